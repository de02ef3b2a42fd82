// Every invalid argument throws sdpa::Error naming the argument and the shapes, before anything
// is written: each test breaks one thing in an otherwise valid call.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::DType;

constexpr DType kF32 = DType::kFloat32;

// A valid call: B=2, Hq=4, Hkv=2, Nq=3, Nk=5, Dk=4, Dv=6, float32, with weights, lse and a mask.
// Outputs stay all-sentinel until written, so untouched() proves nothing was.
class Validation : public testing::Test {
 protected:
  Validation() {
    fill(q_);
    fill(k_);
    fill(v_);
    std::mt19937 rng(1);
    fill_mask(mask_, rng, 0.7, 0.0);
    in.q = q_.view();
    in.k = k_.view();
    in.v = v_.view();
    in.mask = mask_.view();
    outs.out = out_.view();
    outs.weights = weights_.view();
    outs.lse = lse_.view();
  }

  static void fill(GuardedTensor& t) {
    std::mt19937 rng(2);
    fill_normal(t, rng);
  }

  // The call must throw sdpa::Error whose message contains every substring, and write nothing.
  void expect_error(const std::vector<std::string>& substrings) {
    try {
      sdpa::attention(in, outs, options);
      ADD_FAILURE() << "no sdpa::Error thrown";
    } catch (const sdpa::Error& e) {
      for (const std::string& s : substrings) {
        EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "message: " << e.what() << "\nmissing: " << s;
      }
    }
    EXPECT_TRUE(out_.untouched());
    EXPECT_TRUE(weights_.untouched());
    EXPECT_TRUE(lse_.untouched());
  }

  GuardedTensor q_{kF32, {2, 4, 3, 4}}, k_{kF32, {2, 2, 5, 4}}, v_{kF32, {2, 2, 5, 6}}, mask_{DType::kBool, {3, 5}};
  GuardedTensor out_{kF32, {2, 4, 3, 6}}, weights_{kF32, {2, 4, 3, 5}}, lse_{kF32, {2, 4, 3}};
  sdpa::Inputs in;
  sdpa::Outputs outs;
  sdpa::Options options;
};

TEST_F(Validation, TheBaseCallIsValid) {
  // Otherwise every test below would pass for the wrong reason.
  EXPECT_NO_THROW(sdpa::attention(in, outs, options));
  EXPECT_FALSE(out_.untouched());
}

TEST_F(Validation, BadRank) {
  in.q.rank = 5;
  expect_error({"q has rank 5 but must have rank 2..4"});
  in.q.rank = 1;
  expect_error({"q has rank 1 but must have rank 2..4"});
}

TEST_F(Validation, RankMismatch) {
  GuardedTensor k3(kF32, {2, 5, 4});
  in.k = k3.view();
  expect_error({"k has rank 3 but q has rank 4"});
  in.k = k_.view();
  GuardedTensor v3(kF32, {2, 5, 6});
  in.v = v3.view();
  expect_error({"v has rank 3 but q has rank 4"});
  in.v = v_.view();
  GuardedTensor out3(kF32, {4, 3, 6});
  outs.out = out3.view();
  expect_error({"out has shape (4, 3, 6) but must be (2, 4, 3, 6) = (B, Hq, Nq, Dv)"});
  EXPECT_TRUE(out3.untouched());
}

TEST_F(Validation, NegativeDim) {
  in.q.shape[1] = -4;
  expect_error({"q has a negative dim: (2, -4, 3, 4)"});
}

TEST_F(Validation, NonFloatQuery) {
  GuardedTensor qb(DType::kBool, {2, 4, 3, 4}), kb(DType::kBool, {2, 2, 5, 4}), vb(DType::kBool, {2, 2, 5, 6});
  in.q = qb.view();
  in.k = kb.view();
  in.v = vb.view();
  expect_error({"q has dtype bool but must be float32 or float64"});
}

TEST_F(Validation, DtypeMismatch) {
  GuardedTensor k64 = k_.converted(DType::kFloat64, Layout::kContiguous);
  in.k = k64.view();
  expect_error({"k has dtype float64 but q has dtype float32"});
  in.k = k_.view();
  GuardedTensor v64 = v_.converted(DType::kFloat64, Layout::kContiguous);
  in.v = v64.view();
  expect_error({"v has dtype float64 but q has dtype float32"});
  in.v = v_.view();
  GuardedTensor out64(DType::kFloat64, {2, 4, 3, 6}), w64(DType::kFloat64, {2, 4, 3, 5}), l64(DType::kFloat64, {2, 4, 3});
  outs.out = out64.view();
  expect_error({"out has dtype float64 but q has dtype float32"});
  outs.out = out_.view();
  outs.weights = w64.view();
  expect_error({"weights has dtype float64 but q has dtype float32"});
  outs.weights = weights_.view();
  outs.lse = l64.view();
  expect_error({"lse has dtype float64 but q has dtype float32"});
  EXPECT_TRUE(out64.untouched() && w64.untouched() && l64.untouched());
}

TEST_F(Validation, HeadDimMismatch) {
  GuardedTensor k6(kF32, {2, 2, 5, 6});
  in.k = k6.view();
  expect_error({"k has Dk=6 but q has Dk=4", "q (2, 4, 3, 4)", "k (2, 2, 5, 6)"});
}

TEST_F(Validation, KeyCountMismatchBetweenKAndV) {
  GuardedTensor v7(kF32, {2, 2, 7, 6});
  in.v = v7.view();
  expect_error({"v has Nk=7 but k has Nk=5", "k (2, 2, 5, 4)", "v (2, 2, 7, 6)"});
}

TEST_F(Validation, KvHeadCountMismatchBetweenKAndV) {
  GuardedTensor v1(kF32, {2, 1, 5, 6});
  in.v = v1.view();
  expect_error({"v has 1 heads but k has 2", "v (2, 1, 5, 6)"});
}

TEST_F(Validation, QueryHeadsNotAMultipleOfKvHeads) {
  GuardedTensor k3(kF32, {2, 3, 5, 4}), v3(kF32, {2, 3, 5, 6});
  in.k = k3.view();
  in.v = v3.view();
  expect_error({"q has Hq=4 heads, which is not a multiple of k's Hkv=3", "q (2, 4, 3, 4)", "k (2, 3, 5, 4)"});
  GuardedTensor k0(kF32, {2, 0, 5, 4}), v0(kF32, {2, 0, 5, 6});
  in.k = k0.view();
  in.v = v0.view();
  expect_error({"q has Hq=4 heads, which is not a multiple of k's Hkv=0"});
}

TEST_F(Validation, BatchMismatch) {
  GuardedTensor k3(kF32, {3, 2, 5, 4});
  in.k = k3.view();
  expect_error({"k has batch 3 but q has batch 2"});
  in.k = k_.view();
  GuardedTensor v1(kF32, {1, 2, 5, 6});
  in.v = v1.view();
  expect_error({"v has batch 1 but q has batch 2"});
}

TEST_F(Validation, WrongOutputShapes) {
  GuardedTensor out5(kF32, {2, 4, 3, 5});
  outs.out = out5.view();
  expect_error({"out has shape (2, 4, 3, 5) but must be (2, 4, 3, 6) = (B, Hq, Nq, Dv)"});
  outs.out = out_.view();
  GuardedTensor w4(kF32, {2, 4, 3, 4});
  outs.weights = w4.view();
  expect_error({"weights has shape (2, 4, 3, 4) but must be (2, 4, 3, 5) = (B, Hq, Nq, Nk)"});
  outs.weights = weights_.view();
  GuardedTensor l4(kF32, {2, 4, 4}), l_rank4(kF32, {2, 4, 3, 1});
  outs.lse = l4.view();
  expect_error({"lse has shape (2, 4, 4) but must be (2, 4, 3) = (B, Hq, Nq)"});
  outs.lse = l_rank4.view();
  expect_error({"lse has rank 4 but must have rank 1..3"});
  EXPECT_TRUE(out5.untouched() && w4.untouched() && l4.untouched() && l_rank4.untouched());
}

TEST_F(Validation, WrongOutputShapeNamesTheRankTwoAndThreeForms) {
  GuardedTensor q2(kF32, {3, 4}), k2(kF32, {5, 4}), v2(kF32, {5, 6}), out2(kF32, {3, 5}), q3(kF32, {4, 3, 4}),
      k3(kF32, {2, 5, 4}), v3(kF32, {2, 5, 6}), out3(kF32, {4, 3, 5});
  in = {q2.view(), k2.view(), v2.view(), std::nullopt};
  outs = {out2.view(), std::nullopt, std::nullopt};
  expect_error({"out has shape (3, 5) but must be (3, 6) = (Nq, Dv)"});
  in = {q3.view(), k3.view(), v3.view(), std::nullopt};
  outs = {out3.view(), std::nullopt, std::nullopt};
  expect_error({"out has shape (4, 3, 5) but must be (4, 3, 6) = (Hq, Nq, Dv)"});
  EXPECT_TRUE(out2.untouched() && out3.untouched());
}

TEST_F(Validation, NonUnitLastStride) {
  GuardedTensor q2(kF32, {2, 4, 3, 4}, Layout::kPadded, false);  // last stride 2
  in.q = q2.view();
  expect_error({"q must have stride 1 in its last dim, but has stride 2 (shape (2, 4, 3, 4))"});
  in.q = q_.view();
  in.k.strides[3] = -1;
  expect_error({"k must have stride 1 in its last dim, but has stride -1 (shape (2, 2, 5, 4))"});
  in.k = k_.view();
  in.v.strides[3] = 0;
  expect_error({"v must have stride 1 in its last dim, but has stride 0 (shape (2, 2, 5, 6))"});
  in.v = v_.view();
  GuardedTensor out2(kF32, {2, 4, 3, 6}, Layout::kPadded, false);
  outs.out = out2.view();
  expect_error({"out must have stride 1 in its last dim, but has stride 2 (shape (2, 4, 3, 6))"});
  EXPECT_TRUE(out2.untouched());
}

TEST_F(Validation, MaskThatDoesNotBroadcast) {
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{3, 4}, {2, 1, 1, 4}, {3, 3, 5}}) {
    GuardedTensor m(DType::kBool, shape);
    in.mask = m.view();
    expect_error({"mask has shape " + m.view().shape_string() +
                  ", which does not broadcast to the scores (2, 4, 3, 5) = (B, Hq, Nq, Nk)"});
  }
}

TEST_F(Validation, MaskWithMoreDimsThanTheScores) {
  GuardedTensor q3(kF32, {4, 3, 4}), k3(kF32, {2, 5, 4}), v3(kF32, {2, 5, 6}), out3(kF32, {4, 3, 6});
  GuardedTensor m(DType::kBool, {1, 4, 3, 5});
  in = {q3.view(), k3.view(), v3.view(), m.view()};
  outs = {out3.view(), std::nullopt, std::nullopt};
  expect_error({"mask has shape (1, 4, 3, 5), more dims than the scores (4, 3, 5) = (Hq, Nq, Nk)"});
  EXPECT_TRUE(out3.untouched());
}

TEST_F(Validation, MaskOfAnotherFloatDtype) {
  GuardedTensor m(DType::kFloat64, {3, 5});
  in.mask = m.view();
  expect_error({"mask has dtype float64 but must be bool or q's dtype float32"});
}

TEST_F(Validation, FloatMaskWithNanOrPlusInfinity) {
  // -inf blocks and is fine; +inf and NaN have no softmax. Both dtypes, a broadcast shape.
  for (DType dt : {kF32, DType::kFloat64}) {
    GuardedTensor q(dt, q_.shape()), k(dt, k_.shape()), v(dt, v_.shape()), out(dt, out_.shape());
    GuardedTensor m(dt, {4, 1, 5});
    for (GuardedTensor* t : {&q, &k, &v, &m}) fill(*t);
    in = {q.view(), k.view(), v.view(), m.view()};
    outs = {out.view(), std::nullopt, std::nullopt};
    m.set(2 * 5 + 1, -std::numeric_limits<double>::infinity());
    EXPECT_NO_THROW(sdpa::attention(in, outs, options));
    m.set(3 * 5 + 4, std::numeric_limits<double>::infinity());
    expect_error({"mask has +inf at index (3, 0, 4)", "finite biases, or -inf to block"});
    m.set(3 * 5 + 4, 0.0);
    m.set(1 * 5 + 0, std::numeric_limits<double>::quiet_NaN());
    expect_error({"mask has NaN at index (1, 0, 0)"});
  }
}

TEST_F(Validation, ShapeWhoseElementCountOverflows) {
  in.k.shape[1] = int64_t{1} << 40;
  in.k.shape[2] = int64_t{1} << 40;
  expect_error({"k has shape", "more elements than int64_t counts"});
}

TEST_F(Validation, NonFiniteScale) {
  for (double s : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::quiet_NaN()}) {
    options.scale = s;
    expect_error({"scale must be finite, got "});
  }
}

TEST_F(Validation, UnknownEnumValues) {
  options.causal = static_cast<sdpa::Causal>(7);
  expect_error({"causal has an unknown value 7"});
  options.causal = sdpa::Causal::kNone;
  options.backend = static_cast<sdpa::Backend>(9);
  expect_error({"backend has an unknown value 9"});
}

TEST_F(Validation, NullDataWithNonEmptyShape) {
  in.k.data = nullptr;
  expect_error({"k has no data but shape (2, 2, 5, 4)"});
  in.k = k_.view();
  in.mask->data = nullptr;
  expect_error({"mask has no data but shape (3, 5)"});
  in.mask = mask_.view();
  outs.lse->data = nullptr;
  expect_error({"lse has no data but shape (2, 4, 3)"});
}

TEST(Threads, NegativeCountIsAnError) {
  EXPECT_THROW(sdpa::set_num_threads(-1), sdpa::Error);
  EXPECT_GE(sdpa::num_threads(), 1);
}

TEST_F(Validation, NullDataIsFineWhenEmpty) {
  // Nq = 0: nothing to read or write, so no data is needed.
  in.q.shape[2] = 0;
  in.q.data = nullptr;
  in.mask = std::nullopt;
  outs.out.shape[2] = 0;
  outs.weights->shape[2] = 0;
  outs.lse->shape[2] = 0;
  outs.out.data = nullptr;
  EXPECT_NO_THROW(sdpa::attention(in, outs, options));
  EXPECT_TRUE(weights_.untouched() && lse_.untouched());
}

}  // namespace
