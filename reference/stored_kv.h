// R_stored's inputs (SPEC 9.1): what a quantized cache must hold for every token, simulated
// exactly: the key rotated to its position, rounded to float32, transformed (Hadamard),
// quantized; re-rotated through the format when a shifting policy moves it (dequantize,
// rotate, quantize again: each shift rounds once more, and the drift is simulated, not
// tolerated); values quantized once. A tensor that is not quantized is rounded to kv_dtype.
// Under a residual (SPEC 9: residual, flush, prefill, chunk_reads) a token is first held in
// kv_dtype and quantized when the flush rule says, from the values it was held as.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "reference/kv_quant.h"
#include "reference/model.h"
#include "reference/quantize.h"

namespace kvcheck::reference {

// One token's key and value in one kv head of one layer.
struct StoredHead {
  QuantizedRow key_codes, value_codes;  // empty when that tensor is not quantized
  std::vector<double> key, value;       // what they stand for, transform undone: the key rotated
};

struct StoredLayer {
  std::int64_t position = -1;  // where the key is rotated; -1: not written yet
  bool raw = false;            // held in kv_dtype, not yet quantized (the residual; SPEC 9.2.4)
  int flushes = 0;             // times quantized again from its own codes (flush "requantize_all")
  int shifts = 0;              // times re-rotated and stored again (a shift): each rounds once more
  std::vector<StoredHead> heads;
  // Scales along the token axis: which quantization last stored it (tokens quantized together
  // share it, counting up), and what it was quantized from (each kv head's key and value as
  // held before), so a checker can redo the run from the codes a cache held instead.
  std::int64_t quantized_with = -1;
  std::vector<StoredHead> quantized_from;
};

// Scales along the token axis: rows (what tokens stand for, transform undone; oldest first)
// held as float32, transformed and quantized together; each row becomes what its codes stand
// for. `furthest`: the furthest position a key among them is rotated to (0 for values).
std::vector<QuantizedRow> quantize_rows_together(const TensorQuant& format, QuantTransform transform,
                                                 std::vector<std::vector<double>>& rows, std::int64_t furthest);

// A quantized key moved by a shift (SPEC 9, shift "requantize"): its codes dequantized, the
// transform undone, turned by to - from (a pure rotation), rounded to float32, transformed
// and quantized again. `dequantized` gets what the new codes stand for (transform undone).
QuantizedRow requantize_shifted(const TensorQuant& format, QuantTransform transform, const Rope& rope,
                                const QuantizedRow& codes, int kv_head, std::int64_t from, std::int64_t to,
                                std::vector<double>* dequantized = nullptr);

// A raw key (d floats) as a cache first stores it at `position`: rotated, rounded to
// float32, transformed, quantized (what StoredKv::settle writes the first time).
QuantizedRow quantize_key_at(const TensorQuant& format, QuantTransform transform, const Rope& rope, const float* raw,
                             int d, int kv_head, std::int64_t position);

// What a stored row stands for: its codes dequantized, the transform undone.
void dequantize_stored(const TensorQuant& format, QuantTransform transform, const QuantizedRow& codes, double* out);
// The float32 row a key or value is quantized from (SPEC 9.5, rule 2): x rounded to float32,
// then under "hadamard" transformed in double (blocks of transform_block) and rounded again.
std::vector<float> held_row(const TensorQuant& format, QuantTransform transform, std::vector<double> x);

// A query (d doubles, rotated) as an attention that quantizes it to q8_0 uses it (kv_quant
// "query"): rounded to float32, transformed (K's transform, blocks of `block`; 0: the whole
// head), quantized, dequantized, transformed back.
// Returns how far (2-norm) a backend's may be from it: codes on a tie may round either way.
double quantize_query_q8_0(QuantTransform transform, int block, double* q, int d, std::int64_t position);

class StoredKv {
 public:
  // `layers`: one per layer (their k and v may differ; the residual's, read and transform
  // rules are layer 0's).
  StoredKv(const Dims& dims, const Rope& rope, std::vector<KvQuant> layers, KvDtype kv_dtype, const InputTable& inputs);

  // Token `index` (uid) of `row` in `layer` with its key at `position`: written the first
  // time, re-rotated through the format when the position has moved since.
  const StoredLayer& settle(int row, int layer, std::int64_t index, std::uint64_t uid, std::int64_t position);
  // As stored now (settle() must have written it).
  const StoredLayer& at(int row, int layer, std::int64_t index) const;
  // Whether settle() has written it.
  bool written(int row, int layer, std::int64_t index) const;

  // The residual's rule after the tokens [0, length) of `row` are written (each settled):
  // "append" quantizes the oldest raw tokens until `residual` remain; "block" the oldest
  // whole multiple of `residual` of them, together; "requantize_all",
  // once `residual` tokens are raw, quantizes them and every stored token again. The first
  // append of a row is quantized at once under prefill "store". When it runs follows
  // chunk_reads: before the step's queries read ("stored"), or after ("raw").
  void flush(int row, std::int64_t length, bool first_append);

  // The query as the attention uses it (kv_quant.query): rounded to float32, transformed,
  // quantized, dequantized, transformed back. Unchanged without `query`. Returns how far
  // (2-norm) a backend's query may be from it: codes on a tie may round either way.
  double quantize_query(int layer, double* q, std::int64_t position) const;

  // SPEC 9's "first_append": the scales of `row`, computed from the tokens `uids` of its first
  // append (token i stored at index and position i), kept for the row's later tokens.
  void freeze_scales(int row, const std::vector<std::uint64_t>& uids);
  // A prefix hit under frozen scales (SPEC 8.4): token `index` of `row` holds what another
  // row stored for it, one StoredLayer per layer: its codes with its writer's scale.
  void adopt(int row, std::int64_t index, const std::vector<StoredLayer>& layers);

  void reorder(const std::vector<int>& rows);
  void reset(int batch);
  void crop(std::int64_t length);
  void free_row(int row) {
    rows_.at(static_cast<std::size_t>(row)).clear();
    frozen_.at(static_cast<std::size_t>(row)).clear();
  }
  // Layer 0's: the rules every layer shares.
  const KvQuant& quant() const { return layers_.front(); }
  const KvQuant& quant(int layer) const { return layers_.at(static_cast<std::size_t>(layer)); }
  // Some layer freezes a scale at a row's first append.
  bool freezes_scales() const {
    return std::any_of(layers_.begin(), layers_.end(), [](const KvQuant& q) { return frozen_scales(q); });
  }

 private:
  // Rounds (kv_dtype) or quantizes, then decodes, one head's key or value held as float32.
  // `position`: where the key is rotated (its boundary window grows with it); 0 for values.
  void encode(const std::optional<TensorQuant>& format, int kv_head, std::vector<double>& x, QuantizedRow& codes,
              std::int64_t position) const;
  // Raw tokens quantized, or quantized ones quantized again from what their codes stand for,
  // together (in token order: scales along the token axis span them; other scales do not).
  void quantize_tokens(int layer, const std::vector<StoredLayer*>& tokens);

  // The format a token of `row` is stored in: the declared one, its frozen scale (if any)
  // given as the row's.
  std::optional<TensorQuant> format_of(const std::optional<TensorQuant>& declared, int row, int layer,
                                       bool value) const;

  Dims dims_;
  Rope rope_, turn_;  // turn_: a pure rotation (a shift does not apply yarn's factor again)
  std::vector<KvQuant> layers_;  // one per layer
  KvDtype kv_dtype_;
  const InputTable& inputs_;
  std::vector<std::vector<std::vector<StoredLayer>>> rows_;  // [row][token index][layer]
  std::int64_t quantizations_ = 0;                            // quantize_tokens calls along the token axis
  struct FrozenScales {
    std::vector<double> k, v;  // one per kv head ("head") or one ("tensor"), in the scale's dtype
  };
  std::vector<std::vector<FrozenScales>> frozen_;  // [row][layer]; empty until the row's first append
};

}  // namespace kvcheck::reference
