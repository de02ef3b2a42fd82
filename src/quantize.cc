// quantize_kv: float K/V rows into an 8-bit cache's values, scales and zero points, by the rule
// kv_cache.h states (a plain loop: it is O(n · D), as the copy into a cache is).
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>

#include "checks.h"
#include "sdpa/kv_cache.h"
#include "storage.h"

namespace sdpa {
namespace internal {
namespace {

// The element offset of row `row` (C order over t's first `lead` dims) of t.
int64_t row_offset(const TensorView& t, int lead, int64_t row) {
  int64_t offset = 0;
  for (int d = lead - 1; d >= 0; --d) {
    offset += row % t.shape[d] * t.strides[d];
    row /= t.shape[d];
  }
  return offset;
}

int64_t rows_of(const TensorView& x) {
  int64_t rows = 1;
  for (int d = 0; d + 1 < x.rank; ++d) rows *= x.shape[d];
  return rows;
}

const std::byte* element(const TensorView& t, int64_t offset) {
  return static_cast<const std::byte*>(t.data) + offset * storage_bytes(t.dtype);
}

// The rule for one group u of n elements (float64), at `p` with unit stride.
QuantScale group_scale(DType values, DType dtype, const std::byte* p, int64_t n, const char* name, int64_t row,
                       int64_t g) {
  const int64_t bytes = storage_bytes(dtype);
  double lo = 0.0, hi = 0.0;  // the range includes 0, so that a 0 is stored exactly
  for (int64_t e = 0; e < n; ++e) {
    const double u = load_as<double>(dtype, p + e * bytes);
    if (!std::isfinite(u)) {
      fail(std::string(name) + " holds " + std::to_string(u) + " in row " + std::to_string(row) +
           " (C order over its dims but the last), feature " + std::to_string(g * n + e) +
           ": an 8-bit cache holds finite values only");
    }
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  QuantScale q;
  // The quotient in float64, rounded once to float32: for float32, bfloat16 and float16 x this
  // is the exact quotient's rounding (float64 has more than 2 · 24 + 2 bits).
  q.scale = values == DType::kInt8 ? static_cast<float>(std::max(hi, -lo) / 127.0)
                                   : static_cast<float>((hi - lo) / 255.0);
  if (!std::isfinite(q.scale)) {
    fail(std::string(name) + " row " + std::to_string(row) + " group " + std::to_string(g) + " spans [" +
         std::to_string(lo) + ", " + std::to_string(hi) + "], whose scale is beyond float32's largest value");
  }
  if (values == DType::kUInt8 && q.scale > 0.0f) {
    // (+ 0.0: lo = 0 gives -lo = -0, and the zero point is stored as +0)
    q.zero = static_cast<float>(std::clamp(std::nearbyint(-lo / q.scale), 0.0, 255.0) + 0.0);
  }
  return q;
}

}  // namespace

std::vector<QuantScale> quant_scales(const char* name, const TensorView& x, DType values, int64_t groups) {
  const int lead = x.rank - 1;
  const int64_t rows = rows_of(x), D = x.shape[lead], n = groups > 0 ? D / groups : 0;
  std::vector<QuantScale> scales(static_cast<size_t>(rows * groups));
  for (int64_t r = 0; r < rows; ++r) {
    const std::byte* row = element(x, row_offset(x, lead, r));
    for (int64_t g = 0; g < groups; ++g) {
      scales[static_cast<size_t>(r * groups + g)] =
          group_scale(values, x.dtype, row + g * n * storage_bytes(x.dtype), n, name, r, g);
    }
  }
  return scales;
}

void write_quantized(const TensorView& x, const QuantScale* scales, const TensorView& values, const TensorView& scale,
                     const TensorView* zero) {
  const int lead = x.rank - 1;
  const int64_t rows = rows_of(x), D = x.shape[lead];
  const bool grouped = scale.rank == x.rank;
  const int64_t groups = grouped ? scale.shape[lead] : 1, n = groups > 0 ? D / groups : 0;
  const int64_t bytes = storage_bytes(x.dtype);
  const bool is_int8 = values.dtype == DType::kInt8;
  const double lo = is_int8 ? -127.0 : 0.0, hi = is_int8 ? 127.0 : 255.0;
  for (int64_t r = 0; r < rows; ++r) {
    const std::byte* in = element(x, row_offset(x, lead, r));
    auto* out = static_cast<std::byte*>(values.data) + row_offset(values, lead, r);
    const int64_t s_at = row_offset(scale, lead, r), z_at = zero ? row_offset(*zero, lead, r) : 0;
    for (int64_t g = 0; g < groups; ++g) {
      const QuantScale q = scales[r * groups + g];
      static_cast<float*>(scale.data)[s_at + (grouped ? g * scale.strides[lead] : 0)] = q.scale;
      if (zero) static_cast<float*>(zero->data)[z_at + (grouped ? g * zero->strides[lead] : 0)] = q.zero;
      for (int64_t e = g * n; e < (g + 1) * n; ++e) {
        double v = 0.0;  // s = 0: every element is 0 (and so is z)
        if (q.scale > 0.0f) {
          const double u = load_as<double>(x.dtype, in + e * bytes);
          v = std::clamp(std::nearbyint(u / q.scale) + q.zero, lo, hi);
        }
        out[e] = static_cast<std::byte>(is_int8 ? static_cast<uint8_t>(static_cast<int8_t>(v)) : static_cast<uint8_t>(v));
      }
    }
  }
}

}  // namespace internal

namespace {

using internal::fail;

// scale (or zero) against x: x's shape without its last dim, or with a last dim G dividing D.
// Returns G.
int64_t check_scale_shape(const char* name, const TensorView& t, const TensorView& x) {
  const int lead = x.rank - 1;
  TensorView rows = x;
  rows.rank = lead;
  const std::string want = rows.shape_string() + " (x's shape without its last dim: one per row) or that with a " +
                           "last dim G dividing D = " + std::to_string(x.shape[lead]) + " (G groups per row)";
  bool ok = t.rank == x.rank || t.rank == lead;
  for (int d = 0; ok && d < lead; ++d) ok = t.shape[d] == x.shape[d];
  if (ok && t.rank == x.rank) {
    const int64_t G = t.shape[lead];
    ok = G >= 1 && x.shape[lead] % G == 0;
  }
  if (!ok) fail(std::string(name) + " has shape " + t.shape_string() + " but x has shape " + x.shape_string() +
                ": " + name + " must be " + want);
  if (t.dtype != DType::kFloat32) {
    fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but must be float32");
  }
  internal::check_no_zero_stride(name, t);
  return t.rank == x.rank ? t.shape[lead] : 1;
}

}  // namespace

void quantize_kv(const TensorView& x, const TensorView& values, const TensorView& scale,
                 const std::optional<TensorView>& zero) {
  internal::check_basic("x", x, 1, 4);
  if (!internal::is_float_dtype(x.dtype)) {
    fail(std::string("x has dtype ") + dtype_name(x.dtype) + " but must be " + internal::storage_dtype_list());
  }
  const int last = x.rank - 1;
  if (x.numel() > 0 && x.shape[last] > 1 && x.strides[last] != 1) fail("x must have a unit last stride");
  internal::check_basic("values", values, 0, 4);
  if (values.dtype != DType::kInt8 && values.dtype != DType::kUInt8) {
    fail(std::string("values has dtype ") + dtype_name(values.dtype) + " but must be int8 or uint8");
  }
  bool same = values.rank == x.rank;
  for (int d = 0; same && d < x.rank; ++d) same = values.shape[d] == x.shape[d];
  if (!same) fail("values has shape " + values.shape_string() + " but must have x's shape " + x.shape_string());
  if (values.numel() > 0 && values.shape[last] > 1 && values.strides[last] != 1) {
    fail("values must have a unit last stride");
  }
  internal::check_no_zero_stride("values", values);
  internal::check_basic("scale", scale, 0, 4);
  const int64_t groups = check_scale_shape("scale", scale, x);
  if (values.dtype == DType::kUInt8 && !zero) fail("zero must be given for uint8 values (their zero points)");
  if (values.dtype == DType::kInt8 && zero) fail("zero is given but int8 values are symmetric (no zero point)");
  if (zero) {
    internal::check_basic("zero", *zero, 0, 4);
    check_scale_shape("zero", *zero, x);
    bool match = zero->rank == scale.rank;
    for (int d = 0; match && d < scale.rank; ++d) match = zero->shape[d] == scale.shape[d];
    if (!match) fail("zero has shape " + zero->shape_string() + " but must have scale's shape " + scale.shape_string());
  }
  const std::vector<internal::QuantScale> scales = internal::quant_scales("x", x, values.dtype, groups);
  internal::write_quantized(x, scales.data(), values, scale, zero ? &*zero : nullptr);
}

}  // namespace sdpa
