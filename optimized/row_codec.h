// How one stored row (head_dim elements of one token and kv head) is laid out: float32,
// float16, bfloat16 (SPEC 7) or a quantized format (SPEC 9), written by the cache and read
// back by its attention. Quantized rows are groups of [scale][int32 zero point][codes], as ggml's
// blocks are; q4_0 keeps ggml's nibble order (byte j: element j low, j + 16 high).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "optimized/half.h"

namespace kvcheck::optimized {

// int8_even, int4_even: symmetric over [-128, 127] and [-8, 7], ties to even (SPEC 9.6).
enum class Codec { float32, float16, bfloat16, fp8_e4m3, fp8_e5m2, int8, q8_0, q4_0, int4, int2, int8_even, int4_even };

struct RowFormat {
  Codec codec = Codec::float32;
  int group = 0;                     // elements per scale; 0: the whole row
  bool scale_half = false;           // scales stored in float16 (else float32)
  std::vector<float> static_scales;  // fixed scales: one, or one per kv head; empty: from the values
  bool hadamard = false;             // the row is multiplied by the normalized Hadamard matrix first
  int hadamard_block = 0;            // in blocks of this width along the row; 0: one block
  // int8 and fp8: each row stores its scale, given by the writer (SPEC 9's "first_append":
  // the row's scale frozen at its first append, per kv head or one for the tensor).
  enum class Frozen { no, per_head, per_tensor } frozen = Frozen::no;
  // Scales along the token axis (KIVI's per-channel keys): one scale (and zero point) per
  // channel per run of `token_run` tokens quantized together (0: all of them), written by
  // encode_rows_along_tokens; each row stores its run's scale for each element (a group of 1).
  bool along_tokens = false;
  int token_run = 0;
  bool operator==(const RowFormat&) const = default;
};

// How one layer stores its keys and values (the layers of a store may differ: SPEC 9's
// per-layer kv_quant).
struct LayerFormats {
  RowFormat key, value;
  bool operator==(const LayerFormats&) const = default;
};

RowFormat float_format(Storage storage);
bool is_quantized(Codec codec);

// Bytes of one stored row of d elements.
std::size_t row_bytes(const RowFormat& format, int d);

// Writes x[0..d) of kv head `kv_head` into `out` (row_bytes long). `scratch` holds d floats.
// `given_scale`: the scale of a Frozen format (the writer's row's).
void encode_row(const RowFormat& format, int kv_head, const float* x, int d, std::byte* out, float* scratch,
                float given_scale = 0.0f);
// An along_tokens format (no transform): the n rows x[0..n) (d floats each, in token order)
// quantized together into out[0..n) (row_bytes each).
void encode_rows_along_tokens(const RowFormat& format, const float* const* x, int n, int d, std::byte* const* out);
// A Frozen format's scale for values whose largest magnitude is `amax` (as stored), and the
// largest magnitude of what encode_row would quantize of x (after the transform).
float frozen_scale(const RowFormat& format, float amax);
float quantized_amax(const RowFormat& format, const float* x, int d, float* scratch);
// Fills a stored row with the NaN `nan_bits` (poison.h): float32 rows keep the bits, half
// rows a NaN of theirs, quantized rows a NaN scale. False when the format has no room for
// a NaN (a static scale): the row is left as it was.
bool poison_row(const RowFormat& format, int d, std::byte* out, std::uint32_t nan_bits);
// Reads a stored row back into d floats (the transform undone).
void decode_row(const RowFormat& format, int kv_head, const std::byte* in, int d, float* x);

// What a quantized row holds, unpacked: one code per element (fp8: its bit pattern),
// the scales and (affine formats) the zero points, one per group.
struct UnpackedRow {
  std::vector<int> codes;
  std::vector<float> scales;
  std::vector<int> zeros;
  std::vector<float> biases;  // mlx_affine (SPEC 9.7), read from a trace: one per group
};
UnpackedRow unpack_row(const RowFormat& format, int kv_head, const std::byte* in, int d);

// For kernels that read codes in place (q8_0, int8 and fp8 without a transform): the
// elements per scale, or 0 when the format must be decoded with decode_row.
int direct_group(const RowFormat& format, int d);
// The scale of each group of a stored row, and where each group's codes start.
void direct_row(const RowFormat& format, int kv_head, const std::byte* row, int d, float* scales,
                const std::uint8_t** codes);

}  // namespace kvcheck::optimized
