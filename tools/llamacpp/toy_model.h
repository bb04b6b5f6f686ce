// The tiny llama.cpp model kvcheck builds for a scenario: which architecture can run it
// (refusing, by name, what none can), and that model's GGUF. Two architectures:
// - llama: one rope and one policy for every layer (llama.cpp's unified cache);
// - gemma3: sliding layers beside full ones (llama.cpp's iSWA cache: the sliding layers'
//   cells apart), each kind with its own rope, q and k normalized per head before the rope,
//   NEOX rotation; under a context shift (SPEC 10.4) or without one.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "tools/harness/scenario/scenario.h"
#include "tools/llamacpp/gguf_writer.h"

namespace kvcheck::llamacpp {

// A scenario or option the driver cannot run: exit 2, the message naming it.
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ToyArch {
  bool gemma3 = false;
  std::vector<bool> sliding;  // per layer: in the sliding-window cache (gemma3)
  Policy global;              // the full layers' policy (every layer's, for llama)
  Rope global_rope, sliding_rope;
  std::int64_t window = 0;  // the sliding layers' window: llama.cpp's n_swa

  const char* name() const { return gemma3 ? "gemma3" : "llama"; }
  // The graph tensors holding the pre-rope q and k: gemma3's, after its per-head norms.
  std::string q_stem() const { return gemma3 ? "Qcur_normed-" : "Qcur-"; }
  std::string k_stem() const { return gemma3 ? "Kcur_normed-" : "Kcur-"; }
  // llama rotates interleaved pairs; gemma3 is NEOX (pairs i, i + D/2).
  const char* layout() const { return gemma3 ? "half" : "interleaved"; }
};

// The architecture that runs `s`, or Unsupported naming the file, the JSON path and why.
ToyArch choose_arch(const Scenario& s);

// The memory the toy model costs before llama.cpp runs it (weights, n_ctx cells, a whole
// context's attention scores): an estimate, so a scenario too large is refused with exit 2
// rather than dying of bad_alloc.
double toy_model_bytes(const Scenario& s, std::int64_t n_ctx);

GgufFile toy_model(const Scenario& s, const ToyArch& arch, std::int64_t n_ctx);

}  // namespace kvcheck::llamacpp
