// The backward's per-element rules in SIMD form, written once for the fused backward
// (backward-inl.h) and the fused mask gradient (bias_grad.cc): p from the saved lse, ds from p
// and dp (problem.h's grad_ds, step for step), and the softcap's chain rule. Compiled per SIMD
// target (included by backward-inl.h and bias_grad.cc).

#if defined(SDPA_FLASH_GRAD_RULES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_GRAD_RULES_INL_H_
#undef SDPA_FLASH_GRAD_RULES_INL_H_
#else
#define SDPA_FLASH_GRAD_RULES_INL_H_
#endif

#include <cstdint>
#include <limits>

#include "flash/score_tile-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// p = exp(s - lse), exactly 0 for a blocked key (s = -inf) even where lse is NaN, and at most
// 1: s is recomputed here in another order than the forward's (k · scale, not q · scale), so
// with huge scores (|s| ~ 1e9 in float32) s - lse can exceed 0 by far more than rounding of p
// would, and exp of it overflowed into NaN gradients.
// (ExpNormal: a p below the smallest normal number is 0.)
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Probability(D d, V s, V lse) {
  using T = hn::TFromD<D>;
  return hn::IfThenZeroElse(hn::Eq(s, hn::Set(d, -std::numeric_limits<T>::infinity())),
                            hn::Min(ExpNormal(d, hn::Sub(s, lse)), hn::Set(d, T(1))));
}

// problem.h's grad_ds(p, z, dp, D) = p · (z·dp - D) in two steps: DroppedDp(z, dp) = z·dp, 0
// where the dropout factor z is (a dropped key's dp, even NaN, counts as 0); then Ds, exactly 0
// where p is. Without dropout z = 1 and the first step is skipped.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V DroppedDp(D d, V z, V dp) {
  return hn::IfThenZeroElse(hn::Eq(z, hn::Zero(d)), hn::Mul(z, dp));
}
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Ds(D d, V p, V dp, V D_row) {
  return hn::IfThenZeroElse(hn::Eq(p, hn::Zero(d)), hn::Mul(p, hn::Sub(dp, D_row)));
}

// ds · c, c the softcap's ∂s/∂x (MaskScores' slope): the chain rule through the cap. An exact
// 0 (a key of weight 0) stays 0.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V CapSlope(D d, V ds, V slope) {
  return hn::IfThenZeroElse(hn::Eq(ds, hn::Zero(d)), hn::Mul(ds, slope));
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_GRAD_RULES_INL_H_
