// loom tune: search the schedule space of a spec on this GPU (measured) or
// for a named arch without one (ranked by the cost model, marked untimed).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include "autotune/tuner.h"
#include "commands.h"
#include "loom/cache_dir.h"
#include "cuda/driver.h"
#include "loom/cache.h"
#include "loom/compiler.h"

namespace loom::cli {
namespace {

struct TuneCliOptions {
  std::string specPath;
  std::string target;
  std::string budget = "60s";
  std::string strategy = "auto";
  std::string outPath;
  std::string cacheDir;
  int64_t tokens = 4096;
  int64_t batch = 1;
  int top = 10;
  int compileTop = 8;
  std::string bundlesDir;
  bool json = false;
  bool backward = false;
  std::string decode;  // raw | mixed: tune the decode step over that cache
  bool noEmulate = false;
  bool shapeBucket = false;  // file the decision under the bucket of --batch and --tokens
};

Result<double> parseSeconds(const std::string& text) {
  std::smatch m;
  if (!std::regex_match(text, m, std::regex(R"(([0-9]*\.?[0-9]+)(ms|s|m)?)")))
    return makeError("--budget '" + text + "' is not a duration like 500ms, 60s or 5m");
  const double value = std::stod(m[1]);
  return m[2] == "ms" ? value / 1e3 : m[2] == "m" ? value * 60 : value;
}

nlohmann::json candidateJson(const autotune::CandidateResult& r) {
  nlohmann::json j = {{"schedule", r.candidate.key}, {"outcome", autotune::outcomeName(r.outcome)},
                      {"predicted_ms", r.predictedMs}};
  if (!r.sass.empty()) j["sass"] = r.sass;
  if (!r.reason.empty()) j["reason"] = r.reason;
  if (r.outcome == autotune::Outcome::timed) {
    j["median_ms"] = r.medianMs;
    j["p10_ms"] = r.p10Ms;
    j["p90_ms"] = r.p90Ms;
    j["tflops"] = r.tflops;
    j["gb_per_s"] = r.bandwidth / 1e9;
    j["error"] = r.error;
  }
  if (r.registers) j["registers"] = r.registers;
  if (r.sharedMemory) j["shared_memory_bytes"] = r.sharedMemory;
  return j;
}

int tuneCommand(const TuneCliOptions& options) {
  auto spec = readSpecFile(options.specPath);
  if (!spec) return badInput(spec.error().message);
  auto budget = parseSeconds(options.budget);
  if (!budget) return badInput(budget.error().message);
  auto strategy = autotune::parseStrategy(options.strategy);
  if (!strategy) return badInput(strategy.error().message);
  if (options.tokens < 1 || options.batch < 1) return badInput("--tokens and --batch must be at least 1");

  // A GPU if there is one (measured), else the named arch (ranked offline).
  std::shared_ptr<cuda::Device> device;
  v1::Target target;
  if (auto opened = cuda::Device::open(0); opened) {
    device = *opened;
    target = cuda::targetOf(device->info());
    if (!options.target.empty() && options.target != target.arch())
      return badInput("--target " + options.target + " differs from this machine's GPU (" + target.arch() + ")");
  } else {
    if (options.target.empty())
      return badInput(opened.error().message + "; to rank schedules without a GPU, name the arch with --target");
    auto parsed = parseTarget(options.target);
    if (!parsed || parsed->kind() != v1::Target::cuda) return badInput("--target must be a CUDA arch such as sm_90a");
    target = *parsed;
    std::fprintf(stderr, "no GPU: ranking %s schedules with the cost model (untimed)%s\n", target.arch().c_str(),
                 options.noEmulate ? "" : ", each compiled one checked on the emulator");
  }

  autotune::TuneOptions tuneOptions;
  tuneOptions.batch = options.batch;
  tuneOptions.tokens = options.tokens;
  tuneOptions.shapeBucketed = options.shapeBucket;
  tuneOptions.strategy = *strategy;
  tuneOptions.budgetSeconds = *budget;
  tuneOptions.cacheDir = options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir;
  tuneOptions.offlineCompiles = options.compileTop;
  tuneOptions.emulate = !options.noEmulate;
  if (options.backward) tuneOptions.direction = Direction::backward;
  if (!options.decode.empty()) {
    tuneOptions.direction = Direction::decode;
    tuneOptions.mixedCache = options.decode == "mixed";
  }
  const bool live = ::isatty(STDERR_FILENO);
  auto progress = [&](const autotune::TuneProgress& p) {
    if (!live) return;
    std::fprintf(stderr, "\r\033[Kcompiled %d/%d, emulated %d, verified %d, timed %d%s%s", p.compiled, p.candidates,
                 p.emulated, p.verified,
                 p.timed, p.best.empty() ? "" : ", best ", p.best.empty() ? "" : (p.best + " " + std::to_string(p.bestMs).substr(0, 6) + " ms").c_str());
    std::fflush(stderr);
  };
  std::vector<v1::CompiledKernel> compiled;
  auto report = autotune::tune(*spec, target, device, tuneOptions, progress, &compiled);
  if (live) std::fprintf(stderr, "\n");
  if (!report) return badInput(report.error().message);
  if (!options.bundlesDir.empty()) {  // for loom-gpu-tune on a machine without the compiler
    std::filesystem::create_directories(options.bundlesDir);
    for (const v1::CompiledKernel& kernel : compiled) {
      if (kernel.binary().empty()) continue;
      std::ofstream out(options.bundlesDir + "/tune." + autotune::scheduleKey(kernel.schedule()) + ".pb", std::ios::binary);
      kernel.SerializeToOstream(&out);
    }
  }

  // Remember the winner in the kernel cache (and as JSON when --out asks).
  const std::string deviceName = target.device().name().empty() ? target.arch() : target.device().name();
  nlohmann::json saved = nlohmann::json::parse(toJson(report->result));
  saved["device"] = deviceName;
  saved["tokens"] = options.tokens;
  saved["batch"] = options.batch;
  saved["candidates"] = nlohmann::json::array();
  for (const auto& c : report->candidates) saved["candidates"].push_back(candidateJson(c));
  const std::string storePath = cache::storePath(tuneOptions.cacheDir);
  auto store = cache::openSqliteStore(storePath);
  if (!store) return badInput(store.error().message);
  nlohmann::json kept = nlohmann::json::array();  // every candidate that was compiled or measured
  for (const auto& c : report->candidates)
    if (c.outcome != autotune::Outcome::pruned && c.outcome != autotune::Outcome::skipped) kept.push_back(candidateJson(c));
  if (auto stored = autotune::storeTuning(**store, *spec, target, *report, compiled, kept.dump()); !stored)
    return badInput(stored.error().message);
  if (!options.outPath.empty()) {
    const std::string temporary = options.outPath + ".tmp";
    std::ofstream out(temporary);
    out << saved.dump(2) << "\n";
    if (!out) return badInput(options.outPath + ": write failed");
    out.close();
    std::filesystem::rename(temporary, options.outPath);
  }

  if (options.json) {
    std::printf("%s\n", saved.dump(2).c_str());
    return kExitOk;
  }
  const bool measured = report->result.measured();
  const std::string what = options.decode.empty() ? "" : " decode step of 1 token over a " + options.decode + " cache of";
  std::printf("%s on %s,%s B=%lld N=%lld: %s; %d candidates tried, %d rejected, %d pruned\n",
              options.specPath.c_str(), deviceName.c_str(), what.c_str(), (long long)options.batch,
              (long long)options.tokens,
              measured ? "measured" : "UNTIMED (cost model ranking, no GPU)", report->result.candidates_tried(),
              report->result.candidates_rejected(), report->pruned);
  std::printf("%-4s %-50s %10s %10s %9s %5s %8s  %-10s %s\n", "rank", "schedule", "median ms", "model ms", "TFLOP/s",
              "regs", "smem KiB", "outcome", "SASS loops (instr/tensor MFLOP, exp in P V window, ping-pong)");
  int shown = 0;
  for (const auto& r : report->candidates) {
    if (shown >= options.top) break;
    if (r.outcome != autotune::Outcome::timed && r.outcome != autotune::Outcome::unmeasured) continue;
    ++shown;
    std::printf("%-4d %-50s %10s %10.3f %9s %5d %8.1f  %-10s %s\n", shown, r.candidate.key.c_str(),
                r.outcome == autotune::Outcome::timed ? std::to_string(r.medianMs).substr(0, 7).c_str() : "-",
                r.predictedMs, r.outcome == autotune::Outcome::timed ? std::to_string(r.tflops).substr(0, 6).c_str() : "-",
                r.registers, r.sharedMemory / 1024.0, autotune::outcomeName(r.outcome),
                r.sass.empty() ? "-" : r.sass.c_str());
  }
  // The compiled candidates that were turned down, and why.
  for (const auto& r : report->candidates)
    if (r.outcome == autotune::Outcome::wrong || r.outcome == autotune::Outcome::slow ||
        r.outcome == autotune::Outcome::compile_failed)
      std::printf("     %-50s rejected (%s): %s\n", r.candidate.key.c_str(), autotune::outcomeName(r.outcome),
                  r.reason.c_str());
  const std::string& bucket = report->result.shape_bucket();
  std::printf("winner %s stored in %s, %s\n", report->candidates.front().candidate.key.c_str(), storePath.c_str(),
              bucket.empty() ? "for every shape (--shape-bucket files it for these shapes only)"
                             : ("for shape bucket " + bucket + " (and the shapes nearest it)").c_str());
  return kExitOk;
}

}  // namespace

void addTuneCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<TuneCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tune",
      "Search the schedule space of a spec: prune, rank with the cost model, compile in parallel, then on a GPU\n"
      "verify every candidate against the float64 reference and time it (L2 flushed, median of runs).\n"
      "Without a GPU, --target names the arch and the result is the cost model's ranking, marked untimed;\n"
      "each compiled candidate is first run on the emulator, which rejects any it finds wrong.");
  cmd->add_option("--spec", options->specPath, "KernelSpec JSON file")->required();
  cmd->add_option("--target", options->target, "CUDA arch when no GPU is present (sm_80, sm_90a, ...)");
  cmd->add_option("--budget", options->budget, "wall-clock budget: 500ms, 60s, 5m")->capture_default_str();
  cmd->add_option("--strategy", options->strategy, "auto | exhaustive | random | halving")->capture_default_str();
  cmd->add_option("--tokens", options->tokens, "N of the problem tuned for")->capture_default_str();
  cmd->add_option("--batch", options->batch, "B of the problem tuned for")->capture_default_str();
  cmd->add_option("--top", options->top, "rows in the final table")->capture_default_str();
  cmd->add_option("--out", options->outPath, "also write the result as JSON here");
  cmd->add_option("--cache-dir", options->cacheDir, "compiled artifacts and tuning results (default ~/.cache/loom)");
  cmd->add_option("--compile-top", options->compileTop, "without a GPU: compile this many best-ranked candidates")
      ->capture_default_str();
  cmd->add_option("--bundles", options->bundlesDir, "write every compiled candidate here (for loom-gpu-tune)");
  cmd->add_flag("--no-emulate", options->noEmulate,
                "without a GPU: do not run the compiled candidates on the emulator (by default each runs on a\n"
                "small drawn case there, and any with a finding or a wrong output is rejected)");
  cmd->add_flag("--json", options->json, "print the full result as JSON");
  cmd->add_flag("--shape-bucket", options->shapeBucket,
                "file the decision under the shape bucket of --batch and --tokens (a forward's or backward's\n"
                "n<N>, a decode step's c<cache>.b<batch>, powers of two): launches of those shapes get it, others\n"
                "the nearest tuned bucket's, else the decision for every shape (without the flag)");
  cmd->add_flag("--backward", options->backward,
                "tune the backward kernel instead (its own space and cost model, dq in its own launch or by\n"
                "atomic adds; on a GPU each candidate is checked on every gradient and launchBackward timed\n"
                "whole; without one ranked and each compiled one run whole on the emulator; kept apart from\n"
                "the forward's decision)")
      ->excludes(cmd->add_option("--decode", options->decode,
                                 "tune the decode step over a raw or mixed paged cache instead: one new token per\n"
                                 "sequence (--batch of them) over caches of --tokens; its own space (key blocks,\n"
                                 "warps, stages, kv_splits) and cost model (the bytes a step reads), each compiled\n"
                                 "candidate checked on the emulator; not timed on a GPU yet")
                     ->check(CLI::IsMember({"raw", "mixed"})));
  cmd->callback([options, action] { *action = [options] { return tuneCommand(*options); }; });
}

}  // namespace loom::cli
