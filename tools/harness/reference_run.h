// Runs the reference over a scenario's steps and keeps, per step, what the export and
// every check need: appended uids, outputs, the retained set, an expected refusal.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "reference/reference_model.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

struct StepRecord {
  Step step;
  int batch_before = 0;
  std::optional<reference::AppendResult> append;      // append steps
  std::vector<reference::RowRetained> retained;       // per row, after the step
  std::vector<std::vector<std::uint64_t>> histories;  // per row, uid of each token index, after the step
  std::string refused;                                // the code when the step was refused
  std::string refusal_message;
};

struct ReferenceRun {
  std::vector<StepRecord> steps;
  std::vector<std::string> problems;  // an expected refusal not raised, an unexpected one
};

ReferenceRun run_reference(const Scenario& scenario, const InputTable& inputs);

// "step 3 (crop, steps[2])": how messages name a step.
std::string step_label(const Step& step, std::size_t index);

}  // namespace kvcheck
