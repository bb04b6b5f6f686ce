// One table per enum a scenario file spells: each value with its name, in the order the
// file's documentation lists them. Printing and parsing both read the table, so a value
// added in one place is spelled the same everywhere.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvcheck {

template <class Enum>
struct EnumName {
  Enum value;
  const char* name;
};

template <class Enum, std::size_t N>
const char* name_in(const EnumName<Enum> (&table)[N], Enum value) {
  for (const EnumName<Enum>& row : table)
    if (row.value == value) return row.name;
  return "?";
}

template <class Enum, std::size_t N>
std::optional<Enum> value_in(const EnumName<Enum> (&table)[N], std::string_view name) {
  for (const EnumName<Enum>& row : table)
    if (name == row.name) return row.value;
  return std::nullopt;
}

// Every name, in the table's order (what a parser offers).
template <class Enum, std::size_t N>
std::vector<std::string> names_in(const EnumName<Enum> (&table)[N]) {
  std::vector<std::string> names;
  for (const EnumName<Enum>& row : table) names.emplace_back(row.name);
  return names;
}

}  // namespace kvcheck
