// The autotuner: key -> space (pruned, never empty) -> rank by the cost
// model -> compile in parallel (spills and failures dropped, with reasons)
// -> on a GPU, verify every candidate against a trusted result and time it
// (warm-up, L2 flush, events, median within a per-candidate budget, inputs
// rotated) -> remember the winner. Without a GPU the cost model's ranking of
// the compiled candidates is the result, marked untimed, after each has run
// on the emulator on a small drawn case: one with a finding or a wrong
// output is rejected, so an offline ranking never offers a kernel known to
// be wrong.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "autotune/cost_model.h"
#include "autotune/measure.h"
#include "autotune/space.h"
#include "loom/result.h"
#include "cuda/driver.h"
#include "loom/cache.h"
#include "loom/compiler.h"
#include "loom/runtime.h"

namespace loom::autotune {

enum class Strategy { automatic, exhaustive, random, halving };
Result<Strategy> parseStrategy(const std::string& name);

struct TuneOptions {
  int64_t batch = 1;
  int64_t tokens = 4096;
  Strategy strategy = Strategy::automatic;
  double budgetSeconds = 60;        // wall clock for the whole search
  double candidateBudgetMs = 200;   // timing budget per candidate and round
  int exhaustiveLimit = 48;         // automatic: exhaustive up to this many candidates
  int sampleSize = 32;              // random / halving: how many candidates to compile
  int offlineCompiles = 8;          // without a GPU: compile this many top-ranked candidates
  bool emulate = true;              // without a GPU: check those on the emulator (runtime/emu)
  // Tile headers the emulator takes instead of the embedded ones (by include
  // path): tests put a fault into the device code to see it rejected.
  std::map<std::string, std::string> emulatorHeaders;
  int compileThreads = 0;           // 0: one per hardware thread
  std::string cacheDir;             // NVRTC artifacts
  uint64_t seed = 1;                // random sampling and inputs
  // backward: tune the backward kernel (its own space and cost model; on a
  // GPU verified on every gradient and timed by launchBackward, without one
  // ranked and checked on the emulator).
  Direction direction = Direction::forward;
  // decode: tune a decode step (its own space and cost model, docs/compiler.md,
  // The decode step) of `newTokens` per sequence over caches of `tokens`
  // tokens, raw or (mixedCache) mixed; with a device verified on a short
  // step against the forward's rows and timed by launchDecode over caches of
  // `tokens` (pages of 16 under a shuffled table), without one ranked by the
  // model and checked on the emulator.
  bool mixedCache = false;
  int64_t newTokens = 1;
  // File the decision under the shape bucket of (batch, tokens)
  // (cache::shapeBucket: a forward's or backward's N, a decode step's
  // batch and cache length), served to launches of those shapes and, where
  // no bucket nearer is tuned, to others; false: for every shape.
  bool shapeBucketed = false;
};

struct TuneReport {
  v1::TuningResult result;
  std::vector<CandidateResult> candidates;  // ranked: best first, then rejects
  int pruned = 0;
};

// The candidates of `space` with the cost model's predictions, best first
// (the tuner's order before anything is compiled).
// (A decode space's: `tokens` cached, `newTokens` new, over a raw or mixed cache.)
std::vector<CandidateResult> rankByModel(const KernelSpec& spec, const v1::Target& target, const SearchSpace& space,
                                        int64_t batch, int64_t tokens, Direction direction = Direction::forward,
                                        bool mixedCache = false, int64_t newTokens = 1);

// Tunes `spec` for `target`. With `device` (a GPU) candidates are measured;
// without, they are ranked by the cost model. `progress` is called as work
// completes. `compiledOut`, when given, receives every compiled candidate.
Result<TuneReport> tune(const KernelSpec& spec, const v1::Target& target, std::shared_ptr<cuda::Device> device,
                        const TuneOptions& options, const std::function<void(const TuneProgress&)>& progress = {},
                        std::vector<v1::CompiledKernel>* compiledOut = nullptr);

// The compiled kernel of the report's winner among `compiled`, or null.
const v1::CompiledKernel* winnerOf(const TuneReport& report, const std::vector<v1::CompiledKernel>& compiled);

// Stores the decision (with `candidatesJson`) and the winner's kernel in the
// cache; returns the winner's artifact key (empty when it was not compiled).
Result<std::string> storeTuning(cache::KernelStore& store, const KernelSpec& spec, const v1::Target& target,
                                const TuneReport& report, const std::vector<v1::CompiledKernel>& compiled,
                                const std::string& candidatesJson = "[]");

// The TuningResult of ranked results (the first is the winner).
Result<TuneReport> summarize(const KernelSpec& spec, const v1::Target& target, std::vector<CandidateResult> results,
                             int pruned);

}  // namespace loom::autotune
