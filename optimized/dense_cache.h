// Caches that keep every token: `dynamic` grows with the sequence (capacity doubles, so a
// token costs amortized O(1) copies), `static` is preallocated and refuses to overflow.
// Keys are rotated once at their index; the query at its index; every earlier slot is visible.
// A prune (SPEC 11) closes the gap it leaves: later tokens sit `count` slots below their
// index, and re-rotated ones that many positions lower too.
#pragma once

#include "optimized/cache.h"

namespace kvcheck::optimized {

class DenseCache : public KvCache {
 public:
  enum class Growth { dynamic, fixed };
  DenseCache(const CacheConfig& config, Growth growth);

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override;
  void reorder(const std::vector<int>& rows) override;
  void reset(int batch) override;
  void crop(std::int64_t length) override;
  void free_rows(const std::vector<int>& rows) override;
  void prune(std::int64_t sinks, std::int64_t recent, bool rerotate) override;
  const SlotStore& slots() const override { return store_; }
  std::int64_t row_length(int row) const override { return lengths_[row] + pruned_[row].count; }  // pruned included

 protected:
  // Where a token appended at `slot` with index `t` sits (SPEC 11: after a re-rotating
  // prune, at its slot); the zoo plants a prune's position bug here.
  virtual std::int64_t position_of(int row, std::int64_t slot, std::int64_t t) const {
    return pruned_[static_cast<std::size_t>(row)].rerotated ? slot : t;
  }

 private:
  CacheConfig config_;
  Growth growth_;
  RopeTable rope_;
  AttentionKernel kernel_;
  std::vector<PlannedQuery> plans_;  // reused from step to step
  SlotStore store_;
  struct Pruned {
    std::int64_t first = 0, count = 0;  // the row's pruned tokens: indices [first, first + count)
    bool rerotated = false;
  };
  std::vector<std::int64_t> lengths_;  // slots used per row; token t sits in slot t (before its row's prune)
  std::vector<Pruned> pruned_;
  std::vector<float> turned_;  // one key being re-rotated
  FrozenScales frozen_;  // SPEC 9's "first_append": each row's scales
};

}  // namespace kvcheck::optimized
