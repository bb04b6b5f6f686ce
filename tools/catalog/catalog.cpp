// kvcheck's own caches and the zoo, as one catalog the command line and the tests look up.
//
// Recipe, a new cache: write it in optimized/ behind KvCache (optimized/cache.h), add its
// file to kvcheck_optimized in CMakeLists.txt, and add one entry to real_caches() below:
// its name, one line, which scenarios it serves (its policies: a cache of one policy
// serves s.every_layer(kind) and reads shared_policy(config)), and how to make it. Every
// fixture then runs on it (tests/test_caches.cpp, `kvcheck run`).
#include "tools/catalog/catalog.h"

#include <algorithm>

#include "optimized/dense_cache.h"
#include "optimized/hybrid_cache.h"
#include "optimized/paged_cache.h"
#include "optimized/sink_ring_cache.h"
#include "optimized/sink_shift_cache.h"
#include "optimized/sliding_cache.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/zoo/zoo.h"

namespace kvcheck {

using namespace optimized;

const std::vector<CacheEntry>& real_caches() {
  static const std::vector<CacheEntry> caches = [] {
    std::vector<CacheEntry> list = {
        {"dynamic", "full attention, grows with the sequence (amortized doubling)",
         [](const Scenario& s) { return s.every_layer(PolicyKind::full); },
         [](const CacheConfig& c) { return std::make_unique<DenseCache>(c, DenseCache::Growth::dynamic); }},
        {"static", "full attention, preallocated, refuses to overflow",
         [](const Scenario& s) { return s.every_layer(PolicyKind::full); },
         [](const CacheConfig& c) { return std::make_unique<DenseCache>(c, DenseCache::Growth::fixed); }},
        {"sliding", "ring buffer of W slots, keys rotated once (also chunked attention: W = C)",
         [](const Scenario& s) { return s.every_layer(PolicyKind::sliding) || s.every_layer(PolicyKind::chunked); },
         [](const CacheConfig& c) { return std::make_unique<SlidingCache>(c); }},
        // float32 only: re-rotating a half-precision key at every shift rounds it again each
        // time, and the error grows with the shifts (the zoo's rerotates_half_keys). Quantized
        // (SPEC 9), the reference simulates each of those roundings, so it serves every format.
        {"sink_shift", "attention sinks, keys at cache positions, re-rotated when the window shifts",
         [](const Scenario& s) {
           return s.every_layer(PolicyKind::sink) && (s.kv_dtype == KvDtype::float32 || s.quantized());
         },
         [](const CacheConfig& c) { return std::make_unique<SinkShiftCache>(c); }},
        // Its keys stay at their first rotation, so a quantized key is never re-quantized: not
        // the `shift: "requantize"` convention SPEC 9 defines for cache positions.
        {"sink_ring", "attention sinks, ring buffer, keys rotated once, query rotated twice",
         [](const Scenario& s) {
           return s.every_layer(PolicyKind::sink) &&
                  !(quantizes_keys(s) && s.shared_policy()->positions == SinkPositions::cache);
         },
         [](const CacheConfig& c) { return std::make_unique<SinkRingCache>(c); }},
        // SPEC 8: blocks, tables, refcounts, prefix reuse. It serves every scenario, with the
        // scenario's `paging` or a default pool; eviction is per block. Its sink layers keep
        // keys at their first rotation, as sink_ring does: not the requantize convention.
        {"paged", "block pool and tables (vLLM), copy-on-write, prefix index, window freeing, chunked prefill",
         [](const Scenario& s) {
           const bool shifted_sink_layer = std::any_of(
               s.policies.begin(), s.policies.end(),
               [](const Policy& p) { return p.kind == PolicyKind::sink && p.positions == SinkPositions::cache; });
           // A sliding layer under a shift (SPEC 10.4) is the hybrid cache's only.
           const bool swa = std::any_of(s.policies.begin(), s.policies.end(), [](const Policy& p) { return p.swa > 0; });
           return !swa &&
                  !(s.quantized() && (s.quant_rules().holds_raw() || (quantizes_keys(s) && shifted_sink_layer)));
         },
         [](const CacheConfig& c) { return std::make_unique<PagedCache>(c); }, Eviction::any},
        // Layers of different policies (SPEC 7), each served by the cache above that fits it.
        {"hybrid", "one cache per layer, as the layer's policy (dynamic, sliding or sink_ring) and rope need",
         [](const Scenario& s) {
           // Its sink layers are sink_ring caches: not the requantize convention (see sink_ring).
           const bool sink_layer = std::any_of(s.policies.begin(), s.policies.end(), [](const Policy& p) {
             return p.kind == PolicyKind::sink && p.positions == SinkPositions::cache;
           });
           return (s.hybrid() || !s.shared_rope()) && !(quantizes_keys(s) && sink_layer);
         },
         [](const CacheConfig& c) { return std::make_unique<HybridCache>(c); }},
    };
    // None of them stores MLX's affine groups yet (SPEC 9.7: the reference and exports do).
    // None of them quantizes the query (kv_quant "query", ggml's CPU convention). Under scales
    // frozen per row with a prefix cache, a hit's tokens keep their writer's scale: only a
    // cache that takes the hit holds what the reference expects.
    // Only the hybrid cache gives each layer its own rope (SPEC 10.1): the others keep one
    // cos/sin table.
    // Only the dense caches prune (SPEC 11), alone or as the hybrid's full layers;
    // re-rotating a half-precision key rounds it again, so a re-rotating prune is float32's
    // (as sink_shift).
    for (CacheEntry& e : list)
      e.serves = [inner = e.serves, paged = e.name == "paged", hybrid = e.name == "hybrid",
                  prunes = e.name == "dynamic" || e.name == "static" || e.name == "hybrid"](const Scenario& s) {
        const bool shared_scales = any_frozen_scales(s) && s.paging && s.paging->prefix_cache;
        // An observed prune's kept tokens are a scorer's choice (SPEC 11.1): judged from traces only.
        const bool prune_served = !s.prunes() || (prunes && !s.prunes_observed() &&
                                                  (!s.prunes(true) || s.kv_dtype == KvDtype::float32));
        return !(s.quantized() && s.quant_rules().query) && !stores_biased_groups(s) && (paged || !shared_scales) &&
               (hybrid || s.shared_rope()) && prune_served && inner(s);
      };
    return list;
  }();
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
