// The reference's invariants: chunk invariance and the one-by-one split it relies on.
#include <gtest/gtest.h>

#include "tools/harness/inputs.h"
#include "tools/harness/reference_checks.h"

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
