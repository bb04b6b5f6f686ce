// StreamingLLM the Hugging Face SinkCache way, done right: slots hold the sinks, then the
// window in order, and every key is rotated at its cache-relative position (its slot).
// When E grows by d, the first d window keys go, the rest move down d slots and are
// re-rotated by -d; new keys are rotated at their cache position; the query at t - E.
// A chunk runs in groups of tokens that share E, shifting before each group, so a chunk
// that crosses the window boundary gives every token the positions the policy defines.
#pragma once

#include "optimized/cache.h"

namespace kvcheck::optimized {

class SinkShiftCache : public KvCache {
 public:
  explicit SinkShiftCache(const CacheConfig& config);

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override;
  void reorder(const std::vector<int>& rows) override;
  void reset(int batch) override;
  void crop(std::int64_t length) override;
  void free_rows(const std::vector<int>& rows) override;
  void check_crop(std::int64_t length) const override;
  const SlotStore& slots() const override { return store_; }
  std::int64_t row_length(int row) const override { return rows_[row].length; }

 private:
  struct RowState {
    std::int64_t length = 0;   // tokens seen
    std::int64_t used = 0;     // slots in use: 0..used-1, in token order
    std::int64_t evicted = 0;  // E applied to the stored window
  };

  // Evicts and re-rotates row b's window until `evicted` tokens are gone; tells
  // `chunk.key_stored` of each key it stores again.
  void shift_to(const Chunk& chunk, int b, std::int64_t evicted);

  CacheConfig config_;
  LayerPolicy policy_;  // every layer's
  RopeTable rope_;
  AttentionKernel kernel_;
  std::vector<PlannedQuery> plans_;  // reused from step to step
  std::vector<float> turned_;        // one key being re-rotated
  SlotStore store_;
  std::vector<RowState> rows_;
  FrozenScales frozen_;  // SPEC 9's "first_append": each row's scales
};

}  // namespace kvcheck::optimized
