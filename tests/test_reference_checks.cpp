// The reference's invariants: chunk invariance and the one-by-one split it relies on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tools/harness/scenario/inputs.h"
#include "tools/harness/check/reference_checks.h"

using namespace kvcheck;

namespace {

Scenario padded(const std::string& policy) {
  return parse_scenario(R"({"name": "chunks", "dimensions": {"layers": 2, "batch": 3, "heads": 2, "head_dim": 4},
    "policy": )" + policy + R"(, "seed": 11,
    "steps": [{"op": "append", "tokens": [3, 9, 0]}, {"op": "append", "tokens": [4, 2, 6]}, {"op": "decode", "steps": 3}]})",
                        "chunks.json");
}

const Check& find(const Outcome& o, const std::string& name) {
  for (const Check& c : o.checks)
    if (c.name == name) return c;
  throw std::runtime_error("no check " + name);
}

}  // namespace

TEST(ReferenceChecks, SplitKeepsEveryTokensRawVectors) {
  const Scenario s = padded(R"({"type": "full"})");
  const InputTable inputs = load_inputs(s);
  const SplitScenario split = split_into_single_tokens(s, inputs);
  // Step 0 becomes 9 single-token steps (the longest chunk); row 0's first token is the
  // 7th of them (left padding), its uid in the split run is 6 (row 1 took 0..5).
  EXPECT_EQ(split.scenario.steps[6].tokens, (std::vector<std::int64_t>{1, 1, 0}));
  EXPECT_EQ(split.inputs.k_at(1, 6, 0)[2], inputs.k_at(1, 0, 0)[2]);  // row 0, token 0: original uid 0
  EXPECT_EQ(split.inputs.q_at(0, 0, 1)[3], inputs.q_at(0, 3, 1)[3]);  // row 1, token 0: original uid 3
}

TEST(ReferenceChecks, ChunkInvarianceHoldsForStreamingPolicies) {
  for (const char* policy : {R"({"type": "full"})", R"({"type": "sliding", "window": 4})",
                             R"({"type": "sink", "sinks": 2, "window": 5, "evict": 2})"}) {
    const Scenario s = padded(policy);
    const InputTable inputs = load_inputs(s);
    const Outcome o = check_reference(s, inputs, run_reference(s, inputs));
    EXPECT_TRUE(o.passed()) << policy << ": " << o.first_failure()->detail;
  }
}

TEST(ReferenceChecks, DensePrefillReallyDiffersFromStreaming) {
  // The property the chunk check relies on can fail: a dense chunk longer than the window
  // sees tokens that streaming would have evicted.
  const Scenario dense = padded(R"({"type": "sink", "sinks": 1, "window": 4, "prefill": "dense"})");
  const Scenario streaming = padded(R"({"type": "sink", "sinks": 1, "window": 4})");
  const InputTable inputs = load_inputs(dense);
  const auto a = run_reference(dense, inputs), b = run_reference(streaming, inputs);
  EXPECT_NE(a.steps[0].append->out, b.steps[0].append->out);
  EXPECT_EQ(find(check_reference(dense, inputs, a), "chunk invariance").detail,
            "not applicable: dense prefill is chunk-dependent by design");
}

TEST(ReferenceChecks, MissingExpectedErrorFails) {
  const Scenario s = parse_scenario(R"({"name": "x", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "head_dim": 2},
    "policy": {"type": "full"}, "steps": [{"op": "append", "tokens": 4}, {"op": "crop", "length": 2, "expect_error": "crop_evicted"}]})",
                                    "x.json");
  const InputTable inputs = load_inputs(s);
  const Outcome o = check_reference(s, inputs, run_reference(s, inputs));
  EXPECT_FALSE(o.passed());
  EXPECT_EQ(find(o, "expected errors").detail,
            "step 1 (crop, /steps/1): expected the error \"crop_evicted\", but the step was accepted");
}

TEST(ReferenceChecks, AStepThatDoesNotAttendKeepsTheStateExact) {
  // The sampled self-check steps through unsampled tokens without attending: their outputs
  // are NaN, their views and every later output are those of a run that attended.
  const Scenario s = padded(R"({"type": "sink", "sinks": 1, "window": 5, "evict": 2})");
  const InputTable inputs = load_inputs(s);
  std::vector<bool> attend(s.steps.size(), true);
  attend[1] = false;
  ReferenceStepper all(s, inputs), some(s, inputs, attend);
  for (std::size_t i = 0; i < s.steps.size(); ++i) {
    const StepRecord a = all.next(), b = some.next();
    ASSERT_EQ(a.append->rows.size(), b.append->rows.size());
    for (std::size_t r = 0; r < a.append->rows.size(); ++r)
      for (std::size_t t = 0; t < a.append->rows[r].size(); ++t)
        EXPECT_EQ(a.append->rows[r][t].view.keys.size(), b.append->rows[r][t].view.keys.size());
    ASSERT_EQ(a.append->out.size(), b.append->out.size());
    const auto same = [](double x, double y) { return x == y || (std::isnan(x) && std::isnan(y)); };
    if (i == 1)
      EXPECT_TRUE(std::all_of(b.append->out.begin(), b.append->out.end(), [](double x) { return std::isnan(x); }));
    else
      EXPECT_TRUE(std::equal(a.append->out.begin(), a.append->out.end(), b.append->out.begin(), same)) << "step " << i;
  }
}

TEST(ReferenceChecks, OverTheBudgetTheSelfCheckSamplesChunkAndWindowEdges) {
  // One row, sliding W 6: a 20-token prompt, a 10-token chunk, 3 decodes. The cost (hand
  // count: the prompt's tokens see 1..6 keys, 105 in all; the chunk's 60, the decodes' 18;
  // 183 keys x 2 heads x D 4 x 2) is 2928 multiply-adds; a budget of 1000 samples every 3rd.
  const Scenario s = parse_scenario(R"({"name": "edges", "dimensions": {"layers": 1, "batch": 1, "heads": 2, "head_dim": 4},
    "policy": {"type": "sliding", "window": 6}, "seed": 3,
    "steps": [{"op": "append", "tokens": 20}, {"op": "append", "tokens": 10}, {"op": "decode", "steps": 3}]})",
                                    "edges.json");
  const InvarianceSample sample = invariance_sample(s, 1000);
  EXPECT_EQ(sample.every, 3);
  ASSERT_EQ(sample.attend.size(), 33u);
  std::vector<int> chosen;
  for (int i = 0; i < 33; ++i)
    if (sample.attend[static_cast<std::size_t>(i)]) chosen.push_back(i);
  // Prompt: 0-3 and 16-19 (edges), 1-9 (within 4 of t = 5), every 3rd (0, 3, ..., 18);
  // chunk (tokens 20-29): 20-23, 26-29, 21 and 24 (every 3rd); decodes 30-32.
  EXPECT_EQ(chosen, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 26, 27,
                                      28, 29, 30, 31, 32}));
  EXPECT_EQ(sample.sampled, 28);
  EXPECT_EQ(invariance_sample(s, 1e10).attend.size(), 0u);  // within the budget: every token

  const InputTable inputs = load_inputs(s);
  ReferenceChecks checks(s, inputs, 1000);
  const ReferenceRun run = run_reference(s, inputs);
  for (std::size_t i = 0; i < run.steps.size(); ++i) checks.step(i, run.steps[i]);
  const Outcome o = checks.finish({});
  EXPECT_TRUE(o.passed());
  EXPECT_EQ(find(o, "chunk invariance").detail,
            "bit-identical to one-by-one feeding on a sample of 28 of 33 tokens (chunk and window edges, one token in 3), "
            "as the scenario is over the full self-check's budget");
}
