// Runs scenarios: the reference's own invariants, then every cache that serves the policy.
#pragma once

#include <string>
#include <optional>
#include <vector>

#include "tools/harness/sources/cache_entry.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

struct RunOptions {
  std::vector<const CacheEntry*> caches;  // the caches to run, each where it serves the policy
  bool reference_checks = true;
  std::optional<KvDtype> kv_dtype;  // every scenario's caches store in this format instead
  std::optional<QuantFormat> kv_quant;  // or K and V quantized in this format (SPEC 9)
  // Over 85% of this (estimate_cost's, with the caches that serve it), a scenario runs in
  // groups of layers where its layers can run apart (layer_groups.h).
  double memory_budget = kMemoryBudget;
  int layers_per_group = 0;  // > 0: groups of this many layers, whatever the budget (tests)
};

// Throws InputError for bad inputs (a missing or malformed .npy file). A scenario over the
// memory budget whose layers can run apart runs as groups of layers, each reported as
// "NAME [layers A-B]" with its layers numbered as in the whole scenario.
std::vector<Outcome> run_scenario(const Scenario& scenario, const RunOptions& options);

}  // namespace kvcheck
