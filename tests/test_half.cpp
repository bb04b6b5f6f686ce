// float16 and bfloat16 storage: conversions against values worked out by hand from the
// formats, and properties over every half-precision bit pattern.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "optimized/half.h"

using namespace kvcheck::optimized;

TEST(Half, Float16KnownValues) {
  EXPECT_EQ(to_float16(1.0f), 0x3c00);
  EXPECT_EQ(to_float16(-2.0f), 0xc000);
  EXPECT_EQ(to_float16(65504.0f), 0x7bff);            // the largest float16
  EXPECT_EQ(to_float16(65519.0f), 0x7bff);            // below the midpoint to 65536: rounds down
  EXPECT_EQ(to_float16(65520.0f), 0x7c00);            // the midpoint, ties to even: infinity
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -25)), 0x0000);  // half of it: ties to even, 0
  EXPECT_EQ(to_float16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: ties to even, 2
  EXPECT_EQ(to_float16(1.0f / 3.0f), 0x3555);         // 0.333251953125
  EXPECT_EQ(to_float16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // halfway to the next: even stays
  EXPECT_EQ(to_float16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // 1.5 ulps: ties to even, up
  EXPECT_TRUE(std::isnan(from_float16(to_float16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Half, Bfloat16KnownValues) {
  EXPECT_EQ(to_bfloat16(1.0f), 0x3f80);
  EXPECT_EQ(to_bfloat16(1.0f / 3.0f), 0x3eab);  // 0x3eaaaaab: the dropped half 0xaaab rounds up
  EXPECT_EQ(to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // a tie: even stays
  EXPECT_EQ(to_bfloat16(1.0f + std::ldexp(3.0f, -8)), 0x3f82);  // a tie: rounds to even, up
  EXPECT_EQ(from_bfloat16(0x4049), 3.140625f);
  EXPECT_TRUE(std::isnan(from_bfloat16(to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Half, EveryFloat16AndBfloat16ValueRoundTrips) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f16 = from_float16(bits), bf16 = from_bfloat16(bits);
    if (!std::isnan(f16)) {
      EXPECT_EQ(to_float16(f16), bits) << std::hex << h;
    }
    if (!std::isnan(bf16)) {
      EXPECT_EQ(to_bfloat16(bf16), bits) << std::hex << h;
    }
  }
}

TEST(Half, RoundingIsWithinHalfAUnitInTheLastPlace) {
  // Over a spread of normal values: |x - round(x)| <= u |x|, u = 2^-11 and 2^-8.
  for (int i = -2000; i <= 2000; ++i) {
    const float x = static_cast<float>(i) * 0.0123457f + 0.5f * static_cast<float>(i % 7);
    if (x == 0.0f || std::abs(x) < 1e-4f) continue;
    EXPECT_LE(std::abs(from_float16(to_float16(x)) - x), std::ldexp(std::abs(x), -11)) << x;
    EXPECT_LE(std::abs(from_bfloat16(to_bfloat16(x)) - x), std::ldexp(std::abs(x), -8)) << x;
  }
}
