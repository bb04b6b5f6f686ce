// Which keys a token sees and at which positions: the policy table of SPEC section 3,
// written as directly as the table reads. Tokens are named by their index t in the row.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/model.h"

namespace kvcheck::reference {

struct VisibleKey {
  std::int64_t index;     // token index j in the row
  std::int64_t position;  // Pk(t, j)
};

struct QueryView {
  std::int64_t query_position = 0;  // Pq(t)
  std::vector<VisibleKey> keys;     // V(t), in index order
};

// E(t) = k * ceil(max(0, t + 1 - W) / k): tokens evicted when t is the newest (sink only).
std::int64_t evicted_count(const Policy& policy, std::int64_t t);

// V(t), Pk, Pq under the streaming rule: token t fed as the newest token.
QueryView streaming_view(const Policy& policy, std::int64_t t);

// The view of token t inside a chunk that starts at chunk_start, honouring
// `prefill: dense` (the base is V(chunk_start) without chunk_start, then the chunk
// causally). Under streaming prefill this is streaming_view(t).
QueryView chunk_view(const Policy& policy, std::int64_t chunk_start, std::int64_t t);

// The retained set of a row of `length` tokens: what its last token attends to under the
// streaming rule, with the positions that token sees. Empty for length 0.
QueryView retained_view(const Policy& policy, std::int64_t length);

// The live set of a row of `length` tokens (SPEC 3): the retained tokens that the next
// token, index `length`, will still see, with the positions that token sees them at
// (query_position is that token's Pq). A cache may drop the others (dead) early.
QueryView live_view(const Policy& policy, std::int64_t length);

// SPEC 10.4: of live_view, the keys some later query of the row can still see (without a
// crop). The same as live_view except for a sliding layer under a shift (swa > 0), whose
// window hides some of what its sink policy keeps: a shift lowers Pq and a non-sink's Pk
// alike, so a non-sink hidden from the next query stays hidden; a sink j comes back once Pq
// falls to C - k at the next shift, so it is seen again iff min(Pq, C - k) - j < W.
QueryView seen_again_view(const Policy& policy, std::int64_t length);

// SPEC 4's crop refusal for one layer: the first token a row of `length` tokens cut to `cut`
// needs and the cache may no longer hold, or -1 when none. Needed: the cut row's retained
// set; held for sure: the row's. Under SPEC 10.4 both are narrowed to what a later query
// sees (seen_again_view): a cache may have dropped the rest.
std::int64_t crop_lacks(const Policy& policy, std::int64_t length, std::int64_t cut);

// L(T) of SPEC 3.1: how many of a sliding row's most recent tokens a buffer of `capacity`
// C >= W slots holds after `length` T tokens when it evicts G = C - W + 1 of its oldest
// tokens at once (ONNX Runtime's windowed GroupQueryAttention cache): T up to C, then
// T - G * ceil((T - C) / G), which stays within [W, C].
std::int64_t block_retained_length(std::int64_t length, std::int64_t capacity, std::int64_t window);

}  // namespace kvcheck::reference
