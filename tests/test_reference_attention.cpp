// The reference's attention on a three-token example computed by hand.
#include <gtest/gtest.h>

#include <cmath>

#include "reference/reference_model.h"

using namespace kvcheck;

namespace {

// One layer, one head, D = 2 (one rotary pair, inv_freq 1: R(p) rotates by p radians).
// Every q and k is (1, 0), so the score of key j for query t is scale * cos(t - j).
InputTable three_tokens() {
  InputTable t;
  t.layers = 1;
  t.uids = 3;
  t.heads = t.kv_heads = 1;
  t.head_dim = 2;
  t.q = {1, 0, 1, 0, 1, 0};
  t.k = {1, 0, 1, 0, 1, 0};
  t.v = {1, 0, 0, 1, 1, 1};
  return t;
}

}  // namespace

TEST(ReferenceAttention, FullAttentionOverThreeTokens) {
  const InputTable inputs = three_tokens();
  Dims dims;
  dims.head_dim = 2;
  const double scale = 0.5;
  reference::ReferenceModel model(dims, Rope{}, Policy{}, scale, inputs);
  const auto result = model.append({3});
  ASSERT_EQ(result.out.size(), 3u * 2u);

  // Token 0 sees only itself.
  EXPECT_DOUBLE_EQ(result.out[0], 1.0);
  EXPECT_DOUBLE_EQ(result.out[1], 0.0);
  // Token 1: scores 0.5 cos(1), 0.5 cos(0) over v0 = (1, 0), v1 = (0, 1).
  const double a0 = std::exp(0.5 * std::cos(1.0)), a1 = std::exp(0.5);
  EXPECT_NEAR(result.out[2], a0 / (a0 + a1), 1e-15);
  EXPECT_NEAR(result.out[3], a1 / (a0 + a1), 1e-15);
  // Token 2: scores 0.5 cos(2), 0.5 cos(1), 0.5 over v2 = (1, 1) too.
  const double b0 = std::exp(0.5 * std::cos(2.0)), b1 = std::exp(0.5 * std::cos(1.0)), b2 = std::exp(0.5);
  const double sum = b0 + b1 + b2;
  EXPECT_NEAR(result.out[4], (b0 + b2) / sum, 1e-15);
  EXPECT_NEAR(result.out[5], (b1 + b2) / sum, 1e-15);
}

TEST(ReferenceAttention, SlidingWindowOfTwoDropsTheFirstToken) {
  const InputTable inputs = three_tokens();
  Dims dims;
  dims.head_dim = 2;
  Policy sliding;
  sliding.kind = PolicyKind::sliding;
  sliding.window = 2;
  reference::ReferenceModel model(dims, Rope{}, sliding, 0.5, inputs);
  const auto result = model.append({3});
  const double b1 = std::exp(0.5 * std::cos(1.0)), b2 = std::exp(0.5);
  EXPECT_NEAR(result.out[4], b2 / (b1 + b2), 1e-15);
  EXPECT_NEAR(result.out[5], 1.0, 1e-15);
}

TEST(ReferenceAttention, LeftPaddingIsNaNAndNeverSeen) {
  InputTable inputs = three_tokens();
  Dims dims;
  dims.batch = 2;
  dims.head_dim = 2;
  reference::ReferenceModel model(dims, Rope{}, Policy{}, 0.5, inputs);
  const auto result = model.append({1, 2});  // row 0: uid 0; row 1: uids 1, 2
  ASSERT_EQ(result.chunk, 2);
  EXPECT_TRUE(std::isnan(result.out[0]));  // row 0, chunk position 0 is padding
  EXPECT_DOUBLE_EQ(result.out[2], 1.0);    // row 0's only token sees v0
  EXPECT_DOUBLE_EQ(result.out[5], 1.0);    // row 1's first token (uid 1) sees only v1 = (0, 1)
  EXPECT_EQ(result.rows[1][0].index, 0);   // padding does not count as an index
  EXPECT_EQ(result.rows[1][1].uid, 2u);
}

TEST(ReferenceAttention, CropRefusesWhenTheCacheHasEvicted) {
  InputTable inputs = three_tokens();
  Dims dims;
  dims.head_dim = 2;
  Policy sliding;
  sliding.kind = PolicyKind::sliding;
  sliding.window = 2;
  reference::ReferenceModel model(dims, Rope{}, sliding, 0.5, inputs);
  model.append({3});                                    // holds tokens 1, 2
  EXPECT_THROW(model.crop(2), reference::StepRefused);  // would need token 0
  EXPECT_EQ(model.history(0).size(), 3u);               // and nothing changed
  model.crop(3);
  EXPECT_EQ(model.history(0).size(), 3u);
}
