// loom's emulator of the CUDA tile programs: the generated sm_80 / sm_90a
// program and the unchanged device tile headers compiled as host C++ (with
// clang's load/store hooks), every CUDA thread a fiber, every PTX leaf
// executed as the PTX ISA defines it, and every run checked for data races,
// out-of-bounds and misaligned accesses, uninitialised shared memory,
// asynchronous results read before their wait, missing proxy fences,
// mbarrier and barrier misuse, divergent collectives and deadlock. A run with
// any finding has failed, whatever its numbers.
//
// `loom run --backend emu` and the tuner without a GPU use it; docs/emulator.md
// says how to debug a kernel with it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "emu/cta.h"
#include "emu/findings.h"
#include "io/case.h"
#include "io/decode_case.h"
#include "loom/compiler.h"
#include "loom/result.h"

namespace loom::emu {

struct EmuOptions {
  std::string cacheDir;  // empty: loom::defaultCacheDir()
  int threads = 0;       // OS threads running CTAs; 0: one per hardware thread
  uint64_t seed = 1;     // chooses the shared window's base and when asynchronous copies land
  // At most this many CTAs of the attention launch (0: all), as whole query
  // blocks (every head and batch entry of each), the first and the last
  // among them; the other launches run whole. Only the covered tokens are
  // computed (EmuRun::covered).
  int64_t maxCtas = 0;
  // Replacements of tile headers by include path, and of the program's
  // source: tests put faults into copies of the device code this way.
  std::map<std::string, std::string> headers;
  std::string source;
  int findingLimit = 50;
  // Registers per thread of each entry point at launch, as ptxas reported
  // them (what setmaxnreg starts from); entries not named take CtaConfig's
  // default.
  std::map<std::string, int> registers;
  // A forward with `keep` also returns what its backward needs (it must run
  // whole: no maxCtas); a backward given `kept` (a forward of the same case
  // kept it) skips its pre-mix and attention launches.
  KeptForward* keep = nullptr;
  const KeptForward* kept = nullptr;
  // A decode plan's step (runDecodeOnEmulator sets it): its cache, page
  // table and lengths; the case is then the step's (N = T).
  const DecodeCase* decode = nullptr;
  // A decode step's page table and lengths checked on the device, as a CUDA
  // launch given an error word does (in its append launch; the host does
  // not check them): EmuRun::pageErrors says what it found.
  bool devicePageCheck = false;
};

struct EmuRun {
  std::vector<double> out;     // [B, N, H, d] read back from the spec's 16-bit dtype
  std::vector<double> lse;     // [B, H, N * P]
  std::vector<bool> covered;   // per token: computed by the emulated CTAs
  Coverage coverage;
  int64_t attentionCtas = 0;   // in the attention launch's grid
  int64_t attentionCtasRun = 0;
  std::vector<Finding> findings;  // symbolized; repeats of one call site folded
  int64_t findingCount = 0;       // with repeats
  bool deadlocked = false;
  bool compiled = false;  // false: the program came from the cache
  double compileSeconds = 0, runSeconds = 0;
  // A backward plan's gradients of sum(out * dout) (float32, widened).
  std::optional<reference::IhaGradients> gradients;
  // A decode plan's cache after the step (read back from the dtype).
  std::optional<reference::PagedCache> cache;
  // With devicePageCheck: the error word (1 if a sequence was refused) and
  // each sequence's verdict (1 checked, 0 refused).
  int32_t pageErrors = 0;
  std::vector<int32_t> sequenceOk;
};

// Compiles (or finds in the cache) the plan's CUDA program for the
// emulator and runs every launch of it on the case's inputs (rounded to the
// spec's 16-bit dtype, as a GPU would take them). A backward plan takes
// c.dout too and fills EmuRun::gradients (maxCtas must be 0: every launch
// of the backward reads what the earlier ones wrote everywhere). The plan must target a
// CUDA arch; the emulator needs clang (LOOM_EMU_CXX, else clang++-19).
Result<EmuRun> runOnEmulator(const KernelPlan& plan, const IhaCase& c, const EmuOptions& options = {});

// A decode plan (Direction::decode, a raw cache) on a decode step: the
// cache, page table and lengths laid out beside the step's tensors, out
// [B, T, H, d], lse [B, H, T*P] and the cache after the append read back.
Result<EmuRun> runDecodeOnEmulator(const KernelPlan& plan, const DecodeCase& step, const EmuOptions& options = {});

// The relative error of the covered tokens of `out` against `expected`
// ([B, N, H, d] both).
double coveredRelativeError(const EmuRun& run, const std::vector<double>& expected, int64_t batch, int64_t tokens,
                            int64_t heads, int64_t headDim);

// A report of the run: coverage, timings, findings (one per line).
std::string summary(const EmuRun& run);

}  // namespace loom::emu
