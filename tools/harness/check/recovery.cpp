#include "tools/harness/check/recovery.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "reference/rope.h"

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
  double omega;   // angle per position
  double angle;   // measured rotation in [0, 2 pi)
  double weight;  // the pair's length: a pair of (almost) zeros has no angle to measure
  double noise;   // how far storage rounding may move the measured angle
};

enum class Measured { rotation, length_changed, zero_key };

// Angle per position of pair i: what rope_angle gives at position 1.
double omega(int pair, int d, const Rope& rope) {
  const double divisor = rope.scaling == RopeScaling::linear ? rope.factor : 1.0;
  return reference::inverse_frequency(pair, d, rope) / divisor;
}

// The measured rotation of each rotated pair. A rotation by m R(p) multiplies every pair's
// length by m (yarn's attention factor, 1 otherwise) and leaves the dims past R alone.
Measured measure(const float* raw, const float* stored, int d, const Rope& rope, double roundoff,
                 std::vector<Pair>& pairs) {
  pairs.clear();
  const int rotary = reference::rotary_dim(d, rope), half = rotary / 2;
  const double m = reference::rope_magnitude(rope);
  double longest = 0.0;
  // A stored element is off by up to `roundoff` of the key's largest element; float32
  // keys re-rotated many times drift further, hence the floor.
  double largest = 0.0;
  for (int i = 0; i < d; ++i) largest = std::max(largest, std::abs(static_cast<double>(raw[i])));
  const double noise = std::max(1e-4 * std::max(1.0, largest), 8.0 * roundoff * largest);
  for (int i = rotary; i < d; ++i)
    if (std::abs(static_cast<double>(stored[i]) - raw[i]) > noise) return Measured::length_changed;
  for (int i = 0; i < half; ++i) {
    const int ia = reference::pair_first(i, rope.layout), ib = reference::pair_second(i, rotary, rope.layout);
    const double ra = raw[ia], rb = raw[ib], sa = stored[ia] / m, sb = stored[ib] / m;
    const double rn = std::hypot(ra, rb), sn = std::hypot(sa, sb);
    if (std::abs(rn - sn) > std::max(1e-4 * std::max(1.0, rn), 8.0 * roundoff * largest))
      return Measured::length_changed;
    double angle = std::atan2(ra * sb - rb * sa, ra * sa + rb * sb);
    if (angle < 0) angle += kTwoPi;
    pairs.push_back({omega(i, d, rope), angle, rn, 0.0});
    longest = std::max(longest, rn);
  }
  // Pairs far shorter than the key measure their angle from rounding noise: leave them
  // out; the others may be off by the noise over their length.
  for (Pair& p : pairs) {
    if (p.weight < 1e-4 * longest || p.weight < 4.0 * noise) p.weight = 0.0;
    if (p.weight > 0.0) p.noise = 2.0 * noise / p.weight;
  }
  return longest > 0.0 ? Measured::rotation : Measured::zero_key;
}

// float32 keys: a few ulps per element (angles of about 1e-7 rad), plus the rounding of
// the angle p * omega when an engine computes it in float32 (the product and inv_freq
// each rounded: 3 ulps of p * omega leaves room).
// A position off by one moves the fastest pair by a whole radian.
double tolerance(double position, const Pair& p) {
  return std::min(0.25, 1e-4 + p.noise + 3.0 * 5.96e-8 * std::abs(position * p.omega));
}

// Unwraps from the lowest frequency to the highest, starting from `start`, and says
// whether the integer result explains every pair.
bool unwrap(const std::vector<Pair>& pairs, double start, std::int64_t& position) {
  double estimate = start;
  for (auto it = pairs.rbegin(); it != pairs.rend(); ++it) {
    if (it->weight == 0.0) continue;
    const double turns = std::round((estimate * it->omega - it->angle) / kTwoPi);
    estimate = (it->angle + turns * kTwoPi) / it->omega;
  }
  position = std::llround(estimate);
  for (const Pair& p : pairs) {
    if (p.weight == 0.0) continue;
    const double residual = wrap(static_cast<double>(position) * p.omega - p.angle);
    if (std::abs(residual) > tolerance(static_cast<double>(position), p)) return false;
  }
  return true;
}

// Every position up to max_position that fits: one candidate per turn of the lowest
// frequency, each refined by the faster pairs.
RecoveredPosition recover_with(const float* raw, const float* stored, int d, const Rope& rope,
                               std::int64_t max_position, double roundoff) {
  RecoveredPosition r;
  if (rope.nope) {  // R(p) is the identity: the stored key is its raw key, or no NoPE key
    for (int i = 0; i < d; ++i) {
      const double a = raw[i], b = stored[i];
      if (!(std::abs(a - b) <= 8.0 * roundoff * std::max(1.0, std::abs(a)))) return r;
    }
    r.status = RecoveredPosition::Status::exact;
    return r;
  }
  std::vector<Pair> pairs;
  switch (measure(raw, stored, d, rope, roundoff, pairs)) {
    case Measured::length_changed:
      return r;
    case Measured::zero_key:
      r.status = RecoveredPosition::Status::ambiguous;
      return r;  // every position fits
    case Measured::rotation:
      break;
  }
  if (std::all_of(pairs.begin(), pairs.end(), [](const Pair& p) { return p.weight == 0.0; })) {
    r.status = RecoveredPosition::Status::ambiguous;  // no pair long enough to measure
    return r;
  }
  const Pair* lowest = nullptr;
  for (auto it = pairs.rbegin(); it != pairs.rend() && lowest == nullptr; ++it)
    if (it->weight > 0.0) lowest = &*it;
  const double period = kTwoPi / lowest->omega;
  std::vector<std::int64_t> found;
  // From turn -1: a small position whose measured angle fell just below zero wraps to 2 pi.
  for (std::int64_t turn = -1; turn * period <= static_cast<double>(max_position) + 1.0; ++turn) {
    std::int64_t p = 0;
    if (unwrap(pairs, lowest->angle / lowest->omega + period * static_cast<double>(turn), p) && p >= 0 &&
        p <= max_position && std::find(found.begin(), found.end(), p) == found.end())
      found.push_back(p);
  }
  if (found.empty()) return r;
  r.position = *std::min_element(found.begin(), found.end());
  const bool unique_in_first_period = found.size() == 1 && static_cast<double>(found[0]) < period;
  r.status = unique_in_first_period ? RecoveredPosition::Status::exact : RecoveredPosition::Status::ambiguous;
  return r;
}

}  // namespace

double lowest_frequency_period(int head_dim, const Rope& rope) {
  const int pairs = reference::rotary_dim(head_dim, rope) / 2;
  double lowest = omega(0, head_dim, rope);
  for (int i = 1; i < pairs; ++i) lowest = std::min(lowest, omega(i, head_dim, rope));
  return kTwoPi / lowest;
}

RecoveredPosition recover_position(const float* raw, const float* stored, int head_dim, const Rope& rope,
                                   std::int64_t max_position, double roundoff, const std::vector<Rope>& other_layers) {
  RecoveredPosition r = recover_with(raw, stored, head_dim, rope, max_position, roundoff);
  if (r.status != RecoveredPosition::Status::not_rotation) return r;
  // Another layer's rope first (SPEC 10.1): a per-layer stack's likeliest mistake.
  for (const Rope& other : other_layers) {
    if (other == rope || other.nope) continue;
    const RecoveredPosition g = recover_with(raw, stored, head_dim, other, max_position, roundoff);
    if (g.status == RecoveredPosition::Status::not_rotation) continue;
    const std::string what = fmt::format("another layer's rope (theta {:g}{})", other.theta,
                                         other.scaling == RopeScaling::none ? std::string()
                                                                            : ", " + std::string(to_string(other.scaling)));
    r.fits = {rope.nope ? OtherRope::Kind::nope_rotated : OtherRope::Kind::other_layer,
              rope.nope ? "a rotation by " + what + " in a NoPE layer" : what, g.position,
              g.status == RecoveredPosition::Status::exact};
    return r;
  }
  if (rope.nope) return r;  // the guesses below vary a rope; a NoPE layer has none
  // Which rope would fit instead: the other layout, a common theta, a linear scaling.
  struct Guess {
    Rope rope;
    OtherRope::Kind kind;
    std::string name;
  };
  std::vector<Guess> guesses;
  const bool mapped = rope.scaling == RopeScaling::llama3 || rope.scaling == RopeScaling::yarn;
  // SPEC 7's variants first: the mistakes made with them are the likelier ones.
  // The magnitude before the maps: a map guess drops yarn's m, and at position 0 every map
  // fits, so a key missing only m would be blamed on the map.
  if (rope.scaling == RopeScaling::yarn) {
    for (const double m : {1.0, rope.attention_factor * rope.attention_factor}) {
      Rope magnitude = rope;
      magnitude.attention_factor = m;
      guesses.push_back({magnitude, OtherRope::Kind::magnitude,
                         m == 1.0 ? std::string("attention factor 1 (keys not scaled by yarn's m)")
                                  : fmt::format("attention factor {:.6g} (m applied twice)", m)});
    }
  }
  if (mapped) {
    for (const bool linear : {true, false}) {
      Rope plain = rope;
      plain.scaling = linear ? RopeScaling::linear : RopeScaling::none;
      guesses.push_back({plain, OtherRope::Kind::frequency_map,
                         linear ? fmt::format("linear scaling {:g} instead of {}", rope.factor, to_string(rope.scaling))
                                : fmt::format("no scaling instead of {}", to_string(rope.scaling))});
    }
  } else {
    Rope llama3 = rope;  // Llama 3.1's config
    llama3.scaling = RopeScaling::llama3;
    llama3.factor = 8.0;
    llama3.low_freq_factor = 1.0;
    llama3.high_freq_factor = 4.0;
    llama3.original_max_position_embeddings = 8192.0;
    guesses.push_back({llama3, OtherRope::Kind::frequency_map, "llama3 scaling (factor 8, Llama 3.1)"});
  }
  {
    Rope dims = rope;
    const bool partial = rope.rotary_dim > 0 && rope.rotary_dim < head_dim;
    dims.rotary_dim = partial ? 0 : head_dim / 2 - (head_dim / 2) % 2;
    if (dims.rotary_dim != 0 || partial)
      guesses.push_back({dims, OtherRope::Kind::rotary_dim,
                         partial ? fmt::format("rotary_dim {} (all dims rotated)", head_dim)
                                 : fmt::format("rotary_dim {} (partial rotary)", dims.rotary_dim)});
  }
  Rope other = rope;
  other.layout = rope.layout == RopeLayout::half ? RopeLayout::interleaved : RopeLayout::half;
  guesses.push_back({other, OtherRope::Kind::layout, fmt::format("layout {}", to_string(other.layout))});
  for (double theta : {10000.0, 500000.0, 1000000.0, 100000.0, 1000.0, 100.0}) {
    if (theta == rope.theta) continue;
    Rope t = rope;
    t.theta = theta;
    guesses.push_back({t, OtherRope::Kind::theta, fmt::format("theta {:g}", theta)});
  }
  for (double factor : {1.0, 2.0, 4.0, 8.0}) {
    const double current = rope.scaling == RopeScaling::linear ? rope.factor : 1.0;
    if (factor == current || mapped) continue;
    Rope s = rope;
    s.scaling = factor == 1.0 ? RopeScaling::none : RopeScaling::linear;
    s.factor = factor;
    guesses.push_back({s, OtherRope::Kind::scaling,
                       factor == 1.0 ? std::string("no scaling") : fmt::format("linear scaling {:g}", factor)});
  }
  for (const Guess& guess : guesses) {
    const RecoveredPosition g = recover_with(raw, stored, head_dim, guess.rope, max_position, roundoff);
    if (g.status != RecoveredPosition::Status::not_rotation) {
      r.fits = {guess.kind, guess.name, g.position, g.status == RecoveredPosition::Status::exact};
      break;
    }
  }
  return r;
}

OtherRope recover_shift_with_other_rope(const float* raw, const float* stored, int head_dim, const Rope& rope,
                                        std::int64_t position, const std::vector<Rope>& other_layers,
                                        std::int64_t max_position, double tolerance) {
  if (rope.nope || position < 0) return {};
  const std::vector<double> k(raw, raw + head_dim), s(stored, stored + head_dim);
  for (const Rope& other : other_layers) {
    if (other == rope || other.nope) continue;
    // The nearest writes first, alternately above (a shift moves keys down) and below.
    for (std::int64_t distance = 1; distance <= max_position; ++distance)
      for (const std::int64_t p0 : {position + distance, position - distance}) {
        if (p0 < 0 || p0 > max_position) continue;
        const std::vector<double> back = reference::unrotate(s, static_cast<double>(position - p0), other);
        const std::vector<double> written = reference::rotate(k, static_cast<double>(p0), rope);
        double worst = 0.0;
        for (int i = 0; i < head_dim; ++i) worst = std::max(worst, std::abs(back[i] - written[i]));
        if (!(worst <= tolerance)) continue;
        const std::string scaling =
            other.scaling == RopeScaling::none ? std::string() : ", " + std::string(to_string(other.scaling));
        return {OtherRope::Kind::other_layer,
                fmt::format("a shift of {} under another layer's rope (theta {:g}{}) after its write at {} under "
                            "its own",
                            position - p0, other.theta, scaling, p0),
                position, true};
      }
  }
  return {};
}

std::string OtherRope::to_string() const {
  if (kind == Kind::none) return "";
  return fmt::format("{} at position {}{}", name, position, exact ? "" : "?");
}

std::string describe(const RecoveredPosition& r) {
  switch (r.status) {
    case RecoveredPosition::Status::exact:
      return std::to_string(r.position);
    case RecoveredPosition::Status::ambiguous:
      return fmt::format("{}?", r.position);
    case RecoveredPosition::Status::not_rotation:
      return r.fits.kind == OtherRope::Kind::none ? std::string("not a rotation") : "fits " + r.fits.to_string();
  }
  return "?";
}

}  // namespace kvcheck
