// Argument validation: every check of the public API lives here (make_problem's and the shared
// ones of checks.h), before any write.
#include "problem.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "checks.h"

namespace sdpa {

const char* dtype_name(DType dtype) { return internal::dtype_traits(dtype).name; }
int64_t dtype_size(DType dtype) { return internal::storage_bytes(dtype); }

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  if (shape.size() < 1 || shape.size() > 4) throw Error("TensorView::contiguous: rank must be 1..4");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

std::string TensorView::shape_string() const {
  std::string s = "(";
  for (int d = 0; d < rank; ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  return s + (rank == 1 ? ",)" : ")");
}

namespace internal {

void check_rank(const char* name, const TensorView& t, int rank, const char* meaning) {
  if (t.rank != rank) fail(std::string(name) + " has shape " + t.shape_string() + " but must be " + meaning);
}

void check_index_dtype(const char* name, const TensorView& t) {
  if (t.dtype != DType::kInt32 && t.dtype != DType::kInt64) {
    fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but must be int32 or int64");
  }
}

void check_has_data(const char* name, const TensorView& t) {
  if (t.data == nullptr && t.numel() > 0) fail(std::string(name) + " has no data but shape " + t.shape_string());
}

std::string storage_dtype_list() {
  std::vector<std::string> names;
  for (const DTypeTraits& t : kDTypeTable)
    if (t.storage) names.push_back(t.name);
  std::string list = names.front();
  for (size_t i = 1; i < names.size(); ++i) list += (i + 1 == names.size() ? " or " : ", ") + names[i];
  return list;
}

void check_packed_lse(const TensorView& lse, const TensorView& q) {
  if (lse.shape[0] != q.shape[1] || lse.shape[1] != q.shape[0]) {
    fail("lse has shape " + lse.shape_string() + " but must be (Hq, total_q) = (" + std::to_string(q.shape[1]) + ", " +
         std::to_string(q.shape[0]) + ")");
  }
}

namespace {

std::string shape_string(const int64_t* shape, int rank) {
  TensorView t;
  t.rank = rank;
  for (int d = 0; d < rank; ++d) t.shape[d] = shape[d];
  return t.shape_string();
}

}  // namespace

// Checks what every tensor needs: a supported rank, non-negative dims, data when non-empty.
void check_basic(const char* name, const TensorView& t, int min_rank, int max_rank) {
  if (t.rank < min_rank || t.rank > max_rank) {
    fail(std::string(name) + " has rank " + std::to_string(t.rank) + " but must have rank " +
         std::to_string(min_rank) + ".." + std::to_string(max_rank));
  }
  int64_t numel = 1;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] < 0) fail(std::string(name) + " has a negative dim: " + t.shape_string());
    // numel() and every offset the kernels compute must fit int64_t.
    if (__builtin_mul_overflow(numel, t.shape[d], &numel)) {
      fail(std::string(name) + " has shape " + t.shape_string() + ", more elements than int64_t counts");
    }
  }
  check_has_data(name, t);
}

namespace {

void check_unit_last_stride(const char* name, const TensorView& t) {
  // An empty tensor is never read or written, whatever its strides (NumPy gives them 0).
  if (t.numel() > 0 && t.shape[t.rank - 1] > 1 && t.strides[t.rank - 1] != 1) {
    fail(std::string(name) + " must have stride 1 in its last dim, but has stride " +
         std::to_string(t.strides[t.rank - 1]) + " (shape " + t.shape_string() + ")");
  }
}

}  // namespace

// A view that is written must not map two indices to one element: different threads write
// different indices at once. Stride 0 on a dim of extent > 1 is the common way to get that
// (a broadcast view passed as an output) and is refused; other self-overlapping strides are
// the caller's promise (see TensorView in the public header). Dims of extent 1 never step, and
// an empty view is never written, so their strides do not matter.
void check_no_zero_stride(const char* name, const TensorView& t) {
  if (t.numel() == 0) return;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] > 1 && t.strides[d] == 0) {
      fail(std::string(name) + " has stride 0 in dim " + std::to_string(d) + " (shape " + t.shape_string() +
           ", strides " + shape_string(t.strides, t.rank) + "): an output must not overlap itself, or several threads would " +
           "write one element");
    }
  }
}

namespace {

// t must have the dtype of tensor `of` ("q", "k", ...), `expected`.
void check_dtype(const char* name, const TensorView& t, DType expected, const char* of = "q") {
  if (t.dtype != expected) {
    fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but " + of + " has dtype " + dtype_name(expected));
  }
}

// weights and lse hold the compute type: float64 for float64 q, float32 for the others.
void check_compute_dtype(const char* name, const TensorView& t, DType q, DType compute) {
  if (t.dtype != compute) {
    fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but must be " + dtype_name(compute) +
         ", the compute type of " + dtype_name(q) + " q");
  }
}

// out, dout, dq, dk and dv: the dtype of tensor `of` (q's, k's, v's), `expected`, or the compute
// type: float32 partials and gradients of 16-bit inputs, kept unrounded for merging or summing
// (the kernels round each result once to its view's dtype, View4::store / write_row).
void check_dtype_or_compute(const char* name, const TensorView& t, DType expected, DType compute, const char* of) {
  if (t.dtype == expected || t.dtype == compute) return;
  if (expected == compute) check_dtype(name, t, expected, of);
  fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but must be " + of + "'s dtype " +
       dtype_name(expected) + " or the compute type " + dtype_name(compute));
}

// Places a rank-r view in the first `dims` slots of a View4, padding on the left; the padded
// slots and the slots after `dims` have extent 1, stride 0.
// An empty view gets stride 0 everywhere: it is never read or written, but kernels still form
// pointers to its rows, and with a null data pointer (allowed when empty) any non-zero offset
// would be undefined behaviour.
View4 to_view4(const TensorView& t, int dims = 4) {
  View4 v;
  v.data = static_cast<char*>(t.data);
  v.dtype = t.dtype;
  const bool empty = t.numel() == 0;
  const int pad = dims - t.rank;
  for (int d = 0; d < t.rank; ++d) {
    v.shape[pad + d] = t.shape[d];
    v.strides[pad + d] = t.shape[d] == 1 || empty ? 0 : t.strides[d];
  }
  return v;
}

// Requires t to have exactly the shape `expected` (of the same rank as q).
void check_shape(const char* name, const TensorView& t, const int64_t* expected, int rank, const char* meaning) {
  bool same = t.rank == rank;
  for (int d = 0; same && d < rank; ++d) same = t.shape[d] == expected[d];
  if (!same) {
    fail(std::string(name) + " has shape " + t.shape_string() + " but must be " + shape_string(expected, rank) +
         " = " + meaning);
  }
}

// Whether n contiguous values, whose bits are U and whose +inf is pos_inf, hold a NaN or +inf:
// integer compares on the bits, a loop the compiler vectorises (no dtype dispatch per element).
template <typename U>
bool has_nan_or_pos_inf(const char* row, int64_t n, U pos_inf) {
  const U magnitude = static_cast<U>(static_cast<U>(~U(0)) >> 1);
  U bad = 0;
  for (int64_t e = 0; e < n; ++e) {
    U bits;
    std::memcpy(&bits, row + e * static_cast<int64_t>(sizeof(U)), sizeof bits);
    bad |= static_cast<U>(((bits & magnitude) > pos_inf) | (bits == pos_inf));  // NaN | +inf
  }
  return bad != 0;
}

// Whether a row of m's dtype, with unit stride, may hold a NaN or +inf (true where its dtype has
// no bitwise rule here: the caller then reads each element).
bool row_may_be_bad(DType dtype, const char* row, int64_t n) {
  switch (dtype) {
    case DType::kFloat32: return has_nan_or_pos_inf<uint32_t>(row, n, 0x7f800000u);
    case DType::kFloat64: return has_nan_or_pos_inf<uint64_t>(row, n, 0x7ff0000000000000u);
    case DType::kBFloat16: return has_nan_or_pos_inf<uint16_t>(row, n, 0x7f80u);
    case DType::kFloat16: return has_nan_or_pos_inf<uint16_t>(row, n, 0x7c00u);
    default: return true;
  }
}

// A float mask holds biases added to the scores: finite values, or -inf to block. NaN or
// +inf would make a row's softmax undefined (inf - inf), so they are refused with the
// index of the first one. Reads each stored element once (broadcast dims are not expanded);
// rows with unit stride first through row_may_be_bad's vectorised pass (the element-wise loop
// alone, serial, had 1.4 % of a one-thread profile's samples beside the kernel's 17 % for a
// 2048 x 2048 float32 mask).
void check_mask_values(const TensorView& m) {
  if (m.numel() == 0) return;  // its other dims may be huge: (2^40, 0) holds nothing to check
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  const int pad = 4 - m.rank;
  for (int d = 0; d < m.rank; ++d) {
    shape[pad + d] = m.shape[d];
    strides[pad + d] = m.strides[d];
  }
  const int64_t bytes = storage_bytes(m.dtype);
  const char* base = static_cast<const char*>(m.data);
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c) {
        const char* row = base + (a * strides[0] + b * strides[1] + c * strides[2]) * bytes;
        if ((strides[3] == 1 || shape[3] == 1) && !row_may_be_bad(m.dtype, row, shape[3])) continue;
        for (int64_t e = 0; e < shape[3]; ++e) {
          const double x = load_as<double>(m.dtype, row + e * strides[3] * bytes);
          if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) {
            const int64_t index[4] = {a, b, c, e};
            fail(std::string("mask has ") + (std::isnan(x) ? "NaN" : "+inf") + " at index " +
                 shape_string(index + pad, m.rank) + "; a float mask holds finite biases, or -inf to block");
          }
        }
      }
}

// Inputs::seqlens_k: (B,) int32 or int64, any stride, each length in [0, Nk]. Read once here.
std::vector<int64_t> read_seqlens(const TensorView& s, int64_t B, int64_t Nk, int q_rank) {
  check_basic("seqlens_k", s, 1, 1);
  check_index_dtype("seqlens_k", s);
  if (s.shape[0] != B) {
    fail("seqlens_k has shape " + s.shape_string() + " but must be (" + std::to_string(B) + ",): one key length per " +
         (q_rank == 4 ? "batch entry of q (B = " + std::to_string(B) + ")" : std::string("call (q has no batch dim)")));
  }
  std::vector<int64_t> lengths(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = index_at(s, b);
    if (n < 0 || n > Nk) {
      fail("seqlens_k[" + std::to_string(b) + "] = " + std::to_string(n) + " is outside [0, Nk] = [0, " +
           std::to_string(Nk) + "]");
    }
    lengths[static_cast<size_t>(b)] = n;
  }
  return lengths;
}

}  // namespace

Dropout make_dropout(double p, uint64_t seed) {
  if (!(p >= 0.0 && p < 1.0)) fail("dropout_p must be in [0, 1), got " + std::to_string(p));
  Dropout d;
  d.p = p;
  d.seed = seed;
  d.threshold = static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0));
  d.keep_scale = 1.0 / (1.0 - p);
  return d;
}

namespace {

// The shortest text that reads back as x: "0.1" rather than std::to_string's "0.100000".
std::string number_string(double x) {
  std::string text;
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream s;
    s.precision(digits);
    s << x;
    text = s.str();
    if (std::strtod(text.c_str(), nullptr) == x) break;
  }
  return text;
}

// Options::alibi_slopes or sinks: a small float32/float64 tensor of the given shapes, every
// value finite (and held by float32 when that is the compute type), read once into doubles in
// C order. `shapes` lists what it may be, e.g. "(Hq,) or (B, Hq)".
std::vector<double> read_small_floats(const char* name, const TensorView& t, const char* shapes, DType compute) {
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) {
    fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but must be float32 or float64");
  }
  const int64_t rows = t.rank == 2 ? t.shape[0] : 1, cols = t.shape[t.rank - 1];
  std::vector<double> values(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t offset = (t.rank == 2 ? r * t.strides[0] : 0) + c * t.strides[t.rank - 1];
      const double x = load_as<double>(t.dtype, static_cast<const char*>(t.data) + offset * storage_bytes(t.dtype));
      const bool held = compute != DType::kFloat32 || std::isfinite(round_to_float(x));
      if (!std::isfinite(x) || !held) {
        const std::string index = t.rank == 2 ? std::to_string(r) + ", " + std::to_string(c) : std::to_string(c);
        fail(std::string(name) + "[" + index + "] = " + number_string(x) + " but must be finite" +
             (held ? "" : " in float32, the compute type") + " (" + name + " is " + shapes + ")");
      }
      values[static_cast<size_t>(r * cols + c)] = x;
    }
  return values;
}

// The score modifiers of Options into p (after q's shapes are known).
void read_modifiers(const Options& opt, Problem& p) {
  const std::string hq = std::to_string(p.Hq), b = std::to_string(p.B);
  if (!(opt.softcap >= 0) || !std::isfinite(opt.softcap) ||
      (p.compute == DType::kFloat32 && opt.softcap != 0 && !std::isnormal(round_to_float(opt.softcap)))) {
    fail("softcap=" + number_string(opt.softcap) +
         " must be 0 (off) or a positive finite number held by the compute type (a normal float32 for float32 inputs)");
  }
  if (opt.softcap_order != Options::SoftcapOrder::kBeforeBias && opt.softcap_order != Options::SoftcapOrder::kAfterBias) {
    fail("softcap_order has an unknown value " + std::to_string(static_cast<int>(opt.softcap_order)));
  }
  p.softcap = opt.softcap;
  p.cap_after_bias = opt.softcap_order == Options::SoftcapOrder::kAfterBias;
  if (opt.alibi_slopes) {
    const TensorView& t = *opt.alibi_slopes;
    const std::string want = "(Hq,) = (" + hq + ",) or (B, Hq) = (" + b + ", " + hq + ")";
    check_basic("alibi_slopes", t, 1, 2);
    if (t.shape[t.rank - 1] != p.Hq || (t.rank == 2 && t.shape[0] != p.B && t.shape[0] != 1)) {
      fail("alibi_slopes has shape " + t.shape_string() + " but must be " + want + ": one slope per query head");
    }
    p.alibi_slopes = read_small_floats("alibi_slopes", t, want.c_str(), p.compute);
    if (t.rank == 2 && t.shape[0] == 1) p.alibi_slopes.resize(static_cast<size_t>(p.Hq));  // broadcast
  }
  if (opt.sinks) {
    const TensorView& t = *opt.sinks;
    const std::string want = "(Hq,) = (" + hq + ",)";
    check_basic("sinks", t, 1, 1);
    if (t.shape[0] != p.Hq) fail("sinks has shape " + t.shape_string() + " but must be " + want + ": one logit per query head");
    p.sinks = read_small_floats("sinks", t, want.c_str(), p.compute);
  }
}

}  // namespace

View4 checked_block_mask(const TensorView& m, const Options& opt, int max_rank, int64_t B, int64_t Hq, int64_t Nq,
                         int64_t Nk, const char* lengths) {
  if (opt.block_q < 1 || opt.block_k < 1) {
    fail("block_q=" + std::to_string(opt.block_q) + " and block_k=" + std::to_string(opt.block_k) +
         " must be at least 1 (rows and keys per block of block_mask)");
  }
  check_basic("block_mask", m, 2, max_rank);
  if (m.dtype != DType::kBool) {
    fail(std::string("block_mask has dtype ") + dtype_name(m.dtype) + " but must be bool");
  }
  // With positions (checked: both set, and q_start + Nq, k_start + Nk held by int64_t), the
  // blocks of the rows' and keys' positions, and any more.
  const bool positioned = opt.q_start && opt.k_start;
  const int64_t q_end = positioned ? *opt.q_start + Nq : Nq, k_end = positioned ? *opt.k_start + Nk : Nk;
  const int64_t blocks[4] = {B, Hq, ceil_blocks(q_end, opt.block_q), ceil_blocks(k_end, opt.block_k)};
  View4 bv = to_view4(m);
  bool fits = true;
  for (int d = 0; d < 4; ++d) {
    fits &= bv.shape[d] == blocks[d] || (d < 2 && bv.shape[d] == 1) || (d >= 2 && positioned && bv.shape[d] > blocks[d]);
  }
  if (!fits) {
    const int r = max_rank;
    const std::string head = "block_mask has shape " + m.shape_string() + ", which does not broadcast to ";
    const std::string target = r == 2 ? "(QB, KB)" : r == 3 ? "(Hq, QB, KB)" : "(B, Hq, QB, KB)";
    if (positioned) {
      fail(head + target + " with QB >= " + std::to_string(blocks[2]) + " = ceil((q_start + Nq) / block_q) = ceil((" +
           std::to_string(*opt.q_start) + " + " + std::to_string(Nq) + ") / " + std::to_string(opt.block_q) +
           ") and KB >= " + std::to_string(blocks[3]) + " = ceil((k_start + Nk) / block_k) = ceil((" +
           std::to_string(*opt.k_start) + " + " + std::to_string(Nk) + ") / " + std::to_string(opt.block_k) +
           ") (with positions, blocks are counted from position 0)" +
           (r >= 3 ? ", Hq = " + std::to_string(Hq) : std::string()) + (r == 4 ? ", B = " + std::to_string(B) : std::string()));
    }
    fail(head + shape_string(blocks + (4 - r), r) + " = " + target + " with QB = ceil(" + lengths + "Nq / block_q) = ceil(" +
         std::to_string(Nq) + " / " + std::to_string(opt.block_q) + ") and KB = ceil(" + lengths +
         "Nk / block_k) = ceil(" + std::to_string(Nk) + " / " + std::to_string(opt.block_k) + ")");
  }
  for (int d = 0; d < 2; ++d) bv.shape[d] = blocks[d];  // broadcast dims already have stride 0
  return bv;
}

namespace {

// Options::q_start and k_start into p: both or neither, each >= 0, and the positions of the
// last row and key (q_start + Nq - 1, k_start + Nk - 1) held by int64_t.
void read_positions(const Options& opt, Problem& p) {
  if (!opt.q_start && !opt.k_start) return;
  if (!opt.q_start || !opt.k_start) {
    fail(std::string(opt.q_start ? "q_start" : "k_start") + " is set but " + (opt.q_start ? "k_start" : "q_start") +
         " is not: positions need both (the position of query row 0 and of key 0)");
  }
  const auto check = [](const char* name, int64_t start, const char* n_name, int64_t n) {
    if (start < 0) fail(std::string(name) + "=" + std::to_string(start) + " must be >= 0 (a position)");
    if (start > std::numeric_limits<int64_t>::max() - n) {
      fail(std::string(name) + "=" + std::to_string(start) + " plus " + n_name + "=" + std::to_string(n) +
           " overflows int64 (the position past the last " + (n_name[0] == 'N' && n_name[1] == 'q' ? "row" : "key") + ")");
    }
  };
  check("q_start", *opt.q_start, "Nq", p.Nq);
  check("k_start", *opt.k_start, "Nk", p.Nk);
  p.positioned = true;
  p.q_start = *opt.q_start;
  p.k_start = *opt.k_start;
}

// Options::block_mask: bool, (..., ceil(Nq / block_q), ceil(Nk / block_k)), its leading dims
// broadcasting to (B, Hq) (with positions, at least the blocks of the last row's and key's
// positions: checked_block_mask); r is q's rank.
void read_block_mask(const TensorView& m, const Options& opt, int r, Problem& p) {
  p.block_mask = checked_block_mask(m, opt, r, p.B, p.Hq, p.Nq, p.Nk, "");
  p.block_q = opt.block_q;
  p.block_k = opt.block_k;
}

// The checks of q, k, v, the mask and the options: everything but the outputs.
Problem make_input_problem(const Inputs& in, const Options& opt) {
  const TensorView &q = in.q, &k = in.k, &v = in.v;
  check_basic("q", q, 2, 4);
  check_basic("k", k, 2, 4);
  check_basic("v", v, 2, 4);
  if (!is_float_dtype(q.dtype)) {
    fail(std::string("q has dtype ") + dtype_name(q.dtype) + " but must be " + storage_dtype_list());
  }
  // 8-bit K/V reach here only where no forward call dequantised them (kv_dequant.h): the
  // backward (attention_backward, attention_varlen_backward, ring) refuses them.
  if (k.dtype == DType::kInt8 || k.dtype == DType::kUInt8) {
    fail(std::string("k has dtype ") + dtype_name(k.dtype) + " (shape " + k.shape_string() +
         "): 8-bit k and v are read by the forward calls only (attention, attention_varlen, attention_paged, "
         "with kv_quant); the backward refuses them");
  }
  if (in.kv_quant) {
    fail(std::string("kv_quant is given but k has dtype ") + dtype_name(k.dtype) +
         ": kv_quant goes with int8 or uint8 k and v, in the forward calls");
  }
  // q, k and v share a dtype, but float32 queries may read a bfloat16 or float16 KV cache.
  const bool f32_over_16 = q.dtype == DType::kFloat32 && (k.dtype == DType::kBFloat16 || k.dtype == DType::kFloat16);
  if (k.dtype != q.dtype && !f32_over_16) {
    fail(std::string("k has dtype ") + dtype_name(k.dtype) + " but q has dtype " + dtype_name(q.dtype) +
         " (k and v take q's dtype, or bfloat16 or float16 under float32 q)");
  }
  check_dtype("v", v, k.dtype, "k");
  const int r = q.rank;
  if (k.rank != r) fail("k has rank " + std::to_string(k.rank) + " but q has rank " + std::to_string(r));
  if (v.rank != r) fail("v has rank " + std::to_string(v.rank) + " but q has rank " + std::to_string(r));

  Problem p;
  p.dtype = q.dtype;
  p.compute = compute_dtype(q.dtype);
  p.Nq = q.shape[r - 2];
  p.Dk = q.shape[r - 1];
  p.Nk = k.shape[r - 2];
  p.Dv = v.shape[r - 1];
  if (r >= 3) {
    p.Hq = q.shape[r - 3];
    p.Hkv = k.shape[r - 3];
  }
  if (r == 4) {
    p.B = q.shape[0];
    if (k.shape[0] != p.B) fail("k has batch " + std::to_string(k.shape[0]) + " but q has batch " + std::to_string(p.B));
    if (v.shape[0] != p.B) fail("v has batch " + std::to_string(v.shape[0]) + " but q has batch " + std::to_string(p.B));
  }
  if (k.shape[r - 1] != p.Dk) {
    fail("k has Dk=" + std::to_string(k.shape[r - 1]) + " but q has Dk=" + std::to_string(p.Dk) + " (q " +
         q.shape_string() + ", k " + k.shape_string() + ")");
  }
  if (v.shape[r - 2] != p.Nk) {
    fail("v has Nk=" + std::to_string(v.shape[r - 2]) + " but k has Nk=" + std::to_string(p.Nk) + " (k " +
         k.shape_string() + ", v " + v.shape_string() + ")");
  }
  if (r >= 3) {
    if (v.shape[r - 3] != p.Hkv) {
      fail("v has " + std::to_string(v.shape[r - 3]) + " heads but k has " + std::to_string(p.Hkv) + " (k " +
           k.shape_string() + ", v " + v.shape_string() + ")");
    }
    if (p.Hkv == 0 ? p.Hq != 0 : p.Hq % p.Hkv != 0) {
      fail("q has Hq=" + std::to_string(p.Hq) + " heads, which is not a multiple of k's Hkv=" +
           std::to_string(p.Hkv) + " (q " + q.shape_string() + ", k " + k.shape_string() + ")");
    }
    p.group = p.Hkv == 0 ? 1 : p.Hq / p.Hkv;
  }
  check_unit_last_stride("q", q);
  check_unit_last_stride("k", k);
  check_unit_last_stride("v", v);
  p.q = to_view4(q);
  p.k = to_view4(k);
  p.v = to_view4(v);
  const int64_t full_weights[4] = {p.B, p.Hq, p.Nq, p.Nk};  // the scores' shape

  if (in.mask) {
    const TensorView& m = *in.mask;
    check_basic("mask", m, 0, 4);  // rank 0: one value for every score
    if (m.dtype != DType::kBool && m.dtype != q.dtype && m.dtype != DType::kFloat32) {
      fail(std::string("mask has dtype ") + dtype_name(m.dtype) + " but must be bool, float32 or q's dtype " +
           dtype_name(q.dtype));
    }
    const char* target = r == 2 ? "(Nq, Nk)" : r == 3 ? "(Hq, Nq, Nk)" : "(B, Hq, Nq, Nk)";
    if (m.rank > r) {
      fail("mask has shape " + m.shape_string() + ", more dims than the scores " +
           shape_string(full_weights + (4 - r), r) + " = " + target);
    }
    View4 mv = to_view4(m);
    for (int d = 0; d < 4; ++d) {
      if (mv.shape[d] != full_weights[d] && mv.shape[d] != 1) {
        fail("mask has shape " + m.shape_string() + ", which does not broadcast to the scores " +
             shape_string(full_weights + (4 - r), r) + " = " + target);
      }
      mv.shape[d] = full_weights[d];  // broadcast dims already have stride 0
    }
    if (m.dtype != DType::kBool) check_mask_values(m);
    p.mask = mv;
  }
  read_positions(opt, p);
  if (opt.block_mask) read_block_mask(*opt.block_mask, opt, r, p);
  if (in.seqlens_k) p.seqlens_k = read_seqlens(*in.seqlens_k, p.B, p.Nk, r);

  if (opt.scale) {
    const double scale = *opt.scale;
    if (!std::isfinite(scale)) fail("scale must be finite, got " + number_string(scale));
    // The kernels multiply in the compute type: a scale it cannot hold would silently become
    // inf or 0 there (float32 for float32 inputs).
    if (p.compute == DType::kFloat32 && (!std::isfinite(round_to_float(scale)) ||
                                       (scale != 0 && round_to_float(scale) == 0))) {
      fail("scale=" + number_string(scale) + " cannot be held by float32, the compute type of float32 inputs " +
           "(|scale| must be at most 3.4028235e+38 and, when not 0, at least 1.4e-45)");
    }
    p.scale = scale;
  } else {
    // With Dk == 0 every score is an empty sum (0) whatever the scale; 1 avoids 1/sqrt(0).
    p.scale = p.Dk > 0 ? 1.0 / std::sqrt(static_cast<double>(p.Dk)) : 1.0;
  }
  if (opt.backend != Backend::kAuto && opt.backend != Backend::kFlash && opt.backend != Backend::kReference &&
      opt.backend != Backend::kNaive) {
    fail("backend has an unknown value " + std::to_string(static_cast<int>(opt.backend)));
  }
  if (opt.causal != Causal::kNone && opt.causal != Causal::kBottomRight && opt.causal != Causal::kTopLeft) {
    fail("causal has an unknown value " + std::to_string(static_cast<int>(opt.causal)));
  }
  p.causal = opt.causal;
  p.window = opt.window;
  if (opt.precision != Precision::kExact && opt.precision != Precision::kFast) {
    fail("precision has an unknown value " + std::to_string(static_cast<int>(opt.precision)));
  }
  p.batch_invariant = opt.batch_invariant;
  // kFast rounds the weights to q's type; float32 and float64 q (a 16-bit KV cache included)
  // compute exactly whatever it says.
  p.round_p = opt.precision == Precision::kFast && (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16);
  read_modifiers(opt, p);
  p.dropout = make_dropout(opt.dropout_p, opt.seed.value_or(0));
  p.dropout.row_offset = p.q_start;  // the draws of the rows' and keys' positions
  p.dropout.col_offset = p.k_start;
  if (opt.dropout_p > 0 && !opt.seed) {
    fail("dropout_p=" + number_string(opt.dropout_p) +
         " needs a seed: set Options::seed, a new one for each training step and the same one for "
         "attention_backward (there is no default, so that the same weights are not dropped every step)");
  }
  return p;
}

// Outputs::stats' fields, the views make_problem makes of them and their shapes, in Stats'
// order: the one list of them (check_stats and any_stats read it).
enum class StatShape { kRows, kTopK, kPooled };  // lse's shape; with a last dim k; with a last dim G
struct StatField {
  const char* name;
  std::optional<TensorView> Stats::*given;
  std::optional<View4> Problem::StatViews::*view;
  bool index;  // int64 (a count or a key index); else the compute type
  StatShape shape;
};
constexpr StatField kStatFields[] = {
    {"allowed", &Stats::allowed, &Problem::StatViews::allowed, true, StatShape::kRows},
    {"entropy", &Stats::entropy, &Problem::StatViews::entropy, false, StatShape::kRows},
    {"entropy_normalized", &Stats::entropy_normalized, &Problem::StatViews::entropy_normalized, false, StatShape::kRows},
    {"max_weight", &Stats::max_weight, &Problem::StatViews::max_weight, false, StatShape::kRows},
    {"argmax", &Stats::argmax, &Problem::StatViews::argmax, true, StatShape::kRows},
    {"topk_weights", &Stats::topk_weights, &Problem::StatViews::topk_weights, false, StatShape::kTopK},
    {"topk_indices", &Stats::topk_indices, &Problem::StatViews::topk_indices, true, StatShape::kTopK},
    {"pooled_weights", &Stats::pooled_weights, &Problem::StatViews::pooled_weights, false, StatShape::kPooled},
};

// Outputs::stats: lse's shape (the top-k views with a last dim k <= 32 added, the same k for
// both; pooled_weights with any last dim G), the compute type or int64 (indices and counts).
void check_stats(const Stats& st, DType q, int r, const int64_t* full_weights, bool written, Problem& p) {
  const char* rows = r == 2 ? "(Nq,)" : r == 3 ? "(Hq, Nq)" : "(B, Hq, Nq)";
  const char* topk_rows = r == 2 ? "(Nq, k)" : r == 3 ? "(Hq, Nq, k)" : "(B, Hq, Nq, k)";
  const char* pooled_rows = r == 2 ? "(Nq, G)" : r == 3 ? "(Hq, Nq, G)" : "(B, Hq, Nq, G)";
  const std::optional<TensorView>& first_topk = st.topk_weights ? st.topk_weights : st.topk_indices;
  if (first_topk && first_topk->rank == r && first_topk->shape[r - 1] > kMaxTopK) {
    fail(std::string(st.topk_weights ? "topk_weights" : "topk_indices") + " has shape " + first_topk->shape_string() +
         ": k = " + std::to_string(first_topk->shape[r - 1]) + " (its last dim) must be at most " +
         std::to_string(kMaxTopK));
  }
  const int64_t k = first_topk && first_topk->rank == r ? first_topk->shape[r - 1] : 0;
  const int64_t G = st.pooled_weights && st.pooled_weights->rank == r ? st.pooled_weights->shape[r - 1] : 0;
  for (const StatField& f : kStatFields) {
    const std::optional<TensorView>& t = st.*f.given;
    if (!t) continue;
    // A view of lse's shape, or with a last dim `last` added; `meaning` names its dims.
    const std::optional<int64_t> last = f.shape == StatShape::kRows   ? std::nullopt
                                        : f.shape == StatShape::kTopK ? std::optional<int64_t>(k)
                                                                      : std::optional<int64_t>(G);
    const char* meaning = f.shape == StatShape::kRows ? rows : f.shape == StatShape::kTopK ? topk_rows : pooled_rows;
    check_basic(f.name, *t, last ? 2 : 1, last ? 4 : 3);
    if (f.index && t->dtype != DType::kInt64) {
      fail(std::string(f.name) + " has dtype " + dtype_name(t->dtype) + " but must be int64");
    }
    if (!f.index) check_compute_dtype(f.name, *t, q, p.compute);
    const int64_t with_last[4] = {full_weights[0], full_weights[1], full_weights[2], last.value_or(0)};
    check_shape(f.name, *t, (last ? with_last : full_weights) + (4 - r), last ? r : r - 1, meaning);
    if (written) check_no_zero_stride(f.name, *t);
    p.stats.*f.view = to_view4(*t, last ? 4 : 3);
  }
  p.stats.topk = p.stats.topk_weights || p.stats.topk_indices ? k : 0;
}

// The forward's checks: the inputs', then the outputs'. `written` says whether out and lse
// are outputs (forward) or inputs the backward reads, which may overlap themselves (a
// broadcast lse, say).
Problem make_problem(const Inputs& in, const Outputs& outs, const Options& opt, bool written) {
  Problem p = make_input_problem(in, opt);
  const TensorView &q = in.q, &out = outs.out;
  const int r = q.rank;
  check_basic("out", out, 2, 4);
  check_dtype_or_compute("out", out, q.dtype, p.compute, "q");
  check_unit_last_stride("out", out);
  if (written) check_no_zero_stride("out", out);
  // Expected output shapes, in q's rank: (B, Hq, Nq, X) with the leading dims dropped.
  const int64_t full_out[4] = {p.B, p.Hq, p.Nq, p.Dv};
  const int64_t full_weights[4] = {p.B, p.Hq, p.Nq, p.Nk};
  check_shape("out", out, full_out + (4 - r), r, r == 2 ? "(Nq, Dv)" : r == 3 ? "(Hq, Nq, Dv)" : "(B, Hq, Nq, Dv)");
  p.out = to_view4(out);

  if (outs.weights) {
    const TensorView& w = *outs.weights;
    check_basic("weights", w, 2, 4);
    check_compute_dtype("weights", w, q.dtype, p.compute);
    check_shape("weights", w, full_weights + (4 - r), r,
                r == 2 ? "(Nq, Nk)" : r == 3 ? "(Hq, Nq, Nk)" : "(B, Hq, Nq, Nk)");
    if (written) check_no_zero_stride("weights", w);
    p.weights = to_view4(w);
  }
  if (outs.lse) {
    const TensorView& l = *outs.lse;
    check_basic("lse", l, 1, 3);
    check_compute_dtype("lse", l, q.dtype, p.compute);
    check_shape("lse", l, full_weights + (4 - r), r - 1, r == 2 ? "(Nq,)" : r == 3 ? "(Hq, Nq)" : "(B, Hq, Nq)");
    if (written) check_no_zero_stride("lse", l);
    p.lse = to_view4(l, 3);  // (B, Hq, Nq) in the first three slots, last dim 1
  }
  check_stats(outs.stats, q.dtype, r, full_weights, written, p);
  if (outs.scores) {
    const TensorView& sc = *outs.scores;
    check_basic("scores", sc, 2, 4);
    check_compute_dtype("scores", sc, q.dtype, p.compute);
    check_shape("scores", sc, full_weights + (4 - r), r, r == 2 ? "(Nq, Nk)" : r == 3 ? "(Hq, Nq, Nk)" : "(B, Hq, Nq, Nk)");
    if (written) check_no_zero_stride("scores", sc);
    const auto stage = static_cast<int>(outs.scores_stage);
    if (stage > static_cast<int>(ScoresStage::kSoftcapped)) {
      fail("scores_stage has an unknown value " + std::to_string(stage));
    }
    p.scores = to_view4(sc);
    p.scores_stage = outs.scores_stage;
  }
  return p;
}

}  // namespace

Problem make_problem(const Inputs& in, const Outputs& outs, const Options& opt) {
  return make_problem(in, outs, opt, /*written=*/true);
}

bool any_stats(const Stats& stats) {
  for (const StatField& f : kStatFields)
    if (stats.*f.given) return true;
  return false;
}

void check_alibi_gradient(const TensorView& t, const Options& opt) {
  if (!opt.alibi_slopes) {
    fail("dalibi_slopes is given but Options::alibi_slopes is not: dalibi_slopes is the gradient of the slopes");
  }
  const TensorView& slopes = *opt.alibi_slopes;
  check_basic("dalibi_slopes", t, 1, 2);
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) {
    fail(std::string("dalibi_slopes has dtype ") + dtype_name(t.dtype) + " but must be float32 or float64");
  }
  check_shape("dalibi_slopes", t, slopes.shape, slopes.rank, "the shape of alibi_slopes");
  check_no_zero_stride("dalibi_slopes", t);
}

BackwardProblem make_backward_problem(const Inputs& in, const TensorView& out, const TensorView& lse,
                                      const TensorView& dout, const Gradients& grads, const Options& opt) {
  Outputs outs;
  outs.out = out;
  outs.lse = lse;
  BackwardProblem bp{make_problem(in, outs, opt, /*written=*/false), {}, {}, {}, {},
                     std::nullopt, std::nullopt, std::nullopt};
  // Each gradient has the shape and layout needs of its forward twin, and its input's dtype or
  // the compute type (dout: q's dtype or the compute type, as out, each independently).
  const std::pair<const char*, const TensorView*> pairs[] = {
      {"dout", &out}, {"dq", &in.q}, {"dk", &in.k}, {"dv", &in.v}};
  const TensorView* grads_of[] = {&dout, &grads.dq, &grads.dk, &grads.dv};
  for (int g = 0; g < 4; ++g) {
    const char* name = pairs[g].first;
    const TensorView& like = *pairs[g].second;
    const TensorView& t = *grads_of[g];
    check_basic(name, t, 2, 4);
    const TensorView& input = g == 0 ? in.q : like;
    check_dtype_or_compute(name, t, input.dtype, bp.fwd.compute, g <= 1 ? "q" : g == 2 ? "k" : "v");
    const std::string meaning = std::string("the shape of ") + (g == 0 ? "out" : g == 1 ? "q" : g == 2 ? "k" : "v");
    check_shape(name, t, like.shape, like.rank, meaning.c_str());
    check_unit_last_stride(name, t);
    if (g > 0) check_no_zero_stride(name, t);  // dout is read; dq, dk and dv are written
  }
  if (grads.dsinks) {
    const TensorView& t = *grads.dsinks;
    if (!opt.sinks) fail("dsinks is given but Options::sinks is not: dsinks is the gradient of the sinks");
    check_basic("dsinks", t, 1, 1);
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) {
      fail(std::string("dsinks has dtype ") + dtype_name(t.dtype) + " but must be float32 or float64");
    }
    const int64_t hq[1] = {bp.fwd.Hq};
    check_shape("dsinks", t, hq, 1, "(Hq,), the shape of sinks");
    check_no_zero_stride("dsinks", t);
    bp.dsinks = to_view4(t);
  }
  if (grads.dbias) {
    const TensorView& t = *grads.dbias;
    if (!in.mask || in.mask->dtype == DType::kBool) {
      fail(std::string("dbias is given but ") + (in.mask ? "the mask is bool" : "there is no mask") +
           ": dbias is the gradient of a float mask (Inputs::mask)");
    }
    const TensorView& m = *in.mask;
    check_basic("dbias", t, 0, 4);
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64 && t.dtype != m.dtype) {
      fail(std::string("dbias has dtype ") + dtype_name(t.dtype) + " but must be float32, float64 or the mask's " +
           dtype_name(m.dtype));
    }
    check_shape("dbias", t, m.shape, m.rank, "the shape of mask");
    check_no_zero_stride("dbias", t);
    bp.dbias = to_view4(t);
  }
  if (grads.dalibi_slopes) {
    check_alibi_gradient(*grads.dalibi_slopes, opt);
    bp.dalibi = to_view4(*grads.dalibi_slopes);  // (1 or B, Hq) in the last two slots
  }
  bp.dout = to_view4(dout);
  bp.dq = to_view4(grads.dq);
  bp.dk = to_view4(grads.dk);
  bp.dv = to_view4(grads.dv);
  // lse = +inf means a score overflowed the compute type in the forward pass (its weights went
  // to its +inf keys, a limit with no useful gradient): refused rather than NaN gradients.
  // Each stored element is read once: a broadcast (stride 0) dim is not walked.
  const View4& l = *bp.fwd.lse;
  const auto extent = [&](int d, int64_t n) { return l.strides[d] == 0 ? std::min<int64_t>(n, 1) : n; };
  for (int64_t b = 0; b < extent(0, bp.fwd.B); ++b)
    for (int64_t h = 0; h < extent(1, bp.fwd.Hq); ++h)
      for (int64_t i = 0; i < extent(2, bp.fwd.Nq); ++i) {
        if (l.load<double>(b, h, i, 0) == std::numeric_limits<double>::infinity()) {
          const int64_t index[3] = {b, h, i};
          const int r = lse.rank;
          fail("lse has +inf at index " + shape_string(index + (3 - r), r) +
               ": that row's scores overflowed in the forward pass, so it has no gradient");
        }
      }
  return bp;
}

void check_no_positions(const Options& options, const char* call) {
  if (options.q_start || options.k_start) {
    fail(std::string(call) + " takes no positions: q_start and k_start must be unset (they are attention()'s and "
         "attention_backward()'s)");
  }
}

}  // namespace internal

void validate(const Inputs& inputs, const Options& options) { internal::make_input_problem(inputs, options); }

}  // namespace sdpa
