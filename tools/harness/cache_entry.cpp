#include "tools/harness/cache_entry.h"

#include <algorithm>
#include <thread>

#include "tools/harness/scenario.h"

namespace kvcheck {

using optimized::CacheConfig;
using optimized::PairLayout;

namespace {

optimized::LayerPolicy layer_policy(const Policy& p) {
  optimized::LayerPolicy l;
  l.kind = p.kind == PolicyKind::full      ? optimized::LayerPolicy::Kind::full
           : p.kind == PolicyKind::sliding ? optimized::LayerPolicy::Kind::sliding
                                           : optimized::LayerPolicy::Kind::sink;
  l.window = p.window;
  l.sinks = p.sinks;
  l.evict = p.evict;
  // A sliding window keeps absolute positions: it is a sink cache without sinks that never shifts.
  l.shift_positions = p.kind == PolicyKind::sink && p.positions == SinkPositions::cache;
  l.dense_prefill = p.prefill == Prefill::dense;
  return l;
}

}  // namespace

CacheConfig cache_config(const Scenario& s, std::int64_t capacity) {
  CacheConfig c;
  c.layers = s.dims.layers;
  c.heads = s.dims.heads;
  c.kv_heads = s.dims.kv_heads;
  c.head_dim = s.dims.head_dim;
  c.batch = s.dims.batch;
  c.rope.head_dim = s.dims.head_dim;
  c.rope.theta = s.rope.theta;
  c.rope.layout = s.rope.layout == RopeLayout::half ? PairLayout::half : PairLayout::interleaved;
  c.rope.position_divisor = s.rope.scaling == RopeScaling::linear ? s.rope.factor : 1.0;
  c.rope.rotary_dim = s.rope.rotary_dim;
  c.rope.map = s.rope.scaling == RopeScaling::llama3 ? optimized::FrequencyMap::llama3
               : s.rope.scaling == RopeScaling::yarn ? optimized::FrequencyMap::yarn
                                                     : optimized::FrequencyMap::plain;
  c.rope.factor = s.rope.factor;
  c.rope.low_freq_factor = s.rope.low_freq_factor;
  c.rope.high_freq_factor = s.rope.high_freq_factor;
  c.rope.original_context = s.rope.original_max_position_embeddings;
  c.rope.beta_fast = s.rope.beta_fast;
  c.rope.beta_slow = s.rope.beta_slow;
  c.rope.magnitude = s.rope.scaling == RopeScaling::yarn ? s.rope.attention_factor : 1.0;
  for (const std::vector<double>& layer : s.attention.sink_logits)
    c.sink_logits.emplace_back(layer.begin(), layer.end());
  c.softmax_scale = static_cast<float>(s.softmax_scale());
  if (s.hybrid())
    for (const Policy& p : s.layer_policies) c.layer_policies.push_back(layer_policy(p));
  c.window = s.policy.window;
  c.sinks = s.policy.sinks;
  c.evict = s.policy.evict;
  // A sliding window keeps absolute positions: it is a sink cache without sinks that never shifts.
  c.shift_positions = s.policy.kind == PolicyKind::sink && s.policy.positions == SinkPositions::cache;
  c.dense_prefill = s.policy.prefill == Prefill::dense;
  c.capacity = capacity;
  c.storage = s.kv_dtype == KvDtype::float32   ? optimized::Storage::float32
              : s.kv_dtype == KvDtype::float16 ? optimized::Storage::float16
                                               : optimized::Storage::bfloat16;
  // Several threads wherever kvcheck runs: outputs do not depend on the count (tested), so
  // every check also runs the threaded path.
  c.threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 4);
  return c;
}

}  // namespace kvcheck
