#include "tools/harness/hypotheses.h"

#include "reference/attention.h"
#include "reference/rope.h"

namespace kvcheck {

std::vector<double> output_without_learned_sinks(const Scenario& s, const InputTable& inputs,
                                                 std::span<const std::uint64_t> history,
                                                 const reference::AppendedToken& token, int layer, int head) {
  const int D = s.dims.head_dim, group = head / (s.dims.heads / s.dims.kv_heads);
  const auto rotated = [&](const float* x, std::int64_t position) {
    return reference::rotate(std::vector<double>(x, x + D), static_cast<double>(position), s.rope);
  };
  const reference::QueryView& view = token.view_in(layer);
  const std::vector<double> q = rotated(inputs.q_at(layer, token.uid, head), view.query_position);
  std::vector<double> keys, values;
  for (const reference::VisibleKey& key : view.keys) {
    const std::uint64_t uid = history[static_cast<std::size_t>(key.index)];
    const std::vector<double> k = rotated(inputs.k_at(layer, uid, group), key.position);
    keys.insert(keys.end(), k.begin(), k.end());
    const float* v = inputs.v_at(layer, uid, group);
    values.insert(values.end(), v, v + D);
  }
  std::vector<double> scores(view.keys.size()), out(static_cast<std::size_t>(D));
  reference::attend(q.data(), keys.data(), values.data(), view.keys.size(), static_cast<std::size_t>(D),
                    s.softmax_scale(), nullptr, scores.data(), out.data());
  return out;
}

}  // namespace kvcheck
