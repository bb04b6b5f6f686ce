// The plain value types that describe one attention layer stack and its cache policy
// (SPEC sections 1 to 3). No numeric code lives here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvcheck {

struct Dims {
  int layers = 1;
  int batch = 1;  // rows at the start; reorder and reset may change it
  int heads = 1;
  int kv_heads = 1;
  int head_dim = 2;
};

enum class RopeLayout { half, interleaved };
enum class RopeScaling { none, linear };

struct Rope {
  double theta = 10000.0;
  RopeLayout layout = RopeLayout::half;
  RopeScaling scaling = RopeScaling::none;
  double factor = 1.0;  // linear: the angle uses position / factor
};

enum class PolicyKind { full, sliding, sink };
enum class SinkPositions { cache, original };
enum class Prefill { streaming, dense };

struct Policy {
  PolicyKind kind = PolicyKind::full;
  std::int64_t window = 0;  // sliding: keys visible (own token included); sink: capacity W
  std::int64_t sinks = 0;   // sink: S
  std::int64_t evict = 1;   // sink: k tokens dropped at once when full
  SinkPositions positions = SinkPositions::cache;
  Prefill prefill = Prefill::streaming;
};

// Raw, pre-RoPE float32 inputs indexed by layer and uid: q [L, U, H, D], k and v
// [L, U, Hkv, D], row-major, exactly the layout of the export's q.npy, k.npy, v.npy.
struct InputTable {
  int layers = 0;
  std::int64_t uids = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<float> q, k, v;

  const float* q_at(int layer, std::uint64_t uid, int head) const {
    return q.data() + ((static_cast<std::size_t>(layer) * uids + uid) * heads + head) * head_dim;
  }
  const float* k_at(int layer, std::uint64_t uid, int kv_head) const {
    return k.data() + ((static_cast<std::size_t>(layer) * uids + uid) * kv_heads + kv_head) * head_dim;
  }
  const float* v_at(int layer, std::uint64_t uid, int kv_head) const {
    return v.data() + ((static_cast<std::size_t>(layer) * uids + uid) * kv_heads + kv_head) * head_dim;
  }
  float* q_at(int layer, std::uint64_t uid, int head) {
    return const_cast<float*>(static_cast<const InputTable&>(*this).q_at(layer, uid, head));
  }
  float* k_at(int layer, std::uint64_t uid, int kv_head) {
    return const_cast<float*>(static_cast<const InputTable&>(*this).k_at(layer, uid, kv_head));
  }
  float* v_at(int layer, std::uint64_t uid, int kv_head) {
    return const_cast<float*>(static_cast<const InputTable&>(*this).v_at(layer, uid, kv_head));
  }
};

inline const char* to_string(RopeLayout layout) { return layout == RopeLayout::half ? "half" : "interleaved"; }
inline const char* to_string(RopeScaling scaling) { return scaling == RopeScaling::none ? "none" : "linear"; }
inline const char* to_string(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::full:
      return "full";
    case PolicyKind::sliding:
      return "sliding";
    case PolicyKind::sink:
      return "sink";
  }
  return "?";
}
inline const char* to_string(SinkPositions p) { return p == SinkPositions::cache ? "cache" : "original"; }
inline const char* to_string(Prefill p) { return p == Prefill::streaming ? "streaming" : "dense"; }

}  // namespace kvcheck
