// The harness bites: every mutant of the bug zoo is caught on the fixtures that expose it
// and diagnosed with its class, at the step and token worked out by hand below.
#include <gtest/gtest.h>

#include "tools/catalog/catalog.h"
#include "tools/harness/sources/in_process_source.h"
#include "tools/harness/outputs/diagnose_report.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/zoo/zoo.h"

using namespace kvcheck;

namespace {

struct FixtureRun {
  Scenario scenario;
  InputTable inputs;
  ReferenceRun reference;
};

FixtureRun load(const std::string& fixture) {
  FixtureRun r{load_scenario(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios/" + fixture + ".json"), {}, {}};
  r.inputs = load_inputs(r.scenario);
  r.reference = run_reference(r.scenario, r.inputs);
  return r;
}

CacheTrace trace(const std::string& fixture, const std::string& cache, bool picture = false) {
  const FixtureRun r = load(fixture);
  return trace_cache(r.scenario, r.inputs, r.reference, *find_cache(cache), picture);
}

const Check& check_named(const Outcome& o, const std::string& name) {
  for (const Check& c : o.checks)
    if (c.name == name) return c;
  throw std::runtime_error("no check " + name);
}

const SlotRow& first_bad_slot(const StepDiagnosis& f) {
  for (const SlotRow& r : f.slots)
    if (!is_fine(r.verdict)) return r;
  throw std::runtime_error("no slot flagged");
}

}  // namespace

TEST(Zoo, EveryMutantIsCaughtAndClassified) {
  ASSERT_GE(zoo_mutants().size(), 12u);
  for (const ZooMutant& m : zoo_mutants()) {
    ASSERT_FALSE(m.fixtures.empty()) << m.cache.name;
    for (const std::string& fixture : m.fixtures) {
      const CacheTrace t = trace(fixture, m.cache.name);
      EXPECT_FALSE(t.outcome.passed()) << m.cache.name << " escaped on " << fixture;
      ASSERT_TRUE(t.first.has_value()) << m.cache.name << " on " << fixture;
      EXPECT_EQ(class_name(t.first->bug), std::string(class_name(m.expected))) << m.cache.name << " on " << fixture;
    }
  }
}

TEST(Zoo, MutantsAreNotRealCaches) {
  for (const CacheEntry& real : real_caches()) EXPECT_EQ(real.name.rfind("zoo/", 0), std::string::npos);
  for (const ZooMutant& m : zoo_mutants()) EXPECT_EQ(m.cache.name.rfind("zoo/", 0), 0u);
}

// sink_decode_through_windows: S = 2, W = 6, a prompt of 3 (step 0), then one token per
// step, so token t arrives in step t - 2 and the first eviction is token 6, in step 4.
TEST(Zoo, NewKeyNotShiftedFailsThePositionCheckAtTheFirstEviction) {
  const CacheTrace t = trace("sink_decode_through_windows", "zoo/new_key_not_shifted");
  EXPECT_FALSE(check_named(t.outcome, "positions").passed);  // not only the outputs
  EXPECT_FALSE(check_named(t.outcome, "outputs").passed);
  EXPECT_GT(t.outcome.position_mismatches, 0);
  ASSERT_TRUE(t.first);
  EXPECT_EQ(t.first->evidence.step, 4u);
  EXPECT_EQ(t.first->query_index, 6);
  const SlotRow& bad = first_bad_slot(*t.first);
  EXPECT_EQ(bad.index, 6);                 // the new key itself
  EXPECT_EQ(bad.position_claimed, 6);      // kept its absolute position
  EXPECT_EQ(bad.position_expected, 5);     // t - E = 6 - 1
  EXPECT_EQ(bad.position_recovered, "6");  // and the tensor agrees with the claim
}

TEST(Zoo, ShiftOneEarlyDivergesBeforeAnyEviction) {
  // Token W - 1 = 5 (step 3) fills the cache without evicting; the mutant shifts anyway.
  const CacheTrace t = trace("sink_decode_through_windows", "zoo/shift_one_early");
  ASSERT_TRUE(t.first);
  EXPECT_EQ(t.first->evidence.step, 3u);
  EXPECT_EQ(t.first->query_index, 5);
  const SlotRow& bad = first_bad_slot(*t.first);
  EXPECT_EQ(bad.index, 2);  // the first window key, right after the two sinks
  EXPECT_EQ(*bad.distance_actual - *bad.distance_expected, 1);
}

TEST(Zoo, WindowOffByOneSeesTheTokenJustOutside) {
  // sliding_baseline: W = 6, prompt 4 (step 0); token 6 arrives in step 3 and must not see token 0.
  const CacheTrace t = trace("sliding_baseline", "zoo/window_off_by_one");
  ASSERT_TRUE(t.first);
  EXPECT_EQ(t.first->evidence.step, 3u);
  EXPECT_EQ(t.first->query_index, 6);
  const SlotRow& bad = first_bad_slot(*t.first);
  EXPECT_EQ(bad.index, 0);
  EXPECT_TRUE(bad.visible_actual);
  EXPECT_FALSE(bad.visible_expected);
}

TEST(Zoo, StaleRowsShowAtTheResize) {
  // sink_batch_resize_reset: append 10, decode 2 (steps 1, 2), reset to 3 rows (step 3).
  const CacheTrace t = trace("sink_batch_resize_reset", "zoo/stale_rows_on_resize");
  ASSERT_TRUE(t.first);
  EXPECT_EQ(t.first->evidence.step, 3u);
  EXPECT_EQ(first_bad_slot(*t.first).verdict, SlotVerdict::stale);
}

TEST(Zoo, RealCachesHaveNoDivergence) {
  const CacheTrace t = trace("sink_decode_through_windows", "sink_shift", true);
  EXPECT_TRUE(t.outcome.passed());
  EXPECT_FALSE(t.first.has_value());
  EXPECT_EQ(t.picture.size(), 31u);  // one column per step: the prompt, then 30 decodes
}

TEST(Zoo, HtmlPageShowsTheClassAndThePicture) {
  const FixtureRun r = load("sink_decode_through_windows");
  const CacheTrace t = trace_cache(r.scenario, r.inputs, r.reference, *find_cache("zoo/new_key_not_shifted"), true);
  ASSERT_EQ(t.picture.size(), 31u);  // 1 prompt step + 30 decode steps
  const std::string html = diagnosis_html(r.scenario, "zoo/new_key_not_shifted", t);
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_NE(html.find("Class: new key not shifted"), std::string::npos);
  // The newest slot of step 4 is drawn as a wrong position.
  EXPECT_NE(html.find("step 4 slot 5: uid 12, distance off by -1"), std::string::npos);
}
