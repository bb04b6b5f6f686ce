// The generator against values from an independent Python implementation of the
// README's formula (integer arithmetic mod 2^64, then (h >> 40) / 2^23 - 1).
#include <gtest/gtest.h>

#include <algorithm>

#include "tools/harness/scenario/generator.h"

using namespace kvcheck;

TEST(Generator, Splitmix64MatchesTheReferenceConstants) {
  EXPECT_EQ(splitmix64(0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(splitmix64(1), 0x910a2dec89025cc1ull);
}

TEST(Generator, PinnedValues) {
  EXPECT_EQ(generated_value(0, 0, 0, Tensor::q, 0, 0), 0.5923912525177002f);
  EXPECT_EQ(generated_value(7, 1, 5, Tensor::k, 2, 3), 0.44771599769592285f);
  EXPECT_EQ(generated_value(42, 0, 100, Tensor::v, 0, 7), -0.9368009567260742f);
  EXPECT_EQ(generated_value(123456789, 2, 99999, Tensor::q, 3, 15), -0.16794490814208984f);
}

TEST(Generator, TableIsIndexedByLayerUidHeadDim) {
  Dims dims;
  dims.layers = 2;
  dims.heads = 4;
  dims.kv_heads = 2;
  dims.head_dim = 8;
  const InputTable t = generate_inputs(dims, 6, 7);
  EXPECT_EQ(t.q.size(), 2u * 6 * 4 * 8);
  EXPECT_EQ(t.k.size(), 2u * 6 * 2 * 8);
  EXPECT_EQ(t.k_at(1, 5, 1)[3], generated_value(7, 1, 5, Tensor::k, 1, 3));
  EXPECT_EQ(t.q_at(0, 2, 3)[7], generated_value(7, 0, 2, Tensor::q, 3, 7));
  EXPECT_EQ(t.v_at(1, 0, 0)[0], generated_value(7, 1, 0, Tensor::v, 0, 0));
}

TEST(Generator, LayersFromAnOffsetAreThatSliceOfTheDeeperTable) {
  Dims deep;
  deep.layers = 5;
  deep.heads = 4;
  deep.kv_heads = 2;
  deep.head_dim = 6;
  Dims slice = deep;
  slice.layers = 2;
  for (const std::vector<std::uint64_t>& keys : {std::vector<std::uint64_t>{}, std::vector<std::uint64_t>{9, 4, 77}}) {
    const InputTable whole = generate_inputs(deep, 3, 11, keys);
    const InputTable part = generate_inputs(slice, 3, 11, keys, 2);  // layers 2 and 3
    const auto same_layers = [&](const std::vector<float>& a, const std::vector<float>& b, int heads) {
      const std::size_t per_layer = 3u * static_cast<std::size_t>(heads) * 6;
      ASSERT_EQ(b.size(), 2 * per_layer);
      EXPECT_TRUE(std::equal(b.begin(), b.end(), a.begin() + static_cast<std::ptrdiff_t>(2 * per_layer)));
    };
    same_layers(whole.q, part.q, 4);
    same_layers(whole.k, part.k, 2);
    same_layers(whole.v, part.v, 2);
    const std::uint64_t uid = keys.empty() ? 2 : keys[2];
    EXPECT_EQ(part.k_at(1, 2, 1)[5], generated_value(11, 3, uid, Tensor::k, 1, 5));
  }
}
