// The scenario parser's sections, one file each; parse_scenario (scenario.cpp) reads the
// top level and calls them in the order the fields depend on each other.
#pragma once

#include <string>
#include <vector>

#include "tools/harness/scenario/reader.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck::scenario_parse {

// scenario_quant.cpp: SPEC 9's `kv_quant`, one object (every layer's) or one per layer.
KvQuant parse_kv_quant(const Reader& r, const json& j, const Dims& dims, const std::string& p = "/kv_quant");
std::vector<KvQuant> parse_layer_quants(const Reader& r, const json& j, const Dims& dims);

// scenario_paging.cpp: `paging` (SPEC 8), after the policy and kv_quant it must fit; then
// the pool, refused when it would not fit memory or the scenario's steps.
Paging parse_paging(const Reader& r, const json& j, const Scenario& s);
void require_pool_fits(const Reader& r, const Scenario& s);

// scenario_cost.cpp: sizes and durations as messages print them.
std::string bytes_text(double bytes);
std::string duration_text(double seconds);

}  // namespace kvcheck::scenario_parse
