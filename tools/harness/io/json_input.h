// Parsing JSON that other programs wrote: bounded in size and depth, no key twice in an
// object, and every error an InputError naming the file, the JSON path and the position.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace kvcheck {

constexpr std::uint64_t kMaxJsonBytes = std::uint64_t{64} << 20;  // scenarios, manifests
constexpr int kMaxJsonDepth = 64;

nlohmann::json parse_json(const std::string& text, const std::string& file);

}  // namespace kvcheck
