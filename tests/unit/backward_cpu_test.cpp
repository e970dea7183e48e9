// The generated backward (generateKernel with Direction::backward) on the
// host tile API against the float64 backward reference: every shared
// backward case against its finite-difference gradients, every forward
// shared case with a freshly drawn dout, freshly drawn specs over every
// mask, window, collapse, RoPE, qk_norm and GQA shape, both dq strategies,
// and the block accounting of iha-analyze-mask on the backward's loops.
#include <gtest/gtest.h>

#include <numeric>

#include "cpu/cpu_backend.h"
#include "io/case.h"
#include "loom/compiler.h"
#include "loom/mask_rule.h"
#include "loom/tile/layout.h"
#include "reference/iha_backward.h"
#include "reference/iha_reference.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr int kRandomSpecs = 16;

cpu::CpuOptions cpuOptions() { return {LOOM_TEST_CACHE, 2}; }

Result<KernelPlan> backwardPlan(const KernelSpec& spec, const Schedule& schedule) {
  GenerateOptions options;
  options.direction = Direction::backward;
  return generateKernel(spec, schedule, *parseTarget("cpu"), options);
}

// Three schedules: the defaults; small blocks with dq by atomic adds; and
// medium blocks with the separate dq kernel, so a sequence spans several
// query and key blocks and each loop kind (masked, interior) runs.
std::vector<Schedule> schedulesFor(const KernelSpec& spec) {
  const int P = spec.pseudo_heads();
  std::vector<Schedule> schedules(3);
  Schedule& small = schedules[1];
  small.set_warps(1);
  small.set_block_m(std::lcm(P, 16));
  small.set_block_n(16);
  small.set_dq(v1::dq_atomic);
  Schedule& medium = schedules[2];
  medium.set_warps(2);
  medium.set_block_m(std::lcm(P, 32));
  medium.set_block_n(32);
  medium.set_dq(v1::dq_separate);
  return schedules;
}

// The generated backward on `c` with `dout` against `want`, and its block
// accounting: the forward's recomputation, the key-block-outer loops and
// (dq separate) the query-block-outer loops visit exactly the pairs holding
// an allowed pair, and mask exactly those not wholly allowed.
void checkBackward(const IhaCase& c, const std::vector<double>& dout, const reference::IhaGradients& want,
                   const Schedule& schedule, const std::string& what) {
  auto plan = backwardPlan(c.spec, schedule);
  ASSERT_TRUE(plan) << what << ": " << plan.error().message;
  IhaCase withDout = c;
  withDout.dout = dout;
  auto result = cpu::runBackwardPlan(*plan, withDout, cpuOptions());
  ASSERT_TRUE(result) << what << ": " << result.error().message << "\n" << result.error().log;
  const std::vector<double> errors = gradientErrors(c.spec, c.tokens, result->gradients, want);
  const double tolerance = gradientToleranceFor(c.spec.dtype());
  for (size_t i = 0; i < errors.size(); ++i)
    EXPECT_LE(errors[i], tolerance) << what << " " << reference::kGradientNames[i] << " schedule "
                                    << plan->schedule.ShortDebugString();
  EXPECT_LE(relativeError(result->lse, reference::ihaForward(c.spec, c.inputs).lse), toleranceFor(c.spec.dtype()))
      << what << " (lse)";

  const Schedule& s = plan->schedule;
  const int64_t rows = c.batch * c.spec.heads();
  // Each part of a wide head's gradient columns visits its launch's pairs.
  const int64_t parts = backwardColumnParts(int(c.spec.head_dim()));
  // The forward's attention, the key-block-outer loops (query blocks cut at
  // the end masked) and the dq launch (query blocks from multiples of block_m).
  const auto [forwardVisited, forwardMasked] = testing::bruteForceBlocks(c.spec, s.block_m(), s.block_n(), c.tokens);
  const auto [kvVisited, kvMasked] =
      testing::bruteForcePairs(c.spec, s.block_m(), s.block_m(), s.block_n(), c.tokens, /*wholeQueryBlocks=*/true);
  const auto [dqVisited, dqMasked] = s.dq() == v1::dq_separate
                                         ? testing::bruteForcePairs(c.spec, s.block_m(), s.block_m(), s.block_n(),
                                                                    c.tokens, /*wholeQueryBlocks=*/false)
                                         : std::pair<int64_t, int64_t>{0, 0};
  EXPECT_EQ(result->stats.keyBlocks, rows * (forwardVisited + parts * (kvVisited + dqVisited)))
      << what << ": visited block pairs";
  EXPECT_EQ(result->stats.maskedBlocks, rows * (forwardMasked + parts * (kvMasked + dqMasked)))
      << what << ": masked block pairs";
}

std::string testName(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

std::vector<std::string> casesWhere(bool backward) {
  std::vector<std::string> names;
  for (const std::string& name : testing::sharedCaseNames())
    if ((name.rfind("bwd-", 0) == 0) == backward) names.push_back(name);
  return names;
}

// The shared backward cases: against their gradients on disk, computed by
// finite differences of the forward, under every schedule.
class SharedBackwardCaseOnCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedBackwardCaseOnCpu, MatchesTheFiniteDifferencesUnderEverySchedule) {
  auto c = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(c) << c.error().message;
  ASSERT_TRUE(c->dout && c->expectedGradients) << GetParam();
  for (const Schedule& schedule : schedulesFor(c->spec))
    checkBackward(*c, *c->dout, *c->expectedGradients, schedule, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Vectors, SharedBackwardCaseOnCpu, ::testing::ValuesIn(casesWhere(true)),
                         [](const auto& info) { return testName(info.param); });

// Every forward shared case with a dout drawn fresh each run (drawn again
// where the dtype's roundings alone would cost most of the tolerance).
class SharedForwardCaseBackwardOnCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedForwardCaseBackwardOnCpu, MatchesTheReferenceWithADrawnDout) {
  auto c = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(c) << c.error().message;
  std::mt19937_64 rng(testing::testSeed() + std::hash<std::string>{}(GetParam()));
  const std::vector<double> dout = testing::drawCheckableDout(*c, rng);
  const reference::IhaGradients want = reference::ihaBackward(c->spec, c->inputs, dout);
  const Schedule schedule = schedulesFor(c->spec)[rng() % 3];
  checkBackward(*c, dout, want, schedule, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Vectors, SharedForwardCaseBackwardOnCpu, ::testing::ValuesIn(casesWhere(false)),
                         [](const auto& info) { return testName(info.param); });

// Fresh specs every run (testing::randomSpec: every mask, windows, both
// collapses, RoPE, GQA, qk_norm and the other options of public IHA code),
// N and N*P off the block sizes, float32 and the 16-bit dtypes, drawn where
// the roundings of the dtype leave the gradients checkable
// (drawCheckableBackwardCase).
class DrawnBackwardOnCpu : public ::testing::TestWithParam<int> {};

TEST_P(DrawnBackwardOnCpu, MatchesTheReference) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 104729);
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(8 * std::uniform_int_distribution<int>(1, 3)(rng));
    const int dtypePick = GetParam() % 4;
    spec.set_dtype(dtypePick == 2 ? v1::float16 : dtypePick == 3 ? v1::bfloat16 : v1::float32);
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 1 + int64_t(rng() % 48)};
  });
  const std::vector<double>& dout = *c.dout;
  const reference::IhaGradients& want = *c.expectedGradients;
  for (const Schedule& schedule : schedulesFor(c.spec)) checkBackward(c, dout, want, schedule, testing::describe(c));
}

INSTANTIATE_TEST_SUITE_P(Random, DrawnBackwardOnCpu, ::testing::Range(0, kRandomSpecs));

// Past head_dim 128 the key-block-outer and dq launches split the gradient
// columns into parts, a CTA each (layout.h, backwardColumnParts): fresh
// specs at head_dim 136 to 256 (the host takes parts of any width: 200's
// are 104 columns, 136's 72 and 64), every schedule, float32 and 16-bit.
class WideBackwardOnCpu : public ::testing::TestWithParam<int> {};

TEST_P(WideBackwardOnCpu, EveryPartMatchesTheReference) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 7919);
  const int dims[] = {256, 200, 136, 192};
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(dims[GetParam()]);
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float32);
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 1 + int64_t(rng() % 24)};
  });
  ASSERT_EQ(backwardColumnParts(int(c.spec.head_dim())), 2);
  for (const Schedule& schedule : schedulesFor(c.spec))
    checkBackward(c, *c.dout, *c.expectedGradients, schedule, testing::describe(c));
}

INSTANTIATE_TEST_SUITE_P(Random, WideBackwardOnCpu, ::testing::Range(0, 4));

// A gradient's bug cannot hide behind the others: the run's own outputs are
// poisoned beforehand, and a dout of twice the size gives twice every
// gradient (the backward is linear in dout).
TEST(BackwardOnCpu, IsLinearInDout) {
  std::mt19937_64 rng(testing::testSeed() + 17);
  KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 2, .headDim = 16});
  spec.set_rope_theta(10000.0);
  const IhaCase c = drawCase(spec, 2, 19, rng());
  std::vector<double> dout = testing::drawDout(c, rng);
  auto plan = backwardPlan(spec, {});
  ASSERT_TRUE(plan) << plan.error().message;
  IhaCase once = c, twice = c;
  once.dout = dout;
  for (double& x : dout) x *= 2;
  twice.dout = dout;
  auto a = cpu::runBackwardPlan(*plan, once, cpuOptions());
  auto b = cpu::runBackwardPlan(*plan, twice, cpuOptions());
  ASSERT_TRUE(a && b);
  const auto x = reference::gradientsOf(a->gradients), y = reference::gradientsOf(b->gradients);
  for (size_t i = 0; i < x.size(); ++i) {
    std::vector<double> doubled = *x[i];
    for (double& v : doubled) v *= 2;
    EXPECT_LE(relativeError(*y[i], doubled), 1e-6) << reference::kGradientNames[i];
  }
}

// The plan: its launches in order, the workspaces it needs, the schedule's
// backward constraints named by field, a wide head's parts in the grid,
// and the head widths the CUDA backward refuses.
TEST(BackwardPlan, LaunchesWorkspacesAndRefusals) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .pseudoHeads = 2, .headDim = 8});
  auto plan = backwardPlan(spec, {});
  ASSERT_TRUE(plan) << plan.error().message;
  std::vector<std::string> names;
  for (const LaunchPlan& launch : plan->launches) names.push_back(launch.name);
  EXPECT_EQ(names, (std::vector<std::string>{"iha_premix", kAttentionEntry, kBackwardPrepEntry, kBackwardKvEntry,
                                             kBackwardQEntry, kBackwardUnmixEntry, kBackwardReduceEntry}));
  EXPECT_EQ(plan->direction, Direction::backward);
  EXPECT_EQ(plan->schedule.dq(), v1::dq_separate);
  for (Workspace w : {Workspace::q_mixed, Workspace::o_pseudo, Workspace::do_pseudo, Workspace::delta,
                      Workspace::dq_pseudo, Workspace::dk_pseudo, Workspace::dv_pseudo, Workspace::partials})
    EXPECT_NE(std::find(plan->workspaces.begin(), plan->workspaces.end(), w), plan->workspaces.end())
        << workspaceName(w);

  Schedule atomic;
  atomic.set_dq(v1::dq_atomic);
  auto atomicPlan = backwardPlan(spec, atomic);
  ASSERT_TRUE(atomicPlan) << atomicPlan.error().message;
  for (const LaunchPlan& launch : atomicPlan->launches) EXPECT_NE(launch.name, kBackwardQEntry);
  EXPECT_NE(atomicPlan->source, plan->source);

  Schedule fused;
  fused.set_mix(v1::mix_fused);
  auto refused = backwardPlan(spec, fused);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("schedule.mix must be materialized"), std::string::npos)
      << refused.error().message;
  GenerateOptions options;
  options.direction = Direction::backward;
  KernelSpec half = spec;
  half.set_dtype(v1::float16);
  auto cuda = generateKernel(half, {}, *parseTarget("sm_80"), options);
  ASSERT_TRUE(cuda) << cuda.error().message;
  EXPECT_EQ(cuda->workspaceElementBytes, 2);
  EXPECT_EQ(workspaceElementBytes(*cuda, Workspace::do_pseudo), 2);
  EXPECT_EQ(workspaceElementBytes(*cuda, Workspace::dq_pseudo), 4);
  EXPECT_EQ(workspaceElementBytes(*plan, Workspace::do_pseudo), 4);
  for (const LaunchPlan& launch : cuda->launches) {
    if (launch.name != "iha_premix" && launch.name != kBackwardReduceEntry) {
      EXPECT_GT(launch.sharedMemoryBytes, 0) << launch.name;
    }
  }
  // head_dim 256: two parts of 128 columns, the key-block-outer and dq
  // launches' grid y (kv head or head, part), on mma.sync; on sm_90a's
  // default wgmma backward dq is whole (layout.h, backwardDqParts), its
  // launch one CTA an SM.
  half.set_head_dim(256);
  for (const char* arch : {"sm_80", "sm_90a"}) {
    auto wide = generateKernel(half, {}, *parseTarget(arch), options);
    ASSERT_TRUE(wide) << arch << ": " << wide.error().message;
    const bool wgmma = std::string_view(arch) == "sm_90a";
    EXPECT_EQ(wide->schedule.engine(), wgmma ? v1::engine_wgmma : v1::engine_mma) << arch;
    for (const LaunchPlan& launch : wide->launches) {
      if (launch.name == kBackwardKvEntry) EXPECT_EQ(launch.gridY, 2 * half.kv_heads()) << arch;
      if (launch.name == kBackwardQEntry) {
        EXPECT_EQ(launch.gridY, (wgmma ? 1 : 2) * half.heads()) << arch;
        if (wgmma) EXPECT_EQ(launch.ctasPerSm, 1) << arch;
      }
    }
  }
  // Parts a multiple of 16 columns wide (of the padded head: head_dim
  // 200's would be 104, 136's 72, 240's 120).
  for (int d : {136, 200, 240}) {
    half.set_head_dim(d);
    auto refusedWidth = generateKernel(half, {}, *parseTarget("sm_80"), options);
    ASSERT_FALSE(refusedWidth) << d;
    EXPECT_NE(refusedWidth.error().message.find("head_dim " + std::to_string(d) + " has no CUDA backward"),
              std::string::npos)
        << refusedWidth.error().message;
  }

  // A forward plan's schedule says nothing of dq, and its source is unchanged by it.
  auto forward = generateKernel(spec, {}, *parseTarget("cpu"));
  ASSERT_TRUE(forward);
  EXPECT_EQ(forward->direction, Direction::forward);
  EXPECT_EQ(forward->schedule.dq(), v1::dq_unspecified);
  EXPECT_EQ(forward->source.find("atomic_dq"), std::string::npos);
}

}  // namespace
}  // namespace loom
