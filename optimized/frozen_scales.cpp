#include "optimized/frozen_scales.h"

#include <algorithm>

#include "optimized/cache.h"

namespace kvcheck::optimized {

FrozenScales::FrozenScales(int kv_heads, int head_dim, std::vector<LayerFormats> formats)
    : layers_(static_cast<int>(formats.size())),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      formats_(std::move(formats)) {
  for (const LayerFormats& f : formats_) {
    key_frozen_ = key_frozen_ || f.key.frozen != RowFormat::Frozen::no;
    value_frozen_ = value_frozen_ || f.value.frozen != RowFormat::Frozen::no;
  }
}

void FrozenScales::reset(int batch) {
  const std::size_t n = static_cast<std::size_t>(batch) * layers_ * kv_heads_;
  k_.assign(key_frozen_ ? n : 0, 0.0f);
  v_.assign(value_frozen_ ? n : 0, 0.0f);
}

void FrozenScales::gather(const std::vector<int>& rows) {
  const std::size_t per_row = static_cast<std::size_t>(layers_) * kv_heads_;
  for (std::vector<float>* scales : {&k_, &v_}) {
    if (scales->empty()) continue;
    std::vector<float> next;
    for (int r : rows)
      next.insert(next.end(), scales->begin() + static_cast<std::ptrdiff_t>(r * per_row),
                  scales->begin() + static_cast<std::ptrdiff_t>((r + 1) * per_row));
    *scales = std::move(next);
  }
}

void FrozenScales::freeze(int row, const Chunk& chunk, const RopeTable& rope) {
  if (!active()) return;
  const std::int64_t n = chunk.counts[static_cast<std::size_t>(row)], pad = chunk.length - n;
  const std::size_t D = static_cast<std::size_t>(head_dim_);
  std::vector<float> x(D), scratch(D), amax(static_cast<std::size_t>(kv_heads_));
  const auto freeze_tensor = [&](bool value, std::vector<float>& scales, const std::vector<const float*>& in) {
    for (int l = 0; l < layers_; ++l) {
      const RowFormat& format =
          value ? formats_[static_cast<std::size_t>(l)].value : formats_[static_cast<std::size_t>(l)].key;
      if (format.frozen == RowFormat::Frozen::no) continue;
      std::fill(amax.begin(), amax.end(), 0.0f);
      for (std::int64_t i = 0; i < n; ++i)
        for (int g = 0; g < kv_heads_; ++g) {
          const std::size_t token = (static_cast<std::size_t>(row) * chunk.length + pad + i) * kv_heads_ + g;
          std::copy_n(in[l] + token * D, D, x.data());
          if (!value) rope.rotate(x.data(), i);  // as stored: the first append starts at index 0
          amax[g] = std::max(amax[g], quantized_amax(format, x.data(), head_dim_, scratch.data()));
        }
      if (format.frozen == RowFormat::Frozen::per_tensor)
        std::fill(amax.begin(), amax.end(), *std::max_element(amax.begin(), amax.end()));
      for (int g = 0; g < kv_heads_; ++g)
        scales[(static_cast<std::size_t>(row) * layers_ + l) * kv_heads_ + g] = frozen_scale(format, amax[g]);
    }
  };
  freeze_tensor(false, k_, chunk.k);
  freeze_tensor(true, v_, chunk.v);
}

}  // namespace kvcheck::optimized
