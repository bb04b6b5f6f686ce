#include "tools/harness/scenario/scenario.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "reference/policy.h"
#include "reference/quantize.h"
#include "tools/harness/scenario/content_keys.h"
#include "tools/harness/scenario/layer_groups.h"
#include "tools/harness/scenario/parse_sections.h"
#include "tools/harness/io/json_input.h"
#include "tools/harness/io/safe_file.h"

namespace kvcheck {

using json = nlohmann::json;
// The parser's reader and its other sections (quantization, paging, cost).
using namespace scenario_parse;  // NOLINT(google-build-using-namespace): this file is their caller

const char* to_string(StepOp op) {
  switch (op) {
    case StepOp::append:
      return "append";
    case StepOp::reorder:
      return "reorder";
    case StepOp::reset:
      return "reset";
    case StepOp::crop:
      return "crop";
    case StepOp::free_rows:
      return "free";
    case StepOp::evict:
      return "evict";
    case StepOp::preempt:
      return "preempt";
    case StepOp::resume:
      return "resume";
    case StepOp::prune:
      return "prune";
  }
  return "?";
}

double Scenario::softmax_scale() const { return scale ? *scale : 1.0 / std::sqrt(dims.head_dim); }

const Policy* Scenario::shared_policy() const {
  if (policies.empty()) return nullptr;
  const Policy& first = policies.front();
  return std::all_of(policies.begin(), policies.end(), [&](const Policy& p) { return p == first; }) ? &first : nullptr;
}

const Rope* Scenario::shared_rope() const {
  if (ropes.empty()) return nullptr;
  const Rope& first = ropes.front();
  return std::all_of(ropes.begin(), ropes.end(), [&](const Rope& r) { return r == first; }) ? &first : nullptr;
}

bool Scenario::mixed_quant() const {
  return std::any_of(quants.begin(), quants.end(), [&](const KvQuant& q) { return !(q == quants.front()); });
}

namespace {

constexpr int kMaxBatch = 4096;
constexpr std::int64_t kMaxStepRows = std::int64_t{1} << 24;
constexpr std::size_t kMaxNameLength = 128;  // a file name is at most 255 bytes: room for suffixes

// The names a step may give in `expect_error`.
const std::vector<std::string> kKnownErrors = {"crop_evicted"};

Dims parse_dims(const Reader& r, const json& j) {
  const std::string p = "/dimensions";
  r.object(j, p, {"layers", "batch", "heads", "kv_heads", "head_dim"});
  Dims d;
  d.layers = static_cast<int>(r.integer(r.field(j, p, "layers"), p + "/layers", 1, 1024));
  d.batch = static_cast<int>(r.integer(r.field(j, p, "batch"), p + "/batch", 1, kMaxBatch));
  d.heads = static_cast<int>(r.integer(r.field(j, p, "heads"), p + "/heads", 1, 4096));
  d.kv_heads = j.contains("kv_heads") ? static_cast<int>(r.integer(j["kv_heads"], p + "/kv_heads", 1, 4096)) : d.heads;
  d.head_dim = static_cast<int>(r.integer(r.field(j, p, "head_dim"), p + "/head_dim", 2, 4096));
  if (d.heads % d.kv_heads != 0)
    r.fail(p + "/kv_heads", fmt::format("heads ({}) must be a multiple of kv_heads ({})", d.heads, d.kv_heads));
  if (d.head_dim % 2 != 0) r.fail(p + "/head_dim", fmt::format("expected an even head_dim, got {}", d.head_dim));
  return d;
}

// `rope.scaling` as a checkpoint's config.json writes `rope_scaling` (SPEC 7), so one can
// be pasted: {"rope_type" (or "type"): "linear" | "llama3" | "yarn", "factor": f, ...}.
void parse_scaling_object(const Reader& r, const json& j, const std::string& p, Rope& rope) {
  // The type first: a config of another type (longrope, dynamic) is named as such, not
  // reported by its first unknown key.
  if (j.contains("rope_type") && j.contains("type")) r.fail(p + "/type", "give \"rope_type\" or \"type\", not both");
  const char* type_key = j.contains("type") ? "type" : "rope_type";
  const std::string type =
      r.choice(r.field(j, p, type_key), p + "/" + type_key, {"default", "linear", "llama3", "yarn"});
  r.object(j, p,
           {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
            "beta_fast", "beta_slow", "attention_factor", "truncate", "mscale", "mscale_all_dim"});
  auto only_for = [&](std::initializer_list<const char*> keys, const char* types) {
    for (const char* key : keys)
      if (j.contains(key)) r.fail(p + "/" + key, fmt::format("\"{}\" belongs to {} scaling, not {}", key, types, type));
  };
  if (type == "default") {
    only_for({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "attention_factor", "truncate", "mscale", "mscale_all_dim"},
             "another");
    rope.scaling = RopeScaling::none;
    return;
  }
  rope.factor = r.number(r.field(j, p, "factor"), p + "/factor", false);
  if (type == "linear") {
    only_for({"low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "attention_factor", "truncate", "mscale", "mscale_all_dim"},
             "llama3 or yarn");
    rope.scaling = RopeScaling::linear;
    return;
  }
  auto original_length = [&] {
    if (!j.contains("original_max_position_embeddings"))
      r.fail(p + "/original_max_position_embeddings",
             "missing required field (a config.json without it uses the model's max_position_embeddings: copy "
             "that value here)");
    return r.number(j["original_max_position_embeddings"], p + "/original_max_position_embeddings", false);
  };
  if (type == "llama3") {
    only_for({"beta_fast", "beta_slow", "attention_factor", "truncate", "mscale", "mscale_all_dim"}, "yarn");
    rope.scaling = RopeScaling::llama3;
    rope.low_freq_factor = r.number(r.field(j, p, "low_freq_factor"), p + "/low_freq_factor", false);
    rope.high_freq_factor = r.number(r.field(j, p, "high_freq_factor"), p + "/high_freq_factor", false);
    if (rope.high_freq_factor <= rope.low_freq_factor)
      r.fail(p + "/high_freq_factor", fmt::format("expected high_freq_factor > low_freq_factor ({}), got {}",
                                                  rope.low_freq_factor, rope.high_freq_factor));
    rope.original_max_position_embeddings = original_length();
    return;
  }
  only_for({"low_freq_factor", "high_freq_factor"}, "llama3");
  // DeepSeek's variant and transformers' unrounded correction range are not in SPEC 7 yet:
  // refuse them rather than compute something else.
  for (const char* key : {"mscale", "mscale_all_dim"})
    if (j.contains(key))
      r.fail(p + "/" + key, fmt::format("\"{}\" (DeepSeek's yarn magnitude) is not supported; give "
                                        "\"attention_factor\" instead",
                                        key));
  if (j.contains("truncate") && !(j["truncate"].is_boolean() && j["truncate"].get<bool>()))
    r.fail(p + "/truncate", "only \"truncate\": true is supported (SPEC 7 rounds the correction range to whole dims)");
  rope.scaling = RopeScaling::yarn;
  if (rope.theta <= 1.0)
    r.fail(p.substr(0, p.rfind('/')) + "/theta", fmt::format("yarn needs theta > 1 (it divides by ln theta), got {}", rope.theta));
  rope.original_max_position_embeddings = original_length();
  if (j.contains("beta_fast")) rope.beta_fast = r.number(j["beta_fast"], p + "/beta_fast", false);
  if (j.contains("beta_slow")) rope.beta_slow = r.number(j["beta_slow"], p + "/beta_slow", false);
  if (rope.beta_slow >= rope.beta_fast)
    r.fail(p + "/beta_slow",
           fmt::format("expected beta_slow < beta_fast ({}), got {}", rope.beta_fast, rope.beta_slow));
  rope.attention_factor = j.contains("attention_factor")
                              ? r.number(j["attention_factor"], p + "/attention_factor", false)
                              : (rope.factor > 1.0 ? 0.1 * std::log(rope.factor) + 1.0 : 1.0);
}

Rope parse_rope(const Reader& r, const json& j, int head_dim, const std::string& p = "/rope") {
  if (j.is_null()) {  // SPEC 10.1: a NoPE layer
    Rope nope;
    nope.nope = true;
    return nope;
  }
  r.object(j, p, {"theta", "layout", "scaling", "factor", "rotary_dim", "partial_rotary_factor"});
  Rope rope;
  if (j.contains("theta")) rope.theta = r.number(j["theta"], p + "/theta", false);
  if (j.contains("layout"))
    rope.layout = r.choice(j["layout"], p + "/layout", {"half", "interleaved"}) == "half" ? RopeLayout::half
                                                                                          : RopeLayout::interleaved;
  if (j.contains("scaling") && j["scaling"].is_null()) {
    // A config.json's "rope_scaling": null, pasted: no scaling.
    if (j.contains("factor")) r.fail(p + "/factor", "a factor needs \"scaling\": \"linear\"");
  } else if (j.contains("scaling") && j["scaling"].is_object()) {
    if (j.contains("factor")) r.fail(p + "/factor", "give the factor inside \"scaling\" when scaling is an object");
    parse_scaling_object(r, j["scaling"], p + "/scaling", rope);
  } else {
    if (j.contains("scaling") && !j["scaling"].is_string())
      r.fail(p + "/scaling", "expected \"none\", \"linear\" or an object like a config.json's rope_scaling, got " +
                                 describe(j["scaling"]));
    if (j.contains("scaling"))
      rope.scaling = r.choice(j["scaling"], p + "/scaling", {"none", "linear"}) == "none" ? RopeScaling::none
                                                                                          : RopeScaling::linear;
    if (rope.scaling == RopeScaling::linear) {
      rope.factor = r.number(r.field(j, p, "factor"), p + "/factor", false);
    } else if (j.contains("factor")) {
      r.fail(p + "/factor", "a factor needs \"scaling\": \"linear\"");
    }
  }
  if (j.contains("rotary_dim") && j.contains("partial_rotary_factor"))
    r.fail(p + "/partial_rotary_factor", "give \"rotary_dim\" or \"partial_rotary_factor\", not both");
  if (j.contains("rotary_dim")) {
    rope.rotary_dim = static_cast<int>(r.integer(j["rotary_dim"], p + "/rotary_dim", 2, head_dim));
    if (rope.rotary_dim % 2 != 0)
      r.fail(p + "/rotary_dim", fmt::format("expected an even rotary_dim, got {}", rope.rotary_dim));
  }
  if (j.contains("partial_rotary_factor")) {
    // As transformers reads a config.json: R = int(head_dim * factor).
    const double f = r.number(j["partial_rotary_factor"], p + "/partial_rotary_factor", false);
    const auto rotary = f <= 1.0 ? static_cast<std::int64_t>(head_dim * f) : std::int64_t{0};  // no overflow
    if (f > 1.0 || rotary < 2 || rotary % 2 != 0)
      r.fail(p + "/partial_rotary_factor",
             fmt::format("expected a factor in (0, 1] giving an even rotary_dim of at least 2, got {} (head_dim {} "
                         "x {} = {})",
                         f, head_dim, f, rotary));
    rope.rotary_dim = static_cast<int>(rotary);
  }
  return rope;
}

// SPEC 7: "sink_logits": one finite number per query head, or per layer a list of them.
Attention parse_attention(const Reader& r, const json& j, const Dims& dims) {
  const std::string p = "/attention";
  r.object(j, p, {"sink_logits", "query_temperature"});
  Attention a;
  if (j.contains("query_temperature")) {  // SPEC 10.3
    const json& t = j["query_temperature"];
    const std::string tp = p + "/query_temperature";
    r.object(t, tp, {"floor_scale", "attn_scale"});
    QueryTemperature temperature;
    if (t.contains("floor_scale")) temperature.floor_scale = r.integer(t["floor_scale"], tp + "/floor_scale", 1);
    if (t.contains("attn_scale")) temperature.attn_scale = r.number(t["attn_scale"], tp + "/attn_scale", true);
    a.query_temperature = temperature;
  }
  if (!j.contains("sink_logits")) return a;
  const json& s = j["sink_logits"];
  const std::string sp = p + "/sink_logits";
  auto heads = [&](const json& list, const std::string& lp) {
    if (!list.is_array() || list.size() != static_cast<std::size_t>(dims.heads))
      r.fail(lp, fmt::format("expected a list of {} numbers (one per query head), got {}", dims.heads, describe(list)));
    std::vector<double> out;
    for (std::size_t h = 0; h < list.size(); ++h) {
      const json& x = list[h];
      if (!x.is_number() || !std::isfinite(x.get<double>()))
        r.fail(lp + "/" + std::to_string(h), "expected a finite number, got " + describe(x));
      out.push_back(x.get<double>());
    }
    return out;
  };
  if (!s.is_array() || s.empty()) r.fail(sp, "expected a list, got " + describe(s));
  if (s[0].is_array()) {
    if (s.size() != static_cast<std::size_t>(dims.layers))
      r.fail(sp, fmt::format("expected one list per layer ({}), got {}", dims.layers, s.size()));
    for (std::size_t l = 0; l < s.size(); ++l) a.sink_logits.push_back(heads(s[l], sp + "/" + std::to_string(l)));
  } else {
    a.sink_logits.assign(static_cast<std::size_t>(dims.layers), heads(s, sp));
  }
  return a;
}



Policy parse_policy(const Reader& r, const json& j, const std::string& p = "/policy") {
  if (!j.is_object()) r.fail(p, "expected an object, got " + describe(j));
  Policy policy;
  const std::string type = r.choice(r.field(j, p, "type"), p + "/type", {"full", "sliding", "sink", "chunked"});
  if (type == "full") {
    r.object(j, p, {"type"});
    policy.kind = PolicyKind::full;
  } else if (type == "chunked") {  // SPEC 10.2
    r.object(j, p, {"type", "chunk"});
    policy.kind = PolicyKind::chunked;
    policy.window = r.integer(r.field(j, p, "chunk"), p + "/chunk", 1);
  } else if (type == "sliding") {
    r.object(j, p, {"type", "window", "shift_with"});
    policy.kind = PolicyKind::sliding;
    policy.window = r.integer(r.field(j, p, "window"), p + "/window", 1);
    // SPEC 10.4: resolved against layer shift_with's sink policy once every layer is read.
    if (j.contains("shift_with")) policy.shift_with = static_cast<int>(r.integer(j["shift_with"], p + "/shift_with", 0));
  } else {
    r.object(j, p, {"type", "sinks", "window", "evict", "positions", "prefill"});
    policy.kind = PolicyKind::sink;
    policy.window = r.integer(r.field(j, p, "window"), p + "/window", 1);
    policy.sinks = r.integer(r.field(j, p, "sinks"), p + "/sinks", 0);
    if (policy.sinks >= policy.window)
      r.fail(p + "/sinks", fmt::format("expected sinks < window ({}), got {}", policy.window, policy.sinks));
    if (j.contains("evict")) {
      policy.evict = r.integer(j["evict"], p + "/evict", 1);
      if (policy.evict > policy.window - policy.sinks)
        r.fail(p + "/evict", fmt::format("expected 1 <= evict <= window - sinks ({}), got {}",
                                         policy.window - policy.sinks, policy.evict));
    }
    if (j.contains("positions"))
      policy.positions = r.choice(j["positions"], p + "/positions", {"cache", "original"}) == "cache"
                             ? SinkPositions::cache
                             : SinkPositions::original;
    if (j.contains("prefill"))
      policy.prefill = r.choice(j["prefill"], p + "/prefill", {"streaming", "dense"}) == "streaming"
                           ? Prefill::streaming
                           : Prefill::dense;
  }
  return policy;
}

Tolerance parse_tolerance(const Reader& r, const json& j) {
  const std::string p = "/tolerance";
  r.object(j, p, {"rtol", "atol"});
  Tolerance t;
  if (j.contains("rtol")) t.rtol = r.number(j["rtol"], p + "/rtol", true);
  if (j.contains("atol")) t.atol = r.number(j["atol"], p + "/atol", true);
  return t;
}

// Flattens a nested array of numbers of exactly `shape` (outermost first).
void flatten(const Reader& r, const json& j, const std::string& path, const std::vector<std::int64_t>& shape,
             std::size_t depth, std::vector<float>& out) {
  if (depth == shape.size()) {
    if (!j.is_number()) r.fail(path, "expected a number, got " + describe(j));
    const double v = j.get<double>();
    if (!std::isfinite(v) || std::abs(v) > 3.4e38) r.fail(path, "expected a finite float32 value, got " + describe(j));
    out.push_back(static_cast<float>(v));
    return;
  }
  if (!j.is_array() || static_cast<std::int64_t>(j.size()) != shape[depth])
    r.fail(path, fmt::format("expected an array of {} elements, got {}", shape[depth], describe(j)));
  for (std::size_t i = 0; i < j.size(); ++i) flatten(r, j[i], path + "/" + std::to_string(i), shape, depth + 1, out);
}

void parse_inputs(const Reader& r, const json& j, Scenario& s) {
  const std::string p = "/inputs";
  r.object(j, p, {"q", "k", "v"});
  for (const char* key : {"q", "k", "v"}) r.field(j, p, key);
  if (j["q"].is_string()) {
    s.inputs.kind = InputSource::Kind::npy;
    const std::string dir = std::filesystem::path(r.file()).parent_path().string();
    auto path_of = [&](const char* key) {
      return resolve_inside(dir, r.string(j[key], p + "/" + key), r.file(), p + "/" + key);
    };
    s.inputs.q_path = path_of("q");
    s.inputs.k_path = path_of("k");
    s.inputs.v_path = path_of("v");
    return;
  }
  s.inputs.kind = InputSource::Kind::inline_arrays;
  const std::int64_t uids = count_uids(s);
  const Dims& d = s.dims;
  flatten(r, j["q"], p + "/q", {d.layers, uids, d.heads, d.head_dim}, 0, s.inputs.q);
  flatten(r, j["k"], p + "/k", {d.layers, uids, d.kv_heads, d.head_dim}, 0, s.inputs.k);
  flatten(r, j["v"], p + "/v", {d.layers, uids, d.kv_heads, d.head_dim}, 0, s.inputs.v);
}

std::string expect_error(const Reader& r, const json& step, const std::string& path) {
  if (!step.contains("expect_error")) return "";
  return r.choice(step["expect_error"], path + "/expect_error", kKnownErrors);
}

// Row indices below `batch`.
std::vector<int> row_list(const Reader& r, const json& j, const std::string& p, int batch) {
  if (!j.is_array() || j.empty()) r.fail(p, "expected a non-empty array of row indices");
  if (j.size() > kMaxBatch)
    r.fail(p, fmt::format("expected at most {} rows (the batch limit), got {}", kMaxBatch, j.size()));
  std::vector<int> rows;
  for (std::size_t b = 0; b < j.size(); ++b) {
    const auto row = r.integer(j[b], p + "/" + std::to_string(b), 0);
    if (row >= batch) r.fail(p + "/" + std::to_string(b), fmt::format("expected a row index below {}, got {}", batch, row));
    rows.push_back(static_cast<int>(row));
  }
  return rows;
}

// `ids`: one list of token ids per row (SPEC 8.1); their lengths are the counts.
void parse_ids(const Reader& r, const json& j, const std::string& p, int batch, const Scenario& scenario, Step& step) {
  if (scenario.content != Content::prefix)
    r.fail(p, "token ids need \"content\": \"prefix\" (with content \"uid\" a token's vectors come from its uid)");
  if (!j.is_array() || static_cast<int>(j.size()) != batch)
    r.fail(p, fmt::format("expected one list of token ids per row ({} rows), got {}", batch, describe(j)));
  std::int64_t total = 0;
  for (std::size_t b = 0; b < j.size(); ++b) {
    const std::string pb = p + "/" + std::to_string(b);
    if (!j[b].is_array()) r.fail(pb, "expected a list of token ids, got " + describe(j[b]));
    auto& row = step.ids.emplace_back();
    for (std::size_t i = 0; i < j[b].size(); ++i)
      row.push_back(static_cast<std::uint64_t>(r.integer(j[b][i], pb + "/" + std::to_string(i), 0, (std::int64_t{1} << 31) - 1)));
    step.tokens.push_back(static_cast<std::int64_t>(row.size()));
    total += static_cast<std::int64_t>(row.size());
    if (total > (std::int64_t{1} << 24)) r.fail(pb, "more than 2^24 token ids in one append");
  }
  if (total == 0) r.fail(p, "expected at least one row with a token");
}

// An append's paged fields: `extra` and `expect_hit` (rows that start: empty before the
// append) and `chunk`.
void parse_append_paging(const Reader& r, const json& s, const std::string& p, const std::vector<std::int64_t>& lengths,
                         const Scenario& scenario, Step& step) {
  const int batch = static_cast<int>(lengths.size());
  auto per_row = [&](const char* key, const std::string& what) -> const json& {
    const json& j = s[key];
    if (!j.is_array() || static_cast<int>(j.size()) != batch)
      r.fail(p + "/" + key, fmt::format("expected one {} per row ({} rows), null for none, got {}", what, batch, describe(j)));
    for (std::size_t b = 0; b < j.size(); ++b)
      if (!j[b].is_null() && lengths[b] > 0)
        r.fail(p + "/" + key + "/" + std::to_string(b),
               fmt::format("row {} already holds {} tokens; {} applies to a row that starts (empty before the append)",
                           b, lengths[b], key));
    return j;
  };
  if (s.contains("extra")) {
    if (scenario.content != Content::prefix)
      r.fail(p + "/extra", "extras enter context keys: the scenario needs \"content\": \"prefix\"");
    const json& j = per_row("extra", "object {\"adapter\", \"salt\"}");
    for (std::size_t b = 0; b < j.size(); ++b) {
      auto& given = step.extras_given.emplace_back();
      if (j[b].is_null()) continue;
      const std::string pb = p + "/extra/" + std::to_string(b);
      r.object(j[b], pb, {"adapter", "salt"});
      RowExtras e;
      if (j[b].contains("adapter")) e.adapter = r.string(j[b]["adapter"], pb + "/adapter");
      if (j[b].contains("salt")) e.salt = r.string(j[b]["salt"], pb + "/salt");
      if (e.adapter.size() > 256 || e.salt.size() > 256) r.fail(pb, "expected an adapter and a salt of at most 256 bytes");
      given = e;
    }
  }
  if (s.contains("expect_hit")) {
    if (!scenario.paging) r.fail(p + "/expect_hit", "prefix hits need a paged cache: the scenario needs \"paging\"");
    const json& j = per_row("expect_hit", "hit count or {\"min\", \"max\"}");
    for (std::size_t b = 0; b < j.size(); ++b) {
      auto& hit = step.expect_hit.emplace_back();
      if (j[b].is_null()) continue;
      const std::string pb = p + "/expect_hit/" + std::to_string(b);
      if (j[b].is_object()) {
        r.object(j[b], pb, {"min", "max"});
        const std::int64_t lo = r.integer(r.field(j[b], pb, "min"), pb + "/min", 0);
        const std::int64_t hi = r.integer(r.field(j[b], pb, "max"), pb + "/max", lo);
        if (hi != lo && any_frozen_scales(scenario))
          r.fail(pb, "under a scale frozen at the first append (\"first_append\") a hit's tokens keep their writer's "
                     "scale, so the reference must know the hit: expected an exact count");
        hit = HitRange{lo, hi};
      } else {
        const std::int64_t n = r.integer(j[b], pb, 0);
        hit = HitRange{n, n};
      }
      if (hit->min >= std::max<std::int64_t>(step.tokens[b], 1) && hit->min > 0)
        r.fail(pb, fmt::format("expected fewer hit tokens than the row's {} new tokens (the last one is always computed)",
                               step.tokens[b]));
    }
  }
  if (s.contains("chunk")) step.chunk = r.integer(s["chunk"], p + "/chunk", 1);
}

// SPEC 11: a one-time prune of every row's full-attention layers to its sinks and recent
// tokens (kvpress's StreamingLLMPress, re-rotated or not). A window layer (sliding,
// chunked) keeps what its policy keeps; beside a sink layer's shifts it is not defined.
// SPEC 11.1, "select": "observed": the row keeps `keep` tokens a score-based press chooses
// (its sinks and recent tokens among them), read from the cache.
void parse_prune(const Reader& r, const json& s, const std::string& p, const Scenario& scenario,
                 const std::vector<int>& pruned, Step& step) {
  r.object(s, p, {"op", "sinks", "recent", "rerotate", "select", "keep"});
  step.op = StepOp::prune;
  const bool observed = s.contains("select");
  if (observed) {
    r.choice(s["select"], p + "/select", {"observed"});
    step.prune_keep = r.integer(r.field(s, p, "keep"), p + "/keep", 1);
  } else if (s.contains("keep")) {
    r.fail(p + "/keep", "expected \"keep\" only with \"select\": \"observed\" (SPEC 11.1); a prune to sinks and "
                        "recent tokens keeps sinks + recent");
  }
  step.prune_sinks = observed && !s.contains("sinks") ? 0 : r.integer(r.field(s, p, "sinks"), p + "/sinks", 0);
  step.prune_recent = observed && !s.contains("recent") ? 0 : r.integer(r.field(s, p, "recent"), p + "/recent", 0);
  if (!observed && step.prune_sinks + step.prune_recent == 0)
    r.fail(p + "/recent", "expected sinks + recent >= 1: a prune keeps at least one token of each row");
  if (observed && step.prune_sinks + step.prune_recent > step.prune_keep)
    r.fail(p + "/recent", fmt::format("expected sinks + recent <= keep ({}): the required tokens are among the kept, "
                                      "got {} + {}",
                                      step.prune_keep, step.prune_sinks, step.prune_recent));
  if (s.contains("rerotate")) {
    if (!s["rerotate"].is_boolean()) r.fail(p + "/rerotate", "expected true or false, got " + describe(s["rerotate"]));
    step.rerotate = s["rerotate"].get<bool>();
  }
  bool full = false;
  for (int l = 0; l < scenario.dims.layers; ++l) {
    const PolicyKind kind = scenario.policy(l).kind;
    full = full || kind == PolicyKind::full;
    if (kind == PolicyKind::sink || scenario.policy(l).swa > 0)
      r.fail(p + "/op", fmt::format("a prune (SPEC 11) takes tokens from full-attention layers beside window layers, "
                                    "but layer {}'s policy is \"sink\"",
                                    l));
  }
  if (!full) r.fail(p + "/op", "a prune (SPEC 11) takes tokens from full-attention layers, and no layer is one");
  if (scenario.quantized()) not_yet(r, p + "/op", "a prune of a quantized store", "SPEC 11");
  if (scenario.paging) not_yet(r, p + "/op", "a prune of a paged cache", "SPEC 11");
  for (std::size_t b = 0; b < pruned.size(); ++b)
    if (pruned[b] >= 0)
      r.fail(p + "/op", fmt::format("row {} was pruned at /steps/{} already: one prune per row until a reset or free "
                                    "(SPEC 11)",
                                    b, pruned[b]));
}

// Parses the steps while tracking the batch size, so per-row counts and reorder indices
// are checked against the rows that exist at that point.
std::vector<Step> parse_steps(const Reader& r, const json& j, int batch, const Scenario& scenario) {
  if (!j.is_array() || j.empty()) r.fail("/steps", "expected a non-empty array of steps");
  std::vector<Step> steps;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(batch), 0);  // to tell which rows start
  std::vector<int> preempted(static_cast<std::size_t>(batch), -1);        // the preempt step's index, or -1
  std::vector<int> pruned(static_cast<std::size_t>(batch), -1);           // the prune step's index, or -1
  // SPEC 11.1: the prompt length of a row whose observed prune took tokens, or 0.
  std::vector<std::int64_t> observed(static_cast<std::size_t>(batch), 0);
  // Every expanded step stores a count per row: bound their number before expanding.
  std::int64_t step_rows = 0;
  auto count = [&](const std::string& p, std::int64_t steps_added) {
    step_rows += steps_added * batch;
    if (step_rows > kMaxStepRows)
      r.fail(p, fmt::format("the steps so far come to {} (step, row) pairs after expanding decode; kvcheck accepts "
                            "up to {}",
                            step_rows, kMaxStepRows));
  };
  for (std::size_t i = 0; i < j.size(); ++i) {
    const json& s = j[i];
    const std::string p = "/steps/" + std::to_string(i);
    if (!s.is_object()) r.fail(p, "expected an object, got " + describe(s));
    const std::string op = r.choice(r.field(s, p, "op"), p + "/op",
                                    {"append", "decode", "reorder", "reset", "crop", "free", "evict", "preempt", "resume", "prune"});
    // Preempted rows (SPEC 8.6) take no tokens and no row change until they resume.
    auto require_running = [&](const std::string& path, const std::string& what) {
      for (std::size_t b = 0; b < preempted.size(); ++b)
        if (preempted[b] >= 0)
          r.fail(path, fmt::format("row {} is preempted (at /steps/{}): {} until it resumes", b, preempted[b], what));
    };
    Step step;
    const std::size_t first_new = steps.size();
    step.source_index = static_cast<int>(i);
    step.source_op = op;
    if (op == "append") {
      r.object(s, p, {"op", "tokens", "ids", "extra", "expect_hit", "chunk"});
      if (s.contains("tokens") == s.contains("ids"))
        r.fail(p + "/tokens", "expected either \"tokens\" (counts) or \"ids\" (token ids per row), not both");
      if (s.contains("ids")) {
        parse_ids(r, s["ids"], p + "/ids", batch, scenario, step);
      } else if (const json& tokens = s["tokens"]; tokens.is_array()) {
        if (static_cast<int>(tokens.size()) != batch)
          r.fail(p + "/tokens", fmt::format("expected one count per row ({} rows), got {}", batch, tokens.size()));
        for (std::size_t b = 0; b < tokens.size(); ++b)
          step.tokens.push_back(r.integer(tokens[b], p + "/tokens/" + std::to_string(b), 0));
        if (*std::max_element(step.tokens.begin(), step.tokens.end()) == 0)
          r.fail(p + "/tokens", "expected at least one row with a token");
      } else {
        step.tokens.assign(static_cast<std::size_t>(batch), r.integer(tokens, p + "/tokens", 1));
      }
      parse_append_paging(r, s, p, lengths, scenario, step);
      for (std::size_t b = 0; b < preempted.size(); ++b)
        if (preempted[b] >= 0 && step.tokens[b] > 0)
          r.fail(p + (s.contains("ids") ? "/ids/" : "/tokens/") + std::to_string(b),
                 fmt::format("row {} is preempted (at /steps/{}): it takes no tokens until it resumes", b,
                             preempted[b]));
      count(p, 1);
      steps.push_back(step);
    } else if (op == "decode") {
      r.object(s, p, {"op", "steps"});
      const std::int64_t k = r.integer(r.field(s, p, "steps"), p + "/steps", 1, 1000000);
      if (steps.size() + static_cast<std::size_t>(k) > 1000000)
        r.fail(p + "/steps", "more than a million steps in all after expanding decode");
      count(p + "/steps", k);
      require_running(p, "decode appends a token to every row; give per-row counts with append");
      step.op = StepOp::append;
      step.tokens.assign(static_cast<std::size_t>(batch), 1);
      for (std::int64_t n = 0; n < k; ++n) steps.push_back(step);
    } else if (op == "reorder") {
      r.object(s, p, {"op", "rows"});
      step.op = StepOp::reorder;
      require_running(p, "a reorder moves no preempted row");
      step.rows = row_list(r, r.field(s, p, "rows"), p + "/rows", batch);
      batch = static_cast<int>(step.rows.size());
      preempted.assign(static_cast<std::size_t>(batch), -1);
      pruned = [&] {
        std::vector<int> next;
        for (int row : step.rows) next.push_back(pruned[static_cast<std::size_t>(row)]);
        return next;
      }();
      observed = [&] {
        std::vector<std::int64_t> next;
        for (int row : step.rows) next.push_back(observed[static_cast<std::size_t>(row)]);
        return next;
      }();
      count(p, 1);
      steps.push_back(step);
    } else if (op == "reset") {
      r.object(s, p, {"op", "batch"});
      step.op = StepOp::reset;
      if (s.contains("batch")) batch = static_cast<int>(r.integer(s["batch"], p + "/batch", 1, kMaxBatch));
      step.batch = batch;
      preempted.assign(static_cast<std::size_t>(batch), -1);
      pruned.assign(static_cast<std::size_t>(batch), -1);
      observed.assign(static_cast<std::size_t>(batch), 0);
      count(p, 1);
      steps.push_back(step);
    } else if (op == "free") {
      r.object(s, p, {"op", "rows"});
      step.op = StepOp::free_rows;
      step.rows = row_list(r, r.field(s, p, "rows"), p + "/rows", batch);
      std::set<int> distinct(step.rows.begin(), step.rows.end());
      if (distinct.size() != step.rows.size()) r.fail(p + "/rows", "expected each row at most once");
      for (int b : step.rows) preempted[static_cast<std::size_t>(b)] = -1;  // a preempted row may end
      for (int b : step.rows) pruned[static_cast<std::size_t>(b)] = -1;
      for (int b : step.rows) observed[static_cast<std::size_t>(b)] = 0;
      count(p, 1);
      steps.push_back(step);
    } else if (op == "preempt" || op == "resume") {
      const bool pre = op == "preempt";
      r.object(s, p, pre ? std::initializer_list<const char*>{"op", "rows", "mode"}
                         : std::initializer_list<const char*>{"op", "rows"});
      if (!scenario.paging) r.fail(p + "/op", "\"" + op + "\" moves a row's blocks: the scenario needs \"paging\"");
      step.op = pre ? StepOp::preempt : StepOp::resume;
      step.rows = row_list(r, r.field(s, p, "rows"), p + "/rows", batch);
      std::set<int> distinct(step.rows.begin(), step.rows.end());
      if (distinct.size() != step.rows.size()) r.fail(p + "/rows", "expected each row at most once");
      if (pre) step.recompute = r.choice(r.field(s, p, "mode"), p + "/mode", {"swap", "recompute"}) == "recompute";
      for (std::size_t k = 0; k < step.rows.size(); ++k) {
        const auto b = static_cast<std::size_t>(step.rows[k]);
        const std::string pk = p + "/rows/" + std::to_string(k);
        if (pre && preempted[b] >= 0) r.fail(pk, fmt::format("row {} is already preempted (at /steps/{})", b, preempted[b]));
        if (pre && lengths[b] == 0) r.fail(pk, fmt::format("row {} holds no token: there is nothing to preempt", b));
        if (!pre && preempted[b] < 0) r.fail(pk, fmt::format("row {} is not preempted: resume follows preempt", b));
        preempted[b] = pre ? static_cast<int>(i) : -1;
      }
      count(p, 1);
      steps.push_back(step);
    } else if (op == "evict") {
      r.object(s, p, {"op", "blocks"});
      step.op = StepOp::evict;
      if (!scenario.paging) r.fail(p + "/op", "\"evict\" drops blocks of a paged cache: the scenario needs \"paging\"");
      const json& blocks = r.field(s, p, "blocks");
      if (blocks.is_string())
        r.choice(blocks, p + "/blocks", {"all"});
      else
        step.evict_blocks = r.integer(blocks, p + "/blocks", 1);
      count(p, 1);
      steps.push_back(step);
    } else if (op == "prune") {
      parse_prune(r, s, p, scenario, pruned, step);
      for (std::size_t b = 0; b < lengths.size(); ++b) {
        if (lengths[b] > 0) pruned[b] = static_cast<int>(i);
        if (step.prune_keep > 0 && step.prune_keep < lengths[b]) observed[b] = lengths[b];
      }
      count(p, 1);
      steps.push_back(step);
    } else {
      r.object(s, p, {"op", "length", "expect_error"});
      require_running(p, "a crop cuts no preempted row");
      step.op = StepOp::crop;
      step.length = r.integer(r.field(s, p, "length"), p + "/length", 0);
      step.expect_error = expect_error(r, s, p);
      for (std::size_t b = 0; b < observed.size(); ++b)
        if (step.length < observed[b])
          r.fail(p + "/length", fmt::format("expected a length of at least {}: row {}'s prompt of {} tokens was pruned to "
                                            "tokens the cache chose (an observed prune, SPEC 11.1), so a crop into it "
                                            "is not defined",
                                            observed[b], b, observed[b]));
      count(p, 1);
      steps.push_back(step);
    }
    for (std::size_t k = first_new; k < steps.size(); ++k)
      if (steps[k].expect_error.empty()) advance_lengths(steps[k], lengths);
  }
  return steps;
}

// A scenario runs whole within the memory budget or, where its layers can run apart, in
// groups of layers (`run`; layer_groups.h); anything larger is refused before it is spent.
void require_runnable_size(const Reader& r, const Scenario& s) {
  const double floats = input_values(s, s.dims.layers);
  const ScenarioCost cost = estimate_cost(s);
  if (floats <= 1e9 && cost.bytes <= kMemoryBudget) return;
  if (layer_group_size(s, kMemoryBudget) > 0) return;
  const std::string apart = why_layers_cannot_run_apart(s);
  const std::string groups =
      apart.empty() ? " (even one layer at a time)" : fmt::format(" (its layers cannot run in groups: {})", apart);
  if (floats > 1e9)
    r.fail("/steps", fmt::format("the scenario needs {:.3g} input values; kvcheck accepts up to 1e9{}", floats, groups));
  r.fail("/steps", fmt::format("the scenario needs about {} of memory ({}) and about {:.2g} multiply-adds in the "
                               "reference (about {} at 1e9 a second); kvcheck accepts up to {}{}",
                               bytes_text(cost.bytes), cost.breakdown, cost.multiply_adds,
                               duration_text(cost.multiply_adds / 1e9), bytes_text(kMemoryBudget), groups));
}

}  // namespace


Scenario parse_scenario(const std::string& text, const std::string& file) {
  const Reader r(file);
  const json j = parse_json(text, file);
  r.object(j, "",
           {"name", "description", "dimensions", "rope", "attention", "policy", "kv_dtype", "kv_quant", "seed", "inputs",
            "steps", "tolerance", "scale", "paging", "content"});
  Scenario s;
  s.file = file;
  s.source_json = j.dump(2);
  s.name = r.string(r.field(j, "", "name"), "/name");
  if (s.name.empty() || s.name[0] == '.' ||
      s.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") !=
          std::string::npos)
    r.fail("/name", "expected letters, digits, '_', '-' or '.', not starting with '.' (the name names output folders)");
  if (s.name.size() > kMaxNameLength)
    r.fail("/name", fmt::format("expected at most {} characters (the name names output folders), got {}",
                                kMaxNameLength, s.name.size()));
  if (j.contains("description")) s.description = r.string(j["description"], "/description");
  s.dims = parse_dims(r, r.field(j, "", "dimensions"));
  // SPEC 10.1: one rope for every layer, or a list of one per layer (null: NoPE).
  s.ropes.assign(static_cast<std::size_t>(s.dims.layers), Rope{});
  if (j.contains("rope") && j["rope"].is_array()) {
    if (j["rope"].size() != static_cast<std::size_t>(s.dims.layers))
      r.fail("/rope", fmt::format("expected one rope per layer ({}), got {}", s.dims.layers, j["rope"].size()));
    for (std::size_t l = 0; l < j["rope"].size(); ++l)
      s.ropes[l] = parse_rope(r, j["rope"][l], s.dims.head_dim, "/rope/" + std::to_string(l));
  } else if (j.contains("rope")) {
    if (j["rope"].is_null()) r.fail("/rope", "expected a rope object, or a list of one per layer with null for NoPE");
    s.ropes.assign(static_cast<std::size_t>(s.dims.layers), parse_rope(r, j["rope"], s.dims.head_dim));
  }
  if (j.contains("attention")) s.attention = parse_attention(r, j["attention"], s.dims);
  if (j.contains("kv_dtype")) {
    const std::string dtype = r.choice(j["kv_dtype"], "/kv_dtype", {"float32", "float16", "bfloat16"});
    s.kv_dtype = dtype == "float32" ? KvDtype::float32 : dtype == "float16" ? KvDtype::float16 : KvDtype::bfloat16;
  }
  if (j.contains("kv_quant")) {
    if (j["kv_quant"].is_array())
      s.quants = parse_layer_quants(r, j["kv_quant"], s.dims);
    else
      s.quantize_every_layer(parse_kv_quant(r, j["kv_quant"], s.dims));
  }
  const json& policy = r.field(j, "", "policy");
  if (policy.is_array()) {  // one per layer (SPEC 7)
    if (policy.size() != static_cast<std::size_t>(s.dims.layers))
      r.fail("/policy", fmt::format("expected one policy per layer ({}), got {}", s.dims.layers, policy.size()));
    for (std::size_t l = 0; l < policy.size(); ++l)
      s.policies.push_back(parse_policy(r, policy[l], "/policy/" + std::to_string(l)));
  } else {
    s.policies.assign(static_cast<std::size_t>(s.dims.layers), parse_policy(r, policy));
  }
  // SPEC 10.4: a sliding layer under a sink layer's shift takes that layer's sink policy and
  // sees, of it, the keys within its window.
  for (std::size_t l = 0; l < s.policies.size(); ++l) {
    const Policy here = s.policies[l];
    if (here.shift_with < 0) continue;
    const std::string sp = policy.is_array() ? "/policy/" + std::to_string(l) + "/shift_with" : "/policy/shift_with";
    const auto L = static_cast<std::size_t>(here.shift_with);
    if (L >= s.policies.size() || L == l)
      r.fail(sp, fmt::format("expected another layer's index (0 to {}, not {}), got {}", s.policies.size() - 1, l,
                             here.shift_with));
    const Policy& sink = s.policies[L];
    if (sink.kind != PolicyKind::sink || sink.shift_with >= 0)
      r.fail(sp, fmt::format("expected a layer whose policy is \"sink\", got layer {} ({})", L,
                             sink.shift_with >= 0 ? "a sliding layer under a shift" : to_string(sink.kind)));
    if (sink.positions != SinkPositions::cache || sink.prefill != Prefill::streaming)
      not_yet(r, sp, fmt::format("a sliding layer under a sink layer with positions \"original\" or prefill "
                                 "\"dense\" (layer {})", L), "SPEC 10.4");
    if (here.window >= sink.window)
      r.fail(sp.substr(0, sp.rfind('/')) + "/window",
             fmt::format("expected a window below layer {}'s capacity ({}), got {}", L, sink.window, here.window));
    Policy resolved = sink;
    resolved.swa = here.window;
    resolved.shift_with = here.shift_with;
    s.policies[l] = resolved;
  }
  if (s.attention.query_temperature) {  // SPEC 10.3: on the NoPE layers, at each token's index
    const std::string tp = "/attention/query_temperature";
    bool nope = false;
    for (int l = 0; l < s.dims.layers; ++l) {
      if (!s.rope(l).nope) continue;
      nope = true;
      if (s.policy(l).kind == PolicyKind::sink)
        not_yet(r, tp, fmt::format("a query temperature on a NoPE layer under a sink policy (layer {})", l), "SPEC 10.3");
    }
    if (!nope) r.fail(tp, "applies to the NoPE layers (a null entry of \"rope\"), and this scenario has none");
    if (s.quantized()) not_yet(r, tp, "a query temperature with quantized storage", "SPEC 9 and 10.3 together");
  }
  if (s.quantized() && !s.shared_rope())
    not_yet(r, "/kv_quant", "quantized storage (SPEC 9) with a rope per layer (SPEC 10.1)", "SPEC 9 and 10.1 together");
  if (s.quantized() && s.quant_rules().holds_raw())
    for (std::size_t l = 0; l < s.policies.size(); ++l)
      if (s.policies[l].kind != PolicyKind::full)
        not_yet(r, "/kv_quant",
                fmt::format("unquantized tokens (\"residual\", \"flush\": \"requantize_all\", \"chunk_reads\": "
                            "\"raw\" or scales along the token axis) with a {} policy{} (only \"full\" so far)",
                            to_string(s.policies[l].kind),
                            s.policies.size() > 1 && policy.is_array() ? fmt::format(" in layer {}", l) : ""));
  // A frozen scale is computed from the keys as first stored, at their token index: a policy
  // that moves stored keys (cache positions) would re-quantize them under it.
  if (any_frozen_scales(s)) {
    if (s.quant_rules().holds_raw())
      not_yet(r, "/kv_quant", "a scale frozen at the first append (\"first_append\") with unquantized tokens "
                              "(\"residual\", \"flush\": \"requantize_all\" or \"chunk_reads\": \"raw\")");
    for (std::size_t l = 0; l < s.policies.size(); ++l)
      if (s.policies[l].kind == PolicyKind::sink && s.policies[l].positions == SinkPositions::cache)
        not_yet(r, policy.is_array() ? "/policy/" + std::to_string(l) + "/positions" : std::string("/policy/positions"),
                "a scale frozen at the first append (\"first_append\") with keys at cache positions (each shift "
                "re-quantizes them)");
  }
  if (j.contains("scale")) s.scale = r.number(j["scale"], "/scale", false);
  if (j.contains("tolerance")) {
    s.tolerance = parse_tolerance(r, j["tolerance"]);
    s.tolerance_given = true;
  }
  if (j.contains("paging")) s.paging = parse_paging(r, j["paging"], s);
  if (j.contains("content"))
    s.content = r.choice(j["content"], "/content", {"uid", "prefix"}) == "prefix" ? Content::prefix : Content::uid;
  s.steps = parse_steps(r, r.field(j, "", "steps"), s.dims.batch, s);
  // A recompute rebuilds a row from its tokens: under a prefix cache it may take its prefix
  // from blocks other than the ones it read before, written with another frozen scale.
  if (any_frozen_scales(s) && s.paging && s.paging->prefix_cache)
    for (const Step& step : s.steps)
      if (step.op == StepOp::preempt && step.recompute)
        not_yet(r, fmt::format("/steps/{}/mode", step.source_index),
                "a recompute preemption under scales frozen at the first append (\"first_append\") with a prefix "
                "cache");
  if (s.paging) require_pool_fits(r, s);
  // The reference keeps every input and output: refuse what would not fit in memory,
  // before any of it is spent. A single layer's inputs are checked first, as counting
  // anything else of a larger scenario could take long.
  if (input_values(s, 1) > 1e9)
    r.fail("/steps", fmt::format("the scenario needs {:.3g} input values; kvcheck accepts up to 1e9",
                                 input_values(s, s.dims.layers)));
  if (j.contains("seed") && j.contains("inputs")) r.fail("/inputs", "give either \"seed\" or \"inputs\", not both");
  if (j.contains("inputs")) {
    parse_inputs(r, j["inputs"], s);
  } else {
    if (j.contains("seed")) {
      if (!j["seed"].is_number_unsigned())
        r.fail("/seed", "expected an integer from 0 to 2^64 - 1, got " + describe(j["seed"]));
      s.inputs.seed = j["seed"].get<std::uint64_t>();
    }
  }
  if (s.content == Content::prefix && s.inputs.kind != InputSource::Kind::seed)
    r.fail("/content", "content \"prefix\" generates every vector from context keys: give \"seed\", not \"inputs\"");
  require_runnable_size(r, s);
  assign_content_keys(s);
  return s;
}


Scenario load_scenario(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw InputError(path, "", "is a folder; expected a scenario file");
  return parse_scenario(read_file_checked(path, kMaxJsonBytes, "scenario"), path);
}

std::vector<std::string> scenario_files(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return {path};
  if (!fs::is_directory(path, ec)) throw InputError(path, "", "no such scenario file or folder");
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    if (entry.is_regular_file(ec) && entry.path().extension() == ".json") files.push_back(entry.path().string());
  }
  if (ec) throw InputError(path, "", "cannot read the folder: " + ec.message());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw InputError(path, "", "the folder holds no *.json scenario");
  return files;
}

}  // namespace kvcheck
