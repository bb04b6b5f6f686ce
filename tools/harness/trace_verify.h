// Checking an external trace (SPEC 6): a cache written in any language dumps what it
// stored after every step; kvcheck identifies each slot's token by its values, recovers
// the rotary positions from the keys (and queries), and compares with the reference.
#pragma once

#include <string>

#include "tools/harness/cache_checks.h"

namespace kvcheck {

// Throws InputError (exit 2) for a bad trace: missing file, wrong shape or dtype, a
// manifest that does not fit the scenario. A divergence is reported in the result.
CacheTrace verify_trace(const Scenario& scenario, const std::string& trace_dir);

}  // namespace kvcheck
