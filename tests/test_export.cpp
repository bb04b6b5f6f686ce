// The export folder (SPEC 6): names, shapes, dtypes, NaN padding, manifest.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tools/harness/outputs/export.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/io/npy.h"

using namespace kvcheck;
namespace fs = std::filesystem;

namespace {

const char* kScenario = R"({
  "name": "export_shapes",
  "dimensions": {"layers": 2, "batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 6},
  "policy": {"type": "sink", "sinks": 1, "window": 4},
  "seed": 3,
  "steps": [{"op": "append", "tokens": [2, 5]}, {"op": "decode", "steps": 2}, {"op": "reorder", "rows": [1, 1, 0]},
            {"op": "crop", "length": 2, "expect_error": "crop_evicted"}]
})";

std::string header_dtype(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::string head(128, '\0');
  in.read(head.data(), 128);
  const auto at = head.find("'descr': '");
  return head.substr(at + 10, 3);
}

}  // namespace

TEST(Export, WritesTheSpecFolder) {
  const Scenario s = parse_scenario(kScenario, "export_shapes.json");
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const fs::path dir = fs::temp_directory_path() / "kvcheck_test_export";
  fs::remove_all(dir);
  write_export(s, inputs, run, dir.string());

  // 2 + 5 prompt tokens, then 2 decodes of 2 rows: 11 uids.
  EXPECT_EQ(read_npy_f32((dir / "q.npy").string()).shape, (std::vector<std::size_t>{2, 11, 4, 6}));
  EXPECT_EQ(read_npy_f32((dir / "k.npy").string()).shape, (std::vector<std::size_t>{2, 11, 2, 6}));
  EXPECT_EQ(read_npy_f32((dir / "v.npy").string()).shape, (std::vector<std::size_t>{2, 11, 2, 6}));
  EXPECT_EQ(header_dtype(dir / "q.npy"), "<f4");

  const NpyArray<double> out0 = read_npy_f64((dir / "step000_out.npy").string());
  EXPECT_EQ(header_dtype(dir / "step000_out.npy"), "<f8");
  EXPECT_EQ(out0.shape, (std::vector<std::size_t>{2, 2, 5, 4, 6}));
  // Row 0 has 2 of 5 tokens: chunk positions 0..2 are NaN padding, 3 and 4 are not.
  const std::size_t row_stride = 5 * 4 * 6;
  EXPECT_TRUE(std::isnan(out0.data[2 * 4 * 6]));
  EXPECT_FALSE(std::isnan(out0.data[3 * 4 * 6]));
  EXPECT_FALSE(std::isnan(out0.data[row_stride]));
  EXPECT_EQ(read_npy_f64((dir / "step002_out.npy").string()).shape, (std::vector<std::size_t>{2, 2, 1, 4, 6}));
  EXPECT_FALSE(fs::exists(dir / "step003_out.npy"));  // a reorder has no output
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(fs::exists(dir / (step_stem(i) + "_cache.json"))) << i;

  std::ifstream in(dir / "manifest.json");
  const auto manifest = nlohmann::json::parse(in);
  ASSERT_EQ(manifest["steps"].size(), 5u);
  EXPECT_EQ(manifest["steps"][0]["rows"][1]["uids"], nlohmann::json({2, 3, 4, 5, 6}));
  EXPECT_EQ(manifest["steps"][0]["rows"][0]["indices"], nlohmann::json({0, 1}));
  EXPECT_EQ(manifest["steps"][1]["source_op"], "decode");
  EXPECT_EQ(manifest["steps"][4]["refused"], "crop_evicted");
  EXPECT_EQ(manifest["uids"], 11);

  // The cache after the decodes: row 1 holds 7 tokens; S = 1, W = 4: tokens 0, 4, 5, 6.
  std::ifstream cache_in(dir / "step002_cache.json");
  const auto cache = nlohmann::json::parse(cache_in);
  const auto& keys = cache["rows"][1]["keys"];
  ASSERT_EQ(keys.size(), 4u);
  EXPECT_EQ(keys[1]["index"], 4);
  EXPECT_EQ(keys[1]["position"], 1);
  EXPECT_EQ(cache["rows"][1]["query_position"], 3);
  fs::remove_all(dir);
}

TEST(Export, RereadsItsOwnInputsAsNpyScenario) {
  // Inputs exported by one scenario replay bit-identically through "inputs": {npy}.
  const Scenario s = parse_scenario(kScenario, "export_shapes.json");
  const InputTable inputs = load_inputs(s);
  const fs::path dir = fs::temp_directory_path() / "kvcheck_test_replay";
  fs::remove_all(dir);
  write_export(s, inputs, run_reference(s, inputs), dir.string());
  std::string text = kScenario;
  text.replace(text.find(R"("seed": 3)"), 9, R"("inputs": {"q": "q.npy", "k": "k.npy", "v": "v.npy"})");
  const Scenario replay = parse_scenario(text, (dir / "replay.json").string());
  const InputTable again = load_inputs(replay);
  EXPECT_EQ(again.q, inputs.q);
  EXPECT_EQ(again.v, inputs.v);
  fs::remove_all(dir);
}
