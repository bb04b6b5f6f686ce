#include "tools/harness/cache_checks.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "reference/rope.h"

namespace kvcheck {

using optimized::AttentionLog;
using optimized::CacheRefusal;
using optimized::KvCache;
using optimized::SlotMeta;

ChunkBuffers make_chunk(const Scenario& s, const InputTable& inputs, const reference::AppendResult& step) {
  const int L = s.dims.layers, H = s.dims.heads, Hkv = s.dims.kv_heads, D = s.dims.head_dim;
  const int B = static_cast<int>(step.rows.size());
  const std::int64_t n = step.chunk;
  ChunkBuffers c;
  c.chunk.length = n;
  c.chunk.uids.assign(static_cast<std::size_t>(B) * n, -1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  c.q.assign(L, std::vector<float>(static_cast<std::size_t>(B) * n * H * D, nan));
  c.k.assign(L, std::vector<float>(static_cast<std::size_t>(B) * n * Hkv * D, nan));
  c.v = c.k;
  for (int b = 0; b < B; ++b) {
    const auto& row = step.rows[b];
    c.chunk.counts.push_back(static_cast<std::int64_t>(row.size()));
    const std::int64_t pad = n - static_cast<std::int64_t>(row.size());
    for (std::size_t i = 0; i < row.size(); ++i) {
      const std::size_t token = static_cast<std::size_t>(b) * n + pad + i;
      c.chunk.uids[token] = static_cast<std::int64_t>(row[i].uid);
      for (int l = 0; l < L; ++l) {
        std::copy_n(inputs.q_at(l, row[i].uid, 0), H * D, c.q[l].begin() + token * H * D);
        std::copy_n(inputs.k_at(l, row[i].uid, 0), Hkv * D, c.k[l].begin() + token * Hkv * D);
        std::copy_n(inputs.v_at(l, row[i].uid, 0), Hkv * D, c.v[l].begin() + token * Hkv * D);
      }
    }
  }
  for (int l = 0; l < L; ++l) {
    c.chunk.q.push_back(c.q[l].data());
    c.chunk.k.push_back(c.k[l].data());
    c.chunk.v.push_back(c.v[l].data());
  }
  return c;
}

namespace {

// One check's tally and its first failure.
struct Tally {
  std::int64_t failures = 0;
  std::string first;
  void fail(std::string detail) {
    if (failures++ == 0) first = std::move(detail);
  }
};

// The largest token count any row reaches: a static cache's capacity.
std::int64_t longest_row(const ReferenceRun& run) {
  std::int64_t longest = 1;
  for (const StepRecord& r : run.steps)
    if (r.append)
      for (const auto& row : r.append->rows)
        if (!row.empty()) longest = std::max(longest, row.back().index + 1);
  return longest;
}

class CacheRun {
 public:
  CacheRun(const Scenario& s, const InputTable& inputs, const ReferenceRun& run)
      : s_(s), inputs_(inputs), run_(run) {}

  Outcome operator()(const CacheEntry& entry) {
    std::unique_ptr<KvCache> cache = entry.make(cache_config(s_, longest_row(run_)));
    for (std::size_t i = 0; i < run_.steps.size(); ++i) {
      const StepRecord& rec = run_.steps[i];
      label_ = step_label(rec.step, i);
      try {
        apply(*cache, rec);
        if (!rec.refused.empty())
          refusals_.fail(fmt::format("{}: the cache accepted a step the policy refuses ({}: {})", label_, rec.refused,
                                     rec.refusal_message));
      } catch (const CacheRefusal& e) {
        if (e.code != rec.refused) {
          refusals_.fail(fmt::format("{}: the cache refused with \"{}\" ({}){}", label_, e.code, e.what(),
                                     rec.refused.empty() ? ", the reference accepts the step"
                                                         : ", the reference refuses with \"" + rec.refused + "\""));
          break;  // the cache and the reference no longer hold the same rows
        }
      }
      if (cache->batch() != static_cast<int>(rec.retained.size())) {
        retained_.fail(fmt::format("{}: the cache has {} rows, the reference {}", label_, cache->batch(),
                                   rec.retained.size()));
        break;
      }
      check_slots(*cache, rec);
    }
    return outcome(entry.name);
  }

 private:
  void apply(KvCache& cache, const StepRecord& rec) {
    switch (rec.step.op) {
      case StepOp::append: append(cache, rec); break;
      case StepOp::reorder: cache.reorder(rec.step.rows); break;
      case StepOp::reset: cache.reset(*rec.step.batch); break;
      case StepOp::crop: cache.crop(rec.step.length); break;
    }
  }

  void append(KvCache& cache, const StepRecord& rec) {
    const reference::AppendResult& ref = *rec.append;
    const int L = s_.dims.layers, H = s_.dims.heads, D = s_.dims.head_dim;
    const int B = static_cast<int>(ref.rows.size());
    const std::int64_t n = ref.chunk;
    ChunkBuffers buffers = make_chunk(s_, inputs_, ref);
    std::vector<std::vector<float>> out(L, std::vector<float>(static_cast<std::size_t>(B) * n * H * D,
                                                             std::numeric_limits<float>::quiet_NaN()));
    std::vector<float*> out_ptrs;
    for (auto& o : out) out_ptrs.push_back(o.data());
    AttentionLog log;
    cache.append(buffers.chunk, out_ptrs, &log);
    compare_outputs(ref, out);
    compare_distances(rec, log);
  }

  void compare_outputs(const reference::AppendResult& ref, const std::vector<std::vector<float>>& out) {
    const int L = s_.dims.layers, H = s_.dims.heads, D = s_.dims.head_dim;
    const int B = static_cast<int>(ref.rows.size());
    const std::int64_t n = ref.chunk;
    for (int l = 0; l < L; ++l)
      for (int b = 0; b < B; ++b) {
        const std::int64_t pad = n - static_cast<std::int64_t>(ref.rows[b].size());
        for (std::size_t i = 0; i < ref.rows[b].size(); ++i)
          for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d) {
              const std::size_t at = (((static_cast<std::size_t>(l) * B + b) * n + pad + i) * H + h) * D + d;
              const double want = ref.out[at];
              const double got = out[l][at - static_cast<std::size_t>(l) * B * n * H * D];
              const double err = std::abs(got - want);
              sum_sq_err_ += std::isnan(err) ? 0.0 : err * err;
              sum_sq_ref_ += want * want;
              max_abs_ = std::max(max_abs_, std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
              if (!(err <= s_.tolerance.atol + s_.tolerance.rtol * std::abs(want)))
                outputs_.fail(fmt::format("{}: layer {} row {} token {} (uid {}) head {} dim {}: expected {:.9g}, "
                                          "got {:.9g}",
                                          label_, l, b, ref.rows[b][i].index, ref.rows[b][i].uid, h, d, want, got));
            }
      }
  }

  // SPEC 5.3: every visible pair the cache used has the reference's Pq - Pk, as integers,
  // and the cache used exactly the reference's visible tokens (by uid).
  void compare_distances(const StepRecord& rec, const AttentionLog& log) {
    const reference::AppendResult& ref = *rec.append;
    std::map<std::pair<int, std::int64_t>, std::map<std::int64_t, std::int64_t>> used;  // (row, t) -> uid -> distance
    for (const auto& e : log) used[{e.row, e.query_index}][e.key_uid] = e.query_position - e.key_position;
    for (int b = 0; b < static_cast<int>(ref.rows.size()); ++b) {
        for (const auto& token : ref.rows[b]) {
        std::map<std::int64_t, std::int64_t> want;
        for (const auto& key : token.view.keys)
          want[static_cast<std::int64_t>(rec.histories[b][key.index])] = token.view.query_position - key.position;
        const auto& got = used[{b, token.index}];
        for (const auto& [uid, distance] : want) {
          const auto it = got.find(uid);
          if (it == got.end())
            positions_.fail(fmt::format("{}: row {} token {}: uid {} should be visible at distance {}, the cache did "
                                        "not use it",
                                        label_, b, token.index, uid, distance));
          else if (it->second != distance)
            positions_.fail(fmt::format("{}: row {} token {}: uid {} at distance {}, expected {}", label_, b,
                                        token.index, uid, it->second, distance));
        }
        for (const auto& [uid, distance] : got)
          if (!want.count(uid))
            positions_.fail(fmt::format("{}: row {} token {}: the cache used uid {} (distance {}), which the policy "
                                        "does not make visible",
                                        label_, b, token.index, uid, distance));
      }
    }
  }

  // SPEC 5.2 and 5.4: the slots hold exactly the retained set, each key a pure rotation
  // of its token's raw key by the position the slot claims.
  void check_slots(const KvCache& cache, const StepRecord& rec) {
    const optimized::SlotStore& store = cache.slots();
    for (int b = 0; b < static_cast<int>(rec.retained.size()); ++b) {
      std::map<std::int64_t, int> held;
      for (std::int64_t slot = 0; slot < store.capacity(); ++slot) {
        const SlotMeta& m = store.meta(b, slot);
        if (m.uid < 0) continue;
        ++held[m.uid];
        check_rotation(store, b, slot, m);
      }
      std::map<std::int64_t, int> want;
      for (const auto& key : rec.retained[b].keys) want[static_cast<std::int64_t>(key.uid)] = 1;
      for (const auto& [uid, count] : held) {
        if (!want.count(uid))
          retained_.fail(fmt::format("{}: row {} holds uid {}, which is not in the retained set (stale)", label_, b, uid));
        else if (count > 1)
          retained_.fail(fmt::format("{}: row {} holds uid {} in {} slots (duplicated)", label_, b, uid, count));
      }
      for (const auto& [uid, one] : want)
        if (!held.count(uid))
          retained_.fail(fmt::format("{}: row {} lost uid {} of the retained set", label_, b, uid));
    }
  }

  void check_rotation(const optimized::SlotStore& store, int b, std::int64_t slot, const SlotMeta& m) {
    if (m.uid >= inputs_.uids) {
      rotation_.fail(fmt::format("{}: row {} slot {} claims uid {}, which does not exist", label_, b, slot, m.uid));
      return;
    }
    const int D = s_.dims.head_dim;
    for (int l = 0; l < s_.dims.layers; ++l)
      for (int g = 0; g < s_.dims.kv_heads; ++g) {
        const float* stored = store.key(l, b, g, slot);
        const auto back = reference::rotate(std::vector<double>(stored, stored + D), -static_cast<double>(m.position),
                                            s_.rope);
        const float* raw = inputs_.k_at(l, static_cast<std::uint64_t>(m.uid), g);
        double worst = 0.0;
        for (int d = 0; d < D; ++d) worst = std::max(worst, std::abs(back[d] - raw[d]));
        // float32 rotations, re-rotated many times, stay within ~1e-5 of the raw key; a
        // position off by one moves the fastest pair by about a radian.
        if (!(worst <= 1e-3)) {
          rotation_.fail(fmt::format("{}: layer {} row {} slot {} (uid {}): the key rotated back by its claimed "
                                     "position {} differs from the raw key by {:.3g}",
                                     label_, l, b, slot, m.uid, m.position, worst));
          return;
        }
      }
  }

  Outcome outcome(const std::string& target) const {
    Outcome o;
    o.scenario = s_.name;
    o.file = s_.file;
    o.target = target;
    auto add = [&](const char* name, const Tally& t, const std::string& ok) {
      o.checks.push_back({name, t.failures == 0, t.failures == 0 ? ok : t.first});
    };
    add("refusals", refusals_, "as the policy says");
    add("outputs", outputs_, fmt::format("within atol {} + rtol {}", s_.tolerance.atol, s_.tolerance.rtol));
    add("positions", positions_, "every visible pair at the reference's distance");
    add("retained set", retained_, "the retained set, no stale or duplicated slot");
    add("rotation", rotation_, "every stored key is its raw key rotated by its claimed position");
    o.max_abs_error = max_abs_;
    o.nmse = sum_sq_ref_ > 0 ? sum_sq_err_ / sum_sq_ref_ : 0.0;
    o.position_mismatches = positions_.failures;
    o.retained_mismatches = retained_.failures;
    return o;
  }

  const Scenario& s_;
  const InputTable& inputs_;
  const ReferenceRun& run_;
  std::string label_;
  Tally refusals_, outputs_, positions_, retained_, rotation_;
  double max_abs_ = 0.0, sum_sq_err_ = 0.0, sum_sq_ref_ = 0.0;
};

}  // namespace

Outcome check_cache(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, const CacheEntry& cache) {
  return CacheRun(s, inputs, run)(cache);
}

}  // namespace kvcheck
