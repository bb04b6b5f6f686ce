#include "tools/llamacpp/llama_api.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace kvcheck::llamacpp {
namespace {

namespace fs = std::filesystem;

// The library of `folder` whose file name is `stem` followed by ".so" or ".v<version>.so".
std::string library(const std::string& folder, const std::string& stem) {
  std::error_code ec;
  std::string found;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    if (name == stem + ".so" || (name.rfind(stem + ".v", 0) == 0 && name.size() > 3 &&
                                 name.compare(name.size() - 3, 3, ".so") == 0))
      found = e.path().string();
  }
  if (ec) throw ApiRefused(fmt::format("{}: cannot list the folder ({})", folder, ec.message()));
  if (found.empty())
    throw ApiRefused(fmt::format("{}: no {}.so here (LLAMACPP_DIR names the folder holding libllama and libggml)",
                                         folder, stem));
  return found;
}

void* open(const std::string& path) {
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) throw ApiRefused(fmt::format("cannot load {}: {}", path, ::dlerror()));
  return handle;
}

template <typename F>
void resolve(void* handle, const char* name, F& out) {
  void* symbol = ::dlsym(handle, name);
  if (symbol == nullptr) throw ApiRefused(fmt::format("the library has no {} (another llama.cpp?)", name));
  out = reinterpret_cast<F>(symbol);
}

template <typename T>
T read_at(const ContextParams& p, std::size_t offset) {
  T value;
  std::memcpy(&value, p.bytes + offset, sizeof(T));
  return value;
}

}  // namespace

Api load_api(const std::string& folder) {
  void* base = open(library(folder, "libggml-base"));
  void* ggml = open(library(folder, "libggml"));
  void* llama = open(library(folder, "libllama"));
  Api a{};
#define KVCHECK_RESOLVE(handle, name) resolve(handle, #name, a.name)
  KVCHECK_RESOLVE(llama, llama_version);
  const std::string version = a.llama_version();
  if (version != kKnownVersion)
    throw ApiRefused(fmt::format(
        "llama_version() is \"{}\"; kvcheck knows the structures of \"{}\" only (their layouts changed three times "
        "in recent months, and a wrong guess would corrupt memory silently)",
        version, kKnownVersion));
  KVCHECK_RESOLVE(llama, llama_backend_init);
  KVCHECK_RESOLVE(llama, llama_log_set);
  KVCHECK_RESOLVE(llama, llama_model_default_params);
  KVCHECK_RESOLVE(llama, llama_context_default_params);
  KVCHECK_RESOLVE(llama, llama_model_load_from_file);
  KVCHECK_RESOLVE(llama, llama_init_from_model);
  KVCHECK_RESOLVE(llama, llama_free);
  KVCHECK_RESOLVE(llama, llama_model_free);
  KVCHECK_RESOLVE(llama, llama_n_batch);
  KVCHECK_RESOLVE(llama, llama_n_ctx);
  KVCHECK_RESOLVE(llama, llama_n_threads);
  KVCHECK_RESOLVE(llama, llama_batch_init);
  KVCHECK_RESOLVE(llama, llama_batch_free);
  KVCHECK_RESOLVE(llama, llama_decode);
  KVCHECK_RESOLVE(llama, llama_get_memory);
  KVCHECK_RESOLVE(llama, llama_memory_clear);
  KVCHECK_RESOLVE(llama, llama_memory_seq_rm);
  KVCHECK_RESOLVE(llama, llama_memory_seq_add);
  KVCHECK_RESOLVE(llama, llama_memory_seq_cp);
  KVCHECK_RESOLVE(llama, llama_memory_seq_pos_max);
  KVCHECK_RESOLVE(llama, llama_memory_can_shift);
  KVCHECK_RESOLVE(llama, llama_state_seq_get_size);
  KVCHECK_RESOLVE(llama, llama_state_seq_get_data);
  KVCHECK_RESOLVE(llama, llama_state_seq_set_data);
  KVCHECK_RESOLVE(ggml, ggml_backend_load_all_from_path);
  KVCHECK_RESOLVE(base, ggml_backend_tensor_get);
  KVCHECK_RESOLVE(base, ggml_get_name);
  KVCHECK_RESOLVE(base, ggml_op_name);
  KVCHECK_RESOLVE(base, ggml_nbytes);
  KVCHECK_RESOLVE(base, ggml_tensor_overhead);
  KVCHECK_RESOLVE(base, ggml_fp16_to_fp32);
#undef KVCHECK_RESOLVE
  // The layouts this file assumes, checked against what the library says of itself.
  if (a.ggml_tensor_overhead() != 368)
    throw ApiRefused(fmt::format("ggml_tensor_overhead() is {}, expected 368: another ggml_tensor layout",
                                         a.ggml_tensor_overhead()));
  const ContextParams d = a.llama_context_default_params();
  const bool defaults = read_at<std::uint32_t>(d, context_offset::n_ctx) == 512 &&
                        read_at<std::uint32_t>(d, context_offset::n_batch) == 2048 &&
                        read_at<std::uint32_t>(d, context_offset::n_ubatch) == 512 &&
                        read_at<std::int32_t>(d, context_offset::type_k) == static_cast<int>(GgmlType::f16) &&
                        read_at<std::int32_t>(d, context_offset::type_v) == static_cast<int>(GgmlType::f16) &&
                        read_at<std::int32_t>(d, context_offset::flash_attn_type) == -1 &&
                        read_at<float>(d, context_offset::yarn_ext_factor) == -1.0f &&
                        read_at<void*>(d, context_offset::cb_eval) == nullptr;
  if (!defaults)
    throw ApiRefused(
        "llama_context_default_params() does not read back as expected (n_ctx 512, n_batch 2048, n_ubatch 512, "
        "type_k and type_v f16, flash attention auto, yarn_ext_factor -1, no eval callback): another layout");
  return a;
}

}  // namespace kvcheck::llamacpp
