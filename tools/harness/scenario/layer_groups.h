// A scenario too large to run whole (a 62-layer model over an 8k prompt holds 16.6 GB of
// inputs alone) runs as groups of consecutive layers, each an ordinary scenario of its own.
// Layers never read one another's tokens in kvcheck's model (SPEC 7) except through a
// crop's refusal, which every layer decides together, and a sliding layer under another
// layer's sink policy (SPEC 10.4): a scenario with either runs whole or not at all.
#pragma once

#include <functional>
#include <string>

#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// Why the scenario's layers cannot run apart, or an empty string.
std::string why_layers_cannot_run_apart(const Scenario& s);

// Layers [first, first + count) of `s` as a scenario of its own, named "NAME [layers A-B]":
// the same steps and inputs, each layer with its policy, rope, quantized storage and sink
// logits. Its input table is that slice of the whole one, bit for bit.
Scenario layer_group(const Scenario& s, int first, int count);
// Only the layers' part of that into `g`, a copy of `s` (not `s` itself): what serves a
// group can be asked of one copy, its steps not copied again for every group.
void take_layers(Scenario& g, const Scenario& s, int first, int count);

// The layers' period: the smallest p with every layer l configured as layer l mod p.
int layer_period(const Scenario& s);

// How many caches under test serve layers [first, first + count) of `s` as a group.
using CachesServing = std::function<int(const Scenario& s, int first, int count)>;
inline int one_cache(const Scenario&, int, int) { return 1; }

// The most consecutive layers a group may hold: all of them when the scenario fits whole
// in 85% of `budget` bytes beside the caches that serve it (estimate_cost); else every
// group likewise, and within 1e9 input values, rounded down to a whole number of periods
// when it holds one at least, so that groups look alike; 1 when a layer fits the budget
// with one cache (what the parser accepts) but no larger group fits; 0 when a single layer
// does not fit or the layers cannot run apart.
int layer_group_size(const Scenario& s, double budget, const CachesServing& caches = one_cache);

// Layer numbers in a group's report text, "layer 2" and "layers 0, 1" or "layers 0-2", as
// the whole scenario's, "layer 8" and "layers 6, 7" or "layers 6-8".
std::string renumber_layers(const std::string& text, int first);

}  // namespace kvcheck
