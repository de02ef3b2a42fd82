// The forward's block of query rows over its key tiles, compiled per SIMD target (included by
// flash-inl.h): the per-thread Scratch, one online-softmax step (BlockTile), a group of blocks
// over a key range (RunBlocks) and the weights pass (WriteWeights).

#if defined(SDPA_FLASH_FORWARD_BLOCK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_FORWARD_BLOCK_INL_H_
#undef SDPA_FLASH_FORWARD_BLOCK_INL_H_
#else
#define SDPA_FLASH_FORWARD_BLOCK_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash/flash_plan.h"
#include "flash/products-inl.h"
#include "flash/query_block-inl.h"
#include "flash/row_stats.h"
#include "flash/rows-inl.h"
#include "flash/score_tile-inl.h"
#include "flash/tile_stats-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernel_path.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// A piece of Scratch's one allocation (get() as the unique pointers it replaced).
template <typename U>
struct ScratchPart {
  U* ptr = nullptr;
  U* get() const { return ptr; }
};

// What a thread learns about the tiles of the kv head its units are on, kept while consecutive
// units stay on it (they do: units run head after head): whether each tile's keys and values
// lie in the bfloat16 products' range (TileRowsInDotRange, for the keys and the values: whole
// tiles, whichever keys a group of blocks visits, so the choice never depends on the grouping
// or the thread count), and for kFast's p·V on AMX the value tiles as PackAmxValuePairs makes
// them, packed on first use into slots (tile i in slot i mod slots), so that the blocks of a
// head share one transposition of each tile instead of one per block.
struct HeadTiles {
  static constexpr size_t kMaxBytes = size_t{8} << 20;  // the packed tiles' memory per thread
  const Problem* p = nullptr;
  int64_t b = -1, kvh = -1;
  std::vector<uint8_t> k_state, v_state;  // per tile: 0 not looked at yet, 1 in range, 2 not
  std::vector<int64_t> slot_tile;         // the tile each slot holds (-1: none)
  hwy::AlignedFreeUniquePtr<uint32_t[]> words;
  int64_t tile_words = 0;

  void select(const Problem& q, int64_t b_, int64_t kvh_, bool pack) {
    if (p == &q && b == b_ && kvh == kvh_) return;
    p = &q, b = b_, kvh = kvh_;
    const int64_t tiles = ceil_blocks(q.Nk, kTileKeys);
    k_state.assign(static_cast<size_t>(tiles), 0);
    v_state.assign(static_cast<size_t>(tiles), 0);
    if (!pack) return;
    tile_words = std::max<int64_t>(1, amx_value_pairs_size(q.Dv));  // Dv = 0 packs nothing
    const int64_t slots = std::clamp<int64_t>(static_cast<int64_t>(kMaxBytes / 4) / tile_words, 1, tiles);
    if (static_cast<int64_t>(slot_tile.size()) < slots || words == nullptr) {
      words = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(slots * tile_words));
    }
    slot_tile.assign(static_cast<size_t>(slots), -1);
  }
  // Whether tile t's keys (values) are in range, looked at once.
  template <class D>
  bool keys_ok(D d, int64_t t) {
    return in_range(d, k_state, p->k, p->Dk, t);
  }
  template <class D>
  bool values_ok(D d, int64_t t) {
    return in_range(d, v_state, p->v, p->Dv, t);
  }
  template <class D>
  bool in_range(D d, std::vector<uint8_t>& state, const View4& rows, int64_t width, int64_t t) {
    uint8_t& st = state[static_cast<size_t>(t / kTileKeys)];
    if (st == 0) st = TileRowsInDotRange(d, *p, rows, width, b, kvh, t) ? 1 : 2;
    return st == 1;
  }
  // Tile t's values for AmxDotAccumulate (row 0 = key t), packed here on first use (vp: scratch).
  const uint32_t* amx_values(int64_t t, uint32_t* vp) {
    const int64_t tile = t / kTileKeys, slot = tile % static_cast<int64_t>(slot_tile.size());
    uint32_t* at = words.get() + slot * tile_words;
    if (slot_tile[static_cast<size_t>(slot)] != tile) {
      const int64_t n = std::min(kTileKeys, p->keys_of(b) - t);
      PackAmxValuePairs(p->v.at<uint16_t>(b, kvh, t), p->v.strides[2], n, p->Dv, vp, at);
      slot_tile[static_cast<size_t>(slot)] = tile;
    }
    return at;
  }
};

// Words per lane of one part of the weight pairs (Bf16DotAccumulate's and AMX's pp scratch: a
// tile's key pairs and one more for an odd first key); kExact on AMX packs three parts.
inline constexpr int64_t kPairsPartWords = (kTileKeys + 1) / 2 + 1;

// Per-thread working memory for a group of up to `group` blocks that share each K/V tile:
// O(group · Mq · (Dk + Dv) + Mq · kTileKeys), independent of N. One aligned allocation cut
// into parts (a decode step of a small model is shorter than a dozen mallocs).
template <typename T>
struct Scratch {
  Scratch(const Problem& p, size_t mq, size_t lanes_per_vector, size_t group, KernelPath dot, bool pv_pairs = false,
          bool pv_amx = false)
      : mq(mq),
        Dk(static_cast<size_t>(p.Dk)),
        Dv(static_cast<size_t>(p.Dv)),
        bf16_dot(dot != KernelPath::kSimd),
        pv_pairs(pv_pairs),
        pv_amx(pv_pairs && pv_amx),
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
    const size_t vp_size = pv_pairs ? at_least_1((kt + 1) / 2 * Dv) : 1;             // uint32_t
    const size_t pp_size = pv_pairs ? 3 * kPairsPartWords * mq : 1;                   // uint32_t
    const auto rounded = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
    size_t total = rounded(qp_size * sizeof(uint32_t)) + rounded(vp_size * sizeof(uint32_t)) +
                   rounded(pp_size * sizeof(uint32_t));
    for (size_t n : sizes) total += rounded(n * sizeof(T));
    storage = hwy::AllocateAligned<uint8_t>(total);
    uint8_t* at = storage.get();
    qp.ptr = reinterpret_cast<uint32_t*>(at);
    at += rounded(qp_size * sizeof(uint32_t));
    vp.ptr = reinterpret_cast<uint32_t*>(at);
    at += rounded(vp_size * sizeof(uint32_t));
    pp.ptr = reinterpret_cast<uint32_t*>(at);
    at += rounded(pp_size * sizeof(uint32_t));
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
  ScratchPart<uint32_t> vp, pp;       // kFast's p·V pairs (bf16_dot.h), when pv_pairs: a tile's
                                      // values (PackBf16ValuePairs) and a block's weights
  bool bf16_dot, pv_pairs, pv_amx, amx;  // the bfloat16 products (qp; kFast's p·V, on AMX tiles), scores with AMX
  HeadTiles head;                        // when bf16_dot or pv_pairs
  std::vector<uint8_t> v_bad;                         // which V rows of the tile hold NaN or inf
  std::vector<LaneRow> lanes;
  int64_t topk;                                       // Outputs::stats' k
  std::vector<T> stat_reals;                          // BlockState::stats of each block
  std::vector<int64_t> stat_ints;
  // Plan::local_chunks: one block's (ot, m, l, bad) and statistics per key chunk, merged at the
  // unit's end (flash-inl.h's RunUnit); sized there, on first use.
  std::vector<T> chunk_partial, chunk_stat_reals;
  std::vector<int64_t> chunk_stat_ints;
};

// kFast's bfloat16 weights straight into the pairs both p·V products take (PackBf16WeightPairs'
// layout and bits): for rows r < n of the score tile st (key-major, mq lanes), p = exp(s -
// msafe) rounded to bfloat16 (RoundWeights' rounding), summed into sum in row order as
// BlockTile's loop sums them, and packed two keys to a word, pp[(j2 - first / 2)·mq + lane]
// holding key 2·j2 - first (low half) and the next (0 for a row outside [0, n)). The weights
// never go back to st: one pass where rounding, storing and packing took two. No +inf max.
template <size_t QV, class D, class V = hn::Vec<D>>
HWY_INLINE void ExpRoundPack(D d, const float* HWY_RESTRICT st, size_t mq, int64_t first, int64_t n,
                             const V* msafe, V* sum, uint32_t* HWY_RESTRICT pp) {
  const hn::RebindToUnsigned<D> du;
  using VU = hn::Vec<decltype(du)>;
  const size_t N = hn::Lanes(d);
  const VU high = hn::Set(du, 0xffff0000u);
  // Row r's rounding bits for the q-th vector of lanes; its rounded weight added to the sum.
  const auto rounded = [&](int64_t r, size_t q) {
    const VU bits = Bf16RoundingBits(d, ShiftedExp<false, true>(d, hn::Load(d, st + r * mq + q * N), msafe[q]));
    sum[q] = hn::Add(sum[q], hn::BitCast(d, hn::And(bits, high)));
    return bits;
  };
  const auto pair = [&](int64_t a, uint32_t* out) {  // rows a, a + 1 (either may be outside)
    for (size_t q = 0; q < QV; ++q) {
      const VU lo = a >= 0 ? rounded(a, q) : hn::Zero(du);
      const VU hi = a + 1 < n ? rounded(a + 1, q) : hn::Zero(du);
      hn::Store(hn::Or(hn::ShiftRight<16>(lo), hn::And(hi, high)), du, out + q * N);
    }
  };
  int64_t a = -(first % 2);  // the first pair's low row: -1 when first is odd (its key is before the tile)
  uint32_t* out = pp;
  if (a < 0) {
    pair(a, out);
    a += 2;
    out += mq;
  }
  for (; a + 1 < n; a += 2, out += mq) {
    for (size_t q = 0; q < QV; ++q) {
      const VU lo = rounded(a, q), hi = rounded(a + 1, q);
      hn::Store(hn::Or(hn::ShiftRight<16>(lo), hn::And(hi, high)), du, out + q * N);
    }
  }
  if (a < n) pair(a, out);
}

// One online-softmax step of a block over the tile that starts at t (a multiple of
// kTileKeys), clipped to the block's span: scores, new max, rescale, p = exp(s - max), p·V.
// keys and values hold the tile's rows from key k0 on (k0 <= the block's first key in it);
// v_bad (null: none) flags the value rows holding NaN or inf, from k0 on.
// v_pairs (kFast, bfloat16, with vdpbf16ps: Problem::round_p): the tile's values as
// PackBf16ValuePairs made them from key v0 on (pv_amx: as PackAmxValuePairs did, for
// AmxDotAccumulate), and pp their scratch; null: p·V from `values`.
template <size_t QV, class D, typename T = hn::TFromD<D>>
void BlockTile(D d, const Problem& p, BlockState<T>& bs, T* HWY_RESTRICT st, T* HWY_RESTRICT mask_rows, int64_t t,
               int64_t k0, const Rows<T>& keys, bool keys_in_range, const Rows<T>& values, const uint8_t* v_bad,
               const uint32_t* v_pairs = nullptr, int64_t v0 = 0, uint32_t* pp = nullptr, bool pv_amx = false) {
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
  // Scores from bfloat16 pairs in the dot products' range (bf16_dot.h) are finite, and no mask
  // or modifier makes a finite score NaN (problem.cc rejects NaN in a float mask): their tiles
  // skip the NaN test, a mask operation per score on the port the exp's FMAs need.
  const bool may_be_nan = bs.qp == nullptr || !keys_in_range;
  const auto max_loop = [&](auto stats_const, auto nan_const) {
    for (int64_t j = 0; j < n; ++j) {
      for (size_t q = 0; q < QV; ++q) {
        const V s = hn::Load(d, st + j * mq + q * N);
        mnew[q] = hn::Max(mnew[q], s);
        if constexpr (decltype(nan_const)::value) nan[q] = hn::Or(nan[q], hn::IsNaN(s));
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
    max_loop(std::true_type{}, std::true_type{});
    if (topk) OfferTile<QV>(d, bs.stats, st, mq, j0, n, candidates);
    TileStatsEnd<QV>(d, bs, st, mq, j0, n, count, mnew);
  } else {
    // Four running maxima per vector of lanes, merged at the end: one chain of Max would wait on
    // its latency at every score (the loop ran at a quarter of its throughput). Max is exact, so
    // the order changes no bit (a NaN lane's max may differ: its sum is NaN whatever m is).
    const auto plain_max = [&](auto nan_const) {
      V m1[QV], m2[QV], m3[QV];
      for (size_t q = 0; q < QV; ++q) m1[q] = m2[q] = m3[q] = neg_inf;
      const auto take = [&](V& m, int64_t j, size_t q) {
        const V s = hn::Load(d, st + j * mq + q * N);
        m = hn::Max(m, s);
        if constexpr (decltype(nan_const)::value) nan[q] = hn::Or(nan[q], hn::IsNaN(s));
      };
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        for (size_t q = 0; q < QV; ++q) {
          take(mnew[q], j, q);
          take(m1[q], j + 1, q);
          take(m2[q], j + 2, q);
          take(m3[q], j + 3, q);
        }
      }
      for (; j < n; ++j) {
        for (size_t q = 0; q < QV; ++q) take(mnew[q], j, q);
      }
      for (size_t q = 0; q < QV; ++q) mnew[q] = hn::Max(hn::Max(mnew[q], m1[q]), hn::Max(m2[q], m3[q]));
    };
    may_be_nan ? plain_max(std::true_type{}) : plain_max(std::false_type{});
  }
  // A lane whose max is +inf (a score overflowed): shifted_exp's rule, exp(s - m) = 1 where
  // s == m, splits its weight among its +inf keys. Checked once per tile; rare.
  const V pos_inf = hn::Set(d, std::numeric_limits<T>::infinity());
  bool inf_max = false;
  for (size_t q = 0; q < QV; ++q) {
    // A lane with nothing allowed yet keeps max -inf; subtracting 0 keeps exp(-inf) = 0.
    msafe[q] = hn::IfThenZeroElse(hn::Eq(mnew[q], neg_inf), mnew[q]);
    mold[q] = hn::Load(d, bs.m + q * N);
    alpha[q] = RescaleFactor(d, mold[q], msafe[q]);
    inf_max = inf_max || !hn::AllFalse(d, hn::Eq(mnew[q], pos_inf));
    sum[q] = hn::Zero(d);
    tsum[q] = hn::Zero(d);
    hn::Store(mnew[q], d, bs.m + q * N);
  }
  // p = exp(s - m) over the tile (score_tile-inl.h's ShiftedExp); the +inf-max variant, and the
  // one that also sums t for the statistics (AddTTerm), in loops of their own, so that the
  // common loop stays as it was.
  const V lowest = hn::Set(d, std::numeric_limits<T>::lowest());
  // kFast (Problem::round_p) rounds each p to q's 16-bit type before it is summed: the
  // normaliser is the sum of the weights p·V uses (RoundWeights).
  const auto exp_tile = [&](auto inf_max_const, auto stats_const, auto round_const) {
    constexpr bool kInfMax = decltype(inf_max_const)::value;
    constexpr Round16 kRound = decltype(round_const)::value;
    for (int64_t j = 0; j < n; ++j) {
      for (size_t q = 0; q < QV; ++q) {
        T* row = st + j * mq + q * N;
        const V s = hn::Load(d, row);
        const V pj = RoundWeights<kRound>(d, ShiftedExp<kInfMax, kRound != Round16::kNone>(d, s, msafe[q]));
        sum[q] = hn::Add(sum[q], pj);
        if constexpr (decltype(stats_const)::value) tsum[q] = AddTTerm<kInfMax>(d, pj, s, msafe[q], tsum[q]);
        hn::Store(pj, d, row);
      }
    }
  };
  using NoRounding = std::integral_constant<Round16, Round16::kNone>;
  // kFast, bfloat16, p·V from pairs: the weights go straight into pp (ExpRoundPack).
  const bool fused_pairs = p.round_p && v_pairs != nullptr && p.dtype == DType::kBFloat16 && !inf_max &&
                           !p.dropout.enabled();
  if (stats) {  // never with kFast: run_forward gives the statistics an exact pass of their own
    inf_max ? exp_tile(std::true_type{}, std::true_type{}, NoRounding{})
            : exp_tile(std::false_type{}, std::true_type{}, NoRounding{});
    // t = alpha · (t + (m_old - m_new) · l_old) + Σ p · (s - m_new)  (rescale_t, per vector)
    for (size_t q = 0; q < QV; ++q) {
      T* t = bs.stats.t() + q * N;
      const V delta = hn::IfThenZeroElse(hn::Eq(mold[q], msafe[q]), hn::Max(hn::Sub(mold[q], msafe[q]), lowest));
      const V scaled = hn::Mul(alpha[q], hn::MulAdd(delta, hn::Load(d, bs.l + q * N), hn::LoadU(d, t)));
      hn::StoreU(hn::Add(hn::IfThenZeroElse(hn::Eq(alpha[q], hn::Zero(d)), scaled), tsum[q]), d, t);
    }
  } else if (fused_pairs) {
    if constexpr (std::is_same_v<T, float>) ExpRoundPack<QV>(d, st, mq, j0 - v0, n, msafe, sum, pp);
  } else if (std::is_same_v<T, float> && p.round_p) {
    WithRound16(p, [&](auto round) {
      inf_max ? exp_tile(std::true_type{}, std::false_type{}, round) : exp_tile(std::false_type{}, std::false_type{}, round);
    });
  } else if (inf_max) {
    exp_tile(std::true_type{}, std::false_type{}, NoRounding{});
  } else {
    exp_tile(std::false_type{}, std::false_type{}, NoRounding{});
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

  if constexpr (std::is_same_v<T, float>) {
    if (v_pairs != nullptr) {  // bfloat16 values in pairs: vdpbf16ps or AMX tiles
      alignas(64) float alphas[QV * hn::MaxLanes(d)];
      for (size_t q = 0; q < QV; ++q) hn::Store(alpha[q], d, alphas + q * N);
      if (fused_pairs) {  // kFast: the rounded weights, packed
        if (pv_amx) {
          AmxDotAccumulatePacked(pp, 1, 0, mq, j0 - v0, n, v_pairs, p.Dv, alphas, bs.ot);
        } else {
          Bf16DotAccumulatePacked(pp, mq, j0 - v0, n, v_pairs, p.Dv, alphas, bs.ot);
        }
        return;
      }
      if (p.round_p) {  // kFast: the rounded weights
        pv_amx ? AmxDotAccumulate(st, mq, j0 - v0, n, v_pairs, p.Dv, alphas, pp, bs.ot)
               : Bf16DotAccumulate(st, mq, j0 - v0, n, v_pairs, p.Dv, alphas, pp, bs.ot);
        return;
      }
      // kExact on AMX (flash-inl.h's pv_pairs): p = p1 + p2 + p3 exactly, each part a bfloat16
      // value (RoundWeights keeps 8 significant bits; p - p1 and the next difference are exact
      // in float32, and p's 24 bits leave at most 8 for p3), all three products summed in the
      // same float32 tiles. The tiles flush a part or a product below 2^-126 to 0: an absolute
      // error under 2^-126 · max|v| per key, bf16_dot.h's bound for kFast's product (the values are
      // in its range, HeadTiles::values_ok). mask_rows (ScoreTile's, done with) holds a part
      // while it is packed.
      const int64_t count = n * static_cast<int64_t>(mq), part_words = kPairsPartWords * static_cast<int64_t>(mq);
      for (int part = 0; part < 2; ++part) {
        for (int64_t x = 0; x < count; x += static_cast<int64_t>(N)) {
          const V w = hn::Load(d, st + x), head = RoundWeights<Round16::kBf16>(d, w);
          hn::Store(head, d, mask_rows + x);
          hn::Store(hn::Sub(w, head), d, st + x);
        }
        PackBf16WeightPairs(mask_rows, mq, j0 - v0, n, pp + part * part_words);
      }
      PackBf16WeightPairs(st, mq, j0 - v0, n, pp + 2 * part_words);
      AmxDotAccumulatePacked(pp, 3, part_words, mq, j0 - v0, n, v_pairs, p.Dv, alphas, bs.ot);
      return;
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
    if (pairs || s.pv_pairs) s.head.select(p, blk.b, blk.kvh, s.pv_amx);
    const bool keys_in_range = pairs && s.head.keys_ok(d, t);
    widen_keys |= !keys_in_range;
    const Rows<T> keys = widen_keys ? ReadRows(d, p.k, blk.b, blk.kvh, k0, k1 - k0, p.Dk, s.ktile.get()) : Rows<T>{};
    // kFast's bfloat16 p·V (Scratch::pv_pairs) takes the tile's values as pairs when they lie in
    // the instruction's range (which also leaves out NaN and inf); else they are widened.
    const uint32_t* v_pairs = nullptr;
    int64_t v0 = k0;
    if (s.pv_pairs && s.head.values_ok(d, t)) {
      if (s.pv_amx) {
        v_pairs = s.head.amx_values(t, s.vp.get());
        v0 = t;
      } else {
        PackBf16ValuePairs(p.v.template at<uint16_t>(blk.b, blk.kvh, k0), p.v.strides[2], k1 - k0, p.Dv, s.vp.get());
        v_pairs = s.vp.get();
      }
    }
    const Rows<T> values = v_pairs ? Rows<T>{} : ReadRows(d, p.v, blk.b, blk.kvh, k0, k1 - k0, p.Dv, s.vtile.get());
    const bool v_bad = !v_pairs && FlagNonFiniteRows(d, values.data, values.stride, k1 - k0, p.Dv, s.v_bad.data());
    for (size_t g = 0; g < count; ++g) {
      if (!sees[g]) continue;
      BlockTile<QV>(d, p, states[g], s.st.get(), s.mask_rows.get(), t, k0, keys, keys_in_range, values,
                    v_bad ? s.v_bad.data() : nullptr, v_pairs, v0, s.pp.get(), s.pv_amx);
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
    const bool keys_in_range = bs.qp != nullptr && TileRowsInDotRange(d, p, p.k, p.Dk, blk.b, blk.kvh, t);
    const Rows<T> keys = keys_in_range ? Rows<T>{} : ReadRows(d, p.k, blk.b, blk.kvh, j0, n, p.Dk, s.ktile.get());
    ScoreTile<QV>(d, p, bs, s.st.get(), mq, j0, n, /*partial=*/true, keys, keys_in_range, s.mask_rows.get());
    for (int64_t lane = 0; lane < blk.rows; ++lane) {
      const WeightsRow<T> row{p, blk.b, bs.lanes[lane].h, bs.lanes[lane].i};
      for (int64_t j = 0; j < n; ++j) row.put(j0 + j, weight(s.st.get()[j * mq + lane], m[lane], l[lane]));
    }
  }
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_FORWARD_BLOCK_INL_H_
