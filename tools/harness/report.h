// What a run found, per scenario and target (the reference itself or one cache), and the
// three ways to show it: a table, JUnit XML, JSON.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kvcheck {

struct Check {
  std::string name;
  bool passed = true;
  std::string detail;  // why it failed, or what it measured
};

struct Outcome {
  std::string scenario;
  std::string file;
  std::string target;  // "reference" or a cache name
  std::vector<Check> checks;
  double max_abs_error = 0.0;  // outputs vs the reference (or the largest invariance gap)
  double nmse = 0.0;
  std::int64_t position_mismatches = -1;  // -1: not measured
  std::int64_t retained_mismatches = -1;
  double seconds = 0.0;

  bool passed() const;
  const Check* first_failure() const;
};

void print_table(std::FILE* out, const std::vector<Outcome>& outcomes, bool colour);
void write_junit(const std::string& path, const std::vector<Outcome>& outcomes);
void write_json_report(const std::string& path, const std::vector<Outcome>& outcomes);

}  // namespace kvcheck
