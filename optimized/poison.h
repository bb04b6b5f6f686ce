// Poisoned payloads (SPEC 8.8.5): with CacheConfig::poison_blocks a paged cache fills each
// block it allocates, and each block it frees, with NaNs that say which block and why, so a
// read of a slot no token was written to shows in the outputs, even with no attention log
// (a trace). In float32 storage the NaN's bits carry the mark; float16 and bfloat16 rows
// hold a plain NaN, quantized rows a NaN scale (rows under a static scale cannot be poisoned).
//
//   bits = 0x7FC00000 (a quiet NaN) | kind << 20 | (epoch mod 64) << 14 | (block mod 16384)
//
// kind 2: allocated, not yet written; 3: freed. The NaN arithmetic makes (0x7FC00000)
// has kind 0, so it is never read as a mark. A Python cache may poison its pools the same way.
#pragma once

#include <bit>
#include <cstdint>
#include <optional>

namespace kvcheck::optimized {

enum class PoisonKind : std::uint32_t { never_written = 2, freed = 3 };

struct PoisonMark {
  PoisonKind kind;
  std::int64_t block;  // mod 16384
  std::int64_t epoch;  // mod 64: how many times the block was poisoned before
};

inline std::uint32_t poison_bits(PoisonKind kind, std::int64_t block, std::int64_t epoch) {
  return 0x7FC00000u | static_cast<std::uint32_t>(kind) << 20 | static_cast<std::uint32_t>(epoch & 0x3F) << 14 |
         static_cast<std::uint32_t>(block & 0x3FFF);
}

inline std::optional<PoisonMark> read_poison(float x) {
  const auto bits = std::bit_cast<std::uint32_t>(x) & 0x7FFFFFFFu;  // either sign
  if ((bits & 0x7FC00000u) != 0x7FC00000u) return std::nullopt;
  const std::uint32_t kind = (bits >> 20) & 3u;
  if (kind < 2) return std::nullopt;
  return PoisonMark{static_cast<PoisonKind>(kind), bits & 0x3FFF, (bits >> 14) & 0x3F};
}

}  // namespace kvcheck::optimized
