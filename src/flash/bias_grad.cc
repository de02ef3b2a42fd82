// The float mask's and the ALiBi slopes' gradients for kAuto / kFlash (Gradients::dbias and
// dalibi_slopes; the simple twin is ../bias_grad.cc, which states the formulas and the orders):
// per unit of up to kChunk mask rows of one (mask b, mask h) (score rows of one (b, h) without
// dbias), the readers (b, h, i) in that order; per kv head its K and V transposed
// once into zero-padded rows of the compute type T (Dk × stride, Dv × stride), so that a reader
// row's scaled dot products x_j and its dp_j are SIMD multiply-adds along the keys; then, along
// the keys, the score's modifiers, p = exp(s - lse) from the given lse, dropout,
// ds = p · (z·dp - D) (times the cap's slope under kAfterBias), added in float64 into dbias and
// into the row's ALiBi term. The scores' modifiers are the kernels' own (MaskScores on the row:
// cap, edges, ALiBi, mask), and p, ds and the slope's chain rule the fused backward's
// (grad_rules-inl.h: Probability, DroppedDp, Ds, CapSlope). Each dbias element is owned by one unit and
// summed in the same order whatever the thread count; each row's ALiBi term by its unit.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "flash/bias_grad.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "flash/grad_rules-inl.h"
#include "flash/score_tile-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "reference.h"
#include "sdpa/attention.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// out[j] = Σ_d a[d] · rows[d·stride + j] for j in [begin, end), a whole vector at a time (rows
// are padded past end with zeros), d in order.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void ProductsAlongKeys(D d, const T* HWY_RESTRICT a, int64_t depth, const T* HWY_RESTRICT rows,
                                  int64_t stride, int64_t begin, int64_t end, T* HWY_RESTRICT out) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t j = begin; j < end; j += N) {
    auto acc = hn::Zero(d);
    for (int64_t e = 0; e < depth; ++e) acc = hn::MulAdd(hn::Set(d, a[e]), hn::LoadU(d, rows + e * stride + j), acc);
    hn::StoreU(acc, d, out + j);
  }
}

// Row (b, h, n) of v, width elements, as T (rows-inl.h's WidenRow: a copy where v holds T, exact
// SIMD widening of 16-bit storage). An empty row is not addressed at all (its data may be null).
template <typename T>
void read_row(const View4& v, int64_t b, int64_t h, int64_t n, int64_t width, T* HWY_RESTRICT out) {
  if (width > 0) WidenRow(hn::ScalableTag<T>(), v.dtype, v.ptr(b, h, n, 0), width, out);
}

// Mask rows (along Nq) per unit: K and V are transposed once for them, which costs as much as
// 1/kChunk of the unit's products (measured: 16 spent half the pass transposing).
constexpr int64_t kChunk = 64;

// One thread's buffers: the kv head's K and V transposed (Dk × stride, Dv × stride; stride
// leaves a vector past any key a load starts at), a reader row's products, slopes, dropout
// factors and ds, and the unit's float64 dbias sums.
template <typename T>
struct BiasScratch {
  int64_t stride;
  hwy::AlignedFreeUniquePtr<T[]> kt, vt, x, dp, slope, z, ds;
  std::vector<T> q, dout, row;
  std::vector<double> sum;
  BiasScratch(const Problem& p, const GradRows& g, int64_t lanes)
      : stride((p.Nk + lanes - 1) / lanes * lanes + lanes),
        kt(zeros(std::max<int64_t>(1, p.Dk * stride))),
        vt(zeros(std::max<int64_t>(1, p.Dv * stride))),
        x(zeros(stride)),
        dp(zeros(stride)),
        slope(zeros(stride)),
        z(zeros(stride)),
        ds(zeros(stride)),
        q(static_cast<size_t>(p.Dk)),
        dout(static_cast<size_t>(p.Dv)),
        row(static_cast<size_t>(std::max(p.Dk, p.Dv))),
        sum(static_cast<size_t>(kChunk * g.shape[3])) {}
  static hwy::AlignedFreeUniquePtr<T[]> zeros(int64_t n) {
    auto a = hwy::AllocateAligned<T>(static_cast<size_t>(n));
    std::fill(a.get(), a.get() + n, T(0));
    return a;
  }
};

// Reader row (b, h, i) of keys [range.begin, range.end): its ds into s.ds[0, n) (0 where the
// weight is), from q and dout already in s.q (scaled) and s.dout, D = dout · out.
template <typename T>
HWY_NOINLINE void BiasRow(const BackwardProblem& bp, int64_t b, int64_t h, int64_t i, KeyRange range, T lse, T D,
                          BiasScratch<T>& s) {
  const hn::ScalableTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const Problem& p = bp.fwd;
  const bool cap_after = p.softcap != 0 && p.cap_after_bias, dropout = p.dropout.enabled();
  ProductsAlongKeys(d, s.q.data(), p.Dk, s.kt.get(), s.stride, range.begin, range.end, s.x.get());
  ProductsAlongKeys(d, s.dout.data(), p.Dv, s.vt.get(), s.stride, range.begin, range.end, s.dp.get());
  // The row's scores over [begin, end) in place of its dot products, and the cap's ∂s/∂x where
  // the bias is inside the cap.
  const int64_t n = range.end - range.begin;
  const LaneRow lane{h, i, range.begin, range.end};
  T* xs = s.x.get() + range.begin;
  MaskScores<1, TileLayout::kRowMajor>(d, p, b, &lane, 1, range.begin, n, /*edges=*/false, xs,
                                       static_cast<size_t>(s.stride), static_cast<T*>(nullptr),
                                       cap_after ? s.slope.get() + range.begin : nullptr);
  if (dropout) {
    for (int64_t jj = 0; jj < n; ++jj) s.z[jj] = p.dropout.factor<T>(b, h, i, range.begin + jj);
  }
  const auto vlse = hn::Set(d, lse), vD = hn::Set(d, D);
  for (int64_t jj = 0; jj < n; jj += N) {  // the fused backward's rules (grad_rules-inl.h)
    const auto prob = Probability(d, hn::LoadU(d, xs + jj), vlse);
    auto dpv = hn::LoadU(d, s.dp.get() + range.begin + jj);
    if (dropout) dpv = DroppedDp(d, hn::LoadU(d, s.z.get() + jj), dpv);
    auto ds = Ds(d, prob, dpv, vD);
    if (cap_after) ds = CapSlope(d, ds, hn::LoadU(d, s.slope.get() + range.begin + jj));
    hn::StoreU(hn::IfThenElseZero(hn::FirstN(d, static_cast<size_t>(n - jj)), ds), d, s.ds.get() + jj);
  }
}

// Unit u: up to kChunk rows of g (grad_rows: the mask's, or the scores'), each summing its
// readers in (b, h, i) order into dbias, then stored; each reader's ALiBi term into alibi
// ((B, Hq, Nq); empty: not asked for).
template <typename T>
HWY_NOINLINE void BiasUnit(const BackwardProblem& bp, const GradRows& g, int64_t u, BiasScratch<T>& s,
                           std::vector<double>& alibi) {
  const Problem& p = bp.fwd;
  const int64_t width = g.shape[3];  // dbias' last dim (0: no dbias)
  const int64_t row_chunks = (g.shape[2] + kChunk - 1) / kChunk;
  const int64_t mb = u / (g.shape[1] * row_chunks), mh = u / row_chunks % g.shape[1];
  const int64_t mi0 = u % row_chunks * kChunk, mi1 = std::min(g.shape[2], mi0 + kChunk);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  std::fill(s.sum.begin(), s.sum.end(), 0.0);
  const auto [b0, b1] = readers(mb, g.shape[0], p.B);
  const auto [h0, h1] = readers(mh, g.shape[1], p.Hq);
  for (int64_t b = b0; b < b1; ++b) {
    int64_t loaded = -1;  // the kv head held in kt, vt
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t kvh = h / p.group;
      if (kvh != loaded) {
        for (int64_t j = 0; j < p.Nk; ++j) {
          read_row(p.k, b, kvh, j, p.Dk, s.row.data());
          for (int64_t e = 0; e < p.Dk; ++e) s.kt[e * s.stride + j] = s.row[e];
          read_row(p.v, b, kvh, j, p.Dv, s.row.data());
          for (int64_t e = 0; e < p.Dv; ++e) s.vt[e * s.stride + j] = s.row[e];
        }
        loaded = kvh;
      }
      for (int64_t mi = mi0; mi < mi1; ++mi) {
        double* acc = s.sum.data() + (mi - mi0) * g.shape[3];
        const auto [i0, i1] = readers(mi, g.shape[2], p.Nq);
        for (int64_t i = i0; i < i1; ++i) {
          const T lse = p.lse->load<T>(b, h, i, 0);
          const KeyRange range = p.key_range(b, i);
          if (lse == neg_inf || range.empty()) continue;  // no allowed key: no gradient
          read_row(bp.dout, b, h, i, p.Dv, s.dout.data());
          read_row(p.out, b, h, i, p.Dv, s.row.data());
          T D = 0;
          for (int64_t e = 0; e < p.Dv; ++e) D += s.dout[e] * s.row[e];
          PackScaledQuery(p, b, h, i, s.q.data(), 1);
          BiasRow(bp, b, h, i, range, lse, D, s);
          const int64_t n = range.end - range.begin;
          if (width == 1) {
            for (int64_t jj = 0; jj < n; ++jj) acc[0] += static_cast<double>(s.ds[jj]);
          } else if (width > 1) {
            for (int64_t jj = 0; jj < n; ++jj) acc[range.begin + jj] += static_cast<double>(s.ds[jj]);
          }
          if (!alibi.empty()) {
            alibi[static_cast<size_t>((b * p.Hq + h) * p.Nq + i)] = alibi_row_term(p, b, i, s.ds.get(), range.begin, n);
          }
        }
      }
    }
  }
  for (int64_t mi = mi0; mi < mi1; ++mi)
    for (int64_t j = 0; j < width; ++j) bp.dbias->store(mb, mh, mi, j, s.sum[static_cast<size_t>((mi - mi0) * width + j)]);
}

// The parallel region holds no vector code (clang 14 with -fopenmp cannot compile Highway
// vectors in an outlined region: "Do not know how to split the result of this operator").
template <typename T>
void FastBias(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  const GradRows g = grad_rows(bp);
  std::vector<double> alibi = alibi_rows(bp);
  if (bp.dbias || !alibi.empty()) {
    const int64_t lanes = static_cast<int64_t>(hn::Lanes(hn::ScalableTag<T>()));
    const int64_t units = g.shape[0] * g.shape[1] * ((g.shape[2] + kChunk - 1) / kChunk);
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), units)));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      BiasScratch<T> s(p, g, lanes);
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < units; ++u) BiasUnit(bp, g, u, s, alibi);
    }
  }
  if (bp.dalibi) store_alibi_gradients(bp, alibi);
}

void FastBiasF32(const BackwardProblem& bp) { FastBias<float>(bp); }
void FastBiasF64(const BackwardProblem& bp) { FastBias<double>(bp); }

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sdpa::internal {

HWY_EXPORT(FastBiasF32);
HWY_EXPORT(FastBiasF64);

template <>
void fast_bias_gradients<float>(const BackwardProblem& bp) {
  HWY_DYNAMIC_DISPATCH(FastBiasF32)(bp);
}
template <>
void fast_bias_gradients<double>(const BackwardProblem& bp) {
  HWY_DYNAMIC_DISPATCH(FastBiasF64)(bp);
}

}  // namespace sdpa::internal
#endif  // HWY_ONCE
