#include "optimized/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>
#include <xsimd/xsimd.hpp>

#include "optimized/worker_pool.h"

namespace kvcheck::optimized {

namespace {

using Batch = xsimd::batch<float>;
constexpr int kLanes = static_cast<int>(Batch::size);
// Consecutive queries of a prefill chunk that share one read of K and V.
constexpr std::size_t kQueryBlock = 8;
// Query heads served together from one key or value row held in registers.
constexpr int kHeadsAtOnce = 4;
// Query heads whose accumulators stay in registers while whole value rows stream past.
constexpr int kValueHeadsAtOnce = 2;
constexpr int kValueChunksAtOnce = 8;
// Value rows per pass of the register-held accumulators (they stay in L1 for the next pass).
constexpr std::size_t kValueTile = 32;

// out[r] = <q + r * d, k> for N query vectors laid out one after the other.
template <int N>
void dots(const float* q, const float* k, int d, float* out) {
  Batch acc[N];
  for (int r = 0; r < N; ++r) acc[r] = Batch(0.0f);
  int i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const Batch kb = Batch::load_unaligned(k + i);
    for (int r = 0; r < N; ++r) acc[r] = xsimd::fma(Batch::load_unaligned(q + r * d + i), kb, acc[r]);
  }
  for (int r = 0; r < N; ++r) {
    float sum = xsimd::hadd(acc[r]);
    for (int j = i; j < d; ++j) sum += q[r * d + j] * k[j];
    out[r] = sum;
  }
}

// For keys i < count: acc[r] (dims [0, C * kLanes)) += weights[r * stride + i] * v[i], for N
// query heads, with the N x C accumulators held in registers across the keys.
template <int N, int C>
void accumulate(float* acc, int d, const float* weights, std::size_t stride, const float* const* v,
                std::size_t count, int offset) {
  Batch a[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = Batch::load_unaligned(acc + r * d + offset + c * kLanes);
  for (std::size_t i = 0; i < count; ++i) {
    Batch vb[C];
    for (int c = 0; c < C; ++c) vb[c] = Batch::load_unaligned(v[i] + offset + c * kLanes);
    for (int r = 0; r < N; ++r) {
      const Batch wb(weights[r * stride + i]);
      for (int c = 0; c < C; ++c) a[r][c] = xsimd::fma(wb, vb[c], a[r][c]);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) a[r][c].store_unaligned(acc + r * d + offset + c * kLanes);
}

// Runs f.template operator()<N>() for N = min(count, kHeadsAtOnce) chunks of `count`.
template <class F>
void by_head_groups(int count, F&& f) {
  for (int r = 0; r < count; r += kHeadsAtOnce) {
    switch (std::min(kHeadsAtOnce, count - r)) {
      case 1: f.template operator()<1>(r); break;
      case 2: f.template operator()<2>(r); break;
      case 3: f.template operator()<3>(r); break;
      default: f.template operator()<4>(r); break;
    }
  }
}

// Runs f.template operator()<C>() for C = count (1 .. kValueChunksAtOnce).
template <class F>
void by_chunk_count(int count, F&& f) {
  switch (count) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

bool sees(const QueryPlan& p, std::int64_t index) {
  return index <= p.index && (index < p.sink_end || index >= p.window_begin);
}

// x[i] = exp(x[i] - top) for n floats; returns their sum.
float exp_and_sum(float* x, std::size_t n, float top) {
  Batch total(0.0f);
  const Batch tb(top);
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch e = xsimd::exp(Batch::load_unaligned(x + i) - tb);
    e.store_unaligned(x + i);
    total += e;
  }
  float sum = xsimd::hadd(total);
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - top));
  return sum;
}

}  // namespace

struct VisibleSlot {
  const SlotStore* store;
  int row;
  std::int64_t slot;
  std::int64_t index;
};

// Up to kQueryBlock consecutive queries and every slot at least one of them sees.
struct AttentionKernel::Block {
  std::size_t first = 0, count = 0;
  std::vector<VisibleSlot> slots;
};

struct AttentionKernel::Scratch {
  std::vector<float> q_window, q_sink;  // [query, head of the group, D], rotated
  std::vector<float> scores;            // [query, head of the group, slot]
  std::vector<float> acc;               // [query, head of the group, D]
  std::vector<float> totals;            // [query, head of the group]: softmax denominators
  std::vector<const float*> k, v;       // per slot, this layer and kv head
  std::vector<float> k_rows, v_rows;    // [slot, D]: half-precision rows converted to float32

  // Room for M query vectors against n slots. Capacities are powers of two and every
  // participant is fitted before a run, whichever tasks it then takes: between two powers
  // of two of the cached tokens no step allocates.
  void fit(std::size_t M, std::size_t n, std::size_t D) {
    for (auto* x : {&q_window, &q_sink, &acc}) x->reserve(std::bit_ceil(M * D));
    scores.reserve(std::bit_ceil(M * n));
    totals.reserve(std::bit_ceil(M));
    k.reserve(std::bit_ceil(n));
    v.reserve(std::bit_ceil(n));
  }
  void fit_converted(std::size_t n, std::size_t D) {
    k_rows.reserve(std::bit_ceil(n * D));
    v_rows.reserve(std::bit_ceil(n * D));
  }
};

AttentionKernel::AttentionKernel(int threads) : pool_(std::make_unique<WorkerPool>(std::max(1, threads))) {
  scratch_.resize(static_cast<std::size_t>(pool_->size()));
}
AttentionKernel::~AttentionKernel() = default;
AttentionKernel::AttentionKernel(AttentionKernel&&) noexcept = default;
AttentionKernel& AttentionKernel::operator=(AttentionKernel&&) noexcept = default;

void AttentionKernel::attend(const KernelShape& shape, const RopeTable& rope, const std::vector<const float*>& q,
                             const std::vector<float*>& out, std::size_t row_offset,
                             std::span<const PlannedQuery> queries, std::span<const SlotSource> sources,
                             AttentionLog* log, int row) {
  const int H = shape.heads, D = shape.head_dim, G = shape.heads / shape.kv_heads;

  // Blocks and what they see: the same for every layer and kv head.
  const std::size_t block_count = (queries.size() + kQueryBlock - 1) / kQueryBlock;
  if (blocks_.size() < block_count) blocks_.resize(block_count);
  for (std::size_t b = 0; b < block_count; ++b) {
    Block& block = blocks_[b];
    block.first = b * kQueryBlock;
    block.count = std::min(kQueryBlock, queries.size() - block.first);
    block.slots.clear();
    for (const SlotSource& src : sources) {
      const SlotMeta* meta = src.store->row_meta(src.row);
      for (std::int64_t s = 0; s < src.store->capacity(); ++s) {
        if (meta[s].uid < 0) continue;
        for (std::size_t j = 0; j < block.count; ++j)
          if (sees(queries[block.first + j].plan, meta[s].index)) {
            block.slots.push_back({src.store, src.row, s, meta[s].index});
            break;
          }
      }
    }
  }
  if (log != nullptr)
    for (std::size_t b = 0; b < block_count; ++b)
      for (std::size_t j = 0; j < blocks_[b].count; ++j) {
        const QueryPlan& p = queries[blocks_[b].first + j].plan;
        for (const VisibleSlot& x : blocks_[b].slots) {
          if (!sees(p, x.index)) continue;
          const SlotMeta& m = x.store->meta(x.row, x.slot);
          log->push_back(
              {row, p.index, x.index < p.sink_end ? p.sink_query_position : p.query_position, m.uid, m.index, m.position});
        }
      }

  std::size_t most_slots = 0, most_queries = 0;
  for (std::size_t b = 0; b < block_count; ++b) {
    most_slots = std::max(most_slots, blocks_[b].slots.size());
    most_queries = std::max(most_queries, blocks_[b].count);
  }
  const bool half = !sources.empty() && !sources[0].store->plain_float32();
  for (Scratch& w : scratch_) {
    w.fit(most_queries * G, most_slots, static_cast<std::size_t>(D));
    if (half) w.fit_converted(most_slots, static_cast<std::size_t>(D));
  }

  for (int layer = 0; layer < shape.layers; ++layer) {
    // One task: one block of queries against the keys and values of one kv head.
    auto task = [&](int t, int participant) {
      const Block& block = blocks_[static_cast<std::size_t>(t) / shape.kv_heads];
      const int g = t % shape.kv_heads;
      Scratch& w = scratch_[static_cast<std::size_t>(participant)];
      const std::size_t n = block.slots.size(), M = block.count * G;
      // Every query sees at least its own token; none means the cache planned wrongly.
      if (n == 0) throw std::logic_error("attention: a query block sees no slot at all");
      w.q_window.resize(M * D);
      w.q_sink.resize(M * D);
      w.scores.resize(M * n);
      w.acc.assign(M * D, 0.0f);
      w.k.resize(n);
      w.v.resize(n);

      for (std::size_t j = 0; j < block.count; ++j) {
        const PlannedQuery& pq = queries[block.first + j];
        for (int hh = 0; hh < G; ++hh) {
          const float* raw = q[layer] + row_offset + (pq.chunk_pos * H + g * G + hh) * D;
          float* qw = w.q_window.data() + (j * G + hh) * D;
          float* qs = w.q_sink.data() + (j * G + hh) * D;
          std::copy_n(raw, D, qw);
          rope.rotate(qw, pq.plan.query_position);
          if (pq.plan.sink_query_position != pq.plan.query_position && pq.plan.sink_end > 0) {
            std::copy_n(raw, D, qs);
            rope.rotate(qs, pq.plan.sink_query_position);
          } else {
            std::copy_n(qw, D, qs);
          }
        }
      }
      // Half-precision storage is converted to float32 rows once per task, then read as such.
      const bool converted = !block.slots.empty() && !block.slots[0].store->plain_float32();
      if (converted) {
        w.k_rows.resize(n * D);
        w.v_rows.resize(n * D);
      }
      for (std::size_t i = 0; i < n; ++i) {
        const VisibleSlot& x = block.slots[i];
        if (converted) {
          x.store->read_key(layer, x.row, g, x.slot, w.k_rows.data() + i * D);
          x.store->read_value(layer, x.row, g, x.slot, w.v_rows.data() + i * D);
          w.k[i] = w.k_rows.data() + i * D;
          w.v[i] = w.v_rows.data() + i * D;
        } else {
          w.k[i] = static_cast<const float*>(x.store->key(layer, x.row, g, x.slot));
          w.v[i] = static_cast<const float*>(x.store->value(layer, x.row, g, x.slot));
        }
      }

      // Scores: each key row is read once from memory, whole and in order (the pattern memory
      // streams fastest; reading several rows interleaved was twice as slow here), for every
      // query and head of the block. Keys a query does not see get -inf.
      float group_scores[kHeadsAtOnce];
      for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t index = block.slots[i].index;
        for (std::size_t j = 0; j < block.count; ++j) {
          const QueryPlan& p = queries[block.first + j].plan;
          float* column = w.scores.data() + j * G * n + i;
          if (!sees(p, index)) {
            for (int hh = 0; hh < G; ++hh) column[hh * n] = -INFINITY;
            continue;
          }
          const float* qj = (index < p.sink_end ? w.q_sink : w.q_window).data() + j * G * D;
          by_head_groups(G, [&]<int N>(int h0) {
            dots<N>(qj + h0 * D, w.k[i], D, group_scores);
            for (int r = 0; r < N; ++r) column[(h0 + r) * n] = group_scores[r] * shape.scale;
          });
        }
      }

      // Softmax over each query head's row of scores (an invisible key weighs exp(-inf) = 0).
      // A learned sink logit takes its share of the denominator and adds no value.
      w.totals.resize(M);
      float* total = w.totals.data();
      const float* sinks = shape.sink_logits ? (*shape.sink_logits)[static_cast<std::size_t>(layer)].data() : nullptr;
      for (std::size_t m = 0; m < M; ++m) {
        float* x = w.scores.data() + m * n;
        float top = *std::max_element(x, x + n);
        const float sink = sinks ? sinks[g * G + static_cast<int>(m % G)] : 0.0f;
        if (sinks) top = std::max(top, sink);
        total[m] = exp_and_sum(x, n, top);
        if (sinks) total[m] += std::exp(sink - top);
      }

      // Values: each tile of value rows is read once from memory for every query and head of
      // the block (a key a query does not see has weight exp(-inf) = 0).
      const int chunks = D / kLanes;
      for (std::size_t i0 = 0; i0 < n; i0 += kValueTile) {
        const std::size_t len = std::min(kValueTile, n - i0);
        const float* const* v = w.v.data() + i0;
        for (std::size_t j = 0; j < block.count; ++j)
          for (int h0 = 0; h0 < G; h0 += kValueHeadsAtOnce) {
            float* acc = w.acc.data() + (j * G + h0) * D;
            const float* weights = w.scores.data() + (j * G + h0) * n + i0;
            const auto heads = [&]<int N>() {
              for (int c0 = 0; c0 < chunks; c0 += kValueChunksAtOnce)
                by_chunk_count(std::min(kValueChunksAtOnce, chunks - c0), [&]<int C>() {
                  accumulate<N, C>(acc, D, weights, n, v, len, c0 * kLanes);
                });
              for (int r = 0; r < N; ++r)  // dims past the last whole vector
                for (std::size_t i = 0; i < len; ++i)
                  for (int e = chunks * kLanes; e < D; ++e) acc[r * D + e] += weights[r * n + i] * v[i][e];
            };
            if (G - h0 >= 2)
              heads.template operator()<2>();
            else
              heads.template operator()<1>();
          }
      }

      for (std::size_t j = 0; j < block.count; ++j)
        for (int hh = 0; hh < G; ++hh) {
          const std::size_t m = j * G + hh;
          float* o = out[layer] + row_offset + (queries[block.first + j].chunk_pos * H + g * G + hh) * D;
          for (int d = 0; d < D; ++d) o[d] = w.acc[m * D + d] / total[m];
        }
    };
    pool_->run(static_cast<int>(block_count) * shape.kv_heads, task);
  }
}

}  // namespace kvcheck::optimized
