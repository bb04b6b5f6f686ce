#include "tools/harness/io/input_error.h"

#include <fmt/format.h>

#include <utility>

namespace kvcheck {

InputError::InputError(std::string file_, std::string path_, std::string reason_)
    : std::runtime_error(path_.empty()
                             ? fmt::format("{}: {}", file_.empty() ? "<scenario>" : file_, reason_)
                             : fmt::format("{}: {}: {}", file_.empty() ? "<scenario>" : file_, path_, reason_)),
      file(std::move(file_)),
      path(std::move(path_)),
      reason(std::move(reason_)) {}

}  // namespace kvcheck
