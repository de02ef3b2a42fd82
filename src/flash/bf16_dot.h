// bfloat16 dot products with AVX512_BF16 (vdpbf16ps), for the forward's score tiles and the
// backward's q·kᵀ and dout·vᵀ.
//
// Why a hand-written piece: Highway 1.0.3 (Debian's) has no target with AVX512_BF16, so its
// ReorderWidenMulAccumulate for bfloat16 widens and uses float32 FMAs. vdpbf16ps multiplies 32
// pairs of bfloat16 and adds them into 16 float32 lanes per instruction: twice the products of
// a float32 FMA, read straight from bfloat16 memory. This file is the only one that uses it;
// it is compiled with a target attribute and called only after the runtime check below.
//
// Numerics: the products of two bfloat16 are exact in float32 and the sums are rounded in
// float32, as the widening path's (the same error bound, not the same bits). But the
// instruction reads subnormal inputs as 0 and flushes subnormal results, and the kernels apply
// the scale after the sum where the widening path scales q first. So it is used only where
// neither matters: every nonzero element of both operands has magnitude in [2^-40, 2^32), and
// |scale| too (or scale is 0), and the depth is below 2^24. Then every product, partial sum (a
// multiple of 2^-94) and score is 0 or a normal float32 below 2^120, in either order of the
// arithmetic (q·scale·k or q·k·scale), and the
// results differ from the widening path's by rounding only. Blocks of queries and tiles of
// keys outside that range are computed by widening (the callers check: bf16_dot_range_ok).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace sdpa::internal {

// Whether this CPU and OS run AVX512_BF16 with 512-bit vectors (cpuid and xgetbv). Checked once.
bool cpu_has_avx512_bf16();

// Whether a bfloat16 element (bits) is 0 or of magnitude in [2^-40, 2^32): exponent field
// 87 .. 158. And whether a scale is 0 or in that range.
constexpr bool bf16_dot_range_ok(uint16_t x) {
  return (x & 0x7fffu) == 0 || static_cast<uint16_t>(((x >> 7) & 0xffu) - 87u) <= 71u;
}
inline constexpr int64_t kBf16DotMaxDepth = int64_t{1} << 24;
bool bf16_dot_scale_ok(double scale);

// Packs rows l < count (row_of(l): `width` bfloat16 bit patterns) in pairs of features, the
// layout Bf16DotScores takes: pairs[c2·mq + l] holds features 2·c2 (low half) and 2·c2 + 1;
// lanes past count and the feature past an odd width are 0. Returns whether every element is
// in bf16_dot_range_ok's range (if not, the pairs are not to be used).
template <class RowOf>
bool pack_bf16_pairs(const RowOf& row_of, int64_t count, int64_t width, size_t mq, uint32_t* pairs) {
  if (width >= kBf16DotMaxDepth) return false;
  std::fill(pairs, pairs + (width + 1) / 2 * static_cast<int64_t>(mq), 0u);
  for (int64_t l = 0; l < count; ++l) {
    const uint16_t* row = row_of(l);
    for (int64_t c = 0; c < width; ++c) {
      const uint16_t x = row[c];
      if (!bf16_dot_range_ok(x)) return false;
      pairs[c / 2 * static_cast<int64_t>(mq) + l] |= static_cast<uint32_t>(x) << (16 * (c % 2));
    }
  }
  return true;
}

// st[j·mq + lane] = scale · Σ_c k_j[c] · q_lane[c] for keys j < n and lanes < mq (16 or 32),
// with the block's queries packed in pairs of features: qp[c2·mq + lane] holds q_lane[2·c2] in
// its low half and q_lane[2·c2 + 1] (0 past dk) in its high half. k: bfloat16 bits, key j's
// row at k + j·k_stride (elements; the stride may be negative). qp and st 64-byte aligned.
// Only after cpu_has_avx512_bf16() returned true.
void Bf16DotScores(const uint32_t* qp, size_t mq, int64_t dk, const uint16_t* k, int64_t k_stride, int64_t n,
                   float scale, float* st);

// Options::precision kFast's p·V with vdpbf16ps, for a tile of keys k0 + [0, n) (forward_block-
// inl.h): the weights are bfloat16 values held in float32 (RoundWeights), so the products are
// exact and only their sums round, in float32. Range: p in [2^-126, 1] or 0 (ExpNormal's), and
// the tile's values in bf16_dot_range_ok's range (checked by the caller), so every product is
// 0 or at least 2^-166: one below 2^-126 is flushed to 0 by the instruction, an error below
// 2^-126 · n relative to the largest |v|, far under the tolerance floor. (The scores path needs
// more care because q·k can cancel; a weight is never negative.)
//
// vp[j2·dv + e] = v_{2·j2}[e] | v_{2·j2+1}[e] << 16 for the tile's rows [0, n) (bfloat16 bits,
// row r at v + r·v_stride, elements; the high half 0 past an odd n): the value pairs, packed
// once per tile for every block that reads it.
void PackBf16ValuePairs(const uint16_t* v, int64_t v_stride, int64_t n, int64_t dv, uint32_t* vp);
// ot[e·mq + lane] = alpha[lane] · ot[e·mq + lane] + Σ_j p[(j - first)·mq + lane] · v_j[e] for
// the tile's keys j in [first, first + n) and e < dv: p (key-major, mq = 16 or 32 lanes, 64-byte
// aligned) holds bfloat16 values; vp from PackBf16ValuePairs; pp scratch of
// ((n + 1) / 2 + 1) · mq words, 64-byte aligned. Only after cpu_has_avx512_bf16() returned true.
void Bf16DotAccumulate(const float* p, size_t mq, int64_t first, int64_t n, const uint32_t* vp, int64_t dv,
                       const float* alpha, uint32_t* pp, float* ot);
// Bf16DotAccumulate's sum with the weights already in pairs (PackBf16WeightPairs' layout).
void Bf16DotAccumulatePacked(const uint32_t* pp, size_t mq, int64_t first, int64_t n, const uint32_t* vp, int64_t dv,
                             const float* alpha, float* ot);
// The weights of keys [first, first + n) in pairs, as both p·V products take them: pp[(j2 -
// first / 2)·mq + lane] holds p of key 2·j2 (low half) and 2·j2 + 1 for the pairs j2 from
// first / 2 to (first + n + 1) / 2, 0 for a key outside the range. p and pp as above.
void PackBf16WeightPairs(const float* p, size_t mq, int64_t first, int64_t n, uint32_t* pp);

// The backward's one-pass dq += ds · k in kFast, with the ds tile as KeyBlockGrads holds it:
// acc[r·width + c] += Σ_{l < nk} w[r·mq + l] · k_l[c] for rows r < n and c < dk (acc rows
// `width` apart, width a multiple of 16, 64-byte aligned), w holding bfloat16 values in
// float32 (0 past nk), the keys in pairs in kp (PackBf16KeyPairs, with kp_pairs = mq / 2; keys
// in bf16_dot_range_ok's range, the caller checks). wp: n · (mq / 2) words of scratch (rows
// rounded up to 16 for AmxDsKeys), 64-byte aligned. Only after cpu_has_avx512_bf16() returned
// true.
void Bf16DsKeys(const float* w, size_t mq, int64_t n, int64_t nk, const uint32_t* kp, int64_t width, uint32_t* wp,
                float* acc);
// Bf16DsKeys' keys in pairs, packed once per block of keys for every row that takes them:
// kp[l2·width + c] = k_{2·l2}[c] | k_{2·l2+1}[c] << 16 for l2 < kp_pairs (rows at k + l·k_stride;
// 0 for c >= dk and for keys past nk). Only after cpu_has_avx512_bf16() returned true.
void PackBf16KeyPairs(const uint16_t* k, int64_t k_stride, int64_t nk, int64_t dk, int64_t width, int64_t kp_pairs,
                      uint32_t* kp);
// Bf16DsKeys' weights in pairs: wp[r·(mq / 2) + l2] = the bfloat16 tops of w[r·mq + 2·l2] (low
// half) and w[r·mq + 2·l2 + 1] for rows r < n. Only after cpu_has_avx512_bf16() returned true.
void PackBf16DsWeightPairs(const float* w, size_t mq, int64_t n, uint32_t* wp);

// AMX (amx_dot.cc): whether this CPU has AMX-TILE and AMX-BF16, the OS saves the tile state and
// grants it to this process (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked once, here).
bool cpu_has_amx_bf16();
// Bf16DotScores' result with TDPBF16PS: the same layout, arguments and range rules; the same
// error bound, other bits. Only after cpu_has_amx_bf16() returned true.
void AmxDotScores(const uint32_t* qp, size_t mq, int64_t dk, const uint16_t* k, int64_t k_stride, int64_t n,
                  float scale, float* st);

// Bf16DsKeys' sum with TDPBF16PS (the same arguments, layout and range rules; other bits), for
// mq = 32: C tiles of 16 rows × 16 columns of acc, loaded and stored in place, A = 16 rows' 16
// weight pairs (the block's 32 key lanes), B = kp's 16 key pairs × 16 columns. Other mq: Bf16DsKeys.
// Only after cpu_has_amx_bf16() returned true.
void AmxDsKeys(const float* w, size_t mq, int64_t n, int64_t nk, const uint32_t* kp, int64_t width, uint32_t* wp,
               float* acc);

// kFast's p·V on AMX tiles: Bf16DotAccumulate's result (the same arguments, range rules and
// error bound, other bits) with C tiles of 16 value columns × 16 lanes, A = the tile's values
// transposed (16 columns × 32 keys), B = the weight pairs (16 key pairs × 16 lanes). vt as
// PackAmxValuePairs made it; pp as Bf16DotAccumulate's.
inline constexpr int64_t kAmxPairsRow = 80;  // words per column of vt: a tile's 64 key pairs and
                                             // 16 of zeros, so a last A tile never reads past it
// vt[e·pitch + j2] = v_{2·j2}[e] | v_{2·j2+1}[e] << 16 for e below dv rounded up to 16 and
// j2 < pitch (bfloat16 bits, row r at v + r·v_stride; 0 past n and dv): PackBf16ValuePairs'
// words (made 128 rows at a time in vp, its scratch of 64 · dv words), transposed 16 × 16 at a
// time. pitch: at least (n + 1) / 2 rounded up to 16, plus 16 (kAmxPairsRow for n ≤ 128).
void PackAmxValuePairs(const uint16_t* v, int64_t v_stride, int64_t n, int64_t dv, uint32_t* vp, uint32_t* vt,
                       int64_t pitch = kAmxPairsRow);
// (AmxDotAccumulate*: vt's columns pitch words apart, as PackAmxValuePairs made them.)
void AmxDotAccumulate(const float* p, size_t mq, int64_t first, int64_t n, const uint32_t* vt, int64_t dv,
                      const float* alpha, uint32_t* pp, float* ot, int64_t pitch = kAmxPairsRow);
// AmxDotAccumulate's sum with the weights already in pairs (PackBf16WeightPairs), as `parts`
// tiles of pairs part_words apart (each at least 64 · mq words), whose products are all summed
// in the same C tiles before the one alpha · ot + C: kExact's p = p1 + p2 + p3 on AMX.
void AmxDotAccumulatePacked(uint32_t* pp, int parts, int64_t part_words, size_t mq, int64_t first, int64_t n,
                            const uint32_t* vt, int64_t dv, const float* alpha, float* ot,
                            int64_t pitch = kAmxPairsRow);
inline int64_t amx_value_pairs_size(int64_t dv) { return (dv + 15) / 16 * 16 * kAmxPairsRow; }

// The tile configuration (LDTILECFG) is loaded once per thread and call, not per product: an
// AmxScope on a thread's stack for the span of a call's work keeps it loaded between the Amx*
// products it makes (they reload it only to switch between the layouts they need) and releases
// the tiles when it ends. A product called without one loads and releases the tiles itself.
// (Per call, not per thread: other code on the thread, oneDNN in PyTorch, may load its own.)
class AmxScope {
 public:
  explicit AmxScope(bool on);
  ~AmxScope();
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;

 private:
  bool on_;
};

}  // namespace sdpa::internal
