// A GGUF v3 file of a tiny model, written from the format's description: the
// header, key-value pairs, tensor infos, then float32 tensor data aligned to 32 bytes.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace kvcheck::llamacpp {

struct GgufTensor {
  std::string name;
  std::vector<std::int64_t> ne;  // ggml order: ne[0] varies fastest
  std::vector<float> data;
};

// A bool array is what gemma3's sliding_window_pattern may be: one per layer.
using GgufValue = std::variant<std::uint32_t, float, std::string, std::vector<bool>>;

struct GgufFile {
  std::vector<std::pair<std::string, GgufValue>> metadata;
  std::vector<GgufTensor> tensors;
};

// The bytes of the file (so a test can read them back).
std::string gguf_bytes(const GgufFile& file);

}  // namespace kvcheck::llamacpp
