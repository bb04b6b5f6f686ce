// Quantized-cache mutants (SPEC 9): a real cache of kvcheck's with one quantization bug
// planted around it, each modelled on a bug that shipped. Read-side bugs store the right
// codes and read them wrongly; write-side bugs store the wrong codes. For tests and
// demonstration only.
#pragma once

#include <memory>

#include "optimized/cache.h"

namespace kvcheck::zoo {

enum class QuantFault {
  scale_dropped_on_read,  // fp8 written as x / s, read as code * 1 (SGLang #18818, tokenspeed #759)
  v_with_k_scales,        // V's q8_0 blocks dequantized with K's block scales (ik_llama.cpp #400)
  q4_nibble_order,        // q4_0 read with element j paired with j + 1, not j + 16 (ik_llama.cpp #1005)
  scale_frozen_on_first,  // a per-token int8 scale computed at the first append, then kept (imp #89)
  shift_skips_quantized,  // a context shift moves quantized keys and their positions, not their codes
                          // (llama.cpp #5652: context shift with a quantized K cache)
  prefill_skips_residual,  // a prefill declared kept in the residual quantized at once, and the reverse
                           // (transformers #35185)
  reorder_residual_only,   // reorder and crop move the residual, not the quantized tokens
                           // (transformers PRs 45510 and 48700)
  decode_tile_rounding,    // a decode keeps its running output in bfloat16 between tiles of 96 keys, where
                           // chunks keep float32 (FA3 FP8's decode tile: vLLM #54035, SGLang #25790)
  transform_missing_on_restore,  // a swapped-out row comes back re-quantized without the Hadamard transform
                                 // (llama.cpp PR 24367, unslothai/llama.cpp PR 129)
};

// `inner` is the real cache the fault is planted in: dense or sliding for the read-side
// faults (whose queries see every slot of their window by token index), dense (full
// attention, no transform) for decode_tile_rounding, paged for transform_missing_on_restore,
// any for the others.
std::unique_ptr<optimized::KvCache> make_quant_faulty_cache(const optimized::CacheConfig& config, QuantFault fault,
                                                            std::unique_ptr<optimized::KvCache> inner);

}  // namespace kvcheck::zoo
