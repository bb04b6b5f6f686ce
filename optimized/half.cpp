#include "optimized/half.h"

#include <bit>
#include <cstring>

namespace kvcheck::optimized {

std::uint16_t to_bfloat16(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // to nearest, ties to even
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

float from_bfloat16(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

std::uint16_t to_float16(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a float16 subnormal (or zero)
    // The value in units of 2^-24, rounded to nearest even.
    const float scaled = std::bit_cast<float>(magnitude) * 16777216.0f;  // exact: a power of two
    const auto whole = static_cast<std::uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(whole);
    const std::uint32_t rounded = whole + ((rest > 0.5f || (rest == 0.5f && (whole & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | rounded);
  }
  // Normal: rebias the exponent (127 -> 15), keep 10 mantissa bits, round to nearest even.
  const std::uint32_t rebased = magnitude - (112u << 23);
  const std::uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rebased + rounding) >> 13));
}

float from_float16(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(value));
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

void encode(Storage s, const float* x, int n, void* out) {
  switch (s) {
    case Storage::float32:
      std::memcpy(out, x, static_cast<std::size_t>(n) * sizeof(float));
      return;
    case Storage::float16:
      for (int i = 0; i < n; ++i) static_cast<std::uint16_t*>(out)[i] = to_float16(x[i]);
      return;
    case Storage::bfloat16:
      for (int i = 0; i < n; ++i) static_cast<std::uint16_t*>(out)[i] = to_bfloat16(x[i]);
      return;
  }
}

void decode(Storage s, const void* in, int n, float* x) {
  switch (s) {
    case Storage::float32:
      std::memcpy(x, in, static_cast<std::size_t>(n) * sizeof(float));
      return;
    case Storage::float16:
      for (int i = 0; i < n; ++i) x[i] = from_float16(static_cast<const std::uint16_t*>(in)[i]);
      return;
    case Storage::bfloat16:
      for (int i = 0; i < n; ++i) x[i] = from_bfloat16(static_cast<const std::uint16_t*>(in)[i]);
      return;
  }
}

}  // namespace kvcheck::optimized
