// A scenario too large to run whole runs in groups of layers (layer_groups.h): each group is
// that slice of the whole, bit for bit, and a bug is still caught and named at its layer.
#include <gtest/gtest.h>

#include <cmath>

#include "tools/catalog/catalog.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/scenario/layer_groups.h"
#include "tools/harness/sources/runner.h"

using namespace kvcheck;

namespace {

// gemma3_sliding_full_two_bases without its crop (a crop's refusal is every layer's).
const char* kGemma3 = R"({"name": "g3", "dimensions": {"layers": 6, "batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 16},
  "rope": [{"theta": 10000}, {"theta": 10000}, {"theta": 10000}, {"theta": 10000}, {"theta": 10000},
           {"theta": 1000000, "scaling": "linear", "factor": 8}],
  "policy": [{"type": "sliding", "window": 8}, {"type": "sliding", "window": 8}, {"type": "sliding", "window": 8},
             {"type": "sliding", "window": 8}, {"type": "sliding", "window": 8}, {"type": "full"}],
  "seed": 415,
  "steps": [{"op": "append", "tokens": [13, 9]}, {"op": "decode", "steps": 6}, {"op": "append", "tokens": 3},
            {"op": "decode", "steps": 2}]})";

bool same(const std::vector<double>& whole, std::size_t from, const std::vector<double>& part) {
  if (from + part.size() > whole.size()) return false;
  for (std::size_t i = 0; i < part.size(); ++i) {
    const double a = whole[from + i], b = part[i];
    if (!(a == b || (std::isnan(a) && std::isnan(b)))) return false;
  }
  return true;
}

// The scenario as Gemma 3 27B's config has it: 62 layers, five sliding (W 1024, theta 1e4)
// to one full (theta 1e6, linear 8), H 32, Hkv 16, D 128, an 8k prompt and 32 decodes.
std::string gemma3_27b(const std::string& extra_step = "") {
  std::string ropes, policies;
  for (int l = 0; l < 62; ++l) {
    const bool full = l % 6 == 5;
    ropes += std::string(l ? ", " : "") +
             (full ? R"({"theta": 1000000, "scaling": "linear", "factor": 8})" : R"({"theta": 10000})");
    policies += std::string(l ? ", " : "") + (full ? R"({"type": "full"})" : R"({"type": "sliding", "window": 1024})");
  }
  return R"({"name": "g27", "dimensions": {"layers": 62, "batch": 1, "heads": 32, "kv_heads": 16, "head_dim": 128},
    "rope": [)" + ropes + R"(], "policy": [)" + policies + R"(], "seed": 27,
    "steps": [{"op": "append", "tokens": 8192}, {"op": "decode", "steps": 32})" + extra_step + "]}";
}

}  // namespace

TEST(LayerGroups, AGroupIsThatSliceOfTheWholeBitForBit) {
  const Scenario s = parse_scenario(kGemma3, "g3.json");
  const InputTable inputs = load_inputs(s);
  const ReferenceRun whole = run_reference(s, inputs);
  for (const auto& [first, count] : std::vector<std::pair<int, int>>{{0, 1}, {2, 3}, {3, 3}, {5, 1}}) {
    const Scenario g = layer_group(s, first, count);
    EXPECT_EQ(g.name, "g3 [layers " + std::to_string(first) + "-" + std::to_string(first + count - 1) + "]");
    ASSERT_EQ(g.dims.layers, count);
    for (int i = 0; i < count; ++i) {
      EXPECT_EQ(g.policy(i), s.policy(first + i));
      EXPECT_EQ(g.rope(i), s.rope(first + i));
    }
    const InputTable part = load_inputs(g);
    const std::size_t q_layer = inputs.q.size() / 6, kv_layer = inputs.k.size() / 6;
    const auto at = [&](const std::vector<float>& table, std::size_t per_layer) {
      return table.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(first) * per_layer);
    };
    EXPECT_TRUE(std::equal(part.q.begin(), part.q.end(), at(inputs.q, q_layer)));
    EXPECT_TRUE(std::equal(part.k.begin(), part.k.end(), at(inputs.k, kv_layer)));
    EXPECT_TRUE(std::equal(part.v.begin(), part.v.end(), at(inputs.v, kv_layer)));
    const ReferenceRun run = run_reference(g, part);
    ASSERT_EQ(run.steps.size(), whole.steps.size());
    for (std::size_t i = 0; i < run.steps.size(); ++i) {
      if (!whole.steps[i].append) continue;
      const std::vector<double>& out = whole.steps[i].append->out;  // [L, B, n, H, D]
      EXPECT_TRUE(same(out, out.size() / 6 * static_cast<std::size_t>(first), run.steps[i].append->out))
          << "step " << i << ", layers from " << first;
    }
  }
}

TEST(LayerGroups, GroupsAreWholePeriodsOfTheLayerPattern) {
  const Scenario g27 = parse_scenario(gemma3_27b(), "g27.json");  // accepted: it runs in groups
  EXPECT_EQ(layer_period(g27), 6);
  EXPECT_EQ(layer_period(parse_scenario(kGemma3, "g3.json")), 6);
  // Memory no object, the 1e9 input values bind: 8,224 uids x (32 + 2 x 16) heads x 128 is
  // 6.74e7 values a layer, so 14 layers fit (9.4e8) and 15 do not; 14 rounds down to 12.
  EXPECT_EQ(layer_group_size(g27, 1e13), 12);
  // Within kvcheck's 8 GB: a full layer alone, by hand, keeps its inputs twice (2 x 8,224 x
  // 64 x 128 x 4 B = 539 MB) and the prompt's step: outputs 8,192 x 32 x 128 x 8 B = 268 MB
  // and half again in float, and 8,192 x 8,193 / 2 = 3.36e7 visible keys at 16 + 90 B
  // (3.56 GB): 4.50 GB, over half the budget, so the layers go one at a time.
  EXPECT_NEAR(estimate_layers_cost(g27, 5, 1).bytes, 4.50e9, 0.01e9);
  EXPECT_EQ(layer_group_size(g27, kMemoryBudget), 1);
  // Half the budget exactly one period's estimate: groups of six (seven layers from 0 hold
  // one more sliding layer, so they do not fit).
  EXPECT_EQ(layer_group_size(g27, 2 * estimate_layers_cost(g27, 0, 6).bytes), 6);
  // Commands that need the whole table refuse it before allocating 16.7 GB (8,224 uids x 62
  // layers x 64 heads x 128 = 4.18e9 values).
  try {
    load_inputs(g27);
    ADD_FAILURE() << "load_inputs took a 4.18e9-value scenario";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("g27.json: /steps: the scenario needs 4.18e+09 input values"), std::string::npos)
        << e.what();
  }
}

TEST(LayerGroups, AScenarioWhoseLayersCannotRunApartIsRefusedByTheParser) {
  try {
    parse_scenario(gemma3_27b(R"(, {"op": "crop", "length": 100})"), "g27.json");
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()),
              "g27.json: /steps: the scenario needs 4.18e+09 input values; kvcheck accepts up to 1e9 (its layers "
              "cannot run in groups: step 2 crops, and a crop's refusal is every layer's together)");
  }
}

TEST(LayerGroups, LayerNumbersInAGroupsReportAreTheWholeScenarios) {
  EXPECT_EQ(renumber_layers("step 3, row 0, layer 2: layer 0's key; 5 layers", 6),
            "step 3, row 0, layer 8: layer 6's key; 5 layers");
  EXPECT_EQ(renumber_layers("layer 11", 0), "layer 11");
  EXPECT_EQ(renumber_layers("no layer here, layer", 6), "no layer here, layer");
}

TEST(LayerGroups, RunInGroupsEveryGroupPassesAndAPlantedBugIsNamedAtItsLayer) {
  const Scenario s = parse_scenario(kGemma3, "g3.json");
  // Groups of 3 (layers 3-5: two sliding and the full one) and of 4 (4-5).
  for (const int size : {3, 4}) {
    RunOptions options;
    options.layers_per_group = size;
    options.caches = {find_cache("hybrid")};
    const std::vector<Outcome> good = run_scenario(s, options);
    int covered = 0;
    for (const Outcome& o : good) {
      EXPECT_TRUE(o.passed()) << o.scenario << " " << o.target;
      if (o.target == "reference") {
        const int last = std::min(covered + size, 6) - 1;
        EXPECT_EQ(o.scenario, "g3 [layers " + std::to_string(covered) + "-" + std::to_string(last) + "]");
        covered = std::min(covered + size, 6);
      }
    }
    EXPECT_EQ(covered, 6);
    // One rope for every layer, the group's last: the group holding the full layer 5 rotates
    // its sliding layers with the full layer's rope, first of them its own first layer; the
    // groups of sliding layers alone share one rope, and the mutant does not serve them.
    options.caches = {find_cache("zoo/one_rope_for_every_layer")};
    options.reference_checks = false;
    const int last_group = 5 / size * size;
    const std::string where = "layer " + std::to_string(last_group) + ",";
    bool named = false;
    for (const Outcome& o : run_scenario(s, options)) {
      if (o.passed()) continue;
      ASSERT_TRUE(o.first_divergence.has_value()) << o.scenario;
      EXPECT_EQ(o.first_divergence->layer, last_group);
      EXPECT_NE(o.first_divergence->where.find(where), std::string::npos) << o.first_divergence->where;
      EXPECT_EQ(o.first_divergence->class_name, "layer rotated with another layer's rope");
      named = true;
    }
    EXPECT_TRUE(named) << size;
  }
}
