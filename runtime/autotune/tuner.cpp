#include "autotune/tuner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "api/compile.h"
#include "cuda/case_runner.h"
#include "cuda/driver.h"
#include "io/case.h"
#include "reference/iha_reference.h"

namespace loom::autotune {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kVerifyTokens = 96;       // small enough for the float64 reference
constexpr int kWarmupRuns = 2;
constexpr int kMinTimedRuns = 5;
constexpr int kMaxTimedRuns = 100;
constexpr int kInputSets = 2;               // rotated so the cache does not flatter small problems
constexpr size_t kL2FlushBytes = size_t(256) << 20;
constexpr double kNoiseFraction = 0.02;     // medians closer than this are ties

double secondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Compiles candidates on a pool of threads; results land in `results`.
void compileAll(const KernelSpec& spec, const v1::Target& target, const std::vector<size_t>& which,
                std::vector<CandidateResult>& results, std::vector<v1::CompiledKernel>& kernels,
                jit::NvrtcCompiler& compiler, const TuneOptions& options, Clock::time_point start,
                const std::function<void()>& onCompiled) {
  std::atomic<size_t> next{0};
  std::mutex mutex;
  auto worker = [&] {
    for (size_t i = next++; i < which.size(); i = next++) {
      CandidateResult& r = results[which[i]];
      if (secondsSince(start) > options.budgetSeconds) {
        r.outcome = Outcome::skipped;
        r.reason = "not compiled: the time budget ran out";
        continue;
      }
      std::shared_ptr<const jit::Artifact> artifact;
      auto compiled = compileKernel(spec, r.candidate.schedule, target, compiler, &artifact);
      std::lock_guard lock(mutex);
      if (!compiled) {
        r.outcome = Outcome::compile_failed;
        r.reason = compiled.error().message;
      } else {
        r.compileSeconds = artifact->compileSeconds;
        r.spillBytes = artifact->spillBytes();
        for (const auto& usage : artifact->resources) r.registers = std::max(r.registers, usage.registers());
        for (const auto& entry : compiled->entries()) r.sharedMemory = std::max(r.sharedMemory, entry.shared_memory_bytes());
        if (r.spillBytes > 0) {
          r.outcome = Outcome::spilled;
          r.reason = "spills " + std::to_string(r.spillBytes) + " bytes";
        } else {
          kernels[which[i]] = *compiled;
        }
      }
      onCompiled();
    }
  };
  const int threads = options.compileThreads > 0 ? options.compileThreads : int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& thread : pool) thread.join();
}

// Times one kernel on rotating input sets with the L2 flushed before each
// run; stops after `budgetMs` of device time (at least kMinTimedRuns runs).
Status timeKernel(Kernel& kernel, const cuda::Device& device, const std::vector<cuda::CaseBuffers>& inputs,
                  const cuda::DeviceBuffer& flush, double budgetMs, CandidateResult& r) {
  const cuda::DriverApi& api = device.api();
  CUevent start, stop;
  api.cuEventCreate(&start, CU_EVENT_DEFAULT);
  api.cuEventCreate(&stop, CU_EVENT_DEFAULT);
  std::vector<float> times;
  double spent = 0;
  Status status;
  for (int run = 0; run < kWarmupRuns + kMaxTimedRuns; ++run) {
    api.cuMemsetD8(flush.get(), uint8_t(run), flush.size());
    api.cuEventRecord(start, nullptr);
    status = kernel.launch(inputs[size_t(run) % inputs.size()].tensors());
    api.cuEventRecord(stop, nullptr);
    if (!status) break;
    if (status = cuda::check(api.cuEventSynchronize(stop), "timed run"); !status) break;
    float ms = 0;
    api.cuEventElapsedTime(&ms, start, stop);
    if (run < kWarmupRuns) continue;
    times.push_back(ms);
    spent += ms;
    if (int(times.size()) >= kMinTimedRuns && spent >= budgetMs) break;
  }
  api.cuEventDestroy(start);
  api.cuEventDestroy(stop);
  if (!status) return status;
  std::sort(times.begin(), times.end());
  r.medianMs = times[times.size() / 2];
  r.p10Ms = times[times.size() / 10];
  r.p90Ms = times[times.size() * 9 / 10];
  r.outcome = Outcome::timed;
  return Status::success();
}

}  // namespace

const char* outcomeName(Outcome outcome) {
  switch (outcome) {
    case Outcome::pruned: return "pruned";
    case Outcome::skipped: return "skipped";
    case Outcome::compile_failed: return "compile failed";
    case Outcome::spilled: return "spilled";
    case Outcome::wrong: return "wrong result";
    case Outcome::unmeasured: return "ranked";
    case Outcome::timed: return "timed";
  }
  return "?";
}

Result<Strategy> parseStrategy(const std::string& name) {
  if (name == "auto" || name == "automatic") return Strategy::automatic;
  if (name == "exhaustive") return Strategy::exhaustive;
  if (name == "random") return Strategy::random;
  if (name == "halving") return Strategy::halving;
  return makeError("strategy '" + name + "' is not auto, exhaustive, random or halving");
}

void rankResults(std::vector<CandidateResult>& results) {
  auto tier = [](const CandidateResult& r) {
    return r.outcome == Outcome::timed ? 0 : r.outcome == Outcome::unmeasured ? 1 : 2;
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

Result<TuneReport> tune(const KernelSpec& spec, const v1::Target& target, Runtime* runtime, const TuneOptions& options,
                        const std::function<void(const TuneProgress&)>& progress) {
  if (Status valid = validateSpec(spec); !valid) return valid.error();
  if (target.kind() != v1::Target::cuda) return makeError("tuning needs a CUDA target (sm_80, sm_90a, ...)");
  const Clock::time_point start = Clock::now();
  const bool measured = runtime != nullptr;

  // Space and prediction.
  SearchSpace space = searchSpace(spec, target);
  std::vector<CandidateResult> results;
  for (const Candidate& c : space.candidates) {
    CandidateResult r;
    r.candidate = c;
    r.predictedMs = estimateCost(spec, c.schedule, target, options.batch, options.tokens).seconds * 1e3;
    results.push_back(r);
  }
  rankResults(results);  // by prediction

  // Which candidates to compile.
  std::vector<size_t> chosen;
  Strategy strategy = options.strategy;
  if (strategy == Strategy::automatic)
    strategy = int(results.size()) <= options.exhaustiveLimit ? Strategy::exhaustive : Strategy::halving;
  const size_t limit = !measured ? size_t(options.offlineCompiles)
                       : strategy == Strategy::exhaustive ? results.size()
                                                          : size_t(options.sampleSize);
  if (strategy == Strategy::random && measured) {
    std::mt19937_64 rng(options.seed);
    std::vector<size_t> order(results.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin() + 1, order.end(), rng);  // keep the best-predicted one
    order.resize(std::min(limit, order.size()));
    std::sort(order.begin(), order.end());
    chosen = order;
  } else {
    for (size_t i = 0; i < std::min(limit, results.size()); ++i) chosen.push_back(i);
  }

  TuneProgress state;
  state.candidates = int(chosen.size());
  state.measured = measured;
  auto report = [&] {
    if (progress) progress(state);
  };
  jit::NvrtcCompiler compiler(options.cacheDir);
  std::vector<v1::CompiledKernel> kernels(results.size());
  compileAll(spec, target, chosen, results, kernels, compiler, options, start, [&] {
    ++state.compiled;
    report();
  });

  {
    std::vector<bool> isChosen(results.size(), false);
    for (size_t i : chosen) isChosen[i] = true;
    for (size_t i = 0; i < results.size(); ++i)
      if (!isChosen[i]) {
        results[i].outcome = Outcome::skipped;
        results[i].reason = measured ? "not sampled by the " + std::string(strategy == Strategy::random ? "random" : "halving") + " strategy"
                                     : "not compiled: ranked below the top " + std::to_string(options.offlineCompiles);
      }
  }

  if (measured) {
    auto device = cuda::Device::open(runtime->device().ordinal);
    if (!device) return device.error();
    // Trusted result: the float64 reference on a small fresh case.
    const IhaCase verify = drawCase(spec, 1, std::min(options.tokens, kVerifyTokens), options.seed);
    const std::vector<double> trusted = reference::ihaForward(spec, verify.inputs).out;
    std::vector<cuda::CaseBuffers> inputs;
    for (int set = 0; set < kInputSets; ++set) {
      auto buffers = cuda::CaseBuffers::upload(**device, drawCase(spec, options.batch, options.tokens, options.seed + 1 + set));
      if (!buffers) return buffers.error();
      inputs.push_back(std::move(*buffers));
    }
    auto flush = cuda::DeviceBuffer::allocate(**device, kL2FlushBytes);
    if (!flush) return flush.error();

    std::map<size_t, std::shared_ptr<Kernel>> loaded;
    for (size_t i : chosen) {
      if (kernels[i].binary().empty()) continue;
      CandidateResult& r = results[i];
      auto kernel = runtime->load(kernels[i]);
      if (!kernel) {
        r.outcome = Outcome::compile_failed;
        r.reason = kernel.error().message;
        continue;
      }
      auto run = cuda::runCase(**kernel, **device, verify);
      r.error = run ? relativeError(run->out, trusted) : std::nan("");
      if (!run || !(r.error <= toleranceFor(spec.dtype()))) {  // NaN fails too
        r.outcome = Outcome::wrong;
        r.reason = run ? "relative error " + std::to_string(r.error) : run.error().message;
        continue;
      }
      ++state.verified;
      loaded[i] = *kernel;
      report();
    }
    // Rounds: everyone once; with halving, the faster half again with twice the budget.
    std::vector<size_t> round;
    for (const auto& [i, kernel] : loaded) round.push_back(i);
    double budgetMs = options.candidateBudgetMs;
    while (!round.empty()) {
      for (size_t i : round) {
        if (secondsSince(start) > options.budgetSeconds && results[i].outcome == Outcome::timed) continue;
        if (Status ok = timeKernel(*loaded[i], **device, inputs, *flush, budgetMs, results[i]); !ok) {
          results[i].outcome = Outcome::wrong;
          results[i].reason = ok.error().message;
          continue;
        }
        ++state.timed;
        if (state.bestMs == 0 || results[i].medianMs < state.bestMs) {
          state.bestMs = results[i].medianMs;
          state.best = results[i].candidate.key;
        }
        report();
      }
      if (strategy != Strategy::halving || round.size() <= 1 || secondsSince(start) > options.budgetSeconds) break;
      std::sort(round.begin(), round.end(), [&](size_t a, size_t b) { return results[a].medianMs < results[b].medianMs; });
      round.resize(round.size() / 2);
      budgetMs *= 2;
    }
  }

  // Throughput of what was timed.
  const double flops = 4.0 * double(options.batch * spec.heads()) * spec.head_dim() * allowedPairs(spec, options.tokens);
  const double bytes = 2.0 * double(options.batch) * options.tokens * (2 * spec.heads() + 2 * spec.kv_heads()) * spec.head_dim();
  for (CandidateResult& r : results)
    if (r.outcome == Outcome::timed) {
      r.tflops = flops / (r.medianMs * 1e-3) / 1e12;
      r.bandwidth = bytes / (r.medianMs * 1e-3);
    }
  for (const Pruned& p : space.pruned) {
    CandidateResult r;
    r.candidate = {p.schedule, p.key};
    r.outcome = Outcome::pruned;
    r.reason = p.reason;
    results.push_back(r);
  }
  rankResults(results);

  TuneReport out;
  out.candidates = results;
  out.pruned = int(space.pruned.size());
  const CandidateResult& best = results.front();
  if (best.outcome != Outcome::timed && best.outcome != Outcome::unmeasured)
    return makeError("no candidate survived: the best was rejected (" + best.reason + ")");
  v1::TuningResult& r = out.result;
  *r.mutable_spec() = spec;
  *r.mutable_target() = target;
  *r.mutable_best() = best.candidate.schedule;
  r.set_measured(best.outcome == Outcome::timed);
  r.set_median_ms(best.outcome == Outcome::timed ? best.medianMs : best.predictedMs);
  r.set_tflops(best.tflops);
  r.set_toolchain(jit::nvrtcVersion());
  int tried = 0, rejected = 0;
  for (const CandidateResult& c : results) {
    tried += c.outcome != Outcome::pruned && c.outcome != Outcome::skipped;
    rejected += c.outcome == Outcome::compile_failed || c.outcome == Outcome::spilled || c.outcome == Outcome::wrong;
  }
  r.set_candidates_tried(tried);
  r.set_candidates_rejected(rejected);
  return out;
}

}  // namespace loom::autotune
