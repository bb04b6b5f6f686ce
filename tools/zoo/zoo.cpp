// The zoo's list: each mutant's cache, where its bug appeared, the class diagnose must give
// and the fixtures that expose it.
//
// Recipe, a new mutant: a Fault in faulty_cache.h (or QuantFault / PagedFault for a fault
// planted around a real cache), its behaviour in that cache's .cpp, and one mutant(...)
// entry below. `kvcheck zoo` and tests/test_zoo.cpp then check it is caught and classified;
// regenerate docs/caches.md's table with `kvcheck zoo --table` (a test compares the two).
#include "tools/zoo/zoo.h"

#include <algorithm>

#include "optimized/dense_cache.h"
#include "optimized/hybrid_cache.h"
#include "optimized/paged_cache.h"
#include "optimized/sink_ring_cache.h"
#include "optimized/sink_shift_cache.h"
#include "optimized/sliding_cache.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/zoo/faulty_cache.h"
#include "tools/zoo/paged_faulty_cache.h"
#include "tools/zoo/quant_faulty_cache.h"

namespace kvcheck {

namespace {

using zoo::Fault;

enum Serves { sliding = 1, sink = 2, sink_cache_positions = 4 };

bool serves(int mask, const Policy& p) {
  if (p.kind == PolicyKind::sliding) return mask & sliding;
  if (p.kind != PolicyKind::sink || p.prefill != Prefill::streaming) return false;
  if (mask & sink) return true;
  return (mask & sink_cache_positions) && p.positions == SinkPositions::cache;
}

ZooMutant mutant(const char* name, Fault fault, int mask, const char* bug, const char* wild, BugClass expected,
                 std::vector<std::string> fixtures) {
  CacheEntry entry{std::string("zoo/") + name, bug,
                   [mask](const Scenario& s) { return s.shared_policy() && serves(mask, *s.shared_policy()); },
                   [fault](const optimized::CacheConfig& config) { return zoo::make_faulty_cache(config, fault); }};
  return {entry, wild, expected, std::move(fixtures)};
}

// A hybrid cache that gives each layer the next layer's policy: the sliding window lands on
// the wrong layers.
ZooMutant hybrid_layers_shifted() {
  CacheEntry entry{"zoo/hybrid_layers_shifted",
                   "gives each layer of a hybrid stack the next layer's policy, so the window lands on the wrong "
                   "layers",
                   [](const Scenario& s) { return s.hybrid(); },
                   [](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     optimized::CacheConfig shifted = config;
                     std::rotate(shifted.policies.begin(), shifted.policies.begin() + 1, shifted.policies.end());
                     return std::make_unique<optimized::HybridCache>(shifted);
                   }};
  return {entry,
          "hybrid caches that index the per-layer pattern off by one (transformers' sliding_window_pattern, "
          "layer_types)",
          BugClass::layer_policy_swapped,
          {"gemma_hybrid_sliding_full", "gpt_oss_hybrid_yarn_learned_sinks"}};
}

// SPEC 10.1: a hybrid cache whose layers get the wrong rope.
ZooMutant hybrid_with_ropes(const char* name, const char* bug, const char* wild, BugClass expected,
                            std::function<bool(const Scenario&)> serves,
                            std::function<void(std::vector<optimized::RopeSpec>&)> mistake,
                            std::vector<std::string> fixtures) {
  CacheEntry entry{std::string("zoo/") + name, bug, std::move(serves),
                   [mistake](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     optimized::CacheConfig wrong = config;
                     mistake(wrong.ropes);
                     return std::make_unique<optimized::HybridCache>(wrong);
                   }};
  return {entry, wild, expected, std::move(fixtures)};
}

ZooMutant one_rope_for_every_layer() {
  return hybrid_with_ropes(
      "one_rope_for_every_layer",
      "rotates every layer with the last layer's rope (Gemma 3's global base), whatever the layer's own",
      "llama.cpp's Gemma 3 context shift re-rotating the sliding layers with the global rope base (issue 12357)",
      BugClass::layer_rotated_with_another_layers_rope, [](const Scenario& s) { return !s.shared_rope(); },
      [](std::vector<optimized::RopeSpec>& ropes) { ropes.assign(ropes.size(), ropes.back()); },
      {"gemma3_sliding_full_two_bases"});
}

ZooMutant nope_layers_rotated() {
  return hybrid_with_ropes(
      "nope_layers_rotated", "rotates a NoPE layer's keys and queries with the first RoPE layer's rope",
      "ports of Llama 4 that apply the rotary embedding in every layer, missing no_rope_layers (whose name "
      "reads inverted: 1 means the layer uses RoPE)",
      BugClass::nope_layer_rotated,
      [](const Scenario& s) {
        return std::any_of(s.ropes.begin(), s.ropes.end(), [](const Rope& r) { return r.nope; }) &&
               std::any_of(s.ropes.begin(), s.ropes.end(), [](const Rope& r) { return !r.nope; });
      },
      [](std::vector<optimized::RopeSpec>& ropes) {
        const auto rope = std::find_if(ropes.begin(), ropes.end(), [](const optimized::RopeSpec& r) { return !r.identity; });
        const optimized::RopeSpec first = *rope;
        for (optimized::RopeSpec& r : ropes)
          if (r.identity) r = first;
      },
      {"llama4_chunked_nope"});
}

// SPEC 10.4: sliding layers under a shift whose window is measured in token indices.
class SinkWindowInIndices : public optimized::SinkRingCache {
 public:
  using SinkRingCache::SinkRingCache;

 protected:
  std::int64_t first_sink_seen(std::int64_t t, std::int64_t sink_query_position) const override {
    (void)sink_query_position;
    return std::max<std::int64_t>(0, t - policy().swa + 1);
  }
};

ZooMutant sliding_window_in_token_indices() {
  CacheEntry entry{"zoo/sliding_window_in_token_indices",
                   "measures a sliding layer's window under a shift in token indices, not in the shifted "
                   "positions: the sinks leave its view for good",
                   [](const Scenario& s) {
                     return std::any_of(s.policies.begin(), s.policies.end(), [](const Policy& p) { return p.swa > 0; });
                   },
                   [](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     return std::make_unique<optimized::HybridCache>(
                         config, [](const optimized::CacheConfig& one) -> std::unique_ptr<optimized::KvCache> {
                           return std::make_unique<SinkWindowInIndices>(one);
                         });
                   }};
  return {entry,
          "iSWA caches under a context shift whose sliding mask reads unshifted positions (llama.cpp issue 12357's "
          "family: Gemma 3 and the shift's two sections of the cache)",
          BugClass::sliding_window_in_token_indices, {"gemma3_sliding_under_context_shift"}};
}

// SPEC 10.3: the hybrid cache with the query temperature left out.
ZooMutant query_temperature_missing() {
  CacheEntry entry{"zoo/query_temperature_missing",
                   "leaves a NoPE layer's query unscaled: Llama 4's attention temperature not applied",
                   [](const Scenario& s) { return s.attention.query_temperature.has_value(); },
                   [](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     optimized::CacheConfig plain = config;
                     plain.temperature_floor = 0;
                     return std::make_unique<optimized::HybridCache>(plain);
                   }};
  return {entry,
          "Llama 4 ports whose attention skips attn_temperature_tuning (a config flag that defaults to on), "
          "invisible below floor_scale (8192) tokens",
          BugClass::query_temperature_missing, {"llama4_chunked_nope"}};
}

// Chunked attention (SPEC 10.2) served by the sliding ring with one mistake.
bool every_layer_chunked(const Scenario& s) { return s.every_layer(PolicyKind::chunked); }

// Chunks counted from position 1: they start at C k - 1, so a query sees the previous
// chunk's last key, and a chunk's last token starts a chunk of its own.
class ChunkEdgeEarlyCache : public optimized::SlidingCache {
 public:
  using SlidingCache::SlidingCache;

 protected:
  std::int64_t first_visible(std::int64_t t) const override { return chunk_start_moved(t, policy().window, -1); }
};

ZooMutant chunk_edge_off_by_one() {
  CacheEntry entry{"zoo/chunk_edge_off_by_one",
                   "draws a chunked layer's chunks from position 1 (cache_position + 1), so each starts one token "
                   "early: a query sees the previous chunk's last key",
                   every_layer_chunked,
                   [](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     return std::make_unique<ChunkEdgeEarlyCache>(config);
                   }};
  return {entry, "chunk masks built from 1-based positions (a chunk index of (p + 1) // C)",
          BugClass::chunk_edge_off_by_one, {"llama4_chunked_decode_and_chunks"}};
}

// The chunk size given to the sliding-window path: the last C keys, not the chunk.
ZooMutant chunk_as_sliding_window() {
  CacheEntry entry{"zoo/chunk_as_sliding_window",
                   "serves a chunked layer as a sliding window of C keys: its cache is right, its mask is not",
                   every_layer_chunked,
                   [](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     optimized::CacheConfig window = config;
                     for (optimized::LayerPolicy& p : window.policies) p.kind = optimized::LayerPolicy::Kind::sliding;
                     return std::make_unique<optimized::SlidingCache>(window);
                   }};
  return {entry,
          "a model whose chunked layers reuse the sliding-window mask with attention_chunk_size as the window, "
          "over a cache that keeps the last C tokens (a ring of C slots, or mlx-lm's ChunkedKVCache before a "
          "forward)",
          BugClass::chunk_as_sliding_window, {"llama4_chunked_decode_and_chunks"}};
}

// A softmax with an extra 1 in its denominator (a sink of logit 0) for a model without sinks.
ZooMutant smooth_softmax_without_sinks() {
  CacheEntry entry{"zoo/smooth_softmax_without_sinks",
                   "adds 1 to every softmax's denominator (a sink of logit 0 in every head) for a model that has no "
                   "sinks",
                   [](const Scenario& s) {
                     return s.attention.sink_logits.empty() && s.every_layer(PolicyKind::full) && !s.quantized() &&
                            !s.prunes();
                   },
                   [](optimized::CacheConfig config) -> std::unique_ptr<optimized::KvCache> {
                     config.sink_logits.assign(static_cast<std::size_t>(config.layers),
                                               std::vector<float>(static_cast<std::size_t>(config.heads), 0.0f));
                     return std::make_unique<optimized::DenseCache>(config, optimized::DenseCache::Growth::dynamic);
                   }};
  return {entry,
          "ONNX Runtime's GroupQueryAttention exported with smooth_softmax=1 for a model without attention sinks "
          "(the attribute is one flag on the op)",
          BugClass::zero_sink_added, {"full_baseline"}};
}

// SPEC 11's prune done the way users of kvpress go wrong, in kvcheck's dense cache.
bool prunes_with_rerotation(const Scenario& s) {
  return s.prunes(true) && !s.prunes_observed() && s.every_layer(PolicyKind::full) && s.kv_dtype == KvDtype::float32;
}

class PruneWithoutRerotation : public optimized::DenseCache {
 public:
  PruneWithoutRerotation(const optimized::CacheConfig& c) : DenseCache(c, Growth::dynamic) {}
  void prune(std::int64_t sinks, std::int64_t recent, bool rerotate) override {
    (void)rerotate;
    DenseCache::prune(sinks, recent, false);
  }
};

class PruneThenOriginalIndex : public optimized::DenseCache {
 public:
  PruneThenOriginalIndex(const optimized::CacheConfig& c) : DenseCache(c, Growth::dynamic) {}

 protected:
  std::int64_t position_of(int row, std::int64_t slot, std::int64_t t) const override {
    (void)row, (void)slot;
    return t;
  }
};

ZooMutant prune_keys_not_rerotated() {
  CacheEntry entry{"zoo/prune_keys_not_rerotated",
                   "prunes to the sinks and the recent tokens but leaves the kept keys at their original positions "
                   "where the prune re-rotates them",
                   prunes_with_rerotation, [](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     return std::make_unique<PruneWithoutRerotation>(config);
                   }};
  return {entry,
          "kvpress's StreamingLLMPress alone, which keeps original positions, where StreamingLLM places keys in the "
          "cache (kvpress issue 158; KeyRerotationPress does it)",
          BugClass::kept_keys_not_shifted, {"prune_key_rerotation"}};
}

ZooMutant prune_new_tokens_at_original_index() {
  CacheEntry entry{"zoo/prune_new_tokens_at_original_index",
                   "re-rotates the kept keys to their ranks, then stores and queries later tokens at their original "
                   "index, n - k positions too far",
                   prunes_with_rerotation, [](const optimized::CacheConfig& config) -> std::unique_ptr<optimized::KvCache> {
                     return std::make_unique<PruneThenOriginalIndex>(config);
                   }};
  return {entry,
          "model.generate() inside kvpress's KeyRerotationPress, which continues at the prompt's length "
          "(docs/findings/kvpress/generate-after-key-rerotation-misplaces-new-tokens.md)",
          BugClass::new_key_not_shifted, {"prune_key_rerotation"}};
}

// A mutant whose bug needs half-precision storage: it is a correct cache in float32.
ZooMutant half_only(ZooMutant m) {
  m.cache.serves = [inner = m.cache.serves](const Scenario& s) {
    return s.kv_dtype != KvDtype::float32 && !s.quantized() && inner(s);
  };
  return m;
}

// A mutant that drops dead tokens right after the forward, which is allowed (SPEC 3).
ZooMutant eager(ZooMutant m) {
  m.cache.eviction = Eviction::any;
  return m;
}

// The real cache a quantized mutant's fault is planted in, the one kvcheck runs for the
// policy: sink_shift for a sink policy; else dynamic (full: no window) or sliding.
std::unique_ptr<optimized::KvCache> real_cache_for(const optimized::CacheConfig& c, bool sink) {
  using namespace optimized;
  if (sink) return std::make_unique<SinkShiftCache>(c);
  if (shared_policy(c).window == 0) return std::make_unique<DenseCache>(c, DenseCache::Growth::dynamic);
  return std::make_unique<SlidingCache>(c);
}

bool full_or_sliding(const Scenario& s) {
  return s.every_layer(PolicyKind::full) || s.every_layer(PolicyKind::sliding);
}

bool has_format(const KvQuant& q, QuantFormat f) {
  return (q.k && q.k->format == f) || (q.v && q.v->format == f);
}

// Each plants its fault in the quantization every layer has (serves is asked with it); a
// scenario whose layers quantize differently is left to the per-layer mutant.
ZooMutant quant_mutant(const char* name, zoo::QuantFault fault,
                       std::function<bool(const Scenario&, const KvQuant&)> serves, const char* bug, const char* wild,
                       BugClass expected, std::vector<std::string> fixtures) {
  CacheEntry entry{std::string("zoo/") + name, bug,
                   [serves = std::move(serves)](const Scenario& s) {
                     return s.quantized() && !s.mixed_quant() && serves(s, s.quant(0));
                   },
                   [fault](const optimized::CacheConfig& config) {
                     const bool sink = fault == zoo::QuantFault::shift_skips_quantized;
                     return zoo::make_quant_faulty_cache(config, fault, real_cache_for(config, sink));
                   }};
  return {entry, wild, expected, std::move(fixtures)};
}

// A paged mutant: kvcheck's paged cache with one decision made wrongly; it serves what the
// paged cache serves.
ZooMutant paged_mutant(const char* name, zoo::PagedFault fault, const char* bug, const char* wild, BugClass expected,
                       std::vector<std::string> fixtures) {
  CacheEntry entry{std::string("zoo/") + name, bug,
                   [](const Scenario& s) {
                     return !s.quantized() && std::all_of(s.policies.begin(), s.policies.end(),
                                                       [](const Policy& p) { return p.kind != PolicyKind::sink; });
                   },
                   [fault](const optimized::CacheConfig& config) { return zoo::make_paged_faulty_cache(config, fault); },
                   Eviction::any};
  return {entry, wild, expected, std::move(fixtures)};
}

}  // namespace

const std::vector<ZooMutant>& zoo_mutants() {
  static const std::vector<ZooMutant> mutants = [] {
    std::vector<ZooMutant> list = {
      mutant("new_key_not_shifted", Fault::new_key_not_shifted, sink_cache_positions,
             "re-rotates the kept keys when the window shifts, but stores the new key at its absolute position",
             "Hugging Face transformers SinkCache: old keys re-rotated, new ones not", BugClass::new_key_not_shifted,
             {"sink_decode_through_windows", "sink_prompt_longer_than_window"}),
      mutant("absolute_positions", Fault::absolute_positions, sink_cache_positions,
             "rotates new keys and queries at absolute positions, which grow past the cache",
             "Hugging Face transformers SinkCache: new tokens given huge positions",
             BugClass::query_position_not_shifted, {"sink_decode_through_windows", "sink_positions_cache"}),
      mutant("long_prompt_keeps_head", Fault::long_prompt_keeps_head, sliding | sink,
             "a prompt longer than the window keeps its first tokens and drops the newest",
             "Hugging Face transformers SinkCache on prompts longer than the window", BugClass::evicted_wrong_token,
             {"sink_prompt_longer_than_window", "sliding_prompt_longer_than_window"}),
      mutant("short_prompt_sinks", Fault::short_prompt_sinks, sink,
             "takes the sinks from the first chunk, so a prompt shorter than the sinks leaves too few",
             "Hugging Face transformers SinkCache on prompts shorter than the sinks", BugClass::sink_count_wrong,
             {"sink_prompt_shorter_than_sinks"}),
      mutant("window_off_by_one", Fault::window_off_by_one, sliding,
             "keeps W + 1 keys: the query's own token is not counted in the window",
             "sliding-window implementations disagree on whether W counts the query (Mistral's W, flash-attention's "
             "left window W - 1)",
             BugClass::window_off_by_one, {"sliding_baseline", "sliding_prompt_longer_than_window"}),
      mutant("stale_rows_on_resize", Fault::stale_rows_on_resize, sink,
             "a reset to another batch size keeps the old rows instead of clearing them",
             "Hugging Face transformers SinkCache reused stale rows when the batch size changed",
             BugClass::stale_row_after_batch_change, {"sink_batch_resize_reset"}),
      mutant("reorder_keeps_row_state", Fault::reorder_keeps_row_state, sliding | sink,
             "beam reorder moves the keys and values but not each row's length and offsets",
             "beam-search reorder_cache implementations that index the tensors but not the per-row counters",
             BugClass::reorder_lost_positions, {"sink_beam_reorder_duplicates"}),
      mutant("padding_as_positions", Fault::padding_as_positions, sink,
             "left padding takes token indices, so the sinks are padding and positions shift",
             "batched generation with left padding and position ids taken from arange instead of the mask",
             BugClass::padding_counted, {"sink_left_padding_mixed_lengths"}),
      mutant("layout_swapped", Fault::layout_swapped, sliding | sink,
             "rotates with interleaved pairs where rotate_half is expected (and the reverse)",
             "checkpoint converters mixing GPT-NeoX (rotate_half) and GPT-J (interleaved) RoPE; llama.cpp's NEOX "
             "vs NORM rope types",
             BugClass::wrong_rope_layout, {"sink_positions_cache", "interleaved_sliding"}),
      mutant("rope_table_wraps", Fault::rope_table_wraps, sliding,
             "sizes the cos/sin table to the window, so position p is rotated at p mod W",
             "rotary caches sized to the cache or to max_position_embeddings and indexed past their end",
             BugClass::rope_table_wraps, {"sliding_baseline", "sliding_prompt_longer_than_window"}),
      mutant("shift_one_early", Fault::shift_one_early, sink_cache_positions,
             "tests \"still growing\" with <, so kept keys are re-rotated one token before anything is evicted",
             "off-by-one in a cache-full test of a shifting cache", BugClass::shift_one_token_early,
             {"sink_decode_through_windows", "sink_prompt_exactly_window"}),
      mutant("mask_past_cache", Fault::mask_past_cache, sink,
             "does not clear evicted slots and builds the mask for the whole sequence, so queries see them",
             "attention masks sized to the full sequence while the cache holds a window", BugClass::mask_sees_evicted,
             {"sink_evict4_context_shift"}),
      eager(mutant("drops_live_token", Fault::drops_live_token, sink,
                   "evicts right after the forward (allowed for the dead token) and drops one token too many",
                   "caches that move eviction after the forward (StreamingLLM style) and count the window one short",
                   BugClass::dropped_live_token, {"sink_decode_through_windows"})),
      mutant("llama3_as_linear", Fault::llama3_as_linear, sliding | sink,
             "reads llama3 rope_scaling as plain linear scaling: the high frequencies are divided by 8 too",
             "engines and converters that know linear scaling only and map every rope_scaling factor to it",
             BugClass::wrong_frequency_map, {"llama31_sink_gqa", "llama31_sliding_gqa"}),
      mutant("partial_rotates_all", Fault::partial_rotates_all, sliding | sink,
             "ignores rotary_dim: rotates every dim of the head, with frequencies over head_dim",
             "Phi and GPT-NeoX ports whose rotary embedding is applied to the whole head", BugClass::wrong_rotary_dim,
             {"phi_partial_rotary_sink"}),
      mutant("yarn_factor_on_q_only", Fault::yarn_factor_on_q_only, sliding | sink,
             "multiplies the query by yarn's attention factor but stores the keys without it",
             "yarn implementations that fold the attention factor into the query or the softmax scale on one side",
             BugClass::attention_factor_wrong, {"gpt_oss_yarn_learned_sinks_sliding"}),
      half_only(mutant("rerotates_half_keys", Fault::rerotates_half_keys, sink_cache_positions,
                       "re-rotates its stored half-precision keys at every shift, rounding them again each time",
                       "SinkCache-style shifting caches run in float16 or bfloat16 (Hugging Face's SinkCache "
                       "re-rotated keys in the model's dtype)",
                       BugClass::rerotation_drift, {"sink_long_window_bfloat16", "sink_long_window_float16"})),
      hybrid_layers_shifted(),
      mutant("learned_sinks_dropped", Fault::learned_sinks_dropped, sliding | sink,
             "leaves the learned sink logits out of the softmax",
             "gpt-oss ports whose attention kernel has no sink term (and caches that confuse it with sink tokens)",
             BugClass::learned_sinks_dropped, {"learned_sinks_sink_cache", "gpt_oss_yarn_learned_sinks_sliding"}),
      // Quantized storage (SPEC 9): planted in the real dense, sliding or sink_shift cache.
      quant_mutant(
          "scale_dropped_on_read", zoo::QuantFault::scale_dropped_on_read,
          [](const Scenario& s, const KvQuant& q) {
            return full_or_sliding(s) && q.k && q.k->scale.rule == ScaleRule::fixed &&
                   q.k->scale.values != std::vector<double>{1.0};
          },
          "writes fp8(x / s) with the checkpoint's static scale, reads the codes as if s were 1",
          "SGLang's k_scale never reaching the kernels (issue 18818); tokenspeed's FA4 path ignoring k/v_scale (PR "
          "759), unseen by tests that only used scale 1",
          BugClass::quant_scale_not_applied, {"quant_fp8_e4m3_static_scale"}),
      quant_mutant("v_with_k_scales", zoo::QuantFault::v_with_k_scales,
                   [](const Scenario& s, const KvQuant& q) {
                     return full_or_sliding(s) && q.k && q.v &&
                            q.k->format == QuantFormat::q8_0 && q.v->format == QuantFormat::q8_0;
                   },
                   "dequantizes V's q8_0 blocks with K's block scales",
                   "ik_llama.cpp's FlashMLA reading V as a view of K with K's layout (PR 400)",
                   BugClass::quant_dequantization_layout, {"quant_q8_0_full"}),
      quant_mutant("q4_nibble_order", zoo::QuantFault::q4_nibble_order,
                   [](const Scenario& s, const KvQuant& q) { return full_or_sliding(s) && has_format(q, QuantFormat::q4_0); },
                   "reads q4_0 with element j paired with j + 1 in a byte, where ggml pairs j with j + 16",
                   "ik_llama.cpp's Q6_0 dequantization bug, gibberish at high perplexity (PR 1005)",
                   BugClass::quant_dequantization_layout, {"quant_q4_0_sliding"}),
      quant_mutant(
          "scale_frozen_on_first", zoo::QuantFault::scale_frozen_on_first,
          [](const Scenario& s, const KvQuant& q) {
            return full_or_sliding(s) && q.k &&
                   q.transform == QuantTransform::none &&
                   (q.k->format == QuantFormat::int8 || q.k->format == QuantFormat::fp8_e4m3 ||
                    q.k->format == QuantFormat::fp8_e5m2) &&
                   q.k->scale.granularity == ScaleGranularity::token &&
                   q.k->scale.dtype == ScaleDtype::float32;
          },
          "computes each kv head's key scale at the first append and keeps it for every later token",
          "imp's online FP8 calibration frozen on the warm-up pass (PR 89); vLLM's calculate_kv_scales from one "
          "warm-up batch",
          BugClass::quant_scale_wrong, {"quant_int8_token_scale_sliding"}),
      quant_mutant("shift_skips_quantized", zoo::QuantFault::shift_skips_quantized,
                   [](const Scenario& s, const KvQuant& q) {
                     return s.every_layer(PolicyKind::sink) &&
                            s.shared_policy()->positions == SinkPositions::cache &&
                            s.shared_policy()->prefill == Prefill::streaming &&
                            q.k;
                   },
                   "a context shift moves the quantized keys and their positions, but leaves their codes as they were",
                   "llama.cpp's context shift with a quantized K cache, unsupported and then done by dequantize, rope, "
                   "quantize (issues 5652, 7230, 9743; PR 5653)",
                   BugClass::quant_key_not_rerotated, {"quant_q8_0_hadamard_context_shift"}),
      quant_mutant(
          "prefill_skips_residual", zoo::QuantFault::prefill_skips_residual,
          [](const Scenario& s, const KvQuant& q) { return full_or_sliding(s) && q.holds_raw(); },
          "quantizes a row's first append at once though the scenario keeps it in the residual (prefill "
          "\"residual\"), and keeps it raw where it says \"store\"",
          "transformers' QuantizedCache quantizing the whole prompt in one shot whatever residual_length: Qwen2.5-7B "
          "int4 answers 0 of 120 (issue 35185)",
          BugClass::quant_precision_map, {"quant_residual_kivi"}),
      quant_mutant(
          "reorder_residual_only", zoo::QuantFault::reorder_residual_only,
          [](const Scenario& s, const KvQuant& q) { return full_or_sliding(s) && q.holds_raw(); },
          "moves only the raw residual on a beam reorder or a crop; each row keeps its own quantized tokens, "
          "and those past a crop stay",
          "transformers' QuantizedLayer inheriting reorder_cache and crop that touch the residual buffer only: "
          "beams cross silently (PRs 45510 and 48700)",
          BugClass::quant_store_not_moved, {"quant_residual_hf"}),
      quant_mutant(
          "decode_tile_rounding", zoo::QuantFault::decode_tile_rounding,
          [](const Scenario& s, const KvQuant& q) {
            return s.every_layer(PolicyKind::full) && q.transform == QuantTransform::none && s.attention.sink_logits.empty();
          },
          "computes a decode in tiles of 96 keys, holding the running output in bfloat16 between tiles; a chunk is "
          "one float32 pass",
          "FA3's FP8 decode picking a tile of 96 keys, prefill another: decode and prefill logprobs diverge from "
          "position 97, bf16 is bitwise equal (vLLM issue 54035, SGLang issue 25790)",
          BugClass::path_inconsistency, {"quant_decode_tile_paths"}),
      [] {
        // Planted in the paged cache, whose rows swap out and back in.
        ZooMutant m = quant_mutant(
            "transform_missing_on_restore", zoo::QuantFault::transform_missing_on_restore,
            [](const Scenario& s, const KvQuant& q) {
              return s.paging && q.transform == QuantTransform::hadamard &&
                     !q.holds_raw() &&
                     std::all_of(s.policies.begin(), s.policies.end(),
                                 [](const Policy& p) { return p.kind != PolicyKind::sink; });
            },
            "quantizes with the Hadamard transform on every write, but a row swapped back in is staged in float and "
            "quantized again without it",
            "llama.cpp's attention rotation of quantized KV missing on the path that restores or re-quantizes slots: "
            "\"f16 to q8_0 is broken with attention rotation on\" (PR 24367, unslothai/llama.cpp PR 129)",
            BugClass::quant_transform_missing, {"quant_paged_hadamard_swap"});
        m.cache.make = [](const optimized::CacheConfig& config) {
          return zoo::make_quant_faulty_cache(config, zoo::QuantFault::transform_missing_on_restore,
                                              std::make_unique<optimized::PagedCache>(config));
        };
        m.cache.eviction = Eviction::any;
        return m;
      }(),
      // Per-layer static scales (SPEC 9's per-layer kv_quant): a loader that keeps one.
      [] {
        CacheEntry entry{
            "zoo/layer_scales_shared",
            "writes and reads every layer's keys and values with layer 0's static scales (each layer's own "
            "calibrated k_scale and v_scale lost)",
            [](const Scenario& s) {
              return full_or_sliding(s) && s.mixed_quant() && s.any_layer_quant([&](const KvQuant& q) {
                const KvQuant& first = s.quant(0);
                const auto fixed_differs = [](const std::optional<TensorQuant>& a,
                                              const std::optional<TensorQuant>& b) {
                  return a && b && a->format == b->format && a->scale.rule == ScaleRule::fixed &&
                         b->scale.rule == ScaleRule::fixed && a->scale.granularity == b->scale.granularity &&
                         a->scale.values != b->scale.values;
                };
                return fixed_differs(q.k, first.k) || fixed_differs(q.v, first.v);
              });
            },
            [](const optimized::CacheConfig& config) {
              optimized::CacheConfig one_scale = config;
              for (optimized::LayerQuant& layer : one_scale.quant)
                for (auto [mine, first] : {std::pair{&layer.key, &config.quant.front().key},
                                           std::pair{&layer.value, &config.quant.front().value}})
                  if (*mine && *first && (*mine)->codec == (*first)->codec && !(*first)->static_scales.empty())
                    (*mine)->static_scales = (*first)->static_scales;
              return real_cache_for(one_scale, false);
            }};
        return ZooMutant{entry,
                         "SGLang's Qwen3-MoE, Qwen2 and Mixtral loaders dropping the checkpoint's per-layer FP8 KV "
                         "scales, every layer at one scale (issue 39942); ModelOpt exporting 1.0 for every layer "
                         "(Model-Optimizer issue 20)",
                         BugClass::quant_scale_wrong,
                         {"quant_fp8_per_layer_scales"}};
      }(),
      // A paged decision under frozen scales: planted in kvcheck's paged cache.
      [] {
        ZooMutant m = paged_mutant(
            "hit_reads_own_scale", zoo::PagedFault::hit_reads_own_scale,
            "a row that takes a prefix hit reads the shared blocks with its own frozen scale, not the scale their "
            "writer stored them with",
            "TensorRT-LLM issue 2699: wrong outputs with an FP8 KV cache and block reuse (cause unpublished; the "
            "hypothesis is kvcheck's: one scale per request where each block needs its writer's)",
            BugClass::quant_shared_scale, {"quant_paged_frozen_scale_hit"});
        m.cache.serves = [](const Scenario& s) {
          return s.paging && s.paging->prefix_cache && s.every_layer_quant([](const KvQuant& q) { return frozen_scales(q); });
        };
        return m;
      }(),
      // Paged caches (SPEC 8): planted in kvcheck's paged cache.
      paged_mutant("key_without_extras", zoo::PagedFault::key_without_extras,
                   "keys its prefix index by token ids alone, without the row's adapter and salt",
                   "vLLM's automatic prefix caching without the LoRA id in the block hash (issue 3264), then with "
                   "the LoRA name only (issue 30931)",
                   BugClass::paged_hit_across_contexts, {"paged_adapters_and_salts"}),
      paged_mutant("key_extras_untagged", zoo::PagedFault::key_extras_untagged,
                   "mixes adapter and salt into the prefix key untagged, so adapter \"X\" is salt \"X\"",
                   "vLLM v1's extra keys, where lora_name == cache_salt gave one first-block hash (issue 44701)",
                   BugClass::paged_hit_across_contexts, {"paged_adapters_and_salts"}),
      paged_mutant("register_before_write", zoo::PagedFault::register_before_write,
                   "enters full blocks into the prefix index when they are allocated, before the forward writes them",
                   "vLLM's cache_full_blocks registering a hash before the forward, so a request later in the same "
                   "step read uninitialized memory (PR 37152, the invariant of PR 7822)",
                   BugClass::paged_read_before_write, {"paged_same_prompt_in_one_step"}),
      paged_mutant("share_partial_no_cow", zoo::PagedFault::share_partial_no_cow,
                   "writes into a block other rows share (a fork's partly filled tail) without copying it first",
                   "atlas' prefix cache handing a partial tail block to a second writer: \"a mix of two streams\" "
                   "(issue 1193)",
                   BugClass::paged_shared_block_written, {"paged_fork_then_prefix_hit"}),
      paged_mutant("hit_without_reference", zoo::PagedFault::hit_without_reference,
                   "puts the blocks of a prefix hit in the row's table without taking a reference on them",
                   "atlas pushing a hit block into the table without a reference, so the donor's free underflows "
                   "its count (issue 692)",
                   BugClass::paged_refcount_mismatch, {"paged_fork_then_prefix_hit"}),
      paged_mutant("move_row_stale_tail", zoo::PagedFault::move_row_stale_tail,
                   "a reorder copies the source row's table entries over the destination's, leaving its old tail",
                   "vLLM tt-plugin's BlockTable.move_row copying num_blocks entries and leaving the previous "
                   "occupant's ids (PR 103)",
                   BugClass::paged_stale_table_entry, {"paged_move_short_row"}),
      paged_mutant("window_free_early", zoo::PagedFault::window_free_early,
                   "frees the sliding window's blocks one block early: below floor((n - W + 1) / B) + 1",
                   "vLLM v1 dropping one block too many from a sliding window's table (PR 17398)",
                   BugClass::paged_block_freed_while_visible, {"paged_window_2b", "paged_window_2b_plus_1"}),
      paged_mutant("window_absolute_index", zoo::PagedFault::window_absolute_index,
                   "keeps a sliding layer's table compact (from the first live block on, padded with block 0) but "
                   "indexes it with the absolute t / B, so past the window tokens land in block 0",
                   "tt-metal's vLLM plugin indexing the sliding-window page table with cur_pos // block_size "
                   "(PR 45184)",
                   BugClass::paged_slot_mapping_wrong, {"paged_window_2b", "paged_gemma_hybrid_prefix"}),
      paged_mutant("chunk_keys_to_append_end", zoo::PagedFault::chunk_keys_to_append_end,
                   "in a chunked prefill, a chunk's kernel is given the whole append's key length, so its queries "
                   "see keys of later chunks, whose slots are mapped but not yet written",
                   "nano-vllm's chunked prefill setting seqlen_k to the full sequence length, reading KV slots "
                   "\"that haven't been written yet\" (PR 213)",
                   BugClass::chunk_sees_future_keys, {"paged_chunked_prefill"}),
      paged_mutant("chunk_keys_chunk_only", zoo::PagedFault::chunk_keys_chunk_only,
                   "in a chunked prefill, a chunk's queries see only the chunk's own keys",
                   "imp's chunked prefill attending within the chunk, never the cache (PR 114)",
                   BugClass::chunk_misses_past_keys, {"paged_chunked_prefill"}),
      paged_mutant("chunk_position_restart", zoo::PagedFault::chunk_position_restart,
                   "in a chunked prefill, a later chunk's positions restart at 0",
                   "transformers' _prefill taking position_ids from each chunk's cache_position (issue 43082); "
                   "vLLM's M-RoPE positions sliced per chunk (PR 10388)",
                   BugClass::chunk_positions_wrong, {"paged_chunked_prefill"}),
      paged_mutant("evict_keeps_index", zoo::PagedFault::evict_keeps_index,
                   "evicting or reusing a cached block leaves its prefix-index entry behind",
                   "TensorRT-LLM's block reuse serving another prompt's context (issues 8274, 8813); llama-server's "
                   "RAM prompt cache restoring an unrelated conversation (issue 27148)",
                   BugClass::paged_stale_prefix_hit, {"paged_evict_then_repeat"}),
      paged_mutant("recompute_prompt_only", zoo::PagedFault::recompute_prompt_only,
                   "a recompute preemption rebuilds the row's prompt only, losing the tokens generated since",
                   "vLLM's \"preempted output is incomplete\" under PreemptionMode.RECOMPUTE (issue 16832); "
                   "nano-vllm's stale num_cached_tokens (PR 211)",
                   BugClass::tokens_lost_after_preemption, {"paged_preempt_swap_and_recompute"}),
      paged_mutant("window_kept_in_prefill", zoo::PagedFault::window_kept_in_prefill,
                   "a sliding layer frees the blocks that left its window only once a chunked prefill is done: "
                   "between its forwards it holds blocks no query reads again",
                   "kvcheck's own, for SPEC 8.7's per-forward checks; vLLM issue 7470 reports the same memory taken "
                   "from the allocation side (a sliding-window prefill allocating more blocks than the window)",
                   BugClass::window_kept_in_prefill, {"paged_sliding_chunked_prefill"}),
      chunk_edge_off_by_one(),
      chunk_as_sliding_window(),
      one_rope_for_every_layer(),
      nope_layers_rotated(),
      query_temperature_missing(),
      sliding_window_in_token_indices(),
      prune_keys_not_rerotated(),
      prune_new_tokens_at_original_index(),
      smooth_softmax_without_sinks(),
  };
    // The other mutants keep one cos/sin table: they serve scenarios of one rope.
    for (ZooMutant& m : list)
      if (m.cache.name != "zoo/one_rope_for_every_layer" && m.cache.name != "zoo/nope_layers_rotated" &&
          m.cache.name != "zoo/hybrid_layers_shifted" && m.cache.name != "zoo/query_temperature_missing" &&
          m.cache.name != "zoo/sliding_window_in_token_indices")
        m.cache.serves = [inner = m.cache.serves](const Scenario& s) { return s.shared_rope() && inner(s); };
    // Nor do they store MLX's affine groups (SPEC 9.7), as kvcheck's caches do not.
    for (ZooMutant& m : list)
      m.cache.serves = [inner = m.cache.serves](const Scenario& s) { return !stores_biased_groups(s) && inner(s); };
    // Their caches do not prune (SPEC 11), except the mutants planted in a prune.
    for (ZooMutant& m : list)
      if (m.cache.name.rfind("zoo/prune_", 0) != 0)
        m.cache.serves = [inner = m.cache.serves](const Scenario& s) { return !s.prunes() && inner(s); };
    return list;
  }();
  return mutants;
}

const std::vector<CacheEntry>& zoo_caches() {
  static const std::vector<CacheEntry> caches = [] {
    std::vector<CacheEntry> out;
    for (const ZooMutant& m : zoo_mutants()) out.push_back(m.cache);
    return out;
  }();
  return caches;
}

}  // namespace kvcheck
