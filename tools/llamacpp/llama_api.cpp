#include "tools/llamacpp/llama_api.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace kvcheck::llamacpp {
namespace {

namespace fs = std::filesystem;

// The library of `folder` whose file name is `stem` followed by ".so", else the last (by
// name) followed by ".v<version>.so"; tools/setup/llamacpp.sh picks libllama by the same rule.
std::string library(const std::string& folder, const std::string& stem) {
  std::error_code ec;
  std::string found;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    if (name == stem + ".so") return e.path().string();
    if (name.rfind(stem + ".v", 0) == 0 && name.size() > 3 && name.compare(name.size() - 3, 3, ".so") == 0 &&
        e.path().string() > found)
      found = e.path().string();
  }
  if (ec) throw ApiRefused(fmt::format("{}: cannot list the folder ({})", folder, ec.message()));
  if (found.empty())
    throw ApiRefused(fmt::format("{}: no {}.so here (LLAMACPP_DIR names the folder holding libllama and libggml)",
                                         folder, stem));
  return found;
}

// "bytes:mtime" of the file `path` resolves to, as tools/setup/llamacpp.sh writes it.
[[maybe_unused]] std::string file_stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "unreadable";
  return fmt::format("{}:{}", static_cast<long long>(st.st_size), static_cast<long long>(st.st_mtime));
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

// Field sizes are constants of the declarations or of the header: llama_api.h's static_asserts
// hold them to the types written and read, so this check cannot fire at run time.
template <typename T>
T read_at(const ContextParams& p, Field field) {
  if (sizeof(T) != field.size) throw std::logic_error("read_at: a field read with a type of another size");
  T value;
  std::memcpy(&value, reinterpret_cast<const unsigned char*>(&p) + field.offset, sizeof(T));
  return value;
}

}  // namespace

Api load_api(const std::string& folder) {
  void* base = open(library(folder, "libggml-base"));
  void* ggml = open(library(folder, "libggml"));
  const std::string llama_path = library(folder, "libllama");
#ifdef KVCHECK_LLAMA_LIBRARY_STAMP
  // The library the header was paired with at set-up (bytes:mtime of the file): a library
  // rebuilt or replaced since may no longer be of that llama.h.
  if (const std::string now = file_stamp(llama_path); now != KVCHECK_LLAMA_LIBRARY_STAMP)
    throw ApiRefused(fmt::format("{} changed since kvcheck was compiled against its llama.h ({}; was {}, now {}): run "
                                 "tools/kvcheck llamacpp again to pair them anew",
                                 llama_path, abi_source(), KVCHECK_LLAMA_LIBRARY_STAMP, now));
#endif
  void* llama = open(llama_path);
  Api a{};
#ifdef KVCHECK_LLAMA_H
  // Compiled against llama.h: each declaration here must be callable as the header's.
#define KVCHECK_RESOLVE(handle, name)                                                         \
  static_assert(same_signature<decltype(a.name), decltype(&::name)>::value,                   \
                #name ": kvcheck's declaration (tools/llamacpp/llama_api.h) differs from llama.h's"); \
  resolve(handle, #name, a.name)
  // (&::llama_version would name an overload set; a discarded branch is still checked here)
  static_assert(!kHeaderHasVersion || std::is_same_v<decltype(::llama_version()), const char*>,
                "llama_version: another signature");
  if constexpr (kHeaderHasVersion) resolve(llama, "llama_version", a.llama_version);
#else
#define KVCHECK_RESOLVE(handle, name) resolve(handle, #name, a.name)
  constexpr const char* kCompileAgainstIt =
      "To check this build, kvcheck must be compiled against its llama.h: tools/kvcheck llamacpp does it when it "
      "finds the headers (beside an install prefix's lib/, or from a build tree's CMakeCache.txt) or LLAMACPP_INCLUDE "
      "names them (the folders holding llama.h and ggml.h), and --abi auto (the default) then uses them";
  if (::dlsym(llama, "llama_version") == nullptr)
    throw ApiRefused(fmt::format("the library has no llama_version(): an older llama.cpp than the one kvcheck's own "
                                 "declarations know (\"{}\"). {}",
                                 kKnownVersion, kCompileAgainstIt));
  KVCHECK_RESOLVE(llama, llama_version);
  const std::string version = a.llama_version();
  if (version != kKnownVersion)
    throw ApiRefused(fmt::format(
        "llama_version() is \"{}\"; kvcheck's own declarations know the structures of \"{}\" only (their layouts "
        "changed three times in recent months, and a wrong guess would corrupt memory silently). {}",
        version, kKnownVersion, kCompileAgainstIt));
#endif
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
  KVCHECK_RESOLVE(llama, llama_state_get_size);
  KVCHECK_RESOLVE(llama, llama_state_get_data);
  KVCHECK_RESOLVE(ggml, ggml_backend_load_all_from_path);
  KVCHECK_RESOLVE(base, ggml_backend_tensor_get);
  KVCHECK_RESOLVE(base, ggml_get_name);
  KVCHECK_RESOLVE(base, ggml_op_name);
  KVCHECK_RESOLVE(base, ggml_nbytes);
  KVCHECK_RESOLVE(base, ggml_tensor_overhead);
  KVCHECK_RESOLVE(base, ggml_fp16_to_fp32);
#undef KVCHECK_RESOLVE
#ifdef KVCHECK_LLAMA_H
  static_assert(same_signature<EvalCallback, decltype(llama_context_params::cb_eval)>::value,
                "cb_eval: the engine's callback (EvalCallback) differs from llama.h's");
#endif
  // The layouts assumed, checked against what the library says of itself: with the header,
  // a header of another build than the library's shows in its default parameters.
  if (kCompiledAgainstHeader ? a.ggml_tensor_overhead() < tensor_size
                             : a.ggml_tensor_overhead() != declared::tensor_overhead)
    throw ApiRefused(fmt::format("ggml_tensor_overhead() is {}, expected {}: another ggml_tensor layout",
                                 a.ggml_tensor_overhead(),
                                 kCompiledAgainstHeader ? fmt::format("at least {}", tensor_size)
                                                        : std::to_string(declared::tensor_overhead)));
  const ContextParams d = a.llama_context_default_params();
  const bool sane = read_at<std::int32_t>(d, context_field::type_k) == static_cast<int>(GgmlType::f16) &&
                    read_at<std::int32_t>(d, context_field::type_v) == static_cast<int>(GgmlType::f16) &&
                    read_at<void*>(d, context_field::cb_eval) == nullptr;
  if (kCompiledAgainstHeader && !sane)
    throw ApiRefused(fmt::format(
        "llama_context_default_params() does not read back as expected (type_k and type_v f16, no eval callback): "
        "the library is not of the build whose llama.h kvcheck was compiled against ({}); rebuild the library, or "
        "name its own headers in LLAMACPP_INCLUDE and run tools/kvcheck llamacpp again",
        abi_source()));
  if (!kCompiledAgainstHeader) {  // the checked build's defaults, every field read
    const bool defaults = read_at<std::uint32_t>(d, context_field::n_ctx) == 512 &&
                          read_at<std::uint32_t>(d, context_field::n_batch) == 2048 &&
                          read_at<std::uint32_t>(d, context_field::n_ubatch) == 512 &&
                          read_at<std::int32_t>(d, context_field::flash_attn_type) == -1 &&
                          read_at<float>(d, context_field::yarn_ext_factor) == -1.0f;
    if (!sane || !defaults)
      throw ApiRefused(
          "llama_context_default_params() does not read back as expected (n_ctx 512, n_batch 2048, n_ubatch 512, "
          "type_k and type_v f16, flash attention auto, yarn_ext_factor -1, no eval callback): another layout");
  }
  return a;
}

const char* abi_source() {
#ifdef KVCHECK_LLAMA_H
  return "llama.h of " KVCHECK_LLAMA_H_DIR;
#else
  return "kvcheck's declarations";
#endif
}

}  // namespace kvcheck::llamacpp
