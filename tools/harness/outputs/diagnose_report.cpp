#include "tools/harness/outputs/diagnose_report.h"

#include "tools/harness/check/divergence_report.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvcheck {
namespace {

std::string opt(const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : "-"; }
const char* yes(bool b) { return b ? "yes" : "no"; }

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

std::string colour(const PictureCell& c) {
  switch (c.state) {
    case PictureCell::State::empty:
      return "#eeeeee";
    case PictureCell::State::ok:
      return "#4caf50";
    case PictureCell::State::dead:
      return "#a5d6a7";
    case PictureCell::State::stale:
      return "#607d8b";
    case PictureCell::State::not_retained:
      return "#ff9800";
    case PictureCell::State::duplicated:
      return "#9c27b0";
    case PictureCell::State::wrong_precision:
      return "#2196f3";
    case PictureCell::State::wrong_position: {
      // Redder as the position error grows (1 light, 8 or more full).
      const int level = static_cast<int>(std::min<std::int64_t>(8, std::abs(c.error)));
      const int g = 200 - level * 22;
      return fmt::format("#ff{:02x}{:02x}", std::max(g, 0), std::max(g, 0));
    }
  }
  return "#ffffff";
}

void print_step(std::FILE* out, const char* what, const Scenario& s, const StepDiagnosis& f) {
  const FirstDivergence d = first_divergence(s, f);
  fmt::print(out, "{}: {}\n", what, d.where);
  fmt::print(out, "  {}\n", d.what);
  if (f.bug != BugClass::none) fmt::print(out, "class: {}\n  {}\n", class_name(f.bug), class_explanation(f.bug));
  fmt::print(out, "\n");
  if (f.slots.empty()) return;
  fmt::print(
      out, "slots of row {} in layer {} after {}{}:\n", f.row, f.layer, f.evidence.label,
      f.table_query_index >= 0
          ? fmt::format(" (visibility and Pq-Pk as seen by token {}, the row's last of the step)", f.table_query_index)
          : "");
  // A paged cache's slot is block * B + offset: shown as "block+offset".
  const bool paged = f.block_size > 0;
  const auto slot_text = [&](std::int64_t slot) {
    if (slot < 0) return std::string("-");
    return paged ? fmt::format("{}+{}", slot / f.block_size, slot % f.block_size) : std::to_string(slot);
  };
  // A residual's precision (SPEC 9.2.4): expected/actual, "raw" or "q".
  const bool held = std::any_of(f.slots.begin(), f.slots.end(), [](const SlotRow& r) { return !r.held.empty(); });
  fmt::print(out, "{:>{}} {:>6} {:>6} {:>12} {:>10} {:>8} {:>8} {:>14}{}  {}\n", paged ? "block+off" : "slot",
             paged ? 9 : 5, "uid", "token", "visible e/a", "Pq-Pk e/a", "pos exp", "claimed", "recovered",
             held ? fmt::format(" {:>10}", "held e/a") : "", "verdict");
  for (const SlotRow& r : f.slots)
    fmt::print(out, "{:>{}} {:>6} {:>6} {:>12} {:>10} {:>8} {:>8} {:>14}{}  {}\n", slot_text(r.slot), paged ? 9 : 5,
               r.uid, r.index,
               fmt::format("{}/{}", yes(r.visible_expected), yes(r.visible_actual)),
               fmt::format("{}/{}", opt(r.distance_expected), opt(r.distance_actual)), opt(r.position_expected),
               opt(r.position_claimed), r.position_recovered.empty() ? "-" : r.position_recovered,
               held ? fmt::format(" {:>10}", r.held.empty() ? "-" : r.held) : "", verdict_text(r));
}

}  // namespace

void print_diagnosis(std::FILE* out, const std::string& title, const Scenario& s, const CacheTrace& trace) {
  fmt::print(out, "{}\n", title);
  if (!trace.first) {
    fmt::print(out, "no divergence: every check passed (max abs error {:.3g}, NMSE {:.3g})\n",
               trace.outcome.max_abs_error, trace.outcome.nmse);
    for (const Check& c : trace.outcome.checks) fmt::print(out, "  {}: {}\n", c.name, c.detail);
    if (!trace.drift.empty()) fmt::print(out, "drift: {}\n", trace.drift.to_string());
  } else {
    const StepDiagnosis& f = *trace.first;
    std::string failed;
    for (const Check& c : trace.outcome.checks)
      if (!c.passed) failed += (failed.empty() ? "" : ", ") + c.name;
    fmt::print(out, "checks failed: {} ({} position or rotation mismatches, {} retained-set mismatches)\n", failed,
               trace.outcome.position_mismatches, trace.outcome.retained_mismatches);
    for (const Check& c : trace.outcome.checks)
      if (!c.passed) fmt::print(out, "  {}: {}\n", c.name, c.detail);
    fmt::print(out, "\n");
    print_step(out, "first divergence", s, f);
    if (!trace.drift.empty()) fmt::print(out, "after it: {}\n\n", trace.drift.to_string());
  }
  if (trace.focus) print_step(out, "asked for", s, *trace.focus);
}

std::string diagnosis_html(const Scenario& s, const std::string& cache, const CacheTrace& trace) {
  std::string body;
  body += fmt::format("<h1>kvcheck diagnose: {} on {}</h1>\n", escape(s.name), escape(cache));
  body += fmt::format("<p class=\"desc\">{}</p>\n", escape(s.description));
  std::size_t divergent_step = trace.picture.size();
  int row = 0;
  if (!trace.first) {
    body += "<p class=\"ok\">No divergence: every check passed.</p>\n";
    if (!trace.drift.empty()) body += fmt::format("<p><b>Drift:</b> {}</p>\n", escape(trace.drift.to_string()));
  } else {
    const StepDiagnosis& f = *trace.first;
    divergent_step = f.evidence.step;
    row = f.row;
    const FirstDivergence d = first_divergence(s, f);
    body += fmt::format("<h2>First divergence: {}</h2>\n<p>{}</p>\n", escape(d.where), escape(d.what));
    body += fmt::format("<h2 class=\"bad\">Class: {}</h2>\n<p>{}</p>\n", escape(class_name(f.bug)),
                        escape(class_explanation(f.bug)));
    if (!trace.drift.empty())
      body += fmt::format("<p><b>After it:</b> {}</p>\n", escape(trace.drift.to_string()));
  }

  // The picture: steps across, slots down; one line per slot id held at any step, in order
  // (ids can be far apart: a paged cache's block ids), labelled with its id.
  std::vector<std::int64_t> ids;
  for (const auto& column : trace.picture)
    for (const PictureCell& c : column) ids.push_back(c.slot);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const auto line_of = [&](std::int64_t slot) {
    return static_cast<std::size_t>(std::lower_bound(ids.begin(), ids.end(), slot) - ids.begin());
  };
  const std::size_t slots = ids.size();
  const int cell = 16, left = 60, top = 30;
  const std::size_t width = left + trace.picture.size() * cell + 20, height = top + slots * cell + 30;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"10\">\n",
      width, height);
  svg += fmt::format("<text x=\"{}\" y=\"12\">steps &#8594;</text>\n", left);
  svg += fmt::format("<text x=\"2\" y=\"{}\">slots &#8595;</text>\n", top + 10);
  for (std::size_t step = 0; step < trace.picture.size(); ++step) {
    if (step % 5 == 0) svg += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", left + step * cell, top - 4, step);
    for (const PictureCell& c : trace.picture[step]) {
      if (c.state == PictureCell::State::empty) continue;
      svg += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"#ffffff\"><title>step {} slot {}: "
          "uid {}{}</title></rect>\n",
          left + step * cell, top + line_of(c.slot) * cell, cell, cell, colour(c), step, c.slot, c.uid,
          c.state == PictureCell::State::wrong_position ? fmt::format(", distance off by {}", c.error) : "");
    }
  }
  for (std::size_t line = 0; line < slots; line += 4)
    svg += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", 2, top + line * cell + 12, ids[line]);
  if (divergent_step < trace.picture.size())
    svg += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#000000\" stroke-width=\"2\"/>\n",
        left + divergent_step * cell, top - 2, cell, slots * cell + 4);
  svg += "</svg>\n";
  body += fmt::format("<h2>Slots of row {} over the steps</h2>\n{}", row, svg);
  body +=
      "<p class=\"legend\"><span style=\"background:#4caf50\">&#160;&#160;&#160;</span> right position "
      "<span style=\"background:#ff6464\">&#160;&#160;&#160;</span> wrong position (darker: further off) "
      "<span style=\"background:#ff9800\">&#160;&#160;&#160;</span> should have been evicted "
      "<span style=\"background:#9c27b0\">&#160;&#160;&#160;</span> duplicated "
      "<span style=\"background:#a5d6a7\">&#160;&#160;&#160;</span> dead (no later query sees it; fine) "
      "<span style=\"background:#607d8b\">&#160;&#160;&#160;</span> stale "
      "<span style=\"background:#2196f3\">&#160;&#160;&#160;</span> held raw or quantized against the residual's rules "
      "<span style=\"background:#eeeeee\">&#160;&#160;&#160;</span> empty. "
      "The framed column is the first divergent step; positions are judged by the distance Pq - Pk that the "
      "row's last query of each step used.</p>\n";

  if (trace.first && !trace.first->slots.empty()) {
    body +=
        "<h2>Slot table at the first divergence</h2>\n<table>\n<tr><th>slot</th><th>uid</th><th>token</th>"
        "<th>visible exp/act</th><th>Pq-Pk exp/act</th><th>pos exp</th><th>claimed</th><th>recovered</th>"
        "<th>verdict</th></tr>\n";
    for (const SlotRow& r : trace.first->slots)
      body += fmt::format(
          "<tr class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}/{}</td><td>{}</td><td>{}</td>"
          "<td>{}</td><td>{}</td></tr>\n",
          is_fine(r.verdict) ? "ok" : "bad", r.slot < 0 ? std::string("-") : std::to_string(r.slot), r.uid, r.index,
          yes(r.visible_expected), yes(r.visible_actual), opt(r.distance_expected), opt(r.distance_actual),
          opt(r.position_expected), opt(r.position_claimed),
          escape(r.position_recovered.empty() ? "-" : r.position_recovered), escape(verdict_text(r)));
    body += "</table>\n";
  }
  return "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvcheck diagnose</title>\n<style>\n"
         "body{font-family:sans-serif;margin:24px;max-width:1100px}h1{font-size:20px}h2{font-size:16px}"
         "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
         "tr.bad td{background:#ffe0e0}.bad{color:#b00000}.ok{color:#207020}.desc{color:#555}"
         ".legend span{display:inline-block;width:14px;height:12px;margin-left:8px}\n"
         "</style></head><body>\n" +
         body + "</body></html>\n";
}

}  // namespace kvcheck
