#include "tools/harness/check/slot_view.h"

#include <fmt/format.h>

namespace kvcheck {

int severity(SlotVerdict v) {
  switch (v) {
    case SlotVerdict::ok:
    case SlotVerdict::dead_held:
    case SlotVerdict::dead_dropped:
      return 0;
    case SlotVerdict::distance_off:
      return 1;
    case SlotVerdict::not_retained:
    case SlotVerdict::visible_should_not_be:
    case SlotVerdict::not_used_should_be:
      return 2;
    case SlotVerdict::stale:
    case SlotVerdict::unknown_values:
    case SlotVerdict::duplicated:
    case SlotVerdict::missing:
    case SlotVerdict::claims_other_index:
    case SlotVerdict::key_off_claim:
    case SlotVerdict::precision_off:
      return 3;
  }
  return 0;
}

bool is_fine(SlotVerdict v) { return severity(v) == 0; }

std::string verdict_text(const SlotRow& r) {
  switch (r.verdict) {
    case SlotVerdict::ok:
      return "ok";
    case SlotVerdict::dead_held:
      return "ok: dead, held until the next token";
    case SlotVerdict::dead_dropped:
      return "ok: dead, dropped early";
    case SlotVerdict::stale:
      return "stale: not this row's token";
    case SlotVerdict::unknown_values:
      return "unknown values: no token's";
    case SlotVerdict::duplicated:
      return "duplicated";
    case SlotVerdict::missing:
      return "missing: the cache dropped it";
    case SlotVerdict::claims_other_index:
      return fmt::format("claims token {}", r.claimed_index.value_or(-1));
    case SlotVerdict::key_off_claim:
      return "key not at its claimed position";
    case SlotVerdict::not_retained:
      return "should have been evicted";
    case SlotVerdict::visible_should_not_be:
      return "visible, should not be";
    case SlotVerdict::not_used_should_be:
      return "not used, should be visible";
    case SlotVerdict::distance_off:
      return fmt::format("distance off by {}", r.distance_actual.value_or(0) - r.distance_expected.value_or(0));
    case SlotVerdict::precision_off:
      return r.held.rfind("raw/", 0) == 0 ? "held quantized, the rules say raw" : "held raw, the rules say quantized";
  }
  return "?";
}

PictureCell picture_cell(const SlotRow& r) {
  PictureCell c;
  c.uid = r.uid;
  switch (r.verdict) {
    case SlotVerdict::ok:
      c.state = PictureCell::State::ok;
      break;
    case SlotVerdict::dead_held:
    case SlotVerdict::dead_dropped:
      c.state = PictureCell::State::dead;
      break;
    case SlotVerdict::stale:
    case SlotVerdict::unknown_values:
      c.state = PictureCell::State::stale;
      break;
    case SlotVerdict::duplicated:
      c.state = PictureCell::State::duplicated;
      break;
    case SlotVerdict::not_retained:
    case SlotVerdict::visible_should_not_be:
      c.state = PictureCell::State::not_retained;
      break;
    case SlotVerdict::missing:
    case SlotVerdict::not_used_should_be:
      c.state = PictureCell::State::empty;
      break;
    case SlotVerdict::precision_off:
      c.state = PictureCell::State::wrong_precision;
      break;
    case SlotVerdict::claims_other_index:
    case SlotVerdict::key_off_claim:
    case SlotVerdict::distance_off:
      c.state = PictureCell::State::wrong_position;
      c.error = r.distance_actual && r.distance_expected ? *r.distance_actual - *r.distance_expected : 1;
      break;
  }
  return c;
}

}  // namespace kvcheck
