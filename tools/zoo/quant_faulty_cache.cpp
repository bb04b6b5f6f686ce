#include "tools/zoo/quant_faulty_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "optimized/dense_cache.h"
#include "optimized/half.h"
#include "optimized/paged_cache.h"
#include "optimized/row_codec.h"

namespace kvcheck::zoo {

using namespace optimized;

namespace {

class QuantFaultyCache : public KvCache {
 public:
  QuantFaultyCache(const CacheConfig& config, QuantFault fault, std::unique_ptr<KvCache> inner)
      : config_(config), fault_(fault), inner_(std::move(inner)), rope_(shared_rope(config)), kernel_(config.threads) {}

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override {
    std::map<std::pair<int, std::int64_t>, Snapshot> before;
    if (fault_ == QuantFault::shift_skips_quantized) before = snapshot();
    inner_->append(chunk, out, log);
    if (fault_ == QuantFault::shift_skips_quantized) restore_shifted(before);
    if (fault_ == QuantFault::scale_frozen_on_first) freeze_scales(chunk);
    if (read_side() && !out.empty()) attend_as_read_wrongly(chunk, out);
    if (fault_ == QuantFault::decode_tile_rounding && chunk.length == 1 && !out.empty()) attend_in_tiles(chunk, out);
  }
  void reorder(const std::vector<int>& rows) override {
    if (fault_ != QuantFault::reorder_residual_only) return inner_->reorder(rows);
    // Each row keeps its own quantized tokens; only the residual follows the reorder.
    const auto quantized = quantized_slots([](const SlotMeta&) { return true; });
    inner_->reorder(rows);
    SlotStore& s = store();
    for (int b = 0; b < s.batch(); ++b)
      for (std::int64_t slot = 0; slot < s.capacity(); ++slot)
        if (!s.meta(b, slot).raw) s.clear_slot(b, slot);
    put_back(quantized);
  }
  void reset(int batch) override { inner_->reset(batch); }
  void crop(std::int64_t length) override {
    if (fault_ != QuantFault::reorder_residual_only) return inner_->crop(length);
    // Quantized tokens past the crop stay.
    const auto beyond = quantized_slots([length](const SlotMeta& m) { return m.index >= length; });
    inner_->crop(length);
    put_back(beyond);
  }
  void check_crop(std::int64_t length) const override { inner_->check_crop(length); }
  void free_rows(const std::vector<int>& rows) override { inner_->free_rows(rows); }
  void evict(std::int64_t blocks) override { inner_->evict(blocks); }
  void preempt(const std::vector<int>& rows, bool recompute) override { inner_->preempt(rows, recompute); }
  void resume(const std::vector<int>& rows, const Chunk* history) override {
    inner_->resume(rows, history);
    if (fault_ == QuantFault::transform_missing_on_restore && history == nullptr) restore_untransformed(rows);
  }
  const SlotStore& slots() const override { return inner_->slots(); }
  const SlotStore& layer_slots(int layer) const override { return inner_->layer_slots(layer); }
  std::int64_t row_length(int row) const override { return inner_->row_length(row); }
  int batch() const override { return inner_->batch(); }
  const PagedState* paged() const override { return inner_->paged(); }

 private:
  struct Snapshot {
    std::int64_t position;
    std::vector<std::vector<std::byte>> keys;  // [layer * Hkv + head]
  };

  // A quantized slot as stored: where, its metadata and every layer's and head's bytes.
  struct StoredSlot {
    int row;
    std::int64_t slot;
    SlotMeta meta;
    std::vector<std::vector<std::byte>> keys, values;  // [layer * Hkv + head]
  };
  template <class Pick>
  std::vector<StoredSlot> quantized_slots(Pick pick) const {
    std::vector<StoredSlot> out;
    const SlotStore& s = inner_->slots();
    for (int b = 0; b < s.batch(); ++b)
      for (std::int64_t slot = 0; slot < s.capacity(); ++slot) {
        const SlotMeta& m = s.meta(b, slot);
        if (m.uid < 0 || m.raw || !pick(m)) continue;
        StoredSlot& x = out.emplace_back(StoredSlot{b, slot, m, {}, {}});
        for (int l = 0; l < s.layers(); ++l)
          for (int g = 0; g < s.kv_heads(); ++g) {
            const auto* k = static_cast<const std::byte*>(s.key(l, b, g, slot));
            const auto* v = static_cast<const std::byte*>(s.value(l, b, g, slot));
            x.keys.emplace_back(k, k + key_bytes(l));
            x.values.emplace_back(v, v + row_bytes(s.value_format(l), config_.head_dim));
          }
      }
    return out;
  }
  void put_back(const std::vector<StoredSlot>& slots) {
    SlotStore& s = store();
    for (const StoredSlot& x : slots) {
      if (x.row >= s.batch() || x.slot >= s.capacity()) continue;
      for (int l = 0; l < s.layers(); ++l)
        for (int g = 0; g < s.kv_heads(); ++g) {
          const std::size_t at = static_cast<std::size_t>(l * s.kv_heads() + g);
          std::memcpy(const_cast<void*>(s.key(l, x.row, g, x.slot)), x.keys[at].data(), x.keys[at].size());
          std::memcpy(const_cast<void*>(s.value(l, x.row, g, x.slot)), x.values[at].data(), x.values[at].size());
        }
      s.meta(x.row, x.slot) = x.meta;
    }
  }

  bool read_side() const {
    return fault_ == QuantFault::scale_dropped_on_read || fault_ == QuantFault::v_with_k_scales ||
           fault_ == QuantFault::q4_nibble_order;
  }
  // The inner cache's store, written behind its back: that is the bug.
  SlotStore& store() { return const_cast<SlotStore&>(inner_->slots()); }
  std::size_t key_bytes(int layer) const { return row_bytes(inner_->slots().key_format(layer), config_.head_dim); }

  std::map<std::pair<int, std::int64_t>, Snapshot> snapshot() const {
    std::map<std::pair<int, std::int64_t>, Snapshot> out;
    const SlotStore& s = inner_->slots();
    for (int b = 0; b < s.batch(); ++b)
      for (std::int64_t slot = 0; slot < s.capacity(); ++slot) {
        const SlotMeta& m = s.meta(b, slot);
        if (m.uid < 0) continue;
        Snapshot& snap = out[{b, m.uid}];
        snap.position = m.position;
        for (int l = 0; l < s.layers(); ++l)
          for (int g = 0; g < s.kv_heads(); ++g) {
            const auto* k = static_cast<const std::byte*>(s.key(l, b, g, slot));
            snap.keys.emplace_back(k, k + key_bytes(l));
          }
      }
    return out;
  }

  // A shifted key gets its old codes back: its slot and position moved, its rotation did not.
  void restore_shifted(const std::map<std::pair<int, std::int64_t>, Snapshot>& before) {
    SlotStore& s = store();
    for (int b = 0; b < s.batch(); ++b)
      for (std::int64_t slot = 0; slot < s.capacity(); ++slot) {
        const SlotMeta& m = s.meta(b, slot);
        const auto found = before.find({b, m.uid});
        if (m.uid < 0 || found == before.end() || found->second.position == m.position) continue;
        for (int l = 0; l < s.layers(); ++l)
          for (int g = 0; g < s.kv_heads(); ++g)
            std::memcpy(const_cast<void*>(s.key(l, b, g, slot)), found->second.keys[l * s.kv_heads() + g].data(),
                        key_bytes(l));
      }
  }

  // Every key written by this append re-encoded with the scale its kv head had at the first
  // append (one [scale][codes] group per row: the token granularity's layout).
  void freeze_scales(const Chunk& chunk) {
    SlotStore& s = store();
    const int D = config_.head_dim;
    std::vector<float> row(static_cast<std::size_t>(D)), scratch(row.size());
    for (int b = 0; b < s.batch(); ++b)
      for (std::int64_t slot = 0; slot < s.capacity(); ++slot) {
        const SlotMeta& m = s.meta(b, slot);
        if (m.uid < 0 || m.index < inner_->row_length(b) - chunk.counts[b]) continue;  // not new
        for (int l = 0; l < s.layers(); ++l)
          for (int g = 0; g < s.kv_heads(); ++g) {
            auto* bytes = static_cast<std::byte*>(const_cast<void*>(s.key(l, b, g, slot)));
            float scale = 0.0f;
            std::memcpy(&scale, bytes, sizeof scale);
            const auto key = std::make_pair(l, g);
            if (!frozen_.count(key)) frozen_[key] = scale;  // the first append's, kept from now on
            s.read_key(l, b, g, slot, row.data());
            RowFormat fixed = s.key_format(l);
            fixed.static_scales = {frozen_[key]};
            encode_row(fixed, g, row.data(), D, bytes + sizeof scale, scratch.data());
            std::memcpy(bytes, &frozen_[key], sizeof scale);
          }
      }
  }

  // One stored row read the faulty way.
  void read_wrongly(const SlotStore& s, bool value, int l, int b, int g, std::int64_t slot, float* x) const {
    const RowFormat& f = value ? s.value_format(l) : s.key_format(l);
    const int D = config_.head_dim;
    const auto* bytes = static_cast<const std::byte*>(value ? s.value(l, b, g, slot) : s.key(l, b, g, slot));
    if (fault_ == QuantFault::scale_dropped_on_read && is_quantized(f.codec)) {
      RowFormat unit = f;
      for (float& scale : unit.static_scales) scale = 1.0f;
      return decode_row(unit, g, bytes, D, x);
    }
    if (fault_ == QuantFault::v_with_k_scales && value && f.codec == Codec::q8_0) {
      // Each 34-byte block of V with the 2-byte scale of K's block in its place.
      std::vector<std::byte> mixed(bytes, bytes + row_bytes(f, D));
      const auto* k = static_cast<const std::byte*>(s.key(l, b, g, slot));
      for (int block = 0; block < D / 32; ++block) std::memcpy(mixed.data() + block * 34, k + block * 34, 2);
      return decode_row(f, g, mixed.data(), D, x);
    }
    if (fault_ == QuantFault::q4_nibble_order && f.codec == Codec::q4_0) {
      const UnpackedRow u = unpack_row(f, g, bytes, D);
      for (int block = 0; block < D / 32; ++block)
        for (int j = 0; j < 16; ++j) {  // byte j: element j (low) and j + 16 (high), read as 2j and 2j + 1
          x[block * 32 + 2 * j] = static_cast<float>(u.codes[block * 32 + j] - 8) * u.scales[block];
          x[block * 32 + 2 * j + 1] = static_cast<float>(u.codes[block * 32 + j + 16] - 8) * u.scales[block];
        }
      return;
    }
    (value ? s.read_value(l, b, g, slot, x) : s.read_key(l, b, g, slot, x));
  }

  // The chunk's outputs again, over the stored rows as the faulty reader sees them.
  void attend_as_read_wrongly(const Chunk& chunk, const std::vector<float*>& out) {
    const SlotStore& s = inner_->slots();
    read_ = SlotStore(s.layers(), s.kv_heads(), s.head_dim(), Storage::float32);
    read_.reset(s.batch(), s.capacity());
    std::vector<float> row(static_cast<std::size_t>(config_.head_dim));
    std::int64_t longest = 0;
    for (int b = 0; b < s.batch(); ++b) {
      longest = std::max(longest, inner_->row_length(b));
      for (std::int64_t slot = 0; slot < s.capacity(); ++slot) {
        if (s.meta(b, slot).uid < 0) continue;
        read_.meta(b, slot) = s.meta(b, slot);
        for (int l = 0; l < s.layers(); ++l)
          for (int g = 0; g < s.kv_heads(); ++g) {
            read_wrongly(s, false, l, b, g, slot, row.data());
            read_.write_key(l, b, g, slot, row.data());
            read_wrongly(s, true, l, b, g, slot, row.data());
            read_.write_value(l, b, g, slot, row.data());
          }
      }
    }
    rope_.cover(longest);
    for (int b = 0; b < s.batch(); ++b) {
      const std::int64_t pad = chunk.length - chunk.counts[b], first = inner_->row_length(b) - chunk.counts[b];
      std::vector<PlannedQuery> plans;
      for (std::int64_t i = 0; i < chunk.counts[b]; ++i) {
        const std::int64_t t = first + i;
        const std::int64_t W = shared_policy(config_).window;
        const std::int64_t begin = W > 0 ? std::max<std::int64_t>(0, t - W + 1) : 0;
        plans.push_back({pad + i, QueryPlan{t, 0, begin, t, t}});
      }
      const SlotSource sources[] = {{&read_, b}};
      attend_all_layers(config_, kernel_, rope_, chunk, out, b, plans, sources, nullptr);
    }
  }

  // The rows just swapped back in, as a restore path that stages them in float and
  // quantizes them again forgetting the transform the write path applies: each key and
  // value of the rows' own blocks re-encoded with the format minus its Hadamard.
  void restore_untransformed(const std::vector<int>& rows) {
    const PagedState* paged = inner_->paged();
    if (paged == nullptr) return;
    const int D = config_.head_dim;
    std::vector<float> x(static_cast<std::size_t>(D)), scratch(x.size());
    for (const PagedState::Layer& layer : paged->layers) {
      auto& pool = const_cast<SlotStore&>(*layer.pool);
      RowFormat key_plain = pool.key_format(0), value_plain = pool.value_format(0);
      key_plain.hadamard = value_plain.hadamard = false;
      for (const int b : rows)
        for (const std::int64_t block : layer.tables[static_cast<std::size_t>(b)]) {
          if (block < 0 || layer.refcounts[static_cast<std::size_t>(block)] != 1) continue;  // its own blocks only
          for (std::int64_t slot = block * paged->block_size; slot < (block + 1) * paged->block_size; ++slot) {
            if (pool.meta(0, slot).uid < 0) continue;
            for (int g = 0; g < pool.kv_heads(); ++g) {
              pool.read_key(0, 0, g, slot, x.data());
              encode_row(key_plain, g, x.data(), D, static_cast<std::byte*>(const_cast<void*>(pool.key(0, 0, g, slot))),
                         scratch.data());
              pool.read_value(0, 0, g, slot, x.data());
              encode_row(value_plain, g, x.data(), D,
                         static_cast<std::byte*>(const_cast<void*>(pool.value(0, 0, g, slot))), scratch.data());
            }
          }
        }
    }
  }

  // A decode's outputs again, the way a decode kernel with tiles of 96 keys computes them:
  // an online softmax whose running output is held in bfloat16 from one tile to the next.
  // Up to 96 keys it is one float32 pass, as a chunk's; from the 97th key on it drifts.
  void attend_in_tiles(const Chunk& chunk, const std::vector<float*>& out) {
    constexpr std::size_t tile = 96;
    const SlotStore& s = inner_->slots();
    const int H = config_.heads, D = config_.head_dim, group = config_.heads / config_.kv_heads;
    std::vector<float> q(static_cast<std::size_t>(D)), k(q.size()), v(q.size()), acc(q.size()), scores;
    for (int b = 0; b < s.batch(); ++b) {
      if (chunk.counts[b] == 0) continue;
      const std::int64_t t = inner_->row_length(b) - 1;  // the query; full attention: its position too
      rope_.cover(t + 1);
      std::vector<std::int64_t> slots;  // every held token, by token index
      for (std::int64_t slot = 0; slot < s.capacity(); ++slot)
        if (s.meta(b, slot).uid >= 0 && s.meta(b, slot).index <= t) slots.push_back(slot);
      std::sort(slots.begin(), slots.end(),
                [&](std::int64_t x, std::int64_t y) { return s.meta(b, x).index < s.meta(b, y).index; });
      for (int l = 0; l < s.layers(); ++l)
        for (int h = 0; h < H; ++h) {
          const std::size_t at = (static_cast<std::size_t>(b) * H + h) * D;
          std::copy(chunk.q[l] + at, chunk.q[l] + at + D, q.begin());
          rope_.rotate(q.data(), t);
          float running_max = -std::numeric_limits<float>::infinity(), sum = 0.0f;
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (std::size_t begin = 0; begin < slots.size(); begin += tile) {
            const std::size_t end = std::min(slots.size(), begin + tile);
            scores.assign(end - begin, 0.0f);
            float tile_max = running_max;
            for (std::size_t j = begin; j < end; ++j) {
              s.read_key(l, b, h / group, slots[j], k.data());
              float dot = 0.0f;
              for (int d = 0; d < D; ++d) dot += q[d] * k[d];
              scores[j - begin] = dot * config_.softmax_scale;
              tile_max = std::max(tile_max, scores[j - begin]);
            }
            const float rescale = std::exp(running_max - tile_max);
            sum *= rescale;
            for (float& a : acc) a *= rescale;
            for (std::size_t j = begin; j < end; ++j) {
              const float w = std::exp(scores[j - begin] - tile_max);
              sum += w;
              s.read_value(l, b, h / group, slots[j], v.data());
              for (int d = 0; d < D; ++d) acc[d] += w * v[d];
            }
            running_max = tile_max;
            if (end < slots.size())  // the bug: the tile's partial output leaves the registers in bfloat16
              for (float& a : acc) a = from_bfloat16(to_bfloat16(a));
          }
          for (int d = 0; d < D; ++d) out[l][at + d] = acc[d] / sum;
        }
    }
  }

  CacheConfig config_;
  QuantFault fault_;
  std::unique_ptr<KvCache> inner_;
  RopeTable rope_;
  AttentionKernel kernel_;
  SlotStore read_;                          // read-side faults: what the attention reads
  std::map<std::pair<int, int>, float> frozen_;  // (layer, kv head) -> the first append's scale
};

}  // namespace

std::unique_ptr<KvCache> make_quant_faulty_cache(const CacheConfig& config, QuantFault fault,
                                                 std::unique_ptr<KvCache> inner) {
  if (fault == QuantFault::prefill_skips_residual) {
    // Planted in the configuration: the real cache told the other prefill rule.
    CacheConfig flipped = config;
    if (flipped.residual) flipped.residual->prefill_store = !flipped.residual->prefill_store;
    return std::make_unique<DenseCache>(flipped, DenseCache::Growth::dynamic);
  }
  return std::make_unique<QuantFaultyCache>(config, fault, std::move(inner));
}

}  // namespace kvcheck::zoo
