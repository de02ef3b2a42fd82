// attention_fuzz: the edge-semantics oracle: each score's IEEE class and rounding bound, from the
// header's rules (tests/oracle/oracle.h: causal / window, the mask's bias, ALiBi), independently
// of src/.
#include "harness.h"

namespace sdpa_fuzz {

// The bias of score (b, h, i, j): a float mask's value, 0 / -inf for a bool mask's nonzero / 0,
// and -inf where the block mask blocks the key (the header: on top of every other mask, exactly
// as a bool mask's 0), so every check that asks whether a key is blocked sees the block mask.
double mask_bias(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!c.block_allows(b, h, i, j)) return -kInf;
  if (!c.mask) return 0.0;
  const double m = c.mask->at4(b, h, i, j);
  return sdpa_oracle::mask_bias(c.mask->dtype(), m);
}
// Causal, window and seqlens_k: batch entry b has keys 0 .. L - 1, L = seqlens_k[b], and causal
// and window align to L (the header's Inputs::seqlens_k), not to Nk.
bool key_allowed(const Case& c, int64_t b, int64_t i, int64_t j) {
  const int64_t L = c.keys_of(b);
  return j < L && sdpa_oracle::key_allowed(c.opt, c.d.Nq, L, i, j);
}
bool allowed(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  return key_allowed(c, b, i, j) && mask_bias(c, b, h, i, j) != -kInf;
}

// The oracle's score_magnitude (|scale| Σ_d |q_d k_d| + |bias| + |alibi|, as the tests' tolerance
// rule), 0 for a blocked key.
double score_magnitude(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  const double bias = mask_bias(c, b, h, i, j);
  if (!key_allowed(c, b, i, j) || !std::isfinite(bias)) return 0.0;
  double t = 0;
  for (int64_t x = 0; x < c.d.Dk; ++x) t += std::abs(c.q.at4(b, h, i, x) * c.k.at4(b, h / c.d.group(), j, x));
  return sdpa_oracle::score_magnitude(c.scale(), t, bias, c.alibi(b, h, i, j));
}
double max_score_magnitude(const Case& c) {
  double m = 0;
  for (int64_t b = 0; b < c.d.B; ++b)
    for (int64_t h = 0; h < c.d.Hq; ++h)
      for (int64_t i = 0; i < c.d.Nq; ++i)
        for (int64_t j = 0; j < c.d.Nk; ++j) {
          const double x = score_magnitude(c, b, h, i, j);
          if (std::isfinite(x)) m = std::max(m, x);
        }
  return m;
}

// The score modifiers (the header's Options::softcap, softcap_order, alibi_slopes) applied to the
// class of x = Σ_d (q_d·scale)·k_d (`raw`; x and xerr for kFinite) of an allowed key with a finite
// bias:
//   kBeforeBias  s = cap·tanh(x / cap) + alibi + bias: x = ±inf gives ±cap, NaN stays NaN
//   kAfterBias   s = cap·tanh((x + alibi + bias) / cap): +inf gives cap, NaN stays NaN, and an
//                argument that is -inf in the compute type (x = -inf, or a sum past its range:
//                ±inf from |x + alibi + bias| >= 0x1.ffffffp127 for float32 compute) blocks the
//                key like a -inf bias: score -inf, weight 0 (the header's Options::softcap;
//                kReference rounds the argument to the compute type's range, Problem::
//                in_compute_range, as the float32 kernels' sum does: F17, resolved so)
// The errors: tanh is 1-Lipschitz, so an argument's error passes through; the division by cap
// (its reciprocal may be subnormal for caps near FLT_MAX: a few ulps), Highway's Tanh (a few ulps
// of a value <= 1) and the multiplication by cap add eps·(8|x| + 16·cap); ALiBi's slope (rounded
// to the compute type) times an exact distance, 2·eps·|alibi|; each addition eps·(|a| + |b|).
// An argument of the cap after the bias near the overflow threshold: kAmbig.
// `with_cap` false leaves the cap out (cap = 0): Outputs::scores' kBiased stage.
Score modified_score(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j, Cls raw, long double x, long double xerr,
                     double bias, long double TMAX, long double eps, bool with_cap = true) {
  Score r;
  r.cls = Cls::kAmbig;
  if (raw == Cls::kAmbig) return r;
  if (raw == Cls::kNaN) { r.cls = Cls::kNaN; return r; }
  // The kernels hold cap in the compute type; kReference computes in float64.
  const bool f32_arith = c.compute() == DType::kFloat32 && c.opt.backend != Backend::kReference;
  const long double cap = !with_cap ? 0 : f32_arith ? static_cast<long double>(static_cast<float>(c.opt.softcap)) : c.opt.softcap;
  const bool after = c.opt.softcap_order == sdpa::Options::SoftcapOrder::kAfterBias;
  const long double a = c.alibi(b, h, i, j), aerr = 2 * eps * std::fabs(a);
  const auto capped = [&](long double v, long double verr, long double& out_err) {
    out_err = verr + eps * (8 * std::fabs(v) + 16 * cap);
    return cap * std::tanh(v / cap);
  };
  long double v = x, verr = xerr;
  int inf = raw == Cls::kPosInf ? 1 : raw == Cls::kNegInf ? -1 : 0;  // the class of v while infinite
  if (cap > 0 && !after) {
    if (inf != 0) { v = inf * cap; verr = 16 * eps * cap; inf = 0; }
    else v = capped(v, verr, verr);
  }
  // + alibi + bias (finite): an infinite v stays so.
  if (inf == 0) {
    const long double va = v + a, t = va + bias;
    const long double terr = verr + aerr + eps * (std::fabs(v) + std::fabs(a)) + eps * (std::fabs(va) + std::fabs(bias));
    const long double big = std::max(std::fabs(va), std::fabs(t));
    if (std::fabs(t) - terr > 1.001L * TMAX) {
      inf = t > 0 ? 1 : -1;
    } else if (big + terr >= 0.999L * TMAX) {
      return r;  // which side of the threshold is rounding
    } else {
      v = t;
      verr = terr;
    }
  }
  if (cap > 0 && after) {
    // -inf stays -inf (blocked: weight 0); +inf becomes cap.
    if (inf > 0) { v = cap; verr = 16 * eps * cap; inf = 0; }
    else if (inf == 0) v = capped(v, verr, verr);
  }
  if (inf != 0) { r.cls = inf > 0 ? Cls::kPosInf : Cls::kNegInf; return r; }
  if (std::fabs(v) + verr >= 0.999L * TMAX) return r;
  r.cls = Cls::kFinite;
  r.s = v;
  r.err = verr;
  return r;
}

// The range and the arithmetic of c's scores: the range is the inputs' dtype's for every backend
// (kReference rounds q·scale, each product and the score to it); the arithmetic is float64 in
// kReference (the header's rule). 16-bit inputs compute in float32: the range and the arithmetic
// are float32's (kReference rounds to float32's range, src/reference.cc).
struct ScoreArith {
  bool f32, f32_arith;
  long double TMAX, eps, scale;
};
ScoreArith score_arith(const Case& c) {
  const bool f32 = c.compute() == DType::kFloat32, f32_arith = f32 && c.opt.backend != Backend::kReference;
  return {f32, f32_arith, f32 ? FLT_MAX : DBL_MAX, f32_arith ? FLT_EPSILON : DBL_EPSILON,
          f32_arith ? static_cast<long double>(static_cast<float>(c.scale())) : c.scale()};
}

// The class of x = Σ_d (q_d·scale)·k_d alone (no mask, bias or modifier; Outputs::scores' kScaled
// stage) in the compute type, robust to the order of the sum and to FMA: kAmbig when rounding
// could decide it; kFinite with s = x and err its bound.
Score raw_score(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  Score r;
  const ScoreArith a = score_arith(c);
  const bool f32 = a.f32;
  const long double TMAX = a.TMAX, eps = a.eps, scale = a.scale;
  const int64_t kvh = h / c.d.group();
  bool pinf = false, ninf = false, nan = false, ambig = false, ambig_pos = false, ambig_neg = false;
  long double sum = 0, sabs = 0;
  // The score is Σ_d (q_d · scale) · k_d + bias: the scale multiplies q first (the header).
  for (int64_t e = 0; e < c.d.Dk; ++e) {
    const long double x = c.q.at4(b, h, i, e), y = c.k.at4(b, kvh, j, e);
    if (std::isnan(x) || std::isnan(y)) { nan = true; continue; }
    if (std::isinf(x) && scale == 0) { nan = true; continue; }
    // q · scale is one rounded multiply in every backend: it overflows to ±inf and underflows
    // to ±0 at the ends of the inputs' range (kReference rounds to them too; 0 · inf = NaN).
    long double xs = x * scale;
    const long double xr = f32 ? static_cast<long double>(static_cast<float>(xs)) : static_cast<long double>(static_cast<double>(xs));
    if (std::isinf(xr) || xr == 0) xs = xr;
    if ((std::isinf(xs) && y == 0) || (std::isinf(y) && xs == 0)) { nan = true; continue; }
    const long double p = xs * y;
    if (std::isinf(p) || std::fabs(p) > 3 * TMAX) { (p > 0 ? pinf : ninf) = true; continue; }
    if (std::fabs(p) > 0.999L * TMAX) { ambig = true; (p > 0 ? ambig_pos : ambig_neg) = true; continue; }
    sum += p;
    sabs += std::fabs(p);
  }
  r.cls = Cls::kAmbig;
  if (nan) { r.cls = Cls::kNaN; return r; }
  // Overflowing products of both signs: inf - inf = NaN when each product is rounded, but a
  // fused multiply-add adds the next exact product to the inf so far and keeps its sign.
  if (pinf && ninf) return r;
  const long double derr = (c.d.Dk + 2) * eps * sabs;
  if (pinf || ninf) {
    // The finite products' partial sums may themselves overflow, to the other infinity.
    if (sabs + derr >= 0.999L * TMAX) return r;
    // A product near the overflow threshold of the other sign may or may not become inf - inf.
    if ((pinf && ambig_neg) || (ninf && ambig_pos)) return r;
    r.cls = pinf ? Cls::kPosInf : Cls::kNegInf;
    return r;
  }
  if (ambig) return r;
  if (sabs + derr >= 0.999L * TMAX) return r;
  r.cls = Cls::kFinite;
  r.s = sum;
  r.err = derr;
  return r;
}

// The class of score s = Σ_d (q_d·scale)·k_d + bias in the compute type (max = FLT_MAX or DBL_MAX),
// robust to the order of the sum and to FMA: kAmbig when rounding could decide it. With
// `capped` false, the modifiers without the softcap (Outputs::scores' kBiased stage).
Score classify(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j, bool capped) {
  Score r;
  const double bias = mask_bias(c, b, h, i, j);
  if (!key_allowed(c, b, i, j) || bias == -kInf) return r;
  const Score raw = raw_score(c, b, h, i, j);
  if (raw.cls == Cls::kNaN || raw.cls == Cls::kAmbig) return raw;
  const ScoreArith a = score_arith(c);
  const long double TMAX = a.TMAX, eps = a.eps;
  if (c.modified()) return modified_score(c, b, h, i, j, raw.cls, raw.s, raw.err, bias, TMAX, eps, capped);
  if (raw.cls != Cls::kFinite) return raw;
  const long double x = raw.s, xerr = raw.err;
  const long double s = x + bias, serr = xerr + eps * (std::fabs(x) + std::fabs(bias));
  if (std::fabs(s) - serr > 1.001L * TMAX) { r.cls = s > 0 ? Cls::kPosInf : Cls::kNegInf; return r; }
  if (std::fabs(s) + serr >= 0.999L * TMAX) { r.cls = Cls::kAmbig; return r; }
  r.cls = Cls::kFinite;
  r.s = s;
  r.err = serr;
  return r;
}

// Dropout keep decisions (1 kept, 0 dropped) for every (b, h, i, j), C order; empty without dropout.
std::vector<uint8_t> keep_mask(const Case& c) {
  if (c.opt.dropout_p <= 0) return {};
  Tensor m(DType::kBool, c.w_shape(), Role::kAny, false, LayoutSpec::plain());
  if (m.numel() == 0) return {};
  sdpa::dropout_mask(c.opt.dropout_p, c.opt.seed.value_or(0), m.view());
  std::vector<uint8_t> r(static_cast<size_t>(m.numel()));
  for (int64_t n = 0; n < m.numel(); ++n) r[static_cast<size_t>(n)] = m.flat(n) != 0;
  return r;
}

}  // namespace sdpa_fuzz
