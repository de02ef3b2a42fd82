// The float mask's gradient (Gradients::dbias): one pass of its own over the rows, after the
// kernels' dq, dk and dv. Each element of the mask's shape is owned by one iteration, which sums
// its rows in (b, h, i) order in float64, so the result does not depend on the thread count; no
// atomics. Two versions of one formula, dbias_ij = p_ij · (z_ij·dp_ij - D_i) · c_ij:
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

template <typename Acc>
void bias_gradients(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  const View4& g = *bp.dbias;  // the mask's shape, 1 where it broadcasts
  const int64_t rows = g.shape[0] * g.shape[1] * g.shape[2];
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), rows)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<Acc> prob(static_cast<size_t>(p.Nk)), ds(static_cast<size_t>(p.Nk));
    std::vector<double> sum(static_cast<size_t>(g.shape[3]));
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
            for (int64_t j = 0; j < p.Nk; ++j) sum[static_cast<size_t>(g.shape[3] == 1 ? 0 : j)] += ds[j];
          }
      for (int64_t j = 0; j < g.shape[3]; ++j) g.store(mb, mh, mi, j, sum[static_cast<size_t>(j)]);
    }
  }
}

template void bias_gradients<float>(const BackwardProblem& bp);
template void bias_gradients<double>(const BackwardProblem& bp);


}  // namespace sdpa::internal
