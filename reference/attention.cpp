#include "reference/attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvcheck::reference {

double dot(const double* a, const double* b, std::size_t n) {
  double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::size_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (std::size_t k = 0; k < 8; ++k) sums[k] += a[d + k] * b[d + k];
  for (std::size_t k = 0; d < n; ++d, ++k) sums[k] += a[d] * b[d];  // the tail, into the first sums
  return ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
}

namespace {

// The one body of attend() and attend_heads(): key j's and value j's D doubles are key(j)
// and value(j). Key j is read once for every head (heads inner), so a group streams its
// keys and values once instead of once per head; each head's sums run in the same order as
// alone. Each head's scores become its softmax weights in place (e^(x_j - m) / total), so
// nothing is allocated per call.
template <class Row>
void attend_rows(const double* const* queries, std::size_t heads, Row key, Row value, std::size_t n,
                 std::size_t head_dim, double scale, const double* const* sink_logits, double* scores, double* out) {
  if (n == 0) throw std::invalid_argument("attend: needs at least one key");
  for (std::size_t j = 0; j < n; ++j)
    for (std::size_t h = 0; h < heads; ++h) scores[h * n + j] = scale * dot(queries[h], key(j), head_dim);
  for (std::size_t h = 0; h < heads; ++h) {
    double* x = scores + h * n;
    const double* sink_logit = sink_logits == nullptr ? nullptr : sink_logits[h];
    // Subtracting the maximum changes nothing mathematically and keeps exp in range.
    double top = *std::max_element(x, x + n);
    if (sink_logit != nullptr) top = std::max(top, *sink_logit);
    double total = 0.0;
    for (std::size_t j = 0; j < n; ++j) total += (x[j] = std::exp(x[j] - top));
    if (sink_logit != nullptr) total += std::exp(*sink_logit - top);
    for (std::size_t j = 0; j < n; ++j) x[j] /= total;
  }
  std::fill(out, out + heads * head_dim, 0.0);
  for (std::size_t j = 0; j < n; ++j) {
    const double* v = value(j);
    for (std::size_t h = 0; h < heads; ++h) {
      const double weight = scores[h * n + j];
      double* o = out + h * head_dim;
      for (std::size_t d = 0; d < head_dim; ++d) o[d] += weight * v[d];
    }
  }
}

}  // namespace

void attend_heads(const double* const* queries, std::size_t heads, const double* const* keys,
                  const double* const* values, std::size_t n, std::size_t head_dim, double scale,
                  const double* const* sink_logits, double* scores, double* out) {
  const auto row = [](const double* const* rows) { return [rows](std::size_t j) { return rows[j]; }; };
  attend_rows(queries, heads, row(keys), row(values), n, head_dim, scale, sink_logits, scores, out);
}

void attend(const double* q, const double* keys, const double* values, std::size_t n, std::size_t head_dim,
            double scale, const double* sink_logit, double* scores, double* out) {
  const auto row = [head_dim](const double* rows) {
    return [rows, head_dim](std::size_t j) { return rows + j * head_dim; };
  };
  attend_rows(&q, 1, row(keys), row(values), n, head_dim, scale, &sink_logit, scores, out);
}

}  // namespace kvcheck::reference
