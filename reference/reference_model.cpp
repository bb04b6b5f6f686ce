#include "reference/reference_model.h"

#include <algorithm>
#include <limits>
#include <string>

#include "reference/attention.h"
#include "reference/rope.h"

namespace kvcheck::reference {
namespace {

std::vector<double> widen(const float* x, int n) { return std::vector<double>(x, x + n); }

}  // namespace

ReferenceModel::ReferenceModel(const Dims& dims, const Rope& rope, const Policy& policy, double scale,
                               const InputTable& inputs)
    : dims_(dims),
      rope_(rope),
      policy_(policy),
      scale_(scale),
      inputs_(inputs),
      histories_(static_cast<std::size_t>(dims.batch)) {}

std::vector<double> ReferenceModel::head_output(int layer, int head, const std::vector<std::uint64_t>& row,
                                                std::int64_t t, const QueryView& view) const {
  const int d = dims_.head_dim;
  const int group = head / (dims_.heads / dims_.kv_heads);
  const std::vector<double> q = rotate(widen(inputs_.q_at(layer, row[t], head), d), view.query_position, rope_);
  std::vector<std::vector<double>> keys, values;
  for (const VisibleKey& key : view.keys) {
    keys.push_back(rotate(widen(inputs_.k_at(layer, row[key.index], group), d), key.position, rope_));
    values.push_back(widen(inputs_.v_at(layer, row[key.index], group), d));
  }
  return attend(q, keys, values, scale_);
}

AppendResult ReferenceModel::append(const std::vector<std::int64_t>& counts) {
  if (counts.size() != histories_.size()) throw std::invalid_argument("append: one count per row expected");
  AppendResult result;
  result.chunk = *std::max_element(counts.begin(), counts.end());
  result.rows.resize(histories_.size());

  // uids: step order, then row order, then order inside the chunk.
  for (std::size_t b = 0; b < histories_.size(); ++b) {
    for (std::int64_t i = 0; i < counts[b]; ++i) {
      if (next_uid_ >= static_cast<std::uint64_t>(inputs_.uids))
        throw std::out_of_range("append: the inputs hold no uid " + std::to_string(next_uid_));
      histories_[b].push_back(next_uid_++);
    }
  }

  const int L = dims_.layers, B = batch(), H = dims_.heads, D = dims_.head_dim;
  const std::int64_t n = result.chunk;
  result.out.assign(static_cast<std::size_t>(L) * B * n * H * D, std::numeric_limits<double>::quiet_NaN());
  for (int b = 0; b < B; ++b) {
    const std::vector<std::uint64_t>& row = histories_[b];
    const std::int64_t start = static_cast<std::int64_t>(row.size()) - counts[b];
    const std::int64_t pad = n - counts[b];
    for (std::int64_t t = start; t < static_cast<std::int64_t>(row.size()); ++t) {
      AppendedToken token{row[t], t, chunk_view(policy_, start, t)};
      for (int l = 0; l < L; ++l) {
        for (int h = 0; h < H; ++h) {
          const std::vector<double> o = head_output(l, h, row, t, token.view);
          const std::size_t base = ((((static_cast<std::size_t>(l) * B + b) * n + pad + (t - start)) * H + h) * D);
          std::copy(o.begin(), o.end(), result.out.begin() + base);
        }
      }
      result.rows[b].push_back(std::move(token));
    }
  }
  return result;
}

void ReferenceModel::reorder(const std::vector<int>& rows) {
  std::vector<std::vector<std::uint64_t>> next;
  for (int r : rows) next.push_back(histories_.at(r));
  histories_ = std::move(next);
}

void ReferenceModel::reset(int batch) { histories_.assign(static_cast<std::size_t>(batch), {}); }

void ReferenceModel::crop(std::int64_t length) {
  for (std::size_t b = 0; b < histories_.size(); ++b) {
    const auto n = static_cast<std::int64_t>(histories_[b].size());
    if (length >= n) continue;
    // The cropped row's last token must still find every key it needs in the cache.
    const QueryView held = retained_view(policy_, n);
    for (const VisibleKey& needed : retained_view(policy_, length).keys) {
      const bool kept =
          std::any_of(held.keys.begin(), held.keys.end(), [&](const VisibleKey& k) { return k.index == needed.index; });
      if (!kept)
        throw StepRefused("crop_evicted", "crop to " + std::to_string(length) + " tokens needs token " +
                                              std::to_string(needed.index) + " of row " + std::to_string(b) +
                                              ", which the cache has already evicted");
    }
  }
  for (auto& row : histories_)
    if (static_cast<std::int64_t>(row.size()) > length) row.resize(static_cast<std::size_t>(length));
}

RowRetained ReferenceModel::retained(int row) const {
  const std::vector<std::uint64_t>& history = histories_.at(row);
  const QueryView view = retained_view(policy_, static_cast<std::int64_t>(history.size()));
  RowRetained out;
  out.query_position = view.query_position;
  for (const VisibleKey& key : view.keys) out.keys.push_back({history[key.index], key.index, key.position});
  const QueryView next = live_view(policy_, static_cast<std::int64_t>(history.size()));
  out.next_query_position = next.query_position;
  for (const VisibleKey& key : next.keys) out.live.push_back({history[key.index], key.index, key.position});
  return out;
}

}  // namespace kvcheck::reference
