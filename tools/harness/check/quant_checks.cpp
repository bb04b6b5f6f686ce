#include "tools/harness/check/quant_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "reference/attention.h"
#include "reference/quantize.h"
#include "reference/rope.h"
#include "reference/stored_kv.h"
#include "tools/harness/check/recovery.h"

namespace kvcheck {

namespace {

double norm(const float* x, int d) {
  double sum = 0.0;
  for (int i = 0; i < d; ++i) sum += static_cast<double>(x[i]) * x[i];
  return std::sqrt(sum);
}

// The largest per-element error SPEC 9's e(x) allows in a row whose elements are at most
// `a` in magnitude; infinite when a static scale lets the row saturate. Scales computed
// from the values are rounded to their dtype: (1 + 2^-10) covers float16's rounding.
double worst_element_error(const TensorQuant& q, double a, std::string& saturation, const char* tensor) {
  const double r = 1.0 + 0x1p-10, range = reference::code_range(q.format);
  double s = a / range * r;
  if (q.scale.rule == ScaleRule::fixed) {
    const double smallest = *std::min_element(q.scale.values.begin(), q.scale.values.end());
    if (a > range * smallest) {
      saturation = fmt::format("{} values up to {:.4g} may saturate the fixed scale {:.4g} they are stored with "
                               "(range {:.4g})",
                               tensor, a, smallest, range * smallest);
      return std::numeric_limits<double>::infinity();
    }
    s = *std::max_element(q.scale.values.begin(), q.scale.values.end());
  }
  switch (q.format) {
    case QuantFormat::q8_0:
    case QuantFormat::q4_0:
      return reference::element_bound(q.format, a, a / range * r);
    case QuantFormat::int4:
    case QuantFormat::int2:
      return 2.0 * a / range * r;  // S = (max - min) / (2^b - 1) <= 2a / (2^b - 1)
    case QuantFormat::mlx_affine:  // e = 2 |S|, |S| <= (4/3) r, r = (max - min) / n <= 2a / n (SPEC 9.7)
      return 2.0 * (4.0 / 3.0) * 2.0 * a / ((1 << q.bits) - 1) * r;
    case QuantFormat::quanto_affine:  // e = S = (max - min) / n <= 2a / n (SPEC 9.8)
      return 2.0 * a / ((1 << q.bits) - 1) * r;
    default:
      return reference::element_bound(q.format, a, s);
  }
}

// A stored row as the reference's type, to dequantize the cache's codes the same way.
reference::QuantizedRow as_row(const optimized::UnpackedRow& u) {
  reference::QuantizedRow r;
  r.codes = u.codes;
  r.scales.assign(u.scales.begin(), u.scales.end());
  r.zeros = u.zeros;
  r.biases.assign(u.biases.begin(), u.biases.end());
  return r;
}

// Whether two rows store the same thing: codes, scales and (affine) zero points. An affine
// group whose zero point took the other side of a boundary (-min / S on a tie) keeps the
// code of its smallest element (0 either way) while that element dequantizes a whole step
// lower or higher; under scales along the token axis that element is the row's only one in
// the group, so codes and scales alone would call the row the reference's.
bool same_stored(const reference::QuantizedRow& a, const reference::QuantizedRow& b) {
  return a.codes == b.codes && a.scales == b.scales && a.zeros == b.zeros && a.biases == b.biases;
}

}  // namespace

namespace {
double stored_roundoff(const Scenario& s, const std::optional<TensorQuant>& q) {
  if (!q) return unit_roundoff(s.kv_dtype);
  std::string ignored;
  TensorQuant t = *q;
  t.scale.rule = ScaleRule::amax;  // as if a static scale fitted the row
  return worst_element_error(t, 1.0, ignored, "");
}
}  // namespace

double key_roundoff(const Scenario& s, int layer) {
  return stored_roundoff(s, s.quantized() ? s.quant(layer).k : std::nullopt);
}
double value_roundoff(const Scenario& s, int layer) {
  return stored_roundoff(s, s.quantized() ? s.quant(layer).v : std::nullopt);
}

optimized::RowFormat row_format(const TensorQuant& q, QuantTransform transform) {
  using optimized::Codec;
  static const Codec codecs[] = {Codec::fp8_e4m3, Codec::fp8_e5m2, Codec::int8,      Codec::q8_0,     Codec::q4_0,
                                 Codec::int4,     Codec::int2,     Codec::int8_even, Codec::int4_even};
  static_assert(sizeof(codecs) / sizeof(codecs[0]) == static_cast<std::size_t>(QuantFormat::int4_even) + 1);
  static_assert(static_cast<std::size_t>(QuantFormat::mlx_affine) == sizeof(codecs) / sizeof(codecs[0]));
  if (has_biases(q.format))  // SPEC 9.7 and 9.8: the reference's only (stores_biased_groups)
    throw std::logic_error(std::string("row_format: kvcheck's caches have no ") + to_string(q.format) + " codec yet");
  optimized::RowFormat f;
  f.codec = codecs[static_cast<int>(q.format)];
  f.group = q.scale.granularity == ScaleGranularity::group ? q.scale.group : 0;
  f.along_tokens = q.scale.granularity == ScaleGranularity::channel;
  f.token_run = f.along_tokens ? q.scale.group : 0;
  f.scale_half = q.scale.dtype == ScaleDtype::float16;
  // A static scale as the cache holds it: in its dtype (the reference rounds it the same way).
  if (q.scale.rule == ScaleRule::fixed)
    for (double v : q.scale.values)
      f.static_scales.push_back(static_cast<float>(
          q.scale.dtype == ScaleDtype::float16 ? reference::round_to_float16(static_cast<float>(v)) : v));
  f.hadamard = transform == QuantTransform::hadamard;
  f.hadamard_block = q.transform_block;
  if (q.scale.rule == ScaleRule::first_append)
    f.frozen = q.scale.granularity == ScaleGranularity::head ? optimized::RowFormat::Frozen::per_head
                                                             : optimized::RowFormat::Frozen::per_tensor;
  return f;
}

// SPEC 9 keys are quantized under one rope: the parser refuses kv_quant beside a rope per
// layer (SPEC 10.1), so every layer's rope is this one.
static const Rope& quantized_rope(const Scenario& s) {
  if (const Rope* shared = s.shared_rope()) return *shared;
  throw std::logic_error("quantized checks on a scenario whose layers rotate differently");
}

QuantChecks::QuantChecks(const Scenario& s, const InputTable& inputs) : s_(s), inputs_(inputs) {
  const Rope& rope = quantized_rope(s);
  const int D = inputs.head_dim, R = reference::rotary_dim(D, rope);
  const double m = reference::rope_magnitude(rope);
  double v_lo = 0.0, v_hi = 0.0;
  for (std::size_t at = 0; at + D <= inputs.q.size(); at += static_cast<std::size_t>(D))
    q_norm_ = std::max(q_norm_, norm(inputs.q.data() + at, D) * m);
  magnitudes_.resize(inputs.k.size() / static_cast<std::size_t>(D));
  widest_.assign(static_cast<std::size_t>(s.dims.layers) * s.dims.kv_heads, Magnitude{});
  const std::size_t per_layer = static_cast<std::size_t>(inputs.uids) * s.dims.kv_heads;  // rows of one layer
  for (std::size_t at = 0; at + D <= inputs.k.size(); at += static_cast<std::size_t>(D)) {
    const float* k = inputs.k.data() + at;
    const float* v = inputs.v.data() + at;
    Magnitude& here = magnitudes_[at / static_cast<std::size_t>(D)];
    here.key_norm = norm(k, D) * m;
    // A rotated element is at most its pair's norm (times m); the others pass unchanged.
    for (int i = 0; i < R / 2; ++i) {
      const double a = k[reference::pair_first(i, rope.layout)], b = k[reference::pair_second(i, R, rope.layout)];
      here.key_element = std::max(here.key_element, std::sqrt(a * a + b * b) * m);
    }
    for (int i = R; i < D; ++i) here.key_element = std::max(here.key_element, static_cast<double>(std::abs(k[i])));
    here.value_norm = norm(v, D);
    for (int i = 0; i < D; ++i) {
      here.value_element = std::max(here.value_element, static_cast<double>(std::abs(v[i])));
      v_lo = std::min(v_lo, static_cast<double>(v[i]));
      v_hi = std::max(v_hi, static_cast<double>(v[i]));
    }
    k_norm_ = std::max(k_norm_, here.key_norm);
    const std::size_t row = at / static_cast<std::size_t>(D);  // [layer][uid][kv head]
    Magnitude& widest = widest_[row / per_layer * s.dims.kv_heads + row % s.dims.kv_heads];
    widest.key_element = std::max(widest.key_element, here.key_element);
    widest.value_element = std::max(widest.value_element, here.value_element);
  }
  v_range_ = v_hi - v_lo;
}

const QuantChecks::Magnitude& QuantChecks::magnitude(int layer, std::uint64_t uid, int kv_head) const {
  return magnitudes_[static_cast<std::size_t>(inputs_.k_at(layer, uid, kv_head) - inputs_.k.data()) /
                     static_cast<std::size_t>(s_.dims.head_dim)];
}

namespace {

// SPEC 9.2.3's sqrt(sum_d e(x_d)^2) for one store of a row whose elements are at most `a` in
// magnitude and whose 2-norm is at most `n`: fp8's error is relative (plus its subnormal
// floor), the others' a step of the scale in every element. A float (kv_dtype) row rounds
// each element relatively.
double error_norm(const std::optional<TensorQuant>& q, double unit_roundoff, double a, double n, int d,
                  std::string& saturation, const char* tensor) {
  const double root_d = std::sqrt(static_cast<double>(d));
  if (!q) return unit_roundoff * n;
  const double e = worst_element_error(*q, a, saturation, tensor);
  if (!std::isfinite(e)) return e;
  if (q->format != QuantFormat::fp8_e4m3 && q->format != QuantFormat::fp8_e5m2) return root_d * e;
  const double scale = q->scale.rule == ScaleRule::fixed
                           ? *std::max_element(q->scale.values.begin(), q->scale.values.end())
                           : a / reference::code_range(q->format) * (1.0 + 0x1p-10);
  return q->format == QuantFormat::fp8_e4m3 ? n * 0x1p-4 + root_d * scale * 0x1p-10
                                            : n * 0x1p-3 + root_d * scale * 0x1p-17;
}

}  // namespace

namespace {
// The scale a frozen ("first_append") row was stored with; 0 for other rules.
double frozen_scale_of(const reference::QuantizedRow& codes, const std::optional<TensorQuant>& declared) {
  const bool frozen = declared && declared->scale.rule == ScaleRule::first_append;
  return frozen && !codes.scales.empty() ? std::abs(codes.scales[0]) : 0.0;
}

// The format a frozen row was stored in: its scale, given.
std::optional<TensorQuant> with_scale(const std::optional<TensorQuant>& format, double scale) {
  if (!format || scale <= 0.0) return format;
  TensorQuant fixed = *format;
  fixed.scale.rule = ScaleRule::fixed;
  fixed.scale.values = {scale};
  return fixed;
}
}  // namespace

double stored_key_error(const std::optional<TensorQuant>& declared, bool transformed, KvDtype kv_dtype, int head_dim,
                        double element, double norm, int times, std::string& saturation, double scale) {
  const std::optional<TensorQuant> format = with_scale(declared, scale);
  // Each store adds its own error to a row grown by the errors before it; a shift's
  // rotation in float32 rounds once more.
  double total = 0.0;
  for (int t = 0; t < std::max(times, 1); ++t) {
    const double n = norm + total, a = (transformed ? norm : element) + total;
    const double e = error_norm(format, unit_roundoff(kv_dtype), a, n, head_dim, saturation, "key");
    if (!std::isfinite(e)) return e;
    total += e + (t > 0 ? 2.0 * 0x1p-24 * n : 0.0);
  }
  return total;
}

double stored_value_error(const std::optional<TensorQuant>& declared, bool transformed, KvDtype kv_dtype, int head_dim,
                          double element, double norm, int times, std::string& saturation, double scale) {
  const std::optional<TensorQuant> format = with_scale(declared, scale);
  double total = 0.0;
  for (int t = 0; t < std::max(times, 1); ++t) {
    // Under the transform an element's error is at most the error vector's norm.
    const double a = element + total, n = norm + total;
    const double e = transformed ? error_norm(format, 0.0, n, n, head_dim, saturation, "value")
                     : format    ? worst_element_error(*format, a, saturation, "value")
                                 : unit_roundoff(kv_dtype) * a;
    if (!std::isfinite(e)) return e;
    total += e;
  }
  return total;
}

namespace {
bool along_tokens(const std::optional<TensorQuant>& q) { return q && q->scale.granularity == ScaleGranularity::channel; }
}  // namespace

double QuantChecks::key_error(int layer, const Magnitude& m, const Magnitude& widest, int times, double scale) {
  const KvQuant& q = s_.quant(layer);
  return stored_key_error(q.k, q.k && q.transform == QuantTransform::hadamard, s_.kv_dtype, s_.dims.head_dim,
                          along_tokens(q.k) ? widest.key_element : m.key_element, m.key_norm, times, saturation_,
                          scale);
}

double QuantChecks::value_error(int layer, const Magnitude& m, const Magnitude& widest, int times, double scale) {
  const KvQuant& q = s_.quant(layer);
  return stored_value_error(q.v, q.v && q.transform == QuantTransform::hadamard, s_.kv_dtype, s_.dims.head_dim,
                            along_tokens(q.v) ? widest.value_element : m.value_element, m.value_norm, times,
                            saturation_, scale);
}

void QuantChecks::follow_rows(const Step& step) {
  if (step.op == StepOp::reset)
    held_.clear(), held_values_.clear(), precision_seen_.clear(), times_stored_.clear(), reference_key_codes_.clear();
  if (step.op != StepOp::reorder) return;
  // New row b holds old row rows[b]'s keys and values.
  const auto move = [&](auto& map) {
    std::remove_reference_t<decltype(map)> moved;
    for (std::size_t b = 0; b < step.rows.size(); ++b)
      for (const auto& [id, held] : map)
        if (std::get<1>(id) == step.rows[b])
          moved[{std::get<0>(id), static_cast<int>(b), std::get<2>(id), std::get<3>(id)}] = held;
    map = std::move(moved);
  };
  move(held_);
  move(reference_key_codes_);
  move(held_values_);
  move(precision_seen_);
  move(times_stored_);
}

// The positions the step's queries saw a key at, in order, ending at where it is kept: its
// write (a new key) and every shift since, as the reference moved it.
std::vector<std::int64_t> QuantChecks::positions_seen(const StepRecord& rec, std::size_t l, std::size_t b,
                                                      const reference::RetainedKey& key) const {
  std::vector<std::int64_t> path;
  if (rec.append)
    for (const auto& token : rec.append->rows[b])
      for (const reference::VisibleKey& seen : token.view_in(static_cast<int>(l)).keys)
        if (seen.index == key.index && (path.empty() || path.back() != seen.position)) path.push_back(seen.position);
  if (path.empty() || path.back() != key.position) path.push_back(key.position);
  return path;
}

namespace {
bool affine(const TensorQuant& format) {
  return format.format == QuantFormat::int4 || format.format == QuantFormat::int2;
}

// Scales stored as float16: declared so, or ggml's q8_0 and q4_0 d.
bool scale_is_float16(const TensorQuant& format) {
  return format.scale.dtype == ScaleDtype::float16 || format.format == QuantFormat::q8_0 ||
         format.format == QuantFormat::q4_0;
}

// How far (relative) a computed scale may sit from the reference's when another amax a few
// ulps away rounds to the neighbouring value of its dtype: a float16 ulp, or a float32 one.
double neighbouring_scale_move(const TensorQuant& format) {
  return scale_is_float16(format) ? 0x1p-10 : 0x1p-19;
}

// SPEC 9.2.1 for a row a cache wrote and dropped within one step, whose codes no view shows:
// how far (2-norm) what its codes stand for may be from the reference's when the cache's
// float32 arithmetic moved each element of `held` (the float32 row as quantized) by at most
// the boundary window w, and it took any code and scale 9.2.1 accepts. Per element:
//  - where its code (or its group's affine zero point) may move, both are the format's
//    roundings of values at most w apart: at most e(x, s) + e(x', s') + w apart (SPEC 9's e);
//  - where only its group's scale may move, to s' among those stored_scale_accepted takes,
//    the code stands for c s': |x_hat| |s' - s| / s from the reference's;
//  - elsewhere nothing moves.
// A code may move where x / s lies within w / s' + |x / s| |s / s' - 1| of a rounding
// boundary: the reference's own marking (quantize) with that window.
double unseen_row_deviation(const TensorQuant& format, const std::vector<float>& held, int kv_head,
                            double window_relative) {
  const int d = static_cast<int>(held.size());
  const reference::QuantizedRow r = reference::quantize(format, held.data(), d, kv_head, window_relative);
  std::vector<double> x_hat(held.size());
  reference::dequantize(format, r, x_hat.data());
  const int group = std::max(1, reference::scale_group(format, d));
  double largest = 0.0;
  for (const float x : held) largest = std::max(largest, std::abs(static_cast<double>(x)));
  const double w = window_relative * largest;
  double sum = 0.0;
  for (int g0 = 0; g0 < d; g0 += group) {
    const auto at = static_cast<std::size_t>(g0 / group);
    const double s = std::abs(r.scales.at(at));
    if (has_biases(format.format)) {
      // SPEC 9.7: any code may move with q0, the bias and the orientation; each side is within
      // 2 |S| of its element, the cache's |S| at most (4/3) (range + 2w) / n. SPEC 9.8: within
      // S of it, the cache's S at most (range + 2w) / n.
      const double s_moved = (format.format == QuantFormat::mlx_affine ? 4.0 / 3.0 : 1.0) * (r.spans.at(at) + 2 * w) /
                             ((1 << format.bits) - 1);
      const double delta = reference::element_bound(format.format, 0.0, s) +
                           reference::element_bound(format.format, 0.0, s_moved) + w;
      sum += group * delta * delta;
      continue;
    }
    // The scales stored_scale_accepted takes for the group: its own; where flagged, any in
    // [scale_min, scale_max], and (not affine) a neighbouring value of the dtype.
    const bool scale_moves = at < r.scale_near_boundary.size() && r.scale_near_boundary[at];
    double lo = s, hi = s;
    if (scale_moves) {
      if (at < r.scale_min.size()) {
        const double a = std::abs(r.scale_min[at]), b = std::abs(r.scale_max[at]);
        lo = std::min({lo, a, b}), hi = std::max({hi, a, b});
      }
      if (!affine(format)) {
        const double neighbour = neighbouring_scale_move(format) * s;
        lo = std::min(lo, s - neighbour), hi = std::max(hi, s + neighbour);
      }
    }
    // An affine zero point round(-min' / S') over min' within the window and S' as above
    // (stored_zero_accepted); monotone in both, so the corners decide.
    bool zero_moves = false;
    if (scale_moves && affine(format) && at < r.lows.size() && lo > 0.0)
      for (const double scale : {lo, hi})
        for (const double low : {r.lows[at] - r.windows[at], r.lows[at] + r.windows[at]})
          zero_moves = zero_moves || std::round(-low / scale) != r.zeros.at(at);
    // The codes of a group whose scale moves that may move with it: x / s' is within
    // w / s' + |x / s| |s / s' - 1| of x / s. q8_0 and q4_0 take their codes from the float32
    // d = amax / range (rule 1), which moves only with amax, by w: x / d' is within
    // 2 w amax / (amax - w) / d of x / d.
    std::vector<bool> wide;
    if (scale_moves && !zero_moves && lo > 0.0) {
      double amax = 0.0;
      for (int i = g0; i < g0 + group; ++i)
        amax = std::max(amax, std::abs(static_cast<double>(held[static_cast<std::size_t>(i)])));
      const bool ggml = format.format == QuantFormat::q8_0 || format.format == QuantFormat::q4_0;
      double window = INFINITY;
      if (!ggml)
        window = s * w / lo + amax * std::max((s - lo) / lo, (hi - s) / hi);
      else if (amax > w)
        window = 2.0 * w * amax / (amax - w);
      if (!std::isfinite(window))
        wide.assign(static_cast<std::size_t>(group), true);
      else if (amax > 0.0)
        wide = reference::quantize(format, held.data() + g0, group, kv_head, window / amax).near_boundary;
    }
    for (int i = g0; i < g0 + group; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const bool code_moves = zero_moves || (k < r.near_boundary.size() && r.near_boundary[k]) ||
                              (static_cast<std::size_t>(i - g0) < wide.size() && wide[static_cast<std::size_t>(i - g0)]);
      const double x = std::abs(static_cast<double>(held[k]));
      const double delta = code_moves ? reference::element_bound(format.format, x, s) +
                                            reference::element_bound(format.format, x + w, hi) + w
                           : s > 0.0  ? std::abs(x_hat[k]) * std::max(hi - s, s - lo) / s
                                      : 0.0;
      sum += delta * delta;
    }
  }
  return std::sqrt(sum);
}
}  // namespace

bool stored_scale_accepted(const TensorQuant& format, const reference::QuantizedRow& expected, std::size_t g,
                           double actual) {
  const double e = expected.scales.at(g);
  if (e == actual) return true;
  const bool ambiguous = g < expected.scale_near_boundary.size() && expected.scale_near_boundary[g];
  const bool half = scale_is_float16(format);
  if (g < expected.scale_min.size()) {
    // A scale moves with the elements it comes from (S = amax / range, or (max - min) / top),
    // each off by at most the window: a small group's relative move is large. Any value of
    // the scale dtype the reference's range gives is one a cache's arithmetic may compute.
    const double representable =
        half ? reference::round_to_float16(actual) : static_cast<double>(static_cast<float>(actual));
    if (ambiguous && representable == actual && expected.scale_min[g] <= actual && actual <= expected.scale_max[g])
      return true;
    if (affine(format)) return false;
  }
  // A neighbouring value of the dtype: another amax a few ulps away rounds to it.
  return ambiguous && std::abs(e - actual) <= neighbouring_scale_move(format) * std::abs(e);
}

namespace {
// A group the reference gave no windows: the cache's bias and scale must be its own.
BiasedGroupVerdict exactly(const reference::QuantizedRow& expected, std::size_t g, double scale, double bias) {
  return {expected.biases.at(g) == bias, expected.scales.at(g) == scale};
}
}  // namespace

BiasedGroupVerdict mlx_group_accepted(const reference::QuantizedRow& expected, std::size_t g, int bits, double scale,
                                      double bias) {
  if (g >= expected.lows.size()) return exactly(expected, g, scale, bias);  // no windows
  BiasedGroupVerdict v;
  const double n = (1 << bits) - 1, w = expected.windows[g], span = expected.spans[g];
  // The group's extremes, from the reference's orientation (a positive scale: lo is the edge).
  const bool low = expected.scales[g] > 0.0;
  const double lo = low ? expected.lows[g] : expected.lows[g] - span, hi = low ? expected.lows[g] + span : expected.lows[g];
  const bool near_tie = g < expected.other_edges.size() && !std::isnan(expected.other_edges[g]);
  // The range moves by at most twice the window, r = max(range / n, 1e-7) with it.
  const double r_lo = std::max((span - 2 * w) / n, 1e-7), r_hi = std::max((span + 2 * w) / n, 1e-7);
  for (const bool low_edge : {true, false}) {
    if (low_edge != low && !near_tie) continue;  // only a near tie takes the other orientation
    const double e0 = low_edge ? lo : hi, sign = low_edge ? 1.0 : -1.0;
    // The integers q0 = rint(e' / (sign r')) reaches over e' within w of e0 (the quotient in
    // float32: a relative 2^-22 more either way).
    double q_min = INFINITY, q_max = -INFINITY;
    for (const double e : {e0 - w, e0 + w})
      for (const double r : {r_lo, r_hi}) q_min = std::min(q_min, e / (sign * r)), q_max = std::max(q_max, e / (sign * r));
    q_min = std::nearbyint(q_min - std::abs(q_min) * 0x1p-22), q_max = std::nearbyint(q_max + std::abs(q_max) * 0x1p-22);
    if (bias == 0.0 && q_min <= 0.0 && 0.0 <= q_max) {  // q0 = 0: the scale stays sign r'
      v.bias = true;
      const double a = scale * sign;
      v.scale = v.scale || (a >= r_lo * (1 - 0x1p-22) && a <= r_hi * (1 + 0x1p-22));
      continue;
    }
    if (std::abs(bias - e0) > w) continue;  // the bias is this orientation's edge, moved
    v.bias = true;
    // The scale is the stored bias over an integer q0 in reach, divided in float32 as MLX does.
    const double q = std::nearbyint(bias / scale);
    v.scale = v.scale || (q != 0.0 && q_min <= q && q <= q_max &&
                          static_cast<float>(bias) / static_cast<float>(q) == static_cast<float>(scale));
  }
  return v;
}

BiasedGroupVerdict quanto_group_accepted(const reference::QuantizedRow& expected, std::size_t g, int bits,
                                         ScaleDtype dtype, double scale, double bias) {
  if (g >= expected.lows.size()) return exactly(expected, g, scale, bias);  // no windows
  BiasedGroupVerdict v;
  const double n = (1 << bits) - 1, w = expected.windows[g], span = expected.spans[g];
  v.bias = std::abs(bias - expected.lows[g]) <= w;
  // (max' - min') / n in the model dtype, each within w of the reference's: a relative 2^-22
  // more for float32's two roundings, 2^-10 for float16's.
  const double rounding = dtype == ScaleDtype::float16 ? 0x1p-10 : 0x1p-22;
  v.scale = scale >= std::max(0.0, span - 2 * w) / n * (1 - rounding) && scale <= (span + 2 * w) / n * (1 + rounding);
  return v;
}

bool stored_zero_accepted(const TensorQuant& format, const reference::QuantizedRow& expected, std::size_t g,
                          double actual_scale, int actual_zero, bool scale_moved) {
  const int e = expected.zeros.at(g);
  if (e == actual_zero) return true;
  if (affine(format) && g < expected.lows.size()) {
    // The reference's rule over the stored scale: Z = round(-min / S), halves away from zero
    // (std::round), not clamped; min anywhere within the window.
    if (!(actual_scale > 0.0)) return false;
    const double lo = expected.lows[g], w = expected.windows[g];
    return std::round(-(lo + w) / actual_scale) <= actual_zero && actual_zero <= std::round(-(lo - w) / actual_scale);
  }
  const bool ambiguous = g < expected.scale_near_boundary.size() && expected.scale_near_boundary[g];
  return (scale_moved || ambiguous) && std::abs(e - actual_zero) <= 1;
}

std::optional<reference::QuantizedRow> codes_through_write_boundary(const TensorQuant& format, QuantTransform transform,
                                                                    const Rope& rope, const float* raw, int head_dim,
                                                                    int kv_head, const std::vector<std::int64_t>& path,
                                                                    const reference::QuantizedRow& stored) {
  if (path.empty()) return std::nullopt;
  const reference::QuantizedRow written =
      reference::quantize_key_at(format, transform, rope, raw, head_dim, kv_head, path.front());
  int tried = 0;
  for (std::size_t i = 0; i < written.codes.size() && tried < 16; ++i) {
    if (i >= written.near_boundary.size() || !written.near_boundary[i]) continue;
    ++tried;
    for (const int step : {1, -1}) {
      reference::QuantizedRow codes = written;
      codes.codes[i] += step;
      for (std::size_t k = 1; k < path.size(); ++k)
        codes = reference::requantize_shifted(format, transform, rope, codes, kv_head, path[k - 1], path[k]);
      if (same_stored(codes, stored)) return codes;
    }
  }
  return std::nullopt;
}

std::optional<reference::QuantizedRow> QuantChecks::through_write_boundary(int l, int g, std::uint64_t uid,
                                                                           const std::vector<std::int64_t>& path,
                                                                           const optimized::UnpackedRow& stored) const {
  const KvQuant& q = s_.quant(l);
  return codes_through_write_boundary(*q.k, q.transform, quantized_rope(s_), inputs_.k_at(l, uid, g), s_.dims.head_dim, g, path,
                                      as_row(stored));
}

reference::QuantizedRow QuantChecks::requantized(const TensorQuant& format, reference::QuantizedRow codes, int kv_head,
                                                 std::int64_t position, int times) const {
  // A flush re-quantizes what the codes stand for: dequantize, turn by nothing, quantize.
  for (int k = 0; k < times; ++k)
    codes = reference::requantize_shifted(format, s_.quant_rules().transform, quantized_rope(s_), codes, kv_head, position, position);
  return codes;
}

std::map<std::uint64_t, reference::QuantizedRow> QuantChecks::requantized_together(const TensorQuant& format,
                                                                                   bool value, const StepRecord& rec,
                                                                                   int l, int b, int g) const {
  std::map<std::uint64_t, reference::QuantizedRow> out;
  if (format.scale.granularity != ScaleGranularity::channel) return out;
  const auto& tokens = rec.stored[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
  const auto& retained = rec.retained_in(l, b).keys;
  // The codes this cache held for a token before it was quantized again, when not the reference's.
  const auto held_off = [&](std::uint64_t uid, int flushes) -> const reference::QuantizedRow* {
    const HeldId id{l, b, static_cast<std::int64_t>(uid), g};
    if (value) {
      const auto found = held_values_.find(id);
      return found != held_values_.end() && found->second.flushes != flushes ? &found->second.codes : nullptr;
    }
    const auto found = held_.find(id);
    return found != held_.end() && !found->second.as_reference && found->second.flushes != flushes
               ? &found->second.codes
               : nullptr;
  };
  std::map<std::int64_t, std::vector<std::size_t>> members;  // quantized_with -> token indices, oldest first
  std::set<std::int64_t> redo;
  for (std::size_t i = 0; i < retained.size() && i < tokens.size(); ++i) {
    const reference::StoredLayer& t = tokens[i];
    if (t.raw || t.quantized_with < 0) continue;
    members[t.quantized_with].push_back(i);
    if (held_off(retained[i].uid, t.flushes)) redo.insert(t.quantized_with);
  }
  for (const std::int64_t batch : redo) {
    std::vector<std::vector<double>> rows;
    std::int64_t furthest = 0;
    for (const std::size_t i : members[batch]) {
      const reference::StoredLayer& t = tokens[i];
      if (const reference::QuantizedRow* held = held_off(retained[i].uid, t.flushes)) {
        rows.emplace_back(held->codes.size());
        reference::dequantize_stored(format, s_.quant_rules().transform, *held, rows.back().data());
      } else {
        const reference::StoredHead& from = t.quantized_from.at(static_cast<std::size_t>(g));
        rows.push_back(value ? from.value : from.key);
      }
      if (!value) furthest = std::max(furthest, t.position);
    }
    const std::vector<reference::QuantizedRow> codes =
        reference::quantize_rows_together(format, s_.quant_rules().transform, rows, furthest);
    for (std::size_t k = 0; k < codes.size(); ++k) out[retained[members[batch][k]].uid] = codes[k];
  }
  return out;
}

void QuantChecks::check_codes(const StepRecord& rec, const CacheView& view, StepEvidence& evidence) {
  follow_rows(rec.step);
  diverged_.clear();
  flushed_after_reads_.clear();
  const bool raw_reads = s_.quant_rules().chunk_reads == ChunkReads::raw && rec.append;
  if (rec.stored.empty()) return;
  for (std::size_t l = 0; l < rec.stored.size(); ++l)
    for (std::size_t b = 0; b < rec.stored[l].size(); ++b) {
      const auto& kept = rec.retained_in(static_cast<int>(l), static_cast<int>(b)).keys;
      for (std::size_t k = 0; k < kept.size() && k < rec.stored[l][b].size(); ++k) {
        const reference::StoredLayer& now = rec.stored[l][b][k];
        for (std::size_t g = 0; g < now.heads.size(); ++g)
          times_stored_[{static_cast<int>(l), static_cast<int>(b), static_cast<std::int64_t>(kept[k].uid),
                         static_cast<int>(g)}] = {
              1 + now.shifts + now.flushes, 1 + now.flushes, kept[k].position,
              frozen_scale_of(now.heads[g].key_codes, s_.quant(static_cast<int>(l)).k),
              frozen_scale_of(now.heads[g].value_codes, s_.quant(static_cast<int>(l)).v)};
      }
    }
  // Keys and values this cache holds with codes not the reference's, which the step's queries
  // saw and the step then evicted: their outputs were over the held codes. A token the step
  // wrote and evicted shows its codes in no view: its queries' outputs may be over any codes
  // 9.2.1 accepts for it, as far as unseen_row_deviation says (a key whose queries saw it at
  // one position; nothing held raw, no frozen scale).
  std::set<HeldId> shown_stores;  // keys whose every store this append the view shows
  for (const KeyStore& k : view.key_stores) shown_stores.insert({k.layer, k.row, k.uid, k.kv_head});
  if (rec.append)
    for (std::size_t l = 0; l < rec.stored.size(); ++l)
      for (std::size_t b = 0; b < rec.append->rows.size(); ++b) {
        const KvQuant& rules = s_.quant(static_cast<int>(l));
        std::set<std::uint64_t> kept, written;
        std::map<std::uint64_t, std::set<std::int64_t>> seen;  // uid -> where the queries saw its key
        for (const auto& key : rec.retained_in(static_cast<int>(l), static_cast<int>(b)).keys) kept.insert(key.uid);
        const auto& history = rec.histories[b];
        for (const auto& token : rec.append->rows[b]) {
          written.insert(token.uid);
          for (const reference::VisibleKey& key : token.view_in(static_cast<int>(l)).keys)
            seen[history[static_cast<std::size_t>(key.index)]].insert(key.position);
        }
        const int d = s_.dims.head_dim;
        const auto computed = [](const std::optional<TensorQuant>& t) {
          return t && t->scale.rule != ScaleRule::first_append;
        };
        // Unseen rows together: an output is a weighted mean of values (weights summing to at
        // most 1), so it moves by at most the largest value deviation; and every score by at
        // most scale |q| times the largest key deviation.
        double moved = 0.0, unseen_value = 0.0, unseen_key = 0.0;
        for (const auto& [uid, positions] : seen) {
          if (kept.count(uid)) continue;
          for (int g = 0; g < s_.dims.kv_heads; ++g) {
            const HeldId id{static_cast<int>(l), static_cast<int>(b), static_cast<std::int64_t>(uid), g};
            const auto held = held_.find(id);
            if (held != held_.end() && !held->second.as_reference) moved += held->second.weight;
            const auto held_value = held_values_.find(id);
            if (held_value != held_values_.end()) moved += held_value->second.weight;
            if (!written.count(uid) || rules.holds_raw()) continue;
            if (computed(rules.v)) {
              const float* v = inputs_.v_at(static_cast<int>(l), uid, g);
              unseen_value = std::max(
                  unseen_value, unseen_row_deviation(*rules.v,
                                                     reference::held_row(*rules.v, rules.transform,
                                                                         std::vector<double>(v, v + d)),
                                                     g, reference::boundary_window(0)));
            }
            if (computed(rules.k) && positions.size() == 1 && !shown_stores.count(id)) {
              const float* k = inputs_.k_at(static_cast<int>(l), uid, g);
              const std::int64_t position = *positions.begin();
              const std::vector<double> rotated =
                  reference::rotate(std::vector<double>(k, k + d), static_cast<double>(position), quantized_rope(s_));
              unseen_key = std::max(unseen_key, unseen_row_deviation(*rules.k, reference::held_row(*rules.k, rules.transform, rotated),
                                                                     g, reference::boundary_window(position)));
            }
          }
        }
        moved += unseen_value + std::expm1(2.0 * s_.softmax_scale() * q_norm_ * unseen_key) * v_range_ / 2.0;
        if (moved > 0.0) diverged_[{static_cast<int>(l), static_cast<int>(b)}] += moved;
      }
  const QuantTransform transform = s_.quant_rules().transform;  // every layer's
  const int D = s_.dims.head_dim;
  std::vector<double> want(static_cast<std::size_t>(D)), got(static_cast<std::size_t>(D));
  // Under frozen scales, the row's own (its newest token's, which it always computes).
  double readers_key_scale = 0.0, readers_value_scale = 0.0;
  // One stored row against the one expected: true when accepted (exactly, or a code off by
  // one at a rounding boundary, or a computed scale off by its dtype's last bit).
  const auto compare = [&](const TensorQuant& format, const reference::QuantizedRow& expected,
                           const optimized::UnpackedRow& actual, CodeMismatch where, bool value) {
    where.value = value;
    bool ok = true;
    // element: the code's; -1 a group's scale, -2 its zero point.
    const auto fail = [&](int element, int group, double e, double a) {
      ok = false;
      where.element = element;
      where.group = group;
      // A frozen scale that is not the token's writer's but the reading row's own.
      const double own = value ? readers_value_scale : readers_key_scale;
      where.readers_scale = element < 0 && own > 0.0 && std::abs(a) == own && std::abs(e) != own;
      where.expected = e;
      where.actual = a;
      if (codes_.failures++ == 0)
        codes_.first = fmt::format(
            "{}: layer {} row {} uid {} kv head {}: {} {} {}: expected {}, stored {}", evidence.label, where.layer,
            where.row, where.uid, where.kv_head, value ? "value" : "key",
            element >= 0 ? "element"
            : format.scale.granularity == ScaleGranularity::channel
                ? (element == -2 ? "zero point of channel" : "scale of channel")
                : (element == -2 ? "zero point of group" : element == -3 ? "bias of group" : "scale of group"),
            element < 0 ? group : element, e, a);
      if (evidence.codes.size() < 64) evidence.codes.push_back(where);
    };
    if (actual.codes.size() != expected.codes.size() || actual.scales.size() != expected.scales.size() ||
        actual.zeros.size() != expected.zeros.size() || actual.biases.size() != expected.biases.size()) {
      if (codes_.failures++ == 0)
        codes_.first = fmt::format("{}: layer {} row {} uid {} kv head {}: {} stored as {} codes, {} scales and {} zero "
                                   "points, expected {}, {} and {}",
                                   evidence.label, where.layer, where.row, where.uid, where.kv_head,
                                   value ? "value" : "key", actual.codes.size(), actual.scales.size(),
                                   actual.zeros.size(), expected.codes.size(), expected.scales.size(),
                                   expected.zeros.size());
      where.element = -1;
      if (evidence.codes.size() < 64) evidence.codes.push_back(where);
      return false;
    }
    // SPEC 9.7: each group's bias and scale as MLX's rule gives them for elements moved by at
    // most the window, and every code the rule's under the cache's own bias and scale.
    if (has_biases(format.format)) {  // SPEC 9.7, 9.8
      const bool mlx = format.format == QuantFormat::mlx_affine;
      const int group = reference::scale_group(format, D), top = (1 << format.bits) - 1;
      for (std::size_t g = 0; g < expected.scales.size(); ++g) {
        const BiasedGroupVerdict v = mlx ? mlx_group_accepted(expected, g, format.bits, actual.scales[g], actual.biases[g])
                                         : quanto_group_accepted(expected, g, format.bits, format.scale.dtype,
                                                                 actual.scales[g], actual.biases[g]);
        if (!v.bias) fail(-3, static_cast<int>(g), expected.biases[g], actual.biases[g]);
        if (v.bias && !v.scale) fail(-1, static_cast<int>(g), expected.scales[g], actual.scales[g]);
        if (!v.bias || !v.scale) continue;
        for (int i = 0; i < group; ++i) {
          const std::size_t at = g * static_cast<std::size_t>(group) + static_cast<std::size_t>(i);
          ++codes_checked_;
          const int a = actual.codes[at];
          if (expected.values.empty()) {  // a row the cache held before: kept, so unchanged, exactly
            if (a != expected.codes[at]) fail(static_cast<int>(at), static_cast<int>(g), expected.codes[at], a);
            continue;
          }
          // The rule's code under the cache's own scale and bias (quanto's S = 0: code 0).
          float y = 0.0f;
          if (actual.scales[g] != 0.0 && mlx) {
            y = static_cast<float>((expected.values[at] - actual.biases[g]) / actual.scales[g]);
          } else if (actual.scales[g] != 0.0) {  // quanto: each step in the model dtype
            const auto T = [&](float x) {
              return format.scale.dtype == ScaleDtype::float16 ? static_cast<float>(reference::round_to_float16(x)) : x;
            };
            y = T(T(expected.values[at] - static_cast<float>(actual.biases[g])) / static_cast<float>(actual.scales[g]));
          }
          const int c = std::isnan(y) ? 0 : static_cast<int>(std::clamp(std::nearbyint(y), 0.0f, static_cast<float>(top)));
          if (a == c && a == expected.codes[at]) continue;
          if (a == c) {
            ++codes_on_boundary_;  // the rule's code under the cache's own scale and bias
            continue;
          }
          // The element moves by the window; quanto's x - min by twice it (the min moves too).
          const double slack = ((mlx ? 1 : 2) * expected.windows[g] + std::abs(expected.values[at]) * 0x1p-22) /
                               std::abs(actual.scales[g]);
          if (a >= 0 && a <= top && std::abs(a - c) == 1 && std::abs(std::abs(y - std::floor(y)) - 0.5) <= slack) {
            ++codes_on_boundary_;
            continue;
          }
          fail(static_cast<int>(at), static_cast<int>(g), c, a);
        }
      }
      return ok;
    }
    // A computed scale (and an affine zero point) may move only where the reference found it
    // near a rounding boundary, as far as stored_scale_accepted and stored_zero_accepted allow;
    // the codes of that group may then differ by one.
    const int group = std::max(1, reference::scale_group(format, D));
    std::vector<bool> scale_moved(expected.scales.size(), false);
    for (std::size_t g = 0; g < expected.scales.size(); ++g) {
      const double e = expected.scales[g], a = actual.scales[g];
      if (e == a) continue;
      scale_moved[g] = true;
      if (!stored_scale_accepted(format, expected, g, a)) fail(-1, static_cast<int>(g), e, a);
    }
    for (std::size_t g = 0; g < expected.zeros.size(); ++g) {
      if (expected.zeros[g] == actual.zeros[g]) continue;
      if (!stored_zero_accepted(format, expected, g, actual.scales[g], actual.zeros[g], scale_moved[g]))
        fail(-2, static_cast<int>(g), expected.zeros[g], actual.zeros[g]);
      scale_moved[g] = true;  // its codes move with it
    }
    for (std::size_t i = 0; i < expected.codes.size(); ++i) {
      ++codes_checked_;
      const int e = expected.codes[i], a = actual.codes[i];
      if (e == a) continue;
      const bool neighbour = std::abs(e - a) == 1 && ((e ^ a) & 0x80) == 0;
      const bool near = i < expected.near_boundary.size() && expected.near_boundary[i];
      if (neighbour && (near || scale_moved[i / static_cast<std::size_t>(group)])) {
        ++codes_on_boundary_;
        continue;
      }
      fail(static_cast<int>(i), static_cast<int>(i) / group, e, a);
    }
    return ok;
  };
  // How far outputs may move when a row's accepted codes are not the reference's.
  const auto weigh = [&](const TensorQuant& format, const reference::QuantizedRow& reference_codes,
                         const optimized::UnpackedRow& actual, bool value) {
    reference::dequantize(format, reference_codes, want.data());
    reference::dequantize(format, as_row(actual), got.data());
    double diff = 0.0;
    for (int i = 0; i < D; ++i) diff += (want[i] - got[i]) * (want[i] - got[i]);
    diff = std::sqrt(diff);
    return value ? diff : std::expm1(2.0 * s_.softmax_scale() * q_norm_ * diff) * v_range_ / 2.0;
  };

  // SPEC 9.4, "transform missing on a path": a wrong row read without the transform stands
  // for the token's value within the format's own rounding.
  std::int64_t wrong_rows = 0, untransformed_rows = 0;
  const auto fits_untransformed = [&](const TensorQuant& format, const reference::QuantizedRow& expected,
                                      const optimized::UnpackedRow& actual) {
    if (transform == QuantTransform::none || actual.codes.size() != expected.codes.size()) return false;
    reference::dequantize_stored(format, transform, expected, want.data());  // the token's value
    const reference::QuantizedRow stored = as_row(actual);
    reference::dequantize(format, stored, got.data());  // the codes as they are, no transform undone
    const auto group = static_cast<std::size_t>(std::max(1, reference::scale_group(format, D)));
    for (std::size_t i = 0; i < static_cast<std::size_t>(D); ++i) {
      const double scale = i / group < stored.scales.size() ? std::abs(stored.scales[i / group]) : 0.0;
      if (!(std::abs(got[i] - want[i]) <= 2.0 * reference::element_bound(format.format, want[i], scale) + 0x1p-20))
        return false;
    }
    return true;
  };
  const auto wrong_row = [&](const TensorQuant& format, const reference::QuantizedRow& expected,
                             const optimized::UnpackedRow& actual) {
    ++wrong_rows;
    untransformed_rows += fits_untransformed(format, expected, actual) ? 1 : 0;
  };

  // Keys the source showed at every store of this append (in-process caches that shift): each
  // store is judged as the one before re-quantized at its new position (the first, a new
  // key's write, as the reference quantizes it), so a boundary taken the other way at one
  // shift is followed into the next, and no end-of-step view hides a wrong code. Outputs
  // may move by how far each store the step's queries read stands from the reference's own
  // chain. `followed`: the codes a retained key's last store left, where it is kept.
  std::map<HeldId, std::pair<std::int64_t, reference::QuantizedRow>> followed;
  if (rec.append && !view.key_stores.empty()) {
    std::map<HeldId, std::vector<const KeyStore*>> stores;
    for (const KeyStore& k : view.key_stores) stores[{k.layer, k.row, k.uid, k.kv_head}].push_back(&k);
    for (const auto& [id, list] : stores) {
      const auto [l, b, uid, g] = id;
      const KvQuant& q = s_.quant(l);
      if (!q.k || q.holds_raw() || q.k->scale.rule == ScaleRule::first_append) continue;
      if (static_cast<std::size_t>(l) >= rec.stored.size() || static_cast<std::size_t>(b) >= rec.append->rows.size())
        continue;
      const auto& history = rec.histories[static_cast<std::size_t>(b)];
      std::set<std::int64_t> read;  // where the step's queries saw it
      bool written = false;
      for (const auto& token : rec.append->rows[static_cast<std::size_t>(b)]) {
        written = written || static_cast<std::int64_t>(token.uid) == uid;
        for (const reference::VisibleKey& key : token.view_in(l).keys)
          if (static_cast<std::int64_t>(history[static_cast<std::size_t>(key.index)]) == uid) read.insert(key.position);
      }
      // Where it is kept after the step, if it is.
      std::optional<std::int64_t> kept_at;
      std::optional<std::size_t> kept_index;
      const auto& retained = rec.retained_in(l, b).keys;
      for (std::size_t r = 0; r < retained.size(); ++r)
        if (static_cast<std::int64_t>(retained[r].uid) == uid) kept_at = retained[r].position, kept_index = r;
      // Every store must be at a position the reference has the key at this step (read by a
      // query, or where it is kept): else the cache's route is not the reference's, and the
      // codes after the step are judged alone.
      const bool on_reference_route = std::all_of(list.begin(), list.end(), [&](const KeyStore* store) {
        return read.count(store->position) || kept_at == store->position;
      });
      if (!on_reference_route) continue;
      reference::QuantizedRow cache_codes, reference_codes;
      std::int64_t at = 0;
      // How far the outputs may move for this key: each query reads one of its stores, so the
      // largest weight of a store read, not their sum.
      double moved = 0.0;
      if (written) {
        reference_codes = reference::quantize_key_at(*q.k, q.transform, quantized_rope(s_),
                                                     inputs_.k_at(l, static_cast<std::uint64_t>(uid), g), D, g,
                                                     list.front()->position);
      } else {
        const auto held = held_.find(id);
        if (held == held_.end()) continue;  // never judged before: the codes after the step alone
        at = held->second.position;
        cache_codes = held->second.codes;
        // Read where it was held, before the step's first shift: over the held codes.
        if (read.count(at) && !held->second.as_reference) moved = held->second.weight;
        if (held->second.as_reference) {
          reference_codes = held->second.codes;
        } else {
          const auto theirs = reference_key_codes_.find(id);
          if (theirs == reference_key_codes_.end()) continue;
          reference_codes = theirs->second;
        }
      }
      bool right = true;
      for (std::size_t i = 0; i < list.size() && right; ++i) {
        const KeyStore& store = *list[i];
        reference::QuantizedRow expected;
        if (i == 0 && written) {
          expected = reference_codes;
        } else {
          expected = reference::requantize_shifted(*q.k, q.transform, quantized_rope(s_), cache_codes, g, at, store.position);
          reference_codes =
              reference::requantize_shifted(*q.k, q.transform, quantized_rope(s_), reference_codes, g, at, store.position);
        }
        const CodeMismatch where{l, b, g, false, uid, -1, 0, 0, 0.0, 0.0};
        right = compare(*q.k, expected, store.codes, where, false);
        if (!right) {
          wrong_row(*q.k, expected, store.codes);
          break;
        }
        cache_codes = as_row(store.codes);
        at = store.position;
        const bool last_kept = i + 1 == list.size() && kept_at == at;  // judged with the kept codes below
        if (read.count(at) && !last_kept && !same_stored(cache_codes, reference_codes))
          moved = std::max(moved, weigh(*q.k, reference_codes, store.codes, false));
      }
      if (!right) continue;
      // The reference's chain as rebuilt here must end where the reference's own does; if not,
      // the rebuild is not the reference's route, and the codes after the step are judged alone.
      if (kept_at && *kept_at == at && kept_index && *kept_index < rec.stored[l][b].size()) {
        const reference::StoredHead& h = rec.stored[l][b][*kept_index].heads[static_cast<std::size_t>(g)];
        if (!same_stored(reference_codes, h.key_codes)) continue;
        followed[id] = {at, cache_codes};
      }
      if (moved > 0.0) diverged_[{l, b}] += moved;
    }
  }

  for (std::size_t l = 0; l < rec.stored.size() && l < view.layers.size(); ++l)
    for (std::size_t b = 0; b < rec.stored[l].size() && b < view.layers[l].slots.size(); ++b) {
      const KvQuant& q = s_.quant(static_cast<int>(l));
      const auto& retained = rec.retained_in(static_cast<int>(l), static_cast<int>(b)).keys;
      for (int g = 0; g < s_.dims.kv_heads; ++g) {
        std::map<std::int64_t, const ViewSlot*> by_uid;
        for (const ViewSlot& v : view.layers[l].slots[b][static_cast<std::size_t>(g)]) by_uid[v.uid] = &v;
        readers_key_scale = readers_value_scale = 0.0;
        if (!rec.stored[l][b].empty()) {
          const reference::StoredHead& newest = rec.stored[l][b].back().heads[static_cast<std::size_t>(g)];
          readers_key_scale = frozen_scale_of(newest.key_codes, q.k);
          readers_value_scale = frozen_scale_of(newest.value_codes, q.v);
        }
        const auto key_together = q.k ? requantized_together(*q.k, false, rec, static_cast<int>(l), static_cast<int>(b), g)
                                      : std::map<std::uint64_t, reference::QuantizedRow>{};
        const auto value_together = q.v ? requantized_together(*q.v, true, rec, static_cast<int>(l), static_cast<int>(b), g)
                                        : std::map<std::uint64_t, reference::QuantizedRow>{};
        for (std::size_t i = 0; i < retained.size() && i < rec.stored[l][b].size(); ++i) {
          const auto found = by_uid.find(static_cast<std::int64_t>(retained[i].uid));
          if (found == by_uid.end()) continue;  // the retained-set check reports it
          const ViewSlot& slot = *found->second;
          // A key stored at another position than the reference's is the rotation check's; its
          // value, never rotated, is compared all the same (a ring keeps keys at their index).
          const bool key_at_reference = !slot.claimed_position || *slot.claimed_position == retained[i].position;
          const reference::StoredLayer& token = rec.stored[l][b][i];
          const HeldId id{static_cast<int>(l), static_cast<int>(b), static_cast<std::int64_t>(retained[i].uid), g};
          if (raw_reads) {
            // Under chunk_reads "raw" the step's queries read the row before its flush: a
            // token new in the step was read raw, a kept one as it was held. Where a token's
            // precision changed, R_stored is over the state before (the reference's own),
            // and codes this cache held off the reference's then keep their allowance.
            const auto seen = precision_seen_.find(id);
            const std::pair<bool, int> now{token.raw, token.flushes};
            if (seen == precision_seen_.end() ? !token.raw : seen->second != now) {
              flushed_after_reads_.insert({static_cast<int>(l), static_cast<int>(b)});
              const auto key_before = held_.find(id);
              if (key_before != held_.end() && !key_before->second.as_reference)
                diverged_[{static_cast<int>(l), static_cast<int>(b)}] += key_before->second.weight;
              const auto value_before = held_values_.find(id);
              if (value_before != held_values_.end())
                diverged_[{static_cast<int>(l), static_cast<int>(b)}] += value_before->second.weight;
            }
            precision_seen_[id] = now;
          }
          if (token.raw) continue;  // in the residual: the precision map's (no codes to compare)
          const reference::StoredHead& h = token.heads[static_cast<std::size_t>(g)];
          const CodeMismatch where{static_cast<int>(l), static_cast<int>(b), g, false,
                                   static_cast<std::int64_t>(retained[i].uid), slot.slot, 0, 0, 0.0, 0.0};
          if (q.k && slot.key_codes && key_at_reference) {
            // Expected: a new key as the reference stores it; a kept one unchanged; a shifted
            // one as the reference re-quantized it (every shift of the step), or, once this
            // cache took the other side of a rounding boundary, re-quantized from the codes it
            // held (followed, not held against it at every later shift; one shift per step).
            auto held = held_.find(id);
            std::optional<reference::QuantizedRow> flushed_from_held;
            if (const auto together = key_together.find(retained[i].uid); together != key_together.end())
              flushed_from_held = together->second;  // its run, redone from the rows the cache held
            if (held != held_.end() && held->second.flushes != token.flushes) {
              // Quantized again at a flush: from the codes it held, followed like a shift's
              // when they were not the reference's; else expected anew.
              if (!held->second.as_reference && !flushed_from_held)
                flushed_from_held = requantized(*q.k, held->second.codes, g, retained[i].position,
                                                token.flushes - held->second.flushes);
              held_.erase(held);
              held = held_.end();
            }
            reference::QuantizedRow expected = flushed_from_held ? *flushed_from_held : h.key_codes;
            const auto follow = followed.find(id);
            if (follow != followed.end() && follow->second.first == retained[i].position) {
              expected = follow->second.second;  // its last store this append: unchanged since
              expected.near_boundary.clear();
              expected.scale_near_boundary.clear();
            } else if (held != held_.end() && held->second.position == retained[i].position) {
              expected = held->second.codes;  // kept: must be unchanged, exactly
              expected.near_boundary.clear();
              expected.scale_near_boundary.clear();
            } else if (held != held_.end() && !held->second.as_reference) {
              const std::vector<std::int64_t> path = positions_seen(rec, l, b, retained[i]);
              expected = held->second.codes;
              std::int64_t at = held->second.position;
              for (const std::int64_t to : path) {
                if (to == at) continue;
                expected = reference::requantize_shifted(*q.k, q.transform, quantized_rope(s_), expected, g, at, to);
                at = to;
              }
            }
            const reference::QuantizedRow stored_now = as_row(*slot.key_codes);
            if (follow == followed.end() && held == held_.end() && rec.append && !same_stored(stored_now, expected)) {
              const std::vector<std::int64_t> path = positions_seen(rec, l, b, retained[i]);
              if (path.size() > 1)
                if (auto other = through_write_boundary(static_cast<int>(l), g,
                                                        retained[i].uid, path, *slot.key_codes)) {
                  expected = std::move(*other);
                  ++codes_on_boundary_;
                }
            }
            if (compare(*q.k, expected, *slot.key_codes, where, false)) {
              const bool as_reference = same_stored(stored_now, h.key_codes);
              const double w = as_reference ? 0.0 : weigh(*q.k, h.key_codes, *slot.key_codes, false);
              held_[id] = {retained[i].position, stored_now, as_reference, w, token.flushes};
              if (as_reference)
                reference_key_codes_.erase(id);
              else
                reference_key_codes_[id] = h.key_codes;
              if (!as_reference) diverged_[{static_cast<int>(l), static_cast<int>(b)}] += w;
            } else {
              wrong_row(*q.k, expected, *slot.key_codes);
            }
          }
          // A value held off the reference's codes and quantized again since: from those.
          const auto value_held = held_values_.find(id);
          const auto value_run = value_together.find(retained[i].uid);
          const reference::QuantizedRow expected_value =
              value_run != value_together.end() ? value_run->second
              : q.v && value_held != held_values_.end() && value_held->second.flushes != token.flushes
                  ? requantized(*q.v, value_held->second.codes, g, 0, token.flushes - value_held->second.flushes)
                  : h.value_codes;
          const bool value_right = q.v && slot.value_codes && compare(*q.v, expected_value, *slot.value_codes, where, true);
          if (q.v && slot.value_codes && !value_right) wrong_row(*q.v, expected_value, *slot.value_codes);
          if (value_right) {
            const reference::QuantizedRow stored = as_row(*slot.value_codes);
            if (same_stored(stored, h.value_codes)) {
              held_values_.erase(id);
            } else {  // a value code on a boundary taken the other way: outputs are over it
              const double w = weigh(*q.v, h.value_codes, *slot.value_codes, true);
              held_values_[id] = {stored, w, token.flushes};
              diverged_[{static_cast<int>(l), static_cast<int>(b)}] += w;
            }
          }
        }
      }
    }
  evidence.codes_fit_without_transform = wrong_rows > 0 && untransformed_rows == wrong_rows;
}

bool QuantChecks::held_outputs(const StepRecord& rec, int l, int b, const float* rotated_q, std::vector<double>& out,
                               std::vector<double>& slack) const {
  const KvQuant& q = s_.quant(l);
  const bool own_query = rotated_q != nullptr && q.query;
  if ((!diverged_.count({l, b}) && !own_query) || rec.stored.empty()) return false;
  if (flushed_after_reads_.count({l, b})) return false;  // the queries read what the step then flushed
  const reference::AppendResult& ref = *rec.append;
  const auto& tokens = ref.rows[static_cast<std::size_t>(b)];
  const auto& retained = rec.retained_in(l, b).keys;
  const int D = s_.dims.head_dim, H = s_.dims.heads, G = H / s_.dims.kv_heads;
  const std::size_t B = ref.rows.size();
  const std::int64_t pad = ref.chunk - static_cast<std::int64_t>(tokens.size());
  // R_stored's layout, this row's entries replaced below.
  out = ref.out_stored;
  if (ref.query_slack.empty())
    slack.assign(out.size() / static_cast<std::size_t>(D), 0.0);
  else
    slack = ref.query_slack;
  // Where each kept key sits among the retained ones, by token index.
  std::map<std::int64_t, std::size_t> kept;
  for (std::size_t r = 0; r < retained.size(); ++r) kept[retained[r].index] = r;
  std::vector<double> keys, values, scores, result(static_cast<std::size_t>(D));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    // Every key the token saw must still be kept, where it saw it: the view shows the state
    // after the step, not the one a chunk's earlier tokens saw before an eviction.
    const reference::QueryView& view = tokens[i].view_in(l);
    const std::size_t n = view.keys.size();
    keys.resize(n * D);
    values.resize(n * D);
    scores.resize(n);
    for (int head = 0; head < H; ++head) {
      const int g = head / G;
      if (head % G == 0)  // the group's keys and values, once for its G query heads
        for (std::size_t j = 0; j < n; ++j) {
          const auto found = kept.find(view.keys[j].index);
          if (found == kept.end() || retained[found->second].position != view.keys[j].position) {
            out.clear(), slack.clear();
            return false;
          }
          const reference::RetainedKey& key = retained[found->second];
          const reference::StoredHead& h =
              rec.stored[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)][found->second]
                  .heads[static_cast<std::size_t>(g)];
          std::copy(h.key.begin(), h.key.end(), keys.begin() + static_cast<std::ptrdiff_t>(j * D));
          std::copy(h.value.begin(), h.value.end(), values.begin() + static_cast<std::ptrdiff_t>(j * D));
          // Codes the cache holds that are not the reference's (taken at a boundary).
          const HeldId id{l, b, static_cast<std::int64_t>(key.uid), g};
          const auto held = held_.find(id);
          if (q.k && held != held_.end() && held->second.position == key.position && !held->second.as_reference)
            reference::dequantize_stored(*q.k, q.transform, held->second.codes, keys.data() + j * D);
          const auto held_value = held_values_.find(id);
          if (q.v && held_value != held_values_.end())
            reference::dequantize_stored(*q.v, q.transform, held_value->second.codes, values.data() + j * D);
        }
      // The query the cache used when the source shows it (its rope's float32 rounding can
      // move a quantized query's code across a boundary), else the reference's.
      const std::size_t token_at = (static_cast<std::size_t>(b) * ref.chunk + pad + i) * H + head;
      std::vector<double> query;
      if (own_query) {
        query.assign(rotated_q + token_at * D, rotated_q + (token_at + 1) * D);
      } else {
        const float* raw = inputs_.q_at(l, tokens[i].uid, head);
        query = reference::rotate(std::vector<double>(raw, raw + D), static_cast<double>(view.query_position), quantized_rope(s_));
      }
      // A query code on a tie may still round either way: its slack is kept (the window of
      // position 0: neither query here carries a float32 rope's error).
      if (q.query)
        slack[static_cast<std::size_t>(l) * B * ref.chunk * H + token_at] =
            reference::quantize_query_q8_0(query_transform(q), query_transform_block(q), query.data(), D, 0);
      const double* sink =
          s_.attention.sink_logits.empty() ? nullptr : &s_.attention.sink_logits[static_cast<std::size_t>(l)][head];
      reference::attend(query.data(), keys.data(), values.data(), n, static_cast<std::size_t>(D), s_.softmax_scale(),
                        sink, scores.data(), result.data());
      const std::size_t at = (static_cast<std::size_t>(l) * B * ref.chunk * H + token_at) * D;
      std::copy(result.begin(), result.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
    }
  }
  return true;
}

void QuantChecks::check_bound(const StepRecord& rec, int l, int b, const float* out, std::size_t skipped,
                              const std::string& label) {
  const reference::AppendResult& ref = *rec.append;
  const KvQuant& q = s_.quant(l);
  const int H = s_.dims.heads, Hkv = s_.dims.kv_heads, D = s_.dims.head_dim, G = H / Hkv;
  const std::size_t B = ref.rows.size();
  const std::int64_t n = ref.chunk;
  const auto& tokens = ref.rows[static_cast<std::size_t>(b)];
  const std::int64_t pad = n - static_cast<std::int64_t>(tokens.size());
  const auto& history = rec.histories[static_cast<std::size_t>(b)];
  if (tokens.size() <= skipped) return;  // no output of the row to judge
  // The keys the step's queries saw (each query's visible set is among them): maxima over
  // them bound each query's. A key's position moves (a shift stores it again) as the
  // queries see it move.
  std::vector<char> seen(history.size(), 0);
  std::vector<std::int64_t> last_position(history.size(), 0);
  std::vector<int> moves(history.size(), 0);
  for (std::size_t i = skipped; i < tokens.size(); ++i)
    for (const reference::VisibleKey& key : tokens[i].view_in(l).keys) {
      const auto at = static_cast<std::size_t>(key.index);
      if (!seen[at]) {
        seen[at] = 1;
        const auto before = times_stored_.find({l, b, static_cast<std::int64_t>(history[at]), 0});
        last_position[at] = before != times_stored_.end() ? before->second.position : key.position;
      }
      if (key.position != last_position[at]) ++moves[at], last_position[at] = key.position;
    }
  const auto& retained = rec.retained_in(l, b).keys;
  const bool stored_known = static_cast<std::size_t>(l) < rec.stored.size();
  std::vector<std::int64_t> kept_at(history.size(), -1);  // where a kept key is in `retained`
  for (std::size_t k = 0; k < retained.size(); ++k)
    kept_at[static_cast<std::size_t>(retained[k].index)] = static_cast<std::int64_t>(k);
  std::vector<double> key_error_max(static_cast<std::size_t>(Hkv), 0.0), key_norm_max(static_cast<std::size_t>(Hkv), 0.0),
      value_error_max(static_cast<std::size_t>(Hkv), 0.0);
  // Per kv head and element, the smallest and largest value seen; a learned sink is a value 0.
  const bool sinks = !s_.attention.sink_logits.empty();
  std::vector<double> lo(static_cast<std::size_t>(Hkv * D), sinks ? 0.0 : INFINITY),
      hi(static_cast<std::size_t>(Hkv * D), sinks ? 0.0 : -INFINITY);
  for (std::size_t index = 0; index < seen.size(); ++index) {
    if (!seen[index]) continue;
    const std::uint64_t uid = history[index];
    // How often it was stored: as kept after the step (never less than when the queries
    // read it), or, evicted by the step, as last kept plus the moves the queries saw.
    // A frozen scale ("first_append") is the one the token was stored with: its writer's.
    for (int g = 0; g < Hkv; ++g) {
      int key_times = 1 + moves[index], value_times = 1;
      double key_scale = 0.0, value_scale = 0.0;
      bool scale_known = !frozen_scales(q);
      if (stored_known && kept_at[index] >= 0) {
        const reference::StoredLayer& now = rec.stored[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)]
                                                      [static_cast<std::size_t>(kept_at[index])];
        key_times = 1 + now.shifts + now.flushes;
        value_times = 1 + now.flushes;
        key_scale = frozen_scale_of(now.heads[static_cast<std::size_t>(g)].key_codes, q.k);
        value_scale = frozen_scale_of(now.heads[static_cast<std::size_t>(g)].value_codes, q.v);
        scale_known = true;
      } else if (const auto before = times_stored_.find({l, b, static_cast<std::int64_t>(uid), g});
                 before != times_stored_.end()) {
        key_times = before->second.key + moves[index];
        value_times = before->second.value;
        key_scale = before->second.key_scale, value_scale = before->second.value_scale;
        scale_known = true;
      }
      const Magnitude& m = magnitude(l, uid, g);
      const Magnitude& widest = widest_[static_cast<std::size_t>(l) * s_.dims.kv_heads + static_cast<std::size_t>(g)];
      const auto at = static_cast<std::size_t>(g);
      if (!scale_known) {  // written and evicted within the step: its scale is not shown
        saturation_ = "a key written and evicted within one step holds a frozen scale kvcheck does not see";
        key_error_max[at] = INFINITY;
      }
      key_error_max[at] = std::max(key_error_max[at], key_error(l, m, widest, key_times, key_scale));
      key_norm_max[at] = std::max(key_norm_max[at], m.key_norm);
      value_error_max[at] = std::max(value_error_max[at], value_error(l, m, widest, value_times, value_scale));
      const float* v = inputs_.v_at(l, uid, g);
      for (int d = 0; d < D; ++d) {
        lo[at * D + d] = std::min(lo[at * D + d], static_cast<double>(v[d]));
        hi[at * D + d] = std::max(hi[at * D + d], static_cast<double>(v[d]));
      }
    }
  }
  const auto finite = [](const std::vector<double>& x) {
    return std::all_of(x.begin(), x.end(), [](double e) { return std::isfinite(e); });
  };
  if (!finite(key_error_max) || !finite(value_error_max)) {
    ++saturated_rows_;  // saturation_ says why
    return;
  }
  const double scale = s_.softmax_scale(), m = reference::rope_magnitude(quantized_rope(s_));
  const double root_d = std::sqrt(static_cast<double>(D));
  for (std::size_t i = skipped; i < tokens.size(); ++i)
    for (int h = 0; h < H; ++h) {
      const auto g = static_cast<std::size_t>(h / G);
      const double q_norm = norm(inputs_.q_at(l, tokens[i].uid, h), D) * m;
      // Scores move by scale |q| |dk| from the keys, and scale |dq| |k + dk| from a quantized query.
      double delta = scale * q_norm * key_error_max[g];
      if (q.query) {
        TensorQuant q8;
        q8.format = QuantFormat::q8_0;
        const double e_q = worst_element_error(q8, q_norm, saturation_, "query");
        delta += scale * root_d * e_q * (key_norm_max[g] + key_error_max[g]);
      }
      // Both outputs are weighted means of values within [lo - e_V, hi + e_V], so they are
      // never further apart than the values' spread.
      const double spread = std::min(std::expm1(2.0 * delta) / 2.0, 1.0);
      for (int d = 0; d < D; ++d) {
        const std::size_t at = ((static_cast<std::size_t>(b) * n + pad + i) * H + h) * D + d;
        const std::size_t ref_at = static_cast<std::size_t>(l) * B * n * H * D + at;
        const double ideal = ref.out[ref_at], stored = ref.out_stored[ref_at], got = out[at];
        if (std::isnan(ideal)) continue;  // a sampled step (the reference did not attend)
        sum_sq_ideal_ += ideal * ideal;
        sum_sq_format_ += (stored - ideal) * (stored - ideal);
        sum_sq_cache_ += std::isnan(got) ? std::numeric_limits<double>::infinity() : (got - ideal) * (got - ideal);
        const double bound = value_error_max[g] + spread * (hi[g * D + d] - lo[g * D + d]);
        ++bounded_outputs_;
        largest_bound_ = std::max(largest_bound_, bound);
        smallest_bound_ = std::min(smallest_bound_, bound);
        const double limit = bound + s_.tolerance.atol + s_.tolerance.rtol * std::abs(ideal);
        if (std::abs(got - ideal) <= limit) continue;
        if (bound_tally_.failures++ == 0)
          bound_tally_.first =
              fmt::format("{}: layer {} row {} token {} head {} dim {}: {:.9g} is {:.3g} from R_ideal's {:.9g}, beyond "
                          "the format's bound {:.3g} for this query",
                          label, l, b, tokens[i].index, h, d, got, std::abs(got - ideal), ideal, limit);
      }
    }
}

bool QuantChecks::fits(Variant variant, const StepRecord& rec, int l, int b, std::size_t token, int head,
                       const float* out, double atol, double rtol) const {
  if (rec.stored.empty()) return false;
  const KvQuant& q = s_.quant(l);
  const reference::AppendResult& ref = *rec.append;
  const auto& t = ref.rows[b][token];
  const reference::QueryView& view = t.view_in(l);
  const auto& retained = rec.retained_in(l, b).keys;
  const int D = s_.dims.head_dim, H = s_.dims.heads, g = head / (H / s_.dims.kv_heads);
  const std::size_t n = view.keys.size();
  std::vector<double> keys(n * D), values(n * D), scores(n), query, result(static_cast<std::size_t>(D));
  const auto unit = [&](const TensorQuant& format, reference::QuantizedRow row, double* x) {
    if (variant == Variant::unit_scale) std::fill(row.scales.begin(), row.scales.end(), 1.0);
    reference::dequantize_stored(format, q.transform, row, x);
  };
  for (std::size_t j = 0; j < n; ++j) {
    const auto found = std::find_if(retained.begin(), retained.end(),
                                    [&](const reference::RetainedKey& r) { return r.index == view.keys[j].index; });
    if (found == retained.end() || found->position != view.keys[j].position) return false;
    const reference::StoredLayer& held =
        rec.stored[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)][static_cast<std::size_t>(found - retained.begin())];
    const reference::StoredHead& h = held.heads[static_cast<std::size_t>(g)];
    if (q.k && !held.raw)  // a raw token (the residual) has no scale to drop
      unit(*q.k, h.key_codes, keys.data() + j * D);
    else
      std::copy(h.key.begin(), h.key.end(), keys.begin() + static_cast<std::ptrdiff_t>(j * D));
    if (q.v && !held.raw)
      unit(*q.v, h.value_codes, values.data() + j * D);
    else
      std::copy(h.value.begin(), h.value.end(), values.begin() + static_cast<std::ptrdiff_t>(j * D));
  }
  const float* raw = inputs_.q_at(l, t.uid, head);
  query = reference::rotate(std::vector<double>(raw, raw + D), static_cast<double>(view.query_position), quantized_rope(s_));
  // The query quantized as declared (kv_quant "query"), or as the hypothesis says.
  if (variant == Variant::quantized_query || q.query) {
    if (D % 32 != 0) return false;
    reference::quantize_query_q8_0(query_transform(q), query_transform_block(q), query.data(), D, view.query_position);
  }
  const double* sink =
      s_.attention.sink_logits.empty() ? nullptr : &s_.attention.sink_logits[static_cast<std::size_t>(l)][head];
  reference::attend(query.data(), keys.data(), values.data(), n, static_cast<std::size_t>(D), s_.softmax_scale(), sink,
                    scores.data(), result.data());
  const std::int64_t pad = ref.chunk - static_cast<std::int64_t>(ref.rows[b].size());
  const std::size_t at = ((static_cast<std::size_t>(b) * ref.chunk + pad + token) * H + head) * D;
  for (int d = 0; d < D; ++d)
    if (!(std::abs(out[at + d] - result[d]) <= atol + rtol * std::abs(result[d]))) return false;
  return true;
}

void QuantChecks::rule_outputs(const StepRecord& rec, int l, int b, const float* rotated_q, OutputRule& rule) const {
  if (!rec.append) return;
  std::vector<double> held, held_slack;
  if (!rule.expected.empty()) throw std::logic_error("two sub-checks set the expected outputs (OutputRule)");
  if (!rec.append->out_stored.empty() && held_outputs(rec, l, b, rotated_q, held, held_slack)) {
    rule.expected = std::move(held);
    rule.query_slack = std::move(held_slack);
  } else {
    rule.allowance += row_allowance(l, b);
    rule.query_slack = rec.append->query_slack;
  }
  if (!rule.query_slack.empty()) rule.slack_allowance = [this](double slack) { return query_allowance(slack); };
}

void QuantChecks::check_outputs(const StepRecord& rec, int l, int b, const float* out, std::size_t skipped,
                                StepEvidence& evidence) {
  // A forward's outputs are judged on the whole step.
  if (rec.append && !rec.append->out_stored.empty() && rec.forward == 0)
    check_bound(rec, l, b, out, skipped, evidence.label);
}

void QuantChecks::explain_output(const StepRecord& rec, int l, int b, std::size_t token, int head, const float* out,
                                 const Tolerance& tol, StepEvidence& evidence) const {
  evidence.outputs_fit_unit_scale = fits(Variant::unit_scale, rec, l, b, token, head, out, tol.atol, tol.rtol);
  evidence.outputs_fit_quantized_query =
      !s_.quant_rules().query && fits(Variant::quantized_query, rec, l, b, token, head, out, tol.atol, tol.rtol);
}

double QuantChecks::query_allowance(double slack) const {
  return slack == 0.0 ? 0.0 : std::expm1(2.0 * s_.softmax_scale() * slack * k_norm_) * v_range_ / 2.0;
}

void QuantChecks::add_checks(Outcome& o) const {
  const auto formats = [&](const KvQuant& q) {
    if (!q.k && !q.v) return fmt::format("K and V {}", to_string(s_.kv_dtype));
    std::string w;
    if (q.k) w += fmt::format("K {}", to_string(q.k->format));
    if (q.v) w += fmt::format("{}V {}", w.empty() ? "" : ", ", to_string(q.v->format));
    if (q.transform == QuantTransform::hadamard) w += ", Hadamard";
    return w;
  };
  // Per-layer lists: each distinct layer quantization once, with the layers it covers.
  const std::string what = [&] {
    if (!s_.mixed_quant()) return formats(s_.quant(0));
    std::vector<std::pair<const KvQuant*, std::string>> distinct;  // in layer order
    for (int l = 0; l < s_.dims.layers; ++l) {
      const KvQuant& q = s_.quant(l);
      auto it = std::find_if(distinct.begin(), distinct.end(), [&](const auto& d) { return *d.first == q; });
      if (it == distinct.end())
        distinct.push_back({&q, std::to_string(l)});
      else
        it->second += ", " + std::to_string(l);
    }
    std::string w;
    for (const auto& [q, layers] : distinct)
      w += fmt::format("{}{} in layer{} {}", w.empty() ? "" : "; ", formats(*q),
                       layers.find(',') == std::string::npos ? "" : "s", layers);
    return w;
  }();
  o.checks.push_back(
      {"codes", codes_.failures == 0,
       codes_.failures ? codes_.first
       : codes_checked_ == 0
           ? "no codes shown (" + what + ")"
           : fmt::format("{} codes and their scales as the format's rules give ({}){}", codes_checked_, what,
                         codes_on_boundary_ ? fmt::format(" ({} on a rounding boundary took the neighbouring code)",
                                                          codes_on_boundary_)
                                            : std::string())});
  const double nmse = sum_sq_ideal_ > 0 ? sum_sq_cache_ / sum_sq_ideal_ : 0.0;
  const double format_nmse = sum_sq_ideal_ > 0 ? sum_sq_format_ / sum_sq_ideal_ : 0.0;
  const double ratio = format_nmse > 0 ? nmse / format_nmse : (nmse > 0 ? INFINITY : 1.0);
  std::string detail =
      bounded_outputs_ == 0
          ? saturated_rows_ > 0 ? "not checked: " + saturation_ : std::string("no outputs to judge")
          : fmt::format("within each query's bound of R_ideal (SPEC 9.2.3; from {:.3g} to {:.3g}); NMSE against "
                        "R_ideal {:.3g}, the format's own (R_stored) {:.3g}, ratio {:.3g}",
                        smallest_bound_, largest_bound_, nmse, format_nmse, ratio);
  if (bounded_outputs_ > 0 && saturated_rows_ > 0)
    detail += fmt::format("; {} row(s) of a layer not checked: {}", saturated_rows_, saturation_);
  if (bounded_outputs_ > 0 && ratio > 10.0) detail += "; WARNING: more than 10 times the format's own error";
  o.checks.push_back({"quantization bound", bound_tally_.failures == 0,
                      bound_tally_.failures ? bound_tally_.first : detail});
}

}  // namespace kvcheck
