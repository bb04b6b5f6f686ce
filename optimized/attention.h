// Float32 attention over cache slots, as an engine would run it. Which slots a query sees
// follows from each slot's token index, as llama.cpp builds its mask from cell positions:
// never a later token; sinks below `sink_end`; the window from `window_begin` to the query.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "optimized/rope_table.h"
#include "optimized/slot_store.h"

namespace kvcheck::optimized {

struct QueryPlan {
  std::int64_t index = 0;                // token index t of the query
  std::int64_t sink_end = 0;             // slots of tokens with index < sink_end are sinks
  std::int64_t window_begin = 0;         // other slots are visible iff window_begin <= index <= t
  std::int64_t query_position = 0;       // rotation of the query against window keys
  std::int64_t sink_query_position = 0;  // against sink keys (differs only in sink_ring)
};

// One visible (query, key) pair as the kernel used it: the integers SPEC 5.3 checks.
struct AttentionLogEntry {
  int row;
  std::int64_t query_index;
  std::int64_t query_position;
  std::int64_t key_uid;
  std::int64_t key_index;
  std::int64_t key_position;
};
using AttentionLog = std::vector<AttentionLogEntry>;

struct KernelShape {
  int heads = 1, kv_heads = 1, head_dim = 2;
  float scale = 1.0f;
};

struct SlotSource {
  const SlotStore* store;
  int row;
};

// Attends the queries of one row in one layer. `q` holds the row's raw queries
// [chunk, H, D]; each plan names the chunk position it answers; `out` is [chunk, H, D].
// Every visible pair is appended to `log` when it is not null.
void attend_row(const KernelShape& shape, RopeTable& rope, int layer, const float* q,
                const std::vector<std::pair<std::int64_t, QueryPlan>>& plans, const std::vector<SlotSource>& sources,
                float* out, AttentionLog* log, int row);

}  // namespace kvcheck::optimized
