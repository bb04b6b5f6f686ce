#include "tools/harness/check/divergence_report.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>

namespace kvcheck {
namespace {

std::string opt(const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : "-"; }
const char* yes(bool b) { return b ? "yes" : "no"; }

// The slot the report points at: the most direct evidence, the first slot among equals.
const SlotRow* culprit(const StepDiagnosis& f) {
  // A dropped live token is the cause whatever it did to the other slots' positions.
  if (f.bug == BugClass::dropped_live_token)
    for (const SlotRow& r : f.slots)
      if (r.verdict == SlotVerdict::missing) return &r;
  const SlotRow* best = nullptr;
  for (const SlotRow& r : f.slots) {
    if (r.verdict == SlotVerdict::precision_off) continue;  // the precision evidence says it, with a count
    if (severity(r.verdict) > (best ? severity(best->verdict) : 0)) best = &r;
  }
  return best;
}

// A token the table's query should have seen and did not, although no slot is wrong after
// the step: a dead token dropped before the forward that still needed it.
const SlotRow* unseen(const StepDiagnosis& f) {
  for (const SlotRow& r : f.slots)
    if (r.visible_expected && !r.visible_actual) return &r;
  return nullptr;
}

const char* issue_text(const SlotIssue& i) {
  switch (i.kind) {
    case SlotIssue::Kind::lost:
      return "is no longer held";
    case SlotIssue::Kind::stale:
      return "is not this row's token";
    case SlotIssue::Kind::duplicated:
      return "is held twice";
    case SlotIssue::Kind::wrong_index:
      return "claims another token index";
    case SlotIssue::Kind::rotation:
      return "has a key that is not its raw key rotated at its position (beyond the storage's rounding)";
    case SlotIssue::Kind::extra:
      break;
  }
  return "is held where it should not be";
}

std::string where(const StepDiagnosis& f) {
  const StepEvidence& e = f.evidence;
  std::string text = fmt::format("{}, row {}, layer {}", e.label, f.row, f.layer);
  if (!e.outputs.empty() && e.outputs.front().layer == f.layer) text += fmt::format(", head {}", e.outputs.front().head);
  if (f.query_index >= 0) text += fmt::format(", query token {}", f.query_index);
  return text;
}

std::string what(const StepDiagnosis& f, const SlotRow* r) {
  if (!f.evidence.refusal.empty()) return f.evidence.refusal;
  if (f.bug == BugClass::quant_transform_missing && !f.evidence.codes.empty()) {
    // The codes say why the key is "not a rotation": it was stored without the transform.
    const CodeMismatch& c = f.evidence.codes.front();
    const std::size_t n = f.evidence.codes.size();  // the evidence keeps at most 64
    return fmt::format("layer {} row {}: uid {} (slot {}, kv head {}) holds a {} that, read without the Hadamard "
                       "transform, is its token's within the format's rounding; through the transform it is not (the "
                       "first of {}{} such code mismatches at this step)",
                       c.layer, c.row, c.uid, c.slot, c.kv_head, c.value ? "value" : "key", n, n >= 64 ? "+" : "");
  }
  if (r == nullptr) {
    if (!f.evidence.slots.empty()) {
      const SlotIssue& i = f.evidence.slots.front();
      return fmt::format("layer {} row {}: uid {} (token {}) {}", i.layer, i.row, i.uid, i.true_index, issue_text(i));
    }
    if (!f.evidence.precision.empty()) {  // SPEC 9.2.4: it explains the outputs over it
      const PrecisionIssue& p = f.evidence.precision.front();
      const std::size_t n = f.evidence.precision.size();  // the evidence keeps at most 64
      return fmt::format("layer {} row {}: token {} (uid {}, slot {}) is held {}, the residual's rules say {} (the "
                         "first of {}{} such tokens)",
                         p.layer, p.row, p.index, p.uid, p.slot, p.expected_raw ? "quantized" : "raw",
                         p.expected_raw ? "raw" : "quantized", n, n >= 64 ? "+" : "");
    }
    if (!f.evidence.paths.empty()) {  // SPEC 9.2.6: it names both computations
      const PathIssue& p = f.evidence.paths.front();
      const auto path = [](bool decode) { return decode ? "in a decode step" : "inside a chunk"; };
      return fmt::format("layer {} row {}: token {} (uid {}) head {} dim {} is {:.9g} computed {} at step {}, and "
                         "{:.9g} computed {} at step {} (token {}, uid {}) over the same stored cache: {:.3g} apart, "
                         "more than twice the tolerance ({:.3g})",
                         p.layer, p.row, p.index, p.uid, p.head, p.dim, p.here, path(p.decode), p.step, p.there,
                         path(!p.decode), p.other_step, p.other_index, p.other_uid, std::abs(p.here - p.there),
                         p.allowed);
    }
    if (const auto& p = f.evidence.poisoned) {  // SPEC 8.8.5: the NaN names the block
      return fmt::format("layer {} row {}: the output of token {} (uid {}) is {}; the query read a slot {}", p->layer,
                         p->row, p->query_index, p->uid, poison_text(*p),
                         p->freed ? "of a block freed before the read" : "no token had been written to");
    }
    if (!f.evidence.codes.empty()) {  // SPEC 9.2.1: a stored code or scale explains the outputs over it
      const CodeMismatch& c = f.evidence.codes.front();
      const std::size_t n = f.evidence.codes.size();  // the evidence keeps at most 64
      const std::string part = c.element >= 0    ? fmt::format("code {}", c.element)
                               : c.element == -2 ? fmt::format("zero point {}", c.group)
                               : c.element == -3 ? fmt::format("bias {}", c.group)
                                                 : fmt::format("scale {}", c.group);
      return fmt::format("layer {} row {}: uid {} (slot {}, kv head {}) holds a {} whose {} is {:.9g}, the format's "
                         "rule gives {:.9g} (the first of {}{} code mismatches at this step)",
                         c.layer, c.row, c.uid, c.slot, c.kv_head, c.value ? "value" : "key", part, c.actual,
                         c.expected, n, n >= 64 ? "+" : "");
    }
    if (!f.evidence.outputs.empty()) {
      const OutputMismatch& o = f.evidence.outputs.front();
      std::string text = fmt::format("output of token {} (uid {}) dim {}: expected {:.9g}, got {:.9g}; ", o.query_index,
                                     o.uid, o.dim, o.expected, o.actual);
      const SlotRow* gone = f.evidence.dropped_before_last_use ? unseen(f) : nullptr;
      if (gone == nullptr) return text + "every slot checks out";
      return text + fmt::format(
                        "token {} (uid {}) should be visible to token {} and is not: it is dead after this step, "
                        "so the cache may drop it (the table calls its absence fine), but only after this "
                        "forward, not before",
                        gone->index, gone->uid, f.table_query_index);
    }
    return f.evidence.empty() ? "every check passes at this step" : "no single slot stands out";
  }
  const std::string poisoned = f.evidence.poisoned ? "; an output is " + poison_text(*f.evidence.poisoned) : "";
  return fmt::format(
      "{}, uid {} (token {}): visible expected {}, actual {}; position expected {}, claimed {}, "
      "recovered {}; Pq-Pk expected {}, actual {}: {}{}",
      r->slot < 0 ? std::string("no slot") : fmt::format("slot {}", r->slot), r->uid, r->index,
      yes(r->visible_expected), yes(r->visible_actual), opt(r->position_expected), opt(r->position_claimed),
      r->position_recovered.empty() ? "-" : r->position_recovered, opt(r->distance_expected), opt(r->distance_actual),
      verdict_text(*r), poisoned);
}

}  // namespace

std::string class_id(BugClass c) {
  std::string id;
  for (const char* p = class_name(c); *p != '\0'; ++p) {
    const auto ch = static_cast<unsigned char>(*p);
    if (std::isalnum(ch))
      id += static_cast<char>(std::tolower(ch));
    else if (!id.empty() && id.back() != '_')
      id += '_';
  }
  while (!id.empty() && id.back() == '_') id.pop_back();
  return id;
}

FirstDivergence first_divergence(const Scenario& s, const StepDiagnosis& f) {
  FirstDivergence d;
  const StepEvidence& e = f.evidence;
  d.step = e.step;
  if (e.step < s.steps.size()) {
    d.op = s.steps[e.step].source_op;
    d.source = fmt::format("/steps/{}", s.steps[e.step].source_index);
  }
  d.row = f.row;
  d.layer = f.layer;
  if (f.query_index >= 0) d.query_token = f.query_index;
  for (const OutputMismatch& o : e.outputs)
    if (o.layer == f.layer) {
      d.head = o.head;
      d.dim = o.dim;
      d.expected_output = o.expected;
      d.actual_output = o.actual;
      if (o.query_index == f.query_index) d.query_uid = o.uid;
      break;
    }
  const SlotRow* r = culprit(f);
  const SlotRow* named =
      r != nullptr ? r : (e.slots.empty() && e.dropped_before_last_use ? unseen(f) : nullptr);
  if (named != nullptr) {
    if (named->slot >= 0) d.slot = named->slot;
    d.uid = named->uid;
    if (named->index >= 0) d.token = named->index;
    d.expected_distance = named->distance_expected;
    d.actual_distance = named->distance_actual;
    d.expected_position = named->position_expected;
    d.claimed_position = named->position_claimed;
    d.verdict = verdict_text(*named);
  } else if (!e.slots.empty()) {
    const SlotIssue& i = e.slots.front();
    if (i.slot >= 0) d.slot = i.slot;
    d.uid = i.uid;
    if (i.true_index >= 0) d.token = i.true_index;
  }
  d.class_id = class_id(f.bug);
  d.class_name = class_name(f.bug);
  d.explanation = class_explanation(f.bug);
  d.where = where(f);
  d.what = what(f, r);
  return d;
}

}  // namespace kvcheck
