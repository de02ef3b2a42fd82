#include "oracle.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace sdpa_oracle {

double eps(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return DBL_EPSILON;
    case DType::kBFloat16: return 0x1p-7;
    case DType::kFloat16: return 0x1p-10;
    default: return FLT_EPSILON;
  }
}

double round_half(const HalfFormat& f, double x) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);  // |x| = m · 2^e, 0.5 <= m < 1: the leading bit is worth 2^(e - 1)
  const int spacing = std::max(e - f.digits, f.emin - f.digits + 1);  // log2 of the unit in the last place
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -spacing)), spacing);
  return std::abs(r) > f.max ? std::copysign(kInf, x) : r;
}

uint16_t half_bits(const HalfFormat& f, double x) {
  const int exp_bits = f.digits == 8 ? 8 : 5, mant_bits = f.digits - 1, bias = (1 << (exp_bits - 1)) - 1;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0, all_ones = static_cast<uint16_t>(((1 << exp_bits) - 1) << mant_bits);
  if (std::isnan(x)) return static_cast<uint16_t>(all_ones | (1 << (mant_bits - 1)));
  if (std::isinf(x)) return sign | all_ones;
  const double a = std::abs(x);
  if (a < std::ldexp(1.0, f.emin)) return sign | static_cast<uint16_t>(std::ldexp(a, -(f.emin - mant_bits)));  // subnormal
  int e;
  const double m = std::frexp(a, &e);  // a = (2m) · 2^(e - 1)
  const uint16_t mant = static_cast<uint16_t>(std::ldexp(2 * m - 1, mant_bits));
  return sign | static_cast<uint16_t>((e - 1 + bias) << mant_bits) | mant;
}

namespace {

// The value of a 16-bit pattern of format f, from its fields (the definition half_value's
// tables are filled from).
double decode_half(const HalfFormat& f, uint16_t bits) {
  const int exp_bits = f.digits == 8 ? 8 : 5, mant_bits = f.digits - 1, bias = (1 << (exp_bits - 1)) - 1;
  const double sign = bits & 0x8000 ? -1.0 : 1.0;
  const int exp = (bits >> mant_bits) & ((1 << exp_bits) - 1);
  const int mant = bits & ((1 << mant_bits) - 1);
  if (exp == (1 << exp_bits) - 1) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * kInf;
  if (exp == 0) return sign * std::ldexp(mant, f.emin - mant_bits);
  return sign * std::ldexp(1.0 + std::ldexp(mant, -mant_bits), exp - bias);
}

std::vector<double> half_table(const HalfFormat& f) {
  std::vector<double> table(1 << 16);
  for (uint32_t bits = 0; bits < table.size(); ++bits) table[bits] = decode_half(f, static_cast<uint16_t>(bits));
  return table;
}

}  // namespace

// A table per format, built once: the tests read every 16-bit input element many times (the
// tolerance's score magnitudes visit each (i, j, d)), and decoding the fields with ldexp took
// two thirds of a 16-bit sweep case's time.
double half_value(const HalfFormat& f, uint16_t bits) {
  static const std::vector<double> bf16 = half_table(kBF16Format), f16 = half_table(kF16Format);
  return (f.digits == kBF16Format.digits ? bf16 : f16)[bits];
}

double round_to(DType dtype, double x) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<float>(x);
    case DType::kBFloat16: return round_half(kBF16Format, x);
    case DType::kFloat16: return round_half(kF16Format, x);
    default: return x;
  }
}

double scale_of(const sdpa::Options& options, int64_t Dk) {
  return options.scale.value_or(Dk > 0 ? 1.0 / std::sqrt(static_cast<double>(Dk)) : 1.0);
}

Wide query_position(const sdpa::Options& o, int64_t Nq, int64_t Nk, int64_t i) {
  if (o.q_start && o.k_start) return static_cast<Wide>(i) + *o.q_start - *o.k_start;
  return static_cast<Wide>(i) + Nk - Nq;
}

KeyRange key_range(const sdpa::Options& o, int64_t Nq, int64_t Nk, int64_t i) {
  const Wide aligned = query_position(o, Nq, Nk, i);  // query i's key position
  const bool positions = o.q_start && o.k_start;
  KeyRange r{std::numeric_limits<int64_t>::min(), static_cast<Wide>(std::numeric_limits<int64_t>::max()) + 1};
  if (o.causal == sdpa::Causal::kBottomRight || (positions && o.causal == sdpa::Causal::kTopLeft)) {
    r.hi = std::min(r.hi, aligned + 1);
  }
  if (o.causal == sdpa::Causal::kTopLeft && !positions) r.hi = std::min(r.hi, static_cast<Wide>(i) + 1);
  if (o.window.left >= 0) r.lo = std::max(r.lo, aligned - o.window.left);
  if (o.window.right >= 0) r.hi = std::min(r.hi, aligned + o.window.right + 1);
  return r;
}

bool key_allowed(const sdpa::Options& o, int64_t Nq, int64_t Nk, int64_t i, int64_t j) {
  const KeyRange r = key_range(o, Nq, Nk, i);
  return j >= r.lo && j < r.hi;
}

int64_t allowed_count(const sdpa::Options& o, int64_t Nq, int64_t Nk, int64_t i) {
  const KeyRange r = key_range(o, Nq, Nk, i);
  const Wide lo = std::max<Wide>(r.lo, 0), hi = std::min<Wide>(r.hi, Nk);
  return hi > lo ? static_cast<int64_t>(hi - lo) : 0;
}

double alibi_bias(double slope, int64_t Nq, int64_t L, int64_t i, int64_t j) {
  const int64_t dist = i + (L - Nq) - j;
  return -slope * static_cast<double>(dist < 0 ? -dist : dist);
}

double alibi_bias(double slope, const sdpa::Options& o, int64_t Nq, int64_t L, int64_t i, int64_t j) {
  const Wide dist = query_position(o, Nq, L, i) - j;
  return -slope * static_cast<double>(dist < 0 ? -dist : dist);
}

}  // namespace sdpa_oracle
