// An in-process sdpa::Communicator for tests: W ranks as threads of one process sharing a
// mailbox. Messages are keyed (from, to, tag) and matched FIFO (the n-th receive posted for a
// key takes the n-th message sent on it); isend copies the bytes at once (its request is
// complete). Two deliveries (LocalWorld's constructor):
//   kAtWait  a message lands in the receive's buffer when the receiver waits for it;
//   kEager   it lands when both the send and the receive are posted, whichever comes second (as
//            a transport that writes into a posted receive buffer while the receiver computes),
//            and a receive abandoned by a timed-out wait still takes its message if it arrives
//            later (as an MPI_Cancel that did not take) unless its buffer was freed.
// An all-gather completes when every rank has contributed to that round; wait blocks on a
// condition variable with a real deadline (no spinning). A rank can be stopped (its sends and
// all-gather contributions from some point on are dropped, as a process that hangs or died would
// never send them) to test the ring's deadlines.
//
// The buffer of every receive and all-gather not waited to completion (open, abandoned or
// failed) is watched (watch_buffer below): freeing it (operator delete) is counted, since a
// transport may still write into it (ring.h: the ring leaks such buffers).
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

// Memory a request not waited to completion may still touch: watch_buffer returns an id (0 for
// an empty range, never watched) until unwatch_buffer(id); a free of any byte of it (global
// operator delete, replaced in ring_local.cc) meanwhile marks it freed. watched_frees(owner,
// rank): how many of `owner`'s ranges of that rank were freed while watched. write_if_alive
// copies into a watched range unless it was freed (atomically with the frees).
int64_t watch_buffer(const void* owner, int rank, void* data, size_t bytes);
void unwatch_buffer(int64_t id);
bool write_if_alive(int64_t id, const void* src, size_t bytes);
int64_t watched_frees(const void* owner, int rank);
void forget_buffers(const void* owner);  // unwatches all of owner's

enum class Delivery { kAtWait, kEager };

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
  explicit LocalWorld(int size, Delivery delivery = Delivery::kAtWait);
  ~LocalWorld();
  LocalWorld(const LocalWorld&) = delete;
  LocalWorld& operator=(const LocalWorld&) = delete;
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
  // Requests whose wait timed out or threw, per rank (their buffers stay watched).
  int64_t abandoned_requests(int rank);
  // Frees of a buffer that an open, abandoned or failed request of rank's may still touch.
  int64_t freed_while_unfinished(int rank) { return watched_frees(this, rank); }

 private:
  friend class LocalComm;
  struct Req {
    int owner = 0;
    enum Kind { kDone, kRecv, kGather } kind = kDone;
    void* data = nullptr;
    size_t bytes = 0;
    int64_t watch = 0;       // watch_buffer's id of data (receives, all-gathers)
    bool delivered = false;  // kEager: the message is in data already (or its size differed: got)
    size_t got = 0;
    std::tuple<int, int, int> key;  // (from, to, tag) of a receive
    int64_t seq = 0;                // which message of the key, or which all-gather round
  };
  // kEager: the receive (open or abandoned) that message seq of key takes, if posted; delivers
  // into it. Called with mu_ held.
  void deliver_eagerly(const std::tuple<int, int, int>& key, int64_t seq);
  int size_;
  Delivery delivery_;
  std::vector<std::unique_ptr<LocalComm>> comms_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::tuple<int, int, int>, std::map<int64_t, std::vector<std::byte>>> mail_;
  std::map<std::tuple<int, int, int>, int64_t> sent_, posted_;
  std::map<int64_t, std::vector<std::vector<std::byte>>> gathers_;  // round -> each rank's bytes
  std::vector<int64_t> gather_round_, sends_, stop_after_;
  std::vector<bool> gather_stopped_;
  std::map<int64_t, Req> requests_;
  std::map<int64_t, Req> abandoned_;  // timed out or failed
  int64_t next_request_ = 1;
};

}  // namespace sdpa_test
