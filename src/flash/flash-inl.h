// The fused attention kernel, compiled once per SIMD target (included by forward_f32.cc and
// forward_f64.cc through hwy/foreach_target.h, and by backward-inl.h for its products). FlashAttention-2 online softmax over key tiles; the Nq×Nk score
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
#include <initializer_list>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "flash/bf16_dot.h"
#include "flash/decode-inl.h"
#include "flash/row_stats.h"
#include "flash/rows-inl.h"
#include "flash/score_tile-inl.h"
#include "flash/flash_plan.h"
#include "hwy/aligned_allocator.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernel_path.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// One block's state while its tiles are processed (pointers into Scratch).
template <typename T>
struct BlockState {
  BlockRows blk;
  LaneSpan span;
  T* qt;            // Dk × mq: the queries, transposed and pre-scaled
  T* ot;            // Dv × mq: the unnormalised output
  T* m;             // mq: running max (-inf until a key is allowed; 0 once finished)
  T* l;             // mq: running sum
  LaneRow* lanes;   // mq
  T* bad;           // 3 × Dv × mq: flash_plan.h's scores of keys with NaN or inf values (null: unused)
  // The queries as bfloat16 pairs for Bf16DotScores (ceil(Dk/2) × mq), or null: the block's
  // scores come from qt and widened keys.
  uint32_t* qp = nullptr;
  bool amx = false;  // qp's products with AmxDotScores (else Bf16DotScores)
  LaneStats<T> stats = {};  // Outputs::stats' running state (reals null: not asked for)
};

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

// A piece of Scratch's one allocation (get() as the unique pointers it replaced).
template <typename U>
struct ScratchPart {
  U* ptr = nullptr;
  U* get() const { return ptr; }
};

// Per-thread working memory for a group of up to `group` blocks that share each K/V tile:
// O(group · Mq · (Dk + Dv) + Mq · kTileKeys), independent of N. One aligned allocation cut
// into parts (a decode step of a small model is shorter than a dozen mallocs).
template <typename T>
struct Scratch {
  Scratch(const Problem& p, size_t mq, size_t lanes_per_vector, size_t group, KernelPath dot)
      : mq(mq),
        Dk(static_cast<size_t>(p.Dk)),
        Dv(static_cast<size_t>(p.Dv)),
        bf16_dot(dot != KernelPath::kSimd),
        amx(dot == KernelPath::kAmxBf16),
        v_bad(kTileKeys),
        lanes(group * mq),
        topk(p.stats.topk),
        stat_reals(p.stats.in_pass() ? group * static_cast<size_t>(LaneStats<T>::reals_size(static_cast<int64_t>(mq), topk)) : 0),
        stat_ints(p.stats.in_pass() ? group * static_cast<size_t>(LaneStats<T>::ints_size(static_cast<int64_t>(mq), topk)) : 0) {
    // Sizes in elements (at least 1: a part is never empty), each part 64-byte aligned.
    const size_t kt = static_cast<size_t>(kTileKeys), L = lanes_per_vector, R = static_cast<size_t>(kDecodeMaxRows);
    const auto at_least_1 = [](size_t n) { return std::max<size_t>(1, n); };
    const size_t sizes[] = {
        at_least_1(group * Dk * mq),                                                  // qt
        kt * mq,                                                                      // st
        kt * mq,                                                                      // mask_rows
        at_least_1(group * Dv * mq),                                                  // ot
        group * mq,                                                                   // m
        group * mq,                                                                   // l
        R * (Dk + L),                                                                 // decode_q
        2 * R * (Dv + L),                                                             // decode_o
        needs_row_scratch<T>(p.k) ? kt * at_least_1(Dk) : 1,                          // ktile
        needs_row_scratch<T>(p.v) ? kt * at_least_1(Dv) : 1,                         // vtile
        at_least_1(group * kBadClasses * Dv * mq),                                    // bad
    };
    const size_t qp_size = bf16_dot ? at_least_1(group * ((Dk + 1) / 2) * mq) : 1;   // uint32_t
    const auto rounded = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
    size_t total = rounded(qp_size * sizeof(uint32_t));
    for (size_t n : sizes) total += rounded(n * sizeof(T));
    storage = hwy::AllocateAligned<uint8_t>(total);
    uint8_t* at = storage.get();
    qp.ptr = reinterpret_cast<uint32_t*>(at);
    at += rounded(qp_size * sizeof(uint32_t));
    ScratchPart<T>* parts[] = {&qt, &st, &mask_rows, &ot, &m, &l, &decode_q, &decode_o, &ktile, &vtile, &bad};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
      parts[i]->ptr = reinterpret_cast<T*>(at);
      at += rounded(sizes[i] * sizeof(T));
    }
  }
  BlockState<T> block(size_t g) {
    BlockState<T> bs{BlockRows{},           LaneSpan{},
                     qt.get() + g * Dk * mq, ot.get() + g * Dv * mq,
                     m.get() + g * mq,       l.get() + g * mq,
                     lanes.data() + g * mq,  bad.get() + g * kBadClasses * Dv * mq,
                     bf16_dot ? qp.get() + g * ((Dk + 1) / 2) * mq : nullptr,
                     amx};
    if (!stat_reals.empty()) {
      const int64_t m64 = static_cast<int64_t>(mq);
      bs.stats = {m64, topk, stat_reals.data() + g * LaneStats<T>::reals_size(m64, topk),
                  stat_ints.data() + g * LaneStats<T>::ints_size(m64, topk)};
    }
    return bs;
  }
  size_t mq, Dk, Dv;
  hwy::AlignedFreeUniquePtr<uint8_t[]> storage;       // every part below
  ScratchPart<T> qt, st, mask_rows, ot, m, l;
  ScratchPart<T> decode_q, decode_o;  // DecodeBlock's rows of q, and of o (twice)
  ScratchPart<T> ktile, vtile;        // a tile of K, V rows widened to T (ReadRows)
  ScratchPart<T> bad;                 // BlockState::bad of each block
  ScratchPart<uint32_t> qp;           // BlockState::qp of each block, when bf16_dot
  bool bf16_dot, amx;  // the bfloat16 products (qp), with AMX
  std::vector<uint8_t> v_bad;                         // which V rows of the tile hold NaN or inf
  std::vector<LaneRow> lanes;
  int64_t topk;                                       // Outputs::stats' k
  std::vector<T> stat_reals;                          // BlockState::stats of each block
  std::vector<int64_t> stat_ints;
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

// Whether the keys of the tile that starts at t (a multiple of kTileKeys) in head (b, kvh) are
// all in Bf16DotScores' range. The whole tile, whichever of its keys a block visits, so that the
// forward, its weights pass and the backward make the same choice for each (row, key).
template <class D>
HWY_INLINE bool TileKeysInDotRange(D d, const Problem& p, int64_t b, int64_t kvh, int64_t t) {
  const int64_t n = std::min(kTileKeys, p.keys_of(b) - t);  // keys past the sequence's length are never read
  return Bf16RowsInDotRange(d, p.k.at<uint16_t>(b, kvh, t), p.k.strides[2], n, p.Dk);
}

// Scores of keys [j0, j0 + n) for a block into st, scaled, masked: from the bfloat16 pairs
// (bs.qp) and k in place when the tile's keys are in their range (keys_in_range:
// TileKeysInDotRange), else from qt (the scale folded in) and `keys` (rows of k as T, key j0
// first; unread on the first way). slope: MaskScores' (the backward's softcap derivative).
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void ScoreTile(D d, const Problem& p, const BlockState<T>& bs, T* HWY_RESTRICT st, size_t mq, int64_t j0,
                          int64_t n, bool partial, const Rows<T>& keys, bool keys_in_range, T* HWY_RESTRICT mask_rows,
                          T* HWY_RESTRICT slope = nullptr) {
  if (bs.qp != nullptr && keys_in_range) {
    Bf16Dot(bs.qp, mq, p.Dk, p.k, bs.blk.b, bs.blk.kvh, j0, n, p.scale, bs.amx, st);
  } else {
    OuterScores<QV>(d, bs.qt, mq, keys.data, keys.stride, p.Dk, n, st);
  }

  MaskScores<QV, TileLayout::kKeyMajor>(d, p, bs.blk.b, bs.lanes, bs.blk.rows, j0, n, partial, st, mq, mask_rows, slope);
}

// Describes the block's lanes for keys [key_begin, key_end) and packs its queries:
// qt[d][lane] = q[lane's row][d] · scale (padding lanes zero), and bs.qp (when set and the
// block's queries are in its range; else bs.qp becomes null).
template <typename T>
void BeginBlock(const Problem& p, const BlockRows& blk, int64_t key_begin, int64_t key_end, size_t mq,
                BlockState<T>& bs) {
  bs.blk = blk;
  bs.span = describe_lanes(p, blk, key_begin, key_end, bs.lanes);
  if (bs.qp != nullptr) {  // bfloat16 pairs for Bf16DotScores, unless this block must widen
    const auto row = [&](int64_t l) { return p.q.at<uint16_t>(blk.b, bs.lanes[l].h, bs.lanes[l].i); };
    if (!pack_bf16_pairs(row, blk.rows, p.Dk, mq, bs.qp)) bs.qp = nullptr;
  }
  std::fill(bs.ot, bs.ot + p.Dv * mq, T(0));
  std::fill(bs.m, bs.m + mq, -std::numeric_limits<T>::infinity());
  std::fill(bs.l, bs.l + mq, T(0));
  if (bs.stats.reals != nullptr) bs.stats.begin();
  if (bs.bad != nullptr) std::fill(bs.bad, bs.bad + kBadClasses * p.Dv * mq, -std::numeric_limits<T>::infinity());
  // qt even with pairs: tiles of keys outside their range use it.
  std::fill(bs.qt, bs.qt + p.Dk * mq, T(0));
  for (int64_t l = 0; l < blk.rows; ++l) {
    PackScaledQuery(p, blk.b, bs.lanes[l].h, bs.lanes[l].i, bs.qt + l, static_cast<int64_t>(mq));
  }
}

// Outputs::stats' top k (row_stats.h) for a tile: candidates[j · QV + q] holds the lanes of the
// q-th vector (a bit each) whose score of key j0 + j beat the lane's threshold as the tile began;
// each is offered, in key order, and the offer compares with the threshold as it is by then.
// Marking candidates in the max loop and offering them here keeps a branch out of that loop:
// the lanes beat their thresholds often in a row's first tile and at random after.
//
// When many scores are candidates (a row's first tile, where the threshold is still -inf, or
// scores that grow along the keys), offering them one by one costs a mispredicted branch each;
// then the whole tile goes through an insertion network instead: per vector of lanes, the k
// entries as k vectors of scores and ids, each key's scores bubbled down with compare-and-
// select. The new key takes a slot only from a smaller score (strict >: an equal earlier key
// stays above it); once it has, what moves down is an earlier entry, which takes a slot from an
// equal score too (the entries below it with its score have later keys). So the lists are
// those the offers give, ties to the lower key.
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_NOINLINE void OfferTile(D d, const LaneStats<T>& ls, const T* HWY_RESTRICT st, size_t mq, int64_t j0, int64_t n,
                            const uint64_t* candidates) {
  const size_t N = hn::Lanes(d);
  int64_t count = 0;
  for (size_t x = 0; x < static_cast<size_t>(n) * QV; ++x) count += std::popcount(candidates[x]);
  if (count * 8 > n * static_cast<int64_t>(mq)) {  // more than one score in 8
    using V = hn::Vec<D>;
    constexpr size_t kMaxN = hn::MaxLanes(d);
    HWY_ALIGN T top[kMaxTopK * kMaxN], id[kMaxTopK * kMaxN];  // entry r of lane x at r · N + x
    int64_t before[kMaxTopK * kMaxN];                          // the entries' keys as the tile began
    const int64_t k = ls.k;
    for (size_t q = 0; q < QV; ++q) {
      for (int64_t r = 0; r < k; ++r) {
        for (size_t x = 0; x < N; ++x) {
          const int64_t lane = static_cast<int64_t>(q * N + x);
          top[static_cast<size_t>(r) * N + x] = ls.top_s(lane)[r];
          id[static_cast<size_t>(r) * N + x] = static_cast<T>(-(r + 1));  // -(r + 1): entry r as it was
          before[static_cast<size_t>(r) * N + x] = ls.top_i(lane)[r];
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        V s = hn::Load(d, st + j * static_cast<int64_t>(mq) + q * N), sid = hn::Set(d, static_cast<T>(j));  // exact: j < kTileKeys
        auto moved = hn::Lt(s, s);  // lanes whose carried score is an earlier entry (none yet; NaN: none either)
        for (int64_t r = 0; r < k; ++r) {
          T* tr = top + static_cast<size_t>(r) * N;
          T* ir = id + static_cast<size_t>(r) * N;
          const V t = hn::Load(d, tr), ti = hn::Load(d, ir);
          const auto gt = hn::Or(hn::Gt(s, t), hn::And(moved, hn::Eq(s, t)));
          moved = hn::Or(moved, gt);
          hn::Store(hn::IfThenElse(gt, s, t), d, tr);
          hn::Store(hn::IfThenElse(gt, sid, ti), d, ir);
          s = hn::IfThenElse(gt, t, s);
          sid = hn::IfThenElse(gt, ti, sid);
        }
      }
      for (int64_t r = 0; r < k; ++r) {
        for (size_t x = 0; x < N; ++x) {
          const int64_t lane = static_cast<int64_t>(q * N + x);
          const T e = id[static_cast<size_t>(r) * N + x];
          ls.top_s(lane)[r] = top[static_cast<size_t>(r) * N + x];
          ls.top_i(lane)[r] = e < 0 ? before[static_cast<size_t>(-static_cast<int64_t>(e) - 1) * N + x] : j0 + static_cast<int64_t>(e);
        }
      }
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    for (size_t q = 0; q < QV; ++q) {
      for (uint64_t bits = candidates[static_cast<size_t>(j) * QV + q]; bits != 0; bits &= bits - 1) {
        const size_t lane = q * N + static_cast<size_t>(std::countr_zero(bits));
        ls.offer(static_cast<int64_t>(lane), st[j * static_cast<int64_t>(mq) + static_cast<int64_t>(lane)], j0 + j);
      }
    }
  }
}

// Outputs::stats after a tile's max loop, before the block's max bs.m moves to mnew: each lane's
// allowed keys (count), and its argmax where the tile raised its max (the first key of the tile
// at the new max: keys arrive in increasing order, so an equal later max keeps the earlier key).
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_NOINLINE void TileStatsEnd(D d, const BlockState<T>& bs, const T* HWY_RESTRICT st, size_t mq, int64_t j0,
                               int64_t n, const hn::Vec<D>* count, const hn::Vec<D>* mnew) {
  const size_t N = hn::Lanes(d);
  HWY_ALIGN T c[QV * hn::MaxLanes(d)], m[QV * hn::MaxLanes(d)];
  for (size_t q = 0; q < QV; ++q) {
    hn::Store(count[q], d, c + q * N);
    hn::Store(mnew[q], d, m + q * N);
  }
  for (size_t lane = 0; lane < mq; ++lane) {
    bs.stats.allowed()[lane] += static_cast<int64_t>(c[lane]);  // exact: at most kTileKeys
    if (!(m[lane] > bs.m[lane])) continue;
    for (int64_t j = 0; j < n; ++j) {
      if (st[j * static_cast<int64_t>(mq) + static_cast<int64_t>(lane)] == m[lane]) {
        bs.stats.argmax()[lane] = j0 + j;
        break;
      }
    }
  }
}

// One online-softmax step of a block over the tile that starts at t (a multiple of
// kTileKeys), clipped to the block's span: scores, new max, rescale, p = exp(s - max), p·V.
// keys and values hold the tile's rows from key k0 on (k0 <= the block's first key in it);
// v_bad (null: none) flags the value rows holding NaN or inf, from k0 on.
template <size_t QV, class D, typename T = hn::TFromD<D>>
void BlockTile(D d, const Problem& p, BlockState<T>& bs, T* HWY_RESTRICT st, T* HWY_RESTRICT mask_rows, int64_t t,
               int64_t k0, const Rows<T>& keys, bool keys_in_range, const Rows<T>& values, const uint8_t* v_bad) {
  using V = hn::Vec<D>;
  const size_t N = hn::Lanes(d);
  const size_t mq = QV * N;
  const int64_t j0 = std::max(t, bs.span.begin);
  const int64_t n = std::min(t + kTileKeys, bs.span.end) - j0;
  if (n <= 0) return;
  const bool partial = j0 < bs.span.max_begin || j0 + n > bs.span.min_end;
  ScoreTile<QV>(d, p, bs, st, mq, j0, n, partial, Rows<T>{keys.row(j0 - k0), keys.stride}, keys_in_range, mask_rows);
  // Value rows holding NaN or inf: their scores, before the exp overwrites them (rare).
  for (int64_t j = 0; v_bad != nullptr && j < n; ++j) {
    if (!v_bad[j0 - k0 + j]) continue;
    for (int64_t lane = 0; lane < bs.blk.rows; ++lane) {
      const LaneRow& r = bs.lanes[lane];
      if (p.dropout.enabled() && p.dropout.factor<T>(bs.blk.b, r.h, r.i, j0 + j) == T(0)) continue;
      record_bad_row(values.row(j0 - k0 + j), p.Dv, st[j * mq + lane], static_cast<int64_t>(mq), lane, bs.bad);
    }
  }

  const V neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  V mnew[QV], msafe[QV], alpha[QV], sum[QV], mold[QV], tsum[QV];
  // Lanes with a NaN score: Max and Exp drop NaN (Exp(NaN) = 0), so they are flagged here and
  // their sum made NaN below, which carries to out and lse as NaN (never a "blocked" zero).
  hn::Mask<D> nan[QV];
  for (size_t q = 0; q < QV; ++q) {
    mnew[q] = hn::Load(d, bs.m + q * N);
    nan[q] = hn::IsNaN(mnew[q]);  // an earlier tile's NaN score may sit in m
  }
  // The tile's max; with statistics also each lane's allowed keys and its top-k offers (a
  // compare per score against the lane's threshold), in a loop of its own.
  const bool stats = bs.stats.reals != nullptr, topk = stats && bs.stats.k > 0;
  V count[QV], thr[QV];
  HWY_ALIGN T thresholds[QV * hn::MaxLanes(d)];
  uint64_t candidates[kTileKeys * QV];  // OfferTile's
  static_assert(hn::MaxLanes(d) <= 64, "a lane a bit");
  const V one = hn::Set(d, T(1));
  for (size_t q = 0; stats && q < QV; ++q) {
    count[q] = hn::Zero(d);
    for (size_t x = 0; topk && x < N; ++x) thresholds[q * N + x] = bs.stats.threshold(static_cast<int64_t>(q * N + x));
    thr[q] = topk ? hn::Load(d, thresholds + q * N) : neg_inf;
  }
  const auto max_loop = [&](auto stats_const) {
    for (int64_t j = 0; j < n; ++j) {
      for (size_t q = 0; q < QV; ++q) {
        const V s = hn::Load(d, st + j * mq + q * N);
        mnew[q] = hn::Max(mnew[q], s);
        nan[q] = hn::Or(nan[q], hn::IsNaN(s));
        if constexpr (decltype(stats_const)::value) {
          count[q] = hn::Add(count[q], hn::IfThenElseZero(hn::Gt(s, neg_inf), one));
          if (topk) {
            uint8_t bytes[8] = {};  // lane x in bit x % 8 of byte x / 8
            hn::StoreMaskBits(d, hn::Gt(s, thr[q]), bytes);
            uint64_t bits = 0;
            for (size_t b = 0; b < (N + 7) / 8; ++b) bits |= uint64_t{bytes[b]} << (8 * b);
            candidates[static_cast<size_t>(j) * QV + q] = bits;
          }
        }
      }
    }
  };
  if (stats) {
    max_loop(std::true_type{});
    if (topk) OfferTile<QV>(d, bs.stats, st, mq, j0, n, candidates);
    TileStatsEnd<QV>(d, bs, st, mq, j0, n, count, mnew);
  } else {
    max_loop(std::false_type{});
  }
  // A lane whose max is +inf (a score overflowed): shifted_exp's rule, exp(s - m) = 1 where
  // s == m, splits its weight among its +inf keys. Checked once per tile; rare.
  const V pos_inf = hn::Set(d, std::numeric_limits<T>::infinity());
  bool inf_max = false;
  for (size_t q = 0; q < QV; ++q) {
    // A lane with nothing allowed yet keeps max -inf; subtracting 0 keeps exp(-inf) = 0.
    msafe[q] = hn::IfThenZeroElse(hn::Eq(mnew[q], neg_inf), mnew[q]);
    mold[q] = hn::Load(d, bs.m + q * N);
    alpha[q] = ExpNormal(d, hn::Sub(mold[q], msafe[q]));
    if (!hn::AllFalse(d, hn::Eq(mnew[q], pos_inf))) {
      inf_max = true;
      alpha[q] = hn::IfThenElse(hn::Eq(mold[q], pos_inf), one, alpha[q]);
    }
    sum[q] = hn::Zero(d);
    tsum[q] = hn::Zero(d);
    hn::Store(mnew[q], d, bs.m + q * N);
  }
  // p = exp(s - m) over the tile; the +inf-max variant, and the one that also sums t for the
  // statistics (row_stats.h: Σ p · (s - m), -inf clamped so that 0 · -inf adds 0), in loops
  // of their own, so that the common loop stays as it was.
  const V lowest = hn::Set(d, std::numeric_limits<T>::lowest());
  const auto exp_tile = [&](auto inf_max_const, auto stats_const) {
    for (int64_t j = 0; j < n; ++j) {
      for (size_t q = 0; q < QV; ++q) {
        T* row = st + j * mq + q * N;
        const V s = hn::Load(d, row);
        const V x = hn::Sub(s, msafe[q]);
        V pj = ExpNormal(d, x);
        if constexpr (decltype(inf_max_const)::value) pj = hn::IfThenElse(hn::Eq(s, pos_inf), one, pj);  // m = +inf
        sum[q] = hn::Add(sum[q], pj);
        if constexpr (decltype(stats_const)::value) {
          // A +inf key at a +inf max is at the max: s - m counts as 0.
          const V xs = decltype(inf_max_const)::value ? hn::IfThenZeroElse(hn::Eq(s, pos_inf), x) : x;
          tsum[q] = hn::MulAdd(pj, hn::Max(xs, lowest), tsum[q]);
        }
        hn::Store(pj, d, row);
      }
    }
  };
  if (stats) {
    inf_max ? exp_tile(std::true_type{}, std::true_type{}) : exp_tile(std::false_type{}, std::true_type{});
    // t = alpha · (t + (m_old - m_new) · l_old) + Σ p · (s - m_new)  (rescale_t, per vector)
    for (size_t q = 0; q < QV; ++q) {
      T* t = bs.stats.t() + q * N;
      const V delta = hn::IfThenZeroElse(hn::Eq(mold[q], msafe[q]), hn::Max(hn::Sub(mold[q], msafe[q]), lowest));
      const V scaled = hn::Mul(alpha[q], hn::MulAdd(delta, hn::Load(d, bs.l + q * N), hn::LoadU(d, t)));
      hn::StoreU(hn::Add(hn::IfThenZeroElse(hn::Eq(alpha[q], hn::Zero(d)), scaled), tsum[q]), d, t);
    }
  } else if (inf_max) {
    exp_tile(std::true_type{}, std::false_type{});
  } else {
    exp_tile(std::false_type{}, std::false_type{});
  }
  for (size_t q = 0; q < QV; ++q) {
    sum[q] = hn::IfThenElse(nan[q], hn::Set(d, std::numeric_limits<T>::quiet_NaN()), sum[q]);
    hn::Store(hn::MulAdd(hn::Load(d, bs.l + q * N), alpha[q], sum[q]), d, bs.l + q * N);
  }
  if (p.dropout.enabled()) {  // after the sum: the softmax normalises the undropped weights
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t lane = 0; lane < bs.blk.rows; ++lane) {
        st[j * mq + lane] *= p.dropout.factor<T>(bs.blk.b, bs.lanes[lane].h, bs.lanes[lane].i, j0 + j);
      }
    }
  }

  // A value row holding NaN or inf reaches no lane that gives its key weight 0 (no 0 · NaN).
  AccumulateRows<QV, /*kFiniteOnly=*/true>(d, st, n, mq, values.row(j0 - k0), values.stride, p.Dv, alpha,
                                          v_bad ? v_bad + (j0 - k0) : nullptr,
                     bs.ot);
}

// Online softmax for a group of blocks of one kv head over keys [key_begin, key_end), tile
// by tile, every block taking each K/V tile while it is still in cache. Leaves each block's
// unnormalised output in ot, its max in m (0 where no key is allowed) and its sum in l.
// Grouping changes no arithmetic: each block sees the same tiles in the same order.
template <size_t QV, class D, typename T = hn::TFromD<D>>
void RunBlocks(D d, const Problem& p, const BlockRows* blks, size_t count, int64_t key_begin, int64_t key_end,
               Scratch<T>& s) {
  const size_t mq = QV * hn::Lanes(d);
  BlockState<T> states[kMaxGroupBlocks];
  int64_t begin = std::numeric_limits<int64_t>::max(), end = 0;
  for (size_t g = 0; g < count; ++g) {
    states[g] = s.block(g);
    BeginBlock(p, blks[g], key_begin, key_end, mq, states[g]);
    if (states[g].span.begin < states[g].span.end) {
      begin = std::min(begin, states[g].span.begin);
      end = std::max(end, states[g].span.end);
    }
  }
  for (int64_t t = begin < end ? tile_start(begin) : end; t < end; t += kTileKeys) {
    // The group's keys of this tile, read (widened, for 16-bit storage) once for all its blocks.
    const int64_t k0 = std::max(t, begin), k1 = std::min(t + kTileKeys, end);
    const BlockRows& blk = blks[0];  // every block of a group reads the same kv head
    // The blocks that see a key of the tile under the block mask (all without one): a block
    // that sees none would add nothing (its max, sum and output stay bit for bit), and a tile
    // that no block sees is not read.
    bool sees[kMaxGroupBlocks];
    bool any_sees = false;
    for (size_t g = 0; g < count; ++g) {
      sees[g] = !p.block_mask || lanes_see_keys(p, blk.b, states[g].lanes, blks[g].rows, k0, k1);
      any_sees |= sees[g];
    }
    if (!any_sees) continue;
    bool pairs = false, widen_keys = false;  // widened unless every block scores from bfloat16 pairs
    for (size_t g = 0; g < count; ++g) (states[g].qp != nullptr ? pairs : widen_keys) = true;
    const bool keys_in_range = pairs && TileKeysInDotRange(d, p, blk.b, blk.kvh, t);
    widen_keys |= !keys_in_range;
    const Rows<T> keys = widen_keys ? ReadRows(d, p.k, blk.b, blk.kvh, k0, k1 - k0, p.Dk, s.ktile.get()) : Rows<T>{};
    const Rows<T> values = ReadRows(d, p.v, blk.b, blk.kvh, k0, k1 - k0, p.Dv, s.vtile.get());
    const bool v_bad = FlagNonFiniteRows(d, values.data, values.stride, k1 - k0, p.Dv, s.v_bad.data());
    for (size_t g = 0; g < count; ++g) {
      if (!sees[g]) continue;
      BlockTile<QV>(d, p, states[g], s.st.get(), s.mask_rows.get(), t, k0, keys, keys_in_range, values,
                    v_bad ? s.v_bad.data() : nullptr);
    }
  }
  for (size_t g = 0; g < count; ++g) {
    for (size_t l = 0; l < mq; ++l) {
      if (states[g].m[l] == -std::numeric_limits<T>::infinity()) states[g].m[l] = 0;
    }
  }
}

// Weights for inspection, a second pass once each row's max m and sum l are known:
// w = exp(s - m) / l. (exp(s - lse) would lose eps·|lse| of relative accuracy to lse's rounding.)
template <size_t QV, class D, typename T = hn::TFromD<D>>
void WriteWeights(D d, const Problem& p, const BlockRows& blk, const T* m, const T* l, Scratch<T>& s) {
  const size_t mq = QV * hn::Lanes(d);
  BlockState<T> bs = s.block(0);
  BeginBlock(p, blk, 0, p.Nk, mq, bs);
  for (int64_t lane = 0; lane < blk.rows; ++lane) WeightsRow<T>{p, blk.b, bs.lanes[lane].h, bs.lanes[lane].i}.clear();
  for (int64_t t = tile_start(bs.span.begin); t < bs.span.end; t += kTileKeys) {
    const int64_t j0 = std::max(t, bs.span.begin);
    const int64_t n = std::min(t + kTileKeys, bs.span.end) - j0;
    if (p.block_mask && !lanes_see_keys(p, blk.b, bs.lanes, blk.rows, j0, j0 + n)) continue;  // weights stay 0
    const bool keys_in_range = bs.qp != nullptr && TileKeysInDotRange(d, p, blk.b, blk.kvh, t);
    const Rows<T> keys = keys_in_range ? Rows<T>{} : ReadRows(d, p.k, blk.b, blk.kvh, j0, n, p.Dk, s.ktile.get());
    ScoreTile<QV>(d, p, bs, s.st.get(), mq, j0, n, /*partial=*/true, keys, keys_in_range, s.mask_rows.get());
    for (int64_t lane = 0; lane < blk.rows; ++lane) {
      const WeightsRow<T> row{p, blk.b, bs.lanes[lane].h, bs.lanes[lane].i};
      for (int64_t j = 0; j < n; ++j) row.put(j0 + j, weight(s.st.get()[j * mq + lane], m[lane], l[lane]));
    }
  }
}

// One problem of a FlashMany call: its plan, its instruction path, and the (ot, m, l, bad)
// of each block and key chunk when its keys are split (merged after all chunks ran).
template <typename T>
struct Job {
  const Problem* p = nullptr;
  Plan plan;
  KernelPath dot = KernelPath::kSimd;
  size_t mq = 0, partial_size = 0;
  std::vector<T> partial;
  // The statistics' lane states (LaneStats' two arrays) of each block and chunk, when asked for.
  std::vector<T> partial_stat_reals;
  std::vector<int64_t> partial_stat_ints;
  int64_t first_unit = 0, first_merge = 0;  // this job's units and merged blocks in the call's numbering
  // What a thread's Scratch depends on: jobs that agree share one (a varlen batch: all do).
  bool same_scratch(const Job& o) const {
    return p->Dk == o.p->Dk && p->Dv == o.p->Dv && p->k.dtype == o.p->k.dtype && p->v.dtype == o.p->v.dtype &&
           p->k.paged() == o.p->k.paged() && mq == o.mq && plan.group_blocks == o.plan.group_blocks && dot == o.dot &&
           p->stats.in_pass() == o.p->stats.in_pass() && p->stats.topk == o.p->stats.topk;
  }
};

// Normalises block g of the scratch and writes its rows (and weights, when asked for).
template <typename T, class D>
void FinishBlock(D d, const Job<T>& job, Scratch<T>& s, size_t g, const BlockRows& blk) {
  const Problem& p = *job.p;
  const size_t mq = job.mq;
  const BlockState<T> bs = s.block(g);
  if (bs.stats.reals != nullptr) {  // from the keys' max and sum, before the sink joins them
    for (int64_t lane = 0; lane < blk.rows; ++lane) {
      const LaneRow& r = bs.lanes[lane];
      const T sink = p.has_sinks() ? p.sink<T>(r.h) : -std::numeric_limits<T>::infinity();
      write_row_stats(p, blk.b, r.h, r.i, bs.m[lane], bs.l[lane], sink, bs.stats, lane);
    }
  }
  if (p.has_sinks()) add_sinks(p, bs.lanes, blk.rows, static_cast<int64_t>(mq), bs.ot, bs.m, bs.l);
  finish_block<T>(p, blk, bs.ot, bs.m, bs.l, bs.bad, mq, bs.lanes);
  if (!p.weights && !p.stats.pooled_weights) return;
  // The weights pass reuses the scratch, so it reads m and l from copies.
  std::vector<T> m(bs.m, bs.m + mq), l(bs.l, bs.l + mq);
  if (job.plan.decode) {
    DecodeBlock(d, p, blk, 0, p.Nk, mq, /*weights=*/true, s.decode_q.get(), s.decode_o.get(), s.st.get(),
                s.ot.get(), m.data(), l.data(), s.bad.get(), s.lanes.data(), s.vtile.get());
  } else if (job.plan.qv == 1) {
    WriteWeights<1>(d, p, blk, m.data(), l.data(), s);
  } else {
    WriteWeights<2>(d, p, blk, m.data(), l.data(), s);
  }
}

// Runs every block of job j's unit u (a group of blocks and a key chunk) and finishes its rows,
// or keeps its chunk's partial results for the merge.
template <typename T, class D>
void RunUnit(D d, Job<T>& job, int64_t u, Scratch<T>& s) {
  const Problem& p = *job.p;
  const Plan& plan = job.plan;
  const size_t mq = job.mq;
  BlockRows blks[kMaxGroupBlocks];
  const int64_t group = u / plan.chunks, c = u % plan.chunks;
  const size_t count = plan.group(group, blks);
  const int64_t k0 = c * plan.chunk_keys, k1 = std::min(p.Nk, k0 + plan.chunk_keys);
  if (plan.decode) {  // one block per group: decode has few rows per kv head
    const LaneStats<T> stats = s.block(0).stats;
    if (stats.reals != nullptr) stats.begin();
    DecodeBlock(d, p, blks[0], k0, k1, mq, /*weights=*/false, s.decode_q.get(), s.decode_o.get(), s.st.get(),
                s.ot.get(), s.m.get(), s.l.get(), s.bad.get(), s.lanes.data(), s.vtile.get(), stats);
  } else if (plan.qv == 1) {
    RunBlocks<1>(d, p, blks, count, k0, k1, s);
  } else {
    RunBlocks<2>(d, p, blks, count, k0, k1, s);
  }
  for (size_t g = 0; g < count; ++g) {
    if (!plan.needs_merge()) {
      FinishBlock(d, job, s, g, blks[g]);
      continue;
    }
    // Keep (ot, m, l, bad) of this block and chunk for the merge.
    const BlockState<T> bs = s.block(g);
    T* dst = job.partial.data() + (plan.block_index(blks[g]) * plan.chunks + c) * job.partial_size;
    std::copy(bs.ot, bs.ot + p.Dv * mq, dst);
    std::copy(bs.m, bs.m + mq, dst + p.Dv * mq);
    std::copy(bs.l, bs.l + mq, dst + (p.Dv + 1) * mq);
    std::copy(bs.bad, bs.bad + kBadClasses * p.Dv * mq, dst + (p.Dv + 2) * mq);
    if (bs.stats.reals != nullptr) {
      const int64_t rs = LaneStats<T>::reals_size(bs.stats.mq, bs.stats.k), is = LaneStats<T>::ints_size(bs.stats.mq, bs.stats.k);
      const int64_t at = plan.block_index(blks[g]) * plan.chunks + c;
      std::copy(bs.stats.reals, bs.stats.reals + rs, job.partial_stat_reals.data() + at * rs);
      std::copy(bs.stats.ints, bs.stats.ints + is, job.partial_stat_ints.data() + at * is);
    }
  }
}

// Runs n problems (each validated; of compute type T) as one parallel region: the units of all
// of them (groups of blocks and key chunks) share the threads, so a batch of sequences of very
// different lengths (attention_varlen) keeps every thread busy, and pays one region start. Each
// problem's arithmetic is what Flash of it alone does (its plan depends on it alone), so the
// output is bitwise identical for any thread count and any batch it runs in. Each output row is
// written exactly once.
template <typename T>
void FlashMany(const Problem* const* problems, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  std::vector<Job<T>> jobs(n);
  int64_t units = 0, merges = 0;
  double work = 0;
  KernelPath noted = KernelPath::kSimd;
  for (size_t j = 0; j < n; ++j) {
    Job<T>& job = jobs[j];
    const Problem& p = *problems[j];
    job.p = &p;
    job.plan = make_plan(p, N);
    job.mq = job.plan.qv * N;
    // bfloat16 scores with vdpbf16ps: prefill tiles of bfloat16 q and k, where allowed and
    // present. (Not from a paged pool: the instruction reads a tile's keys in place, evenly spaced.)
    job.dot = job.plan.decode || !bf16_dot_scale_ok(p.scale) || p.k.paged() ? KernelPath::kSimd
                                                                            : Bf16DotPath<T>({p.q.dtype, p.k.dtype});
    noted = std::max(noted, job.dot);
    job.partial_size = (p.Dv + 2 + kBadClasses * p.Dv) * job.mq;  // (ot, m, l, bad) of one block and chunk
    if (job.plan.needs_merge()) {
      const int64_t pieces = job.plan.blocks * job.plan.chunks, mq = static_cast<int64_t>(job.mq);
      job.partial.resize(static_cast<size_t>(pieces) * job.partial_size);
      if (p.stats.in_pass()) {
        job.partial_stat_reals.resize(static_cast<size_t>(pieces * LaneStats<T>::reals_size(mq, p.stats.topk)));
        job.partial_stat_ints.resize(static_cast<size_t>(pieces * LaneStats<T>::ints_size(mq, p.stats.topk)));
      }
    }
  }
  note_kernel_path(noted);
  // The largest units first (sequences of lengths that differ 100x): the threads then finish
  // together. The order changes no arithmetic.
  const auto per_unit = [](const Job<T>& job) { return job.plan.work / std::max<int64_t>(1, job.plan.units()); };
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job<T>& a, const Job<T>& b) { return per_unit(a) > per_unit(b); });
  for (Job<T>& job : jobs) {
    job.first_unit = units;
    job.first_merge = merges;
    units += job.plan.units();
    if (job.plan.needs_merge()) merges += job.plan.blocks;
    work += job.plan.work;
  }
  // The job of unit (or merged block) x: the last whose first is <= x (the firsts do not
  // decrease; a job without units shares its first with the next one).
  const auto job_of = [&](int64_t x, int64_t Job<T>::*first) {
    size_t lo = 0, hi = n;
    while (hi - lo > 1) {
      const size_t mid = (lo + hi) / 2;
      (jobs[mid].*first <= x ? lo : hi) = mid;
    }
    return lo;
  };
  const int threads = threads_for(units, work);

  // One thread's part: `each(n, f)` calls f(i) for the i in [0, n) this thread takes (all of
  // them without a team; an orphaned `omp for`, ending in a barrier, within one).
  const auto thread_part = [&](const auto& each) {
    // This thread's scratch, one per kind of job it meets (a varlen batch has one kind).
    std::vector<std::pair<const Job<T>*, std::unique_ptr<Scratch<T>>>> scratches;
    const auto scratch = [&](const Job<T>& job) -> Scratch<T>& {
      for (auto& [owner, sc] : scratches)
        if (owner->same_scratch(job)) return *sc;
      scratches.emplace_back(&job, std::make_unique<Scratch<T>>(*job.p, job.mq, N, job.plan.group_blocks, job.dot));
      return *scratches.back().second;
    };
    each(units, [&](int64_t u) {
      Job<T>& job = jobs[job_of(u, &Job<T>::first_unit)];
      RunUnit(d, job, u - job.first_unit, scratch(job));
    });
    each(merges, [&](int64_t x) {
      const Job<T>& job = jobs[job_of(x, &Job<T>::first_merge)];
      const int64_t bi = x - job.first_merge;
      Scratch<T>& s = scratch(job);
      const BlockRows blk = job.plan.block(bi);
      const BlockState<T> bs = s.block(0);
      describe_lanes(*job.p, blk, 0, job.p->Nk, bs.lanes);
      const T* partial = job.partial.data() + bi * job.plan.chunks * job.partial_size;
      if (bs.stats.reals != nullptr) {  // before merge_chunks overwrites the block's (m, l)
        const int64_t rs = LaneStats<T>::reals_size(bs.stats.mq, bs.stats.k), is = LaneStats<T>::ints_size(bs.stats.mq, bs.stats.k);
        merge_stats_chunks<T>(partial, job.partial_stat_reals.data() + bi * job.plan.chunks * rs,
                              job.partial_stat_ints.data() + bi * job.plan.chunks * is, job.plan.chunks, job.p->Dv, bs.stats);
      }
      merge_chunks<T>(partial, job.plan.chunks, job.p->Dv, job.mq, bs.ot, bs.m, bs.l, bs.bad);
      FinishBlock(d, job, s, 0, blk);
    });
  };
  if (threads == 1) {  // no team: a decode step of a small model is shorter than starting one
    thread_part([](int64_t n, const auto& f) {
      for (int64_t i = 0; i < n; ++i) f(i);
    });
    return;
  }
#pragma omp parallel num_threads(threads)
  thread_part([](int64_t n, const auto& f) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) f(i);
  });
}

template <typename T>
void Flash(const Problem& p) {
  const Problem* one = &p;
  FlashMany<T>(&one, 1);
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_INL_H_
