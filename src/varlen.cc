// attention_varlen: sequences packed end to end (token-major, FlashAttention's layout). Each
// sequence is an ordinary attention() problem on strided views of its rows (no copy): the
// packed (total, H, D) rows of sequence b are the (H, n_b, D) view with the first two strides
// swapped. Every sequence is validated before any is computed, so an Error writes nothing.
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "kv_dequant.h"
#include "kernel_path.h"
#include "packed.h"
#include "problem.h"
#include "storage.h"

namespace sdpa {
namespace internal {

// cu_seqlens: (B + 1,) int32 or int64, starting at 0, non-decreasing, ending at `total` (the
// packed rows of `of`). Read once, into int64.
std::vector<int64_t> read_offsets(const char* name, const TensorView& t, int64_t total, const char* of) {
  if (t.rank != 1) fail(std::string(name) + " has rank " + std::to_string(t.rank) + " but must have rank 1: (B + 1,)");
  check_index_dtype(name, t);
  if (t.shape[0] < 1) fail(std::string(name) + " has shape " + t.shape_string() + " but must hold B + 1 >= 1 offsets");
  check_has_data(name, t);
  std::vector<int64_t> cu(static_cast<size_t>(t.shape[0]));
  for (int64_t b = 0; b < t.shape[0]; ++b) {
    cu[b] = index_at(t, b);
    const std::string entry = std::string(name) + "[" + std::to_string(b) + "] = " + std::to_string(cu[b]);
    if (b == 0 && cu[b] != 0) fail(entry + " but must be 0");
    if (b > 0 && cu[b] < cu[b - 1]) {
      fail(entry + " is less than " + name + "[" + std::to_string(b - 1) + "] = " + std::to_string(cu[b - 1]) +
           ": offsets must not decrease");
    }
  }
  if (cu.back() != total) {
    fail(std::string(name) + "[" + std::to_string(cu.size() - 1) + "] = " + std::to_string(cu.back()) + " but " + of +
         " has " + std::to_string(total) + " rows: the last offset is the total");
  }
  return cu;
}

int64_t longest_sequence(const std::vector<int64_t>& cu) {
  int64_t longest = 0;
  for (size_t b = 1; b < cu.size(); ++b) longest = std::max(longest, cu[b] - cu[b - 1]);
  return longest;
}

bool holds_elements(const TensorView& t) {
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[d] <= 0) return false;
  return true;
}

// Rows [r0, r1) of a packed (total, H, D) tensor as a (H, r1 - r0, D) view.
TensorView rows_of(const TensorView& t, int64_t r0, int64_t r1) {
  TensorView v = t;
  v.shape[0] = t.shape[1];
  v.shape[1] = r1 - r0;
  v.strides[0] = t.strides[1];
  v.strides[1] = t.strides[0];
  // A view without elements keeps t's pointer: it is never read, and its data may be null and
  // its strides anything (the header allows both), so no arithmetic on them (F12).
  if (holds_elements(v)) v.data = static_cast<char*>(t.data) + r0 * t.strides[0] * storage_bytes(t.dtype);
  return v;
}

// Columns [r0, r1) of lse (H, total_q).
TensorView cols_of(const TensorView& t, int64_t r0, int64_t r1) {
  TensorView v = t;
  v.shape[1] = r1 - r0;
  if (holds_elements(v)) v.data = static_cast<char*>(t.data) + r0 * t.strides[1] * storage_bytes(t.dtype);
  return v;
}

Options packed_options(const Options& options, int64_t sequences, int64_t Hq, int64_t max_q, int64_t max_k) {
  Options o = options;
  if (options.block_mask) {
    checked_block_mask(*options.block_mask, options, 4, sequences, Hq, max_q, max_k, "the longest sequence's ");
    o.block_mask.reset();  // all rows as one sequence: not its geometry
  }
  if (!options.alibi_slopes || options.alibi_slopes->rank != 2) return o;
  const TensorView& t = *options.alibi_slopes;
  if (t.shape[0] != 1 && t.shape[0] != sequences) {
    fail("alibi_slopes has shape " + t.shape_string() + " but must be (Hq,) or (B, Hq) with B = " +
         std::to_string(sequences) + " sequences");
  }
  if (sequences == 0) {
    o.alibi_slopes.reset();  // no sequence reads a slope
    return o;
  }
  return sequence_options(o, 0, 0, 0);  // row 0 stands for all: the check is of shapes and dtypes
}

Options sequence_options(const Options& options, int64_t b, int64_t nq, int64_t nk) {
  Options o = options;
  // Row b of a (B, ...) view whose first dim is B (not a broadcast 1), without its first dim.
  const auto row = [b](TensorView t) {
    if (t.shape[0] != 1 && t.data != nullptr && t.numel() > 0) {
      t.data = static_cast<char*>(t.data) + b * t.strides[0] * storage_bytes(t.dtype);
    }
    for (int d = 1; d < t.rank; ++d) t.shape[d - 1] = t.shape[d], t.strides[d - 1] = t.strides[d];
    --t.rank;
    return t;
  };
  if (options.alibi_slopes && options.alibi_slopes->rank == 2) {
    TensorView t = row(*options.alibi_slopes);  // (Hq,)
    o.alibi_slopes = t;
  }
  if (options.block_mask) {
    TensorView t = *options.block_mask;
    if (t.rank == 4) t = row(t);  // (Hq or 1, QB, KB)
    t.shape[t.rank - 2] = ceil_blocks(nq, options.block_q);  // the top-left corner, same strides
    t.shape[t.rank - 1] = ceil_blocks(nk, options.block_k);
    o.block_mask = t;
  }
  return o;
}

namespace {

struct Packed {
  std::vector<int64_t> cu_q, cu_k;
  int64_t sequences() const { return static_cast<int64_t>(cu_q.size()) - 1; }
  // All rows as one sequence: for the checks that do not depend on the cut.
  Inputs whole(const VarlenInputs& in) const {
    return {rows_of(in.q, 0, in.q.shape[0]), rows_of(in.k, 0, in.k.shape[0]), rows_of(in.v, 0, in.v.shape[0]),
            std::nullopt, std::nullopt};
  }
  // The options checked against all sequences, for the check of all rows as one sequence
  // (packed_options), and sequence b's own.
  Options options(const Options& o, const VarlenInputs& in) const {
    return packed_options(o, sequences(), in.q.shape[1], longest_sequence(cu_q), longest_sequence(cu_k));
  }
  Options options(const Options& o, int64_t b) const {
    return sequence_options(o, b, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]);
  }
  // Sequence b's own inputs (its q, k, v rows), as attention() takes them.
  Inputs inputs(const VarlenInputs& in, int64_t b) const {
    Inputs s;
    s.q = rows_of(in.q, cu_q[b], cu_q[b + 1]);
    s.k = rows_of(in.k, cu_k[b], cu_k[b + 1]);
    s.v = rows_of(in.v, cu_k[b], cu_k[b + 1]);
    return s;
  }
};

Packed read_packed(const VarlenInputs& in, const TensorView& out, const std::optional<TensorView>& lse) {
  check_rank("q", in.q, 3, "(total_q, Hq, Dk)");
  check_rank("k", in.k, 3, "(total_k, Hkv, Dk)");
  check_rank("v", in.v, 3, "(total_k, Hkv, Dv)");
  check_rank("out", out, 3, "(total_q, Hq, Dv)");
  if (lse) check_rank("lse", *lse, 2, "(Hq, total_q)");
  Packed p{read_offsets("cu_seqlens_q", in.cu_seqlens_q, in.q.shape[0], "q"),
           read_offsets("cu_seqlens_k", in.cu_seqlens_k, in.k.shape[0], "k")};
  if (p.cu_q.size() != p.cu_k.size()) {
    fail("cu_seqlens_q has shape " + in.cu_seqlens_q.shape_string() + " but cu_seqlens_k has shape " +
         in.cu_seqlens_k.shape_string() + ": both hold B + 1 offsets");
  }
  // Shapes beyond the row counts, checked once on the whole tensors (attention() checks each
  // sequence's views again, in the terms of its own shapes).
  if (out.shape[0] != in.q.shape[0] || out.shape[1] != in.q.shape[1] || out.shape[2] != in.v.shape[2]) {
    fail("out has shape " + out.shape_string() + " but must be (total_q, Hq, Dv) = (" + std::to_string(in.q.shape[0]) +
         ", " + std::to_string(in.q.shape[1]) + ", " + std::to_string(in.v.shape[2]) + ")");
  }
  if (lse) check_packed_lse(*lse, in.q);
  return p;
}

// The sequences' backward passes. Each pass's results do not depend on its thread count, so
// the sequences with at most a thread's share of the work run side by side, one thread each,
// largest first; the larger ones then run one after another on all threads. A long sequence
// beside 100x shorter ones thus gets every thread, and many short ones keep every thread busy.
void run_backward_sequences(const std::vector<BackwardProblem>& problems, Backend backend) {
  const auto work = [](const BackwardProblem& bp) {
    const Problem& p = bp.fwd;
    return static_cast<double>(p.B * p.Hq * p.Nq) * static_cast<double>(p.Nk) * static_cast<double>(p.Dk + p.Dv);
  };
  double total = 0;
  for (const BackwardProblem& bp : problems) total += work(bp);
  const int threads = num_threads();
  std::vector<const BackwardProblem*> small, large;
  for (const BackwardProblem& bp : problems) (threads > 1 && work(bp) * threads <= total ? small : large).push_back(&bp);
  if (small.size() == 1) large.insert(large.begin(), small.front()), small.clear();  // nothing to run beside it
  std::stable_sort(small.begin(), small.end(),
                   [&](const BackwardProblem* a, const BackwardProblem* b) { return work(*a) > work(*b); });
  KernelPath path = KernelPath::kSimd;  // the best path any pass took, for last_kernel_path()
  const int64_t n = static_cast<int64_t>(small.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    const ScopedThreadCount one(1);
    note_kernel_path(KernelPath::kSimd);  // a pass that notes no path must not report a stale one (F20)
    run_backward(*small[static_cast<size_t>(i)], backend);
#pragma omp critical(sdpa_varlen_path)
    path = std::max(path, last_kernel_path());
  }
  for (const BackwardProblem* bp : large) {
    note_kernel_path(KernelPath::kSimd);
    run_backward(*bp, backend);
    path = std::max(path, last_kernel_path());
  }
  note_kernel_path(path);
}

}  // namespace
}  // namespace internal

void attention_varlen(const VarlenInputs& inputs_given, const VarlenOutputs& outputs_given, const Options& options) {
  internal::check_no_positions(options, "attention_varlen");
  internal::note_kernel_path(KernelPath::kSimd);
  // 8-bit K/V (kv_dequant.h; every packed row is read): read in place by the kernels where the
  // scale groups allow (fused: each sequence's k, v, scales and zero points are its rows of
  // them), else the float32 call standing in for this one.
  VarlenInputs inputs = inputs_given;
  VarlenOutputs outputs = outputs_given;
  internal::Float32Call f32;
  const bool quantised = f32.prepare(inputs.q, inputs.k, inputs.v, inputs.kv_quant, nullptr, outputs.out, "k", "v",
                                     [](const int64_t*) { return true; }, /*fusable=*/true);
  const bool fused = quantised && f32.fused();
  VarlenInputs checked = inputs;  // fused: the 8-bit k and v checked as float32 views of their shapes
  if (fused) {
    checked.k.dtype = checked.v.dtype = DType::kFloat32;
    checked.kv_quant.reset();
  }
  const internal::Packed pk = internal::read_packed(checked, outputs.out, outputs.lse);
  // dtypes, heads, dims and strides checked once on the whole tensors (also when B = 0).
  internal::make_problem(pk.whole(checked), {internal::rows_of(outputs.out, 0, outputs.out.shape[0]),
                                             std::nullopt, outputs.lse},
                         pk.options(options, checked));
  std::vector<internal::Problem> problems;
  problems.reserve(static_cast<size_t>(pk.sequences()));
  for (int64_t b = 0; b < pk.sequences(); ++b) {  // every sequence valid before any is computed
    Outputs o;
    o.out = internal::rows_of(outputs.out, pk.cu_q[b], pk.cu_q[b + 1]);
    if (outputs.lse) o.lse = internal::cols_of(*outputs.lse, pk.cu_q[b], pk.cu_q[b + 1]);
    Inputs in = pk.inputs(inputs, b);
    if (fused) {
      const KVQuant& kq = *inputs.kv_quant;
      const auto rows = [&](const TensorView& t) { return internal::rows_of(t, pk.cu_k[b], pk.cu_k[b + 1]); };
      in.kv_quant = KVQuant{rows(kq.k_scale), rows(kq.v_scale), std::nullopt, std::nullopt};
      if (kq.k_zero) in.kv_quant->k_zero = rows(*kq.k_zero);
      if (kq.v_zero) in.kv_quant->v_zero = rows(*kq.v_zero);
      problems.push_back(internal::make_fused_problem(f32, in, o, pk.options(options, b)));
    } else {
      problems.push_back(internal::make_problem(in, o, pk.options(options, b)));
    }
    problems.back().dropout.batch_offset = b;
  }
  internal::run_forward_many(problems, options.backend);
  if (quantised) f32.finish();
}

void attention_varlen_backward(const VarlenInputs& inputs, const TensorView& out, const TensorView& lse,
                               const TensorView& dout, const Gradients& grads, const Options& options) {
  internal::check_no_positions(options, "attention_varlen_backward");
  internal::note_kernel_path(KernelPath::kSimd);
  if (inputs.kv_quant || internal::is_8bit_dtype(inputs.k.dtype)) {
    internal::fail(std::string("k has dtype ") + dtype_name(inputs.k.dtype) + " (shape " + inputs.k.shape_string() +
                   ")" + (inputs.kv_quant ? " and kv_quant is given" : "") +
                   ": 8-bit k and v are forward only; attention_varlen_backward refuses them");
  }
  const internal::Packed pk = internal::read_packed(inputs, out, lse);
  internal::check_rank("dout", dout, 3, "(total_q, Hq, Dv)");
  internal::check_rank("dq", grads.dq, 3, "(total_q, Hq, Dk)");
  internal::check_rank("dk", grads.dk, 3, "(total_k, Hkv, Dk)");
  internal::check_rank("dv", grads.dv, 3, "(total_k, Hkv, Dv)");
  for (const auto& [name, t, like] : {std::tuple{"dout", &dout, &out}, std::tuple{"dq", &grads.dq, &inputs.q},
                                      std::tuple{"dk", &grads.dk, &inputs.k}, std::tuple{"dv", &grads.dv, &inputs.v}}) {
    if (t->shape[0] != like->shape[0]) {
      internal::fail(std::string(name) + " has shape " + t->shape_string() + " but must have " +
                     std::to_string(like->shape[0]) + " rows, as " +
                     (t == &dout ? "out" : "the tensor it is the gradient of"));
    }
  }
  // dalibi_slopes against the slopes as given ((B, Hq) rows are sequences); the check of all rows
  // as one sequence below sees row 0's slopes, so it is not given there.
  if (grads.dalibi_slopes) internal::check_alibi_gradient(*grads.dalibi_slopes, options);
  const int64_t total_q = inputs.q.shape[0];
  internal::make_backward_problem(pk.whole(inputs), internal::rows_of(out, 0, total_q), lse,
                                  internal::rows_of(dout, 0, total_q),
                                  {internal::rows_of(grads.dq, 0, total_q),
                                   internal::rows_of(grads.dk, 0, grads.dk.shape[0]),
                                   internal::rows_of(grads.dv, 0, grads.dv.shape[0]), grads.dsinks},
                                  pk.options(options, inputs));
  // dsinks and dalibi_slopes: each sequence's own (Hq,) row of float64 scratch, summed in
  // sequence order below (dalibi_slopes of (B, Hq) slopes: copied, row b from sequence b).
  const int64_t Hq = inputs.q.shape[1];
  std::vector<double> seq_dsinks(grads.dsinks ? static_cast<size_t>(pk.sequences() * Hq) : 0);
  std::vector<double> seq_dalibi(grads.dalibi_slopes ? static_cast<size_t>(pk.sequences() * Hq) : 0);
  std::vector<internal::BackwardProblem> problems;
  problems.reserve(static_cast<size_t>(pk.sequences()));
  for (int64_t b = 0; b < pk.sequences(); ++b) {
    const int64_t q0 = pk.cu_q[b], q1 = pk.cu_q[b + 1], k0 = pk.cu_k[b], k1 = pk.cu_k[b + 1];
    Gradients g{internal::rows_of(grads.dq, q0, q1), internal::rows_of(grads.dk, k0, k1),
                internal::rows_of(grads.dv, k0, k1)};
    if (grads.dsinks) g.dsinks = TensorView::contiguous(seq_dsinks.data() + b * Hq, DType::kFloat64, {Hq});
    if (grads.dalibi_slopes) g.dalibi_slopes = TensorView::contiguous(seq_dalibi.data() + b * Hq, DType::kFloat64, {Hq});
    problems.push_back(internal::make_backward_problem(pk.inputs(inputs, b), internal::rows_of(out, q0, q1),
                                                       internal::cols_of(lse, q0, q1), internal::rows_of(dout, q0, q1), g,
                                                       pk.options(options, b)));
    problems.back().fwd.dropout.batch_offset = b;
  }
  internal::run_backward_sequences(problems, options.backend);
  if (grads.dsinks) {
    for (int64_t h = 0; h < Hq; ++h) {
      double sum = 0;
      for (int64_t b = 0; b < pk.sequences(); ++b) sum += seq_dsinks[static_cast<size_t>(b * Hq + h)];
      const TensorView& d = *grads.dsinks;
      internal::store_as(d.dtype, static_cast<char*>(d.data) + h * d.strides[0] * internal::storage_bytes(d.dtype), sum);
    }
  }
  if (grads.dalibi_slopes) {
    const TensorView& d = *grads.dalibi_slopes;  // (Hq,), (1, Hq) or (B, Hq), checked above
    const bool per_sequence = d.rank == 2 && d.shape[0] == pk.sequences() && pk.sequences() != 1;
    for (int64_t r = 0; r < (d.rank == 2 ? d.shape[0] : 1); ++r)
      for (int64_t h = 0; h < d.shape[d.rank - 1]; ++h) {  // Hq, unless no sequence read the slopes
        double sum = 0;
        for (int64_t b = per_sequence ? r : 0; b < (per_sequence ? r + 1 : pk.sequences()); ++b) {
          sum += seq_dalibi[static_cast<size_t>(b * Hq + h)];
        }
        const int64_t at = (d.rank == 2 ? r * d.strides[0] : 0) + h * d.strides[d.rank - 1];
        internal::store_as(d.dtype, static_cast<char*>(d.data) + at * internal::storage_bytes(d.dtype), sum);
      }
  }
}

}  // namespace sdpa
