// Runs one optimized cache through a scenario beside the reference run and applies
// SPEC 5 items 1 to 4: outputs, retained set, exact relative distances, rotation. Keeps
// the evidence of the first divergent step for diagnosis.
#pragma once

#include <optional>

#include "reference/model.h"
#include "tools/harness/cache_registry.h"
#include "tools/harness/diagnosis.h"
#include "tools/harness/reference_run.h"
#include "tools/harness/report.h"
#include "tools/harness/scenario.h"
#include "tools/harness/slot_view.h"

namespace kvcheck {

struct FirstDivergence {
  StepEvidence evidence;
  StepContext context;
  BugClass bug = BugClass::none;
  int row = 0;
  int layer = 0;  // of the first slot issue, else of the first wrong output; the table shows it
  std::int64_t query_index = -1;  // the first divergent query; -1: none (a reorder, reset or crop)
  // The row's slots after that step, with visibility and distances as seen by the row's
  // last token of the step (whose view is the state the step leaves behind).
  std::int64_t table_query_index = -1;
  std::vector<SlotRow> slots;
};

struct CacheTrace {
  Outcome outcome;
  std::optional<FirstDivergence> first;
  std::vector<std::vector<PictureCell>> picture;  // [step][slot] for first->row (when asked)
};

// Moves the context past one step (resets, reorders, padding seen).
void advance(StepContext& context, const StepRecord& record);

// A bound for position recovery: twice the longest row the scenario reaches, plus room.
std::int64_t largest_position(const ReferenceRun& run);

// The first token index of the retained window (after the sinks).
std::int64_t window_start(const Policy& policy, const reference::RowRetained& retained);

// The token index of `uid` in a row's history, or -1.
std::int64_t index_of(const std::vector<std::uint64_t>& history, std::int64_t uid);

CacheTrace trace_cache(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run,
                       const CacheEntry& cache, bool with_picture);

Outcome check_cache(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run,
                    const CacheEntry& cache);

// The raw inputs of one append step as the caches take them: per layer [B, n, H|Hkv, D],
// NaN where padded (a cache that reads padding poisons its output).
struct ChunkBuffers {
  optimized::Chunk chunk;
  std::vector<std::vector<float>> q, k, v;
};
ChunkBuffers make_chunk(const Scenario& scenario, const InputTable& inputs, const reference::AppendResult& step);

}  // namespace kvcheck
