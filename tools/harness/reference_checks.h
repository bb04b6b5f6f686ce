// The reference's own invariants (issue 2): chunk invariance, `sink` with no sinks equals
// `sliding`, positions within their bounds, expected refusals raised.
#pragma once

#include <memory>

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

// The same checks fed one step at a time beside the run they judge (their own reference
// runs, one token at a time and with a sliding window, advance in step).
class ReferenceChecks {
 public:
  ReferenceChecks(const Scenario& scenario, const InputTable& inputs);
  ~ReferenceChecks();
  ReferenceChecks(const ReferenceChecks&) = delete;
  ReferenceChecks& operator=(const ReferenceChecks&) = delete;
  void step(std::size_t index, const StepRecord& record);
  // `problems`: the run's expected refusals not raised and unexpected ones.
  Outcome finish(const std::vector<std::string>& problems);

 private:
  void chunk_invariance(std::size_t index, const StepRecord& record);
  void sink_zero(std::size_t index, const StepRecord& record);
  const Scenario& s_;
  std::unique_ptr<SplitScenario> split_;  // chunk invariance: every append one token at a time
  std::unique_ptr<ReferenceStepper> single_;
  std::unique_ptr<Scenario> sliding_;  // sink with S = 0: the same scenario as sliding
  std::unique_ptr<ReferenceStepper> sliding_run_;
  Check invariance_, sink_zero_, bounds_;
  double gap_ = 0.0;
};

}  // namespace kvcheck
