// Scenario validation: every error names the file, the JSON path and what was expected.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/scenario/scenario.h"

using kvcheck::InputError;
using kvcheck::parse_scenario;

namespace {

// A valid scenario with one field replaced by `patch` (a raw JSON fragment per key).
std::string scenario(const std::string& dims = R"({"layers": 1, "batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 8})",
                     const std::string& policy = R"({"type": "sink", "sinks": 2, "window": 8})",
                     const std::string& steps = R"([{"op": "append", "tokens": 5}])", const std::string& extra = "") {
  return R"({"name": "t", "dimensions": )" + dims + R"(, "policy": )" + policy + R"(, "steps": )" + steps + extra + "}";
}

std::string error_of(const std::string& text) {
  try {
    parse_scenario(text, "s.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(ScenarioValidation, AcceptsAValidScenario) {
  const auto s = parse_scenario(scenario(), "s.json");
  EXPECT_EQ(s.dims.heads, 4);
  EXPECT_EQ(s.policy(0).sinks, 2);
  EXPECT_EQ(s.steps.size(), 1u);
}

TEST(ScenarioValidation, UnknownKeyIsATypo) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "head_dim": 8})",
                              R"({"type": "sink", "sinks": 2, "widow": 8})")),
            "s.json: /policy/widow: unknown key \"widow\" (expected one of: type, sinks, window, evict, positions, "
            "prefill)");
}

TEST(ScenarioValidation, HeadsMustBeAMultipleOfKvHeads) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "kv_heads": 3, "head_dim": 8})")),
            "s.json: /dimensions/kv_heads: heads (4) must be a multiple of kv_heads (3)");
}

TEST(ScenarioValidation, HeadDimMustBeEven) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "head_dim": 7})")),
            "s.json: /dimensions/head_dim: expected an even head_dim, got 7");
}

TEST(ScenarioValidation, SizesMustBePositive) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 0, "batch": 2, "heads": 4, "head_dim": 8})")),
            "s.json: /dimensions/layers: expected an integer >= 1, got 0");
}

TEST(ScenarioValidation, SinksMustBeBelowTheWindow) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "head_dim": 8})",
                              R"({"type": "sink", "sinks": 8, "window": 8})")),
            "s.json: /policy/sinks: expected sinks < window (8), got 8");
}

TEST(ScenarioValidation, EvictMustFitBesideTheSinks) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "head_dim": 8})",
                              R"({"type": "sink", "sinks": 2, "window": 8, "evict": 7})")),
            "s.json: /policy/evict: expected 1 <= evict <= window - sinks (6), got 7");
}

TEST(ScenarioValidation, PerRowCountsMustMatchTheBatch) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "head_dim": 8})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": [1, 2, 3]}])")),
            "s.json: /steps/0/tokens: expected one count per row (2 rows), got 3");
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "head_dim": 8})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 2}, {"op": "append", "tokens": [1, -2]}])")),
            "s.json: /steps/1/tokens/1: expected an integer >= 0, got -2");
}

TEST(ScenarioValidation, ReorderIndicesMustBeInRangeOfTheCurrentBatch) {
  // After the first reorder the batch has 3 rows, so row 3 is out of range.
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 2, "heads": 4, "head_dim": 8})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 2}, {"op": "reorder", "rows": [0, 0, 1]},
                                  {"op": "reorder", "rows": [2, 3]}])")),
            "s.json: /steps/2/rows/1: expected a row index below 3, got 3");
}

TEST(ScenarioValidation, UnknownOpAndUnknownErrorName) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "apend", "tokens": 2}])")),
            "s.json: /steps/0/op: expected one of append, decode, reorder, reset, crop, free, evict, preempt, resume, prune, got \"apend\"");
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "crop", "length": 2, "expect_error": "oops"}])")),
            "s.json: /steps/0/expect_error: expected one of crop_evicted, got \"oops\"");
}

TEST(ScenarioValidation, MissingFieldAndBadJson) {
  EXPECT_EQ(error_of(R"({"name": "t", "policy": {"type": "full"}, "steps": []})"),
            "s.json: /dimensions: missing required field");
  EXPECT_EQ(error_of("{\n  \"name\": \"t\",\n  \"dimensions\": {,\n}"),
            "s.json: not valid JSON: parse error at line 3, column 18: syntax error while parsing object key - "
            "unexpected ','; expected string literal");
}

TEST(ScenarioValidation, ADuplicatedKeyIsAnError) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 2}, {"op": "crop", "length": 1, "length": 2}])")),
            "s.json: /steps/1/length: the key appears twice in this object");
}

TEST(ScenarioValidation, LinearScalingNeedsAFactor) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 2}])", R"(, "rope": {"scaling": "linear"})")),
            "s.json: /rope/factor: missing required field");
}

TEST(ScenarioValidation, NamesCannotEscapeTheirFolder) {
  EXPECT_EQ(error_of(R"({"name": "..", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "head_dim": 2},
                         "policy": {"type": "full"}, "steps": [{"op": "append", "tokens": 1}]})"),
            "s.json: /name: expected letters, digits, '_', '-' or '.', not starting with '.' (the name names output "
            "folders)");
}

TEST(ScenarioValidation, HugeSizesAreErrorsNotCrashes) {
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 10000000000, "heads": 1, "head_dim": 2})")),
            "s.json: /dimensions/batch: expected an integer <= 4096, got 10000000000");
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "decode", "steps": 1000001}])")),
            "s.json: /steps/0/steps: expected an integer <= 1000000, got 1000001");
  EXPECT_EQ(error_of(scenario(R"({"layers": 64, "batch": 64, "heads": 64, "head_dim": 256})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 4096}])")),
            // 4096 tokens x 64 rows x 64 layers x (64 + 2 x 64 heads) x 256 dims
            "s.json: /steps: the scenario needs 8.25e+11 input values; kvcheck accepts up to 1e9");
}

TEST(ScenarioValidation, SeedsAreUnsigned64Bit) {
  const auto s =
      parse_scenario(scenario(R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 1}])", R"(, "seed": 18446744073709551615)"),
                     "s.json");
  EXPECT_EQ(s.inputs.seed, 18446744073709551615ull);
  EXPECT_EQ(error_of(scenario(R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 1}])", R"(, "seed": -1)")),
            "s.json: /seed: expected an integer from 0 to 2^64 - 1, got -1");
}

TEST(ScenarioValidation, InlineInputsAreCheckedAgainstTheShape) {
  // 1 layer, 2 uids, 1 head, D = 2: q, k, v are [1, 2, 1, 2].
  const std::string dims = R"({"layers": 1, "batch": 1, "heads": 1, "head_dim": 2})";
  const std::string steps = R"([{"op": "append", "tokens": 2}])";
  const auto s = parse_scenario(
      scenario(
          dims, R"({"type": "full"})", steps,
          R"(, "inputs": {"q": [[[[1, 2]], [[3, 4]]]], "k": [[[[5, 6]], [[7, 8]]]], "v": [[[[0.5, -1]], [[2, 0]]]]})"),
      "s.json");
  EXPECT_EQ(s.inputs.kind, kvcheck::InputSource::Kind::inline_arrays);
  EXPECT_EQ(s.inputs.k, (std::vector<float>{5, 6, 7, 8}));
  EXPECT_EQ(s.inputs.v, (std::vector<float>{0.5f, -1, 2, 0}));
  EXPECT_EQ(error_of(scenario(
                dims, R"({"type": "full"})", steps,
                R"(, "inputs": {"q": [[[[1, 2]], [[3, 4]]]], "k": [[[[5, 6]], [[7]]]], "v": [[[[0, 0]], [[0, 0]]]]})")),
            "s.json: /inputs/k/0/1/0: expected an array of 2 elements, got [7]");
  EXPECT_EQ(error_of(scenario(
                dims, R"({"type": "full"})", steps,
                R"(, "inputs": {"q": [[[[1, 2]]]], "k": [[[[5, 6]], [[7, 8]]]], "v": [[[[0, 0]], [[0, 0]]]]})")),
            "s.json: /inputs/q/0: expected an array of 2 elements, got [[[1,2]]]");
  EXPECT_EQ(
      error_of(scenario(
          dims, R"({"type": "full"})", steps,
          R"(, "inputs": {"q": [[[[1, 2]], [[3, 4]]]], "k": [[[[5, 6]], [[7, 1e39]]]], "v": [[[[0, 0]], [[0, 0]]]]})")),
      "s.json: /inputs/k/0/1/0/1: expected a finite float32 value, got 1e+39");
}

TEST(ScenarioValidation, DecodeExpandsIntoSingleTokenAppends) {
  const auto s =
      parse_scenario(scenario(R"({"layers": 1, "batch": 2, "heads": 1, "head_dim": 2})", R"({"type": "full"})",
                              R"([{"op": "append", "tokens": 3}, {"op": "decode", "steps": 4}])"),
                     "s.json");
  ASSERT_EQ(s.steps.size(), 5u);
  EXPECT_EQ(s.steps[4].tokens, (std::vector<std::int64_t>{1, 1}));
  EXPECT_EQ(s.steps[4].source_index, 1);
  EXPECT_EQ(kvcheck::count_uids(s), 2 * 3 + 2 * 4);
}

namespace {
std::string with_extra(const std::string& extra) {
  return scenario(R"({"layers": 1, "batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 8})",
                  R"({"type": "sink", "sinks": 2, "window": 8})", R"([{"op": "append", "tokens": 5}])", extra);
}
std::string with_rope(const std::string& rope) { return with_extra(R"(, "rope": )" + rope); }
std::string with_attention(const std::string& attention) { return with_extra(R"(, "attention": )" + attention); }
}  // namespace

TEST(ScenarioValidation, RopeScalingPastedFromAConfigJson) {
  // Llama 3.1 8B's rope_scaling exactly as its config.json writes it.
  const auto llama = parse_scenario(
      with_rope(R"({"theta": 500000, "scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}})"),
      "s.json");
  EXPECT_EQ(llama.rope(0).scaling, kvcheck::RopeScaling::llama3);
  EXPECT_EQ(llama.rope(0).factor, 8.0);
  EXPECT_EQ(llama.rope(0).original_max_position_embeddings, 8192.0);
  // Qwen 2.5's older spelling ("type"); the attention factor defaults to 0.1 ln f + 1.
  const auto qwen = parse_scenario(
      with_rope(R"({"scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}})"),
      "s.json");
  EXPECT_EQ(qwen.rope(0).scaling, kvcheck::RopeScaling::yarn);
  EXPECT_DOUBLE_EQ(qwen.rope(0).attention_factor, 0.1 * std::log(4.0) + 1.0);
  EXPECT_EQ(qwen.rope(0).beta_fast, 32.0);
  EXPECT_EQ(qwen.rope(0).beta_slow, 1.0);
}

TEST(ScenarioValidation, RopeVariantErrorsNameTheFieldAndWhatWasExpected) {
  EXPECT_EQ(error_of(with_rope(R"({"scaling": {"rope_type": "dynamic", "factor": 2}})")),
            "s.json: /rope/scaling/rope_type: expected one of default, linear, llama3, yarn, got \"dynamic\"");
  EXPECT_EQ(error_of(with_rope(R"({"scaling": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4,
                                  "original_max_position_embeddings": 8192}})")),
            "s.json: /rope/scaling/low_freq_factor: missing required field");
  EXPECT_EQ(error_of(with_rope(R"({"scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                                  "high_freq_factor": 1, "original_max_position_embeddings": 8192}})")),
            "s.json: /rope/scaling/high_freq_factor: expected high_freq_factor > low_freq_factor (4), got 1");
  EXPECT_EQ(error_of(with_rope(R"({"scaling": {"rope_type": "yarn", "factor": 4}})")),
            "s.json: /rope/scaling/original_max_position_embeddings: missing required field (a config.json without "
            "it uses the model's max_position_embeddings: copy that value here)");
  EXPECT_EQ(error_of(with_rope(R"({"scaling": {"rope_type": "yarn", "factor": 32,
                                  "original_max_position_embeddings": 4096, "truncate": false}})")),
            "s.json: /rope/scaling/truncate: only \"truncate\": true is supported (SPEC 7 rounds the correction range "
            "to whole dims)");
  EXPECT_EQ(error_of(with_rope(R"({"scaling": {"rope_type": "linear", "factor": 2, "beta_fast": 32}})")),
            "s.json: /rope/scaling/beta_fast: \"beta_fast\" belongs to llama3 or yarn scaling, not linear");
  EXPECT_EQ(error_of(with_rope(R"({"factor": 2, "scaling": {"rope_type": "linear", "factor": 2}})")),
            "s.json: /rope/factor: give the factor inside \"scaling\" when scaling is an object");
  EXPECT_EQ(error_of(with_rope(R"({"rotary_dim": 5})")),
            "s.json: /rope/rotary_dim: expected an even rotary_dim, got 5");
  EXPECT_EQ(error_of(with_rope(R"({"rotary_dim": 16})")), "s.json: /rope/rotary_dim: expected an integer <= 8, got 16");
}

TEST(ScenarioValidation, LearnedSinkLogitsOnePerQueryHeadOrPerLayer) {
  const auto one = parse_scenario(with_attention(R"({"sink_logits": [0.5, 1, -2, 3]})"), "s.json");
  ASSERT_EQ(one.attention.sink_logits.size(), 1u);  // one layer
  EXPECT_EQ(one.attention.sink_logits[0][3], 3.0);
  EXPECT_EQ(error_of(with_attention(R"({"sink_logits": [0.5, 1]})")),
            "s.json: /attention/sink_logits: expected a list of 4 numbers (one per query head), got [0.5,1]");
  EXPECT_EQ(error_of(with_attention(R"({"sink_logits": [[0.5, 1, 2, 3], [1, 2, 3, 4]]})")),
            "s.json: /attention/sink_logits: expected one list per layer (1), got 2");
  EXPECT_EQ(error_of(with_attention(R"({"sink_logits": [0.5, "1", 2, 3]})")),
            "s.json: /attention/sink_logits/1: expected a finite number, got \"1\"");
  EXPECT_EQ(error_of(with_attention(R"({"sinks": [1, 2, 3, 4]})")),
            "s.json: /attention/sinks: unknown key \"sinks\" (expected one of: sink_logits, query_temperature)");
}

TEST(ScenarioValidation, PastedConfigVariants) {
  // "rope_scaling": null, as Qwen 2.5 and Mistral write it.
  EXPECT_EQ(parse_scenario(with_rope(R"({"scaling": null})"), "s.json").rope(0).scaling, kvcheck::RopeScaling::none);
  // Phi's partial_rotary_factor: R = int(head_dim * factor).
  EXPECT_EQ(parse_scenario(with_rope(R"({"partial_rotary_factor": 0.5})"), "s.json").rope(0).rotary_dim, 4);
  EXPECT_EQ(error_of(with_rope(R"({"partial_rotary_factor": 0.2})")),
            "s.json: /rope/partial_rotary_factor: expected a factor in (0, 1] giving an even rotary_dim of at least 2, "
            "got 0.2 (head_dim 8 x 0.2 = 1)");
  // Another type is named as such, not by its first unknown key.
  EXPECT_EQ(error_of(with_rope(R"({"scaling": {"rope_type": "longrope", "long_factor": [1, 2]}})")),
            "s.json: /rope/scaling/rope_type: expected one of default, linear, llama3, yarn, got \"longrope\"");
  EXPECT_EQ(error_of(with_rope(R"({"theta": 1, "scaling": {"rope_type": "yarn", "factor": 4,
                                  "original_max_position_embeddings": 64}})")),
            "s.json: /rope/theta: yarn needs theta > 1 (it divides by ln theta), got 1");
  EXPECT_EQ(error_of(with_extra(R"(, "kv_dtype": "fp8")")),
            "s.json: /kv_dtype: expected one of float32, float16, bfloat16, got \"fp8\"");
}

TEST(ScenarioValidation, OnePolicyPerLayer) {
  const std::string two_layers = R"({"layers": 2, "batch": 1, "heads": 2, "head_dim": 8})";
  const auto s = parse_scenario(scenario(two_layers, R"([{"type": "sliding", "window": 4}, {"type": "full"}])",
                                         R"([{"op": "append", "tokens": 3}])"),
                                "s.json");
  EXPECT_TRUE(s.hybrid());
  ASSERT_EQ(s.policies.size(), 2u);
  EXPECT_EQ(s.policies[1].kind, kvcheck::PolicyKind::full);
  EXPECT_EQ(s.policy(0).kind, kvcheck::PolicyKind::sliding);
  EXPECT_FALSE(
      parse_scenario(scenario(two_layers, R"({"type": "full"})", R"([{"op": "append", "tokens": 3}])"), "s.json")
          .hybrid());
  EXPECT_EQ(error_of(scenario(two_layers, R"([{"type": "full"}])", R"([{"op": "append", "tokens": 3}])")),
            "s.json: /policy: expected one policy per layer (2), got 1");
  EXPECT_EQ(error_of(scenario(two_layers, R"([{"type": "full"}, {"type": "sliding", "widow": 4}])",
                              R"([{"op": "append", "tokens": 3}])")),
            "s.json: /policy/1/widow: unknown key \"widow\" (expected one of: type, window, shift_with)");
}

TEST(ScenarioCost, EachLayerOfAHybridIsChargedItsOwnPolicy) {
  // Hand count, a 10-token prompt, 2 heads, D 4: a sliding W 4 layer's tokens see 1, 2, 3, 4,
  // 4, 4, 4, 4, 4, 4 keys (34), a full layer's 1..10 (55): (34 + 55) x 2 heads x 4 x 2 =
  // 1424 multiply-adds. Charging both layers the full layer's 55 would be 1760.
  const std::string two_layers = R"({"layers": 2, "batch": 1, "heads": 2, "head_dim": 4})";
  const auto hybrid = parse_scenario(scenario(two_layers, R"([{"type": "sliding", "window": 4}, {"type": "full"}])",
                                              R"([{"op": "append", "tokens": 10}])"),
                                     "s.json");
  EXPECT_EQ(kvcheck::estimate_cost(hybrid).multiply_adds, 1424);
  // One policy for both layers: 2 x 55 and 2 x 34 keys.
  const auto full = parse_scenario(scenario(two_layers, R"({"type": "full"})", R"([{"op": "append", "tokens": 10}])"),
                                   "s.json");
  EXPECT_EQ(kvcheck::estimate_cost(full).multiply_adds, 1760);
  const auto sliding = parse_scenario(
      scenario(two_layers, R"({"type": "sliding", "window": 4})", R"([{"op": "append", "tokens": 10}])"), "s.json");
  EXPECT_EQ(kvcheck::estimate_cost(sliding).multiply_adds, 1088);
}

TEST(ScenarioCost, AQuantizedChunkedLayerStoresNoMoreThanTheChunkItCounts) {
  // estimate_cost counts a chunked layer's stored tokens as its last C (visible_keys): what
  // it retains and the tail of its ring (SPEC 10.2) must fit in that, at every step.
  const std::string text = scenario(R"({"layers": 1, "batch": 2, "heads": 2, "kv_heads": 1, "head_dim": 4})",
                                    R"({"type": "chunked", "chunk": 4})",
                                    R"([{"op": "append", "tokens": [10, 7]}, {"op": "decode", "steps": 6},
                                        {"op": "append", "tokens": 3}])",
                                    R"(, "seed": 5, "kv_quant": {"k": {"format": "int8", "scale": {"granularity": "token"}},
                                        "v": {"format": "int8", "scale": {"granularity": "token"}}})");
  const kvcheck::Scenario s = parse_scenario(text, "c.json");
  const kvcheck::ReferenceRun run = kvcheck::run_reference(s, kvcheck::load_inputs(s));
  std::size_t rings = 0;
  for (const kvcheck::StepRecord& rec : run.steps)
    for (std::size_t row = 0; row < rec.rows(); ++row) {
      ASSERT_FALSE(rec.stored.empty());
      const std::size_t retained = rec.stored[0][row].size();
      const std::size_t ring = rec.stored_ring.empty() ? 0 : rec.stored_ring[0][row].size();
      EXPECT_EQ(retained, rec.retained_in(0, row).keys.size());
      EXPECT_LE(retained + ring, 4u) << "row " << row;
      rings += ring;
    }
  EXPECT_GT(rings, 0u);  // the ring did hold a tail
}

TEST(ScenarioValidation, Float16StorageRefusesInputsBeyondItsRange) {
  // One layer, 2 uids, 1 head, D 2: the key of uid 1 is (70000, 0), past float16's 65504.
  const std::string text = R"({"name": "t", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "head_dim": 2},
    "policy": {"type": "full"}, "kv_dtype": "float16",
    "inputs": {"q": [[[[1, 0]], [[1, 0]]]], "k": [[[[1, 0]], [[70000, 0]]]], "v": [[[[1, 0]], [[1, 0]]]]},
    "steps": [{"op": "append", "tokens": 2}]})";
  const kvcheck::Scenario s = parse_scenario(text, "s.json");
  try {
    kvcheck::load_inputs(s);
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()),
              "s.json: /kv_dtype: float16 holds magnitudes up to 65504, but layer 0 uid 1 kv head 0 reaches 70000 (a "
              "rotated key element or a value); use bfloat16 or float32");
  }
  // bfloat16 holds it.
  kvcheck::Scenario b = s;
  b.kv_dtype = kvcheck::KvDtype::bfloat16;
  EXPECT_NO_THROW(kvcheck::load_inputs(b));
}
