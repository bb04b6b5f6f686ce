#include "tools/harness/check/paged_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <set>

#include "tools/harness/scenario/content_keys.h"
#include "tools/harness/check/step_checker.h"

namespace kvcheck {

namespace {

using K = PagedIssue::Kind;

// How many table entries reference each block.
std::map<std::int64_t, int> references(const PagedView::Layer& layer) {
  std::map<std::int64_t, int> refs;
  for (const auto& table : layer.tables)
    for (std::int64_t block : table)
      if (block >= 0) ++refs[block];
  return refs;
}

// Each block's filled slots as the view shows them: (offset, context key of its token), by
// offset (a trace names a shared slot by each row's own uid: their context keys agree).
std::map<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>> contents(const Scenario& s,
                                                                                    const ViewLayer& layer,
                                                                                    std::int64_t block_size) {
  const auto uids = static_cast<std::int64_t>(s.token_ids.empty() ? std::numeric_limits<std::int64_t>::max()
                                                                   : static_cast<std::int64_t>(s.token_ids.size()));
  std::map<std::int64_t, std::map<std::int64_t, std::int64_t>> seen;
  for (const auto& row : layer.slots)
    if (!row.empty())
      for (const ViewSlot& v : row[0])
        seen[v.slot / block_size][v.slot % block_size] =
            v.uid < 0 || v.uid >= uids ? -1
                                       : static_cast<std::int64_t>(context_key(s, static_cast<std::uint64_t>(v.uid)));
  std::map<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>> out;
  for (const auto& [block, slots] : seen) out[block].assign(slots.begin(), slots.end());
  return out;
}

}  // namespace

void PagedChecks::fail(StepEvidence& evidence, PagedIssue issue) {
  ++tally_.failures;
  const std::string text = fmt::format(
      "{}: layer {}{}{}{}: {}", evidence.label, issue.layer,
      issue.row >= 0 ? fmt::format(" row {}", issue.row) : std::string(),
      issue.logical >= 0 ? fmt::format(" table entry {}", issue.logical) : std::string(),
      issue.block < 0        ? std::string()
      : issue.logical >= 0 ? fmt::format(" (block {})", issue.block)
                           : fmt::format(" block {}", issue.block),
      issue.detail);
  if (tally_.first.empty()) tally_.first = text;
  if (evidence.paged.size() < 64) evidence.paged.push_back(std::move(issue));
}

void PagedChecks::check(const StepRecord& rec, CacheView& view, StepEvidence& evidence) {
  if (!view.paged) return;
  if (rec.forward == 0) ++steps_checked_;
  const auto L = view.paged->layers.size();
  shared_.resize(L);
  view.uncomputed.assign(rec.rows(), 0);
  // An append's hits are known before its first forward: checked there when its forwards are
  // checked (SPEC 8.7), else on the whole step. The hit tokens open the first forward's record.
  if (rec.append && rec.forward <= 1) {
    if (rec.forward == 1 || !hits_checked_) check_hits(rec, view, evidence);
    hits_checked_ = rec.forward == 1;
  }
  if (rec.append && rec.forward <= 1)
    for (std::size_t b = 0; b < view.uncomputed.size() && b < view.paged->hit_tokens.size(); ++b)
      view.uncomputed[b] = view.paged->hit_tokens[b];
  // The kernel's log names keys by the uid in their slot: a key another row wrote (a shared
  // or hit block, freed or not since) is the row's own token when the context keys agree.
  if (view.pairs) {
    const auto uid_count = static_cast<std::uint64_t>(s_.token_ids.empty() ? ~0ull : s_.token_ids.size());
    for (UsedPair& p : *view.pairs) {
      if (p.row < 0 || static_cast<std::size_t>(p.row) >= rec.histories.size() || p.key_uid < 0 ||
          static_cast<std::uint64_t>(p.key_uid) >= uid_count)
        continue;
      const RowHistory& history = rec.histories[static_cast<std::size_t>(p.row)];
      if (p.key_index < 0 || static_cast<std::size_t>(p.key_index) >= history.size()) continue;
      const std::uint64_t own = history[static_cast<std::size_t>(p.key_index)];
      if (static_cast<std::uint64_t>(p.key_uid) != own &&
          context_key(s_, static_cast<std::uint64_t>(p.key_uid)) == context_key(s_, own))
        p.key_uid = static_cast<std::int64_t>(own);
    }
  }
  for (std::size_t l = 0; l < L; ++l) {
    check_slot_mapping(rec, view, static_cast<int>(l), evidence);  // the cause of what follows, when wrong
    check_refcounts(view, static_cast<int>(l), evidence);
    check_isolation(view, static_cast<int>(l), evidence);
    check_layer(rec, view, static_cast<int>(l), evidence);
  }
}

// 8.8.1 from the writer's side: the slot a step wrote each computed token to (a trace's
// slot_mapping) is table[t / B] * B + t % B, the slot the table says the readers look in.
// vLLM computes both from the token index; a mapping from the rotary position, or one
// computed before a copy-on-write replaced the block, writes where no query reads.
void PagedChecks::check_slot_mapping(const StepRecord& rec, const CacheView& view, int l, StepEvidence& evidence) {
  const PagedView::Layer& layer = view.paged->layers[static_cast<std::size_t>(l)];
  if (layer.slot_mapping.empty()) return;
  const std::int64_t B = view.paged->block_size;
  const auto uid_count = static_cast<std::uint64_t>(s_.token_ids.empty() ? ~0ull : s_.token_ids.size());
  // Whether row b's slot holds its token t now (kv head 0; by context key, as check_layer).
  const auto& slots = view.layers[static_cast<std::size_t>(l)].slots;
  const auto holds_token = [&](std::size_t b, std::int64_t slot, std::int64_t t) {
    if (b >= slots.size() || slots[b].empty()) return false;
    for (const ViewSlot& v : slots[b][0])
      if (v.slot == slot)
        return v.uid >= 0 && static_cast<std::uint64_t>(v.uid) < uid_count &&
               context_key(s_, static_cast<std::uint64_t>(v.uid)) ==
                   context_key(s_, rec.histories[b][static_cast<std::size_t>(t)]);
    return false;
  };
  std::map<std::int64_t, int> written;  // how often the step wrote each slot, every row
  for (const auto& row_slots : layer.slot_mapping)
    for (std::int64_t slot : row_slots) ++written[slot];
  for (std::size_t b = 0; b < layer.slot_mapping.size() && b < rec.histories.size(); ++b) {
    const auto& mapping = layer.slot_mapping[b];
    const auto n = static_cast<std::int64_t>(rec.histories[b].size());
    const auto added = rec.append && b < rec.append->rows.size() ? static_cast<std::int64_t>(rec.append->rows[b].size())
                                                                 : std::int64_t{0};
    const std::int64_t hit = b < view.uncomputed.size() ? view.uncomputed[b] : 0;
    const std::int64_t first = n - added + std::min(hit, added), computed = n - first;
    const int row = static_cast<int>(b);
    if (static_cast<std::int64_t>(mapping.size()) != computed) {
      fail(evidence, {K::mapping_table, l, row, -1, -1, -1,
                      computed == 0 ? fmt::format("the slot mapping gives {} slots, but the row computed no token in "
                                                  "this step",
                                                  mapping.size())
                                    : fmt::format("the slot mapping gives {} slots for the {} tokens the row computed "
                                                  "in this step (tokens {} to {}, after a hit of {})",
                                                  mapping.size(), computed, first, n - 1, hit)});
      continue;
    }
    const auto& table = layer.tables[b];
    int reported = 0;
    for (std::int64_t j = 0; j < computed && reported < 4; ++j) {
      const std::int64_t t = first + j, place = layer.place(t), i = place / B;
      const std::int64_t block = i < static_cast<std::int64_t>(table.size()) ? table[static_cast<std::size_t>(i)] : -1;
      // A block the step freed behind a sliding window says nothing about where it wrote.
      if (block < 0) continue;
      const std::int64_t want = block * B + place % B, got = mapping[static_cast<std::size_t>(j)];
      if (got == want) continue;
      // SPEC 8.9: a ring need not store a token that a later one of the same forward overwrites.
      if (layer.ring > 0 && got < 0 && t + layer.ring < n) continue;
      // SPEC 8.4: after a forward a cache may trade a full block it wrote for an equal one it
      // holds (transformers' mark_complete_blocks), releasing its own, which a later forward of
      // the step may hand out again (to any row, whose write then replaces the slot's token):
      // the write was at the token's offset, into a block the row no longer holds or a slot
      // the step wrote again; check_layer holds every table block to its row's tokens.
      if (layer.ring == 0 && got >= 0 && got % B == t % B && (i + 1) * B <= n &&
          (std::find(table.begin(), table.end(), got / B) == table.end() || written.at(got) > 1)) {
        // ... and the block was written as one (every token of it this step computed went to
        // the same block, each at its offset: one token sent astray is no trade), and the
        // table's block holds the token now (a write to a block that is not the table's, whose
        // tokens never reach the table's, is no trade either).
        bool whole = true;
        for (std::int64_t u = std::max(first, i * B); u < std::min(n, (i + 1) * B) && whole; ++u)
          whole = mapping[static_cast<std::size_t>(u - first)] == got / B * B + u % B;
        if (whole && holds_token(b, want, t)) continue;
      }
      ++reported;
      fail(evidence, {K::mapping_table, l, row, i, block, got,
                      fmt::format("token {} was written to slot {}, but its table entry says slot {} = {} "
                                              "* {} + {}{}",
                                              t, got, want, block, B, place % B,
                                              got / B == block
                                                  ? std::string(": the right block, the wrong offset")
                                                  : fmt::format(": block {}, offset {}", got / B, got % B))});
    }
  }
}

// 8.8.7: a hit is whole blocks (any tokens, under reuse "token"), below the prompt's last
// token, no larger than the largest legitimate hit, and the scenario's expect_hit when it
// gives one.
void PagedChecks::check_hits(const StepRecord& rec, const CacheView& view, StepEvidence& evidence) {
  const PagedView& pv = *view.paged;
  if (pv.hit_tokens.empty()) return;
  const std::int64_t B = pv.block_size;
  for (std::size_t b = 0; b < rec.append->rows.size() && b < pv.hit_tokens.size(); ++b) {
    const std::int64_t hit = std::max<std::int64_t>(0, pv.hit_tokens[b]);  // traces are refused below 0
    // The whole append's tokens, also in a forward's record (whose rows hold the forward's).
    const auto first = static_cast<std::int64_t>(rec.histories[b].size() - rec.append->rows[b].size());
    const auto added = b < rec.after_append.size() ? static_cast<std::int64_t>(rec.after_append[b].size()) - first
                                                    : static_cast<std::int64_t>(rec.append->rows[b].size());
    const bool started = added > 0 && first == 0;
    const std::int64_t legit = b < rec.largest_hit.size() ? rec.largest_hit[b] : 0;
    const std::int64_t same_step = b < rec.largest_hit_same_step.size() ? rec.largest_hit_same_step[b] : 0;
    PagedIssue issue{K::hit_unaligned, 0, static_cast<int>(b), -1, -1, -1, ""};
    hits_seen_ += hit;
    if (hit == 0) {
    } else if (!started) {
      issue.detail = fmt::format("reports a prefix hit of {} tokens, but the row did not start in this step", hit);
      fail(evidence, issue);
    } else if (s_.paging && s_.paging->token_reuse ? hit > added - 1 : hit % B != 0 || hit > (added - 1) / B * B) {
      issue.detail =
          s_.paging && s_.paging->token_reuse
              ? fmt::format("a prefix hit of {} tokens: hits stop before the prompt's last token (at most {} of these "
                            "{})",
                            hit, added - 1, added)
              : fmt::format("a prefix hit of {} tokens: hits are whole blocks of {} below the prompt's last token (at "
                            "most {} of these {})",
                            hit, B, (added - 1) / B * B, added);
      fail(evidence, issue);
    } else if (hit > legit) {
      issue.kind = hit <= same_step ? K::unwritten_hit : K::hit_stale;
      issue.detail =
          hit <= same_step
              ? fmt::format("a prefix hit of {} tokens where {} are legitimate: the rest are blocks another row "
                            "writes in this same step, hit before their write",
                            hit, legit)
              : fmt::format("a prefix hit of {} tokens where at most {} are legitimate (no earlier block holds "
                            "these context keys)",
                            hit, legit);
      fail(evidence, issue);
    }
    const auto& expect = rec.step.expect_hit;
    if (b < expect.size() && expect[b] && (hit < expect[b]->min || hit > expect[b]->max)) {
      issue.kind = K::hit_expected;
      issue.detail = expect[b]->min == expect[b]->max
                         ? fmt::format("a prefix hit of {} tokens; the scenario expects {}", hit, expect[b]->min)
                         : fmt::format("a prefix hit of {} tokens; the scenario expects {} to {}", hit, expect[b]->min,
                                       expect[b]->max);
      fail(evidence, issue);
    }
  }
}

// 8.8.3: refcounts are the references in the tables (kvcheck's caches declare no pins).
void PagedChecks::check_refcounts(const CacheView& view, int l, StepEvidence& evidence) {
  const PagedView::Layer& layer = view.paged->layers[static_cast<std::size_t>(l)];
  if (layer.refcounts.empty()) return;
  const auto refs = references(layer);
  int reported = 0;
  for (std::size_t block = 0; block < layer.refcounts.size() && reported < 4; ++block) {
    const auto it = refs.find(static_cast<std::int64_t>(block));
    const int want = it == refs.end() ? 0 : it->second;
    if (layer.refcounts[block] == want) continue;
    ++reported;
    fail(evidence, {K::refcount, l, -1, -1, static_cast<std::int64_t>(block), -1,
                    fmt::format("refcount {}, but {} table entr{} reference it{}", layer.refcounts[block], want,
                                want == 1 ? "y" : "ies",
                                layer.refcounts[block] == 0 ? " (in use after its free)" : "")});
  }
}

// 8.8.4: a block that was shared when the last step ended holds what it held, while it is
// still referenced: a write into it had to copy it first.
void PagedChecks::check_isolation(const CacheView& view, int l, StepEvidence& evidence) {
  const PagedView::Layer& layer = view.paged->layers[static_cast<std::size_t>(l)];
  const auto refs = references(layer);
  const auto now = contents(s_, view.layers[static_cast<std::size_t>(l)], view.paged->block_size);
  auto& shared = shared_[static_cast<std::size_t>(l)];
  for (const auto& [block, before] : shared) {
    // Released since, or left to one row (the others copied it away): it may be written.
    if (!refs.count(block) || refs.at(block) < 2) continue;
    const auto it = now.find(block);
    const auto& after = it == now.end() ? decltype(before){} : it->second;
    if (after == before) continue;
    std::int64_t offset = -1;
    for (std::size_t i = 0; i < std::max(before.size(), after.size()); ++i)
      if (i >= before.size() || i >= after.size() || before[i] != after[i]) {
        offset = i < after.size() ? after[i].first : before[i].first;
        break;
      }
    fail(evidence, {K::shared_write, l, -1, -1, block, block * view.paged->block_size + offset,
                    fmt::format("was shared by several rows and was written at offset {} without a copy", offset)});
  }
  shared.clear();
  for (const auto& [block, count] : refs)
    if (count > 1) {
      const auto it = now.find(block);
      shared[block] = it == now.end() ? std::vector<std::pair<std::int64_t, std::int64_t>>{} : it->second;
    }
}

// 8.8.1, 8.8.2 and the content of hit blocks: entry i of a row's table holds the row's
// tokens iB .. iB + B - 1 at offsets t % B, by context key; null entries only where the row
// has no live token. Slots of a block shared with another row become the row's own uids.
void PagedChecks::check_layer(const StepRecord& rec, CacheView& view, int l, StepEvidence& evidence) {
  const PagedView& pv = *view.paged;
  const PagedView::Layer& layer = pv.layers[static_cast<std::size_t>(l)];
  ViewLayer& slots = view.layers[static_cast<std::size_t>(l)];
  const std::int64_t B = pv.block_size;
  const auto refs = references(layer);
  const auto uid_count = static_cast<std::uint64_t>(s_.token_ids.empty() ? ~0ull : s_.token_ids.size());
  for (std::size_t b = 0; b < layer.tables.size() && b < rec.histories.size(); ++b) {
    if (rec.is_preempted(static_cast<int>(b))) continue;  // its blocks are out (swap) or freed (recompute)
    if (layer.ring > 0) {
      check_ring(rec, view, l, b, evidence);
      continue;
    }
    const auto& table = layer.tables[b];
    const RowHistory& history = rec.histories[b];
    const auto n = static_cast<std::int64_t>(history.size());
    // Between two forwards, blocks may be there for the append's later tokens already.
    const auto mapped = b < rec.after_append.size() ? static_cast<std::int64_t>(rec.after_append[b].size()) : n;
    const reference::RowRetained& sets = rec.retained_in(l, static_cast<int>(b));
    std::set<std::int64_t> live, retained;
    for (const auto& key : sets.live) live.insert(key.index);
    for (const auto& key : sets.keys) retained.insert(key.index);
    // Tokens the hit filled (under reuse "token" it may end inside a block, copied, then written on).
    const std::int64_t hit_end = rec.append && b < view.uncomputed.size() ? view.uncomputed[b] : 0;
    // The row's slots by (block, offset), every kv head.
    std::map<std::int64_t, std::vector<ViewSlot*>> at;
    for (auto& head : slots.slots[b])
      for (ViewSlot& v : head) at[v.slot].push_back(&v);
    const int row = static_cast<int>(b);
    for (std::size_t i = 0; i < table.size(); ++i) {
      const std::int64_t block = table[i], logical = static_cast<std::int64_t>(i);
      if (block < 0) continue;
      if (logical * B >= mapped) {
        fail(evidence, {K::stale_entry, l, row, logical, block, -1,
                        fmt::format("points at a block, but the row has only {} tokens (entries from {} on must "
                                    "be null)",
                                    n, (n + B - 1) / B)});
        continue;
      }
      const bool shared = refs.count(block) && refs.at(block) > 1;
      for (std::int64_t o = 0; o < B; ++o) {
        const std::int64_t t = logical * B + o, slot = block * B + o;
        const auto found = at.find(slot);
        const ViewSlot* v = found == at.end() ? nullptr : found->second[0];
        if (t >= n) {
          if (v)
            fail(evidence, {shared ? K::shared_write : K::stale_entry, l, row, logical, block, slot,
                            fmt::format("slot {} holds uid {} (token {}) past the row's end ({} tokens){}", slot,
                                        v->uid, v->claimed_index.value_or(-1), n,
                                        shared ? ", in a block another row references" : "")});
          continue;
        }
        if (!v) {
          if (t < hit_end)
            fail(evidence, {K::unwritten_hit, l, row, logical, block, slot,
                            fmt::format("the row's hit took this block, but its slot {} (token {}) was never "
                                        "written",
                                        slot, t)});
          else if (live.count(t))
            fail(evidence, {K::slot_mapping, l, row, logical, block, slot,
                            fmt::format("token {} should be in slot {} = {} * {} + {}, which is empty", t, slot,
                                        block, B, o)});
          continue;
        }
        // The token index the slot says (in-process) or its uid's place in the row (traces).
        const std::int64_t index = v->claimed_index ? *v->claimed_index : index_of(history, v->uid);
        if (index >= 0 && index != t) {
          fail(evidence, {K::slot_mapping, l, row, logical, block, slot,
                          fmt::format("slot {} = {} * {} + {} holds token {}, where token {} belongs", slot, block,
                                      B, o, index, t)});
          continue;
        }
        const std::uint64_t own = history[static_cast<std::size_t>(t)];
        if (v->uid < 0 || static_cast<std::uint64_t>(v->uid) >= uid_count) {
          fail(evidence, {K::stale_entry, l, row, logical, block, slot,
                          fmt::format("slot {} holds values of no token (uid {})", slot, v->uid)});
          continue;
        }
        const auto theirs = static_cast<std::uint64_t>(v->uid);
        if (context_key(s_, theirs) != context_key(s_, own)) {
          const bool same_ids = token_id(s_, theirs) == token_id(s_, own);
          const K kind = t < hit_end ? (same_ids ? K::hit_across : K::hit_stale)
                         : shared              ? K::shared_write
                                               : K::stale_entry;
          fail(evidence, {kind, l, row, logical, block, slot,
                          fmt::format("slot {} holds uid {} (token {}), whose context key is not the row's token "
                                      "{} (uid {}){}",
                                      slot, theirs, t, t, own,
                                      kind == K::hit_across  ? ": the same ids under another context (adapter, salt "
                                                               "or earlier token)"
                                      : kind == K::hit_stale ? ": the hit block holds another prompt's tokens"
                                      : kind == K::shared_write ? ": another row wrote into a block both reference"
                                                                : "")});
          continue;
        }
        if (theirs == own) continue;
        // Value identity by context key: the token is the row's own.
        for (ViewSlot* x : found->second) x->uid = static_cast<std::int64_t>(own);
      }
    }
    // 8.8.2: no null entry where the row has a live token.
    std::set<std::int64_t> reported;
    for (std::int64_t t : live) {
      const std::int64_t i = t / B;
      const bool null = i >= static_cast<std::int64_t>(table.size()) || table[static_cast<std::size_t>(i)] < 0;
      if (null && reported.insert(i).second)
        fail(evidence, {K::freed_visible, l, row, i, -1, -1,
                        fmt::format("is null, but token {} in it is in the window of the row's next query", t)});
    }
    // 8.5: blocks are freed whole, so a block with a live (or retained) token may hold dead
    // ones too; the retained-set check sees only what the policy keeps.
    std::set<std::int64_t> kept_blocks;
    for (std::int64_t t : live) kept_blocks.insert(t / B);
    for (std::int64_t t : retained) kept_blocks.insert(t / B);
    for (auto& head : slots.slots[b])
      std::erase_if(head, [&](const ViewSlot& v) {
        const std::int64_t index = v.claimed_index ? *v.claimed_index : index_of(history, v.uid);
        return index >= 0 && !retained.count(index) && kept_blocks.count(index / B);
      });
  }
}

// 8.9's ring of R places: place p holds the newest of the row's tokens at it (t % R == p),
// in slot table[p / B] * B + p % B. A retained token must sit there; a token no query needs
// again may stay where nothing newer was stored (a chunk's tokens a later token of the same
// chunk overwrote need not be stored). Entries cover the places written so far, and pages
// are held until the row ends (no entry goes null behind the window).
void PagedChecks::check_ring(const StepRecord& rec, CacheView& view, int l, std::size_t b, StepEvidence& evidence) {
  const PagedView::Layer& layer = view.paged->layers[static_cast<std::size_t>(l)];
  ViewLayer& slots = view.layers[static_cast<std::size_t>(l)];
  const std::int64_t B = view.paged->block_size, R = layer.ring;
  const auto refs = references(layer);
  const auto uid_count = static_cast<std::uint64_t>(s_.token_ids.empty() ? ~0ull : s_.token_ids.size());
  const auto& table = layer.tables[b];
  const RowHistory& history = rec.histories[b];
  const auto n = static_cast<std::int64_t>(history.size());
  const std::int64_t places = std::min(n, R);
  const reference::RowRetained& sets = rec.retained_in(l, static_cast<int>(b));
  std::set<std::int64_t> needed;  // retained or live: must be in their places
  for (const auto& key : sets.live) needed.insert(key.index);
  for (const auto& key : sets.keys) needed.insert(key.index);
  std::map<std::int64_t, std::vector<ViewSlot*>> at;
  for (auto& head : slots.slots[b])
    for (ViewSlot& v : head) at[v.slot].push_back(&v);
  const int row = static_cast<int>(b);
  for (std::size_t i = 0; i < table.size(); ++i) {
    const std::int64_t block = table[i], logical = static_cast<std::int64_t>(i);
    if (block < 0) continue;
    if (logical * B >= R) {
      fail(evidence, {K::stale_entry, l, row, logical, block, -1,
                      fmt::format("points at a page, but a ring of {} places has {} pages (entries from {} on must "
                                  "be null)",
                                  R, (R + B - 1) / B, (R + B - 1) / B)});
      continue;
    }
    const bool shared = refs.count(block) && refs.at(block) > 1;
    for (std::int64_t o = 0; o < B; ++o) {
      const std::int64_t p = logical * B + o, slot = block * B + o;
      const auto found = at.find(slot);
      const ViewSlot* v = found == at.end() ? nullptr : found->second[0];
      if (p >= places) {
        if (v)
          fail(evidence, {K::stale_entry, l, row, logical, block, slot,
                          fmt::format("slot {} (ring place {}) holds uid {}, but the ring has written {} places", slot,
                                      p, v->uid, places)});
        continue;
      }
      const std::int64_t newest = p + R * ((n - 1 - p) / R);
      if (!v) {
        if (needed.count(newest))
          fail(evidence, {K::slot_mapping, l, row, logical, block, slot,
                          fmt::format("token {} should be in slot {} (ring place {} = {} % {}), which is empty",
                                      newest, slot, p, newest, R)});
        continue;
      }
      const std::int64_t index = v->claimed_index ? *v->claimed_index : index_of(history, v->uid);
      if (index >= 0 && index % R != p) {
        fail(evidence, {K::slot_mapping, l, row, logical, block, slot,
                        fmt::format("slot {} (ring place {}) holds token {}, whose place is {} = {} % {}", slot, p,
                                    index, index % R, index, R)});
        continue;
      }
      if (index != newest && needed.count(newest)) {
        fail(evidence, {K::slot_mapping, l, row, logical, block, slot,
                        fmt::format("slot {} (ring place {}) holds {}, where token {} belongs", slot, p,
                                    index >= 0 ? fmt::format("token {}", index) : fmt::format("uid {}", v->uid),
                                    newest)});
        continue;
      }
      if (v->uid < 0 || static_cast<std::uint64_t>(v->uid) >= uid_count) {
        fail(evidence, {K::stale_entry, l, row, logical, block, slot,
                        fmt::format("slot {} holds values of no token (uid {})", slot, v->uid)});
        continue;
      }
      // A page copied from another row (a fork) holds that row's uids: the row's own token
      // when the context keys agree.
      const std::uint64_t own = history[static_cast<std::size_t>(index >= 0 ? index : newest)];
      const auto theirs = static_cast<std::uint64_t>(v->uid);
      if (context_key(s_, theirs) != context_key(s_, own)) {
        fail(evidence, {shared ? K::shared_write : K::stale_entry, l, row, logical, block, slot,
                        fmt::format("slot {} holds uid {}, whose context key is not the row's token {} (uid {})", slot,
                                    theirs, index >= 0 ? index : newest, own)});
        continue;
      }
      if (theirs != own)
        for (ViewSlot* x : found->second) x->uid = static_cast<std::int64_t>(own);
    }
  }
  // 8.8.2: the page of every live token's place is in the table.
  std::set<std::int64_t> reported;
  for (const auto& key : sets.live) {
    const std::int64_t i = layer.place(key.index) / B;
    const bool null = i >= static_cast<std::int64_t>(table.size()) || table[static_cast<std::size_t>(i)] < 0;
    if (null && reported.insert(i).second)
      fail(evidence, {K::freed_visible, l, row, i, -1, -1,
                      fmt::format("is null, but token {} at ring place {} is in the window of the row's next query",
                                  key.index, layer.place(key.index))});
  }
  // What a ring still holds that no query needs is held in place, not kept by the policy.
  const std::set<std::int64_t> retained = [&] {
    std::set<std::int64_t> r;
    for (const auto& key : sets.keys) r.insert(key.index);
    return r;
  }();
  for (auto& head : slots.slots[b])
    std::erase_if(head, [&](const ViewSlot& v) {
      const std::int64_t index = v.claimed_index ? *v.claimed_index : index_of(history, v.uid);
      return index >= 0 && !retained.count(index);
    });
}

void PagedChecks::add_checks(Outcome& outcome) const {
  if (steps_checked_ == 0) return;  // not a paged cache
  outcome.checks.push_back(
      {"paged bookkeeping", tally_.failures == 0,
       tally_.failures ? tally_.first
       : steps_checked_ == 0
           ? "no block tables shown"
           : fmt::format("slots, tables, refcounts, shared blocks and hits consistent over {} steps ({} tokens "
                         "taken from the prefix index)",
                         steps_checked_, hits_seen_)});
}

}  // namespace kvcheck
