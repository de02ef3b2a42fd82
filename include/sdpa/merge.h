// sdpa: merging partial attention results (context parallelism, ring attention).
//
// Split a problem's keys into shards K_1 .. K_k (k, v and the mask's key columns sliced alike)
// and call attention() once per shard on the same queries: each call gives the partial
// (out_s, lse_s) of its keys, and the whole rows' result is
//
//   m   = max_s lse_s
//   w_s = exp(lse_s - m)
//   out = Σ_s w_s · out_s / Σ_s w_s
//   lse = m + log(Σ_s w_s)
//
// (FlashInfer's merge_state, PyTorch context parallel's merger). For 16-bit q, give each shard
// call a float32 out (Outputs::out): nothing is then rounded to 16 bits before the merge's own
// output. Sinks enter the denominator once: pass Options::sinks to exactly one shard's call
// (a shard whose keys are all blocked then has out 0 and lse = sink, which the merge weighs as
// the sink's term). Causal, window, ALiBi, a block mask and dropout depend on positions: give
// each shard call Options::q_start and k_start (sdpa/attention.h) and it is its part of the one
// call with them too. The backward of a shard: attention_backward (sdpa/attention.h) with the
// merged out and lse.
#pragma once

#include <span>

#include "sdpa/attention.h"

namespace sdpa {

// One partial result: out (..., N, Dv) and lse (..., N), as attention() writes them (for
// attention_varlen's (Hq, total_q) lse, pass its transpose: a view of shape (total_q, Hq)).
struct Partial {
  TensorView out = {};
  TensorView lse = {};
};

// Merges the partials of the same rows, in the order given, into out (..., N, Dv) and lse
// (..., N) by the formulas above.
//   - Shapes: every part's out and the output out have one shape, of rank 2 to 4; each lse has
//     that shape without its last dim. Any strides (the outputs without a stride 0 on a dim of
//     extent > 1). dtypes: lse float32 or float64; out float32, float64, bfloat16 or float16,
//     each tensor its own.
//   - Arithmetic: float64 when any of the tensors (parts' or outputs') is float64, else float32;
//     the result rounded once to each output's dtype. In order: m, then each w_s (exp in the
//     compute type), Σ_s w_s and Σ_s w_s · out_s summed over s = 0, 1, ... one after the other,
//     then one division per element. The error against exact arithmetic on the same partials is
//     at most u·M·((2 + 2/e)·k + 4) in out and u·((1 + 1/e)·k + 1 + 2·log(k) + |lse|) in lse
//     (u the compute type's unit roundoff, M the largest |out_s| of the row, k the parts of
//     weight > 0; first order; merge_test.cc derives it), plus the output's own rounding.
//   - A part whose weight is 0 (lse_s = -inf: its keys all blocked; or an exp that underflows)
//     adds exactly nothing: its out is not read (even NaN there stays out). A row whose lse are
//     all -inf gives out = +0 and lse = -inf. An lse of +inf or NaN is an Error naming the part
//     and the row (a part whose scores overflowed, or held NaN, has no finite weight to merge).
//   - In place: out may be exactly one part's out (the same data, dtype and strides), and lse
//     one part's lse; each row reads all its parts before writing it. Any other overlap of the
//     outputs with each other or with the parts is undefined.
//   - Deterministic: bitwise the same for the same partials in the same order, any thread count
//     (rows are split among set_num_threads' threads; each row's arithmetic is fixed).
//   - Throws Error, writing nothing, when parts is empty, on a rank, shape or dtype mismatch
//     (the message names the part's index and the shapes), or on +inf or NaN lse.
void merge_attention(std::span<const Partial> parts, const TensorView& out, const TensorView& lse);

}  // namespace sdpa
