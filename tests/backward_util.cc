#include "backward_util.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace sdpa_test {
namespace {

using sdpa::Backend;

std::vector<int64_t> out_shape(const Tensors& t) {
  std::vector<int64_t> s = t.q.shape();
  s.back() = t.v.shape().back();
  return s;
}

std::vector<int64_t> lse_shape(const Tensors& t) {
  std::vector<int64_t> s = t.q.shape();
  s.pop_back();
  return s;
}

// The weights' shape for t: (Nq, Nk), (Hq, Nq, Nk) or (B, Hq, Nq, Nk).
std::vector<int64_t> weights_shape(const Tensors& t) {
  const Dims d = dims_of(t);
  const std::vector<int64_t> full = {d.B, d.Hq, d.Nq, d.Nk};
  return {full.end() - t.q.rank(), full.end()};
}

}  // namespace

Problem Problem::converted(DType dtype) const {
  return {t.converted(dtype), out.converted(dtype, out.layout()), lse.converted(compute_dtype(dtype), lse.layout()),
          dout.converted(dtype, dout.layout())};
}

Problem make_problem(Tensors t, sdpa::Options options, Layout layout, uint32_t seed) {
  const DType dt = t.q.dtype();
  const std::vector<int64_t> os = out_shape(t), ls = lse_shape(t);
  Problem p{std::move(t), GuardedTensor(dt, os, layout), GuardedTensor(compute_dtype(dt), ls, layout, false),
            GuardedTensor(dt, os, layout)};
  options.backend = Backend::kAuto;
  sdpa::Outputs outs;
  outs.out = p.out.view();
  outs.lse = p.lse.view();
  sdpa::attention(p.t.inputs(), outs, options);
  std::mt19937 rng(seed);
  fill_normal(p.dout, rng);
  return p;
}

testing::AssertionResult Grads::guards_intact() const {
  if (auto r = dq.guards_intact(); !r) return r << " (dq)";
  if (auto r = dk.guards_intact(); !r) return r << " (dk)";
  if (auto r = dv.guards_intact(); !r) return r << " (dv)";
  return testing::AssertionSuccess();
}

Grads empty_grads(const Tensors& t, Layout layout) {
  return {GuardedTensor(t.q.dtype(), t.q.shape(), layout), GuardedTensor(t.k.dtype(), t.k.shape(), layout),
          GuardedTensor(t.v.dtype(), t.v.shape(), layout)};
}

Grads backward(const Problem& p, const sdpa::Options& options, Layout layout) {
  Grads g = empty_grads(p.t, layout);
  sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), g.gradients(), options);
  return g;
}

GradValues values(const Grads& g) { return {{g.dq.values(), g.dk.values(), g.dv.values()}}; }

testing::AssertionResult bitwise_equal(const GradValues& va, const GradValues& vb) {
  for (int n = 0; n < 3; ++n) {
    if (va.g[n].size() != vb.g[n].size()) return testing::AssertionFailure() << kGradNames[n] << ": sizes differ";
    for (size_t x = 0; x < va.g[n].size(); ++x) {
      if (std::bit_cast<uint64_t>(va.g[n][x]) != std::bit_cast<uint64_t>(vb.g[n][x])) {
        return testing::AssertionFailure() << kGradNames[n] << "[" << x << "]: " << va.g[n][x] << " vs "
                                           << vb.g[n][x] << " (not bitwise equal)";
      }
    }
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult bitwise_equal(const Grads& a, const Grads& b) { return bitwise_equal(values(a), values(b)); }

testing::AssertionResult no_nan(const GradValues& v) {
  for (int n = 0; n < 3; ++n) {
    for (size_t x = 0; x < v.g[n].size(); ++x) {
      if (!std::isfinite(v.g[n][x])) return testing::AssertionFailure() << kGradNames[n] << "[" << x << "] = " << v.g[n][x];
    }
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult all_near(const char* what, const std::vector<double>& got, const std::vector<double>& want,
                                  double tol) {
  // all_close, but an infinity fails even where both have it.
  for (size_t n = 0; n < std::min(got.size(), want.size()); ++n) {
    if (!std::isfinite(got[n]) || !std::isfinite(want[n])) {
      return testing::AssertionFailure() << what << "[" << n << "]: got " << got[n] << ", want " << want[n]
                                         << " (gradients are finite)";
    }
  }
  return all_close(what, got, want, tol);
}

std::vector<double> keep_mask(const Tensors& t, double p, uint64_t seed) {
  GuardedTensor m(DType::kBool, weights_shape(t));
  sdpa::dropout_mask(p, seed, m.view());
  return m.values();
}

// ---- An independent float64 oracle: the maths of the header, on test_util's forward oracle ----
//
//   P = weights (before dropout); z_ij = keep_ij / (1 - p) from dropout_mask (1 without dropout);
//   dv_j = Σ_i z_ij P_ij dout_i;  dP_ij = z_ij dout_i · v_j;  D_i = dout_i · out_i (out as given,
//   dropout included);  dS = P (dP - D);  dq_i = scale Σ_j dS_ij k_j;  dk_j = scale Σ_i dS_ij q_i;
//   dk, dv of a kv head summed over the query heads h with h / group == kvh.
GradValues backward_oracle(const Problem& p, const sdpa::Options& o) {
  const Tensors& t = p.t;
  const Dims d = dims_of(t);
  const double scale = o.scale.value_or(d.Dk > 0 ? 1.0 / std::sqrt(static_cast<double>(d.Dk)) : 1.0);
  const std::vector<double> w = oracle(t, o).weights;  // (B, Hq, Nq, Nk) in C order
  // Without dropout z = 1 everywhere (and z · x is x exactly).
  const std::vector<double> keep =
      o.dropout_p != 0 ? keep_mask(t, o.dropout_p, o.seed.value_or(0)) : std::vector<double>{};
  const double zk = 1.0 / (1.0 - o.dropout_p);
  GradValues r;
  r.g[0].assign(static_cast<size_t>(d.B * d.Hq * d.Nq * d.Dk), 0.0);
  r.g[1].assign(static_cast<size_t>(d.B * d.Hkv * d.Nk * d.Dk), 0.0);
  r.g[2].assign(static_cast<size_t>(d.B * d.Hkv * d.Nk * d.Dv), 0.0);
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t kvh = h / d.group;
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i;
        double D = 0;
        for (int64_t e = 0; e < d.Dv; ++e) D += p.dout.at(b, h, i, e) * p.out.at(b, h, i, e);
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double pij = w[static_cast<size_t>(row * d.Nk + j)];
          if (pij == 0) continue;
          const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * zk;
          double dp = 0;
          for (int64_t e = 0; e < d.Dv; ++e) {
            dp += p.dout.at(b, h, i, e) * t.v.at(b, kvh, j, e);
            r.g[2][static_cast<size_t>(((b * d.Hkv + kvh) * d.Nk + j) * d.Dv + e)] += z * pij * p.dout.at(b, h, i, e);
          }
          const double ds = pij * (z * dp - D);
          for (int64_t c = 0; c < d.Dk; ++c) {
            r.g[0][static_cast<size_t>(row * d.Dk + c)] += scale * ds * t.k.at(b, kvh, j, c);
            r.g[1][static_cast<size_t>(((b * d.Hkv + kvh) * d.Nk + j) * d.Dk + c)] += scale * ds * t.q.at(b, h, i, c);
          }
        }
      }
    }
  }
  return r;
}

// ---- The tolerance rule ----
//
// sdpa_oracle's (oracle/tolerance.h: gradient_tolerance), per gradient, on the same (q, k, v,
// mask, out, lse, dout) and the same dropout_p and seed: tol = factor · (max error of kNaive
// against kReference) + eps · (4 max(1, max |ref|) + M) (+ a 16-bit gradient's ulp).
//
// M, computed here: the size of the terms that cancel in each gradient, from the two inexact
// factors of dS = P (z dP - D):
//     - z dP and D are only accurate to eps relative to the sums of their terms' sizes,
//       A_ij = |z_ij| Σ_e |dout_ie v_je| + Σ_e |dout_ie out_ie| (not |z dP| + |D|: with Dv = 256
//       the terms cancel and the fuzzer found a dq of 1e-15 off by 5.6x the older rule's floor);
//     - P = exp(s - lse) carries the rounding of s and of lse: δP ≈ P · eps · (S_ij + |lse_i|),
//       S_ij = score_magnitude() (|scale| Σ_d |q_d k_d| + |bias|, not |s|: the dot product's
//       terms cancel too). The fused kernel reads lse as given, kNaive and kReference recompute
//       the softmax and do not see it. This gives the weight
//       mag_ij = P_ij (A_ij + 2 |z dP_ij - D_i| (S_ij + |lse_i|)), and
//       M_dq = |scale| max_i Σ_j mag_ij max|k_j|,  M_dk = |scale| max_j Σ_(h,i) mag_ij max|q_i|,
//       M_dv = max_j Σ_(h,i) 2 P_ij |z_ij| (S_ij + |lse_i|) max|dout_i|,
//     with z_ij = keep_ij / (1 - p) the dropout factor (z = 1 without dropout). Where every row
//     has a single allowed key (Nk = 1, window (0, 0)), P = 1 and out = v exactly, so kNaive,
//     computing dP and D by the same loop, gets dP - D = 0 exactly, while any other summation
//     order leaves ~eps · Σ |dout v|.
namespace {

testing::AssertionResult measure_naive(const Problem& p, const sdpa::Options& options, double scale, GradValues& ref,
                                       double (&err)[3]) {
  sdpa::Options o = options;
  o.backend = Backend::kReference;
  ref = values(backward(p, o));
  o.backend = Backend::kNaive;
  const GradValues naive = values(backward(p, o));
  for (int n = 0; n < 3; ++n) {
    const std::string why =
        sdpa_oracle::naive_error(kGradNames[n], naive.g[n], ref.g[n], scale, err[n], sdpa_oracle::NonFinite::kNever);
    if (!why.empty()) return testing::AssertionFailure() << why;
  }
  return testing::AssertionSuccess();
}

// M of the floor above, from kReference's weights (before dropout), z from dropout_mask, and
// dP, D and the sums of sizes computed here in float64.
void cancellation_magnitudes(const Problem& p, const sdpa::Options& options, double (&M)[3]) {
  const Tensors& t = p.t;
  const Dims d = dims_of(t);
  sdpa::Options o = options;
  o.backend = Backend::kReference;
  const std::vector<double> w = run(t, o).weights->values();  // (B, Hq, Nq, Nk)
  // Without dropout z = 1 everywhere (and z · dP is dP exactly).
  const std::vector<double> keep =
      o.dropout_p != 0 ? keep_mask(t, o.dropout_p, o.seed.value_or(0)) : std::vector<double>{};
  const double zk = 1.0 / (1.0 - o.dropout_p);
  const std::vector<double> lse = p.lse.values();  // (B, Hq, Nq)
  const double scale = std::abs(o.scale.value_or(d.Dk > 0 ? 1.0 / std::sqrt(static_cast<double>(d.Dk)) : 1.0));
  // Every (i, j) pair reads its rows: each tensor is widened once (ScoreMagnitudes does q and k).
  const ScoreMagnitudes score_magnitude(t, o);
  const std::vector<double> v = widened(t.v, d.B, d.Hkv, d.Nk, d.Dv), dout = widened(p.dout, d.B, d.Hq, d.Nq, d.Dv),
                            out = widened(p.out, d.B, d.Hq, d.Nq, d.Dv), q = widened(t.q, d.B, d.Hq, d.Nq, d.Dk),
                            k = widened(t.k, d.B, d.Hkv, d.Nk, d.Dk);
  auto abs_max = [](const std::vector<double>& x, int64_t row, int64_t n) {
    double m = 0;
    for (int64_t c = 0; c < n; ++c) m = std::max(m, std::abs(x[static_cast<size_t>(row * n + c)]));
    return m;
  };
  double row_max = 0;
  std::vector<double> col(static_cast<size_t>(d.B * d.Hkv * d.Nk), 0.0), col_v(col.size(), 0.0), k_max(col.size());
  for (size_t key = 0; key < k_max.size(); ++key) k_max[key] = abs_max(k, static_cast<int64_t>(key), d.Dk);
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t kvh = h / d.group;
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i;
        const double lse_i = std::isfinite(lse[row]) ? std::abs(lse[row]) : 0.0;
        const double qmax = abs_max(q, row, d.Dk), dout_max = abs_max(dout, row, d.Dv);
        const double* dout_i = dout.data() + row * d.Dv;
        const double* out_i = out.data() + row * d.Dv;
        double D = 0, D_size = 0;
        for (int64_t e = 0; e < d.Dv; ++e) {
          D += dout_i[e] * out_i[e];
          D_size += std::abs(dout_i[e] * out_i[e]);
        }
        double sum = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double pij = w[static_cast<size_t>(row * d.Nk + j)];
          if (pij == 0) continue;
          const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * zk;
          const size_t key = static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j);
          const double* v_j = v.data() + key * d.Dv;
          double dp = 0, dp_size = 0;
          for (int64_t e = 0; e < d.Dv; ++e) {
            dp += dout_i[e] * v_j[e];
            dp_size += std::abs(dout_i[e] * v_j[e]);
          }
          const double s_err = 2 * (score_magnitude(b, h, i, j) + lse_i);
          const double mag = pij * (std::abs(z) * dp_size + D_size + std::abs(z * dp - D) * s_err);
          sum += mag * k_max[key];
          col[key] += mag * qmax;
          col_v[key] += pij * std::abs(z) * s_err * dout_max;
        }
        row_max = std::max(row_max, sum);
      }
    }
  }
  M[0] = scale * row_max;
  M[1] = scale * max_abs_finite(col);
  M[2] = max_abs_finite(col_v);
}

}  // namespace

testing::AssertionResult expected(const Problem& p, const sdpa::Options& options, Expected& e) {
  const DType dt = p.t.q.dtype();
  double err[3] = {0, 0, 0};
  if (auto r = measure_naive(p, options, 1.0, e.ref, err); !r) return r;
  if (dt == DType::kFloat64) {
    GradValues ref32;
    if (auto r = measure_naive(p.converted(DType::kFloat32), options, sdpa_oracle::kFloat64ErrorScale, ref32, err);
        !r) {
      return r;
    }
  }
  double M[3];
  cancellation_magnitudes(p, options, M);
  const DType grad_dtype[3] = {dt, p.t.k.dtype(), p.t.v.dtype()};
  for (int n = 0; n < 3; ++n) {
    e.tol[n] = sdpa_oracle::gradient_tolerance(err[n], sdpa_oracle::naive_factor(dt), dt, grad_dtype[n],
                                               max_abs_finite(e.ref.g[n]), M[n])
                   .tol;
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult matches(const Expected& e, const Grads& got) {
  const GradValues g = values(got);
  for (int n = 0; n < 3; ++n) {
    if (auto r = all_near(kGradNames[n], g.g[n], e.ref.g[n], e.tol[n]); !r) return r;
  }
  return testing::AssertionSuccess();
}

}  // namespace sdpa_test
