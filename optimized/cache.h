// The small interface every optimized cache implements: a raw chunk in, attention output
// and a view of the slots out. Each cache pairs its storage with the attention that reads it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "optimized/attention.h"
#include "optimized/frozen_scales.h"
#include "optimized/rope_table.h"
#include "optimized/slot_store.h"

namespace kvcheck::optimized {

// One layer's policy in a hybrid stack (SPEC 7: Gemma's and gpt-oss's sliding and full layers).
struct LayerPolicy {
  enum class Kind { full, sliding, sink, chunked } kind = Kind::full;
  std::int64_t window = 0;      // sliding: keys visible; sink: capacity W; chunked: the chunk C
  std::int64_t sinks = 0;       // sink: S
  std::int64_t evict = 1;       // sink: tokens dropped at once when full
  bool shift_positions = true;  // sink: cache-relative positions (false: original ones)
  bool dense_prefill = false;   // sink: a chunk is one dense forward, trimmed afterwards
  std::int64_t swa = 0;         // sink: SPEC 10.4's sliding window inside it (Pq - Pk < swa); 0: none
  bool operator==(const LayerPolicy&) const = default;
};

// SPEC 8: keys and values in a pool of blocks with a table per row (the `paged` cache).
struct PagedLayout {
  std::int64_t block_size = 16;
  std::int64_t num_blocks = 0;  // per layer
  bool prefix_cache = false;    // full blocks stay reusable by rows with the same prefix
  bool token_reuse = false;     // a hit may end inside a block, whose matching slots are copied
};

// SPEC 9's residual: the newest tokens of a row held unquantized beside the codes, and when
// they are quantized.
struct Residual {
  std::int64_t tokens = 0;       // R
  bool requantize_all = false;   // once R are raw, everything quantized again (Hugging Face); else each once, as it leaves
  bool prefill_store = true;     // a row's first append quantized at once
  bool chunk_reads_raw = false;  // the queries read the chunk raw and the flush comes after them; else before
  bool blocks = false;           // once R are raw, the oldest whole multiple of R quantized together (KIVI)
};

// One layer's quantized formats (SPEC 9); an absent one is stored in the float storage.
struct LayerQuant {
  std::optional<RowFormat> key, value;
};

struct CacheConfig {
  int layers = 1, heads = 1, kv_heads = 1, head_dim = 2;
  int batch = 1;
  std::vector<RopeSpec> ropes;  // one per layer (SPEC 10.1)
  float softmax_scale = 1.0f;
  // One per layer: what each keeps (SPEC 3, 7). A cache of one policy (sliding, sink_*) takes
  // the one they share (shared_policy); the hybrid and paged caches read each layer's.
  std::vector<LayerPolicy> policies;
  std::int64_t capacity = 0;                    // static: slots per row
  int threads = 1;                              // attention threads (results do not depend on it)
  Storage storage = Storage::float32;           // how keys and values are stored (SPEC 7, kv_dtype)
  std::vector<LayerQuant> quant;                // quantized instead (SPEC 9): per layer; empty: nothing is
  std::vector<std::vector<float>> sink_logits;  // learned sink logit per layer and query head; empty: none
  // SPEC 10.3: a query temperature on the layers marked in temperature_layers (Llama 4's NoPE
  // layers); temperature_floor 0: none.
  std::int64_t temperature_floor = 0;
  double temperature_scale = 0.0;
  std::vector<char> temperature_layers;
  std::optional<PagedLayout> paging;            // the paged cache's pool
  std::optional<Residual> residual;             // quantized stores holding some tokens raw (SPEC 9)
  bool poison_blocks = false;                   // paged: new and freed blocks hold marked NaNs (poison.h)
};

// Layer l's policy. std::invalid_argument unless `policies` has one per layer.
const LayerPolicy& layer_policy(const CacheConfig& config, int layer);
// The policy every layer has. std::invalid_argument when the layers' differ (a cache of one
// policy cannot serve a hybrid stack) or `policies` has not one per layer.
const LayerPolicy& shared_policy(const CacheConfig& config);
// Gives every layer the policy p.
inline void set_every_layer(CacheConfig& config, const LayerPolicy& p) {
  config.policies.assign(static_cast<std::size_t>(config.layers), p);
}
// The rope every layer has. std::invalid_argument when the layers' differ (a cache with one
// cos/sin table cannot serve them) or `ropes` has not one per layer.
const RopeSpec& shared_rope(const CacheConfig& config);
// Gives every layer the rope r.
inline void set_every_layer_rope(CacheConfig& config, const RopeSpec& r) {
  config.ropes.assign(static_cast<std::size_t>(config.layers), r);
}

// What a row carries besides its tokens (SPEC 8.1): a prefix may be reused only under the
// same adapter and salt.
struct RowExtras {
  std::string adapter, salt;
};

// New tokens for every row, left-padded to the longest. Raw (unrotated) q/k/v per layer:
// q [B, n, H, D], k and v [B, n, Hkv, D]. Padding entries are never read.
struct Chunk {
  std::int64_t length = 0;            // n
  std::vector<std::int64_t> counts;   // real tokens per row
  std::vector<std::int64_t> uids;     // [B, n]; -1 where padded
  std::vector<const float*> q, k, v;  // per layer
  // Paged caches (SPEC 8): token ids [B, n] (a prefix index keys blocks by them), each
  // row's extras, and the forward size of a chunked prefill (0: one forward).
  std::vector<std::uint64_t> ids;
  std::vector<RowExtras> extras;
  std::int64_t forward = 0;
  // Called between two forwards of a chunked prefill, once every row has run the same
  // number of them: the cache's view then shows the state the next forward starts from, so
  // a checker can take each forward as a step (SPEC 8.7). Empty: nobody looks.
  std::function<void()> between_forwards;
  // Called after a cache that re-rotates kept keys stores a key (its write, and each shift's
  // re-rotation) in layer, row, kv head and slot, rotated to `position`. A quantized key
  // shifted twice in one append is re-quantized each time, and only the last codes are left
  // for a view: a checker reads the others here. Empty: nobody looks.
  std::function<void(int layer, int row, int kv_head, std::int64_t slot, std::int64_t position)> key_stored;
};

// A step the cache must refuse; `code` is what a scenario names in `expect_error`.
struct CacheRefusal : std::runtime_error {
  std::string code;
  CacheRefusal(std::string code_, const std::string& message) : std::runtime_error(message), code(std::move(code_)) {}
};

struct PagedState;

class KvCache {
 public:
  virtual ~KvCache() = default;
  // Writes the output of every real token to out[layer] ([B, n, H, D]); records every
  // visible pair of layer 0 in `log` when it is not null. With `out` empty the chunk only
  // enters the cache and no attention runs (restoring a saved prefix; filling a cache
  // before a benchmark).
  virtual void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) = 0;
  virtual void reorder(const std::vector<int>& rows) = 0;
  virtual void reset(int batch) = 0;
  virtual void crop(std::int64_t length) = 0;
  // SPEC 11: every row keeps its first `sinks` and last `recent` tokens; with `rerotate`
  // the kept keys move to positions in the cache. Only a cache whose catalog entry serves
  // prune implements it.
  virtual void prune(std::int64_t sinks, std::int64_t recent, bool rerotate);
  // Those rows end (SPEC 8.7): they become empty and may start again.
  virtual void free_rows(const std::vector<int>& rows);
  // Drops `blocks` cached blocks (every one when negative); nothing to do unless paged.
  virtual void evict(std::int64_t blocks) { (void)blocks; }
  // SPEC 8.6: the rows give up their memory: swapped out whole, or freed to be recomputed.
  // A cache that keeps everything in place does nothing.
  virtual void preempt(const std::vector<int>& rows, bool recompute) {
    (void)rows;
    (void)recompute;
  }
  // They come back: swapped in, or, after a recompute, rebuilt from `history` (every token
  // of each resumed row, raw, as a chunk with no outputs; other rows take none).
  virtual void resume(const std::vector<int>& rows, const Chunk* history) {
    (void)rows;
    (void)history;
  }

  // Throws CacheRefusal when crop(length) would be refused; changes nothing.
  virtual void check_crop(std::int64_t length) const { (void)length; }

  // The view: every slot's uid, token index, position and stored key and value.
  virtual const SlotStore& slots() const = 0;
  // One layer's slots: slots() for every layer, except in a cache whose layers differ.
  virtual const SlotStore& layer_slots(int layer) const {
    (void)layer;
    return slots();
  }
  virtual std::int64_t row_length(int row) const = 0;
  virtual int batch() const { return slots().batch(); }
  // A paged cache's tables, pool and prefix hits (SPEC 8.8); null for the others.
  virtual const PagedState* paged() const { return nullptr; }
};

// ---- Pieces the caches share ----

// The formats a cache of this configuration stores keys and values in, per layer.
std::vector<LayerFormats> store_formats(const CacheConfig& c);

// E(t) for a sink cache of capacity W with S sinks evicting k at a time.
std::int64_t sink_evicted(std::int64_t window, std::int64_t evict, std::int64_t t);

// Stores chunk token (row, chunk_pos) in `slot` of `store` with its key rotated to
// meta.position (every layer, every kv head), quantized with row `row`'s frozen scales when
// `frozen` has them.
void store_token(SlotStore& store, const RopeTable& rope, const Chunk& chunk, int row, std::int64_t chunk_pos,
                 std::int64_t slot, const SlotMeta& meta, const FrozenScales* frozen = nullptr);

// The residual's rule for `row` once its chunk is written (see Residual): the oldest raw
// tokens beyond R quantized, or, once R are raw, every token quantized (again).
void flush_residual(SlotStore& store, int row, const Residual& rule, bool first_append);

// The first token index in [begin, end) that `row` does not hold, or -1.
std::int64_t first_missing_index(const SlotStore& store, int row, std::int64_t begin, std::int64_t end);

// Empties every slot of `row` whose token index is >= length (a crop).
void drop_from(SlotStore& store, int row, std::int64_t length);

// Makes `rope` cover every position a chunk can need: no position exceeds a token index,
// and no row holds more than the longest row after the chunk.
void cover_chunk(RopeTable& rope, const std::vector<std::int64_t>& lengths, const Chunk& chunk);

// Runs the attention of `row`'s planned queries in every layer, reading `sources`, and
// writes their outputs into out[layer]; layer 0's visible pairs go to `log`.
void attend_all_layers(const CacheConfig& config, AttentionKernel& kernel, const RopeTable& rope, const Chunk& chunk,
                       const std::vector<float*>& out, int row, std::span<const PlannedQuery> plans,
                       std::span<const SlotSource> sources, AttentionLog* log);

// Refuses (CacheRefusal "crop_evicted") a crop of `row` to `length` tokens when the row
// no longer holds a token the cropped row's last token needs: its first min(S, length)
// sinks and its window S + E(length - 1) .. length - 1. A sliding window is S = 0, k = 1.
void refuse_crop_if_evicted(const SlotStore& store, int row, std::int64_t length, std::int64_t sinks,
                            std::int64_t window, std::int64_t evict);

// Per-row state after a beam reorder: new row b takes old row rows[b]'s.
template <class T>
std::vector<T> gather(const std::vector<T>& per_row, const std::vector<int>& rows) {
  std::vector<T> out;
  out.reserve(rows.size());
  for (int r : rows) out.push_back(per_row[static_cast<std::size_t>(r)]);
  return out;
}

}  // namespace kvcheck::optimized
