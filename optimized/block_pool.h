// The bookkeeping of a paged cache's pool (SPEC 8): which blocks are free, which are
// referenced (and how often), which hold a full block of tokens that a later row with the
// same prefix may reuse, and which of those to evict first. It knows nothing of keys or
// values; the paged cache stores them by block id.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <vector>

namespace kvcheck::optimized {

class BlockPool {
 public:
  BlockPool() = default;
  // `prefix_cache`: a block whose last reference goes keeps its index entry (cached) until
  // evicted or reused; without it the block is free at once.
  BlockPool(std::int64_t blocks, bool prefix_cache);

  // A block for new data, refcount 1: a free block, else the least recently used cached
  // one, whose index entry is dropped first (`forget` false leaves it: only a zoo mutant
  // asks). nullopt when every block is referenced.
  std::optional<std::int64_t> allocate(bool forget = true);
  // One more reference (a fork, a prefix hit); a cached block leaves the eviction list.
  void retain(std::int64_t block);
  // One reference fewer; at zero the block is cached (registered, with a prefix cache) or
  // free. True when it became free.
  bool release(std::int64_t block);
  // A full block enters the prefix index under `key` (a block already there keeps it).
  void register_full(std::int64_t block, std::uint64_t key);
  // The registered block for `key`, or nullopt.
  std::optional<std::int64_t> lookup(std::uint64_t key) const;
  // Drops a block's index entry (a block a crop cuts is no longer full).
  void unregister(std::int64_t block);
  // Drops `count` cached blocks (every one when count < 0), least recently used first:
  // their index entries go, they become free. Returns them.
  std::vector<std::int64_t> evict(std::int64_t count, bool forget = true);

  std::int32_t refcount(std::int64_t block) const { return refcount_[static_cast<std::size_t>(block)]; }
  const std::vector<std::int32_t>& refcounts() const { return refcount_; }
  std::int64_t size() const { return static_cast<std::int64_t>(refcount_.size()); }
  bool registered(std::int64_t block) const { return key_[static_cast<std::size_t>(block)].has_value(); }
  // Blocks neither referenced nor cached.
  std::int64_t free_count() const { return static_cast<std::int64_t>(free_.size()); }

 private:
  void make_free(std::int64_t block);

  std::vector<std::int32_t> refcount_;
  std::vector<std::optional<std::uint64_t>> key_;           // index key of a registered block
  std::map<std::uint64_t, std::int64_t> index_;             // key -> block
  std::vector<std::int64_t> free_;                          // a stack: the lowest id on top
  std::list<std::int64_t> cached_;                          // refcount 0 and registered, oldest first
  std::vector<std::list<std::int64_t>::iterator> cached_at_;
  std::vector<bool> is_cached_;
  bool prefix_cache_ = false;
};

}  // namespace kvcheck::optimized
