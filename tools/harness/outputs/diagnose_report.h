// How `kvcheck diagnose` shows a cache's first divergence: a text report with the slot
// table, and a self-contained HTML page with an SVG picture of positions over steps.
#pragma once

#include <cstdio>
#include <string>

#include "tools/harness/check/step_checker.h"

namespace kvcheck {

// `title` heads the report, e.g. "kvcheck diagnose: SCENARIO on CACHE".
void print_diagnosis(std::FILE* out, const std::string& title, const Scenario& scenario, const CacheTrace& trace);

// The whole page as one string (no external resources).
std::string diagnosis_html(const Scenario& scenario, const std::string& cache, const CacheTrace& trace);

}  // namespace kvcheck
