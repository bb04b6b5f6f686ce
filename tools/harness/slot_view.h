// What diagnose shows of one row of a cache after a step: a table of its slots (who sits
// there, what the query saw, expected, claimed and recovered positions, a verdict) and a
// column of the picture of slots over steps.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "optimized/attention.h"
#include "optimized/slot_store.h"
#include "reference/model.h"
#include "tools/harness/reference_run.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

// One slot of the diagnosed row, as the table and the picture show it.
struct SlotRow {
  int row = 0;
  std::int64_t slot = -1;  // -1: a token the cache should hold but does not
  std::int64_t uid = -1;
  std::int64_t index = -1;  // the reference's token index of that uid (-1: not in the row)
  bool visible_expected = false, visible_actual = false;
  std::optional<std::int64_t> distance_expected, distance_actual;  // Pq - Pk for the diagnosed query
  std::optional<std::int64_t> position_expected;                   // Pk for the diagnosed query
  std::int64_t position_claimed = 0;
  std::string position_recovered;  // from the tensors (SPEC 5.5)
  std::string verdict;             // "ok" or what is wrong
};

// The picture: per step, per slot of the diagnosed row.
struct PictureCell {
  enum class State { empty, ok, wrong_position, not_retained, duplicated } state = State::empty;
  std::int64_t uid = -1;
  std::int64_t error = 0;  // actual - expected distance, for wrong_position
};

// The row's slots, with visibility and Pq - Pk as seen by token `query_index`, and the
// retained tokens the cache no longer holds; positions recovered (from `layer`'s keys) up
// to max_position.
std::vector<SlotRow> slot_table(const Scenario& scenario, const InputTable& inputs, std::int64_t max_position,
                                const optimized::SlotStore& store, const optimized::AttentionLog& log,
                                const StepRecord& record, int row, std::int64_t query_index, int layer);

// The row's slots judged by the distance its last query of the step used.
std::vector<PictureCell> picture_column(const optimized::SlotStore& store, const optimized::AttentionLog& log,
                                        const StepRecord& record, int row);

}  // namespace kvcheck
