// The fused backward pass (FlashAttention-2), compiled per SIMD target; included by
// backward_f32.cc and backward_f64.cc. It shares the forward's outer products
// (products-inl.h), bfloat16 dot path (bf16_path-inl.h) and query blocks (query_block-inl.h:
// the dq pass's lanes, packed q and score tiles). Per query row i:
//   p_ij = exp(s_ij - lse_i)       (recomputed tile by tile from the saved lse)
//   D_i  = dout_i · out_i          ds_ij = p_ij · (dout_i · v_j - D_i)
//   dv_j = Σ_i p_ij dout_i         dk_j = scale · Σ_i ds_ij q_i        dq_i = scale · Σ_j ds_ij k_j
// Every output element has one owner and a fixed summation order (no atomics, bitwise
// identical for any thread count):
//   KeyBlockGrads: lanes = keys of one kv head; all query rows of its group stream past,
//                  accumulating dk, dv in registers-and-L1 tiles. In the one-pass plan
//                  (OnePassChunks) it also adds ds · k into float rows of dq: five products
//                  per tile (s, dp, dv, dk, dq), one unit per (b, kv head, chunk of its key
//                  blocks), each chunk with its own dq rows, summed in chunk order at the end.
//   QueryBlockGrad: the two-pass plan's second pass, for shapes with too few (b, kv head)
//                  units or too much dq to hold per chunk: lanes = query rows, as the
//                  forward; key tiles stream past, accumulating dq (the score and dout · vᵀ
//                  products again: seven in all).
// The plan depends on the shape only, never on the thread count. The Nq×Nk matrices never
// exist: extra memory is O(threads × tile) plus D and lse, O(N), chunks × dq in the one-pass
// plan, and kFast's pairs of q and dout (HeadPairs: a kv head's per thread, ≤ 32 MiB).

#if defined(SDPA_FLASH_BACKWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_BACKWARD_INL_H_
#undef SDPA_FLASH_BACKWARD_INL_H_
#else
#define SDPA_FLASH_BACKWARD_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash/bf16_path-inl.h"
#include "flash/flash_plan.h"
#include "flash/grad_rules-inl.h"
#include "flash/products-inl.h"
#include "flash/query_block-inl.h"
#include "flash/rows-inl.h"
#include "flash/score_tile-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "kernel_path.h"
#include "problem.h"
#include "reference.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr size_t kBackwardQV = 2;  // vectors per block: 16 lanes of f32 on AVX2, 32 on AVX-512

// Row width rounded up to whole vectors of n lanes (at least one): the one-pass plan's dq
// rows and padded key rows, so that its product needs no partial vectors.
inline int64_t padded_width(int64_t width, size_t n) {
  const int64_t lanes = static_cast<int64_t>(n);
  return std::max<int64_t>(1, (width + lanes - 1) / lanes) * lanes;
}

// kFast's dv += p~ · dout and dk += ds~ · q (Bf16Accumulate) read a head's rows of dout and q
// as bfloat16 pairs (with AMX, transposed too): packed here once per thread, kv head and call,
// for every head of its group, not once per block of keys and tile of rows (that packing was a
// fifth of the d128 kFast backward's kernel samples on the AMX Xeon). Pairs of rows
// (2·j2, 2·j2 + 1) from row 0, so a tile of rows [first, first + n) is an offset (from an odd
// first, its first pair starts a row early, that row weighing 0). Only heads whose rows all lie
// in the products' range (rows outside a tile meet weight 0 in its pairs, and 0 · inf is NaN)
// and whose pairs fit kMaxWords; the others are packed per tile.
struct HeadPairs {
  static constexpr int64_t kMaxWords = int64_t{8} << 20;  // per thread: 32 MiB
  bool amx = false;
  int64_t b = -1, kvh = -1, group = 0;
  int64_t pitch[2] = {0, 0}, words_per_head[2] = {0, 0};  // [0] q, [1] dout
  std::vector<uint8_t> state;  // per (head of the group, tensor): 0 not packed yet, 1 packed, 2 per tile
  hwy::AlignedFreeUniquePtr<uint32_t[]> words;
  size_t capacity = 0;

  // Head h's rows of `rows` (tensor 0: q, width Dk; 1: dout, width Dv) as pairs, or nullptr
  // (then the caller packs per tile). in_range(): whether every row of the head lies in the
  // products' range, asked once. scratch: PackAmxValuePairs' (64 · width words).
  template <typename InRange>
  const uint32_t* get(const Problem& p, const View4& rows, int tensor, int64_t b_, int64_t kvh_, int64_t h,
                      const InRange& in_range, uint32_t* scratch) {
    if (b != b_ || kvh != kvh_) start(p, b_, kvh_);
    uint8_t& st = state[static_cast<size_t>(2 * (h - kvh * group) + tensor)];
    if (st == 0) {
      st = in_range() ? 1 : 2;
      if (st == 1) {
        const int64_t width = tensor == 0 ? p.Dk : p.Dv;
        uint32_t* at = slot(h, tensor);
        if (amx) {
          PackAmxValuePairs(rows.at<uint16_t>(b, h, 0), rows.strides[2], p.Nq, width, scratch, at, pitch[tensor]);
        } else {
          PackBf16ValuePairs(rows.at<uint16_t>(b, h, 0), rows.strides[2], p.Nq, width, at);
        }
      }
    }
    return st == 1 ? slot(h, tensor) : nullptr;
  }

 private:
  uint32_t* slot(int64_t h, int tensor) const {
    return words.get() + (h - kvh * group) * (words_per_head[0] + words_per_head[1]) + tensor * words_per_head[0];
  }
  void start(const Problem& p, int64_t b_, int64_t kvh_) {
    b = b_, kvh = kvh_, group = p.group;
    const int64_t pairs = (p.Nq + 1) / 2;
    for (int t = 0; t < 2; ++t) {
      const int64_t width = std::max<int64_t>(1, t == 0 ? p.Dk : p.Dv);
      // AMX: columns of whole 16-pair chunks and 16 words more (a last A tile reads past).
      pitch[t] = amx ? (pairs + 15) / 16 * 16 + 16 : width;
      words_per_head[t] = amx ? (width + 15) / 16 * 16 * pitch[t] : std::max<int64_t>(1, pairs) * width;
    }
    const int64_t total = group * (words_per_head[0] + words_per_head[1]);
    const bool fits = total <= kMaxWords;
    state.assign(static_cast<size_t>(2 * group), fits ? 0 : 2);
    if (fits && capacity < static_cast<size_t>(total)) {
      words = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(total));
      capacity = static_cast<size_t>(total);
    }
  }
};

// acc[e·mq + lane] += Σ_{r < n} w[r·mq + lane] · row_{first + r}[e] for e < width, w holding
// bfloat16 values in float32 and rows bfloat16: from the head's pairs as HeadPairs packed them
// (head, pitch), else packed here from rows (row first, stride apart; n ≤ kTileKeys). With alpha
// 1, AmxDotAccumulate where the call's products use AMX (amx; vt its packed rows), else
// Bf16DotAccumulate (only where kBf16DotTarget and T is float; BackwardScratch::grad_pairs is
// false elsewhere). row_pairs and scratch: PackBf16ValuePairs' and the weight pairs' scratch.
template <typename T>
HWY_INLINE void Bf16Accumulate(const T* w, size_t mq, int64_t first, int64_t n, const uint32_t* head, int64_t pitch,
                               const uint16_t* rows, int64_t stride, int64_t width, bool amx, uint32_t* row_pairs,
                               uint32_t* vt, uint32_t* scratch, T* acc) {
  if constexpr (kBf16DotTarget && std::is_same_v<T, float>) {
    alignas(64) float ones[64];
    std::fill(ones, ones + 64, 1.0f);
    if (head != nullptr) {
      amx ? AmxDotAccumulate(w, mq, first, n, head, width, ones, scratch, acc, pitch)
          : Bf16DotAccumulate(w, mq, first, n, head, width, ones, scratch, acc);
    } else if (amx) {
      PackAmxValuePairs(rows, stride, n, width, row_pairs, vt);
      AmxDotAccumulate(w, mq, 0, n, vt, width, ones, scratch, acc);
    } else {
      PackBf16ValuePairs(rows, stride, n, width, row_pairs);
      Bf16DotAccumulate(w, mq, 0, n, row_pairs, width, ones, scratch, acc);
    }
  } else {
    (void)w, (void)mq, (void)first, (void)n, (void)head, (void)pitch, (void)rows, (void)stride, (void)width,
        (void)amx, (void)row_pairs, (void)vt, (void)scratch, (void)acc;
    HWY_ASSERT(false);
  }
}

// Bf16DsKeys (AmxDsKeys where the call has AMX) where it exists (kBf16DotTarget, T float;
// BackwardScratch::grad_pairs is false elsewhere).
template <typename T>
HWY_INLINE void Bf16DsKeysOf(const T* w, size_t mq, int64_t n, int64_t nk, const uint32_t* kp, int64_t width,
                             uint32_t* wp, bool amx, T* acc) {
  if constexpr (kBf16DotTarget && std::is_same_v<T, float>) {
    (amx ? AmxDsKeys : Bf16DsKeys)(w, mq, n, nk, kp, width, wp, acc);
  } else {
    (void)w, (void)mq, (void)n, (void)nk, (void)kp, (void)width, (void)wp, (void)amx, (void)acc;
    HWY_ASSERT(false);
  }
}

// Per-thread tiles of the backward pass.
template <typename T>
struct BackwardScratch {
  BackwardScratch(const Problem& p, size_t mq, KernelPath dot, bool grad_pairs = false)
      : bf16_dot(dot != KernelPath::kSimd),
        amx(dot == KernelPath::kAmxBf16),
        grad_pairs(grad_pairs),
        rp(hwy::AllocateAligned<uint32_t>(grad_pairs ? (kTileKeys / 2 + 1) * std::max<int64_t>({1, p.Dk, p.Dv}) : 1)),
        wp(hwy::AllocateAligned<uint32_t>(grad_pairs ? kAmxPairsRow * mq : 1)),  // (a tile from an odd row: 65 pairs, 5 chunks)
        vt(hwy::AllocateAligned<uint32_t>(grad_pairs && amx ? amx_value_pairs_size(std::max<int64_t>({1, p.Dk, p.Dv})) : 1)),
        kq(hwy::AllocateAligned<uint32_t>(grad_pairs ? mq / 2 * padded_width(p.Dk, hn::Lanes(hn::ScalableTag<T>())) : 1)),
        xp(hwy::AllocateAligned<uint32_t>(bf16_dot ? (std::max<int64_t>({1, p.Dk, p.Dv}) + 1) / 2 * mq : 1)),
        yp(hwy::AllocateAligned<uint32_t>(bf16_dot ? (std::max<int64_t>({1, p.Dk, p.Dv}) + 1) / 2 * mq : 1)),
        xt(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dk) * mq)),
        yt(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dv) * mq)),
        gk(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dk) * mq)),
        gv(hwy::AllocateAligned<T>(std::max<int64_t>(1, p.Dv) * mq)),
        pt(hwy::AllocateAligned<T>(kTileKeys * mq)),
        dpt(hwy::AllocateAligned<T>(kTileKeys * mq)),
        ct(hwy::AllocateAligned<T>(p.softcap != 0 ? kTileKeys * mq : 1)),
        mask_rows(hwy::AllocateAligned<T>(kTileKeys * mq)),
        m(hwy::AllocateAligned<T>(mq)),
        l(hwy::AllocateAligned<T>(mq)),
        lane_lse(hwy::AllocateAligned<T>(mq)),
        lane_D(hwy::AllocateAligned<T>(mq)),
        zt(hwy::AllocateAligned<T>(mq)),
        ktile(hwy::AllocateAligned<T>(kTileKeys * std::max<int64_t>(1, p.Dk))),
        vtile(hwy::AllocateAligned<T>(kTileKeys * std::max<int64_t>(1, p.Dv))),
        qtile(hwy::AllocateAligned<T>(kTileKeys * std::max<int64_t>(1, p.Dk))),
        dtile(hwy::AllocateAligned<T>(kTileKeys * std::max<int64_t>(1, p.Dv))),
        kpad(hwy::AllocateAligned<T>(mq * padded_width(p.Dk, hn::Lanes(hn::ScalableTag<T>())))),
        grad_row(static_cast<size_t>(std::max<int64_t>(1, std::max(p.Dk, p.Dv)))),
        grad_row2(grad_row.size()),
        lanes(mq),
        rows(kTileKeys) {
    std::fill(zt.get(), zt.get() + mq, T(0));
    heads.amx = amx;
  }
  // Bfloat16 inputs with the AVX512_BF16 path: xt and yt's operands also in bfloat16 pairs
  // (bf16_dot.h), for the score and dout · vᵀ products; blocks that must not use them widen.
  bool bf16_dot, amx;  // amx: their products with AmxDotScores
  // Options::precision kFast, bfloat16, no dropout: dv's, dk's and the dq pass's products with
  // vdpbf16ps (bf16_dot.h's Bf16DotAccumulate) from the rounded p~ and ds~, where the rows they
  // meet are in its range; rp holds those rows in pairs, wp the weights in pairs.
  bool grad_pairs;
  hwy::AlignedFreeUniquePtr<uint32_t[]> rp, wp;
  hwy::AlignedFreeUniquePtr<uint32_t[]> vt, kq;  // vt: AMX's packed rows (amx); kq: the one-pass dq's key pairs (Bf16DsKeys)
  HeadPairs heads;  // grad_pairs: the q and dout rows of the kv head's group in pairs
  hwy::AlignedFreeUniquePtr<uint32_t[]> xp, yp;
  hwy::AlignedFreeUniquePtr<T[]> xt, yt;  // transposed inputs: (k, v) or (q, dout) of the block
  hwy::AlignedFreeUniquePtr<T[]> gk, gv;  // gradient accumulators: (dk, dv) or (dq, unused)
  hwy::AlignedFreeUniquePtr<T[]> pt, dpt, ct, mask_rows, m, l;  // score tiles, MaskScores' rows, BeginBlock's m, l
  // ct: the softcap's ∂s/∂x over the score tile (with a softcap; else unused)
  hwy::AlignedFreeUniquePtr<T[]> lane_lse, lane_D;  // per query lane: lse and D
  hwy::AlignedFreeUniquePtr<T[]> zt;  // a tile row's dropout factors (padding lanes: 0 or stale; their p is 0)
  hwy::AlignedFreeUniquePtr<T[]> ktile, vtile, qtile, dtile;  // rows of k, v, q, dout widened to T (ReadRows)
  hwy::AlignedFreeUniquePtr<T[]> kpad;  // the one-pass plan: the block's keys, rows padded to whole vectors
  std::vector<T> grad_row, grad_row2;               // one gradient row before write_row
  std::vector<LaneRow> lanes;  // the dq pass's lanes
  std::vector<LaneRow> rows;   // the dk/dv pass's query rows of one tile
};

// ds ← CapSlope(ds, c) over n contiguous entries, c the softcap's slope tile (MaskScores').
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void ApplySlope(D d, T* HWY_RESTRICT ds, const T* HWY_RESTRICT slope, int64_t n) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t x = 0; x < n; x += N) {  // n is whole vectors (tiles are)
    hn::Store(CapSlope(d, hn::Load(d, ds + x), hn::Load(d, slope + x)), d, ds + x);
  }
}

// Row statistics the passes share, contiguous: lse (+inf where the row has no allowed key,
// so that exp(s - lse) = 0 there) and D = dout · out; and which rows of q and dout, and which
// key rows of k, hold a NaN or inf (`*_bad`, with `any_bad_*` to skip the checks when none do).
template <typename T>
struct RowStats {
  std::vector<T> lse, D;
  std::vector<uint8_t> q_bad, dout_bad, k_bad;  // per row (b, h, i); per row (b, h, i); per key (b, kvh, j)
  bool any_bad_rows = false, any_bad_keys = false;
  // With bfloat16 products: whether each row of q and of dout lies in their range
  // (Bf16RowsInDotRange), scanned once here rather than once per key block.
  std::vector<uint8_t> q_dot, dout_dot;
  int64_t Hq = 0, Nq = 0, Hkv = 0, Nk = 0;
  int64_t index(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * Nq + i; }
  int64_t key_index(int64_t b, int64_t kvh, int64_t j) const { return (b * Hkv + kvh) * Nk + j; }
  // Whether rows [i0, i0 + n) of head (b, h) all have their flag set.
  static bool all_rows(const std::vector<uint8_t>& flags, int64_t at, int64_t n) {
    return std::all_of(flags.begin() + at, flags.begin() + at + n, [](uint8_t f) { return f != 0; });
  }
};

// acc[r][c] += Σ_{l < nk} w[r·mq + l] · keys[l][c] for NR rows r and NV vectors of columns c:
// dq += ds · k with the ds tile as KeyBlockGrads holds it (query rows × key lanes); keys and
// acc rows `width` apart (whole vectors). Each accumulator is a chain of fused multiply-adds
// in key order; keys flagged in `bad` are skipped here (AccumulateDsKeys adds them).
template <size_t NR, size_t NV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void DsKeysBlock(D d, const T* HWY_RESTRICT w, size_t mq, int64_t nk, const T* HWY_RESTRICT keys,
                            int64_t width, const uint8_t* bad, T* HWY_RESTRICT acc) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> a[NR][NV];
  for (size_t r = 0; r < NR; ++r)
    for (size_t v = 0; v < NV; ++v) a[r][v] = hn::Load(d, acc + static_cast<int64_t>(r) * width + v * N);
  for (int64_t l = 0; l < nk; ++l) {
    if (bad != nullptr && bad[l]) continue;
    hn::Vec<D> k[NV];
    for (size_t v = 0; v < NV; ++v) k[v] = hn::Load(d, keys + l * width + v * N);
    for (size_t r = 0; r < NR; ++r) {
      const auto x = hn::Set(d, w[r * mq + static_cast<size_t>(l)]);
      for (size_t v = 0; v < NV; ++v) a[r][v] = hn::MulAdd(x, k[v], a[r][v]);
    }
  }
  for (size_t r = 0; r < NR; ++r)
    for (size_t v = 0; v < NV; ++v) hn::Store(a[r][v], d, acc + static_cast<int64_t>(r) * width + v * N);
}

// dq rows [0, n) += ds · k (DsKeysBlock over all rows and columns; NR·NV accumulators + NV
// loads + 1 broadcast fit the target's registers). A key row holding a NaN or inf (`bad`)
// is added last and skips the rows that give it ds = 0, where 0 · inf would be NaN.
template <class D, typename T = hn::TFromD<D>>
void AccumulateDsKeys(D d, const T* HWY_RESTRICT w, int64_t n, size_t mq, int64_t nk, const T* HWY_RESTRICT keys,
                      int64_t width, const uint8_t* bad, T* HWY_RESTRICT acc) {
  constexpr size_t NR = kVectorRegisters >= 32 ? 6 : 2, NV = 4;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t c = 0; c < width;) {
    const bool whole = c + static_cast<int64_t>(NV) * N <= width;
    int64_t r = 0;
    for (; r + static_cast<int64_t>(NR) <= n; r += NR) {
      const T* wr = w + r * static_cast<int64_t>(mq);
      T* ar = acc + r * width + c;
      whole ? DsKeysBlock<NR, NV>(d, wr, mq, nk, keys + c, width, bad, ar)
            : DsKeysBlock<NR, 1>(d, wr, mq, nk, keys + c, width, bad, ar);
    }
    for (; r < n; ++r) {
      const T* wr = w + r * static_cast<int64_t>(mq);
      T* ar = acc + r * width + c;
      whole ? DsKeysBlock<1, NV>(d, wr, mq, nk, keys + c, width, bad, ar)
            : DsKeysBlock<1, 1>(d, wr, mq, nk, keys + c, width, bad, ar);
    }
    c += whole ? static_cast<int64_t>(NV) * N : N;
  }
  for (int64_t l = 0; bad != nullptr && l < nk; ++l) {
    if (!bad[l]) continue;
    for (int64_t r = 0; r < n; ++r) {
      const T x = w[r * static_cast<int64_t>(mq) + l];
      if (x == T(0)) continue;
      for (int64_t c = 0; c < width; ++c) acc[r * width + c] += x * keys[l * width + c];
    }
  }
}

// The one-pass plan: how many chunks each (b, kv head)'s key blocks are dealt into (block
// kb goes to chunk kb mod chunks, which interleaves a causal mask's long and short blocks),
// or 0 for the two-pass plan. Enough units for 16 threads where the key blocks allow, with
// the chunks' float dq rows at most one dq's worth or 32 MiB, whichever is more (FlashAttention
// keeps one float dq too); two passes where that leaves fewer than 4 units (one long head:
// N = 65536, D = 64 would need 16 MiB per chunk). A function of the shape and the target's
// block size only, so the summation order, and with it every bit, is the same for any
// thread count.
inline int64_t OnePassChunks(const Problem& p, int64_t key_blocks, int64_t dq_row_bytes) {
  constexpr int64_t kUnits = 16, kMinUnits = 4, kSpareBytes = int64_t{32} << 20;
  const int64_t heads = p.B * p.Hkv;
  const int64_t dq_bytes = std::max<int64_t>(1, p.B * p.Hq * p.Nq * dq_row_bytes);
  int64_t chunks = std::min(key_blocks, ceil_blocks(kUnits, heads));
  chunks = std::min(chunks, std::max(dq_bytes, kSpareBytes) / dq_bytes);
  return chunks >= 1 && heads * chunks >= kMinUnits ? chunks : 0;
}

// dk, dv for keys [j0, j0 + nk) of kv head (b, kvh): keys in lanes. With dq_rows (the
// one-pass plan: rows (h - kvh·group, i) of the group's float dq, padded_width(Dk) apart),
// also dq += ds · k for the rows that see these keys.
template <class D, typename T = hn::TFromD<D>>
void KeyBlockGrads(D d, const BackwardProblem& bp, const RowStats<T>& rs, int64_t b, int64_t kvh, int64_t j0,
                   BackwardScratch<T>& s, T* dq_rows) {
  constexpr size_t QV = kBackwardQV;
  using V = hn::Vec<D>;
  const Problem& p = bp.fwd;
  const size_t N = hn::Lanes(d), mq = QV * N;
  const int64_t nk = std::min<int64_t>(static_cast<int64_t>(mq), p.Nk - j0);
  const T scale = static_cast<T>(p.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  // Options::precision kFast: dv's p and dk's (and dq's) ds rounded to q's 16-bit type.
  const bool rounds = std::is_same_v<T, float> && p.round_p;
  // kt = k · scale and vt, transposed; padding lanes zero.
  std::fill(s.xt.get(), s.xt.get() + p.Dk * mq, T(0));
  std::fill(s.yt.get(), s.yt.get() + p.Dv * mq, T(0));
  // Keys past the sequence's length are never read (their lanes stay zero; no row sees them).
  const int64_t nread = std::clamp<int64_t>(p.keys_of(b) - j0, 0, nk);
  const Rows<T> keys = ReadRows(d, p.k, b, kvh, j0, nread, p.Dk, s.ktile.get());
  const Rows<T> values = ReadRows(d, p.v, b, kvh, j0, nread, p.Dv, s.vtile.get());
  for (int64_t l = 0; l < nread; ++l) {
    const T* k = keys.row(l);
    const T* v = values.row(l);
    for (int64_t c = 0; c < p.Dk; ++c) s.xt[c * mq + l] = k[c] * scale;
    for (int64_t e = 0; e < p.Dv; ++e) s.yt[e * mq + l] = v[e];
  }
  const int64_t dq_width = padded_width(p.Dk, N);
  const uint8_t* k_bad = rs.any_bad_keys ? rs.k_bad.data() + rs.key_index(b, kvh, j0) : nullptr;
  bool k_pairs = false, v_pairs = false;  // the same keys and values in bfloat16 pairs
  if (s.bf16_dot) {
    k_pairs = pack_bf16_pairs([&](int64_t l) { return p.k.at<uint16_t>(b, kvh, j0 + l); }, nread, p.Dk, mq, s.xp.get());
    v_pairs = pack_bf16_pairs([&](int64_t l) { return p.v.at<uint16_t>(b, kvh, j0 + l); }, nread, p.Dv, mq, s.yp.get());
  }
  // kFast's dq += ds~ · k from bfloat16 key pairs (Bf16DsKeys), packed once here for every head
  // and row tile of the block.
  const bool ds_pairs = dq_rows != nullptr && s.grad_pairs && k_pairs;
  if constexpr (kBf16DotTarget && std::is_same_v<T, float>) {
    if (ds_pairs) {
      PackBf16KeyPairs(p.k.at<uint16_t>(b, kvh, j0), p.k.strides[2], nread, p.Dk, dq_width,
                       static_cast<int64_t>(mq) / 2, s.kq.get());
    }
  }
  if (dq_rows != nullptr && !ds_pairs) {  // AccumulateDsKeys' keys: unscaled, rows padded with zeros to whole vectors
    std::fill(s.kpad.get(), s.kpad.get() + nk * dq_width, T(0));
    for (int64_t l = 0; l < nread; ++l) std::copy_n(keys.row(l), p.Dk, s.kpad.get() + l * dq_width);
  }
  std::fill(s.gk.get(), s.gk.get() + p.Dk * mq, T(0));
  std::fill(s.gv.get(), s.gv.get() + p.Dv * mq, T(0));
  V ones[QV];
  for (size_t q = 0; q < QV; ++q) ones[q] = hn::Set(d, T(1));

  // Only rows in [rows.first, rows.last) can see a key of the block (causal and windows).
  const RowInterval rows = rows_seeing_keys(p, b, j0, j0 + nk);
  for (int64_t h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
    for (int64_t i0 = rows.first; i0 < rows.last; i0 += kTileKeys) {
      // Rows of this tile that see any key of the block (and whose block mask allows one); the
      // others contribute nothing.
      int64_t first = -1, last = -1;
      BlockRowsSeeKeys allowed(p, b);
      for (int64_t i = i0; i < std::min(rows.last, i0 + kTileKeys); ++i) {
        const KeyRange kr = p.key_range(b, i);
        const int64_t lo = std::max(kr.begin, j0), hi = std::min(kr.end, j0 + nk);
        const bool sees = lo < hi && (!p.block_mask || allowed(h, i, lo, hi));
        if (sees && rs.lse[rs.index(b, h, i)] != T(INFINITY)) {
          if (first < 0) first = i;
          last = i;
        }
      }
      if (first < 0) continue;
      const int64_t n = last + 1 - first;
      // The rows of q and dout as T, read (widened, for 16-bit storage) only by a product that
      // does not take them as bfloat16 pairs: widening them for every block of keys cost kFast's
      // dk/dv pass a tenth of its time when every product reads pairs.
      Rows<T> qrows{}, drows{};
      const auto q_rows = [&]() -> const Rows<T>& {
        if (qrows.data == nullptr) qrows = ReadRows(d, p.q, b, h, first, n, p.Dk, s.qtile.get());
        return qrows;
      };
      const auto dout_rows = [&]() -> const Rows<T>& {
        if (drows.data == nullptr) drows = ReadRows(d, bp.dout, b, h, first, n, p.Dv, s.dtile.get());
        return drows;
      };
      T* pt = s.pt.get();
      T* dpt = s.dpt.get();
      // p = exp(s - lse) with s = q · (k·scale) + bias, -inf outside the row's keys and in the
      // padding lanes past nk.
      // (The broadcast rows, q and dout here, must be in the pairs' range too.)
      if (k_pairs && RowStats<T>::all_rows(rs.q_dot, rs.index(b, h, first), n)) {
        Bf16Dot(s.xp.get(), mq, p.Dk, p.q, b, h, first, n, p.scale, s.amx, pt);
      } else {
        OuterScores<QV>(d, s.xt.get(), mq, q_rows().data, q_rows().stride, p.Dk, n, pt);
      }
      for (int64_t r = 0; r < n; ++r) {
        const KeyRange kr = p.key_range(b, first + r);
        s.rows[r] = {h, first + r, kr.begin, kr.end};
      }
      T* slope = p.softcap != 0 ? s.ct.get() : nullptr;
      MaskScores<QV, TileLayout::kRowMajor>(d, p, b, s.rows.data(), n, j0, nk, /*edges=*/true, pt, mq,
                                            static_cast<T*>(nullptr), slope);
      for (int64_t r = 0; r < n; ++r) {
        T* row = pt + r * mq;
        std::fill(row + nk, row + mq, neg_inf);
        const V lse = hn::Set(d, rs.lse[rs.index(b, h, first + r)]);
        for (size_t q = 0; q < QV; ++q) hn::Store(Probability(d, hn::Load(d, row + q * N), lse), d, row + q * N);
      }
      // dp = dout · vᵀ;  ds = p · (z·dp - D);  dv += Σ_i z·p_i · dout_i;  dk += Σ_i ds_i · q_i,
      // with z the dropout factor (1 without dropout).
      if (v_pairs && RowStats<T>::all_rows(rs.dout_dot, rs.index(b, h, first), n)) {
        Bf16Dot(s.yp.get(), mq, p.Dv, bp.dout, b, h, first, n, 1.0, s.amx, dpt);
      } else {
        OuterScores<QV>(d, s.yt.get(), mq, dout_rows().data, dout_rows().stride, p.Dv, n, dpt);
      }
      T* z = s.zt.get();  // row r's dropout factors, key lanes [0, nk)
      for (int64_t r = 0; r < n; ++r) {
        const V Di = hn::Set(d, rs.D[rs.index(b, h, first + r)]);
        if (p.dropout.enabled()) {
          for (int64_t l = 0; l < nk; ++l) z[l] = p.dropout.factor<T>(b, h, first + r, j0 + l);
        }
        for (size_t q = 0; q < QV; ++q) {
          T* x = dpt + r * mq + q * N;
          T* pr = pt + r * mq + q * N;
          const V pq = hn::Load(d, pr);
          V dp = hn::Load(d, x);
          if (p.dropout.enabled()) {
            const V zq = hn::Load(d, z + q * N);
            dp = DroppedDp(d, zq, dp);
            hn::Store(hn::Mul(rounds ? RoundTo16(d, p, pq) : pq, zq), d, pr);  // dv's weight z·p (kFast: z·p~)
          } else if (rounds) {
            hn::Store(RoundTo16(d, p, pq), d, pr);  // kFast: dv's weight p~
          }
          hn::Store(Ds(d, pq, dp, Di), d, x);
        }
      }
      if (slope != nullptr) ApplySlope(d, dpt, slope, n * static_cast<int64_t>(mq));  // (padding lanes: ds = 0)
      if (rounds) RoundTo16InPlace(d, p, dpt, n * static_cast<int64_t>(mq));  // kFast: dk's and dq's ds~
      // A row whose q or dout holds a NaN or inf reaches no key it gives weight 0.
      const uint8_t *q_bad = nullptr, *dout_bad = nullptr;
      if (rs.any_bad_rows) {
        q_bad = rs.q_bad.data() + rs.index(b, h, first);
        dout_bad = rs.dout_bad.data() + rs.index(b, h, first);
      }
      // dv += Σ_r p~_r · dout_r and dk += Σ_r ds~_r · q_r: vdpbf16ps on kFast's bfloat16 values
      // where the rows are in its range (which leaves out NaN and inf), else float32 products.
      if (s.grad_pairs && RowStats<T>::all_rows(rs.dout_dot, rs.index(b, h, first), n)) {
        const uint32_t* head = s.heads.get(p, bp.dout, 1, b, kvh, h, [&] {
          return RowStats<T>::all_rows(rs.dout_dot, rs.index(b, h, 0), p.Nq);
        }, s.rp.get());
        Bf16Accumulate(pt, mq, first, n, head, s.heads.pitch[1], bp.dout.at<uint16_t>(b, h, first), bp.dout.strides[2],
                       p.Dv, s.amx, s.rp.get(), s.vt.get(), s.wp.get(), s.gv.get());
      } else {
        AccumulateRows<QV>(d, pt, n, mq, dout_rows().data, dout_rows().stride, p.Dv, ones, dout_bad, s.gv.get());
      }
      if (s.grad_pairs && RowStats<T>::all_rows(rs.q_dot, rs.index(b, h, first), n)) {
        const uint32_t* head = s.heads.get(p, p.q, 0, b, kvh, h, [&] {
          return RowStats<T>::all_rows(rs.q_dot, rs.index(b, h, 0), p.Nq);
        }, s.rp.get());
        Bf16Accumulate(dpt, mq, first, n, head, s.heads.pitch[0], p.q.at<uint16_t>(b, h, first), p.q.strides[2], p.Dk,
                       s.amx, s.rp.get(), s.vt.get(), s.wp.get(), s.gk.get());
      } else {
        AccumulateRows<QV>(d, dpt, n, mq, q_rows().data, q_rows().stride, p.Dk, ones, q_bad, s.gk.get());
      }
      if (dq_rows != nullptr) {
        T* acc = dq_rows + ((h - kvh * p.group) * p.Nq + first) * dq_width;
        // kFast: ds~ · k with vdpbf16ps or, where the call has AMX, on tiles (k_pairs: the keys in
        // their range). (On Sapphire Rapids vdpbf16ps was slower than widening; PERFORMANCE.md.)
        if (ds_pairs) {
          Bf16DsKeysOf(dpt, mq, n, nread, s.kq.get(), dq_width, s.wp.get(), s.amx, acc);
        } else {
          AccumulateDsKeys(d, dpt, n, mq, nread, s.kpad.get(), dq_width, k_bad, acc);
        }
      }
    }
  }
  T* dk = s.grad_row.data();
  T* dv = s.grad_row2.data();
  for (int64_t l = 0; l < nk; ++l) {
    // (+0 for a zero: the same bits as the equivalent element mask's call, which adds the +0
    // terms of the rows this pass skips; positive_zero in flash_plan.h.)
    for (int64_t c = 0; c < p.Dk; ++c) dk[c] = positive_zero(s.gk[c * mq + l] * scale);
    for (int64_t e = 0; e < p.Dv; ++e) dv[e] = positive_zero(s.gv[e * mq + l]);
    write_row(bp.dk, b, kvh, j0 + l, dk, p.Dk);
    write_row(bp.dv, b, kvh, j0 + l, dv, p.Dv);
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
  BlockState<T> bs{blk,          {},      s.xt.get(), s.gv.get(), s.m.get(), s.l.get(), s.lanes.data(),
                   /*bad=*/nullptr, s.bf16_dot ? s.xp.get() : nullptr};
  BeginBlock(p, blk, 0, p.Nk, mq, bs);  // qt = q · scale (or bfloat16 pairs in qp), lanes and span
  const bool dout_pairs =
      s.bf16_dot && pack_bf16_pairs([&](int64_t l) { return bp.dout.at<uint16_t>(blk.b, bs.lanes[l].h, bs.lanes[l].i); },
                                    blk.rows, p.Dv, mq, s.yp.get());
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
    for (int64_t e = 0; e < p.Dv; ++e) s.yt[e * mq + l] = bp.dout.load<T>(blk.b, r.h, r.i, e);
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
  for (int64_t t = tile_start(bs.span.begin); t < bs.span.end; t += kTileKeys) {
    const int64_t j0 = std::max(t, bs.span.begin);
    const int64_t n = std::min(t + kTileKeys, bs.span.end) - j0;
    const bool partial = j0 < bs.span.max_begin || j0 + n > bs.span.min_end;
    // A tile the block mask blocks for every lane adds ds = 0 to dq: skipped unread.
    if (p.block_mask && !lanes_see_keys(p, blk.b, bs.lanes, blk.rows, j0, j0 + n)) continue;
    T* pt = s.pt.get();
    T* dpt = s.dpt.get();
    const Rows<T> keys = ReadRows(d, p.k, blk.b, blk.kvh, j0, n, p.Dk, s.ktile.get());  // (dq += ds · k)
    const bool keys_in_range = bs.qp != nullptr && TileRowsInDotRange(d, p, p.k, p.Dk, blk.b, blk.kvh, t);
    T* slope = p.softcap != 0 ? s.ct.get() : nullptr;
    ScoreTile<QV>(d, p, bs, pt, mq, j0, n, partial, keys, keys_in_range, s.mask_rows.get(), slope);
    if (dout_pairs && Bf16RowsInDotRange(d, p.v.at<uint16_t>(blk.b, blk.kvh, j0), p.v.strides[2], n, p.Dv)) {  // dp = dout · vᵀ
      Bf16Dot(s.yp.get(), mq, p.Dv, p.v, blk.b, blk.kvh, j0, n, 1.0, s.amx, dpt);
    } else {
      const Rows<T> values = ReadRows(d, p.v, blk.b, blk.kvh, j0, n, p.Dv, s.vtile.get());
      OuterScores<QV>(d, s.yt.get(), mq, values.data, values.stride, p.Dv, n, dpt);
    }
    T* z = s.zt.get();  // key j's dropout factor per row lane [0, blk.rows)
    for (int64_t j = 0; j < n; ++j) {
      if (p.dropout.enabled()) {
        for (int64_t l = 0; l < blk.rows; ++l) z[l] = p.dropout.factor<T>(blk.b, bs.lanes[l].h, bs.lanes[l].i, j0 + j);
      }
      for (size_t q = 0; q < QV; ++q) {
        const V pj = Probability(d, hn::Load(d, pt + j * mq + q * N), lse[q]);
        T* x = dpt + j * mq + q * N;
        V dp = hn::Load(d, x);
        if (p.dropout.enabled()) dp = DroppedDp(d, hn::Load(d, z + q * N), dp);
        hn::Store(Ds(d, pj, dp, Dv[q]), d, x);  // ds = p · (z·dp - D)
      }
    }
    if (slope != nullptr) ApplySlope(d, dpt, slope, n * static_cast<int64_t>(mq));
    if (std::is_same_v<T, float> && p.round_p) RoundTo16InPlace(d, p, dpt, n * static_cast<int64_t>(mq));  // kFast: dq's ds~, as the key pass rounds it
    // dq += ds · k; a key row holding a NaN or inf reaches no row that gives it weight 0.
    const uint8_t* k_bad = rs.any_bad_keys ? rs.k_bad.data() + rs.key_index(blk.b, blk.kvh, j0) : nullptr;
    if (s.grad_pairs && Bf16RowsInDotRange(d, p.k.at<uint16_t>(blk.b, blk.kvh, j0), p.k.strides[2], n, p.Dk)) {
      Bf16Accumulate(dpt, mq, 0, n, static_cast<const uint32_t*>(nullptr), 0, p.k.at<uint16_t>(blk.b, blk.kvh, j0),
                     p.k.strides[2], p.Dk, s.amx, s.rp.get(), s.vt.get(), s.wp.get(), s.gk.get());
    } else {
      AccumulateRows<QV>(d, dpt, n, mq, keys.data, keys.stride, p.Dk, ones, k_bad, s.gk.get());
    }
  }
  T* dq = s.grad_row.data();
  for (int64_t l = 0; l < blk.rows; ++l) {
    for (int64_t c = 0; c < p.Dk; ++c) dq[c] = positive_zero(s.gk[c * mq + l] * scale);  // (as dk)
    write_row(bp.dq, blk.b, bs.lanes[l].h, bs.lanes[l].i, dq, p.Dk);
  }
}

// The per-row and per-key facts the passes below read, for the calling thread's share of the
// rows and keys (called by every thread of the parallel region; it ends in a barrier). A function
// of its own: clang 14 crashes compiling this body inlined into the parallel region.
template <class D, typename T>
void ScanRows(D d, const BackwardProblem& bp, RowStats<T>& rs, bool bf16_dot, int& any_bad_rows, int& any_bad_keys) {
  const Problem& p = bp.fwd;
  // One row of q, dout, out or k as T (in place, or widened exactly: 16-bit storage).
  const int64_t width = std::max(p.Dk, p.Dv);
  std::vector<T> wide(static_cast<size_t>(2 * width));
  const auto row = [&](const View4& v, int64_t b, int64_t h, int64_t n, int64_t w, int64_t slot) {
    return ReadRows(d, v, b, h, n, 1, w, wide.data() + slot * width).data;
  };
  // Rows of q, dout and k holding a NaN or inf: rare, and then the passes treat them apart.
  int bad_keys = 0, bad_rows = 0;  // this thread's share, or-ed into the shared flags at the end
#pragma omp for schedule(static) nowait
  for (int64_t bk = 0; bk < p.B * p.Hkv; ++bk) {
    for (int64_t j = 0; j < p.keys_of(bk / p.Hkv); ++j) {  // (keys past the length stay 0: unread)
      uint8_t& bad = rs.k_bad[rs.key_index(bk / p.Hkv, bk % p.Hkv, j)];
      bad = AnyNonFinite(d, row(p.k, bk / p.Hkv, bk % p.Hkv, j, p.Dk, 0), p.Dk);
      bad_keys |= bad;
    }
  }
#pragma omp for schedule(static) nowait
  for (int64_t bh = 0; bh < p.B * p.Hq; ++bh) {
    const int64_t b = bh / p.Hq, h = bh % p.Hq;
    for (int64_t i = 0; i < p.Nq; ++i) {
      const int64_t x = rs.index(b, h, i);
      rs.q_bad[x] = AnyNonFinite(d, row(p.q, b, h, i, p.Dk, 0), p.Dk);
      const T* dout = row(bp.dout, b, h, i, p.Dv, 0);
      const T* out = row(p.out, b, h, i, p.Dv, 1);
      rs.dout_bad[x] = AnyNonFinite(d, dout, p.Dv);
      bad_rows |= rs.q_bad[x] | rs.dout_bad[x];
      if (bf16_dot) {
        rs.q_dot[x] = Bf16RowsInDotRange(d, p.q.at<uint16_t>(b, h, i), 0, 1, p.Dk);
        rs.dout_dot[x] = Bf16RowsInDotRange(d, bp.dout.at<uint16_t>(b, h, i), 0, 1, p.Dv);
      }
      const T l = p.lse->load<T>(b, h, i, 0);
      rs.lse[x] = l == -std::numeric_limits<T>::infinity() ? T(INFINITY) : l;
      T dot = 0;  // D_i = dout_i · out_i
      for (int64_t e = 0; e < p.Dv; ++e) dot += dout[e] * out[e];
      rs.D[x] = dot;
    }
  }
#pragma omp atomic
  any_bad_keys |= bad_keys;
#pragma omp atomic
  any_bad_rows |= bad_rows;
#pragma omp barrier
}

template <typename T>
void FlashBackward(const BackwardProblem& bp) {
  const hn::ScalableTag<T> d;
  const Problem& p = bp.fwd;
  const int64_t mq = static_cast<int64_t>(kBackwardQV * hn::Lanes(d));
  RowStats<T> rs;
  rs.Hq = p.Hq;
  rs.Nq = p.Nq;
  rs.Hkv = p.Hkv;
  rs.Nk = p.Nk;
  rs.lse.resize(p.B * p.Hq * p.Nq);
  rs.D.resize(rs.lse.size());
  rs.q_bad.resize(rs.lse.size());
  rs.dout_bad.resize(rs.lse.size());
  rs.k_bad.resize(p.B * p.Hkv * p.Nk);
  const int64_t key_blocks = ceil_blocks(p.Nk, mq);
  const int64_t rows_per_head = p.Nq * p.group, query_blocks = ceil_blocks(rows_per_head, mq);
  // No more threads than units of the largest pass (set_num_threads may ask for millions).
  const int64_t units = std::max({p.B * p.Hq, p.B * p.Hkv * key_blocks, p.B * p.Hkv * query_blocks});
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), units)));
  // The score and dout · vᵀ products with vdpbf16ps when q, k, v and dout are all bfloat16.
  const KernelPath dot = bf16_dot_scale_ok(p.scale) ? Bf16DotPath<T>({p.q.dtype, p.k.dtype, p.v.dtype, bp.dout.dtype})
                                                    : KernelPath::kSimd;
  const bool bf16_dot = dot != KernelPath::kSimd;
  // kFast's bfloat16 gradient products (BackwardScratch::grad_pairs): AVX512_BF16 present and
  // allowed (bf16_dot), weights exact in bfloat16 (no dropout factor in them).
  const bool grad_pairs = kBf16DotTarget && std::is_same_v<T, float> && bf16_dot && p.round_p &&
                          p.dtype == DType::kBFloat16 && !p.dropout.enabled() && cpu_has_avx512_bf16();
  note_kernel_path(dot);

  if (bf16_dot) {
    rs.q_dot.resize(rs.lse.size());
    rs.dout_dot.resize(rs.lse.size());
  }
  int any_bad_rows = 0, any_bad_keys = 0;
  // The one-pass plan's float dq rows: (chunk, b, kv head) × (group · Nq rows of dq_width).
  const int64_t dq_width = padded_width(p.Dk, hn::Lanes(d));
  const int64_t chunks = OnePassChunks(p, key_blocks, dq_width * static_cast<int64_t>(sizeof(T)));
  const int64_t head_rows = p.group * p.Nq * dq_width;
  hwy::AlignedFreeUniquePtr<T[]> dq_chunks =
      hwy::AllocateAligned<T>(static_cast<size_t>(std::max<int64_t>(1, chunks * p.B * p.Hkv * head_rows)));

#pragma omp parallel num_threads(threads)
  {
    ScanRows(d, bp, rs, bf16_dot, any_bad_rows, any_bad_keys);
#pragma omp single
    {
      rs.any_bad_rows = any_bad_rows != 0;
      rs.any_bad_keys = any_bad_keys != 0;
    }  // (its barrier publishes them)
    BackwardScratch<T> s(p, static_cast<size_t>(mq), dot, grad_pairs);
    const AmxScope amx_scope(dot == KernelPath::kAmxBf16);  // tiles configured once per thread and call
    if (chunks == 0) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.Hkv * key_blocks; ++u) {
        const int64_t head = u / key_blocks;
        KeyBlockGrads(d, bp, rs, head / p.Hkv, head % p.Hkv, (u % key_blocks) * mq, s, static_cast<T*>(nullptr));
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.Hkv * query_blocks; ++u) {
        const int64_t head = u / query_blocks, r0 = (u % query_blocks) * mq;
        const BlockRows blk{head / p.Hkv, head % p.Hkv, r0, std::min(mq, rows_per_head - r0)};
        QueryBlockGrad(d, bp, rs, blk, s);
      }
    } else {
      // Unit (chunk, b, kv head): its key blocks in order, dq into the chunk's rows of the group.
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < chunks * p.B * p.Hkv; ++u) {
        const int64_t chunk = u / (p.B * p.Hkv), head = u % (p.B * p.Hkv);
        T* rows = dq_chunks.get() + u * head_rows;
        std::fill(rows, rows + head_rows, T(0));
        for (int64_t kb = chunk; kb < key_blocks; kb += chunks)
          KeyBlockGrads(d, bp, rs, head / p.Hkv, head % p.Hkv, kb * mq, s, rows);
      }
      // dq = scale · Σ_chunk rows, in chunk order.
      std::vector<T>& dq = s.grad_row;
      const T scale = static_cast<T>(p.scale);
#pragma omp for schedule(static)
      for (int64_t x = 0; x < p.B * p.Hq * p.Nq; ++x) {
        const int64_t b = x / (p.Hq * p.Nq), h = x / p.Nq % p.Hq, i = x % p.Nq;
        const T* row = dq_chunks.get() + (b * p.Hkv + h / p.group) * head_rows + (h % p.group * p.Nq + i) * dq_width;
        for (int64_t c = 0; c < p.Dk; ++c) {
          T sum = row[c];
          for (int64_t chunk = 1; chunk < chunks; ++chunk) sum += row[chunk * p.B * p.Hkv * head_rows + c];
          dq[c] = positive_zero(sum * scale);  // (as dk)
        }
        write_row(bp.dq, b, h, i, dq.data(), p.Dk);
      }
    }
  }
  if (bp.dsinks) {  // rs.lse is +inf where the given lse is -inf (or +inf): no sink's share
    store_sink_gradients(bp, [&](int64_t b, int64_t h, int64_t i) {
      const int64_t x = rs.index(b, h, i);
      const double lse = rs.lse[x] == T(INFINITY) ? -INFINITY : static_cast<double>(rs.lse[x]);
      return std::pair<double, double>{lse, static_cast<double>(rs.D[x])};
    });
  }
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_BACKWARD_INL_H_
