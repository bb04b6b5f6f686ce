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

// Per-layer sink logits (gpt-oss) and per-layer quantized storage follow their layers into a
// group: each layer alone gives the whole's outputs and stored values, bit for bit.
TEST(LayerGroups, PerLayerSinkLogitsAndQuantizedStorageGoWithTheirLayer) {
  for (const char* name : {"gpt_oss_hybrid_yarn_learned_sinks", "quant_fp8_per_layer_scales"}) {
    const Scenario s = load_scenario(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios/" + name + ".json");
    const ReferenceRun whole = run_reference(s, load_inputs(s));
    const int L = s.dims.layers;
    for (int layer = 1; layer < L; ++layer) {
      const Scenario g = layer_group(s, layer, 1);
      const ReferenceRun part = run_reference(g, load_inputs(g));
      ASSERT_EQ(part.steps.size(), whole.steps.size());
      for (std::size_t i = 0; i < part.steps.size(); ++i) {
        if (!whole.steps[i].append) continue;
        ASSERT_TRUE(part.steps[i].append);
        const reference::AppendResult &w = *whole.steps[i].append, &p = *part.steps[i].append;
        EXPECT_TRUE(same(w.out, w.out.size() / L * static_cast<std::size_t>(layer), p.out))
            << name << ", step " << i << ", layer " << layer;
        if (!w.out_stored.empty()) {
          EXPECT_TRUE(same(w.out_stored, w.out_stored.size() / L * static_cast<std::size_t>(layer), p.out_stored))
              << name << ", step " << i << ", layer " << layer;
        }
      }
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
  // A full layer alone, by hand: its inputs twice (2 x 8,224 uids x 64 heads x 128 x 4 B =
  // 539 MB) and their histories (8,224 x 16 B), the key memos of two reference models (2 x
  // 16 kv heads x 8,224 keys x (2 x 128 x 8 + 64) B = 556 MB), the prompt's step: outputs
  // (8,192 x 32 x 128 x 8 B = 268 MB) and 8,192 x 8,193 / 2 = 33,558,528 visible keys at
  // 16 B (537 MB), the retained set (48 x 8,192 + 24 B), and one cache under test: its log
  // of those keys at 90 B (3.02 GB), its float outputs (134 MB) and the prompt's keys and
  // values (8,192 x 16 x 128 x 2 x 4 B = 134 MB). 5,189,378,584 B, of which 3,288,702,976
  // the cache's.
  const ScenarioCost full = estimate_layers_cost(g27, 5, 1);
  EXPECT_EQ(full.bytes, 5189378584.0);
  EXPECT_EQ(full.cache_bytes, 3288702976.0);
  // Within kvcheck's 8 GB, with the caches that really serve each group: the full layer
  // alone, served by three caches (dynamic, static and paged), is 11.77 GB, over; three
  // layers fit (two sliding layers and the full one are the hybrid's alone), and four
  // sliding layers (sliding and paged) are over 85% of the budget.
  const CachesServing serving = [](const Scenario& s, int first, int count) {
    const Scenario group = layer_group(s, first, count);
    int n = 0;
    for (const CacheEntry& c : real_caches()) n += c.serves(group) ? 1 : 0;
    return n;
  };
  EXPECT_EQ(serving(g27, 5, 1), 3);
  EXPECT_EQ(serving(g27, 3, 3), 1);
  EXPECT_GT(full.bytes + 2 * full.cache_bytes, kMemoryBudget);
  EXPECT_EQ(layer_group_size(g27, kMemoryBudget, serving), 3);
  const ScenarioCost four = estimate_layers_cost(g27, 0, 4);
  EXPECT_GT(four.bytes + four.cache_bytes, 0.85 * kMemoryBudget);
  // Where the caches decide: at 8.77 GB, groups of four fit with one cache each (layers 4-7,
  // the largest, 7.44 GB) but layers 0-3 with their two do not (7.47 GB over 7.45 GB).
  EXPECT_EQ(layer_group_size(g27, 8.77e9), 4);
  EXPECT_EQ(layer_group_size(g27, 8.77e9, serving), 3);
  // With one cache, as the parser counts, a layer alone fits, and so any scenario whose
  // single layers do is accepted.
  EXPECT_LE(full.bytes, kMemoryBudget);
  // 85% of the budget exactly one period's estimate: groups of six (seven layers
  // from 0 hold one more sliding layer, so they do not fit).
  EXPECT_EQ(layer_group_size(g27, estimate_layers_cost(g27, 0, 6).bytes / 0.85 + 1), 6);
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
  // Lists after "layers" (quant_checks names a format's layers so), not after "layer".
  EXPECT_EQ(renumber_layers("q4 in layers 0, 1; q8 in layer 2, 64 heads; layers 0-2 of 3", 6),
            "q4 in layers 6, 7; q8 in layer 8, 64 heads; layers 6-8 of 3");
  EXPECT_EQ(renumber_layers("layer 99999999999999999999, layer 2147483647", 6),
            "layer 99999999999999999999, layer 2147483647");
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
