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

void attend(const double* q, const double* keys, const double* values, std::size_t n, std::size_t head_dim,
            double scale, const double* sink_logit, double* scores, double* out) {
  if (n == 0) throw std::invalid_argument("attend: needs at least one key");
  for (std::size_t j = 0; j < n; ++j) scores[j] = scale * dot(q, keys + j * head_dim, head_dim);
  // Subtracting the maximum changes nothing mathematically and keeps exp in range.
  double top = *std::max_element(scores, scores + n);
  if (sink_logit != nullptr) top = std::max(top, *sink_logit);
  double total = 0.0;
  for (std::size_t j = 0; j < n; ++j) total += (scores[j] = std::exp(scores[j] - top));
  if (sink_logit != nullptr) total += std::exp(*sink_logit - top);

  std::fill(out, out + head_dim, 0.0);
  for (std::size_t j = 0; j < n; ++j) {
    const double weight = scores[j] / total;
    const double* v = values + j * head_dim;
    for (std::size_t d = 0; d < head_dim; ++d) out[d] += weight * v[d];
  }
}

}  // namespace kvcheck::reference
