#include "tools/harness/check/diagnosis.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace kvcheck {

const char* class_name(BugClass c) {
  switch (c) {
    case BugClass::none:
      return "none";
    case BugClass::refusal_mismatch:
      return "refusal mismatch";
    case BugClass::cache_raised:
      return "the cache raised";
    case BugClass::prompt_kept_whole:
      return "prompt longer than the window kept whole";
    case BugClass::stale_row_after_batch_change:
      return "stale row after batch change";
    case BugClass::reorder_lost_positions:
      return "reorder lost positions";
    case BugClass::stale_slot:
      return "stale slot";
    case BugClass::wrong_rope_layout:
      return "wrong rope layout";
    case BugClass::wrong_rope_theta_or_scaling:
      return "wrong rope theta or scaling";
    case BugClass::rope_table_wraps:
      return "rope table wraps";
    case BugClass::new_key_not_shifted:
      return "new key not shifted";
    case BugClass::key_at_wrong_position:
      return "key at wrong position";
    case BugClass::kept_keys_not_shifted:
      return "kept keys not re-rotated";
    case BugClass::padding_counted:
      return "padding counted as sink or position";
    case BugClass::mask_sees_evicted:
      return "mask sees evicted slots";
    case BugClass::query_position_not_shifted:
      return "query position not shifted";
    case BugClass::sink_count_wrong:
      return "sink count wrong";
    case BugClass::window_off_by_one:
      return "window off by one";
    case BugClass::evicted_wrong_token:
      return "evicted the wrong token";
    case BugClass::dropped_live_token:
      return "dropped a live token";
    case BugClass::dead_token_held:
      return "dead token held under eager eviction";
    case BugClass::trace_incomplete:
      return "trace incomplete";
    case BugClass::shift_one_token_early:
      return "shift one token early";
    case BugClass::positions_wrong:
      return "positions wrong";
    case BugClass::output_mismatch_positions_correct:
      return "output mismatch with positions correct";
    case BugClass::wrong_frequency_map:
      return "rope frequency map wrong";
    case BugClass::wrong_rotary_dim:
      return "rotary dims wrong";
    case BugClass::attention_factor_wrong:
      return "yarn attention factor wrong";
    case BugClass::learned_sinks_dropped:
      return "learned sinks dropped";
    case BugClass::rerotation_drift:
      return "re-rotation drift";
    case BugClass::layer_policy_swapped:
      return "layer given another layer's policy";
    case BugClass::dropped_before_last_use:
      return "token dropped before its last use";
    case BugClass::chunk_sees_future_keys:
      return "chunk sees future keys";
    case BugClass::quant_scale_wrong:
      return "quantization scale wrong";
    case BugClass::quant_codes_wrong:
      return "quantized codes wrong";
    case BugClass::quant_scale_not_applied:
      return "scale not applied";
    case BugClass::quant_dequantization_layout:
      return "dequantization layout";
    case BugClass::quant_key_not_rerotated:
      return "quantized key not re-rotated";
    case BugClass::quant_query_quantized:
      return "query quantized too";
    case BugClass::quant_precision_map:
      return "precision map mismatch";
    case BugClass::quant_store_not_moved:
      return "quantized store not reordered or cropped";
    case BugClass::quant_transform_missing:
      return "transform missing on a path";
    case BugClass::quant_shared_scale:
      return "scale of a shared block not its own";
    case BugClass::paged_slot_mapping_wrong:
      return "slot mapping wrong";
    case BugClass::paged_stale_table_entry:
      return "stale block-table entry";
    case BugClass::paged_block_freed_while_visible:
      return "block freed while visible";
    case BugClass::paged_read_before_write:
      return "read before write";
    case BugClass::paged_shared_block_written:
      return "write to a shared block (copy-on-write missing)";
    case BugClass::paged_refcount_mismatch:
      return "refcount mismatch or use after free";
    case BugClass::paged_hit_across_contexts:
      return "prefix hit across contexts";
    case BugClass::paged_stale_prefix_hit:
      return "stale prefix hit";
    case BugClass::paged_hit_beyond_alignment:
      return "hit beyond block alignment";
    case BugClass::paged_hit_count_wrong:
      return "prefix hit not the expected one";
    case BugClass::tokens_lost_after_preemption:
      return "tokens lost after preemption";
    case BugClass::chunk_misses_past_keys:
      return "chunk misses past keys";
    case BugClass::chunk_positions_wrong:
      return "chunk positions wrong";
    case BugClass::window_kept_in_prefill:
      return "window held through a chunked prefill";
    case BugClass::path_inconsistency:
      return "decode and chunk paths disagree";
  }
  return "?";
}

const char* class_explanation(BugClass c) {
  switch (c) {
    case BugClass::none:
      return "The cache matches the reference.";
    case BugClass::cache_raised:
      return "The cache under test raised an exception (or lacks the operation) at a step the policy accepts: "
             "its own words are above. A shape error on a second chunk usually means an update path written for "
             "one token at a time.";
    case BugClass::prompt_kept_whole:
      return "A chunk longer than the window was kept whole after its forward: the cache stores the prompt "
             "as it comes and trims only when later tokens arrive (Hugging Face SinkCache on a long prompt).";
    case BugClass::refusal_mismatch:
      return "The cache accepted a step its policy must refuse, or refused one it must accept: look at the "
             "crop/rollback path and the test of which tokens are still held.";
    case BugClass::stale_row_after_batch_change:
      return "A slot holds a token of an earlier generation after the batch size changed: the reset reused "
             "rows instead of reallocating or clearing them (Hugging Face SinkCache shipped this).";
    case BugClass::reorder_lost_positions:
      return "After a beam reorder a row's tokens and its bookkeeping (length, offsets, positions) no longer "
             "belong together: the reorder moved the tensors but not every per-row counter.";
    case BugClass::stale_slot:
      return "A slot holds a token that is not in this row's history: look for a missing clear or a wrong "
             "row index when slots are reused.";
    case BugClass::wrong_rope_layout:
      return "Stored keys are rotations under the other pairing (rotate_half vs interleaved): the cache or its "
             "model uses GPT-NeoX pairs where GPT-J pairs are expected, or the reverse.";
    case BugClass::wrong_rope_theta_or_scaling:
      return "Stored keys are rotations under another theta or scaling: the cache re-rotates with a rope "
             "configuration that differs from the model's.";
    case BugClass::rope_table_wraps:
      return "Keys are rotated at their position modulo the window: the cos/sin table was sized to the cache, "
             "not to the longest position, and indexes wrap.";
    case BugClass::new_key_not_shifted:
      return "The newest key is rotated at its absolute position while older keys were re-rotated to cache "
             "positions: the shift re-rotates what is stored but not what comes in (Hugging Face SinkCache).";
    case BugClass::key_at_wrong_position:
      return "A stored key is rotated at another position than its slot claims: look where keys are written "
             "or re-rotated.";
    case BugClass::kept_keys_not_shifted:
      return "Keys kept in the window still sit at their old positions after tokens were evicted: the shift "
             "moves or drops slots but does not re-rotate what it keeps.";
    case BugClass::padding_counted:
      return "Left padding took token indices: sinks and positions are shifted by the padding, so the first "
             "real tokens are not sinks. Look where per-row lengths and position ids are computed.";
    case BugClass::mask_sees_evicted:
      return "The query sees slots that the policy evicted or that hold a duplicate: the mask grows with the "
             "sequence instead of stopping at the cache, or evicted slots are not cleared.";
    case BugClass::query_position_not_shifted:
      return "Queries (and new keys) are rotated at absolute positions in a cache whose keys sit at cache "
             "positions, so positions grow past the cache size (Hugging Face SinkCache's large position ids).";
    case BugClass::sink_count_wrong:
      return "Tokens that must stay as attention sinks were evicted or never kept: the sink count is taken "
             "from the prompt (a prompt shorter than the sinks) or computed off by some tokens.";
    case BugClass::window_off_by_one:
      return "The window holds one key too many or too few: whether the query's own token counts toward W.";
    case BugClass::evicted_wrong_token:
      return "The cache dropped tokens the policy keeps and kept tokens it drops: typically a prompt longer "
             "than the window is trimmed from the wrong end, or eviction runs after the forward.";
    case BugClass::dropped_live_token:
      return "The cache no longer holds a token that the next query still sees: it evicts too early or "
             "too many at once (a token no later query sees may go early; this one may not).";
    case BugClass::trace_incomplete:
      return "The trace leaves out a step that it must show (an append, or a step the policy refuses) without "
             "saying why: what the cache did there is unknown, so the trace cannot pass. A producer that cannot "
             "drive a step writes {\"skipped\": reason} for it.";
    case BugClass::dead_token_held:
      return "The cache is declared to drop, right after each forward, the tokens no later query sees, yet it "
             "still holds one: the eviction runs at the next token instead (or the declaration is wrong).";
    case BugClass::shift_one_token_early:
      return "Kept keys were re-rotated although nothing was evicted: the \"is the cache full\" test fires one "
             "token early (< where <= belongs).";
    case BugClass::positions_wrong:
      return "Relative distances differ from the policy's: look at how query and key positions are derived.";
    case BugClass::wrong_frequency_map:
      return "Stored keys are rotations at the right positions under another frequency map (llama3, yarn, "
             "linear or none): the cache built its cos/sin table from the wrong rope_scaling, e.g. llama3 read as "
             "plain linear scaling, which slows the high frequencies too.";
    case BugClass::wrong_rotary_dim:
      return "Stored keys are rotated over another number of dims than rotary_dim: partial rotary (Phi, "
             "GPT-NeoX, GLM) applied to the whole head, or the frequencies taken over head_dim instead of R.";
    case BugClass::attention_factor_wrong:
      return "Stored keys have the right rotation but the wrong length: yarn's attention factor m multiplies "
             "cos and sin for q and k alike; it is missing on the keys (applied to q only) or applied twice (a "
             "context shift that re-rotates kept keys with the scaled cos and sin multiplies them by m again at "
             "every shift, as llama.cpp's YaRN shift does).";
    case BugClass::layer_policy_swapped:
      return "A layer of a hybrid stack holds exactly what another layer's policy keeps: the cache maps the "
             "per-layer pattern (sliding or full) onto the wrong layers, e.g. off by one in a layer_types or "
             "sliding_window_pattern index.";
    case BugClass::rerotation_drift:
      return "Stored keys sit at their claimed positions but further from an exact rotation than one rounding to "
             "the storage format explains: the cache re-rotates stored keys (in half precision) at every shift, "
             "rounding them again each time, so the error grows with the shifts. Keep keys at their original "
             "rotation and rotate the query instead (sink_ring), or re-rotate from full precision.";
    case BugClass::learned_sinks_dropped:
      return "Positions and visible tokens are right and the outputs equal the attention without the learned "
             "sink logits: the per-head sink (gpt-oss) was left out of the softmax, or confused with sink tokens.";
    case BugClass::dropped_before_last_use:
      return "The step's last query should see a token that no later query needs, and the cache had already "
             "dropped it: holding it no longer after the step is fine, but it went before the forward, not after "
             "it (a buffer that rolls when its last slot is reached instead of when it is passed: transformers "
             "4.46's SlidingWindowCache).";
    case BugClass::paged_slot_mapping_wrong:
      return "A token sits in another slot of the row's blocks than table[t / B] * B + t % B: the slot mapping "
             "was computed from something else than the token index (a rotary position, a window-relative index).";
    case BugClass::paged_stale_table_entry:
      return "A row's block table points at a block that holds none of the row's tokens there: an entry left "
             "from the row's previous occupant after a row move (vLLM tt-plugin's move_row, PR 103), or never reset.";
    case BugClass::paged_block_freed_while_visible:
      return "A block was freed while a token in it was still seen by the row's next query: the window freeing "
             "counts one block too many (vLLM PR 17398; a sliding window frees blocks below floor((n - W + 1) / B) "
             "only), or a sink cache freed the sinks' blocks with the window's.";
    case BugClass::paged_read_before_write:
      return "A query read a slot before its token was written: a row took a block from the prefix index before "
             "the forward that fills it had run (registered at allocation, not after its write: vLLM PR 37152, the "
             "invariant of PR 7822), or a kernel read past the keys written so far. With poisoning on, the NaN in "
             "the output names the block.";
    case BugClass::paged_shared_block_written:
      return "A block that several rows reference was written: a fork or a prefix hit shared a partly filled "
             "block and both rows appended into it, with no copy-on-write (atlas issue 1193).";
    case BugClass::paged_refcount_mismatch:
      return "The refcount the cache reports is not the number of table entries referencing the block: a hit or "
             "fork took no reference, or a free gave one back twice, so the block can be reused while still in a "
             "table (atlas issue 692). With poisoning on, a query that read a freed block gets a NaN naming it.";
    case BugClass::paged_hit_across_contexts:
      return "A prefix hit reused a block whose tokens have the same ids but another context: the prefix key left "
             "out the adapter, the salt or an earlier token, or mixed them untagged (vLLM issues 3264, 30931, 44701).";
    case BugClass::paged_stale_prefix_hit:
      return "A prefix hit reused a block whose index entry outlived its data: an evicted or recycled block kept "
             "its key (TensorRT-LLM issue 8813, llama-server issue 27148).";
    case BugClass::paged_hit_beyond_alignment:
      return "A prefix hit covered a partly filled block or the prompt's last token, which must be computed: hits "
             "are whole blocks up to floor((n - 1) / B) * B tokens.";
    case BugClass::paged_hit_count_wrong:
      return "Every slot is right, but the cache reused another number of tokens from its prefix index than the "
             "scenario's expect_hit: a legitimate hit missed (blocks not registered, or registered under another "
             "key), or an eviction that was not least recently used first.";
    case BugClass::tokens_lost_after_preemption:
      return "After a preempted row resumed, tokens it held before are gone: a recompute rebuilt the prompt only, "
             "not the tokens generated since (vLLM issue 16832; nano-vllm PR 211).";
    case BugClass::chunk_misses_past_keys:
      return "In a chunked prefill a chunk's queries do not see the keys earlier chunks wrote to the cache: the "
             "kernel attends within the chunk only (imp PR 114).";
    case BugClass::chunk_positions_wrong:
      return "In a chunked prefill a later chunk's tokens are rotated at positions that restart or skip: the "
             "position ids were taken per chunk (transformers issue 43082, vLLM PR 10388).";
    case BugClass::window_kept_in_prefill:
      return "Between two forwards of a chunked prefill the row still holds tokens that left its sliding window, "
             "and reads nothing wrong: the layer frees what leaves the window late (once the prefill is done, or "
             "never), so blocks no query reads again stay out of the pool while the prompt runs.";
    case BugClass::quant_transform_missing:
      return "Stored rows that should hold the Hadamard-transformed key or value hold the plain one: read without "
             "the transform they stand for their token within the format's rounding. One path forgot the transform "
             "the others apply, typically one that restores, copies or re-quantizes rows (llama.cpp PR 24367: \"f16 to "
             "q8_0 is broken with attention rotation on\"; unslothai/llama.cpp PR 129).";
    case BugClass::quant_shared_scale:
      return "A row that took a prefix hit reads the shared blocks with its own frozen scale: their codes were "
             "written with their writer's scale (SPEC 9, \"first_append\"), and each stored token must keep the "
             "scale it was written with. A cache that keeps one scale per request, not per block, reads every "
             "reused block wrongly (kvcheck's hypothesis for TensorRT-LLM issue 2699: wrong outputs with an FP8 "
             "KV cache and block reuse).";
    case BugClass::path_inconsistency:
      return "Every slot, code and position is right, but a token computed in a decode step and the same token "
             "computed inside a chunk, over the same stored cache, have outputs further apart than twice the "
             "tolerance (SPEC 9.2.6): the two paths use other kernels, tiles or roundings, and one of them loses "
             "precision (FA3's FP8 decode with tiles of 96 keys: decode and prefill diverge from position 97, vLLM "
             "issue 54035, SGLang issue 25790).";
    case BugClass::quant_query_quantized:
      return "Codes, scales and positions are right, and the outputs equal the attention with the query also "
             "quantized to q8_0 before its dot products with the keys: a convention, not a bug (ggml's CPU matmul "
             "converts the activation to q8_0 K's dot-product type). Declare it with kv_quant \"query\": \"q8_0\".";
    case BugClass::quant_precision_map:
      return "A token is held raw where the residual, flush and prefill rules quantize it, or quantized where they "
             "keep it raw (SPEC 9.2.4): a prefill quantized at once though declared kept in the residual, or the "
             "reverse (transformers issue 35185), a flush at the wrong count, or a residual of the wrong length.";
    case BugClass::quant_store_not_moved:
      return "A reorder or crop moved the raw residual but not the quantized tokens: after it a row holds another "
             "row's quantized tokens, or tokens past the crop (transformers PRs 45510 and 48700: QuantizedLayer's "
             "reorder_cache and crop touch the residual buffer only).";
    case BugClass::quant_key_not_rerotated:
      return "Kept keys moved to their new positions but their stored codes are still the old rotation: the "
             "shift skipped the quantized store (llama.cpp's context shift with a quantized K cache, done as "
             "dequantize, rope, quantize only since PR 5653).";
    case BugClass::quant_scale_wrong:
      return "A stored scale is not the one the format's rule gives for the values it covers (SPEC 9.2.1): a scale "
             "computed once and frozen, from another batch, the wrong group, or never loaded from the checkpoint.";
    case BugClass::quant_codes_wrong:
      return "Scales are right but stored codes are not the format's rounding of the values the cache should hold: "
             "wrong rounding, group or axis, a transform missing on a path, or a key quantized at another position "
             "(a shift that skipped the quantized store).";
    case BugClass::quant_scale_not_applied:
      return "Codes and scales are stored right, but the attention read the codes with a scale of 1: the outputs "
             "equal the attention over unscaled codes. Scale plumbing (SGLang's k_scale never reaching the kernel).";
    case BugClass::quant_dequantization_layout:
      return "Codes and scales are stored right, but the attention dequantized them wrongly: nibble order, stride, "
             "or V read with K's scales (ik_llama.cpp's FlashMLA reading V as a view of K).";
    case BugClass::chunk_sees_future_keys:
      return "A token of a multi-token chunk attended the chunk's later tokens: its output equals the attention "
             "over its visible keys plus those. The causal mask inside the chunk is missing, typically a model's "
             "mask comparing slot indices with cache_position over a cache that shifts or rolls (transformers' "
             "Llama mask over SinkCache once the window is full), or a chunked prefill's kernel was given the "
             "whole append's key length and read slots later chunks had not written yet (nano-vllm PR 213).";
    case BugClass::output_mismatch_positions_correct:
      return "Every position and visible token is right but the outputs differ: the attention arithmetic "
             "(scale, softmax, GQA head mapping, value copy) is wrong, or the tolerance is too tight.";
  }
  return "";
}

namespace {

template <class T, class F>
bool any(const std::vector<T>& v, F f) {
  return std::any_of(v.begin(), v.end(), f);
}

// Every mismatching query has exactly one extra key, one below its window start, and
// nothing missing: the window holds W + 1. Or one missing at the start: W - 1.
bool off_by_one(const StepEvidence& e) {
  std::set<std::pair<int, std::int64_t>> extra_at, missing_at;
  for (const PairMismatch& p : e.pairs) {
    const std::pair<int, std::int64_t> q{p.row, p.query_index};
    if (!p.expected && p.actual) {
      if (extra_at.count(q)) return false;
      extra_at.insert(q);
    } else if (p.expected && !p.actual) {
      if (missing_at.count(q)) return false;
      missing_at.insert(q);
    } else {
      return false;
    }
  }
  return !e.pairs.empty() && (extra_at.empty() || missing_at.empty());
}

}  // namespace

// The paged issue that explains the others: a write where the table does not point, a
// wrong hit or a shared write makes every later slot look wrong, so it is named first.
static BugClass paged_class(const std::vector<PagedIssue>& issues) {
  using K = PagedIssue::Kind;
  const std::pair<K, BugClass> order[] = {
      {K::mapping_table, BugClass::paged_slot_mapping_wrong},
      {K::unwritten_hit, BugClass::paged_read_before_write},
      {K::hit_across, BugClass::paged_hit_across_contexts},
      {K::hit_unaligned, BugClass::paged_hit_beyond_alignment},
      {K::hit_stale, BugClass::paged_stale_prefix_hit},
      {K::shared_write, BugClass::paged_shared_block_written},
      {K::refcount, BugClass::paged_refcount_mismatch},
      {K::freed_visible, BugClass::paged_block_freed_while_visible},
      // A live token missing from its own slot went elsewhere: the other row's slot it
      // landed in looks stale, but the write is the cause.
      {K::slot_mapping, BugClass::paged_slot_mapping_wrong},
      {K::stale_entry, BugClass::paged_stale_table_entry},
      {K::hit_expected, BugClass::paged_hit_count_wrong},
  };
  for (const auto& [kind, bug] : order)
    if (any(issues, [kind](const PagedIssue& i) { return i.kind == kind; })) return bug;
  return BugClass::paged_stale_table_entry;
}

BugClass classify(const Scenario& s, const StepEvidence& e, const StepContext& ctx) {
  using K = SlotIssue::Kind;
  if (e.empty()) return BugClass::none;
  if (e.raised) return BugClass::cache_raised;
  if (e.unrecorded) return BugClass::trace_incomplete;
  if (!e.refusal.empty()) return BugClass::refusal_mismatch;
  if (e.layer_holds_policy_of) return BugClass::layer_policy_swapped;
  if (e.step < s.steps.size() && s.steps[e.step].op == StepOp::resume &&
      any(e.slots, [](const SlotIssue& i) { return i.kind == K::lost; }))
    return BugClass::tokens_lost_after_preemption;
  if (!e.paged.empty()) return paged_class(e.paged);
  // Between forwards, only tokens behind the window held, and every read right.
  if (e.between_forwards && e.pairs.empty() && e.outputs.empty() && !e.slots.empty() &&
      std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) { return i.kind == K::extra && i.window_gap > 0; }))
    return BugClass::window_kept_in_prefill;
  // Codes that fit the token only without the transform: every key read back is garbage
  // through it (rotations, outputs), and this is why.
  if (e.codes_fit_without_transform) return BugClass::quant_transform_missing;
  const bool shifted_policy = s.policy.kind == PolicyKind::sink && s.policy.positions == SinkPositions::cache &&
                              s.policy.prefill == Prefill::streaming;
  // Distances off for sinks only, by E: the query was not moved back with the window, in a
  // chunk or not.
  const bool sinks_only_by_e =
      shifted_policy && any(e.pairs, [](const PairMismatch& p) { return p.expected && p.actual; }) &&
      std::all_of(e.pairs.begin(), e.pairs.end(), [&](const PairMismatch& p) {
        return p.expected && p.actual && p.key_index < s.policy.sinks && *p.actual - *p.expected == p.evicted_before;
      });
  // A chunked append (SPEC 8.7): a query that saw a later key, keys at other positions than
  // the reference's, or queries that missed keys of the append and nothing else.
  const bool chunked = e.step < s.steps.size() && s.steps[e.step].chunk > 0;
  if (chunked) {
    if (any(e.pairs, [](const PairMismatch& p) { return !p.expected && p.actual && p.key_index > p.query_index; }))
      return BugClass::chunk_sees_future_keys;
    if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::rotation; }) ||
        (!sinks_only_by_e &&
         any(e.pairs, [](const PairMismatch& p) { return p.expected && p.actual && *p.expected != *p.actual; })))
      return BugClass::chunk_positions_wrong;
    if (e.slots.empty() && !e.pairs.empty() &&
        std::all_of(e.pairs.begin(), e.pairs.end(), [](const PairMismatch& p) { return p.expected && !p.actual; }))
      return BugClass::chunk_misses_past_keys;
  }
  // A poison NaN in an output (SPEC 8.8.5): the query read a block no token was written to,
  // or one that was freed, whatever the log says.
  if (e.poisoned) return e.poisoned->freed ? BugClass::paged_refcount_mismatch : BugClass::paged_read_before_write;
  if (e.wrong_row_count)
    return ctx.last_row_change == StepContext::RowChange::reorder ? BugClass::reorder_lost_positions
                                                                  : BugClass::stale_row_after_batch_change;
  if (any(e.slots, [](const SlotIssue& i) { return i.dead; }) &&
      std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) { return i.dead; }))
    return BugClass::dead_token_held;

  const bool stale = any(e.slots, [](const SlotIssue& i) { return i.kind == K::stale; }) ||
                     any(e.pairs, [](const PairMismatch& p) { return p.key_index < 0; });
  // Under a residual, only quantized slots hold what is not the row's: the raw residual
  // moved with the reorder or crop, the quantized store did not.
  const auto stale_slot = [](const SlotIssue& i) { return i.kind == K::stale; };
  if (stale && s.kv_quant && s.kv_quant->holds_raw() && any(e.slots, stale_slot) &&
      std::all_of(e.slots.begin(), e.slots.end(), [&](const SlotIssue& i) { return !stale_slot(i) || i.quantized; }))
    return BugClass::quant_store_not_moved;
  if (stale) {
    if (ctx.last_row_change == StepContext::RowChange::reset_new_batch) return BugClass::stale_row_after_batch_change;
    if (ctx.last_row_change == StepContext::RowChange::reorder) return BugClass::reorder_lost_positions;
    return BugClass::stale_slot;
  }

  // A long chunk kept whole: every extra token came in this step's chunk, nothing lost.
  if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::extra; }) &&
      std::all_of(e.slots.begin(), e.slots.end(),
                  [](const SlotIssue& i) { return i.kind == K::rotation || (i.kind == K::extra && i.in_chunk); }) &&
      e.chunk_kept_whole)
    return BugClass::prompt_kept_whole;

  // A token the next query still sees is gone, and nothing is held in its place: the
  // root cause, whatever the cache then did to the positions of what it kept.
  const bool lost_window_token = any(e.slots, [&](const SlotIssue& i) {
    return i.kind == K::lost && (s.policy.kind != PolicyKind::sink || i.true_index >= s.policy.sinks);
  });
  if (lost_window_token && !any(e.slots, [](const SlotIssue& i) {
        return i.kind == K::extra || i.kind == K::duplicated || (i.kind == K::lost && i.true_index < 0);
      }))
    return BugClass::dropped_live_token;

  // What the tensors say about rotations.
  for (const SlotIssue& i : e.slots) {
    if (i.kind != K::rotation) continue;
    switch (i.fits.kind) {
      case OtherRope::Kind::none:
        continue;
      case OtherRope::Kind::layout:
        return BugClass::wrong_rope_layout;
      case OtherRope::Kind::frequency_map:
        return BugClass::wrong_frequency_map;
      case OtherRope::Kind::rotary_dim:
        return BugClass::wrong_rotary_dim;
      case OtherRope::Kind::magnitude:
        return BugClass::attention_factor_wrong;
      case OtherRope::Kind::theta:
      case OtherRope::Kind::scaling:
        return BugClass::wrong_rope_theta_or_scaling;
    }
  }
  // Kept window keys moved back by the same amount while the policy has evicted nothing
  // yet: the shift fired before the cache was full.
  {
    std::optional<std::int64_t> shift;
    bool early = e.evicted_before_last == 0 && s.policy.kind == PolicyKind::sink;
    for (const SlotIssue& i : e.slots) {
      if (!early) break;
      if (i.kind != K::rotation) continue;
      early = i.recovered_position && !i.newest && i.true_index >= s.policy.sinks &&
              *i.recovered_position < i.claimed_position &&
              (!shift || *shift == i.claimed_position - *i.recovered_position);
      if (early) shift = i.claimed_position - *i.recovered_position;
    }
    if (early && shift) return BugClass::shift_one_token_early;
  }
  bool new_unshifted = false;
  for (const SlotIssue& i : e.slots) {
    if (i.kind != K::rotation || !i.recovered_position) continue;
    const std::int64_t w = s.policy.window;
    if (w > 0 && i.claimed_position >= w && *i.recovered_position == i.claimed_position % w)
      return BugClass::rope_table_wraps;
    // A key still at its absolute position where a cache position was due: the kept keys
    // were never re-rotated (whatever the newest key did), or only the newest was not.
    if (*i.recovered_position == i.true_index && i.claimed_position < i.true_index) {
      if (!i.newest) return s.kv_quant && s.quant(i.layer).k ? BugClass::quant_key_not_rerotated : BugClass::kept_keys_not_shifted;
      new_unshifted = true;
    }
  }
  if (new_unshifted) return BugClass::new_key_not_shifted;
  // A stored scale that is not its rule's explains every key and output it touches (keys
  // at another position are named above: their scales differ as a consequence).
  // A token held at the wrong precision explains its codes and the outputs over it.
  if (!e.precision.empty()) return BugClass::quant_precision_map;
  if (any(e.codes, [](const CodeMismatch& c) { return c.readers_scale; })) return BugClass::quant_shared_scale;
  if (any(e.codes, [](const CodeMismatch& c) { return c.element < 0; })) return BugClass::quant_scale_wrong;
  // Every bad key is nearest its claim: right positions, too much rounding.
  const bool rotations = any(e.slots, [](const SlotIssue& i) { return i.kind == K::rotation; });
  if (rotations && std::all_of(e.slots.begin(), e.slots.end(),
                               [](const SlotIssue& i) { return i.kind != K::rotation || i.closest_at_claim; }))
    return BugClass::rerotation_drift;
  // After left padding, keys of a padded row all moved forward by one amount (its padding,
  // in positions taken from slot indices or cache_position instead of the mask).
  if (rotations && ctx.padded) {
    std::map<int, std::int64_t> offset;  // per row
    bool forward = true;
    for (const SlotIssue& i : e.slots) {
      if (i.kind != K::rotation) continue;
      const bool padded_row =
          static_cast<std::size_t>(i.row) < ctx.padded_rows.size() && ctx.padded_rows[static_cast<std::size_t>(i.row)];
      const std::int64_t by = i.recovered_position ? *i.recovered_position - i.claimed_position : 0;
      forward = forward && padded_row && by > 0 && offset.emplace(i.row, by).first->second == by;
    }
    if (forward) return BugClass::padding_counted;
  }
  if (rotations) return BugClass::key_at_wrong_position;

  if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::wrong_index; })) {
    if (ctx.last_row_change == StepContext::RowChange::reorder) return BugClass::reorder_lost_positions;
    if (ctx.padded) return BugClass::padding_counted;
    return BugClass::positions_wrong;
  }
  if (any(e.slots, [](const SlotIssue& i) { return i.kind == K::duplicated; })) return BugClass::mask_sees_evicted;

  // Cache positions never reach W; a query at W or beyond was rotated at its absolute position.
  if (shifted_policy &&
      any(e.pairs, [&](const PairMismatch& p) { return p.query_position && *p.query_position >= s.policy.window; }))
    return BugClass::query_position_not_shifted;
  // Window keys too far back, the query's own key among them: new keys kept their
  // absolute positions while the query moved with the window.
  const bool new_keys_behind =
      shifted_policy && !e.pairs.empty() &&
      std::all_of(e.pairs.begin(), e.pairs.end(),
                  [&](const PairMismatch& p) {
                    return p.expected && p.actual && p.key_index >= s.policy.sinks && *p.actual < *p.expected;
                  }) &&
      any(e.pairs, [](const PairMismatch& p) { return p.key_index == p.query_index; });
  if (new_keys_behind) return BugClass::new_key_not_shifted;
  if (sinks_only_by_e) return BugClass::query_position_not_shifted;

  const bool sink_missing = s.policy.kind == PolicyKind::sink && any(e.pairs, [&](const PairMismatch& p) {
                              return p.expected && !p.actual && p.key_index < s.policy.sinks;
                            });
  if (sink_missing) return BugClass::sink_count_wrong;
  if (off_by_one(e)) return BugClass::window_off_by_one;

  const bool lost = any(e.slots, [](const SlotIssue& i) { return i.kind == K::lost; });
  const bool extra = any(e.slots, [](const SlotIssue& i) { return i.kind == K::extra; });
  // Nothing lost, and every extra token the one just before the window: W + 1 kept.
  if (extra && !lost && std::all_of(e.slots.begin(), e.slots.end(), [](const SlotIssue& i) {
        return i.kind != K::extra || i.window_gap == 1;
      }))
    return BugClass::window_off_by_one;
  if ((lost && extra) || any(e.pairs, [](const PairMismatch& p) { return !p.expected && p.actual; })) {
    // Extra visible tokens with nothing held twice: the wrong ones were kept.
    return lost || extra ? BugClass::evicted_wrong_token : BugClass::mask_sees_evicted;
  }

  // Distances off by one for old window keys, while nothing was evicted.
  const bool early = !e.pairs.empty() && std::all_of(e.pairs.begin(), e.pairs.end(), [](const PairMismatch& p) {
    return p.expected && p.actual && *p.actual - *p.expected == 1 && p.evicted_before == 0;
  });
  if (early) return BugClass::shift_one_token_early;
  if (!e.pairs.empty() || e.query_unreadable) return BugClass::positions_wrong;
  if (lost || extra) return BugClass::evicted_wrong_token;
  if (!e.codes.empty())
    return any(e.codes, [](const CodeMismatch& c) { return c.element < 0; }) ? BugClass::quant_scale_wrong
                                                                             : BugClass::quant_codes_wrong;
  if (e.outputs_fit_unit_scale) return BugClass::quant_scale_not_applied;
  if (e.outputs_fit_quantized_query) return BugClass::quant_query_quantized;
  // Outputs wrong on one path only, where the other path computed the same token over the
  // same stored cache within tolerance: the paths disagree, whatever the storage.
  if (!e.paths.empty() && e.slots.empty() && e.pairs.empty()) return BugClass::path_inconsistency;
  if (s.kv_quant && !e.outputs.empty() && e.slots.empty() && e.pairs.empty())
    return BugClass::quant_dequantization_layout;
  if (e.outputs_fit_without_learned_sinks) return BugClass::learned_sinks_dropped;
  if (e.outputs_fit_with_later_chunk_keys) return BugClass::chunk_sees_future_keys;
  if (!e.outputs.empty() && e.dropped_before_last_use) return BugClass::dropped_before_last_use;
  return BugClass::output_mismatch_positions_correct;
}

}  // namespace kvcheck

namespace kvcheck {

Drift summarize_drift(std::vector<Drift::Point> points) {
  Drift d;
  d.points = std::move(points);
  if (d.points.size() < 2) return d;
  const auto& p = d.points;
  auto all = [&](auto f) { return std::all_of(p.begin(), p.end(), f); };
  // Growing: the error never shrinks, and grows by exactly one at three steps in four or
  // more (a step that evicts the worst key may hold it still).
  bool growing = true;
  std::size_t ones = 0;
  for (std::size_t i = 1; i < p.size(); ++i) {
    const std::int64_t step = std::abs(p[i].error) - std::abs(p[i - 1].error);
    growing = growing && (step == 0 || step == 1);
    ones += step == 1;
  }
  growing = growing && 4 * ones >= 3 * (p.size() - 1);
  if (p.front().error != 0 && all([&](const Drift::Point& x) { return x.error == p.front().error; }))
    d.shape = Drift::Shape::constant;
  else if (growing)
    d.shape = Drift::Shape::growing_by_one;
  else if (any(p, [](const Drift::Point& x) { return x.error != 0; }) &&
           all([](const Drift::Point& x) { return x.error == 0 || x.evicted; }))
    d.shape = Drift::Shape::only_at_evictions;
  else
    d.shape = Drift::Shape::varies;
  return d;
}

std::string poison_text(const PoisonedRead& read) {
  return fmt::format("a poison NaN: block {} (epoch {}), {}", read.block, read.epoch,
                     read.freed ? "freed" : "never written");
}

std::string Drift::to_string() const {
  if (points.empty() && !rotation_errors.empty()) {
    const auto& [first_step, first_error] = rotation_errors.front();
    const auto& [last_step, last_error] = rotation_errors.back();
    const auto middle = rotation_errors[rotation_errors.size() / 2];
    const std::string seen = fmt::format("{:.3g} at step {}, {:.3g} at step {}, {:.3g} at step {}", first_error,
                                         first_step, middle.second, middle.first, last_error, last_step);
    if (last_error > 2 * first_error)
      return first_error > 0
                 ? fmt::format("positions stay exact while the largest rotation error of a stored key grows "
                               "{:.1f}-fold over {} steps: {}",
                               last_error / first_error, rotation_errors.size(), seen)
                 : fmt::format("positions stay exact while the largest rotation error of a stored key grows from 0 "
                               "over {} steps: {}",
                               rotation_errors.size(), seen);
    return "positions stay exact and the largest rotation error of a stored key does not grow: " + seen;
  }
  std::string seen;
  for (std::size_t i = 0; i < points.size() && i < 8; ++i)
    seen += fmt::format("{}{:+d} at step {}", i ? ", " : "", points[i].error, points[i].step);
  if (points.size() > 8) seen += fmt::format(", ... ({} steps)", points.size());
  switch (shape) {
    case Shape::none:
      return points.empty() ? "" : "seen at one step only: " + seen;
    case Shape::constant:
      return fmt::format("the error stays at {:+d} over the following steps: {}", points.front().error, seen);
    case Shape::growing_by_one:
      return "the error grows by about one per step: " + seen;
    case Shape::only_at_evictions:
      return "the error appears only at steps that evict: " + seen;
    case Shape::varies:
      return "the error varies: " + seen;
  }
  return seen;
}

}  // namespace kvcheck
