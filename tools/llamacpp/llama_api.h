// The part of llama.cpp's C API that kvcheck drives, loaded at run time with dlopen, so
// kvcheck builds without llama.cpp. Two ways to know the structures it fills in:
// - declared here, from the build we checked (kKnownVersion; no upstream header is copied):
//   structs that changed between releases are byte blobs with checked offsets, and load()
//   refuses any other version before touching them;
// - compiled against a real llama.h (KVCHECK_LLAMA_H, set by the build when the set-up found
//   one: a build of one's own, or the shipped build's source): offsets and sizes are the
//   compiler's, every function kvcheck calls is checked against the header's declaration at
//   compile time, and any version is accepted.
// The engine's code is the same either way: it writes fields through `Field`s.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#ifdef KVCHECK_LLAMA_H
#include <llama.h>
#endif

namespace kvcheck::llamacpp {

inline constexpr const char* kKnownVersion = "0.5.0-dev";

// ggml_type values used here.
enum class GgmlType : std::int32_t { f32 = 0, f16 = 1, q4_0 = 2, q8_0 = 8, bf16 = 30 };

// A field of one of llama.cpp's structs that kvcheck writes or reads: offset and size in bytes.
struct Field {
  std::size_t offset, size;
};

// The layout of the checked build (kKnownVersion), as measured there.
namespace declared {
inline constexpr std::size_t context_params_size = 160, model_params_size = 80, tensor_size = 336,
                             tensor_overhead = 368;
namespace context_field {  // llama_context_params
inline constexpr Field n_ctx{0, 4}, n_batch{4, 4}, n_ubatch{8, 4}, n_seq_max{12, 4}, n_threads{28, 4},
    n_threads_batch{32, 4}, flash_attn_type{52, 4}, yarn_ext_factor{64, 4}, cb_eval{88, 8}, cb_eval_user_data{96, 8},
    type_k{104, 4}, type_v{108, 4}, offload_kqv{129, 1}, swa_full{132, 1}, kv_unified{133, 1};
}
namespace tensor_field {  // ggml_tensor; src: its first source
inline constexpr Field type{0, 4}, ne{16, 32}, nb{48, 32}, op{80, 4}, src{152, 8}, name{256, 64};
}
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
struct ContextParams {
  alignas(8) unsigned char bytes[context_params_size];
};
struct ModelParams {  // passed back as the library made it
  alignas(8) unsigned char bytes[model_params_size];
};
}  // namespace declared

#ifdef KVCHECK_LLAMA_H
// llama_version() is recent (builds of early 2026 have none): when llama.h does not declare
// it, this overload is what `llama_version()` names, and the engine does without it.
struct NoLlamaVersion {};
}  // namespace kvcheck::llamacpp
template <typename... T>
kvcheck::llamacpp::NoLlamaVersion llama_version(T...);
namespace kvcheck::llamacpp {
inline constexpr bool kHeaderHasVersion = !std::is_same_v<decltype(::llama_version()), NoLlamaVersion>;
inline constexpr bool kCompiledAgainstHeader = true;
inline constexpr std::size_t tensor_size = sizeof(::ggml_tensor);
using ContextParams = ::llama_context_params;
using ModelParams = ::llama_model_params;
using Batch = ::llama_batch;
#define KVCHECK_FIELD(type, member) \
  Field { offsetof(type, member), sizeof(static_cast<type*>(nullptr)->member) }
namespace context_field {
inline constexpr Field n_ctx = KVCHECK_FIELD(llama_context_params, n_ctx),
                       n_batch = KVCHECK_FIELD(llama_context_params, n_batch),
                       n_ubatch = KVCHECK_FIELD(llama_context_params, n_ubatch),
                       n_seq_max = KVCHECK_FIELD(llama_context_params, n_seq_max),
                       n_threads = KVCHECK_FIELD(llama_context_params, n_threads),
                       n_threads_batch = KVCHECK_FIELD(llama_context_params, n_threads_batch),
                       flash_attn_type = KVCHECK_FIELD(llama_context_params, flash_attn_type),
                       yarn_ext_factor = KVCHECK_FIELD(llama_context_params, yarn_ext_factor),
                       cb_eval = KVCHECK_FIELD(llama_context_params, cb_eval),
                       cb_eval_user_data = KVCHECK_FIELD(llama_context_params, cb_eval_user_data),
                       type_k = KVCHECK_FIELD(llama_context_params, type_k),
                       type_v = KVCHECK_FIELD(llama_context_params, type_v),
                       offload_kqv = KVCHECK_FIELD(llama_context_params, offload_kqv),
                       swa_full = KVCHECK_FIELD(llama_context_params, swa_full),
                       kv_unified = KVCHECK_FIELD(llama_context_params, kv_unified);
}
namespace tensor_field {
inline constexpr Field type = KVCHECK_FIELD(ggml_tensor, type), ne = KVCHECK_FIELD(ggml_tensor, ne),
                       nb = KVCHECK_FIELD(ggml_tensor, nb), op = KVCHECK_FIELD(ggml_tensor, op),
                       src{offsetof(ggml_tensor, src), sizeof(ggml_tensor*)}, name = KVCHECK_FIELD(ggml_tensor, name);
}
#undef KVCHECK_FIELD
static_assert(GGML_TYPE_F32 == static_cast<int>(GgmlType::f32) && GGML_TYPE_F16 == static_cast<int>(GgmlType::f16) &&
                  GGML_TYPE_Q4_0 == static_cast<int>(GgmlType::q4_0) &&
                  GGML_TYPE_Q8_0 == static_cast<int>(GgmlType::q8_0) &&
                  GGML_TYPE_BF16 == static_cast<int>(GgmlType::bf16),
              "this ggml.h numbers its types otherwise");
#else
inline constexpr bool kCompiledAgainstHeader = false;
using declared::tensor_size;
using declared::Batch;
using declared::ContextParams;
using declared::ModelParams;
namespace context_field = declared::context_field;
namespace tensor_field = declared::tensor_field;
#endif

// The sizes the engine writes and reads these fields with: a header whose field changed type
// stops the build here rather than being written past.
static_assert(context_field::n_ctx.size == 4 && context_field::n_batch.size == 4 && context_field::n_ubatch.size == 4 &&
                  context_field::n_seq_max.size == 4 && context_field::n_threads.size == 4 &&
                  context_field::n_threads_batch.size == 4 && context_field::flash_attn_type.size == 4 &&
                  context_field::yarn_ext_factor.size == 4 && context_field::cb_eval.size == sizeof(void*) &&
                  context_field::cb_eval_user_data.size == sizeof(void*) && context_field::type_k.size == 4 &&
                  context_field::type_v.size == 4 && context_field::offload_kqv.size == 1 &&
                  context_field::swa_full.size == 1 && context_field::kv_unified.size == 1,
              "llama_context_params: a field kvcheck writes changed size");
static_assert(tensor_field::type.size == 4 && tensor_field::op.size == 4 && tensor_field::ne.size == 32 &&
                  tensor_field::nb.size == 32 && tensor_field::src.size == sizeof(void*) && tensor_field::name.size == 64,
              "ggml_tensor: a field kvcheck reads changed size");

// Where the structures' layout came from, for reports: "llama.h of <folder>", or kvcheck's
// declarations.
const char* abi_source();

using EvalCallback = bool (*)(void* tensor, bool ask, void* user_data);
using LogCallback = void (*)(int level, const char* text, void* user_data);

// Function pointers resolved from the libraries of one folder.
struct Api {
  const char* (*llama_version)();  // null when the header compiled against has none
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
  std::size_t (*llama_state_get_size)(void*);
  std::size_t (*llama_state_get_data)(void*, std::uint8_t*, std::size_t);
  void (*ggml_backend_load_all_from_path)(const char*);
  void (*ggml_backend_tensor_get)(const void*, void*, std::size_t, std::size_t);
  const char* (*ggml_get_name)(const void*);
  const char* (*ggml_op_name)(std::int32_t);
  std::size_t (*ggml_nbytes)(const void*);
  std::size_t (*ggml_tensor_overhead)();
  float (*ggml_fp16_to_fp32)(std::uint16_t);
};

// Whether kvcheck's declaration `Ours` of a function can call the header's `Theirs`: the
// same number of parameters, and each type (and the result) the same, or both object
// pointers (kvcheck passes handles as void*), or both function pointers of such signatures,
// or both integers or enums of one size and signedness (bool only as bool).
template <typename Ours, typename Theirs>
struct same_signature;
template <typename A, typename B>
constexpr bool same_abi_type() {
  using PA = std::conditional_t<std::is_pointer_v<A>, std::remove_pointer_t<A>, void>;
  using PB = std::conditional_t<std::is_pointer_v<B>, std::remove_pointer_t<B>, void>;
  if constexpr (std::is_same_v<A, B>) {
    return true;
  } else if constexpr (std::is_pointer_v<A> && std::is_pointer_v<B> && std::is_function_v<PA> &&
                       std::is_function_v<PB>) {
    return same_signature<A, B>::value;
  } else if constexpr (std::is_pointer_v<A> && std::is_pointer_v<B>) {
    return !std::is_function_v<PA> && !std::is_function_v<PB>;
  } else if constexpr (std::is_same_v<A, bool> || std::is_same_v<B, bool>) {
    return false;
  } else if constexpr ((std::is_integral_v<A> || std::is_enum_v<A>) && (std::is_integral_v<B> || std::is_enum_v<B>)) {
    // A C enum of small values may be signed or not, at the compiler's choice: an enum
    // matches an integer of its size either way; two integers must agree in signedness.
    if constexpr (std::is_enum_v<A> || std::is_enum_v<B>) return sizeof(A) == sizeof(B);
    else return sizeof(A) == sizeof(B) && std::is_signed_v<A> == std::is_signed_v<B>;
  } else {
    return false;
  }
}
template <typename Ours, typename Theirs>
struct same_signature : std::false_type {};
template <typename R1, typename... A1, typename R2, typename... A2>
struct same_signature<R1 (*)(A1...), R2 (*)(A2...)> {
  static constexpr bool value = [] {
    if constexpr (sizeof...(A1) != sizeof...(A2)) return false;
    else return same_abi_type<R1, R2>() && (same_abi_type<A1, A2>() && ...);
  }();
};

// llama_version(), or a stand-in naming its absence.
inline std::string version_of(const Api& api) {
  return api.llama_version != nullptr ? api.llama_version() : "(no llama_version() in this build)";
}

// The libraries are not the ones this driver knows (version, layout, missing file): the
// user's to fix, exit 2, unlike a failure of the library itself.
struct ApiRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Loads the libraries of `folder` (libggml-base, libggml, libllama as the npm package
// names them, or libggml*.so / libllama.so of a build), resolves every function and checks
// the default context parameters; with the declared layout, also llama_version() and
// ggml_tensor_overhead(). Throws ApiRefused naming what is wrong.
Api load_api(const std::string& folder);

}  // namespace kvcheck::llamacpp
