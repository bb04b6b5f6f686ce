#include "tools/harness/check/reference_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace kvcheck {
namespace {

using reference::AppendedToken;

// Copies uid `from` of `src` to uid `to` of `dst` in every layer and tensor.
void copy_uid(const InputTable& src, std::uint64_t from, InputTable& dst, std::uint64_t to) {
  for (int l = 0; l < src.layers; ++l) {
    for (int h = 0; h < src.heads; ++h) std::copy_n(src.q_at(l, from, h), src.head_dim, dst.q_at(l, to, h));
    for (int h = 0; h < src.kv_heads; ++h) {
      std::copy_n(src.k_at(l, from, h), src.head_dim, dst.k_at(l, to, h));
      std::copy_n(src.v_at(l, from, h), src.head_dim, dst.v_at(l, to, h));
    }
  }
}

bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

// Every view of one append step obeys the policy's bounds: the token sees itself, keys
// are earlier tokens, positions are non-negative and never beyond the query's, distances
// inside the window are the true ones, and a windowed policy never sees more than its
// window. Returns the first violation, or "".
std::string bounds_violation(const Scenario& s, const StepRecord& rec, std::size_t i) {
  const auto& rows = rec.append->rows;
  for (int l = 0; l < (s.hybrid() ? s.dims.layers : 1); ++l)  // equal policies: equal views
  for (int b = 0; b < static_cast<int>(rows.size()); ++b) {
    const RowHistory& h = rec.histories[static_cast<std::size_t>(b)];
    // A re-rotating prune (SPEC 11) closes the distance over the pruned tokens.
    const reference::PrunedRun pruned = reference::PrunedRun::of(std::span<const std::uint64_t>(h.begin(), h.size()));
    for (const AppendedToken& token : rows[b]) {
      const Policy& p = s.policy(l);
      auto fail = [&](const std::string& what) {
        return fmt::format("{}: {}row {} token {} (uid {}): {}", step_label(rec.step, i),
                           s.hybrid() ? fmt::format("layer {} ", l) : "", b, token.index, token.uid, what);
      };
      const auto moved = [&](std::int64_t index) { return p.kind == PolicyKind::full ? pruned.shift(index) : 0; };
      const auto& keys = token.view_in(l).keys;
      const std::int64_t pq = token.view_in(l).query_position;
      if (keys.empty() || keys.back().index != token.index) return fail("does not see itself");
      if (pq < 0) return fail(fmt::format("negative query position {}", pq));
      const bool windowed = p.kind != PolicyKind::full && p.prefill == Prefill::streaming;
      if (windowed && static_cast<std::int64_t>(keys.size()) > p.window)
        return fail(fmt::format("sees {} keys, more than the window {}", keys.size(), p.window));
      for (const auto& key : keys) {
        const bool sink = p.kind == PolicyKind::sink && key.index < p.sinks;
        if (key.index < 0 || key.index > token.index || key.position < 0 || key.position > pq ||
            (!sink && pq - key.position != token.index - key.index - moved(token.index) + moved(key.index)))
          return fail(fmt::format("key {} at position {} with query position {}", key.index, key.position, pq));
      }
    }
  }
  return "";
}

// `sink` with S = 0, k = 1 and shifted positions has the relative distances of `sliding`.
bool sink_zero_applies(const Policy& p) {
  return p.kind == PolicyKind::sink && p.sinks == 0 && p.evict == 1 && p.positions == SinkPositions::cache &&
         p.prefill == Prefill::streaming;
}

}  // namespace

InvarianceSample invariance_sample(const Scenario& s, double budget) {
  InvarianceSample sample;
  const double work = estimate_cost(s).multiply_adds;
  sample.every = std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(work / budget)));
  if (sample.every == 1) return sample;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(s.dims.batch), 0);
  for (const Step& step : s.steps) {
    if (step.op != StepOp::append) {
      sample.attend.push_back(true);
      advance_lengths(step, lengths);
      continue;
    }
    const std::int64_t n = *std::max_element(step.tokens.begin(), step.tokens.end());
    for (std::int64_t pos = 0; pos < n; ++pos) {
      bool chosen = pos < 4 || pos >= n - 4 || sample.total % sample.every == 0;
      for (std::size_t b = 0; b < lengths.size() && !chosen; ++b) {
        const std::int64_t pad = n - step.tokens[b];
        if (pos < pad) continue;
        const std::int64_t t = lengths[b] + pos - pad;
        for (const Policy& p : s.policies)
          chosen = chosen || (p.kind != PolicyKind::full && std::abs(t - (p.window - 1)) <= 4) ||
                   (p.kind == PolicyKind::sink && std::abs(t - p.sinks) <= 4) ||
                   (p.kind == PolicyKind::chunked && (t % p.window <= 1 || t % p.window == p.window - 1));
      }
      sample.attend.push_back(chosen);
      sample.sampled += chosen ? 1 : 0;
      ++sample.total;
    }
    advance_lengths(step, lengths);
  }
  return sample;
}

SplitScenario split_into_single_tokens(const Scenario& s, const InputTable& inputs) {
  SplitScenario split{s, inputs};
  split.scenario.steps.clear();
  std::uint64_t orig_next = 0, new_next = 0;
  for (const Step& step : s.steps) {
    if (step.op != StepOp::append) {
      split.scenario.steps.push_back(step);
      continue;
    }
    // Original uids of this step, row-major: row b, chunk order.
    std::vector<std::uint64_t> first(step.tokens.size());
    for (std::size_t b = 0; b < step.tokens.size(); ++b) {
      first[b] = orig_next;
      orig_next += static_cast<std::uint64_t>(step.tokens[b]);
    }
    const std::int64_t n = *std::max_element(step.tokens.begin(), step.tokens.end());
    for (std::int64_t pos = 0; pos < n; ++pos) {
      Step one = step;
      for (std::size_t b = 0; b < step.tokens.size(); ++b) {
        const std::int64_t offset = pos - (n - step.tokens[b]);  // left padding
        one.tokens[b] = offset >= 0 ? 1 : 0;
        if (offset >= 0) copy_uid(inputs, first[b] + static_cast<std::uint64_t>(offset), split.inputs, new_next++);
      }
      split.scenario.steps.push_back(one);
    }
  }
  return split;
}

ReferenceChecks::ReferenceChecks(const Scenario& s, const InputTable& inputs, double invariance_budget) : s_(s) {
  invariance_ = {"chunk invariance", true, "bit-identical to one-by-one feeding"};
  if (std::any_of(s.policies.begin(), s.policies.end(),
                  [](const Policy& p) { return p.prefill == Prefill::dense; })) {
    invariance_.detail = "not applicable: dense prefill is chunk-dependent by design";
  } else {
    split_ = std::make_unique<SplitScenario>(split_into_single_tokens(s, inputs));
    InvarianceSample sample = invariance_sample(s, invariance_budget);
    attend_ = std::move(sample.attend);
    if (!attend_.empty())
      invariance_.detail = fmt::format(
          "bit-identical to one-by-one feeding on a sample of {} of {} tokens (chunk and window edges, one "
          "token in {}), as the scenario is over the full self-check's budget",
          sample.sampled, sample.total, sample.every);
    single_ = std::make_unique<ReferenceStepper>(split_->scenario, split_->inputs, attend_);
  }
  sink_zero_ = {"sink S=0 equals sliding", true, "not applicable"};
  if (const Policy* shared = s.shared_policy(); shared && sink_zero_applies(*shared)) {
    sliding_ = std::make_unique<Scenario>(s);
    sliding_->policies.assign(sliding_->policies.size(),
                              Policy{PolicyKind::sliding, shared->window, 0, 1, SinkPositions::cache, Prefill::streaming});
    sliding_run_ = std::make_unique<ReferenceStepper>(*sliding_, inputs);
  }
  bounds_ = {"positions within bounds", true, "all views within bounds"};
}

ReferenceChecks::~ReferenceChecks() = default;

void ReferenceChecks::step(std::size_t i, const StepRecord& rec) {
  if (single_) chunk_invariance(i, rec);
  if (sliding_run_) sink_zero(i, rec);
  if (bounds_.passed && rec.append) {
    const std::string violation = bounds_violation(s_, rec, i);
    if (!violation.empty()) bounds_ = {bounds_.name, false, violation};
  }
}

// The chunked step's outputs against the same tokens fed one by one, bit for bit.
void ReferenceChecks::chunk_invariance(std::size_t i, const StepRecord& chunked) {
  if (!chunked.append) {
    ++single_index_;
    single_->next();  // the same reorder, reset or crop
    return;
  }
  const int L = s_.dims.layers, H = s_.dims.heads, D = s_.dims.head_dim;
  const auto& out = chunked.append->out;
  const int B = static_cast<int>(chunked.append->rows.size());
  const std::int64_t n = chunked.append->chunk;
  for (std::int64_t pos = 0; pos < n; ++pos) {
    const bool attended = attend_.empty() || attend_[single_index_];
    ++single_index_;
    const StepRecord one = single_->next();  // [L, B, 1, H, D]
    if (!invariance_.passed || !attended) continue;
    for (int l = 0; l < L && invariance_.passed; ++l)
      for (int b = 0; b < B && invariance_.passed; ++b)
        for (int hd = 0; hd < H * D; ++hd) {
          const double a = out[((static_cast<std::size_t>(l) * B + b) * n + pos) * H * D + hd];
          const double e = one.append->out[(static_cast<std::size_t>(l) * B + b) * H * D + hd];
          if (same_value(a, e)) continue;
          invariance_ = {invariance_.name, false,
                         fmt::format("{}: layer {} row {} chunk position {} differs from feeding one by one ({} vs {})",
                                     step_label(chunked.step, i), l, b, pos, a, e)};
          break;
        }
  }
}

// The sink run's outputs against the sliding run's: only the rotation angles differ, so
// the gap is double rounding noise.
void ReferenceChecks::sink_zero(std::size_t i, const StepRecord& rec) {
  const StepRecord other = sliding_run_->next();
  if (!rec.append || !sink_zero_.passed) return;
  const auto& a = rec.append->out;
  const auto& b = other.append->out;
  for (std::size_t x = 0; x < a.size(); ++x) {
    if (std::isnan(a[x]) != std::isnan(b[x])) {
      sink_zero_ = {sink_zero_.name, false, fmt::format("{}: padding differs", step_label(rec.step, i))};
      return;
    }
    if (!std::isnan(a[x])) gap_ = std::max(gap_, std::abs(a[x] - b[x]));
  }
  if (gap_ > 1e-12) sink_zero_.passed = false;
  sink_zero_.detail = fmt::format("max difference {:.3g}", gap_);
}

Outcome ReferenceChecks::finish(const std::vector<std::string>& problems) {
  Outcome o;
  o.scenario = s_.name;
  o.file = s_.file;
  o.target = "reference";
  o.checks = {invariance_, sink_zero_, bounds_};
  Check expected{"expected errors", problems.empty(), ""};
  expected.detail = problems.empty() ? "as the scenario says" : problems.front();
  o.checks.push_back(expected);
  o.max_abs_error = gap_;
  return o;
}

Outcome check_reference(const Scenario& s, const InputTable& inputs, const ReferenceRun& run) {
  ReferenceChecks checks(s, inputs);
  for (std::size_t i = 0; i < run.steps.size(); ++i) checks.step(i, run.steps[i]);
  return checks.finish(run.problems);
}

}  // namespace kvcheck
