#include "tools/harness/scenario/generator.h"

namespace kvcheck {

std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float generated_value(std::uint64_t seed, int layer, std::uint64_t uid, Tensor tensor, int head, int dim) {
  std::uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<std::uint64_t>(layer));
  h = splitmix64(h ^ uid);
  h = splitmix64(h ^ static_cast<std::uint64_t>(tensor));
  h = splitmix64(h ^ static_cast<std::uint64_t>(head));
  h = splitmix64(h ^ static_cast<std::uint64_t>(dim));
  const double unit = static_cast<double>(h >> 40) / 8388608.0;  // 24 bits / 2^23: [0, 2)
  return static_cast<float>(unit - 1.0);
}

InputTable generate_inputs(const Dims& dims, std::int64_t uids, std::uint64_t seed,
                           const std::vector<std::uint64_t>& content_keys) {
  InputTable t;
  t.layers = dims.layers;
  t.uids = uids;
  t.heads = dims.heads;
  t.kv_heads = dims.kv_heads;
  t.head_dim = dims.head_dim;
  auto fill = [&](std::vector<float>& out, Tensor tensor, int heads) {
    out.reserve(static_cast<std::size_t>(dims.layers) * uids * heads * dims.head_dim);
    for (int l = 0; l < dims.layers; ++l)
      for (std::int64_t u = 0; u < uids; ++u)
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < dims.head_dim; ++d)
            out.push_back(generated_value(
                seed, l, content_keys.empty() ? static_cast<std::uint64_t>(u) : content_keys[static_cast<std::size_t>(u)],
                tensor, h, d));
  };
  fill(t.q, Tensor::q, dims.heads);
  fill(t.k, Tensor::k, dims.kv_heads);
  fill(t.v, Tensor::v, dims.kv_heads);
  return t;
}

}  // namespace kvcheck
