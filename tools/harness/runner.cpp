#include "tools/harness/runner.h"

#include <chrono>

#include "tools/harness/cache_checks.h"
#include "tools/harness/inputs.h"
#include "tools/harness/reference_checks.h"
#include "tools/harness/reference_run.h"

namespace kvcheck {

std::vector<Outcome> run_scenario(const Scenario& scenario, const RunOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const InputTable inputs = load_inputs(scenario);
  const ReferenceRun run = run_reference(scenario, inputs);
  std::vector<Outcome> outcomes;
  if (options.reference_checks) {
    outcomes.push_back(check_reference(scenario, inputs, run));
    outcomes.back().seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  for (const CacheEntry* cache : options.caches) {
    if (cache == nullptr || !cache->serves(scenario.policy)) continue;
    const auto cache_start = std::chrono::steady_clock::now();
    outcomes.push_back(check_cache(scenario, inputs, run, *cache));
    outcomes.back().seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - cache_start).count();
  }
  return outcomes;
}

}  // namespace kvcheck
