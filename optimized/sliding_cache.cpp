#include "optimized/sliding_cache.h"

#include <algorithm>

namespace kvcheck::optimized {

SlidingCache::SlidingCache(const CacheConfig& config)
    : config_(config),
      policy_(shared_policy(config)),
      rope_(shared_rope(config)),
      kernel_(config.threads),
      ring_(config.kv_heads, config.head_dim, store_formats(config)),
      chunk_(config.kv_heads, config.head_dim, store_formats(config)),
      frozen_(config.kv_heads, config.head_dim, store_formats(config)) {
  reset(config.batch);
}

void SlidingCache::append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) {
  const int B = batch();
  const std::int64_t W = policy_.window;
  chunk_.make_empty(B, chunk.length);
  cover_chunk(rope_, lengths_, chunk);
  for (int b = 0; b < B; ++b) {
    const std::int64_t pad = chunk.length - chunk.counts[b];
    plans_.clear();
    if (lengths_[b] == 0 && chunk.counts[b] > 0) frozen_.freeze(b, chunk, rope_);
    for (std::int64_t i = 0; i < chunk.counts[b]; ++i) {
      const std::int64_t t = lengths_[b] + i;
      store_token(chunk_, rope_, chunk, b, pad + i, pad + i, {chunk.uids[b * chunk.length + pad + i], t, t}, &frozen_);
      plans_.push_back({pad + i, QueryPlan{t, 0, first_visible(t), t, t}});
    }
    const SlotSource sources[] = {{&ring_, b}, {&chunk_, b}};
    attend_all_layers(config_, kernel_, rope_, chunk, out, b, plans_, sources, log);
    // Only the last W tokens of a long chunk survive; earlier ones would be overwritten.
    for (std::int64_t i = std::max<std::int64_t>(0, chunk.counts[b] - W); i < chunk.counts[b]; ++i)
      ring_.copy_slot(chunk_, b, pad + i, b, (lengths_[b] + i) % W);
    lengths_[b] += chunk.counts[b];
  }
}

std::int64_t SlidingCache::first_visible(std::int64_t t) const {
  const std::int64_t W = policy_.window;
  return policy_.kind == LayerPolicy::Kind::chunked ? t / W * W : t - W + 1;
}


void SlidingCache::reorder(const std::vector<int>& rows) {
  ring_.gather_rows(rows);
  lengths_ = gather(lengths_, rows);
  frozen_.gather(rows);
}

void SlidingCache::reset(int batch) {
  ring_.make_empty(batch, policy_.window);
  lengths_.assign(static_cast<std::size_t>(batch), 0);
  frozen_.reset(batch);
}

// The cropped row's last token needs the window (or chunk) that ends at it.
void SlidingCache::check_crop(std::int64_t length) const {
  for (int b = 0; b < batch(); ++b) {
    if (lengths_[b] <= length || length == 0) continue;
    const std::int64_t missing = first_missing_index(ring_, b, std::max<std::int64_t>(0, first_visible(length - 1)), length);
    if (missing >= 0)
      throw CacheRefusal("crop_evicted", "crop to " + std::to_string(length) + " tokens needs token " +
                                             std::to_string(missing) + " of row " + std::to_string(b) +
                                             ", which this cache has evicted");
  }
}

void SlidingCache::free_rows(const std::vector<int>& rows) {
  for (int b : rows) {
    drop_from(ring_, b, 0);
    lengths_[b] = 0;
  }
}

void SlidingCache::crop(std::int64_t length) {
  check_crop(length);
  for (int b = 0; b < batch(); ++b) {
    if (lengths_[b] <= length) continue;
    drop_from(ring_, b, length);
    lengths_[b] = length;
  }
}

}  // namespace kvcheck::optimized
