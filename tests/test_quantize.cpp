// SPEC 9's formats: the reference's quantizer on values worked out by hand from the format
// table (ties, saturation, zero blocks, subnormals, all-equal groups), and the optimized
// caches' codec, written apart, agreeing with it code for code on many rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "optimized/row_codec.h"
#include "reference/quantize.h"
#include "reference/stored_kv.h"
#include "tools/harness/check/quant_checks.h"

using namespace kvcheck;
using reference::QuantizedRow;

namespace {

TensorQuant format(QuantFormat f, ScaleGranularity g = ScaleGranularity::token, int group = 0,
                   ScaleDtype dtype = ScaleDtype::float32, std::vector<double> fixed = {}) {
  TensorQuant q;
  q.format = f;
  q.scale.granularity = g;
  q.scale.group = group;
  q.scale.dtype = dtype;
  q.scale.rule = fixed.empty() ? ScaleRule::amax : ScaleRule::fixed;
  q.scale.values = fixed;
  return q;
}

// splitmix64 as a double in [0, 1): the same rows on every machine.
double uniform(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1p-53;
}

std::vector<double> decoded(const TensorQuant& q, const QuantizedRow& row) {
  std::vector<double> out(row.codes.size());
  reference::dequantize(q, row, out.data());
  return out;
}

}  // namespace

TEST(ReferenceQuantize, Float16Rounding) {
  EXPECT_EQ(reference::round_to_float16(65504.0), 65504.0);
  EXPECT_TRUE(std::isinf(reference::round_to_float16(65520.0)));  // the midpoint to 65536: ties to even, overflow
  EXPECT_EQ(reference::round_to_float16(std::ldexp(1.0, -25)), 0.0);  // half the smallest subnormal: even is 0
  EXPECT_EQ(reference::round_to_float16(std::ldexp(3.0, -25)), std::ldexp(1.0, -23));  // 1.5 units: up to 2
  // 1/127 in float32 is 0.0078740157...; float16 near 2^-7 steps by 2^-17: 1032 * 2^-17.
  EXPECT_EQ(reference::round_to_float16(static_cast<float>(1.0 / 127.0)), 1032.0 / 131072.0);
}

TEST(ReferenceQuantize, Q8_0RoundsHalfAwayWithTheFloat32Scale) {
  // amax 127: d = 1 exactly, so the codes are round(x) with ties away from zero.
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f, x[1] = 2.5f, x[2] = -2.5f, x[3] = 0.49f, x[4] = -126.5f;
  const TensorQuant q = format(QuantFormat::q8_0);
  const QuantizedRow r = reference::quantize(q, x.data(), 32, 0);
  ASSERT_EQ(r.scales.size(), 1u);
  EXPECT_EQ(r.scales[0], 1.0);
  EXPECT_EQ(r.codes[0], 127);
  EXPECT_EQ(r.codes[1], 3);
  EXPECT_EQ(r.codes[2], -3);
  EXPECT_EQ(r.codes[3], 0);
  EXPECT_EQ(r.codes[4], -127);
  EXPECT_TRUE(r.near_boundary[1] && r.near_boundary[2] && r.near_boundary[4]);  // exact ties
  EXPECT_FALSE(r.near_boundary[3]);
  // The scale is stored in float16: amax 1 gives d = 1032 * 2^-17, not 1/127.
  std::vector<float> y(32, 0.0f);
  y[7] = -1.0f;
  const QuantizedRow s = reference::quantize(q, y.data(), 32, 0);
  EXPECT_EQ(s.scales[0], 1032.0 / 131072.0);
  EXPECT_EQ(s.codes[7], -127);
  EXPECT_EQ(decoded(q, s)[7], -127 * 1032.0 / 131072.0);
}

TEST(ReferenceQuantize, ZeroBlocksStoreZero) {
  std::vector<float> x(64, 0.0f);
  for (QuantFormat f : {QuantFormat::q8_0, QuantFormat::q4_0, QuantFormat::int8, QuantFormat::int4, QuantFormat::int2,
                        QuantFormat::fp8_e4m3}) {
    const TensorQuant q = format(f);
    const QuantizedRow r = reference::quantize(q, x.data(), 64, 0);
    for (double v : decoded(q, r)) EXPECT_EQ(v, 0.0) << to_string(f);
  }
}

TEST(ReferenceQuantize, Q4_0NibblesAndTheClampedExtreme) {
  // m = -8 (largest magnitude, negative): d = 1; code = min(15, trunc(x + 8.5)).
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f, x[1] = 7.4f, x[2] = -0.5f, x[3] = 0.5f, x[4] = 0.49f;
  const TensorQuant q = format(QuantFormat::q4_0);
  const QuantizedRow r = reference::quantize(q, x.data(), 32, 0);
  EXPECT_EQ(r.scales[0], 1.0);
  EXPECT_EQ(r.codes[0], 0);
  EXPECT_EQ(r.codes[1], 15);
  EXPECT_EQ(r.codes[2], 8);  // trunc(8.0)
  EXPECT_EQ(r.codes[3], 9);  // trunc(9.0)
  EXPECT_EQ(r.codes[4], 8);  // trunc(8.99)
  EXPECT_EQ(r.codes[5], 8);  // zero
  // m = +8: d = -1, and -8 maps to trunc(16.5) = 16, clamped to 15: it reads back as -7.
  std::vector<float> y(32, 0.0f);
  y[0] = 8.0f, y[1] = -8.0f;
  const QuantizedRow s = reference::quantize(q, y.data(), 32, 0);
  EXPECT_EQ(s.scales[0], -1.0);
  EXPECT_EQ(decoded(q, s)[0], 8.0);
  EXPECT_EQ(decoded(q, s)[1], -7.0);  // an error of |d|, the bound of the table
}

TEST(ReferenceQuantize, Int8StaticScaleSaturates) {
  const TensorQuant q = format(QuantFormat::int8, ScaleGranularity::tensor, 0, ScaleDtype::float32, {0.5});
  const std::vector<float> x = {1.25f, -1.25f, 200.0f, -63.4f};  // 2.5 and -2.5 are ties: away from zero
  const QuantizedRow r = reference::quantize(q, x.data(), 4, 0);
  EXPECT_EQ(r.scales[0], 0.5);
  EXPECT_EQ(r.codes, (std::vector<int>{3, -3, 127, -127}));
}

// SPEC 9.6 (ONNX Runtime's int8 and int4 KV), worked by hand at scale 0.25: ties to even,
// the whole two's-complement range. The same values under int8 round ties away from zero.
TEST(ReferenceQuantize, EvenFormatsRoundTiesToEvenOverTheWholeRange) {
  const std::vector<float> x = {0.125f, 0.375f, 0.625f, -0.125f, -0.375f, -0.625f, 31.875f, -32.0f,
                                40.0f,  -40.0f, 0.0f,   0.25f,   1.875f,  -2.125f, 1.625f,  -1.625f};
  // x / s: .5 1.5 2.5 -.5 -1.5 -2.5 127.5 -128 160 -160 0 1 7.5 -8.5 6.5 -6.5
  const auto at = [](QuantFormat f) { return format(f, ScaleGranularity::tensor, 0, ScaleDtype::float32, {0.25}); };
  EXPECT_EQ(reference::quantize(at(QuantFormat::int8_even), x.data(), 16, 0).codes,
            (std::vector<int>{0, 2, 2, 0, -2, -2, 127, -128, 127, -128, 0, 1, 8, -8, 6, -6}));
  EXPECT_EQ(reference::quantize(at(QuantFormat::int4_even), x.data(), 16, 0).codes,
            (std::vector<int>{0, 2, 2, 0, -2, -2, 7, -8, 7, -8, 0, 1, 7, -8, 6, -6}));
  EXPECT_EQ(reference::quantize(at(QuantFormat::int8), x.data(), 16, 0).codes,
            (std::vector<int>{1, 2, 3, -1, -2, -3, 127, -127, 127, -127, 0, 1, 8, -9, 7, -7}));
}

// SPEC 9.7 (MLX's affine groups), worked by hand at 4 bits (n = 15), groups of 32.
// Group 0: lo = -1 is the edge (|lo| > hi = 0.95): r = 1.95 / 15 = 0.13, q0 = rint(-1 / 0.13)
// = -8, so S = -1 / -8 = 0.125 and B = -1. Codes (x + 1) / 0.125: 0.95 gives 15.6, clipped
// to 15 (0.875: the far edge beyond reach); ties 0.5 -> 0, 1.5 -> 2, 8.5 -> 8.
// Group 1: hi = 0.5 is the edge (|hi| >= |lo| = 0.25): S = -0.05 (r = 0.75 / 15, q0 = -10,
// S = 0.5 / -10), B = 0.5; codes (x - 0.5) / -0.05: 0.5 -> 0, -0.25 -> 15, 0 -> 10,
// 0.4375 -> 1.25 -> 1. An all-zero group (2 bits): r = 1e-7, q0 = 0, S = -1e-7, B = 0, codes 0.
TEST(ReferenceQuantize, MlxAffineGroupsWorkedByHand) {
  TensorQuant q = format(QuantFormat::mlx_affine, ScaleGranularity::group, 32);
  q.bits = 4;
  std::vector<float> x(64, 0.0f);
  const std::vector<float> g0 = {-1.0f, 0.95f, 0.0f, -0.9375f, -0.8125f, 0.0625f};
  const std::vector<float> g1 = {0.5f, -0.25f, 0.0f, 0.4375f};
  std::copy(g0.begin(), g0.end(), x.begin());
  std::copy(g1.begin(), g1.end(), x.begin() + 32);
  const QuantizedRow row = reference::quantize(q, x.data(), 64, 0);
  EXPECT_EQ(std::vector<int>(row.codes.begin(), row.codes.begin() + 6), (std::vector<int>{0, 15, 8, 0, 2, 8}));
  EXPECT_EQ(row.codes[6], 8);  // a zero: exactly code -q0
  EXPECT_EQ(std::vector<int>(row.codes.begin() + 32, row.codes.begin() + 36), (std::vector<int>{0, 15, 10, 1}));
  EXPECT_EQ(row.codes[36], 10);
  EXPECT_EQ(row.scales, (std::vector<double>{0.125, static_cast<double>(0.5f / -10.0f)}));
  EXPECT_EQ(row.biases, (std::vector<double>{-1.0, 0.5}));
  const std::vector<double> back = decoded(q, row);
  EXPECT_EQ(back[0], -1.0);
  EXPECT_EQ(back[1], 0.875);  // clipped: 0.075 from 0.95, within e = 2 |S| = 0.25
  EXPECT_EQ(back[2], 0.0);
  EXPECT_LE(std::abs(back[1] - 0.95), reference::element_bound(QuantFormat::mlx_affine, 0.95, 0.125));
  q.bits = 2;
  const std::vector<float> zeros(32, 0.0f);
  const QuantizedRow flat = reference::quantize(q, zeros.data(), 32, 0);
  EXPECT_EQ(flat.biases, std::vector<double>{0.0});
  EXPECT_EQ(flat.scales, std::vector<double>{static_cast<double>(-1e-7f)});
  EXPECT_EQ(flat.codes, std::vector<int>(32, 0));
}

// SPEC 9.8 (quanto's groups), worked by hand. 4 bits (n = 15), groups of 32: group 0 spans
// 0 .. 15, so S = 15 / 15 = 1 and B = 0, and the codes are x itself rounded half to even:
// 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 14.5 -> 14, 15 -> 15 (half away from zero gives 1, 2, 3, 15).
// Group 1 spans -2 .. 1 (the rest zeros), S = 3 / 15 = 0.2f, B = -2: x = -2 -> 0, 1 -> 15,
// 0 -> rint(2 / 0.2f) = 10. At 2 bits (n = 3), a group -3 .. 3: S = 2, B = -3, and
// -2 -> 0.5 -> 0, 0 -> 1.5 -> 2, 2 -> 2.5 -> 2, 3 -> 3. A group of equal values: S = 0, codes
// 0, decoded exactly (c S + B = B).
TEST(ReferenceQuantize, QuantoAffineGroupsWorkedByHand) {
  TensorQuant q = format(QuantFormat::quanto_affine, ScaleGranularity::group, 32);
  q.bits = 4;
  std::vector<float> x(64, 0.0f);
  const std::vector<float> g0 = {0.0f, 15.0f, 0.5f, 1.5f, 2.5f, 14.5f, 7.0f};
  const std::vector<float> g1 = {-2.0f, 1.0f, 0.0f};
  std::copy(g0.begin(), g0.end(), x.begin());
  std::copy(g1.begin(), g1.end(), x.begin() + 32);
  const QuantizedRow row = reference::quantize(q, x.data(), 64, 0);
  EXPECT_EQ(std::vector<int>(row.codes.begin(), row.codes.begin() + 7), (std::vector<int>{0, 15, 0, 2, 2, 14, 7}));
  EXPECT_EQ(std::vector<int>(row.codes.begin() + 32, row.codes.begin() + 35), (std::vector<int>{0, 15, 10}));
  EXPECT_EQ(row.scales, (std::vector<double>{1.0, static_cast<double>(3.0f / 15.0f)}));
  EXPECT_EQ(row.biases, (std::vector<double>{0.0, -2.0}));
  const std::vector<double> back = decoded(q, row);
  EXPECT_EQ(back[4], 2.0);  // 2.5 stored as code 2: half a step away, within e = S
  EXPECT_LE(std::abs(back[4] - 2.5), reference::element_bound(QuantFormat::quanto_affine, 2.5, 1.0));
  EXPECT_EQ(back[33], static_cast<double>(static_cast<float>(15 * (3.0f / 15.0f)) - 2.0f));
  q.bits = 2;
  std::vector<float> y(32, 0.0f);
  const std::vector<float> g2 = {-3.0f, 3.0f, -2.0f, 2.0f};
  std::copy(g2.begin(), g2.end(), y.begin());
  const QuantizedRow two = reference::quantize(q, y.data(), 32, 0);
  EXPECT_EQ(std::vector<int>(two.codes.begin(), two.codes.begin() + 5), (std::vector<int>{0, 3, 0, 2, 2}));
  EXPECT_EQ(two.scales, std::vector<double>{2.0});
  const std::vector<float> flat_values(32, 0.75f);
  const QuantizedRow flat = reference::quantize(q, flat_values.data(), 32, 0);
  EXPECT_EQ(flat.scales, std::vector<double>{0.0});
  EXPECT_EQ(flat.codes, std::vector<int>(32, 0));
  EXPECT_EQ(decoded(q, flat), std::vector<double>(32, 0.75));
}

// SPEC 9.8 in a float16 model: every step rounded to float16. A group 0 .. 1 at 4 bits has
// S = fp16(1 / 15) = 0.066650390625 (float32: 0.0666667), and 0.5 divides to fp16(7.5018) =
// 7.5, which rounds to even, code 8; in float32 it is 7.4999995, code 7.
TEST(ReferenceQuantize, QuantoAffineInFloat16RoundsEveryStep) {
  TensorQuant q = format(QuantFormat::quanto_affine, ScaleGranularity::group, 32, ScaleDtype::float16);
  q.bits = 4;
  std::vector<float> x(32, 0.0f);
  x[1] = 1.0f, x[2] = 0.5f;
  const QuantizedRow half = reference::quantize(q, x.data(), 32, 0);
  EXPECT_EQ(half.scales, std::vector<double>{0.066650390625});
  EXPECT_EQ(half.codes[2], 8);
  EXPECT_EQ(half.codes[1], 15);
  q.scale.dtype = ScaleDtype::float32;
  const QuantizedRow single = reference::quantize(q, x.data(), 32, 0);
  EXPECT_EQ(single.codes[2], 7);
}

// SPEC 9.7's check 9.2.1: the bias and scale another float32 arithmetic may store, each case
// worked in NumPy float32 as MLX's rule (4 bits, groups of 32, the window 2^-20 of the row's
// largest element).
TEST(QuantChecks, MlxAffineScalesAndBiasesWithinTheWindow) {
  TensorQuant q = format(QuantFormat::mlx_affine, ScaleGranularity::group, 32);
  q.bits = 4;
  const auto verdict = [&](const std::vector<float>& x, float scale, float bias) {
    const QuantizedRow row = reference::quantize(q, x.data(), 32, 0);
    const BiasedGroupVerdict v = mlx_group_accepted(row, 0, 4, scale, bias);
    return std::pair{v.bias, v.scale};
  };
  // linspace(-0.7647058, 1, 32): hi = 1 is the edge, q0 = rint(1 / -0.11764705) = -9 (a near
  // half, -8.5000004), S = -1/9, B = 1. With x[0] one ulp lower, MLX takes q0 = -8, S = -0.125.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[static_cast<std::size_t>(i)] = -0.7647058f + (1.0f + 0.7647058f) * static_cast<float>(i) / 31.0f;
  x[31] = 1.0f;
  EXPECT_EQ(verdict(x, 1.0f / -9.0f, 1.0f), std::pair(true, true));
  EXPECT_EQ(verdict(x, -0.125f, 1.0f), std::pair(true, true));
  EXPECT_EQ(verdict(x, 1.0f / -12.0f, 1.0f), std::pair(true, false));  // q0 = -12: out of reach
  EXPECT_EQ(verdict(x, -0.125f, 1.0001f), std::pair(false, false));   // the bias 1e-4 from the edge
  // [-1, 0.9999995, 0, ...]: |lo| and |hi| within twice the window. Moved to 0.99999994, MLX
  // keeps lo as the edge with q0 = -7 (S = 1/7, B = -1); or takes hi as the edge:
  // q0 = rint(0.9999995 / -0.13333330) = -7, S = 0.9999995 / -7, B = 0.9999995.
  std::vector<float> tie(32, 0.0f);
  tie[0] = -1.0f, tie[1] = 0.9999995f;
  EXPECT_EQ(verdict(tie, 0.125f, -1.0f), std::pair(true, true));
  EXPECT_EQ(verdict(tie, -1.0f / -7.0f, -1.0f), std::pair(true, true));
  EXPECT_EQ(verdict(tie, 0.9999995f / -7.0f, 0.9999995f), std::pair(true, true));
  std::vector<float> apart = tie;
  apart[1] = 0.9f;  // no near tie: hi is never the edge
  EXPECT_EQ(verdict(apart, 0.9f / -7.0f, 0.9f), std::pair(false, false));
}

TEST(QuantCodec, EvenFormatsStoreTheHandWorkedCodes) {
  using optimized::Codec;
  const std::vector<float> x = {0.125f, 0.375f, 0.625f, -0.125f, -0.375f, -0.625f, 31.875f, -32.0f,
                                40.0f,  -40.0f, 0.0f,   0.25f,   1.875f,  -2.125f, 1.625f,  -1.625f};
  for (const auto& [codec, codes] :
       {std::pair{Codec::int8_even, std::vector<int>{0, 2, 2, 0, -2, -2, 127, -128, 127, -128, 0, 1, 8, -8, 6, -6}},
        std::pair{Codec::int4_even, std::vector<int>{0, 2, 2, 0, -2, -2, 7, -8, 7, -8, 0, 1, 7, -8, 6, -6}}}) {
    optimized::RowFormat f;
    f.codec = codec;
    f.static_scales = {0.25f};
    std::vector<std::byte> bytes(optimized::row_bytes(f, 16));
    std::vector<float> scratch(16), back(16);
    optimized::encode_row(f, 0, x.data(), 16, bytes.data(), scratch.data());
    EXPECT_EQ(optimized::unpack_row(f, 0, bytes.data(), 16).codes, codes);
    optimized::decode_row(f, 0, bytes.data(), 16, back.data());
    for (int i = 0; i < 16; ++i) EXPECT_EQ(back[static_cast<std::size_t>(i)], codes[static_cast<std::size_t>(i)] * 0.25f) << i;
  }
}

// Tiny scales: x / s far beyond int's range (or 1 / d beyond float32's) must saturate toward
// x's sign. Converting to int first and clamping after stored positive values as -127 in
// both the reference and the caches, so they agreed and `run` passed the wrong answer. Every
// integer format, values of both signs, worked by hand; the reference and the codec alike.
namespace {

struct TinyScaleCase {
  const char* name;
  TensorQuant ref;
  optimized::RowFormat opt;
  std::vector<float> x;
  std::vector<int> codes;
};

std::vector<TinyScaleCase> tiny_scale_cases() {
  using optimized::Codec;
  const auto opt = [](Codec c, std::vector<float> fixed = {}) {
    optimized::RowFormat f;
    f.codec = c;
    f.static_scales = fixed;
    return f;
  };
  std::vector<float> tiny(32, 0.0f);
  tiny[0] = std::ldexp(1.0f, -130), tiny[1] = -std::ldexp(1.0f, -130);  // subnormal
  // Affine groups of tiny range, chosen so that S is exact: int4 [-2^-121, 7 * 2^-124] gives
  // S = 2^-124; int2 [-2^-123, 2^-124] gives S = 2^-124 too.
  std::vector<float> wide4(32, 0.0f), wide2(32, 0.0f);
  wide4[0] = -std::ldexp(1.0f, -121), wide4[1] = 7 * std::ldexp(1.0f, -124);
  wide2[0] = -std::ldexp(1.0f, -123), wide2[1] = std::ldexp(1.0f, -124);
  std::vector<int> q8 = std::vector<int>(32, 0), q4 = std::vector<int>(32, 8);
  // q8_0: d = 2^-130 / 127 is the subnormal 4128 * 2^-149, 1 / d overflows; x / d = 127.008.
  q8[0] = 127, q8[1] = -127;
  // q4_0: m = 2^-130 (the first of largest magnitude), d = -2^-133 exactly, 1 / d overflows;
  // x / d + 8.5: 0.5 -> 0, 16.5 -> 15 (clamped), 8.5 -> 8 for the zeros.
  q4[0] = 0, q4[1] = 15;
  // int4: Z = round(2^-121 / 2^-124) = 8; codes -8 + 8 = 0, 7 + 8 = 15, zeros 8.
  std::vector<int> i4(32, 8);
  i4[0] = 0, i4[1] = 15;
  std::vector<int> i2(32, 2);  // int2: Z = 2; codes -2 + 2 = 0, 1 + 2 = 3, zeros 2
  i2[0] = 0, i2[1] = 3;
  return {
      {"int8, static scale 1e-30", format(QuantFormat::int8, ScaleGranularity::tensor, 0, ScaleDtype::float32, {1e-30}),
       opt(Codec::int8, {1e-30f}), {1.0f, -1.0f, 0.5f, -3e-30f, 1e-30f, 0.0f, 2e-31f, -2e-31f},
       {127, -127, 127, -3, 1, 0, 0, 0}},
      {"q8_0, subnormal block", format(QuantFormat::q8_0), opt(Codec::q8_0), tiny, q8},
      {"q4_0, subnormal block", format(QuantFormat::q4_0), opt(Codec::q4_0), tiny, q4},
      {"int4, scale 2^-124", format(QuantFormat::int4, ScaleGranularity::group, 32), opt(Codec::int4), wide4, i4},
      {"int2, scale 2^-124", format(QuantFormat::int2, ScaleGranularity::group, 32), opt(Codec::int2), wide2, i2},
  };
}

}  // namespace

TEST(ReferenceQuantize, TinyScalesSaturateTowardTheValuesSign) {
  for (const TinyScaleCase& c : tiny_scale_cases()) {
    const QuantizedRow r = reference::quantize(c.ref, c.x.data(), static_cast<int>(c.x.size()), 0);
    EXPECT_EQ(r.codes, c.codes) << c.name;
  }
}

TEST(QuantCodec, TinyScalesSaturateTowardTheValuesSign) {
  for (TinyScaleCase c : tiny_scale_cases()) {
    const int d = static_cast<int>(c.x.size());
    if (c.opt.codec == optimized::Codec::int4 || c.opt.codec == optimized::Codec::int2) c.opt.group = 32;
    std::vector<std::byte> bytes(optimized::row_bytes(c.opt, d));
    std::vector<float> scratch(static_cast<std::size_t>(d));
    optimized::encode_row(c.opt, 0, c.x.data(), d, bytes.data(), scratch.data());
    EXPECT_EQ(optimized::unpack_row(c.opt, 0, bytes.data(), d).codes, c.codes) << c.name;
  }
}

TEST(ReferenceQuantize, Fp8KnownPatternsTiesAndSaturation) {
  const QuantFormat e4 = QuantFormat::fp8_e4m3, e5 = QuantFormat::fp8_e5m2;
  EXPECT_EQ(reference::fp8_value(e4, 0x7E), 448.0);
  EXPECT_EQ(reference::fp8_value(e4, 0x38), 1.0);
  EXPECT_EQ(reference::fp8_value(e4, 0x08), std::ldexp(1.0, -6));  // the smallest normal
  EXPECT_EQ(reference::fp8_value(e4, 0x01), std::ldexp(1.0, -9));  // the smallest subnormal
  EXPECT_EQ(reference::fp8_value(e5, 0x7B), 57344.0);
  EXPECT_EQ(reference::fp8_value(e5, 0x3C), 1.0);
  EXPECT_EQ(reference::fp8_code(e4, 1.0625), 0x38);  // halfway 1 and 1.125: the even pattern
  EXPECT_EQ(reference::fp8_code(e4, 1.1875), 0x3A);  // halfway 1.125 and 1.25: the even pattern
  EXPECT_EQ(reference::fp8_code(e4, -1.0), 0xB8);
  EXPECT_EQ(reference::fp8_code(e4, 500.0), 0x7E);  // saturating, not infinity or NaN
  EXPECT_EQ(reference::fp8_code(e4, std::ldexp(1.0, -10)), 0x00);  // half a subnormal step: even 0
  EXPECT_EQ(reference::fp8_code(e4, std::ldexp(3.0, -10)), 0x02);  // 1.5 steps: even 2
  EXPECT_EQ(reference::fp8_code(e5, 1.125), 0x3C);
  EXPECT_EQ(reference::fp8_code(e5, 1e9), 0x7B);
}

TEST(ReferenceQuantize, AffineInt4AndAllEqualGroups) {
  const TensorQuant q4 = format(QuantFormat::int4);
  // S = 4.5 / 15 = 0.3 (as float32), Z = round(1.5 / S) = 5: codes (x / S) + 5.
  const std::vector<float> x = {-1.5f, 0.0f, 3.0f, 1.5f};
  const QuantizedRow r = reference::quantize(q4, x.data(), 4, 0);
  EXPECT_EQ(r.scales[0], static_cast<double>(0.3f));
  EXPECT_EQ(r.zeros[0], 5);
  EXPECT_EQ(r.codes, (std::vector<int>{0, 5, 15, 10}));
  // An all-equal group takes its range from 0: it reads back within float32 rounding.
  const std::vector<float> same = {2.0f, 2.0f, 2.0f, 2.0f};
  const QuantizedRow e = reference::quantize(q4, same.data(), 4, 0);
  EXPECT_EQ(e.codes, (std::vector<int>{15, 15, 15, 15}));
  for (double v : decoded(q4, e)) EXPECT_NEAR(v, 2.0, 1e-6);
  const TensorQuant q2 = format(QuantFormat::int2);
  const std::vector<float> ramp = {0.0f, 1.0f, 2.0f, 3.0f};
  EXPECT_EQ(reference::quantize(q2, ramp.data(), 4, 0).codes, (std::vector<int>{0, 1, 2, 3}));
}

// Three tokens of two channels: t0 (0, -3), t1 (15, 12), t2 (15, 0); int4 affine along the token axis.
const std::vector<std::vector<float>> kThreeTokens = {{0.0f, -3.0f}, {15.0f, 12.0f}, {15.0f, 0.0f}};

TEST(ReferenceQuantize, ChannelScalesAlongTokensByHand) {
  std::vector<const float*> rows;
  for (const auto& t : kThreeTokens) rows.push_back(t.data());
  // Runs of 2 tokens: channel 0 of (t0, t1) spans [0, 15]: S 1, Z 0; channel 1 spans [-3, 12]:
  // S 1, Z 3. t2 alone: channel 0 is all-equal 15, its range [0, 15] (S 1, Z 0); channel 1 is
  // all-equal 0, its range [0, 0] (S 0, Z 0, code 0).
  const TensorQuant runs = format(QuantFormat::int4, ScaleGranularity::channel, 2);
  const std::vector<QuantizedRow> r = reference::quantize_along_tokens(runs, rows, 2);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].codes, (std::vector<int>{0, 0}));
  EXPECT_EQ(r[1].codes, (std::vector<int>{15, 15}));
  EXPECT_EQ(r[2].codes, (std::vector<int>{15, 0}));
  EXPECT_EQ(r[0].scales, (std::vector<double>{1.0, 1.0}));
  EXPECT_EQ(r[2].scales, (std::vector<double>{1.0, 0.0}));
  EXPECT_EQ(r[1].zeros, (std::vector<int>{0, 3}));
  EXPECT_EQ(r[2].zeros, (std::vector<int>{0, 0}));
  EXPECT_EQ(decoded(runs, r[0]), (std::vector<double>{0.0, -3.0}));
  // One run of all three ("channel"): channel 1 spans [-3, 12], so t2's 0 is code 3.
  const TensorQuant all = format(QuantFormat::int4, ScaleGranularity::channel, 0);
  const std::vector<QuantizedRow> a = reference::quantize_along_tokens(all, rows, 2);
  EXPECT_EQ(a[2].codes, (std::vector<int>{15, 3}));
  EXPECT_EQ(a[2].zeros, (std::vector<int>{0, 3}));
  EXPECT_EQ(decoded(all, a[1]), (std::vector<double>{15.0, 12.0}));
  // int8 per channel: s = amax / 127 over the run; channel 1's amax is 12, so -3 is -31.75 -> -32.
  const TensorQuant int8 = format(QuantFormat::int8, ScaleGranularity::channel, 0);
  const std::vector<QuantizedRow> i = reference::quantize_along_tokens(int8, rows, 2);
  EXPECT_EQ(i[0].codes, (std::vector<int>{0, -32}));
  EXPECT_EQ(i[0].scales[1], static_cast<double>(static_cast<float>(12.0 / 127.0)));
}

TEST(QuantCodec, AlongTokensStoresTheHandWorkedCodes) {
  // The same three tokens through the optimized codec: each row keeps its run's scale and
  // zero point per channel, and reads back what the codes stand for.
  optimized::RowFormat f;
  f.codec = optimized::Codec::int4;
  f.along_tokens = true;
  f.token_run = 2;
  std::vector<std::vector<std::byte>> stored(3, std::vector<std::byte>(optimized::row_bytes(f, 2)));
  std::vector<const float*> rows;
  std::vector<std::byte*> out;
  for (std::size_t t = 0; t < 3; ++t) rows.push_back(kThreeTokens[t].data()), out.push_back(stored[t].data());
  optimized::encode_rows_along_tokens(f, rows.data(), 3, 2, out.data());
  const std::vector<std::vector<int>> codes = {{0, 0}, {15, 15}, {15, 0}}, zeros = {{0, 3}, {0, 3}, {0, 0}};
  const std::vector<std::vector<float>> scales = {{1.0f, 1.0f}, {1.0f, 1.0f}, {1.0f, 0.0f}};
  for (std::size_t t = 0; t < 3; ++t) {
    const optimized::UnpackedRow u = optimized::unpack_row(f, 0, stored[t].data(), 2);
    EXPECT_EQ(u.codes, codes[t]) << "token " << t;
    EXPECT_EQ(u.zeros, zeros[t]) << "token " << t;
    EXPECT_EQ(u.scales, scales[t]) << "token " << t;
    std::vector<float> back(2);
    optimized::decode_row(f, 0, stored[t].data(), 2, back.data());
    EXPECT_EQ(back, (std::vector<float>{kThreeTokens[t][0], t == 2 ? 0.0f : kThreeTokens[t][1]})) << "token " << t;
  }
}

TEST(ReferenceQuantize, HadamardByHandAndItsOwnInverse) {
  std::vector<double> a = {1.0, 0.0};
  reference::hadamard(a.data(), 2);
  EXPECT_NEAR(a[0], std::sqrt(0.5), 1e-15);
  EXPECT_NEAR(a[1], std::sqrt(0.5), 1e-15);
  std::vector<double> b = {1.0, 1.0, 1.0, 1.0};
  reference::hadamard(b.data(), 4);
  EXPECT_NEAR(b[0], 2.0, 1e-15);
  for (int i = 1; i < 4; ++i) EXPECT_NEAR(b[i], 0.0, 1e-15);
  std::vector<double> c(64);
  for (int i = 0; i < 64; ++i) c[i] = std::sin(i * 1.7);
  std::vector<double> d = c;
  reference::hadamard(d.data(), 64);
  reference::hadamard(d.data(), 64);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(d[i], c[i], 1e-13);
}

// The codec of optimized/ against the reference, format by format, on rows of every kind:
// random magnitudes from 1e-6 to 1e3, exact ties, zero and all-equal groups. Codes agree
// except where the reference says the value sits on a rounding boundary; scales agree
// exactly; decoded values agree to float32 rounding.
TEST(QuantCodec, AgreesWithTheReferenceCodeForCode) {
  using optimized::Codec;
  struct Case {
    TensorQuant ref;
    optimized::RowFormat opt;
  };
  const auto opt = [](Codec c, int group = 0, bool half = false, std::vector<float> fixed = {}) {
    optimized::RowFormat f;
    f.codec = c;
    f.group = group;
    f.scale_half = half;
    f.static_scales = fixed;
    return f;
  };
  const std::vector<Case> cases = {
      {format(QuantFormat::q8_0), opt(Codec::q8_0)},
      {format(QuantFormat::q4_0), opt(Codec::q4_0)},
      {format(QuantFormat::int8), opt(Codec::int8)},
      {format(QuantFormat::int8_even, ScaleGranularity::tensor, 0, ScaleDtype::float32, {0.02}),
       opt(Codec::int8_even, 0, false, {0.02f})},
      {format(QuantFormat::int4_even, ScaleGranularity::tensor, 0, ScaleDtype::float32, {0.3}),
       opt(Codec::int4_even, 0, false, {0.3f})},
      {format(QuantFormat::int8, ScaleGranularity::group, 16, ScaleDtype::float16), opt(Codec::int8, 16, true)},
      {format(QuantFormat::fp8_e4m3), opt(Codec::fp8_e4m3)},
      {format(QuantFormat::fp8_e4m3, ScaleGranularity::tensor, 0, ScaleDtype::float32, {0.05}),
       opt(Codec::fp8_e4m3, 0, false, {0.05f})},
      {format(QuantFormat::fp8_e5m2, ScaleGranularity::token, 0, ScaleDtype::float16), opt(Codec::fp8_e5m2, 0, true)},
      {format(QuantFormat::int4, ScaleGranularity::group, 32), opt(Codec::int4, 32)},
      {format(QuantFormat::int2, ScaleGranularity::group, 16, ScaleDtype::float16), opt(Codec::int2, 16, true)},
  };
  const int D = 64;
  std::uint64_t state = 12345;
  const auto next = [&] { return uniform(state); };
  std::vector<float> x(D), scratch(D), back(D);
  for (const Case& c : cases) {
    std::vector<std::byte> bytes(optimized::row_bytes(c.opt, D));
    int compared = 0;
    for (int row = 0; row < 400; ++row) {
      const double magnitude = std::pow(10.0, -6.0 + 9.0 * next());
      for (int i = 0; i < D; ++i) x[i] = static_cast<float>((2.0 * next() - 1.0) * magnitude);
      if (row % 7 == 0) std::fill(x.begin(), x.begin() + 32, 0.0f);           // a zero block
      if (row % 11 == 0) std::fill(x.begin() + 32, x.end(), x[33]);           // an all-equal block
      if (row % 5 == 0) x[3] = 2.5f, x[4] = -2.5f, x[5] = 127.0f, x[6] = 0.0f;  // exact ties
      const QuantizedRow want = reference::quantize(c.ref, x.data(), D, 0);
      optimized::encode_row(c.opt, 0, x.data(), D, bytes.data(), scratch.data());
      const optimized::UnpackedRow got = optimized::unpack_row(c.opt, 0, bytes.data(), D);
      ASSERT_EQ(got.scales.size(), want.scales.size()) << to_string(c.ref.format);
      for (std::size_t g = 0; g < want.scales.size(); ++g)
        ASSERT_EQ(static_cast<double>(got.scales[g]), want.scales[g]) << to_string(c.ref.format) << " row " << row;
      ASSERT_EQ(got.zeros, want.zeros) << to_string(c.ref.format) << " row " << row;
      for (int i = 0; i < D; ++i) {
        if (got.codes[i] == want.codes[i]) {
          ++compared;
          continue;
        }
        EXPECT_TRUE(want.near_boundary[i] && std::abs(got.codes[i] - want.codes[i]) == 1)
            << to_string(c.ref.format) << " row " << row << " element " << i << ": x " << x[i] << " reference "
            << want.codes[i] << ", codec " << got.codes[i];
      }
      std::vector<double> values(D);
      reference::dequantize(c.ref, want, values.data());
      optimized::decode_row(c.opt, 0, bytes.data(), D, back.data());
      for (int i = 0; i < D; ++i) {
        if (got.codes[i] != want.codes[i]) continue;
        ASSERT_NEAR(back[i], values[i], 1e-6 * std::abs(values[i]) + 1e-37) << to_string(c.ref.format);
      }
    }
    EXPECT_GT(compared, 400 * D * 99 / 100) << to_string(c.ref.format);
  }
}

// Scales along the token axis, two implementations apart: runs of 8 and one run of all,
// over 37 tokens (a last run of 5), zero and all-equal channels, float16 scales.
TEST(QuantCodec, AlongTokensAgreesWithTheReferenceCodeForCode) {
  using optimized::Codec;
  const std::vector<std::pair<QuantFormat, Codec>> formats = {{QuantFormat::int4, Codec::int4},
                                                              {QuantFormat::int2, Codec::int2},
                                                              {QuantFormat::int8, Codec::int8},
                                                              {QuantFormat::fp8_e4m3, Codec::fp8_e4m3},
                                                              {QuantFormat::fp8_e5m2, Codec::fp8_e5m2}};
  const int D = 32, n = 37;
  std::uint64_t state = 777;
  const auto next = [&] { return uniform(state); };
  std::vector<std::vector<float>> rows(n, std::vector<float>(D));
  for (int t = 0; t < n; ++t) {
    const double magnitude = std::pow(10.0, -3.0 + 5.0 * next());
    for (int c = 0; c < D; ++c) rows[t][c] = static_cast<float>((2.0 * next() - 1.0) * magnitude);
    rows[t][0] = 0.0f;   // a zero channel
    rows[t][1] = 1.5f;   // an all-equal channel
  }
  std::vector<const float*> x;
  for (const auto& r : rows) x.push_back(r.data());
  for (const auto& [ref_format, codec] : formats)
    for (const int run : {8, 0})
      for (const bool half : {false, true}) {
        const TensorQuant ref = format(ref_format, ScaleGranularity::channel, run, half ? ScaleDtype::float16 : ScaleDtype::float32);
        optimized::RowFormat f;
        f.codec = codec, f.along_tokens = true, f.token_run = run, f.scale_half = half;
        std::vector<std::vector<std::byte>> stored(n, std::vector<std::byte>(optimized::row_bytes(f, D)));
        std::vector<std::byte*> out;
        for (auto& s : stored) out.push_back(s.data());
        optimized::encode_rows_along_tokens(f, x.data(), n, D, out.data());
        const std::vector<QuantizedRow> want = reference::quantize_along_tokens(ref, x, D);
        const std::string what = std::string(to_string(ref_format)) + " run " + std::to_string(run) + (half ? " float16" : "");
        int differing = 0;
        for (int t = 0; t < n; ++t) {
          const optimized::UnpackedRow got = optimized::unpack_row(f, 0, stored[t].data(), D);
          ASSERT_EQ(got.scales.size(), static_cast<std::size_t>(D)) << what;
          for (int c = 0; c < D; ++c) {
            ASSERT_EQ(static_cast<double>(got.scales[c]), want[t].scales[c]) << what << " token " << t << " channel " << c;
            if (!want[t].zeros.empty()) {
              ASSERT_EQ(got.zeros[c], want[t].zeros[c]) << what << " token " << t;
            }
            if (got.codes[c] == want[t].codes[c]) continue;
            ++differing;
            EXPECT_TRUE(want[t].near_boundary[c] && std::abs(got.codes[c] - want[t].codes[c]) == 1)
                << what << " token " << t << " channel " << c << ": reference " << want[t].codes[c] << ", codec "
                << got.codes[c];
          }
        }
        EXPECT_LT(differing, n * D / 100) << what;
        // The all-equal channel of 1.5 is the top code times its scale, 1.5 / top as stored
        // (float16: 1.5 / 15 = 0.1 is stored as 0.0999755859375); the zero channel reads 0.
        std::vector<float> back(D);
        optimized::decode_row(f, 0, stored[n - 1].data(), D, back.data());
        const double top = reference::code_range(ref_format);
        const double scale = half ? reference::round_to_float16(1.5 / top) : static_cast<float>(1.5 / top);
        EXPECT_NEAR(back[1], top * scale, 1e-6) << what;
        EXPECT_EQ(back[0], 0.0f) << what;
      }
}

// The optimized Hadamard transform is undone on read: a row round-trips through it to
// within the format's error, and the codes are those of the transformed row.
TEST(QuantCodec, HadamardRowsRoundTrip) {
  optimized::RowFormat f;
  f.codec = optimized::Codec::q8_0;
  f.hadamard = true;
  const int D = 64;
  std::vector<float> x(D), scratch(D), back(D);
  for (int i = 0; i < D; ++i) x[i] = static_cast<float>(std::cos(0.37 * i) * (i % 5 + 1));
  std::vector<std::byte> bytes(optimized::row_bytes(f, D));
  optimized::encode_row(f, 0, x.data(), D, bytes.data(), scratch.data());
  optimized::decode_row(f, 0, bytes.data(), D, back.data());
  std::vector<double> h(x.begin(), x.end());
  reference::hadamard(h.data(), D);
  double amax = 0.0;
  for (double v : h) amax = std::max(amax, std::abs(v));
  for (int i = 0; i < D; ++i) EXPECT_NEAR(back[i], x[i], amax / 127.0 * std::sqrt(static_cast<double>(D)));
  std::vector<float> transformed(h.begin(), h.end());
  const QuantizedRow want = reference::quantize(format(QuantFormat::q8_0), transformed.data(), D, 0);
  const optimized::UnpackedRow got = optimized::unpack_row(f, 0, bytes.data(), D);
  for (int i = 0; i < D; ++i)
    EXPECT_TRUE(got.codes[i] == want.codes[i] || (want.near_boundary[i] && std::abs(got.codes[i] - want.codes[i]) == 1));
}

// A block-diagonal Hadamard transform ("transform_block", llama.cpp's 64-wide V rotation at
// head_dim 128), worked by hand at head_dim 4 in blocks of 2: x = (1, 2, 3, -2) becomes
// (3, -1, 1, 5) / sqrt(2); int8 with a token scale then stores s = (5 / sqrt(2)) / 127 and
// codes round(127 (3, -1, 1, 5) / 5) = (76, -25, 25, 127). The whole-head matrix would give
// (2, 2, 1, -3), codes (85, 85, 42, -127): another row.
TEST(QuantCodec, HadamardBlocksWorkedByHand) {
  const std::vector<float> x = {1.0f, 2.0f, 3.0f, -2.0f};
  const std::vector<int> want = {76, -25, 25, 127};
  const double scale = 5.0 / std::sqrt(2.0) / 127.0;

  optimized::RowFormat f;
  f.codec = optimized::Codec::int8;
  f.hadamard = true;
  f.hadamard_block = 2;
  std::vector<float> scratch(4), back(4);
  std::vector<std::byte> bytes(optimized::row_bytes(f, 4));
  optimized::encode_row(f, 0, x.data(), 4, bytes.data(), scratch.data());
  const optimized::UnpackedRow got = optimized::unpack_row(f, 0, bytes.data(), 4);
  EXPECT_EQ(got.codes, want);
  ASSERT_EQ(got.scales.size(), 1u);
  EXPECT_NEAR(got.scales[0], scale, 1e-7);
  optimized::decode_row(f, 0, bytes.data(), 4, back.data());  // the transform undone
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back[i], x[static_cast<std::size_t>(i)], scale);

  TensorQuant ref = format(QuantFormat::int8);
  ref.transform_block = 2;
  const QuantizedRow stored =
      reference::quantize_key_at(ref, QuantTransform::hadamard, Rope{}, x.data(), 4, 0, 0);  // position 0
  EXPECT_EQ(stored.codes, want);
  ASSERT_EQ(stored.scales.size(), 1u);
  EXPECT_NEAR(stored.scales[0], scale, 1e-7);
  std::vector<double> values(4);
  reference::dequantize_stored(ref, QuantTransform::hadamard, stored, values.data());
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(values[static_cast<std::size_t>(i)], x[static_cast<std::size_t>(i)], scale);
}
