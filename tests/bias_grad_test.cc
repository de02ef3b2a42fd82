// The float mask's gradient (Gradients::dbias): central differences of the float64 forward
// (the header's definition, independent of src/), every backend and dtype against kReference at
// a tolerance derived per element, the broadcast shapes (each element sums the scores that read
// it), blocked scores' exact zeros, thread-count invariance, and errors that write nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;
using Order = sdpa::Options::SoftcapOrder;

struct WithBias {
  Grads g;
  GuardedTensor dbias;
};

// attention_backward with dbias of dtype dt (the mask's shape) in `layout`.
WithBias backward_with_bias(const Problem& p, const sdpa::Options& o, DType dt, Layout layout = Layout::kContiguous) {
  WithBias r{empty_grads(p.t, layout), GuardedTensor(dt, p.t.mask->shape(), layout)};
  sdpa::Gradients g = r.g.gradients();
  g.dbias = r.dbias.view();
  sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), g, o);
  return r;
}

// One case: the problem's dims, the mask's shape (its broadcast), the options that matter.
struct Case {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  std::vector<int64_t> mask_shape;
  Causal causal = Causal::kNone;
  double softcap = 0;
  Order order = Order::kBeforeBias;
  bool alibi = false, sinks = false;
  double dropout = 0;
};

const Case kCases[] = {
    {"full", 2, 3, 3, 7, 9, 5, 4, {2, 3, 7, 9}},
    {"per_position", 2, 4, 2, 6, 11, 3, 5, {6, 11}, Causal::kBottomRight},  // T5's relative bias: (Nq, Nk)
    {"per_head_key", 2, 3, 1, 5, 8, 4, 4, {1, 3, 1, 8}},
    {"key_padding", 3, 2, 2, 4, 7, 6, 3, {3, 1, 1, 7}, Causal::kTopLeft},
    {"scalar", 1, 2, 2, 5, 6, 4, 4, {}},
    {"rank3_column", 1, 3, 3, 6, 5, 4, 2, {3, 6, 1}},
    {"cap_before", 2, 2, 1, 6, 8, 4, 4, {1, 2, 6, 8}, Causal::kNone, 1.5, Order::kBeforeBias},
    {"cap_after", 2, 2, 1, 6, 8, 4, 4, {1, 2, 6, 8}, Causal::kNone, 1.5, Order::kAfterBias},
    {"alibi_sinks", 2, 4, 2, 5, 9, 3, 3, {5, 9}, Causal::kBottomRight, 0, Order::kBeforeBias, true, true},
    {"dropout", 1, 2, 2, 7, 10, 4, 4, {2, 7, 10}, Causal::kNone, 0, Order::kBeforeBias, false, false, 0.3},
    {"dk0", 1, 2, 2, 3, 5, 0, 2, {3, 5}},
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }  // not the bytes

struct Built {
  Tensors t;
  sdpa::Options o;
  std::optional<GuardedTensor> slopes, sinks;
};

// The case's tensors (float64, a float mask of normal biases with some -inf) and options.
Built build(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Built b{{GuardedTensor(kF64, {c.B, c.Hq, c.Nq, c.Dk}), GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.Dk}),
           GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.Dv}), GuardedTensor(kF64, c.mask_shape)},
          {},
          std::nullopt,
          std::nullopt};
  fill_normal(b.t.q, rng, 1.2);
  fill_normal(b.t.k, rng, 1.2);
  fill_normal(b.t.v, rng);
  fill_mask(*b.t.mask, rng, c.mask_shape.empty() ? 1.0 : 0.85, 0.0);
  b.o.causal = c.causal;
  b.o.softcap = c.softcap;
  b.o.softcap_order = c.order;
  if (c.alibi) {
    std::vector<double> s;
    for (int64_t h = 0; h < c.Hq; ++h) s.push_back(std::exp2(-2.0 * (h + 1)));
    b.slopes = tensor(kF32, {c.Hq}, s);
    b.o.alibi_slopes = b.slopes->view();
  }
  if (c.sinks) {
    std::vector<double> s;
    for (int64_t h = 0; h < c.Hq; ++h) s.push_back(0.5 - 0.3 * static_cast<double>(h));
    b.sinks = tensor(kF64, {c.Hq}, s);
    b.o.sinks = b.sinks->view();
  }
  if (c.dropout > 0) {
    b.o.dropout_p = c.dropout;
    b.o.seed = 77;
  }
  return b;
}

class BiasGrad : public testing::TestWithParam<Case> {};

// kReference's and kAuto's float64 dbias against central differences of the float64 forward:
// loss = Σ out · dout, one mask element moved at a time (a broadcast element moves every score
// that reads it, so the difference sums them as the header says). Blocked elements (-inf) get
// exactly 0.
TEST_P(BiasGrad, MatchesFiniteDifferencesInFloat64) {
  const Case& c = GetParam();
  Built b = build(c, 3);
  const Problem p = make_problem(b.t.converted(kF64), b.o, Layout::kContiguous, 5);
  sdpa::Options ref = b.o;
  ref.backend = Backend::kReference;
  std::vector<double> got[2];
  for (int n = 0; n < 2; ++n) {
    sdpa::Options o = b.o;
    o.backend = n == 0 ? Backend::kReference : Backend::kAuto;
    const WithBias r = backward_with_bias(p, o, kF64, Layout::kPadded);
    ASSERT_TRUE(r.dbias.guards_intact());
    got[n] = r.dbias.values();
  }
  GuardedTensor& mask = *b.t.mask;
  for (int64_t m = 0; m < mask.numel(); ++m) {
    const double x0 = mask.get(m);
    const size_t at = static_cast<size_t>(m);
    if (x0 == -kInf) {
      EXPECT_EQ(got[0][at], 0.0) << "element " << m << " blocks its scores";
      EXPECT_EQ(got[1][at], 0.0) << "element " << m << " blocks its scores";
      continue;
    }
    const auto loss = [&](double x) {
      mask.set(m, x);
      const Values v = values(run(b.t, ref, Layout::kContiguous, /*with_extras=*/false));
      double l = 0;
      for (size_t n = 0; n < v.out.size(); ++n) l += v.out[n] * p.dout.get(static_cast<int64_t>(n));
      return l;
    };
    const double h = 1e-6;
    const double numeric = (loss(x0 + h) - loss(x0 - h)) / (2 * h);
    mask.set(m, x0);
    // Central differences: truncation O(h²) and rounding O(eps · loss / h) ≈ 1e-10 here.
    EXPECT_NEAR(got[0][at], numeric, 1e-7 * std::max(1.0, std::abs(numeric))) << "kReference, element " << m;
    EXPECT_NEAR(got[1][at], numeric, 1e-7 * std::max(1.0, std::abs(numeric))) << "kAuto, element " << m;
  }
}

// The per-element error bound of a dbias computed in the compute type: each score's ds is
// p · (z·dp - D), whose rounding error is about eps times
//   p · (|z| Σ_e |dout_e v_e| + Σ_e |dout_e out_e| + |z·dp - D| · 2 (S + |lse|))
// (S = score_magnitude: the error of the score moves p by p times it; backward_util.cc's rule),
// and an element sums the scores that read it. 4 × that in the compute type's eps, plus one
// unit of the rounding of a dbias narrower than the compute type (float32 or 16-bit; absolute
// among its subnormals).
std::vector<double> dbias_tolerance(const Problem& p, const sdpa::Options& o, DType dbias_dtype,
                                    const std::vector<double>& ref) {
  const Tensors& t = p.t;
  const Dims d = dims_of(t);
  sdpa::Options r = o;
  r.backend = Backend::kReference;
  const Values w = values(run(t.converted(kF64), r));
  const std::vector<double> keep = o.dropout_p > 0 ? keep_mask(t, o.dropout_p, *o.seed) : std::vector<double>{};
  const double zk = 1 / (1 - o.dropout_p);
  const std::vector<int64_t>& ms = t.mask->shape();
  int64_t full[4] = {1, 1, 1, 1};
  for (size_t n = 0; n < ms.size(); ++n) full[4 - ms.size() + n] = ms[n];
  std::vector<double> mag(ref.size(), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i;
        double D = 0, D_size = 0;
        for (int64_t e = 0; e < d.Dv; ++e) {
          D += p.dout.at(b, h, i, e) * p.out.at(b, h, i, e);
          D_size += std::abs(p.dout.at(b, h, i, e) * p.out.at(b, h, i, e));
        }
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double pij = w.weights[static_cast<size_t>(row * d.Nk + j)];
          if (pij == 0) continue;
          const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * zk;
          double dp = 0, dp_size = 0;
          for (int64_t e = 0; e < d.Dv; ++e) {
            dp += p.dout.at(b, h, i, e) * t.v.at(b, h / d.group, j, e);
            dp_size += std::abs(p.dout.at(b, h, i, e) * t.v.at(b, h / d.group, j, e));
          }
          const double s_err = 2 * (score_magnitude(t, o, b, h, i, j) + std::abs(w.lse[static_cast<size_t>(row)]));
          const int64_t idx[4] = {b, h, i, j};
          int64_t flat = 0;
          for (int n = 0; n < 4; ++n) flat = flat * full[n] + (full[n] == 1 ? 0 : idx[n]);
          mag[static_cast<size_t>(flat)] += pij * (std::abs(z) * dp_size + D_size + std::abs(z * dp - D) * s_err);
        }
      }
  std::vector<double> tol(ref.size());
  const double compute_eps = eps(compute_dtype(t.q.dtype()));
  const bool narrower = eps(dbias_dtype) > compute_eps;  // float32 or 16-bit dbias of a wider compute type
  // Below the normal range a dtype's spacing is fixed: half its smallest subnormal.
  const double half_ulp_min = dbias_dtype == kF16 ? 0x1p-25 : dbias_dtype == kBF16 ? 0x1p-134 : 0x1p-150;
  for (size_t n = 0; n < ref.size(); ++n) {
    tol[n] = 4 * compute_eps * mag[n] + (narrower ? eps(dbias_dtype) * std::abs(ref[n]) + half_ulp_min : 0.0) + 1e-300;
  }
  return tol;
}

// Every backend, every dtype, dbias in float32, float64 or the mask's dtype, strided: within
// the derived bound of kReference's; blocked elements exactly 0; dq, dk, dv as without dbias
// (bitwise: the pass only adds an output). Where the CPU has AVX-512, again capped at AVX2.
TEST_P(BiasGrad, EveryBackendAndDtypeMatchesTheReference) {
  const Case& c = GetParam();
  for (bool avx2 : {false, true}) {
    if (avx2 && !avx2_pass_skip_reason().empty()) continue;
    std::optional<Avx2Only> cap;
    if (avx2) cap.emplace();
    for (DType dt : {kF32, kBF16, kF16, kF64}) {
      Built b = build(c, 11);
      const Problem p = make_problem(b.t.converted(dt), b.o, Layout::kContiguous, 13);
      sdpa::Options ref = b.o;
      ref.backend = Backend::kReference;
      const std::vector<double> want = backward_with_bias(p, ref, kF64).dbias.values();
      for (DType out_dt : {kF32, kF64, p.t.mask->dtype()}) {
        const std::vector<double> tol = dbias_tolerance(p, b.o, out_dt, want);
        for (Backend backend : {Backend::kAuto, Backend::kFlash, Backend::kNaive}) {
          SCOPED_TRACE(std::string(avx2 ? "AVX2 " : "") + sdpa::dtype_name(dt) + " dbias " +
                       sdpa::dtype_name(out_dt) + " " + backend_name(backend));
          sdpa::Options o = b.o;
          o.backend = backend;
          const WithBias got = backward_with_bias(p, o, out_dt, Layout::kPermuted);
          ASSERT_TRUE(got.dbias.guards_intact());
          ASSERT_TRUE(got.g.guards_intact());
          const std::vector<double> v = got.dbias.values();
          for (size_t n = 0; n < v.size(); ++n) {
            if (b.t.mask->get(static_cast<int64_t>(n)) == -kInf) {
              EXPECT_EQ(v[n], 0.0) << n;
            } else {
              EXPECT_NEAR(v[n], want[n], tol[n]) << "element " << n;
            }
          }
          EXPECT_TRUE(bitwise_equal(got.g, backward(p, o, Layout::kPermuted)));
          if (avx2 && backend != Backend::kNaive) {
            EXPECT_EQ(dispatched_target(), "AVX2");
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, BiasGrad, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// dbias does not depend on the thread count: each element sums its scores in one fixed order.
TEST(BiasGradient, ThreadCountDoesNotChangeIt) {
  Built b = build(kCases[1], 17);
  const Problem p = make_problem(b.t.converted(kF32), b.o, Layout::kContiguous, 19);
  std::vector<double> first;
  for (int threads : {1, 2, 3, 7}) {
    sdpa::set_num_threads(threads);
    const std::vector<double> v = backward_with_bias(p, b.o, kF32).dbias.values();
    if (first.empty()) first = v;
    EXPECT_EQ(v, first) << threads << " threads";
  }
  sdpa::set_num_threads(0);
}

TEST(BiasGradient, BadArgumentsAreErrorsThatWriteNothing) {
  Built b = build(kCases[0], 23);
  const Problem p = make_problem(b.t.converted(kF32), b.o, Layout::kContiguous, 29);
  const auto expect_error = [&](const Tensors& t, const GuardedTensor& dbias, std::vector<std::string> words) {
    Grads g = empty_grads(t, Layout::kContiguous);
    sdpa::Gradients gr = g.gradients();
    gr.dbias = dbias.view();
    expect_sdpa_error([&] { sdpa::attention_backward(t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), gr, {}); },
                      words);
    EXPECT_TRUE(g.untouched());
    EXPECT_TRUE(dbias.untouched());
  };
  const GuardedTensor ok(kF32, {2, 3, 7, 9});
  Tensors no_mask = p.t.converted(kF32);
  no_mask.mask.reset();
  expect_error(no_mask, ok, {"dbias", "no mask"});
  Tensors bool_mask = p.t.converted(kF32);
  bool_mask.mask = GuardedTensor(sdpa::DType::kBool, {2, 3, 7, 9});
  expect_error(bool_mask, ok, {"dbias", "bool"});
  expect_error(p.t, GuardedTensor(kF32, {1, 3, 7, 9}), {"dbias", "(1, 3, 7, 9)", "(2, 3, 7, 9)", "shape of mask"});
  expect_error(p.t, GuardedTensor(sdpa::DType::kInt32, {2, 3, 7, 9}), {"dbias", "int32", "float32, float64"});
  // A zero stride (a broadcast view) as the output.
  GuardedTensor base(kF32, {2, 3, 7, 9});
  sdpa::TensorView zero = base.view();
  zero.strides[1] = 0;
  Grads g = empty_grads(p.t, Layout::kContiguous);
  sdpa::Gradients gr = g.gradients();
  gr.dbias = zero;
  expect_sdpa_error([&] { sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), gr, {}); },
                    {"dbias", "stride"});
  EXPECT_TRUE(g.untouched());
}

}  // namespace
