// A scenario too large to run whole (a 62-layer model over an 8k prompt holds 16.6 GB of
// inputs alone) runs as groups of consecutive layers, each an ordinary scenario of its own.
// Layers never read one another's tokens in kvcheck's model (SPEC 7) except through a
// crop's refusal, which every layer decides together, and a sliding layer under another
// layer's sink policy (SPEC 10.4): a scenario with either runs whole or not at all.
#pragma once

#include <string>

#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

// Why the scenario's layers cannot run apart, or an empty string.
std::string why_layers_cannot_run_apart(const Scenario& s);

// Layers [first, first + count) of `s` as a scenario of its own, named "NAME [layers A-B]":
// the same steps and inputs, each layer with its policy, rope, quantized storage and sink
// logits. Its input table is that slice of the whole one, bit for bit.
Scenario layer_group(const Scenario& s, int first, int count);

// The layers' period: the smallest p with every layer l configured as layer l mod p.
int layer_period(const Scenario& s);

// The most consecutive layers a group may hold: all of them when the scenario fits whole
// in `budget` bytes (estimate_cost); else every group within half of it (its caches hold
// about as much again as the estimate) and 1e9 input values, rounded down to a whole number
// of periods when it holds one at least, so that groups look alike; 1 when a layer fits the
// budget but not its half; 0 when a single layer does not fit or the layers cannot run apart.
int layer_group_size(const Scenario& s, double budget);

// Layer numbers in a group's report text, "layer 2", as the whole scenario's, "layer 8".
std::string renumber_layers(const std::string& text, int first);

}  // namespace kvcheck
