// The dtypes: one table of what each DType is, then the scalar conversions of the storage
// types. Tensors are stored as float64, float32, bfloat16 or float16; the kernels compute
// (accumulate scores, sums, outputs, gradients) in float64 for float64 storage and in float32
// for everything else. Inputs are widened exactly; results are rounded once, to nearest even,
// when stored. These are the scalar conversions every slow path uses (validation, the
// references, fallbacks, writing results); the kernels widen whole rows with SIMD
// (flash/rows-inl.h) and agree with these bit for bit.
//
// Adding a storage dtype: its DType (include/sdpa/attention.h), its row in kDTypeTable, its
// widening and rounding below (load_as, store_as; write_row's row loop in problem.h), the
// kernels' row reader (flash/rows-inl.h's WidenRow, Widened, WithStorage) and the tests. Names,
// sizes, compute types, validation's lists of dtypes and the .npy descriptor follow the row.
// Any new row also reaches: the .npy reader (cli/npy.cc takes every row's descriptor: npy_test's
// unsupported descriptors and fuzz/npy_fuzz.cc's accepted dtypes must follow) and every switch
// over DType (-Werror=switch: tests/test_util.cc, bench/cases.cc, cli/cli_test.cc).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "sdpa/attention.h"

namespace sdpa::internal {

// What one DType is (as ggml's type traits): the table below has one row per DType, in the
// enum's order.
struct DTypeTraits {
  DType dtype;
  const char* name;       // dtype_name(): how errors, the CLI and Python spell it
  int64_t bytes;          // per element (dtype_size())
  bool storage;           // a floating-point storage type of q, k, v, out and float masks
  DType compute;          // for a storage type (or an 8-bit K/V type), what the kernels compute in; else the dtype itself
  const char* npy_descr;  // the .npy header's descr (numpy.save's dtype.str), read and written by cli/npy.cc
};

inline constexpr DTypeTraits kDTypeTable[] = {
    {DType::kBool, "bool", 1, false, DType::kBool, "|b1"},
    {DType::kFloat32, "float32", 4, true, DType::kFloat32, "<f4"},
    {DType::kFloat64, "float64", 8, true, DType::kFloat64, "<f8"},
    // NumPy has no bfloat16: numpy.save writes an ml_dtypes.bfloat16 array's dtype.str, '<V2' (a
    // 2-byte void with a byte order, which no NumPy type has: its own is '|V2'); bfloat16 is
    // ml_dtypes' only 2-byte type (its float8, float6, float4 and int4 are '<V1').
    {DType::kBFloat16, "bfloat16", 2, true, DType::kFloat32, "<V2"},
    {DType::kFloat16, "float16", 2, true, DType::kFloat32, "<f2"},
    {DType::kInt32, "int32", 4, false, DType::kInt32, "<i4"},
    {DType::kInt64, "int64", 8, false, DType::kInt64, "<i8"},
    {DType::kInt8, "int8", 1, false, DType::kFloat32, "|i1"},    // 8-bit K/V (KVQuant): computed in float32
    {DType::kUInt8, "uint8", 1, false, DType::kFloat32, "|u1"},
};
constexpr bool table_in_enum_order() {
  for (size_t i = 0; i < std::size(kDTypeTable); ++i)
    if (static_cast<size_t>(kDTypeTable[i].dtype) != i) return false;
  return true;
}
static_assert(table_in_enum_order(), "kDTypeTable has one row per DType, in the enum's order");

// DType t's row. A value outside the enum (which no check lets through) reads as kUnknownDType:
// named unknown, 0 bytes, no storage type.
inline constexpr DTypeTraits kUnknownDType{DType::kBool, "unknown", 0, false, DType::kBool, ""};
constexpr const DTypeTraits& dtype_traits(DType t) {
  const auto i = static_cast<size_t>(t);
  return i < std::size(kDTypeTable) ? kDTypeTable[i] : kUnknownDType;
}

// Bytes per element (inline: the slow paths ask it per element).
inline int64_t storage_bytes(DType t) { return dtype_traits(t).bytes; }
inline bool is_float_dtype(DType t) { return dtype_traits(t).storage; }
// The compute type of a floating-point storage dtype: float64 for float64, float32 otherwise.
inline DType compute_dtype(DType storage) { return dtype_traits(storage).compute; }

// The dtype of a compute type.
template <typename T>
constexpr DType dtype_of() {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double");
  return sizeof(T) == 8 ? DType::kFloat64 : DType::kFloat32;
}

// bfloat16 is the upper half of a float32: widening is a shift.
inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds to nearest even; NaN stays NaN (made quiet, sign and top payload bits kept), a value
// past bfloat16's largest rounds to inf as IEEE rounding does.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. Widening is exact.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf, NaN (payload kept)
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else {
    const float f = static_cast<float>(mant) * 0x1p-24f;  // zero or subnormal: mant · 2^-24, exact
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds to nearest even: values from 65520 (halfway past the largest, 65504) up become inf,
// values below the smallest subnormal's half become 0; NaN stays NaN (quiet).
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a >= 0x38800000u) {  // normal in float16 (>= 2^-14): round the 13 dropped bits
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r >> 13) - (112u << 10)));
  }
  float mag;
  std::memcpy(&mag, &a, sizeof mag);
  // Subnormal: the count of 2^-24 units, rounded to nearest even (the default rounding mode);
  // 1024 units is the smallest normal, whose encoding is exactly 0x400.
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(mag * 0x1p24f)));
}

// x rounded to nearest even in the 16-bit storage type t (bfloat16 or float16) and widened back:
// Options::precision kFast's rounding of a weight (the naive twin's; the kernels' is SIMD).
inline float rounded_to_16bit(DType t, float x) {
  return t == DType::kBFloat16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
}

// Element i of a rank-1 int32 or int64 view (seqlens_k, cu_seqlens), any stride and alignment.
inline int64_t index_at(const TensorView& t, int64_t i) {
  const char* at = static_cast<const char*>(t.data) + i * t.strides[0] * storage_bytes(t.dtype);
  if (t.dtype == DType::kInt32) {
    int32_t x;
    std::memcpy(&x, at, sizeof x);
    return x;
  }
  int64_t x;
  std::memcpy(&x, at, sizeof x);
  return x;
}

// The value of an 8-bit K/V element x (int8 or uint8, as float) with its zero point z (0 for
// int8) and scale s (KVQuant's rule): fl32(fl32(x - z) · s), two roundings (the build never
// contracts them into an FMA). The kernels' vector reads (rows-inl.h's RowReader::Load) are
// this rule a vector at a time.
inline float dequantised(float x, float z, float s) {
  const float centred = x - z;
  return centred * s;
}

// Element `p` of a float tensor of dtype t, widened to T (exact unless T is narrower than t).
template <typename T>
T load_as(DType t, const void* p) {
  switch (t) {
    case DType::kFloat32: return static_cast<T>(*static_cast<const float*>(p));
    case DType::kFloat64: return static_cast<T>(*static_cast<const double*>(p));
    case DType::kBFloat16: return static_cast<T>(bf16_to_f32(*static_cast<const uint16_t*>(p)));
    case DType::kFloat16: return static_cast<T>(f16_to_f32(*static_cast<const uint16_t*>(p)));
    case DType::kBool:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kUInt8: break;
  }
  std::abort();  // validation admits only float dtypes here
}

// Stores x rounded once to dtype t (a float64 value bound for bfloat16 goes through float32:
// two roundings, which only the float64 references do, and which the tests' rule covers).
template <typename T>
void store_as(DType t, void* p, T x) {
  switch (t) {
    case DType::kFloat32: *static_cast<float*>(p) = static_cast<float>(x); return;
    case DType::kFloat64: *static_cast<double*>(p) = static_cast<double>(x); return;
    case DType::kBFloat16: *static_cast<uint16_t*>(p) = f32_to_bf16(static_cast<float>(x)); return;
    case DType::kFloat16: *static_cast<uint16_t*>(p) = f32_to_f16(static_cast<float>(x)); return;
    case DType::kBool:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kUInt8: break;
  }
  std::abort();
}

}  // namespace sdpa::internal
