// Outputs::stats (attention.h): the fused forward's per-row statistics (its tile, decode and
// key-chunk paths; every dtype; the AVX2 pass too) against kReference's, which computes them
// from each row's weights by their definitions, with tolerances from kNaive's error as the
// tolerance rule derives them (oracle/tolerance.h); bit for bit against the call's own weights output;
// the header's edges (ties, fully masked, one-hot, overflowed and NaN rows, sinks); thread
// invariance; errors that name the argument.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

// An int64 output, C order, in a plain vector (GuardedTensor holds floats and bools).
struct IntOut {
  std::vector<int64_t> data;
  std::vector<int64_t> shape;
  sdpa::TensorView view() {
    sdpa::TensorView v;
    v.data = data.data();
    v.dtype = DType::kInt64;
    v.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = v.rank - 1; d >= 0; --d) {
      v.shape[d] = shape[static_cast<size_t>(d)];
      v.strides[d] = stride;
      stride *= shape[static_cast<size_t>(d)];
    }
    return v;
  }
};

// One call's results: out, weights, lse and every statistic, as doubles / int64 in C order.
struct StatValues {
  Values base;
  std::vector<double> entropy, normalized, max_weight, topk_w;
  std::vector<int64_t> allowed, argmax, topk_i;
  int64_t rows = 0, k = 0, Nk = 0;
};

StatValues run_stats(const Tensors& t, const sdpa::Options& o, int64_t k, Layout layout = Layout::kContiguous) {
  const DType dt = t.q.dtype(), ct = compute_dtype(dt);
  std::vector<int64_t> rows = t.q.shape();
  rows.pop_back();
  std::vector<int64_t> topk_shape = rows;
  topk_shape.push_back(k);
  std::vector<int64_t> out_shape = rows, w_shape = rows;
  out_shape.push_back(t.v.shape().back());
  w_shape.push_back(t.k.shape()[t.k.rank() - 2]);
  Outs outs{GuardedTensor(dt, out_shape, layout), GuardedTensor(ct, w_shape, layout, false),
            GuardedTensor(ct, rows, layout, false)};
  GuardedTensor entropy(ct, rows, layout, false), normalized(ct, rows, layout, false), max_weight(ct, rows, layout, false),
      topk_w(ct, topk_shape, layout, false);
  int64_t n = 1;
  for (int64_t x : rows) n *= x;
  IntOut allowed{std::vector<int64_t>(static_cast<size_t>(n), -7), rows};
  IntOut argmax{std::vector<int64_t>(static_cast<size_t>(n), -7), rows};
  IntOut topk_i{std::vector<int64_t>(static_cast<size_t>(n * k), -7), topk_shape};
  sdpa::Outputs outputs = outs.outputs();
  outputs.stats.allowed = allowed.view();
  outputs.stats.entropy = entropy.view();
  outputs.stats.entropy_normalized = normalized.view();
  outputs.stats.max_weight = max_weight.view();
  outputs.stats.argmax = argmax.view();
  if (k > 0) {
    outputs.stats.topk_weights = topk_w.view();
    outputs.stats.topk_indices = topk_i.view();
  }
  sdpa::attention(t.inputs(), outputs, o);
  EXPECT_TRUE(outs.guards_intact());
  for (const GuardedTensor* g : {&entropy, &normalized, &max_weight, &topk_w}) EXPECT_TRUE(g->guards_intact());
  StatValues v{values(outs), entropy.values(), normalized.values(), max_weight.values(), topk_w.values(),
               allowed.data, argmax.data, topk_i.data, n, k, w_shape.back()};
  return v;
}

// Per row: -Σ w log w, and the spread Σ w |log w - mean| of the log-weights (how far a score
// error moves the entropy: dH = -Cov_w(s, δs), at most max|δs| times this), from weights.
void entropy_of(const std::vector<double>& w, int64_t rows, int64_t Nk, std::vector<double>& H, double& max_spread) {
  H.assign(static_cast<size_t>(rows), 0.0);
  max_spread = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = w.data() + r * Nk;
    double h = 0, mass = 0, mean = 0, spread = 0;
    for (int64_t j = 0; j < Nk; ++j) {
      if (row[j] > 0) h -= row[j] * std::log(row[j]), mass += row[j], mean += row[j] * std::log(row[j]);
    }
    if (mass > 0) mean /= mass;
    for (int64_t j = 0; j < Nk; ++j) {
      if (row[j] > 0) spread += row[j] * std::abs(std::log(row[j]) - mean);
    }
    H[static_cast<size_t>(r)] = h;
    max_spread = std::max(max_spread, spread);
  }
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (size_t x = 0; x < a.size(); ++x) {
    if (std::isnan(a[x]) != std::isnan(b[x])) return INFINITY;
    if (!std::isnan(a[x])) e = std::max(e, std::abs(a[x] - b[x]));
  }
  return e;
}

// The statistics of `got` (kFlash or kAuto) against kReference's, the tolerances from kNaive's
// error (oracle/tolerance.h's rule: factor · naive error + floor), and against got's own weights bit
// for bit. Rows have no NaN here.
void expect_stats_match(const Tensors& t, const sdpa::Options& options, const StatValues& got) {
  sdpa::Options o = options;
  o.backend = Backend::kReference;
  const StatValues ref = run_stats(t, o, got.k);
  // kNaive's error sets the tolerance; for float64, kNaive in float32 scaled by the eps ratio.
  const bool f64 = t.q.dtype() == kF64;
  std::optional<Tensors> f32;
  if (f64) f32.emplace(t.converted(kF32));
  const Tensors& naive_in = f64 ? *f32 : t;
  const StatValues naive_ref = f64 ? run_stats(naive_in, o, got.k) : ref;
  o.backend = Backend::kNaive;
  const StatValues naive = run_stats(naive_in, o, got.k);
  const double factor = f64 ? 3 : 2, ratio = f64 ? DBL_EPSILON / FLT_EPSILON : 1.0;
  const double e = eps(compute_dtype(t.q.dtype())), S2 = 2 * max_score_magnitude(t, options);
  const double tol_w = factor * ratio * max_diff(naive.base.weights, naive_ref.base.weights) + e * std::max(4.0, S2);
  std::vector<double> H_def;
  double spread = 0;
  entropy_of(ref.base.weights, ref.rows, ref.Nk, H_def, spread);
  const double H_max = *std::max_element(H_def.begin(), H_def.end());
  const double tol_h = factor * ratio * max_diff(naive.entropy, naive_ref.entropy) + e * std::max(4 * (1 + H_max), S2 * spread);
  // kReference's entropy is its weights' -Σ w log w (the definition, computed here again).
  // (Both from weights stored in the compute type: each off by eps/2 relative, moving H by eps (1 + H).)
  EXPECT_TRUE(all_close("reference entropy", ref.entropy, H_def, 4 * e * (1 + H_max)));
  EXPECT_TRUE(all_close("entropy", got.entropy, ref.entropy, tol_h));
  EXPECT_TRUE(all_close("entropy_normalized", got.normalized, ref.normalized, tol_h / std::log(2.0)));
  EXPECT_TRUE(all_close("max_weight", got.max_weight, ref.max_weight, tol_w));
  const Dims d = dims_of(t);
  const auto at = [](const std::vector<double>& x, int64_t row, int64_t n, int64_t j) { return x[static_cast<size_t>(row * n + j)]; };
  for (int64_t r = 0; r < got.rows; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    // allowed: the header's rule written out here (causal, window, length, the mask's -inf).
    const int64_t b = r / (d.Hq * d.Nq), h = r / d.Nq % d.Hq, i = r % d.Nq;
    int64_t allowed = 0;
    for (int64_t j = 0; j < d.Nk; ++j) allowed += key_allowed(t, options, b, i, j) && mask_bias(t, b, h, i, j) != -kInf;
    ASSERT_EQ(got.allowed[static_cast<size_t>(r)], allowed);
    ASSERT_EQ(ref.allowed[static_cast<size_t>(r)], allowed);
    const int64_t am = got.argmax[static_cast<size_t>(r)];
    if (allowed == 0) {
      EXPECT_EQ(am, -1);
      EXPECT_EQ(got.max_weight[static_cast<size_t>(r)], 0.0);
      EXPECT_EQ(got.entropy[static_cast<size_t>(r)], 0.0);
    } else {
      ASSERT_GE(am, 0);
      // Bit for bit the weights output there; the key's exact weight within tolerance of the max.
      EXPECT_EQ(got.max_weight[static_cast<size_t>(r)], at(got.base.weights, r, got.Nk, am));
      EXPECT_GE(at(ref.base.weights, r, got.Nk, am), ref.max_weight[static_cast<size_t>(r)] - tol_w);
    }
    if (allowed <= 1) {
      EXPECT_EQ(got.normalized[static_cast<size_t>(r)], 0.0);
    }
    std::vector<int64_t> seen;
    for (int64_t x = 0; x < got.k; ++x) {
      const int64_t j = got.topk_i[static_cast<size_t>(r * got.k + x)];
      const double w = got.topk_w[static_cast<size_t>(r * got.k + x)];
      if (x >= allowed) {
        EXPECT_EQ(j, -1);
        EXPECT_EQ(w, 0.0);
        continue;
      }
      ASSERT_GE(j, 0);
      ASSERT_LT(j, d.Nk);
      EXPECT_EQ(std::count(seen.begin(), seen.end(), j), 0) << "key " << j << " twice";
      seen.push_back(j);
      EXPECT_EQ(w, at(got.base.weights, r, got.Nk, j)) << "top " << x;
      if (x > 0) {
        EXPECT_LE(w, got.topk_w[static_cast<size_t>(r * got.k + x - 1)]);
      }
      EXPECT_NEAR(at(ref.base.weights, r, got.Nk, j), ref.topk_w[static_cast<size_t>(r * got.k + x)], tol_w) << "top " << x;
    }
    if (got.k > 0 && allowed > got.k) {  // no key left out weighs more than the k-th
      const double kth = got.topk_w[static_cast<size_t>(r * got.k + got.k - 1)];
      for (int64_t j = 0; j < d.Nk; ++j) {
        if (std::count(seen.begin(), seen.end(), j) == 0) {
          ASSERT_LE(at(got.base.weights, r, got.Nk, j), kth) << "key " << j;
        }
      }
    }
  }
}

struct Case {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  DType dtype;
  int64_t k;
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  DType mask = DType::kInt32;  // kBool or kFloat32 for a (B, Hq, Nq, Nk) mask; kInt32: none
  double dropout = 0;
  bool mods = false;  // softcap, ALiBi and sinks
  std::vector<int64_t> seqlens = {};
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// The kernel's paths: tiles of query rows (AVX-512: 32 rows a block), the few-rows decode kernel
// (Nq · group <= 8), key chunks merged (few blocks and Nk >= 2048), and both with a top k.
const Case kCases[] = {
    {"tiles_gqa", 2, 4, 2, 97, 300, 32, 24, kF32, 8},
    {"tiles_causal_bool_mask_f64", 1, 2, 2, 65, 129, 16, 16, kF64, 5, Causal::kBottomRight, {}, DType::kBool},
    {"decode_gqa_top32", 2, 8, 2, 1, 1025, 64, 64, kF32, 32},
    {"decode_key_chunks", 1, 2, 1, 1, 5000, 32, 32, kF32, 8, Causal::kNone, {}, DType::kFloat32},
    {"tiles_key_chunks_window", 1, 1, 1, 40, 4500, 16, 16, kF32, 4, Causal::kNone, {3000, 100}},
    {"bf16_modifiers_float_mask", 1, 2, 1, 33, 77, 8, 5, kBF16, 3, Causal::kNone, {}, DType::kFloat32, 0, true},
    {"bf16_tiles", 1, 2, 2, 64, 300, 64, 64, kBF16, 8},
    {"f16_dropout_top_left_window", 1, 2, 2, 50, 70, 16, 16, kF16, 1, Causal::kTopLeft, {20, 3}, DType::kInt32, 0.3},
    {"fewer_keys_than_k", 1, 3, 1, 20, 3, 8, 8, kF32, 8},
    {"seqlens_f64_decode", 2, 2, 1, 3, 40, 8, 8, kF64, 4, Causal::kBottomRight, {}, DType::kInt32, 0, false, {40, 0}},
    {"no_topk_sinks", 1, 3, 3, 17, 33, 8, 8, kF32, 0, Causal::kNone, {}, DType::kInt32, 0, true},
};

Tensors make_case(const Case& c, sdpa::Options& o, std::vector<double>& slopes, std::vector<double>& sinks) {
  std::mt19937 rng(static_cast<unsigned>(std::hash<std::string>{}(c.name)));
  Tensors t{GuardedTensor(kF32, {c.B, c.Hq, c.Nq, c.Dk}), GuardedTensor(kF32, {c.B, c.Hkv, c.Nk, c.Dk}),
            GuardedTensor(kF32, {c.B, c.Hkv, c.Nk, c.Dv}), std::nullopt};
  fill_normal(t.q, rng, 1.5);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  if (c.mask != DType::kInt32) {
    t.mask.emplace(c.mask, std::vector<int64_t>{c.B, c.Hq, c.Nq, c.Nk});
    fill_mask(*t.mask, rng, 0.7, 0.1);
  }
  t.seqlens_k = c.seqlens;
  t = t.converted(c.dtype);
  o.causal = c.causal;
  o.window = c.window;
  if (c.dropout > 0) {
    o.dropout_p = c.dropout;
    o.seed = 11;
  }
  if (c.mods) {
    o.softcap = 2.5;
    for (int64_t h = 0; h < c.Hq; ++h) {
      slopes.push_back(std::exp2(-4.0 * static_cast<double>(h + 1) / static_cast<double>(c.Hq)));
      sinks.push_back(0.5 * static_cast<double>(h) - 0.5);
    }
    o.alibi_slopes = sdpa::TensorView::contiguous(slopes.data(), kF64, {c.Hq});
    o.sinks = sdpa::TensorView::contiguous(sinks.data(), kF64, {c.Hq});
  }
  return t;
}

class StatsSweep : public testing::TestWithParam<Case> {};

TEST_P(StatsSweep, MatchReferenceAndWeights) {
  const Case& c = GetParam();
  sdpa::Options o;
  std::vector<double> slopes, sinks;
  const Tensors t = make_case(c, o, slopes, sinks);
  const auto check = [&](Backend backend, Layout layout) {
    o.backend = backend;
    const StatValues got = run_stats(t, o, c.k, layout);
    expect_stats_match(t, o, got);
    return got;
  };
  const StatValues flash = check(Backend::kFlash, Layout::kPadded);
  // The statistics do not depend on the thread count, bit for bit (nor on the layout).
  sdpa::set_num_threads(1);
  o.backend = Backend::kFlash;
  const StatValues one = run_stats(t, o, c.k);
  sdpa::set_num_threads(0);
  const auto same_bits = [](const std::vector<double>& a, const std::vector<double>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](double x, double y) {
      return std::memcmp(&x, &y, sizeof x) == 0;
    });
  };
  EXPECT_TRUE(same_bits(flash.entropy, one.entropy));
  EXPECT_TRUE(same_bits(flash.normalized, one.normalized));
  EXPECT_TRUE(same_bits(flash.max_weight, one.max_weight));
  EXPECT_TRUE(same_bits(flash.topk_w, one.topk_w));
  EXPECT_EQ(flash.argmax, one.argmax);
  EXPECT_EQ(flash.topk_i, one.topk_i);
  EXPECT_EQ(flash.allowed, one.allowed);
  if (const std::string why = avx2_pass_skip_reason(); why.empty()) {
    SCOPED_TRACE("AVX2 only");
    const Avx2Only avx2;
    check(Backend::kFlash, Layout::kContiguous);
  }
}

// pooled_weights: the call's own weights summed over runs of keys (key j in run j · G / Nk) in
// key order in the compute type, bit for bit, for G below, at and above Nk; kReference's
// within the weights' tolerance times the run's length.
TEST_P(StatsSweep, PooledWeightsSumTheWeights) {
  const Case& c = GetParam();
  sdpa::Options o;
  std::vector<double> slopes, sinks;
  const Tensors t = make_case(c, o, slopes, sinks);
  const DType ct = compute_dtype(c.dtype);
  for (int64_t G : {int64_t{0}, int64_t{1}, int64_t{7}, c.Nk, c.Nk + 3}) {
    SCOPED_TRACE("G " + std::to_string(G));
    for (Backend backend : {Backend::kFlash, Backend::kReference}) {
      o.backend = backend;
      Outs outs{GuardedTensor(c.dtype, {c.B, c.Hq, c.Nq, c.Dv}), GuardedTensor(ct, {c.B, c.Hq, c.Nq, c.Nk}), std::nullopt};
      GuardedTensor pooled(ct, {c.B, c.Hq, c.Nq, G}, Layout::kPadded, false);
      sdpa::Outputs outputs = outs.outputs();
      outputs.stats.pooled_weights = pooled.view();
      sdpa::attention(t.inputs(), outputs, o);
      ASSERT_TRUE(pooled.guards_intact());  // G = 0: no runs, nothing written
      if (G == 0) continue;
      const std::vector<double> w = outs.weights->values(), got = pooled.values();
      std::vector<double> want(got.size(), 0.0);
      for (size_t r = 0; r < got.size() / static_cast<size_t>(G); ++r) {
        for (int64_t j = 0; j < c.Nk; ++j) {
          double& cell = want[r * static_cast<size_t>(G) + static_cast<size_t>(j * G / c.Nk)];
          cell = ct == kF32 ? static_cast<double>(static_cast<float>(cell) + static_cast<float>(w[r * static_cast<size_t>(c.Nk) + static_cast<size_t>(j)]))
                            : cell + w[r * static_cast<size_t>(c.Nk) + static_cast<size_t>(j)];
        }
      }
      if (backend == Backend::kFlash) {
        EXPECT_TRUE(all_close("pooled_weights", got, want, 0.0));
      } else {  // float64 sums rounded once: within a run's worth of float32 roundings
        EXPECT_TRUE(all_close("pooled_weights", got, want, eps(ct) * static_cast<double>(c.Nk / G + 2)));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Stats, StatsSweep, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// ---- The header's edges ----

// Every key at the same score (q = 0): entropy log(Nk), normalised 1, and the ties go to the
// lowest keys, in the tile, decode and key-chunk paths (chunks merge ties in key order).
TEST(Stats, TiesGoToTheLowerKey) {
  for (const auto& [Nq, Nk] : {std::pair<int64_t, int64_t>{1, 300}, {40, 300}, {1, 5000}, {40, 4500}}) {
    SCOPED_TRACE("Nq " + std::to_string(Nq) + ", Nk " + std::to_string(Nk));
    Tensors t{GuardedTensor(kF32, {1, 1, Nq, 8}), GuardedTensor(kF32, {1, 1, Nk, 8}), GuardedTensor(kF32, {1, 1, Nk, 8}),
              std::nullopt};
    std::mt19937 rng(3);
    t.q.set_values(std::vector<double>(static_cast<size_t>(Nq * 8), 0.0));
    fill_normal(t.k, rng);
    fill_normal(t.v, rng);
    sdpa::Options o;
    o.backend = Backend::kFlash;
    const StatValues got = run_stats(t, o, 6);
    for (int64_t r = 0; r < Nq; ++r) {
      EXPECT_NEAR(got.entropy[static_cast<size_t>(r)], std::log(static_cast<double>(Nk)), 1e-5 * std::log(Nk));
      EXPECT_NEAR(got.normalized[static_cast<size_t>(r)], 1.0, 1e-5);
      EXPECT_EQ(got.argmax[static_cast<size_t>(r)], 0);
      for (int64_t x = 0; x < 6; ++x) EXPECT_EQ(got.topk_i[static_cast<size_t>(r * 6 + x)], x);
    }
  }
}

// Exact scores with many ties (D = 1, q = 1, keys on a grid of halves: every score exact in
// float32 and float64), so the kernel's top keys must be kReference's stable order exactly, in
// every path: a row's first tile (where most scores are candidates and go through OfferTile's
// insertion network), later tiles (offers), decode rows, and key chunks merged. Scores such as
// {1, 1, 2} in the first tile: key 0 must stay above key 1 once 2 pushes them down.
TEST(Stats, TiedScoresKeepTheLowerKeyInEveryPath) {
  for (const auto& [Nq, Nk] : {std::pair<int64_t, int64_t>{16, 300}, {1, 300}, {1, 5000}, {40, 4500}, {16, 3}}) {
    Tensors t{GuardedTensor(kF32, {Nq, 1}), GuardedTensor(kF32, {Nk, 1}), GuardedTensor(kF32, {Nk, 1}), std::nullopt};
    t.q.set_values(std::vector<double>(static_cast<size_t>(Nq), 1.0));
    std::mt19937 rng(static_cast<unsigned>(Nk));
    std::vector<double> k(static_cast<size_t>(Nk));
    for (double& x : k) x = 0.5 * static_cast<double>(static_cast<int>(rng() % 9) - 4);
    if (Nk == 3) k = {1.0, 1.0, 2.0};
    t.k.set_values(k);
    t.v.set_values(k);
    for (int64_t topk : {2, 3, 8, 32}) {
      SCOPED_TRACE("Nq " + std::to_string(Nq) + ", Nk " + std::to_string(Nk) + ", k " + std::to_string(topk));
      sdpa::Options o;
      o.scale = 1.0;
      o.backend = Backend::kReference;
      const StatValues want = run_stats(t, o, topk);
      o.backend = Backend::kFlash;
      const StatValues got = run_stats(t, o, topk);
      EXPECT_EQ(got.topk_i, want.topk_i);
      EXPECT_EQ(got.argmax, want.argmax);
    }
  }
}

// The rank is the score's, not the weight's (issue 26 item 1): keys whose scores differ keep the
// scores' order where their weights are equal, (a) because they round to the same float32
// value (scores 0.3 and the next float32 above it: weights exp(-ulp) and 1, equal in float32) and
// (b) because they underflow to 0 (scores -10, -5, 0 beside 1000). A rule "by weight, ties to the
// lower key" would give argmax 0 and top-k [0, 1, 2] in (a), [3, 0, 1, 2] in (b). Every backend
// and path: decode rows (Nq = 1), tile rows, key chunks (Nk past a chunk), float32 and float64.
TEST(Stats, KeysAreRankedByScoreNotByRoundedWeight) {
  for (const DType dt : {kF32, kF64}) {
    for (const auto& [Nq, pad] : {std::pair<int64_t, int64_t>{1, 0}, {16, 0}, {1, 4997}, {40, 4497}}) {
      for (const int example : {0, 1}) {
        // Keys of the example first; `pad` keys of score -1e4 after them (weight 0, never ranked above).
        std::vector<double> keys = example == 0 ? std::vector<double>{0.3, std::nextafter(0.3f, 1.0f), 0.0}
                                                : std::vector<double>{-10.0, -5.0, 0.0, 1000.0};
        const std::vector<int64_t> want_top = example == 0 ? std::vector<int64_t>{1, 0, 2} : std::vector<int64_t>{3, 2, 1};
        if (dt == kF64 && example == 0) keys[1] = std::nextafter(0.3, 1.0);  // equal weights in float64 too
        const int64_t n = static_cast<int64_t>(keys.size()), Nk = n + pad;
        keys.resize(static_cast<size_t>(Nk), -1e4);
        Tensors t{GuardedTensor(dt, {Nq, 1}), GuardedTensor(dt, {Nk, 1}), GuardedTensor(dt, {Nk, 1}), std::nullopt};
        t.q.set_values(std::vector<double>(static_cast<size_t>(Nq), 1.0));
        t.k.set_values(keys);
        t.v.set_values(keys);
        for (const Backend backend : {Backend::kFlash, Backend::kReference, Backend::kNaive}) {
          SCOPED_TRACE(std::string(dt == kF32 ? "float32" : "float64") + ", example " + std::to_string(example) + ", Nq " +
                       std::to_string(Nq) + ", Nk " + std::to_string(Nk) + ", backend " +
                       std::to_string(static_cast<int>(backend)));
          sdpa::Options o;
          o.scale = 1.0;
          o.backend = backend;
          const StatValues got = run_stats(t, o, 3);
          for (int64_t r = 0; r < Nq; ++r) {
            const size_t row = static_cast<size_t>(r);
            if (example == 0 && backend != Backend::kReference) {  // the premise: equal weights in the compute type
              ASSERT_EQ(got.base.weights[row * Nk + 0], got.base.weights[row * Nk + 1]);
            }
            if (example == 1) {
              ASSERT_EQ(got.base.weights[row * Nk + 0], 0.0);
            }
            EXPECT_EQ(got.argmax[row], want_top[0]);
            for (size_t x = 0; x < 3; ++x) EXPECT_EQ(got.topk_i[row * 3 + x], want_top[x]) << "rank " << x;
            // max_weight and the top-k weights are the weights at those keys, bit for bit.
            EXPECT_EQ(got.max_weight[row], got.base.weights[row * Nk + static_cast<size_t>(want_top[0])]);
            for (size_t x = 0; x < 3; ++x) {
              EXPECT_EQ(got.topk_w[row * 3 + x], got.base.weights[row * Nk + static_cast<size_t>(want_top[x])]);
            }
          }
        }
      }
    }
  }
}

// A row the mask blocks entirely; a row whose key 7 takes all the weight; a row with two
// scores past float32's range (+inf: they share the weight); a NaN row.
TEST(Stats, MaskedOneHotOverflowedAndNaNRows) {
  const int64_t Nk = 20;
  Tensors t{GuardedTensor(kF32, {4, 1}), GuardedTensor(kF32, {Nk, 1}), GuardedTensor(kF32, {Nk, 2}),
            GuardedTensor(DType::kBool, {4, Nk})};
  std::vector<double> k(Nk), mask(4 * Nk, 1.0);
  for (int64_t j = 0; j < Nk; ++j) k[static_cast<size_t>(j)] = 0.01 * static_cast<double>(j);
  k[7] = 1e4;
  for (int64_t j = 0; j < Nk; ++j) mask[static_cast<size_t>(j)] = 0;  // row 0: all blocked
  t.q.set_values({1.0, 1.0, 1e36, NAN});
  t.k.set_values(k);
  t.v.set_values(std::vector<double>(2 * Nk, 1.0));
  t.mask->set_values(mask);
  sdpa::Options o;
  o.scale = 1.0;
  for (Backend backend : {Backend::kFlash, Backend::kReference, Backend::kNaive}) {
    SCOPED_TRACE(backend_name(backend));
    o.backend = backend;
    const StatValues got = run_stats(t, o, 3);
    // Row 0: nothing allowed.
    EXPECT_EQ(got.allowed[0], 0);
    EXPECT_EQ(got.entropy[0], 0.0);
    EXPECT_EQ(got.max_weight[0], 0.0);
    EXPECT_EQ(got.argmax[0], -1);
    for (int x = 0; x < 3; ++x) EXPECT_EQ(got.topk_i[static_cast<size_t>(x)], -1);
    // Row 1: key 7's score is 1e4, the others below 0.2: one-hot.
    EXPECT_EQ(got.allowed[1], Nk);
    EXPECT_EQ(got.entropy[1], 0.0);
    EXPECT_EQ(got.max_weight[1], 1.0);
    EXPECT_EQ(got.argmax[1], 7);
    EXPECT_EQ(got.topk_i[3], 7);
    EXPECT_EQ(got.topk_i[4], 19);  // then the largest of 0.01 · j
    // Row 2: 1e36 · 1e4 overflows float32 (and kReference's float32 range) to +inf at key 7
    // only; 1e36 · 0.01 · j is finite: the +inf key takes all.
    EXPECT_EQ(got.argmax[2], 7);
    EXPECT_EQ(got.max_weight[2], 1.0);
    EXPECT_EQ(got.entropy[2], 0.0);
    // Row 3: NaN.
    EXPECT_TRUE(std::isnan(got.entropy[3]));
    EXPECT_TRUE(std::isnan(got.max_weight[3]));
    EXPECT_TRUE(std::isnan(got.topk_w[9]));
    EXPECT_EQ(got.argmax[3], -1);
    EXPECT_EQ(got.topk_i[9], -1);
  }
}

// Two keys overflow to +inf: they share the weight, entropy log 2.
TEST(Stats, TwoOverflowedKeysShareTheWeight) {
  Tensors t{GuardedTensor(kF32, {2, 1}), GuardedTensor(kF32, {5, 1}), GuardedTensor(kF32, {5, 1}), std::nullopt};
  t.q.set_values({1e36, 1e36});
  t.k.set_values({1.0, 1e4, 2.0, 1e4, 3.0});
  t.v.set_values({1, 2, 3, 4, 5});
  sdpa::Options o;
  o.scale = 1.0;
  for (Backend backend : {Backend::kFlash, Backend::kReference}) {
    SCOPED_TRACE(backend_name(backend));
    o.backend = backend;
    const StatValues got = run_stats(t, o, 2);
    EXPECT_EQ(got.argmax[0], 1);
    EXPECT_EQ(got.max_weight[0], 0.5);
    EXPECT_NEAR(got.entropy[0], std::log(2.0), 1e-6);
    EXPECT_EQ(got.topk_i[0], 1);
    EXPECT_EQ(got.topk_i[1], 3);
  }
}

// With sinks the weights sum to less than 1 and the entropy is of the keys' weights as they
// are: by hand for one row, scores {0, log 2} and a sink of log 3 (weights 1/6, 2/6).
TEST(Stats, SinksByHand) {
  const Tensors t{tensor(kF64, {1, 1}, {1.0}), tensor(kF64, {2, 1}, {0.0, std::log(2.0)}), tensor(kF64, {2, 1}, {1.0, 1.0}),
                  std::nullopt};
  std::vector<double> sink = {std::log(3.0)};
  sdpa::Options o;
  o.scale = 1.0;
  o.sinks = sdpa::TensorView::contiguous(sink.data(), kF64, {1});
  const double w0 = 1.0 / 6, w1 = 2.0 / 6, H = -(w0 * std::log(w0) + w1 * std::log(w1));
  for (Backend backend : {Backend::kFlash, Backend::kReference, Backend::kNaive}) {
    SCOPED_TRACE(backend_name(backend));
    o.backend = backend;
    const StatValues got = run_stats(t, o, 2);
    EXPECT_NEAR(got.entropy[0], H, 1e-15);
    EXPECT_NEAR(got.normalized[0], H / std::log(2.0), 1e-15);
    EXPECT_NEAR(got.max_weight[0], w1, 1e-16);
    EXPECT_EQ(got.argmax[0], 1);
    EXPECT_NEAR(got.topk_w[1], w0, 1e-16);
  }
}

// ---- Raw scores (Outputs::scores) ----

// Each stage by hand in float64 (test_util's modified_score for the final one), on every
// backend: a float mask with -inf, causal, ALiBi, a softcap before the bias, and a second
// sequence of 5 keys whose keys past the length are -inf at every stage.
TEST(Scores, StagesByHand) {
  const int64_t B = 2, H = 2, Nq = 4, Nk = 7, D = 3;
  Tensors t{GuardedTensor(kF64, {B, H, Nq, D}), GuardedTensor(kF64, {B, 1, Nk, D}), GuardedTensor(kF64, {B, 1, Nk, D}),
            GuardedTensor(kF64, {Nq, Nk})};
  std::mt19937 rng(9);
  fill_normal(t.q, rng, 2.0);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  fill_mask(*t.mask, rng, 0.8, 0.0);
  t.seqlens_k = {Nk, 5};
  std::vector<double> slopes = {0.25, 0.5};
  sdpa::Options o;
  o.causal = Causal::kBottomRight;
  o.softcap = 3.0;
  o.alibi_slopes = sdpa::TensorView::contiguous(slopes.data(), kF64, {H});
  for (const auto& [stage, name] : {std::pair{sdpa::ScoresStage::kScaled, "scaled"}, {sdpa::ScoresStage::kBiased, "biased"},
                                    {sdpa::ScoresStage::kFinal, "final"}, {sdpa::ScoresStage::kSoftcapped, "softcapped"}}) {
    for (Backend backend : {Backend::kReference, Backend::kFlash, Backend::kNaive}) {
      SCOPED_TRACE(std::string(name) + " " + backend_name(backend));
      o.backend = backend;
      Outs outs{GuardedTensor(kF64, {B, H, Nq, D}), std::nullopt, std::nullopt};
      GuardedTensor scores(kF64, {B, H, Nq, Nk}, Layout::kPadded, false);
      sdpa::Outputs outputs = outs.outputs();
      outputs.scores = scores.view();
      outputs.scores_stage = stage;
      sdpa::attention(t.inputs(), outputs, o);
      ASSERT_TRUE(scores.guards_intact());
      std::vector<double> want;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t i = 0; i < Nq; ++i) {
            for (int64_t j = 0; j < Nk; ++j) {
              double x = 0;
              for (int64_t d = 0; d < D; ++d) x += t.q.at(b, h, i, d) * t.k.at(b, 0, j, d) / std::sqrt(3.0);
              const int64_t L = t.seqlens_k[static_cast<size_t>(b)];
              const bool blocked = !key_allowed(t, o, b, i, j) || mask_bias(t, b, h, i, j) == -kInf;
              if (j >= L) {
                want.push_back(-kInf);
              } else if (stage == sdpa::ScoresStage::kScaled) {
                want.push_back(x);
              } else if (stage == sdpa::ScoresStage::kSoftcapped) {  // the cap alone, every key
                want.push_back(o.softcap * std::tanh(x / o.softcap));
              } else if (blocked) {
                want.push_back(-kInf);
              } else if (stage == sdpa::ScoresStage::kBiased) {
                want.push_back(x + alibi_bias(t, o, b, h, i, j) + mask_bias(t, b, h, i, j));
              } else {
                want.push_back(modified_score(t, o, b, h, i, j, x));
              }
            }
          }
        }
      }
      EXPECT_TRUE(all_close("scores", scores.values(), want, 1e-13));
    }
  }
}

TEST(Scores, BadViewsAndPagedCallsAreErrors) {
  Tensors t{GuardedTensor(kF32, {3, 8}), GuardedTensor(kF32, {5, 8}), GuardedTensor(kF32, {5, 8}), std::nullopt};
  GuardedTensor out(kF32, {3, 8}), wrong(kF32, {3, 4}), f64(kF64, {3, 5});
  const auto call = [&](const GuardedTensor& scores) {
    return [&] {
      sdpa::Outputs o;
      o.out = out.view();
      o.scores = scores.view();
      sdpa::attention(t.inputs(), o);
    };
  };
  expect_sdpa_error(call(wrong), {"scores has shape (3, 4)", "(3, 5)"});
  expect_sdpa_error(call(f64), {"scores", "float64", "float32"});
  EXPECT_TRUE(out.untouched());
}

// ---- Scores that are the biases alone (Dk = Dv = 0) ----

// Every statistic of q (B, H, Nq, 0) against k, v (B, H, Nk, 0): views with no element (null
// data), so Nk may be 2^40; T is the compute type (float64 for float64 inputs). `mask` and
// `seqlens` as the caller gives them.
template <typename T>
struct FeaturelessStats {
  std::vector<int64_t> allowed, argmax, topk_i;
  std::vector<T> entropy, normalized, max_weight, topk_w, pooled;
};
template <typename T>
FeaturelessStats<T> featureless_stats(int64_t B, int64_t Nq, int64_t Nk, const sdpa::Options& o, int64_t topk, int64_t G,
                                      std::optional<sdpa::TensorView> mask = std::nullopt,
                                      std::optional<sdpa::TensorView> seqlens = std::nullopt) {
  const DType dt = sizeof(T) == 8 ? kF64 : kF32;
  const int64_t H = 2, rows = B * H * Nq;
  FeaturelessStats<T> r{std::vector<int64_t>(static_cast<size_t>(rows), -7), std::vector<int64_t>(static_cast<size_t>(rows), -7),
                        std::vector<int64_t>(static_cast<size_t>(rows * topk), -7),
                        std::vector<T>(static_cast<size_t>(rows), T(-7)), std::vector<T>(static_cast<size_t>(rows), T(-7)),
                        std::vector<T>(static_cast<size_t>(rows), T(-7)), std::vector<T>(static_cast<size_t>(rows * topk), T(-7)),
                        std::vector<T>(static_cast<size_t>(rows * G), T(-7))};
  sdpa::Inputs in;
  in.q = sdpa::TensorView::contiguous(nullptr, dt, {B, H, Nq, 0});
  in.k = sdpa::TensorView::contiguous(nullptr, dt, {B, H, Nk, 0});
  in.v = sdpa::TensorView::contiguous(nullptr, dt, {B, H, Nk, 0});
  in.mask = mask;
  in.seqlens_k = seqlens;
  sdpa::Outputs out;
  out.out = sdpa::TensorView::contiguous(nullptr, dt, {B, H, Nq, 0});
  out.stats.allowed = sdpa::TensorView::contiguous(r.allowed.data(), DType::kInt64, {B, H, Nq});
  out.stats.argmax = sdpa::TensorView::contiguous(r.argmax.data(), DType::kInt64, {B, H, Nq});
  out.stats.entropy = sdpa::TensorView::contiguous(r.entropy.data(), dt, {B, H, Nq});
  out.stats.entropy_normalized = sdpa::TensorView::contiguous(r.normalized.data(), dt, {B, H, Nq});
  out.stats.max_weight = sdpa::TensorView::contiguous(r.max_weight.data(), dt, {B, H, Nq});
  out.stats.topk_weights = sdpa::TensorView::contiguous(r.topk_w.data(), dt, {B, H, Nq, topk});
  out.stats.topk_indices = sdpa::TensorView::contiguous(r.topk_i.data(), DType::kInt64, {B, H, Nq, topk});
  out.stats.pooled_weights = sdpa::TensorView::contiguous(r.pooled.data(), dt, {B, H, Nq, G});
  sdpa::attention(in, out, o);
  return r;
}

// Issue 26 item 2: with no features the statistics follow the key range in closed form, as lse
// does: k of shape (2^40, 0) holds no element and must not be walked (it ran for hours). Rows
// see Nk, Nk - 1 and Nk - 2 keys (causal bottom-right), one sequence 5 keys (seqlens_k), a
// window of 3 keys; with and without sinks; every backend; float32 and float64.
template <typename T>
void check_huge_featureless_rows() {
  const int64_t Nk = int64_t{1} << 40, Nq = 3, topk = 4, G = 5;
  const DType dt = sizeof(T) == 8 ? kF64 : kF32;
  const double tol = 4 * eps(dt);
  for (const Backend backend : {Backend::kFlash, Backend::kReference, Backend::kNaive}) {
    for (const int variant : {0, 1, 2, 3}) {  // causal; causal + sinks; seqlens_k {Nk, 5}; window left 2
      SCOPED_TRACE("variant " + std::to_string(variant) + ", backend " + std::to_string(static_cast<int>(backend)));
      sdpa::Options o;
      o.backend = backend;
      std::vector<double> sinks = {0.5, -1.0};
      std::vector<int64_t> lengths = {Nk, 5};
      std::optional<sdpa::TensorView> seqlens;
      if (variant <= 1) o.causal = Causal::kBottomRight;
      if (variant == 1) o.sinks = sdpa::TensorView::contiguous(sinks.data(), kF64, {2});
      if (variant == 2) seqlens = sdpa::TensorView::contiguous(lengths.data(), DType::kInt64, {2});
      if (variant == 3) o.window = {2, 0};
      const FeaturelessStats<T> got = featureless_stats<T>(2, Nq, Nk, o, topk, G, std::nullopt, seqlens);
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t h = 0; h < 2; ++h) {
          for (int64_t i = 0; i < Nq; ++i) {
            const size_t row = static_cast<size_t>((b * 2 + h) * Nq + i);
            const int64_t L = variant == 2 ? lengths[static_cast<size_t>(b)] : Nk;
            const int64_t end = variant != 2 ? L - (Nq - 1 - i) : L;  // causal, or the window's right bound 0
            const int64_t begin = variant == 3 ? end - 3 : 0, n = end - begin;
            const double sink_share = variant == 1 ? std::exp(sinks[static_cast<size_t>(h)]) : 0.0;
            const double w = 1.0 / (static_cast<double>(n) + sink_share);  // each key's weight
            EXPECT_EQ(got.allowed[row], n);
            EXPECT_EQ(got.argmax[row], begin);
            EXPECT_NEAR(got.max_weight[row], w, tol * w);
            EXPECT_NEAR(got.entropy[row], -static_cast<double>(n) * w * std::log(w), tol * std::log(static_cast<double>(n)));
            if (variant != 1) {
              EXPECT_NEAR(got.normalized[row], 1.0, tol);
            }
            for (int64_t r = 0; r < topk; ++r) {
              EXPECT_EQ(got.topk_i[row * topk + static_cast<size_t>(r)], r < n ? begin + r : -1);
              EXPECT_EQ(got.topk_w[row * topk + static_cast<size_t>(r)], r < n ? got.max_weight[row] : T(0));
            }
            for (int64_t g = 0; g < G; ++g) {  // run g: keys [ceil(g Nk / G), ceil((g + 1) Nk / G))
              const auto first = [&](int64_t x) { return static_cast<int64_t>(std::ceil(static_cast<double>(x) * static_cast<double>(Nk) / G)); };
              const int64_t c = std::max<int64_t>(0, std::min(end, first(g + 1)) - std::max(begin, first(g)));
              EXPECT_NEAR(got.pooled[row * G + static_cast<size_t>(g)], static_cast<double>(c) * w, tol * c * w) << "run " << g;
            }
          }
        }
      }
    }
  }
}
TEST(Stats, FeaturelessRowsOfHugeNkAreClosedForm) {
  check_huge_featureless_rows<float>();
  check_huge_featureless_rows<double>();
}

// The closed form against the kernels' and the reference's walk over the keys, which a mask row
// in memory forces (an all-zero float bias of shape (Nk,), the same scores), on a small Nk:
// the same keys exactly, the same weights within rounding; masks that block rows, sinks,
// softcap, causal both ways.
TEST(Stats, FeaturelessClosedFormMatchesTheWalk) {
  const int64_t Nq = 5, Nk = 37, topk = 6, G = 4;
  std::vector<float> zeros(Nk, 0.0f);
  std::vector<uint8_t> rows_kept = {1, 0, 1, 1, 0};  // a bool mask (Nq, 1): rows 1 and 4 blocked
  std::vector<double> sinks = {2.0, -3.0};
  for (const Backend backend : {Backend::kFlash, Backend::kReference}) {
    for (const int variant : {0, 1, 2, 3}) {
      SCOPED_TRACE("variant " + std::to_string(variant) + ", backend " + std::to_string(static_cast<int>(backend)));
      sdpa::Options o;
      o.backend = backend;
      std::optional<sdpa::TensorView> constant;
      if (variant == 0) o.causal = Causal::kBottomRight;
      if (variant == 1) o.causal = Causal::kTopLeft, o.sinks = sdpa::TensorView::contiguous(sinks.data(), kF64, {2});
      if (variant == 2) constant = sdpa::TensorView::contiguous(rows_kept.data(), DType::kBool, {Nq, 1});
      if (variant == 3) o.softcap = 3.0, o.window = {4, 2};
      const FeaturelessStats<float> got = featureless_stats<float>(1, Nq, Nk, o, topk, G, constant);
      // The walk: the same call with a float bias row of zeros (and the bool rows, as a float mask).
      std::vector<float> bias(static_cast<size_t>(Nq * Nk), 0.0f);
      if (variant == 2) {
        for (int64_t i = 0; i < Nq; ++i) {
          if (!rows_kept[static_cast<size_t>(i)]) std::fill_n(bias.begin() + i * Nk, Nk, -INFINITY);
        }
      }
      const FeaturelessStats<float> want =
          featureless_stats<float>(1, Nq, Nk, o, topk, G, sdpa::TensorView::contiguous(bias.data(), kF32, {Nq, Nk}));
      EXPECT_EQ(got.allowed, want.allowed);
      EXPECT_EQ(got.argmax, want.argmax);
      EXPECT_EQ(got.topk_i, want.topk_i);
      const auto near = [](const std::vector<float>& a, const std::vector<float>& b, double rel, const char* what) {
        for (size_t x = 0; x < a.size(); ++x) EXPECT_NEAR(a[x], b[x], rel * std::max(1.0, std::fabs(double(b[x])))) << what << " " << x;
      };
      near(got.max_weight, want.max_weight, 2 * FLT_EPSILON, "max_weight");
      near(got.topk_w, want.topk_w, 2 * FLT_EPSILON, "topk_w");
      near(got.entropy, want.entropy, 4 * FLT_EPSILON, "entropy");
      near(got.normalized, want.normalized, 4 * FLT_EPSILON, "normalized");
      near(got.pooled, want.pooled, Nk * FLT_EPSILON, "pooled");  // summed key by key: Nk roundings
    }
  }
}

// ---- Errors ----

TEST(Stats, BadViewsAreErrorsNamingThem) {
  Tensors t{GuardedTensor(kF32, {2, 3, 8}), GuardedTensor(kF32, {2, 5, 8}), GuardedTensor(kF32, {2, 5, 8}), std::nullopt};
  GuardedTensor out(kF32, {2, 3, 8});
  GuardedTensor wrong_shape(kF32, {2, 4}), f64_rows(kF64, {2, 3}), f32_rows(kF32, {2, 3}), big_k(kF32, {2, 3, 33}),
      topk4(kF32, {2, 3, 4});
  IntOut idx5{std::vector<int64_t>(30), {2, 3, 5}};
  const auto call = [&](auto set) {
    return [&, set] {
      sdpa::Outputs o;
      o.out = out.view();
      set(o.stats);
      sdpa::attention(t.inputs(), o);
    };
  };
  expect_sdpa_error(call([&](sdpa::Stats& s) { s.entropy = wrong_shape.view(); }), {"entropy", "(2, 4)", "(Hq, Nq)"});
  expect_sdpa_error(call([&](sdpa::Stats& s) { s.max_weight = f64_rows.view(); }), {"max_weight", "float64", "float32"});
  expect_sdpa_error(call([&](sdpa::Stats& s) { s.argmax = f32_rows.view(); }), {"argmax", "int64"});
  expect_sdpa_error(call([&](sdpa::Stats& s) { s.topk_weights = big_k.view(); }), {"topk_weights", "33", "at most 32"});
  expect_sdpa_error(call([&](sdpa::Stats& s) {
                      s.topk_weights = topk4.view();
                      s.topk_indices = idx5.view();
                    }),
                    {"topk_indices", "(2, 3, 5)", "(2, 3, 4)"});
  EXPECT_TRUE(out.untouched());
}

}  // namespace
