// SPEC 9: how a quantized cache stores keys and values, as a scenario declares it (the
// `kv_quant` field). Plain value types: the reference's quantizer is reference/quantize.h.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "reference/enum_names.h"

namespace kvcheck {

// int8_even and int4_even: symmetric codes over the whole two's-complement range ([-128, 127],
// [-8, 7]), x / s rounded to nearest with ties to even, static scales: ONNX Runtime's
// GroupQueryAttention KV (SPEC 9.6). int8 rounds ties away from zero over [-127, 127].
// mlx_affine: MLX's affine groups (mx.quantize, SPEC 9.7): unsigned codes of `bits` bits, a
// float scale (negative when the group's largest magnitude is its maximum) and a float bias.
// quanto_affine: optimum-quanto's groups as transformers' QuantizedLayer stores them (SPEC
// 9.8): unsigned codes of `bits` bits, a float scale (max - min) / n and a float bias, the min.
enum class QuantFormat { fp8_e4m3, fp8_e5m2, int8, q8_0, q4_0, int4, int2, int8_even, int4_even, mlx_affine,
                         quanto_affine };
// Formats whose groups carry a float bias beside the scale (x = c S + B).
inline bool has_biases(QuantFormat f) { return f == QuantFormat::mlx_affine || f == QuantFormat::quanto_affine; }

// What one scale covers: the whole tensor, one kv head, one token's row of head_dim (per kv
// head), `group` consecutive elements of that row, or (channel) one channel of head_dim over
// a run of `group` tokens quantized together (0: all of them), as KIVI and Hugging Face's
// QuantizedCache quantize keys per channel.
enum class ScaleGranularity { tensor, head, token, group, channel };
enum class ScaleDtype { float32, float16 };
// A static scale (a checkpoint's k_scale), one computed from the values quantized together,
// or (SPEC 9's "first_append") one computed per row from the row's first append (every
// token of it, keys as first stored), then kept for the row's later tokens: each token
// carries the scale it was written with, and a prefix hit's tokens keep their writer's.
enum class ScaleRule { fixed, amax, first_append };

struct QuantScale {
  ScaleGranularity granularity = ScaleGranularity::token;
  int group = 0;  // elements per scale (group, q8_0, q4_0); head_dim for token; tokens per run (channel)
  ScaleDtype dtype = ScaleDtype::float32;
  ScaleRule rule = ScaleRule::amax;
  std::vector<double> values;  // fixed: one (tensor) or one per kv head (head)
  bool operator==(const QuantScale&) const = default;
};

struct TensorQuant {
  QuantFormat format = QuantFormat::q8_0;
  QuantScale scale;
  // kvcheck's extension of SPEC 9's transform: the Hadamard matrix is block-diagonal, one
  // normalized Hadamard matrix of this width per block along head_dim (llama.cpp rotates V
  // in blocks of 64 at head_dim 128); 0: one block, the whole head.
  int transform_block = 0;
  int bits = 0;  // mlx_affine: 2, 3, 4, 5, 6 or 8; quanto_affine: 2 or 4; 0 for the other formats (their name says it)
  bool operator==(const TensorQuant&) const = default;
};

enum class QuantTransform { none, hadamard };

// When a token leaves the residual (SPEC 9): quantized once as it leaves ("append", vLLM),
// or, once the residual is full, everything stored dequantized and quantized again with it
// (Hugging Face's QuantizedCache). kvcheck's extension "block" (KIVI): once R tokens are raw,
// the oldest whole multiple of R are quantized together and leave it; the stored stay as they are.
enum class Flush { append, requantize_all, block };
// The first append of a row: quantized at once ("store", as Hugging Face does whatever the
// residual) or kept in the residual like any later token.
enum class PrefillRule { store, residual };
// What a chunk's queries read of its own tokens: the stored values (written, then read
// back: vLLM) or the raw ones, earlier tokens dequantized (Hugging Face).
enum class ChunkReads { stored, raw };

struct KvQuant {
  std::optional<TensorQuant> k, v;  // absent: stored in kv_dtype
  QuantTransform transform = QuantTransform::none;
  // A shifting policy always re-rotates a quantized key by dequantize, rotate, quantize
  // (shift "requantize", the only convention SPEC 9 defines).
  // kvcheck's extension of SPEC 9: the attention quantizes the rotated (and transformed)
  // query too before its dot products with the keys, as ggml's CPU matmul converts its
  // activations to the quantized weight's dot-product type (q8_0 for q8_0 K).
  std::optional<QuantFormat> query;
  std::int64_t residual = 0;  // the newest tokens kept in kv_dtype
  Flush flush = Flush::append;
  PrefillRule prefill = PrefillRule::store;
  ChunkReads chunk_reads = ChunkReads::stored;
  // Scales along the token axis: tokens are written raw, then quantized together by the flush
  // rule (an append's tokens, or every token at a "requantize_all" flush).
  bool along_tokens() const {
    return (k && k->scale.granularity == ScaleGranularity::channel) ||
           (v && v->scale.granularity == ScaleGranularity::channel);
  }
  // Some token is ever held unquantized: a residual, a flush or read rule that needs one, or
  // scales along the token axis (a token waits, raw, for the others it is quantized with).
  bool holds_raw() const {
    return residual > 0 || flush == Flush::requantize_all || chunk_reads == ChunkReads::raw || along_tokens();
  }
  bool operator==(const KvQuant&) const = default;
};

// What the query meets in its dot products with the keys: K's transform and block; none
// when K is stored unquantized (nothing of K is transformed then).
inline QuantTransform query_transform(const KvQuant& q) { return q.k ? q.transform : QuantTransform::none; }
inline int query_transform_block(const KvQuant& q) { return q.k ? q.k->transform_block : 0; }

inline constexpr EnumName<QuantFormat> kQuantFormatNames[] = {
    {QuantFormat::fp8_e4m3, "fp8_e4m3"}, {QuantFormat::fp8_e5m2, "fp8_e5m2"}, {QuantFormat::int8, "int8"},
    {QuantFormat::q8_0, "q8_0"},         {QuantFormat::q4_0, "q4_0"},         {QuantFormat::int4, "int4"},
    {QuantFormat::int2, "int2"},         {QuantFormat::int8_even, "int8_even"}, {QuantFormat::int4_even, "int4_even"},
    {QuantFormat::mlx_affine, "mlx_affine"}, {QuantFormat::quanto_affine, "quanto_affine"}};
inline constexpr EnumName<ScaleGranularity> kScaleGranularityNames[] = {{ScaleGranularity::tensor, "tensor"},
                                                                        {ScaleGranularity::head, "head"},
                                                                        {ScaleGranularity::token, "token"},
                                                                        {ScaleGranularity::channel, "channel"},
                                                                        {ScaleGranularity::group, "group"}};
inline constexpr EnumName<Flush> kFlushNames[] = {
    {Flush::append, "append"}, {Flush::requantize_all, "requantize_all"}, {Flush::block, "block"}};
inline constexpr EnumName<PrefillRule> kPrefillRuleNames[] = {{PrefillRule::store, "store"},
                                                              {PrefillRule::residual, "residual"}};
inline constexpr EnumName<ChunkReads> kChunkReadsNames[] = {{ChunkReads::stored, "stored"}, {ChunkReads::raw, "raw"}};
inline constexpr EnumName<QuantTransform> kQuantTransformNames[] = {{QuantTransform::none, "none"},
                                                                    {QuantTransform::hadamard, "hadamard"}};
inline constexpr EnumName<ScaleDtype> kScaleDtypeNames[] = {{ScaleDtype::float32, "float32"},
                                                            {ScaleDtype::float16, "float16"}};

static_assert(sizeof(kQuantFormatNames) / sizeof(kQuantFormatNames[0]) == static_cast<std::size_t>(QuantFormat::quanto_affine) + 1,
              "a format without a name");

inline const char* to_string(QuantFormat f) { return name_in(kQuantFormatNames, f); }
inline const char* to_string(ScaleGranularity g) { return name_in(kScaleGranularityNames, g); }
// Some tensor's scale is frozen per row at its first append.
inline bool frozen_scales(const KvQuant& q) {
  return (q.k && q.k->scale.rule == ScaleRule::first_append) || (q.v && q.v->scale.rule == ScaleRule::first_append);
}
inline const char* to_string(ScaleDtype d) { return name_in(kScaleDtypeNames, d); }
inline const char* to_string(QuantTransform t) { return name_in(kQuantTransformNames, t); }
inline const char* to_string(Flush f) { return name_in(kFlushNames, f); }
inline const char* to_string(PrefillRule p) { return name_in(kPrefillRuleNames, p); }
inline const char* to_string(ChunkReads c) { return name_in(kChunkReadsNames, c); }

}  // namespace kvcheck
