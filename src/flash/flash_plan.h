// The target-independent half of the fused kernel: how the work is cut into blocks and key
// chunks, and the scalar bookkeeping at a block's start and end. Everything here depends
// only on the problem (and the SIMD width), never on the thread count: that is what makes
// the output bitwise identical for any number of threads.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "problem.h"
#include "reference.h"

namespace sdpa::internal {

// Keys per tile: a score tile is kTileKeys × Mq (8 KiB for f32 AVX2 with Mq=16), so with
// the value rows it reads, it stays in L1 between the two products.
inline constexpr int64_t kTileKeys = 128;
// Key splitting for few blocks (decode): aim at this many work units, chunks of at least
// kMinChunkKeys keys, so each unit amortises its merge.
inline constexpr int64_t kTargetUnits = 16;
inline constexpr int64_t kMinChunkKeys = 8 * kTileKeys;
// Long K/V (more bytes per kv head than kGroupAboveBytes, half an L2) is swept by groups of
// up to kMaxGroupBlocks blocks at once, so each K/V tile comes from memory once per group
// rather than once per block (at N = 65536, D = 64 the K/V of a head no longer fit in L3).
inline constexpr int64_t kMaxGroupBlocks = 4;
inline constexpr int64_t kGroupAboveBytes = int64_t{1} << 19;
// Options::batch_invariant: keys are cut at multiples of this from key 0 whatever the problem,
// and the pieces merged in key order (merge_chunks), whether threads take them apart or not.
// Large, so that prefill of up to 4096 keys pays no merge; a decode step of 32768 keys per kv
// head still gives threads 8 chunks per kv head.
inline constexpr int64_t kInvariantChunkKeys = 4 * kMinChunkKeys;
// Blocks of at most this many rows use the few-rows (decode) kernel, lanes along features.
inline constexpr int64_t kDecodeMaxRows = 8;
// A thread joins only with at least this many multiply-adds to do (about 5 µs of one core):
// waking one costs microseconds, and a decode step of a small model has less work than that
// (B 1, H 4, 16 keys, D 32: 4096). The thread count changes no arithmetic.
inline constexpr double kMinWorkPerThread = 1 << 16;

inline int64_t tile_start(int64_t j) { return j / kTileKeys * kTileKeys; }

// x + 0 (round to nearest): -0 becomes +0, every other value (±inf, NaN) stays as it is. Each
// output of the fused kernels goes through it where it is written (out in finish_block; dq, dk, dv
// in backward-inl.h), so a zero is written as +0. The reason is the block mask: the kernels skip
// the tiles (and, in the backward, the rows) it blocks for a whole block, where the same call with
// the equivalent element mask adds their p = 0 or ds = 0 terms, +0 · x. Both sums agree except
// that one may be -0 (a tiny negative product that underflowed, with nothing added after it) where
// the other got +0 from such a term (-0 + +0 = +0); the header promises the two calls the same bits.
template <typename T>
inline T positive_zero(T x) {
  return x + T(0);
}

// Rows [r0, r0 + rows) of kv head kvh's "group rows" r = i·group + g (query row i of query
// head kvh·group + g): one block, one lane per row.
struct BlockRows {
  int64_t b = 0, kvh = 0, r0 = 0, rows = 0;
};

// One lane's query head, row and allowed keys [begin, end).
struct LaneRow {
  int64_t h = 0, i = 0, begin = 0, end = 0;
};

// Over a block's lanes: the union [begin, end) of their key ranges (the tiles to visit) and
// their intersection [max_begin, min_end) (tiles inside it need no per-element masking).
struct LaneSpan {
  int64_t begin = 0, end = 0, max_begin = 0, min_end = 0;
};

inline LaneSpan describe_lanes(const Problem& p, const BlockRows& blk, int64_t k0, int64_t k1, LaneRow* lanes) {
  LaneSpan span{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
                std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
  for (int64_t l = 0; l < blk.rows; ++l) {
    const int64_t r = blk.r0 + l;
    const int64_t i = r / p.group;
    const KeyRange kr = p.key_range(blk.b, i);
    const int64_t begin = std::max(kr.begin, k0);
    const int64_t end = std::max(begin, std::min(kr.end, k1));
    lanes[l] = {blk.kvh * p.group + r % p.group, i, begin, end};
    if (begin < end) {
      span.begin = std::min(span.begin, begin);
      span.end = std::max(span.end, end);
    }
    span.max_begin = std::max(span.max_begin, begin);
    span.min_end = std::min(span.min_end, end);
  }
  if (span.begin >= span.end) span.begin = span.end = 0;  // no lane sees any key
  return span;
}

// Problem::block_allows_any for query rows of batch b asked in turn, each about its own keys
// [lo, hi) (lo < hi; a block mask is given): a row asking what the one before asked (same head,
// block of rows and keys: every row of a block of rows but the GQA heads' when block_q covers
// them) gets the answer kept, and the block of rows is found by comparison while the rows stay
// in it, not by a division per row. The kernels ask it per tile for each of their lanes or rows.
class BlockRowsSeeKeys {
 public:
  BlockRowsSeeKeys(const Problem& p, int64_t b) : p_(p), b_(b) {}
  bool operator()(int64_t h, int64_t i, int64_t lo, int64_t hi) {
    if (i < qb_begin_ || i >= qb_end_) {
      qb_ = p_.block_row(i);
      qb_begin_ = qb_ * p_.block_q - p_.q_start;  // (negative when the block began before row 0)
      qb_end_ = qb_begin_ + std::min(p_.block_q, std::numeric_limits<int64_t>::max() - std::max<int64_t>(qb_begin_, 0));
    }
    if (h != h_ || qb_ != asked_qb_ || lo != lo_ || hi != hi_) {
      h_ = h, asked_qb_ = qb_, lo_ = lo, hi_ = hi;
      sees_ = p_.block_allows_any(b_, h, qb_, lo, hi);
    }
    return sees_;
  }

 private:
  const Problem& p_;
  int64_t b_;
  int64_t qb_ = 0, qb_begin_ = 0, qb_end_ = 0;  // the current row's block of rows, [qb_begin_, qb_end_)
  int64_t h_ = -1, asked_qb_ = -1, lo_ = -1, hi_ = -1;  // the last question, and its answer
  bool sees_ = false;
};

// Whether some lane may see a key of [j0, j1) (j0 < j1): one inside its own range that the
// block mask allows (BlockRowsSeeKeys; lanes come in increasing rows). A tile that no lane sees
// changes none of their sums, so kernels skip it unread.
inline bool lanes_see_keys(const Problem& p, int64_t b, const LaneRow* lanes, int64_t count, int64_t j0, int64_t j1) {
  BlockRowsSeeKeys allowed(p, b);
  for (int64_t l = 0; l < count; ++l) {
    const int64_t lo = std::max(j0, lanes[l].begin), hi = std::min(j1, lanes[l].end);
    if (lo < hi && (!p.block_mask || allowed(lanes[l].h, lanes[l].i, lo, hi))) return true;
  }
  return false;
}

// The query rows [first, last) of batch b that may see a key of [j0, j1) under causal, window
// and the sequence's length: both ends of key_range(b, i) are non-decreasing in i, so the rows
// whose range ends after j0 are a suffix, those whose range begins before j1 a prefix, and the
// rows seeing the keys lie in their intersection (rows inside it whose own range is empty still see nothing). Two binary
// searches instead of a key_range per row: the backward's key blocks ask this once each.
struct RowInterval {
  int64_t first = 0, last = 0;
};

inline RowInterval rows_seeing_keys(const Problem& p, int64_t b, int64_t j0, int64_t j1) {
  // The first row i in [lo, hi) with pred(i) true, for a pred that is false then true.
  const auto first_true = [](int64_t lo, int64_t hi, auto pred) {
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (pred(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  };
  const int64_t first = first_true(0, p.Nq, [&](int64_t i) { return p.key_range(b, i).end > j0; });
  const int64_t last = first_true(first, p.Nq, [&](int64_t i) { return p.key_range(b, i).begin >= j1; });
  return {first, last};
}

struct Plan {
  bool decode = false;      // few rows per kv head: DecodeBlock instead of RunBlocks
  int64_t qv = 1;           // vectors of query rows per block
  int64_t mq = 1;           // rows per block = qv · lanes
  int64_t rows_per_head = 0, blocks_per_head = 0, blocks = 0;
  int64_t Hkv = 1;
  int64_t heads = 0;        // B · Hkv
  int64_t chunks = 1, chunk_keys = 1;  // keys split into `chunks` pieces of chunk_keys
  // Batch invariant with many blocks: a unit runs all chunks of its block and merges them
  // itself (no partials kept for the whole problem); else each chunk is a unit of its own.
  bool local_chunks = false;
  int64_t group_blocks = 1, groups_per_head = 0;  // blocks of one kv head swept together
  double work = 0;           // multiply-adds, at most B·Hq·Nq·Nk·(Dk + Dv) (masks not counted)
  int threads = 1;

  // A unit of parallel work: one group of blocks and one key chunk.
  int64_t unit_chunks() const { return local_chunks ? 1 : chunks; }  // key chunks that are units
  int64_t units() const { return heads * groups_per_head * unit_chunks(); }
  // Whether chunks are merged after the units ran (from partials kept per block and chunk).
  bool needs_merge() const { return chunks > 1 && !local_chunks; }
  BlockRows block(int64_t bi) const {
    const int64_t per_batch = Hkv * blocks_per_head;
    const int64_t r0 = (bi % blocks_per_head) * mq;
    return {bi / per_batch, (bi % per_batch) / blocks_per_head, r0, std::min(mq, rows_per_head - r0)};
  }
  int64_t block_index(const BlockRows& blk) const { return (blk.b * Hkv + blk.kvh) * blocks_per_head + blk.r0 / mq; }
  // Fills the blocks of group gi (at most kMaxGroupBlocks) and returns how many there are.
  size_t group(int64_t gi, BlockRows* out) const {
    const int64_t head = gi / groups_per_head, first = (gi % groups_per_head) * group_blocks;
    const int64_t count = std::min(group_blocks, blocks_per_head - first);
    for (int64_t g = 0; g < count; ++g) out[g] = block(head * blocks_per_head + first + g);
    return static_cast<size_t>(count);
  }
};

// Threads for `units` units of parallel work holding `work` multiply-adds in all: at most the
// configured count, one per unit, and one per kMinWorkPerThread. Changes no arithmetic.
inline int threads_for(int64_t units, double work) {
  const int64_t worth = static_cast<int64_t>(std::min(work / kMinWorkPerThread, 1e6));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({int64_t{num_threads()}, units, worth})));
}

inline Plan make_plan(const Problem& p, int64_t lanes) {
  Plan plan;
  plan.Hkv = p.Hkv;
  plan.heads = p.B * p.Hkv;
  plan.rows_per_head = p.Nq * p.group;
  plan.qv = plan.rows_per_head <= lanes ? 1 : 2;  // decode-sized blocks waste no lanes
  plan.mq = plan.qv * lanes;
  // Batch invariant: a row's sums must not depend on its block, so decode steps run the
  // few-rows kernel in the block kernel's order (decode-inl.h's kBlockOrder), and take the
  // block kernel itself where they ask for weights or statistics (whose passes it does not
  // have in that order).
  plan.decode = plan.rows_per_head <= kDecodeMaxRows && (!p.batch_invariant || (!p.weights && !p.stats.any()));
  plan.blocks_per_head = ceil_blocks(plan.rows_per_head, plan.mq);
  plan.blocks = p.B * p.Hkv * plan.blocks_per_head;
  plan.chunk_keys = std::max<int64_t>(p.Nk, 1);
  if (p.batch_invariant) {  // the chunks from key 0 alone; threads split them only when few blocks
    plan.chunk_keys = kInvariantChunkKeys;
    plan.chunks = std::max<int64_t>(1, ceil_blocks(p.Nk, kInvariantChunkKeys));
    plan.local_chunks = plan.chunks > 1 && plan.blocks >= kTargetUnits;
  } else if (plan.blocks > 0 && plan.blocks < kTargetUnits && p.Nk >= 2 * kMinChunkKeys) {
    const int64_t want = ceil_blocks(kTargetUnits, plan.blocks);
    plan.chunk_keys = std::max(kMinChunkKeys, ceil_blocks(ceil_blocks(p.Nk, want), kTileKeys) * kTileKeys);
    plan.chunks = ceil_blocks(p.Nk, plan.chunk_keys);
  }
  // Grouping changes no arithmetic (each block sees the same tiles in the same order), so it
  // may depend on the thread count: keep at least two units per thread.
  const int threads = num_threads();
  const int64_t kv_bytes = p.Nk * (p.Dk + p.Dv) * storage_bytes(p.k.dtype);
  if (!plan.decode && plan.chunks == 1 && kv_bytes > kGroupAboveBytes) plan.group_blocks = kMaxGroupBlocks;
  while (plan.group_blocks > 1 && plan.blocks / plan.group_blocks < 2 * threads) plan.group_blocks /= 2;
  plan.groups_per_head = ceil_blocks(plan.blocks_per_head, plan.group_blocks);
  plan.work = static_cast<double>(p.B * p.Hq * p.Nq) * static_cast<double>(p.Nk) * static_cast<double>(p.Dk + p.Dv);
  plan.threads = threads_for(plan.units(), plan.work);
  return plan;
}

// Value rows holding NaN or inf: their non-finite entries never enter the tiles' sums (a key
// whose weight is 0 in the end may have had weight in the keys seen before, and rescaling
// inf by a tiny factor stays inf). Instead the kernels keep, per lane and value column, the
// largest score of a key (allowed, kept) with +inf, with -inf and with NaN there:
// bad[(c·Dv + e)·mq + lane] for class c = kBadPosInf, kBadNegInf, kBadNaN (-inf: none), and
// finish_block adds that class to the column exactly when such a key has weight in the row's
// softmax: shifted_exp(score, final max) > 0. Scores are absolute, so chunks merge by max.
inline constexpr int64_t kBadPosInf = 0, kBadNegInf = 1, kBadNaN = 2, kBadClasses = 3;
template <typename T>
int64_t bad_class(T x) {
  return std::isnan(x) ? kBadNaN : x > 0 ? kBadPosInf : kBadNegInf;
}
// Records score s (of an allowed, kept key: s > -inf) for the non-finite entries of its value
// row (width Dv) in one lane.
template <typename T>
void record_bad_row(const T* row, int64_t Dv, T s, int64_t mq, int64_t lane, T* bad) {
  if (!(s > -std::numeric_limits<T>::infinity())) return;  // blocked, or a NaN score (the row is NaN anyway)
  for (int64_t e = 0; e < Dv; ++e) {
    if (std::isfinite(row[e])) continue;
    T& slot = bad[(bad_class(row[e]) * Dv + e) * mq + lane];
    slot = std::max(slot, s);
  }
}

// Merges a block's per-chunk results (ot, m, l, bad), stored one after another, in chunk
// order: rescale each chunk to the common max, then add; bad by max. m is 0 and l is 0 where a
// chunk saw no key; l is NaN where a NaN reached the chunk's scores, and the merge keeps it NaN.
// The max over a lane's chunks that saw a key (l != 0), -inf when none did: the merge's max.
template <typename T>
T chunks_max(const T* partial, int64_t chunks, int64_t Dv, int64_t mq, int64_t lane) {
  const int64_t stride = (Dv + 2 + kBadClasses * Dv) * mq;
  T mmax = -std::numeric_limits<T>::infinity();
  for (int64_t c = 0; c < chunks; ++c) {
    const T* pc = partial + c * stride;
    if (pc[(Dv + 1) * mq + lane] != 0) mmax = std::max(mmax, pc[Dv * mq + lane]);
  }
  return mmax;
}

template <typename T>
void merge_chunks(const T* partial, int64_t chunks, int64_t Dv, int64_t mq, T* ot, T* m, T* l, T* bad) {
  const int64_t stride = (Dv + 2 + kBadClasses * Dv) * mq;
  std::fill(bad, bad + kBadClasses * Dv * mq, -std::numeric_limits<T>::infinity());
  for (int64_t c = 0; c < chunks; ++c) {
    const T* pc = partial + c * stride + (Dv + 2) * mq;
    for (int64_t x = 0; x < kBadClasses * Dv * mq; ++x) bad[x] = std::max(bad[x], pc[x]);
  }
  for (int64_t lane = 0; lane < mq; ++lane) {
    const T mmax = chunks_max(partial, chunks, Dv, mq, lane);
    T sum = 0;
    for (int64_t e = 0; e < Dv; ++e) ot[e * mq + lane] = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const T* pc = partial + c * stride;
      const T lc = pc[(Dv + 1) * mq + lane];
      if (lc == 0) continue;
      const T w = shifted_exp(pc[Dv * mq + lane], mmax);  // 1 for chunks at a +inf max
      // w = 0: every key of the chunk has weight 0 against the row's max, and contributes
      // nothing (its ot may hold inf from an overflowed sum: 0 · inf would be NaN), unless a
      // NaN score reached it (lc NaN): that makes the whole row NaN, so it is added.
      if (w == 0 && !std::isnan(lc)) continue;
      sum += lc * w;
      for (int64_t e = 0; e < Dv; ++e) ot[e * mq + lane] += pc[e * mq + lane] * w;
    }
    m[lane] = sum != 0 ? mmax : T(0);
    l[lane] = sum;
  }
}

// Adds each lane's sink (Problem::sinks: a logit with no value row) to its softmax: the max
// becomes M = max(m, sink), the sum l·exp(m - M) + exp(sink - M), and ot is rescaled by
// exp(m - M) (1, changing no bit, where the keys' max is at least the sink). A lane with no
// allowed key (l = 0) gets m = sink, l = 1 and ot = 0: out 0, lse = sink. NaN stays NaN.
// Then finish_block and the weights pass see the row's true max and sum.
template <typename T>
void add_sinks(const Problem& p, const LaneRow* lanes, int64_t rows, int64_t mq, T* ot, T* m, T* l) {
  for (int64_t lane = 0; lane < rows; ++lane) {
    if (std::isnan(l[lane])) continue;
    const T sink = p.sink<T>(lanes[lane].h);
    if (l[lane] == 0) {
      for (int64_t e = 0; e < p.Dv; ++e) ot[e * mq + lane] = 0;
      m[lane] = sink;
      l[lane] = 1;
      continue;
    }
    const T M = std::max(m[lane], sink), alpha = shifted_exp(m[lane], M);
    l[lane] = l[lane] * alpha + shifted_exp(sink, M);
    if (alpha != 1) {
      for (int64_t e = 0; e < p.Dv; ++e) ot[e * mq + lane] *= alpha;
    }
    m[lane] = M;
  }
}

// The weight of a score s in a row whose final max is m and sum l: shifted_exp(s, m) / l, and
// 0 for blocked keys (s = -inf) and rows with no allowed key (l = 0), even when l is NaN.
template <typename T>
T weight(T s, T m, T l) {
  return s == -std::numeric_limits<T>::infinity() || l == 0 ? T(0) : shifted_exp(s, m) * (T(1) / l);
}

// The weights pass's output for row (b, h, i): Outputs::weights and Stats::pooled_weights,
// whichever are asked for. clear() first, then put() each allowed key's weight in key order.
template <typename T>
struct WeightsRow {
  const Problem& p;
  int64_t b, h, i;
  void clear() const {
    for (int64_t j = 0; p.weights && j < p.Nk; ++j) p.weights->store(b, h, i, j, T(0));
    if (const auto& pw = p.stats.pooled_weights) {
      for (int64_t c = 0; c < pw->shape[3]; ++c) *pw->at<T>(b, h, i, c) = T(0);
    }
  }
  void put(int64_t j, T w) const {
    if (p.weights) p.weights->store(b, h, i, j, w);
    const auto& pw = p.stats.pooled_weights;
    if (pw && pw->shape[3] > 0) *pw->at<T>(b, h, i, pooled_run(j, pw->shape[3], p.Nk)) += w;  // G = 0: no runs
  }
};

// Normalises a block's output rows and writes out and lse. A lane with no allowed key
// (l == 0; otherwise l >= 1, the max's own term) gets zeros and lse = -inf; l = NaN (a NaN
// in its scores) gives NaN. The columns of a row that come out non-finite with a finite l
// (the unnormalised sum Σ p·v may overflow where out does not) are recomputed by attend_row
// (the same algorithm, scalar, in T) where their value rows are finite. Rare, so it may
// allocate.
// Then each column gets the non-finite entries (bad, above) of keys that have weight: +inf,
// -inf (both: NaN) or NaN.
// Whether every one of x[0, n) is -inf, as bits (a loop without branches that compilers
// vectorise: the usual answer for a block's `bad`, checked once instead of per column).
template <typename T>
bool all_negative_infinity(const T* x, int64_t n) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  const Bits neg_inf = std::bit_cast<Bits>(-std::numeric_limits<T>::infinity());
  Bits differ = 0;
  for (int64_t i = 0; i < n; ++i) differ |= std::bit_cast<Bits>(x[i]) ^ neg_inf;
  return differ == 0;
}

template <typename T>
void finish_block(const Problem& p, const BlockRows& blk, const T* ot, const T* m, const T* l, const T* bad,
                  int64_t mq, const LaneRow* lanes) {
  const bool any_bad = !all_negative_infinity(bad, kBadClasses * p.Dv * mq);
  // Rows are formed in T, in place when out holds T, else in `row` and rounded once by write_row.
  const bool in_place = p.out.dtype == dtype_of<T>();
  std::vector<T> row(in_place ? 0 : static_cast<size_t>(p.Dv));
  for (int64_t lane = 0; lane < blk.rows; ++lane) {
    const LaneRow& r = lanes[lane];
    const bool any = l[lane] != 0;
    const T inv = any ? T(1) / l[lane] : T(0);
    T* out = in_place ? p.out.at<T>(blk.b, r.h, r.i) : row.data();
    bool finite = true;
    for (int64_t e = 0; e < p.Dv; ++e) {
      out[e] = any ? ot[e * mq + lane] * inv : T(0);
      finite &= std::isfinite(out[e]);
    }
    if (!finite && !std::isnan(l[lane])) {
      // Only the non-finite columns whose value rows are finite over the row's allowed, kept
      // keys are replaced: those overflowed in the unnormalised sum. A column holding NaN or
      // inf in such a value row gets that from `bad` below, and its finite part stays the
      // tiles' (a recomputation could weigh a key differently at the edge of underflow). The
      // other columns keep the tiles' arithmetic, bit for bit.
      std::vector<T> prob(static_cast<size_t>(p.Nk)), exact(static_cast<size_t>(p.Dv));
      attend_row(p, blk.b, r.h, r.i, prob.data(), exact.data());
      for (int64_t e = 0; e < p.Dv; ++e) {
        if (std::isfinite(out[e])) continue;
        bool column_finite = true;
        for (int64_t j = r.begin; j < r.end && column_finite; ++j) {
          const bool blocked = p.mask_bias<T>(blk.b, r.h, r.i, j) == -std::numeric_limits<T>::infinity();
          const bool dropped = p.dropout.enabled() && p.dropout.factor<T>(blk.b, r.h, r.i, j) == T(0);
          column_finite = blocked || dropped || std::isfinite(p.v.load<T>(blk.b, blk.kvh, j, e));
        }
        if (column_finite) out[e] = exact[e];
      }
    }
    for (int64_t e = 0; any && any_bad && e < p.Dv; ++e) {
      const auto has = [&](int64_t c) {
        const T s = bad[(c * p.Dv + e) * mq + lane];
        return s > -std::numeric_limits<T>::infinity() && shifted_exp(s, m[lane]) > 0;
      };
      if (has(kBadPosInf)) out[e] += std::numeric_limits<T>::infinity();
      if (has(kBadNegInf)) out[e] -= std::numeric_limits<T>::infinity();  // after +inf: NaN
      if (has(kBadNaN)) out[e] = std::numeric_limits<T>::quiet_NaN();
    }
    for (int64_t e = 0; e < p.Dv; ++e) out[e] = positive_zero(out[e]);  // a zero as +0 (above)
    if (!in_place) write_row(p.out, blk.b, r.h, r.i, out, p.Dv);
    if (p.lse) {
      p.lse->store(blk.b, r.h, r.i, 0, any ? m[lane] + std::log(l[lane]) : -std::numeric_limits<T>::infinity());
    }
  }
}

}  // namespace sdpa::internal
