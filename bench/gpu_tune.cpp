// loom-gpu-tune: the tuner's measurement stage on precompiled candidates
// (loom tune --target ARCH --bundles DIR writes them where the compiler
// lives): every tune.*.pb of one spec and direction is verified against the
// float64 reference (every gradient, for backward bundles; for decode
// bundles a step's rows against the forward's, TOKENS then being the
// cache's length and BATCH the sequences per step) and timed;
// prints the ranked table. No compiler linked.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "autotune/cost_model.h"
#include "autotune/measure.h"
#include "cuda/driver.h"
#include "loom/decode.h"

namespace fs = std::filesystem;
using namespace loom;

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help") {
    std::printf("usage: loom-gpu-tune BUNDLE_DIR [TOKENS] [BATCH] [DEADLINE_SECONDS]\n");
    return argc < 2 ? 2 : 0;
  }
  const std::string dir = argv[1];
  autotune::MeasureOptions options;
  options.tokens = argc > 2 ? std::stoll(argv[2]) : 4096;
  options.batch = argc > 3 ? std::stoll(argv[3]) : 1;
  options.halving = false;
  options.deadlineSeconds = argc > 4 ? std::stod(argv[4]) : 240;
  auto device = cuda::Device::open(0);
  if (!device) return std::fprintf(stderr, "loom-gpu-tune: %s\n", device.error().message.c_str()), 2;
  const v1::Target target = cuda::targetOf((*device)->info());

  std::vector<v1::CompiledKernel> kernels;
  std::vector<autotune::CandidateResult> results;
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().rfind("tune.", 0) == 0) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  for (const fs::path& path : files) {
    v1::CompiledKernel kernel;
    std::ifstream in(path, std::ios::binary);
    if (!kernel.ParseFromIstream(&in)) continue;
    if (!kernels.empty() && (kernel.spec().SerializeAsString() != kernels.front().spec().SerializeAsString() ||
                             kernel.direction() != kernels.front().direction()))
      continue;
    const bool backward = kernel.direction() == v1::direction_backward;
    const bool decode = isDecode(kernel.direction());
    options.direction = kernel.direction();
    autotune::CandidateResult r;
    r.candidate = {kernel.schedule(), path.stem().string().substr(5)};
    r.predictedMs = (backward ? autotune::estimateBackwardCost(kernel.spec(), kernel.schedule(), target, options.batch,
                                                              options.tokens)
                     : decode ? autotune::estimateDecodeCost(kernel.spec(), kernel.schedule(), target, options.batch,
                                                             options.tokens, options.newTokens,
                                                             mixedCacheOf(kernel.direction()))
                              : autotune::estimateCost(kernel.spec(), kernel.schedule(), target, options.batch,
                                                       options.tokens))
                        .seconds *
                    1e3;
    for (const auto& usage : kernel.resources()) r.registers = std::max(r.registers, usage.registers());
    for (const auto& entry : kernel.entries()) r.sharedMemory = std::max(r.sharedMemory, entry.shared_memory_bytes());
    kernels.push_back(kernel);
    results.push_back(r);
  }
  if (kernels.empty()) return std::fprintf(stderr, "loom-gpu-tune: no tune.*.pb in %s\n", dir.c_str()), 2;
  std::vector<size_t> all(kernels.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  autotune::TuneProgress state;
  if (Status ok = autotune::measure(kernels.front().spec(), *device, all, kernels, results, options, state, {}); !ok)
    return std::fprintf(stderr, "loom-gpu-tune: %s\n", ok.error().message.c_str()), 1;
  autotune::rankResults(results);

  std::printf("tuning %s on %s, B=%lld N=%lld: %zu candidates, %d verified, %d timed\n",
              kernels.front().spec().ShortDebugString().c_str(), (*device)->info().name.c_str(),
              (long long)options.batch, (long long)options.tokens, kernels.size(), state.verified, state.timed);
  std::printf("%-4s %-34s %10s %10s %10s %9s %8s %5s  %s\n", "rank", "schedule", "median ms", "p90 ms", "model ms",
              "TFLOP/s", "GB/s", "regs", "outcome");
  int rank = 0;
  for (const auto& r : results) {
    std::printf("%-4d %-34s %10.3f %10.3f %10.3f %9.1f %8.1f %5d  %s%s%s\n", ++rank, r.candidate.key.c_str(), r.medianMs,
                r.p90Ms, r.predictedMs, r.tflops, r.bandwidth / 1e9, r.registers, autotune::outcomeName(r.outcome),
                r.reason.empty() ? "" : ": ", r.reason.c_str());
  }
  return results.front().outcome == autotune::Outcome::timed ? 0 : 1;
}
