// A cache kvcheck can run by name: how to make it and which policies it serves. The real
// caches and the zoo's mutants are both listed this way (tools/catalog).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "optimized/cache.h"
#include "reference/model.h"
#include "tools/harness/check/cache_view.h"

namespace kvcheck {

struct Scenario;

struct CacheEntry {
  std::string name;
  std::string description;
  std::function<bool(const Scenario&)> serves;  // the scenario's policy, storage and variants
  std::function<std::unique_ptr<optimized::KvCache>(const optimized::CacheConfig&)> make;
  Eviction eviction = Eviction::lazy;  // every cache here drops tokens when the next arrives
};

// The optimized caches' rope, from a scenario's (every SPEC 7 parameter carried over).
optimized::RopeSpec rope_spec(const Rope& rope, int head_dim);

// The paged cache's pool: the scenario's `paging`, else a default that no step exhausts.
optimized::PagedLayout paged_layout(const Scenario& scenario);

// The same cache with its blocks poisoned (CacheConfig::poison_blocks, SPEC 8.8.5): a paged
// cache fills new and freed blocks with NaNs naming them; other caches are unchanged.
CacheEntry with_poisoned_blocks(CacheEntry entry);

// The optimized caches' own configuration for a scenario; `capacity` sizes a static cache.
optimized::CacheConfig cache_config(const Scenario& scenario, std::int64_t capacity);

}  // namespace kvcheck
