// Float32 RoPE for the optimized caches: a cos/sin table per position. A cache covers the
// positions a chunk needs before it stores or attends (amortized doubling: a table sized
// to the window would wrap on long prompts); the hot path only reads it.
//
// The frequency maps (llama3, yarn) and partial rotary are written here again from SPEC 7,
// apart from reference/, so that a slip in one is caught by the other.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcheck::optimized {

enum class PairLayout { half, interleaved };
enum class FrequencyMap { plain, llama3, yarn };

struct RopeSpec {
  bool identity = false;  // a NoPE layer (SPEC 10.1): nothing rotates
  int head_dim = 2;
  int rotary_dim = 0;  // dims that rotate (the first ones); 0: all
  double theta = 10000.0;
  PairLayout layout = PairLayout::half;
  double position_divisor = 1.0;  // linear scaling factor
  FrequencyMap map = FrequencyMap::plain;
  double factor = 1.0;                   // llama3, yarn
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  double original_context = 8192.0;      // llama3, yarn: original_max_position_embeddings
  double beta_fast = 32.0, beta_slow = 1.0;  // yarn
  double magnitude = 1.0;                // yarn's attention factor: encoded keys and queries are m R(p) x
  bool operator==(const RopeSpec&) const = default;
};

class RopeTable {
 public:
  explicit RopeTable(const RopeSpec& spec);

  // Makes positions -position .. position available.
  void cover(std::int64_t position);
  // x (head_dim floats) becomes m R(position) x in place: a fresh key or query encoded.
  // Throws std::logic_error for a position not covered (a cache's bug, not the input's).
  void rotate(float* x, std::int64_t position) const;
  // x becomes R(by) x: an encoded key moved by `by` positions (negative: back), its
  // magnitude left as it is.
  void shift(float* x, std::int64_t by) const;

  const RopeSpec& spec() const { return spec_; }
  // cos and sin of every rotated pair at a covered position (rotary_dim / 2 each).
  const float* cos_at(std::int64_t position) const { return cos_.data() + position * (rotary_ / 2); }
  const float* sin_at(std::int64_t position) const { return sin_.data() + position * (rotary_ / 2); }
  int rotary_dim() const { return rotary_; }

 private:
  void turn(float* x, std::int64_t position, float scale) const;

  RopeSpec spec_;
  int rotary_;
  std::vector<double> inv_freq_;
  std::vector<float> cos_, sin_;  // [positions, rotary_dim / 2]
  std::int64_t positions_ = 0;
};

}  // namespace kvcheck::optimized
