// Every optimized cache against the reference: every fixture it serves, then 200
// generated scenarios. A failure prints the scenario so it can be saved as a fixture.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "optimized/rope_table.h"
#include "tests/random_scenario.h"
#include "tools/catalog/catalog.h"
#include "tools/harness/sources/in_process_source.h"
#include "tools/harness/scenario/inputs.h"

using namespace kvcheck;

namespace {

std::string describe_failures(const std::vector<Outcome>& outcomes) {
  std::string text;
  for (const Outcome& o : outcomes)
    if (const Check* c = o.first_failure()) text += o.target + ": " + c->name + ": " + c->detail + "\n";
  return text;
}

// Runs every real cache that serves the scenario's policy; returns their outcomes.
std::vector<Outcome> run_caches(const Scenario& s, const std::string& only = "") {
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  std::vector<Outcome> outcomes;
  for (const CacheEntry& cache : real_caches())
    if (cache.serves(s) && (only.empty() || cache.name == only))
      outcomes.push_back(check_cache(s, inputs, run, cache));
  return outcomes;
}

struct FixtureCase {
  std::string file, cache;
};

std::vector<FixtureCase> fixture_cases() {
  std::vector<FixtureCase> cases;
  for (const std::string& file : scenario_files(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios")) {
    const Scenario s = load_scenario(file);
    for (const CacheEntry& cache : real_caches())
      if (cache.serves(s)) cases.push_back({file, cache.name});
  }
  return cases;
}

class FixtureOnCache : public ::testing::TestWithParam<FixtureCase> {};

TEST_P(FixtureOnCache, MatchesTheReference) {
  const Scenario s = load_scenario(GetParam().file);
  const std::vector<Outcome> outcomes = run_caches(s, GetParam().cache);
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_TRUE(outcomes[0].passed()) << describe_failures(outcomes);
  EXPECT_EQ(outcomes[0].position_mismatches, 0);
  EXPECT_EQ(outcomes[0].retained_mismatches, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureOnCache, ::testing::ValuesIn(fixture_cases()),
                         [](const ::testing::TestParamInfo<FixtureCase>& test) {
                           std::string stem = test.param.file.substr(test.param.file.find_last_of('/') + 1);
                           stem = stem.substr(0, stem.size() - 5);
                           return stem + "__" + test.param.cache;
                         });

class RandomScenario : public ::testing::TestWithParam<int> {};

TEST_P(RandomScenario, EveryCacheMatchesTheReference) {
  const std::string text = kvcheck::testing::random_scenario_json(static_cast<std::uint64_t>(GetParam()));
  const Scenario s = parse_scenario(text, "random.json");
  const std::vector<Outcome> outcomes = run_caches(s);
  ASSERT_FALSE(outcomes.empty());
  const bool all = std::all_of(outcomes.begin(), outcomes.end(), [](const Outcome& o) { return o.passed(); });
  EXPECT_TRUE(all) << describe_failures(outcomes) << "scenario (save as a fixture to replay):\n" << text;
}

INSTANTIATE_TEST_SUITE_P(Seeds, RandomScenario, ::testing::Range(0, 200));

TEST(StaticCache, RefusesToOverflowItsCapacity) {
  const Scenario s = parse_scenario(R"({"name": "x", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "head_dim": 2},
    "policy": {"type": "full"}, "steps": [{"op": "append", "tokens": 3}]})",
                                    "x.json");
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  auto cache = find_cache("static")->make(cache_config(s, 2));
  ChunkBuffers buffers = make_chunk(s, inputs, *run.steps[0].append, run.steps[0].step);
  std::vector<float> out(3 * 2);
  try {
    cache->append(buffers.chunk, {out.data()}, nullptr);
    FAIL() << "a static cache of 2 slots accepted 3 tokens";
  } catch (const optimized::CacheRefusal& e) {
    EXPECT_EQ(e.code, "capacity_exceeded");
    EXPECT_STREQ(e.what(), "static cache of 2 slots per row cannot hold 3 tokens");
  }
}

}  // namespace

TEST(Caches, ACacheThatThrowsIsAFailureAtThatStepNotBadInput) {
  // The cache under test raising is a finding about the cache (exit 1), reported at the
  // step it raised with its own words; an internal or input error it is not.
  struct Throwing : optimized::KvCache {
    explicit Throwing(const optimized::CacheConfig& c) : inner(find_cache("dynamic")->make(c)) {}
    void append(const optimized::Chunk& chunk, const std::vector<float*>& out, optimized::AttentionLog* log) override {
      if (++appends == 3) throw std::out_of_range("vector::_M_range_check: 7 >= 6");
      inner->append(chunk, out, log);
    }
    void reorder(const std::vector<int>& rows) override { inner->reorder(rows); }
    void reset(int batch) override { inner->reset(batch); }
    void crop(std::int64_t length) override { inner->crop(length); }
    const optimized::SlotStore& slots() const override { return inner->slots(); }
    std::int64_t row_length(int row) const override { return inner->row_length(row); }
    std::unique_ptr<optimized::KvCache> inner;
    int appends = 0;
  };
  CacheEntry entry{"throwing", "raises at its third append", [](const Scenario&) { return true; },
                   [](const optimized::CacheConfig& c) { return std::make_unique<Throwing>(c); }};
  const Scenario s = load_scenario(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios/full_baseline.json");
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const CacheTrace t = trace_cache(s, inputs, run, entry, false);
  EXPECT_FALSE(t.outcome.passed());
  ASSERT_TRUE(t.first.has_value());
  EXPECT_EQ(t.first->evidence.step, 2u);
  EXPECT_EQ(t.first->bug, BugClass::cache_raised);
  EXPECT_EQ(t.first->evidence.refusal, "the cache raised: vector::_M_range_check: 7 >= 6");
}

TEST(Caches, EachLayerKeysAreHeldToTheirOwnFormatsRounding) {
  // quant_mixed_layers_residual keeps layer 0 in float16 beside an int4 layer: a layer 0 key
  // rotated one position too far must fail the rotation check, which the int4 layer's
  // coarse step (about 0.13 of the largest element) would let through.
  struct OneOnInLayerZero : optimized::KvCache {
    explicit OneOnInLayerZero(const optimized::CacheConfig& c) : inner(find_cache("dynamic")->make(c)), rope(c.ropes.front()) {
      rope.cover(2);
    }
    void append(const optimized::Chunk& chunk, const std::vector<float*>& out, optimized::AttentionLog* log) override {
      inner->append(chunk, out, log);
      auto& store = const_cast<optimized::SlotStore&>(inner->slots());
      std::vector<float> x(static_cast<std::size_t>(store.head_dim()));
      for (int b = 0; b < store.batch(); ++b)
        for (std::int64_t slot = 0; slot < store.capacity(); ++slot) {
          if (store.meta(b, slot).uid < 0 || turned.count({b, store.meta(b, slot).uid})) continue;
          turned.insert({b, store.meta(b, slot).uid});
          for (int g = 0; g < store.kv_heads(); ++g) {
            store.read_key(0, b, g, slot, x.data());
            rope.rotate(x.data(), 1);  // rotations compose: now at its position + 1
            store.write_key(0, b, g, slot, x.data());
          }
        }
    }
    void reorder(const std::vector<int>& rows) override { inner->reorder(rows), turned.clear(); }
    void reset(int batch) override { inner->reset(batch), turned.clear(); }
    void crop(std::int64_t length) override { inner->crop(length); }
    const optimized::SlotStore& slots() const override { return inner->slots(); }
    std::int64_t row_length(int row) const override { return inner->row_length(row); }
    std::unique_ptr<optimized::KvCache> inner;
    optimized::RopeTable rope;
    std::set<std::pair<int, std::int64_t>> turned;
  };
  CacheEntry entry{"one_on_in_layer_zero", "rotates layer 0's keys one position too far",
                   [](const Scenario&) { return true; },
                   [](const optimized::CacheConfig& c) { return std::make_unique<OneOnInLayerZero>(c); }};
  const Scenario s =
      load_scenario(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios/quant_mixed_layers_residual.json");
  ASSERT_FALSE(s.quant(0).k.has_value());
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const CacheTrace t = trace_cache(s, inputs, run, entry, false);
  const auto rotation = std::find_if(t.outcome.checks.begin(), t.outcome.checks.end(),
                                     [](const auto& c) { return c.name == "rotation"; });
  ASSERT_NE(rotation, t.outcome.checks.end());
  EXPECT_FALSE(rotation->passed);
  // The first key already, recovered exactly (held to int4's step, only a few keys fail and
  // every position reads as ambiguous).
  EXPECT_NE(rotation->detail.find("layer 0 row 0 kv head 0 slot 0 (uid 0, token 0): the key is not its raw key "
                                  "rotated by its claimed position 0 (recovered: 1)"),
            std::string::npos)
      << rotation->detail;
  ASSERT_TRUE(t.first.has_value());
  ASSERT_FALSE(t.first->slots.empty());
  EXPECT_EQ(t.first->slots[0].position_recovered, "1");
}

// A cache of one policy takes the policy every layer shares and refuses a stack whose
// layers differ (only the hybrid and paged caches read each layer's), and a config that
// does not give one policy per layer.
TEST(Caches, ACacheOfOnePolicyRefusesLayersThatDiffer) {
  using optimized::LayerPolicy;
  optimized::CacheConfig c;
  c.layers = 2;
  c.policies = {{LayerPolicy::Kind::sink, 8, 2}, {LayerPolicy::Kind::full}};
  c.ropes.assign(2, optimized::RopeSpec{});
  c.paging = optimized::PagedLayout{4, 8, false};
  for (const char* name : {"sliding", "sink_shift", "sink_ring"})
    EXPECT_THROW(find_cache(name)->make(c), std::invalid_argument) << name;
  EXPECT_NO_THROW(find_cache("hybrid")->make(c));
  EXPECT_NO_THROW(find_cache("paged")->make(c));
  c.policies.pop_back();  // one policy for two layers
  EXPECT_THROW(find_cache("sink_shift")->make(c), std::invalid_argument);
  EXPECT_THROW(find_cache("paged")->make(c), std::invalid_argument);
  c.policies.push_back(c.policies.front());
  EXPECT_NO_THROW(find_cache("sink_shift")->make(c));
  // SPEC 10.1: one policy, two ropes. A cache with one cos/sin table refuses it; the
  // hybrid cache gives each layer its own.
  c.ropes[1].theta = 1e6;
  for (const char* name : {"sink_shift", "sink_ring", "paged"})
    EXPECT_THROW(find_cache(name)->make(c), std::invalid_argument) << name;
  EXPECT_NO_THROW(find_cache("hybrid")->make(c));
}
