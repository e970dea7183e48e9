#include "autotune/measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>

#include "autotune/cost_model.h"
#include "cuda/case_runner.h"
#include "io/case.h"
#include "io/decode_case.h"
#include "loom/decode.h"
#include "reference/iha_reference.h"

namespace loom::autotune {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kVerifyTokens = 96;       // small enough for the float64 reference
constexpr int64_t kDecodeVerifyTokens = 256;  // a decode step's: key blocks for several splits
constexpr int kInputSets = 2;               // rotated so the cache does not flatter small problems
constexpr double kNoiseFraction = 0.02;     // medians closer than this are ties
constexpr int64_t kDecodePageSize = 16;     // the page size timed decode steps use

}  // namespace

Result<Timing> timeLaunches(Kernel& kernel, const cuda::Device& device, const std::vector<IhaTensors>& inputs,
                            const cuda::DeviceBuffer& flush, const TimingPlan& plan) {
  return timeRuns([&](int run) { return kernel.launch(inputs[size_t(run) % inputs.size()]); }, device, flush, plan);
}

Result<Timing> timeRuns(const std::function<Status(int run)>& launch, const cuda::Device& device,
                        const cuda::DeviceBuffer& flush, const TimingPlan& plan) {
  const cuda::DriverApi& api = device.api();
  CUevent start, stop;
  api.cuEventCreate(&start, CU_EVENT_DEFAULT);
  api.cuEventCreate(&stop, CU_EVENT_DEFAULT);
  std::vector<float> times;
  double spent = 0;
  Status status;
  for (int run = 0; run < plan.warmupRuns + plan.maxRuns; ++run) {
    api.cuMemsetD8(flush.get(), uint8_t(run), flush.size());
    api.cuEventRecord(start, nullptr);
    status = launch(run);
    api.cuEventRecord(stop, nullptr);
    if (!status) break;
    if (status = cuda::check(api.cuEventSynchronize(stop), "timed run"); !status) break;
    float ms = 0;
    api.cuEventElapsedTime(&ms, start, stop);
    if (run < plan.warmupRuns) continue;
    times.push_back(ms);
    spent += ms;
    if (int(times.size()) >= plan.minRuns && spent >= plan.budgetMs) break;
  }
  api.cuEventDestroy(start);
  api.cuEventDestroy(stop);
  if (!status) return status.error();
  std::sort(times.begin(), times.end());
  return Timing{times[times.size() / 2], times[times.size() / 10], times[times.size() * 9 / 10]};
}

const char* outcomeName(Outcome outcome) {
  switch (outcome) {
    case Outcome::pruned: return "pruned";
    case Outcome::skipped: return "skipped";
    case Outcome::compile_failed: return "compile failed";
    case Outcome::slow: return "loses performance";
    case Outcome::wrong: return "wrong result";
    case Outcome::unmeasured: return "ranked";
    case Outcome::timed: return "timed";
  }
  return "?";
}

void rankResults(std::vector<CandidateResult>& results) {
  // Timed, then untimed, then those rejected after compiling (their reasons
  // say most), then the unsampled, then the pruned.
  auto tier = [](const CandidateResult& r) {
    switch (r.outcome) {
      case Outcome::timed: return 0;
      case Outcome::unmeasured: return 1;
      case Outcome::compile_failed:
      case Outcome::slow:
      case Outcome::wrong: return 2;
      case Outcome::skipped: return 3;
      case Outcome::pruned: return 4;
    }
    return 4;
  };
  std::stable_sort(results.begin(), results.end(), [&](const CandidateResult& a, const CandidateResult& b) {
    if (tier(a) != tier(b)) return tier(a) < tier(b);
    if (tier(a) == 0) {
      const double noise = kNoiseFraction * std::min(a.medianMs, b.medianMs);
      if (std::abs(a.medianMs - b.medianMs) > noise) return a.medianMs < b.medianMs;
    }
    if (a.predictedMs != b.predictedMs) return a.predictedMs < b.predictedMs;
    return a.candidate.key < b.candidate.key;
  });
}

Status measure(const KernelSpec& spec, std::shared_ptr<cuda::Device> device, const std::vector<size_t>& which,
               const std::vector<v1::CompiledKernel>& kernels, std::vector<CandidateResult>& results,
               const MeasureOptions& options, TuneProgress& state,
               const std::function<void(const TuneProgress&)>& progress) {
  const Clock::time_point start = Clock::now();
  auto overDeadline = [&] { return std::chrono::duration<double>(Clock::now() - start).count() > options.deadlineSeconds; };
  auto report = [&] {
    if (progress) progress(state);
  };
  const bool backward = options.direction == v1::direction_backward;
  const bool decode = isDecode(options.direction), mixedCache = mixedCacheOf(options.direction);
  const int64_t T = options.newTokens;
  auto decodeLayout = [&](uint64_t seed, bool expected) {
    return DecodeLayout{T, kDecodePageSize, mixedCache ? CacheLayout::mixed : CacheLayout::raw, {}, seed, expected};
  };
  // Trusted result: the float64 reference (forward or backward) on a small
  // fresh case; for a decode step, the forward's rows of its last T tokens.
  const int64_t verifyTokens = decode ? std::max(T + 1, std::min(options.tokens + T, kDecodeVerifyTokens))
                                      : std::min(options.tokens, kVerifyTokens);
  const int64_t documents = spec.varlen() ? 3 : 1;  // a varlen spec's: three documents packed
  const IhaCase verify = backward ? drawCheckableBackwardCase(spec, documents, verifyTokens, options.seed)
                                  : drawCheckableCase(spec, documents, verifyTokens, options.seed);
  std::optional<DecodeCase> verifyStep;
  if (decode) {
    auto step = decodeCaseFrom(verify, decodeLayout(options.seed, true));
    if (!step) return step.error();
    verifyStep = std::move(*step);
  }
  std::vector<cuda::CaseBuffers> buffers;
  std::vector<cuda::GradBuffers> gradBuffers;
  std::vector<cuda::DecodeBuffers> decodeBuffers;
  std::vector<IhaTensors> inputs;
  std::vector<IhaGradTensors> grads;
  for (int set = 0; set < kInputSets; ++set) {
    if (decode) {  // a step over a cache of options.tokens tokens per sequence
      const IhaCase drawn = drawCase(spec, options.batch, options.tokens + T, options.seed + 1 + set);
      auto step = decodeCaseFrom(drawn, decodeLayout(options.seed + 1 + set, false));
      if (!step) return step.error();
      auto uploaded = cuda::DecodeBuffers::upload(*device, *step);
      if (!uploaded) return uploaded.error();
      decodeBuffers.push_back(std::move(*uploaded));
      continue;
    }
    IhaCase drawn = drawCase(spec, options.batch, options.tokens, options.seed + 1 + set);
    if (backward) drawn.dout = drawDout(spec, options.batch, options.tokens, options.seed + 101 + set);
    auto uploaded = cuda::CaseBuffers::upload(*device, drawn);
    if (!uploaded) return uploaded.error();
    buffers.push_back(std::move(*uploaded));
    inputs.push_back(buffers.back().tensors());
    if (backward) {
      auto gradients = cuda::GradBuffers::upload(*device, drawn);
      if (!gradients) return gradients.error();
      gradBuffers.push_back(std::move(*gradients));
      grads.push_back(gradBuffers.back().tensors());
    }
  }
  auto flush = cuda::DeviceBuffer::allocate(*device, kL2FlushBytes);
  if (!flush) return flush.error();

  std::map<size_t, std::shared_ptr<Kernel>> loaded;
  for (size_t i : which) {
    if (kernels[i].binary().empty()) continue;
    CandidateResult& r = results[i];
    auto kernel = Kernel::load(device, kernels[i]);
    if (!kernel) {
      r.outcome = Outcome::compile_failed;
      r.reason = kernel.error().message;
      continue;
    }
    Status ran = Status::success();
    if (backward) {
      auto run = cuda::runBackwardCase(**kernel, *device, verify);
      if (!run) ran = run.error();
      r.error = run ? worstGradientError(spec, verify.tokens, *run, *verify.expectedGradients, verify.inputs.cu_seqlens) : std::nan("");
    } else if (decode) {
      auto run = cuda::runDecodeCase(**kernel, *device, *verifyStep);
      if (!run) ran = run.error();
      r.error = run ? relativeError(run->out, verifyStep->expected) : std::nan("");
    } else {
      auto run = cuda::runCase(**kernel, *device, verify);
      if (!run) ran = run.error();
      r.error = run ? relativeError(run->out, *verify.expected) : std::nan("");
    }
    const double tolerance = backward ? gradientToleranceFor(spec.dtype()) : toleranceFor(spec.dtype());
    if (!ran || !(r.error <= tolerance)) {  // NaN fails too
      r.outcome = Outcome::wrong;
      r.reason = ran ? std::string(backward ? "worst gradient error " : "relative error ") + std::to_string(r.error)
                     : ran.error().message;
      continue;
    }
    ++state.verified;
    loaded[i] = *kernel;
    report();
  }
  // Rounds: everyone once; with halving, the faster half again with twice the budget.
  std::vector<size_t> round;
  for (const auto& entry : loaded) round.push_back(entry.first);
  double budgetMs = options.candidateBudgetMs;
  while (!round.empty()) {
    for (size_t i : round) {
      if (overDeadline() && results[i].outcome == Outcome::timed) continue;
      TimingPlan plan;
      plan.budgetMs = budgetMs;
      Kernel& kernel = *loaded[i];
      auto timing = backward ? timeRuns(
                                   [&](int run) {
                                     const size_t set = size_t(run) % inputs.size();
                                     return kernel.launchBackward(inputs[set], grads[set]);
                                   },
                                   *device, *flush, plan)
                    : decode ? timeRuns(
                                   [&](int run) {
                                     const cuda::DecodeBuffers& step = decodeBuffers[size_t(run) % decodeBuffers.size()];
                                     // The kernel alone: the page table was built valid and is
                                     // not copied back and checked in the timed runs.
                                     return kernel.launchDecode(step.tensors(), step.cache(), nullptr,
                                                                /*checkPages=*/false);
                                   },
                                   *device, *flush, plan)
                             : timeLaunches(kernel, *device, inputs, *flush, plan);
      if (!timing) {
        results[i].outcome = Outcome::wrong;
        results[i].reason = timing.error().message;
        continue;
      }
      results[i].medianMs = timing->medianMs;
      results[i].p10Ms = timing->p10Ms;
      results[i].p90Ms = timing->p90Ms;
      results[i].outcome = Outcome::timed;
      ++state.timed;
      if (state.bestMs == 0 || results[i].medianMs < state.bestMs) {
        state.bestMs = results[i].medianMs;
        state.best = results[i].candidate.key;
      }
      report();
    }
    if (!options.halving || round.size() <= 1 || overDeadline()) break;
    std::sort(round.begin(), round.end(), [&](size_t a, size_t b) { return results[a].medianMs < results[b].medianMs; });
    round.resize(round.size() / 2);
    budgetMs *= 2;
  }

  // Throughput of what was timed: a decode step's useful FLOPs and the
  // cache bytes it must read at least.
  const double flops = backward ? ihaBackwardFlops(spec, options.batch, options.tokens)
                       : decode ? ihaDecodeFlops(spec, options.batch, options.tokens, T)
                                : ihaFlops(spec, options.batch, options.tokens);
  const double bytes = decode ? decodeCacheBytes(spec, options.batch, options.tokens, T, mixedCache)
                              : operandBytes(spec, options.batch, options.tokens);
  for (CandidateResult& r : results)
    if (r.outcome == Outcome::timed) {
      r.tflops = flops / (r.medianMs * 1e-3) / 1e12;
      r.bandwidth = bytes / (r.medianMs * 1e-3);
    }
  return Status::success();
}

}  // namespace loom::autotune
