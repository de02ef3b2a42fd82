// Absolute positions (Options::q_start, k_start): the header's picture; every backend and dtype
// against kReference with positions; a whole call cut into query chunks × key chunks (in
// order, and in a zigzag order), each pair computed with its positions and merged here by
// log-sum-exp in float64, against the whole call under the tolerance rule, forward (out,
// weights, lse; causal, window, ALiBi, softcap, block mask, dropout, sinks, GQA) and backward
// (dq summed over key shards, dk and dv over query shards; dalibi_slopes and dsinks);
// positions that reproduce bottom-right and top-left causal bit for bit; errors naming the
// option, and the calls that refuse it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backward_util.h"
#include "sdpa/attention.h"
#include "sdpa/kv_cache.h"
#include "sdpa/mha.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;
using sdpa::Options;

constexpr DType kDtypes[] = {kF32, kF64, kBF16, kF16};
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Indices [begin, end) of dim `dim` (counted from the end: 1 is the last) of t, as a new C-order
// tensor of t's dtype.
GuardedTensor slice(const GuardedTensor& t, int from_end, int64_t begin, int64_t end) {
  std::vector<int64_t> shape = t.shape();
  const size_t d = shape.size() - static_cast<size_t>(from_end);
  int64_t inner = 1;
  for (size_t x = d + 1; x < shape.size(); ++x) inner *= shape[x];
  const int64_t n = shape[d], outer = n == 0 ? 0 : t.numel() / (n * inner);
  const std::vector<double> all = t.values();
  std::vector<double> part;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = begin; i < end; ++i)
      for (int64_t x = 0; x < inner; ++x) part.push_back(all[static_cast<size_t>((o * n + i) * inner + x)]);
  shape[d] = end - begin;
  return tensor(t.dtype(), shape, part);
}

// The pair of query rows [q0, q1) and keys [k0, k1) of t (rank 4), with its mask's slice.
Tensors pair_of(const Tensors& t, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  Tensors p{slice(t.q, 2, q0, q1), slice(t.k, 2, k0, k1), slice(t.v, 2, k0, k1), std::nullopt};
  if (t.mask) p.mask = slice(slice(*t.mask, 2, q0, q1), 1, k0, k1);
  return p;
}

struct Chunk {
  int64_t begin, end;
};

// [0, n) cut at `cuts` (increasing, inside (0, n)), then visited in `order` (indices of chunks).
std::vector<Chunk> chunks(int64_t n, const std::vector<int64_t>& cuts, const std::vector<int>& order = {}) {
  std::vector<Chunk> c;
  int64_t at = 0;
  for (int64_t x : cuts) c.push_back({at, x}), at = x;
  c.push_back({at, n});
  if (order.empty()) return c;
  std::vector<Chunk> ordered;
  for (int i : order) ordered.push_back(c[static_cast<size_t>(i)]);
  return ordered;
}
// The zigzag order of 2W chunks: W pairs (r, 2W - 1 - r), as ring attention's ranks hold them.
std::vector<int> zigzag(int W) {
  std::vector<int> order;
  for (int r = 0; r < W; ++r) order.push_back(r), order.push_back(2 * W - 1 - r);
  return order;
}

Options positioned(Options o, int64_t q_start, int64_t k_start) {
  o.q_start = q_start;
  o.k_start = k_start;
  return o;
}

// The whole call's out, weights and lse (float64) merged from the pair calls of every query chunk
// with every key chunk (in the order given), each with q_start = q_base + its first row and
// k_start = its first key: lse = log Σ_s exp(lse_s), out = Σ_s exp(lse_s - lse) out_s and weights
// w_s · exp(lse_s - lse). The sinks (if any) go to the first key chunk of each row only.
Outs merged(const Tensors& t, const Options& o, int64_t q_base, const std::vector<Chunk>& qc,
            const std::vector<Chunk>& kc) {
  const Dims d = dims_of(t);
  std::vector<double> out(static_cast<size_t>(d.B * d.Hq * d.Nq * d.Dv), 0.0);
  std::vector<double> weights(static_cast<size_t>(d.B * d.Hq * d.Nq * d.Nk), 0.0);
  std::vector<double> lse(static_cast<size_t>(d.B * d.Hq * d.Nq), kNegInf);
  for (const Chunk& q : qc) {
    std::vector<Outs> parts;
    for (size_t s = 0; s < kc.size(); ++s) {
      Options po = positioned(o, q_base + q.begin, kc[s].begin);
      if (s > 0) po.sinks.reset();
      parts.push_back(run(pair_of(t, q.begin, q.end, kc[s].begin, kc[s].end), po));
    }
    const int64_t nq = q.end - q.begin;
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t row = (b * d.Hq + h) * d.Nq + q.begin + i;
          double m = kNegInf;
          for (const Outs& p : parts) m = std::max(m, p.lse->at(0, b, h, i));
          if (m == kNegInf) continue;  // no key anywhere: out 0, weights 0, lse -inf
          double sum = 0;
          for (const Outs& p : parts) sum += std::exp(p.lse->at(0, b, h, i) - m);
          const double total = m + std::log(sum);
          lse[static_cast<size_t>(row)] = total;
          for (size_t s = 0; s < parts.size(); ++s) {
            const Outs& p = parts[s];
            const double w = std::exp(p.lse->at(0, b, h, i) - total);
            for (int64_t x = 0; x < d.Dv; ++x) out[static_cast<size_t>(row * d.Dv + x)] += w * p.out.at(b, h, i, x);
            for (int64_t j = kc[s].begin; j < kc[s].end; ++j) {
              weights[static_cast<size_t>(row * d.Nk + j)] = w * p.weights->at(b, h, i, j - kc[s].begin);
            }
          }
        }
  }
  Outs m{GuardedTensor(kF64, {d.B, d.Hq, d.Nq, d.Dv}), GuardedTensor(kF64, {d.B, d.Hq, d.Nq, d.Nk}),
         GuardedTensor(kF64, {d.B, d.Hq, d.Nq})};
  m.out.set_values(out);
  m.weights->set_values(weights);
  m.lse->set_values(lse);
  return m;
}

// The header's picture: a sequence of 6 in chunks of 2, causal; query shard at q_start = 2
// against the key shards at 0, 2 and 4.
TEST(Positions, HeaderPicture) {
  const Tensors t = random_qkv(kF32, {1, 1, 2, 4}, {1, 1, 6, 4}, {1, 1, 6, 3}, 1);
  const char* want[3] = {"xx xx", "x. xx", ".. .."};  // rows P = 2, 3 for k_start = 0, 2, 4
  for (Backend backend : {Backend::kAuto, Backend::kNaive, Backend::kReference}) {
    for (int s = 0; s < 3; ++s) {
      Options o;
      o.causal = s == 1 ? Causal::kTopLeft : Causal::kBottomRight;  // either kind: positions decide
      o.backend = backend;
      const Outs got = run(pair_of(t, 0, 2, 2 * s, 2 * s + 2), positioned(o, 2, 2 * s));
      for (int i = 0; i < 2; ++i) {
        bool any = false;
        for (int j = 0; j < 2; ++j) {
          const bool allowed = want[s][i * 3 + j] == 'x';
          any = any || allowed;
          EXPECT_EQ(got.weights->at(0, 0, i, j) != 0, allowed) << backend_name(backend) << " k_start " << 2 * s
                                                               << " row " << i << " key " << j;
        }
        if (!any) {
          EXPECT_EQ(got.lse->at(0, 0, 0, i), kNegInf);
          for (int x = 0; x < 3; ++x) EXPECT_EQ(got.out.at(0, 0, i, x), 0.0);
        }
      }
    }
  }
}

// A query shard wholly before a key shard under causal sees nothing: out exactly 0, weights 0,
// lse -inf (with sinks: the sink), for every backend and dtype, and every other option on.
TEST(Positions, ShardBeforeKeysSeesNothing) {
  const GuardedTensor slopes = tensor(kF64, {2}, {0.5, 0.25});
  const GuardedTensor sinks = tensor(kF64, {2}, {0.75, -1.5});
  for (DType dt : kDtypes) {
    const Tensors t = random_qkv(dt, {1, 2, 37, 8}, {1, 1, 130, 8}, {1, 1, 130, 5}, 2);
    for (Backend backend : {Backend::kAuto, Backend::kNaive, Backend::kReference}) {
      for (bool with_sinks : {false, true}) {
        Options o;
        o.backend = backend;
        o.causal = Causal::kTopLeft;
        o.window = {300, 2};
        o.alibi_slopes = slopes.view();
        o.dropout_p = 0.25;
        o.seed = 9;
        if (with_sinks) o.sinks = sinks.view();
        const Outs got = run(t, positioned(o, 100, 137));  // rows 100..136, keys 137..266
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t i = 0; i < 37; ++i) {
            const double lse = with_sinks ? round_to(got.lse->dtype(), h == 0 ? 0.75 : -1.5) : kNegInf;
            ASSERT_EQ(got.lse->at(0, 0, h, i), lse) << backend_name(backend) << " " << sdpa::dtype_name(dt);
            for (int64_t x = 0; x < 5; ++x) ASSERT_EQ(got.out.at(0, h, i, x), 0.0);
            for (int64_t j = 0; j < 130; ++j) ASSERT_EQ(got.weights->at(0, h, i, j), 0.0);
          }
      }
    }
  }
}

struct KernelCase {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv, q_start, k_start;
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  bool alibi = false, block_mask = false;
  double dropout = 0;
  bool seqlens = false, sinks = false, softcap = false;
};

// Every fused path (prefill blocks, decode, the weights pass; tiles skipped by causal, window and
// block mask at offsets that are no multiple of the tiles) against kReference on the same
// positioned call, every dtype, within the tolerance rule; then the same on AVX2 where the CPU
// has AVX-512.
TEST(Positions, KernelsMatchReference) {
  const KernelCase cases[] = {
      {"causal_gqa", 2, 4, 2, 97, 211, 16, 24, 300, 190, Causal::kBottomRight},
      {"causal_rows_partly_blind", 1, 2, 1, 130, 97, 8, 8, 50, 120, Causal::kTopLeft},
      {"window_alibi", 1, 3, 3, 97, 300, 32, 16, 400, 250, Causal::kNone, {40, 7}, true},
      {"decode_window", 2, 8, 2, 1, 1025, 64, 64, 5000, 4100, Causal::kBottomRight, {700, -1}, true},
      {"one_row_one_key", 1, 1, 1, 1, 1, 4, 4, 7, 3, Causal::kTopLeft},
      {"block_mask_dropout", 1, 2, 2, 150, 517, 32, 32, 77, 301, Causal::kNone, {}, false, true, 0.2},
      {"causal_block_mask_seqlens", 2, 2, 1, 97, 260, 16, 16, 333, 120, Causal::kBottomRight, {}, true, true, 0.1,
       true},
      {"sinks_softcap_window", 1, 4, 2, 33, 1025, 16, 8, 900, 0, Causal::kNone, {128, 128}, true, false, 0, false,
       true, true},
  };
  for (const KernelCase& c : cases) {
    for (DType dt : kDtypes) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      Tensors t = random_qkv(dt, {c.B, c.Hq, c.Nq, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dv}, 11);
      if (c.seqlens) t.seqlens_k = {c.Nk, c.Nk / 3};
      std::mt19937 rng(5);
      const int64_t bq = 16, bk = 128;  // block rows; keys per block a tile's, at an offset
      const int64_t QB = (c.q_start + c.Nq + bq - 1) / bq + 2, KB = (c.k_start + c.Nk + bk - 1) / bk + 1;
      GuardedTensor bm(DType::kBool, {c.B, 1, QB, KB});
      fill_mask(bm, rng, 0.6, 0.0);
      GuardedTensor slopes(kF64, {c.Hq}), sinks(kF64, {c.Hq});
      fill_uniform(slopes, rng, 0.01, 0.3);
      fill_normal(sinks, rng);
      Options o;
      o.causal = c.causal;
      o.window = c.window;
      if (c.alibi) o.alibi_slopes = slopes.view();
      if (c.sinks) o.sinks = sinks.view();
      if (c.softcap) o.softcap = 5;
      if (c.block_mask) o.block_mask = bm.view(), o.block_q = bq, o.block_k = bk;
      if (c.dropout > 0) o.dropout_p = c.dropout, o.seed = 1234;
      o = positioned(o, c.q_start, c.k_start);
      for (bool avx2 : {false, true}) {
        if (avx2 && !avx2_pass_skip_reason().empty()) continue;
        std::optional<Avx2Only> cap;
        if (avx2) cap.emplace();
        for (Backend backend : {Backend::kAuto, Backend::kNaive}) {
          o.backend = backend;
          const Outs got = run(t, o);
          EXPECT_TRUE(matches_reference(t, o, got)) << backend_name(backend) << (avx2 ? " AVX2" : "");
          EXPECT_TRUE(got.guards_intact());
        }
      }
    }
  }
}

struct SplitCase {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  std::vector<int64_t> qcuts, kcuts;  // chunk boundaries
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  bool alibi = false, block_mask = false;
  double dropout = 0;
  bool sinks = false, softcap = false;
  int64_t bq = 16, bk = 16;
};

// The whole call (no positions) against its pieces: each query chunk × key chunk with its
// positions, merged by lse. Nq = Nk (self-attention: row i at position i) for the block mask
// and dropout, which the whole call indexes by row; Nq < Nk puts the queries at the sequence's
// end (bottom-right, as causal, the window and ALiBi align them: q_start = Nk - Nq + row).
const SplitCase kSplitCases[] = {
    {"causal_gqa", 2, 4, 2, 97, 97, 16, 8, {25, 50, 75}, {25, 50, 75}, Causal::kTopLeft},
    {"causal_uneven_chunks", 1, 2, 1, 131, 131, 8, 8, {1, 40, 41, 100}, {64, 130}, Causal::kBottomRight},
    {"window_alibi_softcap", 1, 3, 1, 97, 97, 16, 16, {30, 60}, {10, 50, 90}, Causal::kNone, {12, 5}, true, false, 0,
     false, true},
    {"block_mask_dropout_causal", 1, 2, 2, 300, 300, 32, 32, {75, 150, 225}, {75, 150, 225}, Causal::kTopLeft, {},
     false, true, 0.2, false, false, 64, 128},
    {"small_blocks_dropout", 2, 2, 1, 97, 97, 8, 5, {33, 66}, {20, 70}, Causal::kNone, {30, 30}, true, true, 0.3, false,
     false, 7, 11},
    {"sinks_causal", 1, 4, 2, 80, 80, 16, 16, {20, 40, 60}, {20, 40, 60}, Causal::kTopLeft, {}, true, false, 0, true},
    {"queries_at_end", 1, 2, 2, 37, 101, 16, 12, {20}, {30, 64, 90}, Causal::kBottomRight, {50, 0}, true},
};

// A split case's options, and the random block mask, ALiBi slopes and sinks they point to.
struct SplitOptions {
  GuardedTensor bm, slopes, sinks;
  Options o;
  SplitOptions(const SplitCase& c, uint32_t seed)
      : bm(DType::kBool, {c.B, c.Hq, (c.Nq + c.bq - 1) / c.bq, (c.Nk + c.bk - 1) / c.bk}),
        slopes(kF64, {c.B, c.Hq}),
        sinks(kF64, {c.Hq}) {
    std::mt19937 rng(seed);
    fill_mask(bm, rng, 0.6, 0.0);
    fill_uniform(slopes, rng, 0.01, 0.3);
    fill_normal(sinks, rng);
    o.causal = c.causal;
    o.window = c.window;
    if (c.alibi) o.alibi_slopes = slopes.view();
    if (c.sinks) o.sinks = sinks.view();
    if (c.softcap) o.softcap = 4;
    if (c.block_mask) o.block_mask = bm.view(), o.block_q = c.bq, o.block_k = c.bk;
    if (c.dropout > 0) o.dropout_p = c.dropout, o.seed = 77;
  }
  SplitOptions(const SplitOptions&) = delete;  // o points into this object's tensors
  SplitOptions& operator=(const SplitOptions&) = delete;
};

void check_split(const SplitCase& c, DType dt, bool zig) {
  Tensors t = random_qkv(dt, {c.B, c.Hq, c.Nq, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dv}, 21);
  const SplitOptions so(c, 8);
  const Options& o = so.o;
  const int W = static_cast<int>(c.kcuts.size() + 1) / 2;
  const std::vector<int> korder = zig && c.kcuts.size() % 2 == 1 ? zigzag(W) : std::vector<int>{};
  const std::vector<int> qorder = zig && c.qcuts.size() % 2 == 1 ? zigzag(static_cast<int>(c.qcuts.size() + 1) / 2)
                                                                 : std::vector<int>{};
  const Outs m = merged(t, o, c.Nk - c.Nq, chunks(c.Nq, c.qcuts, qorder), chunks(c.Nk, c.kcuts, korder));
  EXPECT_TRUE(matches_reference(t, o, m));
}

TEST(Positions, SplitMatchesWhole) {
  for (const SplitCase& c : kSplitCases) {
    for (DType dt : kDtypes) {
      for (bool zig : {false, true}) {
        SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt) + (zig ? " zigzag" : " contiguous"));
        check_split(c, dt, zig);
      }
    }
  }
}

// Positions that put the rows where bottom-right causal does (q_start - k_start = Nk - Nq) give
// that call bit for bit (causal, window, ALiBi, softcap; either Causal kind), and equal starts
// give top-left's: the kernels' arithmetic is the same, only the key ranges come from positions.
TEST(Positions, BottomRightAndTopLeftBitwise) {
  const GuardedTensor slopes = tensor(kF64, {4}, {0.5, 0.25, 0.125, 0.0625});
  const std::pair<int64_t, int64_t> shapes[] = {{97, 211}, {211, 97}, {1, 1025}, {64, 64}};
  for (DType dt : kDtypes) {
    for (auto [nq, nk] : shapes) {
      const Tensors t = random_qkv(dt, {2, 4, nq, 16}, {2, 2, nk, 16}, {2, 2, nk, 8}, 31);
      for (Backend backend : {Backend::kAuto, Backend::kNaive, Backend::kReference}) {
        for (int variant = 0; variant < 3; ++variant) {
          SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " " + backend_name(backend) + " " + std::to_string(nq) +
                       "x" + std::to_string(nk) + " variant " + std::to_string(variant));
          Options plain;
          plain.backend = backend;
          plain.causal = Causal::kBottomRight;
          if (variant >= 1) plain.window = {30, 3}, plain.alibi_slopes = slopes.view();
          if (variant == 2) plain.softcap = 3, plain.causal = Causal::kNone;
          const Outs want = run(t, plain);
          Options o = plain;
          o.causal = variant == 2 ? Causal::kNone : Causal::kTopLeft;  // positions decide the alignment
          const int64_t shift = 1000;  // any common shift
          const Outs got = run(t, positioned(o, shift + std::max<int64_t>(nk - nq, 0), shift + std::max<int64_t>(nq - nk, 0)));
          EXPECT_TRUE(bitwise_equal(got, want));
          if (variant == 0) {
            plain.causal = Causal::kTopLeft;
            EXPECT_TRUE(bitwise_equal(run(t, positioned(o, 123, 123)), run(t, plain)));
          }
        }
      }
    }
  }
}

// ---- The backward of a pair, given the whole rows' out and lse ----

struct Sums {
  std::vector<double> g[3];  // dq, dk, dv of the whole call, summed from the pairs'
  std::vector<double> dalibi, dsinks;
};

// The pairs' gradients summed: dq over key chunks, dk and dv over query chunks, dalibi_slopes
// over every pair, dsinks from the first key chunk of each query chunk (the one given the sinks).
Sums pair_gradients(const Problem& whole, const Options& o, int64_t q_base, const std::vector<Chunk>& qc,
                    const std::vector<Chunk>& kc) {
  const Tensors& t = whole.t;
  const Dims d = dims_of(t);
  Sums s;
  s.g[0].assign(static_cast<size_t>(t.q.numel()), 0.0);
  s.g[1].assign(static_cast<size_t>(t.k.numel()), 0.0);
  s.g[2].assign(static_cast<size_t>(t.v.numel()), 0.0);
  s.dalibi.assign(o.alibi_slopes ? static_cast<size_t>(o.alibi_slopes->numel()) : 0, 0.0);
  s.dsinks.assign(o.sinks ? static_cast<size_t>(d.Hq) : 0, 0.0);
  for (const Chunk& q : qc) {
    for (size_t n = 0; n < kc.size(); ++n) {
      const Chunk& k = kc[n];
      Options po = positioned(o, q_base + q.begin, k.begin);
      if (n > 0) po.sinks.reset();
      const Problem p{pair_of(t, q.begin, q.end, k.begin, k.end), slice(whole.out, 2, q.begin, q.end),
                      slice(whole.lse, 1, q.begin, q.end), slice(whole.dout, 2, q.begin, q.end)};
      Grads g = empty_grads(p.t, Layout::kContiguous);
      sdpa::Gradients grads = g.gradients();
      GuardedTensor dalibi(kF64, o.alibi_slopes ? std::vector<int64_t>(o.alibi_slopes->shape, o.alibi_slopes->shape +
                                                                                                   o.alibi_slopes->rank)
                                                : std::vector<int64_t>{1});
      GuardedTensor dsinks(kF64, {d.Hq});
      if (o.alibi_slopes) grads.dalibi_slopes = dalibi.view();
      if (po.sinks) grads.dsinks = dsinks.view();
      sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), grads, po);
      const GradValues v = values(g);
      const int64_t rows[3] = {q.begin, k.begin, k.begin}, full[3] = {d.Nq, d.Nk, d.Nk}, part[3] = {q.end - q.begin,
                                                                                                   k.end - k.begin,
                                                                                                   k.end - k.begin};
      const int64_t width[3] = {d.Dk, d.Dk, d.Dv};
      for (int x = 0; x < 3; ++x) {
        const int64_t outer = part[x] == 0 ? 0 : static_cast<int64_t>(v.g[x].size()) / (part[x] * width[x]);
        for (int64_t o2 = 0; o2 < outer; ++o2)
          for (int64_t i = 0; i < part[x]; ++i)
            for (int64_t e = 0; e < width[x]; ++e) {
              s.g[x][static_cast<size_t>((o2 * full[x] + rows[x] + i) * width[x] + e)] +=
                  v.g[x][static_cast<size_t>((o2 * part[x] + i) * width[x] + e)];
            }
      }
      if (o.alibi_slopes) {
        const std::vector<double> a = dalibi.values();
        for (size_t i = 0; i < a.size(); ++i) s.dalibi[i] += a[i];
      }
      if (po.sinks) {
        const std::vector<double> a = dsinks.values();
        for (size_t i = 0; i < a.size(); ++i) s.dsinks[i] += a[i];
      }
    }
  }
  return s;
}

// The whole call's gradients (attention_backward without positions, from kAuto's out and lse)
// against the pairs' sums: dq, dk and dv within the backward's tolerance rule of kReference's;
// then dalibi_slopes and dsinks.
void check_backward_split(const SplitCase& c, DType dt, bool zig) {
  Tensors inputs = random_qkv(dt, {c.B, c.Hq, c.Nq, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dv}, 41);
  const SplitOptions so(c, 9);
  const Options& o = so.o;
  const Problem whole = make_problem(std::move(inputs), o, Layout::kContiguous, 5);
  const Tensors& t = whole.t;
  Expected e;
  ASSERT_TRUE(expected(whole, o, e));
  const int W = static_cast<int>(c.kcuts.size() + 1) / 2;
  const std::vector<int> korder = zig && c.kcuts.size() % 2 == 1 ? zigzag(W) : std::vector<int>{};
  const Sums s = pair_gradients(whole, o, c.Nk - c.Nq, chunks(c.Nq, c.qcuts), chunks(c.Nk, c.kcuts, korder));
  for (int x = 0; x < 3; ++x) EXPECT_TRUE(all_near(kGradNames[x], s.g[x], e.ref.g[x], e.tol[x]));
  // dalibi_slopes and dsinks (float32 inputs: kNaive's error is measured in float32) by the rule's
  // form: 2 · |kNaive - kReference| of the whole call + 4 eps max(1, max|kReference|).
  if ((!c.alibi && !c.sinks) || dt != kF32) return;
  const auto modifiers = [&](Backend backend) {
    Options ro = o;
    ro.backend = backend;
    Grads g = empty_grads(t, Layout::kContiguous);
    sdpa::Gradients grads = g.gradients();
    GuardedTensor dalibi(kF64, {c.B, c.Hq}), dsinks(kF64, {c.Hq});
    if (c.alibi) grads.dalibi_slopes = dalibi.view();
    if (c.sinks) grads.dsinks = dsinks.view();
    sdpa::attention_backward(t.inputs(), whole.out.view(), whole.lse.view(), whole.dout.view(), grads, ro);
    return std::pair{c.alibi ? dalibi.values() : std::vector<double>{}, c.sinks ? dsinks.values() : std::vector<double>{}};
  };
  const auto ref = modifiers(Backend::kReference), naive = modifiers(Backend::kNaive);
  const auto check = [](const char* what, const std::vector<double>& got, const std::vector<double>& want,
                        const std::vector<double>& yardstick) {
    double err = 0;
    for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::abs(yardstick[i] - want[i]));
    EXPECT_TRUE(all_near(what, got, want, 2 * err + 4 * eps(kF32) * std::max(1.0, max_abs_finite(want))));
  };
  if (c.alibi) check("dalibi_slopes", s.dalibi, ref.first, naive.first);
  if (c.sinks) check("dsinks", s.dsinks, ref.second, naive.second);
}

TEST(Positions, BackwardSplitMatchesWhole) {
  for (const SplitCase& c : kSplitCases) {
    for (DType dt : {kF32, kF64}) {
      for (bool zig : {false, true}) {
        SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt) + (zig ? " zigzag" : " contiguous"));
        check_backward_split(c, dt, zig);
      }
    }
  }
}

// ---- Errors ----

TEST(Positions, Errors) {
  const Tensors t = random_qkv(kF32, {1, 2, 5, 4}, {1, 2, 7, 4}, {1, 2, 7, 4}, 3);
  const Outs out = run(t, {});
  const auto call = [&](const Options& o) { sdpa::attention(t.inputs(), out.outputs(), o); };
  Options o;
  o.q_start = 3;
  expect_sdpa_error([&] { call(o); }, {"q_start is set but k_start is not"});
  o.q_start.reset();
  o.k_start = 3;
  expect_sdpa_error([&] { call(o); }, {"k_start is set but q_start is not"});
  expect_sdpa_error([&] { call(positioned({}, -1, 0)); }, {"q_start=-1", ">= 0"});
  expect_sdpa_error([&] { call(positioned({}, 0, -2)); }, {"k_start=-2", ">= 0"});
  const int64_t max = std::numeric_limits<int64_t>::max();
  expect_sdpa_error([&] { call(positioned({}, max - 4, 0)); }, {"q_start=9223372036854775803", "Nq=5", "overflows"});
  expect_sdpa_error([&] { call(positioned({}, 0, max - 6)); }, {"k_start=", "Nk=7", "overflows"});
  call(positioned({}, max - 5, max - 7));  // the last positions held: fine
  // The block mask must cover the rows' and keys' positions' blocks (more is fine).
  const GuardedTensor small(DType::kBool, {3, 4}), big(DType::kBool, {9, 9});
  Options b = positioned({}, 6, 2);
  b.block_q = 4, b.block_k = 3;  // QB >= ceil(11 / 4) = 3, KB >= ceil(9 / 3) = 3
  b.block_mask = big.view();
  call(b);
  b.block_mask = small.view();
  call(b);
  b = positioned(b, 9, 2);
  expect_sdpa_error([&] { call(b); }, {"block_mask has shape (3, 4)", "QB >= 4 = ceil((q_start + Nq) / block_q)",
                                       "ceil((9 + 5) / 4)"});
  // attention_backward checks them too.
  Grads g = empty_grads(t, Layout::kContiguous);
  expect_sdpa_error([&] {
    sdpa::attention_backward(t.inputs(), out.out.view(), out.lse->view(), out.out.view(), g.gradients(),
                             positioned({}, -5, 0));
  }, {"q_start=-5"});
  EXPECT_TRUE(g.untouched());
  EXPECT_TRUE(out.guards_intact());
}

// The calls that take no positions refuse them, naming the option, before writing anything.
TEST(Positions, OtherCallsRefuse) {
  const Options o = positioned({}, 0, 0);
  const std::vector<std::string> why = {"takes no positions", "q_start"};
  // attention_varlen and its backward: one sequence of 3.
  const Tensors t = random_qkv(kF32, {3, 2, 4}, {3, 2, 4}, {3, 2, 4}, 4);
  std::vector<int64_t> cu = {0, 3};
  const sdpa::TensorView cu_view = sdpa::TensorView::contiguous(cu.data(), DType::kInt64, {2});
  const sdpa::VarlenInputs vin{t.q.view(), t.k.view(), t.v.view(), cu_view, cu_view};
  GuardedTensor out(kF32, {3, 2, 4}), lse(kF32, {2, 3});
  expect_sdpa_error([&] { sdpa::attention_varlen(vin, {out.view(), lse.view()}, o); }, why);
  EXPECT_TRUE(out.untouched());
  Grads g = empty_grads(t, Layout::kContiguous);
  expect_sdpa_error([&] { sdpa::attention_varlen_backward(vin, out.view(), lse.view(), out.view(), g.gradients(), o); },
                    why);
  EXPECT_TRUE(g.untouched());
  // attention_paged: one page of 4 keys.
  const Tensors pt = random_qkv(kF32, {1, 2, 1, 4}, {1, 4, 2, 4}, {1, 4, 2, 4}, 5);
  std::vector<int32_t> table = {0}, lengths = {4};
  sdpa::PagedInputs pin{pt.q.view(), pt.k.view(), pt.v.view(),
                        sdpa::TensorView::contiguous(table.data(), DType::kInt32, {1, 1}),
                        sdpa::TensorView::contiguous(lengths.data(), DType::kInt32, {1})};
  GuardedTensor pout(kF32, {1, 2, 1, 4});
  sdpa::Outputs po;
  po.out = pout.view();
  expect_sdpa_error([&] { sdpa::attention_paged(pin, po, o); }, why);
  EXPECT_TRUE(pout.untouched());
  // KVCache::attention.
  sdpa::KVCache cache(4, 4, 2, 4, 4, kF32);
  const int64_t seq = cache.new_sequence();
  expect_sdpa_error([&] { cache.attention(pt.q.view(), {seq}, po, o); }, {"KVCache::attention", "q_start"});
  // The layer: refused before anything is read.
  sdpa::MultiHeadConfig config;
  expect_sdpa_error([&] { sdpa::multi_head_attention(config, {}, {}, {}, o); }, {"multi_head_attention", "q_start"});
  expect_sdpa_error([&] { sdpa::multi_head_attention_backward(config, {}, {}, {}, {}, {}, o); },
                    {"multi_head_attention_backward", "q_start"});
}

}  // namespace
