// Cache storage shared by every optimized cache: per layer, keys and values laid out
// [row][kv_head][slot][head_dim], so one head of one row is a contiguous run that a
// decode step reads once; plus three integers of metadata per (row, slot). Rows are
// float32, float16, bfloat16 (SPEC 7, kv_dtype) or quantized (SPEC 9), keys and values
// each in their own format (row_codec.h): written rounded, read converted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "optimized/half.h"
#include "optimized/row_codec.h"

namespace kvcheck::optimized {

// Who sits in a slot. uid < 0 means empty: never visible, never reported.
struct SlotMeta {
  std::int64_t uid = -1;
  std::int64_t index = -1;     // token index in the row
  std::int64_t position = -1;  // the position its key is rotated at
  bool raw = false;            // held in the float storage, not yet quantized (a residual)
};

class SlotStore {
 public:
  SlotStore() = default;
  SlotStore(int layers, int kv_heads, int head_dim, Storage storage = Storage::float32);
  // One entry of `formats` per layer.
  SlotStore(int kv_heads, int head_dim, std::vector<LayerFormats> formats);

  // A quantized store that also holds some tokens unquantized (SPEC 9's residual): every
  // slot gets a float row beside its codes, rounded to `storage`; a slot's meta says which
  // one it holds. Call before reset().
  void hold_raw(Storage storage);
  bool holds_raw() const { return holds_raw_; }
  // A raw slot's tokens quantized, or a quantized slot quantized again from what its codes
  // stand for (a flush); every layer and kv head.
  void quantize_slot(int row, std::int64_t slot);
  // Several slots quantized together (given in token order): a format with scales along the
  // token axis spans them; the others quantize each slot alone.
  void quantize_slots(int row, const std::vector<std::int64_t>& slots);

  // Drops everything and makes `batch` rows of `capacity` empty slots.
  void reset(int batch, std::int64_t capacity);
  // More slots per row, keeping what is there (a dynamic cache's amortized growth).
  void grow(std::int64_t capacity);
  // New row b becomes a copy of old row rows[b] (beam reorder; the batch may change).
  void gather_rows(const std::vector<int>& rows);
  // Empty slots of this shape: reallocated only when the shape changes, otherwise just
  // every slot emptied (no stale row can be read either way).
  void make_empty(int batch, std::int64_t capacity);
  // Copies slot `from_slot` of `from_row` in `src` to slot `to` of `row` here.
  void copy_slot(const SlotStore& src, int from_row, std::int64_t from_slot, int row, std::int64_t to);
  // Copies slot `from` to slot `to` in the same row, every layer and head.
  void move_slot(int row, std::int64_t from, std::int64_t to);
  void clear_slot(int row, std::int64_t slot) { meta(row, slot) = SlotMeta{}; }
  // An empty slot whose keys and values are the NaN `nan_bits` (poison.h), every layer and
  // kv head, so that reading it shows.
  void poison_slot(int row, std::int64_t slot, std::uint32_t nan_bits);

  // A key or value as stored: one row in key_format(layer) or value_format(layer).
  const void* key(int layer, int row, int kv_head, std::int64_t slot) const {
    auto* self = const_cast<SlotStore*>(this);
    return self->at(self->k_, layer, row, kv_head, slot);
  }
  const void* value(int layer, int row, int kv_head, std::int64_t slot) const {
    auto* self = const_cast<SlotStore*>(this);
    return self->at(self->v_, layer, row, kv_head, slot);
  }
  // Writes head_dim floats, rounded or quantized to the format; reads them back as floats.
  // A raw slot (meta(row, slot).raw, set before the write) keeps them in its float row.
  // `given_scale`: a frozen format's scale (the writing row's, row_codec.h).
  void write_key(int layer, int row, int kv_head, std::int64_t slot, const float* x, float given_scale = 0.0f) {
    if (raw_slot(row, slot)) return write_raw(raw_k_, layer, row, kv_head, slot, x);
    encode_row(key_format(layer), kv_head, x, head_dim_, at(k_, layer, row, kv_head, slot), scratch_.data(),
               given_scale);
  }
  void write_value(int layer, int row, int kv_head, std::int64_t slot, const float* x, float given_scale = 0.0f) {
    if (raw_slot(row, slot)) return write_raw(raw_v_, layer, row, kv_head, slot, x);
    encode_row(value_format(layer), kv_head, x, head_dim_, at(v_, layer, row, kv_head, slot), scratch_.data(),
               given_scale);
  }
  void read_key(int layer, int row, int kv_head, std::int64_t slot, float* x) const {
    if (raw_slot(row, slot)) return read_raw(raw_k_, layer, row, kv_head, slot, x);
    decode_row(key_format(layer), kv_head, static_cast<const std::byte*>(key(layer, row, kv_head, slot)), head_dim_, x);
  }
  void read_value(int layer, int row, int kv_head, std::int64_t slot, float* x) const {
    if (raw_slot(row, slot)) return read_raw(raw_v_, layer, row, kv_head, slot, x);
    decode_row(value_format(layer), kv_head, static_cast<const std::byte*>(value(layer, row, kv_head, slot)), head_dim_,
               x);
  }
  bool raw_slot(int row, std::int64_t slot) const { return holds_raw_ && meta(row, slot).raw; }
  const RowFormat& key_format(int layer) const { return formats_[static_cast<std::size_t>(layer)].key; }
  const RowFormat& value_format(int layer) const { return formats_[static_cast<std::size_t>(layer)].value; }
  const std::vector<LayerFormats>& formats() const { return formats_; }
  // Keys and values are plain float32 rows in every layer: the attention reads them in place.
  bool plain_float32() const { return plain_float32_; }
  // The float storage of layer 0's keys (float32 for a quantized format).
  Storage storage() const {
    const Codec c = formats_.empty() ? Codec::float32 : formats_.front().key.codec;
    return c == Codec::float16 ? Storage::float16 : c == Codec::bfloat16 ? Storage::bfloat16 : Storage::float32;
  }
  SlotMeta& meta(int row, std::int64_t slot) { return meta_[static_cast<std::size_t>(row) * capacity_ + slot]; }
  const SlotMeta& meta(int row, std::int64_t slot) const {
    return meta_[static_cast<std::size_t>(row) * capacity_ + slot];
  }
  const SlotMeta* row_meta(int row) const { return meta_.data() + static_cast<std::size_t>(row) * capacity_; }

  int batch() const { return batch_; }
  std::int64_t capacity() const { return capacity_; }
  int layers() const { return layers_; }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return head_dim_; }

 private:
  std::byte* at(std::vector<std::vector<std::byte>>& data, int layer, int row, int kv_head, std::int64_t slot) {
    const auto l = static_cast<std::size_t>(layer);
    const std::size_t bytes = &data == &k_ ? key_bytes_[l] : value_bytes_[l];
    return data[l].data() + ((static_cast<std::size_t>(row) * kv_heads_ + kv_head) * capacity_ + slot) * bytes;
  }

  // Where a slot's float row starts in one layer's raw_k_ or raw_v_.
  std::size_t raw_at(int row, int kv_head, std::int64_t slot) const {
    return ((static_cast<std::size_t>(row) * kv_heads_ + kv_head) * capacity_ + slot) * head_dim_;
  }
  void write_raw(std::vector<std::vector<float>>& data, int layer, int row, int kv_head, std::int64_t slot,
                 const float* x);
  void read_raw(const std::vector<std::vector<float>>& data, int layer, int row, int kv_head, std::int64_t slot,
                float* x) const;
  // `slots` consecutive float rows of one kv head from `src` (which must hold raw too).
  void copy_raw_run(const SlotStore& src, int layer, int from_row, int row, int kv_head, std::int64_t from_slot,
                    std::int64_t to, std::size_t slots);

  int layers_ = 0, kv_heads_ = 0, head_dim_ = 0, batch_ = 0;
  bool holds_raw_ = false;
  Storage raw_storage_ = Storage::float32;
  std::vector<std::uint16_t> half_scratch_;          // a raw row rounded to float16 or bfloat16
  std::vector<std::vector<float>> raw_k_, raw_v_;  // per layer, [row][kv_head][slot][head_dim]; empty unless holds_raw_
  std::vector<LayerFormats> formats_;              // per layer
  std::vector<std::size_t> key_bytes_, value_bytes_;  // per layer, one row of each
  bool plain_float32_ = true;
  bool along_tokens_ = false;                    // some layer's format has scales along the token axis
  std::vector<float> scratch_;                   // head_dim floats for a transform
  std::vector<float> flush_row_;                 // head_dim floats: a row quantized at a flush
  std::vector<float> flush_rows_;                // rows quantized together (scales along the token axis)
  std::int64_t capacity_ = 0;
  std::vector<std::vector<std::byte>> k_, v_;  // per layer
  std::vector<SlotMeta> meta_;             // [row][slot]
};

}  // namespace kvcheck::optimized
