#include "tools/harness/check/observed_prune_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <stdexcept>

#include "reference/attention.h"
#include "reference/rope.h"
#include "tools/harness/check/step_checker.h"

namespace kvcheck {
namespace {

// The row's prune run, observed or not (an empty run when the row was never pruned).
reference::PrunedRun run_of(const RowHistory& history) {
  return reference::PrunedRun::of(std::span<const std::uint64_t>(history.begin(), history.size()));
}

}  // namespace

std::vector<reference::AppendedToken> with_chosen_keys(std::span<const reference::AppendedToken> tokens, int layer,
                                                       const std::vector<reference::RetainedKey>& chosen) {
  std::vector<reference::AppendedToken> out(tokens.begin(), tokens.end());
  for (reference::AppendedToken& token : out) {
    reference::QueryView& view = token.layer_views.empty() ? token.view : token.layer_views[static_cast<std::size_t>(layer)];
    std::vector<reference::VisibleKey> keys;
    for (const reference::RetainedKey& key : chosen) keys.push_back({key.index, key.position});
    keys.insert(keys.end(), view.keys.begin(), view.keys.end());
    view.keys = std::move(keys);
  }
  return out;
}

ObservedPruneChecks::ObservedPruneChecks(const Scenario& scenario, const InputTable& inputs)
    : s_(scenario), inputs_(inputs) {
  for (std::size_t i = 0; i < scenario.steps.size(); ++i)
    if (const Step& step = scenario.steps[i]; step.op == StepOp::prune && step.prune_keep > 0)
      prunes_.push_back({i, step.prune_sinks, step.prune_recent});
}

void ObservedPruneChecks::check(const StepRecord& record, CacheView& view, StepEvidence& evidence) {
  if (prunes_.empty()) return;
  // Rows as this step numbers them: the same row, one a reorder moved or forked here (a
  // fork holds its origin's cells), or a row pruned since and read now. Rows forked before
  // their prune share a first uid yet were pruned apart: each is read on its own.
  std::vector<std::optional<Row>> before = std::move(rows_);
  rows_.assign(record.rows(), std::nullopt);
  for (int b = 0; b < static_cast<int>(record.rows()); ++b) {
    const RowHistory& history = record.histories[static_cast<std::size_t>(b)];
    if (history.empty() || !run_of(history).observed) continue;
    const auto same = [&](const std::optional<Row>& r) { return r && r->first_uid == history[0]; };
    const auto at = static_cast<std::size_t>(b);
    const auto found = at < before.size() && same(before[at]) ? before.begin() + static_cast<std::ptrdiff_t>(at)
                                                              : std::find_if(before.begin(), before.end(), same);
    if (found != before.end()) {
      rows_[at] = *found;
      rows_[at]->fresh = false;
    } else {
      rows_[at] = read_row(record, view, b, evidence);
    }
  }
}

ObservedPruneChecks::Row ObservedPruneChecks::read_row(const StepRecord& record, const CacheView& view, int b,
                                                       StepEvidence& evidence) {
  const RowHistory& history = record.histories[static_cast<std::size_t>(b)];
  const reference::PrunedRun run = run_of(history);
  const std::int64_t keep = run.first, prompt = run.end;
  // The prune that made the run: the last observed one at or before this step.
  Required required{0, 0, 0};
  for (const Required& r : prunes_)
    if (r.step <= evidence.step) required = r;
  const std::int64_t sinks = std::min(required.sinks, prompt), recent = std::min(required.recent, prompt);
  Row row;
  row.first_uid = history[0];
  row.fresh = true;
  row.kept.resize(view.layers.size());
  row.missing.resize(view.layers.size());
  for (std::size_t l = 0; l < view.layers.size(); ++l) {
    if (s_.policy(static_cast<int>(l)).kind != PolicyKind::full) continue;  // a window layer keeps its policy's
    const auto& heads = view.layers[l].slots[static_cast<std::size_t>(b)];
    for (std::size_t g = 0; g < heads.size(); ++g) {
      std::set<std::int64_t> held;  // the prompt tokens the head holds
      for (const ViewSlot& v : heads[g])
        if (const std::int64_t t = v.uid >= 0 ? index_of(history, v.uid) : -1; t >= 0 && t < prompt) held.insert(t);
      ++heads_read_;
      if (static_cast<std::int64_t>(held.size()) != keep) {
        ++failures_;
        if (first_.empty())
          first_ = fmt::format("{}: layer {} row {} kv head {} holds {} of its {} prompt tokens, the prune keeps {}",
                               evidence.label, l, b, g, held.size(), prompt, keep);
        evidence.kept_counts.push_back(
            {static_cast<int>(l), b, static_cast<int>(g), static_cast<std::int64_t>(held.size()), keep, prompt});
      }
      std::vector<reference::RetainedKey> kept, missing;
      for (const std::int64_t t : held) {
        const auto rank = static_cast<std::int64_t>(kept.size());
        kept.push_back({history[static_cast<std::size_t>(t)], t, run.rerotated ? rank : t});
      }
      // A required token not held is lost at this step (a dropped live token).
      for (std::int64_t t = 0; t < prompt; ++t)
        if ((t < sinks || t >= prompt - recent) && !held.count(t))
          missing.push_back({history[static_cast<std::size_t>(t)], t, t});
      row.kept[l].push_back(std::move(kept));
      row.missing[l].push_back(std::move(missing));
    }
  }
  return row;
}

const ObservedPruneChecks::Row* ObservedPruneChecks::row_of(const StepRecord& record, int row) const {
  if (prunes_.empty() || static_cast<std::size_t>(row) >= rows_.size()) return nullptr;
  const auto& r = rows_[static_cast<std::size_t>(row)];
  const RowHistory& history = record.histories[static_cast<std::size_t>(row)];
  return r && !history.empty() && r->first_uid == history[0] ? &*r : nullptr;
}

void ObservedPruneChecks::chosen_keys(const StepRecord& record, int layer, int row, int kv_head,
                                      std::vector<reference::RetainedKey>& keys) const {
  const Row* r = row_of(record, row);
  const auto l = static_cast<std::size_t>(layer), g = static_cast<std::size_t>(kv_head);
  if (r == nullptr || l >= r->kept.size() || g >= r->kept[l].size()) return;
  keys.insert(keys.end(), r->kept[l][g].begin(), r->kept[l][g].end());
  if (r->fresh) keys.insert(keys.end(), r->missing[l][g].begin(), r->missing[l][g].end());
}

void ObservedPruneChecks::rule_outputs(const StepRecord& record, int layer, int row, const float*,
                                       OutputRule& rule) const {
  if (prunes_.empty() || !record.append || s_.policy(layer).kind != PolicyKind::full) return;
  const RowHistory& history = record.histories[static_cast<std::size_t>(row)];
  if (history.empty() || !run_of(history).observed) return;
  // check() read the sets from this very step's view, before any output is compared.
  const Row* kept_row = row_of(record, row);
  const auto l = static_cast<std::size_t>(layer);
  if (kept_row == nullptr || kept_row->kept[l].empty())
    throw std::logic_error("outputs after an observed prune (SPEC 11.1) before its kept sets were read");
  if (!rule.expected.empty()) throw std::logic_error("two sub-checks set the expected outputs (OutputRule)");
  // The reference's attention (5.1) over each kv head's kept keys and the later tokens, in
  // the layout compare_outputs reads, [L, B, n, H, D]. Each key is rotated once per call.
  const reference::AppendResult& ref = *record.append;
  const int H = s_.dims.heads, D = s_.dims.head_dim, group = s_.dims.heads / s_.dims.kv_heads;
  const auto Ds = static_cast<std::size_t>(D);
  const std::size_t B = ref.rows.size(), n = static_cast<std::size_t>(ref.chunk);
  const auto& tokens = ref.rows[static_cast<std::size_t>(row)];
  const std::size_t pad = n - tokens.size();
  const Rope& rope = s_.rope(layer);
  rule.expected.assign(ref.out.size(), std::numeric_limits<double>::quiet_NaN());
  if (tokens.empty()) return;
  const auto rotated = [&](const float* x, std::int64_t position) {
    return reference::rotate(std::vector<double>(x, x + D), static_cast<double>(position), rope);
  };
  const reference::QueryView& last = tokens.back().view_in(layer);  // a full layer: every later key
  std::vector<double> scores, out(Ds), keys, values;
  for (std::size_t g = 0; g < kept_row->kept[l].size(); ++g) {
    // index -> (rotated key, value) of every key a token of this append may see
    std::map<std::int64_t, std::pair<std::vector<double>, const float*>> known;
    const auto learn = [&](std::int64_t index, std::uint64_t uid, std::int64_t position) {
      known.try_emplace(index, rotated(inputs_.k_at(layer, uid, static_cast<int>(g)), position),
                        inputs_.v_at(layer, uid, static_cast<int>(g)));
    };
    for (const reference::RetainedKey& key : kept_row->kept[l][g]) learn(key.index, key.uid, key.position);
    for (const reference::VisibleKey& key : last.keys) learn(key.index, history[static_cast<std::size_t>(key.index)], key.position);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const reference::QueryView& view = tokens[i].view_in(layer);
      keys.clear();
      values.clear();
      const auto take = [&](std::int64_t index) {
        const auto& [key, value] = known.at(index);
        keys.insert(keys.end(), key.begin(), key.end());
        values.insert(values.end(), value, value + D);
      };
      for (const reference::RetainedKey& key : kept_row->kept[l][g]) take(key.index);
      for (const reference::VisibleKey& key : view.keys) take(key.index);
      const std::size_t count = keys.size() / Ds;
      scores.resize(count);
      for (int h = static_cast<int>(g) * group; h < (static_cast<int>(g) + 1) * group; ++h) {
        std::vector<double> q = rotated(inputs_.q_at(layer, tokens[i].uid, h), view.query_position);
        if (s_.attention.query_temperature && rope.nope)
          for (double& x : q) x *= reference::query_temperature(*s_.attention.query_temperature, view.query_position);
        const double* sink = s_.attention.sink_logits.empty()
                                 ? nullptr
                                 : &s_.attention.sink_logits[l][static_cast<std::size_t>(h)];
        reference::attend(q.data(), keys.data(), values.data(), count, Ds, s_.softmax_scale(), sink, scores.data(),
                          out.data());
        const std::size_t at = (((l * B + static_cast<std::size_t>(row)) * n + pad + i) * H + h) * Ds;
        std::copy(out.begin(), out.end(), rule.expected.begin() + static_cast<std::ptrdiff_t>(at));
        if (record.forward == 0) ++outputs_over_kept_;  // a forward's outputs are counted with its step
      }
    }
  }
}

void ObservedPruneChecks::add_checks(Outcome& outcome) const {
  if (heads_read_ == 0) return;
  outcome.checks.push_back(
      {"kept by the press", failures_ == 0,
       failures_ ? first_
                 : fmt::format("{} kv heads of full layers each kept the prune's count of prompt tokens, its sinks and "
                               "recent tokens among them, and {} outputs (token, head) after it were expected over "
                               "those sets (SPEC 11.1; which tokens a press should keep is not judged)",
                               heads_read_, outputs_over_kept_)});
}

}  // namespace kvcheck
