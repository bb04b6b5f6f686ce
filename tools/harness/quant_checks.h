// The quantized-storage checks of SPEC 9.2, in the one checker: codes and scales exactly
// (9.2.1), outputs within the format's derived bound of R_ideal (9.2.3), and the error
// reported against the format's own (NMSE). Outputs against R_stored (9.2.2) are the
// checker's output check, with the allowance check_codes() returns.
#pragma once

#include <cstdint>
#include <string>

#include "tools/harness/cache_view.h"
#include "tools/harness/diagnosis.h"
#include "tools/harness/reference_run.h"
#include "tools/harness/report.h"
#include "tools/harness/scenario.h"

namespace kvcheck {

// How far a stored key's elements may be from the key the cache was given, relative to its
// largest element: the storage's unit roundoff, or a quantized format's worst step.
double key_roundoff(const Scenario& scenario);

// The optimized caches' row format for a scenario's quantized tensor.
optimized::RowFormat row_format(const TensorQuant& quant, QuantTransform transform);

class QuantChecks {
 public:
  QuantChecks(const Scenario& scenario, const InputTable& inputs);

  // 9.2.1 for every retained slot the view shows codes for. Returns how far outputs may
  // move because the cache took the neighbouring code of a value on a rounding boundary.
  double check_codes(const StepRecord& record, const CacheView& view, StepEvidence& evidence);
  // 9.2.3 for one row of one layer of an append step.
  void check_bound(const StepRecord& record, int layer, int row, const float* out, const std::string& label);
  // The first wrong output (row b, token i, head h of layer l) recomputed with every scale
  // read as 1: does it fit?
  bool fits_unit_scale(const StepRecord& record, int layer, int row, std::size_t token, int head, const float* out,
                       double atol, double rtol) const;
  void add_checks(Outcome& outcome) const;

 private:
  struct Tally {
    std::int64_t failures = 0;
    std::string first;
  };
  const Scenario& s_;
  const InputTable& inputs_;
  double bound_ = 0.0;        // 9.2.3, before the float tolerance; infinite when values saturate
  std::string saturation_;    // why the bound does not apply
  double q_norm_ = 0.0, v_range_ = 0.0;
  Tally codes_, bound_tally_;
  std::int64_t codes_checked_ = 0, codes_on_boundary_ = 0;
  double sum_sq_cache_ = 0.0, sum_sq_format_ = 0.0, sum_sq_ideal_ = 0.0;
};

}  // namespace kvcheck
