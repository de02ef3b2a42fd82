// attention_fuzz: the tolerance rules (forward and backward) and the gradients' buffers.
#include "harness.h"

namespace sdpa_fuzz {

// ---- The tolerance rule (tests/test_util.cc: matches_reference) ----

double max_abs_finite(const std::vector<double>& xs) {
  double m = 0;
  for (double x : xs) if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}
Vals vals(const Outs& o) { return {o.out.values(), o.weights ? o.weights->values() : std::vector<double>{}, o.lse ? o.lse->values() : std::vector<double>{}}; }

// Case with q, k, v, mask converted to dt (contiguous).
Case converted(const Case& c, DType dt) {
  Case r;
  r.dtype = dt; r.kv = dt; r.rank = c.rank; r.d = c.d; r.opt = c.opt;
  r.q = c.q.converted(dt); r.k = c.k.converted(dt); r.v = c.v.converted(dt);
  if (c.mask) r.mask.emplace(c.mask->converted(c.mask->dtype() == DType::kBool ? DType::kBool : dt));
  r.seqlens = c.seqlens; r.sl = c.sl; r.sl_view = c.sl_view; r.bad_sl = c.bad_sl;
  r.mods = c.mods; r.backward = c.backward;  // the modifiers' tensors are shared (opt holds their views)
  r.blocks = c.blocks;  // the block mask too (bool: the same in every dtype)
  return r;
}

Vals run_plain(const Case& c, Backend be) {
  sdpa::Options o = c.opt;
  o.backend = be;
  Outs out = make_outs(c, true, true, false);
  run_forward(c, c.inputs(), out, o);
  return vals(out);
}

// false when no tolerance can be derived (kNaive and kReference disagree on non-finite values).
bool max_error(const std::vector<double>& a, const std::vector<double>& b, double& err) {
  for (size_t n = 0; n < a.size(); ++n) {
    if (std::isfinite(a[n]) && std::isfinite(b[n])) err = std::max(err, std::abs(a[n] - b[n]));
    else if (!(a[n] == b[n])) return false;
  }
  return true;
}

// `overflow`: where rounding to the stored dtype gives inf (overflow_at; inf for float32 and
// float64, whose tame results never get near it). A 16-bit out can: tame values reach 1e3, and
// dropout's 1 / (1 - p) = 1000 takes a float16 out past 65504. Which side of the threshold a
// result lands on is rounding, so an inf against a finite value of the same sign within tol of
// the threshold passes (the finite one is then within tol of a value that rounds to inf).
std::string all_close(const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol,
                      double& worst_ratio, double overflow = kInf) {
  std::string first;
  for (size_t n = 0; n < got.size(); ++n) {
    const bool inf = std::isinf(got[n]) || std::isinf(want[n]);
    bool ok = inf ? got[n] == want[n] : std::abs(got[n] - want[n]) <= tol;
    if (!ok && inf && overflow < kInf) {
      const double fin = std::isinf(got[n]) ? want[n] : got[n], infv = std::isinf(got[n]) ? got[n] : want[n];
      ok = std::isfinite(fin) && std::signbit(fin) == std::signbit(infv) && std::abs(fin) + tol >= overflow;
    }
    if (ok) continue;
    const double ratio = inf || std::isnan(got[n]) ? kInf : std::abs(got[n] - want[n]) / tol;
    if (ratio > worst_ratio || first.empty()) {
      worst_ratio = std::max(worst_ratio, ratio);
      first = std::string(what) + "[" + std::to_string(n) + "] = " + num(got[n]) + ", kReference " + num(want[n]) + ", tol " + num(tol) +
              " (" + num(ratio) + " x tol)";
    }
  }
  return first;
}

void check_tolerance(const Case& c, const Outs& got) {
  double err[3] = {0, 0, 0};
  Vals ref;
  auto measure = [&](const Case& in, double scale, Vals& r) {
    r = run_plain(in, Backend::kReference);
    const Vals naive = run_plain(in, Backend::kNaive);
    double e[3] = {0, 0, 0};
    if (!max_error(naive.out, r.out, e[0]) || !max_error(naive.weights, r.weights, e[1]) || !max_error(naive.lse, r.lse, e[2])) return false;
    for (int n = 0; n < 3; ++n) err[n] = std::max(err[n], e[n] * scale);
    return true;
  };
  if (!measure(c, 1.0, ref)) return;
  double factor = 2;
  if (c.dtype == DType::kFloat64) {
    Vals ref32;
    if (!measure(converted(c, DType::kFloat32), DBL_EPSILON / FLT_EPSILON, ref32)) return;
    factor = 3;
  }
  const Vals g = vals(got);
  const double e = sdpa_oracle::eps(c.compute());  // weights and lse are stored in the compute type (test_util.cc)
  const double out_max = max_abs_finite(c.v.values()) / (1 - c.opt.dropout_p);
  const double S2 = 2 * max_score_magnitude(c);  // the scores' own rounding (test_util.cc)
  // 16-bit out: one more unit in its last place (test_util.cc: a float32 result near a tie may
  // round the other way than kReference's float64 one).
  const double out_ulp = is16(c.dtype) ? sdpa_oracle::eps(c.dtype) * out_max : 0.0;
  // Summation, fuzz-only (as in the backward rule below): out and l are sums over up to Nk keys,
  // whose roundings grow like sqrt(Nk)·eps relative to Σ p|v| and l (F6 fourth: float64, Nk 2047,
  // out off by 1.09x a floor without it).
  const double sum_n = std::sqrt(static_cast<double>(std::max<int64_t>(1, c.d.Nk)));
  double ratio = 0;
  std::string r = all_close("out", g.out, ref.out, factor * err[0] + e * out_max * (std::max(4.0, S2) + sum_n) + out_ulp, ratio,
                            overflow_at(c.dtype));
  if (got.weights) { const std::string x = all_close("weights", g.weights, ref.weights, factor * err[1] + e * (std::max(4.0, S2) + sum_n), ratio); if (r.empty()) r = x; }
  if (got.lse) { const std::string x = all_close("lse", g.lse, ref.lse, factor * err[2] + e * (std::max(4 * (1 + max_abs_finite(ref.lse)), S2) + sum_n), ratio); if (r.empty()) r = x; }
  check(r.empty(), ratio <= kNearFactor ? "tolerance_near" : "tolerance",
        [&] { return std::string(backend_name(c.opt.backend)) + " vs kReference: " + r + "; worst " + num(ratio) + " x tol"; });
}
// `ds_ls`: dsinks' layout (the case's own for the call under test, plain for the others).
Grads make_grads(const Case& c, const LayoutSpec& ls, bool ds_fancy) {
  // dq has q's dtype, dk and dv k's and v's (the header's Gradients).
  Grads g{Tensor(c.dtype, c.q.shape(), Role::kUnitLast, false, ls), Tensor(c.kv, c.k.shape(), Role::kUnitLast, false, ls),
          Tensor(c.kv, c.v.shape(), Role::kUnitLast, false, ls), std::nullopt};
  if (c.want_dsinks())
    g.dsinks.emplace(c.mods->dsinks_dtype, std::vector<int64_t>{c.d.Hq}, Role::kAny, false, ds_fancy ? c.mods->dsinks_ls : LayoutSpec::plain());
  return g;
}
GradVals gvals(const Grads& g) { return {{g.dq.values(), g.dk.values(), g.dv.values(), g.dsinks ? g.dsinks->values() : std::vector<double>{}}}; }

void run_backward(const Case&, const sdpa::Inputs& in, const Tensor& out, const Tensor& lse, const Tensor& dout,
                  const Grads& g, const sdpa::Options& opt) {
  expect_no_throw("attention_backward",
                  [&] { sdpa::attention_backward(in, out.view(), lse.view(), dout.view(), g.gradients(), opt); });
}

bool grads_bitwise(const Grads& a, const Grads& b, std::string& why) {
  const GradVals va = gvals(a), vb = gvals(b);
  for (int n = 0; n < 4; ++n)
    for (size_t x = 0; x < va.g[n].size(); ++x)
      if (!same_bits(va.g[n][x], vb.g[n][x])) {
        why = std::string(kGradNames[n]) + "[" + std::to_string(x) + "]: " + num(va.g[n][x]) + " vs " + num(vb.g[n][x]);
        return false;
      }
  return true;
}

// tests/backward_util.cc: expected() and matches(), reimplemented.
void check_bwd_tolerance(const Case& c, const Tensor& out, const Tensor& lse, const Tensor& dout, const Grads& got) {
  const Dims& d = c.d;
  auto measure = [&](const Case& cc, const Tensor& o, const Tensor& l, const Tensor& dO, double scale, GradVals& ref, double (&err)[4]) {
    sdpa::Options opt = cc.opt;
    opt.backend = Backend::kReference;
    Grads gr = make_grads(cc, LayoutSpec::plain());
    run_backward(cc, cc.inputs(), o, l, dO, gr, opt);
    opt.backend = Backend::kNaive;
    Grads gn = make_grads(cc, LayoutSpec::plain());
    run_backward(cc, cc.inputs(), o, l, dO, gn, opt);
    ref = gvals(gr);
    const GradVals naive = gvals(gn);
    for (int n = 0; n < 4; ++n) {  // n = 3: dsinks (none without)
      double e = 0;
      for (size_t x = 0; x < ref.g[n].size(); ++x) {
        if (!std::isfinite(ref.g[n][x]) || !std::isfinite(naive.g[n][x])) return false;  // no_nan fails: no tolerance
        e = std::max(e, std::abs(naive.g[n][x] - ref.g[n][x]));
      }
      err[n] = std::max(err[n], e * scale);
    }
    return true;
  };
  double err[4] = {0, 0, 0, 0};
  GradVals ref;
  if (!measure(c, out, lse, dout, 1.0, ref, err)) return;
  double factor = 2;
  if (c.dtype == DType::kFloat64) {
    const Case c32 = converted(c, DType::kFloat32);
    GradVals ref32;
    if (!measure(c32, out.converted(DType::kFloat32), lse.converted(DType::kFloat32), dout.converted(DType::kFloat32),
                 DBL_EPSILON / FLT_EPSILON, ref32, err)) return;
    factor = 3;
  }
  // Cancellation magnitudes M (backward_util.cc: cancellation_magnitudes, the same terms).
  const Vals rf = run_plain(c, Backend::kReference);
  const std::vector<uint8_t> keep = keep_mask(c);
  const std::vector<double> lsev = lse.values();
  const double zk = c.opt.dropout_p > 0 ? 1.0 / (1.0 - c.opt.dropout_p) : 1.0;
  const double scale = std::abs(c.scale());
  double row_max = 0;
  std::vector<double> col(static_cast<size_t>(d.B * d.Hkv * d.Nk), 0.0), col_v(col.size(), 0.0);
  // dsinks_h = -Σ_b Σ_i exp(sink_h - lse_bhi) · (dout_bhi · out_bhi): the sizes of its terms.
  std::vector<double> ds_terms(static_cast<size_t>(d.Hq), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
        const double lse_i = std::isfinite(lsev[static_cast<size_t>(row)]) ? std::abs(lsev[static_cast<size_t>(row)]) : 0.0;
        double D = 0, D_size = 0, qmax = 0, dout_max = 0;
        for (int64_t e = 0; e < d.Dv; ++e) {
          D += dout.at4(b, h, i, e) * out.at4(b, h, i, e);
          D_size += std::abs(dout.at4(b, h, i, e) * out.at4(b, h, i, e));
          dout_max = std::max(dout_max, std::abs(dout.at4(b, h, i, e)));
        }
        for (int64_t x = 0; x < d.Dk; ++x) qmax = std::max(qmax, std::abs(c.q.at4(b, h, i, x)));
        if (c.has_sinks() && std::isfinite(lsev[static_cast<size_t>(row)]))
          ds_terms[static_cast<size_t>(h)] += std::exp(c.sink(h) - lsev[static_cast<size_t>(row)]) * D_size;
        double sum = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double pij = rf.weights[static_cast<size_t>(row * d.Nk + j)];
          if (pij == 0) continue;
          double dp = 0, dp_size = 0, kmax = 0;
          for (int64_t e = 0; e < d.Dv; ++e) {
            dp += dout.at4(b, h, i, e) * c.v.at4(b, kvh, j, e);
            dp_size += std::abs(dout.at4(b, h, i, e) * c.v.at4(b, kvh, j, e));
          }
          for (int64_t x = 0; x < d.Dk; ++x) kmax = std::max(kmax, std::abs(c.k.at4(b, kvh, j, x)));
          const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * zk;
          const double s_err = 2 * (score_magnitude(c, b, h, i, j) + lse_i);
          const double mag = pij * (z * dp_size + D_size + std::abs(z * dp - D) * s_err);
          const size_t key = static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j);
          sum += mag * kmax;
          col[key] += mag * qmax;
          col_v[key] += pij * z * s_err * dout_max;
        }
        row_max = std::max(row_max, sum);
      }
  // Summation, a fuzz-only term (like the score rounding in s_err): each gradient element sums n
  // terms (dq: a row's keys, n <= Nk; dk, dv: the rows of a key's group, n <= group·Nq) in order,
  // and their roundings add up like a random walk, ~sqrt(n)·eps·Σ|terms| (the usual estimate for
  // recursive summation; the worst case is (n-1)·eps·Σ|terms|), where the tests' rule counts each
  // term's size once (eps · M). It shows where a gradient cancels to zero: F6 third, a dq that
  // is zero up to rounding over 2048 keys, off by 11·eps·M in both backends.
  const double n_dq = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.Nk)));
  const double n_dkv = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.group() * d.Nq)));
  // dsinks: a sum over the B·Nq rows of its head, in a fixed order.
  const double n_ds = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.B * d.Nq)));
  const double M[4] = {n_dq * scale * row_max, n_dkv * scale * max_abs_finite(col), n_dkv * max_abs_finite(col_v),
                       n_ds * max_abs_finite(ds_terms)};
  const GradVals g = gvals(got);
  const DType grad_dtype[4] = {c.dtype, c.kv, c.kv, got.dsinks ? got.dsinks->dtype() : c.compute()};
  for (int n = 0; n < 4; ++n) {
    if (n == 3 && !got.dsinks) break;
    // dsinks is stored in its own dtype (float32 under float64 q too): its epsilon where larger.
    const double e = n == 3 ? std::max(sdpa_oracle::eps(c.compute()), sdpa_oracle::eps(grad_dtype[3])) : sdpa_oracle::eps(c.compute());
    const double ref_max = max_abs_finite(ref.g[n]);
    // 16-bit gradients: one more unit in their last place, as for out (backward_util.cc).
    const double ulp = is16(grad_dtype[n]) ? sdpa_oracle::eps(grad_dtype[n]) * ref_max : 0.0;
    const double tol = factor * err[n] + e * (4 * std::max(1.0, ref_max) + M[n]) + ulp;
    // A 16-bit gradient may round to inf where kReference's stays finite near the threshold (as
    // out in all_close): tame inputs and dropout's z = 1000 reach past float16's 65504.
    const double overflow = overflow_at(grad_dtype[n]);
    double worst = 0;
    size_t at = 0;
    for (size_t x = 0; x < g.g[n].size(); ++x) {
      const double a = g.g[n][x], w = ref.g[n][x];
      const bool rounds_over = std::isinf(a) && std::signbit(a) == std::signbit(w) && std::abs(w) + tol >= overflow;
      const double ratio = std::isfinite(a) ? std::abs(a - w) / tol : rounds_over ? 0.0 : kInf;
      if (!(ratio <= worst)) { worst = std::isnan(ratio) ? kInf : ratio; at = x; }
    }
    const char* name = worst <= kNearFactor ? "bwd_tolerance_near" : std::isinf(worst) ? "bwd_nonfinite" : "bwd_tolerance";
    check(worst <= 1, name, [&] {
      return std::string(backend_name(c.opt.backend)) + " vs kReference: " + kGradNames[n] + "[" + std::to_string(at) + "] = " + num(g.g[n][at]) +
             ", kReference " + num(ref.g[n][at]) + ", tol " + num(tol) + " (" + num(worst) + " x tol; measured error " +
             num(err[n]) + " x " + num(factor) + ", eps " + num(e) + " x (4 max(1, " + num(ref_max) + ") + M " + num(M[n]) + "))";
    });
  }
}

}  // namespace sdpa_fuzz
