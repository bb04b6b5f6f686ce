// V(t), Pk and Pq of the reference against tables written by hand from SPEC 3.
#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

#include "reference/policy.h"

using namespace kvcheck;
using namespace kvcheck::reference;

namespace {

// (index, position) pairs, then Pq.
using Table = std::vector<std::pair<std::int64_t, std::int64_t>>;

void expect_view(const QueryView& view, const Table& keys, std::int64_t pq) {
  Table got;
  for (const VisibleKey& k : view.keys) got.push_back({k.index, k.position});
  EXPECT_EQ(got, keys);
  EXPECT_EQ(view.query_position, pq);
}

Policy sink(std::int64_t s, std::int64_t w, std::int64_t k = 1) {
  Policy p;
  p.kind = PolicyKind::sink;
  p.sinks = s;
  p.window = w;
  p.evict = k;
  return p;
}

}  // namespace

TEST(Policy, Full) {
  Policy p;
  expect_view(streaming_view(p, 0), {{0, 0}}, 0);
  expect_view(streaming_view(p, 3), {{0, 0}, {1, 1}, {2, 2}, {3, 3}}, 3);
}

TEST(Policy, SlidingCountsTheQueryItself) {
  Policy p;
  p.kind = PolicyKind::sliding;
  p.window = 3;
  expect_view(streaming_view(p, 1), {{0, 0}, {1, 1}}, 1);
  expect_view(streaming_view(p, 2), {{0, 0}, {1, 1}, {2, 2}}, 2);  // t = W - 1
  expect_view(streaming_view(p, 3), {{1, 1}, {2, 2}, {3, 3}}, 3);  // t = W
  expect_view(streaming_view(p, 4), {{2, 2}, {3, 3}, {4, 4}}, 4);
}

TEST(Policy, SinkShiftsPositionsAfterEviction) {
  const Policy p = sink(2, 5);
  expect_view(streaming_view(p, 0), {{0, 0}}, 0);                                  // t < S
  expect_view(streaming_view(p, 1), {{0, 0}, {1, 1}}, 1);                          // t = S - 1
  expect_view(streaming_view(p, 4), {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}}, 4);  // t = W - 1
  expect_view(streaming_view(p, 5), {{0, 0}, {1, 1}, {3, 2}, {4, 3}, {5, 4}}, 4);  // t = W
  expect_view(streaming_view(p, 7), {{0, 0}, {1, 1}, {5, 2}, {6, 3}, {7, 4}}, 4);
}

TEST(Policy, SinkOriginalPositionsKeepIndices) {
  Policy p = sink(2, 5);
  p.positions = SinkPositions::original;
  expect_view(streaming_view(p, 5), {{0, 0}, {1, 1}, {3, 3}, {4, 4}, {5, 5}}, 5);
}

TEST(Policy, SinkEvictsInBlocks) {
  // llama.cpp context shift: S = 1, W = 5, k = 2.
  const Policy p = sink(1, 5, 2);
  EXPECT_EQ(evicted_count(p, 4), 0);
  EXPECT_EQ(evicted_count(p, 5), 2);
  EXPECT_EQ(evicted_count(p, 6), 2);
  EXPECT_EQ(evicted_count(p, 7), 4);
  expect_view(streaming_view(p, 5), {{0, 0}, {3, 1}, {4, 2}, {5, 3}}, 3);
  expect_view(streaming_view(p, 6), {{0, 0}, {3, 1}, {4, 2}, {5, 3}, {6, 4}}, 4);
  expect_view(streaming_view(p, 7), {{0, 0}, {5, 1}, {6, 2}, {7, 3}}, 3);
}

TEST(Policy, SinkWithoutSinksHasSlidingDistances) {
  const Policy p = sink(0, 3);
  expect_view(streaming_view(p, 4), {{2, 0}, {3, 1}, {4, 2}}, 2);
}

TEST(Policy, DensePrefillSeesTheWholeChunkAtListPositions) {
  Policy p = sink(1, 4);
  p.prefill = Prefill::dense;
  // A first chunk of 6 tokens: one dense forward, no eviction inside it.
  expect_view(chunk_view(p, 0, 5), {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}}, 5);
  // A later chunk from t0 = 6: base = V(6) without 6 = {0, 4, 5}.
  expect_view(chunk_view(p, 6, 7), {{0, 0}, {4, 1}, {5, 2}, {6, 3}, {7, 4}}, 4);
  expect_view(chunk_view(p, 6, 8), {{0, 0}, {4, 1}, {5, 2}, {6, 3}, {7, 4}, {8, 5}}, 5);
  // The chunk's first token is the same as streaming.
  expect_view(chunk_view(p, 6, 6), {{0, 0}, {4, 1}, {5, 2}, {6, 3}}, 3);
  p.positions = SinkPositions::original;
  expect_view(chunk_view(p, 6, 7), {{0, 0}, {4, 4}, {5, 5}, {6, 6}, {7, 7}}, 7);
}

TEST(Policy, RetainedSetIsWhatTheLastTokenSees) {
  const Policy p = sink(2, 5);
  expect_view(retained_view(p, 8), {{0, 0}, {1, 1}, {5, 2}, {6, 3}, {7, 4}}, 4);
  EXPECT_TRUE(retained_view(p, 0).keys.empty());
  expect_view(retained_view(p, 1), {{0, 0}}, 0);
}

TEST(Policy, LiveSetIsWhatTheNextTokenStillSees) {
  // S = 2, W = 5, 8 tokens held as {0, 1, 5, 6, 7}: token 8 drops 5 and sees 6 and 7 one
  // place lower (E(8) = 4 against E(7) = 3).
  const Policy p = sink(2, 5);
  expect_view(live_view(p, 8), {{0, 0}, {1, 1}, {6, 2}, {7, 3}}, 4);
  // Before the window fills nothing is dead: the live set is the retained set.
  expect_view(live_view(p, 3), {{0, 0}, {1, 1}, {2, 2}}, 3);
  EXPECT_TRUE(live_view(p, 0).keys.empty());
  Policy sliding;
  sliding.kind = PolicyKind::sliding;
  sliding.window = 3;
  expect_view(live_view(sliding, 5), {{3, 3}, {4, 4}}, 5);  // token 5 sees 3, 4 and itself
}

// SPEC 10.4, by hand: a sliding layer of window W under a sink policy (S 2, capacity C,
// evict k) may drop what no later query sees. Non-sink j is seen again iff n - j < W (a
// shift moves query and key alike); sink j iff min(Pq, C - k) - j < W.
TEST(Policy, ASlidingLayerUnderAShiftIsSeenAgainOnlyWithinItsWindow) {
  Policy p = sink(2, 16, 8);
  p.swa = 6;
  // 6 tokens, Pq 6: sink 0 is 6 away now and at least 8 - 0 after a shift, gone for good;
  // sink 1 is 5 away.
  expect_view(seen_again_view(p, 6), {{1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}}, 6);
  p = sink(2, 8, 4);
  p.swa = 5;
  // 7 tokens, Pq 7: the sinks are hidden from token 7 (7 - 1 >= 5) but come back at token 8,
  // whose Pq is 8 - 4 = 4; non-sink 2 is 5 away, hidden for good.
  expect_view(live_view(p, 7), {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}, {6, 6}}, 7);
  expect_view(seen_again_view(p, 7), {{0, 0}, {1, 1}, {3, 3}, {4, 4}, {5, 5}, {6, 6}}, 7);
  p.swa = 3;
  // 10 tokens held as {0, 1, 6..9} at 0, 1, 2..5, Pq 6: 6 and 7 are 4 and 3 away; the
  // sinks at least 4 - 1 = 3 even after a shift.
  expect_view(seen_again_view(p, 10), {{8, 4}, {9, 5}}, 6);
  p.swa = 0;  // not under a shift: the live set
  expect_view(seen_again_view(p, 10), {{0, 0}, {1, 1}, {6, 2}, {7, 3}, {8, 4}, {9, 5}}, 6);
}

// seen_again_view against its definition, by brute force: of a row's first n tokens, the
// ones some later query t (n <= t <= n + 3C: every phase of the shifts) sees under
// streaming_view, which applies the window to the shifted positions.
TEST(Policy, SeenAgainIsWhatSomeLaterQuerySees) {
  int cases = 0;
  for (std::int64_t S = 0; S <= 3; ++S)
    for (std::int64_t C = S + 2; C <= 9; ++C)
      for (std::int64_t k = 1; k <= C - S; ++k)
        for (std::int64_t W = 1; W < C; ++W) {
          Policy p = sink(S, C, k);
          p.swa = W;
          for (std::int64_t n = 0; n <= 3 * C; ++n) {
            std::set<std::int64_t> later, got;
            for (std::int64_t t = n; t <= n + 3 * C; ++t)
              for (const VisibleKey& key : streaming_view(p, t).keys)
                if (key.index < n) later.insert(key.index);
            for (const VisibleKey& key : seen_again_view(p, n).keys) got.insert(key.index);
            ASSERT_EQ(got, later) << "S " << S << " C " << C << " k " << k << " W " << W << " n " << n;
            ++cases;
          }
        }
  EXPECT_GT(cases, 5000);
}

// SPEC 4's crop refusal, narrowed under SPEC 10.4 (S 2, C 8, k 4): after 7 tokens nothing is
// evicted, so a sink layer serves a crop to 6; a sliding layer of W 5 may have dropped token
// 2 (7 - 2 >= 5), which token 6 sees (6 - 2 < 5): refused. After an eviction the sink
// layer refuses a crop back into what it evicted.
TEST(Policy, ACropIsRefusedWhenItNeedsWhatTheCacheMayHaveDropped) {
  Policy p = sink(2, 8, 4);
  EXPECT_EQ(crop_lacks(p, 7, 6), -1);
  EXPECT_EQ(crop_lacks(p, 9, 8), 2);  // token 8 evicted 2..5; token 7 needs 2
  EXPECT_EQ(crop_lacks(p, 7, 7), -1);
  p.swa = 5;
  EXPECT_EQ(crop_lacks(p, 7, 6), 2);
  EXPECT_EQ(crop_lacks(p, 7, 3), 2);   // token 3 sees 0, 1, 2: token 2 again
  EXPECT_EQ(crop_lacks(p, 7, 2), -1);  // token 2 sees the sinks, which come back after a shift
}

// SPEC 10.2, C = 4, worked by hand: chunks are 0..3, 4..7, 8..11.
TEST(Policy, ChunkedSeesItsOwnChunkUpToItself) {
  Policy p;
  p.kind = PolicyKind::chunked;
  p.window = 4;
  expect_view(streaming_view(p, 0), {{0, 0}}, 0);
  expect_view(streaming_view(p, 3), {{0, 0}, {1, 1}, {2, 2}, {3, 3}}, 3);  // the chunk's last token
  expect_view(streaming_view(p, 4), {{4, 4}}, 4);                          // a new chunk sees only itself
  expect_view(streaming_view(p, 6), {{4, 4}, {5, 5}, {6, 6}}, 6);
  // Retained after 7 tokens: token 6's chunk so far. Live: what token 7 will see.
  expect_view(retained_view(p, 7), {{4, 4}, {5, 5}, {6, 6}}, 6);
  expect_view(live_view(p, 7), {{4, 4}, {5, 5}, {6, 6}}, 7);
  // After 8 tokens the whole chunk 4..7 is retained, and none of it is live: token 8
  // starts the next chunk.
  expect_view(retained_view(p, 8), {{4, 4}, {5, 5}, {6, 6}, {7, 7}}, 7);
  EXPECT_TRUE(live_view(p, 8).keys.empty());
}

// SPEC 3.1, by hand: C = 6, W = 4, so G = 3. Six tokens fit; the 7th evicts 3 (4 held),
// the 10th 3 more. C = W is a plain sliding window: min(T, W).
TEST(Policy, BlockEvictionHoldsTheLastLOfTTokens) {
  const std::vector<std::int64_t> c6w4 = {0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6};
  for (std::int64_t t = 0; t < static_cast<std::int64_t>(c6w4.size()); ++t)
    EXPECT_EQ(reference::block_retained_length(t, 6, 4), c6w4[static_cast<std::size_t>(t)]) << "T " << t;
  for (std::int64_t t = 0; t < 9; ++t) EXPECT_EQ(reference::block_retained_length(t, 4, 4), std::min<std::int64_t>(t, 4));
  // A prompt far past the buffer: 100 tokens, C = 19, W = 16 (G = 4): 100 - 4 * 21 = 16.
  EXPECT_EQ(reference::block_retained_length(100, 19, 16), 16);
}
