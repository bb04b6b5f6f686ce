// What a cache under test shows after one step, whatever the source: an in-process cache
// (slot metadata and the kernel's log of visible pairs) or an external trace (tensors
// only). The one checker (step_checker.h) compares it with the reference.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "optimized/attention.h"
#include "optimized/row_codec.h"

namespace kvcheck {

// How a source says at which position each stored key is rotated.
enum class KeyPositions {
  claimed,         // per-slot metadata (in-process caches)
  cache_relative,  // Pk of the policy (traces)
  absolute,        // the token index (traces)
  unrotated,       // not rotated: position 0 (traces)
};
const char* to_string(KeyPositions p);

// When a cache drops the tokens no later query sees (SPEC 3, live set).
enum class Eviction {
  any,    // either, per row and step
  lazy,   // at the next token: the cache holds the retained set between steps
  eager,  // right after the forward: it holds the live set
  // Lazy, and after an append the cache may still hold tokens the append's queries saw that
  // no later query sees: its next update drops them (mlx-lm's RotatingKVCache keeps the
  // W - 1 tokens before a chunk beside the whole chunk).
  deferred,
  // Never: the cache keeps every token of its rows and applies the window by its mask (a
  // model over ONNX Runtime's GroupQueryAttention); a token the policy evicted may be held,
  // the retained set must be.
  never,
  // Blocks (SPEC 3.1): a sliding layer keeps its row's last L(T) tokens, a buffer of C slots
  // that evicts C - W + 1 at once (ONNX Runtime's windowed cache), exactly; the capacity C
  // is CheckOptions::block_capacity. Other layers are judged as under lazy.
  blocks,
};
const char* to_string(Eviction e);

// One slot of one kv head of one row in one layer.
struct ViewSlot {
  std::int64_t slot = -1;
  std::int64_t uid = -1;                         // -1: its values are no token's
  std::optional<std::int64_t> claimed_index;     // slot metadata, when the cache keeps it
  std::optional<std::int64_t> claimed_position;  // likewise
  const float* key = nullptr;                    // head_dim floats as stored (rotated)
  // A quantized cache's codes and scales (SPEC 9.2.1), when the source shows them.
  std::optional<optimized::UnpackedRow> key_codes, value_codes;
  bool raw = false;  // held unquantized (SPEC 9's residual): no codes, `key` in kv_dtype
};

struct ViewLayer {
  std::vector<std::vector<std::vector<ViewSlot>>> slots;  // [row][kv_head]: the slots in use
  const float* out = nullptr;                             // outputs [B, n, H, D] of an append step; null: none
  const float* q = nullptr;  // rotated queries [B, n, H, D]; null: none (in-process caches)
  double key_roundoff = 0.0;  // what the layer's key format loses (SPEC 9), beyond the view's roundoff
};

// A visible (query, key) pair as the cache used it: the integers of SPEC 5.3 (row, query
// index and position, key uid and position), as the optimized kernel logs them, so a long
// prompt's log is handed over without a copy.
using UsedPair = optimized::AttentionLogEntry;

// SPEC 8.8: a paged cache's block tables, refcounts and prefix hits after a step. The
// slots of ViewLayer are then physical: slot = block * block_size + offset, listed under
// every row whose table references the block.
struct PagedView {
  std::int64_t block_size = 0;
  struct Layer {
    std::vector<std::vector<std::int64_t>> tables;  // [row][logical block]: block id, -1 for null
    std::vector<std::int32_t> refcounts;            // [block]; empty: not reported
    // [row][j]: the slot the step wrote its j-th computed token to (the tokens after the
    // row's hit); -1 padding dropped. Empty: not reported.
    std::vector<std::vector<std::int64_t>> slot_mapping;
    // A ring of this many places (SPEC 8.9): token t at place t % ring, in entry (t % ring) / B;
    // 0: the table's entry i holds the row's logical block i.
    std::int64_t ring = 0;
    // Where token t lives: its logical index, or its place in the ring.
    std::int64_t place(std::int64_t t) const { return ring > 0 ? t % ring : t; }
  };
  std::vector<Layer> layers;
  std::vector<std::int64_t> hit_tokens;  // [row]: tokens the step's append took from the prefix index
};

// A key as a cache stored it during an append, when the source shows every store (its write,
// each shift's re-rotation): a quantized key shifted twice within one append was quantized
// three times, and the view after the step shows only the last codes.
struct KeyStore {
  int layer = 0, row = 0, kv_head = 0;
  std::int64_t uid = -1;
  std::int64_t position = 0;  // where the cache rotated it
  optimized::UnpackedRow codes;
};

struct CacheView {
  bool recorded = true;  // false: the source did not record this step (nothing to check)
  std::string note;      // why not, when the source says
  // The cache raised (or refused) at this step: its words, and a refusal's code if any.
  std::optional<std::string> error;
  std::string refusal_code;
  int batch = 0;
  bool slots_shared = false;  // one set of slot metadata for every layer and kv head
  std::vector<ViewLayer> layers;
  // Every visible pair the kernel used in layer 0, when the source logs them; without a
  // log, pairs are derived from recovered query and key positions.
  std::optional<std::vector<UsedPair>> pairs;
  std::optional<PagedView> paged;
  // Every store of a quantized key during this append, in order; empty when the source does
  // not show them (then only the codes after the step are judged).
  std::vector<KeyStore> key_stores;
  // Per row: the first tokens of this append whose outputs the cache did not compute (a
  // prefix hit took their keys and values from its index); their outputs are not compared.
  std::vector<std::int64_t> uncomputed;
  double roundoff = 0x1p-24;                // unit roundoff of the stored keys and values
  double query_roundoff = 0x1p-24;          // of the rotated queries a trace holds (never quantized)
  std::vector<std::vector<float>> storage;  // what the pointers point into, when owned
};

}  // namespace kvcheck
