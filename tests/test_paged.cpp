// SPEC 8: paging changes no output (every paged fixture against its unpaged twin), and the
// pool's and the reference's bookkeeping on hand-worked cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "optimized/block_pool.h"
#include "optimized/paged_cache.h"
#include "reference/prefix_reuse.h"
#include "tools/catalog/catalog.h"
#include "tools/harness/sources/in_process_source.h"
#include "tools/harness/sources/cache_entry.h"
#include "tools/harness/scenario/inputs.h"

using namespace kvcheck;

namespace {

// The scenario without paging: the same steps, less what only a paged cache can do
// (evict) or report (expect_hit).
Scenario unpaged_twin(Scenario s) {
  s.paging.reset();
  std::vector<Step> steps;
  for (Step step : s.steps) {
    if (step.op == StepOp::evict) continue;
    step.expect_hit.clear();
    steps.push_back(std::move(step));
  }
  s.steps = std::move(steps);
  return s;
}

std::vector<std::string> paged_fixtures() {
  std::vector<std::string> out;
  for (const std::string& file : scenario_files(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios"))
    if (load_scenario(file).paging) out.push_back(file);
  return out;
}

}  // namespace

TEST(Paged, EveryPagedFixtureHasTheOutputsOfItsUnpagedTwin) {
  const std::vector<std::string> fixtures = paged_fixtures();
  ASSERT_GE(fixtures.size(), 8u);
  for (const std::string& file : fixtures) {
    const Scenario paged = load_scenario(file);
    const Scenario twin = unpaged_twin(paged);
    const InputTable inputs = load_inputs(paged), twin_inputs = load_inputs(twin);
    ASSERT_EQ(inputs.k, twin_inputs.k) << file;
    const ReferenceRun a = run_reference(paged, inputs), b = run_reference(twin, twin_inputs);
    EXPECT_TRUE(a.problems.empty() && b.problems.empty()) << file;
    std::vector<const reference::AppendResult*> appends_a, appends_b;
    for (const StepRecord& r : a.steps)
      if (r.append) appends_a.push_back(&*r.append);
    for (const StepRecord& r : b.steps)
      if (r.append) appends_b.push_back(&*r.append);
    ASSERT_EQ(appends_a.size(), appends_b.size()) << file;
    for (std::size_t i = 0; i < appends_a.size(); ++i) {
      const auto& x = appends_a[i]->out;
      const auto& y = appends_b[i]->out;
      ASSERT_EQ(x.size(), y.size()) << file;
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(double)), 0) << file << " append " << i;
    }
    // Every cache that serves the twin passes it, and the paged cache passes the paged one.
    for (const CacheEntry& cache : real_caches()) {
      if (cache.serves(twin)) {
        EXPECT_TRUE(check_cache(twin, twin_inputs, b, cache).passed()) << file << " " << cache.name;
      }
      if (cache.name == "paged") {
        EXPECT_TRUE(check_cache(paged, inputs, a, cache).passed()) << file;
        // SPEC 8.8.5: a correct cache reads no slot before its write or after its free.
        EXPECT_TRUE(check_cache(paged, inputs, a, with_poisoned_blocks(cache)).passed()) << file << " poisoned";
      }
    }
  }
}

TEST(Paged, PoolEvictsLeastRecentlyReleasedFirstAndForgetsItsKey) {
  optimized::BlockPool pool(3, true);
  const auto a = *pool.allocate(), b = *pool.allocate(), c = *pool.allocate();
  EXPECT_EQ(a, 0);  // the lowest free id first
  EXPECT_FALSE(pool.allocate().has_value());
  pool.register_full(a, 100);
  pool.register_full(b, 200);
  pool.release(b);  // cached first
  pool.release(a);
  pool.release(c);  // not registered: free at once
  EXPECT_EQ(pool.free_count(), 1);
  EXPECT_EQ(*pool.lookup(200), b);
  EXPECT_EQ(*pool.allocate(), c);  // a free block before any cached one
  EXPECT_EQ(*pool.allocate(), b);  // then the least recently released cached block ...
  EXPECT_FALSE(pool.lookup(200).has_value());  // ... which leaves the index
  EXPECT_EQ(*pool.lookup(100), a);
  pool.retain(a);  // a hit takes it back from the cached list
  EXPECT_EQ(pool.refcount(a), 1);
  EXPECT_FALSE(pool.allocate().has_value());
  pool.release(a);
  pool.evict(-1);
  EXPECT_FALSE(pool.lookup(100).has_value());
  EXPECT_EQ(pool.free_count(), 1);
}

TEST(Paged, LargestHitIsWholeEarlierBlocksBelowTheLastToken) {
  reference::PrefixBlocks blocks(4, false);
  const std::vector<std::uint64_t> row = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // context keys of 10 tokens
  blocks.written(row, 0);
  // Blocks written in this step are not hittable yet.
  EXPECT_EQ(blocks.largest_hit(row), 0);
  blocks.end_step();
  EXPECT_EQ(blocks.largest_hit(row), 8);  // two full blocks; the third is partial
  EXPECT_EQ(blocks.largest_hit({1, 2, 3, 4, 5, 6, 7, 8}), 4);  // capped at floor(7 / 4) * 4
  EXPECT_EQ(blocks.largest_hit({1, 2, 3, 4, 5, 6, 7, 99, 9}), 4);  // block 1 ends in another key
  EXPECT_EQ(blocks.largest_hit({0, 2, 3, 4, 5}), 4);  // a block is named by its last key alone
  blocks.keep_only({{1, 2, 3, 4}});
  EXPECT_EQ(blocks.largest_hit(row), 4);
}

TEST(Paged, UnderTokenReuseTheLargestHitIsEveryEarlierTokenBelowTheLast) {
  reference::PrefixBlocks tokens(4, true);
  const std::vector<std::uint64_t> row = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  tokens.written(row, 0);
  EXPECT_EQ(tokens.largest_hit(row), 0);  // not before the step ends
  tokens.end_step();
  EXPECT_EQ(tokens.largest_hit(row), 9);  // capped at n - 1: the last token is computed
  EXPECT_EQ(tokens.largest_hit({1, 2, 3, 4, 5, 6, 99, 8}), 6);  // up to the first other key, mid-block
  EXPECT_EQ(tokens.largest_hit({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), 10);  // all written ones
  tokens.keep_only({{1, 2, 3}});
  EXPECT_EQ(tokens.largest_hit(row), 3);
}

namespace {

std::string error_of(const std::string& steps) {
  const std::string text = R"({"name": "p", "dimensions": {"layers": 1, "batch": 2, "heads": 1, "kv_heads": 1,
    "head_dim": 2}, "policy": {"type": "full"}, "paging": {"block_size": 2, "num_blocks": 16}, "steps": )" +
                           steps + "}";
  try {
    parse_scenario(text, "p.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Paged, PreemptionIsValidatedWhereTheStepsSayIt) {
  EXPECT_EQ(error_of(R"([{"op": "append", "tokens": 2}, {"op": "resume", "rows": [1]}])"),
            "p.json: /steps/1/rows/0: row 1 is not preempted: resume follows preempt");
  EXPECT_EQ(error_of(R"([{"op": "append", "tokens": [2, 0]}, {"op": "preempt", "rows": [1], "mode": "swap"}])"),
            "p.json: /steps/1/rows/0: row 1 holds no token: there is nothing to preempt");
  EXPECT_EQ(error_of(R"([{"op": "append", "tokens": 2}, {"op": "preempt", "rows": [0], "mode": "swap"},
                         {"op": "decode", "steps": 1}])"),
            "p.json: /steps/2: row 0 is preempted (at /steps/1): decode appends a token to every row; give per-row "
            "counts with append until it resumes");
  EXPECT_EQ(error_of(R"([{"op": "append", "tokens": 2}, {"op": "preempt", "rows": [0], "mode": "recompute"},
                         {"op": "append", "tokens": [1, 1]}])"),
            "p.json: /steps/2/tokens/0: row 0 is preempted (at /steps/1): it takes no tokens until it resumes");
  EXPECT_EQ(error_of(R"([{"op": "append", "tokens": 2}, {"op": "preempt", "rows": [0], "mode": "later"}])"),
            "p.json: /steps/1/mode: expected one of swap, recompute, got \"later\"");
  EXPECT_EQ(error_of(R"([{"op": "append", "tokens": 2}, {"op": "preempt", "rows": [0], "mode": "swap"},
                         {"op": "free", "rows": [0]}, {"op": "append", "tokens": [3, 1]}])"),
            "");  // a preempted row may end, and start again
}

TEST(Paged, ThePoolCountsTheBlocksOfRowsThatDoNotAppend) {
  // Row 0 keeps its 4 blocks of 2 while row 1 takes a fifth.
  const std::string text = R"({"name": "p", "dimensions": {"layers": 1, "batch": 2, "heads": 1, "kv_heads": 1,
    "head_dim": 2}, "policy": {"type": "full"}, "paging": {"block_size": 2, "num_blocks": 4},
    "steps": [{"op": "append", "tokens": [8, 0]}, {"op": "append", "tokens": [0, 2]}]})";
  try {
    parse_scenario(text, "p.json");
    ADD_FAILURE() << "a pool of 4 blocks accepted for 5";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).substr(0, 79),
              "p.json: /paging/num_blocks: the pool holds 4 blocks, but /steps/1 needs up to 5");
  }
}

TEST(Paged, ASinkLayerNeedsItsSinkBlocksAndItsWindowsBlocks) {
  // S = 3, W = 11, evict 2, blocks of 4. 18 tokens take blocks 0-4. Then 10 more: the
  // 18-token row keeps its sinks (block 0) and the window of token 17, tokens 3 + E(17) =
  // 11 on (block 2 on), and grows to 28 tokens (blocks up to 6): 1 + 5 = 6 blocks, where
  // a full layer would hold 7.
  const std::string text = R"({"name": "p", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "kv_heads": 1,
    "head_dim": 2}, "policy": {"type": "sink", "sinks": 3, "window": 11, "evict": 2}, "paging": {"block_size": 4,
    "num_blocks": 6}, "steps": [{"op": "append", "tokens": 18}, {"op": "append", "tokens": 10}]})";
  const PoolNeed need = largest_pool_need(parse_scenario(text, "p.json"), 4);
  EXPECT_EQ(need.blocks, 6);
  EXPECT_EQ(need.source_index, 1);
}

TEST(Paged, ASinkLayerFreesTheBlocksBetweenItsSinksAndItsWindow) {
  // S = 3, W = 11, evict 2, blocks of 4: paged_sink_fork_prefix_hit's policy and pool.
  optimized::CacheConfig c;
  c.head_dim = 4;
  optimized::RopeSpec spec;
  spec.head_dim = 4;
  c.ropes.assign(static_cast<std::size_t>(c.layers), spec);
  optimized::set_every_layer(c, {optimized::LayerPolicy::Kind::sink, 11, 3, 2});
  c.paging = optimized::PagedLayout{4, 16, false};
  optimized::PagedCache cache(c);
  std::int64_t uid = 0;
  const auto append = [&](std::int64_t n) {
    std::vector<float> q(static_cast<std::size_t>(n) * 4, 0.25f), k = q, v = q;
    optimized::Chunk chunk;
    chunk.length = n;
    chunk.counts = {n};
    for (std::int64_t i = 0; i < n; ++i) chunk.uids.push_back(uid++);
    chunk.q = {q.data()};
    chunk.k = {k.data()};
    chunk.v = {v.data()};
    cache.append(chunk, {}, nullptr);
  };
  const auto nulls = [&] {
    std::vector<bool> out;
    for (std::int64_t block : cache.paged()->layers[0].tables[0]) out.push_back(block < 0);
    return out;
  };
  // 18 tokens: E(17) = 8 evicts tokens 3 to 10. Block 1 (tokens 4-7) holds only evicted
  // ones; block 0 keeps the sinks (and evicted token 3), block 2 token 11 of the window.
  append(18);
  EXPECT_EQ(nulls(), (std::vector<bool>{false, true, false, false, false}));
  // 23 tokens: E(22) = 12 evicts tokens 3 to 14: block 2 (8-11) goes, block 3 keeps 15.
  for (int i = 0; i < 5; ++i) append(1);
  EXPECT_EQ(nulls(), (std::vector<bool>{false, true, true, false, false, false}));
  // A crop back to 22 tokens keeps the window of token 21 (E(21) = 12): accepted. A crop
  // to 20 needs token 3 + E(19) = 13, evicted: refused.
  EXPECT_NO_THROW(cache.check_crop(22));
  EXPECT_THROW(cache.check_crop(20), optimized::CacheRefusal);
}

// Corners where a correct paged cache must pass (each once failed or could have).
TEST(Paged, ACorrectCacheServesTheCorners) {
  const auto scenario = [](const std::string& policy, const std::string& paging, const std::string& steps) {
    return parse_scenario(R"({"name": "p", "seed": 5, "dimensions": {"layers": 2, "batch": 2, "heads": 2,
      "kv_heads": 1, "head_dim": 4}, "policy": )" + policy + R"(, "paging": )" + paging + R"(, "steps": )" + steps + "}",
                          "p.json");
  };
  std::vector<Scenario> corners = {
      // Block size 1, window 4: a crop the policy accepts needs a token no later query sees.
      scenario(R"({"type": "sliding", "window": 4})", R"({"block_size": 1, "num_blocks": 16})",
               R"([{"op": "append", "tokens": 4}, {"op": "crop", "length": 3}, {"op": "decode", "steps": 3}])"),
      // A crop into a registered full block with no block to spare: it is unregistered, not copied.
      scenario(R"({"type": "full"})", R"({"block_size": 4, "num_blocks": 4, "prefix_cache": true})",
               R"([{"op": "append", "tokens": [8, 0]}, {"op": "crop", "length": 6}, {"op": "decode", "steps": 2}])"),
      // A recompute on a sliding layer rebuilds the whole history within the pool.
      scenario(R"({"type": "sliding", "window": 8})", R"({"block_size": 4, "num_blocks": 24})",
               R"([{"op": "append", "tokens": 8}, {"op": "decode", "steps": 12},
                   {"op": "preempt", "rows": [0, 1], "mode": "recompute"}, {"op": "resume", "rows": [0, 1]},
                   {"op": "decode", "steps": 2}])"),
      // A recompute on a sink layer under dense prefill: the history is rebuilt as one dense
      // append, and only then are the blocks between the sinks and the window freed again.
      scenario(R"({"type": "sink", "sinks": 2, "window": 7, "evict": 2, "prefill": "dense"})",
               R"({"block_size": 2, "num_blocks": 40})",
               R"([{"op": "append", "tokens": [12, 3]}, {"op": "decode", "steps": 5},
                   {"op": "preempt", "rows": [0], "mode": "recompute"}, {"op": "append", "tokens": [0, 1]},
                   {"op": "resume", "rows": [0]}, {"op": "decode", "steps": 3}])"),
  };
  // A sink layer beside a full one (blocks freed in one layer only), a fork, then a prefix
  // hit of 8 on blocks the sink layer freed from its window but the prefix index kept.
  corners.push_back(parse_scenario(R"({"name": "p", "seed": 5, "content": "prefix", "dimensions": {"layers": 2,
    "batch": 2, "heads": 2, "kv_heads": 1, "head_dim": 4}, "policy": [{"type": "sink", "sinks": 1, "window": 5},
    {"type": "full"}], "paging": {"block_size": 2, "num_blocks": 40, "prefix_cache": true}, "steps": [
    {"op": "append", "ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]}, {"op": "decode", "steps": 2},
    {"op": "reorder", "rows": [0, 0]}, {"op": "decode", "steps": 2}, {"op": "free", "rows": [1]},
    {"op": "append", "ids": [[], [1, 2, 3, 4, 5, 6, 7, 8, 9]], "expect_hit": [null, 8]},
    {"op": "decode", "steps": 2}]})",
                                   "p.json"));
  // Reuse "token" with every block of the pool cached: the partial hit's source (the second
  // block, least recently used once the first is hit) must not be the block taken to copy it
  // into; with no other block at all, the tokens are computed instead.
  const auto token_reuse = [](int blocks, const std::string& first_prompt, const std::string& expect) {
    return parse_scenario(R"({"name": "p", "seed": 5, "content": "prefix", "dimensions": {"layers": 2, "batch": 1,
      "heads": 2, "kv_heads": 1, "head_dim": 4}, "policy": {"type": "full"}, "paging": {"block_size": 4,
      "num_blocks": )" + std::to_string(blocks) + R"(, "prefix_cache": true, "reuse": "token"}, "steps": [
      {"op": "append", "ids": [)" + first_prompt + R"(]}, {"op": "free", "rows": [0]},
      {"op": "append", "ids": [[1, 2, 3, 4, 5, 6, 99]])" + expect + R"(}, {"op": "decode", "steps": 1}]})",
                          "p.json");
  };
  corners.push_back(token_reuse(3, "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]", R"(, "expect_hit": [6])"));
  corners.push_back(token_reuse(2, "[1, 2, 3, 4, 5, 6, 7, 8]", ""));
  const CacheEntry* paged = nullptr;
  for (const CacheEntry& c : real_caches())
    if (c.name == "paged") paged = &c;
  ASSERT_NE(paged, nullptr);
  for (const Scenario& s : corners) {
    const InputTable inputs = load_inputs(s);
    const ReferenceRun run = run_reference(s, inputs);
    for (const CacheEntry& cache : {*paged, with_poisoned_blocks(*paged)}) {
      const Outcome o = check_cache(s, inputs, run, cache);
      EXPECT_TRUE(o.passed()) << s.steps.size() << " steps: "
                              << (o.first_failure() ? o.first_failure()->detail : std::string());
    }
  }
}
