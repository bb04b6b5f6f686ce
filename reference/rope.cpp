#include "reference/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

namespace kvcheck::reference {

int rotary_dim(int head_dim, const Rope& rope) { return rope.rotary_dim > 0 ? rope.rotary_dim : head_dim; }

namespace {

// llama3 (Llama 3.1): high frequencies kept, low ones divided by f, a smooth ramp between.
double llama3_map(double inv_freq, const Rope& r) {
  const double wavelen = 2.0 * std::numbers::pi / inv_freq;
  const double L = r.original_max_position_embeddings;
  if (wavelen < L / r.high_freq_factor) return inv_freq;
  if (wavelen > L / r.low_freq_factor) return inv_freq / r.factor;
  const double s = (L / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  return inv_freq * ((1.0 - s) / r.factor + s);
}

// yarn: pairs below `lo` keep their frequency, pairs above `hi` are divided by f, a linear
// ramp in the pair index between.
double yarn_map(int pair, int rotary, double inv_freq, const Rope& r) {
  const double L = r.original_max_position_embeddings;
  auto correction = [&](double rotations) {
    return rotary * std::log(L / (2.0 * std::numbers::pi * rotations)) / (2.0 * std::log(r.theta));
  };
  const double lo = std::max(std::floor(correction(r.beta_fast)), 0.0);
  double hi = std::min(std::ceil(correction(r.beta_slow)), static_cast<double>(rotary - 1));
  if (hi == lo) hi += 0.001;
  const double ramp = std::clamp((pair - lo) / (hi - lo), 0.0, 1.0);
  return inv_freq / r.factor * ramp + inv_freq * (1.0 - ramp);
}

}  // namespace

double inverse_frequency(int pair, int head_dim, const Rope& rope) {
  if (rope.nope) return 0.0;  // SPEC 10.1: every angle 0, R(p) the identity
  const int rotary = rotary_dim(head_dim, rope);
  const double plain = std::pow(rope.theta, -2.0 * pair / rotary);
  switch (rope.scaling) {
    case RopeScaling::llama3:
      return llama3_map(plain, rope);
    case RopeScaling::yarn:
      return yarn_map(pair, rotary, plain, rope);
    case RopeScaling::none:
    case RopeScaling::linear:
      break;
  }
  return plain;
}

double rope_angle(int pair, int head_dim, double position, const Rope& rope) {
  const double scaled = rope.scaling == RopeScaling::linear ? position / rope.factor : position;
  return scaled * inverse_frequency(pair, head_dim, rope);
}

double query_temperature(const QueryTemperature& t, std::int64_t position) {
  const std::int64_t steps = (position + 1) / t.floor_scale;
  return std::log1p(static_cast<double>(steps)) * t.attn_scale + 1.0;
}

double rope_magnitude(const Rope& rope) { return rope.scaling == RopeScaling::yarn ? rope.attention_factor : 1.0; }

int pair_first(int pair, RopeLayout layout) { return layout == RopeLayout::half ? pair : 2 * pair; }
int pair_second(int pair, int rotary, RopeLayout layout) {
  return layout == RopeLayout::half ? pair + rotary / 2 : 2 * pair + 1;
}

namespace {

std::vector<double> turn(const std::vector<double>& x, double position, double scale, const Rope& rope) {
  const int d = static_cast<int>(x.size());
  const int rotary = rotary_dim(d, rope);
  if (rotary % 2 != 0 || rotary > d) throw std::invalid_argument("rotate: rotary_dim must be even and <= head_dim");
  std::vector<double> out = x;  // dims R .. D-1 pass through
  for (int i = 0; i < rotary / 2; ++i) {
    const int ia = pair_first(i, rope.layout), ib = pair_second(i, rotary, rope.layout);
    const double angle = rope_angle(i, d, position, rope);
    const double c = std::cos(angle), s = std::sin(angle);
    out[ia] = scale * (x[ia] * c - x[ib] * s);
    out[ib] = scale * (x[ia] * s + x[ib] * c);
  }
  return out;
}

}  // namespace

std::vector<double> rotate(const std::vector<double>& x, double position, const Rope& rope) {
  return turn(x, position, rope_magnitude(rope), rope);
}

std::vector<double> unrotate(const std::vector<double>& y, double position, const Rope& rope) {
  return turn(y, -position, 1.0 / rope_magnitude(rope), rope);
}

}  // namespace kvcheck::reference
