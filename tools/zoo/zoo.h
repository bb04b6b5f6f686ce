// The bug zoo: deliberately broken caches, each reproducing one real bug class, so a new
// user can watch kvcheck catch it. Never use one of these as a cache.
#pragma once

#include <vector>

#include "tools/harness/cache_registry.h"

namespace kvcheck {

const std::vector<CacheEntry>& zoo_caches();

}  // namespace kvcheck
