// Softmax attention of one query head over a list of keys, from scratch, in double.
#pragma once

#include <vector>

namespace kvcheck::reference {

// sum_j softmax_j(scale * <q, k_j>) v_j. q and every k_j are already rotated.
std::vector<double> attend(const std::vector<double>& q, const std::vector<std::vector<double>>& keys,
                           const std::vector<std::vector<double>>& values, double scale);

}  // namespace kvcheck::reference
