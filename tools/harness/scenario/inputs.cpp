#include "tools/harness/scenario/inputs.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "tools/harness/scenario/generator.h"
#include "tools/harness/scenario/layer_groups.h"
#include "tools/harness/io/npy.h"

namespace kvcheck {
namespace {

std::vector<float> load_tensor(const std::string& path, const std::vector<std::size_t>& expected, const char* what) {
  NpyArray<float> a = read_npy_f32(path);
  // More uids than the scenario uses is fine (a captured trace may run longer).
  const bool fits = a.shape.size() == 4 && a.shape[0] == expected[0] && a.shape[1] >= expected[1] &&
                    a.shape[2] == expected[2] && a.shape[3] == expected[3];
  if (!fits)
    throw InputError(path, "",
                     fmt::format("expected {} of shape [L={}, U>={}, {}, D={}], got {}", what, expected[0], expected[1],
                                 expected[2], expected[3], shape_string(a.shape)));
  for (std::size_t i = 0; i < a.data.size(); ++i)
    if (!std::isfinite(a.data[i]))
      throw InputError(path, "", fmt::format("expected finite values, got {} at flat index {}", a.data[i], i));
  // Keep the first `expected[1]` uids of every layer.
  std::vector<float> out;
  const std::size_t per_uid = expected[2] * expected[3];
  for (std::size_t l = 0; l < expected[0]; ++l) {
    const auto begin = a.data.begin() + static_cast<std::ptrdiff_t>(l * a.shape[1] * per_uid);
    out.insert(out.end(), begin, begin + static_cast<std::ptrdiff_t>(expected[1] * per_uid));
  }
  return out;
}

}  // namespace

namespace {

// float16 holds magnitudes up to 65504: a key or value beyond it (a rotated key element can
// reach its pair's length, times yarn's m) would be stored as infinity, failing a correct
// cache. Such a scenario asks for the impossible: bad input.
void require_float16_range(const Scenario& s, const InputTable& t) {
  constexpr double kLargest = 65504.0;
  const int D = s.dims.head_dim;
  for (int l = 0; l < t.layers; ++l) {
    const Rope& rope = s.rope(l);
    const int rotary = rope.nope ? 0 : rope.rotary_dim > 0 ? rope.rotary_dim : D;
    const double m = rope.scaling == RopeScaling::yarn ? std::max(1.0, rope.attention_factor) : 1.0;
    for (std::int64_t u = 0; u < t.uids; ++u)
      for (int g = 0; g < t.kv_heads; ++g) {
        const float* k = t.k_at(l, static_cast<std::uint64_t>(u), g);
        const float* v = t.v_at(l, static_cast<std::uint64_t>(u), g);
        for (int d = 0; d < D; ++d) {
          // Element d's pair partner inside R, under either layout: the pair's length bounds both.
          double reach = std::abs(static_cast<double>(k[d]));
          if (d < rotary) {
            const int half = rotary / 2;
            const int other = rope.layout == RopeLayout::half ? (d < half ? d + half : d - half) : (d ^ 1);
            reach = m * std::hypot(static_cast<double>(k[d]), static_cast<double>(k[other]));
          }
          const double worst = std::max(reach, std::abs(static_cast<double>(v[d])));
          if (worst > kLargest)
            throw InputError(s.file, "/kv_dtype",
                             fmt::format("float16 holds magnitudes up to 65504, but layer {} uid {} kv head {} reaches "
                                         "{:.6g} (a rotated key element or a value); use bfloat16 or float32",
                                         l, u, g, worst));
        }
      }
  }
}

InputTable load_raw_inputs(const Scenario& s);

}  // namespace

InputTable load_inputs(const Scenario& s) {
  // A scenario the parser accepted only in groups of layers (layer_groups.h) is refused
  // here, before anything is allocated, by every command but `run`, which slices it first.
  // A scenario the parser took whole and `run --kv-quant` grew past the budget still loads.
  const double floats = input_values(s, s.dims.layers);
  const ScenarioCost cost = estimate_cost(s);
  const bool whole = floats <= 1e9 && cost.bytes <= kMemoryBudget;
  if (!whole && layer_group_size(s, kMemoryBudget) > 0)
    throw InputError(s.file, "/steps",
                     fmt::format("the scenario needs {:.3g} input values and about {:.1f} GB at once; only `kvcheck "
                                 "run` checks it, in groups of layers (kvcheck accepts up to 1e9 values and {:.0f} GB)",
                                 floats, cost.bytes / 1e9, kMemoryBudget / 1e9));
  InputTable t = load_raw_inputs(s);
  if (s.kv_dtype == KvDtype::float16) require_float16_range(s, t);
  return t;
}

namespace {

InputTable load_raw_inputs(const Scenario& s) {
  const std::int64_t uids = count_uids(s);
  if (s.inputs.kind == InputSource::Kind::seed)
    return generate_inputs(s.dims, uids, s.inputs.seed, s.context_keys, s.inputs.first_layer);

  InputTable t;
  t.layers = s.dims.layers;
  t.uids = uids;
  t.heads = s.dims.heads;
  t.kv_heads = s.dims.kv_heads;
  t.head_dim = s.dims.head_dim;
  if (s.inputs.kind == InputSource::Kind::inline_arrays) {
    t.q = s.inputs.q;
    t.k = s.inputs.k;
    t.v = s.inputs.v;
    return t;
  }
  const auto L = static_cast<std::size_t>(s.dims.layers), U = static_cast<std::size_t>(uids),
             D = static_cast<std::size_t>(s.dims.head_dim);
  // Errors name the scenario and its field as well as the .npy file.
  auto load = [&](const std::string& path, std::size_t heads, const char* name) {
    try {
      return load_tensor(path, {L, U, heads, D}, name);
    } catch (const InputError& e) {
      throw InputError(s.file, std::string("/inputs/") + name, e.what());
    }
  };
  t.q = load(s.inputs.q_path, static_cast<std::size_t>(s.dims.heads), "q");
  t.k = load(s.inputs.k_path, static_cast<std::size_t>(s.dims.kv_heads), "k");
  t.v = load(s.inputs.v_path, static_cast<std::size_t>(s.dims.kv_heads), "v");
  return t;
}

}  // namespace

}  // namespace kvcheck
