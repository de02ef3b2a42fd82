// Helpers shared by the backward tests (backward_test.cc and dropout_test.cc): one backward
// problem (inputs, the forward's out and lse, the incoming gradient), its gradients, and the
// tolerance rule of the backward, with or without dropout. See backward_util.cc.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace sdpa_test {

// ---- One backward problem: inputs, the forward's out and lse, the incoming gradient ----

struct Problem {
  Tensors t;
  GuardedTensor out, lse, dout;

  Problem converted(DType dtype) const;
};

// q, k, v (and mask) of t; out and lse from kAuto with `options` (dropout included, as a caller
// chains the two calls), in `layout` (lse with a non-unit last stride when not contiguous);
// dout normal (seeded with `seed`), or set by the caller afterwards.
Problem make_problem(Tensors t, sdpa::Options options, Layout layout, uint32_t seed);

struct Grads {
  GuardedTensor dq, dk, dv;
  sdpa::Gradients gradients() const { return {dq.view(), dk.view(), dv.view()}; }
  testing::AssertionResult guards_intact() const;
  bool untouched() const { return dq.untouched() && dk.untouched() && dv.untouched(); }
};

// dq, dk, dv shaped as q, k, v, of their dtype, in `layout`, all sentinels.
Grads empty_grads(const Tensors& t, Layout layout);
// attention_backward on p with `options` into fresh gradients in `layout`.
Grads backward(const Problem& p, const sdpa::Options& options, Layout layout = Layout::kContiguous);

struct GradValues {
  std::vector<double> g[3];  // dq, dk, dv in C order
};
inline constexpr const char* kGradNames[3] = {"dq", "dk", "dv"};

GradValues values(const Grads& g);

// Bit-for-bit equality of dq, dk and dv.
testing::AssertionResult bitwise_equal(const GradValues& a, const GradValues& b);
testing::AssertionResult bitwise_equal(const Grads& a, const Grads& b);
// Every gradient element finite.
testing::AssertionResult no_nan(const GradValues& v);
// Element-wise |got - want| <= tol; NaN and infinities always fail (gradients are finite).
testing::AssertionResult all_near(const char* what, const std::vector<double>& got, const std::vector<double>& want,
                                  double tol);

// sdpa::dropout_mask for t's weights (shape (Nq, Nk), (Hq, Nq, Nk) or (B, Hq, Nq, Nk), by t's
// rank): 1 = kept, 0 = dropped, in C order (b, h, i, j).
std::vector<double> keep_mask(const Tensors& t, double p, uint64_t seed);

// dq, dk, dv computed the obvious way in float64 from the header's maths on test_util's
// forward oracle, with the dropout of `o` (dropout_p, seed) applied from dropout_mask.
GradValues backward_oracle(const Problem& p, const sdpa::Options& o);

// ---- The tolerance rule of the backward (see backward_util.cc) ----

struct Expected {
  GradValues ref;      // kReference's gradients
  double tol[3] = {0, 0, 0};  // for dq, dk, dv
};

// kReference's gradients for p with `options` (its backend ignored; dropout_p and seed used) and
// the tolerance of each.
testing::AssertionResult expected(const Problem& p, const sdpa::Options& options, Expected& e);
// Each of got's gradients within its tolerance of kReference's.
testing::AssertionResult matches(const Expected& e, const Grads& got);

}  // namespace sdpa_test
