// The float64 reference against every shared case: both sides are float64,
// so they must agree to 1e-9.
#include <gtest/gtest.h>

#include "io/case.h"
#include "reference/iha_reference.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr double kFloat64Tolerance = 1e-9;

class SharedCase : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedCase, ReferenceMatchesExpected) {
  auto c = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(c) << c.error().message;
  ASSERT_TRUE(c->expected.has_value());
  const reference::IhaOutputs result = reference::ihaForward(c->spec, c->inputs);
  const double error = relativeError(result.out, *c->expected);
  EXPECT_LT(error, kFloat64Tolerance) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Vectors, SharedCase, ::testing::ValuesIn(testing::sharedCaseNames()),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

TEST(Reference, SharedCasesArePresent) { EXPECT_GE(testing::sharedCaseNames().size(), 8u); }

// The lse output is the log of the softmax denominator: recompute it for one
// row by hand from its allowed scores.
TEST(Reference, LseIsTheLogSumExpOfAllowedScores) {
  std::mt19937_64 rng(testing::testSeed());
  KernelSpec spec = testing::randomSpec(rng);
  spec.set_rope_theta(0);
  spec.set_pseudo_heads(1);
  spec.set_heads(spec.kv_heads());
  testing::clearOptions(spec);  // raw q . k scores
  IhaCase c = drawCase(spec, 1, 7, rng());
  for (double& a : c.inputs.alpha_q) a = 0;
  for (double& a : c.inputs.alpha_k) a = 0;
  for (int h = 0; h < spec.heads(); ++h) c.inputs.alpha_q[h * spec.heads() + h] = 1;  // identity, P = 1
  for (int g = 0; g < spec.kv_heads(); ++g) c.inputs.alpha_k[g * spec.kv_heads() + g] = 1;
  const auto result = reference::ihaForward(spec, c.inputs);
  const int64_t H = spec.heads(), d = spec.head_dim(), row = 5;
  for (int64_t h = 0; h < H; ++h) {
    double sum = 0;
    for (int64_t j = 0; j < 7; ++j) {
      if (!reference::allowed(spec, row, j)) continue;
      double dot = 0;
      for (int64_t c2 = 0; c2 < d; ++c2) dot += c.inputs.q[(row * H + h) * d + c2] * c.inputs.k[(j * H + h) * d + c2];
      sum += std::exp(effectiveScale(spec) * dot);
    }
    EXPECT_NEAR(result.lse[h * 7 + row], std::log(sum), 1e-12);
  }
}

}  // namespace
}  // namespace loom
