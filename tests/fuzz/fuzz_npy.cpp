// The .npy reader on arbitrary bytes, through a file as kvcheck reads one.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "tools/harness/io/npy.h"
#include "tools/harness/scenario/scenario.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = "/tmp/kvcheck-fuzz-npy-" + std::to_string(::getpid()) + ".npy";
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  try {
    double roundoff = 0;
    (void)kvcheck::read_npy_floats(path, &roundoff);
  } catch (const kvcheck::InputError&) {
  }
  try {
    (void)kvcheck::read_npy_f64(path);
  } catch (const kvcheck::InputError&) {
  }
  return 0;
}
