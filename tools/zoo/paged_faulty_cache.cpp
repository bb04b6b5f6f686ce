#include "tools/zoo/paged_faulty_cache.h"

#include <algorithm>
#include <cstring>

#include "optimized/half.h"
#include "optimized/paged_cache.h"

namespace kvcheck::zoo {

namespace {

using optimized::RowExtras;

class FaultyPagedCache : public optimized::PagedCache {
 public:
  FaultyPagedCache(const optimized::CacheConfig& config, PagedFault fault)
      : PagedCache(config), fault_(fault), layers_(config.layers) {}

 protected:
  std::uint64_t block_key(std::uint64_t previous, std::span<const std::uint64_t> ids, const RowExtras& extras,
                          bool first) const override {
    if (fault_ == PagedFault::key_without_extras) return PagedCache::block_key(previous, ids, RowExtras{}, first);
    if (fault_ == PagedFault::key_extras_untagged)  // "X" as an adapter or as a salt: the same bytes
      return PagedCache::block_key(previous, ids, RowExtras{extras.adapter + extras.salt, ""}, first);
    return PagedCache::block_key(previous, ids, extras, first);
  }
  bool register_on_allocation() const override { return fault_ == PagedFault::register_before_write; }
  bool copy_before_write(std::int32_t refcount, bool registered) const override {
    return fault_ == PagedFault::share_partial_no_cow ? registered
                                                      : PagedCache::copy_before_write(refcount, registered);
  }
  bool hit_takes_reference() const override { return fault_ != PagedFault::hit_without_reference; }
  void move_table(std::vector<std::int64_t>& to, const std::vector<std::int64_t>& from) const override {
    if (fault_ != PagedFault::move_row_stale_tail) return PagedCache::move_table(to, from);
    if (to.size() < from.size()) to.resize(from.size(), -1);
    std::copy(from.begin(), from.end(), to.begin());  // the entries past from's end stay
  }
  std::int64_t first_live_block(std::int64_t n, std::int64_t window) const override {
    if (fault_ != PagedFault::window_free_early) return PagedCache::first_live_block(n, window);
    return std::max<std::int64_t>(0, n - window + 1) / block_size() + 1;  // SPEC 8.5's bound, one block more
  }
  std::int64_t window_begin(std::int64_t t, std::int64_t window, std::int64_t forward_first,
                            std::int64_t append_first) const override {
    const std::int64_t begin = PagedCache::window_begin(t, window, forward_first, append_first);
    const bool later_chunk = forward_first > append_first;  // decodes and first chunks are right
    return fault_ == PagedFault::chunk_keys_chunk_only && later_chunk ? std::max(begin, forward_first) : begin;
  }
  // The key length of the whole append with a bottom-right causal mask: a query of an early
  // chunk sees as many keys past its own as the later chunks hold, mapped but not yet written.
  std::int64_t keys_ahead(std::int64_t t, std::int64_t forward_end, std::int64_t append_end) const override {
    (void)t;
    return fault_ == PagedFault::chunk_keys_to_append_end ? append_end - forward_end : 0;
  }
  std::int64_t position_of(std::int64_t t, std::int64_t forward_first, std::int64_t append_first) const override {
    return fault_ == PagedFault::chunk_position_restart ? t - (forward_first - append_first) : t;
  }
  std::int64_t write_slot(const std::vector<std::int64_t>& table, std::int64_t t) const override {
    if (fault_ != PagedFault::window_absolute_index) return PagedCache::write_slot(table, t);
    // The sliding layer's compact table holds the entries from the first live one on,
    // right-padded with block 0; the mutant indexes it with the absolute t / B.
    const auto live = static_cast<std::size_t>(
        std::find_if(table.begin(), table.end(), [](std::int64_t block) { return block >= 0; }) - table.begin());
    const std::size_t i = static_cast<std::size_t>(t / block_size()) + live;  // compact[t / B] is table[t / B + live]
    const std::int64_t block = i < table.size() && table[i] >= 0 ? table[i] : 0;
    return block * block_size() + t % block_size();
  }
  bool frees_between_forwards() const override { return fault_ != PagedFault::window_kept_in_prefill; }
  bool forget_evicted() const override { return fault_ != PagedFault::evict_keeps_index; }
  std::int64_t recomputed_tokens(std::int64_t history, std::int64_t prompt) const override {
    return fault_ == PagedFault::recompute_prompt_only ? prompt : history;
  }
  // The hit's rows keep their codes, but their scale becomes the reader's frozen one: one
  // scale per request, looked up for every block the request reads.
  void after_prefix_hit(int b, std::int64_t hit) override {
    if (fault_ != PagedFault::hit_reads_own_scale) return;
    const optimized::FrozenScales& scales = frozen_scales();
    for (int l = 0; l < layers_; ++l) {
      optimized::SlotStore& p = pool(l);
      const auto& entries = table(l, b);
      for (std::int64_t t = 0; t < hit; ++t) {
        const std::int64_t slot = entries[static_cast<std::size_t>(t / block_size())] * block_size() + t % block_size();
        for (int g = 0; g < p.kv_heads(); ++g) {
          stamp(p.key_format(0), const_cast<void*>(p.key(0, 0, g, slot)), scales.key(l, b, g));
          stamp(p.value_format(0), const_cast<void*>(p.value(0, 0, g, slot)), scales.value(l, b, g));
        }
      }
    }
  }

 private:
  // A frozen row's scale is its first bytes (row_codec.h: one group, [scale][codes]).
  static void stamp(const optimized::RowFormat& format, void* row, float scale) {
    if (format.frozen == optimized::RowFormat::Frozen::no) return;
    if (format.scale_half) {
      const std::uint16_t h = optimized::to_float16(scale);
      std::memcpy(row, &h, sizeof h);
    } else {
      std::memcpy(row, &scale, sizeof scale);
    }
  }
  PagedFault fault_;
  int layers_;
};

}  // namespace

std::unique_ptr<optimized::KvCache> make_paged_faulty_cache(const optimized::CacheConfig& config, PagedFault fault) {
  return std::make_unique<FaultyPagedCache>(config, fault);
}

}  // namespace kvcheck::zoo
