#include "tools/harness/outputs/output_guard.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "tools/harness/io/atomic_dir.h"
#include "tools/harness/io/json_input.h"
#include "tools/harness/io/safe_file.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

namespace fs = std::filesystem;

namespace {

// A file's identity, through links: two names of one file (a link, a hard link) agree.
using FileId = std::pair<dev_t, ino_t>;

bool file_id(const fs::path& path, FileId& id) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  id = {st.st_dev, st.st_ino};
  return true;
}

std::string first_bytes(const fs::path& path, std::size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  text.resize(static_cast<std::size_t>(in.gcount()));
  return text;
}

// Whether `path` holds what kvcheck writes for a report of `kind` (report.cpp,
// diagnose_report.cpp): only such a file is replaced without --force.
bool is_previous_report(const fs::path& path, ReportKind kind) {
  switch (kind) {
    case ReportKind::junit:
      return first_bytes(path, 64).rfind("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuite name=\"kvcheck\"", 0) == 0;
    case ReportKind::html:
      return first_bytes(path, 96).rfind("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvcheck ", 0) == 0;
    case ReportKind::json:
      try {
        const nlohmann::json j = parse_json(read_file_checked(path.string(), kMaxJsonBytes, "report"), path.string());
        return j.is_object() && j.value("format", "") == "kvcheck-report-1";
      } catch (const InputError&) {
        return false;
      }
  }
  return false;
}

const char* kind_name(ReportKind kind) {
  switch (kind) {
    case ReportKind::junit: return "JUnit";
    case ReportKind::json: return "JSON";
    case ReportKind::html: return "HTML";
  }
  return "";
}

}  // namespace

void check_report_paths(const std::vector<ReportPath>& reports, const std::vector<std::string>& inputs, bool force) {
  std::map<FileId, std::string> read;
  for (const std::string& input : inputs) {
    FileId id;
    if (file_id(input, id)) read.emplace(id, input);
  }
  std::map<fs::path, std::string> claimed;  // resolved path -> option, for two reports on one file
  for (const ReportPath& r : reports) {
    if (r.path.empty() || r.path == "-") continue;
    const OutputTarget target = resolve_output(r.path);
    FileId id;
    const bool exists = file_id(target.path, id);
    if (exists && read.count(id))
      throw InputError(r.path, "",
                       fmt::format("{}: refusing to write the report over {}, which this command reads", r.option,
                                   read.at(id)));
    if (target.stream) continue;  // appended to, never replaced
    const fs::path key = fs::weakly_canonical(target.path);
    if (auto [it, fresh] = claimed.emplace(key, r.option); !fresh)
      throw InputError(r.path, "", fmt::format("{} and {} name the same file", it->second, r.option));
    std::error_code ec;
    if (fs::is_directory(target.path, ec))
      throw InputError(r.path, "", fmt::format("{}: is a folder; expected a file name to write", r.option));
    const fs::path parent = target.path.parent_path();
    if (!parent.empty() && !fs::is_directory(parent, ec))
      throw InputError(r.path, "", fmt::format("{}: no such folder to write into: {}", r.option, parent.string()));
    if (exists && !force && fs::file_size(target.path, ec) > 0 && !is_previous_report(target.path, r.kind))
      throw InputError(r.path, "",
                       fmt::format("{}: refusing to replace a file that is not a kvcheck {} report (--force "
                                   "replaces it)",
                                   r.option, kind_name(r.kind)));
  }
}

std::vector<std::string> scenario_input_files(const Scenario& scenario) {
  std::vector<std::string> files = {scenario.file};
  if (scenario.inputs.kind == InputSource::Kind::npy)
    for (const std::string* p : {&scenario.inputs.q_path, &scenario.inputs.k_path, &scenario.inputs.v_path})
      files.push_back(*p);
  return files;
}

std::vector<std::string> files_under(const fs::path& folder) {
  std::vector<std::string> files;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return files;
  for (auto it = fs::recursive_directory_iterator(folder, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec))
    if (it->is_regular_file(ec)) files.push_back(it->path().string());
  return files;
}

void check_folder_holds_only(const fs::path& dir, const std::string& option, const std::set<std::string>& owned,
                             const std::string& what, const std::vector<std::string>& inputs) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  std::map<FileId, std::string> read;
  for (const std::string& input : inputs) {
    FileId id;
    if (file_id(input, id)) read.emplace(id, input);
  }
  std::vector<std::string> foreign;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    const std::string rel = it->path().lexically_relative(dir).generic_string();
    FileId id;
    if (!it->is_symlink(ec) && file_id(it->path(), id) && read.count(id))
      throw InputError(dir.string(), "",
                       fmt::format("{}: refusing to replace this folder: it holds {}, which this command reads",
                                   option, read.at(id)));
    if (!owned.count(rel)) {
      foreign.push_back(rel);
      if (it->is_directory(ec) && !it->is_symlink(ec)) it.disable_recursion_pending();
    }
  }
  if (ec) throw InputError(dir.string(), "", fmt::format("{}: cannot read the folder ({})", option, ec.message()));
  if (!foreign.empty()) {
    std::sort(foreign.begin(), foreign.end());
    throw InputError(dir.string(), "",
                     fmt::format("{}: refusing to replace this folder: {} is not one of {} files (move it away, or "
                                 "choose a new or empty folder)",
                                 option, foreign.front(), what));
  }
}

}  // namespace kvcheck
