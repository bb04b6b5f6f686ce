#include "tools/harness/io/safe_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tools/harness/io/input_error.h"

namespace kvcheck {

namespace fs = std::filesystem;

bool g_allow_outside_paths = false;

namespace {

// Opens without blocking (a FIFO with no writer would hang a plain open) and checks the
// file is regular before reading a byte.
int open_regular(const std::string& path, const char* what, std::uint64_t& size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int e = errno;
    throw InputError(path, "", fmt::format("cannot open the {}: {}", what, std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path, "",
                     fmt::format("expected a regular file as the {} (not a folder, FIFO, socket or device)", what));
  }
  size = static_cast<std::uint64_t>(st.st_size);
  return fd;
}

}  // namespace

std::uint64_t regular_file_size(const std::string& path, const char* what) {
  std::uint64_t size = 0;
  ::close(open_regular(path, what, size));
  return size;
}

std::string read_file_checked(const std::string& path, std::uint64_t max_bytes, const char* what) {
  std::uint64_t size = 0;
  const int fd = open_regular(path, what, size);
  if (size > max_bytes) {
    ::close(fd);
    throw InputError(path, "", fmt::format("the {} is {} bytes; kvcheck reads at most {}", what, size, max_bytes));
  }
  std::string data(size, '\0');
  std::size_t got = 0;
  while (got < size) {
    const ssize_t n = ::read(fd, data.data() + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      throw InputError(path, "",
                       n == 0 ? fmt::format("the {} shrank while it was read", what)
                              : fmt::format("cannot read the {}: {}", what, std::strerror(e)));
    }
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return data;
}

std::string resolve_inside(const std::string& base_dir, const std::string& name, const std::string& file,
                           const std::string& json_path) {
  if (name.empty()) throw InputError(file, json_path, "expected a file name, got an empty string");
  if (name.find('\0') != std::string::npos) throw InputError(file, json_path, "a file name with a NUL byte");
  const fs::path base = base_dir.empty() ? fs::path(".") : fs::path(base_dir);
  const fs::path joined = base / name;
  if (g_allow_outside_paths) return joined.string();
  std::error_code ec;
  const fs::path real_base = fs::weakly_canonical(base, ec);
  const fs::path real = ec ? fs::path() : fs::weakly_canonical(joined, ec);
  if (ec) throw InputError(file, json_path, fmt::format("cannot resolve \"{}\": {}", name, ec.message()));
  // Inside means real_base is a prefix of real, element by element.
  auto b = real_base.begin(), r = real.begin();
  for (; b != real_base.end() && r != real.end() && *b == *r; ++b, ++r) {
  }
  const bool inside = b == real_base.end() || (std::next(b) == real_base.end() && b->empty());
  if (!inside)
    throw InputError(file, json_path,
                     fmt::format("\"{}\" leads outside the folder {} (to {}); pass --allow-outside-paths to allow it",
                                 name, real_base.string(), real.string()));
  return joined.string();
}

}  // namespace kvcheck
