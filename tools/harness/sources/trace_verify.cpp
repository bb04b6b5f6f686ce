#include "tools/harness/sources/trace_verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "reference/quantize.h"
#include "reference/stored_kv.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/io/json_input.h"
#include "tools/harness/io/npy.h"
#include "tools/harness/sources/paged_trace.h"
#include "tools/harness/check/quant_checks.h"
#include "tools/harness/check/recovery.h"
#include "tools/harness/io/safe_file.h"
#include "tools/harness/sources/trace_codes.h"

namespace kvcheck {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct TraceFiles {
  std::string keys, values, out, q;  // out and q optional
  // SPEC 9.3, optional: a quantized cache's codes [B, Hkv, slots, D], scales and zero points
  // [B, Hkv, slots, groups], per tensor.
  CodeFiles codes;
  // SPEC 9 residual, optional: [B, slots], 1 where a slot holds its token unquantized (its
  // key and value are then those of `keys` and `values`, its codes are ignored).
  std::string raw;
  std::optional<PagedTraceFiles> paged;       // SPEC 8.9: a pool and block tables instead of keys and values
};

struct TraceStep {
  std::vector<TraceFiles> layers;    // empty: not recorded
  std::optional<std::string> error;  // the cache raised at this step
  std::string skipped;               // why the producer did not drive this step
};

struct Trace {
  std::string dir, manifest_path;
  KeyPositions positions = KeyPositions::cache_relative;
  Eviction eviction = Eviction::any;
  std::int64_t block_capacity = 0;  // under Eviction::blocks
  std::vector<TraceStep> steps;
};

// The capacity C of `"eviction": {"blocks": C}` (SPEC 3.1): an integer no smaller than any
// sliding layer's window, in a scenario that has one.
std::int64_t read_block_capacity(const Scenario& s, const json& e, const std::string& manifest) {
  for (const auto& [key, value] : e.items())
    if (key != "blocks") throw InputError(manifest, "/eviction/" + key, "unknown key (expected blocks)");
  const json& c = e["blocks"];
  std::int64_t window = 0;
  for (const Policy& p : s.policies)
    if (p.kind == PolicyKind::sliding) window = std::max(window, p.window);
  if (window == 0)
    throw InputError(manifest, "/eviction/blocks", "block eviction applies to sliding layers, and the scenario has none");
  // SPEC 3.1 defines L(T) over a row's appends; a paged layout or a prune places tokens by
  // rules of their own, and the two are not defined together.
  if (s.paging)
    throw InputError(manifest, "/eviction/blocks", "block eviction is not defined for a paged scenario (SPEC 3.1)");
  if (s.prunes())
    throw InputError(manifest, "/eviction/blocks", "block eviction is not defined for a scenario with a prune (SPEC 3.1)");
  if (!c.is_number_integer() || c.get<std::int64_t>() < window || c.get<std::int64_t>() > (std::int64_t{1} << 40))
    throw InputError(manifest, "/eviction/blocks",
                     fmt::format("expected the buffer's capacity, an integer from the largest sliding window {} "
                                 "to 2^40, got {}",
                                 window, c.dump()));
  return c.get<std::int64_t>();
}

// A layer's "paged" entry (SPEC 8.9): block_size, layout, key_cache, value_cache,
// block_table, and optionally refcount, hit_tokens, slot_mapping and block_ids.
PagedTraceFiles read_paged_entry(const json& j, const std::string& p, const std::string& dir,
                                 const std::string& manifest, const Scenario& s, int layer) {
  auto fail = [&](const std::string& path, const std::string& why) { throw InputError(manifest, path, why); };
  if (!j.is_object()) fail(p, "expected an object");
  static const std::set<std::string> known = {"block_size", "layout",     "key_cache",    "value_cache", "block_table",
                                              "refcount",   "hit_tokens", "slot_mapping", "block_ids",   "k_codes",
                                              "k_scales",   "k_zero",     "v_codes",      "v_scales",    "v_zero",
                                              "k_bias",     "v_bias",     "ring"};
  for (const auto& [key, value] : j.items())
    if (!known.count(key))
      fail(p + "/" + key, "unknown key (expected block_size, layout, key_cache, value_cache, block_table, refcount, "
                          "hit_tokens, slot_mapping, block_ids, ring, k_codes, k_scales, k_zero, k_bias, v_codes, "
                          "v_scales, v_zero, v_bias)");
  PagedTraceFiles f;
  if (!j.contains("block_size") || !j["block_size"].is_number_integer() || j["block_size"].get<std::int64_t>() < 1 ||
      j["block_size"].get<std::int64_t>() > 65536)
    fail(p + "/block_size", "expected an integer from 1 to 65536");
  f.block_size = j["block_size"].get<std::int64_t>();
  if (s.paging && f.block_size != s.paging->block_size)
    fail(p + "/block_size", fmt::format("expected the scenario's block size {}, got {}", s.paging->block_size, f.block_size));
  if (!j.contains("layout") || !j["layout"].is_string() || (j["layout"] != "NHD" && j["layout"] != "HND"))
    fail(p + "/layout", "expected \"NHD\" ([blocks, B, Hkv, D], vLLM) or \"HND\" ([blocks, Hkv, B, D], FlashInfer)");
  f.head_major = j["layout"] == "HND";
  if (j.contains("ring")) {  // SPEC 8.9: a sliding layer's ring of places
    const Policy& policy = s.policies[static_cast<std::size_t>(layer)];
    if (policy.kind != PolicyKind::sliding)
      fail(p + "/ring", "a ring holds a sliding layer's window, and this layer's policy is not sliding");
    if (!j["ring"].is_number_integer() || j["ring"].get<std::int64_t>() < policy.window ||
        j["ring"].get<std::int64_t>() > (std::int64_t{1} << 30))
      fail(p + "/ring", fmt::format("expected the ring's places, an integer from the window {} to 2^30, got {}",
                                    policy.window, j["ring"].dump()));
    if (s.paging && s.paging->prefix_cache)
      fail(p + "/ring", "a ring's pages are overwritten in place and cannot be shared: not with prefix_cache");
    f.ring = j["ring"].get<std::int64_t>();
  }
  auto file = [&](const char* key, bool required) -> std::string {
    if (!j.contains(key)) {
      if (required) fail(p + "/" + key, "missing required field (a file name)");
      return "";
    }
    if (!j[key].is_string()) fail(p + "/" + key, "expected a file name");
    return resolve_inside(dir, j[key].get<std::string>(), manifest, p + "/" + key);
  };
  // SPEC 9.3 in a pool: codes [blocks, B, Hkv, D] (or HND), scales and zero points per group;
  // a pool of floats may then be left out (the checker dequantizes the codes).
  read_code_files(
      j, p, s, layer, [&](const std::string& key) { return file(key.c_str(), true); },
      [&](const std::string& path, const std::string& why) { fail(path, why); }, f.codes);
  f.key_cache = file("key_cache", f.codes.codes[0].empty());
  f.value_cache = file("value_cache", f.codes.codes[1].empty());
  f.block_table = file("block_table", true);
  f.refcount = file("refcount", false);
  f.hit_tokens = file("hit_tokens", false);
  f.slot_mapping = file("slot_mapping", false);
  f.block_ids = file("block_ids", false);
  return f;
}

Trace read_manifest(const Scenario& s, const std::string& dir, std::size_t steps) {
  Trace t;
  t.dir = dir;
  t.manifest_path = (fs::path(dir) / "manifest.json").string();
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw InputError(dir, "", "expected a trace folder (holding manifest.json)");
  if (!fs::exists(t.manifest_path, ec)) throw InputError(t.manifest_path, "", "no manifest.json in the trace folder");
  const json m = parse_json(read_file_checked(t.manifest_path, kMaxJsonBytes, "trace manifest"), t.manifest_path);
  auto fail = [&](const std::string& path, const std::string& why) { throw InputError(t.manifest_path, path, why); };
  if (!m.is_object()) fail("", "expected an object");
  // What the manifest said, short (the depth is bounded, the length is cut).
  auto got = [&](const char* key) {
    if (!m.contains(key)) return std::string("nothing");
    std::string text = m[key].dump(-1, ' ', false, json::error_handler_t::replace);
    return text.size() > 60 ? text.substr(0, 57) + "..." : text;
  };
  if (!m.contains("format") || m["format"] != "kvcheck-trace-1")
    fail("/format", "expected \"kvcheck-trace-1\", got " + got("format"));
  if (!m.contains("scenario") || m["scenario"] != s.name)
    fail("/scenario", fmt::format("expected the scenario's name \"{}\", got {}", s.name, got("scenario")));
  const std::string kp =
      m.contains("key_positions") && m["key_positions"].is_string() ? m["key_positions"].get<std::string>() : "";
  if (kp == "cache-relative")
    t.positions = KeyPositions::cache_relative;
  else if (kp == "absolute")
    t.positions = KeyPositions::absolute;
  else if (kp == "unrotated")
    t.positions = KeyPositions::unrotated;
  else
    fail("/key_positions", "expected one of cache-relative, absolute, unrotated, got " + got("key_positions"));
  if (m.contains("eviction")) {
    const json& e = m["eviction"];
    if (e == "eager")
      t.eviction = Eviction::eager;
    else if (e == "lazy")
      t.eviction = Eviction::lazy;
    else if (e == "deferred")
      t.eviction = Eviction::deferred;
    else if (e == "never")
      t.eviction = Eviction::never;
    else if (e.is_object() && e.contains("blocks"))
      t.block_capacity = read_block_capacity(s, e, t.manifest_path), t.eviction = Eviction::blocks;
    else
      fail("/eviction", "expected \"eager\", \"lazy\", \"deferred\", \"never\" or {\"blocks\": capacity}, got " +
                            got("eviction"));
  }
  for (const auto& [key, value] : m.items())
    if (key != "format" && key != "scenario" && key != "producer" && key != "key_positions" && key != "steps" &&
        key != "eviction")
      fail("/" + key, "unknown key (expected format, scenario, producer, key_positions, eviction, steps)");
  if (!m.contains("steps") || !m["steps"].is_array() || m["steps"].size() != steps)
    fail("/steps",
         fmt::format("expected an array of {} steps (decode expanded into single-token steps), got {}", steps,
                     m.contains("steps") && m["steps"].is_array() ? std::to_string(m["steps"].size()) + " steps"
                                                                  : got("steps")));
  // A paged layer keeps one layout over the trace (SPEC 8.9): its ring, by the step that
  // first showed it (0: logical blocks).
  std::map<std::size_t, std::pair<std::int64_t, std::string>> layouts;
  for (std::size_t i = 0; i < steps; ++i) {
    const json& step = m["steps"][i];
    const std::string p = fmt::format("/steps/{}", i);
    TraceStep entry;
    std::vector<TraceFiles>& layers = entry.layers;
    if (!step.is_object()) fail(p, "expected an object (empty when the step was not recorded)");
    for (const auto& [key, value] : step.items()) {
      if (key != "layers" && key != "error" && key != "skipped")
        fail(p + "/" + key, "unknown key (expected layers, error, skipped)");
      if (key != "layers" && !value.is_string()) fail(p + "/" + key, "expected a string");
    }
    if (step.contains("error")) entry.error = step["error"].get<std::string>();
    if (step.contains("skipped")) entry.skipped = step["skipped"].get<std::string>();
    if (step.contains("layers") && (entry.error || !entry.skipped.empty()))
      fail(p, "a step with an error or skipped has no layers");
    if (step.contains("layers")) {
      const json& ls = step["layers"];
      if (!ls.is_array() || static_cast<int>(ls.size()) != s.dims.layers)
        fail(p + "/layers", fmt::format("expected an array of {} layers", s.dims.layers));
      for (std::size_t l = 0; l < ls.size(); ++l) {
        const std::string lp = fmt::format("{}/layers/{}", p, l);
        if (!ls[l].is_object()) fail(lp, "expected an object of file names");
        for (const auto& [key, value] : ls[l].items()) {
          static const std::set<std::string> known = {"keys",    "values",   "out",      "q",      "k_codes", "k_scales",
                                                      "k_zero",  "v_codes",  "v_scales", "v_zero", "raw",     "paged", "k_bias", "v_bias"};
          if (!known.count(key))
            fail(lp + "/" + key, "unknown key (expected keys, values, out, q, k_codes, k_scales, k_zero, k_bias, v_codes, "
                                 "v_scales, v_zero, v_bias, raw, paged)");
          if (key != "paged" && !value.is_string()) fail(lp + "/" + key, "expected a file name");
        }
        TraceFiles f;
        if (ls[l].contains("paged")) {  // SPEC 8.9: the pool and tables stand for keys and values
          f.paged = read_paged_entry(ls[l]["paged"], lp + "/paged", dir, t.manifest_path, s, static_cast<int>(l));
          const auto [first, fresh] = layouts.emplace(l, std::make_pair(f.paged->ring, lp));
          if (!fresh && first->second.first != f.paged->ring)
            fail(lp + "/paged/ring",
                 fmt::format("expected {}, as {} gives: a layer keeps one layout", first->second.first > 0
                                 ? fmt::format("a ring of {} places", first->second.first)
                                 : std::string("no ring (logical blocks)"),
                             first->second.second));
          for (const char* key : {"keys", "values", "k_codes", "v_codes"})
            if (ls[l].contains(key)) fail(lp + "/" + key, "a paged layer gives its pool under \"paged\", not " + std::string(key));
          if (ls[l].contains("out")) f.out = resolve_inside(dir, ls[l]["out"].get<std::string>(), t.manifest_path, lp + "/out");
          if (ls[l].contains("q")) f.q = resolve_inside(dir, ls[l]["q"].get<std::string>(), t.manifest_path, lp + "/q");
          layers.push_back(f);
          continue;
        }
        // Keys and values, unless their codes stand in for them (SPEC 9.3: then the checker
        // dequantizes).
        for (const char* key : {"keys", "values"})
          if ((!ls[l].contains(key) && !ls[l].contains(std::string(key) == "keys" ? "k_codes" : "v_codes")) ||
              (ls[l].contains(key) && !ls[l][key].is_string()))
            fail(lp + "/" + key, "expected a file name");
        auto file = [&](const char* key) {
          return resolve_inside(dir, ls[l][key].get<std::string>(), t.manifest_path, lp + "/" + key);
        };
        if (ls[l].contains("keys")) f.keys = file("keys");
        if (ls[l].contains("values")) f.values = file("values");
        if (ls[l].contains("out")) f.out = file("out");
        if (ls[l].contains("q")) f.q = file("q");
        if (ls[l].contains("raw")) {
          if (!s.quantized()) fail(lp + "/raw", "the scenario quantizes nothing: a raw mask needs its kv_quant (SPEC 9)");
          if (!ls[l].contains("keys") || !ls[l].contains("values"))
            fail(lp + "/raw", "a raw mask needs \"keys\" and \"values\": they hold the residual's unquantized tokens");
          f.raw = file("raw");
        }
        read_code_files(
            ls[l], lp, s, static_cast<int>(l), [&](const std::string& key) { return file(key.c_str()); },
            [&](const std::string& path, const std::string& why) { fail(path, why); }, f.codes);
        layers.push_back(f);
      }
    }
    t.steps.push_back(std::move(entry));
  }
  if (std::all_of(t.steps.begin(), t.steps.end(),
                  [](const TraceStep& step) { return step.layers.empty() && !step.error; }))
    fail("/steps", "no step was recorded: a trace needs at least one step with layers or an error");
  return t;
}

// A tensor of the trace: float16, float32 or float64, of the expected shape (slots: any).
NpyArray<float> load(const std::string& path, std::vector<std::size_t> expected, const char* what, bool any_third,
                     double& roundoff) {
  double r = 0.0;
  NpyArray<float> a = read_npy_floats(path, &r);
  roundoff = std::max(roundoff, r);
  bool ok = a.shape.size() == expected.size();
  for (std::size_t i = 0; ok && i < expected.size(); ++i) ok = (any_third && i == 2) || a.shape[i] == expected[i];
  if (!ok) {
    std::string want = "[";
    for (std::size_t i = 0; i < expected.size(); ++i)
      want += (i ? ", " : "") + (any_third && i == 2 ? std::string("slots") : std::to_string(expected[i]));
    throw InputError(path, "", fmt::format("expected {} of shape {}], got {}", what, want, shape_string(a.shape)));
  }
  return a;
}

// [B, H, n, D] as the trace stores it, to [B, n, H, D] as the checker reads it.
std::vector<float> to_token_major(const std::vector<float>& x, std::size_t B, std::size_t H, std::size_t n,
                                  std::size_t D) {
  std::vector<float> out(x.size());
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < H; ++h)
      for (std::size_t i = 0; i < n; ++i)
        std::copy_n(x.begin() + static_cast<std::ptrdiff_t>(((b * H + h) * n + i) * D), D,
                    out.begin() + static_cast<std::ptrdiff_t>(((b * n + i) * H + h) * D));
  return out;
}

// Reads the trace step by step as the checker asks, identifying each slot's token by its
// value vector (values are never rotated).
class TraceSource {
 public:
  TraceSource(const Scenario& s, const InputTable& inputs, const Trace& trace)
      : s_(s), inputs_(inputs), trace_(trace) {}

  CacheView operator()(std::size_t i, const StepRecord& rec) {
    const TraceStep& step = trace_.steps[i];
    CacheView view;
    if (step.error) {
      view.error = *step.error;
      return view;
    }
    if (step.layers.empty()) {
      view.recorded = false;
      view.note = step.skipped;
      return view;
    }
    const auto B = rec.rows();
    const auto Hkv = static_cast<std::size_t>(s_.dims.kv_heads), D = static_cast<std::size_t>(s_.dims.head_dim);
    view.batch = static_cast<int>(B);
    // A bfloat16 cache dumps float32 tensors (exactly): the scenario's kv_dtype says how far
    // its values may be from the raw ones, whatever the file's word size.
    view.roundoff = unit_roundoff(s_.kv_dtype);
    view.storage.reserve(4 * step.layers.size());
    for (std::size_t l = 0; l < step.layers.size(); ++l) {
      const TraceFiles& f = step.layers[l];
      if (f.paged) {
        if (!view.paged) view.paged.emplace();
        ViewLayer layer;
        const IdentifyValue id = [&](std::size_t row, int g, const float* v) {
          return identify(static_cast<int>(l), g, v, rec.histories[row], view.roundoff);
        };
        std::vector<std::size_t> lengths;
        for (const RowHistory& h : rec.histories) lengths.push_back(h.size());
        read_paged_layer(*f.paged, lengths, Hkv, D, s_.quantized() ? &s_.quant(static_cast<int>(l)) : nullptr, id, layer,
                         *view.paged, l, view.storage, view.roundoff);
        outputs_and_queries(rec, f, layer, view);
        layer.key_roundoff = key_roundoff(s_, static_cast<int>(l));
        view.layers.push_back(std::move(layer));
        continue;
      }
      std::optional<NpyArray<float>> key_file;
      std::size_t slots = 0;
      if (!f.keys.empty()) {
        key_file = load(f.keys, {B, Hkv, 0, D}, "keys [B, Hkv, slots, D]", true, view.roundoff);
        slots = key_file->shape[2];
      }
      // SPEC 9.3: codes of the same slots, scales and zero points per group.
      std::optional<StoredRows> codes[2];
      for (int t = 0; t < 2; ++t) {
        if (f.codes.codes[t].empty()) continue;
        const TensorQuant& quant = t == 0 ? *s_.quant(static_cast<int>(l)).k : *s_.quant(static_cast<int>(l)).v;
        codes[t] = StoredRows::read(f.codes, t, quant, {B, Hkv, slots}, D);  // slots 0: any
        slots = codes[t]->codes.shape[2];
      }
      // Which slots hold their token raw (SPEC 9's residual).
      std::optional<NpyArray<std::int32_t>> raw;
      if (!f.raw.empty()) {
        raw = read_npy_codes(f.raw);
        if (raw->shape != std::vector<std::size_t>{B, slots})
          throw InputError(f.raw, "", fmt::format("expected a raw mask of shape {}, got {}",
                                                  shape_string({B, slots}), shape_string(raw->shape)));
        for (std::int32_t x : raw->data)
          if (x != 0 && x != 1) throw InputError(f.raw, "", fmt::format("expected 0 or 1 in a raw mask, got {}", x));
      }
      // Left out: what the codes stand for, the transform undone.
      const auto dequantized = [&](int t) {
        const TensorQuant& quant = t == 0 ? *s_.quant(static_cast<int>(l)).k : *s_.quant(static_cast<int>(l)).v;
        return NpyArray<float>{{B, Hkv, slots, D}, codes[t]->dequantized(quant, s_.quant_rules().transform)};
      };
      NpyArray<float> keys = key_file ? std::move(*key_file) : dequantized(0);
      NpyArray<float> values =
          !f.values.empty() ? load(f.values, {B, Hkv, slots, D}, "values [B, Hkv, slots, D]", false, view.roundoff)
                            : dequantized(1);
      view.storage.push_back(std::move(keys.data));
      const float* key_data = view.storage.back().data();
      ViewLayer layer;
      layer.slots.assign(B, std::vector<std::vector<ViewSlot>>(Hkv));
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t g = 0; g < Hkv; ++g)
          for (std::size_t slot = 0; slot < slots; ++slot) {
            const std::size_t at = ((b * Hkv + g) * slots + slot) * D;
            const float* v = values.data.data() + at;
            // All zeros: never written. NaN is not "unused": it is judged (and matches no token).
            if (std::all_of(v, v + D, [](float x) { return x == 0.0f; })) continue;
            ViewSlot s;
            s.slot = static_cast<std::int64_t>(slot);
            s.uid = identify(static_cast<int>(l), static_cast<int>(g), v, rec.histories[b], view.roundoff);
            s.key = key_data + at;
            s.raw = raw && raw->data[b * slots + slot] != 0;
            for (int t = 0; t < 2; ++t)
              if (codes[t] && !s.raw) (t == 0 ? s.key_codes : s.value_codes) = codes[t]->unpacked(at / D);
            layer.slots[b][g].push_back(s);
          }
      outputs_and_queries(rec, f, layer, view);
      layer.key_roundoff = key_roundoff(s_, static_cast<int>(l));
      view.layers.push_back(std::move(layer));
    }
    return view;
  }

 private:
  // An append step's outputs and rotated queries, when the trace gives them.
  void outputs_and_queries(const StepRecord& rec, const TraceFiles& f, ViewLayer& layer, CacheView& view) {
    if (!rec.append) return;
    const auto B = rec.rows(), H = static_cast<std::size_t>(s_.dims.heads),
               D = static_cast<std::size_t>(s_.dims.head_dim);
    const auto n = static_cast<std::size_t>(rec.append->chunk);
    if (!f.out.empty()) {
      const NpyArray<float> out = load(f.out, {B, H, n, D}, "out [B, H, n, D]", false, view.roundoff);
      view.storage.push_back(to_token_major(out.data, B, H, n, D));
      layer.out = view.storage.back().data();
    }
    if (!f.q.empty()) {
      // The query's own precision: the storage's (a quantized cache still computes in it) or the file's.
      view.query_roundoff = std::max(view.query_roundoff, unit_roundoff(s_.kv_dtype));
      const NpyArray<float> q = load(f.q, {B, H, n, D}, "q [B, H, n, D]", false, view.query_roundoff);
      view.roundoff = std::max(view.roundoff, view.query_roundoff);
      view.storage.push_back(to_token_major(q.data, B, H, n, D));
      layer.q = view.storage.back().data();
    }
  }

  // Which uid a value vector of kv head g belongs to: the row's own tokens first, then any
  // uid (stale); -1 for none. Each head is matched on its own: a cache may order slots per head.
  std::int64_t identify(int layer, int g, const float* value, const RowHistory& history, double roundoff) const {
    const int D = s_.dims.head_dim;
    // A quantized value is off by up to a step of its group, relative to the row's largest
    // element (its norm under a transform), not to each element.
    const bool quantized = s_.quantized() && s_.quant(layer).v;
    const double step = quantized ? value_roundoff(s_, layer) : roundoff;
    // How far the value is from uid's, relative to what the storage allows (> 1: no match).
    auto misfit = [&](std::uint64_t uid) {
      const float* raw = inputs_.v_at(layer, uid, g);
      double row = 0.0;
      if (quantized)
        for (int d = 0; d < D; ++d) row += static_cast<double>(raw[d]) * raw[d];
      row = std::sqrt(row);
      double worst = 0.0;
      for (int d = 0; d < D; ++d) {
        const double scale = quantized ? row : std::abs(raw[d]);
        const double r = std::abs(value[d] - raw[d]) / (1e-6 + 2.0 * step * scale);
        if (!(r <= 1.0)) return std::numeric_limits<double>::infinity();  // NaN never matches
        worst = std::max(worst, r);
      }
      return worst;
    };
    // Float storage: the first match (a value is its token's up to a rounding). Quantized,
    // a coarse step can fit several tokens: the closest one, the row's own first.
    std::int64_t best = -1;
    double best_misfit = std::numeric_limits<double>::infinity();
    const auto consider = [&](std::uint64_t uid) {
      const double m = misfit(uid);
      if (m < best_misfit) best_misfit = m, best = static_cast<std::int64_t>(uid);
      return !quantized && best >= 0;
    };
    for (std::size_t i = 0; i < history.size(); ++i)  // operator[]: a pruned token is still its uid
      if (consider(history[i])) return best;
    if (best >= 0) return best;
    for (std::int64_t uid = 0; uid < inputs_.uids; ++uid)
      if (consider(static_cast<std::uint64_t>(uid))) return best;
    return best;
  }

  const Scenario& s_;
  const InputTable& inputs_;
  const Trace& trace_;
};

}  // namespace

CacheTrace verify_trace(const Scenario& s, const std::string& dir, const VerifyOptions& verify) {
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const Trace trace = read_manifest(s, dir, run.steps.size());
  CheckOptions options;
  options.target = "trace";
  options.trace = true;
  options.key_positions = trace.positions;
  options.eviction = trace.eviction;
  options.block_capacity = trace.block_capacity;
  options.picture = verify.picture;
  options.focus_step = verify.focus_step;
  TraceSource source(s, inputs, trace);
  return check_steps(s, inputs, run, options, std::ref(source));
}

}  // namespace kvcheck
