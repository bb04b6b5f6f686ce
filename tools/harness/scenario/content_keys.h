// Token ids and context keys (SPEC 8.1). With content "prefix" a token's vectors come from
// its context key c_t = mix(c_(t-1), id_t), with c_(-1) = the row's key from the seed and
// its extras, so two rows with equal ids and extras hold bit-identical keys and values at
// the same index (a prefix hit is exact) and anything else differs. The README gives the
// formulas in Python.
#pragma once

#include <cstdint>
#include <string>

#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// mix(a, b) = splitmix64(a ^ splitmix64(b)).
std::uint64_t context_mix(std::uint64_t a, std::uint64_t b);
// FNV-1a 64 of the bytes of `text`.
std::uint64_t string_key(const std::string& text);
// c_(-1) of a row: mix(mix(splitmix64(seed), string_key("adapter:" + adapter)),
// string_key("salt:" + salt)); the tags keep adapter "X" and salt "X" apart.
std::uint64_t row_context(std::uint64_t seed, const RowExtras& extras);
// The id of a token the scenario does not name (a decode): splitmix64(splitmix64(seed) ^ uid) >> 33.
std::uint64_t generated_token_id(std::uint64_t seed, std::uint64_t uid);

// Fills scenario.token_ids and context_keys (content "prefix") and every append step's
// `extras` by walking the steps as the rows evolve (reorder, reset, crop, free).
void assign_content_keys(Scenario& scenario);

// The id and context key of a uid: the uid itself under content "uid".
inline std::uint64_t token_id(const Scenario& s, std::uint64_t uid) {
  return s.token_ids.empty() ? uid : s.token_ids[static_cast<std::size_t>(uid)];
}
inline std::uint64_t context_key(const Scenario& s, std::uint64_t uid) {
  return s.context_keys.empty() ? uid : s.context_keys[static_cast<std::size_t>(uid)];
}

}  // namespace kvcheck
