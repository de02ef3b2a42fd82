// The fused attention kernel, compiled once per SIMD target (included by flash.cc through
// hwy/foreach_target.h). FlashAttention-2 online softmax over key tiles; the Nq×Nk score
// matrix never exists, only one (kTileKeys × lanes-block) tile per thread.
//
// Layout: "queries along lanes". A block holds up to QV vectors' worth of query rows (Mq =
// QV·Lanes) of one kv head: for GQA the rows of all query heads that read this kv head,
// r = i·group + g. The block's queries are packed transposed once, qt[d][lane], so that
//   scores  st[j][lane] = Σ_d k[j][d] · qt[d][lane]      (broadcast k[j][d], FMA a q vector)
//   output  ot[e][lane] += Σ_j v[j][e] · st[j][lane]      (broadcast v[j][e], FMA a p vector)
// Both products are register-blocked outer products that read k and v rows in place (no
// transpose, no packing of K/V), and the softmax runs down columns, i.e. lane-wise: its max
// and sum are plain vertical Max/Add with no horizontal reductions.

#if defined(SDPA_FLASH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_INL_H_
#undef SDPA_FLASH_INL_H_
#else
#define SDPA_FLASH_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "flash/decode-inl.h"
#include "flash/flash_plan.h"
#include "hwy/aligned_allocator.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Per-thread working memory for one block: O(Mq · (Dk + Dv + kTileKeys)), independent of N.
template <typename T>
struct Scratch {
  Scratch(const Problem& p, size_t mq, size_t lanes_per_vector)
      : qt(hwy::AllocateAligned<T>(std::max<size_t>(1, p.Dk * mq))),
        st(hwy::AllocateAligned<T>(kTileKeys * mq)),
        ot(hwy::AllocateAligned<T>(std::max<size_t>(1, p.Dv * mq))),
        m(hwy::AllocateAligned<T>(mq)),
        l(hwy::AllocateAligned<T>(mq)),
        decode_q(hwy::AllocateAligned<T>(kDecodeRows * (p.Dk + lanes_per_vector))),
        decode_o(hwy::AllocateAligned<T>(kDecodeRows * (p.Dv + lanes_per_vector))),
        lanes(mq) {}
  hwy::AlignedFreeUniquePtr<T[]> qt, st, ot, m, l;
  hwy::AlignedFreeUniquePtr<T[]> decode_q, decode_o;  // DecodeBlock's rows of q and o
  std::vector<LaneRow> lanes;
};

// st[kb][lane] = Σ_d k[kb][d] · qt[d][lane] for KB consecutive keys: KB×QV accumulators.
template <size_t KB, size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void ScoreKeys(D d, const T* HWY_RESTRICT qt, size_t mq, const T* HWY_RESTRICT k, int64_t k_stride,
                          int64_t dk, T* HWY_RESTRICT st) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> acc[KB][QV];
  for (size_t kb = 0; kb < KB; ++kb)
    for (size_t v = 0; v < QV; ++v) acc[kb][v] = hn::Zero(d);
  for (int64_t c = 0; c < dk; ++c) {
    hn::Vec<D> q[QV];
    for (size_t v = 0; v < QV; ++v) q[v] = hn::Load(d, qt + c * mq + v * N);
    for (size_t kb = 0; kb < KB; ++kb) {
      const auto kk = hn::Set(d, k[kb * k_stride + c]);
      for (size_t v = 0; v < QV; ++v) acc[kb][v] = hn::MulAdd(kk, q[v], acc[kb][v]);
    }
  }
  for (size_t kb = 0; kb < KB; ++kb)
    for (size_t v = 0; v < QV; ++v) hn::Store(acc[kb][v], d, st + kb * mq + v * N);
}

// ot[e][lane] = alpha[lane] · ot[e][lane] + Σ_j v[j][e] · p[j][lane] for EB consecutive value
// columns e: the online-softmax rescale is fused into loading the accumulators.
template <size_t EB, size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void AccumulateValues(D d, const T* HWY_RESTRICT p, int64_t keys, size_t mq, const T* HWY_RESTRICT v,
                                 int64_t v_stride, const hn::Vec<D>* alpha, T* HWY_RESTRICT ot) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> acc[EB][QV];
  for (size_t e = 0; e < EB; ++e)
    for (size_t q = 0; q < QV; ++q) acc[e][q] = hn::Mul(hn::Load(d, ot + e * mq + q * N), alpha[q]);
  for (int64_t j = 0; j < keys; ++j) {
    hn::Vec<D> pj[QV];
    for (size_t q = 0; q < QV; ++q) pj[q] = hn::Load(d, p + j * mq + q * N);
    for (size_t e = 0; e < EB; ++e) {
      const auto ve = hn::Set(d, v[j * v_stride + e]);
      for (size_t q = 0; q < QV; ++q) acc[e][q] = hn::MulAdd(ve, pj[q], acc[e][q]);
    }
  }
  for (size_t e = 0; e < EB; ++e)
    for (size_t q = 0; q < QV; ++q) hn::Store(acc[e][q], d, ot + e * mq + q * N);
}

// Register blocking: 12 accumulators + QV loads + 1 broadcast fit AVX2's 16 registers.
template <size_t QV>
constexpr size_t kBlockRows = QV == 1 ? 8 : 12 / QV;

// Scores of keys [j0, j0 + n) for the block, scaled (the scale is folded into qt), masked.
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void ScoreTile(D d, const Problem& p, const BlockRows& blk, Scratch<T>& s, size_t mq, int64_t j0,
                          int64_t n, bool partial) {
  constexpr size_t KB = kBlockRows<QV>;
  const T* k = p.k.at<T>(blk.b, blk.kvh, j0);
  const int64_t ks = p.k.strides[2];
  int64_t j = 0;
  for (; j + static_cast<int64_t>(KB) <= n; j += KB) ScoreKeys<KB, QV>(d, s.qt.get(), mq, k + j * ks, ks, p.Dk, s.st.get() + j * mq);
  for (; j < n; ++j) ScoreKeys<1, QV>(d, s.qt.get(), mq, k + j * ks, ks, p.Dk, s.st.get() + j * mq);

  // Causal/window edges and the mask: rare tiles or a secondary path, so plain scalar code.
  const T neg_inf = -std::numeric_limits<T>::infinity();
  if (partial) {
    for (int64_t jj = 0; jj < n; ++jj) {
      for (int64_t l = 0; l < blk.rows; ++l) {
        const LaneRow& r = s.lanes[l];
        if (j0 + jj < r.begin || j0 + jj >= r.end) s.st[jj * mq + l] = neg_inf;
      }
    }
  }
  if (p.mask) {
    for (int64_t l = 0; l < blk.rows; ++l) {
      add_mask_row(p, blk.b, s.lanes[l].h, s.lanes[l].i, j0, n, s.st.get() + l, static_cast<int64_t>(mq));
    }
  }
}

// qt[d][lane] = q[lane's row][d] · scale: the block's queries transposed and pre-scaled
// (padding lanes zero). Needs s.lanes described for this block.
template <typename T>
void PackQueries(const Problem& p, const BlockRows& blk, Scratch<T>& s, size_t mq) {
  const T scale = static_cast<T>(p.scale);
  std::fill(s.qt.get(), s.qt.get() + p.Dk * mq, T(0));
  for (int64_t l = 0; l < blk.rows; ++l) {
    const T* q = p.q.at<T>(blk.b, s.lanes[l].h, s.lanes[l].i);
    for (int64_t c = 0; c < p.Dk; ++c) s.qt[c * mq + l] = q[c] * scale;
  }
}

// Online softmax over one block's keys [key_begin, key_end): leaves the unnormalised output
// in s.ot, the running max in s.m (0 where no key is allowed) and the running sum in s.l.
template <size_t QV, class D, typename T = hn::TFromD<D>>
void RunBlock(D d, const Problem& p, const BlockRows& blk, int64_t key_begin, int64_t key_end, Scratch<T>& s) {
  const size_t N = hn::Lanes(d);
  const size_t mq = QV * N;
  using V = hn::Vec<D>;
  const V neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());

  const LaneSpan span = describe_lanes(p, blk, key_begin, key_end, s.lanes.data());
  PackQueries(p, blk, s, mq);
  std::fill(s.ot.get(), s.ot.get() + p.Dv * mq, T(0));
  V m[QV], l[QV];
  for (size_t q = 0; q < QV; ++q) {
    m[q] = neg_inf;
    l[q] = hn::Zero(d);
  }

  const T* v_head = p.v.at<T>(blk.b, blk.kvh, 0);
  const int64_t vs = p.v.strides[2];
  for (int64_t t = tile_start(span.begin); t < span.end; t += kTileKeys) {
    const int64_t j0 = std::max(t, span.begin);
    const int64_t n = std::min(t + kTileKeys, span.end) - j0;
    const bool partial = j0 < span.max_begin || j0 + n > span.min_end;
    ScoreTile<QV>(d, p, blk, s, mq, j0, n, partial);

    V mnew[QV], msafe[QV], alpha[QV], sum[QV];
    for (size_t q = 0; q < QV; ++q) mnew[q] = m[q];
    for (int64_t j = 0; j < n; ++j)
      for (size_t q = 0; q < QV; ++q) mnew[q] = hn::Max(mnew[q], hn::Load(d, s.st.get() + j * mq + q * N));
    for (size_t q = 0; q < QV; ++q) {
      // A lane with nothing allowed yet keeps max -inf; subtracting 0 keeps exp(-inf) = 0.
      msafe[q] = hn::IfThenZeroElse(hn::Eq(mnew[q], neg_inf), mnew[q]);
      alpha[q] = hn::Exp(d, hn::Sub(m[q], msafe[q]));
      sum[q] = hn::Zero(d);
      m[q] = mnew[q];
    }
    for (int64_t j = 0; j < n; ++j) {
      for (size_t q = 0; q < QV; ++q) {
        T* row = s.st.get() + j * mq + q * N;
        const V pj = hn::Exp(d, hn::Sub(hn::Load(d, row), msafe[q]));
        sum[q] = hn::Add(sum[q], pj);
        hn::Store(pj, d, row);
      }
    }
    for (size_t q = 0; q < QV; ++q) l[q] = hn::MulAdd(l[q], alpha[q], sum[q]);

    constexpr size_t EB = kBlockRows<QV>;
    const T* vt = v_head + j0 * vs;
    int64_t e = 0;
    for (; e + static_cast<int64_t>(EB) <= p.Dv; e += EB)
      AccumulateValues<EB, QV>(d, s.st.get(), n, mq, vt + e, vs, alpha, s.ot.get() + e * mq);
    for (; e < p.Dv; ++e) AccumulateValues<1, QV>(d, s.st.get(), n, mq, vt + e, vs, alpha, s.ot.get() + e * mq);
  }
  for (size_t q = 0; q < QV; ++q) {
    hn::Store(hn::IfThenZeroElse(hn::Eq(m[q], neg_inf), m[q]), d, s.m.get() + q * N);
    hn::Store(l[q], d, s.l.get() + q * N);
  }
}

// Weights for inspection, a second pass once each row's max m and sum l are known:
// w = exp(s - m) / l. (exp(s - lse) would lose eps·|lse| of relative accuracy to lse's rounding.)
template <size_t QV, class D, typename T = hn::TFromD<D>>
void WriteWeights(D d, const Problem& p, const BlockRows& blk, const T* m, const T* l, Scratch<T>& s) {
  const size_t mq = QV * hn::Lanes(d);
  const LaneSpan span = describe_lanes(p, blk, 0, p.Nk, s.lanes.data());
  PackQueries(p, blk, s, mq);
  for (int64_t lane = 0; lane < blk.rows; ++lane) {
    for (int64_t j = 0; j < p.Nk; ++j) p.weights->store(blk.b, s.lanes[lane].h, s.lanes[lane].i, j, T(0));
  }
  for (int64_t t = tile_start(span.begin); t < span.end; t += kTileKeys) {
    const int64_t j0 = std::max(t, span.begin);
    const int64_t n = std::min(t + kTileKeys, span.end) - j0;
    ScoreTile<QV>(d, p, blk, s, mq, j0, n, /*partial=*/true);
    for (int64_t lane = 0; lane < blk.rows; ++lane) {
      if (!(l[lane] > 0)) continue;  // no allowed key: the row stays zero
      const T inv = T(1) / l[lane];
      for (int64_t j = 0; j < n; ++j) {
        p.weights->store(blk.b, s.lanes[lane].h, s.lanes[lane].i, j0 + j, std::exp(s.st[j * mq + lane] - m[lane]) * inv);
      }
    }
  }
}

// Runs the whole problem: blocks (and key chunks) in parallel, each written exactly once.
template <typename T>
void Flash(const Problem& p) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const Plan plan = make_plan(p, N);
  const size_t mq = plan.qv * N;
  std::vector<T> partial(plan.needs_merge() ? plan.units() * (p.Dv + 2) * mq : 0);

  auto run = [&](Scratch<T>& s, const BlockRows& blk, int64_t k0, int64_t k1) {
    if (plan.decode) {
      DecodeBlock(d, p, blk, k0, k1, mq, /*weights=*/false, s.decode_q.get(), s.decode_o.get(), s.st.get(),
                  s.ot.get(), s.m.get(), s.l.get(), s.lanes.data());
    } else if (plan.qv == 1) {
      RunBlock<1>(d, p, blk, k0, k1, s);
    } else {
      RunBlock<2>(d, p, blk, k0, k1, s);
    }
  };
  auto finish = [&](Scratch<T>& s, const BlockRows& blk) {
    finish_block<T>(p, blk, s.ot.get(), s.m.get(), s.l.get(), mq, s.lanes.data());
    if (!p.weights) return;
    // WriteWeights overwrites the scratch, so it reads m and l from copies.
    std::vector<T> m(s.m.get(), s.m.get() + mq), l(s.l.get(), s.l.get() + mq);
    if (plan.decode) {
      DecodeBlock(d, p, blk, 0, p.Nk, mq, /*weights=*/true, s.decode_q.get(), s.decode_o.get(), s.st.get(),
                  s.ot.get(), m.data(), l.data(), s.lanes.data());
    } else if (plan.qv == 1) {
      WriteWeights<1>(d, p, blk, m.data(), l.data(), s);
    } else {
      WriteWeights<2>(d, p, blk, m.data(), l.data(), s);
    }
  };

#pragma omp parallel num_threads(plan.threads)
  {
    Scratch<T> s(p, mq, N);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < plan.units(); ++u) {
      const BlockRows blk = plan.block(u / plan.chunks);
      const int64_t c = u % plan.chunks;
      const int64_t k0 = c * plan.chunk_keys, k1 = std::min(p.Nk, k0 + plan.chunk_keys);
      run(s, blk, k0, k1);
      if (!plan.needs_merge()) {
        finish(s, blk);
      } else {  // keep (ot, m, l) of this chunk for the merge below
        T* dst = partial.data() + u * (p.Dv + 2) * mq;
        std::copy(s.ot.get(), s.ot.get() + p.Dv * mq, dst);
        std::copy(s.m.get(), s.m.get() + mq, dst + p.Dv * mq);
        std::copy(s.l.get(), s.l.get() + mq, dst + (p.Dv + 1) * mq);
      }
    }
    if (plan.needs_merge()) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t bi = 0; bi < plan.blocks; ++bi) {
        const BlockRows blk = plan.block(bi);
        describe_lanes(p, blk, 0, p.Nk, s.lanes.data());
        merge_chunks<T>(partial.data() + bi * plan.chunks * (p.Dv + 2) * mq, plan.chunks, p.Dv, mq, s.ot.get(),
                        s.m.get(), s.l.get());
        finish(s, blk);
      }
    }
  }
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_INL_H_
