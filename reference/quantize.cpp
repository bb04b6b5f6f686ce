#include "reference/quantize.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>

namespace kvcheck::reference {

namespace {

// A cache's float32 rotation (and transform) may differ from this double one by a few
// ulps of the row's largest element; a value that close to a rounding boundary may take
// either code. 8 ulps of float32 (2^-20 relative) covers a rotation and a 128-wide
// transform, and is still a tiny fraction of a code step. An engine that computes the rope
// angle p * theta_i in float32 (ggml) is off by about p ulps of the angle: 4 ulps per
// position covers it (a key at position 4096 gets a window of 2^-10, still a thousandth of
// a q8_0 step).
constexpr double kBoundaryWindow = 0x1p-20, kWindowPerPosition = 0x1p-22;

bool near_half_integer(double y, double window) { return std::abs(std::abs(y - std::floor(y)) - 0.5) <= window; }

// A scale computed in float32 lands on another value of `dtype` if it moves by the window.
bool scale_ambiguous(ScaleDtype dtype, float s, double window) {
  if (dtype == ScaleDtype::float32) return true;  // any few-ulp move shows in float32
  return round_to_float16(s * (1.0 + window)) != round_to_float16(s * (1.0 - window));
}

// A computed scale as an engine gets it: the quotient in float32, then stored in its dtype.
double in_dtype(ScaleDtype dtype, double s) {
  const double f = static_cast<float>(s);
  return dtype == ScaleDtype::float16 ? round_to_float16(f) : f;
}

double largest_magnitude(const float* x, int n) {
  double m = 0.0;
  for (int i = 0; i < n; ++i) m = std::max(m, std::abs(static_cast<double>(x[i])));
  return m;
}

int bits_of(QuantFormat f) { return f == QuantFormat::int4 ? 4 : 2; }

}  // namespace

double round_to_float16(double x) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| = f 2^e with f in [0.5, 1): 11 significant bits means a step of 2^(e - 11)
  const double step = e - 1 < -14 ? std::ldexp(1.0, -24) : std::ldexp(1.0, e - 11);
  const double r = std::nearbyint(x / step) * step;  // the default rounding mode: ties to even
  return std::abs(r) > 65504.0 ? std::copysign(INFINITY, x) : r;
}

int scale_group(const TensorQuant& quant, int head_dim) {
  switch (quant.format) {
    case QuantFormat::q8_0:
    case QuantFormat::q4_0:
      return 32;
    default:
      break;
  }
  switch (quant.scale.granularity) {
    case ScaleGranularity::group:
      return quant.scale.group;
    case ScaleGranularity::channel:
      return 1;  // a row carries its run's scale for each channel
    default:
      return head_dim;  // tensor, head and token scales cover the whole row
  }
}

double code_range(QuantFormat format) {
  switch (format) {
    case QuantFormat::fp8_e4m3:
      return 448.0;
    case QuantFormat::fp8_e5m2:
      return 57344.0;
    case QuantFormat::int8:
    case QuantFormat::q8_0:
    case QuantFormat::int8_even:
      return 127.0;
    case QuantFormat::int4_even:
      return 7.0;
    case QuantFormat::q4_0:
      return 8.0;
    case QuantFormat::int4:
      return 15.0;
    case QuantFormat::int2:
      return 3.0;
    case QuantFormat::mlx_affine:
      return 255.0;  // its codes' range is 2^bits - 1 (TensorQuant::bits): 255 at 8 bits
    case QuantFormat::quanto_affine:
      return 15.0;  // likewise (2 or 4 bits); its scale comes from the group's range
  }
  return 1.0;
}

double fp8_value(QuantFormat format, int bits) {
  const bool e4m3 = format == QuantFormat::fp8_e4m3;
  const int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int sign = bits >> 7, exponent = (bits >> mantissa_bits) & (e4m3 ? 15 : 31),
            mantissa = bits & ((1 << mantissa_bits) - 1);
  const double m = static_cast<double>(mantissa) / (1 << mantissa_bits);
  const double magnitude = exponent == 0 ? std::ldexp(m, 1 - bias) : std::ldexp(1.0 + m, exponent - bias);
  return sign ? -magnitude : magnitude;
}

int fp8_code(QuantFormat format, double y) {
  // Positive patterns 0 .. top hold increasing magnitudes; the sign is bit 7.
  const int top = format == QuantFormat::fp8_e4m3 ? 0x7E : 0x7B;  // 448 and 57344
  const double a = std::abs(y);
  int best = 0;
  for (int c = 1; c <= top; ++c) {
    const double here = std::abs(fp8_value(format, c) - a), there = std::abs(fp8_value(format, best) - a);
    if (here < there || (here == there && c % 2 == 0)) best = c;
  }
  if (a >= fp8_value(format, top)) best = top;  // saturating
  return std::signbit(y) ? best | 0x80 : best;
}

double element_bound(QuantFormat format, double x, double s) {
  const double a = std::abs(x), d = std::abs(s);
  switch (format) {
    case QuantFormat::fp8_e4m3:
      return std::max(a * 0x1p-4, d * 0x1p-10);
    case QuantFormat::fp8_e5m2:
      return std::max(a * 0x1p-3, d * 0x1p-17);
    case QuantFormat::int8:
    case QuantFormat::int8_even:
    case QuantFormat::int4_even:
      return d / 2;
    case QuantFormat::q8_0:
      return d / 2 + 127 * d * 0x1p-11;
    case QuantFormat::q4_0:
      return d * (1 + 0x1p-8);
    case QuantFormat::int4:
    case QuantFormat::int2:
      return d;
    case QuantFormat::mlx_affine:
      // SPEC 9.7: within reach, half a step; the far edge, clipped, within n (r - |S|) < r <=
      // (4/3) |S| of the last code (r = (max - min) / n, |S| >= r |e| / (|e| + r/2), |e| >= n r / 2).
      return 2.0 * d;
    case QuantFormat::quanto_affine:
      // SPEC 9.8: half a step S = (max - min) / n from the nearest code, and float32's roundings
      // of x - min, of the quotient and of c S + min, well inside the other half.
      return d;
  }
  return INFINITY;
}

double boundary_window(std::int64_t position) {
  return kBoundaryWindow + kWindowPerPosition * static_cast<double>(position < 0 ? -position : position);
}

namespace {

// A code from a rounded real: saturated to [lo, hi] in double before the conversion to int,
// which is undefined for |r| >= 2^31 (a tiny static scale: x / 1e-30) and for NaN (mapped to
// `nan_code`). Converting first and clamping after stored large positive values as -127.
int saturated(double rounded, int lo, int hi, int nan_code = 0) {
  if (std::isnan(rounded)) return nan_code;
  return static_cast<int>(std::clamp(rounded, static_cast<double>(lo), static_cast<double>(hi)));
}

// x * id as ggml computes it, or x / d where 1 / d overflowed float32 (d below about 2^-127):
// there ggml's own product is infinite and its conversion undefined; x / d is the code the
// rule round(x / d) means.
float times_inverse(float x, float d, float id) { return std::isinf(id) ? x / d : x * id; }

}  // namespace

namespace {

// SPEC 9.7, MLX's affine group (mx.quantize, mlx 0.32 on the CPU): every step in float32, one
// rounding to nearest even per operation; the codes divide by the float32 scale and subtract
// the float32 bias that are then stored (float32 here: nothing is rounded again).
void mlx_affine_group(int bits, const float* xs, int group, double window, QuantizedRow& row, int g0) {
  const float n = static_cast<float>((1 << bits) - 1), eps = 1e-7f;
  float lo = xs[0], hi = xs[0];
  for (int i = 1; i < group; ++i) lo = std::min(lo, xs[i]), hi = std::max(hi, xs[i]);
  const float r = std::max((hi - lo) / n, eps);
  const bool low_edge = std::abs(lo) > std::abs(hi);  // the edge of larger magnitude becomes code 0
  float s = low_edge ? r : -r;
  const float edge = low_edge ? lo : hi;
  const float q0 = std::nearbyint(edge / s);
  float bias = 0.0f;
  if (q0 != 0.0f) s = edge / q0, bias = edge;
  row.scales.push_back(s);
  row.biases.push_back(bias);
  // Another's float32 rotation may move each element by the window: the edge (so the bias
  // and, through q0, the scale) and the range with it, even the orientation where |lo| and
  // |hi| nearly tie. The check (mlx_group_accepted) recomputes what is reachable from these.
  row.scale_near_boundary.push_back(window > 0.0);
  row.lows.push_back(edge);
  row.windows.push_back(window);
  row.spans.push_back(static_cast<double>(hi) - lo);
  const bool near_tie = std::abs(std::abs(static_cast<double>(lo)) - std::abs(static_cast<double>(hi))) <= 2 * window;
  row.other_edges.push_back(near_tie ? (low_edge ? hi : lo) : NAN);
  row.values.insert(row.values.end(), xs, xs + group);
  for (int i = 0; i < group; ++i) {
    const float y = (xs[i] - bias) / s;
    row.codes[static_cast<std::size_t>(g0 + i)] = std::isnan(y) ? 0 : static_cast<int>(std::clamp(std::nearbyint(y), 0.0f, n));
    row.near_boundary[static_cast<std::size_t>(g0 + i)] = near_half_integer(y, window / std::abs(s));
  }
}

// The model dtype T of quanto's arithmetic: torch's CPU kernels compute a float16 operation in
// float32 and round the result once to float16.
float in_quanto_dtype(ScaleDtype dtype, float x) {
  return dtype == ScaleDtype::float16 ? static_cast<float>(round_to_float16(x)) : x;
}

// SPEC 9.8, optimum-quanto 0.2.7's MaxOptimizer and quantize as transformers' QuantizedLayer
// calls them on keys and values of the model's dtype T (float32 or float16): every step one
// operation in T; codes round ties to even (torch.round); a group of equal values has S = 0,
// and its codes are 0.
void quanto_affine_group(int bits, ScaleDtype dtype, const float* xs, int group, double window, QuantizedRow& row,
                         int g0) {
  const auto T = [dtype](float x) { return in_quanto_dtype(dtype, x); };
  const float n = static_cast<float>((1 << bits) - 1);
  float lo = xs[0], hi = xs[0];
  for (int i = 1; i < group; ++i) lo = std::min(lo, xs[i]), hi = std::max(hi, xs[i]);
  const float s = T(T(hi - lo) / n);
  row.scales.push_back(s);
  row.biases.push_back(lo);
  // Another's float32 rotation may move each element by the window: the range by twice it.
  row.scale_min.push_back(std::max(0.0, static_cast<double>(hi) - lo - 2 * window) / n);
  row.scale_max.push_back((static_cast<double>(hi) - lo + 2 * window) / n);
  row.scale_near_boundary.push_back(window > 0.0);
  row.lows.push_back(lo);
  row.windows.push_back(window);
  row.spans.push_back(static_cast<double>(hi) - lo);
  row.values.insert(row.values.end(), xs, xs + group);
  for (int i = 0; i < group; ++i) {
    const float y = s != 0.0f ? T(T(xs[i] - lo) / s) : 0.0f;
    row.codes[static_cast<std::size_t>(g0 + i)] = static_cast<int>(std::clamp(std::nearbyint(y), 0.0f, n));
    // x and the bias each move by the window: x - min by twice it.
    row.near_boundary[static_cast<std::size_t>(g0 + i)] = s != 0.0f && near_half_integer(y, 2 * window / s);
  }
}

}  // namespace

QuantizedRow quantize(const TensorQuant& quant, const float* x, int n, int kv_head, double window_relative) {
  if (quant.scale.granularity == ScaleGranularity::channel)
    throw std::logic_error("quantize: scales along the token axis quantize rows together (quantize_along_tokens)");
  const int group = scale_group(quant, n);
  if (group <= 0 || n % group != 0) throw std::invalid_argument("quantize: the row is not a whole number of groups");
  QuantizedRow row;
  row.codes.resize(static_cast<std::size_t>(n));
  row.near_boundary.assign(static_cast<std::size_t>(n), false);
  const QuantFormat f = quant.format;
  for (int g0 = 0; g0 < n; g0 += group) {
    const float* xs = x + g0;
    const double window = window_relative * largest_magnitude(x, n);
    auto mark = [&](int i, double y, double s) {
      row.near_boundary[static_cast<std::size_t>(g0 + i)] = s != 0.0 && near_half_integer(y, window / s);
    };
    if (f == QuantFormat::q8_0) {
      // ggml quantize_row_q8_0_ref: d = amax / 127 and id = 1 / d in float32; codes roundf(x * id).
      const float d = static_cast<float>(largest_magnitude(xs, group)) / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      row.scales.push_back(round_to_float16(d));
      // The block's largest element may be off by the window in another's float32 arithmetic
      // (a Hadamard row's small elements most of all): d within its scales.
      const double amax = largest_magnitude(xs, group);
      row.scale_min.push_back(round_to_float16(static_cast<float>(std::max(0.0, amax - window) / 127.0)));
      row.scale_max.push_back(round_to_float16(static_cast<float>((amax + window) / 127.0)));
      row.scale_near_boundary.push_back(scale_ambiguous(ScaleDtype::float16, d, window_relative) ||
                                        row.scale_min.back() != row.scale_max.back());
      for (int i = 0; i < group; ++i) {
        const float y = times_inverse(xs[i], d, id);
        row.codes[static_cast<std::size_t>(g0 + i)] = saturated(std::round(y), -127, 127);
        mark(i, y, d);
      }
    } else if (f == QuantFormat::q4_0) {
      // ggml quantize_row_q4_0_ref: m the element of largest magnitude, d = m / -8;
      // codes min(15, trunc(x * id + 8.5)).
      float m = 0.0f;
      for (int i = 0; i < group; ++i)
        if (std::abs(xs[i]) > std::abs(m)) m = xs[i];
      const float d = m / -8.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      row.scales.push_back(round_to_float16(d));
      // As q8_0's, with m's sign (a near tie of opposite signs is not allowed for).
      const double far = (std::abs(static_cast<double>(m)) + window) / 8, near = std::max(0.0, std::abs(m) - window) / 8;
      const double a = round_to_float16(static_cast<float>(m > 0 ? -far : far)),
                   b = round_to_float16(static_cast<float>(m > 0 ? -near : near));
      row.scale_min.push_back(std::min(a, b));
      row.scale_max.push_back(std::max(a, b));
      row.scale_near_boundary.push_back(scale_ambiguous(ScaleDtype::float16, d, window_relative) || a != b);
      for (int i = 0; i < group; ++i) {
        const float y = times_inverse(xs[i], d, id) + 8.5f;
        row.codes[static_cast<std::size_t>(g0 + i)] = saturated(std::trunc(y), 0, 15, 8);
        row.near_boundary[static_cast<std::size_t>(g0 + i)] =
            d != 0.0f && std::abs(y - std::round(y)) <= window / std::abs(d);
      }
    } else if (f == QuantFormat::int4 || f == QuantFormat::int2) {
      // Affine: S = (max - min) / (2^b - 1), Z = round(-min / S), c = clamp(round(x / S) + Z).
      // An all-equal group takes its range from zero to its value, so it stays exact.
      double lo = INFINITY, hi = -INFINITY;
      for (int i = 0; i < group; ++i) lo = std::min(lo, static_cast<double>(xs[i])), hi = std::max(hi, static_cast<double>(xs[i]));
      if (lo == hi) lo = std::min(lo, 0.0), hi = std::max(hi, 0.0);
      const int top = (1 << bits_of(f)) - 1;
      const double s = in_dtype(quant.scale.dtype, (hi - lo) / top);
      const int z = s != 0.0 ? static_cast<int>(std::round(-lo / s)) : 0;
      row.scales.push_back(s);
      // Each element may be off by the window in another's float32 arithmetic: the range by
      // twice that, and S with it, amplified by |x| / (max - min) in a narrow group.
      const double s_min = in_dtype(quant.scale.dtype, std::max(0.0, hi - lo - 2 * window) / top),
                   s_max = in_dtype(quant.scale.dtype, (hi - lo + 2 * window) / top);
      row.scale_min.push_back(s_min);
      row.scale_max.push_back(s_max);
      row.lows.push_back(lo);
      row.windows.push_back(window);
      // A zero point -lo / S near a tie may round either way in another's float32 arithmetic.
      row.scale_near_boundary.push_back(
          s_min != s_max || scale_ambiguous(quant.scale.dtype, static_cast<float>((hi - lo) / top), window_relative) ||
          (s != 0.0 && near_half_integer(-lo / s, window / s)));
      row.zeros.push_back(z);
      for (int i = 0; i < group; ++i) {
        const double y = s != 0.0 ? xs[i] / s : 0.0;
        row.codes[static_cast<std::size_t>(g0 + i)] = std::clamp(static_cast<int>(std::round(y)) + z, 0, top);
        mark(i, y, s);
      }
    } else if (f == QuantFormat::mlx_affine) {
      mlx_affine_group(quant.bits, xs, group, window, row, g0);
    } else if (f == QuantFormat::quanto_affine) {
      quanto_affine_group(quant.bits, quant.scale.dtype, xs, group, window, row, g0);
    } else {  // fp8, int8 and the *_even formats: one scale per group, static or from the group's amax
      double s = 0.0;
      const bool computed = quant.scale.rule != ScaleRule::fixed;
      if (!computed) {
        const auto& v = quant.scale.values;
        s = v.size() == 1 ? v[0] : v.at(static_cast<std::size_t>(kv_head));
      } else {
        s = largest_magnitude(xs, group) / code_range(f);
      }
      // A computed scale moves with its group's largest element, which may be off by the
      // window (relative to the row's largest: a small group's scale moves the most).
      const double amax = largest_magnitude(xs, group);
      row.scale_min.push_back(computed ? in_dtype(quant.scale.dtype, std::max(0.0, amax - window) / code_range(f))
                                       : in_dtype(quant.scale.dtype, s));
      row.scale_max.push_back(computed ? in_dtype(quant.scale.dtype, (amax + window) / code_range(f))
                                       : in_dtype(quant.scale.dtype, s));
      row.scale_near_boundary.push_back(
          computed && (scale_ambiguous(quant.scale.dtype, static_cast<float>(s), window_relative) ||
                       row.scale_min.back() != row.scale_max.back()));
      s = in_dtype(quant.scale.dtype, s);
      row.scales.push_back(s);
      for (int i = 0; i < group; ++i) {
        const double y = s != 0.0 ? xs[i] / s : 0.0;
        int& c = row.codes[static_cast<std::size_t>(g0 + i)];
        if (f == QuantFormat::int8) {
          c = saturated(std::round(y), -127, 127);
          mark(i, y, s);
        } else if (f == QuantFormat::int8_even || f == QuantFormat::int4_even) {
          const int top = f == QuantFormat::int8_even ? 127 : 7;
          c = saturated(std::nearbyint(y), -top - 1, top);  // the default rounding mode: ties to even
          mark(i, y, s);
        } else {
          c = fp8_code(f, y);
          // Near the midpoint between c's value and a neighbour's.
          const double v = fp8_value(f, c);
          for (int other : {c - 1, c + 1}) {
            if ((other & 0x7F) > (f == QuantFormat::fp8_e4m3 ? 0x7E : 0x7B) || other < 0 || other > 255) continue;
            if ((other ^ c) & 0x80) continue;
            const double mid = (v + fp8_value(f, other)) / 2;
            if (s != 0.0 && std::abs(y - mid) <= window / s) row.near_boundary[static_cast<std::size_t>(g0 + i)] = true;
          }
        }
      }
    }
  }
  return row;
}

std::vector<QuantizedRow> quantize_along_tokens(const TensorQuant& quant, const std::vector<const float*>& rows, int d,
                                                double window) {
  const int n = static_cast<int>(rows.size());
  const int run = quant.scale.group > 0 ? quant.scale.group : std::max(n, 1);
  TensorQuant column_format = quant;  // one channel of a run, quantized as a row
  column_format.scale.granularity = ScaleGranularity::token;
  column_format.scale.group = 0;
  std::vector<QuantizedRow> out(static_cast<std::size_t>(n));
  for (QuantizedRow& row : out) {
    row.codes.resize(static_cast<std::size_t>(d));
    row.scales.resize(static_cast<std::size_t>(d));
    row.near_boundary.resize(static_cast<std::size_t>(d));
    row.scale_near_boundary.resize(static_cast<std::size_t>(d));
    row.scale_min.resize(static_cast<std::size_t>(d));
    row.scale_max.resize(static_cast<std::size_t>(d));
    if (quant.format == QuantFormat::int4 || quant.format == QuantFormat::int2) {
      row.zeros.resize(static_cast<std::size_t>(d));
      row.lows.resize(static_cast<std::size_t>(d));
      row.windows.resize(static_cast<std::size_t>(d));
    }
  }
  std::vector<float> column;
  for (int t0 = 0; t0 < n; t0 += run) {
    const int length = std::min(run, n - t0);
    column.resize(static_cast<std::size_t>(length));
    // An element may be off by the window of its own token's row (a rotation mixes a row's
    // elements), not of its channel: the run's absolute window is its rows' largest.
    double row_largest = 0.0;
    for (int t = 0; t < length; ++t)
      row_largest = std::max(row_largest, largest_magnitude(rows[static_cast<std::size_t>(t0 + t)], d));
    for (int c = 0; c < d; ++c) {
      for (int t = 0; t < length; ++t) column[static_cast<std::size_t>(t)] = rows[static_cast<std::size_t>(t0 + t)][c];
      // quantize() takes a window relative to what it is given (the column).
      const double column_largest = largest_magnitude(column.data(), length);
      const double relative = column_largest > 0.0 ? window * row_largest / column_largest : window;
      const QuantizedRow q = quantize(column_format, column.data(), length, 0, relative);
      for (int t = 0; t < length; ++t) {
        QuantizedRow& row = out[static_cast<std::size_t>(t0 + t)];
        const auto at = static_cast<std::size_t>(c);
        row.codes[at] = q.codes[static_cast<std::size_t>(t)];
        row.near_boundary[at] = q.near_boundary[static_cast<std::size_t>(t)];
        row.scales[at] = q.scales[0];
        row.scale_near_boundary[at] = q.scale_near_boundary[0];
        if (!q.zeros.empty()) row.zeros[at] = q.zeros[0];
        row.scale_min[at] = q.scale_min[0];
        row.scale_max[at] = q.scale_max[0];
        if (!q.lows.empty()) {
          row.lows[at] = q.lows[0];
          row.windows[at] = q.windows[0];
        }
      }
    }
  }
  return out;
}

void dequantize(const TensorQuant& quant, const QuantizedRow& row, double* out) {
  const int n = static_cast<int>(row.codes.size());
  const int group = scale_group(quant, n);
  for (int i = 0; i < n; ++i) {
    const double s = row.scales[static_cast<std::size_t>(i / group)];
    const int c = row.codes[static_cast<std::size_t>(i)];
    switch (quant.format) {
      case QuantFormat::fp8_e4m3:
      case QuantFormat::fp8_e5m2:
        out[i] = fp8_value(quant.format, c) * s;
        break;
      case QuantFormat::q4_0:
        out[i] = (c - 8) * s;
        break;
      case QuantFormat::int4:
      case QuantFormat::int2:
        out[i] = (c - row.zeros[static_cast<std::size_t>(i / group)]) * s;
        break;
      case QuantFormat::mlx_affine:
        out[i] = c * s + row.biases[static_cast<std::size_t>(i / group)];
        break;
      case QuantFormat::quanto_affine: {  // in the model dtype T, as quanto dequantizes: T(T(c S) + min)
        const auto T = [&](float x) { return in_quanto_dtype(quant.scale.dtype, x); };
        out[i] = T(T(static_cast<float>(c) * static_cast<float>(s)) +
                   static_cast<float>(row.biases[static_cast<std::size_t>(i / group)]));
        break;
      }
      default:
        out[i] = c * s;
    }
  }
}

double quantize_activation_q8_0(const float* x, int n, double* out, double window_relative) {
  double slack = 0.0;
  const double window = window_relative * 127.0;  // in codes: the block's largest element is 127
  for (int g0 = 0; g0 < n; g0 += 32) {
    const float amax = static_cast<float>(largest_magnitude(x + g0, 32));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const float d32 = amax / 127.0f;
    const double d = round_to_float16(d32);
    // The other float16 neighbour of amax / 127, when a slightly different amax rounds to it.
    const double other = round_to_float16(d32 * (d32 > d ? 1.0 + window_relative : 1.0 - window_relative));
    double codes = 0.0;
    for (int i = 0; i < 32; ++i) {
      // 127 / amax overflows for amax below about 2^-120: then x / d32, the rule's own value.
      const float y = std::isinf(id) ? (d32 != 0.0f ? x[g0 + i] / d32 : 0.0f) : x[g0 + i] * id;
      out[g0 + i] = std::nearbyint(y) * d;  // ties to even
      codes += std::nearbyint(y) * std::nearbyint(y);
      if (near_half_integer(y, window)) slack += d * d;
    }
    if (other != d) slack += (other - d) * (other - d) * codes;
  }
  return std::sqrt(slack);
}

void hadamard(double* x, int n) {
  if (n <= 0 || !std::has_single_bit(static_cast<unsigned>(n)))
    throw std::invalid_argument("hadamard: the length must be a power of two");
  std::vector<double> y(static_cast<std::size_t>(n), 0.0);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      y[static_cast<std::size_t>(i)] += (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -x[j] : x[j]);
  const double norm = 1.0 / std::sqrt(static_cast<double>(n));
  for (int i = 0; i < n; ++i) x[i] = y[static_cast<std::size_t>(i)] * norm;
}

}  // namespace kvcheck::reference
