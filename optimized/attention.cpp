#include "optimized/attention.h"

#include <algorithm>
#include <cmath>

namespace kvcheck::optimized {

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
        log->push_back({row, plan.index, x.sink ? plan.sink_query_position : plan.query_position, m.uid, m.index,
                        m.position});
      }

    weights.resize(seen.size());
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const float* qw = q_window.data() + h * D;
      const float* qs = (two_positions ? q_sink.data() : q_window.data()) + h * D;
      float top = -INFINITY;
      for (std::size_t i = 0; i < seen.size(); ++i) {
        const float* k = seen[i].store->key(layer, seen[i].row, g, seen[i].slot);
        const float* qv = seen[i].sink ? qs : qw;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qv[d] * k[d];
        weights[i] = dot * shape.scale;
        top = std::max(top, weights[i]);
      }
      float total = 0.0f;
      for (float& w : weights) total += (w = std::exp(w - top));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::size_t i = 0; i < seen.size(); ++i) {
        const float* v = seen[i].store->value(layer, seen[i].row, g, seen[i].slot);
        for (int d = 0; d < D; ++d) acc[d] += weights[i] * v[d];
      }
      float* o = out + (chunk_pos * H + h) * D;
      for (int d = 0; d < D; ++d) o[d] = acc[d] / total;
    }
  }
}

}  // namespace kvcheck::optimized
