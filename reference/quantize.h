// SPEC 9 in the reference: each format's quantize and dequantize, written from the
// format table, plainly and apart from the optimized caches' codecs (the two share no
// code, so a quantizer bug shows as a disagreement, not as agreement).
//
// Arithmetic follows the formats' own definitions where they are defined in float32
// (ggml's q8_0 and q4_0 compute codes with the float32 scale and its float32 reciprocal,
// then store the scale in float16); elsewhere x / s in double, rounded as the table says.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/kv_quant.h"

namespace kvcheck::reference {

// One row of head_dim values (one token, one kv head) as a quantized cache stores it.
struct QuantizedRow {
  std::vector<int> codes;      // one per element: a signed integer, or fp8's bit pattern 0..255
  std::vector<double> scales;  // one per scale group, exactly as stored (in the scale dtype)
  std::vector<int> zeros;      // affine int4 / int2: one zero point per group; else empty
  std::vector<double> biases;  // mlx_affine: one bias per group, as stored; else empty
  // Per element: x / s came within the boundary window of a rounding boundary, so a cache
  // whose float32 arithmetic differs by a few ulps may store the neighbouring code.
  std::vector<bool> near_boundary;
  // Per group: a computed scale a few ulps from its dtype's rounding boundary (float16), or
  // any computed float32 scale: another amax a few ulps away may give the neighbouring one.
  // Static scales never are.
  std::vector<bool> scale_near_boundary;
  // Per group, the range [scale_min, scale_max] of stored scales (in the scale dtype) a cache
  // may compute when each element is off by at most the boundary window: from amax -+ w
  // (int8, fp8, q8_0, q4_0: a static scale's range is itself) or from max - min -+ 2w (affine
  // int4 / int2). Affine groups also keep their minimum `lows` and window `windows` (the zero
  // point round(-min / S) is checked against the stored S over min -+ window). Empty for
  // codes read back from a cache.
  std::vector<double> scale_min, scale_max, lows, windows;
  // mlx_affine (SPEC 9.7), per group: lows hold the edge, spans max - min, other_edges the
  // other extreme when |min| and |max| are within twice the window (either may be the edge in
  // another's arithmetic), else NaN; and the float32 values quantized, one per element, from
  // which the check recomputes the codes under a cache's own scale and bias. Empty for codes
  // read back from a cache.
  std::vector<double> spans, other_edges;
  std::vector<float> values;
  bool operator==(const QuantizedRow&) const = default;
};

// x rounded to float16 (nearest, ties to even; subnormals; beyond 65504: infinity).
double round_to_float16(double x);

// Elements per scale for `format` at head_dim `d` (q8_0 and q4_0: 32).
int scale_group(const TensorQuant& quant, int head_dim);

// The largest magnitude a code can hold, in units of the scale (fp8: 448 or 57344, int8: 127).
double code_range(QuantFormat format);

// How close to a rounding boundary (relative to the row's largest element) a value may fall
// and still be stored either way: 8 float32 ulps for arithmetic done in another order,
// plus what an engine's float32 rope angle (position times an ulp) moves a key at `position`.
double boundary_window(std::int64_t position);

// Quantizes the float32 values x[0..n) of kv head `kv_head` (static scales may differ per
// head), marking the elements within `window` (boundary_window) of a rounding boundary.
QuantizedRow quantize(const TensorQuant& quant, const float* x, int n, int kv_head, double window = 0x1p-20);
// Scales along the token axis (granularity "channel"): rows[0..n) (d float32 values each, in
// token order) quantized together. Each channel of each run of quant.scale.group tokens (0:
// all n) is quantized as one "token" row of the format would be: one scale (and zero point)
// per channel per run. Each returned row carries its run's scales, one per element
// (scale_group is 1 for it), so it dequantizes like any row.
std::vector<QuantizedRow> quantize_along_tokens(const TensorQuant& quant, const std::vector<const float*>& rows, int d,
                                                double window = 0x1p-20);
// The values the codes stand for.
void dequantize(const TensorQuant& quant, const QuantizedRow& row, double* out);

// fp8: the value of a bit pattern (0..255) and the pattern nearest y, ties to the even
// pattern, saturating at the largest finite value.
double fp8_value(QuantFormat format, int bits);
int fp8_code(QuantFormat format, double y);

// SPEC 9's per-element bound e(x) for a value x quantized with (stored) scale s.
double element_bound(QuantFormat format, double x, double s);

// ggml's x86 CPU backend quantizing an activation (the query) to q8_0 before a matmul with
// q8_0 weights (quantize_row_q8_0, AVX2): per block of 32, id = 127 / amax in float32 and
// codes rounded half to even (not the reference row quantizer's half away from zero and
// 1 / d); the scale amax / 127 stored in float16. Writes the dequantized values to out and
// returns how far they may be from a backend's whose float32 arithmetic differs by a few
// ulps: the 2-norm of one code step at every element within `window` of a tie, and of the
// other float16 scale where amax / 127 lies within `window` of a float16 midpoint.
double quantize_activation_q8_0(const float* x, int n, double* out, double window);

// The normalized Sylvester Hadamard transform of n (a power of two) doubles, in place:
// H[i][j] = (-1)^popcount(i & j) / sqrt(n). H is symmetric and its own inverse.
void hadamard(double* x, int n);

}  // namespace kvcheck::reference
