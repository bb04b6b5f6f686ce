// SPEC 8.7: the state between two forwards of a chunked append, cut out of the reference's
// whole step. Expected values are worked by hand from the sliding window's rule.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tools/harness/run/forward_record.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {
namespace {

std::vector<std::int64_t> indices(const std::vector<reference::RetainedKey>& keys) {
  std::vector<std::int64_t> out;
  for (const auto& key : keys) out.push_back(key.index);
  return out;
}

// The fixture's reference run: window 6, prompts of 17 and 11 tokens in forwards of 5.
struct SlidingRun {
  Scenario s =
      load_scenario(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios/paged_sliding_chunked_prefill.json");
  InputTable inputs = load_inputs(s);
  ReferenceRun run = run_reference(s, inputs);
};

// Window 6, prompts of 17 and 11 tokens in forwards of 5: after forward 2 both rows hold
// tokens 0 .. 9.
TEST(ForwardRecord, ASlidingRowBetweenForwardsKeepsItsWindowAndTheForwardsOutputs) {
  const SlidingRun r;
  const Scenario& s = r.s;
  const StepRecord& whole = r.run.steps[0];
  const StepRecord part = forward_record(s, whole, {5, 5}, {10, 10}, 2);

  EXPECT_EQ(step_label(part, 0), "step 0 (append, /steps/0) after forward 2");
  for (int b = 0; b < 2; ++b) {
    // Token 9 saw 4 .. 9; token 10 will see 5 .. 10, of which 5 .. 9 are held.
    EXPECT_EQ(indices(part.retained_in(0, b).keys), (std::vector<std::int64_t>{4, 5, 6, 7, 8, 9})) << "row " << b;
    EXPECT_EQ(indices(part.retained_in(0, b).live), (std::vector<std::int64_t>{5, 6, 7, 8, 9})) << "row " << b;
    EXPECT_EQ(part.histories[b].size(), 10u);
    ASSERT_EQ(part.append->rows[b].size(), 5u);
    EXPECT_EQ(part.append->rows[b].front().index, 5);
    EXPECT_EQ(part.append->rows[b].back().index, 9);
  }
  EXPECT_EQ(part.after_append[0].size(), 17u);
  EXPECT_EQ(part.after_append[1].size(), 11u);

  // Outputs: row b's forward token i is whole-step token 5 + i, which sits after 17 - count
  // places of left padding ([L, B, n, H, D]).
  const std::size_t HD = static_cast<std::size_t>(s.dims.heads * s.dims.head_dim);
  const std::size_t counts[2] = {17, 11};
  ASSERT_EQ(part.append->chunk, 5);
  for (std::size_t l = 0; l < 2; ++l)
    for (std::size_t b = 0; b < 2; ++b)
      for (std::size_t i = 0; i < 5; ++i)
        for (std::size_t e = 0; e < HD; ++e) {
          const double got = part.append->out[((l * 2 + b) * 5 + i) * HD + e];
          const double want = whole.append->out[((l * 2 + b) * 17 + (17 - counts[b]) + 5 + i) * HD + e];
          ASSERT_FALSE(std::isnan(got));
          ASSERT_EQ(got, want) << "layer " << l << " row " << b << " token " << 5 + i;
        }
}

// A row whose forwards are over while another's go on is as after the whole append.
TEST(ForwardRecord, ARowThatIsDoneIsAsAfterTheAppend) {
  const SlidingRun r;
  const Scenario& s = r.s;
  const StepRecord& whole = r.run.steps[0];
  // Forward 3: row 0 at 15 of 17 tokens, row 1 done at 11 (its third forward was one token).
  const StepRecord part = forward_record(s, whole, {10, 10}, {15, 11}, 3);
  EXPECT_EQ(indices(part.retained_in(0, 0).keys), (std::vector<std::int64_t>{9, 10, 11, 12, 13, 14}));
  EXPECT_EQ(indices(part.retained_in(0, 1).keys), (std::vector<std::int64_t>{5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(part.histories[1].size(), 11u);
  ASSERT_EQ(part.append->rows[1].size(), 1u);
  EXPECT_EQ(part.append->rows[1][0].index, 10);
  EXPECT_EQ(part.append->chunk, 5);
}

}  // namespace
}  // namespace kvcheck
