#include "tools/harness/cache_registry.h"

#include "optimized/dense_cache.h"
#include "optimized/sink_ring_cache.h"
#include "optimized/sink_shift_cache.h"
#include "optimized/sliding_cache.h"
#include "tools/zoo/zoo.h"

namespace kvcheck {

using namespace optimized;

const std::vector<CacheEntry>& real_caches() {
  static const std::vector<CacheEntry> caches = {
      {"dynamic", "full attention, grows with the sequence (amortized doubling)",
       [](const Policy& p) { return p.kind == PolicyKind::full; },
       [](const CacheConfig& c) { return std::make_unique<DenseCache>(c, DenseCache::Growth::dynamic); }},
      {"static", "full attention, preallocated, refuses to overflow",
       [](const Policy& p) { return p.kind == PolicyKind::full; },
       [](const CacheConfig& c) { return std::make_unique<DenseCache>(c, DenseCache::Growth::fixed); }},
      {"sliding", "ring buffer of W slots, keys rotated once",
       [](const Policy& p) { return p.kind == PolicyKind::sliding; },
       [](const CacheConfig& c) { return std::make_unique<SlidingCache>(c); }},
      {"sink_shift", "attention sinks, keys at cache positions, re-rotated when the window shifts",
       [](const Policy& p) { return p.kind == PolicyKind::sink; },
       [](const CacheConfig& c) { return std::make_unique<SinkShiftCache>(c); }},
      {"sink_ring", "attention sinks, ring buffer, keys rotated once, query rotated twice",
       [](const Policy& p) { return p.kind == PolicyKind::sink; },
       [](const CacheConfig& c) { return std::make_unique<SinkRingCache>(c); }},
  };
  return caches;
}

const CacheEntry* find_cache(const std::string& name) {
  for (const CacheEntry& e : real_caches())
    if (e.name == name) return &e;
  for (const CacheEntry& e : zoo_caches())
    if (e.name == name) return &e;
  return nullptr;
}

CacheConfig cache_config(const Scenario& s, std::int64_t capacity) {
  CacheConfig c;
  c.layers = s.dims.layers;
  c.heads = s.dims.heads;
  c.kv_heads = s.dims.kv_heads;
  c.head_dim = s.dims.head_dim;
  c.batch = s.dims.batch;
  c.rope.head_dim = s.dims.head_dim;
  c.rope.theta = s.rope.theta;
  c.rope.layout = s.rope.layout == RopeLayout::half ? PairLayout::half : PairLayout::interleaved;
  c.rope.position_divisor = s.rope.scaling == RopeScaling::linear ? s.rope.factor : 1.0;
  c.softmax_scale = static_cast<float>(s.softmax_scale());
  c.window = s.policy.window;
  c.sinks = s.policy.sinks;
  c.evict = s.policy.evict;
  // A sliding window keeps absolute positions: it is a sink cache without sinks that never shifts.
  c.shift_positions = s.policy.kind == PolicyKind::sink && s.policy.positions == SinkPositions::cache;
  c.dense_prefill = s.policy.prefill == Prefill::dense;
  c.capacity = capacity;
  return c;
}

}  // namespace kvcheck
