// The raw q/k/v of a scenario, from its generator seed, its .npy files or inline arrays.
#pragma once

#include "reference/model.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// Throws InputError naming the file and the expected shape when given arrays do not fit.
InputTable load_inputs(const Scenario& scenario);

}  // namespace kvcheck
