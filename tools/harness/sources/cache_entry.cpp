#include "tools/harness/sources/cache_entry.h"

#include <algorithm>
#include <thread>

#include "tools/harness/check/quant_checks.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

using optimized::CacheConfig;
using optimized::PairLayout;

namespace {

optimized::LayerPolicy layer_policy(const Policy& p) {
  optimized::LayerPolicy l;
  l.kind = p.kind == PolicyKind::full      ? optimized::LayerPolicy::Kind::full
           : p.kind == PolicyKind::sliding ? optimized::LayerPolicy::Kind::sliding
           : p.kind == PolicyKind::chunked ? optimized::LayerPolicy::Kind::chunked
                                           : optimized::LayerPolicy::Kind::sink;
  l.window = p.window;
  l.sinks = p.sinks;
  l.evict = p.evict;
  // A sliding window keeps absolute positions: it is a sink cache without sinks that never shifts.
  l.shift_positions = p.kind == PolicyKind::sink && p.positions == SinkPositions::cache;
  l.dense_prefill = p.prefill == Prefill::dense;
  l.swa = p.swa;
  return l;
}

}  // namespace

optimized::RopeSpec rope_spec(const Rope& r, int head_dim) {
  optimized::RopeSpec spec;
  spec.head_dim = head_dim;
  spec.identity = r.nope;
  spec.theta = r.theta;
  spec.layout = r.layout == RopeLayout::half ? PairLayout::half : PairLayout::interleaved;
  spec.position_divisor = r.scaling == RopeScaling::linear ? r.factor : 1.0;
  spec.rotary_dim = r.rotary_dim;
  spec.map = r.scaling == RopeScaling::llama3 ? optimized::FrequencyMap::llama3
             : r.scaling == RopeScaling::yarn ? optimized::FrequencyMap::yarn
                                              : optimized::FrequencyMap::plain;
  spec.factor = r.factor;
  spec.low_freq_factor = r.low_freq_factor;
  spec.high_freq_factor = r.high_freq_factor;
  spec.original_context = r.original_max_position_embeddings;
  spec.beta_fast = r.beta_fast;
  spec.beta_slow = r.beta_slow;
  spec.magnitude = r.scaling == RopeScaling::yarn ? r.attention_factor : 1.0;
  return spec;
}

optimized::PagedLayout paged_layout(const Scenario& s) {
  optimized::PagedLayout layout;
  if (s.paging) {
    layout.block_size = s.paging->block_size;
    layout.num_blocks = s.paging->num_blocks;
    layout.prefix_cache = s.paging->prefix_cache;
    layout.token_reuse = s.paging->token_reuse;
    return layout;
  }
  // A scenario without paging: vLLM's block size (4 for toy rows, so blocks still turn
  // over), a pool no step can exhaust plus a block per row for copy-on-write.
  layout.block_size = longest_row(s) >= 256 ? 16 : 4;
  std::int64_t most_rows = s.dims.batch;
  for (const Step& step : s.steps)
    if (step.op == StepOp::reorder || step.op == StepOp::reset)
      most_rows = std::max<std::int64_t>(most_rows, step.op == StepOp::reset ? *step.batch : static_cast<std::int64_t>(step.rows.size()));
  layout.num_blocks = largest_pool_need(s, layout.block_size).blocks + 2 * most_rows + 1;
  return layout;
}

CacheEntry with_poisoned_blocks(CacheEntry entry) {
  entry.make = [make = std::move(entry.make)](CacheConfig config) {
    config.poison_blocks = true;
    return make(config);
  };
  return entry;
}

CacheConfig cache_config(const Scenario& s, std::int64_t capacity) {
  CacheConfig c;
  c.layers = s.dims.layers;
  c.heads = s.dims.heads;
  c.kv_heads = s.dims.kv_heads;
  c.head_dim = s.dims.head_dim;
  c.batch = s.dims.batch;
  for (const Rope& r : s.ropes) c.ropes.push_back(rope_spec(r, s.dims.head_dim));
  if (const auto& t = s.attention.query_temperature) {  // SPEC 10.3: on the NoPE layers
    c.temperature_floor = t->floor_scale;
    c.temperature_scale = t->attn_scale;
    for (const Rope& r : s.ropes) c.temperature_layers.push_back(r.nope ? 1 : 0);
  }
  for (const std::vector<double>& layer : s.attention.sink_logits)
    c.sink_logits.emplace_back(layer.begin(), layer.end());
  c.softmax_scale = static_cast<float>(s.softmax_scale());
  for (const Policy& p : s.policies) c.policies.push_back(layer_policy(p));
  c.capacity = capacity;
  c.storage = s.kv_dtype == KvDtype::float32   ? optimized::Storage::float32
              : s.kv_dtype == KvDtype::float16 ? optimized::Storage::float16
                                               : optimized::Storage::bfloat16;
  if (s.quantized()) {
    for (int l = 0; l < s.dims.layers; ++l) {
      const KvQuant& q = s.quant(l);
      optimized::LayerQuant& formats = c.quant.emplace_back();
      if (q.k) formats.key = row_format(*q.k, q.transform);
      if (q.v) formats.value = row_format(*q.v, q.transform);
    }
    if (s.quant_rules().holds_raw())
      c.residual = optimized::Residual{s.quant_rules().residual, s.quant_rules().flush == Flush::requantize_all,
                                       s.quant_rules().prefill == PrefillRule::store,
                                       s.quant_rules().chunk_reads == ChunkReads::raw,
                                       s.quant_rules().flush == Flush::block};
  }
  c.paging = paged_layout(s);
  // Several threads wherever kvcheck runs: outputs do not depend on the count (tested), so
  // every check also runs the threaded path.
  c.threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 4);
  return c;
}

}  // namespace kvcheck
