// The trace reader and checker on an arbitrary manifest.json beside well-formed tensors:
// a bad manifest is an InputError; a well-formed one is checked without crashing.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "tools/harness/io/npy.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/harness/sources/trace_verify.h"

namespace {

const char* kScenario = R"({"name": "tr", "dimensions": {"layers": 1, "batch": 1, "heads": 2, "kv_heads": 1,
  "head_dim": 4}, "policy": {"type": "sliding", "window": 3}, "seed": 1,
  "steps": [{"op": "append", "tokens": 2}, {"op": "decode", "steps": 2}]})";

std::string make_folder() {
  const std::string dir = "/tmp/kvcheck-fuzz-trace-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  for (const char* name : {"k.npy", "v.npy"})
    kvcheck::write_npy(dir + "/" + name, {1, 1, 3, 4}, std::vector<float>(12, 0.5f));
  kvcheck::write_npy(dir + "/o.npy", {1, 2, 1, 4}, std::vector<float>(8, 0.5f));
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const kvcheck::Scenario scenario = kvcheck::parse_scenario(kScenario, "/nonexistent/tr.json");
  static const std::string dir = make_folder();
  if (std::FILE* f = std::fopen((dir + "/manifest.json").c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  try {
    (void)kvcheck::verify_trace(scenario, dir);
  } catch (const kvcheck::InputError&) {
  }
  return 0;
}
