// The classes of bug a diagnosis names, in one table: each class's id (BugClass, in
// diagnosis.h), its name (the report's "class:" line; class_id() derives the JSON id from
// it) and one explanation of what it means and where such bugs usually hide.
//
// Recipe, a new class: one enumerator at the end of BugClass, one row at the end of this
// table (the static_assert below keeps the two in step), and a rule in classify()
// (diagnosis.cpp) with a test on hand-made evidence in tests/test_diagnosis.cpp.
#include <cstddef>
#include <iterator>

#include "tools/harness/check/diagnosis.h"

namespace kvcheck {

namespace {

struct BugClassRow {
  BugClass id;
  const char* name;
  const char* explanation;
};

constexpr BugClassRow kBugClasses[] = {
    {BugClass::none, "none",
     "The cache matches the reference."},
    {BugClass::refusal_mismatch, "refusal mismatch",
     "The cache accepted a step its policy must refuse, or refused one it must accept: look at the "
     "crop/rollback path and the test of which tokens are still held."},
    {BugClass::cache_raised, "the cache raised",
     "The cache under test raised an exception (or lacks the operation) at a step the policy accepts: "
     "its own words are above. A shape error on a second chunk usually means an update path written for "
     "one token at a time."},
    {BugClass::prompt_kept_whole, "prompt longer than the window kept whole",
     "A chunk longer than the window was kept whole after its forward: the cache stores the prompt "
     "as it comes and trims only when later tokens arrive (Hugging Face SinkCache on a long prompt)."},
    {BugClass::stale_row_after_batch_change, "stale row after batch change",
     "A slot holds a token of an earlier generation after the batch size changed: the reset reused "
     "rows instead of reallocating or clearing them (Hugging Face SinkCache shipped this)."},
    {BugClass::reorder_lost_positions, "reorder lost positions",
     "After a beam reorder a row's tokens and its bookkeeping (length, offsets, positions) no longer "
     "belong together: the reorder moved the tensors but not every per-row counter."},
    {BugClass::stale_slot, "stale slot",
     "A slot holds a token that is not in this row's history: look for a missing clear or a wrong "
     "row index when slots are reused."},
    {BugClass::wrong_rope_layout, "wrong rope layout",
     "Stored keys are rotations under the other pairing (rotate_half vs interleaved): the cache or its "
     "model uses GPT-NeoX pairs where GPT-J pairs are expected, or the reverse."},
    {BugClass::wrong_rope_theta_or_scaling, "wrong rope theta or scaling",
     "Stored keys are rotations under another theta or scaling: the cache re-rotates with a rope "
     "configuration that differs from the model's."},
    {BugClass::rope_table_wraps, "rope table wraps",
     "Keys are rotated at their position modulo the window: the cos/sin table was sized to the cache, "
     "not to the longest position, and indexes wrap."},
    {BugClass::new_key_not_shifted, "new key not shifted",
     "The newest key is rotated at its absolute position while older keys were re-rotated to cache "
     "positions: the shift re-rotates what is stored but not what comes in (Hugging Face SinkCache)."},
    {BugClass::key_at_wrong_position, "key at wrong position",
     "A stored key is rotated at another position than its slot claims: look where keys are written "
     "or re-rotated."},
    {BugClass::kept_keys_not_shifted, "kept keys not re-rotated",
     "Keys kept in the window still sit at their old positions after tokens were evicted: the shift "
     "moves or drops slots but does not re-rotate what it keeps."},
    {BugClass::padding_counted, "padding counted as sink or position",
     "Left padding took token indices: sinks and positions are shifted by the padding, so the first "
     "real tokens are not sinks. Look where per-row lengths and position ids are computed."},
    {BugClass::mask_sees_evicted, "mask sees evicted slots",
     "The query sees slots that the policy evicted or that hold a duplicate: the mask grows with the "
     "sequence instead of stopping at the cache, or evicted slots are not cleared."},
    {BugClass::query_position_not_shifted, "query position not shifted",
     "Queries (and new keys) are rotated at absolute positions in a cache whose keys sit at cache "
     "positions, so positions grow past the cache size (Hugging Face SinkCache's large position ids)."},
    {BugClass::sink_count_wrong, "sink count wrong",
     "Tokens that must stay as attention sinks were evicted or never kept: the sink count is taken "
     "from the prompt (a prompt shorter than the sinks) or computed off by some tokens."},
    {BugClass::window_off_by_one, "window off by one",
     "The window holds one key too many or too few: whether the query's own token counts toward W."},
    {BugClass::evicted_wrong_token, "evicted the wrong token",
     "The cache dropped tokens the policy keeps and kept tokens it drops: typically a prompt longer "
     "than the window is trimmed from the wrong end, or eviction runs after the forward."},
    {BugClass::dropped_live_token, "dropped a live token",
     "The cache no longer holds a token that the next query still sees: it evicts too early or "
     "too many at once (a token no later query sees may go early; this one may not)."},
    {BugClass::dead_token_held, "dead token held under eager eviction",
     "The cache is declared to drop, right after each forward, the tokens no later query sees, yet it "
     "still holds one: the eviction runs at the next token instead (or the declaration is wrong)."},
    {BugClass::block_eviction_count_wrong, "block eviction count wrong",
     "The cache is declared to evict in blocks (a buffer of C slots dropping C - W + 1 of its oldest tokens "
     "at once, as ONNX Runtime's windowed cache does), and every visible token is right, but it holds more or "
     "fewer of the row's last tokens than such a buffer holds: it evicts at another fill or another number "
     "at once (or the declared capacity is not the cache's)."},
    {BugClass::trace_incomplete, "trace incomplete",
     "The trace leaves out a step that it must show (an append, or a step the policy refuses) without "
     "saying why: what the cache did there is unknown, so the trace cannot pass. A producer that cannot "
     "drive a step writes {\"skipped\": reason} for it."},
    {BugClass::shift_one_token_early, "shift one token early",
     "Kept keys were re-rotated although nothing was evicted: the \"is the cache full\" test fires one "
     "token early (< where <= belongs)."},
    {BugClass::positions_wrong, "positions wrong",
     "Relative distances differ from the policy's: look at how query and key positions are derived."},
    {BugClass::output_mismatch_positions_correct, "output mismatch with positions correct",
     "Every position and visible token is right but the outputs differ: the attention arithmetic "
     "(scale, softmax, GQA head mapping, value copy) is wrong, or the tolerance is too tight."},
    {BugClass::wrong_frequency_map, "rope frequency map wrong",
     "Stored keys are rotations at the right positions under another frequency map (llama3, yarn, "
     "linear or none): the cache built its cos/sin table from the wrong rope_scaling, e.g. llama3 read as "
     "plain linear scaling, which slows the high frequencies too."},
    {BugClass::wrong_rotary_dim, "rotary dims wrong",
     "Stored keys are rotated over another number of dims than rotary_dim: partial rotary (Phi, "
     "GPT-NeoX, GLM) applied to the whole head, or the frequencies taken over head_dim instead of R."},
    {BugClass::attention_factor_wrong, "yarn attention factor wrong",
     "Stored keys have the right rotation but the wrong length: yarn's attention factor m multiplies "
     "cos and sin for q and k alike; it is missing on the keys (applied to q only) or applied twice (a "
     "context shift that re-rotates kept keys with the scaled cos and sin multiplies them by m again at "
     "every shift, as llama.cpp's YaRN shift does)."},
    {BugClass::learned_sinks_dropped, "learned sinks dropped",
     "Positions and visible tokens are right and the outputs equal the attention without the learned "
     "sink logits: the per-head sink (gpt-oss) was left out of the softmax, or confused with sink tokens."},
    {BugClass::zero_sink_added, "softmax with an extra 1",
     "Positions and visible tokens are right and the outputs equal the attention with a sink of logit 0 in "
     "every head, which the model does not have: 1 was added to every softmax's denominator (ONNX Runtime's "
     "GroupQueryAttention with smooth_softmax=1, or a learned-sink kernel given zeros for a model without "
     "sinks)."},
    {BugClass::rerotation_drift, "re-rotation drift",
     "Stored keys sit at their claimed positions but further from an exact rotation than one rounding to "
     "the storage format explains: the cache re-rotates stored keys (in half precision) at every shift, "
     "rounding them again each time, so the error grows with the shifts. Keep keys at their original "
     "rotation and rotate the query instead (sink_ring), or re-rotate from full precision."},
    {BugClass::layer_policy_swapped, "layer given another layer's policy",
     "A layer of a hybrid stack holds exactly what another layer's policy keeps: the cache maps the "
     "per-layer pattern (sliding or full) onto the wrong layers, e.g. off by one in a layer_types or "
     "sliding_window_pattern index."},
    {BugClass::dropped_before_last_use, "token dropped before its last use",
     "The step's last query should see a token that no later query needs, and the cache had already "
     "dropped it: holding it no longer after the step is fine, but it went before the forward, not after "
     "it (a buffer that rolls when its last slot is reached instead of when it is passed: transformers "
     "4.46's SlidingWindowCache)."},
    {BugClass::chunk_sees_future_keys, "chunk sees future keys",
     "A token of a multi-token chunk attended the chunk's later tokens: its output equals the attention "
     "over its visible keys plus those. The causal mask inside the chunk is missing, typically a model's "
     "mask comparing slot indices with cache_position over a cache that shifts or rolls (transformers' "
     "Llama mask over SinkCache once the window is full), or a chunked prefill's kernel was given the "
     "whole append's key length and read slots later chunks had not written yet (nano-vllm PR 213)."},
    {BugClass::sinks_masked_out, "sinks masked out",
     "The cache holds the sink tokens at their positions, but the query attended a plain causal window "
     "of W tokens ending at itself: the mask forgot the sinks. Typically a chunk's mask built as a "
     "sliding window of the cache's size while single-token decodes see the sinks (mlx-lm's "
     "RotatingKVCache.make_mask with keep > 0)."},
    {BugClass::quant_scale_wrong, "quantization scale wrong",
     "A stored scale (or zero point, or bias) is not the one the format's rule gives for the values it covers "
     "(SPEC 9.2.1): a scale computed once and frozen, from another batch, the wrong group, stored in a narrower "
     "type, or never loaded from the checkpoint."},
    {BugClass::quant_codes_wrong, "quantized codes wrong",
     "Scales are right but stored codes are not the format's rounding of the values the cache should hold: "
     "wrong rounding, group or axis, a transform missing on a path, or a key quantized at another position "
     "(a shift that skipped the quantized store)."},
    {BugClass::quant_scale_not_applied, "scale not applied",
     "Codes and scales are stored right, but the attention read the codes with a scale of 1: the outputs "
     "equal the attention over unscaled codes. Scale plumbing (SGLang's k_scale never reaching the kernel)."},
    {BugClass::quant_dequantization_layout, "dequantization layout",
     "Codes and scales are stored right, but the attention dequantized them wrongly: nibble order, stride, "
     "or V read with K's scales (ik_llama.cpp's FlashMLA reading V as a view of K). In a trace whose slots "
     "decode to no token's values, the same mistake may sit in how the codes were unpacked for the trace."},
    {BugClass::quant_key_not_rerotated, "quantized key not re-rotated",
     "Kept keys moved to their new positions but their stored codes are still the old rotation: the "
     "shift skipped the quantized store (llama.cpp's context shift with a quantized K cache, done as "
     "dequantize, rope, quantize only since PR 5653)."},
    {BugClass::quant_query_quantized, "query quantized too",
     "Codes, scales and positions are right, and the outputs equal the attention with the query also "
     "quantized to q8_0 before its dot products with the keys: a convention, not a bug (ggml's CPU matmul "
     "converts the activation to q8_0 K's dot-product type). Declare it with kv_quant \"query\": \"q8_0\"."},
    {BugClass::quant_precision_map, "precision map mismatch",
     "A token is held raw where the residual, flush and prefill rules quantize it, or quantized where they "
     "keep it raw (SPEC 9.2.4): a prefill quantized at once though declared kept in the residual, or the "
     "reverse (transformers issue 35185), a flush at the wrong count, or a residual of the wrong length."},
    {BugClass::quant_store_not_moved, "quantized store not reordered or cropped",
     "A reorder or crop moved the raw residual but not the quantized tokens: after it a row holds another "
     "row's quantized tokens, or tokens past the crop (transformers PRs 45510 and 48700: QuantizedLayer's "
     "reorder_cache and crop touch the residual buffer only)."},
    {BugClass::quant_transform_missing, "transform missing on a path",
     "Stored rows that should hold the Hadamard-transformed key or value hold the plain one: read without "
     "the transform they stand for their token within the format's rounding. One path forgot the transform "
     "the others apply, typically one that restores, copies or re-quantizes rows (llama.cpp PR 24367: \"f16 to "
     "q8_0 is broken with attention rotation on\"; unslothai/llama.cpp PR 129)."},
    {BugClass::quant_shared_scale, "scale of a shared block not its own",
     "A row that took a prefix hit reads the shared blocks with its own frozen scale: their codes were "
     "written with their writer's scale (SPEC 9, \"first_append\"), and each stored token must keep the "
     "scale it was written with. A cache that keeps one scale per request, not per block, reads every "
     "reused block wrongly (kvcheck's hypothesis for TensorRT-LLM issue 2699: wrong outputs with an FP8 "
     "KV cache and block reuse)."},
    {BugClass::paged_slot_mapping_wrong, "slot mapping wrong",
     "A token sits in another slot of the row's blocks than table[t / B] * B + t % B: the slot mapping "
     "was computed from something else than the token index (a rotary position, a window-relative index)."},
    {BugClass::paged_stale_table_entry, "stale block-table entry",
     "A row's block table points at a block that holds none of the row's tokens there: an entry left "
     "from the row's previous occupant after a row move (vLLM tt-plugin's move_row, PR 103), or never reset."},
    {BugClass::paged_block_freed_while_visible, "block freed while visible",
     "A block was freed while a token in it was still seen by the row's next query: the window freeing "
     "counts one block too many (vLLM PR 17398; a sliding window frees blocks below floor((n - W + 1) / B) "
     "only), or a sink cache freed the sinks' blocks with the window's."},
    {BugClass::paged_read_before_write, "read before write",
     "A query read a slot before its token was written: a row took a block from the prefix index before "
     "the forward that fills it had run (registered at allocation, not after its write: vLLM PR 37152, the "
     "invariant of PR 7822), or a kernel read past the keys written so far. With poisoning on, the NaN in "
     "the output names the block."},
    {BugClass::paged_shared_block_written, "write to a shared block (copy-on-write missing)",
     "A block that several rows reference was written: a fork or a prefix hit shared a partly filled "
     "block and both rows appended into it, with no copy-on-write (atlas issue 1193)."},
    {BugClass::paged_refcount_mismatch, "refcount mismatch or use after free",
     "The refcount the cache reports is not the number of table entries referencing the block: a hit or "
     "fork took no reference, or a free gave one back twice, so the block can be reused while still in a "
     "table (atlas issue 692). With poisoning on, a query that read a freed block gets a NaN naming it."},
    {BugClass::paged_hit_across_contexts, "prefix hit across contexts",
     "A prefix hit reused a block whose tokens have the same ids but another context: the prefix key left "
     "out the adapter, the salt or an earlier token, or mixed them untagged (vLLM issues 3264, 30931, 44701)."},
    {BugClass::paged_stale_prefix_hit, "stale prefix hit",
     "A prefix hit reused a block whose index entry outlived its data: an evicted or recycled block kept "
     "its key (TensorRT-LLM issue 8813, llama-server issue 27148)."},
    {BugClass::paged_hit_beyond_alignment, "hit beyond block alignment",
     "A prefix hit covered a partly filled block or the prompt's last token, which must be computed: hits "
     "are whole blocks up to floor((n - 1) / B) * B tokens."},
    {BugClass::paged_hit_count_wrong, "prefix hit not the expected one",
     "Every slot is right, but the cache reused another number of tokens from its prefix index than the "
     "scenario's expect_hit: a legitimate hit missed (blocks not registered, or registered under another "
     "key), or an eviction that was not least recently used first."},
    {BugClass::chunk_misses_past_keys, "chunk misses past keys",
     "In a chunked prefill a chunk's queries do not see the keys earlier chunks wrote to the cache: the "
     "kernel attends within the chunk only (imp PR 114)."},
    {BugClass::tokens_lost_after_preemption, "tokens lost after preemption",
     "After a preempted row resumed, tokens it held before are gone: a recompute rebuilt the prompt only, "
     "not the tokens generated since (vLLM issue 16832; nano-vllm PR 211)."},
    {BugClass::chunk_positions_wrong, "chunk positions wrong",
     "In a chunked prefill a later chunk's tokens are rotated at positions that restart or skip: the "
     "position ids were taken per chunk (transformers issue 43082, vLLM PR 10388)."},
    {BugClass::window_kept_in_prefill, "window held through a chunked prefill",
     "Between two forwards of a chunked prefill the row still holds tokens that left its sliding window, "
     "and reads nothing wrong: the layer frees what leaves the window late (once the prefill is done, or "
     "never), so blocks no query reads again stay out of the pool while the prompt runs."},
    {BugClass::path_inconsistency, "decode and chunk paths disagree",
     "Every slot, code and position is right, but a token computed in a decode step and the same token "
     "computed inside a chunk, over the same stored cache, have outputs further apart than twice the "
     "tolerance (SPEC 9.2.6): the two paths use other kernels, tiles or roundings, and one of them loses "
     "precision (FA3's FP8 decode with tiles of 96 keys: decode and prefill diverge from position 97, vLLM "
     "issue 54035, SGLang issue 25790)."},
    {BugClass::chunk_edge_off_by_one, "chunk edge off by one",
     "A chunked attention layer (Llama 4's attention_chunk_size) draws its chunks one token early or late: "
     "queries see the last key of the previous chunk, or miss their chunk's first key. Look where the "
     "chunk index is computed: positions counted from 1, or from the cache's start instead of the row's "
     "first real token."},
    {BugClass::chunk_as_sliding_window, "chunk taken as a sliding window",
     "A chunked attention layer sees the last C keys, as a sliding window of C would, instead of its own "
     "chunk: the mask was built by the sliding-window path with the chunk size as the window (a cache that "
     "keeps the last C tokens is right, the mask over it is not)."},
    {BugClass::layer_rotated_with_another_layers_rope, "layer rotated with another layer's rope",
     "A layer's stored keys are rotations under the rope of another layer of the same model (its theta, "
     "scaling or rotary dims): the cache or its shift uses one rope for every layer where the model gives "
     "layers their own (Gemma 3's sliding layers rotated with the global base, llama.cpp issue 12357)."},
    {BugClass::nope_layer_rotated, "NoPE layer rotated",
     "A layer without positional encoding (NoPE: Llama 4's every fourth layer) holds rotated keys: the "
     "cache or the model applied RoPE to every layer, or re-rotated a NoPE layer's keys at a shift."},
    {BugClass::query_temperature_missing, "query temperature missing",
     "A NoPE layer's outputs are those of its query left unscaled: Llama 4's attn_temperature_tuning "
     "(the query times log1p(floor((p + 1) / floor_scale)) * attn_scale + 1) is not applied, or applied "
     "only where it is 1 (positions below floor_scale - 1)."},
    {BugClass::sliding_window_in_token_indices, "sliding window measured before the shift",
     "A sliding layer that shares a sink cache's cells (llama.cpp's iSWA cache with swa_full under a "
     "context shift) measures its window in token indices, or in positions the shift has not moved, "
     "instead of the shifted positions: the sinks leave its view too early and never come back after a "
     "shift. Look where the sliding mask reads the cells' positions."},
    {BugClass::kept_count_wrong, "kept count wrong",
     "After a score-based prune (SPEC 11.1), a kv head holds more or fewer of its prompt's tokens than the "
     "prune keeps: all of them means the press skipped the layer (its hook never ran, or returned the cache "
     "unchanged); one more or one fewer means a compression ratio rounded the other way (kvpress keeps "
     "int(n * (1 - ratio)))."},
};

// Row i describes class i, and every class has its row.
constexpr bool rows_in_enum_order() {
  for (std::size_t i = 0; i < std::size(kBugClasses); ++i)
    if (static_cast<std::size_t>(kBugClasses[i].id) != i) return false;
  return true;
}
static_assert(rows_in_enum_order(), "kBugClasses: one row per BugClass, in the enum's order");
static_assert(std::size(kBugClasses) == static_cast<std::size_t>(BugClass::kept_count_wrong) + 1,
              "kBugClasses: a BugClass without its row (the last enumerator must be kept_count_wrong)");

}  // namespace

const char* class_name(BugClass c) { return kBugClasses[static_cast<std::size_t>(c)].name; }

const char* class_explanation(BugClass c) { return kBugClasses[static_cast<std::size_t>(c)].explanation; }

}  // namespace kvcheck
