// The materialising kernels: a float64 oracle and its same-precision twin.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "problem.h"

namespace sdpa::internal {

// Computes every row's scores, a stable softmax and the weighted sum of values (and
// Outputs::stats from the row's weights, by their definitions), accumulating in Acc. Acc = double is the reference every fast kernel is tested against; Acc = the inputs'
// dtype is the "naive implementation" whose error sets test tolerances. Deliberately simple.
template <typename Acc>
void materialized_attention(const Problem& p);

// Row i of head h: prob[j] = softmax_j(scale · q_i·k_j + bias_ij) over the keys causal and
// the window allow (prob has Nk entries); returns the row's lse (-inf: no allowed key, and
// prob is all zero). Shared by the forward and backward references. scores (Nk entries, or
// null): the row's scores, -inf where blocked.
template <typename Acc>
Acc softmax_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* prob, Acc* scores = nullptr);

// One row of the same algorithm: softmax_row, then out_row[d] = Σ_j w_ij · z_ij · v_j[d] over
// the keys whose weight (after dropout z) is not 0; returns the row's lse. Also the fused
// kernel's exact fallback for a row whose output came out non-finite (Out = its dtype).
template <typename Acc, typename Out>
Acc attend_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* prob, Out* out_row, Acc* scores = nullptr);

// Row i's scores s[0, Nk) of head h at `stage` (Outputs::scores), in Acc with the ends of the
// compute type's range (as softmax_row, which takes kFinal's); -inf where the stage blocks a key.
template <typename Acc>
void score_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* s, ScoresStage stage = ScoresStage::kFinal);
// Outputs::scores of every row (any backend: float64 for kReference, else the compute type).
template <typename Acc>
void write_scores(const Problem& p);

// lse of every row when the scores are the biases alone (Problem::scores_are_biases_only):
// log of the number of allowed keys plus the bias when the mask is constant along the keys
// (so Nk may be huge and hold no element), a pass over the mask row otherwise. Every backend.
void lse_of_biases(const Problem& p);
// Outputs::stats (pooled_weights too) of every row in the same case when the biases are also
// constant along the keys (Problem::biases_constant_along_keys): a row's n allowed keys share
// one score, so each weighs w (write_row_stats' arithmetic, as the kernels end a row), argmax and
// top-k are its first keys, and a run of c of them pools c·w, rounded once. Work per row is
// O(topk + G), not O(Nk). T: the stats' type (float64 for kReference and float64 inputs).
template <typename T>
void stats_of_constant_rows(const Problem& p);

// The backward pass the same way (reference_backward.cc): recomputes each row's softmax,
// accumulates dq, dk, dv in Acc.
template <typename Acc>
void materialized_backward(const BackwardProblem& bp);

// One query row of it: dq (Dk entries) of row (b, h, i), its contributions added to dk
// (Nk × Dk) and dv (Nk × Dv) of the row's kv head, and the row's ∂loss/∂bias (Nk entries),
// each unless null; prob is Nk scratch. Keys of weight 0 (and the value rows of dropped keys)
// add nothing. Returns the row's {lse, D} in Acc (lse recomputed, D = dout · out): what
// store_sink_gradients reads of it.
template <typename Acc>
std::pair<Acc, Acc> backward_row(const BackwardProblem& bp, int64_t b, int64_t h, int64_t i, Acc* prob, Acc* dq,
                                 Acc* dk, Acc* dv, Acc* dbias);

// dbias and dalibi_slopes (BackwardProblem::dbias and dalibi, the header's formulas), one pass
// over the score rows that computes each row's ds once for both (bias_grad.cc): each element of
// the mask's shape sums the rows (b, h, i) that read it in that order, from backward_row in Acc,
// summed in float64, in parallel over the mask's rows (over the scores' rows without dbias).
// Every backend's: Acc = double is the oracle, Acc = float the float32 compute type's.
template <typename Acc>
void bias_gradients(const BackwardProblem& bp);
// The rows that pass walks, (rows0, rows1, rows2, width): dbias' shape (1 where the mask
// broadcasts; width its last dim) when dbias is asked for, else the scores' (B, Hq, Nq) with
// width 0 (no dbias column). The readers of a row (readers() along each dim) cover each score
// row (b, h, i) exactly once either way.
struct GradRows {
  int64_t shape[4];
  int64_t count() const { return shape[0] * shape[1] * shape[2]; }
};
GradRows grad_rows(const BackwardProblem& bp);
// dalibi's per-row terms, (B, Hq, Nq) in C order, float64, zeros: the pass writes row (b, h, i)'s
// Σ_j ds_j · |i' - j| (alibi_row_term) there. Empty when dalibi is not asked for or Dv = 0 (the
// gradient is 0: the pass need not run for it).
std::vector<double> alibi_rows(const BackwardProblem& bp);
// Row (b, h, i)'s term from its ds over keys [begin, begin + n) (ds[0] is key begin's), in key
// order, in float64.
template <typename T>
double alibi_row_term(const Problem& p, int64_t b, int64_t i, const T* ds, int64_t begin, int64_t n);
// dalibi[s, h] = -Σ_b Σ_i rows[b, h, i] over the batches b that read slope row s, in (b, i) order.
void store_alibi_gradients(const BackwardProblem& bp, const std::vector<double>& rows);
// The scores' index range [first, last) along one dim (of full extent n) that reads index m of
// a mask dim of the given extent: all n where the mask broadcasts (extent 1), else m alone.
inline std::pair<int64_t, int64_t> readers(int64_t m, int64_t extent, int64_t n) {
  return extent == 1 ? std::pair<int64_t, int64_t>{0, n} : std::pair<int64_t, int64_t>{m, m + 1};
}
// The same sums for kAuto / kFlash in the compute type T: p from the given lse, K and V of a kv
// head converted once per chunk of mask rows.
template <typename T>
void fast_bias_gradients(const BackwardProblem& bp);

// dsinks (BackwardProblem::dsinks; the header's formula) from each row's lse and D = dout · out,
// row(b, h, i) giving {lse, D} in Acc: dsink_h = -Σ_b Σ_i exp(sink_h - lse) · D in (b, i) order,
// in Acc, a row with lse = -inf (no allowed key) adding nothing. The fused backward gives it its
// rows' lse and D (D in the compute type), sink_gradients those below, both in float64; the
// materialising backward its recomputed rows in its own Acc (kNaive's float32 sums in float32).
template <typename Acc = double, typename Row>
void store_sink_gradients(const BackwardProblem& bp, const Row& row) {
  const Problem& p = bp.fwd;
  for (int64_t h = 0; h < p.Hq; ++h) {
    Acc sum = 0;
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t i = 0; i < p.Nq; ++i) {
        const auto [lse, D] = row(b, h, i);
        if (lse == -std::numeric_limits<Acc>::infinity()) continue;
        sum -= std::exp(p.sink<Acc>(h) - lse) * D;
      }
    bp.dsinks->store(0, 0, 0, h, sum);
  }
}
// store_sink_gradients from the given lse, out and dout, D in float64: for calls whose kernels
// have nothing else to write.
void sink_gradients(const BackwardProblem& bp);

}  // namespace sdpa::internal
