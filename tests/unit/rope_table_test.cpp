// rope_table_dtype (docs/IHA.md, Options): RoPE's cosines and sines as
// public training code tables them, a float32 angle and entries rounded to
// float32 or bfloat16, qk_norm then taken of the turned rows. The float64
// reference against a table built here from the public recipe; the host
// program in float32 (where the table's rounding is far over the
// tolerance), forward, backward and decode; the CUDA pre-mix's rotated rows
// on the emulator (float16 rows, whose rounding is a quarter of a bfloat16
// entry's); the emulated backward and decode step; and the decode steps
// that cannot have it refused. (The CUDA backward's order, the norm's
// transpose before the turn's, moves float16 gradients by about their own
// rounding: the host program's float32 backward is what pins it.)
#include <gtest/gtest.h>

#include <cmath>

#include "cpu/cpu_backend.h"
#include "emu/emulator.h"
#include "io/case.h"
#include "io/decode_case.h"
#include "loom/compiler.h"
#include "mutate.h"
#include "reference/iha_backward.h"
#include "reference/iha_reference.h"
#include "test_util.h"

namespace loom {
namespace {

// The recipe as public code writes it (nanochat's rotary table), kept apart
// from loom/half.h: inv_freq = 1 / theta^(arange(0, d, 2) / d) in float32,
// t = arange(n) in float32, angle = outer(t, inv_freq) in float32, cos and
// sin rounded to bfloat16 (or float32).
std::pair<double, double> publicEntry(double theta, int64_t position, int j, int d, bool bfloat16) {
  const float exponent = float(2 * j) / float(d);
  const float inverse = 1.0f / std::pow(float(theta), exponent);
  const volatile float angle = float(position) * inverse;
  auto rounded = [&](double x) {
    const float f = float(x);
    if (!bfloat16) return double(f);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    float r;
    std::memcpy(&r, &bits, 4);
    return double(r);
  };
  return {rounded(std::cos(double(angle))), rounded(std::sin(double(angle)))};
}

// The reference's rotation of unit vectors against the public table, entry
// by entry, far into a long sequence; and how far the table is from exact
// angles there (the difference public code's models were trained with).
TEST(RopeTable, ReferenceTurnsByThePublicTable) {
  for (const int table : {1, 2}) {
    const int d = 64;
    double fromExact = 0;
    for (const int64_t position : {int64_t(0), int64_t(1), int64_t(977), int64_t(65535), int64_t(200003)})
      for (int j = 0; j < d / 2; ++j) {
        std::vector<double> row(size_t(d), 0.0);
        row[size_t(j)] = 1.0;  // (x_j, x_{j + d/2}) = (1, 0) turns to (cos, sin)
        std::vector<double> exact = row;
        reference::detail::rotate(row, position, 10000.0, 1.0, table);
        reference::detail::rotate(exact, position, 10000.0, 1.0, 0);
        const auto [c, s] = publicEntry(10000.0, position, j, d, table == 2);
        EXPECT_EQ(row[size_t(j)], c) << "position " << position << " pair " << j;
        EXPECT_EQ(row[size_t(j + d / 2)], s) << "position " << position << " pair " << j;
        fromExact = std::max(fromExact, std::abs(row[size_t(j)] - exact[size_t(j)]));
      }
    EXPECT_GT(fromExact, table == 2 ? 1e-3 : 1e-6) << "table " << table << " turns as exact angles do";
  }
}

KernelSpec tableSpec(std::mt19937_64& rng, v1::KernelSpec::RopeTableDtype table, v1::DType dtype) {
  KernelSpec spec = testing::randomSpec(rng);
  spec.set_rope_theta(10000);
  spec.set_rope_table_dtype(table);
  spec.set_head_dim(8 * (2 + int32_t(rng() % 3)));
  spec.set_dtype(dtype);
  testing::dropStaleOptions(spec);
  return spec;
}

// float32 on the host: the program within float32's tolerance of the
// table's reference, and ten times that from the exact angles' (no window:
// scores between far positions).
TEST(RopeTable, HostProgramInFloat32) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7ab1);
  for (const auto table : {v1::KernelSpec::table_bfloat16, v1::KernelSpec::table_float32}) {
    KernelSpec spec = tableSpec(rng, table, v1::float32);
    spec.set_mask(v1::flat_causal);  // no window: rows see keys far from their own position
    spec.clear_window();
    spec.clear_window_rows();
    spec.clear_window_align();
    const IhaCase c = drawCase(spec, 1, 48 + int64_t(rng() % 40), rng());
    SCOPED_TRACE(testing::describe(c));
    auto plan = generateKernel(spec, {}, *parseTarget("cpu"));
    ASSERT_TRUE(plan) << plan.error().message;
    auto got = cpu::runPlan(*plan, c, {LOOM_TEST_CACHE, 2});
    ASSERT_TRUE(got) << got.error().message;
    EXPECT_LE(relativeError(got->out, reference::ihaForward(spec, c.inputs).out), toleranceFor(v1::float32));
    if (table == v1::KernelSpec::table_bfloat16) {
      KernelSpec exact = spec;
      exact.clear_rope_table_dtype();
      EXPECT_GT(relativeError(got->out, reference::ihaForward(exact, c.inputs).out), 10 * toleranceFor(v1::float32));
    }
  }
}

// The CUDA pre-mix (both archs) on the emulator: its rotated q and k rows
// (float16, rounded to 2^-11) within 6e-4 of the bfloat16 table's rows, and
// further than that from exact angles' (the table's entries round to 2^-9).
TEST(RopeTable, EmulatedPremixTurnsByTheTable) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7ab2);
  for (const std::string arch : {"sm_80", "sm_90a"}) {
    KernelSpec spec = tableSpec(rng, v1::KernelSpec::table_bfloat16, v1::float16);
    spec.set_head_dim(64);
    if (arch == "sm_90a") spec.set_qk_norm(v1::KernelSpec::rms);  // the norm of the turned row
    const IhaCase c = drawCase(spec, 1, 64 + int64_t(rng() % 64), rng());
    SCOPED_TRACE(testing::describe(c) + " " + arch);
    Schedule schedule;
    schedule.set_mix(v1::mix_materialized);
    schedule.set_collapse(v1::collapse_separate);
    auto plan = generateKernel(spec, schedule, *parseTarget(arch));
    ASSERT_TRUE(plan) << plan.error().message;
    KeptForward kept;
    emu::EmuOptions options = testing::emulatorOptions(rng());
    options.keep = &kept;
    auto run = emu::runOnEmulator(*plan, c, options);
    ASSERT_TRUE(run) << run.error().message;
    EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
    // Query head h's rows [1, H, L, d] as the kernel stored them, and as the
    // reference mixes and turns them with and without the table.
    const int64_t H = spec.heads(), P = spec.pseudo_heads(), d = spec.head_dim(), L = c.tokens * P;
    const NpyArray stored{NpyType::float16, {H * L * d}, kept.rows.at(Workspace::q_mixed)};
    const std::vector<double> got = npyToDouble(stored);
    auto rows = [&](const KernelSpec& s) {
      auto q = reference::detail::mixAndInterleave(c.inputs.q, c.inputs.alpha_q, 0, c.tokens, H, P, d);
      reference::detail::normalizeAndRotate(s, q);
      std::vector<double> flat;
      for (const auto& head : q)
        for (const auto& row : head) flat.insert(flat.end(), row.begin(), row.end());
      return flat;
    };
    KernelSpec exact = spec;
    exact.clear_rope_table_dtype();
    const double table = relativeError(got, rows(spec)), angles = relativeError(got, rows(exact));
    EXPECT_LE(table, 6e-4) << "from the table's rows";
    EXPECT_GT(angles, 6e-4) << "from exact angles' rows (the kernel ignores the table)";
  }
}

// The backward with a table, qk_norm on (the norm of the turned row, so
// through the norm first and then the turn's transpose): the host program
// in float32 within float32's gradient tolerance, and the emulated CUDA
// backward (sm_80) in float16 within its own.
TEST(RopeTable, BackwardThroughTheTableAndTheNorm) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7ab3);
  for (const v1::DType dtype : {v1::float32, v1::float16}) {
    const IhaCase c = testing::drawCheckableShape(rng, /*backward=*/true, [&] {
      KernelSpec spec = tableSpec(rng, v1::KernelSpec::table_bfloat16, dtype);
      spec.set_qk_norm(v1::KernelSpec::rms);
      if (dtype == v1::float16) spec.set_head_dim(32);
      return testing::DrawnShape{spec, 1, 20 + int64_t(rng() % 20)};
    });
    SCOPED_TRACE(testing::describe(c));
    GenerateOptions backward;
    backward.direction = Direction::backward;
    reference::IhaGradients got;
    if (dtype == v1::float32) {
      auto plan = generateKernel(c.spec, {}, *parseTarget("cpu"), backward);
      ASSERT_TRUE(plan) << plan.error().message;
      auto run = cpu::runBackwardPlan(*plan, c, {LOOM_TEST_CACHE, 2});
      ASSERT_TRUE(run) << run.error().message;
      got = run->gradients;
    } else {
      auto plan = generateKernel(c.spec, {}, *parseTarget("sm_80"), backward);
      ASSERT_TRUE(plan) << plan.error().message;
      auto run = emu::runOnEmulator(*plan, c, testing::emulatorOptions(rng()));
      ASSERT_TRUE(run) << run.error().message;
      EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
      ASSERT_TRUE(run->gradients);
      got = *run->gradients;
    }
    const std::vector<double> errors = gradientErrors(c.spec, c.tokens, got, *c.expectedGradients);
    for (size_t i = 0; i < errors.size(); ++i)
      EXPECT_LE(errors[i], gradientToleranceFor(dtype)) << reference::kGradientNames[i];
  }
}

// A decode step with a table (qk_norm on and off) over either cache layout:
// the host program in float32 and the emulated CUDA step (sm_80, the general
// step; float16) give the forward's rows of the new tokens.
TEST(RopeTable, DecodeStepsGiveTheForwardsRows) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7ab4);
  for (const v1::DType dtype : {v1::float32, v1::float16})
    for (const CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed}) {
      const IhaCase c = testing::drawCheckableShape(rng, /*backward=*/false, [&] {
        KernelSpec spec = tableSpec(rng, v1::KernelSpec::table_bfloat16, dtype);
        if (dtype == v1::float16) spec.set_head_dim(32);
        return testing::DrawnShape{spec, 2, 24 + int64_t(rng() % 24)};
      });
      SCOPED_TRACE(testing::describe(c) + " " + cacheLayoutName(layout));
      auto step = decodeCaseFrom(c, {2, 5, layout, {}, rng()});
      ASSERT_TRUE(step) << step.error().message;
      GenerateOptions decode;
      decode.direction = Direction::decode;
      decode.mixedCache = layout == CacheLayout::mixed;
      auto plan = generateKernel(c.spec, {}, *parseTarget(dtype == v1::float32 ? "cpu" : "sm_80"), decode);
      ASSERT_TRUE(plan) << plan.error().message;
      std::vector<double> out;
      if (dtype == v1::float32) {
        auto run = cpu::runDecodePlan(*plan, *step, {LOOM_TEST_CACHE, 2});
        ASSERT_TRUE(run) << run.error().message;
        out = run->out;
      } else {
        auto run = emu::runDecodeOnEmulator(*plan, *step, testing::emulatorOptions(rng()));
        ASSERT_TRUE(run) << run.error().message;
        EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
        out = run->out;
      }
      EXPECT_LE(relativeError(out, step->expected), toleranceFor(dtype));
    }
}

// The decode steps that turn a cached row by R(tP) and R(j) apart are
// refused with a table, and the default decode plan takes another.
TEST(RopeTable, OneCtaDecodeStepsAreRefused) {
  KernelSpec spec = testing::makeSpec({.heads = 8, .kvHeads = 8, .pseudoHeads = 8, .headDim = 64,
                                       .dtype = v1::bfloat16, .ropeTheta = 10000});
  spec.set_rope_table_dtype(v1::KernelSpec::table_bfloat16);
  GenerateOptions decode;
  decode.direction = Direction::decode;
  for (const bool tensor : {false, true}) {
    Schedule schedule;
    if (tensor) schedule.set_tensor_mixing(true);
    else schedule.set_absorb_mixing(true);
    auto refused = generateKernel(spec, schedule, *parseTarget("sm_80"), decode);
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.error().message.find("does not compose to R(tP + j)"), std::string::npos)
        << refused.error().message;
  }
  auto plan = generateKernel(spec, {}, *parseTarget("sm_80"), decode);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_FALSE(plan->schedule.absorb_mixing() || plan->schedule.tensor_mixing());
}

}  // namespace
}  // namespace loom
