// Random scenarios for the randomized suite, from a splitmix64 stream (no std::
// distributions), as JSON text so a failing one can be saved as a fixture.
#pragma once

#include <cstdint>
#include <string>

namespace kvcheck::testing {

std::string random_scenario_json(std::uint64_t seed);

}  // namespace kvcheck::testing
