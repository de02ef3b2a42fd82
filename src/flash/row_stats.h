// Outputs::stats in the fused forward: per-lane running statistics kept beside the online
// softmax's max m and sum l = Σ_j exp(s_j - m), in the same one pass over the keys:
//   t       = Σ_j exp(s_j - m) · (s_j - m)    relative to the running max, so every term is <= 0
//             and nothing cancels; rescaled with l when m grows:
//             t' = alpha · (t + (m_old - m_new) · l),  alpha = exp(m_old - m_new)
//   allowed = the keys with a score above -inf
//   argmax  = the first key of the running max (keys arrive in increasing order)
//   top k   = the k largest scores with their keys, largest first; an equal score keeps the
//             earlier (lower) key first
// At the end (write_row_stats), with the row's final max M and sum L (a sink's term included):
//   w_j = exp(s_j - M) / L,  c = exp(m - M) / L (the keys' factor),
//   H   = -Σ_j w_j log w_j = c · (l · (M - m + log L) - t)     (two terms >= 0: no cancellation)
// which is log l - t / l without a sink. Target-independent: the SIMD kernels
// (forward_block-inl.h, tile_stats-inl.h, decode-inl.h) keep t, the counts and the top-k
// thresholds in vectors and call these per lane.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "flash/flash_plan.h"
#include "problem.h"

namespace sdpa::internal {

// The state of mq lanes (one block), in two arrays that chunk merges copy as they are:
//   reals: t[mq], top_s[mq · k]        ints: allowed[mq], argmax[mq], top_i[mq · k]
template <typename T>
struct LaneStats {
  int64_t mq = 0, k = 0;
  T* reals = nullptr;
  int64_t* ints = nullptr;

  static int64_t reals_size(int64_t mq, int64_t k) { return mq * (1 + k); }
  static int64_t ints_size(int64_t mq, int64_t k) { return mq * (2 + k); }
  T* t() const { return reals; }
  T* top_s(int64_t lane) const { return reals + mq + lane * k; }
  int64_t* allowed() const { return ints; }
  int64_t* argmax() const { return ints + mq; }
  int64_t* top_i(int64_t lane) const { return ints + 2 * mq + lane * k; }

  void begin() const {
    std::fill(reals, reals + mq, T(0));
    std::fill(reals + mq, reals + reals_size(mq, k), -std::numeric_limits<T>::infinity());
    std::fill(ints, ints + mq, int64_t{0});
    std::fill(ints + mq, ints + ints_size(mq, k), int64_t{-1});
  }
  // The score a key must beat to enter the lane's top k (-inf while it has fewer than k).
  T threshold(int64_t lane) const { return top_s(lane)[k - 1]; }
  // Offers score s of key j (keys offered in increasing order; NaN and -inf never enter).
  void offer(int64_t lane, T s, int64_t j) const {
    T* ts = top_s(lane);
    int64_t* ti = top_i(lane);
    if (!(s > ts[k - 1])) return;
    int64_t r = k - 1;
    for (; r > 0 && s > ts[r - 1]; --r) {
      ts[r] = ts[r - 1];
      ti[r] = ti[r - 1];
    }
    ts[r] = s;
    ti[r] = j;
  }
};

// t rescaled to a new running max: alpha · (t + (m_old - m_new) · l_old). Where alpha is 0 (the
// old keys now weigh nothing) the result is 0; where the max did not move (+inf included) t
// stays. The difference is clamped to the lowest finite value so that a lane with no key yet
// (m_old = -inf, l_old = 0, t = 0) gives 0, not -inf · 0.
template <typename T>
T rescale_t(T t, T m_old, T m_new, T l_old, T alpha) {
  if (alpha == T(0)) return T(0);
  const T delta = m_old == m_new ? T(0) : std::max(m_old - m_new, std::numeric_limits<T>::lowest());
  return alpha * (t + delta * l_old);
}

// Merges chunk c's statistics (its lane state `from`, its max mc and sum lc) into `into`,
// which starts with begin() and gets the chunks in key order: t relative to the merged max
// mmax, summed as merge_chunks sums l (w = shifted_exp(mc, mmax); a chunk that adds nothing to
// l adds nothing to t); the argmax of the first chunk at the max; top-k entries of later
// chunks after equal scores of earlier ones.
template <typename T>
void merge_lane_stats(const LaneStats<T>& into, const LaneStats<T>& from, int64_t lane, T mc, T lc, T mmax, T w,
                      bool& argmax_set) {
  into.allowed()[lane] += from.allowed()[lane];
  for (int64_t r = 0; r < into.k; ++r) {
    const int64_t j = from.top_i(lane)[r];
    if (j >= 0) into.offer(lane, from.top_s(lane)[r], j);
  }
  if (lc == 0 || (w == 0 && !std::isnan(lc))) return;
  if (!argmax_set && mc == mmax) {
    into.argmax()[lane] = from.argmax()[lane];
    argmax_set = true;
  }
  const T delta = mc == mmax ? T(0) : mc - mmax;
  into.t()[lane] += w * (from.t()[lane] + delta * lc);
}

// merge_chunks for the statistics: chunk c's lane states at reals + c · reals_size and ints +
// c · ints_size, its (m, l) in `partial` (merge_chunks' layout), merged into `into`.
template <typename T>
void merge_stats_chunks(const T* partial, const T* reals, const int64_t* ints, int64_t chunks, int64_t Dv,
                        const LaneStats<T>& into) {
  const int64_t mq = into.mq, stride = (Dv + 2 + kBadClasses * Dv) * mq;
  const int64_t rs = LaneStats<T>::reals_size(mq, into.k), is = LaneStats<T>::ints_size(mq, into.k);
  into.begin();
  for (int64_t lane = 0; lane < mq; ++lane) {
    const T mmax = chunks_max(partial, chunks, Dv, mq, lane);
    bool argmax_set = false;
    for (int64_t c = 0; c < chunks; ++c) {
      const LaneStats<T> from{mq, into.k, const_cast<T*>(reals + c * rs), const_cast<int64_t*>(ints + c * is)};
      const T mc = partial[c * stride + Dv * mq + lane], lc = partial[c * stride + (Dv + 1) * mq + lane];
      merge_lane_stats(into, from, lane, mc, lc, mmax, lc != 0 ? shifted_exp(mc, mmax) : T(0), argmax_set);
    }
  }
}

// Writes row (b, h, i)'s statistics from the keys' max m (0 when none), sum l (NaN after a NaN
// score), t and the lane's counts; sink: the row's sink logit, or -inf without one. Returns the
// weight of the row's largest score (max_weight, written or not).
template <typename T>
T write_row_stats(const Problem& p, int64_t b, int64_t h, int64_t i, T m, T l, T sink, const LaneStats<T>& ls,
                     int64_t lane) {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const int64_t allowed = ls.allowed()[lane];
  T entropy = 0, normalized = 0, max_weight = 0;
  int64_t argmax = -1;
  // The top k's weights, from their scores as the weights output computes them.
  T M = m, L = l;
  const bool none = l == 0, is_nan = std::isnan(l);
  if (is_nan) {
    entropy = normalized = max_weight = nan;
  } else if (!none) {
    if (sink > -std::numeric_limits<T>::infinity()) {  // add_sinks' arithmetic
      M = std::max(m, sink);
      L = l * shifted_exp(m, M) + shifted_exp(sink, M);
    }
    // c · (l · (M - m + log L) - t) in float64; a +inf max has t = 0 and c · l = 1: log l.
    const double c = static_cast<double>(shifted_exp(m, M)) / static_cast<double>(L);
    const double shift = std::isinf(m) ? 0.0 : static_cast<double>(M) - static_cast<double>(m);
    const double h_row = c * (static_cast<double>(l) * (shift + std::log(static_cast<double>(L))) - static_cast<double>(ls.t()[lane]));
    entropy = static_cast<T>(std::max(0.0, h_row));
    normalized = allowed > 1 ? static_cast<T>(std::max(0.0, h_row) / std::log(static_cast<double>(allowed))) : T(0);
    max_weight = weight(m, M, L);
    argmax = ls.argmax()[lane];
  }
  p.stats.store_row(b, h, i, allowed, entropy, normalized, max_weight, argmax, [&](int64_t r) {
    const int64_t j = none || is_nan ? -1 : ls.top_i(lane)[r];
    return std::pair<int64_t, T>{j, is_nan ? nan : j < 0 ? T(0) : weight(ls.top_s(lane)[r], M, L)};
  });
  return max_weight;
}

}  // namespace sdpa::internal
