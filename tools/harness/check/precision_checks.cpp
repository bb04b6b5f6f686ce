#include "tools/harness/check/precision_checks.h"

#include <fmt/format.h>

#include <map>

#include "reference/stored_kv.h"

namespace kvcheck {

void PrecisionChecks::check(const StepRecord& rec, CacheView& view, StepEvidence& evidence) {
  const Scenario& s = s_;
  if (rec.stored.empty() || !s.quantized()) return;
  for (std::size_t l = 0; l < rec.stored.size() && l < view.layers.size(); ++l)
    for (std::size_t b = 0; b < rec.stored[l].size() && b < view.layers[l].slots.size(); ++b) {
      if (!s.quant(static_cast<int>(l)).k && !s.quant(static_cast<int>(l)).v) break;
      const auto& retained = rec.retained_in(static_cast<int>(l), static_cast<int>(b)).keys;
      // Every kv head of a token changes precision together: the first head speaks for it.
      if (view.layers[l].slots[b].empty()) continue;
      std::map<std::int64_t, const ViewSlot*> by_uid;
      for (const ViewSlot& v : view.layers[l].slots[b][0]) by_uid[v.uid] = &v;
      for (std::size_t i = 0; i < retained.size() && i < rec.stored[l][b].size(); ++i) {
        const auto found = by_uid.find(static_cast<std::int64_t>(retained[i].uid));
        if (found == by_uid.end()) continue;  // the retained-set check reports it
        const ViewSlot& slot = *found->second;
        if (!slot.raw && !slot.key_codes && !slot.value_codes) continue;  // the source does not show it
        ++checked_;
        raw_seen_ += slot.raw ? 1 : 0;
        const bool raw = rec.stored[l][b][i].raw;
        if (slot.raw == raw) continue;
        const PrecisionIssue issue{static_cast<int>(l), static_cast<int>(b), static_cast<std::int64_t>(retained[i].uid),
                                   retained[i].index, slot.slot, raw};
        if (failures_++ == 0)
          first_ = fmt::format("{}: layer {} row {} token {} (uid {}, slot {}) is held {}, the rules say {}",
                               evidence.label, l, b, issue.index, issue.uid, issue.slot,
                               raw ? "quantized" : "raw", raw ? "raw (in the residual)" : "quantized");
        if (evidence.precision.size() < 64) evidence.precision.push_back(issue);
      }
    }
}

void PrecisionChecks::add_checks(Outcome& outcome) const {
  if (checked_ == 0) return;  // no residual, or a source that does not show precision
  outcome.checks.push_back(
      {"precision map", failures_ == 0,
       failures_ ? first_
                 : fmt::format("{} retained tokens held raw or quantized as the rules say ({} of them raw)",
                               checked_, raw_seen_)});
}

}  // namespace kvcheck
