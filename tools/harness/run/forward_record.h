// SPEC 8.7: an append with `chunk` runs as several forwards, each checked as a step. The
// reference computes the whole append (its outputs do not depend on the chunking); the
// state between two forwards is cut out of it here, at the lengths the cache reached.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// The tokens of `part` cut out of `whole`, a [layers, B, n, width] array of `from`'s tokens
// (each row left-padded to from.chunk), each row left-padded to part.chunk (NaN). skipped[b]:
// row b's tokens in `from` before part's first.
template <class T>
std::vector<T> cut_tokens(std::span<const T> whole, const reference::AppendResult& from,
                          const reference::AppendResult& part, const std::vector<std::size_t>& skipped,
                          std::size_t layers, std::size_t width) {
  if (whole.empty()) return {};
  const std::size_t B = from.rows.size(), n = static_cast<std::size_t>(from.chunk),
                    m = static_cast<std::size_t>(part.chunk);
  std::vector<T> out(layers * B * m * width, std::numeric_limits<T>::quiet_NaN());
  for (std::size_t l = 0; l < layers; ++l)
    for (std::size_t b = 0; b < B; ++b) {
      const std::size_t count = part.rows[b].size();
      const std::size_t source = (l * B + b) * n + (n - from.rows[b].size()) + skipped[b];
      const std::size_t target = (l * B + b) * m + (m - count);
      std::copy_n(whole.begin() + static_cast<std::ptrdiff_t>(source * width), count * width,
                  out.begin() + static_cast<std::ptrdiff_t>(target * width));
    }
  return out;
}

// Step `whole` (an append) as it stands after forward number `forward` (from 1): per row,
// the tokens with index in [begin[b], end[b]) are the forward's (for the first forward,
// from the append's first token, a prefix hit included), and the row holds end[b] tokens.
// The retained sets and histories are those of the rows at end[b]; the outputs, those of
// the forward's tokens; the stored values (quantized scenarios), the reference's.
StepRecord forward_record(const Scenario& scenario, const StepRecord& whole, const std::vector<std::int64_t>& begin,
                          const std::vector<std::int64_t>& end, std::int64_t forward);

}  // namespace kvcheck
