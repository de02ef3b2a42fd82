// RingStrategy::kAllGather (sdpa/ring.h) on the in-process communicator of ring_local.h: world
// sizes 1-4, both layouts, GQA and MQA, against kReference on the whole sequence under the
// tolerance rule plus the merges' and sums' bounds ring_test derives, and against kRing on the
// same inputs (the same pairs and merge order: out and lse bit for bit; the gradients within
// twice the bound, as dk, dv sum the same W terms in another order and a call of fewer heads may
// take another kernel path); repeatable bit for bit; a mismatch, a stopped
// rank and the refusals as Errors within the deadline, nothing written. Packed documents:
// ring_docs_test runs both strategies.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "ring_local.h"
#include "ring_util.h"
#include "sdpa/ring.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Causal;
using sdpa::RingStrategy;

constexpr RingLayout kZig = RingLayout::kZigzag, kCont = RingLayout::kContiguous;
constexpr RingStrategy kAG = RingStrategy::kAllGather, kRingS = RingStrategy::kRing;

struct AgCase {
  const char* name;
  int W;
  RingLayout layout;
  int64_t B, Hq, Hkv, n_local, Dk, Dv;
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  bool alibi = false, batch_slopes = false, sinks = false, softcap = false;  // batch_slopes: (B, Hq)
};

const AgCase kCases[] = {
    {"w1_mqa", 1, kZig, 1, 4, 1, 10, 8, 8},
    {"w2_zigzag_causal_gqa", 2, kZig, 1, 8, 2, 12, 16, 8, Causal::kBottomRight},
    {"w2_contiguous_mqa_batch_slopes", 2, kCont, 2, 4, 1, 9, 8, 12, Causal::kNone, {}, true, true},
    {"w3_zigzag_window_alibi_sinks", 3, kZig, 1, 4, 2, 14, 8, 8, Causal::kNone, {9, 4}, true, false, true},
    {"w3_contiguous_causal_softcap_batch", 3, kCont, 2, 4, 2, 11, 8, 6, Causal::kTopLeft, {}, false, false, false, true},
    {"w4_zigzag_causal_mqa_sinks", 4, kZig, 1, 2, 1, 16, 8, 8, Causal::kTopLeft, {}, true, true, true},
    {"w4_contiguous_97_window", 4, kCont, 1, 2, 2, 97, 16, 16, Causal::kBottomRight, {40, -1}, true, false, true},
};

struct AgOptions {
  GuardedTensor slopes, sinks;
  Options o;
  AgOptions(const AgCase& c, uint32_t seed)
      : slopes(kF64, c.batch_slopes ? std::vector<int64_t>{c.B, c.Hq} : std::vector<int64_t>{c.Hq}), sinks(kF32, {c.Hq}) {
    std::mt19937 rng(seed);
    fill_uniform(slopes, rng, 0.01, 0.3);
    fill_normal(sinks, rng);
    o.causal = c.causal;
    o.window = c.window;
    if (c.alibi) o.alibi_slopes = slopes.view();
    if (c.sinks) o.sinks = sinks.view();
    if (c.softcap) o.softcap = 3;
  }
};

sdpa::RingOptions ring_of(const AgCase& c, RingStrategy s, double timeout = 30.0) {
  sdpa::RingOptions ring{c.layout, timeout};
  ring.strategy = s;
  return ring;
}

void check_forward(const AgCase& c, DType dt) {
  const int64_t N = c.W * c.n_local;
  const Tensors t = random_qkv(dt, {c.B, c.Hq, N, c.Dk}, {c.B, c.Hkv, N, c.Dk}, {c.B, c.Hkv, N, c.Dv}, 41);
  const AgOptions co(c, 9);
  const Options& o = co.o;
  std::vector<RankData> ag = shards(t, c.W, c.layout, dt), rg = shards(t, c.W, c.layout, dt);
  run_forward(ag, o, ring_of(c, kAG));
  run_forward(rg, o, ring_of(c, kRingS));
  std::vector<double> out(static_cast<size_t>(c.B * c.Hq * N * c.Dv)), lse(static_cast<size_t>(c.B * c.Hq * N));
  for (size_t r = 0; r < ag.size(); ++r) {
    const RankData& d = ag[r];
    EXPECT_TRUE(d.out.guards_intact());
    EXPECT_TRUE(d.lse.guards_intact());
    place(out, N, d.out.values(), c.n_local, c.Dv, d.chunks);
    place(lse, N, d.lse.values(), c.n_local, 1, d.chunks);
    // kRing's pairs, merged in kRing's order: the same bits.
    EXPECT_TRUE(all_close("out (kRing's)", d.out.values(), rg[r].out.values(), 0)) << "rank " << r;
    EXPECT_TRUE(all_close("lse (kRing's)", d.lse.values(), rg[r].lse.values(), 0)) << "rank " << r;
  }
  ForwardExpected e;
  ASSERT_TRUE(expected_forward(t, o, e));
  const int64_t P = c.layout == kZig ? 2 * c.W : c.W;
  const MergeBound mb = merge_bound(dt, P, max_abs_finite(t.v.values()), max_abs_finite(e.ref.lse));
  EXPECT_TRUE(all_close("out", out, e.ref.out, e.tol.out + mb.out));
  EXPECT_TRUE(all_close("lse", lse, e.ref.lse, e.tol.lse + mb.lse));
  std::vector<RankData> again = shards(t, c.W, c.layout, dt);
  run_forward(again, o, ring_of(c, kAG));
  for (size_t r = 0; r < ag.size(); ++r) {
    EXPECT_TRUE(all_close("out (second run)", again[r].out.values(), ag[r].out.values(), 0));
    EXPECT_TRUE(all_close("lse (second run)", again[r].lse.values(), ag[r].lse.values(), 0));
  }
}

TEST_F(Ring, AllGatherForwardMatchesWholeAndRing) {
  for (const AgCase& c : kCases) {
    for (DType dt : {kF32, kF64, kBF16}) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      check_forward(c, dt);
    }
  }
}

struct RankGrads {
  GuardedTensor out, lse, dout;
  Grads g;
  GuardedTensor dalibi, dsinks;
};

void check_backward(const AgCase& c, DType dt) {
  const int64_t N = c.W * c.n_local;
  Tensors inputs = random_qkv(dt, {c.B, c.Hq, N, c.Dk}, {c.B, c.Hkv, N, c.Dk}, {c.B, c.Hkv, N, c.Dv}, 43);
  const AgOptions co(c, 10);
  const Options& o = co.o;
  const Problem whole = make_problem(std::move(inputs), o, Layout::kContiguous, 7);
  const Tensors& t = whole.t;
  const std::vector<RankData> ranks = shards(t, c.W, c.layout, dt);
  const auto run = [&](RingStrategy strategy) {
    std::vector<RankGrads> rg;
    for (const RankData& d : ranks) {
      rg.push_back({cut(whole.out, 2, d.chunks), cut(whole.lse, 1, d.chunks), cut(whole.dout, 2, d.chunks),
                    Grads{GuardedTensor(dt, d.q.shape()), GuardedTensor(dt, d.k.shape()), GuardedTensor(dt, d.v.shape())},
                    GuardedTensor(kF64, co.slopes.shape()), GuardedTensor(kF32, {c.Hq})});
    }
    LocalWorld world(c.W);
    const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
      const RankData& d = ranks[static_cast<size_t>(r)];
      RankGrads& x = rg[static_cast<size_t>(r)];
      sdpa::Gradients g = x.g.gradients();
      if (o.alibi_slopes) g.dalibi_slopes = x.dalibi.view();
      if (o.sinks) g.dsinks = x.dsinks.view();
      sdpa::ring_attention_backward(comm, {d.q.view(), d.k.view(), d.v.view()}, x.out.view(), x.lse.view(),
                                    x.dout.view(), g, o, ring_of(c, strategy));
    });
    expect_clean_run(world, errors);
    return rg;
  };
  const std::vector<RankGrads> ag = run(kAG), rg = run(kRingS);
  const int64_t width[3] = {c.Dk, c.Dk, c.Dv};
  GradValues got, ring;
  for (GradValues* v : {&got, &ring}) {
    v->g[0].resize(static_cast<size_t>(t.q.numel())), v->g[1].resize(static_cast<size_t>(t.k.numel())),
        v->g[2].resize(static_cast<size_t>(t.v.numel()));
  }
  for (size_t r = 0; r < ag.size(); ++r) {
    EXPECT_TRUE(ag[r].g.guards_intact());
    const GradValues a = values(ag[r].g), b = values(rg[r].g);
    for (int x = 0; x < 3; ++x) {
      place(got.g[x], N, a.g[x], c.n_local, width[x], ranks[r].chunks);
      place(ring.g[x], N, b.g[x], c.n_local, width[x], ranks[r].chunks);
    }
  }
  // Against kReference as ring_test bounds kRing: dq sums P pair terms, dk and dv P terms, each
  // sum of P - 1 additions erring by at most u times the sum of the terms' sizes (sums[x]).
  Expected e;
  ASSERT_TRUE(expected(whole, o, e));
  const double u = eps(compute_dtype(dt)) / 2, P = static_cast<double>(c.layout == kZig ? 2 * c.W : c.W);
  const double scale = 1 / std::sqrt(static_cast<double>(c.Dk));
  const double dmax = max_abs_finite(whole.dout.values()), vmax = max_abs_finite(t.v.values()),
               omax = max_abs_finite(whole.out.values()), kmax = max_abs_finite(t.k.values()),
               qmax = max_abs_finite(t.q.values());
  const double rows = static_cast<double>(c.Hq / c.Hkv * N);
  const double term = scale * static_cast<double>(c.Dv) * dmax * (vmax + omax);
  const double sums[3] = {term * kmax, term * qmax * rows, rows * dmax};
  for (int x = 0; x < 3; ++x) EXPECT_TRUE(all_near(kGradNames[x], got.g[x], e.ref.g[x], e.tol[x] + (P - 1) * u * sums[x]));
  // Against kRing's (ring_test holds kRing to the same bound): each within its bound of
  // kReference's, so within twice of each other. (Not bit for bit: a call of one kv head's query
  // heads may take another kernel path than kRing's call of all heads, e.g. with softcap.)
  for (int x = 0; x < 3; ++x) {
    EXPECT_TRUE(all_near(kGradNames[x], got.g[x], ring.g[x], 2 * (e.tol[x] + (P - 1) * u * sums[x]))) << "against kRing";
  }
  // dalibi_slopes and dsinks, summed over the ranks: kRing's (ring_test holds them to the
  // reference) within the sums' reordering, 4 eps of the largest (float64 terms per rank).
  const auto summed = [&](const std::vector<RankGrads>& g, bool slopes) {
    std::vector<double> sum;
    for (const RankGrads& x : g) {
      const std::vector<double> a = slopes ? x.dalibi.values() : x.dsinks.values();
      sum.resize(a.size(), 0.0);
      for (size_t h = 0; h < a.size(); ++h) sum[h] += a[h];
    }
    return sum;
  };
  for (bool slopes : {true, false}) {
    if (slopes ? !o.alibi_slopes : !o.sinks) continue;
    const std::vector<double> a = summed(ag, slopes), b = summed(rg, slopes);
    EXPECT_TRUE(all_near(slopes ? "dalibi_slopes" : "dsinks", a, b, 4 * eps(kF32) * std::max(1.0, max_abs_finite(b))))
        << "against kRing";
  }
  const std::vector<RankGrads> again = run(kAG);
  for (size_t r = 0; r < ag.size(); ++r) {
    EXPECT_TRUE(bitwise_equal(again[r].g, ag[r].g)) << "rank " << r;
    if (o.alibi_slopes) {
      EXPECT_TRUE(all_close("dalibi (second run)", again[r].dalibi.values(), ag[r].dalibi.values(), 0));
    }
    if (o.sinks) {
      EXPECT_TRUE(all_close("dsinks (second run)", again[r].dsinks.values(), ag[r].dsinks.values(), 0));
    }
  }
}

TEST_F(Ring, AllGatherBackwardMatchesWholeAndRing) {
  for (const AgCase& c : kCases) {
    for (DType dt : {kF32, kF64, kBF16}) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      check_backward(c, dt);
    }
  }
}

// ---- Failures: every rank throws within the deadline, nothing is written ----

// Stops a rank's all-gathers after `after` of them (the collective check's is the first): the
// rank that hangs after agreeing to the call.
class StoppingComm : public sdpa::Communicator {
 public:
  StoppingComm(LocalWorld& world, int rank, int after) : world_(world), rank_(rank), after_(after) {}
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }
  Request isend(const void* d, size_t n, int to, int tag) override { return inner().isend(d, n, to, tag); }
  Request irecv(void* d, size_t n, int from, int tag) override { return inner().irecv(d, n, from, tag); }
  Request iallgather(const void* in, void* out, size_t n) override {
    if (after_ >= 0 && gathers_++ == after_) world_.stop_allgathers(rank_);
    return inner().iallgather(in, out, n);
  }
  bool wait(Request q, double s) override { return inner().wait(q, s); }

 private:
  sdpa::Communicator& inner() { return world_.comm(rank_); }
  LocalWorld& world_;
  int rank_, after_, gathers_ = 0;
};

struct FailureRun {
  std::vector<RankData> ranks;
  std::vector<Grads> grads;
  std::vector<std::string> errors;
  std::vector<double> seconds;
};

// W ranks of a small float32 GQA problem (B 2, Hq 4, Hkv 2: 4 heads to gather), kAllGather,
// deadline 0.5 s, rank 1's all-gathers stopped after `stop_gathers_after` (>= 0) of the call's
// (the collective check's is its first); `edit` changes rank r's call. backward: the forward
// first (every rank, succeeding), then ring_attention_backward (dout = out) under the stops.
FailureRun run_failing(int W, bool backward, const std::function<void(LocalWorld&)>& setup, int stop_gathers_after,
                       const std::function<void(int, Options&, sdpa::RingOptions&)>& edit) {
  const int64_t n_local = 6, N = W * n_local;
  const Tensors t = random_qkv(kF32, {2, 4, N, 4}, {2, 2, N, 4}, {2, 2, N, 4}, 3);
  FailureRun f{shards(t, W, kCont, kF32), {}, {}, std::vector<double>(static_cast<size_t>(W), 0.0)};
  for (const RankData& d : f.ranks) {
    f.grads.push_back(Grads{GuardedTensor(kF32, d.q.shape()), GuardedTensor(kF32, d.k.shape()), GuardedTensor(kF32, d.v.shape())});
  }
  LocalWorld world(W);
  setup(world);
  const auto errors = world.run([&](int r, sdpa::Communicator& local) {
    StoppingComm comm(world, r, r == 1 ? stop_gathers_after : -1);
    RankData& d = f.ranks[static_cast<size_t>(r)];
    Options o;
    o.causal = Causal::kTopLeft;
    sdpa::RingOptions ring{kCont, 0.5};
    ring.strategy = kAG;
    edit(r, o, ring);
    const sdpa::Inputs in{d.q.view(), d.k.view(), d.v.view()};
    if (backward) sdpa::ring_attention(local, in, {d.out.view(), std::nullopt, d.lse.view()}, o, ring);
    const auto start = std::chrono::steady_clock::now();
    try {
      if (backward) {
        sdpa::ring_attention_backward(comm, in, d.out.view(), d.lse.view(), d.out.view(),
                                      f.grads[static_cast<size_t>(r)].gradients(), o, ring);
      } else {
        sdpa::ring_attention(comm, in, {d.out.view(), std::nullopt, d.lse.view()}, o, ring);
      }
    } catch (...) {
      f.seconds[static_cast<size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      throw;
    }
  });
  f.errors = messages(errors);
  expect_requests_settled(world);  // nothing left open, no buffer freed under an unfinished request
  return f;
}

void expect_nothing_written(const FailureRun& f, bool backward) {
  for (size_t r = 0; r < f.ranks.size(); ++r) {
    if (backward) {
      EXPECT_TRUE(f.grads[r].untouched()) << "rank " << r;
    } else {
      EXPECT_TRUE(f.ranks[r].out.untouched()) << "rank " << r;
      EXPECT_TRUE(f.ranks[r].lse.untouched()) << "rank " << r;
    }
  }
}

TEST_F(Ring, AllGatherMismatchIsTheSameErrorOnEveryRank) {
  const FailureRun a = run_failing(3, false, [](LocalWorld&) {}, -1, [](int r, Options&, sdpa::RingOptions& ring) {
    if (r == 2) ring.strategy = kRingS;
  });
  for (const std::string& e : a.errors) {
    EXPECT_NE(e.find("rank 2's arguments differ from rank 0's"), std::string::npos) << e;
    EXPECT_NE(e.find("RingOptions::strategy: kAllGather on rank 0, kRing on rank 2"), std::string::npos) << e;
    EXPECT_EQ(e, a.errors[0]);
  }
  expect_nothing_written(a, false);
  const FailureRun b = run_failing(2, false, [](LocalWorld&) {}, -1, [](int r, Options& o, sdpa::RingOptions&) {
    if (r == 1) o.scale = 0.25;
  });
  for (const std::string& e : b.errors) EXPECT_NE(e.find("scale: default on rank 0, 0.25 on rank 1"), std::string::npos) << e;
  expect_nothing_written(b, false);
}

TEST_F(Ring, AllGatherStoppedRankTimesOut) {
  const int W = 4;
  const auto check = [&](const FailureRun& f, bool backward, double deadlines, const std::string& what) {
    for (int r = 0; r < W; ++r) {
      const std::string& e = f.errors[static_cast<size_t>(r)];
      EXPECT_NE(e.find("no message (a peer died, stopped or is slower than timeout_seconds)"), std::string::npos)
          << "rank " << r << ": " << e;
      EXPECT_LT(f.seconds[static_cast<size_t>(r)], deadlines * 0.5 + 0.4) << "rank " << r;
    }
    EXPECT_NE(f.errors[0].find(what), std::string::npos) << f.errors[0];
    expect_nothing_written(f, backward);
  };
  // Rank 1 stops after the collective check: every rank waits one deadline for the first head's
  // K/V (rank 1 too: the all-gather needs its own part).
  check(run_failing(W, false, [](LocalWorld&) {}, 1, [](int, Options&, sdpa::RingOptions&) {}), false, 1,
        "ring_attention: rank 0 waited 0.5 s for the all-gather of the K/V of batch entry 0, kv head 0 (head 1 of 4)");
  // ... or after the first head's (the forward has computed a head).
  check(run_failing(W, false, [](LocalWorld&) {}, 2, [](int, Options&, sdpa::RingOptions&) {}), false, 1,
        "(head 2 of 4)");
  // The backward: rank 1 never sends a dk, dv segment; rank 2 gives up on it, the others in turn
  // (a reduce step's deadline each, or the next head's all-gather's).
  const FailureRun g = run_failing(W, true, [](LocalWorld& w) { w.stop_sends(1, 0); }, -1,
                                   [](int, Options&, sdpa::RingOptions&) {});
  check(g, true, W, "ring_attention_backward: rank 0 waited 0.5 s");
  EXPECT_NE(g.errors[2].find("ring_attention_backward: rank 2 waited 0.5 s for the dk, dv sums of rank 0's rows of batch "
                             "entry 0, kv head 0 at reduce step 1 from rank 1"),
            std::string::npos)
      << g.errors[2];
  // The backward: rank 1's all-gathers stop after the check.
  check(run_failing(W, true, [](LocalWorld&) {}, 1, [](int, Options&, sdpa::RingOptions&) {}), true, 1,
        "ring_attention_backward: rank 0 waited 0.5 s for the all-gather of the K/V of batch entry 0, kv head 0");
}

TEST_F(Ring, AllGatherRefusals) {
  const GuardedTensor bm(DType::kBool, {1, 1});
  {
    const FailureRun d = run_failing(2, false, [](LocalWorld&) {}, -1, [](int, Options& o, sdpa::RingOptions&) {
      o.dropout_p = 0.5, o.seed = 3;
    });
    for (const std::string& e : d.errors) {
      EXPECT_NE(e.find("dropout_p=0.5 is not supported with RingStrategy::kAllGather"), std::string::npos) << e;
    }
    expect_nothing_written(d, false);
    const FailureRun m = run_failing(2, false, [](LocalWorld&) {}, -1, [&](int, Options& o, sdpa::RingOptions&) {
      o.block_mask = bm.view(), o.block_q = 64, o.block_k = 64;
    });
    for (const std::string& e : m.errors) {
      EXPECT_NE(e.find("Options::block_mask is not supported with RingStrategy::kAllGather"), std::string::npos) << e;
    }
    expect_nothing_written(m, false);
  }
}

// RingStats: the forward's bytes are its heads' all-gathers ((W - 1) shards of [k | v] each, what
// a ring all-gather sends); the backward's those and W - 1 segments per head.
TEST_F(Ring, AllGatherStats) {
  const int W = 3;
  const int64_t n_local = 6, N = W * n_local, B = 2, Hkv = 1;
  const Tensors t = random_qkv(kF32, {B, 4, N, 4}, {B, Hkv, N, 4}, {B, Hkv, N, 4}, 3);
  std::vector<RankData> ranks = shards(t, W, kCont, kF32);
  LocalWorld world(W);
  std::vector<sdpa::RingStats> fwd(W), bwd(W);
  const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
    RankData& d = ranks[static_cast<size_t>(r)];
    const sdpa::Inputs in{d.q.view(), d.k.view(), d.v.view()};
    sdpa::RingOptions ring{kCont, 5.0, &fwd[static_cast<size_t>(r)]};
    ring.strategy = kAG;
    sdpa::ring_attention(comm, in, {d.out.view(), std::nullopt, d.lse.view()}, {}, ring);
    GuardedTensor dq(kF32, d.q.shape()), dk(kF32, d.k.shape()), dv(kF32, d.v.shape());
    ring.stats = &bwd[static_cast<size_t>(r)];
    sdpa::ring_attention_backward(comm, in, d.out.view(), d.lse.view(), d.out.view(), {dq.view(), dk.view(), dv.view()},
                                  {}, ring);
  });
  expect_clean_run(world, errors);
  const int64_t shard = 2 * n_local * 4 * 4;  // one head's k and v, float32
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(fwd[static_cast<size_t>(r)].bytes_sent, B * Hkv * (W - 1) * shard);
    EXPECT_GT(bwd[static_cast<size_t>(r)].bytes_sent, B * Hkv * (W - 1) * 2 * shard);  // + the failure records
    EXPECT_GT(fwd[static_cast<size_t>(r)].compute_seconds, 0.0);
  }
}

}  // namespace
