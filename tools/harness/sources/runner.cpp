#include "tools/harness/sources/runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "tools/harness/sources/in_process_source.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/scenario/layer_groups.h"
#include "tools/harness/io/progress.h"
#include "tools/harness/check/reference_checks.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/step_checker.h"

namespace kvcheck {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// One cache under test beside the reference: fed each step as the reference makes it.
struct Target {
  Target(const Scenario& s, const InputTable& inputs, const CacheEntry& entry, const CheckOptions& options)
      : cache(s, inputs, entry), checker(s, inputs, options) {
    cache.check_forwards_with(checker);
  }
  InProcessCache cache;
  StepChecker checker;
  bool going = true;
  double seconds = 0.0;
};

}  // namespace

namespace {

// The reference makes one step at a time and every check takes it before the next, so
// memory holds one step's outputs and views, not the whole run's.
std::vector<Outcome> run_whole(const Scenario& scenario, const RunOptions& options) {
  const auto start = Clock::now();
  const InputTable inputs = load_inputs(scenario);
  double reference_seconds = seconds_since(start);
  std::optional<ReferenceChecks> reference_checks;
  if (options.reference_checks) reference_checks.emplace(scenario, inputs);
  std::vector<std::unique_ptr<Target>> targets;
  for (const CacheEntry* cache : options.caches) {
    if (cache == nullptr || !cache->serves(scenario)) continue;
    CheckOptions check;
    check.target = cache->name;
    check.eviction = cache->eviction;
    targets.push_back(std::make_unique<Target>(scenario, inputs, *cache, check));
  }

  ReferenceStepper reference(scenario, inputs);
  Progress& progress = Progress::line();
  progress.begin(scenario.name, scenario.steps.size(), count_uids(scenario));
  std::int64_t tokens = 0;
  for (std::size_t i = 0; !reference.done(); ++i) {
    auto t0 = Clock::now();
    const StepRecord record = reference.next();
    if (reference_checks) reference_checks->step(i, record);
    reference_seconds += seconds_since(t0);
    for (auto& target : targets) {
      if (!target->going) continue;
      t0 = Clock::now();
      target->going = target->checker.step(i, record, target->cache(i, record));
      target->seconds += seconds_since(t0);
    }
    if (record.append)
      for (const auto& row : record.append->rows) tokens += static_cast<std::int64_t>(row.size());
    progress.advance(i, tokens);
  }

  std::vector<Outcome> outcomes;
  if (reference_checks) {
    outcomes.push_back(reference_checks->finish(reference.problems()));
    outcomes.back().seconds = reference_seconds;
    // A PASS of the reference alone says nothing of a cache: the table says so beside it.
    if (targets.empty())
      outcomes.back().checks.push_back(
          {"caches", true,
           scenario.prunes_observed()
               ? std::string("not judged: no kvcheck cache chooses which tokens to keep (an observed prune, SPEC "
                             "11.1); drive kvpress with kvtrace.drive_kvpress and `kvcheck verify` its trace")
               : std::string("not judged: none of the chosen caches serves this scenario (`kvcheck list`); drive an "
                             "engine through kvtrace and `kvcheck verify` its trace")});
  }
  for (auto& target : targets) {
    outcomes.push_back(target->checker.finish().outcome);
    outcomes.back().seconds = target->seconds;
  }
  return outcomes;
}

}  // namespace

std::vector<Outcome> run_scenario(const Scenario& scenario, const RunOptions& options) {
  const int layers = scenario.dims.layers;
  const int size = options.layers_per_group > 0 && why_layers_cannot_run_apart(scenario).empty()
                       ? std::min(options.layers_per_group, layers)
                       : layer_group_size(scenario, options.memory_budget);
  // 0: no groups; the parser took the scenario whole (`--kv-quant` may have grown it since).
  if (size == layers || size == 0) return run_whole(scenario, options);
  const double whole_bytes = estimate_cost(scenario).bytes;
  std::vector<Outcome> outcomes;
  for (int first = 0; first < layers; first += size) {
    const int count = std::min(size, layers - first);
    std::vector<Outcome> group = run_whole(layer_group(scenario, first, count), options);
    for (Outcome& o : group) {
      for (Check& c : o.checks) c.detail = renumber_layers(c.detail, first);
      if (FirstDivergence* f = o.first_divergence ? &*o.first_divergence : nullptr) {
        f->layer += first;
        for (std::string* text : {&f->verdict, &f->explanation, &f->where, &f->what}) *text = renumber_layers(*text, first);
      }
      if (o.target == "reference")
        o.checks.push_back(
            {"layer groups", true,
             fmt::format("layers {}-{} of {} checked as a scenario of their own (the whole needs about {:.1f} GB; "
                         "groups of {} fit in {:.1f} GB): each layer as in the whole, nothing across groups",
                         first, first + count - 1, layers, whole_bytes / 1e9, size,
                         options.memory_budget / 1e9)});
      outcomes.push_back(std::move(o));
    }
  }
  return outcomes;
}

}  // namespace kvcheck
