// The reference's attention beside a plain double dot product over contiguous memory of the
// same size (H heads x n keys x D), and on one thread beside two: the ratios issue 9 asks
// for, measured side by side in one run. Run:
//   tools/kvcheck bench --benchmark_filter=Reference
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "reference/reference_model.h"

namespace {

using namespace kvcheck;

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128;

InputTable inputs(std::int64_t uids) {
  InputTable t;
  t.layers = 1;
  t.uids = uids;
  t.heads = kHeads;
  t.kv_heads = kKvHeads;
  t.head_dim = kHeadDim;
  auto fill = [](std::vector<float>& x, std::size_t n, double salt) {
    x.resize(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(std::sin(0.61 * static_cast<double>(i) + salt));
  };
  fill(t.q, static_cast<std::size_t>(uids) * kHeads * kHeadDim, 1);
  fill(t.k, static_cast<std::size_t>(uids) * kKvHeads * kHeadDim, 2);
  fill(t.v, static_cast<std::size_t>(uids) * kKvHeads * kHeadDim, 3);
  return t;
}

Dims dims() {
  Dims d;
  d.heads = kHeads;
  d.kv_heads = kKvHeads;
  d.head_dim = kHeadDim;
  return d;
}

// One decode step of the reference over a sliding window of `keys` tokens (every query
// head against every visible key, double precision), on `threads` threads.
void ReferenceDecode(benchmark::State& state) {
  const std::int64_t keys = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const std::int64_t steps = 64;
  const InputTable table = inputs(keys + steps + 1);
  Policy sliding;
  sliding.kind = PolicyKind::sliding;
  sliding.window = keys;
  Rope rope;
  rope.theta = 500000;
  for (auto _ : state) {
    state.PauseTiming();
    reference::ReferenceModel model(dims(), rope, sliding, 0.088, table);
    model.set_threads(threads);
    model.append({keys});  // the window, filled
    state.ResumeTiming();
    for (std::int64_t i = 0; i < steps; ++i) benchmark::DoNotOptimize(model.append({1}).out.data());
  }
  state.counters["ns_per_query_key_dim"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * steps * kHeads * keys * kHeadDim,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// The floor: a plain dot product, left to right, over contiguous doubles of the same size
// (one query head's keys, for every head and step).
void PlainDot(benchmark::State& state) {
  const std::int64_t keys = state.range(0);
  const std::int64_t steps = 64;
  std::vector<double> q(kHeadDim, 0.5), k(static_cast<std::size_t>(keys) * kHeadDim, 0.25);
  for (auto _ : state)
    for (std::int64_t s = 0; s < steps; ++s)
      for (int h = 0; h < kHeads; ++h)
        for (std::int64_t j = 0; j < keys; ++j) {
          double sum = 0;
          const double* kj = k.data() + j * kHeadDim;
          for (int d = 0; d < kHeadDim; ++d) sum += q[d] * kj[d];
          benchmark::DoNotOptimize(sum);
        }
  state.counters["ns_per_query_key_dim"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * steps * kHeads * keys * kHeadDim,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

}  // namespace

BENCHMARK(PlainDot)->Arg(1024)->Unit(benchmark::kMillisecond);
BENCHMARK(ReferenceDecode)->Args({1024, 1})->Args({1024, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
