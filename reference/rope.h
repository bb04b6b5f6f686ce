// RoPE in double precision, written straight from SPEC section 2.
#pragma once

#include <vector>

#include "reference/model.h"

namespace kvcheck::reference {

// theta^(-2i/D) for pair i.
double inverse_frequency(int pair, int head_dim, const Rope& rope);

// The angle of pair i at position p: (p / factor) * inv_freq_i under linear scaling.
double rope_angle(int pair, int head_dim, double position, const Rope& rope);

// R(p) x: each pair (a, b) becomes (a cos - b sin, a sin + b cos). The layout decides
// which elements form pair i. A negative position rotates back.
std::vector<double> rotate(const std::vector<double>& x, double position, const Rope& rope);

}  // namespace kvcheck::reference
