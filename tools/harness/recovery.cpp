#include "tools/harness/recovery.h"

#include <cmath>

#include <fmt/format.h>

namespace kvcheck {
namespace {

constexpr double kTwoPi = 6.283185307179586;

double wrap(double a) {  // into (-pi, pi]
  a = std::fmod(a, kTwoPi);
  if (a > kTwoPi / 2) a -= kTwoPi;
  if (a <= -kTwoPi / 2) a += kTwoPi;
  return a;
}

struct Pair {
  double omega;  // angle per position
  double angle;  // measured rotation in [0, 2 pi)
  double weight; // the pair's length: short pairs measure their angle poorly
};

// The measured rotation of each pair and whether every pair kept its length.
bool measure(const float* raw, const float* stored, int d, const Rope& rope, std::vector<Pair>& pairs) {
  pairs.clear();
  const int half = d / 2;
  for (int i = 0; i < half; ++i) {
    const int ia = rope.layout == RopeLayout::half ? i : 2 * i;
    const int ib = rope.layout == RopeLayout::half ? i + half : 2 * i + 1;
    const double ra = raw[ia], rb = raw[ib], sa = stored[ia], sb = stored[ib];
    const double rn = std::hypot(ra, rb), sn = std::hypot(sa, sb);
    if (std::abs(rn - sn) > 1e-4 * std::max(1.0, rn)) return false;  // a rotation keeps lengths
    const double divisor = rope.scaling == RopeScaling::linear ? rope.factor : 1.0;
    const double omega = std::pow(rope.theta, -2.0 * i / d) / divisor;
    double angle = std::atan2(ra * sb - rb * sa, ra * sa + rb * sb);
    if (angle < 0) angle += kTwoPi;
    pairs.push_back({omega, angle, rn});
  }
  return true;
}

// Unwraps from the lowest frequency to the highest, starting from `start` (a position
// estimate), and says whether the integer result explains every pair.
bool unwrap(const std::vector<Pair>& pairs, double start, std::int64_t& position) {
  double estimate = start;
  for (auto it = pairs.rbegin(); it != pairs.rend(); ++it) {
    if (it->weight < 1e-3) continue;
    const double turns = std::round((estimate * it->omega - it->angle) / kTwoPi);
    estimate = (it->angle + turns * kTwoPi) / it->omega;
  }
  position = std::llround(estimate);
  for (const Pair& p : pairs) {
    if (p.weight < 1e-3) continue;
    // float32 keys, even re-rotated a thousand times, stay within 1e-3 / length radians,
    // while a position off by one moves the fastest pair by a whole radian.
    if (std::abs(wrap(static_cast<double>(position) * p.omega - p.angle)) > std::min(0.1, 1e-3 / p.weight))
      return false;
  }
  return true;
}

// Tries positions in the first period, then beyond it.
RecoveredPosition recover_with(const float* raw, const float* stored, int d, const Rope& rope) {
  RecoveredPosition r;
  std::vector<Pair> pairs;
  if (!measure(raw, stored, d, rope, pairs)) return r;
  const Pair* lowest = nullptr;
  for (auto it = pairs.rbegin(); it != pairs.rend() && lowest == nullptr; ++it)
    if (it->weight >= 1e-3) lowest = &*it;
  if (lowest == nullptr) {  // a zero key: every position fits
    r.status = RecoveredPosition::Status::ambiguous;
    return r;
  }
  const double period = kTwoPi / lowest->omega;
  std::int64_t p = 0;
  if (unwrap(pairs, lowest->angle / lowest->omega, p) && p >= 0) {
    r.status = std::llround(static_cast<double>(p)) < std::llround(period) ? RecoveredPosition::Status::exact
                                                                            : RecoveredPosition::Status::ambiguous;
    r.position = p;
    return r;
  }
  // Beyond the first period the lowest frequency no longer decides; search a few periods.
  for (int turn = 1; turn <= 64 && period * turn < 1e7; ++turn) {
    if (unwrap(pairs, lowest->angle / lowest->omega + period * turn, p)) {
      r.status = RecoveredPosition::Status::ambiguous;
      r.position = p;
      return r;
    }
  }
  return r;
}

}  // namespace

double lowest_frequency_period(int head_dim, const Rope& rope) {
  const double divisor = rope.scaling == RopeScaling::linear ? rope.factor : 1.0;
  return kTwoPi / (std::pow(rope.theta, -2.0 * (head_dim / 2 - 1) / head_dim) / divisor);
}

RecoveredPosition recover_position(const float* raw, const float* stored, int head_dim, const Rope& rope) {
  RecoveredPosition r = recover_with(raw, stored, head_dim, rope);
  if (r.status != RecoveredPosition::Status::not_rotation) return r;
  // Which rope would fit instead: the other layout, a common theta, a linear scaling.
  std::vector<std::pair<Rope, std::string>> guesses;
  Rope other = rope;
  other.layout = rope.layout == RopeLayout::half ? RopeLayout::interleaved : RopeLayout::half;
  guesses.push_back({other, fmt::format("layout {}", to_string(other.layout))});
  for (double theta : {10000.0, 500000.0, 1000000.0, 100000.0, 1000.0, 100.0}) {
    if (theta == rope.theta) continue;
    Rope t = rope;
    t.theta = theta;
    guesses.push_back({t, fmt::format("theta {:g}", theta)});
  }
  for (double factor : {1.0, 2.0, 4.0, 8.0}) {
    const double current = rope.scaling == RopeScaling::linear ? rope.factor : 1.0;
    if (factor == current) continue;
    Rope s = rope;
    s.scaling = factor == 1.0 ? RopeScaling::none : RopeScaling::linear;
    s.factor = factor;
    guesses.push_back({s, factor == 1.0 ? std::string("no scaling") : fmt::format("linear scaling {:g}", factor)});
  }
  for (const auto& [guess, name] : guesses) {
    const RecoveredPosition g = recover_with(raw, stored, head_dim, guess);
    if (g.status == RecoveredPosition::Status::exact) {
      r.fits = fmt::format("{} at position {}", name, g.position);
      break;
    }
  }
  return r;
}

std::string describe(const RecoveredPosition& r) {
  switch (r.status) {
    case RecoveredPosition::Status::exact: return std::to_string(r.position);
    case RecoveredPosition::Status::ambiguous: return fmt::format("{}?", r.position);
    case RecoveredPosition::Status::not_rotation:
      return r.fits.empty() ? std::string("not a rotation") : "fits " + r.fits;
  }
  return "?";
}

}  // namespace kvcheck
