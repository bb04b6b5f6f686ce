// Golden fixtures: the reference's export of each scenario, committed under
// fixtures/golden/<scenario>/, so implementations that cannot link C++ pin its results.
#pragma once

#include <string>
#include <vector>

namespace kvcheck {

struct GoldenOptions {
  std::vector<std::string> scenario_files;  // resolved scenario files
  std::string dir;                          // the golden folder
  bool force = false;                       // generate: overwrite goldens that changed
  bool prune = false;                       // generate: remove goldens of scenarios not given
};

// Writes every scenario's export into `dir` atomically (all or nothing). Refuses, and
// returns 1, when an existing golden would change and `force` is not set; prints what
// changed either way. Outputs within 1e-9 of the golden count as unchanged (libm may
// differ in the last bit between machines), and the golden's bytes are kept.
// Returns 0 on success.
int generate_goldens(const GoldenOptions& options);

// Recomputes every scenario and compares with its golden: inputs, manifests and cache
// files byte for byte, outputs within 1e-9. Prints the first drift per scenario.
// Returns 0 when all match, 1 otherwise.
int check_goldens(const GoldenOptions& options);

}  // namespace kvcheck
