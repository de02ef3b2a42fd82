// The header's rules (include/sdpa/attention.h) written out once for the C++ tests (tests/) and
// the fuzzers (fuzz/), independently of src/: that independence is the point. A rule here is the
// test suite's statement of the contract; the library's own code is checked against it, never
// the other way round. No GoogleTest, no src/ header: only the public API's types.
//
// python/tests/reference.py states the same rules for the Python tests (it cannot share C++).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "sdpa/attention.h"

namespace sdpa_oracle {

using sdpa::DType;

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- Guard patterns ----
// What test and fuzz tensors fill their guards (and unwritten outputs) with: quiet NaNs with a
// recognisable payload, so a guard read into arithmetic poisons the result; 0xA5 for bool; int32
// and int64 take the float patterns of their size.
inline constexpr uint32_t kSentinel32 = 0x7fc5a5a5u;
inline constexpr uint64_t kSentinel64 = 0x7ff8a5a5a5a5a5a5ull;
inline constexpr uint8_t kSentinel8 = 0xa5;
inline constexpr uint16_t kSentinelBF16 = 0x7fa5;  // exponent all ones, mantissa non-zero: NaN
inline constexpr uint16_t kSentinelF16 = 0x7ea5;

// ---- The dtypes ----

// The compute type of q's dtype (the header): float64 for float64, float32 otherwise. Weights and
// lse are stored in it.
inline DType compute_dtype(DType q) { return q == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }
// The spacing above 1: FLT_EPSILON, DBL_EPSILON, 2^-7 (bfloat16), 2^-10 (float16).
double eps(DType dtype);

// The 16-bit formats, written from their definitions: `digits` significant bits, smallest
// normal exponent `emin` (x = m · 2^e with 1 <= m < 2), largest finite value `max`.
struct HalfFormat {
  int digits, emin;
  double max;
};
inline constexpr HalfFormat kBF16Format{8, -126, 0x1.fep127};
inline constexpr HalfFormat kF16Format{11, -14, 65504.0};
inline const HalfFormat& half_format(DType t) { return t == DType::kBFloat16 ? kBF16Format : kF16Format; }

// x rounded to the format, to nearest with ties to even (std::nearbyint's default mode).
double round_half(const HalfFormat& f, double x);
// The bits of a value the format holds exactly (NaN: a quiet NaN), and back.
uint16_t half_bits(const HalfFormat& f, double x);
double half_value(const HalfFormat& f, uint16_t bits);
// x rounded to nearest even in dtype (float32, bfloat16, float16; float64: x), as a double.
double round_to(DType dtype, double x);

// ---- The scores ----

// Options::scale, or its default 1 / sqrt(Dk) (1 for Dk = 0).
double scale_of(const sdpa::Options& options, int64_t Dk);

// The header's causal and window rule: query i of Nq sees key j of Nk when lo <= j < hi. Both
// align bottom-right (query i sits at key position i + Nk - Nq), kTopLeft at key position i.
// With positions (Options::q_start and k_start), query i sits at key position i + q_start -
// k_start for causal (either kind), the window and ALiBi alike.
// The bounds are not clipped to [0, Nk); 128-bit, so no Nq, Nk or window overflows them.
__extension__ typedef __int128 Wide;
struct KeyRange {
  Wide lo, hi;
};
// Query i's key position: i + (Nk - Nq), or i + q_start - k_start with positions.
Wide query_position(const sdpa::Options& options, int64_t Nq, int64_t Nk, int64_t i);
KeyRange key_range(const sdpa::Options& options, int64_t Nq, int64_t Nk, int64_t i);
bool key_allowed(const sdpa::Options& options, int64_t Nq, int64_t Nk, int64_t i, int64_t j);
int64_t allowed_count(const sdpa::Options& options, int64_t Nq, int64_t Nk, int64_t i);  // keys of [0, Nk)

// The additive bias a mask element puts on its score: a bool mask's nonzero 0, its 0 -inf
// (blocked); a float mask's value.
inline double mask_bias(DType mask_dtype, double value) {
  return mask_dtype == DType::kBool ? (value != 0 ? 0.0 : -kInf) : value;
}

// ALiBi's bias -slope · |i + (L - Nq) - j|: query i aligned bottom-right to the sequence's L keys.
double alibi_bias(double slope, int64_t Nq, int64_t L, int64_t i, int64_t j);
// The same at query_position (Options' positions, when set).
double alibi_bias(double slope, const sdpa::Options& options, int64_t Nq, int64_t L, int64_t i, int64_t j);

// The size of the terms that make up a score: |scale| · Σ_d |q_d k_d| (`abs_dot`) + |bias| +
// |alibi| (ALiBi's distance is exact, its product rounded once). A score is only accurate to
// about eps times this, however it is summed, and so are the weights and lse computed from it:
// the tolerance rules' score-rounding term. (0 for a blocked key: the callers' business.)
inline double score_magnitude(double scale, double abs_dot, double bias, double alibi) {
  return std::abs(scale) * abs_dot + std::abs(bias) + std::abs(alibi);
}

}  // namespace sdpa_oracle
