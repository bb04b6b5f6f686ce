#include "tools/harness/atomic_dir.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <stdexcept>

namespace kvcheck {

namespace fs = std::filesystem;

namespace {
fs::path sibling(const fs::path& target, const char* tag) {
  fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  // fmt rather than string +: GCC 12 warns falsely (-Wrestrict) on "." + string.
  return parent / fmt::format(".{}{}{}", target.filename().string(), tag, ::getpid());
}
}  // namespace

// Temporary siblings of `target` left by a run that was killed (its process is gone).
void remove_abandoned(const fs::path& target) {
  const fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::error_code ec;
  for (const char* tag : {".tmp-", ".old-"}) {
    const std::string prefix = fmt::format(".{}{}", target.filename().string(), tag);
    for (const auto& e : fs::directory_iterator(parent, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(prefix, 0) != 0) continue;
      const std::string pid = name.substr(prefix.size());
      if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;
      if (::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0 && errno == ESRCH) fs::remove_all(e.path(), ec);
    }
  }
}

AtomicDir::AtomicDir(fs::path target) : target_(std::move(target)) {
  if (target_.filename().empty()) target_ = target_.parent_path();
  if (!target_.parent_path().empty()) fs::create_directories(target_.parent_path());
  remove_abandoned(target_);
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
  try {
    fs::rename(temp_, target_);
  } catch (...) {
    if (replacing) fs::rename(old, target_);  // put the old one back
    throw;
  }
  committed_ = true;
  fs::remove_all(old);
}

void write_file_atomically(const fs::path& path, const std::string& text) {
  if (!path.parent_path().empty()) fs::create_directories(path.parent_path());
  const fs::path temp = sibling(path, ".tmp-");
  {
    std::ofstream out(temp, std::ios::binary);
    out << text;
    if (!out.flush()) throw std::runtime_error("cannot write " + temp.string());
  }
  fs::rename(temp, path);
}

}  // namespace kvcheck
