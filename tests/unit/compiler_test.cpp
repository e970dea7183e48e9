// generateKernel as a library: determinism, the plan, and the diagnostics
// for specs and schedules the compiler cannot build.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <regex>

#include "loom/compiler.h"
#include "test_util.h"

namespace loom {
namespace {

KernelSpec baseSpec() {
  return testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 4, .headDim = 32, .dtype = v1::float16,
                            .ropeTheta = 10000});
}

std::string errorOf(const KernelSpec& spec, const Schedule& schedule) {
  auto plan = generateKernel(spec, schedule, *parseTarget("cpu"));
  return plan ? std::string("(no error)") : plan.error().message;
}

TEST(Compiler, GenerationIsDeterministic) {
  auto a = generateKernel(baseSpec(), Schedule(), *parseTarget("sm_80"));
  auto b = generateKernel(baseSpec(), Schedule(), *parseTarget("sm_80"));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->source, b->source);
  EXPECT_EQ(a->sourceHash, b->sourceHash);
}

TEST(Compiler, TargetsDifferOnlyInTheInclude) {
  auto host = generateKernel(baseSpec(), Schedule(), *parseTarget("cpu"));
  auto cuda = generateKernel(baseSpec(), Schedule(), *parseTarget("sm_90a"));
  ASSERT_TRUE(host && cuda);
  std::string swapped = host->source;
  swapped.replace(swapped.find("loom/tile/host.h"), std::string("loom/tile/host.h").size(), "loom/tile/cuda.h");
  EXPECT_EQ(swapped, cuda->source);
}

TEST(Compiler, PlanFollowsTheSchedule) {
  Schedule separate;
  separate.set_mix(v1::mix_materialized);
  separate.set_collapse(v1::collapse_separate);
  auto plan = generateKernel(baseSpec(), separate, *parseTarget("cpu"));
  ASSERT_TRUE(plan) << plan.error().message;
  ASSERT_EQ(plan->launches.size(), 3u);
  EXPECT_EQ(plan->launches[0].name, "iha_premix");
  EXPECT_EQ(plan->launches[1].name, "iha_attention");
  EXPECT_EQ(plan->launches[1].rowsPerToken, 4);
  EXPECT_EQ(plan->launches[1].gridY, 4);
  EXPECT_EQ(plan->launches[2].name, "iha_collapse");
  EXPECT_EQ(plan->workspaces.size(), 4u);

  auto fused = generateKernel(baseSpec(), Schedule(), *parseTarget("cpu"));
  ASSERT_TRUE(fused);
  ASSERT_EQ(fused->launches.size(), 1u);
  EXPECT_TRUE(fused->workspaces.empty());
  EXPECT_EQ(fused->schedule.block_m(), 64);
  EXPECT_EQ(fused->schedule.warps(), 4);
}

// The default for every P: four warps of one 16-row tile each on the mma
// engine (two consumer warpgroups on sm_90a), whatever P; the CTA owns the
// whole tokens among its rows, and the attention grid steps by those.
TEST(Compiler, DefaultScheduleAlwaysValid) {
  for (int P = 1; P <= 12; ++P) {
    KernelSpec spec = baseSpec();
    spec.set_pseudo_heads(P);
    auto plan = generateKernel(spec, Schedule(), *parseTarget("cpu"));
    ASSERT_TRUE(plan) << "P=" << P << ": " << plan.error().message;
    EXPECT_EQ(plan->schedule.warps(), 4) << "P=" << P;
    EXPECT_EQ(plan->schedule.block_m(), 64) << "P=" << P;
    for (const LaunchPlan& launch : plan->launches) {
      if (launch.name == "iha_attention") {
        EXPECT_EQ(launch.rowsPerCta, 64 / P * P) << "P=" << P;
      }
    }
    spec.set_head_dim(64);
    spec.set_dtype(v1::bfloat16);
    auto hopper = resolveSchedule(spec, Schedule(), *parseTarget("sm_90a"));
    ASSERT_TRUE(hopper) << "P=" << P << ": " << hopper.error().message;
    EXPECT_EQ(hopper->engine(), v1::engine_wgmma) << "P=" << P;
    EXPECT_EQ(hopper->warps(), 8) << "P=" << P;
  }
}

TEST(Compiler, DiagnosticsNameTheField) {
  Schedule schedule;
  schedule.set_block_m(18);
  schedule.set_warps(1);
  EXPECT_NE(errorOf(baseSpec(), schedule).find("schedule.block_m (18) must be a multiple of 16 rows per warp x 1 warps"),
            std::string::npos);
  KernelSpec many = baseSpec();
  many.set_pseudo_heads(20);
  schedule.set_block_m(16);
  EXPECT_NE(errorOf(many, schedule).find("schedule.block_m (16) must hold at least one token (pseudo_heads = 20 rows)"),
            std::string::npos);

  schedule = Schedule();
  schedule.set_block_m(32);
  schedule.set_warps(4);
  EXPECT_NE(errorOf(baseSpec(), schedule).find("16 rows per warp x 4 warps"), std::string::npos);

  schedule = Schedule();
  schedule.set_stages(9);
  EXPECT_NE(errorOf(baseSpec(), schedule).find("schedule.stages (9)"), std::string::npos);

  KernelSpec spec = baseSpec();
  spec.set_kv_heads(3);
  EXPECT_NE(errorOf(spec, Schedule()).find("kv_heads (3) must divide heads (4)"), std::string::npos);

  spec = baseSpec();
  spec.set_head_dim(20);
  EXPECT_NE(errorOf(spec, Schedule()).find("head_dim (20) is unsupported"), std::string::npos);
}

// Found by fuzz_schedule_json: a given field far out of range reached the
// shared-memory arithmetic of the defaults (a signed overflow) before any
// check. Each is refused first, naming it, on every target.
TEST(Compiler, FieldsOutOfEveryRangeAreRefusedBeforeDefaulting) {
  Schedule huge;
  huge.set_block_m(12571251);
  huge.set_mix(v1::mix_materialized);
  for (const char* arch : {"cpu", "sm_80", "sm_90a"}) {
    auto resolved = resolveSchedule(baseSpec(), huge, *parseTarget(arch));
    ASSERT_FALSE(resolved) << arch;
    EXPECT_NE(resolved.error().message.find("schedule.block_m (12571251) must be in [1, 256], or 0 for the default"),
              std::string::npos)
        << resolved.error().message;
  }
  Schedule negative;
  negative.set_warps(-4);
  EXPECT_NE(errorOf(baseSpec(), negative).find("schedule.warps (-4) must be in [1, 12]"), std::string::npos);
  Schedule registers;
  registers.set_producer_registers(100000);
  EXPECT_NE(errorOf(baseSpec(), registers).find("schedule.producer_registers (100000)"), std::string::npos);
}

// Found by fuzz_spec_json: rope_theta -0.0 passed as "0" but is other bytes
// (another cache key for the same function, and it printed back as +0).
TEST(Compiler, NegativeZeroRopeThetaIsRefused) {
  KernelSpec spec = baseSpec();
  spec.set_rope_theta(-0.0);
  EXPECT_NE(errorOf(spec, Schedule()).find("rope_theta must be 0 (no rotary embedding) or positive"),
            std::string::npos);
  spec.set_rope_theta(0.0);
  EXPECT_TRUE(generateKernel(spec, Schedule(), *parseTarget("cpu")));
}

// The rotary table the device reads: each pair's frequency in turns per
// position as a 64-bit fixed-point fraction. The device keeps the top 32 bits
// of position * turns (a wrapping integer product) as the angle's fraction of
// a turn; at every position up to 2^24 rows that is within 1e-6 rad of the
// exact angle, where fp32 products would be off by whole radians.
TEST(Compiler, RopeTurnsKeepThePhaseAtLongPositions) {
  KernelSpec spec = baseSpec();
  spec.set_head_dim(128);
  spec.set_rope_theta(500000);
  auto plan = generateKernel(spec, Schedule(), *parseTarget("sm_80"));
  ASSERT_TRUE(plan) << plan.error().message;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(plan->source, m, std::regex(R"(rope_turns\[64\] = \{([^}]*)\})"))) << plan->source;
  std::vector<unsigned long long> turns;
  const std::string table = m[1];
  const std::regex number(R"((\d+)ull)");
  for (auto it = std::sregex_iterator(table.begin(), table.end(), number); it != std::sregex_iterator(); ++it)
    turns.push_back(std::stoull((*it)[1]));
  ASSERT_EQ(turns.size(), 64u);
  std::mt19937_64 rng(testing::testSeed());
  double worst = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t position = int64_t(rng() % (1ull << 24));
    const int j = int(rng() % 64);
    const unsigned long long product = static_cast<unsigned long long>(position) * turns[size_t(j)];
    const double device = double(float(static_cast<int>(static_cast<unsigned>(product >> 32))) *
                                 (6.2831853071795865f / 4294967296.0f));
    const long double exact = (long double)position * std::pow((long double)500000, -2.0L * j / 128);
    const long double reduced = std::remainder(exact, 6.283185307179586476925286766559L);
    worst = std::max(worst, double(std::fabs(std::remainder((long double)device - reduced,
                                                                6.283185307179586476925286766559L))));
  }
  EXPECT_LT(worst, 1e-6);
}

TEST(Compiler, ParsesTargets) {
  EXPECT_TRUE(parseTarget("cpu"));
  EXPECT_EQ(parseTarget("sm_90a")->arch(), "sm_90a");
  EXPECT_FALSE(parseTarget("gpu"));
}

}  // namespace
}  // namespace loom
