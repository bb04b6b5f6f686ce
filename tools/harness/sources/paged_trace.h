// SPEC 8.9: a trace layer that dumps a paged pool. The checker rebuilds each row's slots
// from its block table and the pool (NHD [blocks, B, Hkv, D] as vLLM's FlashAttention
// backend keeps it, or HND [blocks, Hkv, B, D] as FlashInfer does), identifies every
// slot's token by its value vector, and applies SPEC 5 and 8.8 unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tools/harness/check/cache_view.h"
#include "tools/harness/sources/trace_codes.h"

namespace kvcheck {

struct PagedTraceFiles {
  std::int64_t block_size = 0;
  bool head_major = false;  // HND
  std::string key_cache, value_cache, block_table;  // required
  std::string refcount, hit_tokens;                 // optional: [blocks], [rows]
  std::string slot_mapping;                         // optional: [rows, tokens], the step's computed tokens
  std::string block_ids;  // optional: [k], the blocks the pools' k rows hold (only those dumped)
  // optional (SPEC 8.9): a ring of `ring` places (token t at place t % ring, in slot
  // table[p / B] * B + p % B); 0: the table is the row's logical blocks.
  std::int64_t ring = 0;
  // SPEC 9.3, optional: codes in the pool's layout, scales and zero points per group; a
  // tensor with codes may leave its float pool out (key_cache or value_cache then empty).
  CodeFiles codes;
};

// Which uid row `row`'s slot of kv head g holds, from its value vector (-1: none).
using IdentifyValue = std::function<std::int64_t(std::size_t row, int kv_head, const float* value)>;

// Reads one layer's pool and tables into `layer` (the slots each row's table reaches, slot =
// block * B + offset) and paged.layers[index]; the first layer's hits into paged.hit_tokens.
// Throws InputError naming the file for a shape, dtype or block id that does not fit.
// Slots past a row's length (`lengths`, the reference's) are left out: a block is not zeroed
// when it is reused, and no query reads them.
// `quant` is the scenario's kv_quant (null: none): how the pool's codes read.
void read_paged_layer(const PagedTraceFiles& files, const std::vector<std::size_t>& lengths, std::size_t kv_heads,
                      std::size_t head_dim, const KvQuant* quant, const IdentifyValue& identify, ViewLayer& layer,
                      PagedView& paged, std::size_t index, std::vector<std::vector<float>>& storage, double& roundoff);

}  // namespace kvcheck
