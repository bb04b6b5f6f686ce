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
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>
#include <algorithm>
#include <chrono>
#include <iterator>
#include <thread>

#include "tools/harness/io/atomic_dir.h"
#include "tools/harness/outputs/diagnose_report.h"
#include "tools/harness/outputs/output_guard.h"
#include "tools/harness/check/divergence_report.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/report.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/harness/sources/trace_verify.h"
#include "tools/llamacpp/crash_site.h"
#include "tools/llamacpp/llama_api.h"

extern char** environ;

namespace kvcheck {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Where llama.cpp's libraries are: LLAMACPP_DIR, else the folder tools/setup/llamacpp.sh
// unpacks the npm package into.
std::string library_folder() {
  if (const char* dir = std::getenv("LLAMACPP_DIR"); dir != nullptr && *dir != '\0') return dir;
  return KVCHECK_LLAMACPP_DIR;
}

// Which engine drives the library: the one compiled against a llama.h (built by the set-up
// for one library folder only), or the one with kvcheck's declarations of the checked build.
struct EngineChoice {
  std::string path;
  std::string structures;  // for the report: where the structures' layout comes from
};

EngineChoice choose_engine(const std::string& lib, const std::string& abi) {
  const fs::path here = fs::read_symlink("/proc/self/exe").parent_path();
  const EngineChoice declared{(here / "kvcheck_llamacpp_engine").string(),
                              fmt::format("kvcheck's declarations of llama.cpp {}", llamacpp::kKnownVersion)};
  if (abi == "declared") return declared;
#ifdef KVCHECK_LLAMA_HEADER_LIBRARY
  std::error_code ec;
  if (fs::equivalent(lib, KVCHECK_LLAMA_HEADER_LIBRARY, ec)) {
    const fs::path engine = here / "kvcheck_llamacpp_engine_h";
    if (!fs::is_regular_file(engine, ec))  // not part of the default build
      throw InputError("--abi", "",
                       fmt::format("{}: the driver compiled against the llama.h of {} is not built: tools/kvcheck "
                                   "llamacpp builds it (or --abi declared uses kvcheck's own declarations)",
                                   abi, KVCHECK_LLAMA_HEADER_DIR));
    return {engine.string(), std::string("llama.h of ") + KVCHECK_LLAMA_HEADER_DIR};
  }
  if (abi == "header")
    throw InputError("--abi", "",
                     fmt::format("header: kvcheck was compiled against the llama.h of {}, for the libraries in {}, not "
                                 "{}; tools/kvcheck llamacpp rebuilds it for LLAMACPP_DIR (headers from "
                                 "LLAMACPP_INCLUDE or found beside the libraries)",
                                 KVCHECK_LLAMA_HEADER_DIR, KVCHECK_LLAMA_HEADER_LIBRARY, lib));
#else
  if (abi == "header")
    throw InputError("--abi", "",
                     fmt::format("header: kvcheck was built without a llama.h for {}; tools/kvcheck llamacpp finds "
                                 "one (LLAMACPP_INCLUDE, or beside LLAMACPP_DIR's libraries) and builds for it",
                                 lib));
#endif
  return declared;
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

// How the engine's process ended; `stalled` when kvcheck stopped it for making no progress.
struct EngineEnd {
  int status = 0;
  bool stalled = false;
};

// The progress file's text: it changes at every step the engine starts.
std::string progress_text(const fs::path& out) {
  std::ifstream in(out / "progress");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs the engine with `args` (argv[0] its path) and waits; returns its wait status. The
// library folder leads LD_LIBRARY_PATH: an installed llama.cpp's libraries find each other
// there without a runpath (libggml needs libggml-cpu). A hang must not hang kvcheck (nor a
// CI job): an engine whose progress file stays the same for `stall_seconds` (0: no limit)
// is sent SIGABRT, whose handler records where it was (its crash site), then SIGKILL.
EngineEnd run_engine(std::vector<std::string> args, const std::string& lib, const fs::path& out, int stall_seconds) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // ggml prints a backtrace through gdb when it aborts: the step and signal are what counts.
  const char* path = std::getenv("LD_LIBRARY_PATH");
  std::vector<std::string> env_strings = {"GGML_NO_BACKTRACE=1",
                                          "LD_LIBRARY_PATH=" + lib + (path && *path ? ":" + std::string(path) : "")};
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, "LD_LIBRARY_PATH=", 16) != 0) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  if (const int err = ::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()); err != 0)
    throw std::runtime_error(fmt::format("cannot start {}: {}", args[0], std::strerror(err)));
  using clock = std::chrono::steady_clock;
  EngineEnd end;
  std::string seen = progress_text(out);
  clock::time_point changed = clock::now(), aborted{};
  for (auto poll = std::chrono::milliseconds(1);; poll = std::min(poll * 2, std::chrono::milliseconds(50))) {
    const pid_t done = ::waitpid(pid, &end.status, WNOHANG);
    if (done == pid) return end;
    if (done < 0 && errno != EINTR) throw std::runtime_error("waitpid failed");
    const clock::time_point now = clock::now();
    if (!end.stalled && stall_seconds > 0) {
      if (std::string text = progress_text(out); text != seen) {
        seen = std::move(text);
        changed = now;
      } else if (now - changed >= std::chrono::seconds(stall_seconds)) {
        end.stalled = true;
        aborted = now;
        ::kill(pid, SIGABRT);
      }
    } else if (end.stalled && now - aborted >= std::chrono::seconds(10)) {
      ::kill(pid, SIGKILL);  // it did not end on SIGABRT
    }
    std::this_thread::sleep_for(poll);
  }
}

// The scenario cut to its first `steps` steps (a decode op keeps the decodes before the
// cut), written to `file`; false when it reads its inputs from files beside it.
bool write_prefix(const Scenario& s, std::size_t steps, const fs::path& file) {
  json j = json::parse(s.source_json);
  if (j.contains("inputs") || steps == 0) return false;
  json kept = json::array();
  for (std::size_t i = 0; i < steps; ++i) {
    const Step& step = s.steps[i];
    const bool same_op = i > 0 && s.steps[i - 1].source_index == step.source_index;
    if (!same_op) kept.push_back(j["steps"][static_cast<std::size_t>(step.source_index)]);
    if (step.source_op == "decode") kept.back()["steps"] = same_op ? kept.back()["steps"].get<int>() + 1 : 1;
  }
  j["steps"] = kept;
  write_file_atomically(file.string(), j.dump(2) + "\n");
  return true;
}

}  // namespace

// The relative paths of everything under `dir` (folders too, links not followed), sorted.
static std::vector<std::string> entries_under(const fs::path& dir) {
  std::vector<std::string> entries;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec))
    entries.push_back(it->path().lexically_relative(dir).generic_string());
  std::sort(entries.begin(), entries.end());
  return entries;
}

// What an earlier capture in `dir` wrote, as its marker lists it (one path a line after the
// first); the marker alone when it lists nothing (a run killed before it could list).
static std::set<std::string> capture_listed_files(const fs::path& dir) {
  std::set<std::string> owned = {kMarker};
  std::ifstream in(dir / kMarker);
  std::string line;
  std::getline(in, line);  // the sentence
  while (std::getline(in, line))
    if (!line.empty()) owned.insert(line);
  return owned;
}

int run_llamacpp(const LlamacppOptions& o) {
  const Scenario scenario = load_scenario(o.scenario);  // bad input is reported before any work
  std::vector<std::string> read = scenario_input_files(scenario);
  if (!o.keep.empty())
    for (std::string& f : files_under(o.keep)) read.push_back(std::move(f));  // replaced whole by this run
  check_report_paths({{"--html", o.html, ReportKind::html}, {"--junit", o.junit, ReportKind::junit},
                      {"--json", o.json, ReportKind::json}},
                     read, o.force);
  std::error_code ec;
  if (!o.keep.empty()) {
    check_output_folder(o.keep, "--trace");
    const fs::path out = o.keep;
    if (fs::exists(out, ec) && !(fs::is_directory(out, ec) && (fs::is_empty(out, ec) || fs::exists(out / kMarker, ec))))
      throw InputError(o.keep, "", "--trace: refusing to write into a folder that is not a kvcheck llamacpp capture");
    check_folder_holds_only(out, "--trace", capture_listed_files(out), "an earlier capture's",
                            scenario_input_files(scenario));
  }
  const std::string lib = library_folder();
  if (!fs::is_directory(lib, ec))
    throw InputError("LLAMACPP_DIR", "",
                     fmt::format("no llama.cpp libraries in {}: `tools/kvcheck llamacpp ...` fetches the npm package "
                                 "@node-llama-cpp/linux-x64 there, or set LLAMACPP_DIR to a folder holding "
                                 "libllama.so and libggml*.so",
                                 lib));
  const EngineChoice engine = choose_engine(lib, o.abi);
  fmt::print("llama.cpp: {} (structures: {})\n", lib, engine.structures);
  std::fflush(stdout);  // before the engine's own output
  const bool keep = !o.keep.empty();
  fs::path out;
  if (keep) {
    out = o.keep;
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
      if (!keep) {
        fs::remove_all(dir, e);
        return;
      }
      // The marker lists what this run wrote: only that is replaced by the next run.
      std::ofstream marker(dir / kMarker);
      marker << "written by kvcheck llamacpp; replaced whole by the next run, which refuses anything not listed "
                "here\n";
      for (const std::string& entry : entries_under(dir)) marker << entry << "\n";
    }
  } cleanup{out, keep};

  std::vector<std::string> args = {engine.path,    "--lib",        lib,      "--scenario", scenario.file,
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
  const EngineEnd end = run_engine(args, lib, out, o.stall_seconds);
  const int status = end.status;
  const long step = last_step(out);
  // Only a signal raised inside llama.cpp is the engine's; one in the driver's own code is
  // kvcheck's fault (exit 3), whatever step it was driving.
  const std::string site = llamacpp::read_crash_site((out / "crash_site").string());
  const std::string step_or_setup = step >= 0 && static_cast<std::size_t>(step) < scenario.steps.size()
                                        ? step_label(scenario.steps[static_cast<std::size_t>(step)],
                                                     static_cast<std::size_t>(step))
                                        : std::string(step < 0 ? "set-up" : "after the last step");
  if (end.stalled) {  // a hang: llama.cpp's is a finding, the driver's (or one nobody can place) kvcheck's fault
    if (!llamacpp::crash_site_is_llamacpp(site))
      throw std::runtime_error(fmt::format(
          "kvcheck's llama.cpp driver ({}) made no progress for {} s at {} and was stopped: {}", 
          fs::path(engine.path).filename().string(), o.stall_seconds, step_or_setup,
          site.empty() ? std::string("it did not say where it was (it did not answer SIGABRT)")
                       : fmt::format("it was in {}, a bug of kvcheck's, not of llama.cpp", site)));
    const std::string what = fmt::format("the engine hung: no progress for {} s at {}, inside {}", o.stall_seconds,
                                         step_or_setup, site.substr(site.find(' ') + 1));
    fmt::print("kvcheck llamacpp: {} through llama.cpp (K {}, V {}, flash attention {})\n{}\n", scenario.name,
               o.type_k, o.type_v, o.flash_attn ? "on" : "off", what);
    Outcome hung;
    hung.scenario = scenario.name;
    hung.file = scenario.file;
    hung.target = "llama.cpp";
    hung.checks.push_back({"engine", false, what});
    if (keep) fmt::print("captured scenario and trace in {}\n", out.string());
    if (!o.junit.empty()) write_junit(o.junit, {hung});
    if (!o.json.empty()) write_json_report(o.json, {hung});
    return 1;
  }
  if (WIFSIGNALED(status) && !site.empty() && !llamacpp::crash_site_is_llamacpp(site))
    throw std::runtime_error(fmt::format(
        "kvcheck's llama.cpp driver ({}) crashed in its own code: signal {} ({}) at {}; {}: a bug of kvcheck's, "
        "not of llama.cpp",
        fs::path(engine.path).filename().string(), WTERMSIG(status), ::strsignal(WTERMSIG(status)),
        step >= 0 && static_cast<std::size_t>(step) < scenario.steps.size()
            ? step_label(scenario.steps[static_cast<std::size_t>(step)], static_cast<std::size_t>(step))
            : std::string("set-up"),
        site));
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
    // Which state the crash met: the steps before it, run again on their own (the engine
    // is deterministic), checked, with the slot table of the last one. Whatever goes wrong
    // here, the crash stays the finding (exit 1) and the reports are written.
    const auto prefix = static_cast<std::size_t>(step);
    try {
      const fs::path before = out / "before_crash";
      fs::create_directories(before);
      if (write_prefix(scenario, prefix, before / "scenario_before.json")) {
        std::vector<std::string> again = args;
        for (std::size_t i = 0; i + 1 < again.size(); ++i) {
          if (again[i] == "--scenario") again[i + 1] = (before / "scenario_before.json").string();
          if (again[i] == "--out") again[i + 1] = before.string();
        }
        again.insert(again.end(), {"--context-of", scenario.file});  // the same cache as the crashed run
        const EngineEnd again_end = run_engine(again, lib, before, o.stall_seconds);
        const int again_status = again_end.status;
        if (again_end.stalled) throw std::runtime_error(fmt::format("the engine hung: no progress for {} s", o.stall_seconds));
        if (!WIFEXITED(again_status) || WEXITSTATUS(again_status) != 0)
          throw std::runtime_error(
              WIFSIGNALED(again_status) ? fmt::format("the engine crashed again: signal {}", WTERMSIG(again_status))
                                        : fmt::format("the engine exited with status {}", WEXITSTATUS(again_status)));
        const Scenario captured = load_scenario((before / "scenario.json").string());
        VerifyOptions verify;
        // The last step of the run again (the driver may have split an append into forwards,
        // so the captured scenario can hold more steps than the prefix).
        verify.focus_step = captured.steps.empty() ? 0 : captured.steps.size() - 1;
        const CacheTrace trace = verify_trace(captured, (before / "trace").string(), verify);
        fmt::print("\n");
        print_diagnosis(stdout,
                        fmt::format("the {} step{} before it, run again without it:", prefix, prefix == 1 ? "" : "s"),
                        captured, trace);
        crashed.checks.push_back({"before the crash", trace.outcome.passed(),
                                  trace.outcome.passed()
                                      ? fmt::format("the {} steps before it pass every check", prefix)
                                      : fmt::format("the steps before it fail too: {}",
                                                    trace.first ? first_divergence(captured, *trace.first).where
                                                                : std::string("see the report"))});
      }
    } catch (const std::exception& e) {
      fmt::print("the steps before it could not be run again on their own: {}\n", e.what());
    }
    if (keep) fmt::print("captured scenario and trace in {}\n", out.string());
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
  std::string title = fmt::format("kvcheck llamacpp: {} through llama.cpp (K {}, V {}, flash attention {})",
                                   scenario.name, o.type_k, o.type_v, o.flash_attn ? "on" : "off");
  // An append that evicts part-way runs as forwards with a shift between them, and the
  // captured scenario holds each forward as a step: say so, since step numbers then differ.
  const auto written_steps = [](const Scenario& s) { return s.steps.empty() ? 0 : s.steps.back().source_index + 1; };
  if (written_steps(captured) > written_steps(scenario))
    title += fmt::format("\n(appends that evict part-way ran as forwards with a shift between them: the captured "
                         "scenario holds each forward as a step, {} steps for the scenario's {}; paths below are "
                         "the captured scenario's)",
                         written_steps(captured), written_steps(scenario));
  print_diagnosis(stdout, title, captured, trace);
  if (keep) fmt::print("captured scenario and trace in {}\n", out.string());
  if (!o.html.empty()) write_file_atomically(o.html, diagnosis_html(captured, "llama.cpp", trace));
  if (!o.junit.empty()) write_junit(o.junit, {trace.outcome});
  if (!o.json.empty()) write_json_report(o.json, {trace.outcome});
  return trace.outcome.passed() ? 0 : 1;
}

}  // namespace kvcheck
