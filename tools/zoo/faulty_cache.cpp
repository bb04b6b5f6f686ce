#include "tools/zoo/faulty_cache.h"

#include <algorithm>

namespace kvcheck::zoo {

using namespace optimized;

namespace {

class FaultyCache : public KvCache {
 public:
  FaultyCache(const CacheConfig& config, Fault fault)
      : config_(config),
        policy_(shared_policy(config)),
        fault_(fault),
        rope_(rope_spec(config, fault)),
        key_rope_(key_rope_spec(config, fault)),
        kernel_(config.threads),
        store_(config.kv_heads, config.head_dim, store_formats(config)) {
    if (fault == Fault::window_off_by_one) ++policy_.window;
    if (fault == Fault::learned_sinks_dropped) config_.sink_logits.clear();
    store_.reset(config_.batch, policy_.window + 1);
    rows_.assign(static_cast<std::size_t>(config_.batch), Row{});
    turned_.resize(static_cast<std::size_t>(config_.head_dim));
  }

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override {
    std::int64_t longest = 0;  // padding_as_positions may count a row's padding too
    for (int b = 0; b < batch(); ++b) longest = std::max(longest, rows_[b].length + chunk.length);
    rope_.cover(longest);
    key_rope_.cover(longest);
    for (int b = 0; b < batch(); ++b) {
      const std::int64_t pad = chunk.length - chunk.counts[b];
      Row& row = rows_[b];
      if (fault_ == Fault::padding_as_positions && row.length == 0) row.length = pad;
      if (row.sinks < 0)
        row.sinks = fault_ == Fault::short_prompt_sinks ? std::min(policy_.sinks, chunk.counts[b]) : policy_.sinks;
      for (std::int64_t i = 0; i < chunk.counts[b]; ++i) token(chunk, out, log, b, pad + i, chunk.counts[b] > 1);
    }
  }

  void reorder(const std::vector<int>& rows) override {
    store_.gather_rows(rows);
    if (fault_ == Fault::reorder_keeps_row_state) {
      rows_.resize(rows.size(), rows_.back());  // lengths and offsets stay where they were
      return;
    }
    rows_ = gather(rows_, rows);
  }

  void reset(int batch) override {
    if (fault_ == Fault::stale_rows_on_resize && batch != this->batch()) {
      std::vector<int> keep;  // "resize" the batch, keeping what the rows held
      for (int b = 0; b < batch; ++b) keep.push_back(b % this->batch());
      store_.gather_rows(keep);
      rows_ = gather(rows_, keep);
      return;
    }
    store_.reset(batch, policy_.window + 1);
    rows_.assign(static_cast<std::size_t>(batch), Row{});
  }

  void crop(std::int64_t length) override {
    for (int b = 0; b < batch(); ++b)
      if (rows_[b].length > length)
        refuse_crop_if_evicted(store_, b, length, policy_.sinks, policy_.window, policy_.evict);
    for (int b = 0; b < batch(); ++b) {
      Row& row = rows_[b];
      if (row.length <= length) continue;
      drop_from(store_, b, length);
      while (row.used > 0 && store_.meta(b, row.used - 1).uid < 0) --row.used;
      row.length = length;
      row.evicted = length == 0 ? 0 : evicted(length - 1);
    }
  }

  const SlotStore& slots() const override { return store_; }
  std::int64_t row_length(int row) const override { return rows_[row].length; }

 private:
  struct Row {
    std::int64_t length = 0, used = 0, evicted = 0;
    std::int64_t sinks = -1;  // decided at the first append
    bool shifted_early = false;
  };

  static RopeSpec rope_spec(const CacheConfig& c, Fault fault) {
    RopeSpec spec = shared_rope(c);
    if (fault == Fault::layout_swapped)
      spec.layout = spec.layout == PairLayout::half ? PairLayout::interleaved : PairLayout::half;
    if (fault == Fault::llama3_as_linear && spec.map == FrequencyMap::llama3) {
      spec.map = FrequencyMap::plain;
      spec.position_divisor = spec.factor;
    }
    if (fault == Fault::partial_rotates_all) spec.rotary_dim = 0;
    return spec;
  }
  // Keys: the same rope, except where the fault leaves them without yarn's magnitude.
  static RopeSpec key_rope_spec(const CacheConfig& c, Fault fault) {
    RopeSpec spec = rope_spec(c, fault);
    if (fault == Fault::yarn_factor_on_q_only) spec.magnitude = 1.0;
    return spec;
  }

  std::int64_t evicted(std::int64_t t) const { return sink_evicted(policy_.window, policy_.evict, t); }

  // The position a key or query is really rotated at (faults may differ from the claim).
  std::int64_t rotation_of(std::int64_t position) const {
    return fault_ == Fault::rope_table_wraps ? position % policy_.window : position;
  }

  void rotate_stored(int b, std::int64_t slot, std::int64_t by) {
    for (int l = 0; l < store_.layers(); ++l)
      for (int g = 0; g < store_.kv_heads(); ++g) {
        store_.read_key(l, b, g, slot, turned_.data());
        if (fault_ == Fault::rerotates_half_keys)
          shift_in_storage_arithmetic(turned_.data(), by);
        else
          key_rope_.shift(turned_.data(), by);
        store_.write_key(l, b, g, slot, turned_.data());  // rounded again in half precision
      }
  }

  // R(by) x the way a model running in half precision computes it: cos and sin taken from
  // a table in the storage format, every product and sum rounded to it (as torch does for
  // bfloat16 tensors). The rounded cos and sin turn the key by a slightly wrong angle, and
  // re-rotating at every shift adds that error up.
  void shift_in_storage_arithmetic(float* x, std::int64_t by) const {
    const Storage st = store_.storage();
    const auto round = [st](float v) {
      std::uint16_t h = 0;
      float out = 0.0f;
      encode(st, &v, 1, &h);
      decode(st, &h, 1, &out);
      return out;
    };
    const std::int64_t p = by < 0 ? -by : by;
    const int pairs = key_rope_.rotary_dim() / 2;
    const bool half = key_rope_.spec().layout == PairLayout::half;
    for (int i = 0; i < pairs; ++i) {
      const float c = round(key_rope_.cos_at(p)[i]), s = round((by < 0 ? -1.0f : 1.0f) * key_rope_.sin_at(p)[i]);
      float& a = x[half ? i : 2 * i];
      float& bb = x[half ? i + pairs : 2 * i + 1];
      const float na = round(round(a * c) - round(bb * s));
      const float nb = round(round(a * s) + round(bb * c));
      a = na;
      bb = nb;
    }
  }

  void shift_to(int b, std::int64_t e) {
    Row& row = rows_[b];
    const std::int64_t d = e - row.evicted;
    if (d <= 0) return;
    const std::int64_t s0 = std::min(row.sinks, row.used);
    for (std::int64_t s = s0 + d; s < row.used; ++s) {
      store_.move_slot(b, s, s - d);
      if (policy_.shift_positions) {
        rotate_stored(b, s - d, -d);
        store_.meta(b, s - d).position -= d;
      }
    }
    if (fault_ != Fault::mask_past_cache)
      for (std::int64_t s = std::max(s0, row.used - d); s < row.used; ++s) store_.clear_slot(b, s);
    row.used = std::max(s0, row.used - d);
    row.evicted = e;
  }

  void token(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log, int b, std::int64_t chunk_pos,
             bool in_long_chunk) {
    Row& row = rows_[b];
    const std::int64_t t = row.length, S = row.sinks;
    const std::int64_t e = evicted(t);
    bool keep = true;
    if (fault_ == Fault::long_prompt_keeps_head && in_long_chunk && e > row.evicted) {
      keep = false;  // full in the middle of a prompt: the cache keeps what it has
    } else {
      if (fault_ == Fault::shift_one_early && policy_.shift_positions && !row.shifted_early &&
          t + 1 >= policy_.window) {
        // The "is it full" test fired one token early: the window is re-rotated without evicting.
        for (std::int64_t s = S; s < row.used; ++s) {
          rotate_stored(b, s, -1);
          store_.meta(b, s).position -= 1;
        }
        row.shifted_early = true;
      }
      shift_to(b, e);
    }
    const bool absolute = !policy_.shift_positions || fault_ == Fault::absolute_positions;
    const std::int64_t query = absolute ? t : t - e;
    // The new key keeps the position the model gave it (t) when the cache forgets to shift it.
    const std::int64_t claimed = fault_ == Fault::new_key_not_shifted ? t : query;
    const std::int64_t slot = row.used;
    SlotMeta meta{chunk.uids[b * chunk.length + chunk_pos], t, claimed};
    store_token(store_, key_rope_, chunk, b, chunk_pos, slot, {meta.uid, t, 0});
    rotate_stored(b, slot, rotation_of(claimed));
    store_.meta(b, slot) = meta;

    const std::int64_t window_begin = (fault_ == Fault::mask_past_cache || !keep) ? 0 : S + e;
    const QueryPlan plan{t, S, window_begin, rotation_of(query), rotation_of(query)};
    const PlannedQuery query_plan[] = {{chunk_pos, plan}};
    const SlotSource sources[] = {{&store_, b}};
    attend_all_layers(config_, kernel_, rope_, chunk, out, b, query_plan, sources, log);
    if (keep)
      ++row.used;
    else
      store_.clear_slot(b, slot);
    row.length = t + 1;
    if (fault_ == Fault::drops_live_token && row.used == policy_.window && row.used - S >= 2) {
      // Evicting right after the forward is allowed for the token the next query no longer
      // sees; this drops the one after it as well, which that query still needs.
      for (std::int64_t s = S + 2; s < row.used; ++s) store_.move_slot(b, s, s - 2);
      store_.clear_slot(b, --row.used);
      store_.clear_slot(b, --row.used);
      row.evicted += 2;
    }
  }

  CacheConfig config_;
  LayerPolicy policy_;  // every layer's (window_off_by_one widens it)
  Fault fault_;
  RopeTable rope_;      // queries
  RopeTable key_rope_;  // keys
  AttentionKernel kernel_;
  SlotStore store_;
  std::vector<Row> rows_;
  std::vector<float> turned_;  // one key being re-rotated
};

}  // namespace

std::unique_ptr<KvCache> make_faulty_cache(const CacheConfig& config, Fault fault) {
  return std::make_unique<FaultyCache>(config, fault);
}

}  // namespace kvcheck::zoo
