#include "tools/harness/io/progress.h"

#include <fmt/format.h>

#include <cstdio>

namespace kvcheck {

Progress& Progress::line() {
  static Progress progress;
  return progress;
}

void Progress::begin(std::string what, std::size_t steps, std::int64_t tokens) {
  if (!enabled_) return;
  const Clock::time_point now = Clock::now();
  if (!started_) {
    command_start_ = now;
    started_ = true;
  }
  what_ = std::move(what);
  steps_ = steps;
  tokens_ = tokens;
  phase_start_ = now;
}

void Progress::advance(std::size_t step, std::int64_t tokens) {
  if (!enabled_) return;
  const Clock::time_point now = Clock::now();
  if (now - command_start_ < std::chrono::seconds(2) || now - last_draw_ < std::chrono::milliseconds(200)) return;
  last_draw_ = now;
  const double seconds = std::chrono::duration<double>(now - phase_start_).count();
  const double rate = seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
  std::string left = "-";
  if (rate > 0 && tokens_ > tokens) {
    const double remaining = static_cast<double>(tokens_ - tokens) / rate;
    left = remaining >= 120 ? fmt::format("{:.0f} min", remaining / 60) : fmt::format("{:.0f} s", remaining);
  }
  fmt::print(stderr, "\r{}{}: step {}/{}, {:.0f} tokens/s, about {} left\033[K", prefix_.empty() ? "" : prefix_ + " ",
             what_, step + 1, steps_, rate, left);
  std::fflush(stderr);
  shown_ = true;
}

void Progress::clear() {
  if (!shown_) return;
  fmt::print(stderr, "\r\033[K");
  std::fflush(stderr);
  shown_ = false;
}

}  // namespace kvcheck
