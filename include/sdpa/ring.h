// sdpa: ring attention, exact context-parallel attention over several processes.
//
// A sequence of N tokens is cut into W shards, one per rank of a communicator (MPI, torch.distributed,
// or any transport behind the Communicator interface below). Each rank holds its shard's q, k and
// v; the keys and values travel around the ring (rank r sends to r + 1 and receives from r - 1,
// modulo W) while every rank attends its queries to each block in turn, and the partial results
// merge by their log-sum-exp (sdpa/merge.h) in float32 (float64 for float64 inputs), so nothing is
// rounded to 16 bits before the last merge. Each (query chunk, key chunk) pair is one attention()
// call with its absolute positions (Options::q_start, k_start), so causal, window, ALiBi, a block
// mask and dropout are those of the one-process call on the whole sequence.
//
// Layouts: the sequence is cut into chunks, and rank r holds
//   kContiguous  chunk r of W                  (N_local = N / W)
//   kZigzag      chunks r and 2W - 1 - r of 2W (N_local = N / W, two chunks of N / 2W)
// e.g. W = 2, N = 8 (positions), causal:
//   kContiguous  rank 0: 0 1 2 3          rank 1: 4 5 6 7
//   kZigzag      rank 0: 0 1 | 6 7        rank 1: 2 3 | 4 5
// Under causal, kContiguous gives rank W - 1 (2W - 1) times rank 0's work; kZigzag gives every rank the
// same work (each rank's early chunk sees few keys, its late chunk many).
//
// Results: bitwise the same from run to run for a given world size, layout, thread count choice
// and options (each block's partial is merged in ring-step order: the rank's own block first, then
// the block of rank r - 1, r - 2, ...), and equal to the one-process call within the tolerance rule
// (tests/ring_test.cc). Memory per rank: O(N_local) (two K/V blocks, the float32 partials).
//
// Failures: every rank checks its own arguments as attention() would, then the shapes, dtypes,
// options and a hash of the slopes', sinks' and block mask's values are compared across ranks in
// one all-gather before any block moves. A refusal on any rank is the same Error on every rank
// ("rank R refused its arguments: ..."), and so is a difference ("rank R's arguments differ from
// rank 0's ...: <field>: <value> on rank 0, <value> on rank R"). Every wait has a deadline
// (RingOptions::timeout_seconds; <= 0 is refused locally): a rank that dies or stops gives its
// successor an Error naming the peer, the block and the step within that time, and the ranks
// behind it fail in turn, each within one deadline per step it waited — never a hang. A pair whose
// computation fails on a rank (an lse of +inf or NaN) is an Error on that rank after the ring has
// finished (and, in the backward, on every rank whose dk, dv lack its part). Outputs are written
// only after the last block arrived: a call that throws writes nothing, leaves none of its
// requests pending, and leaks (never frees) the message buffers of those that did not complete
// (Communicator, below: kRing's blocks and gradient sums, O(N_local); kAllGather's gathered
// heads and a head's dk, dv segments, O(N) for one head).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa {

// The transport a ring runs on: point-to-point messages of bytes and an all-gather, non-blocking,
// waited on with a deadline. Adapters: sdpa::mpi::Communicator (sdpa/mpi.h, library sdpa_mpi),
// Python's sdpa.distributed (mpi4py) and sdpa.torch.distributed (torch.distributed). A call waits
// every request it started before it returns. A call that throws first waits each request still
// outstanding once more, all of them within min(0.25 s, RingOptions::timeout_seconds) together
// (enough for one whose peer already matched it; one whose peer stopped never completes), and
// then uses the communicator no more; the buffers of every request that did not complete (its
// wait timed out or threw, or it was still outstanding) are leaked, never freed, since the
// transport may still read or write them.
class Communicator {
 public:
  using Request = int64_t;  // an adapter's handle of one non-blocking operation
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Start sending bytes [data, data + bytes) to rank `to` / receiving them from rank `from`, with
  // a tag (messages between two ranks with one tag arrive in the order sent). The buffer is not
  // touched by the caller until the request completes.
  virtual Request isend(const void* data, size_t bytes, int to, int tag) = 0;
  virtual Request irecv(void* data, size_t bytes, int from, int tag) = 0;
  // Start gathering `bytes` bytes from every rank: out holds size() · bytes, rank i's at i · bytes.
  virtual Request iallgather(const void* in, void* out, size_t bytes) = 0;
  // Wait for the request up to `seconds`: true when it completed, false when the time ran out
  // (the request is then abandoned). A transport error (a peer that closed its connection) is
  // thrown as sdpa::Error naming the peer.
  virtual bool wait(Request request, double seconds) = 0;
};

enum class RingLayout : uint8_t {
  kContiguous,  // rank r holds chunk r of W
  kZigzag,      // rank r holds chunks r and 2W - 1 - r of 2W (balances causal work)
};

// Where a call's time went on this rank (RingOptions::stats), for benchmarks: the share of the
// transfers hidden behind compute is 1 - wait_seconds / (the transfers' own time).
struct RingStats {
  double check_seconds = 0;    // the local checks and the all-gather of the ranks' arguments
  double compute_seconds = 0;  // the pairs' attention() / attention_backward() calls and merges
  double wait_seconds = 0;     // waiting for transfers after the compute (exposed communication)
  int64_t bytes_sent = 0;      // bytes this rank sent (blocks and, backward, gradients)
};

// How the keys and values reach the queries (both compute the same pairs, below; the results of
// the two differ only by the order of their merges and sums, each fixed):
//   kRing       K/V blocks travel the ring (rank r sends to r + 1): 2 (W - 1) blocks of N_local
//               tokens (k and v) sent per rank, each transfer overlapped with the compute of the
//               block before; memory O(N_local) per rank (two blocks). Long sequences with many
//               kv heads: the default.
//   kAllGather  every rank gathers the whole sequence's K/V, one (batch entry, kv head) at a time
//               (Llama 3's context parallelism gathers K/V): the same bytes per rank as the ring,
//               the next head's gather in flight while the current head is computed, but memory
//               2 · N · (Dk + Dv) per rank for the gathered head (two heads' buffers, N = W ·
//               N_local; N · D per tensor, not N · Hkv · D). For GQA / MQA (few kv heads: K/V
//               small beside Q) and short K/V, where a head's gathered K/V is cheap and each rank
//               then computes without waiting step by step. The pairs are taken in the ring's step
//               order: out and lse are merged as kRing's (bitwise kRing's unless a kernel's plan
//               depends on the head count: e.g. a long document's few rows, whose keys a call of
//               all heads may split otherwise; within the tolerance rule either way). The backward gathers the same, computes dq locally
//               and its part of the head's whole dk, dv (N · (Dk + Dv) more, float32 / float64),
//               and reduces those to their owners with a ring reduce-scatter (W - 1 steps of
//               isend/irecv per head, after the head's compute: rank o's rows summed over ranks
//               o + 1, o + 2, ..., o in that order). Packed documents: forward and backward (as
//               kRing). Refuses dropout_p > 0 and a block mask (Error: its calls hold one kv
//               head's query heads, which dropout and the mask would number from 0).
enum class RingStrategy : uint8_t { kRing, kAllGather };

struct RingOptions {
  RingLayout layout = RingLayout::kZigzag;
  // Each wait's deadline, from the start of that wait (a block's transfer and the peer's compute
  // on the block before it must fit in it). > 0.
  double timeout_seconds = 300.0;
  RingStats* stats = nullptr;  // when given, overwritten with this call's (also when it throws)
  // Packed documents (sequences packed end to end in one row of tokens, as attention_varlen
  // packs them): (D + 1,) int32 or int64 offsets over the WHOLE sequence's positions (not the
  // rank's rows): 0, non-decreasing, ending at N = W · N_local (Error otherwise, naming the
  // entry and its value); the same on every rank (compared). q's batch must be 1 (rank 4; ranks
  // 2 and 3 have none). The result is attention_varlen's on the whole packed sequence with
  // cu_seqlens_q = cu_seqlens_k = these offsets: a token attends only to keys of its own
  // document, and causal, the window and ALiBi are the document's own (positions relative to
  // its start); (D, Hq) ALiBi slopes give document d row d; a block mask is read per document
  // as attention_varlen reads it (its leading dims broadcast to (D, Hq), each document the
  // top-left corner of its row: ceil(longest document / block) blocks suffice); dropout draws
  // as attention_varlen does (batch index = the document, positions inside it). Documents may
  // span ranks and chunks and start anywhere in a chunk. ring_attention_backward takes the same
  // offsets and gives attention_varlen_backward's gradients on the whole packed sequence:
  // dalibi_slopes has the slopes' shape ((D, Hq) slopes: row d is document d's; (Hq,) or
  // (1, Hq): summed over the documents), dsinks (Hq,) sums every document's rows; both are this
  // rank's part, to be summed over the ranks (tests/ring_docs_test.cc).
  std::optional<TensorView> cu_seqlens = std::nullopt;
  RingStrategy strategy = RingStrategy::kRing;
};

// One chunk of this rank's shard: rows [local, local + length) of the local tensors hold the
// sequence's positions [start, start + length).
struct RingChunk {
  int64_t local = 0, start = 0, length = 0;
};
// The chunks rank `rank` of `world` holds for a local length n_local (kZigzag: two chunks of
// n_local / 2, so n_local must be even; Error otherwise; kContiguous: one).
std::vector<RingChunk> ring_chunks(RingLayout layout, int world, int rank, int64_t n_local);

// Ring attention forward. inputs.q, k, v: this rank's shards, (B, Hq, N_local, Dk) etc. with the
// rank and dtypes attention() takes (ranks 2-4; N_local the same on every rank; q's and k's
// N_local equal). No Inputs::mask or seqlens_k (Error): a block mask (Options::block_mask, of the
// whole sequence, read at absolute positions) masks instead. outputs.out: this rank's output shard
// (q's dtype, or float32 for 16-bit q); outputs.lse optional (the compute type), the whole rows'
// log-sum-exp for ring_attention_backward; weights, stats and scores: Error. options: as
// attention()'s, except q_start and k_start (Error: the layout sets them); every rank passes the
// same options (compared, with the shapes, before any block moves; seeds and slopes included).
// Sinks are counted once: with the pair of each query chunk and the same chunk of the rank's own
// block (always visible). Pairs no query of the chunk can see (causal, window) are not computed.
void ring_attention(Communicator& comm, const Inputs& inputs, const Outputs& outputs, const Options& options = {},
                    const RingOptions& ring = {});

// Ring attention backward: given this rank's q, k, v, the out and lse ring_attention gave (lse
// required) and dout, writes this rank's dq, dk, dv (and dsinks, dalibi_slopes: each rank's part,
// to be summed over the ranks by the caller, e.g. with an all-reduce; dbias: Error). The K/V blocks
// travel the ring as in the forward, each with its float32 dk, dv accumulators, which reach their
// owner after W steps: dk of a block is summed over the ranks in ring order from its owner, dq over
// the blocks in ring-step order, in float32 (float64 for float64), rounded once to the gradients'
// dtypes.
void ring_attention_backward(Communicator& comm, const Inputs& inputs, const TensorView& out, const TensorView& lse,
                             const TensorView& dout, const Gradients& grads, const Options& options = {},
                             const RingOptions& ring = {});

}  // namespace sdpa
