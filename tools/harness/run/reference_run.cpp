#include "tools/harness/run/reference_run.h"

#include <fmt/format.h>

#include <map>
#include <set>
#include <span>

#include "reference/prefix_reuse.h"
#include "tools/harness/scenario/content_keys.h"
#include "tools/harness/io/progress.h"

namespace kvcheck {

std::string step_label(const Step& step, std::size_t index) {
  return fmt::format("step {} ({}, /steps/{})", index, step.source_op, step.source_index);
}

std::string step_label(const StepRecord& record, std::size_t index) {
  const std::string step = step_label(record.step, index);
  return record.forward > 0 ? fmt::format("{} after forward {}", step, record.forward) : step;
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
      // A prune rewrites the row in place (SPEC 11): a vector of its own.
      const bool extends = mine && step.op != StepOp::reset && step.op != StepOp::prune && mine->size() <= h.size() &&
                           !shared(b);
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
  std::optional<reference::PrefixBlocks> prefix_blocks;  // paged scenarios with a prefix cache
  // Under scales frozen per row with a prefix cache: what each token (by context key) was
  // stored as by the first row that wrote it; ambiguous when another row stored it otherwise.
  struct Written {
    std::vector<reference::StoredLayer> layers;
    bool ambiguous = false;
  };
  std::map<std::uint64_t, Written> written;
};

namespace {

std::vector<std::uint64_t> row_contexts(const Scenario& s, const std::vector<std::uint64_t>& uids) {
  std::vector<std::uint64_t> out;
  out.reserve(uids.size());
  for (std::uint64_t u : uids) out.push_back(context_key(s, u));
  return out;
}

// Each layer's rows as their histories leave them (retained_of, a pure function of the
// history); a layer whose policy an earlier layer has shares that layer's vector.
std::vector<std::shared_ptr<const std::vector<reference::RowRetained>>> retained_by_layer(
    const Scenario& s, const std::vector<RowHistory>& histories) {
  std::vector<std::shared_ptr<const std::vector<reference::RowRetained>>> out;
  for (int l = 0; l < s.dims.layers; ++l) {
    const auto first = s.policies.begin();
    const auto same = std::find(first, first + l, s.policy(l));
    if (same != first + l) {
      out.push_back(out[static_cast<std::size_t>(same - first)]);
      continue;
    }
    auto rows = std::make_shared<std::vector<reference::RowRetained>>();
    for (const RowHistory& h : histories)
      rows->push_back(reference::retained_of(s.policy(l), std::span<const std::uint64_t>(h.begin(), h.size())));
    out.push_back(std::move(rows));
  }
  return out;
}

// SPEC 9: what each retained token is stored as ([layer][row][i] for the i-th key of the
// row's retained set) and, for a chunked layer, each of the row's last C tokens its ring
// may still hold outside the retained set. `strict`: false when a retained token was never
// written (else it is taken as the store holds it).
bool stored_values(const Scenario& s, const reference::StoredKv& stored, bool strict,
                   const std::vector<std::shared_ptr<const std::vector<reference::RowRetained>>>& retained,
                   const std::vector<RowHistory>& histories,
                   std::vector<std::vector<std::vector<reference::StoredLayer>>>& out,
                   std::vector<std::vector<std::vector<std::pair<std::int64_t, reference::StoredLayer>>>>& ring) {
  out.assign(static_cast<std::size_t>(s.dims.layers), {});
  ring.assign(static_cast<std::size_t>(s.dims.layers), {});
  for (int l = 0; l < s.dims.layers; ++l)
    for (std::size_t b = 0; b < histories.size(); ++b) {
      const int row = static_cast<int>(b);
      const auto& kept = retained[static_cast<std::size_t>(l)]->at(b).keys;
      auto& keys = out[static_cast<std::size_t>(l)].emplace_back();
      for (const reference::RetainedKey& key : kept) {
        if (strict && !stored.written(row, l, key.index)) return false;
        keys.push_back(stored.at(row, l, key.index));
      }
      if (s.policy(l).kind != PolicyKind::chunked) continue;
      auto& held = ring[static_cast<std::size_t>(l)].emplace_back();
      const auto n = static_cast<std::int64_t>(histories[b].size());
      const std::int64_t first_kept = kept.empty() ? n : kept.front().index;  // a chunk: a run to the row's end
      for (std::int64_t i = std::max<std::int64_t>(0, n - s.policy(l).window); i < first_kept; ++i)
        if (stored.written(row, l, i)) held.emplace_back(i, stored.at(row, l, i));
    }
  return true;
}

// A refused crop as a cache that still held the tokens would serve it: every row cut to
// `length`, its retained set that of the cut history under each layer's policy.
std::shared_ptr<const StepRecord::ServedCrop> served_crop(const Scenario& s, const std::vector<RowHistory>& histories,
                                                          std::int64_t length, const reference::StoredKv* stored) {
  auto served = std::make_shared<StepRecord::ServedCrop>();
  for (const RowHistory& h : histories) served->histories.push_back(h.prefix(static_cast<std::size_t>(length)));
  served->retained = retained_by_layer(s, served->histories);
  // Quantized, a token of the cut rows that was never written leaves nothing to judge
  // its slot by: no served state, and accepting the crop stays a refusal mismatch.
  if (stored && !stored_values(s, *stored, true, served->retained, served->histories, served->stored, served->stored_ring))
    return nullptr;
  return served;
}

}  // namespace

// SPEC 8.4: the largest legitimate hit of each row the append starts, and what the step's
// writes make hittable from the next step on.
void ReferenceStepper::account_prefix_hits(StepRecord& record, const std::vector<std::int64_t>& lengths_before) {
  const Scenario& s = scenario_;
  auto& blocks = state_->prefix_blocks;
  const reference::ReferenceModel& model = state_->model;
  const auto B = static_cast<std::size_t>(model.batch());
  record.largest_hit.assign(B, 0);
  record.largest_hit_same_step.assign(B, 0);
  std::vector<std::vector<std::uint64_t>> added(B);  // context keys of each row's new tokens
  for (std::size_t b = 0; b < B; ++b) {
    const std::vector<std::uint64_t>& uids = model.history(static_cast<int>(b));
    for (std::size_t t = static_cast<std::size_t>(lengths_before[b]); t < uids.size(); ++t)
      added[b].push_back(context_key(s, uids[t]));
    if (blocks && lengths_before[b] == 0) record.largest_hit[b] = blocks->largest_hit(added[b]);
  }
  if (blocks) {
    for (std::size_t b = 0; b < B; ++b) {
      if (lengths_before[b] != 0) continue;
      std::set<std::uint64_t> others;  // full blocks the step's other rows write
      for (std::size_t c = 0; c < B; ++c)
        if (c != b) others.merge(blocks->full_blocks(added[c], lengths_before[c]));
      record.largest_hit_same_step[b] = blocks->largest_hit(added[b], others);
    }
    for (std::size_t b = 0; b < B; ++b) blocks->written(added[b], lengths_before[b]);
    blocks->end_step();
  }
  for (std::size_t b = 0; b < B; ++b) {
    const auto& expect = record.step.expect_hit;
    if (!expect.empty() && expect[b] && expect[b]->min > record.largest_hit[b])
      problems_.push_back(fmt::format(
          "{}: row {} expects a prefix hit of at least {} tokens, but at most {} are legitimate (SPEC 8.4: leading "
          "full blocks written in earlier steps with equal context keys, the last token computed{})",
          step_label(record.step, next_ - 1), b, expect[b]->min, record.largest_hit[b],
          s.paging->prefix_cache ? "" : "; prefix_cache is off"));
  }
}

// SPEC 8.4 with 9's "first_append": a starting row's hit tokens hold what their writer
// stored, its codes and its frozen scale, not the row's own. The reference must know the
// hit, so the scenario gives each starting row's exact expect_hit. Returns each row's hit.
std::vector<std::int64_t> ReferenceStepper::adopt_prefix_hits(const Step& step) {
  reference::ReferenceModel& model = state_->model;
  const auto B = static_cast<std::size_t>(model.batch());
  std::vector<std::int64_t> hits(B, 0);
  std::uint64_t uid = model.next_uid();  // uids: row order, then order inside the chunk
  for (std::size_t b = 0; b < B; ++b) {
    const std::int64_t count = step.tokens.size() == 1 ? step.tokens[0] : step.tokens.at(b);
    const std::uint64_t first = uid;
    uid += static_cast<std::uint64_t>(std::max<std::int64_t>(count, 0));
    if (count <= 0 || !model.history(static_cast<int>(b)).empty()) continue;
    const auto& expect = step.expect_hit;
    if (b >= expect.size() || !expect[b]) {
      problems_.push_back(fmt::format(
          "{}: row {} starts under a scale frozen at its first append with a prefix cache: give its exact expect_hit "
          "(0 for none), so the reference knows which tokens keep their writer's scale",
          step_label(step, next_ - 1), b));
      continue;
    }
    for (std::int64_t i = 0; i < expect[b]->min; ++i) {
      const auto found = state_->written.find(context_key(scenario_, first + static_cast<std::uint64_t>(i)));
      if (found == state_->written.end() || found->second.ambiguous) {
        problems_.push_back(fmt::format(
            "{}: row {} expects a prefix hit of {} tokens, but its token {} {}", step_label(step, next_ - 1), b,
            expect[b]->min, i,
            found == state_->written.end()
                ? "was never written before"
                : "was written by two rows with different frozen scales: which copy a cache keeps is not defined"));
        break;
      }
      model.adopt_stored(static_cast<int>(b), i, found->second.layers);
      hits[b] = i + 1;
    }
  }
  return hits;
}

// What each row stored itself in the append (not its hit), under the first writer's name.
void ReferenceStepper::record_writes(const std::vector<std::int64_t>& lengths_before,
                                     const std::vector<std::int64_t>& hits) {
  const reference::ReferenceModel& model = state_->model;
  const reference::StoredKv& stored = *model.stored();
  for (int b = 0; b < model.batch(); ++b) {
    const std::vector<std::uint64_t>& uids = model.history(b);
    for (std::size_t t = static_cast<std::size_t>(std::max(lengths_before[static_cast<std::size_t>(b)],
                                                           hits[static_cast<std::size_t>(b)]));
         t < uids.size(); ++t) {
      std::vector<reference::StoredLayer> layers;
      for (int l = 0; l < scenario_.dims.layers; ++l) layers.push_back(stored.at(b, l, static_cast<std::int64_t>(t)));
      const auto [at, fresh] = state_->written.try_emplace(context_key(scenario_, uids[t]), State::Written{layers, false});
      if (fresh) continue;
      for (int l = 0; l < scenario_.dims.layers; ++l)
        for (std::size_t g = 0; g < layers[static_cast<std::size_t>(l)].heads.size(); ++g) {
          const auto& mine = layers[static_cast<std::size_t>(l)].heads[g];
          const auto& first = at->second.layers[static_cast<std::size_t>(l)].heads[g];
          const auto same = [](const reference::QuantizedRow& x, const reference::QuantizedRow& y) {
            return x.codes == y.codes && x.scales == y.scales && x.zeros == y.zeros && x.biases == y.biases;
          };
          if (!same(mine.key_codes, first.key_codes) || !same(mine.value_codes, first.value_codes))
            at->second.ambiguous = true;
        }
    }
  }
}

ReferenceStepper::ReferenceStepper(const Scenario& s, const InputTable& inputs, std::vector<bool> attend)
    : scenario_(s),
      state_(new State{
          reference::ReferenceModel(s.dims, s.ropes, s.policies, s.softmax_scale(), inputs, s.attention), {}, {}, {}}),
      attend_(std::move(attend)) {
  if (s.quantized()) state_->model.store_as(s.quants, s.kv_dtype);
  if (s.paging && s.paging->prefix_cache) state_->prefix_blocks.emplace(s.paging->block_size, s.paging->token_reuse);
}

ReferenceStepper::~ReferenceStepper() = default;

bool ReferenceStepper::done() const { return next_ >= scenario_.steps.size(); }

StepRecord ReferenceStepper::next() {
  const std::size_t i = next_++;
  const Step& step = scenario_.steps.at(i);
  reference::ReferenceModel& model = state_->model;
  StepRecord record;
  record.step = step;
  record.batch_before = model.batch();
  try {
    switch (step.op) {
      case StepOp::append: {
        std::vector<std::int64_t> before;
        for (int b = 0; b < model.batch(); ++b) before.push_back(static_cast<std::int64_t>(model.history(b).size()));
        const bool adopts = any_frozen_scales(scenario_) && scenario_.paging && scenario_.paging->prefix_cache;
        const std::vector<std::int64_t> hits = adopts ? adopt_prefix_hits(step) : std::vector<std::int64_t>{};
        record.append = model.append(step.tokens, attend_.empty() || attend_.at(i));
        if (adopts) record_writes(before, hits);
        if (scenario_.paging) account_prefix_hits(record, before);
        break;
      }
      case StepOp::free_rows:
        model.free_rows(step.rows);
        break;
      case StepOp::preempt:  // paging changes nothing of the row (SPEC 8.6)
      case StepOp::resume:
        break;
      case StepOp::evict:
        if (state_->prefix_blocks && step.evict_blocks < 0) {
          std::vector<std::vector<std::uint64_t>> rows;
          for (int b = 0; b < model.batch(); ++b) rows.push_back(row_contexts(scenario_, model.history(b)));
          state_->prefix_blocks->keep_only(rows);
        }
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
      case StepOp::prune:
        if (step.prune_keep > 0)
          model.prune_observed(step.prune_keep, step.rerotate);  // SPEC 11.1: the cache chooses the kept
        else
          model.prune(step.prune_sinks, step.prune_recent, step.rerotate);
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
  preempted_.resize(static_cast<std::size_t>(model.batch()), false);
  if (step.op == StepOp::reset || step.op == StepOp::reorder)
    preempted_.assign(static_cast<std::size_t>(model.batch()), false);
  for (int b : step.rows)
    if (step.op == StepOp::preempt || step.op == StepOp::resume || step.op == StepOp::free_rows)
      preempted_[static_cast<std::size_t>(b)] = step.op == StepOp::preempt;
  record.preempted = preempted_;
  record.histories = state_->histories.after(step, model);
  record.retained = retained_by_layer(scenario_, record.histories);
  if (step.op == StepOp::crop && !record.refused.empty())
    record.served = served_crop(scenario_, record.histories, step.length, model.stored());
  if (const reference::StoredKv* stored = model.stored()) {
    stored_values(scenario_, *stored, false, record.retained, record.histories, record.stored, record.stored_ring);
    // Between two forwards a row holds what one of its appended tokens saw.
    if (step.op == StepOp::append && step.chunk > 0 && record.append) {
      record.stored_window.resize(static_cast<std::size_t>(scenario_.dims.layers));
      record.stored_from.resize(static_cast<std::size_t>(scenario_.dims.layers));
      for (int l = 0; l < scenario_.dims.layers; ++l)
        for (int b = 0; b < model.batch(); ++b) {
          const auto end = static_cast<std::int64_t>(model.history(b).size());
          std::int64_t from = end;
          for (const reference::AppendedToken& token : record.append->rows[static_cast<std::size_t>(b)])
            for (const reference::VisibleKey& key : token.view_in(l).keys) from = std::min(from, key.index);
          auto& window = record.stored_window[static_cast<std::size_t>(l)].emplace_back();
          for (std::int64_t t = from; t < end; ++t) window.push_back(stored->at(b, l, t));
          record.stored_from[static_cast<std::size_t>(l)].push_back(from);
        }
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
