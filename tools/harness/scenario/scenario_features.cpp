#include "tools/harness/scenario/scenario_features.h"

#include <algorithm>
#include <iterator>

#include "reference/enum_names.h"

namespace kvcheck {

namespace {
// Every feature with its name, in the enum's order.
constexpr EnumName<Feature> kFeatureNames[] = {
    {Feature::left_padding, "left_padding"},
    {Feature::reorder, "reorder"},
    {Feature::crop, "crop"},
    {Feature::refused_step, "refused_step"},
    {Feature::reset, "reset"},
    {Feature::per_layer_policy, "per_layer_policy"},
    {Feature::learned_sinks, "learned_sinks"},
    {Feature::rope_scaling, "rope_scaling"},
    {Feature::partial_rotary, "partial_rotary"},
    {Feature::interleaved_rope, "interleaved_rope"},
    {Feature::half_precision, "half_precision"},
    {Feature::dense_prefill, "dense_prefill"},
    {Feature::original_positions, "original_positions"},
    {Feature::evict_block, "evict_block"},
    {Feature::gqa, "gqa"},
    {Feature::quantized, "quantized"},
    {Feature::per_layer_quant, "per_layer_quant"},
    {Feature::paged, "paged"},
    {Feature::per_layer_rope, "per_layer_rope"},
    {Feature::nope_layer, "nope_layer"},
    {Feature::chunked, "chunked"},
    {Feature::query_temperature, "query_temperature"},
    {Feature::sliding_under_shift, "sliding_under_shift"},
    {Feature::prune, "prune"},
};
static_assert(std::size(kFeatureNames) == static_cast<std::size_t>(Feature::prune) + 1,
              "a feature without a name");
}  // namespace

const char* to_string(Feature f) { return name_in(kFeatureNames, f); }

const std::vector<Feature>& all_features() {
  static const std::vector<Feature> all = [] {
    std::vector<Feature> features;
    for (const EnumName<Feature>& row : kFeatureNames) features.push_back(row.value);
    return features;
  }();
  return all;
}

std::vector<Feature> scenario_features(const Scenario& s) {
  auto has_op = [&](StepOp op) {
    return std::any_of(s.steps.begin(), s.steps.end(), [&](const Step& step) { return step.op == op; });
  };
  auto any_policy = [&](auto predicate) {
    return std::any_of(s.policies.begin(), s.policies.end(), predicate);
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
  add(Feature::prune, has_op(StepOp::prune));
  add(Feature::refused_step,
      std::any_of(s.steps.begin(), s.steps.end(), [](const Step& step) { return !step.expect_error.empty(); }));
  add(Feature::reset, has_op(StepOp::reset));
  add(Feature::per_layer_policy, s.hybrid());
  add(Feature::learned_sinks, !s.attention.sink_logits.empty());
  auto any_rope = [&](auto pred) { return std::any_of(s.ropes.begin(), s.ropes.end(), pred); };
  add(Feature::rope_scaling, any_rope([](const Rope& r) { return !r.nope && r.scaling != RopeScaling::none; }));
  add(Feature::partial_rotary, any_rope([&](const Rope& r) {
        return !r.nope && r.rotary_dim != 0 && r.rotary_dim < s.dims.head_dim;
      }));
  add(Feature::interleaved_rope, any_rope([](const Rope& r) { return !r.nope && r.layout == RopeLayout::interleaved; }));
  add(Feature::half_precision, s.kv_dtype != KvDtype::float32);
  add(Feature::dense_prefill, any_policy([](const Policy& p) { return p.prefill == Prefill::dense; }));
  add(Feature::original_positions, any_policy([](const Policy& p) {
        return p.kind == PolicyKind::sink && p.positions == SinkPositions::original;
      }));
  add(Feature::evict_block, any_policy([](const Policy& p) { return p.kind == PolicyKind::sink && p.evict > 1; }));
  add(Feature::gqa, s.dims.kv_heads < s.dims.heads);
  add(Feature::quantized, s.quantized());
  add(Feature::per_layer_quant, s.mixed_quant());
  add(Feature::paged, s.paging || s.content == Content::prefix || has_op(StepOp::free_rows) ||
                          has_op(StepOp::preempt) ||
                          has_op(StepOp::evict) || std::any_of(s.steps.begin(), s.steps.end(), [](const Step& step) {
                            return step.chunk > 0;
                          }));
  add(Feature::per_layer_rope, !s.shared_rope());
  add(Feature::nope_layer, any_rope([](const Rope& r) { return r.nope; }));
  add(Feature::chunked, any_policy([](const Policy& p) { return p.kind == PolicyKind::chunked; }));
  add(Feature::query_temperature, s.attention.query_temperature.has_value());
  add(Feature::sliding_under_shift, any_policy([](const Policy& p) { return p.swa > 0; }));
  return f;
}

}  // namespace kvcheck
