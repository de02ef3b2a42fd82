// A block of query rows along SIMD lanes, as the forward's blocks and the backward's dq pass
// hold it, compiled per SIMD target (included by forward_block-inl.h and backward-inl.h): its
// state (BlockState), its start (BeginBlock: lanes, key span, q packed transposed with the
// scale) and its scored, masked tiles (ScoreTile: OuterScores or the bfloat16 products, then
// MaskScores).

#if defined(SDPA_FLASH_QUERY_BLOCK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_QUERY_BLOCK_INL_H_
#undef SDPA_FLASH_QUERY_BLOCK_INL_H_
#else
#define SDPA_FLASH_QUERY_BLOCK_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <limits>

#include "flash/bf16_path-inl.h"
#include "flash/flash_plan.h"
#include "flash/products-inl.h"
#include "flash/row_stats.h"
#include "flash/rows-inl.h"
#include "flash/score_tile-inl.h"
#include "hwy/highway.h"
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
  bool qt_packed = false;   // qt written (with qp, only when a tile outside its range needs it)
};

// qt[d][lane] = q[lane's row][d] · scale, padding lanes zero.
template <typename T>
void PackBlockQueries(const Problem& p, BlockState<T>& bs, size_t mq) {
  std::fill(bs.qt, bs.qt + p.Dk * mq, T(0));
  for (int64_t l = 0; l < bs.blk.rows; ++l) {
    PackScaledQuery(p, bs.blk.b, bs.lanes[l].h, bs.lanes[l].i, bs.qt + l, static_cast<int64_t>(mq));
  }
  bs.qt_packed = true;
}

// Scores of keys [j0, j0 + n) for a block into st, scaled, masked: from the bfloat16 pairs
// (bs.qp) and k in place when the tile's keys are in their range (keys_in_range:
// TileRowsInDotRange), else from qt (the scale folded in) and `keys` (rows of k as T, key j0
// first; unread on the first way). slope: MaskScores' (the backward's softcap derivative).
template <size_t QV, class D, typename T = hn::TFromD<D>>
HWY_INLINE void ScoreTile(D d, const Problem& p, BlockState<T>& bs, T* HWY_RESTRICT st, size_t mq, int64_t j0,
                          int64_t n, bool partial, const Rows<T>& keys, bool keys_in_range, T* HWY_RESTRICT mask_rows,
                          T* HWY_RESTRICT slope = nullptr) {
  if (bs.qp != nullptr && keys_in_range) {
    Bf16Dot(bs.qp, mq, p.Dk, p.k, bs.blk.b, bs.blk.kvh, j0, n, p.scale, bs.amx, st);
  } else {
    if (!bs.qt_packed) PackBlockQueries(p, bs, mq);
    OuterScores<QV>(d, bs.qt, mq, keys.data, keys.stride, p.Dk, n, st);
  }

  MaskScores<QV, TileLayout::kKeyMajor>(d, p, bs.blk.b, bs.lanes, bs.blk.rows, j0, n, partial, st, mq, mask_rows, slope);
}

// Describes the block's lanes for keys [key_begin, key_end) and packs its queries: bs.qp
// (when set and the block's queries are in its range; else bs.qp becomes null), else qt
// (PackBlockQueries).
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
  // qt now without pairs; with them, by ScoreTile on the first tile of keys outside their range
  // (most blocks have none: the packing cost a sixth of a bfloat16 block's time).
  bs.qt_packed = false;
  if (bs.qp == nullptr) PackBlockQueries(p, bs, mq);
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_QUERY_BLOCK_INL_H_
