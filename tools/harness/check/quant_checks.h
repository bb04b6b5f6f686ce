// The quantized-storage checks of SPEC 9.2, in the one checker: codes and scales exactly
// (9.2.1), outputs within the format's derived bound of R_ideal (9.2.3), and the error
// reported against the format's own (NMSE). Outputs against R_stored (9.2.2) are the
// checker's output check, with the allowance row_allowance() gives.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "reference/quantize.h"
#include "tools/harness/check/sub_check.h"
#include "tools/harness/check/cache_view.h"
#include "tools/harness/check/diagnosis.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// How far a stored key's elements may be from the key the cache was given, relative to its
// largest element: the storage's unit roundoff, or the layer's quantized format's worst step.
double key_roundoff(const Scenario& scenario, int layer);
double value_roundoff(const Scenario& scenario, int layer);

// The optimized caches' row format for a scenario's quantized tensor.
optimized::RowFormat row_format(const TensorQuant& quant, QuantTransform transform);

// A key written and shifted within one step shows only its codes after the shifts: those
// of its write may have taken a rounding boundary the other way. Tries the neighbouring
// code of each element of the write (at `path.front()`) that sat near a boundary (the
// first 16 such), through the shifts along `path`; the codes that reproduce `stored`, or
// nullopt.
std::optional<reference::QuantizedRow> codes_through_write_boundary(const TensorQuant& format, QuantTransform transform,
                                                                    const Rope& rope, const float* raw, int head_dim,
                                                                    int kv_head, const std::vector<std::int64_t>& path,
                                                                    const reference::QuantizedRow& stored);

// 9.2.1's allowance for a computed scale: whether `actual`, stored for group g where the
// reference expected expected.scales[g], is one a cache's float32 arithmetic may compute.
// Affine int4 / int2 (when the reference gave the group's window): a value of the scale
// dtype within [scale_min, scale_max], in a group flagged near a boundary; else, where
// flagged, its dtype's last bit (float16: 2^-10 relative, float32: 2^-19).
bool stored_scale_accepted(const TensorQuant& format, const reference::QuantizedRow& expected, std::size_t g,
                           double actual);
// The same for an affine group's zero point, stored with the scale `actual_scale`: the
// reference's round(-min / S) over that S, for every min within the group's window (codes
// read back from a cache carry no window: then one off, where the scale moved
// (`scale_moved`) or was flagged).
// Whether a cache's stored bias and scale of a group are ones the format's rule gives.
struct BiasedGroupVerdict {
  bool bias = false, scale = false;
};
// SPEC 9.7: mlx_affine's for the group's elements each moved by at most the window: the bias
// is the edge so moved (either extreme where |min| and |max| nearly tie, or 0 where q0 may
// round to 0), and the scale that bias over an integer q0 in reach, in float32.
BiasedGroupVerdict mlx_group_accepted(const reference::QuantizedRow& expected, std::size_t g, int bits, double scale,
                                      double bias);
// SPEC 9.8: quanto_affine's: the bias is the minimum moved by at most the window, the scale
// (max - min) / n over a range moved by at most twice it (0 only where that range may be 0).
BiasedGroupVerdict quanto_group_accepted(const reference::QuantizedRow& expected, std::size_t g, int bits,
                                         ScaleDtype dtype, double scale, double bias);
bool stored_zero_accepted(const TensorQuant& format, const reference::QuantizedRow& expected, std::size_t g,
                          double actual_scale, int actual_zero, bool scale_moved);

// SPEC 9.2.3's error of a row stored `times` over (its write, each shift through the
// format, each flush), each store adding the format's error for the row as it then is.
// Keys: a bound on the error vector's 2-norm (sqrt(sum_d e(k_d)^2)); values: on one
// element's error. `element` bounds the row's largest element, `norm` its 2-norm (a
// rotation keeps both); `transformed`: stored under the Hadamard transform. Without a
// format the row is rounded to kv_dtype. `scale`: the scale a frozen ("first_append") row
// was stored with (0: the format's rule gives it). Infinite when a static or frozen scale
// saturates, with `saturation` saying why.
double stored_key_error(const std::optional<TensorQuant>& format, bool transformed, KvDtype kv_dtype, int head_dim,
                        double element, double norm, int times, std::string& saturation, double scale = 0.0);
double stored_value_error(const std::optional<TensorQuant>& format, bool transformed, KvDtype kv_dtype, int head_dim,
                          double element, double norm, int times, std::string& saturation, double scale = 0.0);

class QuantChecks : public SubCheck {
 public:
  QuantChecks(const Scenario& scenario, const InputTable& inputs);

  // 9.2.1 for every retained slot the view shows codes for: a new key or value as the
  // reference stores it, a kept key unchanged, a shifted key re-quantized from the codes
  // the cache held. Where the cache took the other side of a rounding boundary (then or at
  // an earlier shift), row_allowance() says how far its outputs may move from R_stored.
  void check_codes(const StepRecord& record, const CacheView& view, StepEvidence& evidence);
  // R_stored of row b in layer l recomputed over the codes the cache holds, when they are
  // not the reference's (accepted at a boundary), or with the rotated query the source
  // shows when the attention quantizes it: `out` becomes R_stored with this row's entries
  // replaced, `slack` ([L, B, n, H]) the query's slack. Every token of the row must have
  // seen only keys still kept, and none may have changed precision after the queries read
  // it (a residual's flush under chunk_reads "raw"). False, both left empty: not needed or
  // not possible (use R_stored with row_allowance()).
  bool held_outputs(const StepRecord& record, int layer, int row, const float* rotated_q, std::vector<double>& out,
                    std::vector<double>& slack) const;
  // The allowance of check_codes for one row of one layer (0 when its codes are the reference's).
  double row_allowance(int layer, int row) const {
    const auto found = diverged_.find({layer, row});
    return found == diverged_.end() ? 0.0 : found->second;
  }
  // 9.2.3 for one row of one layer of an append step.
  // The row's first `skipped` tokens were not computed (a prefix hit): no outputs to judge.
  void check_bound(const StepRecord& record, int layer, int row, const float* out, std::size_t skipped,
                   const std::string& label);
  // The first wrong output (row b, token i, head h of layer l) recomputed under a named
  // mistake or convention: does it fit?
  enum class Variant {
    unit_scale,       // every scale read as 1 (scale plumbing)
    quantized_query,  // the query quantized to q8_0 before the dot products (ggml's CPU matmul)
  };
  bool fits(Variant variant, const StepRecord& record, int layer, int row, std::size_t token, int head,
            const float* out, double atol, double rtol) const;
  // How far an output may move when a quantized query (kv_quant "query") is `slack` (2-norm)
  // from the reference's: its codes on a tie may round either way.
  double query_allowance(double slack) const;
  void add_checks(Outcome& outcome) const override;
  void check(const StepRecord& record, CacheView& view, StepEvidence& evidence) override {
    check_codes(record, view, evidence);
  }
  // R_stored over the codes held (held_outputs), else row_allowance(); the quantized
  // query's slack through query_allowance().
  void rule_outputs(const StepRecord& record, int layer, int row, const float* rotated_q,
                    OutputRule& rule) const override;
  // 9.2.3 (check_bound) on the whole step's outputs.
  void check_outputs(const StepRecord& record, int layer, int row, const float* out, std::size_t skipped,
                     StepEvidence& evidence) override;
  // Scale plumbing (every scale read as 1) and, when the scenario does not declare it, a
  // query quantized to q8_0.
  void explain_output(const StepRecord& record, int layer, int row, std::size_t token, int head, const float* out,
                      const Tolerance& tolerance, StepEvidence& evidence) const override;

 private:
  struct Tally {
    std::int64_t failures = 0;
    std::string first;
  };
  std::vector<std::int64_t> positions_seen(const StepRecord& record, std::size_t layer, std::size_t row,
                                           const reference::RetainedKey& key) const;
  // Keeps each key's accepted codes across a reorder or reset.
  void follow_rows(const Step& step);

  const Scenario& s_;
  const InputTable& inputs_;
  using HeldId = std::tuple<int, int, std::int64_t, int>;  // layer, row, uid, kv head
  struct Held {
    std::int64_t position;
    reference::QuantizedRow codes;
    bool as_reference;  // the codes are the reference's own (no boundary taken the other way)
    double weight = 0.0;  // how far outputs over them may move from R_stored (when not the reference's)
    int flushes = 0;      // the reference's count when accepted: a flush quantizes them anew
  };
  // codes_through_write_boundary for a key of the scenario.
  std::optional<reference::QuantizedRow> through_write_boundary(int layer, int kv_head, std::uint64_t uid,
                                                                const std::vector<std::int64_t>& path,
                                                                const optimized::UnpackedRow& stored) const;
  std::map<HeldId, Held> held_;                 // the codes the cache holds, as accepted
  // The reference's codes of a held key whose accepted codes are not the reference's: the
  // start of the reference's chain when the key's next stores are followed one by one.
  std::map<HeldId, reference::QuantizedRow> reference_key_codes_;
  // Value codes accepted though not the reference's, and how far outputs over them may move.
  struct HeldValue {
    reference::QuantizedRow codes;
    double weight = 0.0;
    int flushes = 0;  // the reference's count when accepted
  };
  std::map<HeldId, HeldValue> held_values_;
  // Scales along the token axis: where a quantization of this step read a row the cache held
  // off the reference's codes, every row of it as the cache's held rows make it (uid -> codes),
  // for one tensor of (layer, row, kv head); empty elsewhere (the reference's codes stand).
  std::map<std::uint64_t, reference::QuantizedRow> requantized_together(const TensorQuant& format, bool value,
                                                                        const StepRecord& record, int layer, int row,
                                                                        int kv_head) const;
  // `codes` quantized again `times` over at a residual's flush (flush "requantize_all").
  reference::QuantizedRow requantized(const TensorQuant& format, reference::QuantizedRow codes, int kv_head,
                                      std::int64_t position, int times) const;
  // A residual's precision of each kept token (raw, flushes) as last seen (kv head 0), and the
  // (layer, row)s where it changed in a step whose queries read before the flush (chunk_reads "raw").
  std::map<HeldId, std::pair<bool, int>> precision_seen_;
  std::set<std::pair<int, int>> flushed_after_reads_;
  std::map<std::pair<int, int>, double> diverged_;  // (layer, row) whose codes are not the reference's this step
  // 9.2.3 per query: each token's key and value magnitudes, which a rotation keeps (the key's
  // largest pair norm and its norm, times the rope's magnitude), from the inputs.
  struct Magnitude {
    double key_element = 0.0, key_norm = 0.0, value_element = 0.0, value_norm = 0.0;
  };
  std::vector<Magnitude> magnitudes_;  // [layer][uid][kv head]
  // The largest key and value elements of any token, per [layer][kv head]: under scales along
  // the token axis a channel's scale comes from the other tokens of its run, so a row's own
  // magnitude does not bound its error.
  std::vector<Magnitude> widest_;
  const Magnitude& magnitude(int layer, std::uint64_t uid, int kv_head) const;
  // How often each kept key and value has been quantized or rounded (its write, each shift,
  // each flush), as last seen; (layer, row, uid, kv head). Each time adds the format's error again.
  struct TimesStored {
    int key = 1, value = 1;
    std::int64_t position = 0;             // where the key was kept
    double key_scale = 0, value_scale = 0;  // a frozen scale it was stored with (0: none)
  };
  std::map<HeldId, TimesStored> times_stored_;
  // The bound on the 2-norm of a stored key's error (quantized `times` over), and on one
  // element of a stored value's; infinite when a static scale saturates (saturation_ says).
  // `widest`: the largest of its layer and kv head (for scales along the token axis).
  double key_error(int layer, const Magnitude& m, const Magnitude& widest, int times, double scale);
  double value_error(int layer, const Magnitude& m, const Magnitude& widest, int times, double scale);
  double largest_bound_ = 0.0, smallest_bound_ = std::numeric_limits<double>::infinity();
  std::int64_t saturated_rows_ = 0;  // (step, layer, row)s not judged: a scale may saturate
  std::int64_t bounded_outputs_ = 0;                   // output elements judged
  std::string saturation_;    // why the bound did not apply, the first time
  // Global maxima, for the allowances of codes taken at a boundary.
  double q_norm_ = 0.0, k_norm_ = 0.0, v_range_ = 0.0;
  Tally codes_, bound_tally_;
  std::int64_t codes_checked_ = 0, codes_on_boundary_ = 0;
  double sum_sq_cache_ = 0.0, sum_sq_format_ = 0.0, sum_sq_ideal_ = 0.0;
};

}  // namespace kvcheck
