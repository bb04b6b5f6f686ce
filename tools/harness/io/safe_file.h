// Reading files that other programs wrote without trusting them: regular files only
// (never blocking on a FIFO or reading a device without end), never more than a cap, and
// names from inside a file resolved inside that file's folder unless allowed out.
#pragma once

#include <cstdint>
#include <string>

namespace kvcheck {

// The whole file, or InputError naming it: not a regular file, larger than `max_bytes`,
// unreadable. `what` says what the file is ("scenario", ".npy file").
std::string read_file_checked(const std::string& path, std::uint64_t max_bytes, const char* what);

// The size of a regular file, with the same refusals as read_file_checked.
std::uint64_t regular_file_size(const std::string& path, const char* what);

// `name`, as written in `file` at JSON path `json_path`, resolved against `base_dir`.
// The result (symbolic links followed) must stay inside `base_dir` unless
// g_allow_outside_paths: InputError otherwise, naming the file and the field.
std::string resolve_inside(const std::string& base_dir, const std::string& name, const std::string& file,
                           const std::string& json_path);

// Whether names in scenarios and traces may lead out of their folder: set once, by the
// command line's --allow-outside-paths, before anything is read.
extern bool g_allow_outside_paths;

}  // namespace kvcheck
