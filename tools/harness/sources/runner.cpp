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
// `what` names the run on the progress line (default: the scenario's name).
std::vector<Outcome> run_whole(const Scenario& scenario, const RunOptions& options, const std::string& what = "") {
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
  progress.begin(what.empty() ? scenario.name : what, scenario.steps.size(), count_uids(scenario));
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

// How many of the chosen caches serve a group: groups of the same layers' configurations
// are served alike, so each distinct one is asked once. Asking reads every step, so past 64
// distinct groups (a hostile file: a thousand layers each its own window over many steps)
// every chosen cache is counted, which can only make groups smaller.
class CachesServingGroups {
 public:
  explicit CachesServingGroups(const std::vector<const CacheEntry*>& caches) : caches_(caches) {}
  int operator()(const Scenario& s, int first, int count) {
    const auto from = s.policies.begin() + first;
    for (const Known& k : known_)
      if (k.count == count && std::equal(from, from + count, s.policies.begin() + k.first) &&
          same_layers(s.ropes, k.first, first, count) && same_layers(s.quants, k.first, first, count) &&
          same_layers(s.attention.sink_logits, k.first, first, count))
        return k.serving;
    if (known_.size() >= 64)
      return static_cast<int>(std::count_if(caches_.begin(), caches_.end(), [](const CacheEntry* c) { return c; }));
    if (!group_) group_ = std::make_unique<Scenario>(s);
    take_layers(*group_, s, first, count);
    const int serving = static_cast<int>(
        std::count_if(caches_.begin(), caches_.end(), [&](const CacheEntry* c) { return c && c->serves(*group_); }));
    known_.push_back({first, count, serving});
    return serving;
  }

 private:
  template <class T>
  static bool same_layers(const std::vector<T>& v, int a, int b, int count) {
    return v.empty() || std::equal(v.begin() + a, v.begin() + a + count, v.begin() + b);
  }
  struct Known {
    int first, count, serving;
  };
  const std::vector<const CacheEntry*>& caches_;
  std::vector<Known> known_;
  std::unique_ptr<Scenario> group_;
};

}  // namespace

std::vector<Outcome> run_scenario(const Scenario& scenario, const RunOptions& options) {
  const int layers = scenario.dims.layers;
  CachesServingGroups serving(options.caches);
  const int size = options.layers_per_group > 0 && why_layers_cannot_run_apart(scenario).empty()
                       ? std::min(options.layers_per_group, layers)
                       : layer_group_size(scenario, options.memory_budget, std::ref(serving));
  // 0: no groups; the parser took the scenario whole (`--kv-quant` may have grown it since).
  if (size == layers || size == 0) return run_whole(scenario, options);
  const double whole_bytes = estimate_cost(scenario).bytes;
  std::vector<Outcome> outcomes;
  for (int first = 0; first < layers; first += size) {
    const int count = std::min(size, layers - first);
    const Scenario part = layer_group(scenario, first, count);
    const ScenarioCost cost = estimate_cost(part);
    const int caches = serving(scenario, first, count);
    const double group_bytes = cost.bytes + std::max(0, caches - 1) * cost.cache_bytes;
    // The time left on the progress line is the group's: the line says which of how many.
    std::vector<Outcome> group = run_whole(
        part, options, fmt::format("{}, group {} of {}", part.name, first / size + 1, (layers + size - 1) / size));
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
                         "this group about {:.1f} GB beside its {} cache{}, of a {:.1f} GB budget{}): each layer as "
                         "in the whole, nothing across groups",
                         first, first + count - 1, layers, whole_bytes / 1e9, group_bytes / 1e9, caches,
                         caches == 1 ? "" : "s", options.memory_budget / 1e9,
                         group_bytes > options.memory_budget
                             ? "; over it, as a single layer and its caches are: `--cache NAME` runs fewer at once"
                             : "")});
      outcomes.push_back(std::move(o));
    }
  }
  return outcomes;
}

}  // namespace kvcheck
