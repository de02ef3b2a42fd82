// Ring attention (sdpa/ring.h) on the in-process communicator of ring_local.h: world sizes 1-4,
// both layouts, against kReference on the whole sequence under the tolerance rule plus the
// merges' own bound, bit for bit against the documented order of pairs and merges (emulated here
// with attention() and merge_attention()), repeatable bit for bit; the collective check, the
// deadlines and the refusals, each with nothing written.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "ring_local.h"
#include "ring_util.h"
#include "sdpa/merge.h"
#include "sdpa/ring.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Causal;
using sdpa::Options;
using sdpa::RingChunk;
using sdpa::RingLayout;


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


}  // namespace

void sdpa_test::check_forward(const RingCase& c, DType dt, RingStrategy strategy) {
  const int64_t N = c.W * c.n_local;
  const Tensors t = random_qkv(dt, {c.B, c.Hq, N, c.Dk}, {c.B, c.Hkv, N, c.Dk}, {c.B, c.Hkv, N, c.Dv}, 17);
  const CaseOptions co(c, 5);
  const Options& o = co.o;
  std::vector<RankData> ranks = shards(t, c.W, c.layout, dt);
  run_forward(ranks, o, ring_options(c.layout, strategy));
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
  // Bit for bit the documented order, on every rank (kAllGather: its pairs and merges are
  // kRing's, ring.h).
  for (int r = 0; r < c.W; ++r) {
    const RankData& d = ranks[static_cast<size_t>(r)];
    GuardedTensor eo(d.out.dtype(), d.out.shape()), el(d.lse.dtype(), d.lse.shape());
    emulate(ranks, r, o, eo, el);
    EXPECT_TRUE(all_close("out (documented order)", d.out.values(), eo.values(), 0)) << "rank " << r;
    EXPECT_TRUE(all_close("lse (documented order)", d.lse.values(), el.values(), 0)) << "rank " << r;
  }
  // Repeatable bit for bit, also when each message lands as soon as it is sent (ring_local.h:
  // kEager writes into a posted receive while the receiver computes).
  std::vector<RankData> again = shards(t, c.W, c.layout, dt);
  run_forward(again, o, ring_options(c.layout, strategy), Delivery::kEager);
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_TRUE(all_close("out (second run)", again[r].out.values(), ranks[r].out.values(), 0));
    EXPECT_TRUE(all_close("lse (second run)", again[r].lse.values(), ranks[r].lse.values(), 0));
  }
}

namespace {

TEST_F(Ring, ForwardMatchesWhole) {
  for (const RingCase& c : kCases) {
    for (DType dt : {kF32, kF64, kBF16}) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      check_forward(c, dt, RingStrategy::kRing);
    }
  }
  // float16 and kFast once each.
  RingCase c = {"w3_zigzag_f16", 3, kZig, 1, 4, 2, 10, 8, 8, Causal::kTopLeft, {}, true, true};
  {
    SCOPED_TRACE("float16");
    check_forward(c, kF16, RingStrategy::kRing);
  }
  c.name = "w2_fast", c.W = 2, c.fast = true;
  {
    SCOPED_TRACE("kFast bfloat16");
    check_forward(c, kBF16, RingStrategy::kRing);
  }
}

// ---- Backward ----

}  // namespace

void sdpa_test::check_backward(const RingCase& c, DType dt, RingStrategy strategy) {
  const int64_t N = c.W * c.n_local;
  Tensors inputs = random_qkv(dt, {c.B, c.Hq, N, c.Dk}, {c.B, c.Hkv, N, c.Dk}, {c.B, c.Hkv, N, c.Dv}, 23);
  const CaseOptions co(c, 6);
  const Options& o = co.o;
  // The ranks' shards of the whole problem's out, lse (kAuto's) and dout.
  const Problem whole = make_problem(std::move(inputs), o, Layout::kContiguous, 7);
  const Tensors& t = whole.t;
  const std::vector<RankData> ranks = shards(t, c.W, c.layout, dt);
  const auto run = [&](RingStrategy s, Delivery delivery) {
    return run_backward(ranks, whole.out, whole.lse, whole.dout, o, ring_options(c.layout, s), co.slopes.shape(), kF32,
                        delivery);
  };
  // The whole gradients from the ranks' shards; dalibi_slopes and dsinks summed over the ranks.
  const int64_t width[3] = {c.Dk, c.Dk, c.Dv};
  struct Whole {
    GradValues g;
    std::vector<double> dalibi, dsinks;
  };
  const auto gather = [&](const std::vector<RankGrads>& rg) {
    Whole w;
    w.g.g[0].resize(static_cast<size_t>(t.q.numel())), w.g.g[1].resize(static_cast<size_t>(t.k.numel())),
        w.g.g[2].resize(static_cast<size_t>(t.v.numel()));
    w.dalibi.assign(static_cast<size_t>(co.slopes.numel()), 0.0), w.dsinks.assign(static_cast<size_t>(c.Hq), 0.0);
    for (size_t r = 0; r < rg.size(); ++r) {
      EXPECT_TRUE(rg[r].g.guards_intact()) << "rank " << r;
      const GradValues v = values(rg[r].g);
      for (int x = 0; x < 3; ++x) place(w.g.g[x], N, v.g[x], c.n_local, width[x], ranks[r].chunks);
      if (o.alibi_slopes) {
        const std::vector<double> a = rg[r].dalibi.values();
        for (size_t h = 0; h < a.size(); ++h) w.dalibi[h] += a[h];
      }
      if (o.sinks) {
        const std::vector<double> a = rg[r].dsinks.values();
        for (size_t h = 0; h < a.size(); ++h) w.dsinks[h] += a[h];
      }
    }
    return w;
  };
  const std::vector<RankGrads> rg = run(strategy, Delivery::kAtWait);
  const Whole got = gather(rg);
  // Against kReference under the backward's rule, plus the ring's sums (ring_util.h's sums_bound;
  // kAllGather sums the same terms in another order, which the bound allows).
  Expected e;
  ASSERT_TRUE(expected(whole, o, e));
  const int64_t P = c.layout == kZig ? 2 * c.W : c.W;
  const std::array<double, 3> sums = sums_bound(
      dt, P, c.Dk, c.Dv, static_cast<double>(c.Hq / c.Hkv * N), o.dropout_p,
      {max_abs_finite(whole.dout.values()), max_abs_finite(t.v.values()), max_abs_finite(whole.out.values()),
       max_abs_finite(t.k.values()), max_abs_finite(t.q.values())});
  for (int x = 0; x < 3; ++x) EXPECT_TRUE(all_near(kGradNames[x], got.g.g[x], e.ref.g[x], e.tol[x] + sums[x]));
  // dalibi_slopes and dsinks (float32: kNaive's error is measured in float32) as positions_test
  // checks the pairs' sums: 2 |kNaive - kReference| of the whole call + 4 eps max(1, max|ref|).
  if (dt == kF32 && (o.alibi_slopes || o.sinks)) {
    const auto modifiers = [&](sdpa::Backend backend) {
      Options ro = o;
      ro.backend = backend;
      Grads g = empty_grads(t, Layout::kContiguous);
      sdpa::Gradients grads = g.gradients();
      GuardedTensor da(kF64, co.slopes.shape()), ds(kF64, {c.Hq});
      if (o.alibi_slopes) grads.dalibi_slopes = da.view();
      if (o.sinks) grads.dsinks = ds.view();
      sdpa::attention_backward(t.inputs(), whole.out.view(), whole.lse.view(), whole.dout.view(), grads, ro);
      return std::pair{da.values(), ds.values()};
    };
    const auto ref = modifiers(sdpa::Backend::kReference), naive = modifiers(sdpa::Backend::kNaive);
    const auto check = [](const char* what, const std::vector<double>& g, const std::vector<double>& want,
                          const std::vector<double>& yardstick) {
      double err = 0;
      for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::abs(yardstick[i] - want[i]));
      EXPECT_TRUE(all_near(what, g, want, 2 * err + 4 * eps(kF32) * std::max(1.0, max_abs_finite(want))));
    };
    if (o.alibi_slopes) check("dalibi_slopes", got.dalibi, ref.first, naive.first);
    if (o.sinks) check("dsinks", got.dsinks, ref.second, naive.second);
  }
  // kAllGather against kRing (held to the same bounds by the kRing cases): each within its bound
  // of kReference's, so within twice of each other (not bit for bit: dk, dv sum the same W terms
  // in another order, and a call of one kv head's query heads may take another kernel path than
  // kRing's call of all heads, e.g. with softcap); dalibi_slopes and dsinks within the sums'
  // reordering, 4 eps of the largest (float64 terms per rank), in every dtype.
  if (strategy == RingStrategy::kAllGather) {
    const Whole ring = gather(run(RingStrategy::kRing, Delivery::kAtWait));
    for (int x = 0; x < 3; ++x) {
      EXPECT_TRUE(all_near(kGradNames[x], got.g.g[x], ring.g.g[x], 2 * (e.tol[x] + sums[x]))) << "against kRing";
    }
    if (o.alibi_slopes) {
      EXPECT_TRUE(all_near("dalibi_slopes", got.dalibi, ring.dalibi,
                           4 * eps(kF32) * std::max(1.0, max_abs_finite(ring.dalibi))))
          << "against kRing";
    }
    if (o.sinks) {
      EXPECT_TRUE(all_near("dsinks", got.dsinks, ring.dsinks, 4 * eps(kF32) * std::max(1.0, max_abs_finite(ring.dsinks))))
          << "against kRing";
    }
  }
  // Repeatable bit for bit, also with kEager delivery (as the forward).
  const std::vector<RankGrads> again = run(strategy, Delivery::kEager);
  for (size_t r = 0; r < rg.size(); ++r) {
    EXPECT_TRUE(bitwise_equal(again[r].g, rg[r].g)) << "rank " << r;
    if (o.alibi_slopes) {
      EXPECT_TRUE(all_close("dalibi (second run)", again[r].dalibi.values(), rg[r].dalibi.values(), 0));
    }
    if (o.sinks) {
      EXPECT_TRUE(all_close("dsinks (second run)", again[r].dsinks.values(), rg[r].dsinks.values(), 0));
    }
  }
}

namespace {

TEST_F(Ring, BackwardMatchesWhole) {
  for (const RingCase& c : kCases) {
    for (DType dt : {kF32, kF64, kBF16}) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      check_backward(c, dt, RingStrategy::kRing);
    }
  }
  RingCase c = {"w3_zigzag_f16", 3, kZig, 1, 4, 2, 10, 8, 8, Causal::kTopLeft, {}, true, true};
  SCOPED_TRACE("float16");
  check_backward(c, kF16, RingStrategy::kRing);
}

// ---- Failures: every rank throws, nothing is written ----

// W ranks of a small float32 problem; `edit` changes rank r's call before it runs.
struct FailureRun {
  std::vector<RankData> ranks;
  std::vector<std::string> errors;
  std::vector<double> seconds;
};
// After the run, every rank's requests settled (ring_util.h), whichever threw.
FailureRun run_failing(int W, int64_t n_local, const std::function<void(LocalWorld&)>& setup,
                       const std::function<void(int, sdpa::Inputs&, Options&, sdpa::RingOptions&)>& edit,
                       Delivery delivery = Delivery::kAtWait) {
  const int64_t N = W * n_local;
  const Tensors t = random_qkv(kF32, {1, 2, N, 4}, {1, 2, N, 4}, {1, 2, N, 4}, 3);
  FailureRun f{shards(t, W, kCont, kF32), {}, std::vector<double>(static_cast<size_t>(W), 0.0)};
  LocalWorld world(W, delivery);
  setup(world);
  const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
    RankData& d = f.ranks[static_cast<size_t>(r)];
    sdpa::Inputs in{d.q.view(), d.k.view(), d.v.view()};
    Options o;
    o.causal = Causal::kTopLeft;
    sdpa::RingOptions ring{kCont, 0.5};
    edit(r, in, o, ring);
    sdpa::Outputs out;
    out.out = d.out.view();
    out.lse = d.lse.view();
    const auto start = std::chrono::steady_clock::now();
    try {
      sdpa::ring_attention(comm, in, out, o, ring);
    } catch (...) {
      f.seconds[static_cast<size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      throw;
    }
  });
  f.errors = messages(errors);
  expect_requests_settled(world);
  return f;
}

TEST_F(Ring, MismatchIsTheSameErrorOnEveryRank) {
  // Rank 2 with another scale; rank 1 with another N_local (its own shard cut shorter).
  const FailureRun a = run_failing(3, 6, [](LocalWorld&) {}, [](int r, sdpa::Inputs&, Options& o, sdpa::RingOptions&) {
    if (r == 2) o.scale = 0.25;
  });
  for (size_t r = 0; r < a.errors.size(); ++r) {
    EXPECT_NE(a.errors[r].find("rank 2's arguments differ from rank 0's"), std::string::npos) << a.errors[r];
    EXPECT_NE(a.errors[r].find("scale: default on rank 0, 0.25 on rank 2"), std::string::npos) << a.errors[r];
    EXPECT_EQ(a.errors[r], a.errors[0]);
    EXPECT_TRUE(a.ranks[r].out.untouched());
    EXPECT_TRUE(a.ranks[r].lse.untouched());
  }
  const FailureRun b = run_failing(4, 6, [](LocalWorld&) {}, [](int r, sdpa::Inputs& in, Options&, sdpa::RingOptions&) {
    if (r == 1) in.q.shape[2] = in.k.shape[2] = in.v.shape[2] = 4;
  });
  for (size_t r = 0; r < b.errors.size(); ++r) {
    EXPECT_EQ(b.errors[r], b.errors[0]);
    EXPECT_TRUE(b.ranks[r].out.untouched());
  }
  // Rank 1's out no longer matches its q: it refuses locally, and every rank says so.
  EXPECT_NE(b.errors[0].find("rank 1 refused its arguments"), std::string::npos) << b.errors[0];
  // The layout: another N_local with matching outputs is a difference of q's shape.
  const FailureRun c = run_failing(2, 6, [](LocalWorld&) {}, [](int r, sdpa::Inputs&, Options& o, sdpa::RingOptions& ring) {
    if (r == 1) ring.layout = kZig;
    (void)o;
  });
  for (const std::string& e : c.errors) EXPECT_NE(e.find("RingOptions::layout: kContiguous on rank 0, kZigzag on rank 1"), std::string::npos) << e;
}

TEST_F(Ring, StoppedRankTimesOut) {
  for (Delivery delivery : {Delivery::kAtWait, Delivery::kEager}) {
  SCOPED_TRACE(delivery == Delivery::kEager ? "kEager" : "kAtWait");
  // Rank 1 never sends a block: rank 2 gives up on it after 0.5 s naming it; the others, waiting
  // on ranks that gave up, within one deadline per step.
  const int W = 4;
  const FailureRun f = run_failing(W, 5, [](LocalWorld& w) { w.stop_sends(1, 0); },
                                   [](int, sdpa::Inputs&, Options&, sdpa::RingOptions&) {}, delivery);
  EXPECT_NE(f.errors[2].find("ring_attention: rank 2 waited 0.5 s for the block of rank 1 at step 1 from rank 1: no message"),
            std::string::npos)
      << f.errors[2];
  EXPECT_LT(f.seconds[2], 0.5 + 0.4);
  EXPECT_GE(f.seconds[2], 0.5);
  for (int r = 0; r < W; ++r) {
    if (r == 1) continue;
    EXPECT_NE(f.errors[static_cast<size_t>(r)].find("no message (a peer died, stopped or is slower than timeout_seconds)"),
              std::string::npos)
        << "rank " << r << ": " << f.errors[static_cast<size_t>(r)];
    EXPECT_LT(f.seconds[static_cast<size_t>(r)], (W - 1) * 0.5 + 0.4) << "rank " << r;
    EXPECT_TRUE(f.ranks[static_cast<size_t>(r)].out.untouched()) << "rank " << r;
    EXPECT_TRUE(f.ranks[static_cast<size_t>(r)].lse.untouched()) << "rank " << r;
  }
  // A rank that never joins: the all-gather's deadline.
  const FailureRun g = run_failing(2, 4, [](LocalWorld& w) { w.stop_allgathers(0); w.stop_sends(0, 0); },
                                   [](int, sdpa::Inputs&, Options&, sdpa::RingOptions&) {});
  EXPECT_NE(g.errors[1].find("rank 1 waited 0.5 s for the all-gather of the ranks' arguments"), std::string::npos)
      << g.errors[1];
  EXPECT_TRUE(g.ranks[1].out.untouched());
  }
}

// A rank that stops in the middle of the ring (rank 1 of 3 sends its own block at step 0, then
// nothing): its successor, rank 2, gives up at step 2 naming it, and writes nothing; ranks 0
// and 1 got every block and finish.
TEST_F(Ring, RankStoppedMidRing) {
  for (Delivery delivery : {Delivery::kAtWait, Delivery::kEager}) {
    SCOPED_TRACE(delivery == Delivery::kEager ? "kEager" : "kAtWait");
    const FailureRun f = run_failing(3, 4, [](LocalWorld& w) { w.stop_sends(1, 1); },
                                     [](int, sdpa::Inputs&, Options&, sdpa::RingOptions&) {}, delivery);
    EXPECT_NE(f.errors[2].find("ring_attention: rank 2 waited 0.5 s for the block of rank 0 at step 2 from rank 1: "
                               "no message"),
              std::string::npos)
        << f.errors[2];
    EXPECT_TRUE(f.ranks[2].out.untouched());
    EXPECT_TRUE(f.ranks[2].lse.untouched());
    for (int r : {0, 1}) {
      EXPECT_EQ(f.errors[static_cast<size_t>(r)], "") << "rank " << r;
      EXPECT_FALSE(f.ranks[static_cast<size_t>(r)].out.untouched()) << "rank " << r;
    }
  }
}

// A rank that stops during the backward, before its last hop (the gradients of its successor's
// own block): the successor gives up on them and writes nothing; the others finish.
TEST_F(Ring, RankStoppedBeforeTheGradientsLastHop) {
  const int W = 3;
  const int64_t n_local = 4, N = W * n_local;
  const Tensors t = random_qkv(kF32, {1, 2, N, 4}, {1, 2, N, 4}, {1, 2, N, 4}, 3);
  Options o;
  o.causal = Causal::kTopLeft;
  for (Delivery delivery : {Delivery::kAtWait, Delivery::kEager}) {
    SCOPED_TRACE(delivery == Delivery::kEager ? "kEager" : "kAtWait");
    std::vector<RankData> ranks = shards(t, W, kCont, kF32);
    run_forward(ranks, o, {kCont, 30.0});
    std::vector<Grads> grads;
    for (const RankData& d : ranks) {
      grads.push_back({GuardedTensor(kF32, d.q.shape()), GuardedTensor(kF32, d.k.shape()), GuardedTensor(kF32, d.v.shape())});
    }
    LocalWorld world(W, delivery);
    world.stop_sends(1, 2 * W - 2);  // its sends: (block, gradients) at steps 0 .. W - 2, then gradients
    const std::vector<std::string> errors = messages(world.run([&](int r, sdpa::Communicator& comm) {
      const RankData& d = ranks[static_cast<size_t>(r)];
      sdpa::ring_attention_backward(comm, {d.q.view(), d.k.view(), d.v.view()}, d.out.view(), d.lse.view(),
                                    d.out.view(), grads[static_cast<size_t>(r)].gradients(), o, {kCont, 0.5});
    }));
    expect_requests_settled(world);
    EXPECT_NE(errors[2].find("ring_attention_backward: rank 2 waited 0.5 s for the gradients of its own block at step 3 "
                             "from rank 1: no message"),
              std::string::npos)
        << errors[2];
    EXPECT_TRUE(grads[2].untouched());
    for (int r : {0, 1}) {
      EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
      EXPECT_FALSE(grads[static_cast<size_t>(r)].dk.untouched()) << "rank " << r;
    }
  }
}

// The backward's pair failures travel with the gradients (ring.cc): no input makes a pair of
// the backward throw once the collective check passed (an lse of +inf is refused there; a NaN
// gives NaN gradients), so rank 1's failure is injected by its transport: from step 1 on, the
// failure record that ends each of its gradients' messages says "rank 1 failed" (ring.cc's
// Failure: int32 rank + 1, then 380 chars; tag kTagGradients = 2902). The sums that passed rank 1
// then are those of every block but rank 1's own: their owners throw, naming rank 1, and write
// nothing; rank 1 finishes.
class InjectFailure : public sdpa::Communicator {
 public:
  explicit InjectFailure(sdpa::Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Request isend(const void* data, size_t bytes, int to, int tag) override {
    if (tag != 2902 || gradients_++ == 0) return inner_.isend(data, bytes, to, tag);
    std::vector<std::byte> m(static_cast<const std::byte*>(data), static_cast<const std::byte*>(data) + bytes);
    const int32_t rank_plus_1 = rank() + 1;
    char* record = reinterpret_cast<char*>(m.data() + bytes - 384);
    std::memcpy(record, &rank_plus_1, 4);
    std::snprintf(record + 4, 380, "%s", "injected");
    return inner_.isend(m.data(), bytes, to, tag);  // LocalComm copies it at once
  }
  Request irecv(void* data, size_t bytes, int from, int tag) override { return inner_.irecv(data, bytes, from, tag); }
  Request iallgather(const void* in, void* out, size_t bytes) override { return inner_.iallgather(in, out, bytes); }
  bool wait(Request request, double seconds) override { return inner_.wait(request, seconds); }

 private:
  sdpa::Communicator& inner_;
  int gradients_ = 0;
};

// Rank 1's transport fails (ring_util.h's FaultyTransport: an sdpa::Error from its second isend,
// just after the step's irecv was posted; or from the wait of its second receive, with the
// step's send outstanding): the ring throws that Error, and the requests it left behind are
// settled all the same (the irecv / the send waited by the unwinding call, or their buffers
// leaked).
TEST_F(Ring, TransportErrorsLeaveNoRequestBehind) {
  for (const bool in_wait : {false, true}) {
    SCOPED_TRACE(in_wait ? "wait" : "isend");
    const int W = 3;
    const Tensors t = random_qkv(kF32, {1, 2, W * 4, 4}, {1, 2, W * 4, 4}, {1, 2, W * 4, 4}, 3);
    std::vector<RankData> ranks = shards(t, W, kCont, kF32);
    LocalWorld world(W, Delivery::kEager);
    const std::vector<std::string> errors = messages(world.run([&](int r, sdpa::Communicator& comm) {
      RankData& d = ranks[static_cast<size_t>(r)];
      FaultyTransport faulty(comm, in_wait ? FaultyTransport::Faults{-1, 1, -1} : FaultyTransport::Faults{1, -1, -1});
      sdpa::Outputs out;
      out.out = d.out.view();
      sdpa::ring_attention(r == 1 ? faulty : comm, {d.q.view(), d.k.view(), d.v.view()}, out, {}, {kCont, 0.5});
    }));
    expect_requests_settled(world);
    EXPECT_EQ(errors[1], in_wait ? "FaultyTransport: wait failed" : "FaultyTransport: isend refused");
    EXPECT_TRUE(ranks[1].out.untouched());
  }
}

TEST_F(Ring, BackwardPairFailureReachesTheOwnersOfTheSums) {
  const int W = 3;
  const int64_t n_local = 4, N = W * n_local;
  const Tensors t = random_qkv(kF32, {1, 2, N, 4}, {1, 2, N, 4}, {1, 2, N, 4}, 3);
  for (Delivery delivery : {Delivery::kAtWait, Delivery::kEager}) {
    SCOPED_TRACE(delivery == Delivery::kEager ? "kEager" : "kAtWait");
    std::vector<RankData> ranks = shards(t, W, kCont, kF32);
    run_forward(ranks, {}, {kCont, 30.0});
    std::vector<Grads> grads;
    for (const RankData& d : ranks) {
      grads.push_back({GuardedTensor(kF32, d.q.shape()), GuardedTensor(kF32, d.k.shape()), GuardedTensor(kF32, d.v.shape())});
    }
    LocalWorld world(W, delivery);
    const std::vector<std::string> errors = messages(world.run([&](int r, sdpa::Communicator& comm) {
      const RankData& d = ranks[static_cast<size_t>(r)];
      InjectFailure injecting(comm);
      sdpa::ring_attention_backward(r == 1 ? injecting : comm, {d.q.view(), d.k.view(), d.v.view()}, d.out.view(),
                                    d.lse.view(), d.out.view(), grads[static_cast<size_t>(r)].gradients(), {},
                                    {kCont, 0.5});
    }));
    expect_requests_settled(world);
    EXPECT_EQ(errors[1], "");
    EXPECT_FALSE(grads[1].dk.untouched());
    for (int r : {0, 2}) {
      EXPECT_EQ(errors[static_cast<size_t>(r)],
                "ring_attention_backward: rank 1 could not compute its part of this rank's dk and dv: injected")
          << "rank " << r;
      EXPECT_TRUE(grads[static_cast<size_t>(r)].untouched()) << "rank " << r;
    }
  }
}

// A pair whose computation fails (a NaN in a query or key: the lse of every row that sees it is
// NaN, which merge_attention refuses) is an Error on each rank that computed such a pair, after
// the ring: that rank still passes every block on, so the other ranks finish (no deadline is
// reached), and it writes nothing. Contiguous, causal, W = 3: a NaN in rank 1's queries fails
// rank 1 alone (rank 2 still needs rank 1 to pass on rank 0's block at step 1); one in rank 1's
// keys fails ranks 1 and 2 (rank 0 never sees them).
TEST_F(Ring, PairFailureIsAnErrorAfterTheRing) {
  for (Delivery delivery : {Delivery::kAtWait, Delivery::kEager}) {
    for (const bool in_keys : {false, true}) {
      SCOPED_TRACE(std::string(delivery == Delivery::kEager ? "kEager" : "kAtWait") + (in_keys ? ", keys" : ", queries"));
      const FailureRun f = run_failing(3, 4, [](LocalWorld&) {}, [&](int r, sdpa::Inputs& in, Options&, sdpa::RingOptions&) {
        if (r == 1) static_cast<float*>((in_keys ? in.k : in.q).data)[1 * 4 + 2] = std::numeric_limits<float>::quiet_NaN();
      }, delivery);
      for (int r = 0; r < 3; ++r) {
        const std::string& e = f.errors[static_cast<size_t>(r)];
        const RankData& d = f.ranks[static_cast<size_t>(r)];
        if (r == 1 || (in_keys && r == 2)) {
          EXPECT_NE(e.find("lse has NaN"), std::string::npos) << "rank " << r << ": " << e;
          EXPECT_LT(f.seconds[static_cast<size_t>(r)], 0.5) << "rank " << r;
          EXPECT_TRUE(d.out.untouched()) << "rank " << r;
          EXPECT_TRUE(d.lse.untouched()) << "rank " << r;
        } else {
          EXPECT_EQ(e, "") << "rank " << r;
          EXPECT_FALSE(d.out.untouched()) << "rank " << r;
        }
      }
    }
  }
}

TEST_F(Ring, Refusals) {
  const auto refused = [](const std::function<void(int, sdpa::Inputs&, Options&, sdpa::RingOptions&)>& edit,
                          const std::string& why) {
    const FailureRun f = run_failing(2, 4, [](LocalWorld&) {}, edit);
    for (size_t r = 0; r < f.errors.size(); ++r) {
      EXPECT_NE(f.errors[r].find(why), std::string::npos) << "rank " << r << ": " << f.errors[r];
      EXPECT_TRUE(f.ranks[r].out.untouched());
    }
  };
  const GuardedTensor mask(DType::kBool, {4, 4});
  std::vector<int64_t> lengths = {4};
  refused([&](int r, sdpa::Inputs& in, Options&, sdpa::RingOptions&) { if (r == 0) in.mask = mask.view(); },
          "rank 0 refused its arguments: ring_attention: Inputs::mask is not supported");
  refused([&](int r, sdpa::Inputs& in, Options&, sdpa::RingOptions&) {
    if (r == 1) in.seqlens_k = sdpa::TensorView::contiguous(lengths.data(), DType::kInt64, {1});
  }, "Inputs::seqlens_k is not supported");
  refused([](int, sdpa::Inputs&, Options& o, sdpa::RingOptions&) { o.q_start = 0, o.k_start = 0; },
          "Options::q_start and k_start must not be set");
  refused([](int r, sdpa::Inputs&, Options& o, sdpa::RingOptions&) { if (r == 1) o.dropout_p = 0.5; },
          "needs a seed");
  // kZigzag with an odd N_local: ring_chunks' Error, on every rank.
  const FailureRun z = run_failing(2, 5, [](LocalWorld&) {}, [](int, sdpa::Inputs&, Options&, sdpa::RingOptions& ring) {
    ring.layout = kZig;
  });
  for (const std::string& e : z.errors) EXPECT_NE(e.find("kZigzag needs an even N_local"), std::string::npos) << e;
  // A block mask too small for the whole sequence (8 positions: 2 blocks of 4 needed; rank 0's
  // own rows need only 1).
  const GuardedTensor small(DType::kBool, {1, 1});
  refused([&](int, sdpa::Inputs&, Options& o, sdpa::RingOptions&) {
    o.block_mask = small.view(), o.block_q = 4, o.block_k = 4;
  }, "block_mask has shape (1, 1)");
  // Outputs the ring refuses, and a timeout that is not > 0 (no collective: the rank's own Error).
  LocalWorld world(1);
  const Tensors t = random_qkv(kF32, {1, 2, 4, 4}, {1, 2, 4, 4}, {1, 2, 4, 4}, 3);
  GuardedTensor out(kF32, {1, 2, 4, 4}), weights(kF32, {1, 2, 4, 4});
  sdpa::Outputs o;
  o.out = out.view();
  o.weights = weights.view();
  expect_sdpa_error([&] { sdpa::ring_attention(world.comm(0), t.inputs(), o, {}, {kCont, 1.0}); },
                    {"Outputs::weights is not supported"});
  o.weights.reset();
  expect_sdpa_error([&] { sdpa::ring_attention(world.comm(0), t.inputs(), o, {}, {kCont, 0.0}); },
                    {"timeout_seconds=0", "> 0"});
  EXPECT_TRUE(out.untouched());
  // The backward: dbias, and lse missing.
  Grads g = empty_grads(t, Layout::kContiguous);
  sdpa::Gradients grads = g.gradients();
  GuardedTensor dbias(kF32, {4, 4}), lse(kF32, {1, 2, 4});
  grads.dbias = dbias.view();
  expect_sdpa_error([&] {
    sdpa::ring_attention_backward(world.comm(0), t.inputs(), out.view(), lse.view(), out.view(), grads, {}, {kCont, 1.0});
  }, {"Gradients::dbias is not supported"});
  EXPECT_TRUE(g.untouched());
}

// RingOptions::stats: the bytes each rank sent are its blocks (forward: W - 1 sends of its K/V
// block; backward: those and W sends of a block's dk, dv sums and failure record), and times
// that add up to at most the call's.
TEST_F(Ring, Stats) {
  const int W = 3;
  const int64_t n_local = 6;
  const Tensors t = random_qkv(kF32, {1, 2, W * n_local, 4}, {1, 2, W * n_local, 4}, {1, 2, W * n_local, 4}, 3);
  std::vector<RankData> ranks = shards(t, W, kCont, kF32);
  LocalWorld world(W);
  std::vector<sdpa::RingStats> fwd(W), bwd(W);
  std::vector<double> seconds(W);
  const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
    RankData& d = ranks[static_cast<size_t>(r)];
    const sdpa::Inputs in{d.q.view(), d.k.view(), d.v.view()};
    Options o;
    o.causal = Causal::kTopLeft;
    const auto start = std::chrono::steady_clock::now();
    sdpa::ring_attention(comm, in, {d.out.view(), std::nullopt, d.lse.view()}, o, {kCont, 5.0, &fwd[r]});
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    GuardedTensor dq(kF32, {1, 2, n_local, 4}), dk(kF32, {1, 2, n_local, 4}), dv(kF32, {1, 2, n_local, 4});
    sdpa::ring_attention_backward(comm, in, d.out.view(), d.lse.view(), d.out.view(),
                                  {dq.view(), dk.view(), dv.view()}, o, {kCont, 5.0, &bwd[r]});
  });
  for (const std::string& e : messages(errors)) ASSERT_EQ(e, "");
  const int64_t block = 2 * (1 * 2 * n_local * 4) * 4;  // k and v, float32
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    EXPECT_EQ(fwd[r].bytes_sent, (W - 1) * block);
    EXPECT_GT(bwd[r].bytes_sent, (W - 1) * block + W * block);  // + the failure records
    EXPECT_GT(fwd[r].compute_seconds, 0.0);
    EXPECT_GT(fwd[r].check_seconds, 0.0);
    EXPECT_GE(fwd[r].wait_seconds, 0.0);
    EXPECT_LE(fwd[r].check_seconds + fwd[r].compute_seconds + fwd[r].wait_seconds, seconds[r]);
    EXPECT_GT(bwd[r].compute_seconds, 0.0);
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
