// SPEC 9.2.6 on hand-made outputs: a token computed in a decode step and inside a chunk over
// the same stored cache agrees within the sum of both check 2 allowances, or is named.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "tools/harness/check/path_checks.h"

using namespace kvcheck;

namespace {

Scenario prefix_scenario() {
  Scenario s;
  s.content = Content::prefix;
  s.policies = {Policy{}};  // one layer, full attention
  s.dims.heads = 1;
  s.dims.head_dim = 2;
  return s;
}

// One computation of the token with context key 7 at token index 5.
struct Computation {
  std::vector<float> out;
  std::vector<double> want{1.0, 2.0}, allowed{0.1, 0.1};
  PathToken token(std::size_t step, bool decode, std::int64_t uid) const {
    return {0, 0, step, 5, uid, decode, 7, out, want, allowed};
  }
};

// The "path consistency" line of the report, if the checks add one.
std::optional<Check> path_check(const PathChecks& checks) {
  Outcome outcome;
  checks.add_checks(outcome);
  if (outcome.checks.empty()) return std::nullopt;
  return outcome.checks.front();
}

}  // namespace

TEST(PathChecks, WithinBothAllowancesAgreesBeyondThemDisagrees) {
  PathChecks checks(prefix_scenario());
  StepEvidence chunk_step, decode_step, other_decode;
  const Computation chunk{{1.0f, 2.0f}}, close{{1.15f, 2.0f}}, far{{1.0f, 2.25f}};
  checks.record(chunk.token(0, false, 5), chunk_step);
  checks.record(close.token(3, true, 40), decode_step);  // 0.15 <= 0.1 + 0.1
  EXPECT_TRUE(decode_step.paths.empty());
  checks.record(far.token(4, true, 41), other_decode);  // 0.25 > 0.2, in dim 1
  ASSERT_EQ(other_decode.paths.size(), 1u);
  const PathIssue& i = other_decode.paths.front();
  EXPECT_EQ(i.dim, 1);
  EXPECT_TRUE(i.decode);
  EXPECT_EQ(i.other_step, 0u);
  EXPECT_EQ(i.other_uid, 5);
  EXPECT_FLOAT_EQ(static_cast<float>(i.here), 2.25f);
  EXPECT_FLOAT_EQ(static_cast<float>(i.there), 2.0f);
  const std::optional<Check> line = path_check(checks);
  ASSERT_TRUE(line);
  EXPECT_FALSE(line->passed);
}

TEST(PathChecks, ANanOutputDisagrees) {
  PathChecks checks(prefix_scenario());
  StepEvidence a, b;
  checks.record(Computation{{1.0f, 2.0f}}.token(0, true, 5), a);
  checks.record(Computation{{1.0f, std::numeric_limits<float>::quiet_NaN()}}.token(1, false, 9), b);
  EXPECT_EQ(b.paths.size(), 1u);
}

TEST(PathChecks, OnlyTheOtherPathOverTheSameStoredCacheIsCompared) {
  PathChecks checks(prefix_scenario());
  StepEvidence e;
  Computation other_cache{{9.0f, 9.0f}};
  other_cache.want = {1.0, 2.5};  // another expected output: another stored cache (a per-tensor scale, say)
  checks.record(Computation{{1.0f, 2.0f}}.token(0, false, 5), e);
  checks.record(Computation{{9.0f, 9.0f}}.token(1, false, 6), e);  // the same path again
  checks.record(other_cache.token(2, true, 7), e);
  EXPECT_TRUE(e.paths.empty());
  EXPECT_FALSE(path_check(checks));  // nothing compared: no check line
}

TEST(PathChecks, NothingRepeatsUnderUidContentOrIsComparableUnderRawChunkReads) {
  Scenario uid = prefix_scenario();
  uid.content = Content::uid;
  EXPECT_FALSE(PathChecks(uid).enabled());
  Scenario raw = prefix_scenario();
  KvQuant reads_raw;
  reads_raw.chunk_reads = ChunkReads::raw;
  raw.quantize_every_layer(reads_raw);
  EXPECT_FALSE(PathChecks(raw).enabled());
  EXPECT_TRUE(PathChecks(prefix_scenario()).enabled());
}

TEST(PathChecks, AnEarlierStepLearnsOfALaterDisagreementFromItsOwnSide) {
  PathChecks checks(prefix_scenario());
  StepEvidence decode_step, chunk_step;
  checks.record(Computation{{1.0f, 2.0f}}.token(3, true, 5), decode_step);
  checks.record(Computation{{1.5f, 2.0f}}.token(9, false, 50), chunk_step);
  ASSERT_EQ(chunk_step.paths.size(), 1u);
  const auto told = checks.found_later_for(3);
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].step, 3u);
  EXPECT_EQ(told[0].other_step, 9u);
  EXPECT_TRUE(told[0].decode);
  EXPECT_EQ(told[0].uid, 5);
  EXPECT_EQ(told[0].other_uid, 50);
  EXPECT_FLOAT_EQ(static_cast<float>(told[0].here), 1.0f);
  EXPECT_TRUE(checks.found_later_for(9).empty());  // found there already
}

TEST(PathChecks, PathsAloneClassAsTheTwoPathsDisagreeing) {
  Scenario s = prefix_scenario();
  s.quantize_every_layer(KvQuant{});
  StepEvidence e;
  e.outputs.push_back({0, 0, 0, 0, 96, 96, 1.0, 1.1});
  EXPECT_EQ(classify(s, e, {}), BugClass::quant_dequantization_layout);  // outputs alone, under quantization
  e.paths.push_back({0, 0, 7, 96, 96, true, 42, 96, 226, 0, 0, 1.1, 1.0, 0.01});
  EXPECT_EQ(classify(s, e, {}), BugClass::path_inconsistency);
  e.slots.push_back(SlotIssue::of(SlotIssue::Kind::stale, 0, 3, -1));  // a wrong slot explains more
  EXPECT_NE(classify(s, e, {}), BugClass::path_inconsistency);
}
