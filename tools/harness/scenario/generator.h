// Deterministic inputs from integer arithmetic only (SPEC 6): a splitmix64 hash chained
// over (seed, layer, uid, tensor, head, dim). The README gives the same formula in Python.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/model.h"

namespace kvcheck {

enum class Tensor : std::uint64_t { q = 0, k = 1, v = 2 };

// The splitmix64 finalizer applied to z + golden gamma.
std::uint64_t splitmix64(std::uint64_t z);

// A value in [-1, 1) with 24 significant bits, so it is exact in float32.
float generated_value(std::uint64_t seed, int layer, std::uint64_t uid, Tensor tensor, int head, int dim);

// Fills q, k, v for uids 0 .. uids-1; with `content_keys` (SPEC 8.1, one per uid) uid u's
// vectors are generated from content_keys[u] in place of u. The table's layer l holds the
// values of layer first_layer + l: a slice of a deeper model's table, bit for bit.
InputTable generate_inputs(const Dims& dims, std::int64_t uids, std::uint64_t seed,
                           const std::vector<std::uint64_t>& content_keys = {}, int first_layer = 0);

}  // namespace kvcheck
