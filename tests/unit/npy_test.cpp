#include <gtest/gtest.h>

#include <cmath>

#include "loom/half.h"
#include "io/npy.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::TempDir;

TEST(Npy, RoundTripsEveryType) {
  std::mt19937_64 rng(testing::testSeed());
  std::normal_distribution<double> normal;
  TempDir dir;
  for (NpyType type : {NpyType::float64, NpyType::float32, NpyType::float16, NpyType::uint16}) {
    std::vector<double> values(2 * 3 * 5);
    for (double& value : values) value = normal(rng);
    const NpyArray array = npyFromDouble(values, {2, 3, 5}, type);
    ASSERT_TRUE(writeNpy(dir / "a.npy", array));
    auto back = readNpy(dir / "a.npy");
    ASSERT_TRUE(back) << back.error().message;
    EXPECT_EQ(back->type, type);
    EXPECT_EQ(back->shape, (std::vector<int64_t>{2, 3, 5}));
    EXPECT_EQ(back->bytes, array.bytes);
    // Narrow types keep values to their precision.
    const double tolerance = type == NpyType::float64 ? 0 : type == NpyType::float32 ? 1e-7 : type == NpyType::float16 ? 1e-3 : 8e-3;
    const std::vector<double> widened = npyToDouble(*back, true);
    for (size_t i = 0; i < values.size(); ++i) EXPECT_NEAR(widened[i], values[i], tolerance * std::abs(values[i]) + 1e-7);
  }
}

TEST(Npy, OneDimensionalAndScalarShapes) {
  TempDir dir;
  for (std::vector<int64_t> shape : {std::vector<int64_t>{7}, std::vector<int64_t>{}}) {
    const int64_t count = shape.empty() ? 1 : shape[0];
    std::vector<double> values(size_t(count), 0.5);
    ASSERT_TRUE(writeNpy(dir / "s.npy", npyFromDouble(values, shape, NpyType::float32)));
    auto back = readNpy(dir / "s.npy");
    ASSERT_TRUE(back) << back.error().message;
    EXPECT_EQ(back->shape, shape);
  }
}

TEST(Npy, ReadsTheSharedCases) {
  auto q = readNpy(testing::casesDir() + "/h8p8-d64-fp16/q.npy");
  ASSERT_TRUE(q) << q.error().message;
  EXPECT_EQ(q->type, NpyType::float16);
  EXPECT_EQ(q->shape.size(), 4u);
  auto expected = readNpy(testing::casesDir() + "/h8p8-d64-fp16/expected.npy");
  ASSERT_TRUE(expected);
  EXPECT_EQ(expected->type, NpyType::float64);
}

TEST(Npy, RejectsMalformedFiles) {
  TempDir dir;
  {
    std::ofstream(dir / "garbage.npy") << "not a numpy file at all";
  }
  auto garbage = readNpy(dir / "garbage.npy");
  ASSERT_FALSE(garbage);
  EXPECT_NE(garbage.error().message.find("malformed .npy"), std::string::npos);

  // A valid header whose data is one element short.
  NpyArray array = npyFromDouble({1, 2, 3, 4}, {4}, NpyType::float32);
  array.bytes.resize(12);
  ASSERT_TRUE(writeNpy(dir / "short.npy", array));
  auto truncated = readNpy(dir / "short.npy");
  ASSERT_FALSE(truncated);
  EXPECT_NE(truncated.error().message.find("data bytes"), std::string::npos);

  auto missing = readNpy(dir / "absent.npy");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("cannot open"), std::string::npos);
}

TEST(HalfFloat, EveryHalfSurvivesARoundTrip) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float value = half::halfToFloat(uint16_t(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(half::floatToHalf(value), bits) << "half bits " << bits;
  }
}

TEST(HalfFloat, KnownValuesAndRounding) {
  EXPECT_EQ(half::floatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(half::floatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(half::floatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(half::floatToHalf(1e6f), 0x7c00);           // overflow to Inf
  EXPECT_EQ(half::floatToHalf(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(half::floatToHalf(1.0f + 1.0f / 2048), 0x3c00);     // tie rounds to even
  EXPECT_EQ(half::floatToHalf(1.0f + 3.0f / 2048), 0x3c02);
  EXPECT_TRUE(std::isnan(half::halfToFloat(half::floatToHalf(std::nanf("")))));
}

TEST(Bfloat16, KnownValuesAndRounding) {
  EXPECT_EQ(half::floatToBfloat16(1.0f), 0x3f80);
  EXPECT_EQ(half::bfloat16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(half::floatToBfloat16(1.0f + 1.0f / 256), 0x3f80);  // tie rounds to even
  EXPECT_EQ(half::floatToBfloat16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_TRUE(std::isnan(half::bfloat16ToFloat(half::floatToBfloat16(std::nanf("")))));
}

}  // namespace
}  // namespace loom
