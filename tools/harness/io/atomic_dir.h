// Output that appears whole or not at all: write into a temporary sibling, then rename.
#pragma once

#include <filesystem>
#include <string>

namespace kvcheck {

// A temporary folder beside `target`; commit() swaps it into place (replacing an old
// `target`), and the destructor removes it if commit() was never reached.
class AtomicDir {
 public:
  explicit AtomicDir(std::filesystem::path target);
  ~AtomicDir();
  AtomicDir(const AtomicDir&) = delete;
  AtomicDir& operator=(const AtomicDir&) = delete;

  const std::filesystem::path& path() const { return temp_; }
  void commit();

 private:
  std::filesystem::path target_, temp_;
  bool committed_ = false;
};

// Puts back a folder whose replacement was interrupted between AtomicDir::commit's two
// renames (the backup of a killed run), and removes killed runs' temporaries. AtomicDir
// does this itself; readers of `target` call it first so they see the folder as it was.
void recover_interrupted(const std::filesystem::path& target);

// Refuses, before any work, an output folder that AtomicDir could not replace sensibly: an
// empty name, the folder kvcheck runs in (or one holding it), a symbolic link (dangling or
// not: the link would be replaced, not followed). `option` names the argument (--out).
void check_output_folder(const std::filesystem::path& target, const std::string& option);

// Where a report named `given` ends up: symbolic links followed to the file they name, and
// whether that is a stream ("-", anything under /dev or /proc, a FIFO, a terminal), which is
// written through rather than replaced.
struct OutputTarget {
  std::filesystem::path path;
  bool stream = false;
};
OutputTarget resolve_output(const std::filesystem::path& given);

// Writes `text` to `path` through a temporary file and a rename. "-" is standard output (as
// reserve_stdout_for_report left it); a stream (/dev/stdout, anything under /dev or /proc, a
// FIFO, a terminal) is written straight through, appended, never replaced by a renamed file;
// a symbolic link is followed: the file it names is replaced, not the link.
void write_file_atomically(const std::filesystem::path& path, const std::string& text);

// A report is going to "-": standard output is kept for it alone and everything else kvcheck
// prints there (tables, diagnoses) goes to standard error from now on, so the report parses.
void reserve_stdout_for_report();

}  // namespace kvcheck
