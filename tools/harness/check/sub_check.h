// One check in the step checker's list. Each looks at a step's view before the slot-by-slot
// and output comparisons, records what it finds in the step's evidence, and adds its rows to
// the outcome. StepChecker runs the list in one loop, in its order.
//
// Recipe, a new check: one class behind this interface (its own file in check/), one entry
// in StepChecker's list (step_checker.cpp, the constructor), and, if it names a new class
// of bug, one row in bug_classes.cpp's table with a rule in classify() (diagnosis.cpp). A
// check that changes what outputs are expected, or how far they may move, says so through
// the output hooks below: the checker asks the whole list, never a check by name.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "tools/harness/check/cache_view.h"
#include "tools/harness/check/diagnosis.h"
#include "tools/harness/check/report.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// What the checks say of one row's outputs in one layer before the checker compares them
// with the reference's: other expected values (outputs recomputed over what the cache holds,
// in R_stored's layout), how far every element may move beyond the tolerance, and how far
// one may move for a query `slack` (2-norm) from the reference's, element by element.
// At most one check of the list sets `expected` (today QuantChecks: R_stored over held codes);
// allowances add up.
struct OutputRule {
  std::vector<double> expected;     // empty: the reference's own
  std::vector<double> query_slack;  // one per (token, head), in `expected`'s layout; empty: none
  double allowance = 0.0;
  std::function<double(double slack)> slack_allowance;  // set with query_slack
};

class SubCheck {
 public:
  virtual ~SubCheck() = default;
  // One step (or the state between two forwards of a chunked append).
  virtual void check(const StepRecord& record, CacheView& view, StepEvidence& evidence) = 0;
  // Its rows of the report; none when it never applied.
  virtual void add_checks(Outcome& outcome) const = 0;

  // Keys the cache chose to keep that the reference cannot know (SPEC 11.1): row `row`'s kv
  // head `kv_head` in layer `layer` also retains these, and its next token sees them, at
  // these positions. The slot and rotation checks judge them like the reference's own.
  virtual void chosen_keys(const StepRecord& record, int layer, int row, int kv_head,
                           std::vector<reference::RetainedKey>& keys) const {
    (void)record, (void)layer, (void)row, (void)kv_head, (void)keys;
  }

  // Outputs of an append step, row `row` of layer `layer`, asked of every check in the
  // list's order; a check that has nothing to say leaves each hook alone.
  // Before the comparison: what to expect, and how far from it (`rotated_q`: the queries the
  // source shows, or null).
  virtual void rule_outputs(const StepRecord& record, int layer, int row, const float* rotated_q,
                            OutputRule& rule) const {
    (void)record, (void)layer, (void)row, (void)rotated_q, (void)rule;
  }
  // The outputs themselves, judged by the check's own rule (the first `skipped` tokens were
  // not computed: a prefix hit).
  virtual void check_outputs(const StepRecord& record, int layer, int row, const float* out, std::size_t skipped,
                             StepEvidence& evidence) {
    (void)record, (void)layer, (void)row, (void)out, (void)skipped, (void)evidence;
  }
  // The step's first wrong output (token `token`, head `head`): which of the check's named
  // mistakes fit it, recorded in `evidence` for diagnosis.
  virtual void explain_output(const StepRecord& record, int layer, int row, std::size_t token, int head,
                              const float* out, const Tolerance& tolerance, StepEvidence& evidence) const {
    (void)record, (void)layer, (void)row, (void)token, (void)head, (void)out, (void)tolerance, (void)evidence;
  }
};

}  // namespace kvcheck
