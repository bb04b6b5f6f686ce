// What diagnose shows of one row of a cache after a step: a table of its slots (who sits
// there, what the query saw, expected, claimed and recovered positions, a verdict) and a
// column of the picture of slots over steps. Plain values: the checker fills them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace kvcheck {

// What is wrong with a slot, most direct first.
enum class SlotVerdict {
  ok,
  dead_held,     // a token no later query sees, kept until the next token (lazy): fine
  dead_dropped,  // such a token already dropped (eager): fine
  stale,         // a token of another row or generation
  unknown_values,
  duplicated,
  missing,             // a live token the cache dropped
  claims_other_index,  // its metadata names another token index
  key_off_claim,       // the key is not rotated at the position the slot claims
  not_retained,        // the policy evicted it
  visible_should_not_be,
  not_used_should_be,
  distance_off,
  precision_off,  // held raw where the residual's rules quantize it, or quantized where they keep it raw
};

// How directly a verdict points at the bug: a slot's own content first, then what is
// visible, then distances, which a wrong query position shifts for every slot at once.
int severity(SlotVerdict v);
bool is_fine(SlotVerdict v);

// One slot of the diagnosed row, as the table and the picture show it.
struct SlotRow {
  int row = 0;
  std::int64_t slot = -1;  // -1: a token the cache does not hold
  std::int64_t uid = -1;
  std::int64_t index = -1;  // the reference's token index of that uid (-1: not in the row)
  bool visible_expected = false, visible_actual = false;
  std::optional<std::int64_t> distance_expected, distance_actual;  // Pq - Pk for the diagnosed query
  std::optional<std::int64_t> position_expected;                   // Pk for the diagnosed query
  std::optional<std::int64_t> position_claimed;                    // by the slot's metadata, or the trace's declaration
  std::optional<std::int64_t> claimed_index;
  std::string position_recovered;  // from the tensors (SPEC 5.5)
  std::string held;                // a residual's precision, expected/actual ("raw/q"); empty: not shown
  SlotVerdict verdict = SlotVerdict::ok;
};

// "ok", "distance off by 2", "claims token 5", ...
std::string verdict_text(const SlotRow& row);

// The picture: per step, per slot of the diagnosed row.
struct PictureCell {
  enum class State { empty, ok, dead, wrong_position, not_retained, duplicated, stale, wrong_precision } state =
      State::empty;
  std::int64_t slot = -1;  // the slot's own id (a paged slot: block * block_size + offset)
  std::int64_t uid = -1;
  std::int64_t error = 0;  // actual - expected distance, for wrong_position
};

PictureCell picture_cell(const SlotRow& row);

}  // namespace kvcheck
