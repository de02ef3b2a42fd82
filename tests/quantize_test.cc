// quantize_kv (sdpa/kv_cache.h): the rule on hand-computed rows, against a plain twin of the rule
// on random rows of every input dtype, shape (odd sizes too), group count and layout, the round
// trip bound, and the errors (each naming the argument, nothing written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sdpa/kv_cache.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;

constexpr DType kI8 = DType::kInt8, kU8 = DType::kUInt8;

struct Quantized {
  GuardedTensor values, scale;
  std::optional<GuardedTensor> zero;
};

// quantize_kv of x into fresh guarded outputs: G == 0 for one scale per row, else G groups.
Quantized quantize(const GuardedTensor& x, DType dtype, int64_t G, Layout layout = Layout::kContiguous) {
  std::vector<int64_t> s_shape(x.shape().begin(), x.shape().end() - 1);
  if (G > 0) s_shape.push_back(G);
  // (A rank-0 scale, of a rank-1 x, is contiguous: GuardedTensor's layouts need a dim.)
  const Layout s_layout = s_shape.empty() ? Layout::kContiguous : layout;
  Quantized q{GuardedTensor(dtype, x.shape(), layout), GuardedTensor(kF32, s_shape, s_layout, false), std::nullopt};
  if (dtype == kU8) q.zero.emplace(kF32, s_shape, s_layout, false);
  sdpa::quantize_kv(x.view(), q.values.view(), q.scale.view(),
                    q.zero ? std::optional<sdpa::TensorView>(q.zero->view()) : std::nullopt);
  EXPECT_TRUE(q.values.guards_intact());
  EXPECT_TRUE(q.scale.guards_intact());
  if (q.zero) {
    EXPECT_TRUE(q.zero->guards_intact());
  }
  return q;
}

// The rule of kv_cache.h written out for one group u (float64 values): {s, z, x_q...}.
struct Twin {
  float s = 0.0f, z = 0.0f;
  std::vector<double> xq;
};
Twin twin(DType dtype, const std::vector<double>& u) {
  Twin t;
  double lo = 0.0, hi = 0.0, m = 0.0;
  for (double x : u) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    m = std::max(m, std::fabs(x));
  }
  t.s = dtype == kI8 ? static_cast<float>(m / 127.0) : static_cast<float>((hi - lo) / 255.0);
  if (dtype == kU8 && t.s != 0.0f) t.z = static_cast<float>(std::clamp(std::nearbyint(-lo / t.s), 0.0, 255.0));
  for (double x : u) {
    if (t.s == 0.0f) {
      t.xq.push_back(0.0);
    } else if (dtype == kI8) {
      t.xq.push_back(std::clamp(std::nearbyint(x / t.s), -127.0, 127.0));
    } else {
      t.xq.push_back(std::clamp(std::nearbyint(x / t.s) + t.z, 0.0, 255.0));
    }
  }
  return t;
}

// The dequantised value fl32(fl32(x_q - z) · s) (KVQuant's).
double dequantised(double xq, float z, float s) { return static_cast<float>(static_cast<float>(xq - z) * s); }

void expect_row(const Quantized& q, const std::vector<double>& values, const std::vector<double>& scales,
                const std::vector<double>& zeros = {}) {
  EXPECT_EQ(q.values.values(), values);
  EXPECT_EQ(q.scale.values(), scales);
  if (q.zero) {
    EXPECT_EQ(q.zero->values(), zeros);
  }
}

TEST(QuantizeKV, HandComputedInt8) {
  // max |u| = 127: s = 1 exactly, so the values are rne(u): 2.5 -> 2, -3.5 -> -4, -0.5 -> 0.
  expect_row(quantize(tensor(kF32, {6}, {127, -3.5, 2.5, 0.4, -0.5, 126.5}), kI8, 0),
             {127, -4, 2, 0, 0, 126}, {1.0});
  // The max at -127, and a row of two heads (one scale each).
  expect_row(quantize(tensor(kF32, {2, 2}, {-127, 1.5, 0, 254}), kI8, 0), {-127, 2, 0, 127}, {1.0, 2.0});
  // An all-zero row: s = 0, values 0 (dequantised: exactly 0).
  expect_row(quantize(tensor(kF32, {3}, {0, -0.0, 0}), kI8, 0), {0, 0, 0}, {0.0});
  // A group of one value: it is the max, so it is ±127 whatever its size.
  const float s5 = static_cast<float>(5.0 / 127.0);
  expect_row(quantize(tensor(kF32, {2, 1}, {-5, 1e-30}), kI8, 0), {-127, 127},
             {s5, static_cast<double>(static_cast<float>(static_cast<double>(1e-30f) / 127.0))});
  // Two groups of two (G = 2): scales 1 and 2; -63 / 2 = -31.5 rounds to even -32.
  expect_row(quantize(tensor(kF32, {4}, {127, 1, 254, -63}), kI8, 2), {127, 1, 127, -32}, {1.0, 2.0});
}

TEST(QuantizeKV, HandComputedUInt8) {
  // [0, 255]: s = 1, z = 0, values rne(u): 3.5 -> 4, 254.5 -> 254.
  expect_row(quantize(tensor(kF32, {4}, {0, 255, 3.5, 254.5}), kU8, 0), {0, 255, 4, 254}, {1.0}, {0.0});
  // Negative only: lo = -255, hi = 0 (the range includes 0), s = 1, z = 255; -100.5 -> -100 + 255.
  expect_row(quantize(tensor(kF32, {3}, {-255, -100.5, -1}), kU8, 0), {0, 155, 254}, {1.0}, {255.0});
  // Both signs: [-51, 204], s = 1, z = 51: 0 is stored as z itself (dequantised exactly 0).
  expect_row(quantize(tensor(kF32, {3}, {-51, 204, 0}), kU8, 0), {0, 255, 51}, {1.0}, {51.0});
  // Positive only: lo = 0, so z = 0 and the max is 255.
  const Quantized positive = quantize(tensor(kF32, {2}, {510, 2}), kU8, 0);
  expect_row(positive, {255, 1}, {2.0}, {0.0});
  EXPECT_FALSE(std::signbit(positive.zero->get(0)));  // +0, not the -0 of -lo
  // All zero: s = 0, z = 0, values 0. A group of one negative value: z = 255, value 0.
  expect_row(quantize(tensor(kF32, {2, 2}, {0, 0, -2, 0}), kU8, 2), {0, 0, 0, 0},
             {0.0, 0.0, static_cast<double>(static_cast<float>(2.0 / 255.0)), 0.0}, {0.0, 0.0, 255.0, 0.0});
}

// Random rows of every input dtype against the twin (bitwise), and the round trip: for a normal
// scale s, |u - fl32(fl32(x_q - z) · s)| <= s · (1/2 + 2^-15). Derivation, with ε = 2^-24:
//   int8: s = fl32(m / 127) >= (m / 127)(1 - ε), so |u / s| <= 127 / (1 - ε) < 127.5 and the
//     clamp never moves rne(u / s): |u / s - x_q| <= 1/2 (+ 2^-46 from float64's quotient).
//     The dequantisation rounds once, by at most ε · |x_q · s| <= 127 ε s.
//   uint8: rne(u / s) >= rne(lo / s) = -z, so the clamp at 0 never acts; at 255 it acts only
//     when rne(u / s) + z > 255 although u / s + (-lo / s) <= (hi - lo) / s <= 255 (1 + ε), so
//     x_q - z = 255 - z is within 1/2 + 255 ε of u / s. The dequantisation rounds by at most
//     ε · 255 s.
//   So |u - deq| <= s (1/2 + 510 ε + 2^-46) < s (1/2 + 512 ε) = s (1/2 + 2^-15).
TEST(QuantizeKV, MatchesTheRuleAndRoundTrips) {
  std::mt19937 rng(30);
  const std::vector<std::vector<int64_t>> shapes{{1, 1, 1, 8}, {2, 3, 5, 16}, {97, 24}, {3, 1025}, {2, 2, 96}, {7}};
  for (DType in : {kF32, kF64, kBF16, kF16}) {
    for (DType dtype : {kI8, kU8}) {
      for (const auto& shape : shapes) {
        for (int64_t G : {0, 1, 2, 4, 8}) {
          const int64_t D = shape.back();
          if (G > 0 && D % G != 0) continue;
          for (Layout layout : {Layout::kContiguous, Layout::kPermuted}) {
            SCOPED_TRACE(std::string(sdpa::dtype_name(in)) + " -> " + sdpa::dtype_name(dtype) + " D=" +
                         std::to_string(D) + " G=" + std::to_string(G) + " layout=" +
                         std::to_string(static_cast<int>(layout)));
            GuardedTensor x(in, shape, layout);
            fill_normal(x, rng, 3.0);
            if (dtype == kU8) {  // an offset, so that the zero point moves off the middle
              std::vector<double> shifted = x.values();
              for (double& e : shifted) e += 2.0;
              x.set_values(shifted);
            }
            const Quantized q = quantize(x, dtype, G, layout);
            const std::vector<double> u = x.values(), xq = q.values.values(), s = q.scale.values();
            const std::vector<double> z = q.zero ? q.zero->values() : std::vector<double>(s.size(), 0.0);
            const int64_t groups = std::max<int64_t>(G, 1), n = D / groups;
            for (size_t g = 0; g < s.size(); ++g) {
              const std::vector<double> group(u.begin() + static_cast<int64_t>(g) * n,
                                              u.begin() + static_cast<int64_t>(g + 1) * n);
              const Twin t = twin(dtype, group);
              ASSERT_EQ(s[g], t.s) << "group " << g;
              ASSERT_EQ(z[g], t.z) << "group " << g;
              for (int64_t e = 0; e < n; ++e) {
                const size_t at = g * static_cast<size_t>(n) + static_cast<size_t>(e);
                ASSERT_EQ(xq[at], t.xq[static_cast<size_t>(e)]) << "group " << g << " element " << e;
                const double err = std::fabs(u[at] - dequantised(xq[at], t.z, t.s));
                ASSERT_LE(err, t.s * (0.5 + std::ldexp(1.0, -15))) << "group " << g << " element " << e;
              }
            }
          }
        }
      }
    }
  }
}

// The bound is tight: a value halfway between two steps is off by s / 2 (as rne must be).
TEST(QuantizeKV, RoundTripBoundIsReached) {
  const Quantized q = quantize(tensor(kF32, {2}, {127, 0.5}), kI8, 0);
  EXPECT_EQ(q.values.values(), (std::vector<double>{127, 0}));  // 0.5 -> 0 (even): off by s / 2 = 0.5
}

TEST(QuantizeKV, ErrorsNameTheArgumentAndWriteNothing) {
  GuardedTensor x = tensor(kF32, {2, 4}, {1, 2, 3, 4, 5, 6, 7, 8});
  GuardedTensor v8(kI8, {2, 4}), u8(kU8, {2, 4}), s(kF32, {2}), z(kF32, {2});
  const auto untouched = [&] {
    EXPECT_TRUE(v8.untouched());
    EXPECT_TRUE(u8.untouched());
    EXPECT_TRUE(s.untouched());
    EXPECT_TRUE(z.untouched());
  };
  // A non-finite x: found before anything is written (the bad value is in the last row).
  for (double bad : {kInf, -kInf, std::nan("")}) {
    GuardedTensor y = tensor(kF32, {2, 4}, {1, 2, 3, 4, 5, 6, 7, bad});
    expect_sdpa_error([&] { sdpa::quantize_kv(y.view(), v8.view(), s.view()); },
                      {"x holds", "row 1", "feature 3", "finite"});
  }
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), s.view(), s.view()); }, {"values has dtype float32", "int8 or uint8"});
  GuardedTensor wrong(kI8, {2, 5});
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), wrong.view(), s.view()); },
                    {"values has shape (2, 5)", "x's shape (2, 4)"});
  GuardedTensor s3(kF32, {3}), s23(kF32, {2, 3}), s64(kF64, {2});
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), v8.view(), s3.view()); }, {"scale has shape (3,)", "(2,)", "G dividing D = 4"});
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), v8.view(), s23.view()); }, {"scale has shape (2, 3)", "G dividing D = 4"});
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), v8.view(), s64.view()); }, {"scale has dtype float64", "float32"});
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), u8.view(), s.view()); }, {"zero must be given for uint8"});
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), v8.view(), s.view(), z.view()); }, {"zero is given but int8"});
  GuardedTensor z22(kF32, {2, 2});
  expect_sdpa_error([&] { sdpa::quantize_kv(x.view(), u8.view(), s.view(), z22.view()); },
                    {"zero has shape (2, 2) but must have scale's shape (2,)"});
  GuardedTensor xi(DType::kInt32, {2, 4});
  expect_sdpa_error([&] { sdpa::quantize_kv(xi.view(), v8.view(), s.view()); }, {"x has dtype int32"});
  // float64 x whose scale float32 cannot hold.
  GuardedTensor big = tensor(kF64, {2, 4}, {1, 2, 3, 4, 1e300, 6, 7, 8});
  expect_sdpa_error([&] { sdpa::quantize_kv(big.view(), v8.view(), s.view()); }, {"x row 1 group 0", "beyond float32"});
  untouched();
}

}  // namespace
