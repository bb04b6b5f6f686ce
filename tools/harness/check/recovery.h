// Recovering what a cache stored from its tensors alone (SPEC 5.5): the rotary position
// of a stored key, and which token a slot holds, found from its value vector.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "reference/model.h"

namespace kvcheck {

// A rope other than the declared one under which a key is a pure rotation.
struct OtherRope {
  enum class Kind {
    none,
    layout,
    theta,
    scaling,
    frequency_map,
    rotary_dim,
    magnitude,
    other_layer,   // SPEC 10.1: another layer's rope (its theta, scaling or dims)
    nope_rotated,  // SPEC 10.1: a NoPE layer's key, rotated by a rope of the scenario
  } kind = Kind::none;
  // "layout interleaved", "theta 500000", "linear scaling 4", "linear scaling 8 instead of
  // llama3", "rotary_dim 16 (all dims)", "attention factor 1 (keys not scaled)"
  std::string name;
  std::int64_t position = 0;
  bool exact = false;
  std::string to_string() const;  // "layout interleaved at position 37" ("...37?" when ambiguous)
};

struct RecoveredPosition {
  enum class Status {
    exact,         // the only position up to max_position that fits, and below the lowest frequency's period
    ambiguous,     // fits `position` (the smallest that fits), but beyond that period or not alone
    not_rotation,  // no pure rotation of the raw key under this rope, at any position up to max_position
  } status = Status::not_rotation;
  std::int64_t position = 0;
  OtherRope fits;  // for not_rotation: the rope that fits instead, if any
};

// The unit roundoff of a storage format: what a stored element may be off by, relative.
constexpr double kFloat32Roundoff = 0x1p-24, kFloat16Roundoff = 0x1p-11, kBfloat16Roundoff = 0x1p-8;
constexpr double unit_roundoff(KvDtype d) {
  return d == KvDtype::float32 ? kFloat32Roundoff : d == KvDtype::float16 ? kFloat16Roundoff : kBfloat16Roundoff;
}

// The integer position p with stored = R(p) raw under `rope`, among 0 .. max_position:
// the pair angles are unwrapped from the lowest frequency to the highest, starting from
// every turn of the lowest frequency that stays below max_position. Float32 keys, even
// with angles computed in float32 and re-rotated many times, are expected to fit. Give
// the largest position the scenario can reach: a looser bound admits false fits.
// `roundoff` is the unit roundoff of the stored key's format (float16 traces: 2^-11).
// A NoPE rope (SPEC 10.1) fits only an unrotated key (position 0, exact). `other_layers`:
// the scenario's ropes of other layers, tried first when the key fits no rotation under
// `rope` (a layer rotated with another layer's rope, or a NoPE layer's key rotated).
RecoveredPosition recover_position(const float* raw, const float* stored, int head_dim, const Rope& rope,
                                   std::int64_t max_position = std::int64_t{1} << 17,
                                   double roundoff = kFloat32Roundoff, const std::vector<Rope>& other_layers = {});

// A key that fits no rotation under `rope` nor under any other layer's, expected at
// `position`: was it written at some p0 under `rope` and moved since by position - p0
// under another layer's rope? That composition R_other(p - p0) R_own(p0) k is
// what a context shift with one rope for every layer leaves in a layer of its own rope
// (llama.cpp issue 12357: Gemma 3's sliding layers shifted with the global base). Tries
// every p0 in 0 .. max_position, nearest first; a fit is within `tolerance` (max abs, the
// rotation check's own bar). Returns the fit (kind other_layer), or kind none. O(max_position
// x head_dim) rotations: a caller on a failure path bounds how often it asks.
OtherRope recover_shift_with_other_rope(const float* raw, const float* stored, int head_dim, const Rope& rope,
                                        std::int64_t position, const std::vector<Rope>& other_layers,
                                        std::int64_t max_position, double tolerance);

// The period of the lowest frequency, in positions: below it a position is unique.
double lowest_frequency_period(int head_dim, const Rope& rope);

std::string describe(const RecoveredPosition& r);

}  // namespace kvcheck
