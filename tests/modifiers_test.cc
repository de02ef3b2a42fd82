// Score modifiers (Options::softcap, softcap_order, alibi_slopes, sinks): hand-made cases
// written from the header's formulas, the promises at the edges (a blocked key stays blocked
// under the cap, a sink on a row with no key), gradients against central differences of the
// float64 forward, a sweep of forward and backward against kReference (and kReference against
// the independent oracle) on every SIMD path and dtype, thread-count invariance, and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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

constexpr Backend kBackends[] = {Backend::kAuto, Backend::kFlash, Backend::kNaive, Backend::kReference};

// The modifiers of one call: the tensors behind Options' views, kept alive beside them.
struct Mods {
  double softcap = 0;
  Order order = Order::kBeforeBias;
  std::optional<GuardedTensor> slopes, sinks;
  sdpa::Options apply(sdpa::Options o) const {
    o.softcap = softcap;
    o.softcap_order = order;
    if (slopes) o.alibi_slopes = slopes->view();
    if (sinks) o.sinks = sinks->view();
    return o;
  }
};

// The kinds the sweep combines: each modifier alone, and all of them together.
enum class ModKind { kSoftcap, kSoftcapAfterBias, kAlibi, kAlibiPerBatch, kSinks, kAll };
const char* kind_name(ModKind k) {
  switch (k) {
    case ModKind::kSoftcap: return "softcap";
    case ModKind::kSoftcapAfterBias: return "softcap_after_bias";
    case ModKind::kAlibi: return "alibi";
    case ModKind::kAlibiPerBatch: return "alibi_per_batch";
    case ModKind::kSinks: return "sinks";
    case ModKind::kAll: return "all";
  }
  return "?";
}

// Slopes as BLOOM's geometric series 2^(-8(h+1)/H) (per batch: scaled by b + 1), sinks normal
// around 1 (so that they matter against the scores' max), a cap that bites (scores ~ N(0, 1)
// scaled: 1.5). Slopes and sinks strided (every other element of a float64 buffer) or float32.
Mods make_mods(ModKind kind, int64_t B, int64_t Hq, uint32_t seed) {
  Mods m;
  std::mt19937 rng(seed);
  const bool cap = kind == ModKind::kSoftcap || kind == ModKind::kSoftcapAfterBias || kind == ModKind::kAll;
  if (cap) m.softcap = 1.5;
  if (kind == ModKind::kSoftcapAfterBias) m.order = Order::kAfterBias;
  if (kind == ModKind::kAlibi || kind == ModKind::kAlibiPerBatch || kind == ModKind::kAll) {
    const bool per_batch = kind == ModKind::kAlibiPerBatch;
    std::vector<double> slopes;
    for (int64_t b = 0; b < (per_batch ? B : 1); ++b)
      for (int64_t h = 0; h < Hq; ++h) slopes.push_back((b + 1) * std::exp2(-8.0 * (h + 1) / static_cast<double>(Hq)));
    m.slopes = per_batch ? tensor(kF64, {B, Hq}, slopes, Layout::kPadded) : tensor(kF32, {Hq}, slopes);
  }
  if (kind == ModKind::kSinks || kind == ModKind::kAll) {
    std::normal_distribution<double> normal(1.0, 1.0);
    std::vector<double> sinks;
    for (int64_t h = 0; h < Hq; ++h) sinks.push_back(normal(rng));
    m.sinks = tensor(kind == ModKind::kAll ? kF32 : kF64, {Hq}, sinks, Layout::kPadded);
  }
  return m;
}

// ---- By hand ----

// One query, three keys, scores (after scale) x = {2, 0, -3}: the header's formulas evaluated
// here in double, against every backend.
TEST(Modifiers, ToyRowByHand) {
  const Tensors t{tensor(kF64, {1, 1}, {1.0}), tensor(kF64, {3, 1}, {2.0, 0.0, -3.0}),
                  tensor(kF64, {3, 2}, {1, 0, 0, 1, 1, 1}), std::nullopt};
  Mods m;
  m.softcap = 2.0;
  m.slopes = tensor(kF64, {1}, {0.5});
  m.sinks = tensor(kF64, {1}, {0.25});
  sdpa::Options o = m.apply({});
  o.scale = 1.0;
  // i' = 0 + (3 - 1) = 2: distances {2, 1, 0}.
  const double x[3] = {2.0, 0.0, -3.0}, dist[3] = {2, 1, 0};
  for (Order order : {Order::kBeforeBias, Order::kAfterBias}) {
    o.softcap_order = order;
    double s[3], sum = std::exp(0.25);
    for (int j = 0; j < 3; ++j) {
      s[j] = order == Order::kBeforeBias ? 2.0 * std::tanh(x[j] / 2.0) - 0.5 * dist[j]
                                         : 2.0 * std::tanh((x[j] - 0.5 * dist[j]) / 2.0);
      sum += std::exp(s[j]);
    }
    const double w[3] = {std::exp(s[0]) / sum, std::exp(s[1]) / sum, std::exp(s[2]) / sum};
    const std::vector<double> out = {w[0] + w[2], w[1] + w[2]};
    for (Backend backend : kBackends) {
      SCOPED_TRACE(backend_name(backend));
      o.backend = backend;
      const Values got = values(run(t, o));
      EXPECT_TRUE(all_close("weights", got.weights, {w[0], w[1], w[2]}, 1e-14));
      EXPECT_TRUE(all_close("out", got.out, out, 1e-14));
      EXPECT_TRUE(all_close("lse", got.lse, {std::log(sum)}, 1e-14));
    }
  }
}

// A key that a bool mask, a -inf bias, causal or the window blocks keeps weight exactly 0 under
// the cap in either order (never cap·tanh(-inf) = -cap), on every backend and dtype.
TEST(Modifiers, SoftcapKeepsBlockedKeysBlocked) {
  std::mt19937 rng(5);
  for (DType dt : {kF32, kF64, kBF16, kF16}) {
    for (bool bool_mask : {true, false}) {
      Tensors t{GuardedTensor(kF32, {2, 3, 19, 8}), GuardedTensor(kF32, {2, 3, 37, 8}),
                GuardedTensor(kF32, {2, 3, 37, 8}), GuardedTensor(bool_mask ? DType::kBool : kF32, {2, 3, 19, 37})};
      fill_normal(t.q, rng, 3.0);
      fill_normal(t.k, rng, 3.0);
      fill_normal(t.v, rng);
      fill_mask(*t.mask, rng, 0.5, 0.2);
      t = t.converted(dt);
      for (Order order : {Order::kBeforeBias, Order::kAfterBias}) {
        sdpa::Options o;
        o.softcap = 0.75;
        o.softcap_order = order;
        o.causal = Causal::kTopLeft;
        o.window = {20, -1};
        for (Backend backend : kBackends) {
          SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + (bool_mask ? " bool " : " float ") +
                       (order == Order::kAfterBias ? "after " : "before ") + backend_name(backend));
          o.backend = backend;
          const Outs got = run(t, o);
          EXPECT_TRUE(blocked_are_exact(t, o, got));
          if (backend != Backend::kReference) {
            EXPECT_TRUE(matches_reference(t, o, got));
          }
        }
      }
    }
  }
}

// A NaN score (a NaN in q) stays NaN through the cap in either order (the vector tanh's clamp
// must not turn it into ±cap), so its row is NaN on every backend; the other rows are finite.
TEST(Modifiers, NanScoresStayNanUnderTheCap) {
  std::mt19937 rng(13);
  for (DType dt : {kF32, kF64}) {
    Tensors t{GuardedTensor(dt, {1, 2, 40, 16}), GuardedTensor(dt, {1, 2, 50, 16}), GuardedTensor(dt, {1, 2, 50, 16}),
              std::nullopt};
    fill_normal(t.q, rng);
    fill_normal(t.k, rng);
    fill_normal(t.v, rng);
    t.q.set(5 * 16 + 3, std::nan(""));  // head 0, row 5
    for (Order order : {Order::kBeforeBias, Order::kAfterBias}) {
      sdpa::Options o;
      o.softcap = 2.0;
      o.softcap_order = order;
      for (Backend backend : kBackends) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " " + backend_name(backend));
        o.backend = backend;
        const Outs got = run(t, o);
        EXPECT_TRUE(std::isnan(got.lse->at(0, 0, 0, 5)));
        for (int64_t x = 0; x < 16; ++x) EXPECT_TRUE(std::isnan(got.out.at(0, 0, 5, x)));
        for (int64_t i = 0; i < 40; ++i) EXPECT_TRUE(std::isfinite(got.lse->at(0, 0, 1, i)));
      }
    }
  }
}

// The header's rule at float32's edge (fuzz finding F17): under kAfterBias an argument
// x + bias that is -inf in the compute type blocks the key like a -inf bias (the float32 kernels
// cannot tell the two apart, and kReference rounds the sum to float32's range as they do);
// kBeforeBias caps x first, so the key keeps weight 1. q = [3e38], k = [-1], bias -1e38.
TEST(Modifiers, AnArgumentPastTheRangeUnderTheCapAfterTheBiasBlocks) {
  for (DType dt : {kF32, kF64}) {
    const Tensors t{tensor(dt, {1, 1}, {3e38}), tensor(dt, {1, 1}, {-1.0}), tensor(dt, {1, 2}, {1.0, 2.0}),
                    tensor(dt, {1, 1}, {-1e38})};
    for (Order order : {Order::kBeforeBias, Order::kAfterBias}) {
      sdpa::Options o;
      o.scale = 1.0;
      o.softcap = 50.0;
      o.softcap_order = order;
      // float64 holds -4e38: only float32 blocks the key, and only after the bias.
      const bool blocked = dt == kF32 && order == Order::kAfterBias;
      const double lse = order == Order::kAfterBias ? -50.0 : -1e38 + 50.0 * std::tanh(-3e38 / 50.0);
      for (Backend backend : kBackends) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + (order == Order::kAfterBias ? " after " : " before ") +
                     backend_name(backend));
        o.backend = backend;
        const Values got = values(run(t, o));
        EXPECT_EQ(got.weights, std::vector<double>{blocked ? 0.0 : 1.0});
        EXPECT_EQ(got.out, (blocked ? std::vector<double>{0, 0} : std::vector<double>{1, 2}));
        ASSERT_EQ(got.lse.size(), 1u);
        if (blocked) {
          EXPECT_EQ(got.lse[0], -kInf);
        } else {
          EXPECT_NEAR(got.lse[0], lse, std::abs(lse) * 1e-6);
        }
      }
    }
  }
}

// A sink on rows whose keys are all blocked: out = 0, weights 0, lse = the sink; and where keys
// exist, the weights sum to 1 - exp(sink - lse).
TEST(Modifiers, SinkRowsWithoutKeysAndWeightSums) {
  std::mt19937 rng(9);
  Tensors t{GuardedTensor(kF32, {1, 2, 12, 16}), GuardedTensor(kF32, {1, 2, 20, 16}),
            GuardedTensor(kF32, {1, 2, 20, 16}), GuardedTensor(DType::kBool, {12, 20})};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  fill_mask(*t.mask, rng, 0.6, 0.0);
  for (int64_t j = 0; j < 20; ++j) t.mask->set(3 * 20 + j, 0.0);  // row 3 fully blocked
  const std::vector<double> sink_values = {0.5, -2.0};
  Mods m;
  m.sinks = tensor(kF32, {2}, sink_values);
  for (DType dt : {kF32, kF64, kBF16, kF16}) {
    const Tensors tc = t.converted(dt);
    for (Backend backend : kBackends) {
      SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " " + backend_name(backend));
      sdpa::Options o = m.apply({});
      o.backend = backend;
      const Outs got = run(tc, o);
      for (int64_t h = 0; h < 2; ++h) {
        EXPECT_EQ(got.lse->at(0, 0, h, 3), static_cast<float>(sink_values[h]));
        for (int64_t x = 0; x < 16; ++x) EXPECT_EQ(got.out.at(0, h, 3, x), 0.0);
        for (int64_t i = 0; i < 12; ++i) {
          double sum = 0;
          for (int64_t j = 0; j < 20; ++j) sum += got.weights->at(0, h, i, j);
          const double want = 1 - std::exp(sink_values[h] - got.lse->at(0, 0, h, i));
          EXPECT_NEAR(sum, want, 64 * eps(compute_dtype(dt))) << "h " << h << " i " << i;
        }
      }
      EXPECT_TRUE(blocked_are_exact(tc, o, got));
      if (backend != Backend::kReference) {
        EXPECT_TRUE(matches_reference(tc, o, got));
      }
    }
  }
}

// ALiBi aligns bottom-right whatever `causal` is, and to each sequence's own length under
// seqlens_k: the bias of query i and key j is -slope · |i + (L - Nq) - j|.
TEST(Modifiers, AlibiAlignsBottomRightToTheSequenceLength) {
  // q·k = 0 everywhere: the weights are softmax(-slope · distance) alone.
  const int64_t Nq = 2, Nk = 5;
  Tensors t{GuardedTensor(kF64, {2, 1, Nq, 4}), GuardedTensor(kF64, {2, 1, Nk, 4}), GuardedTensor(kF64, {2, 1, Nk, 4}),
            std::nullopt};
  t.q.set_values(std::vector<double>(2 * Nq * 4, 0.0));
  t.k.set_values(std::vector<double>(2 * Nk * 4, 1.0));
  t.v.set_values(std::vector<double>(2 * Nk * 4, 1.0));
  t.seqlens_k = {5, 3};
  Mods m;
  m.slopes = tensor(kF64, {1}, {std::log(2.0)});  // weight ∝ 2^-distance
  for (Causal causal : {Causal::kNone, Causal::kTopLeft}) {
    sdpa::Options o = m.apply({});
    o.causal = causal;
    o.backend = Backend::kAuto;
    const Outs got = run(t, o);
    for (int64_t b = 0; b < 2; ++b) {
      const int64_t L = t.seqlens_k[b];
      for (int64_t i = 0; i < Nq; ++i) {
        double w[Nk] = {}, sum = 0;
        for (int64_t j = 0; j < L; ++j) {
          if (causal == Causal::kTopLeft && j > i) continue;
          w[j] = std::exp2(-std::abs(static_cast<double>(i + L - Nq - j)));
          sum += w[j];
        }
        for (int64_t j = 0; j < Nk; ++j) EXPECT_NEAR(got.weights->at(b, 0, i, j), w[j] / sum, 1e-15) << b << i << j;
      }
    }
  }
}

// ---- Gradients against central differences of the float64 forward ----

// loss = Σ out · dout. Its derivative along one input element, by central differences of
// kReference's forward in float64 (step h relative to the element).
double numeric_derivative(const Tensors& t, const sdpa::Options& o, const GuardedTensor& dout, GuardedTensor* x,
                          int64_t flat, GuardedTensor* sinks, int64_t sink) {
  const auto loss = [&]() {
    sdpa::Options r = o;
    r.backend = Backend::kReference;
    if (sinks) r.sinks = sinks->view();
    const Values v = values(run(t, r, Layout::kContiguous, /*with_extras=*/false));
    double l = 0;
    for (size_t n = 0; n < v.out.size(); ++n) l += v.out[n] * dout.get(static_cast<int64_t>(n));
    return l;
  };
  GuardedTensor& target = x ? *x : *sinks;
  const int64_t at = x ? flat : sink;
  const double x0 = target.get(at), h = 1e-6 * std::max(1.0, std::abs(x0));
  target.set(at, x0 + h);
  const double up = loss();
  target.set(at, x0 - h);
  const double down = loss();
  target.set(at, x0);
  return (up - down) / (2 * h);
}

TEST(Modifiers, GradientsMatchFiniteDifferences) {
  std::mt19937 rng(21);
  for (ModKind kind : {ModKind::kSoftcap, ModKind::kSoftcapAfterBias, ModKind::kAll}) {
    SCOPED_TRACE(kind_name(kind));
    Tensors t{GuardedTensor(kF64, {1, 4, 7, 5}), GuardedTensor(kF64, {1, 2, 9, 5}), GuardedTensor(kF64, {1, 2, 9, 3}),
              GuardedTensor(kF64, {7, 9})};
    fill_normal(t.q, rng, 1.5);
    fill_normal(t.k, rng, 1.5);
    fill_normal(t.v, rng);
    fill_mask(*t.mask, rng, 0.8, 0.0);
    Mods m = make_mods(kind, 1, 4, 3);
    if (!m.sinks) m.sinks = tensor(kF64, {4}, {0.3, -0.2, 1.1, 0.0});  // dsinks in every case
    sdpa::Options o = m.apply({});
    o.causal = Causal::kBottomRight;
    GuardedTensor sinks_copy = m.sinks ? m.sinks->converted(kF64, Layout::kContiguous) : tensor(kF64, {1}, {0.0});
    const Problem p = make_problem(t.converted(kF64), o, Layout::kContiguous, 4);
    for (Backend backend : {Backend::kReference, Backend::kAuto}) {
      SCOPED_TRACE(backend_name(backend));
      o.backend = backend;
      Grads g = empty_grads(p.t, Layout::kContiguous);
      GuardedTensor dsinks(kF64, {4});
      sdpa::Gradients grads = g.gradients();
      grads.dsinks = dsinks.view();
      sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), grads, o);
      Tensors probe = p.t.converted(kF64);
      GuardedTensor* inputs[3] = {&probe.q, &probe.k, &probe.v};
      const GuardedTensor* grad[3] = {&g.dq, &g.dk, &g.dv};
      for (int w = 0; w < 3; ++w) {
        for (int64_t n = 0; n < inputs[w]->numel(); n += 3) {
          const double want = numeric_derivative(probe, o, p.dout, inputs[w], n, nullptr, 0);
          EXPECT_NEAR(grad[w]->get(n), want, 1e-7 * (1 + std::abs(want))) << kGradNames[w] << "[" << n << "]";
        }
      }
      for (int64_t h = 0; h < 4; ++h) {
        const double want = numeric_derivative(probe, o, p.dout, nullptr, 0, &sinks_copy, h);
        EXPECT_NEAR(dsinks.get(h), want, 1e-7 * (1 + std::abs(want))) << "dsinks[" << h << "]";
      }
    }
  }
}

// ---- The sweep: forward and backward against kReference on every path ----

struct ModCase {
  Case c;
  ModKind kind;
  std::vector<int64_t> seqlens_k = {};
};

std::vector<ModCase> mod_cases() {
  std::vector<ModCase> cases;
  const ModKind kinds[] = {ModKind::kSoftcap, ModKind::kSoftcapAfterBias, ModKind::kAlibi,
                           ModKind::kAlibiPerBatch, ModKind::kSinks, ModKind::kAll};
  // A spread of the main sweep's shapes (odd sizes, GQA, masks, both causal alignments, windows,
  // layouts), each with one kind in turn, in every dtype.
  std::vector<Case> eligible;
  for (const Case& c : sweep_cases()) {
    if (c.dtype == kF32 && work(c) <= (int64_t{1} << 22)) eligible.push_back(c);
  }
  size_t next = 0;
  for (size_t n = 0; n < eligible.size(); n += std::max<size_t>(1, eligible.size() / 14)) {
    const Case& c = eligible[n];
    for (DType dt : {kF32, kF64, kBF16, kF16}) {
      ModCase m{c, kinds[next++ % 6]};
      m.c.dtype = dt;
      m.c.name = c.name + "_" + sdpa::dtype_name(dt) + "_" + kind_name(m.kind);
      cases.push_back(m);
    }
  }
  // Decode with split keys and per-sequence lengths, with everything.
  for (DType dt : {kF32, kBF16}) {
    ModCase m;
    m.c = Case{"decode_seqlens", 4, 3, 4, 2, 1, 2100, 64, 64, dt};
    m.c.name = std::string("decode_seqlens_") + sdpa::dtype_name(dt);
    m.kind = ModKind::kAll;
    m.seqlens_k = {2100, 7, 1500};
    cases.push_back(m);
  }
  return cases;
}

void check_case(const ModCase& mc) {
  const Case& c = mc.c;
  Tensors t = make_inputs(c);
  t.seqlens_k = mc.seqlens_k;
  const Mods m = make_mods(mc.kind, c.B, c.Hq, 11);
  sdpa::Options o = m.apply(options(c, Backend::kReference));
  if (c.dtype == kF64) {  // kReference against the independent oracle
    const Values ref = values(run(t, o));
    const Values want = oracle(t, o);
    EXPECT_TRUE(all_close("out", ref.out, want.out, 1e-12 * (1 + max_abs_finite(want.out))));
    EXPECT_TRUE(all_close("weights", ref.weights, want.weights, 1e-12));
    EXPECT_TRUE(all_close("lse", ref.lse, want.lse, 1e-12 * (1 + max_abs_finite(want.lse))));
  }
  o.backend = Backend::kAuto;
  const Outs got = run(t, o, c.layout);
  EXPECT_TRUE(got.guards_intact());
  EXPECT_TRUE(matches_reference(t, o, got));
  EXPECT_TRUE(blocked_are_exact(t, o, got));
  // Backward: dq, dk, dv by the backward's tolerance rule; dsinks within twice kNaive's error.
  const Problem p = make_problem(std::move(t), o, c.layout, 77);
  Expected e;
  ASSERT_TRUE(expected(p, o, e));
  const Grads g = backward(p, o, c.layout);
  EXPECT_TRUE(g.guards_intact());
  EXPECT_TRUE(matches(e, g));
  if (!m.sinks) return;
  std::vector<double> dsinks[3];  // kReference, kNaive, kAuto
  const Backend backends[3] = {Backend::kReference, Backend::kNaive, Backend::kAuto};
  for (int n = 0; n < 3; ++n) {
    sdpa::Options ob = o;
    ob.backend = backends[n];
    Grads scratch = empty_grads(p.t, Layout::kContiguous);
    GuardedTensor ds(kF32, {c.Hq});
    sdpa::Gradients grads = scratch.gradients();
    grads.dsinks = ds.view();
    sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), grads, ob);
    dsinks[n] = ds.values();
  }
  double naive_err = 0;
  for (size_t h = 0; h < dsinks[0].size(); ++h) naive_err = std::max(naive_err, std::abs(dsinks[1][h] - dsinks[0][h]));
  const double floor = 8 * eps(kF32) * (1 + max_abs_finite(dsinks[0]));
  EXPECT_TRUE(all_close("dsinks", dsinks[2], dsinks[0], 2 * naive_err + floor));
}

class ModifierSweep : public testing::TestWithParam<size_t> {};

TEST_P(ModifierSweep, MatchesReferenceOnEveryPath) {
  const ModCase mc = mod_cases()[GetParam()];
  {
    SCOPED_TRACE("best path");
    check_case(mc);
  }
  if (mc.c.dtype == kBF16) {
    SCOPED_TRACE("capped at SIMD (widening)");
    const KernelPathCap cap(sdpa::KernelPath::kSimd);
    check_case(mc);
  }
  if (avx2_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX2");
    const Avx2Only avx2;
    check_case(mc);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ModifierSweep, testing::Range<size_t>(0, mod_cases().size()),
                         [](const testing::TestParamInfo<size_t>& info) { return mod_cases()[info.param].c.name; });

// The same results for any thread count, bit for bit, forward and backward (with dsinks).
TEST(Modifiers, ThreadCountDoesNotChangeResults) {
  Case c{"threads", 4, 2, 4, 2, 150, 300, 40, 24, kF32};
  c.causal = Causal::kBottomRight;
  const Tensors t = make_inputs(c);
  const Mods m = make_mods(ModKind::kAll, c.B, c.Hq, 2);
  const sdpa::Options o = m.apply({});
  const Problem p = make_problem(t.converted(kF32), o, Layout::kContiguous, 8);
  std::vector<double> ds[2];
  std::vector<Outs> outs;
  GradValues grads[2];
  for (int n = 0; n < 2; ++n) {
    sdpa::set_num_threads(n + 1);
    outs.push_back(run(t, o));
    Grads g = empty_grads(p.t, Layout::kContiguous);
    GuardedTensor dsinks(kF32, {c.Hq});
    sdpa::Gradients gr = g.gradients();
    gr.dsinks = dsinks.view();
    sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), gr, o);
    grads[n] = values(g);
    ds[n] = dsinks.values();
  }
  sdpa::set_num_threads(0);
  EXPECT_TRUE(bitwise_equal(outs[0], outs[1]));
  EXPECT_TRUE(bitwise_equal(grads[0], grads[1]));
  EXPECT_EQ(ds[0], ds[1]);
}

// ---- Errors name the argument and write nothing ----

TEST(Modifiers, BadArgumentsAreErrorsNamingThem) {
  Case c{"errors", 4, 2, 3, 3, 5, 6, 4, 4, kF32};
  const Tensors t = make_inputs(c);
  const auto call = [&](const sdpa::Options& o) {
    Outs outs{GuardedTensor(kF32, {2, 3, 5, 4}), std::nullopt, std::nullopt};
    sdpa::attention(t.inputs(), outs.outputs(), o);
  };
  sdpa::Options o;
  for (double cap : {-1.0, std::nan(""), kInf, 1e300}) {
    o.softcap = cap;
    expect_sdpa_error([&] { call(o); }, {"softcap="});
  }
  o.softcap = 0;
  const GuardedTensor wrong = tensor(kF32, {2}, {1, 2}), ok = tensor(kF32, {3}, {1, 2, 3});
  const GuardedTensor per_batch_wrong = tensor(kF32, {3, 3}, std::vector<double>(9, 1.0));
  const GuardedTensor ints(DType::kInt32, {3});
  const GuardedTensor nan_slope = tensor(kF32, {3}, {1, std::nan(""), 3});
  o.alibi_slopes = wrong.view();
  expect_sdpa_error([&] { call(o); }, {"alibi_slopes", "(2,)", "(Hq,) = (3,)", "(B, Hq) = (2, 3)"});
  o.alibi_slopes = per_batch_wrong.view();
  expect_sdpa_error([&] { call(o); }, {"alibi_slopes", "(3, 3)"});
  o.alibi_slopes = ints.view();
  expect_sdpa_error([&] { call(o); }, {"alibi_slopes", "int32", "float32 or float64"});
  o.alibi_slopes = nan_slope.view();
  expect_sdpa_error([&] { call(o); }, {"alibi_slopes[1]", "finite"});
  o.alibi_slopes.reset();
  o.sinks = wrong.view();
  expect_sdpa_error([&] { call(o); }, {"sinks", "(2,)", "(Hq,) = (3,)"});
  o.sinks = nan_slope.view();
  expect_sdpa_error([&] { call(o); }, {"sinks[1]", "finite"});
  // dsinks without sinks, or of the wrong shape.
  const Problem p = make_problem(t.converted(kF32), {}, Layout::kContiguous, 1);
  Grads g = empty_grads(p.t, Layout::kContiguous);
  GuardedTensor dsinks(kF32, {2});
  sdpa::Gradients gr = g.gradients();
  gr.dsinks = dsinks.view();
  expect_sdpa_error([&] { sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), gr, {}); },
                    {"dsinks", "Options::sinks"});
  sdpa::Options with_sinks;
  with_sinks.sinks = ok.view();
  expect_sdpa_error(
      [&] { sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), gr, with_sinks); },
      {"dsinks", "(2,)", "(Hq,)"});
  EXPECT_TRUE(g.untouched());
  EXPECT_TRUE(dsinks.untouched());
}

}  // namespace
