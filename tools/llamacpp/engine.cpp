// kvcheck_llamacpp_engine: runs one scenario through llama.cpp's own KV cache and writes
// what it captured, for `kvcheck llamacpp` to judge. It runs as a child process, so a
// crash in llama.cpp is a finding of the parent's, never a crash of kvcheck.
//
//   kvcheck_llamacpp_engine --lib DIR --scenario FILE --out DIR [--type-k f32|f16]
//                           [--type-v f32|f16] [--flash-attn on|off]
//
// It writes into --out: model.gguf (a tiny `llama` model of the scenario's dimensions),
// q.npy, k.npy, v.npy (the pre-rope q, k, v llama.cpp computed, by uid), scenario.json (the
// scenario with those inputs) and trace/ (kvcheck-trace-1: every cell's K and V after each
// step, the rotated queries and the attention outputs). The schedule is llama-server's
// context shift: when the cache cannot take the next tokens, it removes `evict` tokens after
// the `sinks` kept ones and shifts the rest down (seq_rm, then seq_add). Exit status: 0
// done, 2 a scenario or option this driver does not support (the message names it), 3 the
// library refused something.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/policy.h"
#include "reference/rope.h"
#include "tools/harness/scenario/generator.h"
#include "tools/harness/io/npy.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/llamacpp/crash_site.h"
#include "tools/llamacpp/llama_api.h"
#include "tools/llamacpp/state_reader.h"
#include "tools/llamacpp/toy_model.h"

namespace {

using namespace kvcheck;
using namespace kvcheck::llamacpp;
namespace fs = std::filesystem;
using json = nlohmann::json;

struct Options {
  std::string lib, scenario, out;
  GgmlType type_k = GgmlType::f32, type_v = GgmlType::f32;
  bool flash_attn = false;
  // A fault planted in this driver (a self-test of kvcheck, not of llama.cpp): in its shift,
  // "remove-without-add" (seq_rm, no seq_add) or "add-short" (seq_add by k - 1);
  // "issue-12357" (gemma3: every layer's moved keys shifted with the full layers' rope, as
  // llama.cpp did before that fix); or "driver-crash", a signal raised in the
  // driver's own code at the first append.
  std::string plant;
  // Save the sequence right after the first shift's seq_add and restore it into a fresh
  // context before the next decode, as a server that swaps a slot out between the two.
  bool restore_after_shift = false;
  // A scenario whose whole run sizes the context (a replay of the steps before a crash).
  std::string context_of;
};

GgmlType parse_type(const std::string& option, const std::string& text) {
  if (text == "f32") return GgmlType::f32;
  if (text == "f16") return GgmlType::f16;
  if (text == "q8_0") return GgmlType::q8_0;
  if (text == "q4_0") return GgmlType::q4_0;
  if (text == "bf16") return GgmlType::bf16;
  throw Unsupported(fmt::format("{}: expected f32, f16, q8_0, q4_0 or bf16, got \"{}\"", option, text));
}

// The graph tensors one forward produced, by name and op ("Qcur-0/RESHAPE"), as float in
// logical order (ne[0] fastest).
struct Capture {
  const Api* api = nullptr;
  int layers = 0;
  std::map<std::string, std::vector<float>> tensors;
  // llama.cpp multiplied K (V) by a Hadamard matrix before storing it (quantized cells): a
  // MUL_MAT whose first source is named attn_inp_k_rot (attn_inp_v_rot). With V rotated,
  // kqv_out is still in the rotated basis (measured): the driver multiplies it back.
  bool keys_hadamard = false, values_hadamard = false;
  std::int64_t rotation_size[2] = {0, 0};  // K's and V's Hadamard matrix's ne[0]
  std::string unreadable;          // a wanted tensor of a type this driver does not read
};

bool wanted(const std::string& name, int layers) {
  for (int l = 0; l < layers; ++l)
    for (const char* stem : {"Qcur-", "Kcur-", "Vcur-", "kqv_out-", "Qcur_normed-", "Kcur_normed-"})
      if (name == stem + std::to_string(l)) return true;
  return false;
}

bool on_tensor(void* t, bool ask, void* user) {
  auto& c = *static_cast<Capture*>(user);
  const std::string name = c.api->ggml_get_name(t);
  if (name != reinterpret_cast<const char*>(t) + tensor_field::name.offset) return false;  // another layout: stop
  if (ask) {
    std::int32_t op;
    std::memcpy(&op, static_cast<const char*>(t) + tensor_field::op.offset, 4);
    const void* src0;
    std::memcpy(&src0, static_cast<const char*>(t) + tensor_field::src.offset, sizeof src0);
    if (src0 != nullptr && std::strcmp(c.api->ggml_op_name(op), "MUL_MAT") == 0) {
      const std::string factor = c.api->ggml_get_name(src0);
      if (factor == "attn_inp_k_rot" || factor == "attn_inp_v_rot") {
        const bool value = factor == "attn_inp_v_rot";
        (value ? c.values_hadamard : c.keys_hadamard) = true;
        std::memcpy(&c.rotation_size[value ? 1 : 0], static_cast<const char*>(src0) + tensor_field::ne.offset,
                    sizeof c.rotation_size[0]);
      }
    }
  }
  if (!wanted(name, c.layers)) return !ask;  // keep computing; ask for nothing else
  if (ask) return true;
  std::int32_t type;
  std::int64_t ne[4];
  std::uint64_t nb[4];
  std::int32_t op;
  std::memcpy(&type, static_cast<const char*>(t) + tensor_field::type.offset, 4);
  std::memcpy(ne, static_cast<const char*>(t) + tensor_field::ne.offset, sizeof ne);
  std::memcpy(nb, static_cast<const char*>(t) + tensor_field::nb.offset, sizeof nb);
  std::memcpy(&op, static_cast<const char*>(t) + tensor_field::op.offset, 4);
  std::vector<std::uint8_t> bytes(c.api->ggml_nbytes(t));
  c.api->ggml_backend_tensor_get(t, bytes.data(), 0, bytes.size());
  std::vector<float> values;
  values.reserve(static_cast<std::size_t>(ne[0] * ne[1] * ne[2] * ne[3]));
  for (std::int64_t i3 = 0; i3 < ne[3]; ++i3)
    for (std::int64_t i2 = 0; i2 < ne[2]; ++i2)
      for (std::int64_t i1 = 0; i1 < ne[1]; ++i1)
        for (std::int64_t i0 = 0; i0 < ne[0]; ++i0) {
          const std::size_t at = i0 * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
          if (type == 0) {
            float f;
            std::memcpy(&f, bytes.data() + at, 4);
            values.push_back(f);
          } else if (type == 1) {
            std::uint16_t h;
            std::memcpy(&h, bytes.data() + at, 2);
            values.push_back(c.api->ggml_fp16_to_fp32(h));
          } else {
            c.unreadable = fmt::format("{} is of ggml type {}, expected f32 or f16", name, type);
            return true;
          }
        }
  const std::string key = name + "/" + c.api->ggml_op_name(op);
  c.tensors[key] = std::move(values);
  return true;
}

// A captured tensor of exactly `size` values, by name and the first op found.
const std::vector<float>& captured(const Capture& c, const std::string& name, const std::vector<std::string>& ops,
                                   std::size_t size) {
  if (!c.unreadable.empty()) throw std::runtime_error(c.unreadable);
  for (const std::string& op : ops)
    if (const auto it = c.tensors.find(name + "/" + op); it != c.tensors.end()) {
      if (it->second.size() != size)
        throw std::runtime_error(fmt::format("{} ({}) holds {} values, expected {}: another llama.cpp graph", name, op,
                                             it->second.size(), size));
      return it->second;
    }
  throw std::runtime_error(fmt::format("the graph had no {} ({}): another llama.cpp graph", name, ops.front()));
}

bool is_quantized(GgmlType t) { return t == GgmlType::q8_0 || t == GgmlType::q4_0; }
const char* format_name(GgmlType t) { return t == GgmlType::q8_0 ? "q8_0" : "q4_0"; }

// Each D-vector of `x` multiplied by the normalized Sylvester Hadamard matrix (its own
// inverse): H_ij = (-1)^popcount(i & j) / sqrt(D), D a power of two. llama.cpp may rotate a
// head in narrower blocks (V at head_dim 128: 64 wide): then D is the block's width.
void unrotate_hadamard(std::vector<float>& x, std::size_t D) {
  std::vector<double> row(D);
  const double norm = 1.0 / std::sqrt(static_cast<double>(D));
  for (std::size_t at = 0; at + D <= x.size(); at += D) {
    for (std::size_t i = 0; i < D; ++i) {
      double sum = 0.0;
      for (std::size_t j = 0; j < D; ++j) sum += (__builtin_popcountll(i & j) % 2 ? -1.0 : 1.0) * x[at + j];
      row[i] = sum * norm;
    }
    for (std::size_t i = 0; i < D; ++i) x[at + i] = static_cast<float>(row[i]);
  }
}

// Writes `value` into one of llama_context_params' fields (their sizes are held to the
// types written by llama_api.h's static_asserts; this check guards the engine's own calls).
template <typename T>
void set_at(ContextParams& p, Field field, T value) {
  if (sizeof(T) != field.size)
    throw std::logic_error(fmt::format("set_at: {} bytes written into a field of {}", sizeof(T), field.size));
  std::memcpy(reinterpret_cast<unsigned char*>(&p) + field.offset, &value, sizeof(T));
}

void write_atomically(const fs::path& path, const std::string& text) {
  const fs::path temp = path.string() + ".tmp";
  std::ofstream(temp, std::ios::binary) << text;
  fs::rename(temp, path);
}

int run(const Options& o) {
  const Scenario s = load_scenario(o.scenario);
  const ToyArch arch = choose_arch(s);
  record_crash_site((fs::path(o.out) / "crash_site").string());
  if (is_quantized(o.type_v) && !o.flash_attn)
    throw Unsupported(fmt::format("--type-v {}: llama.cpp quantizes V only under flash attention: add --flash-attn on",
                                  format_name(o.type_v)));
  const int L = s.dims.layers, H = s.dims.heads, Hkv = s.dims.kv_heads, D = s.dims.head_dim;
  const Policy& policy = arch.global;  // the cache's shift follows the full layers' policy
  if (o.plant == "issue-12357" &&
      (!arch.gemma3 || policy.kind != PolicyKind::sink || o.type_k != GgmlType::f32 ||
       std::any_of(s.steps.begin(), s.steps.end(), [](const Step& step) { return step.op == StepOp::reorder; }) ||
       s.dims.batch != 1))
    throw Unsupported("--plant-fault issue-12357: a gemma3 scenario (sliding layers beside full ones) under a context "
                      "shift, one row without reorders, K in f32 (the plant rewrites one sequence's stored keys)");
  if (arch.gemma3 && (is_quantized(o.type_k) || is_quantized(o.type_v)))
    throw Unsupported("--type-k/--type-v q8_0 or q4_0 with the gemma3 arch: not yet (llama.cpp quantizes its scaled "
                      "query; f32, f16 and bf16 cells only)");
  // Rows are sequences of one unified cache: each holds at most a window (or its longest
  // row), and a reorder needs as many temporary sequence ids again. Sized from the whole
  // scenario when this run replays only its first steps (--context-of), so the replay's
  // cache is the one the whole run had.
  const Scenario sized = o.context_of.empty() ? s : load_scenario(o.context_of);
  std::int64_t max_rows = sized.dims.batch;
  for (const Step& step : sized.steps)
    max_rows = std::max<std::int64_t>(max_rows, step.op == StepOp::reset     ? *step.batch
                                                : step.op == StepOp::reorder ? static_cast<std::int64_t>(step.rows.size())
                                                                             : 0);
  if (2 * max_rows > 256) throw Unsupported(fmt::format("{}: {} rows: llama.cpp holds at most 128 here", s.file, max_rows));
  if (o.restore_after_shift && max_rows > 1)
    throw Unsupported("--restore-after-shift restores one sequence into a fresh context: batch 1 only");
  const std::int64_t per_row =
      policy.kind == PolicyKind::sink ? policy.window : std::max<std::int64_t>(longest_row(sized), 1);
  const std::int64_t n_ctx = per_row * max_rows;
  const std::int64_t uids = count_uids(s);
  if (const double bytes = toy_model_bytes(s, n_ctx); bytes > kMemoryBudget)
    throw Unsupported(fmt::format("{}: /dimensions: the llama.cpp model kvcheck builds for this scenario would take about "
                                  "{:.1f} GB ({} layers, {} heads x head_dim {}, {} context cells); kvcheck accepts up "
                                  "to {:.1f} GB",
                                  s.file, bytes / 1e9, L, H, D, n_ctx, kMemoryBudget / 1e9));
  // As the scenario parser refuses a kv_quant it cannot store: the driver captures one.
  if ((is_quantized(o.type_k) || is_quantized(o.type_v)) && D % 32 != 0)
    throw Unsupported(fmt::format("{}: /dimensions/head_dim: q8_0 and q4_0 quantize blocks of 32 along head_dim; "
                                  "head_dim {} is not a multiple of 32",
                                  s.file, D));

  fs::create_directories(fs::path(o.out) / "trace");
  const std::string model_path = (fs::path(o.out) / "model.gguf").string();
  write_atomically(model_path, gguf_bytes(toy_model(s, arch, n_ctx)));

  const Api api = load_api(o.lib);
  api.llama_log_set([](int level, const char* text, void*) {
    if (level == 4) fmt::print(stderr, "llama.cpp: {}", text);  // errors only
  }, nullptr);
  api.ggml_backend_load_all_from_path(o.lib.c_str());
  api.llama_backend_init();
  void* model = api.llama_model_load_from_file(model_path.c_str(), api.llama_model_default_params());
  if (model == nullptr) throw std::runtime_error("llama.cpp refused the model it was given (model.gguf)");
  Capture capture;
  capture.api = &api;
  capture.layers = L;
  ContextParams cp = api.llama_context_default_params();
  const auto cells = static_cast<std::uint32_t>(n_ctx);
  set_at(cp, context_field::n_ctx, cells);
  set_at(cp, context_field::n_batch, cells);
  set_at(cp, context_field::n_ubatch, cells);
  set_at(cp, context_field::n_seq_max, static_cast<std::uint32_t>(2 * max_rows));
  set_at(cp, context_field::kv_unified, true);  // one cache for every sequence, cells shared by forks
  // llama-server's default: the sliding layers' cells sized to their windows. With n_ubatch
  // = n_ctx that is as many cells as the full layers', so llama.cpp allows the shift.
  set_at(cp, context_field::swa_full, false);
  set_at(cp, context_field::flash_attn_type, static_cast<std::int32_t>(o.flash_attn ? 1 : 0));
  set_at(cp, context_field::type_k, static_cast<std::int32_t>(o.type_k));
  set_at(cp, context_field::type_v, static_cast<std::int32_t>(o.type_v));
  set_at(cp, context_field::n_threads, static_cast<std::int32_t>(1));  // tiny graphs: a second thread only spins
  set_at(cp, context_field::n_threads_batch, static_cast<std::int32_t>(1));
  set_at(cp, context_field::cb_eval, reinterpret_cast<void*>(&on_tensor));
  set_at(cp, context_field::cb_eval_user_data, static_cast<void*>(&capture));
  void* ctx = api.llama_init_from_model(model, cp);
  if (ctx == nullptr) throw std::runtime_error("llama.cpp refused the context parameters");
  if (api.llama_n_threads(ctx) != 1)
    throw std::runtime_error(fmt::format("llama_n_threads() is {}, set 1: the context parameters are laid out otherwise",
                                         api.llama_n_threads(ctx)));
  if (api.llama_n_batch(ctx) != cells)
    throw std::runtime_error(fmt::format("llama_n_batch() is {}, set {}: the context parameters are laid out otherwise",
                                         api.llama_n_batch(ctx), cells));
  void* memory = api.llama_get_memory(ctx);
  if (policy.kind == PolicyKind::sink && !api.llama_memory_can_shift(memory))
    throw Unsupported("this cache cannot shift (llama_memory_can_shift is false)");

  const auto embd = static_cast<std::size_t>(H * D);
  std::vector<float> q_in(static_cast<std::size_t>(L * uids * H * D)), k_in(static_cast<std::size_t>(L * uids * Hkv * D)),
      v_in(k_in.size());
  json steps = json::array();
  // Appends the driver ran as several forwards (a shift between them), by their index in the
  // scenario's "steps": each forward's tokens per row, as the captured scenario writes them.
  std::map<int, std::vector<std::vector<std::int64_t>>> split_appends;
  // One llama.cpp sequence per row (seq id = row). Tokens evicted and seen, per row.
  struct Row {
    std::int64_t evicted = 0, tokens = 0;
  };
  std::vector<Row> rows(static_cast<std::size_t>(s.dims.batch));
  std::uint64_t next_uid = 0;
  std::string failure;  // llama.cpp refused a step: the trace says so there, and stops
  bool restored = false;
  // The next position of a sequence is the cache's own (pos_max + 1), as a server that
  // trusts its cache: a driver fault that leaves positions unshifted then shows in the cells.
  const auto next_position = [&](int seq) { return api.llama_memory_seq_pos_max(memory, seq) + 1; };
  // llama.cpp issue 12357, planted: the pending shift applied to every layer's moved keys
  // with the full layers' rope (base and linear scale), the sliding layers' included, as
  // llama.cpp's K-shift did before it took each layer's own. Through the public API: right
  // after seq_add the sequence's state holds the new positions and the keys not yet
  // shifted; the driver rotates those by -discard and restores the state, which drops
  // llama.cpp's own pending shift (nothing is shifted twice).
  const auto shift_with_the_full_layers_rope = [&](int seq, std::int32_t keep, std::int32_t discard) {
    std::vector<std::uint8_t> state(api.llama_state_seq_get_size(ctx, seq));
    if (api.llama_state_seq_get_data(ctx, state.data(), state.size(), seq) != state.size())
      throw std::runtime_error("llama_state_seq_get_data wrote another size than it said");
    const auto width = static_cast<std::size_t>(Hkv * D), Ds = static_cast<std::size_t>(D);
    for (const Cells& section : read_sequence_sections(state, width, api.ggml_fp16_to_fp32))
      for (const CellLayer& layer : section.layers) {
        if (layer.k_type != static_cast<std::int32_t>(GgmlType::f32))
          throw std::runtime_error(fmt::format("the plant rewrites f32 keys; the state holds ggml type {}", layer.k_type));
        for (std::size_t cell = 0; cell < section.positions.size(); ++cell) {
          if (section.positions[cell] < keep) continue;  // a sink: not moved
          for (std::size_t g = 0; g < static_cast<std::size_t>(Hkv); ++g) {
            float* key = reinterpret_cast<float*>(state.data() + layer.k_at + cell * layer.k_row) + g * Ds;
            std::vector<double> x(key, key + Ds);
            const std::vector<double> y = reference::rotate(x, -static_cast<double>(discard), arch.global_rope);
            for (std::size_t d = 0; d < Ds; ++d) key[d] = static_cast<float>(y[d]);
          }
        }
      }
    if (api.llama_state_seq_set_data(ctx, state.data(), state.size(), seq) == 0)
      throw std::runtime_error("llama_state_seq_set_data refused the sequence the plant rewrote");
  };
  // llama-server's context shift for one sequence: n_keep = sinks, n_discard = evict.
  const auto shift = [&](int seq, std::int64_t due) {
    Row& row = rows[static_cast<std::size_t>(seq)];
    while (row.evicted < due) {
      const auto keep = static_cast<std::int32_t>(policy.sinks), discard = static_cast<std::int32_t>(policy.evict);
      const auto end = static_cast<std::int32_t>(next_position(seq));
      api.llama_memory_seq_rm(memory, seq, keep, keep + discard);
      if (o.plant != "remove-without-add")
        api.llama_memory_seq_add(memory, seq, keep + discard, end, o.plant == "add-short" ? 1 - discard : -discard);
      if (o.plant == "issue-12357") shift_with_the_full_layers_rope(seq, keep, discard);
      row.evicted += discard;
      if (o.restore_after_shift && !restored) {
        restored = true;
        std::vector<std::uint8_t> saved(api.llama_state_seq_get_size(ctx, seq));
        if (api.llama_state_seq_get_data(ctx, saved.data(), saved.size(), seq) != saved.size())
          throw std::runtime_error("llama_state_seq_get_data wrote another size than it said");
        api.llama_free(ctx);
        ctx = api.llama_init_from_model(model, cp);
        if (ctx == nullptr) throw std::runtime_error("llama.cpp refused a second context");
        memory = api.llama_get_memory(ctx);
        if (api.llama_state_seq_set_data(ctx, saved.data(), saved.size(), seq) == 0)
          throw std::runtime_error("llama_state_seq_set_data refused the saved sequence");
      }
    }
  };
  const auto evicted_at = [&](std::int64_t t) {
    return policy.kind == PolicyKind::sink ? reference::evicted_count(policy, t) : std::int64_t{0};
  };
  // llama.cpp's caches (gemma3: the full layers', then the sliding layers'), how many layers
  // each holds, and where layer l lives: (cache, its index there).
  const std::size_t caches = arch.gemma3 ? 2 : 1;
  std::vector<std::size_t> cache_layers(caches, 0);
  std::vector<std::pair<std::size_t, std::size_t>> home;
  for (int l = 0; l < L; ++l) {
    const std::size_t c = arch.gemma3 && arch.sliding[static_cast<std::size_t>(l)] ? 1 : 0;
    home.emplace_back(c, cache_layers[c]++);
  }
  // Every cell of every sequence after step i, and (an append) the rotated queries and the
  // outputs [L][B][H][n][D] (zero at left padding).
  const auto record = [&](std::int64_t n, const std::vector<float>* out, const std::vector<float>* q_rot) {
    const std::size_t i = steps.size();  // the captured scenario's step
    const auto B = rows.size();
    std::vector<std::vector<Cells>> held(caches);  // [cache][row]
    if (arch.gemma3) {
      // The whole context's state: a sequence's leaves out the sliding layers' cells that its
      // window masks, which a shift can bring back into view (SPEC 10.4).
      std::vector<std::uint8_t> state(api.llama_state_get_size(ctx));
      if (api.llama_state_get_data(ctx, state.data(), state.size()) != state.size())
        throw std::runtime_error("llama_state_get_data wrote another size than llama_state_get_size said");
      // The layout of v0.5.0 (the arch's name, then the caches): another build may write more
      // first, which is the libraries' difference (exit 2), not kvcheck's fault.
      const auto another_layout = [&](const std::string& why) {
        const std::string text = fmt::format("the context state (llama_state_get_data) is not laid out as llama.cpp "
                                             "{}'s, which the gemma3 arch reads: {}", kKnownVersion, why);
        if (version_of(api) != kKnownVersion) throw ApiRefused(text);
        throw std::runtime_error(text);
      };
      ContextState context;
      try {
        context = read_context_state(state, static_cast<std::size_t>(Hkv * D), api.ggml_fp16_to_fp32);
      } catch (const std::runtime_error& e) {
        another_layout(e.what());
      }
      if (context.arch != "gemma3" || context.sections.size() != caches)
        another_layout(fmt::format("arch \"{}\" with {} caches, expected gemma3 with {} (full layers, then sliding)",
                                   context.arch, context.sections.size(), caches));
      for (std::size_t c = 0; c < caches; ++c)
        for (std::size_t b = 0; b < B; ++b) held[c].push_back(context.sections[c].of_sequence(static_cast<std::int32_t>(b)));
    } else {
      for (std::size_t b = 0; b < B; ++b) {
        const auto seq = static_cast<std::int32_t>(b);
        std::vector<std::uint8_t> state(api.llama_state_seq_get_size(ctx, seq));
        if (api.llama_state_seq_get_data(ctx, state.data(), state.size(), seq) != state.size())
          throw std::runtime_error("llama_state_seq_get_data wrote another size than llama_state_seq_get_size said");
        held[0].push_back(read_cells(state, static_cast<std::size_t>(Hkv * D), api.ggml_fp16_to_fp32));
      }
    }
    for (std::size_t c = 0; c < caches; ++c)
      for (const Cells& row_cells : held[c])
        if (!row_cells.positions.empty() && row_cells.layers.size() != cache_layers[c])
          throw std::runtime_error(fmt::format("the state holds {} layers in cache {}, the model {}", row_cells.layers.size(),
                                               c, cache_layers[c]));
    json layers = json::array();
    const auto Hs = static_cast<std::size_t>(H), Hkvs = static_cast<std::size_t>(Hkv), Ds = static_cast<std::size_t>(D),
               ns = static_cast<std::size_t>(n);
    for (int l = 0; l < L; ++l) {
      const auto [cache, within] = home[static_cast<std::size_t>(l)];
      const std::vector<Cells>& cells_of = held[cache];  // per row: the cache holding layer l
      std::size_t slots = 0;
      for (const Cells& row_cells : cells_of) slots = std::max(slots, row_cells.positions.size());
      std::vector<float> keys(B * Hkvs * slots * Ds, 0.0f), values(keys.size(), 0.0f);  // zero: an unused slot
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t cell = 0; cell < cells_of[b].positions.size(); ++cell)
          for (std::size_t g = 0; g < Hkvs; ++g)
            for (std::size_t d = 0; d < Ds; ++d) {
              const std::size_t src = (cell * Hkvs + g) * Ds + d, dst = ((b * Hkvs + g) * slots + cell) * Ds + d;
              keys[dst] = cells_of[b].layers[within].k[src];
              values[dst] = cells_of[b].layers[within].v[src];
            }
      // The scenario declares a Hadamard matrix narrower than the head as "transform_block"
      // (blocks along head_dim); it must be a power of two that divides head_dim.
      for (const bool value : {false, true}) {
        const std::int64_t width = capture.rotation_size[value ? 1 : 0];
        if ((value ? capture.values_hadamard : capture.keys_hadamard) &&
            (width < 2 || width > D || (width & (width - 1)) != 0 || D % width != 0))
          throw Unsupported(fmt::format("llama.cpp rotates {} by a Hadamard matrix {} wide at head_dim {}: not a "
                                        "power of two that divides head_dim, so this cache cannot be declared",
                                        value ? "V" : "K", width, D));
      }
      // H R(p) k back to R(p) k, block by block
      if (capture.keys_hadamard) unrotate_hadamard(keys, static_cast<std::size_t>(capture.rotation_size[0]));
      if (capture.values_hadamard) unrotate_hadamard(values, static_cast<std::size_t>(capture.rotation_size[1]));
      const std::string stem = fmt::format("step{:03d}_l{}_", i, l);
      const fs::path dir = fs::path(o.out) / "trace";
      write_npy((dir / (stem + "keys.npy")).string(), {B, Hkvs, slots, Ds}, keys);
      write_npy((dir / (stem + "values.npy")).string(), {B, Hkvs, slots, Ds}, values);
      json files = {{"keys", stem + "keys.npy"}, {"values", stem + "values.npy"}};
      // q8_0 and q4_0 cells as stored (SPEC 9.3): the codes and scales the checker compares exactly.
      for (const bool value : {false, true}) {
        if (!is_quantized(value ? o.type_v : o.type_k)) continue;
        const std::size_t G = Ds / 32;
        std::vector<std::int8_t> codes(B * Hkvs * slots * Ds, 0);
        std::vector<float> scales(B * Hkvs * slots * G, 0.0f);
        for (std::size_t b = 0; b < B; ++b) {
          if (cells_of[b].layers.empty()) continue;  // no cells
          const CellLayer& layer_cells = cells_of[b].layers[within];
          for (std::size_t cell = 0; cell < cells_of[b].positions.size(); ++cell)
            for (std::size_t g = 0; g < Hkvs; ++g) {
              const std::size_t dst = (b * Hkvs + g) * slots + cell;
              const auto& c = value ? layer_cells.v_codes : layer_cells.k_codes;
              const auto& sc = value ? layer_cells.v_scales : layer_cells.k_scales;
              std::copy_n(c.begin() + static_cast<std::ptrdiff_t>((cell * Hkvs + g) * Ds), Ds,
                          codes.begin() + static_cast<std::ptrdiff_t>(dst * Ds));
              std::copy_n(sc.begin() + static_cast<std::ptrdiff_t>((cell * Hkvs + g) * G), G,
                          scales.begin() + static_cast<std::ptrdiff_t>(dst * G));
            }
        }
        const std::string name = value ? "v" : "k";
        write_npy((dir / (stem + name + "_codes.npy")).string(), {B, Hkvs, slots, Ds}, codes);
        write_npy((dir / (stem + name + "_scales.npy")).string(), {B, Hkvs, slots, G}, scales);
        files[name + "_codes"] = stem + name + "_codes.npy";
        files[name + "_scales"] = stem + name + "_scales.npy";
      }
      if (out != nullptr) {
        const std::size_t size = B * Hs * ns * Ds;
        const auto at = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(l) * size);
        write_npy((dir / (stem + "out.npy")).string(), {B, Hs, ns, Ds},
                  std::vector<float>(out->begin() + at, out->begin() + at + static_cast<std::ptrdiff_t>(size)));
        write_npy((dir / (stem + "q.npy")).string(), {B, Hs, ns, Ds},
                  std::vector<float>(q_rot->begin() + at, q_rot->begin() + at + static_cast<std::ptrdiff_t>(size)));
        files["out"] = stem + "out.npy";
        files["q"] = stem + "q.npy";
      }
      layers.push_back(files);
    }
    steps.push_back({{"layers", layers}});
  };

  for (std::size_t i = 0; i < s.steps.size(); ++i) {
    const Step& step = s.steps[i];
    if (!failure.empty()) {
      steps.push_back(json::object());
      continue;
    }
    std::ofstream(fs::path(o.out) / "progress") << i << "\n";  // where a crash happens
    if (o.plant == "driver-crash" && step.op == StepOp::append) std::raise(SIGSEGV);  // kvcheck's own fault
    if (o.plant == "driver-hang" && step.op == StepOp::append)
      for (volatile unsigned long spin = 0;;) {  // a hang in kvcheck's own code
        const unsigned long next = spin + 1;
        spin = next;
      }
    if (step.op == StepOp::reset) {
      api.llama_memory_clear(memory, true);
      rows.assign(static_cast<std::size_t>(*step.batch), Row{});
      steps.push_back(json::object());
      continue;
    }
    if (step.op == StepOp::crop) {
      // As a server rewinds a slot: every cell from the cropped length's cache position on
      // is removed (seq_rm). A shifted cache cannot give back tokens it discarded: where the
      // cropped row would need one (the policy refuses the crop), the driver refuses too.
      std::string refused;
      for (std::size_t b = 0; b < rows.size() && refused.empty(); ++b) {
        if (rows[b].tokens <= step.length) continue;
        for (int l = 0; l < L && refused.empty(); ++l) {
          const Policy& layer = s.policy(l);
          const std::int64_t needed = reference::crop_lacks(layer, rows[b].tokens, step.length);
          if (needed >= 0)
            refused = fmt::format("crop to {} tokens needs token {} of row {}{}, {}", step.length, needed, b,
                                  arch.gemma3 ? fmt::format(" in layer {}", l) : std::string(),
                                  layer.swa > 0                    ? "which the sliding cells may have given away"
                                  : layer.kind == PolicyKind::sink ? "discarded by a context shift"
                                                                   : "beyond the sliding window");
        }
      }
      if (!refused.empty()) {
        steps.push_back({{"error", "the driver refuses: " + refused}});
        continue;
      }
      for (std::size_t b = 0; b < rows.size(); ++b) {
        Row& row = rows[b];
        if (row.tokens <= step.length) continue;
        const std::int64_t sinks = policy.kind == PolicyKind::sink ? policy.sinks : 0;
        const std::int64_t from = step.length < sinks ? step.length : step.length - row.evicted;
        api.llama_memory_seq_rm(memory, static_cast<std::int32_t>(b), static_cast<std::int32_t>(from), -1);
        row.tokens = step.length;
        row.evicted = step.length == 0 ? 0 : evicted_at(step.length - 1);
      }
      record(0, nullptr, nullptr);
      continue;
    }
    if (step.op == StepOp::reorder) {
      // New row b takes old row rows[b]'s cells, shared (seq_cp), through temporary ids
      // above every old and new row, as a beam search keeps its beams.
      const auto old = static_cast<std::int32_t>(rows.size());
      const std::int32_t temp = std::max(old, static_cast<std::int32_t>(step.rows.size()));
      for (std::int32_t r = 0; r < old; ++r) api.llama_memory_seq_cp(memory, r, temp + r, -1, -1);
      for (std::int32_t r = 0; r < old; ++r) api.llama_memory_seq_rm(memory, r, -1, -1);
      std::vector<Row> next;
      for (std::size_t b = 0; b < step.rows.size(); ++b) {
        api.llama_memory_seq_cp(memory, temp + step.rows[b], static_cast<std::int32_t>(b), -1, -1);
        next.push_back(rows[static_cast<std::size_t>(step.rows[b])]);
      }
      for (std::int32_t r = 0; r < old; ++r) api.llama_memory_seq_rm(memory, temp + r, -1, -1);
      rows = std::move(next);
      record(0, nullptr, nullptr);
      continue;
    }
    const auto B = rows.size();
    const std::int64_t n = *std::max_element(step.tokens.begin(), step.tokens.end());
    std::vector<std::int64_t> start_tokens(B);  // each row's tokens before this step
    for (std::size_t b = 0; b < B; ++b) start_tokens[b] = rows[b].tokens;
    const auto pad = [&](std::size_t b) { return n - step.tokens[b]; };
    const auto token_at = [&](std::size_t b, std::int64_t place) { return start_tokens[b] + place - pad(b); };
    // The step runs as forwards within which no row evicts, with a shift between them. Each
    // forward is recorded as a step of its own (the captured scenario splits the append the
    // same way), so the checker sees every state a shift creates: a shift re-quantizes q8_0
    // keys, and a state never shown could not be judged.
    std::vector<std::vector<std::int64_t>> forward_counts;  // per recorded forward, per row
    std::int64_t first = 0;
    while (first < n) {
      std::int64_t end = first + 1;
      const auto same_eviction = [&](std::int64_t place) {
        for (std::size_t b = 0; b < B; ++b)
          if (place - 1 >= pad(b) && evicted_at(token_at(b, place)) != evicted_at(token_at(b, place - 1))) return false;
        return true;
      };
      while (end < n && same_eviction(end)) ++end;
      struct Entry {
        std::size_t row;
        std::int64_t place;
        std::uint64_t uid;
      };
      // uids as the captured scenario gives them: forward order, then row order, then place.
      std::vector<Entry> entries;
      std::vector<std::int64_t> counts(B, 0);
      std::uint64_t uid = next_uid;
      for (std::size_t b = 0; b < B; ++b) {
        const std::int64_t from = std::max(first, pad(b));
        if (from >= end) continue;
        shift(static_cast<int>(b), evicted_at(token_at(b, from)));
        for (std::int64_t place = from; place < end; ++place) entries.push_back({b, place, uid++});
        counts[b] = end - from;
      }
      if (entries.empty()) {  // every row padded here
        first = end;
        continue;
      }
      const std::int64_t nf = end - first;  // this forward's places; a row's tokens end at `end`
      std::vector<float> out(static_cast<std::size_t>(L) * B * H * nf * D, 0.0f), q_rot(out.size(), 0.0f);
      const auto count = static_cast<std::int32_t>(entries.size());
      Batch batch = api.llama_batch_init(count, static_cast<std::int32_t>(embd), 1);
      batch.n_tokens = count;
      std::vector<std::int64_t> position(B);
      for (std::size_t b = 0; b < B; ++b) position[b] = next_position(static_cast<int>(b));
      for (std::int32_t j = 0; j < count; ++j) {
        const Entry& e = entries[static_cast<std::size_t>(j)];
        for (std::size_t x = 0; x < embd; ++x)
          batch.embd[static_cast<std::size_t>(j) * embd + x] =
              generated_value(s.inputs.seed, 0, e.uid, static_cast<Tensor>(3), 0, static_cast<int>(x));
        batch.pos[j] = static_cast<std::int32_t>(position[e.row]++);
        batch.n_seq_id[j] = 1;
        batch.seq_id[j][0] = static_cast<std::int32_t>(e.row);
        batch.logits[j] = 1;
      }
      capture.tensors.clear();
      const std::int32_t status = api.llama_decode(ctx, batch);
      api.llama_batch_free(batch);
      if (status != 0) {
        failure = fmt::format("llama_decode returned {} (see llama.cpp's words on stderr)", status);
        break;
      }
      for (int l = 0; l < L; ++l) {
        const std::string tag = std::to_string(l);
        const auto tokens = static_cast<std::size_t>(count);
        const std::size_t q_size = tokens * static_cast<std::size_t>(H * D), kv_size = tokens * static_cast<std::size_t>(Hkv * D);
        // Pre-rope q and k: the reshaped projection, or (builds before build_qkv, early 2026)
        // the projection itself, the same values in the same order (the model has no biases).
        // gemma3: after its per-head q and k norms (a MUL by the norm's weight), before the rope.
        const std::vector<std::string> pre_rope =
            arch.gemma3 ? std::vector<std::string>{"MUL"} : std::vector<std::string>{"RESHAPE", "MUL_MAT"};
        const auto& qp = captured(capture, arch.q_stem() + tag, pre_rope, q_size);
        const auto& kp = captured(capture, arch.k_stem() + tag, pre_rope, kv_size);
        const auto& vp = captured(capture, "Vcur-" + tag, {"RESHAPE", "VIEW", "MUL_MAT"}, kv_size);
        const auto& qr = captured(capture, "Qcur-" + tag, {"ROPE"}, q_size);
        std::vector<float> kqv = captured(capture, "kqv_out-" + tag, {"CONT", "RESHAPE", "VIEW"}, q_size);
        // With V stored as H v, the attention output is H out until llama.cpp multiplies it
        // back after kqv_out: undone here, per head.
        if (capture.values_hadamard) unrotate_hadamard(kqv, static_cast<std::size_t>(capture.rotation_size[1]));
        for (std::int32_t j = 0; j < count; ++j) {
          const Entry& e = entries[static_cast<std::size_t>(j)];
          const auto ls = static_cast<std::size_t>(l), place = static_cast<std::size_t>(e.place - first);
          for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d) {
              const std::size_t src = (static_cast<std::size_t>(j) * H + h) * D + d;  // [tokens][H][D]
              const std::size_t dst = (((ls * B + e.row) * H + h) * static_cast<std::size_t>(nf) + place) * D + d;
              q_in[((ls * uids + e.uid) * H + h) * D + d] = qp[src];
              q_rot[dst] = qr[src];
              out[dst] = kqv[src];
            }
          for (int g = 0; g < Hkv; ++g)
            for (int d = 0; d < D; ++d) {
              const std::size_t src = (static_cast<std::size_t>(j) * Hkv + g) * D + d;
              k_in[((ls * uids + e.uid) * Hkv + g) * D + d] = kp[src];
              v_in[((ls * uids + e.uid) * Hkv + g) * D + d] = vp[src];
            }
        }
      }
      for (std::size_t b = 0; b < B; ++b) rows[b].tokens += counts[b];
      next_uid = uid;
      record(nf, &out, &q_rot);
      forward_counts.push_back(std::move(counts));
      first = end;
    }
    if (!failure.empty()) {
      // The forwards before the refused one stay recorded; the rest of the append is the
      // step llama.cpp refused.
      std::vector<std::int64_t> rest(B);
      for (std::size_t b = 0; b < B; ++b) rest[b] = start_tokens[b] + step.tokens[b] - rows[b].tokens;
      forward_counts.push_back(std::move(rest));
      steps.push_back({{"error", failure}});
    }
    if (forward_counts.size() > 1) split_appends[step.source_index] = std::move(forward_counts);
  }
  std::ofstream(fs::path(o.out) / "progress") << "done\n";  // a crash from here on is no step's
  api.llama_free(ctx);
  api.llama_model_free(model);

  const auto Ls = static_cast<std::size_t>(L), Us = static_cast<std::size_t>(uids), Ds = static_cast<std::size_t>(D);
  write_npy((fs::path(o.out) / "q.npy").string(), {Ls, Us, static_cast<std::size_t>(H), Ds}, q_in);
  write_npy((fs::path(o.out) / "k.npy").string(), {Ls, Us, static_cast<std::size_t>(Hkv), Ds}, k_in);
  write_npy((fs::path(o.out) / "v.npy").string(), {Ls, Us, static_cast<std::size_t>(Hkv), Ds}, v_in);
  // The scenario as run: llama.cpp's own inputs, its rope layout (the llama arch rotates
  // interleaved pairs), and the precision its outputs carry.
  json scenario = json::parse(s.source_json);
  scenario.erase("seed");
  if (!split_appends.empty()) {
    json written = json::array();
    for (std::size_t k = 0; k < scenario["steps"].size(); ++k) {
      const auto split = split_appends.find(static_cast<int>(k));
      if (split == split_appends.end()) {
        written.push_back(scenario["steps"][k]);
        continue;
      }
      for (const std::vector<std::int64_t>& counts : split->second) written.push_back({{"op", "append"}, {"tokens", counts}});
    }
    scenario["steps"] = written;
  }
  scenario["inputs"] = {{"q", "q.npy"}, {"k", "k.npy"}, {"v", "v.npy"}};
  if (scenario["rope"].is_array())
    for (json& rope : scenario["rope"]) rope["layout"] = arch.layout();
  else
    scenario["rope"]["layout"] = arch.layout();
  // A q8_0 or q4_0 cache is declared as SPEC 9 describes it (blocks of 32, float16 scales,
  // the Hadamard transform when llama.cpp applied one), with or without flash attention:
  // both store the same codes and dot them with a q8_0 query. (Declaring q8_0 K as bfloat16
  // under flash attention, as before, judged the same stored keys by another rule.)
  // ggml's CPU matmul converts Q to q8_0, the dot-product type of q8_0 and q4_0 K, before
  // K Q: declared, so R_stored quantizes the query the same way (kvcheck's `query` extension).
  if (is_quantized(o.type_k) || is_quantized(o.type_v)) {
    json q = {{"transform", capture.keys_hadamard || capture.values_hadamard ? "hadamard" : "none"}};
    if (is_quantized(o.type_k)) q["k"] = {{"format", format_name(o.type_k)}}, q["query"] = "q8_0";
    if (is_quantized(o.type_v)) q["v"] = {{"format", format_name(o.type_v)}};
    for (const bool value : {false, true}) {  // a rotation narrower than the head (kvcheck's extension)
      const std::int64_t width = capture.rotation_size[value ? 1 : 0];
      const char* name = value ? "v" : "k";
      if ((value ? capture.values_hadamard : capture.keys_hadamard) && width != D && q.contains(name))
        q[name]["transform_block"] = width;
    }
    scenario["kv_quant"] = q;
  }
  const bool bf16 = o.type_k == GgmlType::bf16 || o.type_v == GgmlType::bf16;
  // Flash attention works in float16 over float cells; over q8_0 K and V it dots q8_0 codes
  // and accumulates dequantized rows in float32 (measured: within float32's tolerance).
  const bool quantized_both = is_quantized(o.type_k) && is_quantized(o.type_v);
  const bool half = o.type_k == GgmlType::f16 || o.type_v == GgmlType::f16 || (o.flash_attn && !quantized_both);
  scenario["kv_dtype"] = bf16 ? "bfloat16" : half ? "float16" : "float32";
  write_atomically(fs::path(o.out) / "scenario.json", scenario.dump(2) + "\n");
  const json manifest = {{"format", "kvcheck-trace-1"},
                         {"scenario", s.name},
                         {"producer", fmt::format("kvcheck_llamacpp_engine, llama.cpp {} (structures from {})", version_of(api),
                                                  abi_source())},
                         {"key_positions", "cache-relative"},
                         // A sliding layer without a shift keeps its masked cells until llama.cpp
                         // reuses them: beyond the window for good (SPEC 5's "never").
                         {"eviction", arch.gemma3 && policy.kind != PolicyKind::sink ? "never" : "lazy"},
                         {"steps", steps}};
  write_atomically(fs::path(o.out) / "trace" / "manifest.json", manifest.dump(1) + "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (i + 1 >= argc) throw Unsupported(arg + ": expected a value");
      const std::string value = argv[++i];
      if (arg == "--lib")
        o.lib = value;
      else if (arg == "--scenario")
        o.scenario = value;
      else if (arg == "--out")
        o.out = value;
      else if (arg == "--type-k")
        o.type_k = parse_type(arg, value);
      else if (arg == "--type-v")
        o.type_v = parse_type(arg, value);
      else if (arg == "--flash-attn")
        o.flash_attn = value == "on";
      else if (arg == "--plant-fault" && (value == "remove-without-add" || value == "add-short" || value == "driver-crash" ||
                                                 value == "driver-hang" || value == "issue-12357"))
        o.plant = value;
      else if (arg == "--restore-after-shift")
        o.restore_after_shift = value == "on";
      else if (arg == "--context-of")
        o.context_of = value;
      else
        throw Unsupported("unknown option " + arg);
    }
    if (o.lib.empty() || o.scenario.empty() || o.out.empty()) throw Unsupported("--lib, --scenario and --out are required");
    return run(o);
  } catch (const Unsupported& e) {
    fmt::print(stderr, "kvcheck: error: {}\n", e.what());
    return 2;
  } catch (const InputError& e) {
    fmt::print(stderr, "kvcheck: error: {}\n", e.what());
    return 2;
  } catch (const ApiRefused& e) {
    fmt::print(stderr, "kvcheck: error: LLAMACPP_DIR: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvcheck llamacpp: {}\n", e.what());
    return 3;
  }
}
