// The paged-cache checks of SPEC 8.8, in the one checker: slots and a trace's slot
// mapping (8.8.1), tables (8.8.2), refcounts (8.8.3), isolation of shared blocks (8.8.4),
// no read of a block before its write (8.8.5, through hits) and hit accounting (8.8.7), as
// integers from the tables and the slots' metadata. Positions after reuse (8.8.6) and outputs are the checker's own
// checks, run after these on the same view.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tools/harness/check/sub_check.h"
#include "tools/harness/check/cache_view.h"
#include "tools/harness/check/diagnosis.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

class PagedChecks : public SubCheck {
 public:
  explicit PagedChecks(const Scenario& scenario) : s_(scenario) {}

  // Checks a step's paged view. A slot that a row reaches through a shared or hit block
  // holds the uid of the row that wrote it: where its context key is the row's own token's
  // at that index (SPEC 8.1, value identity by context key), the slot's uid and the log's
  // become the row's own, so the checker's other checks see the row's tokens. Sets
  // view.uncomputed to the rows' hits.
  void check(const StepRecord& record, CacheView& view, StepEvidence& evidence) override;
  void add_checks(Outcome& outcome) const override;

 private:
  struct Tally {
    std::int64_t failures = 0;
    std::string first;
  };
  void fail(StepEvidence& evidence, PagedIssue issue);
  void check_hits(const StepRecord& record, const CacheView& view, StepEvidence& evidence);
  void check_layer(const StepRecord& record, CacheView& view, int layer, StepEvidence& evidence);
  void check_ring(const StepRecord& record, CacheView& view, int layer, std::size_t row, StepEvidence& evidence);
  void check_slot_mapping(const StepRecord& record, const CacheView& view, int layer, StepEvidence& evidence);
  void check_refcounts(const CacheView& view, int layer, StepEvidence& evidence);
  void check_isolation(const CacheView& view, int layer, StepEvidence& evidence);

  const Scenario& s_;
  // [layer] block -> its slots' (offset, uid) when the step ended with the block shared:
  // no row may write into it until it is copied (8.8.4).
  std::vector<std::map<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>>> shared_;
  Tally tally_;
  std::int64_t steps_checked_ = 0, hits_seen_ = 0;
  bool hits_checked_ = false;  // the current append's hits, at its first forward
};

}  // namespace kvcheck
