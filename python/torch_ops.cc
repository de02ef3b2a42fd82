// sdpa's torch operators: the library "sdpa" in torch's dispatcher (torch.ops.sdpa.*), loaded
// by sdpa/torch.py (torch.ops.load_library). Written against torch's C++ API so that a call
// costs what a torch operator costs: the Python path before it (autograd.Function, NumPy views)
// spent ~80 µs per call, twenty times the kernel on a decode-sized problem.
//
//   attention(q, k, v, mask?, causal, scale?, window_left, window_right, dropout_p, seed?)
//       -> (out, lse)                      q (B, Hq, Nq, Dk), k (B, Hkv, Nk, Dk), v (B, Hkv, Nk, Dv)
//   attention_out(q, k, v, causal="none", scale?) -> out    attention's out alone, for calls without
//       mask, dropout, modifiers or block mask in exact precision (no lse: a cheaper call)
//   attention_backward(dout, q, k, v, out, lse, mask?, causal, ...) -> (dq, dk, dv, dsinks, dbias, dalibi)
//   attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, ...) -> (out, lse)
//                                           q (total_q, Hq, Dk), k, v (total_k, Hkv, D)
//   attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, causal, ...)
//       -> (dq, dk, dv, dsinks, dalibi)
//   attention_weights(q, k, v, mask?, causal, scale?, window_left, window_right, ...) -> weights
//       (B, Hq, Nq, Nk) in the compute dtype: the softmax (Outputs::weights), forward only
//   attention_paged(q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q?, causal, scale?,
//       window_left, window_right) -> (out, lse)   forward only; q packed with cu_seqlens_q
//
// Every operator ends with the score modifiers, defaulted: softcap (0 = off), softcap_after_bias
// (SoftcapOrder::kAfterBias), alibi_slopes? ((Hq,) or (B, Hq)) and sinks? ((Hq,)), float32 or
// float64; then block_mask? (bool), block_q and block_k (Options::block_mask; default 128);
// then, after the backward operators' own flags (below), precision ("exact", the default, or
// "fast": Options::precision; the autograd kernels give the backward the forward's). The
// backward operators return dsinks as a fourth result ((Hq,) in the compute dtype; (0,)
// without sinks), and the autograd kernels give sinks that gradient. attention_backward
// ends with mask_grad (default false): true returns the float mask's gradient as a fifth result
// (shaped like the mask, its dtype; (0,) otherwise), which attention's autograd kernel asks for
// when the mask requires grad (a learned bias: T5's, Swin's). Both backward operators end with
// alibi_grad (default false): true returns the slopes' gradient (Gradients::dalibi_slopes) as
// their last result (shaped like alibi_slopes, their dtype; (0,) otherwise), which the autograd
// kernels ask for when the slopes require grad. attention and attention_backward end with
// seqlens_k? (Inputs::seqlens_k: (B,) int32 or int64, each in [0, Nk]; the keys past a
// sequence's length are never read, and causal and the window align to that length); the
// autograd kernel gives the backward the forward's.
// The arguments mean what they mean in sdpa/attention.h (causal: "none", "bottom_right" or
// "top_left"; a window bound < 0 is unbounded; seed: a one-element int64 tensor, present when
// dropout_p > 0 — a tensor, so that torch.compile can trace drawing it). Each kernel checks
// nothing sdpa::attention does not: its Errors become ValueError, as from sdpa._core. lse is
// in the compute dtype (float64 for float64 q, else float32) and gets no gradient.
//
// Autograd: attention, attention_out and attention_varlen have kernels at the Autograd key (a
// torch::autograd::Function whose backward calls the *_backward operator); the backward
// operators' own autograd kernels refuse a second derivative; attention_paged's and
// attention_weights' outputs carry no gradient. Fake (meta) kernels, for torch.compile, are registered in sdpa/torch.py.
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "front_options.h"
#include "sdpa/attention.h"
#include "sdpa/merge.h"

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

sdpa::DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return sdpa::DType::kFloat32;
    case at::kDouble: return sdpa::DType::kFloat64;
    case at::kBFloat16: return sdpa::DType::kBFloat16;
    case at::kHalf: return sdpa::DType::kFloat16;
    case at::kBool: return sdpa::DType::kBool;
    case at::kInt: return sdpa::DType::kInt32;
    case at::kLong: return sdpa::DType::kInt64;
    default: TORCH_CHECK_TYPE(false, name, " has dtype ", t.scalar_type(), ", which sdpa does not take");
  }
}

// A view of t for sdpa (no copy). t must live on the CPU and have at most 4 dims.
sdpa::TensorView view(const Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK_VALUE(t.dim() <= 4, name, " has ", t.dim(), " dims, but sdpa takes at most 4");
  sdpa::TensorView v;
  v.data = t.data_ptr();
  v.dtype = dtype_of(t, name);
  v.rank = static_cast<int>(t.dim());
  for (int d = 0; d < v.rank; ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

// t, or a copy of it with a contiguous last dim: the kernels load rows of q, k, v, out and
// dout with SIMD. (Gradients from autograd often arrive expanded, with stride 0 everywhere.)
Tensor unit_last(const Tensor& t) {
  return t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// The score modifiers of a call (the operators' last four arguments).
struct Mods {
  double softcap = 0.0;
  bool after_bias = false;
  std::optional<Tensor> alibi_slopes, sinks;
  std::optional<Tensor> block_mask = std::nullopt;  // attention and attention_backward only
  int64_t block_q = 128, block_k = 128;
  c10::string_view precision = "exact";  // sdpa::front checks the name
  bool batch_invariant = false;          // Options::batch_invariant (the forward operators' last flag)
};

// Options for a call (sdpa::front: causal's name is checked there, the values by the library),
// its errors raised as ValueError.
sdpa::Options options(c10::string_view causal, std::optional<double> scale, int64_t window_left, int64_t window_right,
                      double dropout_p, const std::optional<Tensor>& seed, const Mods& mods = {}) {
  sdpa::front::Call c{.scale = scale,
                      .causal = std::string_view(causal.data(), causal.size()),
                      .window = {window_left, window_right},
                      .precision = std::string_view(mods.precision.data(), mods.precision.size()),
                      .dropout_p = dropout_p,
                      .softcap = mods.softcap,
                      .softcap_order = mods.after_bias ? "after_bias" : "before_bias",
                      .block_q = mods.block_q,
                      .block_k = mods.block_k};
  if (seed) {
    TORCH_CHECK_VALUE(seed->numel() == 1 && seed->scalar_type() == at::kLong,
                      "seed must be a one-element int64 tensor, got ", seed->scalar_type(), " ", seed->sizes());
    c.seed = static_cast<uint64_t>(seed->item<int64_t>());
  }
  c.batch_invariant = mods.batch_invariant;
  if (mods.alibi_slopes) c.alibi_slopes = view(*mods.alibi_slopes, "alibi_slopes");
  if (mods.sinks) c.sinks = view(*mods.sinks, "sinks");
  if (mods.block_mask) c.block_mask = view(*mods.block_mask, "block_mask");
  try {
    return sdpa::front::options(c);
  } catch (const sdpa::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// Runs an sdpa call, its Errors (invalid arguments, nothing written) raised as ValueError.
template <class F>
void run(F&& f) {
  try {
    f();
  } catch (const sdpa::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

at::ScalarType compute_type(const Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// (..., Dk) queries -> out (..., Dv) in q's dtype and lse (...) in the compute dtype.
std::tuple<Tensor, Tensor> empty_outputs(const Tensor& q, const Tensor& v) {
  auto shape = q.sizes().vec();
  shape.back() = v.size(-1);
  Tensor out = at::empty(shape, q.options());
  shape.pop_back();
  return {out, at::empty(shape, q.options().dtype(compute_type(q)))};
}

// dsinks for a backward call: (Hq,) in the compute dtype with sinks, else (0,) (never written).
Tensor empty_dsinks(const Tensor& q, const std::optional<Tensor>& sinks) {
  return at::empty({sinks ? sinks->size(0) : 0}, q.options().dtype(compute_type(q)));
}

// ---------------------------------------------------------------- CPU kernels

std::tuple<Tensor, Tensor> attention_cpu(const Tensor& q_, const Tensor& k_, const Tensor& v_,
                                         const std::optional<Tensor>& mask, c10::string_view causal,
                                         std::optional<double> scale, int64_t window_left, int64_t window_right,
                                         double dropout_p, const std::optional<Tensor>& seed, double softcap,
                                         bool softcap_after_bias, const std::optional<Tensor>& alibi_slopes,
                                         const std::optional<Tensor>& sinks, const std::optional<Tensor>& block_mask,
                                         int64_t block_q, int64_t block_k, c10::string_view precision,
                                         const std::optional<Tensor>& seqlens_k, bool batch_invariant) {
  const Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  auto [out, lse] = empty_outputs(q, v);
  sdpa::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), std::nullopt, std::nullopt};
  if (mask) in.mask = view(*mask, "mask");
  if (seqlens_k) in.seqlens_k = view(*seqlens_k, "seqlens_k");
  const sdpa::Outputs outs{view(out, "out"), std::nullopt, view(lse, "lse")};
  const sdpa::Options opt =
      options(causal, scale, window_left, window_right, dropout_p, seed,
              Mods{softcap, softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                   batch_invariant});
  run([&] { sdpa::attention(in, outs, opt); });
  return {out, lse};
}

// attention's out alone, for the common call (no mask, dropout, modifiers or block mask; exact
// precision): no lse is allocated, returned or written, and the schema has five arguments, each
// of which costs the boxed call from Python (sdpa.torch's tiny decode step). The same kernels
// as attention's: out is attention's out bit for bit.
Tensor attention_out_cpu(const Tensor& q_, const Tensor& k_, const Tensor& v_, c10::string_view causal,
                         std::optional<double> scale) {
  const Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  auto shape = q.sizes().vec();
  shape.back() = v.size(-1);
  const Tensor out = at::empty(shape, q.options());
  const sdpa::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), std::nullopt, std::nullopt};
  const sdpa::Outputs outs{view(out, "out"), std::nullopt, std::nullopt};
  const sdpa::Options opt = options(causal, scale, -1, -1, 0.0, std::nullopt);
  run([&] { sdpa::attention(in, outs, opt); });
  return out;
}

// dalibi for a backward call: with alibi_grad, the slopes' gradient, shaped like them, in their
// dtype; else (0,) (never written).
Tensor empty_dalibi(const Tensor& q, const std::optional<Tensor>& alibi_slopes, bool alibi_grad) {
  TORCH_CHECK(!alibi_grad || alibi_slopes, "sdpa: alibi_grad needs alibi_slopes (the gradient of the slopes)");
  return alibi_grad ? at::empty(alibi_slopes->sizes(), alibi_slopes->options()) : at::empty({0}, q.options());
}

// With mask_grad, dbias is the float mask's gradient, shaped like the mask, in its dtype; else (0,).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attention_backward_cpu(
    const Tensor& dout_, const Tensor& q_, const Tensor& k_, const Tensor& v_, const Tensor& out_, const Tensor& lse,
    const std::optional<Tensor>& mask, c10::string_view causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, double dropout_p, const std::optional<Tensor>& seed, double softcap, bool softcap_after_bias,
    const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k, bool mask_grad, bool alibi_grad,
    c10::string_view precision, const std::optional<Tensor>& seqlens_k) {
  const Tensor dout = unit_last(dout_), q = unit_last(q_), k = unit_last(k_), v = unit_last(v_), out = unit_last(out_);
  Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
         dv = at::empty(v.sizes(), v.options()), dsinks = empty_dsinks(q, sinks);
  TORCH_CHECK(!mask_grad || (mask && mask->scalar_type() != at::kBool),
              "sdpa: mask_grad needs a float mask (the gradient of its biases)");
  Tensor dbias = mask_grad ? at::empty(mask->sizes(), mask->options()) : at::empty({0}, q.options());
  Tensor dalibi = empty_dalibi(q, alibi_slopes, alibi_grad);
  sdpa::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), std::nullopt, std::nullopt};
  if (mask) in.mask = view(*mask, "mask");
  if (seqlens_k) in.seqlens_k = view(*seqlens_k, "seqlens_k");
  sdpa::Gradients grads{view(dq, "dq"), view(dk, "dk"), view(dv, "dv")};
  if (sinks) grads.dsinks = view(dsinks, "dsinks");
  if (mask_grad) grads.dbias = view(dbias, "dbias");
  if (alibi_grad) grads.dalibi_slopes = view(dalibi, "dalibi_slopes");
  const sdpa::Options opt =
      options(causal, scale, window_left, window_right, dropout_p, seed,
              Mods{softcap, softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision});
  run([&] { sdpa::attention_backward(in, view(out, "out"), view(lse, "lse"), view(dout, "dout"), grads, opt); });
  return {dq, dk, dv, dsinks, dbias, dalibi};
}

sdpa::VarlenInputs varlen_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                                 const Tensor& cu_k) {
  return {view(q, "q"), view(k, "k"), view(v, "v"), view(cu_q, "cu_seqlens_q"), view(cu_k, "cu_seqlens_k")};
}

std::tuple<Tensor, Tensor> attention_varlen_cpu(const Tensor& q_, const Tensor& k_, const Tensor& v_,
                                                const Tensor& cu_q, const Tensor& cu_k, c10::string_view causal,
                                                std::optional<double> scale, int64_t window_left, int64_t window_right,
                                                double dropout_p, const std::optional<Tensor>& seed, double softcap,
                                                bool softcap_after_bias, const std::optional<Tensor>& alibi_slopes,
                                                const std::optional<Tensor>& sinks,
                                                const std::optional<Tensor>& block_mask, int64_t block_q,
                                                int64_t block_k, c10::string_view precision, bool batch_invariant) {
  const Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  TORCH_CHECK_VALUE(q.dim() == 3, "q has shape ", q.sizes(), " but must be (total_q, Hq, Dk)");
  auto shape = q.sizes().vec();
  shape.back() = v.size(-1);
  const Tensor out = at::empty(shape, q.options());
  const Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(compute_type(q)));  // (Hq, total_q)
  const sdpa::VarlenInputs in = varlen_inputs(q, k, v, cu_q, cu_k);
  const sdpa::VarlenOutputs outs{view(out, "out"), view(lse, "lse")};
  const sdpa::Options opt =
      options(causal, scale, window_left, window_right, dropout_p, seed,
              Mods{softcap, softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                   batch_invariant});
  run([&] { sdpa::attention_varlen(in, outs, opt); });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> attention_varlen_backward_cpu(
    const Tensor& dout_, const Tensor& q_, const Tensor& k_, const Tensor& v_, const Tensor& cu_q, const Tensor& cu_k,
    const Tensor& out_, const Tensor& lse, c10::string_view causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, double dropout_p, const std::optional<Tensor>& seed, double softcap, bool softcap_after_bias,
    const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k, bool alibi_grad,
    c10::string_view precision) {
  const Tensor dout = unit_last(dout_), q = unit_last(q_), k = unit_last(k_), v = unit_last(v_), out = unit_last(out_);
  Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
         dv = at::empty(v.sizes(), v.options()), dsinks = empty_dsinks(q, sinks);
  Tensor dalibi = empty_dalibi(q, alibi_slopes, alibi_grad);
  const sdpa::VarlenInputs in = varlen_inputs(q, k, v, cu_q, cu_k);
  sdpa::Gradients grads{view(dq, "dq"), view(dk, "dk"), view(dv, "dv")};
  if (sinks) grads.dsinks = view(dsinks, "dsinks");
  if (alibi_grad) grads.dalibi_slopes = view(dalibi, "dalibi_slopes");
  const sdpa::Options opt =
      options(causal, scale, window_left, window_right, dropout_p, seed,
              Mods{softcap, softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision});
  run([&] { sdpa::attention_varlen_backward(in, view(out, "out"), view(lse, "lse"), view(dout, "dout"), grads, opt); });
  return {dq, dk, dv, dsinks, dalibi};
}

std::tuple<Tensor, Tensor> attention_paged_cpu(
    const Tensor& q_, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_table, const Tensor& seqlens_k,
    const std::optional<Tensor>& cu_seqlens_q, c10::string_view causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, double softcap, bool softcap_after_bias,
    const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k, c10::string_view precision,
    bool batch_invariant) {
  const Tensor q = unit_last(q_);
  auto [out, lse] = empty_outputs(q, v_pages);
  if (cu_seqlens_q) {  // packed queries (total_q, Hq, Dk): lse (Hq, total_q)
    TORCH_CHECK_VALUE(q.dim() == 3, "q has shape ", q.sizes(), " but must be (total_q, Hq, Dk) with cu_seqlens_q");
    lse = at::empty({q.size(1), q.size(0)}, lse.options());
  }
  sdpa::PagedInputs in{view(q, "q"), view(k_pages, "k_pages"), view(v_pages, "v_pages"),
                       view(block_table, "block_table"), view(seqlens_k, "seqlens_k"), std::nullopt};
  if (cu_seqlens_q) in.cu_seqlens_q = view(*cu_seqlens_q, "cu_seqlens_q");
  const sdpa::Outputs outs{view(out, "out"), std::nullopt, view(lse, "lse")};
  const sdpa::Options opt =
      options(causal, scale, window_left, window_right, 0.0, std::nullopt,
              Mods{softcap, softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                   batch_invariant});
  run([&] { sdpa::attention_paged(in, outs, opt); });
  return {out, lse};
}

// The softmax weights of an attention call (Outputs::weights: (..., Nq, Nk) for q (..., Nq, Dk),
// the compute dtype, before dropout): sdpa.torch.MultiheadAttention's need_weights, an operator
// so that torch.compile traces it (a NumPy call would break the graph). sdpa has no call that
// writes the weights alone: out is computed too and dropped.
Tensor attention_weights_cpu(const Tensor& q_, const Tensor& k_, const Tensor& v_, const std::optional<Tensor>& mask,
                             c10::string_view causal, std::optional<double> scale, int64_t window_left,
                             int64_t window_right, double softcap, bool softcap_after_bias,
                             const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
                             const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k,
                             c10::string_view precision) {
  const Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  TORCH_CHECK_VALUE(q.dim() >= 2 && k.dim() >= 2, "q and k must have at least 2 dims, got ", q.sizes(), " and ",
                    k.sizes());
  const Tensor out = std::get<0>(empty_outputs(q, v));
  auto shape = q.sizes().vec();
  shape.back() = k.size(-2);
  const Tensor weights = at::empty(shape, q.options().dtype(compute_type(q)));
  sdpa::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), std::nullopt, std::nullopt};
  if (mask) in.mask = view(*mask, "mask");
  const sdpa::Outputs outs{view(out, "out"), view(weights, "weights"), std::nullopt};
  const sdpa::Options opt =
      options(causal, scale, window_left, window_right, 0.0, std::nullopt,
              Mods{softcap, softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision});
  run([&] { sdpa::attention(in, outs, opt); });
  return weights;
}

// ---------------------------------------------------------------- autograd

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The saved options of a forward call, for its backward.
void save_options(AutogradContext* ctx, c10::string_view causal, std::optional<double> scale, int64_t window_left,
                  int64_t window_right, double dropout_p, double softcap, bool softcap_after_bias,
                  c10::string_view precision) {
  ctx->saved_data["softcap"] = softcap;
  ctx->saved_data["precision"] = std::string(precision);  // the backward rounds p and ds as the forward did
  ctx->saved_data["softcap_after_bias"] = softcap_after_bias;
  ctx->saved_data["causal"] = std::string(causal);
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["window_left"] = window_left;
  ctx->saved_data["window_right"] = window_right;
  ctx->saved_data["dropout_p"] = dropout_p;
}
struct SavedOptions {
  std::string causal;
  std::optional<double> scale;
  int64_t window_left, window_right;
  double dropout_p;
  double softcap;
  bool softcap_after_bias;
  std::string precision;
};
SavedOptions saved_options(AutogradContext* ctx) {
  const auto& s = ctx->saved_data;
  return {s.at("causal").toStringRef(),        s.at("scale").toOptional<double>(), s.at("window_left").toInt(),
          s.at("window_right").toInt(),        s.at("dropout_p").toDouble(),       s.at("softcap").toDouble(),
          s.at("softcap_after_bias").toBool(), s.at("precision").toStringRef()};
}
std::optional<Tensor> optional(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const std::optional<Tensor>& mask, c10::string_view causal, std::optional<double> scale,
                               int64_t window_left, int64_t window_right, double dropout_p,
                               const std::optional<Tensor>& seed, double softcap, bool softcap_after_bias,
                               const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
                               const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k,
                               c10::string_view precision, const std::optional<Tensor>& seqlens_k,
                               bool batch_invariant) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto fwd = op("sdpa::attention").typed<decltype(attention_cpu)>();
    auto [out, lse] = fwd.call(q, k, v, mask, causal, scale, window_left, window_right, dropout_p, seed, softcap,
                               softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                               seqlens_k, batch_invariant);
    // Saved through autograd, so that an in-place change of an input or of the returned out
    // makes backward raise instead of using stale data.
    ctx->save_for_backward({q, k, v, out, lse, mask.value_or(Tensor()), seed.value_or(Tensor()),
                            alibi_slopes.value_or(Tensor()), sinks.value_or(Tensor()), block_mask.value_or(Tensor()),
                            seqlens_k.value_or(Tensor())});
    save_options(ctx, causal, scale, window_left, window_right, dropout_p, softcap, softcap_after_bias, precision);
    ctx->saved_data["block_q"] = block_q;
    ctx->saved_data["block_k"] = block_k;
    // A float mask that requires grad (a learned bias) gets its gradient (dbias).
    ctx->saved_data["mask_grad"] = mask && mask->requires_grad();
    // So do slopes that require grad (learned ALiBi slopes).
    ctx->saved_data["alibi_grad"] = alibi_slopes && alibi_slopes->requires_grad();
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const SavedOptions o = saved_options(ctx);
    static const auto bwd = op("sdpa::attention_backward").typed<decltype(attention_backward_cpu)>();
    Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[3]);
    const bool mask_grad = ctx->saved_data["mask_grad"].toBool(), alibi_grad = ctx->saved_data["alibi_grad"].toBool();
    auto [dq, dk, dv, dsinks, dbias, dalibi] = bwd.call(
        dout, s[0], s[1], s[2], s[3], s[4], optional(s[5]), o.causal, o.scale, o.window_left, o.window_right,
        o.dropout_p, optional(s[6]), o.softcap, o.softcap_after_bias, optional(s[7]), optional(s[8]), optional(s[9]),
        ctx->saved_data["block_q"].toInt(), ctx->saved_data["block_k"].toInt(), mask_grad, alibi_grad, o.precision,
        optional(s[10]));
    // One gradient per forward argument: q, k, v, mask, causal .. softcap_after_bias (8),
    // alibi_slopes, sinks, block_mask, block_q, block_k, precision, seqlens_k, batch_invariant.
    const Tensor none;
    return {dq,   dk,   dv,   mask_grad ? dbias : none,
            none, none, none, none, none, none, none, none,  // causal .. softcap_after_bias
            alibi_grad ? dalibi : none, s[8].defined() ? dsinks : none,
            none, none, none, none, none, none};  // block_mask, block_q, block_k, precision, seqlens_k, batch_invariant
  }
};

// Whether autograd records a call on these inputs (else the autograd kernels call the kernel
// below them directly: a Function's node and saved state cost more than a decode step).
bool records(std::initializer_list<const Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

std::tuple<Tensor, Tensor> attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const std::optional<Tensor>& mask, c10::string_view causal,
                                              std::optional<double> scale, int64_t window_left, int64_t window_right,
                                              double dropout_p, const std::optional<Tensor>& seed, double softcap,
                                              bool softcap_after_bias, const std::optional<Tensor>& alibi_slopes,
                                              const std::optional<Tensor>& sinks,
                                              const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k,
                                              c10::string_view precision, const std::optional<Tensor>& seqlens_k,
                                              bool batch_invariant) {
  const Tensor none;
  if (!records({&q, &k, &v, sinks ? &*sinks : &none, mask ? &*mask : &none, alibi_slopes ? &*alibi_slopes : &none})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto fwd = op("sdpa::attention").typed<decltype(attention_cpu)>();
    return fwd.call(q, k, v, mask, causal, scale, window_left, window_right, dropout_p, seed, softcap,
                    softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision, seqlens_k,
                    batch_invariant);
  }
  const variable_list r =
      AttentionFunction::apply(q, k, v, mask, causal, scale, window_left, window_right, dropout_p, seed, softcap,
                               softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                               seqlens_k, batch_invariant);
  return {r[0], r[1]};
}

// attention_out's Function: AttentionFunction for attention_out's five arguments (the others at
// their defaults), with a smaller node (five saved tensors, two saved options: each costs the
// recorded call), returning out alone; its backward is attention_backward's, as AttentionFunction's.
struct AttentionOutFunction : public torch::autograd::Function<AttentionOutFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               c10::string_view causal, std::optional<double> scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto fwd = op("sdpa::attention").typed<decltype(attention_cpu)>();
    auto [out, lse] = fwd.call(q, k, v, std::nullopt, causal, scale, -1, -1, 0.0, std::nullopt, 0.0, false,
                               std::nullopt, std::nullopt, std::nullopt, 128, 128, "exact", std::nullopt, false);
    ctx->save_for_backward({q, k, v, out, lse});  // (through autograd: see AttentionFunction)
    ctx->saved_data["causal"] = std::string(causal);
    ctx->saved_data["scale"] = scale;
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    static const auto bwd = op("sdpa::attention_backward").typed<decltype(attention_backward_cpu)>();
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[3]);
    auto [dq, dk, dv, dsinks, dbias, dalibi] =
        bwd.call(dout, s[0], s[1], s[2], s[3], s[4], std::nullopt, ctx->saved_data["causal"].toStringRef(),
                 ctx->saved_data["scale"].toOptional<double>(), -1, -1, 0.0, std::nullopt, 0.0, false, std::nullopt,
                 std::nullopt, std::nullopt, 128, 128, false, false, "exact", std::nullopt);
    return {dq, dk, dv, Tensor(), Tensor()};  // q, k, v, causal, scale
  }
};

// attention_out: the CPU kernel when autograd records nothing; else AttentionOutFunction.
Tensor attention_out_autograd(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view causal,
                              std::optional<double> scale) {
  if (!records({&q, &k, &v})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto fwd = op("sdpa::attention_out").typed<decltype(attention_out_cpu)>();
    return fwd.call(q, k, v, causal, scale);
  }
  return AttentionOutFunction::apply(q, k, v, causal, scale)[0];
}

struct VarlenFunction : public torch::autograd::Function<VarlenFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& cu_q, const Tensor& cu_k, c10::string_view causal,
                               std::optional<double> scale, int64_t window_left, int64_t window_right, double dropout_p,
                               const std::optional<Tensor>& seed, double softcap, bool softcap_after_bias,
                               const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
                               const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k,
                               c10::string_view precision, bool batch_invariant) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto fwd = op("sdpa::attention_varlen").typed<decltype(attention_varlen_cpu)>();
    auto [out, lse] = fwd.call(q, k, v, cu_q, cu_k, causal, scale, window_left, window_right, dropout_p, seed, softcap,
                               softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                               batch_invariant);
    ctx->save_for_backward({q, k, v, cu_q, cu_k, out, lse, seed.value_or(Tensor()), alibi_slopes.value_or(Tensor()),
                            sinks.value_or(Tensor()), block_mask.value_or(Tensor())});
    save_options(ctx, causal, scale, window_left, window_right, dropout_p, softcap, softcap_after_bias, precision);
    ctx->saved_data["block_q"] = block_q;
    ctx->saved_data["block_k"] = block_k;
    ctx->saved_data["alibi_grad"] = alibi_slopes && alibi_slopes->requires_grad();
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const SavedOptions o = saved_options(ctx);
    static const auto bwd = op("sdpa::attention_varlen_backward").typed<decltype(attention_varlen_backward_cpu)>();
    Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[5]);
    const bool alibi_grad = ctx->saved_data["alibi_grad"].toBool();
    auto [dq, dk, dv, dsinks, dalibi] = bwd.call(
        dout, s[0], s[1], s[2], s[3], s[4], s[5], s[6], o.causal, o.scale, o.window_left, o.window_right, o.dropout_p,
        optional(s[7]), o.softcap, o.softcap_after_bias, optional(s[8]), optional(s[9]), optional(s[10]),
        ctx->saved_data["block_q"].toInt(), ctx->saved_data["block_k"].toInt(), alibi_grad, o.precision);
    // One gradient per forward argument: q, k, v, cu_seqlens_q, cu_seqlens_k, causal ..
    // softcap_after_bias (8), alibi_slopes, sinks, block_mask, block_q, block_k, precision, batch_invariant.
    const Tensor none;
    return {dq,   dk,   dv,   none, none,                    // cu_seqlens_q, cu_seqlens_k
            none, none, none, none, none, none, none, none,  // causal .. softcap_after_bias
            alibi_grad ? dalibi : none, s[9].defined() ? dsinks : none,
            none, none, none, none, none};  // block_mask, block_q, block_k, precision, batch_invariant
  }
};

std::tuple<Tensor, Tensor> attention_varlen_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k, c10::string_view causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right, double dropout_p,
    const std::optional<Tensor>& seed, double softcap, bool softcap_after_bias,
    const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k, c10::string_view precision,
    bool batch_invariant) {
  const Tensor none;
  if (!records({&q, &k, &v, sinks ? &*sinks : &none, alibi_slopes ? &*alibi_slopes : &none})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto fwd = op("sdpa::attention_varlen").typed<decltype(attention_varlen_cpu)>();
    return fwd.call(q, k, v, cu_q, cu_k, causal, scale, window_left, window_right, dropout_p, seed, softcap,
                    softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision, batch_invariant);
  }
  const variable_list r =
      VarlenFunction::apply(q, k, v, cu_q, cu_k, causal, scale, window_left, window_right, dropout_p, seed, softcap,
                            softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                            batch_invariant);
  return {r[0], r[1]};
}

// The backward operators compute first derivatives only (sdpa's backward is not itself
// differentiated): their results carry a node that raises if a second derivative reaches it.
// Op names the operator and its kernel's type (a tag: kName, Kernel).
template <class Op, class Kernel = typename Op::Kernel>
struct OnceDifferentiable;
template <class Op, class... Results, class... Args>
struct OnceDifferentiable<Op, std::tuple<Results...>(Args...)>
    : public torch::autograd::Function<OnceDifferentiable<Op>> {
  static variable_list forward(AutogradContext*, Args... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto below = op(Op::kName).template typed<typename Op::Kernel>();
    return std::apply([](auto&&... r) { return variable_list{r...}; }, below.call(args...));
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, "sdpa's attention is once_differentiable: its backward has no derivative of its own, so a "
                       "second derivative (double backward) is not supported");
  }
  static std::tuple<Results...> apply_tuple(Args... args) {
    const variable_list r = OnceDifferentiable::apply(args...);
    return [&]<size_t... n>(std::index_sequence<n...>) { return std::tuple<Results...>{r[n]...}; }(
        std::index_sequence_for<Results...>());
  }
};
struct BackwardOp {
  static constexpr const char* kName = "sdpa::attention_backward";
  using Kernel = decltype(attention_backward_cpu);
};
struct VarlenBackwardOp {
  static constexpr const char* kName = "sdpa::attention_varlen_backward";
  using Kernel = decltype(attention_varlen_backward_cpu);
};
using AttentionBackwardAutograd = OnceDifferentiable<BackwardOp>;
using VarlenBackwardAutograd = OnceDifferentiable<VarlenBackwardOp>;

// attention_paged: forward only; its outputs are not connected to the inputs' graphs.
std::tuple<Tensor, Tensor> attention_paged_autograd(
    const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_table, const Tensor& seqlens_k,
    const std::optional<Tensor>& cu_seqlens_q, c10::string_view causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, double softcap, bool softcap_after_bias,
    const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k, c10::string_view precision,
    bool batch_invariant) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op("sdpa::attention_paged").typed<decltype(attention_paged_cpu)>();
  return fwd.call(q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q, causal, scale, window_left, window_right,
                  softcap, softcap_after_bias, alibi_slopes, sinks, block_mask, block_q, block_k, precision,
                  batch_invariant);
}

// attention_weights: no gradient either (sdpa.torch.MultiheadAttention's weights are for inspection).
Tensor attention_weights_autograd(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                                  c10::string_view causal, std::optional<double> scale, int64_t window_left,
                                  int64_t window_right, double softcap, bool softcap_after_bias,
                                  const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
                                  const std::optional<Tensor>& block_mask, int64_t block_q, int64_t block_k,
                                  c10::string_view precision) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto fwd = op("sdpa::attention_weights").typed<decltype(attention_weights_cpu)>();
  return fwd.call(q, k, v, mask, causal, scale, window_left, window_right, softcap, softcap_after_bias, alibi_slopes,
                  sinks, block_mask, block_q, block_k, precision);
}

// sdpa::merge_attention of (outs[s], lses[s]): out of out_dtype (default: the compute type,
// float64 when any part is float64, else float32) and lse of the compute type. No autograd.
std::tuple<Tensor, Tensor> merge_attention_cpu(at::TensorList outs, at::TensorList lses,
                                               std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK_VALUE(outs.size() == lses.size(), "outs has ", outs.size(), " tensors but lses has ", lses.size(),
                    ": one lse per out");
  TORCH_CHECK_VALUE(!outs.empty(), "merge_attention: parts is empty; there is nothing to merge");
  bool f64 = false;
  for (size_t s = 0; s < outs.size(); ++s)
    f64 = f64 || outs[s].scalar_type() == at::kDouble || lses[s].scalar_type() == at::kDouble;
  const at::ScalarType compute = f64 ? at::kDouble : at::kFloat;
  auto shape = outs[0].sizes().vec();
  Tensor out = at::empty(shape, outs[0].options().dtype(out_dtype.value_or(compute)));
  if (!shape.empty()) shape.pop_back();
  Tensor lse = at::empty(shape, outs[0].options().dtype(compute));
  std::vector<std::string> names;
  for (size_t s = 0; s < outs.size(); ++s) {
    names.push_back("parts[" + std::to_string(s) + "].out");
    names.push_back("parts[" + std::to_string(s) + "].lse");
  }
  std::vector<sdpa::Partial> parts;
  for (size_t s = 0; s < outs.size(); ++s)
    parts.push_back({view(outs[s], names[2 * s].c_str()), view(lses[s], names[2 * s + 1].c_str())});
  const sdpa::TensorView o = view(out, "out"), l = view(lse, "lse");
  run([&] { sdpa::merge_attention(parts, o, l); });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(sdpa, m) {
  // The score modifiers come last, defaulted.
#define SDPA_MODS ", float softcap=0., bool softcap_after_bias=False, Tensor? alibi_slopes=None, Tensor? sinks=None"
  // Then a block mask (packed sequences read it as Options::block_mask says).
#define SDPA_BLOCKS ", Tensor? block_mask=None, int block_q=128, int block_k=128"
  // Options::precision by name ("exact" or "fast") comes last, after the backward operators' own
  // flags too, so that older callers' positional arguments keep their meaning.
#define SDPA_PRECISION ", str precision=\"exact\""
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, str causal, float? scale, int window_left, "
        "int window_right, float dropout_p, Tensor? seed" SDPA_MODS SDPA_BLOCKS SDPA_PRECISION
        ", Tensor? seqlens_k=None, bool batch_invariant=False) -> (Tensor, Tensor)");
  m.def("attention_out(Tensor q, Tensor k, Tensor v, str causal=\"none\", float? scale=None) -> Tensor");
  m.def("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, "
        "str causal, float? scale, int window_left, int window_right, float dropout_p, Tensor? seed" SDPA_MODS
        SDPA_BLOCKS ", bool mask_grad=False, bool alibi_grad=False" SDPA_PRECISION
        ", Tensor? seqlens_k=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, str causal, "
        "float? scale, int window_left, int window_right, float dropout_p, Tensor? seed" SDPA_MODS
        SDPA_BLOCKS SDPA_PRECISION ", bool batch_invariant=False) -> (Tensor, Tensor)");
  m.def("attention_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, Tensor out, Tensor lse, str causal, float? scale, int window_left, int window_right, "
        "float dropout_p, Tensor? seed" SDPA_MODS SDPA_BLOCKS ", bool alibi_grad=False" SDPA_PRECISION
        ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("attention_paged(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seqlens_k, "
        "Tensor? cu_seqlens_q, str causal, float? scale, int window_left, int window_right" SDPA_MODS
        SDPA_BLOCKS SDPA_PRECISION ", bool batch_invariant=False) -> (Tensor, Tensor)");
  m.def("attention_weights(Tensor q, Tensor k, Tensor v, Tensor? mask, str causal, float? scale, int window_left, "
        "int window_right" SDPA_MODS SDPA_BLOCKS SDPA_PRECISION ") -> Tensor");
  m.def("merge_attention(Tensor[] outs, Tensor[] lses, ScalarType? out_dtype=None) -> (Tensor, Tensor)");
#undef SDPA_PRECISION
#undef SDPA_BLOCKS
#undef SDPA_MODS
  m.def("torch_version() -> str", [] { return std::string(SDPA_TORCH_VERSION); });
}

TORCH_LIBRARY_IMPL(sdpa, CPU, m) {
  m.impl("attention", &attention_cpu);
  m.impl("attention_out", &attention_out_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
  m.impl("attention_varlen", &attention_varlen_cpu);
  m.impl("attention_varlen_backward", &attention_varlen_backward_cpu);
  m.impl("attention_paged", &attention_paged_cpu);
  m.impl("attention_weights", &attention_weights_cpu);
  m.impl("merge_attention", &merge_attention_cpu);
}

TORCH_LIBRARY_IMPL(sdpa, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("attention_out", &attention_out_autograd);
  m.impl("attention_backward", &AttentionBackwardAutograd::apply_tuple);
  m.impl("attention_varlen", &attention_varlen_autograd);
  m.impl("attention_varlen_backward", &VarlenBackwardAutograd::apply_tuple);
  m.impl("attention_paged", &attention_paged_autograd);
  m.impl("attention_weights", &attention_weights_autograd);
}
