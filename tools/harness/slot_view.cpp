#include "tools/harness/slot_view.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "tools/harness/cache_checks.h"
#include "tools/harness/recovery.h"

namespace kvcheck {

using optimized::SlotMeta;

namespace {

// The reference's view of the query (or, without one, the retained set).
reference::QueryView expected_view(const StepRecord& rec, int row, std::int64_t query_index) {
  if (rec.append)
    for (const auto& token : rec.append->rows[row])
      if (token.index == query_index) return token.view;
  reference::QueryView view;
  view.query_position = rec.retained[row].query_position;
  for (const auto& key : rec.retained[row].keys) view.keys.push_back({key.index, key.position});
  return view;
}

}  // namespace

std::vector<SlotRow> slot_table(const Scenario& s, const InputTable& inputs, std::int64_t max_position,
                                const optimized::SlotStore& store, const optimized::AttentionLog& log,
                                const StepRecord& rec, int row, std::int64_t query_index, int layer) {
  const auto& history = rec.histories[row];
  const reference::QueryView view = expected_view(rec, row, query_index);
  std::map<std::int64_t, reference::VisibleKey> expected;  // uid -> key
  for (const auto& key : view.keys) expected[static_cast<std::int64_t>(history[key.index])] = key;
  std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> actual;
  for (const auto& e : log)
    if (e.row == row && e.query_index == query_index)
      actual[e.key_uid] = {e.query_position - e.key_position, e.query_position};
  std::map<std::int64_t, int> seen;
  std::vector<SlotRow> rows;
  for (std::int64_t slot = 0; slot < store.capacity(); ++slot) {
    const SlotMeta& m = store.meta(row, slot);
    if (m.uid < 0) continue;
    SlotRow r;
    r.slot = slot;
    r.uid = m.uid;
    r.index = index_of(history, m.uid);
    r.position_claimed = m.position;
    if (m.uid < inputs.uids)
      r.position_recovered =
          describe(recover_position(inputs.k_at(layer, static_cast<std::uint64_t>(m.uid), 0), store.key(layer, row, 0, slot),
                                    s.dims.head_dim, s.rope, max_position));
    if (const auto it = expected.find(m.uid); it != expected.end()) {
      r.visible_expected = true;
      r.distance_expected = view.query_position - it->second.position;
      r.position_expected = it->second.position;
    }
    if (const auto it = actual.find(m.uid); it != actual.end()) {
      r.visible_actual = true;
      r.distance_actual = it->second.first;
    }
    const bool in_retained = std::any_of(rec.retained[row].keys.begin(), rec.retained[row].keys.end(),
                                         [&](const auto& k) { return static_cast<std::int64_t>(k.uid) == m.uid; });
    if (r.index < 0)
      r.verdict = "stale: not this row's token";
    else if (++seen[m.uid] > 1)
      r.verdict = "duplicated";
    else if (m.index != r.index)
      r.verdict = fmt::format("claims token {}", m.index);
    else if (r.visible_expected != r.visible_actual)
      r.verdict = r.visible_actual ? "visible, should not be" : "not used, should be visible";
    else if (r.distance_expected != r.distance_actual)
      r.verdict = fmt::format("distance off by {}", *r.distance_actual - *r.distance_expected);
    else if (r.position_recovered != std::to_string(m.position) && r.position_recovered.back() != '?')
      r.verdict = "key not at its claimed position";
    else if (!in_retained)
      r.verdict = "should have been evicted";
    else
      r.verdict = "ok";
    rows.push_back(r);
  }
  for (const auto& key : rec.retained[row].keys)
    if (!std::any_of(rows.begin(), rows.end(),
                     [&](const SlotRow& r) { return r.uid == static_cast<std::int64_t>(key.uid); })) {
      SlotRow r;
      r.uid = static_cast<std::int64_t>(key.uid);
      r.index = key.index;
      if (const auto it = expected.find(r.uid); it != expected.end()) {
        r.visible_expected = true;
        r.distance_expected = view.query_position - it->second.position;
        r.position_expected = it->second.position;
      }
      r.verdict = "missing: the cache dropped it";
      rows.push_back(r);
    }
  return rows;
}

std::vector<PictureCell> picture_column(const optimized::SlotStore& store, const optimized::AttentionLog& log,
                                        const StepRecord& rec, int row) {
  std::vector<PictureCell> column;
  if (row >= store.batch() || row >= static_cast<int>(rec.histories.size())) return column;
  std::map<std::int64_t, std::int64_t> want, got;
  if (rec.append && !rec.append->rows[row].empty()) {
    const auto& last = rec.append->rows[row].back();
    for (const auto& key : last.view.keys)
      want[static_cast<std::int64_t>(rec.histories[row][key.index])] = last.view.query_position - key.position;
    for (const auto& e : log)
      if (e.row == row && e.query_index == last.index) got[e.key_uid] = e.query_position - e.key_position;
  }
  std::map<std::int64_t, int> seen;
  for (std::int64_t slot = 0; slot < store.capacity(); ++slot) {
    const SlotMeta& m = store.meta(row, slot);
    PictureCell cell;
    cell.uid = m.uid;
    if (m.uid < 0) {
      column.push_back(cell);
      continue;
    }
    const bool retained = std::any_of(rec.retained[row].keys.begin(), rec.retained[row].keys.end(),
                                      [&](const auto& k) { return static_cast<std::int64_t>(k.uid) == m.uid; });
    if (++seen[m.uid] > 1)
      cell.state = PictureCell::State::duplicated;
    else if (!retained)
      cell.state = PictureCell::State::not_retained;
    else if (want.count(m.uid) && got.count(m.uid) && want[m.uid] != got[m.uid]) {
      cell.state = PictureCell::State::wrong_position;
      cell.error = got[m.uid] - want[m.uid];
    } else
      cell.state = PictureCell::State::ok;
    column.push_back(cell);
  }
  return column;
}

}  // namespace kvcheck
