// kvcheck never destroys or overwrites a file it did not write. Every command that writes
// checks its outputs here, before any work (docs/trust.md, "Files kvcheck writes"):
// - a report (--json, --junit, --html) may not be, or link to, a file the command reads,
//   and may replace an existing file only when that file is a previous kvcheck report of
//   the same kind, or with --force;
// - a folder kvcheck replaces whole (export --out, golden generate --out, llamacpp --trace)
//   may hold only what an earlier run of the same command wrote, as that run listed it.
#pragma once

#include <filesystem>
#include <set>
#include <string>
#include <vector>

namespace kvcheck {

struct Scenario;

enum class ReportKind { junit, json, html };

struct ReportPath {
  std::string option;  // "--json"
  std::string path;    // as given; empty: not asked for
  ReportKind kind;
};

// Refuses (InputError, exit 2) a report path that is one of `inputs` (the same file, through
// links and hard links), that two reports share, that is a folder or lies in no folder, or
// that holds an existing file other than an empty one or a previous report of its kind
// (unless `force`). "-" and streams are written through, never replaced, and pass.
void check_report_paths(const std::vector<ReportPath>& reports, const std::vector<std::string>& inputs, bool force);

// The files a scenario makes the command read: the scenario and its .npy inputs.
std::vector<std::string> scenario_input_files(const Scenario& scenario);

// Every regular file under `folder` (a trace the command reads), links not followed.
std::vector<std::string> files_under(const std::filesystem::path& folder);

// Refuses an existing folder `dir` that holds anything but the relative paths in `owned`
// (folders included, links not followed), naming the first foreign entry in sorted order,
// or that holds one of `inputs`. A missing folder passes. `what` names the writer's files
// in the message ("an earlier export's").
void check_folder_holds_only(const std::filesystem::path& dir, const std::string& option,
                             const std::set<std::string>& owned, const std::string& what,
                             const std::vector<std::string>& inputs);

}  // namespace kvcheck
