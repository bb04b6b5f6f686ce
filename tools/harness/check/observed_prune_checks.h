// SPEC 11.1, the observed prune, in the one checker. A score-based press (kvpress's
// ScorerPress: KnormPress, SnapKV, TOVA, ...) keeps, in every full layer, row and kv head,
// tokens of the prompt that kvcheck does not predict. The first step that shows a row after
// such a prune reads them: the prompt tokens each kv head holds (identified by their values)
// become that head's kept set, which must count exactly what the prune keeps and include its
// required sinks and recent tokens. From then on the slot and rotation checks judge those
// keys like the reference's own, at their index or (re-rotated) at their rank in the head's
// set, and the full layers' outputs over the row are expected over those sets (the
// reference's attention, over the keys the cache chose).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reference/reference_model.h"
#include "tools/harness/check/sub_check.h"

namespace kvcheck {

// An append's tokens with `chosen` (one kv head's kept keys in `layer`) visible ahead of
// what the reference's view of that layer holds: all of them are earlier tokens.
std::vector<reference::AppendedToken> with_chosen_keys(std::span<const reference::AppendedToken> tokens, int layer,
                                                       const std::vector<reference::RetainedKey>& chosen);

class ObservedPruneChecks : public SubCheck {
 public:
  ObservedPruneChecks(const Scenario& scenario, const InputTable& inputs);
  // Reads the kept sets of every row the step shows pruned for the first time.
  void check(const StepRecord& record, CacheView& view, StepEvidence& evidence) override;
  void add_checks(Outcome& outcome) const override;
  void chosen_keys(const StepRecord& record, int layer, int row, int kv_head,
                   std::vector<reference::RetainedKey>& keys) const override;
  void rule_outputs(const StepRecord& record, int layer, int row, const float* rotated_q,
                    OutputRule& rule) const override;

 private:
  struct Required {
    std::size_t step;
    std::int64_t sinks, recent;
  };
  // [layer][kv head] keys, a layer filled for full layers only.
  using Keys = std::vector<std::vector<std::vector<reference::RetainedKey>>>;
  // One pruned row: the uid of its first token (which row it is after a reorder), the keys
  // each head holds (at their index, or their rank among the held when re-rotated), and
  // the required ones it lacks, reported lost at the step that read them only (a wrong
  // prune fails once, where it happened).
  struct Row {
    std::uint64_t first_uid = 0;
    Keys kept, missing;
    bool fresh = false;  // read at the step being checked
  };
  Row read_row(const StepRecord& record, const CacheView& view, int row, StepEvidence& evidence);
  const Row* row_of(const StepRecord& record, int row) const;

  const Scenario& s_;
  const InputTable& inputs_;
  std::vector<Required> prunes_;           // the scenario's observed prunes, in step order
  std::vector<std::optional<Row>> rows_;   // per row as the last checked step numbered them
  std::int64_t heads_read_ = 0, failures_ = 0;
  mutable std::int64_t outputs_over_kept_ = 0;  // (token, head) outputs expected over kept sets
  std::string first_;
};

}  // namespace kvcheck
