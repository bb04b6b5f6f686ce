// Paged-cache mutants (SPEC 8): kvcheck's real paged cache with one bookkeeping decision
// made wrongly, each modelled on a bug that shipped (named beside each fault below). For
// tests and demonstration only.
#pragma once

#include <memory>

#include "optimized/cache.h"

namespace kvcheck::zoo {

enum class PagedFault {
  key_without_extras,      // prefix key from token ids only (vLLM #3264, #30931)
  key_extras_untagged,     // adapter and salt concatenated untagged: adapter "X" == salt "X" (vLLM #44701)
  register_before_write,   // full blocks enter the index at allocation, before their forward (vLLM PR 37152)
  share_partial_no_cow,    // a shared block is written in place, no copy-on-write (atlas #1193)
  hit_without_reference,   // a hit puts blocks in the table without taking a reference (atlas #692)
  move_row_stale_tail,     // a reorder copies the source's entries over the old table, keeping its tail (tt-plugin PR 103)
  window_free_early,       // frees one block more than floor((n - W + 1) / B) (vLLM PR 17398)
  window_absolute_index,   // a compact window table indexed with t / B, its padding block 0 (tt-metal PR 45184)
  chunk_keys_to_append_end,  // a chunk's kernel is told the whole append's key length (nano-vllm PR 213)
  chunk_keys_chunk_only,   // a chunk's queries see only the chunk, not earlier chunks' keys (imp PR 114)
  chunk_position_restart,  // a later chunk's positions restart at 0 (transformers #43082)
  evict_keeps_index,       // an evicted or recycled block keeps its index entry (TRT-LLM #8813, llama.cpp #27148)
  recompute_prompt_only,   // a recompute preemption rebuilds the prompt only (vLLM #16832, nano-vllm PR 211)
  window_kept_in_prefill,  // a sliding layer frees nothing between a chunked prefill's forwards (kvcheck's own)
  hit_reads_own_scale,     // a prefix hit's blocks read with the reading row's frozen scale, not their writer's
                           // (TRT-LLM #2699, FP8 KV with block reuse; kvcheck's hypothesis)
};

std::unique_ptr<optimized::KvCache> make_paged_faulty_cache(const optimized::CacheConfig& config, PagedFault fault);

}  // namespace kvcheck::zoo
