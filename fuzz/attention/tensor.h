// attention_fuzz's tensors: strided views into exactly-sized heap buffers (ASan sees any overrun),
// in any layout the input asks for (LayoutSpec), read and written as doubles.
#pragma once

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "oracle.h"
#include "sdpa/attention.h"

namespace sdpa_fuzz {

using sdpa::DType;
inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
extern bool g_verbose;  // SDPA_FUZZ_VERBOSE (harness.cc): describe() prints more elements

inline bool is16(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }
inline int64_t esize(DType t) { return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : is16(t) ? 2 : 1; }
inline const char* dtype_str(DType t) {
  return t == DType::kFloat32 ? "f32" : t == DType::kFloat64 ? "f64" : t == DType::kBFloat16 ? "bf16" : t == DType::kFloat16 ? "f16" : "bool";
}
// The largest finite value and the smallest normal one of a float dtype.
inline double max_of(DType t) {
  return t == DType::kFloat64 ? DBL_MAX : t == DType::kBFloat16 ? 0x1.fep127 : t == DType::kFloat16 ? 65504.0 : FLT_MAX;
}
inline double min_normal_of(DType t) {
  return t == DType::kFloat64 ? DBL_MIN : t == DType::kBFloat16 ? 0x1p-126 : t == DType::kFloat16 ? 0x1p-14 : FLT_MIN;
}
// Where rounding to the dtype gives ±inf: halfway between its largest finite value and the next
// power of two (float16: 65520). A correct kernel and kReference may land on either side of it.
inline double overflow_at(DType t) {
  return t == DType::kBFloat16 ? 0x1.ffp127 : t == DType::kFloat16 ? 65520.0 : kInf;
}

// How a tensor lays out its elements; decoded from the input.
struct LayoutSpec {
  uint8_t perm = 0;      // memory order of the dims (a permutation index)
  uint8_t pad = 0;       // bit d: gap after dim d's block (1-3 elements)
  uint8_t neg = 0;       // bit d: negative stride on dim d
  uint8_t zero = 0;      // bit d: stride 0 on dim d (inputs only: broadcast)
  uint8_t misalign = 0;  // elements before the lowest element in the buffer
  uint8_t last = 1;      // last-dim stride for mask / weights / lse (1..3)
  bool odd_unit = false; // dims of extent 1 get odd strides (never stepped)
  bool null_empty = true;  // an empty tensor has data == nullptr
  uint64_t empty_stride_seed = 0;

  static LayoutSpec plain() { return LayoutSpec{}; }
};

enum class Role { kUnitLast, kAny };  // q/k/v/out/gradients need stride 1 in the last dim

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape, Role role, bool input, const LayoutSpec& ls) { init(dtype, std::move(shape), role, input, ls); }
  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;

  void init(DType dtype, std::vector<int64_t> shape, Role role, bool input, const LayoutSpec& ls) {
    dtype_ = dtype;
    shape_ = std::move(shape);
    rank_ = static_cast<int>(shape_.size());
    strides_.assign(shape_.size(), 0);
    const int r = rank_;
    int64_t n = 1;
    for (int64_t s : shape_) if (s == 0) n = 0;
    for (int64_t s : shape_) if (n != 0 && __builtin_mul_overflow(n, s, &n)) n = INT64_MAX;  // never allocated
    numel_ = n;
    if (numel_ == 0) {
      // Never read or written: any strides; data null or a tiny buffer.
      std::mt19937_64 g(ls.empty_stride_seed);
      const int64_t choices[] = {0, 1, -1, 7, -1000, int64_t{1} << 40, -(int64_t{1} << 50)};
      for (int d = 0; d < r; ++d) strides_[d] = ls.empty_stride_seed == 0 ? 0 : choices[g() % 7];
      if (!ls.null_empty) alloc(1);
      data_off_ = 0;
      return;
    }
    std::vector<int> order;  // innermost first
    for (int d = r - 1; d >= 0; --d) order.push_back(d);
    {
      // Permute: unit-last roles keep the last dim innermost.
      const int fixed = role == Role::kUnitLast && r > 0 ? 1 : 0;
      std::vector<int> rest(order.begin() + fixed, order.end());
      int p = ls.perm;
      for (size_t i = 0; i < rest.size(); ++i) {
        const size_t j = i + static_cast<size_t>(p % static_cast<int>(rest.size() - i));
        p /= static_cast<int>(rest.size() - i);
        std::swap(rest[i], rest[j]);
      }
      std::copy(rest.begin(), rest.end(), order.begin() + fixed);
    }
    int64_t cur = role == Role::kUnitLast ? 1 : std::max<int>(1, ls.last);
    for (size_t o = 0; o < order.size(); ++o) {
      const int d = order[o];
      if (shape_[d] == 1 && ls.odd_unit) {
        strides_[d] = (o % 2 ? -12345 : 99991) + d;
        continue;
      }
      strides_[d] = cur;
      cur = cur * shape_[d] + ((ls.pad >> d & 1) ? 1 + d % 3 : 0);
    }
    for (int d = 0; d < r; ++d) {
      const bool is_last = d == r - 1;
      if (input && (ls.zero >> d & 1) && !(role == Role::kUnitLast && is_last && shape_[d] > 1)) strides_[d] = 0;
      if ((ls.neg >> d & 1) && !(role == Role::kUnitLast && is_last && shape_[d] > 1)) strides_[d] = -strides_[d];
    }
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < r; ++d) {
      const int64_t ext = (shape_[d] - 1) * strides_[d];
      if (ext < 0) lo += ext; else hi += ext;
    }
    alloc(static_cast<size_t>(hi - lo + 1 + ls.misalign));
    data_off_ = ls.misalign - lo;
  }

  sdpa::TensorView view() const {
    sdpa::TensorView t;
    t.dtype = dtype_;
    t.rank = rank_;
    for (int d = 0; d < rank_; ++d) {
      t.shape[d] = shape_[d];
      t.strides[d] = strides_[d];
    }
    t.data = buf_ ? buf_.get() + data_off_ * esize(dtype_) : nullptr;
    return t;
  }

  DType dtype() const { return dtype_; }
  int rank() const { return rank_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const { return numel_; }
  size_t buffer_elems() const { return elems_; }

  // Offset (in elements, relative to element 0) of the element at C-order flat index.
  int64_t offset_of_flat(int64_t flat) const {
    int64_t off = 0;
    for (int d = rank_ - 1; d >= 0; --d) {
      off += (flat % shape_[d]) * strides_[d];
      flat /= shape_[d];
    }
    return off;
  }
  // Element (b, h, n, e): dims right-aligned to these four; extent-1 dims broadcast.
  int64_t offset4(int64_t b, int64_t h, int64_t n, int64_t e) const {
    const int64_t idx[4] = {b, h, n, e};
    int64_t off = 0;
    for (int d = 0; d < rank_; ++d) {
      const int64_t i = idx[4 - rank_ + d];
      if (shape_[d] != 1) off += i * strides_[d];
    }
    return off;
  }
  double get_off(int64_t off) const {
    const std::byte* p = buf_.get() + (data_off_ + off) * esize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: { float f; std::memcpy(&f, p, 4); return f; }
      case DType::kFloat64: { double f; std::memcpy(&f, p, 8); return f; }
      case DType::kBool: return static_cast<double>(static_cast<uint8_t>(*p));
      case DType::kBFloat16:
      case DType::kFloat16: { uint16_t h; std::memcpy(&h, p, 2); return sdpa_oracle::half_value(sdpa_oracle::half_format(dtype_), h); }
      default: break;
    }
    return 0;
  }
  void set_off(int64_t off, double v) {
    std::byte* p = buf_.get() + (data_off_ + off) * esize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: { const float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
      case DType::kFloat64: std::memcpy(p, &v, 8); break;
      case DType::kBool: *p = static_cast<std::byte>(static_cast<uint8_t>(v)); break;
      case DType::kBFloat16:
      case DType::kFloat16: {  // rounded once to nearest even, as a caller's conversion would
        const sdpa_oracle::HalfFormat& hf = sdpa_oracle::half_format(dtype_);
        const uint16_t h = sdpa_oracle::half_bits(hf, sdpa_oracle::round_half(hf, v));
        std::memcpy(p, &h, 2);
        break;
      }
      default: break;
    }
  }
  double at4(int64_t b, int64_t h, int64_t n, int64_t e) const { return get_off(offset4(b, h, n, e)); }
  double flat(int64_t i) const { return get_off(offset_of_flat(i)); }
  void set_flat(int64_t i, double v) { set_off(offset_of_flat(i), v); }
  std::vector<double> values() const {
    std::vector<double> r(static_cast<size_t>(numel_));
    for (int64_t i = 0; i < numel_; ++i) r[static_cast<size_t>(i)] = flat(i);
    return r;
  }
  // Raw bits of element (flat) for bitwise comparisons (as uint64).
  bool is_sentinel_off(int64_t off) const {
    const std::byte* p = buf_.get() + (data_off_ + off) * esize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: return std::memcmp(p, &sdpa_oracle::kSentinel32, 4) == 0;
      case DType::kFloat64: return std::memcmp(p, &sdpa_oracle::kSentinel64, 8) == 0;
      case DType::kBool: return static_cast<uint8_t>(*p) == sdpa_oracle::kSentinel8;
      case DType::kBFloat16: return std::memcmp(p, &sdpa_oracle::kSentinelBF16, 2) == 0;
      case DType::kFloat16: return std::memcmp(p, &sdpa_oracle::kSentinelF16, 2) == 0;
      default: break;
    }
    return false;
  }
  std::vector<std::byte> snapshot() const { return buf_ ? std::vector<std::byte>(buf_.get(), buf_.get() + bytes()) : std::vector<std::byte>{}; }
  bool same_bytes(const std::vector<std::byte>& s) const { return s.size() == bytes() && (bytes() == 0 || std::memcmp(s.data(), buf_.get(), bytes()) == 0); }
  size_t bytes() const { return elems_ * static_cast<size_t>(esize(dtype_)); }

  // Every buffer slot that is no element still holds the sentinel; every element is written.
  std::string guards_and_written() const {
    if (!buf_) return "";
    std::vector<uint8_t> is_elem(elems_, 0);
    for (int64_t i = 0; i < numel_; ++i) is_elem[static_cast<size_t>(data_off_ + offset_of_flat(i))] = 1;
    for (size_t o = 0; o < elems_; ++o) {
      const bool sent = is_sentinel_off(static_cast<int64_t>(o) - data_off_);
      if (!is_elem[o] && !sent) return "guards: slot " + std::to_string(o) + " of the buffer (not an element) was written";
      if (is_elem[o] && sent) return "unwritten: an element (buffer slot " + std::to_string(o) + ") still holds the sentinel";
    }
    return "";
  }

  std::string describe(const char* name) const {
    std::ostringstream s;
    s << name << ": " << dtype_str(dtype_) << " shape (";
    for (int d = 0; d < rank_; ++d) s << (d ? ", " : "") << shape_[d];
    s << ") strides (";
    for (int d = 0; d < rank_; ++d) s << (d ? ", " : "") << strides_[d];
    s << ") data " << (buf_ ? "buffer" : "nullptr") << " +" << data_off_ << " elems";
    const int64_t lim = g_verbose ? 4096 : 64;
    if (numel_ > 0 && numel_ <= lim && dtype_ != DType::kBool) {
      s << " values [";
      for (int64_t i = 0; i < numel_; ++i) s << (i ? ", " : "") << flat(i);
      s << "]";
    } else if (numel_ > 0 && numel_ <= lim) {
      s << " values [";
      for (int64_t i = 0; i < numel_; ++i) s << (i ? "," : "") << flat(i);
      s << "]";
    }
    return s.str();
  }

  // A contiguous copy in another dtype (same values, C order).
  Tensor converted(DType dt) const {
    Tensor t(dt, shape_, Role::kUnitLast, true, LayoutSpec::plain());
    for (int64_t i = 0; i < numel_; ++i) t.set_flat(i, flat(i));
    return t;
  }
  Tensor clone() const {
    Tensor t;
    t.dtype_ = dtype_; t.rank_ = rank_; t.shape_ = shape_; t.strides_ = strides_; t.numel_ = numel_;
    t.data_off_ = data_off_;
    if (buf_) {
      t.alloc(elems_);
      std::memcpy(t.buf_.get(), buf_.get(), bytes());
    }
    return t;
  }

 private:
  void alloc(size_t elems) {
    elems_ = elems;
    const size_t b = std::max<size_t>(1, elems * static_cast<size_t>(esize(dtype_)));
    buf_.reset(static_cast<std::byte*>(std::malloc(b)));
    for (size_t o = 0; o < elems; ++o) {
      std::byte* p = buf_.get() + o * static_cast<size_t>(esize(dtype_));
      if (dtype_ == DType::kFloat32) std::memcpy(p, &sdpa_oracle::kSentinel32, 4);
      else if (dtype_ == DType::kFloat64) std::memcpy(p, &sdpa_oracle::kSentinel64, 8);
      else if (dtype_ == DType::kBFloat16) std::memcpy(p, &sdpa_oracle::kSentinelBF16, 2);
      else if (dtype_ == DType::kFloat16) std::memcpy(p, &sdpa_oracle::kSentinelF16, 2);
      else *p = static_cast<std::byte>(sdpa_oracle::kSentinel8);
    }
  }
  struct Free { void operator()(std::byte* p) const { std::free(p); } };
  DType dtype_ = DType::kFloat32;
  int rank_ = 0;
  std::vector<int64_t> shape_, strides_;
  int64_t numel_ = 0;
  int64_t data_off_ = 0;
  size_t elems_ = 0;
  std::unique_ptr<std::byte[], Free> buf_;
};

// An int32 / int64 rank-1 tensor (seqlens_k, cu_seqlens) in an exactly-sized heap buffer, any
// stride (0 only when every value is the same) and a byte offset (index_at reads any alignment).
struct IndexTensor {
  DType dtype = DType::kInt64;
  std::vector<int64_t> vals;
  int64_t stride = 1;
  int misalign = 0;  // bytes before the lowest element
  struct Free { void operator()(std::byte* p) const { std::free(p); } };
  std::unique_ptr<std::byte[], Free> buf;
  size_t bytes = 0;
  std::byte* data = nullptr;  // element 0

  IndexTensor(DType dt, std::vector<int64_t> v, int64_t st, int mis) : dtype(dt), vals(std::move(v)), stride(st), misalign(mis) {
    const int64_t n = static_cast<int64_t>(vals.size()), es = dt == DType::kInt32 ? 4 : 8;
    const int64_t span = n == 0 ? 0 : (n - 1) * std::abs(stride) + 1;
    bytes = static_cast<size_t>(span * es + misalign);
    buf.reset(static_cast<std::byte*>(std::malloc(std::max<size_t>(1, bytes))));
    std::memset(buf.get(), 0xa5, std::max<size_t>(1, bytes));
    data = buf.get() + misalign + (stride < 0 && n > 0 ? (n - 1) * -stride * es : 0);
    for (int64_t i = 0; i < n; ++i) {
      std::byte* at = data + i * stride * es;
      if (dt == DType::kInt32) { const int32_t x = static_cast<int32_t>(vals[static_cast<size_t>(i)]); std::memcpy(at, &x, 4); }
      else std::memcpy(at, &vals[static_cast<size_t>(i)], 8);
    }
  }
  // Entry i's value, in memory too (as the dtype holds it).
  void set(int64_t i, int64_t x) {
    vals[static_cast<size_t>(i)] = x;
    std::byte* at = data + i * stride * (dtype == DType::kInt32 ? 4 : 8);
    if (dtype == DType::kInt32) { const int32_t y = static_cast<int32_t>(x); std::memcpy(at, &y, 4); }
    else std::memcpy(at, &x, 8);
  }
  sdpa::TensorView view() const {
    sdpa::TensorView t;
    t.data = vals.empty() ? nullptr : data;
    t.dtype = dtype;
    t.rank = 1;
    t.shape[0] = static_cast<int64_t>(vals.size());
    t.strides[0] = stride;
    return t;
  }
  std::string describe(const char* name) const {
    std::ostringstream s;
    s << name << ": " << (dtype == DType::kInt32 ? "int32" : "int64") << " (" << vals.size() << ",) stride " << stride
      << " misalign " << misalign << " values [";
    for (size_t i = 0; i < vals.size(); ++i) s << (i ? ", " : "") << vals[i];
    s << "]";
    return s.str();
  }
};

}  // namespace sdpa_fuzz
