#include "gpu/base/dtype.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace kvs {
namespace {

float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

bool IsHalfNan(uint16_t bits) { return (bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu) != 0; }

TEST(Float16Test, EveryBitPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const uint16_t half = static_cast<uint16_t>(bits);
    const float value = Float16ToFloat(half);
    const uint16_t back = FloatToFloat16(value);
    if (IsHalfNan(half)) {
      EXPECT_TRUE(std::isnan(value)) << std::hex << bits;
      EXPECT_TRUE(IsHalfNan(back)) << std::hex << bits;
      EXPECT_EQ(back & 0x8000u, half & 0x8000u) << std::hex << bits;
    } else {
      EXPECT_EQ(back, half) << std::hex << bits;
    }
  }
}

TEST(Float16Test, KnownValues) {
  EXPECT_EQ(Float16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Float16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Float16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(Float16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(Float16ToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(Float16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::signbit(Float16ToFloat(0x8000)));
}

TEST(Float16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToFloat16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even (down)
  EXPECT_EQ(FloatToFloat16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(FloatToFloat16(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3c01);
  EXPECT_EQ(FloatToFloat16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFloat16(65520.0f), 0x7c00);  // rounds past the largest finite: infinity
  EXPECT_EQ(FloatToFloat16(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToFloat16(std::ldexp(1.0f, -25)), 0x0000);  // half the smallest subnormal: even
  EXPECT_EQ(FloatToFloat16(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
  EXPECT_EQ(FloatToFloat16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp -> 2 (even)
  EXPECT_EQ(FloatToFloat16(std::ldexp(1.0f, -14) * (1.0f - std::ldexp(1.0f, -12))), 0x0400);
  EXPECT_EQ(FloatToFloat16(-0.0f), 0x8000);
  EXPECT_TRUE(IsHalfNan(FloatToFloat16(FromBits(0x7f800001u))));  // payload only in low bits
  EXPECT_TRUE(IsHalfNan(FloatToFloat16(std::numeric_limits<float>::quiet_NaN())));
}

__attribute__((target("f16c"))) uint16_t HardwareFloatToHalf(float value) {
  return static_cast<uint16_t>(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT));
}

TEST(Float16Test, MatchesF16cOnRandomFloats) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C on this CPU";
  std::mt19937 rng(42);
  // Exponents around the fp16 range so overflow, normal, subnormal and underflow all occur.
  std::uniform_int_distribution<uint32_t> mantissa(0, 0x7fffff);
  std::uniform_int_distribution<uint32_t> exponent(127 - 30, 127 + 17);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = ((i & 1u) << 31) | (exponent(rng) << 23) | mantissa(rng);
    const float value = FromBits(bits);
    EXPECT_EQ(FloatToFloat16(value), HardwareFloatToHalf(value)) << std::hex << bits;
  }
}

TEST(BFloat16Test, EveryBitPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const uint16_t narrow = static_cast<uint16_t>(bits);
    const float value = BFloat16ToFloat(narrow);
    const uint16_t back = FloatToBFloat16(value);
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(back))) << std::hex << bits;
    } else {
      EXPECT_EQ(back, narrow) << std::hex << bits;
    }
  }
}

TEST(BFloat16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-1.5f), 0xbfc0);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even (down)
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8) - std::ldexp(1.0f, -20)), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to infinity
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::denorm_min()), 0x0000);
  // A NaN whose payload sits only in the low 16 bits must not truncate to infinity.
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(FromBits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(FromBits(0xff800001u)))));
}

TEST(DTypeTest, LoadAndStoreThroughEveryDType) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    uint8_t buffer[16] = {};
    StoreFromFloat(buffer, dtype, 0, 0.5f);
    StoreFromFloat(buffer, dtype, 1, -3.0f);
    StoreFromFloat(buffer, dtype, 2, 100.0f);
    EXPECT_EQ(LoadAsFloat(buffer, dtype, 0), 0.5f) << DTypeName(dtype);
    EXPECT_EQ(LoadAsFloat(buffer, dtype, 1), -3.0f) << DTypeName(dtype);
    EXPECT_EQ(LoadAsFloat(buffer, dtype, 2), 100.0f) << DTypeName(dtype);
    EXPECT_EQ(LoadAsFloat(buffer, dtype, 3), 0.0f) << DTypeName(dtype);
  }
  EXPECT_EQ(DTypeBytes(DType::kFloat16), 2);
  EXPECT_EQ(DTypeBytes(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeBytes(DType::kFloat32), 4);
  EXPECT_EQ(DTypeName(DType::kBFloat16), "bfloat16");
}

}  // namespace
}  // namespace kvs
