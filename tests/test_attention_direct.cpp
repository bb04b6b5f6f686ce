// The attention kernel reads q8_0, int8 and fp8 codes in place (no float row is decoded).
// An independent path gives what it must compute: the float32 kernel over rows that were
// encoded and decoded by the row codec. The two differ only by float32 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "optimized/dense_cache.h"
#include "optimized/rope_table.h"
#include "optimized/row_codec.h"

using namespace kvcheck::optimized;

namespace {

constexpr int kKvHeads = 2;

// Deterministic values in [-1, 1) from the element's index (Knuth's multiplicative hash).
std::vector<float> values(std::size_t n, std::uint32_t salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(((i + salt) * 2654435761u) % 2000) / 1000.0f - 1.0f;
  return v;
}

// x ([tokens, kKvHeads, d], the first token at `first`) as the format stores it: encoded,
// then decoded. Keys are stored rotated, so `rope` rotates them to their position first and
// back after (float32 rounding only).
std::vector<float> round_trip(const RowFormat& format, const std::vector<float>& x, int d, std::int64_t first,
                              const RopeTable* rope) {
  std::vector<float> out(x), scratch(static_cast<std::size_t>(d));
  std::vector<std::byte> row(row_bytes(format, d));
  for (std::size_t r = 0; r * d < x.size(); ++r) {
    const int kv_head = static_cast<int>(r % kKvHeads);
    const std::int64_t position = first + static_cast<std::int64_t>(r / kKvHeads);
    float* y = out.data() + r * d;
    if (rope) rope->rotate(y, position);
    encode_row(format, kv_head, y, d, row.data(), scratch.data());
    decode_row(format, kv_head, row.data(), d, y);
    if (rope) rope->shift(y, -position);
  }
  return out;
}

// Every output of a 21-token prompt then three decode steps, from a dense cache storing K
// and V in their formats (read in place), or float32 fed the round-tripped keys and values
// (`decoded`).
std::vector<float> run(const RowFormat& key_format, const RowFormat& value_format, int heads, int d, bool decoded) {
  CacheConfig c;
  c.heads = heads;
  c.kv_heads = kKvHeads;
  c.head_dim = d;
  RopeSpec spec;
  spec.head_dim = d;
  c.ropes.assign(static_cast<std::size_t>(c.layers), spec);
  c.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
  c.capacity = 32;
  if (!decoded) c.quant = {{key_format, value_format}};
  DenseCache cache(c, DenseCache::Growth::dynamic);
  RopeTable rope(c.ropes.front());
  rope.cover(32);
  std::vector<float> all;
  std::int64_t uid = 0;
  for (const std::int64_t n : {21, 1, 1, 1}) {
    Chunk chunk;
    chunk.length = n;
    chunk.counts = {n};
    const std::int64_t first = uid;
    for (std::int64_t i = 0; i < n; ++i) chunk.uids.push_back(uid++);
    const std::size_t tokens = static_cast<std::size_t>(n);
    const std::vector<float> q = values(tokens * heads * d, static_cast<std::uint32_t>(uid * 7));
    std::vector<float> k = values(tokens * kKvHeads * d, static_cast<std::uint32_t>(uid * 11));
    std::vector<float> v = values(tokens * kKvHeads * d, static_cast<std::uint32_t>(uid * 13));
    for (float& x : v) x *= 3.0f;  // V's scales differ from K's
    if (decoded) k = round_trip(key_format, k, d, first, &rope), v = round_trip(value_format, v, d, first, nullptr);
    std::vector<float> out(tokens * heads * d, 0.0f);
    chunk.q = {q.data()};
    chunk.k = {k.data()};
    chunk.v = {v.data()};
    cache.append(chunk, {out.data()}, nullptr);
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

struct Case {
  std::string name;
  RowFormat key, value;
  int d;
};

std::vector<Case> cases() {
  RowFormat q8_0;
  q8_0.codec = Codec::q8_0;
  RowFormat fp8_static;  // one fixed scale: the kernel applies it to the finished sums
  fp8_static.codec = Codec::fp8_e4m3;
  fp8_static.static_scales = {0.01f};
  RowFormat fp8_head_static = fp8_static;  // a fixed scale per kv head: listed per row
  fp8_head_static.static_scales = {0.01f, 0.02f};
  RowFormat int8_groups;  // groups of 8: one vector of codes each, no pair of vectors
  int8_groups.codec = Codec::int8;
  int8_groups.group = 8;
  RowFormat e5m2_row;  // a whole row of 40: two pairs of vectors, then one
  e5m2_row.codec = Codec::fp8_e5m2;
  RowFormat fp8_other_static = fp8_static;  // V's own fixed scale, not K's
  fp8_other_static.static_scales = {0.05f};
  // head_dim 40 leaves a single vector after the pairs under AVX2 (8 lanes); under AVX-512
  // (16 lanes) those formats are not read in place and the kernel decodes them (still
  // compared), so the head_dim 64 cases are the ones read in place there.
  return {{"q8_0", q8_0, q8_0, 64},
          {"fp8_e4m3 static", fp8_static, fp8_static, 40},
          {"fp8_e4m3 static per head", fp8_head_static, fp8_head_static, 40},
          {"int8 groups of 8", int8_groups, int8_groups, 40},
          {"fp8_e5m2 row", e5m2_row, e5m2_row, 40},
          {"K fp8 static 0.01, V fp8 static 0.05", fp8_static, fp8_other_static, 64},
          {"K q8_0, V fp8 static", q8_0, fp8_other_static, 64},
          {"K fp8 static, V q8_0", fp8_static, q8_0, 64},
          {"K q8_0, V int8 groups of 8", q8_0, int8_groups, 64}};
}

}  // namespace

TEST(AttentionDirect, CodesReadInPlaceGiveTheFloatKernelOverTheDecodedRows) {
  // Groups of 4 query heads (the four-head reduction), 3 (three), 1 (one).
  for (const int heads : {8, 6, 2})
    for (const Case& c : cases()) {
      ASSERT_GT(direct_group(c.key, c.d), 0) << c.name << ": not a format read in place";
      ASSERT_GT(direct_group(c.value, c.d), 0) << c.name << ": not a format read in place";
      const std::vector<float> direct = run(c.key, c.value, heads, c.d, false);
      const std::vector<float> decoded = run(c.key, c.value, heads, c.d, true);
      ASSERT_EQ(direct.size(), decoded.size());
      double worst = 0.0;
      for (std::size_t i = 0; i < direct.size(); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(direct[i]) - decoded[i]) /
                                    (1.0 + std::abs(static_cast<double>(decoded[i]))));
      EXPECT_LT(worst, 2e-6) << c.name << ", " << heads << " heads";
      // The run attended over values of magnitude ~1 (3 for V): a kernel that dropped a
      // scale would be off by orders of magnitude, not by rounding.
      double largest = 0.0;
      for (float x : decoded) largest = std::max(largest, static_cast<double>(std::abs(x)));
      EXPECT_GT(largest, 0.1) << c.name;
    }
}
