// kvcheck: checks KV caches against the naive reference (see README.md and docs/spec.md).
// Exit status: 0 every check passed, 1 a check failed (a cache that raised included), 2 bad
// input or usage, 3 an internal error of kvcheck itself.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tools/catalog/catalog.h"
#include "tools/cli/llamacpp_command.h"
#include "tools/harness/io/atomic_dir.h"
#include "tools/harness/sources/in_process_source.h"
#include "tools/harness/outputs/diagnose_report.h"
#include "tools/harness/outputs/export.h"
#include "tools/harness/outputs/golden.h"
#include "tools/harness/scenario/inputs.h"
#include "tools/harness/outputs/output_guard.h"
#include "tools/harness/io/progress.h"
#include "tools/harness/run/reference_run.h"
#include "tools/harness/check/report.h"
#include "tools/harness/sources/runner.h"
#include "tools/harness/io/safe_file.h"
#include "tools/harness/scenario/scenario.h"
#include "tools/harness/scenario/scenario_features.h"
#include "tools/harness/sources/trace_verify.h"
#include "tools/zoo/zoo.h"

namespace {

using namespace kvcheck;

constexpr int kPass = 0, kFail = 1, kBadInput = 2, kInternal = 3;

std::string default_scenarios() { return std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios"; }

void print_input_error(const InputError& e) { fmt::print(stderr, "kvcheck: error: {}\n", e.what()); }

// Every scenario file under the given paths, in order; bad paths are input errors.
std::vector<std::string> collect(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const std::string& path : paths.empty() ? std::vector<std::string>{default_scenarios()} : paths)
    for (std::string& f : scenario_files(path)) files.push_back(std::move(f));
  return files;
}

// The HTML page of one diagnosis: page.html for one target, page.<tag>.html for several.
std::string page_path(const std::string& html, const std::string& tag_name, bool several) {
  std::filesystem::path page = html;
  if (several) {
    std::string tag = tag_name;
    std::replace(tag.begin(), tag.end(), '/', '_');
    page.replace_extension("." + tag + page.extension().string());
  }
  return page.string();
}

void write_html(const std::string& html, const std::string& tag_name, bool several, const Scenario& scenario,
                const std::string& target, const CacheTrace& trace) {
  const std::string page = page_path(html, tag_name, several);
  write_file_atomically(page, diagnosis_html(scenario, target, trace));
  fmt::print("wrote {}\n", page);
}

int cmd_verify(const std::string& path, const std::string& trace_dir, const VerifyOptions& options,
               const std::string& html, const std::string& junit, const std::string& json, bool force) {
  const Scenario scenario = load_scenario(path);
  std::vector<std::string> read = scenario_input_files(scenario);
  for (std::string& f : files_under(trace_dir)) read.push_back(std::move(f));
  check_report_paths({{"--html", html, ReportKind::html}, {"--junit", junit, ReportKind::junit},
                      {"--json", json, ReportKind::json}},
                     read, force);
  const CacheTrace trace = verify_trace(scenario, trace_dir, options);
  Progress::line().clear();
  print_diagnosis(stdout, fmt::format("kvcheck verify: {} against the trace in {}", scenario.name, trace_dir), scenario,
                  trace);
  if (!html.empty()) write_html(html, "trace", false, scenario, "the trace in " + trace_dir, trace);
  if (!junit.empty()) write_junit(junit, {trace.outcome});
  if (!json.empty()) write_json_report(json, {trace.outcome});
  return trace.outcome.passed() ? kPass : kFail;
}

// "I/N" of --shard: this run takes shard I of N (1 <= I <= N).
struct Shard {
  std::uint64_t index = 1, count = 1;
};

Shard parse_shard(const std::string& text) {
  Shard s;
  const auto slash = text.find('/');
  auto number = [&](const std::string& part, std::uint64_t& out) {
    const auto [end, err] = std::from_chars(part.data(), part.data() + part.size(), out);
    return !part.empty() && err == std::errc() && end == part.data() + part.size();
  };
  if (slash == std::string::npos || !number(text.substr(0, slash), s.index) ||
      !number(text.substr(slash + 1), s.count) || s.count == 0 || s.index == 0 || s.index > s.count)
    throw InputError("--shard", "", fmt::format("expected I/N with 1 <= I <= N (for example 2/4), got \"{}\"", text));
  return s;
}

// Which shard a scenario file belongs to: FNV-1a of its file name, so every scenario is
// in exactly one shard and adding a scenario moves no other.
bool in_shard(const std::string& file, const Shard& shard) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : std::filesystem::path(file).filename().string()) h = (h ^ c) * 1099511628211ull;
  return h % shard.count == shard.index - 1;
}

int cmd_run(const std::vector<std::string>& paths, const RunOptions& options, const std::string& junit,
            const std::string& json, const Shard& shard, bool force) {
  std::vector<Outcome> outcomes;
  bool bad_input = false;
  std::vector<std::string> files, read;
  for (const std::string& f : collect(paths)) {
    if (in_shard(f, shard)) files.push_back(f);
    read.push_back(f);
    try {  // a scenario's .npy inputs are read too; a scenario that does not parse is reported below
      for (std::string& input : scenario_input_files(load_scenario(f))) read.push_back(std::move(input));
    } catch (const InputError&) {
    }
  }
  check_report_paths({{"--junit", junit, ReportKind::junit}, {"--json", json, ReportKind::json}}, read, force);
  if (files.empty()) {
    fmt::print("shard {}/{} holds no scenario of these paths\n\n0 passed, 0 failed\n", shard.index, shard.count);
    if (!junit.empty()) write_junit(junit, outcomes);
    if (!json.empty()) write_json_report(json, outcomes);
    return kPass;
  }
  Progress& progress = Progress::line();
  std::size_t skipped = 0;  // --kv-quant: scenarios the format cannot store
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (files.size() > 1) progress.set_prefix(fmt::format("[{}/{}]", i + 1, files.size()));
    try {
      Scenario scenario = load_scenario(files[i]);
      if (options.kv_dtype) scenario.kv_dtype = *options.kv_dtype;
      if (options.kv_quant) {
        const std::string why = quantize_scenario(scenario, *options.kv_quant);
        if (!why.empty()) {
          progress.clear();
          fmt::print(stderr, "kvcheck: skipped {}: {}\n", scenario.name, why);
          ++skipped;
          continue;
        }
      }
      for (Outcome& o : run_scenario(scenario, options)) outcomes.push_back(std::move(o));
    } catch (const std::exception& e) {
      // Reported, and counted in every report, without hiding the other scenarios' results.
      progress.clear();
      const auto* input = dynamic_cast<const InputError*>(&e);
      const std::string message = input ? e.what() : files[i] + ": " + e.what();
      fmt::print(stderr, "kvcheck: error: {}\n", message);
      Outcome o;
      o.scenario = std::filesystem::path(files[i]).stem().string();
      o.file = files[i];
      o.target = "input";
      o.checks.push_back({"input", false, message});
      outcomes.push_back(std::move(o));
      bad_input = true;
    }
  }
  progress.clear();
  if (outcomes.empty() && !bad_input) {
    fmt::print(stderr, "kvcheck: no scenario here is one the chosen caches serve (policy and kv_dtype)\n");
    return kBadInput;
  }
  print_table(stdout, outcomes, ::isatty(STDOUT_FILENO));
  if (skipped)
    fmt::print("{} scenario{} skipped: {} cannot store their head_dim\n", skipped, skipped == 1 ? "" : "s",
               to_string(*options.kv_quant));
  if (!junit.empty()) write_junit(junit, outcomes);
  if (!json.empty()) write_json_report(json, outcomes);
  if (bad_input) return kBadInput;
  for (const Outcome& o : outcomes)
    if (!o.passed()) return kFail;
  return kPass;
}

int cmd_export(const std::string& path, const std::string& out) {
  check_output_folder(out, "--out");
  const Scenario scenario = load_scenario(path);
  check_export_folder(out, "--out", scenario_input_files(scenario));
  const InputTable inputs = load_inputs(scenario);
  const ReferenceRun run = run_reference(scenario, inputs);
  write_export(scenario, inputs, run, out);
  Progress::line().clear();
  fmt::print("wrote {} ({} steps, {} uids)\n", out, run.steps.size(), inputs.uids);
  for (const std::string& problem : run.problems) fmt::print(stderr, "kvcheck: warning: {}\n", problem);
  return run.problems.empty() ? kPass : kFail;
}

// Which scenarios `list` shows: every layer's policy among `policies` (none given: any),
// and none of the features in `without`.
struct ListFilter {
  std::vector<PolicyKind> policies;
  std::vector<Feature> without;
  bool json = false;
};

int cmd_list(const std::vector<std::string>& paths, const ListFilter& filter) {
  nlohmann::json scenarios = nlohmann::json::array();
  std::vector<std::pair<Scenario, std::vector<Feature>>> shown;
  for (const std::string& file : collect(paths)) {
    Scenario s = load_scenario(file);
    const std::vector<Feature> features = scenario_features(s);
    const bool policy_ok = filter.policies.empty() ||
                           std::all_of(s.policies.begin(), s.policies.end(), [&](const Policy& p) {
                             return std::find(filter.policies.begin(), filter.policies.end(), p.kind) !=
                                    filter.policies.end();
                           });
    const bool features_ok = std::none_of(features.begin(), features.end(), [&](Feature f) {
      return std::find(filter.without.begin(), filter.without.end(), f) != filter.without.end();
    });
    if (policy_ok && features_ok) shown.emplace_back(std::move(s), features);
  }
  if (filter.json) {
    for (const auto& [s, features] : shown) {
      nlohmann::json policies = nlohmann::json::array(), names = nlohmann::json::array(),
                     caches = nlohmann::json::array();
      for (const Policy& p : s.policies) policies.push_back(to_string(p.kind));
      for (Feature f : features) names.push_back(to_string(f));
      for (const CacheEntry& c : real_caches())
        if (c.serves(s)) caches.push_back(c.name);
      scenarios.push_back({{"name", s.name},
                           {"file", s.file},
                           {"policies", policies},
                           {"features", names},
                           {"caches", caches},
                           {"description", s.description}});
    }
    nlohmann::json caches = nlohmann::json::array();
    for (const CacheEntry& c : real_caches()) caches.push_back({{"name", c.name}, {"description", c.description}});
    fmt::print("{}\n", nlohmann::json{{"scenarios", scenarios}, {"caches", caches}}.dump(
                           1, ' ', false, nlohmann::json::error_handler_t::replace));
    return kPass;
  }
  fmt::print("scenarios:\n");
  for (const auto& [s, features] : shown) {
    std::string tags;
    for (const Policy& p : s.policies) {
      // A sliding layer under a sink layer's shift (SPEC 10.4) resolves to that sink policy;
      // a reader knows it as sliding.
      const std::string kind = p.swa > 0 ? "sliding" : to_string(p.kind);
      if (("," + tags + ",").find("," + kind + ",") == std::string::npos) tags += (tags.empty() ? "" : ",") + kind;
    }
    for (Feature f : features) tags += std::string(" ") + to_string(f);
    fmt::print("  {:<40} {}\n  {:<40} {}\n", s.name, tags, "", s.description);
  }
  fmt::print("\ncaches:\n");
  for (const CacheEntry& c : real_caches()) fmt::print("  {:<40} {}\n", c.name, c.description);
  if (!zoo_caches().empty()) {
    fmt::print("\nbug zoo (deliberately broken, for demonstration only):\n");
    for (const CacheEntry& c : zoo_caches()) fmt::print("  {:<40} {}\n", c.name, c.description);
  }
  return kPass;
}

int cmd_diagnose(const std::string& path, std::vector<std::string> caches, const std::string& html,
                 const std::string& json, std::optional<std::size_t> step, bool poison_blocks, bool force) {
  const Scenario scenario = load_scenario(path);
  if (caches.empty())
    for (const CacheEntry& c : real_caches())
      if (c.serves(scenario)) caches.push_back(c.name);
  if (caches.empty())
    throw InputError(path, "/policy", "no cache serves this policy (`kvcheck list` shows the caches)");
  std::vector<ReportPath> reports = {{"--json", json, ReportKind::json}};
  if (!html.empty())
    for (const std::string& name : caches) reports.push_back({"--html", page_path(html, name, caches.size() > 1), ReportKind::html});
  check_report_paths(reports, scenario_input_files(scenario), force);
  const InputTable inputs = load_inputs(scenario);
  const ReferenceRun run = run_reference(scenario, inputs);
  // A wrong expectation in the scenario is not the cache's fault, but it is a failure.
  for (const std::string& problem : run.problems)
    fmt::print(stderr, "kvcheck: the scenario's expectation does not hold: {}\n", problem);
  bool diverged = !run.problems.empty();
  std::vector<Outcome> outcomes;
  for (const std::string& name : caches) {
    const CacheEntry* found = find_cache(name);
    const CacheEntry poisoned = poison_blocks ? with_poisoned_blocks(*found) : CacheEntry{};
    const CacheEntry* cache = poison_blocks ? &poisoned : found;
    if (!cache->serves(scenario))
      throw InputError(
          path, "/policy",
          fmt::format("cache {} does not serve the {} of this scenario", name,
                      scenario.hybrid() ? std::string("per-layer policies")
                                        : std::string(to_string(scenario.shared_policy()->kind)) + " policy"));
    const CacheTrace trace = trace_cache(scenario, inputs, run, *cache, !html.empty(), step);
    Progress::line().clear();
    print_diagnosis(stdout, fmt::format("kvcheck diagnose: {} on {}", scenario.name, name), scenario, trace);
    if (!html.empty()) write_html(html, name, caches.size() > 1, scenario, name, trace);
    diverged = diverged || !trace.outcome.passed();
    outcomes.push_back(trace.outcome);
  }
  if (!json.empty()) write_json_report(json, outcomes);
  return diverged ? kFail : kPass;
}

// docs/caches.md's table of the zoo, as Markdown (tests/check_zoo_table.sh compares the two).
int print_zoo_table() {
  const auto cell = [](const std::string& text) {
    std::string out;
    for (const char c : text) {
      if (c == '|') out.push_back('\\');
      out.push_back(c);
    }
    return out;
  };
  fmt::print("| mutant | the bug | where it appeared | kvcheck says | caught on |\n|---|---|---|---|---|\n");
  for (const ZooMutant& m : zoo_mutants()) {
    std::vector<std::string> fixtures;
    for (const std::string& f : m.fixtures) fixtures.push_back(fmt::format("`{}`", f));
    fmt::print("| `{}` | {} | {} | {} | {} |\n", m.cache.name.substr(m.cache.name.find('/') + 1),
               cell(m.cache.description), cell(m.in_the_wild), cell(class_name(m.expected)),
               fmt::join(fixtures, ", "));
  }
  return kPass;
}

int cmd_zoo(const std::vector<std::string>& only, std::optional<KvDtype> kv_dtype) {
  if (kv_dtype) fmt::print("every fixture with its caches storing {}\n", to_string(*kv_dtype));
  fmt::print("{:<28} {:<36} {:<7} {:<38} {}\n", "mutant", "fixture", "caught", "diagnosed class", "as expected");
  bool all = true;
  int mutants = 0;
  for (const ZooMutant& m : zoo_mutants()) {
    if (!only.empty() && std::find(only.begin(), only.end(), m.cache.name) == only.end()) continue;
    ++mutants;
    for (const std::string& fixture : m.fixtures) {
      Scenario s = load_scenario(default_scenarios() + "/" + fixture + ".json");
      if (kv_dtype) s.kv_dtype = *kv_dtype;
      if (!m.cache.serves(s)) {
        fmt::print("{:<28} {:<36} {:<7} {:<38} {}\n", m.cache.name, fixture, "-", "(not a bug in this storage)", "-");
        continue;
      }
      const InputTable inputs = load_inputs(s);
      const ReferenceRun run = run_reference(s, inputs);
      const CacheTrace trace = trace_cache(s, inputs, run, m.cache, false);
      const bool caught = !trace.outcome.passed();
      const BugClass got = trace.first ? trace.first->bug : BugClass::none;
      const bool right = caught && got == m.expected;
      all = all && right;
      fmt::print("{:<28} {:<36} {:<7} {:<38} {}\n", m.cache.name, fixture, caught ? "yes" : "NO", class_name(got),
                 right ? "yes" : fmt::format("NO (expected {})", class_name(m.expected)));
    }
  }
  if (mutants == 0) throw InputError("--mutant", "", "no such mutant (`kvcheck list` shows the zoo)");
  fmt::print("\n{}\n", all ? "every mutant caught and classified" : "some mutants escaped or were misclassified");
  return all ? kPass : kFail;
}

// --cache names must exist; a typo is bad input, not an empty run.
void validate_cache_names(const std::vector<std::string>& names) {
  for (const std::string& name : names)
    if (find_cache(name) == nullptr) {
      std::string known;
      for (const CacheEntry& c : real_caches()) known += (known.empty() ? "" : ", ") + c.name;
      throw InputError("--cache", "",
                       fmt::format("unknown cache \"{}\" (known: {}; `kvcheck list` shows the zoo)", name, known));
    }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvcheck: checks transformer KV caches against a naive full-recompute reference"};
  app.require_subcommand(1);
  app.fallthrough();  // --allow-outside-paths and --progress may follow the command
  bool show_progress = ::isatty(STDERR_FILENO) != 0;
  app.add_flag("--progress,!--no-progress", show_progress,
               "a progress line on stderr for runs over two seconds (default: when stderr is a terminal)");
  app.add_flag("--allow-outside-paths", g_allow_outside_paths,
               "let file names in scenarios and traces lead outside their folder (off: refused)");

  std::vector<std::string> run_paths, run_caches;
  std::string junit, json;
  RunOptions options;
  CLI::App* run = app.add_subcommand("run", "run scenarios (files or folders; default: the built-in suite)");
  run->add_option("paths", run_paths, "scenario files or folders");
  run->add_option("--junit", junit, "write a JUnit XML report to FILE (- for standard output)");
  run->add_option("--json", json, "write a JSON report to FILE (- for standard output)");
  bool force_reports = false;
  const char* force_help = "let a report replace an existing file that is not a kvcheck report of its kind (never "
                           "a file the command reads)";
  run->add_flag("--force", force_reports, force_help);
  // One value per --cache, so scenario paths after it stay paths.
  run->add_option("--cache", run_caches, "only this cache (repeat for more; zoo/NAME for a mutant)")
      ->allow_extra_args(false);
  std::string shard_text = "1/1";
  run->add_option("--shard", shard_text, "run shard I of N (I/N): a fixed 1/N of the scenarios, for CI matrices");
  run->add_flag(
      "--no-reference", [&](std::int64_t) { options.reference_checks = false; },
      "skip the reference's own invariant checks");
  const std::map<std::string, KvDtype> dtypes = {
      {"float32", KvDtype::float32}, {"float16", KvDtype::float16}, {"bfloat16", KvDtype::bfloat16}};
  bool poison_blocks = false;
  run->add_flag("--poison-blocks", poison_blocks,
                "paged caches fill new and freed blocks with NaNs that name the block (SPEC 8.8.5), so a read of "
                "an unwritten or freed slot shows in the outputs");
  run->add_option("--kv-dtype", options.kv_dtype,
                  "caches store keys and values in this format, whatever the scenarios say (float32, float16, "
                  "bfloat16)")
      ->transform(CLI::CheckedTransformer(dtypes, CLI::ignore_case));
  run->add_option_function<std::string>(
         "--kv-quant", [&](const std::string& name) { options.kv_quant = quant_format_named(name); },
         "caches store keys and values quantized in this format (SPEC 9), with its default scale")
      ->check(CLI::IsMember(names_in(kQuantFormatNames)));

  std::string export_path, export_out;
  CLI::App* exp = app.add_subcommand("export", "write a scenario's inputs and reference results (SPEC 6)");
  exp->add_option("scenario", export_path, "scenario file")->required();
  exp->add_option("--out", export_out, "output folder (replaced whole, atomically)")->required();

  std::vector<std::string> list_paths;
  ListFilter list_filter;
  CLI::App* list = app.add_subcommand("list", "list scenarios (with their policies and features) and caches");
  list->add_option("paths", list_paths, "scenario files or folders");
  const std::map<std::string, PolicyKind> policy_names = {
      {"full", PolicyKind::full},
      {"sliding", PolicyKind::sliding},
      {"sink", PolicyKind::sink},
      {"chunked", PolicyKind::chunked}};
  std::map<std::string, Feature> feature_names;
  for (Feature f : all_features()) feature_names[to_string(f)] = f;
  std::vector<std::string> list_policies, list_without;
  list->add_option("--policy", list_policies,
                   "only scenarios whose every layer has one of these policies (repeatable: full, sliding, sink, chunked)")
      ->check(CLI::IsMember(policy_names))
      ->allow_extra_args(false);
  list->add_option("--without", list_without, "leave out scenarios with this feature (repeatable)")
      ->check(CLI::IsMember(feature_names))
      ->allow_extra_args(false);
  list->add_flag("--json", list_filter.json, "print JSON: each scenario's file, policies, features and caches");

  std::string diagnose_path, html;
  std::vector<std::string> diagnose_caches;
  CLI::App* diagnose = app.add_subcommand("diagnose", "find a cache's first divergence from the reference and name it");
  diagnose->add_option("scenario", diagnose_path, "scenario file")->required();
  diagnose
      ->add_option("--cache", diagnose_caches,
                   "cache to diagnose (repeatable; default: every cache serving the policy)")
      ->allow_extra_args(false);
  diagnose->add_option("--html", html, "also write a self-contained HTML page with a picture of the slots");
  std::string diagnose_json;
  diagnose->add_option("--json", diagnose_json,
                       "write a JSON report to FILE (- for standard output; per cache: the checks and the first divergence as fields)");
  std::optional<std::size_t> diagnose_step, verify_step;
  diagnose->add_flag("--force", force_reports, force_help);
  diagnose->add_option("--step", diagnose_step, "also show step N's evidence and slot table (as numbered in reports)");
  diagnose->add_flag("--poison-blocks", poison_blocks, "as run's: paged caches poison new and freed blocks");

  GoldenOptions golden_options;
  std::vector<std::string> golden_paths;
  CLI::App* golden = app.add_subcommand("golden", "golden fixtures: the reference's exports, committed");
  golden->require_subcommand(1);
  CLI::App* generate =
      golden->add_subcommand("generate", "write fixtures/golden/<scenario>/ (atomically, all or nothing)");
  generate->add_option("scenarios", golden_paths, "scenario files or folders (default: the built-in suite)");
  generate->add_option("--out", golden_options.dir, "golden folder (default: fixtures/golden)");
  generate->add_flag("--force", golden_options.force, "overwrite goldens that changed");
  CLI::App* check = golden->add_subcommand("check", "recompute the reference and compare with the goldens");
  check->add_option("scenarios", golden_paths, "scenario files or folders (default: the built-in suite)");
  check->add_option("--dir", golden_options.dir, "golden folder (default: fixtures/golden)");

  std::string verify_path, trace_dir;
  CLI::App* verify =
      app.add_subcommand("verify", "check an external trace (a cache's dumped state) against the reference");
  verify->add_option("scenario", verify_path, "scenario file the trace ran")->required();
  verify->add_option("--trace", trace_dir, "trace folder (manifest.json with format kvcheck-trace-1)")->required();
  std::string verify_html, verify_junit, verify_json;
  verify->add_option("--html", verify_html, "also write a self-contained HTML page with a picture of the slots");
  verify->add_option("--junit", verify_junit, "write a JUnit XML report to FILE (- for standard output)");
  verify->add_option("--json", verify_json, "write a JSON report to FILE (- for standard output)");
  verify->add_flag("--force", force_reports, force_help);
  verify->add_option("--step", verify_step, "also show step N's evidence and slot table (as numbered in reports)");

  LlamacppOptions llamacpp_options;
  CLI::App* llamacpp = app.add_subcommand(
      "llamacpp", "run a scenario through llama.cpp's own KV cache (context shift as llama-server) and check it");
  llamacpp->add_option("scenario", llamacpp_options.scenario,
                       "scenario file: policy sink or full (the llama arch), or a list of sliding layers beside "
                       "full or sink ones (the gemma3 arch)")
      ->required();
  const std::vector<std::string> cache_types = {"f32", "f16", "q8_0", "q4_0", "bf16"};
  llamacpp->add_option("--type-k", llamacpp_options.type_k, "K cache type (default f32)")
      ->check(CLI::IsMember(cache_types));
  llamacpp->add_option("--type-v", llamacpp_options.type_v, "V cache type (default f32)")
      ->check(CLI::IsMember(cache_types));
  std::string flash = "off";
  llamacpp->add_option("--flash-attn", flash, "flash attention on or off (default off)")
      ->check(CLI::IsMember({"on", "off"}));
  llamacpp->add_option("--abi", llamacpp_options.abi,
                       "where the layout of llama.cpp's structures comes from: header (the llama.h the set-up "
                       "built the engine against, for these libraries), declared (kvcheck's own declarations of "
                       "the build it knows; other versions are refused) or auto (header when there is one; "
                       "default)")
      ->check(CLI::IsMember({"auto", "header", "declared"}));
  llamacpp->add_option("--trace", llamacpp_options.keep, "keep the captured scenario and trace in DIR");
  llamacpp->add_option("--plant-fault", llamacpp_options.plant,
                       "kvcheck's self-test: break the driver's own shift (remove-without-add: seq_rm without "
                       "seq_add; add-short: seq_add by k - 1; issue-12357: a gemma3 model's moved keys shifted "
                       "with the full layers' rope in every layer, llama.cpp's bug before March 2025), crash it "
                       "in its own code (driver-crash) or hang it there (driver-hang)")
      ->check(CLI::IsMember({"remove-without-add", "add-short", "issue-12357", "driver-crash", "driver-hang"}));
  llamacpp->add_option("--stall-timeout", llamacpp_options.stall_seconds,
                       "stop the engine when one step takes longer than SECONDS and say where it was (default "
                       "600; 0: wait for ever)")
      ->check(CLI::NonNegativeNumber);
  llamacpp->add_flag("--restore-after-shift", llamacpp_options.restore_after_shift,
                     "save the sequence right after the first shift's seq_add and restore it into a fresh context "
                     "before the next decode (a server swapping a slot out between the two)");
  llamacpp->add_option("--html", llamacpp_options.html, "also write a self-contained HTML page");
  llamacpp->add_option("--junit", llamacpp_options.junit, "write a JUnit XML report to FILE (- for standard output)");
  llamacpp->add_option("--json", llamacpp_options.json, "write a JSON report to FILE (- for standard output)");
  llamacpp->add_flag("--force", force_reports, force_help);

  std::vector<std::string> zoo_only;
  CLI::App* zoo = app.add_subcommand("zoo", "run the bug zoo: deliberately broken caches kvcheck must catch");
  zoo->add_option("--mutant", zoo_only, "only this mutant (zoo/NAME; repeatable)")->allow_extra_args(false);
  std::optional<KvDtype> zoo_dtype;
  zoo->add_option("--kv-dtype", zoo_dtype, "run every fixture with its caches storing this format")
      ->transform(CLI::CheckedTransformer(dtypes, CLI::ignore_case));
  bool zoo_table = false;
  zoo->add_flag("--table", zoo_table, "print the mutants as docs/caches.md's Markdown table (runs nothing)")
      ->excludes("--mutant")
      ->excludes("--kv-dtype");

  if (argc == 1) {  // no command: show what there is
    fmt::print(stderr, "{}", app.help());
    return kBadInput;
  }
  // A mistyped command gets the list, not CLI11's "a subcommand is required".
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.rfind("-", 0) == 0) continue;
    const auto subs = app.get_subcommands({});
    if (std::none_of(subs.begin(), subs.end(), [&](const CLI::App* sub) { return sub->check_name(word); })) {
      std::string names;
      for (const CLI::App* sub : subs) names += (names.empty() ? "" : ", ") + sub->get_name();
      fmt::print(stderr, "kvcheck: error: unknown command \"{}\" (commands: {})\n", word, names);
      return kBadInput;
    }
    break;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kPass : kBadInput;
  }

  Progress::line().enable(show_progress);
  try {
    // One report at most to standard output ("-"); the tables and diagnoses then go to
    // standard error, so what a script reads from standard output parses.
    const std::vector<const std::string*> reports = {&junit,        &json,         &html,
                                                     &diagnose_json, &verify_html, &verify_junit,
                                                     &verify_json,  &llamacpp_options.html,
                                                     &llamacpp_options.junit, &llamacpp_options.json};
    const auto to_stdout = std::count_if(reports.begin(), reports.end(), [](const std::string* r) { return *r == "-"; });
    if (to_stdout > 1) {
      fmt::print(stderr, "kvcheck: error: only one report can go to standard output (\"-\"), {} do\n", to_stdout);
      return kBadInput;
    }
    if (to_stdout == 1) reserve_stdout_for_report();
    if (*run) {
      validate_cache_names(run_caches);
      for (const std::string& name : run_caches) options.caches.push_back(find_cache(name));
      if (!options.caches.empty()) options.reference_checks = false;  // show the asked-for caches only
      if (options.caches.empty())
        for (const CacheEntry& c : real_caches()) options.caches.push_back(&c);
      std::vector<CacheEntry> poisoned;  // --poison-blocks: the same caches, reconfigured
      if (poison_blocks) {
        poisoned.reserve(options.caches.size());
        for (const CacheEntry*& c : options.caches) c = &poisoned.emplace_back(with_poisoned_blocks(*c));
      }
      return cmd_run(run_paths, options, junit, json, parse_shard(shard_text), force_reports);
    }
    if (*exp) return cmd_export(export_path, export_out);
    if (*diagnose) {
      validate_cache_names(diagnose_caches);
      return cmd_diagnose(diagnose_path, diagnose_caches, html, diagnose_json, diagnose_step, poison_blocks,
                          force_reports);
    }
    if (*zoo) return zoo_table ? print_zoo_table() : cmd_zoo(zoo_only, zoo_dtype);
    if (*llamacpp) {
      llamacpp_options.flash_attn = flash == "on";
      llamacpp_options.force = force_reports;
      return run_llamacpp(llamacpp_options);
    }
    if (*verify) {
      VerifyOptions verify_options;
      verify_options.picture = !verify_html.empty();
      verify_options.focus_step = verify_step;
      return cmd_verify(verify_path, trace_dir, verify_options, verify_html, verify_junit, verify_json,
                        force_reports);
    }
    if (*golden) {
      golden_options.scenario_files = collect(golden_paths);
      golden_options.prune = golden_paths.empty();  // the whole suite: drop goldens of deleted scenarios
      if (golden_options.dir.empty()) golden_options.dir = std::string(KVCHECK_SOURCE_DIR) + "/fixtures/golden";
      if (*generate) check_output_folder(golden_options.dir, "--out");
      return *generate ? generate_goldens(golden_options) : check_goldens(golden_options);
    }
    if (*list) {
      for (const std::string& p : list_policies) list_filter.policies.push_back(policy_names.at(p));
      for (const std::string& f : list_without) list_filter.without.push_back(feature_names.at(f));
      return cmd_list(list_paths, list_filter);
    }
  } catch (const InputError& e) {
    print_input_error(e);
    return kBadInput;
  } catch (const std::filesystem::filesystem_error& e) {
    // A folder that cannot be written, a name too long, a dangling link: the user's to fix.
    fmt::print(stderr, "kvcheck: error: {}: {}\n", e.path1().string(), e.code().message());
    return kBadInput;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "kvcheck: error: out of memory (the scenario or trace is larger than this machine holds)\n");
    return kBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvcheck: internal error: {}\n", e.what());
    return kInternal;
  }
  return kBadInput;
}
