// What turns dot products into scores, written once for every fused kernel (the forward's
// tiles, decode, and both backward passes): causal/window edges and the mask's bias on a tile of
// scores, in either of the kernels' two layouts. Score modifiers, per-sequence lengths and
// paged K/V change this file, not the kernels: the softcap, ALiBi, edges and the mask live here. Compiled per SIMD target (included by
// decode-inl.h, query_block-inl.h, backward-inl.h, grad_rules-inl.h and bias_grad.cc).
//
// A tile holds s(r, jj) for `count` query rows (lanes[r]: head, row and allowed keys
// [begin, end)) and keys j0 + jj, jj < n:
//   TileLayout::kKeyMajor  tile[jj · stride + r]   rows along SIMD lanes (forward, dq pass)
//   TileLayout::kRowMajor  tile[r · stride + jj]   keys along the row (decode, dk/dv pass)
// The dot products are the kernels' own (outer products or lane-wise dots); the scale is folded
// into whichever operand they pack.

#if defined(SDPA_FLASH_SCORE_TILE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_SCORE_TILE_INL_H_
#undef SDPA_FLASH_SCORE_TILE_INL_H_
#else
#define SDPA_FLASH_SCORE_TILE_INL_H_
#endif

#include <algorithm>
#include <limits>
#include <type_traits>

#include "flash/flash_plan.h"
#include "flash/rows-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

enum class TileLayout { kKeyMajor, kRowMajor };

// exp(x) for the softmax's terms (p = exp(s - m), the rescale exp(m_old - m_new), the
// backward's exp(s - lse)), 0 where it would be below the smallest normal number: such a term
// changes no sum it enters but in its last bits at most, while every operation on a subnormal
// operand costs the CPU a microcode assist (a row whose far keys land there, ALiBi's with a
// slope near 1, ran 15x slower, its backward 3.6x). Every kernel takes its exps from here.
// The argument is clamped first, since Exp's own scaling of a far-negative x passes through
// subnormals too (a select, not Max, so that NaN stays NaN): the lanes below log_min are
// computed at log_min + 4 and then zeroed. Not at log_min itself: Exp scales its polynomial by
// 2^n in two multiplies, and at n = -126 the second product can land below the smallest normal,
// an assist on Intel cores although the lane is zeroed next. Every blocked key (s = -inf) took
// that path: a bool mask with 1 key in 8 blocked ran at 37 % of the unmasked speed on a
// Sapphire Rapids class Xeon. The lanes kept are computed as they always were.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V ExpNormal(D d, V x) {
  using T = hn::TFromD<D>;
  const T log_min = std::log(std::numeric_limits<T>::min());
  const auto below = hn::Lt(x, hn::Set(d, log_min));
  return hn::IfThenZeroElse(below, hn::Exp(d, hn::IfThenElse(below, hn::Set(d, log_min + T(4)), x)));
}

// exp(x) for kFast's weights (Problem::round_p), which are rounded to 16 bits next: 2^(x·log2 e)
// as 2^n · 2^f with n = round(x·log2 e), |f| <= 1/2, and 2^f by its Taylor polynomial of degree
// 5 (relative error below 3.5e-6: 1/140 of float16's rounding, 1/1100 of bfloat16's, so that
// it moves the rounded weight's error by under 1 %; exp(0) = 1 exactly). Degree 4 (6e-5) was
// measurable: a float16 decode case's lse error went past twice the naive twin's. Less work
// than ExpNormal's full-precision Exp, which is most of the softmax's share of a short-head
// tile. 0 where x is below the smallest normal's log (as ExpNormal); x <= 0 (+inf and NaN give
// values the callers replace or flag).
// n comes from adding 1.5·2^23, which rounds t to an integer (ties to even, as Round) and leaves
// it in the low bits, where a shift moves it to the exponent: no float-to-int conversion and its
// overflow fix-up. A lane below is computed from its own x and then zeroed: the exponent add
// wraps there, but as integer arithmetic, which costs no microcode assist (no float operation
// sees a subnormal); x = -inf passes through NaN (f = -inf - -inf), zeroed too.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V ExpForRounding(D d, V x) {
  using T = hn::TFromD<D>;
  static_assert(std::is_same_v<T, float>, "the shifter and the exponent shift are float32's");
  const auto below = hn::Lt(x, hn::Set(d, std::log(std::numeric_limits<T>::min())));
  const V t = hn::Mul(x, hn::Set(d, T(1.4426950408889634)));  // x · log2 e
  const V shifter = hn::Set(d, T(0x1.8p23));
  const V y = hn::Add(t, shifter);  // n in its low bits, |t| < 2^22
  const V f = hn::Sub(t, hn::Sub(y, shifter));
  // 2^f = Σ (f ln 2)^k / k!, k <= 5, in Horner's form.
  V poly = hn::Set(d, T(0.0013333558146428443));                     // ln2^5 / 120
  poly = hn::MulAdd(poly, f, hn::Set(d, T(0.0096181291076284772)));  // ln2^4 / 24
  poly = hn::MulAdd(poly, f, hn::Set(d, T(0.055504108664821580)));   // ln2^3 / 6
  poly = hn::MulAdd(poly, f, hn::Set(d, T(0.24022650695910071)));   // ln2^2 / 2
  poly = hn::MulAdd(poly, f, hn::Set(d, T(0.69314718055994531)));   // ln2
  poly = hn::MulAdd(poly, f, hn::Set(d, T(1)));
  const hn::RebindToUnsigned<D> du;
  // poly · 2^n: y's bits are 0x4B400000 + n, whose shift by 23 leaves n << 23 (mod 2^32).
  const auto scaled = hn::Add(hn::BitCast(du, poly), hn::ShiftLeft<23>(hn::BitCast(du, y)));
  return hn::IfThenZeroElse(below, hn::BitCast(d, scaled));
}

// The online softmax's per-score rules, one vector at a time, shared by the two layouts that
// run it: BlockTile (forward_block-inl.h: lanes along query rows, msafe a vector of row maxima)
// and DecodeRows (decode-inl.h: lanes along keys, msafe one row's max in every lane). msafe is
// the running max with -inf replaced by 0 (a row with nothing allowed yet: exp(-inf - 0) = 0).
// What differs between the two is the order of the sums (down lanes vs across them), which is
// the layouts', not a rule's.
//
// p = exp(s - m). kInfMax: some row's max is +inf (a score overflowed), shifted_exp's rule:
// exp(s - m) = 1 where s == m = +inf, so that the row splits its weight among its +inf keys.
template <bool kInfMax, bool kForRounding = false, class D, class V = hn::Vec<D>>
HWY_INLINE V ShiftedExp(D d, V s, V msafe) {
  V p;
  if constexpr (kForRounding && std::is_same_v<hn::TFromD<D>, float>) {  // (double never rounds)
    p = ExpForRounding(d, hn::Sub(s, msafe));
  } else {
    p = ExpNormal(d, hn::Sub(s, msafe));
  }
  if constexpr (kInfMax) {
    return hn::IfThenElse(hn::Eq(s, hn::Set(d, std::numeric_limits<hn::TFromD<D>>::infinity())),
                          hn::Set(d, hn::TFromD<D>(1)), p);
  }
  return p;
}
// Entropy's running t (row_stats.h) gains p · (s - m) per score: -inf clamped to the lowest
// finite value so that p = 0 adds 0 (not 0 · -inf), and a +inf key at a +inf max is at the
// max (s - m counts as 0).
template <bool kInfMax, class D, class V = hn::Vec<D>>
HWY_INLINE V AddTTerm(D d, V p, V s, V msafe, V tsum) {
  using T = hn::TFromD<D>;
  V x = hn::Sub(s, msafe);
  if constexpr (kInfMax) x = hn::IfThenZeroElse(hn::Eq(s, hn::Set(d, std::numeric_limits<T>::infinity())), x);
  return hn::MulAdd(p, hn::Max(x, hn::Set(d, std::numeric_limits<T>::lowest())), tsum);
}
// Options::precision kFast's rounding (Problem::round_p) of the weights p, and in the backward
// of ds: kNone keeps float32's value, kBf16 / kF16 round to nearest even in q's 16-bit type,
// a vector at a time, as storage.h's rounded_to_16bit does one value (any sign; float16's
// overflow to inf from 65520 up; NaN stays NaN).
enum class Round16 { kNone, kBf16, kF16 };
// x's bits with bfloat16's rounding carry added: the top 16 bits are x rounded to nearest even
// bfloat16, the low 16 are to be dropped (RoundWeights masks them off; the forward's weight
// pairs, ExpRoundPack in forward_block-inl.h, shift them out).
template <class D, class V = hn::Vec<D>>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> Bf16RoundingBits(D, V x) {
  const hn::RebindToUnsigned<D> du;
  const auto u = hn::BitCast(du, x);  // sign and magnitude: the carry stays in the magnitude
  const auto odd = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  return hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), odd));
}
template <Round16 kRound, class D, class V = hn::Vec<D>>
HWY_INLINE V RoundWeights(D d, V x) {
  if constexpr (kRound == Round16::kNone || !std::is_same_v<hn::TFromD<D>, float>) {
    return x;
  } else {
    const hn::RebindToUnsigned<D> du;
    if constexpr (kRound == Round16::kBf16) {  // keep the top 16 bits, ties to even
      return hn::BitCast(d, hn::And(Bf16RoundingBits(d, x), hn::Set(du, 0xffff0000u)));
    } else {  // float16: 11 significant bits from 2^-14 up, multiples of 2^-24 below
      const auto u = hn::BitCast(du, x);  // sign and magnitude: the carry stays in the magnitude
      const auto odd = hn::And(hn::ShiftRight<13>(u), hn::Set(du, 1u));
      const V normal = hn::BitCast(d, hn::And(hn::Add(u, hn::Add(hn::Set(du, 0xfffu), odd)), hn::Set(du, ~0x1fffu)));
      const V subnormal = hn::Mul(hn::Round(hn::Mul(x, hn::Set(d, 0x1p24f))), hn::Set(d, 0x1p-24f));
      const V a = hn::Abs(x);
      const V inf = hn::CopySign(hn::Set(d, std::numeric_limits<float>::infinity()), x);
      return hn::IfThenElse(hn::Lt(a, hn::Set(d, 0x1p-14f)), subnormal,
                            hn::IfThenElse(hn::Ge(a, hn::Set(d, 65520.0f)), inf, normal));
    }
  }
}
// x[0, count) rounded in place (count a multiple of the lanes, x aligned).
template <Round16 kRound, class D, typename T = hn::TFromD<D>>
HWY_INLINE void RoundInPlace(D d, T* HWY_RESTRICT x, int64_t count) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < count; i += N) hn::Store(RoundWeights<kRound>(d, hn::Load(d, x + i)), d, x + i);
}
// The rounding Problem::round_p asks for: f(std::integral_constant<Round16, ...>{}).
template <typename F>
HWY_INLINE void WithRound16(const Problem& p, const F& f) {
  if (!p.round_p) {
    f(std::integral_constant<Round16, Round16::kNone>{});
  } else if (p.dtype == DType::kBFloat16) {
    f(std::integral_constant<Round16, Round16::kBf16>{});
  } else {
    f(std::integral_constant<Round16, Round16::kF16>{});
  }
}

// RoundWeights in the type Problem::round_p names, chosen at run time (the backward's loops,
// where the choice is one predictable branch among loads and multiplies).
template <class D, class V = hn::Vec<D>>
HWY_INLINE V RoundTo16(D d, const Problem& p, V x) {
  return p.dtype == DType::kBFloat16 ? RoundWeights<Round16::kBf16>(d, x) : RoundWeights<Round16::kF16>(d, x);
}
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void RoundTo16InPlace(D d, const Problem& p, T* HWY_RESTRICT x, int64_t count) {
  WithRound16(p, [&](auto round) { RoundInPlace<decltype(round)::value>(d, x, count); });
}

// The rescale of what came before, alpha = exp(m_old - m_new): 0 where the row had nothing
// allowed (m_old = -inf), 1 where the max stayed +inf.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V RescaleFactor(D d, V mold, V msafe) {
  const V pos_inf = hn::Set(d, std::numeric_limits<hn::TFromD<D>>::infinity());
  return hn::IfThenElse(hn::Eq(mold, pos_inf), hn::Set(d, hn::TFromD<D>(1)), ExpNormal(d, hn::Sub(mold, msafe)));
}

// Adds the mask's bias for query (b, h, i) and keys [j0, j0 + n) to dst[jj]: -inf where a bool
// mask blocks, the value of a float mask (widened from its dtype when that is not T's). One
// row of the mask read through its own (possibly zero, broadcast) key stride.
template <typename T>
void add_mask_row(const Problem& p, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, T* dst) {
  const View4& mask = *p.mask;
  const int64_t js = mask.strides[3];
  const T blocked = -std::numeric_limits<T>::infinity();
  // Blocked keys become -inf whatever their score (with_bias): +inf or NaN must not leak.
  if (mask.dtype == DType::kBool) {
    const uint8_t* row = mask.at<uint8_t>(b, h, i, j0);
    if (js == 1) {  // the common case, in a loop the compiler vectorises
      for (int64_t jj = 0; jj < n; ++jj) dst[jj] = row[jj] ? dst[jj] : blocked;
    } else {
      for (int64_t jj = 0; jj < n; ++jj) dst[jj] = row[jj * js] ? dst[jj] : blocked;
    }
  } else if (mask.dtype == dtype_of<T>()) {
    // with_bias written as an unconditional add and a select, which the compiler vectorises.
    const T* row = mask.at<T>(b, h, i, j0);
    if (js == 1) {
      for (int64_t jj = 0; jj < n; ++jj) {
        const T sum = dst[jj] + row[jj];
        dst[jj] = row[jj] == blocked ? blocked : sum;
      }
    } else {
      for (int64_t jj = 0; jj < n; ++jj) {
        const T sum = dst[jj] + row[jj * js];
        dst[jj] = row[jj * js] == blocked ? blocked : sum;
      }
    }
  } else if (mask.dtype == DType::kBFloat16 || mask.dtype == DType::kFloat16) {
    // A 16-bit mask (q's dtype): the dtype's branch hoisted out of the loop over keys.
    const uint16_t* row = mask.at<uint16_t>(b, h, i, j0);
    if (mask.dtype == DType::kBFloat16) {
      for (int64_t jj = 0; jj < n; ++jj) dst[jj] = with_bias(dst[jj], static_cast<T>(bf16_to_f32(row[jj * js])));
    } else {
      for (int64_t jj = 0; jj < n; ++jj) dst[jj] = with_bias(dst[jj], static_cast<T>(f16_to_f32(row[jj * js])));
    }
  } else {
    for (int64_t jj = 0; jj < n; ++jj) dst[jj] = with_bias(dst[jj], mask.load<T>(b, h, i, j0 + jj));
  }
}

// dst[jj] = the mask's bias for query (b, h, i) and key j0 + jj, jj < n. The common cases, a
// bool or 16-bit float mask with contiguous keys and float32 scores, convert a vector at a
// time; a float mask of T's dtype is copied; the rest goes through add_mask_row.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void MaskRowBias(D d, const Problem& p, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                            T* HWY_RESTRICT dst) {
  int64_t jj = 0;
  if constexpr (sizeof(T) == 4) {
    if (p.mask->dtype == DType::kBool && p.mask->strides[3] == 1) {
      const hn::Rebind<uint8_t, D> d8;
      const hn::RebindToUnsigned<D> du;
      const int64_t N = static_cast<int64_t>(hn::Lanes(d));
      const uint8_t* row = p.mask->at<uint8_t>(b, h, i, j0);
      const auto blocked = hn::Set(d, -std::numeric_limits<T>::infinity());
      for (; jj + N <= n; jj += N) {
        const auto is_zero = hn::Eq(hn::PromoteTo(du, hn::LoadU(d8, row + jj)), hn::Zero(du));
        hn::StoreU(hn::IfThenElseZero(hn::RebindMask(d, is_zero), blocked), d, dst + jj);
      }
    } else if ((p.mask->dtype == DType::kBFloat16 || p.mask->dtype == DType::kFloat16) && p.mask->strides[3] == 1) {
      WidenRow(d, p.mask->dtype, p.mask->ptr(b, h, i, j0), n, dst);  // exact: the biases themselves
      jj = n;
    }
  }
  if (jj < n && p.mask->dtype == dtype_of<T>()) {  // a float mask's row is its biases: copy it
    const T* row = p.mask->at<T>(b, h, i, j0);
    const int64_t js = p.mask->strides[3];
    for (; jj < n; ++jj) dst[jj] = row[jj * js];
  }
  if (jj < n) {
    std::fill(dst + jj, dst + n, T(0));
    add_mask_row(p, b, h, i, j0 + jj, n - jj, dst + jj);
  }
}

// Adds the mask's biases to a key-major tile (QV vectors of lanes per key; padding lanes past
// `count` take harmless biases). mask_rows: Mq × kTileKeys scratch.
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void AddMaskKeyMajor(D d, const Problem& p, int64_t b, const LaneRow* lanes, int64_t count, int64_t j0,
                                int64_t n, T* HWY_RESTRICT st, size_t mq, T* HWY_RESTRICT mask_rows) {
  const size_t N = hn::Lanes(d);
  if (p.mask->strides[1] == 0 && p.mask->strides[2] == 0) {
    // One mask row for every lane (a key-padding mask, (B, 1, 1, Nk) or (Nk,)): read it once
    // and add each key's bias to all lanes with SIMD. Padding lanes take it too, harmlessly.
    MaskRowBias(d, p, b, 0, 0, j0, n, mask_rows);
    for (int64_t jj = 0; jj < n; ++jj) {
      if (mask_rows[jj] == T(0)) continue;
      const auto bias = hn::Set(d, mask_rows[jj]);
      const bool blocked = mask_rows[jj] == -std::numeric_limits<T>::infinity();  // -inf whatever the score
      for (size_t v = 0; v < QV; ++v) {
        T* row = st + jj * static_cast<int64_t>(mq) + v * N;
        hn::Store(blocked ? bias : hn::Add(hn::Load(d, row), bias), d, row);
      }
    }
    return;
  }
  // Each lane's mask row runs along the keys, the tile along the lanes. Reading the rows into
  // mask_rows[lane][jj] (contiguous, vectorised) and adding them a key at a time with one
  // gather per vector of lanes beats writing each element across the tile (~1.5x here).
  for (size_t l = 0; l < mq; ++l) {
    T* dst = mask_rows + l * kTileKeys;
    if (static_cast<int64_t>(l) < count) {
      MaskRowBias(d, p, b, lanes[l].h, lanes[l].i, j0, n, dst);
    } else {
      std::fill_n(dst, n, T(0));  // padding lanes: bias 0
    }
  }
  const hn::RebindToSigned<D> di;
  using TI = hn::TFromD<decltype(di)>;
  TI offsets[QV * hn::MaxLanes(di)];
  for (size_t l = 0; l < mq; ++l) offsets[l] = static_cast<TI>(l * kTileKeys);
  hn::Vec<decltype(di)> index[QV];
  for (size_t v = 0; v < QV; ++v) index[v] = hn::LoadU(di, offsets + v * N);
  const auto neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  for (int64_t jj = 0; jj < n; ++jj) {
    for (size_t v = 0; v < QV; ++v) {
      T* row = st + jj * static_cast<int64_t>(mq) + v * N;
      const auto bias = hn::GatherIndex(d, mask_rows + jj, index[v]);  // with_bias, a vector at a time
      hn::Store(hn::IfThenElse(hn::Eq(bias, neg_inf), bias, hn::Add(hn::Load(d, row), bias)), d, row);
    }
  }
}

// tanh(x) = sign(x) · y / (y + 2) with y = expm1(2|x|), Highway's formula, but with |x| clamped
// where tanh rounds to 1 (9 in float32, 19 in float64: y stays finite) and, in float32, the
// division as a reciprocal estimate refined by one Newton step (relative error below 2^-23 with
// AVX2's 12-bit estimate): the division cost more than the rest of the cap (issue 12's budget).
template <class D, class V = hn::Vec<D>>
HWY_INLINE V CapTanh(D d, V x) {
  using T = hn::TFromD<D>;
  const V sign = hn::And(hn::SignBit(d), x);
  const V abs_x = hn::Xor(x, sign), limit = hn::Set(d, T(sizeof(T) == 4 ? 9 : 19));
  const V a = hn::IfThenElse(hn::Gt(abs_x, limit), limit, abs_x);  // NaN stays NaN (x86's Min would not keep it)
  const V y = hn::Expm1(d, hn::Add(a, a));
  const V z = hn::Add(y, hn::Set(d, T(2)));
  V t;
  if constexpr (sizeof(T) == 4) {
    const V r = hn::ApproximateReciprocal(z);
    t = hn::Mul(y, hn::MulAdd(r, hn::NegMulAdd(z, r, hn::Set(d, T(1))), r));
  } else {
    t = hn::Div(y, z);
  }
  return hn::Xor(t, sign);
}

// The softcap on n contiguous scores: x = cap·tanh(x / cap) (Problem::score's tanh, with
// CapTanh), keeping -inf (a blocked key) when keep_blocked; slope (null: not wanted) gets
// ∂x/∂(the argument) = 1 - tanh². The tail goes through one vector of a zero-padded copy, so
// every element takes the same arithmetic wherever it lies in a tile.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void CapRun(D d, T cap, bool keep_blocked, T* HWY_RESTRICT x, int64_t n, T* HWY_RESTRICT slope) {
  using V = hn::Vec<D>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const V vcap = hn::Set(d, cap), inv = hn::Set(d, T(1) / cap), one = hn::Set(d, T(1));
  const V neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  const auto step = [&](T* at, T* slope_at) {
    const V s = hn::LoadU(d, at);
    const V t = CapTanh(d, hn::Mul(s, inv));
    V capped = hn::Mul(vcap, t);
    if (keep_blocked) capped = hn::IfThenElse(hn::Eq(s, neg_inf), s, capped);
    hn::StoreU(capped, d, at);
    if (slope_at != nullptr) hn::StoreU(hn::NegMulAdd(t, t, one), d, slope_at);
  };
  int64_t i = 0;
  for (; i + N <= n; i += N) step(x + i, slope ? slope + i : nullptr);
  if (i < n) {
    HWY_ALIGN T buf[hn::MaxLanes(d)] = {};
    HWY_ALIGN T slope_buf[hn::MaxLanes(d)] = {};
    for (int64_t l = 0; l < n - i; ++l) buf[l] = x[i + l];
    step(buf, slope_buf);
    for (int64_t l = 0; l < n - i; ++l) x[i + l] = buf[l];
    for (int64_t l = 0; slope != nullptr && l < n - i; ++l) slope[i + l] = slope_buf[l];
  }
}

// ALiBi on a key-major tile: tile[jj·stride + r] -= slope_r · |i'_r - (j0 + jj)| for the
// block's `count` lanes (Problem::alibi_bias: the distance as T, then one fused multiply-add).
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void AddAlibiKeyMajor(D d, const Problem& p, int64_t b, const LaneRow* lanes, int64_t count, int64_t j0,
                                 int64_t n, T* HWY_RESTRICT tile, size_t stride) {
  using V = hn::Vec<D>;
  const size_t N = hn::Lanes(d);
  constexpr size_t kMax = 2 * hn::MaxLanes(hn::ScalableTag<T>());  // QV <= 2
  HWY_ALIGN T neg_slope[kMax] = {}, row[kMax] = {};
  for (int64_t r = 0; r < count; ++r) {
    neg_slope[r] = -p.alibi_slope<T>(b, lanes[r].h);
    row[r] = static_cast<T>(p.aligned_row(b, lanes[r].i));
  }
  for (size_t v = 0; v * N < stride; ++v) {
    const V slope = hn::Load(d, neg_slope + v * N), ip = hn::Load(d, row + v * N);
    for (int64_t jj = 0; jj < n; ++jj) {
      T* at = tile + jj * static_cast<int64_t>(stride) + v * N;
      const V distance = hn::Abs(hn::Sub(ip, hn::Set(d, static_cast<T>(j0 + jj))));
      hn::Store(hn::MulAdd(slope, distance, hn::Load(d, at)), d, at);
    }
  }
}

// ALiBi on one row of a row-major tile: row[jj] -= slope · |i' - (j0 + jj)|, one fused
// multiply-add per key as AddAlibiKeyMajor (the distance as T: exact below 2^24 for float32),
// a vector of keys at a time, the tail through a zero-padded copy.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void AddAlibiRow(D d, const Problem& p, int64_t b, const LaneRow& lane, int64_t j0, int64_t n,
                            T* HWY_RESTRICT row) {
  using V = hn::Vec<D>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const V neg_slope = hn::Set(d, -p.alibi_slope<T>(b, lane.h));
  const V ip = hn::Set(d, static_cast<T>(p.aligned_row(b, lane.i)));
  const auto step = [&](int64_t jj, T* at) {
    const V distance = hn::Abs(hn::Sub(ip, hn::Iota(d, static_cast<T>(j0 + jj))));
    hn::StoreU(hn::MulAdd(neg_slope, distance, hn::LoadU(d, at)), d, at);
  };
  int64_t jj = 0;
  for (; jj + N <= n; jj += N) step(jj, row + jj);
  if (jj < n) {
    HWY_ALIGN T buf[hn::MaxLanes(d)] = {};
    for (int64_t l = 0; l < n - jj; ++l) buf[l] = row[jj + l];
    step(jj, buf);
    for (int64_t l = 0; l < n - jj; ++l) row[jj + l] = buf[l];
  }
}

// The block mask on a tile (Problem::block_allows): -inf at the keys of [j0, j0 + n) whose
// block the lane's row blocks, a run of keys per block, in either layout (s: the stride).
template <TileLayout layout, typename T>
void BlockMaskTile(const Problem& p, int64_t b, const LaneRow* lanes, int64_t count, int64_t j0, int64_t n,
                   T* HWY_RESTRICT tile, int64_t s) {
  const View4& bm = *p.block_mask;
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* row = bm.at<uint8_t>(b, lanes[r].h, p.block_row(lanes[r].i), 0);
    for (int64_t j = j0; j < j0 + n;) {
      const int64_t kb = p.block_col(j), end = p.block_col_end(j, j0 + n);
      for (; row[kb * bm.strides[3]] == 0 && j < end; ++j) {
        (layout == TileLayout::kKeyMajor ? tile[(j - j0) * s + r] : tile[r * s + (j - j0)]) =
            -std::numeric_limits<T>::infinity();
      }
      j = end;
    }
  }
}

// The scores of a tile from its scaled dot products: the softcap, causal/window edges (when
// `edges`: tiles inside every row's keys need none), ALiBi, the mask and the block mask, in
// Problem::score's order. For kKeyMajor, stride is the block's Mq = QV · lanes and mask_rows
// is Mq × kTileKeys scratch; kRowMajor ignores QV and mask_rows. slope (null: not wanted; the backward's) gets
// the softcap's ∂score/∂x in the tile's layout, where there is a softcap.
template <size_t QV, TileLayout layout, class D, typename T = hn::TFromD<D>>
HWY_INLINE void MaskScores(D d, const Problem& p, int64_t b, const LaneRow* lanes, int64_t count, int64_t j0,
                           int64_t n, bool edges, T* HWY_RESTRICT tile, size_t stride, T* HWY_RESTRICT mask_rows,
                           T* HWY_RESTRICT slope = nullptr) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t s = static_cast<int64_t>(stride);
  const T cap = static_cast<T>(p.softcap);
  // The cap on the rows of the tile that hold scores (key-major: all of it, one run).
  const auto cap_tile = [&](bool keep_blocked) {
    if constexpr (layout == TileLayout::kKeyMajor) {
      CapRun(d, cap, keep_blocked, tile, n * s, slope);
      return;
    }
    for (int64_t r = 0; r < count; ++r) CapRun(d, cap, keep_blocked, tile + r * s, n, slope ? slope + r * s : nullptr);
  };
  if (p.softcap != 0 && !p.cap_after_bias) cap_tile(/*keep_blocked=*/false);  // edges and masks follow
  if constexpr (layout == TileLayout::kKeyMajor) {
    if (edges) {  // rare tiles, so plain scalar code
      for (int64_t jj = 0; jj < n; ++jj) {
        for (int64_t r = 0; r < count; ++r) {
          if (j0 + jj < lanes[r].begin || j0 + jj >= lanes[r].end) tile[jj * s + r] = neg_inf;
        }
      }
    }
    if (p.has_alibi()) AddAlibiKeyMajor(d, p, b, lanes, count, j0, n, tile, stride);
    if (p.mask) AddMaskKeyMajor<QV>(d, p, b, lanes, count, j0, n, tile, stride, mask_rows);
    if (p.block_mask) BlockMaskTile<layout>(p, b, lanes, count, j0, n, tile, s);
  } else {
    for (int64_t r = 0; r < count; ++r) {
      T* row = tile + r * s;
      if (edges) {  // the keys before the row's first and from its end on: two runs per row
        // (the backward asks for edges on every tile; a compare per score was a third of its
        // dk/dv pass's samples)
        const int64_t lo = std::clamp<int64_t>(lanes[r].begin - j0, 0, n);
        const int64_t hi = std::clamp<int64_t>(lanes[r].end - j0, lo, n);
        std::fill(row, row + lo, neg_inf);
        std::fill(row + hi, row + n, neg_inf);
      }
      if (p.has_alibi()) AddAlibiRow(d, p, b, lanes[r], j0, n, row);
      if (p.mask) add_mask_row(p, b, lanes[r].h, lanes[r].i, j0, n, row);
    }
    if (p.block_mask) BlockMaskTile<layout>(p, b, lanes, count, j0, n, tile, s);
  }
  if (p.softcap != 0 && p.cap_after_bias) cap_tile(/*keep_blocked=*/true);
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_SCORE_TILE_INL_H_
