#include "tools/harness/atomic_dir.h"

#include <fstream>
#include <stdexcept>

#include <unistd.h>

namespace kvcheck {

namespace fs = std::filesystem;

namespace {
fs::path sibling(const fs::path& target, const char* tag) {
  fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  return parent / ("." + target.filename().string() + tag + std::to_string(::getpid()));
}
}  // namespace

AtomicDir::AtomicDir(fs::path target) : target_(std::move(target)) {
  if (target_.filename().empty()) target_ = target_.parent_path();
  if (!target_.parent_path().empty()) fs::create_directories(target_.parent_path());
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
  if (fs::exists(target_)) fs::rename(target_, old);
  fs::rename(temp_, target_);
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
