#include "tools/harness/reference_checks.h"

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

Check chunk_invariance(const Scenario& s, const InputTable& inputs, const ReferenceRun& run) {
  Check check{"chunk invariance", true, ""};
  if (s.policy.prefill == Prefill::dense) {
    check.detail = "not applicable: dense prefill is chunk-dependent by design";
    return check;
  }
  const SplitScenario split = split_into_single_tokens(s, inputs);
  const ReferenceRun single = run_reference(split.scenario, split.inputs);
  const int L = s.dims.layers, H = s.dims.heads, D = s.dims.head_dim;
  std::size_t next = 0;  // the next step of the single-token run
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const StepRecord& chunked = run.steps[i];
    if (!chunked.append) {
      ++next;
      continue;
    }
    const auto& out = chunked.append->out;
    const int B = static_cast<int>(chunked.append->rows.size());
    const std::int64_t n = chunked.append->chunk;
    for (std::int64_t pos = 0; pos < n; ++pos, ++next) {
      const auto& one = single.steps.at(next).append->out;  // [L, B, 1, H, D]
      for (int l = 0; l < L; ++l)
        for (int b = 0; b < B; ++b)
          for (int hd = 0; hd < H * D; ++hd) {
            const double a = out[((static_cast<std::size_t>(l) * B + b) * n + pos) * H * D + hd];
            const double e = one[(static_cast<std::size_t>(l) * B + b) * H * D + hd];
            if (!same_value(a, e)) {
              check.passed = false;
              check.detail = fmt::format(
                  "{}: layer {} row {} chunk position {} differs from feeding one by one "
                  "({} vs {})",
                  step_label(chunked.step, i), l, b, pos, a, e);
              return check;
            }
          }
    }
  }
  check.detail = "bit-identical to one-by-one feeding";
  return check;
}

// `sink` with S = 0, k = 1 and shifted positions has the relative distances of `sliding`.
Check sink_zero_equals_sliding(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, double& max_gap) {
  Check check{"sink S=0 equals sliding", true, ""};
  const Policy& p = s.policy;
  if (p.kind != PolicyKind::sink || p.sinks != 0 || p.evict != 1 || p.positions != SinkPositions::cache ||
      p.prefill != Prefill::streaming) {
    check.detail = "not applicable";
    return check;
  }
  Scenario sliding = s;
  sliding.policy = Policy{PolicyKind::sliding, p.window, 0, 1, SinkPositions::cache, Prefill::streaming};
  const ReferenceRun other = run_reference(sliding, inputs);
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    if (!run.steps[i].append) continue;
    const auto& a = run.steps[i].append->out;
    const auto& b = other.steps[i].append->out;
    for (std::size_t x = 0; x < a.size(); ++x) {
      if (std::isnan(a[x]) != std::isnan(b[x])) {
        check.passed = false;
        check.detail = fmt::format("{}: padding differs", step_label(run.steps[i].step, i));
        return check;
      }
      if (!std::isnan(a[x])) max_gap = std::max(max_gap, std::abs(a[x] - b[x]));
    }
  }
  // Only the rotation angles differ, so the gap is double rounding noise.
  check.passed = max_gap <= 1e-12;
  check.detail = fmt::format("max difference {:.3g}", max_gap);
  return check;
}

// Every view obeys the policy's bounds: the token sees itself, keys are earlier tokens,
// positions are non-negative and never beyond the query's, distances inside the window
// are the true ones, and a windowed policy never sees more than its window.
Check position_bounds(const Scenario& s, const ReferenceRun& run) {
  Check check{"positions within bounds", true, ""};
  const Policy& p = s.policy;
  auto fail = [&](std::size_t i, int b, const AppendedToken& token, const std::string& what) {
    check.passed = false;
    check.detail = fmt::format("{}: row {} token {} (uid {}): {}", step_label(run.steps[i].step, i), b, token.index,
                               token.uid, what);
  };
  for (std::size_t i = 0; i < run.steps.size() && check.passed; ++i) {
    if (!run.steps[i].append) continue;
    const auto& rows = run.steps[i].append->rows;
    for (int b = 0; b < static_cast<int>(rows.size()) && check.passed; ++b) {
      for (const AppendedToken& token : rows[b]) {
        const auto& keys = token.view.keys;
        const std::int64_t pq = token.view.query_position;
        if (keys.empty() || keys.back().index != token.index) {
          fail(i, b, token, "does not see itself");
          break;
        }
        if (pq < 0) {
          fail(i, b, token, fmt::format("negative query position {}", pq));
          break;
        }
        const bool windowed = p.kind != PolicyKind::full && p.prefill == Prefill::streaming;
        if (windowed && static_cast<std::int64_t>(keys.size()) > p.window) {
          fail(i, b, token, fmt::format("sees {} keys, more than the window {}", keys.size(), p.window));
          break;
        }
        for (const auto& key : keys) {
          const bool sink = p.kind == PolicyKind::sink && key.index < p.sinks;
          if (key.index < 0 || key.index > token.index || key.position < 0 || key.position > pq ||
              (!sink && pq - key.position != token.index - key.index)) {
            fail(i, b, token, fmt::format("key {} at position {} with query position {}", key.index, key.position, pq));
            break;
          }
        }
        if (!check.passed) break;
      }
    }
  }
  if (check.passed) check.detail = "all views within bounds";
  return check;
}

}  // namespace

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

Outcome check_reference(const Scenario& s, const InputTable& inputs, const ReferenceRun& run) {
  Outcome o;
  o.scenario = s.name;
  o.file = s.file;
  o.target = "reference";
  double gap = 0.0;
  o.checks.push_back(chunk_invariance(s, inputs, run));
  o.checks.push_back(sink_zero_equals_sliding(s, inputs, run, gap));
  o.checks.push_back(position_bounds(s, run));
  Check expected{"expected errors", run.problems.empty(), ""};
  expected.detail = run.problems.empty() ? "as the scenario says" : run.problems.front();
  o.checks.push_back(expected);
  o.max_abs_error = gap;
  return o;
}

}  // namespace kvcheck
