// SPEC 9.3 in a trace: a quantized cache's codes, scales and zero points per tensor, read the
// same way from a flat layer (rows [B, Hkv, slots]) and from a paged pool (rows [blocks, B,
// Hkv] or [blocks, Hkv, B]): every array is rows of D codes and rows of G groups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "optimized/row_codec.h"
#include "reference/quantize.h"
#include "tools/harness/io/npy.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// The files of one layer's codes: [0] keys, [1] values; empty where not given.
struct CodeFiles {
  std::string codes[2], scales[2], zeros[2], biases[2];
};

// Reads `k_codes`, `k_scales`, `k_zero`, `v_...` of the manifest object `j` at JSON path `p`:
// codes need the scenario's kv_quant for that tensor, come with their scales, and with zero
// points exactly for the affine formats. `file` resolves a name (and names its field when it
// is not one); `fail` throws the manifest's error.
// `layer`: whose kv_quant the codes follow.
void read_code_files(const nlohmann::json& j, const std::string& p, const Scenario& s, int layer,
                     const std::function<std::string(const std::string& key)>& file,
                     const std::function<void(const std::string& path, const std::string& why)>& fail, CodeFiles& out);

// Codes as SPEC 9.3 reads them whatever byte type they came in: fp8 bit patterns 0..255,
// int8 and q8_0 signed, q4_0 and int4 0..15, int2 0..3 (anything else is bad input).
void normalize_codes(QuantFormat format, const std::string& path, std::vector<std::int32_t>& codes);

// Codes or zero points (int8, uint8 or int32) of the `expected` shape, where a 0 stands for
// any size (the slots a dump holds, the blocks it dumped).
NpyArray<std::int32_t> load_codes(const std::string& path, std::vector<std::size_t> expected);

// One tensor's stored rows: codes [rows, D], scales and zero points [rows, G], in the shape
// the caller checked.
struct StoredRows {
  NpyArray<std::int32_t> codes;
  NpyArray<float> scales;
  std::optional<NpyArray<std::int32_t>> zeros;
  std::optional<NpyArray<float>> biases;  // mlx_affine (SPEC 9.7)
  std::size_t head_dim = 0, groups = 0;

  // Reads and checks the three files of tensor t: `rows_shape` is the shape's leading
  // dimensions, 0 for any size (the codes' is rows_shape + [D], the scales' and zero
  // points' the codes' leading dimensions + [G]).
  static StoredRows read(const CodeFiles& files, int t, const TensorQuant& quant, std::vector<std::size_t> rows_shape,
                         std::size_t head_dim);
  optimized::UnpackedRow unpacked(std::size_t row) const;
  reference::QuantizedRow quantized(std::size_t row) const;
  // What every row stands for, the transform undone: the floats a dump left out.
  std::vector<float> dequantized(const TensorQuant& quant, QuantTransform transform) const;
};

}  // namespace kvcheck
