// The classes of cache bugs kvcheck names, and how the evidence of the first divergent
// step maps to one (SPEC 5, last paragraph).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tools/harness/check/recovery.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

enum class BugClass {
  none,
  refusal_mismatch,
  cache_raised,
  prompt_kept_whole,
  stale_row_after_batch_change,
  reorder_lost_positions,
  stale_slot,
  wrong_rope_layout,
  wrong_rope_theta_or_scaling,
  rope_table_wraps,
  new_key_not_shifted,
  key_at_wrong_position,
  kept_keys_not_shifted,
  padding_counted,
  mask_sees_evicted,
  query_position_not_shifted,
  sink_count_wrong,
  window_off_by_one,
  evicted_wrong_token,
  dropped_live_token,
  dead_token_held,
  block_eviction_count_wrong,
  trace_incomplete,
  shift_one_token_early,
  positions_wrong,
  output_mismatch_positions_correct,
  wrong_frequency_map,
  wrong_rotary_dim,
  attention_factor_wrong,
  learned_sinks_dropped,
  zero_sink_added,
  rerotation_drift,
  layer_policy_swapped,
  dropped_before_last_use,
  chunk_sees_future_keys,
  sinks_masked_out,
  quant_scale_wrong,
  quant_codes_wrong,
  quant_scale_not_applied,
  quant_dequantization_layout,
  quant_key_not_rerotated,
  quant_query_quantized,
  quant_precision_map,
  quant_store_not_moved,
  quant_transform_missing,
  quant_shared_scale,
  // Paged caches (SPEC 8.10).
  paged_slot_mapping_wrong,
  paged_stale_table_entry,
  paged_block_freed_while_visible,
  paged_read_before_write,
  paged_shared_block_written,
  paged_refcount_mismatch,
  paged_hit_across_contexts,
  paged_stale_prefix_hit,
  paged_hit_beyond_alignment,
  paged_hit_count_wrong,
  chunk_misses_past_keys,
  tokens_lost_after_preemption,
  chunk_positions_wrong,
  window_kept_in_prefill,  // SPEC 8.7: between forwards, blocks behind a sliding window still held
  path_inconsistency,  // SPEC 9.2.6: decode and chunk paths disagree
  chunk_edge_off_by_one,    // SPEC 10.2: chunks start one token early or late
  chunk_as_sliding_window,  // SPEC 10.2: a chunked layer sees the last C keys
  layer_rotated_with_another_layers_rope,  // SPEC 10.1
  nope_layer_rotated,                      // SPEC 10.1
  query_temperature_missing,               // SPEC 10.3
  sliding_window_in_token_indices,         // SPEC 10.4
  kept_count_wrong,                        // SPEC 11.1: a kv head holds another number of prompt tokens
};

// Both from the one table of bug classes (bug_classes.cpp).
const char* class_name(BugClass c);
// One sentence: what the class means and where such bugs usually hide.
const char* class_explanation(BugClass c);

// What the checks saw at one step (only the first divergent step is kept in full).
struct PairMismatch {
  int row;
  std::int64_t query_index;
  std::int64_t key_uid;
  std::int64_t key_index;                      // -1 when the uid is not in the row's history
  std::optional<std::int64_t> expected;        // Pq - Pk; none: should not be visible
  std::optional<std::int64_t> actual;          // none: the cache did not use it
  std::optional<std::int64_t> query_position;  // the query rotation the cache used
  std::int64_t evicted_before = 0;             // E of the query (sink policy)
};

struct SlotIssue {
  enum class Kind { stale, duplicated, lost, extra, wrong_index, rotation } kind;
  int row;
  int layer = 0;  // where it was seen (slots, and so most issues, are shared by every layer)
  std::int64_t slot = -1;
  std::int64_t uid = -1;
  std::int64_t claimed_index = -1, true_index = -1;
  std::int64_t claimed_position = 0;
  std::optional<std::int64_t> recovered_position;  // exact or ambiguous recovery
  OtherRope fits;                                  // another rope that fits, if any
  std::int64_t window_gap = 0;                     // extra: how far before the window start
  bool newest = false;                             // the token is the row's newest
  bool in_chunk = false;                           // the token came in this step's chunk
  bool dead = false;                               // extra: a dead token held under declared eager eviction
  bool block_count = false;  // extra or lost against a declared block buffer's L(T) (SPEC 3.1), not the policy's set
  bool closest_at_claim = false;  // rotation: nearer its claim than its neighbours, beyond the storage's rounding
  bool quantized = false;         // stale, extra: the slot holds codes, not a raw residual token

  static SlotIssue of(Kind kind, int row, std::int64_t uid, std::int64_t true_index) {
    SlotIssue i{};
    i.kind = kind;
    i.row = row;
    i.uid = uid;
    i.true_index = true_index;
    return i;
  }
};

// SPEC 9.2.1: a stored code or scale that is not the format's rule applied to the key or
// value the cache should hold.
struct CodeMismatch {
  int layer, row, kv_head;
  bool value;  // in V (else K)
  std::int64_t uid, slot;
  int element;           // -1: the scale of group `group`; -2 its zero point; -3 its bias (SPEC 9.7)
  int group;
  double expected, actual;  // the code, or the scale
  // A prefix hit's token (SPEC 8.4) whose stored scale is the reading row's own frozen one,
  // not the one its writer stored it with.
  bool readers_scale = false;
};

// SPEC 8.8: a paged cache's bookkeeping that is not what its rows hold. `block` and `slot`
// name the physical place, `logical` the row's table entry.
struct PagedIssue {
  enum class Kind {
    slot_mapping,     // a token in another slot of its block than t % B
    mapping_table,    // a trace's slot mapping wrote a token elsewhere than its table entry says
    stale_entry,      // a table entry holding no token of the row (past its end, or another row's)
    freed_visible,    // a null entry where the row has a live token
    unwritten_hit,    // a hit block not yet written when it was hit (same step)
    shared_write,     // a block that several rows reference changed
    refcount,         // reported refcount is not the references in the tables
    hit_across,       // a hit block whose context keys are not the row's
    hit_stale,        // a hit larger than any block with the row's context keys could give
    hit_unaligned,    // a hit past floor((n - 1) / B) * B or not whole blocks
    hit_expected,     // the hit is not the scenario's expect_hit
  } kind;
  int layer = 0, row = 0;
  std::int64_t logical = -1, block = -1, slot = -1;
  std::string detail;
};

// SPEC 8.8.5: an output that is one of a paged cache's poison NaNs (optimized/poison.h):
// its query read a slot of a block no token was written to, or one that was freed.
struct PoisonedRead {
  int layer, row;
  std::int64_t query_index, uid;
  std::int64_t block, epoch;  // mod 16384 and mod 64, as the NaN carries them
  bool freed;                 // else never written
};

// SPEC 9.2.4: a retained token held raw where the residual rules quantize it, or the reverse.
struct PrecisionIssue {
  int layer, row;
  std::int64_t uid, index, slot;
  bool expected_raw;
};

// SPEC 9.2.6: one token computed in a decode step and inside a chunk, over the same stored
// cache, with outputs further apart than twice check 2's tolerance. `step` is where it was
// found (the later computation), `other_step` the earlier one.
struct PathIssue {
  int layer, row;
  std::size_t step;
  std::int64_t index, uid;
  bool decode;  // the computation at `step` was a decode; the other was inside a chunk
  std::size_t other_step;
  std::int64_t other_index, other_uid;
  int head, dim;
  double here, there, allowed;
};

// SPEC 11.1: a kv head that holds another number of its prompt's tokens after an observed
// prune than the prune keeps.
struct KeptCount {
  int layer, row, kv_head;
  std::int64_t held, expected, prompt;
};

struct OutputMismatch {
  int layer, row, head, dim;
  std::int64_t query_index, uid;
  double expected, actual;
};

struct StepEvidence {
  std::size_t step = 0;
  std::string label;
  bool between_forwards = false;  // the state between two forwards of a chunked append (SPEC 8.7)
  std::string refusal;  // non-empty: the cache and the policy disagree on a refusal
  bool raised = false;  // the cache raised where the policy accepts the step
  std::vector<OutputMismatch> outputs;
  std::vector<PairMismatch> pairs;
  std::vector<SlotIssue> slots;
  std::vector<CodeMismatch> codes;        // SPEC 9.2.1
  std::vector<PagedIssue> paged;          // SPEC 8.8
  std::vector<PrecisionIssue> precision;  // SPEC 9.2.4
  std::vector<PathIssue> paths;           // SPEC 9.2.6
  std::vector<KeptCount> kept_counts;     // SPEC 11.1
  std::optional<PoisonedRead> poisoned;   // SPEC 8.8.5: the first output that is a poison NaN
  bool outputs_fit_unit_scale = false;    // quantized: recomputed with every scale read as 1, the outputs fit
  bool outputs_fit_quantized_query = false;  // quantized: with the query quantized to q8_0 too, they fit
  // Quantized with a transform: every row whose codes are wrong stands for its token's value
  // when read without the transform (a path that forgot it).
  bool codes_fit_without_transform = false;
  std::int64_t evicted_before_last = 0;  // E of the diagnosed row's last token (sink policy)
  bool chunk_kept_whole = false;         // a row holds all of a chunk longer than the policy keeps
  bool wrong_row_count = false;          // the cache holds another number of rows than the reference
  bool query_unreadable = false;         // a trace's rotated query is no rotation of its raw query
  bool unrecorded = false;               // a trace left out an append step without saying why
  // Layer `first` of a hybrid holds exactly what layer `second`'s policy keeps.
  std::optional<std::pair<int, int>> layer_holds_policy_of;
  bool hypotheses_tested = false;                  // the first output mismatch was recomputed under named mistakes:
  bool outputs_fit_without_learned_sinks = false;  // without learned sinks: it matched, the cache dropped them
  bool outputs_fit_with_a_zero_sink = false;       // a sink of logit 0 added where the model has none
  bool outputs_fit_with_later_chunk_keys = false;  // with the chunk's later tokens visible: the mask missed causality
  bool outputs_fit_plain_window = false;  // over a plain window of W, no sinks: the mask forgot the sinks
  bool outputs_fit_window_off_by_one = false;  // a sliding layer's, over W + 1 or W - 1 keys
  bool outputs_fit_window_in_token_indices = false;  // a sliding layer under a shift, its window in indices
  bool outputs_fit_chunk_edge_off_by_one = false;  // a chunked layer's, its chunks moved by one token
  bool outputs_fit_chunk_as_window = false;        // a chunked layer's, over a sliding window of C
  bool outputs_fit_without_query_temperature = false;  // a NoPE layer's query not scaled (SPEC 10.3)
  // The diagnosed query should see a token that is dead after the step and gone: dropping it
  // is allowed after this forward, not before it.
  bool dropped_before_last_use = false;
  int layer = 0;  // the diagnosed layer, whose policy classify() reads
  bool empty() const {
    return !raised && !wrong_row_count && !query_unreadable && !unrecorded && refusal.empty() && outputs.empty() &&
           pairs.empty() && slots.empty() && codes.empty() && paged.empty() && precision.empty() && paths.empty() &&
           kept_counts.empty();
  }
};

// What led up to the step: ops since the last reset, padding seen.
struct StepContext {
  // The most recent step that rearranged rows: what a stale or misplaced slot points back to.
  enum class RowChange { none, reset_same_batch, reset_new_batch, reorder } last_row_change = RowChange::none;
  bool padded = false;              // some append so far left-padded a row
  std::vector<bool> padded_rows;    // which rows (as now numbered) were left-padded so far
  // The sinks of the re-rotating prune (SPEC 11) since the last reset, if one ran.
  std::optional<std::int64_t> rerotating_prune_sinks;
};

BugClass classify(const Scenario& scenario, const StepEvidence& evidence, const StepContext& context);

// "a poison NaN: block 5 (epoch 2), never written", for reports.
// SPEC 10.2's chunk edge off by one: where query t's chunk starts when the chunks are
// drawn from token `by` (1 or -1) instead of 0, C tokens each.
inline std::int64_t chunk_start_moved(std::int64_t t, std::int64_t c, std::int64_t by) {
  const std::int64_t shifted = t - by;
  const std::int64_t floor_div = shifted >= 0 ? shifted / c : -((-shifted + c - 1) / c);
  return floor_div * c + by;
}

std::string poison_text(const PoisonedRead& read);

// How the position error of the diagnosed row evolves from the first divergence on: the
// signed error (actual - expected Pq - Pk, or recovered - claimed key position) per step.
struct Drift {
  enum class Shape { none, constant, growing_by_one, only_at_evictions, varies } shape = Shape::none;
  struct Point {
    std::size_t step;
    std::int64_t error;
    bool evicted;  // the row evicted at this step
  };
  std::vector<Point> points;
  // Re-rotation drift: the largest rotation error of a stored key per append step, when
  // positions are right but keys are rounded again and again.
  std::vector<std::pair<std::size_t, double>> rotation_errors;
  bool empty() const { return points.empty() && rotation_errors.empty(); }
  std::string to_string() const;  // one sentence
};

Drift summarize_drift(std::vector<Drift::Point> points);

}  // namespace kvcheck
