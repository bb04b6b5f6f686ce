#include "tools/harness/sources/in_process_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include "optimized/paged_cache.h"
#include "tools/harness/sources/cache_entry.h"
#include "tools/harness/scenario/content_keys.h"
#include "tools/harness/run/forward_record.h"
#include "tools/harness/check/quant_checks.h"

namespace kvcheck {

using optimized::CacheRefusal;
using optimized::SlotMeta;

ChunkBuffers make_chunk(const Scenario& s, const InputTable& inputs, const reference::AppendResult& step,
                        const Step& scenario_step) {
  const int L = s.dims.layers, H = s.dims.heads, Hkv = s.dims.kv_heads, D = s.dims.head_dim;
  const int B = static_cast<int>(step.rows.size());
  const std::int64_t n = step.chunk;
  ChunkBuffers c;
  c.chunk.length = n;
  c.chunk.uids.assign(static_cast<std::size_t>(B) * n, -1);
  c.chunk.ids.assign(static_cast<std::size_t>(B) * n, 0);
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
      c.chunk.ids[token] = token_id(s, row[i].uid);
      for (int l = 0; l < L; ++l) {
        std::copy_n(inputs.q_at(l, row[i].uid, 0), H * D, c.q[l].begin() + token * H * D);
        std::copy_n(inputs.k_at(l, row[i].uid, 0), Hkv * D, c.k[l].begin() + token * Hkv * D);
        std::copy_n(inputs.v_at(l, row[i].uid, 0), Hkv * D, c.v[l].begin() + token * Hkv * D);
      }
    }
  }
  for (const RowExtras& e : scenario_step.extras) c.chunk.extras.push_back({e.adapter, e.salt});
  c.chunk.forward = scenario_step.chunk;
  for (int l = 0; l < L; ++l) {
    c.chunk.q.push_back(c.q[l].data());
    c.chunk.k.push_back(c.k[l].data());
    c.chunk.v.push_back(c.v[l].data());
  }
  return c;
}

namespace {

// A quantized slot's codes and scales as the view shows them (SPEC 9.2.1), or that it holds
// its token raw (a residual).
void show_codes(const optimized::SlotStore& store, int l, int b, int g, std::int64_t slot, ViewSlot& v) {
  v.raw = store.raw_slot(b, slot);
  if (v.raw) return;
  if (optimized::is_quantized(store.key_format(l).codec))
    v.key_codes = optimized::unpack_row(store.key_format(l), g, static_cast<const std::byte*>(store.key(l, b, g, slot)),
                                        store.head_dim());
  if (optimized::is_quantized(store.value_format(l).codec))
    v.value_codes = optimized::unpack_row(store.value_format(l), g,
                                          static_cast<const std::byte*>(store.value(l, b, g, slot)), store.head_dim());
}

// The view of every used slot. Half-precision keys are converted to float32 (exactly) into
// `storage`, which the view owns.
std::vector<ViewLayer> slot_layers(const optimized::KvCache& cache, int layer_count,
                                   const std::vector<std::vector<float>>& out,
                                   std::vector<std::vector<float>>& storage) {
  std::vector<ViewLayer> layers(static_cast<std::size_t>(layer_count));
  storage.resize(static_cast<std::size_t>(layer_count));
  for (int layer_index = 0; layer_index < layer_count; ++layer_index) {
    // A hybrid cache keeps one single-layer store per layer.
    const optimized::SlotStore& store = cache.layer_slots(layer_index);
    const int l = store.layers() == layer_count ? layer_index : 0;
    const bool convert = !store.plain_float32();
    if (convert)
      storage[static_cast<std::size_t>(layer_index)].resize(static_cast<std::size_t>(store.batch()) * store.kv_heads() *
                                                            store.capacity() * store.head_dim());
    ViewLayer& layer = layers[static_cast<std::size_t>(layer_index)];
    if (!out.empty()) layer.out = out[static_cast<std::size_t>(layer_index)].data();
    layer.slots.assign(static_cast<std::size_t>(store.batch()),
                       std::vector<std::vector<ViewSlot>>(static_cast<std::size_t>(store.kv_heads())));
    for (int b = 0; b < store.batch(); ++b)
      for (int g = 0; g < store.kv_heads(); ++g)
        for (std::int64_t slot = 0; slot < store.capacity(); ++slot) {
          const SlotMeta& m = store.meta(b, slot);
          if (m.uid < 0) continue;
          const float* key = static_cast<const float*>(store.key(l, b, g, slot));
          if (convert) {
            float* x =
                storage[static_cast<std::size_t>(layer_index)].data() +
                ((static_cast<std::size_t>(b) * store.kv_heads() + g) * store.capacity() + slot) * store.head_dim();
            store.read_key(l, b, g, slot, x);
            key = x;
          }
          ViewSlot& v = layer.slots[static_cast<std::size_t>(b)][static_cast<std::size_t>(g)].emplace_back(
              ViewSlot{slot, m.uid, m.index, m.position, key, std::nullopt, std::nullopt});
          show_codes(store, l, b, g, slot, v);
        }
  }
  return layers;
}

// A paged cache's view: per layer and row, the slots its table reaches (slot = block * B +
// offset), so a block two rows share is listed under both.
std::vector<ViewLayer> paged_layers(const optimized::PagedState& paged, const std::vector<std::vector<float>>& out,
                                    std::vector<std::vector<float>>& storage) {
  const std::int64_t B = paged.block_size;
  std::vector<ViewLayer> layers(paged.layers.size());
  storage.resize(paged.layers.size());
  for (std::size_t l = 0; l < paged.layers.size(); ++l) {
    const optimized::SlotStore& pool = *paged.layers[l].pool;
    const auto& tables = paged.layers[l].tables;
    const int G = pool.kv_heads(), D = pool.head_dim();
    ViewLayer& layer = layers[l];
    if (!out.empty()) layer.out = out[l].data();
    layer.slots.assign(tables.size(), std::vector<std::vector<ViewSlot>>(static_cast<std::size_t>(G)));
    const bool convert = !pool.plain_float32();
    if (convert) storage[l].resize(static_cast<std::size_t>(pool.capacity()) * G * D);
    for (std::size_t b = 0; b < tables.size(); ++b)
      for (std::int64_t block : tables[b]) {
        if (block < 0) continue;
        for (std::int64_t slot = block * B; slot < block * B + B; ++slot) {
          const SlotMeta& m = pool.meta(0, slot);
          if (m.uid < 0) continue;
          for (int g = 0; g < G; ++g) {
            const float* key = static_cast<const float*>(pool.key(0, 0, g, slot));
            if (convert) {
              float* x = storage[l].data() + (static_cast<std::size_t>(g) * pool.capacity() + slot) * D;
              pool.read_key(0, 0, g, slot, x);
              key = x;
            }
            ViewSlot& v = layer.slots[b][static_cast<std::size_t>(g)].emplace_back(
                ViewSlot{slot, m.uid, m.index, m.position, key, std::nullopt, std::nullopt});
            show_codes(pool, 0, 0, g, slot, v);
          }
        }
      }
  }
  return layers;
}

PagedView paged_view(const optimized::PagedState& paged) {
  PagedView v;
  v.block_size = paged.block_size;
  for (const auto& layer : paged.layers) {
    PagedView::Layer& out = v.layers.emplace_back();
    out.tables.assign(layer.tables.begin(), layer.tables.end());
    out.refcounts.assign(layer.refcounts.begin(), layer.refcounts.end());
  }
  v.hit_tokens.assign(paged.hit_tokens.begin(), paged.hit_tokens.end());
  return v;
}

}  // namespace

InProcessCache::InProcessCache(const Scenario& s, const InputTable& inputs, const CacheEntry& entry)
    : s_(s), inputs_(inputs), cache_(entry.make(cache_config(s, longest_row(s)))) {}

InProcessCache::~InProcessCache() = default;

CacheView InProcessCache::operator()(std::size_t index, const StepRecord& rec) {
  CacheView view;
  log_ = {};  // a long prompt's log and outputs are large: none kept past their step
  out_ = {};
  key_stores_ = {};
  key_stores_complete_ = true;
  std::optional<std::string> error;
  std::string refusal_code;
  try {
    apply(index, rec);
  } catch (const CacheRefusal& e) {
    error = e.what();
    refusal_code = e.code;
  } catch (const std::exception& e) {
    error = e.what();  // the cache under test failed: a finding, not bad input
  }
  if (checker_error_) std::rethrow_exception(std::exchange(checker_error_, nullptr));
  const bool shows = !error || !rec.refused.empty();
  if (shows) view = view_now(out_);
  view.slots_shared = !s_.hybrid();
  view.error = std::move(error);
  view.refusal_code = std::move(refusal_code);
  if (rec.append && shows) view.pairs = std::move(log_);
  if (rec.append && shows && key_stores_complete_) view.key_stores = std::move(key_stores_);
  return view;
}

namespace {
// Stores of quantized keys a checker follows in layer l: keys quantized with a scale computed
// per row (a frozen one never moves across a boundary), nothing held raw.
bool follows_key_stores(const Scenario& s, int l) {
  if (!s.quantized()) return false;
  const KvQuant& q = s.quant(l);
  return q.k && !q.holds_raw() && q.k->scale.rule != ScaleRule::first_append;
}
bool shows_key_stores(const Scenario& s) {
  for (int l = 0; l < s.dims.layers; ++l)
    if (follows_key_stores(s, l)) return true;
  return false;
}
// A long prompt re-quantizes its window at every shift: beyond this many stores in one step
// (about 170 MB at head_dim 128) the source shows none, and the checker judges the codes
// after the step alone, as for a trace (docs/quantized.md).
constexpr std::size_t kMostKeyStores = std::size_t{1} << 18;
}  // namespace

void InProcessCache::record_key_store(int l, int b, int g, std::int64_t slot, std::int64_t position) {
  if (!key_stores_complete_ || !follows_key_stores(s_, l)) return;
  if (key_stores_.size() >= kMostKeyStores) {
    key_stores_complete_ = false;
    key_stores_ = {};
    return;
  }
  const optimized::SlotStore& store = cache_->layer_slots(l);
  if (!optimized::is_quantized(store.key_format(l).codec)) return;
  key_stores_.push_back({l, b, g, store.meta(b, slot).uid, position,
                         optimized::unpack_row(store.key_format(l), g,
                                               static_cast<const std::byte*>(store.key(l, b, g, slot)),
                                               store.head_dim())});
}

CacheView InProcessCache::view_now(const std::vector<std::vector<float>>& out) {
  CacheView view;
  view.slots_shared = !s_.hybrid();
  view.batch = cache_->batch();
  if (const optimized::PagedState* paged = cache_->paged()) {
    view.layers = paged_layers(*paged, out, view.storage);
    view.paged = paged_view(*paged);
  } else {
    view.layers = slot_layers(*cache_, s_.dims.layers, out, view.storage);
  }
  view.roundoff = unit_roundoff(s_.kv_dtype);
  for (std::size_t l = 0; l < view.layers.size(); ++l) view.layers[l].key_roundoff = key_roundoff(s_, static_cast<int>(l));
  return view;
}

void InProcessCache::between_forwards(std::size_t index, const StepRecord& rec, std::int64_t forward,
                                      std::vector<std::int64_t>& begin, std::size_t& logged) {
  if (checker_error_) return;  // the run ends at the checker's failure
  // What the cache says of itself may raise: that is the cache's (through its append).
  const reference::AppendResult& all = *rec.append;
  std::vector<std::int64_t> end(begin.size());
  for (std::size_t b = 0; b < begin.size(); ++b) {
    const auto held = static_cast<std::int64_t>(rec.histories[b].size());  // after the whole append
    end[b] = all.rows[b].empty() ? held : std::clamp(cache_->row_length(static_cast<int>(b)), begin[b], held);
  }
  StepRecord part;
  try {
    part = forward_record(s_, rec, begin, end, forward);
    // The forward's outputs, cut out of the whole append's [B, n, H, D] per layer.
    std::vector<std::size_t> skipped(begin.size(), 0);
    for (std::size_t b = 0; b < begin.size(); ++b)
      if (!part.append->rows[b].empty())
        skipped[b] = static_cast<std::size_t>(part.append->rows[b].front().index - all.rows[b].front().index);
    const std::size_t HD = static_cast<std::size_t>(s_.dims.heads) * static_cast<std::size_t>(s_.dims.head_dim);
    forward_out_.clear();
    for (const std::vector<float>& layer : out_)
      forward_out_.push_back(cut_tokens<float>(layer, all, *part.append, skipped, 1, HD));
  } catch (...) {
    checker_error_ = std::current_exception();
    return;
  }
  CacheView view = view_now(forward_out_);
  try {
    view.pairs.emplace(log_.begin() + static_cast<std::ptrdiff_t>(logged), log_.end());
    logged = log_.size();
    forwards_to_->forward(index, part, std::move(view));
    begin = std::move(end);
  } catch (...) {
    checker_error_ = std::current_exception();
  }
}

void InProcessCache::apply(std::size_t index, const StepRecord& rec) {
  switch (rec.step.op) {
    case StepOp::append: {
      const reference::AppendResult& ref = *rec.append;
      ChunkBuffers buffers = make_chunk(s_, inputs_, ref, rec.step);
      std::int64_t forward = 0;
      std::vector<std::int64_t> begin;  // per row: the first token of the next forward's record
      std::size_t logged = 0;           // log entries already handed over
      for (std::size_t b = 0; b < ref.rows.size(); ++b)
        begin.push_back(ref.rows[b].empty() ? 0 : ref.rows[b].front().index);
      if (forwards_to_ && rec.step.chunk > 0)
        buffers.chunk.between_forwards = [&] { between_forwards(index, rec, ++forward, begin, logged); };
      if (shows_key_stores(s_))
        buffers.chunk.key_stored = [&](int l, int b, int g, std::int64_t slot, std::int64_t position) {
          record_key_store(l, b, g, slot, position);
        };
      const std::size_t size = ref.rows.size() * static_cast<std::size_t>(ref.chunk) * s_.dims.heads * s_.dims.head_dim;
      out_.assign(static_cast<std::size_t>(s_.dims.layers),
                  std::vector<float>(size, std::numeric_limits<float>::quiet_NaN()));
      std::vector<float*> out_ptrs;
      for (auto& o : out_) out_ptrs.push_back(o.data());
      cache_->append(buffers.chunk, out_ptrs, &log_);
      break;
    }
    case StepOp::reorder:
      cache_->reorder(rec.step.rows);
      break;
    case StepOp::reset:
      cache_->reset(*rec.step.batch);
      break;
    case StepOp::crop:
      cache_->crop(rec.step.length);
      break;
    case StepOp::prune:
      // The catalog serves no observed prune (SPEC 11.1) to kvcheck's caches: they have no scorer.
      if (rec.step.prune_keep > 0) throw std::logic_error("an observed prune (SPEC 11.1) reached an in-process cache");
      cache_->prune(rec.step.prune_sinks, rec.step.prune_recent, rec.step.rerotate);
      break;
    case StepOp::free_rows:
      cache_->free_rows(rec.step.rows);
      break;
    case StepOp::evict:
      cache_->evict(rec.step.evict_blocks);
      break;
    case StepOp::preempt:
      cache_->preempt(rec.step.rows, rec.step.recompute);
      recomputed_.resize(std::max<std::size_t>(recomputed_.size(), rec.rows()), false);
      for (int b : rec.step.rows) recomputed_[static_cast<std::size_t>(b)] = rec.step.recompute;
      break;
    case StepOp::resume: {
      // A recompute rebuilds every token each resumed row had: its whole history, raw.
      reference::AppendResult history;
      history.rows.resize(rec.rows());
      bool recompute = false;
      for (int b : rec.step.rows) {
        if (static_cast<std::size_t>(b) >= recomputed_.size() || !recomputed_[static_cast<std::size_t>(b)]) continue;
        recompute = true;
        const RowHistory& h = rec.histories[static_cast<std::size_t>(b)];
        for (std::size_t t = 0; t < h.size(); ++t)
          history.rows[static_cast<std::size_t>(b)].push_back({h[t], static_cast<std::int64_t>(t), {}, {}});
        history.chunk = std::max(history.chunk, static_cast<std::int64_t>(h.size()));
      }
      if (!recompute) {
        cache_->resume(rec.step.rows, nullptr);
        break;
      }
      Step none;  // no extras: the cache keeps each row's own
      const ChunkBuffers buffers = make_chunk(s_, inputs_, history, none);
      cache_->resume(rec.step.rows, &buffers.chunk);
      break;
    }
  }
}

CacheTrace trace_cache(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, const CacheEntry& cache,
                       bool with_picture, std::optional<std::size_t> focus_step) {
  CheckOptions options;
  options.target = cache.name;
  options.eviction = cache.eviction;
  options.picture = with_picture;
  options.focus_step = focus_step;
  StepChecker checker(s, inputs, options);
  InProcessCache in_process(s, inputs, cache);
  in_process.check_forwards_with(checker);
  return check_steps(checker, s, run, options.target, std::ref(in_process));
}

Outcome check_cache(const Scenario& s, const InputTable& inputs, const ReferenceRun& run, const CacheEntry& cache) {
  return trace_cache(s, inputs, run, cache, false).outcome;
}

}  // namespace kvcheck
