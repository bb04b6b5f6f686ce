#include "optimized/paged_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvcheck::optimized {

namespace {

std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::uint64_t text_hash(std::uint64_t h, const std::string& text) {
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

PagedCache::PagedCache(const CacheConfig& config)
    : config_(config),
      paging_(config.paging ? *config.paging : throw std::invalid_argument("the paged cache needs config.paging")),
      rope_(shared_rope(config)),
      kernel_(config.threads),
      frozen_(config.kv_heads, config.head_dim, store_formats(config)) {
  const std::vector<LayerFormats> formats = store_formats(config);
  for (int l = 0; l < config.layers; ++l) {
    policies_.push_back(layer_policy(config, l));
    // One row of every block's slots: a kv head's blocks lie end to end, as a contiguous
    // cache's slots do, so reading a row's blocks in order streams like reading one run.
    pools_.emplace_back(config.kv_heads, config.head_dim,
                        std::vector<LayerFormats>{formats[static_cast<std::size_t>(l)]});
    pools_.back().reset(1, paging_.num_blocks * paging_.block_size);
    blocks_.emplace_back(paging_.num_blocks, paging_.prefix_cache);
    poisoned_.emplace_back(static_cast<std::size_t>(paging_.num_blocks), 0);
    token_index_.emplace_back();
    token_keys_.emplace_back(static_cast<std::size_t>(paging_.num_blocks));
    sink_logits_.push_back(config.sink_logits.empty()
                               ? std::vector<std::vector<float>>{}
                               : std::vector<std::vector<float>>{config.sink_logits[static_cast<std::size_t>(l)]});
  }
  tables_.resize(static_cast<std::size_t>(config.layers));
  reset(config.batch);
}

// What the query at token t of layer `layer` sees, in a forward of tokens forward_first ..
// forward_end - 1 of an append of append_first .. append_end - 1.
QueryPlan PagedCache::plan(int layer, std::int64_t t, std::int64_t forward_first, std::int64_t forward_end,
                           std::int64_t append_first, std::int64_t append_end) const {
  const LayerPolicy& p = policy(layer);
  const std::int64_t position = position_of(t, forward_first, append_first);
  const std::int64_t ahead = keys_ahead(t, forward_end, append_end);
  if (p.kind == LayerPolicy::Kind::chunked)  // SPEC 10.2: the query's own chunk
    return {t, 0, t / p.window * p.window, position, position, ahead};
  if (p.kind != LayerPolicy::Kind::sink) {
    const std::int64_t w = p.kind == LayerPolicy::Kind::sliding ? p.window : 0;
    return {t, 0, window_begin(t, w, forward_first, append_first), position, position, ahead};
  }
  // Keys sit at their token index, so the query is rotated at t against the window (t - j)
  // and at t - E against the sinks (SPEC 3's Pq - Pk); a dense append is one forward over
  // what the row held before it, so E stays E(append_first).
  const std::int64_t e = sink_evicted(p.window, p.evict, p.dense_prefill ? append_first : t);
  return {t, p.sinks, p.sinks + e, position, p.shift_positions ? position - e : position, ahead};
}

std::uint64_t PagedCache::block_key(std::uint64_t previous, std::span<const std::uint64_t> ids, const RowExtras& extras,
                                    bool first) const {
  std::uint64_t h = previous;
  if (first)  // each extra hashed on its own and tagged: no text of one can pass for the other
    h = mix64(mix64(text_hash(0xcbf29ce484222325ull, extras.adapter) ^ 0xA) ^ text_hash(0xcbf29ce484222325ull, extras.salt) ^
              0x5);
  for (std::uint64_t id : ids) h = mix64(h ^ id);
  return h;
}

// Blocks wholly before the window of the row's last token: what the policy keeps (its
// retained set) stays, so a crop the policy accepts always finds its tokens. SPEC 8.5
// allows freeing up to floor((n - W + 1) / B), one dead token sooner.
std::int64_t PagedCache::first_live_block(std::int64_t n, std::int64_t w) const {
  return std::max<std::int64_t>(0, n - w) / paging_.block_size;
}

std::uint64_t PagedCache::key_of_block(int b, std::int64_t logical) {
  Row& row = rows_[static_cast<std::size_t>(b)];
  const auto B = static_cast<std::size_t>(paging_.block_size);
  while (static_cast<std::int64_t>(row.keys.size()) <= logical) {
    const std::size_t i = row.keys.size();
    row.keys.push_back(block_key(i == 0 ? 0 : row.keys.back(), std::span(row.ids).subspan(i * B, B), row.extras, i == 0));
  }
  return row.keys[static_cast<std::size_t>(logical)];
}

// A block taken for new data: its slots empty (and poisoned, when asked).
void PagedCache::clear_block(int layer, std::int64_t block) {
  if (config_.poison_blocks) return poison_block(layer, block, PoisonKind::never_written);
  SlotStore& pool = pools_[static_cast<std::size_t>(layer)];
  for (std::int64_t s = 0; s < paging_.block_size; ++s) pool.clear_slot(0, block * paging_.block_size + s);
}

void PagedCache::poison_block(int layer, std::int64_t block, PoisonKind kind) {
  std::int64_t& epoch = poisoned_[static_cast<std::size_t>(layer)][static_cast<std::size_t>(block)];
  const std::uint32_t bits = poison_bits(kind, block, epoch++);
  SlotStore& pool = pools_[static_cast<std::size_t>(layer)];
  for (std::int64_t s = 0; s < paging_.block_size; ++s) pool.poison_slot(0, block * paging_.block_size + s, bits);
}

// A block for new data: whatever it held leaves the token index.
std::optional<std::int64_t> PagedCache::take_block(int layer) {
  const std::optional<std::int64_t> block = blocks_[static_cast<std::size_t>(layer)].allocate(forget_evicted());
  if (block) forget_tokens(layer, *block);
  return block;
}

void PagedCache::release_block(int layer, std::int64_t block) {
  if (!blocks_[static_cast<std::size_t>(layer)].release(block)) return;
  forget_tokens(layer, block);
  if (config_.poison_blocks) poison_block(layer, block, PoisonKind::freed);
}

void PagedCache::forget_tokens(int layer, std::int64_t block) {
  auto& index = token_index_[static_cast<std::size_t>(layer)];
  auto& keys = token_keys_[static_cast<std::size_t>(layer)][static_cast<std::size_t>(block)];
  for (std::uint64_t key : keys) {
    const auto it = index.find(key);
    if (it != index.end() && it->second == block) index.erase(it);
  }
  keys.clear();
}

// Reuse "token": tokens from..to-1 of row b were written; each is the end of a run of its
// block's first tokens that a later row may copy.
void PagedCache::register_tokens(int b, std::int64_t from, std::int64_t to) {
  if (!paging_.prefix_cache || !paging_.token_reuse) return;
  const std::int64_t B = paging_.block_size;
  for (std::int64_t t = from; t < to; ++t) {
    const std::int64_t logical = t / B;
    const std::uint64_t previous = logical == 0 ? 0 : key_of_block(b, logical - 1);
    const Row& row = rows_[static_cast<std::size_t>(b)];
    const std::uint64_t key = block_key(previous, std::span(row.ids).subspan(static_cast<std::size_t>(logical * B),
                                                                             static_cast<std::size_t>(t % B + 1)),
                                        row.extras, logical == 0);
    for (int l = 0; l < config_.layers; ++l) {
      const auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
      const std::int64_t block = table[static_cast<std::size_t>(logical)];
      if (block >= 0 && token_index_[static_cast<std::size_t>(l)].emplace(key, block).second)
        token_keys_[static_cast<std::size_t>(l)][static_cast<std::size_t>(block)].push_back(key);
    }
  }
}

// Reuse "token": the longest run of the row's tokens from block `logical` on, at most `most`
// (fewer than a block), that some block holds as its first tokens in every layer, copied
// into a new block of the row: a partly matching block is copied, never shared (SPEC 8).
std::int64_t PagedCache::take_partial_hit(int b, std::int64_t logical, std::int64_t most) {
  const std::int64_t B = paging_.block_size;
  const std::uint64_t previous = logical == 0 ? 0 : key_of_block(b, logical - 1);
  const Row& row = rows_[static_cast<std::size_t>(b)];
  std::vector<std::int64_t> from;
  for (std::int64_t m = most; m > 0; --m) {
    const std::uint64_t key = block_key(
        previous, std::span(row.ids).subspan(static_cast<std::size_t>(logical * B), static_cast<std::size_t>(m)),
        row.extras, logical == 0);
    from.clear();
    for (int l = 0; l < config_.layers; ++l) {
      const auto& index = token_index_[static_cast<std::size_t>(l)];
      const auto it = index.find(key);
      if (it == index.end()) break;
      from.push_back(it->second);
    }
    if (static_cast<int>(from.size()) < config_.layers) continue;
    for (int l = 0; l < config_.layers; ++l) {
      const std::int64_t source = from[static_cast<std::size_t>(l)];
      blocks_[static_cast<std::size_t>(l)].retain(source);  // a cached source is not the block taken for the copy
      const std::optional<std::int64_t> block = take_block(l);
      if (!block) {  // no block to copy into: the tokens are computed instead (undo the layers done)
        release_block(l, source);
        for (int done = 0; done < l; ++done) {
          auto& table = tables_[static_cast<std::size_t>(done)][static_cast<std::size_t>(b)];
          release_block(done, table.back());
          table.pop_back();
        }
        return 0;
      }
      clear_block(l, *block);
      SlotStore& pool = pools_[static_cast<std::size_t>(l)];
      for (std::int64_t s = 0; s < m; ++s) pool.copy_slot(pool, 0, source * B + s, 0, *block * B + s);
      release_block(l, source);
      tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)].push_back(*block);
    }
    return m;
  }
  return 0;
}

void PagedCache::release_table(int layer, std::vector<std::int64_t>& table) {
  for (std::int64_t block : table)
    if (block >= 0) release_block(layer, block);
  table.clear();
}

void PagedCache::ensure_block(int layer, int b, std::int64_t logical) {
  auto& table = tables_[static_cast<std::size_t>(layer)][static_cast<std::size_t>(b)];
  if (static_cast<std::int64_t>(table.size()) <= logical) table.resize(static_cast<std::size_t>(logical) + 1, -1);
  std::int64_t& entry = table[static_cast<std::size_t>(logical)];
  if (entry >= 0) return make_writable(layer, b, logical);
  const std::optional<std::int64_t> block = take_block(layer);
  if (!block)
    throw CacheRefusal("pool_exhausted", "layer " + std::to_string(layer) + ": every one of the " +
                                             std::to_string(paging_.num_blocks) + " blocks is referenced");
  clear_block(layer, *block);
  entry = *block;
  const Row& row = rows_[static_cast<std::size_t>(b)];
  const bool will_be_full = (logical + 1) * paging_.block_size <= static_cast<std::int64_t>(row.ids.size());
  if (register_on_allocation() && will_be_full)
    blocks_[static_cast<std::size_t>(layer)].register_full(*block, key_of_block(b, logical));
}

void PagedCache::make_writable(int layer, int b, std::int64_t logical) {
  BlockPool& pool = blocks_[static_cast<std::size_t>(layer)];
  std::int64_t& entry = tables_[static_cast<std::size_t>(layer)][static_cast<std::size_t>(b)][static_cast<std::size_t>(logical)];
  if (!copy_before_write(pool.refcount(entry), pool.registered(entry))) return;
  const std::optional<std::int64_t> copy = take_block(layer);
  if (!copy)
    throw CacheRefusal("pool_exhausted", "layer " + std::to_string(layer) + ": no block left to copy block " +
                                             std::to_string(entry) + " before a write");
  SlotStore& store = pools_[static_cast<std::size_t>(layer)];
  for (std::int64_t s = 0; s < paging_.block_size; ++s)
    store.copy_slot(store, 0, entry * paging_.block_size + s, 0, *copy * paging_.block_size + s);
  release_block(layer, entry);
  entry = *copy;
}

void PagedCache::take_prefix_hit(int b, const Chunk& chunk) {
  const std::int64_t n = chunk.counts[static_cast<std::size_t>(b)];
  const std::int64_t B = paging_.block_size;
  std::int64_t blocks = 0;
  std::vector<std::vector<std::int64_t>> found(static_cast<std::size_t>(config_.layers));
  while ((blocks + 1) * B <= (n - 1) / B * B) {
    const std::uint64_t key = key_of_block(b, blocks);
    bool everywhere = true;
    for (int l = 0; l < config_.layers && everywhere; ++l) {
      const std::optional<std::int64_t> block = blocks_[static_cast<std::size_t>(l)].lookup(key);
      if (block)
        found[static_cast<std::size_t>(l)].push_back(*block);
      else
        everywhere = false;
    }
    if (!everywhere) break;
    ++blocks;
  }
  for (int l = 0; l < config_.layers; ++l) {
    auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
    for (std::int64_t i = 0; i < blocks; ++i) {
      const std::int64_t block = found[static_cast<std::size_t>(l)][static_cast<std::size_t>(i)];
      if (hit_takes_reference()) blocks_[static_cast<std::size_t>(l)].retain(block);
      table.push_back(block);
    }
  }
  std::int64_t hit = blocks * B;
  if (paging_.token_reuse && paging_.prefix_cache) hit += take_partial_hit(b, blocks, std::min(B - 1, n - 1 - hit));
  hits_[static_cast<std::size_t>(b)] = hit;
  lengths_[static_cast<std::size_t>(b)] = hit;
}

// Row by row, as a scheduler admits requests: a starting row takes its hit, then every row's
// new tokens get their blocks.
void PagedCache::schedule(const Chunk& chunk) {
  const int B = batch();
  for (int b = 0; b < B; ++b) {
    const std::int64_t n = chunk.counts[static_cast<std::size_t>(b)];
    if (n == 0) continue;
    Row& row = rows_[static_cast<std::size_t>(b)];
    const std::size_t pad = static_cast<std::size_t>(chunk.length - n);
    for (std::int64_t i = 0; i < n; ++i)
      row.ids.push_back(chunk.ids.empty() ? static_cast<std::uint64_t>(chunk.uids[b * chunk.length + pad + i])
                                          : chunk.ids[b * chunk.length + pad + i]);
    if (lengths_[static_cast<std::size_t>(b)] == 0 && row.ids.size() == static_cast<std::size_t>(n)) {
      if (!chunk.extras.empty()) row.extras = chunk.extras[static_cast<std::size_t>(b)];
      if (row.prompt == 0) row.prompt = n;  // a recompute keeps the prompt it had
      if (!resuming_) frozen_.freeze(b, chunk, rope_);
      take_prefix_hit(b, chunk);
      after_prefix_hit(b, hits_[static_cast<std::size_t>(b)]);
    }
    const auto end = static_cast<std::int64_t>(rows_[static_cast<std::size_t>(b)].ids.size());
    const std::int64_t first = lengths_[static_cast<std::size_t>(b)];
    if (end == first) continue;
    for (int l = 0; l < config_.layers; ++l)
      for (std::int64_t logical = first / paging_.block_size; logical * paging_.block_size < end; ++logical)
        ensure_block(l, b, logical);
  }
}

// The forward that writes token t of row b starts here (forwards of `forward` tokens from
// the row's length before the append; 0: one forward).
std::int64_t PagedCache::forward_first(int b, std::int64_t t, std::int64_t forward) const {
  const std::int64_t from = lengths_[static_cast<std::size_t>(b)];
  return forward > 0 ? from + (t - from) / forward * forward : from;
}

// Every new token's slot gets its metadata before any forward runs: the slot mapping.
void PagedCache::map_slots(const Chunk& chunk) {
  for (int b = 0; b < batch(); ++b) {
    const std::int64_t n = chunk.counts[static_cast<std::size_t>(b)];
    const auto end = static_cast<std::int64_t>(rows_[static_cast<std::size_t>(b)].ids.size());
    const std::int64_t start = end - n, pad = chunk.length - n;
    for (int l = 0; l < config_.layers; ++l) {
      const auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
      for (std::int64_t t = lengths_[static_cast<std::size_t>(b)]; t < end; ++t) {
        const std::int64_t slot = write_slot(table, t);
        if (slot < 0) continue;  // run_forward names it
        pools_[static_cast<std::size_t>(l)].meta(0, slot) = {chunk.uids[b * chunk.length + pad + t - start], t,
                                                             position_of(t, forward_first(b, t, chunk.forward), start)};
      }
    }
  }
}

void PagedCache::run_forward(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log, int b,
                             std::int64_t first, std::int64_t count) {
  const std::int64_t B = paging_.block_size, D = config_.head_dim, Hkv = config_.kv_heads;
  const std::int64_t n = chunk.counts[static_cast<std::size_t>(b)];
  const std::int64_t start = static_cast<std::int64_t>(rows_[static_cast<std::size_t>(b)].ids.size()) - n;
  const std::int64_t pad = chunk.length - n;
  scratch_.resize(static_cast<std::size_t>(D));
  for (int l = 0; l < config_.layers; ++l) {
    SlotStore& pool = pools_[static_cast<std::size_t>(l)];
    const auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
    for (std::int64_t t = first; t < first + count; ++t) {
      const std::int64_t chunk_pos = pad + t - start;
      const std::int64_t slot = write_slot(table, t);
      if (slot < 0)
        throw std::logic_error("layer " + std::to_string(l) + " row " + std::to_string(b) + ": no block for token " +
                               std::to_string(t));
      const std::size_t token = (static_cast<std::size_t>(b) * chunk.length + chunk_pos) * Hkv;
      const std::int64_t position = position_of(t, first, start);
      for (int g = 0; g < Hkv; ++g) {
        std::copy_n(chunk.k[l] + (token + g) * D, D, scratch_.data());
        rope_.rotate(scratch_.data(), position);
        pool.write_key(0, 0, g, slot, scratch_.data(), frozen_.key(l, b, g));
        pool.write_value(0, 0, g, slot, chunk.v[l] + (token + g) * D, frozen_.value(l, b, g));
      }
      pool.meta(0, slot) = {chunk.uids[b * chunk.length + chunk_pos], t, position};
    }
    if (out.empty()) continue;
    plans_.clear();
    for (std::int64_t t = first; t < first + count; ++t)
      plans_.push_back({pad + t - start, plan(l, t, first, first + count, start, start + n)});
    std::vector<SlotSource> sources;
    for (std::int64_t block : table)
      if (block >= 0) sources.push_back({&pool, 0, block * B, B});
    const auto& logits = sink_logits_[static_cast<std::size_t>(l)];
    const KernelShape shape{1,
                            config_.heads,
                            config_.kv_heads,
                            config_.head_dim,
                            config_.softmax_scale,
                            logits.empty() ? nullptr : &logits,
                            config_.temperature_floor,
                            config_.temperature_scale,
                            config_.temperature_layers.empty() ? nullptr : config_.temperature_layers.data() + l};
    const std::size_t per_row = static_cast<std::size_t>(b) * chunk.length * config_.heads * config_.head_dim;
    kernel_.attend(shape, rope_, {chunk.q[l]}, {out[l]}, per_row, plans_, sources, l == 0 ? log : nullptr, b);
  }
}

std::int64_t PagedCache::write_slot(const std::vector<std::int64_t>& table, std::int64_t t) const {
  const auto entry = static_cast<std::size_t>(t / paging_.block_size);
  if (entry >= table.size() || table[entry] < 0) return -1;
  return table[entry] * paging_.block_size + t % paging_.block_size;
}

void PagedCache::register_full_blocks(int b, std::int64_t from, std::int64_t to) {
  if (!paging_.prefix_cache || register_on_allocation()) return;
  for (std::int64_t t = from; t < to; ++t) {
    if ((t + 1) % paging_.block_size != 0) continue;
    const std::int64_t logical = t / paging_.block_size;
    const std::uint64_t key = key_of_block(b, logical);
    for (int l = 0; l < config_.layers; ++l) {
      const std::int64_t block = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)][static_cast<std::size_t>(logical)];
      if (block >= 0) blocks_[static_cast<std::size_t>(l)].register_full(block, key);
    }
  }
}

// The blocks holding no token the policy keeps: before a sliding window; between the sinks and
// a sink window (the sinks' blocks stay). A dense append frees only once it is done: its
// later forwards still see the window its first token saw.
void PagedCache::free_behind_window(int b, bool append_done) {
  const std::int64_t n = lengths_[static_cast<std::size_t>(b)], B = paging_.block_size;
  for (int l = 0; l < config_.layers; ++l) {
    const LayerPolicy& p = policy(l);
    std::int64_t from = 0, to = 0;  // blocks [from, to) are dead
    if (p.kind == LayerPolicy::Kind::sliding && (append_done || frees_between_forwards())) {
      to = first_live_block(n, p.window);
    } else if (p.kind == LayerPolicy::Kind::sink && n > 0 && (append_done || !p.dense_prefill)) {
      from = (p.sinks + B - 1) / B;
      to = (p.sinks + sink_evicted(p.window, p.evict, n - 1)) / B;  // tokens S .. S + E(n - 1) - 1 are evicted
    } else if (p.kind == LayerPolicy::Kind::chunked && n > 0 && (append_done || frees_between_forwards())) {
      to = (n - 1) / p.window * p.window / B;  // blocks wholly before the last token's chunk
    }
    auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
    to = std::min<std::int64_t>(to, static_cast<std::int64_t>(table.size()));
    for (std::int64_t i = from; i < to; ++i)
      if (table[static_cast<std::size_t>(i)] >= 0) {
        release_block(l, table[static_cast<std::size_t>(i)]);
        table[static_cast<std::size_t>(i)] = -1;
      }
  }
}

void PagedCache::append(const Chunk& chunk, const std::vector<float*>& out, AttentionLog* log) {
  std::fill(hits_.begin(), hits_.end(), 0);
  std::vector<std::int64_t> longest(lengths_.size());
  for (std::size_t b = 0; b < lengths_.size(); ++b) longest[b] = lengths_[b];
  cover_chunk(rope_, longest, chunk);
  schedule(chunk);
  map_slots(chunk);
  // Forward j of every row, then forward j + 1: rows are independent, and the state
  // between two forwards is one an engine's scheduler would see.
  for (bool more = true; more;) {
    more = false;
    for (int b = 0; b < batch(); ++b) {
      const std::int64_t first = lengths_[static_cast<std::size_t>(b)];
      const auto end = static_cast<std::int64_t>(rows_[static_cast<std::size_t>(b)].ids.size());
      if (first == end) continue;
      const std::int64_t count = chunk.forward > 0 ? std::min(chunk.forward, end - first) : end - first;
      run_forward(chunk, out, log, b, first, count);
      lengths_[static_cast<std::size_t>(b)] = first + count;
      register_full_blocks(b, first, first + count);
      register_tokens(b, first, first + count);
      free_behind_window(b, first + count == end);
      more |= first + count < end;
    }
    if (more && chunk.between_forwards) chunk.between_forwards();
  }
}

void PagedCache::reorder(const std::vector<int>& rows) {
  for (int l = 0; l < config_.layers; ++l) {
    auto& old = tables_[static_cast<std::size_t>(l)];
    std::vector<std::vector<std::int64_t>> next;
    for (std::size_t b = 0; b < rows.size(); ++b) {
      // Row b's new table starts as what row b held (empty for a new row), then takes its source's.
      next.push_back(b < old.size() ? old[b] : std::vector<std::int64_t>{});
      move_table(next.back(), old[static_cast<std::size_t>(rows[b])]);
      for (std::int64_t block : next.back())
        if (block >= 0) blocks_[static_cast<std::size_t>(l)].retain(block);
    }
    for (auto& table : old) release_table(l, table);
    old = std::move(next);
  }
  lengths_ = gather(lengths_, rows);
  rows_ = gather(rows_, rows);
  frozen_.gather(rows);
  hits_.assign(rows.size(), 0);
}

void PagedCache::reset(int batch) {
  for (int l = 0; l < config_.layers; ++l) {
    for (auto& table : tables_[static_cast<std::size_t>(l)]) release_table(l, table);
    tables_[static_cast<std::size_t>(l)].assign(static_cast<std::size_t>(batch), {});
  }
  lengths_.assign(static_cast<std::size_t>(batch), 0);
  rows_.assign(static_cast<std::size_t>(batch), Row{});
  hits_.assign(static_cast<std::size_t>(batch), 0);
  frozen_.reset(batch);
}

void PagedCache::free_rows(const std::vector<int>& rows) {
  // (a freed row's Row{} forgets its prompt: it starts again)
  for (int b : rows) {
    for (int l = 0; l < config_.layers; ++l)
      release_table(l, tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)]);
    lengths_[static_cast<std::size_t>(b)] = 0;
    rows_[static_cast<std::size_t>(b)] = Row{};
  }
}

void PagedCache::evict(std::int64_t count) {
  for (int l = 0; l < config_.layers; ++l)
    for (std::int64_t block : blocks_[static_cast<std::size_t>(l)].evict(count, forget_evicted())) {
      forget_tokens(l, block);
      if (config_.poison_blocks) poison_block(l, block, PoisonKind::freed);
    }
}

// The cropped row's last token needs the window that ends at it, in every sliding or sink
// layer. Paging changes no refusal (SPEC 8): the rule is the policy's, though a block freed
// whole may still hold an evicted token.
void PagedCache::check_crop(std::int64_t length) const {
  for (int l = 0; l < config_.layers; ++l) {
    const LayerPolicy& p = policy(l);
    if (p.kind == LayerPolicy::Kind::full) continue;
    for (int b = 0; b < batch(); ++b) {
      const std::int64_t n = lengths_[static_cast<std::size_t>(b)];
      if (n <= length || length == 0) continue;
      // The window tokens the cropped row's last token sees start at `needed`; those below
      // `kept` were evicted (a sliding window is a sink window without sinks, evicting 1).
      std::int64_t needed = std::max<std::int64_t>(0, length - p.window), kept = std::max<std::int64_t>(0, n - p.window);
      if (p.kind == LayerPolicy::Kind::sink) {
        needed = p.sinks + sink_evicted(p.window, p.evict, length - 1);
        kept = std::min(length, p.sinks + sink_evicted(p.window, p.evict, n - 1));
      }
      if (p.kind == LayerPolicy::Kind::chunked) {  // the chunk of the last token, cropped or held
        needed = (length - 1) / p.window * p.window;
        kept = (n - 1) / p.window * p.window;
      }
      if (needed < kept)
        throw CacheRefusal("crop_evicted", "crop to " + std::to_string(length) + " tokens needs token " +
                                               std::to_string(needed) + " of row " + std::to_string(b) +
                                               ", which this cache has evicted");
    }
  }
}

void PagedCache::crop(std::int64_t length) {
  check_crop(length);
  for (int b = 0; b < batch(); ++b)
    if (lengths_[static_cast<std::size_t>(b)] > length) cut_row(b, length);
}

// Row b keeps its first `length` tokens.
void PagedCache::cut_row(int b, std::int64_t length) {
  const std::int64_t B = paging_.block_size;
  for (int l = 0; l < config_.layers; ++l) {
    auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
    const std::size_t keep = static_cast<std::size_t>((length + B - 1) / B);
    for (std::size_t i = keep; i < table.size(); ++i)
      if (table[i] >= 0) release_block(l, table[i]);
    if (table.size() > keep) table.resize(keep);
    if (length % B != 0 && table[keep - 1] >= 0) {  // the block the row ends in loses its tail
      BlockPool& pool = blocks_[static_cast<std::size_t>(l)];
      if (pool.refcount(table[keep - 1]) == 1) pool.unregister(table[keep - 1]);  // no longer full: not reusable
      make_writable(l, b, static_cast<std::int64_t>(keep) - 1);
      SlotStore& store = pools_[static_cast<std::size_t>(l)];
      const std::int64_t block = table[keep - 1];
      forget_tokens(l, block);  // its runs past the cut are gone (the others could stay: fewer hits, never wrong)
      const std::uint32_t bits = config_.poison_blocks
                                     ? poison_bits(PoisonKind::freed, block,
                                                   poisoned_[static_cast<std::size_t>(l)][static_cast<std::size_t>(block)]++)
                                     : 0;
      for (std::int64_t s = length % B; s < B; ++s)
        if (config_.poison_blocks)
          store.poison_slot(0, block * B + s, bits);
        else
          store.clear_slot(0, block * B + s);
    }
  }
  Row& row = rows_[static_cast<std::size_t>(b)];
  row.ids.resize(static_cast<std::size_t>(length));
  if (static_cast<std::int64_t>(row.keys.size()) > length / B) row.keys.resize(static_cast<std::size_t>(length / B));
  lengths_[static_cast<std::size_t>(b)] = length;
}

// Swap: each layer's blocks are copied out and released; recompute: released, the row
// forgets its tokens (it keeps its extras, which its recomputed prompt needs).
void PagedCache::preempt(const std::vector<int>& rows, bool recompute) {
  const std::int64_t B = paging_.block_size;
  for (int b : rows) {
    Row& row = rows_[static_cast<std::size_t>(b)];
    row.swapped.clear();
    for (int l = 0; l < config_.layers && !recompute; ++l) {
      auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
      SlotStore& pool = pools_[static_cast<std::size_t>(l)];
      Swapped& out = row.swapped.emplace_back();
      out.slots = SlotStore(config_.kv_heads, config_.head_dim, pool.formats());
      out.slots.reset(1, static_cast<std::int64_t>(table.size()) * B);
      for (std::size_t i = 0; i < table.size(); ++i) {
        out.present.push_back(table[i] >= 0);
        if (table[i] >= 0)
          for (std::int64_t s = 0; s < B; ++s)
            out.slots.copy_slot(pool, 0, table[i] * B + s, 0, static_cast<std::int64_t>(i) * B + s);
      }
    }
    for (int l = 0; l < config_.layers; ++l) release_table(l, tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)]);
    if (recompute) {
      Row kept;
      kept.extras = row.extras;
      kept.prompt = row.prompt;
      row = std::move(kept);
      lengths_[static_cast<std::size_t>(b)] = 0;
    }
  }
}

void PagedCache::resume(const std::vector<int>& rows, const Chunk* history) {
  const std::int64_t B = paging_.block_size;
  std::vector<std::pair<int, std::int64_t>> prompts;  // recomputed rows and their prompts
  for (int b : rows) {
    Row& row = rows_[static_cast<std::size_t>(b)];
    if (row.swapped.empty()) {
      prompts.emplace_back(b, row.prompt);
      continue;
    }
    for (int l = 0; l < config_.layers; ++l) {  // swapped in, into whichever blocks are free
      Swapped& in = row.swapped[static_cast<std::size_t>(l)];
      auto& table = tables_[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)];
      SlotStore& pool = pools_[static_cast<std::size_t>(l)];
      table.assign(in.present.size(), -1);
      for (std::size_t i = 0; i < in.present.size(); ++i) {
        if (!in.present[i]) continue;
        const std::optional<std::int64_t> block = take_block(l);
        if (!block) throw CacheRefusal("pool_exhausted", "no block left to swap row " + std::to_string(b) + " in");
        for (std::int64_t s = 0; s < B; ++s)
          pool.copy_slot(in.slots, 0, static_cast<std::int64_t>(i) * B + s, 0, *block * B + s);
        table[i] = *block;
      }
    }
    row.swapped.clear();
  }
  if (prompts.empty()) return;
  if (history == nullptr) throw std::logic_error("resume after a recompute needs the rows' history");
  resuming_ = true;
  try {
    append(*history, {}, nullptr);
  } catch (...) {
    resuming_ = false;
    throw;
  }
  resuming_ = false;
  for (const auto& [b, prompt] : prompts) {
    Row& row = rows_[static_cast<std::size_t>(b)];
    row.prompt = prompt;
    const std::int64_t keep = recomputed_tokens(lengths_[static_cast<std::size_t>(b)], prompt);
    if (keep < lengths_[static_cast<std::size_t>(b)]) cut_row(b, keep);
  }
}

const PagedState* PagedCache::paged() const {
  state_.block_size = paging_.block_size;
  state_.layers.resize(static_cast<std::size_t>(config_.layers));
  for (int l = 0; l < config_.layers; ++l) {
    PagedState::Layer& layer = state_.layers[static_cast<std::size_t>(l)];
    layer.pool = &pools_[static_cast<std::size_t>(l)];
    layer.tables = tables_[static_cast<std::size_t>(l)];
    layer.refcounts = blocks_[static_cast<std::size_t>(l)].refcounts();
  }
  state_.hit_tokens = hits_;
  return &state_;
}

}  // namespace kvcheck::optimized
