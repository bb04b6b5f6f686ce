#include "tools/llamacpp/gguf_writer.h"

#include <cstring>
#include <stdexcept>

namespace kvcheck::llamacpp {
namespace {

constexpr std::uint64_t kAlignment = 32;
constexpr std::uint32_t kTypeUint32 = 4, kTypeFloat32 = 6, kTypeBool = 7, kTypeString = 8, kTypeArray = 9;
constexpr std::uint32_t kGgmlF32 = 0;

template <typename T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian, as GGUF and x86-64
  out.append(bytes, sizeof(T));
}

void put_string(std::string& out, const std::string& s) {
  put<std::uint64_t>(out, s.size());
  out += s;
}

void pad(std::string& out) {
  while (out.size() % kAlignment != 0) out.push_back('\0');
}

}  // namespace

std::string gguf_bytes(const GgufFile& file) {
  std::string out = "GGUF";
  put<std::uint32_t>(out, 3);
  put<std::uint64_t>(out, file.tensors.size());
  put<std::uint64_t>(out, file.metadata.size());
  for (const auto& [key, value] : file.metadata) {
    put_string(out, key);
    if (const auto* u = std::get_if<std::uint32_t>(&value)) {
      put(out, kTypeUint32);
      put(out, *u);
    } else if (const auto* f = std::get_if<float>(&value)) {
      put(out, kTypeFloat32);
      put(out, *f);
    } else if (const auto* bits = std::get_if<std::vector<bool>>(&value)) {
      put(out, kTypeArray);
      put(out, kTypeBool);
      put<std::uint64_t>(out, bits->size());
      for (const bool bit : *bits) put<std::uint8_t>(out, bit ? 1 : 0);
    } else {
      put(out, kTypeString);
      put_string(out, std::get<std::string>(value));
    }
  }
  std::uint64_t offset = 0;  // of each tensor in the data section, each padded to the alignment
  for (const GgufTensor& t : file.tensors) {
    std::int64_t count = 1;
    for (std::int64_t n : t.ne) count *= n;
    if (count != static_cast<std::int64_t>(t.data.size())) throw std::logic_error("gguf: " + t.name + " size");
    put_string(out, t.name);
    put<std::uint32_t>(out, static_cast<std::uint32_t>(t.ne.size()));
    for (std::int64_t n : t.ne) put<std::int64_t>(out, n);
    put(out, kGgmlF32);
    put<std::uint64_t>(out, offset);
    offset += (t.data.size() * sizeof(float) + kAlignment - 1) / kAlignment * kAlignment;
  }
  pad(out);
  for (const GgufTensor& t : file.tensors) {
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
    pad(out);
  }
  return out;
}

}  // namespace kvcheck::llamacpp
