// Random scenarios for the randomized suite, from a splitmix64 stream (no std::
// distributions), as JSON text so a failing one can be saved as a fixture.
#pragma once

#include <cstdint>
#include <string>

namespace kvcheck::testing {

std::string random_scenario_json(std::uint64_t seed);

// A candidate for the sweep of random valid scenarios (tests/test_sweep.cpp): the scenario of
// random_scenario_json(seed) with, at random, SPEC 9's storage (formats, granularities, scale
// dtypes, static and frozen scales, residuals and their flush rules, Hadamard) and SPEC 8's
// paging. Not every candidate is valid: the sweep keeps those the parser accepts, as a
// user's file would be judged, and draws again (`attempt`) for the others.
std::string random_sweep_candidate_json(std::uint64_t seed, int attempt);

}  // namespace kvcheck::testing
