// SPEC 9.2.3: the bound of a quantized cache's outputs against R_ideal is built, per query,
// from each visible key's and value's own error, and a key stored again at every shift
// (or flush) carries the error of every store. Expected values are worked by hand from
// SPEC 9's table; the drift test holds the bound to the reference's own simulated keys.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference/rope.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/check/quant_checks.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {
namespace {

TensorQuant format(QuantFormat f, QuantScale scale = {}) {
  TensorQuant q;
  q.format = f;
  q.scale = scale;
  return q;
}

TEST(QuantBound, OneStoreOfAKeyWorkedByHand) {
  std::string why;
  // int8, a scale per token from the amax 2.54: s = 2.54 / 127 = 0.02, which a float16 or
  // float32 rounding may raise by 2^-10; half a step in each of 4 elements: sqrt(4) s / 2.
  const double s = 0.02 * (1 + 0x1p-10);
  EXPECT_DOUBLE_EQ(stored_key_error(format(QuantFormat::int8), false, KvDtype::float32, 4, 2.54, 4.0, 1, why), s);
  // fp8 e4m3 under a static scale 0.05: relative 2^-4 of the norm 12, plus the subnormal
  // floor 0.05 2^-10 in each of 4 elements.
  const QuantScale fixed{ScaleGranularity::tensor, 0, ScaleDtype::float32, ScaleRule::fixed, {0.05}};
  EXPECT_DOUBLE_EQ(stored_key_error(format(QuantFormat::fp8_e4m3, fixed), false, KvDtype::float32, 4, 10.0, 12.0, 1, why),
                   12.0 / 16 + 2 * 0.05 / 1024);
  EXPECT_TRUE(why.empty());
  // 30 is beyond e4m3's 448 steps of 0.05 (22.4): saturated, no bound.
  EXPECT_TRUE(std::isinf(
      stored_key_error(format(QuantFormat::fp8_e4m3, fixed), false, KvDtype::float32, 4, 30.0, 31.0, 1, why)));
  EXPECT_NE(why.find("saturate"), std::string::npos) << why;
  // A float16 key: each element rounds relatively, so the error's norm is 2^-11 of the key's.
  EXPECT_DOUBLE_EQ(stored_key_error(std::nullopt, false, KvDtype::float16, 4, 3.0, 5.0, 1, why), 5.0 * 0x1p-11);
}

TEST(QuantBound, EachStoreAddsItsErrorToTheRowAsItThenIs) {
  std::string why;
  // Twice: the second store quantizes a row grown by the first's error, and the rotation
  // between them rounds in float32 (2^-24 of the norm, twice).
  const double e1 = 0.02 * (1 + 0x1p-10);
  const double e2 = (2.54 + e1) / 127 * (1 + 0x1p-10) + 2 * 0x1p-24 * (4.0 + e1);
  EXPECT_DOUBLE_EQ(stored_key_error(format(QuantFormat::int8), false, KvDtype::float32, 4, 2.54, 4.0, 2, why), e1 + e2);
  // A q8_0 value element of 1.27: d = 1.27 / 127 (to float16: up to 2^-10 more), d / 2 plus
  // float16's rounding of d, 127 d 2^-11.
  const double d = 0.01 * (1 + 0x1p-10);
  EXPECT_DOUBLE_EQ(stored_value_error(format(QuantFormat::q8_0), false, KvDtype::float32, 32, 1.27, 2.0, 1, why),
                   d / 2 + 127 * d * 0x1p-11);
}

// A key kept through a window of 128 under evict 1 is shifted more than a hundred times:
// its simulated error outgrows what one store may lose, and stays within what every store
// together may.
TEST(QuantBound, AKeyShiftedAHundredTimesDriftsBeyondOneStoreButNotBeyondTheBound) {
  const Scenario s = load_scenario(std::string(KVCHECK_SOURCE_DIR) + "/tests/data/quant_shift_drift.json");
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const StepRecord& last = run.steps.back();
  const auto& kept = last.retained_in(0, 0).keys;
  ASSERT_EQ(last.stored.size(), 1u);
  ASSERT_EQ(last.stored[0][0].size(), kept.size());
  const int D = s.dims.head_dim;
  int most_shifts = 0;
  double worst_against_one_store = 0.0;
  std::string why;
  for (std::size_t k = 0; k < kept.size(); ++k) {
    const reference::StoredLayer& stored = last.stored[0][0][k];
    const float* raw = inputs.k_at(0, kept[k].uid, 0);
    const std::vector<double> ideal =
        reference::rotate(std::vector<double>(raw, raw + D), static_cast<double>(kept[k].position), s.rope(0));
    double error = 0.0, norm = 0.0;
    for (int d = 0; d < D; ++d) {
      error += (stored.heads[0].key[d] - ideal[d]) * (stored.heads[0].key[d] - ideal[d]);
      norm += ideal[d] * ideal[d];
    }
    error = std::sqrt(error), norm = std::sqrt(norm);
    const int times = 1 + stored.shifts + stored.flushes;
    most_shifts = std::max(most_shifts, stored.shifts);
    // Under the transform an element of what is quantized is at most the row's norm.
    const double once = stored_key_error(s.quant(0).k, true, s.kv_dtype, D, norm, norm, 1, why);
    const double every = stored_key_error(s.quant(0).k, true, s.kv_dtype, D, norm, norm, times, why);
    EXPECT_LE(error, every) << "key " << kept[k].index << " after " << stored.shifts << " shifts";
    worst_against_one_store = std::max(worst_against_one_store, error / once);
  }
  EXPECT_GE(most_shifts, 100);
  EXPECT_GT(worst_against_one_store, 1.0) << "no key drifted beyond one store's error: the scenario shows nothing";
}

}  // namespace
}  // namespace kvcheck
