// What attention() computes: hand-checked examples and properties (for every backend), the
// reference against an independent oracle, and the table-driven sweep of kAuto vs kReference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

constexpr DType kDTypes[] = {kF32, kF64};

Tensors qkv(GuardedTensor q, GuardedTensor k, GuardedTensor v, std::optional<GuardedTensor> mask = std::nullopt) {
  return {std::move(q), std::move(k), std::move(v), std::move(mask)};
}

GuardedTensor random_mask(DType dtype, std::vector<int64_t> shape, uint32_t seed, double density = 0.6) {
  std::mt19937 rng(seed);
  GuardedTensor m(dtype, std::move(shape));
  fill_mask(m, rng, density, 0.0);
  return m;
}

// Every output present in `got` within an absolute tolerance of `want`, for small problems with
// values of order `magnitude`: the seed's atol of 1e-6 in float32, 1e-12 in float64.
testing::AssertionResult near(const Outs& got, const Values& want, double magnitude = 1.0) {
  const double tol = (got.out.dtype() == kF32 ? 1e-6 : 1e-12) * magnitude;
  const Values g = values(got);
  if (auto r = all_close("out", g.out, want.out, tol); !r) return r;
  if (got.weights) {
    if (auto r = all_close("weights", g.weights, want.weights, tol); !r) return r;
  }
  if (got.lse) return all_close("lse", g.lse, want.lse, tol);
  return testing::AssertionSuccess();
}

// Each semantic test runs on every backend: they all promise the same contract.
class Semantics : public testing::TestWithParam<Backend> {
 protected:
  sdpa::Options opts() const {
    sdpa::Options o;
    o.backend = GetParam();
    return o;
  }
  // Runs t, checks guards, the tolerance rule against kReference and exact blocked entries.
  Outs checked_run(const Tensors& t, const sdpa::Options& o) const {
    Outs got = run(t, o);
    EXPECT_TRUE(got.guards_intact());
    EXPECT_TRUE(matches_reference(t, o, got));
    EXPECT_TRUE(blocked_are_exact(t, o, got));
    return got;
  }
};

INSTANTIATE_TEST_SUITE_P(Backends, Semantics,
                         testing::Values(Backend::kAuto, Backend::kFlash, Backend::kNaive, Backend::kReference),
                         [](const testing::TestParamInfo<Backend>& info) { return testing::PrintToString(info.param); });

// ---- Seed 001's examples and seed 000's toy head ----

TEST_P(Semantics, SeedExampleUniformAveragesValues) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Tensors t = qkv(tensor(dt, {2, 2}, {0, 0, 0, 0}), tensor(dt, {2, 2}, {0, 0, 0, 0}),
                          tensor(dt, {2, 2}, {1, 0, 0, 1}));
    const Outs got = checked_run(t, opts());
    // exp(0) = 1, 1 / 2 and 0.5 * 1 + 0.5 * 0 are exact in any precision.
    EXPECT_EQ(got.out.values(), (std::vector<double>{0.5, 0.5, 0.5, 0.5}));
    EXPECT_EQ(got.weights->values(), (std::vector<double>{0.5, 0.5, 0.5, 0.5}));
    EXPECT_TRUE(all_close("lse", got.lse->values(), {std::log(2.0), std::log(2.0)}, eps(dt)));
  }
}

TEST_P(Semantics, SeedExampleCausalMaskBlocksTheFuture) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const std::vector<double> want = {10, 15};  // query 0 sees V0; query 1 averages V0 and V1
    const Tensors masked = qkv(tensor(dt, {2, 1}, {0, 0}), tensor(dt, {2, 1}, {0, 0}), tensor(dt, {2, 1}, {10, 20}),
                               tensor(DType::kBool, {2, 2}, {1, 0, 1, 1}));
    EXPECT_EQ(checked_run(masked, opts()).out.values(), want);
    // With Nq == Nk both causal conventions are that same mask.
    const Tensors plain = qkv(tensor(dt, {2, 1}, {0, 0}), tensor(dt, {2, 1}, {0, 0}), tensor(dt, {2, 1}, {10, 20}));
    for (Causal c : {Causal::kTopLeft, Causal::kBottomRight}) {
      sdpa::Options o = opts();
      o.causal = c;
      EXPECT_EQ(checked_run(plain, o).out.values(), want);
    }
  }
}

TEST_P(Semantics, SeedToyHeadByHand) {
  // Q = [[1,0],[0,1]], K = [[1,0],[1,1],[0,1]], V = [[1,0],[0,2],[1,1]], d_k = 2.
  // S = Q Kᵀ/√2 = [[c, c, 0], [0, c, c]] with c = 1/√2; let a = e^c = 2.028114981647472.
  // A = [[a, a, 1], [1, a, a]] / (2a + 1);  O = A V = [[(a+1), (2a+1)], [(1+a), 3a]] / (2a + 1);
  // lse = log(2a + 1) for both rows.
  const double a0 = 0.4011120926797859, a1 = 0.1977758146404282;  // a / (2a+1), 1 / (2a+1)
  const std::vector<double> want_w = {a0, a0, a1, a1, a0, a0};
  const std::vector<double> want_o = {0.5988879073202141, 1.0, 0.5988879073202141, 1.2033362780393577};
  const std::vector<double> want_lse = {1.6206211390568515, 1.6206211390568515};
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Tensors t = qkv(tensor(dt, {2, 2}, {1, 0, 0, 1}), tensor(dt, {3, 2}, {1, 0, 1, 1, 0, 1}),
                          tensor(dt, {3, 2}, {1, 0, 0, 2, 1, 1}));
    const Outs got = checked_run(t, opts());
    const double tol = 8 * eps(dt);  // a handful of roundings on values of magnitude ~1
    EXPECT_TRUE(all_close("weights", got.weights->values(), want_w, tol));
    EXPECT_TRUE(all_close("out", got.out.values(), want_o, tol));
    EXPECT_TRUE(all_close("lse", got.lse->values(), want_lse, tol));
    const std::vector<double> w = got.weights->values();
    for (int row = 0; row < 2; ++row) EXPECT_NEAR(w[3 * row] + w[3 * row + 1] + w[3 * row + 2], 1.0, 3 * eps(dt));
  }
}

// ---- Seed 001's six properties ----

TEST_P(Semantics, OutputHasShapeNqByDvAndEveryElementIsWritten) {
  // Outputs start as NaN sentinels: a skipped element stays NaN, a stray write hits a guard.
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    for (const Tensors& t : {random_qkv(dt, {6, 4}, {6, 4}, {6, 4}, 1),
                             random_qkv(dt, {2, 3, 5, 4}, {2, 3, 7, 4}, {2, 3, 7, 6}, 2)}) {
      const Outs got = checked_run(t, opts());
      std::vector<int64_t> want = t.q.shape();
      want.back() = t.v.shape().back();
      EXPECT_EQ(got.out.shape(), want);
      const Values v = values(got);
      for (const auto* xs : {&v.out, &v.weights, &v.lse}) {
        EXPECT_TRUE(std::all_of(xs->begin(), xs->end(), [](double x) { return std::isfinite(x); }));
      }
    }
  }
}

TEST_P(Semantics, MatchesIndependentReferenceWithoutMask) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Tensors t = random_qkv(dt, {8, 16}, {8, 16}, {8, 16}, 3);
    EXPECT_TRUE(near(checked_run(t, opts()), oracle(t, opts()), 4));
  }
}

TEST_P(Semantics, ScalesScoresByOneOverSqrtDk) {
  // At d_k = 64 unscaled scores have std 8 and softmax is nearly one-hot: far from the answer.
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Tensors t = random_qkv(dt, {16, 64}, {16, 64}, {16, 64}, 4);
    const Outs got = checked_run(t, opts());
    EXPECT_TRUE(near(got, oracle(t, opts()), 4));
    sdpa::Options unscaled = opts();
    unscaled.scale = 1.0;
    const Values wrong = oracle(t, unscaled);
    double diff = 0;
    for (size_t n = 0; n < wrong.out.size(); ++n) diff = std::max(diff, std::abs(wrong.out[n] - got.out.get(n)));
    EXPECT_GT(diff, 0.1) << "the unscaled result is not a usable diagnostic";
    sdpa::Options explicit_scale = opts();
    explicit_scale.scale = 0.125;  // 1/√64, exact
    EXPECT_TRUE(bitwise_equal(run(t, explicit_scale), got));
  }
}

TEST_P(Semantics, HonoursCausalMask) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const int64_t T = 9;
    std::vector<double> tril(T * T);
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t j = 0; j < T; ++j) tril[i * T + j] = j <= i;
    }
    Tensors t = random_qkv(dt, {T, 4}, {T, 4}, {T, 4}, 5);
    t.mask = tensor(DType::kBool, {T, T}, tril);
    const Outs got = checked_run(t, opts());  // includes: weights above the diagonal exactly 0
    EXPECT_TRUE(near(got, oracle(t, opts()), 4));
    for (int d = 0; d < 4; ++d) EXPECT_EQ(got.out.get(d), t.v.get(d)) << "query 0 sees only key 0";
    // Changing the last key and value changes only the last query's row.
    for (int d = 0; d < 4; ++d) {
      t.k.set((T - 1) * 4 + d, 3.0);
      t.v.set((T - 1) * 4 + d, -5.0);
    }
    const Outs changed = run(t, opts());
    for (int64_t n = 0; n < (T - 1) * 4; ++n) ASSERT_EQ(changed.out.get(n), got.out.get(n)) << "element " << n;
    EXPECT_NE(changed.out.get(T * 4 - 1), got.out.get(T * 4 - 1));
  }
}

TEST_P(Semantics, OutputRowsAreConvexCombinationsOfValueRows) {
  for (DType dt : kDTypes) {
    for (double scale : {0.35, 8.0}) {  // moderate and nearly one-hot
      SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " scale " + std::to_string(scale));
      std::mt19937 rng(6);
      Tensors t = random_qkv(dt, {12, 5}, {12, 5}, {12, 5}, 6);
      fill_uniform(t.v, rng, -3.0, 7.0);
      sdpa::Options o = opts();
      o.scale = scale;
      const Outs got = checked_run(t, o);
      const double slack = 4 * eps(dt) * 7.0;  // a few roundings of the largest |v|
      for (int64_t i = 0; i < 12; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < 12; ++j) {
          EXPECT_GE(got.weights->at(0, 0, i, j), 0.0);
          sum += got.weights->at(0, 0, i, j);
        }
        EXPECT_NEAR(sum, 1.0, 12 * eps(dt)) << "row " << i;
        for (int64_t d = 0; d < 5; ++d) {
          double lo = kInf, hi = -kInf;
          for (int64_t j = 0; j < 12; ++j) {
            lo = std::min(lo, t.v.at(0, 0, j, d));
            hi = std::max(hi, t.v.at(0, 0, j, d));
          }
          EXPECT_GE(got.out.at(0, 0, i, d), lo - slack);
          EXPECT_LE(got.out.at(0, 0, i, d), hi + slack);
        }
      }
    }
  }
}

TEST_P(Semantics, AllTrueMaskEqualsNoMaskBitwise) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors t = random_qkv(dt, {2, 7, 5}, {2, 9, 5}, {2, 9, 3}, 7);
    const Outs plain = run(t, opts());
    for (double byte : {1.0, 2.0, 255.0}) {  // any non-zero byte attends
      t.mask = tensor(DType::kBool, {2, 7, 9}, std::vector<double>(2 * 7 * 9, byte));
      EXPECT_TRUE(bitwise_equal(run(t, opts()), plain)) << "mask byte " << byte;
    }
    t.mask = tensor(dt, {7, 9}, std::vector<double>(7 * 9, 0.0));  // an all-zero bias
    EXPECT_TRUE(bitwise_equal(run(t, opts()), plain));
  }
}

// ---- Causal conventions, masks and windows ----

TEST_P(Semantics, CausalBottomRightVersusTopLeftByHand) {
  // Equal scores and V = 1, 2, 4, 8: each output is the mean of the values a query sees.
  const auto check = [&](DType dt, int64_t nq, Causal causal, const std::vector<double>& want_w,
                         const std::vector<double>& want_out) {
    const int64_t nk = nq == 2 ? 4 : 2;
    const Tensors t = qkv(tensor(dt, {nq, 1}, std::vector<double>(nq, 0.0)), tensor(dt, {nk, 1}, std::vector<double>(nk, 0.0)),
                          tensor(dt, {nk, 1}, nk == 4 ? std::vector<double>{1, 2, 4, 8} : std::vector<double>{1, 2}));
    sdpa::Options o = opts();
    o.causal = causal;
    const Outs got = checked_run(t, o);
    EXPECT_TRUE(all_close("weights", got.weights->values(), want_w, 2 * eps(dt)));
    EXPECT_TRUE(all_close("out", got.out.values(), want_out, 32 * eps(dt)));
  };
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const double third = 1.0 / 3;
    // Nq = 2 < Nk = 4. Bottom-right: query i sees j <= i + 2. Top-left: j <= i.
    check(dt, 2, Causal::kBottomRight, {third, third, third, 0, .25, .25, .25, .25}, {7.0 / 3, 3.75});
    check(dt, 2, Causal::kTopLeft, {1, 0, 0, 0, .5, .5, 0, 0}, {1, 1.5});
    // Nq = 4 > Nk = 2. Bottom-right: query i sees j <= i - 2, so queries 0 and 1 see nothing.
    check(dt, 4, Causal::kBottomRight, {0, 0, 0, 0, 1, 0, .5, .5}, {0, 0, 1, 1.5});
    check(dt, 4, Causal::kTopLeft, {1, 0, .5, .5, .5, .5, .5, .5}, {1, 1.5, 1.5, 1.5});
    // Nq == Nk: the conventions coincide.
    const Tensors t = random_qkv(dt, {3, 11, 8}, {3, 11, 8}, {3, 11, 8}, 8);
    sdpa::Options br = opts(), tl = opts();
    br.causal = Causal::kBottomRight;
    tl.causal = Causal::kTopLeft;
    EXPECT_TRUE(bitwise_equal(run(t, br), run(t, tl)));
  }
}

TEST_P(Semantics, CausalAndMaskCombine) {
  // Allowed = causal AND mask: the same as the mask with the future also blocked.
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors t = random_qkv(dt, {2, 6, 4}, {2, 9, 4}, {2, 9, 4}, 9);
    t.mask = random_mask(DType::kBool, {2, 6, 9}, 10);
    sdpa::Options o = opts();
    o.causal = Causal::kBottomRight;
    const Outs got = checked_run(t, o);
    Tensors combined = t.converted(dt);
    for (int64_t n = 0; n < combined.mask->numel(); ++n) {
      const int64_t i = n / 9 % 6, j = n % 9;
      if (j > i + 3) combined.mask->set(n, 0);
    }
    EXPECT_TRUE(near(got, oracle(combined, opts()), 4));
  }
}

TEST_P(Semantics, WindowsByHand) {
  // Equal scores and V = 2^j: the weights show exactly which keys each query sees.
  struct WindowCase {
    const char* what;
    int64_t nq, nk;
    sdpa::Window window;
    Causal causal;
    std::function<bool(int64_t, int64_t)> sees;  // written out by hand, not from the header
  };
  const WindowCase cases[] = {
      {"left 1", 6, 6, {1, -1}, Causal::kNone, [](int64_t i, int64_t j) { return j >= i - 1; }},
      {"right 1", 6, 6, {-1, 1}, Causal::kNone, [](int64_t i, int64_t j) { return j <= i + 1; }},
      {"both 1", 6, 6, {1, 1}, Causal::kNone, [](int64_t i, int64_t j) { return j >= i - 1 && j <= i + 1; }},
      {"left 2 causal", 6, 6, {2, -1}, Causal::kBottomRight, [](int64_t i, int64_t j) { return j >= i - 2 && j <= i; }},
      {"right 2 causal", 6, 6, {-1, 2}, Causal::kTopLeft, [](int64_t i, int64_t j) { return j <= i; }},
      {"0,0 bottom-right", 2, 6, {0, 0}, Causal::kNone, [](int64_t i, int64_t j) { return j == i + 4; }},
      {"1,0 top-left causal", 3, 6, {1, 0}, Causal::kTopLeft,
       [](int64_t i, int64_t j) { return j <= i && j >= i + 3 - 1 && j <= i + 3; }},  // empty for every row
  };
  for (DType dt : kDTypes) {
    for (const WindowCase& c : cases) {
      SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " " + c.what);
      std::vector<double> v(c.nk);
      for (int64_t j = 0; j < c.nk; ++j) v[j] = std::ldexp(1.0, static_cast<int>(j));
      const Tensors t = qkv(tensor(dt, {c.nq, 1}, std::vector<double>(c.nq, 0.0)),
                            tensor(dt, {c.nk, 1}, std::vector<double>(c.nk, 0.0)), tensor(dt, {c.nk, 1}, v));
      sdpa::Options o = opts();
      o.window = c.window;
      o.causal = c.causal;
      const Outs got = checked_run(t, o);
      std::vector<double> want_w, want_out;
      for (int64_t i = 0; i < c.nq; ++i) {
        int64_t count = 0;
        double sum = 0;
        for (int64_t j = 0; j < c.nk; ++j) {
          if (c.sees(i, j)) {
            ++count;
            sum += v[j];
          }
        }
        for (int64_t j = 0; j < c.nk; ++j) want_w.push_back(c.sees(i, j) ? 1.0 / count : 0.0);
        want_out.push_back(count ? sum / count : 0.0);
      }
      EXPECT_TRUE(all_close("weights", got.weights->values(), want_w, 2 * eps(dt)));
      EXPECT_TRUE(all_close("out", got.out.values(), want_out, 256 * eps(dt)));
    }
  }
}

TEST_P(Semantics, HugeWindowBoundsMeanNoWindow) {
  // A bound larger than any sequence must behave like "unbounded", not overflow.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (DType dt : kDTypes) {
    for (int64_t nq : {2, 7}) {  // the aligned row i + Nk - Nq is positive, then negative
      for (Causal causal : {Causal::kNone, Causal::kTopLeft}) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " Nq " + std::to_string(nq));
        const Tensors t = random_qkv(dt, {nq, 4}, {5, 4}, {5, 4}, 11);
        sdpa::Options o = opts();
        o.causal = causal;
        const Outs plain = run(t, o);
        for (sdpa::Window w : {sdpa::Window{kMax, kMax}, sdpa::Window{kMax, -1}, sdpa::Window{-1, kMax}}) {
          o.window = w;
          EXPECT_TRUE(bitwise_equal(run(t, o), plain)) << "window " << w.left << ", " << w.right;
        }
      }
    }
  }
}

TEST_P(Semantics, ExplicitScale) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Tensors t = random_qkv(dt, {2, 5, 8}, {2, 7, 8}, {2, 7, 3}, 12);
    for (double scale : {0.37, -1.25}) {
      sdpa::Options o = opts();
      o.scale = scale;
      EXPECT_TRUE(near(checked_run(t, o), oracle(t, o), 4)) << "scale " << scale;
    }
    // scale 0: every score is 0, weights exactly uniform, out the column means.
    sdpa::Options o = opts();
    o.scale = 0.0;
    const Outs got = checked_run(t, o);
    EXPECT_TRUE(all_close("weights", got.weights->values(), std::vector<double>(2 * 5 * 7, 1.0 / 7), eps(dt)));
    std::vector<double> means;
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < 5; ++i) {
        for (int64_t d = 0; d < 3; ++d) {
          double sum = 0;
          for (int64_t j = 0; j < 7; ++j) sum += t.v.at(0, h, j, d);
          means.push_back(sum / 7);
        }
      }
    }
    EXPECT_TRUE(all_close("out", got.out.values(), means, 32 * eps(dt)));
  }
}

TEST_P(Semantics, GroupedQueryAttentionEqualsRepeatedKvHeads) {
  // Query head h reads kv head h / (Hq / Hkv): repeat each kv head Hq / Hkv times in a row.
  for (DType dt : kDTypes) {
    for (int64_t hkv : {6, 3, 2, 1}) {  // group sizes 1, 2, 3 and MQA
      SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " Hkv " + std::to_string(hkv));
      const int64_t B = 2, Hq = 6, Nq = 5, Nk = 9, D = 4, group = Hq / hkv;
      const Tensors t = random_qkv(dt, {B, Hq, Nq, D}, {B, hkv, Nk, D}, {B, hkv, Nk, D}, 13);
      std::vector<double> k, v;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < Hq; ++h) {
          for (int64_t j = 0; j < Nk; ++j) {
            for (int64_t d = 0; d < D; ++d) {
              k.push_back(t.k.at(b, h / group, j, d));
              v.push_back(t.v.at(b, h / group, j, d));
            }
          }
        }
      }
      const Tensors repeated = qkv(t.q.converted(dt, Layout::kContiguous), tensor(dt, {B, Hq, Nk, D}, k),
                                   tensor(dt, {B, Hq, Nk, D}, v));
      EXPECT_TRUE(near(checked_run(t, opts()), values(run(repeated, opts())), 4));
    }
  }
}

TEST_P(Semantics, FullyMaskedRowsGiveZeroAndMinusInfinity) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    // A bool row all False and an additive row all -inf (query 2 of head 1 in each).
    for (DType mask_dtype : {DType::kBool, dt}) {
      Tensors t = random_qkv(dt, {2, 4, 3}, {2, 5, 3}, {2, 5, 3}, 14);
      t.mask = random_mask(mask_dtype, {2, 4, 5}, 15, 0.9);
      for (int64_t j = 0; j < 5; ++j) t.mask->set((4 + 2) * 5 + j, mask_dtype == DType::kBool ? 0 : -kInf);
      const Outs got = checked_run(t, opts());
      const Values v = values(got);
      EXPECT_TRUE(no_nan(v));
      EXPECT_EQ(v.lse[4 + 2], -kInf);
      for (int d = 0; d < 3; ++d) EXPECT_EQ(v.out[(4 + 2) * 3 + d], 0.0);
      EXPECT_TRUE(std::isfinite(v.lse[4 + 1])) << "the other rows are unaffected";
    }
    // A window that excludes every key for the first rows (Nq > Nk, aligned bottom-right).
    {
      const Tensors t = random_qkv(dt, {5, 3}, {2, 3}, {2, 3}, 16);
      sdpa::Options o = opts();
      o.window = {0, 0};
      const Values v = values(checked_run(t, o));
      EXPECT_TRUE(no_nan(v));
      EXPECT_EQ(v.lse, (std::vector<double>{-kInf, -kInf, -kInf, v.lse[3], v.lse[4]}));
      EXPECT_TRUE(std::isfinite(v.lse[3]) && std::isfinite(v.lse[4]));
    }
    // No keys at all.
    {
      const Tensors t = random_qkv(dt, {2, 4, 3}, {2, 0, 3}, {2, 0, 3}, 17);
      const Outs got = checked_run(t, opts());
      EXPECT_EQ(got.out.values(), std::vector<double>(2 * 4 * 3, 0.0));
      EXPECT_EQ(got.lse->values(), std::vector<double>(2 * 4, -kInf));
      EXPECT_EQ(got.weights->numel(), 0);
    }
  }
}

// A NaN in q or k is not a blocked key: every row whose scores it reaches comes out NaN (out,
// weights and lse), the other rows exactly as without it. Sizes reach the few-rows kernel
// (Nq = 5), the lanes-are-rows kernel (Nq = 40) and the key split with its merge (Nk = 4096).
TEST_P(Semantics, NanInputsPropagateToTheRowsTheyReach) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : kDTypes) {
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{5, 5}, {40, 40}, {1, 4096}}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk);
      const int64_t bad_key = nk - 3;  // the last 3 rows (bottom-right causal) see it
      sdpa::Options o = opts();
      o.causal = Causal::kBottomRight;
      const Tensors clean = random_qkv(dt, {2, nq, 8}, {1, nk, 8}, {1, nk, 4}, 21);
      const Values want = values(run(clean, o));
      for (const char* which : {"q", "k"}) {
        SCOPED_TRACE(which);
        Tensors t = random_qkv(dt, {2, nq, 8}, {1, nk, 8}, {1, nk, 4}, 21);
        if (which[0] == 'q') {
          t.q.set((nq + (nq - 1)) * 8 + 5, nan);  // head 1, last row
        } else {
          t.k.set(bad_key * 8 + 2, nan);
        }
        const Values got = values(run(t, o));
        for (int64_t h = 0; h < 2; ++h) {
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t row = h * nq + i;
            const bool reached = which[0] == 'q' ? (h == 1 && i == nq - 1) : i + nk - nq >= bad_key;
            if (reached) {
              EXPECT_TRUE(std::isnan(got.lse[row])) << "row " << row;
              for (int64_t e = 0; e < 4; ++e) EXPECT_TRUE(std::isnan(got.out[row * 4 + e])) << "row " << row;
              EXPECT_TRUE(std::isnan(got.weights[row * nk])) << "row " << row;
            } else {
              EXPECT_EQ(got.lse[row], want.lse[row]) << "row " << row;
              for (int64_t e = 0; e < 4; ++e) EXPECT_EQ(got.out[row * 4 + e], want.out[row * 4 + e]) << "row " << row;
            }
          }
        }
      }
    }
  }
}

TEST_P(Semantics, EmptyQueriesOrHeadsWriteNothing) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    for (const Tensors& t : {random_qkv(dt, {2, 0, 3}, {2, 5, 3}, {2, 5, 4}, 18),
                             random_qkv(dt, {0, 2, 3, 3}, {0, 1, 5, 3}, {0, 1, 5, 4}, 19),
                             random_qkv(dt, {1, 0, 3, 3}, {1, 0, 5, 3}, {1, 0, 5, 4}, 20)}) {
      const Outs got = run(t, opts());
      EXPECT_TRUE(got.out.untouched());
      EXPECT_TRUE(got.weights->untouched());
      EXPECT_TRUE(got.lse->untouched());
    }
  }
}

TEST_P(Semantics, AdditiveMinusInfinityMaskEqualsBoolMask) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors t = random_qkv(dt, {2, 3, 6, 8}, {2, 1, 11, 8}, {2, 1, 11, 5}, 21);
    t.mask = random_mask(DType::kBool, {2, 3, 6, 11}, 22, 0.5);
    for (int64_t j = 0; j < 11; ++j) t.mask->set(4 * 11 + j, 0);  // one fully blocked row
    const Outs with_bool = checked_run(t, opts());
    std::vector<double> bias = t.mask->values();
    for (double& x : bias) x = x != 0 ? 0.0 : -kInf;
    t.mask = tensor(dt, {2, 3, 6, 11}, bias);
    EXPECT_TRUE(bitwise_equal(run(t, opts()), with_bool));
  }
}

TEST_P(Semantics, MaskBroadcastShapesEqualTheExpandedMask) {
  const int64_t B = 2, Hq = 4, Nq = 5, Nk = 7;
  const std::vector<std::vector<int64_t>> shapes = {{Nk},         {Nq, Nk},        {1, Hq, 1, Nk}, {B, 1, 1, Nk},
                                                    {B, 1, Nq, Nk}, {Hq, Nq, Nk}, {1, 1, 1, 1},  {B, Hq, Nq, 1}};
  for (DType dt : kDTypes) {
    const Tensors base = random_qkv(dt, {B, Hq, Nq, 8}, {B, 2, Nk, 8}, {B, 2, Nk, 8}, 23);
    for (DType mask_dtype : {DType::kBool, dt}) {
      for (size_t s = 0; s < shapes.size(); ++s) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " mask " + sdpa::dtype_name(mask_dtype) + " shape #" +
                     std::to_string(s));
        Tensors t = base.converted(dt);
        t.mask = random_mask(mask_dtype, shapes[s], 24 + static_cast<uint32_t>(s), 0.7);
        std::vector<double> full;  // NumPy broadcasting, done by hand through at()
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < Hq; ++h)
            for (int64_t i = 0; i < Nq; ++i)
              for (int64_t j = 0; j < Nk; ++j) full.push_back(t.mask->at(b, h, i, j));
        Tensors expanded = base.converted(dt);
        expanded.mask = tensor(mask_dtype, {B, Hq, Nq, Nk}, full);
        EXPECT_TRUE(bitwise_equal(checked_run(t, opts()), run(expanded, opts())));
      }
    }
  }
}

TEST_P(Semantics, LseIsLogSumExpOfScaledBiasedScores) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors t = random_qkv(dt, {3, 6, 16}, {3, 10, 16}, {3, 10, 2}, 25);
    t.mask = random_mask(dt, {6, 10}, 26, 0.8);
    const Outs got = checked_run(t, opts());
    const double tol = dt == kF32 ? 1e-6 : 1e-12;
    for (int64_t h = 0; h < 3; ++h) {
      for (int64_t i = 0; i < 6; ++i) {
        double sum = 0;  // straight from the definition: no max shift (the scores are small)
        for (int64_t j = 0; j < 10; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < 16; ++d) dot += t.q.at(0, h, i, d) * t.k.at(0, h, j, d);
          sum += std::exp(dot / 4 + t.mask->at(0, h, i, j));
        }
        const double lse = got.lse->at(0, 0, h, i);
        EXPECT_NEAR(lse, std::log(sum), tol * (1 + std::abs(lse)));
        for (int64_t j = 0; j < 10; ++j) {  // and the weights are exp(score - lse)
          double dot = 0;
          for (int64_t d = 0; d < 16; ++d) dot += t.q.at(0, h, i, d) * t.k.at(0, h, j, d);
          EXPECT_NEAR(got.weights->at(0, h, i, j), std::exp(dot / 4 + t.mask->at(0, h, i, j) - std::log(sum)), tol);
        }
      }
    }
  }
}

TEST_P(Semantics, RepeatedCallsAreBitwiseIdentical) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors t = random_qkv(dt, {2, 4, 97, 64}, {2, 2, 65, 64}, {2, 2, 65, 64}, 27);
    t.mask = random_mask(DType::kBool, {97, 65}, 28, 0.8);
    sdpa::Options o = opts();
    o.causal = Causal::kBottomRight;
    EXPECT_TRUE(bitwise_equal(run(t, o), run(t, o)));
  }
}

TEST_P(Semantics, Float32AgreesWithFloat64OnTheSameValues) {
  const Tensors t64 = random_qkv(kF64, {2, 33, 40}, {2, 47, 40}, {2, 47, 24}, 29);
  const Tensors t32 = t64.converted(kF32);
  const Tensors t32_in_64 = t32.converted(kF64);  // the float32-rounded inputs, in float64
  EXPECT_TRUE(near(run(t32, opts()), values(run(t32_in_64, opts())), 4));
}

TEST_P(Semantics, StridedAndMisalignedViewsMatchContiguous) {
  for (DType dt : kDTypes) {
    Tensors t = random_qkv(dt, {2, 4, 9, 17}, {2, 2, 13, 17}, {2, 2, 13, 5}, 30);
    t.mask = random_mask(dt, {4, 9, 13}, 31, 0.7);
    sdpa::Options o = opts();
    o.causal = Causal::kBottomRight;
    const Outs plain = run(t, o);
    for (Layout layout : {Layout::kPadded, Layout::kPermuted}) {
      SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + (layout == Layout::kPadded ? " padded" : " permuted"));
      const Tensors s = qkv(t.q.converted(dt, layout), t.k.converted(dt, layout), t.v.converted(dt, layout),
                            t.mask->converted(dt, layout));
      const Outs got = run(s, o, layout);
      EXPECT_TRUE(got.guards_intact());
      for (const GuardedTensor* in : {&s.q, &s.k, &s.v, &*s.mask}) EXPECT_TRUE(in->guards_intact());
      EXPECT_TRUE(bitwise_equal(got, plain));
    }
  }
}

TEST_P(Semantics, ZeroStridesBroadcastInputs) {
  // k and v shared by every batch entry through a zero batch stride, as a caller may pass them.
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Tensors one = random_qkv(dt, {3, 2, 6, 8}, {1, 2, 10, 8}, {1, 2, 10, 4}, 32);
    sdpa::Inputs in = one.inputs();
    in.k.shape[0] = in.v.shape[0] = 3;
    in.k.strides[0] = in.v.strides[0] = 0;
    Outs got{GuardedTensor(dt, {3, 2, 6, 4}), std::nullopt, std::nullopt};
    sdpa::attention(in, got.outputs(), opts());
    std::vector<double> k, v;
    for (int b = 0; b < 3; ++b) {
      const std::vector<double> kb = one.k.values(), vb = one.v.values();
      k.insert(k.end(), kb.begin(), kb.end());
      v.insert(v.end(), vb.begin(), vb.end());
    }
    const Tensors copied = qkv(one.q.converted(dt, Layout::kContiguous), tensor(dt, {3, 2, 10, 8}, k),
                               tensor(dt, {3, 2, 10, 4}, v));
    EXPECT_TRUE(bitwise_equal(got, run(copied, opts(), Layout::kContiguous, false)));
  }
}

TEST_P(Semantics, OptionalOutputsDoNotChangeOut) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    const Tensors t = random_qkv(dt, {4, 19, 32}, {4, 23, 32}, {4, 23, 32}, 33);
    EXPECT_TRUE(bitwise_equal(run(t, opts(), Layout::kContiguous, false), run(t, opts())));
  }
}

TEST_P(Semantics, ThreadCountDoesNotChangeResults) {
  // The header promises bit-identical results for any thread count: a prefill with many
  // blocks, and a decode step whose keys may be split into chunks and merged.
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    for (const Tensors& t : {random_qkv(dt, {2, 4, 97, 32}, {2, 2, 130, 32}, {2, 2, 130, 16}, 34),
                             random_qkv(dt, {1, 4, 1, 32}, {1, 1, 4500, 32}, {1, 1, 4500, 16}, 35)}) {
      sdpa::set_num_threads(1);
      const Outs one = run(t, opts());
      sdpa::set_num_threads(3);
      const Outs three = run(t, opts());
      sdpa::set_num_threads(0);
      EXPECT_TRUE(bitwise_equal(one, three));
      EXPECT_TRUE(bitwise_equal(run(t, opts()), one));
    }
  }
}

// ---- The reference against the independent oracle ----

TEST(Reference, MatchesIndependentOracleOnTheSmallSweepCases) {
  // kReference is the yardstick of every other test: check its conventions (causal, window,
  // masks, broadcasting, GQA, layouts) against an implementation that shares no code with it.
  int checked = 0;
  for (const Case& c : sweep_cases()) {
    if (work(c) > 2'000'000) continue;
    SCOPED_TRACE(c.name);
    const Tensors t = make_inputs(c);
    const sdpa::Options o = options(c, Backend::kReference);
    const Values want = oracle(t, o);
    const Values got = values(run(t, o, c.layout));
    // Both compute in float64 from the same values (only summation details may differ); then
    // kReference rounds its results to the dtype: eps/2 relative.
    double vmax = 0, lmax = 0;
    for (double x : t.v.values()) vmax = std::max(vmax, std::abs(x));
    for (double x : want.lse) lmax = std::isfinite(x) ? std::max(lmax, std::abs(x)) : lmax;
    const double rel = 1e-13 + eps(c.dtype);
    ASSERT_TRUE(all_close("out", got.out, want.out, rel * vmax));
    ASSERT_TRUE(all_close("weights", got.weights, want.weights, rel));
    ASSERT_TRUE(all_close("lse", got.lse, want.lse, rel * (1 + lmax)));
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

// ---- The sweep: kAuto against kReference on every case of the table, on every path ----

// kAuto's result of one path against the case's reference and tolerances.
void check_sweep_path(const Case& c, const Tensors& t, const sdpa::Options& o, const ForwardExpected& e) {
  const Outs got = run(t, o, c.layout);
  EXPECT_TRUE(got.guards_intact());
  for (const GuardedTensor* in : {&t.q, &t.k, &t.v}) EXPECT_TRUE(in->guards_intact());
  if (t.mask) {
    EXPECT_TRUE(t.mask->guards_intact());
  }
  EXPECT_TRUE(no_nan(values(got)));
  EXPECT_TRUE(blocked_are_exact(t, o, got));
  EXPECT_TRUE(matches(e, got));
}

// Every path this machine has, against one reference (computed once: it is most of a case's
// time): the best target; AVX2 alone (the product's target machine may have only AVX2); and, for
// bfloat16 where the best pass runs on AMX, AVX512_BF16. A path the machine lacks is left out
// here; SimdTargets.* and KernelPaths.* report it as skipped with the reason.
void check_sweep_case(const Case& c) {
  const Tensors t = make_inputs(c);
  const sdpa::Options o = options(c, Backend::kAuto);
  ForwardExpected e;
  ASSERT_TRUE(expected_forward(t, o, e));
  {
    SCOPED_TRACE("best path");
    check_sweep_path(c, t, o, e);
  }
  if (avx2_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX2");
    const Avx2Only avx2;
    check_sweep_path(c, t, o, e);
    EXPECT_EQ(dispatched_target(), "AVX2");  // the kernel really ran on AVX2
  }
  if (c.dtype == kBF16 && bf16_dot_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX512_BF16");
    const KernelPathCap cap(sdpa::KernelPath::kAvx512Bf16);
    check_sweep_path(c, t, o, e);
  }
}

class Sweep : public testing::TestWithParam<Case> {};

TEST_P(Sweep, EveryPathMatchesReference) { check_sweep_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Table, Sweep, testing::ValuesIn(sweep_cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(SimdTargets, Avx2OnlyDispatchesToAvx2AndRestores) {
  // Without this, the sweep's AVX2 pass could pass while running on AVX-512 all along.
  if (const std::string why = avx2_pass_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const Tensors t = make_inputs(sweep_cases().front());
  const sdpa::Options o = options(sweep_cases().front(), Backend::kFlash);
  run(t, o);
  const std::string best = dispatched_target();
  EXPECT_NE(best, "AVX2") << "the CPU has AVX-512, so the normal pass should use it";
  EXPECT_NE(best, "none");
  {
    const Avx2Only avx2;
    EXPECT_EQ(dispatched_target(), "none") << "changing the targets resets the dispatch";
    run(t, o);
    EXPECT_EQ(dispatched_target(), "AVX2");
  }
  run(t, o);
  EXPECT_EQ(dispatched_target(), best) << "the best target again after the AVX2-only pass";
}

// The sweep's AVX512_BF16 pass for bfloat16 (on a CPU whose best bfloat16 path is AMX): the cap
// really moves the call off AMX. Skipped, with the reason, where the pass is left out.
TEST(SimdTargets, TheAvx512Bf16PassRunsOffAmx) {
  if (const std::string why = bf16_dot_pass_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const Case c = bf16_sweep_cases().back();
  const Tensors t = make_inputs(c);
  const KernelPathCap cap(sdpa::KernelPath::kAvx512Bf16);
  run(t, options(c, Backend::kAuto), c.layout);
  EXPECT_NE(sdpa::last_kernel_path(), sdpa::KernelPath::kAmxBf16);
}

}  // namespace
