// Decode-step cost of each optimized cache, side by side with the time to read its K and V
// once (the memory-bandwidth floor a decode step is measured against). Run:
//   build/kvcheck_bench --benchmark_filter=Decode
// and compare each cache's time with ReadKV at the same window.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "optimized/dense_cache.h"
#include "optimized/sink_ring_cache.h"
#include "optimized/sink_shift_cache.h"
#include "optimized/sliding_cache.h"

namespace {

using namespace kvcheck::optimized;

constexpr int kHeads = 8, kKvHeads = 8, kHeadDim = 128;

CacheConfig config(std::int64_t window) {
  CacheConfig c;
  c.heads = kHeads;
  c.kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  c.rope.head_dim = kHeadDim;
  c.softmax_scale = 0.088f;
  c.window = window;
  c.sinks = 4;
  c.capacity = 1 << 20;
  return c;
}

// Deterministic small values; the numbers do not matter for timing.
std::vector<float> values(std::size_t n, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
  return v;
}

struct Feed {
  std::vector<float> q, k, v, out;
  Chunk chunk;
  Feed()
      : q(values(kHeads * kHeadDim, 1.0f)),
        k(values(kKvHeads * kHeadDim, 0.7f)),
        v(values(kKvHeads * kHeadDim, 0.3f)),
        out(kHeads * kHeadDim) {
    chunk.length = 1;
    chunk.counts = {1};
    chunk.uids = {0};
    chunk.q = {q.data()};
    chunk.k = {k.data()};
    chunk.v = {v.data()};
  }
  void next(KvCache& cache) {
    ++chunk.uids[0];
    cache.append(chunk, {out.data()}, nullptr);
  }
};

template <class Make>
void decode(benchmark::State& state, Make make) {
  const std::int64_t window = state.range(0);
  std::unique_ptr<KvCache> cache = make(config(window));
  Feed feed;
  for (std::int64_t t = 0; t < window + 8; ++t) feed.next(*cache);  // full, and already evicting
  for (auto _ : state) {
    feed.next(*cache);
    benchmark::DoNotOptimize(feed.out.data());
  }
  state.SetBytesProcessed(state.iterations() * 2 * window * kKvHeads * kHeadDim *
                          static_cast<std::int64_t>(sizeof(float)));
}

void DecodeSliding(benchmark::State& s) {
  decode(s, [](const CacheConfig& c) { return std::make_unique<SlidingCache>(c); });
}
void DecodeSinkShift(benchmark::State& s) {
  decode(s, [](const CacheConfig& c) { return std::make_unique<SinkShiftCache>(c); });
}
void DecodeSinkRing(benchmark::State& s) {
  decode(s, [](const CacheConfig& c) { return std::make_unique<SinkRingCache>(c); });
}

// The floor: read W keys and W values of every kv head once.
void ReadKV(benchmark::State& state) {
  const std::int64_t window = state.range(0);
  const std::vector<float> k = values(static_cast<std::size_t>(window) * kKvHeads * kHeadDim, 1.0f);
  const std::vector<float> v = values(static_cast<std::size_t>(window) * kKvHeads * kHeadDim, 1.0f);
  // XOR of the raw bits: a reduction the compiler vectorizes, so this is bound by memory,
  // not by a chain of dependent float additions.
  auto bits = [](const std::vector<float>& x) {
    std::uint32_t acc = 0;
    const auto* p = reinterpret_cast<const std::uint32_t*>(x.data());
    for (std::size_t i = 0; i < x.size(); ++i) acc ^= p[i];
    return acc;
  };
  for (auto _ : state) {
    std::uint32_t sum = bits(k) ^ bits(v);
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(state.iterations() * 2 * window * kKvHeads * kHeadDim *
                          static_cast<std::int64_t>(sizeof(float)));
}

}  // namespace

BENCHMARK(ReadKV)->Arg(1024)->Arg(4096);
BENCHMARK(DecodeSliding)->Arg(1024)->Arg(4096);
BENCHMARK(DecodeSinkShift)->Arg(1024)->Arg(4096);
BENCHMARK(DecodeSinkRing)->Arg(1024)->Arg(4096);
BENCHMARK_MAIN();
