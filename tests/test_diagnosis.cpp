// Classification rules on hand-made evidence: each case is the evidence a bug leaves.
#include <gtest/gtest.h>

#include "tools/harness/diagnosis.h"

using namespace kvcheck;

namespace {

Scenario sink_scenario() {
  Scenario s;
  s.policy.kind = PolicyKind::sink;
  s.policy.sinks = 2;
  s.policy.window = 6;
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
