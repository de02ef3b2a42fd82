// attention_fuzz: the tolerance rules (forward and backward) and the gradients' buffers.
#include "harness.h"

namespace sdpa_fuzz {

// ---- The tolerance rule: sdpa_oracle's (tests/oracle/tolerance.h), on the fuzzer's cases ----

using sdpa_oracle::max_abs_finite;

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

// A miss is "tolerance_near" within kNearFactor times tol, else "tolerance". Where kNaive and
// kReference disagree on non-finite values no tolerance can be derived and nothing is checked
// (sdpa_oracle::naive_error: the tests fail there instead).
void check_tolerance(const Case& c, const Outs& got) {
  double err[3] = {0, 0, 0};
  Vals ref;
  auto measure = [&](const Case& in, double scale, Vals& r) {
    r = run_plain(in, Backend::kReference);
    const Vals naive = run_plain(in, Backend::kNaive);
    double e[3] = {0, 0, 0};
    if (!sdpa_oracle::naive_error("out", naive.out, r.out, scale, e[0]).empty() ||
        !sdpa_oracle::naive_error("weights", naive.weights, r.weights, scale, e[1]).empty() ||
        !sdpa_oracle::naive_error("lse", naive.lse, r.lse, scale, e[2]).empty())
      return false;
    for (int n = 0; n < 3; ++n) err[n] = std::max(err[n], e[n]);
    return true;
  };
  if (!measure(c, 1.0, ref)) return;
  if (c.dtype == DType::kFloat64) {
    Vals ref32;
    if (!measure(converted(c, DType::kFloat32), sdpa_oracle::kFloat64ErrorScale, ref32)) return;
  }
  // The summation term, fuzz-only (tolerance.h): out and l are sums over up to Nk keys (F6 fourth).
  const sdpa_oracle::ForwardTolerance tol = sdpa_oracle::forward_tolerance(
      err, sdpa_oracle::naive_factor(c.dtype),
      {.dtype = c.dtype,
       .out_max = max_abs_finite(c.v.values()) / (1 - c.opt.dropout_p),
       .max_score = max_score_magnitude(c),
       .lse_max = max_abs_finite(ref.lse),
       .summation = std::sqrt(static_cast<double>(std::max<int64_t>(1, c.d.Nk))),
       .rounds_weights = rounds_weights(c)});
  const Vals g = vals(got);
  // out only: a 16-bit out may round to inf near the threshold (tolerance.h: compare).
  const sdpa_oracle::Mismatch m[3] = {
      sdpa_oracle::compare("out", g.out, ref.out, tol.out, overflow_at(c.dtype)),
      got.weights ? sdpa_oracle::compare("weights", g.weights, ref.weights, tol.weights) : sdpa_oracle::Mismatch{},
      got.lse ? sdpa_oracle::compare("lse", g.lse, ref.lse, tol.lse) : sdpa_oracle::Mismatch{}};
  std::string r;  // the first output's miss, with the worst ratio over all three
  double ratio = 0;
  for (const sdpa_oracle::Mismatch& x : m) {
    if (r.empty()) r = x.message;
    ratio = std::max(ratio, x.worst_ratio);
  }
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

// The backward rule, sdpa_oracle::gradient_tolerance, per gradient (dsinks too); a miss is
// "bwd_tolerance_near" within kNearFactor, "bwd_nonfinite" for a non-finite gradient, else
// "bwd_tolerance". M is computed here as tests/backward_util.cc's cancellation_magnitudes (the
// fuzzer's cases are not the tests' tensors), with dsinks' terms and the summation term.
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
    for (int n = 0; n < 4; ++n) {  // n = 3: dsinks (none without); a non-finite gradient: no tolerance
      if (!sdpa_oracle::naive_error(kGradNames[n], naive.g[n], ref.g[n], scale, err[n], sdpa_oracle::NonFinite::kNever)
               .empty())
        return false;
    }
    return true;
  };
  double err[4] = {0, 0, 0, 0};
  GradVals ref;
  if (!measure(c, out, lse, dout, 1.0, ref, err)) return;
  if (c.dtype == DType::kFloat64) {
    const Case c32 = converted(c, DType::kFloat32);
    GradVals ref32;
    if (!measure(c32, out.converted(DType::kFloat32), lse.converted(DType::kFloat32), dout.converted(DType::kFloat32),
                 sdpa_oracle::kFloat64ErrorScale, ref32, err)) return;
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
    sdpa_oracle::GradientTolerance tol = sdpa_oracle::gradient_tolerance(
        err[n], sdpa_oracle::naive_factor(c.dtype), c.dtype, grad_dtype[n], max_abs_finite(ref.g[n]), M[n], n == 3);
    // dsinks in kFast (the fused backward): its terms exp(sink - lse) · D read the lse the kFast
    // forward gave, m + log Σ p~, whose rounded weights (each within eps/2 relative, eps q's)
    // move it by up to eps/2 (1 + eps) from the exact lse that kReference and kNaive recompute
    // (kNaive rounds p, not lse): each term moves by that fraction of its size.
    if (n == 3 && rounds_weights(c) && c.opt.backend != Backend::kReference && c.opt.backend != Backend::kNaive) {
      const double e16 = sdpa_oracle::eps(c.dtype), lse_term = 0.5 * e16 * (1 + e16) * max_abs_finite(ds_terms);
      tol.tol += lse_term;
      tol.terms += " + kFast's lse " + num(lse_term);
    }
    // A 16-bit gradient may round to inf where kReference's stays finite near the threshold (as
    // out): tame inputs and dropout's z = 1000 reach past float16's 65504.
    const sdpa_oracle::Mismatch m = sdpa_oracle::compare(kGradNames[n], g.g[n], ref.g[n], tol.tol, overflow_at(grad_dtype[n]));
    const double worst = m.worst_ratio;
    const char* name = worst <= kNearFactor ? "bwd_tolerance_near" : std::isinf(worst) ? "bwd_nonfinite" : "bwd_tolerance";
    check(m.count == 0, name, [&] {
      return std::string(backend_name(c.opt.backend)) + " vs kReference: " + m.message + " (tol: " + tol.terms + ")";
    });
  }
}

}  // namespace sdpa_fuzz
