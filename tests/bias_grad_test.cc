// The float mask's gradient (Gradients::dbias): central differences of the float64 forward
// (the header's definition, independent of src/), every backend and dtype against kReference at
// a tolerance derived per element, the broadcast shapes (each element sums the scores that read
// it), blocked scores' exact zeros, thread-count invariance, and errors that write nothing. The
// ALiBi slopes' gradient (Gradients::dalibi_slopes, computed in the same pass) the same way,
// and attention_varlen_backward's against each sequence's dense call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
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

// The rounding error of each score's ds computed in the compute type, per unit of its eps:
// ds = p · (z·dp - D) is accurate to about eps times
//   p · (|z| Σ_e |dout_e v_e| + Σ_e |dout_e out_e| + |z·dp - D| · 2 (S + |lse|))
// (S = score_magnitude: the error of the score moves p by p times it; backward_util.cc's rule).
// (B, Hq, Nq, Nk) in C order; 0 for a score of weight 0. dbias and dalibi_slopes sum them.
std::vector<double> ds_magnitudes(const Problem& p, const sdpa::Options& o) {
  const Tensors& t = p.t;
  const Dims d = dims_of(t);
  sdpa::Options r = o;
  r.backend = Backend::kReference;
  const Values w = values(run(t.converted(kF64), r));
  const std::vector<double> keep = o.dropout_p > 0 ? keep_mask(t, o.dropout_p, *o.seed) : std::vector<double>{};
  const double zk = 1 / (1 - o.dropout_p);
  std::vector<double> mag(static_cast<size_t>(d.B * d.Hq * d.Nq * d.Nk), 0.0);
  const ScoreMagnitudes score_magnitude(t, o);
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
          const double s_err = 2 * (score_magnitude(b, h, i, j) + std::abs(w.lse[static_cast<size_t>(row)]));
          mag[static_cast<size_t>(row * d.Nk + j)] = pij * (std::abs(z) * dp_size + D_size + std::abs(z * dp - D) * s_err);
        }
      }
  return mag;
}

// The error bound of sums of ds computed in the compute type, element n summing the scores that
// mags[n] sums (ds_magnitudes, times any exact weights): 4 × that in the compute type's eps, plus
// one unit of the rounding of an output narrower than the compute type (float32 or 16-bit;
// absolute among its subnormals).
std::vector<double> sum_tolerance(const Problem& p, const std::vector<double>& mags, DType out_dtype,
                                  const std::vector<double>& ref) {
  const double compute_eps = eps(compute_dtype(p.t.q.dtype()));
  const bool narrower = eps(out_dtype) > compute_eps;  // float32 or 16-bit output of a wider compute type
  // Below the normal range a dtype's spacing is fixed: half its smallest subnormal.
  const double half_ulp_min = out_dtype == kF16 ? 0x1p-25 : out_dtype == kBF16 ? 0x1p-134 : 0x1p-150;
  std::vector<double> tol(ref.size());
  for (size_t n = 0; n < ref.size(); ++n) {
    tol[n] = 4 * compute_eps * mags[n] + (narrower ? eps(out_dtype) * std::abs(ref[n]) + half_ulp_min : 0.0) + 1e-300;
  }
  return tol;
}

// dbias' bound: each element sums the ds of the scores that read it.
std::vector<double> dbias_tolerance(const Problem& p, const sdpa::Options& o, DType dbias_dtype,
                                    const std::vector<double>& ref) {
  const Dims d = dims_of(p.t);
  const std::vector<double> ds = ds_magnitudes(p, o);
  const std::vector<int64_t>& ms = p.t.mask->shape();
  int64_t full[4] = {1, 1, 1, 1};
  for (size_t n = 0; n < ms.size(); ++n) full[4 - ms.size() + n] = ms[n];
  std::vector<double> mag(ref.size(), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i)
        for (int64_t j = 0; j < d.Nk; ++j) {
          const int64_t idx[4] = {b, h, i, j};
          int64_t flat = 0;
          for (int n = 0; n < 4; ++n) flat = flat * full[n] + (full[n] == 1 ? 0 : idx[n]);
          mag[static_cast<size_t>(flat)] += ds[static_cast<size_t>(((b * d.Hq + h) * d.Nq + i) * d.Nk + j)];
        }
  return sum_tolerance(p, mag, dbias_dtype, ref);
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

// ---- The ALiBi slopes' gradient (Gradients::dalibi_slopes) ----

struct AlibiCase {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  std::vector<int64_t> slopes_shape;  // (Hq,), (1, Hq) or (B, Hq)
  Causal causal = Causal::kNone;
  std::vector<int64_t> seqlens_k = {};
  bool empty_rows = false;  // a bool mask blocking every key of query rows 1 and Nq - 1
  double softcap = 0;
  Order order = Order::kBeforeBias;
  double dropout = 0;
  sdpa::Window window = {};
  bool float_mask = false;  // a float mask (0.85 dense), whose dbias shares the pass
};

const AlibiCase kAlibiCases[] = {
    {"per_head", 2, 4, 2, 6, 9, 5, 4, {4}},
    {"per_batch", 3, 2, 2, 7, 5, 4, 3, {3, 2}, Causal::kBottomRight},  // Nk < Nq: i' < 0 for the first rows
    {"broadcast_row", 2, 3, 1, 5, 8, 3, 4, {1, 3}, Causal::kTopLeft},
    {"seqlens", 3, 2, 1, 4, 9, 4, 4, {3, 2}, Causal::kBottomRight, {9, 2, 0}},  // sequence 2 has no key
    {"empty_rows", 2, 2, 2, 6, 7, 4, 4, {2}, Causal::kNone, {}, true},
    {"cap_before", 1, 2, 1, 5, 8, 4, 4, {1, 2}, Causal::kNone, {}, false, 1.5, Order::kBeforeBias},
    {"cap_after", 2, 2, 1, 5, 8, 4, 4, {2, 2}, Causal::kNone, {}, false, 1.5, Order::kAfterBias},
    {"dropout", 2, 2, 2, 7, 10, 4, 4, {2}, Causal::kNone, {}, false, 0, Order::kBeforeBias, 0.3},
    {"window", 1, 3, 3, 8, 8, 4, 2, {3}, Causal::kNone, {}, false, 0, Order::kBeforeBias, 0, {2, 1}},
    {"float_mask", 2, 4, 2, 6, 9, 3, 3, {2, 4}, Causal::kBottomRight, {}, false, 0, Order::kBeforeBias, 0, {}, true},
    {"dk0", 2, 2, 2, 3, 5, 0, 2, {2}},
};

void PrintTo(const AlibiCase& c, std::ostream* os) { *os << c.name; }

struct AlibiBuilt {
  Tensors t;
  sdpa::Options o;
  GuardedTensor slopes;
};

// The case's float64 tensors, its slopes (distinct per row and head, one negative) and options.
AlibiBuilt build_alibi(const AlibiCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::optional<GuardedTensor> mask;
  if (c.float_mask) {
    mask = GuardedTensor(kF64, {c.B, c.Hq, c.Nq, c.Nk});
    fill_mask(*mask, rng, 0.85, 0.0);
  } else if (c.empty_rows) {
    mask = GuardedTensor(sdpa::DType::kBool, {c.B, c.Hq, c.Nq, c.Nk});
    fill_mask(*mask, rng, 0.8, 0.0);
    for (int64_t r = 0; r < c.B * c.Hq; ++r)
      for (int64_t i : {int64_t{1}, c.Nq - 1})
        for (int64_t j = 0; j < c.Nk; ++j) mask->set((r * c.Nq + i) * c.Nk + j, 0);
  }
  AlibiBuilt b{{GuardedTensor(kF64, {c.B, c.Hq, c.Nq, c.Dk}), GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.Dk}),
                GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.Dv}), std::move(mask), c.seqlens_k},
               {},
               GuardedTensor(kF64, c.slopes_shape)};
  fill_normal(b.t.q, rng, 1.2);
  fill_normal(b.t.k, rng, 1.2);
  fill_normal(b.t.v, rng);
  const int64_t rows = c.slopes_shape.size() == 2 ? c.slopes_shape[0] : 1;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < c.Hq; ++h) {
      const double slope = std::exp2(-1.0 - static_cast<double>(h)) * (1 + 0.4 * static_cast<double>(r));
      b.slopes.set(r * c.Hq + h, h == c.Hq - 1 && c.Hq > 1 ? -0.3 * slope : slope);
    }
  b.o.alibi_slopes = b.slopes.view();
  b.o.causal = c.causal;
  b.o.window = c.window;
  b.o.softcap = c.softcap;
  b.o.softcap_order = c.order;
  if (c.dropout > 0) {
    b.o.dropout_p = c.dropout;
    b.o.seed = 91;
  }
  return b;
}

struct WithAlibi {
  Grads g;
  GuardedTensor dalibi;
};

// attention_backward with dalibi_slopes of dtype dt (the slopes' shape) in `layout`; dbias too
// when `dbias` is given.
WithAlibi backward_with_alibi(const Problem& p, const sdpa::Options& o, DType dt, Layout layout = Layout::kContiguous,
                              GuardedTensor* dbias = nullptr) {
  const sdpa::TensorView& s = *o.alibi_slopes;
  WithAlibi r{empty_grads(p.t, layout), GuardedTensor(dt, std::vector<int64_t>(s.shape, s.shape + s.rank), layout)};
  sdpa::Gradients g = r.g.gradients();
  g.dalibi_slopes = r.dalibi.view();
  if (dbias) g.dbias = dbias->view();
  sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), g, o);
  return r;
}

class AlibiGrad : public testing::TestWithParam<AlibiCase> {};

// kReference's and kAuto's float64 dalibi_slopes against central differences of the float64
// forward (loss = Σ out · dout), one slope moved at a time: a slope of (Hq,) or (1, Hq) slopes
// moves every batch's scores of its head, so the difference sums them as the header says.
TEST_P(AlibiGrad, MatchesFiniteDifferencesInFloat64) {
  const AlibiCase& c = GetParam();
  AlibiBuilt b = build_alibi(c, 5);
  const Problem p = make_problem(b.t.converted(kF64), b.o, Layout::kContiguous, 7);
  std::vector<double> got[2];
  for (int n = 0; n < 2; ++n) {
    sdpa::Options o = b.o;
    o.backend = n == 0 ? Backend::kReference : Backend::kAuto;
    const WithAlibi r = backward_with_alibi(p, o, kF64, Layout::kPadded);
    ASSERT_TRUE(r.dalibi.guards_intact());
    got[n] = r.dalibi.values();
  }
  bool moved = false;  // some slope has a gradient: the case tests something
  for (int64_t m = 0; m < b.slopes.numel(); ++m) {
    const double x0 = b.slopes.get(m);
    const auto loss = [&](double x) {
      b.slopes.set(m, x);
      sdpa::Options r = b.o;
      r.backend = Backend::kReference;
      const Values v = values(run(b.t, r, Layout::kContiguous, /*with_extras=*/false));
      double l = 0;
      for (size_t n = 0; n < v.out.size(); ++n) l += v.out[n] * p.dout.get(static_cast<int64_t>(n));
      return l;
    };
    const double h = 1e-6;
    const double numeric = (loss(x0 + h) - loss(x0 - h)) / (2 * h);
    b.slopes.set(m, x0);
    moved = moved || std::abs(numeric) > 1e-3;
    // Central differences: truncation O(h²) and rounding O(eps · loss / h) ≈ 1e-10 here.
    const size_t at = static_cast<size_t>(m);
    EXPECT_NEAR(got[0][at], numeric, 1e-7 * std::max(1.0, std::abs(numeric))) << "kReference, slope " << m;
    EXPECT_NEAR(got[1][at], numeric, 1e-7 * std::max(1.0, std::abs(numeric))) << "kAuto, slope " << m;
  }
  EXPECT_EQ(moved, c.Dv > 0 && c.Nk > 0) << "the slopes move the loss unless it reads no score";
}

// dalibi's bound: slope (s, h) sums -ds · |i' - j| over the batches that read it, the distance
// exact, so its error is the sum of ds_magnitudes · |i' - j|.
std::vector<double> alibi_tolerance(const Problem& p, const sdpa::Options& o, DType dt, const std::vector<double>& ref) {
  const Dims d = dims_of(p.t);
  const std::vector<double> ds = ds_magnitudes(p, o);
  const int64_t rows = o.alibi_slopes->rank == 2 ? o.alibi_slopes->shape[0] : 1;
  std::vector<double> mag(ref.size(), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i)
        for (int64_t j = 0; j < d.Nk; ++j) {
          const int64_t L = p.t.seqlens_k.empty() ? d.Nk : p.t.seqlens_k[static_cast<size_t>(b)];
          const double distance = std::abs(static_cast<double>(i + L - d.Nq - j));
          mag[static_cast<size_t>((rows == 1 ? 0 : b) * d.Hq + h)] +=
              ds[static_cast<size_t>(((b * d.Hq + h) * d.Nq + i) * d.Nk + j)] * distance;
        }
  return sum_tolerance(p, mag, dt, ref);
}

// Every backend and dtype, dalibi in float32 or float64, strided: within the derived bound of
// kReference's; dq, dk, dv bitwise as without dalibi (the pass only adds an output). Where the
// CPU has AVX-512, again capped at AVX2.
TEST_P(AlibiGrad, EveryBackendAndDtypeMatchesTheReference) {
  const AlibiCase& c = GetParam();
  for (bool avx2 : {false, true}) {
    if (avx2 && !avx2_pass_skip_reason().empty()) continue;
    std::optional<Avx2Only> cap;
    if (avx2) cap.emplace();
    for (DType dt : {kF32, kBF16, kF16, kF64}) {
      AlibiBuilt b = build_alibi(c, 11);
      const Problem p = make_problem(b.t.converted(dt), b.o, Layout::kContiguous, 13);
      sdpa::Options ref = b.o;
      ref.backend = Backend::kReference;
      const std::vector<double> want = backward_with_alibi(p, ref, kF64).dalibi.values();
      for (DType out_dt : {kF32, kF64}) {
        const std::vector<double> tol = alibi_tolerance(p, b.o, out_dt, want);
        for (Backend backend : {Backend::kAuto, Backend::kFlash, Backend::kNaive}) {
          SCOPED_TRACE(std::string(avx2 ? "AVX2 " : "") + sdpa::dtype_name(dt) + " dalibi " +
                       sdpa::dtype_name(out_dt) + " " + backend_name(backend));
          sdpa::Options o = b.o;
          o.backend = backend;
          const WithAlibi got = backward_with_alibi(p, o, out_dt, Layout::kPermuted);
          ASSERT_TRUE(got.dalibi.guards_intact());
          ASSERT_TRUE(got.g.guards_intact());
          const std::vector<double> v = got.dalibi.values();
          for (size_t n = 0; n < v.size(); ++n) EXPECT_NEAR(v[n], want[n], tol[n]) << "slope " << n;
          EXPECT_TRUE(bitwise_equal(got.g, backward(p, o, Layout::kPermuted)));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AlibiGrad, testing::ValuesIn(kAlibiCases),
                         [](const testing::TestParamInfo<AlibiCase>& info) { return std::string(info.param.name); });

// dalibi_slopes does not depend on the thread count, nor on whether dbias shares its pass (which
// changes the pass's units: the mask's rows instead of the scores'), on either kind of pass.
TEST(AlibiGradient, ThreadCountAndDbiasDoNotChangeIt) {
  const AlibiCase& c = kAlibiCases[9];  // float_mask
  AlibiBuilt b = build_alibi(c, 17);
  const Problem p = make_problem(b.t.converted(kF32), b.o, Layout::kContiguous, 19);
  for (Backend backend : {Backend::kAuto, Backend::kNaive, Backend::kReference}) {
    SCOPED_TRACE(backend_name(backend));
    sdpa::Options o = b.o;
    o.backend = backend;
    std::vector<double> first;
    for (int threads : {1, 2, 3, 7}) {
      sdpa::set_num_threads(threads);
      for (bool with_dbias : {false, true}) {
        GuardedTensor dbias(kF32, p.t.mask->shape());
        const std::vector<double> v =
            backward_with_alibi(p, o, kF32, Layout::kContiguous, with_dbias ? &dbias : nullptr).dalibi.values();
        if (first.empty()) first = v;
        EXPECT_EQ(v, first) << threads << " threads" << (with_dbias ? ", with dbias" : "");
        if (with_dbias) {  // and dbias is the one computed without dalibi
          GuardedTensor alone(kF32, p.t.mask->shape());
          const Grads grads = empty_grads(p.t, Layout::kContiguous);
          sdpa::Gradients g = grads.gradients();
          g.dbias = alone.view();
          sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), g, o);
          EXPECT_EQ(dbias.values(), alone.values()) << threads << " threads";
        }
      }
    }
  }
  sdpa::set_num_threads(0);
}

// attention_varlen_backward: (B, Hq) slopes give sequence b's row the dense call's dalibi of its
// rows bit for bit; (Hq,) and (1, Hq) the sum of the sequences' in order.
TEST(AlibiGradient, VarlenIsEachSequencesDenseCall) {
  const int64_t Hq = 6, Hkv = 2, D = 5;
  const std::vector<int64_t> nq = {3, 0, 6, 2}, nk = {5, 4, 6, 0};
  const int64_t B = static_cast<int64_t>(nq.size());
  std::vector<int64_t> cu_q = {0}, cu_k = {0};
  for (int64_t b = 0; b < B; ++b) cu_q.push_back(cu_q.back() + nq[b]), cu_k.push_back(cu_k.back() + nk[b]);
  const int64_t tq = cu_q.back(), tk = cu_k.back();
  std::mt19937 rng(31);
  GuardedTensor q(kF32, {tq, Hq, D}), k(kF32, {tk, Hkv, D}), v(kF32, {tk, Hkv, D}), dout(kF32, {tq, Hq, D});
  for (GuardedTensor* t : {&q, &k, &v, &dout}) fill_normal(*t, rng);
  const sdpa::VarlenInputs in{q.view(), k.view(), v.view(),
                              sdpa::TensorView::contiguous(cu_q.data(), sdpa::DType::kInt64, {B + 1}),
                              sdpa::TensorView::contiguous(cu_k.data(), sdpa::DType::kInt64, {B + 1})};
  // Rows [r0, r1) of a packed (total, H, D) tensor as a (H, r1 - r0, D) view; columns of lse.
  const auto rows = [](const GuardedTensor& t, int64_t r0, int64_t r1) {
    sdpa::TensorView s = t.view();
    s.shape[0] = s.shape[1], s.shape[1] = r1 - r0;
    std::swap(s.strides[0], s.strides[1]);
    s.data = static_cast<float*>(s.data) + r0 * s.strides[1];
    return s;
  };
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{B, Hq}, {1, Hq}, {Hq}}) {
    SCOPED_TRACE(GuardedTensor(kF32, shape).view().shape_string());
    GuardedTensor slopes(kF32, shape);
    fill_uniform(slopes, rng, -0.2, 0.8);
    sdpa::Options o;
    o.causal = Causal::kBottomRight;
    o.alibi_slopes = slopes.view();
    GuardedTensor out(kF32, {tq, Hq, D}), lse(kF32, {Hq, tq});
    sdpa::attention_varlen(in, {out.view(), lse.view()}, o);
    GuardedTensor dq(kF32, {tq, Hq, D}), dk(kF32, {tk, Hkv, D}), dv(kF32, {tk, Hkv, D}), dalibi(kF64, shape);
    sdpa::Gradients g{dq.view(), dk.view(), dv.view()};
    g.dalibi_slopes = dalibi.view();
    sdpa::attention_varlen_backward(in, out.view(), lse.view(), dout.view(), g, o);
    ASSERT_TRUE(dalibi.guards_intact());
    std::vector<double> sum(static_cast<size_t>(Hq), 0.0);
    for (int64_t b = 0; b < B; ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const bool per_sequence = shape.size() == 2 && shape[0] == B;
      const int64_t row = per_sequence ? b : 0;
      std::vector<double> s(static_cast<size_t>(Hq));
      for (int64_t h = 0; h < Hq; ++h) s[static_cast<size_t>(h)] = slopes.get(row * Hq + h);
      GuardedTensor seq_slopes = tensor(kF32, {Hq}, s);
      sdpa::Options so = o;
      so.alibi_slopes = seq_slopes.view();
      sdpa::TensorView l = lse.view();
      l.shape[1] = nq[b];
      l.data = static_cast<float*>(l.data) + cu_q[b] * l.strides[1];
      Grads dense{GuardedTensor(kF32, {Hq, nq[b], D}), GuardedTensor(kF32, {Hkv, nk[b], D}),
                  GuardedTensor(kF32, {Hkv, nk[b], D})};
      GuardedTensor want(kF64, {Hq});
      sdpa::Gradients dg = dense.gradients();
      dg.dalibi_slopes = want.view();
      sdpa::Inputs din;
      din.q = rows(q, cu_q[b], cu_q[b + 1]);
      din.k = rows(k, cu_k[b], cu_k[b + 1]);
      din.v = rows(v, cu_k[b], cu_k[b + 1]);
      sdpa::attention_backward(din, rows(out, cu_q[b], cu_q[b + 1]), l, rows(dout, cu_q[b], cu_q[b + 1]), dg, so);
      for (int64_t h = 0; h < Hq; ++h) {
        if (per_sequence) {
          EXPECT_EQ(dalibi.get(b * Hq + h), want.get(h)) << "head " << h;
        }
        sum[static_cast<size_t>(h)] += want.get(h);
      }
    }
    if (shape.size() == 1 || shape[0] == 1) {
      EXPECT_EQ(dalibi.values(), sum) << "the sequences' sum";
    }
  }
}

TEST(AlibiGradient, BadArgumentsAreErrorsThatWriteNothing) {
  AlibiBuilt b = build_alibi(kAlibiCases[1], 23);  // slopes (3, 2)
  const Problem p = make_problem(b.t.converted(kF32), b.o, Layout::kContiguous, 29);
  const auto expect_error = [&](const sdpa::Options& o, const sdpa::TensorView& dalibi, const GuardedTensor& owner,
                                std::vector<std::string> words) {
    Grads g = empty_grads(p.t, Layout::kContiguous);
    sdpa::Gradients gr = g.gradients();
    gr.dalibi_slopes = dalibi;
    expect_sdpa_error([&] { sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), gr, o); },
                      words);
    EXPECT_TRUE(g.untouched());
    EXPECT_TRUE(owner.untouched());
  };
  sdpa::Options no_slopes = b.o;
  no_slopes.alibi_slopes.reset();
  const GuardedTensor ok(kF32, {3, 2});
  expect_error(no_slopes, ok.view(), ok, {"dalibi_slopes", "alibi_slopes is not"});
  const GuardedTensor per_head(kF32, {2});
  expect_error(b.o, per_head.view(), per_head, {"dalibi_slopes", "(2,)", "(3, 2)", "shape of alibi_slopes"});
  const GuardedTensor f16(kF16, {3, 2});
  expect_error(b.o, f16.view(), f16, {"dalibi_slopes", "float16", "float32 or float64"});
  GuardedTensor base(kF32, {3, 2});
  sdpa::TensorView zero = base.view();
  zero.strides[0] = 0;
  expect_error(b.o, zero, base, {"dalibi_slopes", "stride 0"});
}

}  // namespace
