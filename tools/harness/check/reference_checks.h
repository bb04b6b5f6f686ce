// The reference's own invariants (issue 2): chunk invariance, `sink` with no sinks equals
// `sliding`, positions within their bounds, expected refusals raised.
#pragma once

#include <memory>

#include "reference/model.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

Outcome check_reference(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run);

// The same scenario with every append split into single-token appends, and the inputs
// permuted so each token keeps its raw vectors although its uid changes.
struct SplitScenario {
  Scenario scenario;
  InputTable inputs;
};
SplitScenario split_into_single_tokens(const Scenario& scenario, const InputTable& inputs);

// Chunk invariance at real shapes: the one-by-one run must step through every token (its
// state must be exact) but need not attend for every one. Below this many multiply-adds
// (every fixture but the real-shape ones) every token is compared.
constexpr double kFullInvarianceBudget = 2e10;

// Which single-token steps of the split scenario attend (attend, one entry per step of
// split_into_single_tokens; empty when every token fits the budget): the first and last 4
// tokens of every chunk (where chunking bugs live), every token within 4 of a window's
// edge (t = W - 1 of any layer) or of the sinks, and every `every`-th token, `every` chosen
// so the scenario's attention over it costs about the budget.
struct InvarianceSample {
  std::vector<bool> attend;
  std::int64_t sampled = 0, total = 0, every = 1;
};
InvarianceSample invariance_sample(const Scenario& scenario, double budget);

// The same checks fed one step at a time beside the run they judge (their own reference
// runs, one token at a time and with a sliding window, advance in step).
class ReferenceChecks {
 public:
  ReferenceChecks(const Scenario& scenario, const InputTable& inputs, double invariance_budget = kFullInvarianceBudget);
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
  std::vector<bool> attend_;  // per step of the split scenario; empty: every token is compared
  std::size_t single_index_ = 0;
  std::unique_ptr<Scenario> sliding_;  // sink with S = 0: the same scenario as sliding
  std::unique_ptr<ReferenceStepper> sliding_run_;
  Check invariance_, sink_zero_, bounds_;
  double gap_ = 0.0;
};

}  // namespace kvcheck
