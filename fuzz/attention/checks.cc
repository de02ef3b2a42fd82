// attention_fuzz: forward calls and the edge-semantics checks.
#include "harness.h"

namespace sdpa_fuzz {

Outs make_outs(const Case& c, bool weights, bool lse, bool fancy_layout) {
  Outs o;
  o.out.init(c.dtype, c.out_shape(), Role::kUnitLast, false, fancy_layout ? c.out_ls : LayoutSpec::plain());
  if (weights) o.weights.emplace(c.compute(), c.w_shape(), Role::kAny, false, fancy_layout ? c.w_ls : LayoutSpec::plain());
  if (lse) o.lse.emplace(c.compute(), c.lse_shape(), Role::kAny, false, fancy_layout ? c.l_ls : LayoutSpec::plain());
  return o;
}

void run_forward(const Case&, const sdpa::Inputs& in, const Outs& o, const sdpa::Options& opt) {
  expect_no_throw("attention", [&] { sdpa::attention(in, o.outputs(), opt); });
}

void check_outs_written(const Outs& o) {
  auto one = [](const Tensor& t, const char* name) {
    const std::string r = t.guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  };
  one(o.out, "out");
  if (o.weights) one(*o.weights, "weights");
  if (o.lse) one(*o.lse, "lse");
}

// (a)-(c): per row, from the classified scores.
void check_edge_semantics(const Case& c, const Outs& o, std::vector<uint8_t>* finite_rows) {
  const Dims& d = c.d;
  const bool f32 = c.compute() == DType::kFloat32 && c.opt.backend != Backend::kReference;
  // Results are stored in the inputs' dtype: kReference's float64 values are rounded to it.
  // out has q's dtype (16-bit: its own eps, range and smallest normal); weights and lse the
  // compute type's (float32 for 16-bit q).
  const long double out_eps = sdpa_oracle::eps(c.dtype), w_eps = sdpa_oracle::eps(c.compute());
  const long double out_store_max = max_of(c.dtype), out_min_normal = min_normal_of(c.dtype);
  const long double TMAX = f32 ? FLT_MAX : DBL_MAX;
  const long double zero_below = f32 ? -110 : -760;
  // kFast rounds each weight's exp(s - m) (m <= lse: the running max) to q's 16-bit type, where
  // one below its smallest normal may round (or, converted on AVX512_BF16, flush) to 0: surely
  // nonzero only above it (float16: t > -8.7; bfloat16's -86.3 is below float32's -80). Rounding
  // at most doubles a weight, so zero_below holds as it is.
  const long double nonzero_above =
      !f32 ? -700 : rounds_weights(c) ? std::max(-80.0L, std::log(static_cast<long double>(min_normal_of(c.dtype))) + 1) : -80;
  if (finite_rows) finite_rows->assign(static_cast<size_t>(d.B * d.Hq * d.Nq), 0);
  const std::vector<uint8_t> keep = keep_mask(c);
  const double keep_scale = c.opt.dropout_p > 0 ? 1.0 / (1.0 - c.opt.dropout_p) : 1.0;
  std::vector<Score> sc(static_cast<size_t>(d.Nk));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i;
        const int64_t kvh = h / d.group();
        int n_nan = 0, n_pinf = 0, n_fin = 0, n_ambig = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          sc[j] = classify(c, b, h, i, j);
          n_nan += sc[j].cls == Cls::kNaN;
          n_pinf += sc[j].cls == Cls::kPosInf;
          n_fin += sc[j].cls == Cls::kFinite;
          n_ambig += sc[j].cls == Cls::kAmbig;
        }
        auto W = [&](int64_t j) { return o.weights->at4(b, h, i, j); };
        auto where = [&](const char* what, int64_t x) {
          return std::string(what) + "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i) +
                 (x >= 0 ? ", " + std::to_string(x) : std::string()) + "]";
        };
        // Blocked keys: weight 0 (NaN accepted in a NaN row, where the header's NaN rule may reach it).
        if (o.weights) {
          for (int64_t j = 0; j < d.Nk; ++j) {
            if (sc[j].cls != Cls::kBlocked) continue;
            const double w = W(j);
            check(w == 0 || (std::isnan(w) && (n_nan > 0 || n_ambig > 0)), "blocked_weight",
                  [&] { return where("weights", j) + " = " + num(w) + " but causal/window/mask block that key"; });
          }
        }
        if (n_ambig > 0) continue;
        const double lse = o.lse ? o.lse->at4(0, b, h, i) : 0.0;
        if (n_nan > 0) {
          if (o.lse) check(std::isnan(lse), "nan_row", [&] { return where("lse", -1) + " = " + num(lse) + " but an allowed key's score is NaN"; });
          if (o.weights)
            for (int64_t j = 0; j < d.Nk; ++j)
              if (sc[j].cls != Cls::kBlocked && sc[j].cls != Cls::kNegInf)  // a -inf key: 0 or NaN
                check(std::isnan(W(j)), "nan_row", [&] { return where("weights", j) + " = " + num(W(j)) + " but an allowed key's score is NaN"; });
          if (c.opt.dropout_p == 0)
            for (int64_t e = 0; e < d.Dv; ++e) {
              const double x = o.out.at4(b, h, i, e);
              check(std::isnan(x), "nan_row", [&] { return where("out", e) + " = " + num(x) + " but an allowed key's score is NaN"; });
            }
          continue;
        }
        if (n_pinf > 0) {
          if (o.lse) check(lse == kInf, "inf_row", [&] { return where("lse", -1) + " = " + num(lse) + " but " + std::to_string(n_pinf) + " allowed keys score +inf"; });
          if (o.weights)
            for (int64_t j = 0; j < d.Nk; ++j) {
              const double want = sc[j].cls == Cls::kPosInf ? 1.0 / n_pinf : 0.0;
              const double w = W(j);
              check(std::fabs(w - want) <= 4 * w_eps, "inf_row",
                    [&] { return where("weights", j) + " = " + num(w) + ", want " + num(want) + " (" + std::to_string(n_pinf) + " keys score +inf)"; });
            }
          for (int64_t e = 0; e < d.Dv; ++e) {
            long double want = 0, mag = 0;
            bool any_nan = false, pos = false, neg = false;
            for (int64_t j = 0; j < d.Nk; ++j) {
              if (sc[j].cls != Cls::kPosInf) continue;
              const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * keep_scale;
              if (z == 0) continue;
              const long double vv = c.v.at4(b, kvh, j, e);
              if (std::isnan(vv)) any_nan = true;
              else if (std::isinf(vv)) (vv > 0 ? pos : neg) = true;
              else { want += vv * z / n_pinf; mag += std::fabs(vv * z); }
            }
            const double x = o.out.at4(b, h, i, e);
            if (any_nan || (pos && neg)) {
              check(std::isnan(x), "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want NaN (NaN/inf in v of a +inf key)"; });
            } else if (pos || neg) {
              check(x == (pos ? kInf : -kInf), "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want " + (pos ? "+inf" : "-inf"); });
            } else if (mag < 0.25L * TMAX) {
              // kReference computes in float64: a mean past float32's range overflows when stored
              // (and a float32 mean past a 16-bit out's range).
              const long double stored_max = out_store_max;
              const long double tol = 8 * out_eps * mag + out_min_normal;
              if (std::fabs(want) - tol > stored_max) {
                check(x == (want > 0 ? kInf : -kInf), "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want " + (want > 0 ? "+inf" : "-inf") + " (the mean of the +inf keys' v rows overflows the output dtype)"; });
              } else if (std::fabs(want) + tol <= stored_max) {
                check(std::fabs(x - want) <= tol, "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want " + num(static_cast<double>(want)) + " (mean of the v rows of the +inf keys)"; });
              }
            }
          }
          continue;
        }
        if (n_fin == 0) {  // nothing allowed, or every allowed score -inf
          // With sinks: lse = the head's sink (the header), stored in the compute type.
          const double no_key_lse = !c.has_sinks() ? -kInf : c.compute() == DType::kFloat32 ? static_cast<double>(static_cast<float>(c.sink(h))) : c.sink(h);
          if (o.lse) check(same_bits(lse, no_key_lse), "masked_row", [&] { return where("lse", -1) + " = " + num(lse) + " but the row has no allowed key with a score above -inf" + (c.has_sinks() ? " (want the sink " + num(no_key_lse) + ")" : std::string()); });
          if (o.weights)
            for (int64_t j = 0; j < d.Nk; ++j)
              check(W(j) == 0, "masked_row", [&] { return where("weights", j) + " = " + num(W(j)) + " but the row is fully masked"; });
          for (int64_t e = 0; e < d.Dv; ++e) {
            const double x = o.out.at4(b, h, i, e);
            check(x == 0, "masked_row", [&] { return where("out", e) + " = " + num(x) + " but the row is fully masked"; });
          }
          continue;
        }
        if (finite_rows) (*finite_rows)[static_cast<size_t>(row)] = 1;
        // Finite scores (some maybe -inf): -inf keys weight 0; lse finite; out per (c).
        // lse is a smooth max: off by at most the largest error of any score (not only the top
        // one's: a key whose score cancels from huge products may be the max in the kernels).
        long double m = -INFINITY, merr = 0;
        for (int64_t j = 0; j < d.Nk; ++j)
          if (sc[j].cls == Cls::kFinite) {
            m = std::max(m, sc[j].s);
            merr = std::max(merr, sc[j].err);
          }
        // A sink is one more term of the softmax's sum (exact: the sink is finite, as stored).
        if (c.has_sinks()) m = std::max<long double>(m, c.sink(h));
        long double l = c.has_sinks() ? std::exp(static_cast<long double>(c.sink(h)) - m) : 0;
        for (int64_t j = 0; j < d.Nk; ++j)
          if (sc[j].cls == Cls::kFinite) l += std::exp(sc[j].s - m);
        const long double lse_exact = m + std::log(l);
        // kReference computes in float64 and may legitimately round a huge lse to inf in float32.
        const long double out_max = max_of(c.compute());  // lse's storage
        if (o.lse && std::fabs(lse_exact) + merr < 0.999L * out_max) check(std::isfinite(lse), "finite_row", [&] { return where("lse", -1) + " = " + num(lse) + " but every allowed score is finite or -inf (lse ~ " + num(static_cast<double>(lse_exact)) + ")"; });
        if (o.weights)
          for (int64_t j = 0; j < d.Nk; ++j) {
            const double w = W(j);
            if (sc[j].cls == Cls::kNegInf) check(w == 0, "finite_row", [&] { return where("weights", j) + " = " + num(w) + " but that key's score is -inf"; });
            else check(w >= 0 && w <= 1, "finite_row", [&] { return where("weights", j) + " = " + num(w) + ", not in [0, 1] (finite scores)"; });
          }
        // (c): classify each key's weight as robustly zero / nonzero / unsure.
        for (int64_t e = 0; e < d.Dv; ++e) {
          bool unsure = false, any_nan = false, pos = false, neg = false;
          long double mag = 0;
          for (int64_t j = 0; j < d.Nk; ++j) {
            const long double vv = c.v.at4(b, kvh, j, e);
            const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * keep_scale;
            if (sc[j].cls != Cls::kFinite || z == 0) continue;  // weight 0 or dropped: contributes nothing
            const long double t = sc[j].s - lse_exact;
            if (t + sc[j].err + merr < zero_below) continue;  // underflows to weight 0
            const bool nonzero = t - sc[j].err - merr > nonzero_above;
            if (!std::isfinite(vv)) {
              if (!nonzero) { unsure = true; break; }
              if (std::isnan(vv)) any_nan = true; else (vv > 0 ? pos : neg) = true;
            } else {
              mag += std::fabs(vv) * z;
            }
          }
          if (unsure) continue;
          const double x = o.out.at4(b, h, i, e);
          if (any_nan || (pos && neg)) {
            check(std::isnan(x), "finite_row", [&] { return where("out", e) + " = " + num(x) + ", want NaN (NaN, or +inf and -inf, in v rows of keys with nonzero weight)"; });
          } else if (pos || neg) {
            if (mag < 0.25L * std::min(TMAX, out_store_max)) check(x == (pos ? kInf : -kInf), "finite_row", [&] { return where("out", e) + " = " + num(x) + ", want " + (pos ? "+inf" : "-inf") + " (inf in the v row of a key with nonzero weight)"; });
          } else if (mag < 0.25L * std::min(TMAX, out_store_max)) {
            check(std::isfinite(x), "finite_row", [&] { return where("out", e) + " = " + num(x) + " but every key with nonzero weight has a finite v row (keys of weight 0 must contribute nothing)"; });
          }
        }
      }
}

// ---- One forward (+ backward) case ----

// kernel_path: the path a call reports (sdpa::last_kernel_path) is no better than the cap,
// available here (kernel_path_available: this CPU, the SIMD targets not disabled: so kSimd under
// the AVX2 cap), and kSimd unless q, k and v are all bfloat16 (the header's KernelPath).
void check_kernel_path(const Case& c, sdpa::KernelPath p, const char* call) {
  if (g_print) std::fprintf(stderr, "attention_fuzz: %s ran on kernel path %s\n", call, path_name(p));
  const bool ok = static_cast<int>(p) <= static_cast<int>(c.path_cap) && sdpa::kernel_path_available(p) &&
                  (p == sdpa::KernelPath::kSimd || c.all_bf16());
  check(ok, "kernel_path", [&] {
    return std::string(call) + " reports kernel path " + path_name(p) + " (cap " + path_name(c.path_cap) + ", available: " +
           (sdpa::kernel_path_available(p) ? "yes" : "no") + ", dtype " + dtype_str(c.dtype) + "/" + dtype_str(c.kv) + ")";
  });
}

}  // namespace sdpa_fuzz
