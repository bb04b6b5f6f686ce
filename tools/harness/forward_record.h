// SPEC 8.7: an append with `chunk` runs as several forwards, each checked as a step. The
// reference computes the whole append (its outputs do not depend on the chunking); the
// state between two forwards is cut out of it here, at the lengths the cache reached.
#pragma once

#include <cstdint>
#include <vector>

#include "tools/harness/reference_run.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

// Step `whole` (an append) as it stands after forward number `forward` (from 1): per row,
// the tokens with index in [begin[b], end[b]) are the forward's (for the first forward,
// from the append's first token, a prefix hit included), and the row holds end[b] tokens.
// The retained sets and histories are those of the rows at end[b]; the outputs, those of
// the forward's tokens; the stored values (quantized scenarios), the reference's.
StepRecord forward_record(const Scenario& scenario, const StepRecord& whole, const std::vector<std::int64_t>& begin,
                          const std::vector<std::int64_t>& end, std::int64_t forward);

}  // namespace kvcheck
