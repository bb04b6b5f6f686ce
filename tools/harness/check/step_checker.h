// The one checker (SPEC 5): what a cache under test shows after each step, from an
// in-process run or from a trace (cache_view.h), compared with the reference. It tallies
// every failure, keeps the evidence of the first divergent step (and of a step asked
// for), names the class, and summarizes how the error evolves afterwards.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "reference/model.h"
#include "tools/harness/check/cache_view.h"
#include "tools/harness/check/diagnosis.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/harness/check/slot_view.h"

namespace kvcheck {

// One step looked at closely: its evidence, its class, and the slot table of one row.
struct StepDiagnosis {
  StepEvidence evidence;
  StepContext context;
  BugClass bug = BugClass::none;
  int row = 0;
  int layer = 0;                  // of the first slot issue, else of the first wrong output
  std::int64_t query_index = -1;  // the first divergent query; -1: none (a reorder, reset or crop)
  // The row's slots after the step, with visibility and distances as seen by the row's
  // last token of the step (whose view is the state the step leaves behind).
  std::int64_t table_query_index = -1;
  std::vector<SlotRow> slots;
  std::int64_t block_size = 0;  // a paged cache's: slots are then shown as block + offset
};

struct CacheTrace {
  Outcome outcome;
  std::optional<StepDiagnosis> first;
  std::optional<StepDiagnosis> focus;             // the step asked for (--step), divergent or not
  Drift drift;                                    // from the first divergence on, for its row
  std::vector<std::vector<PictureCell>> picture;  // [step][the slots held, by id] of first->row (when asked)
};

struct CheckOptions {
  std::string target;  // a cache name, or "trace"
  KeyPositions key_positions = KeyPositions::claimed;
  Eviction eviction = Eviction::any;
  std::int64_t block_capacity = 0;  // C, under Eviction::blocks
  bool trace = false;  // the views come from a trace: report how many steps it recorded
  bool picture = false;
  std::optional<std::size_t> focus_step;
};

// The checker of one cache under test, fed one step at a time (so a long run keeps no
// step longer than its checks need).
class StepChecker {
 public:
  StepChecker(const Scenario& scenario, const InputTable& inputs, const CheckOptions& options);
  ~StepChecker();
  StepChecker(const StepChecker&) = delete;
  StepChecker& operator=(const StepChecker&) = delete;
  // Checks step `index` against what the cache shows; false when the run cannot go on for
  // this cache (it raised, or holds other rows than the reference).
  bool step(std::size_t index, const StepRecord& record, CacheView view);
  // SPEC 8.7: the state between two forwards of chunked append `index` (a forward_record),
  // checked like a step; the whole step still comes to step() once it is done.
  void forward(std::size_t index, const StepRecord& record, CacheView view);
  CacheTrace finish();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Applies step `index` to the cache under test and returns what it shows; the view's
// pointers must stay valid until the next call.
using Observe = std::function<CacheView(std::size_t index, const StepRecord& record)>;

// A whole run at once (diagnose, verify, tests), with progress.
CacheTrace check_steps(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run,
                       const CheckOptions& options, const Observe& observe);
// The same with a checker the caller made (one that also takes forwards); `target` names
// it in the progress line.
CacheTrace check_steps(StepChecker& checker, const Scenario& scenario, const ReferenceRun& run,
                       const std::string& target, const Observe& observe);

// A bound for position recovery: twice the longest row the scenario reaches, plus room.
std::int64_t largest_position(const Scenario& scenario);

// The token index of `uid` in a row's history, or -1.
std::int64_t index_of(const RowHistory& history, std::int64_t uid);

// Output tolerance for outputs computed from keys and values stored with unit roundoff
// `roundoff`: the scenario's for float32, derived from the inputs' magnitudes for half
// precision (see the definition).
struct InputMagnitudes {
  double v_max = 0.0;             // the largest |v| of any element
  double q_norm = 0.0, k_norm = 0.0;  // the largest 2-norm of a raw query, of a raw key
};
InputMagnitudes input_magnitudes(const InputTable& inputs);
Tolerance output_tolerance(const Scenario& scenario, const InputMagnitudes& inputs, double roundoff);

}  // namespace kvcheck
