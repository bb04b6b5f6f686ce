// The reference's attention on a three-token example computed by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <span>

#include "reference/attention.h"
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

TEST(ReferenceAttention, ResultsDoNotDependOnTheThreadCount) {
  // Large enough that the append is shared by threads (GQA 8 over 2, D 64, 160 tokens).
  Dims dims;
  dims.layers = 2;
  dims.heads = 8;
  dims.kv_heads = 2;
  dims.head_dim = 64;
  const std::int64_t tokens = 160;
  InputTable inputs;
  inputs.layers = dims.layers;
  inputs.uids = tokens;
  inputs.heads = dims.heads;
  inputs.kv_heads = dims.kv_heads;
  inputs.head_dim = dims.head_dim;
  auto fill = [](std::vector<float>& x, std::size_t n, int salt) {
    x.resize(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(std::sin(0.37 * i + salt));
  };
  fill(inputs.q, static_cast<std::size_t>(dims.layers * tokens * dims.heads * dims.head_dim), 1);
  fill(inputs.k, static_cast<std::size_t>(dims.layers * tokens * dims.kv_heads * dims.head_dim), 2);
  fill(inputs.v, static_cast<std::size_t>(dims.layers * tokens * dims.kv_heads * dims.head_dim), 3);
  Rope rope;
  rope.theta = 500000;
  std::vector<std::vector<double>> outputs;
  for (int threads : {1, 2, 3}) {
    reference::ReferenceModel model(dims, rope, Policy{}, 0.125, inputs);
    model.set_threads(threads);
    outputs.push_back(model.append({tokens}).out);
  }
  ASSERT_EQ(outputs[0].size(), static_cast<std::size_t>(dims.layers * tokens * dims.heads * dims.head_dim));
  // Bit for bit: each output is computed by one thread, in one fixed order.
  EXPECT_EQ(std::memcmp(outputs[0].data(), outputs[1].data(), outputs[0].size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(outputs[0].data(), outputs[2].data(), outputs[0].size() * sizeof(double)), 0);
}

TEST(ReferenceAttention, TheDotProductSumsInItsDocumentedOrder) {
  // A left-to-right sum of 1e16 and eight ones gives 1e16 (each 1e16 + 1 rounds back, the
  // spacing of doubles there being 2). In the documented order the ones meet each other
  // first: sums = [1e16 + 1 (the tail joins the first), 1, 1, 1, 1, 1, 1, 1], then
  // ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) = (1e16 + 2) + 4.
  const double a[9] = {1e16, 1, 1, 1, 1, 1, 1, 1, 1};
  const double ones[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_EQ(reference::dot(a, ones, 9), 1e16 + 6);
}

// SPEC 11 by hand: five tokens with q = k = (1, 0), v_j = (j, 1), pruned to sink 0 and recent
// 3, 4, then token 5. Without re-rotation every token keeps its index as position (Pq 5);
// re-rotated, the kept tokens sit at 0, 1, 2 and token 5 at 3, so only key 0's distance
// changes (5 -> 3).
class ReferencePrune : public ::testing::TestWithParam<bool> {};

namespace {

// One layer, one head of dim 2: q = k = (1, 0) and v_j = (j, 1) for uid j < uids.
InputTable prune_inputs(int uids) {
  InputTable inputs;
  inputs.layers = 1;
  inputs.uids = uids;
  inputs.heads = inputs.kv_heads = 1;
  inputs.head_dim = 2;
  for (int j = 0; j < uids; ++j) {
    inputs.q.insert(inputs.q.end(), {1, 0});
    inputs.k.insert(inputs.k.end(), {1, 0});
    inputs.v.insert(inputs.v.end(), {static_cast<float>(j), 1});
  }
  return inputs;
}

}  // namespace

TEST_P(ReferencePrune, KeepsSinksAndRecentAtTheSpecPositions) {
  const bool rerotate = GetParam();
  const InputTable inputs = prune_inputs(6);
  Dims dims;
  reference::ReferenceModel model(dims, Rope{}, Policy{}, 0.5, inputs);
  model.append({5});
  model.prune(1, 2, rerotate);
  const reference::RowRetained kept = model.retained(0);
  ASSERT_EQ(kept.keys.size(), 3u);
  const std::int64_t indices[] = {0, 3, 4}, positions[] = {0, rerotate ? 1 : 3, rerotate ? 2 : 4};
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(kept.keys[i].uid, static_cast<std::uint64_t>(indices[i]));
    EXPECT_EQ(kept.keys[i].index, indices[i]);
    EXPECT_EQ(kept.keys[i].position, positions[i]);
  }
  EXPECT_EQ(kept.next_query_position, rerotate ? 3 : 5);

  const auto result = model.append({1});
  const double w[] = {std::exp(0.5 * std::cos(rerotate ? 3.0 : 5.0)), std::exp(0.5 * std::cos(2.0)),
                      std::exp(0.5 * std::cos(1.0)), std::exp(0.5)};
  const double sum = w[0] + w[1] + w[2] + w[3];
  EXPECT_NEAR(result.out[0], (0 * w[0] + 3 * w[1] + 4 * w[2] + 5 * w[3]) / sum, 1e-15);
  EXPECT_NEAR(result.out[1], 1.0, 1e-15);
  EXPECT_EQ(result.rows[0][0].view.query_position, rerotate ? 3 : 5);
}

INSTANTIATE_TEST_SUITE_P(OriginalAndRerotated, ReferencePrune, ::testing::Bool());

// SPEC 11.1 by hand: the same five tokens keep 2 of the cache's choosing. The reference
// knows none of them: token 5 sees only itself, at 5 - (5 - 2) = 2 re-rotated (else 5), its
// full layer's output is not computed (NaN), and a row of 2 tokens or fewer is not pruned.
TEST(ReferencePruneObserved, KnowsOnlyTheLaterTokensAndTheirPositions) {
  for (const bool rerotate : {false, true}) {
    const InputTable inputs = prune_inputs(9);
    Dims dims;
    dims.batch = 2;
    reference::ReferenceModel model(dims, Rope{}, Policy{}, 0.5, inputs);
    model.append({5, 2});  // row 0: uids 0..4, row 1: uids 5, 6 (left-padded)
    model.prune_observed(2, rerotate);
    EXPECT_TRUE(model.retained(0).keys.empty());
    EXPECT_EQ(model.retained(1).keys.size(), 2u);  // 2 <= keep: nothing pruned, both known
    const reference::PrunedRun run =
        reference::PrunedRun::of(std::span<const std::uint64_t>(model.history(0).data(), 5));
    EXPECT_TRUE(run.observed);
    EXPECT_EQ(run.first, 2);
    EXPECT_EQ(run.end, 5);

    const auto result = model.append({1, 1});  // row 0: uid 7 at index 5; row 1: uid 8 at index 2
    const auto& token = result.rows[0][0];
    ASSERT_EQ(token.view.keys.size(), 1u);
    EXPECT_EQ(token.view.keys[0].index, 5);
    EXPECT_EQ(token.view.keys[0].position, rerotate ? 2 : 5);
    EXPECT_EQ(token.view.query_position, rerotate ? 2 : 5);
    EXPECT_TRUE(std::isnan(result.out[0]) && std::isnan(result.out[1]));  // [L, B, n, H, D]: row 0
    // Row 1 attends over all three of its tokens, v = 5, 6, 8, every score cos(0) = 1 apart
    // from its distances; its second coordinate averages to 1.
    EXPECT_NEAR(result.out[3], 1.0, 1e-15);
    const reference::RowRetained kept = model.retained(0);
    ASSERT_EQ(kept.keys.size(), 1u);
    EXPECT_EQ(kept.keys[0].uid, 7u);
    EXPECT_EQ(kept.next_query_position, rerotate ? 3 : 6);
  }
}
