// A stack whose layers follow different policies (Gemma 2 and 3: sliding layers with a
// full one every few; gpt-oss: alternating), as transformers' HybridCache: one cache per
// layer, each the kind its policy needs (dynamic, sliding or sink_ring), fed that layer's
// q, k and v.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "optimized/cache.h"

namespace kvcheck::optimized {

class HybridCache : public KvCache {
 public:
  // config.policies names each layer's policy. `make_sink`, when given, makes the sink
  // layers' caches instead of SinkRingCache (a zoo mutant plants its fault there).
  using MakeLayer = std::function<std::unique_ptr<KvCache>(const CacheConfig&)>;
  explicit HybridCache(const CacheConfig& config, const MakeLayer& make_sink = nullptr);

  void append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) override;
  void reorder(const std::vector<int>& rows) override;
  void reset(int batch) override;
  void check_crop(std::int64_t length) const override;
  void crop(std::int64_t length) override;
  void free_rows(const std::vector<int>& rows) override;
  // SPEC 11: the full layers prune; the window layers keep what their policy keeps.
  void prune(std::int64_t sinks, std::int64_t recent, bool rerotate) override;
  const SlotStore& slots() const override { return layers_[0]->slots(); }
  const SlotStore& layer_slots(int layer) const override { return layers_[static_cast<std::size_t>(layer)]->slots(); }
  std::int64_t row_length(int row) const override { return layers_[0]->row_length(row); }

 private:
  std::vector<std::unique_ptr<KvCache>> layers_;
  std::vector<bool> full_;         // per layer: its policy is full attention
  Chunk layer_chunk_;              // one layer's view of a chunk, reused
  std::vector<float*> layer_out_;  // one layer's output
};

}  // namespace kvcheck::optimized
