// bfloat16 and float16 storage (float32 compute) beyond the sweep, which runs every case in both:
// results rounded once to nearest even, float32 queries over a 16-bit KV cache, float16 at the
// top and bottom of its range, large logits, NaN and inf in 16-bit inputs, and the dtype policy's
// errors. Every backend.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backward_util.h"
#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr DType kHalves[] = {kBF16, kF16};

class LowPrecision : public testing::TestWithParam<Backend> {
 protected:
  sdpa::Options opts() const {
    sdpa::Options o;
    o.backend = GetParam();
    return o;
  }
};

INSTANTIATE_TEST_SUITE_P(Backends, LowPrecision,
                         testing::Values(Backend::kAuto, Backend::kFlash, Backend::kNaive, Backend::kReference),
                         [](const testing::TestParamInfo<Backend>& info) { return testing::PrintToString(info.param); });

// q = 0 gives two keys weight 1/2 each, so out = (v0 + v1) / 2, exact in float32 for 16-bit v:
// the stored out must be that mean rounded once to nearest even (ties to the even mantissa),
// in normal and subnormal range.
TEST_P(LowPrecision, OutputsAreRoundedOnceToNearestEven) {
  for (DType dt : kHalves) {
    const double u = eps(dt);  // the spacing of the 16-bit type just above 1
    const double tiny = dt == kF16 ? 0x1p-24 : 0x1p-133;  // the smallest subnormal
    const std::vector<std::pair<double, double>> pairs = {
        {1.0, 1.0 + u},            // mean 1 + u/2: a tie, to 1 (even)
        {1.0 + u, 1.0 + 2 * u},    // mean 1 + 3u/2: a tie, to 1 + 2u (even)
        {1.0, 1.0 + 2 * u},        // exact
        {-1.0 - u, -1.0},          // a tie below zero, to -1
        {0.0, tiny},               // a subnormal tie, to 0
        {tiny, 2 * tiny},          // to 2 units (even)
        {3 * tiny, 4 * tiny},      // 3.5 units: to 4
    };
    for (const auto& [a, b] : pairs) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " v = " << a << ", " << b);
      const Tensors t{tensor(dt, {1, 1}, {0.0}), tensor(dt, {2, 1}, {0.5, -0.25}), tensor(dt, {2, 1}, {a, b}),
                      std::nullopt};
      ASSERT_EQ(t.v.get(0), a);  // the pair is exact in the 16-bit type
      ASSERT_EQ(t.v.get(1), b);
      const Values got = values(run(t, opts()));
      EXPECT_EQ(got.out[0], round_to(dt, (a + b) / 2));
      EXPECT_EQ(got.weights, (std::vector<double>{0.5, 0.5}));
    }
  }
}

// float16's largest value, 65504, in v (out may not overflow: a convex combination stays below
// it) and in q, k (scores of 65504² · Dk ~ 1.7e10, far past float16 but fine in float32).
// Values in float16's subnormal range. Large logits (|s| ~ 1e4). All against the rule.
TEST_P(LowPrecision, Float16RangeEndsAndLargeLogits) {
  std::mt19937 rng(3);
  for (DType dt : kHalves) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    Tensors top{GuardedTensor(dt, {2, 5, 4}), GuardedTensor(dt, {2, 7, 4}), GuardedTensor(dt, {2, 7, 3}), std::nullopt};
    for (GuardedTensor* x : {&top.q, &top.k, &top.v}) {
      for (int64_t n = 0; n < x->numel(); ++n) x->set(n, n % 3 == 0 ? 65504.0 : n % 3 == 1 ? -65504.0 : 1.0);
    }
    sdpa::Options o = opts();
    o.scale = 1e-6;  // scores up to ~1.7e4
    const Outs a = run(top, o);
    EXPECT_TRUE(matches_reference(top, o, a));
    for (int64_t n = 0; n < a.out.numel(); ++n) EXPECT_TRUE(std::isfinite(a.out.get(n))) << n;

    Tensors sub{GuardedTensor(dt, {3, 9, 16}), GuardedTensor(dt, {3, 33, 16}), GuardedTensor(dt, {3, 33, 8}),
                std::nullopt};
    fill_normal(sub.q, rng);
    fill_normal(sub.k, rng);
    fill_normal(sub.v, rng, dt == kF16 ? 1e-6 : 1e-40);  // mostly subnormal in the 16-bit type
    EXPECT_TRUE(matches_reference(sub, opts(), run(sub, opts())));

    Tensors sharp{GuardedTensor(dt, {2, 17, 8}), GuardedTensor(dt, {2, 40, 8}), GuardedTensor(dt, {2, 40, 8}),
                  std::nullopt};
    fill_normal(sharp.q, rng, 30);
    fill_normal(sharp.k, rng, 30);
    fill_normal(sharp.v, rng);
    o = opts();
    o.scale = 2.0;  // |s| ~ 1e4: every row nearly one-hot
    EXPECT_TRUE(matches_reference(sharp, o, run(sharp, o)));
  }
}

// A KV cache stored in 16 bits read by float32 queries: out, dq in float32, dk and dv in the
// cache's dtype, every semantic of the sweep's cases (GQA, masks, causal, windows, dropout).
TEST_P(LowPrecision, Float32QueriesOverA16BitCache) {
  for (DType kv : kHalves) {
    for (int variant = 0; variant < 4; ++variant) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(kv) << " variant " << variant);
      Case c{.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = variant == 3 ? 1 : 33, .Nk = variant == 3 ? 3000 : 65,
             .Dk = 64, .Dv = 40};
      c.dtype = kv;
      if (variant == 1) c.causal = Causal::kBottomRight;
      if (variant == 2) {
        c.mask = MaskKind::kAdditive;
        c.window = {16, 3};
      }
      c.name = "mixed";
      Tensors t = make_inputs(c);
      t.q = t.q.converted(kF32, t.q.layout());  // float32 queries (the same values)
      if (t.mask) t.mask = t.mask->converted(kF32, t.mask->layout());
      sdpa::Options o = opts();
      if (variant == 2) {
        o.window = c.window;
        o.dropout_p = 0.2;
        o.seed = 11;
      }
      o.causal = c.causal;
      const Outs got = run(t, o);
      EXPECT_EQ(got.out.dtype(), kF32);
      EXPECT_TRUE(matches_reference(t, o, got));
      const sdpa_test::Problem p = make_problem(t.converted(kF32).converted(kF32), o, Layout::kContiguous, 4);
      sdpa_test::Problem mixed{t.converted(kF32), p.out.converted(kF32, Layout::kContiguous),
                               p.lse.converted(kF32, Layout::kContiguous), p.dout.converted(kF32, Layout::kContiguous)};
      mixed.t.k = t.k.converted(kv, Layout::kContiguous);
      mixed.t.v = t.v.converted(kv, Layout::kContiguous);
      Expected e;
      ASSERT_TRUE(expected(mixed, o, e));
      const Grads g = backward(mixed, o);
      EXPECT_EQ(g.dk.dtype(), kv);
      EXPECT_TRUE(matches(e, g));
    }
  }
}

// NaN and inf stored in 16 bits: a blocked key's NaN value row reaches nothing; a row with no
// allowed key is 0 with lse -inf; a NaN query row is NaN and leaves the other rows bit for bit.
TEST_P(LowPrecision, NonFiniteSixteenBitInputs) {
  for (DType dt : kHalves) {
    SCOPED_TRACE(sdpa::dtype_name(dt));
    sdpa::Options o = opts();
    o.causal = Causal::kTopLeft;  // row 0 sees key 0 only
    const Tensors t{tensor(dt, {3, 1}, {0.5, 1, -1}), tensor(dt, {3, 1}, {1, 2, 3}), tensor(dt, {3, 1}, {4, kNaN, kNaN}),
                    tensor(DType::kBool, {3}, {1, 0, 0})};
    const Values got = values(run(t, o));
    EXPECT_EQ(got.out, (std::vector<double>{4, 4, 4}));
    Tensors none = t.converted(dt);
    none.mask = tensor(DType::kBool, {3}, {0, 0, 0});
    const Values z = values(run(none, o));
    EXPECT_EQ(z.out, (std::vector<double>{0, 0, 0}));
    EXPECT_EQ(z.lse, (std::vector<double>(3, -kInf)));
    Tensors nan_row = t.converted(dt);
    nan_row.mask.reset();
    nan_row.v = tensor(dt, {3, 1}, {4, 5, 6});
    const Values clean = values(run(nan_row, o));
    nan_row.q.set(1, kNaN);
    const Values dirty = values(run(nan_row, o));
    EXPECT_TRUE(std::isnan(dirty.out[1]));
    EXPECT_EQ(dirty.out[0], clean.out[0]);
    EXPECT_EQ(dirty.out[2], clean.out[2]);
  }
}

// The dtype policy: q, k, v one dtype (or float32 q over a 16-bit k, v of one dtype); weights and
// lse float32 for 16-bit q; errors name the argument and write nothing.
TEST_P(LowPrecision, DtypePolicyErrors) {
  const Tensors t{GuardedTensor(kBF16, {2, 4}), GuardedTensor(kBF16, {3, 4}), GuardedTensor(kBF16, {3, 2}),
                  std::nullopt};
  GuardedTensor out(kBF16, {2, 2}), lse16(kBF16, {2}), k32(kF32, {3, 4}), v16(kF16, {3, 2}), q32(kF32, {2, 4}),
      out32(kF32, {2, 2});
  auto expect_error = [&](const sdpa::Inputs& in, const sdpa::Outputs& outs, const std::string& what) {
    try {
      sdpa::attention(in, outs, opts());
      ADD_FAILURE() << "no error; wanted: " << what;
    } catch (const sdpa::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_TRUE(out.untouched() && out32.untouched());
  };
  sdpa::Inputs in = t.inputs();
  sdpa::Outputs outs;
  outs.out = out.view();
  outs.lse = lse16.view();
  expect_error(in, outs, "lse has dtype bfloat16 but must be float32, the compute type of bfloat16 q");
  outs.lse.reset();
  in.k = k32.view();
  expect_error(in, outs, "k has dtype float32 but q has dtype bfloat16");
  in = t.inputs();
  in.q = q32.view();
  in.v = v16.view();
  outs.out = out32.view();
  expect_error(in, outs, "v has dtype float16 but k has dtype bfloat16");
}

// ---- Instruction paths (sdpa::KernelPath) ----

// Which path a call ran: kAmxBf16 for bfloat16 prefill where the CPU has AMX and AVX-512 is
// dispatched, else kAvx512Bf16 where it has that, kSimd when capped (set_max_kernel_path,
// Highway at AVX2), for decode shapes, float16, and float32 queries over a bfloat16 cache.
// Every one against the reference.
TEST(KernelPaths, TheCallReportsThePathItRan) {
  const bool has = sdpa::kernel_path_available(sdpa::KernelPath::kAvx512Bf16);
  const bool amx = sdpa::kernel_path_available(sdpa::KernelPath::kAmxBf16);
  EXPECT_TRUE(sdpa::kernel_path_available(sdpa::KernelPath::kSimd));
  std::printf("AVX512_BF16 path %s, AMX path %s on this CPU\n", has ? "available" : "not available",
              amx ? "available" : "not available");
  Case prefill{.rank = 4, .B = 1, .Hq = 4, .Hkv = 2, .Nq = 37, .Nk = 300, .Dk = 33, .Dv = 20};
  prefill.dtype = kBF16;
  prefill.causal = Causal::kBottomRight;
  prefill.name = "paths_prefill";
  Case decode = prefill;
  decode.Nq = 1;
  decode.name = "paths_decode";
  const auto ran = [](const Tensors& t, const sdpa::Options& o) {
    const Outs got = run(t, o);
    const sdpa::KernelPath path = sdpa::last_kernel_path();  // before matches_reference's own calls
    EXPECT_TRUE(matches_reference(t, o, got));
    return path;
  };
  sdpa::Options o;
  o.causal = Causal::kBottomRight;
  const Tensors t = make_inputs(prefill);
  const auto want = amx ? sdpa::KernelPath::kAmxBf16 : has ? sdpa::KernelPath::kAvx512Bf16 : sdpa::KernelPath::kSimd;
  EXPECT_EQ(ran(t, o), want);
  EXPECT_EQ(ran(make_inputs(decode), o), sdpa::KernelPath::kSimd);
  EXPECT_EQ(ran(t.converted(kF16), o), sdpa::KernelPath::kSimd);
  Tensors mixed = t.converted(kBF16);
  mixed.q = mixed.q.converted(kF32, mixed.q.layout());
  EXPECT_EQ(ran(mixed, o), sdpa::KernelPath::kSimd);
  {
    KernelPathCap cap(sdpa::KernelPath::kAvx512Bf16);
    EXPECT_EQ(sdpa::max_kernel_path(), sdpa::KernelPath::kAvx512Bf16);
    EXPECT_EQ(ran(t, o), has ? sdpa::KernelPath::kAvx512Bf16 : sdpa::KernelPath::kSimd);
  }
  {
    KernelPathCap cap(sdpa::KernelPath::kSimd);
    EXPECT_EQ(sdpa::max_kernel_path(), sdpa::KernelPath::kSimd);
    EXPECT_EQ(ran(t, o), sdpa::KernelPath::kSimd);
  }
  if (avx2_pass_skip_reason().empty()) {
    Avx2Only cap;
    EXPECT_EQ(ran(t, o), sdpa::KernelPath::kSimd);
  }
  EXPECT_EQ(ran(t, o), want);  // the caps are lifted
  // The backward's score and dout · vᵀ products take the same path.
  const sdpa_test::Problem prob = make_problem(t.converted(kBF16), o, Layout::kContiguous, 5);
  backward(prob, o);
  EXPECT_EQ(sdpa::last_kernel_path(), want);
  EXPECT_THROW(sdpa::set_max_kernel_path(static_cast<sdpa::KernelPath>(7)), sdpa::Error);
}

// vdpbf16ps reads subnormal inputs as 0, and the kernels scale its sums after (q·k·scale, not
// q·scale·k). Blocks of queries and tiles of keys outside the range where neither matters
// ([2^-40, 2^32)) are computed by widening: here each would otherwise lose a score of ~1
// (weights 0.5/0.5 instead of 0.73/0.27), or overflow q·k where q·scale·k = 2^90 is finite.
TEST(KernelPaths, OutOfRangeInputsAreWidened) {
  const double sub = 0x1p-127;  // a bfloat16 subnormal (exact)
  const double e1 = std::exp(1.0);
  struct Setup {
    double q, k, scale, out, lse;
  };
  for (const Setup& c : {Setup{sub, 0x1p127, 1.0, e1 / (1 + e1), std::log(1 + e1)},  // the queries' block
                         Setup{0x1p127, sub, 1.0, e1 / (1 + e1), std::log(1 + e1)},  // the queries' block
                         Setup{0x1p30, 0x1p100, 0x1p-40, 1.0, 0x1p90}}) {            // the keys' tile
    SCOPED_TRACE(testing::Message() << "q " << c.q << " k " << c.k << " scale " << c.scale);
    const int64_t nq = 16;  // more rows than the few-rows (decode) kernel takes
    std::vector<double> q(nq * 2, 0.0), k = {c.k, 0, 0, 0}, v = {1, 0};
    for (int64_t i = 0; i < nq; ++i) q[i * 2] = c.q;
    const Tensors t{tensor(kBF16, {nq, 2}, q), tensor(kBF16, {2, 2}, k), tensor(kBF16, {2, 1}, v), std::nullopt};
    ASSERT_EQ(t.q.get(0), c.q);
    ASSERT_EQ(t.k.get(0), c.k);
    sdpa::Options o;
    o.scale = c.scale;
    const Outs got = run(t, o, Layout::kContiguous, /*with_extras=*/true);
    EXPECT_TRUE(matches_reference(t, o, got));
    const Values x = values(got);
    EXPECT_NEAR(x.out[0], c.out, 4 * eps(kBF16));
    EXPECT_NEAR(x.lse[0], c.lse, 4 * eps(kF32) * c.lse);
  }
}

// Dk = 0 with bfloat16 and more rows than the decode kernel takes: the bfloat16 pairs of q
// (empty) once asked Highway for 0 bytes, which aborts the process (fuzz finding F11). Every
// score is 0, so each row is the mean of v; lse = log(Nk). Forward and backward, every path.
TEST(KernelPaths, Bfloat16WithNoFeaturesRuns) {
  for (sdpa::KernelPath cap : {sdpa::KernelPath::kAmxBf16, sdpa::KernelPath::kAvx512Bf16, sdpa::KernelPath::kSimd}) {
    SCOPED_TRACE(static_cast<int>(cap));
    const KernelPathCap capped(cap);
    const int64_t nq = 16;
    const Tensors t{GuardedTensor(kBF16, {nq, 0}), GuardedTensor(kBF16, {4, 0}), tensor(kBF16, {4, 1}, {1, 2, 4, 9}),
                    std::nullopt};
    const Outs got = run(t, sdpa::Options{}, Layout::kContiguous, /*with_extras=*/true);
    const Values x = values(got);
    for (int64_t i = 0; i < nq; ++i) {
      EXPECT_EQ(x.out[i], 4.0);
      EXPECT_NEAR(x.lse[i], std::log(4.0), 4 * eps(kF32));
    }
    GuardedTensor dout(kBF16, {nq, 1}), dq(kBF16, {nq, 0}), dk(kBF16, {4, 0}), dv(kBF16, {4, 1});
    for (int64_t i = 0; i < nq; ++i) dout.set(i, 1.0);
    sdpa::attention_backward(t.inputs(), got.out.view(), got.lse->view(), dout.view(), {dq.view(), dk.view(), dv.view()});
    for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(dv.get(j), nq / 4.0);  // each row gives each key weight 1/4
  }
}

}  // namespace
