// The reference's own invariants (issue 2): chunk invariance, `sink` with no sinks equals
// `sliding`, positions within their bounds, expected refusals raised.
#pragma once

#include "reference/model.h"
#include "tools/harness/reference_run.h"
#include "tools/harness/report.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

Outcome check_reference(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run);

// The same scenario with every append split into single-token appends, and the inputs
// permuted so each token keeps its raw vectors although its uid changes.
struct SplitScenario {
  Scenario scenario;
  InputTable inputs;
};
SplitScenario split_into_single_tokens(const Scenario& scenario, const InputTable& inputs);

}  // namespace kvcheck
