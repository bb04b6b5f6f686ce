// Recovering what a cache stored from its tensors alone (SPEC 5.5): the rotary position
// of a stored key, and which token a slot holds, found from its value vector.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "reference/model.h"

namespace kvcheck {

struct RecoveredPosition {
  enum class Status {
    exact,         // the only position up to max_position that fits, and below the lowest frequency's period
    ambiguous,     // fits `position` (the smallest that fits), but beyond that period or not alone
    not_rotation,  // no pure rotation of the raw key under this rope, at any position up to max_position
  } status = Status::not_rotation;
  std::int64_t position = 0;
  std::string fits;  // for not_rotation: the rope that fits instead, e.g. "layout interleaved at 7"
};

// The integer position p with stored = R(p) raw under `rope`, among 0 .. max_position:
// the pair angles are unwrapped from the lowest frequency to the highest, starting from
// every turn of the lowest frequency that stays below max_position. Float32 keys, even
// with angles computed in float32 and re-rotated many times, are expected to fit. Give
// the largest position the scenario can reach: a looser bound admits false fits.
RecoveredPosition recover_position(const float* raw, const float* stored, int head_dim, const Rope& rope,
                                   std::int64_t max_position = std::int64_t{1} << 17);

// The period of the lowest frequency, in positions: below it a position is unique.
double lowest_frequency_period(int head_dim, const Rope& rope);

std::string describe(const RecoveredPosition& r);

}  // namespace kvcheck
