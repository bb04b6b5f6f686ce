// Bad input: the file, the JSON path of the field and what was expected (exit status 2).
// Every reader throws it, so it lives below them all and knows no scenario.
#pragma once

#include <stdexcept>
#include <string>

namespace kvcheck {

struct InputError : std::runtime_error {
  std::string file, path, reason;
  InputError(std::string file_, std::string path_, std::string reason_);
};

}  // namespace kvcheck
