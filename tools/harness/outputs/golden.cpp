#include "tools/harness/outputs/golden.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "tools/harness/io/atomic_dir.h"
#include "tools/harness/outputs/export.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/io/npy.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

namespace fs = std::filesystem;

namespace {

// Outputs are doubles from libm's exp and cos, which may differ in the last bit between
// machines; anything beyond that is drift.
constexpr double kOutputTolerance = 1e-9;

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::set<std::string> file_names(const fs::path& dir) {
  std::set<std::string> names;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

// What differs between an old and a new export folder, one line each (empty: same).
// Outputs may differ by kOutputTolerance; every other file must be byte for byte the same.
std::vector<std::string> differences(const fs::path& old_dir, const fs::path& new_dir) {
  std::vector<std::string> lines;
  const auto old_names = file_names(old_dir), new_names = file_names(new_dir);
  for (const std::string& name : old_names)
    if (!new_names.count(name)) lines.push_back(fmt::format("{}: no longer written", name));
  for (const std::string& name : new_names) {
    if (!old_names.count(name)) {
      lines.push_back(fmt::format("{}: missing from the golden", name));
      continue;
    }
    const bool is_output = name.size() > 8 && name.compare(name.size() - 8, 8, "_out.npy") == 0;
    const bool same_bytes = read_bytes(old_dir / name) == read_bytes(new_dir / name);
    if (!is_output) {
      if (!same_bytes) lines.push_back(fmt::format("{}: differs", name));
      continue;
    }
    if (same_bytes) continue;
    const NpyArray<double> a = read_npy_f64((old_dir / name).string());
    const NpyArray<double> b = read_npy_f64((new_dir / name).string());
    if (a.shape != b.shape) {
      lines.push_back(fmt::format("{}: shape {} became {}", name, shape_string(a.shape), shape_string(b.shape)));
      continue;
    }
    double worst = 0.0;
    std::size_t at = 0;
    for (std::size_t i = 0; i < a.data.size(); ++i) {
      if (std::isnan(a.data[i]) && std::isnan(b.data[i])) continue;
      const double d = std::isnan(a.data[i]) != std::isnan(b.data[i]) ? INFINITY : std::abs(a.data[i] - b.data[i]);
      if (d > worst) {
        worst = d;
        at = i;
      }
    }
    if (worst > kOutputTolerance)
      lines.push_back(fmt::format("{}: max difference {:.3g} at flat index {} (golden {:.17g}, now {:.17g})", name,
                                  worst, at, a.data[at], b.data[at]));
  }
  return lines;
}

struct Computed {
  std::string name;
  fs::path folder;
};

// Exports one scenario into `parent`/<name>.
Computed export_into(const std::string& file, const fs::path& parent) {
  const Scenario s = load_scenario(file);
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const fs::path folder = parent / s.name;
  write_export(s, inputs, run, folder.string());
  return {s.name, folder};
}

// "g/" and "g" name the same folder; scratch folders go beside it, not inside.
fs::path folder_path(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  return p.filename().empty() ? p.parent_path() : p;
}

}  // namespace

int generate_goldens(const GoldenOptions& o) {
  const fs::path dir = folder_path(o.dir);
  recover_interrupted(dir);
  // The golden folder holds export folders only; anything else is not ours to replace.
  std::error_code ec;
  if (fs::is_directory(dir, ec))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string()[0] != '.') {
        if (!is_export_folder(e.path().string()))
          throw InputError(e.path().string(), "", "not a golden (export) folder; refusing to replace " + dir.string());
        // A golden is replaced or removed whole: it may hold only what its export wrote.
        check_export_folder(e.path().string(), "--out", o.scenario_files);
      }

  // First every export, so an error in any scenario leaves nothing written and nothing said.
  const AtomicDir scratch(dir.parent_path() / ".kvcheck-golden-scratch");
  std::vector<Computed> computed;
  std::set<std::string> names;
  for (const std::string& file : o.scenario_files) {
    computed.push_back(export_into(file, scratch.path()));
    if (!names.insert(computed.back().name).second)
      throw InputError(
          file, "/name",
          fmt::format("two scenarios are named \"{}\"; golden folders need distinct names", computed.back().name));
  }

  // Then what would change: changed and removed goldens need --force.
  int unchanged = 0, added = 0, changed = 0, removed = 0;
  std::vector<std::string> to_write, to_remove;
  for (const Computed& c : computed) {
    const fs::path old = dir / c.name;
    if (!fs::exists(old)) {
      ++added;
      fmt::print("{}: new\n", c.name);
      to_write.push_back(c.name);
      continue;
    }
    const auto diff = differences(old, c.folder);
    if (diff.empty()) {
      ++unchanged;  // the golden's bytes stay, even where outputs moved within tolerance
      continue;
    }
    ++changed;
    fmt::print("{}: changed{}\n", c.name, o.force ? "" : " (not overwritten)");
    for (const std::string& line : diff) fmt::print("    {}\n", line);
    to_write.push_back(c.name);
  }
  if (o.prune)
    for (const std::string& name : file_names(dir))
      if (!names.count(name) && name[0] != '.') {
        ++removed;
        fmt::print("{}: no such scenario{}\n", name, o.force ? ", removed" : " (not removed)");
        to_remove.push_back(name);
      }
  if ((changed > 0 || removed > 0) && !o.force) {
    fmt::print(stderr,
               "kvcheck: goldens would change; nothing was written. Rerun with --force to apply the "
               "changes listed above.\n");
    return 1;
  }

  // Last, one swap: the old folder with the changes applied replaces the old folder.
  AtomicDir staging(dir);
  // The user's dotfiles beside the goldens come along as they are, links as links.
  if (fs::is_directory(dir)) fs::copy(dir, staging.path(), fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  for (const std::string& name : to_remove) fs::remove_all(staging.path() / name);
  for (const std::string& name : to_write) {
    fs::remove_all(staging.path() / name);
    fs::copy(scratch.path() / name, staging.path() / name, fs::copy_options::recursive);
  }
  staging.commit();
  fmt::print("{}: {} new, {} changed, {} unchanged, {} removed\n", dir.string(), added, changed, unchanged, removed);
  return 0;
}

int check_goldens(const GoldenOptions& o) {
  recover_interrupted(folder_path(o.dir));
  std::error_code ec;
  if (!fs::is_directory(o.dir, ec)) throw InputError(o.dir, "", "no such golden folder");
  int drifted = 0;
  const AtomicDir scratch(folder_path(o.dir).parent_path() / ".kvcheck-golden-check");
  for (const std::string& file : o.scenario_files) {
    const Computed c = export_into(file, scratch.path());
    const fs::path golden = fs::path(o.dir) / c.name;
    if (!fs::is_directory(golden)) {
      ++drifted;
      fmt::print("{}: no golden in {} (run `kvcheck golden generate {} --out {}`)\n", c.name, o.dir, file, o.dir);
      continue;
    }
    const auto diff = differences(golden, c.folder);
    if (diff.empty()) {
      fmt::print("{}: matches\n", c.name);
      continue;
    }
    ++drifted;
    fmt::print("{}: DRIFT, first: {}{}\n", c.name, diff.front(),
               diff.size() > 1 ? fmt::format(" (and {} more files)", diff.size() - 1) : "");
  }
  fmt::print("\n{} passed, {} failed\n", o.scenario_files.size() - drifted, drifted);
  return drifted == 0 ? 0 : 1;
}

}  // namespace kvcheck
