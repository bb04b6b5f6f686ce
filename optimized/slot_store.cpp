#include "optimized/slot_store.h"

#include <algorithm>
#include <bit>
#include <stdexcept>

namespace kvcheck::optimized {

SlotStore::SlotStore(int layers, int kv_heads, int head_dim, Storage storage)
    : SlotStore(
          kv_heads, head_dim,
          std::vector<LayerFormats>(static_cast<std::size_t>(layers), {float_format(storage), float_format(storage)})) {
}

SlotStore::SlotStore(int kv_heads, int head_dim, std::vector<LayerFormats> formats)
    : layers_(static_cast<int>(formats.size())),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      formats_(std::move(formats)),
      scratch_(static_cast<std::size_t>(head_dim)),
      k_(formats_.size()),
      v_(formats_.size()) {
  for (const LayerFormats& f : formats_) {
    key_bytes_.push_back(row_bytes(f.key, head_dim));
    value_bytes_.push_back(row_bytes(f.value, head_dim));
    plain_float32_ = plain_float32_ && f.key.codec == Codec::float32 && f.value.codec == Codec::float32;
    along_tokens_ = along_tokens_ || f.key.along_tokens || f.value.along_tokens;
  }
}

void SlotStore::hold_raw(Storage storage) {
  holds_raw_ = true;
  raw_storage_ = storage;
  raw_k_.assign(static_cast<std::size_t>(layers_), {});
  raw_v_.assign(static_cast<std::size_t>(layers_), {});
}

void SlotStore::write_raw(std::vector<std::vector<float>>& data, int layer, int row, int kv_head, std::int64_t slot,
                          const float* x) {
  float* out = data[static_cast<std::size_t>(layer)].data() + raw_at(row, kv_head, slot);
  if (raw_storage_ == Storage::float32) {
    std::copy_n(x, head_dim_, out);
    return;
  }
  // Rounded to the float storage, kept as float32 (the bytes a half cache would hold).
  half_scratch_.resize(static_cast<std::size_t>(head_dim_));
  encode(raw_storage_, x, head_dim_, half_scratch_.data());
  decode(raw_storage_, half_scratch_.data(), head_dim_, out);
}

void SlotStore::read_raw(const std::vector<std::vector<float>>& data, int layer, int row, int kv_head,
                         std::int64_t slot, float* x) const {
  std::copy_n(data[static_cast<std::size_t>(layer)].data() + raw_at(row, kv_head, slot), head_dim_, x);
}

void SlotStore::quantize_slot(int row, std::int64_t slot) {
  std::vector<float>& x = flush_row_;
  x.resize(static_cast<std::size_t>(head_dim_));  // allocates once
  for (int l = 0; l < layers_; ++l)
    for (int g = 0; g < kv_heads_; ++g) {
      // From the values it is held as: its float row while raw, what its codes stand for after.
      read_key(l, row, g, slot, x.data());
      encode_row(key_format(l), g, x.data(), head_dim_, at(k_, l, row, g, slot), scratch_.data());
      read_value(l, row, g, slot, x.data());
      encode_row(value_format(l), g, x.data(), head_dim_, at(v_, l, row, g, slot), scratch_.data());
    }
  meta(row, slot).raw = false;
}

void SlotStore::quantize_slots(int row, const std::vector<std::int64_t>& slots) {
  if (!along_tokens_) {
    for (std::int64_t s : slots) quantize_slot(row, s);
    return;
  }
  const std::size_t n = slots.size(), d = static_cast<std::size_t>(head_dim_);
  flush_rows_.resize(n * d);
  std::vector<const float*> rows(n);
  std::vector<std::byte*> out(n);
  for (std::size_t t = 0; t < n; ++t) rows[t] = flush_rows_.data() + t * d;
  for (int l = 0; l < layers_; ++l)
    for (int g = 0; g < kv_heads_; ++g)
      for (const bool value : {false, true}) {
        const RowFormat& format = value ? value_format(l) : key_format(l);
        auto& data = value ? v_ : k_;
        // From the values each is held as: its float row while raw, what its codes stand for after.
        for (std::size_t t = 0; t < n; ++t) {
          float* x = flush_rows_.data() + t * d;
          value ? read_value(l, row, g, slots[t], x) : read_key(l, row, g, slots[t], x);
          out[t] = at(data, l, row, g, slots[t]);
          if (!format.along_tokens) encode_row(format, g, x, head_dim_, out[t], scratch_.data());
        }
        if (format.along_tokens)
          encode_rows_along_tokens(format, rows.data(), static_cast<int>(n), head_dim_, out.data());
      }
  for (std::int64_t s : slots) meta(row, s).raw = false;
}

void SlotStore::reset(int batch, std::int64_t capacity) {
  batch_ = batch;
  capacity_ = capacity;
  const std::size_t rows = static_cast<std::size_t>(batch) * kv_heads_ * capacity;
  for (int l = 0; l < layers_; ++l) {
    k_[l].assign(rows * key_bytes_[l], std::byte{0});
    v_[l].assign(rows * value_bytes_[l], std::byte{0});
    if (holds_raw_) {
      raw_k_[l].assign(rows * head_dim_, 0.0f);
      raw_v_[l].assign(rows * head_dim_, 0.0f);
    }
  }
  meta_.assign(static_cast<std::size_t>(batch) * capacity, SlotMeta{});
}

void SlotStore::make_empty(int batch, std::int64_t capacity) {
  if (batch == batch_ && capacity == capacity_)
    meta_.assign(meta_.size(), SlotMeta{});
  else
    reset(batch, capacity);
}

void SlotStore::grow(std::int64_t capacity) {
  if (capacity <= capacity_) return;
  SlotStore bigger(kv_heads_, head_dim_, formats_);
  if (holds_raw_) bigger.hold_raw(raw_storage_);
  bigger.reset(batch_, capacity);
  const std::size_t slots = static_cast<std::size_t>(capacity_);
  for (int l = 0; l < layers_; ++l)
    for (int b = 0; b < batch_; ++b)
      for (int g = 0; g < kv_heads_; ++g) {
        std::copy_n(at(k_, l, b, g, 0), slots * key_bytes_[l], bigger.at(bigger.k_, l, b, g, 0));
        std::copy_n(at(v_, l, b, g, 0), slots * value_bytes_[l], bigger.at(bigger.v_, l, b, g, 0));
        bigger.copy_raw_run(*this, l, b, b, g, 0, 0, slots);
      }
  for (int b = 0; b < batch_; ++b) std::copy_n(row_meta(b), capacity_, &bigger.meta(b, 0));
  *this = std::move(bigger);
}

void SlotStore::gather_rows(const std::vector<int>& rows) {
  SlotStore next(kv_heads_, head_dim_, formats_);
  if (holds_raw_) next.hold_raw(raw_storage_);
  next.reset(static_cast<int>(rows.size()), capacity_);
  const std::size_t slots = static_cast<std::size_t>(capacity_);
  for (std::size_t b = 0; b < rows.size(); ++b) {
    for (int l = 0; l < layers_; ++l)
      for (int g = 0; g < kv_heads_; ++g) {
        std::copy_n(at(k_, l, rows[b], g, 0), slots * key_bytes_[l], next.at(next.k_, l, static_cast<int>(b), g, 0));
        std::copy_n(at(v_, l, rows[b], g, 0), slots * value_bytes_[l], next.at(next.v_, l, static_cast<int>(b), g, 0));
        next.copy_raw_run(*this, l, rows[b], static_cast<int>(b), g, 0, 0, slots);
      }
    std::copy_n(row_meta(rows[b]), capacity_, &next.meta(static_cast<int>(b), 0));
  }
  *this = std::move(next);
}

void SlotStore::copy_slot(const SlotStore& src, int from_row, std::int64_t from_slot, int row, std::int64_t to) {
  // Raw bytes: both stores must hold the same format and shape (a cache makes its stores alike).
  if (!(src.formats_ == formats_) || src.head_dim_ != head_dim_ || src.kv_heads_ != kv_heads_ ||
      src.holds_raw_ != holds_raw_)
    throw std::logic_error("copy_slot between stores of different formats or shapes");
  for (int l = 0; l < layers_; ++l)
    for (int g = 0; g < kv_heads_; ++g) {
      std::copy_n(static_cast<const std::byte*>(src.key(l, from_row, g, from_slot)), key_bytes_[l],
                  at(k_, l, row, g, to));
      std::copy_n(static_cast<const std::byte*>(src.value(l, from_row, g, from_slot)), value_bytes_[l],
                  at(v_, l, row, g, to));
      copy_raw_run(src, l, from_row, row, g, from_slot, to, 1);
    }
  meta(row, to) = src.meta(from_row, from_slot);
}

void SlotStore::poison_slot(int row, std::int64_t slot, std::uint32_t nan_bits) {
  for (int l = 0; l < layers_; ++l)
    for (int g = 0; g < kv_heads_; ++g) {
      poison_row(key_format(l), head_dim_, at(k_, l, row, g, slot), nan_bits);
      poison_row(value_format(l), head_dim_, at(v_, l, row, g, slot), nan_bits);
      if (holds_raw_) {
        const auto l_at = static_cast<std::size_t>(l);
        std::fill_n(raw_k_[l_at].begin() + static_cast<std::ptrdiff_t>(raw_at(row, g, slot)), head_dim_,
                    std::bit_cast<float>(nan_bits));
        std::fill_n(raw_v_[l_at].begin() + static_cast<std::ptrdiff_t>(raw_at(row, g, slot)), head_dim_,
                    std::bit_cast<float>(nan_bits));
      }
    }
  clear_slot(row, slot);
}

void SlotStore::move_slot(int row, std::int64_t from, std::int64_t to) {
  for (int l = 0; l < layers_; ++l)
    for (int g = 0; g < kv_heads_; ++g) {
      std::copy_n(at(k_, l, row, g, from), key_bytes_[l], at(k_, l, row, g, to));
      std::copy_n(at(v_, l, row, g, from), value_bytes_[l], at(v_, l, row, g, to));
      copy_raw_run(*this, l, row, row, g, from, to, 1);
    }
  meta(row, to) = meta(row, from);
}

void SlotStore::copy_raw_run(const SlotStore& src, int layer, int from_row, int row, int kv_head,
                             std::int64_t from_slot, std::int64_t to, std::size_t slots) {
  if (!holds_raw_) return;
  const auto l = static_cast<std::size_t>(layer);
  const std::size_t n = slots * head_dim_;
  std::copy_n(src.raw_k_[l].data() + src.raw_at(from_row, kv_head, from_slot), n,
              raw_k_[l].data() + raw_at(row, kv_head, to));
  std::copy_n(src.raw_v_[l].data() + src.raw_at(from_row, kv_head, from_slot), n,
              raw_v_[l].data() + raw_at(row, kv_head, to));
}

}  // namespace kvcheck::optimized
