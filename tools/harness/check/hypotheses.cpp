#include "tools/harness/check/hypotheses.h"

#include <algorithm>

#include "reference/attention.h"
#include "reference/policy.h"
#include "reference/rope.h"

namespace kvcheck {
namespace {

struct KeyAt {
  std::uint64_t uid;
  std::int64_t position;
};

// One query head's attention in double over the given keys at the given positions.
// The query temperature (SPEC 10.3) applies unless `temperature` is false.
std::vector<double> attend_over(const Scenario& s, const InputTable& inputs, int layer, int head, std::uint64_t query,
                                std::int64_t query_position, const std::vector<KeyAt>& keys_at, bool learned_sinks,
                                bool temperature = true, const double* sink_logit = nullptr) {
  const int D = s.dims.head_dim, group = head / (s.dims.heads / s.dims.kv_heads);
  const auto rotated = [&](const float* x, std::int64_t position) {
    return reference::rotate(std::vector<double>(x, x + D), static_cast<double>(position), s.rope(layer));
  };
  std::vector<double> q = rotated(inputs.q_at(layer, query, head), query_position);
  if (temperature && s.attention.query_temperature && s.rope(layer).nope)
    for (double& x : q) x *= reference::query_temperature(*s.attention.query_temperature, query_position);
  std::vector<double> keys, values;
  for (const KeyAt& key : keys_at) {
    const std::vector<double> k = rotated(inputs.k_at(layer, key.uid, group), key.position);
    keys.insert(keys.end(), k.begin(), k.end());
    const float* v = inputs.v_at(layer, key.uid, group);
    values.insert(values.end(), v, v + D);
  }
  const double* sink = sink_logit;
  if (learned_sinks && !s.attention.sink_logits.empty())
    sink = &s.attention.sink_logits[static_cast<std::size_t>(layer)][static_cast<std::size_t>(head)];
  std::vector<double> scores(keys_at.size()), out(static_cast<std::size_t>(D));
  reference::attend(q.data(), keys.data(), values.data(), keys_at.size(), static_cast<std::size_t>(D),
                    s.softmax_scale(), sink, scores.data(), out.data());
  return out;
}

std::vector<KeyAt> visible_keys(std::span<const std::uint64_t> history, const reference::QueryView& view) {
  std::vector<KeyAt> keys;
  for (const reference::VisibleKey& key : view.keys)
    keys.push_back({history[static_cast<std::size_t>(key.index)], key.position});
  return keys;
}

}  // namespace

std::vector<double> output_without_learned_sinks(const Scenario& s, const InputTable& inputs,
                                                 std::span<const std::uint64_t> history,
                                                 const reference::AppendedToken& token, int layer, int head) {
  const reference::QueryView& view = token.view_in(layer);
  return attend_over(s, inputs, layer, head, token.uid, view.query_position, visible_keys(history, view), false);
}

std::vector<double> output_with_a_zero_sink(const Scenario& s, const InputTable& inputs,
                                            std::span<const std::uint64_t> history,
                                            const reference::AppendedToken& token, int layer, int head) {
  const reference::QueryView& view = token.view_in(layer);
  static const double zero = 0.0;
  return attend_over(s, inputs, layer, head, token.uid, view.query_position, visible_keys(history, view), false, true,
                     &zero);
}

std::vector<double> output_without_query_temperature(const Scenario& s, const InputTable& inputs,
                                                    std::span<const std::uint64_t> history,
                                                    const reference::AppendedToken& token, int layer, int head) {
  const reference::QueryView& view = token.view_in(layer);
  return attend_over(s, inputs, layer, head, token.uid, view.query_position, visible_keys(history, view), true, false);
}

std::vector<double> output_with_later_chunk_keys(const Scenario& s, const InputTable& inputs,
                                                 std::span<const std::uint64_t> history,
                                                 std::span<const reference::AppendedToken> chunk, std::size_t i,
                                                 int layer, int head) {
  const reference::QueryView& view = chunk[i].view_in(layer);
  std::vector<KeyAt> keys = visible_keys(history, view);
  for (std::size_t later = i + 1; later < chunk.size(); ++later)
    keys.push_back({chunk[later].uid, chunk[later].view_in(layer).query_position});
  return attend_over(s, inputs, layer, head, chunk[i].uid, view.query_position, keys, true);
}

std::vector<double> output_in_a_plain_window(const Scenario& s, const InputTable& inputs,
                                             std::span<const std::uint64_t> history,
                                             std::span<const reference::AppendedToken> chunk, std::size_t i,
                                             std::int64_t window, int layer, int head) {
  std::vector<KeyAt> buffer;  // the cache's buffer in token order: what it held, then the chunk
  for (const reference::VisibleKey& key : chunk[0].view_in(layer).keys)
    if (key.index != chunk[0].index) buffer.push_back({history[static_cast<std::size_t>(key.index)], key.index});
  for (std::size_t c = 0; c <= i; ++c) buffer.push_back({chunk[c].uid, chunk[c].index});
  const std::size_t from = buffer.size() > static_cast<std::size_t>(window) ? buffer.size() - window : 0;
  const std::vector<KeyAt> keys(buffer.begin() + static_cast<std::ptrdiff_t>(from), buffer.end());
  return attend_over(s, inputs, layer, head, chunk[i].uid, chunk[i].index, keys, true);
}

std::vector<double> output_in_a_window_of(const Scenario& s, const InputTable& inputs,
                                          std::span<const std::uint64_t> history,
                                          const reference::AppendedToken& token, std::int64_t window, int layer,
                                          int head) {
  std::vector<KeyAt> keys;  // a sliding layer's: the last `window` tokens, own included, at their indices
  for (std::int64_t j = std::max<std::int64_t>(0, token.index - window + 1); j <= token.index; ++j)
    keys.push_back({history[static_cast<std::size_t>(j)], j});
  return attend_over(s, inputs, layer, head, token.uid, token.index, keys, true);
}

std::vector<double> output_with_window_in_token_indices(const Scenario& s, const InputTable& inputs,
                                                        std::span<const std::uint64_t> history,
                                                        const reference::AppendedToken& token, int layer, int head) {
  Policy shifted = s.policies[static_cast<std::size_t>(layer)];
  const std::int64_t window = shifted.swa;
  shifted.swa = 0;  // the sink policy's own view: what the cache retains, at its positions
  const reference::QueryView view = reference::streaming_view(shifted, token.index);
  std::vector<KeyAt> keys;
  for (const reference::VisibleKey& key : view.keys)
    if (token.index - key.index < window) keys.push_back({history[static_cast<std::size_t>(key.index)], key.position});
  return attend_over(s, inputs, layer, head, token.uid, view.query_position, keys, true);
}

}  // namespace kvcheck
