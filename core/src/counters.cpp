#include "loom/counters.h"

#include <array>
#include <atomic>

namespace loom {
namespace {

std::array<std::atomic<int64_t>, kCounterCount> values{};

constexpr const char* kNames[kCounterCount] = {"programs_generated", "programs_compiled", "store_reads",
                                                 "modules_loaded",     "device_allocations", "host_syncs",
                                                 "launches",           "service_channels",   "service_requests"};

}  // namespace

void count(Counter counter, int64_t n) { values[size_t(counter)].fetch_add(n, std::memory_order_relaxed); }

std::vector<std::pair<std::string, int64_t>> counters() {
  std::vector<std::pair<std::string, int64_t>> snapshot;
  snapshot.reserve(kCounterCount);
  for (int i = 0; i < kCounterCount; ++i) snapshot.emplace_back(kNames[i], values[size_t(i)].load());
  return snapshot;
}

}  // namespace loom
