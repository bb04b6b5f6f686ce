// Float32 RoPE for the optimized caches: a cos/sin table per position. A cache covers the
// positions a chunk needs before it stores or attends (amortized doubling: a table sized
// to the window would wrap on long prompts); the hot path only reads it.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcheck::optimized {

enum class PairLayout { half, interleaved };

struct RopeSpec {
  int head_dim = 2;
  double theta = 10000.0;
  PairLayout layout = PairLayout::half;
  double position_divisor = 1.0;  // linear scaling factor
};

class RopeTable {
 public:
  explicit RopeTable(const RopeSpec& spec);

  // Makes positions -position .. position available to rotate().
  void cover(std::int64_t position);
  // x (head_dim floats) becomes R(position) x in place; a negative position rotates back.
  // Throws std::logic_error for a position not covered (a cache's bug, not the input's).
  void rotate(float* x, std::int64_t position) const;

  const RopeSpec& spec() const { return spec_; }

 private:
  RopeSpec spec_;
  std::vector<double> inv_freq_;
  std::vector<float> cos_, sin_;  // [positions, head_dim / 2]
  std::int64_t positions_ = 0;
};

}  // namespace kvcheck::optimized
