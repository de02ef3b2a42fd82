// An in-process sdpa::Communicator for tests: W ranks as threads of one process sharing a
// mailbox. Messages are keyed (from, to, tag) and matched FIFO (the n-th receive posted for a
// key takes the n-th message sent on it); isend copies the bytes at once (its request is
// complete); an all-gather completes when every rank has contributed to that round; wait blocks
// on a condition variable with a real deadline (no spinning). A rank can be stopped (its sends
// and all-gather contributions from some point on are dropped, as a process that hangs or died
// would never send them) to test the ring's deadlines.
//
//   LocalWorld world(3);
//   world.stop_sends(1, 0);  // rank 1 never sends a point-to-point message
//   auto errors = world.run([&](int rank, sdpa::Communicator& comm) { sdpa::ring_attention(comm, ...); });
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "sdpa/ring.h"

namespace sdpa_test {

class LocalWorld;

class LocalComm : public sdpa::Communicator {
 public:
  LocalComm(LocalWorld& world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override;
  Request isend(const void* data, size_t bytes, int to, int tag) override;
  Request irecv(void* data, size_t bytes, int from, int tag) override;
  Request iallgather(const void* in, void* out, size_t bytes) override;
  bool wait(Request request, double seconds) override;

 private:
  LocalWorld& world_;
  int rank_;
};

class LocalWorld {
 public:
  explicit LocalWorld(int size);
  int size() const { return size_; }
  sdpa::Communicator& comm(int rank) { return *comms_[static_cast<size_t>(rank)]; }
  // From rank's (after+1)-th point-to-point send on, its messages are dropped (never delivered).
  void stop_sends(int rank, int after);
  // Rank's all-gather contributions are dropped from now on (with stop_sends: a dead rank).
  void stop_allgathers(int rank);
  // Runs f(rank, comm) on one thread per rank; returns each rank's exception (null: returned).
  std::vector<std::exception_ptr> run(const std::function<void(int, sdpa::Communicator&)>& f);
  // Requests posted and not yet waited to completion or abandoned by a timed-out wait, per rank:
  // 0 after a call that waited for everything it started.
  int64_t open_requests(int rank);

 private:
  friend class LocalComm;
  struct Req {
    int owner = 0;
    enum Kind { kDone, kRecv, kGather } kind = kDone;
    void* data = nullptr;
    size_t bytes = 0;
    std::tuple<int, int, int> key;  // (from, to, tag) of a receive
    int64_t seq = 0;                // which message of the key, or which all-gather round
  };
  int size_;
  std::vector<std::unique_ptr<LocalComm>> comms_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::tuple<int, int, int>, std::map<int64_t, std::vector<std::byte>>> mail_;
  std::map<std::tuple<int, int, int>, int64_t> sent_, posted_;
  std::map<int64_t, std::vector<std::vector<std::byte>>> gathers_;  // round -> each rank's bytes
  std::vector<int64_t> gather_round_, sends_, stop_after_;
  std::vector<bool> gather_stopped_;
  std::map<int64_t, Req> requests_;
  int64_t next_request_ = 1;
};

}  // namespace sdpa_test
