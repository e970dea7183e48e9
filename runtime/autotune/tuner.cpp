#include "autotune/tuner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "api/compile.h"
#include "jit/sass.h"
#include "emu/emulator.h"
#include "io/decode_case.h"
#include "loom/compiler.h"
#include "reference/iha_reference.h"

namespace loom::autotune {
namespace {

using Clock = std::chrono::steady_clock;

// Offline, how many further compiles (times those asked for) may replace
// candidates that failed or lost performance.
constexpr size_t kBackfillFactor = 3;

double secondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Runs work(i) for every i in [0, count) on the tuner's threads (the
// caller's among them); done() follows each that returns true, one at a time
// (progress).
void onThreads(const TuneOptions& options, size_t count, const std::function<bool(size_t)>& work,
               const std::function<void()>& done) {
  std::atomic<size_t> next{0};
  std::mutex mutex;
  auto worker = [&] {
    for (size_t i = next++; i < count; i = next++) {
      if (!work(i)) continue;
      std::lock_guard lock(mutex);
      done();
    }
  };
  const int threads =
      options.compileThreads > 0 ? options.compileThreads : int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& thread : pool) thread.join();
}

// The cost model of the tuned direction.
CostEstimate predict(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target, int64_t batch,
                     int64_t tokens, Direction direction, bool mixedCache, int64_t newTokens,
                     std::optional<int> registers = std::nullopt,
                     const std::optional<LoopIssue>& issue = std::nullopt,
                     const std::optional<BackwardIssue>& backwardIssue = std::nullopt) {
  switch (direction) {
    case Direction::backward:
      return estimateBackwardCost(spec, schedule, target, batch, tokens, registers, backwardIssue);
    case Direction::decode:
      return estimateDecodeCost(spec, schedule, target, batch, tokens, newTokens, mixedCache, registers);
    case Direction::forward: break;
  }
  return estimateCost(spec, schedule, target, batch, tokens, registers, issue);
}

// Compiles candidates on the tuner's threads; results land in `results`
// (each worker writes only its own candidates' entries).
void compileAll(const KernelSpec& spec, const v1::Target& target, const std::vector<size_t>& which,
                std::vector<CandidateResult>& results, std::vector<v1::CompiledKernel>& kernels,
                jit::NvrtcCompiler& compiler, const TuneOptions& options, Clock::time_point start,
                const std::function<void()>& onCompiled) {
  onThreads(options, which.size(), [&](size_t i) {
    CandidateResult& r = results[which[i]];
    if (secondsSince(start) > options.budgetSeconds) {
      r.outcome = Outcome::skipped;
      r.reason = "not compiled: the time budget ran out";
      return false;
    }
    std::shared_ptr<const jit::Artifact> artifact;
    const bool backward = options.direction == Direction::backward;
    auto compiled = compileKernel(spec, r.candidate.schedule, target, compiler, &artifact, options.direction,
                                  options.mixedCache);
    if (!compiled) {
      r.outcome = Outcome::compile_failed;
      r.reason = compiled.error().message;
    } else {
      r.compileSeconds = artifact->compileSeconds;
      r.spillBytes = artifact->spillBytes();
      for (const auto& usage : artifact->resources) r.registers = std::max(r.registers, usage.registers());
      for (const auto& entry : compiled->entries()) r.sharedMemory = std::max(r.sharedMemory, entry.shared_memory_bytes());
      // The prediction again with ptxas's registers in place of the
      // estimate: occupancy as the compiled kernel will really have it.
      const int attentionRegisters =
          jit::registersOf(artifact->resources, backward ? kBackwardKvEntry : kAttentionEntry);
      // And the machine code's loop (sass.h) in place of the assumed
      // softmax overlap, for the forward's wgmma kernels.
      std::optional<LoopIssue> issue;
      for (const v1::ResourceUsage& usage : artifact->resources)
        if (usage.entry() == kAttentionEntry && options.direction == Direction::forward) {
          issue = loopIssueOf(usage);
          r.sass = jit::sass::loopsBrief(usage);
        }
      // The wgmma backward's two loops likewise.
      std::optional<BackwardIssue> backwardIssue;
      if (backward && r.candidate.schedule.engine() == v1::engine_wgmma) {
        std::optional<LoopIssue> kv, q;
        for (const v1::ResourceUsage& usage : artifact->resources) {
          if (usage.entry() == kBackwardKvEntry) {
            kv = loopIssueOf(usage);
            r.sass = jit::sass::loopsBrief(usage);
          }
          if (usage.entry() == kBackwardQEntry) q = loopIssueOf(usage);
        }
        if (kv && q) backwardIssue = BackwardIssue{*kv, *q};
      }
      if (attentionRegisters > 0)
        r.predictedMs = predict(spec, r.candidate.schedule, target, options.batch, options.tokens, options.direction,
                                options.mixedCache, options.newTokens, attentionRegisters, issue, backwardIssue)
                            .seconds *
                        1e3;
      // A kernel that ptxas or its PTX shows losing speed is no candidate.
      const std::vector<std::string> losses = artifact->performanceLosses();
      if (!losses.empty()) {
        r.outcome = Outcome::slow;
        r.reason = losses.front();
        for (size_t k = 1; k < losses.size(); ++k) r.reason += "; " + losses[k];
      } else {
        kernels[which[i]] = *compiled;
      }
    }
    return true;
  }, onCompiled);
}

// Without a GPU: every compiled candidate runs on the emulator on a small
// drawn case (enough tokens for three key blocks, the last one cut short;
// the first and last query blocks of every head): a finding or an output
// over the dtype's tolerance rejects it, with the reason.
void emulateAll(const KernelSpec& spec, const v1::Target& target, const std::vector<size_t>& which,
                std::vector<CandidateResult>& results, const std::vector<v1::CompiledKernel>& kernels,
                const TuneOptions& options, const std::function<void()>& onEmulated) {
  std::vector<size_t> compiled;
  for (size_t at : which)
    if (!kernels[at].binary().empty()) compiled.push_back(at);
  onThreads(options, compiled.size(), [&](size_t i) {
    const size_t at = compiled[i];
    CandidateResult& r = results[at];
    const Schedule& schedule = r.candidate.schedule;
    GenerateOptions generate;
    generate.direction = options.direction;
    generate.mixedCache = options.mixedCache;
    auto plan = generateKernel(spec, schedule, target, generate);
    std::string verdict;
    bool wrong = false;
    // One emulated CTA thread at a time (the candidates run in parallel), the
    // compiled kernel's registers, at most `maxCtas` CTAs of the attention.
    auto emulatorOptions = [&](int64_t maxCtas) {
      emu::EmuOptions emuOptions;
      emuOptions.cacheDir = options.cacheDir;
      emuOptions.threads = 1;
      emuOptions.seed = options.seed + at;
      emuOptions.maxCtas = maxCtas;
      emuOptions.headers = options.emulatorHeaders;
      for (const v1::ResourceUsage& usage : kernels[at].resources())
        emuOptions.registers[usage.entry()] = usage.registers();
      return emuOptions;
    };
    // Whether the run came back without a finding; the verdict says why not.
    auto ranClean = [&](const Result<emu::EmuRun>& run) {
      if (!run) {
        verdict = "not checked on the emulator: " + run.error().message;
        return false;
      }
      if (run->findingCount > 0 || run->deadlocked) {
        wrong = true;
        verdict = "emulator: " + (run->findings.empty() ? std::string("deadlock") : emu::format(run->findings.front()));
        return false;
      }
      return true;
    };
    if (!plan) {
      wrong = true;
      verdict = plan.error().message;
    } else if (options.direction == Direction::decode) {
      // A step of one new token over a cache of the drawn case's other
      // tokens: enough for three key blocks per split, the last cut short,
      // pages of 16 tokens under a shuffled table.
      const int64_t P = spec.pseudo_heads(), splits = std::max(1, schedule.kv_splits());
      const int64_t tokens = std::min<int64_t>(256, (3 * splits * schedule.block_n() + P - 1) / P + 2);
      const IhaCase c = drawCheckableCase(spec, 1, tokens, options.seed + at);
      auto step = decodeCaseFrom(c, {1, 16, options.mixedCache ? CacheLayout::mixed : CacheLayout::raw, {},
                                     options.seed + at});
      auto run = step ? emu::runDecodeOnEmulator(*plan, *step, emulatorOptions(0)) : Result<emu::EmuRun>(step.error());
      if (ranClean(run)) {
        const double error = relativeError(run->out, step->expected);
        char text[160];
        std::snprintf(text, sizeof text, "emulator: decode step's relative error %.2e over a cache of %lld tokens",
                      error, (long long)(tokens - 1));
        verdict = text;
        wrong = !(error <= toleranceFor(spec.dtype()));
        if (!wrong) r.error = error;
      }
    } else {
      // A small case: enough tokens for three key blocks, the last cut
      // short. The forward runs the first and last query blocks of every
      // head; the backward runs whole (each launch reads the others').
      const bool backward = options.direction == Direction::backward;
      const int64_t P = spec.pseudo_heads();
      const int64_t tokens = std::min<int64_t>(backward ? 128 : 256, (3 * schedule.block_n() + P - 1) / P + 1);
      // A varlen spec's case packs three documents (one of them a single token).
      const int64_t batch = spec.varlen() ? 3 : 1;
      const IhaCase c = backward ? drawCheckableBackwardCase(spec, batch, tokens, options.seed + at)
                                 : drawCheckableCase(spec, batch, tokens, options.seed + at);
      auto run = emu::runOnEmulator(*plan, c, emulatorOptions(backward ? 0 : 2 * spec.heads()));
      if (ranClean(run)) {
        double error = 0;
        if (backward) {
          error = worstGradientError(spec, c.tokens, *run->gradients, *c.expectedGradients, c.inputs.cu_seqlens);
        } else {
          error = emu::coveredRelativeError(*run, *c.expected, c.batch, c.tokens, spec.heads(), spec.head_dim());
        }
        char text[160];
        std::snprintf(text, sizeof text, "emulator: %s %.2e on N=%lld",
                      backward ? "worst gradient error" : "relative error", error, (long long)tokens);
        verdict = text;
        wrong = !(error <= (backward ? gradientToleranceFor(spec.dtype()) : toleranceFor(spec.dtype())));
        if (!wrong) r.error = error;
      }
    }
    if (wrong) r.outcome = Outcome::wrong;
    r.reason = verdict;
    return true;
  }, onEmulated);
}

}  // namespace

const v1::CompiledKernel* winnerOf(const TuneReport& report, const std::vector<v1::CompiledKernel>& compiled) {
  const std::string best = report.result.best().SerializeAsString();
  for (const v1::CompiledKernel& kernel : compiled)
    if (!kernel.binary().empty() && kernel.schedule().SerializeAsString() == best) return &kernel;
  return nullptr;
}

Result<std::string> storeTuning(cache::KernelStore& store, const KernelSpec& spec, const v1::Target& target,
                                const TuneReport& report, const std::vector<v1::CompiledKernel>& compiled,
                                const std::string& candidatesJson) {
  cache::Decision decision;
  decision.spec = spec;
  decision.device = cache::DeviceModel::of(target);
  decision.toolchain = report.result.toolchain();
  decision.result = report.result;
  decision.candidatesJson = candidatesJson;
  if (const v1::CompiledKernel* winner = winnerOf(report, compiled)) {
    if (Status ok = store.putArtifact(*winner); !ok) return ok.error();
    decision.artifactKey = cache::artifactKey(*winner);
  }
  if (Status ok = store.putDecision(decision); !ok) return ok.error();
  return decision.artifactKey;
}

Result<Strategy> parseStrategy(const std::string& name) {
  if (name == "auto" || name == "automatic") return Strategy::automatic;
  if (name == "exhaustive") return Strategy::exhaustive;
  if (name == "random") return Strategy::random;
  if (name == "halving") return Strategy::halving;
  return makeError("strategy '" + name + "' is not auto, exhaustive, random or halving");
}

std::vector<CandidateResult> rankByModel(const KernelSpec& spec, const v1::Target& target, const SearchSpace& space,
                                        int64_t batch, int64_t tokens, Direction direction, bool mixedCache,
                                        int64_t newTokens) {
  std::vector<CandidateResult> results;
  for (const Candidate& c : space.candidates) {
    CandidateResult r;
    r.candidate = c;
    r.predictedMs = predict(spec, c.schedule, target, batch, tokens, direction, mixedCache, newTokens).seconds * 1e3;
    results.push_back(r);
  }
  rankResults(results);
  return results;
}

Result<TuneReport> tune(const KernelSpec& spec, const v1::Target& target, std::shared_ptr<cuda::Device> device,
                        const TuneOptions& options, const std::function<void(const TuneProgress&)>& progress,
                        std::vector<v1::CompiledKernel>* compiledOut) {
  if (Status valid = validateSpec(spec); !valid) return valid.error();
  if (target.kind() != v1::Target::cuda) return makeError("tuning needs a CUDA target (sm_80, sm_90a, ...)");
  const Clock::time_point start = Clock::now();
  const bool backward = options.direction == Direction::backward;
  const bool decode = options.direction == Direction::decode;
  const bool measured = device != nullptr;
  if (decode && options.newTokens < 1) return makeError("a decode step has at least one new token per sequence");

  // Space and prediction.
  SearchSpace space = backward ? backwardSearchSpace(spec, target)
                      : decode ? decodeSearchSpace(spec, target, options.mixedCache)
                               : searchSpace(spec, target);
  std::vector<CandidateResult> results = rankByModel(spec, target, space, options.batch, options.tokens,
                                                     options.direction, options.mixedCache, options.newTokens);

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
  } else if (limit >= results.size()) {
    for (size_t i = 0; i < results.size(); ++i) chosen.push_back(i);
  } else {
    // The best-predicted candidate of each tile shape first (the model's
    // near-ties should not crowd out shapes it cannot tell apart), then the
    // rest in predicted order.
    std::set<std::string> shapes;
    std::vector<bool> taken(results.size(), false);
    for (size_t i = 0; i < results.size() && chosen.size() < limit; ++i) {
      const Schedule& s = results[i].candidate.schedule;
      const std::string shape = std::to_string(s.block_m()) + "/" + std::to_string(s.block_n()) + "/" +
                                std::to_string(s.warps()) + "/" + std::to_string(int(s.mix())) + "/" +
                                std::to_string(s.kv_splits()) + (s.stack_heads() ? "/stacked" : "");
      if (shapes.insert(shape).second) {
        chosen.push_back(i);
        taken[i] = true;
      }
    }
    for (size_t i = 0; i < results.size() && chosen.size() < limit; ++i)
      if (!taken[i]) chosen.push_back(i);
    std::sort(chosen.begin(), chosen.end());
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
  // Offline, a candidate whose compile fails or loses performance is
  // replaced by the next in predicted order (at most kBackfillFactor times
  // the compiles asked for), so the ranking offers `offlineCompiles` clean
  // kernels wherever the space holds them.
  if (!measured) {
    std::vector<bool> isChosen(results.size(), false);
    for (size_t i : chosen) isChosen[i] = true;
    size_t next = 0, extra = 0;
    const size_t extraLimit = kBackfillFactor * limit;
    while (extra < extraLimit) {
      size_t clean = 0;
      for (size_t i : chosen) clean += !kernels[i].binary().empty();
      if (clean >= limit) break;
      std::vector<size_t> more;
      for (; next < results.size() && more.size() < limit - clean && extra + more.size() < extraLimit; ++next)
        if (!isChosen[next]) {
          isChosen[next] = true;
          more.push_back(next);
        }
      if (more.empty()) break;
      state.candidates += int(more.size());
      extra += more.size();
      compileAll(spec, target, more, results, kernels, compiler, options, start, [&] {
        ++state.compiled;
        report();
      });
      chosen.insert(chosen.end(), more.begin(), more.end());
    }
    std::sort(chosen.begin(), chosen.end());
  }

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

  if (!measured && options.emulate)
    emulateAll(spec, target, chosen, results, kernels, options, [&] {
      ++state.emulated;
      report();
    });

  if (measured) {
    MeasureOptions measureOptions;
    measureOptions.batch = options.batch;
    measureOptions.tokens = options.tokens;
    measureOptions.candidateBudgetMs = options.candidateBudgetMs;
    measureOptions.deadlineSeconds = options.budgetSeconds - secondsSince(start);
    measureOptions.halving = strategy == Strategy::halving;
    measureOptions.seed = options.seed;
    measureOptions.direction = directionOf(options.direction, options.mixedCache);
    measureOptions.newTokens = options.newTokens;
    if (Status ok = measure(spec, device, chosen, kernels, results, measureOptions, state, progress); !ok)
      return ok.error();
  }
  if (compiledOut) *compiledOut = kernels;

  for (const Pruned& p : space.pruned) {
    CandidateResult r;
    r.candidate = {p.schedule, p.key};
    r.outcome = Outcome::pruned;
    r.reason = p.reason;
    results.push_back(r);
  }
  auto summary = summarize(spec, target, std::move(results), int(space.pruned.size()));
  if (summary) {
    const v1::Direction direction = directionOf(options.direction, options.mixedCache);
    summary->result.set_direction(direction);
    if (options.shapeBucketed) summary->result.set_shape_bucket(cache::shapeBucket(direction, options.batch, options.tokens));
  }
  return summary;
}

Result<TuneReport> summarize(const KernelSpec& spec, const v1::Target& target, std::vector<CandidateResult> results,
                             int pruned) {
  rankResults(results);
  TuneReport out;
  out.candidates = results;
  out.pruned = pruned;
  const CandidateResult& best = results.front();
  if (best.outcome != Outcome::timed && best.outcome != Outcome::unmeasured)
    return makeError("no candidate survived: the best was rejected (" + best.reason + ")");
  v1::TuningResult& r = out.result;
  *r.mutable_spec() = spec;
  *r.mutable_target() = target;
  *r.mutable_best() = best.candidate.schedule;
  r.set_measured(best.outcome == Outcome::timed);
  if (best.outcome == Outcome::timed) r.set_median_ms(best.medianMs);
  r.set_predicted_ms(best.predictedMs);
  r.set_tflops(best.tflops);
  r.set_toolchain(jit::nvrtcVersion());
  int tried = 0, rejected = 0;
  for (const CandidateResult& c : results) {
    tried += c.outcome != Outcome::pruned && c.outcome != Outcome::skipped;
    rejected += c.outcome == Outcome::compile_failed || c.outcome == Outcome::slow || c.outcome == Outcome::wrong;
  }
  r.set_candidates_tried(tried);
  r.set_candidates_rejected(rejected);
  return out;
}

}  // namespace loom::autotune
