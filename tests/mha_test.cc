// The multi-head layer (sdpa/mha.h):
//   - the float64 reference layer's forward against an oracle written here from the header's
//     formulas (its own projections and RoPE, test_util's attention oracle);
//   - the reference layer's gradients against central differences of its forward;
//   - the fast layer's output and every gradient against the reference layer, with the
//     tolerance 2 · (error of the naive layer in the same precision) + one rounding of the
//     result (eps · its largest magnitude): self- and cross-attention, GQA and MQA, RoPE,
//     causal, masks with empty rows, dropout, odd sizes, float32 and float64, padded and
//     negative-stride inputs;
//   - the bfloat16 and float16 layers in both precisions against the reference layer, with the
//     tolerance of their own naive layer (Fast16BitMatches, whose comment states the bound), and
//     rounding where sdpa/mha.h says, with the precision passed to the kernel (bit for bit);
//   - bitwise equal results on 1 and 2 threads;
//   - step() with a KVCache token by token and in chunks against the full causal forward;
//   - errors that name the argument.
#include "sdpa/mha.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

struct LayerCase {
  const char* name;
  int64_t B, Nq, Nk, E, Hq, Hkv, Dk, Dv, kdim, vdim;
  int cross;  // 0 self-attention, 1 x_k and x_v, 2 x_k alone (x_v = x_k)
  bool bias, rope;
  Causal causal;
  int mask;  // 0 none, 1 bool key padding (B, 1, 1, Nk) with a fully padded batch row, 2 float (Nq, Nk) with -inf
  double dropout;
};

const LayerCase kCases[] = {
    {"self", 2, 5, 5, 16, 4, 4, 4, 4, 16, 16, 0, true, false, Causal::kNone, 0, 0.0},
    {"causal_rope_gqa", 2, 33, 33, 32, 4, 2, 8, 8, 32, 32, 0, true, true, Causal::kBottomRight, 0, 0.0},
    {"cross_dims", 2, 7, 13, 24, 3, 3, 8, 6, 12, 10, 1, true, false, Causal::kNone, 2, 0.0},
    {"padding_dropout_nobias", 3, 9, 9, 16, 2, 2, 8, 8, 16, 16, 0, false, false, Causal::kNone, 1, 0.25},
    {"mqa_rope_odd", 1, 97, 97, 40, 5, 1, 8, 8, 40, 40, 0, true, true, Causal::kTopLeft, 0, 0.0},
    {"cross_rope_causal_mask", 1, 6, 11, 16, 2, 1, 4, 5, 16, 16, 1, true, true, Causal::kBottomRight, 2, 0.1},
    {"cross_shared_kv", 2, 5, 8, 16, 2, 1, 8, 8, 12, 12, 2, true, false, Causal::kNone, 0, 0.0},
};

void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

// A layer's tensors: weights, inputs, mask.
struct Layer {
  sdpa::MultiHeadConfig cfg;
  std::vector<GuardedTensor> w;  // w_q, w_k, w_v, w_o, then b_q, b_k, b_v, b_o when cfg.bias
  GuardedTensor xq;
  std::optional<GuardedTensor> xk, xv, mask;
  int64_t pos_q = 0, pos_k = 0;

  sdpa::MultiHeadWeights weights() const {
    sdpa::MultiHeadWeights m{w[0].view(), w[1].view(), w[2].view(), w[3].view()};
    if (cfg.bias) m.b_q = w[4].view(), m.b_k = w[5].view(), m.b_v = w[6].view(), m.b_o = w[7].view();
    return m;
  }
  sdpa::MultiHeadInputs inputs() const {
    sdpa::MultiHeadInputs in;
    in.x_q = xq.view();
    if (xk) in.x_k = xk->view();
    if (xv) in.x_v = xv->view();
    if (mask) in.mask = mask->view();
    in.position_q = pos_q;
    in.position_k = pos_k;
    return in;
  }
};

sdpa::Options options_of(const LayerCase& c, Backend backend) {
  sdpa::Options o;
  o.causal = c.causal;
  o.dropout_p = c.dropout;
  if (c.dropout > 0) o.seed = 1234;
  o.backend = backend;
  return o;
}

Layer make_layer(const LayerCase& c, DType dt, Layout layout, uint32_t seed) {
  std::mt19937 rng(seed);
  sdpa::MultiHeadConfig cfg;
  cfg.d_model = c.E, cfg.num_heads = c.Hq, cfg.num_kv_heads = c.Hkv, cfg.head_dim = c.Dk, cfg.head_dim_v = c.Dv;
  cfg.kdim = c.kdim, cfg.vdim = c.vdim, cfg.bias = c.bias, cfg.rope = c.rope;
  const std::vector<std::vector<int64_t>> shapes = {{c.E, c.Hq * c.Dk}, {c.kdim, c.Hkv * c.Dk}, {c.vdim, c.Hkv * c.Dv},
                                                    {c.Hq * c.Dv, c.E}, {c.Hq * c.Dk},        {c.Hkv * c.Dk},
                                                    {c.Hkv * c.Dv},     {c.E}};
  Layer L{cfg, {}, GuardedTensor(dt, {c.B, c.Nq, c.E}, layout), std::nullopt, std::nullopt, std::nullopt};
  for (size_t p = 0; p < (c.bias ? 8u : 4u); ++p) {
    L.w.emplace_back(dt, shapes[p], p < 4 ? layout : Layout::kContiguous);
    fill_normal(L.w.back(), rng, p < 4 ? 1.0 / std::sqrt(static_cast<double>(shapes[p][0])) : 0.5);
  }
  fill_normal(L.xq, rng);
  if (c.cross) {
    L.xk.emplace(dt, std::vector<int64_t>{c.B, c.Nk, c.kdim}, layout);
    fill_normal(*L.xk, rng);
  }
  if (c.cross == 1) {
    L.xv.emplace(dt, std::vector<int64_t>{c.B, c.Nk, c.vdim}, layout);
    fill_normal(*L.xv, rng);
  }
  if (c.mask == 1) {
    L.mask.emplace(DType::kBool, std::vector<int64_t>{c.B, 1, 1, c.Nk});
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t j = 0; j < c.Nk; ++j) L.mask->set(b * c.Nk + j, b == 1 ? 0.0 : (j < c.Nk - b ? 1.0 : 0.0));
  } else if (c.mask == 2) {
    L.mask.emplace(dt, std::vector<int64_t>{c.Nq, c.Nk});
    fill_mask(*L.mask, rng, 0.8, 0.2);
  }
  if (c.rope) L.pos_q = 3, L.pos_k = c.cross ? 1 : 3;
  return L;
}

// Every output of one forward and backward, by name, as doubles in C order.
struct Parts {
  std::vector<std::string> names;
  std::vector<std::vector<double>> values;
};

Parts run(const Layer& L, const sdpa::Options& o, const GuardedTensor& dy, Layout out_layout = Layout::kContiguous) {
  const DType dt = L.xq.dtype();
  GuardedTensor y(dt, L.xq.shape(), out_layout);
  sdpa::MultiHeadOutputs out{y.view()};
  sdpa::MultiHeadSaved saved;
  sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), out, o, &saved);
  EXPECT_TRUE(y.guards_intact());
  Parts p{{"y"}, {y.values()}};
  std::vector<GuardedTensor> g;
  g.emplace_back(dt, L.xq.shape(), out_layout);
  if (L.xk) g.emplace_back(dt, L.xk->shape(), out_layout);
  if (L.xv) g.emplace_back(dt, L.xv->shape(), out_layout);
  for (const GuardedTensor& w : L.w) g.emplace_back(dt, w.shape(), out_layout);
  sdpa::MultiHeadGradients grads{g[0].view()};
  size_t i = 1;
  if (L.xk) grads.dx_k = g[i++].view();
  if (L.xv) grads.dx_v = g[i++].view();
  grads.dw_q = g[i++].view(), grads.dw_k = g[i++].view(), grads.dw_v = g[i++].view(), grads.dw_o = g[i++].view();
  if (L.cfg.bias) grads.db_q = g[i++].view(), grads.db_k = g[i++].view(), grads.db_v = g[i++].view(), grads.db_o = g[i++].view();
  sdpa::multi_head_attention_backward(L.cfg, L.weights(), L.inputs(), saved, dy.view(), grads, o);
  const char* names[] = {"dw_q", "dw_k", "dw_v", "dw_o", "db_q", "db_k", "db_v", "db_o"};
  p.names.push_back("dx_q");
  if (L.xk) p.names.push_back("dx_k");
  if (L.xv) p.names.push_back("dx_v");
  for (size_t w = 0; w < L.w.size(); ++w) p.names.push_back(names[w]);
  for (const GuardedTensor& t : g) {
    EXPECT_TRUE(t.guards_intact());
    p.values.push_back(t.values());
  }
  return p;
}

GuardedTensor make_dy(const Layer& L, uint32_t seed) {
  std::mt19937 rng(seed);
  GuardedTensor dy(L.xq.dtype(), L.xq.shape());
  fill_normal(dy, rng);
  return dy;
}

// ---- The oracle: the header's formulas, written here ----

// x (R × W, C order) times W (W × C) plus bias.
std::vector<double> linear(const std::vector<double>& x, int64_t R, const GuardedTensor& w, const GuardedTensor* b) {
  const int64_t Win = w.shape()[0], C = w.shape()[1];
  const std::vector<double> W = w.values();
  std::vector<double> out(R * C, 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      double s = b ? b->get(c) : 0.0;
      for (int64_t e = 0; e < Win; ++e) s += x[r * Win + e] * W[e * C + c];
      out[r * C + c] = s;
    }
  return out;
}

// (B, N, H·D) rows as a (B, H, N, D) float64 tensor, rotated by RoPE when `rope`.
GuardedTensor split_heads(const std::vector<double>& rows, int64_t B, int64_t N, int64_t H, int64_t D, bool rope,
                          int64_t pos0, double base) {
  GuardedTensor t(kF64, {B, H, N, D});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t d = 0; d < D; ++d) {
          const double* e = &rows[((b * N + i) * H + h) * D];
          double x = e[d];
          if (rope) {
            const int64_t half = D / 2, f = d % half;
            const double theta = static_cast<double>(pos0 + i) * std::pow(base, -2.0 * f / D);
            x = d < half ? e[d] * std::cos(theta) - e[d + half] * std::sin(theta)
                         : e[d] * std::cos(theta) + e[d - half] * std::sin(theta);
          }
          t.set(((b * H + h) * N + i) * D + d, x);
        }
  return t;
}

std::vector<double> oracle_y(const LayerCase& c, const Layer& L) {
  const std::vector<double> xq = L.xq.values(), xk = L.xk ? L.xk->values() : xq, xv = L.xv ? L.xv->values() : xk;
  auto bias = [&](int p) { return c.bias ? &L.w[4 + p] : nullptr; };
  Tensors t{split_heads(linear(xq, c.B * c.Nq, L.w[0], bias(0)), c.B, c.Nq, c.Hq, c.Dk, c.rope, L.pos_q, 10000.0),
            split_heads(linear(xk, c.B * c.Nk, L.w[1], bias(1)), c.B, c.Nk, c.Hkv, c.Dk, c.rope, L.pos_k, 10000.0),
            split_heads(linear(xv, c.B * c.Nk, L.w[2], bias(2)), c.B, c.Nk, c.Hkv, c.Dv, false, 0, 10000.0),
            L.mask ? std::optional<GuardedTensor>(L.mask->converted(L.mask->dtype() == DType::kBool ? DType::kBool : kF64,
                                                                    Layout::kContiguous))
                   : std::nullopt};
  const std::vector<double> heads = oracle(t, options_of(c, Backend::kReference)).out;  // (B, Hq, Nq, Dv)
  std::vector<double> concat(c.B * c.Nq * c.Hq * c.Dv);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Nq; ++i)
        for (int64_t d = 0; d < c.Dv; ++d)
          concat[((b * c.Nq + i) * c.Hq + h) * c.Dv + d] = heads[((b * c.Hq + h) * c.Nq + i) * c.Dv + d];
  return linear(concat, c.B * c.Nq, L.w[3], bias(3));
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}
double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

class LayerTest : public testing::TestWithParam<LayerCase> {};

TEST_P(LayerTest, ReferenceForwardMatchesOracle) {
  LayerCase c = GetParam();
  c.dropout = 0;  // test_util's oracle has no dropout (FastMatchesReference and the finite differences cover it)
  const Layer L = make_layer(c, kF64, Layout::kContiguous, 7);
  GuardedTensor y(kF64, L.xq.shape());
  sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {y.view()}, options_of(c, Backend::kReference));
  const std::vector<double> want = oracle_y(c, L);
  // Both are float64 sums of the same terms in different orders: a few ulps of the largest term.
  EXPECT_TRUE(all_close("y", y.values(), want, 64 * eps(kF64) * (1 + max_abs(want))));
}

// The reference layer's backward against central differences of its forward: loss = Σ y·dy.
TEST_P(LayerTest, ReferenceGradientsMatchFiniteDifferences) {
  const LayerCase& c = GetParam();
  Layer L = make_layer(c, kF64, Layout::kContiguous, 11);
  const GuardedTensor dy = make_dy(L, 12);
  const sdpa::Options o = options_of(c, Backend::kReference);
  const Parts g = run(L, o, dy);
  auto loss = [&]() {
    GuardedTensor y(kF64, L.xq.shape());
    sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {y.view()}, o);
    const std::vector<double> yv = y.values(), d = dy.values();
    double s = 0;
    for (size_t i = 0; i < yv.size(); ++i) s += yv[i] * d[i];
    return s;
  };
  const double L0 = std::abs(loss());
  std::vector<GuardedTensor*> params = {&L.xq};
  if (L.xk) params.push_back(&*L.xk);
  if (L.xv) params.push_back(&*L.xv);
  for (GuardedTensor& w : L.w) params.push_back(&w);
  std::mt19937 rng(5);
  const double h = 1e-5;
  for (size_t p = 0; p < params.size(); ++p) {
    GuardedTensor& t = *params[p];
    for (int trial = 0; trial < 4; ++trial) {
      const int64_t i = std::uniform_int_distribution<int64_t>(0, t.numel() - 1)(rng);
      const double x = t.get(i);
      t.set(i, x + h);
      const double up = loss();
      t.set(i, x - h);
      const double down = loss();
      t.set(i, x);
      const double fd = (up - down) / (2 * h);
      // Truncation h² · |f'''| ~ 1e-10 and rounding eps · |loss| / h ~ 2e-11 · |loss|: a
      // tolerance of 1e-6 · (1 + |loss|) is far above both and far below a wrong gradient.
      EXPECT_NEAR(g.values[p + 1][i], fd, 1e-6 * (1 + L0)) << g.names[p + 1] << "[" << i << "]";
    }
  }
}

// The tolerance of part p of a result in dtype dt: 4 · e_p · eps(dt) / eps(float32) + eps(dt) ·
// max |ref_p|, where e_p is the naive float32 layer's largest error against the reference on the
// same problem (in float64 the naive layer is the reference's own loops, so its error says
// nothing; the error bound of the same algorithm scales with the unit roundoff). 4 = the
// kernel's factor 2 (tests/test_util.h) times 2 for the products on either side of the
// attention, whose BLAS sums round differently from the naive loop's.
std::vector<double> tolerances(const Parts& naive32, const Parts& ref32, const Parts& ref, DType dt) {
  std::vector<double> tol;
  for (size_t p = 0; p < ref.values.size(); ++p) {
    tol.push_back(4 * max_diff(naive32.values[p], ref32.values[p]) * eps(dt) / eps(kF32) +
                  eps(dt) * max_abs(ref.values[p]));
  }
  return tol;
}

// A 16-bit layer (bfloat16, float16) against the float64 reference layer on the same inputs.
// The bound: the fast layer and the naive one (kNaive, the same precision) round the same
// intermediates to dt where sdpa/mha.h says (q, k, v, the heads; dheads, dq, dk, dv), each
// within eps(dt)/2 relative, which dominates their error against the reference (which rounds
// only its results): their float32 sums add about K · eps(float32) relative, 2^-24 · K, far
// below 2^-9 at these K. The fast layer's float32 sums, summed in another order, can land on
// the other side of a rounding of dt, so its error has the naive one's size, not its value:
//   tol_p = 4 · max|naive_p - ref_p| + eps(dt) · max|ref_p|
// 4 as for the float32 layer (tolerances() above: the kernel's 2 times 2 for the products on
// either side of it), and one unit of dt in the last place of the largest result for the
// final rounding of y or a gradient (a float32 sum near a tie of dt rounds either way).
void expect_16bit_fast_matches_reference(const LayerCase& c) {
  for (DType dt : {kBF16, kF16}) {
    for (sdpa::Precision precision : {sdpa::Precision::kExact, sdpa::Precision::kFast}) {
      for (Layout layout : {Layout::kContiguous, Layout::kPadded}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + (precision == sdpa::Precision::kFast ? " kFast" : " kExact") +
                     (layout == Layout::kPadded ? " padded" : " contiguous"));
        const Layer L = make_layer(c, dt, layout, 23);
        const GuardedTensor dy = make_dy(L, 24);
        sdpa::Options o = options_of(c, Backend::kAuto);
        o.precision = precision;
        const Parts fast = run(L, o, dy, layout);
        o.backend = Backend::kNaive;
        const Parts naive = run(L, o, dy);
        o.backend = Backend::kReference;
        const Parts ref = run(L, o, dy);
        ASSERT_EQ(fast.names, ref.names);
        for (size_t p = 0; p < ref.values.size(); ++p) {
          const double tol = 4 * max_diff(naive.values[p], ref.values[p]) + eps(dt) * max_abs(ref.values[p]);
          EXPECT_TRUE(all_close(ref.names[p].c_str(), fast.values[p], ref.values[p], tol));
        }
      }
    }
  }
}

void expect_fast_matches_reference(const LayerCase& c) {
  expect_16bit_fast_matches_reference(c);
  const Layer L32 = make_layer(c, kF32, Layout::kContiguous, 21);
  const GuardedTensor dy32 = make_dy(L32, 22);
  const Parts naive32 = run(L32, options_of(c, Backend::kNaive), dy32);
  const Parts ref32 = run(L32, options_of(c, Backend::kReference), dy32);
  for (DType dt : {kF32, kF64}) {
    for (Layout layout : {Layout::kContiguous, Layout::kPadded}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (layout == Layout::kPadded ? " padded" : " contiguous"));
      const Layer L = make_layer(c, dt, layout, 21);
      const GuardedTensor dy = make_dy(L, 22);
      const Parts fast = run(L, options_of(c, Backend::kAuto), dy, layout);
      const Parts ref = run(L, options_of(c, Backend::kReference), dy);
      ASSERT_EQ(fast.names, ref.names);
      const std::vector<double> tol = tolerances(naive32, ref32, ref, dt);
      for (size_t p = 0; p < ref.values.size(); ++p) {
        EXPECT_TRUE(all_close(ref.names[p].c_str(), fast.values[p], ref.values[p], tol[p]));
      }
    }
  }
}

TEST_P(LayerTest, FastMatchesReference) { expect_fast_matches_reference(GetParam()); }

// The same where AVX-512 is disabled (the kernel on AVX2; OpenBLAS, when this process loads it
// here, with its Haswell kernels): what a CPU without AVX-512 gets.
TEST_P(LayerTest, FastMatchesReferenceOnAvx2) {
  const std::string skip = avx2_pass_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  Avx2Only avx2;
  expect_fast_matches_reference(GetParam());
}

// The fast layer's forward and backward on 1 and 2 threads: the same bits (float32; bfloat16
// in both precisions).
void expect_bitwise_for_any_thread_count(const LayerCase& c, uint32_t seed) {
  for (auto [dt, precision] : {std::pair{kF32, sdpa::Precision::kExact}, std::pair{kBF16, sdpa::Precision::kExact},
                               std::pair{kBF16, sdpa::Precision::kFast}}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + (precision == sdpa::Precision::kFast ? " kFast" : ""));
    const Layer L = make_layer(c, dt, Layout::kContiguous, seed);
    const GuardedTensor dy = make_dy(L, seed + 1);
    sdpa::Options o = options_of(c, Backend::kAuto);
    o.precision = precision;
    sdpa::set_num_threads(1);
    const Parts one = run(L, o, dy);
    sdpa::set_num_threads(2);
    const Parts two = run(L, o, dy);
    sdpa::set_num_threads(0);
    for (size_t p = 0; p < one.values.size(); ++p) {
      EXPECT_TRUE(all_close(one.names[p].c_str(), two.values[p], one.values[p], 0.0));
    }
  }
}

TEST_P(LayerTest, BitwiseForAnyThreadCount) { expect_bitwise_for_any_thread_count(GetParam(), 31); }

INSTANTIATE_TEST_SUITE_P(Cases, LayerTest, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<LayerCase>& i) { return std::string(i.param.name); });

// Loading OpenBLAS (at the first product) leaves the kernels' thread count as it was: OpenBLAS
// built for OpenMP sets OpenMP's count when told to use one thread (src/layer/blas.cc).
TEST(Layer, LoadingTheBlasKeepsTheThreadCount) {
  const int before = sdpa::num_threads();
  const Layer L = make_layer(kCases[0], kF32, Layout::kContiguous, 33);
  GuardedTensor y(kF32, L.xq.shape());
  sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {y.view()});
  EXPECT_EQ(sdpa::num_threads(), before);
}

// Large enough that OpenBLAS splits its products across threads: still the same bits.
TEST(Layer, BitwiseForAnyThreadCountLarge) {
  const LayerCase c{"large", 2, 300, 300, 128, 4, 2, 32, 32, 128, 128, 0, true, true, Causal::kBottomRight, 0, 0.0};
  expect_bitwise_for_any_thread_count(c, 35);
}

// The float32 layer's reference backend computes in float64 and writes the weights and
// statistics through float64 shadows: exactly the float64 layer's on the same values, rounded.
TEST(Layer, ReferenceWeightsAndStatsOfAFloat32LayerAreTheFloat64OnesRounded) {
  const LayerCase& c = kCases[2];  // cross-attention, a float mask with empty rows
  const Layer L32 = make_layer(c, kF32, Layout::kContiguous, 45);
  Layer L64 = make_layer(c, kF64, Layout::kContiguous, 45);  // then the float32 layer's values
  for (size_t p = 0; p < L64.w.size(); ++p) L64.w[p].set_values(L32.w[p].values());
  L64.xq.set_values(L32.xq.values());
  L64.xk->set_values(L32.xk->values());
  L64.xv->set_values(L32.xv->values());
  L64.mask->set_values(L32.mask->values());
  std::vector<double> got[2];
  for (const Layer* L : {&L32, static_cast<const Layer*>(&L64)}) {
    const DType dt = L->xq.dtype();
    GuardedTensor y(dt, L->xq.shape()), w(dt, {c.B, c.Hq, c.Nq, c.Nk}, Layout::kPadded, false),
        h(dt, {c.B, c.Hq, c.Nq});
    sdpa::MultiHeadOutputs out{y.view(), w.view()};
    out.stats.entropy = h.view();
    sdpa::multi_head_attention(L->cfg, L->weights(), L->inputs(), out, options_of(c, Backend::kReference));
    EXPECT_TRUE(w.guards_intact());
    std::vector<double>& g = got[dt == kF64];
    g = w.values();
    for (double e : h.values()) g.push_back(e);
  }
  for (double& x : got[1]) x = static_cast<float>(x);
  EXPECT_TRUE(all_close("weights and entropy", got[0], got[1], 0.0));
}

// Inputs given through negative strides (the batch's rows backwards) give the same bits.
TEST(Layer, NegativeStrideInputs) {
  const LayerCase& c = kCases[2];
  const Layer L = make_layer(c, kF32, Layout::kContiguous, 41);
  GuardedTensor y1(kF32, L.xq.shape()), y2(kF32, L.xq.shape());
  const sdpa::Options o = options_of(c, Backend::kAuto);
  sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {y1.view()}, o);
  // The same x_q stored with its rows reversed, read through a negative row stride.
  GuardedTensor rev(kF32, L.xq.shape());
  const int64_t N = c.Nq, E = c.E;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t e = 0; e < E; ++e) rev.set((b * N + (N - 1 - i)) * E + e, L.xq.get((b * N + i) * E + e));
  sdpa::MultiHeadInputs in = L.inputs();
  sdpa::TensorView v = rev.view();
  v.data = static_cast<float*>(v.data) + (N - 1) * E;
  v.strides[1] = -E;
  in.x_q = v;
  sdpa::multi_head_attention(L.cfg, L.weights(), in, {y2.view()}, o);
  EXPECT_TRUE(all_close("y", y2.values(), y1.values(), 0.0));
}

// step(): two sequences decoded together, in chunks of 1, 4, 1 and 7 tokens, against the
// full causal forward of the reference layer on the whole 13 tokens.
TEST(Layer, StepMatchesFullForward) {
  for (DType dt : {kF32, kF64, kBF16, kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const LayerCase c{"step", 2, 13, 13, 32, 4, 2, 8, 8, 32, 32, 0, true, true, Causal::kBottomRight, 0, 0.0};
    Layer L = make_layer(c, dt, Layout::kContiguous, 51);
    L.pos_q = L.pos_k = 0;
    Layer L32 = make_layer(c, kF32, Layout::kContiguous, 51);
    L32.pos_q = L32.pos_k = 0;
    GuardedTensor ref(dt, L.xq.shape()), ref32(kF32, L.xq.shape()), naive32(kF32, L.xq.shape());
    sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {ref.view()}, options_of(c, Backend::kReference));
    sdpa::multi_head_attention(L32.cfg, L32.weights(), L32.inputs(), {ref32.view()}, options_of(c, Backend::kReference));
    sdpa::multi_head_attention(L32.cfg, L32.weights(), L32.inputs(), {naive32.view()}, options_of(c, Backend::kNaive));
    sdpa::KVCache cache(8, 4, c.Hkv, c.Dk, c.Dv, dt);
    const std::vector<int64_t> seqs = {cache.new_sequence(), cache.new_sequence()};
    std::vector<double> got(ref.numel());
    int64_t at = 0;
    for (int64_t n : {1, 4, 1, 7}) {
      GuardedTensor x(dt, {c.B, n, c.E}), y(dt, {c.B, n, c.E});
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t e = 0; e < c.E; ++e) x.set((b * n + i) * c.E + e, L.xq.get((b * c.Nq + at + i) * c.E + e));
      sdpa::multi_head_attention_step(L.cfg, L.weights(), x.view(), cache, seqs, y.view());
      EXPECT_TRUE(y.guards_intact());
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t e = 0; e < c.E; ++e) got[(b * c.Nq + at + i) * c.E + e] = y.get((b * n + i) * c.E + e);
      at += n;
    }
    EXPECT_EQ(cache.length(seqs[0]), 13);
    double tol = tolerances({{"y"}, {naive32.values()}}, {{"y"}, {ref32.values()}}, {{"y"}, {ref.values()}}, dt)[0];
    if (dt == kBF16 || dt == kF16) {  // the 16-bit layer's rule (expect_16bit_fast_matches_reference)
      GuardedTensor naive(dt, L.xq.shape());
      sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {naive.view()}, options_of(c, Backend::kNaive));
      tol = 4 * max_diff(naive.values(), ref.values()) + eps(dt) * max_abs(ref.values());
    }
    EXPECT_TRUE(all_close("y", got, ref.values(), tol));
  }
}

// The values of n elements of dtype dt stored in `bytes` (a MultiHeadSaved buffer), in order.
std::vector<double> saved_values(const std::vector<std::byte>& bytes, DType dt, int64_t n) {
  GuardedTensor t(dt, {n});
  EXPECT_EQ(bytes.size(), static_cast<size_t>(n * sdpa::dtype_size(dt)));
  std::memcpy(t.view().data, bytes.data(), bytes.size());
  return t.values();
}

// A 16-bit layer rounds where sdpa/mha.h says, bit for bit: its q, k and v are the float32
// layer's on the same values (computed by the same products) rounded once after RoPE, not
// before it; its heads are the kernel's output on them with the precision given (kExact and
// kFast differ); its backward passes the precision to the kernel too.
TEST(Layer, SixteenBitLayerRoundsOnceAfterRopeAndPassesThePrecision) {
  const LayerCase& c = kCases[1];  // causal, RoPE from position 3, GQA; Hq·Dv = 32: unpadded rows
  for (DType dt : {kBF16, kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Layer L = make_layer(c, dt, Layout::kContiguous, 71);
    Layer L32 = make_layer(c, kF32, Layout::kContiguous, 71);  // then L's values, exactly
    for (size_t p = 0; p < L.w.size(); ++p) L32.w[p].set_values(L.w[p].values());
    L32.xq.set_values(L.xq.values());
    sdpa::MultiHeadSaved s32;
    GuardedTensor y32(kF32, L.xq.shape());
    sdpa::multi_head_attention(L32.cfg, L32.weights(), L32.inputs(), {y32.view()}, options_of(c, Backend::kAuto), &s32);
    const int64_t nq = c.B * c.Hq * c.Nq * c.Dk, nk = c.B * c.Hkv * c.Nk * c.Dk, nv = c.B * c.Hkv * c.Nk * c.Dv;
    std::vector<double> heads[2];
    for (sdpa::Precision precision : {sdpa::Precision::kExact, sdpa::Precision::kFast}) {
      const bool fast = precision == sdpa::Precision::kFast;
      SCOPED_TRACE(fast ? "kFast" : "kExact");
      sdpa::Options o = options_of(c, Backend::kAuto);
      o.precision = precision;
      sdpa::MultiHeadSaved s;
      GuardedTensor y(dt, L.xq.shape());
      sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {y.view()}, o, &s);
      ASSERT_EQ(s.dtype, dt);
      const std::vector<std::byte>* mine[3] = {&s.q, &s.k, &s.v};
      const std::vector<std::byte>* f32[3] = {&s32.q, &s32.k, &s32.v};
      const int64_t n[3] = {nq, nk, nv};
      const char* names[3] = {"q", "k", "v"};
      std::vector<GuardedTensor> stored;  // q, k, v head-major in dt
      const std::vector<int64_t> shapes[3] = {{c.B, c.Hq, c.Nq, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dk}, {c.B, c.Hkv, c.Nk, c.Dv}};
      for (int i = 0; i < 3; ++i) {
        GuardedTensor rounded(dt, {n[i]});
        rounded.set_values(saved_values(*f32[i], kF32, n[i]));  // set() rounds to dt once (a float32 value)
        const std::vector<double> got = saved_values(*mine[i], dt, n[i]);
        EXPECT_TRUE(all_close(names[i], got, rounded.values(), 0.0));
        stored.emplace_back(dt, shapes[i]);
        stored.back().set_values(got);
      }
      // The kernel on those q, k, v: its out (B, Hq, Nq, Dv) is the saved heads (B·Nq rows of Hq·Dv).
      GuardedTensor out(dt, {c.B, c.Hq, c.Nq, c.Dv});
      sdpa::Options ko;
      ko.causal = c.causal;
      ko.precision = precision;
      sdpa::attention({stored[0].view(), stored[1].view(), stored[2].view()}, {out.view()}, ko);
      const std::vector<double> h = saved_values(s.heads, dt, c.B * c.Nq * c.Hq * c.Dv);
      std::vector<double> want(h.size());
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t hh = 0; hh < c.Hq; ++hh)
          for (int64_t i = 0; i < c.Nq; ++i)
            for (int64_t e = 0; e < c.Dv; ++e)
              want[((b * c.Nq + i) * c.Hq + hh) * c.Dv + e] = out.get(((b * c.Hq + hh) * c.Nq + i) * c.Dv + e);
      EXPECT_TRUE(all_close("heads", h, want, 0.0));
      heads[fast] = h;
    }
    EXPECT_FALSE(all_close("heads of kExact and kFast", heads[1], heads[0], 0.0)) << "the precision reached no kernel";
    // The backward of one kExact forward, in either precision: different gradients.
    sdpa::MultiHeadSaved s;
    GuardedTensor y(dt, L.xq.shape());
    sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {y.view()}, options_of(c, Backend::kAuto), &s);
    const GuardedTensor dy = make_dy(L, 72);
    std::vector<double> dx[2];
    for (sdpa::Precision precision : {sdpa::Precision::kExact, sdpa::Precision::kFast}) {
      sdpa::Options o = options_of(c, Backend::kAuto);
      o.precision = precision;
      GuardedTensor g(dt, L.xq.shape());
      sdpa::multi_head_attention_backward(L.cfg, L.weights(), L.inputs(), s, dy.view(), {g.view()}, o);
      dx[precision == sdpa::Precision::kFast] = g.values();
    }
    EXPECT_FALSE(all_close("dx_q of kExact and kFast", dx[1], dx[0], 0.0)) << "the backward's precision reached no kernel";
  }
}

TEST(Layer, OwningLayerInitialisesAsTorch) {
  sdpa::MultiHeadConfig cfg;
  cfg.d_model = 64, cfg.num_heads = 4;
  sdpa::MultiHeadAttention layer(cfg, kF32, 3);
  const sdpa::MultiHeadWeights w = layer.weights();
  const float* wq = static_cast<const float*>(w.w_q.data);
  const double bound = std::sqrt(6.0 / (64 + 3 * 64));  // Xavier-uniform on torch's (3E × E) in_proj_weight
  double lo = 0, hi = 0;
  for (int64_t i = 0; i < w.w_q.numel(); ++i) lo = std::min(lo, double(wq[i])), hi = std::max(hi, double(wq[i]));
  EXPECT_LE(hi, bound);
  EXPECT_GE(lo, -bound);
  EXPECT_GT(hi, 0.9 * bound);  // 4096 uniform draws reach within 10 % of the bound
  EXPECT_EQ(static_cast<const float*>(w.b_o->data)[5], 0.0f);
  // Its forward (causal) and step agree, within the rule of StepMatchesFullForward.
  GuardedTensor x(kF32, {1, 3, 64}), y(kF32, {1, 3, 64}), ref(kF32, {1, 3, 64}), naive(kF32, {1, 3, 64});
  std::mt19937 rng(1);
  fill_normal(x, rng);
  sdpa::Options o;
  o.causal = Causal::kBottomRight;
  for (auto [backend, out] : {std::pair{Backend::kReference, &ref}, std::pair{Backend::kNaive, &naive}}) {
    o.backend = backend;
    layer.forward({x.view()}, {out->view()}, o);
  }
  sdpa::KVCache cache = layer.make_cache(4, 16);
  layer.step(x.view(), cache, {cache.new_sequence()}, y.view());
  const double tol = tolerances({{"y"}, {naive.values()}}, {{"y"}, {ref.values()}}, {{"y"}, {ref.values()}}, kF32)[0];
  EXPECT_TRUE(all_close("y", y.values(), ref.values(), tol));
  // A bfloat16 layer: its parameters are bfloat16 (W_Q within the same bound), its forward takes
  // bfloat16 x and its cache is bfloat16.
  sdpa::MultiHeadAttention half(cfg, kBF16, 3);
  const sdpa::MultiHeadWeights hw = half.weights();
  EXPECT_EQ(hw.w_q.dtype, kBF16);
  EXPECT_EQ(hw.b_o->dtype, kBF16);
  GuardedTensor xh = x.converted(kBF16, Layout::kContiguous), yh(kBF16, {1, 3, 64}), sh(kBF16, {1, 3, 64});
  half.forward({xh.view()}, {yh.view()}, o);  // o: kNaive, causal
  sdpa::KVCache half_cache = half.make_cache(4, 16);
  EXPECT_EQ(half_cache.dtype(), kBF16);
  half.step(xh.view(), half_cache, {half_cache.new_sequence()}, sh.view());
  EXPECT_TRUE(yh.guards_intact());
  EXPECT_GT(max_abs(sh.values()), 0.0);
}

TEST(Layer, Errors) {
  const Layer L = make_layer(kCases[2], kF32, Layout::kContiguous, 61);
  GuardedTensor y(kF32, L.xq.shape());
  auto fwd = [&](const sdpa::MultiHeadConfig& cfg, const sdpa::MultiHeadWeights& w, const sdpa::MultiHeadInputs& in) {
    return [=, &y]() { sdpa::multi_head_attention(cfg, w, in, {y.view()}); };
  };
  sdpa::MultiHeadWeights w = L.weights();
  w.w_q = L.w[1].view();
  expect_sdpa_error(fwd(L.cfg, w, L.inputs()), {"w_q", "(12, 24)", "(24, 24)"});
  w = L.weights();
  w.b_o.reset();
  expect_sdpa_error(fwd(L.cfg, w, L.inputs()), {"b_o", "missing"});
  sdpa::MultiHeadInputs in = L.inputs();
  in.x_k.reset(), in.x_v.reset();
  expect_sdpa_error(fwd(L.cfg, L.weights(), in), {"kdim", "x_k"});
  in = L.inputs();
  in.x_v = L.xk->view();
  expect_sdpa_error(fwd(L.cfg, L.weights(), in), {"x_v", "(2, 13, 12)", "vdim"});
  const GuardedTensor x64 = L.xq.converted(kF64, Layout::kContiguous);
  in = L.inputs();
  in.x_q = x64.view();
  expect_sdpa_error(fwd(L.cfg, L.weights(), in), {"x_k", "float32", "float64"});
  const GuardedTensor xh = L.xq.converted(kBF16, Layout::kContiguous);
  const GuardedTensor xkh = L.xk->converted(kBF16, Layout::kContiguous), xvh = L.xv->converted(kBF16, Layout::kContiguous);
  in.x_q = xh.view(), in.x_k = xkh.view(), in.x_v = xvh.view();  // bfloat16 inputs, float32 weights
  expect_sdpa_error(fwd(L.cfg, L.weights(), in), {"w_q", "float32", "expected bfloat16"});
  GuardedTensor xi(DType::kInt32, L.xq.shape());
  in.x_q = xi.view();
  expect_sdpa_error(fwd(L.cfg, L.weights(), in), {"x_q is int32", "float32, float64, bfloat16 or float16"});
  in = L.inputs();
  GuardedTensor bad_mask(DType::kBool, {3, 13});
  in.mask = bad_mask.view();
  expect_sdpa_error(fwd(L.cfg, L.weights(), in), {"mask", "(3, 13)"});
  sdpa::MultiHeadConfig cfg = L.cfg;
  cfg.num_kv_heads = 2;
  expect_sdpa_error(fwd(cfg, L.weights(), L.inputs()), {"num_kv_heads 2", "num_heads 3"});
  cfg = L.cfg;
  cfg.head_dim = 0;
  cfg.d_model = 25;
  expect_sdpa_error(fwd(cfg, L.weights(), L.inputs()), {"d_model 25", "num_heads 3", "head_dim"});
  cfg = L.cfg;
  cfg.rope = true;
  cfg.head_dim = 7;
  expect_sdpa_error(fwd(cfg, L.weights(), L.inputs()), {"rope", "even", "7"});
  GuardedTensor wrong_y(kF32, {2, 7, 23});
  expect_sdpa_error([&] { sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {wrong_y.view()}); },
                    {"y", "(2, 7, 23)", "(2, 7, 24)"});
  EXPECT_TRUE(y.untouched());
  EXPECT_TRUE(wrong_y.untouched());

  // Backward: saved from another problem, gradients of the wrong shape.
  sdpa::MultiHeadSaved saved;
  sdpa::multi_head_attention(L.cfg, L.weights(), L.inputs(), {y.view()}, {}, &saved);
  GuardedTensor dx(kF32, L.xq.shape()), dw(kF32, {3, 3});
  sdpa::MultiHeadGradients g{dx.view()};
  g.dw_q = dw.view();
  expect_sdpa_error([&] { sdpa::multi_head_attention_backward(L.cfg, L.weights(), L.inputs(), saved, y.view(), g); },
                    {"dw_q", "(3, 3)", "(24, 24)"});
  sdpa::MultiHeadSaved other = saved;
  other.nq = 3;
  g.dw_q.reset();
  expect_sdpa_error([&] { sdpa::multi_head_attention_backward(L.cfg, L.weights(), L.inputs(), other, y.view(), g); },
                    {"saved", "Nq 3", "Nq 7"});
  expect_sdpa_error(
      [&] {
        sdpa::multi_head_attention_backward(L.cfg, L.weights(), L.inputs(), saved, y.view(), g,
                                            options_of(kCases[0], Backend::kReference));
      },
      {"saved", "float32", "float64"});
  EXPECT_TRUE(dx.untouched());

  // A forward whose scores overflowed (lse = +inf) has no gradient: Error, and no gradient written.
  Layer big = make_layer(kCases[0], kF32, Layout::kContiguous, 62);
  for (int64_t i = 0; i < big.xq.numel(); ++i) big.xq.set(i, 1e20);
  for (GuardedTensor* t : {&big.w[0], &big.w[1], &big.w[4], &big.w[5]})  // q, k > 0: every score +inf
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, std::abs(t->get(i)));
  GuardedTensor ybig(kF32, big.xq.shape()), dxb(kF32, big.xq.shape()), dwo(kF32, big.w[3].shape()),
      dbo(kF32, big.w[7].shape());
  sdpa::multi_head_attention(big.cfg, big.weights(), big.inputs(), {ybig.view()}, {}, &saved);
  sdpa::MultiHeadGradients gb{dxb.view()};
  gb.dw_o = dwo.view();
  gb.db_o = dbo.view();
  expect_sdpa_error([&] { sdpa::multi_head_attention_backward(big.cfg, big.weights(), big.inputs(), saved, ybig.view(), gb); },
                    {"lse"});
  EXPECT_TRUE(dxb.untouched());
  EXPECT_TRUE(dwo.untouched());
  EXPECT_TRUE(dbo.untouched());

  // step: duplicate sequences, a full cache, a cache of other heads; nothing appended.
  sdpa::MultiHeadConfig sc;
  sc.d_model = 16, sc.num_heads = 2, sc.rope = true;
  sdpa::MultiHeadAttention layer(sc);
  sdpa::KVCache cache = layer.make_cache(2, 2);
  const int64_t s0 = cache.new_sequence(), s1 = cache.new_sequence();
  GuardedTensor x(kF32, {2, 3, 16}), ys(kF32, {2, 3, 16});
  expect_sdpa_error([&] { layer.step(x.view(), cache, {s0, s0}, ys.view()); }, {"sequence 0", "twice"});
  expect_sdpa_error([&] { layer.step(x.view(), cache, {s0, s1}, ys.view()); }, {"2 free pages", "need 4"});
  sdpa::KVCache other_cache(4, 2, 1, 8, 8, kF32);
  other_cache.new_sequence(), other_cache.new_sequence();
  expect_sdpa_error([&] { layer.step(x.view(), other_cache, {0, 1}, ys.view()); }, {"cache", "Hkv 1", "Hkv 2"});
  // Options the paged call refuses (sinks for 3 heads, not 2) are refused before appending.
  sdpa::KVCache roomy = layer.make_cache(8, 2);
  const std::vector<int64_t> both = {roomy.new_sequence(), roomy.new_sequence()};
  std::vector<float> sinks(3, 0.0f);
  sdpa::Options bad;
  bad.sinks = sdpa::TensorView::contiguous(sinks.data(), kF32, {3});
  expect_sdpa_error([&] { layer.step(x.view(), roomy, both, ys.view(), bad); }, {"sinks", "(3,)"});
  EXPECT_EQ(roomy.length(both[0]), 0);
  EXPECT_EQ(roomy.free_pages(), 8);
  EXPECT_EQ(cache.length(s0), 0);
  EXPECT_TRUE(ys.untouched());
}

}  // namespace
