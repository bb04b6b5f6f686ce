// The part of llama.cpp's C API that kvcheck drives, declared here from its documented
// behaviour (no upstream header is copied) and loaded at run time with dlopen, so kvcheck
// builds without llama.cpp. Structs that changed between releases are handled as byte
// blobs with checked offsets: the offsets are those of the build we checked
// (kKnownVersion), and load() refuses any other version before touching them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvcheck::llamacpp {

inline constexpr const char* kKnownVersion = "0.5.0-dev";

// ggml_type values used here.
enum class GgmlType : std::int32_t { f32 = 0, f16 = 1, q4_0 = 2, q8_0 = 8, bf16 = 30 };

// llama_context_params: 160 bytes in the checked build; written through these offsets.
struct ContextParams {
  alignas(8) unsigned char bytes[160];
};
namespace context_offset {
inline constexpr std::size_t n_ctx = 0, n_batch = 4, n_ubatch = 8, n_seq_max = 12, n_threads = 28,
                             n_threads_batch = 32, flash_attn_type = 52, yarn_ext_factor = 64, cb_eval = 88,
                             cb_eval_user_data = 96, type_k = 104, type_v = 108, offload_kqv = 129,
                             kv_unified = 133;
}
struct ModelParams {  // passed back as the library made it
  alignas(8) unsigned char bytes[80];
};

// llama_batch: 56 bytes, stable for years.
struct Batch {
  std::int32_t n_tokens;
  std::int32_t* token;
  float* embd;
  std::int32_t* pos;
  std::int32_t* n_seq_id;
  std::int32_t** seq_id;
  std::int8_t* logits;
};
static_assert(sizeof(Batch) == 56);

// ggml_tensor fields read here, by offset (336 bytes in the checked build).
namespace tensor_offset {
inline constexpr std::size_t type = 0, ne = 16, nb = 48, op = 80, src = 152, name = 256;
}

using EvalCallback = bool (*)(void* tensor, bool ask, void* user_data);
using LogCallback = void (*)(int level, const char* text, void* user_data);

// Function pointers resolved from the libraries of one folder.
struct Api {
  const char* (*llama_version)();
  void (*llama_backend_init)();
  void (*llama_log_set)(LogCallback, void*);
  ModelParams (*llama_model_default_params)();
  ContextParams (*llama_context_default_params)();
  void* (*llama_model_load_from_file)(const char*, ModelParams);
  void* (*llama_init_from_model)(void*, ContextParams);
  void (*llama_free)(void*);
  void (*llama_model_free)(void*);
  std::uint32_t (*llama_n_batch)(const void*);
  std::uint32_t (*llama_n_ctx)(const void*);
  std::int32_t (*llama_n_threads)(void*);
  Batch (*llama_batch_init)(std::int32_t, std::int32_t, std::int32_t);
  void (*llama_batch_free)(Batch);
  std::int32_t (*llama_decode)(void*, Batch);
  void* (*llama_get_memory)(const void*);
  void (*llama_memory_clear)(void*, bool);
  bool (*llama_memory_seq_rm)(void*, std::int32_t, std::int32_t, std::int32_t);
  void (*llama_memory_seq_add)(void*, std::int32_t, std::int32_t, std::int32_t, std::int32_t);
  void (*llama_memory_seq_cp)(void*, std::int32_t, std::int32_t, std::int32_t, std::int32_t);
  std::int32_t (*llama_memory_seq_pos_max)(void*, std::int32_t);
  bool (*llama_memory_can_shift)(void*);
  std::size_t (*llama_state_seq_get_size)(void*, std::int32_t);
  std::size_t (*llama_state_seq_get_data)(void*, std::uint8_t*, std::size_t, std::int32_t);
  std::size_t (*llama_state_seq_set_data)(void*, const std::uint8_t*, std::size_t, std::int32_t);
  void (*ggml_backend_load_all_from_path)(const char*);
  void (*ggml_backend_tensor_get)(const void*, void*, std::size_t, std::size_t);
  const char* (*ggml_get_name)(const void*);
  const char* (*ggml_op_name)(std::int32_t);
  std::size_t (*ggml_nbytes)(const void*);
  std::size_t (*ggml_tensor_overhead)();
  float (*ggml_fp16_to_fp32)(std::uint16_t);
};

// The libraries are not the ones this driver knows (version, layout, missing file): the
// user's to fix, exit 2, unlike a failure of the library itself.
struct ApiRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Loads the libraries of `folder` (libggml-base, libggml, libllama as the npm package
// names them, or libggml*.so / libllama.so of a build), resolves every function, checks
// llama_version() and the default context parameters. Throws ApiRefused naming what is
// wrong.
Api load_api(const std::string& folder);

}  // namespace kvcheck::llamacpp
