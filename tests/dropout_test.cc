// Dropout (Options::dropout_p and seed, sdpa::dropout_mask):
//   - the fused kernel (kFlash, kAuto) against kReference with the same dropout_p and seed, by
//     test_util's tolerance rule, forward and backward, over a table of shapes;
//   - kReference itself against dropout applied by hand here, from dropout_mask's mask, to
//     kReference's weights without dropout (forward) and to test_util's oracle (backward), so
//     that the comparisons above do not only compare two users of the same dropout code;
//   - the keep/drop decisions every backend applies, forward and backward, read off exactly
//     (one-hot values and incoming gradients) and compared with dropout_mask;
//   - dropout_p = 0 is bitwise no dropout; dropout_p outside [0, 1) is an Error that writes nothing;
//   - dropout_mask: layouts, statistics of the decisions, seeds, and Philox4x32-10 against the
//     published Random123 known answers.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "sdpa/attention.h"
#include "backward_util.h"
#include "test_util.h"
// src/: the generator itself, for its known-answer test only (tests/CMakeLists.txt gives this
// test, and only this one, src/ on its include path). Everything else uses the public API.
#include "dropout.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

sdpa::Options with_dropout(sdpa::Options o, double p, uint64_t seed) {
  o.dropout_p = p;
  o.seed = seed;
  return o;
}

std::vector<int64_t> last(int rank, std::vector<int64_t> full) { return {full.end() - rank, full.end()}; }

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t n = 0; n < a.size(); ++n) {
    if (std::bit_cast<uint64_t>(a[n]) != std::bit_cast<uint64_t>(b[n])) return false;
  }
  return true;
}

// ---- The case table ----

struct DropoutCase {
  Case c;  // shapes, dtype, mask, causal, window, layout; c.name is the test name
  double p = 0;
  uint64_t seed = 0;
};

void PrintTo(const DropoutCase& dc, std::ostream* os) { *os << dc.c.name; }

// Ranks 2/3/4, B = 2, GQA and MQA, Nq != Nk, Dv != Dk, odd sizes (1, 7, 9, 97, 130 keys: more
// than one 128-key tile), bool and additive masks, both causal alignments, windows, padded and
// permuted views, a 140-row prefill, and decode-sized cases (few rows, Nk >= 2048, so the fused
// kernel splits the keys into chunks and merges them). dropout_p from 0.1 to 0.9; seeds with
// and without their high 32 bits (the second half of Philox's key).
std::vector<DropoutCase> dropout_cases() {
  std::vector<DropoutCase> cases;
  for (DType dtype : {kF32, kF64}) {
    auto add = [&](const std::string& name, Case c, double p, uint64_t seed) {
      c.dtype = dtype;
      c.name = (dtype == kF32 ? "f32_" : "f64_") + name;
      cases.push_back({c, p, seed});
    };
    add("r2_q7_k9", {.rank = 2, .Nq = 7, .Nk = 9, .Dk = 8, .Dv = 8}, 0.3, 1);
    add("r3_h2_q3_k1_d3_v5", {.rank = 3, .Hq = 2, .Hkv = 2, .Nq = 3, .Nk = 1, .Dk = 3, .Dv = 5}, 0.5, 2);
    add("r3_h2x1_q1_k7_win0_0", {.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 4, .Nk = 7, .Dk = 5, .Dv = 2, .window = {0, 0}},
        0.6, 0x100000000ull);
    add("r3_h4x2_q9_k97_causalBR",
        {.rank = 3, .Hq = 4, .Hkv = 2, .Nq = 9, .Nk = 97, .Dk = 16, .Dv = 24, .causal = Causal::kBottomRight}, 0.2, 3);
    add("r4_b2_h4x1_q33_k130_boolFull",
        {.rank = 4, .B = 2, .Hq = 4, .Hkv = 1, .Nq = 33, .Nk = 130, .Dk = 32, .Dv = 16, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kFull},
        0.1, 0xfedcba9876543210ull);
    add("r4_b2_h4x2_q17_k130_addHK_causalTL",
        {.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = 17, .Nk = 130, .Dk = 64, .Dv = 64, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kHeadKey, .causal = Causal::kTopLeft},
        0.5, 5);
    add("r3_h2x1_q130_k97_win16_4",
        {.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 130, .Nk = 97, .Dk = 8, .Dv = 8, .window = {16, 4}}, 0.7, 6);
    add("r4_b2_h2_q40_k7_boolQK_causalBR_padded",
        {.rank = 4, .B = 2, .Hq = 2, .Hkv = 2, .Nq = 40, .Nk = 7, .Dk = 9, .Dv = 3, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kQueryKey, .causal = Causal::kBottomRight, .layout = Layout::kPadded},
        0.9, 7);
    add("r4_b2_h4x2_q17_k65_addFull_causalBR_win32_permuted",
        {.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = 17, .Nk = 65, .Dk = 59, .Dv = 80, .mask = MaskKind::kAdditive,
         .causal = Causal::kBottomRight, .window = {32, -1}, .layout = Layout::kPermuted},
        0.4, 0xffffffffffffffffull);
    add("r3_h2x1_q140_k260_prefill", {.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 140, .Nk = 260, .Dk = 32, .Dv = 32}, 0.15,
        9);
    add("r4_h4x1_q1_k4100_addK_decode",
        {.rank = 4, .Hq = 4, .Hkv = 1, .Nq = 1, .Nk = 4100, .Dk = 64, .Dv = 64, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kKey},
        0.25, 10);
    add("r4_h8x2_q2_k2100_causalBR_decode",
        {.rank = 4, .Hq = 8, .Hkv = 2, .Nq = 2, .Nk = 2100, .Dk = 32, .Dv = 48, .causal = Causal::kBottomRight}, 0.5,
        11);
  }
  return cases;
}

sdpa::Options case_options(const DropoutCase& dc, Backend backend) {
  return with_dropout(options(dc.c, backend), dc.p, dc.seed);
}

// ---- Forward: kFlash and kAuto against kReference, the same dropout_p and seed ----

class DropoutForward : public testing::TestWithParam<DropoutCase> {};

TEST_P(DropoutForward, FlashAndAutoMatchReference) {
  const DropoutCase& dc = GetParam();
  const Tensors t = make_inputs(dc.c);
  std::optional<Outs> flash;
  for (Backend backend : {Backend::kFlash, Backend::kAuto}) {
    SCOPED_TRACE(backend_name(backend));
    const sdpa::Options o = case_options(dc, backend);
    Outs got = run(t, o, dc.c.layout);
    EXPECT_TRUE(got.guards_intact());
    for (const GuardedTensor* in : {&t.q, &t.k, &t.v}) EXPECT_TRUE(in->guards_intact());
    EXPECT_TRUE(blocked_are_exact(t, o, got));
    EXPECT_TRUE(matches_reference(t, o, got));
    // The header: weights show the softmax before dropout and lse is unaffected; only out changes.
    const Values plain = values(run(t, options(dc.c, backend), dc.c.layout));
    const Values g = values(got);
    EXPECT_TRUE(same_bits(g.weights, plain.weights)) << "weights must be the softmax before dropout";
    EXPECT_TRUE(same_bits(g.lse, plain.lse)) << "lse must not depend on dropout";
    EXPECT_FALSE(same_bits(g.out, plain.out)) << "dropout changed nothing";
    if (flash) {
      EXPECT_TRUE(bitwise_equal(got, *flash)) << "kAuto is documented to be kFlash today";
    } else {
      flash.emplace(std::move(got));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Table, DropoutForward, testing::ValuesIn(dropout_cases()),
                         [](const testing::TestParamInfo<DropoutCase>& info) { return info.param.c.name; });

TEST(DropoutTable, EveryCaseDropsAndKeepsAllowedWeights) {
  // Otherwise a case compares nothing that dropout touches (or nothing at all).
  for (const DropoutCase& dc : dropout_cases()) {
    if (dc.c.dtype != kF32) continue;
    SCOPED_TRACE(dc.c.name);
    const Tensors t = make_inputs(dc.c);
    const std::vector<double> w = run(t, options(dc.c, Backend::kReference)).weights->values();
    const std::vector<double> keep = keep_mask(t, dc.p, dc.seed);
    int64_t dropped = 0, kept = 0;
    for (size_t n = 0; n < w.size(); ++n) {
      if (w[n] == 0) continue;
      ++(keep[n] != 0 ? kept : dropped);
    }
    EXPECT_GT(dropped, 0);
    EXPECT_GT(kept, 0);
  }
}

// ---- kReference against dropout applied by hand ----
//
//   out_i = Σ_j w_ij · keep_ij / (1 - p) · v_j
// with w from kReference without dropout and keep from dropout_mask, summed here in float64.
// Error bound, per element, with S = Σ_j |w_ij keep_ij / (1 - p) v_j|: float32 weights are
// rounded (eps/2 relative each: eps/2 · S) and kReference rounds its out (eps/2 · |out| <=
// eps/2 · S); each float64 sum of Nk terms is within Nk · DBL_EPSILON · S. So
// tol = (eps(dtype) + 2 (Nk + 2) DBL_EPSILON) · S (float64: the weights are kReference's own
// float64 values, so the first term is more than needed). One decision flipped moves out by
// w_ij / (1 - p) · |v_j|: orders of magnitude above tol.
TEST_P(DropoutForward, ReferenceMatchesDropoutAppliedByHand) {
  const DropoutCase& dc = GetParam();
  const Tensors t = make_inputs(dc.c);
  const Dims d = dims_of(t);
  const std::vector<double> w = run(t, options(dc.c, Backend::kReference)).weights->values();
  const std::vector<double> keep = keep_mask(t, dc.p, dc.seed);
  const Values got = values(run(t, case_options(dc, Backend::kReference)));
  const double scale = 1.0 / (1.0 - dc.p);
  ASSERT_EQ(got.out.size(), static_cast<size_t>(d.B * d.Hq * d.Nq * d.Dv));
  int64_t bad = 0;
  std::string first;
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t kvh = h / d.group;
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i;
        for (int64_t e = 0; e < d.Dv; ++e) {
          double want = 0, S = 0;
          for (int64_t j = 0; j < d.Nk; ++j) {
            const double x = w[row * d.Nk + j] * keep[row * d.Nk + j] * scale;
            if (x == 0) continue;
            want += x * t.v.at(b, kvh, j, e);
            S += std::abs(x * t.v.at(b, kvh, j, e));
          }
          const double tol = (eps(dc.c.dtype) + 2.0 * static_cast<double>(d.Nk + 2) * DBL_EPSILON) * S;
          const double g = got.out[row * d.Dv + e];
          if (!(std::abs(g - want) <= tol) && bad++ == 0) {
            first = "out[" + std::to_string(b) + "," + std::to_string(h) + "," + std::to_string(i) + "," +
                    std::to_string(e) + "] = " + std::to_string(g) + ", by hand " + std::to_string(want) +
                    ", tol " + std::to_string(tol);
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "first: " << first;
}

// ---- The decisions themselves, read off exactly ----

// q, k normal; v (B, Hkv, Nk, Nk) the identity in every kv head, so out[b, h, i, j] =
// w_ij · z_ij with nothing else added: exactly 0 where (b, h, i, j) is dropped, w_ij / (1 - p)
// where kept.
Tensors one_hot_values(DType dt, int rank, int64_t B, int64_t Hq, int64_t Hkv, int64_t Nq, int64_t Nk, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensors t{GuardedTensor(dt, last(rank, {B, Hq, Nq, 8})), GuardedTensor(dt, last(rank, {B, Hkv, Nk, 8})),
            GuardedTensor(dt, last(rank, {B, Hkv, Nk, Nk})), std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  std::vector<double> v(static_cast<size_t>(B * Hkv * Nk * Nk), 0.0);
  for (int64_t x = 0; x < B * Hkv; ++x)
    for (int64_t j = 0; j < Nk; ++j) v[static_cast<size_t>((x * Nk + j) * Nk + j)] = 1;
  t.v.set_values(v);
  return t;
}

// A shape of the decision tests (forward: one-hot values; backward: one-hot dout), its dropout_p
// and seed.
struct OneHotCase {
  const char* name;
  int rank;
  int64_t B, Hq, Hkv, Nq, Nk;
  Causal causal;
  sdpa::Window window;
  double p;
  uint64_t seed;
};

constexpr OneHotCase kOneHotCases[] = {
    {"rank 2", 2, 1, 1, 1, 9, 7, Causal::kNone, {}, 0.9, 21},
    {"rank 4 GQA causal top-left, 130 keys", 4, 2, 4, 2, 20, 130, Causal::kTopLeft, {}, 0.3, 22},
    {"rank 3 MQA window, 130 rows", 3, 1, 3, 1, 130, 40, Causal::kNone, {8, 8}, 0.6, 0xabcdef0123456789ull},
    {"decode, keys in chunks", 4, 1, 2, 1, 1, 2100, Causal::kNone, {}, 0.5, 23},
};

TEST(DropoutDecisions, ForwardDropsExactlyTheMaskedWeightsInEveryBackend) {
  for (DType dt : {kF32, kF64}) {
    for (const OneHotCase& oc : kOneHotCases) {
      const Tensors t = one_hot_values(dt, oc.rank, oc.B, oc.Hq, oc.Hkv, oc.Nq, oc.Nk, 31);
      const std::vector<double> keep = keep_mask(t, oc.p, oc.seed);
      for (Backend backend : {Backend::kAuto, Backend::kFlash, Backend::kReference, Backend::kNaive}) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " " + oc.name + " " + backend_name(backend));
        sdpa::Options o;
        o.backend = backend;
        o.causal = oc.causal;
        o.window = oc.window;
        o = with_dropout(o, oc.p, oc.seed);
        const Values got = values(run(t, o));  // out (.., Nq, Nk) and weights (.., Nq, Nk), both C order
        ASSERT_EQ(got.out.size(), keep.size());
        int64_t dropped = 0, kept = 0, wrong = 0;
        size_t first = 0;
        for (size_t n = 0; n < keep.size(); ++n) {
          const double w = got.weights[n];
          bool ok;
          if (w == 0) {
            ok = got.out[n] == 0;  // blocked
          } else if (keep[n] == 0) {
            ok = got.out[n] == 0;
            ++dropped;
          } else {
            ok = std::abs(got.out[n] - w / (1 - oc.p)) <= 64 * eps(dt) * w / (1 - oc.p);
            ++kept;
          }
          if (!ok && wrong++ == 0) first = n;
        }
        EXPECT_EQ(wrong, 0) << "first at flat index " << first << ": out " << got.out[first] << ", weight "
                            << got.weights[first] << ", keep " << keep[first];
        EXPECT_GT(dropped, 0);
        EXPECT_GT(kept, 0);
      }
    }
  }
}

// ---- Backward: one problem, the tolerance rule of backward_test.cc ----
//
// Problem, Grads and the tolerance rule (expected(), matches()) are backward_util's, shared with
// backward_test.cc; the rule takes the dropout factor z from the options' dropout_p and seed.

uint32_t dout_seed(const DropoutCase& dc) {
  uint32_t h = 2166136261u;  // FNV-1a of the name
  for (unsigned char ch : dc.c.name + "/dout") h = (h ^ ch) * 16777619u;
  return h;
}

Problem make_case(const DropoutCase& dc) {
  return make_problem(make_inputs(dc.c), case_options(dc, Backend::kAuto), dc.c.layout, dout_seed(dc));
}

// The backward table: the forward's cases but the decode ones (the backward has no key
// chunks; its Nq = 1 rows are covered by rank 3 with 4 rows and the window (0, 0) case).
std::vector<DropoutCase> backward_cases() {
  std::vector<DropoutCase> cases;
  for (const DropoutCase& dc : dropout_cases()) {
    if (dc.c.Nk < 2048) cases.push_back(dc);
  }
  return cases;
}

class DropoutBackward : public testing::TestWithParam<DropoutCase> {};

TEST_P(DropoutBackward, FlashAndAutoMatchReference) {
  const DropoutCase& dc = GetParam();
  const Problem p = make_case(dc);
  Expected e;
  ASSERT_TRUE(expected(p, case_options(dc, Backend::kReference), e));
  std::optional<GradValues> flash;
  for (Backend backend : {Backend::kFlash, Backend::kAuto}) {
    SCOPED_TRACE(backend_name(backend));
    const Grads got = backward(p, case_options(dc, backend), dc.c.layout);
    EXPECT_TRUE(got.guards_intact());
    for (const GuardedTensor* in : {&p.t.q, &p.t.k, &p.t.v, &p.out, &p.lse, &p.dout}) EXPECT_TRUE(in->guards_intact());
    EXPECT_TRUE(matches(e, got));
    const GradValues g = values(got);
    if (flash) {
      EXPECT_TRUE(bitwise_equal(g, *flash)) << "kAuto is documented to be kFlash today";
    } else {
      flash = g;
    }
  }
  // Dropout is in the gradients: the same call without it gives other ones.
  Problem plain = make_problem(make_inputs(dc.c), options(dc.c, Backend::kAuto), dc.c.layout, dout_seed(dc));
  EXPECT_FALSE(bitwise_equal(values(backward(plain, options(dc.c, Backend::kAuto), dc.c.layout)), *flash));
}

INSTANTIATE_TEST_SUITE_P(Table, DropoutBackward, testing::ValuesIn(backward_cases()),
                         [](const testing::TestParamInfo<DropoutCase>& info) { return info.param.c.name; });

// kReference's backward against the maths with dropout written out in float64 (backward_util's
// backward_oracle: test_util's oracle weights P, before dropout, and z = keep / (1 - p) from
// dropout_mask). Tolerance as backward_test.cc's oracle check: both compute in float64 from the
// same values.
TEST_P(DropoutBackward, ReferenceMatchesDropoutAppliedByHand) {
  const DropoutCase& dc = GetParam();
  const Problem p = make_case(dc);
  const sdpa::Options o = case_options(dc, Backend::kReference);
  const GradValues want = backward_oracle(p, o);
  const GradValues got = values(backward(p, o, dc.c.layout));
  for (int n = 0; n < 3; ++n) {
    const double tol = (1e-12 + eps(dc.c.dtype)) * std::max(1.0, max_abs_finite(want.g[n]));
    EXPECT_TRUE(all_near(kGradNames[n], got.g[n], want.g[n], tol));
  }
}

// The backward's decisions, read off exactly: dout[b, h, i, e] = 1 where e = (h mod group) · Nq
// + i, else 0 (Dv = group · Nq), so dv[b, kvh, j, (h mod group) · Nq + i] = z_ij P_ij, nothing
// else added: exactly 0 where (b, h, i, j) is dropped, P_ij / (1 - p) where kept. With the
// forward's check above, the forward and backward of every backend drop the same weights:
// dropout_mask's.
TEST(DropoutDecisions, BackwardDropsExactlyTheMaskedWeightsInEveryBackend) {
  constexpr OneHotCase shapes[] = {
      {"rank 2", 2, 1, 1, 1, 9, 7, Causal::kNone, {}, 0.9, 41},
      {"rank 4 GQA causal bottom-right, 130 keys", 4, 2, 4, 2, 20, 130, Causal::kBottomRight, {}, 0.4, 42},
      {"rank 3 MQA window, 130 rows", 3, 1, 3, 1, 130, 40, Causal::kNone, {8, 8}, 0.6, 0x123456789abcdef0ull},
  };
  for (DType dt : {kF32, kF64}) {
    for (const OneHotCase& s : shapes) {
      const int64_t G = s.Hq / s.Hkv, Dv = G * s.Nq;
      std::mt19937 rng(43);
      Tensors t{GuardedTensor(dt, last(s.rank, {s.B, s.Hq, s.Nq, 8})), GuardedTensor(dt, last(s.rank, {s.B, s.Hkv, s.Nk, 8})),
                GuardedTensor(dt, last(s.rank, {s.B, s.Hkv, s.Nk, Dv})), std::nullopt};
      fill_normal(t.q, rng);
      fill_normal(t.k, rng);
      fill_normal(t.v, rng);
      sdpa::Options o;
      o.causal = s.causal;
      o.window = s.window;
      o = with_dropout(o, s.p, s.seed);
      const std::vector<double> keep = keep_mask(t, s.p, s.seed);
      sdpa::Options ro = o;
      ro.backend = Backend::kReference;
      const std::vector<double> w = run(t, ro).weights->values();
      Problem p = make_problem(std::move(t), o, Layout::kContiguous, 44);
      std::vector<double> dout(static_cast<size_t>(p.dout.numel()), 0.0);
      for (int64_t bh = 0; bh < s.B * s.Hq; ++bh)
        for (int64_t i = 0; i < s.Nq; ++i) dout[static_cast<size_t>((bh * s.Nq + i) * Dv + bh % s.Hq % G * s.Nq + i)] = 1;
      p.dout.set_values(dout);
      for (Backend backend : {Backend::kAuto, Backend::kFlash, Backend::kReference, Backend::kNaive}) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " " + s.name + " " + backend_name(backend));
        o.backend = backend;
        const std::vector<double> dv = backward(p, o).dv.values();
        int64_t dropped = 0, kept = 0, wrong = 0;
        std::string first;
        for (int64_t b = 0; b < s.B; ++b)
          for (int64_t h = 0; h < s.Hq; ++h)
            for (int64_t i = 0; i < s.Nq; ++i)
              for (int64_t j = 0; j < s.Nk; ++j) {
                const size_t n = static_cast<size_t>(((b * s.Hq + h) * s.Nq + i) * s.Nk + j);
                const double g = dv[static_cast<size_t>(((b * s.Hkv + h / G) * s.Nk + j) * Dv + h % G * s.Nq + i)];
                bool ok;
                if (w[n] == 0) {
                  ok = g == 0;  // blocked
                } else if (keep[n] == 0) {
                  ok = g == 0;
                  ++dropped;
                } else {
                  // P recomputed from the given lse: relative error a few eps (1 + |lse|).
                  ok = std::abs(g - w[n] / (1 - s.p)) <= 1e3 * eps(dt) * w[n] / (1 - s.p);
                  ++kept;
                }
                if (!ok && wrong++ == 0) {
                  first = "(" + std::to_string(b) + "," + std::to_string(h) + "," + std::to_string(i) + "," +
                          std::to_string(j) + "): dv " + std::to_string(g) + ", weight " + std::to_string(w[n]) +
                          ", keep " + std::to_string(keep[n]);
                }
              }
        EXPECT_EQ(wrong, 0) << "first at " << first;
        EXPECT_GT(dropped, 0);
        EXPECT_GT(kept, 0);
      }
    }
  }
}

// ---- dropout_p = 0 is no dropout; dropout_p outside [0, 1) is an error ----

TEST(DropoutOff, ZeroProbabilityIsBitwiseNoDropoutWhateverTheSeed) {
  for (DType dt : {kF32, kF64}) {
    Case c{.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = 17, .Nk = 130, .Dk = 16, .Dv = 8, .dtype = dt,
           .mask = MaskKind::kBool, .causal = Causal::kBottomRight};
    c.name = std::string("zero_p_") + sdpa::dtype_name(dt);
    const Tensors t = make_inputs(c);
    for (Backend backend : {Backend::kAuto, Backend::kFlash, Backend::kReference, Backend::kNaive}) {
      const sdpa::Options plain = options(c, backend);  // dropout_p, seed: the defaults
      const Outs want = run(t, plain);
      const Problem pp = make_problem(t.converted(dt), plain, Layout::kContiguous, 51);
      const GradValues want_g = values(backward(pp, plain));
      for (uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{0x100000000ull}, ~uint64_t{0}}) {
        for (double zero : {0.0, -0.0}) {
          SCOPED_TRACE(std::string(sdpa::dtype_name(dt)) + " " + backend_name(backend) + " seed " +
                       std::to_string(seed) + (std::signbit(zero) ? " p -0" : " p 0"));
          const sdpa::Options o = with_dropout(plain, zero, seed);
          EXPECT_TRUE(bitwise_equal(run(t, o), want));
          EXPECT_TRUE(bitwise_equal(values(backward(pp, o)), want_g));
        }
      }
    }
  }
  GuardedTensor m(DType::kBool, {2, 3, 5, 7});
  sdpa::dropout_mask(0.0, 12345, m.view());
  EXPECT_EQ(m.values(), std::vector<double>(m.numel(), 1.0)) << "p = 0 keeps everything";
}

// Must throw sdpa::Error naming dropout_p.
template <typename F>
testing::AssertionResult throws_dropout_error(F&& call) {
  try {
    call();
  } catch (const sdpa::Error& e) {
    if (std::string(e.what()).find("dropout_p") == std::string::npos) {
      return testing::AssertionFailure() << "the message does not name dropout_p: " << e.what();
    }
    return testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw something else than sdpa::Error: " << e.what();
  }
  return testing::AssertionFailure() << "no sdpa::Error thrown";
}

TEST(DropoutOff, ProbabilityOutsideZeroToOneIsAnErrorThatWritesNothing) {
  Case c{.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 5, .Nk = 9, .Dk = 4, .Dv = 3};
  c.name = "invalid_p";
  const Problem p = make_problem(make_inputs(c), {}, Layout::kContiguous, 61);
  for (double bad : {-0.1, 1.0, 1.5, kNaN, kInf, -kInf, -1e-300, std::nextafter(1.0, 2.0)}) {
    for (Backend backend : {Backend::kAuto, Backend::kFlash, Backend::kReference, Backend::kNaive}) {
      SCOPED_TRACE("dropout_p " + std::to_string(bad) + " " + backend_name(backend));
      sdpa::Options o;
      o.backend = backend;
      o = with_dropout(o, bad, 7);
      Outs outs{GuardedTensor(kF32, {2, 5, 3}), GuardedTensor(kF32, {2, 5, 9}), GuardedTensor(kF32, {2, 5})};
      EXPECT_TRUE(throws_dropout_error([&] { sdpa::attention(p.t.inputs(), outs.outputs(), o); }));
      EXPECT_TRUE(outs.out.untouched());
      EXPECT_TRUE(outs.weights->untouched());
      EXPECT_TRUE(outs.lse->untouched());
      const Grads g = empty_grads(p.t, Layout::kContiguous);
      EXPECT_TRUE(throws_dropout_error(
          [&] { sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), g.gradients(), o); }));
      EXPECT_TRUE(g.untouched());
    }
    SCOPED_TRACE("dropout_mask, dropout_p " + std::to_string(bad));
    GuardedTensor m(DType::kBool, {2, 5, 9});
    EXPECT_TRUE(throws_dropout_error([&] { sdpa::dropout_mask(bad, 7, m.view()); }));
    EXPECT_TRUE(m.untouched());
  }
  // The largest valid dropout_p is accepted (the check is not off by one ulp).
  GuardedTensor m(DType::kBool, {2, 5, 9});
  EXPECT_NO_THROW(sdpa::dropout_mask(std::nextafter(1.0, 0.0), 7, m.view()));
}

// ---- dropout_mask ----

TEST(DropoutMask, RejectsViewsThatAreNotBoolWeights) {
  GuardedTensor f(kF32, {3, 4}), r1(DType::kBool, {12});
  EXPECT_THROW(sdpa::dropout_mask(0.5, 1, f.view()), sdpa::Error);
  EXPECT_TRUE(f.untouched());
  EXPECT_THROW(sdpa::dropout_mask(0.5, 1, r1.view()), sdpa::Error);
  EXPECT_TRUE(r1.untouched());
}

// Raw bytes of every element: each must be exactly 0 or 1 (the sentinel 0xA5 would read as 1
// through GuardedTensor::get, so an unwritten element would not show there).
std::vector<uint8_t> raw_bytes(const GuardedTensor& m) {
  const sdpa::TensorView v = m.view();
  std::vector<uint8_t> out;
  int64_t idx[4] = {0, 0, 0, 0};
  for (int64_t n = 0; n < m.numel(); ++n) {
    int64_t flat = n, off = 0;
    for (int d = v.rank - 1; d >= 0; --d) {
      idx[d] = flat % v.shape[d];
      flat /= v.shape[d];
      off += idx[d] * v.strides[d];
    }
    out.push_back(static_cast<const uint8_t*>(v.data)[off]);
  }
  return out;
}

TEST(DropoutMask, EveryLayoutAndRankWritesTheSameDecisions) {
  const double p = 0.3;
  const uint64_t seed = 0x5eed;
  GuardedTensor full(DType::kBool, {2, 3, 17, 33});
  sdpa::dropout_mask(p, seed, full.view());
  ASSERT_TRUE(full.guards_intact());
  const std::vector<uint8_t> bytes = raw_bytes(full);
  for (uint8_t x : bytes) ASSERT_TRUE(x == 0 || x == 1) << "an element was not written, or not as 0 / 1: " << int(x);
  const std::vector<double> want = full.values();
  for (Layout layout : {Layout::kPadded, Layout::kPermuted}) {
    for (bool unit : {true, false}) {
      SCOPED_TRACE(std::string(layout == Layout::kPadded ? "padded" : "permuted") + (unit ? "" : ", last stride 2"));
      GuardedTensor m(DType::kBool, {2, 3, 17, 33}, layout, unit);
      sdpa::dropout_mask(p, seed, m.view());
      EXPECT_TRUE(m.guards_intact());
      EXPECT_EQ(raw_bytes(m), bytes);
    }
  }
  // Rank 3 is b = 0, rank 2 is b = h = 0 (the weights' dims right-aligned, as in attention()).
  GuardedTensor r3(DType::kBool, {3, 17, 33}, Layout::kPadded, false), r2(DType::kBool, {17, 33});
  sdpa::dropout_mask(p, seed, r3.view());
  sdpa::dropout_mask(p, seed, r2.view());
  EXPECT_TRUE(r3.guards_intact());
  EXPECT_TRUE(r2.guards_intact());
  EXPECT_EQ(r3.values(), std::vector<double>(want.begin(), want.begin() + 3 * 17 * 33));
  EXPECT_EQ(r2.values(), std::vector<double>(want.begin(), want.begin() + 17 * 33));
  GuardedTensor empty(DType::kBool, {2, 0, 5});
  sdpa::dropout_mask(p, seed, empty.view());
  EXPECT_TRUE(empty.untouched()) << "no elements, nothing written";
}

// Kept fraction and independence. With n decisions each kept with probability q (q = 1 - p up
// to the 2^-32 resolution of the threshold: |q - (1 - p)| <= 2^-32, n · 2^-32 < 1 here), the
// kept count is Binomial(n, q): mean n q, standard deviation sqrt(n q (1 - q)). A correct
// generator stays within 6 standard deviations (+1 for the resolution) except with probability
// ~2e-9 per check. Pairs of neighbours along each index (j, i, h, b), disjoint pairs, agree with
// probability a = q² + (1 - q)² if independent; likewise within 6 sd of Binomial(n/2, a). A
// generator that ignored an index, or correlated neighbours, fails the pair check for it.
testing::AssertionResult within_6_sd(const char* what, double count, double n, double prob) {
  const double mean = n * prob, sd = std::sqrt(n * prob * (1 - prob)), bound = 6 * sd + 1;
  if (std::abs(count - mean) <= bound) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << ": " << count << " of " << n << ", expected " << mean << " ± " << bound;
}

TEST(DropoutMask, KeptFractionAndIndependenceAreThoseOfBernoulliDraws) {
  const int64_t B = 4, H = 4, N = 96, M = 96;  // 147456 decisions
  for (double p : {0.01, 0.1, 0.5, 0.9, 0.99}) {
    for (uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{0xdeadbeefcafef00dull}}) {
      SCOPED_TRACE("p " + std::to_string(p) + " seed " + std::to_string(seed));
      GuardedTensor m(DType::kBool, {B, H, N, M});
      sdpa::dropout_mask(p, seed, m.view());
      const std::vector<double> x = m.values();
      const double n = static_cast<double>(x.size()), q = 1 - p;
      double kept = 0;
      for (double v : x) kept += v;
      EXPECT_TRUE(within_6_sd("kept", kept, n, q));
      const double agree_p = q * q + (1 - q) * (1 - q);
      const int64_t strides[4] = {H * N * M, N * M, M, 1};
      const int64_t extents[4] = {B, H, N, M};
      const char* names[4] = {"b neighbours agree", "h neighbours agree", "i neighbours agree", "j neighbours agree"};
      for (int d = 0; d < 4; ++d) {
        double agree = 0, pairs = 0;
        for (int64_t flat = 0; flat < static_cast<int64_t>(x.size()); ++flat) {
          if (flat / strides[d] % extents[d] % 2 != 0) continue;  // the first of each disjoint pair
          agree += x[flat] == x[flat + strides[d]];
          ++pairs;
        }
        EXPECT_TRUE(within_6_sd(names[d], agree, pairs, agree_p));
      }
    }
  }
}

TEST(DropoutMask, SameSeedSameMaskOtherSeedOtherMask) {
  const double p = 0.5;
  auto mask = [&](uint64_t seed) {
    GuardedTensor m(DType::kBool, {2, 2, 32, 64});
    sdpa::dropout_mask(p, seed, m.view());
    return m.values();
  };
  // Each half of the seed is half of Philox's key: changing only the high word must matter.
  const uint64_t seeds[] = {0, 1, 2, 0x100000000ull, 0x200000000ull, 0x100000001ull, ~uint64_t{0}};
  for (uint64_t a : seeds) {
    EXPECT_EQ(mask(a), mask(a)) << "seed " << a;
    for (uint64_t b : seeds) {
      if (a >= b) continue;
      SCOPED_TRACE("seeds " + std::to_string(a) + " and " + std::to_string(b));
      const std::vector<double> x = mask(a), y = mask(b);
      double differ = 0;
      for (size_t n = 0; n < x.size(); ++n) differ += x[n] != y[n];
      // Independent masks differ with probability 2 p (1 - p) per element.
      EXPECT_TRUE(within_6_sd("differ", differ, static_cast<double>(x.size()), 2 * p * (1 - p)));
    }
  }
}

// Philox4x32-10 written out again from Salmon et al. (SC'11) and Random123's philox.h: per
// round, (c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)),
// M0 = 0xD2511F53, M1 = 0xCD9E8D57; the key is bumped by (0x9E3779B9, 0xBB67AE85) between rounds.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
    const uint64_t p0 = uint64_t{0xD2511F53u} * c[0], p1 = uint64_t{0xCD9E8D57u} * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
  }
  return c;
}

struct KnownAnswer {
  std::array<uint32_t, 4> counter;
  std::array<uint32_t, 2> key;
  std::array<uint32_t, 4> want;
};

// Random123's kat_vectors for philox4x32_10.
constexpr KnownAnswer kPhiloxKat[] = {
    {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

TEST(DropoutGenerator, Philox4x32_10MatchesTheRandom123KnownAnswers) {
  for (const KnownAnswer& kat : kPhiloxKat) {
    EXPECT_EQ(philox4x32_10(kat.counter, kat.key), kat.want);
    // src/dropout.h: counter (j, i, h, b), key (low, high 32 bits of the seed); its draw is
    // the first output word.
    const uint64_t seed = uint64_t{kat.key[1]} << 32 | kat.key[0];
    EXPECT_EQ(sdpa::internal::Dropout::draw(seed, kat.counter[3], kat.counter[2], kat.counter[1], kat.counter[0]),
              kat.want[0]);
  }
  std::mt19937_64 rng(71);
  for (int n = 0; n < 10000; ++n) {
    const uint64_t seed = rng(), x = rng(), y = rng();
    const uint32_t b = static_cast<uint32_t>(x), h = static_cast<uint32_t>(x >> 32), i = static_cast<uint32_t>(y),
                   j = static_cast<uint32_t>(y >> 32);
    ASSERT_EQ(sdpa::internal::Dropout::draw(seed, b, h, i, j),
              philox4x32_10({j, i, h, b}, {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)})[0]);
  }
}

// Reproducible across runs, machines and versions: through the public API, weight (b, h, i, j)
// is dropped iff the first word of Philox4x32-10 at counter (j, i, h, b), key (low, high half of
// the seed), is below floor(p · 2^32). Pinned here so that a change of the rule (which would
// silently change every user's masks for a given seed) shows.
TEST(DropoutGenerator, PublicMaskIsThePinnedPhiloxRule) {
  for (double p : {0.1, 0.5, 0.77}) {
    for (uint64_t seed : {uint64_t{0}, uint64_t{42}, uint64_t{0x299f31d0a4093822ull}, ~uint64_t{0}}) {
      SCOPED_TRACE("p " + std::to_string(p) + " seed " + std::to_string(seed));
      const int64_t B = 2, H = 3, N = 17, M = 33;
      GuardedTensor m(DType::kBool, {B, H, N, M});
      sdpa::dropout_mask(p, seed, m.view());
      const uint32_t threshold = static_cast<uint32_t>(std::floor(p * 4294967296.0));
      std::vector<double> want;
      for (uint32_t b = 0; b < B; ++b)
        for (uint32_t h = 0; h < H; ++h)
          for (uint32_t i = 0; i < N; ++i)
            for (uint32_t j = 0; j < M; ++j) {
              const uint32_t u =
                  philox4x32_10({j, i, h, b}, {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)})[0];
              want.push_back(u >= threshold ? 1.0 : 0.0);
            }
      EXPECT_EQ(m.values(), want);
    }
  }
  // The boundary, which random draws almost never hit: weight (b, h, i, j) with draw u is kept
  // at p = u / 2^32 (u is not below floor(p · 2^32) = u) and dropped at p = (u + 1) / 2^32.
  // Both p are exact doubles, so this pins the comparison (<, not <=) and the rounding.
  for (uint64_t seed : {uint64_t{0}, uint64_t{0x299f31d0a4093822ull}}) {
    const int64_t B = 2, H = 2, N = 2, M = 3;
    for (uint32_t b = 0; b < B; ++b)
      for (uint32_t h = 0; h < H; ++h)
        for (uint32_t i = 0; i < N; ++i)
          for (uint32_t j = 0; j < M; ++j) {
            SCOPED_TRACE("seed " + std::to_string(seed) + " at (" + std::to_string(b) + "," + std::to_string(h) + "," +
                         std::to_string(i) + "," + std::to_string(j) + ")");
            const uint32_t u =
                philox4x32_10({j, i, h, b}, {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)})[0];
            GuardedTensor m(DType::kBool, {B, H, N, M});
            sdpa::dropout_mask(static_cast<double>(u) / 4294967296.0, seed, m.view());
            EXPECT_EQ(m.at(b, h, i, j), 1.0) << "dropped at p = u / 2^32";
            if (u == 0xffffffffu) continue;  // (u + 1) / 2^32 = 1 is not a valid p
            sdpa::dropout_mask((static_cast<double>(u) + 1) / 4294967296.0, seed, m.view());
            EXPECT_EQ(m.at(b, h, i, j), 0.0) << "kept at p = (u + 1) / 2^32";
          }
  }
}

}  // namespace
