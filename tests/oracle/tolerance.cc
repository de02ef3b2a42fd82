#include "tolerance.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace sdpa_oracle {
namespace {

bool is16(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }

// A number as the messages print it: enough digits to tell neighbouring doubles apart.
std::string num(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

}  // namespace

double max_abs_finite(const std::vector<double>& xs) {
  double m = 0;
  for (double x : xs) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

std::string naive_error(const char* what, const std::vector<double>& naive, const std::vector<double>& ref,
                        double scale, double& err, NonFinite non_finite) {
  if (naive.size() != ref.size()) {
    return std::string(what) + ": kNaive gives " + std::to_string(naive.size()) + " elements, kReference " +
           std::to_string(ref.size());
  }
  for (size_t n = 0; n < naive.size(); ++n) {
    if (std::isfinite(naive[n]) && std::isfinite(ref[n])) {
      err = std::max(err, std::abs(naive[n] - ref[n]) * scale);
    } else if (non_finite == NonFinite::kNever || !(naive[n] == ref[n])) {
      std::ostringstream msg;
      msg.precision(17);
      msg << what << "[" << n << "]: kNaive gives " << naive[n] << " but kReference " << ref[n]
          << (non_finite == NonFinite::kNever ? " (gradients are finite)" : "");
      return msg.str();
    }
  }
  return "";
}

ForwardTolerance forward_tolerance(const double (&err)[3], double factor, const ForwardSizes& s) {
  const double e = eps(compute_dtype(s.dtype));  // weights and lse are stored in the compute type
  const double S2 = 2 * s.max_score;
  const double out_ulp = is16(s.dtype) ? eps(s.dtype) * s.out_max : 0.0;
  // `+ s.summation` is exact for the tests' 0: their tolerances are the rule's without the term.
  return {factor * err[0] + e * s.out_max * (std::max(4.0, S2) + s.summation) + out_ulp,
          factor * err[1] + e * (std::max(4.0, S2) + s.summation),
          factor * err[2] + e * (std::max(4 * (1 + s.lse_max), S2) + s.summation) +
              (s.rounds_weights ? eps(s.dtype) / 2 : 0.0)};
}

GradientTolerance gradient_tolerance(double err, double factor, DType q, DType stored, double ref_max, double M,
                                     bool sinks) {
  const double e = sinks ? std::max(eps(compute_dtype(q)), eps(stored)) : eps(compute_dtype(q));
  const double ulp = is16(stored) ? eps(stored) * ref_max : 0.0;
  const double tol = factor * err + e * (4 * std::max(1.0, ref_max) + M) + ulp;
  return {tol, "measured error " + num(err) + " x " + num(factor) + ", eps " + num(e) + " x (4 max(1, " + num(ref_max) +
                   ") + M " + num(M) + ")" + (ulp > 0 ? " + ulp " + num(ulp) : "")};
}

Mismatch compare(const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol,
                 double overflow) {
  Mismatch m;
  if (got.size() != want.size()) {
    m.count = std::max(got.size(), want.size());
    m.worst_ratio = kInf;
    m.message =
        std::string(what) + ": " + std::to_string(got.size()) + " elements, want " + std::to_string(want.size());
    return m;
  }
  for (size_t n = 0; n < got.size(); ++n) {
    const bool inf = std::isinf(got[n]) || std::isinf(want[n]);
    bool ok = inf ? got[n] == want[n] : std::abs(got[n] - want[n]) <= tol;  // NaN: both comparisons false
    if (!ok && inf && overflow < kInf) {
      const double fin = std::isinf(got[n]) ? want[n] : got[n], infv = std::isinf(got[n]) ? got[n] : want[n];
      ok = std::isfinite(fin) && std::signbit(fin) == std::signbit(infv) && std::abs(fin) + tol >= overflow;
    }
    if (ok) continue;
    const double ratio = std::abs(got[n] - want[n]) / tol;
    const double r = inf || std::isnan(ratio) ? kInf : ratio;
    if (m.count++ == 0) m.first = n;
    if (m.count == 1 || r > m.worst_ratio) m.worst = n, m.worst_ratio = r;
  }
  if (m.count == 0) return m;
  // A stream, not string concatenation: GCC 12's -Wrestrict misreads `"[" + std::to_string(n)`.
  std::ostringstream msg;
  msg.precision(17);
  auto element = [&](size_t n) {
    msg << "[" << n << "] = " << got[n] << ", want " << want[n] << " ("
        << (n == m.worst ? m.worst_ratio : std::abs(got[n] - want[n]) / tol) << " x tol)";
  };
  msg << what << ": " << m.count << " of " << got.size() << " elements off, tol " << tol << "; worst ";
  element(m.worst);
  if (m.first != m.worst) {
    msg << "; first ";
    element(m.first);
  }
  m.message = msg.str();
  return m;
}

}  // namespace sdpa_oracle
