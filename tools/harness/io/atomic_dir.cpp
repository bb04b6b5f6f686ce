#include "tools/harness/io/atomic_dir.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "tools/harness/io/input_error.h"

namespace kvcheck {

namespace fs = std::filesystem;

namespace {
fs::path sibling(const fs::path& target, const char* tag) {
  fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  // fmt rather than string +: GCC 12 warns falsely (-Wrestrict) on "." + string.
  return parent / fmt::format(".{}{}{}", target.filename().string(), tag, ::getpid());
}

// Whether `name` is `prefix` followed by the pid of a process that no longer runs.
bool abandoned(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return false;
  const std::string digits = name.substr(prefix.size());
  pid_t pid = 0;
  const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
  if (digits.empty() || err != std::errc() || end != digits.data() + digits.size() || pid <= 0) return false;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace

// Siblings of `target` left by a run that was killed (its process is gone): a temporary
// folder is removed; a backup taken by commit() is put back when the target is missing
// (the run died between its two renames), else removed.
void recover_interrupted(const fs::path& target) {
  const fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string name = target.filename().string();
  std::error_code ec;
  std::vector<fs::path> temporaries, backups;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string entry = e.path().filename().string();
    if (abandoned(entry, fmt::format(".{}.tmp-", name))) temporaries.push_back(e.path());
    if (abandoned(entry, fmt::format(".{}.old-", name))) backups.push_back(e.path());
  }
  for (const fs::path& p : temporaries) fs::remove_all(p, ec);
  for (const fs::path& p : backups) {
    if (!fs::exists(target, ec)) {
      fs::rename(p, target);  // the folder as it was before the interrupted commit
      fmt::print(stderr, "kvcheck: restored {} from {}, left by an interrupted run\n", target.string(), p.string());
    } else {
      fs::remove_all(p, ec);
    }
  }
}

void check_output_folder(const fs::path& target, const std::string& option) {
  const std::string shown = option + " " + (target.empty() ? std::string("''") : target.string());
  if (target.empty()) throw InputError(option, "", "expected a folder name, got an empty string");
  std::error_code ec;
  fs::path folder = fs::absolute(target, ec).lexically_normal();
  if (folder.filename().empty()) folder = folder.parent_path();  // "out/" names "out"
  // Physical paths on both sides: a link on the way to the working folder still leads there.
  const fs::path real = fs::weakly_canonical(folder, ec);
  const fs::path cwd = fs::current_path(ec);
  if (!ec) {
    const auto [end, rest] = std::mismatch(real.begin(), real.end(), cwd.begin(), cwd.end());
    if (end == real.end())  // every part of the target starts the working folder
      throw InputError(shown, "",
                       fmt::format("is the folder kvcheck runs in, or holds it; it cannot be replaced while in use: "
                                   "name a new folder (for example {} ./new-folder) or run from elsewhere",
                                   option));
  }
  if (fs::is_symlink(fs::symlink_status(folder, ec))) {
    const fs::path to = fs::read_symlink(folder, ec);
    const bool dangling = !fs::exists(folder, ec);
    throw InputError(shown, "",
                     fmt::format("is a symbolic link to {}{}; kvcheck replaces a folder whole and would replace "
                                 "the link, not follow it: name the folder itself",
                                 to.string(), dangling ? ", which does not exist" : ""));
  }
}

AtomicDir::AtomicDir(fs::path target) : target_(std::move(target)) {
  if (target_.filename().empty()) target_ = target_.parent_path();
  if (!target_.parent_path().empty()) fs::create_directories(target_.parent_path());
  if (fs::exists(target_) && !fs::is_directory(target_))
    throw InputError(target_.string(), "", "exists and is not a folder; refusing to replace it");
  recover_interrupted(target_);
  temp_ = sibling(target_, ".tmp-");
  fs::remove_all(temp_);
  fs::create_directories(temp_);
}

AtomicDir::~AtomicDir() {
  std::error_code ec;
  if (!committed_) fs::remove_all(temp_, ec);
}

void AtomicDir::commit() {
  const fs::path old = sibling(target_, ".old-");
  fs::remove_all(old);
  const bool replacing = fs::exists(target_);
  if (replacing) fs::rename(target_, old);
  // Tests only: die between the two renames, as a killed run would.
  if (replacing && std::getenv("KVCHECK_TEST_DIE_IN_COMMIT") != nullptr) ::raise(SIGKILL);
  try {
    fs::rename(temp_, target_);
  } catch (...) {
    if (replacing) fs::rename(old, target_);  // put the old one back
    throw;
  }
  committed_ = true;
  fs::remove_all(old);
}

namespace {
int report_fd = STDOUT_FILENO;  // where "-" goes: standard output, kept apart by reserve_stdout_for_report

bool under_special_tree(const fs::path& p) {
  const std::string s = p.lexically_normal().string();
  return s.rfind("/dev/", 0) == 0 || s.rfind("/proc/", 0) == 0;
}

void write_through(const fs::path& path, int fd, const std::string& text) {
  std::fflush(stdout);  // what kvcheck printed comes first, when the stream is standard output
  if (fd >= 0) {
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw InputError(path.string(), "", "cannot write to it (" + std::string(std::strerror(errno)) + ")");
      done += static_cast<std::size_t>(n);
    }
    return;
  }
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::app);  // a stream: appended, never truncated
  out << text;
  if (!out.flush())
    throw InputError(path.string(), "", "cannot write to it (" + std::string(errno ? std::strerror(errno) : "write failed") + ")");
}
}  // namespace

void reserve_stdout_for_report() {
  std::fflush(stdout);
  report_fd = ::dup(STDOUT_FILENO);
  if (report_fd < 0 || ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0)
    throw std::runtime_error(std::string("cannot set standard output apart for the report: ") + std::strerror(errno));
}

OutputTarget resolve_output(const fs::path& given) {
  std::error_code ec;
  if (given == "-") return {given, true};
  // A link is followed: renaming a file over it would replace the link (/dev/stdout is one).
  // A link into /dev or /proc (/dev/stdout -> /proc/self/fd/1 -> the file standard output
  // was redirected to) is a stream: renaming over its end would hide what was printed.
  fs::path path = given;
  bool stream = under_special_tree(path);
  for (int hops = 0; fs::is_symlink(fs::symlink_status(path, ec)); ++hops) {
    const fs::path to = fs::read_symlink(path, ec);
    if (ec || hops == 40)
      throw InputError(given.string(), "",
                       "cannot follow the link" + (ec ? " (" + ec.message() + ")" : std::string(": too many levels")));
    path = to.is_absolute() ? to : path.parent_path() / to;
    stream = stream || under_special_tree(path);
  }
  const fs::file_status target = fs::status(path, ec);
  stream = stream || (fs::exists(target) && !fs::is_regular_file(target) && !fs::is_directory(target));
  return {path, stream};
}

void write_file_atomically(const fs::path& given, const std::string& text) {
  std::error_code ec;
  if (given == "-") return write_through(given, report_fd, text);
  const auto [path, stream] = resolve_output(given);
  if (stream) return write_through(given, -1, text);
  const fs::file_status target = fs::status(path, ec);
  if (fs::is_directory(target)) throw InputError(given.string(), "", "is a folder; expected a file name to write");
  if (!path.parent_path().empty() && !fs::is_directory(path.parent_path(), ec))
    throw InputError(given.string(), "", "no such folder to write into: " + path.parent_path().string());
  const fs::path temp = sibling(path, ".tmp-");
  try {
    {
      std::ofstream out(temp, std::ios::binary);
      out << text;
      if (!out.flush())
        throw InputError(given.string(), "", "cannot write the file (" + std::string(std::strerror(errno)) + ")");
    }
    fs::rename(temp, path);
  } catch (...) {
    fs::remove(temp, ec);  // never leave the temporary behind
    throw;
  }
}

}  // namespace kvcheck
