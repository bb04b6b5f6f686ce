#include "optimized/dense_cache.h"

#include <algorithm>

namespace kvcheck::optimized {

namespace {
constexpr std::int64_t kInitialDynamicSlots = 16;
}

DenseCache::DenseCache(const CacheConfig& config, Growth growth)
    : config_(config),
      growth_(growth),
      rope_(shared_rope(config)),
      kernel_(config.threads),
      store_(config.kv_heads, config.head_dim, store_formats(config)),
      frozen_(config.kv_heads, config.head_dim, store_formats(config)) {
  if (config.residual) store_.hold_raw(config.storage);
  reset(config.batch);
}

void DenseCache::append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) {
  const int B = batch();
  std::int64_t need = 0;
  for (int b = 0; b < B; ++b) need = std::max(need, lengths_[b] + chunk.counts[b]);
  if (need > store_.capacity()) {
    if (growth_ == Growth::fixed)
      throw CacheRefusal("capacity_exceeded", "static cache of " + std::to_string(store_.capacity()) +
                                                  " slots per row cannot hold " + std::to_string(need) + " tokens");
    store_.grow(std::max(need, 2 * store_.capacity()));
  }
  cover_chunk(rope_, lengths_, chunk);
  for (int b = 0; b < B; ++b) {
    const std::int64_t pad = chunk.length - chunk.counts[b];
    plans_.clear();
    if (lengths_[b] == 0 && chunk.counts[b] > 0) frozen_.freeze(b, chunk, rope_);
    for (std::int64_t i = 0; i < chunk.counts[b]; ++i) {
      const std::int64_t t = lengths_[b] + i;
      store_token(store_, rope_, chunk, b, pad + i, t, {chunk.uids[b * chunk.length + pad + i], t, t}, &frozen_);
      plans_.push_back({pad + i, QueryPlan{t, 0, 0, t, t}});
    }
    const bool first_append = lengths_[b] == 0;
    const Residual* residual = config_.residual ? &*config_.residual : nullptr;
    if (residual && !residual->chunk_reads_raw && chunk.counts[b] > 0)
      flush_residual(store_, b, *residual, first_append);
    const SlotSource sources[] = {{&store_, b}};
    attend_all_layers(config_, kernel_, rope_, chunk, out, b, plans_, sources, log);
    if (residual && residual->chunk_reads_raw && chunk.counts[b] > 0) flush_residual(store_, b, *residual, first_append);
    lengths_[b] += chunk.counts[b];
  }
}

void DenseCache::reorder(const std::vector<int>& rows) {
  store_.gather_rows(rows);
  lengths_ = gather(lengths_, rows);
  frozen_.gather(rows);
}

void DenseCache::reset(int batch) {
  const std::int64_t capacity = growth_ == Growth::fixed ? config_.capacity : kInitialDynamicSlots;
  store_.make_empty(batch, capacity);
  lengths_.assign(static_cast<std::size_t>(batch), 0);
  frozen_.reset(batch);
}

void DenseCache::free_rows(const std::vector<int>& rows) {
  for (int b : rows) {
    drop_from(store_, b, 0);
    lengths_[b] = 0;
  }
}

void DenseCache::crop(std::int64_t length) {
  for (int b = 0; b < batch(); ++b) {
    if (lengths_[b] <= length) continue;
    drop_from(store_, b, length);
    lengths_[b] = length;
  }
}

}  // namespace kvcheck::optimized
