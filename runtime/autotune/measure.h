// Measurement on the GPU, with no compiler involved: verify candidates
// against a trusted result, time them (warm-up, L2 flush, CUDA events,
// median within a budget, inputs rotated), rank them. Used by the tuner and
// by loom-gpu-tune on precompiled candidates.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autotune/space.h"
#include "cuda/driver.h"
#include "loom/result.h"
#include "loom/runtime.h"

namespace loom::autotune {

// slow: compiled, but ptxas or the PTX shows a performance loss (spills, a
// stack frame, serialised wgmma or another C75xx note, fp64, local memory).
enum class Outcome { pruned, skipped, compile_failed, slow, wrong, unmeasured, timed };
const char* outcomeName(Outcome outcome);

struct CandidateResult {
  Candidate candidate;
  Outcome outcome = Outcome::unmeasured;
  std::string reason;
  double predictedMs = 0;
  double medianMs = 0, p10Ms = 0, p90Ms = 0;
  double tflops = 0;      // useful FLOPs (docs/IHA.md) over the median
  double bandwidth = 0;   // operands moved once over the median, bytes/s
  double error = 0;       // relative error of the verification run
  int registers = 0;
  int64_t spillBytes = 0;
  int64_t sharedMemory = 0;
  double compileSeconds = 0;
  // The compiled forward's attention loops in the SASS (sass.h): per loop,
  // instructions per tensor MFLOP ("m": masked), exponentials in the P V
  // window, "pp" for ping-pong; empty when not read.
  std::string sass;
};

struct TuneProgress {
  int candidates = 0, compiled = 0, verified = 0, timed = 0, emulated = 0;
  std::string best;
  double bestMs = 0;
  bool measured = false;
};

// Orders results: timed (by median, ties within noise broken by the cost
// model's order and then the key), then untimed by prediction, then rejects.
void rankResults(std::vector<CandidateResult>& results);

// How to time a kernel: `warmupRuns` untimed launches, then timed ones
// until `budgetMs` of device time is spent after at least `minRuns` (and at
// most `maxRuns`).
struct TimingPlan {
  int warmupRuns = 2;
  int minRuns = 5;
  int maxRuns = 100;
  double budgetMs = 200;
};

struct Timing {
  double medianMs = 0, p10Ms = 0, p90Ms = 0;
};

// A buffer several times any L2, rewritten before every timed launch.
inline constexpr size_t kL2FlushBytes = size_t(256) << 20;

// The one timing loop (tuner, loom-gpu-bench, loom get): CUDA events around
// each launch, the L2 flushed before each, `inputs` taken in turn so the
// cache does not flatter small problems.
Result<Timing> timeLaunches(Kernel& kernel, const cuda::Device& device, const std::vector<IhaTensors>& inputs,
                            const cuda::DeviceBuffer& flush, const TimingPlan& plan);
// The same loop around any launch sequence (`launch(run)` enqueues run
// number `run` on the default stream): a backward, or a forward and its
// backward together.
Result<Timing> timeRuns(const std::function<Status(int run)>& launch, const cuda::Device& device,
                        const cuda::DeviceBuffer& flush, const TimingPlan& plan);

struct MeasureOptions {
  int64_t batch = 1;
  int64_t tokens = 4096;
  double candidateBudgetMs = 200;  // timing budget per candidate and round
  double deadlineSeconds = 60;     // stop starting new rounds after this (from `start`)
  bool halving = false;            // successive halving: the faster half again, twice the budget
  uint64_t seed = 1;
  // backward: the kernels are backward plans, verified on every gradient
  // against the float64 backward and timed whole by launchBackward.
  // decode (raw or mixed cache): decode steps of `newTokens` new tokens per
  // sequence over a paged cache of `tokens` tokens (pages of 16, shuffled),
  // verified on a short step against the forward's rows and timed by
  // launchDecode.
  v1::Direction direction = v1::direction_forward;
  int64_t newTokens = 1;
};

// Verifies and times `kernels[i]` for every i in `which` (empty binaries are
// skipped), writing outcomes, times, errors and throughput into `results`.
Status measure(const KernelSpec& spec, std::shared_ptr<cuda::Device> device, const std::vector<size_t>& which,
               const std::vector<v1::CompiledKernel>& kernels, std::vector<CandidateResult>& results,
               const MeasureOptions& options, TuneProgress& state,
               const std::function<void(const TuneProgress&)>& progress);

}  // namespace loom::autotune
