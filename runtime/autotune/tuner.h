// The autotuner: key -> space (pruned, never empty) -> rank by the cost
// model -> compile in parallel (spills and failures dropped, with reasons)
// -> on a GPU, verify every candidate against a trusted result and time it
// (warm-up, L2 flush, events, median within a per-candidate budget, inputs
// rotated) -> remember the winner. Without a GPU the cost model's ranking of
// the compiled candidates is the result, marked untimed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autotune/cost_model.h"
#include "autotune/space.h"
#include "loom/result.h"
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
  int compileThreads = 0;           // 0: one per hardware thread
  std::string cacheDir;             // NVRTC artifacts
  uint64_t seed = 1;                // random sampling and inputs
};

enum class Outcome { pruned, skipped, compile_failed, spilled, wrong, unmeasured, timed };
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
};

struct TuneProgress {
  int candidates = 0, compiled = 0, verified = 0, timed = 0;
  std::string best;
  double bestMs = 0;
  bool measured = false;
};

struct TuneReport {
  v1::TuningResult result;
  std::vector<CandidateResult> candidates;  // ranked: best first, then rejects
  int pruned = 0;
};

// Tunes `spec` for `target`. With `runtime` (a GPU) candidates are measured;
// without, they are ranked by the cost model. `progress` is called as work
// completes.
Result<TuneReport> tune(const KernelSpec& spec, const v1::Target& target, Runtime* runtime, const TuneOptions& options,
                        const std::function<void(const TuneProgress&)>& progress = {});

// Orders results: timed (by median, ties within noise broken by the cost
// model's order and then the key), then untimed by prediction, then rejects.
void rankResults(std::vector<CandidateResult>& results);

}  // namespace loom::autotune
