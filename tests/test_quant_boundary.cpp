// The quantized-code check's allowance for a key written and shifted within one step
// (codes_through_write_boundary): an element that sat on a q8_0 rounding boundary at the
// write may have been stored the other way; the shifted codes that follow from it are
// accepted, and nothing else is. Worked on a key chosen by hand: at position 0 the rotation
// is the identity, the largest element 127 makes the scale exactly 1, and 2.5 sits on the
// boundary between 2 and 3 while 0.25 sits nowhere near one. Both are in the slowest
// rotating pairs (14 and 15, with 30 and 31), so a code's difference survives the shifts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>
#include <vector>

#include "reference/stored_kv.h"
#include "tools/harness/check/quant_checks.h"

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

// Affine int4 with scales per group of 2 (stored_scale_accepted, stored_zero_accepted): S =
// (max - min) / 15 of a narrow group moves by |x| / (max - min) times an element's error, so
// the float32 ulp a cache's FMA rotation moves an element by may move S beyond any fixed
// relative allowance, and the zero point round(-min / S) by several. Accepted: the scales
// and zero points within the boundary window of each element; not: another rule's scale,
// a scale off by 1%, another group's, one not in the scale dtype, a zero point off by one.
namespace {

TensorQuant int4_group2(ScaleDtype dtype) {
  TensorQuant q;
  q.format = QuantFormat::int4;
  q.scale.granularity = ScaleGranularity::group;
  q.scale.group = 2;
  q.scale.dtype = dtype;
  return q;
}

// A row whose group 0 is {a, b}, its largest element about 1 elsewhere.
std::vector<float> affine_row(float a, float b) {
  std::vector<float> x(kDim);
  for (int i = 0; i < kDim; ++i) x[static_cast<std::size_t>(i)] = static_cast<float>(((i * 7) % 13) - 6) / 6.25f;
  x[0] = a;
  x[1] = b;
  return x;
}

// Group 0's scale and zero point as the optimized caches compute them (optimized/row_codec.cpp).
std::pair<double, int> cache_params(ScaleDtype dtype, float lo, float hi) {
  float s = static_cast<float>((static_cast<double>(hi) - lo) / 15);
  if (dtype == ScaleDtype::float16) s = static_cast<float>(reference::round_to_float16(s));
  return {s, static_cast<int>(std::round(-lo / s))};
}

}  // namespace

TEST(QuantBoundary, AnAffineScaleMovedByAnElementsUlpIsAccepted) {
  // kvcheck run tests/data/quant_int4_group2_scale_window.json: uid 1's group 8.
  const TensorQuant q = int4_group2(ScaleDtype::float32);
  const std::vector<float> x = affine_row(-0.2756439447402954f, -0.28807175159454346f);
  const QuantizedRow want = reference::quantize(q, x.data(), kDim, 0, reference::boundary_window(1));
  const float moved = std::nextafter(x[1], -1.0f);  // the cache's element, one ulp away
  const auto [s, z] = cache_params(q.scale.dtype, moved, x[0]);
  ASSERT_GT(std::abs(s - want.scales[0]), 0x1p-19 * want.scales[0]) << "beyond the old fixed allowance";
  EXPECT_TRUE(stored_scale_accepted(q, want, 0, s));
  EXPECT_TRUE(stored_zero_accepted(q, want, 0, s, z, true));
}

TEST(QuantBoundary, AFloat16AffineScaleAndZeroPointMovedByAnElementsUlpAreAccepted) {
  // kvcheck run tests/data/quant_int4_group2_float16_zero_point.json: uid 2's group 15.
  const TensorQuant q = int4_group2(ScaleDtype::float16);
  const std::vector<float> x = affine_row(-0.9659978151321411f, -0.9700443744659424f);
  const QuantizedRow want = reference::quantize(q, x.data(), kDim, 0, reference::boundary_window(2));
  const float moved = std::nextafter(x[0], -1.0f);
  const auto [s, z] = cache_params(q.scale.dtype, x[1], moved);
  ASSERT_NE(s, want.scales[0]);
  ASSERT_GE(std::abs(z - want.zeros[0]), 2) << "the zero point moves by more than one";
  EXPECT_TRUE(stored_scale_accepted(q, want, 0, s));
  EXPECT_TRUE(stored_zero_accepted(q, want, 0, s, z, true));
}

TEST(QuantBoundary, AnAffineScaleOutsideTheWindowIsStillWrong) {
  for (const ScaleDtype dtype : {ScaleDtype::float32, ScaleDtype::float16}) {
    const TensorQuant q = int4_group2(dtype);
    const std::vector<float> x = affine_row(-0.2756439447402954f, -0.28807175159454346f);
    const QuantizedRow want = reference::quantize(q, x.data(), kDim, 0, reference::boundary_window(1));
    const double s = want.scales[0];
    const auto in_dtype = [&](double v) {
      const double f = static_cast<float>(v);
      return dtype == ScaleDtype::float16 ? reference::round_to_float16(f) : f;
    };
    EXPECT_FALSE(stored_scale_accepted(q, want, 0, in_dtype(0.28807175159454346 / 15))) << "amax / 15";
    EXPECT_FALSE(stored_scale_accepted(q, want, 0, in_dtype(s * 1.01))) << "1% off";
    EXPECT_FALSE(stored_scale_accepted(q, want, 0, want.scales[1])) << "group 1's";
    // A zero point off by one under the expected scale (nowhere near a tie here).
    EXPECT_FALSE(stored_zero_accepted(q, want, 0, s, want.zeros[0] + 1, false));
    EXPECT_FALSE(stored_zero_accepted(q, want, 0, s, want.zeros[0] - 1, true));
    // Another scale's zero point with this one.
    EXPECT_FALSE(stored_zero_accepted(q, want, 0, s, static_cast<int>(std::round(0.28807175 / (s * 1.01))), true));
  }
  // A float16 format's scale left in float32, though inside the window's float16 values.
  const TensorQuant q = int4_group2(ScaleDtype::float16);
  const std::vector<float> x = affine_row(-0.9659978151321411f, -0.9700443744659424f);
  const QuantizedRow want = reference::quantize(q, x.data(), kDim, 0, reference::boundary_window(2));
  const double unrounded = static_cast<float>((static_cast<double>(x[0]) - x[1]) / 15);
  ASSERT_NE(unrounded, reference::round_to_float16(unrounded));
  ASSERT_TRUE(want.scale_min[0] < unrounded && unrounded < want.scale_max[0]) << "between the window's float16 scales";
  EXPECT_FALSE(stored_scale_accepted(q, want, 0, unrounded));
}
