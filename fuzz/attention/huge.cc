// attention_fuzz: mode < 12: empty views with huge dims.
#include "harness.h"

namespace sdpa_fuzz {

// ---- (f): empty views with huge dims ----

void run_huge(FuzzedDataProvider& f) {
  Case c;
  c.huge = true;
  c.path_cap = g_path_cap;
  c.dtype = f.ConsumeBool() ? DType::kFloat64 : DType::kFloat32;
  c.rank = f.ConsumeIntegralInRange<int>(2, 4);
  static const int64_t kHuge[] = {0, 0, 1, 2, 3, int64_t{1} << 20, (int64_t{1} << 31) + 1, int64_t{1} << 40, int64_t{1} << 62};
  Dims& d = c.d;
  d.B = c.rank == 4 ? pick(f, kHuge) : 1;
  d.Hkv = c.rank >= 3 ? pick(f, kHuge) : 1;
  d.Hq = c.rank >= 3 ? (f.ConsumeBool() ? d.Hkv : 0) : 1;
  d.Nq = pick(f, kHuge); d.Nk = pick(f, kHuge); d.Dk = pick(f, kHuge); d.Dv = pick(f, kHuge);
  const uint8_t of = f.ConsumeIntegral<uint8_t>();
  // The ext byte's storage: 16-bit (float16 where the bool above picked float64); a float32 q
  // over a 16-bit k, v for storage 2.
  if (g_storage != 0) {
    c.kv = c.dtype == DType::kFloat64 ? DType::kFloat16 : DType::kBFloat16;
    c.dtype = g_storage == 2 ? DType::kFloat32 : c.kv;
  } else {
    c.kv = c.dtype;
  }
  if (c.all_bf16() && d.Dk == 0 && c.path_cap != sdpa::KernelPath::kSimd && skipping("bf16_dk0")) {  // F11
    c.path_cap = g_path_cap = sdpa::KernelPath::kSimd;
    sdpa::set_max_kernel_path(g_path_cap);
  }
  c.opt.precision = g_precision;
  c.opt.causal = static_cast<Causal>(of % 3);
  static const int64_t kWin[] = {-1, 0, 3, 100, int64_t{1} << 41, INT64_MAX};
  if (of & 4) c.opt.window = {pick(f, kWin), pick(f, kWin)};
  c.opt.backend = static_cast<Backend>(f.ConsumeIntegralInRange<int>(0, 3));
  if (of & 8) { c.opt.dropout_p = 0.5; c.opt.seed = 1; }
  if (of & 16) c.opt.scale = 0.5;
  auto numel = [](std::vector<int64_t> s) {
    __int128 n = 1;
    for (int64_t x : s) n = (x == 0 || n == 0) ? 0 : std::min<__int128>(n * x, __int128{1} << 64);
    return n;
  };
  constexpr __int128 kMax = 4096;
  const auto qs = last_dims(c.rank, {d.B, d.Hq, d.Nq, d.Dk}), ks = last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dk}),
             vs = last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dv}), os = c.out_shape(), ws = c.w_shape(), ls = c.lse_shape();
  // Every tensor we must allocate is small; at least one dim is huge.
  if (numel(qs) > kMax || numel(ks) > kMax || numel(vs) > kMax || numel(os) > kMax) return;
  if (std::max({d.B, d.Hq, d.Nq, d.Nk, d.Dk, d.Dv}) < (int64_t{1} << 20)) return;
  // The products of the dims must fit int64_t for a valid call (validation may refuse otherwise).
  c.want_lse = numel(ls) <= kMax && (of & 32);
  c.want_weights = numel(ws) <= kMax && (of & 64);
  const bool huge_ref = c.want_lse && d.Nk > (1 << 20) && (c.opt.backend == Backend::kReference || c.opt.backend == Backend::kNaive);
  if (huge_ref && skipping("huge_reference")) return;
  const LayoutSpec ls0 = decode_layout(f, true);
  c.q.init(c.dtype, qs, Role::kUnitLast, true, ls0);
  c.k.init(c.kv, ks, Role::kUnitLast, true, ls0);
  c.v.init(c.kv, vs, Role::kUnitLast, true, ls0);
  std::mt19937_64 rng(7);
  fill_values(c.q, rng, 1, 0);
  fill_values(c.k, rng, 1, 0);
  fill_values(c.v, rng, 1, 0);
  const uint8_t mf = f.ConsumeIntegral<uint8_t>();
  double bias = 0;
  bool full_mask = false;
  if (mf % 4 == 1) {  // a scalar (rank 0) or all-ones-shape mask: one bias for every score
    const bool b = mf & 4;
    c.mask.emplace(b ? DType::kBool : c.dtype, std::vector<int64_t>(static_cast<size_t>(f.ConsumeIntegralInRange<int>(0, c.rank)), 1), Role::kAny, true, LayoutSpec::plain());
    const double x = b ? ((mf & 8) ? 1.0 : 0.0) : ((mf & 8) ? -kInf : 1.5);
    c.mask->set_flat(0, x);
    bias = b ? (x != 0 ? 0.0 : -kInf) : x;
  } else if (mf % 4 == 2) {  // a full-shaped float mask: empty when the scores are
    if (numel(ws) > kMax && numel(ws) != 0) return;
    if (numel(ws) == 0 && std::max({d.B, d.Hq, d.Nq, d.Nk}) >= (int64_t{1} << 20) && skipping("huge_mask")) return;
    c.mask.emplace(f.ConsumeBool() ? DType::kBool : c.dtype, ws, Role::kAny, true, decode_layout(f, true));
    full_mask = true;
  }
  g_case = describe(c);
  if (g_print) std::fprintf(stderr, "attention_fuzz: case\n%s", g_case.c_str());
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  const auto t0 = std::chrono::steady_clock::now();
  bool threw = false;
  std::string what;
  try {
    sdpa::attention(c.inputs(), o.outputs(), c.opt);
  } catch (const sdpa::Error& e) {
    threw = true;
    what = e.what();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(secs < 2.0, "empty_fast", [&] { return "attention on empty views took " + num(secs) + " s"; });
  // An Error is acceptable only when an element count overflows int64_t.
  if (threw) {
    bool overflow = false;
    for (const auto& s : {qs, ks, vs, os}) {
      int64_t m = 1;
      for (int64_t x : s) if (__builtin_mul_overflow(m, x, &m)) overflow = true;
    }
    for (const auto& s : {ws, ls}) {
      int64_t m = 1;
      for (int64_t x : s) if (__builtin_mul_overflow(m, x, &m)) overflow = true;
    }
    check(overflow, "unexpected_error", [&] { return "attention threw on empty views with huge dims: " + what; });
    return;
  }
  check_outs_written(o);
  if (o.lse && d.Dk == 0 && !full_mask) {
    for (int64_t n = 0; n < o.lse->numel(); ++n) {
      const int64_t i = d.Nq > 0 ? n % d.Nq : 0;
      const int64_t cnt = sdpa_oracle::allowed_count(c.opt, d.Nq, d.Nk, i);
      const double want = (cnt == 0 || bias == -kInf) ? -kInf : bias + std::log(static_cast<double>(cnt));
      const double got = o.lse->flat(n);
      const double tol = 8 * sdpa_oracle::eps(c.compute()) * (1 + std::fabs(want));  // lse has the compute type
      check(got == want || std::fabs(got - want) <= tol, "empty_lse", [&] {
        return "lse[" + std::to_string(n) + "] = " + num(got) + ", want " + num(want) + " = bias + log(" + std::to_string(cnt) + " allowed keys) (Dk = 0: every score is the bias)";
      });
    }
  }
  if (d.Dk == 0 && !c.want_weights && c.opt.dropout_p == 0) {
    // Backward with the forward's out and lse: gradients are empty; must return quickly too.
    if (!o.lse || o.lse->numel() == 0) return;
    Tensor dout(c.dtype, os, Role::kUnitLast, true, LayoutSpec::plain());
    for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
    Grads g = make_grads(c, LayoutSpec::plain());
    const auto t1 = std::chrono::steady_clock::now();
    try {
      sdpa::attention_backward(c.inputs(), o.out.view(), o.lse->view(), dout.view(), g.gradients(), c.opt);
    } catch (const sdpa::Error&) {
    }
    const double s2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    check(s2 < 2.0, "empty_fast", [&] { return "attention_backward on empty views took " + num(s2) + " s"; });
  }
}

}  // namespace sdpa_fuzz
