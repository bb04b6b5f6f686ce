// `kvcheck llamacpp SCENARIO`: runs the scenario through llama.cpp's own KV cache (a child
// process, tools/llamacpp/engine.cpp) and judges what it captured with the one checker.
#pragma once

#include <string>

namespace kvcheck {

struct LlamacppOptions {
  std::string scenario;
  std::string type_k = "f32", type_v = "f32";
  bool flash_attn = false;
  std::string abi = "auto";  // auto, header (compiled against llama.h) or declared (kvcheck's own)
  std::string keep;  // --trace DIR: keep the captured scenario and trace there
  std::string plant;                 // --plant-fault: a fault in the driver itself (kvcheck's self-test)
  bool restore_after_shift = false;  // save after the first seq_add, restore into a fresh context
  int stall_seconds = 600;           // --stall-timeout: an engine this long on one step is stopped (0: never)
  std::string html, junit, json;
  bool force = false;  // --force: a report may replace a file that is not a kvcheck report
};

// Exit status as the other commands: 0 pass, 1 a finding (the engine crashing included),
// 2 bad input or a scenario the driver does not support, 3 an internal error.
int run_llamacpp(const LlamacppOptions& options);

}  // namespace kvcheck
