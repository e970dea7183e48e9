// The generated program on the host tile API against the float64 reference:
// every shared case and freshly drawn specs, each under several schedules,
// and the block accounting of iha-analyze-mask.
#include <gtest/gtest.h>

#include <numeric>

#include "cpu/cpu_backend.h"
#include "io/case.h"
#include "loom/compiler.h"
#include "reference/iha_reference.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr int kRandomSpecs = 10;

cpu::CpuOptions cpuOptions() { return {LOOM_TEST_CACHE, 2}; }

v1::Target cpuTarget() { return *parseTarget("cpu"); }

// Schedules that exercise different block shapes, pipeline depths and
// fusion choices; each is valid for `spec`.
std::vector<Schedule> schedulesFor(const KernelSpec& spec) {
  const int P = spec.pseudo_heads();
  std::vector<Schedule> schedules(3);  // [0]: all defaults
  Schedule& small = schedules[1];
  small.set_warps(1);
  small.set_block_m(std::lcm(P, 16));
  small.set_block_n(16);
  small.set_stages(1);
  small.set_mix(v1::mix_materialized);
  small.set_collapse(v1::collapse_separate);
  Schedule& deep = schedules[2];
  deep.set_warps(2);
  deep.set_block_m(std::lcm(P, 32));
  deep.set_block_n(32);
  deep.set_stages(3);
  deep.set_mix(v1::mix_fused);
  deep.set_collapse(v1::collapse_fused);  // the head-looped CTA for global
  return schedules;
}

// All CTAs' key blocks: the per-(batch, head) brute-force count times B*H.
std::pair<int64_t, int64_t> expectedBlocks(const KernelSpec& spec, const Schedule& schedule, int64_t B, int64_t N) {
  const auto [visited, masked] = testing::bruteForceBlocks(spec, schedule.block_m(), schedule.block_n(), N);
  return {visited * B * spec.heads(), masked * B * spec.heads()};
}

void checkAgainstReference(const IhaCase& c, const Schedule& schedule, const std::string& what) {
  auto plan = generateKernel(c.spec, schedule, cpuTarget());
  ASSERT_TRUE(plan) << what << ": " << plan.error().message;
  auto result = cpu::runPlan(*plan, c, cpuOptions());
  ASSERT_TRUE(result) << what << ": " << result.error().message << "\n" << result.error().log;
  const auto reference = reference::ihaForward(c.spec, c.inputs);
  const std::vector<double>& expected = c.expected ? *c.expected : reference.out;
  const double error = relativeError(result->out, expected);
  EXPECT_LE(error, toleranceFor(c.spec.dtype())) << what << " schedule " << plan->schedule.ShortDebugString();
  EXPECT_LE(relativeError(result->lse, reference.lse), toleranceFor(c.spec.dtype())) << what << " (lse)";

  const auto [visited, masked] = expectedBlocks(c.spec, plan->schedule, c.batch, c.tokens);
  EXPECT_EQ(result->stats.keyBlocks, visited) << what << ": visited key blocks";
  EXPECT_EQ(result->stats.maskedBlocks, masked) << what << ": masked key blocks";
}

class SharedCaseOnCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedCaseOnCpu, MatchesExpectedUnderSeveralSchedules) {
  auto c = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(c) << c.error().message;
  for (const Schedule& schedule : schedulesFor(c->spec)) checkAgainstReference(*c, schedule, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Vectors, SharedCaseOnCpu, ::testing::ValuesIn(testing::sharedCaseNames()),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

class DrawnCaseOnCpu : public ::testing::TestWithParam<int> {};

// Fresh specs every run: all masks, windows down to one token (smaller than
// any block), both collapses, RoPE, G < H, N and N*P off the block sizes.
TEST_P(DrawnCaseOnCpu, MatchesTheReference) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 7919);
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(8 * std::uniform_int_distribution<int>(1, 4)(rng));
    const int dtypePick = GetParam() % 5;
    spec.set_dtype(dtypePick == 3 ? v1::float16 : dtypePick == 4 ? v1::bfloat16 : v1::float32);
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 1 + int64_t(rng() % 40)};
  });
  for (const Schedule& schedule : schedulesFor(c.spec)) checkAgainstReference(c, schedule, testing::describe(c));
}

INSTANTIATE_TEST_SUITE_P(Random, DrawnCaseOnCpu, ::testing::Range(0, kRandomSpecs));

// Every combination of the options of public IHA code, each on a freshly
// drawn shape and data: five window rules (flat_causal, token_causal and none
// with a window aligned to tokens; window_rows at and off a multiple of P)
// times qk_norm off / on times both RoPE directions, under one of the three
// schedules in turn.
class OptionsOnCpu : public ::testing::TestWithParam<int> {};

TEST_P(OptionsOnCpu, MatchTheReference) {
  const int combination = GetParam(), windowRule = combination / 4;
  std::mt19937_64 rng(testing::testSeed() + uint64_t(combination) * 6151);
  KernelSpec spec = testing::randomSpec(rng);
  testing::clearOptions(spec);
  spec.set_head_dim(8 * std::uniform_int_distribution<int>(1, 4)(rng));
  spec.set_pseudo_heads(std::uniform_int_distribution<int>(2, 4)(rng));
  spec.set_rope_theta(10000.0);
  const int P = spec.pseudo_heads(), W = std::uniform_int_distribution<int>(1, 4)(rng);
  spec.set_window(windowRule < 3 ? W : 0);
  if (windowRule < 3) {
    spec.set_mask(windowRule == 0 ? v1::flat_causal : windowRule == 1 ? v1::token_causal : v1::none);
    spec.set_window_align(v1::KernelSpec::token);
  } else {
    spec.set_mask(v1::flat_causal);
    spec.set_window_rows(W * P + (windowRule == 4 ? 1 : 0));
  }
  if (combination % 2) spec.set_qk_norm(v1::KernelSpec::rms);
  if ((combination / 2) % 2) spec.set_rope_direction(v1::KernelSpec::negative);
  ASSERT_TRUE(validateSpec(spec)) << spec.ShortDebugString();
  const int dtypePick = combination % 3;
  spec.set_dtype(dtypePick == 1 ? v1::float16 : dtypePick == 2 ? v1::bfloat16 : v1::float32);
  const int64_t B = 1 + int64_t(rng() % 2), N = 1 + int64_t(rng() % 40);
  const IhaCase c = drawCheckableCase(spec, B, N, rng());
  const std::string what = spec.ShortDebugString() + " B=" + std::to_string(B) + " N=" + std::to_string(N);
  checkAgainstReference(c, schedulesFor(spec)[size_t(combination % 3)], what);
}

INSTANTIATE_TEST_SUITE_P(Every, OptionsOnCpu, ::testing::Range(0, 20));

// The wgmma engine's warp-specialised program (iha-warp-specialize), run on
// the host as a producer part then a consumer part per CTA: the consumers
// must take exactly the key blocks the producer streamed, in order (host.h
// aborts otherwise), and the result must match the reference. Specs with
// d in {64, 128} and P dividing 64; schedules with one to three consumer
// warpgroups, fused and materialised mixing, the head-looped global
// collapse, two and three stages.
class WarpSpecializedOnCpu : public ::testing::TestWithParam<int> {};

TEST_P(WarpSpecializedOnCpu, MatchesTheReference) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 104729);
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(64 * std::uniform_int_distribution<int>(1, 2)(rng));
    spec.set_pseudo_heads(1 << std::uniform_int_distribution<int>(0, 3)(rng));
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 1 + int64_t(rng() % 80)};
  });
  const KernelSpec& spec = c.spec;
  const std::string what = testing::describe(c);
  std::vector<Schedule> schedules(3);
  for (Schedule& s : schedules) s.set_engine(v1::engine_wgmma);  // [0]: the sm_90a defaults
  schedules[1].set_warps(4);
  schedules[1].set_block_m(64);
  schedules[1].set_block_n(64);
  schedules[1].set_stages(3);
  schedules[1].set_mix(v1::mix_fused);
  schedules[2].set_warps(12);
  schedules[2].set_block_m(192);
  schedules[2].set_block_n(192);
  schedules[2].set_stages(2);  // the fewest the wgmma engine takes
  schedules[2].set_collapse(spec.collapse() == v1::global ? v1::collapse_fused : v1::collapse_separate);
  for (const Schedule& schedule : schedules) checkAgainstReference(c, schedule, what);
}

INSTANTIATE_TEST_SUITE_P(Random, WarpSpecializedOnCpu, ::testing::Range(0, 6));

TEST(CpuBackend, SecondRunCompilesNothing) {
  auto c = loadCase(testing::casesDir() + "/mha-identity");
  ASSERT_TRUE(c);
  testing::TempDir cache;
  auto plan = generateKernel(c->spec, Schedule(), cpuTarget());
  ASSERT_TRUE(plan);
  auto first = cpu::runPlan(*plan, *c, {cache.path(), 1});
  ASSERT_TRUE(first) << first.error().message;
  auto second = cpu::runPlan(*plan, *c, {cache.path(), 1});
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_TRUE(first->stats.compiled);
  EXPECT_FALSE(second->stats.compiled);
  EXPECT_EQ(first->out, second->out);
}

TEST(CpuBackend, CompileErrorsCarryTheCompilerLog) {
  auto c = loadCase(testing::casesDir() + "/mha-identity");
  ASSERT_TRUE(c);
  auto plan = generateKernel(c->spec, Schedule(), cpuTarget());
  ASSERT_TRUE(plan);
  plan->source += "\nthis is not C++;\n";
  testing::TempDir cache;
  auto result = cpu::runPlan(*plan, *c, {cache.path(), 1});
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message.find("rejected the generated program"), std::string::npos);
  EXPECT_NE(result.error().log.find("error"), std::string::npos) << result.error().log;
}

}  // namespace
}  // namespace loom
