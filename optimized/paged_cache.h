// A paged cache as vLLM keeps one (SPEC 8): per layer a pool of blocks of B slots, a block
// table per row (token t lives in slot table[t / B] * B + t % B), refcounts, copy-on-write
// when a row writes into a block another row references, a prefix index over full blocks
// keyed by the chain of token ids and the row's extras (LRU eviction of blocks no row
// references), window freeing on sliding layers, and chunked prefill; under reuse "token" a
// hit may end inside a block, whose matching slots are copied. Keys are rotated
// once, at their token index, under every policy: a sink layer rotates the query twice, as
// sink_ring does (sink_ring_cache.h), so no key is re-rotated when its window moves, a
// shared or hit block stays valid at any eviction count, and the blocks lying wholly
// between the sinks and the window are freed.
//
// A step is scheduled, then run, as an engine batches it: first, row by row, a starting row
// takes its prefix hit and every row gets the blocks its new tokens need; then each row's
// forwards run; full blocks enter the prefix index only after the forward that wrote them.
// Slots are mapped (their metadata written) when the step is scheduled, as an engine's slot
// mapping is; each forward writes its tokens' keys and values.
// The attention reads K and V through the table: each table entry is one source of B
// contiguous slots per kv head.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "optimized/block_pool.h"
#include "optimized/cache.h"
#include "optimized/poison.h"

namespace kvcheck::optimized {

// What a checker reads of a paged cache (SPEC 8.8): per layer the pool, the block tables
// and the refcounts; per row the prefix hit of the last append. Views of the cache's own
// state, valid until it next changes: nothing is copied at each step.
struct PagedState {
  std::int64_t block_size = 0;
  struct Layer {
    const SlotStore* pool = nullptr;                      // one row: block b's slots are b * B .. b * B + B - 1
    std::span<const std::vector<std::int64_t>> tables;  // [row][logical block]: block id, -1 for null
    std::span<const std::int32_t> refcounts;            // [block]
  };
  std::vector<Layer> layers;
  std::span<const std::int64_t> hit_tokens;  // [row], the last append's
};

class PagedCache : public KvCache {
 public:
  explicit PagedCache(const CacheConfig& config);

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override;
  void reorder(const std::vector<int>& rows) override;
  void reset(int batch) override;
  void crop(std::int64_t length) override;
  void check_crop(std::int64_t length) const override;
  void free_rows(const std::vector<int>& rows) override;
  void evict(std::int64_t blocks) override;
  void preempt(const std::vector<int>& rows, bool recompute) override;
  void resume(const std::vector<int>& rows, const Chunk* history) override;
  const SlotStore& slots() const override { return pools_[0]; }
  const SlotStore& layer_slots(int layer) const override { return pools_[static_cast<std::size_t>(layer)]; }
  std::int64_t row_length(int row) const override { return lengths_[static_cast<std::size_t>(row)]; }
  int batch() const override { return static_cast<int>(lengths_.size()); }
  const PagedState* paged() const override;
  std::int64_t block_size() const { return paging_.block_size; }

 protected:
  // The decisions a paged cache makes, one function each, so the zoo's mutants can make
  // them wrongly (tools/zoo/paged_faulty_cache.h).

  // The prefix-index key of a full block: the previous block's key, the block's ids, the
  // row's extras (only the first block mixes them in, tagged).
  virtual std::uint64_t block_key(std::uint64_t previous, std::span<const std::uint64_t> ids, const RowExtras& extras,
                                  bool first) const;
  // A full block enters the prefix index when it is allocated (true) or after the forward
  // that writes it (false, the only safe choice).
  virtual bool register_on_allocation() const { return false; }
  // A write into a block that `refcount` rows reference, or that the prefix index holds,
  // first copies it.
  virtual bool copy_before_write(std::int32_t refcount, bool registered) const { return refcount > 1 || registered; }
  // A prefix hit takes a reference on each block it reuses.
  virtual bool hit_takes_reference() const { return true; }
  // Row `to` takes row `from`'s table in a reorder.
  virtual void move_table(std::vector<std::int64_t>& to, const std::vector<std::int64_t>& from) const { to = from; }
  // Blocks below this index hold no token the window of a row of length n still sees.
  virtual std::int64_t first_live_block(std::int64_t n, std::int64_t window) const;
  // A sliding layer frees what left its window between the forwards of a chunked prefill
  // (true), or only once the append is done.
  virtual bool frees_between_forwards() const { return true; }
  // The first token index a query at t sees in a forward that starts at `forward_first` of
  // an append that starts at `append_first`.
  virtual std::int64_t window_begin(std::int64_t t, std::int64_t window, std::int64_t forward_first,
                                    std::int64_t append_first) const {
    (void)forward_first;
    (void)append_first;
    return window == 0 ? 0 : t - window + 1;
  }
  // The position token t's key and query are rotated at, in a forward that starts at token
  // `forward_first` of an append that starts at `append_first`.
  virtual std::int64_t position_of(std::int64_t t, std::int64_t forward_first, std::int64_t append_first) const {
    (void)forward_first;
    (void)append_first;
    return t;
  }
  // How many keys past its own a query at t sees, in a forward that ends before token
  // `forward_end` of an append that ends before `append_end`: none (causal attention).
  virtual std::int64_t keys_ahead(std::int64_t t, std::int64_t forward_end, std::int64_t append_end) const {
    (void)t;
    (void)forward_end;
    (void)append_end;
    return 0;
  }
  // The slot token t is written to, through the row's table in that layer (SPEC 8.2:
  // table[t / B] * B + t % B); -1 when the entry is null or missing.
  virtual std::int64_t write_slot(const std::vector<std::int64_t>& table, std::int64_t t) const;
  // Evicting or reusing a cached block drops its index entry.
  virtual bool forget_evicted() const { return true; }
  // After a recompute, the row keeps this many tokens of the `history` it was rebuilt from
  // (its prompt was the first `prompt` of them).
  virtual std::int64_t recomputed_tokens(std::int64_t history, std::int64_t prompt) const {
    (void)prompt;
    return history;
  }
  // A starting row has just taken `hit` tokens from the prefix index, before any forward:
  // their blocks keep what their writer stored (codes and, under frozen scales, its scale).
  virtual void after_prefix_hit(int b, std::int64_t hit) {
    (void)b;
    (void)hit;
  }
  // For the hooks above: a layer's pool, a row's table there, each row's frozen scales.
  SlotStore& pool(int layer) { return pools_[static_cast<std::size_t>(layer)]; }
  const std::vector<std::int64_t>& table(int layer, int b) const {
    return tables_[static_cast<std::size_t>(layer)][static_cast<std::size_t>(b)];
  }
  const FrozenScales& frozen_scales() const { return frozen_; }

 private:
  struct Swapped {  // one layer of a row swapped out: per table entry its slots, or none for null
    std::vector<bool> present;
    SlotStore slots;  // one row, B slots per present entry
  };
  struct Row {
    std::int64_t prompt = 0;  // tokens of the append that started it (its length is lengths_'s)
    RowExtras extras;
    std::vector<Swapped> swapped;  // per layer, while swapped out
    std::vector<std::uint64_t> ids;   // every token id so far (the open block's complete a key)
    std::vector<std::uint64_t> keys;  // prefix-index key of each full block
  };

  const LayerPolicy& policy(int layer) const { return policies_[static_cast<std::size_t>(layer)]; }
  QueryPlan plan(int layer, std::int64_t t, std::int64_t forward_first, std::int64_t forward_end,
                 std::int64_t append_first, std::int64_t append_end) const;
  void schedule(const Chunk& chunk);
  void take_prefix_hit(int b, const Chunk& chunk);
  void make_writable(int layer, int b, std::int64_t logical);
  void ensure_block(int layer, int b, std::int64_t logical);
  void run_forward(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log, int b, std::int64_t first,
                   std::int64_t count);
  void register_full_blocks(int b, std::int64_t from, std::int64_t to);
  void free_behind_window(int b, bool append_done);
  void release_table(int layer, std::vector<std::int64_t>& table);
  void cut_row(int b, std::int64_t length);
  void clear_block(int layer, std::int64_t block);
  std::optional<std::int64_t> take_block(int layer);
  void release_block(int layer, std::int64_t block);
  void forget_tokens(int layer, std::int64_t block);
  void register_tokens(int b, std::int64_t from, std::int64_t to);
  std::int64_t take_partial_hit(int b, std::int64_t logical, std::int64_t most);
  void poison_block(int layer, std::int64_t block, PoisonKind kind);
  void map_slots(const Chunk& chunk);
  std::int64_t forward_first(int b, std::int64_t t, std::int64_t forward) const;
  std::uint64_t key_of_block(int b, std::int64_t logical);

  CacheConfig config_;
  std::vector<LayerPolicy> policies_;  // per layer
  PagedLayout paging_;
  RopeTable rope_;
  AttentionKernel kernel_;
  std::vector<PlannedQuery> plans_;
  std::vector<SlotStore> pools_;                             // per layer: batch = blocks, capacity = B
  std::vector<BlockPool> blocks_;                            // per layer
  std::vector<std::vector<std::vector<std::int64_t>>> tables_;  // [layer][row][logical block]
  std::vector<std::vector<std::vector<float>>> sink_logits_;   // per layer: that layer's alone
  std::vector<std::int64_t> lengths_;
  std::vector<Row> rows_;
  std::vector<std::int64_t> hits_;  // tokens of the last append each row took from the prefix index
  std::vector<std::vector<std::int64_t>> poisoned_;  // [layer][block]: times poisoned (the mark's epoch)
  // Reuse "token" (SGLang's radix tree): the key of each run of a block's first tokens (a
  // full block's key when the run is whole) -> a block holding it, and each block's keys there.
  std::vector<std::map<std::uint64_t, std::int64_t>> token_index_;  // [layer]
  std::vector<std::vector<std::vector<std::uint64_t>>> token_keys_;  // [layer][block]
  mutable PagedState state_;
  std::vector<float> scratch_;
  FrozenScales frozen_;   // SPEC 9's "first_append": each row's scales
  bool resuming_ = false;  // a recompute's rebuild: its rows keep the scales they froze
};

}  // namespace kvcheck::optimized
