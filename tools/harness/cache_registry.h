// The caches kvcheck knows by name: the real ones of optimized/ and the bug zoo's mutants
// (named zoo/...), each with the policies it serves.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "optimized/cache.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

struct CacheEntry {
  std::string name;
  std::string description;
  std::function<bool(const Policy&)> serves;
  std::function<std::unique_ptr<optimized::KvCache>(const optimized::CacheConfig&)> make;
};

// The real caches, in display order.
const std::vector<CacheEntry>& real_caches();
// A real cache or a zoo mutant by name; null when unknown.
const CacheEntry* find_cache(const std::string& name);

// The optimized caches' own configuration for a scenario; `capacity` sizes a static cache.
optimized::CacheConfig cache_config(const Scenario& scenario, std::int64_t capacity);

}  // namespace kvcheck
