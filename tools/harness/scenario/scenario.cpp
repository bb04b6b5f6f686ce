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
#include "tools/harness/io/json_input.h"
#include "tools/harness/io/safe_file.h"

namespace kvcheck {

using json = nlohmann::json;

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
  }
  return "?";
}

double Scenario::softmax_scale() const { return scale ? *scale : 1.0 / std::sqrt(dims.head_dim); }

bool Scenario::hybrid() const {
  return std::any_of(layer_policies.begin(), layer_policies.end(), [&](const Policy& p) { return !(p == policy); });
}

bool Scenario::mixed_quant() const {
  return std::any_of(layer_quants.begin(), layer_quants.end(), [&](const KvQuant& q) { return !(q == *kv_quant); });
}

namespace {

constexpr int kMaxBatch = 4096;
constexpr std::int64_t kMaxStepRows = std::int64_t{1} << 24;
constexpr std::size_t kMaxNameLength = 128;  // a file name is at most 255 bytes: room for suffixes

// The names a step may give in `expect_error`.
const std::vector<std::string> kKnownErrors = {"crop_evicted"};

std::string describe(const json& j) {
  std::string s = j.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// Reads one JSON document, keeping the file name for every message.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& reason) const {
    throw InputError(file_, path, reason);
  }

  void object(const json& j, const std::string& path, std::initializer_list<const char*> allowed) const {
    if (!j.is_object()) fail(path, "expected an object, got " + describe(j));
    for (const auto& item : j.items()) {
      const std::string& key = item.key();
      if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return key == a; })) {
        std::vector<std::string> names(allowed.begin(), allowed.end());
        fail(path + "/" + key, fmt::format("unknown key \"{}\" (expected one of: {})", key, join(names)));
      }
    }
  }

  const json& field(const json& obj, const std::string& path, const char* key) const {
    if (!obj.contains(key)) fail(path + "/" + key, "missing required field");
    return obj.at(key);
  }

  // Sizes are capped well below what would overflow an int or exhaust memory, so a
  // typo such as 10000000000 is an error, not a crash.
  std::int64_t integer(const json& j, const std::string& path, std::int64_t min,
                       std::int64_t max = std::int64_t{1} << 24) const {
    if (!j.is_number_integer()) fail(path, "expected an integer, got " + describe(j));
    if (j.is_number_unsigned() && j.get<std::uint64_t>() > static_cast<std::uint64_t>(max))
      fail(path, fmt::format("expected an integer <= {}, got {}", max, describe(j)));
    const std::int64_t v = j.get<std::int64_t>();
    if (v < min) fail(path, fmt::format("expected an integer >= {}, got {}", min, v));
    if (v > max) fail(path, fmt::format("expected an integer <= {}, got {}", max, v));
    return v;
  }

  double number(const json& j, const std::string& path, bool allow_zero) const {
    if (!j.is_number()) fail(path, "expected a number, got " + describe(j));
    const double v = j.get<double>();
    if (!std::isfinite(v) || v < 0 || (!allow_zero && v == 0))
      fail(path, fmt::format("expected a {} number, got {}", allow_zero ? "non-negative" : "positive", describe(j)));
    return v;
  }

  std::string string(const json& j, const std::string& path) const {
    if (!j.is_string()) fail(path, "expected a string, got " + describe(j));
    return j.get<std::string>();
  }

  std::string choice(const json& j, const std::string& path, const std::vector<std::string>& options) const {
    const std::string v = string(j, path);
    if (std::find(options.begin(), options.end(), v) == options.end())
      fail(path, fmt::format("expected one of {}, got \"{}\"", join(options), v));
    return v;
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

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
    r.fail("/rope/theta", fmt::format("yarn needs theta > 1 (it divides by ln theta), got {}", rope.theta));
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

Rope parse_rope(const Reader& r, const json& j, int head_dim) {
  const std::string p = "/rope";
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
  r.object(j, p, {"sink_logits"});
  Attention a;
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

// SPEC 9's `kv_quant`. What SPEC 9 defines but kvcheck's caches do not implement yet is
// refused by name, so a scenario never passes on a convention it did not get.
[[noreturn]] void not_yet(const Reader& r, const std::string& path, const std::string& what) {
  r.fail(path, what + " is in SPEC 9, but kvcheck's caches do not implement it yet");
}

TensorQuant parse_tensor_quant(const Reader& r, const json& j, const std::string& p, const Dims& dims) {
  r.object(j, p, {"format", "scale", "transform_block"});
  static const std::vector<std::string> formats = {"fp8_e4m3", "fp8_e5m2", "int8", "q8_0", "q4_0", "int4", "int2"};
  const std::string name = r.choice(r.field(j, p, "format"), p + "/format", formats);
  TensorQuant q;
  q.format = static_cast<QuantFormat>(std::find(formats.begin(), formats.end(), name) - formats.begin());
  const bool ggml = q.format == QuantFormat::q8_0 || q.format == QuantFormat::q4_0;
  const bool affine = q.format == QuantFormat::int4 || q.format == QuantFormat::int2;
  const bool fp8 = q.format == QuantFormat::fp8_e4m3 || q.format == QuantFormat::fp8_e5m2;
  // kvcheck's extension: a block-diagonal Hadamard transform (checked against "transform"
  // by parse_kv_quant).
  if (j.contains("transform_block")) {
    const std::string bp = p + "/transform_block";
    q.transform_block = static_cast<int>(r.integer(j["transform_block"], bp, 2, dims.head_dim));
    if ((q.transform_block & (q.transform_block - 1)) != 0 || dims.head_dim % q.transform_block != 0)
      r.fail(bp, fmt::format("expected a power of two that divides head_dim ({}), got {}", dims.head_dim,
                             q.transform_block));
  }
  if (ggml) {
    if (dims.head_dim % 32 != 0)
      r.fail(p + "/format", fmt::format("{} quantizes blocks of 32 along head_dim; head_dim {} is not a multiple of 32",
                                        name, dims.head_dim));
    if (j.contains("scale"))
      r.fail(p + "/scale", name + " fixes its scale (float16, one per block of 32 along head_dim); leave \"scale\" out");
    q.scale = {ScaleGranularity::group, 32, ScaleDtype::float16, ScaleRule::amax, {}};
    return q;
  }
  // Defaults: fp8 a static per-tensor 1.0 (vLLM's default); int8 and affine a scale per token.
  q.scale = fp8 ? QuantScale{ScaleGranularity::tensor, 0, ScaleDtype::float32, ScaleRule::fixed, {1.0}}
                : QuantScale{ScaleGranularity::token, 0, ScaleDtype::float32, ScaleRule::amax, {}};
  if (!j.contains("scale")) return q;
  const std::string sp = p + "/scale";
  const json& sj = j["scale"];
  r.object(sj, sp, {"granularity", "group", "axis", "dtype", "value"});
  if (sj.contains("granularity")) {
    const std::string g =
        r.choice(sj["granularity"], sp + "/granularity", {"tensor", "head", "token", "channel", "group"});
    q.scale.granularity = g == "tensor"    ? ScaleGranularity::tensor
                          : g == "head"    ? ScaleGranularity::head
                          : g == "token"   ? ScaleGranularity::token
                          : g == "channel" ? ScaleGranularity::channel
                                           : ScaleGranularity::group;
  }
  const bool grouped = q.scale.granularity == ScaleGranularity::group;
  const bool token_axis = grouped && sj.contains("axis") &&
                          r.choice(sj["axis"], sp + "/axis", {"dim", "token"}) == "token";
  if (sj.contains("axis") && !grouped) r.fail(sp + "/axis", "only a \"group\" granularity takes an axis");
  if (token_axis) {
    // A group along the token axis: one scale per channel per run of `group` tokens
    // quantized together (KIVI's keys; Hugging Face's QuantizedCache with a per-channel axis).
    q.scale.granularity = ScaleGranularity::channel;
    q.scale.group = static_cast<int>(r.integer(r.field(sj, sp, "group"), sp + "/group", 1, 1 << 20));
  } else if (grouped) {
    q.scale.group = static_cast<int>(r.integer(r.field(sj, sp, "group"), sp + "/group", 1, dims.head_dim));
    if (dims.head_dim % q.scale.group != 0)
      r.fail(sp + "/group", fmt::format("expected a divisor of head_dim ({}), got {}", dims.head_dim, q.scale.group));
  } else if (sj.contains("group")) {
    r.fail(sp + "/group", "only a \"group\" granularity takes a group size (with \"axis\": \"token\", in tokens)");
  }
  if (sj.contains("dtype"))
    q.scale.dtype = r.choice(sj["dtype"], sp + "/dtype", {"float32", "float16"}) == "float16" ? ScaleDtype::float16
                                                                                            : ScaleDtype::float32;
  const bool per_token = q.scale.granularity == ScaleGranularity::token || grouped ||
                         q.scale.granularity == ScaleGranularity::channel;
  if (per_token) q.scale.rule = ScaleRule::amax, q.scale.values.clear();
  if (!per_token && !sj.contains("value") && !fp8)
    r.fail(sp + "/value", "a tensor or head scale is static here: give its value (a number, or one per kv head)");
  if (sj.contains("value")) {
    const json& v = sj["value"];
    const std::string vp = sp + "/value";
    if (v.is_string()) {
      const std::string rule = r.choice(v, vp, {"amax", "first_append"});
      if (rule == "first_append") {
        if (per_token)
          r.fail(vp, "a scale frozen at a row's first append covers a tensor or a kv head: expected \"granularity\": "
                     "\"tensor\" or \"head\"");
        if (affine) r.fail(vp, "an affine format computes its scale and zero point from each group: expected \"amax\"");
        q.scale.rule = ScaleRule::first_append;
        q.scale.values.clear();
      } else if (!per_token) {
        not_yet(r, vp, "a tensor or head scale computed from the values (\"amax\" needs \"token\" or \"group\")");
      }
    } else {
      if (per_token)
        r.fail(vp, "a token, group or channel scale comes from the values it covers: expected \"amax\"");
      if (affine) r.fail(vp, "an affine format computes its scale and zero point from each group: expected \"amax\"");
      q.scale.rule = ScaleRule::fixed;
      q.scale.values.clear();
      // A scale must stay finite and non-zero once stored in its dtype.
      const bool half = q.scale.dtype == ScaleDtype::float16;
      auto positive = [&](const json& x, const std::string& path) {
        const double s = r.number(x, path, false);
        if (s > 1e30) r.fail(path, fmt::format("expected a scale up to 1e30, got {}", s));
        // Judged as stored (the caches round through float32, then to float16): 2^-25 is
        // a tie that rounds to 0, and so does anything a hair above it.
        const double stored =
            half ? reference::round_to_float16(static_cast<float>(s)) : static_cast<double>(static_cast<float>(s));
        if (half && (s > 65504.0 || !(stored >= 0x1p-24)))
          r.fail(path, fmt::format("a float16 scale must be between 2^-24 and 65504 once stored in float16, got {} "
                                   "(stored as {})",
                                   s, stored));
        if (!half && !(stored >= 0x1p-149))
          r.fail(path, fmt::format("a float32 scale must be at least 2^-149 once stored in float32, got {}", s));
        return s;
      };
      if (v.is_array()) {
        if (q.scale.granularity != ScaleGranularity::head)
          r.fail(vp, "a list gives one scale per kv head: expected \"granularity\": \"head\"");
        if (v.size() != static_cast<std::size_t>(dims.kv_heads))
          r.fail(vp, fmt::format("expected one scale per kv head ({}), got {}", dims.kv_heads, v.size()));
        for (std::size_t i = 0; i < v.size(); ++i) q.scale.values.push_back(positive(v[i], vp + "/" + std::to_string(i)));
      } else {
        q.scale.values.push_back(positive(v, vp));
      }
    }
  }
  return q;
}

KvQuant parse_kv_quant(const Reader& r, const json& j, const Dims& dims, const std::string& p = "/kv_quant") {
  r.object(j, p, {"k", "v", "residual", "flush", "prefill", "chunk_reads", "transform", "shift", "query"});
  if (!j.contains("k") && !j.contains("v")) r.fail(p, "expected \"k\", \"v\" or both: what is quantized");
  KvQuant q;
  if (j.contains("k")) q.k = parse_tensor_quant(r, j["k"], p + "/k", dims);
  if (j.contains("v")) q.v = parse_tensor_quant(r, j["v"], p + "/v", dims);
  // An engine keeps at most a few thousand tokens unquantized; more is a typo.
  if (j.contains("residual")) q.residual = r.integer(j["residual"], p + "/residual", 0, 1 << 20);
  if (j.contains("flush")) {
    const std::string flush = r.choice(j["flush"], p + "/flush", {"append", "requantize_all", "block"});
    q.flush = flush == "append" ? Flush::append : flush == "block" ? Flush::block : Flush::requantize_all;
    if (q.flush == Flush::block && q.residual < 1)
      r.fail(p + "/flush", "\"block\" quantizes the residual's tokens R at a time: expected a \"residual\" of 1 or more");
  }
  if (j.contains("prefill"))
    q.prefill = r.choice(j["prefill"], p + "/prefill", {"store", "residual"}) == "store" ? PrefillRule::store
                                                                                        : PrefillRule::residual;
  if (j.contains("chunk_reads"))
    q.chunk_reads = r.choice(j["chunk_reads"], p + "/chunk_reads", {"stored", "raw"}) == "stored" ? ChunkReads::stored
                                                                                                  : ChunkReads::raw;
  if (j.contains("transform") && r.choice(j["transform"], p + "/transform", {"none", "hadamard"}) == "hadamard")
    q.transform = QuantTransform::hadamard;
  // Each quantized tensor's blocks (checked for width above): one block of head_dim needs a
  // power of two; a block needs the transform.
  for (const auto& [name, t] : {std::pair{"k", &q.k}, std::pair{"v", &q.v}}) {
    if (!*t) continue;
    const bool hadamard = q.transform == QuantTransform::hadamard, whole = (*t)->transform_block == 0;
    if (hadamard && whole && (dims.head_dim & (dims.head_dim - 1)) != 0)
      r.fail(p + "/transform", fmt::format("a Hadamard transform needs a power-of-two head_dim, got {} (or a "
                                           "power-of-two \"transform_block\" in \"{}\")",
                                           dims.head_dim, name));
    if (!hadamard && !whole)
      r.fail(p + "/" + name + "/transform_block", "a transform block needs \"transform\": \"hadamard\"");
  }
  // A run along the token axis is the tokens quantized together: "append" would quantize each
  // token alone as it leaves the residual (a run of one, nearly lossless: not what anyone ships).
  if (q.along_tokens() && q.flush == Flush::append)
    r.fail(j.contains("flush") ? p + "/flush" : p,
           "scales along the token axis need tokens quantized together: expected \"flush\": \"block\" (KIVI: the "
           "residual's tokens, R at a time) or \"requantize_all\" (Hugging Face's QuantizedCache)");
  if (q.along_tokens() && q.transform == QuantTransform::hadamard)
    not_yet(r, p + "/transform", "a Hadamard transform with scales along the token axis (\"channel\", or a "
                                 "\"group\" with \"axis\": \"token\")");
  if (j.contains("shift")) r.choice(j["shift"], p + "/shift", {"requantize"});
  // kvcheck's extension: the attention quantizes the query too (ggml's CPU matmul does, to
  // the q8_0 K's dot-product type).
  if (j.contains("query") && r.choice(j["query"], p + "/query", {"none", "q8_0"}) == "q8_0") {
    if (dims.head_dim % 32 != 0)
      r.fail(p + "/query", fmt::format("q8_0 quantizes blocks of 32 along head_dim; head_dim {} is not a multiple "
                                       "of 32", dims.head_dim));
    q.query = QuantFormat::q8_0;
  }
  return q;
}

// A per-layer `kv_quant` list: each layer's "k" and "v" its own (formats, scales, static
// values; null: the layer stored in kv_dtype); what the caches share across layers (the
// residual and when it flushes, what a chunk reads, the transform, the query) must be the
// first quantized layer's, which a null layer takes.
std::vector<KvQuant> parse_layer_quants(const Reader& r, const json& j, const Dims& dims) {
  if (j.size() != static_cast<std::size_t>(dims.layers))
    r.fail("/kv_quant", fmt::format("expected one kv_quant per layer ({}), got {}", dims.layers, j.size()));
  std::vector<KvQuant> layers(j.size());
  std::optional<std::size_t> first_at;
  for (std::size_t l = 0; l < j.size(); ++l) {
    if (j[l].is_null()) continue;
    const std::string p = "/kv_quant/" + std::to_string(l);
    layers[l] = parse_kv_quant(r, j[l], dims, p);
    if (!first_at) first_at = l;
    const KvQuant &first = layers[*first_at], &q = layers[l];
    const auto same = [&](const char* field, bool equal, const std::string& first_value) {
      if (!equal)
        r.fail(j[l].contains(field) ? p + "/" + field : p,
               fmt::format("expected layer {}'s \"{}\" ({}): kvcheck's caches keep one {} rule for every layer; "
                           "per layer, only \"k\" and \"v\" may differ",
                           *first_at, field, first_value, field));
    };
    same("residual", q.residual == first.residual, std::to_string(first.residual));
    same("flush", q.flush == first.flush, to_string(first.flush));
    same("prefill", q.prefill == first.prefill, to_string(first.prefill));
    same("chunk_reads", q.chunk_reads == first.chunk_reads, to_string(first.chunk_reads));
    same("transform", q.transform == first.transform, to_string(first.transform));
    same("query", q.query == first.query, first.query ? "q8_0" : "none");
    // A quantized query follows K's format (ggml converts it to K's dot-product type).
    if (q.query && (q.k.has_value() != first.k.has_value() || (q.k && q.k->format != first.k->format)))
      not_yet(r, p + "/k", "a quantized query (\"query\") with layers whose keys are stored in different formats");
  }
  if (!first_at)
    r.fail("/kv_quant", "expected at least one layer quantized (null keeps a layer in kv_dtype); leave kv_quant out "
                        "to quantize none");
  for (std::size_t l = 0; l < j.size(); ++l)
    if (j[l].is_null()) {  // the shared rules, nothing quantized
      layers[l] = layers[*first_at];
      layers[l].k.reset();
      layers[l].v.reset();
      if (layers[l].query)
        not_yet(r, "/kv_quant/" + std::to_string(l),
                "a quantized query (\"query\") with layers whose keys are stored in different formats");
    }
  return layers;
}

// `paging` (SPEC 8). Parsed after the policy and kv_quant, which it must fit.
Paging parse_paging(const Reader& r, const json& j, const Scenario& s) {
  const std::string p = "/paging";
  r.object(j, p, {"block_size", "num_blocks", "prefix_cache", "reuse"});
  Paging paging;
  paging.block_size = r.integer(r.field(j, p, "block_size"), p + "/block_size", 1, 65536);
  paging.num_blocks = r.integer(r.field(j, p, "num_blocks"), p + "/num_blocks", 1, std::int64_t{1} << 20);
  if (j.contains("prefix_cache")) {
    if (!j["prefix_cache"].is_boolean()) r.fail(p + "/prefix_cache", "expected true or false, got " + describe(j["prefix_cache"]));
    paging.prefix_cache = j["prefix_cache"].get<bool>();
  }
  if (j.contains("reuse")) paging.token_reuse = r.choice(j["reuse"], p + "/reuse", {"full", "token"}) == "token";
  // Quantized blocks (vLLM's fp8 pools) are served; a residual of raw tokens beside them is not yet.
  if (s.kv_quant && s.kv_quant->holds_raw())
    r.fail(p, "a paged cache with a residual (kv_quant \"residual\", \"requantize_all\", raw chunk reads or "
              "scales along the token axis) is in SPEC 8 and 9, but kvcheck's paged cache quantizes each token alone "
              "as it is written");
  return paging;
}

std::string bytes_text(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.1f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  return fmt::format("{:.0f} kB", bytes / 1e3);
}

// The pool must hold every row's blocks at every step, counted without sharing (so any
// correct cache fits): SPEC 8.6 makes room by preemption, which kvcheck does not run yet.
void require_pool_fits(const Reader& r, const Scenario& s) {
  // The paged cache allocates its whole pool up front: keys and values of every block in
  // every layer (float32 at most), and each slot's bookkeeping, about 192 bytes (measured:
  // 4.9 GB peak for 2 layers of 2^20 blocks of 8 with 2 kv heads of 8, 128 bytes of KV a slot).
  const double slots = static_cast<double>(s.paging->num_blocks) * static_cast<double>(s.paging->block_size);
  const double pool = static_cast<double>(s.dims.layers) * slots *
                      (2.0 * s.dims.kv_heads * s.dims.head_dim * 4 + 192);
  if (pool > kMemoryBudget)
    r.fail("/paging/num_blocks",
           fmt::format("the paged cache's pool would take about {} ({} layers x {} blocks x {} tokens x {} kv heads x "
                       "head_dim {}, keys and values); kvcheck accepts up to {}",
                       bytes_text(pool), s.dims.layers, s.paging->num_blocks, s.paging->block_size, s.dims.kv_heads,
                       s.dims.head_dim, bytes_text(kMemoryBudget)));
  const PoolNeed need = largest_pool_need(s, s.paging->block_size);
  if (need.blocks > s.paging->num_blocks)
    r.fail("/paging/num_blocks", fmt::format("the pool holds {} blocks, but /steps/{} needs up to {} (every row's "
                                             "blocks, counted without sharing); a pool too small needs preemption "
                                             "(SPEC 8.6), which kvcheck does not run yet",
                                             s.paging->num_blocks, need.source_index, need.blocks));
}

Policy parse_policy(const Reader& r, const json& j, const std::string& p = "/policy") {
  if (!j.is_object()) r.fail(p, "expected an object, got " + describe(j));
  Policy policy;
  const std::string type = r.choice(r.field(j, p, "type"), p + "/type", {"full", "sliding", "sink"});
  if (type == "full") {
    r.object(j, p, {"type"});
    policy.kind = PolicyKind::full;
  } else if (type == "sliding") {
    r.object(j, p, {"type", "window"});
    policy.kind = PolicyKind::sliding;
    policy.window = r.integer(r.field(j, p, "window"), p + "/window", 1);
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

// Parses the steps while tracking the batch size, so per-row counts and reorder indices
// are checked against the rows that exist at that point.
std::vector<Step> parse_steps(const Reader& r, const json& j, int batch, const Scenario& scenario) {
  if (!j.is_array() || j.empty()) r.fail("/steps", "expected a non-empty array of steps");
  std::vector<Step> steps;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(batch), 0);  // to tell which rows start
  std::vector<int> preempted(static_cast<std::size_t>(batch), -1);        // the preempt step's index, or -1
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
                                    {"append", "decode", "reorder", "reset", "crop", "free", "evict", "preempt", "resume"});
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
      count(p, 1);
      steps.push_back(step);
    } else if (op == "reset") {
      r.object(s, p, {"op", "batch"});
      step.op = StepOp::reset;
      if (s.contains("batch")) batch = static_cast<int>(r.integer(s["batch"], p + "/batch", 1, kMaxBatch));
      step.batch = batch;
      preempted.assign(static_cast<std::size_t>(batch), -1);
      count(p, 1);
      steps.push_back(step);
    } else if (op == "free") {
      r.object(s, p, {"op", "rows"});
      step.op = StepOp::free_rows;
      step.rows = row_list(r, r.field(s, p, "rows"), p + "/rows", batch);
      std::set<int> distinct(step.rows.begin(), step.rows.end());
      if (distinct.size() != step.rows.size()) r.fail(p + "/rows", "expected each row at most once");
      for (int b : step.rows) preempted[static_cast<std::size_t>(b)] = -1;  // a preempted row may end
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
    } else {
      r.object(s, p, {"op", "length", "expect_error"});
      require_running(p, "a crop cuts no preempted row");
      step.op = StepOp::crop;
      step.length = r.integer(r.field(s, p, "length"), p + "/length", 0);
      step.expect_error = expect_error(r, s, p);
      count(p, 1);
      steps.push_back(step);
    }
    for (std::size_t k = first_new; k < steps.size(); ++k)
      if (steps[k].expect_error.empty()) advance_lengths(steps[k], lengths);
  }
  return steps;
}

}  // namespace

namespace {


std::string duration_text(double seconds) {
  if (seconds >= 7200) return fmt::format("{:.0f} hours", seconds / 3600);
  if (seconds >= 120) return fmt::format("{:.0f} minutes", seconds / 60);
  return fmt::format("{:.0f} seconds", seconds);
}

}  // namespace

void advance_lengths(const Step& step, std::vector<std::int64_t>& lengths) {
  switch (step.op) {
    case StepOp::append:
      for (std::size_t b = 0; b < lengths.size(); ++b) lengths[b] += step.tokens[b];
      break;
    case StepOp::reorder: {
      std::vector<std::int64_t> next;
      for (int r : step.rows) next.push_back(lengths[static_cast<std::size_t>(r)]);
      lengths = std::move(next);
      break;
    }
    case StepOp::reset:
      lengths.assign(static_cast<std::size_t>(*step.batch), 0);
      break;
    case StepOp::crop:
      for (std::int64_t& n : lengths) n = std::min(n, step.length);
      break;
    case StepOp::free_rows:
      for (int r : step.rows) lengths[static_cast<std::size_t>(r)] = 0;
      break;
    case StepOp::evict:
    case StepOp::preempt:  // the row keeps its tokens (SPEC 8.6): they come back on resume
    case StepOp::resume:
      break;
  }
}

namespace {

// Blocks one layer of a row needs, without sharing, while it appends tokens [first, n):
// every block from the first one holding a token that token `first` still sees.
// A row of `first` tokens that appends up to n holds, without sharing, every block from
// the first one holding a token of its retained set (the window of its last token, a
// sliding or sink layer's blocks being freed no earlier) to the last new token's, and a sink
// layer's blocks of sinks.
std::int64_t blocks_needed(const Policy& policy, std::int64_t block_size, std::int64_t first, std::int64_t n) {
  if (n == 0) return 0;
  const std::int64_t last = (n + block_size - 1) / block_size;  // blocks 0 .. last - 1 cover the row
  if (policy.kind == PolicyKind::full) return last;
  if (policy.kind == PolicyKind::sliding) return last - std::max<std::int64_t>(0, first - policy.window) / block_size;
  const std::int64_t sink_blocks = (policy.sinks + block_size - 1) / block_size;
  const std::int64_t from = first == 0 ? 0 : (policy.sinks + reference::evicted_count(policy, first - 1)) / block_size;
  return last - from + std::min(sink_blocks, from);
}

}  // namespace

PoolNeed largest_pool_need(const Scenario& s, std::int64_t block_size) {
  PoolNeed most;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(s.dims.batch), 0);
  std::vector<bool> recompute(lengths.size(), false);  // preempted for a recompute
  for (const Step& step : s.steps) {
    // Idle rows hold their blocks; a recompute's resume rebuilds its row from token 0.
    const bool counts = (step.op == StepOp::append || step.op == StepOp::resume) && step.expect_error.empty();
    if (counts)
      for (const Policy& policy : s.layer_policies) {
        std::int64_t need = 0;
        for (std::size_t b = 0; b < lengths.size(); ++b) {
          const bool rebuilt = step.op == StepOp::resume && recompute[b] &&
                               std::find(step.rows.begin(), step.rows.end(), static_cast<int>(b)) != step.rows.end();
          need += rebuilt ? blocks_needed(policy, block_size, 0, lengths[b])
                          : blocks_needed(policy, block_size, lengths[b],
                                          lengths[b] + (step.op == StepOp::append ? step.tokens[b] : 0));
        }
        if (need > most.blocks) most = {need, step.source_index};
      }
    if (step.op == StepOp::preempt)
      for (int b : step.rows) recompute[static_cast<std::size_t>(b)] = step.recompute;
    if (step.op == StepOp::reset || step.op == StepOp::reorder) {
      if (step.expect_error.empty()) advance_lengths(step, lengths);
      recompute.assign(lengths.size(), false);
      continue;
    }
    if (step.expect_error.empty()) advance_lengths(step, lengths);
  }
  return most;
}

namespace {

// Keys a token at index t sees under the policy (the query's own included).
double visible_keys(const Policy& p, std::int64_t t) {
  return p.kind == PolicyKind::full ? static_cast<double>(t + 1)
                                    : static_cast<double>(std::min<std::int64_t>(t + 1, p.window));
}

// The sum of visible_keys over t in [first, last], in closed form.
double visible_keys_sum(const Policy& p, std::int64_t first, std::int64_t last) {
  auto prefix = [&](std::int64_t n) {  // sum over t in [0, n)
    const std::int64_t cap = p.kind == PolicyKind::full ? n : std::min(n, p.window);
    const double grow = static_cast<double>(cap) * static_cast<double>(cap + 1) / 2;
    return grow + (p.kind == PolicyKind::full ? 0.0 : static_cast<double>(n - cap) * static_cast<double>(p.window));
  };
  return last < first ? 0.0 : prefix(last + 1) - prefix(first);
}

}  // namespace

namespace {
// What the reference keeps of one quantized token (SPEC 9's R_stored: every layer and kv
// head, keys and values) as reference::StoredLayer holds it: what each stands for (doubles),
// its codes (ints), scales (doubles) and zero points (ints) per group; under scales along the
// token axis a group is one element, and what it was quantized from is kept too.
double stored_bytes_per_token(const Scenario& s) {
  if (!s.kv_quant) return 0.0;
  const double D = s.dims.head_dim;
  double total = 0.0;
  for (int l = 0; l < s.dims.layers; ++l) {
    const KvQuant& q = s.quant(l);
    double per_head = 0.0;
    for (const auto& t : {q.k, q.v}) {
      const double groups = t ? D / std::max(1, reference::scale_group(*t, s.dims.head_dim)) : 0.0;
      per_head += D * 8 + (t ? D * 4 + groups * 12 + D / 4 : 0.0);
    }
    if (q.along_tokens()) per_head *= 2;
    total += static_cast<double>(s.dims.kv_heads) * (per_head + 64);
  }
  return total;
}
}  // namespace

ScenarioCost estimate_cost(const Scenario& s) {
  const Dims& d = s.dims;
  const double stored_per_token = stored_bytes_per_token(s);
  // A hybrid costs at most what its widest layer would cost in every layer.
  Policy widest = s.policy;
  for (const Policy& p : s.layer_policies)
    if (visible_keys(p, std::int64_t{1} << 40) > visible_keys(widest, std::int64_t{1} << 40)) widest = p;
  const double per_token_out = static_cast<double>(d.layers) * d.heads * d.head_dim;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(d.batch), 0);
  double outputs = 0, views = 0, retained = 0, stored = 0, work = 0, largest_step = 0;
  for (const Step& step : s.steps) {
    double step_bytes = 0;
    if (step.op == StepOp::append) {
      const std::int64_t n = *std::max_element(step.tokens.begin(), step.tokens.end());
      const double out = static_cast<double>(lengths.size()) * static_cast<double>(n) * per_token_out * 8;
      double seen_all = 0;
      for (std::size_t b = 0; b < lengths.size(); ++b) {
        const double seen = visible_keys_sum(widest, lengths[b], lengths[b] + step.tokens[b] - 1);
        seen_all += seen;
        work += seen * per_token_out * 2;  // a dot product and a value accumulation per key
      }
      outputs += out;
      // One (index, position) pair per visible key; a hybrid keeps a view per layer too.
      views += seen_all * 16 * (s.hybrid() ? d.layers + 1.0 : 1.0);
      // Checking the step holds its outputs and views, and each cache's log of the
      // visible pairs (about 90 bytes a pair, sorted copy included) and float outputs.
      step_bytes = out + seen_all * 16 + seen_all * 90 + out / 2;
    }
    advance_lengths(step, lengths);
    // Per row and step: the retained and live sets (24 bytes a key), and a history view.
    double sets = 0;
    for (std::int64_t n : lengths)
      sets += (48.0 * (n == 0 ? 0.0 : visible_keys(widest, n - 1)) + 24) * (s.hybrid() ? d.layers + 1.0 : 1.0);
    retained += sets;
    // A quantized step's record holds what the reference stores for every retained token.
    double stored_now = 0;
    for (std::int64_t n : lengths) stored_now += stored_per_token * (n == 0 ? 0.0 : visible_keys(widest, n - 1));
    stored += stored_now;
    largest_step = std::max(largest_step, step_bytes + sets + stored_now);
  }
  ScenarioCost c;
  const double inputs = static_cast<double>(count_uids(s)) * d.layers * (d.heads + 2.0 * d.kv_heads) * d.head_dim * 4;
  const double histories = static_cast<double>(count_uids(s)) * 8 * 2;
  // `run` checks step by step: the inputs (twice: the reference's own checks feed the
  // tokens one by one from a copy) and the largest step. Export, goldens, diagnose and
  // verify keep every step.
  c.bytes = 2 * inputs + histories + largest_step;
  c.whole_run_bytes = outputs + views + retained + stored + inputs + histories;
  c.multiply_adds = work;
  c.breakdown = fmt::format("inputs {}, the largest step {}", bytes_text(2 * inputs), bytes_text(largest_step));
  c.whole_run_breakdown = fmt::format("outputs {}, attention views {}, retained sets {}, inputs {}",
                                      bytes_text(outputs), bytes_text(views), bytes_text(retained), bytes_text(inputs));
  if (stored > 0) c.whole_run_breakdown += fmt::format(", stored quantized KV {}", bytes_text(stored));
  return c;
}

void require_whole_run_fits(const Scenario& s) {
  const ScenarioCost cost = estimate_cost(s);
  if (cost.whole_run_bytes > kMemoryBudget)
    throw InputError(s.file, "/steps",
                     fmt::format("this command keeps every step, about {} ({}); kvcheck accepts up to {} (`run` "
                                 "checks step by step and needs about {})",
                                 bytes_text(cost.whole_run_bytes), cost.whole_run_breakdown, bytes_text(kMemoryBudget),
                                 bytes_text(cost.bytes)));
}

std::int64_t longest_row(const Scenario& s) {
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(s.dims.batch), 0);
  std::int64_t longest = 1;
  for (const Step& step : s.steps) {
    advance_lengths(step, lengths);
    for (std::int64_t n : lengths) longest = std::max(longest, n);
  }
  return longest;
}

std::int64_t count_uids(const Scenario& scenario) {
  std::int64_t total = 0;
  for (const Step& step : scenario.steps)
    if (step.op == StepOp::append)
      for (std::int64_t n : step.tokens) total += n;
  return total;
}

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
  if (j.contains("rope")) s.rope = parse_rope(r, j["rope"], s.dims.head_dim);
  if (j.contains("attention")) s.attention = parse_attention(r, j["attention"], s.dims);
  if (j.contains("kv_dtype")) {
    const std::string dtype = r.choice(j["kv_dtype"], "/kv_dtype", {"float32", "float16", "bfloat16"});
    s.kv_dtype = dtype == "float32" ? KvDtype::float32 : dtype == "float16" ? KvDtype::float16 : KvDtype::bfloat16;
  }
  if (j.contains("kv_quant")) {
    if (j["kv_quant"].is_array()) {
      s.layer_quants = parse_layer_quants(r, j["kv_quant"], s.dims);
      s.kv_quant = s.layer_quants.front();
    } else {
      s.kv_quant = parse_kv_quant(r, j["kv_quant"], s.dims);
    }
  }
  const json& policy = r.field(j, "", "policy");
  if (policy.is_array()) {  // one per layer (SPEC 7)
    if (policy.size() != static_cast<std::size_t>(s.dims.layers))
      r.fail("/policy", fmt::format("expected one policy per layer ({}), got {}", s.dims.layers, policy.size()));
    for (std::size_t l = 0; l < policy.size(); ++l)
      s.layer_policies.push_back(parse_policy(r, policy[l], "/policy/" + std::to_string(l)));
    s.policy = s.layer_policies[0];
  } else {
    s.policy = parse_policy(r, policy);
    s.layer_policies.assign(static_cast<std::size_t>(s.dims.layers), s.policy);
  }
  if (s.kv_quant && s.kv_quant->holds_raw())
    for (std::size_t l = 0; l < s.layer_policies.size(); ++l)
      if (s.layer_policies[l].kind != PolicyKind::full)
        not_yet(r, "/kv_quant",
                fmt::format("unquantized tokens (\"residual\", \"flush\": \"requantize_all\", \"chunk_reads\": "
                            "\"raw\" or scales along the token axis) with a {} policy{} (only \"full\" so far)",
                            to_string(s.layer_policies[l].kind),
                            s.layer_policies.size() > 1 && policy.is_array() ? fmt::format(" in layer {}", l) : ""));
  // A frozen scale is computed from the keys as first stored, at their token index: a policy
  // that moves stored keys (cache positions) would re-quantize them under it.
  if (any_frozen_scales(s)) {
    if (s.kv_quant->holds_raw())
      not_yet(r, "/kv_quant", "a scale frozen at the first append (\"first_append\") with unquantized tokens "
                              "(\"residual\", \"flush\": \"requantize_all\" or \"chunk_reads\": \"raw\")");
    for (std::size_t l = 0; l < s.layer_policies.size(); ++l)
      if (s.layer_policies[l].kind == PolicyKind::sink && s.layer_policies[l].positions == SinkPositions::cache)
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
  // before any of it is spent.
  const double floats =
      static_cast<double>(count_uids(s)) * s.dims.layers * (s.dims.heads + 2.0 * s.dims.kv_heads) * s.dims.head_dim;
  if (floats > 1e9)
    r.fail("/steps", fmt::format("the scenario needs {:.3g} input values; kvcheck accepts up to 1e9", floats));
  const ScenarioCost cost = estimate_cost(s);
  if (cost.bytes > kMemoryBudget)
    r.fail("/steps", fmt::format("the scenario needs about {} of memory ({}) and about {:.2g} multiply-adds in the "
                                 "reference (about {} at 1e9 a second); kvcheck accepts up to {}",
                                 bytes_text(cost.bytes), cost.breakdown, cost.multiply_adds,
                                 duration_text(cost.multiply_adds / 1e9), bytes_text(kMemoryBudget)));
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
  assign_content_keys(s);
  return s;
}

std::optional<QuantFormat> quant_format_named(const std::string& name) {
  for (QuantFormat f : {QuantFormat::fp8_e4m3, QuantFormat::fp8_e5m2, QuantFormat::int8, QuantFormat::q8_0,
                        QuantFormat::q4_0, QuantFormat::int4, QuantFormat::int2})
    if (name == to_string(f)) return f;
  return std::nullopt;
}

std::string quantize_scenario(Scenario& s, QuantFormat format) {
  // The defaults of a scenario file's {"format": ...} with no "scale".
  nlohmann::json tensor = {{"format", to_string(format)}};
  nlohmann::json j = {{"k", tensor}, {"v", tensor}};
  try {
    s.kv_quant = parse_kv_quant(Reader(s.file), j, s.dims);
    s.layer_quants.clear();
  } catch (const InputError& e) {
    return e.reason;
  }
  return "";
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
