// StreamingLLM without re-rotation: S fixed sink slots plus a ring of W - S slots for the
// window. Every key is rotated once, at its original index j, and never again.
//
// Why that is enough: the policy wants, for query t with E(t) tokens evicted,
//   window key j: Pq - Pk = (t - E) - (j - E) = t - j,
//   sink key j:   Pq - Pk = (t - E) - j.
// RoPE scores depend only on Pq - Pk, so rotating the query at t against window keys
// (stored at j) gives t - j, and rotating it at t - E against sink keys (also stored at j)
// gives t - E - j. Two query rotations, O(D) per head, replace re-rotating W keys per
// eviction, O(W D). With `positions: original` both query rotations are t.
//
// A sliding layer under the shift (SPEC 10.4, `swa`) keeps the same slots and sees, of them,
// the keys with Pq - Pk < swa: window keys from t - swa + 1, sinks from Pq - swa + 1.
#pragma once

#include "optimized/cache.h"

namespace kvcheck::optimized {

class SinkRingCache : public KvCache {
 public:
  explicit SinkRingCache(const CacheConfig& config);

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override;
  void reorder(const std::vector<int>& rows) override;
  void reset(int batch) override;
  void crop(std::int64_t length) override;
  void free_rows(const std::vector<int>& rows) override;
  void check_crop(std::int64_t length) const override;
  const SlotStore& slots() const override { return store_; }
  std::int64_t row_length(int row) const override { return lengths_[row]; }

 protected:
  // SPEC 10.4: the first sink query t sees under `swa` (a zoo mutant measures it elsewhere).
  virtual std::int64_t first_sink_seen(std::int64_t t, std::int64_t sink_query_position) const;
  const LayerPolicy& policy() const { return policy_; }

 private:
  std::int64_t slot_of(std::int64_t index) const;

  CacheConfig config_;
  LayerPolicy policy_;  // every layer's
  RopeTable rope_;
  AttentionKernel kernel_;
  std::vector<PlannedQuery> plans_;  // reused from step to step
  SlotStore store_;                  // slots 0..S-1 sinks, S..W-1 the ring
  SlotStore chunk_;
  std::vector<std::int64_t> lengths_;
  FrozenScales frozen_;  // SPEC 9's "first_append": each row's scales
};

}  // namespace kvcheck::optimized
