// RingStrategy::kAllGather (sdpa/ring.h) on the in-process communicator of ring_local.h: its
// cases (world sizes 1-4, both layouts, GQA and MQA) through ring_test.cc's checks (kReference on
// the whole sequence under the tolerance rule plus the merges' and sums' bounds; out and lse bit
// for bit the documented order, which is kRing's; the gradients within twice the bound of
// kRing's; repeatable bit for bit); what only kAllGather has: rank 3 and rank 2 tensors (its
// per-head slicing) bit for bit the rank 4 call, forward and backward; a mismatch, a stopped rank,
// a transport Error and the refusals as Errors within the deadline, nothing written, no request
// left open and no buffer freed under one; its stats. Packed documents: ring_docs_test runs both
// strategies.
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

// kAllGather's cases (GQA and MQA, the strategy's use; no dropout or block mask: it refuses
// them), each checked by ring_test.cc's check_forward and check_backward as kRing's cases are.
const RingCase kCases[] = {
    {"w1_mqa", 1, kZig, 1, 4, 1, 10, 8, 8},
    {"w2_zigzag_causal_gqa", 2, kZig, 1, 8, 2, 12, 16, 8, Causal::kBottomRight},
    {"w2_contiguous_mqa_batch_slopes", 2, kCont, 2, 4, 1, 9, 8, 12, Causal::kNone, {}, true, false, false, 0, 0, 0,
     false, true},
    {"w3_zigzag_window_alibi_sinks", 3, kZig, 1, 4, 2, 14, 8, 8, Causal::kNone, {9, 4}, true, true},
    {"w3_contiguous_causal_softcap_batch", 3, kCont, 2, 4, 2, 11, 8, 6, Causal::kTopLeft, {}, false, false, true},
    {"w4_zigzag_causal_mqa_sinks", 4, kZig, 1, 2, 1, 16, 8, 8, Causal::kTopLeft, {}, true, true, false, 0, 0, 0, false,
     true},
    {"w4_contiguous_97_window", 4, kCont, 1, 2, 2, 97, 16, 16, Causal::kBottomRight, {40, -1}, true, true},
};

TEST_F(Ring, AllGatherForwardMatchesWholeAndRing) {
  for (const RingCase& c : kCases) {
    for (DType dt : {kF32, kF64, kBF16}) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      check_forward(c, dt, kAG);
    }
  }
}

TEST_F(Ring, AllGatherBackwardMatchesWholeAndRing) {
  for (const RingCase& c : kCases) {
    for (DType dt : {kF32, kF64, kBF16}) {
      SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt));
      check_backward(c, dt, kAG);
    }
  }
}

// Rank 3 (H, N, D) and rank 2 (N, D) tensors: kAllGather slices its heads by the tensors' rank
// (ring.cc's heads_of, KvGather): the bits of the same problem as rank 4 (1, H, N, D), forward
// (out, lse) and backward (dq, dk, dv, dalibi_slopes, dsinks), which the cases above check.
// Rank 3 with GQA (2 kv heads of 2 query heads), ALiBi and sinks; rank 2 a single head.
TEST_F(Ring, AllGatherRank3And2TensorsAreTheRank4Call) {
  for (const int drop : {1, 2}) {
    SCOPED_TRACE(drop == 1 ? "rank 3" : "rank 2");
    const RingCase c = drop == 1 ? RingCase{"rank3", 3, kZig, 1, 4, 2, 6, 8, 6, Causal::kTopLeft, {}, true, true}
                                 : RingCase{"rank2", 3, kCont, 1, 1, 1, 5, 8, 6, Causal::kBottomRight, {4, 1}};
    const int64_t N = c.W * c.n_local;
    Tensors inputs = random_qkv(kF32, {1, c.Hq, N, c.Dk}, {1, c.Hkv, N, c.Dk}, {1, c.Hkv, N, c.Dv}, 47);
    const CaseOptions co(c, 11);
    const Options& o = co.o;
    const Problem whole = make_problem(std::move(inputs), o, Layout::kContiguous, 7);
    std::vector<RankData> four = shards(whole.t, c.W, c.layout, kF32), low = shards(whole.t, c.W, c.layout, kF32);
    run_forward(four, o, ring_options(c.layout, kAG));
    run_forward(low, o, ring_options(c.layout, kAG), Delivery::kAtWait, drop);
    for (size_t r = 0; r < four.size(); ++r) {
      EXPECT_TRUE(low[r].out.guards_intact() && low[r].lse.guards_intact());
      EXPECT_TRUE(all_close("out", low[r].out.values(), four[r].out.values(), 0)) << "rank " << r;
      EXPECT_TRUE(all_close("lse", low[r].lse.values(), four[r].lse.values(), 0)) << "rank " << r;
    }
    const auto backward = [&](int d) {
      return run_backward(four, whole.out, whole.lse, whole.dout, o, ring_options(c.layout, kAG), co.slopes.shape(), kF32,
                          Delivery::kAtWait, d);
    };
    const std::vector<RankGrads> g4 = backward(0), gl = backward(drop);
    for (size_t r = 0; r < g4.size(); ++r) {
      EXPECT_TRUE(gl[r].g.guards_intact()) << "rank " << r;
      EXPECT_TRUE(bitwise_equal(gl[r].g, g4[r].g)) << "rank " << r;
      EXPECT_FALSE(gl[r].g.dk.untouched()) << "rank " << r;
      if (o.alibi_slopes) {
        EXPECT_TRUE(all_close("dalibi_slopes", gl[r].dalibi.values(), g4[r].dalibi.values(), 0));
      }
      if (o.sinks) {
        EXPECT_TRUE(all_close("dsinks", gl[r].dsinks.values(), g4[r].dsinks.values(), 0));
      }
    }
  }
}

// No heads (attention() takes Hq = Hkv = 0): both strategies run and return (kAllGather has no
// head to gather; its query heads per kv head are then 0, not a division by zero).
TEST_F(Ring, NoHeads) {
  const int W = 2;
  const int64_t n_local = 4, N = W * n_local;
  Options o;
  o.causal = Causal::kTopLeft;
  const Problem whole = make_problem(random_qkv(kF32, {1, 0, N, 8}, {1, 0, N, 8}, {1, 0, N, 8}, 5), o,
                                     Layout::kContiguous, 7);
  for (RingStrategy strategy : {kRingS, kAG}) {
    SCOPED_TRACE(strategy == kAG ? "kAllGather" : "kRing");
    std::vector<RankData> ranks = shards(whole.t, W, kZig, kF32);
    run_forward(ranks, o, ring_options(kZig, strategy));
    run_backward(ranks, whole.out, whole.lse, whole.dout, o, ring_options(kZig, strategy), {0}, kF32);
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
// deadline 0.5 s, rank `stopper`'s all-gathers stopped after `stop_gathers_after` (>= 0) of the
// call's (the collective check's is its first); `edit` changes rank r's call; rank `faulty`
// (>= 0) calls through a FaultyTransport with `faults`. backward: the forward first (every rank, succeeding), then
// ring_attention_backward (dout = out) under the stops.
FailureRun run_failing(int W, bool backward, const std::function<void(LocalWorld&)>& setup, int stop_gathers_after,
                       const std::function<void(int, Options&, sdpa::RingOptions&)>& edit, int stopper = 1,
                       int faulty = -1, FaultyTransport::Faults faults = {}) {
  const int64_t n_local = 6, N = W * n_local;
  const Tensors t = random_qkv(kF32, {2, 4, N, 4}, {2, 2, N, 4}, {2, 2, N, 4}, 3);
  FailureRun f{shards(t, W, kCont, kF32), {}, {}, std::vector<double>(static_cast<size_t>(W), 0.0)};
  for (const RankData& d : f.ranks) {
    f.grads.push_back(Grads{GuardedTensor(kF32, d.q.shape()), GuardedTensor(kF32, d.k.shape()), GuardedTensor(kF32, d.v.shape())});
  }
  LocalWorld world(W);
  setup(world);
  const auto errors = world.run([&](int r, sdpa::Communicator& local) {
    StoppingComm stopping(world, r, r == stopper ? stop_gathers_after : -1);
    FaultyTransport failing(stopping, faults);
    sdpa::Communicator& comm = r == faulty ? static_cast<sdpa::Communicator&>(failing) : stopping;
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

// A transport that fails on rank 1 (ring_util.h's FaultyTransport): its wait of the K/V
// all-gather of the first head (the call's second all-gather: the first is the collective
// check's) throws an sdpa::Error, the request ended unfinished first (as a transport's failed
// one); or, in the backward, its wait of the
// first dk, dv segment it receives, with that step's send and the next head's all-gather
// outstanding. The call throws that Error and unwinds through its Transfers: the outstanding
// requests waited briefly, the buffers of those that did not finish leaked (ring.h), so no
// request is left open and no buffer freed under one; the other ranks give up within their
// deadlines; nobody writes. The forward's all-gather is kept unfinished by rank 0, whose
// all-gathers stop after the check.
TEST_F(Ring, AllGatherTransportErrorUnwinds) {
  const int W = 3;
  for (const bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    // (run_failing checks every rank's requests settled)
    const FailureRun f = run_failing(W, backward, [](LocalWorld&) {}, backward ? -1 : 1,
                                     [](int, Options&, sdpa::RingOptions&) {}, 0, 1,
                                     backward ? FaultyTransport::Faults{-1, 0, -1} : FaultyTransport::Faults{-1, -1, 1});
    EXPECT_EQ(f.errors[1], "FaultyTransport: wait failed");
    for (int r : {0, 2}) {
      const std::string& e = f.errors[static_cast<size_t>(r)];
      EXPECT_NE(e.find("no message (a peer died, stopped or is slower than timeout_seconds)"), std::string::npos)
          << "rank " << r << ": " << e;
      EXPECT_LT(f.seconds[static_cast<size_t>(r)], W * 0.5 + 0.4) << "rank " << r;
    }
    expect_nothing_written(f, backward);
  }
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
