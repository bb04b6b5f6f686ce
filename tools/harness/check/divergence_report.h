// The first divergence of a cache as fields: what the text report's two lines say (where,
// and the slot or output that went wrong) and what `--json` carries for scripts, from one
// function, so the two cannot disagree.
#pragma once

#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/harness/check/step_checker.h"

namespace kvcheck {

FirstDivergence first_divergence(const Scenario& scenario, const StepDiagnosis& diagnosis);

// "refusal mismatch" -> "refusal_mismatch": the class as an identifier, for scripts.
std::string class_id(BugClass c);

}  // namespace kvcheck
