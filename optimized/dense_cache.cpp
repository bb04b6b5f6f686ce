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
  std::int64_t longest = 0;  // the largest index a chunk's token gets
  for (int b = 0; b < B; ++b) longest = std::max(longest, lengths_[b] + pruned_[b].count + chunk.counts[b]);
  rope_.cover(longest);
  for (int b = 0; b < B; ++b) {
    const std::int64_t pad = chunk.length - chunk.counts[b];
    plans_.clear();
    if (lengths_[b] == 0 && chunk.counts[b] > 0) frozen_.freeze(b, chunk, rope_);
    for (std::int64_t i = 0; i < chunk.counts[b]; ++i) {
      const std::int64_t slot = lengths_[b] + i, t = slot + pruned_[b].count;
      const std::int64_t position = position_of(b, slot, t);
      store_token(store_, rope_, chunk, b, pad + i, slot, {chunk.uids[b * chunk.length + pad + i], t, position},
                  &frozen_);
      plans_.push_back({pad + i, QueryPlan{t, 0, 0, position, position}});
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
  pruned_ = gather(pruned_, rows);
  frozen_.gather(rows);
}

void DenseCache::reset(int batch) {
  const std::int64_t capacity = growth_ == Growth::fixed ? config_.capacity : kInitialDynamicSlots;
  store_.make_empty(batch, capacity);
  lengths_.assign(static_cast<std::size_t>(batch), 0);
  pruned_.assign(static_cast<std::size_t>(batch), Pruned{});
  frozen_.reset(batch);
}

void DenseCache::free_rows(const std::vector<int>& rows) {
  for (int b : rows) {
    drop_from(store_, b, 0);
    lengths_[b] = 0;
    pruned_[b] = {};
  }
}

// `length` counts the row's tokens, pruned ones included (SPEC 11).
void DenseCache::crop(std::int64_t length) {
  for (int b = 0; b < batch(); ++b) {
    Pruned& p = pruned_[b];
    if (lengths_[b] + p.count <= length) continue;
    drop_from(store_, b, length);
    p.count = std::clamp<std::int64_t>(length - p.first, 0, p.count);  // the gap the cut row still has
    lengths_[b] = std::min(length, p.first) + std::max<std::int64_t>(0, length - p.first - p.count);
  }
}

void DenseCache::prune(std::int64_t sinks, std::int64_t recent, bool rerotate) {
  turned_.resize(static_cast<std::size_t>(config_.head_dim));
  for (int b = 0; b < batch(); ++b) {
    const std::int64_t n = lengths_[b];  // one prune per row: slot = index until now
    const std::int64_t first = std::min(sinks, n), end = std::clamp(n - recent, first, n);
    if (end <= first) continue;
    const std::int64_t d = end - first;
    for (std::int64_t s = end; s < n; ++s) {
      store_.move_slot(b, s, s - d);
      if (!rerotate) continue;
      for (int l = 0; l < store_.layers(); ++l)
        for (int g = 0; g < store_.kv_heads(); ++g) {
          store_.read_key(l, b, g, s - d, turned_.data());
          rope_.shift(turned_.data(), -d);
          store_.write_key(l, b, g, s - d, turned_.data());
        }
      store_.meta(b, s - d).position -= d;
    }
    for (std::int64_t s = n - d; s < n; ++s) store_.clear_slot(b, s);
    lengths_[b] = n - d;
    pruned_[b] = {first, d, rerotate};
  }
}

}  // namespace kvcheck::optimized
