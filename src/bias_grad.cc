// The float mask's gradient (Gradients::dbias): one pass of its own over the rows, after the
// kernels' dq, dk and dv. Each element of the mask's shape is owned by one iteration, which sums
// its rows in (b, h, i) order in float64, so the result does not depend on the thread count; no
// atomics. Two versions of one formula, dbias_ij = p_ij · (z_ij·dp_ij - D_i) · c_ij:
//   bias_gradients       the reference row (backward_row: the row's softmax recomputed from
//                        scratch), in Acc: kReference (double) and kNaive (the compute type).
//   fast_bias_gradients  kAuto / kFlash: p from the given lse (as the fused backward does), the
//                        kv head's K and V converted once per chunk of mask rows into contiguous
//                        rows of the compute type, dot products with independent partial sums.
#include <algorithm>
#include <cmath>
#include <limits>
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
  // The scores' index range that reads mask index m along a dim of full extent n.
  const auto readers = [](int64_t m, int64_t extent, int64_t n) {
    return extent == 1 ? std::pair<int64_t, int64_t>{0, n} : std::pair<int64_t, int64_t>{m, m + 1};
  };
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

namespace {

// Σ a[d]·b[d] in T with eight partial sums (a fixed order the compiler may vectorise).
template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T part[8] = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[d + l] * b[d + l];
  for (int l = 0; d < n; ++d, ++l) part[l] += a[d] * b[d];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Row (b, h, n) of v, width elements, as T.
template <typename T>
void read_row(const View4& v, int64_t b, int64_t h, int64_t n, int64_t width, T* out) {
  for (int64_t c = 0; c < width; ++c) out[c] = v.load<T>(b, h, n, c);
}

}  // namespace

template <typename T>
void fast_bias_gradients(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  const View4& g = *bp.dbias;  // the mask's shape, 1 where it broadcasts
  constexpr int64_t kChunk = 16;  // mask rows (along Nq) per unit: K and V converted once for them
  const int64_t row_chunks = (g.shape[2] + kChunk - 1) / kChunk, units = g.shape[0] * g.shape[1] * row_chunks;
  const auto readers = [](int64_t m, int64_t extent, int64_t n) {
    return extent == 1 ? std::pair<int64_t, int64_t>{0, n} : std::pair<int64_t, int64_t>{m, m + 1};
  };
  const T scale = static_cast<T>(p.scale), neg_inf = -std::numeric_limits<T>::infinity();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), units)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<T> K(static_cast<size_t>(p.Nk * p.Dk)), V(static_cast<size_t>(p.Nk * p.Dv));
    std::vector<T> q(static_cast<size_t>(p.Dk)), dout(static_cast<size_t>(p.Dv)), out(static_cast<size_t>(p.Dv));
    std::vector<double> sum(static_cast<size_t>(kChunk * g.shape[3]));
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t mb = u / (g.shape[1] * row_chunks), mh = u / row_chunks % g.shape[1];
      const int64_t mi0 = u % row_chunks * kChunk, mi1 = std::min(g.shape[2], mi0 + kChunk);
      std::fill(sum.begin(), sum.end(), 0.0);
      const auto [b0, b1] = readers(mb, g.shape[0], p.B);
      const auto [h0, h1] = readers(mh, g.shape[1], p.Hq);
      for (int64_t b = b0; b < b1; ++b) {
        int64_t loaded = -1;  // the kv head whose K and V are in K, V
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t kvh = h / p.group;
          if (kvh != loaded) {
            for (int64_t j = 0; j < p.Nk; ++j) {
              read_row(p.k, b, kvh, j, p.Dk, K.data() + j * p.Dk);
              read_row(p.v, b, kvh, j, p.Dv, V.data() + j * p.Dv);
            }
            loaded = kvh;
          }
          for (int64_t mi = mi0; mi < mi1; ++mi) {
            double* acc = sum.data() + (mi - mi0) * g.shape[3];
            const auto [i0, i1] = readers(mi, g.shape[2], p.Nq);
            for (int64_t i = i0; i < i1; ++i) {
              const T lse = p.lse->load<T>(b, h, i, 0);
              const KeyRange range = p.key_range(b, i);
              if (lse == neg_inf || range.empty()) continue;  // no allowed key: no gradient
              for (int64_t d = 0; d < p.Dk; ++d) q[d] = p.q.load<T>(b, h, i, d) * scale;  // as the kernels scale q
              read_row(bp.dout, b, h, i, p.Dv, dout.data());
              read_row(p.out, b, h, i, p.Dv, out.data());
              const T D = dot(dout.data(), out.data(), p.Dv);
              for (int64_t j = range.begin; j < range.end; ++j) {
                const T x = dot(q.data(), K.data() + j * p.Dk, p.Dk);
                const T s = p.score(x, b, h, i, j);
                if (s == neg_inf) continue;
                const T prob = std::exp(s - lse);
                const T z = p.dropout.factor<T>(b, h, i, j);
                const T dp = z == 0 ? T(0) : dot(dout.data(), V.data() + j * p.Dv, p.Dv);
                T ds = grad_ds(prob, z, dp, D);
                if (p.softcap != 0 && p.cap_after_bias) ds *= p.score_slope(x, b, h, i, j);
                acc[g.shape[3] == 1 ? 0 : j] += static_cast<double>(ds);
              }
            }
          }
        }
      }
      for (int64_t mi = mi0; mi < mi1; ++mi)
        for (int64_t j = 0; j < g.shape[3]; ++j) g.store(mb, mh, mi, j, sum[static_cast<size_t>((mi - mi0) * g.shape[3] + j)]);
    }
  }
}

template void bias_gradients<float>(const BackwardProblem& bp);
template void bias_gradients<double>(const BackwardProblem& bp);
template void fast_bias_gradients<float>(const BackwardProblem& bp);
template void fast_bias_gradients<double>(const BackwardProblem& bp);

}  // namespace sdpa::internal
