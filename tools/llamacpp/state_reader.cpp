#include "tools/llamacpp/state_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace kvcheck::llamacpp {
namespace {

class Reader {
 public:
  // label: what the bytes are, for messages ("sequence state", "context state").
  Reader(const std::vector<std::uint8_t>& bytes, const char* label) : bytes_(bytes), label_(label) {}
  const char* label() const { return label_; }
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  template <typename T>
  T peek() {
    const std::size_t at = at_;
    const T value = get<T>("a value");
    at_ = at;
    return value;
  }
  const std::uint8_t* take(std::size_t n, const char* what) {
    need(n, what);
    const std::uint8_t* p = bytes_.data() + at_;
    at_ += n;
    return p;
  }
  bool done() const { return at_ == bytes_.size(); }
  std::size_t at() const { return at_; }

 private:
  void need(std::size_t n, const char* what) const {
    if (n > bytes_.size() - at_)
      throw std::runtime_error(fmt::format("{}: {} needs {} bytes at offset {}, {} left", label_, what, n, at_,
                                           bytes_.size() - at_));
  }
  const std::vector<std::uint8_t>& bytes_;
  const char* label_;
  std::size_t at_ = 0;
};

constexpr std::int32_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ8_0 = 8, kBF16 = 30;
constexpr std::size_t kQ8Block = 32, kQ8BlockBytes = 34;  // ggml's q8_0: f16 scale d, then 32 int8 codes
// ggml's q4_0: f16 scale d, then 16 bytes; byte j holds element j (low nibble) and j + 16 (high).
constexpr std::size_t kQ4BlockBytes = 18;

bool quantized(std::int32_t type) { return type == kQ8_0 || type == kQ4_0; }

// Code i of a quantized block (q8_0: signed; q4_0: the nibble, 0 to 15) and its scale d.
int code_at(const std::uint8_t* block, std::int32_t type, std::size_t i) {
  if (type == kQ8_0) return static_cast<std::int8_t>(block[2 + i]);
  const std::uint8_t byte = block[2 + i % 16];
  return i < 16 ? byte & 0x0F : byte >> 4;
}

// Bytes of a row of `width` elements of `type`.
std::size_t row_bytes(std::int32_t type, std::size_t width, const char* what, const char* label) {
  switch (type) {
    case kF32:
      return 4 * width;
    case kF16:
    case kBF16:
      return 2 * width;
    case kQ8_0:
    case kQ4_0:
      if (width % kQ8Block == 0) return width / kQ8Block * (type == kQ8_0 ? kQ8BlockBytes : kQ4BlockBytes);
      break;
  }
  throw std::runtime_error(fmt::format("{}: {} stored as ggml type {}; kvcheck reads f32, f16, bf16, q8_0 "
                                       "and q4_0 cells",
                                       label, what, type));
}

// Element i of a row of `type` as float (q8_0 dequantized: d * code; q4_0: d * (code - 8)).
float element(const std::uint8_t* row, std::int32_t type, std::size_t i, const std::function<float(std::uint16_t)>& fp16) {
  if (type == kF32) {
    float f;
    std::memcpy(&f, row + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  if (quantized(type)) {
    const std::uint8_t* block = row + i / kQ8Block * (type == kQ8_0 ? kQ8BlockBytes : kQ4BlockBytes);
    std::memcpy(&h, block, 2);
    const int code = code_at(block, type, i % kQ8Block);
    return fp16(h) * static_cast<float>(type == kQ8_0 ? code : code - 8);
  }
  std::memcpy(&h, row + 2 * i, 2);
  if (type == kBF16) {  // the upper half of a float32
    const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return fp16(h);
}

// A q8_0 or q4_0 row's codes and scales, appended to `codes` and `scales`.
void keep_codes(const std::uint8_t* row, std::int32_t type, std::size_t width,
                const std::function<float(std::uint16_t)>& fp16, std::vector<std::int8_t>& codes,
                std::vector<float>& scales) {
  for (std::size_t block = 0; block < width / kQ8Block; ++block) {
    const std::uint8_t* at = row + block * (type == kQ8_0 ? kQ8BlockBytes : kQ4BlockBytes);
    std::uint16_t h;
    std::memcpy(&h, at, 2);
    scales.push_back(fp16(h));
    for (std::size_t i = 0; i < kQ8Block; ++i) codes.push_back(static_cast<std::int8_t>(code_at(at, type, i)));
  }
}

// One cache's cells, from n_stream on, leaving `r` after them.
Cells read_section(Reader& r, std::size_t width, const std::function<float(std::uint16_t)>& fp16) {
  const auto streams = r.get<std::uint32_t>("n_stream");
  if (streams != 1) throw std::runtime_error(fmt::format("{}: {} streams, expected 1", r.label(), streams));
  const auto count = r.get<std::uint32_t>("cell_count");
  Cells c;
  for (std::uint32_t i = 0; i < count; ++i) {
    c.positions.push_back(r.get<std::int32_t>("a cell's position"));
    const auto seqs = r.get<std::uint32_t>("a cell's n_seq");
    std::vector<std::int32_t>& ids = c.seqs.emplace_back();
    const std::uint8_t* at = r.take(4 * static_cast<std::size_t>(seqs), "a cell's seq ids");
    ids.resize(seqs);
    if (seqs > 0) std::memcpy(ids.data(), at, 4 * static_cast<std::size_t>(seqs));
  }
  if (count == 0) return c;
  const auto v_trans = r.get<std::uint32_t>("v_trans");
  const auto layers = r.get<std::uint32_t>("n_layer");
  c.layers.resize(layers);
  for (CellLayer& layer : c.layers) {
    const auto type = r.get<std::int32_t>("a K type");
    const auto row = r.get<std::uint64_t>("a K row size");
    if (row != row_bytes(type, width, "K", r.label()))
      throw std::runtime_error(
          fmt::format("{}: K rows of {} bytes, expected {}", r.label(), row, row_bytes(type, width, "K", r.label())));
    layer.k_at = r.at(), layer.k_row = row, layer.k_type = type;
    const std::uint8_t* rows = r.take(row * count, "the K rows");
    for (std::uint32_t cell = 0; cell < count; ++cell) {
      for (std::size_t i = 0; i < width; ++i) layer.k.push_back(element(rows + cell * row, type, i, fp16));
      if (quantized(type)) keep_codes(rows + cell * row, type, width, fp16, layer.k_codes, layer.k_scales);
    }
  }
  for (CellLayer& layer : c.layers) {
    const auto type = r.get<std::int32_t>("a V type");
    layer.v.assign(count * width, 0.0f);
    if (v_trans == 0) {
      const auto row = r.get<std::uint64_t>("a V row size");
      if (row != row_bytes(type, width, "V", r.label()))
        throw std::runtime_error(fmt::format("{}: V rows of another width", r.label()));
      const std::uint8_t* rows = r.take(row * count, "the V rows");
      for (std::uint32_t cell = 0; cell < count; ++cell) {
        for (std::size_t i = 0; i < width; ++i) layer.v[cell * width + i] = element(rows + cell * row, type, i, fp16);
        if (quantized(type)) keep_codes(rows + cell * row, type, width, fp16, layer.v_codes, layer.v_scales);
      }
    } else {
      const auto size = r.get<std::uint32_t>("a V element size");
      const auto dims = r.get<std::uint32_t>("a V width");
      if (quantized(type) || size * width != row_bytes(type, width, "V", r.label()) || dims != width)
        throw std::runtime_error(fmt::format("{}: transposed V of another element size or width", r.label()));
      const std::uint8_t* data = r.take(static_cast<std::size_t>(size) * dims * count, "the V columns");
      for (std::uint32_t d = 0; d < dims; ++d)
        for (std::uint32_t cell = 0; cell < count; ++cell)
          layer.v[cell * width + d] = element(data + static_cast<std::size_t>(d) * count * size, type, cell, fp16);
    }
  }
  return c;
}

}  // namespace

Cells Cells::of_sequence(std::int32_t seq) const {
  Cells out;
  out.layers.resize(layers.size());
  for (std::size_t cell = 0; cell < positions.size(); ++cell) {
    if (std::find(seqs[cell].begin(), seqs[cell].end(), seq) == seqs[cell].end()) continue;
    out.positions.push_back(positions[cell]);
    out.seqs.push_back(seqs[cell]);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const CellLayer& from = layers[l];
      CellLayer& to = out.layers[l];
      const auto copy = [&](const auto& source, auto& target) {
        if (source.empty()) return;
        const std::size_t per = source.size() / positions.size();
        target.insert(target.end(), source.begin() + static_cast<std::ptrdiff_t>(cell * per),
                      source.begin() + static_cast<std::ptrdiff_t>((cell + 1) * per));
      };
      copy(from.k, to.k);
      copy(from.v, to.v);
      copy(from.k_codes, to.k_codes);
      copy(from.v_codes, to.v_codes);
      copy(from.k_scales, to.k_scales);
      copy(from.v_scales, to.v_scales);
    }
  }
  if (out.positions.empty()) out.layers.clear();  // as a sequence's state: no layers without cells
  return out;
}

std::vector<Cells> read_sequence_sections(const std::vector<std::uint8_t>& state, std::size_t width,
                                          const std::function<float(std::uint16_t)>& fp16) {
  Reader r(state, "sequence state");
  // Builds since spring 2026 open a sequence's state with a magic number and its seq id
  // (io_magic in llama.cpp v0.5.0's src/llama-context.cpp; b8390 has none); older ones
  // start at n_stream (a small count, never the magic).
  constexpr std::uint32_t kStateMagic = 0xaf143cd8;
  if (state.size() >= 4 && r.peek<std::uint32_t>() == kStateMagic) r.take(8, "the prefix (magic and seq id)");
  else if (state.size() >= 4 && r.peek<std::uint32_t>() > 1024)
    throw std::runtime_error(fmt::format("sequence state: begins with {:#010x}, neither the magic {:#010x} of recent "
                                         "builds nor a stream count: another state format",
                                         r.peek<std::uint32_t>(), kStateMagic));
  std::vector<Cells> sections;
  do sections.push_back(read_section(r, width, fp16));
  while (!r.done() && sections.size() < 2);  // at most a full part and a sliding part
  if (!r.done())
    throw std::runtime_error(fmt::format("sequence state: {} bytes left after the cells", state.size() - r.at()));
  return sections;
}

Cells read_cells(const std::vector<std::uint8_t>& state, std::size_t width,
                 const std::function<float(std::uint16_t)>& fp16) {
  std::vector<Cells> sections = read_sequence_sections(state, width, fp16);
  if (sections.size() != 1)
    throw std::runtime_error(fmt::format("sequence state: {} caches' cells, expected 1", sections.size()));
  return std::move(sections.front());
}

ContextState read_context_state(const std::vector<std::uint8_t>& state, std::size_t width,
                                const std::function<float(std::uint16_t)>& fp16) {
  Reader r(state, "context state");
  ContextState out;
  const auto length = r.get<std::uint32_t>("the architecture's name length");
  if (length > 64)
    throw std::runtime_error(fmt::format("context state: an architecture name of {} bytes: another state format", length));
  const std::uint8_t* name = r.take(length, "the architecture's name");
  out.arch.assign(reinterpret_cast<const char*>(name), length);
  while (!r.done()) out.sections.push_back(read_section(r, width, fp16));
  return out;
}

}  // namespace kvcheck::llamacpp
