// Bitwise equality of every output across thread counts (1, 2, 3) and across calls, for each
// way the fused kernel cuts work: many-row blocks, few-row (decode) blocks, key chunks merged
// by lse, GQA, causal, masks, weights. Also the program the ThreadSanitizer build runs.
#include <gtest/gtest.h>

#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "sdpa/attention.h"

namespace {

struct Shape {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, D;
  sdpa::Causal causal;
  bool mask, weights;
};

struct Result {
  std::vector<float> out, lse, weights;
};

Result run(const Shape& s, int threads) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> q(s.B * s.Hq * s.Nq * s.D), k(s.B * s.Hkv * s.Nk * s.D), v(k.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(rng);
  std::vector<uint8_t> mask(s.Nq * s.Nk);
  for (auto& m : mask) m = rng() % 4 != 0;
  Result r;
  r.out.resize(s.B * s.Hq * s.Nq * s.D);
  r.lse.resize(s.B * s.Hq * s.Nq);
  if (s.weights) r.weights.resize(s.B * s.Hq * s.Nq * s.Nk);

  sdpa::Inputs in;
  in.q = sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {s.B, s.Hq, s.Nq, s.D});
  in.k = sdpa::TensorView::contiguous(k.data(), sdpa::DType::kFloat32, {s.B, s.Hkv, s.Nk, s.D});
  in.v = sdpa::TensorView::contiguous(v.data(), sdpa::DType::kFloat32, {s.B, s.Hkv, s.Nk, s.D});
  if (s.mask) in.mask = sdpa::TensorView::contiguous(mask.data(), sdpa::DType::kBool, {s.Nq, s.Nk});
  sdpa::Outputs outs;
  outs.out = sdpa::TensorView::contiguous(r.out.data(), sdpa::DType::kFloat32, {s.B, s.Hq, s.Nq, s.D});
  outs.lse = sdpa::TensorView::contiguous(r.lse.data(), sdpa::DType::kFloat32, {s.B, s.Hq, s.Nq});
  if (s.weights) {
    outs.weights = sdpa::TensorView::contiguous(r.weights.data(), sdpa::DType::kFloat32, {s.B, s.Hq, s.Nq, s.Nk});
  }
  sdpa::Options opt;
  opt.causal = s.causal;
  sdpa::set_num_threads(threads);
  sdpa::attention(in, outs, opt);
  sdpa::set_num_threads(0);
  return r;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }  // names, not bytes, in test logs

class Threads : public testing::TestWithParam<Shape> {};

TEST_P(Threads, OutputsAreBitwiseIdenticalForAnyThreadCount) {
  const Shape& s = GetParam();
  const Result one = run(s, 1);
  for (int threads : {1, 2, 3}) {
    const Result other = run(s, threads);
    EXPECT_TRUE(bitwise_equal(one.out, other.out)) << "out differs with " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.lse, other.lse)) << "lse differs with " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.weights, other.weights)) << "weights differ with " << threads << " threads";
  }
}

// Sizes are kept small enough for the ThreadSanitizer build, while still crossing tiles
// (128 keys), blocks (16-32 rows) and key chunks (decode with few blocks and Nk >= 2048).
INSTANTIATE_TEST_SUITE_P(
    Cuts, Threads,
    testing::Values(Shape{"prefill", 2, 4, 2, 97, 300, 32, sdpa::Causal::kNone, false, false},
                    Shape{"prefill_causal_mask_weights", 1, 2, 1, 70, 260, 16, sdpa::Causal::kBottomRight, true, true},
                    Shape{"decode_split_keys", 1, 2, 1, 1, 5000, 64, sdpa::Causal::kNone, false, false},
                    Shape{"decode_split_keys_mask_weights", 1, 4, 2, 2, 4500, 24, sdpa::Causal::kTopLeft, true, true},
                    Shape{"many_heads", 3, 6, 3, 9, 40, 8, sdpa::Causal::kNone, true, false}),
    [](const testing::TestParamInfo<Shape>& info) { return std::string(info.param.name); });

}  // namespace
