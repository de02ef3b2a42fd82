// The MPI adapter of the ring's Communicator (sdpa/mpi.h).
#include "sdpa/mpi.h"

#include <sched.h>

#include <chrono>
#include <climits>
#include <string>
#include <thread>

namespace sdpa::mpi {
namespace {

using Clock = std::chrono::steady_clock;

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(length));
}

// A message of `bytes` bytes as MPI sees it: `count` elements of `type`. MPI's counts are ints,
// so a message over max_bytes (<= INT_MAX) is one element of a derived datatype: blocks of
// max_bytes and the rest, its extent exactly `bytes` (so that MPI_Iallgather places rank i's
// at i · bytes). The caller frees an owned type once the operation has started (MPI lets an
// operation under way finish with a freed type).
struct Message {
  int count = 0;
  MPI_Datatype type = MPI_BYTE;
  bool owned = false;
};

Message message(size_t bytes, size_t max_bytes) {
  if (bytes <= max_bytes) return {static_cast<int>(bytes), MPI_BYTE, false};
  const size_t blocks = bytes / max_bytes, rest = bytes % max_bytes;
  if (blocks > static_cast<size_t>(INT_MAX)) {
    throw Error("sdpa::mpi::Communicator: a message of " + std::to_string(bytes) + " bytes is more than MPI can count");
  }
  MPI_Datatype block, whole, resized;
  MPI_Type_contiguous(static_cast<int>(max_bytes), MPI_BYTE, &block);
  int lengths[2] = {static_cast<int>(blocks), static_cast<int>(rest)};
  MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(blocks * max_bytes)};
  MPI_Datatype types[2] = {block, MPI_BYTE};
  MPI_Type_create_struct(rest ? 2 : 1, lengths, displacements, types, &whole);
  MPI_Type_create_resized(whole, 0, static_cast<MPI_Aint>(bytes), &resized);
  MPI_Type_commit(&resized);
  MPI_Type_free(&whole);
  MPI_Type_free(&block);
  return {1, resized, true};
}

// call(count, type): an MPI call that starts an operation on the message; its error code.
template <typename Call>
int with_message(size_t bytes, size_t max_bytes, Call call) {
  Message m = message(bytes, max_bytes);
  const int code = call(m.count, m.type);
  if (m.owned) MPI_Type_free(&m.type);
  return code;
}

}  // namespace

Communicator::Communicator(MPI_Comm comm, double timeout_seconds, size_t max_message_bytes)
    : max_message_bytes_(max_message_bytes) {
  if (max_message_bytes == 0 || max_message_bytes > static_cast<size_t>(INT_MAX)) {
    throw Error("sdpa::mpi::Communicator: max_message_bytes = " + std::to_string(max_message_bytes) +
                ", must be in [1, INT_MAX = " + std::to_string(INT_MAX) + "]");
  }
  if (!(timeout_seconds > 0)) {
    throw Error("sdpa::mpi::Communicator: timeout_seconds = " + std::to_string(timeout_seconds) + ", must be > 0");
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    throw Error(std::string("sdpa::mpi::Communicator: MPI is ") + (finalized ? "finalized" : "not initialized") +
                " (MPI_Init_thread before, MPI_Finalize after)");
  }
  if (comm == MPI_COMM_NULL) throw Error("sdpa::mpi::Communicator: comm is MPI_COMM_NULL");
  // Errors of the duplication itself go to comm's handler (the caller's choice); a rank that
  // never joins is the deadline's.
  MPI_Comm duplicate = MPI_COMM_NULL;
  MPI_Request request;
  const int code = MPI_Comm_idup(comm, &duplicate, &request);
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
  if (!wait(start(code, request, "MPI_Comm_idup", -1, -1), timeout_seconds)) {
    throw Error("sdpa::mpi::Communicator: rank " + std::to_string(rank_) + ": MPI_Comm_idup of a communicator of " +
                std::to_string(size_) + " ranks did not complete within " + std::to_string(timeout_seconds) +
                " s: a rank did not call it (stopped or died); MPI's state is now undefined (sdpa/mpi.h)");
  }
  comm_ = duplicate;
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
}

Communicator::~Communicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Communicator::Request Communicator::start(int code, MPI_Request request, const char* operation, int peer, int tag) {
  if (code != MPI_SUCCESS) fail(code, operation, peer, tag);
  const Request handle = next_++;
  pending_.emplace(handle, Pending{request, operation, peer, tag});
  return handle;
}

void Communicator::fail(int code, const char* operation, int peer, int tag) const {
  std::string where = operation;
  if (peer >= 0) where += " rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
  throw Error("sdpa::mpi::Communicator: rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": " + where +
              " failed: " + error_string(code));
}

Communicator::Request Communicator::isend(const void* data, size_t bytes, int to, int tag) {
  MPI_Request request;
  const int code = with_message(bytes, max_message_bytes_, [&](int count, MPI_Datatype type) {
    return MPI_Isend(data, count, type, to, tag, comm_, &request);
  });
  return start(code, request, "MPI_Isend to", to, tag);
}

Communicator::Request Communicator::irecv(void* data, size_t bytes, int from, int tag) {
  MPI_Request request;
  const int code = with_message(bytes, max_message_bytes_, [&](int count, MPI_Datatype type) {
    return MPI_Irecv(data, count, type, from, tag, comm_, &request);
  });
  return start(code, request, "MPI_Irecv from", from, tag);
}

Communicator::Request Communicator::iallgather(const void* in, void* out, size_t bytes) {
  MPI_Request request;
  const int code = with_message(bytes, max_message_bytes_, [&](int count, MPI_Datatype type) {
    return MPI_Iallgather(in, count, type, out, count, type, comm_, &request);
  });
  return start(code, request, "MPI_Iallgather", -1, -1);
}

bool Communicator::wait(Request request, double seconds) {
  const auto it = pending_.find(request);
  if (it == pending_.end()) {
    throw Error("sdpa::mpi::Communicator::wait: request " + std::to_string(request) +
                " is not pending (already waited on, abandoned, or never started)");
  }
  Pending& p = it->second;
  const auto begin = Clock::now();
  const auto deadline = begin + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  // MPI progresses (a rendezvous, the copy of a large message) only inside MPI calls, on both
  // sides: test often. Spin (yielding the core to a rank or thread that shares it) for the
  // first millisecond, which a block already on its way needs; then sleep between tests, 1 µs
  // doubling to 64 µs (Linux's timer slack adds ~50 µs to each), so that a rank waiting for a
  // slow peer leaves the cores to the others. Measured (2 ranks, ping-pong of 1 MiB, a shared
  // 2-core machine under load, so ±50%): with CMA, wait() 0.6 ms per round trip, MPI_Wait
  // 0.3-1.6 ms; through shared-memory buffers (single copy off, as in containers) 1.0-1.5 ms vs
  // 0.8-1.3 ms; a spin of 20 µs instead made the latter 3.2 ms vs 1.0 ms (the pipelined copy
  // stalled in the sleeps). 8 bytes: 0.9 µs vs 0.3 µs.
  auto nap = std::chrono::microseconds(1);
  for (;;) {
    int done = 0;
    const int code = MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      const Pending failed = p;
      pending_.erase(it);
      fail(code, failed.operation, failed.peer, failed.tag);
    }
    if (done) {
      pending_.erase(it);
      return true;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    if (now - begin < std::chrono::milliseconds(1)) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::min<Clock::duration>(nap, deadline - now));
      nap = std::min(nap * 2, std::chrono::microseconds(64));
    }
  }
  // Abandoned. A point-to-point request is cancelled and freed (a receive that nothing matched
  // is then gone cleanly); MPI forbids both on a collective, which stays pending.
  if (p.peer >= 0) {
    MPI_Cancel(&p.request);
    MPI_Request_free(&p.request);
  }
  pending_.erase(it);
  return false;
}

void ring_attention(MPI_Comm comm, const Inputs& inputs, const Outputs& outputs, const Options& options,
                    const RingOptions& ring) {
  Communicator communicator(comm, ring.timeout_seconds);
  sdpa::ring_attention(communicator, inputs, outputs, options, ring);
}

void ring_attention_backward(MPI_Comm comm, const Inputs& inputs, const TensorView& out, const TensorView& lse,
                             const TensorView& dout, const Gradients& grads, const Options& options,
                             const RingOptions& ring) {
  Communicator communicator(comm, ring.timeout_seconds);
  sdpa::ring_attention_backward(communicator, inputs, out, lse, dout, grads, options, ring);
}

}  // namespace sdpa::mpi
