// SPEC 8.4: the largest prefix hit a correct paged cache may report. A full block is named
// by the context key of its last token, which chains every earlier token id and the row's
// extras: two blocks with equal names hold equal keys and values at every slot. Under
// reuse "token" (SGLang's radix tree) the unit of reuse is one token, named by its own
// context key, and the cap is n - 1.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

namespace kvcheck::reference {

class PrefixBlocks {
 public:
  PrefixBlocks(std::int64_t block_size, bool token_reuse) : unit_(token_reuse ? 1 : block_size) {}

  // A row's tokens from index `first` on were written in the current step, `contexts` their
  // context keys. Their full blocks can be hit from the next step on (a block is hit only
  // after all its slots were written).
  void written(const std::vector<std::uint64_t>& contexts, std::int64_t first);
  void end_step();
  // `evict all`: only blocks that a row still holds stay (an upper bound for the others).
  void keep_only(const std::vector<std::vector<std::uint64_t>>& rows);

  // The longest run of leading blocks (tokens, under reuse "token") of `prompt`, a starting
  // row's context keys, that a cache may hold, in tokens, capped at floor((n - 1) / B) * B
  // (n - 1): the last token is computed.
  std::int64_t largest_hit(const std::vector<std::uint64_t>& prompt) const { return largest_hit(prompt, {}); }
  // The same with the blocks named in `also` hittable too (blocks other rows write in the
  // same step: a hit on them reads a block before its write).
  std::int64_t largest_hit(const std::vector<std::uint64_t>& prompt, const std::set<std::uint64_t>& also) const;
  // The names of the full blocks (every token, under reuse "token") among a row's tokens
  // from index `first` on.
  std::set<std::uint64_t> full_blocks(const std::vector<std::uint64_t>& contexts, std::int64_t first) const;

 private:
  std::int64_t unit_;  // tokens per unit of reuse: B, or 1
  std::set<std::uint64_t> hittable_, pending_;
};

}  // namespace kvcheck::reference
