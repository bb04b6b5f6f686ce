// The scenario parser on arbitrary bytes: an InputError is the right answer to bad input;
// anything else (a crash, a sanitizer report, another exception) is a finding.
#include <cstdint>
#include <string>

#include "tools/harness/scenario/scenario.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const kvcheck::Scenario s =
        kvcheck::parse_scenario(std::string(reinterpret_cast<const char*>(data), size), "/nonexistent/fuzz.json");
    (void)kvcheck::estimate_cost(s);
  } catch (const kvcheck::InputError&) {
  }
  return 0;
}
