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
    expect_sdpa_error([&] { sdpa::attention(in, outs, options); }, substrings);
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

// sdpa::validate runs the same checks of inputs and options without any output: the CLI calls
// it before allocating outputs whose size the inputs decide.
TEST_F(Validation, ValidateChecksInputsAndOptionsWithoutOutputs) {
  EXPECT_NO_THROW(sdpa::validate(in, options));
  GuardedTensor k_bad(kF32, {2, 2, 5, 3});
  in.k = k_bad.view();
  expect_sdpa_error([&] { sdpa::validate(in, options); }, {"k has Dk=3 but q has Dk=4"});
  in.k = k_.view();
  options.scale = 1e39;
  expect_sdpa_error([&] { sdpa::validate(in, options); }, {"scale=1e+39 cannot be held by float32"});
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
  expect_error({"q has dtype bool but must be float32, float64, bfloat16 or float16"});
}

TEST_F(Validation, DtypeMismatch) {
  GuardedTensor k64 = k_.converted(DType::kFloat64, Layout::kContiguous);
  in.k = k64.view();
  expect_error({"k has dtype float64 but q has dtype float32 (k and v take q's dtype, or bfloat16 or float16 under float32 q)"});
  in.k = k_.view();
  GuardedTensor v64 = v_.converted(DType::kFloat64, Layout::kContiguous);
  in.v = v64.view();
  expect_error({"v has dtype float64 but k has dtype float32"});
  in.v = v_.view();
  GuardedTensor out64(DType::kFloat64, {2, 4, 3, 6}), w64(DType::kFloat64, {2, 4, 3, 5}), l64(DType::kFloat64, {2, 4, 3});
  outs.out = out64.view();
  expect_error({"out has dtype float64 but q has dtype float32"});
  outs.out = out_.view();
  outs.weights = w64.view();
  expect_error({"weights has dtype float64 but must be float32, the compute type of float32 q"});
  outs.weights = weights_.view();
  outs.lse = l64.view();
  expect_error({"lse has dtype float64 but must be float32, the compute type of float32 q"});
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
  expect_error({"mask has dtype float64 but must be bool, float32 or q's dtype float32"});
}

TEST_F(Validation, FloatMaskWithNanOrPlusInfinity) {
  // -inf blocks and is fine; +inf and NaN (either sign) have no softmax. Every float dtype a
  // mask may have (problem.cc checks their bits, one rule per dtype), a broadcast shape.
  for (DType dt : {kF32, DType::kFloat64, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
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
    m.set(1 * 5 + 0, -std::numeric_limits<double>::quiet_NaN());
    expect_error({"mask has NaN at index (1, 0, 0)"});
    m.set(1 * 5 + 0, -1e6);  // finite, or -inf in float16: either is allowed
    EXPECT_NO_THROW(sdpa::attention(in, outs, options));
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

TEST_F(Validation, OutputWithStrideZeroOnADimOfExtentAboveOne) {
  // Several indices on one element: threads would race writing it.
  outs.out.strides[1] = 0;
  expect_error({"out has stride 0 in dim 1 (shape (2, 4, 3, 6), strides (72, 0, 6, 1))", "overlap itself"});
  outs.out = out_.view();
  outs.weights->strides[2] = 0;
  expect_error({"weights has stride 0 in dim 2 (shape (2, 4, 3, 5), strides (60, 15, 0, 1))"});
  outs.weights = weights_.view();
  outs.weights->strides[3] = 0;  // weights may have any last-dim stride, but not 0
  expect_error({"weights has stride 0 in dim 3"});
  outs.weights = weights_.view();
  outs.lse->strides[0] = 0;
  expect_error({"lse has stride 0 in dim 0 (shape (2, 4, 3), strides (0, 3, 1))"});
  outs.lse = lse_.view();
  for (int d = 0; d < 3; ++d) outs.out.strides[d] = 0;
  expect_error({"out has stride 0 in dim 0"});
}

TEST_F(Validation, OutputStrideZeroIsFineOnDimsOfExtentOneAndWhenEmpty) {
  // A dim of extent 1 never steps, so its stride is never used; an empty output is never written.
  GuardedTensor q(kF32, {1, 4, 1, 4}), k(kF32, {1, 2, 5, 4}), v(kF32, {1, 2, 5, 6});
  GuardedTensor out(kF32, {1, 4, 1, 6}), w(kF32, {1, 4, 1, 5}), l(kF32, {1, 4, 1});
  for (GuardedTensor* t : {&q, &k, &v}) fill(*t);
  in = {q.view(), k.view(), v.view(), std::nullopt};
  outs = {out.view(), w.view(), l.view()};
  outs.out.strides[0] = outs.out.strides[2] = 0;
  outs.weights->strides[0] = outs.weights->strides[2] = 0;
  outs.lse->strides[0] = outs.lse->strides[2] = 0;
  EXPECT_NO_THROW(sdpa::attention(in, outs, options));
  EXPECT_FALSE(out.untouched());
  EXPECT_TRUE(out.guards_intact() && w.guards_intact() && l.guards_intact());

  in = {q_.view(), k_.view(), v_.view(), std::nullopt};
  in.q.shape[2] = 0;  // Nq = 0
  outs = {out_.view(), weights_.view(), lse_.view()};
  for (sdpa::TensorView* t : {&outs.out, &*outs.weights}) {
    t->shape[2] = 0;
    t->strides[0] = t->strides[1] = t->strides[2] = 0;
  }
  outs.lse->shape[2] = 0;
  outs.lse->strides[0] = outs.lse->strides[1] = 0;
  EXPECT_NO_THROW(sdpa::attention(in, outs, options));
  EXPECT_TRUE(out_.untouched() && weights_.untouched() && lse_.untouched());
}

// attention_backward: the gradients it writes must not have stride 0 on a dim of extent > 1;
// out, lse and dout, which it only reads, may (a broadcast dout, as torch gives for sum()).
class BackwardStrideValidation : public Validation {
 protected:
  BackwardStrideValidation() {
    outs.weights = std::nullopt;
    in.mask = std::nullopt;
    sdpa::attention(in, outs, options);  // out_ and lse_ for the backward
    std::mt19937 rng(3);
    fill_normal(dout_, rng);
    grads = {dq_.view(), dk_.view(), dv_.view()};
  }

  void call() { sdpa::attention_backward(in, out_.view(), lse_.view(), dout, grads, options); }

  void expect_backward_error(const std::vector<std::string>& substrings) {
    expect_sdpa_error([&] { call(); }, substrings);
    EXPECT_TRUE(dq_.untouched() && dk_.untouched() && dv_.untouched());
  }

  GuardedTensor dout_{kF32, {2, 4, 3, 6}}, dq_{kF32, {2, 4, 3, 4}}, dk_{kF32, {2, 2, 5, 4}}, dv_{kF32, {2, 2, 5, 6}};
  sdpa::TensorView dout = dout_.view();
  sdpa::Gradients grads;
};

TEST_F(BackwardStrideValidation, GradientWithStrideZero) {
  grads.dq.strides[2] = 0;
  expect_backward_error({"dq has stride 0 in dim 2 (shape (2, 4, 3, 4), strides (48, 12, 0, 1))"});
  grads = {dq_.view(), dk_.view(), dv_.view()};
  grads.dk.strides[0] = 0;
  expect_backward_error({"dk has stride 0 in dim 0 (shape (2, 2, 5, 4)"});
  grads = {dq_.view(), dk_.view(), dv_.view()};
  grads.dv.strides[1] = 0;
  expect_backward_error({"dv has stride 0 in dim 1 (shape (2, 2, 5, 6)"});
}

TEST_F(BackwardStrideValidation, InputsItOnlyReadsMayHaveStrideZero) {
  GuardedTensor row(kF32, {6});  // one row of dout, broadcast to (2, 4, 3, 6)
  std::mt19937 rng(4);
  fill_normal(row, rng);
  dout = row.view();
  dout.rank = 4;
  for (int d = 0; d < 4; ++d) dout.shape[d] = out_.shape()[static_cast<size_t>(d)];
  dout.strides[0] = dout.strides[1] = dout.strides[2] = 0;
  dout.strides[3] = 1;
  EXPECT_NO_THROW(call());
  EXPECT_FALSE(dq_.untouched());
  EXPECT_TRUE(dq_.guards_intact() && dk_.guards_intact() && dv_.guards_intact());
}

TEST_F(Validation, DropoutNeedsASeed) {
  // No default seed: a training loop that forgot it would drop the same weights every step.
  options.dropout_p = 0.1;
  expect_error({"dropout_p=0.1 needs a seed"});
  options.dropout_p = 0.25;
  expect_error({"dropout_p=0.25 needs a seed", "Options::seed"});
  outs.weights = std::nullopt;
  in.mask = std::nullopt;
  {
    // The backward pass too, before writing any gradient.
    sdpa::Options no_dropout;
    sdpa::attention(in, outs, no_dropout);
    GuardedTensor dout(kF32, {2, 4, 3, 6}), dq(kF32, {2, 4, 3, 4}), dk(kF32, {2, 2, 5, 4}), dv(kF32, {2, 2, 5, 6});
    fill(dout);
    expect_sdpa_error(
        [&] {
          sdpa::attention_backward(in, out_.view(), lse_.view(), dout.view(), {dq.view(), dk.view(), dv.view()},
                                   options);
        },
        {"dropout_p=0.25 needs a seed"});
    EXPECT_TRUE(dq.untouched() && dk.untouched() && dv.untouched());
    options.seed = 0;  // any explicit seed, 0 included, is fine
    const sdpa::Gradients grads{dq.view(), dk.view(), dv.view()};
    EXPECT_NO_THROW(sdpa::attention_backward(in, out_.view(), lse_.view(), dout.view(), grads, options));
  }
  EXPECT_NO_THROW(sdpa::attention(in, outs, options));
  // Without dropout no seed is needed (the base call), and an out-of-range dropout_p is
  // reported as such even without a seed.
  options.seed = std::nullopt;
  options.dropout_p = 1.0;
  expect_sdpa_error([&] { sdpa::attention(in, outs, options); }, {"dropout_p must be in [0, 1)"});
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

namespace {

// q, k, v of shape (2^62, 0) with an empty out: valid, and nothing to compute. The call must
// return at once instead of looping over 2^62 empty rows (a regression would hang the test).
TEST(EmptyOutputs, HugeEmptyProblemsReturnAtOnce) {
  const int64_t huge = int64_t{1} << 62;
  sdpa::Inputs in;
  in.q = sdpa::TensorView::contiguous(nullptr, kF32, {huge, 0});
  in.k = in.q;
  in.v = in.q;
  sdpa::Outputs outs;
  outs.out = in.q;
  EXPECT_NO_THROW(sdpa::attention(in, outs, sdpa::Options{}));
  // The backward: dq, dk, dv are empty too (Dk = Dv = 0); lse (Nq,) would be huge, so Nq = 0
  // there and the keys stay huge.
  sdpa::Inputs bin = in;
  bin.q = sdpa::TensorView::contiguous(nullptr, kF32, {0, 0});
  const sdpa::TensorView out = bin.q, dout = bin.q;
  const sdpa::TensorView lse = sdpa::TensorView::contiguous(nullptr, kF32, {0});
  sdpa::Gradients grads{bin.q, in.k, in.v};
  EXPECT_NO_THROW(sdpa::attention_backward(bin, out, lse, dout, grads, sdpa::Options{}));
  // Skipping the work skips no check: an unknown backend is still an error.
  sdpa::Options bad;
  bad.backend = static_cast<sdpa::Backend>(9);
  EXPECT_THROW(sdpa::attention(in, outs, bad), sdpa::Error);
}

}  // namespace
