#include "tools/harness/scenario/layer_groups.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <type_traits>

namespace kvcheck {

namespace {

bool fits(const Scenario& s, int first, int count, double budget) {
  return input_values(s, count) <= 1e9 && estimate_layers_cost(s, first, count).bytes <= budget;
}

// Every group of `size` layers fits.
bool all_fit(const Scenario& s, int size, double budget) {
  for (int first = 0; first < s.dims.layers; first += size)
    if (!fits(s, first, std::min(size, s.dims.layers - first), budget)) return false;
  return true;
}

}  // namespace

std::string why_layers_cannot_run_apart(const Scenario& s) {
  if (s.inputs.kind != InputSource::Kind::seed) return "its inputs are read from files, not generated from a seed";
  if (s.paging) return "its caches are paged (SPEC 8)";
  for (const Policy& p : s.policies)
    if (p.shift_with >= 0) return "a sliding layer is shifted with another layer's sink policy (SPEC 10.4)";
  for (const Step& step : s.steps)
    if (step.op == StepOp::crop)
      return fmt::format("step {} crops, and a crop's refusal is every layer's together", step.source_index);
  // Sizing groups estimates each of them a few times over: bounded, as a hostile file could
  // make it take long.
  if (static_cast<double>(s.steps.size()) * s.dims.batch * s.dims.layers > 5e7)
    return fmt::format("its {} steps x {} rows x {} layers are too many to plan groups of layers", s.steps.size(),
                       s.dims.batch, s.dims.layers);
  return "";
}

Scenario layer_group(const Scenario& s, int first, int count) {
  Scenario g = s;
  const auto from = static_cast<std::ptrdiff_t>(first), to = static_cast<std::ptrdiff_t>(first + count);
  auto slice = [&](auto& layers) {
    if (layers.empty()) return;
    layers = std::decay_t<decltype(layers)>(layers.begin() + from, layers.begin() + to);  // not assign: aliasing
  };
  g.name = fmt::format("{} [layers {}-{}]", s.name, first, first + count - 1);
  g.dims.layers = count;
  slice(g.ropes);
  slice(g.policies);
  slice(g.quants);
  slice(g.attention.sink_logits);
  g.inputs.first_layer = s.inputs.first_layer + first;
  return g;
}

int layer_period(const Scenario& s) {
  const int layers = s.dims.layers;
  for (int p = 1; p < layers; ++p) {
    bool repeats = true;
    for (int l = p; l < layers && repeats; ++l) {
      const auto same = [&](const auto& v) {
        return v.empty() || v[static_cast<std::size_t>(l)] == v[static_cast<std::size_t>(l % p)];
      };
      repeats = same(s.policies) && same(s.ropes) && same(s.quants);
    }
    if (repeats) return p;
  }
  return layers;
}

int layer_group_size(const Scenario& s, double budget) {
  const int layers = s.dims.layers;
  if (fits(s, 0, layers, budget)) return layers;
  if (!why_layers_cannot_run_apart(s).empty()) return 0;
  if (!all_fit(s, 1, budget)) return 0;
  // A group's estimate is held to half the budget: its caches, which the estimate leaves
  // out, hold about as much again (four sliding layers of Gemma 3 27B's shape over 8,224
  // tokens, estimated at 4.6 GB, reached 8.1 GB resident beside two caches); one layer at a
  // time when even that is over half.
  budget /= 2;
  if (!all_fit(s, 1, budget)) return 1;
  // A group costs more the more layers it holds: the largest size that fits, by bisection
  // (at most 10 rounds for the parser's 1024 layers), then whole periods that fit.
  int fit = 1, too_big = layers;
  while (too_big - fit > 1) {
    const int mid = fit + (too_big - fit) / 2;
    (all_fit(s, mid, budget) ? fit : too_big) = mid;
  }
  const int period = layer_period(s);
  if (fit < period) return fit;
  for (int size = fit - fit % period; size >= period; size -= period)
    if (all_fit(s, size, budget)) return size;
  return fit;
}

std::string renumber_layers(const std::string& text, int first) {
  if (first == 0) return text;
  static const std::string word = "layer ";
  std::string out;
  std::size_t at = 0;
  while (true) {
    const std::size_t found = text.find(word, at);
    if (found == std::string::npos) break;
    std::size_t digits = found + word.size();
    std::size_t end = digits;
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    out.append(text, at, digits - at);
    if (end > digits) out += std::to_string(std::stoll(text.substr(digits, end - digits)) + first);
    at = end;
  }
  out.append(text, at, std::string::npos);
  return out;
}

}  // namespace kvcheck
