// RoPE in double precision, written straight from SPEC sections 2 and 7.
#pragma once

#include <vector>

#include "reference/model.h"

namespace kvcheck::reference {

// R: the dims that rotate (rope.rotary_dim, or every dim).
int rotary_dim(int head_dim, const Rope& rope);

// The inverse frequency of pair i (i < R/2): theta^(-2i/R), then the scaling's map (llama3,
// yarn). Linear scaling divides the position instead (rope_angle), as SPEC 2 writes it.
double inverse_frequency(int pair, int head_dim, const Rope& rope);

// The angle of pair i at position p: (p / factor under linear scaling) * inv_freq_i.
double rope_angle(int pair, int head_dim, double position, const Rope& rope);

// m: what cos and sin are multiplied by (yarn's attention factor; 1 otherwise).
double rope_magnitude(const Rope& rope);

// The two elements that form pair i inside the first R dims: rotate_half pairs the two
// halves of R, interleaved pairs neighbours.
int pair_first(int pair, RopeLayout layout);
int pair_second(int pair, int rotary, RopeLayout layout);

// m R(p) x: each pair (a, b) of the first R dims becomes m (a cos - b sin, a sin + b cos);
// the other dims pass through. A negative position rotates the other way.
std::vector<double> rotate(const std::vector<double>& x, double position, const Rope& rope);

// SPEC 10.3: what a NoPE layer's query at position p is multiplied by,
// log1p(floor((p + 1) / F)) * a + 1 (floor of a non-negative quotient: integer division).
double query_temperature(const QueryTemperature& t, std::int64_t position);

// The inverse: x = unrotate(rotate(x, p), p).
std::vector<double> unrotate(const std::vector<double>& y, double position, const Rope& rope);

}  // namespace kvcheck::reference
