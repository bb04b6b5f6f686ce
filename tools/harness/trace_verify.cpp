#include "tools/harness/trace_verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "reference/policy.h"
#include "reference/rope.h"
#include "tools/harness/inputs.h"
#include "tools/harness/npy.h"
#include "tools/harness/recovery.h"

namespace kvcheck {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

enum class KeyPositions { cache_relative, absolute, unrotated };

struct TraceFiles {
  std::string keys, values, out, q;  // out and q optional
};

struct Trace {
  std::string dir, manifest_path;
  KeyPositions positions = KeyPositions::cache_relative;
  std::vector<std::vector<TraceFiles>> steps;  // [step][layer]; an empty step was not recorded
};

Trace read_manifest(const Scenario& s, const std::string& dir, std::size_t steps) {
  Trace t;
  t.dir = dir;
  t.manifest_path = (fs::path(dir) / "manifest.json").string();
  std::ifstream in(t.manifest_path);
  if (!in) throw InputError(t.manifest_path, "", "no manifest.json in the trace folder");
  json m;
  try {
    m = json::parse(in);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    if (const auto close = what.find("] "); close != std::string::npos) what = what.substr(close + 2);
    throw InputError(t.manifest_path, "", "not valid JSON: " + what);
  }
  auto fail = [&](const std::string& path, const std::string& why) { throw InputError(t.manifest_path, path, why); };
  if (!m.is_object()) fail("", "expected an object");
  auto got = [&](const char* key) { return m.contains(key) ? m[key].dump() : std::string("nothing"); };
  if (!m.contains("format") || m["format"] != "kvcheck-trace-1")
    fail("/format", "expected \"kvcheck-trace-1\", got " + got("format"));
  if (!m.contains("scenario") || m["scenario"] != s.name)
    fail("/scenario", fmt::format("expected the scenario's name \"{}\", got {}", s.name, got("scenario")));
  const std::string kp = m.value("key_positions", "");
  if (kp == "cache-relative")
    t.positions = KeyPositions::cache_relative;
  else if (kp == "absolute")
    t.positions = KeyPositions::absolute;
  else if (kp == "unrotated")
    t.positions = KeyPositions::unrotated;
  else
    fail("/key_positions", "expected one of cache-relative, absolute, unrotated, got " + got("key_positions"));
  for (const auto& [key, value] : m.items())
    if (key != "format" && key != "scenario" && key != "producer" && key != "key_positions" && key != "steps")
      fail("/" + key, "unknown key (expected format, scenario, producer, key_positions, steps)");
  if (!m.contains("steps") || !m["steps"].is_array() || m["steps"].size() != steps)
    fail("/steps",
         fmt::format("expected an array of {} steps (decode expanded into single-token steps), got {}", steps,
                     m.contains("steps") && m["steps"].is_array() ? std::to_string(m["steps"].size()) + " steps"
                                                                  : got("steps")));
  for (std::size_t i = 0; i < steps; ++i) {
    const json& step = m["steps"][i];
    const std::string p = fmt::format("/steps/{}", i);
    std::vector<TraceFiles> layers;
    if (step.is_object() && step.contains("layers")) {
      const json& ls = step["layers"];
      if (!ls.is_array() || static_cast<int>(ls.size()) != s.dims.layers)
        fail(p + "/layers", fmt::format("expected an array of {} layers", s.dims.layers));
      for (std::size_t l = 0; l < ls.size(); ++l) {
        const std::string lp = fmt::format("{}/layers/{}", p, l);
        if (!ls[l].is_object()) fail(lp, "expected an object of file names");
        for (const auto& [key, value] : ls[l].items()) {
          if (key != "keys" && key != "values" && key != "out" && key != "q")
            fail(lp + "/" + key, "unknown key (expected keys, values, out, q)");
          if (!value.is_string()) fail(lp + "/" + key, "expected a file name, got " + value.dump());
        }
        TraceFiles f;
        for (const char* key : {"keys", "values"})
          if (!ls[l].contains(key) || !ls[l][key].is_string()) fail(lp + "/" + key, "expected a file name");
        f.keys = (fs::path(dir) / ls[l]["keys"].get<std::string>()).string();
        f.values = (fs::path(dir) / ls[l]["values"].get<std::string>()).string();
        if (ls[l].contains("out")) f.out = (fs::path(dir) / ls[l]["out"].get<std::string>()).string();
        if (ls[l].contains("q")) f.q = (fs::path(dir) / ls[l]["q"].get<std::string>()).string();
        layers.push_back(f);
      }
    } else if (!step.is_object()) {
      fail(p, "expected an object (empty when the step was not recorded)");
    }
    t.steps.push_back(layers);
  }
  if (std::all_of(t.steps.begin(), t.steps.end(), [](const auto& layers) { return layers.empty(); }))
    fail("/steps", "no step was recorded: a trace needs at least one step with layers");
  return t;
}

NpyArray<double> load(const std::string& path, std::vector<std::size_t> expected, const char* what, bool any_third) {
  NpyArray<double> a = read_npy_as_double(path);
  bool ok = a.shape.size() == expected.size();
  for (std::size_t i = 0; ok && i < expected.size(); ++i) ok = (any_third && i == 2) || a.shape[i] == expected[i];
  if (!ok) {
    std::string want = "[";
    for (std::size_t i = 0; i < expected.size(); ++i)
      want += (i ? ", " : "") + (any_third && i == 2 ? std::string("slots") : std::to_string(expected[i]));
    throw InputError(path, "", fmt::format("expected {} of shape {}], got {}", what, want, shape_string(a.shape)));
  }
  return a;
}

struct Tally {
  std::int64_t failures = 0;
  std::string first;
  void fail(std::string detail) {
    if (failures++ == 0) first = std::move(detail);
  }
};

class Verifier {
 public:
  Verifier(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, const Trace& trace)
      : s_(s), inputs_(inputs), run_(run), trace_(trace), max_position_(largest_position(run)) {}

  CacheTrace operator()() {
    StepContext context;
    for (std::size_t i = 0; i < run_.steps.size(); ++i) {
      const StepRecord& rec = run_.steps[i];
      advance(context, rec);
      if (trace_.steps[i].empty()) continue;
      StepEvidence evidence;
      evidence.step = i;
      evidence.label = step_label(rec.step, i);
      std::vector<std::vector<SlotRow>> tables(static_cast<std::size_t>(s_.dims.layers));
      for (int l = 0; l < s_.dims.layers; ++l) {
        const std::size_t before = evidence.slots.size();
        check_layer(rec, l, evidence, tables[static_cast<std::size_t>(l)]);
        for (std::size_t i = before; i < evidence.slots.size(); ++i) evidence.slots[i].layer = l;
      }
      if (!evidence.empty() && !result_.first) {
        FirstDivergence f;
        f.evidence = evidence;
        f.context = context;
        f.bug = classify(s_, evidence, context);
        f.row = first_row(evidence);
        if (rec.append && f.row < static_cast<int>(rec.append->rows.size()) && !rec.append->rows[f.row].empty())
          f.query_index = f.table_query_index = rec.append->rows[f.row].back().index;
        if (evidence.pairs.empty() && !evidence.outputs.empty()) f.query_index = evidence.outputs.front().query_index;
        f.layer = !evidence.slots.empty() ? evidence.slots.front().layer
                  : !evidence.outputs.empty() ? evidence.outputs.front().layer
                                              : 0;
        for (const SlotRow& r : tables[static_cast<std::size_t>(f.layer)])
          if (r.row == f.row) f.slots.push_back(r);
        result_.first = std::move(f);
      }
    }
    Outcome& o = result_.outcome;
    o.scenario = s_.name;
    o.file = s_.file;
    o.target = "trace";
    auto add = [&](const char* name, const Tally& t, const std::string& ok) {
      o.checks.push_back({name, t.failures == 0, t.failures == 0 ? ok : t.first});
    };
    const auto recorded =
        std::count_if(trace_.steps.begin(), trace_.steps.end(), [](const auto& s) { return !s.empty(); });
    o.checks.push_back({"steps recorded", true, fmt::format("{} of {} steps", recorded, trace_.steps.size())});
    add("outputs", outputs_, outputs_seen_ ? "within tolerance" : "no outputs in the trace");
    add("retained set", retained_, "every slot identified, the retained set, nothing stale or duplicated");
    add("key positions", keys_, "every key a rotation at the expected position");
    add("query positions", queries_,
        queries_seen_                         ? "every query at the expected distance"
        : s_.policy.prefill == Prefill::dense ? "not checked: under dense prefill a chunk's queries see a state "
                                                "the trace does not show"
                                              : "no queries in the trace");
    o.max_abs_error = max_abs_;
    o.nmse = sum_sq_ref_ > 0 ? sum_sq_err_ / sum_sq_ref_ : 0.0;
    o.position_mismatches = keys_.failures + queries_.failures;
    o.retained_mismatches = retained_.failures;
    return std::move(result_);
  }

 private:
  static int first_row(const StepEvidence& e) {
    if (!e.pairs.empty()) return e.pairs.front().row;
    if (!e.slots.empty()) return e.slots.front().row;
    if (!e.outputs.empty()) return e.outputs.front().row;
    return 0;
  }

  // Which uid a value vector of kv head g belongs to: the row's own tokens first, then any
  // uid (stale). Each head is matched on its own: a cache may order slots per head.
  std::int64_t identify(int layer, int g, const double* value, const std::vector<std::uint64_t>& history) const {
    const int D = s_.dims.head_dim;
    auto matches = [&](std::uint64_t uid) {
      const float* raw = inputs_.v_at(layer, uid, g);
      for (int d = 0; d < D; ++d)
        if (std::abs(value[d] - raw[d]) > 1e-6) return false;
      return true;
    };
    for (std::uint64_t uid : history)
      if (matches(uid)) return static_cast<std::int64_t>(uid);
    for (std::int64_t uid = 0; uid < inputs_.uids; ++uid)
      if (matches(static_cast<std::uint64_t>(uid))) return uid;
    return -1;
  }

  // Checks layer l's files; the slots of kv head 0 go to `table`, one SlotRow each.
  void check_layer(const StepRecord& rec, int l, StepEvidence& evidence, std::vector<SlotRow>& table) {
    const TraceFiles& f = trace_.steps[evidence.step][static_cast<std::size_t>(l)];
    const auto B = rec.retained.size();
    const auto Hkv = static_cast<std::size_t>(s_.dims.kv_heads), H = static_cast<std::size_t>(s_.dims.heads),
               D = static_cast<std::size_t>(s_.dims.head_dim);
    const NpyArray<double> keys = load(f.keys, {B, Hkv, 0, D}, "keys [B, Hkv, slots, D]", true);
    const NpyArray<double> values = load(f.values, {B, Hkv, keys.shape[2], D}, "values [B, Hkv, slots, D]", false);
    const std::size_t slots = keys.shape[2];
    for (std::size_t b = 0; b < B; ++b) {
      const auto& history = rec.histories[b];
      const bool row_attended = rec.append && !rec.append->rows[b].empty();
      // What the row's last query should see, to fill the table's visibility columns.
      std::map<std::int64_t, std::int64_t> expected_distance;
      if (row_attended) {
        const auto& last = rec.append->rows[b].back();
        for (const auto& key : last.view.keys)
          expected_distance[static_cast<std::int64_t>(history[key.index])] = last.view.query_position - key.position;
      }
      std::map<std::int64_t, std::int64_t> want;  // uid -> token index
      for (const auto& key : rec.retained[b].keys) want[static_cast<std::int64_t>(key.uid)] = key.index;
      const std::size_t table_start = table.size();
      std::map<std::int64_t, std::int64_t> recovered;  // uid -> key position (kv head 0)
      for (std::size_t g = 0; g < Hkv; ++g) {
        std::vector<SlotRow>* rows = g == 0 ? &table : nullptr;
        const std::string where = fmt::format("{}: layer {} row {}{}", evidence.label, l, b,
                                              Hkv > 1 ? fmt::format(" kv head {}", g) : std::string());
        std::map<std::int64_t, std::int64_t> held;  // uid -> slot
        for (std::size_t slot = 0; slot < slots; ++slot) {
          const double* v = values.data.data() + ((b * Hkv + g) * slots + slot) * D;
          if (std::all_of(v, v + D, [](double x) { return x == 0.0 || std::isnan(x); })) continue;  // unused
          const std::int64_t uid = identify(l, static_cast<int>(g), v, history);
          const std::int64_t index = uid < 0 ? -1 : index_of(history, uid);
          SlotRow row;
          row.slot = static_cast<std::int64_t>(slot);
          row.uid = uid;
          row.index = index;
          if (index < 0) {
            retained_.fail(fmt::format(
                "{} slot {} holds {}", where, slot,
                uid < 0 ? std::string("values of no token") : fmt::format("uid {}, not this row's token", uid)));
            SlotIssue issue = SlotIssue::of(SlotIssue::Kind::stale, static_cast<int>(b), uid, -1);
            issue.slot = static_cast<std::int64_t>(slot);
            evidence.slots.push_back(issue);
            row.verdict = uid < 0 ? "unknown values" : "stale: not this row's token";
          } else if (held.count(uid)) {
            retained_.fail(fmt::format("{} holds uid {} twice", where, uid));
            evidence.slots.push_back(SlotIssue::of(SlotIssue::Kind::duplicated, static_cast<int>(b), uid, index));
            row.verdict = "duplicated";
          } else {
            held[uid] = static_cast<std::int64_t>(slot);
            if (want.count(uid)) {
              check_key(rec, l, b, g, slot, slots, keys, uid, index, evidence, row, recovered);
            } else {
              row.verdict = "should have been evicted";  // reported below, with the retained set
            }
          }
          push(rows, row, static_cast<int>(b));
        }
        for (const auto& [uid, slot] : held)
          if (!want.count(uid)) {
            const std::int64_t index = index_of(history, uid);
            retained_.fail(fmt::format("{} slot {} still holds uid {} (token {}), which the policy evicted", where,
                                       slot, uid, index));
            SlotIssue issue = SlotIssue::of(SlotIssue::Kind::extra, static_cast<int>(b), uid, index);
            issue.window_gap = window_start(s_.policy, rec.retained[b]) - index;
            evidence.slots.push_back(issue);
          }
        for (const auto& [uid, index] : want)
          if (!held.count(uid)) {
            retained_.fail(fmt::format("{} lost uid {} (token {})", where, uid, index));
            evidence.slots.push_back(SlotIssue::of(SlotIssue::Kind::lost, static_cast<int>(b), uid, index));
          }
      }
      std::optional<std::int64_t> query_position;
      if (rec.append) query_position = check_query_and_output(rec, l, b, f, H, D, recovered, evidence);
      for (std::size_t r = table_start; r < table.size(); ++r) {
        SlotRow& row = table[r];
        row.visible_actual = row_attended;  // a cache attends to every slot it returns
        if (const auto it = expected_distance.find(row.uid); it != expected_distance.end()) {
          row.visible_expected = true;
          row.distance_expected = it->second;
        }
        if (query_position && recovered.count(row.uid)) row.distance_actual = *query_position - recovered[row.uid];
        if (row.verdict == "ok" && row.visible_actual && !row.visible_expected)
          row.verdict = "held, should have been evicted";
        if (row.verdict == "ok" && row.distance_expected && row.distance_actual &&
            row.distance_expected != row.distance_actual)
          row.verdict = fmt::format("distance off by {}", *row.distance_actual - *row.distance_expected);
      }
    }
  }

  static void push(std::vector<SlotRow>* table, SlotRow row, int b) {
    if (table == nullptr) return;
    row.row = b;
    table->push_back(row);
  }

  // The key's position, recovered from the tensor, against what key_positions declares.
  // Kv head g's key in `slot`: rotated back by the position key_positions declares, it must
  // be the raw key; recovery from the tensor explains a failure (and feeds the distances).
  void check_key(const StepRecord& rec, int l, std::size_t b, std::size_t g, std::size_t slot, std::size_t slots,
                 const NpyArray<double>& keys, std::int64_t uid, std::int64_t index, StepEvidence& evidence,
                 SlotRow& row, std::map<std::int64_t, std::int64_t>& recovered) {
    const std::size_t Hkv = static_cast<std::size_t>(s_.dims.kv_heads), D = static_cast<std::size_t>(s_.dims.head_dim);
    std::int64_t expected = 0;
    for (const auto& key : rec.retained[b].keys)
      if (static_cast<std::int64_t>(key.uid) == uid) expected = key.position;
    row.position_expected = expected;
    const std::int64_t declared = trace_.positions == KeyPositions::cache_relative ? expected
                                  : trace_.positions == KeyPositions::absolute     ? index
                                                                                   : 0;
    row.position_claimed = declared;
    const double* stored = keys.data.data() + ((b * Hkv + g) * slots + slot) * D;
    const float* raw = inputs_.k_at(l, static_cast<std::uint64_t>(uid), static_cast<int>(g));
    const auto back =
        reference::rotate(std::vector<double>(stored, stored + D), -static_cast<double>(declared), s_.rope);
    double worst = 0.0;
    for (std::size_t d = 0; d < D; ++d) worst = std::max(worst, std::abs(back[d] - raw[d]));
    const std::vector<float> stored_f(stored, stored + D);
    const RecoveredPosition r = recover_position(raw, stored_f.data(), static_cast<int>(D), s_.rope, max_position_);
    if (g == 0) {
      row.position_recovered = describe(r);
      if (worst <= 1e-3)
        recovered[uid] = declared;
      else if (r.status != RecoveredPosition::Status::not_rotation)
        recovered[uid] = r.position;
    }
    if (worst <= 1e-3) {
      row.verdict = "ok";
      return;
    }
    keys_.fail(
        fmt::format("{}: layer {} row {} kv head {} slot {} (uid {}, token {}): key at position {}, "
                    "expected {}",
                    evidence.label, l, b, g, slot, uid, index, describe(r), declared));
    SlotIssue issue = SlotIssue::of(SlotIssue::Kind::rotation, static_cast<int>(b), uid, index);
    issue.slot = static_cast<std::int64_t>(slot);
    issue.claimed_index = index;
    issue.claimed_position = declared;
    issue.newest = index + 1 == static_cast<std::int64_t>(rec.histories[b].size());
    if (r.status != RecoveredPosition::Status::not_rotation) issue.recovered_position = r.position;
    issue.fits = r.fits;
    evidence.slots.push_back(issue);
    row.verdict = "key not at the expected position";
  }

  // The row's last query: its recovered position against the keys' recovered positions
  // gives the distances it used; then the outputs.
  // Returns the last query's recovered position, when the trace has queries.
  std::optional<std::int64_t> check_query_and_output(const StepRecord& rec, int l, std::size_t b, const TraceFiles& f,
                                                     std::size_t H, std::size_t D,
                                                     const std::map<std::int64_t, std::int64_t>& recovered,
                                                     StepEvidence& evidence) {
    const auto& tokens = rec.append->rows[b];
    const auto B = rec.retained.size();
    const auto n = static_cast<std::size_t>(rec.append->chunk);
    std::optional<std::int64_t> query_position;
    if (tokens.empty()) return query_position;
    const std::size_t pad = n - tokens.size();
    if (!f.q.empty() && s_.policy.prefill == Prefill::streaming) {
      const NpyArray<double> q = load(f.q, {B, H, n, D}, "q [B, H, n, D]", false);
      queries_seen_ = true;
      const auto& last = tokens.back();
      std::vector<float> rotated(D);
      for (std::size_t d = 0; d < D; ++d) rotated[d] = static_cast<float>(q.data[((b * H + 0) * n + n - 1) * D + d]);
      const RecoveredPosition r =
          recover_position(inputs_.q_at(l, last.uid, 0), rotated.data(), static_cast<int>(D), s_.rope, max_position_);
      if (r.status != RecoveredPosition::Status::not_rotation) query_position = r.position;
      // A cache that keeps keys at original positions rotates the query twice (sink_ring);
      // one rotated q shows only the window rotation, so sinks are judged by keys alone.
      const bool skip_sinks = s_.policy.kind == PolicyKind::sink && trace_.positions != KeyPositions::cache_relative;
      for (const auto& key : last.view.keys) {
        if (skip_sinks && key.index < s_.policy.sinks) continue;
        const auto uid = static_cast<std::int64_t>(rec.histories[b][key.index]);
        const auto it = recovered.find(uid);
        if (it == recovered.end() || r.status == RecoveredPosition::Status::not_rotation) continue;
        const std::int64_t want = last.view.query_position - key.position, got = r.position - it->second;
        if (want == got) continue;
        queries_.fail(
            fmt::format("{}: layer {} row {} token {}: query at {}, key uid {} at {}: distance {}, "
                        "expected {}",
                        evidence.label, l, b, last.index, r.position, uid, it->second, got, want));
        if (l == 0)
          evidence.pairs.push_back({static_cast<int>(b), last.index, uid, key.index, want, got, r.position,
                                    reference::evicted_count(s_.policy, last.index)});
      }
    }
    if (!f.out.empty()) {
      const NpyArray<double> out = load(f.out, {B, H, n, D}, "out [B, H, n, D]", false);
      outputs_seen_ = true;
      for (std::size_t i = 0; i < tokens.size(); ++i)
        for (std::size_t h = 0; h < H; ++h)
          for (std::size_t d = 0; d < D; ++d) {
            const double want =
                rec.append->out[((((static_cast<std::size_t>(l) * B + b) * n + pad + i) * H + h) * D) + d];
            const double got = out.data[((b * H + h) * n + pad + i) * D + d];
            const double err = std::abs(got - want);
            max_abs_ = std::max(max_abs_, std::isnan(err) ? INFINITY : err);
            sum_sq_err_ += std::isnan(err) ? 0 : err * err;
            sum_sq_ref_ += want * want;
            if (err <= s_.tolerance.atol + s_.tolerance.rtol * std::abs(want)) continue;
            outputs_.fail(fmt::format("{}: layer {} row {} token {} head {} dim {}: expected {:.9g}, got {:.9g}",
                                      evidence.label, l, b, tokens[i].index, h, d, want, got));
            if (evidence.outputs.size() < 64)
              evidence.outputs.push_back({l, static_cast<int>(b), static_cast<int>(h), static_cast<int>(d),
                                          tokens[i].index, static_cast<std::int64_t>(tokens[i].uid), want, got});
          }
    }
    return query_position;
  }

  const Scenario& s_;
  const InputTable& inputs_;
  const ReferenceRun& run_;
  const Trace& trace_;
  const std::int64_t max_position_;  // bounds position recovery
  CacheTrace result_;
  Tally outputs_, retained_, keys_, queries_;
  bool outputs_seen_ = false, queries_seen_ = false;
  double max_abs_ = 0.0, sum_sq_err_ = 0.0, sum_sq_ref_ = 0.0;
};

}  // namespace

CacheTrace verify_trace(const Scenario& s, const std::string& dir) {
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const Trace trace = read_manifest(s, dir, run.steps.size());
  return Verifier(s, inputs, run, trace)();
}

}  // namespace kvcheck
