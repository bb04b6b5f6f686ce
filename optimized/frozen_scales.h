// SPEC 9's "first_append" scale in the optimized caches: each row's key and value scales
// (per layer, per kv head or one for the tensor) computed once, from every token of the
// row's first append as the cache stores them (keys rotated to their index), then given to
// every row the row writes later. Each stored row keeps the scale it was written with, so a
// block another row reads (a prefix hit) keeps its writer's.
#pragma once

#include <cstdint>
#include <vector>

#include "optimized/row_codec.h"

namespace kvcheck::optimized {

struct Chunk;
class RopeTable;

class FrozenScales {
 public:
  FrozenScales() = default;
  // `formats`: one per layer.
  FrozenScales(int kv_heads, int head_dim, std::vector<LayerFormats> formats);

  // Neither format freezes its scale: nothing to keep.
  bool active() const { return key_frozen_ || value_frozen_; }
  // Row `row`'s scales from its chunk tokens (its first append, token i at position i); the
  // rope must cover them.
  void freeze(int row, const Chunk& chunk, const RopeTable& rope);
  float key(int layer, int row, int kv_head) const { return at(k_, layer, row, kv_head); }
  float value(int layer, int row, int kv_head) const { return at(v_, layer, row, kv_head); }

  void reset(int batch);
  void gather(const std::vector<int>& rows);  // new row b keeps old row rows[b]'s

 private:
  float at(const std::vector<float>& scales, int layer, int row, int kv_head) const {
    if (scales.empty()) return 0.0f;
    return scales[(static_cast<std::size_t>(row) * layers_ + layer) * kv_heads_ + kv_head];
  }
  int layers_ = 0, kv_heads_ = 0, head_dim_ = 0;
  std::vector<LayerFormats> formats_;
  bool key_frozen_ = false, value_frozen_ = false;
  std::vector<float> k_, v_;  // [row][layer][kv head]; empty when that tensor's scale is not frozen
};

}  // namespace kvcheck::optimized
