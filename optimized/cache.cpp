#include "optimized/cache.h"

#include <algorithm>

namespace kvcheck::optimized {

std::int64_t sink_evicted(std::int64_t window, std::int64_t evict, std::int64_t t) {
  const std::int64_t over = t + 1 - window;
  return over <= 0 ? 0 : evict * ((over + evict - 1) / evict);
}

namespace {

void require_one_per_layer(const CacheConfig& config) {
  if (config.policies.size() != static_cast<std::size_t>(config.layers))
    throw std::invalid_argument("CacheConfig: " + std::to_string(config.policies.size()) + " policies for " +
                                std::to_string(config.layers) + " layers (one per layer)");
}

}  // namespace

const LayerPolicy& layer_policy(const CacheConfig& config, int layer) {
  require_one_per_layer(config);
  return config.policies.at(static_cast<std::size_t>(layer));
}

const LayerPolicy& shared_policy(const CacheConfig& config) {
  require_one_per_layer(config);
  for (const LayerPolicy& p : config.policies)
    if (!(p == config.policies.front()))
      throw std::invalid_argument("CacheConfig: the layers' policies differ; this cache serves one policy");
  return config.policies.front();
}

const RopeSpec& shared_rope(const CacheConfig& config) {
  if (config.ropes.size() != static_cast<std::size_t>(config.layers) || config.ropes.empty())
    throw std::invalid_argument("CacheConfig: expected one rope per layer");
  for (const RopeSpec& r : config.ropes)
    if (!(r == config.ropes.front()))
      throw std::invalid_argument("CacheConfig: the layers' ropes differ; this cache serves one rope");
  return config.ropes.front();
}

std::vector<LayerFormats> store_formats(const CacheConfig& c) {
  std::vector<LayerFormats> out;
  for (int l = 0; l < c.layers; ++l) {
    const LayerQuant none, &q = c.quant.empty() ? none : c.quant.at(static_cast<std::size_t>(l));
    out.push_back({q.key ? *q.key : float_format(c.storage), q.value ? *q.value : float_format(c.storage)});
  }
  return out;
}

void store_token(SlotStore& store, const RopeTable& rope, const Chunk& chunk, int row, std::int64_t chunk_pos,
                 std::int64_t slot, const SlotMeta& meta, const FrozenScales* frozen) {
  const int hkv = store.kv_heads(), d = store.head_dim();
  const std::size_t token = (static_cast<std::size_t>(row) * chunk.length + chunk_pos) * hkv;
  thread_local std::vector<float> k;  // rotated in float32, rounded once when stored
  k.resize(static_cast<std::size_t>(d));
  store.meta(row, slot) = meta;
  store.meta(row, slot).raw = store.holds_raw();  // a new token enters the residual, if there is one
  for (int l = 0; l < store.layers(); ++l)
    for (int g = 0; g < hkv; ++g) {
      std::copy_n(chunk.k[l] + (token + g) * d, d, k.data());
      rope.rotate(k.data(), meta.position);
      store.write_key(l, row, g, slot, k.data(), frozen ? frozen->key(l, row, g) : 0.0f);
      store.write_value(l, row, g, slot, chunk.v[l] + (token + g) * d, frozen ? frozen->value(l, row, g) : 0.0f);
    }
}

void flush_residual(SlotStore& store, int row, const Residual& rule, bool first_append) {
  std::vector<std::pair<std::int64_t, std::int64_t>> raw, written;  // (token index, slot), sorted to oldest first
  for (std::int64_t s = 0; s < store.capacity(); ++s) {
    const SlotMeta& m = store.meta(row, s);
    if (m.uid < 0) continue;
    written.emplace_back(m.index, s);
    if (m.raw) raw.emplace_back(m.index, s);
  }
  std::sort(raw.begin(), raw.end());
  std::sort(written.begin(), written.end());
  const auto slots = [](auto begin, auto end) {
    std::vector<std::int64_t> out;
    for (auto it = begin; it != end; ++it) out.push_back(it->second);
    return out;
  };
  const auto residual = static_cast<std::size_t>(rule.tokens);
  if (first_append && rule.prefill_store) {
    store.quantize_slots(row, slots(raw.begin(), raw.end()));
  } else if (rule.blocks) {
    store.quantize_slots(row, slots(raw.begin(), raw.begin() + static_cast<std::ptrdiff_t>(raw.size() / residual * residual)));
  } else if (!rule.requantize_all) {
    store.quantize_slots(row, slots(raw.begin(), raw.end() - static_cast<std::ptrdiff_t>(std::min(residual, raw.size()))));
  } else if (raw.size() >= residual) {
    store.quantize_slots(row, slots(written.begin(), written.end()));
  }
}

std::int64_t first_missing_index(const SlotStore& store, int row, std::int64_t begin, std::int64_t end) {
  if (begin >= end) return -1;
  std::vector<bool> seen(static_cast<std::size_t>(end - begin), false);
  const SlotMeta* meta = store.row_meta(row);
  for (std::int64_t s = 0; s < store.capacity(); ++s)
    if (meta[s].uid >= 0 && meta[s].index >= begin && meta[s].index < end) seen[meta[s].index - begin] = true;
  const auto missing = std::find(seen.begin(), seen.end(), false);
  return missing == seen.end() ? -1 : begin + (missing - seen.begin());
}

void drop_from(SlotStore& store, int row, std::int64_t length) {
  for (std::int64_t s = 0; s < store.capacity(); ++s)
    if (store.meta(row, s).uid >= 0 && store.meta(row, s).index >= length) store.clear_slot(row, s);
}

void KvCache::prune(std::int64_t sinks, std::int64_t recent, bool rerotate) {
  (void)sinks, (void)recent, (void)rerotate;
  throw std::logic_error("this cache does not implement prune (SPEC 11)");
}

void KvCache::free_rows(const std::vector<int>& rows) {
  (void)rows;
  throw std::logic_error("this cache does not implement free (SPEC 8.7)");
}

void cover_chunk(RopeTable& rope, const std::vector<std::int64_t>& lengths, const Chunk& chunk) {
  std::int64_t longest = 0;
  for (std::size_t b = 0; b < lengths.size(); ++b) longest = std::max(longest, lengths[b] + chunk.counts[b]);
  rope.cover(longest);
}

void attend_all_layers(const CacheConfig& config, AttentionKernel& kernel, const RopeTable& rope, const Chunk& chunk,
                       const std::vector<float*>& out, int row, std::span<const PlannedQuery> plans,
                       std::span<const SlotSource> sources, AttentionLog* log) {
  if (out.empty()) return;  // the chunk only enters the cache
  const KernelShape shape{config.layers,
                          config.heads,
                          config.kv_heads,
                          config.head_dim,
                          config.softmax_scale,
                          config.sink_logits.empty() ? nullptr : &config.sink_logits,
                          config.temperature_floor,
                          config.temperature_scale,
                          config.temperature_layers.empty() ? nullptr : config.temperature_layers.data()};
  const std::size_t per_row = static_cast<std::size_t>(row) * chunk.length * config.heads * config.head_dim;
  kernel.attend(shape, rope, chunk.q, out, per_row, plans, sources, log, row);
}

void refuse_crop_if_evicted(const SlotStore& store, int row, std::int64_t length, std::int64_t sinks,
                            std::int64_t window, std::int64_t evict) {
  if (length == 0) return;
  std::int64_t missing = first_missing_index(store, row, 0, std::min(sinks, length));
  if (missing < 0) missing = first_missing_index(store, row, sinks + sink_evicted(window, evict, length - 1), length);
  if (missing >= 0)
    throw CacheRefusal("crop_evicted", "crop to " + std::to_string(length) + " tokens needs token " +
                                           std::to_string(missing) + " of row " + std::to_string(row) +
                                           ", which this cache has evicted");
}

}  // namespace kvcheck::optimized
