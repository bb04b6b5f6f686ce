// One deliberately simple sink/sliding cache (token by token, compact slots, keys at cache
// positions: Hugging Face SinkCache's design) with one fault switched on. Each fault is a
// bug that shipped in a real engine. For demonstration and tests only.
#pragma once

#include "optimized/cache.h"

namespace kvcheck::zoo {

enum class Fault {
  new_key_not_shifted,      // the newest key keeps its absolute rotation; old keys are re-rotated
  absolute_positions,       // new keys and queries at absolute positions: positions grow past the cache
  long_prompt_keeps_head,   // a prompt longer than the window keeps its first tokens, drops the newest
  short_prompt_sinks,       // the sinks are whatever the first chunk had: a short prompt leaves fewer
  window_off_by_one,        // the window holds W + 1 keys (own token not counted)
  stale_rows_on_resize,     // a reset to another batch size keeps the old rows
  reorder_keeps_row_state,  // reorder moves the keys but not the rows' lengths and offsets
  padding_as_positions,     // left padding takes token indices, so sinks and positions shift
  layout_swapped,           // interleaved RoPE where rotate_half is expected (or the reverse)
  rope_table_wraps,         // the cos/sin table has W rows: position p is rotated at p mod W
  shift_one_early,          // "still growing" tested with < : kept keys re-rotated one token early
  mask_past_cache,          // evicted slots are not cleared and the mask does not stop at the window
  drops_live_token,         // evicts right after the forward, one token more than the dead one
  llama3_as_linear,         // llama3 rope_scaling read as plain linear: every frequency divided by f
  partial_rotates_all,      // rotary_dim ignored: all head_dim dims rotated, frequencies over head_dim
  yarn_factor_on_q_only,    // yarn's attention factor multiplies the query but not the stored keys
  learned_sinks_dropped,    // the learned sink logits are left out of the softmax
  rerotates_half_keys,      // none of the above: a correct shifting cache, wrong only in half precision,
                            // where re-rotating stored keys rounds them again at every shift
};

std::unique_ptr<optimized::KvCache> make_faulty_cache(const optimized::CacheConfig& config, Fault fault);

}  // namespace kvcheck::zoo
