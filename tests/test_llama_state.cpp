// The reader of llama.cpp's sequence state (tools/llamacpp/state_reader.h) on states built
// here byte by byte, in both layouts: with the magic-and-seq-id prefix of recent builds and
// without it (builds before spring 2026, such as b8390).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "tools/llamacpp/state_reader.h"

namespace kvcheck::llamacpp {
namespace {

template <typename T>
void put(std::vector<std::uint8_t>& out, T value) {
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

// One stream, cells at positions 7 and 9 of seq 0, one layer of f32 K [1 2; 3 4] and V [5 6; 7 8].
std::vector<std::uint8_t> two_cells() {
  std::vector<std::uint8_t> s;
  put<std::uint32_t>(s, 1);  // n_stream
  put<std::uint32_t>(s, 2);  // cell_count
  for (std::int32_t pos : {7, 9}) {
    put<std::int32_t>(s, pos);
    put<std::uint32_t>(s, 1);
    put<std::int32_t>(s, 0);
  }
  put<std::uint32_t>(s, 0);  // v_trans
  put<std::uint32_t>(s, 1);  // n_layer
  put<std::int32_t>(s, 0);   // K f32
  put<std::uint64_t>(s, 8);
  for (float f : {1.0f, 2.0f, 3.0f, 4.0f}) put(s, f);
  put<std::int32_t>(s, 0);  // V f32
  put<std::uint64_t>(s, 8);
  for (float f : {5.0f, 6.0f, 7.0f, 8.0f}) put(s, f);
  return s;
}

float no_fp16(std::uint16_t) { throw std::logic_error("no f16 here"); }

void expect_two_cells(const Cells& c) {
  EXPECT_EQ(c.positions, (std::vector<std::int32_t>{7, 9}));
  ASSERT_EQ(c.layers.size(), 1u);
  EXPECT_EQ(c.layers[0].k, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(c.layers[0].v, (std::vector<float>{5, 6, 7, 8}));
}

TEST(LlamaState, ReadsTheStateOfBuildsBeforeThePrefix) { expect_two_cells(read_cells(two_cells(), 2, no_fp16)); }

TEST(LlamaState, SkipsTheMagicAndSeqIdOfRecentBuilds) {
  std::vector<std::uint8_t> s;
  put<std::uint32_t>(s, 0xaf143cd8);
  put<std::int32_t>(s, 0);
  for (std::uint8_t byte : two_cells()) s.push_back(byte);
  expect_two_cells(read_cells(s, 2, no_fp16));
}

TEST(LlamaState, AnotherPrefixIsNotSkippedButNamed) {
  std::vector<std::uint8_t> s;
  put<std::uint32_t>(s, 0xaf143cd9);
  put<std::int32_t>(s, 0);
  for (std::uint8_t byte : two_cells()) s.push_back(byte);
  try {
    read_cells(s, 2, no_fp16);
    FAIL() << "read a state with an unknown prefix";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("begins with 0xaf143cd9, neither the magic 0xaf143cd8"), std::string::npos)
        << e.what();
  }
}

TEST(LlamaState, ATruncatedStateNamesWhatIsMissing) {
  std::vector<std::uint8_t> s = two_cells();
  s.resize(s.size() - 3);  // V's rows (2 cells of 8 bytes) start at byte 80 of 96
  try {
    read_cells(s, 2, no_fp16);
    FAIL() << "read a truncated state";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the V rows needs 16 bytes at offset 80, 13 left"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvcheck::llamacpp
