// The edges of the header's contract (docs/RELIABILITY.md), on every backend: scores past the
// float range, blocked keys holding inf or NaN, unnormalised sums that overflow, scales the
// compute type cannot hold, empty views with null data, huge dims that hold no element. Each
// test pins a defect that once gave a silent wrong answer, undefined behaviour or a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <cstdint>
#include <limits>
#include <vector>

#include "backward_util.h"
#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr DType kDTypes[] = {kF32, kF64, kBF16};

// A value whose square overflows the compute type: q·k = big² is +inf there (bfloat16 has
// float32's range and computes in it).
double big(DType dt) { return dt == kF64 ? 1e160 : 1e20; }

class Edge : public testing::TestWithParam<Backend> {
 protected:
  sdpa::Options opts() const {
    sdpa::Options o;
    o.backend = GetParam();
    return o;
  }
};

INSTANTIATE_TEST_SUITE_P(Backends, Edge,
                         testing::Values(Backend::kAuto, Backend::kFlash, Backend::kNaive, Backend::kReference),
                         [](const testing::TestParamInfo<Backend>& info) { return testing::PrintToString(info.param); });

// Rows (Nq, 1) of q = `qv`, keys (Nk, 1) and values (Nk, 1) small except at `hot` keys.
Tensors one_feature(DType dt, int64_t nq, int64_t nk, double qv, const std::vector<int64_t>& hot, double hot_k,
                    const std::vector<double>& hot_v) {
  std::vector<double> q(nq, qv), k(nk), v(nk);
  for (int64_t j = 0; j < nk; ++j) {
    k[j] = 0.25 * static_cast<double>(j % 7) - 0.5;
    v[j] = static_cast<double>(j % 5);
  }
  for (size_t h = 0; h < hot.size(); ++h) {
    k[hot[h]] = hot_k;
    v[hot[h]] = hot_v[h];
  }
  return {tensor(dt, {nq, 1}, q), tensor(dt, {nk, 1}, k), tensor(dt, {nk, 1}, v), std::nullopt};
}

// Two query heads sharing one kv head, (2, Nq, 8), (1, Nk, 8), (1, Nk, 4), normal values, and a
// key-padding mask blocking keys 1, 4, 7, ...
Tensors blocking_every_third_key(DType dt, int64_t nq, int64_t nk, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensors t{GuardedTensor(dt, {2, nq, 8}), GuardedTensor(dt, {1, nk, 8}), GuardedTensor(dt, {1, nk, 4}),
            GuardedTensor(DType::kBool, {nk})};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  for (int64_t j = 0; j < nk; ++j) t.mask->set(j, j % 3 != 1);
  return t;
}

// The example: q=[[1e20]], k=[[1e20],[1]], v=[[5],[7]] in float32 gave out 0 and
// lse -inf (as if no key were allowed). A +inf score takes the row's whole weight; several
// share it equally. Sizes reach the few-rows kernel, the lanes-are-rows kernel and the key
// split with its merge (Nk = 4096, one row).
TEST_P(Edge, OverflowingScoresTakeTheRowsWeight) {
  for (DType dt : kDTypes) {
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{1, 2}, {3, 9}, {40, 300}, {1, 4096}}) {
      for (const std::vector<int64_t>& hot : {std::vector<int64_t>{0}, std::vector<int64_t>{nk - 1, nk / 2 - 1}}) {
        SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk << " hot=" << hot.size());
        const Tensors t = one_feature(dt, nq, nk, big(dt), hot, big(dt), {5.0, 8.0});
        sdpa::Options o = opts();
        o.scale = 1.0;
        const Values got = values(run(t, o));
        const double want = hot.size() == 1 ? 5.0 : 6.5;
        for (int64_t i = 0; i < nq; ++i) {
          EXPECT_EQ(got.out[i], want) << "row " << i;
          EXPECT_EQ(got.lse[i], kInf) << "row " << i;
          for (int64_t j = 0; j < nk; ++j) {
            const bool is_hot = std::find(hot.begin(), hot.end(), j) != hot.end();
            ASSERT_EQ(got.weights[i * nk + j], is_hot ? 1.0 / static_cast<double>(hot.size()) : 0.0) << i << "," << j;
          }
        }
      }
    }
  }
}

// The score is Σ (q_d · scale) · k_d: the scale multiplies q first in every backend, so an
// overflow of q · scale happens in all of them alike (found by the fuzzer: kFlash gave NaN
// where kReference and kNaive, which scaled the dot product, gave finite values).
TEST_P(Edge, ScaleMultipliesQFirstInEveryBackend) {
  const Tensors t{tensor(kF32, {1, 2}, {2, -1.5}), tensor(kF32, {1, 2}, {1, 1}), tensor(kF32, {1, 1}, {1}),
                  std::nullopt};
  sdpa::Options o = opts();
  o.scale = 3e38;  // q · scale = (+inf, -inf): the score is inf - inf = NaN
  const Values got = values(run(t, o));
  EXPECT_TRUE(std::isnan(got.out[0]));
  EXPECT_TRUE(std::isnan(got.lse[0]));
  o.scale = 1e38;  // q · scale = (2e38, -1.5e38): finite, the score 5e37
  const Values fine = values(run(t, o));
  EXPECT_EQ(fine.out[0], 1.0);
  EXPECT_NEAR(fine.lse[0], 5e37, 5e37 * 4 * eps(kF32));
}

// With Dk = Dv = 0 the scores are the biases alone, and lse is the same bits whether or not the
// weights are asked for too (they once took different paths).
TEST_P(Edge, LseOfBiasesDoesNotDependOnAskingForWeights) {
  for (DType dt : kDTypes) {
    for (int64_t nk : {3, 5, 7, 1000}) {
      for (double bias : {0.1, 0.3, 1.7, -2.9}) {
        SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nk=" << nk << " bias=" << bias);
        const Tensors t{GuardedTensor(dt, {3, 0}), GuardedTensor(dt, {nk, 0}), GuardedTensor(dt, {nk, 0}),
                        tensor(dt, {1}, {bias})};
        const Outs with = run(t, opts(), Layout::kContiguous, /*with_extras=*/true);
        Outs without{GuardedTensor(dt, {3, 0}), std::nullopt, GuardedTensor(compute_dtype(dt), {3})};
        sdpa::attention(t.inputs(), without.outputs(), opts());
        EXPECT_EQ(with.lse->values(), without.lse->values());
        const double want = round_to(dt, bias) + std::log(static_cast<double>(nk));  // the bias as stored
        EXPECT_NEAR(with.lse->get(0), want, 4 * eps(compute_dtype(dt)) * std::fabs(want));
      }
    }
  }
}

// A -inf score on an allowed key (q·k overflowing downwards) weighs 0; with nothing above -inf
// the row is fully masked: zeros and lse -inf, never NaN.
TEST_P(Edge, NegativeOverflowWeighsNothing) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    sdpa::Options o = opts();
    o.scale = 1.0;
    const Values one = values(run(one_feature(dt, 1, 2, big(dt), {0}, -big(dt), {5.0}), o));
    EXPECT_EQ(one.out[0], 1.0);  // all weight on key 1, whose value is 1
    const Values all = values(run(one_feature(dt, 1, 1, big(dt), {0}, -big(dt), {5.0}), o));
    EXPECT_EQ(all.out[0], 0.0);
    EXPECT_EQ(all.lse[0], -kInf);
  }
}

// A key the mask blocks is -inf whatever its dot product: an overflowing (+inf) or NaN score
// there made the whole row NaN.
TEST_P(Edge, MaskedKeysWithInfiniteOrNanScoresDoNotReachTheRow) {
  for (DType dt : kDTypes) {
    for (DType mask_dt : {DType::kBool, dt}) {
      for (double bad_k : {big(dt), kNaN, kInf}) {
        SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " mask " << sdpa::dtype_name(mask_dt) << " k=" << bad_k);
        Tensors t = one_feature(dt, 1, 2, big(dt), {0}, bad_k, {5.0});
        t.k.set(1, 1.0);
        t.v.set(1, 7.0);
        t.mask = tensor(mask_dt, {2}, {mask_dt == DType::kBool ? 0.0 : -kInf, mask_dt == DType::kBool ? 1.0 : 0.0});
        sdpa::Options o = opts();
        o.scale = 1.0;
        const Values got = values(run(t, o));
        EXPECT_EQ(got.out[0], 7.0);
        EXPECT_EQ(got.weights, (std::vector<double>{0.0, 1.0}));
        EXPECT_EQ(got.lse[0], round_to(dt, big(dt)));  // the one allowed key's score: big · 1
      }
    }
  }
}

// A NaN (or inf) in the value row of a key that a row does not attend never reaches that row:
// the example (zeros, causal, v = [[1], [nan]]; a row that sees no key came back NaN),
// then keys the mask blocks, at sizes of every kernel. A row that does attend it is NaN.
TEST_P(Edge, BlockedValueRowsDoNotReachTheRow) {
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    {
      const Tensors t{tensor(dt, {3, 1}, {0, 0, 0}), tensor(dt, {2, 1}, {0, 0}), tensor(dt, {2, 1}, {1, kNaN}),
                      std::nullopt};
      sdpa::Options o = opts();
      o.causal = Causal::kBottomRight;  // row 0 sees no key, row 1 key 0, row 2 both
      const Values got = values(run(t, o));
      EXPECT_EQ(got.out[0], 0.0);
      EXPECT_EQ(got.lse[0], -kInf);
      EXPECT_EQ(got.out[1], 1.0);
      EXPECT_TRUE(std::isnan(got.out[2]));
    }
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{2, 9}, {40, 300}, {1, 4096}}) {
      for (double bad : {kNaN, kInf}) {
        SCOPED_TRACE(testing::Message() << "Nq=" << nq << " Nk=" << nk << " v=" << bad);
        Tensors t = blocking_every_third_key(dt, nq, nk, 3);  // key 4 among them
        for (int64_t e = 0; e < 4; ++e) t.v.set(4 * 4 + e, bad);
        const Outs got = run(t, opts());
        EXPECT_TRUE(matches_reference(t, opts(), got));
        EXPECT_TRUE(blocked_are_exact(t, opts(), got));
        for (double x : got.out.values()) ASSERT_TRUE(std::isfinite(x));
      }
    }
  }
}

// An inf planted in one column of a value row changes that column of the rows that attend its
// key, and no other bit: decode redoes a tile whose sums came out non-finite, and the redo must
// repeat the first pass's arithmetic exactly. With g++ free to fuse a*b+c into an FMA, the two
// passes of the scalar feature tail differed, so row 0 (which blocks the key) moved by an ulp
// (fuzz finding F2 fifth: float64, Dv 4 < the 8 lanes of AVX-512, decode with key chunks).
TEST_P(Edge, InfInAValueRowChangesOnlyItsColumnOfTheRowsThatSeeIt) {
  struct Case {
    int64_t nq, nk, dv;
  };
  for (DType dt : kDTypes) {
    for (const Case& c : {Case{2, 9, 4}, Case{7, 300, 4}, Case{7, 4100, 4}, Case{5, 4100, 5}, Case{3, 300, 17},
                          Case{8, 2100, 3}, Case{40, 300, 4}}) {
      for (uint32_t seed = 0; seed < 3; ++seed) {
        SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << c.nq << " Nk=" << c.nk << " Dv=" << c.dv
                                        << " seed " << seed);
        std::mt19937 rng(seed);
        Tensors t{GuardedTensor(dt, {c.nq, 3}), GuardedTensor(dt, {c.nk, 3}), GuardedTensor(dt, {c.nk, c.dv}),
                  GuardedTensor(DType::kBool, {c.nq, c.nk})};
        fill_normal(t.q, rng, 2);
        fill_normal(t.k, rng, 2);
        fill_normal(t.v, rng);
        const int64_t hot = c.nk * 4 / 9;
        for (int64_t x = 0; x < c.nq * c.nk; ++x) t.mask->set(x, x != hot);  // row 0 blocks the hot key
        const Values clean = values(run(t, opts()));
        Tensors poisoned = t.converted(dt);
        poisoned.v.set(hot * c.dv + 1, kInf);
        const Values got = values(run(poisoned, opts()));
        for (int64_t i = 0; i < c.nq; ++i) {
          for (int64_t e = 0; e < c.dv; ++e) {
            const int64_t x = i * c.dv + e;
            if (i > 0 && e == 1) {
              EXPECT_EQ(got.out[x], kInf) << "row " << i;
            } else {
              ASSERT_EQ(got.out[x], clean.out[x]) << "row " << i << " column " << e;
            }
          }
        }
      }
    }
  }
}

// out = Σ p·v / l: the unnormalised sum overflowed for values near the top of the range
// (out came back inf where the answer, 3e38, is a float32).
TEST_P(Edge, UnnormalisedSumsDoNotOverflow) {
  for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{1, 4}, {40, 300}}) {
    const Tensors z{tensor(kF32, {nq, 2}, std::vector<double>(nq * 2, 0.0)),
                    tensor(kF32, {nk, 2}, std::vector<double>(nk * 2, 0.0)),
                    tensor(kF32, {nk, 1}, std::vector<double>(nk, 3e38)), std::nullopt};
    const Values got = values(run(z, opts()));
    // A sum of Nk float32 terms: relative error up to Nk · eps (the naive bound).
    for (int64_t i = 0; i < nq; ++i) EXPECT_NEAR(got.out[i], 3e38, 3e38 * nk * eps(kF32)) << "row " << i;
  }
}

// A scale float32 cannot hold was accepted and became inf (or 0) inside the kernels.
TEST_P(Edge, ScalesTheComputeTypeCannotHoldAreErrors) {
  for (double scale : {1e39, -1e39, 1e-50}) {
    Tensors t = one_feature(kF32, 1, 2, 1e-20, {0}, 1e-20, {5.0});
    Outs outs{GuardedTensor(kF32, {1, 1}), GuardedTensor(kF32, {1, 2}), GuardedTensor(kF32, {1})};
    sdpa::Options o = opts();
    o.scale = scale;
    expect_sdpa_error([&] { sdpa::attention(t.inputs(), outs.outputs(), o); }, {"scale=", "float32"});
    EXPECT_TRUE(outs.out.untouched());
    // float64 holds it.
    EXPECT_NO_THROW(run(t.converted(kF64), o));
  }
}

sdpa::TensorView null_view(DType dt, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  sdpa::TensorView t;
  t.dtype = dt;
  t.rank = static_cast<int>(shape.size());
  for (int d = 0; d < t.rank; ++d) {
    t.shape[d] = shape[d];
    t.strides[d] = strides[d];
  }
  return t;  // data == nullptr
}

// Empty views may have null data and any strides: the kernels formed null + offset (undefined
// behaviour, reported by UBSan) from the strides of empty k and v.
TEST_P(Edge, EmptyViewsWithNullDataAndAnyStrides) {
  for (DType dt : kDTypes) {
    GuardedTensor q(dt, {2, 3, 4}), out(dt, {2, 3, 2}), lse(compute_dtype(dt), {2, 3});
    std::mt19937 rng(5);
    fill_normal(q, rng);
    sdpa::Inputs in;
    in.q = q.view();
    in.k = null_view(dt, {2, 0, 4}, {-1000003, -7, 1});
    in.v = null_view(dt, {2, 0, 2}, {999983, 123457, 1});
    sdpa::Outputs outs;
    outs.out = out.view();
    outs.lse = lse.view();
    outs.weights = null_view(compute_dtype(dt), {2, 3, 0}, {-5, 77, -1});
    sdpa::attention(in, outs, opts());
    EXPECT_EQ(out.values(), std::vector<double>(12, 0.0));
    EXPECT_EQ(lse.values(), std::vector<double>(6, -kInf));
  }
}

// q (1, 0) against k, v (2^40, 0) with lse asked for walked 2^40 keys. The scores are all 0
// (empty dot products), so lse = log(number of allowed keys) + bias, from what exists.
TEST_P(Edge, HugeKeyDimsHoldingNoElementGiveLseAtOnce) {
  const int64_t nk = int64_t{1} << 40;
  for (DType dt : kDTypes) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    GuardedTensor lse(compute_dtype(dt), {1});
    sdpa::Inputs in;
    in.q = null_view(dt, {1, 0}, {0, 1});
    in.k = null_view(dt, {nk, 0}, {0, 1});
    in.v = null_view(dt, {nk, 0}, {0, 1});
    sdpa::Outputs outs;
    outs.out = null_view(dt, {1, 0}, {0, 1});
    outs.lse = lse.view();
    const double log_nk = 40 * std::log(2.0);
    sdpa::attention(in, outs, opts());
    EXPECT_NEAR(lse.get(0), log_nk, 4 * eps(compute_dtype(dt)) * log_nk);
    sdpa::Options o = opts();
    o.causal = Causal::kTopLeft;  // row 0 sees key 0 only
    sdpa::attention(in, outs, o);
    EXPECT_EQ(lse.get(0), 0.0);
    GuardedTensor bias = tensor(dt, {1, 1}, {2.5});
    in.mask = bias.view();
    sdpa::attention(in, outs, opts());
    EXPECT_NEAR(lse.get(0), 2.5 + log_nk, 4 * eps(compute_dtype(dt)) * (2.5 + log_nk));
    GuardedTensor blocked = tensor(DType::kBool, {1}, {0});
    in.mask = blocked.view();
    sdpa::attention(in, outs, opts());
    EXPECT_EQ(lse.get(0), -kInf);
  }
}

// An empty float mask of shape (2^40, 0) made validation loop 2^40 times over its rows.
TEST_P(Edge, HugeEmptyMaskValidatesAtOnce) {
  const int64_t nq = int64_t{1} << 40;
  for (DType dt : kDTypes) {
    sdpa::Inputs in;
    in.q = null_view(dt, {nq, 0}, {0, 1});
    in.k = null_view(dt, {0, 0}, {0, 1});
    in.v = null_view(dt, {0, 0}, {0, 1});
    in.mask = null_view(dt, {nq, 0}, {0, 1});
    sdpa::Outputs outs;
    outs.out = null_view(dt, {nq, 0}, {0, 1});
    EXPECT_NO_THROW(sdpa::attention(in, outs, opts()));
  }
}

// ---- Backward ----

// A key the mask blocks passes nothing of its value row to the gradients: dp = dout·v was NaN
// there, and ds = 0 · NaN reached dq and dk. With the key's v clean the gradients are the same
// bit for bit.
TEST_P(Edge, BackwardIgnoresValueRowsOfBlockedKeys) {
  for (DType dt : kDTypes) {
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{3, 9}, {40, 300}}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk);
      Tensors t = blocking_every_third_key(dt, nq, nk, 7);  // key 4 among them
      sdpa::Options o = opts();
      const sdpa_test::Problem clean = make_problem(std::move(t), o, Layout::kContiguous, 8);
      sdpa_test::Problem dirty = clean.converted(dt);  // a copy
      for (int64_t e = 0; e < 4; ++e) dirty.t.v.set(4 * 4 + e, kNaN);
      const GradValues want = values(backward(clean, o)), got = values(backward(dirty, o));
      EXPECT_TRUE(no_nan(got));
      EXPECT_TRUE(bitwise_equal(got, want));
    }
  }
}

// The same for the key row of a key the mask blocks: dq = Σ ds·k multiplied it by ds = 0, so a
// NaN there made dq NaN. The row is recomputed; the gradients match kReference's by the rule.
TEST_P(Edge, BackwardIgnoresKeyRowsOfBlockedKeys) {
  for (DType dt : kDTypes) {
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{3, 9}, {40, 300}}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk);
      Tensors t = blocking_every_third_key(dt, nq, nk, 11);  // key 4 among them
      sdpa::Options o = opts();
      sdpa_test::Problem p = make_problem(std::move(t), o, Layout::kContiguous, 12);
      for (int64_t c = 0; c < 8; ++c) p.t.k.set(4 * 8 + c, kNaN);
      const Grads got = backward(p, o);
      EXPECT_TRUE(no_nan(values(got)));
      Expected e;
      ASSERT_TRUE(expected(p, o, e));
      EXPECT_TRUE(matches(e, got));
    }
  }
}

// A NaN in the q or dout of a row reaches no key that row does not attend: the fused backward's
// outer products multiplied those rows by p = ds = 0 (0 · NaN), which made dk and dv of keys
// every row blocks NaN (found by the fuzzer, F3). Such rows now skip the keys they give weight
// 0. Keys blocked for every row keep gradients of exactly 0; keys only the clean rows see match
// the clean problem's gradients by the rule (and bit for bit: the fuzzer's poison_bwd).
TEST_P(Edge, BackwardKeepsNanRowsFromKeysTheyDoNotAttend) {
  for (DType dt : kDTypes) {
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{3, 9}, {40, 300}}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk);
      sdpa::Options o = opts();
      o.causal = Causal::kBottomRight;  // row i sees keys j <= i + Nk - Nq
      const sdpa_test::Problem clean = make_problem(blocking_every_third_key(dt, nq, nk, 17), o, Layout::kContiguous, 18);
      sdpa_test::Problem dirty = clean.converted(dt);  // a copy, with the same out and lse
      dirty.t.q.set(0 * nq * 8 + 0 * 8 + 3, kNaN);     // head 0, row 0
      dirty.dout.set(1 * nq * 4 + 1 * 4 + 2, kNaN);    // head 1, row 1
      Expected e;
      ASSERT_TRUE(expected(clean, o, e));
      const GradValues got = values(backward(dirty, o));
      const int64_t last_seen = 1 + nk - nq;  // the last key a poisoned row sees
      for (int n = 1; n < 3; ++n) {           // dk, dv: (1, Nk, 8), (1, Nk, 4)
        const int64_t width = n == 1 ? 8 : 4;
        for (int64_t j = 0; j < nk; ++j) {
          for (int64_t c = 0; c < width; ++c) {
            const size_t x = static_cast<size_t>(j * width + c);
            if (j % 3 == 1) {
              EXPECT_EQ(got.g[n][x], 0.0) << (n == 1 ? "dk" : "dv") << " of blocked key " << j;
            } else if (j > last_seen) {
              EXPECT_NEAR(got.g[n][x], e.ref.g[n][x], e.tol[n]) << (n == 1 ? "dk" : "dv") << " of key " << j;
            }
          }
        }
      }
    }
  }
}

// An inf value row whose key had weight in the keys seen so far, then weight 0 once a far
// larger score arrives (a later tile, or another key chunk merged afterwards): the rescale by
// exp(old max - new max) = 0 gave 0 · inf = NaN (found by the fuzzer: Nq 18, Nk 3000). The key
// contributes nothing: out is the huge key's value row. Prefill tiles, decode, key chunks; the
// huge key before and after the inf one.
TEST_P(Edge, InfValueRowOfAKeyThatLosesItsWeight) {
  for (DType dt : kDTypes) {
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{18, 300}, {1, 300}, {18, 3000}, {2, 5000}}) {
      for (const bool huge_first : {false, true}) {
        SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk << " huge key "
                                        << (huge_first ? "first" : "last"));
        const int64_t inf_key = huge_first ? nk - 5 : 5, huge_key = huge_first ? 2 : nk - 50;
        std::vector<double> q(nq, -1.0), k(nk), v(nk);
        for (int64_t j = 0; j < nk; ++j) {
          k[j] = static_cast<double>(j % 5) - 2;  // scores -2 .. 2
          v[j] = static_cast<double>(j % 7);
        }
        k[huge_key] = -3e38;  // score +3e38: every other key's weight is exactly 0
        v[inf_key] = kInf;
        const Tensors t{tensor(dt, {nq, 1}, q), tensor(dt, {nk, 1}, k), tensor(dt, {nk, 1}, v), std::nullopt};
        sdpa::Options o = opts();
        o.scale = 1.0;
        const Values got = values(run(t, o));
        EXPECT_EQ(got.out, std::vector<double>(nq, t.v.get(huge_key)));
        EXPECT_EQ(got.lse, std::vector<double>(nq, t.k.get(huge_key) * -1.0));
      }
    }
  }
}

// The same with a tiny, not zero, rescale (found by the fuzzer next: float64, decode, chunks):
// key A (value +inf, score 0) has weight exp(-c) > 0 against key C's score c in the keys seen
// first, but exp(-b) = 0 against key B's b, the row's max, so out must be finite (all other
// values are 1). The tiles' p · inf = inf stayed inf through every later rescale, however tiny;
// the kernels now keep such keys' scores apart and decide at the end.
TEST_P(Edge, InfValueRowWhoseWeightUnderflowsOnlyInTheEnd) {
  for (DType dt : kDTypes) {
    const bool f64 = dt == kF64;
    const double c = f64 ? 700 : 80, big = f64 ? 1000 : 110;  // exp(-c) > 0, exp(-big) = 0
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{18, 256}, {1, 256}, {18, 3000}, {2, 5000}}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk);
      std::vector<double> q(nq, 1.0), k(nk, 0.0), v(nk, 1.0);
      v[0] = kInf;     // key A: score 0
      k[1] = c;        // key C: A's weight exp(-c) among the first keys
      k[nk - 50] = big;  // key B, in a later tile (and key chunk, for the long rows)
      const Tensors t{tensor(dt, {nq, 1}, q), tensor(dt, {nk, 1}, k), tensor(dt, {nk, 1}, v), std::nullopt};
      sdpa::Options o = opts();
      o.scale = 1.0;
      if (GetParam() == Backend::kReference && !f64) continue;  // float64 compute: exp(-110) > 0 there
      const Values got = values(run(t, o));
      for (double x : got.out) EXPECT_NEAR(x, 1.0, 1e-6);
      // And a key with nonzero weight in the end still brings its inf: B's own value row.
      Tensors t2 = t.converted(dt);
      t2.v.set(nk - 50, kInf);
      for (double x : values(run(t2, o)).out) EXPECT_EQ(x, kInf);
    }
  }
}

// A NaN score makes its row NaN even in a key chunk whose weight against the row's max is 0
// (found by the fuzzer: float64 decode, Nk 2100, after the merge learned to skip such chunks).
TEST_P(Edge, NanScoreInAChunkOfWeightZeroStillMakesTheRowNan) {
  for (DType dt : kDTypes) {
    for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{18, 3000}, {1, 3000}, {2, 5000}}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Nk=" << nk);
      std::vector<double> q(nq, 1.0), k(nk, 0.0), v(nk, 1.0);
      k[100] = kNaN;       // first chunk: a NaN score
      k[nk - 50] = 1e4;    // last chunk: the row's max, so the first chunk's weight is exp(-1e4) = 0
      const Tensors t{tensor(dt, {nq, 1}, q), tensor(dt, {nk, 1}, k), tensor(dt, {nk, 1}, v), std::nullopt};
      sdpa::Options o = opts();
      o.scale = 1.0;
      const Values got = values(run(t, o, Layout::kContiguous, /*with_extras=*/true));
      for (double x : got.out) EXPECT_TRUE(std::isnan(x)) << x;
      for (double x : got.lse) EXPECT_TRUE(std::isnan(x)) << x;
    }
  }
}

// Huge finite scores (|s| ~ 1e9 in float32): the backward recomputes s in another order than
// the forward, and exp(s - lse) overflowed into NaN gradients (found by the fuzzer). p is
// clamped to at most 1; the gradients stay finite.
TEST_P(Edge, BackwardWithHugeScoresStaysFinite) {
  // The fuzzer's case: GQA 16:2, Nq = 15, Nk = 16, Dk = 20, Dv = 17, q and k of sigma 300.
  for (uint32_t seed = 13; seed < 23; ++seed) {
    std::mt19937 rng(seed);
    Tensors t{GuardedTensor(kF32, {16, 15, 20}), GuardedTensor(kF32, {2, 16, 20}), GuardedTensor(kF32, {2, 16, 17}),
              std::nullopt};
    fill_normal(t.q, rng, 300);
    fill_normal(t.k, rng, 300);
    fill_normal(t.v, rng);
    sdpa::Options o = opts();
    o.scale = -1000;
    const sdpa_test::Problem p = make_problem(std::move(t), o, Layout::kContiguous, seed);
    EXPECT_TRUE(no_nan(values(backward(p, o)))) << "seed " << seed;
  }
}

// lse = +inf (a score overflowed in the forward pass) has no gradient: an Error naming the row,
// before anything is written.
TEST_P(Edge, BackwardRefusesAnOverflowedLse) {
  for (DType dt : kDTypes) {
    const Tensors t = one_feature(dt, 3, 2, 1.0, {0}, 1.0, {5.0});
    sdpa_test::Problem p = make_problem(t.converted(dt), opts(), Layout::kContiguous, 9);
    p.lse.set(1, kInf);
    const Grads g = empty_grads(t, Layout::kContiguous);
    expect_sdpa_error(
        [&] { sdpa::attention_backward(t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), g.gradients(), opts()); },
        {"lse has +inf at index (1,)", "overflowed"});
    EXPECT_TRUE(g.untouched());
    // Also when no gradient has an element to write (found by the fuzzer).
    const Tensors e{GuardedTensor(dt, {2, 0}), GuardedTensor(dt, {0, 0}), GuardedTensor(dt, {0, 0}), std::nullopt};
    GuardedTensor out(dt, {2, 0}), lse = tensor(compute_dtype(dt), {2}, {-kInf, kInf}), dout(dt, {2, 0});
    const Grads ge = empty_grads(e, Layout::kContiguous);
    expect_sdpa_error(
        [&] { sdpa::attention_backward(e.inputs(), out.view(), lse.view(), dout.view(), ge.gradients(), opts()); },
        {"lse has +inf at index (1,)"});
  }
}

}  // namespace
