// The quantized-code check's allowance for a key written and shifted within one step
// (codes_through_write_boundary): an element that sat on a q8_0 rounding boundary at the
// write may have been stored the other way; the shifted codes that follow from it are
// accepted, and nothing else is. Worked on a key chosen by hand: at position 0 the rotation
// is the identity, the largest element 127 makes the scale exactly 1, and 2.5 sits on the
// boundary between 2 and 3 while 0.25 sits nowhere near one. Both are in the slowest
// rotating pairs (14 and 15, with 30 and 31), so a code's difference survives the shifts.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <vector>

#include "reference/stored_kv.h"
#include "tools/harness/quant_checks.h"

using namespace kvcheck;
using reference::QuantizedRow;

namespace {

constexpr int kDim = 32;  // one q8_0 block

TensorQuant q8_0() {
  TensorQuant q;
  q.format = QuantFormat::q8_0;
  return q;
}

std::vector<float> raw_key() {
  std::vector<float> x(kDim, 0.0f);
  const float head[] = {127.0f, -40.0f, 10.0f, -3.0f, 7.0f, 1.0f};
  std::copy(std::begin(head), std::end(head), x.begin());
  for (int i = 16; i < kDim; ++i) x[static_cast<std::size_t>(i)] = static_cast<float>(i % 5) - 2.0f;  // 0, ±1, ±2
  x[14] = 0.25f;
  x[15] = 2.5f;
  return x;
}
const std::vector<float> kRaw = raw_key();

// What a cache stores after writing `written` at 0 and shifting it along `path`.
QuantizedRow shifted(QuantizedRow written, const std::vector<std::int64_t>& path) {
  for (std::size_t k = 1; k < path.size(); ++k)
    written = reference::requantize_shifted(q8_0(), QuantTransform::none, Rope{}, written, 0, path[k - 1], path[k]);
  return written;
}

}  // namespace

TEST(QuantBoundary, TheWriteSeenByHand) {
  const QuantizedRow w = reference::quantize_key_at(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, 0);
  ASSERT_EQ(w.scales, std::vector<double>{1.0});
  const std::vector<int> head(w.codes.begin(), w.codes.begin() + 6);
  EXPECT_EQ(head, (std::vector<int>{127, -40, 10, -3, 7, 1}));
  EXPECT_EQ(w.codes[14], 0);
  EXPECT_EQ(w.codes[15], 3);  // 2.5 rounds away from zero
  EXPECT_TRUE(w.near_boundary[15]);
  EXPECT_FALSE(w.near_boundary[14]);
}

TEST(QuantBoundary, AWriteRoundedTheOtherWayIsFollowedThroughEveryShift) {
  QuantizedRow other = reference::quantize_key_at(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, 0);
  const QuantizedRow ours = other;
  other.codes[15] = 2;  // the boundary taken the other way
  for (const std::vector<std::int64_t>& path : {std::vector<std::int64_t>{0, 5}, {0, 5, 9}, {0, 3, 7, 40}}) {
    const QuantizedRow stored = shifted(other, path);
    ASSERT_NE(stored.codes, shifted(ours, path).codes) << "the flip must show after the shifts, or this tests nothing";
    const auto found = codes_through_write_boundary(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, path,
                                                    stored);
    ASSERT_TRUE(found.has_value()) << "path of " << path.size() << " positions";
    EXPECT_EQ(found->codes, stored.codes);
  }
}

TEST(QuantBoundary, AFlipAwayFromAnyBoundaryIsNotExcused) {
  QuantizedRow wrong = reference::quantize_key_at(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, 0);
  wrong.codes[14] = 1;  // 0.25 stored as 1: no rounding explains it
  const std::vector<std::int64_t> path{0, 5};
  const QuantizedRow stored = shifted(wrong, path);
  const QuantizedRow ours = reference::quantize_key_at(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, 0);
  ASSERT_NE(stored.codes, shifted(ours, path).codes);
  EXPECT_FALSE(codes_through_write_boundary(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, path, stored));
  // Nor a shift to another position than the one the cache made.
  QuantizedRow other = reference::quantize_key_at(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, 0);
  other.codes[15] = 2;
  EXPECT_FALSE(codes_through_write_boundary(q8_0(), QuantTransform::none, Rope{}, kRaw.data(), kDim, 0, {0, 6},
                                            shifted(other, path)));
}
