// Pieces shared by the ring tests (ring_test.cc, ring_docs_test.cc): the one-thread-per-rank
// fixture, cutting a whole problem into the ranks' shards and placing their results back, the
// forward on every rank of an in-process world, the merges' error bound, the ranks' messages.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "ring_local.h"
#include "sdpa/ring.h"
#include "test_util.h"

namespace sdpa_test {

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

// Runs the ring forward on every rank (ring: its options, timeout 30 s in the tests); fails the
// test on any rank's exception.
inline void run_forward(std::vector<RankData>& ranks, const Options& o, const sdpa::RingOptions& ring,
                        Delivery delivery = Delivery::kAtWait) {
  LocalWorld world(static_cast<int>(ranks.size()), delivery);
  const auto errors = world.run([&](int r, sdpa::Communicator& comm) {
    RankData& d = ranks[static_cast<size_t>(r)];
    sdpa::Outputs out;
    out.out = d.out.view();
    out.lse = d.lse.view();
    sdpa::ring_attention(comm, {d.q.view(), d.k.view(), d.v.view()}, out, o, ring);
  });
  expect_clean_run(world, errors);
}

// The documented order, emulated on rank r's shards with the public calls: an accumulator of
// out 0, lse -inf in the compute type; for each step s the block of rank (r - s) mod W, for each
// query chunk, each key chunk of that block, attention() at the chunks' positions (sinks only

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
