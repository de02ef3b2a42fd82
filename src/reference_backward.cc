// The materialising backward pass: a float64 oracle (Acc = double) and its same-precision
// twin (Acc = the inputs' dtype), deliberately simple. Per query row i of head h:
//   p_ij  = softmax_j(s_ij), recomputed from scratch (not from the given lse)
//   z_ij  = the dropout factor (1 without dropout)
//   dv_j += z_ij p_ij · dout_i                 dp_ij = z_ij · dout_i · v_j  (0 where z_ij = 0)
//   D_i   = dout_i · out_i   (out as given)    ds_ij = p_ij · (dp_ij - D_i) · c_ij
//   dq_i  = scale · Σ_j ds_ij k_j              dk_j += scale · ds_ij q_i
//   dbias_ij = p_ij · (dp_ij - D_i) · (c_ij under SoftcapOrder::kAfterBias, else 1)
// with c_ij = ∂s_ij/∂x_ij, the softcap's 1 - tanh² (1 without it; Problem::score_slope). dk
// and dv of a kv head sum over the query heads of its group. With sinks,
//   dsink_h = -Σ_b Σ_i exp(sink_h - lse_bhi) · D_bhi   (lse recomputed with the sink).
// With positions (Options::q_start, k_start) the call holds one shard of each row's keys, whose
// softmax is not the row's: p_ij = exp(s_ij - lse_i) from the given lse (the whole row's, as the
// fused kernel takes it), and dsink from it too.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "reference.h"

namespace sdpa::internal {

// A positioned row's probabilities p_j = exp(s_j - lse) from the given lse (0 where s_j is -inf,
// and everywhere in a row with lse = -inf: it has no key in any shard); returns that lse.
template <typename Acc>
Acc given_lse_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* prob) {
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  score_row(p, b, h, i, prob);
  const Acc lse = p.lse->load<Acc>(b, h, i, 0);
  for (int64_t j = 0; j < p.Nk; ++j) prob[j] = prob[j] == neg_inf || lse == neg_inf ? Acc(0) : std::exp(prob[j] - lse);
  return lse;
}

template <typename Acc>
std::pair<Acc, Acc> backward_row(const BackwardProblem& bp, int64_t b, int64_t h, int64_t i, Acc* prob, Acc* dq,
                                 Acc* dk, Acc* dv, Acc* dbias) {
  const Problem& p = bp.fwd;
  const Acc scale = static_cast<Acc>(p.scale);
  const int64_t kvh = h / p.group;
  // Recomputed, not taken from the given lse (but for a positioned shard of the row's keys).
  const Acc lse = p.positioned ? given_lse_row(p, b, h, i, prob) : softmax_row(p, b, h, i, prob);
  const bool rounds = !std::is_same_v<Acc, double> && p.round_p;
  Acc D = 0;
  for (int64_t e = 0; e < p.Dv; ++e) D += bp.dout.load<Acc>(b, h, i, e) * p.out.load<Acc>(b, h, i, e);
  if (dq) std::fill(dq, dq + p.Dk, Acc(0));
  if (dbias) std::fill(dbias, dbias + p.Nk, Acc(0));
  for (int64_t j = 0; j < p.Nk; ++j) {
    if (prob[j] == 0) continue;  // blocked keys get no gradient and give none
    const Acc z = p.dropout.factor<Acc>(b, h, i, j);  // 0, or 1 / (1 - dropout_p)
    // Options::precision kFast (the naive twin, Acc = float): p and ds are rounded to q's 16-bit
    // type before the products that use them (dv's p, dq's and dk's ds), as the fused kernel does.
    const Acc pv = rounds ? static_cast<Acc>(rounded_to_16bit(p.dtype, static_cast<float>(prob[j]))) : prob[j];
    Acc dp = 0;
    for (int64_t e = 0; e < p.Dv; ++e) {
      const Acc g = bp.dout.load<Acc>(b, h, i, e);
      if (dv) dv[j * p.Dv + e] += z * pv * g;
      dp += g * p.v.load<Acc>(b, kvh, j, e);
    }
    Acc slope = 1;  // the softcap's ∂s/∂x, from the scaled dot product x as the forward formed it
    if (p.softcap != 0) {
      Acc x = 0;
      for (int64_t d = 0; d < p.Dk; ++d) x += p.q.load<Acc>(b, h, i, d) * scale * p.k.load<Acc>(b, kvh, j, d);
      slope = p.score_slope(x, b, h, i, j);
    }
    const Acc dscore = grad_ds(prob[j], z, dp, D);  // ∂loss/∂s; a dropped key's v (even NaN) adds nothing
    if (dbias) dbias[j] = p.cap_after_bias ? dscore * slope : dscore;  // the bias is inside the cap, or after it
    const Acc ds = (rounds ? static_cast<Acc>(rounded_to_16bit(p.dtype, static_cast<float>(dscore * slope)))
                           : dscore * slope) * scale;
    for (int64_t d = 0; d < p.Dk; ++d) {
      if (dq) dq[d] += ds * p.k.load<Acc>(b, kvh, j, d);
      if (dk) dk[j * p.Dk + d] += ds * p.q.load<Acc>(b, h, i, d);
    }
  }
  return {lse, D};
}

template <typename Acc>
void materialized_backward(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  std::vector<Acc> dk(static_cast<size_t>(p.Nk * p.Dk)), dv(static_cast<size_t>(p.Nk * p.Dv));
  std::vector<Acc> prob(static_cast<size_t>(p.Nk)), dq(static_cast<size_t>(p.Dk));
  // Each row's {lse, D}, (B, Hq, Nq) in C order, for dsinks (store_sink_gradients).
  std::vector<std::pair<Acc, Acc>> rows(bp.dsinks ? static_cast<size_t>(p.B * p.Hq * p.Nq) : 0);
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
      std::fill(dk.begin(), dk.end(), Acc(0));
      std::fill(dv.begin(), dv.end(), Acc(0));
      for (int64_t h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
        for (int64_t i = 0; i < p.Nq; ++i) {
          const auto row =
              backward_row(bp, b, h, i, prob.data(), dq.data(), dk.data(), dv.data(), static_cast<Acc*>(nullptr));
          if (bp.dsinks) rows[static_cast<size_t>((b * p.Hq + h) * p.Nq + i)] = row;
          for (int64_t d = 0; d < p.Dk; ++d) bp.dq.store(b, h, i, d, dq[d]);
        }
      }
      for (int64_t j = 0; j < p.Nk; ++j) {
        for (int64_t d = 0; d < p.Dk; ++d) bp.dk.store(b, kvh, j, d, dk[j * p.Dk + d]);
        for (int64_t e = 0; e < p.Dv; ++e) bp.dv.store(b, kvh, j, e, dv[j * p.Dv + e]);
      }
    }
  }
  if (bp.dsinks) {
    store_sink_gradients<Acc>(
        bp, [&](int64_t b, int64_t h, int64_t i) { return rows[static_cast<size_t>((b * p.Hq + h) * p.Nq + i)]; });
  }
}

void sink_gradients(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  store_sink_gradients(bp, [&](int64_t b, int64_t h, int64_t i) {
    double D = 0;
    for (int64_t e = 0; e < p.Dv; ++e) D += bp.dout.load<double>(b, h, i, e) * p.out.load<double>(b, h, i, e);
    return std::pair<double, double>{p.lse->load<double>(b, h, i, 0), D};
  });
}

template std::pair<float, float> backward_row<float>(const BackwardProblem&, int64_t, int64_t, int64_t, float*, float*,
                                                     float*, float*, float*);
template std::pair<double, double> backward_row<double>(const BackwardProblem&, int64_t, int64_t, int64_t, double*,
                                                        double*, double*, double*, double*);
template void materialized_backward<float>(const BackwardProblem& bp);
template void materialized_backward<double>(const BackwardProblem& bp);

}  // namespace sdpa::internal
