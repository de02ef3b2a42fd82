// The tolerance rule, written once for the C++ tests (tests/test_util.cc: matches_reference,
// tests/backward_util.cc: expected and matches) and the fuzzer (fuzz/attention/tolerance.cc:
// check_tolerance, check_bwd_tolerance). Each caller runs the backends on its own tensors and
// reports in its own way (a GoogleTest assertion, a fuzz finding); what a result is compared
// against, how tol is derived and what a miss says are here. Plain C++, no GoogleTest.
//
// tol = factor · (max abs error of kNaive against kReference) + floor, per output.
//
// kNaive is the materialising algorithm in the inputs' own precision: a kernel at most twice as
// inaccurate as it is acceptable. kReference computes in float64, so for float32 inputs it is
// exact to within ~1e-16 and |kNaive - kReference| is kNaive's own error.
//
// Float64 inputs: kNaive and kReference are then the same code and agree bit for bit, so the
// measured error is 0 and says nothing. We estimate the error e of a naive float64 kernel by
// running kNaive in float32 on the inputs rounded to float32 and scaling its error by
// DBL_EPSILON / FLT_EPSILON (rounding errors are, to first order, proportional to the unit
// roundoff; the inputs differ only by that rounding). kReference is then no better than e
// itself, so a kernel within 2e of the exact result is within 3e of kReference: the factor
// is 3 for float64.
//
// The floor: storing a result in the dtype alone can change it by eps/2 relative, and two
// correct kernels may each take a few more roundings on other paths. Where kNaive is exact by
// luck (uniform weights, a single allowed key, ...) 2 * 0 would demand bit-exactness, so allow
// 4 * eps times the output's magnitude:
//   out:     |out| <= max|v| (each row is a convex combination of v rows)  -> 4 eps max|v|
//            With dropout the kept weights are scaled by 1 / (1 - p), so |out| <= max|v| /
//            (1 - p) and the floor scales with it: 4 eps max|v| / (1 - p) (with p = 0.9 a
//            float64 out of 12 from v within ±3.3 got 0.4 ulp of floor without it, and a
//            correct kernel failed by 2 ulp). Weights and lse: dropout does not touch them.
//   weights: 0 <= w <= 1                                                   -> 4 eps
//   lse:     m + log(sum), rounded relative to |m| and to log(sum) >= 0    -> 4 eps (1 + max|lse|)
//
// 16-bit inputs (bfloat16, float16): kNaive computes in float32 from the same stored inputs and
// rounds out to the 16-bit type, so its error is the naive implementation's with that storage;
// weights and lse are float32 (the floors use float32's eps), and out gets one more unit in its
// last place (a float32 result near a tie may round the other way than kReference's float64 one).
//
// The scores' own rounding: a score is only accurate to about eps · S, S = |scale| Σ_d |q_d k_d|
// + |bias| + |alibi| (oracle.h: score_magnitude), whatever the order of its sum; where the terms
// cancel this is far above eps · |score|. A score off by δ moves its weight by w·δ and the row's
// lse by up to δ, so a second correct kernel can differ from kReference by about eps · S in lse
// and weights and by eps · S · 2 max|out| in out. kNaive carries the same error and its measured
// error usually covers it, but on a sharp row (a few dominant keys) it can be lucky: the fuzzer
// found float64 scale-30 scores (|s| ~ 500) where a correct kFlash missed the rule by 4.7x. So
// each floor is at least 2 eps · max S (times max|out| for out):
//   out: 4 eps max|out| -> eps max|out| max(4, 2 max S); weights: eps max(4, 2 max S);
//   lse: eps max(4 (1 + max|lse|), 2 max S).
//
// Summation, the fuzzer's term only (`summation` below; 0 in the tests' rule): a result summed
// over n terms carries roundings that grow like sqrt(n) · eps relative to the sum of their
// sizes, where the rule above counts each size once. The fuzzer's tiny cases with one long row
// showed it (FINDINGS.md F6: float64, Nk 2047, out off by 1.09x a floor without it); the tests'
// cases are sized so the measured error covers it, and keep the tighter rule.
//
// The backward (gradient_tolerance): the same factor on kNaive's error, measured on the same
// (q, k, v, mask, out, lse, dout) and dropout, and the floor eps · (4 max(1, max|ref|) + M), M
// the size of the terms that cancel in the gradient (the callers compute it: backward_util.cc's
// cancellation_magnitudes states it), plus the unit in the last place of a 16-bit gradient.
//
// The maximum error is a noisy statistic when few elements dominate it (a sharp softmax over
// a handful of rows): cases meant to stress accuracy need a few hundred rows.
#pragma once

#include <cfloat>
#include <cstddef>
#include <string>
#include <vector>

#include "oracle.h"

namespace sdpa_oracle {

// The factor on kNaive's measured error: 2; 3 for float64 q (measured in float32, see above).
inline double naive_factor(DType q) { return q == DType::kFloat64 ? 3.0 : 2.0; }
// Float64 q: kNaive's error measured in float32 on the inputs rounded to float32, times this.
inline constexpr double kFloat64ErrorScale = DBL_EPSILON / FLT_EPSILON;

// The largest |x| over the finite entries (0 for none).
double max_abs_finite(const std::vector<double>& xs);

// Where a measurement meets non-finite values: a forward output may hold them (an empty row's
// lse is -inf), and then kNaive's must be kReference's; gradients are finite, so any non-finite
// value leaves no error to measure.
enum class NonFinite { kMustMatch, kNever };

// Raises err to scale · |naive - ref| over the elements finite in both. Returns why no tolerance
// can be derived from the two ("" when one can): their sizes differ, or a non-finite value that
// `non_finite` does not allow. The tests fail on it, the fuzzer skips the check (its inputs may
// overflow kNaive's float32 where kReference's float64 stays finite).
std::string naive_error(const char* what, const std::vector<double>& naive, const std::vector<double>& ref,
                        double scale, double& err, NonFinite non_finite = NonFinite::kMustMatch);

// What the forward floors scale with (see above).
struct ForwardSizes {
  DType dtype;           // q's
  double out_max;        // max|v| / (1 - dropout_p): no |out| is larger
  double max_score;      // the largest score_magnitude over the problem's scores
  double lse_max;        // kReference's max|lse| (max_abs_finite)
  double summation = 0;  // the fuzzer's sqrt(Nk) (see above); 0: the tests' rule
  // Options::precision kFast with 16-bit q: the weights are rounded to q's type, each within a
  // relative eps/2, so their sum, and lse = m + log(sum), move by up to eps/2 (eps q's) in
  // the kernel and in the naive twin alike, at random. lse's tolerance then includes that
  // bound: twice the twin's error alone is a ratio of two random errors, which a row of few
  // keys can put past 2 (a float16 decode row did: 1.03x).
  bool rounds_weights = false;
};
struct ForwardTolerance {
  double out, weights, lse;
};
// tol of each output from kNaive's errors `err` (out, weights, lse) and their factor.
ForwardTolerance forward_tolerance(const double (&err)[3], double factor, const ForwardSizes& sizes);

// One gradient's tolerance: factor · err + e · (4 max(1, ref_max) + M) + (16-bit `stored`: eps
// of it times ref_max), e the compute type's eps (q's: weights and the sums are in it). `sinks`:
// dsinks, stored in its own dtype (float32 under float64 q too), whose eps counts where larger.
struct GradientTolerance {
  double tol;
  std::string terms;  // how tol was made, for the messages
};
GradientTolerance gradient_tolerance(double err, double factor, DType q, DType stored, double ref_max, double M,
                                     bool sinks = false);

// Element-wise |got - want| <= tol; an infinity must be matched exactly; NaN never passes. `overflow` (where rounding
// to a 16-bit stored dtype gives inf; inf: no such allowance): which side of that threshold a result lands on is
// rounding, so an inf against a finite value of the same sign within tol of the threshold passes. The fuzzer allows it
// (its tame values and dropout's 1 / (1 - p) reach float16's 65504); the tests' cases stay far below it and do not.
struct Mismatch {
  size_t count = 0;        // elements off; 0: all within tol
  size_t first = 0;        // the first element off
  size_t worst = 0;        // the element furthest off, in units of tol
  double worst_ratio = 0;  // |got - want| / tol there (inf: a non-finite value off, or sizes)
  std::string message;     // "" when count is 0
};
Mismatch compare(const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol,
                 double overflow = kInf);

}  // namespace sdpa_oracle
