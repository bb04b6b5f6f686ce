// Runs one optimized cache through a scenario beside the reference run and applies
// SPEC 5 items 1 to 4: outputs, retained set, exact relative distances, rotation.
#pragma once

#include "reference/model.h"
#include "tools/harness/cache_registry.h"
#include "tools/harness/reference_run.h"
#include "tools/harness/report.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

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
