#include "tools/cli/llamacpp_command.h"

#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "tools/harness/atomic_dir.h"
#include "tools/harness/diagnose_report.h"
#include "tools/harness/reference_run.h"
#include "tools/harness/report.h"
#include "tools/harness/scenario.h"
#include "tools/harness/trace_verify.h"

extern char** environ;

namespace kvcheck {
namespace {

namespace fs = std::filesystem;

// Where llama.cpp's libraries are: LLAMACPP_DIR, else the folder tools/setup/llamacpp.sh
// unpacks the npm package into.
std::string library_folder() {
  if (const char* dir = std::getenv("LLAMACPP_DIR"); dir != nullptr && *dir != '\0') return dir;
  return KVCHECK_LLAMACPP_DIR;
}

// The step the engine was driving, from its progress file (-1: none: before the first
// step, or after the last).
long last_step(const fs::path& out) {
  std::ifstream in(out / "progress");
  long step = -1;
  if (!(in >> step)) return -1;
  return step;
}

// Signals by which a library crashes (not a kill from outside, such as the OOM killer's).
bool crash_signal(int sig) {
  return sig == SIGSEGV || sig == SIGABRT || sig == SIGBUS || sig == SIGFPE || sig == SIGILL;
}

constexpr const char* kMarker = "kvcheck-llamacpp-capture";  // names a folder this command wrote

}  // namespace

int run_llamacpp(const LlamacppOptions& o) {
  const Scenario scenario = load_scenario(o.scenario);  // bad input is reported before any work
  const std::string lib = library_folder();
  std::error_code ec;
  if (!fs::is_directory(lib, ec))
    throw InputError("LLAMACPP_DIR", "",
                     fmt::format("no llama.cpp libraries in {}: `tools/kvcheck llamacpp ...` fetches the npm package "
                                 "@node-llama-cpp/linux-x64 there, or set LLAMACPP_DIR to a folder holding "
                                 "libllama.so and libggml*.so",
                                 lib));
  const bool keep = !o.keep.empty();
  fs::path out;
  if (keep) {
    check_output_folder(o.keep, "--trace");
    out = o.keep;
    if (fs::exists(out, ec) && !(fs::is_directory(out, ec) && (fs::is_empty(out, ec) || fs::exists(out / kMarker, ec))))
      throw InputError(o.keep, "", "--trace: refusing to write into a folder that is not a kvcheck llamacpp capture");
    fs::remove_all(out, ec);
    fs::create_directories(out);
  } else {
    std::string pattern = (fs::temp_directory_path() / "kvcheck-llamacpp-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("cannot make a temporary folder");
    out = pattern;
  }
  std::ofstream(out / kMarker) << "written by kvcheck llamacpp; replaced whole by the next run\n";
  struct Cleanup {
    fs::path dir;
    bool keep;
    ~Cleanup() {
      std::error_code e;
      if (!keep) fs::remove_all(dir, e);
    }
  } cleanup{out, keep};

  const std::string engine = (fs::read_symlink("/proc/self/exe").parent_path() / "kvcheck_llamacpp_engine").string();
  std::vector<std::string> args = {engine,    "--lib",        lib,      "--scenario", scenario.file,
                                   "--out",   out.string(),   "--type-k", o.type_k,   "--type-v",
                                   o.type_v,  "--flash-attn", o.flash_attn ? "on" : "off"};
  if (o.restore_after_shift) {
    args.push_back("--restore-after-shift");
    args.push_back("on");
  }
  if (!o.plant.empty()) {
    args.push_back("--plant-fault");
    args.push_back(o.plant);
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // ggml prints a backtrace through gdb when it aborts: the step and signal are what counts.
  std::vector<std::string> env_strings = {"GGML_NO_BACKTRACE=1"};
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  if (const int err = ::posix_spawn(&pid, engine.c_str(), nullptr, nullptr, argv.data(), envp.data()); err != 0)
    throw std::runtime_error(fmt::format("cannot start {}: {}", engine, std::strerror(err)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw std::runtime_error("waitpid failed");
  const long step = last_step(out);
  if (WIFSIGNALED(status) &&
      (!crash_signal(WTERMSIG(status)) || step < 0 || static_cast<std::size_t>(step) >= scenario.steps.size()))
    throw std::runtime_error(fmt::format("the engine ended by signal {} ({}) outside any step", WTERMSIG(status),
                                         ::strsignal(WTERMSIG(status))));
  if (WIFSIGNALED(status)) {  // a finding at the step the engine was driving
    const std::string where =
        step_label(scenario.steps[static_cast<std::size_t>(step)], static_cast<std::size_t>(step));
    const std::string what = fmt::format("the engine crashed: signal {} ({}) at {}", WTERMSIG(status),
                                         ::strsignal(WTERMSIG(status)), where);
    fmt::print("kvcheck llamacpp: {} through llama.cpp (K {}, V {}, flash attention {})\n{}\n", scenario.name, o.type_k,
               o.type_v, o.flash_attn ? "on" : "off", what);
    Outcome crashed;
    crashed.scenario = scenario.name;
    crashed.file = scenario.file;
    crashed.target = "llama.cpp";
    crashed.checks.push_back({"engine", false, what});
    if (!o.junit.empty()) write_junit(o.junit, {crashed});
    if (!o.json.empty()) write_json_report(o.json, {crashed});
    return 1;
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 3;
  if (code != 0) return code == 2 ? 2 : 3;  // the engine said why on stderr

  const Scenario captured = load_scenario((out / "scenario.json").string());
  VerifyOptions verify;
  verify.picture = !o.html.empty();
  const CacheTrace trace = verify_trace(captured, (out / "trace").string(), verify);
  print_diagnosis(stdout,
                  fmt::format("kvcheck llamacpp: {} through llama.cpp (K {}, V {}, flash attention {})", scenario.name,
                              o.type_k, o.type_v, o.flash_attn ? "on" : "off"),
                  captured, trace);
  if (keep) fmt::print("captured scenario and trace in {}\n", out.string());
  if (!o.html.empty()) write_file_atomically(o.html, diagnosis_html(captured, "llama.cpp", trace));
  if (!o.junit.empty()) write_junit(o.junit, {trace.outcome});
  if (!o.json.empty()) write_json_report(o.json, {trace.outcome});
  return trace.outcome.passed() ? 0 : 1;
}

}  // namespace kvcheck
