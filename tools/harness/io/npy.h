// Reading and writing NumPy .npy files through xtensor, behind a plain interface so the
// heavy xtensor headers stay in one translation unit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvcheck {

template <class T>
struct NpyArray {
  std::vector<std::size_t> shape;
  std::vector<T> data;  // row-major
};

// Throw InputError naming the file and what was expected (dtype, C order).
NpyArray<float> read_npy_f32(const std::string& path);
NpyArray<double> read_npy_f64(const std::string& path);

// float16, float32 or float64 as float (traces written by other tools); `roundoff` gets
// the unit roundoff of what the file stored (float64 counts as float32, the inputs' own).
NpyArray<float> read_npy_floats(const std::string& path, double* roundoff);
// SPEC 9.3's codes: int8, uint8 or int32, as int32.
NpyArray<std::int32_t> read_npy_codes(const std::string& path);
// Block tables, slot mappings, refcounts (SPEC 8.9): any of those, or int64, as int64.
NpyArray<std::int64_t> read_npy_indices(const std::string& path);

void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<float>& data);
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<double>& data);
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<std::int32_t>& data);
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<std::int8_t>& data);
void write_npy(const std::string& path, const std::vector<std::size_t>& shape, const std::vector<std::uint8_t>& data);

// "[2, 3, 4]"
std::string shape_string(const std::vector<std::size_t>& shape);

}  // namespace kvcheck
