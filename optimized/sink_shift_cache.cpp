#include "optimized/sink_shift_cache.h"

#include <algorithm>

namespace kvcheck::optimized {

SinkShiftCache::SinkShiftCache(const CacheConfig& config)
    : config_(config),
      policy_(shared_policy(config)),
      rope_(shared_rope(config)),
      kernel_(config.threads),
      store_(config.kv_heads, config.head_dim, store_formats(config)),
      frozen_(config.kv_heads, config.head_dim, store_formats(config)) {
  turned_.resize(static_cast<std::size_t>(config.head_dim));
  reset(config.batch);
}

void SinkShiftCache::shift_to(const Chunk& chunk, int b, std::int64_t evicted) {
  RowState& row = rows_[b];
  const std::int64_t d = evicted - row.evicted;
  if (d <= 0) return;
  const std::int64_t S = std::min(policy_.sinks, row.length);
  for (std::int64_t s = S + d; s < row.used; ++s) {
    store_.move_slot(b, s, s - d);
    if (policy_.shift_positions) {
      for (int l = 0; l < store_.layers(); ++l)
        for (int g = 0; g < store_.kv_heads(); ++g) {
          // Read, turn back by d, store again: float32 only (catalog), since every shift would
          // round a half-precision key once more.
          store_.read_key(l, b, g, s - d, turned_.data());
          rope_.shift(turned_.data(), -d);
          store_.write_key(l, b, g, s - d, turned_.data());
          if (chunk.key_stored) chunk.key_stored(l, b, g, s - d, store_.meta(b, s - d).position - d);
        }
      store_.meta(b, s - d).position -= d;
    }
  }
  for (std::int64_t s = std::max(S, row.used - d); s < row.used; ++s) store_.clear_slot(b, s);
  row.used = std::max(S, row.used - d);
  row.evicted = evicted;
}

void SinkShiftCache::append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) {
  const std::int64_t S = policy_.sinks, W = policy_.window, k = policy_.evict;
  // A dense chunk holds the cache plus the whole chunk at once.
  std::int64_t need = W;
  for (int b = 0; b < batch(); ++b) need = std::max(need, rows_[b].used + chunk.counts[b]);
  store_.grow(need);
  std::int64_t longest = 0;
  for (int b = 0; b < batch(); ++b) longest = std::max(longest, rows_[b].length + chunk.counts[b]);
  rope_.cover(longest);

  for (int b = 0; b < batch(); ++b) {
    RowState& row = rows_[b];
    const std::int64_t pad = chunk.length - chunk.counts[b], first = row.length;
    const std::int64_t end = first + chunk.counts[b];
    if (first == 0 && chunk.counts[b] > 0) frozen_.freeze(b, chunk, rope_);
    std::int64_t t = first;
    while (t < end) {
      // The group: tokens that see the same E (one dense chunk is a single group).
      const std::int64_t e = sink_evicted(W, k, t);
      std::int64_t group_end = t + 1;
      if (policy_.dense_prefill)
        group_end = end;
      else
        while (group_end < end && sink_evicted(W, k, group_end) == e) ++group_end;
      shift_to(chunk, b, e);

      plans_.clear();
      for (std::int64_t j = t; j < group_end; ++j) {
        const std::int64_t pos = policy_.shift_positions ? j - e : j;
        const std::int64_t chunk_pos = pad + (j - first);
        const std::int64_t slot = row.used++;
        store_token(store_, rope_, chunk, b, chunk_pos, slot, {chunk.uids[b * chunk.length + chunk_pos], j, pos},
                    &frozen_);
        if (chunk.key_stored)
          for (int l = 0; l < store_.layers(); ++l)
            for (int g = 0; g < store_.kv_heads(); ++g) chunk.key_stored(l, b, g, slot, pos);
        plans_.push_back({chunk_pos, QueryPlan{j, S, S + e, pos, pos}});
      }
      row.length = group_end;
      const SlotSource sources[] = {{&store_, b}};
      attend_all_layers(config_, kernel_, rope_, chunk, out, b, plans_, sources, log);
      t = group_end;
    }
    // After a dense forward the cache keeps what the last token would see streaming.
    if (end > 0) shift_to(chunk, b, sink_evicted(W, k, end - 1));
  }
}

void SinkShiftCache::reorder(const std::vector<int>& rows) {
  store_.gather_rows(rows);
  rows_ = gather(rows_, rows);
  frozen_.gather(rows);
}

void SinkShiftCache::reset(int batch) {
  store_.make_empty(batch, policy_.window);
  rows_.assign(static_cast<std::size_t>(batch), RowState{});
  frozen_.reset(batch);
}

void SinkShiftCache::free_rows(const std::vector<int>& rows) {
  for (int b : rows) {
    drop_from(store_, b, 0);
    rows_[b] = RowState{};
  }
}

void SinkShiftCache::check_crop(std::int64_t length) const {
  for (int b = 0; b < batch(); ++b)
    if (rows_[b].length > length)
      refuse_crop_if_evicted(store_, b, length, policy_.sinks, policy_.window, policy_.evict);
}

void SinkShiftCache::crop(std::int64_t length) {
  check_crop(length);
  for (int b = 0; b < batch(); ++b) {
    RowState& row = rows_[b];
    if (row.length <= length) continue;
    drop_from(store_, b, length);
    // Slots are in token order, so the kept ones are a prefix.
    while (row.used > 0 && store_.meta(b, row.used - 1).uid < 0) --row.used;
    row.length = length;
    // Equal to the old E unless the crop went back to the sinks alone.
    row.evicted = length == 0 ? 0 : sink_evicted(policy_.window, policy_.evict, length - 1);
  }
}

}  // namespace kvcheck::optimized
