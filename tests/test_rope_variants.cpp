// SPEC 7's rotary variants: the reference against hand-derived values and against
// frequency tables computed independently from the published formulas (NumPy, outside the
// project: Llama 3.1 8B's llama3 config, Qwen 2.5's yarn config); the optimized caches'
// own table against the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "optimized/rope_table.h"
#include "reference/attention.h"
#include "reference/rope.h"
#include "tools/harness/sources/cache_entry.h"

using namespace kvcheck;

namespace {

Rope llama31() {  // Llama 3.1 8B's config.json
  Rope r;
  r.theta = 500000.0;
  r.scaling = RopeScaling::llama3;
  r.factor = 8.0;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = 8192.0;
  return r;
}

Rope qwen25_yarn() {  // Qwen 2.5 with {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}
  Rope r;
  r.theta = 1000000.0;
  r.scaling = RopeScaling::yarn;
  r.factor = 4.0;
  r.original_max_position_embeddings = 32768.0;
  r.attention_factor = 0.1 * std::log(4.0) + 1.0;
  return r;
}

}  // namespace

TEST(RopeVariants, Llama3FrequenciesMatchAnIndependentTable) {
  // Pair index, inv_freq after the llama3 map (D 128), from the independent NumPy table.
  const std::vector<std::pair<int, double>> table = {
      {0, 1.0},
      {2, 0.66360123769608848},
      {21, 0.013490419890226748},
      {30, 0.0013718935677611381},
      {31, 0.00085675141291963208},
      {40, 3.4281021959525912e-05},
      {63, 3.0689259889145111e-07},
  };
  for (const auto& [i, expected] : table)
    EXPECT_NEAR(reference::inverse_frequency(i, 128, llama31()), expected, 1e-14 * expected) << "pair " << i;
}

TEST(RopeVariants, Llama3RegimesSwitchWhereTheWavelengthCrossesLOverHAndLOverL) {
  // By hand: wavelen_i = 2 pi 500000^(i/64); 8192 / 4 = 2048 and 8192 / 1 = 8192.
  // Pair 28: 1956.5 < 2048, kept. Pair 35: 8218.7 > 8192, divided by 8.
  const Rope r = llama31();
  const auto plain = [](int i) { return std::pow(500000.0, -2.0 * i / 128); };
  EXPECT_DOUBLE_EQ(reference::inverse_frequency(28, 128, r), plain(28));
  EXPECT_DOUBLE_EQ(reference::inverse_frequency(35, 128, r), plain(35) / 8.0);
  // Pair 32: wavelen = 2 pi sqrt(500000), s = (8192 / wavelen - 1) / 3, inv (1 - s) / 8 + inv s.
  const double wavelen = 2.0 * std::numbers::pi * std::sqrt(500000.0);
  const double s = (8192.0 / wavelen - 1.0) / 3.0;
  EXPECT_NEAR(reference::inverse_frequency(32, 128, r), plain(32) * ((1.0 - s) / 8.0 + s), 1e-18);
}

TEST(RopeVariants, YarnFrequenciesMatchAnIndependentTable) {
  // lo = floor(c(32)) = 23, hi = ceil(c(1)) = 40 (c(32) = 23.596, c(1) = 39.651).
  const std::vector<std::pair<int, double>> table = {
      {0, 1.0},
      {16, 0.031622776601683791},
      {21, 0.010746078283213174},
      {30, 0.0010643609812470017},
      {31, 0.00080295972754523023},
      {40, 4.4456985250973074e-05},
      {63, 3.1023444018792988e-07},
  };
  for (const auto& [i, expected] : table)
    EXPECT_NEAR(reference::inverse_frequency(i, 128, qwen25_yarn()), expected, 1e-14 * expected) << "pair " << i;
  // Pair 23 is the last kept (ramp 0), pair 40 the first divided by f (ramp 1).
  EXPECT_DOUBLE_EQ(reference::inverse_frequency(23, 128, qwen25_yarn()), std::pow(1e6, -2.0 * 23 / 128));
}

TEST(RopeVariants, YarnScalesRotatedDimsByTheAttentionFactor) {
  // m = 0.1 ln 4 + 1 = 1.1386294361119891; R(0) is the identity, so rotate gives m x.
  Rope r = qwen25_yarn();
  r.rotary_dim = 2;
  const auto out = reference::rotate({1.0, 2.0, 3.0, 4.0}, 0.0, r);
  EXPECT_DOUBLE_EQ(out[0], 1.1386294361119891);
  EXPECT_DOUBLE_EQ(out[1], 2.0 * 1.1386294361119891);
  EXPECT_DOUBLE_EQ(out[2], 3.0);  // past rotary_dim: unchanged, unscaled
  EXPECT_DOUBLE_EQ(out[3], 4.0);
  const auto back = reference::unrotate(reference::rotate({1.0, 2.0, 3.0, 4.0}, 17.0, r), 17.0, r);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back[i], 1.0 + i, 1e-14);
}

TEST(RopeVariants, PartialRotaryRotatesTheFirstRDimsWithFrequenciesOfR) {
  // D 8, R 4, theta 100, half layout inside R: pairs (x0, x2) at inv_freq 1 and (x1, x3)
  // at 100^(-2/4) = 0.1; x4 .. x7 pass through.
  Rope r;
  r.theta = 100.0;
  r.rotary_dim = 4;
  const auto out = reference::rotate({1, 2, 3, 4, 5, 6, 7, 8}, 2.0, r);
  EXPECT_NEAR(out[0], 1 * std::cos(2.0) - 3 * std::sin(2.0), 1e-15);
  EXPECT_NEAR(out[2], 1 * std::sin(2.0) + 3 * std::cos(2.0), 1e-15);
  EXPECT_NEAR(out[1], 2 * std::cos(0.2) - 4 * std::sin(0.2), 1e-15);
  EXPECT_NEAR(out[3], 2 * std::sin(0.2) + 4 * std::cos(0.2), 1e-15);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(out[i], i + 1.0);
  // Interleaved inside R: pairs (x0, x1) at 1 and (x2, x3) at 0.1.
  r.layout = RopeLayout::interleaved;
  const auto inter = reference::rotate({1, 2, 3, 4, 5, 6, 7, 8}, 2.0, r);
  EXPECT_NEAR(inter[0], 1 * std::cos(2.0) - 2 * std::sin(2.0), 1e-15);
  EXPECT_NEAR(inter[3], 3 * std::sin(0.2) + 4 * std::cos(0.2), 1e-15);
}

TEST(RopeVariants, LearnedSinkTakesWeightWithoutValue) {
  // One key with score 1 (q = k = (1, 0), scale 1) and a sink logit 1: the key's weight is
  // e^0 / (e^0 + e^0) = 1/2. With sink logit 1 + ln 3 it is 1/4. Without a sink, 1.
  const double q[2] = {1, 0}, k[2] = {1, 0}, v[2] = {4, 8};
  double scores[1], out[2];
  const double sink = 1.0;
  reference::attend(q, k, v, 1, 2, 1.0, &sink, scores, out);
  EXPECT_DOUBLE_EQ(out[0], 2.0);
  EXPECT_DOUBLE_EQ(out[1], 4.0);
  const double big = 1.0 + std::log(3.0);
  reference::attend(q, k, v, 1, 2, 1.0, &big, scores, out);
  EXPECT_NEAR(out[0], 1.0, 1e-15);
  reference::attend(q, k, v, 1, 2, 1.0, nullptr, scores, out);
  EXPECT_DOUBLE_EQ(out[0], 4.0);
}

// The optimized table is written apart from the reference: a unit vector on pair i, rotated
// at position p, must turn by p * inv_freq_i as the reference computes it.
TEST(RopeVariants, OptimizedTableAgreesWithTheReferenceOnEveryVariant) {
  Rope partial;
  partial.theta = 10000.0;
  partial.rotary_dim = 64;
  Rope yarn = qwen25_yarn();
  yarn.rotary_dim = 96;
  for (const Rope& rope : {llama31(), qwen25_yarn(), partial, yarn}) {
    optimized::RopeTable table(rope_spec(rope, 128));
    const std::int64_t p = 3001;
    table.cover(p);
    const int rotary = reference::rotary_dim(128, rope);
    for (int i = 0; i < rotary / 2; ++i) {
      std::vector<float> x(128, 0.0f);
      x[static_cast<std::size_t>(i)] = 1.0f;  // half layout: pair i is (i, i + R/2)
      table.rotate(x.data(), p);
      const double angle = reference::rope_angle(i, 128, static_cast<double>(p), rope);
      const double m = reference::rope_magnitude(rope);
      EXPECT_NEAR(x[static_cast<std::size_t>(i)], m * std::cos(angle), 2e-6) << "pair " << i;
      EXPECT_NEAR(x[static_cast<std::size_t>(i + rotary / 2)], m * std::sin(angle), 2e-6) << "pair " << i;
    }
  }
}
