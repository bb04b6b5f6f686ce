#include "tools/harness/check/path_checks.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace kvcheck {

namespace {

// FNV-1a over the doubles' bytes: equal expected outputs, bit for bit, mean the same stored
// cache was read (a per-tensor scale or a flush that differs between the paths changes them).
std::uint64_t hash_of(std::span<const double> values) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const double v : values) {
    unsigned char bytes[sizeof v];
    std::memcpy(bytes, &v, sizeof v);
    for (const unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  }
  return h;
}

const char* path_name(bool decode) { return decode ? "in a decode step" : "inside a chunk"; }

}  // namespace

PathChecks::PathChecks(const Scenario& s) : head_dim_(s.dims.head_dim) {
  // Raw chunk reads attend a chunk's own tokens unquantized: its paths differ by design.
  const bool raw_reads = s.quantized() && s.quant_rules().chunk_reads == ChunkReads::raw;
  enabled_ = s.content == Content::prefix && !raw_reads;
}

void PathChecks::record(const PathToken& t, StepEvidence& evidence) {
  if (!enabled_) return;
  const std::uint64_t want_hash = hash_of(t.want);
  // The other path's computation of this token over the same stored cache, if any.
  const auto other = seen_.find({t.layer, t.context, !t.decode});
  if (other != seen_.end())
    for (const Seen& s : other->second) {
      if (s.want_hash != want_hash) continue;
      ++compared_;
      for (std::size_t e = 0; e < t.out.size(); ++e) {
        const double gap = std::abs(static_cast<double>(t.out[e]) - s.out[e]);
        const double allowed = t.allowed[e] + s.allowed[e];
        if (gap <= allowed) continue;  // NaN fails
        const int head = static_cast<int>(e) / head_dim_, dim = static_cast<int>(e) % head_dim_;
        const PathIssue issue{t.layer, t.row,   t.step,   t.index, t.uid,     t.decode,   s.step,
                              s.index, s.uid,   head,     dim,     t.out[e], s.out[e], allowed};
        if (failures_++ == 0)
          first_ = fmt::format(
              "{}: layer {} row {} token {} (uid {}) head {} dim {}: {:.9g} computed {}, {:.9g} {} at step {} "
              "(token {}, uid {}) over the same stored cache; they differ by {:.3g}, more than twice check 2's "
              "tolerance ({:.3g})",
              evidence.label, t.layer, t.row, t.index, t.uid, head, dim, t.out[e], path_name(t.decode), s.out[e],
              path_name(!t.decode), s.step, s.index, s.uid, gap, allowed);
        if (evidence.paths.size() < 64) evidence.paths.push_back(issue);
        if (later_.size() < 64) later_.push_back(issue);
        break;  // one element per token pair is enough to name it
      }
      break;
    }
  auto& mine = seen_[{t.layer, t.context, t.decode}];
  for (const Seen& s : mine)
    if (s.want_hash == want_hash) return;  // the first computation on this path speaks for it
  // Allowances kept in float, rounded up: a pair within both check 2 tolerances stays within their sum.
  std::vector<float> allowed(t.allowed.size());
  for (std::size_t e = 0; e < allowed.size(); ++e) {
    const auto a = static_cast<float>(t.allowed[e]);
    allowed[e] = a < t.allowed[e] ? std::nextafter(a, std::numeric_limits<float>::infinity()) : a;
  }
  mine.push_back({t.step, t.index, t.uid, want_hash, std::vector<float>(t.out.begin(), t.out.end()), std::move(allowed)});
}

std::vector<PathIssue> PathChecks::found_later_for(std::size_t step) const {
  std::vector<PathIssue> out;
  for (const PathIssue& i : later_) {
    if (i.other_step != step || i.step == step) continue;
    // Told from `step`'s side: its computation first.
    PathIssue& mine = out.emplace_back(i);
    std::swap(mine.step, mine.other_step);
    std::swap(mine.index, mine.other_index);
    std::swap(mine.uid, mine.other_uid);
    std::swap(mine.here, mine.there);
    mine.decode = !i.decode;
  }
  return out;
}

void PathChecks::add_checks(Outcome& outcome) const {
  if (compared_ == 0) return;  // no token was computed on both paths over the same cache
  outcome.checks.push_back(
      {"path consistency", failures_ == 0,
       failures_ ? first_
                 : fmt::format("{} tokens computed both in a decode step and inside a chunk, over the same stored "
                               "cache, agree within twice check 2's tolerance",
                               compared_)});
}

}  // namespace kvcheck
