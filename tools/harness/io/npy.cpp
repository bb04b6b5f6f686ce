#include "tools/harness/io/npy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <xtensor/xadapt.hpp>
#include <xtensor/xnpy.hpp>

#include "tools/harness/io/safe_file.h"
#include "tools/harness/io/input_error.h"

namespace kvcheck {
namespace {

// What the header of a .npy file says, checked against the file before anything else is
// read (xtensor's reader trusts it; a hostile header must not).
struct NpyHeader {
  std::string descr;
  std::vector<std::size_t> shape;
  std::size_t count = 0;  // elements, overflow-checked
  std::size_t word = 0;   // bytes per element
  char kind = 'f';        // 'f' float, 'i' signed or 'u' unsigned integer
  std::uint64_t data_offset = 0;
};

// The header dict: {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path) : t_(text), path_(path) {}

  NpyHeader parse() {
    NpyHeader h;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    while (!peek('}')) {
      const std::string key = quoted();
      expect(':');
      if (key == "descr") {
        h.descr = quoted();
        have_descr = true;
      } else if (key == "fortran_order") {
        if (word("True")) fail("expected C order (fortran_order False)");
        if (!word("False")) fail("fortran_order must be True or False");
        have_order = true;
      } else if (key == "shape") {
        h.shape = shape();
        have_shape = true;
      } else {
        fail(fmt::format("unknown header key '{}'", key));
      }
      if (!peek('}')) expect(',');
    }
    expect('}');
    if (!have_descr || !have_order || !have_shape) fail("the header lacks descr, fortran_order or shape");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw InputError(path_, "", "not a valid .npy header: " + why);
  }
  void skip() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n')) ++i_;
  }
  bool peek(char c) {
    skip();
    return i_ < t_.size() && t_[i_] == c;
  }
  void expect(char c) {
    if (!peek(c)) fail(fmt::format("expected '{}' at byte {}", c, i_));
    ++i_;
  }
  bool word(const char* w) {
    skip();
    if (t_.compare(i_, std::strlen(w), w) != 0) return false;
    i_ += std::strlen(w);
    return true;
  }
  std::string quoted() {
    skip();
    if (i_ >= t_.size() || (t_[i_] != '\'' && t_[i_] != '"'))
      fail(fmt::format("expected a quoted string at byte {}", i_));
    const char q = t_[i_++];
    const std::size_t end = t_.find(q, i_);
    if (end == std::string::npos) fail("an unterminated string");
    std::string s = t_.substr(i_, end - i_);
    i_ = end + 1;
    return s;
  }
  std::vector<std::size_t> shape() {
    std::vector<std::size_t> dims;
    expect('(');
    while (!peek(')')) {
      skip();
      std::size_t v = 0;
      bool digits = false;
      while (i_ < t_.size() && t_[i_] >= '0' && t_[i_] <= '9') {
        if (__builtin_mul_overflow(v, std::size_t{10}, &v) || __builtin_add_overflow(v, std::size_t(t_[i_] - '0'), &v))
          fail("a dimension too large");
        ++i_;
        digits = true;
      }
      if (!digits) fail(fmt::format("expected a dimension at byte {}", i_));
      if (dims.size() == 32) fail("more than 32 dimensions");
      dims.push_back(v);
      if (!peek(')')) expect(',');
    }
    expect(')');
    return dims;
  }

  const std::string& t_;
  const std::string& path_;
  std::size_t i_ = 0;
};

// Reads and checks the header: magic, version, header length within the file, dtype,
// C order, and a data size that matches the shape exactly.
NpyHeader read_header(std::ifstream& in, const std::string& path, std::uint64_t file_size) {
  auto bad = [&](const std::string& why) { throw InputError(path, "", "not a valid .npy file: " + why); };
  char start[12] = {};
  if (file_size < 10) bad(fmt::format("{} bytes, shorter than the 10-byte preamble", file_size));
  in.read(start, 10);
  if (std::memcmp(start, "\x93NUMPY", 6) != 0) bad("no \\x93NUMPY magic");
  // Versions 1.0 and 2.0 are what numpy.save writes for float arrays (3.0 only adds UTF-8
  // field names, which a float array has none of): any other is named as such, before its
  // header length is read with a width that may not be its own.
  const int major = static_cast<unsigned char>(start[6]), minor = static_cast<unsigned char>(start[7]);
  if ((major != 1 && major != 2) || minor != 0)
    bad(fmt::format("format version {}.{} is not supported (expected 1.0 or 2.0, as numpy.save writes for float "
                    "arrays)",
                    major, minor));
  std::uint64_t header_len = 0, offset = 10;
  if (major == 1) {
    header_len = static_cast<unsigned char>(start[8]) | static_cast<unsigned char>(start[9]) << 8;
  } else {
    if (file_size < 12) bad("shorter than the 12-byte preamble of version 2");
    in.read(start + 10, 2);
    for (int b = 3; b >= 0; --b) header_len = header_len << 8 | static_cast<unsigned char>(start[8 + b]);
    offset = 12;
  }
  if (header_len > (1u << 20)) bad(fmt::format("a header of {} bytes, over the 1 MiB kvcheck reads", header_len));
  if (header_len == 0 || header_len > file_size - offset)
    bad(fmt::format("version {}.0's {}-byte header length says {} bytes, but {} follow the preamble", major,
                    major == 1 ? 2 : 4, header_len, file_size - offset));
  std::string text(header_len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  if (!in) bad("the header could not be read");
  NpyHeader h = HeaderParser(text, path).parse();
  h.data_offset = offset + header_len;
  if (h.descr == "<f2")
    h.word = 2;
  else if (h.descr == "<f4")
    h.word = 4;
  else if (h.descr == "<f8")
    h.word = 8;
  else if (h.descr == "|i1" || h.descr == "|u1" || h.descr == "<i4" || h.descr == "<i8")  // codes, indices
    h.word = h.descr == "<i8" ? 8 : h.descr == "<i4" ? 4 : 1, h.kind = h.descr[1];
  else
    throw InputError(path, "",
                     fmt::format("expected dtype <f2 (float16), <f4 (float32) or <f8 (float64) (integers: |i1, |u1, "
                                 "<i4 or <i8), got {}",
                                 h.descr));
  h.count = 1;
  for (std::size_t d : h.shape)
    if (__builtin_mul_overflow(h.count, d, &h.count)) bad(fmt::format("shape {} overflows", shape_string(h.shape)));
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(h.count, h.word, &bytes) || bytes != file_size - h.data_offset)
    bad(fmt::format("shape {} of {} needs {} data bytes, the file has {}", shape_string(h.shape), h.descr,
                    h.count * h.word, file_size - h.data_offset));
  return h;
}

// IEEE binary16 to float, exactly (every half is a float).
float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24
    const float f = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The data as T, converting from the file's dtype in blocks (never the whole file twice).
template <class T>
std::vector<T> read_data(std::ifstream& in, const NpyHeader& h, const std::string& path) {
  std::vector<T> out(h.count);
  std::vector<char> block(std::size_t{1} << 20);
  const std::size_t per_block = block.size() / h.word;
  for (std::size_t at = 0; at < h.count; at += per_block) {
    const std::size_t n = std::min(per_block, h.count - at);
    in.read(block.data(), static_cast<std::streamsize>(n * h.word));
    if (!in) throw InputError(path, "", "not a valid .npy file: the data could not be read");
    for (std::size_t i = 0; i < n; ++i) {
      const char* x = block.data() + i * h.word;
      if (h.kind != 'f') {
        std::int64_t v = 0;
        if (h.word == 8) {
          std::memcpy(&v, x, 8);
        } else if (h.word == 4) {
          std::int32_t w;
          std::memcpy(&w, x, 4);
          v = w;
        } else {
          v = h.kind == 'i' ? static_cast<std::int8_t>(*x) : static_cast<std::uint8_t>(*x);
        }
        out[at + i] = static_cast<T>(v);
      } else if (h.word == 2) {
        std::uint16_t v;
        std::memcpy(&v, x, 2);
        out[at + i] = static_cast<T>(half_to_float(v));
      } else if (h.word == 4) {
        float v;
        std::memcpy(&v, x, 4);
        out[at + i] = static_cast<T>(v);
      } else {
        double v;
        std::memcpy(&v, x, 8);
        out[at + i] = static_cast<T>(v);
      }
    }
  }
  return out;
}

// The largest .npy kvcheck reads: inputs are capped at 1e9 values, 4 GB as float32.
constexpr std::uint64_t kMaxNpyBytes = std::uint64_t{1} << 33;

template <class T>
NpyArray<T> read_npy(const std::string& path, const char* required, double* roundoff) {
  const std::uint64_t size = regular_file_size(path, ".npy file");
  if (size > kMaxNpyBytes)
    throw InputError(path, "", fmt::format("the .npy file is {} bytes; kvcheck reads at most {}", size, kMaxNpyBytes));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, "", "cannot open the .npy file");
  const NpyHeader h = read_header(in, path, size);
  if (required != nullptr && h.descr != required)
    throw InputError(path, "", fmt::format("expected dtype {}, got {}", required, h.descr));
  const bool want_integers = std::is_integral_v<T>;
  const bool codes = want_integers && sizeof(T) == 4;  // SPEC 9.3's codes fit int32; indices may be int64
  if (want_integers != (h.kind != 'f') || (codes && h.word == 8))
    throw InputError(path, "", fmt::format("expected dtype {}, got {}",
                                           codes           ? "|i1, |u1 or <i4 (integer codes)"
                                           : want_integers ? "|i1, |u1, <i4 or <i8 (integers)"
                                                         : "<f2 (float16), <f4 (float32) or <f8 (float64)",
                                           h.descr));
  if (roundoff != nullptr) *roundoff = h.word == 2 ? 0x1p-11 : 0x1p-24;
  return {h.shape, read_data<T>(in, h, path)};
}

template <class T>
void write(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<T>& data) {
  auto view = xt::adapt(data.data(), data.size(), xt::no_ownership(), shape);
  xt::dump_npy(path, view);
}

}  // namespace

NpyArray<float> read_npy_f32(const std::string& path) { return read_npy<float>(path, "<f4", nullptr); }
NpyArray<double> read_npy_f64(const std::string& path) { return read_npy<double>(path, "<f8", nullptr); }

// float64 is narrowed to float32, the inputs' own precision: the trace is judged as float32.
NpyArray<float> read_npy_floats(const std::string& path, double* roundoff) {
  return read_npy<float>(path, nullptr, roundoff);
}
NpyArray<std::int32_t> read_npy_codes(const std::string& path) { return read_npy<std::int32_t>(path, nullptr, nullptr); }
NpyArray<std::int64_t> read_npy_indices(const std::string& path) { return read_npy<std::int64_t>(path, nullptr, nullptr); }

void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<float>& data) {
  write(path, shape, data);
}
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<double>& data) {
  write(path, shape, data);
}
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<std::int32_t>& data) {
  write(path, shape, data);
}
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<std::int8_t>& data) {
  write(path, shape, data);
}
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<std::uint8_t>& data) {
  write(path, shape, data);
}

std::string shape_string(const std::vector<std::size_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace kvcheck
