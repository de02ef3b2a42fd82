// sdpa._core: a thin bridge from NumPy arrays to sdpa::attention and sdpa::attention_backward.
// All conversion and dtype policy lives in sdpa/__init__.py and sdpa/_args.py; here arrays are only wrapped as
// TensorViews (no copies). bfloat16 arrives as uint16: NumPy has no bfloat16 of its own, and
// neither DLPack nor the buffer protocol carries ml_dtypes.bfloat16, so the package passes a
// uint16 view of the same memory (arr.view(numpy.uint16)); it never passes integer arrays for
// anything else (it converts them to float64 first) but the int8 and uint8 values of an 8-bit
// K/V cache (KVQuant, quantize_kv) and int64 indices.
// sdpa::Error derives from std::invalid_argument, which nanobind raises as ValueError.
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/trampoline.h>

#include "hwy/targets.h"
#include "front_options.h"
#include "inspect.h"
#include "sdpa/attention.h"
#include "sdpa/kv_cache.h"
#include "sdpa/merge.h"
#include "sdpa/mha.h"
#include "sdpa/ring.h"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::device::cpu>;                 // outputs: written
using ConstArray = nb::ndarray<nb::ro, nb::device::cpu>;   // inputs: read-only views welcome

template <typename A>
sdpa::TensorView to_view(const A& a, const char* name) {
  sdpa::TensorView t;
  const nb::dlpack::dtype dt = a.dtype();
  if (dt == nb::dtype<float>()) {
    t.dtype = sdpa::DType::kFloat32;
  } else if (dt == nb::dtype<double>()) {
    t.dtype = sdpa::DType::kFloat64;
  } else if (dt == nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}) {
    t.dtype = sdpa::DType::kFloat16;
  } else if (dt == nb::dtype<uint16_t>()) {
    t.dtype = sdpa::DType::kBFloat16;  // the bits of an ml_dtypes.bfloat16 array (see the top)
  } else if (dt == nb::dtype<bool>()) {
    t.dtype = sdpa::DType::kBool;
  } else if (dt == nb::dtype<int64_t>()) {
    t.dtype = sdpa::DType::kInt64;  // seqlens_k, cu_seqlens, block_table (the package makes them int64)
  } else if (dt == nb::dtype<int8_t>()) {
    t.dtype = sdpa::DType::kInt8;  // an 8-bit K/V cache's values
  } else if (dt == nb::dtype<uint8_t>()) {
    t.dtype = sdpa::DType::kUInt8;
  } else {
    throw nb::type_error((std::string(name) +
                          " must be float32, float64, float16, bfloat16 (as a uint16 view), int8, uint8 or bool").c_str());
  }
  if (a.ndim() > 4) throw nb::value_error((std::string(name) + " has more than 4 dims").c_str());
  // NumPy allows data at any byte address (np.frombuffer(..., offset=1)); the kernels read
  // whole elements, so a misaligned one is refused here (the sdpa package copies it first).
  // Byte strides that are not a multiple of the item size never get this far: nanobind
  // takes strides in elements.
  const std::uintptr_t item = a.dtype().bits / 8;
  if (reinterpret_cast<std::uintptr_t>(a.data()) % item != 0) {
    throw nb::value_error((std::string(name) + " is not aligned to its item size (" + std::to_string(item) +
                           " bytes); pass an aligned copy").c_str());
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));  // inputs are only read
  t.rank = static_cast<int>(a.ndim());
  for (int d = 0; d < t.rank; ++d) {
    t.shape[d] = static_cast<int64_t>(a.shape(d));
    t.strides[d] = a.stride(d);
  }
  return t;
}

// A call's options (sdpa::front: the names of causal, backend and softcap_order, checked there).
sdpa::front::Call call(std::optional<double> scale, const std::string& causal, int64_t window_left,
                       int64_t window_right, const std::string& backend, double dropout_p = 0.0,
                       std::optional<uint64_t> seed = std::nullopt) {
  return {.scale = scale, .causal = causal, .window = {window_left, window_right}, .backend = backend,
          .dropout_p = dropout_p, .seed = seed};
}

// Options for c with the score modifiers (the last arguments of every function below).
sdpa::Options with_mods(sdpa::front::Call c, double softcap, const std::string& softcap_order,
                        const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks,
                        const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
                        const std::string& precision, bool batch_invariant = false) {
  c.precision = precision;
  c.batch_invariant = batch_invariant;
  c.softcap = softcap;
  c.softcap_order = softcap_order;
  if (alibi_slopes) c.alibi_slopes = to_view(*alibi_slopes, "alibi_slopes");
  if (sinks) c.sinks = to_view(*sinks, "sinks");
  if (block_mask) c.block_mask = to_view(*block_mask, "block_mask");
  c.block_q = block_q;
  c.block_k = block_k;
  return sdpa::front::options(c);
}

// An 8-bit K/V cache's scales and zero points (KVQuant), or nullopt when no scale is given (the
// library refuses 8-bit k and v without them, and zero points without scales, by name).
using OptArray = std::optional<ConstArray>;
std::optional<sdpa::KVQuant> kv_quant(const OptArray& k_scale, const OptArray& v_scale, const OptArray& k_zero,
                                      const OptArray& v_zero) {
  if (!k_scale && !v_scale && !k_zero && !v_zero) return std::nullopt;
  if (!k_scale || !v_scale) {
    throw nb::value_error((std::string(k_scale ? "v_scale" : "k_scale") +
                           " is missing: an 8-bit cache's k and v each take their scales").c_str());
  }
  sdpa::KVQuant q{to_view(*k_scale, "k_scale"), to_view(*v_scale, "v_scale"), std::nullopt, std::nullopt};
  if (k_zero) q.k_zero = to_view(*k_zero, "k_zero");
  if (v_zero) q.v_zero = to_view(*v_zero, "v_zero");
  return q;
}

void attention(const ConstArray& q, const ConstArray& k, const ConstArray& v, const std::optional<ConstArray>& mask,
               const std::optional<ConstArray>& seqlens_k, const Array& out,
               const std::optional<Array>& weights, const std::optional<Array>& lse, std::optional<double> scale,
               const std::string& causal, int64_t window_left, int64_t window_right, const std::string& backend,
               double dropout_p, std::optional<uint64_t> seed,
               double softcap, const std::string& softcap_order, const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks, const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
               const std::optional<std::vector<std::optional<Array>>>& stats, const std::optional<Array>& scores,
               const std::string& scores_stage, const std::string& precision, std::optional<int64_t> q_start,
               std::optional<int64_t> k_start, const OptArray& k_scale, const OptArray& v_scale,
               const OptArray& k_zero, const OptArray& v_zero, bool batch_invariant) {
  sdpa::Inputs in{to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), std::nullopt};
  if (mask) in.mask = to_view(*mask, "mask");
  if (seqlens_k) in.seqlens_k = to_view(*seqlens_k, "seqlens_k");
  in.kv_quant = kv_quant(k_scale, v_scale, k_zero, v_zero);
  sdpa::Outputs outs{to_view(out, "out"), std::nullopt, std::nullopt};
  if (weights) outs.weights = to_view(*weights, "weights");
  if (lse) outs.lse = to_view(*lse, "lse");
  if (stats) {  // sdpa::Stats' views in its order (None: not asked for)
    sdpa::Stats& st = outs.stats;
    std::optional<sdpa::TensorView>* slots[] = {&st.allowed,    &st.entropy, &st.entropy_normalized, &st.max_weight,
                                                &st.argmax,     &st.topk_weights, &st.topk_indices};
    const char* names[] = {"allowed", "entropy", "entropy_normalized", "max_weight", "argmax", "topk_weights", "topk_indices"};
    if (stats->size() != 7) throw nb::value_error("stats must hold 7 arrays or None");
    for (size_t x = 0; x < 7; ++x)
      if ((*stats)[x]) *slots[x] = to_view(*(*stats)[x], names[x]);
  }
  if (scores) {
    outs.scores = to_view(*scores, "scores");
    outs.scores_stage = sdpa::front::parse_name("return_scores", sdpa::front::kScoresStageNames, scores_stage);
  }
  sdpa::front::Call c = call(scale, causal, window_left, window_right, backend, dropout_p, seed);
  c.q_start = q_start;
  c.k_start = k_start;
  const sdpa::Options opt = with_mods(c, softcap, softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision, batch_invariant);
  nb::gil_scoped_release release;
  sdpa::attention(in, outs, opt);
}

void attention_backward(const ConstArray& q, const ConstArray& k, const ConstArray& v,
                        const std::optional<ConstArray>& mask, const std::optional<ConstArray>& seqlens_k,
                        const ConstArray& out, const ConstArray& lse,
                        const ConstArray& dout, const Array& dq, const Array& dk, const Array& dv,
                        std::optional<double> scale, const std::string& causal, int64_t window_left,
                        int64_t window_right, const std::string& backend, double dropout_p,
                        std::optional<uint64_t> seed, double softcap, const std::string& softcap_order, const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks, const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
                        const std::optional<Array>& dsinks, const std::optional<Array>& dbias,
                        const std::string& precision, std::optional<int64_t> q_start, std::optional<int64_t> k_start) {
  sdpa::Inputs in{to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), std::nullopt};
  if (mask) in.mask = to_view(*mask, "mask");
  if (seqlens_k) in.seqlens_k = to_view(*seqlens_k, "seqlens_k");
  const sdpa::TensorView out_view = to_view(out, "out"), lse_view = to_view(lse, "lse"),
                         dout_view = to_view(dout, "dout");
  sdpa::Gradients grads{to_view(dq, "dq"), to_view(dk, "dk"), to_view(dv, "dv")};
  if (dsinks) grads.dsinks = to_view(*dsinks, "dsinks");
  if (dbias) grads.dbias = to_view(*dbias, "dbias");
  sdpa::front::Call c = call(scale, causal, window_left, window_right, backend, dropout_p, seed);
  c.q_start = q_start;
  c.k_start = k_start;
  const sdpa::Options opt = with_mods(c, softcap, softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision);
  nb::gil_scoped_release release;
  sdpa::attention_backward(in, out_view, lse_view, dout_view, grads, opt);
}

void attention_varlen(const ConstArray& q, const ConstArray& k, const ConstArray& v, const ConstArray& cu_q,
                      const ConstArray& cu_k, const Array& out, const std::optional<Array>& lse,
                      std::optional<double> scale, const std::string& causal, int64_t window_left, int64_t window_right,
                      const std::string& backend, double dropout_p, std::optional<uint64_t> seed, double softcap, const std::string& softcap_order, const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks, const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
                      const std::string& precision, const OptArray& k_scale, const OptArray& v_scale,
                      const OptArray& k_zero, const OptArray& v_zero, bool batch_invariant) {
  const sdpa::VarlenInputs in{to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(cu_q, "cu_seqlens_q"),
                              to_view(cu_k, "cu_seqlens_k"), kv_quant(k_scale, v_scale, k_zero, v_zero)};
  sdpa::VarlenOutputs outs{to_view(out, "out"), std::nullopt};
  if (lse) outs.lse = to_view(*lse, "lse");
  const sdpa::Options opt = with_mods(call(scale, causal, window_left, window_right, backend, dropout_p, seed), softcap, softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision, batch_invariant);
  nb::gil_scoped_release release;
  sdpa::attention_varlen(in, outs, opt);
}

void attention_varlen_backward(const ConstArray& q, const ConstArray& k, const ConstArray& v, const ConstArray& cu_q,
                               const ConstArray& cu_k, const ConstArray& out, const ConstArray& lse,
                               const ConstArray& dout, const Array& dq, const Array& dk, const Array& dv,
                               std::optional<double> scale, const std::string& causal, int64_t window_left,
                               int64_t window_right, const std::string& backend, double dropout_p,
                               std::optional<uint64_t> seed, double softcap, const std::string& softcap_order, const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks, const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
                               const std::optional<Array>& dsinks, const std::string& precision) {
  const sdpa::VarlenInputs in{to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(cu_q, "cu_seqlens_q"),
                              to_view(cu_k, "cu_seqlens_k")};
  const sdpa::TensorView out_view = to_view(out, "out"), lse_view = to_view(lse, "lse"),
                         dout_view = to_view(dout, "dout");
  sdpa::Gradients grads{to_view(dq, "dq"), to_view(dk, "dk"), to_view(dv, "dv")};
  if (dsinks) grads.dsinks = to_view(*dsinks, "dsinks");
  const sdpa::Options opt = with_mods(call(scale, causal, window_left, window_right, backend, dropout_p, seed), softcap, softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision);
  nb::gil_scoped_release release;
  sdpa::attention_varlen_backward(in, out_view, lse_view, dout_view, grads, opt);
}

void attention_paged(const ConstArray& q, const ConstArray& k_pages, const ConstArray& v_pages, const ConstArray& table,
                     const ConstArray& seqlens_k, const std::optional<ConstArray>& cu_seqlens_q, const Array& out,
                     const std::optional<Array>& lse, std::optional<double> scale, const std::string& causal,
                     int64_t window_left, int64_t window_right, const std::string& backend, double softcap, const std::string& softcap_order, const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks, const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
                     const std::string& precision, const OptArray& k_scale, const OptArray& v_scale,
                     const OptArray& k_zero, const OptArray& v_zero, bool batch_invariant) {
  sdpa::PagedInputs in{to_view(q, "q"), to_view(k_pages, "k_pages"), to_view(v_pages, "v_pages"),
                       to_view(table, "block_table"), to_view(seqlens_k, "seqlens_k"), std::nullopt,
                       kv_quant(k_scale, v_scale, k_zero, v_zero)};
  if (cu_seqlens_q) in.cu_seqlens_q = to_view(*cu_seqlens_q, "cu_seqlens_q");
  sdpa::Outputs outs{to_view(out, "out"), std::nullopt, std::nullopt};
  if (lse) outs.lse = to_view(*lse, "lse");
  const sdpa::Options opt = with_mods(call(scale, causal, window_left, window_right, backend), softcap, softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision, batch_invariant);
  nb::gil_scoped_release release;
  sdpa::attention_paged(in, outs, opt);
}

// sdpa.inspect's page (cli/inspect.h), with the arguments attention() takes.
std::string inspect_report(const ConstArray& q, const ConstArray& k, const ConstArray& v,
                           const std::optional<ConstArray>& mask, const std::optional<ConstArray>& seqlens_k,
                           std::optional<double> scale, const std::string& causal, int64_t window_left,
                           int64_t window_right, const std::string& backend, int64_t topk, int64_t cells,
                           int64_t max_heads, const std::string& title, bool progress, double softcap,
                           const std::string& softcap_order, const std::optional<ConstArray>& alibi_slopes,
                           const std::optional<ConstArray>& sinks, const std::optional<ConstArray>& block_mask,
                           int64_t block_q, int64_t block_k, const std::string& precision) {
  sdpa_inspect::Request r;
  r.inputs = {to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), std::nullopt};
  if (mask) r.inputs.mask = to_view(*mask, "mask");
  if (seqlens_k) r.inputs.seqlens_k = to_view(*seqlens_k, "seqlens_k");
  r.options = with_mods(call(scale, causal, window_left, window_right, backend), softcap,
                        softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision);
  r.topk = topk;
  r.cells = cells;
  r.max_heads = max_heads;
  r.title = title;
  if (progress) r.progress = sdpa_inspect::terminal_progress();
  nb::gil_scoped_release release;
  return sdpa_inspect::report_html(r);
}

// A pool of a KVCache (values (num_pages, page_size, Hkv, D), or an 8-bit cache's scales or
// zero points, rank 3 or 4) as an array of its memory (bfloat16 as uint16 bits), kept alive by
// the cache (rv_policy::reference_internal).
nb::ndarray<nb::numpy> pool_array(const sdpa::TensorView& t) {
  size_t shape[4];
  int64_t strides[4];
  for (int d = 0; d < t.rank; ++d) {
    shape[d] = static_cast<size_t>(t.shape[d]);
    strides[d] = t.strides[d];
  }
  nb::dlpack::dtype dt = nb::dtype<float>();
  if (t.dtype == sdpa::DType::kFloat64) dt = nb::dtype<double>();
  if (t.dtype == sdpa::DType::kFloat16) dt = {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
  if (t.dtype == sdpa::DType::kBFloat16) dt = nb::dtype<uint16_t>();
  if (t.dtype == sdpa::DType::kInt8) dt = nb::dtype<int8_t>();
  if (t.dtype == sdpa::DType::kUInt8) dt = nb::dtype<uint8_t>();
  return nb::ndarray<nb::numpy>(t.data, static_cast<size_t>(t.rank), shape, nb::handle(), strides, dt);
}

// A KVCache's dtype by name: a storage dtype (parse_storage_dtype's names) or int8, uint8.
sdpa::DType cache_dtype(const std::string& name) {
  if (name == "int8") return sdpa::DType::kInt8;
  if (name == "uint8") return sdpa::DType::kUInt8;
  return sdpa::front::parse_storage_dtype("dtype", name);
}

// ---- The multi-head layer (sdpa/mha.h); sdpa/layer.py holds the Python class ----

// (d_model, num_heads, num_kv_heads, head_dim, head_dim_v, kdim, vdim, bias, rope, rope_base)
using LayerConfig = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, double>;
using OptArrays = std::vector<std::optional<ConstArray>>;

sdpa::MultiHeadConfig layer_config(const LayerConfig& t) {
  sdpa::MultiHeadConfig c;
  std::tie(c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim_v, c.kdim, c.vdim, c.bias, c.rope,
           c.rope_base) = t;
  return c;
}

// params: w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o (biases None without bias).
sdpa::MultiHeadWeights layer_weights(const OptArrays& p) {
  if (p.size() != 8) throw nb::value_error("params must hold 8 arrays or None");
  const char* names[8] = {"w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"};
  std::optional<sdpa::TensorView> v[8];
  for (int i = 0; i < 8; ++i)
    if (p[i]) v[i] = to_view(*p[i], names[i]);
  for (int i = 0; i < 4; ++i)
    if (!v[i]) throw nb::value_error((std::string(names[i]) + " is missing").c_str());
  return {*v[0], *v[1], *v[2], *v[3], v[4], v[5], v[6], v[7]};
}

sdpa::MultiHeadInputs layer_inputs(const ConstArray& x_q, const std::optional<ConstArray>& x_k,
                                   const std::optional<ConstArray>& x_v, const std::optional<ConstArray>& mask,
                                   int64_t position_q, int64_t position_k) {
  sdpa::MultiHeadInputs in;
  in.x_q = to_view(x_q, "x_q");
  if (x_k) in.x_k = to_view(*x_k, "x_k");
  if (x_v) in.x_v = to_view(*x_v, "x_v");
  if (mask) in.mask = to_view(*mask, "mask");
  in.position_q = position_q;
  in.position_k = position_k;
  return in;
}

void mha_forward(const LayerConfig& config, const OptArrays& params, const ConstArray& x_q,
                 const std::optional<ConstArray>& x_k, const std::optional<ConstArray>& x_v,
                 const std::optional<ConstArray>& mask, int64_t position_q, int64_t position_k, const Array& y,
                 const std::optional<Array>& weights, sdpa::MultiHeadSaved* saved, std::optional<double> scale,
                 const std::string& causal, int64_t window_left, int64_t window_right, const std::string& backend,
                 double dropout_p, std::optional<uint64_t> seed, const std::string& precision) {
  const sdpa::MultiHeadInputs in = layer_inputs(x_q, x_k, x_v, mask, position_q, position_k);
  sdpa::MultiHeadOutputs out{to_view(y, "y")};
  if (weights) out.weights = to_view(*weights, "weights");
  const sdpa::MultiHeadWeights w = layer_weights(params);
  sdpa::front::Call c = call(scale, causal, window_left, window_right, backend, dropout_p, seed);
  c.precision = precision;
  const sdpa::Options opt = sdpa::front::options(c);
  nb::gil_scoped_release release;
  sdpa::multi_head_attention(layer_config(config), w, in, out, opt, saved);
}

// grads: dx_q, dx_k, dx_v, dw_q, dw_k, dw_v, dw_o, db_q, db_k, db_v, db_o (None: not computed).
void mha_backward(const LayerConfig& config, const OptArrays& params, const ConstArray& x_q,
                  const std::optional<ConstArray>& x_k, const std::optional<ConstArray>& x_v,
                  const std::optional<ConstArray>& mask, int64_t position_q, int64_t position_k,
                  const sdpa::MultiHeadSaved& saved, const ConstArray& dy, const std::vector<std::optional<Array>>& grads,
                  std::optional<double> scale, const std::string& causal, int64_t window_left, int64_t window_right,
                  const std::string& backend, double dropout_p, std::optional<uint64_t> seed,
                  const std::string& precision) {
  if (grads.size() != 11 || !grads[0]) throw nb::value_error("grads must hold dx_q and 10 arrays or None");
  const char* names[11] = {"dx_q", "dx_k", "dx_v", "dw_q", "dw_k", "dw_v", "dw_o", "db_q", "db_k", "db_v", "db_o"};
  std::optional<sdpa::TensorView> g[11];
  for (int i = 0; i < 11; ++i)
    if (grads[i]) g[i] = to_view(*grads[i], names[i]);
  const sdpa::MultiHeadGradients mg{*g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10]};
  const sdpa::MultiHeadInputs in = layer_inputs(x_q, x_k, x_v, mask, position_q, position_k);
  const sdpa::MultiHeadWeights w = layer_weights(params);
  const sdpa::TensorView dyv = to_view(dy, "dy");
  sdpa::front::Call c = call(scale, causal, window_left, window_right, backend, dropout_p, seed);
  c.precision = precision;
  const sdpa::Options opt = sdpa::front::options(c);
  nb::gil_scoped_release release;
  sdpa::multi_head_attention_backward(layer_config(config), w, in, saved, dyv, mg, opt);
}

void mha_step(const LayerConfig& config, const OptArrays& params, const ConstArray& x, sdpa::KVCache& cache,
              const std::vector<int64_t>& seqs, const Array& y, std::optional<double> scale, int64_t window_left,
              int64_t window_right, const std::string& backend, const std::string& precision) {
  const sdpa::MultiHeadWeights w = layer_weights(params);
  const sdpa::TensorView xv = to_view(x, "x"), yv = to_view(y, "y");
  const std::string causal = "bottom_right";  // outlives c, which holds views of its names
  sdpa::front::Call c = call(scale, causal, window_left, window_right, backend);
  c.precision = precision;
  const sdpa::Options opt = sdpa::front::options(c);
  nb::gil_scoped_release release;
  sdpa::multi_head_attention_step(layer_config(config), w, xv, cache, seqs, yv, opt);
}

// sdpa::merge_attention of the partials (outs[s], lses[s]) into out and lse (the package checks
// that the two lists have one length).
void merge_attention(const std::vector<ConstArray>& outs, const std::vector<ConstArray>& lses, const Array& out,
                     const Array& lse) {
  if (outs.size() != lses.size()) throw nb::value_error("outs and lses must have one length");
  std::vector<sdpa::Partial> parts;
  for (size_t s = 0; s < outs.size(); ++s) {
    const std::string name = "parts[" + std::to_string(s) + "]";
    parts.push_back({to_view(outs[s], (name + ".out").c_str()), to_view(lses[s], (name + ".lse").c_str())});
  }
  const sdpa::TensorView o = to_view(out, "out"), l = to_view(lse, "lse");
  nb::gil_scoped_release release;
  sdpa::merge_attention(parts, o, l);
}

// ---- Ring attention (sdpa/ring.h) over a communicator written in Python ----

// sdpa::Communicator implemented by a Python subclass of _core.Communicator (sdpa/distributed.py:
// MPICommunicator; sdpa/_torch_distributed.py: TorchCommunicator). The ring calls these from C++
// without the GIL; each takes it for its Python call. Buffers reach Python as NumPy uint8 arrays
// over the ring's memory (no owner, no copy; read-only for what is sent), valid until the request
// completes; requests are ints. A Python Exception raised by a method (or a result of the wrong
// type) becomes an sdpa::Error naming the rank and the call, which the ring handles as any
// transport error; BaseExceptions that are not Exceptions (KeyboardInterrupt) pass unchanged.
class PyCommunicator : public sdpa::Communicator {
 public:
  NB_TRAMPOLINE(sdpa::Communicator);

  int rank() const override { return invoke<int>("rank", "rank()", false); }
  int size() const override { return invoke<int>("size", "size()"); }
  Request isend(const void* data, size_t bytes, int to, int tag) override {
    nb::gil_scoped_acquire gil;
    return invoke<Request>("isend", describe("isend", bytes, "to", to, tag), true, bytes_array<const uint8_t>(data, bytes),
                           to, tag);
  }
  Request irecv(void* data, size_t bytes, int from, int tag) override {
    nb::gil_scoped_acquire gil;
    return invoke<Request>("irecv", describe("irecv", bytes, "from", from, tag), true, bytes_array<uint8_t>(data, bytes),
                           from, tag);
  }
  Request iallgather(const void* in, void* out, size_t bytes) override {
    const size_t world = static_cast<size_t>(size());
    nb::gil_scoped_acquire gil;
    return invoke<Request>("iallgather", "iallgather(" + std::to_string(bytes) + " bytes)", true,
                           bytes_array<const uint8_t>(in, bytes), bytes_array<uint8_t>(out, bytes * world));
  }
  bool wait(Request request, double seconds) override {
    return invoke<bool>("wait", "wait(request " + std::to_string(request) + ")", true, request, seconds);
  }

 private:
  // The Python method `name`(args...) as an R, with the GIL; its Exceptions as sdpa::Error.
  template <typename R, typename... A>
  R invoke(const char* name, const std::string& what, bool with_rank = true, const A&... args) const {
    nb::gil_scoped_acquire gil;
    try {
      nb::detail::ticket t(nb_trampoline, name, nb::detail::str_hash(name), true);
      return nb::cast<R>(nb_trampoline.base().attr(t.key)(args...));
    } catch (const nb::python_error& e) {
      if (!e.matches(PyExc_Exception)) throw;  // KeyboardInterrupt, SystemExit: as they are
      throw sdpa::Error(prefix(with_rank) + what + " raised " + nb::type_name(e.type()).c_str() + ": " +
                        nb::str(e.value()).c_str());
    } catch (const nb::cast_error&) {
      throw sdpa::Error(prefix(with_rank) + what + " returned a value of the wrong type (requests are ints, "
                        "wait() a bool, rank() and size() ints)");
    } catch (const std::runtime_error& e) {  // nanobind's: the method is not defined
      throw sdpa::Error(prefix(with_rank) + what + ": " + e.what());
    }
  }
  // A 1-dim uint8 NumPy array over [data, data + bytes) without an owner (rv_policy::reference:
  // nanobind would copy an ownerless array otherwise); const T: read-only.
  template <typename T>
  static nb::object bytes_array(const void* data, size_t bytes) {
    nb::ndarray<nb::numpy, T, nb::ndim<1>> a(const_cast<void*>(data), {bytes}, nb::handle());
    return a.cast(nb::rv_policy::reference);
  }
  static std::string describe(const char* what, size_t bytes, const char* dir, int peer, int tag) {
    return std::string(what) + "(" + std::to_string(bytes) + " bytes " + dir + " rank " + std::to_string(peer) +
           ", tag " + std::to_string(tag) + ")";
  }
  // "rank R: the communicator (Type)'s " (the rank when rank() answers).
  std::string prefix(bool with_rank) const {
    std::string r;
    if (with_rank) {
      try {
        r = "rank " + std::to_string(nb::cast<int>(nb_trampoline.base().attr("rank")())) + ": ";
      } catch (const std::exception&) {  // (python_error, cast_error: no rank to name)
      }
    }
    return r + "the communicator (" + nb::type_name(nb_trampoline.base().type()).c_str() + ")'s ";
  }
};

// The ring's names (sdpa.distributed's layout= and strategy=), parsed once here.
constexpr sdpa::front::Name<sdpa::RingLayout> kRingLayoutNames[] = {{"zigzag", sdpa::RingLayout::kZigzag},
                                                                    {"contiguous", sdpa::RingLayout::kContiguous}};
constexpr sdpa::front::Name<sdpa::RingStrategy> kRingStrategyNames[] = {{"ring", sdpa::RingStrategy::kRing},
                                                                        {"allgather", sdpa::RingStrategy::kAllGather}};

// RingStats as the dict the ring calls return (sdpa.distributed's return_stats).
nb::dict stats_dict(const sdpa::RingStats& s) {
  nb::dict d;
  d["check_seconds"] = s.check_seconds;
  d["compute_seconds"] = s.compute_seconds;
  d["wait_seconds"] = s.wait_seconds;
  d["bytes_sent"] = s.bytes_sent;
  return d;
}

// What both ring calls do around their sdpa call: RingOptions from the ring's arguments (names
// parsed, cu_seqlens viewed; its values are the ring's to check), run(ring) without the GIL, and
// the call's stats as a dict.
template <typename Run>
nb::dict run_ring(const std::string& layout, const std::string& strategy, const std::optional<ConstArray>& cu_seqlens,
                  double timeout, Run run) {
  sdpa::RingStats stats;
  sdpa::RingOptions ring;
  ring.layout = sdpa::front::parse_name("layout", kRingLayoutNames, layout);
  ring.strategy = sdpa::front::parse_name("strategy", kRingStrategyNames, strategy);
  if (cu_seqlens) ring.cu_seqlens = to_view(*cu_seqlens, "cu_seqlens");
  ring.timeout_seconds = timeout;
  ring.stats = &stats;
  {
    nb::gil_scoped_release release;
    run(ring);
  }
  return stats_dict(stats);
}

nb::dict ring_attention(sdpa::Communicator& comm, const ConstArray& q, const ConstArray& k, const ConstArray& v,
                    const Array& out, const std::optional<Array>& lse, std::optional<double> scale,
                    const std::string& causal, int64_t window_left, int64_t window_right, const std::string& backend,
                    double dropout_p, std::optional<uint64_t> seed, double softcap, const std::string& softcap_order,
                    const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks,
                    const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
                    const std::string& precision, const std::string& layout, const std::string& strategy,
                    const std::optional<ConstArray>& cu_seqlens, double timeout) {
  const sdpa::Inputs in{to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), std::nullopt};
  sdpa::Outputs outs{to_view(out, "out"), std::nullopt, std::nullopt};
  if (lse) outs.lse = to_view(*lse, "lse");
  const sdpa::Options opt = with_mods(call(scale, causal, window_left, window_right, backend, dropout_p, seed), softcap,
                                      softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision);
  return run_ring(layout, strategy, cu_seqlens, timeout,
                  [&](const sdpa::RingOptions& ring) { sdpa::ring_attention(comm, in, outs, opt, ring); });
}

nb::dict ring_attention_backward(sdpa::Communicator& comm, const ConstArray& q, const ConstArray& k, const ConstArray& v,
                             const ConstArray& out, const ConstArray& lse, const ConstArray& dout, const Array& dq,
                             const Array& dk, const Array& dv, std::optional<double> scale, const std::string& causal,
                             int64_t window_left, int64_t window_right, const std::string& backend, double dropout_p,
                             std::optional<uint64_t> seed, double softcap, const std::string& softcap_order,
                             const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks,
                             const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
                             const std::optional<Array>& dsinks, const std::optional<Array>& dalibi_slopes,
                             const std::string& precision, const std::string& layout, const std::string& strategy,
                             const std::optional<ConstArray>& cu_seqlens, double timeout) {
  const sdpa::Inputs in{to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), std::nullopt};
  const sdpa::TensorView out_view = to_view(out, "out"), lse_view = to_view(lse, "lse"),
                         dout_view = to_view(dout, "dout");
  sdpa::Gradients grads{to_view(dq, "dq"), to_view(dk, "dk"), to_view(dv, "dv")};
  if (dsinks) grads.dsinks = to_view(*dsinks, "dsinks");
  if (dalibi_slopes) grads.dalibi_slopes = to_view(*dalibi_slopes, "dalibi_slopes");
  const sdpa::Options opt = with_mods(call(scale, causal, window_left, window_right, backend, dropout_p, seed), softcap,
                                      softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision);
  return run_ring(layout, strategy, cu_seqlens, timeout, [&](const sdpa::RingOptions& ring) {
    sdpa::ring_attention_backward(comm, in, out_view, lse_view, dout_view, grads, opt, ring);
  });
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "sdpa native core; use the functions of the sdpa package instead.";
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask").none(),
        nb::arg("seqlens_k").none(), nb::arg("out"), nb::arg("weights").none(), nb::arg("lse").none(), nb::arg("scale").none(),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"),
        nb::arg("dropout_p"), nb::arg("seed").none(), nb::arg("softcap") = 0.0, nb::arg("softcap_order") = "before_bias",
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(), nb::arg("block_mask").none() = nb::none(), nb::arg("block_q") = 128, nb::arg("block_k") = 128,
        nb::arg("stats").none() = nb::none(), nb::arg("scores").none() = nb::none(), nb::arg("scores_stage") = "final",
        nb::arg("precision") = "exact", nb::arg("q_start").none() = nb::none(), nb::arg("k_start").none() = nb::none(),
        nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(),
        nb::arg("k_zero").none() = nb::none(), nb::arg("v_zero").none() = nb::none(), nb::arg("batch_invariant") = false);
  m.def("attention_backward", &attention_backward, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("mask").none(), nb::arg("seqlens_k").none(), nb::arg("out"), nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"),
        nb::arg("dv"), nb::arg("scale").none(), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("backend"), nb::arg("dropout_p"), nb::arg("seed").none(), nb::arg("softcap") = 0.0, nb::arg("softcap_order") = "before_bias",
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(), nb::arg("block_mask").none() = nb::none(), nb::arg("block_q") = 128, nb::arg("block_k") = 128,
        nb::arg("dsinks").none() = nb::none(), nb::arg("dbias").none() = nb::none(), nb::arg("precision") = "exact",
        nb::arg("q_start").none() = nb::none(), nb::arg("k_start").none() = nb::none());
  m.def("attention_varlen", &attention_varlen, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"),
        nb::arg("cu_seqlens_k"), nb::arg("out"), nb::arg("lse").none(), nb::arg("scale").none(), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"), nb::arg("dropout_p"),
        nb::arg("seed").none(), nb::arg("softcap") = 0.0, nb::arg("softcap_order") = "before_bias",
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(), nb::arg("block_mask").none() = nb::none(), nb::arg("block_q") = 128, nb::arg("block_k") = 128,
        nb::arg("precision") = "exact", nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(),
        nb::arg("k_zero").none() = nb::none(), nb::arg("v_zero").none() = nb::none(), nb::arg("batch_invariant") = false);
  m.def("attention_varlen_backward", &attention_varlen_backward, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("out"), nb::arg("lse"), nb::arg("dout"),
        nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("scale").none(), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"), nb::arg("dropout_p"),
        nb::arg("seed").none(), nb::arg("softcap") = 0.0, nb::arg("softcap_order") = "before_bias",
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(), nb::arg("block_mask").none() = nb::none(), nb::arg("block_q") = 128, nb::arg("block_k") = 128, nb::arg("dsinks").none() = nb::none(), nb::arg("precision") = "exact");
  m.def("attention_paged", &attention_paged, nb::arg("q"), nb::arg("k_pages"), nb::arg("v_pages"),
        nb::arg("block_table"), nb::arg("seqlens_k"), nb::arg("cu_seqlens_q").none(), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("scale").none(),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"), nb::arg("softcap") = 0.0, nb::arg("softcap_order") = "before_bias",
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(), nb::arg("block_mask").none() = nb::none(), nb::arg("block_q") = 128, nb::arg("block_k") = 128,
        nb::arg("precision") = "exact", nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(),
        nb::arg("k_zero").none() = nb::none(), nb::arg("v_zero").none() = nb::none(), nb::arg("batch_invariant") = false);
  m.def("inspect_report", &inspect_report, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask").none(),
        nb::arg("seqlens_k").none(), nb::arg("scale").none(), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("backend"), nb::arg("topk"), nb::arg("cells"), nb::arg("max_heads"),
        nb::arg("title"), nb::arg("progress"), nb::arg("softcap") = 0.0, nb::arg("softcap_order") = "before_bias",
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
        nb::arg("block_mask").none() = nb::none(), nb::arg("block_q") = 128, nb::arg("block_k") = 128,
        nb::arg("precision") = "exact");
  nb::class_<sdpa::KVCache>(m, "KVCache")
      .def("__init__",
           [](sdpa::KVCache* c, int64_t num_pages, int64_t page_size, int64_t heads, int64_t dk, int64_t dv,
              const std::string& dtype, int64_t quant_groups) {
             new (c) sdpa::KVCache(num_pages, page_size, heads, dk, dv, cache_dtype(dtype), quant_groups);
           },
           nb::arg("num_pages"), nb::arg("page_size"), nb::arg("num_kv_heads"), nb::arg("head_dim_k"),
           nb::arg("head_dim_v"), nb::arg("dtype"), nb::arg("quant_groups") = 1)
      .def("new_sequence", &sdpa::KVCache::new_sequence)
      .def("append", [](sdpa::KVCache& c, int64_t seq, const ConstArray& k, const ConstArray& v) {
        c.append(seq, to_view(k, "k"), to_view(v, "v"));
      }, nb::arg("seq"), nb::arg("k"), nb::arg("v"))
      .def("free", &sdpa::KVCache::free, nb::arg("seq"))
      .def("length", &sdpa::KVCache::length, nb::arg("seq"))
      .def("pages", &sdpa::KVCache::pages, nb::arg("seq"))
      .def("sequences", &sdpa::KVCache::sequences)
      .def_prop_ro("free_pages", &sdpa::KVCache::free_pages)
      .def_prop_ro("num_pages", &sdpa::KVCache::num_pages)
      .def_prop_ro("page_size", &sdpa::KVCache::page_size)
      .def_prop_ro("num_kv_heads", &sdpa::KVCache::num_kv_heads)
      .def_prop_ro("head_dim_k", &sdpa::KVCache::head_dim_k)
      .def_prop_ro("head_dim_v", &sdpa::KVCache::head_dim_v)
      .def_prop_ro("dtype", [](const sdpa::KVCache& c) { return std::string(sdpa::dtype_name(c.dtype())); })
      .def("k_pages", [](const sdpa::KVCache& c) { return pool_array(c.k_pages()); }, nb::rv_policy::reference_internal)
      .def("v_pages", [](const sdpa::KVCache& c) { return pool_array(c.v_pages()); }, nb::rv_policy::reference_internal)
      .def_prop_ro("quant_groups", &sdpa::KVCache::quant_groups)
      // An 8-bit cache's scale or zero-point pool: KVQuant's field `i` (k_scale, v_scale, k_zero,
      // v_zero); ValueError for one the cache does not have.
      .def("kv_quant_pool", [](const sdpa::KVCache& c, int i) {
        const std::optional<sdpa::KVQuant> q = c.kv_quant();
        const std::optional<sdpa::TensorView> pools[4] = {q ? std::optional(q->k_scale) : std::nullopt,
                                                          q ? std::optional(q->v_scale) : std::nullopt,
                                                          q ? q->k_zero : std::nullopt, q ? q->v_zero : std::nullopt};
        if (i < 0 || i > 3 || !pools[i]) throw nb::value_error("this KVCache has no such pool");
        return pool_array(*pools[i]);
      }, nb::arg("i"), nb::rv_policy::reference_internal)
      .def("attention",
           [](const sdpa::KVCache& c, const ConstArray& q, const std::vector<int64_t>& seqs, const Array& out,
              const std::optional<Array>& lse, std::optional<double> scale, const std::string& causal,
              int64_t window_left, int64_t window_right, const std::string& backend, double softcap, const std::string& softcap_order, const std::optional<ConstArray>& alibi_slopes, const std::optional<ConstArray>& sinks, const std::optional<ConstArray>& block_mask, int64_t block_q, int64_t block_k,
              const std::string& precision, bool batch_invariant) {
             sdpa::Outputs outs{to_view(out, "out"), std::nullopt, std::nullopt};
             if (lse) outs.lse = to_view(*lse, "lse");
             const sdpa::TensorView qv = to_view(q, "q");
             const sdpa::Options opt = with_mods(call(scale, causal, window_left, window_right, backend), softcap, softcap_order, alibi_slopes, sinks, block_mask, block_q, block_k, precision, batch_invariant);
             nb::gil_scoped_release release;
             c.attention(qv, seqs, outs, opt);
           },
           nb::arg("q"), nb::arg("seqs"), nb::arg("out"), nb::arg("lse").none(), nb::arg("scale").none(),
           nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"),
           nb::arg("softcap") = 0.0, nb::arg("softcap_order") = "before_bias",
           nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(), nb::arg("block_mask").none() = nb::none(), nb::arg("block_q") = 128, nb::arg("block_k") = 128,
           nb::arg("precision") = "exact", nb::arg("batch_invariant") = false);
  nb::class_<sdpa::MultiHeadSaved>(m, "MultiHeadSaved").def(nb::init<>());
  m.def("mha_resolved", [](const LayerConfig& t) {
    const sdpa::MultiHeadConfig c = layer_config(t).resolved();
    return LayerConfig{c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim_v, c.kdim, c.vdim, c.bias, c.rope,
                       c.rope_base};
  }, nb::arg("config"));
  m.def("mha_forward", &mha_forward, nb::arg("config"), nb::arg("params"), nb::arg("x_q"), nb::arg("x_k").none(),
        nb::arg("x_v").none(), nb::arg("mask").none(), nb::arg("position_q"), nb::arg("position_k"), nb::arg("y"),
        nb::arg("weights").none(), nb::arg("saved").none(), nb::arg("scale").none(), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"), nb::arg("dropout_p"),
        nb::arg("seed").none(), nb::arg("precision") = "exact");
  m.def("mha_backward", &mha_backward, nb::arg("config"), nb::arg("params"), nb::arg("x_q"), nb::arg("x_k").none(),
        nb::arg("x_v").none(), nb::arg("mask").none(), nb::arg("position_q"), nb::arg("position_k"),
        nb::arg("saved"), nb::arg("dy"), nb::arg("grads"), nb::arg("scale").none(), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"), nb::arg("dropout_p"),
        nb::arg("seed").none(), nb::arg("precision") = "exact");
  m.def("mha_step", &mha_step, nb::arg("config"), nb::arg("params"), nb::arg("x"), nb::arg("cache"), nb::arg("seqs"),
        nb::arg("y"), nb::arg("scale").none(), nb::arg("window_left"), nb::arg("window_right"), nb::arg("backend"),
        nb::arg("precision") = "exact");
  m.def("dropout_mask", [](double dropout_p, uint64_t seed, const Array& mask) {
    sdpa::dropout_mask(dropout_p, seed, to_view(mask, "mask"));
  }, nb::arg("dropout_p"), nb::arg("seed"), nb::arg("mask"));
  nb::class_<sdpa::Communicator, PyCommunicator>(m, "Communicator",
      "sdpa::Communicator (sdpa/ring.h) for Python: subclass it, call super().__init__(), and define "
      "rank(), size(), isend(buf, to, tag), irecv(buf, from_, tag), iallgather(inbuf, outbuf) (each "
      "returning an int request; bufs are uint8 NumPy arrays valid until the request completes) and "
      "wait(request, seconds) -> bool.")
      .def(nb::init<>())
      .def("rank", &sdpa::Communicator::rank)
      .def("size", &sdpa::Communicator::size);
  m.def("ring_chunks", [](const std::string& layout, int world, int rank, int64_t n_local) {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> chunks;
    const sdpa::RingLayout l = sdpa::front::parse_name("layout", kRingLayoutNames, layout);
    for (const sdpa::RingChunk& c : sdpa::ring_chunks(l, world, rank, n_local))
      chunks.emplace_back(c.local, c.start, c.length);
    return chunks;
  }, nb::arg("layout"), nb::arg("world"), nb::arg("rank"), nb::arg("n_local"));
  m.def("ring_attention", &ring_attention, nb::arg("comm"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("scale").none(), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("backend"), nb::arg("dropout_p"), nb::arg("seed").none(),
        nb::arg("softcap"), nb::arg("softcap_order"), nb::arg("alibi_slopes").none(), nb::arg("sinks").none(),
        nb::arg("block_mask").none(), nb::arg("block_q"), nb::arg("block_k"), nb::arg("precision"),
        nb::arg("layout"), nb::arg("strategy"), nb::arg("cu_seqlens").none(), nb::arg("timeout"));
  m.def("ring_attention_backward", &ring_attention_backward, nb::arg("comm"), nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("scale").none(), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("backend"), nb::arg("dropout_p"), nb::arg("seed").none(), nb::arg("softcap"),
        nb::arg("softcap_order"), nb::arg("alibi_slopes").none(), nb::arg("sinks").none(),
        nb::arg("block_mask").none(), nb::arg("block_q"), nb::arg("block_k"), nb::arg("dsinks").none(),
        nb::arg("dalibi_slopes").none(), nb::arg("precision"), nb::arg("layout"), nb::arg("strategy"),
        nb::arg("cu_seqlens").none(), nb::arg("timeout"));
  m.def("merge_attention", &merge_attention, nb::arg("outs"), nb::arg("lses"), nb::arg("out"), nb::arg("lse"));
  m.def("quantize_kv", [](const ConstArray& x, const Array& values, const Array& scale, const std::optional<Array>& zero) {
    const sdpa::TensorView xv = to_view(x, "x"), vv = to_view(values, "values"), sv = to_view(scale, "scale");
    const std::optional<sdpa::TensorView> zv = zero ? std::optional(to_view(*zero, "zero")) : std::nullopt;
    nb::gil_scoped_release release;
    sdpa::quantize_kv(xv, vv, sv, zv);
  }, nb::arg("x"), nb::arg("values"), nb::arg("scale"), nb::arg("zero").none());
  m.def("set_num_threads", &sdpa::set_num_threads, nb::arg("n"));
  m.def("num_threads", &sdpa::num_threads);
  // For benchmarks (bench/compare.py --no-avx512): dispatch to AVX2 at most, as on a CPU
  // without AVX-512, or (False) to the best target again. Results are the same either way.
  m.def("_limit_simd_to_avx2", [](bool on) {
#if HWY_ARCH_X86
    hwy::DisableTargets(on ? HWY_AVX2 - 1 : 0);  // HWY_AVX2 - 1: every x86 target above AVX2
#else
    (void)on;
#endif
  }, nb::arg("on"));
  // For benchmarks (bench/compare.py --bf16): whether the AVX512_BF16 and AMX paths can run
  // here, and turning both off (True) or on again (False): sdpa::set_max_kernel_path.
  m.def("_kernel_path_available_bf16", [] { return sdpa::kernel_path_available(sdpa::KernelPath::kAvx512Bf16); });
  m.def("_kernel_path_available_amx", [] { return sdpa::kernel_path_available(sdpa::KernelPath::kAmxBf16); });
  m.def("_limit_kernel_path_to_simd", [](bool on) {
    sdpa::set_max_kernel_path(on ? sdpa::KernelPath::kSimd : sdpa::KernelPath::kAmxBf16);
  }, nb::arg("on"));
  // ... and to AVX512_BF16 (True: no AMX tiles) or back to the best (False).
  m.def("_limit_kernel_path_to_avx512_bf16", [](bool on) {
    sdpa::set_max_kernel_path(on ? sdpa::KernelPath::kAvx512Bf16 : sdpa::KernelPath::kAmxBf16);
  }, nb::arg("on"));
}
