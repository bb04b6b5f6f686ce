// What a run found, per scenario and target (the reference itself or one cache), and the
// three ways to show it: a table, JUnit XML, JSON.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace kvcheck {

struct Check {
  std::string name;
  bool passed = true;
  std::string detail;  // why it failed, or what it measured
};

// Where a cache first diverged from the reference, as fields (verify, diagnose and run
// --json): every field a script needs to find the step, row, slot and token, and the class.
struct FirstDivergence {
  std::size_t step = 0;  // as numbered in reports (decode expanded)
  std::string op;        // as written in the scenario ("decode")
  std::string source;    // JSON path of the scenario's step ("/steps/1")
  int row = 0, layer = 0;
  std::optional<int> head, dim;                                      // of the first wrong output
  std::optional<std::int64_t> query_token, query_uid;                // the divergent query (token index, uid)
  std::optional<std::int64_t> slot, uid, token;                      // the slot that went wrong, its uid and token
  std::optional<std::int64_t> expected_distance, actual_distance;    // Pq - Pk for that slot
  std::optional<std::int64_t> expected_position, claimed_position;   // Pk
  std::optional<double> expected_output, actual_output;              // of the first wrong output element
  std::string verdict;     // the slot's verdict ("missing: the cache dropped it")
  std::string class_id;    // "shift_one_token_early"
  std::string class_name;  // "shift one token early"
  std::string explanation;
  std::string where;  // the text report's first line: "step 3 (decode, /steps/1), row 0, layer 0, ..."
  std::string what;   // its second line: the slot or output that went wrong
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
  std::optional<FirstDivergence> first_divergence;  // a cache's, when it diverged

  bool passed() const;
  const Check* first_failure() const;
};

void print_table(std::FILE* out, const std::vector<Outcome>& outcomes, bool colour);
void write_junit(const std::string& path, const std::vector<Outcome>& outcomes);
void write_json_report(const std::string& path, const std::vector<Outcome>& outcomes);

}  // namespace kvcheck
