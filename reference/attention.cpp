#include "reference/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace kvcheck::reference {

std::vector<double> attend(const std::vector<double>& q, const std::vector<std::vector<double>>& keys,
                           const std::vector<std::vector<double>>& values, double scale) {
  if (keys.empty() || keys.size() != values.size())
    throw std::invalid_argument("attend: needs at least one key and one value per key");

  std::vector<double> scores(keys.size());
  for (std::size_t j = 0; j < keys.size(); ++j) {
    double dot = 0.0;
    for (std::size_t d = 0; d < q.size(); ++d) dot += q[d] * keys[j][d];
    scores[j] = scale * dot;
  }
  // Subtracting the maximum changes nothing mathematically and keeps exp in range.
  const double top = *std::max_element(scores.begin(), scores.end());
  double total = 0.0;
  for (double& s : scores) total += (s = std::exp(s - top));

  std::vector<double> out(values[0].size(), 0.0);
  for (std::size_t j = 0; j < keys.size(); ++j)
    for (std::size_t d = 0; d < out.size(); ++d) out[d] += scores[j] / total * values[j][d];
  return out;
}

}  // namespace kvcheck::reference
