// Process-wide counts of the work behind loom's calls: how often a program
// was generated, compiled, read from a store, loaded as a module, how many
// device allocations, host synchronisations and kernel launches were made,
// and how many channels to and requests of a loom service.
// A steady-state call (its kernel already in memory) changes only
// `launches`; the tests and `bench/host_overhead` read them through
// loom::counters() (C++) and loom.counters() (Python).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom {

enum class Counter : int {
  programs_generated,  // generateKernel runs (the MLIR pipeline)
  programs_compiled,   // NVRTC or the host compiler run (not a cache hit)
  store_reads,         // a compiled program or a decision read from disk or SQLite
  modules_loaded,      // a host program opened (dlopen) or a CUDA module loaded
  device_allocations,  // cuMemAlloc calls
  host_syncs,          // the host waiting on the device (synchronise, a copy back)
  launches,            // kernel grids launched (host tile API, emulator or CUDA)
  service_channels,    // channels opened to a loom service (KernelClient::connect)
  service_requests,    // requests sent to a loom service
};
inline constexpr int kCounterCount = int(Counter::service_requests) + 1;

// Adds `n` to a counter (thread-safe).
void count(Counter counter, int64_t n = 1);

// A snapshot of every counter, by name (the names above), in that order.
std::vector<std::pair<std::string, int64_t>> counters();

}  // namespace loom
