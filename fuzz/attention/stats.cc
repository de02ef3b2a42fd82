// attention_fuzz: stats mode (Outputs::stats and Outputs::scores).
#include "harness.h"

namespace sdpa_fuzz {

// ---- Outputs::stats and Outputs::scores against kReference (stats mode: mode bits 0xa0) ----
//
// One more call of the case's backend with every statistic (allowed, entropy, entropy_normalized,
// max_weight, argmax, top k for k in [0, 32], pooled_weights for G in [0, 2 Nk + 3]) and the raw
// scores at one ScoresStage, in padded / permuted / negative-stride layouts; the same with
// kReference. Checked (names as in README.md here):
//   stats_invariant  out, weights, lse of that call bit for bit the case's own (stats change none)
//   stats_self       max_weight and the top-k weights bit for bit the call's weights at argmax and
//                    at the top-k keys; pooled_weights the weights summed in key order in the
//                    compute type (bit for bit for kFlash / kAuto, within a run's roundings else)
//   stats_rows       per row, from the oracle's score classes (classify, for each backend's
//                    arithmetic): allowed = the keys scoring above -inf, exactly; a row with a NaN
//                    score: entropy, normalized, max_weight, top-k weights NaN, argmax and indices
//                    -1; a row with no key above -inf: 0, 0, 0, -1, -1 / 0; +inf keys share the
//                    weight (max_weight 1 / count, entropy log count); normalized 0 where allowed <= 1
//   stats_rank       argmax and the top-k indices: allowed keys, distinct, the first
//                    min(k, allowed), then -1; never a key below another by more than the two scores'
//                    rounding bounds (the oracle's), among keys left out too; equal scores (+inf, or
//                    the same key row, bias and ALiBi term) in increasing key order; argmax = the
//                    first index. For kReference and the case's backend alike
//   stats_tolerance  (tame) entropy, entropy_normalized, max_weight, top-k weights and
//                    pooled_weights against kReference's by the tolerance rule (kNaive's measured
//                    error times 2, or 3 for float64 with float32's scaled; floors as check_tolerance,
//                    and for the entropy tests/stats_test.cc's e·max(4(1 + H), S2·spread));
//                    "stats_tolerance_near" within kNearFactor
//   scores           every element of Outputs::scores of both calls in the oracle's class at that
//                    stage (kScaled: x for every key below the sequence's length; kBiased / kFinal:
//                    -inf where causal, the window, a mask or the block mask blocks the key), exactly,
//                    and a finite one within the oracle's bound of its value (plus the rounding to
//                    the compute type, and underflow's absolute error); not judged where kAmbig
//   guards, unwritten for every view.

// An int64 output of the statistics (allowed, argmax, topk_indices), C order, exactly sized,
// every element first kSentinelIndex (unwritten if it stays).
constexpr int64_t kSentinelIndex = INT64_MIN + 0x5a5a;
struct IndexOut {
  std::vector<int64_t> shape, vals;
  explicit IndexOut(std::vector<int64_t> s) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    vals.assign(static_cast<size_t>(n), kSentinelIndex);
  }
  sdpa::TensorView view() {
    sdpa::TensorView t;
    t.data = vals.empty() ? nullptr : vals.data();
    t.dtype = DType::kInt64;
    t.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.shape[d] = shape[static_cast<size_t>(d)];
      t.strides[d] = stride;
      stride *= std::max<int64_t>(1, shape[static_cast<size_t>(d)]);
    }
    return t;
  }
  int64_t at(int64_t row, int64_t k, int64_t x) const { return vals[static_cast<size_t>(row * k + x)]; }
};

// A layout for a statistics output (no zero strides: outputs), from the mode's PRNG.
LayoutSpec stats_layout(std::mt19937_64& rng) {
  LayoutSpec ls;
  ls.perm = static_cast<uint8_t>(rng() % 24);
  ls.pad = static_cast<uint8_t>(rng() % 16);
  ls.neg = static_cast<uint8_t>(rng() % 16);
  ls.misalign = static_cast<uint8_t>(rng() % 3);
  ls.last = static_cast<uint8_t>(1 + rng() % 3);
  ls.odd_unit = rng() % 2;
  return ls;
}

struct StatsRun {
  Outs base;  // out, weights, lse
  Tensor entropy, normalized, max_weight, topk_w, pooled, scores;  // the compute type
  IndexOut allowed, argmax, topk_i;
  int64_t k = 0, G = 0;
  sdpa::ScoresStage stage = sdpa::ScoresStage::kFinal;
  sdpa::KernelPath path = sdpa::KernelPath::kSimd;
};

const char* stage_name(sdpa::ScoresStage s) {
  return s == sdpa::ScoresStage::kScaled ? "kScaled" : s == sdpa::ScoresStage::kBiased ? "kBiased" : "kFinal";
}

// The case's call on backend `be` with every statistic (top k if k > 0) and the scores at `stage`;
// layouts from rng where `fancy`, else plain.
StatsRun run_stats(const Case& c, Backend be, int64_t k, int64_t G, sdpa::ScoresStage stage, std::mt19937_64* rng) {
  const std::vector<int64_t> rows = c.lse_shape();
  std::vector<int64_t> top = rows, pool = rows;
  top.push_back(k);
  pool.push_back(G);
  const auto ls = [&] { return rng ? stats_layout(*rng) : LayoutSpec::plain(); };
  const DType ct = c.compute();
  StatsRun r{make_outs(c, true, true, false),
             Tensor(ct, rows, Role::kAny, false, ls()), Tensor(ct, rows, Role::kAny, false, ls()),
             Tensor(ct, rows, Role::kAny, false, ls()), Tensor(ct, top, Role::kAny, false, ls()),
             Tensor(ct, pool, Role::kAny, false, ls()), Tensor(ct, c.w_shape(), Role::kAny, false, ls()),
             IndexOut(rows), IndexOut(rows), IndexOut(top), k, G, stage};
  sdpa::Outputs o = r.base.outputs();
  o.stats.allowed = r.allowed.view();
  o.stats.entropy = r.entropy.view();
  o.stats.entropy_normalized = r.normalized.view();
  o.stats.max_weight = r.max_weight.view();
  o.stats.argmax = r.argmax.view();
  if (k > 0) {
    o.stats.topk_weights = r.topk_w.view();
    o.stats.topk_indices = r.topk_i.view();
  }
  o.stats.pooled_weights = r.pooled.view();
  o.scores = r.scores.view();
  o.scores_stage = stage;
  sdpa::Options opt = c.opt;
  opt.backend = be;
  expect_no_throw(be == Backend::kReference ? "attention (stats, kReference)" : "attention (stats)",
                  [&] { sdpa::attention(c.inputs(), o, opt); });
  r.path = sdpa::last_kernel_path();
  return r;
}

// Sets c.opt.backend for the oracle (classify reads the backend's arithmetic), restored on exit.
struct BackendAs {
  Case& c;
  Backend old;
  BackendAs(Case& cc, Backend be) : c(cc), old(cc.opt.backend) { c.opt.backend = be; }
  ~BackendAs() { c.opt.backend = old; }
};

// The per-row quantities the tolerance rule reads: measured kNaive errors of the weights and the
// entropy, and kReference's largest entropy and spread (stats_test.cc's entropy_of).
struct StatsTol {
  bool ok = false;
  double w = 0, h = 0;
};

// Per row: the largest entropy and Σ w |log w - mean| of the weights (how far a score error moves
// the entropy: at most max|δs| times this; tests/stats_test.cc).
void entropy_spread(const Case& c, const Tensor& weights, double& H_max, double& spread_max) {
  H_max = spread_max = 0;
  const Dims& d = c.d;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        double H = 0, mass = 0, mean = 0, spread = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double w = weights.at4(b, h, i, j);
          if (w > 0) H -= w * std::log(w), mass += w, mean += w * std::log(w);
        }
        if (mass > 0) mean /= mass;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double w = weights.at4(b, h, i, j);
          if (w > 0) spread += w * std::abs(std::log(w) - mean);
        }
        if (std::isfinite(H)) H_max = std::max(H_max, H);
        if (std::isfinite(spread)) spread_max = std::max(spread_max, spread);
      }
}

// kNaive's error against kReference on the weights and the entropy (plain layouts), scaled;
// false where their non-finite values differ (no tolerance can be derived: sdpa_oracle::naive_error).
bool measure_stats(const Case& c, int64_t k, int64_t G, double scale, StatsTol& t) {
  const StatsRun r = run_stats(c, Backend::kReference, k, G, sdpa::ScoresStage::kFinal, nullptr);
  const StatsRun n = run_stats(c, Backend::kNaive, k, G, sdpa::ScoresStage::kFinal, nullptr);
  return sdpa_oracle::naive_error("weights", n.base.weights->values(), r.base.weights->values(), scale, t.w).empty() &&
         sdpa_oracle::naive_error("entropy", n.entropy.values(), r.entropy.values(), scale, t.h).empty();
}

void check_stats(Case& c, const Outs& own) {
  const Dims& d = c.d;
  // The mode's draws: a PRNG seeded by the input's bytes (no byte of the input is consumed, so
  // every other check decodes and runs as it did).
  std::mt19937_64 rng(input_seed());
  static const int64_t kTopK[] = {0, 1, 2, 3, 5, 8, 31, 32};
  const int64_t k = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 33) : kTopK[rng() % 8];
  const int64_t Gs[] = {0, 1, 2, 7, d.Nk, d.Nk + 3, static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * d.Nk + 4))};
  const int64_t G = Gs[rng() % 7];
  const auto stage = static_cast<sdpa::ScoresStage>(rng() % 3);
  const Backend be = c.opt.backend;
  const std::string saved_case = g_case;
  g_case = saved_case + "stats mode: top k " + std::to_string(k) + ", pooled G " + std::to_string(G) + ", scores " +
           stage_name(stage) + "\n";
  const StatsRun A = run_stats(c, be, k, G, stage, &rng);
  const StatsRun R = run_stats(c, Backend::kReference, k, G, stage, nullptr);

  // Guards and unwritten elements.
  for (const auto& [t_, name_] : {std::pair<const Tensor*, const char*>{&A.entropy, "entropy"}, {&A.normalized, "entropy_normalized"},
                                {&A.max_weight, "max_weight"}, {&A.topk_w, "topk_weights"}, {&A.pooled, "pooled_weights"},
                                {&A.scores, "scores"}}) {
    const Tensor* t = t_;
    const char* name = name_;
    if (t == &A.topk_w && k == 0) {
      check(t->guards_and_written().rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + " (not requested) was written"; });
      continue;
    }
    const std::string r = t->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  }
  for (const auto& [t_, name_] : {std::pair<const IndexOut*, const char*>{&A.allowed, "allowed"}, {&A.argmax, "argmax"}, {&A.topk_i, "topk_indices"}}) {
    const IndexOut* t = t_;
    const char* name = name_;
    if (t == &A.topk_i && k == 0) continue;
    const auto it = std::find(t->vals.begin(), t->vals.end(), kSentinelIndex);
    check(it == t->vals.end(), "unwritten", [&] { return std::string(name) + "[" + std::to_string(it - t->vals.begin()) + "] was not written"; });
  }
  {
    std::string why;
    check(own.bitwise_equal(A.base, why), "stats_invariant", [&] { return "the same call with every statistic and the scores requested differs: " + why; });
  }

  // stats_self: the statistics' weights are the call's own weights, bit for bit.
  const auto self = [&](const StatsRun& X) {
    const bool fused = &X == &A && (be == Backend::kFlash || be == Backend::kAuto);
    const Tensor& W = *X.base.weights;
    const double e = sdpa_oracle::eps(c.compute());
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t i = 0; i < d.Nq; ++i) {
          const int64_t row = (b * d.Hq + h) * d.Nq + i;
          const std::string at = "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i);
          const int64_t am = X.argmax.at(row, 1, 0);
          if (am >= 0 && am < d.Nk) {
            const double mw = X.max_weight.at4(0, b, h, i), w = W.at4(b, h, i, am);
            check(same_bits(mw, w) || (std::isnan(mw) && std::isnan(w)), "stats_self",
                  [&] { return "max_weight" + at + "] = " + num(mw) + " but weights at argmax " + std::to_string(am) + " = " + num(w); });
          }
          for (int64_t x = 0; x < X.k; ++x) {
            const int64_t j = X.topk_i.at(row, X.k, x);
            if (j < 0 || j >= d.Nk) continue;  // stats_rank judges the indices
            const double tw = X.topk_w.at4(b, h, i, x), w = W.at4(b, h, i, j);
            check(same_bits(tw, w) || (std::isnan(tw) && std::isnan(w)), "stats_self",
                  [&] { return "topk_weights" + at + ", " + std::to_string(x) + "] = " + num(tw) + " but weights at key " + std::to_string(j) + " = " + num(w); });
          }
          // pooled_weights: key j in run floor(j · G / Nk), summed in key order in the compute type.
          std::vector<double> sums(static_cast<size_t>(X.G), 0.0), mass(static_cast<size_t>(X.G), 0.0);
          std::vector<int64_t> len(static_cast<size_t>(X.G), 0);
          for (int64_t j = 0; j < d.Nk && X.G > 0; ++j) {
            const size_t g = static_cast<size_t>(static_cast<__int128>(j) * X.G / d.Nk);
            const double w = W.at4(b, h, i, j);
            sums[g] = c.compute() == DType::kFloat32 ? static_cast<double>(static_cast<float>(sums[g]) + static_cast<float>(w)) : sums[g] + w;
            mass[g] += std::fabs(w);
            ++len[g];
          }
          for (int64_t g = 0; g < X.G; ++g) {
            const double got = X.pooled.at4(b, h, i, g), want = sums[static_cast<size_t>(g)];
            // Other backends sum in their own precision, rounded once: a run's worth of roundings.
            const double tol = fused ? 0.0 : e * static_cast<double>(len[static_cast<size_t>(g)] + 2) * mass[static_cast<size_t>(g)];
            check(same_bits(got, want) || (std::isnan(got) && std::isnan(want)) || std::fabs(got - want) <= tol, "stats_self",
                  [&] { return "pooled_weights" + at + ", " + std::to_string(g) + "] = " + num(got) + " but the weights of its run of keys sum to " + num(want) + " (tol " + num(tol) + ")"; });
          }
        }
  };
  self(A);
  self(R);

  // Equal scores by construction: the same key row (as values), mask bias and ALiBi term, or both
  // +inf. (Not on the bfloat16 dot-product path, where two tiles of keys may take different
  // arithmetic: F10.)
  std::vector<int64_t> krep(static_cast<size_t>(d.B * d.Hkv * d.Nk), -1);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t kvh = 0; kvh < d.Hkv; ++kvh) {
      std::map<std::vector<double>, int64_t> first;
      for (int64_t j = 0; j < d.Nk; ++j) {
        std::vector<double> row(static_cast<size_t>(d.Dk));
        for (int64_t e = 0; e < d.Dk; ++e) row[static_cast<size_t>(e)] = c.k.at4(b, kvh, j, e);
        krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)] = first.emplace(std::move(row), j).first->second;
      }
    }

  // stats_rows, stats_rank and scores for one call X of backend xb, from the oracle's classes.
  const auto judge = [&](const StatsRun& X, Backend xb) {
    BackendAs as(c, xb);
    const char* who = xb == Backend::kReference ? "kReference" : backend_name(be);
    const bool ties = !(c.all_bf16() && X.path != sdpa::KernelPath::kSimd);
    const double w_eps = sdpa_oracle::eps(c.compute());
    // Underflow's absolute error, beside the oracle's relative bound: q·scale and each product may
    // lose up to the smallest normal number each (the bfloat16 dot-product instructions flush
    // subnormals), so key j's scores carry (Dk + 2 + Σ_d |k_d|) · min_normal more.
    const double tiny = min_normal_of(c.compute());
    std::vector<double> floor_of(static_cast<size_t>(d.Nk));
    std::vector<Score> sc(static_cast<size_t>(d.Nk));
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t i = 0; i < d.Nq; ++i) {
          const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
          const std::string at = std::string(who) + " [b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i);
          int64_t n_nan = 0, n_pinf = 0, n_fin = 0, n_ambig = 0;
          for (int64_t j = 0; j < d.Nk; ++j) {
            double ksum = 0;
            for (int64_t e = 0; e < d.Dk; ++e) ksum += std::fabs(c.k.at4(b, kvh, j, e));
            floor_of[static_cast<size_t>(j)] = tiny * (ksum + static_cast<double>(d.Dk + 2));
            sc[static_cast<size_t>(j)] = classify(c, b, h, i, j);
            const Cls cl = sc[static_cast<size_t>(j)].cls;
            n_nan += cl == Cls::kNaN;
            n_pinf += cl == Cls::kPosInf;
            n_fin += cl == Cls::kFinite;
            n_ambig += cl == Cls::kAmbig;
          }
          // The scores output at X's stage: the oracle's class, exactly, and a finite one within its
          // bound (plus its rounding to the compute type, and underflow: q·scale and each product
          // may lose up to the smallest subnormal each).
          std::string bad_score;
          for (int64_t j = 0; j < d.Nk && bad_score.empty(); ++j) {
            Score s;
            if (j >= c.keys_of(b)) s.cls = Cls::kNegInf;  // never read: -inf at every stage
            else if (X.stage == sdpa::ScoresStage::kScaled) s = raw_score(c, b, h, i, j);
            else if (X.stage == sdpa::ScoresStage::kBiased) s = classify(c, b, h, i, j, /*capped=*/false);
            else s = sc[static_cast<size_t>(j)];
            if (s.cls == Cls::kBlocked) s.cls = Cls::kNegInf;
            if (s.cls == Cls::kAmbig) continue;
            const double got = X.scores.at4(b, h, i, j);
            const auto where = [&] { return "scores" + at + ", " + std::to_string(j) + "] = " + num(got) + " at " + stage_name(X.stage) + ", want "; };
            if (s.cls != Cls::kFinite) {
              const bool ok = s.cls == Cls::kNaN ? std::isnan(got) : got == (s.cls == Cls::kPosInf ? kInf : -kInf);
              if (!ok) bad_score = where() + (s.cls == Cls::kNaN ? "NaN" : s.cls == Cls::kPosInf ? "+inf" : "-inf");
              continue;
            }
            const long double tol = s.err + w_eps * std::fabs(s.s) + floor_of[static_cast<size_t>(j)];
            if (!(std::isfinite(got) && std::fabs(got - s.s) <= tol)) bad_score = where() + num(static_cast<double>(s.s)) + " within " + num(static_cast<double>(tol));
          }
          check(bad_score.empty(), "scores", [&] { return bad_score; });
          const int64_t allowed = X.allowed.at(row, 1, 0);
          const int64_t sure = n_pinf + n_fin;
          check(allowed >= sure && allowed <= sure + n_ambig, "stats_rows", [&] {
            return "allowed" + at + "] = " + std::to_string(allowed) + ", want " + std::to_string(sure) +
                   (n_ambig ? " to " + std::to_string(sure + n_ambig) : std::string()) + " (the keys scoring above -inf)";
          });
          if (n_ambig > 0) continue;
          const double H = X.entropy.at4(0, b, h, i), Hn = X.normalized.at4(0, b, h, i), mw = X.max_weight.at4(0, b, h, i);
          const int64_t am = X.argmax.at(row, 1, 0);
          const auto cls_msg = [&](const char* what) { return std::string("row") + at + "] " + what + ": entropy " + num(H) + ", normalized " + num(Hn) + ", max_weight " + num(mw) + ", argmax " + std::to_string(am); };
          if (n_nan > 0) {
            check(std::isnan(H) && std::isnan(Hn) && std::isnan(mw) && am == -1, "stats_rows", [&] { return cls_msg("has a NaN score (want NaN, NaN, NaN, -1)"); });
            for (int64_t x = 0; x < X.k; ++x) {
              const int64_t j = X.topk_i.at(row, X.k, x);
              const double tw = X.topk_w.at4(b, h, i, x);
              check(j == -1 && std::isnan(tw), "stats_rows", [&] { return "top " + std::to_string(x) + " of row" + at + "] with a NaN score: key " + std::to_string(j) + ", weight " + num(tw) + " (want -1, NaN)"; });
            }
            continue;
          }
          if (sure == 0) {
            check(H == 0 && Hn == 0 && mw == 0 && am == -1, "stats_rows", [&] { return cls_msg("has no key above -inf (want 0, 0, 0, -1)"); });
            for (int64_t x = 0; x < X.k; ++x) {
              const int64_t j = X.topk_i.at(row, X.k, x);
              const double tw = X.topk_w.at4(b, h, i, x);
              check(j == -1 && tw == 0, "stats_rows", [&] { return "top " + std::to_string(x) + " of row" + at + "] with no key: key " + std::to_string(j) + ", weight " + num(tw) + " (want -1, 0)"; });
            }
            continue;
          }
          if (allowed <= 1) check(Hn == 0, "stats_rows", [&] { return cls_msg("allows one key (want normalized 0)"); });
          if (n_pinf > 0) {
            const double want = 1.0 / static_cast<double>(n_pinf), Hw = std::log(static_cast<double>(n_pinf));
            check(std::fabs(mw - want) <= 4 * w_eps && std::fabs(H - Hw) <= static_cast<double>(d.Nk + 4) * w_eps * (1 + Hw), "stats_rows",
                  [&] { return cls_msg(("has " + std::to_string(n_pinf) + " keys at +inf (want max_weight " + num(want) + ", entropy " + num(Hw) + ")").c_str()); });
          }
          // stats_rank: argmax as a list of one, and the top k.
          const auto lo = [&](int64_t j) { const Score& s = sc[static_cast<size_t>(j)]; return s.cls == Cls::kPosInf ? static_cast<long double>(INFINITY) : s.s - s.err - floor_of[static_cast<size_t>(j)]; };
          const auto hi = [&](int64_t j) { const Score& s = sc[static_cast<size_t>(j)]; return s.cls == Cls::kPosInf ? static_cast<long double>(INFINITY) : s.s + s.err + floor_of[static_cast<size_t>(j)]; };
          const auto ranked = [&](int64_t j) { const Cls cl = sc[static_cast<size_t>(j)].cls; return cl == Cls::kFinite || cl == Cls::kPosInf; };
          const auto equal = [&](int64_t j1, int64_t j2) {
            const Cls c1 = sc[static_cast<size_t>(j1)].cls, c2 = sc[static_cast<size_t>(j2)].cls;
            if (c1 == Cls::kPosInf || c2 == Cls::kPosInf) return c1 == c2;
            return ties && krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j1)] == krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j2)] &&
                   same_bits(mask_bias(c, b, h, i, j1), mask_bias(c, b, h, i, j2)) && c.alibi(b, h, i, j1) == c.alibi(b, h, i, j2);
          };
          std::vector<int64_t> pos(static_cast<size_t>(d.Nk));
          const auto rank = [&](const std::vector<int64_t>& L, const char* name) {
            const int64_t n = std::min<int64_t>(static_cast<int64_t>(L.size()), sure);
            std::string why;  // the first violation
            std::fill(pos.begin(), pos.end(), INT64_MAX);  // each key's rank in L (INT64_MAX: left out)
            for (int64_t x = 0; x < static_cast<int64_t>(L.size()) && why.empty(); ++x) {
              const int64_t j = L[static_cast<size_t>(x)];
              if (x >= n) {
                if (j != -1) why = "rank " + std::to_string(x) + " past the " + std::to_string(sure) + " keys above -inf is not -1";
              } else if (!(j >= 0 && j < d.Nk && ranked(j) && pos[static_cast<size_t>(j)] == INT64_MAX)) {
                why = "rank " + std::to_string(x) + " is not a new key scoring above -inf";
              } else {
                pos[static_cast<size_t>(j)] = x;
              }
            }
            // A key ranked after jx (later in L, or left out) must not score surely above it: the
            // largest lower bound of the keys after each rank (a suffix maximum, from the keys left out).
            if (why.empty() && n > 0) {
              long double after = -INFINITY;
              int64_t after_j = -1;
              for (int64_t j = 0; j < d.Nk; ++j)
                if (ranked(j) && pos[static_cast<size_t>(j)] == INT64_MAX && lo(j) > after) after = lo(j), after_j = j;
              for (int64_t x = n - 1; x >= 0 && why.empty(); --x) {
                const int64_t jx = L[static_cast<size_t>(x)];
                if (after > hi(jx))
                  why = "key " + std::to_string(after_j) + " (score ~ " + num(static_cast<double>(sc[static_cast<size_t>(after_j)].s)) + ") is ranked after key " +
                        std::to_string(jx) + " (score ~ " + num(static_cast<double>(sc[static_cast<size_t>(jx)].s)) + ") but scores above it by more than rounding";
                if (lo(jx) > after) after = lo(jx), after_j = jx;
              }
            }
            // Nor a lower key with the same score (the key row compared first: cheap).
            for (int64_t x = 0; x < n && why.empty(); ++x) {
              const int64_t jx = L[static_cast<size_t>(x)];
              const int64_t rx = krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + jx)];
              for (int64_t j = 0; j < jx && why.empty(); ++j) {
                if (pos[static_cast<size_t>(j)] < x || !ranked(j)) continue;
                if (sc[static_cast<size_t>(j)].cls != Cls::kPosInf && krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)] != rx) continue;
                if (equal(j, jx))
                  why = "key " + std::to_string(j) + " has the score of key " + std::to_string(jx) +
                        " (the same key row, bias and ALiBi term, or +inf) but is ranked after it (equal scores go to the lower key)";
              }
            }
            check(why.empty(), "stats_rank", [&] {
              std::string s = std::string(name) + " of row" + at + "] = [";
              for (size_t x = 0; x < L.size(); ++x) s += (x ? ", " : "") + std::to_string(L[x]);
              return s + "]: " + why;
            });
          };
          rank({am}, "argmax");
          if (X.k > 0) {
            std::vector<int64_t> L(static_cast<size_t>(X.k));
            for (int64_t x = 0; x < X.k; ++x) L[static_cast<size_t>(x)] = X.topk_i.at(row, X.k, x);
            rank(L, "topk_indices");
            check(L[0] == am, "stats_rank", [&] { return "topk_indices" + at + ", 0] = " + std::to_string(L[0]) + " but argmax = " + std::to_string(am); });
            for (int64_t x = sure; x < X.k; ++x)
              check(X.topk_w.at4(b, h, i, x) == 0, "stats_rows", [&] { return "topk_weights" + at + ", " + std::to_string(x) + "] past the allowed keys is not 0"; });
          }
        }
  };
  judge(A, be);
  judge(R, Backend::kReference);

  // stats_tolerance (tame): against kReference by the tolerance rule.
  if (c.tame) {
    StatsTol t;
    bool ok = measure_stats(c, k, G, 1.0, t);
    if (ok && c.dtype == DType::kFloat64) ok = measure_stats(converted(c, DType::kFloat32), k, G, sdpa_oracle::kFloat64ErrorScale, t);
    const double factor = sdpa_oracle::naive_factor(c.dtype);
    if (ok) {
      const double e = sdpa_oracle::eps(c.compute());
      const double S2 = 2 * max_score_magnitude(c);
      const double sum_n = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.Nk)));
      double H_max = 0, spread = 0;
      entropy_spread(c, *R.base.weights, H_max, spread);
      const double tol_w = factor * t.w + e * (std::max(4.0, S2) + sum_n);
      const double tol_h = factor * t.h + e * (std::max(4 * (1 + H_max), S2 * spread) + sum_n * (1 + H_max));
      double ratio = 0;
      std::string first;
      const auto close = [&](const std::string& what, double got, double want, double tol) {
        if (std::isnan(got) && std::isnan(want)) return;
        const bool inf = std::isinf(got) || std::isinf(want);
        if (inf ? got == want : std::fabs(got - want) <= tol) return;
        const double r = inf || std::isnan(got) || std::isnan(want) ? kInf : std::fabs(got - want) / tol;
        if (r > ratio || first.empty()) {
          ratio = std::max(ratio, r);
          first = what + " = " + num(got) + ", kReference " + num(want) + ", tol " + num(tol) + " (" + num(r) + " x tol)";
        }
      };
      const Tensor& WR = *R.base.weights;
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.Hq; ++h)
          for (int64_t i = 0; i < d.Nq; ++i) {
            const int64_t row = (b * d.Hq + h) * d.Nq + i;
            const std::string at = "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i);
            if (std::isnan(R.entropy.at4(0, b, h, i)) || std::isnan(A.entropy.at4(0, b, h, i))) continue;  // stats_rows judges NaN rows
            check(A.allowed.at(row, 1, 0) == R.allowed.at(row, 1, 0), "stats_rows",
                  [&] { return "allowed" + at + "] = " + std::to_string(A.allowed.at(row, 1, 0)) + " but kReference's is " + std::to_string(R.allowed.at(row, 1, 0)); });
            close("entropy" + at + "]", A.entropy.at4(0, b, h, i), R.entropy.at4(0, b, h, i), tol_h);
            close("entropy_normalized" + at + "]", A.normalized.at4(0, b, h, i), R.normalized.at4(0, b, h, i), tol_h / std::log(2.0));
            // Where the two rank another key first (scores within rounding), the weight kReference
            // gives the key this call names.
            const int64_t am = A.argmax.at(row, 1, 0), amr = R.argmax.at(row, 1, 0);
            const double mw_ref = am == amr ? R.max_weight.at4(0, b, h, i) : am >= 0 ? WR.at4(b, h, i, am) : 0.0;
            close("max_weight" + at + "]", A.max_weight.at4(0, b, h, i), mw_ref, tol_w);
            for (int64_t x = 0; x < k; ++x) {
              const int64_t j = A.topk_i.at(row, k, x), jr = R.topk_i.at(row, k, x);
              const double want = j == jr ? R.topk_w.at4(b, h, i, x) : j >= 0 ? WR.at4(b, h, i, j) : 0.0;
              close("topk_weights" + at + ", " + std::to_string(x) + "]", A.topk_w.at4(b, h, i, x), want, tol_w);
            }
            for (int64_t g = 0; g < G; ++g) {
              // A run of n keys: n weights within tol_w each, and the sums' roundings.
              const int64_t first_key = static_cast<int64_t>((static_cast<__int128>(g) * d.Nk + G - 1) / G);
              const int64_t end_key = std::min<int64_t>(d.Nk, static_cast<int64_t>((static_cast<__int128>(g + 1) * d.Nk + G - 1) / G));
              const double n = static_cast<double>(std::max<int64_t>(0, end_key - first_key));
              close("pooled_weights" + at + ", " + std::to_string(g) + "]", A.pooled.at4(b, h, i, g), R.pooled.at4(b, h, i, g), n * tol_w + e * (n + 2));
            }
          }
      check(first.empty(), ratio <= kNearFactor ? "stats_tolerance_near" : "stats_tolerance",
            [&] { return std::string(backend_name(be)) + " vs kReference: " + first + "; worst " + num(ratio) + " x tol"; });
    }
  }
  g_case = saved_case;
}

}  // namespace sdpa_fuzz
