#include "optimized/rope_table.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kvcheck::optimized {

namespace {

constexpr double kPi = 3.141592653589793;

// Llama 3.1: a pair whose wavelength is short against the original context keeps its
// frequency, a long one is slowed by `factor`, and those between blend the two.
double llama3_frequency(double base, const RopeSpec& s) {
  const double wavelength = 2.0 * kPi / base;
  const double short_limit = s.original_context / s.high_freq_factor;
  const double long_limit = s.original_context / s.low_freq_factor;
  if (wavelength < short_limit) return base;
  if (wavelength > long_limit) return base / s.factor;
  const double blend = (s.original_context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return base * (blend + (1.0 - blend) / s.factor);
}

// The pair index at which a pair turns `turns` times over the original context.
double yarn_pair_for(double turns, int rotary, const RopeSpec& s) {
  return rotary * std::log(s.original_context / (turns * 2.0 * kPi)) / (2.0 * std::log(s.theta));
}

// yarn: pairs up to `first` extrapolate (keep their frequency), pairs from `last` on
// interpolate (divided by factor), linearly in the pair index between.
double yarn_frequency(int pair, double base, int rotary, const RopeSpec& s) {
  const double first = std::max(0.0, std::floor(yarn_pair_for(s.beta_fast, rotary, s)));
  double last = std::min(static_cast<double>(rotary - 1), std::ceil(yarn_pair_for(s.beta_slow, rotary, s)));
  if (last == first) last += 0.001;
  const double interpolated = std::min(1.0, std::max(0.0, (pair - first) / (last - first)));
  return (1.0 - interpolated) * base + interpolated * (base / s.factor);
}

}  // namespace

RopeTable::RopeTable(const RopeSpec& spec)
    : spec_(spec), rotary_(spec.rotary_dim > 0 ? std::min(spec.rotary_dim, spec.head_dim) : spec.head_dim) {
  for (int i = 0; i < rotary_ / 2; ++i) {
    if (spec.identity) {  // NoPE: cos 1 and sin 0 at every position
      inv_freq_.push_back(0.0);
      continue;
    }
    const double base = std::pow(spec.theta, -2.0 * i / rotary_);
    switch (spec.map) {
      case FrequencyMap::plain: inv_freq_.push_back(base); break;
      case FrequencyMap::llama3: inv_freq_.push_back(llama3_frequency(base, spec)); break;
      case FrequencyMap::yarn: inv_freq_.push_back(yarn_frequency(i, base, rotary_, spec)); break;
    }
  }
}

void RopeTable::cover(std::int64_t position) {
  position = std::abs(position);
  if (position < positions_) return;
  const std::int64_t target = std::max<std::int64_t>(position + 1, 2 * positions_);
  const auto pairs = static_cast<std::size_t>(rotary_ / 2);
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

void RopeTable::turn(float* x, std::int64_t position, float scale) const {
  const std::int64_t p = std::abs(position);
  if (p >= positions_)
    throw std::logic_error("rope table covers positions below " + std::to_string(positions_) + ", asked for " +
                           std::to_string(position));
  const int pairs = rotary_ / 2;
  const float* c = cos_.data() + static_cast<std::size_t>(p) * pairs;
  const float* s = sin_.data() + static_cast<std::size_t>(p) * pairs;
  const float sign = position < 0 ? -1.0f : 1.0f;  // R(-p): same cos, opposite sin
  for (int i = 0; i < pairs; ++i) {
    float& a = x[spec_.layout == PairLayout::half ? i : 2 * i];
    float& b = x[spec_.layout == PairLayout::half ? i + pairs : 2 * i + 1];
    const float sn = sign * s[i];
    const float na = a * c[i] - b * sn;
    const float nb = a * sn + b * c[i];
    a = scale * na;
    b = scale * nb;
  }
}

void RopeTable::rotate(float* x, std::int64_t position) const {
  turn(x, position, static_cast<float>(spec_.magnitude));
}

void RopeTable::shift(float* x, std::int64_t by) const { turn(x, by, 1.0f); }

}  // namespace kvcheck::optimized
