// The few-rows kernel (decode: one or a few query rows per kv head against long K/V),
// compiled per SIMD target; included by flash-inl.h. With few rows the lanes-are-queries
// layout of RunBlocks leaves most lanes idle and spends a broadcast per key and feature, so
// here lanes run along the features instead:
//   scores  s[r][j] = Σ_lanes q_r[d..d+N) · k_j[d..d+N)     (one horizontal sum per key)
//   output  o_r[e..e+N) += p[r][j] · v_j[e..e+N)             (rows of V loaded once per key)
// K and V rows are each read once per block (up to kDecodeMaxRows rows, e.g. all query heads of
// a GQA group): the kernel streams memory. 16-bit K and V are widened in registers as they are
// loaded (storage type S, compute type T): the bytes streamed are half float32's, and no
// scratch copy of the tile is written and read again. 8-bit K/V (KVQuant views) are
// dequantised in registers the same way (rows-inl.h's RowReader), a quarter of the bytes.
// It produces the same (ot, m, l) as RunBlocks, so finishing and chunk merging are shared.

#if defined(SDPA_FLASH_DECODE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_DECODE_INL_H_
#undef SDPA_FLASH_DECODE_INL_H_
#else
#define SDPA_FLASH_DECODE_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "flash/flash_plan.h"
#include "flash/products-inl.h"
#include "flash/row_stats.h"
#include "flash/rows-inl.h"
#include "flash/score_tile-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Feature vectors per DecodeValues call for R rows: 4, 2 or 1, the most that keep its R·C
// accumulators and C value vectors in registers (AVX2: 4 up to three rows, 2 up to seven;
// AVX-512: 4 up to seven rows).
template <int64_t R>
inline constexpr int64_t kDecodeChunk = (R + 1) * 4 <= kVectorRegisters ? 4 : (R + 1) * 2 <= kVectorRegisters ? 2 : 1;

// sums[r] = Σ of acc[r]'s lanes for r < R, bit for bit GetLane(SumOfLanes(d, acc[r])): the
// same tree as Highway's x86 reductions (halves added at lane distance N/2, N/4, ..., 1).
// Four rows share each shuffle and add of the tree on AVX-512 and AVX2 (13 and 10 instructions
// for four rows where four SumOfLanes take about 40 and 28): the few-rows kernel sums one
// vector per key and row, a fifth of an 8-bit decode's instructions. Fewer than 3 rows, other
// targets and float64: one SumOfLanes each.
template <int64_t R, class D, typename T = hn::TFromD<D>>
HWY_INLINE void SumsOfLanes(D d, const hn::Vec<D>* HWY_RESTRICT acc, T* HWY_RESTRICT sums) {
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
  if constexpr (std::is_same_v<T, float> && sizeof(hn::Vec<D>) == 64 && R >= 3) {
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      __m512 a[4];
      for (int64_t i = 0; i < 4; ++i) a[i] = r0 + i < R ? acc[r0 + i].raw : _mm512_setzero_ps();
      // Distance 8: [a0's lanes 0-7 + 8-15, a1's] and [a2's, a3's].
      const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
      const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
      // Distance 4: block i (4 lanes) holds row r0 + i.
      const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
      const __m512 z = _mm512_add_ps(y, _mm512_permute_ps(y, 0x4E));  // distance 2
      const __m512 w = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));  // distance 1: lane 4i is row r0 + i's sum
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, w);
      for (int64_t i = 0; i < 4 && r0 + i < R; ++i) sums[r0 + i] = lanes[4 * i];
    }
    return;
  }
#elif HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
  if constexpr (std::is_same_v<T, float> && sizeof(hn::Vec<D>) == 32 && R >= 3) {
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      __m256 a[4];
      for (int64_t i = 0; i < 4; ++i) a[i] = r0 + i < R ? acc[r0 + i].raw : _mm256_setzero_ps();
      // Distance 4: [a0's lanes 0-3 + 4-7, a1's] and [a2's, a3's].
      const __m256 x01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
      const __m256 x23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
      // Distance 2: lanes 0-1 row r0, 2-3 row r0 + 2, 4-5 row r0 + 1, 6-7 row r0 + 3.
      const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x01, x23, 0x44), _mm256_shuffle_ps(x01, x23, 0xEE));
      const __m256 w = _mm256_add_ps(y, _mm256_permute_ps(y, 0xB1));  // distance 1
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, w);
      constexpr int kLane[4] = {0, 4, 2, 6};
      for (int64_t i = 0; i < 4 && r0 + i < R; ++i) sums[r0 + i] = lanes[kLane[i]];
    }
    return;
  }
#endif
  for (int64_t r = 0; r < R; ++r) sums[r] = hn::GetLane(hn::SumOfLanes(d, acc[r]));
}

// Streaming K and V is the whole cost of a decode step: while key j0 + j computes, ask for its
// value row (read in step 4, when `values` is given) and for the key row a tile ahead (row
// j0 + kTileKeys + j, in its storage dtype), so both arrive while this tile computes. A
// paged pool's rows are followed from page to page (one address lookup per page).
template <typename S>
struct StreamAhead {
  const Problem& p;
  const BlockRows& blk;
  int64_t j0;
  const Rows<S>* values;
  int64_t k_bytes, v_bytes, ks_bytes;
  // (A pointer past the tensor, or through a table entry past the sequence, would be undefined, even unread.)
  int64_t ahead_end;
  const char* run = nullptr;  // the row run_first of the page being prefetched
  int64_t run_first = 0, run_stop = 0;
  StreamAhead(const Problem& p_, const BlockRows& blk_, int64_t j0_, const Rows<S>* values_)
      : p(p_), blk(blk_), j0(j0_), values(values_), k_bytes(p_.Dk * storage_bytes(p_.k.dtype)),
        v_bytes(p_.Dv * storage_bytes(p_.v.dtype)), ks_bytes(p_.k.strides[2] * storage_bytes(p_.k.dtype)),
        ahead_end(p_.k.paged() ? p_.keys_of(blk_.b) : p_.Nk) {}
  HWY_INLINE void operator()(int64_t j) {
    if (const int64_t r = j0 + kTileKeys + j; r < ahead_end) {
      if (r >= run_stop) {
        run = static_cast<const char*>(p.k.ptr(blk.b, blk.kvh, r, 0));
        run_first = r;
        run_stop = p.k.run_end(r);
      }
      const char* next = run + (r - run_first) * ks_bytes;
      for (int64_t c = 0; c < k_bytes; c += 64) hwy::Prefetch(next + c);
    }
    if (values != nullptr) {
      const char* vj = reinterpret_cast<const char*>(values->row(j));
      for (int64_t c = 0; c < v_bytes; c += 64) hwy::Prefetch(vj + c);
    }
  }
};

// s[r][j] for keys [j0, j0 + n) (rows of `keys`, key j0 first): scaled dot products (q is
// pre-scaled), then causal/window edges and the mask; the row is padded with -inf to whole
// vectors. Each score depends only on (row, key), so the weights pass recomputes exactly the
// scores the forward pass saw. `prefetch_values`: V is read after this.
template <int64_t R, class D, typename S, typename T = hn::TFromD<D>>
HWY_INLINE void DecodeScores(D d, const Problem& p, const BlockRows& blk, const LaneRow* lanes,
                             const T* HWY_RESTRICT q, int64_t dkp, int64_t j0, int64_t n, const Rows<S>& keys,
                             const Rows<S>* prefetch_values, T* HWY_RESTRICT st) {
  using V = hn::Vec<D>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t dk_full = p.Dk / N * N;
  StreamAhead<S> ahead(p, blk, j0, prefetch_values);
  // 1. Scores, one key at a time for all R rows.
  for (int64_t j = 0; j < n; ++j) {
    const RowReader<S, T> kj(keys, j);
    ahead(j);
    V acc[R];
#pragma GCC unroll 8  // fully unrolled, the accumulators stay in registers
    for (int64_t r = 0; r < R; ++r) acc[r] = hn::Zero(d);
#pragma GCC unroll 2
    for (int64_t c = 0; c < dk_full; c += N) {
      const V kv = kj.Load(d, c);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) acc[r] = hn::MulAdd(hn::Load(d, q + r * dkp + c), kv, acc[r]);
    }
    T dots[R];
    SumsOfLanes<R>(d, acc, dots);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      T dot = dots[r];
      for (int64_t c = dk_full; c < p.Dk; ++c) dot += q[r * dkp + c] * kj.At(c);
      st[r * kTileKeys + j] = dot;
    }
  }
  // 2. Causal/window edges and the mask (scalar: per element, but only O(R·n)); then -inf up
  //    to whole vectors for the softmax below.
  MaskScores<1, TileLayout::kRowMajor>(d, p, blk.b, lanes, R, j0, n, /*edges=*/true, st, kTileKeys, static_cast<T*>(nullptr));
  for (int64_t r = 0; r < R; ++r) std::fill(st + r * kTileKeys + n, st + r * kTileKeys + (n + N - 1) / N * N, neg_inf);
}

// Transposes the N × N block r (row x: N consecutive features of key x) in place, so that
// r[c] holds feature c of the N keys. AVX-512 (16 lanes) and AVX2 (8) only.
template <class D>
HWY_INLINE void TransposeSquare(D, hn::Vec<D>* r) {
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
  if constexpr (std::is_same_v<hn::TFromD<D>, float> && sizeof(hn::Vec<D>) == 64) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {  // per 128-bit block b: keys 2i, 2i + 1 of features 4b, 4b + 1 (lo), 4b + 2, 4b + 3 (hi)
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i].raw, r[2 * i + 1].raw);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i].raw, r[2 * i + 1].raw);
    }
    for (int i = 0; i < 4; ++i) {  // u[4i + c] block b: keys 4i..4i + 3 of feature 4b + c
      u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {  // feature 4b + c: block b of u[c], u[4 + c], u[8 + c], u[12 + c]
      const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
      const __m512 x2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44), x3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
      r[c].raw = _mm512_shuffle_f32x4(x0, x2, 0x88);
      r[4 + c].raw = _mm512_shuffle_f32x4(x0, x2, 0xDD);
      r[8 + c].raw = _mm512_shuffle_f32x4(x1, x3, 0x88);
      r[12 + c].raw = _mm512_shuffle_f32x4(x1, x3, 0xDD);
    }
  }
#elif HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
  if constexpr (std::is_same_v<hn::TFromD<D>, float> && sizeof(hn::Vec<D>) == 32) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i].raw, r[2 * i + 1].raw);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i].raw, r[2 * i + 1].raw);
    }
    for (int i = 0; i < 2; ++i) {
      u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      r[c].raw = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
      r[4 + c].raw = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
  }
#else
  (void)r;
#endif
}

// Whether TransposeSquare transposes on this target and type.
template <class D>
inline constexpr bool kCanTransposeSquare =
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
    std::is_same_v<hn::TFromD<D>, float> && sizeof(hn::Vec<D>) == 64;
#elif HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
    std::is_same_v<hn::TFromD<D>, float> && sizeof(hn::Vec<D>) == 32;
#else
    false;
#endif

// DecodeScores in the block kernel's order (Options::batch_invariant): each score is one
// fused multiply-add chain over the features in order, from 0, as OuterScores computes it with
// rows along the lanes (k[j][c] · q[c] = q[c] · k[j][c] exactly), so a row's scores have the
// same bits in a decode step as in any block of a prefill. Here keys run along the lanes: N
// keys at a time are transposed into kt (Dk × N, features as RowReader reads them), and each
// row's q[c] is broadcast against kt[c]; the few-rows kernel's use of every lane stays. (The
// products straight from the transposed registers, without kt, measured slower: 15.3-15.6 ms
// against 14.1-14.3 on the bench's float32 decode case.)
template <int64_t R, class D, typename S, typename T = hn::TFromD<D>>
HWY_INLINE void DecodeScoresBlockOrder(D d, const Problem& p, const BlockRows& blk, const LaneRow* lanes,
                                       const T* HWY_RESTRICT q, int64_t dkp, int64_t j0, int64_t n,
                                       const Rows<S>& keys, const Rows<S>* prefetch_values, T* HWY_RESTRICT st,
                                       T* HWY_RESTRICT kt) {
  using V = hn::Vec<D>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dk_full = kCanTransposeSquare<D> ? p.Dk / N * N : 0;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  StreamAhead<S> ahead(p, blk, j0, prefetch_values);
  for (int64_t g = 0; g < n; g += N) {
    const int64_t m = std::min(N, n - g);  // keys of this group; lanes past them read 0
    RowReader<S, T> rd[hn::MaxLanes(d)];
    for (int64_t x = 0; x < m; ++x) {
      rd[x] = RowReader<S, T>(keys, g + x);
      ahead(g + x);
    }
    for (int64_t c = 0; c < dk_full; c += N) {
      V r[hn::MaxLanes(d)];
      for (int64_t x = 0; x < N; ++x) r[x] = x < m ? rd[x].Load(d, c) : hn::Zero(d);
      TransposeSquare(d, r);
      for (int64_t x = 0; x < N; ++x) hn::Store(r[x], d, kt + (c + x) * N);
    }
    for (int64_t c = dk_full; c < p.Dk; ++c)
      for (int64_t x = 0; x < N; ++x) kt[c * N + x] = x < m ? rd[x].At(c) : T(0);
    V acc[R];
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) acc[r] = hn::Zero(d);
    for (int64_t c = 0; c < p.Dk; ++c) {
      const V kc = hn::Load(d, kt + c * N);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) acc[r] = hn::MulAdd(kc, hn::Set(d, q[r * dkp + c]), acc[r]);
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) hn::Store(acc[r], d, st + r * kTileKeys + g);
  }
  MaskScores<1, TileLayout::kRowMajor>(d, p, blk.b, lanes, R, j0, n, /*edges=*/true, st, kTileKeys, static_cast<T*>(nullptr));
  for (int64_t r = 0; r < R; ++r) std::fill(st + r * kTileKeys + n, st + r * kTileKeys + (n + N - 1) / N * N, neg_inf);
}

// o[r][0..C·N) = alpha[r] · o[r][..] + Σ_j p[r][j] · v_j[0..C·N): R×C accumulators; each
// chunk of a value row is loaded once for all R rows. A value row flagged in v_bad (NaN or
// inf) adds only its finite entries, and nothing to rows that give its key weight 0.
template <int64_t R, int64_t C, class D, typename S, typename T = hn::TFromD<D>>
HWY_INLINE void DecodeValues(D d, const T* HWY_RESTRICT p, int64_t keys, const Rows<S>& values, int64_t e0,
                             const T* alpha, T* HWY_RESTRICT o, int64_t dvp, const uint8_t* v_bad) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<D> acc[R][C];
  for (int64_t r = 0; r < R; ++r) {
    const auto a = hn::Set(d, alpha[r]);
    for (int64_t c = 0; c < C; ++c) acc[r][c] = Rescale(d, hn::Load(d, o + r * dvp + c * N), a);
  }
  for (int64_t j = 0; j < keys; ++j) {
    hn::Vec<D> vv[C];
    const RowReader<S, T> v(values, j);
    for (int64_t c = 0; c < C; ++c) vv[c] = v.Load(d, e0 + c * N);
    const bool bad = v_bad != nullptr && v_bad[j];  // v_bad is null on the common path
    if (bad) {  // its non-finite entries go through `bad` scores (flash_plan.h), not the sums
      for (int64_t c = 0; c < C; ++c) vv[c] = hn::IfThenZeroElse(hn::IsNaN(hn::Mul(vv[c], hn::Zero(d))), vv[c]);
    }
    for (int64_t r = 0; r < R; ++r) {
      if (bad && p[r * kTileKeys + j] == T(0)) continue;
      const auto pj = hn::Set(d, p[r * kTileKeys + j]);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = hn::MulAdd(pj, vv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) hn::Store(acc[r][c], d, o + r * dvp + c * N);
}

// Outputs::stats of row r's scores of a tile (keys j0.., padded with -inf to n_vec) before its
// max m_old moves (row_stats.h): allowed keys, the first key of the tile's max where it beats
// m_old, and top-k offers where a score beats the row's threshold.
template <class D, typename T = hn::TFromD<D>>
HWY_NOINLINE void DecodeRowStats(D d, const LaneStats<T>& ls, int64_t r, const T* HWY_RESTRICT row, int64_t n_vec,
                                 int64_t j0, T m_old) {
  using V = hn::Vec<D>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const V neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  V mx = neg_inf;
  int64_t count = 0;
  for (int64_t j = 0; j < n_vec; j += N) {
    const V s = hn::Load(d, row + j);
    mx = hn::Max(mx, s);
    count += static_cast<int64_t>(hn::CountTrue(d, hn::Gt(s, neg_inf)));
    if (ls.k > 0 && !hn::AllFalse(d, hn::Gt(s, hn::Set(d, ls.threshold(r))))) {
      for (int64_t x = 0; x < N; ++x) ls.offer(r, row[j + x], j0 + j + x);
    }
  }
  ls.allowed()[r] += count;
  const T tile_max = hn::GetLane(hn::MaxOfLanes(d, mx));
  if (tile_max > m_old) {  // strict: an earlier key at the same max stays
    int64_t j = 0;
    while (!(row[j] == tile_max)) ++j;
    ls.argmax()[r] = j0 + j;
  }
}

// Rows [row0, row0 + R) of the block: R·Dk queries (pre-scaled, zero-padded to whole
// vectors) in q, R·Dvp output accumulators in o, R·kTileKeys scores in st. K and V are read in
// place in their storage type S; vtile: scratch for a tile of V rows widened to T, used only
// when a tile is redone (below).
// kBlockOrder (Options::batch_invariant): every sum in the block kernel's order, so that a row's
// bits do not depend on whether its block took this kernel (DecodeScoresBlockOrder; each
// row's weights summed in key order and l fused as BlockTile does; p·V's chains are the same in
// both kernels already). Never with statistics (make_plan).
template <int64_t R, bool kBlockOrder, class D, typename S, typename T = hn::TFromD<D>>
void DecodeRows(D d, S, const Problem& p, const BlockRows& blk, const LaneRow* lanes, const LaneSpan& span,
                const T* HWY_RESTRICT q, int64_t dkp, T* HWY_RESTRICT o, int64_t dvp, T* HWY_RESTRICT st, T* m_out,
                T* l_out, T* HWY_RESTRICT vtile, T* HWY_RESTRICT o_prev, T* bad, int64_t mq, const LaneStats<T>& stats) {
  using V = hn::Vec<D>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t dv_full = p.Dv / N * N;
  T m[R], l[R];
  for (int64_t r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0;
  }
  std::fill(o, o + R * dvp, T(0));

  const S* key_ptrs[kTileKeys];  // a paged pool's rows of the tile (RowsInPlace)
  const S* value_ptrs[kTileKeys];
  const float* quant_ptrs[4][kTileKeys];  // 8-bit K/V: the rows' scales and zero points (k, v)
  hwy::AlignedFreeUniquePtr<T[]> kt;  // kBlockOrder: a group of keys transposed, Dk × N
  if constexpr (kBlockOrder) kt = hwy::AllocateAligned<T>(static_cast<size_t>(std::max<int64_t>(p.Dk, 1) * N));
  const auto score = [&](const Rows<S>& keys, const Rows<S>* prefetch_values, int64_t j0, int64_t n, T* out) {
    if constexpr (kBlockOrder) {
      DecodeScoresBlockOrder<R>(d, p, blk, lanes, q, dkp, j0, n, keys, prefetch_values, out, kt.get());
    } else {
      DecodeScores<R>(d, p, blk, lanes, q, dkp, j0, n, keys, prefetch_values, out);
    }
  };
  for (int64_t t = tile_start(span.begin); t < span.end; t += kTileKeys) {
    const int64_t j0 = std::max(t, span.begin);
    const int64_t n = std::min(t + kTileKeys, span.end) - j0;
    // A tile the block mask blocks for every row changes no sum: skipped unread.
    if (p.block_mask && !lanes_see_keys(p, blk.b, lanes, R, j0, j0 + n)) continue;
    const Rows<S> keys = QuantRowsInPlace(p.k, blk.b, blk.kvh, j0, n, key_ptrs, quant_ptrs[0], quant_ptrs[1]);
    const Rows<S> values = QuantRowsInPlace(p.v, blk.b, blk.kvh, j0, n, value_ptrs, quant_ptrs[2], quant_ptrs[3]);
    score(keys, &values, j0, n, st);
    // 3. Online softmax per row: p = exp(s - max), rescale what came before by alpha. The rules
    //    are BlockTile's, one piece each (score_tile-inl.h: ShiftedExp, AddTTerm,
    //    RescaleFactor); by default the sums are not: here p is summed per lane then across
    //    lanes, and l and t are rescaled with a multiply then an add, where BlockTile sums down
    //    lanes and fuses them (one order for both would change decode's default bits, which
    //    issue 27 forbids). kBlockOrder takes BlockTile's order (after this loop).
    const int64_t n_vec = (n + N - 1) / N * N;
    T alpha[R];
    bool nan_row[R];
    for (int64_t r = 0; r < R; ++r) {
      T* row = st + r * kTileKeys;
      V mx = hn::Set(d, neg_inf);
      auto nan = hn::IsNaN(mx);  // no lane yet: Max and Exp drop NaN, so NaN scores are flagged
      for (int64_t j = 0; j < n_vec; j += N) {
        const V s = hn::Load(d, row + j);
        mx = hn::Max(mx, s);
        nan = hn::Or(nan, hn::IsNaN(s));
      }
      const T mnew = std::max(m[r], hn::GetLane(hn::MaxOfLanes(d, mx)));
      const T msafe = mnew == neg_inf ? T(0) : mnew;  // nothing allowed yet: exp(-inf - 0) = 0
      const V vmsafe = hn::Set(d, msafe);
      if (stats.reals != nullptr) DecodeRowStats(d, stats, r, row, n_vec, j0, m[r]);
      // A max of +inf (a score overflowed): shifted_exp's rule, exp(s - m) = 1 where s == m.
      const bool inf_max = mnew == std::numeric_limits<T>::infinity();
      V sum = hn::Zero(d), tsum = hn::Zero(d);
      // With statistics, also t's Σ p · (s - m) (row_stats.h), in a loop of its own.
      // kFast (Problem::round_p): each p rounded to q's 16-bit type before it is summed.
      const auto exp_row = [&](auto inf_max_const, auto stats_const, auto round_const) {
        constexpr bool kInfMax = decltype(inf_max_const)::value;
        constexpr Round16 kRound = decltype(round_const)::value;
        for (int64_t j = 0; j < n_vec; j += N) {
          const V s = hn::Load(d, row + j);
          const V pj = RoundWeights<kRound>(d, ShiftedExp<kInfMax, kRound != Round16::kNone>(d, s, vmsafe));
          sum = hn::Add(sum, pj);
          if constexpr (decltype(stats_const)::value) tsum = AddTTerm<kInfMax>(d, pj, s, vmsafe, tsum);
          hn::Store(pj, d, row + j);
        }
      };
      using NoRounding = std::integral_constant<Round16, Round16::kNone>;
      if (stats.reals != nullptr) {  // never with kFast (run_forward)
        inf_max ? exp_row(std::true_type{}, std::true_type{}, NoRounding{})
                : exp_row(std::false_type{}, std::true_type{}, NoRounding{});
      } else if (std::is_same_v<T, float> && p.round_p) {
        WithRound16(p, [&](auto round) {
          inf_max ? exp_row(std::true_type{}, std::false_type{}, round) : exp_row(std::false_type{}, std::false_type{}, round);
        });
      } else {
        inf_max ? exp_row(std::true_type{}, std::false_type{}, NoRounding{})
                : exp_row(std::false_type{}, std::false_type{}, NoRounding{});
      }
      alpha[r] = hn::GetLane(RescaleFactor(d, hn::Set(d, m[r]), vmsafe));
      if (stats.reals != nullptr) {
        stats.t()[r] = rescale_t(stats.t()[r], m[r], msafe, l[r], alpha[r]) + hn::GetLane(hn::SumOfLanes(d, tsum));
      }
      nan_row[r] = !hn::AllFalse(d, nan);
      if constexpr (!kBlockOrder) {
        l[r] = l[r] * alpha[r] + hn::GetLane(hn::SumOfLanes(d, sum));
        if (nan_row[r]) l[r] = std::numeric_limits<T>::quiet_NaN();  // out and lse become NaN
      }
      m[r] = mnew;
    }
    if constexpr (kBlockOrder) {  // BlockTile's sums: a row's weights in key order from 0, l fused
      T sums[R];
      for (int64_t r = 0; r < R; ++r) sums[r] = T(0);
      for (int64_t j = 0; j < n; ++j)  // the rows' chains interleaved: each add waits on its row's last
        for (int64_t r = 0; r < R; ++r) sums[r] += st[r * kTileKeys + j];
      for (int64_t r = 0; r < R; ++r) {
        l[r] = nan_row[r] ? std::numeric_limits<T>::quiet_NaN() : std::fma(l[r], alpha[r], sums[r]);
      }
    }
    if (p.dropout.enabled()) {  // after the sums: the softmax normalises the undropped weights
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < n; ++j) st[r * kTileKeys + j] *= p.dropout.factor<T>(blk.b, lanes[r].h, lanes[r].i, j0 + j);
    }
    // 4. o_r = alpha_r · o_r + Σ_j p[r][j] · v_j, in chunks of C (then 1) vectors of features.
    //    A value row holding NaN or inf must not reach a row that gives its key weight 0
    //    (0 · NaN). Scanning every tile of V for them would cost a second pass (decode streams
    //    V: ~10 %), so the tile runs unchecked from a copy of o, and only if some o came out
    //    non-finite are V's bad rows flagged and the tile redone (from V widened to T in
    //    vtile), skipping them where p = 0.
    const auto accumulate = [&](const auto& values, const uint8_t* bad) {
      constexpr int64_t C = kDecodeChunk<R>;
      int64_t e0 = 0;
      for (; e0 + C * N <= dv_full; e0 += C * N) {
        DecodeValues<R, C>(d, st, n, values, e0, alpha, o + e0, dvp, bad);
      }
      for (; e0 < dv_full; e0 += N) DecodeValues<R, 1>(d, st, n, values, e0, alpha, o + e0, dvp, bad);
      for (int64_t r = 0; r < R; ++r) {  // feature tail (Dv % N)
        for (int64_t e = dv_full; e < p.Dv; ++e) {
          T acc = rescale(o[r * dvp + e], alpha[r]);
          for (int64_t j = 0; j < n; ++j) {
            using Stored = std::remove_cv_t<std::remove_pointer_t<decltype(values.data)>>;
            const T x = RowReader<Stored, T>(values, j).At(e);
            if (bad && bad[j] && (st[r * kTileKeys + j] == T(0) || !std::isfinite(x))) continue;
            if constexpr (kBlockOrder) {
              acc = std::fma(x, st[r * kTileKeys + j], acc);  // AccumulateValues' fused chain
            } else {
              acc += st[r * kTileKeys + j] * x;
            }
          }
          o[r * dvp + e] = acc;
        }
      }
    };
    std::copy(o, o + R * dvp, o_prev);
    accumulate(values, nullptr);
    if (AnyNonFinite(d, o, R * dvp)) {
      const Rows<T> wide = ReadRows(d, p.v, blk.b, blk.kvh, j0, n, p.Dv, vtile);
      uint8_t v_bad[kTileKeys];
      if (FlagNonFiniteRows(d, wide.data, wide.stride, n, p.Dv, v_bad)) {
        std::copy(o_prev, o_prev + R * dvp, o);
        accumulate(wide, v_bad);
        // The bad rows' scores (recomputed: st holds p now, and each score is a function of
        // (row, key) alone, so these are the same bits) go to `bad`.
        T scores[R * kTileKeys];
        score(keys, /*prefetch_values=*/nullptr, j0, n, scores);
        for (int64_t j = 0; j < n; ++j) {
          if (!v_bad[j]) continue;
          for (int64_t r = 0; r < R; ++r) {
            if (p.dropout.enabled() && p.dropout.factor<T>(blk.b, lanes[r].h, lanes[r].i, j0 + j) == T(0)) continue;
            record_bad_row(wide.row(j), p.Dv, scores[r * kTileKeys + j], mq, r, bad);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    m_out[r] = m[r] == neg_inf ? T(0) : m[r];
    l_out[r] = l[r];
  }
}

// Weights w = exp(s - m) / l for R rows whose final max m and sum l are known.
template <int64_t R, class D, typename S, typename T = hn::TFromD<D>>
void DecodeWeights(D d, S, const Problem& p, const BlockRows& blk, const LaneRow* lanes, const LaneSpan& span,
                   const T* HWY_RESTRICT q, int64_t dkp, T* HWY_RESTRICT st, const T* m, const T* l) {
  for (int64_t r = 0; r < R; ++r) {
    WeightsRow<T>{p, blk.b, lanes[r].h, lanes[r].i}.clear();
  }
  const S* key_ptrs[kTileKeys];
  const float* quant_ptrs[2][kTileKeys];  // 8-bit K: the rows' scales and zero points
  for (int64_t t = tile_start(span.begin); t < span.end; t += kTileKeys) {
    const int64_t j0 = std::max(t, span.begin);
    const int64_t n = std::min(t + kTileKeys, span.end) - j0;
    if (p.block_mask && !lanes_see_keys(p, blk.b, lanes, R, j0, j0 + n)) continue;  // weights stay 0
    const Rows<S> keys = QuantRowsInPlace(p.k, blk.b, blk.kvh, j0, n, key_ptrs, quant_ptrs[0], quant_ptrs[1]);
    DecodeScores<R>(d, p, blk, lanes, q, dkp, j0, n, keys, /*prefetch_values=*/static_cast<const Rows<S>*>(nullptr), st);
    for (int64_t r = 0; r < R; ++r) {
      const WeightsRow<T> row{p, blk.b, lanes[r].h, lanes[r].i};
      for (int64_t j = 0; j < n; ++j) row.put(j0 + j, weight(st[r * kTileKeys + j], m[r], l[r]));
    }
  }
}

// Whole block with the few-rows kernel, all its rows (at most kDecodeMaxRows) in one pass over
// K and V. Without weights it leaves (ot, m, l) in RunBlocks' layout; with weights it reads
// the final m, l (per lane) and writes the weights.
template <class D, typename T = hn::TFromD<D>>
void DecodeBlock(D d, const Problem& p, const BlockRows& blk, int64_t key_begin, int64_t key_end, size_t mq,
                 bool weights, T* HWY_RESTRICT qbuf, T* HWY_RESTRICT obuf, T* HWY_RESTRICT st, T* ot, T* m, T* l,
                 T* bad, LaneRow* lanes, T* HWY_RESTRICT vtile, const LaneStats<T>& stats = {}) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dkp = (p.Dk + N - 1) / N * N, dvp = (p.Dv + N - 1) / N * N;
  // The visited keys of the block's rows; pack their queries pre-scaled and zero-padded.
  const LaneSpan span = describe_lanes(p, blk, key_begin, key_end, lanes);
  std::fill(qbuf, qbuf + blk.rows * dkp, T(0));
  for (int64_t r = 0; r < blk.rows; ++r) PackScaledQuery(p, blk.b, lanes[r].h, lanes[r].i, qbuf + r * dkp, 1);
  const auto rows = [&](auto r_const) {
    constexpr int64_t R = decltype(r_const)::value;
    if (weights) {
      WithStorage<T>(p.k.dtype, [&](auto s) { DecodeWeights<R>(d, s, p, blk, lanes, span, qbuf, dkp, st, m, l); });
      return;
    }
    // obuf holds two sets of rows: o, and o before the current tile (DecodeRows' redo).
    std::fill(bad, bad + kBadClasses * p.Dv * static_cast<int64_t>(mq), -std::numeric_limits<T>::infinity());
    WithStorage<T>(p.k.dtype, [&](auto s) {  // k and v share a dtype
      T* const o_prev = obuf + kDecodeMaxRows * (p.Dv + N);
      if (p.batch_invariant) {  // make_plan: never with statistics
        DecodeRows<R, true>(d, s, p, blk, lanes, span, qbuf, dkp, obuf, dvp, st, m, l, vtile, o_prev, bad,
                            static_cast<int64_t>(mq), stats);
      } else {
        DecodeRows<R, false>(d, s, p, blk, lanes, span, qbuf, dkp, obuf, dvp, st, m, l, vtile, o_prev, bad,
                             static_cast<int64_t>(mq), stats);
      }
    });
    for (int64_t r = 0; r < R; ++r)
      for (int64_t e = 0; e < p.Dv; ++e) ot[e * mq + r] = obuf[r * dvp + e];
  };
  static_assert(kDecodeMaxRows == 8, "one case per row count below");
  switch (blk.rows) {
    case 1: rows(std::integral_constant<int64_t, 1>{}); break;
    case 2: rows(std::integral_constant<int64_t, 2>{}); break;
    case 3: rows(std::integral_constant<int64_t, 3>{}); break;
    case 4: rows(std::integral_constant<int64_t, 4>{}); break;
    case 5: rows(std::integral_constant<int64_t, 5>{}); break;
    case 6: rows(std::integral_constant<int64_t, 6>{}); break;
    case 7: rows(std::integral_constant<int64_t, 7>{}); break;
    default: rows(std::integral_constant<int64_t, 8>{}); break;
  }
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_DECODE_INL_H_
