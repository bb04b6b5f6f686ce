// Runs one optimized cache through a scenario beside the reference run: each step's raw
// chunk goes in, and its outputs, slots and kernel log come out as a CacheView for the
// one checker (step_checker.h).
#pragma once

#include <exception>

#include "tools/harness/sources/cache_entry.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/harness/check/step_checker.h"

namespace kvcheck {

// One in-process cache fed the scenario's steps: step i's raw chunk goes in, the cache's
// outputs, slots and kernel log come out as a CacheView, valid until step i + 1. A cache
// that throws is a finding in the view, never an exception here.
class InProcessCache {
 public:
  InProcessCache(const Scenario& scenario, const InputTable& inputs, const CacheEntry& entry);
  ~InProcessCache();
  CacheView operator()(std::size_t index, const StepRecord& record);
  // SPEC 8.7: the state between two forwards of a chunked append goes to `checker` as a
  // step of its own (StepChecker::forward), while the cache waits.
  void check_forwards_with(StepChecker& checker) { forwards_to_ = &checker; }

 private:
  void apply(std::size_t index, const StepRecord& record);
  // Keeps the codes of a key the cache has just stored (Chunk::key_stored).
  void record_key_store(int layer, int row, int kv_head, std::int64_t slot, std::int64_t position);
  // What the cache shows now, with `out` ([layer][B, n, H, D]) as the outputs.
  CacheView view_now(const std::vector<std::vector<float>>& out);
  // The chunked append `record` (step `index`) has just run forward number `forward`.
  void between_forwards(std::size_t index, const StepRecord& record, std::int64_t forward,
                        std::vector<std::int64_t>& begin, std::size_t& logged);
  const Scenario& s_;
  const InputTable& inputs_;
  std::unique_ptr<optimized::KvCache> cache_;
  optimized::AttentionLog log_;
  std::vector<std::vector<float>> out_;
  std::vector<KeyStore> key_stores_;  // this append's stores of quantized keys, in order
  bool key_stores_complete_ = true;   // false: more than the cap, none handed over
  std::vector<bool> recomputed_;  // per row: its preemption was a recompute
  StepChecker* forwards_to_ = nullptr;
  std::vector<std::vector<float>> forward_out_;  // a forward's outputs, cut out of out_
  std::exception_ptr checker_error_;             // the checker's own failure, raised after the cache returns
};

CacheTrace trace_cache(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run,
                       const CacheEntry& cache, bool with_picture, std::optional<std::size_t> focus_step = {});

Outcome check_cache(const Scenario& scenario, const InputTable& inputs, const ReferenceRun& run,
                    const CacheEntry& cache);

// The raw inputs of one append step as the caches take them: per layer [B, n, H|Hkv, D],
// NaN where padded (a cache that reads padding poisons its output).
struct ChunkBuffers {
  optimized::Chunk chunk;
  std::vector<std::vector<float>> q, k, v;
};
// `scenario_step` gives the paged fields (extras, forward size); the ids come from the scenario.
ChunkBuffers make_chunk(const Scenario& scenario, const InputTable& inputs, const reference::AppendResult& step,
                        const Step& scenario_step);

}  // namespace kvcheck
