// Pieces shared by the ring tests (ring_test.cc, ring_allgather_test.cc, ring_docs_test.cc): the
// one-thread-per-rank fixture, the cases and their options, cutting a whole problem into the
// ranks' shards and placing their results back, the forward and the backward on every rank of an
// in-process world, the merges' and the backward's sums' error bounds, the ranks' messages, and
// the checks of a case against the whole call that ring_test.cc defines for either strategy.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "ring_local.h"
#include "sdpa/ring.h"
#include "test_util.h"

namespace sdpa_test {

using sdpa::Causal;
using sdpa::Options;
using sdpa::RingChunk;
using sdpa::RingLayout;
using sdpa::RingStrategy;

constexpr double kE = 2.718281828459045;

// One thread per rank on a shared machine: the kernels run single-threaded (set_num_threads is
// process-wide) so that W ranks do not oversubscribe the cores.
class Ring : public testing::Test {
 protected:
  void SetUp() override { sdpa::set_num_threads(1); }
  void TearDown() override { sdpa::set_num_threads(0); }
};

// A whole problem of N = W · n_local tokens, (B, Hq, N, Dk) queries, cut over W ranks.
struct RingCase {
  const char* name;
  int W;
  RingLayout layout;
  int64_t B, Hq, Hkv, n_local, Dk, Dv;
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  bool alibi = false, sinks = false, softcap = false;
  double dropout = 0;
  int64_t bq = 0, bk = 0;     // block mask when > 0
  bool fast = false;          // Precision::kFast
  bool batch_slopes = false;  // ALiBi slopes (B, Hq), else (Hq)
};

// The case's options and the tensors they point to (whole-sequence block mask, slopes, sinks).
struct CaseOptions {
  GuardedTensor bm, slopes, sinks;
  Options o;
  CaseOptions(const RingCase& c, uint32_t seed)
      : bm(DType::kBool, {c.B, c.Hq, c.bq ? (c.W * c.n_local + c.bq - 1) / c.bq : 1,
                          c.bk ? (c.W * c.n_local + c.bk - 1) / c.bk : 1}),
        slopes(kF64, c.batch_slopes ? std::vector<int64_t>{c.B, c.Hq} : std::vector<int64_t>{c.Hq}),
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
  CaseOptions(const CaseOptions&) = delete;  // o points into this object's tensors
  CaseOptions& operator=(const CaseOptions&) = delete;
};

inline sdpa::RingOptions ring_options(RingLayout layout, RingStrategy strategy, double timeout = 30.0) {
  sdpa::RingOptions ring{layout, timeout};
  ring.strategy = strategy;
  return ring;
}

// The case against the whole call (ring_test.cc): forward (out, lse: kReference under the
// tolerance rule plus the merges' bound; every rank bit for bit the documented order of pairs and
// merges; repeatable bit for bit, with either delivery) and backward (dq, dk, dv: kReference
// under the backward's rule plus the sums' bound; dalibi_slopes and dsinks in float32 against
// kReference; kAllGather also against kRing; repeatable bit for bit), with the strategy given.
void check_forward(const RingCase& c, DType dt, RingStrategy strategy);
void check_backward(const RingCase& c, DType dt, RingStrategy strategy);

// The rows of dim `from_end` (2: the sequence's dim of (..., N, D); 1: of lse's (..., N)) of t
// that `chunks` name, concatenated in order, as a new C-order tensor of t's dtype.
inline GuardedTensor cut(const GuardedTensor& t, int from_end, const std::vector<RingChunk>& chunks) {
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
inline void place(std::vector<double>& whole, int64_t N, const std::vector<double>& local, int64_t n_local, int64_t inner,
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

// Every rank's shards of a whole problem, and its outputs.
struct RankData {
  std::vector<RingChunk> chunks;
  GuardedTensor q, k, v, out, lse;
};

inline std::vector<RankData> shards(const Tensors& t, int W, RingLayout layout, DType out_dtype) {
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

// After any run, every rank's requests (ring.h, Communicator): none left open (each was waited,
// on completion or by the unwinding call's last waits), and no buffer freed that a request not
// waited to completion (abandoned by a timed-out wait, or failed) may still touch: the ring
// leaks those.
inline void expect_requests_settled(LocalWorld& world) {
  for (int r = 0; r < world.size(); ++r) {
    EXPECT_EQ(world.open_requests(r), 0) << "rank " << r << ": requests left open";
    EXPECT_EQ(world.freed_while_unfinished(r), 0) << "rank " << r << ": buffers freed under unfinished requests";
  }
}

// Every rank of a run that should succeed: no exception (each reported with its rank), and
// every request waited to completion (ring.h: a call waits for all of its requests before it
// returns).
inline void expect_clean_run(LocalWorld& world, const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r]) {
      try {
        std::rethrow_exception(errors[r]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    }
    EXPECT_EQ(world.abandoned_requests(static_cast<int>(r)), 0) << "rank " << r;
  }
  expect_requests_settled(world);
}

// t without its first `drop` dims (each of size 1): a rank 4 tensor's rank 3 or rank 2 view.
inline sdpa::TensorView lower(sdpa::TensorView t, int drop) {
  sdpa::TensorView s = t;
  s.rank = t.rank - drop;
  for (int i = 0; i < 4; ++i) {
    s.shape[i] = i < s.rank ? t.shape[i + drop] : 0;
    s.strides[i] = i < s.rank ? t.strides[i + drop] : 0;
  }
  return s;
}

// Runs the ring forward on every rank (ring: its options, timeout 30 s in the tests); fails the
// test on any rank's exception. drop > 0: every tensor without its first `drop` dims (lower).
inline void run_forward(std::vector<RankData>& ranks, const Options& o, const sdpa::RingOptions& ring,
                        Delivery delivery = Delivery::kAtWait, int drop = 0) {
  LocalWorld world(static_cast<int>(ranks.size()), delivery);
  const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
    RankData& d = ranks[static_cast<size_t>(r)];
    sdpa::Outputs out;
    out.out = lower(d.out.view(), drop);
    out.lse = lower(d.lse.view(), drop);
    sdpa::ring_attention(comm, {lower(d.q.view(), drop), lower(d.k.view(), drop), lower(d.v.view(), drop)}, out, o,
                         ring);
  });
  expect_clean_run(world, errors);
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
inline MergeBound merge_bound(DType q, int64_t P, double M, double L) {
  const double u = eps(compute_dtype(q)) / 2, m = static_cast<double>(std::max<int64_t>(P - 1, 0));
  const double c_out = (2 + 2 / kE) * 2 + 4, c_lse = (1 + 1 / kE) * 2 + 1 + 2 * std::log(2.0) + L;
  return {m * u * M * (c_out + m * c_lse), m * u * c_lse};
}

// The backward's sums' own error: dq sums P pair terms (P key chunks), dk and dv P terms (one per
// query chunk of the sequence), one after the other in the compute type: P - 1 additions each
// erring by at most u times the sum of the terms' sizes, which the pairs' own terms bound: per
// element of dq, |scale| Σ_j p_ij (|z dP_ij| + |D_i|) |k_j| <= |scale| Dv max|dout| (max|v| z +
// max|out|) max|k| (Σ_j p_ij <= 1, z = 1 / (1 - p)); of dk the same with max|q| over the `rows`
// that read a key (group · N, each p <= 1); of dv Σ_i |z| p_ij |dout_i| <= rows max|dout| z.
// The maxima are those of the whole problem, or of the rows the bound covers.
struct GradMaxima {
  double dout, v, out, k, q;
};
inline std::array<double, 3> sums_bound(DType dt, int64_t P, int64_t Dk, int64_t Dv, double rows, double dropout_p,
                                        const GradMaxima& m) {
  const double u = eps(compute_dtype(dt)) / 2, z = 1 / (1 - dropout_p), scale = 1 / std::sqrt(static_cast<double>(Dk));
  const double term = scale * static_cast<double>(Dv) * m.dout * (m.v * z + m.out);
  const double adds = static_cast<double>(std::max<int64_t>(P - 1, 0)) * u;
  return {adds * term * m.k, adds * term * m.q * rows, adds * rows * m.dout * z};
}

// A rank's backward: its shards of the whole out, lse and dout, its gradients, and its parts of
// dalibi_slopes (the slopes' shape) and dsinks.
struct RankGrads {
  GuardedTensor out, lse, dout;
  Grads g;
  GuardedTensor dalibi, dsinks;
};

// Runs ring_attention_backward on every rank of an in-process world, given the whole problem's
// out, lse and dout ((..., H, N, D)): dalibi_slopes of `slopes_shape` and dsinks (Hq) of
// `sinks_dtype` where o has slopes and sinks; fails the test on any rank's exception. drop > 0:
// every tensor but dalibi_slopes and dsinks without its first `drop` dims (lower).
inline std::vector<RankGrads> run_backward(const std::vector<RankData>& ranks, const GuardedTensor& out,
                                           const GuardedTensor& lse, const GuardedTensor& dout, const Options& o,
                                           const sdpa::RingOptions& ring, const std::vector<int64_t>& slopes_shape,
                                           DType sinks_dtype, Delivery delivery = Delivery::kAtWait, int drop = 0) {
  const int64_t Hq = out.shape()[out.shape().size() - 3];
  std::vector<RankGrads> rg;
  for (const RankData& d : ranks) {
    rg.push_back({cut(out, 2, d.chunks), cut(lse, 1, d.chunks), cut(dout, 2, d.chunks),
                  Grads{GuardedTensor(d.q.dtype(), d.q.shape()), GuardedTensor(d.k.dtype(), d.k.shape()),
                        GuardedTensor(d.v.dtype(), d.v.shape())},
                  GuardedTensor(kF64, slopes_shape), GuardedTensor(sinks_dtype, {Hq})});
  }
  LocalWorld world(static_cast<int>(ranks.size()), delivery);
  const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
    const RankData& d = ranks[static_cast<size_t>(r)];
    RankGrads& x = rg[static_cast<size_t>(r)];
    const auto l = [drop](const GuardedTensor& t) { return lower(t.view(), drop); };
    sdpa::Gradients g{l(x.g.dq), l(x.g.dk), l(x.g.dv)};
    if (o.alibi_slopes) g.dalibi_slopes = x.dalibi.view();
    if (o.sinks) g.dsinks = x.dsinks.view();
    sdpa::ring_attention_backward(comm, {l(d.q), l(d.k), l(d.v)}, l(x.out), l(x.lse), l(x.dout), g, o, ring);
  });
  expect_clean_run(world, errors);
  return rg;
}

// A transport that fails: sdpa::Error "FaultyTransport: isend refused" from its isend number
// `send` (from 0), or "FaultyTransport: wait failed" from the wait of its irecv number `recv` or
// its iallgather number `gather`, that request ended first (by a wait of 0 s: unfinished unless
// its data had come), as a transport's failed one; -1: never.
class FaultyTransport : public sdpa::Communicator {
 public:
  struct Faults {
    int send = -1, recv = -1, gather = -1;
  };
  FaultyTransport(sdpa::Communicator& inner, Faults faults) : inner_(inner), faults_(faults) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Request isend(const void* data, size_t bytes, int to, int tag) override {
    if (sends_++ == faults_.send) throw sdpa::Error("FaultyTransport: isend refused");
    return inner_.isend(data, bytes, to, tag);
  }
  Request irecv(void* data, size_t bytes, int from, int tag) override {
    const Request id = inner_.irecv(data, bytes, from, tag);
    if (recvs_++ == faults_.recv) faulty_ = id;
    return id;
  }
  Request iallgather(const void* in, void* out, size_t bytes) override {
    const Request id = inner_.iallgather(in, out, bytes);
    if (gathers_++ == faults_.gather) faulty_ = id;
    return id;
  }
  bool wait(Request request, double seconds) override {
    if (request == faulty_) {
      inner_.wait(request, 0.0);
      throw sdpa::Error("FaultyTransport: wait failed");
    }
    return inner_.wait(request, seconds);
  }

 private:
  sdpa::Communicator& inner_;
  Faults faults_;
  int sends_ = 0, recvs_ = 0, gathers_ = 0;
  Request faulty_ = -1;
};

// Each rank's exception message ("" when it returned).
inline std::vector<std::string> messages(const std::vector<std::exception_ptr>& errors) {
  std::vector<std::string> m;
  for (const auto& e : errors) {
    std::string what;
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const sdpa::Error& x) {
        what = x.what();
      } catch (const std::exception& x) {
        what = std::string("not an sdpa::Error: ") + x.what();
      }
    }
    m.push_back(what);
  }
  return m;
}


}  // namespace sdpa_test
