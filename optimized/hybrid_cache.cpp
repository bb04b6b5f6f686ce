#include "optimized/hybrid_cache.h"

#include <stdexcept>

#include "optimized/dense_cache.h"
#include "optimized/sink_ring_cache.h"
#include "optimized/sliding_cache.h"

namespace kvcheck::optimized {

HybridCache::HybridCache(const CacheConfig& config, const MakeLayer& make_sink) : layer_out_(1) {
  for (int l = 0; l < config.layers; ++l) {
    const LayerPolicy& p = layer_policy(config, l);
    full_.push_back(p.kind == LayerPolicy::Kind::full);
    CacheConfig one = config;
    one.layers = 1;
    // Each layer's cache would start its own worker pool: L pools of idle threads for a deep
    // stack. The layers run one after another, each on one thread.
    one.threads = 1;
    one.policies = {p};
    one.ropes = {config.ropes.at(static_cast<std::size_t>(l))};
    if (!config.temperature_layers.empty()) one.temperature_layers = {config.temperature_layers[static_cast<std::size_t>(l)]};
    one.sink_logits.clear();
    if (!config.sink_logits.empty()) one.sink_logits.push_back(config.sink_logits[static_cast<std::size_t>(l)]);
    one.quant.clear();
    if (!config.quant.empty()) one.quant.push_back(config.quant[static_cast<std::size_t>(l)]);
    switch (p.kind) {
      case LayerPolicy::Kind::full:
        layers_.push_back(std::make_unique<DenseCache>(one, DenseCache::Growth::dynamic));
        break;
      case LayerPolicy::Kind::sliding:
      case LayerPolicy::Kind::chunked:
        layers_.push_back(std::make_unique<SlidingCache>(one));
        break;
      case LayerPolicy::Kind::sink:
        layers_.push_back(make_sink ? make_sink(one) : std::make_unique<SinkRingCache>(one));
        break;
    }
  }
}

void HybridCache::append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) {
  layer_chunk_.length = chunk.length;
  layer_chunk_.counts = chunk.counts;
  layer_chunk_.uids = chunk.uids;
  layer_chunk_.q.resize(1);
  layer_chunk_.k.resize(1);
  layer_chunk_.v.resize(1);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    layer_chunk_.q[0] = chunk.q[l];
    layer_chunk_.k[0] = chunk.k[l];
    layer_chunk_.v[0] = chunk.v[l];
    if (!out.empty()) layer_out_[0] = out[l];
    layers_[l]->append(layer_chunk_, out.empty() ? out : layer_out_, l == 0 ? log : nullptr);
  }
}

void HybridCache::reorder(const std::vector<int>& rows) {
  for (auto& layer : layers_) layer->reorder(rows);
}

void HybridCache::reset(int batch) {
  for (auto& layer : layers_) layer->reset(batch);
}

void HybridCache::free_rows(const std::vector<int>& rows) {
  for (auto& layer : layers_) layer->free_rows(rows);
}

void HybridCache::check_crop(std::int64_t length) const {
  for (const auto& layer : layers_) layer->check_crop(length);
}

void HybridCache::prune(std::int64_t sinks, std::int64_t recent, bool rerotate) {
  for (std::size_t l = 0; l < layers_.size(); ++l)
    if (full_[l]) layers_[l]->prune(sinks, recent, rerotate);
}

void HybridCache::crop(std::int64_t length) {
  check_crop(length);  // every layer first: a refusal leaves every layer as it was
  for (auto& layer : layers_) layer->crop(length);
}

}  // namespace kvcheck::optimized
