// Float32 attention over cache slots, as an engine would run it. Which slots a query sees
// follows from each slot's token index, as llama.cpp builds its mask from cell positions:
// never a later token; sinks below `sink_end`; the window from `window_begin` to the query.
//
// Where the time goes: a decode step is bound by reading K and V. The kernel reads each
// key and value row once per kv head and serves all of that head's query heads (GQA) from
// it, and a block of up to kQueryBlock consecutive queries of a prefill chunk from the same
// read. Work is shared out over (query block, kv head) tasks; each task's result does not
// depend on which thread ran it, so outputs are bit-identical for any thread count.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "optimized/rope_table.h"
#include "optimized/slot_store.h"

namespace kvcheck::optimized {

class WorkerPool;

struct QueryPlan {
  std::int64_t index = 0;                // token index t of the query
  std::int64_t sink_end = 0;             // slots of tokens with index < sink_end are sinks
  std::int64_t window_begin = 0;         // other slots are visible iff window_begin <= index <= t (causal)
  std::int64_t query_position = 0;       // rotation of the query against window keys
  std::int64_t sink_query_position = 0;  // against sink keys (differs only in sink_ring)
  std::int64_t sees_ahead = 0;           // slots of index <= index + sees_ahead are visible: 0 is causal,
                                         // and only a zoo mutant reads ahead
  std::int64_t sink_begin = 0;           // sinks below it are not visible (SPEC 10.4's window inside a sink cache)
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
  int layers = 1, heads = 1, kv_heads = 1, head_dim = 2;
  float scale = 1.0f;
  // Learned sink logits [layer][head] (gpt-oss): each joins its head's softmax with no value.
  const std::vector<std::vector<float>>* sink_logits = nullptr;
  // SPEC 10.3 (Llama 4's NoPE layers): where temperature_layers[layer] is set, the query of
  // token t is multiplied by log1p(floor((t + 1) / temperature_floor)) * temperature_scale + 1.
  std::int64_t temperature_floor = 0;  // 0: no temperature
  double temperature_scale = 0.0;
  const char* temperature_layers = nullptr;
};

// Slots a query may read: a row of a store, or `count` slots of it from `first` (a block of
// a paged pool).
struct SlotSource {
  const SlotStore* store;
  int row;
  std::int64_t first = 0;
  std::int64_t count = -1;  // -1: to the row's end
};

// A query of the chunk: its position in the chunk and what it sees.
struct PlannedQuery {
  std::int64_t chunk_pos;
  QueryPlan plan;
};

// The attention of one cache, with the scratch space and threads it reuses from step to
// step (nothing is allocated per decoded token once the shapes have been seen).
class AttentionKernel {
 public:
  explicit AttentionKernel(int threads = 1);
  ~AttentionKernel();
  AttentionKernel(AttentionKernel&&) noexcept;
  AttentionKernel& operator=(AttentionKernel&&) noexcept;

  // Attends `queries` of one row in every layer. q[layer] + row_offset holds the row's raw
  // queries [chunk, H, D]; out[layer] + row_offset receives [chunk, H, D] at the same chunk
  // positions. Layer 0's visible pairs are appended to `log` when it is not null.
  void attend(const KernelShape& shape, const RopeTable& rope, const std::vector<const float*>& q,
              const std::vector<float*>& out, std::size_t row_offset, std::span<const PlannedQuery> queries,
              std::span<const SlotSource> sources, AttentionLog* log, int row);

  struct Scratch;
  struct Block;

 private:
  std::unique_ptr<WorkerPool> pool_;
  std::vector<Scratch> scratch_;  // one per participant
  std::vector<Block> blocks_;
};

}  // namespace kvcheck::optimized
