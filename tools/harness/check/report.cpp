#include "tools/harness/check/report.h"

#include <fmt/color.h>
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "tools/harness/io/atomic_dir.h"

namespace kvcheck {

bool Outcome::passed() const {
  return std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.passed; });
}

const Check* Outcome::first_failure() const {
  for (const Check& c : checks)
    if (!c.passed) return &c;
  return nullptr;
}

namespace {

std::string count_cell(std::int64_t n) { return n < 0 ? "-" : std::to_string(n); }

// Text from files other programs wrote may be any bytes: invalid UTF-8 and control
// characters (which XML 1.0 cannot carry at all) become U+FFFD; newlines and tabs stay.
std::string valid_xml_text(const std::string& s) {
  static const std::string replacement = "\xEF\xBF\xBD";
  std::string out;
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= s.size();
    for (std::size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) >> 6) == 0x2;
    if (ok && len == 1 && c < 0x20 && c != '\n' && c != '\t') ok = false;
    if (ok && len == 2 && c < 0xC2) ok = false;  // overlong
    if (!ok) {
      out += replacement;
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

std::string xml_escape(const std::string& text) {
  const std::string s = valid_xml_text(text);
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// A passed check that left steps unjudged (a crop the cache served, steps a trace
// skipped): shown beside a PASS, which must not hide them.
bool leaves_steps_unjudged(const Check& c) {
  return c.passed && (c.detail.find("not judged") != std::string::npos || c.detail.find("skipped") != std::string::npos);
}

std::string unjudged(const Outcome& o) {
  std::string notes;
  for (const Check& c : o.checks)
    if (leaves_steps_unjudged(c)) notes += c.name + ": " + c.detail + "\n";
  return notes;
}

}  // namespace

void print_table(std::FILE* out, const std::vector<Outcome>& outcomes, bool colour) {
  std::size_t name_width = 8, target_width = 6;
  for (const Outcome& o : outcomes) {
    name_width = std::max(name_width, o.scenario.size());
    target_width = std::max(target_width, o.target.size());
  }
  fmt::print(out, "{:<{}}  {:<{}}  {:>6}  {:>10}  {:>10}  {:>9}  {:>8}  {}\n", "scenario", name_width, "target",
             target_width, "checks", "max error", "nmse", "positions", "retained", "verdict");
  int failed = 0;
  for (const Outcome& o : outcomes) {
    const auto passed_checks = std::count_if(o.checks.begin(), o.checks.end(), [](const Check& c) { return c.passed; });
    const std::string verdict = o.passed() ? "PASS" : "FAIL";
    fmt::print(out, "{:<{}}  {:<{}}  {:>6}  {:>10.3g}  {:>10.3g}  {:>9}  {:>8}  ", o.scenario, name_width, o.target,
               target_width, fmt::format("{}/{}", passed_checks, o.checks.size()), o.max_abs_error, o.nmse,
               count_cell(o.position_mismatches), count_cell(o.retained_mismatches));
    if (colour)
      fmt::print(out, fmt::fg(o.passed() ? fmt::color::green : fmt::color::red) | fmt::emphasis::bold, "{}", verdict);
    else
      fmt::print(out, "{}", verdict);
    fmt::print(out, "\n");
    if (!o.passed()) ++failed;
    for (const Check& c : o.checks)
      if (!c.passed) fmt::print(out, "    {}: {}\n", c.name, c.detail);
    if (o.passed())
      for (const Check& c : o.checks)
        if (leaves_steps_unjudged(c)) fmt::print(out, "    note, {}: {}\n", c.name, c.detail);
  }
  fmt::print(out, "\n{} passed, {} failed\n", outcomes.size() - failed, failed);
}

void write_junit(const std::string& path, const std::vector<Outcome>& outcomes) {
  std::size_t failures = 0;
  std::string cases;
  for (const Outcome& o : outcomes) {
    cases += fmt::format("  <testcase classname=\"kvcheck.{}\" name=\"{}\" time=\"{:.6f}\">\n", xml_escape(o.target),
                         xml_escape(o.scenario), o.seconds);
    // One <failure> per test case (many CI parsers read only one): the first failed check
    // as the message, every failed check in the text.
    std::string text;
    for (const Check& c : o.checks)
      if (!c.passed) text += c.name + ": " + c.detail + "\n";
    if (const Check* first = o.first_failure()) {
      ++failures;
      cases += fmt::format("    <failure message=\"{}\">{}</failure>\n", xml_escape(first->name + ": " + first->detail),
                           xml_escape(text));
    }
    else if (const std::string notes = unjudged(o); !notes.empty())
      cases += fmt::format("    <system-out>{}</system-out>\n", xml_escape(notes));
    cases += "  </testcase>\n";
  }
  const std::string xml = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuite name=\"kvcheck\" tests=\"{}\" failures=\"{}\">\n{}"
      "</testsuite>\n",
      outcomes.size(), failures, cases);
  write_file_atomically(path, xml);
}

namespace {

template <typename T>
nlohmann::json or_null(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

nlohmann::json divergence_json(const std::optional<FirstDivergence>& first) {
  if (!first) return nullptr;
  const FirstDivergence& d = *first;
  return {{"step", d.step},
          {"op", d.op},
          {"source", d.source},
          {"row", d.row},
          {"layer", d.layer},
          {"head", or_null(d.head)},
          {"dim", or_null(d.dim)},
          {"query_token", or_null(d.query_token)},
          {"query_uid", or_null(d.query_uid)},
          {"slot", or_null(d.slot)},
          {"uid", or_null(d.uid)},
          {"token", or_null(d.token)},
          {"expected_distance", or_null(d.expected_distance)},
          {"actual_distance", or_null(d.actual_distance)},
          {"expected_position", or_null(d.expected_position)},
          {"claimed_position", or_null(d.claimed_position)},
          {"expected_output", or_null(d.expected_output)},
          {"actual_output", or_null(d.actual_output)},
          {"verdict", d.verdict},
          {"class", d.class_id},
          {"class_name", d.class_name},
          {"explanation", d.explanation},
          {"where", d.where},
          {"what", d.what}};
}

}  // namespace

void write_json_report(const std::string& path, const std::vector<Outcome>& outcomes) {
  nlohmann::json results = nlohmann::json::array();
  for (const Outcome& o : outcomes) {
    nlohmann::json checks = nlohmann::json::array();
    for (const Check& c : o.checks) checks.push_back({{"name", c.name}, {"passed", c.passed}, {"detail", c.detail}});
    results.push_back({{"scenario", o.scenario},
                       {"file", o.file},
                       {"target", o.target},
                       {"passed", o.passed()},
                       {"max_abs_error", o.max_abs_error},
                       {"nmse", o.nmse},
                       {"position_mismatches", o.position_mismatches},
                       {"retained_mismatches", o.retained_mismatches},
                       {"checks", checks},
                       {"first_divergence", divergence_json(o.first_divergence)}});
  }
  const auto failed = std::count_if(outcomes.begin(), outcomes.end(), [](const Outcome& o) { return !o.passed(); });
  const nlohmann::json report = {{"format", "kvcheck-report-1"},
                                 {"passed", static_cast<std::int64_t>(outcomes.size()) - failed},
                                 {"failed", failed},
                                 {"results", results}};
  // Invalid UTF-8 in a message (file names, a cache's own words) becomes U+FFFD.
  write_file_atomically(path, report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

}  // namespace kvcheck
