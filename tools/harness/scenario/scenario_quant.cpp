// The scenario parser's `kv_quant` section (SPEC 9): one object, or one per layer; and
// `run --kv-quant`'s rewrite of a scenario to a format.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "reference/quantize.h"
#include "tools/harness/scenario/parse_sections.h"

namespace kvcheck {
namespace scenario_parse {
namespace {

// Formats whose groups carry a float bias (SPEC 9.7, 9.8): what each takes.
struct BiasedGroups {
  int default_bits;
  std::vector<int> bits;
  const char* bits_words;    // how the expected bits are said
  const char* group_words;   // whose group sizes 32, 64 and 128 are
  const char* cache;         // the cache that stores it (it stores the rotated keys: no transform)
  const char* head_dim_tail;  // said after "head_dim D is not a multiple of it"
  bool float16;               // computes in a float16 model's dtype (quanto: yes; MLX: not yet)
};

// SPEC 9.7 (mlx_affine: MLX's affine groups, `bits` 2, 3, 4, 5, 6 or 8, default 8, mlx-lm's
// QuantizedKVCache defaults) and 9.8 (quanto_affine: optimum-quanto's groups under
// transformers' QuantizedLayer, `bits` 2 or 4, default 4). Both take a group of 32, 64 or 128
// along head_dim (default 64), the scale and bias computed from each group in float32 (a
// model's float16 or bfloat16 ones: not yet).
TensorQuant parse_biased_groups(const Reader& r, const json& j, const std::string& p, const Dims& dims,
                                QuantFormat format) {
  static const BiasedGroups mlx{8, {2, 3, 4, 5, 6, 8}, "2, 3, 4, 5, 6 or 8 (MLX's affine bits)", "MLX's group sizes",
                                "MLX's QuantizedKVCache", "", false};
  static const BiasedGroups quanto{4, {2, 4}, "2 or 4 (quanto's qint2 and qint4)", "q_group_size",
                                   "QuantizedLayer", " (a larger group would cross heads)", true};
  const BiasedGroups& f = format == QuantFormat::mlx_affine ? mlx : quanto;
  const std::string name = to_string(format);
  TensorQuant q;
  q.format = format;
  q.bits = f.default_bits;
  if (j.contains("bits")) {
    q.bits = static_cast<int>(r.integer(j["bits"], p + "/bits", f.bits.front(), f.bits.back()));
    if (std::find(f.bits.begin(), f.bits.end(), q.bits) == f.bits.end())
      r.fail(p + "/bits", fmt::format("expected {}, got {}", f.bits_words, q.bits));
  }
  if (j.contains("transform_block"))
    r.fail(p + "/transform_block", fmt::format("{} has no transform ({} stores the rotated keys)", name, f.cache));
  q.scale = {ScaleGranularity::group, 64, ScaleDtype::float32, ScaleRule::amax, {}};
  if (j.contains("scale")) {
    const std::string sp = p + "/scale";
    const json& sj = j["scale"];
    r.object(sj, sp, {"granularity", "group", "dtype", "value"});
    if (sj.contains("granularity") && r.choice(sj["granularity"], sp + "/granularity", {"group"}) != "group")
      r.fail(sp + "/granularity", name + " scales groups along head_dim: expected \"group\"");
    if (sj.contains("group")) {
      q.scale.group = static_cast<int>(r.integer(sj["group"], sp + "/group", 32, 128));
      if (q.scale.group != 32 && q.scale.group != 64 && q.scale.group != 128)
        r.fail(sp + "/group", fmt::format("expected 32, 64 or 128 ({}), got {}", f.group_words, q.scale.group));
    }
    if (sj.contains("dtype") && r.choice(sj["dtype"], sp + "/dtype", {"float32", "float16"}) != "float32") {
      if (!f.float16) not_yet(r, sp + "/dtype", name + " scales and biases in float16 (a float16 model's)");
      q.scale.dtype = ScaleDtype::float16;  // every step in float16, as a float16 model's
    }
    if (sj.contains("value") && !(sj["value"].is_string() && sj["value"].get<std::string>() == "amax"))
      r.fail(sp + "/value", name + " computes its scale and bias from each group: expected \"amax\"");
  }
  if (dims.head_dim % q.scale.group != 0)
    r.fail(p + (j.contains("scale") ? "/scale/group" : "/format"),
           fmt::format("{} quantizes groups of {} along head_dim; head_dim {} is not a multiple of it{}", name,
                       q.scale.group, dims.head_dim, f.head_dim_tail));
  return q;
}

// SPEC 9's `kv_quant`.
TensorQuant parse_tensor_quant(const Reader& r, const json& j, const std::string& p, const Dims& dims) {
  r.object(j, p, {"format", "scale", "transform_block", "bits"});
  TensorQuant q;
  q.format = r.named(r.field(j, p, "format"), p + "/format", kQuantFormatNames);
  const std::string name = to_string(q.format);
  if (has_biases(q.format)) return parse_biased_groups(r, j, p, dims, q.format);
  if (j.contains("bits"))
    r.fail(p + "/bits", name + " has its bits in its name; only mlx_affine and quanto_affine take \"bits\"");
  const bool ggml = q.format == QuantFormat::q8_0 || q.format == QuantFormat::q4_0;
  const bool affine = q.format == QuantFormat::int4 || q.format == QuantFormat::int2;
  const bool fp8 = q.format == QuantFormat::fp8_e4m3 || q.format == QuantFormat::fp8_e5m2;
  // ONNX Runtime's int8 and int4 (SPEC 9.6): static scales only, like a checkpoint's.
  const bool static_only = q.format == QuantFormat::int8_even || q.format == QuantFormat::int4_even;
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
  q.scale = fp8 || static_only ? QuantScale{ScaleGranularity::tensor, 0, ScaleDtype::float32, ScaleRule::fixed, {1.0}}
                                : QuantScale{ScaleGranularity::token, 0, ScaleDtype::float32, ScaleRule::amax, {}};
  if (!j.contains("scale")) return q;
  const std::string sp = p + "/scale";
  const json& sj = j["scale"];
  r.object(sj, sp, {"granularity", "group", "axis", "dtype", "value"});
  if (sj.contains("granularity")) {
    q.scale.granularity = r.named(sj["granularity"], sp + "/granularity", kScaleGranularityNames);
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
    q.scale.dtype = r.named(sj["dtype"], sp + "/dtype", kScaleDtypeNames);
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
  if (static_only && q.scale.rule != ScaleRule::fixed)
    r.fail(sp, name + " takes a static scale (SPEC 9.6): expected \"granularity\": \"tensor\" or \"head\" with a "
                      "\"value\"");
  return q;
}

}  // namespace

KvQuant parse_kv_quant(const Reader& r, const json& j, const Dims& dims, const std::string& p) {
  r.object(j, p, {"k", "v", "residual", "flush", "prefill", "chunk_reads", "transform", "shift", "query"});
  if (!j.contains("k") && !j.contains("v")) r.fail(p, "expected \"k\", \"v\" or both: what is quantized");
  KvQuant q;
  if (j.contains("k")) q.k = parse_tensor_quant(r, j["k"], p + "/k", dims);
  if (j.contains("v")) q.v = parse_tensor_quant(r, j["v"], p + "/v", dims);
  // An engine keeps at most a few thousand tokens unquantized; more is a typo.
  if (j.contains("residual")) q.residual = r.integer(j["residual"], p + "/residual", 0, 1 << 20);
  if (j.contains("flush")) {
    q.flush = r.named(j["flush"], p + "/flush", kFlushNames);
    if (q.flush == Flush::block && q.residual < 1)
      r.fail(p + "/flush", "\"block\" quantizes the residual's tokens R at a time: expected a \"residual\" of 1 or more");
  }
  if (j.contains("prefill")) q.prefill = r.named(j["prefill"], p + "/prefill", kPrefillRuleNames);
  if (j.contains("chunk_reads")) q.chunk_reads = r.named(j["chunk_reads"], p + "/chunk_reads", kChunkReadsNames);
  if (j.contains("transform")) q.transform = r.named(j["transform"], p + "/transform", kQuantTransformNames);
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

}  // namespace scenario_parse

using scenario_parse::parse_kv_quant;
using scenario_parse::Reader;

std::optional<QuantFormat> quant_format_named(const std::string& name) { return value_in(kQuantFormatNames, name); }

std::string quantize_scenario(Scenario& s, QuantFormat format) {
  if (!s.shared_rope()) return "quantized storage (SPEC 9) with a rope per layer (SPEC 10.1) is not implemented yet";
  if (s.prunes()) return "quantized storage (SPEC 9) with a prune (SPEC 11) is not implemented yet";
  // The defaults of a scenario file's {"format": ...} with no "scale".
  nlohmann::json tensor = {{"format", to_string(format)}};
  nlohmann::json j = {{"k", tensor}, {"v", tensor}};
  try {
    s.quantize_every_layer(parse_kv_quant(Reader(s.file), j, s.dims));
  } catch (const InputError& e) {
    return e.reason;
  }
  return "";
}

}  // namespace kvcheck
