#include "optimized/row_codec.h"

#include <algorithm>
#include <bit>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace kvcheck::optimized {

namespace {

bool affine(Codec c) { return c == Codec::int4 || c == Codec::int2; }
bool fp8(Codec c) { return c == Codec::fp8_e4m3 || c == Codec::fp8_e5m2; }

int code_bits(Codec c) {
  switch (c) {
    case Codec::q4_0:
    case Codec::int4:
    case Codec::int4_even:
      return 4;
    case Codec::int2:
      return 2;
    default:
      return 8;
  }
}

int group_of(const RowFormat& f, int d) {
  if (f.codec == Codec::q8_0 || f.codec == Codec::q4_0) return 32;
  if (f.along_tokens) return 1;
  return f.group > 0 ? f.group : d;
}

bool stores_scale(const RowFormat& f) { return f.static_scales.empty(); }
// ggml's blocks always keep a float16 scale.
bool half_scale(const RowFormat& f) { return f.scale_half || f.codec == Codec::q8_0 || f.codec == Codec::q4_0; }
std::size_t scale_bytes(const RowFormat& f) { return stores_scale(f) ? (half_scale(f) ? 2 : 4) : 0; }

std::size_t group_bytes(const RowFormat& f, int g) {
  return scale_bytes(f) + (affine(f.codec) ? 4 : 0) + (static_cast<std::size_t>(g) * code_bits(f.codec) + 7) / 8;
}

// fp8 (OCP E4M3FN and E5M2): round to nearest, ties to even, saturating at the largest
// finite value. The code's low bits are the mantissa, so an even q is an even code.
struct Fp8 {
  int mantissa_bits, bias, top;  // top: the largest finite positive code
};
constexpr Fp8 kE4m3{3, 7, 0x7E}, kE5m2{2, 15, 0x7B};

std::uint8_t fp8_encode(const Fp8& f, float y) {
  const std::uint8_t sign = std::signbit(y) ? 0x80 : 0;
  const float a = std::abs(y);
  const float min_normal = std::ldexp(1.0f, 1 - f.bias);
  int code = 0;
  if (!(a < std::ldexp(1.0f, 20))) {  // huge or NaN: saturate
    code = f.top;
  } else if (a < min_normal) {  // subnormal: steps of 2^(1 - bias - m)
    code = static_cast<int>(std::nearbyint(std::ldexp(a, f.bias - 1 + f.mantissa_bits)));
  } else {
    int e = 0;
    std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): the exponent is e - 1
    const float q = std::nearbyint(std::ldexp(a, f.mantissa_bits - (e - 1)));  // in [2^m, 2^(m+1)]
    code = ((e - 1 + f.bias) << f.mantissa_bits) + static_cast<int>(q) - (1 << f.mantissa_bits);
  }
  return static_cast<std::uint8_t>(sign | std::min(code, f.top));
}

const Fp8& fp8_of(Codec c) { return c == Codec::fp8_e4m3 ? kE4m3 : kE5m2; }

float code_range(Codec c) {
  switch (c) {
    case Codec::fp8_e4m3:
      return 448.0f;
    case Codec::fp8_e5m2:
      return 57344.0f;
    case Codec::int4_even:
      return 7.0f;
    default:
      return 127.0f;
  }
}

// The normalized fast Walsh-Hadamard transform, in place (n a power of two).
void walsh_hadamard(float* x, int n) {
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

// walsh_hadamard on each `block`-wide block of x (0: one block of n).
void walsh_hadamard_blocks(float* x, int n, int block) {
  const int width = block > 0 ? block : n;
  for (int at = 0; at + width <= n; at += width) walsh_hadamard(x + at, width);
}

float as_stored(bool half, float s) { return half ? from_float16(to_float16(s)) : s; }

void put_scale(const RowFormat& f, float s, std::byte*& p) {
  if (!stores_scale(f)) return;
  if (half_scale(f)) {
    const std::uint16_t h = to_float16(s);
    std::memcpy(p, &h, 2);
  } else {
    std::memcpy(p, &s, 4);
  }
  p += scale_bytes(f);
}

float get_scale(const RowFormat& f, int kv_head, const std::byte*& p) {
  if (!stores_scale(f))
    return f.static_scales.size() == 1 ? f.static_scales[0] : f.static_scales[static_cast<std::size_t>(kv_head)];
  float s = 0.0f;
  if (half_scale(f)) {
    std::uint16_t h = 0;
    std::memcpy(&h, p, 2);
    s = from_float16(h);
  } else {
    std::memcpy(&s, p, 4);
  }
  p += scale_bytes(f);
  return s;
}

// An affine group's int32 zero point (after its scale), advancing p; 0 for the others.
int get_zero(const RowFormat& f, const std::byte*& p) {
  if (!affine(f.codec)) return 0;
  std::int32_t z = 0;
  std::memcpy(&z, p, 4);
  p += 4;
  return z;
}

void put_code(const RowFormat& f, std::byte* codes, int i, int g, int c) {
  const auto u = static_cast<std::uint8_t>(c);
  if (f.codec == Codec::q4_0) {  // ggml: byte j holds element j (low) and j + 16 (high)
    const int half = g / 2, j = i % half;
    auto& byte = reinterpret_cast<std::uint8_t&>(codes[j]);
    byte = i < half ? static_cast<std::uint8_t>((byte & 0xF0) | (u & 0x0F))
                    : static_cast<std::uint8_t>((byte & 0x0F) | (u << 4));
    return;
  }
  const int bits = code_bits(f.codec);
  if (bits == 8) {
    codes[i] = static_cast<std::byte>(u);
    return;
  }
  const int bit = i * bits, mask = (1 << bits) - 1;
  auto& byte = reinterpret_cast<std::uint8_t&>(codes[bit / 8]);
  byte = static_cast<std::uint8_t>((byte & ~(mask << (bit % 8))) | ((u & mask) << (bit % 8)));
}

int get_code(const RowFormat& f, const std::byte* codes, int i, int g) {
  if (f.codec == Codec::q4_0) {
    const int half = g / 2;
    const auto byte = static_cast<std::uint8_t>(codes[i % half]);
    return i < half ? byte & 0x0F : byte >> 4;
  }
  const int bits = code_bits(f.codec);
  const auto byte = static_cast<std::uint8_t>(codes[i * bits / 8]);
  if (bits == 8)
    return f.codec == Codec::int8 || f.codec == Codec::q8_0 || f.codec == Codec::int8_even
               ? static_cast<std::int8_t>(byte)
               : byte;
  const int u = (byte >> (i * bits % 8)) & ((1 << bits) - 1);
  return f.codec == Codec::int4_even ? (u ^ 8) - 8 : u;  // two's complement in the nibble
}

// An affine group's scale and zero point from its range (an all-equal group takes its range
// from zero, so it stays exact).
void affine_params(const RowFormat& f, float lo, float hi, float& s, int& z) {
  if (lo == hi) lo = std::min(lo, 0.0f), hi = std::max(hi, 0.0f);
  s = as_stored(f.scale_half, static_cast<float>((static_cast<double>(hi) - lo) / ((1 << code_bits(f.codec)) - 1)));
  z = s != 0.0f ? static_cast<int>(std::round(-lo / s)) : 0;
}

// A code from a rounded float: saturated in float before the conversion to int, which is
// undefined out of int's range (x over a tiny static scale) and for NaN (`nan_code`).
int saturated(float rounded, int lo, int hi, int nan_code = 0) {
  if (std::isnan(rounded)) return nan_code;
  return static_cast<int>(std::clamp(rounded, static_cast<float>(lo), static_cast<float>(hi)));
}

// x * inv as ggml computes it, or x / s where 1 / s overflowed (s below about 2^-127).
float times_inverse(float x, float s, float inv) { return std::isinf(inv) ? x / s : x * inv; }

// The code of x under scale s (and zero point z) for affine, int8 and fp8.
int scaled_code(const RowFormat& f, float x, float s, int z) {
  if (affine(f.codec))
    return std::clamp(static_cast<int>(s != 0.0f ? std::round(x / s) : 0.0f) + z, 0, (1 << code_bits(f.codec)) - 1);
  const float y = s != 0.0f ? x / s : 0.0f;
  if (f.codec == Codec::int8_even) return saturated(std::nearbyint(y), -128, 127);  // ties to even
  if (f.codec == Codec::int4_even) return saturated(std::nearbyint(y), -8, 7);
  return f.codec == Codec::int8 ? saturated(std::round(y), -127, 127) : fp8_encode(fp8_of(f.codec), y);
}

// An affine group's int32 zero point, after its scale, advancing p.
void put_zero(int z, std::byte*& p) {
  const auto z32 = static_cast<std::int32_t>(z);
  std::memcpy(p, &z32, 4);
  p += 4;
}

}  // namespace

RowFormat float_format(Storage storage) {
  RowFormat f;
  f.codec = storage == Storage::float32 ? Codec::float32 : storage == Storage::float16 ? Codec::float16 : Codec::bfloat16;
  return f;
}

bool is_quantized(Codec codec) {
  return codec != Codec::float32 && codec != Codec::float16 && codec != Codec::bfloat16;
}

std::size_t row_bytes(const RowFormat& f, int d) {
  switch (f.codec) {
    case Codec::float32:
      return static_cast<std::size_t>(d) * 4;
    case Codec::float16:
    case Codec::bfloat16:
      return static_cast<std::size_t>(d) * 2;
    default: {
      const int g = group_of(f, d);
      return static_cast<std::size_t>(d / g) * group_bytes(f, g);
    }
  }
}

float frozen_scale(const RowFormat& f, float amax) {
  return as_stored(f.scale_half, static_cast<float>(static_cast<double>(amax) / code_range(f.codec)));
}

float quantized_amax(const RowFormat& f, const float* x, int d, float* scratch) {
  if (f.hadamard) {
    std::copy_n(x, d, scratch);
    walsh_hadamard_blocks(scratch, d, f.hadamard_block);
    x = scratch;
  }
  float amax = 0.0f;
  for (int i = 0; i < d; ++i) amax = std::max(amax, std::abs(x[i]));
  return amax;
}

void encode_row(const RowFormat& f, int kv_head, const float* x, int d, std::byte* out, float* scratch,
                float given_scale) {
  switch (f.codec) {
    case Codec::float32:
      return encode(Storage::float32, x, d, out);
    case Codec::float16:
      return encode(Storage::float16, x, d, out);
    case Codec::bfloat16:
      return encode(Storage::bfloat16, x, d, out);
    default:
      break;
  }
  if (f.along_tokens)
    throw std::logic_error("encode_row: scales along the token axis quantize rows together (encode_rows_along_tokens)");
  if (f.hadamard) {
    std::copy_n(x, d, scratch);
    walsh_hadamard_blocks(scratch, d, f.hadamard_block);
    x = scratch;
  }
  const int g = group_of(f, d);
  std::memset(out, 0, row_bytes(f, d));
  for (int g0 = 0; g0 < d; g0 += g) {
    const float* xs = x + g0;
    std::byte* p = out + static_cast<std::size_t>(g0 / g) * group_bytes(f, g);
    float amax = 0.0f;
    for (int i = 0; i < g; ++i) amax = std::max(amax, std::abs(xs[i]));
    if (f.codec == Codec::q8_0) {  // as ggml's quantize_row_q8_0
      const float s = amax / 127.0f, inv = s != 0.0f ? 1.0f / s : 0.0f;
      put_scale(f, s, p);
      for (int i = 0; i < g; ++i) put_code(f, p, i, g, saturated(std::round(times_inverse(xs[i], s, inv)), -127, 127));
    } else if (f.codec == Codec::q4_0) {  // as ggml's quantize_row_q4_0
      float m = 0.0f;
      for (int i = 0; i < g; ++i)
        if (std::abs(xs[i]) > std::abs(m)) m = xs[i];
      const float s = m / -8.0f, inv = s != 0.0f ? 1.0f / s : 0.0f;
      put_scale(f, s, p);
      for (int i = 0; i < g; ++i)
        put_code(f, p, i, g, saturated(std::trunc(times_inverse(xs[i], s, inv) + 8.5f), 0, 15, 8));
    } else if (affine(f.codec)) {
      float s = 0.0f;
      int z = 0;
      affine_params(f, *std::min_element(xs, xs + g), *std::max_element(xs, xs + g), s, z);
      put_scale(f, s, p);
      put_zero(z, p);
      for (int i = 0; i < g; ++i) put_code(f, p, i, g, scaled_code(f, xs[i], s, z));
    } else {  // int8 and fp8: a static scale, or the group's amax over the code range
      float s = 0.0f;
      if (!stores_scale(f))
        s = f.static_scales.size() == 1 ? f.static_scales[0] : f.static_scales[static_cast<std::size_t>(kv_head)];
      else if (f.frozen != RowFormat::Frozen::no)
        s = given_scale;
      else
        s = as_stored(f.scale_half, static_cast<float>(static_cast<double>(amax) / code_range(f.codec)));
      put_scale(f, s, p);
      for (int i = 0; i < g; ++i) put_code(f, p, i, g, scaled_code(f, xs[i], s, 0));
    }
  }
}

void encode_rows_along_tokens(const RowFormat& f, const float* const* x, int n, int d, std::byte* const* out) {
  if (f.hadamard) throw std::logic_error("encode_rows_along_tokens: no transform along the token axis");
  for (int t = 0; t < n; ++t) std::memset(out[t], 0, row_bytes(f, d));
  const std::size_t element_bytes = group_bytes(f, 1);
  const int run = f.token_run > 0 ? f.token_run : std::max(n, 1);
  for (int t0 = 0; t0 < n; t0 += run) {
    const int t1 = std::min(n, t0 + run);
    for (int c = 0; c < d; ++c) {  // the channel's run, as one group
      float lo = x[t0][c], hi = lo, amax = 0.0f;
      for (int t = t0; t < t1; ++t) lo = std::min(lo, x[t][c]), hi = std::max(hi, x[t][c]), amax = std::max(amax, std::abs(x[t][c]));
      float s = 0.0f;
      int z = 0;
      if (affine(f.codec))
        affine_params(f, lo, hi, s, z);
      else
        s = as_stored(f.scale_half, static_cast<float>(static_cast<double>(amax) / code_range(f.codec)));
      for (int t = t0; t < t1; ++t) {
        std::byte* p = out[t] + static_cast<std::size_t>(c) * element_bytes;
        put_scale(f, s, p);
        if (affine(f.codec)) put_zero(z, p);
        put_code(f, p, 0, 1, scaled_code(f, x[t][c], s, z));
      }
    }
  }
}

bool poison_row(const RowFormat& f, int d, std::byte* out, std::uint32_t nan_bits) {
  const float nan = std::bit_cast<float>(nan_bits);
  if (!is_quantized(f.codec)) {
    const Storage s = f.codec == Codec::float32 ? Storage::float32
                      : f.codec == Codec::float16 ? Storage::float16
                                                  : Storage::bfloat16;
    for (int i = 0; i < d; ++i) encode(s, &nan, 1, out + static_cast<std::size_t>(i) * element_bytes(s));
    return true;
  }
  if (!stores_scale(f)) return false;
  const int g = group_of(f, d);
  std::memset(out, 0, row_bytes(f, d));
  for (int g0 = 0; g0 < d; g0 += g) {
    std::byte* p = out + static_cast<std::size_t>(g0 / g) * group_bytes(f, g);
    put_scale(f, nan, p);
  }
  return true;
}

void decode_row(const RowFormat& f, int kv_head, const std::byte* in, int d, float* x) {
  switch (f.codec) {
    case Codec::float32:
      return decode(Storage::float32, in, d, x);
    case Codec::float16:
      return decode(Storage::float16, in, d, x);
    case Codec::bfloat16:
      return decode(Storage::bfloat16, in, d, x);
    default:
      break;
  }
  const int g = group_of(f, d);
  for (int g0 = 0; g0 < d; g0 += g) {
    const std::byte* p = in + static_cast<std::size_t>(g0 / g) * group_bytes(f, g);
    const float s = get_scale(f, kv_head, p);
    const int z = get_zero(f, p);
    // One loop per layout, each simple enough for the compiler to vectorize: the attention
    // decodes rows here, one key row or one tile of value rows at a time.
    float* out = x + g0;
    const auto* codes = reinterpret_cast<const std::uint8_t*>(p);
    if (f.codec == Codec::q8_0 || f.codec == Codec::int8 || f.codec == Codec::int8_even) {
      const auto* signed_codes = reinterpret_cast<const std::int8_t*>(p);
      for (int i = 0; i < g; ++i) out[i] = static_cast<float>(signed_codes[i]) * s;
    } else if (fp8(f.codec)) {
      // The pattern's exponent and mantissa shifted into a float's, times 2^(127 - bias):
      // exact for normal and subnormal codes alike.
      const Fp8& e = fp8_of(f.codec);
      const float rebias = std::ldexp(1.0f, 127 - e.bias);
      const int shift = 23 - e.mantissa_bits;
      for (int i = 0; i < g; ++i) {
        const std::uint32_t bits = static_cast<std::uint32_t>(codes[i] & 0x7F) << shift;
        const float magnitude = std::bit_cast<float>(bits) * rebias * s;
        out[i] = (codes[i] & 0x80) ? -magnitude : magnitude;
      }
    } else if (f.codec == Codec::q4_0) {
      for (int i = 0; i < g / 2; ++i) {
        out[i] = static_cast<float>((codes[i] & 0x0F) - 8) * s;
        out[i + g / 2] = static_cast<float>((codes[i] >> 4) - 8) * s;
      }
    } else {
      for (int i = 0; i < g; ++i) out[i] = static_cast<float>(get_code(f, p, i, g) - z) * s;
    }
  }
  if (f.hadamard) walsh_hadamard_blocks(x, d, f.hadamard_block);
}

UnpackedRow unpack_row(const RowFormat& f, int kv_head, const std::byte* in, int d) {
  if (!is_quantized(f.codec)) throw std::logic_error("unpack_row: the row is not quantized");
  UnpackedRow u;
  const int g = group_of(f, d);
  for (int g0 = 0; g0 < d; g0 += g) {
    const std::byte* p = in + static_cast<std::size_t>(g0 / g) * group_bytes(f, g);
    u.scales.push_back(get_scale(f, kv_head, p));
    if (affine(f.codec)) u.zeros.push_back(get_zero(f, p));
    for (int i = 0; i < g; ++i) u.codes.push_back(get_code(f, p, i, g));
  }
  return u;
}

int direct_group(const RowFormat& f, int d) {
  const bool direct = f.codec == Codec::q8_0 || f.codec == Codec::int8 || fp8(f.codec);
  return direct && !f.hadamard && !f.along_tokens ? group_of(f, d) : 0;
}

void direct_row(const RowFormat& f, int kv_head, const std::byte* row, int d, float* scales,
                const std::uint8_t** codes) {
  const int g = group_of(f, d);
  for (int i = 0; i < d / g; ++i) {
    const std::byte* p = row + static_cast<std::size_t>(i) * group_bytes(f, g);
    scales[i] = get_scale(f, kv_head, p);
    codes[i] = reinterpret_cast<const std::uint8_t*>(p);
  }
}

}  // namespace kvcheck::optimized
