// Checking an external trace (SPEC 6): a cache written in any language dumps what it
// stored after every step; kvcheck identifies each slot's token by its values, recovers
// the rotary positions from the keys (and queries), and hands the steps to the one
// checker, as an in-process cache's are.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "tools/harness/check/step_checker.h"

namespace kvcheck {

struct VerifyOptions {
  bool picture = false;                   // for --html
  std::optional<std::size_t> focus_step;  // --step N
};

// Throws InputError (exit 2) for a bad trace: missing file, wrong shape or dtype, a
// manifest that does not fit the scenario. A divergence is reported in the result.
CacheTrace verify_trace(const Scenario& scenario, const std::string& trace_dir, const VerifyOptions& options = {});

}  // namespace kvcheck
