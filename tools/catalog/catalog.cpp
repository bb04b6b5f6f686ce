#include "tools/catalog/catalog.h"

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

}  // namespace kvcheck
