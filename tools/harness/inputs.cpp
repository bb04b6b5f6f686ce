#include "tools/harness/inputs.h"

#include <fmt/format.h>

#include <cmath>

#include "tools/harness/generator.h"
#include "tools/harness/npy.h"

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

InputTable load_inputs(const Scenario& s) {
  const std::int64_t uids = count_uids(s);
  if (s.inputs.kind == InputSource::Kind::seed) return generate_inputs(s.dims, uids, s.inputs.seed);

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

}  // namespace kvcheck
