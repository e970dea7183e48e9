// Heartbeat: calls `beat` every `period` on a thread of its own until it is
// destroyed (which wakes the thread and joins it at once). What keeps a
// lease while the work it covers runs: the provider's compile lease, a
// pre-tuning worker's tuning lease.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace loom {

class Heartbeat {
 public:
  Heartbeat(std::chrono::milliseconds period, std::function<void()> beat)
      : thread_([this, period, beat = std::move(beat)] {
          std::unique_lock lock(mutex_);
          while (!stopped_.wait_for(lock, period, [this] { return stop_; })) beat();
        }) {}
  ~Heartbeat() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    stopped_.notify_all();
    thread_.join();
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable stopped_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members it reads exist
};

}  // namespace loom
