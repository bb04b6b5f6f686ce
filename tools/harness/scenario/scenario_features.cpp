#include "tools/harness/scenario/scenario_features.h"

#include <algorithm>

namespace kvcheck {

const char* to_string(Feature f) {
  switch (f) {
    case Feature::left_padding:
      return "left_padding";
    case Feature::reorder:
      return "reorder";
    case Feature::crop:
      return "crop";
    case Feature::refused_step:
      return "refused_step";
    case Feature::reset:
      return "reset";
    case Feature::per_layer_policy:
      return "per_layer_policy";
    case Feature::learned_sinks:
      return "learned_sinks";
    case Feature::rope_scaling:
      return "rope_scaling";
    case Feature::partial_rotary:
      return "partial_rotary";
    case Feature::interleaved_rope:
      return "interleaved_rope";
    case Feature::half_precision:
      return "half_precision";
    case Feature::dense_prefill:
      return "dense_prefill";
    case Feature::original_positions:
      return "original_positions";
    case Feature::evict_block:
      return "evict_block";
    case Feature::gqa:
      return "gqa";
    case Feature::paged:
      return "paged";
    case Feature::quantized:
      return "quantized";
    case Feature::per_layer_quant:
      return "per_layer_quant";
  }
  return "?";
}

const std::vector<Feature>& all_features() {
  static const std::vector<Feature> all = {
      Feature::left_padding,       Feature::reorder,         Feature::crop,
      Feature::refused_step,       Feature::reset,           Feature::per_layer_policy,
      Feature::learned_sinks,      Feature::rope_scaling,    Feature::partial_rotary,
      Feature::interleaved_rope,   Feature::half_precision,  Feature::dense_prefill,
      Feature::original_positions, Feature::evict_block,     Feature::gqa,
      Feature::quantized,          Feature::per_layer_quant, Feature::paged};
  return all;
}

std::vector<Feature> scenario_features(const Scenario& s) {
  auto has_op = [&](StepOp op) {
    return std::any_of(s.steps.begin(), s.steps.end(), [&](const Step& step) { return step.op == op; });
  };
  auto any_policy = [&](auto predicate) {
    return std::any_of(s.layer_policies.begin(), s.layer_policies.end(), predicate);
  };
  std::vector<Feature> f;
  auto add = [&](Feature feature, bool present) {
    if (present) f.push_back(feature);
  };
  add(Feature::left_padding, std::any_of(s.steps.begin(), s.steps.end(), [](const Step& step) {
        return step.op == StepOp::append &&
               std::adjacent_find(step.tokens.begin(), step.tokens.end(), std::not_equal_to<>()) != step.tokens.end();
      }));
  add(Feature::reorder, has_op(StepOp::reorder));
  add(Feature::crop, has_op(StepOp::crop));
  add(Feature::refused_step,
      std::any_of(s.steps.begin(), s.steps.end(), [](const Step& step) { return !step.expect_error.empty(); }));
  add(Feature::reset, has_op(StepOp::reset));
  add(Feature::per_layer_policy, s.hybrid());
  add(Feature::learned_sinks, !s.attention.sink_logits.empty());
  add(Feature::rope_scaling, s.rope.scaling != RopeScaling::none);
  add(Feature::partial_rotary, s.rope.rotary_dim != 0 && s.rope.rotary_dim < s.dims.head_dim);
  add(Feature::interleaved_rope, s.rope.layout == RopeLayout::interleaved);
  add(Feature::half_precision, s.kv_dtype != KvDtype::float32);
  add(Feature::dense_prefill, any_policy([](const Policy& p) { return p.prefill == Prefill::dense; }));
  add(Feature::original_positions, any_policy([](const Policy& p) {
        return p.kind == PolicyKind::sink && p.positions == SinkPositions::original;
      }));
  add(Feature::evict_block, any_policy([](const Policy& p) { return p.kind == PolicyKind::sink && p.evict > 1; }));
  add(Feature::gqa, s.dims.kv_heads < s.dims.heads);
  add(Feature::quantized, s.kv_quant.has_value());
  add(Feature::per_layer_quant, s.mixed_quant());
  add(Feature::paged, s.paging || s.content == Content::prefix || has_op(StepOp::free_rows) ||
                          has_op(StepOp::preempt) ||
                          has_op(StepOp::evict) || std::any_of(s.steps.begin(), s.steps.end(), [](const Step& step) {
                            return step.chunk > 0;
                          }));
  return f;
}

}  // namespace kvcheck
