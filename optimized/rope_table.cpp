#include "optimized/rope_table.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kvcheck::optimized {

RopeTable::RopeTable(const RopeSpec& spec) : spec_(spec) {
  for (int i = 0; i < spec.head_dim / 2; ++i) inv_freq_.push_back(std::pow(spec.theta, -2.0 * i / spec.head_dim));
}

void RopeTable::cover(std::int64_t position) {
  position = std::abs(position);
  if (position < positions_) return;
  const std::int64_t target = std::max<std::int64_t>(position + 1, 2 * positions_);
  const auto pairs = static_cast<std::size_t>(spec_.head_dim / 2);
  cos_.resize(static_cast<std::size_t>(target) * pairs);
  sin_.resize(static_cast<std::size_t>(target) * pairs);
  for (std::int64_t p = positions_; p < target; ++p) {
    const double scaled = static_cast<double>(p) / spec_.position_divisor;
    for (std::size_t i = 0; i < pairs; ++i) {
      const double angle = scaled * inv_freq_[i];  // in double, rounded once to float
      cos_[static_cast<std::size_t>(p) * pairs + i] = static_cast<float>(std::cos(angle));
      sin_[static_cast<std::size_t>(p) * pairs + i] = static_cast<float>(std::sin(angle));
    }
  }
  positions_ = target;
}

void RopeTable::rotate(float* x, std::int64_t position) const {
  const std::int64_t p = std::abs(position);
  if (p >= positions_)
    throw std::logic_error("rope table covers positions below " + std::to_string(positions_) + ", asked for " +
                           std::to_string(position));
  const int pairs = spec_.head_dim / 2;
  const float* c = cos_.data() + static_cast<std::size_t>(p) * pairs;
  const float* s = sin_.data() + static_cast<std::size_t>(p) * pairs;
  const float sign = position < 0 ? -1.0f : 1.0f;  // R(-p): same cos, opposite sin
  for (int i = 0; i < pairs; ++i) {
    float& a = x[spec_.layout == PairLayout::half ? i : 2 * i];
    float& b = x[spec_.layout == PairLayout::half ? i + pairs : 2 * i + 1];
    const float sn = sign * s[i];
    const float na = a * c[i] - b * sn;
    const float nb = a * sn + b * c[i];
    a = na;
    b = nb;
  }
}

}  // namespace kvcheck::optimized
