#include "tools/harness/cache_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "reference/policy.h"
#include "reference/rope.h"
#include "tools/harness/recovery.h"

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

// How many problems a check saw, and the first one in words.
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

}  // namespace

std::int64_t largest_position(const ReferenceRun& run) { return 2 * longest_row(run) + 16; }

std::int64_t window_start(const Policy& policy, const reference::RowRetained& retained) {
  for (const auto& key : retained.keys)
    if (policy.kind != PolicyKind::sink || key.index >= policy.sinks) return key.index;
  return retained.keys.empty() ? 0 : retained.keys.back().index + 1;
}

void advance(StepContext& c, const StepRecord& rec) {
  if (rec.step.op == StepOp::reset) {
    c.last_row_change = rec.batch_before != *rec.step.batch ? StepContext::RowChange::reset_new_batch
                                                            : StepContext::RowChange::reset_same_batch;
  }
  if (rec.step.op == StepOp::reorder) c.last_row_change = StepContext::RowChange::reorder;
  if (rec.append)
    for (const auto& row : rec.append->rows)
      if (static_cast<std::int64_t>(row.size()) < rec.append->chunk) c.padded = true;
}

std::int64_t index_of(const std::vector<std::uint64_t>& history, std::int64_t uid) {
  const auto it = std::find(history.begin(), history.end(), static_cast<std::uint64_t>(uid));
  return it == history.end() ? -1 : it - history.begin();
}

namespace {

using Distances = std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>>;  // uid -> (distance, query pos)

class CacheRun {
 public:
  CacheRun(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, bool with_picture)
      : s_(s), inputs_(inputs), run_(run), with_picture_(with_picture) {}

  // The row whose slots the picture follows.
  void set_picture_row(int row) { picture_row_ = row; }

  CacheTrace operator()(const CacheEntry& entry) {
    std::unique_ptr<KvCache> cache = entry.make(cache_config(s_, longest_row(run_)));
    StepContext context;
    for (std::size_t i = 0; i < run_.steps.size(); ++i) {
      const StepRecord& rec = run_.steps[i];
      StepEvidence evidence;
      evidence.step = i;
      evidence.label = step_label(rec.step, i);
      log_.clear();
      bool in_step = true;
      try {
        apply(*cache, rec, evidence);
        if (!rec.refused.empty())
          evidence.refusal =
              fmt::format("the cache accepted a step the policy refuses ({}: {})", rec.refused, rec.refusal_message);
      } catch (const CacheRefusal& e) {
        if (e.code != rec.refused) {
          evidence.refusal = fmt::format("the cache refused with \"{}\" ({}){}", e.code, e.what(),
                                         rec.refused.empty() ? ", the policy accepts the step"
                                                             : ", the policy refuses with \"" + rec.refused + "\"");
          in_step = false;
        }
      }
      if (!evidence.refusal.empty()) refusals_.fail(evidence.label + ": " + evidence.refusal);
      if (in_step && cache->batch() != static_cast<int>(rec.retained.size())) {
        retained_.fail(fmt::format("{}: the cache has {} rows, the reference {}", evidence.label, cache->batch(),
                                   rec.retained.size()));
        in_step = false;
      }
      if (in_step) check_slots(*cache, rec, evidence);
      advance(context, rec);  // what led up to the end of this step, this step included
      if (!evidence.empty() && !trace_.first) record_first(*cache, rec, evidence, context);
      if (with_picture_ && in_step && picture_row_ < cache->batch())
        trace_.picture.push_back(picture_column(cache->slots(), log_, rec, picture_row_));
      if (!in_step) break;  // the cache and the reference no longer hold the same rows
    }
    trace_.outcome = outcome(entry.name);
    return std::move(trace_);
  }

 private:
  void apply(KvCache& cache, const StepRecord& rec, StepEvidence& evidence) {
    switch (rec.step.op) {
      case StepOp::append:
        append(cache, rec, evidence);
        break;
      case StepOp::reorder:
        cache.reorder(rec.step.rows);
        break;
      case StepOp::reset:
        cache.reset(*rec.step.batch);
        break;
      case StepOp::crop:
        cache.crop(rec.step.length);
        break;
    }
  }

  void append(KvCache& cache, const StepRecord& rec, StepEvidence& evidence) {
    const reference::AppendResult& ref = *rec.append;
    const int L = s_.dims.layers, H = s_.dims.heads, D = s_.dims.head_dim;
    const int B = static_cast<int>(ref.rows.size());
    ChunkBuffers buffers = make_chunk(s_, inputs_, ref);
    std::vector<std::vector<float>> out(L, std::vector<float>(static_cast<std::size_t>(B) * ref.chunk * H * D,
                                                              std::numeric_limits<float>::quiet_NaN()));
    std::vector<float*> out_ptrs;
    for (auto& o : out) out_ptrs.push_back(o.data());
    cache.append(buffers.chunk, out_ptrs, &log_);
    compare_outputs(ref, out, evidence);
    compare_distances(rec, evidence);
  }

  void compare_outputs(const reference::AppendResult& ref, const std::vector<std::vector<float>>& out,
                       StepEvidence& evidence) {
    const int L = s_.dims.layers, H = s_.dims.heads, D = s_.dims.head_dim;
    const int B = static_cast<int>(ref.rows.size());
    const std::int64_t n = ref.chunk;
    for (int l = 0; l < L; ++l)
      for (int b = 0; b < B; ++b) {
        const std::int64_t pad = n - static_cast<std::int64_t>(ref.rows[b].size());
        for (std::size_t i = 0; i < ref.rows[b].size(); ++i)
          for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d) {
              const std::size_t at = ((static_cast<std::size_t>(b) * n + pad + i) * H + h) * D + d;
              const double want = ref.out[static_cast<std::size_t>(l) * B * n * H * D + at];
              const double got = out[l][at];
              const double err = std::abs(got - want);
              sum_sq_err_ += std::isnan(err) ? 0.0 : err * err;
              sum_sq_ref_ += want * want;
              max_abs_ = std::max(max_abs_, std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
              if (err <= s_.tolerance.atol + s_.tolerance.rtol * std::abs(want)) continue;
              const auto& token = ref.rows[b][i];
              outputs_.fail(
                  fmt::format("{}: layer {} row {} token {} (uid {}) head {} dim {}: expected {:.9g}, got "
                              "{:.9g}",
                              evidence.label, l, b, token.index, token.uid, h, d, want, got));
              if (evidence.outputs.size() < 64)
                evidence.outputs.push_back({l, b, h, d, token.index, static_cast<std::int64_t>(token.uid), want, got});
            }
      }
  }

  // The pairs the cache used, per (row, query index).
  std::map<std::pair<int, std::int64_t>, Distances> used_pairs(StepEvidence& evidence) {
    std::map<std::pair<int, std::int64_t>, Distances> used;
    for (const auto& e : log_) {
      Distances& pairs = used[{e.row, e.query_index}];
      if (pairs.count(e.key_uid)) {
        // The same token attended twice (a duplicated slot, or ring plus chunk).
        positions_.fail(fmt::format("{}: row {} token {}: the cache used uid {} twice", evidence.label, e.row,
                                    e.query_index, e.key_uid));
        SlotIssue twice = SlotIssue::of(SlotIssue::Kind::duplicated, e.row, e.key_uid, e.key_index);
        evidence.slots.push_back(twice);
      }
      pairs[e.key_uid] = {e.query_position - e.key_position, e.query_position};
    }
    return used;
  }

  // SPEC 5.3: every visible pair the cache used has the reference's Pq - Pk, as integers,
  // and the cache used exactly the reference's visible tokens (by uid).
  void compare_distances(const StepRecord& rec, StepEvidence& evidence) {
    auto used = used_pairs(evidence);
    for (int b = 0; b < static_cast<int>(rec.append->rows.size()); ++b) {
      const auto& history = rec.histories[b];
      for (const auto& token : rec.append->rows[b]) {
        const std::int64_t e = reference::evicted_count(s_.policy, token.index);
        std::map<std::int64_t, std::int64_t> want;
        for (const auto& key : token.view.keys)
          want[static_cast<std::int64_t>(history[key.index])] = token.view.query_position - key.position;
        const Distances& got = used[{b, token.index}];
        auto note = [&](std::int64_t uid, std::optional<std::int64_t> w, std::optional<std::int64_t> a,
                        std::optional<std::int64_t> qpos, std::string text) {
          positions_.fail(fmt::format("{}: row {} token {}: {}", evidence.label, b, token.index, text));
          evidence.pairs.push_back({b, token.index, uid, index_of(history, uid), w, a, qpos, e});
        };
        for (const auto& [uid, distance] : want) {
          const auto it = got.find(uid);
          if (it == got.end())
            note(uid, distance, std::nullopt, std::nullopt,
                 fmt::format("uid {} should be visible at distance {}, the cache did not use it", uid, distance));
          else if (it->second.first != distance)
            note(uid, distance, it->second.first, it->second.second,
                 fmt::format("uid {} at distance {}, expected {}", uid, it->second.first, distance));
        }
        for (const auto& [uid, used_pair] : got)
          if (!want.count(uid))
            note(uid, std::nullopt, used_pair.first, used_pair.second,
                 fmt::format("the cache used uid {} (distance {}), which the policy does not make visible", uid,
                             used_pair.first));
      }
    }
  }

  // SPEC 5.2 and 5.4: the slots hold exactly the retained set, each key a pure rotation
  // of its token's raw key by the position the slot claims, each at its true token index.
  void check_slots(const KvCache& cache, const StepRecord& rec, StepEvidence& evidence) {
    const optimized::SlotStore& store = cache.slots();
    for (int b = 0; b < static_cast<int>(rec.retained.size()); ++b) {
      const auto& history = rec.histories[b];
      std::map<std::int64_t, int> held;
      for (std::int64_t slot = 0; slot < store.capacity(); ++slot) {
        const SlotMeta& m = store.meta(b, slot);
        if (m.uid < 0) continue;
        ++held[m.uid];
        const std::int64_t true_index = index_of(history, m.uid);
        if (true_index >= 0 && m.index != true_index) {
          retained_.fail(fmt::format("{}: row {} slot {} says uid {} is token {}, it is token {}", evidence.label, b,
                                     slot, m.uid, m.index, true_index));
          SlotIssue wrong = SlotIssue::of(SlotIssue::Kind::wrong_index, b, m.uid, true_index);
          wrong.slot = slot;
          wrong.claimed_index = m.index;
          wrong.claimed_position = m.position;
          evidence.slots.push_back(wrong);
        }
        check_rotation(store, b, slot, m, true_index, true_index + 1 == static_cast<std::int64_t>(history.size()),
                       evidence);
      }
      std::map<std::int64_t, int> want;
      for (const auto& key : rec.retained[b].keys) want[static_cast<std::int64_t>(key.uid)] = 1;
      for (const auto& [uid, count] : held) {
        const std::int64_t index = index_of(history, uid);
        if (index < 0) {
          retained_.fail(fmt::format("{}: row {} holds uid {}, a token of another row or generation (stale)",
                                     evidence.label, b, uid));
          evidence.slots.push_back(SlotIssue::of(SlotIssue::Kind::stale, b, uid, -1));
        } else if (!want.count(uid)) {
          retained_.fail(fmt::format("{}: row {} still holds uid {} (token {}), which the policy evicted",
                                     evidence.label, b, uid, index));
          SlotIssue extra = SlotIssue::of(SlotIssue::Kind::extra, b, uid, index);
          extra.window_gap = window_start(s_.policy, rec.retained[b]) - index;
          evidence.slots.push_back(extra);
        } else if (count > 1) {
          retained_.fail(
              fmt::format("{}: row {} holds uid {} in {} slots (duplicated)", evidence.label, b, uid, count));
          evidence.slots.push_back(SlotIssue::of(SlotIssue::Kind::duplicated, b, uid, index));
        }
      }
      for (const auto& [uid, one] : want)
        if (!held.count(uid)) {
          retained_.fail(fmt::format("{}: row {} lost uid {} (token {}) of the retained set", evidence.label, b, uid,
                                     index_of(history, uid)));
          evidence.slots.push_back(SlotIssue::of(SlotIssue::Kind::lost, b, uid, index_of(history, uid)));
        }
    }
  }

  void check_rotation(const optimized::SlotStore& store, int b, std::int64_t slot, const SlotMeta& m,
                      std::int64_t true_index, bool newest, StepEvidence& evidence) {
    if (m.uid >= inputs_.uids) {
      rotation_.fail(
          fmt::format("{}: row {} slot {} claims uid {}, which does not exist", evidence.label, b, slot, m.uid));
      return;
    }
    const int D = s_.dims.head_dim;
    for (int l = 0; l < s_.dims.layers; ++l)
      for (int g = 0; g < s_.dims.kv_heads; ++g) {
        const float* stored = store.key(l, b, g, slot);
        const auto back =
            reference::rotate(std::vector<double>(stored, stored + D), -static_cast<double>(m.position), s_.rope);
        const float* raw = inputs_.k_at(l, static_cast<std::uint64_t>(m.uid), g);
        double worst = 0.0;
        for (int d = 0; d < D; ++d) worst = std::max(worst, std::abs(back[d] - raw[d]));
        // float32 rotations, re-rotated many times, stay within ~1e-5 of the raw key; a
        // position off by one moves the fastest pair by about a radian.
        if (worst <= 1e-3) continue;
        const RecoveredPosition r = recover_position(raw, stored, D, s_.rope, largest_position(run_));
        rotation_.fail(
            fmt::format("{}: layer {} row {} slot {} (uid {}): the key is not its raw key rotated by its "
                        "claimed position {} (recovered: {})",
                        evidence.label, l, b, slot, m.uid, m.position, describe(r)));
        SlotIssue rotated = SlotIssue::of(SlotIssue::Kind::rotation, b, m.uid, true_index);
        rotated.slot = slot;
        rotated.layer = l;
        rotated.claimed_index = m.index;
        rotated.claimed_position = m.position;
        rotated.newest = newest;
        if (r.status != RecoveredPosition::Status::not_rotation) rotated.recovered_position = r.position;
        rotated.fits = r.fits;
        evidence.slots.push_back(rotated);
        return;
      }
  }

  // Where to look first: the first mismatching pair's query, else the first wrong output,
  // else the first slot issue's row.
  void record_first(const KvCache& cache, const StepRecord& rec, const StepEvidence& evidence,
                    const StepContext& context) {
    FirstDivergence f;
    f.evidence = evidence;
    f.context = context;
    f.layer = !evidence.slots.empty() ? evidence.slots.front().layer
              : !evidence.outputs.empty() ? evidence.outputs.front().layer
                                          : 0;
    f.bug = classify(s_, evidence, context);
    if (!evidence.pairs.empty()) {
      f.row = evidence.pairs.front().row;
      f.query_index = evidence.pairs.front().query_index;
    } else if (!evidence.outputs.empty()) {
      f.row = evidence.outputs.front().row;
      f.query_index = evidence.outputs.front().query_index;
    } else if (!evidence.slots.empty()) {
      f.row = evidence.slots.front().row;
      if (rec.append && !rec.append->rows[f.row].empty()) f.query_index = rec.append->rows[f.row].back().index;
    }
    if (rec.append && f.row < static_cast<int>(rec.append->rows.size()) && !rec.append->rows[f.row].empty())
      f.table_query_index = rec.append->rows[f.row].back().index;
    if (f.row < cache.batch() && f.row < static_cast<int>(rec.histories.size()))
      f.slots = slot_table(s_, inputs_, largest_position(run_), cache.slots(), log_, rec, f.row, f.table_query_index,
                           f.layer);
    trace_.first = std::move(f);
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
  bool with_picture_;
  int picture_row_ = 0;
  AttentionLog log_;
  CacheTrace trace_;
  Tally refusals_, outputs_, positions_, retained_, rotation_;
  double max_abs_ = 0.0, sum_sq_err_ = 0.0, sum_sq_ref_ = 0.0;
};

}  // namespace

CacheTrace trace_cache(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, const CacheEntry& cache,
                       bool with_picture) {
  if (!with_picture) return CacheRun(s, inputs, run, false)(cache);
  // The picture follows the diagnosed row, which is known only after a first pass.
  const CacheTrace first = CacheRun(s, inputs, run, false)(cache);
  CacheRun again(s, inputs, run, true);
  if (first.first) again.set_picture_row(first.first->row);
  return again(cache);
}

Outcome check_cache(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, const CacheEntry& cache) {
  return trace_cache(s, inputs, run, cache, false).outcome;
}

}  // namespace kvcheck
