// The identities of docs/IHA.md, checked on randomly drawn shapes and seeds.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <optional>

#include "io/case.h"
#include "reference/iha_reference.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr int kTrials = 12;
constexpr double kTolerance = 1e-12;

double maxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

// Textbook multi-head attention, written independently of the reference.
std::vector<double> plainAttention(const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v, int64_t B, int64_t N, int64_t H, int64_t G,
                                   int64_t d, double scale, bool causal) {
  std::vector<double> out(size_t(B * N * H * d), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h * G / H;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t last = causal ? i : N - 1;
        std::vector<double> s(size_t(last + 1));
        for (int64_t j = 0; j <= last; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += q[((b * N + i) * H + h) * d + c] * k[((b * N + j) * G + g) * d + c];
          s[j] = scale * dot;
        }
        const double top = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - top));
        for (int64_t j = 0; j <= last; ++j)
          for (int64_t c = 0; c < d; ++c)
            out[((b * N + i) * H + h) * d + c] += s[j] / sum * v[((b * N + j) * G + g) * d + c];
      }
    }
  return out;
}

void setIdentity(std::vector<double>& alpha, int64_t heads) {
  std::fill(alpha.begin(), alpha.end(), 0.0);
  for (int64_t h = 0; h < heads; ++h) alpha[h * heads + h] = 1.0;  // [m, h, p] with P = 1
}

TEST(ReferenceProperty, OnePseudoHeadWithIdentityMixingIsMultiHeadAttention) {
  std::mt19937_64 rng(testing::testSeed());
  for (int trial = 0; trial < kTrials; ++trial) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_pseudo_heads(1);
    spec.set_window(0);
    spec.set_rope_theta(0);
    spec.set_collapse(v1::per_head);
    testing::clearOptions(spec);  // plain multi-head attention has none
    const int64_t B = 1 + rng() % 2, N = 1 + rng() % 9;
    IhaCase c = drawCase(spec, B, N, rng());
    setIdentity(c.inputs.alpha_q, spec.heads());
    setIdentity(c.inputs.alpha_k, spec.kv_heads());
    setIdentity(c.inputs.alpha_v, spec.kv_heads());
    std::fill(c.inputs.collapse.begin(), c.inputs.collapse.end(), 1.0);
    const auto iha = reference::ihaForward(spec, c.inputs).out;
    const auto mha = plainAttention(c.inputs.q, c.inputs.k, c.inputs.v, B, N, spec.heads(), spec.kv_heads(),
                                    spec.head_dim(), effectiveScale(spec), spec.mask() != v1::none);
    EXPECT_LT(maxAbsDiff(iha, mha), kTolerance) << spec.ShortDebugString();
  }
}

TEST(ReferenceProperty, PerHeadEqualsBlockDiagonalGlobal) {
  std::mt19937_64 rng(testing::testSeed() + 1);
  for (int trial = 0; trial < kTrials; ++trial) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_collapse(v1::per_head);
    const int64_t N = 1 + rng() % 8;
    IhaCase c = drawCase(spec, 1, N, rng());
    const auto perHead = reference::ihaForward(spec, c.inputs).out;

    const int64_t H = spec.heads(), P = spec.pseudo_heads();
    KernelSpec globalSpec = spec;
    globalSpec.set_collapse(v1::global);
    reference::IhaInputs globalInputs = c.inputs;
    globalInputs.collapse.assign(size_t(H * H * P), 0.0);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t p = 0; p < P; ++p) globalInputs.collapse[h * H * P + h * P + p] = c.inputs.collapse[h * P + p];
    const auto global = reference::ihaForward(globalSpec, globalInputs).out;
    EXPECT_LT(maxAbsDiff(perHead, global), kTolerance) << spec.ShortDebugString();
  }
}

TEST(ReferenceProperty, CausalModesNeverLookAhead) {
  std::mt19937_64 rng(testing::testSeed() + 2);
  for (int trial = 0; trial < kTrials; ++trial) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_mask(trial % 2 ? v1::flat_causal : v1::token_causal);
    testing::dropStaleOptions(spec);
    const int64_t N = 2 + rng() % 8;
    IhaCase c = drawCase(spec, 1, N, rng());
    const auto before = reference::ihaForward(spec, c.inputs);
    const int64_t changed = 1 + int64_t(rng() % (N - 1));  // token whose inputs change
    const int64_t H = spec.heads(), G = spec.kv_heads(), d = spec.head_dim();
    for (int64_t x = 0; x < H * d; ++x) c.inputs.q[changed * H * d + x] += 1.0;
    for (int64_t x = 0; x < G * d; ++x) {
      c.inputs.k[changed * G * d + x] -= 0.7;
      c.inputs.v[changed * G * d + x] += 2.0;
    }
    const auto after = reference::ihaForward(spec, c.inputs);
    const int64_t earlier = changed * H * d;  // elements of tokens < changed
    for (int64_t x = 0; x < earlier; ++x) ASSERT_NEAR(before.out[x], after.out[x], kTolerance) << spec.ShortDebugString();
    // ... and the change is visible at the changed token itself.
    EXPECT_GT(maxAbsDiff(std::vector<double>(before.out.begin() + earlier, before.out.end()),
                         std::vector<double>(after.out.begin() + earlier, after.out.end())),
              1e-6);
  }
}

// Query heads are permuted group by group (sigma over kv heads, tau inside a
// group) so that every query head keeps its kv head.
TEST(ReferenceProperty, PermutingHeadsPermutesTheOutput) {
  std::mt19937_64 rng(testing::testSeed() + 3);
  for (int trial = 0; trial < kTrials; ++trial) {
    const KernelSpec spec = testing::randomSpec(rng);
    const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
    const int64_t groupSize = H / G, N = 1 + rng() % 6;
    IhaCase c = drawCase(spec, 1, N, rng());
    std::vector<int64_t> sigma(G), tau(groupSize), pi(H);
    std::iota(sigma.begin(), sigma.end(), 0);
    std::iota(tau.begin(), tau.end(), 0);
    std::shuffle(sigma.begin(), sigma.end(), rng);
    std::shuffle(tau.begin(), tau.end(), rng);
    for (int64_t h = 0; h < H; ++h) pi[h] = sigma[h / groupSize] * groupSize + tau[h % groupSize];

    reference::IhaInputs permuted = c.inputs;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t x = 0; x < d; ++x) permuted.q[(n * H + h) * d + x] = c.inputs.q[(n * H + pi[h]) * d + x];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t x = 0; x < d; ++x) {
          permuted.k[(n * G + g) * d + x] = c.inputs.k[(n * G + sigma[g]) * d + x];
          permuted.v[(n * G + g) * d + x] = c.inputs.v[(n * G + sigma[g]) * d + x];
        }
    }
    for (int64_t m = 0; m < H; ++m)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t p = 0; p < P; ++p)
          permuted.alpha_q[(m * H + h) * P + p] = c.inputs.alpha_q[(pi[m] * H + pi[h]) * P + p];
    for (int64_t m = 0; m < G; ++m)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = 0; p < P; ++p) {
          permuted.alpha_k[(m * G + g) * P + p] = c.inputs.alpha_k[(sigma[m] * G + sigma[g]) * P + p];
          permuted.alpha_v[(m * G + g) * P + p] = c.inputs.alpha_v[(sigma[m] * G + sigma[g]) * P + p];
        }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t p = 0; p < P; ++p) {
        if (spec.collapse() == v1::per_head) {
          permuted.collapse[h * P + p] = c.inputs.collapse[pi[h] * P + p];
        } else {
          for (int64_t s = 0; s < H; ++s)
            permuted.collapse[h * H * P + s * P + p] = c.inputs.collapse[pi[h] * H * P + pi[s] * P + p];
        }
      }

    const auto base = reference::ihaForward(spec, c.inputs);
    const auto moved = reference::ihaForward(spec, permuted);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t x = 0; x < d; ++x)
          ASSERT_NEAR(moved.out[(n * H + h) * d + x], base.out[(n * H + pi[h]) * d + x], kTolerance)
              << spec.ShortDebugString();
  }
}

// The options of docs/IHA.md against the function without them:
// - rope_direction negative is positive RoPE on inputs whose second half of
//   every q and k row is negated (R(-a) = S R(a) S with S = diag(1, -1) on
//   each pair, and mixing acts on each column alike);
// - qk_norm rms makes the output blind to the scale of each token's q and k;
// - window_rows W*P is flat_causal's window W, and a window aligned to tokens
//   is token_causal's own rule under token_causal and under none.
TEST(ReferenceProperty, OptionsAgreeWithTheirDefinitions) {
  std::mt19937_64 rng(testing::testSeed() + 5);
  for (int trial = 0; trial < kTrials; ++trial) {
    KernelSpec spec = testing::randomSpec(rng);
    testing::clearOptions(spec);
    spec.set_rope_theta(100.0 + double(rng() % 10000));
    spec.set_mask(v1::none);  // every row sees every key, so the rotation shows
    spec.set_window(0);
    const int64_t N = 2 + rng() % 7, H = spec.heads(), G = spec.kv_heads(), d = spec.head_dim();
    const IhaCase c = drawCase(spec, 1, N, rng());
    const auto negateSecondHalves = [&](std::vector<double>& x, int64_t heads) {
      for (int64_t row = 0; row < N * heads; ++row)
        for (int64_t e = d / 2; e < d; ++e) x[row * d + e] = -x[row * d + e];
    };
    KernelSpec negative = spec;
    negative.set_rope_direction(v1::KernelSpec::negative);
    reference::IhaInputs flipped = c.inputs;
    negateSecondHalves(flipped.q, H);
    negateSecondHalves(flipped.k, G);
    EXPECT_LT(maxAbsDiff(reference::ihaForward(negative, c.inputs).out, reference::ihaForward(spec, flipped).out),
              kTolerance)
        << spec.ShortDebugString();
    EXPECT_GT(maxAbsDiff(reference::ihaForward(negative, c.inputs).out, reference::ihaForward(spec, c.inputs).out),
              1e-6)
        << "the direction matters";

    KernelSpec normed = spec;
    normed.set_qk_norm(v1::KernelSpec::rms);
    normed.set_qk_norm_eps(1e-30);
    reference::IhaInputs scaled = c.inputs;
    for (int64_t n = 0; n < N; ++n) {
      const double factor = 0.25 + double(rng() % 100) / 10.0;
      for (int64_t x = 0; x < H * d; ++x) scaled.q[n * H * d + x] *= factor;
      for (int64_t x = 0; x < G * d; ++x) scaled.k[n * G * d + x] *= factor;
    }
    EXPECT_LT(maxAbsDiff(reference::ihaForward(normed, c.inputs).out, reference::ihaForward(normed, scaled).out),
              1e-9)
        << normed.ShortDebugString();

    const int64_t P = spec.pseudo_heads(), L = N * P, W = 1 + int64_t(rng() % 4);
    KernelSpec byTokens = spec, byRows = spec;
    byTokens.set_mask(v1::flat_causal);
    byTokens.set_window(int32_t(W));
    byRows.set_mask(v1::flat_causal);
    byRows.set_window(0);
    byRows.set_window_rows(int32_t(W * P));
    KernelSpec tokenCausal = spec, alignedToken = spec, alignedNone = spec;
    tokenCausal.set_mask(v1::token_causal);
    tokenCausal.set_window(int32_t(W));
    alignedToken = tokenCausal;
    alignedToken.set_window_align(v1::KernelSpec::token);
    alignedNone = alignedToken;
    alignedNone.set_mask(v1::none);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < L; ++j) {
        ASSERT_EQ(reference::allowed(byRows, i, j), reference::allowed(byTokens, i, j));
        ASSERT_EQ(reference::allowed(alignedToken, i, j), reference::allowed(tokenCausal, i, j));
        ASSERT_EQ(reference::allowed(alignedNone, i, j), reference::allowed(tokenCausal, i, j));
      }
  }
}

TEST(ReferenceProperty, EveryRowAttendsToItself) {
  std::mt19937_64 rng(testing::testSeed() + 4);
  for (int trial = 0; trial < 50; ++trial) {
    const KernelSpec spec = testing::randomSpec(rng);
    const int64_t L = (1 + rng() % 10) * spec.pseudo_heads();
    for (int64_t i = 0; i < L; ++i) ASSERT_TRUE(reference::allowed(spec, i, i)) << spec.ShortDebugString();
  }
}


//===--- what a 16-bit kernel can be checked on (docs/IHA.md, Numerics) ---===//

// Rounding the mixed rows changes nothing where every mixed row is already
// a 16-bit value (P = 1, identity mixing of 16-bit inputs), and changes the
// output by about the dtype's rounding where they are not.
TEST(ReferenceProperty, RoundedMixingRoundsOnlyTheMixedRows) {
  std::mt19937_64 rng(testing::testSeed() + 11);
  for (v1::DType dtype : {v1::float16, v1::bfloat16}) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_dtype(dtype);
    spec.set_pseudo_heads(1);
    IhaCase c = drawCase(spec, 1, 1 + int64_t(rng() % 20), rng());
    setIdentity(c.inputs.alpha_q, spec.heads());
    setIdentity(c.inputs.alpha_k, spec.kv_heads());
    setIdentity(c.inputs.alpha_v, spec.kv_heads());
    const auto exact = reference::ihaForward(spec, c.inputs).out;
    EXPECT_EQ(reference::ihaForwardWithRoundedMixing(spec, c.inputs, dtype).out, exact) << spec.ShortDebugString();
    for (double& alpha : c.inputs.alpha_v) alpha *= 1.0 + 1.0 / 3.0;  // no longer a 16-bit product
    const auto scaled = reference::ihaForward(spec, c.inputs).out;
    const double error = relativeError(reference::ihaForwardWithRoundedMixing(spec, c.inputs, dtype).out, scaled);
    const double unit = dtype == v1::float16 ? 0x1p-11 : 0x1p-8;  // the dtype's unit roundoff
    EXPECT_GT(error, 0.05 * unit) << spec.ShortDebugString();
    EXPECT_LT(error, unit) << spec.ShortDebugString();
  }
}

// The filter's reference (ihaForwardWithTensorCoreRounding) keeps what a
// tensor-core kernel keeps: its outputs are values of the dtype, and it is
// off the mixing-only reference by about one rounding of the weights and of
// the output.
TEST(ReferenceProperty, TensorCoreRoundingRoundsWeightsAndOutput) {
  std::mt19937_64 rng(testing::testSeed() + 13);
  for (v1::DType dtype : {v1::float16, v1::bfloat16}) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_dtype(dtype);
    const IhaCase c = drawCase(spec, 1, 4 + int64_t(rng() % 20), rng());
    const auto rounded = reference::ihaForwardWithTensorCoreRounding(spec, c.inputs, dtype).out;
    for (double x : rounded) ASSERT_EQ(x, reference::detail::roundTo(x, dtype)) << spec.ShortDebugString();
    const auto mixing = reference::ihaForwardWithRoundedMixing(spec, c.inputs, dtype).out;
    const double unit = dtype == v1::float16 ? 0x1p-11 : 0x1p-8;
    const double error = relativeError(rounded, mixing);
    EXPECT_GT(error, 0.01 * unit) << spec.ShortDebugString();
    EXPECT_LT(error, 4 * unit) << spec.ShortDebugString();
  }
}

// Why checks draw again (drawCheckableCase): with one source head and two
// pseudo-heads the two pseudo outputs are close, and collapse weights of
// opposite sign leave a small sum. There the mixing's rounding alone, which
// no 16-bit kernel avoids, is over the contract's tolerance; drawCheckableCase
// gives, for the seed of such a draw, a case where it is within half of it.
// (bfloat16's rounding alone comes near its tolerance on any draw: one seed's
// third draw was at 1.09e-2 with weights of one sign, so the test looks for a
// draw that is over and cancels, and counts the others.)
TEST(ReferenceProperty, ACancellingCollapseIsOverTheToleranceFromRoundingAlone) {
  for (v1::DType dtype : {v1::float16, v1::bfloat16}) {
    KernelSpec spec = testing::makeSpec({.heads = 1, .kvHeads = 1, .pseudoHeads = 2, .headDim = 64, .dtype = dtype,
                                         .mask = v1::none, .collapse = v1::per_head});
    const uint64_t first = testing::testSeed() + (dtype == v1::bfloat16 ? 100000 : 0);
    std::optional<uint64_t> over;
    double overError = 0, sumOfWeights = 0, sizeOfWeights = 0;
    int draws = 0, overWithoutCancelling = 0;
    for (; draws < 4000 && !over; ++draws) {
      const IhaCase drawn = drawCase(spec, 1, 48, first + uint64_t(draws));
      const auto exact = reference::ihaForward(spec, drawn.inputs).out;
      const double error = relativeError(reference::ihaForwardWithRoundedMixing(spec, drawn.inputs, dtype).out, exact);
      if (error <= toleranceFor(dtype)) continue;
      const double sum = std::abs(drawn.inputs.collapse[0] + drawn.inputs.collapse[1]);
      const double size = std::abs(drawn.inputs.collapse[0]) + std::abs(drawn.inputs.collapse[1]);
      if (sum >= 0.5 * size) {
        ++overWithoutCancelling;
        continue;
      }
      over = first + uint64_t(draws);
      overError = error;
      sumOfWeights = sum;
      sizeOfWeights = size;
    }
    ASSERT_TRUE(over) << "no draw over the tolerance with cancelling weights in " << draws;
    std::printf("[ numerics ] %s: draw %d of seed %llu: mixing rounded to the dtype, relative error %.2e; collapse "
                "weights sum to %.3f of their size (%d draws before it over the tolerance without cancelling)\n",
                dtypeName(dtype).c_str(), draws, (unsigned long long)first, overError, sumOfWeights / sizeOfWeights,
                overWithoutCancelling);
    // Most draws over the tolerance cancel: the one over it without is bfloat16's rare near-miss.
    EXPECT_LE(overWithoutCancelling, 2) << "draws over the tolerance whose weights do not cancel";

    const IhaCase checkable = drawCheckableCase(spec, 1, 48, *over);
    const auto exact = reference::ihaForward(spec, checkable.inputs).out;
    EXPECT_EQ(*checkable.expected, exact);
    EXPECT_LE(relativeError(reference::ihaForwardWithTensorCoreRounding(spec, checkable.inputs, dtype).out, exact),
              kCheckableShare * toleranceFor(dtype));
    EXPECT_NE(checkable.inputs.collapse, drawCase(spec, 1, 48, *over).inputs.collapse) << "the draw was kept";
  }
}

}  // namespace
}  // namespace loom
