#include "tools/harness/npy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

NpyArray<double> read_npy_as_double(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, "", "cannot open the .npy file");
  std::string magic(10, '\0');
  in.read(magic.data(), 10);
  std::string header(256, '\0');
  in.read(header.data(), 256);
  if (header.find("'<f4'") != std::string::npos) {
    NpyArray<float> f = read_npy_f32(path);
    return {f.shape, std::vector<double>(f.data.begin(), f.data.end())};
  }
  if (header.find("'<f8'") == std::string::npos)
    throw InputError(path, "", "expected dtype <f4 (float32) or <f8 (float64)");
  return read_npy_f64(path);
}

void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<float>& data) {
  write(path, shape, data);
}
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<double>& data) {
  write(path, shape, data);
}

std::string shape_string(const std::vector<std::size_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace kvcheck
