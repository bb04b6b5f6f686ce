// SPEC 9.2.6, path consistency, in the one checker: a token computed in a decode step and
// the same token computed inside a chunk, over the same stored cache, must agree within
// twice check 2's tolerance. Engines pick other kernels, tiles and roundings for the two
// paths (FA3's FP8 decode tile of 96 keys, vLLM #54035), and each path alone may look fine.
//
// "The same token" is the same context key (content "prefix": equal ids and extras give
// bit-identical inputs); "the same stored cache" is the same expected output, bit for bit.
// Under content "uid" no token repeats, so there is nothing to compare.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tools/harness/check/sub_check.h"
#include "tools/harness/check/diagnosis.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// One token's outputs in one layer, as check 2 judged them.
struct PathToken {
  int layer = 0, row = 0;
  std::size_t step = 0;
  std::int64_t index = 0, uid = 0;
  bool decode = false;           // its step appended one token per row; else inside a longer chunk
  std::uint64_t context = 0;     // its context key
  std::span<const float> out;    // [H * D], the cache's
  std::span<const double> want;  // [H * D], what check 2 held it to
  std::span<const double> allowed;  // [H * D], the error check 2 allowed each element
};

class PathChecks : public SubCheck {
 public:
  explicit PathChecks(const Scenario& scenario);
  // Worth feeding: some token may be computed on both paths.
  bool enabled() const { return enabled_; }
  // Compares the token with the other path's first computation of it; a disagreement goes
  // to evidence.paths.
  void record(const PathToken& token, StepEvidence& evidence);
  // Disagreements found at a later step whose other side is at `step`, told from `step`'s
  // side: the earlier step's diagnosis learns of them only when the later one runs.
  std::vector<PathIssue> found_later_for(std::size_t step) const;
  // Its evidence comes from the output comparison (record): nothing to look at before it.
  void check(const StepRecord&, CacheView&, StepEvidence&) override {}
  void add_checks(Outcome& outcome) const override;

 private:
  struct Seen {
    std::size_t step;
    std::int64_t index, uid;
    std::uint64_t want_hash;
    std::vector<float> out, allowed;
  };
  bool enabled_ = false;
  int head_dim_ = 1;
  // (layer, context key, path) -> the first computations of that token on that path, one
  // per distinct expected output.
  std::map<std::tuple<int, std::uint64_t, bool>, std::vector<Seen>> seen_;
  std::vector<PathIssue> later_;  // issues whose earlier side is at another step, for found_later_for
  std::int64_t compared_ = 0, failures_ = 0;
  std::string first_;
};

}  // namespace kvcheck
