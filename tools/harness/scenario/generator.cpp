#include "tools/harness/scenario/generator.h"

namespace kvcheck {

std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {

// The chain up to the head: one per (layer, uid, tensor, head), shared by its head_dim values.
std::uint64_t head_hash(std::uint64_t seed, int layer, std::uint64_t uid, Tensor tensor, int head) {
  std::uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<std::uint64_t>(layer));
  h = splitmix64(h ^ uid);
  h = splitmix64(h ^ static_cast<std::uint64_t>(tensor));
  return splitmix64(h ^ static_cast<std::uint64_t>(head));
}

float value_at(std::uint64_t head_hash, int dim) {
  const std::uint64_t h = splitmix64(head_hash ^ static_cast<std::uint64_t>(dim));
  const double unit = static_cast<double>(h >> 40) / 8388608.0;  // 24 bits / 2^23: [0, 2)
  return static_cast<float>(unit - 1.0);
}

}  // namespace

float generated_value(std::uint64_t seed, int layer, std::uint64_t uid, Tensor tensor, int head, int dim) {
  return value_at(head_hash(seed, layer, uid, tensor, head), dim);
}

InputTable generate_inputs(const Dims& dims, std::int64_t uids, std::uint64_t seed,
                           const std::vector<std::uint64_t>& content_keys, int first_layer) {
  InputTable t;
  t.layers = dims.layers;
  t.uids = uids;
  t.heads = dims.heads;
  t.kv_heads = dims.kv_heads;
  t.head_dim = dims.head_dim;
  auto fill = [&](std::vector<float>& out, Tensor tensor, int heads) {
    out.resize(static_cast<std::size_t>(dims.layers) * static_cast<std::size_t>(uids) * static_cast<std::size_t>(heads) *
               static_cast<std::size_t>(dims.head_dim));
    float* next = out.data();
    for (int l = 0; l < dims.layers; ++l)
      for (std::int64_t u = 0; u < uids; ++u)
        for (int h = 0; h < heads; ++h) {
          const std::uint64_t key =
              content_keys.empty() ? static_cast<std::uint64_t>(u) : content_keys[static_cast<std::size_t>(u)];
          const std::uint64_t prefix = head_hash(seed, first_layer + l, key, tensor, h);
          for (int d = 0; d < dims.head_dim; ++d) *next++ = value_at(prefix, d);
        }
  };
  fill(t.q, Tensor::q, dims.heads);
  fill(t.k, Tensor::k, dims.kv_heads);
  fill(t.v, Tensor::v, dims.kv_heads);
  return t;
}

}  // namespace kvcheck
