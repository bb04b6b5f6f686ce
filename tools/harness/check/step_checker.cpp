#include "tools/harness/check/step_checker.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "reference/policy.h"
#include "reference/quantize.h"
#include "optimized/poison.h"
#include "reference/rope.h"
#include "tools/harness/check/divergence_report.h"
#include "tools/harness/scenario/content_keys.h"
#include "tools/harness/check/hypotheses.h"
#include "tools/harness/io/progress.h"
#include "tools/harness/check/paged_checks.h"
#include "tools/harness/check/observed_prune_checks.h"
#include "tools/harness/check/path_checks.h"
#include "tools/harness/check/precision_checks.h"
#include "tools/harness/check/quant_checks.h"
#include "tools/harness/check/recovery.h"

namespace kvcheck {

std::int64_t largest_position(const Scenario& s) { return 2 * longest_row(s) + 16; }

// A row's uids increase with the token index (uids are handed out in step order, and a
// reorder or crop keeps a row's order), so the search is binary.
std::int64_t index_of(const RowHistory& history, std::int64_t uid) {
  if (uid < 0) return -1;
  // Sorted by uid; an entry a prune marked (SPEC 11) is still its token, which a window
  // layer keeps.
  const auto it = std::lower_bound(history.begin(), history.end(), static_cast<std::uint64_t>(uid),
                                   [](std::uint64_t entry, std::uint64_t u) { return (entry & reference::kUidBits) < u; });
  return it == history.end() || (*it & reference::kUidBits) != static_cast<std::uint64_t>(uid) ? -1
                                                                                              : it - history.begin();
}

// Outputs from half-precision keys and values. A stored element is off by at most u of
// itself, so each value by u |v|max, and each score (scale <q, k>) by u scale |q| |k|,
// which moves a softmax weight by at most twice that, relatively: the output moves by at
// most u |v|max (1 + 2 scale |q|max |k|max), where |q| and |k| are the largest vector
// norms of the inputs. Doubled for the rounding of the output itself and of the
// attention's own arithmetic; rtol covers an output rounded to the same format.
InputMagnitudes input_magnitudes(const InputTable& inputs) {
  const int D = inputs.head_dim;
  auto largest_norm = [D](const std::vector<float>& x) {
    double best = 0.0;
    for (std::size_t at = 0; at + D <= x.size(); at += static_cast<std::size_t>(D)) {
      double sum = 0.0;
      for (int d = 0; d < D; ++d) sum += static_cast<double>(x[at + d]) * x[at + d];
      best = std::max(best, std::sqrt(sum));
    }
    return best;
  };
  InputMagnitudes m;
  for (float v : inputs.v) m.v_max = std::max(m.v_max, static_cast<double>(std::abs(v)));
  m.q_norm = largest_norm(inputs.q);
  m.k_norm = largest_norm(inputs.k);
  return m;
}

Tolerance output_tolerance(const Scenario& s, const InputMagnitudes& inputs, double roundoff) {
  if (roundoff <= kFloat32Roundoff || s.tolerance_given) return s.tolerance;  // a scenario may override
  // Yarn's attention factor m scales rotated q and k, so the scores by up to m^2.
  double m = 1.0;
  for (const Rope& rope : s.ropes) m = std::max(m, reference::rope_magnitude(rope));
  // A NoPE layer's query temperature (SPEC 10.3) scales its scores by up to T at the
  // largest position.
  const double temperature = s.attention.query_temperature
                                 ? reference::query_temperature(*s.attention.query_temperature, largest_position(s))
                                 : 1.0;
  const double bound = roundoff * inputs.v_max *
                       (1.0 + 2.0 * s.softmax_scale() * m * m * temperature * inputs.q_norm * inputs.k_norm);
  Tolerance t;
  t.atol = std::max(s.tolerance.atol, 2.0 * bound);
  t.rtol = std::max(s.tolerance.rtol, 2.0 * roundoff);
  return t;
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

// A stored key rotated back by its claimed position is its raw key, up to the storage's
// rounding; float32 keys re-rotated at every shift drift further (about 1e-5 after
// thousands of shifts), hence the floor. A position off by one moves the fastest pair by
// about a radian, far beyond either.
double rotation_tolerance(const float* raw, int d, double roundoff) {
  double largest = 1.0;
  for (int i = 0; i < d; ++i) largest = std::max(largest, static_cast<double>(std::abs(raw[i])));
  return (1e-3 + 8.0 * roundoff) * largest;
}

// How far layer l's stored keys may be from the keys given, relative to their largest
// element: the view's storage and files, or the layer's quantized format (SPEC 9).
double key_roundoff_in(const CacheView& view, int l) {
  const auto at = static_cast<std::size_t>(l);
  return std::max(view.roundoff, at < view.layers.size() ? view.layers[at].key_roundoff : 0.0);
}

// How far a stored key, rotated back by `position`, is from its raw key: the largest
// element difference (infinite for NaN). Every slot is checked at every step, so cos and
// sin come from a table (the values of reference::rotate's formula) grown on demand up to
// a bound; positions beyond it are rotated the slow way.
class RotationCheck {
 public:
  RotationCheck(int head_dim, const Rope& rope, std::int64_t bound)
      : d_(head_dim),
        rotary_(reference::rotary_dim(head_dim, rope)),
        inverse_magnitude_(1.0 / reference::rope_magnitude(rope)),
        rope_(rope),
        bound_(bound) {}

  const Rope& rope() const { return rope_; }

  double error(const float* stored, const float* raw, std::int64_t position) {
    if (unrotated_) return plain(stored, raw);
    if (position < 0 || position > bound_) return slow(stored, raw, position);
    const int half = rotary_ / 2;
    for (; rows_ <= position; ++rows_)
      for (int i = 0; i < half; ++i) {
        const double angle = reference::rope_angle(i, d_, static_cast<double>(rows_), rope_);
        table_.push_back(std::cos(angle) * inverse_magnitude_);
        table_.push_back(std::sin(angle) * inverse_magnitude_);
      }
    const double* cs = table_.data() + static_cast<std::size_t>(position) * static_cast<std::size_t>(rotary_);
    double worst = 0.0;
    for (int i = 0; i < half; ++i) {
      const int ia = reference::pair_first(i, rope_.layout), ib = reference::pair_second(i, rotary_, rope_.layout);
      const double c = cs[2 * i], s = cs[2 * i + 1], a = stored[ia], b = stored[ib];
      // R(-p) / m: (a cos + b sin, -a sin + b cos) / m.
      worst = std::max({worst, std::abs(a * c + b * s - raw[ia]), std::abs(-a * s + b * c - raw[ib])});
      if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::infinity();
    }
    for (int i = rotary_; i < d_; ++i) {  // dims past R are stored as they came
      const double e = std::abs(static_cast<double>(stored[i]) - raw[i]);
      worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(worst, e);
    }
    return worst;
  }

  // Keys stored as they came (a trace's "unrotated" keys): no rotation and no magnitude.
  void set_unrotated(bool unrotated) { unrotated_ = unrotated; }

 private:
  double plain(const float* stored, const float* raw) const {
    double worst = 0.0;
    for (int i = 0; i < d_; ++i) {
      const double e = std::abs(static_cast<double>(stored[i]) - raw[i]);
      worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(worst, e);
    }
    return worst;
  }

  double slow(const float* stored, const float* raw, std::int64_t position) const {
    const auto back =
        reference::unrotate(std::vector<double>(stored, stored + d_), static_cast<double>(position), rope_);
    double worst = 0.0;
    for (int i = 0; i < d_; ++i) {
      const double e = std::abs(back[i] - raw[i]);
      worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(worst, e);
    }
    return worst;
  }

  int d_, rotary_;
  bool unrotated_ = false;
  double inverse_magnitude_;
  Rope rope_;
  std::int64_t bound_;
  std::int64_t rows_ = 0;
  std::vector<double> table_;  // [position][pair][cos, sin]
};

void advance(StepContext& c, const StepRecord& rec) {
  if (rec.step.op == StepOp::reset)
    c.last_row_change = rec.batch_before != *rec.step.batch ? StepContext::RowChange::reset_new_batch
                                                            : StepContext::RowChange::reset_same_batch;
  if (rec.step.op == StepOp::reorder) {
    c.last_row_change = StepContext::RowChange::reorder;
    std::vector<bool> moved;
    for (int r : rec.step.rows)
      moved.push_back(static_cast<std::size_t>(r) < c.padded_rows.size() && c.padded_rows[static_cast<std::size_t>(r)]);
    c.padded_rows = std::move(moved);
  }
  if (rec.step.op == StepOp::reset) c.padded_rows.clear();
  if (rec.step.op == StepOp::reset) c.rerotating_prune_sinks.reset();
  if (rec.step.op == StepOp::prune && rec.step.rerotate) c.rerotating_prune_sinks = rec.step.prune_sinks;
  if (rec.append)
    for (std::size_t b = 0; b < rec.append->rows.size(); ++b)
      if (static_cast<std::int64_t>(rec.append->rows[b].size()) < rec.append->chunk) {
        c.padded = true;
        c.padded_rows.resize(std::max(c.padded_rows.size(), b + 1), false);
        c.padded_rows[b] = true;
      }
}

// SPEC 10.2: a chunked layer may hold its last C tokens (a ring of C slots), those of the
// previous chunk among them dead.
bool in_last_chunk_span(const Policy& policy, std::int64_t index, std::int64_t length) {
  return policy.kind == PolicyKind::chunked && index >= length - policy.window;
}

// The first token index of the retained window (after the sinks).
std::int64_t window_start(const Policy& policy, const reference::RowRetained& retained) {
  for (const auto& key : retained.keys)
    if (policy.kind != PolicyKind::sink || key.index >= policy.sinks) return key.index;
  return retained.keys.empty() ? 0 : retained.keys.back().index + 1;
}

// What one (layer, row, kv head 0) looked like in a step: its table rows and, per uid,
// the position its key was used at and the distance the row's last query used.
struct RowState {
  std::vector<SlotRow> table;
  std::map<std::int64_t, const float*> keys;          // uid -> stored key, for recovery on demand
  std::map<std::int64_t, std::int64_t> key_position;  // uid -> position at attention time (traces)
  std::map<std::int64_t, std::int64_t> distance;      // uid -> Pq - Pk the last query used
  bool pairs_known = false;                           // `distance` was measured for this row
};

// The retained set of a row, by uid, with its two position conventions (SPEC 3): Pk as the
// row's last token saw it (lazy), and as the next token will see it (eager, live tokens).
struct RowSets {
  std::map<std::int64_t, const reference::RetainedKey*> retained, live;
  std::set<std::int64_t> droppable;  // SPEC 10.4: retained, but no later query sees them again
  std::optional<std::int64_t> lazy_position(std::int64_t uid) const {
    const auto it = retained.find(uid);
    return it == retained.end() ? std::nullopt : std::optional<std::int64_t>(it->second->position);
  }
  std::optional<std::int64_t> eager_position(std::int64_t uid) const {
    const auto it = live.find(uid);
    return it == live.end() ? lazy_position(uid) : std::optional<std::int64_t>(it->second->position);
  }
};

}  // namespace

class StepChecker::Impl {
 public:
  Impl(const Scenario& s, const InputTable& inputs, const CheckOptions& options)
      : s_(s),
        inputs_(inputs),
        options_(options),
        max_position_(largest_position(s)),

        paged_(s),
        precision_(s),
        paths_(s),
        observed_(s, inputs) {
    if (s.quantized()) quant_.emplace(s, inputs);
    // One rotation table per distinct rope (SPEC 10.1), shared by the layers that use it.
    for (const Rope& rope : s.ropes) {
      auto same = std::find_if(rotations_.begin(), rotations_.end(),
                               [&](const RotationCheck& r) { return r.rope() == rope; });
      if (same == rotations_.end())
        same = rotations_.insert(rotations_.end(), RotationCheck(s.dims.head_dim, rope, largest_position(s)));
      rotation_of_layer_.push_back(static_cast<std::size_t>(same - rotations_.begin()));
    }
    // The list, in its order: paged first (it names shared and hit slots by the row's own
    // uids), then the codes, then the precision map (both SPEC 9: a quantized cache only).
    checks_ = {&paged_};
    if (quant_) checks_.insert(checks_.end(), {&*quant_, &precision_});
    checks_.push_back(&paths_);
    checks_.push_back(&observed_);
    for (RotationCheck& r : rotations_) r.set_unrotated(options_.key_positions == KeyPositions::unrotated);
    if (options_.focus_step && *options_.focus_step >= s_.steps.size())
      throw InputError("--step", "",
                       fmt::format("step {} does not exist: this scenario has steps 0 to {} (decode expanded)",
                                   *options_.focus_step, s_.steps.size() - 1));
  }

  bool step(std::size_t i, const StepRecord& rec, CacheView& view) {
    if (!served_crop_.empty()) return options_.trace;  // after a served crop: nothing to judge
    advance(context_, rec);  // what led up to the end of this step, this step included
    StepEvidence evidence;
    evidence.step = i;
    evidence.label = step_label(rec.step, i);
    std::vector<std::vector<RowState>> rows;  // [layer][row]
    bool go_on = true;
    if (view.recorded) {
      ++recorded_;
      go_on = check(rec, view, evidence, rows);
    } else {
      unrecorded(rec, view, evidence, stopped_);
    }
    const bool focus = options_.focus_step && *options_.focus_step == i;
    if ((!evidence.empty() && !trace_.first) || focus) {
      StepDiagnosis d = diagnose(rec, view, evidence, context_, rows);
      if (view.paged) d.block_size = view.paged->block_size;
      if (!evidence.empty() && !trace_.first) trace_.first = d;
      if (focus) trace_.focus = std::move(d);
    }
    if (trace_.first && rec.append && view.recorded && trace_.first->evidence.step <= i)
      drift_.push_back(drift_point(rec, evidence, trace_.first->row));
    if (rec.append && view.recorded) rotation_errors_.emplace_back(i, step_rotation_error_);
    step_rotation_error_ = 0.0;
    if (options_.picture && !rows.empty()) {
      columns_.resize(std::max(columns_.size(), rows.size()));
      for (std::size_t l = 0; l < rows.size(); ++l) {
        columns_[l].resize(std::max(columns_[l].size(), rows[l].size()));
        for (std::size_t b = 0; b < rows[l].size(); ++b) {
          columns_[l][b].resize(i);  // one column per step, empty where nothing was seen
          columns_[l][b].push_back(picture_column(rows[l][b].table));
        }
      }
    }
    // A trace goes on after a failure that ends the run's meaning (its later steps are
    // empty); an in-process cache cannot.
    if (!go_on && options_.trace) stopped_ = true;
    return go_on || options_.trace;
  }

  // A chunked append between two forwards (SPEC 8.7): the same checks as a step, and the
  // first divergence when it is the first; no picture column or drift point of its own
  // (the whole step gives those).
  void forward(std::size_t i, const StepRecord& rec, CacheView& view) {
    StepContext context = context_;
    advance(context, rec);
    StepEvidence evidence;
    evidence.step = i;
    evidence.label = step_label(rec, i);
    evidence.between_forwards = true;
    // Slots mapped for the append's later tokens, not written yet, are not held: the log
    // shows whether a query read one.
    for (ViewLayer& layer : view.layers)
      for (std::size_t b = 0; b < layer.slots.size() && b < rec.after_append.size(); ++b)
        for (auto& head : layer.slots[b])
          std::erase_if(head, [&](const ViewSlot& v) {
            return v.uid >= 0 && index_of(rec.after_append[b], v.uid) >= static_cast<std::int64_t>(rec.histories[b].size());
          });
    // Outputs and pairs are compared again on the whole step, which counts them; a
    // forward's own failures are its state's (slots, tables, codes).
    const Tally outputs = outputs_, positions = positions_;
    const double err = sum_sq_err_, ref = sum_sq_ref_;
    const std::int64_t lazy = lazy_rows_, eager = eager_rows_;
    std::vector<std::vector<RowState>> rows;
    check(rec, view, evidence, rows);
    outputs_ = outputs, positions_ = positions, sum_sq_err_ = err, sum_sq_ref_ = ref;
    lazy_rows_ = lazy, eager_rows_ = eager;
    step_rotation_error_ = 0.0;  // the whole step measures its own
    if (evidence.empty() || trace_.first) return;
    StepDiagnosis d = diagnose(rec, view, evidence, context, rows);
    if (view.paged) d.block_size = view.paged->block_size;
    trace_.first = std::move(d);
  }

  CacheTrace finish() {
    if (options_.focus_step && !trace_.focus)
      throw InputError("--step", "",
                       served_crop_.empty()
                           ? fmt::format("step {} was not reached: the run stopped at the first failure",
                                         *options_.focus_step)
                           : fmt::format("step {} was not judged: {}", *options_.focus_step, served_crop_));
    // A drift line only where positions were off at all.
    if (trace_.first && std::any_of(drift_.begin(), drift_.end(), [](const Drift::Point& p) { return p.error != 0; }))
      trace_.drift = summarize_drift(std::move(drift_));
    else if (trace_.first && trace_.first->bug == BugClass::rerotation_drift && rotation_errors_.size() > 1)
      trace_.drift.rotation_errors = std::move(rotation_errors_);
    // A run that passes still says when its stored keys drift (a quantized cache re-rotated
    // at every shift follows its rules code for code, yet its keys grow less accurate), so
    // every storage format reports drift the same way.
    else if (!trace_.first && rotation_errors_.size() > 1 &&
             rotation_errors_.back().second > 2 * rotation_errors_.front().second)
      trace_.drift.rotation_errors = std::move(rotation_errors_);
    if (options_.picture) {
      const std::size_t layer = trace_.first ? static_cast<std::size_t>(trace_.first->layer) : 0;
      const std::size_t row = trace_.first ? static_cast<std::size_t>(trace_.first->row) : 0;
      if (layer < columns_.size() && row < columns_[layer].size()) {
        trace_.picture = std::move(columns_[layer][row]);
        trace_.picture.resize(s_.steps.size());
      }
    }
    // A decode that went wrong before the chunk computing the same token came: the first
    // divergence learns of the disagreement now.
    if (trace_.first && trace_.first->evidence.paths.empty()) {
      StepDiagnosis& first = *trace_.first;
      first.evidence.paths = paths_.found_later_for(first.evidence.step);
      if (!first.evidence.paths.empty()) first.bug = classify(s_, first.evidence, first.context);
    }
    trace_.outcome = outcome();
    if (trace_.first) trace_.outcome.first_divergence = first_divergence(s_, *trace_.first);
    return std::move(trace_);
  }

 private:
  // A step the source did not record. Fine for a step with nothing to see or one the
  // source says why it skipped; not for an append or a refused step left out silently.
  void unrecorded(const StepRecord& rec, const CacheView& view, StepEvidence& evidence, bool stopped) {
    if (stopped) return;  // the failure that stopped the run is already reported
    if (!view.note.empty()) {
      if (skipped_.empty()) skipped_ = fmt::format("{} skipped: {}", evidence.label, view.note);
      return;
    }
    if (!rec.refused.empty()) {
      evidence.unrecorded = true;
      evidence.refusal = fmt::format("the trace does not say whether the cache refused this step ({}: {})", rec.refused,
                                     rec.refusal_message);
      refusals_.fail(evidence.label + ": " + evidence.refusal);
    } else if (rec.append) {
      evidence.unrecorded = true;
      unrecorded_.fail(evidence.label + ": an append step left out of the trace with no reason");
    }
  }

  // Every check of one step. False when the run cannot go on (the cache raised, or holds
  // other rows than the reference).
  bool check(const StepRecord& rec, CacheView& view, StepEvidence& evidence, std::vector<std::vector<RowState>>& rows) {
    bool go_on = true;
    shift_searches_left_ = kShiftSearchesPerStep;
    if (!rec.refused.empty()) {
      if (!view.error) {
        const std::string unserved = rec.served ? crop_not_served(rec, view) : std::string();
        if (rec.served && unserved.empty()) {
          // Served: the scenario's later steps assume the refusal, so they mean nothing here.
          served_crop_ = fmt::format(
              "{} was served (the policy refuses it; the cache still held what the cut rows need), so the {} "
              "steps after it, which assume the refusal, are not judged",
              evidence.label, s_.steps.size() - 1 - evidence.step);
          return false;
        }
        evidence.refusal = fmt::format("the cache accepted a step the policy refuses ({}: {}){}", rec.refused,
                                       rec.refusal_message,
                                       rec.served ? ", and its rows are not the cut rows: " + unserved : "");
      } else if (!view.refusal_code.empty() && view.refusal_code != rec.refused)
        evidence.refusal = fmt::format("the cache refused with \"{}\" ({}), the policy refuses with \"{}\"",
                                       view.refusal_code, *view.error, rec.refused);
    } else if (view.error) {
      evidence.raised = view.refusal_code.empty();
      evidence.refusal = evidence.raised
                             ? fmt::format("the cache raised: {}", *view.error)
                             : fmt::format("the cache refused with \"{}\" ({}), the policy accepts the step",
                                           view.refusal_code, *view.error);
      go_on = false;
    }
    if (!evidence.refusal.empty()) refusals_.fail(evidence.label + ": " + evidence.refusal);
    if (!go_on || view.layers.empty()) return go_on;
    if (view.batch != static_cast<int>(rec.rows())) {
      evidence.wrong_row_count = true;
      retained_.fail(
          fmt::format("{}: the cache has {} rows, the reference {}", evidence.label, view.batch, rec.rows()));
      return false;
    }
    // Quantized: outputs are compared with R_stored, the attention over exactly what the
    // cache must hold, so float32's tolerance, plus what codes a cache may round the other
    // way at a boundary can move.
    const double roundoff = quant_ ? view.query_roundoff : view.roundoff;
    // The inputs' magnitudes once per run, not a scan of every input at every step.
    if (roundoff > kFloat32Roundoff && !magnitudes_) magnitudes_ = input_magnitudes(inputs_);
    Tolerance tolerance = output_tolerance(s_, magnitudes_.value_or(InputMagnitudes{}), roundoff);
    for (SubCheck* c : checks_) c->check(rec, view, evidence);
    uncomputed_ = view.uncomputed;  // as the paged check left it (prefix hits)
    used_tolerance_.atol = std::max(used_tolerance_.atol, tolerance.atol);
    used_tolerance_.rtol = std::max(used_tolerance_.rtol, tolerance.rtol);
    rows.assign(view.layers.size(), std::vector<RowState>(rec.rows()));
    if (rec.append && view.pairs) compare_pairs(rec, std::move(*view.pairs), evidence, rows[0]);
    for (std::size_t l = 0; l < view.layers.size(); ++l) {
      const ViewLayer& layer = view.layers[l];
      for (int b = 0; b < static_cast<int>(rec.rows()); ++b) {
        if (rec.is_preempted(b)) continue;  // SPEC 8.6: its blocks are out until it resumes
        const std::size_t before = evidence.slots.size();
        check_row(rec, view, static_cast<int>(l), b, evidence, rows[l][b]);
        for (std::size_t k = before; k < evidence.slots.size(); ++k) evidence.slots[k].layer = static_cast<int>(l);
        // Another layer's policy explains wrong tokens held, not wrong rotations of the right
        // ones; a cache that never evicts holds every token by design.
        const bool wrong_tokens = std::any_of(evidence.slots.begin() + static_cast<std::ptrdiff_t>(before),
                                              evidence.slots.end(), [](const SlotIssue& i) {
                                                return i.kind == SlotIssue::Kind::lost || i.kind == SlotIssue::Kind::extra;
                                              });
        if (s_.hybrid() && wrong_tokens && options_.eviction != Eviction::never && !evidence.layer_holds_policy_of)
          match_other_layer_policy(rec, view, static_cast<int>(l), b, evidence);
        if (rec.append && layer.out)
          compare_outputs(rec, static_cast<int>(l), b, layer.out, layer.q, tolerance, evidence);
        if (rec.append && layer.q && !view.pairs) derive_pairs(rec, view, static_cast<int>(l), b, evidence, rows[l][b]);
      }
    }
    if (rec.append)
      for (std::size_t b = 0; b < rec.append->rows.size(); ++b) {
        const auto& chunk = rec.append->rows[b];
        if (chunk.size() <= rec.retained_in(0, static_cast<int>(b)).keys.size()) continue;
        const auto& table = rows[0][b].table;
        evidence.chunk_kept_whole |= std::all_of(chunk.begin(), chunk.end(), [&](const auto& token) {
          return std::any_of(table.begin(), table.end(), [&](const SlotRow& r) {
            return r.slot >= 0 && r.uid == static_cast<std::int64_t>(token.uid);
          });
        });
      }
    for (std::size_t l = 0; l < rows.size(); ++l)
      for (std::size_t b = 0; b < rows[l].size(); ++b)
        fill_distances(rec, view, static_cast<int>(l), static_cast<int>(b), rows[l][b]);
    return true;
  }

  // A crop the policy refuses, accepted: empty when the cache holds what serving it needs
  // (every layer and row judged against the cut rows, as after an accepted crop), else the
  // first thing it lacks. Nothing of this judgement enters the run's tallies.
  std::string crop_not_served(const StepRecord& rec, const CacheView& view) {
    if (view.layers.empty()) return "the cache shows no state to judge";
    if (view.batch != static_cast<int>(rec.rows()))
      return fmt::format("the cache has {} rows, the reference {}", view.batch, rec.rows());
    StepRecord cut = rec;
    cut.retained = rec.served->retained;
    cut.histories = rec.served->histories;
    cut.stored = rec.served->stored;
    cut.stored_ring = rec.served->stored_ring;
    cut.refused.clear();
    cut.served.reset();
    const Tally retained = retained_, positions = positions_, rotation = rotation_;
    const std::int64_t lazy = lazy_rows_, eager = eager_rows_;
    const double rotation_error = step_rotation_error_;
    retained_ = positions_ = rotation_ = Tally{};
    StepEvidence scratch;
    scratch.label = fmt::format("cut to {} tokens", rec.step.length);
    for (std::size_t l = 0; l < view.layers.size(); ++l)
      for (int b = 0; b < static_cast<int>(cut.rows()); ++b) {
        RowState state;
        if (!cut.is_preempted(b)) check_row(cut, view, static_cast<int>(l), b, scratch, state);
      }
    std::string first = !retained_.first.empty() ? retained_.first : !positions_.first.empty() ? positions_.first : rotation_.first;
    if (first.empty() && !scratch.slots.empty()) first = "a slot does not hold what the cut row needs";
    retained_ = retained, positions_ = positions, rotation_ = rotation;
    lazy_rows_ = lazy, eager_rows_ = eager, step_rotation_error_ = rotation_error;
    return first;
  }

  // SPEC 5.2 and 5.4 for one row of one layer: every kv head's slots identified, the set
  // between the live set and the retained set, each key its raw key rotated by the
  // position it claims (or the trace declares, under one of the two conventions).
  void check_row(const StepRecord& rec, const CacheView& view, int l, int b, StepEvidence& evidence, RowState& state) {
    const auto& history = rec.histories[b];
    const reference::RowRetained& ret = rec.retained_in(l, b);
    RowSets row_sets;
    for (const auto& key : ret.keys) row_sets.retained[static_cast<std::int64_t>(key.uid)] = &key;
    for (const auto& key : ret.live) row_sets.live[static_cast<std::int64_t>(key.uid)] = &key;
    for (const std::uint64_t uid : ret.droppable) row_sets.droppable.insert(static_cast<std::int64_t>(uid));
    const bool has_dead = row_sets.retained.size() != row_sets.live.size();
    // Declared block eviction (SPEC 3.1): a sliding layer holds exactly its last L(T) tokens.
    const Policy& policy = s_.policies[static_cast<std::size_t>(l)];
    const bool blocks = options_.eviction == Eviction::blocks && policy.kind == PolicyKind::sliding;
    const auto length = static_cast<std::int64_t>(history.size());
    const std::int64_t block_start =
        blocks ? length - reference::block_retained_length(length, options_.block_capacity, policy.window) : 0;
    const auto& heads = view.layers[static_cast<std::size_t>(l)].slots[static_cast<std::size_t>(b)];
    for (std::size_t g = 0; g < heads.size(); ++g) {
      // Keys a press chose to keep in this head (SPEC 11.1), beside the reference's (a copy
      // of the sets only then: a long row's maps are large).
      std::vector<reference::RetainedKey> chosen;
      for (const SubCheck* c : checks_) c->chosen_keys(rec, l, b, static_cast<int>(g), chosen);
      RowSets head_sets;
      if (!chosen.empty()) head_sets = row_sets;
      for (const reference::RetainedKey& key : chosen)
        head_sets.retained[static_cast<std::int64_t>(key.uid)] = head_sets.live[static_cast<std::int64_t>(key.uid)] = &key;
      const RowSets& sets = chosen.empty() ? row_sets : head_sets;
      const bool check_set = !view.slots_shared || (l == 0 && g == 0);
      const std::string where = fmt::format("{}: layer {} row {}{}", evidence.label, l, b,
                                            heads.size() > 1 ? fmt::format(" kv head {}", g) : std::string());
      std::map<std::int64_t, int> held;
      for (const ViewSlot& v : heads[g])
        if (v.uid >= 0 && index_of(history, v.uid) >= 0) ++held[v.uid];
      bool dead_held = false, dead_dropped = false;
      for (const auto& [uid, key] : sets.retained) {
        if (sets.live.count(uid)) continue;
        if (held.count(uid)) dead_held = true;
        else if (!sets.droppable.count(uid)) dead_dropped = true;  // SPEC 10.4's may go: no evidence
      }
      if (check_set && has_dead) {
        eager_rows_ += dead_dropped && !dead_held;
        lazy_rows_ += dead_held && !dead_dropped;
      }
      // Keys re-encoded for the next token only where no dead token is held (SPEC 3).
      const Convention positions = key_convention(rec, view, l, b, static_cast<int>(g), heads[g], sets, dead_held);

      // A residual's precision of each retained token, for the slot table (SPEC 9.2.4).
      std::map<std::int64_t, bool> raw_expected;
      const bool shows_precision = s_.quantized() && s_.quant_rules().holds_raw() && !rec.stored.empty() &&
                                   (s_.quant(l).k || s_.quant(l).v);
      if (shows_precision) {
        const auto& keys = rec.retained_in(l, b).keys;
        for (std::size_t i = 0; i < keys.size() && i < rec.stored[static_cast<std::size_t>(l)][b].size(); ++i)
          raw_expected[static_cast<std::int64_t>(keys[i].uid)] = rec.stored[static_cast<std::size_t>(l)][b][i].raw;
      }
      std::map<std::int64_t, int> seen;
      for (const ViewSlot& v : heads[g]) {
        SlotRow row;
        row.row = b;
        row.slot = v.slot;
        row.uid = v.uid;
        row.index = v.uid < 0 ? -1 : index_of(history, v.uid);
        row.claimed_index = v.claimed_index;
        bool precision_off = false;
        if (shows_precision) {
          const auto expected = raw_expected.find(v.uid);
          const bool quantized = !v.raw && (v.key_codes || v.value_codes);
          const char* actual = v.raw ? "raw" : quantized ? "q" : "?";
          row.held = fmt::format("{}/{}", expected == raw_expected.end() ? "-" : expected->second ? "raw" : "q", actual);
          precision_off = expected != raw_expected.end() && (expected->second ? quantized : v.raw);
        }
        const bool first_time = row.index >= 0 && ++seen[v.uid] == 1;
        const bool live = sets.live.count(v.uid) > 0;
        if (row.index < 0) {
          row.verdict = v.uid < 0 ? SlotVerdict::unknown_values : SlotVerdict::stale;
          if (check_set) {
            retained_.fail(fmt::format("{} slot {} holds {}", where, v.slot,
                                       v.uid < 0 ? std::string("values of no token (corrupted, or NaN)")
                                                 : fmt::format("uid {}, not this row's token (stale)", v.uid)));
            SlotIssue issue = SlotIssue::of(SlotIssue::Kind::stale, b, v.uid, -1);
            issue.slot = v.slot;
            issue.quantized = !v.raw && (v.key_codes || v.value_codes);
            evidence.slots.push_back(issue);
          }
        } else if (!first_time) {
          row.verdict = SlotVerdict::duplicated;
          if (check_set) {
            retained_.fail(fmt::format("{} holds uid {} (token {}) in more than one slot", where, v.uid, row.index));
            evidence.slots.push_back(SlotIssue::of(SlotIssue::Kind::duplicated, b, v.uid, row.index));
          }
        } else if (v.claimed_index && *v.claimed_index != row.index) {
          row.verdict = SlotVerdict::claims_other_index;
          if (check_set) {
            retained_.fail(fmt::format("{} slot {} says uid {} is token {}, it is token {}", where, v.slot, v.uid,
                                       *v.claimed_index, row.index));
            SlotIssue wrong = SlotIssue::of(SlotIssue::Kind::wrong_index, b, v.uid, row.index);
            wrong.slot = v.slot;
            wrong.claimed_index = *v.claimed_index;
            wrong.claimed_position = v.claimed_position.value_or(0);
            evidence.slots.push_back(wrong);
          }
        } else if (!sets.retained.count(v.uid) && options_.eviction == Eviction::deferred && !live &&
                   seen_by_append(rec, l, b, v.uid)) {
          row.verdict = SlotVerdict::dead_held;  // dropped at the cache's next update
        } else if (!sets.retained.count(v.uid) && options_.eviction == Eviction::never && !live) {
          row.verdict = SlotVerdict::dead_held;  // kept for good, outside the mask
        } else if (!sets.retained.count(v.uid) && blocks && !live && row.index >= block_start) {
          row.verdict = SlotVerdict::dead_held;  // in the buffer until its block is evicted
        } else if (!sets.retained.count(v.uid) && !live && options_.eviction != Eviction::eager &&
                   in_last_chunk_span(s_.policies[static_cast<std::size_t>(l)], row.index,
                                      static_cast<std::int64_t>(history.size()))) {
          row.verdict = SlotVerdict::dead_held;  // SPEC 10.2: a ring of C slots keeps the last C tokens
        } else if (!sets.retained.count(v.uid)) {
          row.verdict = SlotVerdict::not_retained;
          if (check_set) {
            retained_.fail(
                blocks ? fmt::format("{} slot {} still holds uid {} (token {}), which {} has evicted", where, v.slot,
                                     v.uid, row.index, block_rule(policy, length, block_start))
                       : fmt::format("{} slot {} still holds uid {} (token {}), which the policy evicted", where,
                                     v.slot, v.uid, row.index));
            SlotIssue extra = SlotIssue::of(SlotIssue::Kind::extra, b, v.uid, row.index);
            extra.slot = v.slot;
            extra.window_gap = window_start(s_.policies[static_cast<std::size_t>(l)], ret) - row.index;
            extra.in_chunk =
                rec.append && !rec.append->rows[b].empty() && row.index >= rec.append->rows[b].front().index;
            extra.block_count = blocks && !live;
            evidence.slots.push_back(extra);
          }
        } else if (!live && options_.eviction == Eviction::eager && !sets.droppable.count(v.uid)) {
          row.verdict = SlotVerdict::not_retained;
          if (check_set) {
            retained_.fail(
                fmt::format("{} slot {} still holds uid {} (token {}), which no later query sees, though "
                            "the cache is declared to evict eagerly",
                            where, v.slot, v.uid, row.index));
            SlotIssue dead = SlotIssue::of(SlotIssue::Kind::extra, b, v.uid, row.index);
            dead.slot = v.slot;
            dead.dead = true;
            evidence.slots.push_back(dead);
          }
        } else {
          row.verdict = live ? SlotVerdict::ok : SlotVerdict::dead_held;
        }
        // A key no later query sees (SPEC 10.4) is not judged for its rotation: a shift may
        // leave it as it was.
        const bool judged = (row.index >= 0 || options_.key_positions == KeyPositions::claimed) &&
                            !sets.droppable.count(v.uid);
        if (judged && v.uid >= 0 && v.uid < inputs_.uids && v.key != nullptr)
          check_key(rec, view, l, b, static_cast<int>(g), v, row, positions, sets, evidence, state, where);
        if (precision_off && is_fine(row.verdict) && row.verdict != SlotVerdict::dead_held)
          row.verdict = SlotVerdict::precision_off;
        if (g == 0) state.table.push_back(row);
      }
      // Tokens the cache should hold but does not.
      for (const auto& [uid, key] : sets.retained) {
        if (held.count(uid)) continue;
        // A cache that never evicts masks instead: a dead token no query sees again may be gone
        // (assisted generation's transformers layers trim to W - 1 before they start keeping).
        const bool dead = !sets.live.count(uid);
        // Under block eviction a dead token is held: in its buffer (sliding) or as under lazy.
        // A sliding layer under a shift may drop what no later query sees, however it evicts
        // otherwise (llama.cpp's iSWA cache reuses masked cells).
        const bool fine = sets.droppable.count(uid) ||
                          (dead && options_.eviction != Eviction::lazy && options_.eviction != Eviction::deferred &&
                           options_.eviction != Eviction::blocks);
        if (g == 0) {
          SlotRow row;
          row.row = b;
          row.uid = uid;
          row.index = key->index;
          row.verdict = fine ? SlotVerdict::dead_dropped : SlotVerdict::missing;
          state.table.push_back(row);
        }
        if (fine || !check_set) continue;
        retained_.fail(fmt::format("{} lost uid {} (token {}){}", where, uid, key->index,
                                   !dead  ? ", which the next token still sees"
                                   : blocks ? ", which " + block_rule(policy, length, block_start) + " still holds"
                                            : ", which the cache is declared to keep until the next token (lazy)"));
        SlotIssue lost = SlotIssue::of(SlotIssue::Kind::lost, b, uid, key->index);
        lost.block_count = dead && blocks;
        evidence.slots.push_back(lost);
      }
      // Under block eviction, also the evicted tokens its buffer still holds (SPEC 3.1).
      for (std::int64_t index = block_start; blocks && index < length; ++index) {
        const auto uid = static_cast<std::int64_t>(history[static_cast<std::size_t>(index)]);
        if (held.count(uid) || sets.retained.count(uid)) continue;
        if (g == 0) {
          SlotRow row;
          row.row = b;
          row.uid = uid;
          row.index = index;
          row.verdict = SlotVerdict::missing;
          state.table.push_back(row);
        }
        if (!check_set) continue;
        retained_.fail(fmt::format("{} lost uid {} (token {}), which {} still holds", where, uid, index,
                                   block_rule(policy, length, block_start)));
        SlotIssue lost = SlotIssue::of(SlotIssue::Kind::lost, b, uid, index);
        lost.block_count = true;
        evidence.slots.push_back(lost);
      }
    }
  }

  // SPEC 3.1, in words, for a row of `length` tokens whose buffer starts at token `start`.
  std::string block_rule(const Policy& policy, std::int64_t length, std::int64_t start) const {
    return fmt::format("a buffer of {} evicting {} at once (its last {} of {} tokens)", options_.block_capacity,
                       options_.block_capacity - policy.window + 1, length - start, length);
  }

  // Whether some query of this step's append (row b, layer l) saw the token.
  static bool seen_by_append(const StepRecord& rec, int l, int b, std::int64_t uid) {
    if (!rec.append) return false;
    const auto& history = rec.histories[static_cast<std::size_t>(b)];
    for (const auto& token : rec.append->rows[static_cast<std::size_t>(b)])
      for (const reference::VisibleKey& key : token.view_in(l).keys)
        if (static_cast<std::int64_t>(history[static_cast<std::size_t>(key.index)]) == uid) return true;
    return false;
  }

  // Where a cache-relative key may sit: as the row's last token saw it (lazy), or as the
  // next token will (eager), one convention per row and kv head.
  enum class Convention { lazy, eager };

  // The convention under which the row's keys fit best: lazy unless every key fits the
  // eager positions (allowed only where no dead token is held) and some does not fit lazy.
  Convention key_convention(const StepRecord& rec, const CacheView& view, int l, int b, int g,
                            const std::vector<ViewSlot>& slots, const RowSets& sets, bool dead_held) {
    if (options_.key_positions != KeyPositions::cache_relative || dead_held || sets.retained.size() == sets.live.size())
      return Convention::lazy;
    std::size_t lazy_misfits = 0, eager_misfits = 0;
    const int D = s_.dims.head_dim;
    for (const ViewSlot& v : slots) {
      if (v.uid < 0 || v.uid >= inputs_.uids || v.key == nullptr || index_of(rec.histories[b], v.uid) < 0 ||
          sets.droppable.count(v.uid))
        continue;
      const auto lazy = sets.lazy_position(v.uid), eager = sets.eager_position(v.uid);
      if (!lazy) continue;
      const float* raw = inputs_.k_at(l, static_cast<std::uint64_t>(v.uid), g);
      const double tol = rotation_tolerance(raw, D, key_roundoff_in(view, l));
      const bool lazy_misfit = rotations(l).error(v.key, raw, *lazy) > tol;
      lazy_misfits += lazy_misfit;
      eager_misfits += *eager == *lazy ? lazy_misfit : rotations(l).error(v.key, raw, *eager) > tol;
    }
    return eager_misfits < lazy_misfits ? Convention::eager : Convention::lazy;
  }

  // SPEC 9.2.5: a quantized key re-quantized at every shift drifts from its raw key by
  // what the simulated chain drifts (not tolerated: simulated): the reference's stored key
  // at that position, rotated back, is that far from the raw key.
  double simulated_drift(const StepRecord& rec, int l, int b, int g, std::int64_t uid, std::int64_t position,
                         const float* raw) {
    if (rec.stored.empty() || !s_.quant(l).k) return 0.0;
    const reference::StoredLayer* token = stored_key(rec, l, b, uid, position);
    if (token == nullptr) return 0.0;
    const std::vector<double>& stored = token->heads[static_cast<std::size_t>(g)].key;
    const std::vector<float> as_float(stored.begin(), stored.end());
    return rotations(l).error(as_float.data(), raw, position);
  }

  // What the reference stored for token `uid` of row b in layer l with its key at
  // `position`: a retained token, or one a chunked layer's ring may still hold. Null: none.
  static const reference::StoredLayer* stored_key(const StepRecord& rec, int l, int b, std::int64_t uid,
                                                  std::int64_t position) {
    if (rec.stored.empty()) return nullptr;
    const auto& keys = rec.retained_in(l, b).keys;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (static_cast<std::int64_t>(keys[i].uid) == uid && keys[i].position == position)
        return &rec.stored[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)][i];
    if (static_cast<std::size_t>(l) >= rec.stored_ring.size()) return nullptr;
    const auto& rows = rec.stored_ring[static_cast<std::size_t>(l)];
    if (static_cast<std::size_t>(b) >= rows.size()) return nullptr;
    const std::int64_t index = index_of(rec.histories[static_cast<std::size_t>(b)], uid);
    for (const auto& [i, token] : rows[static_cast<std::size_t>(b)])
      if (i == index && i == position) return &token;  // chunked layers keep true positions
    return nullptr;
  }

  // Without codes, a quantized key against the simulated one at `position` (SPEC 9.2.5):
  // within one code step of every element, where the policy never moves a stored key (a
  // shift chain that took a boundary the other way could not be followed without codes).
  // nullopt: not applicable.
  std::optional<bool> matches_simulated_key(const StepRecord& rec, int l, int b, int g, const ViewSlot& v,
                                            std::int64_t position) const {
    if (rec.stored.empty() || !s_.quant(l).k || v.key_codes || v.raw) return std::nullopt;
    const bool moves = std::any_of(s_.policies.begin(), s_.policies.end(), [](const Policy& p) {
      return p.kind == PolicyKind::sink && p.positions == SinkPositions::cache;
    });
    if (moves) return std::nullopt;
    if (const reference::StoredLayer* found = stored_key(rec, l, b, v.uid, position)) {
      const reference::StoredLayer& token = *found;
      if (token.raw) return std::nullopt;  // in the residual: held in kv_dtype
      const reference::StoredHead& h = token.heads[static_cast<std::size_t>(g)];
      const TensorQuant& format = *s_.quant(l).k;
      const int D = s_.dims.head_dim, group = std::max(1, reference::scale_group(format, D));
      double step = 0.0;  // the largest code step of the row, both sides of a boundary
      for (int d = 0; d < D; ++d)
        step = std::max(step, 2.0 * reference::element_bound(format.format, h.key[static_cast<std::size_t>(d)],
                                                             h.key_codes.scales[static_cast<std::size_t>(d / group)]));
      if (s_.quant_rules().transform == QuantTransform::hadamard) step *= std::sqrt(static_cast<double>(D));
      for (int d = 0; d < D; ++d)
        if (!(std::abs(v.key[d] - h.key[static_cast<std::size_t>(d)]) <= step + 1e-6)) return false;
      return true;
    }
    return std::nullopt;
  }

  // The key of slot v: rotated back by the position it claims, it must be its raw key.
  void check_key(const StepRecord& rec, const CacheView& view, int l, int b, int g, const ViewSlot& v, SlotRow& row,
                 Convention convention, const RowSets& sets, StepEvidence& evidence, RowState& state,
                 const std::string& where) {
    const int D = s_.dims.head_dim;
    const std::optional<std::int64_t> lazy = sets.lazy_position(v.uid);
    std::int64_t claim = 0;
    switch (options_.key_positions) {
      case KeyPositions::claimed:
        claim = v.claimed_position.value_or(0);
        break;
      case KeyPositions::cache_relative:
        if (!lazy) return;  // nothing to expect of a token the policy does not keep
        claim = convention == Convention::eager ? *sets.eager_position(v.uid) : *lazy;
        break;
      case KeyPositions::absolute:
        claim = row.index;
        break;
      case KeyPositions::unrotated:
        claim = 0;
        break;
    }
    // A key re-encoded for the next token was used at its lazy position.
    const std::int64_t shift = options_.key_positions == KeyPositions::cache_relative ? *lazy - claim : 0;
    if (g == 0) {
      row.position_claimed = claim;
      if (lazy) row.position_expected = *lazy;
      state.keys[v.uid] = v.key;
    }
    const float* raw = inputs_.k_at(l, static_cast<std::uint64_t>(v.uid), g);
    const double error = rotations(l).error(v.key, raw, claim);
    step_rotation_error_ = std::max(step_rotation_error_, error);
    // A coarse quantized key whose codes the source does not show is held to the value the
    // reference simulates at its claimed position, within a code step: the rotation check's
    // tolerance, one step of the format, would let a wrong position through.
    const std::optional<bool> near_simulated = matches_simulated_key(rec, l, b, g, v, claim);
    if (near_simulated && !*near_simulated) {
      // fall through: not at its claim
    } else if (near_simulated ||
               error <= rotation_tolerance(raw, D, key_roundoff_in(view, l)) +
                            simulated_drift(rec, l, b, g, v.uid, claim, raw)) {
      if (g == 0) state.key_position[v.uid] = claim + shift;
      return;
    }
    RecoveredPosition r = recover_position(raw, v.key, D, s_.rope(l), max_position_, key_roundoff_in(view, l), other_ropes(l));
    // A key moved since its write by another layer's rope (issue 12357's shift): a search
    // over write positions, for the step's first few such keys only.
    if (r.status == RecoveredPosition::Status::not_rotation && r.fits.kind == OtherRope::Kind::none &&
        shift_searches_left_ > 0 && !other_ropes(l).empty()) {
      --shift_searches_left_;
      r.fits = recover_shift_with_other_rope(raw, v.key, D, s_.rope(l), claim, other_ropes(l), max_position_,
                                             rotation_tolerance(raw, D, key_roundoff_in(view, l)));
    }
    if (g == 0 && r.status != RecoveredPosition::Status::not_rotation) state.key_position[v.uid] = r.position + shift;
    // Rotated back by its claim the key is still closest to its raw key, by far: the right
    // position, carrying more rounding error than one rounding to the storage explains.
    const double at_claim = rotations(l).error(v.key, raw, claim);
    const bool best_at_claim =
        at_claim < 0.5 * std::min(rotations(l).error(v.key, raw, claim - 1), rotations(l).error(v.key, raw, claim + 1));
    if (g == 0 && is_fine(row.verdict)) row.verdict = SlotVerdict::key_off_claim;
    rotation_.fail(
        fmt::format("{} slot {} (uid {}, token {}): the key is not its raw key rotated by {} {} "
                    "(recovered: {})",
                    where, v.slot, v.uid, row.index,
                    options_.key_positions == KeyPositions::claimed ? "its claimed position" : "the expected position",
                    claim, describe(r)));
    SlotIssue issue = SlotIssue::of(SlotIssue::Kind::rotation, b, v.uid, row.index);
    issue.slot = v.slot;
    issue.claimed_index = v.claimed_index.value_or(row.index);
    issue.claimed_position = claim;
    issue.newest = row.index + 1 == static_cast<std::int64_t>(rec.histories[b].size());
    if (r.status != RecoveredPosition::Status::not_rotation) issue.recovered_position = r.position;
    issue.fits = r.fits;
    issue.closest_at_claim = best_at_claim;
    evidence.slots.push_back(issue);
  }

  // A hybrid's layer holding wrong tokens: does it hold exactly what another layer's
  // policy keeps? Then the cache gave this layer that layer's policy.
  void match_other_layer_policy(const StepRecord& rec, const CacheView& view, int l, int b, StepEvidence& evidence) {
    const auto& heads = view.layers[static_cast<std::size_t>(l)].slots[static_cast<std::size_t>(b)];
    if (heads.empty()) return;
    std::set<std::int64_t> held;
    for (const ViewSlot& v : heads[0])
      if (v.uid >= 0) held.insert(v.uid);
    const auto length = static_cast<std::int64_t>(rec.histories[b].size());
    const auto kept_by = [&](const Policy& p) {
      std::set<std::int64_t> kept;
      for (const auto& key : reference::retained_view(p, length).keys)
        kept.insert(static_cast<std::int64_t>(rec.histories[b][static_cast<std::size_t>(key.index)]));
      return kept;
    };
    const std::set<std::int64_t> own = kept_by(s_.policies[static_cast<std::size_t>(l)]);
    if (held == own) return;  // the right tokens: the trouble is elsewhere (a rotation, say)
    for (std::size_t m = 0; m < s_.policies.size(); ++m) {
      if (s_.policies[m] == s_.policies[static_cast<std::size_t>(l)]) continue;
      const std::set<std::int64_t> kept = kept_by(s_.policies[m]);
      if (kept != own && kept == held) {
        evidence.layer_holds_policy_of = std::pair<int, int>{l, static_cast<int>(m)};
        return;
      }
    }
  }

  void compare_outputs(const StepRecord& rec, int l, int b, const float* out, const float* rotated_q,
                       const Tolerance& tol, StepEvidence& evidence) {
    const reference::AppendResult& ref = *rec.append;
    const int H = s_.dims.heads, D = s_.dims.head_dim;
    const auto B = ref.rows.size();
    const std::int64_t n = ref.chunk;
    const std::int64_t pad = n - static_cast<std::int64_t>(ref.rows[b].size());
    // The reference's outputs (R_stored over a quantized cache's codes), unless a check of
    // the list expects others (over what the cache holds) or lets them move further.
    OutputRule rule;
    for (SubCheck* check : checks_) check->rule_outputs(rec, l, b, rotated_q, rule);
    outputs_seen_ = true;
    const std::vector<double>& query_slack = rule.query_slack;
    const std::vector<double>& expected =
        !rule.expected.empty() ? rule.expected : ref.out_stored.empty() ? ref.out : ref.out_stored;
    const double row_allowance = rule.allowance;
    const std::size_t skipped = uncomputed(b);  // a prefix hit spared their outputs
    for (SubCheck* check : checks_) check->check_outputs(rec, l, b, out, skipped, evidence);
    std::optional<std::pair<std::size_t, int>> first;  // (token, head) of the first mismatch
    // SPEC 9.2.6: a token of a decode step, or inside a longer chunk, kept to compare with
    // the other path's computation of it.
    const bool decode = n == 1;
    // A forward's record is part of its chunk, which the whole step records.
    const bool on_a_path = rec.forward == 0 && paths_.enabled() && (decode || ref.rows[b].size() > 1);
    std::vector<double> path_want, path_allowed;
    for (std::size_t i = skipped; i < ref.rows[b].size(); ++i) {
      path_want.clear();
      path_allowed.clear();
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const std::size_t at = ((static_cast<std::size_t>(b) * n + pad + i) * H + h) * D + d;
          const double want = expected[static_cast<std::size_t>(l) * B * n * H * D + at];
          const double got = out[at];
          const double err = std::abs(got - want);
          sum_sq_err_ += std::isnan(err) ? 0.0 : err * err;
          sum_sq_ref_ += want * want;
          max_abs_ = std::max(max_abs_, std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
          const double slack =
              query_slack.empty() || !rule.slack_allowance
                  ? 0.0
                  : rule.slack_allowance(query_slack[(static_cast<std::size_t>(l) * B * n * H * D + at) / D]);
          const double allowed = tol.atol + row_allowance + slack + tol.rtol * std::abs(want);
          if (on_a_path) {
            path_want.push_back(want);
            path_allowed.push_back(allowed);
          }
          if (err <= allowed) continue;
          if (!first) first = {i, h};
          const auto& token = ref.rows[b][i];
          std::optional<PoisonedRead> poison;
          if (const std::optional<optimized::PoisonMark> mark = optimized::read_poison(out[at]))
            poison = PoisonedRead{l, b, token.index, static_cast<std::int64_t>(token.uid), mark->block, mark->epoch,
                                  mark->kind == optimized::PoisonKind::freed};
          outputs_.fail(fmt::format("{}: layer {} row {} token {} (uid {}) head {} dim {}: expected {:.9g}, got {:.9g}{}",
                                    evidence.label, l, b, token.index, token.uid, h, d, want, got,
                                    poison ? ", " + poison_text(*poison) : std::string()));
          if (poison && !evidence.poisoned) evidence.poisoned = poison;
          if (evidence.outputs.size() < 64)
            evidence.outputs.push_back({l, b, h, d, token.index, static_cast<std::int64_t>(token.uid), want, got});
        }
      if (on_a_path) {
        const auto& token = ref.rows[b][i];
        const std::size_t at = (static_cast<std::size_t>(b) * n + pad + i) * H * D;
        paths_.record({l, b, evidence.step, token.index, static_cast<std::int64_t>(token.uid), decode,
                       context_key(s_, token.uid), std::span<const float>(out + at, static_cast<std::size_t>(H) * D),
                       path_want, path_allowed},
                      evidence);
      }
    }
    if (!first || evidence.hypotheses_tested) return;
    // The first wrong output recomputed under named mistakes: does one of them fit it?
    evidence.hypotheses_tested = true;
    const auto [i, h] = *first;
    const std::size_t at = ((static_cast<std::size_t>(b) * n + pad + i) * H + h) * D;
    const auto fits = [&](const std::vector<double>& other) {
      for (int d = 0; d < D; ++d)
        if (!(std::abs(out[at + d] - other[d]) <= tol.atol + tol.rtol * std::abs(other[d]))) return false;
      return true;
    };
    // The row's uids (a prune's marks dropped: the hypotheses read inputs by uid).
    std::vector<std::uint64_t> uids(rec.histories[b].size());
    for (std::size_t t = 0; t < uids.size(); ++t) uids[t] = rec.histories[b][t];
    const std::span<const std::uint64_t> history(uids);
    // The append's tokens as the hypotheses see them: with the keys a press chose to keep in
    // this head's group (SPEC 11.1), which the reference's views lack.
    std::vector<reference::RetainedKey> chosen;
    for (const SubCheck* check : checks_) check->chosen_keys(rec, l, b, h / (H / s_.dims.kv_heads), chosen);
    const std::vector<reference::AppendedToken> completed =
        chosen.empty() ? std::vector<reference::AppendedToken>() : with_chosen_keys(ref.rows[b], l, chosen);
    const std::span<const reference::AppendedToken> tokens =
        chosen.empty() ? std::span<const reference::AppendedToken>(ref.rows[b]) : std::span(completed);
    if (!s_.attention.sink_logits.empty())
      evidence.outputs_fit_without_learned_sinks =
          fits(output_without_learned_sinks(s_, inputs_, history, tokens[i], l, h));
    else
      evidence.outputs_fit_with_a_zero_sink = fits(output_with_a_zero_sink(s_, inputs_, history, tokens[i], l, h));
    if (s_.attention.query_temperature && s_.rope(l).nope)
      evidence.outputs_fit_without_query_temperature =
          fits(output_without_query_temperature(s_, inputs_, history, tokens[i], l, h));
    for (const SubCheck* check : checks_) check->explain_output(rec, l, b, i, h, out, tol, evidence);
    if (i + 1 < ref.rows[b].size())
      evidence.outputs_fit_with_later_chunk_keys =
          fits(output_with_later_chunk_keys(s_, inputs_, history, tokens, i, l, h));
    const Policy& policy = s_.policies[static_cast<std::size_t>(l)];
    if (policy.kind == PolicyKind::sink && policy.sinks > 0 && policy.positions == SinkPositions::original)
      evidence.outputs_fit_plain_window =
          fits(output_in_a_plain_window(s_, inputs_, history, tokens, i, policy.window, l, h));
    if (policy.swa > 0 && policy.prefill == Prefill::streaming)
      evidence.outputs_fit_window_in_token_indices =
          fits(output_with_window_in_token_indices(s_, inputs_, history, tokens[i], l, h));
    if (policy.kind == PolicyKind::sliding)
      for (const std::int64_t other : {policy.window + 1, policy.window - 1})
        evidence.outputs_fit_window_off_by_one =
            evidence.outputs_fit_window_off_by_one ||
            (other > 0 && fits(output_in_a_window_of(s_, inputs_, history, tokens[i], other, l, h)));
    if (policy.kind == PolicyKind::chunked) {
      // The visible keys are a run ending at the query: a window of t - begin + 1 keys.
      const std::int64_t t = tokens[i].index, c = policy.window;
      auto fits_from = [&](std::int64_t begin) {
        begin = std::max<std::int64_t>(0, begin);
        return begin <= t && begin != t / c * c &&
               fits(output_in_a_window_of(s_, inputs_, history, tokens[i], t - begin + 1, l, h));
      };
      evidence.outputs_fit_chunk_as_window = fits_from(t - c + 1);
      evidence.outputs_fit_chunk_edge_off_by_one =
          fits_from(chunk_start_moved(t, c, 1)) || fits_from(chunk_start_moved(t, c, -1));
    }
  }

  // SPEC 5.3 from the kernel's log: every visible pair at the reference's Pq - Pk, as
  // integers, and exactly the reference's visible tokens.
  void compare_pairs(const StepRecord& rec, std::vector<UsedPair> log, StepEvidence& evidence,
                     std::vector<RowState>& rows) {
    pairs_seen_ = true;
    // The log sorted by (row, query, key uid): each query's pairs are one run, walked
    // beside the reference's visible keys sorted the same way.
    std::sort(log.begin(), log.end(), [](const UsedPair& x, const UsedPair& y) {
      return std::tie(x.row, x.query_index, x.key_uid) < std::tie(y.row, y.query_index, y.key_uid);
    });
    std::vector<std::pair<std::int64_t, std::int64_t>> want;  // (uid, distance), sorted by uid
    auto at = log.begin();
    for (int b = 0; b < static_cast<int>(rec.append->rows.size()); ++b) {
      // A forward's keys are named by the whole append's history: a read of a later token
      // is that token, not a stale slot.
      const auto& history = rec.after_append.empty() ? rec.histories[b] : rec.after_append[b];
      const std::size_t skipped = uncomputed(b);  // a prefix hit spared their attention
      for (const auto& token : rec.append->rows[b]) {
        if (static_cast<std::size_t>(&token - rec.append->rows[b].data()) < skipped) continue;
        const std::int64_t e = reference::evicted_count(s_.policy(0), token.index);  // layer 0's log
        auto note = [&](std::int64_t uid, std::optional<std::int64_t> w, std::optional<std::int64_t> a,
                        std::optional<std::int64_t> qpos, const std::string& text) {
          positions_.fail(fmt::format("{}: row {} token {}: {}", evidence.label, b, token.index, text));
          evidence.pairs.push_back({b, token.index, uid, index_of(history, uid), w, a, qpos, e});
        };
        want.clear();
        for (const auto& key : token.view.keys)
          want.push_back({static_cast<std::int64_t>(history[key.index]), token.view.query_position - key.position});
        std::sort(want.begin(), want.end());
        // Pairs of a query the step does not have (a cache that numbers padding as tokens):
        // a failure, though the slots tell the story better than these pairs.
        auto before = [&](const UsedPair& p) { return std::tie(p.row, p.query_index) < std::tie(b, token.index); };
        for (; at != log.end() && before(*at); ++at)
          positions_.fail(fmt::format("{}: row {}: the cache attended for token {}, which the step does not have",
                                      evidence.label, at->row, at->query_index));
        auto end = at;
        while (end != log.end() && end->row == b && end->query_index == token.index) ++end;
        const bool last = &token == &rec.append->rows[b].back();
        if (last) rows[b].pairs_known = true;  // the table shows the row's last query (layer 0's log)
        auto w = want.begin();
        for (auto p = at; p != end; ++p) {
          const std::int64_t distance = p->query_position - p->key_position;
          if (last) rows[b].distance[p->key_uid] = distance;
          if (p != at && std::prev(p)->key_uid == p->key_uid) {
            // The same token attended twice (a duplicated slot, or ring plus chunk).
            positions_.fail(fmt::format("{}: row {} token {}: the cache used uid {} twice", evidence.label, b,
                                        token.index, p->key_uid));
            evidence.slots.push_back(
                SlotIssue::of(SlotIssue::Kind::duplicated, b, p->key_uid, index_of(history, p->key_uid)));
            continue;
          }
          for (; w != want.end() && w->first < p->key_uid; ++w)
            note(w->first, w->second, std::nullopt, std::nullopt,
                 fmt::format("uid {} should be visible at distance {}, the cache did not use it", w->first, w->second));
          if (w != want.end() && w->first == p->key_uid) {
            if (w->second != distance)
              note(p->key_uid, w->second, distance, p->query_position,
                   fmt::format("uid {} at distance {}, expected {}", p->key_uid, distance, w->second));
            ++w;
          } else {
            note(p->key_uid, std::nullopt, distance, p->query_position,
                 fmt::format("the cache used uid {} (distance {}), which the policy does not make visible", p->key_uid,
                             distance));
          }
        }
        for (; w != want.end(); ++w)
          note(w->first, w->second, std::nullopt, std::nullopt,
               fmt::format("uid {} should be visible at distance {}, the cache did not use it", w->first, w->second));
        at = end;
      }
    }
    for (; at != log.end(); ++at)
      positions_.fail(fmt::format("{}: row {}: the cache attended for token {}, which the step does not have",
                                  evidence.label, at->row, at->query_index));
  }

  // SPEC 5.3 from tensors alone: the row's last query's position recovered from its
  // rotated q, against the positions its keys were used at.
  void derive_pairs(const StepRecord& rec, const CacheView& view, int l, int b, StepEvidence& evidence,
                    RowState& state) {
    const auto& tokens = rec.append->rows[b];
    // Dense prefill: a chunk's queries saw a state the trace does not show. Unrotated keys
    // carry no position to measure a distance against.
    // A NoPE layer (SPEC 10.1) has no positions to measure: no score depends on them.
    if (tokens.empty() || s_.policy(l).prefill != Prefill::streaming ||
        options_.key_positions == KeyPositions::unrotated || s_.rope(l).nope)
      return;
    const int H = s_.dims.heads, D = s_.dims.head_dim;
    const std::int64_t n = rec.append->chunk;
    const auto& last = tokens.back();
    const float* rotated = view.layers[l].q + ((static_cast<std::size_t>(b) * n + n - 1) * H + 0) * D;
    const RecoveredPosition r =
        recover_position(inputs_.q_at(l, last.uid, 0), rotated, D, s_.rope(l), max_position_, view.query_roundoff);
    pairs_seen_ = true;
    if (r.status == RecoveredPosition::Status::not_rotation) {
      positions_.fail(
          fmt::format("{}: layer {} row {} token {}: the trace's query is no rotation of its raw query ({})",
                      evidence.label, l, b, last.index, describe(r)));
      evidence.query_unreadable = true;
      return;
    }
    state.pairs_known = true;
    // A cache that keeps keys at original positions rotates the query twice (sink_ring);
    // one rotated q shows only the window rotation, so sinks are judged by keys alone.
    const Policy& policy = s_.policies[static_cast<std::size_t>(l)];
    const reference::QueryView& seen = last.view_in(l);
    const bool skip_sinks = policy.kind == PolicyKind::sink && options_.key_positions != KeyPositions::cache_relative;
    for (const auto& key : seen.keys) {
      if (skip_sinks && key.index < policy.sinks) continue;
      const auto uid = static_cast<std::int64_t>(rec.histories[b][key.index]);
      const auto it = state.key_position.find(uid);
      if (it == state.key_position.end()) continue;  // not held, or no rotation: reported with the slots
      const std::int64_t want = seen.query_position - key.position, got = r.position - it->second;
      state.distance[uid] = got;
      if (want == got) continue;
      positions_.fail(
          fmt::format("{}: layer {} row {} token {}: query at {}, key uid {} at {}: distance {}, expected {}",
                      evidence.label, l, b, last.index, r.position, uid, it->second, got, want));
      if (l == 0)
        evidence.pairs.push_back(
            {b, last.index, uid, key.index, want, got, r.position, reference::evicted_count(s_.policy(l), last.index)});
    }
  }

  // The table's visibility and distances, as seen by the row's last token of the step.
  void fill_distances(const StepRecord& rec, const CacheView& view, int l, int b, RowState& state) {
    const bool attended = rec.append && !rec.append->rows[b].empty();
    std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> expected;  // uid -> (distance, Pk)
    if (attended) {
      const reference::QueryView& last = rec.append->rows[b].back().view_in(l);
      for (const auto& key : last.keys)
        expected[static_cast<std::int64_t>(rec.histories[b][key.index])] = {last.query_position - key.position,
                                                                            key.position};
      // Kv head 0's keys a press chose to keep (SPEC 11.1): the table shows head 0.
      std::vector<reference::RetainedKey> chosen;
      for (const SubCheck* check : checks_) check->chosen_keys(rec, l, b, 0, chosen);
      for (const auto& key : chosen)
        expected[static_cast<std::int64_t>(key.uid)] = {last.query_position - key.position, key.position};
    }
    for (SlotRow& r : state.table) {
      if (const auto it = expected.find(r.uid); it != expected.end()) {
        r.visible_expected = true;
        r.distance_expected = it->second.first;
        r.position_expected = it->second.second;
      }
      if (r.slot < 0 || !attended) continue;
      // The kernel's log says what was used (layer 0); a trace's cache attends to every
      // slot it returns, and other layers of a logged cache are taken to do the same.
      const bool logged = view.pairs && state.pairs_known;
      const auto used = state.distance.find(r.uid);
      r.visible_actual = logged ? used != state.distance.end() : true;
      if (used != state.distance.end()) r.distance_actual = used->second;
      if (!is_fine(r.verdict)) continue;
      if (logged && r.visible_expected != r.visible_actual)
        r.verdict = r.visible_actual ? SlotVerdict::visible_should_not_be : SlotVerdict::not_used_should_be;
      else if (r.distance_expected && r.distance_actual && *r.distance_expected != *r.distance_actual)
        r.verdict = SlotVerdict::distance_off;
    }
  }

  StepDiagnosis diagnose(const StepRecord& rec, const CacheView& view, StepEvidence evidence,
                         const StepContext& context, const std::vector<std::vector<RowState>>& rows) {
    StepDiagnosis d;
    d.context = context;
    d.layer = !evidence.slots.empty()     ? evidence.slots.front().layer
              : !evidence.outputs.empty() ? evidence.outputs.front().layer
                                          : 0;
    if (!evidence.pairs.empty()) {
      d.row = evidence.pairs.front().row;
      d.query_index = evidence.pairs.front().query_index;
    } else if (!evidence.slots.empty()) {
      d.row = evidence.slots.front().row;
    } else if (!evidence.outputs.empty()) {
      d.row = evidence.outputs.front().row;
      d.query_index = evidence.outputs.front().query_index;
    }
    if (rec.append && d.row < static_cast<int>(rec.append->rows.size()) && !rec.append->rows[d.row].empty()) {
      d.table_query_index = rec.append->rows[d.row].back().index;
      if (d.query_index < 0) d.query_index = d.table_query_index;
      evidence.evicted_before_last = reference::evicted_count(s_.policy(d.layer), d.table_query_index);
      if (static_cast<std::size_t>(d.layer) < rows.size() && static_cast<std::size_t>(d.row) < rows[d.layer].size() &&
          d.query_index == d.table_query_index) {
        const auto& table = rows[d.layer][d.row].table;
        evidence.dropped_before_last_use = std::any_of(table.begin(), table.end(), [](const SlotRow& r) {
          return r.verdict == SlotVerdict::dead_dropped && r.visible_expected;
        });
      }
    }
    evidence.layer = d.layer;
    d.bug = classify(s_, evidence, context);
    d.evidence = std::move(evidence);
    if (static_cast<std::size_t>(d.layer) < rows.size() && static_cast<std::size_t>(d.row) < rows[d.layer].size()) {
      const RowState& state = rows[d.layer][d.row];
      d.slots = state.table;
      for (SlotRow& r : d.slots)
        if (const auto it = state.keys.find(r.uid); it != state.keys.end())
          r.position_recovered =
              describe(recover_position(inputs_.k_at(d.layer, static_cast<std::uint64_t>(r.uid), 0), it->second,
                                        s_.dims.head_dim, s_.rope(d.layer), max_position_, key_roundoff_in(view, d.layer),
                                        other_ropes(d.layer)));
    }
    return d;
  }

  // The slots a row holds at a step, by id: as many cells as slots held, however large the
  // ids (a paged trace's block ids), so the picture grows with what is drawn.
  static std::vector<PictureCell> picture_column(const std::vector<SlotRow>& table) {
    std::vector<PictureCell> column;
    for (const SlotRow& r : table) {
      if (r.slot < 0) continue;
      column.push_back(picture_cell(r));
      column.back().slot = r.slot;
    }
    std::sort(column.begin(), column.end(), [](const PictureCell& a, const PictureCell& b) { return a.slot < b.slot; });
    return column;
  }

  // The diagnosed row's signed position error at this step: the largest distance error
  // its queries saw, else the largest key rotation error.
  Drift::Point drift_point(const StepRecord& rec, const StepEvidence& e, int row) const {
    Drift::Point p{e.step, 0, false};
    auto bigger = [&](std::int64_t error) {
      if (std::abs(error) > std::abs(p.error)) p.error = error;
    };
    for (const PairMismatch& m : e.pairs)
      if (m.row == row && m.expected && m.actual) bigger(*m.actual - *m.expected);
    if (p.error == 0)
      for (const SlotIssue& i : e.slots)
        if (i.row == row && i.kind == SlotIssue::Kind::rotation && i.recovered_position)
          bigger(*i.recovered_position - i.claimed_position);
    if (row < static_cast<int>(rec.append->rows.size()) && !rec.append->rows[row].empty()) {
      const auto& tokens = rec.append->rows[row];
      p.evicted = reference::evicted_count(s_.policy(e.layer), tokens.back().index) !=
                  reference::evicted_count(s_.policy(e.layer), tokens.front().index - 1);
    }
    return p;
  }

  // Some layer prefills densely: its chunks' queries saw a state no trace shows.
  bool dense_prefill() const {
    return std::any_of(s_.policies.begin(), s_.policies.end(), [](const Policy& p) { return p.prefill == Prefill::dense; });
  }

  Outcome outcome() const {
    Outcome o;
    o.scenario = s_.name;
    o.file = s_.file;
    o.target = options_.target;
    auto add = [&](const char* name, const Tally& t, const std::string& ok) {
      o.checks.push_back({name, t.failures == 0, t.failures == 0 ? ok : t.first});
    };
    if (options_.trace)
      add("steps recorded", unrecorded_,
          fmt::format("{} of {} steps{}{}", recorded_, s_.steps.size(), skipped_.empty() ? "" : "; " + skipped_,
                      served_crop_.empty() ? "" : "; the steps after a served crop not judged (refusals)"));
    add("refusals", refusals_, served_crop_.empty() ? "as the policy says" : "as the policy says, but " + served_crop_);
    add("outputs", outputs_,
        outputs_seen_ ? fmt::format("within atol {:.3g} + rtol {:.3g}", used_tolerance_.atol, used_tolerance_.rtol)
                      : "no outputs to compare");
    add("positions", positions_,
        pairs_seen_                           ? "every visible pair at the reference's distance"
        : dense_prefill()                     ? "not checked: under dense prefill a chunk's queries see a state the "
                                                "trace does not show"
        : options_.key_positions == KeyPositions::unrotated
            ? "not checked: keys stored unrotated carry no position to measure a distance against"
            : "no queries to check");
    std::string eviction = "no token died early";
    if (lazy_rows_ && eager_rows_)
      eviction = "dead tokens kept until the next token in some steps, dropped right away in others";
    else if (lazy_rows_)
      eviction = "lazy: dead tokens kept until the next token";
    else if (eager_rows_)
      eviction = "eager: dead tokens dropped right after the forward";
    if (options_.eviction == Eviction::blocks)
      eviction = fmt::format("sliding layers: the last L(T) tokens of a buffer of {}, evicted in blocks",
                             options_.block_capacity);
    add("retained set", retained_,
        "between the live and the retained set, nothing stale or duplicated (" + eviction + ")");
    add("rotation", rotation_,
        options_.key_positions == KeyPositions::claimed
            ? std::string("every stored key is its raw key rotated by its claimed position")
            : fmt::format("every stored key is its raw key rotated at its {} position",
                          to_string(options_.key_positions)));
    for (const SubCheck* c : checks_) c->add_checks(o);
    o.max_abs_error = max_abs_;
    o.nmse = sum_sq_ref_ > 0 ? sum_sq_err_ / sum_sq_ref_ : 0.0;
    o.position_mismatches = positions_.failures + rotation_.failures;
    o.retained_mismatches = retained_.failures;
    return o;
  }

  const Scenario& s_;
  const InputTable& inputs_;
  std::optional<InputMagnitudes> magnitudes_;  // of inputs_, when a step first needs them
  const CheckOptions options_;  // a copy: callers build it on the spot
  const std::int64_t max_position_;
  std::vector<RotationCheck> rotations_;      // one per distinct rope
  std::vector<std::size_t> rotation_of_layer_;  // per layer, its rope's
  RotationCheck& rotations(int layer) { return rotations_[rotation_of_layer_[static_cast<std::size_t>(layer)]]; }
  // The ropes of the other layers, for recovery's guesses (SPEC 10.1).
  std::vector<Rope> other_ropes(int layer) const {
    std::vector<Rope> out;
    for (const Rope& r : s_.ropes)
      if (!(r == s_.rope(layer)) && std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
    return out;
  }
  CacheTrace trace_;
  StepContext context_;
  bool stopped_ = false;  // an earlier step ended the run's meaning (the cache raised)
  std::vector<Drift::Point> drift_;
  double step_rotation_error_ = 0.0;                              // of the step being checked
  std::vector<std::pair<std::size_t, double>> rotation_errors_;  // per append step
  std::vector<std::vector<std::vector<std::vector<PictureCell>>>> columns_;  // [layer][row][step][slot]
  Tally refusals_, outputs_, positions_, retained_, rotation_, unrecorded_;
  std::optional<QuantChecks> quant_;  // SPEC 9: the scenario quantizes the cache
  PagedChecks paged_;                 // SPEC 8: the cache shows block tables
  PrecisionChecks precision_;         // SPEC 9.2.4: quantized caches with a residual
  PathChecks paths_;                  // SPEC 9.2.6: tokens computed both in a decode step and inside a chunk
  ObservedPruneChecks observed_;      // SPEC 11.1: the tokens a press chose to keep
  std::vector<SubCheck*> checks_;     // the list the one loop runs (the members above)
  std::vector<std::int64_t> uncomputed_;  // the step's, per row (prefix hits)
  std::size_t uncomputed(int row) const {
    return static_cast<std::size_t>(row) < uncomputed_.size()
               ? static_cast<std::size_t>(std::max<std::int64_t>(0, uncomputed_[static_cast<std::size_t>(row)]))
               : 0;
  }
  Tolerance used_tolerance_{0.0, 0.0};
  std::string skipped_;
  std::string served_crop_;  // a crop the policy refuses, served: the run stops being judged
  std::int64_t lazy_rows_ = 0, eager_rows_ = 0, recorded_ = 0;
  bool outputs_seen_ = false, pairs_seen_ = false;
  // recover_shift_with_other_rope's searches left in the step: enough to name the
  // diagnosed keys, bounded on a step where every key of a long row fails.
  static constexpr int kShiftSearchesPerStep = 8;
  int shift_searches_left_ = kShiftSearchesPerStep;
  double max_abs_ = 0.0, sum_sq_err_ = 0.0, sum_sq_ref_ = 0.0;
};

const char* to_string(KeyPositions p) {
  switch (p) {
    case KeyPositions::claimed:
      return "claimed";
    case KeyPositions::cache_relative:
      return "cache-relative";
    case KeyPositions::absolute:
      return "absolute";
    case KeyPositions::unrotated:
      return "unrotated";
  }
  return "?";
}

const char* to_string(Eviction e) {
  switch (e) {
    case Eviction::any:
      return "any";
    case Eviction::lazy:
      return "lazy";
    case Eviction::eager:
      return "eager";
    case Eviction::deferred:
      return "deferred";
    case Eviction::never:
      return "never";
    case Eviction::blocks:
      return "blocks";
  }
  return "?";
}

StepChecker::StepChecker(const Scenario& s, const InputTable& inputs, const CheckOptions& options)
    : impl_(std::make_unique<Impl>(s, inputs, options)) {}
StepChecker::~StepChecker() = default;
bool StepChecker::step(std::size_t index, const StepRecord& record, CacheView view) {
  return impl_->step(index, record, view);
}
void StepChecker::forward(std::size_t index, const StepRecord& record, CacheView view) {
  impl_->forward(index, record, view);
}
CacheTrace StepChecker::finish() { return impl_->finish(); }

CacheTrace check_steps(const Scenario& s, const InputTable& inputs, const ReferenceRun& run,
                       const CheckOptions& options, const Observe& observe) {
  StepChecker checker(s, inputs, options);
  return check_steps(checker, s, run, options.target, observe);
}

CacheTrace check_steps(StepChecker& checker, const Scenario& s, const ReferenceRun& run, const std::string& target,
                       const Observe& observe) {
  Progress& progress = Progress::line();
  std::int64_t tokens = 0;
  progress.begin(s.name + ": " + target, run.steps.size(), count_uids(s));
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const StepRecord& rec = run.steps[i];
    const bool go_on = checker.step(i, rec, observe(i, rec));
    if (rec.append)
      for (const auto& row : rec.append->rows) tokens += static_cast<std::int64_t>(row.size());
    progress.advance(i, tokens);
    if (!go_on) break;
  }
  return checker.finish();
}

}  // namespace kvcheck
