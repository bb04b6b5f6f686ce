// The scenario parser's reader: one JSON document, every message naming the file and the JSON
// path (exit 2, io/input_error.h). Shared by the parser's sections (parse_sections.h).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "reference/enum_names.h"
#include "tools/harness/io/input_error.h"

namespace kvcheck::scenario_parse {

using json = nlohmann::json;

inline std::string describe(const json& j) {
  std::string s = j.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

inline std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// Reads one JSON document, keeping the file name for every message.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& reason) const {
    throw InputError(file_, path, reason);
  }

  void object(const json& j, const std::string& path, std::initializer_list<const char*> allowed) const {
    if (!j.is_object()) fail(path, "expected an object, got " + describe(j));
    for (const auto& item : j.items()) {
      const std::string& key = item.key();
      if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return key == a; })) {
        std::vector<std::string> names(allowed.begin(), allowed.end());
        fail(path + "/" + key, fmt::format("unknown key \"{}\" (expected one of: {})", key, join(names)));
      }
    }
  }

  const json& field(const json& obj, const std::string& path, const char* key) const {
    if (!obj.contains(key)) fail(path + "/" + key, "missing required field");
    return obj.at(key);
  }

  // Sizes are capped well below what would overflow an int or exhaust memory, so a
  // typo such as 10000000000 is an error, not a crash.
  std::int64_t integer(const json& j, const std::string& path, std::int64_t min,
                       std::int64_t max = std::int64_t{1} << 24) const {
    if (!j.is_number_integer()) fail(path, "expected an integer, got " + describe(j));
    if (j.is_number_unsigned() && j.get<std::uint64_t>() > static_cast<std::uint64_t>(max))
      fail(path, fmt::format("expected an integer <= {}, got {}", max, describe(j)));
    const std::int64_t v = j.get<std::int64_t>();
    if (v < min) fail(path, fmt::format("expected an integer >= {}, got {}", min, v));
    if (v > max) fail(path, fmt::format("expected an integer <= {}, got {}", max, v));
    return v;
  }

  double number(const json& j, const std::string& path, bool allow_zero) const {
    if (!j.is_number()) fail(path, "expected a number, got " + describe(j));
    const double v = j.get<double>();
    if (!std::isfinite(v) || v < 0 || (!allow_zero && v == 0))
      fail(path, fmt::format("expected a {} number, got {}", allow_zero ? "non-negative" : "positive", describe(j)));
    return v;
  }

  std::string string(const json& j, const std::string& path) const {
    if (!j.is_string()) fail(path, "expected a string, got " + describe(j));
    return j.get<std::string>();
  }

  // One of an enum's names (reference/enum_names.h), as its value.
  template <class Enum, std::size_t N>
  Enum named(const json& j, const std::string& path, const EnumName<Enum> (&table)[N]) const {
    return *value_in(table, choice(j, path, names_in(table)));
  }
  std::string choice(const json& j, const std::string& path, const std::vector<std::string>& options) const {
    const std::string v = string(j, path);
    if (std::find(options.begin(), options.end(), v) == options.end())
      fail(path, fmt::format("expected one of {}, got \"{}\"", join(options), v));
    return v;
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

// What SPEC 9 defines but kvcheck's caches do not implement yet is refused by name, so a
// scenario never passes on a convention it did not get.
[[noreturn]] inline void not_yet(const Reader& r, const std::string& path, const std::string& what,
                                 const char* section = "SPEC 9") {
  r.fail(path, what + " is in " + section + ", but kvcheck's caches do not implement it yet");
}

}  // namespace kvcheck::scenario_parse
