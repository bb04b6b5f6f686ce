// The bug zoo: deliberately broken caches, each reproducing one real bug class, so a new
// user can watch kvcheck catch it. Never use one of these as a cache.
#pragma once

#include <string>
#include <vector>

#include "tools/harness/sources/cache_entry.h"
#include "tools/harness/check/diagnosis.h"

namespace kvcheck {

struct ZooMutant {
  CacheEntry cache;                   // named zoo/...
  std::string in_the_wild;            // where this bug appeared
  BugClass expected;                  // what diagnose must call it
  std::vector<std::string> fixtures;  // scenarios of fixtures/scenarios/ that expose it
};

const std::vector<ZooMutant>& zoo_mutants();
// The mutants as caches, for find_cache and `list`.
const std::vector<CacheEntry>& zoo_caches();

}  // namespace kvcheck
