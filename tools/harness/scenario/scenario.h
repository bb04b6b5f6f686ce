// A scenario: dimensions, RoPE, policy, inputs and a list of steps (SPEC section 4),
// parsed from JSON with every error naming the file and the JSON path of the field.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/kv_quant.h"
#include "reference/model.h"
#include "tools/harness/io/input_error.h"

namespace kvcheck {

enum class StepOp { append, reorder, reset, crop, free_rows, evict, preempt, resume, prune };

// A row's extras (SPEC 8.1): they enter its tokens' context keys, so equal ids under
// another adapter or salt are other tokens.
struct RowExtras {
  std::string adapter, salt;
  bool operator==(const RowExtras&) const = default;
};

// `expect_hit` of one row: tokens the cache may take from its prefix index (SPEC 8.4).
struct HitRange {
  std::int64_t min = 0, max = 0;
};

// One step after `decode k` was expanded into k appends of one token.
struct Step {
  StepOp op = StepOp::append;
  std::vector<std::int64_t> tokens;  // append: one count (every row) or one per row
  std::vector<int> rows;             // reorder; free, preempt, resume: the rows
  bool recompute = false;            // preempt (SPEC 8.6): "recompute" (else "swap")
  std::optional<int> batch;          // reset
  std::int64_t length = 0;           // crop
  std::int64_t evict_blocks = -1;    // evict: blocks to drop, -1 for all
  // prune (SPEC 11): every row keeps its first `sinks` and last `recent` tokens; `rerotate`
  // moves the kept keys (and every later token) to positions in the cache.
  std::int64_t prune_sinks = 0, prune_recent = 0;
  bool rerotate = false;
  // prune, observed (SPEC 11.1): every row keeps `prune_keep` tokens the cache chooses (a
  // score-based press), `prune_sinks` and `prune_recent` among them; 0: a SPEC 11 prune.
  std::int64_t prune_keep = 0;
  // append (SPEC 8): the forward size (0: one forward); the rows' extras (content
  // "prefix", every row); per row the tokens a prefix hit may cover (rows that start).
  std::int64_t chunk = 0;
  std::vector<RowExtras> extras;                        // filled by assign_content_keys
  std::vector<std::optional<RowExtras>> extras_given;   // as written: rows that start
  std::vector<std::vector<std::uint64_t>> ids;          // as written: explicit token ids per row
  std::vector<std::optional<HitRange>> expect_hit;
  std::string expect_error;          // non-empty: this step must be refused with that code
  int source_index = 0;              // index in the scenario's "steps" array
  std::string source_op;             // op as written ("decode" for expanded decodes)
};

struct Tolerance {
  double rtol = 1.3e-6;  // torch.testing.assert_close defaults for float32
  double atol = 1e-5;
};

// Where the raw q/k/v come from: the generator (seed), .npy files beside the scenario,
// or inline arrays.
struct InputSource {
  enum class Kind { seed, npy, inline_arrays } kind = Kind::seed;
  std::uint64_t seed = 0;
  int first_layer = 0;  // seed: layer 0 is this layer of a deeper model (a layer group, layer_groups.h)
  std::string q_path, k_path, v_path;  // npy: resolved paths
  std::vector<float> q, k, v;          // inline: flattened [L, U, H|Hkv, D]
};

// SPEC 8: the caches keep keys and values in a pool of blocks with a table per row.
struct Paging {
  std::int64_t block_size = 0;
  std::int64_t num_blocks = 0;  // per layer
  bool prefix_cache = false;    // blocks of rows that ended stay reusable until evicted
  bool token_reuse = false;     // reuse "token" (SGLang's radix tree): any run of equal tokens, a partly
                                // matching block copied; else "full" (vLLM): whole blocks shared
};

// Where a token's vectors come from (SPEC 8.1): its uid, or its context key (the chain of
// token ids and the row's extras), so equal prefixes get equal vectors.
enum class Content { uid, prefix };

struct Scenario {
  std::string file;  // where it came from ("" for generated ones)
  std::string name;
  std::string description;
  std::string source_json;  // the scenario as written, echoed into manifests
  Dims dims;
  std::vector<Rope> ropes;  // one per layer (SPEC 10.1: `rope` as a list; Rope::nope for a NoPE layer)
  Attention attention;                  // learned sink logits (SPEC 7)
  KvDtype kv_dtype = KvDtype::float32;  // the caches' storage (SPEC 7)
  // Quantized storage (SPEC 9), one per layer; empty: nothing is quantized. The layers' "k"
  // and "v" may differ when `kv_quant` was a list (vLLM's per-layer k_scale, mixed-precision
  // layers; absent: that tensor kept in kv_dtype); their residual, flush, read, transform and
  // query rules do not (the parser refuses it): quant_rules() reads those.
  std::vector<KvQuant> quants;
  std::vector<Policy> policies;         // one per layer (SPEC 7: `policy` as a list: Gemma- and gpt-oss-style hybrids)
  std::optional<double> scale;          // softmax scale; 1/sqrt(D) when absent
  InputSource inputs;
  std::optional<Paging> paging;
  Content content = Content::uid;
  // Per uid: the token id and the context key (SPEC 8.1); filled for every scenario (with
  // content "uid" the id is the uid and the key names the uid alone).
  std::vector<std::uint64_t> token_ids, context_keys;
  std::vector<Step> steps;
  Tolerance tolerance;
  bool tolerance_given = false;  // the scenario set it: used as it is, not derived

  double softmax_scale() const;
  const Policy& policy(int layer) const { return policies.at(static_cast<std::size_t>(layer)); }
  // The policy every layer follows; nullptr when the layers' differ (a hybrid).
  const Policy* shared_policy() const;
  // The layers follow different policies.
  bool hybrid() const { return shared_policy() == nullptr; }
  const Rope& rope(int layer) const { return ropes.at(static_cast<std::size_t>(layer)); }
  // The rope every layer rotates with; nullptr when the layers' differ (SPEC 10.1).
  const Rope* shared_rope() const;
  // Every layer follows one policy, of this kind.
  // A step prunes rows (SPEC 11); `rerotated`: one that re-rotates the kept keys.
  bool prunes(bool rerotated = false) const {
    return std::any_of(steps.begin(), steps.end(),
                       [&](const Step& step) { return step.op == StepOp::prune && (!rerotated || step.rerotate); });
  }
  // A step prunes to tokens the cache chooses (SPEC 11.1).
  bool prunes_observed() const {
    return std::any_of(steps.begin(), steps.end(),
                       [](const Step& step) { return step.op == StepOp::prune && step.prune_keep > 0; });
  }
  bool every_layer(PolicyKind kind) const {
    const Policy* p = shared_policy();
    return p && p->kind == kind;
  }
  bool quantized() const { return !quants.empty(); }
  // Layer `layer`'s quantized storage (quantized() must hold).
  const KvQuant& quant(int layer) const { return quants.at(static_cast<std::size_t>(layer)); }
  // The rules every layer shares: residual, flush, chunk reads, transform, query (not k, v).
  const KvQuant& quant_rules() const { return quants.at(0); }
  // Some layers quantize differently from others.
  bool mixed_quant() const;
  // Some layer's quantized storage satisfies `pred` (false when nothing is quantized).
  template <class Pred>
  bool any_layer_quant(Pred pred) const {
    return std::any_of(quants.begin(), quants.end(), pred);
  }
  // Something is quantized and every layer's storage satisfies `pred`.
  template <class Pred>
  bool every_layer_quant(Pred pred) const {
    return quantized() && std::all_of(quants.begin(), quants.end(), pred);
  }
  // Sets every layer's quantized storage to q.
  void quantize_every_layer(const KvQuant& q) { quants.assign(static_cast<std::size_t>(dims.layers), q); }
};

// Some layer's scales are frozen at a row's first append (SPEC 9's "first_append").
inline bool any_frozen_scales(const Scenario& s) {
  return s.any_layer_quant([](const KvQuant& q) { return frozen_scales(q); });
}

// Some layer quantizes its keys.
inline bool quantizes_keys(const Scenario& s) {
  return s.any_layer_quant([](const KvQuant& q) { return q.k.has_value(); });
}

// Some layer stores K or V with a float bias per group (MLX's affine groups, SPEC 9.7;
// quanto's, 9.8): the reference and exports follow them; kvcheck's caches do not yet.
inline bool stores_biased_groups(const Scenario& s) {
  return s.any_layer_quant([](const KvQuant& q) { return (q.k && has_biases(q.k->format)) || (q.v && has_biases(q.v->format)); });
}

// Number of uids the scenario's steps create, and the batch size each step sees.
std::int64_t count_uids(const Scenario& scenario);
// The largest token count any row reaches (a static cache's capacity).
std::int64_t longest_row(const Scenario& scenario);

// Each row's token count after `step`, from the counts before it.
void advance_lengths(const Step& step, std::vector<std::int64_t>& lengths);

// The most blocks (of `block_size` tokens, per layer) the rows hold at once in any append,
// counted without sharing: a pool this large never runs out (SPEC 8).
struct PoolNeed {
  std::int64_t blocks = 0;
  int source_index = 0;  // the step that needs them
};
PoolNeed largest_pool_need(const Scenario& scenario, std::int64_t block_size);

// What a scenario costs the reference, estimated from its steps before anything runs:
// the memory the run keeps and the multiply-adds of its attention.
struct ScenarioCost {
  double bytes = 0;            // `run`, which checks step by step, with one cache under test
  double cache_bytes = 0;      // of which each cache under test (its largest step)
  double whole_run_bytes = 0;  // commands that keep every step (export, goldens, diagnose, verify)
  double multiply_adds = 0;
  std::string breakdown, whole_run_breakdown;  // "inputs 1.2 GB, the largest step ..."
};
ScenarioCost estimate_cost(const Scenario& scenario);
// The same for layers [first, first + count) alone, as a scenario of their own would cost.
ScenarioCost estimate_layers_cost(const Scenario& scenario, int first, int count);
// InputError when keeping every step of the scenario would pass the memory budget.
void require_whole_run_fits(const Scenario& scenario);

// The raw q, k and v values `layers` layers of the scenario hold (kvcheck accepts up to 1e9).
double input_values(const Scenario& scenario, int layers);

// The memory kvcheck allows one scenario's reference run (the machine has 24 GB).
constexpr double kMemoryBudget = 8e9;

// `run --kv-quant`: the scenario's caches store K and V in `format`, with the format's
// default scale (scenario files' defaults). Returns why it cannot (ggml's formats need a
// head_dim that is a multiple of 32), or an empty string.
std::string quantize_scenario(Scenario& scenario, QuantFormat format);
// "q8_0" -> QuantFormat::q8_0; nullopt for an unknown name.
std::optional<QuantFormat> quant_format_named(const std::string& name);

// Parses and validates. `file` is used in messages and to resolve .npy paths.
Scenario parse_scenario(const std::string& text, const std::string& file);
Scenario load_scenario(const std::string& path);

// Scenario files under a path (a file, or a folder searched for *.json), sorted.
std::vector<std::string> scenario_files(const std::string& path);

const char* to_string(StepOp op);

}  // namespace kvcheck
