// Runs scenarios: the reference's own invariants, then every cache that serves the policy.
#pragma once

#include <string>
#include <vector>

#include "tools/harness/report.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

struct RunOptions {
  std::vector<std::string> caches;  // names to run; empty: every cache that serves the policy
  bool reference_checks = true;
};

// Throws InputError for bad inputs (a missing or malformed .npy file).
std::vector<Outcome> run_scenario(const Scenario& scenario, const RunOptions& options);

}  // namespace kvcheck
