#include "reference/rope.h"

#include <cmath>
#include <stdexcept>

namespace kvcheck::reference {

double inverse_frequency(int pair, int head_dim, const Rope& rope) {
  return std::pow(rope.theta, -2.0 * pair / head_dim);
}

double rope_angle(int pair, int head_dim, double position, const Rope& rope) {
  const double scaled = rope.scaling == RopeScaling::linear ? position / rope.factor : position;
  return scaled * inverse_frequency(pair, head_dim, rope);
}

std::vector<double> rotate(const std::vector<double>& x, double position, const Rope& rope) {
  const int d = static_cast<int>(x.size());
  if (d % 2 != 0) throw std::invalid_argument("rotate: head_dim must be even");
  std::vector<double> out(x.size());
  for (int i = 0; i < d / 2; ++i) {
    // Which two elements form pair i: rotate_half pairs the two halves, interleaved
    // pairs neighbours.
    const int ia = rope.layout == RopeLayout::half ? i : 2 * i;
    const int ib = rope.layout == RopeLayout::half ? i + d / 2 : 2 * i + 1;
    const double angle = rope_angle(i, d, position, rope);
    const double c = std::cos(angle), s = std::sin(angle);
    out[ia] = x[ia] * c - x[ib] * s;
    out[ib] = x[ia] * s + x[ib] * c;
  }
  return out;
}

}  // namespace kvcheck::reference
