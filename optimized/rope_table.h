// Float32 RoPE for the optimized caches: a cos/sin table per position, grown on demand
// (a table sized to the window would wrap on long prompts).
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

  // x (head_dim floats) becomes R(position) x in place; a negative position rotates back.
  void rotate(float* x, std::int64_t position);

  const RopeSpec& spec() const { return spec_; }

 private:
  void grow_to(std::int64_t position);

  RopeSpec spec_;
  std::vector<double> inv_freq_;
  std::vector<float> cos_, sin_;  // [positions, head_dim / 2]
  std::int64_t positions_ = 0;
};

}  // namespace kvcheck::optimized
