#include "reference/stored_kv.h"

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

}  // namespace

StoredKv::StoredKv(const Dims& dims, const Rope& rope, const KvQuant& quant, KvDtype kv_dtype,
                   const InputTable& inputs)
    : dims_(dims), rope_(rope), turn_(rope), quant_(quant), kv_dtype_(kv_dtype), inputs_(inputs) {
  turn_.attention_factor = 1.0;
  reset(dims.batch);
}

void StoredKv::encode(const std::optional<TensorQuant>& format, int kv_head, std::vector<double>& x,
                      QuantizedRow& codes) const {
  const int d = dims_.head_dim;
  if (!format) {
    for (double& e : x) e = round_to(kv_dtype_, e);
    return;
  }
  // The cache holds float32 before it quantizes; the transform runs on those floats.
  std::vector<float> held(static_cast<std::size_t>(d));
  for (int i = 0; i < d; ++i) x[i] = static_cast<float>(x[i]);
  if (quant_.transform == QuantTransform::hadamard) hadamard(x.data(), d);
  for (int i = 0; i < d; ++i) held[i] = static_cast<float>(x[i]);
  codes = quantize(*format, held.data(), d, kv_head);
  dequantize(*format, codes, x.data());
  if (quant_.transform == QuantTransform::hadamard) hadamard(x.data(), d);  // H is its own inverse
}

const StoredLayer& StoredKv::settle(int row, int layer, std::int64_t index, std::uint64_t uid, std::int64_t position) {
  auto& tokens = rows_.at(static_cast<std::size_t>(row));
  if (static_cast<std::int64_t>(tokens.size()) <= index)
    tokens.resize(static_cast<std::size_t>(index) + 1,
                  std::vector<StoredLayer>(static_cast<std::size_t>(dims_.layers)));
  StoredLayer& here = tokens[static_cast<std::size_t>(index)][static_cast<std::size_t>(layer)];
  if (here.position == position) return here;
  const int d = dims_.head_dim;
  if (here.position < 0) {  // first write: the raw key rotated to its position
    here.heads.assign(static_cast<std::size_t>(dims_.kv_heads), {});
    for (int g = 0; g < dims_.kv_heads; ++g) {
      StoredHead& h = here.heads[static_cast<std::size_t>(g)];
      const float* k = inputs_.k_at(layer, uid, g);
      const float* v = inputs_.v_at(layer, uid, g);
      h.key = rotate(std::vector<double>(k, k + d), static_cast<double>(position), rope_);
      h.value.assign(v, v + d);
      encode(quant_.k, g, h.key, h.key_codes);
      encode(quant_.v, g, h.value, h.value_codes);
    }
  } else {  // a shift: what is stored, turned by the difference, stored again
    for (int g = 0; g < dims_.kv_heads; ++g) {
      StoredHead& h = here.heads[static_cast<std::size_t>(g)];
      h.key = rotate(h.key, static_cast<double>(position - here.position), turn_);
      if (quant_.k && !quant_.requantize_on_shift)
        throw std::logic_error("stored_kv: a quantized key moved without shift: requantize");
      encode(quant_.k, g, h.key, h.key_codes);
    }
  }
  here.position = position;
  return here;
}

const StoredLayer& StoredKv::at(int row, int layer, std::int64_t index) const {
  return rows_.at(static_cast<std::size_t>(row)).at(static_cast<std::size_t>(index)).at(static_cast<std::size_t>(layer));
}

void StoredKv::reorder(const std::vector<int>& rows) {
  std::vector<std::vector<std::vector<StoredLayer>>> next;
  for (int r : rows) next.push_back(rows_.at(static_cast<std::size_t>(r)));
  rows_ = std::move(next);
}

void StoredKv::reset(int batch) { rows_.assign(static_cast<std::size_t>(batch), {}); }

void StoredKv::crop(std::int64_t length) {
  for (auto& tokens : rows_)
    if (static_cast<std::int64_t>(tokens.size()) > length) tokens.resize(static_cast<std::size_t>(length));
}

}  // namespace kvcheck::reference
