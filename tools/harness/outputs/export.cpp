#include "tools/harness/outputs/export.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <fstream>
#include <nlohmann/json.hpp>

#include "reference/quantize.h"
#include "tools/harness/io/atomic_dir.h"
#include "tools/harness/scenario/content_keys.h"
#include "tools/harness/io/json_input.h"
#include "tools/harness/io/npy.h"
#include "tools/harness/outputs/output_guard.h"
#include "tools/harness/io/safe_file.h"

namespace kvcheck {

using json = nlohmann::json;

std::string step_stem(std::size_t index) { return fmt::format("step{:03d}", index); }

namespace {

json dims_json(const Dims& d) {
  return {
      {"layers", d.layers}, {"batch", d.batch}, {"heads", d.heads}, {"kv_heads", d.kv_heads}, {"head_dim", d.head_dim}};
}

// The rope as the reference resolved it: every parameter, defaults and yarn's derived
// attention factor included, so an implementation needs nothing else.
json rope_json(const Rope& r) {
  if (r.nope) return nullptr;  // SPEC 10.1: a NoPE layer
  json j = {{"theta", r.theta}, {"layout", to_string(r.layout)}, {"scaling", to_string(r.scaling)}};
  if (r.rotary_dim > 0) j["rotary_dim"] = r.rotary_dim;
  if (r.scaling != RopeScaling::none) j["factor"] = r.factor;
  if (r.scaling == RopeScaling::llama3) {
    j["low_freq_factor"] = r.low_freq_factor;
    j["high_freq_factor"] = r.high_freq_factor;
  }
  if (r.scaling == RopeScaling::llama3 || r.scaling == RopeScaling::yarn)
    j["original_max_position_embeddings"] = r.original_max_position_embeddings;
  if (r.scaling == RopeScaling::yarn) {
    j["beta_fast"] = r.beta_fast;
    j["beta_slow"] = r.beta_slow;
    j["attention_factor"] = r.attention_factor;
  }
  return j;
}

json policy_json(const Policy& p) {
  json j = {{"type", to_string(p.kind)}};
  if (p.kind == PolicyKind::chunked) j["chunk"] = p.window;
  if (p.kind == PolicyKind::sliding || p.kind == PolicyKind::sink) j["window"] = p.window;
  if (p.kind == PolicyKind::sink) {
    j["sinks"] = p.sinks;
    j["evict"] = p.evict;
    j["positions"] = to_string(p.positions);
    j["prefill"] = to_string(p.prefill);
    if (p.swa > 0) {  // SPEC 10.4: a sliding layer under layer shift_with's sink policy
      j["swa"] = p.swa;
      j["shift_with"] = p.shift_with;
    }
  }
  return j;
}

json cache_rows(const std::vector<reference::RowRetained>& retained) {
  json rows = json::array();
  for (std::size_t b = 0; b < retained.size(); ++b) {
    json keys = json::array();
    for (const auto& key : retained[b].keys)
      keys.push_back({{"uid", key.uid}, {"index", key.index}, {"position", key.position}});
    rows.push_back({{"row", b}, {"query_position", retained[b].query_position}, {"keys", keys}});
  }
  return rows;
}

// The rows, the same for every layer; or, when the layers' policies differ, "layers": one
// {"rows"} per layer.
json cache_json(std::size_t index, const StepRecord& record) {
  if (!record.retained_differs()) return {{"step", index}, {"rows", cache_rows(*record.retained.front())}};
  json layers = json::array();
  for (const auto& retained : record.retained) layers.push_back({{"rows", cache_rows(*retained)}});
  return {{"step", index}, {"layers", layers}};
}

json kv_quant_json(const KvQuant& q, int head_dim) {
  const auto tensor = [head_dim](const TensorQuant& t) {
    json scale = {{"granularity", to_string(t.scale.granularity)},
                  {"dtype", to_string(t.scale.dtype)},
                  {"elements", reference::scale_group(t, head_dim)}};  // per scale, along head_dim
    if (t.scale.granularity == ScaleGranularity::group) scale["group"] = t.scale.group;
    if (t.scale.granularity == ScaleGranularity::channel)  // tokens per run quantized together; 0: all of them
      scale["group"] = t.scale.group, scale["axis"] = "token";
    if (t.scale.rule == ScaleRule::fixed)
      scale["value"] = t.scale.values;
    else
      scale["value"] = t.scale.rule == ScaleRule::first_append ? "first_append" : "amax";
    json j = {{"format", to_string(t.format)}, {"scale", scale}};
    if (t.transform_block > 0) j["transform_block"] = t.transform_block;
    if (has_biases(t.format)) j["bits"] = t.bits;
    return j;
  };
  json j = {{"transform", to_string(q.transform)}, {"shift", "requantize"}, {"residual", q.residual},
            {"flush", to_string(q.flush)},           {"prefill", to_string(q.prefill)},
            {"chunk_reads", to_string(q.chunk_reads)}};
  if (q.k) j["k"] = tensor(*q.k);
  if (q.v) j["v"] = tensor(*q.v);
  return j;
}

// SPEC 9: the codes and scales a quantized cache must hold after the step, for the keys of
// the step's cache file in its order ([L, B, R, Hkv, D] codes and [L, B, R, Hkv, groups]
// scales, R the most keys any row keeps; a shorter row is padded with code 0 and scale NaN,
// as are the keys a residual holds raw, which [L, B, R] `raw` marks with 1).
// Codes as SPEC 9.3 dumps them: int8 for int8 and q8_0, uint8 otherwise (fp8 bit patterns,
// 4- and 2-bit codes one per byte); zero points int32; mlx_affine's biases (SPEC 9.7) as its
// scales are, in a `bias` file.
// A per-layer kv_quant list gets one file per layer instead ([B, R, Hkv, ...], named
// `..._k_codes_lNN.npy`), listed in layer order, null where the layer keeps the tensor in
// kv_dtype: the layers' formats and group counts may differ.
void write_stored_codes(const std::filesystem::path& dir, const std::string& stem, const Scenario& s,
                        const StepRecord& r, json& step) {
  const std::size_t L = r.stored.size(), B = r.stored.empty() ? 0 : r.stored[0].size();
  const std::size_t Hkv = static_cast<std::size_t>(s.dims.kv_heads), D = static_cast<std::size_t>(s.dims.head_dim);
  std::size_t R = 0;
  for (const auto& layer : r.stored)
    for (const auto& row : layer) R = std::max(R, row.size());
  if (s.quant_rules().holds_raw()) {  // which keys the residual holds raw (their codes: 0, scales: NaN)
    std::vector<std::uint8_t> raw(L * B * R, 0);
    for (std::size_t l = 0; l < L; ++l)
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t i = 0; i < r.stored[l][b].size(); ++i) raw[(l * B + b) * R + i] = r.stored[l][b][i].raw;
    step["raw"] = stem + "_raw.npy";
    write_npy((dir / (stem + "_raw.npy")).string(), {L, B, R}, raw);
  }
  const bool per_layer = s.mixed_quant();
  // Layers [first, last) of one tensor, in one file: codes, scales and (affine) zero points.
  const auto write_layers = [&](const TensorQuant& t, bool value, std::size_t first, std::size_t last,
                                const std::string& suffix) {
    const std::size_t n = last - first;
    const std::size_t G = D / static_cast<std::size_t>(reference::scale_group(t, s.dims.head_dim));
    const bool affine = t.format == QuantFormat::int4 || t.format == QuantFormat::int2;
    const bool biased = has_biases(t.format);
    std::vector<std::int32_t> codes(n * B * R * Hkv * D, 0), zeros(affine ? n * B * R * Hkv * G : 0, 0);
    std::vector<double> scales(n * B * R * Hkv * G, std::numeric_limits<double>::quiet_NaN());
    std::vector<double> biases(biased ? scales.size() : 0, std::numeric_limits<double>::quiet_NaN());
    for (std::size_t l = first; l < last; ++l)
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t i = 0; i < r.stored[l][b].size(); ++i)
          for (std::size_t g = 0; g < Hkv; ++g) {
            const reference::StoredHead& h = r.stored[l][b][i].heads[g];
            const reference::QuantizedRow& row = value ? h.value_codes : h.key_codes;
            const std::size_t at = ((((l - first) * B + b) * R + i) * Hkv + g);
            std::copy(row.codes.begin(), row.codes.end(), codes.begin() + static_cast<std::ptrdiff_t>(at * D));
            std::copy(row.scales.begin(), row.scales.end(), scales.begin() + static_cast<std::ptrdiff_t>(at * G));
            if (affine)
              std::copy(row.zeros.begin(), row.zeros.end(), zeros.begin() + static_cast<std::ptrdiff_t>(at * G));
            if (biased)
              std::copy(row.biases.begin(), row.biases.end(), biases.begin() + static_cast<std::ptrdiff_t>(at * G));
          }
    std::vector<std::size_t> lead = {B, R, Hkv};
    if (!per_layer) lead.insert(lead.begin(), n);
    const auto shape = [&](std::size_t last_dim) {
      std::vector<std::size_t> x = lead;
      x.push_back(last_dim);
      return x;
    };
    const std::string name = value ? "v" : "k";
    json files = {{"codes", stem + "_" + name + "_codes" + suffix + ".npy"},
                  {"scales", stem + "_" + name + "_scales" + suffix + ".npy"}};
    if (t.format == QuantFormat::int8 || t.format == QuantFormat::q8_0 || t.format == QuantFormat::int8_even ||
        t.format == QuantFormat::int4_even)
      write_npy((dir / files["codes"].get<std::string>()).string(), shape(D),
                std::vector<std::int8_t>(codes.begin(), codes.end()));
    else
      write_npy((dir / files["codes"].get<std::string>()).string(), shape(D),
                std::vector<std::uint8_t>(codes.begin(), codes.end()));
    write_npy((dir / files["scales"].get<std::string>()).string(), shape(G), scales);
    if (affine) {
      files["zero"] = stem + "_" + name + "_zero" + suffix + ".npy";
      write_npy((dir / files["zero"].get<std::string>()).string(), shape(G), zeros);
    }
    if (biased) {
      files["bias"] = stem + "_" + name + "_bias" + suffix + ".npy";
      write_npy((dir / files["bias"].get<std::string>()).string(), shape(G), biases);
    }
    return files;
  };
  for (const bool value : {false, true}) {
    const std::string name = value ? "v" : "k";
    if (!per_layer) {
      const std::optional<TensorQuant>& t = value ? s.quant(0).v : s.quant(0).k;  // every layer's
      if (!t) continue;
      const json files = write_layers(*t, value, 0, L, "");
      for (const auto& [part, file] : files.items()) step[name + "_" + part] = file;
      continue;
    }
    json codes = json::array(), scales = json::array(), zeros = json::array(), biases = json::array();
    bool any = false, affine = false, biased = false;
    for (std::size_t l = 0; l < L; ++l) {
      const std::optional<TensorQuant>& t = value ? s.quant(static_cast<int>(l)).v : s.quant(static_cast<int>(l)).k;
      if (!t) {
        codes.push_back(nullptr), scales.push_back(nullptr), zeros.push_back(nullptr), biases.push_back(nullptr);
        continue;
      }
      const json files = write_layers(*t, value, l, l + 1, fmt::format("_l{:02}", l));
      any = true;
      affine = affine || files.contains("zero");
      codes.push_back(files["codes"]), scales.push_back(files["scales"]);
      zeros.push_back(files.contains("zero") ? files["zero"] : json(nullptr));
      biased = biased || files.contains("bias");
      biases.push_back(files.contains("bias") ? files["bias"] : json(nullptr));
    }
    if (!any) continue;
    step[name + "_codes"] = codes;
    step[name + "_scales"] = scales;
    if (affine) step[name + "_zero"] = zeros;
    if (biased) step[name + "_bias"] = biases;
  }
}

}  // namespace

bool is_export_folder(const std::string& dir) {
  try {
    const std::string path = (std::filesystem::path(dir) / "manifest.json").string();
    const json manifest = parse_json(read_file_checked(path, kMaxJsonBytes, "export manifest"), path);
    return manifest.is_object() && manifest.contains("format") && manifest["format"] == "kvcheck-export-1";
  } catch (const InputError&) {
    return false;  // no manifest, or not ours: not an export folder
  }
}

std::set<std::string> export_listed_files(const std::string& dir) {
  std::set<std::string> files;
  if (!is_export_folder(dir)) return files;
  const std::string path = (std::filesystem::path(dir) / "manifest.json").string();
  const json manifest = parse_json(read_file_checked(path, kMaxJsonBytes, "export manifest"), path);
  files.insert("manifest.json");
  // Every string under "inputs" and "steps" that is a plain file name the export writes.
  const auto collect = [&](const json& j, const auto& self) -> void {
    if (j.is_string()) {
      const std::string name = j.get<std::string>();
      if (!name.empty() && name.find('/') == std::string::npos && name != "." && name != ".." &&
          (name.size() > 4 && (name.ends_with(".npy") || name.ends_with(".json"))))
        files.insert(name);
    } else if (j.is_structured()) {
      for (const json& e : j) self(e, self);
    }
  };
  if (manifest.contains("inputs")) collect(manifest["inputs"], collect);
  if (manifest.contains("steps")) collect(manifest["steps"], collect);
  return files;
}

void check_export_folder(const std::string& dir, const std::string& option, const std::vector<std::string>& inputs) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return;
  if (std::filesystem::is_directory(dir, ec) && std::filesystem::is_empty(dir, ec)) return;
  if (!std::filesystem::is_directory(dir, ec) || !is_export_folder(dir))
    throw InputError(dir, "",
                     "refusing to replace it: not a kvcheck export folder (no manifest.json with "
                     "format kvcheck-export-1); choose a new or empty folder");
  check_folder_holds_only(dir, option, export_listed_files(dir), "an earlier export's", inputs);
}

void write_export(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, const std::string& out_dir) {
  check_export_folder(out_dir, "--out", scenario_input_files(s));
  AtomicDir dir(out_dir);
  const auto L = static_cast<std::size_t>(s.dims.layers), U = static_cast<std::size_t>(inputs.uids),
             H = static_cast<std::size_t>(s.dims.heads), Hkv = static_cast<std::size_t>(s.dims.kv_heads),
             D = static_cast<std::size_t>(s.dims.head_dim);
  write_npy((dir.path() / "q.npy").string(), {L, U, H, D}, inputs.q);
  write_npy((dir.path() / "k.npy").string(), {L, U, Hkv, D}, inputs.k);
  write_npy((dir.path() / "v.npy").string(), {L, U, Hkv, D}, inputs.v);

  json steps = json::array();
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const StepRecord& r = run.steps[i];
    json step = {{"index", i},
                 {"op", to_string(r.step.op)},
                 {"source_step", r.step.source_index},
                 {"source_op", r.step.source_op},
                 {"batch", r.rows()}};
    if (r.append) {
      const auto B = r.append->rows.size(), n = static_cast<std::size_t>(r.append->chunk);
      json rows = json::array();
      for (const auto& row : r.append->rows) {
        json uids = json::array(), indices = json::array(), query_positions = json::array();
        for (const auto& token : row) {
          uids.push_back(token.uid);
          indices.push_back(token.index);
          query_positions.push_back(token.view.query_position);
        }
        if (s.hybrid()) {  // one list per layer
          query_positions = json::array();
          for (int l = 0; l < s.dims.layers; ++l) {
            json layer = json::array();
            for (const auto& token : row) layer.push_back(token.view_in(l).query_position);
            query_positions.push_back(layer);
          }
        }
        // Pq of each appended token: lets a driver rotate new keys and queries where the
        // policy puts them (kvtrace's positions="policy").
        rows.push_back({{"uids", uids}, {"indices", indices}, {"query_positions", query_positions}});
        // SPEC 8: what a paged cache keys its prefix index by (scenarios that use them only,
        // so every other export stays as it was).
        if (s.paging || s.content == Content::prefix) {
          json ids = json::array();
          for (const auto& token : row) ids.push_back(token_id(s, token.uid));
          rows.back()["ids"] = ids;
          const std::size_t b = rows.size() - 1;
          if (b < r.step.extras.size())
            rows.back()["extra"] = {{"adapter", r.step.extras[b].adapter}, {"salt", r.step.extras[b].salt}};
          if (b < r.step.expect_hit.size() && r.step.expect_hit[b])
            rows.back()["expect_hit"] = {{"min", r.step.expect_hit[b]->min}, {"max", r.step.expect_hit[b]->max}};
        }
      }
      if (r.step.chunk > 0) step["forward"] = r.step.chunk;
      step["chunk"] = n;
      step["rows"] = rows;
      step["out"] = step_stem(i) + "_out.npy";
      write_npy((dir.path() / (step_stem(i) + "_out.npy")).string(), {L, B, n, H, D}, r.append->out);
      if (!r.append->out_stored.empty()) {  // SPEC 9.1: over what a quantized cache must hold
        step["out_stored"] = step_stem(i) + "_out_stored.npy";
        write_npy((dir.path() / (step_stem(i) + "_out_stored.npy")).string(), {L, B, n, H, D},
                  r.append->out_stored);
      }
    }
    if (!r.stored.empty()) write_stored_codes(dir.path(), step_stem(i), s, r, step);
    if (r.step.op == StepOp::reorder) step["rows_from"] = r.step.rows;
    if (r.step.op == StepOp::crop) step["length"] = r.step.length;
    if (r.step.op == StepOp::prune) {
      step["sinks"] = r.step.prune_sinks;
      step["recent"] = r.step.prune_recent;
      step["rerotate"] = r.step.rerotate;
      if (r.step.prune_keep > 0) {  // SPEC 11.1: the cache chooses `keep` tokens, sinks and recent among them
        step["select"] = "observed";
        step["keep"] = r.step.prune_keep;
      }
    }
    if (r.step.op == StepOp::free_rows) step["rows_freed"] = r.step.rows;
    if (r.step.op == StepOp::evict) step["blocks"] = r.step.evict_blocks;  // -1: all
    if (r.step.op == StepOp::preempt || r.step.op == StepOp::resume) step["rows_preempted"] = r.step.rows;
    if (r.step.op == StepOp::preempt) step["mode"] = r.step.recompute ? "recompute" : "swap";

    if (!r.step.expect_error.empty()) step["expect_error"] = r.step.expect_error;
    if (!r.refused.empty()) step["refused"] = r.refused;
    step["cache"] = step_stem(i) + "_cache.json";
    write_file_atomically(dir.path() / (step_stem(i) + "_cache.json"), cache_json(i, r).dump(1) + "\n");
    steps.push_back(step);
  }

  json manifest = {{"format", "kvcheck-export-1"},
                   {"name", s.name},
                   {"description", s.description},
                   {"scenario", json::parse(s.source_json)},
                   {"dimensions", dims_json(s.dims)},
                   {"rope", rope_json(s.rope(0))},  // a list when the layers' differ, below
                   {"policy", policy_json(s.policies.front())},  // a list when the layers' differ, below
                   {"softmax_scale", s.softmax_scale()},

                   {"uids", inputs.uids},
                   {"inputs", {{"q", "q.npy"}, {"k", "k.npy"}, {"v", "v.npy"}}},
                   {"steps", steps}};
  if (s.paging)
    manifest["paging"] = {{"block_size", s.paging->block_size},
                          {"num_blocks", s.paging->num_blocks},
                          {"prefix_cache", s.paging->prefix_cache}};
  if (s.paging && s.paging->token_reuse) manifest["paging"]["reuse"] = "token";  // a driver refuses what its cache lacks
  if (!s.attention.sink_logits.empty()) manifest["attention"]["sink_logits"] = s.attention.sink_logits;
  if (const auto& t = s.attention.query_temperature)  // SPEC 10.3: applies to the NoPE layers
    manifest["attention"]["query_temperature"] = {{"floor_scale", t->floor_scale}, {"attn_scale", t->attn_scale}};
  if (s.kv_dtype != KvDtype::float32) manifest["kv_dtype"] = to_string(s.kv_dtype);
  if (s.quantized() && !s.mixed_quant()) manifest["kv_quant"] = kv_quant_json(s.quant(0), s.dims.head_dim);
  if (s.mixed_quant()) {  // one per layer
    manifest["kv_quant"] = json::array();
    for (const KvQuant& q : s.quants)  // null: a layer stored in kv_dtype
      manifest["kv_quant"].push_back(q.k || q.v ? kv_quant_json(q, s.dims.head_dim) : json(nullptr));
  }
  if (!s.shared_rope()) {
    json ropes = json::array();
    for (const Rope& r : s.ropes) ropes.push_back(rope_json(r));
    manifest["rope"] = ropes;
  }
  if (s.hybrid()) {
    json policies = json::array();
    for (const Policy& p : s.policies) policies.push_back(policy_json(p));
    manifest["policy"] = policies;
  }
  write_file_atomically(dir.path() / "manifest.json", manifest.dump(1) + "\n");
  dir.commit();
}

}  // namespace kvcheck
