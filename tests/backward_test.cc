// attention_backward(): the fused kernel (kFlash, kAuto) against the float64 kReference over a
// table of cases with the tolerance rule; kReference against an independent oracle and against
// central finite differences of the forward; exact zeros where nothing is allowed; bitwise
// thread invariance; argument validation (an error names the argument and writes nothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "sdpa/attention.h"
#include "backward_util.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

// ---- Structure: what nothing may see gets exactly zero gradient ----

bool allowed(const Tensors& t, const sdpa::Options& o, const Dims& d, int64_t b, int64_t h, int64_t i, int64_t j) {
  (void)d;
  if (!key_allowed(t, o, b, i, j)) return false;
  if (!t.mask) return true;
  const double m = t.mask->at(b, h, i, j);
  return t.mask->dtype() == DType::kBool ? m != 0 : m != -kInf;
}

// dq of a query row with no allowed key, and dk, dv of a key that no query of its group may
// see, are exactly 0; nothing is NaN. Returns how many such rows and keys there were.
testing::AssertionResult blocked_are_exact(const Tensors& t, const sdpa::Options& o, const Grads& got,
                                           int64_t* empty_rows = nullptr, int64_t* unseen_keys = nullptr) {
  const Dims d = dims_of(t);
  if (auto r = no_nan(values(got)); !r) return r;
  int64_t rows = 0, keys = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t kvh = 0; kvh < d.Hkv; ++kvh) {
      std::vector<bool> seen(static_cast<size_t>(d.Nk), false);
      for (int64_t h = kvh * d.group; h < (kvh + 1) * d.group; ++h) {
        for (int64_t i = 0; i < d.Nq; ++i) {
          bool any = false;
          for (int64_t j = 0; j < d.Nk; ++j) {
            if (allowed(t, o, d, b, h, i, j)) any = seen[j] = true;
          }
          if (any) continue;
          ++rows;
          for (int64_t c = 0; c < d.Dk; ++c) {
            if (got.dq.at(b, h, i, c) != 0) {
              return testing::AssertionFailure() << "dq[" << b << "," << h << "," << i << "," << c
                                                 << "] = " << got.dq.at(b, h, i, c) << " but the row has no allowed key";
            }
          }
        }
      }
      for (int64_t j = 0; j < d.Nk; ++j) {
        if (seen[j]) continue;
        ++keys;
        for (int64_t c = 0; c < d.Dk; ++c) {
          if (got.dk.at(b, kvh, j, c) != 0) {
            return testing::AssertionFailure() << "dk[" << b << "," << kvh << "," << j << "," << c
                                               << "] = " << got.dk.at(b, kvh, j, c) << " but no query sees that key";
          }
        }
        for (int64_t e = 0; e < d.Dv; ++e) {
          if (got.dv.at(b, kvh, j, e) != 0) {
            return testing::AssertionFailure() << "dv[" << b << "," << kvh << "," << j << "," << e
                                               << "] = " << got.dv.at(b, kvh, j, e) << " but no query sees that key";
          }
        }
      }
    }
  }
  if (empty_rows) *empty_rows = rows;
  if (unseen_keys) *unseen_keys = keys;
  return testing::AssertionSuccess();
}

// ---- The case table: the forward sweep's (sweep_cases() in test_util.cc) ----
//
// It crosses the backward's own cuts too: key blocks of 2 SIMD vectors of rows (16 or 32 with
// AVX-512), 128-row query tiles per key block and 128-key tiles per query block.
std::vector<Case> backward_cases() { return sweep_cases(); }

int64_t backward_seed(const Case& c) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name, as make_inputs seeds its data
  for (unsigned char ch : c.name + "/dout") h = (h ^ ch) * 1099511628211ull;
  return static_cast<int64_t>(h & 0xffffffffu);
}

Problem make_case(const Case& c) {
  return make_problem(make_inputs(c), options(c, Backend::kAuto), c.layout, static_cast<uint32_t>(backward_seed(c)));
}

// ---- The sweep: kFlash and kAuto against kReference on every case, on every path ----

// kFlash's and kAuto's gradients on one path against the case's reference and tolerances.
void check_backward_path(const Case& c, const Problem& p, const Expected& e) {
  std::optional<Grads> flash;
  for (Backend backend : {Backend::kFlash, Backend::kAuto}) {
    SCOPED_TRACE(backend_name(backend));
    const sdpa::Options o = options(c, backend);
    Grads got = backward(p, o, c.layout);
    EXPECT_TRUE(got.guards_intact());
    for (const GuardedTensor* in : {&p.t.q, &p.t.k, &p.t.v, &p.out, &p.lse, &p.dout}) EXPECT_TRUE(in->guards_intact());
    if (p.t.mask) {
      EXPECT_TRUE(p.t.mask->guards_intact());
    }
    EXPECT_TRUE(blocked_are_exact(p.t, o, got));
    EXPECT_TRUE(matches(e, got));
    if (flash) {
      EXPECT_TRUE(bitwise_equal(got, *flash)) << "kAuto is documented to be kFlash today";
    } else {
      flash.emplace(std::move(got));
    }
  }
}

// The AVX2 pass takes every float32 case, and the others up to 2M multiply-adds (float64's
// 4-lane blocks cut the small shapes differently; its large cases add time more than coverage).
bool avx2_backward_case(const Case& c) { return c.dtype == kF32 || work(c) <= 2'000'000; }

// Every path this machine has, against one reference (computed once: it is most of a case's
// time), from one forward's out and lse (the best path's): the best target; AVX2 alone (the
// product's target machine may have only AVX2); and, for bfloat16 where the best pass runs on
// AMX, AVX512_BF16. A path the machine lacks is left out here; SimdTargets.* report it as
// skipped with the reason.
void check_backward_case(const Case& c) {
  const Problem p = make_case(c);
  Expected e;
  ASSERT_TRUE(expected(p, options(c, Backend::kReference), e));
  {
    SCOPED_TRACE("best path");
    check_backward_path(c, p, e);
  }
  if (avx2_backward_case(c) && avx2_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX2");
    const Avx2Only avx2;
    check_backward_path(c, p, e);
    EXPECT_EQ(dispatched_target(), "AVX2");
  }
  if (c.dtype == kBF16 && bf16_dot_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX512_BF16");
    const KernelPathCap cap(sdpa::KernelPath::kAvx512Bf16);
    check_backward_path(c, p, e);
  }
}

class BackwardSweep : public testing::TestWithParam<Case> {};

TEST_P(BackwardSweep, EveryPathMatchesReference) { check_backward_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Table, BackwardSweep, testing::ValuesIn(backward_cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(BackwardTable, CoversWhatItClaims) {
  // The table above is the coverage: keep it honest.
  const std::vector<Case> cases = backward_cases();
  int masked_rows = 0, unseen_keys = 0, strided = 0, gqa = 0, big = 0;
  for (const Case& c : cases) {
    if (c.layout != Layout::kContiguous) ++strided;
    if (c.Hq != c.Hkv) ++gqa;
    if (c.Nq > 128 && c.Nk > 128) ++big;
    if (c.dtype != kF32 || work(c) > 3'000'000) continue;
    const Problem p = make_case(c);
    const sdpa::Options o = options(c, Backend::kFlash);
    int64_t rows = 0, keys = 0;
    ASSERT_TRUE(blocked_are_exact(p.t, o, backward(p, o), &rows, &keys)) << c.name;
    masked_rows += rows > 0;
    unseen_keys += keys > 0;
  }
  EXPECT_GE(cases.size(), 100u);
  EXPECT_GE(masked_rows, 8) << "cases with query rows that see no key";
  EXPECT_GE(unseen_keys, 8) << "cases with keys that no query sees";
  EXPECT_GE(strided, 20);
  EXPECT_GE(gqa, 20);
  EXPECT_GE(big, 2);
}

// ---- kReference, the yardstick, against an independent oracle and finite differences ----

TEST(BackwardReference, MatchesIndependentOracleOnTheSmallCases) {
  int checked = 0;
  for (const Case& c : backward_cases()) {
    if (work(c) > 300'000) continue;
    SCOPED_TRACE(c.name);
    const Problem p = make_case(c);
    const sdpa::Options o = options(c, Backend::kReference);
    const GradValues want = backward_oracle(p, o);
    const GradValues got = values(backward(p, o, c.layout));
    // Both compute in float64 from the same values; then kReference rounds to the dtype.
    for (int n = 0; n < 3; ++n) {
      const double tol = (1e-12 + eps(c.dtype)) * std::max(1.0, max_abs_finite(want.g[n]));
      ASSERT_TRUE(all_near(kGradNames[n], got.g[n], want.g[n], tol));
    }
    ++checked;
  }
  EXPECT_GT(checked, 60) << checked;
}

// f(q, k, v) = Σ out · G through the float64 kReference forward.
double functional(const Tensors& t, const GuardedTensor& G, const sdpa::Options& o) {
  sdpa::Options fo = o;
  fo.backend = Backend::kReference;
  const std::vector<double> out = run(t, fo, Layout::kContiguous, false).out.values();
  const std::vector<double> g = G.values();
  double f = 0;
  for (size_t n = 0; n < out.size(); ++n) f += out[n] * g[n];
  return f;
}

struct FdCase {
  const char* name;
  std::vector<int64_t> q, k, v;
  std::optional<double> scale = std::nullopt;
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  int mask = 0;  // 0 none, 1 bool (Nq, Nk) with row 1 fully blocked, 2 additive (Nq, Nk)
  sdpa::Options options() const {
    sdpa::Options o;
    o.scale = scale;
    o.causal = causal;
    o.window = window;
    return o;
  }
};

TEST(BackwardReference, MatchesCentralFiniteDifferences) {
  const FdCase cases[] = {
      {"rank 2", {3, 3}, {4, 3}, {4, 2}},
      {"rank 2 scale", {4, 2}, {3, 2}, {3, 3}, -0.8},
      {"rank 3 GQA causal bottom-right", {4, 3, 2}, {2, 5, 2}, {2, 5, 3}, std::nullopt, Causal::kBottomRight},
      {"rank 4 MQA causal top-left", {2, 3, 2, 2}, {2, 1, 4, 2}, {2, 1, 4, 2}, std::nullopt, Causal::kTopLeft},
      {"window", {2, 4, 3}, {2, 5, 3}, {2, 5, 2}, std::nullopt, Causal::kNone, {1, 1}},
      {"bool mask, empty row", {4, 3}, {5, 3}, {5, 2}, std::nullopt, Causal::kNone, {}, 1},
      {"additive mask, GQA", {2, 3, 2}, {1, 4, 2}, {1, 4, 2}, std::nullopt, Causal::kNone, {}, 2},
  };
  const double h = 1e-5;
  for (const FdCase& fc : cases) {
    SCOPED_TRACE(fc.name);
    std::mt19937 rng(99);
    Tensors t{GuardedTensor(kF64, fc.q), GuardedTensor(kF64, fc.k), GuardedTensor(kF64, fc.v), std::nullopt};
    fill_normal(t.q, rng);
    fill_normal(t.k, rng);
    fill_normal(t.v, rng);
    const int64_t Nq = fc.q[fc.q.size() - 2], Nk = fc.k[fc.k.size() - 2];
    if (fc.mask) {
      t.mask.emplace(fc.mask == 1 ? DType::kBool : kF64, std::vector<int64_t>{Nq, Nk});
      fill_mask(*t.mask, rng, 0.7, 0.0);
      t.mask->set(0, fc.mask == 1 ? 1.0 : 0.5);  // row 0 sees key 0
      if (fc.mask == 1) {
        for (int64_t j = 0; j < Nk; ++j) t.mask->set(Nk + j, 0);  // row 1 sees nothing
      }
    }
    Problem p = make_problem(std::move(t), fc.options(), Layout::kContiguous, 5);
    // Central differences, element by element, of q, k and v.
    GradValues fd;
    GuardedTensor* xs[3] = {&p.t.q, &p.t.k, &p.t.v};
    for (int n = 0; n < 3; ++n) {
      for (int64_t e = 0; e < xs[n]->numel(); ++e) {
        const double x = xs[n]->get(e);
        xs[n]->set(e, x + h);
        const double fp = functional(p.t, p.dout, fc.options());
        xs[n]->set(e, x - h);
        const double fm = functional(p.t, p.dout, fc.options());
        xs[n]->set(e, x);
        fd.g[n].push_back((fp - fm) / (2 * h));
      }
    }
    for (Backend backend : {Backend::kReference, Backend::kFlash, Backend::kNaive}) {
      SCOPED_TRACE(backend_name(backend));
      sdpa::Options o = fc.options();
      o.backend = backend;
      const GradValues got = values(backward(p, o));
      for (int n = 0; n < 3; ++n) {
        // Truncation (h²) and rounding (eps / h) are ~1e-10 here; a wrong factor is ~0.1.
        const double mag = max_abs_finite(fd.g[n]);
        EXPECT_GT(mag, 1e-3) << kGradNames[n] << ": nothing to check";
        EXPECT_TRUE(all_near(kGradNames[n], got.g[n], fd.g[n], 1e-7 * std::max(1.0, mag)));
      }
    }
  }
}

// ---- The float64 cases of the sweep against finite differences ----
//
// Along a random direction u = (uq, uk, uv), the derivative of f = Σ out · dout is
// Σ dq·uq + dk·uk + dv·uv; central differences of f through the float64 kReference forward
// approximate it to O(h²) truncation plus O(eps · F / h) rounding, F = Σ |out · dout|. The
// tolerance 1e-8 · (S + F), S = Σ |dq·uq| + ..., sits ~50x above both at h = 1e-6 and far
// below the error of any wrong term (a missing or doubled contribution moves it by O(S)).

class BackwardDirectional : public testing::TestWithParam<Case> {};

TEST_P(BackwardDirectional, AutoMatchesCentralDifferences) {
  const Case& c = GetParam();
  const Problem p = make_case(c);
  const sdpa::Options o = options(c, Backend::kAuto);
  const GradValues g = values(backward(p, o, c.layout));
  ASSERT_TRUE(no_nan(g));
  std::mt19937 rng(static_cast<uint32_t>(backward_seed(c)) + 1);
  std::normal_distribution<double> normal;
  const double h = 1e-6;
  Tensors plus = p.t.converted(kF64), minus = p.t.converted(kF64);
  GuardedTensor* xp[3] = {&plus.q, &plus.k, &plus.v};
  GuardedTensor* xm[3] = {&minus.q, &minus.k, &minus.v};
  double analytic = 0, S = 0;
  for (int n = 0; n < 3; ++n) {
    std::vector<double> x = xp[n]->values(), up = x, um = x;
    for (size_t e = 0; e < x.size(); ++e) {
      const double u = normal(rng);
      up[e] = x[e] + h * u;
      um[e] = x[e] - h * u;
      analytic += g.g[n][e] * u;
      S += std::abs(g.g[n][e] * u);
    }
    xp[n]->set_values(up);
    xm[n]->set_values(um);
  }
  const double numeric = (functional(plus, p.dout, o) - functional(minus, p.dout, o)) / (2 * h);
  const std::vector<double> out = p.out.values(), G = p.dout.values();
  double F = 0;
  for (size_t n = 0; n < out.size(); ++n) F += std::abs(out[n] * G[n]);
  EXPECT_NEAR(analytic, numeric, 1e-8 * (S + F)) << "S = " << S << ", F = " << F;
}

// The float64 cases up to 10M multiply-adds: this checks kReference (the yardstick of the
// sweep), whose arithmetic does not change with size; the larger ones only add time.
std::vector<Case> float64_backward_cases() {
  std::vector<Case> f64;
  for (const Case& c : backward_cases()) {
    if (c.dtype == kF64 && work(c) <= 10'000'000) f64.push_back(c);
  }
  return f64;
}

INSTANTIATE_TEST_SUITE_P(Table, BackwardDirectional, testing::ValuesIn(float64_backward_cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

// ---- Small semantic checks for every backend ----

class BackwardSemantics : public testing::TestWithParam<Backend> {
 protected:
  sdpa::Options opts() const {
    sdpa::Options o;
    o.backend = GetParam();
    return o;
  }
};

INSTANTIATE_TEST_SUITE_P(Backends, BackwardSemantics,
                         testing::Values(Backend::kAuto, Backend::kFlash, Backend::kNaive, Backend::kReference),
                         [](const testing::TestParamInfo<Backend>& info) { return backend_name(info.param); });

TEST_P(BackwardSemantics, HandComputedExample) {
  // One query, two keys, Dk = Dv = 1, scale 1: s = (0, 1) for q = 1, k = (0, 1); v = (2, 5);
  // dout = 1. With a = e / (1 + e): P = (1 - a, a), out = 2 + 3a, dv = P, dP = (2, 5),
  // dS = P (dP - out) = 3a(1 - a) (-1, 1): dq = dS · k = 3a(1 - a), dk = dS · q = 3a(1 - a) (-1, 1).
  const double a = std::exp(1.0) / (1 + std::exp(1.0)), g = 3 * a * (1 - a);
  for (DType dt : {kF32, kF64}) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors t{tensor(dt, {1, 1}, {1}), tensor(dt, {2, 1}, {0, 1}), tensor(dt, {2, 1}, {2, 5}), std::nullopt};
    sdpa::Options o = opts();
    o.scale = 1.0;
    Problem p = make_problem(std::move(t), o, Layout::kContiguous, 1);
    p.dout.set(0, 1.0);
    const Grads got = backward(p, o);
    const double tol = 16 * eps(dt);
    EXPECT_TRUE(all_near("dq", got.dq.values(), {g}, tol));
    EXPECT_TRUE(all_near("dk", got.dk.values(), {-g, g}, tol));
    EXPECT_TRUE(all_near("dv", got.dv.values(), {1 - a, a}, tol));
  }
}

TEST_P(BackwardSemantics, EverythingMaskedGivesZeros) {
  for (DType dt : {kF32, kF64}) {
    for (DType mask_dtype : {DType::kBool, dt}) {
      SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " mask " + sdpa::dtype_name(mask_dtype));
      Tensors t = random_qkv(dt, {2, 2, 5, 4}, {2, 1, 7, 4}, {2, 1, 7, 3}, 3);
      t.mask = tensor(mask_dtype, {5, 7}, std::vector<double>(35, mask_dtype == DType::kBool ? 0.0 : -kInf));
      const Problem p = make_problem(std::move(t), opts(), Layout::kContiguous, 4);
      for (double x : p.lse.values()) ASSERT_EQ(x, -kInf);
      const GradValues v = values(backward(p, opts()));
      for (int n = 0; n < 3; ++n) EXPECT_EQ(v.g[n], std::vector<double>(v.g[n].size(), 0.0)) << kGradNames[n];
    }
  }
}

TEST_P(BackwardSemantics, EmptyDimsWriteZerosOrNothing) {
  for (DType dt : {kF32, kF64}) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    {  // Nk = 0: dq = 0; dk, dv have no elements.
      const Problem p = make_problem(random_qkv(dt, {2, 4, 3}, {1, 0, 3}, {1, 0, 5}, 5), opts(), Layout::kContiguous, 6);
      const Grads g = backward(p, opts());
      EXPECT_EQ(g.dq.values(), std::vector<double>(24, 0.0));
      EXPECT_TRUE(g.dk.untouched());
      EXPECT_TRUE(g.dv.untouched());
    }
    {  // Nq = 0: nothing depends on k and v, so dk = dv = 0 (written).
      const Problem p = make_problem(random_qkv(dt, {2, 0, 3}, {1, 4, 3}, {1, 4, 5}, 7), opts(), Layout::kContiguous, 8);
      const Grads g = backward(p, opts());
      EXPECT_TRUE(g.dq.untouched());
      EXPECT_EQ(g.dk.values(), std::vector<double>(12, 0.0));
      EXPECT_EQ(g.dv.values(), std::vector<double>(20, 0.0));
    }
    {  // B = 0: nothing at all.
      const Problem p =
          make_problem(random_qkv(dt, {0, 2, 3, 3}, {0, 1, 5, 3}, {0, 1, 5, 4}, 9), opts(), Layout::kContiguous, 10);
      const Grads g = backward(p, opts());
      EXPECT_TRUE(g.dq.untouched() && g.dk.untouched() && g.dv.untouched());
    }
  }
}

TEST_P(BackwardSemantics, GqaGradientsAreSumsOverRepeatedHeads) {
  // Query head h reads kv head h / group: dk, dv of GQA equal MHA's (kv heads repeated)
  // summed over each group.
  const int64_t B = 2, Hq = 6, Hkv = 2, G = 3, Nq = 5, Nk = 8, D = 4;
  for (DType dt : {kF32, kF64}) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Problem gqa = make_problem(random_qkv(dt, {B, Hq, Nq, D}, {B, Hkv, Nk, D}, {B, Hkv, Nk, D}, 11), opts(),
                                     Layout::kContiguous, 12);
    std::vector<double> k, v;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t j = 0; j < Nk; ++j)
          for (int64_t d = 0; d < D; ++d) {
            k.push_back(gqa.t.k.at(b, h / G, j, d));
            v.push_back(gqa.t.v.at(b, h / G, j, d));
          }
    Tensors rep{gqa.t.q.converted(dt, Layout::kContiguous), tensor(dt, {B, Hq, Nk, D}, k), tensor(dt, {B, Hq, Nk, D}, v),
                std::nullopt};
    Problem mha = make_problem(std::move(rep), opts(), Layout::kContiguous, 12);
    mha.dout.set_values(gqa.dout.values());
    const GradValues a = values(backward(gqa, opts())), m = values(backward(mha, opts()));
    std::vector<double> dk(a.g[1].size(), 0.0), dv(a.g[2].size(), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t x = 0; x < Nk * D; ++x) {
          dk[(b * Hkv + h / G) * Nk * D + x] += m.g[1][(b * Hq + h) * Nk * D + x];
          dv[(b * Hkv + h / G) * Nk * D + x] += m.g[2][(b * Hq + h) * Nk * D + x];
        }
    const double tol = dt == kF32 ? 2e-5 : 1e-13;
    EXPECT_TRUE(all_near("dq", a.g[0], m.g[0], tol));
    EXPECT_TRUE(all_near("dk", a.g[1], dk, tol));
    EXPECT_TRUE(all_near("dv", a.g[2], dv, tol));
  }
}

TEST_P(BackwardSemantics, StridedAndMisalignedViewsMatchContiguous) {
  for (DType dt : {kF32, kF64}) {
    Tensors base = random_qkv(dt, {2, 4, 37, 17}, {2, 2, 45, 17}, {2, 2, 45, 5}, 13);
    base.mask.emplace(dt, std::vector<int64_t>{4, 37, 45});
    std::mt19937 rng(14);
    fill_mask(*base.mask, rng, 0.7, 0.1);
    sdpa::Options o = opts();
    o.causal = Causal::kBottomRight;
    const Problem plain = make_problem(base.converted(dt), o, Layout::kContiguous, 15);
    const Grads want = backward(plain, o);
    for (Layout layout : {Layout::kPadded, Layout::kPermuted}) {
      SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + (layout == Layout::kPadded ? " padded" : " permuted"));
      Tensors s{base.q.converted(dt, layout), base.k.converted(dt, layout), base.v.converted(dt, layout),
                base.mask->converted(dt, layout)};
      Problem p{std::move(s), plain.out.converted(dt, layout), GuardedTensor(dt, plain.lse.shape(), layout, false),
                plain.dout.converted(dt, layout)};
      p.lse.set_values(plain.lse.values());
      const Grads got = backward(p, o, layout);
      EXPECT_TRUE(got.guards_intact());
      EXPECT_TRUE(bitwise_equal(got, want));
    }
  }
}

TEST_P(BackwardSemantics, RepeatedCallsAndThreadCountsAreBitwiseIdentical) {
  // Deterministic for any thread count: several key blocks per kv head, query blocks of
  // several heads (GQA), more than one 128-row query tile and 128-key tile.
  for (DType dt : {kF32, kF64}) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors t = random_qkv(dt, {2, 4, 150, 24}, {2, 2, 170, 24}, {2, 2, 170, 16}, 16);
    t.mask.emplace(dt, std::vector<int64_t>{150, 170});
    std::mt19937 rng(17);
    fill_mask(*t.mask, rng, 0.8, 0.05);
    sdpa::Options o = opts();
    o.causal = Causal::kTopLeft;
    const Problem p = make_problem(std::move(t), o, Layout::kContiguous, 18);
    sdpa::set_num_threads(1);
    const Grads one = backward(p, o);
    sdpa::set_num_threads(2);
    const Grads two = backward(p, o);
    sdpa::set_num_threads(3);
    const Grads three = backward(p, o);
    sdpa::set_num_threads(0);
    EXPECT_TRUE(bitwise_equal(one, two));
    EXPECT_TRUE(bitwise_equal(one, three));
    EXPECT_TRUE(bitwise_equal(backward(p, o), one));
  }
}

// ---- Validation: an error names the argument and nothing is written ----

class BackwardValidation : public testing::Test {
 protected:
  BackwardValidation() : p(make_problem(base_inputs(), {}, Layout::kContiguous, 3)), grads(empty_grads(p.t, Layout::kContiguous)) {
    in = p.t.inputs();
    out = p.out.view();
    lse = p.lse.view();
    dout = p.dout.view();
    g = grads.gradients();
  }

  static Tensors base_inputs() {
    Tensors t = random_qkv(kF32, {2, 4, 3, 4}, {2, 2, 5, 4}, {2, 2, 5, 6}, 1);
    t.mask.emplace(DType::kBool, std::vector<int64_t>{3, 5});
    std::mt19937 rng(2);
    fill_mask(*t.mask, rng, 0.7, 0.0);
    return t;
  }

  void call() { sdpa::attention_backward(in, out, lse, dout, g, options); }

  // Must throw sdpa::Error whose message contains every substring, and write nothing.
  void expect_error(const std::vector<std::string>& substrings) {
    expect_sdpa_error([&] { call(); }, substrings);
    EXPECT_TRUE(grads.dq.untouched());
    EXPECT_TRUE(grads.dk.untouched());
    EXPECT_TRUE(grads.dv.untouched());
  }

  Problem p;
  Grads grads;
  sdpa::Inputs in;
  sdpa::TensorView out, lse, dout;
  sdpa::Gradients g;
  sdpa::Options options;
};

TEST_F(BackwardValidation, TheBaseCallIsValid) {
  // Otherwise every test below would pass for the wrong reason.
  for (Backend b : {Backend::kAuto, Backend::kFlash, Backend::kReference, Backend::kNaive}) {
    options.backend = b;
    EXPECT_NO_THROW(call()) << backend_name(b);
  }
  EXPECT_FALSE(grads.dq.untouched());
  EXPECT_FALSE(grads.dk.untouched());
  EXPECT_FALSE(grads.dv.untouched());
}

TEST_F(BackwardValidation, WrongGradientShapes) {
  GuardedTensor dq_small(kF32, {2, 4, 3, 3}), dk_heads(kF32, {2, 4, 5, 4}), dv_keys(kF32, {2, 2, 4, 6});
  g.dq = dq_small.view();
  expect_error({"dq has shape (2, 4, 3, 3) but must be (2, 4, 3, 4)", "shape of q"});
  EXPECT_TRUE(dq_small.untouched());
  g = grads.gradients();
  g.dk = dk_heads.view();
  expect_error({"dk has shape (2, 4, 5, 4) but must be (2, 2, 5, 4)", "shape of k"});
  g = grads.gradients();
  g.dv = dv_keys.view();
  expect_error({"dv has shape (2, 2, 4, 6) but must be (2, 2, 5, 6)", "shape of v"});
}

TEST_F(BackwardValidation, WrongGradientRankDtypeOrStride) {
  GuardedTensor dq3(kF32, {4, 3, 4}), dq64(kF64, {2, 4, 3, 4}), dq_strided(kF32, {2, 4, 3, 4}, Layout::kPadded, false);
  g.dq = dq3.view();
  expect_error({"dq has shape (4, 3, 4) but must be (2, 4, 3, 4)"});
  g.dq = dq64.view();
  expect_error({"dq has dtype float64 but q has dtype float32"});
  g.dq = dq_strided.view();
  expect_error({"dq must have stride 1 in its last dim"});
  g.dq = grads.dq.view();
  g.dq.rank = 5;
  expect_error({"dq has rank 5"});
  g.dq = grads.dq.view();
  g.dq.data = nullptr;
  expect_error({"dq has no data"});
}

TEST_F(BackwardValidation, WrongDoutOutOrLse) {
  GuardedTensor dout_small(kF32, {2, 4, 3, 5}), out_small(kF32, {2, 4, 2, 6}), lse_small(kF32, {2, 4, 2});
  GuardedTensor dout64(kF64, {2, 4, 3, 6});
  dout = dout_small.view();
  expect_error({"dout has shape (2, 4, 3, 5) but must be (2, 4, 3, 6)", "shape of out"});
  dout = dout64.view();
  expect_error({"dout has dtype float64"});
  dout = p.dout.view();
  out = out_small.view();
  expect_error({"out has shape (2, 4, 2, 6) but must be (2, 4, 3, 6)"});
  out = p.out.view();
  lse = lse_small.view();
  expect_error({"lse has shape (2, 4, 2) but must be (2, 4, 3)"});
  lse = p.lse.view();
  lse.data = nullptr;
  expect_error({"lse has no data"});
}

TEST_F(BackwardValidation, ForwardArgumentErrorsToo) {
  GuardedTensor k_dk(kF32, {2, 2, 5, 3});
  in.k = k_dk.view();
  expect_error({"k has Dk=3 but q has Dk=4"});
  in = p.t.inputs();
  GuardedTensor bad_mask(DType::kBool, {4, 5});
  in.mask = bad_mask.view();
  expect_error({"mask has shape (4, 5)"});
  in = p.t.inputs();
  options.scale = std::numeric_limits<double>::quiet_NaN();
  expect_error({"scale must be finite"});
  options = {};
  options.backend = static_cast<Backend>(42);
  expect_error({"backend"});
}

}  // namespace
