#include "reference.h"

#include <cmath>
#include <limits>
#include <vector>

namespace sdpa::internal {

template <typename Acc>
Acc softmax_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* prob) {
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const Acc scale = static_cast<Acc>(p.scale);
  const int64_t kvh = h / p.group;
  // 1. Scores s_j = (q_i · k_j) * scale + bias_ij, -inf outside causal/window.
  const KeyRange range = p.key_range(i);
  Acc row_max = neg_inf;
  bool any_allowed = false;  // a score other than -inf (NaN counts: it must propagate)
  for (int64_t j = 0; j < p.Nk; ++j) {
    Acc s = neg_inf;
    if (j >= range.begin && j < range.end) {
      Acc dot = 0;
      for (int64_t d = 0; d < p.Dk; ++d) dot += p.q.load<Acc>(b, h, i, d) * p.k.load<Acc>(b, kvh, j, d);
      s = dot * scale + p.mask_bias<Acc>(b, h, i, j);
    }
    prob[j] = s;
    row_max = std::max(row_max, s);
    any_allowed |= s != neg_inf;
  }
  // 2. Stable softmax: subtract the row max. A row with no allowed key stays all zero; a NaN
  //    score makes the sum, and so the whole row, NaN.
  Acc sum = 0;
  for (int64_t j = 0; j < p.Nk; ++j) {
    prob[j] = any_allowed ? std::exp(prob[j] - row_max) : Acc(0);
    sum += prob[j];
  }
  const Acc inv_sum = any_allowed ? Acc(1) / sum : Acc(0);
  for (int64_t j = 0; j < p.Nk; ++j) prob[j] *= inv_sum;
  return any_allowed ? row_max + std::log(sum) : neg_inf;
}

template <typename Acc>
void materialized_attention(const Problem& p) {
  std::vector<Acc> prob(static_cast<size_t>(p.Nk));
  std::vector<Acc> out_row(static_cast<size_t>(p.Dv));
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.Hq; ++h) {
      const int64_t kvh = h / p.group;
      for (int64_t i = 0; i < p.Nq; ++i) {
        const Acc lse = softmax_row(p, b, h, i, prob.data());
        // 3. out_i = sum_j w_ij v_j, the weights after dropout (w itself when it is off).
        for (int64_t d = 0; d < p.Dv; ++d) out_row[d] = 0;
        for (int64_t j = 0; j < p.Nk; ++j) {
          if (p.weights) p.weights->store(b, h, i, j, prob[j]);  // before dropout
          const Acc w = prob[j] * p.dropout.factor<Acc>(b, h, i, j);
          if (w == 0) continue;
          for (int64_t d = 0; d < p.Dv; ++d) out_row[d] += w * p.v.load<Acc>(b, kvh, j, d);
        }
        for (int64_t d = 0; d < p.Dv; ++d) p.out.store(b, h, i, d, out_row[d]);
        if (p.lse) p.lse->store(b, h, i, 0, lse);
      }
    }
  }
}

template float softmax_row<float>(const Problem&, int64_t, int64_t, int64_t, float*);
template double softmax_row<double>(const Problem&, int64_t, int64_t, int64_t, double*);
template void materialized_attention<float>(const Problem& p);
template void materialized_attention<double>(const Problem& p);

}  // namespace sdpa::internal
