#include "reference/prefix_reuse.h"

namespace kvcheck::reference {

void PrefixBlocks::written(const std::vector<std::uint64_t>& contexts, std::int64_t first) {
  const std::set<std::uint64_t> full = full_blocks(contexts, first);
  pending_.insert(full.begin(), full.end());
}

void PrefixBlocks::end_step() {
  hittable_.insert(pending_.begin(), pending_.end());
  pending_.clear();
}

void PrefixBlocks::keep_only(const std::vector<std::vector<std::uint64_t>>& rows) {
  std::set<std::uint64_t> kept;
  for (const auto& row : rows)
    for (std::size_t t = static_cast<std::size_t>(unit_) - 1; t < row.size(); t += static_cast<std::size_t>(unit_))
      if (hittable_.count(row[t])) kept.insert(row[t]);
  hittable_ = std::move(kept);
}

std::set<std::uint64_t> PrefixBlocks::full_blocks(const std::vector<std::uint64_t>& contexts, std::int64_t first) const {
  std::set<std::uint64_t> out;
  for (std::size_t i = 0; i < contexts.size(); ++i)
    if ((first + static_cast<std::int64_t>(i) + 1) % unit_ == 0) out.insert(contexts[i]);
  return out;
}

std::int64_t PrefixBlocks::largest_hit(const std::vector<std::uint64_t>& prompt, const std::set<std::uint64_t>& also) const {
  const auto n = static_cast<std::int64_t>(prompt.size());
  if (n == 0) return 0;
  const std::int64_t cap = (n - 1) / unit_ * unit_;
  std::int64_t hit = 0;
  auto known = [&](std::uint64_t key) { return hittable_.count(key) > 0 || also.count(key) > 0; };
  while (hit + unit_ <= cap && known(prompt[static_cast<std::size_t>(hit + unit_ - 1)])) hit += unit_;
  return hit;
}

}  // namespace kvcheck::reference
