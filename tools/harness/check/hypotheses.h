// What the reference would have computed under a named mistake, to tell which one a cache
// made when its outputs are off while every position is right.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "reference/reference_model.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// The output of `token`'s query head `head` in `layer` with the learned sink logits left
// out of the softmax (SPEC 7's sinks dropped), from the same visible keys and positions.
std::vector<double> output_without_learned_sinks(const Scenario& scenario, const InputTable& inputs,
                                                 std::span<const std::uint64_t> history,
                                                 const reference::AppendedToken& token, int layer, int head);

// The same with a sink of logit 0 in the softmax where the scenario has none (a 1 added to
// the denominator: ONNX Runtime's smooth_softmax).
std::vector<double> output_with_a_zero_sink(const Scenario& scenario, const InputTable& inputs,
                                            std::span<const std::uint64_t> history,
                                            const reference::AppendedToken& token, int layer, int head);

// The output of `token`'s query head without the query temperature of a NoPE layer (SPEC
// 10.3: Llama 4's attn_temperature_tuning missing), from the same visible keys.
std::vector<double> output_without_query_temperature(const Scenario& scenario, const InputTable& inputs,
                                                    std::span<const std::uint64_t> history,
                                                    const reference::AppendedToken& token, int layer, int head);

// The output of the chunk's token i with the chunk's later tokens visible too, each key at
// the position its own token's query had (a causal mask missing inside the chunk: a
// model's mask built from slot indices and cache_position over a cache that shifts).
std::vector<double> output_with_later_chunk_keys(const Scenario& scenario, const InputTable& inputs,
                                                 std::span<const std::uint64_t> history,
                                                 std::span<const reference::AppendedToken> chunk, std::size_t i,
                                                 int layer, int head);

// The output of the chunk's token i had its query attended the last W entries of what the
// cache held before the chunk (what the chunk's first token saw, itself left out) followed by
// the chunk up to token i, at original positions, instead of the sinks plus the window: a
// chunk's mask that is a plain causal window over the cache's buffer (mlx-lm's
// RotatingKVCache.make_mask with keep > 0; at a row's first chunk, simply the last W tokens).
std::vector<double> output_in_a_plain_window(const Scenario& scenario, const InputTable& inputs,
                                             std::span<const std::uint64_t> history,
                                             std::span<const reference::AppendedToken> chunk, std::size_t i,
                                             std::int64_t window, int layer, int head);

// A sliding layer's output over the last `window` tokens (own included) at their indices:
// with W + 1 or W - 1, a window counted the other way (ONNX Runtime's local_window_size
// changed from "keys before the query" to "keys seen" in 1.24).
std::vector<double> output_in_a_window_of(const Scenario& scenario, const InputTable& inputs,
                                          std::span<const std::uint64_t> history,
                                          const reference::AppendedToken& token, std::int64_t window, int layer,
                                          int head);

// A sliding layer under a sink cache's shift (SPEC 10.4) that measures its window in token
// indices (t - j < W) instead of the shifted positions: of what the sink policy shows token
// t, at those positions, the keys within W tokens; the sinks leave its view for good.
std::vector<double> output_with_window_in_token_indices(const Scenario& scenario, const InputTable& inputs,
                                                        std::span<const std::uint64_t> history,
                                                        const reference::AppendedToken& token, int layer, int head);

}  // namespace kvcheck
