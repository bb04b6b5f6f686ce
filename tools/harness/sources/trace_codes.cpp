#include "tools/harness/sources/trace_codes.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "reference/stored_kv.h"

namespace kvcheck {

void read_code_files(const nlohmann::json& j, const std::string& p, const Scenario& s, int layer,
                     const std::function<std::string(const std::string& key)>& file,
                     const std::function<void(const std::string& path, const std::string& why)>& fail, CodeFiles& out) {
  for (int tensor = 0; tensor < 2; ++tensor) {
    const std::string name = tensor == 0 ? "k" : "v";
    static const std::optional<TensorQuant> none;
    const std::optional<TensorQuant>& quant = !s.quantized() ? none : tensor == 0 ? s.quant(layer).k : s.quant(layer).v;
    if (!j.contains(name + "_codes") && !j.contains(name + "_scales")) continue;
    if (!quant)
      fail(p + "/" + name + "_codes",
           fmt::format("the scenario quantizes no {}{}: codes need its kv_quant (SPEC 9)", tensor == 0 ? "K" : "V",
                       !s.mixed_quant() ? "" : fmt::format(" in layer {}", layer)));
    for (const std::string& key : {name + "_codes", name + "_scales"})
      if (!j.contains(key)) fail(p + "/" + key, "expected a file name: codes and scales come together");
    out.codes[tensor] = file(name + "_codes");
    out.scales[tensor] = file(name + "_scales");
    const bool affine = quant->format == QuantFormat::int4 || quant->format == QuantFormat::int2;
    if (affine != j.contains(name + "_zero"))
      fail(p + "/" + name + "_zero", affine ? fmt::format("expected a file name: {} codes need their zero points",
                                                          to_string(quant->format))
                                            : fmt::format("{} has no zero points", to_string(quant->format)));
    if (affine) out.zeros[tensor] = file(name + "_zero");
    const bool biased = has_biases(quant->format);  // SPEC 9.7, 9.8
    if (biased != j.contains(name + "_bias"))
      fail(p + "/" + name + "_bias", biased ? fmt::format("expected a file name: {} codes need their biases",
                                                          to_string(quant->format))
                                            : fmt::format("{} has no biases", to_string(quant->format)));
    if (biased) out.biases[tensor] = file(name + "_bias");
  }
}

void normalize_codes(QuantFormat format, const std::string& path, std::vector<std::int32_t>& codes) {
  int lo = 0, hi = 255;
  switch (format) {
    case QuantFormat::fp8_e4m3:
    case QuantFormat::fp8_e5m2:
      for (std::int32_t& c : codes) c &= 0xFF;
      return;
    case QuantFormat::int8:
    case QuantFormat::q8_0:
    case QuantFormat::int8_even:
      for (std::int32_t& c : codes)
        if (c > 127 && c <= 255) c -= 256;  // written as uint8
      lo = -128, hi = 127;
      break;
    case QuantFormat::int4_even:  // signed codes, one a byte
      for (std::int32_t& c : codes)
        if (c > 127 && c <= 255) c -= 256;
      lo = -8, hi = 7;
      break;
    case QuantFormat::q4_0:
    case QuantFormat::int4:
      hi = 15;
      break;
    case QuantFormat::int2:
      hi = 3;
      break;
    case QuantFormat::mlx_affine:  // unsigned, up to 2^bits - 1 (the code check holds each to its bits)
    case QuantFormat::quanto_affine:
      break;
  }
  for (std::int32_t c : codes)
    if (c < lo || c > hi)
      throw InputError(path, "", fmt::format("a {} code of {}: expected {} to {}", to_string(format), c, lo, hi));
}

NpyArray<std::int32_t> load_codes(const std::string& path, std::vector<std::size_t> expected) {
  NpyArray<std::int32_t> a = read_npy_codes(path);
  if (a.shape.size() == expected.size())
    for (std::size_t i = 0; i < expected.size(); ++i)
      if (expected[i] == 0) expected[i] = a.shape[i];
  if (a.shape != expected)
    throw InputError(path, "", fmt::format("expected codes of shape {}, got {}", shape_string(expected),
                                           shape_string(a.shape)));
  return a;
}

StoredRows StoredRows::read(const CodeFiles& files, int t, const TensorQuant& quant, std::vector<std::size_t> rows_shape,
                            std::size_t head_dim) {
  StoredRows r;
  r.head_dim = head_dim;
  r.groups = head_dim / static_cast<std::size_t>(reference::scale_group(quant, static_cast<int>(head_dim)));
  std::vector<std::size_t> shape = rows_shape;
  shape.push_back(head_dim);
  r.codes = load_codes(files.codes[t], shape);
  normalize_codes(quant.format, files.codes[t], r.codes.data);
  shape = r.codes.shape;  // the slots, when any were allowed
  shape.back() = r.groups;
  double ignored = 0.0;
  r.scales = read_npy_floats(files.scales[t], &ignored);
  if (r.scales.shape != shape)
    throw InputError(files.scales[t], "",
                     fmt::format("expected scales of shape {} ({}), got {}", shape_string(shape),
                                 quant.scale.granularity == ScaleGranularity::channel
                                     ? std::string("along the token axis: each token's run's scale for each element")
                                     : fmt::format("groups of {}", head_dim / r.groups),
                                 shape_string(r.scales.shape)));
  if (!files.zeros[t].empty()) r.zeros = load_codes(files.zeros[t], shape);
  if (!files.biases[t].empty()) {
    r.biases = read_npy_floats(files.biases[t], &ignored);
    if (r.biases->shape != shape)
      throw InputError(files.biases[t], "", fmt::format("expected biases of shape {} (as the scales), got {}",
                                                        shape_string(shape), shape_string(r.biases->shape)));
  }
  return r;
}

optimized::UnpackedRow StoredRows::unpacked(std::size_t row) const {
  optimized::UnpackedRow u;
  const auto c = codes.data.begin() + static_cast<std::ptrdiff_t>(row * head_dim);
  u.codes.assign(c, c + static_cast<std::ptrdiff_t>(head_dim));
  const auto s = scales.data.begin() + static_cast<std::ptrdiff_t>(row * groups);
  u.scales.assign(s, s + static_cast<std::ptrdiff_t>(groups));
  if (zeros) {
    const auto z = zeros->data.begin() + static_cast<std::ptrdiff_t>(row * groups);
    u.zeros.assign(z, z + static_cast<std::ptrdiff_t>(groups));
  }
  if (biases) {
    const auto c0 = biases->data.begin() + static_cast<std::ptrdiff_t>(row * groups);
    u.biases.assign(c0, c0 + static_cast<std::ptrdiff_t>(groups));
  }
  return u;
}

reference::QuantizedRow StoredRows::quantized(std::size_t row) const {
  const optimized::UnpackedRow u = unpacked(row);
  reference::QuantizedRow q;
  q.codes = u.codes;
  q.scales.assign(u.scales.begin(), u.scales.end());
  q.zeros = u.zeros;
  q.biases.assign(u.biases.begin(), u.biases.end());
  return q;
}

std::vector<float> StoredRows::dequantized(const TensorQuant& quant, QuantTransform transform) const {
  std::vector<float> out(codes.data.size());
  std::vector<double> row(head_dim);
  for (std::size_t r = 0; r < codes.data.size() / head_dim; ++r) {
    reference::dequantize_stored(quant, transform, quantized(r), row.data());
    std::copy(row.begin(), row.end(), out.begin() + static_cast<std::ptrdiff_t>(r * head_dim));
  }
  return out;
}

}  // namespace kvcheck
