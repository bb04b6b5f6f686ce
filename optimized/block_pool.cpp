#include "optimized/block_pool.h"

#include <stdexcept>
#include <string>

namespace kvcheck::optimized {

BlockPool::BlockPool(std::int64_t blocks, bool prefix_cache)
    : refcount_(static_cast<std::size_t>(blocks), 0),
      key_(static_cast<std::size_t>(blocks)),
      cached_at_(static_cast<std::size_t>(blocks)),
      is_cached_(static_cast<std::size_t>(blocks), false),
      prefix_cache_(prefix_cache) {
  for (std::int64_t b = blocks - 1; b >= 0; --b) free_.push_back(b);
}

std::optional<std::int64_t> BlockPool::allocate(bool forget) {
  std::int64_t block;
  if (!free_.empty()) {
    block = free_.back();
    free_.pop_back();
  } else if (!cached_.empty()) {
    block = cached_.front();
    cached_.pop_front();
    is_cached_[static_cast<std::size_t>(block)] = false;
    if (forget) unregister(block);
  } else {
    return std::nullopt;
  }
  refcount_[static_cast<std::size_t>(block)] = 1;
  return block;
}

void BlockPool::retain(std::int64_t block) {
  const auto i = static_cast<std::size_t>(block);
  if (is_cached_[i]) {
    cached_.erase(cached_at_[i]);
    is_cached_[i] = false;
  }
  ++refcount_[i];
}

bool BlockPool::release(std::int64_t block) {
  const auto i = static_cast<std::size_t>(block);
  if (refcount_[i] <= 0) throw std::logic_error("block " + std::to_string(block) + " released with no reference");
  if (--refcount_[i] > 0) return false;
  if (prefix_cache_ && key_[i]) {
    cached_at_[i] = cached_.insert(cached_.end(), block);
    is_cached_[i] = true;
    return false;
  }
  make_free(block);
  return true;
}

void BlockPool::register_full(std::int64_t block, std::uint64_t key) {
  if (!prefix_cache_ || index_.count(key)) return;
  index_[key] = block;
  key_[static_cast<std::size_t>(block)] = key;
}

std::optional<std::int64_t> BlockPool::lookup(std::uint64_t key) const {
  const auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::int64_t> BlockPool::evict(std::int64_t count, bool forget) {
  std::vector<std::int64_t> evicted;
  while (!cached_.empty() && count != 0) {
    const std::int64_t block = cached_.front();
    cached_.pop_front();
    is_cached_[static_cast<std::size_t>(block)] = false;
    if (forget) unregister(block);
    free_.push_back(block);
    evicted.push_back(block);
    if (count > 0) --count;
  }
  return evicted;
}

void BlockPool::unregister(std::int64_t block) {
  auto& key = key_[static_cast<std::size_t>(block)];
  if (!key) return;
  const auto it = index_.find(*key);
  if (it != index_.end() && it->second == block) index_.erase(it);
  key.reset();
}

void BlockPool::make_free(std::int64_t block) {
  unregister(block);
  free_.push_back(block);
}

}  // namespace kvcheck::optimized
