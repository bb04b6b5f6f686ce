// What a cache step costs, side by side with the floor it is judged against: reading the
// same K and V once. Every figure is a Google Benchmark; tools/kvcheck bench runs them with
// repetitions and tools/bench/ratios.py prints the ratios.
//
//   Decode/<cache>/H<heads>/W<window>/t<threads>   one decode step (update plus attention)
//                                                  with W tokens cached, D 128, 8 kv heads
//   ReadKV/W<window>/t<threads>                    the floor: W keys and values of 8 kv heads
//   Prefill/<cache>/H32/t<threads>                 4096 tokens in chunks of 512
//   DecodeQuant/<format>/H32/W<window>/t<threads>  the dynamic cache's decode step with K and V
//                                                  stored quantized (SPEC 9): q8_0, fp8_e4m3
//   ReadKVQuant/<format>/W<window>/t<threads>      its floor: the stored bytes read once
//   DecodePaged/<policy>/H32/W<window>/t<threads>  the paged cache's decode step (blocks of 16,
//                                                  SPEC 8), against Decode/dynamic, /sliding or /sink_ring
#include <benchmark/benchmark.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "optimized/dense_cache.h"
#include "optimized/paged_cache.h"
#include "optimized/row_codec.h"
#include "optimized/sink_ring_cache.h"
#include "optimized/sink_shift_cache.h"
#include "optimized/sliding_cache.h"
#include "optimized/worker_pool.h"

namespace {

using namespace kvcheck::optimized;

constexpr int kKvHeads = 8, kHeadDim = 128, kSinks = 4;
constexpr std::int64_t kFillChunk = 4096;

struct Shape {
  int heads;
  std::int64_t window;
  int threads;
};

CacheConfig config(const Shape& shape, std::int64_t capacity) {
  CacheConfig c;
  c.heads = shape.heads;
  c.kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  RopeSpec rope;
  rope.head_dim = kHeadDim;
  rope.theta = 500000.0;
  set_every_layer_rope(c, rope);
  c.softmax_scale = 0.088f;
  // The caches of one policy read the window (and sinks); decode_paged sets the kind.
  set_every_layer(c, LayerPolicy{LayerPolicy::Kind::full, shape.window, kSinks});
  c.capacity = capacity;
  c.threads = shape.threads;
  return c;
}

using MakeCache = std::function<std::unique_ptr<KvCache>(const CacheConfig&)>;

struct NamedCache {
  std::string name;
  MakeCache make;
};

const std::vector<NamedCache>& caches() {
  static const std::vector<NamedCache> all = {
      {"dynamic", [](const CacheConfig& c) { return std::make_unique<DenseCache>(c, DenseCache::Growth::dynamic); }},
      {"static", [](const CacheConfig& c) { return std::make_unique<DenseCache>(c, DenseCache::Growth::fixed); }},
      {"sliding", [](const CacheConfig& c) { return std::make_unique<SlidingCache>(c); }},
      {"sink_shift", [](const CacheConfig& c) { return std::make_unique<SinkShiftCache>(c); }},
      {"sink_ring", [](const CacheConfig& c) { return std::make_unique<SinkRingCache>(c); }},
  };
  return all;
}

// Deterministic values in [-scale/2, scale/2); the numbers do not matter for timing.
std::vector<float> values(std::size_t n, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * (static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f);
  return v;
}

// Raw q/k/v for chunks of up to `capacity` tokens of one row, and the outputs.
struct Feed {
  int heads;
  std::vector<float> q, k, v, out;
  Chunk chunk;
  std::int64_t next_uid = 0;

  Feed(int heads_, std::int64_t capacity)
      : heads(heads_),
        q(values(static_cast<std::size_t>(capacity) * heads * kHeadDim, 1.0f)),
        k(values(static_cast<std::size_t>(capacity) * kKvHeads * kHeadDim, 0.7f)),
        v(values(static_cast<std::size_t>(capacity) * kKvHeads * kHeadDim, 0.3f)),
        out(static_cast<std::size_t>(capacity) * heads * kHeadDim) {
    chunk.q = {q.data()};
    chunk.k = {k.data()};
    chunk.v = {v.data()};
  }
  // Appends n tokens; outputs are computed unless `fill_only`.
  void append(KvCache& cache, std::int64_t n, bool fill_only = false) {
    chunk.length = n;
    chunk.counts = {n};
    chunk.uids.resize(static_cast<std::size_t>(n));
    for (std::int64_t& u : chunk.uids) u = next_uid++;
    cache.append(chunk, fill_only ? std::vector<float*>{} : std::vector<float*>{out.data()}, nullptr);
  }
};

std::int64_t kv_bytes(std::int64_t window) {
  return 2 * window * kKvHeads * kHeadDim * static_cast<std::int64_t>(sizeof(float));
}

// One decode step with `window` tokens cached. Dense caches are cropped back to `window`
// tokens outside the timed region, so every cache attends over the same number of keys.
void decode(benchmark::State& state, const NamedCache& named, Shape shape) {
  const bool dense = named.name == "dynamic" || named.name == "static";
  std::unique_ptr<KvCache> cache = named.make(config(shape, shape.window + 64));
  Feed feed(shape.heads, kFillChunk);
  const std::int64_t fill = dense ? shape.window - 1 : shape.window + 8;  // windowed ones: full, evicting
  for (std::int64_t done = 0; done < fill; done += kFillChunk)
    feed.append(*cache, std::min(kFillChunk, fill - done), /*fill_only=*/true);
  for (auto _ : state) {
    feed.append(*cache, 1);
    benchmark::DoNotOptimize(feed.out.data());
    if (dense) {
      state.PauseTiming();
      cache->crop(shape.window - 1);
      state.ResumeTiming();
    }
  }
  state.SetBytesProcessed(state.iterations() * kv_bytes(shape.window));
}

// The floor: every kv head's W keys and W values read once, split over the threads by kv
// head as the attention splits its work.
void read_kv(benchmark::State& state, Shape shape) {
  const std::size_t run = static_cast<std::size_t>(shape.window) * kHeadDim;
  const std::vector<float> k = values(run * kKvHeads, 1.0f), v = values(run * kKvHeads, 1.0f);
  std::vector<std::uint32_t> sums(kKvHeads);
  WorkerPool pool(shape.threads);
  // XOR of the raw bits: a reduction the compiler vectorizes, so this is bound by memory.
  auto bits = [run](const std::vector<float>& x, int head) {
    std::uint32_t acc = 0;
    const auto* p = reinterpret_cast<const std::uint32_t*>(x.data()) + head * run;
    for (std::size_t i = 0; i < run; ++i) acc ^= p[i];
    return acc;
  };
  for (auto _ : state) {
    pool.run(kKvHeads, [&](int head, int) { sums[static_cast<std::size_t>(head)] = bits(k, head) ^ bits(v, head); });
    benchmark::DoNotOptimize(sums.data());
  }
  state.SetBytesProcessed(state.iterations() * kv_bytes(shape.window));
}

// The quantized formats benchmarked: llama.cpp's q8_0 and vLLM's fp8 with a static scale.
RowFormat quant_format(const std::string& name) {
  RowFormat f;
  f.codec = name == "q8_0" ? Codec::q8_0 : Codec::fp8_e4m3;
  if (f.codec == Codec::fp8_e4m3) f.static_scales = {0.01f};
  return f;
}

// The dynamic cache's decode step with K and V stored in `format`.
void decode_quant(benchmark::State& state, const std::string& format, Shape shape) {
  CacheConfig c = config(shape, shape.window + 64);
  c.quant.assign(static_cast<std::size_t>(c.layers), {quant_format(format), quant_format(format)});
  DenseCache cache(c, DenseCache::Growth::dynamic);
  Feed feed(shape.heads, kFillChunk);
  for (std::int64_t done = 0; done < shape.window - 1; done += kFillChunk)
    feed.append(cache, std::min(kFillChunk, shape.window - 1 - done), /*fill_only=*/true);
  for (auto _ : state) {
    feed.append(cache, 1);
    benchmark::DoNotOptimize(feed.out.data());
    state.PauseTiming();
    cache.crop(shape.window - 1);
    state.ResumeTiming();
  }
}

// The paged cache's decode step with `window` tokens cached: full attention (cropped back
// outside the timed region, as the dense caches are), or a sliding or sink window, evicting.
void decode_paged(benchmark::State& state, LayerPolicy::Kind kind, Shape shape) {
  const bool full = kind == LayerPolicy::Kind::full;
  CacheConfig c = config(shape, 0);
  LayerPolicy policy = shared_policy(c);
  if (full) policy.window = 0;
  policy.kind = kind;
  set_every_layer(c, policy);
  c.paging = PagedLayout{16, shape.window / 16 + 8, false};
  PagedCache cache(c);
  Feed feed(shape.heads, kFillChunk);
  const std::int64_t fill = full ? shape.window - 1 : shape.window + 8;
  for (std::int64_t done = 0; done < fill; done += kFillChunk)
    feed.append(cache, std::min(kFillChunk, fill - done), /*fill_only=*/true);
  for (auto _ : state) {
    feed.append(cache, 1);
    benchmark::DoNotOptimize(feed.out.data());
    if (full) {
      state.PauseTiming();
      cache.crop(shape.window - 1);
      state.ResumeTiming();
    }
  }
  state.SetBytesProcessed(state.iterations() * kv_bytes(shape.window));
}

// Its floor: every kv head's W stored key and value rows read once.
void read_kv_quant(benchmark::State& state, const std::string& format, Shape shape) {
  const std::size_t run = static_cast<std::size_t>(shape.window) * row_bytes(quant_format(format), kHeadDim) / 4;
  const std::vector<std::uint32_t> k(run * kKvHeads, 1u), v(run * kKvHeads, 2u);
  std::vector<std::uint32_t> sums(kKvHeads);
  WorkerPool pool(shape.threads);
  auto bits = [run](const std::vector<std::uint32_t>& x, int head) {
    std::uint32_t acc = 0;
    const std::uint32_t* p = x.data() + head * run;
    for (std::size_t i = 0; i < run; ++i) acc ^= p[i];
    return acc;
  };
  for (auto _ : state) {
    pool.run(kKvHeads, [&](int head, int) { sums[static_cast<std::size_t>(head)] = bits(k, head) ^ bits(v, head); });
    benchmark::DoNotOptimize(sums.data());
  }
}

// 4096 tokens into an empty cache in chunks of 512, every output computed.
void prefill(benchmark::State& state, const NamedCache& named, Shape shape) {
  constexpr std::int64_t kTokens = 4096, kChunk = 512;
  Feed feed(shape.heads, kChunk);
  std::unique_ptr<KvCache> cache = named.make(config(shape, kTokens));
  for (auto _ : state) {
    state.PauseTiming();
    cache->reset(1);
    state.ResumeTiming();
    for (std::int64_t done = 0; done < kTokens; done += kChunk) feed.append(*cache, kChunk);
    benchmark::DoNotOptimize(feed.out.data());
  }
}

int register_all() {
  using benchmark::RegisterBenchmark;
  for (const std::int64_t window : {1024, 4096, 32768})
    for (const int threads : {1, 2}) {
      const std::string suffix = "/W" + std::to_string(window) + "/t" + std::to_string(threads);
      RegisterBenchmark(("ReadKV" + suffix).c_str(), read_kv, Shape{0, window, threads})
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      for (const int heads : {32, 8})
        for (const NamedCache& named : caches())
          RegisterBenchmark(("Decode/" + named.name + "/H" + std::to_string(heads) + suffix).c_str(), decode, named,
                            Shape{heads, window, threads})
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
    }
  for (const std::int64_t window : {4096, 32768})
    for (const int threads : {1, 2})
      for (const std::string format : {"q8_0", "fp8_e4m3"}) {
        const std::string suffix = "/W" + std::to_string(window) + "/t" + std::to_string(threads);
        RegisterBenchmark(("DecodeQuant/" + format + "/H32" + suffix).c_str(), decode_quant, format,
                          Shape{32, window, threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
        RegisterBenchmark(("ReadKVQuant/" + format + suffix).c_str(), read_kv_quant, format, Shape{0, window, threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
  for (const std::int64_t window : {4096, 32768})
    for (const int threads : {1, 2})
      for (const auto& [name, kind] : {std::pair{"full", LayerPolicy::Kind::full},
                                       std::pair{"sliding", LayerPolicy::Kind::sliding},
                                       std::pair{"sink", LayerPolicy::Kind::sink}})
        RegisterBenchmark(("DecodePaged/" + std::string(name) + "/H32/W" + std::to_string(window) + "/t" +
                           std::to_string(threads))
                              .c_str(),
                          decode_paged, kind, Shape{32, window, threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
  // The sink cache's window holds the whole prompt, so each query sees the keys a
  // dynamic cache gives it.
  for (const int threads : {1, 2})
    for (const NamedCache& named : caches())
      if (named.name == "dynamic" || named.name == "sink_ring")
        RegisterBenchmark(("Prefill/" + named.name + "/H32/t" + std::to_string(threads)).c_str(), prefill, named,
                          Shape{32, 4096, threads})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->Iterations(1);
  return 0;
}

[[maybe_unused]] const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
