// One line of progress on stderr, updated in place: what runs (scenario, cache), step /
// steps, tokens per second, time left. Shown only where enabled (stderr a terminal, or
// --progress) and only once the command has run for two seconds, so short runs and CI
// logs stay clean; erased when the command prints its results.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace kvcheck {

class Progress {
 public:
  // The command's one progress line (the command line enables it).
  static Progress& line();

  void enable(bool on) { enabled_ = on; }
  // A prefix for every phase, e.g. "[3/44]" while running the third of 44 files.
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }
  // A new phase: `what` runs `steps` steps over `tokens` tokens in all.
  void begin(std::string what, std::size_t steps, std::int64_t tokens);
  // Step `step` (0-based) is done, with `tokens` tokens done so far in this phase.
  void advance(std::size_t step, std::int64_t tokens);
  // Erases the line (before results are printed).
  void clear();

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_ = false, shown_ = false, started_ = false;
  std::string prefix_, what_;
  std::size_t steps_ = 0;
  std::int64_t tokens_ = 0;
  Clock::time_point command_start_, phase_start_, last_draw_;
};

}  // namespace kvcheck
