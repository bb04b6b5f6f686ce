#include "reference/stored_kv.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "reference/rope.h"

namespace kvcheck::reference {

namespace {

double round_to_bfloat16(double x) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);  // 8 significant bits
  const double step = std::ldexp(1.0, e - 8);
  return std::nearbyint(x / step) * step;
}

double round_to(KvDtype dtype, double x) {
  switch (dtype) {
    case KvDtype::float16:
      return round_to_float16(x);
    case KvDtype::bfloat16:
      return round_to_bfloat16(x);
    default:
      return static_cast<float>(x);
  }
}

// x (d doubles) times the block-diagonal Hadamard matrix of `block`-wide blocks (0: one
// block of d); its own inverse.
void hadamard_blocks(double* x, int d, int block) {
  const int width = block > 0 ? block : d;
  for (int at = 0; at + width <= d; at += width) hadamard(x + at, width);
}

}  // namespace

std::vector<float> held_row(const TensorQuant& format, QuantTransform transform, std::vector<double> x) {
  const int d = static_cast<int>(x.size());
  for (double& e : x) e = static_cast<float>(e);
  if (transform == QuantTransform::hadamard) hadamard_blocks(x.data(), d, format.transform_block);
  std::vector<float> held(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) held[i] = static_cast<float>(x[i]);
  return held;
}

namespace {

// The row held as float32, transformed, quantized; x becomes what the codes stand for.
QuantizedRow quantize_held(const TensorQuant& format, QuantTransform transform, int kv_head, std::vector<double>& x,
                           std::int64_t position) {
  const int d = static_cast<int>(x.size());
  const std::vector<float> held = held_row(format, transform, x);
  QuantizedRow codes = quantize(format, held.data(), d, kv_head, boundary_window(position));
  dequantize_stored(format, transform, codes, x.data());
  return codes;
}

// A frozen scale was computed from float32 values: another amax a few ulps away gives the
// neighbouring one (as for any computed float32 scale).
void mark_computed_scale(const std::optional<TensorQuant>& declared, QuantizedRow& codes) {
  if (declared && declared->scale.rule == ScaleRule::first_append)
    codes.scale_near_boundary.assign(codes.scales.size(), true);
}

}  // namespace

void dequantize_stored(const TensorQuant& format, QuantTransform transform, const QuantizedRow& codes, double* out) {
  dequantize(format, codes, out);
  if (transform == QuantTransform::hadamard)  // its own inverse
    hadamard_blocks(out, static_cast<int>(codes.codes.size()), format.transform_block);
}

double quantize_query_q8_0(QuantTransform transform, int block, double* q, int d, std::int64_t position) {
  std::vector<float> held(static_cast<std::size_t>(d));
  for (int i = 0; i < d; ++i) q[i] = static_cast<float>(q[i]);
  if (transform == QuantTransform::hadamard) hadamard_blocks(q, d, block);
  for (int i = 0; i < d; ++i) held[static_cast<std::size_t>(i)] = static_cast<float>(q[i]);
  const double slack = quantize_activation_q8_0(held.data(), d, q, boundary_window(position));
  if (transform == QuantTransform::hadamard) hadamard_blocks(q, d, block);
  return slack;
}

QuantizedRow quantize_key_at(const TensorQuant& format, QuantTransform transform, const Rope& rope, const float* raw,
                             int d, int kv_head, std::int64_t position) {
  std::vector<double> x = rotate(std::vector<double>(raw, raw + d), static_cast<double>(position), rope);
  return quantize_held(format, transform, kv_head, x, position);
}

QuantizedRow requantize_shifted(const TensorQuant& format, QuantTransform transform, const Rope& rope,
                                const QuantizedRow& codes, int kv_head, std::int64_t from, std::int64_t to,
                                std::vector<double>* dequantized) {
  std::vector<double> x(codes.codes.size());
  dequantize_stored(format, transform, codes, x.data());
  Rope turn = rope;
  turn.attention_factor = 1.0;  // a shift does not apply yarn's factor again
  x = rotate(x, static_cast<double>(to - from), turn);
  QuantizedRow out = quantize_held(format, transform, kv_head, x, std::max(from, to));
  if (dequantized) *dequantized = std::move(x);
  return out;
}

StoredKv::StoredKv(const Dims& dims, const Rope& rope, std::vector<KvQuant> layers, KvDtype kv_dtype,
                   const InputTable& inputs)
    : dims_(dims), rope_(rope), turn_(rope), layers_(std::move(layers)), kv_dtype_(kv_dtype), inputs_(inputs) {
  if (layers_.size() != static_cast<std::size_t>(dims.layers))
    throw std::logic_error("stored_kv: expected one kv_quant per layer");
  turn_.attention_factor = 1.0;
  reset(dims.batch);
}

void StoredKv::encode(const std::optional<TensorQuant>& format, int kv_head, std::vector<double>& x,
                      QuantizedRow& codes, std::int64_t position) const {
  if (!format) {
    for (double& e : x) e = round_to(kv_dtype_, e);
    return;
  }
  // The cache holds float32 before it quantizes; the transform runs on those floats.
  codes = quantize_held(*format, quant().transform, kv_head, x, position);
}

const StoredLayer& StoredKv::settle(int row, int layer, std::int64_t index, std::uint64_t uid, std::int64_t position) {
  auto& tokens = rows_.at(static_cast<std::size_t>(row));
  if (static_cast<std::int64_t>(tokens.size()) <= index)
    tokens.resize(static_cast<std::size_t>(index) + 1,
                  std::vector<StoredLayer>(static_cast<std::size_t>(dims_.layers)));
  StoredLayer& here = tokens[static_cast<std::size_t>(index)][static_cast<std::size_t>(layer)];
  if (here.position == position) return here;
  const int d = dims_.head_dim;
  const KvQuant& rules = quant(layer);
  if (here.position < 0) {  // first write: the raw key rotated to its position
    here.heads.assign(static_cast<std::size_t>(dims_.kv_heads), {});
    for (int g = 0; g < dims_.kv_heads; ++g) {
      StoredHead& h = here.heads[static_cast<std::size_t>(g)];
      const float* k = inputs_.k_at(layer, uid, g);
      const float* v = inputs_.v_at(layer, uid, g);
      h.key = rotate(std::vector<double>(k, k + d), static_cast<double>(position), rope_);
      h.value.assign(v, v + d);
      // Held raw: in kv_dtype until the flush rule quantizes it.
      encode(rules.holds_raw() ? std::nullopt : format_of(rules.k, row, layer, false), g, h.key, h.key_codes, position);
      encode(rules.holds_raw() ? std::nullopt : format_of(rules.v, row, layer, true), g, h.value, h.value_codes, 0);
      mark_computed_scale(rules.k, h.key_codes);
      mark_computed_scale(rules.v, h.value_codes);
    }
    here.raw = rules.holds_raw();
  } else {  // a shift: what is stored, turned by the difference, stored again
    ++here.shifts;
    for (int g = 0; g < dims_.kv_heads; ++g) {
      StoredHead& h = here.heads[static_cast<std::size_t>(g)];
      if (rules.k && !here.raw) {
        h.key_codes =
            requantize_shifted(*rules.k, rules.transform, rope_, h.key_codes, g, here.position, position, &h.key);
      } else {
        h.key = rotate(h.key, static_cast<double>(position - here.position), turn_);
        encode(std::nullopt, g, h.key, h.key_codes, position);
      }
    }
  }
  here.position = position;
  return here;
}

double StoredKv::quantize_query(int layer, double* q, std::int64_t position) const {
  const KvQuant& rules = quant(layer);  // K's transform and block: the layer's
  return rules.query ? quantize_query_q8_0(query_transform(rules), query_transform_block(rules), q,
                                             dims_.head_dim, position)
                       : 0.0;
}

bool StoredKv::written(int row, int layer, std::int64_t index) const {
  const auto& tokens = rows_.at(static_cast<std::size_t>(row));
  return index >= 0 && index < static_cast<std::int64_t>(tokens.size()) &&
         tokens[static_cast<std::size_t>(index)][static_cast<std::size_t>(layer)].position >= 0;
}

const StoredLayer& StoredKv::at(int row, int layer, std::int64_t index) const {
  return rows_.at(static_cast<std::size_t>(row)).at(static_cast<std::size_t>(index)).at(static_cast<std::size_t>(layer));
}

std::vector<QuantizedRow> quantize_rows_together(const TensorQuant& format, QuantTransform transform,
                                                 std::vector<std::vector<double>>& rows, std::int64_t furthest) {
  std::vector<std::vector<float>> held;  // each row as float32, transformed
  std::vector<const float*> pointers;
  for (std::vector<double>& x : rows) {
    for (double& e : x) e = static_cast<float>(e);
    if (transform == QuantTransform::hadamard) hadamard_blocks(x.data(), static_cast<int>(x.size()), format.transform_block);
    held.emplace_back(x.begin(), x.end());
  }
  for (const auto& row : held) pointers.push_back(row.data());
  const int d = rows.empty() ? 0 : static_cast<int>(rows[0].size());
  std::vector<QuantizedRow> codes = quantize_along_tokens(format, pointers, d, boundary_window(furthest));
  for (std::size_t t = 0; t < rows.size(); ++t) dequantize_stored(format, transform, codes[t], rows[t].data());
  return codes;
}

void StoredKv::quantize_tokens(int layer, const std::vector<StoredLayer*>& tokens) {
  // From the values each is held as: kv_dtype while raw, what its codes stand for after.
  const KvQuant& rules = quant(layer);
  const bool along = rules.along_tokens();
  if (along && !tokens.empty()) ++quantizations_;
  for (StoredLayer* token : tokens) {
    if (!token->raw) ++token->flushes;
    token->raw = false;
    if (along) {
      token->quantized_with = quantizations_;
      token->quantized_from.resize(token->heads.size());
      for (std::size_t g = 0; g < token->heads.size(); ++g)  // what each stood for; the codes are not needed
        token->quantized_from[g].key = token->heads[g].key, token->quantized_from[g].value = token->heads[g].value;
    }
  }
  for (int g = 0; g < dims_.kv_heads; ++g)
    for (const auto& [format, value] : {std::pair{&rules.k, false}, std::pair{&rules.v, true}}) {
      if (!*format) continue;
      if ((*format)->scale.granularity == ScaleGranularity::channel) {
        std::vector<std::vector<double>> rows;
        std::int64_t furthest = 0;
        for (StoredLayer* token : tokens) {
          const StoredHead& h = token->heads[static_cast<std::size_t>(g)];
          rows.push_back(value ? h.value : h.key);
          if (!value) furthest = std::max(furthest, token->position);
        }
        const std::vector<QuantizedRow> codes = quantize_rows_together(**format, rules.transform, rows, furthest);
        for (std::size_t t = 0; t < tokens.size(); ++t) {
          StoredHead& h = tokens[t]->heads[static_cast<std::size_t>(g)];
          (value ? h.value_codes : h.key_codes) = codes[t];
          (value ? h.value : h.key) = std::move(rows[t]);
        }
        continue;
      }
      for (StoredLayer* token : tokens) {
        StoredHead& h = token->heads[static_cast<std::size_t>(g)];
        encode(*format, g, value ? h.value : h.key, value ? h.value_codes : h.key_codes, value ? 0 : token->position);
      }
    }
}

void StoredKv::flush(int row, std::int64_t length, bool first_append) {
  const KvQuant& rules = quant();  // the residual's: every layer's
  if (!rules.holds_raw()) return;
  auto& tokens = rows_.at(static_cast<std::size_t>(row));
  const std::size_t n = std::min(tokens.size(), static_cast<std::size_t>(std::max<std::int64_t>(length, 0)));
  for (int l = 0; l < dims_.layers; ++l) {
    std::vector<StoredLayer*> raw, written;  // oldest first
    for (std::size_t i = 0; i < n; ++i) {
      StoredLayer& token = tokens[i][static_cast<std::size_t>(l)];
      if (token.position < 0) continue;
      written.push_back(&token);
      if (token.raw) raw.push_back(&token);
    }
    const auto residual = static_cast<std::size_t>(rules.residual);
    if (first_append && rules.prefill == PrefillRule::store) {
      quantize_tokens(l, raw);
    } else if (rules.flush == Flush::block) {  // the oldest whole multiple of R, together
      quantize_tokens(l, {raw.begin(), raw.begin() + static_cast<std::ptrdiff_t>(raw.size() / residual * residual)});
    } else if (rules.flush == Flush::append) {
      quantize_tokens(l, {raw.begin(), raw.end() - static_cast<std::ptrdiff_t>(std::min(residual, raw.size()))});
    } else if (raw.size() >= residual) {
      quantize_tokens(l, written);
    }
  }
}

std::optional<TensorQuant> StoredKv::format_of(const std::optional<TensorQuant>& declared, int row, int layer,
                                               bool value) const {
  if (!declared || declared->scale.rule != ScaleRule::first_append) return declared;
  const auto& scales = frozen_.at(static_cast<std::size_t>(row));
  if (scales.empty()) throw std::logic_error("stored_kv: a token stored before its row's first append froze its scale");
  TensorQuant frozen = *declared;
  frozen.scale.rule = ScaleRule::fixed;  // given, already in its dtype
  frozen.scale.values = value ? scales.at(static_cast<std::size_t>(layer)).v : scales.at(static_cast<std::size_t>(layer)).k;
  return frozen;
}

void StoredKv::freeze_scales(int row, const std::vector<std::uint64_t>& uids) {
  const int d = dims_.head_dim;
  // The largest magnitude of what is quantized: the key rotated to its index and the value,
  // each held as float32 and transformed.
  const auto largest = [&](const TensorQuant& format, std::vector<double> x) {
    for (double& e : x) e = static_cast<float>(e);
    if (quant().transform == QuantTransform::hadamard) hadamard_blocks(x.data(), d, format.transform_block);
    double amax = 0.0;
    for (double e : x) amax = std::max(amax, std::abs(static_cast<double>(static_cast<float>(e))));
    return amax;
  };
  const auto scales = [&](const std::optional<TensorQuant>& format, int layer, bool value) {
    std::vector<double> out;
    if (!format || format->scale.rule != ScaleRule::first_append) return out;
    std::vector<double> amax(static_cast<std::size_t>(dims_.kv_heads), 0.0);
    for (std::size_t i = 0; i < uids.size(); ++i)
      for (int g = 0; g < dims_.kv_heads; ++g) {
        const float* x = value ? inputs_.v_at(layer, uids[i], g) : inputs_.k_at(layer, uids[i], g);
        std::vector<double> row_values(x, x + d);
        if (!value) row_values = rotate(row_values, static_cast<double>(i), rope_);
        amax[static_cast<std::size_t>(g)] = std::max(amax[static_cast<std::size_t>(g)], largest(*format, row_values));
      }
    if (format->scale.granularity == ScaleGranularity::tensor) amax = {*std::max_element(amax.begin(), amax.end())};
    for (double a : amax) {
      const double s = a / code_range(format->format);
      out.push_back(format->scale.dtype == ScaleDtype::float16 ? round_to_float16(static_cast<float>(s))
                                                                 : static_cast<double>(static_cast<float>(s)));
    }
    return out;
  };
  auto& mine = frozen_.at(static_cast<std::size_t>(row));
  mine.assign(static_cast<std::size_t>(dims_.layers), {});
  for (int l = 0; l < dims_.layers; ++l)
    mine[static_cast<std::size_t>(l)] = {scales(quant(l).k, l, false), scales(quant(l).v, l, true)};
}

void StoredKv::adopt(int row, std::int64_t index, const std::vector<StoredLayer>& layers) {
  auto& tokens = rows_.at(static_cast<std::size_t>(row));
  if (static_cast<std::int64_t>(tokens.size()) <= index)
    tokens.resize(static_cast<std::size_t>(index) + 1, std::vector<StoredLayer>(static_cast<std::size_t>(dims_.layers)));
  tokens[static_cast<std::size_t>(index)] = layers;
}

void StoredKv::reorder(const std::vector<int>& rows) {
  std::vector<std::vector<std::vector<StoredLayer>>> next;
  std::vector<std::vector<FrozenScales>> scales;
  for (int r : rows) next.push_back(rows_.at(static_cast<std::size_t>(r))), scales.push_back(frozen_.at(static_cast<std::size_t>(r)));
  rows_ = std::move(next);
  frozen_ = std::move(scales);
}

void StoredKv::reset(int batch) {
  rows_.assign(static_cast<std::size_t>(batch), {});
  frozen_.assign(static_cast<std::size_t>(batch), {});
}

void StoredKv::crop(std::int64_t length) {
  for (auto& tokens : rows_)
    if (static_cast<std::int64_t>(tokens.size()) > length) tokens.resize(static_cast<std::size_t>(length));
}

}  // namespace kvcheck::reference
