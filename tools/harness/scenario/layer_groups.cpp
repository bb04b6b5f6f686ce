#include "tools/harness/scenario/layer_groups.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <type_traits>

namespace kvcheck {

namespace {

// One layer alone fits with one cache under test: what the parser accepts.
bool layer_fits(const Scenario& s, int layer, double budget) {
  return input_values(s, 1) <= 1e9 && estimate_layers_cost(s, layer, 1).bytes <= budget;
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

void take_layers(Scenario& g, const Scenario& s, int first, int count) {
  const auto from = static_cast<std::ptrdiff_t>(first), to = static_cast<std::ptrdiff_t>(first + count);
  auto slice = [&](auto& into, const auto& layers) {
    into = layers.empty() ? layers : std::decay_t<decltype(layers)>(layers.begin() + from, layers.begin() + to);
  };
  g.dims.layers = count;
  slice(g.ropes, s.ropes);
  slice(g.policies, s.policies);
  slice(g.quants, s.quants);
  slice(g.attention.sink_logits, s.attention.sink_logits);
  g.inputs.first_layer = s.inputs.first_layer + first;
}

Scenario layer_group(const Scenario& s, int first, int count) {
  Scenario g = s;
  g.name = fmt::format("{} [layers {}-{}]", s.name, first, first + count - 1);
  take_layers(g, s, first, count);
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

int layer_group_size(const Scenario& s, double budget, const CachesServing& caches) {
  const int layers = s.dims.layers;
  // 15% of the budget is kept spare: on Gemma 3 27B's shape the estimate came up to 10% under
  // the peaks measured (docs/performance.md).
  const double usable = 0.85 * budget;
  const auto fit_bytes = [&](int first, int count) {
    const ScenarioCost cost = estimate_layers_cost(s, first, count);
    return cost.bytes + std::max(0, caches(s, first, count) - 1) * cost.cache_bytes;
  };
  if (input_values(s, layers) <= 1e9 && fit_bytes(0, layers) <= usable) return layers;
  if (!why_layers_cannot_run_apart(s).empty()) return 0;
  for (int l = 0; l < layers; ++l)
    if (!layer_fits(s, l, budget)) return 0;
  const auto all_fit = [&](int size) {
    if (input_values(s, size) > 1e9) return false;
    for (int first = 0; first < layers; first += size)
      if (fit_bytes(first, std::min(size, layers - first)) > usable) return false;
    return true;
  };
  // A group costs more the more layers it holds, mostly: the largest size that fits, by
  // bisection (at most 10 rounds for the parser's 1024 layers), then whole periods that
  // fit. Not always: Gemma 3 27B's full layer alone, served by three caches, takes more than
  // beside two sliding layers, served by the hybrid alone; so size 1 is not assumed to fit,
  // and a larger size that fits past one that does not may be missed. One layer at a time
  // when no larger group fits, whatever its caches take (the report says so).
  int fit = 1, too_big = layers;
  while (too_big - fit > 1) {
    const int mid = fit + (too_big - fit) / 2;
    (all_fit(mid) ? fit : too_big) = mid;
  }
  const int period = layer_period(s);
  if (fit < period) return fit;
  for (int size = fit - fit % period; size >= period; size -= period)
    if (all_fit(size)) return size;
  return fit;
}

std::string renumber_layers(const std::string& text, int first) {
  if (first == 0) return text;
  static const std::string word = "layer";
  const auto digit = [&](std::size_t i) { return i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); };
  std::string out;
  std::size_t at = 0;
  while (true) {
    const std::size_t found = text.find(word, at);
    if (found == std::string::npos) break;
    // "layer N", or "layers N, M" and "layers A-B": each number of the list.
    std::size_t next = found + word.size();
    const bool plural = next < text.size() && text[next] == 's';
    if (plural) ++next;
    if (next >= text.size() || text[next] != ' ' || !digit(next + 1)) {
      out.append(text, at, next - at);
      at = next;
      continue;
    }
    out.append(text, at, next + 1 - at);
    std::size_t i = next + 1;
    while (true) {
      std::size_t end = i;
      while (digit(end)) ++end;
      int number = 0;  // a number too long for an int is copied as it is
      const auto [stop, error] = std::from_chars(text.data() + i, text.data() + end, number);
      if (error == std::errc{} && stop == text.data() + end && number <= INT_MAX - first)
        out += std::to_string(number + first);
      else
        out.append(text, i, end - i);
      i = end;
      const std::size_t gap = text.compare(i, 2, ", ") == 0 ? 2 : (i < text.size() && text[i] == '-') ? 1 : 0;
      if (!plural || gap == 0 || !digit(i + gap)) break;
      out.append(text, i, gap);
      i += gap;
    }
    at = i;
  }
  out.append(text, at, std::string::npos);
  return out;
}

}  // namespace kvcheck
