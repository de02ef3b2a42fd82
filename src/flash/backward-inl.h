// The fused backward pass (FlashAttention-2), compiled per SIMD target; included by
// flash.cc after flash-inl.h, whose outer-product kernels it reuses. Per query row i:
//   p_ij = exp(s_ij - lse_i)       (recomputed tile by tile from the saved lse)
//   D_i  = dout_i · out_i          ds_ij = p_ij · (dout_i · v_j - D_i)
//   dv_j = Σ_i p_ij dout_i         dk_j = scale · Σ_i ds_ij q_i        dq_i = scale · Σ_j ds_ij k_j
// Two passes, so that every output element has one owner and a fixed summation order (no
// atomics, bitwise identical for any thread count):
//   KeyBlockGrads: lanes = keys of one kv head; all query rows of its group stream past,
//                  accumulating dk, dv in registers-and-L1 tiles.
//   QueryBlockGrad: lanes = query rows, as the forward; key tiles stream past, accumulating dq.
// The Nq×Nk matrices never exist: extra memory is O(threads × tile) plus D and lse, O(N).

#if defined(SDPA_FLASH_BACKWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_BACKWARD_INL_H_
#undef SDPA_FLASH_BACKWARD_INL_H_
#else
#define SDPA_FLASH_BACKWARD_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "flash/flash-inl.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr size_t kBackwardQV = 2;  // vectors per block: 16 lanes of f32 on AVX2, 32 on AVX-512

// Per-thread tiles of the backward pass.
template <typename T>
struct BackwardScratch {
  BackwardScratch(const Problem& p, size_t mq)
      : xt(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dk) * mq)),
        yt(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dv) * mq)),
        gk(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dk) * mq)),
        gv(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dv) * mq)),
        pt(hwy::AllocateAligned<T>(kTileKeys * mq)),
        dpt(hwy::AllocateAligned<T>(kTileKeys * mq)),
        mask_rows(hwy::AllocateAligned<T>(kTileKeys * mq)),
        m(hwy::AllocateAligned<T>(mq)),
        l(hwy::AllocateAligned<T>(mq)),
        lane_lse(hwy::AllocateAligned<T>(mq)),
        lane_D(hwy::AllocateAligned<T>(mq)),
        lanes(mq) {}
  hwy::AlignedFreeUniquePtr<T[]> xt, yt;  // transposed inputs: (k, v) or (q, dout) of the block
  hwy::AlignedFreeUniquePtr<T[]> gk, gv;  // gradient accumulators: (dk, dv) or (dq, unused)
  hwy::AlignedFreeUniquePtr<T[]> pt, dpt, mask_rows, m, l;  // score tiles, AddMaskTile's rows, BeginBlock's m, l
  hwy::AlignedFreeUniquePtr<T[]> lane_lse, lane_D;  // per query lane: lse and D
  std::vector<LaneRow> lanes;
};

// problem.h's probability(): p = exp(s - lse), 0 for s = -inf whatever lse, at most 1.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Probability(D d, V s, V lse) {
  using T = hn::TFromD<D>;
  return hn::IfThenZeroElse(hn::Eq(s, hn::Set(d, -std::numeric_limits<T>::infinity())),
                            hn::Min(hn::Exp(d, hn::Sub(s, lse)), hn::Set(d, T(1))));
}
// problem.h's grad_ds() without dropout: ds = p · (dp - D), exactly 0 where p is.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Ds(D d, V p, V dp, V D_row) {
  return hn::IfThenZeroElse(hn::Eq(p, hn::Zero(d)), hn::Mul(p, hn::Sub(dp, D_row)));
}

// Row statistics the passes share, contiguous: lse (+inf where the row has no allowed key,
// so that exp(s - lse) = 0 there) and D = dout · out.
template <typename T>
struct RowStats {
  std::vector<T> lse, D;
  int64_t Hq = 0, Nq = 0;
  int64_t index(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * Nq + i; }
};

// dk, dv for keys [j0, j0 + nk) of kv head (b, kvh): keys in lanes.
template <class D, typename T = hn::TFromD<D>>
void KeyBlockGrads(D d, const BackwardProblem& bp, const RowStats<T>& rs, int64_t b, int64_t kvh, int64_t j0,
                   BackwardScratch<T>& s) {
  constexpr size_t QV = kBackwardQV;
  using V = hn::Vec<D>;
  const Problem& p = bp.fwd;
  const size_t N = hn::Lanes(d), mq = QV * N;
  const int64_t nk = std::min<int64_t>(static_cast<int64_t>(mq), p.Nk - j0);
  const T scale = static_cast<T>(p.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  // kt = k · scale and vt, transposed; padding lanes zero.
  std::fill(s.xt.get(), s.xt.get() + p.Dk * mq, T(0));
  std::fill(s.yt.get(), s.yt.get() + p.Dv * mq, T(0));
  for (int64_t l = 0; l < nk; ++l) {
    const T* k = p.k.at<T>(b, kvh, j0 + l);
    const T* v = p.v.at<T>(b, kvh, j0 + l);
    for (int64_t c = 0; c < p.Dk; ++c) s.xt[c * mq + l] = k[c] * scale;
    for (int64_t e = 0; e < p.Dv; ++e) s.yt[e * mq + l] = v[e];
  }
  std::fill(s.gk.get(), s.gk.get() + p.Dk * mq, T(0));
  std::fill(s.gv.get(), s.gv.get() + p.Dv * mq, T(0));
  V ones[QV];
  for (size_t q = 0; q < QV; ++q) ones[q] = hn::Set(d, T(1));

  // Only rows in [rows.first, rows.last) can see a key of the block (causal and windows).
  const RowInterval rows = rows_seeing_keys(p, j0, j0 + nk);
  for (int64_t h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
    for (int64_t i0 = rows.first; i0 < rows.last; i0 += kTileKeys) {
      // Rows of this tile that see any key of the block; the others contribute nothing.
      int64_t first = -1, last = -1;
      for (int64_t i = i0; i < std::min(rows.last, i0 + kTileKeys); ++i) {
        const KeyRange kr = p.key_range(i);
        if (std::max(kr.begin, j0) < std::min(kr.end, j0 + nk) && rs.lse[rs.index(b, h, i)] != T(INFINITY)) {
          if (first < 0) first = i;
          last = i;
        }
      }
      if (first < 0) continue;
      const int64_t n = last + 1 - first;
      const T* q = p.q.at<T>(b, h, first);
      const T* dout = bp.dout.at<T>(b, h, first);
      const int64_t qs = p.q.strides[2], ds = bp.dout.strides[2];
      T* pt = s.pt.get();
      T* dpt = s.dpt.get();
      // p = exp(s - lse) with s = q · (k·scale) + bias, -inf outside the row's keys.
      OuterScores<QV>(d, s.xt.get(), mq, q, qs, p.Dk, n, pt);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t i = first + r;
        T* row = pt + r * mq;
        const KeyRange kr = p.key_range(i);
        for (int64_t l = 0; l < static_cast<int64_t>(mq); ++l) {
          if (l >= nk || j0 + l < kr.begin || j0 + l >= kr.end) row[l] = neg_inf;
        }
        if (p.mask) add_mask_row(p, b, h, i, j0, nk, row, 1);
        const V lse = hn::Set(d, rs.lse[rs.index(b, h, i)]);
        for (size_t q = 0; q < QV; ++q) hn::Store(Probability(d, hn::Load(d, row + q * N), lse), d, row + q * N);
      }
      // dp = dout · vᵀ;  ds = p · (z·dp - D);  dv += Σ_i z·p_i · dout_i;  dk += Σ_i ds_i · q_i,
      // with z the dropout factor (1 without dropout).
      OuterScores<QV>(d, s.yt.get(), mq, dout, ds, p.Dv, n, dpt);
      for (int64_t r = 0; r < n; ++r) {
        const T Di = rs.D[rs.index(b, h, first + r)];
        if (p.dropout.enabled()) {
          for (int64_t l = 0; l < nk; ++l) {
            const T z = p.dropout.factor<T>(b, h, first + r, j0 + l);
            dpt[r * mq + l] = grad_ds(pt[r * mq + l], z, dpt[r * mq + l], Di);
            pt[r * mq + l] *= z;
          }
          continue;
        }
        for (size_t q = 0; q < QV; ++q) {
          T* x = dpt + r * mq + q * N;
          hn::Store(Ds(d, hn::Load(d, pt + r * mq + q * N), hn::Load(d, x), hn::Set(d, Di)), d, x);
        }
      }
      OuterAccumulate<QV>(d, pt, n, mq, dout, ds, p.Dv, ones, s.gv.get());
      OuterAccumulate<QV>(d, dpt, n, mq, q, qs, p.Dk, ones, s.gk.get());
    }
  }
  for (int64_t l = 0; l < nk; ++l) {
    T* dk = bp.dk.at<T>(b, kvh, j0 + l);
    T* dv = bp.dv.at<T>(b, kvh, j0 + l);
    bool finite = true;
    for (int64_t c = 0; c < p.Dk; ++c) {
      dk[c] = s.gk[c * mq + l] * scale;
      finite &= std::isfinite(dk[c]);
    }
    for (int64_t e = 0; e < p.Dv; ++e) {
      dv[e] = s.gv[e * mq + l];
      finite &= std::isfinite(dv[e]);
    }
    // The outer products multiplied every row's q and dout by its p or ds, so a NaN or inf in
    // a row that does not attend this key (p = ds = 0) gave 0 · NaN: recompute the key from the
    // same lse and D, skipping those rows (rare; O(group · Nq · (Dk + Dv))).
    if (!finite) backward_key<T>(bp, b, kvh, j0 + l, rs.lse.data(), rs.D.data(), dk, dv);
  }
}

// dq for one block of query rows (lanes = rows, as in the forward).
template <class D, typename T = hn::TFromD<D>>
void QueryBlockGrad(D d, const BackwardProblem& bp, const RowStats<T>& rs, const BlockRows& blk,
                    BackwardScratch<T>& s) {
  constexpr size_t QV = kBackwardQV;
  using V = hn::Vec<D>;
  const Problem& p = bp.fwd;
  const size_t N = hn::Lanes(d), mq = QV * N;
  const T scale = static_cast<T>(p.scale);
  BlockState<T> bs{blk, {}, s.xt.get(), s.gv.get(), s.m.get(), s.l.get(), s.lanes.data()};
  BeginBlock(p, blk, 0, p.Nk, mq, bs);  // qt = q · scale, lanes and span
  // dout transposed; lse and D per lane (padding lanes: lse = +inf, so p = 0).
  std::fill(s.yt.get(), s.yt.get() + p.Dv * mq, T(0));
  T* lse_lanes = s.lane_lse.get();
  T* D_lanes = s.lane_D.get();
  for (size_t l = 0; l < mq; ++l) {
    lse_lanes[l] = T(INFINITY);
    D_lanes[l] = 0;
  }
  for (int64_t l = 0; l < blk.rows; ++l) {
    const LaneRow& r = bs.lanes[l];
    const T* dout = bp.dout.at<T>(blk.b, r.h, r.i);
    for (int64_t e = 0; e < p.Dv; ++e) s.yt[e * mq + l] = dout[e];
    lse_lanes[l] = rs.lse[rs.index(blk.b, r.h, r.i)];
    D_lanes[l] = rs.D[rs.index(blk.b, r.h, r.i)];
  }
  std::fill(s.gk.get(), s.gk.get() + p.Dk * mq, T(0));
  V ones[QV], lse[QV], Dv[QV];
  for (size_t q = 0; q < QV; ++q) {
    ones[q] = hn::Set(d, T(1));
    lse[q] = hn::Load(d, lse_lanes + q * N);
    Dv[q] = hn::Load(d, D_lanes + q * N);
  }
  const T* k_head = p.k.at<T>(blk.b, blk.kvh, 0);
  const T* v_head = p.v.at<T>(blk.b, blk.kvh, 0);
  const int64_t ks = p.k.strides[2], vs = p.v.strides[2];
  for (int64_t t = tile_start(bs.span.begin); t < bs.span.end; t += kTileKeys) {
    const int64_t j0 = std::max(t, bs.span.begin);
    const int64_t n = std::min(t + kTileKeys, bs.span.end) - j0;
    const bool partial = j0 < bs.span.max_begin || j0 + n > bs.span.min_end;
    T* pt = s.pt.get();
    T* dpt = s.dpt.get();
    ScoreTile<QV>(d, p, bs, pt, mq, j0, n, partial, s.mask_rows.get());
    OuterScores<QV>(d, s.yt.get(), mq, v_head + j0 * vs, vs, p.Dv, n, dpt);  // dp = dout · vᵀ
    if (p.dropout.enabled()) {  // dp = z · (dout · vᵀ), z the dropout factor (0 · NaN = 0 here)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t l = 0; l < blk.rows; ++l) {
          const T z = p.dropout.factor<T>(blk.b, bs.lanes[l].h, bs.lanes[l].i, j0 + j);
          dpt[j * mq + l] = z == 0 ? T(0) : z * dpt[j * mq + l];
        }
    }
    for (int64_t j = 0; j < n; ++j) {
      for (size_t q = 0; q < QV; ++q) {
        const V pj = Probability(d, hn::Load(d, pt + j * mq + q * N), lse[q]);
        T* x = dpt + j * mq + q * N;
        hn::Store(Ds(d, pj, hn::Load(d, x), Dv[q]), d, x);  // ds = p · (dp - D)
      }
    }
    OuterAccumulate<QV>(d, dpt, n, mq, k_head + j0 * ks, ks, p.Dk, ones, s.gk.get());  // dq += ds · k
  }
  for (int64_t l = 0; l < blk.rows; ++l) {
    T* dq = bp.dq.at<T>(blk.b, bs.lanes[l].h, bs.lanes[l].i);
    bool finite = true;
    for (int64_t c = 0; c < p.Dk; ++c) {
      dq[c] = s.gk[c * mq + l] * scale;
      finite &= std::isfinite(dq[c]);
    }
    // ds · k multiplied every key row by its ds, so a NaN or inf in the key row of a key the
    // row does not attend (ds = 0) gave 0 · NaN: recompute the row exactly (rare; allocates).
    // (It recomputes the softmax, which backward_key does not need: lse is given.)
    if (!finite && !std::isnan(lse_lanes[l]) && std::isfinite(D_lanes[l])) {
      std::vector<T> prob(static_cast<size_t>(p.Nk)), row(static_cast<size_t>(p.Dk));
      backward_row<T>(bp, blk.b, bs.lanes[l].h, bs.lanes[l].i, prob.data(), row.data(), nullptr, nullptr);
      std::copy(row.begin(), row.end(), dq);
    }
  }
}

template <typename T>
void FlashBackward(const BackwardProblem& bp) {
  const hn::ScalableTag<T> d;
  const Problem& p = bp.fwd;
  const int64_t mq = static_cast<int64_t>(kBackwardQV * hn::Lanes(d));
  RowStats<T> rs;
  rs.Hq = p.Hq;
  rs.Nq = p.Nq;
  rs.lse.resize(p.B * p.Hq * p.Nq);
  rs.D.resize(rs.lse.size());
  const int64_t key_blocks = ceil_div(p.Nk, mq);
  const int64_t rows_per_head = p.Nq * p.group, query_blocks = ceil_div(rows_per_head, mq);
  // No more threads than units of the largest pass (set_num_threads may ask for millions).
  const int64_t units = std::max({p.B * p.Hq, p.B * p.Hkv * key_blocks, p.B * p.Hkv * query_blocks});
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), units)));

#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < p.B * p.Hq; ++bh) {
      const int64_t b = bh / p.Hq, h = bh % p.Hq;
      for (int64_t i = 0; i < p.Nq; ++i) {
        const T l = p.lse->load<T>(b, h, i, 0);
        rs.lse[rs.index(b, h, i)] = l == -std::numeric_limits<T>::infinity() ? T(INFINITY) : l;
        T D = 0;
        for (int64_t e = 0; e < p.Dv; ++e) D += bp.dout.at<T>(b, h, i)[e] * p.out.at<T>(b, h, i)[e];
        rs.D[rs.index(b, h, i)] = D;
      }
    }
    BackwardScratch<T> s(p, static_cast<size_t>(mq));
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < p.B * p.Hkv * key_blocks; ++u) {
      const int64_t head = u / key_blocks;
      KeyBlockGrads(d, bp, rs, head / p.Hkv, head % p.Hkv, (u % key_blocks) * mq, s);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < p.B * p.Hkv * query_blocks; ++u) {
      const int64_t head = u / query_blocks, r0 = (u % query_blocks) * mq;
      const BlockRows blk{head / p.Hkv, head % p.Hkv, r0, std::min(mq, rows_per_head - r0)};
      QueryBlockGrad(d, bp, rs, blk, s);
    }
  }
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_BACKWARD_INL_H_
