// Classification rules on hand-made evidence: each case is the evidence a bug leaves.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "tools/harness/check/diagnosis.h"

using namespace kvcheck;

namespace {

Scenario sink_scenario() {
  Scenario s;
  s.policies = {Policy{PolicyKind::sink, 6, 2}};
  return s;
}

// A key at its absolute index (6) where the cache position 5 was due.
StepEvidence key_left_absolute(bool newest) {
  StepEvidence e;
  SlotIssue i = SlotIssue::of(SlotIssue::Kind::rotation, 0, 12, 6);
  i.claimed_position = 5;
  i.recovered_position = 6;
  i.newest = newest;
  e.slots.push_back(i);
  return e;
}

}  // namespace

TEST(Diagnosis, AnAbsoluteKeyIsTheNewKeyOrTheKeptOnes) {
  EXPECT_EQ(classify(sink_scenario(), key_left_absolute(true), {}), BugClass::new_key_not_shifted);
  EXPECT_EQ(classify(sink_scenario(), key_left_absolute(false), {}), BugClass::kept_keys_not_shifted);
}

TEST(Diagnosis, TheMostRecentRowChangeExplainsAStaleSlot) {
  StepEvidence e;
  e.slots.push_back(SlotIssue::of(SlotIssue::Kind::stale, 1, 40, -1));
  StepContext c;
  c.last_row_change = StepContext::RowChange::reset_new_batch;
  EXPECT_EQ(classify(sink_scenario(), e, c), BugClass::stale_row_after_batch_change);
  c.last_row_change = StepContext::RowChange::reorder;  // a reorder after the resize
  EXPECT_EQ(classify(sink_scenario(), e, c), BugClass::reorder_lost_positions);
  c.last_row_change = StepContext::RowChange::none;
  EXPECT_EQ(classify(sink_scenario(), e, c), BugClass::stale_slot);
}

TEST(Diagnosis, OneExtraTokenJustBeforeTheWindowIsAnOffByOne) {
  StepEvidence e;
  SlotIssue extra = SlotIssue::of(SlotIssue::Kind::extra, 0, 3, 3);
  extra.window_gap = 1;
  e.slots.push_back(extra);
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::window_off_by_one);
  e.slots[0].window_gap = 4;  // an old token kept: not a window edge
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::evicted_wrong_token);
}

TEST(Diagnosis, OutputsAloneMeanTheArithmetic) {
  StepEvidence e;
  e.outputs.push_back({0, 0, 0, 0, 3, 3, 0.5, 0.6});
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::output_mismatch_positions_correct);
  EXPECT_EQ(classify(sink_scenario(), StepEvidence{}, {}), BugClass::none);
}

TEST(Diagnosis, WrongOutputsBesideADeadTokenGoneBeforeTheForwardAreADropBeforeItsLastUse) {
  // transformers 4.46's SlidingWindowCache (W 6) at token 5: token 0 is dead after the
  // step, but token 5 should have seen it, and the buffer rolled it out before the forward.
  StepEvidence e;
  e.outputs.push_back({0, 0, 0, 0, 5, 10, 0.0557, 0.0793});
  e.dropped_before_last_use = true;
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::dropped_before_last_use);
  e.outputs.clear();  // the same state with right outputs: an eager cache, nothing to name
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::none);
}

TEST(Diagnosis, KeysMovedForwardByTheirRowsPaddingAreCountedPadding) {
  // Rows 0 and 1 both padded (by 5 and 2): row 0's keys at 5, 6 claimed 0, 1; row 1's at 5
  // claimed 3. Each padded row's keys moved forward by one amount: padding counted.
  StepEvidence e;
  for (auto [row, index, recovered] : {std::tuple{0, 0, 5}, {0, 1, 6}, {1, 3, 5}}) {
    SlotIssue i = SlotIssue::of(SlotIssue::Kind::rotation, row, index, index);
    i.claimed_position = index;
    i.recovered_position = recovered;
    e.slots.push_back(i);
  }
  StepContext padded;
  padded.padded = true;
  padded.padded_rows = {true, true};
  EXPECT_EQ(classify(sink_scenario(), e, padded), BugClass::padding_counted);
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::key_at_wrong_position);  // no padding so far
  StepContext row0_only = padded;
  row0_only.padded_rows = {true, false};  // row 1 was never padded: its moved key is no padding
  EXPECT_EQ(classify(sink_scenario(), e, row0_only), BugClass::key_at_wrong_position);
  e.slots[1].recovered_position = 7;  // row 0's keys moved by different amounts
  EXPECT_EQ(classify(sink_scenario(), e, padded), BugClass::key_at_wrong_position);
}

TEST(Diagnosis, OutputsThatFitTheChunksLaterKeysAreAMissingCausalMask) {
  StepEvidence e;
  e.outputs.push_back({0, 0, 0, 0, 12, 12, 0.30, 0.24});
  e.hypotheses_tested = true;
  e.outputs_fit_with_later_chunk_keys = true;
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::chunk_sees_future_keys);
  e.outputs_fit_with_later_chunk_keys = false;  // no hypothesis fits: the arithmetic
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::output_mismatch_positions_correct);
}

TEST(Diagnosis, APoisonNaNIsAReadBeforeWriteOrAUseAfterFree) {
  StepEvidence e;
  e.outputs.push_back({0, 0, 0, 0, 3, 3, 0.5, std::nan("")});
  e.poisoned = PoisonedRead{0, 0, 3, 3, 7, 1, false};
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::paged_read_before_write);
  e.poisoned->freed = true;
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::paged_refcount_mismatch);
  EXPECT_EQ(poison_text(*e.poisoned), "a poison NaN: block 7 (epoch 1), freed");
}

TEST(Diagnosis, AChunkedAppendsQueryThatSeesALaterKeySeesTheFuture) {
  Scenario s = sink_scenario();
  s.policies = {Policy{PolicyKind::full}};
  Step append;
  append.op = StepOp::append;
  append.chunk = 4;
  s.steps.push_back(append);
  StepEvidence e;
  e.pairs.push_back({0, 2, 5, 5, std::nullopt, -3, 2, 0});  // query 2 used key 5, later in the append
  EXPECT_EQ(classify(s, e, {}), BugClass::chunk_sees_future_keys);
  e.pairs[0].key_index = 1;  // an earlier key it should not see: not the future
  EXPECT_NE(classify(s, e, {}), BugClass::chunk_sees_future_keys);
}

TEST(Diagnosis, SinkDistancesOffByTheEvictionCountInAChunkAreAQueryNotMovedBack) {
  // S = 2, W = 6: query 9 of a chunked append has E = 4; its sinks 0 and 1 should sit at
  // distances 9 - 4 - 0 = 5 and 4, and were used at 9 and 8: the query rotated once, at t.
  Scenario s = sink_scenario();
  Step append;
  append.op = StepOp::append;
  append.chunk = 4;
  s.steps.push_back(append);
  StepEvidence e;
  e.pairs.push_back({0, 9, 0, 0, 5, 9, 9, 4});
  e.pairs.push_back({0, 9, 1, 1, 4, 8, 9, 4});
  EXPECT_EQ(classify(s, e, {}), BugClass::query_position_not_shifted);
  e.pairs.push_back({0, 9, 7, 7, 2, 3, 9, 4});  // a window key off too: the chunk's positions
  EXPECT_EQ(classify(s, e, {}), BugClass::chunk_positions_wrong);
}

TEST(Diagnosis, RotationDriftSaysWhetherTheErrorGrows) {
  Drift d;
  d.rotation_errors = {{0, 0.001}, {5, 0.01}, {10, 0.02}};
  EXPECT_EQ(d.to_string(),
            "positions stay exact while the largest rotation error of a stored key grows 20.0-fold over 3 steps: "
            "0.001 at step 0, 0.01 at step 5, 0.02 at step 10");
  d.rotation_errors = {{0, 0.01}, {5, 0.012}, {10, 0.015}};  // 1.5-fold: rounding, not growth
  EXPECT_EQ(d.to_string(),
            "positions stay exact and the largest rotation error of a stored key does not grow: 0.01 at step 0, "
            "0.012 at step 5, 0.015 at step 10");
}

TEST(Diagnosis, KeptKeysMovedBackBeforeAnyEvictionIsAShiftOneTokenEarly) {
  // Hugging Face SinkCache at the step the window fills (S = 2, W = 6, token 5 arrives):
  // nothing is evicted yet, but window keys 2..4 were re-rotated one position back.
  StepEvidence e;
  for (std::int64_t index : {2, 3, 4}) {
    SlotIssue i = SlotIssue::of(SlotIssue::Kind::rotation, 0, index, index);
    i.claimed_position = index;
    i.recovered_position = index - 1;
    e.slots.push_back(i);
  }
  e.evicted_before_last = 0;
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::shift_one_token_early);
  e.evicted_before_last = 1;  // after an eviction the same keys are merely at a wrong position
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::key_at_wrong_position);
}

TEST(Diagnosis, ALongChunkHeldWholeIsItsOwnClass) {
  // A 12-token prompt in a window of 6, all 12 held: tokens 2..7 are extra, all from the chunk.
  StepEvidence e;
  for (std::int64_t index = 2; index < 8; ++index) {
    SlotIssue extra = SlotIssue::of(SlotIssue::Kind::extra, 0, index, index);
    extra.in_chunk = true;
    e.slots.push_back(extra);
  }
  e.chunk_kept_whole = true;
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::prompt_kept_whole);
  e.chunk_kept_whole = false;  // some of the chunk went: not kept whole
  EXPECT_NE(classify(sink_scenario(), e, {}), BugClass::prompt_kept_whole);
}

TEST(Diagnosis, ALostLiveTokenAloneIsDroppedEarly) {
  StepEvidence e;
  e.slots.push_back(SlotIssue::of(SlotIssue::Kind::lost, 0, 4, 4));
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::dropped_live_token);
}

// A lost sink is a sink count under a sink policy; in a sliding layer under a shift (SPEC
// 10.4: llama.cpp's iSWA cache reusing a masked sink's cell) it is a live token dropped.
TEST(Diagnosis, ALostSinkOfASlidingLayerUnderAShiftIsALiveTokenDropped) {
  StepEvidence e;
  e.slots.push_back(SlotIssue::of(SlotIssue::Kind::lost, 0, 7, 0));
  EXPECT_NE(classify(sink_scenario(), e, {}), BugClass::dropped_live_token);
  Scenario s = sink_scenario();
  s.policies[0].swa = 4;
  EXPECT_EQ(classify(s, e, {}), BugClass::dropped_live_token);
}

TEST(Diagnosis, TheDriftSummaryNamesHowTheErrorEvolves) {
  using P = Drift::Point;
  EXPECT_EQ(summarize_drift({{4, 1, false}, {5, 2, true}, {6, 3, true}}).shape, Drift::Shape::growing_by_one);
  EXPECT_EQ(summarize_drift({{4, -1, true}, {5, -1, true}, {6, -1, false}}).shape, Drift::Shape::constant);
  EXPECT_EQ(summarize_drift({{4, 1, true}, {5, 0, false}, {6, 2, true}}).shape, Drift::Shape::only_at_evictions);
  EXPECT_EQ(summarize_drift({{4, 1, true}, {5, 0, false}, {6, 5, false}}).shape, Drift::Shape::varies);
  // One pause in five steps is still growth; two in four is not.
  EXPECT_EQ(
      summarize_drift({{3, 1, false}, {4, 2, true}, {5, 3, true}, {6, 3, true}, {7, 4, true}, {8, 5, true}}).shape,
      Drift::Shape::growing_by_one);
  EXPECT_EQ(summarize_drift({{3, 1, false}, {4, 2, true}, {5, 2, true}, {6, 2, true}, {7, 3, true}}).shape,
            Drift::Shape::varies);
  EXPECT_EQ(summarize_drift({P{4, 1, true}}).shape, Drift::Shape::none);
  EXPECT_EQ(summarize_drift({{4, 1, false}, {5, 2, true}}).to_string(),
            "the error grows by about one per step: +1 at step 4, +2 at step 5");
}

// A scenario with a Hadamard kv_quant. Built out of line: inlined into the test body, GCC 12
// at -O3 warns that the optional's payload "may be used uninitialized" (a false positive).
namespace {
[[gnu::noinline]] Scenario hadamard_scenario() {
  Scenario s;
  s.policies = {Policy{}};  // one layer, full attention
  KvQuant q;
  q.transform = QuantTransform::hadamard;
  s.quantize_every_layer(q);
  return s;
}
}  // namespace

TEST(Diagnosis, CodesThatFitOnlyWithoutTheTransformExplainTheRotationsTheyBreak) {
  const Scenario s = hadamard_scenario();
  StepEvidence e;
  SlotIssue garbage = SlotIssue::of(SlotIssue::Kind::rotation, 0, 4, 4);  // read through the transform: no rotation
  garbage.claimed_position = 4;
  e.slots.push_back(garbage);
  e.codes.push_back({0, 0, 0, false, 4, 4, -1, 0, 0.011, 0.0077});
  EXPECT_NE(classify(s, e, {}), BugClass::quant_transform_missing);
  e.codes_fit_without_transform = true;
  EXPECT_EQ(classify(s, e, {}), BugClass::quant_transform_missing);
}

// A hybrid stack is diagnosed with the policy of the layer where the bug was seen: a missing
// sink in the sink layer of a full + sink stack is a sink count, whatever layer 0 does.
TEST(Diagnosis, AHybridIsJudgedWithTheDiagnosedLayersPolicy) {
  Scenario s;
  s.dims.layers = 2;
  s.policies = {Policy{PolicyKind::full}, Policy{PolicyKind::sink, 6, 2}};
  StepEvidence e;
  e.pairs.push_back({0, 7, 1, 1, 4, std::nullopt, 5, 2});  // sink key 1 unseen by the query at cache position 5
  e.layer = 1;
  EXPECT_EQ(classify(s, e, {}), BugClass::sink_count_wrong);
  e.layer = 0;  // the full layer has no sinks to miss
  EXPECT_NE(classify(s, e, {}), BugClass::sink_count_wrong);
}

// Under quantization, slots that decode to no token's values, beside the tokens they should
// have held, are codes read with the wrong layout; one slot holding another token's values
// is still a stale slot.
TEST(Diagnosis, QuantizedSlotsOfNoTokenAreADequantizationLayout) {
  Scenario s;
  s.policies = {Policy{PolicyKind::full}};
  s.quantize_every_layer(KvQuant{});
  StepEvidence e;
  SlotIssue garbage = SlotIssue::of(SlotIssue::Kind::stale, 0, -1, -1);
  garbage.quantized = true;
  e.slots = {garbage, garbage, SlotIssue::of(SlotIssue::Kind::lost, 0, 3, 0), SlotIssue::of(SlotIssue::Kind::lost, 0, 4, 1)};
  EXPECT_EQ(classify(s, e, {}), BugClass::quant_dequantization_layout);
  SlotIssue other = SlotIssue::of(SlotIssue::Kind::stale, 0, 9, -1);  // another row's token
  other.quantized = true;
  e.slots.push_back(other);
  EXPECT_EQ(classify(s, e, {}), BugClass::stale_slot);
  e.slots.pop_back();
  s.quants.clear();  // unquantized: garbage is a stale slot
  EXPECT_EQ(classify(s, e, {}), BugClass::stale_slot);
}

// SPEC 10.2 with C = 4, pairs worked by hand. Query 5 (chunk 4..7) used key 3, the previous
// chunk's last: chunks drawn from token -1 (3..6) explain it, and so would a window of
// four keys (2..5) only if it had used key 2 as well.
TEST(Diagnosis, AChunkedQuerySeeingThePreviousChunksLastKeyIsAChunkEdgeOffByOne) {
  Scenario s;
  s.policies = {Policy{PolicyKind::chunked, 4}};
  StepEvidence e;
  e.pairs.push_back({0, 5, 3, 3, std::nullopt, 2, 5, 0});
  EXPECT_EQ(classify(s, e, {}), BugClass::chunk_edge_off_by_one);
  e.pairs.push_back({0, 5, 2, 2, std::nullopt, 3, 5, 0});  // key 2 too: the last four keys
  EXPECT_EQ(classify(s, e, {}), BugClass::chunk_as_sliding_window);
  // Query 4 starts a chunk; missing nothing, it used keys 1..3: a window of four.
  StepEvidence w;
  for (std::int64_t j = 1; j <= 3; ++j) w.pairs.push_back({0, 4, j, j, std::nullopt, 4 - j, 4, 0});
  EXPECT_EQ(classify(s, w, {}), BugClass::chunk_as_sliding_window);
  // The same pairs under a sliding policy are no chunk's mistake.
  s.policies = {Policy{PolicyKind::sliding, 4}};
  EXPECT_NE(classify(s, e, {}), BugClass::chunk_edge_off_by_one);
  EXPECT_NE(classify(s, e, {}), BugClass::chunk_as_sliding_window);
}

// Outputs alone (a trace without the kernel's pairs): the recomputed hypotheses decide.
TEST(Diagnosis, ChunkedOutputsThatFitAnotherRuleNameIt) {
  Scenario s;
  s.policies = {Policy{PolicyKind::chunked, 4}};
  StepEvidence e;
  e.outputs.push_back({0, 0, 0, 0, 5, 5, 0.5, 0.6});
  EXPECT_EQ(classify(s, e, {}), BugClass::output_mismatch_positions_correct);
  e.outputs_fit_chunk_edge_off_by_one = true;
  EXPECT_EQ(classify(s, e, {}), BugClass::chunk_edge_off_by_one);
  e.outputs_fit_chunk_as_window = true;
  EXPECT_EQ(classify(s, e, {}), BugClass::chunk_as_sliding_window);
}

// chunk_start_moved by hand, C = 4: chunks drawn from token 1 are 1..4, 5..8; from -1,
// 3..6, 7..10 (and -1..2, so token 0 starts at -1).
TEST(Diagnosis, ChunksDrawnFromAnotherTokenStartWhereExpected) {
  EXPECT_EQ(chunk_start_moved(0, 4, 1), -3);
  EXPECT_EQ(chunk_start_moved(4, 4, 1), 1);
  EXPECT_EQ(chunk_start_moved(5, 4, 1), 5);
  EXPECT_EQ(chunk_start_moved(0, 4, -1), -1);
  EXPECT_EQ(chunk_start_moved(2, 4, -1), -1);
  EXPECT_EQ(chunk_start_moved(3, 4, -1), 3);
  EXPECT_EQ(chunk_start_moved(6, 4, -1), 3);
  EXPECT_EQ(chunk_start_moved(7, 4, -1), 7);
}

// SPEC 10.1: a rotation that fits another layer's rope, or a NoPE layer's rotated key.
TEST(Diagnosis, KeysUnderAnotherLayersRopeOrARotatedNoPEKeyAreNamed) {
  StepEvidence e;
  SlotIssue i = SlotIssue::of(SlotIssue::Kind::rotation, 0, 12, 6);
  i.claimed_position = 6;
  i.fits = {OtherRope::Kind::other_layer, "another layer's rope (theta 1e+06, linear)", 6, true};
  e.slots.push_back(i);
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::layer_rotated_with_another_layers_rope);
  e.slots[0].fits.kind = OtherRope::Kind::nope_rotated;
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::nope_layer_rotated);
  e.slots[0].fits.kind = OtherRope::Kind::theta;  // a theta of no layer: the scenario's rope is wrong
  EXPECT_EQ(classify(sink_scenario(), e, {}), BugClass::wrong_rope_theta_or_scaling);
}
