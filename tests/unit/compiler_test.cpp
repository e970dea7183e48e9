// generateKernel as a library: determinism, the plan, and the diagnostics
// for specs and schedules the compiler cannot build.
#include <gtest/gtest.h>

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

TEST(Compiler, DefaultScheduleAlwaysValid) {
  for (int P = 1; P <= 12; ++P) {
    KernelSpec spec = baseSpec();
    spec.set_pseudo_heads(P);
    auto plan = generateKernel(spec, Schedule(), *parseTarget("cpu"));
    ASSERT_TRUE(plan) << "P=" << P << ": " << plan.error().message;
    EXPECT_EQ(plan->schedule.block_m() % P, 0);
  }
}

TEST(Compiler, DiagnosticsNameTheField) {
  Schedule schedule;
  schedule.set_block_m(18);
  schedule.set_warps(1);
  EXPECT_NE(errorOf(baseSpec(), schedule).find("schedule.block_m (18) must be a multiple of pseudo_heads (4)"),
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

TEST(Compiler, ParsesTargets) {
  EXPECT_TRUE(parseTarget("cpu"));
  EXPECT_EQ(parseTarget("sm_90a")->arch(), "sm_90a");
  EXPECT_FALSE(parseTarget("gpu"));
}

}  // namespace
}  // namespace loom
