// One check in the step checker's list. Each looks at a step's view before the slot-by-slot
// and output comparisons, records what it finds in the step's evidence, and adds its rows to
// the outcome. StepChecker runs the list in one loop, in its order.
//
// Recipe, a new check: one class behind this interface (its own file in check/), one entry
// in StepChecker's list (step_checker.cpp, the constructor), and, if it names a new class
// of bug, one row in bug_classes.cpp's table with a rule in classify() (diagnosis.cpp).
#pragma once

#include "tools/harness/check/cache_view.h"
#include "tools/harness/check/diagnosis.h"
#include "tools/harness/check/report.h"
#include "tools/harness/run/reference_run.h"

namespace kvcheck {

class SubCheck {
 public:
  virtual ~SubCheck() = default;
  // One step (or the state between two forwards of a chunked append).
  virtual void check(const StepRecord& record, CacheView& view, StepEvidence& evidence) = 0;
  // Its rows of the report; none when it never applied.
  virtual void add_checks(Outcome& outcome) const = 0;
};

}  // namespace kvcheck
