// The host path's steady state (loom/counters.h): after a warm-up call, a
// call of the same spec and shapes generates, compiles, reads and loads
// nothing; it only launches, and still gives the reference's results.
#include <random>

#include <gtest/gtest.h>

#include "cpu/cpu_backend.h"
#include "host_tensors.h"
#include "io/case.h"
#include "io/decode_case.h"
#include "loom/counters.h"
#include "loom/runtime.h"
#include "reference/iha_decode.h"
#include "test_util.h"

namespace loom {
namespace {

int64_t counterOf(const std::vector<std::pair<std::string, int64_t>>& all, const std::string& name) {
  for (const auto& [key, value] : all)
    if (key == name) return value;
  ADD_FAILURE() << "no counter " << name;
  return -1;
}

// Runs `call` once more (its launches), then `times` times: every counter
// but `launches` unchanged, launches grown by `times` calls' worth.
template <class Call>
void expectSteadyState(const char* what, int times, Call&& call) {
  SCOPED_TRACE(what);
  const auto warm = counters();
  call();
  const int64_t perCall = counterOf(counters(), "launches") - counterOf(warm, "launches");
  EXPECT_GT(perCall, 0) << "a call launches its grids";
  const auto before = counters();
  for (int i = 0; i < times; ++i) call();
  const auto after = counters();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    const int64_t grown = after[i].second - before[i].second;
    if (before[i].first == "launches") EXPECT_EQ(grown, times * perCall);
    else EXPECT_EQ(grown, 0) << before[i].first << " moved in steady-state calls";
  }
}

// A drawn spec's forward, backward and decode step on host tensors: one
// warm-up call each, then 200 calls each change only `launches`; the last
// results match the float64 reference.
TEST(HostPath, SteadyStateCallsChangeOnlyLaunches) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x57ead);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  KernelSpec spec = testing::makeSpec({.heads = int(2 * pick(1, 2)), .kvHeads = 2, .pseudoHeads = int(pick(1, 3)),
                                       .headDim = int(8 * pick(1, 2)), .dtype = v1::float32,
                                       .mask = pick(0, 1) ? v1::flat_causal : v1::token_causal,
                                       .ropeTheta = pick(0, 1) ? 10000.0 : 0.0});
  const cpu::CpuOptions options{LOOM_TEST_CACHE, 1};
  constexpr int kCalls = 200;

  const IhaCase c = drawCheckableBackwardCase(spec, pick(1, 2), pick(4, 12), rng());
  SCOPED_TRACE(testing::describe(c));
  testing::HostTensors t(c);
  ASSERT_TRUE(runOnHost(spec, t.inputs(), {}, options)) << "warm-up";
  expectSteadyState("forward", kCalls, [&] { ASSERT_TRUE(runOnHost(spec, t.inputs(), {}, options)); });
  EXPECT_LE(relativeError(hostValues(t.inputs().out), *c.expected), toleranceFor(spec.dtype()));

  ASSERT_TRUE(runBackwardOnHost(spec, t.inputs(), t.grads(), {}, options)) << "warm-up";
  expectSteadyState("backward", kCalls,
                    [&] { ASSERT_TRUE(runBackwardOnHost(spec, t.inputs(), t.grads(), {}, options)); });
  EXPECT_LE(worstGradientError(spec, c.tokens, t.gradients(), *c.expectedGradients), gradientToleranceFor(spec.dtype()));

  // Decode: the same step again and again (its append writes the same slots).
  auto dc = decodeCaseFrom(c, {1, int64_t(pick(2, 5)), CacheLayout::raw, {}, rng()});
  ASSERT_TRUE(dc) << dc.error().message;
  testing::HostTensors step(stepCase(*dc));
  const PagedCacheTensors cache = step.cache(*dc);
  ASSERT_TRUE(runDecodeOnHost(spec, step.inputs(), cache, {}, options)) << "warm-up";
  expectSteadyState("decode", kCalls, [&] { ASSERT_TRUE(runDecodeOnHost(spec, step.inputs(), cache, {}, options)); });
  EXPECT_LE(relativeError(hostValues(step.inputs().out), dc->expected), toleranceFor(spec.dtype()));
}

}  // namespace
}  // namespace loom
