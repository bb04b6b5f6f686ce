// The plain value types that describe one attention layer stack and its cache policy
// (SPEC sections 1 to 3). No numeric code lives here.
#pragma once

#include <cstdint>
#include <optional>
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
// SPEC 2 and 7: linear divides the position; llama3 and yarn map each inverse frequency.
enum class RopeScaling { none, linear, llama3, yarn };

struct Rope {
  bool nope = false;  // SPEC 10.1: a NoPE layer, R(p) the identity (no field below applies)
  double theta = 10000.0;
  RopeLayout layout = RopeLayout::half;
  RopeScaling scaling = RopeScaling::none;
  double factor = 1.0;  // linear: the angle uses position / factor; llama3, yarn: f
  int rotary_dim = 0;   // R: the first R dims rotate, the rest pass through; 0 means all
  // llama3 (names as in a checkpoint's config.json rope_scaling)
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192.0;  // L (llama3 and yarn)
  // yarn
  double beta_fast = 32.0, beta_slow = 1.0;
  double attention_factor = 1.0;  // m: cos and sin are multiplied by it (parsed default 0.1 ln f + 1)
  bool operator==(const Rope&) const = default;
};

// SPEC 7: how a cache stores keys and values. The reference does not depend on it.
enum class KvDtype { float32, float16, bfloat16 };
inline const char* to_string(KvDtype d) {
  return d == KvDtype::float32 ? "float32" : d == KvDtype::float16 ? "float16" : "bfloat16";
}

// SPEC 10.3: Llama 4's attn_temperature_tuning, on its NoPE layers: the query of the token
// at position p is multiplied by log1p(floor((p + 1) / F)) * a + 1.
struct QueryTemperature {
  std::int64_t floor_scale = 8192;  // F
  double attn_scale = 0.1;          // a
  bool operator==(const QueryTemperature&) const = default;
};

// SPEC 7: learned sink logits, one per query head, per layer ([L][H]); empty: none.
struct Attention {
  std::vector<std::vector<double>> sink_logits;
  std::optional<QueryTemperature> query_temperature;  // SPEC 10.3: on every NoPE layer
};

enum class PolicyKind { full, sliding, sink, chunked };
enum class SinkPositions { cache, original };
enum class Prefill { streaming, dense };

struct Policy {
  PolicyKind kind = PolicyKind::full;
  // sliding: keys visible (own token included); sink: capacity W; chunked: the chunk C
  // (SPEC 10.2), which is also the most keys a query sees.
  std::int64_t window = 0;
  std::int64_t sinks = 0;   // sink: S
  std::int64_t evict = 1;   // sink: k tokens dropped at once when full
  SinkPositions positions = SinkPositions::cache;
  Prefill prefill = Prefill::streaming;
  // SPEC 10.4: a sliding layer under layer `shift_with`'s sink policy (whose fields above it
  // takes): it retains what that layer retains and sees only keys with Pq - Pk < swa.
  std::int64_t swa = 0;  // 0: none
  int shift_with = -1;
  bool operator==(const Policy&) const = default;
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
inline const char* to_string(RopeScaling scaling) {
  switch (scaling) {
    case RopeScaling::none:
      return "none";
    case RopeScaling::linear:
      return "linear";
    case RopeScaling::llama3:
      return "llama3";
    case RopeScaling::yarn:
      return "yarn";
  }
  return "?";
}
inline const char* to_string(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::full:
      return "full";
    case PolicyKind::sliding:
      return "sliding";
    case PolicyKind::sink:
      return "sink";
    case PolicyKind::chunked:
      return "chunked";
  }
  return "?";
}
inline const char* to_string(SinkPositions p) { return p == SinkPositions::cache ? "cache" : "original"; }
inline const char* to_string(Prefill p) { return p == Prefill::streaming ? "streaming" : "dense"; }

}  // namespace kvcheck
