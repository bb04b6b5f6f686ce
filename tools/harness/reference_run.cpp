#include "tools/harness/reference_run.h"

#include <fmt/format.h>

namespace kvcheck {

std::string step_label(const Step& step, std::size_t index) {
  return fmt::format("step {} ({}, /steps/{})", index, step.source_op, step.source_index);
}

ReferenceRun run_reference(const Scenario& s, const InputTable& inputs) {
  reference::ReferenceModel model(s.dims, s.rope, s.policy, s.softmax_scale(), inputs);
  ReferenceRun run;
  for (std::size_t i = 0; i < s.steps.size(); ++i) {
    const Step& step = s.steps[i];
    StepRecord record{step, model.batch(), {}, {}, {}, {}, {}};
    try {
      switch (step.op) {
        case StepOp::append:
          record.append = model.append(step.tokens);
          break;
        case StepOp::reorder:
          model.reorder(step.rows);
          break;
        case StepOp::reset:
          model.reset(*step.batch);
          break;
        case StepOp::crop:
          model.crop(step.length);
          break;
      }
      if (!step.expect_error.empty())
        run.problems.push_back(fmt::format("{}: expected the error \"{}\", but the step was accepted",
                                           step_label(step, i), step.expect_error));
    } catch (const reference::StepRefused& e) {
      record.refused = e.code;
      record.refusal_message = e.what();
      if (e.code != step.expect_error)
        run.problems.push_back(fmt::format("{}: refused with \"{}\" ({}){}", step_label(step, i), e.code, e.what(),
                                           step.expect_error.empty() ? ", which the scenario does not expect"
                                                                     : ", expected \"" + step.expect_error + "\""));
    }
    for (int b = 0; b < model.batch(); ++b) {
      record.retained.push_back(model.retained(b));
      record.histories.push_back(model.history(b));
    }
    run.steps.push_back(std::move(record));
  }
  return run;
}

}  // namespace kvcheck
