// Softmax attention of one query head over a list of keys, from scratch, in double.
#pragma once

#include <cstddef>

namespace kvcheck::reference {

// The dot product <a, b> of n doubles, summed in a fixed order: eight running sums (every
// eighth element each), then added pairwise. The order does not depend on the machine, and
// the compiler can vectorize it without fast-math.
double dot(const double* a, const double* b, std::size_t n);

// out = sum_j softmax_j(scale * <q, k_j>) v_j, for q [D], keys and values [n][D] (rows of
// D doubles, contiguous), q and every k_j already rotated. A learned sink logit s (SPEC 7),
// when given, joins the softmax's denominator with no value:
//   out = sum_j e^(x_j - m) v_j / (sum_j e^(x_j - m) + e^(s - m)),  m = max(max_j x_j, s).
// `scores` holds n doubles of scratch, so nothing is allocated per query.
void attend(const double* q, const double* keys, const double* values, std::size_t n, std::size_t head_dim,
            double scale, const double* sink_logit, double* scores, double* out);

// attend() for `heads` query heads that share one set of keys and values (a GQA group):
// queries[h] is head h's rotated query, keys[j] and values[j] point at key j's D doubles,
// sink_logits (null, or one pointer per head, each possibly null) gives each head's sink;
// scores holds heads * n doubles of scratch and out receives heads rows of D. Each head's
// result is bit for bit what attend() gives it alone.
void attend_heads(const double* const* queries, std::size_t heads, const double* const* keys,
                  const double* const* values, std::size_t n, std::size_t head_dim, double scale, const double* const* sink_logits,
                  double* scores, double* out);

}  // namespace kvcheck::reference
