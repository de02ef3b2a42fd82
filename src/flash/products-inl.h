// The register-blocked outer products of the lanes-along-rows layout, compiled per SIMD target
// (included by query_block-inl.h, backward-inl.h and decode-inl.h, which takes only
// kVectorRegisters): out[j][lane] = Σ_c rows[j][c] · xt[c][lane] (OuterScores: the scores q·kᵀ,
// the backward's dout·vᵀ) and acc[e][lane] = alpha · acc + Σ_j rows[j][e] · p[j][lane]
// (OuterAccumulate / AccumulateRows: p·V, the backward's dq, dk, dv), reading the rows in place.

#if defined(SDPA_FLASH_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_PRODUCTS_INL_H_
#undef SDPA_FLASH_PRODUCTS_INL_H_
#else
#define SDPA_FLASH_PRODUCTS_INL_H_
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "flash/rows-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Vector registers of this target: AVX-512 (and the AVX3 family) has 32, AVX2 and SSE 16.
// Other architectures are counted as 16, which only makes register blocks smaller. Sizes
// the register blocks below (kBlockRows) and decode-inl.h's DecodeValues (kDecodeChunk).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
inline constexpr int64_t kVectorRegisters = 32;
#else
inline constexpr int64_t kVectorRegisters = 16;
#endif


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
      const auto kk = hn::Set(d, k[static_cast<int64_t>(kb) * k_stride + c]);  // signed: strides may be < 0
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
    for (size_t q = 0; q < QV; ++q) acc[e][q] = Rescale(d, hn::Load(d, ot + e * mq + q * N), alpha[q]);
  for (int64_t j = 0; j < keys; ++j) {
    hn::Vec<D> pj[QV];
    for (size_t q = 0; q < QV; ++q) pj[q] = hn::Load(d, p + j * mq + q * N);
    for (size_t e = 0; e < EB; ++e) {
      const auto ve = hn::Set(d, v[j * v_stride + static_cast<int64_t>(e)]);  // signed: strides may be < 0
      for (size_t q = 0; q < QV; ++q) acc[e][q] = hn::MulAdd(ve, pj[q], acc[e][q]);
    }
  }
  for (size_t e = 0; e < EB; ++e)
    for (size_t q = 0; q < QV; ++q) hn::Store(acc[e][q], d, ot + e * mq + q * N);
}

// Register blocking: KB·QV accumulators + QV loads + 1 broadcast within the target's vector
// registers: 12 (QV = 2) or 8 (QV = 1) accumulators of AVX2's 16, twice that of AVX-512's 32.
template <size_t QV>
constexpr size_t kBlockRows = (kVectorRegisters >= 32 ? 2 : 1) * (QV == 1 ? 8 : 12 / QV);

// out[j][lane] = Σ_c rows[j][c] · xt[c][lane] for n rows (rows[j] at rows + j·stride): the
// scores q·kᵀ (xt = queries, rows = keys), and in the backward pass dout·vᵀ and the like.
// The rows left over after whole blocks of KB go in blocks of 4, 2 and 1.
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void OuterScores(D d, const T* HWY_RESTRICT xt, size_t mq, const T* HWY_RESTRICT rows, int64_t stride,
                            int64_t depth, int64_t n, T* HWY_RESTRICT out) {
  constexpr size_t KB = kBlockRows<QV>;
  int64_t j = 0;
  for (; j + static_cast<int64_t>(KB) <= n; j += KB) ScoreKeys<KB, QV>(d, xt, mq, rows + j * stride, stride, depth, out + j * mq);
  for (; j + 4 <= n; j += 4) ScoreKeys<4, QV>(d, xt, mq, rows + j * stride, stride, depth, out + j * mq);
  for (; j + 2 <= n; j += 2) ScoreKeys<2, QV>(d, xt, mq, rows + j * stride, stride, depth, out + j * mq);
  for (; j < n; ++j) ScoreKeys<1, QV>(d, xt, mq, rows + j * stride, stride, depth, out + j * mq);
}

// acc[e][lane] = alpha[lane] · acc[e][lane] + Σ_j rows[j][e] · p[j][lane] for e < width:
// p·V in the forward pass, and the dq, dk, dv products of the backward pass.
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void OuterAccumulate(D d, const T* HWY_RESTRICT p, int64_t n, size_t mq, const T* HWY_RESTRICT rows,
                                int64_t stride, int64_t width, const hn::Vec<D>* alpha, T* HWY_RESTRICT acc) {
  constexpr size_t EB = kBlockRows<QV>;
  int64_t e = 0;
  for (; e + static_cast<int64_t>(EB) <= width; e += EB)
    AccumulateValues<EB, QV>(d, p, n, mq, rows + e, stride, alpha, acc + e * mq);
  // The columns left over in blocks of 4, 2 and 1: each block re-reads the whole p tile, so a
  // column at a time would be load-bound (D = 64 with EB = 6 leaves 4 columns).
  for (; e + 4 <= width; e += 4) AccumulateValues<4, QV>(d, p, n, mq, rows + e, stride, alpha, acc + e * mq);
  for (; e + 2 <= width; e += 2) AccumulateValues<2, QV>(d, p, n, mq, rows + e, stride, alpha, acc + e * mq);
  for (; e < width; ++e) AccumulateValues<1, QV>(d, p, n, mq, rows + e, stride, alpha, acc + e * mq);
}

// acc[e][lane] += row[e] · w[lane] for one row (of v, or of q, dout, k in the backward) that
// holds a NaN or inf, skipping the lanes where w is 0 (a blocked, dropped or underflowed key;
// ds = 0): OuterAccumulate would add 0 · NaN there. Elsewhere the same fused multiply-add, so
// the other lanes keep their bits. kFiniteOnly (the forward's value rows): the non-finite
// entries are skipped too; flash_plan.h's `bad` scores carry them.
template <size_t QV, bool kFiniteOnly = false, class D, typename T = hn::TFromD<D>>
HWY_INLINE void AccumulateRowSkippingZeros(D d, const T* HWY_RESTRICT w, size_t mq, const T* HWY_RESTRICT row,
                                           int64_t width, T* HWY_RESTRICT acc) {
  const size_t N = hn::Lanes(d);
  for (int64_t e = 0; e < width; ++e) {
    if (kFiniteOnly && !std::isfinite(row[e])) continue;
    const auto x = hn::Set(d, row[e]);
    for (size_t q = 0; q < QV; ++q) {
      T* a = acc + e * static_cast<int64_t>(mq) + q * N;
      const auto wq = hn::Load(d, w + q * N), old = hn::Load(d, a);
      hn::Store(hn::IfThenElse(hn::Eq(wq, hn::Zero(d)), old, hn::MulAdd(x, wq, old)), d, a);
    }
  }
}

// OuterAccumulate over rows [0, n) (acc = alpha · acc + Σ_r rows[r] · w[r]), in row order as
// it, but with the rows flagged in `bad` (null: none) going through AccumulateRowSkippingZeros.
// Splitting the rows changes no bit: alpha is applied once, first, and each accumulator is a
// chain of fused multiply-adds in row order.
template <size_t QV, bool kFiniteOnly = false, class D, typename T = hn::TFromD<D>>
HWY_INLINE void AccumulateRows(D d, const T* HWY_RESTRICT w, int64_t n, size_t mq, const T* HWY_RESTRICT rows,
                               int64_t stride, int64_t width, const hn::Vec<D>* alpha, const uint8_t* bad,
                               T* HWY_RESTRICT acc) {
  hn::Vec<D> ones[QV];
  for (size_t q = 0; q < QV; ++q) ones[q] = hn::Set(d, T(1));
  int64_t r0 = 0;
  for (int64_t r = 0; bad && r < n; ++r) {
    if (!bad[r]) continue;
    OuterAccumulate<QV>(d, w + r0 * mq, r - r0, mq, rows + r0 * stride, stride, width, alpha, acc);
    AccumulateRowSkippingZeros<QV, kFiniteOnly>(d, w + r * mq, mq, rows + r * stride, width, acc);
    alpha = ones;
    r0 = r + 1;
  }
  OuterAccumulate<QV>(d, w + r0 * mq, n - r0, mq, rows + r0 * stride, stride, width, alpha, acc);
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_PRODUCTS_INL_H_
