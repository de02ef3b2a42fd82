// 8-bit K/V: validation and the float32 stand-in call (kv_dequant.h).
#include "kv_dequant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "checks.h"
#include "huge_pages.h"
#include "problem.h"
#include "storage.h"

namespace sdpa::internal {
namespace {

const char* at(const TensorView& t, const int64_t* idx) {
  int64_t off = 0;
  for (int d = 0; d < t.rank; ++d) off += idx[d] * t.strides[d];
  return static_cast<const char*>(t.data) + off * storage_bytes(t.dtype);
}

std::string index_string(const int64_t* idx, int n) {
  std::string s = "(";
  for (int d = 0; d < n; ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + ")";
}

// Calls f(lead) for every index of t's leading rank - 1 dims, in C order.
template <typename F>
void for_rows(const TensorView& t, F&& f) {
  const int n = t.rank - 1;
  for (int d = 0; d < n; ++d)
    if (t.shape[d] == 0) return;
  int64_t idx[4] = {0, 0, 0, 0};
  while (true) {
    f(idx);
    int d = n - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

// A scale (or zero point) view of x: float32, x's shape without its last dim, or with a last
// dim G dividing x's last dim. Returns G (1 for one per row).
int64_t check_scale(const char* name, const TensorView& s, const char* x_name, const TensorView& x) {
  check_basic(name, s, 1, 4);
  if (s.dtype != DType::kFloat32) {
    fail(std::string(name) + " has dtype " + dtype_name(s.dtype) + " but must be float32");
  }
  const int lead = x.rank - 1;
  const int64_t D = x.shape[x.rank - 1];
  bool ok = s.rank == lead || s.rank == x.rank;
  for (int d = 0; ok && d < lead; ++d) ok = s.shape[d] == x.shape[d];
  const int64_t G = s.rank == x.rank ? s.shape[lead] : 1;
  if (ok && s.rank == x.rank) ok = G >= 1 && D % G == 0;
  if (!ok) {
    fail(std::string(name) + " has shape " + s.shape_string() + " but " + x_name + " has shape " + x.shape_string() +
         ": it must be " + x_name + "'s shape without its last dim, or with a last dim G that divides " +
         std::to_string(D));
  }
  check_has_data(name, s);
  return G;
}

// Whether every element of float32 t is finite, when t's elements fill one span of memory
// without gaps (C order or any permutation of it, as a paged pool's scales laid out
// (pages, Hkv, page_size) and viewed as (pages, page_size, Hkv); false when they do not, or
// when one is not finite): a vectorised pass over the scales, 4 bytes per row of x against
// x's D, so that the common case of an 8-bit call costs no per-row loop.
bool all_finite_dense(const TensorView& t) {
  int dims[4];
  int n_dims = 0;
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[d] != 1) dims[n_dims++] = d;
  for (int i = 1; i < n_dims; ++i)  // by stride, smallest first (insertion: at most 4 dims)
    for (int j = i; j > 0 && t.strides[dims[j]] < t.strides[dims[j - 1]]; --j) std::swap(dims[j], dims[j - 1]);
  int64_t stride = 1;  // each dim must step over the ones before it
  for (int i = 0; i < n_dims; ++i) {
    if (t.strides[dims[i]] != stride) return false;
    stride *= t.shape[dims[i]];
  }
  const char* x = static_cast<const char*>(t.data);
  const int64_t n = t.numel();
  uint32_t non_finite = 0;  // an exponent of all ones: inf or NaN (integer compares, vectorised)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i * sizeof(float), sizeof bits);
    non_finite |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return non_finite == 0;
}

// A contiguous float32 view of t's shape over data.
TensorView contiguous_like(const TensorView& t, float* data) {
  TensorView out = t;
  out.dtype = DType::kFloat32;
  out.data = data;
  int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) out.strides[d] = stride, stride *= t.shape[d];
  return out;
}

// n values of X (int8_t or uint8_t) `stride` apart from `from`, dequantised into dst
// (storage.h's dequantised). A unit stride is a plain loop the compiler vectorises.
template <typename X>
void dequantize_run(const char* from, int64_t stride, int64_t n, float z, float s, float* dst) {
  const X* x = reinterpret_cast<const X*>(from);
  if (stride == 1) {
    for (int64_t e = 0; e < n; ++e) dst[e] = dequantised(static_cast<float>(x[e]), z, s);
    return;
  }
  for (int64_t e = 0; e < n; ++e) dst[e] = dequantised(static_cast<float>(x[e * stride]), z, s);
}

// A contiguous float32 view of t's shape over buf, holding t's values widened (copy) or not.
TensorView float32_like(const TensorView& t, std::vector<float>& buf, bool copy) {
  buf.assign(static_cast<size_t>(t.numel()), 0.0f);
  TensorView out = contiguous_like(t, buf.data());
  if (!copy || t.numel() == 0) return out;
  int64_t i = 0;
  TensorView rows = t;  // for_rows walks the leading dims; a rank-1 view is one row
  for_rows(rows, [&](const int64_t* lead) {
    int64_t idx[4] = {lead[0], lead[1], lead[2], 0};
    const char* p = at(t, idx);
    const int64_t n = t.shape[t.rank - 1];
    for (int64_t e = 0; e < n; ++e)
      buf[static_cast<size_t>(i++)] = load_as<float>(t.dtype, p + e * t.strides[t.rank - 1] * storage_bytes(t.dtype));
  });
  return out;
}

// x (8-bit) dequantised into buf (contiguous float32, x's shape): the rows read, by KVQuant's
// rule; the others 0. Errors on a non-finite scale or zero point of a row read.
TensorView dequantize(const TensorView& x, const char* x_name, const TensorView& scale,
                      const std::optional<TensorView>& zero, const char* s_name, const char* z_name,
                      const RowsRead& reads, std::unique_ptr<float[]>& buf, bool values = true) {
  const int64_t G = check_scale(s_name, scale, x_name, x);
  if (zero) {
    check_scale(z_name, *zero, x_name, x);
    if (zero->rank != scale.rank || (zero->rank == x.rank && zero->shape[x.rank - 1] != G)) {
      fail(std::string(z_name) + " has shape " + zero->shape_string() + " but " + s_name + " has shape " +
           scale.shape_string() + ": a zero point per scale");
    }
  }
  check_has_data(x_name, x);
  const int64_t D = x.shape[x.rank - 1], width = D / G;
  if (values) {  // not zeroed: every row is written below; on huge pages, fewer faults
    buf.reset(new float[static_cast<size_t>(x.numel())]);
    advise_huge_pages(buf.get(), static_cast<size_t>(x.numel()) * sizeof(float));
  }
  TensorView out = contiguous_like(x, buf.get());
  if (D == 0) return out;  // no value: no scale is read
  if (!values) {
    // Checked only (a fused call, whose kernels stream k and v in a few milliseconds): first
    // whether every scale and zero point is finite (rows read or not: one pass over
    // dense tensors), then whether every one read is, rows split among the threads; only
    // if one is not, the serial loop below finds the first and names it.
    if (all_finite_dense(scale) && (!zero || all_finite_dense(*zero))) return out;
    const int64_t total = x.numel() / D;
    bool bad = false;
#pragma omp parallel for schedule(static) reduction(|| : bad) num_threads(num_threads()) if (total >= 4096)
    for (int64_t r = 0; r < total; ++r) {
      int64_t idx[4] = {0, 0, 0, 0};
      for (int64_t d = x.rank - 2, rest = r; d >= 0; --d) idx[d] = rest % x.shape[d], rest /= x.shape[d];
      if (!reads(idx)) continue;
      for (int64_t g = 0; g < G; ++g) {
        idx[x.rank - 1] = g;
        float value;
        std::memcpy(&value, at(scale, idx), sizeof value);
        bool finite = std::isfinite(value);
        if (zero) std::memcpy(&value, at(*zero, idx), sizeof value), finite &= std::isfinite(value);
        bad = bad || !finite;
      }
    }
    if (!bad) return out;
  }
  // First the scales and zero points of the rows read, serially (an Error leaves this loop),
  // then the values, rows split among the threads (no check there: nothing throws in parallel).
  std::vector<int64_t> rows;
  int64_t row = 0;
  for_rows(x, [&](const int64_t* lead) {
    const int64_t r = row++;
    if (!reads(lead)) {
      if (values) std::fill_n(buf.get() + r * D, D, 0.0f);  // a row not read: 0, its scale unread
      return;
    }
    rows.push_back(r);
    int64_t idx[4] = {lead[0], lead[1], lead[2], 0};
    for (int64_t g = 0; g < G; ++g) {
      idx[x.rank - 1] = g;
      for (const auto& [t, name] : {std::pair{&scale, s_name}, std::pair{zero ? &*zero : nullptr, z_name}}) {
        if (t == nullptr) continue;
        float value;
        std::memcpy(&value, at(*t, idx), sizeof value);
        if (!std::isfinite(value)) {
          fail(std::string(name) + " has a non-finite value " + std::to_string(value) + " at " +
               index_string(idx, t->rank) + " (" + name + " " + t->shape_string() + ", " + x_name + " " +
               x.shape_string() + ")");
        }
      }
    }
  });
  if (!values) return out;  // checked only: the kernels dequantise in registers
  const bool u8 = x.dtype == DType::kUInt8;
  const int64_t n_rows = static_cast<int64_t>(rows.size());
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (n_rows * D >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t r = rows[static_cast<size_t>(i)];
    int64_t idx[4] = {0, 0, 0, 0};
    for (int64_t d = x.rank - 2, rest = r; d >= 0; --d) idx[d] = rest % x.shape[d], rest /= x.shape[d];
    const char* src = at(x, idx);
    float* dst = buf.get() + r * D;
    for (int64_t g = 0; g < G; ++g) {
      idx[x.rank - 1] = g;
      float s, z = 0.0f;
      std::memcpy(&s, at(scale, idx), sizeof s);
      if (zero) std::memcpy(&z, at(*zero, idx), sizeof z);
      const char* from = src + g * width * x.strides[x.rank - 1];
      u8 ? dequantize_run<uint8_t>(from, x.strides[x.rank - 1], width, z, s, dst + g * width)
         : dequantize_run<int8_t>(from, x.strides[x.rank - 1], width, z, s, dst + g * width);
    }
  }
  return out;
}

bool is_16bit(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }

}  // namespace

bool Float32Call::prepare(TensorView& q, TensorView& k, TensorView& v, std::optional<KVQuant>& kv_quant,
                          std::optional<TensorView>* mask, TensorView& out, const char* k_name, const char* v_name,
                          const RowsRead& reads, bool fusable) {
  fused_ = false;
  if (!is_8bit_dtype(k.dtype) && !is_8bit_dtype(v.dtype)) {
    if (kv_quant) {
      fail(std::string("kv_quant is given but ") + k_name + " has dtype " + dtype_name(k.dtype) +
           ": kv_quant goes with int8 or uint8 " + k_name + " and " + v_name);
    }
    return false;
  }
  if (v.dtype != k.dtype) {
    fail(std::string(v_name) + " has dtype " + dtype_name(v.dtype) + " but " + k_name + " has dtype " +
         dtype_name(k.dtype) + " (8-bit " + k_name + " and " + v_name + " share int8 or uint8)");
  }
  check_basic("q", q, 1, 4);
  if (q.dtype != DType::kFloat32 && !is_16bit(q.dtype)) {
    fail(std::string("q has dtype ") + dtype_name(q.dtype) + " but " + dtype_name(k.dtype) + " " + k_name +
         " is read by float32, bfloat16 or float16 q");
  }
  if (!kv_quant) {
    fail(std::string(k_name) + " has dtype " + dtype_name(k.dtype) + " but kv_quant is not given: 8-bit " + k_name +
         " and " + v_name + " need their scales");
  }
  const bool u8 = k.dtype == DType::kUInt8;
  for (const auto& [zero, name] : {std::pair{&kv_quant->k_zero, "kv_quant.k_zero"}, std::pair{&kv_quant->v_zero, "kv_quant.v_zero"}}) {
    if (zero->has_value() && !u8) {
      fail(std::string(name) + " is given but " + k_name + " has dtype int8 (symmetric: no zero point)");
    }
    if (!zero->has_value() && u8) fail(std::string(name) + " is not given but " + k_name + " has dtype uint8: it needs zero points");
  }
  check_basic(k_name, k, 2, 4);
  check_basic(v_name, v, 2, 4);
  check_basic("out", out, 1, 4);
  if (is_16bit(q.dtype) && out.dtype != q.dtype && out.dtype != DType::kFloat32) {
    fail(std::string("out has dtype ") + dtype_name(out.dtype) + " but must be q's dtype " + dtype_name(q.dtype) +
         " or the compute type float32");
  }
  if (is_16bit(q.dtype) && mask && *mask && (*mask)->dtype != DType::kBool && (*mask)->dtype != DType::kFloat32 &&
      (*mask)->dtype != q.dtype) {
    fail(std::string("mask has dtype ") + dtype_name((*mask)->dtype) + " but must be bool, float32 or q's dtype " +
         dtype_name(q.dtype));
  }
  check_has_data("q", q);
  check_has_data("out", out);
  // Every check above before any copy; dequantize checks the scales as it reads them.
  bool fuse = false;
  if (fusable) {
    // The scales checked, k and v not copied; fused() tells whether the kernels can read them
    // in place (scale groups of whole vectors, or vectors of whole groups: kFusedWidth).
    const TensorView* xs[2] = {&k, &v};
    const TensorView* ss[2] = {&kv_quant->k_scale, &kv_quant->v_scale};
    const std::optional<TensorView>* zs[2] = {&kv_quant->k_zero, &kv_quant->v_zero};
    const char* names[2][3] = {{k_name, "kv_quant.k_scale", "kv_quant.k_zero"}, {v_name, "kv_quant.v_scale", "kv_quant.v_zero"}};
    fuse = true;
    for (int t = 0; t < 2; ++t) {
      std::unique_ptr<float[]> none;
      dequantize(*xs[t], names[t][0], *ss[t], *zs[t], names[t][1], names[t][2], reads, none, /*values=*/false);
      const int64_t D = xs[t]->shape[xs[t]->rank - 1];
      const int64_t G = ss[t]->rank == xs[t]->rank ? ss[t]->shape[ss[t]->rank - 1] : 1;
      width_[t] = D / G;
      fuse &= G == 1 || width_[t] % kFusedWidth == 0 || kFusedWidth % width_[t] == 0;
    }
  }
  if (!fuse) {
    const TensorView kf = dequantize(k, k_name, kv_quant->k_scale, kv_quant->k_zero, "kv_quant.k_scale",
                                     "kv_quant.k_zero", reads, k_);
    const TensorView vf = dequantize(v, v_name, kv_quant->v_scale, kv_quant->v_zero, "kv_quant.v_scale",
                                     "kv_quant.v_zero", reads, v_);
    k = kf;
    v = vf;
    kv_quant.reset();
  }
  // 16-bit q (fused or not): q and a 16-bit mask widened into float32 copies (small beside the
  // cache a decode step reads), out computed in float32 and rounded once by finish().
  if (is_16bit(q.dtype)) {
    if (mask && *mask && is_16bit((*mask)->dtype)) {
      check_basic("mask", **mask, 1, 4);
      check_has_data("mask", **mask);
      *mask = float32_like(**mask, mask_, true);
    }
    q = float32_like(q, q_, true);
    if (out.dtype != DType::kFloat32) {
      user_out_ = out;
      round_out_ = true;
      out = float32_like(out, out_, false);
    }
  }
  fused_ = fuse;
  return true;
}

void Float32Call::finish() const {
  if (!round_out_) return;
  int64_t i = 0;
  for_rows(user_out_, [&](const int64_t* lead) {
    int64_t idx[4] = {lead[0], lead[1], lead[2], 0};
    char* p = const_cast<char*>(at(user_out_, idx));
    const int64_t n = user_out_.shape[user_out_.rank - 1];
    for (int64_t e = 0; e < n; ++e)
      store_as(user_out_.dtype, p + e * user_out_.strides[user_out_.rank - 1] * storage_bytes(user_out_.dtype),
               out_[static_cast<size_t>(i++)]);
  });
}

void Float32Call::attach(View4& view, int which, const TensorView& scale, const std::optional<TensorView>& zero,
                         int rank, bool paged) const {
  View4::Quant& qv = view.quant;
  qv.width = width_[which];
  const auto place = [&](const TensorView& t, int64_t* strides, int64_t& page_stride) {
    const bool grouped = t.rank == rank;
    if (paged) {  // (num_pages, page_size, Hkv[, G]): as the pool's rows (paged.cc's as_rows)
      page_stride = t.strides[0];
      strides[0] = 0;
      strides[1] = t.strides[2];
      strides[2] = t.strides[1];
      strides[3] = grouped ? t.strides[3] : 0;
      return;
    }
    // k's leading dims (padded on the left to B, H, N as to_view4 pads k), then the group dim.
    const int lead = rank - 1, pad = 3 - lead;
    for (int d = 0; d < lead; ++d) strides[pad + d] = t.shape[d] == 1 ? 0 : t.strides[d];
    strides[3] = grouped && t.shape[lead] > 1 ? t.strides[lead] : 0;
  };
  qv.scale = static_cast<const float*>(scale.data);
  place(scale, qv.strides, qv.page_stride);
  if (zero) {
    qv.zero = static_cast<const float*>(zero->data);
    place(*zero, qv.zero_strides, qv.zero_page_stride);
  }
}

Problem make_fused_problem(const Float32Call& f32, const Inputs& in, const Outputs& outputs, const Options& options) {
  // make_problem checks the 8-bit views as the float32 views of the same shapes and strides
  // (prepare checked their dtypes and scales), then they become what they are.
  Inputs as_f32 = in;
  as_f32.k.dtype = as_f32.v.dtype = DType::kFloat32;
  as_f32.kv_quant.reset();
  Problem p = make_problem(as_f32, outputs, options);
  p.k.dtype = in.k.dtype;
  p.v.dtype = in.v.dtype;
  f32.attach(p.k, 0, in.kv_quant->k_scale, in.kv_quant->k_zero, in.k.rank, /*paged=*/false);
  f32.attach(p.v, 1, in.kv_quant->v_scale, in.kv_quant->v_zero, in.v.rank, /*paged=*/false);
  return p;
}

RowsRead dense_rows_read(const TensorView& k, const std::optional<TensorView>& seqlens_k) {
  if (!seqlens_k) return [](const int64_t*) { return true; };
  const TensorView s = *seqlens_k;
  const bool readable = s.rank == 1 && s.data != nullptr && s.shape[0] >= 1 &&
                        (s.dtype == DType::kInt32 || s.dtype == DType::kInt64);
  if (!readable) return [](const int64_t*) { return false; };
  const int n_dim = k.rank - 2;  // the key dim
  if (k.rank == 4 && s.shape[0] == k.shape[0]) {
    return [s](const int64_t* lead) { return lead[2] < index_at(s, lead[0]); };
  }
  int64_t longest = 0;  // k's batch broadcast (or rank < 4): any sequence's length
  for (int64_t b = 0; b < s.shape[0]; ++b) longest = std::max(longest, index_at(s, b));
  return [n_dim, longest](const int64_t* lead) { return lead[n_dim] < longest; };
}

}  // namespace sdpa::internal
