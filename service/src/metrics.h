// Counters the service exports in the Prometheus text format.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace loom::service {

class Metrics {
 public:
  void request(const std::string& method, const std::string& code) {
    std::lock_guard lock(mutex_);
    ++requests_[method + "\",code=\"" + code];
  }
  void compileSeconds(double seconds) {
    std::lock_guard lock(mutex_);
    compileSecondsSum_ += seconds;
    ++compileCount_;
  }
  // The provider's own counts: compiles run (identical misses count once)
  // and compiles running now.
  void setCounters(std::function<int64_t()> compiles, std::function<int64_t()> compilesInFlight) {
    std::lock_guard lock(mutex_);
    compiles_ = std::move(compiles);
    compilesInFlight_ = std::move(compilesInFlight);
  }
  std::atomic<int64_t> cacheHits{0}, cacheMisses{0}, tunes{0};
  std::atomic<int64_t> rankings{0};  // cost-model rankings run (not those read back from the store)

  std::string text() {
    std::lock_guard lock(mutex_);
    std::string out = "# TYPE loom_requests_total counter\n";
    for (const auto& [labels, count] : requests_)
      out += "loom_requests_total{method=\"" + labels + "\"} " + std::to_string(count) + "\n";
    out += "# TYPE loom_cache_hits_total counter\nloom_cache_hits_total " + std::to_string(cacheHits) + "\n";
    out += "# TYPE loom_cache_misses_total counter\nloom_cache_misses_total " + std::to_string(cacheMisses) + "\n";
    out += "# TYPE loom_tunes_total counter\nloom_tunes_total " + std::to_string(tunes) + "\n";
    out += "# TYPE loom_rankings_total counter\nloom_rankings_total " + std::to_string(rankings) + "\n";
    out += "# TYPE loom_compiles_total counter\nloom_compiles_total " +
           std::to_string(compiles_ ? compiles_() : 0) + "\n";
    out += "# TYPE loom_compiles_in_flight gauge\nloom_compiles_in_flight " +
           std::to_string(compilesInFlight_ ? compilesInFlight_() : 0) + "\n";
    out += "# TYPE loom_compile_seconds summary\nloom_compile_seconds_sum " + std::to_string(compileSecondsSum_) +
           "\nloom_compile_seconds_count " + std::to_string(compileCount_) + "\n";
    return out;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, int64_t> requests_;
  std::function<int64_t()> compiles_, compilesInFlight_;
  double compileSecondsSum_ = 0;
  int64_t compileCount_ = 0;
};

}  // namespace loom::service
