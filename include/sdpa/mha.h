// The multi-head attention layer: projections, heads, output projection, and its gradients.
//
//   q = x_q W_Q + b_Q     k = x_k W_K + b_K     v = x_v W_V + b_V       (then RoPE on q and k)
//   head_h = attention(q_h, k_{h / G}, v_{h / G})                         G = Hq / Hkv (GQA)
//   y = Concat(head_0, …, head_{Hq-1}) W_O + b_O
//
// Shapes (E = d_model; Dk, Dv the head dims):
//   x_q   (B, Nq, E)         x_k (B, Nk, kdim) (absent: x_q, self-attention), x_v (B, Nk, vdim) (absent: x_k)
//   W_Q   (E, Hq·Dk)         b_Q (Hq·Dk)        column h·Dk + d of q is head h's element d
//   W_K   (kdim, Hkv·Dk)     b_K (Hkv·Dk)
//   W_V   (vdim, Hkv·Dv)     b_V (Hkv·Dv)
//   W_O   (Hq·Dv, E)         b_O (E)
//   y     (B, Nq, E)         weights (B, Hq, Nq, Nk) and stats as attention()'s Outputs
// Weights act on the right (x W): a torch.nn.Linear's weight is W's transpose. Every option of
// attention() applies per head (mask broadcasting to (B, Hq, Nq, Nk), seqlens_k, causal,
// window, dropout, scale, softcap, ALiBi, sinks, block mask); Options::backend kReference runs
// the float64 reference layer (plain loops for every product, kReference attention), kNaive
// the same in the inputs' precision (the tolerance yardstick), kAuto/kFlash the fast layer:
// the projections are GEMMs of a real BLAS (OpenBLAS, loaded at first use: src/layer/blas.cc)
// in per-head tiles that write q, k, v head-major, (B, H, N, D), the layout the kernel reads
// fastest (no transposing copies; docs/PERFORMANCE.md).
//
// RoPE (MultiHeadConfig::rope): the rotate-half form of GPT-NeoX and Llama on q and k, per
// head, pairing element d with d + Dk/2 (Dk even): for position p,
//   θ_d = p · base^(-2d / Dk),   (x_d, x_{d+Dk/2}) ← (x_d cos θ_d - x_{d+Dk/2} sin θ_d,
//                                                    x_{d+Dk/2} cos θ_d + x_d sin θ_d)
// Query row i has position position_q + i, key row j position_k + j.
//
// Dtypes: x, every weight and bias, y, dy and the gradients share one dtype, the layer's:
// float32, float64, bfloat16 or float16. A float32 or float64 layer computes in it (the
// reference layer in float64). A bfloat16 or float16 layer computes in float32, as the kernel
// computes 16-bit attention: inputs and weights are widened exactly, the products are float32
// GEMMs (sgemm: Debian 12's OpenBLAS 0.3.21 has no bfloat16 GEMM, see layer/blas.h), and it
// rounds once to its dtype where it stores a value, as PyTorch's 16-bit layer does:
//   forward   q, k and v after the projection, the bias and RoPE (the kernel's inputs); the
//             heads' output (the kernel's, rounded once there); y.
//   backward  the heads' gradient dy W_Oᵀ (the kernel's dout); dq, dk, dv (the kernel's); then
//             the inverse RoPE and the products in float32 again, and each gradient of x, a
//             weight or a bias is rounded once from its float32 sum (dx_q's parts from q, k and
//             v of a shared input are summed in float32 first).
// Options::precision reaches the kernel as given (kExact by default; kFast rounds the weights
// as attention.h says); it changes nothing for a float32 or float64 layer. weights and stats
// are the kernel's, in the compute type (float32 for a 16-bit layer). kReference computes a
// 16-bit layer in float64 too, rounding only y and the gradients (the tests' oracle); kNaive in
// float32 with the fast layer's roundings (its yardstick).
// Deterministic: bitwise the same results for any thread count (the kernel's promise; the
// BLAS products split their output, not their sums, across threads; tests/mha_test.cc checks).
// Throws Error, naming the argument and its shape, before writing anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "sdpa/attention.h"
#include "sdpa/kv_cache.h"

namespace sdpa {

struct MultiHeadConfig {
  int64_t d_model = 0;       // E, > 0
  int64_t num_heads = 0;     // Hq, > 0
  int64_t num_kv_heads = 0;  // Hkv (0: Hq); Hq % Hkv == 0 (1: multi-query)
  int64_t head_dim = 0;      // Dk (0: E / Hq, which must divide)
  int64_t head_dim_v = 0;    // Dv (0: Dk)
  int64_t kdim = 0;          // width of x_k (0: E)
  int64_t vdim = 0;          // width of x_v (0: kdim)
  bool bias = true;          // b_Q, b_K, b_V, b_O present
  bool rope = false;         // rotary position embedding on q and k (Dk even)
  double rope_base = 10000.0;

  // The same config with every 0 replaced by its default (and checked): Error names the field.
  MultiHeadConfig resolved() const;
};

// The layer's parameters, as views (all of the layer's dtype; any strides with a unit last one). Biases are given exactly when config.bias.
struct MultiHeadWeights {
  TensorView w_q = {}, w_k = {}, w_v = {}, w_o = {};
  std::optional<TensorView> b_q = std::nullopt, b_k = std::nullopt, b_v = std::nullopt, b_o = std::nullopt;
};

struct MultiHeadInputs {
  TensorView x_q = {};                           // (B, Nq, E)
  std::optional<TensorView> x_k = std::nullopt;  // (B, Nk, kdim); absent: x_q
  std::optional<TensorView> x_v = std::nullopt;  // (B, Nk, vdim); absent: x_k (or x_q)
  std::optional<TensorView> mask = std::nullopt;       // as Inputs::mask
  std::optional<TensorView> seqlens_k = std::nullopt;  // as Inputs::seqlens_k
  int64_t position_q = 0, position_k = 0;              // RoPE's first positions
};

struct MultiHeadOutputs {
  TensorView y = {};                                 // (B, Nq, E)
  std::optional<TensorView> weights = std::nullopt;  // (B, Hq, Nq, Nk), as Outputs::weights
  Stats stats = {};                                  // as Outputs::stats
};

// What the backward reads, written by the forward: q and k after RoPE, v and the heads'
// concatenated outputs in `dtype` (the layer's; float64 for the reference layer), the
// log-sum-exps in its compute type (float32 for a 16-bit layer). O(B · N · Hq · D) memory.
struct MultiHeadSaved {
  DType dtype = DType::kFloat32;
  int64_t batch = 0, nq = 0, nk = 0;
  // q, k, v head-major (B, H, N, D); heads (B·Nq rows of Hq·Dv, at a padded row stride); lse (B, Hq, Nq)
  std::vector<std::byte> q, k, v, heads, lse;
};

// Gradients: dx_q always; dx_k, dx_v when the forward had x_k, x_v (absent: their parts are
// added into dx_q, or dx_k, as the inputs were shared). The weights' and biases' gradients
// are written (not accumulated) where given; biases' exactly when config.bias.
struct MultiHeadGradients {
  TensorView dx_q = {};
  std::optional<TensorView> dx_k = std::nullopt, dx_v = std::nullopt;
  std::optional<TensorView> dw_q = std::nullopt, dw_k = std::nullopt, dw_v = std::nullopt, dw_o = std::nullopt;
  std::optional<TensorView> db_q = std::nullopt, db_k = std::nullopt, db_v = std::nullopt, db_o = std::nullopt;
};

// The forward: y (and weights, stats). With `saved`, also what multi_head_attention_backward
// needs (dropout: pass the same Options, seed included, to both).
void multi_head_attention(const MultiHeadConfig& config, const MultiHeadWeights& weights,
                          const MultiHeadInputs& inputs, const MultiHeadOutputs& outputs,
                          const Options& options = {}, MultiHeadSaved* saved = nullptr);

// The backward of one forward: dy = ∂loss/∂y (B, Nq, E); inputs, weights and options as the
// forward's, `saved` what it wrote.
void multi_head_attention_backward(const MultiHeadConfig& config, const MultiHeadWeights& weights,
                                   const MultiHeadInputs& inputs, const MultiHeadSaved& saved, const TensorView& dy,
                                   const MultiHeadGradients& grads, const Options& options = {});

// Incremental decoding: x (B, n, E) are the next n tokens of sequences seqs[b] of `cache`
// (Hkv, Dk, Dv and dtype as the layer's: a 16-bit layer appends its rounded k and v). Projects them, applies RoPE at positions
// cache.length(seqs[b]) + i, appends their k and v to the cache, and attends with causal
// bottom-right (token i sees the cache up to itself), writing y (B, n, E). Equal to the
// forward on the whole sequence with causal, row for row (tests/mha_test.cc). Self-attention
// only (kdim = vdim = E); options.causal is ignored (always bottom-right), no dropout; the
// products are the fast layer's whatever options.backend says.
void multi_head_attention_step(const MultiHeadConfig& config, const MultiHeadWeights& weights, const TensorView& x,
                               KVCache& cache, const std::vector<int64_t>& seqs, const TensorView& y,
                               const Options& options = {});

// A layer that owns its parameters (float32, float64, bfloat16 or float16), initialised as
// torch.nn.MultiheadAttention does: W_Q, W_K, W_V Xavier-uniform (as one (3E × E) matrix when
// all three are E × E, as torch's in_proj_weight), W_O uniform ±1/sqrt(Hq·Dv), biases 0; from a
// seeded generator (give each layer of a model its own seed).
class MultiHeadAttention {
 public:
  explicit MultiHeadAttention(const MultiHeadConfig& config, DType dtype = DType::kFloat32, uint64_t seed = 0);

  const MultiHeadConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }
  MultiHeadWeights weights();  // views of the owned parameters (writable)

  void forward(const MultiHeadInputs& inputs, const MultiHeadOutputs& outputs, const Options& options = {},
               MultiHeadSaved* saved = nullptr);
  void backward(const MultiHeadInputs& inputs, const MultiHeadSaved& saved, const TensorView& dy,
                const MultiHeadGradients& grads, const Options& options = {});
  void step(const TensorView& x, KVCache& cache, const std::vector<int64_t>& seqs, const TensorView& y,
            const Options& options = {});
  // A cache for this layer's k and v: num_pages pages of page_size tokens.
  KVCache make_cache(int64_t num_pages, int64_t page_size) const;

 private:
  MultiHeadConfig config_;
  DType dtype_;
  std::vector<std::byte> params_[8];  // w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o
};

}  // namespace sdpa
