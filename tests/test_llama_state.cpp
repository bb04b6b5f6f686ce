// The reader of llama.cpp's sequence state (tools/llamacpp/state_reader.h) on states built
// here byte by byte, in both layouts: with the magic-and-seq-id prefix of recent builds and
// without it (builds before spring 2026, such as b8390).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
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

// One cache's cells: one stream, a cell per position with its seq ids, one layer of f32 K
// and V rows of 2 values each (`k` and `v` hold every cell's, in cell order).
std::vector<std::uint8_t> section(const std::vector<std::pair<std::int32_t, std::vector<std::int32_t>>>& cells,
                                  const std::vector<float>& k, const std::vector<float>& v) {
  std::vector<std::uint8_t> s;
  put<std::uint32_t>(s, 1);  // n_stream
  put<std::uint32_t>(s, static_cast<std::uint32_t>(cells.size()));
  for (const auto& [pos, seqs] : cells) {
    put<std::int32_t>(s, pos);
    put<std::uint32_t>(s, static_cast<std::uint32_t>(seqs.size()));
    for (std::int32_t seq : seqs) put<std::int32_t>(s, seq);
  }
  put<std::uint32_t>(s, 0);  // v_trans
  put<std::uint32_t>(s, 1);  // n_layer
  put<std::int32_t>(s, 0);   // K f32
  put<std::uint64_t>(s, 8);
  for (float f : k) put(s, f);
  put<std::int32_t>(s, 0);  // V f32
  put<std::uint64_t>(s, 8);
  for (float f : v) put(s, f);
  return s;
}

// Cells at positions 7 and 9 of seq 0, one layer of f32 K [1 2; 3 4] and V [5 6; 7 8].
std::vector<std::uint8_t> two_cells() { return section({{7, {0}}, {9, {0}}}, {1, 2, 3, 4}, {5, 6, 7, 8}); }

float no_fp16(std::uint16_t) { throw std::logic_error("no f16 here"); }

// `read` throws a std::runtime_error whose message holds `text`.
template <typename Read>
void expect_error(Read read, const std::string& text) {
  std::string message = "(nothing thrown)";
  try {
    read();
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find(text), std::string::npos) << message;
}

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
  expect_error([&] { read_cells(s, 2, no_fp16); }, "begins with 0xaf143cd9, neither the magic 0xaf143cd8");
}

TEST(LlamaState, ATruncatedStateNamesWhatIsMissing) {
  std::vector<std::uint8_t> s = two_cells();
  s.resize(s.size() - 3);  // V's rows (2 cells of 8 bytes) start at byte 80 of 96
  expect_error([&] { read_cells(s, 2, no_fp16); }, "the V rows needs 16 bytes at offset 80, 13 left");
}

// A sequence's state holds one section per cache, two at most (full and sliding layers):
// read_cells takes one, and a third is bytes left over.
TEST(LlamaState, ASequencesStateHoldsAtMostTwoSections) {
  const std::vector<std::uint8_t> one = two_cells();  // 96 bytes
  std::vector<std::uint8_t> two = one, three = one;
  two.insert(two.end(), one.begin(), one.end());
  three.insert(three.end(), two.begin(), two.end());
  EXPECT_EQ(read_sequence_sections(two, 2, no_fp16).size(), 2u);
  expect_error([&] { read_cells(two, 2, no_fp16); }, "2 caches' cells, expected 1");
  expect_error([&] { read_sequence_sections(three, 2, no_fp16); }, "96 bytes left after the cells");
}

// A context's state (llama_state_get_data) of a model with sliding layers: the arch's name,
// then the full layers' cells (7 of seq 0, 9 shared by seqs 0 and 1), then the sliding
// layers' (3 of seq 1). Each sequence's cells are picked from every section.
TEST(LlamaState, AContextsStateIsItsArchThenOneSectionPerCache) {
  std::vector<std::uint8_t> s;
  put<std::uint32_t>(s, 6);
  for (char c : std::string("gemma3")) s.push_back(static_cast<std::uint8_t>(c));
  for (std::uint8_t byte : section({{7, {0}}, {9, {0, 1}}}, {1, 2, 3, 4}, {5, 6, 7, 8})) s.push_back(byte);
  for (std::uint8_t byte : section({{3, {1}}}, {9, 10}, {11, 12})) s.push_back(byte);
  const ContextState state = read_context_state(s, 2, no_fp16);
  EXPECT_EQ(state.arch, "gemma3");
  ASSERT_EQ(state.sections.size(), 2u);
  expect_two_cells(state.sections[0].of_sequence(0));
  const Cells shared = state.sections[0].of_sequence(1);
  EXPECT_EQ(shared.positions, (std::vector<std::int32_t>{9}));
  ASSERT_EQ(shared.layers.size(), 1u);
  EXPECT_EQ(shared.layers[0].k, (std::vector<float>{3, 4}));
  EXPECT_EQ(shared.layers[0].v, (std::vector<float>{7, 8}));
  const Cells sliding = state.sections[1].of_sequence(1);
  EXPECT_EQ(sliding.positions, (std::vector<std::int32_t>{3}));
  EXPECT_EQ(sliding.layers[0].k, (std::vector<float>{9, 10}));
  EXPECT_EQ(sliding.layers[0].v, (std::vector<float>{11, 12}));
  EXPECT_TRUE(state.sections[1].of_sequence(0).positions.empty());
  EXPECT_TRUE(state.sections[1].of_sequence(0).layers.empty());
  s.resize(s.size() - 3);  // the sliding section's V rows cut short: named as the context's
  expect_error([&] { read_context_state(s, 2, no_fp16); }, "context state: the V rows needs 8 bytes");
}

}  // namespace
}  // namespace kvcheck::llamacpp
