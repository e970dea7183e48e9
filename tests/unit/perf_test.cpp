// Performance you can check without a GPU: for a grid of specs, the kernels
// loom may hand out (the default schedule and the offline tuner's top three)
// compile on sm_80 and sm_90a with nothing ptxas or the PTX shows losing
// speed: no spill bytes, no stack frame, no C75xx performance-loss note (a
// serialised wgmma among them), no fp64 and no local memory. The tuner
// drops a compiled candidate that loses performance and compiles the next
// in its ranking instead; what it dropped is printed.
//
// The grid (P 1..8, head_dim 32/64/96/128/256, H up to 16 with G dividing
// it, every mask mode, windows on and off, both collapses, float16 and
// bfloat16, RoPE and qk_norm on and off) is sampled with a fixed seed:
// kGridSpecs specs: P = 1 + index % 8 and head_dim = kHeadDims[index % 5],
// so every P meets three head dims and every head dim four or five P; the
// rest is drawn (LOOM_GRID_SEED draws another sample of the same grid).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string_view>
#include <tuple>

#include "api/compile.h"
#include "autotune/cost_model.h"
#include "autotune/tuner.h"
#include "jit/nvrtc_compiler.h"
#include "jit/sass.h"
#include "loom/compiler.h"
#include "loom/tile_headers.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr int kGridSpecs = 24;
constexpr int kHeadDims[] = {32, 64, 96, 128, 256};
constexpr int kTopCandidates = 3;

uint64_t gridSeed() {
  if (const char* seed = std::getenv("LOOM_GRID_SEED")) return std::stoull(seed);
  return 20261201;
}

KernelSpec gridSpec(int index) {
  std::mt19937_64 rng(gridSeed() + uint64_t(index) * 7919);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  KernelSpec spec;
  const int G = 1 << pick(0, 4);
  spec.set_kv_heads(G);
  spec.set_heads(G << pick(0, 4 - (G == 1 ? 0 : __builtin_ctz(G))));
  spec.set_pseudo_heads(1 + index % 8);
  spec.set_head_dim(kHeadDims[index % 5]);
  spec.set_dtype(pick(0, 1) ? v1::bfloat16 : v1::float16);
  spec.set_mask(static_cast<v1::MaskMode>(1 + index % 3));
  spec.set_window(pick(0, 1) ? 0 : pick(1, 512));
  spec.set_collapse(pick(0, 1) ? v1::per_head : v1::global);
  spec.set_rope_theta(pick(0, 1) ? 0.0 : 10000.0);
  if (pick(0, 2) == 0) spec.set_qk_norm(v1::KernelSpec::rms);
  return spec;
}

std::string describe(const KernelSpec& spec) { return spec.ShortDebugString(); }

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += "\n    " + line;
  return text;
}

class Grid : public ::testing::TestWithParam<int> {};

TEST_P(Grid, DefaultAndTopCandidatesCompileWithoutLosses) {
  const KernelSpec spec = gridSpec(GetParam());
  ASSERT_TRUE(validateSpec(spec)) << describe(spec);
  for (const std::string arch : {"sm_80", "sm_90a"}) {
    const v1::Target target = *parseTarget(arch);
    // One artifact cache for the default's compile and the tuner's: the
    // default is often among the top three and is compiled once.
    const std::string cacheDir = std::string(LOOM_TEST_CACHE) + "/perf";
    jit::NvrtcCompiler compiler(cacheDir);
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, Schedule(), target, compiler, &artifact);
    ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
    EXPECT_EQ(artifact->performanceLosses(), std::vector<std::string>{})
        << arch << " default " << kernel->schedule().ShortDebugString() << " of " << describe(spec)
        << joined(artifact->performanceLosses());

    autotune::TuneOptions options;
    options.offlineCompiles = kTopCandidates;
    options.emulate = false;  // the emulator's own tests run the space
    options.compileThreads = 1;
    options.tokens = 4096;
    options.cacheDir = cacheDir;
    auto report = autotune::tune(spec, target, nullptr, options);
    ASSERT_TRUE(report) << arch << " " << describe(spec) << ": " << report.error().message;
    // The ranking offers its top three, each compiled clean; the compiles
    // the tuner dropped on the way (and replaced) are counted and shown.
    const int offered = std::min<int>(kTopCandidates, int(report->candidates.size()) - report->pruned);
    ASSERT_LE(offered, int(report->candidates.size()));
    for (int i = 0; i < offered; ++i) {
      const autotune::CandidateResult& c = report->candidates[size_t(i)];
      EXPECT_EQ(c.outcome, autotune::Outcome::unmeasured)
          << arch << " top candidate " << i + 1 << " " << c.candidate.key << " of " << describe(spec) << ": "
          << autotune::outcomeName(c.outcome) << ": " << c.reason;
      EXPECT_EQ(c.spillBytes, 0) << c.candidate.key;
    }
    int dropped = 0;
    for (const autotune::CandidateResult& c : report->candidates) {
      if (c.outcome != autotune::Outcome::slow) continue;
      ++dropped;
      std::printf("[ dropped  ] %s %s: %s\n", arch.c_str(), c.candidate.key.c_str(), c.reason.c_str());
    }
    std::printf("[ grid     ] %s %s: default %s clean, top %d clean, %d compiled candidates dropped\n", arch.c_str(),
                describe(spec).c_str(), kernel->schedule().ShortDebugString().c_str(), offered, dropped);
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, Grid, ::testing::Range(0, kGridSpecs), [](const auto& info) {
  const KernelSpec spec = gridSpec(info.param);
  return "p" + std::to_string(spec.pseudo_heads()) + "_d" + std::to_string(spec.head_dim()) + "_h" +
         std::to_string(spec.heads()) + "_g" + std::to_string(spec.kv_heads()) + "_" + std::to_string(info.param);
});

//===--- the SASS gates --------------------------------------------------===//

// The sm_90a default forward of the paper's settings (H 16, P 4, d 128,
// bf16, flat_causal) and a drawn grid (H 8-32 with G dividing it, P 1-8,
// d 64 and 128, every mask, windows on and off, both collapses, bf16 and
// fp16, qk_norm on and off), read in the machine code (runtime/jit/sass.h): every tensor-core
// loop of the attention entry within the gate of docs/performance.md
// (instructions per tensor MFLOP), at least 13 of every 66 exponentials
// between the wait for S and the wait for P V, the ping-pong between
// consumer warpgroups where there are two or more, and no local memory.
constexpr int kSassGridSpecs = 12;

KernelSpec sassGridSpec(int index) {
  if (index == 0)
    return testing::makeSpec({.heads = 16, .kvHeads = 16, .pseudoHeads = 4, .headDim = 128, .dtype = v1::bfloat16,
                              .mask = v1::flat_causal, .window = 0, .collapse = v1::per_head, .ropeTheta = 0});
  std::mt19937_64 rng(gridSeed() + uint64_t(index) * 104729);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  KernelSpec spec;
  const int H = 8 << pick(0, 2);
  spec.set_heads(H);
  spec.set_kv_heads(H >> pick(0, 3));
  spec.set_pseudo_heads(pick(1, 8));
  spec.set_head_dim(index % 2 ? 64 : 128);
  spec.set_dtype(pick(0, 1) ? v1::bfloat16 : v1::float16);
  spec.set_mask(static_cast<v1::MaskMode>(1 + index % 3));
  spec.set_window(pick(0, 2) ? 0 : pick(1, 512));
  spec.set_collapse(pick(0, 1) ? v1::per_head : v1::global);
  spec.set_rope_theta(pick(0, 1) ? 0.0 : 10000.0);
  if (pick(0, 1)) spec.set_qk_norm(v1::KernelSpec::rms);  // as nanochat-style models train
  return spec;
}

v1::ResourceUsage attentionUsage(const jit::Artifact& artifact) {
  for (const v1::ResourceUsage& u : artifact.resources)
    if (u.entry() == kAttentionEntry) return u;
  return v1::ResourceUsage();
}

// An entry's resources with its SASS figures, read now where the compile
// did not (it reads sm_90a's only).
Result<v1::ResourceUsage> sassUsageOf(const jit::Artifact& artifact, std::string_view entry) {
  auto resources = jit::resourcesWithSass(artifact);
  if (!resources) return resources.error();
  for (const v1::ResourceUsage& u : *resources)
    if (u.entry() == entry && u.sass_read()) return u;
  return makeError(std::string(entry) + ": no SASS figures (nvdisasm: " + jit::sass::nvdisasmPath() + ")");
}

class SassGate : public ::testing::TestWithParam<int> {};

TEST_P(SassGate, DefaultForwardLoopsMeetTheGate) {
  const KernelSpec spec = sassGridSpec(GetParam());
  ASSERT_TRUE(validateSpec(spec)) << describe(spec);
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(spec, Schedule(), *parseTarget("sm_90a"), compiler, &artifact);
  ASSERT_TRUE(kernel) << describe(spec) << ": " << kernel.error().message;
  ASSERT_EQ(kernel->schedule().engine(), v1::engine_wgmma) << describe(spec);
  const v1::ResourceUsage usage = attentionUsage(*artifact);
  ASSERT_TRUE(usage.sass_read()) << "the SASS was not read: " << jit::sass::nvdisasmPath()
                                 << " (scripts/setup installs nvdisasm under .tools/)";
  ASSERT_GE(usage.loops_size(), 1) << describe(spec) << ": no tensor-core loop found";
  const std::vector<std::string> misses = jit::sass::gateMisses(usage, spec, kernel->schedule());
  EXPECT_TRUE(misses.empty()) << describe(spec) << " default " << kernel->schedule().ShortDebugString()
                              << joined(misses);
  for (const v1::SassLoop& loop : usage.loops())
    std::printf("[ sass     ] %s %s: %s loop %d instructions, %.0f per tensor MFLOP (gate %.0f, FA3 %.0f), %d of %d "
                "exponentials in the P V window%s\n",
                describe(spec).c_str(), kernel->schedule().ShortDebugString().c_str(),
                loop.masked() ? "masked" : "unmasked", loop.instructions(), loop.instructions_per_tensor_mflop(),
                jit::sass::budgetPerTensorMflop(spec.head_dim(), loop.masked()),
                jit::sass::fa3PerTensorMflop(spec.head_dim(), loop.masked()), loop.exponentials_in_pv_window(),
                loop.exponentials(), loop.ping_pong() ? ", ping-pong" : "");
}

INSTANTIATE_TEST_SUITE_P(Specs, SassGate, ::testing::Range(0, kSassGridSpecs), [](const auto& info) {
  const KernelSpec spec = sassGridSpec(info.param);
  return std::string(info.param == 0 ? "paper_" : "") + "p" + std::to_string(spec.pseudo_heads()) + "_d" +
         std::to_string(spec.head_dim()) + "_h" + std::to_string(spec.heads()) + "_" + std::to_string(info.param);
});

// The sm_90a default backward of the grid (the wgmma one: every grid spec
// has head_dim 64 or 128), read in the machine code: engine wgmma, no
// spills and no local memory in its key-block-outer and dq launches, and
// each of their tensor-core loops printed against FlashAttention-3's
// backward loop (docs/performance.md). The gate, kFa3BackwardPerTensorMflop
// (371) at head_dim 128, holds both launches' unmasked loops (the grid and
// seeds 101-110: key-block-outer 361-364, its lse read in log2 units from
// the collapse backward and with D in one TMA box; the warp-specialised dq
// launch 322-348). FA3's backward is one loop with its causal mask inside; loom's
// masked blocks (the diagonal's, a window's edges: a few of a long
// sequence's) run in loops of their own that compare every element with
// the mask, held at d 128 to 1.5x the gate (dq; the grid and seeds
// 101-110: 437-490) and to 660 (key-block-outer, as before its loop came
// under the gate; 477-600, a token-aligned window's edges the most). At
// head_dim 64 (the softmax's share of a FLOP doubles) within 8% of the
// grid, masked loops 2.5x.
double backwardLoopCeiling(int headDim, bool masked, bool dqLaunch) {
  if (headDim == 128) {
    const double unmasked = jit::sass::kFa3BackwardPerTensorMflop;
    return masked ? (dqLaunch ? unmasked * 1.5 : 660) : unmasked;
  }
  const double unmasked = dqLaunch ? 670 : 700;  // the grid: dq 577-615, key-block-outer 645-650
  return masked ? unmasked * 2.5 : unmasked;
}

// Each tensor-core loop of the backward's key-block-outer and dq launches
// in `artifact`, printed: no local memory, none nested in it where `whole`,
// within ceiling(masked, dq launch) instructions a tensor MFLOP; each
// launch has one at least.
template <class Ceiling>
void expectBackwardLoops(const jit::Artifact& artifact, const std::string& what, bool whole, Ceiling ceiling) {
  for (const char* entry : {kBackwardKvEntry, kBackwardQEntry}) {
    auto usage = sassUsageOf(artifact, entry);
    ASSERT_TRUE(usage) << usage.error().message;
    int tensorLoops = 0;
    for (const v1::SassLoop& loop : usage->loops()) {
      if (loop.tensor_flops_per_warp() <= 0) continue;
      ++tensorLoops;
      EXPECT_EQ(loop.local_memory(), 0) << what << " " << entry;
      if (whole) {
        EXPECT_EQ(loop.inner_loops(), 0) << what << " " << entry;
      }
      const double most = ceiling(loop.masked(), std::string_view(entry) == kBackwardQEntry);
      EXPECT_LE(loop.instructions_per_tensor_mflop(), most)
          << what << " " << entry << (loop.masked() ? " masked" : " unmasked");
      std::printf("[ sass     ] %s %s: %s loop %d instructions, %.0f per tensor MFLOP (at most %.0f)\n", what.c_str(),
                  entry, loop.masked() ? "masked" : "unmasked", loop.instructions(),
                  loop.instructions_per_tensor_mflop(), most);
    }
    EXPECT_GE(tensorLoops, 1) << what << " " << entry << ": no tensor-core loop found";
  }
}

class BackwardGate : public ::testing::TestWithParam<int> {};

TEST_P(BackwardGate, WgmmaBackwardLoopsWithoutSpills) {
  const KernelSpec spec = sassGridSpec(GetParam());
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(spec, Schedule(), *parseTarget("sm_90a"), compiler, &artifact, Direction::backward);
  ASSERT_TRUE(kernel) << describe(spec) << ": " << kernel.error().message;
  ASSERT_EQ(kernel->schedule().engine(), v1::engine_wgmma) << describe(spec) << ": the sm_90a backward default";
  EXPECT_EQ(artifact->spillBytes(), 0) << describe(spec);
  expectBackwardLoops(*artifact, "backward " + describe(spec), /*whole=*/false, [&](bool masked, bool dqLaunch) {
    return backwardLoopCeiling(spec.head_dim(), masked, dqLaunch);
  });
}

INSTANTIATE_TEST_SUITE_P(Specs, BackwardGate, ::testing::Range(0, kSassGridSpecs), [](const auto& info) {
  const KernelSpec spec = sassGridSpec(info.param);
  return std::string(info.param == 0 ? "paper_" : "") + "p" + std::to_string(spec.pseudo_heads()) + "_d" +
         std::to_string(spec.head_dim()) + "_h" + std::to_string(spec.heads()) + "_" + std::to_string(info.param);
});

// The default backward past head_dim 128 (the gradient columns split into
// two parts, a CTA each; layout.h, backwardColumnParts), read in the
// machine code on sm_80, sm_86 (one warp on 16-row blocks at head_dim 256:
// two warps' tiles outgrow its 99 KiB) and sm_90a: grid specs at head_dim
// 160, 192, 224 and 256, the first the paper's settings. Nothing ptxas
// shows losing speed (no spill, no stack frame, no local memory), every
// tensor-core loop whole (no loop nested in it: the tile copies by cursor,
// K and V by their shared-window address). On mma.sync within
// kWideBackwardCeiling a tensor MFLOP (docs/performance.md; the grid's
// unmasked loops: 774-815 at head_dim 256, up to 1054 at 160, where a
// part's 80 columns leave the mask and softmax of S a larger share; one
// warp on sm_86 1007-1017), masked loops 1.35x (the grid: up to 1.33x).
// On sm_90a at head_dim 192 and 256 the default is the wgmma backward,
// held to FlashAttention-3's backward loop at the same head_dim
// (jit::sass::fa3BackwardPerTensorMflop: 413 and 329; the grid: at 192
// key-block-outer 407, dq 277-278, at 256 293-296 and 233), masked loops
// 1.65x (the key-block-outer launch's at 128 are held to 1.78x; FA3's
// causal loop holds its mask, its local one 1.32x its causal at 192; the
// grid and LOOM_GRID_SEED 101-102: 285-427 at 256, 347-616 (1.49x) at 192,
// the most a window's edges).
constexpr int kWideBackwardSpecs = 8;
constexpr double kWideBackwardCeiling = 1100;
constexpr double kWideWgmmaMasked = 1.65;

KernelSpec wideBackwardSpec(int index) {
  constexpr int kWideHeadDims[] = {256, 192, 160, 224};
  KernelSpec spec = index == 0 ? testing::makeSpec({.heads = 16, .kvHeads = 16, .pseudoHeads = 4, .headDim = 256,
                                                    .dtype = v1::bfloat16, .mask = v1::flat_causal, .window = 0,
                                                    .collapse = v1::per_head, .ropeTheta = 10000})
                               : gridSpec(index);
  spec.set_head_dim(kWideHeadDims[index % 4]);
  return spec;
}

class WideBackwardGate : public ::testing::TestWithParam<int> {};

TEST_P(WideBackwardGate, PartsCompileWithoutLossesAndWholeLoops) {
  const KernelSpec spec = wideBackwardSpec(GetParam());
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  for (const char* arch : {"sm_80", "sm_86", "sm_90a"}) {
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, Schedule(), *parseTarget(arch), compiler, &artifact, Direction::backward);
    ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
    const bool wgmma = std::string_view(arch) == "sm_90a" && wgmmaBackwardHeadDim(int(spec.head_dim()));
    EXPECT_EQ(kernel->schedule().engine(), wgmma ? v1::engine_wgmma : v1::engine_mma) << arch << " " << describe(spec);
    EXPECT_EQ(artifact->performanceLosses(), std::vector<std::string>{})
        << arch << " " << describe(spec) << joined(artifact->performanceLosses());
    expectBackwardLoops(*artifact, std::string("wide backward ") + arch + " " + describe(spec), /*whole=*/true,
                        [&](bool masked, bool) {
                          if (wgmma)
                            return jit::sass::fa3BackwardPerTensorMflop(int(spec.head_dim())) *
                                   (masked ? kWideWgmmaMasked : 1.0);
                          return kWideBackwardCeiling * (masked ? 1.35 : 1.0);
                        });
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, WideBackwardGate, ::testing::Range(0, kWideBackwardSpecs), [](const auto& info) {
  const KernelSpec spec = wideBackwardSpec(info.param);
  return std::string(info.param == 0 ? "paper_" : "") + "p" + std::to_string(spec.pseudo_heads()) + "_d" +
         std::to_string(spec.head_dim()) + "_h" + std::to_string(spec.heads()) + "_" + std::to_string(info.param);
});

// The wgmma backward between atoms (head_dim 80, 96, 112: tiles of two
// 64-column atoms, the second filled with zeros past head_dim by TMA), the
// sm_90a default there: the paper's settings and two grid specs at each,
// no loss ptxas shows, whole loops, each tensor-core loop within 1.25x
// (unmasked) and 2x (masked) of FlashAttention-3's hdim-96 backward loop
// (jit::sass::kFa3BackwardHdim96PerTensorMflop, 467: FA3 runs head dims 65
// to 96 on it, 97 to 128 on its hdim-128 one). Measured: unmasked
// key-block-outer 375-395 instructions an iteration, 429-572 a tensor MFLOP
// (488-490 at 96, 5% over FA3's 467: a 64 x 64 block's softmax beside fewer
// columns' products than FA3's 64 x 128), dq 235-252 (359-492); masked up
// to 914 (d 80, a window's edges; FA3's local loop 510) (docs/performance.md).
TEST(BackwardGate, WgmmaBetweenAtoms) {
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  const double anchor = jit::sass::kFa3BackwardHdim96PerTensorMflop;
  for (int index : {0, 2, 5})
    for (int d : {80, 96, 112}) {
      KernelSpec spec = wideBackwardSpec(index);
      spec.set_head_dim(d);
      std::shared_ptr<const jit::Artifact> artifact;
      auto kernel = compileKernel(spec, Schedule(), *parseTarget("sm_90a"), compiler, &artifact, Direction::backward);
      ASSERT_TRUE(kernel) << describe(spec) << ": " << kernel.error().message;
      EXPECT_EQ(kernel->schedule().engine(), v1::engine_wgmma) << describe(spec);
      EXPECT_EQ(artifact->performanceLosses(), std::vector<std::string>{})
          << describe(spec) << joined(artifact->performanceLosses());
      expectBackwardLoops(*artifact, "wgmma backward between atoms " + describe(spec), /*whole=*/true,
                          [&](bool masked, bool) { return anchor * (masked ? 2.0 : 1.25); });
    }
}

// The sm_80 default over mixed rows (materialised mixing: plain attention,
// what FlashAttention-2 computes) of the grid's head_dim 128 specs, in the
// machine code: the unmasked loop at or under FlashAttention-2's 872
// instructions per tensor MFLOP (sass::kFa2PerTensorMflop, counted by this
// reader on FA2's own build), no spills and no local memory, and two CTAs an
// SM on an A100 (its 164 KB of shared memory less 1 KB a CTA, 64 K
// registers). The fused default (raw rows mixed in the loop, work FA2 does
// not do) is printed beside it. Above 16 source heads the program stays at
// ptxas -O3 for its premix (loom::attentionAtO1) and keeps one m-tile a
// warp: printed, held to no spills, not to the budget.
constexpr int64_t kA100SharedPerSm = 167936, kSharedReservedPerCta = 1024, kRegistersPerSm = 65536;

int ctasPerA100Sm(const v1::ResourceUsage& u, const LaunchPlan& launch) {
  const int64_t registers = (u.registers() + 7) / 8 * 8 * launch.threads;  // allocated 8 a thread at a time
  const int64_t shared = launch.sharedMemoryBytes + u.shared_memory_bytes() + kSharedReservedPerCta;
  return int(std::min(kA100SharedPerSm / shared, kRegistersPerSm / std::max<int64_t>(registers, 1)));
}

class Sm80Gate : public ::testing::TestWithParam<int> {};

TEST_P(Sm80Gate, DefaultLoopAtFlashAttention2sBudget) {
  const KernelSpec spec = sassGridSpec(GetParam());
  ASSERT_EQ(spec.head_dim(), 128) << "the sm_80 gate is set at head_dim 128 (FlashAttention-2's anchor)";
  const bool budget = attentionAtO1(2, spec.heads(), spec.kv_heads());
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  const v1::Target target = *parseTarget("sm_80");
  Schedule materialized;
  materialized.set_mix(v1::mix_materialized);
  for (const bool fused : {false, true}) {
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, fused ? Schedule() : materialized, target, compiler, &artifact);
    ASSERT_TRUE(kernel) << describe(spec) << ": " << kernel.error().message;
    if (fused && kernel->schedule().mix() != v1::mix_fused) continue;  // the fused tiles outgrow shared memory
    auto read = sassUsageOf(*artifact, kAttentionEntry);
    ASSERT_TRUE(read) << read.error().message;
    const v1::ResourceUsage& u = *read;
    const std::string what = describe(spec) + " sm_80 " + kernel->schedule().ShortDebugString();
    auto plan = generateKernel(spec, kernel->schedule(), target);
    ASSERT_TRUE(plan) << what << ": " << plan.error().message;
    const auto launch = std::find_if(plan->launches.begin(), plan->launches.end(),
                                     [](const LaunchPlan& l) { return l.name == kAttentionEntry; });
    ASSERT_NE(launch, plan->launches.end()) << what;
    const int ctas = ctasPerA100Sm(u, *launch);
    ASSERT_GE(u.loops_size(), 1) << what << ": no tensor-core loop found";
    for (const v1::SassLoop& loop : u.loops()) {
      std::printf("[ sm_80    ] %s: %s loop %d instructions, %.0f per tensor MFLOP (FA2 %.0f), %d registers, %d "
                  "CTAs an A100 SM\n",
                  what.c_str(), loop.masked() ? "masked" : "unmasked", loop.instructions(),
                  loop.instructions_per_tensor_mflop(), jit::sass::kFa2PerTensorMflop, u.registers(), ctas);
      if (!fused && budget && !loop.masked())
        EXPECT_LE(loop.instructions_per_tensor_mflop(), jit::sass::kFa2PerTensorMflop) << what;
    }
    if (fused) continue;
    EXPECT_EQ(u.spill_store_bytes(), 0) << what;
    EXPECT_EQ(u.local_memory_instructions(), 0) << what;
    if (budget)
      EXPECT_GE(ctas, 2) << what << ": " << launch->sharedMemoryBytes << " B of shared memory, " << u.registers()
                         << " registers";
  }
}

// The grid's even specs are its head_dim 128 ones.
INSTANTIATE_TEST_SUITE_P(Specs, Sm80Gate, ::testing::Range(0, kSassGridSpecs, 2), [](const auto& info) {
  const KernelSpec spec = sassGridSpec(info.param);
  return std::string(info.param == 0 ? "paper_" : "") + "p" + std::to_string(spec.pseudo_heads()) + "_d" +
         std::to_string(spec.head_dim()) + "_h" + std::to_string(spec.heads()) + "_" + std::to_string(info.param);
});

// The premix (materialised mixing, cuda_common.h) of the same grid, on
// sm_80 and sm_90a, in the machine code: each raw element read once with
// wide loads (at least 80% of the entry's global loads 64- or 128-bit, at
// most 16 scalar 16-bit ones), every store wide, no local memory; and the
// issue time its mixing loops model within 1.5x of the bytes' floor where
// the mixing is not FMA-bound by nature (on the FMA units above 16 source
// heads the FMAs per byte alone pass the floor; 16 and more mix on the
// tensor cores where their weights fit, gated, qk_norm on sm_80 included;
// docs/performance.md, The premix). The loop-part
// estimate the tuner uses before anything is compiled stays within 15% of
// the machine code's.
constexpr int kPremixGateTokens = 8192;
constexpr double kPremixFloorRatioGate = 1.5;

class PremixGate : public ::testing::TestWithParam<int> {};

// The grid's specs, then head counts that are not whole k-steps of 16 (the
// tensor path pads them: Llama-style 24 and 40 query heads, 20 with qk_norm).
constexpr int kPremixPaddedSpecs = 5;
KernelSpec premixGateSpec(int index) {
  if (index < kSassGridSpecs) return sassGridSpec(index);
  KernelSpec spec = sassGridSpec(index - kSassGridSpecs);  // its dtype, mask and collapse
  // and one kv head (multi-query: its keys' and values' groups of V products
  // alone, under the FMA path's 16; with 16 query heads beside on the
  // tensor cores)
  const int padded[kPremixPaddedSpecs][5] = {
      {24, 8, 2, 128, 0}, {40, 8, 3, 64, 1}, {20, 4, 4, 128, 1}, {8, 1, 3, 128, 1}, {16, 1, 4, 64, 0}};  // H, G, P, d, qk_norm
  const int* at = padded[index - kSassGridSpecs];
  spec.set_heads(at[0]);
  spec.set_kv_heads(at[1]);
  spec.set_pseudo_heads(at[2]);
  spec.set_head_dim(at[3]);
  spec.set_qk_norm(at[4] ? v1::KernelSpec::rms : v1::KernelSpec::none);
  spec.set_window(0);
  spec.set_rope_theta(10000.0);
  return spec;
}

TEST_P(PremixGate, ReadsOnceWideAndNearTheMemoryFloor) {
  const KernelSpec spec = premixGateSpec(GetParam());
  ASSERT_TRUE(validateSpec(spec)) << describe(spec);
  Schedule materialized;
  materialized.set_mix(v1::mix_materialized);
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  for (const std::string arch : {"sm_80", "sm_90a"}) {
    const v1::Target target = *parseTarget(arch);
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, materialized, target, compiler, &artifact);
    ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
    auto read = sassUsageOf(*artifact, kPremixEntry);
    ASSERT_TRUE(read) << arch << ": " << read.error().message;
    const v1::ResourceUsage& premix = *read;
    const v1::SassMemory& m = premix.memory();
    const std::string what = arch + " " + describe(spec) + ": " + jit::sass::memoryBrief(m);
    EXPECT_GE(m.global_loads_wide(), 0.8 * m.global_loads()) << what;
    EXPECT_LE(m.global_loads_16bit(), 16) << what;
    EXPECT_GT(m.global_stores(), 0) << what;
    EXPECT_EQ(m.global_stores_wide(), m.global_stores()) << what;
    EXPECT_EQ(premix.spill_store_bytes(), 0) << what;
    EXPECT_EQ(premix.local_memory_instructions(), 0) << what;
    const auto issue = autotune::premixIssueOf(premix, spec, kernel->schedule());
    ASSERT_TRUE(issue) << what << ": not one mixing loop per role";
    const autotune::PremixCost measured =
        autotune::estimatePremixCost(spec, kernel->schedule(), target, 1, kPremixGateTokens, issue);
    const autotune::PremixCost estimated =
        autotune::estimatePremixCost(spec, kernel->schedule(), target, 1, kPremixGateTokens);
    EXPECT_NEAR(estimated.issueSeconds / measured.issueSeconds, 1.0, 0.15)
        << what << ": the loop-part estimate is off the machine code's (per group q/k/v " << issue->perGroup[0]
        << " / " << issue->perGroup[1] << " / " << issue->perGroup[2] << ")";
    // A role on the FMA units is FMA-bound above 16 source heads; on the
    // tensor cores (layout.h premixOnTensorCores) it is not.
    const int P = spec.pseudo_heads(), D = spec.head_dim();
    auto tensor = [&](int M) {
      return premixOnTensorCores(M, P, D, int(kernel->schedule().block_m()) / P, int(kernel->schedule().warps()));
    };
    const bool fmaBound = (spec.heads() > 16 && !tensor(spec.heads())) || (spec.kv_heads() > 16 && !tensor(spec.kv_heads()));
    if (!fmaBound) EXPECT_LE(measured.floorRatio(), kPremixFloorRatioGate) << what;
    std::printf("[ premix   ] %s %s: %s; mixing loops %.0f / %.0f / %.0f a group; N %d: floor %.3f ms, issue %.3f "
                "ms (%.2fx; estimated before compiling %.2fx of it)\n",
                arch.c_str(), describe(spec).c_str(), jit::sass::memoryBrief(m).c_str(), issue->perGroup[0],
                issue->perGroup[1], issue->perGroup[2], kPremixGateTokens, measured.memorySeconds * 1e3,
                measured.issueSeconds * 1e3, measured.floorRatio(), estimated.issueSeconds / measured.issueSeconds);
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, PremixGate, ::testing::Range(0, kSassGridSpecs + kPremixPaddedSpecs), [](const auto& info) {
  const KernelSpec spec = premixGateSpec(info.param);
  return std::string(info.param == 0 ? "paper_" : "") + "p" + std::to_string(spec.pseudo_heads()) + "_d" +
         std::to_string(spec.head_dim()) + "_h" + std::to_string(spec.heads()) + "_g" +
         std::to_string(spec.kv_heads()) + "_" + std::to_string(info.param);
});

// The default decode step over a raw paged cache (the serving path), the
// same grid on sm_80 and sm_90a: its attention launch streams the pages
// with asynchronous copies and mixes the raw rows from 16-byte reads, in
// shared memory (keys and values) and in global memory (the step's
// queries): at most 16 scalar 16-bit global loads and 64 scalar 16-bit
// shared loads in the entry (there were 256 and 384); so does the wgmma
// engine's step (sm_90a), whose producer copies into a ring. Its key-block loops
// hold no inner loop (the copies and the mixing unrolled at compile time),
// so their instruction counts, which the floor report divides, are a whole
// block's: a loop nested in them would be counted once, whatever its trips.
// Where the step absorbs the mixing (the default wherever the spec allows
// it), its loop's issue on sm_90a is within kDecodeFloorRatioGate of the
// memory floor for caches of 32k and 128k tokens at batches 1, 8 and 64
// (estimateDecodeFloor, the loop's count from the machine code); the tensor
// pipe's time at the model's mma.sync rate is printed beside it. A step that
// cannot absorb (qk_norm, P above 8, more rows than eight warps hold) prints
// its ratio, not gated: it mixes the cached rows on the FMA units.
class DecodeGate : public ::testing::TestWithParam<int> {};
constexpr double kDecodeFloorRatioGate = 1.5;

// What the decode steps' attention entries show in the machine code:
// asynchronous copies, at most 16 scalar 16-bit global loads and 64 shared
// ones, no spill, and key-block loops with no loop inside.
void expectStreamingStep(const v1::ResourceUsage& attention, const std::string& what) {
  const v1::SassMemory& m = attention.memory();
  EXPECT_GT(m.async_copies(), 0) << what;
  EXPECT_LE(m.global_loads_16bit(), 16) << what;
  EXPECT_LE(m.shared_loads_16bit(), 64) << what;
  EXPECT_EQ(attention.spill_store_bytes(), 0) << what;
  ASSERT_GT(attention.loops_size(), 0) << what;
  for (const v1::SassLoop& loop : attention.loops())
    EXPECT_EQ(loop.inner_loops(), 0) << what << ": the loop at 0x" << std::hex << loop.first_offset();
}

// A decode step's loop issue over the memory floor on sm_90a for caches of
// 32k and 128k tokens at batches 1, 8 and 64 (estimateDecodeFloor, the
// loop's count from the machine code), printed with the tensor pipe's
// ratio; each within `guard` where it is above 0.
void expectDecodeFloor(const KernelSpec& spec, const Schedule& schedule, const autotune::LoopIssue& issue,
                       double guard, const std::string& label, const std::string& what) {
  for (int64_t batch : {1, 8, 64})
    for (int64_t cache : {32768, 131072}) {
      const autotune::DecodeFloor f = autotune::estimateDecodeFloor(spec, schedule, *parseTarget("sm_90a"), batch,
                                                                    cache, 1, /*mixedCache=*/false, issue);
      if (guard > 0) EXPECT_LE(f.floorRatio(), guard) << what << ": B " << batch << ", cache " << cache;
      std::printf("[ floor    ] %s B %lld cache %lld: %.0f instructions a warp a block, issue %.2fx the floor, "
                  "tensor %.2fx\n",
                  label.c_str(), (long long)batch, (long long)cache, issue.unmasked, f.floorRatio(), f.tensorRatio());
    }
}

TEST_P(DecodeGate, StreamsThePagesAndMixesFromWideReads) {
  const KernelSpec spec = sassGridSpec(GetParam());
  ASSERT_TRUE(validateSpec(spec)) << describe(spec);
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  std::string skipped;
  for (const std::string arch : {"sm_80", "sm_90a"}) {
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, Schedule(), *parseTarget(arch), compiler, &artifact, Direction::decode,
                                /*mixedCache=*/false);
    // A step stages one key block's raw rows of all G heads: at G 32 on an
    // A100 (163 KiB) neither the absorbed step's eight tokens nor the mixing
    // step's 16 keys fit (docs/performance.md).
    if (!kernel && spec.kv_heads() >= 32 && kernel.error().message.find("shared memory") != std::string::npos) {
      skipped += arch + " " + describe(spec) + ": no raw-cache decode step fits: " + kernel.error().message + "; ";
      continue;
    }
    ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
    auto read = sassUsageOf(*artifact, kAttentionEntry);
    ASSERT_TRUE(read) << arch << ": " << read.error().message;
    const v1::ResourceUsage& attention = *read;
    const v1::SassMemory& m = attention.memory();
    const std::string what = arch + " decode " + kernel->schedule().ShortDebugString() + " of " + describe(spec) +
                             ": " + jit::sass::memoryBrief(m);
    ASSERT_NO_FATAL_FAILURE(expectStreamingStep(attention, what));
    std::printf("[ decode   ] %s\n", what.c_str());
    if (arch != "sm_90a") continue;
    const auto issue = autotune::loopIssueOf(attention);
    ASSERT_TRUE(issue) << what << ": no key-block loop read";
    // Gated: the absorbed step over a cache it sees whole (a window bounds
    // the keys whatever the cache holds), where its rows' scores per cached
    // byte (H P^2 scores a token against 4 G d bytes) leave the loop's
    // per-score work under the bytes' time, H P^2 <= G d / 2, and its
    // products (every S row against every raw row: H P P' G d
    // multiply-adds a token, P' = P rounded up to a power of two) fit the
    // gate at the tensor pipe's mma.sync rate: where they alone pass it, the
    // step is compute-bound by its math, and fewer instructions could not
    // bring it within the gate (H 32 G 16 P 3 d 64: 3.54x; H 16 G 4 P 3 d
    // 128: 1.80x).
    const bool absorbed = kernel->schedule().absorb_mixing();
    const bool windowed = spec.window() > 0 || spec.window_rows() > 0;
    const bool fewScores = spec.heads() * spec.pseudo_heads() * spec.pseudo_heads() * 2 <=
                           spec.kv_heads() * spec.head_dim();
    bool fewProducts = true;
    for (int64_t batch : {1, 8, 64})
      for (int64_t cache : {32768, 131072})
        fewProducts = fewProducts && autotune::estimateDecodeFloor(spec, kernel->schedule(), *parseTarget(arch), batch,
                                                                   cache, 1, false, *issue)
                                             .tensorRatio() <= kDecodeFloorRatioGate;
    const bool gated = absorbed && !windowed && fewScores && fewProducts;
    const std::string why = gated                               ? "absorbed"
                            : kernel->schedule().tensor_mixing() ? "tensor mixing (gated for the paper's P 8 below)"
                            : !absorbed                         ? "mixed on chip (not gated)"
                            : windowed ? "absorbed, windowed (not gated: the window is the visible cache)"
                            : !fewScores ? "absorbed, H P^2 > G d / 2 (not gated: per-score work bounds it)"
                                         : "absorbed, its products over the gate (not gated: the tensor pipe bounds it)";
    expectDecodeFloor(spec, kernel->schedule(), *issue, gated ? kDecodeFloorRatioGate : 0.0, why, what);
  }
  // The wgmma engine's step over a raw cache (sm_90a): its producer
  // streams the pages into its ring of raw rows by cp.async and mixes them
  // from 16-byte shared reads.
  Schedule wgmma;
  wgmma.set_engine(v1::engine_wgmma);
  std::shared_ptr<const jit::Artifact> wgmmaArtifact;
  auto wgmmaKernel = compileKernel(spec, wgmma, *parseTarget("sm_90a"), compiler, &wgmmaArtifact, Direction::decode,
                                   /*mixedCache=*/false);
  if (wgmmaKernel) {
    auto read = sassUsageOf(*wgmmaArtifact, kAttentionEntry);
    ASSERT_TRUE(read) << read.error().message;
    const v1::SassMemory& m = read->memory();
    const std::string what = "sm_90a wgmma decode " + wgmmaKernel->schedule().ShortDebugString() + " of " +
                             describe(spec) + ": " + jit::sass::memoryBrief(m);
    EXPECT_GT(m.async_copies(), 0) << what;
    EXPECT_LE(m.global_loads_16bit(), 16) << what;
    EXPECT_LE(m.shared_loads_16bit(), 64) << what;
    EXPECT_EQ(read->spill_store_bytes(), 0) << what;
    std::printf("[ decode   ] %s\n", what.c_str());
  } else {
    EXPECT_NE(wgmmaKernel.error().message.find("shared memory"), std::string::npos) << wgmmaKernel.error().message;
    skipped += "the wgmma engine: " + wgmmaKernel.error().message + "; ";
  }
  if (skipped.empty()) return;
  if (skipped.find("sm_90a ") != std::string::npos && skipped.find("sm_80") != std::string::npos) GTEST_SKIP() << skipped;
  std::printf("[ no step  ] %s\n", skipped.c_str());  // the other arch's step was checked
}

// The tensor-mixing step at the paper's P = 8 (H = G = 16, d 128, RoPE;
// qk_norm off and on; and H = G = 8, d 64, whose eight staged rows a token
// make its mix and P' V m16n8k8: tensorMixingNarrow), the default in each
// (it multiplies less than absorbing), sm_80 and sm_90a: the streaming and
// wide reads the grid's steps show, no spill, no inner loop; on sm_90a its
// loop's issue within each case's guard of the memory floor (caches of 32k
// and 128k tokens, batches 1, 8, 64; measured 1.65x, 2.07x with qk_norm and
// 1.86x at d 64, in key blocks of four tokens; 1.87x and 2.30x in blocks of
// two; the FMA units' mixing step sat at 33x and mixing the values too at
// 2.13x). The tensor pipe's time is printed: at the model's mma.sync rate
// it, not the issue, bounds the d 128 step, and R(j) on the mixed keys is a
// third of the issue (docs/performance.md, decode).
TEST(DecodeGate, TensorMixingStepsOfThePapersP8) {
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  struct Case {
    int heads, headDim;
    bool qkNorm;
    double guard;
  };
  for (const Case& c : {Case{16, 128, false, 1.8}, Case{16, 128, true, 2.2}, Case{8, 64, false, 2.0}}) {
    KernelSpec spec = testing::makeSpec({.heads = c.heads, .kvHeads = c.heads, .pseudoHeads = 8, .headDim = c.headDim,
                                         .dtype = v1::bfloat16, .mask = v1::flat_causal, .window = 0,
                                         .collapse = v1::per_head, .ropeTheta = 10000});
    if (c.qkNorm) spec.set_qk_norm(v1::KernelSpec::rms);
    for (const std::string arch : {"sm_80", "sm_90a"}) {
      std::shared_ptr<const jit::Artifact> artifact;
      Schedule tensor;
      tensor.set_tensor_mixing(true);
      auto kernel = compileKernel(spec, tensor, *parseTarget(arch), compiler, &artifact, Direction::decode,
                                  /*mixedCache=*/false);
      ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
      auto byDefault = resolveSchedule(spec, Schedule(), *parseTarget(arch), Direction::decode, false);
      ASSERT_TRUE(byDefault) << byDefault.error().message;
      EXPECT_TRUE(byDefault->tensor_mixing()) << byDefault->ShortDebugString();
      EXPECT_FALSE(byDefault->absorb_mixing()) << byDefault->ShortDebugString();
      auto read = sassUsageOf(*artifact, kAttentionEntry);
      ASSERT_TRUE(read) << arch << ": " << read.error().message;
      const std::string what = arch + " " + describe(spec) + ": " + jit::sass::memoryBrief(read->memory());
      ASSERT_NO_FATAL_FAILURE(expectStreamingStep(*read, what));
      if (arch != "sm_90a") continue;
      const auto issue = autotune::loopIssueOf(*read);
      ASSERT_TRUE(issue) << what << ": no key-block loop read";
      expectDecodeFloor(spec, kernel->schedule(), *issue, c.guard,
                        "tensor mixing, " + describe(spec) + ",", what);
    }
  }
}

// H above 16 (layout.h, stepHeads): the one-CTA steps in CTAs of up to 16
// heads where every head does not fit one, sm_80 and sm_90a, RoPE, bf16,
// d 128: H 32 G 8 P 4 absorbed in two CTAs of 16 (the stacked mixing step
// before them: 12.6x its memory floor in issue), H 32 G 32 P 4 tensor
// mixing in two (the per-head mixing step: 30.5x), and H 32 G 8 P 2
// absorbed in one CTA of 32 (eight warps hold a token of each). The plan
// picks them by default, with the chunk's CTAs in its grid; the streaming
// and wide reads of the grid's steps, no spill, no inner loop; on sm_90a
// the loop's issue within each case's guard of the memory floor (caches of
// 32k and 128k tokens, batches 1, 8, 64; measured 1.78x, 2.34x, 0.91x at B 8, 32k).
TEST(DecodeGate, OneCtaStepsInChunksOfHeads) {
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  struct Case {
    int kvHeads, pseudoHeads;
    bool tensor;
    int ctaHeads;
    double guard;
  };
  for (const Case& c : {Case{8, 4, false, 16, 2.0}, Case{32, 4, true, 16, 2.5}, Case{8, 2, false, 32, 1.0}}) {
    const KernelSpec spec =
        testing::makeSpec({.heads = 32, .kvHeads = c.kvHeads, .pseudoHeads = c.pseudoHeads, .headDim = 128,
                           .dtype = v1::bfloat16, .mask = v1::flat_causal, .window = 0, .collapse = v1::per_head,
                           .ropeTheta = 10000});
    for (const std::string arch : {"sm_80", "sm_90a"}) {
      auto byDefault = resolveSchedule(spec, Schedule(), *parseTarget(arch), Direction::decode, false);
      ASSERT_TRUE(byDefault) << byDefault.error().message;
      EXPECT_EQ(byDefault->tensor_mixing(), c.tensor) << arch << " " << byDefault->ShortDebugString();
      EXPECT_EQ(byDefault->absorb_mixing(), !c.tensor) << arch << " " << byDefault->ShortDebugString();
      std::shared_ptr<const jit::Artifact> artifact;
      auto kernel = compileKernel(spec, *byDefault, *parseTarget(arch), compiler, &artifact, Direction::decode,
                                  /*mixedCache=*/false);
      ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
      const int most = stepMostHeads(c.tensor, c.pseudoHeads, 128);
      EXPECT_EQ(stepHeads(32, c.kvHeads, most), c.ctaHeads);
      EXPECT_NE(kernel->source().find("stacked_heads = " + std::to_string(c.ctaHeads) + ";"), std::string::npos);
      auto read = sassUsageOf(*artifact, kAttentionEntry);
      ASSERT_TRUE(read) << arch << ": " << read.error().message;
      const std::string what = arch + " " + describe(spec) + " " + kernel->schedule().ShortDebugString() + ": " +
                               jit::sass::memoryBrief(read->memory());
      ASSERT_NO_FATAL_FAILURE(expectStreamingStep(*read, what));
      if (arch != "sm_90a") continue;
      const auto issue = autotune::loopIssueOf(*read);
      ASSERT_TRUE(issue) << what << ": no key-block loop read";
      expectDecodeFloor(spec, kernel->schedule(), *issue, c.guard,
                        std::string(c.tensor ? "tensor mixing, " : "absorbed, ") + describe(spec) + ",", what);
    }
  }
}

// An absorbed step of few rows is a CTA of one warp (H 16 P 1: a token of
// each head is one 16-row m-tile), which issues on one of an SM's four
// sub-partitions. Its default kv_splits cover the sub-partitions as far as
// an SM's shared memory holds such CTAs at once (defaultDecodeSplits), not
// only the SMs (132): H = G = 16 at d 64 with qk_norm takes 85 KiB a CTA,
// two an SM, 264 splits (the Gram matrices and their quadratic forms, about
// 550 instructions a token on the one warp; 1.26x the floor at B 1, 32k;
// at 256 splits, the old cap, 1.34x; with the SMs' splits, 2.53x);
// H 16 G 4 with token_causal takes 23 KiB, four an SM, 528 capped at 512
// (the drawn spec of LOOM_GRID_SEED 116: 1.63x at 256 splits). For each,
// the step is within the gate of the memory floor, the same estimate with
// one CTA an SM (the splits set to the SM count) is as many times slower as
// the SM held CTAs, and no launch spills (the combine of 256 splits had,
// unrolled whole; it now takes 512).
TEST(DecodeGate, OneWarpStepsShareTheirSm) {
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  const v1::Target target = *parseTarget("sm_90a");
  const struct {
    int kvHeads;
    v1::MaskMode mask;
    int ctasPerSm, splits;  // at least those CTAs an SM at once
  } cases[] = {{16, v1::flat_causal, 2, 264}, {4, v1::token_causal, 4, 512}};
  for (const auto& c : cases) {
    KernelSpec spec = testing::makeSpec({.heads = 16, .kvHeads = c.kvHeads, .pseudoHeads = 1, .headDim = 64,
                                         .dtype = v1::bfloat16, .mask = c.mask, .window = 0,
                                         .collapse = v1::per_head, .ropeTheta = 10000});
    spec.set_qk_norm(v1::KernelSpec::rms);
    SCOPED_TRACE(describe(spec));
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, Schedule(), target, compiler, &artifact, Direction::decode, /*mixedCache=*/false);
    ASSERT_TRUE(kernel) << kernel.error().message;
    const Schedule& schedule = kernel->schedule();
    ASSERT_TRUE(schedule.absorb_mixing()) << schedule.ShortDebugString();
    ASSERT_EQ(schedule.warps(), 1) << schedule.ShortDebugString();
    for (const auto& usage : artifact->resources)  // the combine of its splits too
      EXPECT_EQ(usage.spill_store_bytes() + usage.spill_load_bytes(), 0) << usage.ShortDebugString();
    EXPECT_EQ(schedule.kv_splits(), c.splits) << "one sequence's CTAs cover the SMs' sub-partitions it holds";
    auto read = sassUsageOf(*artifact, kAttentionEntry);
    ASSERT_TRUE(read) << read.error().message;
    const std::string what = "sm_90a " + describe(spec) + " " + schedule.ShortDebugString() + ": " +
                             jit::sass::memoryBrief(read->memory());
    ASSERT_NO_FATAL_FAILURE(expectStreamingStep(*read, what));
    const auto issue = autotune::loopIssueOf(*read);
    ASSERT_TRUE(issue) << what << ": no key-block loop read";
    const autotune::DecodeFloor shared =
        autotune::estimateDecodeFloor(spec, schedule, target, 1, 32768, 1, false, issue);
    EXPECT_GE(shared.ctasPerSm, c.ctasPerSm) << what;
    expectDecodeFloor(spec, schedule, *issue, kDecodeFloorRatioGate, "absorbed, one warp,", what);
    Schedule alone = schedule;  // the SMs' splits: a CTA an SM, three sub-partitions idle
    alone.set_kv_splits(int32_t(smCountOf(target)));
    const autotune::DecodeFloor lone = autotune::estimateDecodeFloor(spec, alone, target, 1, 32768, 1, false, issue);
    EXPECT_GT(lone.floorRatio(), kDecodeFloorRatioGate) << what;
    const double held = double(c.splits) / double(smCountOf(target));  // splits an SM
    EXPECT_NEAR(lone.floorRatio() / shared.floorRatio(), held, 0.15 * held) << what;
  }
}

// GQA at P 5 to 8 (H / G even, tensorMixingPairs): the tensor-mixing step,
// the default, mixes two tokens' keys at once, the first's in a warp's
// rows lane/4 and the next's in lane/4 + 8, which both of its heads score
// whole, folds and multiplies both tokens' values in one k-step, and takes
// key blocks of four tokens (two such passes) (sm_80 and sm_90a, bf16,
// RoPE, d 128): every key-block loop issues the products
// tensorMixingTokenMacs counts, half of what a token at a time issued (at
// G 2 and 4 a pass's staged rows fit 8: the mix and P' V are m16n8k8,
// tensorMixingNarrow, and the count follows); the streaming and wide reads
// of the grid's steps; on sm_90a the loop's issue within each case's guard
// of the memory floor (caches of 32k and 128k, batches 1, 8, 64; measured
// at B 8, 32k: 2.24x, 4.44x and 3.86x, the tensor pipe 1.86x, 3.71x and
// 5.96x; a token at a time in blocks of two issued about 1.85x the
// instructions a token: `loom compile --decode --sass`, 913, 921, 911 a
// block of two -> 996, 985, 968 a block of four). H 8 G 2 is compute-bound
// by nature (H P^2 / G = 144 FLOP a cached byte).
TEST(DecodeGate, PairedHeadsMixTwoTokensAPass) {
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  struct Case {
    int heads, kvHeads, pseudoHeads;
    double guard;
  };
  for (const Case& c : {Case{8, 4, 5, 2.5}, Case{8, 2, 6, 4.9}, Case{32, 8, 8, 4.3}}) {
    const KernelSpec spec =
        testing::makeSpec({.heads = c.heads, .kvHeads = c.kvHeads, .pseudoHeads = c.pseudoHeads, .headDim = 128,
                           .dtype = v1::bfloat16, .mask = v1::flat_causal, .window = 0, .collapse = v1::per_head,
                           .ropeTheta = 10000});
    ASSERT_TRUE(tensorMixingPairs(c.heads, c.kvHeads));
    for (const std::string arch : {"sm_80", "sm_90a"}) {
      std::shared_ptr<const jit::Artifact> artifact;
      auto kernel = compileKernel(spec, Schedule(), *parseTarget(arch), compiler, &artifact, Direction::decode,
                                  /*mixedCache=*/false);
      ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
      ASSERT_TRUE(kernel->schedule().tensor_mixing()) << arch << " " << kernel->schedule().ShortDebugString();
      auto read = sassUsageOf(*artifact, kAttentionEntry);
      ASSERT_TRUE(read) << arch << ": " << read.error().message;
      const std::string what = arch + " " + describe(spec) + " " + kernel->schedule().ShortDebugString() + ": " +
                               jit::sass::memoryBrief(read->memory());
      ASSERT_NO_FATAL_FAILURE(expectStreamingStep(*read, what));
      const int ctaHeads = oneCtaHeads(true, c.heads, c.kvHeads, c.pseudoHeads, 128);
      const double warpBlockFlops = 2.0 * kTensorMixingTokens *
                                    double(tensorMixingTokenMacs(c.heads, c.kvHeads, 128, /*splitWeights=*/true)) /
                                    double(c.heads / ctaHeads * tensorMixingWarps(ctaHeads));
      for (const v1::SassLoop& loop : read->loops())
        EXPECT_EQ(loop.tensor_flops_per_warp(), warpBlockFlops) << what << ": the loop at 0x" << std::hex
                                                                << loop.first_offset();
      if (arch != "sm_90a") continue;
      const auto issue = autotune::loopIssueOf(*read);
      ASSERT_TRUE(issue) << what << ": no key-block loop read";
      char flops[48];
      std::snprintf(flops, sizeof flops, " %.3f tensor MFLOP a warp a block,", warpBlockFlops * 1e-6);
      expectDecodeFloor(spec, kernel->schedule(), *issue, c.guard,
                        "paired tensor mixing, " + describe(spec) + "," + flops, what);
    }
  }
}

// The same for a mixed cache's step: its rows copied through the page table
// unrolled, no inner loop in its key-block loops.
TEST_P(DecodeGate, MixedCacheLoopsHoldNoInnerLoop) {
  const KernelSpec spec = sassGridSpec(GetParam());
  jit::NvrtcCompiler compiler(std::string(LOOM_TEST_CACHE) + "/perf");
  for (const std::string arch : {"sm_80", "sm_90a"}) {
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, Schedule(), *parseTarget(arch), compiler, &artifact, Direction::decode,
                                /*mixedCache=*/true);
    ASSERT_TRUE(kernel) << arch << " " << describe(spec) << ": " << kernel.error().message;
    auto read = sassUsageOf(*artifact, kAttentionEntry);
    ASSERT_TRUE(read) << arch << ": " << read.error().message;
    const std::string what = arch + " mixed-cache decode " + kernel->schedule().ShortDebugString() + " of " + describe(spec);
    EXPECT_GT(read->memory().async_copies(), 0) << what;
    EXPECT_EQ(read->spill_store_bytes(), 0) << what;
    ASSERT_GT(read->loops_size(), 0) << what;
    for (const v1::SassLoop& loop : read->loops())
      EXPECT_EQ(loop.inner_loops(), 0) << what << ": the loop at 0x" << std::hex << loop.first_offset();
  }
  // The wgmma step's producer streams a mixed cache's rows with
  // asynchronous copies too (the page table is no tensor map).
  Schedule wgmma;
  wgmma.set_engine(v1::engine_wgmma);
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(spec, wgmma, *parseTarget("sm_90a"), compiler, &artifact, Direction::decode,
                              /*mixedCache=*/true);
  if (!kernel && kernel.error().message.find("shared memory") != std::string::npos)
    GTEST_SKIP() << "no wgmma step over a mixed cache fits " << describe(spec) << ": " << kernel.error().message;
  ASSERT_TRUE(kernel) << describe(spec) << ": " << kernel.error().message;
  auto read = sassUsageOf(*artifact, kAttentionEntry);
  ASSERT_TRUE(read) << read.error().message;
  EXPECT_GT(read->memory().async_copies(), 0) << describe(spec) << ": " << jit::sass::memoryBrief(read->memory());
  EXPECT_EQ(read->spill_store_bytes(), 0) << describe(spec);
}

INSTANTIATE_TEST_SUITE_P(Specs, DecodeGate, ::testing::Range(0, kSassGridSpecs), [](const auto& info) {
  const KernelSpec spec = sassGridSpec(info.param);
  return std::string(info.param == 0 ? "paper_" : "") + "p" + std::to_string(spec.pseudo_heads()) + "_d" +
         std::to_string(spec.head_dim()) + "_h" + std::to_string(spec.heads()) + "_g" +
         std::to_string(spec.kv_heads()) + "_" + std::to_string(info.param);
});

// The gate fails a kernel whose loop lost the overlap or the ping-pong: the
// shipped hopper.h, then with the wait for P V moved to the start of the
// softmax (every exponential after it), then with the turns at the tensor
// cores taken and given nowhere.
TEST(SassGate, FailsALoopWithoutOverlapOrPingPong) {
  const KernelSpec spec = sassGridSpec(0);
  auto plan = generateKernel(spec, Schedule(), *parseTarget("sm_90a"));
  ASSERT_TRUE(plan) << plan.error().message;
  std::string hopper;
  for (const tile::EmbeddedFile& file : tile::embeddedHeaders())
    if (std::string_view(file.path) == "loom/tile/hopper.h") hopper = file.text;
  const std::string include = "#include \"loom/tile/hopper.h\"";
  const size_t included = plan->source.find(include);
  ASSERT_NE(included, std::string::npos);
  auto withHopper = [&](const std::string& text) {
    return std::string(plan->source).replace(included, include.size(), text);
  };
  auto mutated = [&](const std::string& from, const std::string& to) {
    const size_t at = hopper.find(from);
    EXPECT_NE(at, std::string::npos) << "hopper.h changed; update this test: " << from;
    return at == std::string::npos ? std::string() : withHopper(std::string(hopper).replace(at, from.size(), to));
  };
  const std::string softmax = "  constexpr float scale = C::scale * kLog2e;\n  #pragma unroll\n  for (int h = 0; h < 2; ++h) {\n"
                              "    float rowMax";
  const std::string waitFirst = "  constexpr float scale = C::scale * kLog2e;\n  hopper::wgmmaWait<0>();\n"
                                "  #pragma unroll\n  for (int h = 0; h < 2; ++h) {\n    float rowMax";
  const std::string turns = "  if constexpr (Geometry<C>::consumers > 1) ptx::barSyncId";
  const std::string noTurns = "  if constexpr (Geometry<C>::consumers > 100) ptx::barSyncId";
  const std::string give = "  if constexpr (Geometry<C>::consumers > 1) ptx::barArriveId";
  const std::string noGive = "  if constexpr (Geometry<C>::consumers > 100) ptx::barArriveId";
  const std::string hoisted = mutated(softmax, waitFirst);
  std::string unscheduled = mutated(turns, noTurns);
  ASSERT_FALSE(hoisted.empty());
  ASSERT_FALSE(unscheduled.empty());
  {
    const size_t at = unscheduled.find(give);
    ASSERT_NE(at, std::string::npos);
    unscheduled.replace(at, give.size(), noGive);
  }
  jit::NvrtcCompiler compiler("");
  for (const auto& [name, source, shouldPass] :
       {std::tuple<std::string, std::string, bool>{"shipped", plan->source, true},
        {"wait for P V first", hoisted, false},
        {"no ping-pong", unscheduled, false}}) {
    auto artifact = compiler.compile(source, "sm_90a");
    ASSERT_TRUE(artifact) << name << ": " << artifact.error().message << "\n" << artifact.error().log;
    const v1::ResourceUsage usage = attentionUsage(**artifact);
    ASSERT_TRUE(usage.sass_read()) << name;
    const std::vector<std::string> misses = jit::sass::budgetMisses(usage, 128, /*pingPong=*/true);
    if (shouldPass) EXPECT_TRUE(misses.empty()) << name << joined(misses);
    else EXPECT_FALSE(misses.empty()) << name << ": the gate let it through";
  }
}

//===--- the report -----------------------------------------------------===//

// ptxas's C7xxx notes come through as fields of the entry they name (once
// each, however often ptxas repeats them), and a serialised wgmma is flagged.
TEST(Report, KeepsPtxasPerformanceNotes) {
  const std::string log =
      "ptxas info    : Compiling entry function 'iha_attention' for 'sm_90a'\n"
      "ptxas info    : Function properties for iha_attention\n"
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 168 registers, used 1 barriers, 384 bytes cmem[0]\n"
      "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
      "program dependence on compiler-inserted WG.AR in divergent path in the function 'iha_attention'\n"
      "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
      "program dependence on compiler-inserted WG.AR in divergent path in the function 'iha_attention'\n"
      "ptxas info    : (C7519) Potential Performance Loss: warpgroup.arrive is injected in the function "
      "'iha_attention'\n";
  const auto usage = jit::parsePtxasReport(log);
  ASSERT_EQ(usage.size(), 1u);
  EXPECT_EQ(usage[0].performance_notes_size(), 2);
  EXPECT_TRUE(usage[0].serialized_wgmma());
  const std::vector<std::string> losses = jit::performanceLosses(usage);
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_NE(losses[0].find("C7520"), std::string::npos) << losses[0];
}

// fp64 arithmetic and local memory are read off each entry's PTX from a
// real NVRTC compile; moves and loads of doubles are not counted.
TEST(Report, CountsFp64AndLocalMemoryInThePtx) {
  const std::string source = R"(
extern "C" __global__ void with_doubles(const float* x, float* y, int n, int k) {
  double acc = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += double(x[i]) * 1.000000001;
  float scratch[64];
  for (int i = 0; i < 64; ++i) scratch[i] = x[(i * k) % n];
  y[threadIdx.x] = float(acc) + scratch[k % 64];
}
extern "C" __global__ void plain(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x] * 2.0f; }
)";
  jit::NvrtcCompiler compiler("");
  auto artifact = compiler.compile(source, "sm_80");
  ASSERT_TRUE(artifact) << artifact.error().message << "\n" << artifact.error().log;
  int checked = 0;
  for (const v1::ResourceUsage& u : (*artifact)->resources) {
    if (u.entry() == "with_doubles") {
      EXPECT_GT(u.fp64_instructions(), 0);
      EXPECT_GT(u.local_memory_instructions(), 0);
      ++checked;
    } else if (u.entry() == "plain") {
      EXPECT_EQ(u.fp64_instructions(), 0);
      EXPECT_EQ(u.local_memory_instructions(), 0);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2);
  EXPECT_FALSE((*artifact)->performanceLosses().empty());
}

// The fix behind "no serialised wgmma", checked with ptxas itself: the owed
// P V issued only under a branch ptxas cannot prove warpgroup-uniform (here
// on a thread's own softmax correction; hopper.h once branched on whether
// anything was owed, before the pipeline's state was warp-uniform) makes
// ptxas serialise every wgmma of the kernel and say so (C7520); the report
// flags it and the tuner would drop the kernel. As shipped, the same program
// has no such note.
TEST(Report, ConditionalOwedProductSerialisesWgmma) {
  const KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 2, .headDim = 64,
                                             .dtype = v1::bfloat16, .mask = v1::flat_causal, .window = 0,
                                             .collapse = v1::per_head, .ropeTheta = 0});
  auto plan = generateKernel(spec, Schedule(), *parseTarget("sm_90a"));
  ASSERT_TRUE(plan) << plan.error().message;
  ASSERT_EQ(plan->schedule.engine(), v1::engine_wgmma);
  std::string hopper;
  for (const tile::EmbeddedFile& file : tile::embeddedHeaders())
    if (std::string_view(file.path) == "loom/tile/hopper.h") hopper = file.text;
  const std::string unconditional =
      "  hopper::issueOwedPv<C>(acc, pipe);\n"
      "  hopper::wgmmaCommit();\n"
      "  hopper::giveTurn<C>(acc);\n"
      "  hopper::wgmmaWait<1>();";
  const std::string conditional =
      "  if (acc.scale[0] > 0.0f) {\n"
      "    hopper::issueOwedPv<C>(acc, pipe);\n"
      "    hopper::wgmmaCommit();\n"
      "    hopper::giveTurn<C>(acc);\n"
      "    hopper::wgmmaWait<1>();\n"
      "  } else {\n"
      "    hopper::giveTurn<C>(acc);\n"
      "    hopper::wgmmaWait<0>();\n"
      "  }";
  const size_t at = hopper.find(unconditional);
  ASSERT_NE(at, std::string::npos) << "hopper.h's mma_qk changed; update this test";
  const std::string include = "#include \"loom/tile/hopper.h\"";
  const size_t included = plan->source.find(include);
  ASSERT_NE(included, std::string::npos);
  std::string mutated = plan->source;
  mutated.replace(included, include.size(), std::string(hopper).replace(at, unconditional.size(), conditional));

  jit::NvrtcCompiler compiler("");
  auto shipped = compiler.compile(plan->source, "sm_90a");
  auto serialised = compiler.compile(mutated, "sm_90a");
  ASSERT_TRUE(shipped) << shipped.error().message;
  ASSERT_TRUE(serialised) << serialised.error().message << "\n" << serialised.error().log;
  EXPECT_FALSE(attentionUsage(**shipped).serialized_wgmma());
  // Named barriers take their thread counts as immediates (the ping-pong's
  // ids are warp-uniform registers: a branch choosing among immediates
  // would itself serialise the wgmma, see ptx::barSyncId).
  EXPECT_NE((*shipped)->ptx.find("bar.sync"), std::string::npos);
  EXPECT_EQ((*shipped)->performanceLosses(), std::vector<std::string>{});
  EXPECT_TRUE(attentionUsage(**serialised).serialized_wgmma()) << (*serialised)->log;
  EXPECT_FALSE((*serialised)->performanceLosses().empty());
}

// The sm_80 program overlaps Q's load with the first K/V copies: Q's
// cp.async group goes out, then the K/V prologue's stages - 1 groups, and
// the first wait lets those stay in flight (wait_group stages - 1, not 0).
// The emulator tests run these programs and would flag a read of a tile
// whose copy has not landed.
TEST(Report, QLoadOverlapsTheFirstKeyBlocks) {
  const KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 2, .headDim = 64,
                                             .dtype = v1::float16, .mask = v1::flat_causal, .window = 0,
                                             .collapse = v1::per_head, .ropeTheta = 0});
  jit::NvrtcCompiler compiler("");
  for (int stages : {2, 3}) {
    Schedule schedule;
    schedule.set_mix(v1::mix_materialized);
    schedule.set_stages(stages);
    auto plan = generateKernel(spec, schedule, *parseTarget("sm_80"));
    ASSERT_TRUE(plan) << plan.error().message;
    auto artifact = compiler.compile(plan->source, "sm_80");
    ASSERT_TRUE(artifact) << artifact.error().message;
    const std::string& ptx = (*artifact)->ptx;
    const size_t entry = ptx.find(std::string(".entry ") + kAttentionEntry);
    ASSERT_NE(entry, std::string::npos);
    const size_t end = ptx.find(".entry ", entry + 1);
    const std::string body = ptx.substr(entry, end == std::string::npos ? std::string::npos : end - entry);
    const size_t wait = body.find("cp.async.wait_group");
    ASSERT_NE(wait, std::string::npos);
    EXPECT_EQ(body.compare(wait, 22, "cp.async.wait_group " + std::to_string(stages - 1) + ";"), 0)
        << body.substr(wait, 40);
    int commits = 0;
    for (size_t at = body.find("cp.async.commit_group"); at < wait; at = body.find("cp.async.commit_group", at + 1))
      ++commits;
    // Q's group and the prologue's (a loop over stages - 1 blocks, which
    // ptxas may keep rolled) come before it.
    EXPECT_GE(commits, 2);
  }
}

}  // namespace
}  // namespace loom
