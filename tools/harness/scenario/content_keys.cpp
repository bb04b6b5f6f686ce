#include "tools/harness/scenario/content_keys.h"

#include "tools/harness/scenario/generator.h"

namespace kvcheck {

std::uint64_t context_mix(std::uint64_t a, std::uint64_t b) { return splitmix64(a ^ splitmix64(b)); }

std::uint64_t string_key(const std::string& text) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

std::uint64_t row_context(std::uint64_t seed, const RowExtras& extras) {
  return context_mix(context_mix(splitmix64(seed), string_key("adapter:" + extras.adapter)),
                     string_key("salt:" + extras.salt));
}

std::uint64_t generated_token_id(std::uint64_t seed, std::uint64_t uid) {
  return splitmix64(splitmix64(seed) ^ uid) >> 33;
}

void assign_content_keys(Scenario& s) {
  const bool prefix = s.content == Content::prefix;
  const std::uint64_t seed = s.inputs.seed;
  struct Row {
    RowExtras extras;
    std::vector<std::uint64_t> contexts;  // c_t of each token index
  };
  std::vector<Row> rows(static_cast<std::size_t>(s.dims.batch));
  std::uint64_t uid = 0;
  if (prefix) {
    s.token_ids.clear();
    s.context_keys.clear();
  }
  for (Step& step : s.steps) {
    switch (step.op) {
      case StepOp::append:
        step.extras.clear();
        for (std::size_t b = 0; b < rows.size(); ++b) {
          Row& row = rows[b];
          if (!step.extras_given.empty() && step.extras_given[b]) row.extras = *step.extras_given[b];
          if (prefix) step.extras.push_back(row.extras);
          for (std::int64_t i = 0; i < step.tokens[b]; ++i, ++uid) {
            if (!prefix) continue;
            const std::uint64_t id = step.ids.empty() ? generated_token_id(seed, uid) : step.ids[b][i];
            const std::uint64_t before = row.contexts.empty() ? row_context(seed, row.extras) : row.contexts.back();
            row.contexts.push_back(context_mix(before, id));
            s.token_ids.push_back(id);
            s.context_keys.push_back(row.contexts.back());
          }
        }
        break;
      case StepOp::reorder:
        rows = [&] {
          std::vector<Row> next;
          for (int r : step.rows) next.push_back(rows[static_cast<std::size_t>(r)]);
          return next;
        }();
        break;
      case StepOp::reset:
        rows.assign(static_cast<std::size_t>(*step.batch), Row{});
        break;
      case StepOp::crop:
        if (!step.expect_error.empty()) break;  // refused: nothing is cut
        for (Row& row : rows)
          if (static_cast<std::int64_t>(row.contexts.size()) > step.length)
            row.contexts.resize(static_cast<std::size_t>(step.length));
        break;
      case StepOp::free_rows:
        for (int r : step.rows) rows[static_cast<std::size_t>(r)] = Row{};
        break;
      case StepOp::evict:
      case StepOp::preempt:
      case StepOp::resume:
      case StepOp::prune:  // never paged (SPEC 11)
        break;
    }
  }
}

}  // namespace kvcheck
