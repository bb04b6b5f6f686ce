// The optimized attention splits its work over threads by (query block, kv head); each
// task's arithmetic is the same whoever runs it, so outputs must be bit-identical for any
// thread count, on every cache, through a prefill longer than a query block and decode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "optimized/worker_pool.h"
#include "tools/catalog/catalog.h"

using namespace kvcheck;
using namespace kvcheck::optimized;

namespace {

// Groups of 3 query heads, and a head_dim with a remainder past whole vector registers.
constexpr int kLayers = 2, kBatch = 2, kHeads = 6, kKvHeads = 2, kDim = 40;

// Deterministic values in [-1, 1) from the element's index (Knuth's multiplicative hash).
std::vector<float> values(std::size_t n, std::uint32_t salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(((i + salt) * 2654435761u) % 2000) / 1000.0f - 1.0f;
  return v;
}

// Outputs of every step, layer by layer, for a left-padded prompt (20 and 13 tokens) then
// six decode steps.
std::vector<float> run(const CacheEntry& entry, int threads, AttentionLog& log, Storage storage) {
  CacheConfig c;
  c.layers = kLayers;
  c.batch = kBatch;
  c.heads = kHeads;
  c.kv_heads = kKvHeads;
  c.head_dim = kDim;
  RopeSpec spec;
  spec.head_dim = kDim;
  c.ropes.assign(static_cast<std::size_t>(c.layers), spec);
  c.softmax_scale = 0.25f;
  c.capacity = 64;
  // The paged cache's kind (the others are what their type says; the sink caches read W, S).
  set_every_layer(c, {LayerPolicy::Kind::sliding, 12, 2});
  c.paging = PagedLayout{4, 64, true};  // the paged cache's pool (a sliding window of 12 there)
  c.threads = threads;
  c.storage = storage;
  for (int l = 0; l < kLayers; ++l) c.sink_logits.push_back({0.5f, -1.0f, 2.0f, 0.0f, 1.0f, 3.0f});
  if (entry.name == "hybrid") {  // a sink layer and a full one
    c.policies = {{LayerPolicy::Kind::sink, 12, 2, 1, true, false}, {LayerPolicy::Kind::full, 0, 0, 1, false, false}};
  }
  const std::unique_ptr<KvCache> cache = entry.make(c);
  std::vector<float> all;
  std::int64_t uid = 0;
  for (const std::vector<std::int64_t>& counts :
       std::vector<std::vector<std::int64_t>>{{20, 13}, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}}) {
    Chunk chunk;
    chunk.length = std::max(counts[0], counts[1]);
    chunk.counts = counts;
    for (int b = 0; b < kBatch; ++b)
      for (std::int64_t i = 0; i < chunk.length; ++i) chunk.uids.push_back(i < chunk.length - counts[b] ? -1 : uid++);
    const std::size_t tokens = static_cast<std::size_t>(kBatch * chunk.length);
    std::vector<std::vector<float>> q, k, v, out;
    for (int l = 0; l < kLayers; ++l) {
      q.push_back(values(tokens * kHeads * kDim, static_cast<std::uint32_t>(uid * 7 + l)));
      k.push_back(values(tokens * kKvHeads * kDim, static_cast<std::uint32_t>(uid * 11 + l)));
      v.push_back(values(tokens * kKvHeads * kDim, static_cast<std::uint32_t>(uid * 13 + l)));
      out.emplace_back(tokens * kHeads * kDim, 0.0f);
    }
    std::vector<float*> out_ptrs;
    for (int l = 0; l < kLayers; ++l) {
      chunk.q.push_back(q[l].data());
      chunk.k.push_back(k[l].data());
      chunk.v.push_back(v[l].data());
      out_ptrs.push_back(out[l].data());
    }
    cache->append(chunk, out_ptrs, &log);
    for (const std::vector<float>& o : out) all.insert(all.end(), o.begin(), o.end());
  }
  return all;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(AttentionThreads, OutputsAreBitIdenticalForAnyThreadCount) {
  for (const CacheEntry& entry : real_caches())
    for (const Storage storage : {Storage::float32, Storage::bfloat16}) {
      AttentionLog one_log, three_log;
      const std::vector<float> one = run(entry, 1, one_log, storage);
      const std::vector<float> three = run(entry, 3, three_log, storage);
      EXPECT_TRUE(same_bits(one, three)) << entry.name;
      ASSERT_EQ(one_log.size(), three_log.size()) << entry.name;
      for (std::size_t i = 0; i < one_log.size(); ++i) {
        EXPECT_EQ(one_log[i].key_uid, three_log[i].key_uid) << entry.name;
        EXPECT_EQ(one_log[i].key_position, three_log[i].key_position) << entry.name;
        EXPECT_EQ(one_log[i].query_position, three_log[i].query_position) << entry.name;
      }
      // The run did attend: outputs are finite and not all zero.
      bool some_nonzero = false;
      for (float x : one) {
        ASSERT_TRUE(std::isfinite(x)) << entry.name;
        some_nonzero = some_nonzero || x != 0.0f;
      }
      EXPECT_TRUE(some_nonzero) << entry.name;
    }
}

TEST(WorkerPool, RunsEveryTaskOnceAndRethrowsTheFirstFailure) {
  WorkerPool pool(3);
  std::vector<int> hits(100, 0);
  pool.run(100, [&](int i, int participant) {
    ASSERT_GE(participant, 0);
    ASSERT_LT(participant, 3);
    ++hits[static_cast<std::size_t>(i)];
  });
  for (int h : hits) EXPECT_EQ(h, 1);
  EXPECT_THROW(pool.run(10,
                        [](int i, int) {
                          if (i == 4) throw std::runtime_error("task 4");
                        }),
               std::runtime_error);
  // The pool still works after a failure.
  int count = 0;
  std::mutex m;
  pool.run(7, [&](int, int) {
    std::lock_guard lock(m);
    ++count;
  });
  EXPECT_EQ(count, 7);
}
