// A sliding window of W keys as a ring buffer: token t lives in slot t % W, so a decoded
// token costs O(1) writes and nothing moves. Keys are rotated once, at their index.
// A chunk is attended over the ring plus the chunk itself before it overwrites the ring,
// so a chunk longer than the window gives every token its own window.
// Chunked attention (SPEC 10.2) is the same ring with W = C: a query sees from its chunk's
// first token; the ring keeps the previous chunk's tail, dead, as SPEC 10.2 allows.
#pragma once

#include "optimized/cache.h"

namespace kvcheck::optimized {

class SlidingCache : public KvCache {
 public:
  explicit SlidingCache(const CacheConfig& config);

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override;
  void reorder(const std::vector<int>& rows) override;
  void reset(int batch) override;
  void crop(std::int64_t length) override;
  void free_rows(const std::vector<int>& rows) override;
  void check_crop(std::int64_t length) const override;
  const SlotStore& slots() const override { return ring_; }
  std::int64_t row_length(int row) const override { return lengths_[row]; }

 protected:
  // The first token index query t sees (a zoo mutant draws chunk edges elsewhere).
  virtual std::int64_t first_visible(std::int64_t t) const;
  const LayerPolicy& policy() const { return policy_; }

 private:
  CacheConfig config_;
  LayerPolicy policy_;  // every layer's
  RopeTable rope_;
  AttentionKernel kernel_;
  std::vector<PlannedQuery> plans_;  // reused from step to step
  SlotStore ring_;                   // W slots per row
  SlotStore chunk_;                  // the chunk being appended, before it enters the ring
  std::vector<std::int64_t> lengths_;
  FrozenScales frozen_;  // SPEC 9's "first_append": each row's scales
};

}  // namespace kvcheck::optimized
