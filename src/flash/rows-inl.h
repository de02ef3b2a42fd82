// The one way the fused kernels read and write tensor rows: storage dtype in memory, compute
// type T in registers. A view that already holds T is used in place (no copy: the float32 and
// float64 paths are what they were); any other storage (bfloat16, float16; a float32 mask
// beside float64 inputs) is widened exactly into per-thread scratch with SIMD, a tile of rows
// at a time, and results are rounded once to the output's dtype (storage.h's rules, which the
// SIMD widening matches bit for bit: widening is exact). Compiled per SIMD target (included by
// score_tile-inl.h).

#if defined(SDPA_FLASH_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_ROWS_INL_H_
#undef SDPA_FLASH_ROWS_INL_H_
#else
#define SDPA_FLASH_ROWS_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows of T: row r at data + r · stride (stride may be negative: a view's own row stride), or,
// with `ptrs` (the decode kernel's tiles of a paged pool, rows in several pages), at ptrs[r].
// Kernels that read data and stride directly never get ptrs (ReadRows gathers instead).
// 8-bit rows (T int8_t or uint8_t, a KVQuant view read in place) carry each row's scales and
// zero points (zeros: null without them): group 0's, groups scale_step (zero_step) floats apart,
// `width` features each.
template <typename T>
struct Rows {
  const T* data = nullptr;
  int64_t stride = 0;
  const T* const* ptrs = nullptr;
  const float* const* scales = nullptr;
  const float* const* zeros = nullptr;
  int64_t scale_step = 0, zero_step = 0, width = 0;
  bool one_group = false;  // one scale per row: group 0 throughout
  const T* row(int64_t r) const { return ptrs != nullptr ? ptrs[r] : data + r * stride; }
};

template <typename S>
inline constexpr bool kIs8Bit = std::is_same_v<S, int8_t> || std::is_same_v<S, uint8_t>;

// Rows [n0, n0 + n) of head (b, h) of v in place, as storage type S: evenly spaced, or for a
// paged view through `ptrs` (n entries, one table lookup per page).
template <typename S>
Rows<S> RowsInPlace(const View4& v, int64_t b, int64_t h, int64_t n0, int64_t n, const S** ptrs) {
  if (!v.paged()) return {v.at<S>(b, h, n0), v.strides[2]};
  for (int64_t r = 0; r < n;) {
    const S* first = v.at<S>(b, h, n0 + r);
    const int64_t stop = std::min(n, v.run_end(n0 + r) - n0);
    for (int64_t x = r; x < stop; ++x) ptrs[x] = first + (x - r) * v.strides[2];
    r = stop;
  }
  return {ptrs[0], v.strides[2], ptrs};
}

// RowsInPlace's rows of an 8-bit view, with each row's scales and zero points (n entries of
// `scales` and `zeros`); for any other storage, RowsInPlace's.
template <typename S>
Rows<S> QuantRowsInPlace(const View4& v, int64_t b, int64_t h, int64_t n0, int64_t n, const S** ptrs,
                         const float** scales, const float** zeros) {
  Rows<S> rows = RowsInPlace(v, b, h, n0, n, ptrs);
  if constexpr (kIs8Bit<S>) {
    const bool has_zero = v.quant.zero != nullptr;
    HWY_DASSERT(has_zero == (std::is_same_v<S, uint8_t>));  // RowReader::Load relies on it
    // One address per run of evenly spaced rows (a page of a paged pool), as RowsInPlace's:
    // a row's scales lie in the row's page, st[2] floats past the previous row's.
    for (int64_t r = 0; r < n;) {
      const int64_t stop = std::min(n, v.run_end(n0 + r) - n0);
      const float* s0 = v.quant_row(false, b, h, n0 + r);
      const float* z0 = has_zero ? v.quant_row(true, b, h, n0 + r) : nullptr;
      for (int64_t x = r; x < stop; ++x) {
        scales[x] = s0 + (x - r) * v.quant.strides[2];
        if (has_zero) zeros[x] = z0 + (x - r) * v.quant.zero_strides[2];
      }
      r = stop;
    }
    rows.scales = scales;
    rows.zeros = has_zero ? zeros : nullptr;
    rows.scale_step = v.quant.strides[3];
    rows.zero_step = v.quant.zero_strides[3];
    rows.width = v.quant.width;
    rows.one_group = v.quant.width >= v.shape[3];
  }
  return rows;
}

// dst[0, n) = src[0, n) of storage dtype `from`, widened to T.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void WidenRow(D d, DType from, const void* src, int64_t n, T* HWY_RESTRICT dst) {
  int64_t c = 0;
  if constexpr (sizeof(T) == 4) {
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
    if (from == DType::kBFloat16) {
      const hn::Rebind<hwy::bfloat16_t, D> dh;
      const auto* s = static_cast<const hwy::bfloat16_t*>(src);
      for (; c + N <= n; c += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, s + c)), d, dst + c);
    } else if (from == DType::kFloat16) {
      const hn::Rebind<hwy::float16_t, D> dh;
      const auto* s = static_cast<const hwy::float16_t*>(src);
      for (; c + N <= n; c += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, s + c)), d, dst + c);
    }
  }
  if (from == dtype_of<T>()) {  // a paged view's rows gathered as they are
    std::copy_n(static_cast<const T*>(src), n, dst);
    return;
  }
  const int64_t bytes = storage_bytes(from);
  for (; c < n; ++c) dst[c] = load_as<T>(from, static_cast<const char*>(src) + c * bytes);
}

// A vector of T from N consecutive elements of storage type S (T itself, or a 16-bit type
// widened exactly), for kernels that widen in registers instead of into scratch (decode).
template <typename S, class D, typename T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> LoadWidened(D d, const S* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<S, T>) {
    return hn::LoadU(d, p);
  } else {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<S, D>(), p));
  }
}

// One element of storage type S as T (exact).
template <typename T, typename S>
HWY_INLINE T Widened(S x) {
  if constexpr (std::is_same_v<S, T>) {
    return x;
  } else if constexpr (std::is_same_v<S, hwy::bfloat16_t>) {
    return bf16_to_f32(x.bits);
  } else {
    static_assert(std::is_same_v<S, hwy::float16_t>);
    return f16_to_f32(x.bits);
  }
}

// Row j of rows of storage type S as T, in registers: S widened exactly (LoadWidened,
// Widened), or 8-bit values dequantised by KVQuant's rule, fl32(fl32(x - z) · s) (a Sub then a
// Mul: two roundings, as Float32Call's scratch copy has them; x - 0 is x, so no zero point
// needs no Sub). Load's N elements (c a multiple of N) lie in one scale group (one group, or
// width % N == 0), or span whole groups (N % width == 0: kv_dequant.h's kFusedWidth rule).
template <typename S, typename T>
struct RowReader {
  const S* x = nullptr;
  const float* s = nullptr;
  const float* z = nullptr;
  int64_t s_step = 0, z_step = 0, width = 1;
  bool one_group = true;
  RowReader() = default;  // reads nothing until assigned
  HWY_INLINE RowReader(const Rows<S>& rows, int64_t j) : x(rows.row(j)) {
    if constexpr (kIs8Bit<S>) {
      s = rows.scales[j];
      z = rows.zeros != nullptr ? rows.zeros[j] : nullptr;
      s_step = rows.scale_step;
      z_step = rows.zero_step;
      width = rows.width;
      one_group = rows.one_group;
    }
  }
  template <class D>
  HWY_INLINE hn::Vec<D> Load(D d, int64_t c) const {
    if constexpr (kIs8Bit<S>) {
      auto xf = hn::ConvertTo(d, hn::PromoteTo(hn::Rebind<int32_t, D>(), hn::LoadU(hn::Rebind<S, D>(), x + c)));
      if (one_group || width >= static_cast<int64_t>(hn::Lanes(d))) {  // one group for the vector
        const int64_t g = one_group ? 0 : c / width;  // (no division per vector for a scale per row)
        // uint8 always has zero points, int8 never (Float32Call::prepare): no test per vector.
        if constexpr (std::is_same_v<S, uint8_t>) xf = hn::Sub(xf, hn::Set(d, z[g * z_step]));
        return hn::Mul(xf, hn::Set(d, s[g * s_step]));
      }
      const int64_t g = c / width;  // groups narrower than the vector: lane i is in group g + i / width
      if constexpr (std::is_same_v<S, uint8_t>) xf = hn::Sub(xf, Spread(d, z + g * z_step, z_step));
      return hn::Mul(xf, Spread(d, s + g * s_step, s_step));
    } else {
      return LoadWidened(d, x + c);
    }
  }
  // A vector whose lane i is p[(i / width) · step], for a width that divides the lanes (a
  // power of two: it divides kFusedWidth): on AVX2 and AVX-512, from contiguous groups, one
  // masked load of the vector's N / width values (lanes past them not read) and one permute.
  template <class D>
  HWY_INLINE hn::Vec<D> Spread(D d, const float* p, int64_t step) const {
    const int64_t N = static_cast<int64_t>(hn::Lanes(d));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
    if (step == 1) {
      const hn::RebindToSigned<D> di;
      const int shift = static_cast<int>(hwy::Num0BitsBelowLS1Bit_Nonzero32(static_cast<uint32_t>(width)));
      const auto idx = hn::IndicesFromVec(d, hn::ShiftRightSame(hn::Iota(di, 0), shift));
      return hn::TableLookupLanes(hn::MaskedLoad(hn::FirstN(d, static_cast<size_t>(N / width)), d, p), idx);
    }
#endif
    alignas(64) hn::TFromD<D> lanes[hn::MaxLanes(d)];
    for (int64_t i = 0; i < N; ++i) lanes[i] = p[(i / width) * step];
    return hn::Load(d, lanes);
  }
  HWY_INLINE T At(int64_t c) const {
    if constexpr (kIs8Bit<S>) {
      const int64_t g = one_group ? 0 : c / width;
      return static_cast<T>(dequantised(static_cast<float>(x[c]), z != nullptr ? z[g * z_step] : 0.0f, s[g * s_step]));
    } else {
      return Widened<T>(x[c]);
    }
  }
};

// Calls f(S{}) with S the storage type of dtype `storage` for compute type T: T itself, or
// (T = float) hwy::bfloat16_t / hwy::float16_t, or int8_t / uint8_t (an 8-bit KVQuant view).
// The kernels that widen in registers are instantiated per storage type through this.
template <typename T, typename F>
HWY_INLINE void WithStorage(DType storage, const F& f) {
  if constexpr (sizeof(T) == 4) {
    if (storage == DType::kBFloat16) return f(hwy::bfloat16_t{});
    if (storage == DType::kFloat16) return f(hwy::float16_t{});
    if (storage == DType::kInt8) return f(int8_t{});
    if (storage == DType::kUInt8) return f(uint8_t{});
  }
  f(T{});
}

// Rows [n0, n0 + n) of head (b, h) of a (B, H, N, width) view as T: in place when the view holds
// T and the rows are evenly spaced (not across pages of a paged view), else widened or
// gathered into scratch (n × width, which the caller sizes: see needs_row_scratch).
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE Rows<T> ReadRows(D d, const View4& v, int64_t b, int64_t h, int64_t n0, int64_t n, int64_t width,
                            T* HWY_RESTRICT scratch) {
  if (v.dtype == dtype_of<T>() && n0 + n <= v.run_end(n0)) return {v.at<T>(b, h, n0), v.strides[2]};
  if (v.quantized()) {  // 8-bit: dequantised by KVQuant's rule, a group of one scale at a time
    const int64_t width_g = v.quant.width;
    for (int64_t r = 0; r < n; ++r) {
      T* HWY_RESTRICT dst = scratch + r * width;
      for (int64_t g0 = 0; g0 < width; g0 += width_g) {
        const float s = v.quant_at(false, b, h, n0 + r, g0 / width_g);
        const float z = v.quant_at(true, b, h, n0 + r, g0 / width_g);
        const auto dequant = [&](const auto* x) {
          for (int64_t c = g0; c < g0 + width_g; ++c) dst[c] = static_cast<T>(dequantised(static_cast<float>(x[c]), z, s));
        };
        v.dtype == DType::kInt8 ? dequant(static_cast<const int8_t*>(v.ptr(b, h, n0 + r, 0)))
                                : dequant(static_cast<const uint8_t*>(v.ptr(b, h, n0 + r, 0)));
      }
    }
    return {scratch, width};
  }
  for (int64_t r = 0; r < n; ++r) WidenRow(d, v.dtype, v.ptr(b, h, n0 + r, 0), width, scratch + r * width);
  return {scratch, width};
}

// Row (b, h, i) of q times the scale, as T, into dst[c · stride] for c < Dk (16-bit storage
// widened exactly, then scaled): how every fused kernel that scales q packs it (the forward's
// blocks, decode, the mask's gradient), so that their scores share its bits.
template <typename T>
void PackScaledQuery(const Problem& p, int64_t b, int64_t h, int64_t i, T* HWY_RESTRICT dst, int64_t stride) {
  const T scale = static_cast<T>(p.scale);
  if (p.q.dtype == dtype_of<T>()) {
    const T* q = p.q.at<T>(b, h, i);
    for (int64_t c = 0; c < p.Dk; ++c) dst[c * stride] = q[c] * scale;
  } else if (p.q.dtype == DType::kBFloat16 || p.q.dtype == DType::kFloat16) {  // load's values, without its per-element dispatch
    const uint16_t* q = p.q.at<uint16_t>(b, h, i);
    const bool bf16 = p.q.dtype == DType::kBFloat16;
    for (int64_t c = 0; c < p.Dk; ++c) dst[c * stride] = static_cast<T>(bf16 ? bf16_to_f32(q[c]) : f16_to_f32(q[c])) * scale;
  } else {
    for (int64_t c = 0; c < p.Dk; ++c) dst[c * stride] = p.q.load<T>(b, h, i, c) * scale;
  }
}

// Whether ReadRows may need scratch for rows of v read as T.
template <typename T>
bool needs_row_scratch(const View4& v) {
  return v.dtype != dtype_of<T>() || v.paged();
}

// Whether x[0, n) holds a NaN or inf: x · 0 is NaN exactly for those, so one fused
// multiply-add per vector.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE bool AnyNonFinite(D d, const T* HWY_RESTRICT x, int64_t n) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  auto acc = hn::Zero(d);
  int64_t c = 0;
  for (; c + N <= n; c += N) acc = hn::MulAdd(hn::LoadU(d, x + c), hn::Zero(d), acc);
  bool bad = !hn::AllFalse(d, hn::IsNaN(acc));
  for (; c < n; ++c) bad |= !std::isfinite(x[c]);
  return bad;
}

// alpha · acc: the online softmax's rescale of what earlier keys accumulated, when a larger
// max arrives. Where alpha is 0 those keys now have weight 0 and must contribute nothing, so a
// NaN product (0 · inf, from an inf value row that had weight before) is 0 there; every other
// lane keeps the product's bits.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Rescale(D d, V acc, V alpha) {
  const V prod = hn::Mul(acc, alpha);
  return hn::IfThenZeroElse(hn::And(hn::Eq(alpha, hn::Zero(d)), hn::IsNaN(prod)), prod);
}
template <typename T>
T rescale(T acc, T alpha) {  // the same for one element
  const T prod = acc * alpha;
  return alpha == T(0) && std::isnan(prod) ? T(0) : prod;
}

// flags[r] = whether row r of rows[0, n) (width elements each) holds a NaN or inf; returns
// whether any does.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE bool FlagNonFiniteRows(D d, const T* HWY_RESTRICT rows, int64_t stride, int64_t n, int64_t width,
                                  uint8_t* HWY_RESTRICT flags) {
  bool any = false;
  for (int64_t r = 0; r < n; ++r) {
    flags[r] = AnyNonFinite(d, rows + r * stride, width);
    any |= flags[r] != 0;
  }
  return any;
}



// Results go back through problem.h's write_row (rounded once to the output's dtype).

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_ROWS_INL_H_
