// The CPU backend: compiles a kernel plan's source against the host tile API
// with the system C++ compiler into a shared object (cached by content
// hash, so a second run compiles nothing), loads it, and runs each launch's
// grid CTA by CTA on a few threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/case.h"
#include "io/decode_case.h"
#include "loom/compiler.h"
#include "loom/result.h"

namespace loom::cpu {

struct CpuOptions {
  std::string cacheDir;  // empty: loom::defaultCacheDir()
  int threads = 0;       // 0: one per hardware thread
};

// What one run did, counted by the host tile API.
struct CpuRunStats {
  int64_t keyBlocks = 0;     // key blocks multiplied, over all CTAs
  int64_t maskedBlocks = 0;  // of those, blocks masked element-wise
  int64_t attentionCtas = 0;
  bool compiled = false;     // false: the shared object came from the cache
  double compileSeconds = 0;
};

struct CpuOutputs {
  std::vector<double> out;  // [B, N, H, d], read back from the spec's dtype
  std::vector<double> lse;  // [B, H, N*P]
  CpuRunStats stats;
};

// Compiles (or finds in the cache) and runs `plan` on the case's inputs;
// with `keep`, also what its backward needs (canKeepForward says which
// plans can).
Result<CpuOutputs> runPlan(const KernelPlan& plan, const IhaCase& c, const CpuOptions& options = {},
                           KeptForward* keep = nullptr);

struct CpuGradients {
  reference::IhaGradients gradients;  // float32 results, widened
  std::vector<double> lse;            // [B, H, N*P], the forward's, recomputed
  CpuRunStats stats;
};

// The same for a backward plan (generateKernel with Direction::backward):
// every gradient of sum(out * c.dout). Given what a forward of the same
// case kept, it starts from there (no pre-mix, no attention).
Result<CpuGradients> runBackwardPlan(const KernelPlan& plan, const IhaCase& c, const CpuOptions& options = {},
                                     const KeptForward* kept = nullptr);

struct CpuDecodeOutputs {
  std::vector<double> out;      // [B, T, H, d], read back from the spec's dtype
  std::vector<double> lse;      // [B, H, T*P]
  reference::PagedCache cache;  // after the step's append, read back from the dtype
  CpuRunStats stats;
};

// Whether `plan` is a decode plan for the step's cache layout, and the step's
// page table and lengths pass validateDecode (the CPU backend and the
// emulator check this before they lay anything out); without `entries`,
// only that they hold B x max_pages and B entries (the device checks the
// rest: EmuOptions::devicePageCheck).
Status checkDecodeStep(const KernelPlan& plan, const DecodeCase& step, bool entries = true);

// A decode plan (generateKernel with Direction::decode, the case's cache
// layout) on a decode step: the cache, q, k and v in the spec's dtype, out
// and the workspaces poisoned with NaN.
Result<CpuDecodeOutputs> runDecodePlan(const KernelPlan& plan, const DecodeCase& step, const CpuOptions& options = {});

}  // namespace loom::cpu
