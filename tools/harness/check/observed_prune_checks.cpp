#include "tools/harness/check/observed_prune_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <set>
#include <span>
#include <stdexcept>

#include "tools/harness/check/hypotheses.h"
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
  for (int b = 0; b < static_cast<int>(record.rows()); ++b) {
    const RowHistory& history = record.histories[static_cast<std::size_t>(b)];
    if (history.empty() || !run_of(history).observed || rows_.count(history[0])) continue;
    read_row(record, view, b, evidence);
  }
}

void ObservedPruneChecks::read_row(const StepRecord& record, const CacheView& view, int b, StepEvidence& evidence) {
  const RowHistory& history = record.histories[static_cast<std::size_t>(b)];
  const reference::PrunedRun run = run_of(history);
  const std::int64_t keep = run.first, prompt = run.end;
  // The prune that made the run: the last observed one at or before this step.
  Required required{0, 0, 0};
  for (const Required& r : prunes_)
    if (r.step <= evidence.step) required = r;
  const std::int64_t sinks = std::min(required.sinks, prompt), recent = std::min(required.recent, prompt);
  Kept& kept = rows_[history[0]];
  kept.resize(view.layers.size());
  for (std::size_t l = 0; l < view.layers.size(); ++l) {
    if (s_.policy(static_cast<int>(l)).kind != PolicyKind::full) continue;  // a window layer keeps its policy's
    const auto& heads = view.layers[l].slots[static_cast<std::size_t>(b)];
    for (std::size_t g = 0; g < heads.size(); ++g) {
      std::set<std::int64_t> indices;  // the prompt tokens the head holds
      for (const ViewSlot& v : heads[g])
        if (const std::int64_t t = v.uid >= 0 ? index_of(history, v.uid) : -1; t >= 0 && t < prompt) indices.insert(t);
      const auto held = static_cast<std::int64_t>(indices.size());
      ++heads_read_;
      if (held != keep) {
        ++failures_;
        if (first_.empty())
          first_ = fmt::format("{}: layer {} row {} kv head {} holds {} of its {} prompt tokens, the prune keeps {}",
                               evidence.label, l, b, g, held, prompt, keep);
        evidence.kept_counts.push_back({static_cast<int>(l), b, static_cast<int>(g), held, keep, prompt});
      }
      // The required tokens are kept whether held or not: one not held is then lost, a
      // dropped live token, in the slot check.
      for (std::int64_t t = 0; t < sinks; ++t) indices.insert(t);
      for (std::int64_t t = prompt - recent; t < prompt; ++t) indices.insert(t);
      std::vector<reference::RetainedKey> keys;
      for (const std::int64_t t : indices) {
        const auto rank = static_cast<std::int64_t>(keys.size());
        keys.push_back({history[static_cast<std::size_t>(t)], t, run.rerotated ? rank : t});
      }
      kept[l].push_back(std::move(keys));
    }
  }
}

const ObservedPruneChecks::Kept* ObservedPruneChecks::kept_of(const StepRecord& record, int row) const {
  const RowHistory& history = record.histories[static_cast<std::size_t>(row)];
  if (history.empty() || !run_of(history).observed) return nullptr;
  const auto it = rows_.find(history[0]);
  return it == rows_.end() ? nullptr : &it->second;
}

void ObservedPruneChecks::chosen_keys(const StepRecord& record, int layer, int row, int kv_head,
                                      std::vector<reference::RetainedKey>& keys) const {
  const Kept* kept = kept_of(record, row);
  if (kept == nullptr || static_cast<std::size_t>(layer) >= kept->size()) return;
  const auto& heads = (*kept)[static_cast<std::size_t>(layer)];
  if (static_cast<std::size_t>(kv_head) < heads.size())
    keys.insert(keys.end(), heads[static_cast<std::size_t>(kv_head)].begin(), heads[static_cast<std::size_t>(kv_head)].end());
}

void ObservedPruneChecks::rule_outputs(const StepRecord& record, int layer, int row, const float*,
                                       OutputRule& rule) const {
  const RowHistory& history = record.histories[static_cast<std::size_t>(row)];
  if (!record.append || s_.policy(layer).kind != PolicyKind::full || history.empty() || !run_of(history).observed)
    return;
  // check() read the sets from this very step's view, before any output is compared.
  const Kept* kept = kept_of(record, row);
  if (kept == nullptr || (*kept)[static_cast<std::size_t>(layer)].empty())
    throw std::logic_error("outputs after an observed prune (SPEC 11.1) before its kept sets were read");
  if (!rule.expected.empty()) throw std::logic_error("two sub-checks set the expected outputs (OutputRule)");
  // The reference's attention over each kv head's kept keys and the later tokens, in the
  // layout compare_outputs reads: [L, B, n, H, D].
  const reference::AppendResult& ref = *record.append;
  const int H = s_.dims.heads, D = s_.dims.head_dim, group = s_.dims.heads / s_.dims.kv_heads;
  const std::size_t B = ref.rows.size(), n = static_cast<std::size_t>(ref.chunk);
  const auto& tokens = ref.rows[static_cast<std::size_t>(row)];
  const std::size_t pad = n - tokens.size();
  rule.expected.assign(ref.out.size(), std::numeric_limits<double>::quiet_NaN());
  std::vector<std::uint64_t> uids(history.size());  // a prune's marks dropped: inputs are read by uid
  for (std::size_t t = 0; t < uids.size(); ++t) uids[t] = history[t];
  const auto& heads = (*kept)[static_cast<std::size_t>(layer)];
  for (std::size_t g = 0; g < heads.size(); ++g) {
    const std::vector<reference::AppendedToken> seen = with_chosen_keys(tokens, layer, heads[g]);
    for (std::size_t i = 0; i < seen.size(); ++i)
      for (int h = static_cast<int>(g) * group; h < (static_cast<int>(g) + 1) * group; ++h) {
        const std::vector<double> out = output_over_view(s_, inputs_, uids, seen[i], layer, h);
        const std::size_t at =
            ((((static_cast<std::size_t>(layer) * B + static_cast<std::size_t>(row)) * n + pad + i) * H + h) * D);
        std::copy(out.begin(), out.end(), rule.expected.begin() + static_cast<std::ptrdiff_t>(at));
        ++outputs_over_kept_;
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
