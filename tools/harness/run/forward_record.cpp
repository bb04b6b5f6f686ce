#include "tools/harness/run/forward_record.h"

#include <algorithm>
#include <span>

namespace kvcheck {

StepRecord forward_record(const Scenario& s, const StepRecord& whole, const std::vector<std::int64_t>& begin,
                          const std::vector<std::int64_t>& end, std::int64_t forward) {
  StepRecord r;
  r.step = whole.step;
  r.forward = forward;
  r.batch_before = whole.batch_before;
  r.preempted = whole.preempted;
  r.largest_hit = whole.largest_hit;
  r.largest_hit_same_step = whole.largest_hit_same_step;
  r.after_append = whole.histories;

  const reference::AppendResult& all = *whole.append;
  const std::size_t B = all.rows.size();
  reference::AppendResult part;
  part.rows.resize(B);
  std::vector<std::size_t> skipped(B, 0);  // the row's tokens of the append before this forward's
  for (std::size_t b = 0; b < B; ++b)
    for (const reference::AppendedToken& token : all.rows[b]) {
      if (token.index < begin[b]) ++skipped[b];
      if (token.index >= begin[b] && token.index < end[b]) part.rows[b].push_back(token);
    }
  for (const auto& row : part.rows) part.chunk = std::max(part.chunk, static_cast<std::int64_t>(row.size()));
  const auto H = static_cast<std::size_t>(s.dims.heads), D = static_cast<std::size_t>(s.dims.head_dim);
  const auto L = static_cast<std::size_t>(s.dims.layers);
  part.out = cut_tokens<double>(all.out, all, part, skipped, L, H * D);
  part.out_stored = cut_tokens<double>(all.out_stored, all, part, skipped, L, H * D);
  part.query_slack = cut_tokens<double>(all.query_slack, all, part, skipped, L, H);
  r.append = std::move(part);

  // Each row as it stands at end[b]: it keeps what its token end[b] - 1 saw, and its token
  // end[b] will see the live set. Under dense prefill those are the dense forward's views
  // (the window of the append's first token), not the streaming rule's.
  auto kept = [&](int l, std::size_t b, const RowHistory& history) {
    const auto& tokens = all.rows[b];
    const std::int64_t first = tokens.front().index;
    if (end[b] <= first)  // nothing of the append computed: the streaming rule at that length
      return reference::retained_of(s.policy(l), std::span<const std::uint64_t>(history.begin(), history.size()));
    const reference::QueryView& last = tokens[static_cast<std::size_t>(end[b] - 1 - first)].view_in(l);
    const reference::QueryView& next = tokens[static_cast<std::size_t>(end[b] - first)].view_in(l);
    const RowHistory& after = whole.histories[b];
    reference::RowRetained out;
    out.query_position = last.query_position;
    for (const reference::VisibleKey& key : last.keys) out.keys.push_back({after[static_cast<std::size_t>(key.index)], key.index, key.position});
    out.next_query_position = next.query_position;
    for (const reference::VisibleKey& key : next.keys)  // the kept ones: not token end[b] itself
      if (key.index < end[b]) out.live.push_back({after[static_cast<std::size_t>(key.index)], key.index, key.position});
    return out;
  };
  std::vector<bool> row_cut(whole.histories.size(), false);
  for (std::size_t b = 0; b < whole.histories.size(); ++b) {
    // Rows that take no token, or whose forwards are all done, are as after the append.
    const bool cut_here = b < B && !all.rows[b].empty() && end[b] < all.rows[b].back().index + 1;
    row_cut[b] = cut_here;
    r.histories.push_back(cut_here ? whole.histories[b].prefix(static_cast<std::size_t>(end[b])) : whole.histories[b]);
  }
  // Layers that share the whole append's rows share the forward's too.
  for (std::size_t l = 0; l < whole.retained.size(); ++l) {
    const auto first = whole.retained.begin();
    const auto same = std::find(first, first + static_cast<std::ptrdiff_t>(l), whole.retained[l]);
    if (same != first + static_cast<std::ptrdiff_t>(l)) {
      r.retained.push_back(r.retained[static_cast<std::size_t>(same - first)]);
      continue;
    }
    auto rows = std::make_shared<std::vector<reference::RowRetained>>();
    for (std::size_t b = 0; b < whole.histories.size(); ++b)
      rows->push_back(row_cut[b] ? kept(static_cast<int>(l), b, r.histories[b])
                                 : whole.retained_in(static_cast<int>(l), static_cast<int>(b)));
    r.retained.push_back(std::move(rows));
  }

  // A stored key does not change between two forwards (no shift or flush moves it inside
  // an append of a paged cache): the reference kept every key a forward's state may hold.
  if (!whole.stored_window.empty()) {
    r.stored.resize(whole.stored_window.size());
    for (std::size_t l = 0; l < whole.stored_window.size(); ++l)
      for (std::size_t b = 0; b < whole.histories.size(); ++b) {
        if (!row_cut[b]) {
          r.stored[l].push_back(whole.stored[l][b]);
          continue;
        }
        auto& keys = r.stored[l].emplace_back();
        const std::int64_t from = whole.stored_from[l][b];
        for (const reference::RetainedKey& key : r.retained_in(static_cast<int>(l), static_cast<int>(b)).keys)
          keys.push_back(whole.stored_window[l][b].at(static_cast<std::size_t>(key.index - from)));
      }
  }
  return r;
}

}  // namespace kvcheck
