#include "tools/harness/npy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <xtensor/xadapt.hpp>
#include <xtensor/xnpy.hpp>

#include "tools/harness/scenario.h"

namespace kvcheck {
namespace {

template <class T>
NpyArray<T> read_npy(const std::string& path, const char* dtype, const char* dtype_name) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, "", "cannot open the .npy file");
  try {
    auto file = xt::detail::load_npy_file(in);
    if (!in) throw InputError(path, "", "the file is shorter than its .npy header says");
    if (file.m_typestring != dtype)
      throw InputError(path, "", fmt::format("expected dtype {} ({}), got {}", dtype, dtype_name, file.m_typestring));
    if (file.m_fortran_order) throw InputError(path, "", "expected C order (fortran_order False)");
    NpyArray<T> out;
    out.shape = file.m_shape;
    auto values = std::move(file).template cast<T>(false);
    out.data.assign(values.begin(), values.end());
    return out;
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    throw InputError(path, "", fmt::format("not a readable .npy file: {}", e.what()));
  }
}

template <class T>
void write(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<T>& data) {
  auto view = xt::adapt(data.data(), data.size(), xt::no_ownership(), shape);
  xt::dump_npy(path, view);
}

}  // namespace

NpyArray<float> read_npy_f32(const std::string& path) { return read_npy<float>(path, "<f4", "float32"); }
NpyArray<double> read_npy_f64(const std::string& path) { return read_npy<double>(path, "<f8", "float64"); }

namespace {

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

}  // namespace

NpyArray<float> read_npy_floats(const std::string& path, double* roundoff) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, "", "cannot open the .npy file");
  try {
    auto file = xt::detail::load_npy_file(in);
    if (!in) throw InputError(path, "", "the file is shorter than its .npy header says");
    if (file.m_fortran_order) throw InputError(path, "", "expected C order (fortran_order False)");
    NpyArray<float> out;
    out.shape = file.m_shape;
    std::size_t count = 1;
    for (std::size_t d : out.shape)
      if (__builtin_mul_overflow(count, d, &count)) throw InputError(path, "", "the shape's element count overflows");
    const std::size_t word = file.m_typestring == "<f2" ? 2 : file.m_typestring == "<f4" ? 4 : 8;
    if (count > file.n_bytes() / word) throw InputError(path, "", "the data is shorter than the shape says");
    out.data.resize(count);
    if (file.m_typestring == "<f2") {
      std::vector<std::uint16_t> half(count);
      std::memcpy(half.data(), file.ptr(), count * sizeof(std::uint16_t));
      std::transform(half.begin(), half.end(), out.data.begin(), half_to_float);
      *roundoff = 0x1p-11;
    } else if (file.m_typestring == "<f4") {
      std::memcpy(out.data.data(), file.ptr(), count * sizeof(float));
      *roundoff = 0x1p-24;
    } else if (file.m_typestring == "<f8") {
      // Narrowed to float32, the inputs' own precision: the trace is judged as float32.
      const double* d = reinterpret_cast<const double*>(file.ptr());
      std::transform(d, d + count, out.data.begin(), [](double x) { return static_cast<float>(x); });
      *roundoff = 0x1p-24;
    } else {
      throw InputError(
          path, "",
          fmt::format("expected dtype <f2 (float16), <f4 (float32) or <f8 (float64), got {}", file.m_typestring));
    }
    return out;
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    throw InputError(path, "", fmt::format("not a readable .npy file: {}", e.what()));
  }
}

void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<float>& data) {
  write(path, shape, data);
}
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<double>& data) {
  write(path, shape, data);
}

std::string shape_string(const std::vector<std::size_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace kvcheck
