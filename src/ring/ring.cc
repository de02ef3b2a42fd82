// Ring attention (include/sdpa/ring.h): the K/V blocks travel the ring behind the Communicator
// interface while each rank computes its (query chunk, key chunk) pairs with attention() /
// attention_backward() at absolute positions and merges the partials with merge_attention. One
// algorithm for every transport: the adapters (MPI, mpi4py, torch.distributed) only move bytes.
//
// Order of a call: local checks (ring.h's refusals, then make_problem / make_backward_problem of
// the rank's whole shard at the first and the last positions of the sequence, which checks every
// argument and the block mask's coverage); one all-gather of a fixed-size Descriptor (shapes,
// dtypes, options, a hash of the slopes', sinks' and block mask's values, or the local Error), so
// that every rank throws the same Error before any block moves; then the ring. An Error of a
// pair's computation (an lse of +inf or NaN, which merge_attention refuses) is kept until the
// ring has finished, so that the peers never wait for a rank that stopped computing; the
// backward passes it on with the travelling gradients, so every rank whose dk, dv it reached
// throws it too (their sums lack its part).
#include "sdpa/ring.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <vector>

// LeakSanitizer is told that the buffers a failed call leaks on purpose (Transfers) are not a leak.
#if defined(__SANITIZE_ADDRESS__)
#define SDPA_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SDPA_LSAN 1
#endif
#endif
#ifdef SDPA_LSAN
#include <sanitizer/lsan_interface.h>
#endif

#include "../checks.h"
#include "../packed.h"
#include "../problem.h"
#include "../storage.h"
#include "sdpa/merge.h"

namespace sdpa {
namespace {

using internal::fail;

constexpr int kTagBlock = 2901;      // a packed K/V block
constexpr int kTagGradients = 2902;  // a block's travelling dk, dv accumulators (backward)

std::string str(int64_t x) { return std::to_string(x); }
std::string str(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

// ---- Views ----

// A C-order view of `rank` dims.
TensorView contiguous_view(void* data, DType dtype, int rank, const int64_t* shape) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = rank;
  int64_t stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= shape[d];
  }
  return t;
}
// t with dim `dim` cut to [first, first + n).
TensorView slice(TensorView t, int dim, int64_t first, int64_t n) {
  if (t.data != nullptr && n > 0) {
    t.data = static_cast<char*>(t.data) + first * t.strides[dim] * dtype_size(t.dtype);
  }
  t.shape[dim] = n;
  return t;
}
// A shape with dim `dim` replaced.
std::vector<int64_t> with_dim(const TensorView& t, int dim, int64_t n) {
  std::vector<int64_t> s(t.shape, t.shape + t.rank);
  s[static_cast<size_t>(dim)] = n;
  return s;
}

// The elements of a C-order shape, without its last `drop` dims.
size_t numel(const std::vector<int64_t>& shape, size_t drop = 0) {
  int64_t n = 1;
  for (size_t d = 0; d + drop < shape.size(); ++d) n *= shape[d];
  return static_cast<size_t>(n);
}

// Calls f(offset of the element in t's storage, in elements, index in C order) for every element.
template <typename F>
void for_each_element(const TensorView& t, F f) {
  if (t.numel() == 0) return;
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  const int pad = 4 - t.rank;
  for (int d = 0; d < t.rank; ++d) shape[pad + d] = t.shape[d], strides[pad + d] = t.strides[d];
  int64_t flat = 0;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d) f(a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3], flat++);
}

// t's elements copied to dst in C order, in t's dtype.
void pack(const TensorView& t, std::byte* dst) {
  const int64_t size = dtype_size(t.dtype);
  const auto* src = static_cast<const std::byte*>(t.data);
  for_each_element(t, [&](int64_t at, int64_t flat) { std::memcpy(dst + flat * size, src + at * size, size); });
}
// x (C order, T) rounded once into t (its dtype and strides).
template <typename T>
void store(const std::vector<T>& x, const TensorView& t) {
  auto* dst = static_cast<std::byte*>(t.data);
  const int64_t size = dtype_size(t.dtype);
  for_each_element(t, [&](int64_t at, int64_t flat) {
    internal::store_as(t.dtype, dst + at * size, x[static_cast<size_t>(flat)]);
  });
}

// ---- The problem ----

// The documents over the whole sequence's positions: RingOptions::cu_seqlens' D + 1 offsets, or
// without it one document {0, N} (each pair is then one call on the whole chunks).
struct Docs {
  std::vector<int64_t> cu;
  bool given = false;
};

struct Shard {
  int rank_dims = 0;  // of q (2 to 4)
  int n_dim = 0;      // the sequence's dim: rank - 2
  int64_t n_local = 0;
  int64_t n_total = 0;  // W · n_local
  int64_t Hq = 1;       // q's heads (1 for rank 2)
  std::vector<RingChunk> chunks;
  Docs docs;
};

Options positioned(Options o, int64_t q_start, int64_t k_start) {
  o.q_start = q_start;
  o.k_start = k_start;
  return o;
}

// Whether some row of query chunk q can see some key of key chunk k under causal and the window
// (positions: row P sees key K when K <= P (causal), P - left <= K <= P + right). The pairs that
// fail it would give out = 0, lse = -inf (no gradient): they are not computed.
bool visible(const RingChunk& q, const RingChunk& k, const Options& o) {
  if (q.length == 0 || k.length == 0) return false;
  const int64_t p_first = q.start, p_last = q.start + q.length - 1;
  const int64_t k_first = k.start, k_last = k.start + k.length - 1;
  if (o.causal != Causal::kNone && k_first > p_last) return false;
  if (o.window.right >= 0 && k_first > p_last && k_first - p_last > o.window.right) return false;
  if (o.window.left >= 0 && p_first > k_last && p_first - k_last > o.window.left) return false;
  return true;
}

// The refusals of ring.h that need no peer, and the shard's layout. `call` names the function.
Shard local_shard(const char* call, Communicator& comm, const Inputs& in, const Options& o, const RingOptions& ring) {
  const std::string c = call;
  if (in.mask) fail(c + ": Inputs::mask is not supported (a ring has no mask of the whole sequence): give a block mask (Options::block_mask, read at absolute positions) instead");
  if (in.seqlens_k) fail(c + ": Inputs::seqlens_k is not supported (every rank's shard is N_local tokens of one sequence)");
  if (o.q_start || o.k_start) fail(c + ": Options::q_start and k_start must not be set: the layout sets each pair's positions");
  if (ring.layout != RingLayout::kContiguous && ring.layout != RingLayout::kZigzag) {
    fail(c + ": RingOptions::layout " + str(static_cast<int64_t>(ring.layout)) + " is neither kContiguous nor kZigzag");
  }
  internal::check_basic("q", in.q, 2, 4);
  internal::check_basic("k", in.k, 2, 4);
  Shard s;
  s.rank_dims = in.q.rank;
  s.n_dim = in.q.rank - 2;
  s.n_local = in.q.shape[s.n_dim];
  if (in.k.rank == in.q.rank && in.k.shape[s.n_dim] != s.n_local) {
    fail(c + ": q has shape " + in.q.shape_string() + " and k " + in.k.shape_string() +
         ": their N_local (dim " + str(int64_t{s.n_dim}) + ") must be equal (each rank holds the same tokens' queries and keys)");
  }
  s.chunks = ring_chunks(ring.layout, comm.size(), comm.rank(), s.n_local);
  s.n_total = s.n_local * comm.size();  // held: ring_chunks checked it
  s.Hq = s.rank_dims >= 3 ? in.q.shape[s.rank_dims - 3] : 1;
  if (ring.strategy != RingStrategy::kRing && ring.strategy != RingStrategy::kAllGather) {
    fail(c + ": RingOptions::strategy " + str(static_cast<int64_t>(ring.strategy)) + " is neither kRing nor kAllGather");
  }
  if (ring.strategy == RingStrategy::kAllGather) {
    if (o.dropout_p != 0) {
      fail(c + ": dropout_p=" + str(o.dropout_p) + " is not supported with RingStrategy::kAllGather (its calls compute one kv head's query heads, which dropout would number from 0): use kRing");
    }
    if (o.block_mask) fail(c + ": Options::block_mask is not supported with RingStrategy::kAllGather: use kRing");
  }
  s.docs.cu = {0, s.n_total};
  if (ring.cu_seqlens) {
    if (s.rank_dims == 4 && in.q.shape[0] != 1) {
      fail(c + ": RingOptions::cu_seqlens needs q's batch B = 1 (packed documents are one row of tokens), but q has shape " +
           in.q.shape_string());
    }
    s.docs.cu = internal::read_offsets("RingOptions::cu_seqlens", *ring.cu_seqlens, s.n_total,
                                       ("the whole sequence (W · N_local = " + str(int64_t{comm.size()}) + " · " +
                                        str(s.n_local) + ")").c_str());
    s.docs.given = true;
  }
  return s;
}

// The checks of every argument as attention() makes them, on this rank's whole shard (`check`
// calls make_problem or make_backward_problem with the inputs' first `rows` rows and options):
// without documents at the sequence's first and last positions (the block mask must cover the
// whole sequence's blocks); with documents once with the options checked against every document
// (internal::packed_options) and once as the longest document's own, at its last rows.
template <typename Check>
void check_calls(const Shard& sh, const Options& o, Check check) {
  if (!sh.docs.given) {
    for (int64_t at : {int64_t{0}, sh.n_total - sh.n_local}) check(sh.n_local, positioned(o, at, at));
    return;
  }
  const std::vector<int64_t>& cu = sh.docs.cu;
  const int64_t D = static_cast<int64_t>(cu.size()) - 1, longest = internal::longest_sequence(cu);
  check(sh.n_local, positioned(internal::packed_options(o, D, sh.Hq, longest, longest), 0, 0));
  for (int64_t d = 0; d < D; ++d) {
    if (cu[d + 1] - cu[d] != longest || longest == 0) continue;
    const int64_t rows = std::min(longest, sh.n_local);
    check(rows, positioned(internal::sequence_options(o, d, longest, longest), longest - rows, longest - rows));
    break;
  }
}

// ---- The collective check ----

struct TensorDesc {
  int32_t present = 0, dtype = 0, rank = 0, pad = 0;
  int64_t shape[4] = {0, 0, 0, 0};
};

// What every rank must agree on, compared field by field after one all-gather. Fixed size, plain
// bytes: the same struct on every rank (one library).
struct Descriptor {
  uint64_t magic = 0x676e6952617064ULL;  // "sdpaRing" (roughly), a version check
  int32_t rank = 0, world = 0, call = 0, refused = 0;
  char message[512] = {};  // refused: this rank's local Error
  TensorDesc tensors[6];   // q, k, v, out, lse, dout
  int32_t layout = 0, causal = 0, precision = 0, backend = 0, softcap_order = 0, has_scale = 0, has_seed = 0, pad = 0;
  double scale = 0, softcap = 0, dropout_p = 0;
  uint64_t seed = 0;
  int64_t window_left = 0, window_right = 0, block_q = 0, block_k = 0;
  TensorDesc slopes, sinks, block_mask;
  uint64_t slopes_hash = 0, sinks_hash = 0, block_mask_hash = 0;
  int32_t strategy = 0, has_cu = 0;
  int64_t cu_count = 0;  // RingOptions::cu_seqlens: D + 1
  uint64_t cu_hash = 0;  // of its values (as int64)
};
constexpr const char* kTensorNames[6] = {"q", "k", "v", "out", "lse", "dout"};

TensorDesc describe(const TensorView* t) {
  TensorDesc d;
  if (t == nullptr) return d;
  d.present = 1;
  d.dtype = static_cast<int32_t>(t->dtype);
  d.rank = t->rank;
  for (int i = 0; i < t->rank && i < 4; ++i) d.shape[i] = t->shape[i];
  return d;
}
std::string to_string(const TensorDesc& d) {
  if (!d.present) return "not given";
  TensorView t;
  t.rank = d.rank;
  for (int i = 0; i < d.rank && i < 4; ++i) t.shape[i] = d.shape[i];
  return "shape " + t.shape_string() + " " + dtype_name(static_cast<DType>(d.dtype));
}
bool operator==(const TensorDesc& a, const TensorDesc& b) {
  if (a.present != b.present || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int i = 0; i < a.rank && i < 4; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

// FNV-1a over the values of a float view (as float64 bits), a bool view (0 / 1) or an index
// view (as int64), in C order.
uint64_t hash_values(const std::optional<TensorView>& t) {
  uint64_t h = 1469598103934665603ULL;
  if (!t) return h;
  const auto* data = static_cast<const std::byte*>(t->data);
  const int64_t size = dtype_size(t->dtype);
  for_each_element(*t, [&](int64_t at, int64_t flat) {
    uint64_t bits;
    if (t->dtype == DType::kBool) {
      bits = std::to_integer<uint8_t>(data[at * size]) != 0;
    } else if (t->dtype == DType::kInt32 || t->dtype == DType::kInt64) {
      bits = static_cast<uint64_t>(internal::index_at(*t, flat));  // rank 1 (cu_seqlens)
    } else {
      bits = std::bit_cast<uint64_t>(internal::load_as<double>(t->dtype, data + at * size));
    }
    for (int i = 0; i < 8; ++i) h = (h ^ ((bits >> (8 * i)) & 0xff)) * 1099511628211ULL;
  });
  return h;
}

Descriptor describe_call(int call, Communicator& comm, const TensorView* tensors[6], const Options& o,
                         const RingOptions& ring) {
  Descriptor d;
  d.rank = comm.rank();
  d.world = comm.size();
  d.call = call;
  for (int i = 0; i < 6; ++i) d.tensors[i] = describe(tensors[i]);
  d.layout = static_cast<int32_t>(ring.layout);
  d.causal = static_cast<int32_t>(o.causal);
  d.precision = static_cast<int32_t>(o.precision);
  d.backend = static_cast<int32_t>(o.backend);
  d.softcap_order = static_cast<int32_t>(o.softcap_order);
  d.has_scale = o.scale.has_value();
  d.scale = o.scale.value_or(0.0);
  d.softcap = o.softcap;
  d.dropout_p = o.dropout_p;
  d.has_seed = o.seed.has_value();
  d.seed = o.seed.value_or(0);
  d.window_left = o.window.left;
  d.window_right = o.window.right;
  d.block_q = o.block_q;
  d.block_k = o.block_k;
  d.slopes = describe(o.alibi_slopes ? &*o.alibi_slopes : nullptr);
  d.sinks = describe(o.sinks ? &*o.sinks : nullptr);
  d.block_mask = describe(o.block_mask ? &*o.block_mask : nullptr);
  d.slopes_hash = hash_values(o.alibi_slopes);
  d.sinks_hash = hash_values(o.sinks);
  d.block_mask_hash = hash_values(o.block_mask);
  d.strategy = static_cast<int32_t>(ring.strategy);
  d.has_cu = ring.cu_seqlens.has_value();
  d.cu_count = ring.cu_seqlens ? ring.cu_seqlens->shape[0] : 0;
  d.cu_hash = hash_values(ring.cu_seqlens);
  return d;
}

// The first field in which rank b's descriptor differs from rank a's, as "<field>: <a's> on rank
// A, <b's> on rank B"; "" when none does.
std::string first_difference(const Descriptor& a, const Descriptor& b) {
  const std::string ra = " on rank " + str(int64_t{a.rank}), rb = " on rank " + str(int64_t{b.rank});
  const auto diff = [&](const std::string& field, const std::string& x, const std::string& y) {
    return field + ": " + x + ra + ", " + y + rb;
  };
  const auto bits = [](double x) { return std::bit_cast<uint64_t>(x); };
  if (a.world != b.world) return diff("world size", str(int64_t{a.world}), str(int64_t{b.world}));
  if (a.call != b.call) {
    const char* names[2] = {"ring_attention", "ring_attention_backward"};
    return diff("the call", names[a.call & 1], names[b.call & 1]);
  }
  for (int i = 0; i < 6; ++i) {
    if (!(a.tensors[i] == b.tensors[i])) return diff(kTensorNames[i], to_string(a.tensors[i]), to_string(b.tensors[i]));
  }
  const char* layouts[2] = {"kContiguous", "kZigzag"};
  if (a.layout != b.layout) return diff("RingOptions::layout", layouts[a.layout & 1], layouts[b.layout & 1]);
  const char* strategies[2] = {"kRing", "kAllGather"};
  if (a.strategy != b.strategy) {
    return diff("RingOptions::strategy", strategies[a.strategy & 1], strategies[b.strategy & 1]);
  }
  const auto offsets = [](const Descriptor& x) {
    return x.has_cu ? str(x.cu_count) + " offsets" : std::string("not given");
  };
  if (a.has_cu != b.has_cu || a.cu_count != b.cu_count) return diff("RingOptions::cu_seqlens", offsets(a), offsets(b));
  if (a.cu_hash != b.cu_hash) return diff("RingOptions::cu_seqlens", "one set of values", "other values");
  if (a.has_scale != b.has_scale || bits(a.scale) != bits(b.scale)) {
    return diff("scale", a.has_scale ? str(a.scale) : "default", b.has_scale ? str(b.scale) : "default");
  }
  if (a.causal != b.causal) return diff("causal", str(int64_t{a.causal}), str(int64_t{b.causal}));
  if (a.window_left != b.window_left || a.window_right != b.window_right) {
    return diff("window", "{" + str(a.window_left) + ", " + str(a.window_right) + "}",
                "{" + str(b.window_left) + ", " + str(b.window_right) + "}");
  }
  if (bits(a.softcap) != bits(b.softcap)) return diff("softcap", str(a.softcap), str(b.softcap));
  if (a.softcap_order != b.softcap_order) {
    return diff("softcap_order", str(int64_t{a.softcap_order}), str(int64_t{b.softcap_order}));
  }
  if (bits(a.dropout_p) != bits(b.dropout_p)) return diff("dropout_p", str(a.dropout_p), str(b.dropout_p));
  if (a.has_seed != b.has_seed || a.seed != b.seed) {
    return diff("seed", a.has_seed ? std::to_string(a.seed) : "not given", b.has_seed ? std::to_string(b.seed) : "not given");
  }
  if (a.precision != b.precision) return diff("precision", str(int64_t{a.precision}), str(int64_t{b.precision}));
  if (a.backend != b.backend) return diff("backend", str(int64_t{a.backend}), str(int64_t{b.backend}));
  if (a.block_q != b.block_q || a.block_k != b.block_k) {
    return diff("block_q, block_k", str(a.block_q) + ", " + str(a.block_k), str(b.block_q) + ", " + str(b.block_k));
  }
  if (!(a.slopes == b.slopes)) return diff("alibi_slopes", to_string(a.slopes), to_string(b.slopes));
  if (a.slopes_hash != b.slopes_hash) return diff("alibi_slopes", "one set of values", "other values");
  if (!(a.sinks == b.sinks)) return diff("sinks", to_string(a.sinks), to_string(b.sinks));
  if (a.sinks_hash != b.sinks_hash) return diff("sinks", "one set of values", "other values");
  if (!(a.block_mask == b.block_mask)) return diff("block_mask", to_string(a.block_mask), to_string(b.block_mask));
  if (a.block_mask_hash != b.block_mask_hash) return diff("block_mask", "one set of values", "other values");
  return "";
}

// Seconds since `t0` (RingStats).
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// Adds the seconds its scope lasts to *sum (when sum is not null).
class Timed {
 public:
  explicit Timed(double* sum) : sum_(sum), t0_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    if (sum_) *sum_ += since(t0_);
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  double* sum_;
  std::chrono::steady_clock::time_point t0_;
};

// ---- The call's messages ----

// The one owner of a ring call's message buffers and of its requests in flight (every strategy's:
// the blocks, the gradients, the all-gather of the arguments). buffer() allocates a buffer that
// lives as long as the Transfers; isend / irecv / iallgather start a request on such buffers and
// keep it as outstanding until wait() completes it. The rules (ring.h, Communicator):
// - Normal completion: the call waits every request it started (wait(); the destructor then
//   finds none outstanding).
// - A wait that ran out of time or threw (a transport Error): that request's buffers may still
//   be read or written by the transport (an MPI_Cancel that did not take, a gloo receive that
//   lands late), and so may those of every request still outstanding when the call unwinds.
// - Unwinding (the call throws): the destructor waits every outstanding request, all of them
//   within one short deadline, kUnwindSeconds (never more than the call's timeout): a request
//   whose peer is alive and matched completes at once (a send already delivered, a block on its
//   way), one whose peer stopped never will, and a full timeout per request would multiply the
//   time each rank needs to fail (and the ranks behind it wait on it). Then every buffer that a
//   request which did not complete may touch is released, deliberately leaked, never freed: a
//   transport may still write into it. The call uses the communicator for nothing else after a
//   wait failed: it throws, and the destructor's waits are its last use.
class Transfers {
 public:
  static constexpr double kUnwindSeconds = 0.25;

  Transfers(Communicator& comm, double timeout_seconds) : comm_(comm), timeout_(timeout_seconds) {}
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  ~Transfers() {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(std::min(timeout_, kUnwindSeconds));
    for (const Open& q : open_) {
      bool done = false;
      try {
        const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
        done = comm_.wait(q.id, std::max(left, 0.0));  // 0: tests once
      } catch (...) {
        done = false;  // a transport Error: the request's state is unknown
      }
      if (!done) lost_.push_back(q);
    }
    for (Buffer& b : buffers_) {
      for (const Open& q : lost_) {
        if (q.touches(b.data.get(), b.bytes)) {
#ifdef SDPA_LSAN
          __lsan_ignore_object(b.data.get());
#endif
          (void)b.data.release();  // leaked on purpose (above)
          break;
        }
      }
    }
  }

  // `bytes` bytes (uninitialized), alive until the Transfers ends (or leaked, above).
  std::byte* buffer(size_t bytes) {
    buffers_.push_back({std::make_unique_for_overwrite<std::byte[]>(std::max<size_t>(bytes, 1)), bytes});
    return buffers_.back().data.get();
  }
  Communicator::Request isend(const std::byte* data, size_t bytes, int to, int tag) {
    return started(comm_.isend(data, bytes, to, tag), {data, bytes}, {});
  }
  Communicator::Request irecv(std::byte* data, size_t bytes, int from, int tag) {
    return started(comm_.irecv(data, bytes, from, tag), {data, bytes}, {});
  }
  Communicator::Request iallgather(const std::byte* in, std::byte* out, size_t bytes) {
    return started(comm_.iallgather(in, out, bytes), {in, bytes}, {out, bytes * static_cast<size_t>(comm_.size())});
  }
  // Waits with the call's deadline: Error (naming what was awaited) when it runs out.
  void wait(Communicator::Request request, const std::string& what) {
    const auto it = std::find_if(open_.begin(), open_.end(), [&](const Open& q) { return q.id == request; });
    const Open q = *it;
    open_.erase(it);
    bool done = false;
    try {
      done = comm_.wait(request, timeout_);
    } catch (...) {
      lost_.push_back(q);
      throw;
    }
    if (!done) {
      lost_.push_back(q);
      fail(what + ": no message (a peer died, stopped or is slower than timeout_seconds)");
    }
  }
  double timeout() const { return timeout_; }

 private:
  struct Span {
    const std::byte* data = nullptr;
    size_t bytes = 0;
    bool overlaps(const std::byte* b, size_t n) const { return bytes > 0 && n > 0 && data < b + n && b < data + bytes; }
  };
  struct Open {
    Communicator::Request id;
    Span a, b;  // the buffers it reads or writes
    bool touches(const std::byte* p, size_t n) const { return a.overlaps(p, n) || b.overlaps(p, n); }
  };
  struct Buffer {
    std::unique_ptr<std::byte[]> data;
    size_t bytes;
  };
  Communicator::Request started(Communicator::Request id, Span a, Span b) {
    open_.push_back({id, a, b});
    return id;
  }
  Communicator& comm_;
  double timeout_;
  std::vector<Buffer> buffers_;
  std::vector<Open> open_;  // started, not yet waited
  std::vector<Open> lost_;  // did not complete: their buffers are leaked
};

// Runs the local checks (`check`), then the all-gather; throws the same Error on every rank when
// any rank refused its arguments or differs from rank 0. `tensors`: q, k, v, out, lse, dout (null
// where absent).
template <typename Check>
void collective_check(const char* call, int call_id, Communicator& comm, const TensorView* tensors[6],
                      const Options& o, const RingOptions& ring, Check check) {
  const Timed timed(ring.stats ? &ring.stats->check_seconds : nullptr);
  Descriptor mine;
  try {
    check();
    mine = describe_call(call_id, comm, tensors, o, ring);
  } catch (const std::exception& e) {  // an Error, or e.g. bad_alloc: refused all the same
    mine = Descriptor{};
    mine.rank = comm.rank();
    mine.world = comm.size();
    mine.call = call_id;
    mine.refused = 1;
    std::snprintf(mine.message, sizeof mine.message, "%s", e.what());
  }
  const int W = comm.size();
  std::vector<Descriptor> all(static_cast<size_t>(W));
  {
    Transfers tr(comm, ring.timeout_seconds);
    std::byte* in = tr.buffer(sizeof(Descriptor));
    std::byte* out = tr.buffer(sizeof(Descriptor) * all.size());
    std::memcpy(in, &mine, sizeof(Descriptor));
    tr.wait(tr.iallgather(in, out, sizeof(Descriptor)),
            std::string(call) + ": rank " + str(int64_t{comm.rank()}) + " waited " + str(ring.timeout_seconds) +
                " s for the all-gather of the ranks' arguments");
    std::memcpy(static_cast<void*>(all.data()), out, sizeof(Descriptor) * all.size());
  }
  for (int i = 0; i < W; ++i) {
    const Descriptor& d = all[static_cast<size_t>(i)];
    if (d.magic != Descriptor{}.magic || d.rank != i) {
      fail(std::string(call) + ": the all-gather's entry of rank " + str(int64_t{i}) +
           " is not a ring descriptor of this library (another version, or a transport that mixed up the ranks)");
    }
  }
  for (int i = 0; i < W; ++i) {
    const Descriptor& d = all[static_cast<size_t>(i)];
    if (d.refused) {
      fail(std::string(call) + ": rank " + str(int64_t{i}) + " refused its arguments: " +
           std::string(d.message, strnlen(d.message, sizeof d.message)));
    }
  }
  for (int i = 1; i < W; ++i) {
    const std::string d = first_difference(all[0], all[static_cast<size_t>(i)]);
    if (!d.empty()) {
      fail(std::string(call) + ": rank " + str(int64_t{i}) + "'s arguments differ from rank 0's (every rank must pass the same shapes, dtypes and options): " + d);
    }
  }
}

// A message exchange of one step: send `send` on to rank + 1, receive `recv` from rank - 1.
struct Exchange {
  Communicator::Request send = 0, recv = 0;
  bool posted = false;
};
Exchange post(Communicator& comm, Transfers& tr, const std::byte* send, std::byte* recv, size_t bytes, int tag,
              RingStats* st) {
  const int W = comm.size(), r = comm.rank();
  if (st) st->bytes_sent += static_cast<int64_t>(bytes);
  Exchange x;
  x.recv = tr.irecv(recv, bytes, (r + W - 1) % W, tag);
  x.send = tr.isend(send, bytes, (r + 1) % W, tag);
  x.posted = true;
  return x;
}
// Waits for both, naming `what` ("the block of rank O") and the step it is for.
void finish(Communicator& comm, Transfers& tr, Exchange& x, const char* call, const std::string& what, int step,
            RingStats* st) {
  if (!x.posted) return;
  const Timed timed(st ? &st->wait_seconds : nullptr);
  x.posted = false;
  const int W = comm.size(), r = comm.rank();
  const std::string who = std::string(call) + ": rank " + str(int64_t{r}) + " waited " + str(tr.timeout()) + " s ";
  tr.wait(x.recv, who + "for " + what + " at step " + str(int64_t{step}) + " from rank " + str(int64_t{(r + W - 1) % W}));
  tr.wait(x.send, who + "to send on " + what + " at step " + str(int64_t{step}) + " to rank " + str(int64_t{(r + 1) % W}));
}

// The K/V block of one rank, packed: k then v, C order, their dtype (in a buffer of the call's
// Transfers).
struct Block {
  std::byte* bytes = nullptr;
  size_t size = 0, k_bytes = 0;
  TensorView k(const TensorView& like) const { return contiguous_view(bytes, like.dtype, like.rank, like.shape); }
  TensorView v(const TensorView& like) const {
    return contiguous_view(bytes + k_bytes, like.dtype, like.rank, like.shape);
  }
};
Block pack_block(Transfers& tr, const TensorView& k, const TensorView& v) {
  Block b;
  b.k_bytes = static_cast<size_t>(k.numel() * dtype_size(k.dtype));
  b.size = b.k_bytes + static_cast<size_t>(v.numel() * dtype_size(v.dtype));
  b.bytes = tr.buffer(b.size);
  pack(k, b.bytes);
  pack(v, b.bytes + b.k_bytes);
  return b;
}
// A block of the same sizes, to receive into.
Block like(Transfers& tr, const Block& b) { return {tr.buffer(b.size), b.size, b.k_bytes}; }

// The ring's steps, the one loop of the forward and the backward: at step s (0 .. W - 1) `cur`
// holds the block of rank (r - s) mod W; the next block is posted (sent on to rank + 1,
// received from rank - 1) before compute(s, owner, cur) runs, which is skipped once a step's
// compute threw (the first such exception is returned, after the ring: the peers never wait
// for a rank that stopped computing); then after(s, owner, failed) (the backward's gradients),
// then the next block is waited for and becomes `cur`.
template <typename Compute, typename After>
std::exception_ptr ring_steps(Communicator& comm, Transfers& tr, Block cur, const char* call, RingStats* st,
                              Compute compute, After after) {
  const int W = comm.size(), r = comm.rank();
  Block next = like(tr, cur);
  std::exception_ptr failed;
  for (int s = 0; s < W; ++s) {
    const int owner = (r + W - s) % W;
    Exchange x;
    if (s + 1 < W) x = post(comm, tr, cur.bytes, next.bytes, cur.size, kTagBlock, st);
    if (!failed) {
      const Timed timed(st ? &st->compute_seconds : nullptr);
      try {
        compute(s, owner, static_cast<const Block&>(cur));
      } catch (...) {
        failed = std::current_exception();
      }
    }
    after(s, owner, failed);
    if (s + 1 < W) {
      finish(comm, tr, x, call, "the block of rank " + str(int64_t{(r + W - s - 1) % W}), s + 1, st);
      std::swap(cur, next);
    }
  }
  return failed;
}

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 8 ? DType::kFloat64 : DType::kFloat32;
}

// dst's rows [first, first + n) += src's rows [0, n), each a C-order (lead..., rows, D) array of T
// (dst of N rows, src of src_rows).
template <typename T>
void add_rows(T* dst, int64_t N, int64_t first, const std::vector<T>& src, int64_t n, int64_t src_rows, int64_t D) {
  if (n == 0 || D == 0) return;
  const int64_t lead = static_cast<int64_t>(src.size()) / (src_rows * D);
  for (int64_t l = 0; l < lead; ++l) {
    T* d = dst + (l * N + first) * D;
    const T* s = src.data() + l * src_rows * D;
    for (int64_t e = 0; e < n * D; ++e) d[e] += s[e];
  }
}

// ---- The pair: what both strategies compute ----

// Which query heads a pair's calls compute: all of them (kRing), or those of one kv head of one
// batch entry (kAllGather: `count` heads from `head0` of entry `b`).
struct Heads {
  bool all = true;
  int64_t b = 0, head0 = 0, count = 0;
};

struct PairSetup {
  const Docs& docs;
  const Options& o;
  int nd;      // the sequence's dim of q, k, v, out (and of lse)
  int64_t Hq;  // of the whole call
  Heads heads;
};

// One document's part of a (query chunk, key chunk) pair: rows [row, row + n) of the query
// chunk and keys [key, key + m) of the key chunk, with the options of the call.
struct Part {
  int64_t doc = 0;  // dropout's batch index (attention_varlen's: the document; 0 without documents)
  int64_t row = 0, n = 0, key = 0, m = 0;
  Options o;                // positions relative to the document's start; its slopes, block mask, heads
  bool sinks = false;       // the call counts the sinks (o.sinks is then set)
  int64_t slopes_base = 0;  // o.alibi_slopes' element i is element slopes_base + i (C order) of the whole slopes
  int64_t sinks_base = 0;   // o.sinks' element i is element sinks_base + i of the whole sinks
};

// The options of document d (of `length` tokens) for the setup's heads, into p.
void part_options(const PairSetup& ps, int64_t d, int64_t length, Part& p) {
  const Options& o = ps.o;
  p.o = ps.docs.given ? internal::sequence_options(o, d, length, length) : o;  // row d, the block mask's corner
  if (ps.heads.all) {
    if (ps.docs.given && o.alibi_slopes && o.alibi_slopes->rank == 2 && o.alibi_slopes->shape[0] != 1) {
      p.slopes_base = d * ps.Hq;
    }
    return;
  }
  if (o.alibi_slopes) {
    const TensorView& s = *o.alibi_slopes;
    int64_t row = 0;
    if (s.rank == 2 && s.shape[0] != 1) row = ps.docs.given ? d : ps.heads.b;
    if (s.rank == 2 && !ps.docs.given) p.o.alibi_slopes = internal::sequence_options(o, row, 0, 0).alibi_slopes;
    p.o.alibi_slopes = slice(*p.o.alibi_slopes, 0, ps.heads.head0, ps.heads.count);  // (Hq,) -> the heads'
    p.slopes_base = row * ps.Hq + ps.heads.head0;
  }
  if (o.sinks) {
    p.o.sinks = slice(*o.sinks, 0, ps.heads.head0, ps.heads.count);
    p.sinks_base = ps.heads.head0;
  }
}

// Calls f(part) for each document with rows in query chunk qc and keys in key chunk kc, in
// document order, when some row of it can see some key (causal, window) or it counts the sinks
// (sinks_here: each row counts them in exactly one pair, its own chunk with itself, where its
// document always has a part: the row's own position).
template <typename F>
void for_each_part(const PairSetup& ps, const RingChunk& qc, const RingChunk& kc, bool sinks_here, F f) {
  const std::vector<int64_t>& cu = ps.docs.cu;
  const int64_t q_end = qc.start + qc.length, k_end = kc.start + kc.length;
  if (qc.length == 0 || kc.length == 0) return;
  size_t d = static_cast<size_t>(std::upper_bound(cu.begin(), cu.end(), qc.start) - cu.begin());  // cu[d - 1] <= start
  for (d = d == 0 ? 0 : d - 1; d + 1 < cu.size() && cu[d] < q_end; ++d) {
    const int64_t ds = cu[d], de = cu[d + 1];
    const int64_t r0 = std::max(qc.start, ds), r1 = std::min(q_end, de);
    const int64_t k0 = std::max(kc.start, ds), k1 = std::min(k_end, de);
    if (r0 >= r1 || k0 >= k1) continue;
    const bool sinks = sinks_here && ps.o.sinks.has_value();
    if (!visible({0, r0 - ds, r1 - r0}, {0, k0 - ds, k1 - k0}, ps.o) && !sinks) continue;
    Part p;
    p.doc = static_cast<int64_t>(d);
    p.row = r0 - qc.start, p.n = r1 - r0, p.key = k0 - kc.start, p.m = k1 - k0;
    p.sinks = sinks;
    part_options(ps, p.doc, de - ds, p);
    p.o = positioned(p.o, r0 - ds, k0 - ds);
    if (!sinks) p.o.sinks.reset();
    f(p);
  }
}

// attention() and attention_backward() of a part, with its document as dropout's batch index
// (as attention_varlen runs sequence b).
void run_part(const Inputs& in, const Outputs& out, const Part& p) {
  internal::Problem problem = internal::make_problem(in, out, p.o);
  problem.dropout.batch_offset = p.doc;
  internal::run_forward(problem, p.o.backend);
}
void run_part_backward(const Inputs& in, const TensorView& out, const TensorView& lse, const TensorView& dout,
                       const Gradients& g, const Part& p) {
  internal::BackwardProblem problem = internal::make_backward_problem(in, out, lse, dout, g, p.o);
  problem.fwd.dropout.batch_offset = p.doc;
  internal::run_backward(problem, p.o.backend);
}

// The forward of a pair: q, acc_o, acc_l are query chunk qc's rows (its queries and their
// accumulator, out 0 / lse -inf at first), k and v key chunk kc's; each part's partial (in
// part_o, part_l: scratch of the compute type, at least qc.length rows) merged into its rows'
// accumulator (merge_attention, in the compute type).
void forward_pair(const PairSetup& ps, const RingChunk& qc, const RingChunk& kc, bool sinks_here, const TensorView& q,
                  const TensorView& k, const TensorView& v, const TensorView& acc_o, const TensorView& acc_l,
                  const TensorView& part_o, const TensorView& part_l) {
  const int nd = ps.nd;
  for_each_part(ps, qc, kc, sinks_here, [&](const Part& p) {
    Outputs po;
    po.out = slice(part_o, nd, 0, p.n);
    po.lse = slice(part_l, nd, 0, p.n);
    run_part(Inputs{slice(q, nd, p.row, p.n), slice(k, nd, p.key, p.m), slice(v, nd, p.key, p.m)}, po, p);
    const TensorView ao = slice(acc_o, nd, p.row, p.n), al = slice(acc_l, nd, p.row, p.n);
    const Partial parts[2] = {{ao, al}, {po.out, *po.lse}};
    merge_attention(parts, ao, al);
  });
}

// Where a pair's gradients add: a C-order (lead..., rows, D) array of T whose chunk starts at
// row `first`.
template <typename T>
struct Rows {
  T* data;
  int64_t rows, first, D;
};

// A part's gradients (scratch, compute type): dq, dk, dv of at most max_len rows, C order with
// the shapes of the pair's q, k, v (lead dims included); dalibi_slopes and dsinks in float64.
template <typename T>
struct PairGrads {
  std::vector<T> dq, dk, dv;
  TensorView dq_v, dk_v, dv_v;
  int64_t max_len = 0;
  std::vector<double> dalibi, dsinks;
  PairGrads(DType ct, std::vector<int64_t> q_shape, std::vector<int64_t> k_shape, std::vector<int64_t> v_shape, int nd,
            int64_t max_rows, size_t slopes, size_t sinks)
      : max_len(max_rows), dalibi(slopes), dsinks(sinks) {
    const size_t n = static_cast<size_t>(nd);
    q_shape[n] = k_shape[n] = v_shape[n] = max_rows;
    dq.resize(numel(q_shape)), dk.resize(numel(k_shape)), dv.resize(numel(v_shape));
    const int R = static_cast<int>(q_shape.size());
    dq_v = contiguous_view(dq.data(), ct, R, q_shape.data());
    dk_v = contiguous_view(dk.data(), ct, R, k_shape.data());
    dv_v = contiguous_view(dv.data(), ct, R, v_shape.data());
  }
};

// The backward of a pair: q, out, lse, dout are query chunk qc's rows, k and v key chunk kc's;
// each part's dq, dk, dv added to dq, dk, dv's rows, its dalibi_slopes and dsinks (when `grads`
// asks for them) to the whole ones' (float64, C order of the slopes and sinks), part by part.
template <typename T>
void backward_pair(const PairSetup& ps, const RingChunk& qc, const RingChunk& kc, bool sinks_here, const TensorView& q,
                   const TensorView& out, const TensorView& lse, const TensorView& dout, const TensorView& k,
                   const TensorView& v, const Gradients& grads, PairGrads<T>& s, Rows<T> dq, Rows<T> dk, Rows<T> dv,
                   std::vector<double>& dalibi, std::vector<double>& dsinks) {
  const int nd = ps.nd;
  for_each_part(ps, qc, kc, sinks_here, [&](const Part& p) {
    Gradients g{slice(s.dq_v, nd, 0, p.n), slice(s.dk_v, nd, 0, p.m), slice(s.dv_v, nd, 0, p.m)};
    if (grads.dalibi_slopes) {
      g.dalibi_slopes = contiguous_view(s.dalibi.data(), DType::kFloat64, p.o.alibi_slopes->rank, p.o.alibi_slopes->shape);
    }
    if (grads.dsinks && p.sinks) g.dsinks = contiguous_view(s.dsinks.data(), DType::kFloat64, 1, p.o.sinks->shape);
    run_part_backward(Inputs{slice(q, nd, p.row, p.n), slice(k, nd, p.key, p.m), slice(v, nd, p.key, p.m)},
                      slice(out, nd, p.row, p.n), slice(lse, nd, p.row, p.n), slice(dout, nd, p.row, p.n), g, p);
    add_rows(dq.data, dq.rows, dq.first + p.row, s.dq, p.n, s.max_len, dq.D);
    add_rows(dk.data, dk.rows, dk.first + p.key, s.dk, p.m, s.max_len, dk.D);
    add_rows(dv.data, dv.rows, dv.first + p.key, s.dv, p.m, s.max_len, dv.D);
    if (g.dalibi_slopes) {
      const int64_t n = g.dalibi_slopes->numel();
      for (int64_t i = 0; i < n; ++i) dalibi[static_cast<size_t>(p.slopes_base + i)] += s.dalibi[static_cast<size_t>(i)];
    }
    if (g.dsinks) {
      for (int64_t i = 0; i < g.dsinks->shape[0]; ++i) dsinks[static_cast<size_t>(p.sinks_base + i)] += s.dsinks[static_cast<size_t>(i)];
    }
  });
}

template <typename T>
void forward(Communicator& comm, const Shard& sh, const Inputs& in, const Outputs& outputs, const Options& o,
             const RingOptions& ring) {
  const int W = comm.size();
  const int nd = sh.n_dim, R = sh.rank_dims;
  const DType ct = dtype_of<T>();
  // This rank's accumulator: out 0, lse -inf, merged into pair by pair.
  const std::vector<int64_t> out_shape = with_dim(in.q, R - 1, in.v.shape[R - 1]);
  std::vector<int64_t> part_shape = out_shape;
  int64_t max_len = 0;  // a pair's partial holds the longest chunk's rows
  for (const RingChunk& c : sh.chunks) max_len = std::max(max_len, c.length);
  part_shape[static_cast<size_t>(nd)] = max_len;
  std::vector<T> acc_out(numel(out_shape), T(0)), acc_lse(numel(out_shape, 1), -std::numeric_limits<T>::infinity());
  std::vector<T> part_out(numel(part_shape)), part_lse(numel(part_shape, 1));
  const TensorView acc_o = contiguous_view(acc_out.data(), ct, R, out_shape.data());
  const TensorView acc_l = contiguous_view(acc_lse.data(), ct, R - 1, out_shape.data());
  const TensorView part_o = contiguous_view(part_out.data(), ct, R, part_shape.data());
  const TensorView part_l = contiguous_view(part_lse.data(), ct, R - 1, part_shape.data());
  const PairSetup ps{sh.docs, o, nd, sh.Hq, {}};

  Transfers tr(comm, ring.timeout_seconds);
  const std::exception_ptr failed = ring_steps(
      comm, tr, pack_block(tr, in.k, in.v), "ring_attention", ring.stats,
      [&](int s, int owner, const Block& cur) {
        const TensorView k = cur.k(in.k), v = cur.v(in.v);
        const std::vector<RingChunk> kchunks = ring_chunks(ring.layout, W, owner, sh.n_local);
        for (size_t qi = 0; qi < sh.chunks.size(); ++qi) {
          const RingChunk& qc = sh.chunks[qi];
          for (size_t ki = 0; ki < kchunks.size(); ++ki) {
            const RingChunk& kc = kchunks[ki];
            // Sinks: with the pair of the chunk with itself, once per row.
            forward_pair(ps, qc, kc, s == 0 && ki == qi, slice(in.q, nd, qc.local, qc.length),
                         slice(k, nd, kc.local, kc.length), slice(v, nd, kc.local, kc.length),
                         slice(acc_o, nd, qc.local, qc.length), slice(acc_l, nd, qc.local, qc.length), part_o, part_l);
          }
        }
      },
      [](int, int, const std::exception_ptr&) {});
  if (failed) std::rethrow_exception(failed);
  // One merge of one part: a copy rounded once to the outputs' dtypes (exact: its weight is 1).
  const Partial whole[1] = {{acc_o, acc_l}};
  merge_attention(whole, outputs.out, outputs.lse ? *outputs.lse : acc_l);
}


// An exception's message (what() of a std::exception).
std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// The backward's message of a block's gradients: dk and dv (C order, T), then the first failure
// any rank it passed met ({rank + 1, message}; 0: none), so that a rank whose part is missing
// from a sum makes every owner of such a sum throw.
struct Failure {
  int32_t rank_plus_1 = 0;
  char message[380] = {};
};

template <typename T>
struct GradBlock {
  std::byte* bytes = nullptr;  // a buffer of the call's Transfers
  size_t size = 0, dk_n = 0, dv_n = 0;
  GradBlock(Transfers& tr, size_t dk, size_t dv)
      : bytes(tr.buffer((dk + dv) * sizeof(T) + sizeof(Failure))), size((dk + dv) * sizeof(T) + sizeof(Failure)),
        dk_n(dk), dv_n(dv) {}
  T* dk() { return reinterpret_cast<T*>(bytes); }
  T* dv() { return dk() + dk_n; }
  Failure* failure() { return reinterpret_cast<Failure*>(bytes + (dk_n + dv_n) * sizeof(T)); }
  // += a rank's local contributions (T arrays of the same sizes).
  void add(const std::vector<T>& dk_local, const std::vector<T>& dv_local) {
    for (size_t i = 0; i < dk_n; ++i) dk()[i] += dk_local[i];
    for (size_t i = 0; i < dv_n; ++i) dv()[i] += dv_local[i];
  }
};

template <typename T>
void backward(Communicator& comm, const Shard& sh, const Inputs& in, const TensorView& out, const TensorView& lse,
              const TensorView& dout, const Gradients& grads, const Options& o, const RingOptions& ring) {
  const int W = comm.size(), r = comm.rank();
  const int nd = sh.n_dim, R = sh.rank_dims;
  const DType ct = dtype_of<T>();
  const int64_t Dk = in.q.shape[R - 1], Dv = in.v.shape[R - 1], N = sh.n_local;
  int64_t max_len = 0;
  for (const RingChunk& c : sh.chunks) max_len = std::max(max_len, c.length);
  const std::vector<int64_t> q_shape(in.q.shape, in.q.shape + R), k_shape(in.k.shape, in.k.shape + R),
      v_shape(in.v.shape, in.v.shape + R);
  // dq: this rank's, summed over the pairs; dk, dv: this step's block, this rank's pairs summed
  // (added to the travelling sums after the compute, then zeroed); a pair's gradients.
  std::vector<T> dq(numel(q_shape), T(0)), dk_local(numel(k_shape), T(0)), dv_local(numel(v_shape), T(0));
  // dalibi_slopes (this rank's part, summed over the pairs) and dsinks (one pair per row), float64.
  std::vector<double> dalibi(grads.dalibi_slopes ? static_cast<size_t>(o.alibi_slopes->numel()) : 0, 0.0);
  std::vector<double> dsinks(grads.dsinks ? static_cast<size_t>(sh.Hq) : 0, 0.0);
  PairGrads<T> pg(ct, q_shape, k_shape, v_shape, nd, max_len, dalibi.size(), dsinks.size());
  const PairSetup ps{sh.docs, o, nd, sh.Hq, {}};

  Transfers tr(comm, ring.timeout_seconds);
  GradBlock<T> sums(tr, dk_local.size(), dv_local.size()), incoming(tr, dk_local.size(), dv_local.size());
  Failure mine;  // this rank's, if its part failed
  Exchange gx;   // the gradients' exchange of the step before
  const std::exception_ptr failed = ring_steps(
      comm, tr, pack_block(tr, in.k, in.v), "ring_attention_backward", ring.stats,
      [&](int s, int owner, const Block& cur) {
        const TensorView k = cur.k(in.k), v = cur.v(in.v);
        const std::vector<RingChunk> kchunks = ring_chunks(ring.layout, W, owner, N);
        for (size_t qi = 0; qi < sh.chunks.size(); ++qi) {
          const RingChunk& qc = sh.chunks[qi];
          const auto rows = [&](const TensorView& t) { return slice(t, nd, qc.local, qc.length); };
          for (size_t ki = 0; ki < kchunks.size(); ++ki) {
            const RingChunk& kc = kchunks[ki];
            backward_pair(ps, qc, kc, s == 0 && ki == qi,  // sinks as in the forward
                          rows(in.q), rows(out), rows(lse), rows(dout), slice(k, nd, kc.local, kc.length),
                          slice(v, nd, kc.local, kc.length), grads, pg, Rows<T>{dq.data(), N, qc.local, Dk},
                          Rows<T>{dk_local.data(), N, kc.local, Dk}, Rows<T>{dv_local.data(), N, kc.local, Dv}, dalibi,
                          dsinks);
          }
        }
      },
      [&](int s, int owner, const std::exception_ptr& failed) {
        if (failed && mine.rank_plus_1 == 0) {
          mine.rank_plus_1 = r + 1;
          std::snprintf(mine.message, sizeof mine.message, "%s", message_of(failed).c_str());
        }
        // The block's sums: zero at its owner (step 0), else those that arrived from rank - 1;
        // plus this rank's part; then on to rank + 1 (the last hop brings them back to their
        // owner).
        if (s == 0) {
          std::memset(sums.bytes, 0, sums.size);
        } else {
          finish(comm, tr, gx, "ring_attention_backward", "the gradients of the block of rank " + str(int64_t{owner}), s,
                 ring.stats);
        }
        if (failed && sums.failure()->rank_plus_1 == 0) *sums.failure() = mine;
        sums.add(dk_local, dv_local);
        std::fill(dk_local.begin(), dk_local.end(), T(0));  // zero for the next step's block
        std::fill(dv_local.begin(), dv_local.end(), T(0));
        if (W > 1) {
          gx = post(comm, tr, sums.bytes, incoming.bytes, sums.size, kTagGradients, ring.stats);
          std::swap(sums, incoming);  // sums: the buffer receiving the next block's
        }
      });
  // The last hop: this rank's own block's sums, from rank - 1.
  finish(comm, tr, gx, "ring_attention_backward", "the gradients of its own block", W, ring.stats);
  if (failed) std::rethrow_exception(failed);
  if (const Failure* f = sums.failure(); f->rank_plus_1 != 0) {
    fail("ring_attention_backward: rank " + str(int64_t{f->rank_plus_1 - 1}) +
         " could not compute its part of this rank's dk and dv: " +
         std::string(f->message, strnlen(f->message, sizeof f->message)));
  }
  store(dq, grads.dq);
  store(std::vector<T>(sums.dk(), sums.dk() + sums.dk_n), grads.dk);
  store(std::vector<T>(sums.dv(), sums.dv() + sums.dv_n), grads.dv);
  if (grads.dalibi_slopes) store(dalibi, *grads.dalibi_slopes);
  if (grads.dsinks) store(dsinks, *grads.dsinks);
}

// What both calls check before anything else (locally: the all-gather needs a valid world and
// deadline), and their stats reset.
void start_call(const char* call, Communicator& comm, const RingOptions& ring) {
  const std::string c = call;
  if (!(ring.timeout_seconds > 0)) fail(c + ": RingOptions::timeout_seconds=" + str(ring.timeout_seconds) + " must be > 0");
  if (ring.stats) *ring.stats = RingStats{};
  const int W = comm.size();
  if (W < 1 || comm.rank() < 0 || comm.rank() >= W) {
    fail(c + ": the communicator's rank " + str(int64_t{comm.rank()}) + " and size " + str(int64_t{W}) +
         " are not a rank of a world");
  }
}

// kAllGather (the section at the end of this file).
template <typename T>
void allgather_forward(Communicator& comm, const Shard& sh, const Inputs& in, const Outputs& outputs, const Options& o,
                       const RingOptions& ring);
template <typename T>
void allgather_backward(Communicator& comm, const Shard& sh, const Inputs& in, const TensorView& out,
                        const TensorView& lse, const TensorView& dout, const Gradients& grads, const Options& o,
                        const RingOptions& ring);

}  // namespace

std::vector<RingChunk> ring_chunks(RingLayout layout, int world, int rank, int64_t n_local) {
  if (world < 1) fail("ring_chunks: world=" + str(int64_t{world}) + " must be >= 1");
  if (rank < 0 || rank >= world) {
    fail("ring_chunks: rank=" + str(int64_t{rank}) + " must lie in [0, world) = [0, " + str(int64_t{world}) + ")");
  }
  if (n_local < 0) fail("ring_chunks: N_local=" + str(n_local) + " must be >= 0");
  if (n_local > std::numeric_limits<int64_t>::max() / world) {
    fail("ring_chunks: the sequence's length world * N_local = " + str(int64_t{world}) + " * " + str(n_local) +
         " overflows int64_t");
  }
  if (layout == RingLayout::kContiguous) return {{0, rank * n_local, n_local}};
  if (layout != RingLayout::kZigzag) fail("ring_chunks: layout " + str(static_cast<int64_t>(layout)) + " is neither kContiguous nor kZigzag");
  if (n_local % 2 != 0) {
    fail("ring_chunks: kZigzag needs an even N_local (two chunks of N_local / 2 per rank), got N_local=" + str(n_local));
  }
  const int64_t h = n_local / 2;
  return {{0, rank * h, h}, {h, (2 * int64_t{world} - 1 - rank) * h, h}};
}

void ring_attention(Communicator& comm, const Inputs& inputs, const Outputs& outputs, const Options& options,
                    const RingOptions& ring) {
  start_call("ring_attention", comm, ring);
  Shard sh;
  const TensorView* tensors[6] = {&inputs.q, &inputs.k, &inputs.v, &outputs.out, outputs.lse ? &*outputs.lse : nullptr,
                                  nullptr};
  collective_check("ring_attention", 0, comm, tensors, options, ring, [&] {
    if (outputs.weights) fail("ring_attention: Outputs::weights is not supported (no rank holds a whole row's keys)");
    if (internal::any_stats(outputs.stats)) fail("ring_attention: Outputs::stats are not supported (no rank holds a whole row's keys)");
    if (outputs.scores) fail("ring_attention: Outputs::scores is not supported (no rank holds a whole row's keys)");
    sh = local_shard("ring_attention", comm, inputs, options, ring);
    check_calls(sh, options, [&](int64_t rows, const Options& o) {
      const auto first = [&](const TensorView& t) { return rows == sh.n_local ? t : slice(t, sh.n_dim, 0, rows); };
      Outputs out = outputs;
      out.out = first(outputs.out);
      if (outputs.lse) out.lse = first(*outputs.lse);
      internal::make_problem(Inputs{first(inputs.q), first(inputs.k), first(inputs.v)}, out, o);
    });
  });
  const bool f64 = internal::compute_dtype(inputs.q.dtype) == DType::kFloat64;
  if (ring.strategy == RingStrategy::kAllGather) {
    f64 ? allgather_forward<double>(comm, sh, inputs, outputs, options, ring)
        : allgather_forward<float>(comm, sh, inputs, outputs, options, ring);
  } else if (f64) {
    forward<double>(comm, sh, inputs, outputs, options, ring);
  } else {
    forward<float>(comm, sh, inputs, outputs, options, ring);
  }
}

void ring_attention_backward(Communicator& comm, const Inputs& inputs, const TensorView& out, const TensorView& lse,
                             const TensorView& dout, const Gradients& grads, const Options& options,
                             const RingOptions& ring) {
  start_call("ring_attention_backward", comm, ring);
  Shard sh;
  const TensorView* tensors[6] = {&inputs.q, &inputs.k, &inputs.v, &out, &lse, &dout};
  collective_check("ring_attention_backward", 1, comm, tensors, options, ring, [&] {
    if (grads.dbias) fail("ring_attention_backward: Gradients::dbias is not supported (the ring takes no Inputs::mask)");
    sh = local_shard("ring_attention_backward", comm, inputs, options, ring);
    // With documents dalibi_slopes is checked against the slopes as given ((D, Hq): rows are
    // documents), as attention_varlen_backward checks it; the calls below see one document's.
    Gradients g = grads;
    if (sh.docs.given && grads.dalibi_slopes) {
      internal::check_alibi_gradient(*grads.dalibi_slopes, options);
      g.dalibi_slopes.reset();
    }
    check_calls(sh, options, [&](int64_t rows, const Options& o) {
      const auto first = [&](const TensorView& t) { return rows == sh.n_local ? t : slice(t, sh.n_dim, 0, rows); };
      internal::make_backward_problem(Inputs{first(inputs.q), first(inputs.k), first(inputs.v)}, first(out),
                                      first(lse), first(dout),
                                      {first(g.dq), first(g.dk), first(g.dv), g.dsinks, std::nullopt, g.dalibi_slopes}, o);
    });
  });
  const bool f64 = internal::compute_dtype(inputs.q.dtype) == DType::kFloat64;
  if (ring.strategy == RingStrategy::kAllGather) {
    f64 ? allgather_backward<double>(comm, sh, inputs, out, lse, dout, grads, options, ring)
        : allgather_backward<float>(comm, sh, inputs, out, lse, dout, grads, options, ring);
  } else if (f64) {
    backward<double>(comm, sh, inputs, out, lse, dout, grads, options, ring);
  } else {
    backward<float>(comm, sh, inputs, out, lse, dout, grads, options, ring);
  }
}

// ---- kAllGather (ring.h's RingStrategy) ----
//
// The heads are taken one (batch entry, kv head) at a time, in C order: every rank all-gathers
// its shard of that head's k and v (one Communicator::iallgather of [k | v], N_local rows each,
// in their dtype), the next head's gather posted before the current head's compute (two heads'
// buffers). The pairs are the ring's (forward_pair / backward_pair with PairSetup::heads the kv
// head's query heads), taken in the ring's step order (the rank's own block first, then that of
// rank r - 1, r - 2, ...), so each row merges its partials, and sums its dq, in kRing's order.
// The backward's dk, dv of the head's whole sequence (W segments; segment o: rank o's rows) are
// reduced to their owners by a ring reduce-scatter: at step s = 0 .. W - 2 rank r sends segment
// (r - s - 1) mod W to rank r + 1 and receives segment (r - s - 2) mod W from rank r - 1, which
// it adds to its own part (received + own): segment o is summed over the ranks o + 1, o + 2,
// ..., o in that order and is complete at rank o after W - 1 steps. Each segment carries the
// first Failure of the ranks it passed, as the ring's travelling gradients do.
//
// Failure safety: as the ring's, through the call's Transfers (AllGatherOwner below): every
// buffer a transport touches is one of its buffers, every request is waited with the call's
// deadline, and on unwind the outstanding ones are waited briefly and their buffers leaked
// unless they completed.
namespace {

constexpr int kTagReduce = 2903;         // a segment of a head's dk, dv sums (kAllGather's backward)

// Batch entry b's heads [h0, h0 + count) of a tensor whose leading dims are q's (rank R of q:
// (B, H, ...), (H, ...) or one head); lse's too (its leading dims are q's).
TensorView heads_of(const TensorView& t, int R, int64_t b, int64_t h0, int64_t count) {
  if (R == 4) return slice(slice(t, 0, b, 1), 1, h0, count);
  if (R == 3) return slice(t, 0, h0, count);
  return t;
}
std::vector<int64_t> shape_of(const TensorView& t) { return std::vector<int64_t>(t.shape, t.shape + t.rank); }

// kAllGather's transfers: the call's Transfers (its buffers and requests, and their unwind:
// above) with the stats' bytes and waits counted.
class AllGatherOwner {
 public:
  struct Buffers {
    std::byte* send[2] = {};      // a head's [k | v] shard (head parity)
    std::byte* gathered[2] = {};  // every rank's
    std::byte* segments = nullptr;  // backward: the head's W segments
    std::byte* incoming = nullptr;  // one received segment
  };
  AllGatherOwner(Communicator& comm, double seconds, RingStats* stats) : comm_(comm), tr_(comm, seconds), stats_(stats) {}

  Buffers& buf() { return buf_; }
  std::byte* buffer(size_t bytes) { return tr_.buffer(bytes); }
  Communicator::Request allgather(const std::byte* in, std::byte* out, size_t bytes) {
    if (stats_) stats_->bytes_sent += static_cast<int64_t>(bytes) * (comm_.size() - 1);  // a ring all-gather's
    return tr_.iallgather(in, out, bytes);
  }
  Communicator::Request send(const std::byte* data, size_t bytes, int to, int tag) {
    if (stats_) stats_->bytes_sent += static_cast<int64_t>(bytes);
    return tr_.isend(data, bytes, to, tag);
  }
  Communicator::Request recv(std::byte* data, size_t bytes, int from, int tag) { return tr_.irecv(data, bytes, from, tag); }
  // Waits with the call's deadline: Error naming `what` when it runs out.
  void await(Communicator::Request q, const std::string& what) {
    const Timed timed(stats_ ? &stats_->wait_seconds : nullptr);
    tr_.wait(q, what);
  }

 private:
  Communicator& comm_;
  Transfers tr_;
  RingStats* stats_;
  Buffers buf_;
};

// The (batch entry, kv head) heads of a call and their K/V all-gathers through an owner's buffers.
struct KvGather {
  AllGatherOwner& owner;
  const Inputs& in;
  const char* call;
  double seconds;  // each wait's deadline (for the Error)
  int R, rank;
  int64_t Hkv, count;                       // kv heads per entry; heads in all (B · Hkv)
  std::vector<int64_t> k_shape, v_shape;    // one kv head's shard
  size_t k_bytes, each;                     // of one rank's [k | v]
  Communicator::Request pending = 0;

  KvGather(AllGatherOwner& o, const Inputs& inputs, const char* name, double timeout, int W, int r, int q_rank)
      : owner(o), in(inputs), call(name), seconds(timeout), R(q_rank), rank(r) {
    const int64_t B = R == 4 ? in.k.shape[0] : 1;
    Hkv = R >= 3 ? in.k.shape[R - 3] : 1;
    count = B * Hkv;
    k_shape = shape_of(heads_of(in.k, R, 0, 0, 1));
    v_shape = shape_of(heads_of(in.v, R, 0, 0, 1));
    k_bytes = numel(k_shape) * static_cast<size_t>(dtype_size(in.k.dtype));
    each = k_bytes + numel(v_shape) * static_cast<size_t>(dtype_size(in.v.dtype));
    for (int p = 0; p < 2; ++p) {
      owner.buf().send[p] = owner.buffer(each);
      owner.buf().gathered[p] = owner.buffer(each * static_cast<size_t>(W));
    }
  }
  int64_t b(int64_t i) const { return i / Hkv; }
  int64_t kv_head(int64_t i) const { return i % Hkv; }
  // Head i's shard packed and its all-gather posted.
  void post(int64_t i) {
    std::byte* s = owner.buf().send[i % 2];
    pack(heads_of(in.k, R, b(i), kv_head(i), 1), s);
    pack(heads_of(in.v, R, b(i), kv_head(i), 1), s + k_bytes);
    pending = owner.allgather(s, owner.buf().gathered[i % 2], each);
  }
  void await(int64_t i) {
    owner.await(pending, std::string(call) + ": rank " + str(int64_t{rank}) + " waited " + str(seconds) +
                             " s for the all-gather of the K/V of batch entry " +
                             str(b(i)) + ", kv head " + str(kv_head(i)) + " (head " + str(i + 1) + " of " + str(count) + ")");
  }
  // Rank o's k, v of head i (once awaited).
  TensorView k(int64_t i, int o) {
    return contiguous_view(owner.buf().gathered[i % 2] + static_cast<size_t>(o) * each, in.k.dtype, R, k_shape.data());
  }
  TensorView v(int64_t i, int o) {
    return contiguous_view(owner.buf().gathered[i % 2] + static_cast<size_t>(o) * each + k_bytes, in.v.dtype, R,
                           v_shape.data());
  }
};

}  // namespace

namespace {

template <typename T>
void allgather_forward(Communicator& comm, const Shard& sh, const Inputs& in, const Outputs& outputs, const Options& o,
                       const RingOptions& ring) {
  const int W = comm.size(), r = comm.rank();
  const int nd = sh.n_dim, R = sh.rank_dims;
  const DType ct = dtype_of<T>();
  // This rank's accumulator (all heads): out 0, lse -inf, merged into pair by pair.
  const std::vector<int64_t> out_shape = with_dim(in.q, R - 1, in.v.shape[R - 1]);
  std::vector<T> acc_out(numel(out_shape), T(0)), acc_lse(numel(out_shape, 1), -std::numeric_limits<T>::infinity());
  const TensorView acc_o = contiguous_view(acc_out.data(), ct, R, out_shape.data());
  const TensorView acc_l = contiguous_view(acc_lse.data(), ct, R - 1, out_shape.data());
  AllGatherOwner owner(comm, ring.timeout_seconds, ring.stats);
  KvGather kv(owner, in, "ring_attention", ring.timeout_seconds, W, r, R);
  const int64_t G = kv.Hkv > 0 ? sh.Hq / kv.Hkv : 0;  // query heads per kv head (no heads: none)
  // A pair's partial: one kv head's query heads, the longest chunk's rows.
  int64_t max_len = 0;
  for (const RingChunk& c : sh.chunks) max_len = std::max(max_len, c.length);
  std::vector<int64_t> part_shape = shape_of(heads_of(acc_o, R, 0, 0, G));
  part_shape[static_cast<size_t>(nd)] = max_len;
  std::vector<T> part_out(numel(part_shape)), part_lse(numel(part_shape, 1));
  const TensorView part_o = contiguous_view(part_out.data(), ct, R, part_shape.data());
  const TensorView part_l = contiguous_view(part_lse.data(), ct, R - 1, part_shape.data());

  std::exception_ptr failed;
  if (kv.count > 0) kv.post(0);
  for (int64_t i = 0; i < kv.count; ++i) {
    kv.await(i);
    if (i + 1 < kv.count) kv.post(i + 1);
    if (failed) continue;
    const Timed timed(ring.stats ? &ring.stats->compute_seconds : nullptr);
    try {
      const int64_t b = kv.b(i), h0 = kv.kv_head(i) * G;
      const PairSetup ps{sh.docs, o, nd, sh.Hq, Heads{false, b, h0, G}};
      const TensorView q = heads_of(in.q, R, b, h0, G), ao = heads_of(acc_o, R, b, h0, G), al = heads_of(acc_l, R, b, h0, G);
      for (int s = 0; s < W; ++s) {
        const int src = (r + W - s) % W;
        const TensorView k = kv.k(i, src), v = kv.v(i, src);
        const std::vector<RingChunk> kchunks = ring_chunks(ring.layout, W, src, sh.n_local);
        for (size_t qi = 0; qi < sh.chunks.size(); ++qi) {
          const RingChunk& qc = sh.chunks[qi];
          for (size_t ki = 0; ki < kchunks.size(); ++ki) {
            const RingChunk& kc = kchunks[ki];
            forward_pair(ps, qc, kc, s == 0 && ki == qi, slice(q, nd, qc.local, qc.length),
                         slice(k, nd, kc.local, kc.length), slice(v, nd, kc.local, kc.length),
                         slice(ao, nd, qc.local, qc.length), slice(al, nd, qc.local, qc.length), part_o, part_l);
          }
        }
      }
    } catch (...) {
      failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
  const Partial whole[1] = {{acc_o, acc_l}};
  merge_attention(whole, outputs.out, outputs.lse ? *outputs.lse : acc_l);
}

template <typename T>
void allgather_backward(Communicator& comm, const Shard& sh, const Inputs& in, const TensorView& out,
                        const TensorView& lse, const TensorView& dout, const Gradients& grads, const Options& o,
                        const RingOptions& ring) {
  const int W = comm.size(), r = comm.rank();
  const int nd = sh.n_dim, R = sh.rank_dims;
  const DType ct = dtype_of<T>();
  const int64_t Dk = in.q.shape[R - 1], Dv = in.v.shape[R - 1], N = sh.n_local;
  const std::vector<int64_t> q_shape = shape_of(in.q), k_shape = shape_of(in.k), v_shape = shape_of(in.v);
  // dq, dk, dv of this rank's shard (all heads); dalibi_slopes and dsinks in float64, as kRing.
  std::vector<T> dq(numel(q_shape), T(0)), dk(numel(k_shape), T(0)), dv(numel(v_shape), T(0));
  std::vector<double> dalibi(grads.dalibi_slopes ? static_cast<size_t>(o.alibi_slopes->numel()) : 0, 0.0);
  std::vector<double> dsinks(grads.dsinks ? static_cast<size_t>(sh.Hq) : 0, 0.0);
  AllGatherOwner owner(comm, ring.timeout_seconds, ring.stats);
  KvGather kv(owner, in, "ring_attention_backward", ring.timeout_seconds, W, r, R);
  const int64_t G = kv.Hkv > 0 ? sh.Hq / kv.Hkv : 0;
  int64_t max_len = 0;
  for (const RingChunk& c : sh.chunks) max_len = std::max(max_len, c.length);
  PairGrads<T> pg(ct, shape_of(heads_of(in.q, R, 0, 0, G)), kv.k_shape, kv.v_shape, nd, max_len, dalibi.size(),
                  dsinks.size());
  // The head's segments: W of [dk (N, Dk) | dv (N, Dv) | Failure], rank o's rows in segment o.
  const size_t dk_n = static_cast<size_t>(N * Dk), dv_n = static_cast<size_t>(N * Dv);
  const size_t seg_bytes = (dk_n + dv_n) * sizeof(T) + sizeof(Failure);
  owner.buf().segments = owner.buffer(seg_bytes * static_cast<size_t>(W));
  owner.buf().incoming = owner.buffer(seg_bytes);
  const auto seg = [&](int j) { return owner.buf().segments + static_cast<size_t>(j) * seg_bytes; };
  const auto seg_dk = [&](std::byte* s) { return reinterpret_cast<T*>(s); };
  const auto seg_failure = [&](std::byte* s) { return reinterpret_cast<Failure*>(s + (dk_n + dv_n) * sizeof(T)); };

  std::exception_ptr failed;
  Failure mine, reached;  // this rank's (its part failed); the first one its own segments carried
  if (kv.count > 0) kv.post(0);
  for (int64_t i = 0; i < kv.count; ++i) {
    kv.await(i);
    if (i + 1 < kv.count) kv.post(i + 1);
    std::fill(owner.buf().segments, owner.buf().segments + seg_bytes * static_cast<size_t>(W), std::byte{0});
    const int64_t b = kv.b(i), h0 = kv.kv_head(i) * G;
    if (!failed) {
      const Timed timed(ring.stats ? &ring.stats->compute_seconds : nullptr);
      try {
        const PairSetup ps{sh.docs, o, nd, sh.Hq, Heads{false, b, h0, G}};
        const auto h = [&](const TensorView& t) { return heads_of(t, R, b, h0, G); };
        const TensorView q = h(in.q), ho = h(out), hl = h(lse), hd = h(dout);
        T* dq_h = dq.data() + (b * sh.Hq + h0) * N * Dk;  // the heads' rows: C order, contiguous
        for (int s = 0; s < W; ++s) {
          const int src = (r + W - s) % W;
          const TensorView k = kv.k(i, src), v = kv.v(i, src);
          T* dk_s = seg_dk(seg(src));
          const std::vector<RingChunk> kchunks = ring_chunks(ring.layout, W, src, N);
          for (size_t qi = 0; qi < sh.chunks.size(); ++qi) {
            const RingChunk& qc = sh.chunks[qi];
            const auto rows = [&](const TensorView& t) { return slice(t, nd, qc.local, qc.length); };
            for (size_t ki = 0; ki < kchunks.size(); ++ki) {
              const RingChunk& kc = kchunks[ki];
              backward_pair(ps, qc, kc, s == 0 && ki == qi, rows(q), rows(ho), rows(hl), rows(hd),
                            slice(k, nd, kc.local, kc.length), slice(v, nd, kc.local, kc.length), grads, pg,
                            Rows<T>{dq_h, N, qc.local, Dk}, Rows<T>{dk_s, N, kc.local, Dk},
                            Rows<T>{dk_s + dk_n, N, kc.local, Dv}, dalibi, dsinks);
            }
          }
        }
      } catch (...) {
        failed = std::current_exception();
        mine.rank_plus_1 = r + 1;
        std::snprintf(mine.message, sizeof mine.message, "%s", message_of(failed).c_str());
      }
    }
    if (failed) {
      for (int j = 0; j < W; ++j) *seg_failure(seg(j)) = mine;
    }
    // The reduce-scatter of the head's segments (the next head's gather in flight meanwhile).
    std::byte* incoming = owner.buf().incoming;
    for (int s = 0; s + 1 < W; ++s) {
      const int to_send = (r + 2 * W - s - 1) % W, to_add = (r + 2 * W - s - 2) % W;
      const Communicator::Request rq = owner.recv(incoming, seg_bytes, (r + W - 1) % W, kTagReduce);
      const Communicator::Request sq = owner.send(seg(to_send), seg_bytes, (r + 1) % W, kTagReduce);
      const std::string what = "ring_attention_backward: rank " + str(int64_t{r}) + " waited " + str(ring.timeout_seconds) +
                               " s ";
      const std::string which = "the dk, dv sums of rank " + str(int64_t{to_add}) + "'s rows of batch entry " + str(b) +
                                ", kv head " + str(kv.kv_head(i)) + " at reduce step " + str(int64_t{s + 1});
      owner.await(rq, what + "for " + which + " from rank " + str(int64_t{(r + W - 1) % W}));
      owner.await(sq, what + "to send on the dk, dv sums of rank " + str(int64_t{to_send}) + "'s rows at reduce step " +
                          str(int64_t{s + 1}) + " to rank " + str(int64_t{(r + 1) % W}));
      std::byte* acc = seg(to_add);
      const T* got = seg_dk(incoming);
      T* sum = seg_dk(acc);
      for (size_t e = 0; e < dk_n + dv_n; ++e) sum[e] = got[e] + sum[e];  // received + own
      if (seg_failure(incoming)->rank_plus_1 != 0) *seg_failure(acc) = *seg_failure(incoming);
    }
    // This rank's rows of the head, complete.
    const T* own = seg_dk(seg(r));
    std::copy(own, own + dk_n, dk.begin() + static_cast<std::ptrdiff_t>(i * static_cast<int64_t>(dk_n)));
    std::copy(own + dk_n, own + dk_n + dv_n, dv.begin() + static_cast<std::ptrdiff_t>(i * static_cast<int64_t>(dv_n)));
    if (reached.rank_plus_1 == 0) reached = *seg_failure(seg(r));
  }
  if (failed) std::rethrow_exception(failed);
  if (reached.rank_plus_1 != 0) {
    fail("ring_attention_backward: rank " + str(int64_t{reached.rank_plus_1 - 1}) +
         " could not compute its part of this rank's dk and dv: " +
         std::string(reached.message, strnlen(reached.message, sizeof reached.message)));
  }
  store(dq, grads.dq);
  store(dk, grads.dk);
  store(dv, grads.dv);
  if (grads.dalibi_slopes) store(dalibi, *grads.dalibi_slopes);
  if (grads.dsinks) store(dsinks, *grads.dsinks);
}

}  // namespace

}  // namespace sdpa
