// float32 <-> float16 / bfloat16 conversions for half-precision cache storage, portable
// (no F16C needed) and exact: rounding to nearest, ties to even, as hardware does.
#pragma once

#include <cstdint>

namespace kvcheck::optimized {

enum class Storage { float32, float16, bfloat16 };

std::uint16_t to_float16(float x);
float from_float16(std::uint16_t h);
std::uint16_t to_bfloat16(float x);
float from_bfloat16(std::uint16_t h);

// n floats into storage `s` (2 or 4 bytes each), and back.
void encode(Storage s, const float* x, int n, void* out);
void decode(Storage s, const void* in, int n, float* x);

inline int element_bytes(Storage s) { return s == Storage::float32 ? 4 : 2; }

}  // namespace kvcheck::optimized
