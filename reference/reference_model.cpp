#include "reference/reference_model.h"

#include <algorithm>
#include <set>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <unordered_map>

#include "reference/attention.h"
#include "reference/rope.h"

namespace kvcheck::reference {

ReferenceModel::ReferenceModel(const Dims& dims, const Rope& rope, const Policy& policy, double scale,
                               const InputTable& inputs, const Attention& attention)
    : ReferenceModel(dims, std::vector<Rope>(static_cast<std::size_t>(dims.layers), rope),
                     std::vector<Policy>(static_cast<std::size_t>(dims.layers), policy), scale, inputs, attention) {}

ReferenceModel::ReferenceModel(const Dims& dims, const std::vector<Rope>& layer_ropes,
                               const std::vector<Policy>& layer_policies, double scale, const InputTable& inputs,
                               const Attention& attention)
    : dims_(dims),
      policy_(layer_policies.at(0)),
      layer_policies_(layer_policies),
      hybrid_(std::any_of(layer_policies.begin(), layer_policies.end(),
                          [&](const Policy& p) { return !(p == layer_policies[0]); })),
      attention_(attention),
      scale_(scale),
      inputs_(inputs),
      histories_(static_cast<std::size_t>(dims.batch)),
      threads_(std::max(1, static_cast<int>(std::thread::hardware_concurrency()))) {
  for (const Rope& rope : layer_ropes) {
    auto same = std::find_if(tables_.begin(), tables_.end(), [&](const AngleTable& t) { return t.rope == rope; });
    if (same == tables_.end()) same = tables_.insert(tables_.end(), AngleTable{rope, rotary_dim(dims.head_dim, rope), {}});
    table_of_.push_back(static_cast<int>(same - tables_.begin()));
  }
}

// Quantized storage re-rotates and re-quantizes keys with one rope: the scenario parser
// refuses a rope per layer beside kv_quant.
void ReferenceModel::store_as(std::vector<KvQuant> layers, KvDtype kv_dtype) {
  stored_ = std::make_unique<StoredKv>(dims_, tables_.at(0).rope, std::move(layers), kv_dtype, inputs_);
  stored_->reset(batch());
}

// SPEC 10.3: a NoPE layer's query times its temperature at position p (the parser allows
// the temperature only where every NoPE layer's Pq is its token's index).
void ReferenceModel::scale_query(int layer, std::int64_t position, double* query, int d) const {
  if (!attention_.query_temperature || !angles(layer).rope.nope) return;
  const double factor = query_temperature(*attention_.query_temperature, position);
  for (int i = 0; i < d; ++i) query[i] *= factor;
}

void ReferenceModel::ensure_positions(std::int64_t largest) {
  for (AngleTable& table : tables_) {
    const int half = table.rotary / 2;
    const double m = rope_magnitude(table.rope);
    for (std::int64_t p = positions_; p <= largest; ++p) {
      for (int i = 0; i < half; ++i)
        table.cos_sin.push_back(m * std::cos(rope_angle(i, dims_.head_dim, static_cast<double>(p), table.rope)));
      for (int i = 0; i < half; ++i)
        table.cos_sin.push_back(m * std::sin(rope_angle(i, dims_.head_dim, static_cast<double>(p), table.rope)));
    }
  }
  positions_ = std::max(positions_, largest + 1);
}

namespace {

// m R(p) x for float32 x, into out: rotate() of rope.h, with the angles' cos and sin looked
// up instead of recomputed (the same values: the table holds m std::cos and m std::sin of
// rope_angle, cos for every pair, then sin). The first `rotary` dims rotate, the others
// pass through. One loop per layout, so each vectorizes.
void rotate_into(const float* x, const double* cos_sin, int d, int rotary, RopeLayout layout, double* out) {
  const int half = rotary / 2;
  for (int i = rotary; i < d; ++i) out[i] = x[i];
  const double* c = cos_sin;
  const double* s = cos_sin + half;
  if (layout == RopeLayout::half) {  // pair i is (x[i], x[i + D/2])
    for (int i = 0; i < half; ++i) {
      const double a = x[i], b = x[i + half];
      out[i] = a * c[i] - b * s[i];
      out[i + half] = a * s[i] + b * c[i];
    }
  } else {  // pair i is (x[2i], x[2i + 1])
    for (int i = 0; i < half; ++i) {
      const double a = x[2 * i], b = x[2 * i + 1];
      out[2 * i] = a * c[i] - b * s[i];
      out[2 * i + 1] = a * s[i] + b * c[i];
    }
  }
}

}  // namespace

// Buffers one thread reuses for every token: nothing is allocated per query or key.
struct ReferenceModel::Scratch {
  std::vector<double> keys, values, query, scores;
  std::vector<const double*> query_rows, sink_rows;  // one per head of a group
  std::vector<const double*> key_rows, value_rows;   // one per visible key
  std::vector<std::size_t> slots;                    // one per visible key: its memo slot
};

void ReferenceModel::attend_group(int layer, int group, const std::vector<std::uint64_t>& row, std::int64_t t,
                                  const QueryView& view, Scratch& scratch, KeyMemo& memo, double* out) const {
  const int d = dims_.head_dim;
  const std::size_t n = view.keys.size(), D = static_cast<std::size_t>(d);
  const std::size_t share = kMemoBytes / memos_.size() / (2 * sizeof(double) * D);
  // Room for this view's keys beside the last view's: a full layer's next token sees the
  // same keys plus one. Cleared, not freed: its memory is reused, not faulted in again.
  if (memo.slot_of_uid.size() + n > std::max(2 * n, share)) {
    memo.slot_of_uid.clear();
    memo.position.clear();
    memo.keys.clear();
    memo.values.clear();
  }
  // Every visible key rotated at its position Pk(t, j), once for the group's query heads
  // (and once for all tokens that see it at that position).
  std::vector<std::size_t>& slots = scratch.slots;
  slots.resize(n);
  for (std::size_t j = 0; j < n; ++j) {
    const VisibleKey& key = view.keys[j];
    const std::uint64_t uid = row[key.index] & kUidBits;  // a window layer sees tokens a prune took from full ones
    auto [it, added] = memo.slot_of_uid.try_emplace(uid, memo.position.size());
    const std::size_t slot = it->second;
    if (added) {
      memo.position.push_back(key.position);
      memo.keys.resize(memo.keys.size() + D);
      memo.values.resize(memo.values.size() + D);
      const float* v = inputs_.v_at(layer, uid, group);
      std::copy(v, v + d, memo.values.begin() + static_cast<std::ptrdiff_t>(slot * D));
    } else if (memo.position[slot] == key.position) {
      slots[j] = slot;
      continue;
    }
    memo.position[slot] = key.position;
    const AngleTable& a = angles(layer);
    rotate_into(inputs_.k_at(layer, uid, group), a.at(key.position), d, a.rotary, a.rope.layout,
                memo.keys.data() + slot * D);
    slots[j] = slot;
  }
  scratch.key_rows.resize(n);
  scratch.value_rows.resize(n);
  for (std::size_t j = 0; j < n; ++j) {
    scratch.key_rows[j] = memo.keys.data() + slots[j] * D;
    scratch.value_rows[j] = memo.values.data() + slots[j] * D;
  }
  const int heads_per_group = dims_.heads / dims_.kv_heads;
  const std::size_t G = static_cast<std::size_t>(heads_per_group);
  scratch.query.resize(G * D);
  scratch.scores.resize(G * n);
  scratch.query_rows.resize(G);
  scratch.sink_rows.resize(G);
  for (int k = 0; k < heads_per_group; ++k) {
    const int head = group * heads_per_group + k;
    const AngleTable& a = angles(layer);
    double* query = scratch.query.data() + static_cast<std::size_t>(k) * D;
    rotate_into(inputs_.q_at(layer, row[t], head), a.at(view.query_position), d, a.rotary, a.rope.layout, query);
    scale_query(layer, view.query_position, query, d);
    scratch.query_rows[static_cast<std::size_t>(k)] = scratch.query.data() + static_cast<std::size_t>(k) * D;
    scratch.sink_rows[static_cast<std::size_t>(k)] =
        attention_.sink_logits.empty() ? nullptr : &attention_.sink_logits[static_cast<std::size_t>(layer)][head];
  }
  attend_heads(scratch.query_rows.data(), G, scratch.key_rows.data(), scratch.value_rows.data(), n, D, scale_,
               scratch.sink_rows.data(), scratch.scores.data(), out);
}

AppendResult ReferenceModel::append(const std::vector<std::int64_t>& counts, bool attend) {
  if (counts.size() != histories_.size()) throw std::invalid_argument("append: one count per row expected");
  AppendResult result;
  result.chunk = *std::max_element(counts.begin(), counts.end());
  result.rows.resize(histories_.size());

  // uids: step order, then row order, then order inside the chunk.
  for (std::size_t b = 0; b < histories_.size(); ++b) {
    for (std::int64_t i = 0; i < counts[b]; ++i) {
      if (next_uid_ >= static_cast<std::uint64_t>(inputs_.uids))
        throw std::out_of_range("append: the inputs hold no uid " + std::to_string(next_uid_));
      histories_[b].push_back(next_uid_++);
    }
  }

  const int L = dims_.layers, B = batch(), H = dims_.heads, Hkv = dims_.kv_heads, D = dims_.head_dim;
  const std::int64_t n = result.chunk;
  result.out.assign(static_cast<std::size_t>(L) * B * n * H * D, std::numeric_limits<double>::quiet_NaN());
  // The views first (what each token sees), then the attention of every (token, layer,
  // kv head) as a unit of work. Units are independent; a thread takes all of a (layer,
  // kv head)'s, so its key memo is never shared.
  struct Unit {
    int row, layer, group;
    std::int64_t token;  // index into result.rows[row]
  };
  std::vector<Unit> units;
  std::int64_t largest = 0;
  for (int b = 0; b < B; ++b) {
    const std::vector<std::uint64_t>& row = histories_[b];
    const std::int64_t start = static_cast<std::int64_t>(row.size()) - counts[b];
    const PrunedRun pruned = PrunedRun::of(row);
    for (std::int64_t t = start; t < static_cast<std::int64_t>(row.size()); ++t) {
      AppendedToken token{row[t], t, chunk_view(policy_, start, t), {}};
      if (policy_.kind == PolicyKind::full) pruned.apply(token.view, t);
      if (hybrid_)
        for (const Policy& p : layer_policies_) {
          token.layer_views.push_back(chunk_view(p, start, t));
          if (p.kind == PolicyKind::full) pruned.apply(token.layer_views.back(), t);  // SPEC 11: full layers only
        }
      for (int l = 0; l < L; ++l) {
        const QueryView& view = token.view_in(l);
        largest = std::max(largest, view.query_position);
        for (const VisibleKey& key : view.keys) largest = std::max(largest, key.position);
      }
      result.rows[b].push_back(std::move(token));
    }
    // Tokens innermost: consecutive units share a (layer, kv head) and most of their keys.
    // SPEC 11.1: a full layer's outputs over a row whose kept tokens the cache chose stay NaN.
    for (int l = 0; attend && l < L; ++l) {
      if (pruned.observed && layer_policies_[static_cast<std::size_t>(l)].kind == PolicyKind::full) continue;
      for (int g = 0; g < Hkv; ++g)
        for (std::int64_t i = 0; i < counts[b]; ++i) units.push_back({b, l, g, i});
    }
  }
  ensure_positions(largest);
  const std::size_t heads_per_group = static_cast<std::size_t>(H / Hkv);
  // Each (layer, kv head) belongs to one thread, which owns its key memo.
  if (memos_.empty()) memos_.resize(static_cast<std::size_t>(L) * static_cast<std::size_t>(Hkv));
  auto work = [&](std::size_t first, std::size_t stride) {
    Scratch scratch;
    for (const Unit& unit : units) {
      const std::size_t owner = static_cast<std::size_t>(unit.layer) * static_cast<std::size_t>(Hkv) +
                                static_cast<std::size_t>(unit.group);
      if (owner % stride != first) continue;
      const AppendedToken& token = result.rows[unit.row][static_cast<std::size_t>(unit.token)];
      const std::int64_t pad = n - counts[unit.row];
      const std::size_t base = ((((static_cast<std::size_t>(unit.layer) * B + unit.row) * n + pad + unit.token) * H +
                                 unit.group * heads_per_group) *
                                D);
      attend_group(unit.layer, unit.group, histories_[unit.row], token.index, token.view_in(unit.layer), scratch,
                   memos_[owner], result.out.data() + base);
    }
  };
  // Threads only where the work pays for starting them.
  std::size_t keys = 0;
  for (const auto& tokens : result.rows)
    for (const auto& token : tokens)
      for (int l = 0; l < L; ++l) keys += token.view_in(l).keys.size();
  const std::size_t threads = keys * static_cast<std::size_t>(H * D) < 2000000 ? 1 : static_cast<std::size_t>(threads_);
  std::vector<std::thread> pool;
  for (std::size_t k = 1; k < threads; ++k) pool.emplace_back(work, k, threads);
  work(0, threads);
  for (std::thread& th : pool) th.join();

  // R_stored: one token after the other, since a shift re-rotates stored keys in the order
  // the queries see them move.
  if (stored_) {
    if (attend) result.out_stored.assign(result.out.size(), std::numeric_limits<double>::quiet_NaN());
    if (attend) result.query_slack.assign(result.out.size() / static_cast<std::size_t>(D), 0.0);
    Scratch scratch;
    const KvQuant& quant = stored_->quant();  // the residual's rules: every layer's
    for (int b = 0; b < B; ++b) {
      const std::int64_t pad = n - counts[b];
      const auto length = static_cast<std::int64_t>(histories_[b].size());
      const bool first_append = length == counts[b];
      if (first_append && counts[b] > 0 && stored_->freezes_scales()) stored_->freeze_scales(b, histories_[b]);
      // A residual's flush: before the queries read under chunk_reads "stored", after under "raw".
      if (quant.holds_raw() && counts[b] > 0) {
        // Every new token written first (raw), at its index: a residual needs full attention.
        for (int l = 0; l < L; ++l)
          for (const AppendedToken& token : result.rows[b])
            stored_->settle(b, l, token.index, histories_[b][static_cast<std::size_t>(token.index)], token.index);
        if (quant.chunk_reads == ChunkReads::stored) stored_->flush(b, length, first_append);
      }
      for (std::size_t i = 0; i < result.rows[b].size(); ++i)
        for (int l = 0; l < L; ++l) {
          const AppendedToken& token = result.rows[b][i];
          const std::size_t base = (((static_cast<std::size_t>(l) * B + b) * n + pad + static_cast<std::int64_t>(i)) * H) * D;
          attend_stored(b, l, token.index, token.view_in(l), attend, scratch,
                        attend ? result.out_stored.data() + base : nullptr,
                        attend ? result.query_slack.data() + base / static_cast<std::size_t>(D) : nullptr);
        }
      if (quant.holds_raw() && counts[b] > 0 && quant.chunk_reads == ChunkReads::raw)
        stored_->flush(b, length, first_append);
      // What the row keeps after the step, at the positions its next token sees them (a
      // dense prefill shifts once more after its forward).
      for (int l = 0; l < L; ++l)
        for (const VisibleKey& key :
             retained_view(layer_policies_[static_cast<std::size_t>(l)], static_cast<std::int64_t>(histories_[b].size())).keys)
          stored_->settle(b, l, key.index, histories_[b][static_cast<std::size_t>(key.index)], key.position);
    }
  }
  return result;
}

void ReferenceModel::attend_stored(int row, int layer, std::int64_t t, const QueryView& view, bool attend,
                                   Scratch& scratch, double* out, double* slack) {
  const std::vector<std::uint64_t>& history = histories_[static_cast<std::size_t>(row)];
  const std::size_t n = view.keys.size(), D = static_cast<std::size_t>(dims_.head_dim);
  const int Hkv = dims_.kv_heads, G = dims_.heads / dims_.kv_heads;
  // keys and values [kv head][key][D]
  scratch.keys.resize(Hkv * n * D);
  scratch.values.resize(Hkv * n * D);
  for (std::size_t j = 0; j < n; ++j) {
    const VisibleKey& key = view.keys[j];
    const StoredLayer& s = stored_->settle(row, layer, key.index, history[static_cast<std::size_t>(key.index)], key.position);
    for (int g = 0; g < Hkv; ++g) {
      const StoredHead& h = s.heads[static_cast<std::size_t>(g)];
      std::copy(h.key.begin(), h.key.end(), scratch.keys.begin() + static_cast<std::ptrdiff_t>((g * n + j) * D));
      std::copy(h.value.begin(), h.value.end(), scratch.values.begin() + static_cast<std::ptrdiff_t>((g * n + j) * D));
    }
  }
  if (!attend) return;
  scratch.query.resize(G * D);
  scratch.scores.resize(G * n);
  scratch.query_rows.resize(G);
  scratch.sink_rows.resize(G);
  for (int g = 0; g < Hkv; ++g) {
    for (int k = 0; k < G; ++k) {
      const int head = g * G + k;
      double* query = scratch.query.data() + static_cast<std::size_t>(k) * D;
      const AngleTable& a = angles(layer);
      rotate_into(inputs_.q_at(layer, history[static_cast<std::size_t>(t)], head), a.at(view.query_position),
                  dims_.head_dim, a.rotary, a.rope.layout, query);
      scale_query(layer, view.query_position, query, dims_.head_dim);
      slack[head] = stored_->quantize_query(layer, query, view.query_position);
      scratch.query_rows[static_cast<std::size_t>(k)] = query;
      scratch.sink_rows[static_cast<std::size_t>(k)] =
          attention_.sink_logits.empty() ? nullptr : &attention_.sink_logits[static_cast<std::size_t>(layer)][head];
    }
    scratch.key_rows.resize(n);
    scratch.value_rows.resize(n);
    for (std::size_t j = 0; j < n; ++j) {
      scratch.key_rows[j] = scratch.keys.data() + (g * n + j) * D;
      scratch.value_rows[j] = scratch.values.data() + (g * n + j) * D;
    }
    attend_heads(scratch.query_rows.data(), static_cast<std::size_t>(G), scratch.key_rows.data(),
                 scratch.value_rows.data(), n, D, scale_, scratch.sink_rows.data(), scratch.scores.data(),
                 out + static_cast<std::size_t>(g * G) * D);
  }
}

void ReferenceModel::reorder(const std::vector<int>& rows) {
  std::vector<std::vector<std::uint64_t>> next;
  for (int r : rows) next.push_back(histories_.at(r));
  histories_ = std::move(next);
  if (stored_) stored_->reorder(rows);
}

void ReferenceModel::reset(int batch) {
  histories_.assign(static_cast<std::size_t>(batch), {});
  if (stored_) stored_->reset(batch);
}

void ReferenceModel::free_rows(const std::vector<int>& rows) {
  for (int r : rows) {
    histories_.at(static_cast<std::size_t>(r)).clear();
    if (stored_) stored_->free_row(r);
  }
}

void ReferenceModel::crop(std::int64_t length) {
  for (std::size_t b = 0; b < histories_.size(); ++b) {
    const auto n = static_cast<std::int64_t>(histories_[b].size());
    if (length >= n) continue;
    // The cropped row's last token must still find every key it needs in the cache, in
    // every layer.
    for (std::size_t l = 0; l < layer_policies_.size(); ++l) {
      const std::int64_t needed = crop_lacks(layer_policies_[l], n, length);
      if (needed >= 0)
        throw StepRefused("crop_evicted", "crop to " + std::to_string(length) + " tokens needs token " +
                                              std::to_string(needed) + " of row " + std::to_string(b) +
                                              (hybrid_ ? " in layer " + std::to_string(l) : std::string()) +
                                              (layer_policies_[l].swa > 0 ? ", which the window may have dropped"
                                                                          : ", which the cache has already evicted"));
      if (!hybrid_) break;  // every layer alike
    }
  }
  for (auto& row : histories_)
    if (static_cast<std::int64_t>(row.size()) > length) row.resize(static_cast<std::size_t>(length));
  if (stored_) stored_->crop(length);
}

void ReferenceModel::prune(std::int64_t sinks, std::int64_t recent, bool rerotate) {
  for (auto& row : histories_) {
    const auto n = static_cast<std::int64_t>(row.size());
    // Kept: [0, S) and [n - R, n); pruned: what lies between.
    const std::int64_t first = std::min(sinks, n), end = std::clamp(n - recent, first, n);
    for (std::int64_t i = first; i < end; ++i)
      row[static_cast<std::size_t>(i)] |= kPrunedBit | (rerotate ? kRerotatedBit : 0);
  }
}

void ReferenceModel::prune_observed(std::int64_t keep, bool rerotate) {
  for (auto& row : histories_)
    for (std::size_t i = static_cast<std::size_t>(keep); i < row.size(); ++i)
      row[i] |= kPrunedBit | kObservedBit | (rerotate ? kRerotatedBit : 0);
}

PrunedRun PrunedRun::of(std::span<const std::uint64_t> history) {
  PrunedRun run;
  const auto at = std::find_if(history.begin(), history.end(), is_pruned);
  if (at == history.end()) return run;
  run.rerotated = (*at & kRerotatedBit) != 0;
  run.observed = (*at & kObservedBit) != 0;
  run.first = at - history.begin();
  run.end = std::find_if_not(at, history.end(), is_pruned) - history.begin();
  return run;
}

void PrunedRun::apply(QueryView& view, std::int64_t t) const {
  if (first == end) return;
  const std::int64_t from = observed ? 0 : first;  // observed: which of the prompt's are kept is the cache's
  std::erase_if(view.keys, [&](const VisibleKey& k) { return k.index >= from && k.index < end; });
  for (VisibleKey& k : view.keys) k.position -= shift(k.index);
  view.query_position -= shift(t);
}

RowRetained retained_of(const Policy& policy, std::span<const std::uint64_t> history) {
  const auto length = static_cast<std::int64_t>(history.size());
  // SPEC 11: a prune takes tokens from the full layers; a window layer keeps what its policy keeps.
  const PrunedRun pruned = policy.kind == PolicyKind::full ? PrunedRun::of(history) : PrunedRun{};
  QueryView view = retained_view(policy, length);
  pruned.apply(view, length - 1);
  RowRetained out;
  out.query_position = view.query_position;
  for (const VisibleKey& key : view.keys) out.keys.push_back({history[key.index] & kUidBits, key.index, key.position});
  QueryView next = live_view(policy, length);
  pruned.apply(next, length);
  out.next_query_position = next.query_position;
  for (const VisibleKey& key : next.keys) out.live.push_back({history[key.index] & kUidBits, key.index, key.position});
  if (policy.swa > 0) {
    std::set<std::int64_t> seen;
    for (const VisibleKey& key : seen_again_view(policy, length).keys) seen.insert(key.index);
    for (const RetainedKey& key : out.keys)
      if (!seen.count(key.index)) out.droppable.push_back(key.uid);
  }
  return out;
}

RowRetained ReferenceModel::retained(int row, int layer) const {
  return retained_of(layer_policies_.at(static_cast<std::size_t>(layer)), histories_.at(row));
}

}  // namespace kvcheck::reference
