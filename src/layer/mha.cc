// The multi-head attention layer (sdpa/mha.h): one pipeline for the fast layer (OpenBLAS
// products, the fused kernel) and the reference layers (plain loops, kReference / kNaive
// attention), so the two differ only in how they multiply and attend.
#include "sdpa/mha.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>

#include "checks.h"
#include "layer/matrix.h"
#include "storage.h"

namespace sdpa {
namespace {
using internal::fail;
using internal::InRows;
using internal::OutRows;

std::string sh(const TensorView& t) { return t.shape_string(); }
std::string num(int64_t x) { return std::to_string(x); }

// The problem's sizes.
struct Dims {
  int64_t B, Nq, Nk, E, kdim, vdim, Hq, Hkv, Dk, Dv;
};

// `input` names the query input as the caller knows it: x_q (forward, backward) or x (step).
void check_float(const char* fn, const char* name, const TensorView& t, DType dtype, const char* input = "x_q") {
  if (t.dtype != dtype) {
    fail(std::string(fn) + ": " + name + " is " + dtype_name(t.dtype) + ", expected " + dtype_name(dtype) +
         " (the layer's dtype, " + input + "'s)");
  }
  internal::check_has_data((std::string(fn) + ": " + name).c_str(), t);
}

void check_shape(const char* fn, const char* name, const TensorView& t, std::initializer_list<int64_t> want,
                 const char* meaning) {
  bool ok = t.rank == static_cast<int>(want.size());
  int d = 0;
  for (int64_t w : want) ok = ok && t.shape[d++] == w;
  if (!ok) {
    std::string s = "(";
    for (int64_t w : want) s += (s.size() > 1 ? ", " : "") + num(w);
    fail(std::string(fn) + ": " + name + " has shape " + sh(t) + ", expected " + meaning + " = " + s + ")");
  }
}

// Checks the weights and inputs against the config (resolved) and returns the sizes; `input`
// names in.x_q in the messages, as the caller knows it (step's argument is x).
Dims check(const char* fn, const MultiHeadConfig& c, const MultiHeadWeights& w, const MultiHeadInputs& in,
           const char* input = "x_q") {
  const TensorView& xq = in.x_q;
  if (!internal::is_float_dtype(xq.dtype)) {
    fail(std::string(fn) + ": " + input + " is " + dtype_name(xq.dtype) + "; the layer takes " +
         internal::storage_dtype_list());
  }
  if (xq.rank != 3 || xq.shape[2] != c.d_model) {
    fail(std::string(fn) + ": " + input + " has shape " + sh(xq) + ", expected (B, Nq, d_model = " + num(c.d_model) +
         ")");
  }
  const DType dt = xq.dtype;
  check_float(fn, input, xq, dt, input);
  const TensorView& xk = in.x_k ? *in.x_k : xq;
  const TensorView& xv = in.x_v ? *in.x_v : xk;
  if (!in.x_k && c.kdim != c.d_model)
    fail(std::string(fn) + ": kdim " + num(c.kdim) + " != d_model " + num(c.d_model) + " needs x_k");
  if (!in.x_v && !in.x_k && c.vdim != c.d_model)
    fail(std::string(fn) + ": vdim " + num(c.vdim) + " != d_model needs x_v");
  if (in.x_v && !in.x_k) fail(std::string(fn) + ": x_v without x_k (give both for cross-attention)");
  if (!in.x_v && in.x_k && c.vdim != c.kdim) fail(std::string(fn) + ": vdim " + num(c.vdim) + " != kdim needs x_v");
  const Dims d{xq.shape[0], xq.shape[1], xk.shape[1], c.d_model, c.kdim, c.vdim,
               c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim_v};
  if (in.x_k) {
    check_float(fn, "x_k", xk, dt, input);
    check_shape(fn, "x_k", xk, {d.B, xk.rank == 3 ? xk.shape[1] : -1, d.kdim}, "(B, Nk, kdim)");
  }
  if (in.x_v) {
    check_float(fn, "x_v", xv, dt, input);
    check_shape(fn, "x_v", xv, {d.B, d.Nk, d.vdim}, "(B, Nk, vdim)");
  }
  check_float(fn, "w_q", w.w_q, dt, input);
  check_shape(fn, "w_q", w.w_q, {d.E, d.Hq * d.Dk}, "(d_model, num_heads·head_dim)");
  check_float(fn, "w_k", w.w_k, dt, input);
  check_shape(fn, "w_k", w.w_k, {d.kdim, d.Hkv * d.Dk}, "(kdim, num_kv_heads·head_dim)");
  check_float(fn, "w_v", w.w_v, dt, input);
  check_shape(fn, "w_v", w.w_v, {d.vdim, d.Hkv * d.Dv}, "(vdim, num_kv_heads·head_dim_v)");
  check_float(fn, "w_o", w.w_o, dt, input);
  check_shape(fn, "w_o", w.w_o, {d.Hq * d.Dv, d.E}, "(num_heads·head_dim_v, d_model)");
  const std::optional<TensorView>* b[4] = {&w.b_q, &w.b_k, &w.b_v, &w.b_o};
  const char* names[4] = {"b_q", "b_k", "b_v", "b_o"};
  const int64_t widths[4] = {d.Hq * d.Dk, d.Hkv * d.Dk, d.Hkv * d.Dv, d.E};
  for (int i = 0; i < 4; ++i) {
    if (b[i]->has_value() != c.bias) {
      fail(std::string(fn) + ": " + names[i] +
           (c.bias ? " is missing (config.bias is true)" : " is given but config.bias is false"));
    }
    if (*b[i]) {
      check_float(fn, names[i], **b[i], dt, input);
      check_shape(fn, names[i], **b[i], {widths[i]}, "(width of the projection)");
    }
  }
  return d;
}

// Activations of H heads of D per token live in one of two layouts:
//   head-major   (B, H, N, D) contiguous: what the kernel reads fastest (q, k, v, and dout in
//                the backward), written by gemm_heads;
//   token-major  (B, N, H·D) rows at a row stride ld: what the GEMMs read (the heads' output,
//                dq, dk, dv), written by the kernel through strides. ld is padded by a cache
//                line when H·D is a multiple of 8 lines, so that rows do not map to the same
//                few L1 sets (rows 2 KiB apart did: the kernel read them ~15 % slower than
//                contiguous ones; docs/PERFORMANCE.md).
// `bytes`: the size of an element.
int64_t row_stride(int64_t width, int64_t bytes) {
  const int64_t line = 64 / bytes;
  return width % (8 * line) == 0 ? width + line : width;
}
TensorView head_major_view(void* data, DType dt, int64_t B, int64_t N, int64_t H, int64_t D) {
  return TensorView::contiguous(data, dt, {B, H, N, D});
}
TensorView token_major_view(void* data, DType dt, int64_t B, int64_t N, int64_t H, int64_t D, int64_t ld) {
  TensorView t = TensorView::contiguous(data, dt, {B, H, N, D});
  t.strides[0] = N * ld;
  t.strides[1] = D;
  t.strides[2] = ld;
  return t;
}

// A buffer of n elements of T, kept as bytes so that MultiHeadSaved can take it as it is.
template <typename T>
struct Buf {
  std::vector<std::byte> bytes;
  explicit Buf(int64_t n) : bytes(static_cast<size_t>(n) * sizeof(T)) {}
  T* data() { return reinterpret_cast<T*>(bytes.data()); }
};
template <typename T>
T* as(const std::vector<std::byte>& b) {
  return reinterpret_cast<T*>(const_cast<std::byte*>(b.data()));
}

// Where a 16-bit layer (bfloat16, float16: computed in float32, as the kernel computes them)
// rounds: it stores its intermediates in its own dtype, each rounded once from float32 where it
// is stored, as PyTorch's 16-bit layer stores them: q, k and v after the projection, the bias
// and RoPE (the kernel's inputs), the heads' output (the kernel's output), and in the backward
// the heads' gradient (the kernel's dout) and dq, dk, dv (the kernel's gradients). y and the
// gradients of x, the weights and the biases are float32 sums rounded once when written. Every
// other layer (float32, float64, the float64 reference) stores them in its compute type T:
// nothing is rounded.
template <typename T>
DType stored_dtype(DType layer) {
  const bool low = layer == DType::kBFloat16 || layer == DType::kFloat16;
  return std::is_same_v<T, float> && low ? layer : internal::dtype_of<T>();
}

// n intermediates stored in dtype `st`, computed in T: compute() is where they are computed
// (the stored bytes themselves when st is T's dtype, else a T scratch that store() rounds
// into them once).
template <typename T>
struct Stored {
  DType dtype;
  std::vector<std::byte> bytes;
  std::vector<T> scratch;
  Stored(int64_t n, DType st) : dtype(st), bytes(static_cast<size_t>(n * internal::storage_bytes(st))) {
    if (st != internal::dtype_of<T>()) scratch.resize(static_cast<size_t>(n));
  }
  void* data() { return bytes.data(); }
  T* compute() { return dtype == internal::dtype_of<T>() ? reinterpret_cast<T*>(bytes.data()) : scratch.data(); }
  void store() {
    if (dtype == internal::dtype_of<T>()) return;
    internal::round_to<T>(dtype, scratch.data(), static_cast<int64_t>(scratch.size()), bytes.data());
    scratch = {};
  }
};

// An optional output of the compute type computed by a T layer into a float64 shadow when the
// layer's dtype is float32 and T is double (the reference layer), copied back by finish().
struct Shadow {
  std::optional<TensorView> user, view;
  std::vector<double> buffer;
  Shadow(const std::optional<TensorView>& u, bool widen) : user(u), view(u) {
    if (!u || !widen || u->dtype != DType::kFloat32) return;
    buffer.assign(static_cast<size_t>(u->numel()), 0.0);
    TensorView t = *u;
    t.data = buffer.data();
    t.dtype = DType::kFloat64;
    int64_t s = 1;
    for (int d = t.rank - 1; d >= 0; --d) t.strides[d] = s, s *= t.shape[d];
    view = t;
  }
  void finish() {
    if (buffer.empty()) return;
    internal::for_each_element(*user, [&](int64_t i, void* p) { internal::store_as<double>(user->dtype, p, buffer[i]); });
  }
};

// How a layer computes: the fast one (BLAS, options.backend), or a reference one.
struct Mode {
  bool blas;
  Backend attention;
};
Mode mode_of(const Options& o) {
  const bool ref = o.backend == Backend::kReference || o.backend == Backend::kNaive;
  return {!ref, o.backend};
}

// out = x W + b for one projection: x (R rows of width Win), W (Win × Wout), out (row stride ldo).
template <typename T>
void project(bool blas, const InRows<T>& x, int64_t R, int64_t Win, const TensorView& w,
             const std::optional<TensorView>& b, int64_t Wout, T* out, int64_t ldo) {
  const InRows<T> W = internal::in_rows<T>(w);
  internal::matmul<T>(blas, false, false, R, Wout, Win, x.data, x.ld, W.data, W.ld, T(0), out, ldo);
  if (b) internal::add_bias<T>(*b, R, Wout, out, ldo);
}

// out = x W + b for one projection written head-major: x (B·N rows of width Win), W (Win × H·D).
template <typename T>
void project_heads(bool blas, const InRows<T>& x, int64_t B, int64_t N, int64_t Win, const TensorView& w,
                   const std::optional<TensorView>& b, int64_t H, int64_t D, T* out) {
  const InRows<T> W = internal::in_rows<T>(w);
  internal::matmul_heads<T>(blas, false, false, B, N, H, D, Win, x.data, x.ld, W.data, W.ld, out);
  if (!b) return;
  const InRows<T> bias = internal::in_rows<T>(*b);
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t e = 0; e < D; ++e) out[(bh * N + i) * D + e] += bias.data[bh % H * D + e];
}

// The four projections' sizes and the rows they read, shared by forward and backward.
template <typename T>
struct LayerInputs {
  InRows<T> xq, xk, xv;
  explicit LayerInputs(const MultiHeadInputs& in)
      : xq(internal::in_rows<T>(in.x_q)),
        xk(in.x_k ? internal::in_rows<T>(*in.x_k) : InRows<T>{xq.data, xq.ld, {}}),
        xv(in.x_v ? internal::in_rows<T>(*in.x_v) : InRows<T>{xk.data, xk.ld, {}}) {}
};

// RoPE on q and k (sign -1: its inverse, for the gradients): head-major q and k in the forward,
// token-major dq and dk (row strides ldq, ldk) in the backward.
template <typename T>
void apply_rope(const MultiHeadConfig& c, const Dims& d, const MultiHeadInputs& in, T* q, T* k, int sign,
                bool head_major, int64_t ldq = 0, int64_t ldk = 0) {
  if (!c.rope) return;
  for (int64_t b = 0; b < d.B; ++b) {
    if (head_major) {
      for (int64_t h = 0; h < d.Hq; ++h)
        internal::rope<T>(q + (b * d.Hq + h) * d.Nq * d.Dk, d.Dk, d.Nq, 1, d.Dk, in.position_q, c.rope_base, sign);
      for (int64_t h = 0; h < d.Hkv; ++h)
        internal::rope<T>(k + (b * d.Hkv + h) * d.Nk * d.Dk, d.Dk, d.Nk, 1, d.Dk, in.position_k, c.rope_base, sign);
    } else {
      internal::rope<T>(q + b * d.Nq * ldq, ldq, d.Nq, d.Hq, d.Dk, in.position_q, c.rope_base, sign);
      internal::rope<T>(k + b * d.Nk * ldk, ldk, d.Nk, d.Hkv, d.Dk, in.position_k, c.rope_base, sign);
    }
  }
}

// The kernel's inputs: head-major q, k, v of dtype dt, and the mask, which the float64
// reference of a 16-bit layer reads widened to float32 (exactly): a float mask is float32 or
// q's dtype (attention.h), and that layer's q is float64. `widened` holds the copy.
Inputs attention_inputs(const Dims& d, DType dt, void* q, void* k, void* v, const MultiHeadInputs& in,
                        std::vector<float>& widened) {
  std::optional<TensorView> mask = in.mask;
  if (mask && mask->data && dt == DType::kFloat64 && (mask->dtype == DType::kBFloat16 || mask->dtype == DType::kFloat16)) {
    widened.resize(static_cast<size_t>(mask->numel()));
    internal::for_each_element(*mask, [&](int64_t i, const void* p) { widened[i] = internal::load_as<float>(mask->dtype, p); });
    TensorView t = *mask;  // the same shape, contiguous (broadcast dims stay size 1)
    t.data = widened.data();
    t.dtype = DType::kFloat32;
    int64_t stride = 1;
    for (int r = t.rank - 1; r >= 0; --r) t.strides[r] = stride, stride *= t.shape[r];
    mask = t;
  }
  return Inputs{head_major_view(q, dt, d.B, d.Nq, d.Hq, d.Dk), head_major_view(k, dt, d.B, d.Nk, d.Hkv, d.Dk),
                head_major_view(v, dt, d.B, d.Nk, d.Hkv, d.Dv), mask, in.seqlens_k};
}

template <typename T>
void forward(const MultiHeadConfig& c, const MultiHeadWeights& w, const MultiHeadInputs& in,
             const MultiHeadOutputs& out, const Options& options, MultiHeadSaved* saved) {
  const char* fn = "multi_head_attention";
  const Dims d = check(fn, c, w, in);
  check_float(fn, "y", out.y, in.x_q.dtype);
  check_shape(fn, "y", out.y, {d.B, d.Nq, d.E}, "(B, Nq, d_model)");
  const Mode m = mode_of(options);
  const DType dt = internal::dtype_of<T>(), st = stored_dtype<T>(in.x_q.dtype);
  const LayerInputs<T> x(in);

  Stored<T> q(d.B * d.Nq * d.Hq * d.Dk, st), k(d.B * d.Nk * d.Hkv * d.Dk, st), v(d.B * d.Nk * d.Hkv * d.Dv, st);
  std::vector<float> mask32;
  const Inputs ai = attention_inputs(d, st, q.data(), k.data(), v.data(), in, mask32);
  Options ao_options = options;  // precision included: the kernel's, for a 16-bit layer
  ao_options.backend = m.attention;
  validate(ai, ao_options);  // the mask and options, before anything is computed
  project_heads<T>(m.blas, x.xq, d.B, d.Nq, d.E, w.w_q, w.b_q, d.Hq, d.Dk, q.compute());
  project_heads<T>(m.blas, x.xk, d.B, d.Nk, d.kdim, w.w_k, w.b_k, d.Hkv, d.Dk, k.compute());
  project_heads<T>(m.blas, x.xv, d.B, d.Nk, d.vdim, w.w_v, w.b_v, d.Hkv, d.Dv, v.compute());
  apply_rope<T>(c, d, in, q.compute(), k.compute(), 1, true);
  q.store(), k.store(), v.store();

  // The heads' output in st, token-major; lse in the compute type (Outputs::lse's).
  const int64_t ldo = row_stride(d.Hq * d.Dv, internal::storage_bytes(st));
  std::vector<std::byte> heads(static_cast<size_t>(d.B * d.Nq * ldo * internal::storage_bytes(st)));
  Buf<T> lse(saved ? d.B * d.Hq * d.Nq : 0);
  // The reference layer of a float32 or 16-bit layer: weights and stats in float32 (the compute
  // type of the layer's dtype), computed in float64.
  const bool widen = !std::is_same_v<T, float> && in.x_q.dtype != DType::kFloat64;
  Shadow weights(out.weights, widen);
  Shadow stats[8] = {{out.stats.allowed, false},           {out.stats.entropy, widen},
                     {out.stats.entropy_normalized, widen}, {out.stats.max_weight, widen},
                     {out.stats.argmax, false},             {out.stats.topk_weights, widen},
                     {out.stats.topk_indices, false},       {out.stats.pooled_weights, widen}};
  Outputs ao;
  ao.out = token_major_view(heads.data(), st, d.B, d.Nq, d.Hq, d.Dv, ldo);
  if (saved) ao.lse = TensorView::contiguous(lse.data(), dt, {d.B, d.Hq, d.Nq});
  ao.weights = weights.view;
  ao.stats = {stats[0].view, stats[1].view, stats[2].view, stats[3].view,
              stats[4].view, stats[5].view, stats[6].view, stats[7].view};
  attention(ai, ao, ao_options);

  OutRows<T> y(out.y);
  project<T>(m.blas, internal::rows_as<T>(heads.data(), st, d.B * d.Nq, d.Hq * d.Dv, ldo), d.B * d.Nq, d.Hq * d.Dv,
             w.w_o, w.b_o, d.E, y.data, y.ld);
  y.finish();
  weights.finish();
  for (Shadow& s : stats) s.finish();
  if (saved) {
    *saved = MultiHeadSaved{st, d.B, d.Nq, d.Nk, std::move(q.bytes), std::move(k.bytes), std::move(v.bytes),
                            std::move(heads), std::move(lse.bytes)};
  }
}

// The gradients of one projection out = x W + b, given dout (R × Wout, row stride ld): dW =
// xᵀ dout, db = its column sums, and dx (+)= dout Wᵀ into `dx` when given.
template <typename T>
void project_backward(bool blas, const InRows<T>& x, int64_t R, int64_t Win, const TensorView& w, const T* dout,
                      int64_t Wout, int64_t ld, const std::optional<TensorView>& dw,
                      const std::optional<TensorView>& db, OutRows<T>* dx, bool accumulate) {
  if (dw) {
    OutRows<T> g(*dw);
    internal::matmul<T>(blas, true, false, Win, Wout, R, x.data, x.ld, dout, ld, T(0), g.data, g.ld);
    g.finish();
  }
  if (db) internal::column_sums<T>(dout, ld, R, Wout, *db);
  if (dx) {
    const InRows<T> W = internal::in_rows<T>(w);
    internal::matmul<T>(blas, false, true, R, Win, Wout, dout, ld, W.data, W.ld, accumulate ? T(1) : T(0), dx->data,
                        dx->ld);
  }
}

void check_gradient(const char* name, const std::optional<TensorView>& g, const TensorView& like, DType dt) {
  if (!g) return;
  check_float("multi_head_attention_backward", name, *g, dt);
  bool same = g->rank == like.rank;
  for (int i = 0; same && i < like.rank; ++i) same = g->shape[i] == like.shape[i];
  if (!same) {
    fail(std::string("multi_head_attention_backward: ") + name + " has shape " + sh(*g) + ", expected " + sh(like) +
         " (its parameter's or input's)");
  }
}

template <typename T>
void backward(const MultiHeadConfig& c, const MultiHeadWeights& w, const MultiHeadInputs& in,
              const MultiHeadSaved& saved, const TensorView& dy, const MultiHeadGradients& g, const Options& options) {
  const char* fn = "multi_head_attention_backward";
  const Dims d = check(fn, c, w, in);
  const DType dt = internal::dtype_of<T>(), layer = in.x_q.dtype, st = stored_dtype<T>(layer);
  const int64_t sb = internal::storage_bytes(st);
  if (saved.dtype != st || saved.batch != d.B || saved.nq != d.Nq || saved.nk != d.Nk ||
      saved.q.size() != static_cast<size_t>(d.B * d.Nq * d.Hq * d.Dk * sb) ||
      saved.heads.size() != static_cast<size_t>(d.B * d.Nq * row_stride(d.Hq * d.Dv, sb) * sb) ||
      saved.lse.size() != static_cast<size_t>(d.B * d.Hq * d.Nq) * sizeof(T)) {
    fail(std::string(fn) + ": saved is not from a forward of these inputs with this backend (B " + num(saved.batch) +
         ", Nq " + num(saved.nq) + ", Nk " + num(saved.nk) + ", " + dtype_name(saved.dtype) + "; expected B " +
         num(d.B) + ", Nq " + num(d.Nq) + ", Nk " + num(d.Nk) + ", " + dtype_name(st) + ")");
  }
  check_float(fn, "dy", dy, layer);
  check_shape(fn, "dy", dy, {d.B, d.Nq, d.E}, "(B, Nq, d_model)");
  check_gradient("dx_q", g.dx_q, in.x_q, layer);
  if (g.dx_k && !in.x_k) fail(std::string(fn) + ": dx_k is given but the forward had no x_k");
  if (g.dx_v && !in.x_v) fail(std::string(fn) + ": dx_v is given but the forward had no x_v");
  if (g.dx_k) check_gradient("dx_k", g.dx_k, *in.x_k, layer);
  if (g.dx_v) check_gradient("dx_v", g.dx_v, *in.x_v, layer);
  check_gradient("dw_q", g.dw_q, w.w_q, layer);
  check_gradient("dw_k", g.dw_k, w.w_k, layer);
  check_gradient("dw_v", g.dw_v, w.w_v, layer);
  check_gradient("dw_o", g.dw_o, w.w_o, layer);
  const std::optional<TensorView>* db[4] = {&g.db_q, &g.db_k, &g.db_v, &g.db_o};
  const std::optional<TensorView>* b[4] = {&w.b_q, &w.b_k, &w.b_v, &w.b_o};
  const char* names[4] = {"db_q", "db_k", "db_v", "db_o"};
  for (int i = 0; i < 4; ++i) {
    if (*db[i] && !c.bias) fail(std::string(fn) + ": " + names[i] + " is given but config.bias is false");
    if (*db[i]) check_gradient(names[i], *db[i], **b[i], layer);
  }
  const Mode m = mode_of(options);
  const LayerInputs<T> x(in);
  const InRows<T> dY = internal::in_rows<T>(dy);
  const int64_t Rq = d.B * d.Nq, Rk = d.B * d.Nk;

  // Output projection: dheads = dY W_Oᵀ (head-major: the kernel's dout, in st); dW_O and db_O
  // are written after the attention's backward, which may still throw (lse = +inf).
  void* heads = as<std::byte>(saved.heads);
  const int64_t ldo = row_stride(d.Hq * d.Dv, sb);
  Stored<T> dheads(Rq * d.Hq * d.Dv, st);
  {
    const InRows<T> W = internal::in_rows<T>(w.w_o);
    internal::matmul_heads<T>(m.blas, false, true, d.B, d.Nq, d.Hq, d.Dv, d.E, dY.data, dY.ld, W.data, W.ld,
                              dheads.compute());
    dheads.store();
  }

  // Attention: dq, dk, dv token-major in st, then as T (widened for a 16-bit layer), as the
  // projections' GEMMs read them.
  const int64_t ldq = row_stride(d.Hq * d.Dk, sb), ldk = row_stride(d.Hkv * d.Dk, sb),
                ldv = row_stride(d.Hkv * d.Dv, sb);
  std::vector<std::byte> dq(static_cast<size_t>(Rq * ldq * sb)), dk(static_cast<size_t>(Rk * ldk * sb)),
      dv(static_cast<size_t>(Rk * ldv * sb));
  std::vector<float> mask32;
  const Inputs ai =
      attention_inputs(d, st, as<std::byte>(saved.q), as<std::byte>(saved.k), as<std::byte>(saved.v), in, mask32);
  Options ao_options = options;  // precision included: the kernel's, for a 16-bit layer
  ao_options.backend = m.attention;
  Gradients ag{token_major_view(dq.data(), st, d.B, d.Nq, d.Hq, d.Dk, ldq),
               token_major_view(dk.data(), st, d.B, d.Nk, d.Hkv, d.Dk, ldk),
               token_major_view(dv.data(), st, d.B, d.Nk, d.Hkv, d.Dv, ldv)};
  attention_backward(ai, token_major_view(heads, st, d.B, d.Nq, d.Hq, d.Dv, ldo),
                     TensorView::contiguous(as<T>(saved.lse), dt, {d.B, d.Hq, d.Nq}),
                     head_major_view(dheads.data(), st, d.B, d.Nq, d.Hq, d.Dv), ag, ao_options);
  const InRows<T> dQ = internal::rows_as<T>(dq.data(), st, Rq, d.Hq * d.Dk, ldq),
                  dK = internal::rows_as<T>(dk.data(), st, Rk, d.Hkv * d.Dk, ldk),
                  dV = internal::rows_as<T>(dv.data(), st, Rk, d.Hkv * d.Dv, ldv);
  // RoPE's inverse in place: dQ and dK are this function's own (dq, dk or their widened copies).
  apply_rope<T>(c, d, in, const_cast<T*>(dQ.data), const_cast<T*>(dK.data), -1, false, dQ.ld, dK.ld);
  project_backward<T>(m.blas, internal::rows_as<T>(heads, st, Rq, d.Hq * d.Dv, ldo), Rq, d.Hq * d.Dv, w.w_o, dY.data,
                      d.E, dY.ld, g.dw_o, g.db_o, nullptr, false);

  // Input projections; a shared input gathers its three parts in order q, k, v.
  OutRows<T> dxq(g.dx_q);
  std::optional<OutRows<T>> dxk, dxv;
  if (g.dx_k) dxk.emplace(*g.dx_k);
  if (g.dx_v) dxv.emplace(*g.dx_v);
  OutRows<T>* to_k = in.x_k ? (dxk ? &*dxk : nullptr) : &dxq;
  OutRows<T>* to_v = in.x_v ? (dxv ? &*dxv : nullptr) : to_k;
  const bool k_adds = !in.x_k, v_adds = !in.x_v;
  project_backward<T>(m.blas, x.xq, Rq, d.E, w.w_q, dQ.data, d.Hq * d.Dk, dQ.ld, g.dw_q, g.db_q, &dxq, false);
  project_backward<T>(m.blas, x.xk, Rk, d.kdim, w.w_k, dK.data, d.Hkv * d.Dk, dK.ld, g.dw_k, g.db_k, to_k, k_adds);
  project_backward<T>(m.blas, x.xv, Rk, d.vdim, w.w_v, dV.data, d.Hkv * d.Dv, dV.ld, g.dw_v, g.db_v, to_v, v_adds);
  dxq.finish();
  if (dxk) dxk->finish();
  if (dxv) dxv->finish();
}

template <typename T>
void step(const MultiHeadConfig& c, const MultiHeadWeights& w, const TensorView& x, KVCache& cache,
          const std::vector<int64_t>& seqs, const TensorView& y, const Options& options) {
  const char* fn = "multi_head_attention_step";
  MultiHeadInputs in;
  in.x_q = x;
  if (c.kdim != c.d_model || c.vdim != c.d_model)
    fail(std::string(fn) + ": self-attention only (kdim = vdim = d_model)");
  const Dims d = check(fn, c, w, in, "x");
  check_float(fn, "y", y, x.dtype, "x");
  check_shape(fn, "y", y, {d.B, d.Nq, d.E}, "(B, n, d_model)");
  if (static_cast<int64_t>(seqs.size()) != d.B) {
    fail(std::string(fn) + ": seqs has " + num(static_cast<int64_t>(seqs.size())) +
         " sequences, x has B = " + num(d.B));
  }
  if (cache.dtype() != x.dtype || cache.num_kv_heads() != d.Hkv || cache.head_dim_k() != d.Dk ||
      cache.head_dim_v() != d.Dv) {
    fail(std::string(fn) + ": cache holds " + dtype_name(cache.dtype()) + " Hkv " + num(cache.num_kv_heads()) +
         ", Dk " + num(cache.head_dim_k()) + ", Dv " + num(cache.head_dim_v()) + "; the layer needs " +
         dtype_name(x.dtype) + " Hkv " + num(d.Hkv) + ", Dk " + num(d.Dk) + ", Dv " + num(d.Dv));
  }
  if (options.dropout_p != 0.0) fail(std::string(fn) + ": no dropout in incremental decoding");
  // Every sequence exists, appears once, and the pool has the pages: checked before any append.
  // max_pages: the longest block-table row after the append (the paged call's keys / page_size).
  const int64_t ps = cache.page_size();
  int64_t pages = 0, max_pages = 0;
  for (size_t b = 0; b < seqs.size(); ++b) {
    for (size_t a = 0; a < b; ++a)
      if (seqs[a] == seqs[b]) fail(std::string(fn) + ": sequence " + num(seqs[b]) + " appears twice in seqs");
    const int64_t L = cache.length(seqs[b]), after = (L + d.Nq + ps - 1) / ps;
    pages += after - (L + ps - 1) / ps;
    max_pages = std::max(max_pages, after);
  }
  if (pages > cache.free_pages()) {
    fail(std::string(fn) + ": the cache has " + num(cache.free_pages()) + " free pages, these tokens need " +
         num(pages));
  }
  const DType dt = x.dtype;
  Options o = options;
  o.causal = Causal::kBottomRight;
  {
    // The options as the paged call will see them (max_pages · page_size keys), checked before
    // anything is appended. Stand-in q, k, v rows of zeros: validate reads no q, k or v element.
    const std::vector<T> zeros(static_cast<size_t>(std::max(d.Dk, d.Dv)), T(0));
    auto stand_in = [&](int64_t H, int64_t N, int64_t D) {
      TensorView t = TensorView::contiguous(const_cast<T*>(zeros.data()), dt, {d.B, H, N, D});
      t.strides[0] = t.strides[1] = t.strides[2] = 0;
      return t;
    };
    validate(Inputs{stand_in(d.Hq, d.Nq, d.Dk), stand_in(d.Hkv, max_pages * ps, d.Dk),
                    stand_in(d.Hkv, max_pages * ps, d.Dv)},
             o);
  }
  // q, k, v token-major, stored (rounded, for a 16-bit layer) as the forward's after RoPE.
  const DType st = stored_dtype<T>(dt);
  const int64_t sb = internal::storage_bytes(st);
  const InRows<T> xr = internal::in_rows<T>(x);
  const int64_t R = d.B * d.Nq;
  Stored<T> q(R * d.Hq * d.Dk, st), k(R * d.Hkv * d.Dk, st), v(R * d.Hkv * d.Dv, st);
  project<T>(true, xr, R, d.E, w.w_q, w.b_q, d.Hq * d.Dk, q.compute(), d.Hq * d.Dk);
  project<T>(true, xr, R, d.E, w.w_k, w.b_k, d.Hkv * d.Dk, k.compute(), d.Hkv * d.Dk);
  project<T>(true, xr, R, d.E, w.w_v, w.b_v, d.Hkv * d.Dv, v.compute(), d.Hkv * d.Dv);
  for (int64_t b = 0; b < d.B && c.rope; ++b) {
    const int64_t pos = cache.length(seqs[b]);
    internal::rope<T>(q.compute() + b * d.Nq * d.Hq * d.Dk, d.Hq * d.Dk, d.Nq, d.Hq, d.Dk, pos, c.rope_base, 1);
    internal::rope<T>(k.compute() + b * d.Nq * d.Hkv * d.Dk, d.Hkv * d.Dk, d.Nq, d.Hkv, d.Dk, pos, c.rope_base, 1);
  }
  q.store(), k.store(), v.store();
  for (int64_t b = 0; b < d.B; ++b) {
    cache.append(seqs[b], TensorView::contiguous(as<std::byte>(k.bytes) + b * d.Nq * d.Hkv * d.Dk * sb, st, {d.Nq, d.Hkv, d.Dk}),
                 TensorView::contiguous(as<std::byte>(v.bytes) + b * d.Nq * d.Hkv * d.Dv * sb, st, {d.Nq, d.Hkv, d.Dv}));
  }
  std::vector<std::byte> heads(static_cast<size_t>(R * d.Hq * d.Dv * sb));
  Outputs ao;
  ao.out = token_major_view(heads.data(), st, d.B, d.Nq, d.Hq, d.Dv, d.Hq * d.Dv);
  cache.attention(token_major_view(q.data(), st, d.B, d.Nq, d.Hq, d.Dk, d.Hq * d.Dk), seqs, ao, o);
  OutRows<T> yr(y);
  project<T>(true, internal::rows_as<T>(heads.data(), st, R, d.Hq * d.Dv, d.Hq * d.Dv), R, d.Hq * d.Dv, w.w_o, w.b_o,
             d.E, yr.data, yr.ld);
  yr.finish();
}

bool in_f64(const MultiHeadInputs& in, const Options& o) {
  return o.backend == Backend::kReference || in.x_q.dtype == DType::kFloat64;
}

}  // namespace

MultiHeadConfig MultiHeadConfig::resolved() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) fail(std::string("MultiHeadConfig: ") + name + " must be > 0, got " + num(v));
  };
  auto defaulted = [](const char* name, int64_t v) {
    if (v < 0) fail(std::string("MultiHeadConfig: ") + name + " must be >= 0 (0: the default), got " + num(v));
  };
  MultiHeadConfig c = *this;
  positive("d_model", c.d_model);
  positive("num_heads", c.num_heads);
  defaulted("num_kv_heads", c.num_kv_heads);
  defaulted("head_dim", c.head_dim);
  defaulted("head_dim_v", c.head_dim_v);
  defaulted("kdim", c.kdim);
  defaulted("vdim", c.vdim);
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (c.num_heads % c.num_kv_heads != 0) {
    fail("MultiHeadConfig: num_kv_heads " + num(c.num_kv_heads) + " must divide num_heads " + num(c.num_heads));
  }
  if (c.head_dim == 0) {
    if (c.d_model % c.num_heads != 0) {
      fail("MultiHeadConfig: d_model " + num(c.d_model) + " is not a multiple of num_heads " + num(c.num_heads) +
           "; give head_dim");
    }
    c.head_dim = c.d_model / c.num_heads;
  }
  if (c.head_dim_v == 0) c.head_dim_v = c.head_dim;
  if (c.kdim == 0) c.kdim = c.d_model;
  if (c.vdim == 0) c.vdim = c.kdim;
  if (c.rope && c.head_dim % 2 != 0) fail("MultiHeadConfig: rope needs an even head_dim, got " + num(c.head_dim));
  if (c.rope && !(std::isfinite(c.rope_base) && c.rope_base > 0)) {
    fail("MultiHeadConfig: rope_base must be finite and > 0, got " + std::to_string(c.rope_base));
  }
  return c;
}

void multi_head_attention(const MultiHeadConfig& config, const MultiHeadWeights& weights, const MultiHeadInputs& inputs,
                          const MultiHeadOutputs& outputs, const Options& options, MultiHeadSaved* saved) {
  internal::check_no_positions(options, "multi_head_attention");
  const MultiHeadConfig c = config.resolved();
  in_f64(inputs, options) ? forward<double>(c, weights, inputs, outputs, options, saved)
                          : forward<float>(c, weights, inputs, outputs, options, saved);
}

void multi_head_attention_backward(const MultiHeadConfig& config, const MultiHeadWeights& weights,
                                   const MultiHeadInputs& inputs, const MultiHeadSaved& saved, const TensorView& dy,
                                   const MultiHeadGradients& grads, const Options& options) {
  internal::check_no_positions(options, "multi_head_attention_backward");
  const MultiHeadConfig c = config.resolved();
  in_f64(inputs, options) ? backward<double>(c, weights, inputs, saved, dy, grads, options)
                          : backward<float>(c, weights, inputs, saved, dy, grads, options);
}

void multi_head_attention_step(const MultiHeadConfig& config, const MultiHeadWeights& weights, const TensorView& x,
                               KVCache& cache, const std::vector<int64_t>& seqs, const TensorView& y,
                               const Options& options) {
  internal::check_no_positions(options, "multi_head_attention_step");
  const MultiHeadConfig c = config.resolved();
  if (x.dtype == DType::kFloat64) {
    step<double>(c, weights, x, cache, seqs, y, options);
  } else {
    step<float>(c, weights, x, cache, seqs, y, options);
  }
}

// ---- The owning layer ----

MultiHeadAttention::MultiHeadAttention(const MultiHeadConfig& config, DType dtype, uint64_t seed)
    : config_(config.resolved()), dtype_(dtype) {
  if (!internal::is_float_dtype(dtype)) {
    fail(std::string("MultiHeadAttention: dtype must be ") + internal::storage_dtype_list() + ", got " +
         dtype_name(dtype));
  }
  const MultiHeadConfig& c = config_;
  const int64_t shapes[8][2] = {{c.d_model, c.num_heads * c.head_dim},    {c.kdim, c.num_kv_heads * c.head_dim},
                                {c.vdim, c.num_kv_heads * c.head_dim_v},  {c.num_heads * c.head_dim_v, c.d_model},
                                {1, c.num_heads * c.head_dim},            {1, c.num_kv_heads * c.head_dim},
                                {1, c.num_kv_heads * c.head_dim_v},       {1, c.d_model}};
  std::mt19937_64 rng(seed);
  for (int p = 0; p < 8; ++p) {
    const int64_t n = shapes[p][0] * shapes[p][1];
    if (p >= 4 && !c.bias) continue;
    const int64_t bytes = internal::storage_bytes(dtype);
    params_[p].assign(static_cast<size_t>(n * bytes), std::byte{0});
    if (p >= 4) continue;  // biases start at 0
    // Xavier-uniform on the input projections, ±1/sqrt(fan_in) on W_O (torch's out_proj, a
    // Linear). torch draws W_Q, W_K, W_V as one (3E × E) in_proj_weight when they are all E × E
    // (kdim = vdim = E, one head width): fan-out 3E then.
    const bool packed = c.kdim == c.d_model && c.vdim == c.d_model && c.num_heads * c.head_dim == c.d_model &&
                        c.num_kv_heads * c.head_dim == c.d_model && c.num_kv_heads * c.head_dim_v == c.d_model;
    const double fan_in = static_cast<double>(shapes[p][0]);
    const double fan_out = packed && p < 3 ? 3.0 * static_cast<double>(c.d_model) : static_cast<double>(shapes[p][1]);
    const double bound = p < 3 ? std::sqrt(6.0 / (fan_in + fan_out)) : 1.0 / std::sqrt(fan_in);
    std::uniform_real_distribution<double> u(-bound, bound);
    for (int64_t i = 0; i < n; ++i) internal::store_as<double>(dtype, params_[p].data() + i * bytes, u(rng));
  }
}

MultiHeadWeights MultiHeadAttention::weights() {
  const MultiHeadConfig& c = config_;
  auto view = [&](int p, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(params_[p].data(), dtype_, shape);
  };
  MultiHeadWeights w{view(0, {c.d_model, c.num_heads * c.head_dim}), view(1, {c.kdim, c.num_kv_heads * c.head_dim}),
                     view(2, {c.vdim, c.num_kv_heads * c.head_dim_v}), view(3, {c.num_heads * c.head_dim_v, c.d_model})};
  if (c.bias) {
    w.b_q = view(4, {c.num_heads * c.head_dim});
    w.b_k = view(5, {c.num_kv_heads * c.head_dim});
    w.b_v = view(6, {c.num_kv_heads * c.head_dim_v});
    w.b_o = view(7, {c.d_model});
  }
  return w;
}

void MultiHeadAttention::forward(const MultiHeadInputs& inputs, const MultiHeadOutputs& outputs, const Options& options,
                                 MultiHeadSaved* saved) {
  multi_head_attention(config_, weights(), inputs, outputs, options, saved);
}
void MultiHeadAttention::backward(const MultiHeadInputs& inputs, const MultiHeadSaved& saved, const TensorView& dy,
                                  const MultiHeadGradients& grads, const Options& options) {
  multi_head_attention_backward(config_, weights(), inputs, saved, dy, grads, options);
}
void MultiHeadAttention::step(const TensorView& x, KVCache& cache, const std::vector<int64_t>& seqs,
                              const TensorView& y, const Options& options) {
  multi_head_attention_step(config_, weights(), x, cache, seqs, y, options);
}
KVCache MultiHeadAttention::make_cache(int64_t num_pages, int64_t page_size) const {
  return KVCache(num_pages, page_size, config_.num_kv_heads, config_.head_dim, config_.head_dim_v, dtype_);
}

}  // namespace sdpa
