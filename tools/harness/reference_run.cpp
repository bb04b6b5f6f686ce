#include "tools/harness/reference_run.h"

#include <fmt/format.h>

#include "tools/harness/progress.h"

namespace kvcheck {

std::string step_label(const Step& step, std::size_t index) {
  return fmt::format("step {} ({}, /steps/{})", index, step.source_op, step.source_index);
}

namespace {

// The rows' shared histories: a row's vector is extended in place while no other row
// shares it and nothing was cut; otherwise the row starts a vector of its own.
class SharedHistories {
 public:
  std::vector<RowHistory> after(const Step& step, const reference::ReferenceModel& model) {
    if (step.op == StepOp::reorder) {
      std::vector<std::shared_ptr<std::vector<std::uint64_t>>> moved;
      for (int r : step.rows) moved.push_back(rows_.at(static_cast<std::size_t>(r)));
      rows_ = std::move(moved);
    }
    rows_.resize(static_cast<std::size_t>(model.batch()));
    std::vector<RowHistory> out;
    for (std::size_t b = 0; b < rows_.size(); ++b) {
      const std::vector<std::uint64_t>& h = model.history(static_cast<int>(b));
      auto& mine = rows_[b];
      const bool extends = mine && step.op != StepOp::reset && mine->size() <= h.size() && !shared(b);
      if (!extends)
        mine = std::make_shared<std::vector<std::uint64_t>>(h);
      else
        mine->insert(mine->end(), h.begin() + static_cast<std::ptrdiff_t>(mine->size()), h.end());
      out.emplace_back(mine, h.size());
    }
    return out;
  }

 private:
  bool shared(std::size_t b) const {
    for (std::size_t o = 0; o < rows_.size(); ++o)
      if (o != b && rows_[o] == rows_[b]) return true;
    return false;
  }
  std::vector<std::shared_ptr<std::vector<std::uint64_t>>> rows_;
};

}  // namespace

struct ReferenceStepper::State {
  reference::ReferenceModel model;
  SharedHistories histories;
};

ReferenceStepper::ReferenceStepper(const Scenario& s, const InputTable& inputs, std::vector<bool> attend)
    : scenario_(s),
      state_(new State{
          reference::ReferenceModel(s.dims, s.rope, s.layer_policies, s.softmax_scale(), inputs, s.attention), {}}),
      attend_(std::move(attend)) {
  if (s.kv_quant) state_->model.store_as(*s.kv_quant, s.kv_dtype);
}

ReferenceStepper::~ReferenceStepper() = default;

bool ReferenceStepper::done() const { return next_ >= scenario_.steps.size(); }

StepRecord ReferenceStepper::next() {
  const std::size_t i = next_++;
  const Step& step = scenario_.steps.at(i);
  reference::ReferenceModel& model = state_->model;
  StepRecord record{step, model.batch(), {}, {}, {}, {}, {}, {}, {}};
  try {
    switch (step.op) {
      case StepOp::append:
        record.append = model.append(step.tokens, attend_.empty() || attend_.at(i));
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
      problems_.push_back(fmt::format("{}: expected the error \"{}\", but the step was accepted", step_label(step, i),
                                      step.expect_error));
  } catch (const reference::StepRefused& e) {
    record.refused = e.code;
    record.refusal_message = e.what();
    if (e.code != step.expect_error)
      problems_.push_back(fmt::format("{}: refused with \"{}\" ({}){}", step_label(step, i), e.code, e.what(),
                                      step.expect_error.empty() ? ", which the scenario does not expect"
                                                                : ", expected \"" + step.expect_error + "\""));
  }
  for (int b = 0; b < model.batch(); ++b) record.retained.push_back(model.retained(b));
  if (model.hybrid()) {
    record.layer_retained.resize(static_cast<std::size_t>(scenario_.dims.layers));
    for (int l = 0; l < scenario_.dims.layers; ++l)
      for (int b = 0; b < model.batch(); ++b)
        record.layer_retained[static_cast<std::size_t>(l)].push_back(model.retained(b, l));
  }
  record.histories = state_->histories.after(step, model);
  if (const reference::StoredKv* stored = model.stored()) {
    record.stored.resize(static_cast<std::size_t>(scenario_.dims.layers));
    for (int l = 0; l < scenario_.dims.layers; ++l)
      for (int b = 0; b < model.batch(); ++b) {
        auto& keys = record.stored[static_cast<std::size_t>(l)].emplace_back();
        for (const reference::RetainedKey& key : record.retained_in(l, b).keys) keys.push_back(stored->at(b, l, key.index));
      }
  }
  return record;
}

ReferenceRun run_reference(const Scenario& s, const InputTable& inputs) {
  require_whole_run_fits(s);  // every step is kept: refuse before spending the memory
  ReferenceRun run;
  ReferenceStepper stepper(s, inputs);
  Progress& progress = Progress::line();
  progress.begin(s.name + ": reference", s.steps.size(), count_uids(s));
  std::int64_t tokens = 0;
  while (!stepper.done()) {
    run.steps.push_back(stepper.next());
    if (run.steps.back().append)
      for (const auto& row : run.steps.back().append->rows) tokens += static_cast<std::int64_t>(row.size());
    progress.advance(run.steps.size() - 1, tokens);
  }
  run.problems = stepper.problems();
  return run;
}

}  // namespace kvcheck
