// SPEC 9.2.4, the precision map, in the one checker: after each step, which retained tokens
// a quantized cache holds raw (its residual) and which quantized follows the scenario's
// residual, flush and prefill rules, token by token, as integers.
#pragma once

#include <cstdint>
#include <string>

#include "tools/harness/check/sub_check.h"
#include "tools/harness/check/cache_view.h"
#include "tools/harness/check/diagnosis.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

class PrecisionChecks : public SubCheck {
 public:
  explicit PrecisionChecks(const Scenario& scenario) : s_(scenario) {}
  // Compares every retained slot whose source shows its precision (raw, or codes) with the
  // reference's; a mismatch goes to evidence.precision.
  // A layer that quantizes nothing (a null entry of a per-layer kv_quant) holds every token
  // in kv_dtype: it has no precision to check.
  void check(const StepRecord& record, CacheView& view, StepEvidence& evidence) override;
  void add_checks(Outcome& outcome) const override;

 private:
  const Scenario& s_;
  std::int64_t failures_ = 0, checked_ = 0, raw_seen_ = 0;
  std::string first_;
};

}  // namespace kvcheck
