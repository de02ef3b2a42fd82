// sdpa: ring attention over MPI (library sdpa_mpi, built when CMake finds MPI; the library sdpa,
// the CLI and the Python package never link libmpi).
//
// sdpa::mpi::Communicator is the MPI adapter of sdpa::Communicator (sdpa/ring.h), and
// sdpa::mpi::ring_attention / ring_attention_backward are sdpa/ring.h's functions on an MPI
// communicator: every rank of `comm` calls them together, with its own shard (ring.h says which
// positions rank r holds in each layout: sdpa::ring_chunks).
//
//   MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);   // the kernels' OpenMP
//   sdpa::mpi::ring_attention(MPI_COMM_WORLD, inputs, outputs, options);  // threads call no MPI
//
// Threads: MPI is called only from the thread that calls these functions (MPI_THREAD_FUNNELED
// is enough; the kernels' OpenMP threads never call MPI). One Communicator is used by one
// thread at a time.
//
// Failures. MPI errors are returned, not fatal (MPI_ERRORS_RETURN on the Communicator's own
// duplicate of `comm`) and thrown as sdpa::Error with MPI_Error_string's text, the operation
// and the peer. Every wait has a deadline (RingOptions::timeout_seconds): a rank that stopped
// (or died without MPI noticing) gives the others an Error naming the peer within that time,
// never a hang. After such a timeout the state of MPI is undefined: Debian's OpenMPI 4.1 has no
// fault tolerance (ULFM), the abandoned point-to-point requests are cancelled and freed but a
// transfer already under way may still write into memory the ring has released, and an
// abandoned collective stays pending. The caller should report the Error and end the job with
// MPI_Abort (tests/mpi/ring_mpi_test.cc does), not go on using MPI. A mismatch of shapes or
// options between the ranks is not a timeout: it is an Error on every rank with MPI left clean.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "sdpa/attention.h"
#include "sdpa/ring.h"

namespace sdpa::mpi {

class Communicator final : public sdpa::Communicator {
 public:
  // Duplicates comm (so the ring's messages never match the caller's, whatever their tags)
  // with MPI_Comm_idup, a collective of every rank of comm, waited on for at most
  // timeout_seconds (Error when a rank does not join). Messages larger than
  // max_message_bytes (at most INT_MAX, MPI's int counts) travel as one message of a derived
  // datatype (a block over 2 GiB: a million tokens' keys per rank); the default is the
  // largest power of two MPI takes, and a smaller one is for tests of that path.
  explicit Communicator(MPI_Comm comm, double timeout_seconds = 300.0, size_t max_message_bytes = size_t{1} << 30);
  ~Communicator() override;  // MPI_Comm_free of the duplicate (local; pending requests finish first)
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // MPI_Isend / MPI_Irecv of MPI_BYTE (tags 0 to MPI_TAG_UB, at least 32767).
  Request isend(const void* data, size_t bytes, int to, int tag) override;
  Request irecv(void* data, size_t bytes, int from, int tag) override;
  Request iallgather(const void* in, void* out, size_t bytes) override;  // MPI_Iallgather
  // MPI_Test in a loop (MPI makes progress inside it): spinning (sched_yield) for the first
  // millisecond, then sleeping between tests with a backoff from 1 µs to 64 µs, until the
  // request completes (true) or `seconds` pass (false). On false
  // a point-to-point request is cancelled and freed; a collective one cannot be (MPI forbids
  // both) and is left pending. Either way MPI's state is then undefined (above).
  bool wait(Request request, double seconds) override;

  MPI_Comm comm() const { return comm_; }  // the duplicate

 private:
  struct Pending {
    MPI_Request request;
    const char* operation;  // "MPI_Isend to", "MPI_Irecv from", "MPI_Iallgather"
    int peer;               // -1 for a collective
    int tag;
  };
  // A started operation's handle, or the Error of its MPI call's code.
  Request start(int code, MPI_Request request, const char* operation, int peer, int tag);
  [[noreturn]] void fail(int code, const char* operation, int peer, int tag) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  size_t max_message_bytes_;
  Request next_ = 0;
  std::unordered_map<Request, Pending> pending_;
};

// sdpa::ring_attention (sdpa/ring.h) on comm: every rank of comm calls it. Duplicates comm for
// the call (a Communicator, within ring.timeout_seconds); a program that calls it often can
// keep one Communicator and call sdpa::ring_attention with it.
void ring_attention(MPI_Comm comm, const Inputs& inputs, const Outputs& outputs, const Options& options = {},
                    const RingOptions& ring = {});

// sdpa::ring_attention_backward (sdpa/ring.h) on comm, as ring_attention above.
void ring_attention_backward(MPI_Comm comm, const Inputs& inputs, const TensorView& out, const TensorView& lse,
                             const TensorView& dout, const Gradients& grads, const Options& options = {},
                             const RingOptions& ring = {});

}  // namespace sdpa::mpi
