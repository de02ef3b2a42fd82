// sdpa::mpi (sdpa/mpi.h) under mpirun: the Communicator's primitives, then ring attention over
// MPI. Every rank runs the same tests in the same order (the same arguments on every rank);
// each rank prints its own failures, rank 0 GoogleTest's report.
//
// The ring over MPI, forward and backward, must give on every rank the bits the same ring gives
// over the in-process communicator (tests/ring_local.h, W threads of this process): the transport
// only moves bytes. Those bits are checked against kReference on the whole sequence under the
// tolerance rule, and against the documented order of pairs and merges, by tests/ring_test.cc.
//
//   ring_mpi_test [gtest flags]       the tests (tests/mpi/CMakeLists.txt: W = 1, 2, 3, 4)
//   ring_mpi_test --stopped=dup       rank W - 1 stops (sleeps instead of calling): the others'
//                                     Communicator constructor (MPI_Comm_idup) must throw
//                                     within its timeout + slack
//   ring_mpi_test --stopped=ring      the same in the ring's first collective (a Communicator
//                                     made before the rank stops): sdpa::ring_attention throws
//                                     on the others within RingOptions::timeout_seconds + slack,
//                                     naming the all-gather, with nothing written
//   ring_mpi_test --stopped=step      (3+ ranks) rank W - 1 stops in the middle of the forward's
//                                     ring, at its send of step 1: rank 0 throws within the
//                                     timeout + slack, naming the block, the step and rank
//                                     W - 1; each other rank finishes or throws "no message"
//                                     within W timeouts + slack; whoever throws writes nothing
//   ring_mpi_test --stopped=allgather rank W - 1 stops in RingStrategy::kAllGather's first K/V
//                                     all-gather (after the collective check): every other rank
//                                     throws within the timeout + slack, rank 0 naming the
//                                     all-gather of batch entry 0, kv head 0, and writes nothing
//   ring_mpi_test --stopped=backward  rank W - 1 stops in the backward at its last send (the
//                                     gradients' last hop, to rank 0): rank 0 throws within the
//                                     timeout + slack naming its own block's gradients and
//                                     writes nothing; each other rank finishes or throws "no
//                                     message" as above (rank W - 2's last send to the stopped
//                                     rank may never complete: MPI moves it only while both
//                                     ranks call MPI)
// In step, backward and allgather runs every rank's calls go through a Tracked communicator (below): a rank
// that threw has no request left open and freed no buffer that a request not waited to
// completion may still touch (ring.h; ring_local.h's watch of the frees).
// A stopped run leaves MPI undefined (sdpa/mpi.h), so it is a run of its own: the ranks that
// saw the Error agree on a verdict over a communicator of their own, and rank 0 ends the job
// with MPI_Abort(verdict) (errorcode 0 is mpirun's exit status 0), as a program should.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ring_local.h"
#include "ring_util.h"
#include "sdpa/mpi.h"
#include "sdpa/ring.h"
#include "test_util.h"

namespace {

using Clock = std::chrono::steady_clock;
using sdpa::Error;
using sdpa::RingLayout;
using sdpa::RingStrategy;
using sdpa_test::DType;
using sdpa_test::GuardedTensor;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int w = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Byte i of a message from rank `from` with salt `salt`: differs between senders, messages
// and neighbouring bytes, so a misplaced or truncated piece shows.
unsigned char pattern(int from, int salt, size_t i) {
  return static_cast<unsigned char>(
      (i * 131 + static_cast<size_t>(from) * 17 + static_cast<size_t>(salt) * 7 + i / 251) & 0xFF);
}
std::vector<unsigned char> message(int from, int salt, size_t bytes) {
  std::vector<unsigned char> m(bytes);
  for (size_t i = 0; i < bytes; ++i) m[i] = pattern(from, salt, i);
  return m;
}
// The first byte that differs, or -1.
int64_t first_difference(const std::vector<unsigned char>& got, int from, int salt) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != pattern(from, salt, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

constexpr double kWait = 30.0;  // completing waits: a generous deadline, never reached

// Every rank sends a message of each size to r + 1 and to r - 1 and receives from both (one
// tag per direction and size), all in flight at once, with a Communicator whose messages over
// max_message_bytes go as derived datatypes.
void exchange_both_ways(size_t max_message_bytes, const std::vector<size_t>& sizes) {
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD, kWait, max_message_bytes);
  const int r = comm.rank(), w = comm.size(), next = (r + 1) % w, prev = (r + w - 1) % w;
  std::vector<std::vector<unsigned char>> sends, from_prev, from_next;
  std::vector<sdpa::Communicator::Request> requests;
  for (size_t s = 0; s < sizes.size(); ++s) {
    const int salt = static_cast<int>(s);
    sends.push_back(message(r, salt, sizes[s]));
    from_prev.emplace_back(sizes[s], 0);
    from_next.emplace_back(sizes[s], 0);
  }
  for (size_t s = 0; s < sizes.size(); ++s) {
    const int tag = static_cast<int>(2 * s);
    requests.push_back(comm.irecv(from_prev[s].data(), sizes[s], prev, tag));      // forward ring
    requests.push_back(comm.irecv(from_next[s].data(), sizes[s], next, tag + 1));  // backward ring
  }
  for (size_t s = 0; s < sizes.size(); ++s) {
    const int tag = static_cast<int>(2 * s);
    requests.push_back(comm.isend(sends[s].data(), sizes[s], next, tag));
    requests.push_back(comm.isend(sends[s].data(), sizes[s], prev, tag + 1));
  }
  for (auto request : requests) ASSERT_TRUE(comm.wait(request, kWait));
  for (size_t s = 0; s < sizes.size(); ++s) {
    EXPECT_EQ(first_difference(from_prev[s], prev, static_cast<int>(s)), -1) << sizes[s] << " bytes from rank " << prev;
    EXPECT_EQ(first_difference(from_next[s], next, static_cast<int>(s)), -1) << sizes[s] << " bytes from rank " << next;
  }
}

void allgather(size_t max_message_bytes, const std::vector<size_t>& sizes) {
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD, kWait, max_message_bytes);
  const int w = comm.size();
  for (size_t s = 0; s < sizes.size(); ++s) {
    const int salt = static_cast<int>(s);
    const std::vector<unsigned char> in = message(comm.rank(), salt, sizes[s]);
    std::vector<unsigned char> out(sizes[s] * static_cast<size_t>(w), 0);
    ASSERT_TRUE(comm.wait(comm.iallgather(in.data(), out.data(), sizes[s]), kWait));
    for (int from = 0; from < w; ++from) {
      const std::vector<unsigned char> part(out.begin() + static_cast<int64_t>(sizes[s]) * from,
                                            out.begin() + static_cast<int64_t>(sizes[s]) * (from + 1));
      EXPECT_EQ(first_difference(part, from, salt), -1) << sizes[s] << " bytes of rank " << from;
    }
  }
}

TEST(MpiCommunicator, RankAndSizeAreTheCommunicators) {
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD);
  EXPECT_EQ(comm.rank(), world_rank());
  EXPECT_EQ(comm.size(), world_size());
  int compare = 0;
  MPI_Comm_compare(comm.comm(), MPI_COMM_WORLD, &compare);
  EXPECT_EQ(compare, MPI_CONGRUENT);  // a duplicate: same group, its own context
}

TEST(MpiCommunicator, SendsAndReceivesBothWaysAroundTheRing) {
  exchange_both_ways(size_t{1} << 30, {0, 1, 1000, (size_t{8} << 20) + 3});
}

// Messages over max_message_bytes: one element of a derived datatype (blocks and the rest);
// here with a small limit, so that blocks, rest and none show on small buffers (the default
// limit's case, > 2 GiB, is SDPA_MPI_TEST_HUGE=1 below).
TEST(MpiCommunicator, SendsMessagesLargerThanTheLimitAsOneDerivedType) {
  exchange_both_ways(1000, {0, 999, 1000, 1001, 3000, 2 * 1000 + 17, 100'000});
}

TEST(MpiCommunicator, AllGathers) { allgather(size_t{1} << 30, {0, 1, 4097, (size_t{1} << 20) + 5}); }

TEST(MpiCommunicator, AllGathersMessagesLargerThanTheLimit) { allgather(1000, {1000, 1001, 2 * 1000 + 17}); }

// The real thing: a message over INT_MAX bytes (2^31 + 17) each way between ranks 0 and 1,
// 8.6 GB of memory over the two ranks: only when SDPA_MPI_TEST_HUGE=1 (not in CI).
TEST(MpiCommunicator, SendsMoreThanTwoGigabytes) {
  const char* huge = std::getenv("SDPA_MPI_TEST_HUGE");
  if (world_size() < 2 || !huge || std::string(huge) != "1") GTEST_SKIP() << "SDPA_MPI_TEST_HUGE=1 with 2+ ranks";
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD);
  const size_t bytes = (size_t{1} << 31) + 17;
  if (comm.rank() > 1) return;
  const int peer = 1 - comm.rank();
  std::vector<unsigned char> send(bytes), recv(bytes, 0);
  for (size_t i = 0; i < bytes; ++i) send[i] = pattern(comm.rank(), 0, i);
  auto r = comm.irecv(recv.data(), bytes, peer, 0);
  auto s = comm.isend(send.data(), bytes, peer, 0);
  ASSERT_TRUE(comm.wait(s, 600));
  ASSERT_TRUE(comm.wait(r, 600));
  EXPECT_EQ(first_difference(recv, peer, 0), -1);
}

// The ring's messages never match the caller's: a message on MPI_COMM_WORLD with the same
// source and tag, sent first, is not the one the Communicator receives.
TEST(MpiCommunicator, ItsMessagesAreApartFromTheCallers) {
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD);
  const int r = comm.rank(), w = comm.size(), next = (r + 1) % w, prev = (r + w - 1) % w;
  const std::vector<unsigned char> users = message(r, 1, 64), rings = message(r, 2, 64);
  std::vector<unsigned char> got(64), users_got(64);
  MPI_Request user_send, user_recv;
  MPI_Isend(users.data(), 64, MPI_BYTE, next, 5, MPI_COMM_WORLD, &user_send);
  auto ring_send = comm.isend(rings.data(), 64, next, 5);
  auto ring_recv = comm.irecv(got.data(), 64, prev, 5);
  ASSERT_TRUE(comm.wait(ring_recv, kWait));
  ASSERT_TRUE(comm.wait(ring_send, kWait));
  MPI_Irecv(users_got.data(), 64, MPI_BYTE, prev, 5, MPI_COMM_WORLD, &user_recv);
  MPI_Wait(&user_send, MPI_STATUS_IGNORE);
  MPI_Wait(&user_recv, MPI_STATUS_IGNORE);
  EXPECT_EQ(first_difference(got, prev, 2), -1);
  EXPECT_EQ(first_difference(users_got, prev, 1), -1);
}

// wait's deadline: a receive that no rank sends returns false after `seconds`, not before and
// not much after; the request is then cancelled (nothing is left to match later) and gone.
TEST(MpiCommunicator, WaitReturnsFalseAtTheDeadline) {
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD);
  const int w = comm.size(), prev = (comm.rank() + w - 1) % w;
  unsigned char buffer[8];
  const auto request = comm.irecv(buffer, sizeof buffer, prev, 77);
  const double deadline = 0.3;
  const auto t0 = Clock::now();
  EXPECT_FALSE(comm.wait(request, deadline));
  const double took = seconds_since(t0);
  EXPECT_GE(took, deadline);
  EXPECT_LT(took, deadline + 0.5);
  EXPECT_THROW(comm.wait(request, 1.0), Error);  // abandoned: no longer a request
  // A zero deadline tests once: a receive that has not arrived is false at once.
  const auto again = comm.irecv(buffer, sizeof buffer, prev, 78);
  EXPECT_FALSE(comm.wait(again, 0.0));
  // The communicator still works (the cancelled receives matched nothing).
  MPI_Barrier(MPI_COMM_WORLD);
  exchange_both_ways(size_t{1} << 30, {16});
}

// An MPI error (a message longer than the receive) is an sdpa::Error naming the operation,
// the peer and MPI's own words, not MPI's default abort.
TEST(MpiCommunicator, MpiErrorsAreErrorsNamingThePeer) {
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD);
  const int r = comm.rank(), w = comm.size(), next = (r + 1) % w, prev = (r + w - 1) % w;
  const std::vector<unsigned char> send = message(r, 0, 16);
  std::vector<unsigned char> recv(8);
  auto s = comm.isend(send.data(), 16, next, 3);
  auto q = comm.irecv(recv.data(), 8, prev, 3);
  try {
    comm.wait(q, kWait);
    ADD_FAILURE() << "no Error for a truncated message";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("MPI_Irecv from rank " + std::to_string(prev) + " (tag 3)"), std::string::npos) << what;
    EXPECT_NE(what.find("MPI_ERR_TRUNCATE"), std::string::npos) << what;
  }
  EXPECT_TRUE(comm.wait(s, kWait));
}

TEST(MpiCommunicator, RejectsBadArguments) {
  EXPECT_THROW(sdpa::mpi::Communicator(MPI_COMM_WORLD, 1.0, 0), Error);
  EXPECT_THROW(sdpa::mpi::Communicator(MPI_COMM_WORLD, 1.0, size_t{1} << 31), Error);
  EXPECT_THROW(sdpa::mpi::Communicator(MPI_COMM_WORLD, 0.0), Error);
  EXPECT_THROW(sdpa::mpi::Communicator(MPI_COMM_NULL), Error);
  sdpa::mpi::Communicator comm(MPI_COMM_WORLD);
  EXPECT_THROW(comm.wait(12345, 1.0), Error);  // never started
}

// ---- Ring attention over MPI ----------------------------------------------------------------

struct Shard {
  GuardedTensor q, k, v, out, lse;
  sdpa::Inputs inputs() const { return {q.view(), k.view(), v.view()}; }
  sdpa::Outputs outputs() const {
    sdpa::Outputs o;
    o.out = out.view();
    o.lse = lse.view();
    return o;
  }
};

struct RingCase {
  RingLayout layout;
  sdpa::Causal causal;
  DType dtype;
  int64_t n_local;
};

// Rank `rank`'s shard of one whole problem: (1, 4, N, 8) queries, (1, 2, N, 8) keys (GQA),
// (1, 2, N, 12) values, from a seed every rank shares.
Shard make_shard(const RingCase& c, int world, int rank, int64_t dk_change = 0) {
  const int64_t N = world * c.n_local;
  const sdpa_test::Tensors t = sdpa_test::random_qkv(c.dtype, {1, 4, N, 8}, {1, 2, N, 8}, {1, 2, N, 12}, 29);
  const auto chunks = sdpa::ring_chunks(c.layout, world, rank, c.n_local);
  Shard s{sdpa_test::cut(t.q, 2, chunks), sdpa_test::cut(t.k, 2, chunks), sdpa_test::cut(t.v, 2, chunks),
          GuardedTensor(c.dtype, {1, 4, c.n_local, 12}),
          GuardedTensor(sdpa_test::compute_dtype(c.dtype), {1, 4, c.n_local})};
  if (dk_change) {  // a wrong Dk on this rank: q and k (1, H, n, 8 + dk_change)
    s.q = GuardedTensor(c.dtype, {1, 4, c.n_local, 8 + dk_change});
    s.k = GuardedTensor(c.dtype, {1, 2, c.n_local, 8 + dk_change});
    std::mt19937 rng(3);
    sdpa_test::fill_normal(s.q, rng);
    sdpa_test::fill_normal(s.k, rng);
  }
  return s;
}

std::string case_name(const RingCase& c, RingStrategy strategy) {
  return std::string(strategy == RingStrategy::kRing ? "kRing " : "kAllGather ") +
         (c.layout == RingLayout::kZigzag ? "zigzag" : "contiguous") +
         (c.causal == sdpa::Causal::kNone ? "" : " causal") + " " + sdpa::dtype_name(c.dtype) + " n_local " +
         std::to_string(c.n_local);
}

// Both strategies run every case (kAllGather: the K/V of each kv head all-gathered, ring.h).
constexpr RingStrategy kStrategies[] = {RingStrategy::kRing, RingStrategy::kAllGather};
sdpa::RingOptions ring_options(const RingCase& c, RingStrategy strategy, double timeout = kWait) {
  sdpa::RingOptions ring{c.layout, timeout};
  ring.strategy = strategy;
  return ring;
}

const RingCase kRingCases[] = {
    {RingLayout::kZigzag, sdpa::Causal::kNone, DType::kFloat32, 10},
    {RingLayout::kZigzag, sdpa::Causal::kTopLeft, DType::kFloat32, 10},
    {RingLayout::kZigzag, sdpa::Causal::kBottomRight, DType::kBFloat16, 12},
    {RingLayout::kZigzag, sdpa::Causal::kNone, DType::kBFloat16, 2},
    {RingLayout::kContiguous, sdpa::Causal::kNone, DType::kFloat32, 9},
    {RingLayout::kContiguous, sdpa::Causal::kTopLeft, DType::kFloat32, 1},
    {RingLayout::kContiguous, sdpa::Causal::kTopLeft, DType::kBFloat16, 9},
    {RingLayout::kContiguous, sdpa::Causal::kNone, DType::kBFloat16, 13},
};

// Forward: over MPI (sdpa::mpi::ring_attention on MPI_COMM_WORLD, and sdpa::ring_attention on a
// Communicator kept for two calls) the bits of the in-process ring, on every rank, twice; for
// each strategy (kRing, kAllGather), against the in-process run of the same strategy.
TEST(MpiRing, ForwardGivesTheInProcessRingsBits) {
  sdpa::set_num_threads(1);
  const int W = world_size(), r = world_rank();
  sdpa::mpi::Communicator kept(MPI_COMM_WORLD);
  for (const RingStrategy strategy : kStrategies)
  for (const RingCase& c : kRingCases) {
    SCOPED_TRACE(case_name(c, strategy) + ", rank " + std::to_string(r) + " of " + std::to_string(W));
    sdpa::Options o;
    o.causal = c.causal;
    const sdpa::RingOptions ring = ring_options(c, strategy);
    Shard mpi = make_shard(c, W, r);
    sdpa::mpi::ring_attention(MPI_COMM_WORLD, mpi.inputs(), mpi.outputs(), o, ring);
    // The in-process ring: every rank's shard, W threads; this rank's outputs.
    std::vector<Shard> local;
    for (int i = 0; i < W; ++i) local.push_back(make_shard(c, W, i));
    sdpa_test::LocalWorld world(W);
    const auto errors = world.run([&](int i, sdpa::Communicator& comm) {
      sdpa::ring_attention(comm, local[static_cast<size_t>(i)].inputs(), local[static_cast<size_t>(i)].outputs(), o,
                           ring);
    });
    for (const auto& e : errors) ASSERT_FALSE(e) << "the in-process ring threw";
    const Shard& mine = local[static_cast<size_t>(r)];
    EXPECT_TRUE(mpi.out.guards_intact());
    EXPECT_TRUE(mpi.lse.guards_intact());
    EXPECT_TRUE(sdpa_test::all_close("out", mpi.out.values(), mine.out.values(), 0));
    EXPECT_TRUE(sdpa_test::all_close("lse", mpi.lse.values(), mine.lse.values(), 0));
    // Repeatable bit for bit, twice on one kept Communicator.
    for (int again = 0; again < 2; ++again) {
      Shard second = make_shard(c, W, r);
      sdpa::ring_attention(kept, second.inputs(), second.outputs(), o, ring);
      EXPECT_TRUE(sdpa_test::all_close("out (again)", second.out.values(), mpi.out.values(), 0));
      EXPECT_TRUE(sdpa_test::all_close("lse (again)", second.lse.values(), mpi.lse.values(), 0));
    }
  }
  sdpa::set_num_threads(0);
}

// Backward: sdpa::mpi::ring_attention_backward's dq, dk, dv are, on every rank, the bits of the
// in-process ring's backward on the same shards, out and lse (the forward's, the same bits on
// both transports) and dout; for each strategy, against the in-process run of the same strategy.
TEST(MpiRing, BackwardGivesTheInProcessRingsBits) {
  sdpa::set_num_threads(1);
  const int W = world_size(), r = world_rank();
  for (const RingStrategy strategy : kStrategies)
  for (const RingCase& c : kRingCases) {
    SCOPED_TRACE(case_name(c, strategy) + ", rank " + std::to_string(r) + " of " + std::to_string(W));
    sdpa::Options o;
    o.causal = c.causal;
    const sdpa::RingOptions ring = ring_options(c, strategy);
    const int64_t N = W * c.n_local;
    const sdpa_test::Tensors whole_dout = sdpa_test::random_qkv(c.dtype, {1, 4, N, 12}, {1, 1, 0, 1}, {1, 1, 0, 1}, 31);
    struct Grads {
      GuardedTensor dq, dk, dv;
      sdpa::Gradients views() const { return {dq.view(), dk.view(), dv.view()}; }
    };
    const auto grads = [&](const Shard& s) {
      return Grads{GuardedTensor(s.q.dtype(), s.q.shape()), GuardedTensor(s.k.dtype(), s.k.shape()),
                   GuardedTensor(s.v.dtype(), s.v.shape())};
    };
    std::vector<Shard> local;
    std::vector<GuardedTensor> douts;
    std::vector<Grads> local_grads;
    for (int i = 0; i < W; ++i) {
      local.push_back(make_shard(c, W, i));
      douts.push_back(sdpa_test::cut(whole_dout.q, 2, sdpa::ring_chunks(c.layout, W, i, c.n_local)));
      local_grads.push_back(grads(local.back()));
    }
    sdpa_test::LocalWorld world(W);
    const auto errors = world.run([&](int i, sdpa::Communicator& comm) {
      const Shard& s = local[static_cast<size_t>(i)];
      sdpa::ring_attention(comm, s.inputs(), s.outputs(), o, ring);
      sdpa::ring_attention_backward(comm, s.inputs(), s.out.view(), s.lse.view(), douts[static_cast<size_t>(i)].view(),
                                    local_grads[static_cast<size_t>(i)].views(), o, ring);
    });
    for (const auto& e : errors) ASSERT_FALSE(e) << "the in-process ring threw";
    Shard mpi = make_shard(c, W, r);
    Grads g = grads(mpi);
    sdpa::mpi::ring_attention(MPI_COMM_WORLD, mpi.inputs(), mpi.outputs(), o, ring);
    sdpa::mpi::ring_attention_backward(MPI_COMM_WORLD, mpi.inputs(), mpi.out.view(), mpi.lse.view(),
                                       douts[static_cast<size_t>(r)].view(), g.views(), o, ring);
    const Grads& mine = local_grads[static_cast<size_t>(r)];
    EXPECT_TRUE(g.dq.guards_intact() && g.dk.guards_intact() && g.dv.guards_intact());
    EXPECT_TRUE(sdpa_test::all_close("dq", g.dq.values(), mine.dq.values(), 0));
    EXPECT_TRUE(sdpa_test::all_close("dk", g.dk.values(), mine.dk.values(), 0));
    EXPECT_TRUE(sdpa_test::all_close("dv", g.dv.values(), mine.dv.values(), 0));
  }
  sdpa::set_num_threads(0);
}

// One rank's q and k have another Dk: every rank throws the same Error (the collective check,
// before any block moves), names that rank, and writes nothing; MPI stays usable.
TEST(MpiRing, AShapeMismatchOnOneRankIsTheSameErrorOnEveryRank) {
  const int W = world_size(), r = world_rank();
  if (W < 2) GTEST_SKIP() << "needs 2+ ranks";
  const RingCase c = {RingLayout::kZigzag, sdpa::Causal::kTopLeft, DType::kFloat32, 4};
  Shard s = make_shard(c, W, r, r == W - 1 ? 8 : 0);
  std::string what = "no Error";
  try {
    sdpa::mpi::ring_attention(MPI_COMM_WORLD, s.inputs(), s.outputs(), {}, {c.layout, kWait});
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("rank " + std::to_string(W - 1)), std::string::npos) << what;
  EXPECT_TRUE(s.out.untouched());
  EXPECT_TRUE(s.lse.untouched());
  // The same message on every rank: rank 0's, broadcast, against each rank's own.
  std::vector<char> first(1024, 0);
  std::strncpy(first.data(), what.c_str(), first.size() - 1);
  MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
  EXPECT_EQ(std::string(first.data()), what.substr(0, first.size() - 1));
}

// A Communicator over another that keeps account of its requests (ring.h's rule: each waited;
// the buffers of one not waited to completion never freed, watched as ring_local.h watches
// them), and that can stop its rank: at its send number stop_at, or its all-gather number
// stop_gather_at (from 0), it hangs (sleeps), as a process that stopped.
class Tracked : public sdpa::Communicator {
 public:
  Tracked(sdpa::Communicator& inner, int64_t stop_at, int64_t stop_gather_at = -1)
      : inner_(inner), stop_at_(stop_at), stop_gather_at_(stop_gather_at) {}
  ~Tracked() override { sdpa_test::forget_buffers(this); }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Request isend(const void* data, size_t bytes, int to, int tag) override {
    if (sends_++ == stop_at_) std::this_thread::sleep_for(std::chrono::seconds(60));  // MPI_Abort ends it
    return track(inner_.isend(data, bytes, to, tag), {{const_cast<void*>(data), bytes}});
  }
  Request irecv(void* data, size_t bytes, int from, int tag) override {
    return track(inner_.irecv(data, bytes, from, tag), {{data, bytes}});
  }
  Request iallgather(const void* in, void* out, size_t bytes) override {
    if (gathers_++ == stop_gather_at_) std::this_thread::sleep_for(std::chrono::seconds(60));  // MPI_Abort ends it
    return track(inner_.iallgather(in, out, bytes),
                 {{const_cast<void*>(in), bytes}, {out, bytes * static_cast<size_t>(size())}});
  }
  bool wait(Request request, double seconds) override {
    const std::vector<int64_t> watches = open_.at(request);
    open_.erase(request);  // waited: completed, abandoned or failed
    if (!inner_.wait(request, seconds)) return false;  // (an exception: the same) its buffers stay watched
    for (int64_t w : watches) sdpa_test::unwatch_buffer(w);
    return true;
  }
  int64_t open_requests() const { return static_cast<int64_t>(open_.size()); }
  int64_t freed_while_unfinished() const { return sdpa_test::watched_frees(this, rank()); }

 private:
  Request track(Request id, std::vector<std::pair<void*, size_t>> buffers) {
    std::vector<int64_t>& w = open_[id];
    for (const auto& [data, bytes] : buffers) w.push_back(sdpa_test::watch_buffer(this, rank(), data, bytes));
    return id;
  }
  sdpa::Communicator& inner_;
  int64_t stop_at_, stop_gather_at_, sends_ = 0, gathers_ = 0;
  std::map<Request, std::vector<int64_t>> open_;
};

// --stopped=step, backward and allgather on rank r (not the stopped one, which hangs in its
// call): whether its outcome is the one the top of the file describes; what happened, in words.
bool stopped_in_ring(const std::string& mode, int r, int w, double timeout, double slack, std::string& what) {
  const int stopped = w - 1;
  const RingCase c = {RingLayout::kContiguous, sdpa::Causal::kNone, DType::kFloat32, 4};
  sdpa::mpi::Communicator mpi(MPI_COMM_WORLD);
  Shard s = make_shard(c, w, r);
  GuardedTensor dq(c.dtype, s.q.shape()), dk(c.dtype, s.k.shape()), dv(c.dtype, s.v.shape());
  const bool backward = mode == "backward", allgather = mode == "allgather";
  if (backward) sdpa::ring_attention(mpi, s.inputs(), s.outputs(), {}, {c.layout, kWait});  // every rank
  // The stopped rank's sends: forward, one per step; backward, (block, gradients) per step and
  // the last step's gradients alone. kAllGather: its all-gathers, the collective check's, then
  // the first kv head's K/V.
  Tracked comm(mpi, r != stopped || allgather ? -1 : backward ? 2 * w - 2 : 1, r == stopped && allgather ? 1 : -1);
  const sdpa::RingOptions ring = ring_options(c, allgather ? RingStrategy::kAllGather : RingStrategy::kRing, timeout);
  const auto t0 = Clock::now();
  bool threw = false;
  try {
    if (backward) {
      sdpa::ring_attention_backward(comm, s.inputs(), s.out.view(), s.lse.view(), s.out.view(),
                                    {dq.view(), dk.view(), dv.view()}, {}, ring);
    } else {
      sdpa::ring_attention(comm, s.inputs(), s.outputs(), {}, ring);
    }
    what = "no Error";
  } catch (const Error& e) {
    threw = true;
    what = e.what();
  }
  const double took = seconds_since(t0);
  what += " (after " + std::to_string(took) + " s; " + std::to_string(comm.open_requests()) + " requests open, " +
          std::to_string(comm.freed_while_unfinished()) + " buffers freed under unfinished ones)";
  const bool settled = comm.open_requests() == 0 && comm.freed_while_unfinished() == 0;
  const bool untouched = backward ? dq.untouched() && dk.untouched() && dv.untouched() : s.out.untouched() && s.lse.untouched();
  if (!threw) return !allgather && r != 0 && !untouched && settled;  // (kAllGather: every rank needs the stopped one)
  if (!settled || !untouched || what.find("no message") == std::string::npos) return false;
  if (r != 0) return took < (allgather ? timeout : w * timeout) + slack;
  const std::string expected =  // timeout = 1 s
      allgather ? "ring_attention: rank 0 waited 1 s for the all-gather of the K/V of batch entry 0, kv head 0 (head 1 of 2)"
      : backward ? "waited 1 s for the gradients of its own block at step " + std::to_string(w) + " from rank " +
                       std::to_string(stopped)
                 : "waited 1 s for the block of rank " + std::to_string(w - 2) + " at step 2 from rank " +
                       std::to_string(stopped);
  return took >= timeout && took < timeout + slack && what.find(expected) != std::string::npos;
}

int verdict(const std::string& mode, int r, int w, int ok, const std::string& what, MPI_Comm others);

// --stopped=dup, ring, step and backward: see the top of the file.
int stopped_run(const std::string& mode) {
  const int r = world_rank(), w = world_size();
  if (w < (mode == "step" ? 3 : 2)) {
    if (r == 0) std::printf("stopped-rank test --stopped=%s needs %d+ ranks\n", mode.c_str(), mode == "step" ? 3 : 2);
    return 1;
  }
  const int stopped = w - 1;
  MPI_Comm others;  // made before anything stops: the verdict's communicator
  MPI_Comm_split(MPI_COMM_WORLD, r == stopped ? MPI_UNDEFINED : 0, r, &others);
  // --stopped=ring: the ring's Communicator, made while every rank still runs.
  std::unique_ptr<sdpa::mpi::Communicator> comm;
  if (mode == "ring") comm = std::make_unique<sdpa::mpi::Communicator>(MPI_COMM_WORLD);
  const double timeout = 1.0, slack = 2.0;
  if (mode == "step" || mode == "backward" || mode == "allgather") {
    std::string what;
    int ok = 0;
    try {
      ok = stopped_in_ring(mode, r, w, timeout, slack, what);  // the stopped rank never returns
    } catch (const std::exception& e) {
      what = std::string("unexpected: ") + e.what();
    }
    if (r == stopped) {  // only if it did not stop where it should
      std::printf("rank %d (the stopped one) returned: %s\n", r, what.c_str());
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 1;
    }
    return verdict(mode, r, w, ok, what, others);
  }
  if (r == stopped) {
    std::this_thread::sleep_for(std::chrono::seconds(60));  // MPI_Abort ends it sooner
    return 1;
  }
  int ok = 0;
  std::string what;
  auto t0 = Clock::now();
  std::unique_ptr<Shard> shard;
  try {
    if (mode == "dup") {
      sdpa::mpi::Communicator comm(MPI_COMM_WORLD, timeout);
      what = "no Error";
    } else if (mode == "ring") {
      const RingCase c = {RingLayout::kZigzag, sdpa::Causal::kTopLeft, DType::kFloat32, 4};
      shard = std::make_unique<Shard>(make_shard(c, w, r));
      t0 = Clock::now();
      sdpa::ring_attention(*comm, shard->inputs(), shard->outputs(), {}, {c.layout, timeout});
      what = "no Error";
    } else {
      what = "unknown mode --stopped=" + mode;
    }
  } catch (const Error& e) {
    what = e.what();
    const double took = seconds_since(t0);
    const char* expected = mode == "dup" ? "did not complete within" : "for the all-gather of the ranks' arguments";
    ok = took >= timeout && took < timeout + slack && what.find(expected) != std::string::npos &&
         (!shard || (shard->out.untouched() && shard->lse.untouched()));
    what += " (after " + std::to_string(took) + " s)";
  }
  return verdict(mode, r, w, ok, what, others);
}

// Each rank but the stopped one prints its outcome; rank 0 gathers theirs and ends the job.
int verdict(const std::string& mode, int r, int w, int ok, const std::string& what, MPI_Comm others) {
  const int stopped = w - 1;
  std::printf("rank %d: %s: %s\n", r, ok ? "ok" : "FAILED", what.c_str());
  std::fflush(stdout);
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, others);
  if (r == 0) {
    std::printf("stopped-rank test (%s, %d ranks, rank %d stopped): %s\n", mode.c_str(), w, stopped,
                all ? "PASSED" : "FAILED");
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, all ? 0 : 1);  // MPI is undefined after a timeout: end the job
  }
  std::this_thread::sleep_for(std::chrono::seconds(60));  // rank 0's MPI_Abort ends it
  return 1;
}

// Ranks other than 0 print only their failures, prefixed with their rank.
class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--stopped=", 10) == 0) return stopped_run(argv[i] + 10);
  }
  testing::InitGoogleTest(&argc, argv);
  if (world_rank() != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(world_rank()));
  }
  const int failed = RUN_ALL_TESTS();
  MPI_Finalize();
  return failed;
}
