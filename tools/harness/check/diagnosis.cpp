#include "tools/harness/check/diagnosis.h"

#include "reference/policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace kvcheck {

namespace {

template <class T, class F>
bool any(const std::vector<T>& v, F f) {
  return std::any_of(v.begin(), v.end(), f);
}

// Every mismatching query has exactly one extra key, one below its window start, and
// nothing missing: the window holds W + 1. Or one missing at the start: W - 1.
bool off_by_one(const StepEvidence& e) {
  std::set<std::pair<int, std::int64_t>> extra_at, missing_at;
  for (const PairMismatch& p : e.pairs) {
    const std::pair<int, std::int64_t> q{p.row, p.query_index};
    if (!p.expected && p.actual) {
      if (extra_at.count(q)) return false;
      extra_at.insert(q);
    } else if (p.expected && !p.actual) {
      if (missing_at.count(q)) return false;
      missing_at.insert(q);
    } else {
      return false;
    }
  }
  return !e.pairs.empty() && (extra_at.empty() || missing_at.empty());
}

// Every query's mismatching pairs are exactly the keys j <= t where `truth` and `rule`
// disagree: the rule explains every key the query used or missed.
template <class F, class G>
bool pairs_fit_rule(const StepEvidence& e, F truth, G rule) {
  if (e.pairs.empty()) return false;
  std::map<std::pair<int, std::int64_t>, std::set<std::int64_t>> listed;  // (row, query) -> keys
  for (const PairMismatch& p : e.pairs) {
    if (p.key_index < 0 || p.expected.has_value() == p.actual.has_value()) return false;
    listed[{p.row, p.query_index}].insert(p.key_index);
  }
  for (const auto& [query, keys] : listed) {
    std::set<std::int64_t> differ;
    for (std::int64_t j = 0; j <= query.second; ++j)
      if (truth(query.second, j) != rule(query.second, j)) differ.insert(j);
    if (keys != differ) return false;
  }
  return true;
}

// The same for visibility rules that are runs ending at the query: `policy_first(t)` .. t
// against `first_visible(t)` .. t.
template <class F, class G>
bool pairs_fit_visibility(const StepEvidence& e, F policy_first, G first_visible) {
  return pairs_fit_rule(e, [&](std::int64_t t, std::int64_t j) { return j >= policy_first(t); },
                        [&](std::int64_t t, std::int64_t j) { return j >= first_visible(t); });
}

// SPEC 10.4: whether token t of a sliding layer under a sink policy sees token j, with the
// window measured in the shifted positions (Pq - Pk < swa) or in token indices (t - j < swa).
bool sees_under_shift(const Policy& p, std::int64_t t, std::int64_t j, bool in_token_indices) {
  const std::int64_t e = reference::evicted_count(p, t);
  const bool sink = j < std::min(p.sinks, t + 1);
  if (!sink && !(j >= p.sinks + e && j <= t)) return false;
  const std::int64_t distance = in_token_indices ? t - j : (t - e) - (sink ? j : j - e);
  return distance < p.swa;
}

}  // namespace

// The paged issue that explains the others: a write where the table does not point, a
// wrong hit or a shared write makes every later slot look wrong, so it is named first.
static BugClass paged_class(const std::vector<PagedIssue>& issues) {
  using K = PagedIssue::Kind;
  const std::pair<K, BugClass> order[] = {
      {K::mapping_table, BugClass::paged_slot_mapping_wrong},
      {K::unwritten_hit, BugClass::paged_read_before_write},
      {K::hit_across, BugClass::paged_hit_across_contexts},
      {K::hit_unaligned, BugClass::paged_hit_beyond_alignment},
      {K::hit_stale, BugClass::paged_stale_prefix_hit},
      {K::shared_write, BugClass::paged_shared_block_written},
      {K::refcount, BugClass::paged_refcount_mismatch},
      {K::freed_visible, BugClass::paged_block_freed_while_visible},
      // A live token missing from its own slot went elsewhere: the other row's slot it
      // landed in looks stale, but the write is the cause.
      {K::slot_mapping, BugClass::paged_slot_mapping_wrong},
      {K::stale_entry, BugClass::paged_stale_table_entry},
      {K::hit_expected, BugClass::paged_hit_count_wrong},
  };
  for (const auto& [kind, bug] : order)
    if (any(issues, [kind](const PagedIssue& i) { return i.kind == kind; })) return bug;
  return BugClass::paged_stale_table_entry;
}

BugClass classify(const Scenario& s, const StepEvidence& e, const StepContext& ctx) {
  const Policy& policy = s.policy(e.layer);
  using K = SlotIssue::Kind;
  if (e.empty()) return BugClass::none;
  if (e.raised) return BugClass::cache_raised;
  if (e.unrecorded) return BugClass::trace_incomplete;
  if (!e.refusal.empty()) return BugClass::refusal_mismatch;
  if (e.layer_holds_policy_of) return BugClass::layer_policy_swapped;
  if (e.step < s.steps.size() && s.steps[e.step].op == StepOp::resume &&
      any(e.slots, [](const SlotIssue& i) { return i.kind == K::lost; }))
    return BugClass::tokens_lost_after_preemption;
  if (!e.paged.empty()) return paged_class(e.paged);
  // Between forwards, only tokens behind the window held, and every read right.
  if (e.between_forwards && e.pairs.empty() && e.outputs.empty() && !e.slots.empty() &&
      std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) { return i.kind == K::extra && i.window_gap > 0; }))
    return BugClass::window_kept_in_prefill;
  // Codes that fit the token only without the transform: every key read back is garbage
  // through it (rotations, outputs), and this is why.
  if (e.codes_fit_without_transform) return BugClass::quant_transform_missing;
  const bool shifted_policy = policy.kind == PolicyKind::sink && policy.positions == SinkPositions::cache &&
                              policy.prefill == Prefill::streaming;
  // Distances off for sinks only, by E: the query was not moved back with the window, in a
  // chunk or not.
  const bool sinks_only_by_e =
      shifted_policy && any(e.pairs, [](const PairMismatch& p) { return p.expected && p.actual; }) &&
      std::all_of(e.pairs.begin(), e.pairs.end(), [&](const PairMismatch& p) {
        return p.expected && p.actual && p.key_index < policy.sinks && *p.actual - *p.expected == p.evicted_before;
      });
  // A chunked append (SPEC 8.7): a query that saw a later key, keys at other positions than
  // the reference's, or queries that missed keys of the append and nothing else.
  const bool chunked = e.step < s.steps.size() && s.steps[e.step].chunk > 0;
  if (chunked) {
    if (any(e.pairs, [](const PairMismatch& p) { return !p.expected && p.actual && p.key_index > p.query_index; }))
      return BugClass::chunk_sees_future_keys;
    if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::rotation; }) ||
        (!sinks_only_by_e &&
         any(e.pairs, [](const PairMismatch& p) { return p.expected && p.actual && *p.expected != *p.actual; })))
      return BugClass::chunk_positions_wrong;
    if (e.slots.empty() && !e.pairs.empty() &&
        std::all_of(e.pairs.begin(), e.pairs.end(), [](const PairMismatch& p) { return p.expected && !p.actual; }))
      return BugClass::chunk_misses_past_keys;
  }
  // A poison NaN in an output (SPEC 8.8.5): the query read a block no token was written to,
  // or one that was freed, whatever the log says.
  if (e.poisoned) return e.poisoned->freed ? BugClass::paged_refcount_mismatch : BugClass::paged_read_before_write;
  if (e.wrong_row_count)
    return ctx.last_row_change == StepContext::RowChange::reorder ? BugClass::reorder_lost_positions
                                                                  : BugClass::stale_row_after_batch_change;
  // SPEC 11.1: a head holding another number of prompt tokens than the prune keeps; the
  // tokens it lacks or holds beyond that are its consequence.
  if (!e.kept_counts.empty()) return BugClass::kept_count_wrong;
  if (e.pairs.empty() && e.outputs.empty() && any(e.slots, [](const SlotIssue& i) { return i.block_count; }) &&
      std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) { return i.block_count; }))
    return BugClass::block_eviction_count_wrong;
  if (any(e.slots, [](const SlotIssue& i) { return i.dead; }) &&
      std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) { return i.dead; }))
    return BugClass::dead_token_held;

  const bool stale = any(e.slots, [](const SlotIssue& i) { return i.kind == K::stale; }) ||
                     any(e.pairs, [](const PairMismatch& p) { return p.key_index < 0; });
  // Under a residual, only quantized slots hold what is not the row's: the raw residual
  // moved with the reorder or crop, the quantized store did not.
  const auto stale_slot = [](const SlotIssue& i) { return i.kind == K::stale; };
  if (stale && s.quantized() && s.quant_rules().holds_raw() && any(e.slots, stale_slot) &&
      std::all_of(e.slots.begin(), e.slots.end(), [&](const SlotIssue& i) { return !stale_slot(i) || i.quantized; }))
    return BugClass::quant_store_not_moved;
  // Quantized slots that decode to no token's values, and nothing else wrong but the tokens
  // they should have held: the codes are read with the wrong layout (nibble order, stride,
  // another tensor's scales), not left over from another token (those would be named).
  if (stale && s.quantized() && any(e.slots, stale_slot) &&
      std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) {
        return (i.kind == K::stale && i.uid < 0 && i.quantized) || i.kind == K::lost;
      }))
    return BugClass::quant_dequantization_layout;
  if (stale) {
    if (ctx.last_row_change == StepContext::RowChange::reset_new_batch) return BugClass::stale_row_after_batch_change;
    if (ctx.last_row_change == StepContext::RowChange::reorder) return BugClass::reorder_lost_positions;
    return BugClass::stale_slot;
  }

  // A long chunk kept whole: every extra token came in this step's chunk, nothing lost.
  if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::extra; }) &&
      std::all_of(e.slots.begin(), e.slots.end(),
                  [](const SlotIssue& i) { return i.kind == K::rotation || (i.kind == K::extra && i.in_chunk); }) &&
      e.chunk_kept_whole)
    return BugClass::prompt_kept_whole;

  // A token the next query still sees is gone, and nothing is held in its place: the
  // root cause, whatever the cache then did to the positions of what it kept. (A lost sink
  // is a sink count, except in a sliding layer under a shift, whose sinks its sink layer
  // keeps: there its window may have hidden one that a shift brings back, SPEC 10.4.)
  const bool lost_window_token = any(e.slots, [&](const SlotIssue& i) {
    return i.kind == K::lost && (policy.kind != PolicyKind::sink || policy.swa > 0 || i.true_index >= policy.sinks);
  });
  if (lost_window_token && !any(e.slots, [](const SlotIssue& i) {
        return i.kind == K::extra || i.kind == K::duplicated || (i.kind == K::lost && i.true_index < 0);
      }))
    return BugClass::dropped_live_token;

  // What the tensors say about rotations.
  for (const SlotIssue& i : e.slots) {
    if (i.kind != K::rotation) continue;
    switch (i.fits.kind) {
      case OtherRope::Kind::none:
        continue;
      case OtherRope::Kind::layout:
        return BugClass::wrong_rope_layout;
      case OtherRope::Kind::frequency_map:
        return BugClass::wrong_frequency_map;
      case OtherRope::Kind::rotary_dim:
        return BugClass::wrong_rotary_dim;
      case OtherRope::Kind::magnitude:
        return BugClass::attention_factor_wrong;
      case OtherRope::Kind::theta:
      case OtherRope::Kind::scaling:
        return BugClass::wrong_rope_theta_or_scaling;
      case OtherRope::Kind::other_layer:
        return BugClass::layer_rotated_with_another_layers_rope;
      case OtherRope::Kind::nope_rotated:
        return BugClass::nope_layer_rotated;
    }
  }
  // Kept window keys moved back by the same amount while the policy has evicted nothing
  // yet: the shift fired before the cache was full.
  {
    std::optional<std::int64_t> shift;
    bool early = e.evicted_before_last == 0 && policy.kind == PolicyKind::sink;
    for (const SlotIssue& i : e.slots) {
      if (!early) break;
      if (i.kind != K::rotation) continue;
      early = i.recovered_position && !i.newest && i.true_index >= policy.sinks &&
              *i.recovered_position < i.claimed_position &&
              (!shift || *shift == i.claimed_position - *i.recovered_position);
      if (early) shift = i.claimed_position - *i.recovered_position;
    }
    if (early && shift) return BugClass::shift_one_token_early;
  }
  bool new_unshifted = false;
  // Kept keys are named not re-rotated only when every misplaced kept key of the same layer
  // and row sits at its index: keys turned by the wrong amounts land there only by chance (a
  // press re-rotating every kv head by one head's distances, SPEC 11.1).
  const auto kept_at_their_indices = [&](const SlotIssue& of) {
    return std::all_of(e.slots.begin(), e.slots.end(), [&](const SlotIssue& i) {
      return i.layer != of.layer || i.row != of.row || i.kind != K::rotation || !i.recovered_position || i.newest ||
             *i.recovered_position == i.true_index;
    });
  };
  for (const SlotIssue& i : e.slots) {
    if (i.kind != K::rotation || !i.recovered_position) continue;
    const std::int64_t w = policy.window;
    if (w > 0 && i.claimed_position >= w && *i.recovered_position == i.claimed_position % w)
      return BugClass::rope_table_wraps;
    // A key still at its absolute position where a cache position was due: the kept keys
    // were never re-rotated (whatever the newest key did), or only the newest was not.
    if (*i.recovered_position == i.true_index && i.claimed_position < i.true_index) {
      if (!i.newest && kept_at_their_indices(i))
        return s.quantized() && s.quant(i.layer).k ? BugClass::quant_key_not_rerotated : BugClass::kept_keys_not_shifted;
      if (!i.newest) continue;
      new_unshifted = true;
    }
  }
  if (new_unshifted) return BugClass::new_key_not_shifted;
  // A stored scale that is not its rule's explains every key and output it touches (keys
  // at another position are named above: their scales differ as a consequence).
  // A token held at the wrong precision explains its codes and the outputs over it.
  if (!e.precision.empty()) return BugClass::quant_precision_map;
  if (any(e.codes, [](const CodeMismatch& c) { return c.readers_scale; })) return BugClass::quant_shared_scale;
  if (any(e.codes, [](const CodeMismatch& c) { return c.element < 0; })) return BugClass::quant_scale_wrong;
  // Every bad key is nearest its claim: right positions, too much rounding.
  const bool rotations = any(e.slots, [](const SlotIssue& i) { return i.kind == K::rotation; });
  if (rotations && std::all_of(e.slots.begin(), e.slots.end(),
                               [](const SlotIssue& i) { return i.kind != K::rotation || i.closest_at_claim; }))
    return BugClass::rerotation_drift;
  // After left padding, keys of a padded row all moved forward by one amount (its padding,
  // in positions taken from slot indices or cache_position instead of the mask).
  if (rotations && ctx.padded) {
    std::map<int, std::int64_t> offset;  // per row
    bool forward = true;
    for (const SlotIssue& i : e.slots) {
      if (i.kind != K::rotation) continue;
      const bool padded_row =
          static_cast<std::size_t>(i.row) < ctx.padded_rows.size() && ctx.padded_rows[static_cast<std::size_t>(i.row)];
      const std::int64_t by = i.recovered_position ? *i.recovered_position - i.claimed_position : 0;
      forward = forward && padded_row && by > 0 && offset.emplace(i.row, by).first->second == by;
    }
    if (forward) return BugClass::padding_counted;
  }
  if (rotations) return BugClass::key_at_wrong_position;

  if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::wrong_index; })) {
    if (ctx.last_row_change == StepContext::RowChange::reorder) return BugClass::reorder_lost_positions;
    if (ctx.padded) return BugClass::padding_counted;
    return BugClass::positions_wrong;
  }
  if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::duplicated; })) return BugClass::mask_sees_evicted;

  // Cache positions never reach W; a query at W or beyond was rotated at its absolute position.
  if (shifted_policy &&
      any(e.pairs, [&](const PairMismatch& p) { return p.query_position && *p.query_position >= policy.window; }))
    return BugClass::query_position_not_shifted;
  // Window keys too far back, the query's own key among them: new keys kept their
  // absolute positions while the query moved with the window.
  const bool new_keys_behind =
      shifted_policy && !e.pairs.empty() &&
      std::all_of(e.pairs.begin(), e.pairs.end(),
                  [&](const PairMismatch& p) {
                    return p.expected && p.actual && p.key_index >= policy.sinks && *p.actual < *p.expected;
                  }) &&
      any(e.pairs, [](const PairMismatch& p) { return p.key_index == p.query_index; });
  if (new_keys_behind) return BugClass::new_key_not_shifted;
  if (sinks_only_by_e) return BugClass::query_position_not_shifted;

  const bool sink_missing = policy.kind == PolicyKind::sink && any(e.pairs, [&](const PairMismatch& p) {
                              return p.expected && !p.actual && p.key_index < policy.sinks;
                            });
  if (policy.swa > 0 &&
      pairs_fit_rule(e, [&](std::int64_t t, std::int64_t j) { return sees_under_shift(policy, t, j, false); },
                     [&](std::int64_t t, std::int64_t j) { return sees_under_shift(policy, t, j, true); }))
    return BugClass::sliding_window_in_token_indices;
  if (sink_missing) return BugClass::sink_count_wrong;
  if (policy.kind == PolicyKind::chunked) {
    const std::int64_t c = policy.window;
    auto chunk = [c](std::int64_t t) { return t / c * c; };
    if (pairs_fit_visibility(e, chunk, [c](std::int64_t t) { return t - c + 1; }))
      return BugClass::chunk_as_sliding_window;
    if (pairs_fit_visibility(e, chunk, [c](std::int64_t t) { return chunk_start_moved(t, c, 1); }) ||
        pairs_fit_visibility(e, chunk, [c](std::int64_t t) { return chunk_start_moved(t, c, -1); }))
      return BugClass::chunk_edge_off_by_one;
  }
  if (off_by_one(e)) return BugClass::window_off_by_one;

  const bool lost = any(e.slots, [](const SlotIssue& i) { return i.kind == K::lost; });
  const bool extra = any(e.slots, [](const SlotIssue& i) { return i.kind == K::extra; });
  // Nothing lost, and every extra token the one just before the window: W + 1 kept.
  if (extra && !lost && std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) {
        return i.kind != K::extra || i.window_gap == 1;
      }))
    return BugClass::window_off_by_one;
  if ((lost && extra) || any(e.pairs, [](const PairMismatch& p) { return !p.expected && p.actual; })) {
    // Extra visible tokens with nothing held twice: the wrong ones were kept.
    return lost || extra ? BugClass::evicted_wrong_token : BugClass::mask_sees_evicted;
  }

  // SPEC 11: after a re-rotating prune, every wrong distance too long by one amount. Only
  // the sinks: the recent keys stayed where they were, with the queries (kept keys not
  // re-rotated). Every kept key, the new ones right: later tokens at their original index.
  // (With no recent token kept the two give the same pairs: named the first.)
  if (const auto& sinks = ctx.rerotating_prune_sinks; sinks && !e.pairs.empty()) {
    const PairMismatch& first = e.pairs.front();
    const bool constant = std::all_of(e.pairs.begin(), e.pairs.end(), [&](const PairMismatch& p) {
      return p.expected && p.actual && first.expected && first.actual && *p.actual > *p.expected &&
             *p.actual - *p.expected == *first.actual - *first.expected && p.key_index != p.query_index;
    });
    if (constant)
      return std::all_of(e.pairs.begin(), e.pairs.end(),
                         [&](const PairMismatch& p) { return p.key_index >= 0 && p.key_index < *sinks; })
                 ? BugClass::kept_keys_not_shifted
                 : BugClass::new_key_not_shifted;
  }

  // Distances off by one for old window keys, while nothing was evicted.
  const bool early = !e.pairs.empty() && std::all_of(e.pairs.begin(), e.pairs.end(), [](const PairMismatch& p) {
    return p.expected && p.actual && *p.actual - *p.expected == 1 && p.evicted_before == 0;
  });
  if (early) return BugClass::shift_one_token_early;
  if (!e.pairs.empty() || e.query_unreadable) return BugClass::positions_wrong;
  if (lost || extra) return BugClass::evicted_wrong_token;
  if (!e.codes.empty())
    return any(e.codes, [](const CodeMismatch& c) { return c.element < 0; }) ? BugClass::quant_scale_wrong
                                                                             : BugClass::quant_codes_wrong;
  if (e.outputs_fit_unit_scale) return BugClass::quant_scale_not_applied;
  if (e.outputs_fit_quantized_query) return BugClass::quant_query_quantized;
  // Outputs wrong on one path only, where the other path computed the same token over the
  // same stored cache within tolerance: the paths disagree, whatever the storage.
  if (!e.paths.empty() && e.slots.empty() && e.pairs.empty()) return BugClass::path_inconsistency;
  if (s.quantized() && !e.outputs.empty() && e.slots.empty() && e.pairs.empty())
    return BugClass::quant_dequantization_layout;
  if (e.outputs_fit_without_learned_sinks) return BugClass::learned_sinks_dropped;
  if (e.outputs_fit_with_a_zero_sink) return BugClass::zero_sink_added;
  if (e.outputs_fit_without_query_temperature) return BugClass::query_temperature_missing;
  if (e.outputs_fit_with_later_chunk_keys) return BugClass::chunk_sees_future_keys;
  if (e.outputs_fit_plain_window) return BugClass::sinks_masked_out;
  if (e.outputs_fit_window_in_token_indices) return BugClass::sliding_window_in_token_indices;
  if (!e.outputs.empty() && e.dropped_before_last_use) return BugClass::dropped_before_last_use;
  // After the slots: a cache that dropped a token early also attends one key short.
  if (e.outputs_fit_window_off_by_one) return BugClass::window_off_by_one;
  if (e.outputs_fit_chunk_as_window) return BugClass::chunk_as_sliding_window;
  if (e.outputs_fit_chunk_edge_off_by_one) return BugClass::chunk_edge_off_by_one;
  return BugClass::output_mismatch_positions_correct;
}

}  // namespace kvcheck

namespace kvcheck {

Drift summarize_drift(std::vector<Drift::Point> points) {
  Drift d;
  d.points = std::move(points);
  if (d.points.size() < 2) return d;
  const auto& p = d.points;
  auto all = [&](auto f) { return std::all_of(p.begin(), p.end(), f); };
  // Growing: the error never shrinks, and grows by exactly one at three steps in four or
  // more (a step that evicts the worst key may hold it still).
  bool growing = true;
  std::size_t ones = 0;
  for (std::size_t i = 1; i < p.size(); ++i) {
    const std::int64_t step = std::abs(p[i].error) - std::abs(p[i - 1].error);
    growing = growing && (step == 0 || step == 1);
    ones += step == 1;
  }
  growing = growing && 4 * ones >= 3 * (p.size() - 1);
  if (p.front().error != 0 && all([&](const Drift::Point& x) { return x.error == p.front().error; }))
    d.shape = Drift::Shape::constant;
  else if (growing)
    d.shape = Drift::Shape::growing_by_one;
  else if (any(p, [](const Drift::Point& x) { return x.error != 0; }) &&
           all([](const Drift::Point& x) { return x.error == 0 || x.evicted; }))
    d.shape = Drift::Shape::only_at_evictions;
  else
    d.shape = Drift::Shape::varies;
  return d;
}

std::string poison_text(const PoisonedRead& read) {
  return fmt::format("a poison NaN: block {} (epoch {}), {}", read.block, read.epoch,
                     read.freed ? "freed" : "never written");
}

std::string Drift::to_string() const {
  if (points.empty() && !rotation_errors.empty()) {
    const auto& [first_step, first_error] = rotation_errors.front();
    const auto& [last_step, last_error] = rotation_errors.back();
    const auto middle = rotation_errors[rotation_errors.size() / 2];
    const std::string seen = fmt::format("{:.3g} at step {}, {:.3g} at step {}, {:.3g} at step {}", first_error,
                                         first_step, middle.second, middle.first, last_error, last_step);
    if (last_error > 2 * first_error)
      return first_error > 0
                 ? fmt::format("positions stay exact while the largest rotation error of a stored key grows "
                               "{:.1f}-fold over {} steps: {}",
                               last_error / first_error, rotation_errors.size(), seen)
                 : fmt::format("positions stay exact while the largest rotation error of a stored key grows from 0 "
                               "over {} steps: {}",
                               rotation_errors.size(), seen);
    return "positions stay exact and the largest rotation error of a stored key does not grow: " + seen;
  }
  std::string seen;
  for (std::size_t i = 0; i < points.size() && i < 8; ++i)
    seen += fmt::format("{}{:+d} at step {}", i ? ", " : "", points[i].error, points[i].step);
  if (points.size() > 8) seen += fmt::format(", ... ({} steps)", points.size());
  switch (shape) {
    case Shape::none:
      return points.empty() ? "" : "seen at one step only: " + seen;
    case Shape::constant:
      return fmt::format("the error stays at {:+d} over the following steps: {}", points.front().error, seen);
    case Shape::growing_by_one:
      return "the error grows by about one per step: " + seen;
    case Shape::only_at_evictions:
      return "the error appears only at steps that evict: " + seen;
    case Shape::varies:
      return "the error varies: " + seen;
  }
  return seen;
}

}  // namespace kvcheck
