// What a scenario costs before it runs: lengths after each step, the paged pool's largest
// need, the reference's memory and multiply-adds, refused over the budget before any
// allocation (SPEC 1's limits).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "reference/policy.h"
#include "reference/quantize.h"
#include "tools/harness/scenario/parse_sections.h"

namespace kvcheck {

namespace scenario_parse {

std::string bytes_text(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.1f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  return fmt::format("{:.0f} kB", bytes / 1e3);
}

std::string duration_text(double seconds) {
  if (seconds >= 7200) return fmt::format("{:.0f} hours", seconds / 3600);
  if (seconds >= 120) return fmt::format("{:.0f} minutes", seconds / 60);
  return fmt::format("{:.0f} seconds", seconds);
}

}  // namespace scenario_parse

using scenario_parse::bytes_text;

void advance_lengths(const Step& step, std::vector<std::int64_t>& lengths) {
  switch (step.op) {
    case StepOp::append:
      for (std::size_t b = 0; b < lengths.size(); ++b) lengths[b] += step.tokens[b];
      break;
    case StepOp::reorder: {
      std::vector<std::int64_t> next;
      for (int r : step.rows) next.push_back(lengths[static_cast<std::size_t>(r)]);
      lengths = std::move(next);
      break;
    }
    case StepOp::reset:
      lengths.assign(static_cast<std::size_t>(*step.batch), 0);
      break;
    case StepOp::crop:
      for (std::int64_t& n : lengths) n = std::min(n, step.length);
      break;
    case StepOp::free_rows:
      for (int r : step.rows) lengths[static_cast<std::size_t>(r)] = 0;
      break;
    case StepOp::evict:
    case StepOp::preempt:  // the row keeps its tokens (SPEC 8.6): they come back on resume
    case StepOp::resume:
    case StepOp::prune:    // the pruned tokens keep their indices (SPEC 11)
      break;
  }
}

namespace {

// Blocks one layer of a row needs, without sharing, while it appends tokens [first, n):
// every block from the first one holding a token that token `first` still sees.
// A row of `first` tokens that appends up to n holds, without sharing, every block from
// the first one holding a token of its retained set (the window of its last token, a
// sliding or sink layer's blocks being freed no earlier) to the last new token's, and a sink
// layer's blocks of sinks.
std::int64_t blocks_needed(const Policy& policy, std::int64_t block_size, std::int64_t first, std::int64_t n) {
  if (n == 0) return 0;
  const std::int64_t last = (n + block_size - 1) / block_size;  // blocks 0 .. last - 1 cover the row
  if (policy.kind == PolicyKind::full) return last;
  // A chunked layer retains at most its last C tokens: counted as a window of C, an upper bound.
  if (policy.kind == PolicyKind::sliding || policy.kind == PolicyKind::chunked)
    return last - std::max<std::int64_t>(0, first - policy.window) / block_size;
  const std::int64_t sink_blocks = (policy.sinks + block_size - 1) / block_size;
  const std::int64_t from = first == 0 ? 0 : (policy.sinks + reference::evicted_count(policy, first - 1)) / block_size;
  return last - from + std::min(sink_blocks, from);
}

}  // namespace

PoolNeed largest_pool_need(const Scenario& s, std::int64_t block_size) {
  PoolNeed most;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(s.dims.batch), 0);
  std::vector<bool> recompute(lengths.size(), false);  // preempted for a recompute
  for (const Step& step : s.steps) {
    // Idle rows hold their blocks; a recompute's resume rebuilds its row from token 0.
    const bool counts = (step.op == StepOp::append || step.op == StepOp::resume) && step.expect_error.empty();
    if (counts)
      for (const Policy& policy : s.policies) {
        std::int64_t need = 0;
        for (std::size_t b = 0; b < lengths.size(); ++b) {
          const bool rebuilt = step.op == StepOp::resume && recompute[b] &&
                               std::find(step.rows.begin(), step.rows.end(), static_cast<int>(b)) != step.rows.end();
          need += rebuilt ? blocks_needed(policy, block_size, 0, lengths[b])
                          : blocks_needed(policy, block_size, lengths[b],
                                          lengths[b] + (step.op == StepOp::append ? step.tokens[b] : 0));
        }
        if (need > most.blocks) most = {need, step.source_index};
      }
    if (step.op == StepOp::preempt)
      for (int b : step.rows) recompute[static_cast<std::size_t>(b)] = step.recompute;
    if (step.op == StepOp::reset || step.op == StepOp::reorder) {
      if (step.expect_error.empty()) advance_lengths(step, lengths);
      recompute.assign(lengths.size(), false);
      continue;
    }
    if (step.expect_error.empty()) advance_lengths(step, lengths);
  }
  return most;
}

namespace {

// Keys a token at index t sees under the policy (the query's own included); for a chunked
// layer, at most C (an upper bound, as for a window of C).
double visible_keys(const Policy& p, std::int64_t t) {
  return p.kind == PolicyKind::full ? static_cast<double>(t + 1)
                                    : static_cast<double>(std::min<std::int64_t>(t + 1, p.window));
}

// The sum of visible_keys over t in [first, last], in closed form.
double visible_keys_sum(const Policy& p, std::int64_t first, std::int64_t last) {
  auto prefix = [&](std::int64_t n) {  // sum over t in [0, n)
    const std::int64_t cap = p.kind == PolicyKind::full ? n : std::min(n, p.window);
    const double grow = static_cast<double>(cap) * static_cast<double>(cap + 1) / 2;
    return grow + (p.kind == PolicyKind::full ? 0.0 : static_cast<double>(n - cap) * static_cast<double>(p.window));
  };
  return last < first ? 0.0 : prefix(last + 1) - prefix(first);
}

}  // namespace

namespace {
// What the reference keeps of one quantized token (SPEC 9's R_stored: every layer and kv
// head, keys and values) as reference::StoredLayer holds it: what each stands for (doubles),
// its codes (ints), scales (doubles) and zero points (ints) per group; under scales along the
// token axis a group is one element, and what it was quantized from is kept too.
double stored_bytes_per_token(const Scenario& s, int first, int count) {
  if (!s.quantized()) return 0.0;
  const double D = s.dims.head_dim;
  double total = 0.0;
  for (int l = first; l < first + count; ++l) {
    const KvQuant& q = s.quant(l);
    double per_head = 0.0;
    for (const auto& t : {q.k, q.v}) {
      const double groups = t ? D / std::max(1, reference::scale_group(*t, s.dims.head_dim)) : 0.0;
      per_head += D * 8 + (t ? D * 4 + groups * 12 + D / 4 : 0.0);
    }
    if (q.along_tokens()) per_head *= 2;
    total += static_cast<double>(s.dims.kv_heads) * (per_head + 64);
  }
  return total;
}
}  // namespace

ScenarioCost estimate_cost(const Scenario& s) { return estimate_layers_cost(s, 0, s.dims.layers); }

ScenarioCost estimate_layers_cost(const Scenario& s, int first, int count) {
  const Dims& d = s.dims;
  const double stored_per_token = stored_bytes_per_token(s, first, count);
  // Each layer attends under its own policy (a Gemma 3-like hybrid's sliding layers see a
  // window, its full layers everything); one view and set per layer beside the widest's.
  // Layers of one policy are counted together: a scenario has few distinct policies.
  std::vector<std::pair<Policy, double>> policies;  // each distinct policy and its layers
  for (int l = first; l < first + count; ++l) {
    const Policy& p = s.policy(l);
    auto same = std::find_if(policies.begin(), policies.end(), [&](const auto& e) { return e.first == p; });
    if (same == policies.end()) policies.emplace_back(p, 1.0);
    else same->second += 1.0;
  }
  Policy widest = policies.front().first;
  for (const auto& [p, layers] : policies)
    if (visible_keys(p, std::int64_t{1} << 40) > visible_keys(widest, std::int64_t{1} << 40)) widest = p;
  const double views_per_key = policies.size() > 1 ? 1.0 : 0.0;  // per layer's key, beside the widest's
  // Counting each of many distinct policies over many steps and rows would take long (a
  // hostile file: 1,024 windows, a million steps): every layer is charged the widest then,
  // which over-estimates.
  if (static_cast<double>(policies.size()) * static_cast<double>(s.steps.size()) * d.batch > 5e7)
    policies.assign(1, {widest, static_cast<double>(count)});
  const double per_token_out = static_cast<double>(count) * d.heads * d.head_dim;
  const double per_layer_key = static_cast<double>(d.heads) * d.head_dim;
  // What a cache stores of one token in all the group's layers (float32 at most: half
  // formats and codes take less).
  const double kv_per_token = static_cast<double>(count) * d.kv_heads * d.head_dim * 2 * 4;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(d.batch), 0);
  double outputs = 0, views = 0, retained = 0, stored = 0, work = 0, largest_step = 0, largest_cache = 0;
  double largest_view = 0;  // keys one query sees, in its widest layer
  for (const Step& step : s.steps) {
    double step_bytes = 0, cache_bytes = 0;
    if (step.op == StepOp::append) {
      const std::int64_t n = *std::max_element(step.tokens.begin(), step.tokens.end());
      const double out = static_cast<double>(lengths.size()) * static_cast<double>(n) * per_token_out * 8;
      double seen_all = 0, seen_layers = 0, seen_first = 0, held = 0;
      for (std::size_t b = 0; b < lengths.size(); ++b) {
        seen_all += visible_keys_sum(widest, lengths[b], lengths[b] + step.tokens[b] - 1);
        seen_first += visible_keys_sum(s.policy(first), lengths[b], lengths[b] + step.tokens[b] - 1);
        for (const auto& [p, layers] : policies)
          seen_layers += layers * visible_keys_sum(p, lengths[b], lengths[b] + step.tokens[b] - 1);
        held += (lengths[b] == 0 ? 0.0 : visible_keys(widest, lengths[b] - 1)) + static_cast<double>(step.tokens[b]);
        largest_view = std::max(largest_view, visible_keys(widest, lengths[b] + step.tokens[b] - 1));
      }
      work += seen_layers * per_layer_key * 2;  // a dot product and a value accumulation per key
      outputs += out;
      // One (index, position) pair per visible key; a hybrid keeps a view per layer too.
      views += (seen_all + views_per_key * seen_layers) * 16;
      // The reference's step: its outputs and views.
      step_bytes = out + (seen_all + views_per_key * seen_layers) * 16;
      // A cache under test beside it: the kernel's log of the first layer's visible pairs
      // (about 90 bytes a pair, the checker's sorted copy included), its float outputs, and
      // the keys and values it holds while the step's queries attend.
      cache_bytes = seen_first * 90 + out / 2 + held * kv_per_token;
    }
    advance_lengths(step, lengths);
    // Per row and step: the retained and live sets (24 bytes a key), and a history view.
    double sets = 0;
    for (std::int64_t n : lengths) {
      if (n == 0) {
        sets += 24 * (1.0 + views_per_key * count);
        continue;
      }
      double layer_keys = 0;
      for (const auto& [p, layers] : policies) layer_keys += layers * (48.0 * visible_keys(p, n - 1) + 24);
      sets += 48.0 * visible_keys(widest, n - 1) + 24 + views_per_key * layer_keys;
    }
    retained += sets;
    // A quantized step's record holds what the reference stores for every retained token.
    // A chunked layer's retained tokens and the tail of its ring (SPEC 10.2, stored_ring) are
    // together at most its last C, which visible_keys counts for it.
    double stored_now = 0;
    for (std::int64_t n : lengths) stored_now += stored_per_token * (n == 0 ? 0.0 : visible_keys(widest, n - 1));
    stored += stored_now;
    if (step_bytes + sets + stored_now + cache_bytes > largest_step + largest_cache) {
      largest_step = step_bytes + sets + stored_now;
      largest_cache = cache_bytes;
    }
  }
  // reference::ReferenceModel's key memos, one per layer and kv head, each under twice the
  // largest view or its share of 256 MB, and never over the keys there are; a second model
  // feeds the tokens one by one for the reference's own checks. Per key: its rotated key and
  // value (doubles) and a map entry.
  double memos = 0;
  const double uids = static_cast<double>(count_uids(s));
  for (const auto& [p, layers] : policies) {
    const double share = 256.0 * (1 << 20) / (static_cast<double>(count) * d.kv_heads) / (16.0 * d.head_dim);
    const double keys =
        std::min(std::max(2 * std::min(largest_view, visible_keys(p, std::int64_t{1} << 40)), share), uids);
    memos += 2 * layers * d.kv_heads * keys * (16.0 * d.head_dim + 64);
  }
  ScenarioCost c;
  const double inputs = static_cast<double>(count_uids(s)) * count * (d.heads + 2.0 * d.kv_heads) * d.head_dim * 4;
  const double histories = static_cast<double>(count_uids(s)) * 8 * 2;
  // `run` checks step by step: the inputs (twice: the reference's own checks feed the
  // tokens one by one from a copy), the memos, the largest step, and the caches under test
  // beside it. Export, goldens, diagnose and verify keep every step, with one model's memos.
  c.cache_bytes = largest_cache;
  c.bytes = 2 * inputs + histories + memos + largest_step + largest_cache;
  c.whole_run_bytes = outputs + views + retained + stored + inputs + histories + memos / 2;
  c.multiply_adds = work;
  c.breakdown = fmt::format("inputs {}, key memos {}, the largest step {} and a cache under test beside it {}",
                            bytes_text(2 * inputs), bytes_text(memos), bytes_text(largest_step),
                            bytes_text(largest_cache));
  c.whole_run_breakdown = fmt::format("outputs {}, attention views {}, retained sets {}, inputs {}",
                                      bytes_text(outputs), bytes_text(views), bytes_text(retained), bytes_text(inputs));
  if (stored > 0) c.whole_run_breakdown += fmt::format(", stored quantized KV {}", bytes_text(stored));
  c.whole_run_breakdown += fmt::format(", key memos {}", bytes_text(memos / 2));
  return c;
}

void require_whole_run_fits(const Scenario& s) {
  const ScenarioCost cost = estimate_cost(s);
  if (cost.whole_run_bytes > kMemoryBudget)
    throw InputError(s.file, "/steps",
                     fmt::format("this command keeps every step, about {} ({}); kvcheck accepts up to {} (`run` "
                                 "checks step by step and needs about {})",
                                 bytes_text(cost.whole_run_bytes), cost.whole_run_breakdown, bytes_text(kMemoryBudget),
                                 bytes_text(cost.bytes)));
}

std::int64_t longest_row(const Scenario& s) {
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(s.dims.batch), 0);
  std::int64_t longest = 1;
  for (const Step& step : s.steps) {
    advance_lengths(step, lengths);
    for (std::int64_t n : lengths) longest = std::max(longest, n);
  }
  return longest;
}

double input_values(const Scenario& s, int layers) {
  return static_cast<double>(count_uids(s)) * layers * (s.dims.heads + 2.0 * s.dims.kv_heads) * s.dims.head_dim;
}

std::int64_t count_uids(const Scenario& scenario) {
  std::int64_t total = 0;
  for (const Step& step : scenario.steps)
    if (step.op == StepOp::append)
      for (std::int64_t n : step.tokens) total += n;
  return total;
}

}  // namespace kvcheck
