// The export folder of SPEC 6: manifest.json, q/k/v.npy, stepNNN_out.npy,
// stepNNN_cache.json. Written into a temporary folder and renamed into place.
#pragma once

#include <string>

#include "reference/model.h"
#include "tools/harness/reference_run.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

// Refuses (InputError) to replace an existing folder that is not an export, so a stray
// --out never deletes a user's folder.
void write_export(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run,
                  const std::string& out_dir);

// Does `dir` hold a kvcheck export (manifest.json with format kvcheck-export-1)?
bool is_export_folder(const std::string& dir);

// "step007"
std::string step_stem(std::size_t index);

}  // namespace kvcheck
