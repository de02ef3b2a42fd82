// Ring attention (sdpa/ring.h) on the in-process communicator of ring_local.h: world sizes 1-4,
// both layouts, against kReference on the whole sequence under the tolerance rule plus the
// merges' own bound, bit for bit against the documented order of pairs and merges (emulated here
// with attention() and merge_attention()), repeatable bit for bit; the collective check, the
// deadlines and the refusals, each with nothing written.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "ring_local.h"
#include "sdpa/merge.h"
#include "sdpa/ring.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Causal;
using sdpa::Options;
using sdpa::RingChunk;
using sdpa::RingLayout;

constexpr double kE = 2.718281828459045;

// One thread per rank on a shared machine: the kernels run single-threaded (set_num_threads is
// process-wide) so that W ranks do not oversubscribe the cores.
class Ring : public testing::Test {
 protected:
  void SetUp() override { sdpa::set_num_threads(1); }
  void TearDown() override { sdpa::set_num_threads(0); }
};

// The rows of dim `from_end` (2: the sequence's dim of (..., N, D); 1: of lse's (..., N)) of t
// that `chunks` name, concatenated in order, as a new C-order tensor of t's dtype.
GuardedTensor cut(const GuardedTensor& t, int from_end, const std::vector<RingChunk>& chunks) {
  std::vector<int64_t> shape = t.shape();
  const size_t d = shape.size() - static_cast<size_t>(from_end);
  int64_t inner = 1;
  for (size_t x = d + 1; x < shape.size(); ++x) inner *= shape[x];
  const int64_t n = shape[d], outer = n == 0 ? 0 : t.numel() / (n * inner);
  const std::vector<double> all = t.values();
  std::vector<double> part;
  int64_t total = 0;
  for (const RingChunk& c : chunks) total += c.length;
  for (int64_t o = 0; o < outer; ++o)
    for (const RingChunk& c : chunks)
      for (int64_t i = c.start; i < c.start + c.length; ++i)
        for (int64_t x = 0; x < inner; ++x) part.push_back(all[static_cast<size_t>((o * n + i) * inner + x)]);
  shape[d] = total;
  return tensor(t.dtype(), shape, part);
}
// The inverse: rank tensors' values (C order, local rows) placed at their chunks' positions of
// a whole (outer, N, inner) array.
void place(std::vector<double>& whole, int64_t N, const std::vector<double>& local, int64_t n_local, int64_t inner,
           const std::vector<RingChunk>& chunks) {
  const int64_t outer = n_local == 0 || inner == 0 ? 0 : static_cast<int64_t>(local.size()) / (n_local * inner);
  for (int64_t o = 0; o < outer; ++o)
    for (const RingChunk& c : chunks)
      for (int64_t i = 0; i < c.length; ++i)
        for (int64_t x = 0; x < inner; ++x) {
          whole[static_cast<size_t>((o * N + c.start + i) * inner + x)] =
              local[static_cast<size_t>((o * n_local + c.local + i) * inner + x)];
        }
}

struct RingCase {
  const char* name;
  int W;
  RingLayout layout;
  int64_t B, Hq, Hkv, n_local, Dk, Dv;
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  bool alibi = false, sinks = false, softcap = false;
  double dropout = 0;
  int64_t bq = 0, bk = 0;  // block mask when > 0
  bool fast = false;       // Precision::kFast
};

constexpr RingLayout kZig = RingLayout::kZigzag, kCont = RingLayout::kContiguous;

// The world sizes and layouts, with the options spread over them (each dtype runs every case).
const RingCase kCases[] = {
    {"w1_plain", 1, kZig, 1, 2, 2, 10, 8, 8},
    {"w1_contiguous_causal", 1, kCont, 1, 2, 1, 7, 8, 8, Causal::kTopLeft},
    {"w2_zigzag_causal_gqa", 2, kZig, 1, 4, 2, 12, 16, 8, Causal::kBottomRight},
    {"w2_contiguous_odd", 2, kCont, 2, 2, 2, 9, 8, 12},
    {"w3_zigzag_window_alibi", 3, kZig, 1, 4, 2, 14, 8, 8, Causal::kNone, {9, 4}, true},
    {"w3_contiguous_causal_sinks_softcap", 3, kCont, 1, 4, 2, 11, 8, 6, Causal::kTopLeft, {}, false, true, true},
    {"w4_zigzag_causal_dropout_block_mask", 4, kZig, 1, 2, 1, 16, 8, 8, Causal::kTopLeft, {}, false, false, false,
     0.2, 5, 7},
    {"w4_contiguous_97", 4, kCont, 1, 2, 2, 97, 16, 16, Causal::kBottomRight, {40, -1}, true, true},
    {"w2_zigzag_sinks_window", 2, kZig, 1, 2, 2, 20, 8, 8, Causal::kNone, {3, 3}, false, true},
};

// The case's options and the tensors they point to (whole-sequence block mask, slopes, sinks).
struct CaseOptions {
  GuardedTensor bm, slopes, sinks;
  Options o;
  CaseOptions(const RingCase& c, uint32_t seed)
      : bm(DType::kBool, {c.B, c.Hq, c.bq ? (c.W * c.n_local + c.bq - 1) / c.bq : 1,
                          c.bk ? (c.W * c.n_local + c.bk - 1) / c.bk : 1}),
        slopes(kF64, {c.Hq}),
        sinks(kF32, {c.Hq}) {
    std::mt19937 rng(seed);
    fill_mask(bm, rng, 0.6, 0.0);
    fill_uniform(slopes, rng, 0.01, 0.3);
    fill_normal(sinks, rng);
    o.causal = c.causal;
    o.window = c.window;
    if (c.alibi) o.alibi_slopes = slopes.view();
    if (c.sinks) o.sinks = sinks.view();
    if (c.softcap) o.softcap = 3;
    if (c.bq > 0) o.block_mask = bm.view(), o.block_q = c.bq, o.block_k = c.bk;
    if (c.dropout > 0) o.dropout_p = c.dropout, o.seed = 1234;
    if (c.fast) o.precision = sdpa::Precision::kFast;
  }
  CaseOptions(const CaseOptions&) = delete;
  CaseOptions& operator=(const CaseOptions&) = delete;
};

// Every rank's shards of a whole problem, and its outputs.
struct RankData {
  std::vector<RingChunk> chunks;
  GuardedTensor q, k, v, out, lse;
};

std::vector<RankData> shards(const Tensors& t, int W, RingLayout layout, DType out_dtype) {
  const int64_t n_local = t.q.shape()[2] / W;
  std::vector<RankData> ranks;
  for (int r = 0; r < W; ++r) {
    const std::vector<RingChunk> ch = sdpa::ring_chunks(layout, W, r, n_local);
    std::vector<int64_t> out_shape = t.q.shape(), lse_shape = t.q.shape();
    out_shape[2] = n_local, out_shape[3] = t.v.shape()[3];
    lse_shape.pop_back(), lse_shape[2] = n_local;
    ranks.push_back({ch, cut(t.q, 2, ch), cut(t.k, 2, ch), cut(t.v, 2, ch), GuardedTensor(out_dtype, out_shape),
                     GuardedTensor(compute_dtype(t.q.dtype()), lse_shape)});
  }
  return ranks;
}

// Runs the ring forward on every rank; fails the test on any rank's exception.
void run_forward(std::vector<RankData>& ranks, const Options& o, RingLayout layout) {
  LocalWorld world(static_cast<int>(ranks.size()));
  const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
    RankData& d = ranks[static_cast<size_t>(r)];
    sdpa::Outputs out;
    out.out = d.out.view();
    out.lse = d.lse.view();
    sdpa::ring_attention(comm, {d.q.view(), d.k.view(), d.v.view()}, out, o, {layout, 30.0});
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": " << e.what();
    }
  }
  for (size_t r = 0; r < ranks.size(); ++r) EXPECT_EQ(world.open_requests(static_cast<int>(r)), 0) << "rank " << r;
}

// The documented order, emulated on rank r's shards with the public calls: an accumulator of
// out 0, lse -inf in the compute type; for each step s the block of rank (r - s) mod W, for each
// query chunk, each key chunk of that block, attention() at the chunks' positions (sinks only
// at step 0 with the query chunk's own chunk) merged in place; then rounded once. Every pair is
// computed here (the ring skips those no row sees: merging them changes no bit).
void emulate(const std::vector<RankData>& ranks, int r, const Options& o, GuardedTensor& out,
             GuardedTensor& lse) {
  const int W = static_cast<int>(ranks.size());
  const RankData& me = ranks[static_cast<size_t>(r)];
  const DType ct = compute_dtype(me.q.dtype());
  const auto rows = [](const sdpa::TensorView& t, int dim, int64_t first, int64_t n) {
    sdpa::TensorView s = t;
    s.data = static_cast<char*>(t.data) + first * t.strides[dim] * sdpa::dtype_size(t.dtype);
    s.shape[dim] = n;
    return s;
  };
  GuardedTensor acc(ct, me.out.shape()), acc_lse(ct, me.lse.shape());
  acc.set_values(std::vector<double>(static_cast<size_t>(acc.numel()), 0.0));
  acc_lse.set_values(std::vector<double>(static_cast<size_t>(acc_lse.numel()), -kInf));
  for (int s = 0; s < W; ++s) {
    const RankData& blk = ranks[static_cast<size_t>((r + W - s) % W)];
    for (size_t qi = 0; qi < me.chunks.size(); ++qi) {
      const RingChunk& qc = me.chunks[qi];
      for (size_t ki = 0; ki < blk.chunks.size(); ++ki) {
        const RingChunk& kc = blk.chunks[ki];
        std::vector<int64_t> ps = me.out.shape(), ls = me.lse.shape();
        ps[2] = qc.length, ls[2] = qc.length;
        GuardedTensor po(ct, ps), pl(ct, ls);
        Options pop = o;
        pop.q_start = qc.start, pop.k_start = kc.start;
        if (!(s == 0 && ki == qi)) pop.sinks.reset();
        sdpa::Outputs outs;
        outs.out = po.view();
        outs.lse = pl.view();
        sdpa::attention({rows(me.q.view(), 2, qc.local, qc.length), rows(blk.k.view(), 2, kc.local, kc.length),
                         rows(blk.v.view(), 2, kc.local, kc.length)},
                        outs, pop);
        const sdpa::TensorView ao = rows(acc.view(), 2, qc.local, qc.length), al = rows(acc_lse.view(), 2, qc.local, qc.length);
        const sdpa::Partial parts[2] = {{ao, al}, {po.view(), pl.view()}};
        sdpa::merge_attention(parts, ao, al);
      }
    }
  }
  const sdpa::Partial whole[1] = {{acc.view(), acc_lse.view()}};
  sdpa::merge_attention(whole, out.view(), lse.view());
}

// The merges' own error (merge.h: one merge of k = 2 parts errs by at most u M ((2 + 2/e) 2 + 4)
// in out and u ((1 + 1/e) 2 + 1 + 2 log 2 + |lse|) in lse, first order, against exact
// arithmetic on its parts). A row merges P pairs one by one into an accumulator that starts
// empty (the first merge is exact: the empty part weighs 0 and the other 1), so P - 1 merges
// err; merge t also carries the lse error of the accumulator so far, (t - 1) lse bounds, which
// moves the two weights of a convex combination of outs within 2M of each other by at most
// w (1 - w) 2M delta <= M delta. M bounds |out| (max|v| / (1 - p)), L |lse| (the whole row's).
struct MergeBound {
  double out, lse;
};
MergeBound merge_bound(DType q, int64_t P, double M, double L) {
  const double u = eps(compute_dtype(q)) / 2, m = static_cast<double>(std::max<int64_t>(P - 1, 0));
  const double c_out = (2 + 2 / kE) * 2 + 4, c_lse = (1 + 1 / kE) * 2 + 1 + 2 * std::log(2.0) + L;
  return {m * u * M * (c_out + m * c_lse), m * u * c_lse};
}

void check_forward(const RingCase& c, DType dt) {
  const int64_t N = c.W * c.n_local;
  const Tensors t = random_qkv(dt, {c.B, c.Hq, N, c.Dk}, {c.B, c.Hkv, N, c.Dk}, {c.B, c.Hkv, N, c.Dv}, 17);
  const CaseOptions co(c, 5);
  const Options& o = co.o;
  std::vector<RankData> ranks = shards(t, c.W, c.layout, dt);
  run_forward(ranks, o, c.layout);
  // The whole sequence's out and lse from the ranks' shards.
  std::vector<double> out(static_cast<size_t>(c.B * c.Hq * N * c.Dv)), lse(static_cast<size_t>(c.B * c.Hq * N));
  for (const RankData& d : ranks) {
    EXPECT_TRUE(d.out.guards_intact());
    EXPECT_TRUE(d.lse.guards_intact());
    place(out, N, d.out.values(), c.n_local, c.Dv, d.chunks);
    place(lse, N, d.lse.values(), c.n_local, 1, d.chunks);
  }
  // Against kReference on the whole sequence: the tolerance rule plus the merges' bound.
  ForwardExpected e;
  ASSERT_TRUE(expected_forward(t, o, e));
  const int64_t P = c.layout == kZig ? 2 * c.W : c.W;
  const MergeBound mb =
      merge_bound(dt, P, max_abs_finite(t.v.values()) / (1 - o.dropout_p), max_abs_finite(e.ref.lse));
  EXPECT_TRUE(all_close("out", out, e.ref.out, e.tol.out + mb.out));
  EXPECT_TRUE(all_close("lse", lse, e.ref.lse, e.tol.lse + mb.lse));
  // Bit for bit the documented order, on every rank.
  for (int r = 0; r < c.W; ++r) {
    const RankData& d = ranks[static_cast<size_t>(r)];
    GuardedTensor eo(d.out.dtype(), d.out.shape()), el(d.lse.dtype(), d.lse.shape());
    emulate(ranks, r, o, eo, el);
    EXPECT_TRUE(all_close("out (documented order)", d.out.values(), eo.values(), 0)) << "rank " << r;
    EXPECT_TRUE(all_close("lse (documented order)", d.lse.values(), el.values(), 0)) << "rank " << r;
  }
  // Repeatable bit for bit.
  std::vector<RankData> again = shards(t, c.W, c.layout, dt);
  run_forward(again, o, c.layout);
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_TRUE(all_close("out (second run)", again[r].out.values(), ranks[r].out.values(), 0));
    EXPECT_TRUE(all_close("lse (second run)", again[r].lse.values(), ranks[r].lse.values(), 0));
  }
}

TEST_F(Ring, ForwardMatchesWhole) {
  for (const RingCase& c : kCases) {
    for (DType dt : {kF32, kF64, kBF16}) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      check_forward(c, dt);
    }
  }
  // float16 and kFast once each.
  RingCase c = {"w3_zigzag_f16", 3, kZig, 1, 4, 2, 10, 8, 8, Causal::kTopLeft, {}, true, true};
  {
    SCOPED_TRACE("float16");
    check_forward(c, kF16);
  }
  c.name = "w2_fast", c.W = 2, c.fast = true;
  {
    SCOPED_TRACE("kFast bfloat16");
    check_forward(c, kBF16);
  }
}

TEST_F(Ring, Chunks) {
  // ring.h's picture: W = 2, N = 8.
  const auto z0 = sdpa::ring_chunks(kZig, 2, 0, 4), z1 = sdpa::ring_chunks(kZig, 2, 1, 4);
  ASSERT_EQ(z0.size(), 2u);
  EXPECT_EQ(z0[0].start, 0);
  EXPECT_EQ(z0[1].start, 6);
  EXPECT_EQ(z0[1].local, 2);
  EXPECT_EQ(z0[1].length, 2);
  EXPECT_EQ(z1[0].start, 2);
  EXPECT_EQ(z1[1].start, 4);
  const auto c1 = sdpa::ring_chunks(kCont, 2, 1, 4);
  ASSERT_EQ(c1.size(), 1u);
  EXPECT_EQ(c1[0].start, 4);
  EXPECT_EQ(c1[0].length, 4);
  EXPECT_EQ(c1[0].local, 0);
  expect_sdpa_error([] { sdpa::ring_chunks(kZig, 2, 0, 5); }, {"kZigzag needs an even N_local", "N_local=5"});
  expect_sdpa_error([] { sdpa::ring_chunks(kCont, 2, 2, 4); }, {"rank=2", "[0, 2)"});
  expect_sdpa_error([] { sdpa::ring_chunks(kCont, 0, 0, 4); }, {"world=0"});
  expect_sdpa_error([] { sdpa::ring_chunks(kCont, 4, 0, std::numeric_limits<int64_t>::max() / 2); }, {"overflows"});
}

}  // namespace
