// loom-static-report: what can be said of a kernel's speed without a GPU,
// for the paper's settings (H = 8 and 16, P = 2, 4, 8, d = 64 and 128, bf16,
// causal): for the default schedule and the cost model's first choice, each
// compiled by NVRTC, the registers and shared memory ptxas reports, the CTAs
// per SM they allow, the performance losses (none expected), the cost
// model's predicted time and TFLOP/s with ptxas's registers, and the share of
// the measured H200 bf16 matrix ceiling (790 TFLOP/s) that prediction is.
// Then the memory-bound premix: its bytes' floor beside the issue time of
// its machine code. The first GPU run puts its measurements beside these
// numbers.
//
//   loom-static-report [--target sm_90a] [--tokens 4096] [--batch 1]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "api/compile.h"
#include "autotune/cost_model.h"
#include "autotune/space.h"
#include "autotune/tuner.h"
#include "jit/nvrtc_compiler.h"
#include "jit/sass.h"
#include "loom/compiler.h"

namespace {

constexpr double kMeasuredCeilingTflops = 790;  // H200 bf16 GEMM, docs/gpu-results.md

struct Row {
  std::string kind, key;
  int registers = 0;
  int64_t sharedMemory = 0;
  int ctasPerSm = 0;
  double predictedMs = 0, tflops = 0;
  size_t losses = 0;
};

// The paper's settings: H heads (and kv heads), P pseudo-heads, head_dim
// d, bf16, causal, per-head collapse, RoPE.
loom::KernelSpec paperSpec(int H, int P, int d) {
  loom::KernelSpec spec;
  spec.set_heads(H);
  spec.set_kv_heads(H);
  spec.set_pseudo_heads(P);
  spec.set_head_dim(d);
  spec.set_dtype(loom::v1::bfloat16);
  spec.set_mask(loom::v1::flat_causal);
  spec.set_collapse(loom::v1::per_head);
  spec.set_rope_theta(10000);
  return spec;
}

int usage(const char* self) {
  std::fprintf(stderr, "usage: %s [--target sm_90a|sm_80|...] [--tokens N] [--batch B]\n", self);
  return 2;
}

// The premix (materialised mixing, cuda_common.h) of the same settings:
// the bytes it must move, their floor at the device's DRAM bandwidth, the
// issue time of its mixing loops as the machine code has them, and the
// ratio (docs/performance.md, The premix).
void premixFloors(const loom::v1::Target& target, loom::jit::NvrtcCompiler& compiler, int64_t batch, int64_t tokens) {
  std::printf("\npremix (materialised mixing), B=%lld N=%lld: the bytes' floor against the SASS issue time\n",
              (long long)batch, (long long)tokens);
  std::printf("%-3s %-2s %-4s %10s %10s %10s %7s  %s\n", "H", "P", "d", "MB moved", "floor ms", "issue ms", "ratio",
              "SASS: mixing loops (q / k / v instructions a group), memory instructions");
  for (int H : {8, 16, 32})
    for (int P : {2, 4, 8})
      for (int d : {64, 128}) {
        const loom::KernelSpec spec = paperSpec(H, P, d);
        loom::Schedule materialized;
        materialized.set_mix(loom::v1::mix_materialized);
        std::shared_ptr<const loom::jit::Artifact> artifact;
        auto kernel = loom::compileKernel(spec, materialized, target, compiler, &artifact);
        if (!kernel) {
          std::printf("%-3d %-2d %-4d %s\n", H, P, d, kernel.error().message.c_str());
          continue;
        }
        const auto read = loom::jit::resourcesWithSass(*artifact);  // without nvdisasm: estimated
        const std::vector<loom::v1::ResourceUsage> resources = read ? *read : artifact->resources;
        std::optional<loom::autotune::PremixIssue> issue;
        std::string memory = "SASS not read";
        for (const auto& usage : resources)
          if (usage.entry() == loom::kPremixEntry && usage.sass_read()) {
            issue = loom::autotune::premixIssueOf(usage, spec, kernel->schedule());
            memory = loom::jit::sass::memoryBrief(usage.memory());
          }
        const loom::autotune::PremixCost cost =
            loom::autotune::estimatePremixCost(spec, kernel->schedule(), target, batch, tokens, issue);
        char loops[64] = "estimated";
        if (issue)
          std::snprintf(loops, sizeof loops, "%.0f / %.0f / %.0f", issue->perGroup[0], issue->perGroup[1],
                        issue->perGroup[2]);
        std::printf("%-3d %-2d %-4d %10.1f %10.3f %10.3f %6.2fx  %s; %s\n", H, P, d, cost.bytes / 1e6,
                    cost.memorySeconds * 1e3, cost.issueSeconds * 1e3, cost.floorRatio(), loops, memory.c_str());
        std::fflush(stdout);
      }
}

// The decode step over a paged cache (the serving path), one new token a
// sequence: for batches of 1 to 64 and caches of 4k to 128k tokens, the
// bytes it must move, their floor, the issue time of its attention loop as
// the machine code has it, and the ratio. The paper's settings (H = G = 16,
// P = 4, d = 128, bf16, causal, RoPE) over a raw cache (the default: the
// mixing absorbed; then the raw rows mixed on chip), the same with qk_norm
// (nanochat-style: the keys' norms from Gram matrices) and a mixed cache; then
// kv groups of four heads (H = 32, G = 8, P = 2) over a raw cache, the
// default (absorbed), the group's heads stacked in one CTA, and each head
// alone; then P = 8 (H = G = 16): the default (tensor mixing) and the FMA
// units' mixing step. Beside the issue, the tensor pipe's time at the
// model's mma.sync share of the dense rate (DecodeFloor).
void decodeFloors(const loom::v1::Target& target, loom::jit::NvrtcCompiler& compiler) {
  struct Case {
    loom::KernelSpec spec;
    bool mixedCache;
    std::optional<bool> absorb, stacked;  // unset: the default
    const char* what;
  };
  loom::KernelSpec grouped = paperSpec(32, 2, 128);
  grouped.set_kv_heads(8);
  loom::KernelSpec normed = paperSpec(16, 4, 128);  // nanochat-style: qk_norm, RoPE turned the other way
  normed.set_qk_norm(loom::v1::KernelSpec::rms);
  normed.set_rope_direction(loom::v1::KernelSpec::negative);
  const Case cases[] = {
      {paperSpec(16, 4, 128), false, std::nullopt, std::nullopt, "a raw paged cache, H=G=16 P=4 d=128 (default: absorbed)"},
      {paperSpec(16, 4, 128), false, false, std::nullopt, "a raw paged cache, H=G=16 P=4 d=128, absorb_mixing false"},
      {normed, false, std::nullopt, std::nullopt, "a raw paged cache, H=G=16 P=4 d=128 qk_norm (default: absorbed)"},
      {normed, false, false, std::nullopt, "a raw paged cache, H=G=16 P=4 d=128 qk_norm, absorb_mixing false"},
      {paperSpec(16, 4, 128), true, std::nullopt, std::nullopt, "a mixed paged cache, H=G=16 P=4 d=128"},
      {grouped, false, std::nullopt, std::nullopt, "a raw paged cache, H=32 G=8 P=2 d=128 (default: absorbed)"},
      {grouped, false, false, std::nullopt, "a raw paged cache, H=32 G=8 P=2 d=128, absorb_mixing false (heads stacked)"},
      {grouped, false, false, false, "a raw paged cache, H=32 G=8 P=2 d=128, absorb_mixing and stack_heads false"},
      {paperSpec(16, 8, 128), false, std::nullopt, std::nullopt,
       "a raw paged cache, H=G=16 P=8 d=128 (default: tensor mixing)"},
      {paperSpec(16, 8, 128), false, false, std::nullopt,
       "a raw paged cache, H=G=16 P=8 d=128, absorb_mixing false (mixed on the FMA units)"},
  };
  for (const Case& c : cases) {
    loom::Schedule schedule;
    if (c.absorb) schedule.set_absorb_mixing(*c.absorb);  // false: the FMA units' mixing step
    if (c.stacked) schedule.set_stack_heads(*c.stacked);
    std::shared_ptr<const loom::jit::Artifact> artifact;
    auto kernel = loom::compileKernel(c.spec, schedule, target, compiler, &artifact, loom::Direction::decode,
                                      c.mixedCache);
    std::printf("\ndecode over %s bf16 causal RoPE, one new token a sequence\n", c.what);
    if (!kernel) {
      std::printf("  %s\n", kernel.error().message.c_str());
      continue;
    }
    const auto read = loom::jit::resourcesWithSass(*artifact);  // without nvdisasm: estimated
    const std::vector<loom::v1::ResourceUsage> resources = read ? *read : artifact->resources;
    std::optional<loom::autotune::LoopIssue> issue;
    for (const auto& usage : resources)
      if (usage.entry() == loom::kAttentionEntry) {
        issue = loom::autotune::loopIssueOf(usage);
        std::printf("  default %s; attention: %s\n", loom::autotune::scheduleKey(kernel->schedule()).c_str(),
                    loom::jit::sass::memoryBrief(usage.memory()).c_str());
      }
    if (issue) std::printf("  its loop: %.0f instructions a warp a key block (SASS)\n", issue->unmasked);
    std::printf("%-5s %-7s %10s %10s %10s %8s %10s %8s %8s\n", "B", "cache", "MB moved", "floor ms", "issue ms", "ratio",
                "tensor ms", "ratio", "CTAs");
    for (int64_t batch : {1, 8, 64})
      for (int64_t cache : {4096, 32768, 131072}) {
        const loom::autotune::DecodeFloor f = loom::autotune::estimateDecodeFloor(
            c.spec, kernel->schedule(), target, batch, cache, 1, c.mixedCache, issue);
        std::printf("%-5lld %-7lld %10.1f %10.3f %10.3f %7.2fx %10.3f %7.2fx %8lld\n", (long long)batch,
                    (long long)cache, f.bytes / 1e6, f.memorySeconds * 1e3, f.issueSeconds * 1e3, f.floorRatio(),
                    f.tensorSeconds * 1e3, f.tensorRatio(), (long long)f.ctas);
      }
  }
}

// The default decode step over a raw cache for each of the paper's
// settings (H = G = 8 and 16, P = 2, 4, 8, d = 64 and 128, bf16, causal,
// RoPE), qk_norm off and on, one line each at B = 8 and a 32k-token cache:
// which step it is (absorbed; tensor: mixing on the tensor cores; mixing:
// on the FMA units), its loop and the two ratios to the memory floor.
void decodeSettings(const loom::v1::Target& target, loom::jit::NvrtcCompiler& compiler) {
  std::printf("\ndecode over a raw paged cache, the paper's settings, default schedule, B 8, cache 32768, one new token\n");
  std::printf("%-3s %-2s %-4s %-8s %-9s %12s %8s %8s\n", "H", "P", "d", "qk_norm", "step", "loop (SASS)", "issue",
              "tensor");
  for (int H : {8, 16})
    for (int P : {2, 4, 8})
      for (int d : {64, 128})
        for (bool normed : {false, true}) {
          loom::KernelSpec spec = paperSpec(H, P, d);
          if (normed) spec.set_qk_norm(loom::v1::KernelSpec::rms);
          std::shared_ptr<const loom::jit::Artifact> artifact;
          auto kernel = loom::compileKernel(spec, loom::Schedule(), target, compiler, &artifact,
                                            loom::Direction::decode, /*mixedCache=*/false);
          if (!kernel) {
            std::printf("%-3d %-2d %-4d %-8s %s\n", H, P, d, normed ? "rms" : "none", kernel.error().message.c_str());
            continue;
          }
          const auto read = loom::jit::resourcesWithSass(*artifact);  // without nvdisasm: estimated
          std::optional<loom::autotune::LoopIssue> issue;
          for (const auto& usage : read ? *read : artifact->resources)
            if (usage.entry() == loom::kAttentionEntry) issue = loom::autotune::loopIssueOf(usage);
          const loom::autotune::DecodeFloor f =
              loom::autotune::estimateDecodeFloor(spec, kernel->schedule(), target, 8, 32768, 1, false, issue);
          std::printf("%-3d %-2d %-4d %-8s %-9s %12.0f %7.2fx %7.2fx\n", H, P, d, normed ? "rms" : "none",
                      kernel->schedule().absorb_mixing()   ? "absorbed"
                      : kernel->schedule().tensor_mixing() ? "tensor"
                                                           : "mixing",
                      issue ? issue->unmasked : 0.0,
                      f.floorRatio(), f.tensorRatio());
          std::fflush(stdout);
        }
}

}  // namespace

int main(int argc, char** argv) {
  std::string arch = "sm_90a";
  int64_t tokens = 4096, batch = 1;
  for (int i = 1; i < argc; ++i) {
    const bool hasValue = i + 1 < argc;
    if (!std::strcmp(argv[i], "--target") && hasValue) arch = argv[++i];
    else if (!std::strcmp(argv[i], "--tokens") && hasValue) tokens = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--batch") && hasValue) batch = std::atoll(argv[++i]);
    else return usage(argv[0]);
  }
  auto target = loom::parseTarget(arch);
  if (!target || target->kind() != loom::v1::Target::cuda) {
    std::fprintf(stderr, "loom-static-report: --target %s is not a CUDA arch\n", arch.c_str());
    return 2;
  }
  loom::jit::NvrtcCompiler compiler("");
  std::printf("loom-static-report: %s, B=%lld N=%lld, bf16, causal; NVRTC %s; no GPU: every time is a prediction\n",
              arch.c_str(), (long long)batch, (long long)tokens, loom::jit::nvrtcVersion().c_str());
  std::printf("%-3s %-2s %-4s %-8s %-48s %5s %9s %8s %7s %11s %10s %9s %9s %8s  %s\n", "H", "P", "d", "schedule", "key",
              "regs", "smem KiB", "CTAs/SM", "losses", "model ms", "premix ms", "grid eff", "TFLOP/s", "of 790",
              "SASS loops: instructions per tensor MFLOP (m: masked), exp in the P V window, ping-pong");
  for (int H : {8, 16})
    for (int P : {2, 4, 8})
      for (int d : {64, 128}) {
        const loom::KernelSpec spec = paperSpec(H, P, d);
        const double flops = loom::autotune::ihaFlops(spec, batch, tokens);
        // The default schedule, and the best-predicted of the tuner's space.
        std::vector<std::pair<std::string, loom::Schedule>> schedules;
        auto resolved = loom::resolveSchedule(spec, loom::Schedule(), *target);
        if (resolved) schedules.emplace_back("default", *resolved);
        const std::vector<loom::autotune::CandidateResult> ranked =
            loom::autotune::rankByModel(spec, *target, loom::autotune::searchSpace(spec, *target), batch, tokens);
        if (!ranked.empty()) schedules.emplace_back("model", ranked.front().candidate.schedule);
        for (const auto& [kind, schedule] : schedules) {
          std::shared_ptr<const loom::jit::Artifact> artifact;
          auto kernel = loom::compileKernel(spec, schedule, *target, compiler, &artifact);
          if (!kernel) {
            std::printf("%-3d %-2d %-4d %-8s %s: %s\n", H, P, d, kind.c_str(),
                        loom::autotune::scheduleKey(schedule).c_str(), kernel.error().message.c_str());
            continue;
          }
          Row row;
          row.kind = kind;
          row.key = loom::autotune::scheduleKey(schedule);
          row.registers = loom::jit::registersOf(artifact->resources, loom::kAttentionEntry);
          for (const auto& entry : kernel->entries())
            if (entry.name() == loom::kAttentionEntry) row.sharedMemory = entry.shared_memory_bytes();
          row.losses = artifact->performanceLosses().size();
          // The machine code's loops (sass.h), which the prediction reads, on
          // every arch (a compile reads sm_90a's; the others are read here).
          std::optional<loom::autotune::LoopIssue> issue;
          std::string loops;
          const auto read = loom::jit::resourcesWithSass(*artifact);  // without nvdisasm: as compiled
          for (const auto& usage : read ? *read : artifact->resources)
            if (usage.entry() == loom::kAttentionEntry) {
              if (schedule.engine() == loom::v1::engine_wgmma) issue = loom::autotune::loopIssueOf(usage);
              loops = loom::jit::sass::loopsBrief(usage);
            }
          const loom::autotune::CostEstimate e =
              loom::autotune::estimateCost(spec, schedule, *target, batch, tokens, row.registers, issue);
          row.ctasPerSm = e.ctasPerSm;
          row.predictedMs = e.seconds * 1e3;
          row.tflops = flops / e.seconds / 1e12;
          // premix ms: materialised mixing's own launch, within model ms; grid eff: the SMs' mean load
          // over the busiest one's as the CTAs are handed out (a causal grid is uneven).
          std::printf("%-3d %-2d %-4d %-8s %-48s %5d %9.1f %8d %7zu %11.3f %10.3f %9.2f %9.0f %7.0f%%  %s\n", H, P, d,
                      row.kind.c_str(), row.key.c_str(), row.registers, row.sharedMemory / 1024.0, row.ctasPerSm,
                      row.losses, row.predictedMs, e.premixSeconds * 1e3, e.waveEfficiency, row.tflops,
                      100.0 * row.tflops / kMeasuredCeilingTflops, loops.c_str());
          std::fflush(stdout);
        }
      }
  premixFloors(*target, compiler, batch, tokens);
  decodeFloors(*target, compiler);
  decodeSettings(*target, compiler);
  return 0;
}
