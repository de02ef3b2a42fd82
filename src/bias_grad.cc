// The score modifiers' gradients that need each score's ds, Gradients::dbias (the float mask's)
// and Gradients::dalibi_slopes: one pass of their own over the rows, after the kernels' dq, dk
// and dv, which computes each row's ds once for both. Each element of the mask's shape is owned
// by one iteration, which sums its rows in (b, h, i) order in float64; each row writes its own
// ALiBi term (Σ_j ds_j · |i' - j|, float64), and the terms are summed into the slopes in (b, i)
// order after the pass: neither depends on the thread count; no atomics. Two versions of one
// formula, ds_ij = p_ij · (z_ij·dp_ij - D_i) · c_ij:
//   bias_gradients       the reference row (backward_row: the row's softmax recomputed from
//                        scratch), in Acc: kReference (double) and kNaive (the compute type).
//   fast_bias_gradients  kAuto / kFlash (flash/bias_grad.cc): the same sums with SIMD products
//                        and p from the given lse.
#include <algorithm>
#include <utility>
#include <vector>

#include "reference.h"
#include "sdpa/attention.h"

namespace sdpa::internal {

GradRows grad_rows(const BackwardProblem& bp) {
  if (bp.dbias) return {{bp.dbias->shape[0], bp.dbias->shape[1], bp.dbias->shape[2], bp.dbias->shape[3]}};
  return {{bp.fwd.B, bp.fwd.Hq, bp.fwd.Nq, 0}};
}

std::vector<double> alibi_rows(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  return std::vector<double>(bp.dalibi && p.Dv > 0 ? static_cast<size_t>(p.B * p.Hq * p.Nq) : 0, 0.0);
}

template <typename T>
double alibi_row_term(const Problem& p, int64_t b, int64_t i, const T* ds, int64_t begin, int64_t n) {
  double sum = 0;
  for (int64_t jj = 0; jj < n; ++jj) {
    sum += static_cast<double>(ds[jj]) * static_cast<double>(p.alibi_distance(b, i, begin + jj));
  }
  return sum;
}

void store_alibi_gradients(const BackwardProblem& bp, const std::vector<double>& rows) {
  const Problem& p = bp.fwd;
  const View4& g = *bp.dalibi;  // (1 or B, Hq) in the last two slots
  for (int64_t s = 0; s < g.shape[2]; ++s)
    for (int64_t h = 0; h < g.shape[3]; ++h) {
      double sum = 0;
      if (!rows.empty()) {
        const auto [b0, b1] = readers(s, g.shape[2], p.B);
        for (int64_t b = b0; b < b1; ++b)
          for (int64_t i = 0; i < p.Nq; ++i) sum += rows[static_cast<size_t>((b * p.Hq + h) * p.Nq + i)];
      }
      g.store(0, 0, s, h, -sum);  // ∂alibi/∂slope = -|i' - j|
    }
}

template <typename Acc>
void bias_gradients(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  const GradRows g = grad_rows(bp);
  const int64_t width = g.shape[3];  // dbias' last dim (0: no dbias)
  std::vector<double> alibi = alibi_rows(bp);
  if (bp.dbias || !alibi.empty()) {
    const int64_t rows = g.count();
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), rows)));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      std::vector<Acc> prob(static_cast<size_t>(p.Nk)), ds(static_cast<size_t>(p.Nk));
      std::vector<double> sum(static_cast<size_t>(width));
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t mb = r / (g.shape[1] * g.shape[2]), mh = r / g.shape[2] % g.shape[1], mi = r % g.shape[2];
        std::fill(sum.begin(), sum.end(), 0.0);
        const auto [b0, b1] = readers(mb, g.shape[0], p.B);
        const auto [h0, h1] = readers(mh, g.shape[1], p.Hq);
        const auto [i0, i1] = readers(mi, g.shape[2], p.Nq);
        for (int64_t b = b0; b < b1; ++b)
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t i = i0; i < i1; ++i) {
              backward_row<Acc>(bp, b, h, i, prob.data(), nullptr, nullptr, nullptr, ds.data());
              if (width > 0) {
                for (int64_t j = 0; j < p.Nk; ++j) sum[static_cast<size_t>(width == 1 ? 0 : j)] += ds[j];
              }
              if (!alibi.empty()) {
                alibi[static_cast<size_t>((b * p.Hq + h) * p.Nq + i)] = alibi_row_term(p, b, i, ds.data(), 0, p.Nk);
              }
            }
        for (int64_t j = 0; j < width; ++j) bp.dbias->store(mb, mh, mi, j, sum[static_cast<size_t>(j)]);
      }
    }
  }
  if (bp.dalibi) store_alibi_gradients(bp, alibi);
}

template void bias_gradients<float>(const BackwardProblem& bp);
template void bias_gradients<double>(const BackwardProblem& bp);
template double alibi_row_term<float>(const Problem&, int64_t, int64_t, const float*, int64_t, int64_t);
template double alibi_row_term<double>(const Problem&, int64_t, int64_t, const double*, int64_t, int64_t);

}  // namespace sdpa::internal
