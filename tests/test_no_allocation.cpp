// A decode step allocates nothing once a cache has seen the shapes: counted by replacing
// the global operator new in this test program alone. Tables and scratch space that grow
// with the sequence double, so between two powers of two of the token count no step
// allocates at all.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "optimized/dense_cache.h"
#include "optimized/sink_ring_cache.h"
#include "optimized/sink_shift_cache.h"
#include "optimized/sliding_cache.h"

namespace {
std::atomic<long> g_allocations{0};
}

// GCC cannot see that this delete pairs with the malloc of the new above.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using namespace kvcheck::optimized;

namespace {

constexpr int kHeads = 8, kKvHeads = 2, kDim = 32;

template <class Make>
long allocations_in_decode(Make make, int threads) {
  CacheConfig c;
  c.heads = kHeads;
  c.kv_heads = kKvHeads;
  c.head_dim = kDim;
  RopeSpec spec;
  spec.head_dim = kDim;
  c.ropes.assign(static_cast<std::size_t>(c.layers), spec);
  set_every_layer(c, {LayerPolicy::Kind::full, 24, 4});  // the sink caches read W and S
  c.capacity = 2048;
  c.threads = threads;
  std::unique_ptr<KvCache> cache = make(c);
  std::vector<float> q(kHeads * kDim, 0.25f), k(kKvHeads * kDim, 0.5f), v(kKvHeads * kDim, 1.0f), out(kHeads * kDim);
  Chunk chunk;
  chunk.length = 1;
  chunk.counts = {1};
  chunk.uids = {0};
  chunk.q = {q.data()};
  chunk.k = {k.data()};
  chunk.v = {v.data()};
  const std::vector<float*> outs = {out.data()};
  // Tokens 0 .. 1099 (every windowed cache long past its window), then 1100 .. 1499 counted.
  for (int t = 0; t < 1100; ++t, ++chunk.uids[0]) cache->append(chunk, outs, nullptr);
  const long before = g_allocations.load();
  for (int t = 1100; t < 1500; ++t, ++chunk.uids[0]) cache->append(chunk, outs, nullptr);
  return g_allocations.load() - before;
}

}  // namespace

TEST(DecodeStep, AllocatesNothingOnceTheShapesAreKnown) {
  for (const int threads : {1, 2}) {
    EXPECT_EQ(allocations_in_decode([](const CacheConfig& c) { return std::make_unique<SlidingCache>(c); }, threads), 0)
        << "sliding, threads " << threads;
    EXPECT_EQ(allocations_in_decode([](const CacheConfig& c) { return std::make_unique<SinkRingCache>(c); }, threads), 0)
        << "sink_ring, threads " << threads;
    EXPECT_EQ(allocations_in_decode([](const CacheConfig& c) { return std::make_unique<SinkShiftCache>(c); }, threads),
              0)
        << "sink_shift, threads " << threads;
    EXPECT_EQ(
        allocations_in_decode(
            [](const CacheConfig& c) { return std::make_unique<DenseCache>(c, DenseCache::Growth::fixed); }, threads),
        0)
        << "static, threads " << threads;
  }
}

TEST(DecodeStep, TheCounterSeesAllocations) {
  const long before = g_allocations.load();
  auto p = std::make_unique<std::vector<int>>(100);
  EXPECT_GE(g_allocations.load() - before, 2);
}
