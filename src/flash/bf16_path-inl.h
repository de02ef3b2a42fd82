// The bfloat16 dot-product path (bf16_dot.h's vdpbf16ps and AMX products) as the fused kernels
// choose and call it, compiled per SIMD target (included by query_block-inl.h and
// backward-inl.h): which call may take it (Bf16DotPath), which rows and key tiles lie in its
// range, and the product itself (Bf16Dot).

#if defined(SDPA_FLASH_BF16_PATH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_BF16_PATH_INL_H_
#undef SDPA_FLASH_BF16_PATH_INL_H_
#else
#define SDPA_FLASH_BF16_PATH_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "flash/bf16_dot.h"
#include "flash/flash_plan.h"
#include "hwy/highway.h"
#include "kernel_path.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Targets on which the kernels may call bf16_dot.h (AVX-512: 16 float lanes, as it assumes).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
inline constexpr bool kBf16DotTarget = true;
#else
inline constexpr bool kBf16DotTarget = false;
#endif

// The path of a call whose dot products read views of these dtypes: kAmxBf16 (AmxDotScores) or
// kAvx512Bf16 (Bf16DotScores) when all of them are bfloat16, on this target, allowed
// (set_max_kernel_path) and present on the CPU, the best such; else kSimd. (The scale, and each
// block's and tile's values, are checked against their range too.)
template <typename T>
KernelPath Bf16DotPath(std::initializer_list<DType> operands) {
  for (DType t : operands) {
    if (t != DType::kBFloat16) return KernelPath::kSimd;
  }
  if (!kBf16DotTarget || !std::is_same_v<T, float>) return KernelPath::kSimd;
  const KernelPath max = max_kernel_path();
  if (max >= KernelPath::kAmxBf16 && cpu_has_amx_bf16()) return KernelPath::kAmxBf16;
  if (max >= KernelPath::kAvx512Bf16 && cpu_has_avx512_bf16()) return KernelPath::kAvx512Bf16;
  return KernelPath::kSimd;
}

// out[j·mq + lane] = scale · Σ_c x_lane[c] · row_j[c] for rows j < n of head (b, h) of v from
// row n0 on, x packed in bfloat16 pairs (bf16_dot.h): OuterScores' result from the bfloat16
// dot-product instruction. Only where kBf16DotTarget and T is float (pairs are null elsewhere).
template <typename T>
HWY_INLINE void Bf16Dot(const uint32_t* pairs, size_t mq, int64_t depth, const View4& v, int64_t b, int64_t h,
                        int64_t n0, int64_t n, double scale, bool amx, T* HWY_RESTRICT out) {
  if constexpr (kBf16DotTarget && std::is_same_v<T, float>) {
    (amx ? AmxDotScores : Bf16DotScores)(pairs, mq, depth, v.at<uint16_t>(b, h, n0), v.strides[2], n,
                                         static_cast<float>(scale), out);
  } else {
    (void)pairs, (void)mq, (void)depth, (void)v, (void)b, (void)h, (void)n0, (void)n, (void)scale, (void)amx, (void)out;
    HWY_ASSERT(false);  // Flash and FlashBackward set no pairs here
  }
}

// Whether rows [0, n) (width bfloat16 elements each, row r at rows + r·stride) all lie in
// Bf16DotScores' range (bf16_dot_range_ok), a vector at a time.
template <class D>
HWY_INLINE bool Bf16RowsInDotRange(D d, const uint16_t* rows, int64_t stride, int64_t n, int64_t width) {
  if (width >= kBf16DotMaxDepth) return false;
  if constexpr (kBf16DotTarget) {
    const hn::Repartition<uint16_t, D> du;
    const int64_t N = static_cast<int64_t>(hn::Lanes(du));
    const auto magnitude = hn::Set(du, uint16_t{0x7fff}), lowest = hn::Set(du, uint16_t{87}),
               span = hn::Set(du, uint16_t{71});
    auto bad = hn::Lt(hn::Zero(du), hn::Zero(du));  // all false
    bool bad_tail = false;
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* row = rows + r * stride;
      int64_t c = 0;
      for (; c + N <= width; c += N) {
        const auto mag = hn::And(hn::LoadU(du, row + c), magnitude);
        const auto off = hn::Sub(hn::ShiftRight<7>(mag), lowest);  // wraps below 87
        bad = hn::Or(bad, hn::AndNot(hn::Eq(mag, hn::Zero(du)), hn::Gt(off, span)));
      }
      for (; c < width; ++c) bad_tail |= !bf16_dot_range_ok(row[c]);
    }
    return !bad_tail && hn::AllFalse(du, bad);
  } else {
    (void)d, (void)rows, (void)stride, (void)n;
    return false;
  }
}

// Whether the rows of the tile that starts at t (a multiple of kTileKeys) in head (b, kvh) of
// `rows` (p.k, width Dk, or p.v, width Dv) are all in Bf16DotScores' range. The whole tile,
// whichever of its keys a block visits, so that the forward, its weights pass and the backward
// make the same choice for each (row, key), whatever the grouping of blocks or the thread count.
template <class D>
HWY_INLINE bool TileRowsInDotRange(D d, const Problem& p, const View4& rows, int64_t width, int64_t b, int64_t kvh,
                                   int64_t t) {
  const int64_t n = std::min(kTileKeys, p.keys_of(b) - t);  // keys past the sequence's length are never read
  return Bf16RowsInDotRange(d, rows.at<uint16_t>(b, kvh, t), rows.strides[2], n, width);
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_BF16_PATH_INL_H_
