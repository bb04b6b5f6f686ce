// What a scenario exercises beyond its policy, as named features: `kvcheck list` filters on
// them (and kvtrace through it), so a user can tell which fixtures a cache can run.
#pragma once

#include <string>
#include <vector>

#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

enum class Feature {
  left_padding,        // an append gives rows different token counts
  reorder,             // beam reorder, fork, batch change through reorder
  crop,                // crop (accepted or refused)
  refused_step,        // a step the policy must refuse (expect_error)
  reset,               // a new generation in the same cache
  per_layer_policy,    // policy is a list that differs between layers (SPEC 7)
  learned_sinks,       // attention.sink_logits (SPEC 7)
  rope_scaling,        // linear, llama3 or yarn
  partial_rotary,      // rotary_dim < head_dim
  interleaved_rope,    // the GPT-J / llama.cpp NORM layout
  half_precision,      // kv_dtype float16 or bfloat16
  dense_prefill,       // sink prefill "dense"
  original_positions,  // sink positions "original"
  evict_block,         // sink evict > 1 (llama.cpp's context shift)
  gqa,                 // kv_heads < heads
  quantized,           // kv_quant (SPEC 9): codes and scales, not floats
  per_layer_quant,     // kv_quant is a list whose layers quantize differently (SPEC 9)
  paged,               // SPEC 8: paging, content "prefix", free/evict, chunked or id-given appends
  per_layer_rope,      // rope is a list that differs between layers (SPEC 10.1)
  nope_layer,          // a NoPE layer: no rotation (SPEC 10.1)
  chunked,             // a chunked attention layer (SPEC 10.2)
  query_temperature,   // attention.query_temperature (SPEC 10.3)
  sliding_under_shift,  // a sliding layer under a sink layer's shift (SPEC 10.4)
  prune,               // a one-time prune to sinks and recent tokens (SPEC 11)
};

const char* to_string(Feature f);
// Every feature, in the enum's order (for help texts and validation).
const std::vector<Feature>& all_features();
// The scenario's features, in the enum's order.
std::vector<Feature> scenario_features(const Scenario& scenario);

}  // namespace kvcheck
