// Runs the reference over a scenario's steps and keeps, per step, what the export and
// every check need: appended uids, outputs, the retained set, an expected refusal.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "reference/reference_model.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// A row's history after a step: the uid of each token index. Steps share one vector per
// row and generation (appends extend it; a record sees its own prefix), so a long run
// keeps one history per row, not a copy per step.
class RowHistory {
 public:
  RowHistory() = default;
  RowHistory(std::shared_ptr<const std::vector<std::uint64_t>> uids, std::size_t size)
      : uids_(std::move(uids)), size_(size) {}
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // The uid of token i (a token a prune took from the full layers keeps its uid; SPEC 11).
  std::uint64_t operator[](std::size_t i) const { return (*uids_)[i] & reference::kUidBits; }
  // begin()/end() give the entries as the reference holds them, prune marks included.
  const std::uint64_t* begin() const { return uids_ ? uids_->data() : nullptr; }
  const std::uint64_t* end() const { return begin() + size_; }
  // The first n tokens (the history at an earlier point of the same step).
  RowHistory prefix(std::size_t n) const { return {uids_, std::min(n, size_)}; }

 private:
  std::shared_ptr<const std::vector<std::uint64_t>> uids_;
  std::size_t size_ = 0;
};

struct StepRecord {
  Step step;
  // A chunked append's state after its forward number `forward` (from 1; SPEC 8.7), made
  // by forward_record(); 0: the state after the whole step.
  std::int64_t forward = 0;
  // A forward's record: each row's history once the whole append is done. An engine may map
  // slots and blocks for the append's later tokens before their forward runs (vLLM's v0
  // block manager allocated a whole prompt at once).
  std::vector<RowHistory> after_append;
  int batch_before = 0;
  std::optional<reference::AppendResult> append;                    // append steps
  // One per layer: what each row holds after the step ([row]). Layers of equal policies hold
  // the same and share one vector (a deep stack of one policy keeps one copy).
  std::vector<std::shared_ptr<const std::vector<reference::RowRetained>>> retained;
  const reference::RowRetained& retained_in(int layer, int row) const {
    return retained.at(static_cast<std::size_t>(layer))->at(static_cast<std::size_t>(row));
  }
  std::size_t rows() const { return retained.empty() ? 0 : retained.front()->size(); }
  // Some layers hold other tokens than others (their policies differ).
  bool retained_differs() const {
    return std::any_of(retained.begin(), retained.end(), [&](const auto& r) { return r != retained.front(); });
  }
  std::vector<RowHistory> histories;  // per row, after the step
  // SPEC 9: what a quantized cache must hold after the step, [layer][row][i] for the i-th
  // key of retained_in(layer, row); empty unless the scenario quantizes.
  std::vector<std::vector<std::vector<reference::StoredLayer>>> stored;
  // A chunked append's (SPEC 8.7): [layer][row] the stored value of every token from
  // `stored_from[layer][row]` to the row's end, the keys any forward's state may hold.
  std::vector<std::vector<std::vector<reference::StoredLayer>>> stored_window;
  std::vector<std::vector<std::int64_t>> stored_from;
  // SPEC 10.2: a chunked layer's ring of C slots may still hold the previous chunk's tail,
  // dead and outside the retained set: [layer][row] the stored value of each of the row's
  // last C tokens that is not retained (at its index; empty for other policies).
  std::vector<std::vector<std::vector<std::pair<std::int64_t, reference::StoredLayer>>>> stored_ring;
  // SPEC 8.4, paged scenarios' appends: per row, the largest prefix hit a correct cache may
  // report (0 for rows that do not start).
  std::vector<std::int64_t> largest_hit;
  // The same, were blocks written earlier in this very step hittable (they are not: a hit up
  // to this many tokens read a block before its write).
  std::vector<std::int64_t> largest_hit_same_step;
  // SPEC 8.6: rows preempted after the step (their cache may hold nothing of them).
  std::vector<bool> preempted;
  bool is_preempted(int row) const {
    return static_cast<std::size_t>(row) < preempted.size() && preempted[static_cast<std::size_t>(row)];
  }
  std::string refused;                // the code when the step was refused
  std::string refusal_message;
  // A refused crop (SPEC 4): what the rows would hold had a cache served it, each cut to
  // the crop and kept under its policy as if only those tokens had been appended. A cache
  // that kept more than the retained set may serve it (section 5, item 2).
  struct ServedCrop {
    std::vector<std::shared_ptr<const std::vector<reference::RowRetained>>> retained;  // [layer]
    std::vector<RowHistory> histories;
    // SPEC 9: what the cut rows' tokens are stored as (a crop re-quantizes nothing), laid
    // out as `stored` and `stored_ring` are; empty unless the scenario quantizes.
    std::vector<std::vector<std::vector<reference::StoredLayer>>> stored;
    std::vector<std::vector<std::vector<std::pair<std::int64_t, reference::StoredLayer>>>> stored_ring;
  };
  std::shared_ptr<const ServedCrop> served;
};

struct ReferenceRun {
  std::vector<StepRecord> steps;
  std::vector<std::string> problems;  // an expected refusal not raised, an unexpected one
};

// The reference one step at a time: a long scenario is checked step by step, and nothing
// of a step needs to outlive its checks.
class ReferenceStepper {
 public:
  // attend[i] false: step i's outputs are not computed (NaN); empty: every step attends.
  ReferenceStepper(const Scenario& scenario, const InputTable& inputs, std::vector<bool> attend = {});
  ~ReferenceStepper();
  ReferenceStepper(const ReferenceStepper&) = delete;
  ReferenceStepper& operator=(const ReferenceStepper&) = delete;

  bool done() const;
  StepRecord next();
  // An expected refusal not raised, an unexpected one (so far).
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  struct State;
  void account_prefix_hits(StepRecord& record, const std::vector<std::int64_t>& lengths_before);
  std::vector<std::int64_t> adopt_prefix_hits(const Step& step);
  void record_writes(const std::vector<std::int64_t>& lengths_before, const std::vector<std::int64_t>& hits);
  const Scenario& scenario_;
  std::unique_ptr<State> state_;
  std::vector<bool> attend_;
  std::size_t next_ = 0;
  std::vector<std::string> problems_;
  std::vector<bool> preempted_;
};

// Every step at once (export, goldens, diagnosis), with progress.
ReferenceRun run_reference(const Scenario& scenario, const InputTable& inputs);

// "step 3 (crop, steps[2])": how messages name a step.
std::string step_label(const Step& step, std::size_t index);
// The same, with "after forward 2" for a record of a chunked append's forward.
std::string step_label(const StepRecord& record, std::size_t index);

}  // namespace kvcheck
