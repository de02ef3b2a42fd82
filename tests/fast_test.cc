// Options::precision kFast (issue 28): 16-bit inputs whose weights p are rounded to the inputs'
// type before p·V, with the normaliser summed from the same rounded weights. The sweep's 16-bit
// cases against the float64 oracle with the tolerance rule, where the naive yardstick
// (Backend::kNaive with kFast) rounds the same p, on every path this machine has (AMX tiles,
// vdpbf16ps, the widening path with the rounding, AVX2); rows that stay stochastic; the weights and
// statistics that stay exact mode's; determinism across thread counts; float32 and float64
// inputs, which ignore it.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backward_util.h"
#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;
using sdpa::Precision;

constexpr DType kHalves[] = {kBF16, kF16};

sdpa::Options fast(sdpa::Options o = {}) {
  o.precision = Precision::kFast;
  return o;
}

// ---- The sweep's 16-bit cases in kFast (named Table/Sweep*: the sanitizer stage runs a third) ----

std::vector<Case> half_sweep_cases() {
  std::vector<Case> cases;
  for (const Case& c : sweep_cases()) {
    if (c.dtype == kBF16 || c.dtype == kF16) cases.push_back(c);
  }
  return cases;
}

// Runs f on every path the machine has: the best, vdpbf16ps where the best is AMX, the
// widening one, AVX2.
template <typename F>
void on_every_path(const F& f) {
  {
    SCOPED_TRACE("best path");
    f();
  }
  if (sdpa::kernel_path_available(sdpa::KernelPath::kAmxBf16)) {
    SCOPED_TRACE("capped at kAvx512Bf16");
    const KernelPathCap cap(sdpa::KernelPath::kAvx512Bf16);
    f();
  }
  {
    SCOPED_TRACE("capped at kSimd");
    const KernelPathCap cap(sdpa::KernelPath::kSimd);
    f();
  }
  if (avx2_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX2");
    const Avx2Only avx2;
    f();
    EXPECT_EQ(dispatched_target(), "AVX2");  // the calls really ran on AVX2
  }
}

// One path's kFast result against the case's reference and tolerances.
void check_fast_path(const Case& c, const Tensors& t, const sdpa::Options& o, const ForwardExpected& e) {
  const Outs got = run(t, o, c.layout);
  EXPECT_TRUE(got.guards_intact());
  EXPECT_TRUE(no_nan(values(got)));
  EXPECT_TRUE(blocked_are_exact(t, o, got));
  EXPECT_TRUE(matches(e, got));
}

// Every path this machine has (on_every_path), against one reference computed once: it is
// most of a case's time.
void check_fast_case(const Case& c) {
  const Tensors t = make_inputs(c);
  const sdpa::Options o = fast(options(c, Backend::kAuto));
  ForwardExpected e;
  ASSERT_TRUE(expected_forward(t, o, e));
  on_every_path([&] { check_fast_path(c, t, o, e); });
}

const auto kCaseName = [](const testing::TestParamInfo<Case>& info) { return info.param.name; };

class SweepFast : public testing::TestWithParam<Case> {};
TEST_P(SweepFast, EveryPathMatchesReference) { check_fast_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Table, SweepFast, testing::ValuesIn(half_sweep_cases()), kCaseName);

// The backward in kFast: p rounded before dv's product, ds before dq's and dk's, against the
// naive backward that rounds the same (the tolerance rule's yardstick), from a kFast forward.
// On every path the machine has (on_every_path: AMX, vdpbf16ps, the widening path with the
// roundings, AVX2), against one reference.
void check_fast_backward_case(const Case& c) {
  const sdpa::Options o = fast(options(c, Backend::kAuto));
  uint32_t seed = 2166136261u;
  for (unsigned char ch : c.name) seed = (seed ^ ch) * 16777619u;
  const Problem p = make_problem(make_inputs(c), o, c.layout, seed);
  Expected e;
  ASSERT_TRUE(expected(p, o, e));
  on_every_path([&] {
    const Grads got = backward(p, o, c.layout);
    EXPECT_TRUE(got.guards_intact());
    EXPECT_TRUE(matches(e, got));
  });
}

class BackwardSweepFast : public testing::TestWithParam<Case> {};
TEST_P(BackwardSweepFast, MatchesReference) { check_fast_backward_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Table, BackwardSweepFast, testing::ValuesIn(half_sweep_cases()), kCaseName);

// ---- Semantics ----

// Values all equal to c give exactly c: the normaliser is the sum of the weights the numerator
// uses (FlashAttention sums the unrounded ones and falls short of c). Long rows (sums of
// thousands of rounded weights), several key tiles and chunks, a mask with fully masked rows,
// causal, GQA, decode and prefill.
TEST(Fast, RowsStayStochastic) {
  for (DType dt : kHalves) {
    for (double c : {1.0, -0.375, 3.0}) {
      struct Shape {
        std::vector<int64_t> q, k, v;
        Causal causal;
        bool mask;
      };
      const Shape shapes[] = {
          {{2, 4, 97, 64}, {2, 2, 1025, 64}, {2, 2, 1025, 40}, Causal::kNone, false},
          {{1, 8, 130, 32}, {1, 2, 300, 32}, {1, 2, 300, 33}, Causal::kBottomRight, true},
          {{1, 4, 1, 64}, {1, 4, 5000, 64}, {1, 4, 5000, 16}, Causal::kNone, false},  // decode, key chunks
          {{3, 17, 16}, {3, 4097, 16}, {3, 4097, 8}, Causal::kTopLeft, false},
      };
      for (const Shape& s : shapes) {
        SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " c = " << c << " Nk = " << s.k[s.k.size() - 2]);
        Tensors t = random_qkv(dt, s.q, s.k, s.v, 41);
        std::vector<double> vals(static_cast<size_t>(t.v.numel()), c);
        t.v = tensor(dt, s.v, vals);
        if (s.mask) {
          std::vector<int64_t> mshape = {s.q[0], s.q[1], s.q[2], s.k[2]};
          GuardedTensor m(DType::kBool, mshape);
          std::mt19937 rng(5);
          fill_mask(m, rng, 0.6, 0.1);
          t.mask = std::move(m);
        }
        sdpa::Options o = fast();
        o.causal = s.causal;
        on_every_path([&] {
          const Values got = values(run(t, o, Layout::kContiguous, false));
          int64_t rows_checked = 0;
          for (size_t r = 0; r < got.out.size(); ++r) {
            if (got.out[r] == 0) continue;  // a row with no allowed key
            ASSERT_EQ(got.out[r], c) << "element " << r;
            ++rows_checked;
          }
          EXPECT_GT(rows_checked, 0);
        });
      }
    }
  }
}

// The weights and statistics describe the exact softmax (an exact pass writes them); out and
// lse are those of the kFast call without them, bit for bit.
TEST(Fast, WeightsAndStatisticsAreExactModes) {
  for (DType dt : kHalves) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    for (const Tensors& t : {random_qkv(dt, {2, 4, 97, 32}, {2, 2, 300, 32}, {2, 2, 300, 16}, 42),
                             random_qkv(dt, {1, 4, 1, 32}, {1, 1, 700, 32}, {1, 1, 700, 16}, 43)}) {
      const Outs exact = run(t, sdpa::Options{});
      const Outs with_weights = run(t, fast());
      ASSERT_TRUE(exact.weights && with_weights.weights);
      EXPECT_EQ(exact.weights->values(), with_weights.weights->values());
      const Outs plain = run(t, fast(), Layout::kContiguous, false);
      EXPECT_EQ(plain.out.values(), with_weights.out.values());
      // lse: from a call that asks for lse alone.
      Outs lse_only{GuardedTensor(t.q.dtype(), plain.out.shape()), std::nullopt,
                    GuardedTensor(kF32, with_weights.lse->shape())};
      sdpa::attention(t.inputs(), lse_only.outputs(), fast());
      EXPECT_EQ(lse_only.lse->values(), with_weights.lse->values());
      EXPECT_EQ(lse_only.out.values(), plain.out.values());
      // Statistics: exact mode's, bit for bit.
      const auto stats_of = [&](const sdpa::Options& o) {
        const std::vector<int64_t> rows(t.q.shape().begin(), t.q.shape().end() - 1);
        GuardedTensor out(t.q.dtype(), plain.out.shape()), entropy(kF32, rows), max_weight(kF32, rows);
        sdpa::Outputs outs{out.view(), std::nullopt, std::nullopt};
        outs.stats.entropy = entropy.view();
        outs.stats.max_weight = max_weight.view();
        sdpa::attention(t.inputs(), outs, o);
        return std::vector<std::vector<double>>{entropy.values(), max_weight.values(), out.values()};
      };
      const auto e = stats_of(sdpa::Options{}), f = stats_of(fast());
      EXPECT_EQ(e[0], f[0]);
      EXPECT_EQ(e[1], f[1]);
      EXPECT_EQ(f[2], plain.out.values());  // out still kFast's
    }
  }
}

TEST(Fast, ThreadCountDoesNotChangeResults) {
  for (DType dt : kHalves) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    for (const Tensors& t : {random_qkv(dt, {2, 4, 97, 32}, {2, 2, 1030, 32}, {2, 2, 1030, 16}, 44),
                             random_qkv(dt, {1, 4, 1, 32}, {1, 1, 4500, 32}, {1, 1, 4500, 16}, 45)}) {
      sdpa::set_num_threads(1);
      const Outs one = run(t, fast());
      sdpa::set_num_threads(3);
      const Outs three = run(t, fast());
      sdpa::set_num_threads(0);
      EXPECT_TRUE(bitwise_equal(one, three));
    }
  }
}

// float32 and float64 inputs, and float32 queries over a 16-bit cache, compute exactly.
TEST(Fast, WiderInputsIgnoreIt) {
  for (DType dt : {kF32, kF64}) {
    const Tensors t = random_qkv(dt, {2, 4, 33, 16}, {2, 2, 70, 16}, {2, 2, 70, 8}, 46);
    EXPECT_TRUE(bitwise_equal(run(t, sdpa::Options{}), run(t, fast())));
  }
  Tensors mixed = random_qkv(kBF16, {1, 2, 9, 16}, {1, 2, 70, 16}, {1, 2, 70, 8}, 47);
  mixed.q = mixed.q.converted(kF32, mixed.q.layout());
  EXPECT_TRUE(bitwise_equal(run(mixed, sdpa::Options{}), run(mixed, fast())));
}

// kFast changes the results (the test above would pass if it were ignored everywhere), within
// the rule, with the path reported: vdpbf16ps for bfloat16 prefill where the CPU has it.
TEST(Fast, BfloatPrefillRunsOnTheBf16Path) {
  const Tensors t = random_qkv(kBF16, {1, 4, 200, 64}, {1, 4, 300, 64}, {1, 4, 300, 64}, 48);
  const Outs exact = run(t, sdpa::Options{}, Layout::kContiguous, false);
  const Outs got = run(t, fast(), Layout::kContiguous, false);
  const sdpa::KernelPath path = sdpa::last_kernel_path();
  EXPECT_FALSE(bitwise_equal(exact, got)) << "kFast changed nothing";
  EXPECT_TRUE(matches_reference(t, fast(), got));
  if (sdpa::kernel_path_available(sdpa::KernelPath::kAvx512Bf16)) {
    EXPECT_GE(path, sdpa::KernelPath::kAvx512Bf16);
  }
}

// The fused kernels round what the naive twin rounds: their kFast results lie much nearer the
// twin's (they differ where a rounding falls the other way, and in summation order) than exact
// mode's do (which differ by the rounding itself, in every element). Forward and backward.
TEST(Fast, KernelsRoundWhatTheNaiveTwinRounds) {
  const auto mean_gap = [](const std::vector<double>& a, const std::vector<double>& b) {
    double sum = 0;
    for (size_t i = 0; i < a.size(); ++i) sum += std::abs(a[i] - b[i]);
    return sum / static_cast<double>(a.size());
  };
  for (DType dt : kHalves) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    // Forward: one tile of keys (fewer than 128), so that the kernel's running max is the row's
    // max, as the twin's (past it the kernel rounds exp(s - m) for the max so far, then rescales).
    const Tensors t = random_qkv(dt, {1, 4, 64, 64}, {1, 4, 120, 64}, {1, 4, 120, 64}, 50);
    sdpa::Options naive = fast();
    naive.backend = Backend::kNaive;
    const std::vector<double> twin = run(t, naive, Layout::kContiguous, false).out.values();
    const double fast_gap = mean_gap(run(t, fast(), Layout::kContiguous, false).out.values(), twin);
    const double exact_gap = mean_gap(run(t, sdpa::Options{}, Layout::kContiguous, false).out.values(), twin);
    EXPECT_LT(fast_gap, 0.5 * exact_gap) << "forward: kFast " << fast_gap << ", kExact " << exact_gap;
    // Backward, from the kFast forward's out and lse.
    const Problem p = make_problem(t.converted(dt), fast(), Layout::kContiguous, 51);
    const GradValues twin_grads = values(backward(p, naive));
    const GradValues fast_grads = values(backward(p, fast()));
    const GradValues exact_grads = values(backward(p, sdpa::Options{}));
    for (int g = 0; g < 3; ++g) {
      const double fg = mean_gap(fast_grads.g[g], twin_grads.g[g]), eg = mean_gap(exact_grads.g[g], twin_grads.g[g]);
      EXPECT_LT(fg, 0.5 * eg) << kGradNames[g] << ": kFast " << fg << ", kExact " << eg;
    }
  }
}

// Empty head dims on every path, forward and backward: Dv = 0 (nothing to write but lse) and
// Dk = 0 (scores all 0).
// kFast's AMX p·V sized its packed value tiles by Dv and divided by that size (the fuzzer's
// SIGFPE at Dv = 0); the prefill shapes reach the block kernel, the decode one the few-rows one.
TEST(Fast, EmptyHeadDimsOnEveryPath) {
  for (DType dt : kHalves) {
    for (const auto& [nq, dk, dv] : {std::tuple<int64_t, int64_t, int64_t>{200, 32, 0}, {200, 0, 16}, {200, 0, 0},
                                      {1, 32, 0}}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << nq << " Dk=" << dk << " Dv=" << dv);
      const Tensors t = random_qkv(dt, {1, 2, nq, dk}, {1, 2, 300, dk}, {1, 2, 300, dv}, 52);
      const Problem p = make_problem(t.converted(dt), fast(), Layout::kContiguous, 53);
      Expected e;
      ASSERT_TRUE(expected(p, fast(), e));
      on_every_path([&] {
        const Outs got = run(t, fast());
        EXPECT_TRUE(got.guards_intact());
        EXPECT_TRUE(matches_reference(t, fast(), got));
        const Grads grads = backward(p, fast());
        EXPECT_TRUE(grads.guards_intact());
        EXPECT_TRUE(matches(e, grads));
      });
    }
  }
}

TEST(Fast, UnknownPrecisionIsRefused) {
  const Tensors t = random_qkv(kBF16, {1, 1, 4, 8}, {1, 1, 4, 8}, {1, 1, 4, 8}, 49);
  sdpa::Options o;
  o.precision = static_cast<Precision>(9);
  expect_sdpa_error([&] { run(t, o); }, {"precision", "9"});
}

}  // namespace
