#include "tools/llamacpp/toy_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "reference/rope.h"
#include "tools/harness/scenario/generator.h"

namespace kvcheck::llamacpp {
namespace {

[[noreturn]] void refuse(const Scenario& s, const std::string& path, const std::string& why) {
  throw Unsupported(fmt::format("{}: {}: {}", s.file, path, why));
}

// A policy list's or rope list's path for layer l ("/policy/3"), or the shared one's.
std::string layer_path(const char* field, bool listed, int l) {
  return listed ? fmt::format("/{}/{}", field, l) : fmt::format("/{}", field);
}

// What both architectures need, checked before anything is loaded.
void require_common(const Scenario& s) {
  if (s.attention.query_temperature) refuse(s, "/attention/query_temperature", "llama.cpp's llama and gemma3 archs have no query temperature");
  if (!s.attention.sink_logits.empty()) refuse(s, "/attention/sink_logits", "llama.cpp's llama and gemma3 archs have no learned sinks");
  if (s.scale && std::abs(*s.scale - 1.0 / std::sqrt(s.dims.head_dim)) > 1e-12)
    refuse(s, "/scale", "llama.cpp's llama and gemma3 archs scale by 1/sqrt(head_dim)");
  if (s.inputs.kind != InputSource::Kind::seed)
    refuse(s, "/inputs", "llama.cpp computes q, k and v itself: give a seed (it seeds the embeddings and weights)");
  if (s.content == Content::prefix)
    refuse(s, "/content", "content \"prefix\" is SPEC 8's paged prefix reuse; llama.cpp's cache has no blocks");
  if (s.paging) refuse(s, "/paging", "llama.cpp's unified cache has no block pool (SPEC 8 is for paged engines)");
  // Steps the driver cannot express are refused here, naming the step, never run into.
  for (const Step& step : s.steps)
    if (step.op == StepOp::free_rows || step.op == StepOp::evict || step.op == StepOp::preempt ||
        step.op == StepOp::resume || step.op == StepOp::prune)
      refuse(s, fmt::format("/steps/{}/op", step.source_index),
             fmt::format("\"{}\": the llama.cpp driver runs append, decode, reorder, reset and crop only",
                         to_string(step.op)));
}

// A sink policy as llama-server's context shift runs it.
void require_shiftable(const Scenario& s, const Policy& p, const std::string& path) {
  if (p.kind == PolicyKind::sink && p.positions != SinkPositions::cache)
    refuse(s, path + "/positions", "llama.cpp's context shift re-encodes kept keys: positions \"cache\" only");
  if (p.kind == PolicyKind::sink && p.prefill != Prefill::streaming)
    refuse(s, path + "/prefill", "prefill \"streaming\" only (the driver shifts between forwards)");
}

void require_full_rotation(const Scenario& s, const Rope& rope, const std::string& path, const char* arch) {
  if (rope.nope) refuse(s, path, fmt::format("NoPE layers: the {} arch rotates every layer", arch));
  if (rope.rotary_dim != 0 && rope.rotary_dim != s.dims.head_dim)
    refuse(s, path + "/rotary_dim", fmt::format("the {} arch rotates every dim of the head", arch));
}

ToyArch choose_llama(const Scenario& s) {
  const Rope& rope = *s.shared_rope();
  require_full_rotation(s, rope, "/rope", "llama");
  const Policy& p = *s.shared_policy();
  if (p.kind == PolicyKind::sliding)
    refuse(s, "/policy/type", "sliding for every layer: the llama arch has no sliding window, and gemma3 needs full "
                              "layers beside its sliding ones; use sink or full, or a list of both");
  if (p.kind == PolicyKind::chunked) refuse(s, "/policy/type", "chunked: the llama arch has no chunked attention; use sink or full");
  require_shiftable(s, p, "/policy");
  if (rope.scaling == RopeScaling::yarn &&
      (rope.beta_fast != 32.0 || rope.beta_slow != 1.0 ||
       std::abs(rope.attention_factor - (0.1 * std::log(rope.factor) + 1.0)) > 1e-12))
    refuse(s, "/rope/scaling", "yarn with beta_fast 32, beta_slow 1 and the default attention factor only (what the "
                               "llama arch reads from a GGUF)");
  ToyArch arch;
  arch.sliding.assign(static_cast<std::size_t>(s.dims.layers), false);
  arch.global = p;
  arch.global_rope = arch.sliding_rope = rope;
  return arch;
}

// Gemma 3: sliding layers (one window, one rope without scaling: llama.cpp has no scaling
// key for them) beside full layers (one policy, one rope: none or linear scaling). Under a
// shift (the full layers' policy a sink) every sliding layer shifts with them (SPEC 10.4).
ToyArch choose_gemma3(const Scenario& s) {
  ToyArch arch;
  const bool policy_listed = s.hybrid(), rope_listed = s.shared_rope() == nullptr;
  int first_global = -1, first_sliding = -1;
  for (int l = 0; l < s.dims.layers; ++l) {
    const Policy& p = s.policy(l);
    const bool sliding = p.swa > 0 || p.kind == PolicyKind::sliding;
    arch.sliding.push_back(sliding);
    const std::string path = layer_path("policy", policy_listed, l);
    if (p.kind == PolicyKind::chunked) refuse(s, path + "/type", "chunked: the gemma3 arch has no chunked attention");
    int& first = sliding ? first_sliding : first_global;
    if (first < 0) {
      first = l;
      continue;
    }
    // Which sink layer a sliding layer names does not matter: llama.cpp shifts them all alike.
    Policy mine = p, model = s.policy(first);
    mine.shift_with = model.shift_with = -1;
    if (!(mine == model))
      refuse(s, path, fmt::format("the gemma3 arch gives every {} layer one policy: layer {} differs from layer {}",
                                  sliding ? "sliding" : "full", l, first));
  }
  if (first_global < 0 || first_sliding < 0)
    refuse(s, "/policy", "the gemma3 arch needs sliding layers beside full (or sink) ones");
  arch.gemma3 = true;
  arch.global = s.policy(first_global);
  const Policy& sliding = s.policy(first_sliding);
  const std::string sliding_path = layer_path("policy", policy_listed, first_sliding);
  require_shiftable(s, arch.global, layer_path("policy", policy_listed, first_global));
  if (arch.global.kind == PolicyKind::sink && sliding.swa == 0)
    refuse(s, sliding_path, "under llama.cpp's context shift the sliding layers share the full layers' cells: give "
                            "them \"shift_with\" the sink layer (SPEC 10.4)");
  arch.window = sliding.swa > 0 ? sliding.swa : sliding.window;
  // Ropes: one for the full layers, one for the sliding ones.
  for (int l = 0; l < s.dims.layers; ++l) {
    const std::string path = layer_path("rope", rope_listed, l);
    Rope rope = s.ropes[static_cast<std::size_t>(l)];
    require_full_rotation(s, rope, path, "gemma3");
    rope.layout = RopeLayout::half;  // the driver's to declare: llama.cpp rotates gemma3 NEOX
    const bool is_sliding = arch.sliding[static_cast<std::size_t>(l)];
    if (is_sliding && rope.scaling != RopeScaling::none)
      refuse(s, path + "/scaling", "gemma3's sliding layers rotate without scaling in llama.cpp (it reads no scaling "
                                   "for them): give the sliding layers a rope of their own");
    if (!is_sliding && rope.scaling != RopeScaling::none && rope.scaling != RopeScaling::linear)
      refuse(s, path + "/scaling", "the gemma3 arch's full layers take none or linear scaling here");
    Rope& kind = is_sliding ? arch.sliding_rope : arch.global_rope;
    const int first = is_sliding ? first_sliding : first_global;
    if (l == first) kind = rope;
    else if (!(rope == kind))
      refuse(s, path, fmt::format("the gemma3 arch gives every {} layer one rope: layer {} differs from layer {}",
                                  is_sliding ? "sliding" : "full", l, first));
  }
  return arch;
}

// Deterministic weights: the scenario's generator under its own tags, scaled.
std::vector<float> weights(std::uint64_t seed, int tag, std::size_t count, float scale) {
  std::vector<float> w(count);
  for (std::size_t i = 0; i < count; ++i) w[i] = scale * generated_value(seed, 1000 + tag, i, Tensor::q, 0, 0);
  return w;
}

}  // namespace

ToyArch choose_arch(const Scenario& s) {
  require_common(s);
  if (!s.hybrid()) {
    if (!s.shared_rope())
      refuse(s, "/rope", "one rope for every layer: the llama arch rotates every layer alike (a rope per layer is "
                         "gemma3's, with sliding layers in the policy list)");
    return choose_llama(s);
  }
  return choose_gemma3(s);
}

double toy_model_bytes(const Scenario& s, std::int64_t n_ctx) {
  const double L = s.dims.layers, embd = static_cast<double>(s.dims.heads) * s.dims.head_dim,
               kv = static_cast<double>(s.dims.kv_heads) * s.dims.head_dim, ctx = static_cast<double>(n_ctx);
  const double weights = 4 * (L * (2 * embd * embd + 2 * embd * kv + 50 * embd) + 17 * embd);
  const double cache = 2 * L * (ctx + 256) * kv * 4;
  const double scores = 4.0 * s.dims.heads * (ctx + 256) * ctx + 4 * ctx * 10 * embd;
  return 3 * weights + cache + scores;
}

GgufFile toy_model(const Scenario& s, const ToyArch& arch, std::int64_t n_ctx) {
  const std::int64_t H = s.dims.heads, Hkv = s.dims.kv_heads, D = s.dims.head_dim, embd = H * D, ff = 16,
                     vocab = 8;
  const std::uint64_t seed = s.inputs.seed;
  const float scale = 1.0f / std::sqrt(static_cast<float>(embd));
  const std::string a = arch.name();
  const Rope& rope = arch.global_rope;
  GgufFile f;
  auto meta = [&](const std::string& key, GgufValue v) { f.metadata.emplace_back(key, std::move(v)); };
  meta("general.architecture", a);
  meta("general.name", s.name);
  meta(a + ".vocab_size", static_cast<std::uint32_t>(vocab));
  meta(a + ".context_length", static_cast<std::uint32_t>(std::max<std::int64_t>(n_ctx, 8192)));
  meta(a + ".embedding_length", static_cast<std::uint32_t>(embd));
  meta(a + ".block_count", static_cast<std::uint32_t>(s.dims.layers));
  meta(a + ".feed_forward_length", static_cast<std::uint32_t>(ff));
  meta(a + ".attention.head_count", static_cast<std::uint32_t>(H));
  meta(a + ".attention.head_count_kv", static_cast<std::uint32_t>(Hkv));
  meta(a + ".attention.key_length", static_cast<std::uint32_t>(D));
  meta(a + ".attention.value_length", static_cast<std::uint32_t>(D));
  meta(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  meta(a + ".rope.dimension_count", static_cast<std::uint32_t>(D));
  meta(a + ".rope.freq_base", static_cast<float>(rope.theta));
  if (rope.scaling == RopeScaling::linear || rope.scaling == RopeScaling::yarn) {
    meta(a + ".rope.scaling.type", std::string(rope.scaling == RopeScaling::linear ? "linear" : "yarn"));
    meta(a + ".rope.scaling.factor", static_cast<float>(rope.factor));
    if (rope.scaling == RopeScaling::yarn)
      meta(a + ".rope.scaling.original_context_length", static_cast<std::uint32_t>(rope.original_max_position_embeddings));
  }
  if (arch.gemma3) {
    // One flag per layer (true: sliding), and the sliding layers' own base; a full layer's
    // scaling is the context's, which llama.cpp applies to full layers only.
    meta(a + ".attention.sliding_window", static_cast<std::uint32_t>(arch.window));
    meta(a + ".attention.sliding_window_pattern", arch.sliding);
    meta(a + ".rope.freq_base_swa", static_cast<float>(arch.sliding_rope.theta));
  }
  meta("tokenizer.ggml.model", std::string("none"));
  // llama3 scaling reaches the llama arch as Llama 3.1 checkpoints carry it: a rope_freqs
  // tensor of per-pair factors, each pair's plain inverse frequency over its mapped one.
  if (rope.scaling == RopeScaling::llama3) {
    Rope plain = rope;
    plain.scaling = RopeScaling::none;
    std::vector<float> factors;
    for (int i = 0; i < static_cast<int>(D) / 2; ++i)
      factors.push_back(static_cast<float>(reference::inverse_frequency(i, static_cast<int>(D), plain) /
                                           reference::inverse_frequency(i, static_cast<int>(D), rope)));
    f.tensors.push_back({"rope_freqs.weight", {D / 2}, std::move(factors)});
  }
  int tag = 0;
  // A norm's weight is 1 (0 here): the identity, also for gemma3, whose converter folds
  // Gemma's 1 + w into the stored weight.
  auto tensor = [&](const std::string& name, std::vector<std::int64_t> ne, float w) {
    std::size_t count = 1;
    for (std::int64_t n : ne) count *= static_cast<std::size_t>(n);
    std::vector<float> data = w == 0.0f ? std::vector<float>(count, 1.0f) : weights(seed, tag++, count, w);
    f.tensors.push_back({name + ".weight", std::move(ne), std::move(data)});
  };
  tensor("token_embd", {embd, vocab}, scale);
  tensor("output_norm", {embd}, 0.0f);
  if (!arch.gemma3) tensor("output", {embd, vocab}, scale);  // gemma3 ties it to token_embd
  for (int l = 0; l < s.dims.layers; ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    tensor(b + "attn_norm", {embd}, 0.0f);
    tensor(b + "attn_q", {embd, H * D}, 2 * scale);
    tensor(b + "attn_k", {embd, Hkv * D}, 2 * scale);
    tensor(b + "attn_v", {embd, Hkv * D}, 2 * scale);
    tensor(b + "attn_output", {H * D, embd}, scale);
    if (arch.gemma3) {
      tensor(b + "attn_q_norm", {D}, 0.0f);
      tensor(b + "attn_k_norm", {D}, 0.0f);
      tensor(b + "post_attention_norm", {embd}, 0.0f);
      tensor(b + "post_ffw_norm", {embd}, 0.0f);
    }
    tensor(b + "ffn_norm", {embd}, 0.0f);
    tensor(b + "ffn_gate", {embd, ff}, scale);
    tensor(b + "ffn_up", {embd, ff}, scale);
    tensor(b + "ffn_down", {ff, embd}, 0.1f * scale);
  }
  return f;
}

}  // namespace kvcheck::llamacpp
