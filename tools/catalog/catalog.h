// The caches kvcheck knows by name: the real ones of optimized/ and the bug zoo's mutants
// (named zoo/...). The one place that puts the two side by side: the harness knows
// neither, the zoo knows only its own mutants.
#pragma once

#include <string>
#include <vector>

#include "tools/harness/sources/cache_entry.h"

namespace kvcheck {

// The real caches, in display order.
const std::vector<CacheEntry>& real_caches();
// A real cache or a zoo mutant by name; null when unknown.
const CacheEntry* find_cache(const std::string& name);

}  // namespace kvcheck
