// attention_fuzz: Options::precision kFast's own checks (inputs that start with kExtMagicFast).
// Every other check holds in kFast as in kExact, with the tolerance rule's yardstick kNaive in
// kFast (tolerance.cc: run_plain keeps the case's precision) and kFast's weight rounding in the
// edge semantics (checks.cc: nonzero_above). Here (names as in README.md):
//   fast_ignored     a call the header says ignores kFast (float32 or float64 q, float32 q over a
//                    16-bit cache, kReference): out, weights, lse and dq, dk, dv, dsinks bit for bit
//                    the same call's in kExact
//   fast_weights     16-bit q: weights (forward) and dsinks (backward, from the same out, lse,
//                    dout) bit for bit kExact's (the header: exact mode's)
//   fast_stochastic  16-bit q, no dropout, no sinks: v all equal to one value x gives out = x in
//                    every row with finite scores (the normaliser is the sum of the rounded
//                    weights the numerator uses)
#include "harness.h"

namespace sdpa_fuzz {

// kFast on 16-bit q (then k and v are too): the weights are rounded to q's type, in the kernels
// and in the naive yardstick (the tests' ForwardSizes::rounds_weights; kReference ignores it).
bool rounds_weights(const Case& c) { return c.opt.precision == sdpa::Precision::kFast && is16(c.dtype); }

// kFast asked for where the header says it is ignored: float32 and float64 q (a 16-bit cache
// under float32 q too) and kReference compute as kExact.
bool precision_ignored(const Case& c) {
  return c.opt.precision == sdpa::Precision::kFast && (!is16(c.dtype) || c.opt.backend == Backend::kReference);
}

namespace {

// The first element whose bits differ ("" if none).
std::string first_difference(const Tensor& a, const Tensor& b, const char* name) {
  for (int64_t n = 0; n < a.numel(); ++n)
    if (!same_bits(a.flat(n), b.flat(n))) return std::string(name) + "[" + std::to_string(n) + "]: " + num(a.flat(n)) + " vs " + num(b.flat(n));
  return "";
}

sdpa::Options exact_options(const Case& c) {
  sdpa::Options o = c.opt;
  o.precision = sdpa::Precision::kExact;
  return o;
}

// fast_stochastic: v (c.v's shape, contiguous) all x, a value both 16-bit types hold exactly.
// Each finite row's out is then Σ_j p~_j x / Σ_j p~_j in float32, rounded to q's type. The
// products p~_j x are exact (p~: at most 11 significant bits, x: at most 8; but for float32's
// underflow, absolute 2^-149 against a row whose largest term is x), so the float32
// result is x (1 + θ) with |θ| <= δ = 4 (Nk + 1) u (u = 2^-24: the two sums of Nk terms,
// the online softmax's rescales of both, the division). Rounding it to q's type gives x
// exactly where δ < eps / 4 (half the gap to x's nearer neighbour, eps q's: bfloat16 always
// here, float16 below 1023 keys), else x within |x| (δ + eps / 2).
void check_stochastic(const Case& c, const std::vector<uint8_t>& finite_rows) {
  const Dims& d = c.d;
  static const double kX[] = {1, -1, 0.5, 3, -0.375, 1.5, -100, 0x1p-7};
  const double x = kX[input_seed() % 8];
  Tensor vx(c.kv, c.v.shape(), Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t n = 0; n < vx.numel(); ++n) vx.set_flat(n, x);
  sdpa::Inputs in = c.inputs();
  in.v = vx.view();
  Outs s = make_outs(c, false, false, false);  // out alone: the single kFast pass
  run_forward(c, in, s, c.opt);
  const double delta = 4.0 * static_cast<double>(d.Nk + 1) * 0x1p-24, e16 = sdpa_oracle::eps(c.dtype);
  const bool exact = delta < e16 / 4;
  const double tol = exact ? 0.0 : std::fabs(x) * (delta + e16 / 2);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        if (!finite_rows[static_cast<size_t>((b * d.Hq + h) * d.Nq + i)]) continue;
        for (int64_t e = 0; e < d.Dv; ++e) {
          const double got = s.out.at4(b, h, i, e);
          check(std::fabs(got - x) <= tol, "fast_stochastic", [&] {
            return "v all " + num(x) + ": out[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i) +
                   ", " + std::to_string(e) + "] = " + num(got) + (exact ? ", want exactly " + num(x) : ", tol " + num(tol)) +
                   " (a row with finite scores: its normaliser must be the sum of the rounded weights)";
          });
        }
      }
}

}  // namespace

// After a valid forward in kFast (`full`: the call's out, weights and lse, plain layouts;
// `finite_rows` from check_edge_semantics): the same call in kExact.
void check_fast_forward(const Case& c, const Outs& full, const std::vector<uint8_t>& finite_rows) {
  if (c.opt.precision != sdpa::Precision::kFast) return;
  Outs ex = make_outs(c, true, true, false);
  run_forward(c, c.inputs(), ex, exact_options(c));
  if (precision_ignored(c)) {
    std::string why;
    check(full.bitwise_equal(ex, why), "fast_ignored", [&] { return "kFast (ignored by this call) differs from kExact: " + why; });
  } else {
    const std::string why = first_difference(*full.weights, *ex.weights, "weights");
    check(why.empty(), "fast_weights", [&] { return "kFast's weights differ from kExact's: " + why; });
  }
  if (is16(c.dtype) && c.opt.dropout_p == 0 && !c.has_sinks()) check_stochastic(c, finite_rows);
}

// After a valid backward in kFast from (out, lse, dout): the same backward in kExact.
void check_fast_backward(const Case& c, const Tensor& out, const Tensor& lse, const Tensor& dout, const Grads& got) {
  if (c.opt.precision != sdpa::Precision::kFast) return;
  const bool ignored = precision_ignored(c);
  if (!ignored && !got.dsinks) return;
  Grads ex = make_grads(c, LayoutSpec::plain());
  run_backward(c, c.inputs(), out, lse, dout, ex, exact_options(c));
  if (ignored) {
    std::string why;
    check(grads_bitwise(got, ex, why), "fast_ignored", [&] { return "attention_backward in kFast (ignored by this call) differs from kExact: " + why; });
    return;
  }
  const std::string why = first_difference(*got.dsinks, *ex.dsinks, "dsinks");
  check(why.empty(), "fast_weights", [&] { return "attention_backward in kFast: dsinks differ from kExact's: " + why; });
}

}  // namespace sdpa_fuzz
