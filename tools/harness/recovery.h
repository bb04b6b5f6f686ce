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
    exact,         // a pure rotation at `position`, below the lowest frequency's period
    ambiguous,     // fits `position`, but only beyond that period (others may fit too)
    not_rotation,  // no pure rotation of the raw key under this rope
  } status = Status::not_rotation;
  std::int64_t position = 0;
  std::string fits;  // for not_rotation: the rope that fits instead, e.g. "layout interleaved at 7"
};

// The integer position p with stored = R(p) raw under `rope`, unwrapping the pair angles
// from the lowest frequency to the highest. Float32 stored keys are expected.
RecoveredPosition recover_position(const float* raw, const float* stored, int head_dim, const Rope& rope);

// The period of the lowest frequency, in positions: below it a position is unique.
double lowest_frequency_period(int head_dim, const Rope& rope);

std::string describe(const RecoveredPosition& r);

}  // namespace kvcheck
