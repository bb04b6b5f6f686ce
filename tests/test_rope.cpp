// RoPE of the reference against values computed by hand from SPEC 2.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "reference/rope.h"

using kvcheck::Rope;
using kvcheck::RopeLayout;
using kvcheck::RopeScaling;
using kvcheck::reference::rotate;

TEST(Rope, HeadDim2RotatesByThePositionInRadians) {
  // D = 2: one pair with inv_freq 1, so R(p) is a plain rotation by p radians.
  const auto out = rotate({1.0, 0.0}, 1.0, Rope{});
  EXPECT_DOUBLE_EQ(out[0], std::cos(1.0));
  EXPECT_DOUBLE_EQ(out[1], std::sin(1.0));
  const auto back = rotate({0.0, 2.0}, -0.5, Rope{});
  EXPECT_DOUBLE_EQ(back[0], -2.0 * std::sin(-0.5));
  EXPECT_DOUBLE_EQ(back[1], 2.0 * std::cos(-0.5));
}

TEST(Rope, HeadDim4HalfLayoutPairsTheTwoHalves) {
  // theta 100, D 4: inv_freq = 1 and 100^(-1/2) = 0.1; pairs (x0, x2) and (x1, x3).
  Rope rope;
  rope.theta = 100.0;
  const auto out = rotate({1.0, 2.0, 3.0, 4.0}, 2.0, rope);
  EXPECT_NEAR(out[0], 1 * std::cos(2.0) - 3 * std::sin(2.0), 1e-15);
  EXPECT_NEAR(out[2], 1 * std::sin(2.0) + 3 * std::cos(2.0), 1e-15);
  EXPECT_NEAR(out[1], 2 * std::cos(0.2) - 4 * std::sin(0.2), 1e-15);
  EXPECT_NEAR(out[3], 2 * std::sin(0.2) + 4 * std::cos(0.2), 1e-15);
}

TEST(Rope, HeadDim4InterleavedLayoutPairsNeighbours) {
  Rope rope;
  rope.theta = 100.0;
  rope.layout = RopeLayout::interleaved;
  const auto out = rotate({1.0, 2.0, 3.0, 4.0}, 2.0, rope);
  EXPECT_NEAR(out[0], 1 * std::cos(2.0) - 2 * std::sin(2.0), 1e-15);
  EXPECT_NEAR(out[1], 1 * std::sin(2.0) + 2 * std::cos(2.0), 1e-15);
  EXPECT_NEAR(out[2], 3 * std::cos(0.2) - 4 * std::sin(0.2), 1e-15);
  EXPECT_NEAR(out[3], 3 * std::sin(0.2) + 4 * std::cos(0.2), 1e-15);
}

TEST(Rope, LinearScalingDividesThePosition) {
  Rope rope;
  rope.theta = 100.0;
  rope.scaling = RopeScaling::linear;
  rope.factor = 4.0;
  const auto out = rotate({1.0, 0.0, 0.0, 1.0}, 8.0, rope);  // angles 2 and 0.2
  EXPECT_NEAR(out[0], std::cos(2.0), 1e-15);
  EXPECT_NEAR(out[2], std::sin(2.0), 1e-15);
  EXPECT_NEAR(out[1], -std::sin(0.2), 1e-15);
  EXPECT_NEAR(out[3], std::cos(0.2), 1e-15);
}

TEST(Rope, DotProductDependsOnlyOnTheDistance) {
  for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved}) {
    Rope rope;
    rope.layout = layout;
    const std::vector<double> q = {0.3, -1.2, 0.7, 0.05, -0.4, 0.9, 1.1, -0.6};
    const std::vector<double> k = {-0.8, 0.2, 0.4, -1.0, 0.6, 0.1, -0.3, 0.5};
    auto dot = [&](double m, double n) {
      const auto a = rotate(q, m, rope), b = rotate(k, n, rope);
      double s = 0;
      for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
      return s;
    };
    for (double shift : {1.0, 17.0, 4096.0}) {
      EXPECT_NEAR(dot(5, 2), dot(5 + shift, 2 + shift), 1e-9);
      EXPECT_NEAR(dot(0, 9), dot(shift, 9 + shift), 1e-9);
    }
    EXPECT_GT(std::abs(dot(5, 2) - dot(5, 3)), 1e-3);  // and it does depend on the distance
  }
}

// SPEC 10.3 by hand, F = 4, a = 0.1: floor((p + 1) / 4) is 0 up to p = 2, 1 from p = 3, 3 at
// p = 11; T = ln(1 + floor) * 0.1 + 1.
TEST(Rope, QueryTemperatureGrowsWithTheLogOfTheFloorSteps) {
  const kvcheck::QueryTemperature t{4, 0.1};
  EXPECT_EQ(kvcheck::reference::query_temperature(t, 0), 1.0);
  EXPECT_EQ(kvcheck::reference::query_temperature(t, 2), 1.0);
  EXPECT_NEAR(kvcheck::reference::query_temperature(t, 3), 1.0693147180559945, 1e-15);
  EXPECT_NEAR(kvcheck::reference::query_temperature(t, 11), 1.1386294361119891, 1e-15);
  // Llama 4's defaults: 1 until position 8190, then 1 + 0.1 ln 2.
  const kvcheck::QueryTemperature defaults;
  EXPECT_EQ(kvcheck::reference::query_temperature(defaults, 8190), 1.0);
  EXPECT_NEAR(kvcheck::reference::query_temperature(defaults, 8191), 1.0693147180559945, 1e-15);
}
