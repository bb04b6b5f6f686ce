#include "optimized/attention.h"

#include <algorithm>
#include <cmath>
#include <xsimd/xsimd.hpp>

namespace kvcheck::optimized {

namespace {

using Batch = xsimd::batch<float>;

// <a, b> over n floats, Batch::size lanes at a time (the decode step's inner loop).
float dot(const float* a, const float* b, int n) {
  Batch acc(0.0f);
  int i = 0;
  for (; i + static_cast<int>(Batch::size) <= n; i += static_cast<int>(Batch::size))
    acc = xsimd::fma(Batch::load_unaligned(a + i), Batch::load_unaligned(b + i), acc);
  float sum = xsimd::hadd(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// acc += w * v over n floats.
void add_scaled(float* acc, float w, const float* v, int n) {
  const Batch wb(w);
  int i = 0;
  for (; i + static_cast<int>(Batch::size) <= n; i += static_cast<int>(Batch::size))
    xsimd::fma(wb, Batch::load_unaligned(v + i), Batch::load_unaligned(acc + i)).store_unaligned(acc + i);
  for (; i < n; ++i) acc[i] += w * v[i];
}

}  // namespace

void attend_row(const KernelShape& shape, RopeTable& rope, int layer, const float* q,
                const std::vector<std::pair<std::int64_t, QueryPlan>>& plans, const std::vector<SlotSource>& sources,
                float* out, AttentionLog* log, int row) {
  const int H = shape.heads, D = shape.head_dim, group = shape.heads / shape.kv_heads;
  struct Seen {
    const SlotStore* store;
    int row;
    std::int64_t slot;
    bool sink;
  };
  std::vector<float> q_window(static_cast<std::size_t>(H) * D), q_sink(static_cast<std::size_t>(H) * D);
  std::vector<Seen> seen;
  std::vector<float> weights;
  std::vector<float> acc(static_cast<std::size_t>(D));

  for (const auto& [chunk_pos, plan] : plans) {
    const float* raw = q + chunk_pos * H * D;
    std::copy_n(raw, H * D, q_window.data());
    for (int h = 0; h < H; ++h) rope.rotate(q_window.data() + h * D, plan.query_position);
    const bool two_positions = plan.sink_query_position != plan.query_position;
    if (two_positions) {
      std::copy_n(raw, H * D, q_sink.data());
      for (int h = 0; h < H; ++h) rope.rotate(q_sink.data() + h * D, plan.sink_query_position);
    }

    seen.clear();
    for (const SlotSource& src : sources) {
      const SlotMeta* meta = src.store->row_meta(src.row);
      for (std::int64_t s = 0; s < src.store->capacity(); ++s) {
        if (meta[s].uid < 0 || meta[s].index > plan.index) continue;  // empty, or a later token of the chunk
        if (meta[s].index < plan.sink_end)
          seen.push_back({src.store, src.row, s, true});
        else if (meta[s].index >= plan.window_begin)
          seen.push_back({src.store, src.row, s, false});
      }
    }
    if (log != nullptr)
      for (const Seen& x : seen) {
        const SlotMeta& m = x.store->meta(x.row, x.slot);
        log->push_back(
            {row, plan.index, x.sink ? plan.sink_query_position : plan.query_position, m.uid, m.index, m.position});
      }

    weights.resize(seen.size());
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const float* qw = q_window.data() + h * D;
      const float* qs = (two_positions ? q_sink.data() : q_window.data()) + h * D;
      float top = -INFINITY;
      for (std::size_t i = 0; i < seen.size(); ++i) {
        const float* k = seen[i].store->key(layer, seen[i].row, g, seen[i].slot);
        weights[i] = dot(seen[i].sink ? qs : qw, k, D) * shape.scale;
        top = std::max(top, weights[i]);
      }
      float total = 0.0f;
      for (float& w : weights) total += (w = std::exp(w - top));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::size_t i = 0; i < seen.size(); ++i) {
        add_scaled(acc.data(), weights[i], seen[i].store->value(layer, seen[i].row, g, seen[i].slot), D);
      }
      float* o = out + (chunk_pos * H + h) * D;
      for (int d = 0; d < D; ++d) o[d] = acc[d] / total;
    }
  }
}

}  // namespace kvcheck::optimized
