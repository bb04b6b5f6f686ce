// The export folder of SPEC 6: manifest.json, q/k/v.npy, stepNNN_out.npy,
// stepNNN_cache.json. Written into a temporary folder and renamed into place.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "reference/model.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// Refuses (InputError) to replace an existing folder that is not an export, so a stray
// --out never deletes a user's folder.
void write_export(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run,
                  const std::string& out_dir);

// Does `dir` hold a kvcheck export (manifest.json with format kvcheck-export-1)?
bool is_export_folder(const std::string& dir);

// What an earlier export in `dir` wrote, as its manifest lists it: manifest.json and every
// file name its "inputs" and "steps" give (plain names only: a manifest cannot claim a
// subfolder or a path outside). Empty when `dir` holds no export.
std::set<std::string> export_listed_files(const std::string& dir);

// Refuses, before any work, an export or golden folder `dir` that holds anything but what
// an earlier export listed, or one of `inputs` (the files the command reads).
void check_export_folder(const std::string& dir, const std::string& option, const std::vector<std::string>& inputs);

// "step007"
std::string step_stem(std::size_t index);

}  // namespace kvcheck
