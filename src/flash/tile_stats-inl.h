// Outputs::stats (row_stats.h) per score tile of a forward block, compiled per SIMD target
// (included by forward_block-inl.h): the top-k offers (OfferTile) and each lane's allowed count
// and argmax after the tile's max loop (TileStatsEnd).

#if defined(SDPA_FLASH_TILE_STATS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_TILE_STATS_INL_H_
#undef SDPA_FLASH_TILE_STATS_INL_H_
#else
#define SDPA_FLASH_TILE_STATS_INL_H_
#endif

#include <bit>
#include <cstddef>
#include <cstdint>

#include "flash/query_block-inl.h"
#include "flash/row_stats.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_TILE_STATS_INL_H_
