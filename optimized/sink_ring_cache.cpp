#include "optimized/sink_ring_cache.h"

#include <algorithm>

namespace kvcheck::optimized {

SinkRingCache::SinkRingCache(const CacheConfig& config)
    : config_(config),
      policy_(shared_policy(config)),
      rope_(shared_rope(config)),
      kernel_(config.threads),
      store_(config.kv_heads, config.head_dim, store_formats(config)),
      chunk_(config.kv_heads, config.head_dim, store_formats(config)),
      frozen_(config.kv_heads, config.head_dim, store_formats(config)) {
  reset(config.batch);
}

std::int64_t SinkRingCache::slot_of(std::int64_t index) const {
  const std::int64_t S = policy_.sinks;
  return index < S ? index : S + (index - S) % (policy_.window - S);
}

void SinkRingCache::append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) {
  const int B = batch();
  const std::int64_t S = policy_.sinks, W = policy_.window, k = policy_.evict;
  chunk_.make_empty(B, chunk.length);
  cover_chunk(rope_, lengths_, chunk);
  for (int b = 0; b < B; ++b) {
    const std::int64_t pad = chunk.length - chunk.counts[b], first = lengths_[b];
    plans_.clear();
    if (first == 0 && chunk.counts[b] > 0) frozen_.freeze(b, chunk, rope_);
    for (std::int64_t i = 0; i < chunk.counts[b]; ++i) {
      const std::int64_t t = first + i;
      store_token(chunk_, rope_, chunk, b, pad + i, pad + i, {chunk.uids[b * chunk.length + pad + i], t, t}, &frozen_);
      // A dense chunk is one forward over what the cache held before it: E stays E(first).
      const std::int64_t e = sink_evicted(W, k, policy_.dense_prefill ? first : t);
      QueryPlan plan{t, S, S + e, t, policy_.shift_positions ? t - e : t};
      if (policy_.swa > 0) {  // SPEC 10.4: keys within swa positions of the query
        plan.window_begin = std::max(plan.window_begin, t - policy_.swa + 1);  // window keys: Pq - Pk = t - j
        plan.sink_begin = first_sink_seen(t, plan.sink_query_position);
      }
      plans_.push_back({pad + i, plan});
    }
    const SlotSource sources[] = {{&store_, b}, {&chunk_, b}};
    attend_all_layers(config_, kernel_, rope_, chunk, out, b, plans_, sources, log);
    for (std::int64_t i = 0; i < chunk.counts[b]; ++i) store_.copy_slot(chunk_, b, pad + i, b, slot_of(first + i));
    lengths_[b] += chunk.counts[b];
    // Evicting k at a time can leave ring slots behind the window start: empty them.
    const std::int64_t window_begin = S + sink_evicted(W, k, lengths_[b] - 1);
    for (std::int64_t s = S; s < W; ++s)
      if (store_.meta(b, s).uid >= 0 && store_.meta(b, s).index < window_begin) store_.clear_slot(b, s);
  }
}

// A sink j is seen while Pq - j < swa, Pq the query's position against the sinks.
std::int64_t SinkRingCache::first_sink_seen(std::int64_t t, std::int64_t sink_query_position) const {
  (void)t;
  return std::max<std::int64_t>(0, sink_query_position - policy_.swa + 1);
}

void SinkRingCache::reorder(const std::vector<int>& rows) {
  store_.gather_rows(rows);
  lengths_ = gather(lengths_, rows);
  frozen_.gather(rows);
}

void SinkRingCache::reset(int batch) {
  store_.make_empty(batch, policy_.window);
  lengths_.assign(static_cast<std::size_t>(batch), 0);
  frozen_.reset(batch);
}

void SinkRingCache::free_rows(const std::vector<int>& rows) {
  for (int b : rows) {
    drop_from(store_, b, 0);
    lengths_[b] = 0;
  }
}

void SinkRingCache::check_crop(std::int64_t length) const {
  for (int b = 0; b < batch(); ++b)
    if (lengths_[b] > length) refuse_crop_if_evicted(store_, b, length, policy_.sinks, policy_.window, policy_.evict);
}

void SinkRingCache::crop(std::int64_t length) {
  check_crop(length);
  for (int b = 0; b < batch(); ++b) {
    if (lengths_[b] <= length) continue;
    drop_from(store_, b, length);
    lengths_[b] = length;
  }
}

}  // namespace kvcheck::optimized
