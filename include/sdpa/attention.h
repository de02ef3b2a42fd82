// sdpa: exact scaled dot-product attention on the CPU.
//
//   out = softmax(q kᵀ · scale + bias) v          (softmax over keys, row by row)
//
// Shapes (rank 2, 3 or 4; the same rank for every tensor of one call):
//   q       (B, Hq,  Nq, Dk)      rank 3 drops B, rank 2 drops B and H (a single head)
//   k       (B, Hkv, Nk, Dk)      Hq % Hkv == 0; query head h reads kv head h / (Hq / Hkv)
//   v       (B, Hkv, Nk, Dv)
//   mask    broadcasts to (B, Hq, Nq, Nk) by NumPy rules (rank <= rank of q)
//   out     (B, Hq,  Nq, Dv)
//   weights (B, Hq,  Nq, Nk)      optional: softmax probabilities, for inspection
//   lse     (B, Hq,  Nq)          optional: log-sum-exp of each row's biased, scaled scores
//   stats   (B, Hq,  Nq[, k])     optional: entropy, max weight, argmax, top-k of each row (Stats)
//   scores  (B, Hq,  Nq, Nk)      optional: the raw scores, for inspection (Outputs::scores)
//
// Edges (docs/RELIABILITY.md lists every promise and the test that holds it):
//   - Key j is allowed for row i when causal and the window let i see j and the mask does not
//     block it (bool false, or a bias of -inf). A blocked key never influences the row: not its
//     score (even an overflowing or NaN q·k), not its value row (even NaN or inf).
//   - Scores s = Σ_d (q_d · scale) · k_d + bias are computed in the compute type (float32 for
//     float32, float64 for float64; the float64 kReference rounds q_d · scale, each product and
//     the score to the ends of the inputs' range, so it overflows to ±inf and underflows to 0
//     where they do, but not in partial sums).
//     A score of +inf on an allowed key takes the row's weight: the weight is split equally
//     among the row's +inf keys, 0 elsewhere, and lse = +inf. A score of -inf weighs 0.
//   - A row with no allowed key, or none whose score is above -inf (everything masked, Nk == 0),
//     gives out = 0, weights = 0 and lse = -inf: never NaN.
//   - out_i = Σ_j w_ij · v_j over the keys whose weight (after dropout) is not 0: a blocked,
//     dropped or underflowed key adds nothing even if its value row holds NaN or inf; a NaN or
//     inf in the value row of a key with weight > 0 reaches out as IEEE arithmetic says.
//   - A NaN score on an allowed key (a NaN in q or k, or inf - inf) makes the row's out, lse
//     and weights NaN (weights stay 0 at the keys the row blocks). Whether overflowing
//     products of both signs give NaN or ±inf depends on the kernel's fused multiply-adds.
//   - A float mask holds finite biases or -inf; NaN or +inf there is an Error. The scale must
//     be finite and held by the compute type (float32: |scale| <= FLT_MAX, and not a non-zero
//     that rounds to 0), else Error.
//   - Work follows the elements that exist: empty views may have null data and any strides, and
//     dims whose tensors hold no element (k of shape (2^40, 0)) are never walked.
// See docs/ARCHITECTURE.md for the layers behind this header.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>

namespace sdpa {

// Every invalid argument is reported by throwing Error before anything is written.
// The message names the argument and the shapes involved.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class DType : uint8_t {
  kBool,      // 1 byte per element, 0 = blocked, anything else = attend (masks only)
  kFloat32,
  kFloat64,
  kBFloat16,  // the upper half of a float32 (8 exponent bits, 7 mantissa bits)
  kFloat16,   // IEEE binary16 (5 exponent bits, 10 mantissa bits; largest 65504)
  kInt32,     // index tensors only (Inputs::seqlens_k)
  kInt64,
  kInt8,      // an 8-bit K/V cache (KVQuant below): symmetric, values in [-127, 127], a scale
  kUInt8,     // an 8-bit K/V cache: asymmetric, values in [0, 255], a scale and a zero point
};
const char* dtype_name(DType dtype);
int64_t dtype_size(DType dtype);

// A non-owning view of a strided tensor. Strides count elements (not bytes) and may be zero
// or negative. Preconditions the caller promises:
//   - q, k, v and out have stride 1 in their last dim (the kernels load rows with SIMD);
//     mask, weights and lse may have any strides.
//   - Every view that is written (out, weights, lse; dq, dk, dv) maps distinct indices to
//     distinct elements: threads write different indices at once, so a view that overlaps
//     itself is a data race. Stride 0 on a dim of extent > 1 of such a view is an Error;
//     other self-overlapping strides are not detected.
//   - out, weights and lse (dq, dk and dv) do not overlap each other or any input.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t strides[4] = {0, 0, 0, 0};

  // A C-order (row-major, contiguous) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape);
  int64_t numel() const;
  std::string shape_string() const;  // "(2, 3, 4)"
};

enum class Causal : uint8_t {
  kNone,
  kBottomRight,  // query i sees keys j <= i + (Nk - Nq): the last query sees every key
                 // (FlashAttention's convention; what a KV cache needs)
  kTopLeft,      // query i sees keys j <= i (PyTorch's is_causal)
};                // (with positions, Options::q_start and k_start, both: key position <= query position)

// Sliding-window (local) attention: query i sees keys j with
//   i' - left <= j <= i' + right,   i' = i + (Nk - Nq)   (aligned bottom-right, as causal)
// A negative bound is unbounded. The default {-1, -1} is no window. With positions
// (Options::q_start, k_start), i' = i + q_start - k_start.
struct Window {
  int64_t left = -1;
  int64_t right = -1;
};

enum class Backend : uint8_t {
  kAuto,       // the fastest exact kernel for the inputs' dtype (today: kFlash)
  kFlash,      // fused tiled kernel: online softmax, SIMD (runtime dispatch), threads;
               // extra memory O(threads × tile), independent of Nq and Nk
  kReference,  // the textbook algorithm in float64, one query row at a time (all of the
               // row's scores, then softmax, then the weighted sum): simple, slow, the oracle
  kNaive,      // the same algorithm in the inputs' own precision: the yardstick for
               // tolerances ("error of a naive implementation")
};

// How 16-bit inputs (bfloat16, float16 q, k and v) are computed. float32 and float64 inputs,
// and float32 q over a 16-bit KV cache, ignore it: they are always computed as kExact.
enum class Precision : uint8_t {
  kExact,  // 16-bit inputs widened exactly, everything in float32, results rounded once (on
           // AMX, bfloat16's p·V takes each weight as three bfloat16 parts that sum to it
           // exactly: the same products, summed in float32 in another order)
  kFast,   // the weights rounded to the inputs' type before the products that use them, as
           // every peer does (FlashAttention, PyTorch's CPU flash attention, OpenVINO), so
           // that those products run on 16-bit instructions (AVX512_BF16's vdpbf16ps, AMX
           // tiles where the CPU has them); each row stays stochastic (below)
};
// kFast, in the forward: each unnormalised weight p = exp(s - m) (m the row's running max, as
// the online softmax has it) is rounded to nearest even in the inputs' type, p~, and
//   out = Σ_j p~_j · z_j · v_j / l,   l = Σ_j p~_j (float32; + exp(sink - m) with a sink, unrounded)
// with z_j the dropout factor (0 or 1 / (1 - dropout_p), in float32 after the rounding; 1
// without dropout). The normaliser is the sum of the same rounded weights, so values all 1
// give 1 and the error has no sign (FlashAttention's numerator and denominator differ: a
// row of ones gives less than 1). Products accumulate in float32. lse = m + log(l), the
// normaliser used. The weights and Outputs::stats are exact mode's (an exact pass computes
// them: asking for them costs a second pass). In attention_backward, with p = exp(s - lse)
// from the lse the forward gave, p is rounded before dv's product (dv += z·p~ · dout) and
// ds = p·(z·dp - D) (times the softcap's slope) before dq's and dk's, all accumulating in
// float32; dbias, dalibi_slopes and dsinks are exact mode's. Accuracy (tested): the error
// against float64 is at most twice that of the naive algorithm that rounds the same values
// (Backend::kNaive with kFast), plus the tolerance floor. kReference ignores it (the float64
// oracle).

struct Options {
  std::optional<double> scale;  // default 1 / sqrt(Dk); finite and held by the compute type
  Causal causal = Causal::kNone;
  Window window;
  Backend backend = Backend::kAuto;
  Precision precision = Precision::kExact;  // for 16-bit inputs (above)
  // Batch invariance: each query row's out and lse then depend only on the row (its query, its
  // own keys and values, its mask row, its sequence's length) and these options, bit for bit —
  // not on B, Nq, the other sequences of an attention_varlen or attention_paged batch (or a
  // KVCache's), chunked prefill versus token-by-token decode, the page size or the thread count.
  // Without it (the default) results are already independent of the thread count, but the fused
  // kernels pick the key split and the kernel from the problem's shape, so a row's last bits may
  // change with the batch. With it the fused forward (kAuto, kFlash) always cuts a row's keys at
  // multiples of 4096 from key 0 and merges the pieces in key order, computes decode steps with
  // the prefill kernel's order of sums, and uses the portable SIMD products (KernelPath::kSimd).
  // Cost (docs/PERFORMANCE.md): decode transposes its keys (the prefill kernel's order), 16-bit
  // prefill on an AVX512_BF16 CPU loses the bfloat16 instruction. kReference computes one row at a time and is
  // invariant anyway; kNaive is not covered. The backward ignores it. Tests: batch_invariance_test.cc.
  bool batch_invariant = false;
  // Dropout on the attention weights, after the softmax: each weight is dropped with
  // probability dropout_p and kept ones are scaled by 1 / (1 - dropout_p). The decision for
  // weight (b, h, i, j) is a pure function of (seed, b, h, i, j) (Philox4x32-10), the same in
  // forward and backward, for any tiling and thread count. 0 (the default) is exactly no
  // dropout. The weights output shows the softmax before dropout; lse is unaffected.
  // dropout_p > 0 needs a seed (else Error): pass a new one each training step, the same one
  // to attention_backward. There is no default, so that forgetting it cannot drop the same
  // weights every step. Without dropout the seed is ignored.
  double dropout_p = 0.0;  // in [0, 1)
  std::optional<uint64_t> seed;

  // Score modifiers (Gemma's logit softcapping, BLOOM's ALiBi, gpt-oss's attention sinks). With
  // x = q·kᵀ · scale the scaled dot product of query i and key j of query head h, the score is
  //
  //   s = cap·tanh(x / cap) + alibi + bias        SoftcapOrder::kBeforeBias (the default)
  //   s = cap·tanh((x + alibi + bias) / cap)      SoftcapOrder::kAfterBias
  //
  // with cap = softcap (no tanh when 0), alibi = -slope(b, h)·|i' - j| (0 without slopes),
  // i' = i + (L - Nq) the query aligned bottom-right to the sequence's L keys (Nk, or
  // seqlens_k[b]) whatever `causal` is (FlashAttention's definition; with positions, i' = i +
  // q_start - k_start), and bias the mask's.
  // A key that causal, the window, the sequence's length, a bool mask or a bias of -inf blocks
  // stays blocked in either order: its weight is exactly 0 (never cap·tanh(-inf) = -cap).
  // Under kAfterBias so does any key whose argument x + alibi + bias is -inf in the compute
  // type, blocked or not (a product or a sum past float32's range in a float32 kernel): the
  // kernels see only the value. kBeforeBias caps such an x to -cap.
  // With sinks, each row's softmax has one more term in its denominator, a logit with no value:
  //   w_ij = exp(s_ij - m) / (exp(sink_h - m) + Σ_j' exp(s_ij' - m)),   out_i = Σ_j w_ij v_j
  // so the weights of a row sum to less than 1, lse includes the sink (lse = log(exp(sink_h) +
  // Σ_j exp(s_ij))), and a row whose keys are all blocked gives out = 0, weights 0 and lse = sink_h.
  // softcap: finite, >= 0, and held by the compute type. kBeforeBias is FlashAttention's, Gemma's
  // and ONNX Attention's (opset 23 reference) order.
  double softcap = 0.0;
  enum class SoftcapOrder : uint8_t { kBeforeBias, kAfterBias };
  SoftcapOrder softcap_order = SoftcapOrder::kBeforeBias;
  // ALiBi slopes: (Hq,) or (B, Hq) (rank 1 or 2; (1, Hq) broadcasts over the batch), float32
  // or float64, finite, any strides.
  std::optional<TensorView> alibi_slopes = std::nullopt;
  // Attention sinks: (Hq,), float32 or float64, finite (a learned logit per query head), any stride.
  std::optional<TensorView> sinks = std::nullopt;

  // Block-sparse attention (BigBird's, Longformer's and FlexAttention's block masks): a bool
  // block_mask of shape (..., ceil(Nq / block_q), ceil(Nk / block_k)) whose leading dims
  // broadcast to the scores' (B, Hq) as a mask's do. Query row i and key j lie in block
  // (i / block_q, j / block_k), counted as stored (causal's alignment does not move blocks);
  // where that block is false (0) the key is blocked for the row on top of every other mask:
  // its weight is exactly 0, as under a bool mask, and a row left with no key gives out = 0,
  // lse = -inf (or the sink). block_q, block_k >= 1.
  //   Nq = 4, Nk = 6, block_q = 2, block_k = 3, block_mask = {{1, 0}, {1, 1}}, no causal
  //   (x: attended, .: blocked):   x x x . . .
  //                                x x x . . .
  //                                x x x x x x
  //                                x x x x x x
  //   (tests/block_mask_test.cc checks this picture)
  // The fused kernels skip whole tiles: in the forward (decode and weights included), a tile
  // of 128 keys that the block mask blocks for every row of a kernel block of rows is neither
  // scored nor read (its keys and values are not touched); the backward skips the score tiles such tiles and rows would make (it still reads every key
  // and value once, checking for non-finite values). A block_k that is a multiple of 128
  // therefore skips exactly the false blocks; smaller blocks are also masked key by key inside
  // tiles they share with allowed ones.
  // Results equal those of the same call with the equivalent bool mask, bit for bit, a zero's
  // sign included: the fused kernels write every zero of out, dq, dk and dv as +0 (a sum left at
  // -0 by an underflowed product would otherwise keep it where the element mask's call adds the
  // skipped tiles' +0 terms). Tests: block_mask_test.cc.
  // Packed sequences (attention_varlen, attention_paged with cu_seqlens_q): the block_mask is
  // (..., ceil(max_b Nq_b / block_q), ceil(max_b Nk_b / block_k)), its leading dims broadcasting
  // to (sequences, Hq), and sequence b reads the top-left (ceil(Nq_b / block_q),
  // ceil(Nk_b / block_k)) blocks of its row, in its own positions (Nk_b of a paged sequence is
  // max_pages · page_size): each sequence is the call on its own rows with that corner.
  std::optional<TensorView> block_mask = std::nullopt;
  int64_t block_q = 128, block_k = 128;

  // Absolute positions (a shard of a longer sequence, as context-parallel attention cuts it):
  // query row i is at position q_start + i and key j at k_start + j. Unset (the default), the
  // call is the usual one. Set, both are given (one alone is an Error), each >= 0, with
  // q_start + Nq and k_start + Nk held by int64_t; then, with P_i = q_start + i and K_j = k_start + j:
  //   - causal (kBottomRight and kTopLeft alike) lets row i see key j when K_j <= P_i;
  //   - the window when P_i - left <= K_j <= P_i + right;
  //   - ALiBi's distance is |P_i - K_j| (its i' - j above with i' = i + q_start - k_start; the
  //     kernels compute it in the compute type, exact while i' and j lie below 2^24 in float32);
  //   - the block mask is read at block ((q_start + i) / block_q, (k_start + j) / block_k): its
  //     last two dims must be at least ceil((q_start + Nq) / block_q) and ceil((k_start + Nk) /
  //     block_k) (the whole sequence's block mask works unchanged for every shard; its leading
  //     dims as above; blocks past those are not read);
  //   - dropout draws weight (b, h, i, j) as the element (b, h, P_i, K_j) of the whole call
  //     (positions modulo 2^32, as i and j are);
  //   - Inputs::seqlens_k still counts this call's keys: key j exists when j < seqlens_k[b].
  // So the call on rows [q0, q0 + n) and keys [k0, k0 + m) of a sequence with q_start = q0 and
  // k_start = k0 computes exactly that pair's part of the whole call with q_start = k_start = 0
  // (the plain call when Nq = Nk: a plain call with Nq != Nk aligns causal, the window and ALiBi
  // bottom-right but indexes the block mask and dropout by row, which no positions reproduce
  // together; the scale is the same),
  // dropout included, and its out and lse merge by log-sum-exp with the other key shards'
  //   lse = log Σ_s exp(lse_s),   out = Σ_s exp(lse_s - lse) · out_s
  // into the whole call's out and lse. A shard whose rows see none of its keys gives out = 0,
  // lse = -inf, which the merge ignores. Sinks are part of every call they are passed to (its
  // lse counts exp(sink)): pass them to exactly one key shard of each row, so that the merge
  // counts them once. Each query shard and key shard in their own positions, e.g. a sequence
  // of 6 cut into chunks of 2, causal; the query shard at q_start = 2 and the key shards at
  // k_start = 0, 2, 4 (x: attended, .: blocked; K_j on top):
  //        k_start = 0     k_start = 2     k_start = 4
  //          0 1             2 3             4 5
  //   P = 2  x x             x .             . .      (out = 0, lse = -inf: nothing to see)
  //   P = 3  x x             x x             . .
  //   (tests/positions_test.cc checks this picture)
  // attention() and attention_backward() (given the whole row's out and lse: the merged ones,
  // the backward of one pair gives that pair's part of dq and its key shard's part of dk and
  // dv, and dalibi_slopes' part, to be summed over the shards; a float mask is the pair's own
  // (Nq, Nk) slice, and dbias that slice's; dsinks needs only out, lse and dout, so pass the
  // sinks to one key shard's backward of each row there too; with positions every backend takes
  // the probabilities from the given lse, where kReference and kNaive otherwise recompute each
  // row's softmax) take positions; attention_varlen, attention_paged,
  // KVCache and the MultiHeadAttention layer refuse them (Error naming q_start).
  std::optional<int64_t> q_start = std::nullopt, k_start = std::nullopt;
};

// An 8-bit K/V cache (OpenVINO's u8 KV cache, llama.cpp's q8_0): k and v hold int8 or uint8
// values (both the same dtype) and beside them float32 scales (and, for uint8, zero points).
// Element d of key row (b, h, n) is
//   k(b, h, n, d) = fl32(fl32(x - z) · s),   x the stored value, s = k_scale(b, h, n, g),
//                                            z = k_zero(b, h, n, g) (0 for int8), g = d / (Dk / G)
// one float32 rounding when z is an integer (as quantize_kv writes it), and likewise v with
// v_scale, v_zero and Dv. Each scale view has k's (v's) shape without its last dim: one scale
// per (token, kv head), OpenVINO's default; or that shape with a last dim G that divides Dk (Dv):
// per-group scales, G groups of Dk / G features. Any strides. For attention_paged the views are
// pools like k_pages: (num_pages, page_size, Hkv[, G]), read through the same block table.
// The call computes in float32 on those values, bit for bit the call on float32 K/V holding them (q: float32, bfloat16
// or float16; Options::precision does not apply); kReference takes them as the cache. attention(), attention_varlen and
// attention_paged read the 8-bit values in place, dequantising them in the kernels' registers (a quarter of float32's
// bytes), when each scale group is one row, a multiple of 16 features, or 1, 2, 4 or 8 (16-bit q and out via copies);
// otherwise the rows read are dequantised into float32 scratch per call. Forward only (attention, attention_paged, attention_varlen, KVCache); the backward refuses 8-bit K/V.
// Errors: scales missing or given for other dtypes, a zero point for int8 or none for uint8, wrong shapes or dtypes, a
// non-finite scale or zero point of a row read (past seqlens_k, or in a page no sequence uses, not read).
struct KVQuant {
  TensorView k_scale = {}, v_scale = {};                         // float32
  std::optional<TensorView> k_zero = std::nullopt, v_zero = std::nullopt;  // float32, uint8 only
};

// Dtypes. q, k, v share one dtype: float32, float64, bfloat16 or float16; or q is float32 and
// k, v share bfloat16 or float16 (a 16-bit KV cache read by float32 queries). The compute type
// is float64 for float64 q and float32 otherwise: scores, softmax sums, outputs and gradients
// accumulate in it; 16-bit inputs are widened exactly and results are rounded once (to
// nearest even) to their output's dtype. The kReference backend computes in float64 whatever
// the dtype (and then rounds to the output's dtype).
struct Inputs {
  TensorView q = {}, k = {}, v = {};
  // kBool (0 blocks), or a float mask added to the scores: float32 or q's dtype.
  std::optional<TensorView> mask = std::nullopt;
  // Per-sequence key lengths (ONNX Attention's nonpad_kv_seqlen): shape (B,) (rank 1; (1,) when
  // q has rank 2 or 3), kInt32 or kInt64, any stride, each 0 <= seqlens_k[b] <= Nk. Sequence b
  // has keys 0 .. seqlens_k[b] - 1 and the keys past them are never read (their K/V memory may
  // be uninitialised; their dk, dv are 0). Causal and window align to the sequence's own
  // length L = seqlens_k[b]: bottom-right, query i sees keys j <= i + (L - Nq); top-left,
  // j <= i (and j < L). Rows left with no key give out = 0, lse = -inf, as any fully masked row.
  //
  //   Nq = 2, Nk = 6, seqlens_k = {5, 2}, causal bottom-right (x: attended, .: not, -: past L)
  //     b = 0:  x x x x . -      b = 1:  x . - - - -
  //             x x x x x -              x x - - - -
  //   (tests/seqlens_test.cc checks this picture)
  std::optional<TensorView> seqlens_k = std::nullopt;
  // 8-bit k and v: their scales (and zero points), as KVQuant says.
  std::optional<KVQuant> kv_quant = std::nullopt;
};

// Per-row statistics of the attention weights w_ij (the softmax before dropout, after every
// mask and score modifier; what Outputs::weights would hold), computed by the fused forward in its
// one pass over the keys: O(Nq · k) memory, no Nq × Nk weights. Every view is optional and has
// lse's shape ((B, Hq, Nq) for rank-4 q, (Hq, Nq), (Nq,)), top-k ones with a last dim k added;
// float views hold the compute type, index views int64; any strides (no zero stride on a dim > 1).
//   allowed             keys the row may attend: its scores above -inf (causal, window, the
//                       masks and seqlens_k leave them; a weight that underflows to 0 counts)
//   entropy             H_i = -Σ_j w_ij log w_ij in nats (0 log 0 = 0): log(allowed) when uniform,
//                       0 when one key takes all. With sinks the weights sum to less than 1 and
//                       H_i is of the keys' weights as they are (the sink's share is not a key's).
//   entropy_normalized  H_i / log(allowed) (0 when allowed <= 1): in [0, 1], 1 = uniform, except
//                       with sinks, whose weights summing to S < 1 allow up to S (log n - log S)
//   max_weight          max_j w_ij, bit for bit weights[argmax]
//   argmax              the key of the largest score, the lowest j among equal scores
//   topk_weights        (..., k): the weights of the row's k largest scores, largest score first,
//                       bit for bit the weights at topk_indices. k <= 32.
//   topk_indices        (..., k) int64: their keys; equal scores go to the lower key index. A row
//                       with fewer than k allowed keys fills the rest with index -1 and weight 0.
//                       Keys are ranked by score (in the compute type; kReference's float64), not
//                       by weight: scores that differ keep their order where their weights round
//                       to the same value or underflow to 0 (scores 0.3 and the next float32
//                       above it give equal float32 weights; argmax is the second key).
//   pooled_weights      (..., G): the row's weights summed over G runs of keys, key j in run
//                       floor(j · G / Nk), summed in key order (G = 0: nothing): the row at a picture's
//                       resolution without its Nk weights (sdpa inspect's heatmaps of long
//                       inputs). Costs a second pass over the keys, as weights does.
// A row with no allowed key: entropy 0, max_weight 0, argmax -1, top-k all -1 / 0. A row
// with a NaN score: entropy, max_weight and top-k weights NaN, argmax and top-k indices -1.
// A row whose scores overflowed to +inf splits its weight among them (as the weights do).
struct Stats {
  std::optional<TensorView> allowed = std::nullopt;
  std::optional<TensorView> entropy = std::nullopt;
  std::optional<TensorView> entropy_normalized = std::nullopt;
  std::optional<TensorView> max_weight = std::nullopt;
  std::optional<TensorView> argmax = std::nullopt;
  std::optional<TensorView> topk_weights = std::nullopt;
  std::optional<TensorView> topk_indices = std::nullopt;
  std::optional<TensorView> pooled_weights = std::nullopt;
};

// Which scores Outputs::scores holds (ONNX Attention's qk_matmul_output_mode), for query i and
// key j of head h, x = q_i·k_j · scale:
enum class ScoresStage : uint8_t {
  kScaled,      // x, for every key of the sequence (the masks not applied, blocked blocks read too)
  kBiased,      // x + ALiBi + the mask's bias, -inf where causal, the window or a mask blocks the key
  kFinal,       // what the softmax takes: kBiased with the softcap in its order (Options::softcap)
  kSoftcapped,  // cap·tanh(x / cap) (x without a softcap), for every key of the sequence as kScaled:
                // the capped scores before ALiBi and the mask, kBeforeBias's intermediate (ONNX's
                // qk_matmul_output_mode 1); under kAfterBias the softmax takes no such value
};
// ONNX Attention's qk_matmul_output_mode: 0 is kScaled, 1 kSoftcapped, 2 kFinal (kBeforeBias; no
// ALiBi in ONNX), 3 Outputs::weights (python/tests/test_onnx_attention.py maps all four).

struct Outputs {
  // q's dtype; for bfloat16 or float16 q also float32, the compute type: partials kept for
  // merge_attention (sdpa/merge.h), so that nothing is rounded to 16 bits before the last
  // merge. A float32 out holds the kernels' float32 results unrounded: rounded to q's dtype
  // they are, bit for bit, what the call with an out of q's dtype writes (either precision).
  // attention_varlen and attention_paged take the same two dtypes.
  TensorView out = {};
  std::optional<TensorView> weights = std::nullopt;  // the compute type (float32 for 16-bit q)
  std::optional<TensorView> lse = std::nullopt;      // the compute type (float32 for 16-bit q)
  Stats stats = {};                                  // per-row statistics of the weights (above)
  // The raw scores for inspection, (B, Hq, Nq, Nk) like weights, the compute type, any strides:
  // O(Nq · Nk) memory, computed by a plain loop in the compute type (float64 with kReference),
  // not by the fused kernel, so they may differ from its scores by rounding. Keys past a
  // sequence's length (seqlens_k) are -inf at every stage: they are never read.
  std::optional<TensorView> scores = std::nullopt;
  ScoresStage scores_stage = ScoresStage::kFinal;
};

// Computes attention in the compute type of q's dtype (see Dtypes above).
// Throws Error on invalid arguments, before writing anything.
void attention(const Inputs& inputs, const Outputs& outputs, const Options& options = {});

// Throws the Error attention() would throw for these inputs and options, and does nothing
// else: a caller can check a call before allocating its outputs (the CLI does). Reads only
// what attention() validates (a float mask's values); the outputs are checked by attention().
void validate(const Inputs& inputs, const Options& options = {});

// Gradients of attention() with respect to q, k and v.
// dq, dk and dv: each its input's dtype, or the compute type (float32 for 16-bit inputs:
// unrounded, for gradients that are summed further, as key shards' dq partials are; rounded to
// the input's dtype they are bit for bit the call's with gradients of that dtype).
struct Gradients {
  TensorView dq = {};  // shaped like q, q's dtype or the compute type
  TensorView dk = {};  // shaped like k, k's dtype or the compute type: for GQA, the sum over the
                       // query heads of its group
  TensorView dv = {};  // shaped like v, v's dtype or the compute type
  // With Options::sinks: ∂loss/∂sinks, (Hq,), float32 or float64 (not read; written), summed
  // over the batch and the query rows in a fixed order:
  //   dsinks_h = -Σ_b Σ_i exp(sink_h - lse_bhi) · (dout_bhi · out_bhi)
  // Not given: the sinks' gradient is not computed.
  std::optional<TensorView> dsinks = std::nullopt;
  // With a float mask (Inputs::mask, a learned bias such as T5's relative positions): ∂loss/∂mask,
  // shaped like the mask (its rank and shape; any strides without a zero), float32, float64 or
  // the mask's dtype (not read; written). An element sums, in a fixed order, over the scores
  // that read it (the mask's broadcast dims: size 1 or missing):
  //   dbias[m] = Σ_{(b, h, i, j) reading m} w_bhij · (z_bhij · dout_bhi · v_bj - dout_bhi · out_bhi) · c_bhij
  // with z the dropout factor and c = 1, or under SoftcapOrder::kAfterBias the cap's 1 - tanh² of
  // the argument (the bias is inside the cap). A blocked score (weight 0) adds 0. Computed by
  // its own pass over the rows, which recomputes each row's softmax (not from lse): it costs
  // about as much as the backward again. Not given: not computed.
  std::optional<TensorView> dbias = std::nullopt;
  // With Options::alibi_slopes: ∂loss/∂alibi_slopes, shaped like the slopes ((Hq,), (1, Hq) or
  // (B, Hq); any strides without a zero), float32 or float64 (not read; written). The score
  // reads alibi = -slope(b, h)·|i' - j| (Options' i', bottom-right), so with ds_bhij the
  // score's gradient of dbias' formula (c included: the slopes' term is inside the cap where the
  // bias is):
  //   dalibi_slopes[b, h] = -Σ_i Σ_j ds_bhij · |i' - j|
  // summed over the batch too for (Hq,) and (1, Hq) slopes; each row's sum over j (in key order)
  // is added in float64 in (b, i) order, whatever the thread count. Computed in dbias' pass
  // (the two share each row's ds; asking for both costs one pass). 0 when Dv = 0 (out holds no
  // element, so the loss reads no score). attention_varlen_backward: row b of (B, Hq) slopes
  // is sequence b's; (Hq,) and (1, Hq) sum the sequences in order. Not given: not computed.
  std::optional<TensorView> dalibi_slopes = std::nullopt;
};

// Backward pass: given dout = ∂loss/∂out (shaped like out; q's dtype or the compute type, as
// out may be, each independently) and the out and lse that attention() returned for these
// inputs and options, writes dq, dk and dv. The softmax is
// recomputed from lse, tile by tile. Rows with no allowed key (lse = -inf) contribute
// nothing; a key of weight 0 for a row (blocked, dropped) and that row exchange nothing: the
// key's value or key row (even NaN) does not reach the row's dq, and the row's q or dout (even
// NaN) does not reach the key's dk and dv. An lse of +inf (the forward's scores overflowed) has
// no gradient: Error.
// Deterministic: bitwise identical for any thread count. Throws Error on invalid arguments,
// before writing anything.
//
// A key shard (context parallelism, sdpa/merge.h): split the keys into shards, k, v and the
// mask's key columns sliced alike, each shard's forward giving partials that merge_attention
// combines into the whole rows' out and lse. Given that WHOLE out and lse, dout and q, and one
// shard's k, v (and mask slice), attention_backward is that shard's part of the one call's
// backward: its dk and dv are the one call's rows of the shard's keys, and its dq is the
// shard's term dq_s of dq = Σ_s dq_s (pass a float32 dq for 16-bit q to sum the terms before
// rounding). Each weight p_ij = exp(s_ij - lse_i) is the whole row's, and D_i = dout_i · out_i
// the whole row's, so nothing else couples the shards. With sinks, dsinks reads only out and
// lse: ask for it from one shard. Tested (merge_test.cc's KeyShards.*) for float32, float64,
// bfloat16 and float16, GQA and sliced masks. Causal, window, ALiBi, a block mask and dropout
// depend on positions: give each shard call its Options::q_start and k_start (above), and it is
// its pair's part of the whole call with them too (tests/positions_test.cc). kReference and
// kNaive take the weights from the given lse only when positions are set (otherwise they
// recompute each row's softmax over the call's own keys, which for a shard is not the whole
// row's): for a shard's backward on them, set q_start and k_start (e.g. 0 and the shard's first
// key).
void attention_backward(const Inputs& inputs, const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const Gradients& grads, const Options& options = {});

// Varlen: a batch of B sequences of different lengths packed end to end, token-major as in
// FlashAttention's flash_attn_varlen_func; no padding is stored or computed.
//   q    (total_q, Hq,  Dk)      sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1
//   k    (total_k, Hkv, Dk)      its keys rows cu_seqlens_k[b] .. cu_seqlens_k[b+1] - 1
//   v    (total_k, Hkv, Dv)
//   cu_seqlens_q, cu_seqlens_k   (B + 1,) int32 or int64: 0, then non-decreasing prefix sums
//                                ending at total_q (total_k)
//   out  (total_q, Hq, Dv)       lse (Hq, total_q), optional
//
//   cu_seqlens_q = {0, 2, 5}, cu_seqlens_k = {0, 3, 7}:   q rows  | 0 1 | 2 3 4 |
//                                                          k rows  | 0 1 2 | 3 4 5 6 |
//                                                                   seq 0   seq 1
// Each sequence is attention() of its own rows with the same options: causal and window align
// to the sequence's own Nq and Nk, dropout draws for (seed, b, h, i, j) with b the sequence
// and i, j the positions inside it. Nothing crosses a sequence's boundary. dtypes as attention().
// Per-sequence options: alibi_slopes (B, Hq) give sequence b row b; a block_mask is read per
// sequence as Options::block_mask says (a top-left corner of the longest sequence's blocks).
// Without dropout each sequence's results are bit for bit those of attention() on its rows (with
// dropout, sequence b draws as batch entry b of a dense call would); bitwise identical for any
// thread count. The forward runs every sequence's blocks (and key chunks) in one parallel region,
// largest first, so that threads stay busy when lengths differ 100x; the backward runs the
// sequences with at most a thread's share of the work side by side, a thread each, and the
// larger ones on all threads. No copies: see PERFORMANCE.md.
struct VarlenInputs {
  TensorView q = {}, k = {}, v = {};
  TensorView cu_seqlens_q = {}, cu_seqlens_k = {};
  // 8-bit k and v: scales (total_k, Hkv[, G]) (and zero points), as KVQuant says.
  std::optional<KVQuant> kv_quant = std::nullopt;
};
struct VarlenOutputs {
  TensorView out = {};
  std::optional<TensorView> lse = std::nullopt;
};
void attention_varlen(const VarlenInputs& inputs, const VarlenOutputs& outputs, const Options& options = {});
// Gradients of attention_varlen: dq, dk, dv shaped like the packed q, k, v; out, lse (Hq,
// total_q) and dout (total_q, Hq, Dv) as attention_varlen gave and takes them.
void attention_varlen_backward(const VarlenInputs& inputs, const TensorView& out, const TensorView& lse,
                               const TensorView& dout, const Gradients& grads, const Options& options = {});

// Paged KV cache: keys and values live in a pool of fixed-size pages, as in vLLM and
// FlashAttention's block_table; sequence b's key j is row j % page_size of page
// block_table[b][j / page_size].
//   q            (B, Hq, Nq, Dk)                   q's dtype: float32, float64, bfloat16 or float16
//   k_pages      (num_pages, page_size, Hkv, Dk)   q's dtype, or bfloat16/float16 under float32 q
//   v_pages      (num_pages, page_size, Hkv, Dv)   the same dtype and pages as k_pages
//   block_table  (B, max_pages) int32 or int64, unit last stride; entries of the pages a
//                sequence uses (j < ceil(seqlens_k[b] / page_size)) in [0, num_pages); the
//                rest are never read (-1 is fine)
//   seqlens_k    (B,) int32 or int64, 0 <= seqlens_k[b] <= max_pages · page_size
//   out          (B, Hq, Nq, Dv); lse (B, Hq, Nq), weights (B, Hq, Nq, max_pages · page_size)
//                and stats, optional, as attention()'s (Outputs::scores: Error)
//
//   page_size = 4, block_table[b] = {7, 2, 5}, seqlens_k[b] = 10:
//     keys 0-3 in page 7, keys 4-7 in page 2, keys 8-9 in rows 0-1 of page 5
//
// The same as attention() with q, the sequence's keys and values gathered in order, and
// Inputs::seqlens_k: causal and window align to each sequence's own length (a decode step's
// query sees the whole cache), no mask. page_size may be any size >= 1 (16 to 256 in
// practice); pages may be shared between sequences and appear in any order. Forward only.
// Any strides (unit last): a head-major pool, memory (num_pages, Hkv, page_size, D) passed as
// a view with strides (Hkv·page_size·D, D, page_size·D, 1), keeps one head's rows of a page
// contiguous and decodes about twice as fast as the token-major C order (KVCache stores so).
// Decode (few query rows per kv head) reads the pages in place (a 128-key tile through a row
// pointer per key); longer query blocks gather each tile's rows. The tiles are those of a
// dense call, so results are bit for bit those of attention() on the gathered keys capped at
// KernelPath::kSimd (a paged call does not use the AVX512_BF16/AMX products, which read a
// tile's keys in place with one stride).
//
// Packed queries (chunked prefill of several sequences, as attention_varlen packs them): with
// cu_seqlens_q (B + 1,) int32/int64 offsets, q is (total_q, Hq, Dk), sequence b's queries
// rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1, attending to the keys of block_table row b;
// out is (total_q, Hq, Dv), lse (Hq, total_q); no weights or stats. Each sequence is bit for bit the
// call with q = its rows as (1, Hq, n_b, Dk); all of them share one parallel region.
struct PagedInputs {
  TensorView q = {}, k_pages = {}, v_pages = {};
  TensorView block_table = {}, seqlens_k = {};
  std::optional<TensorView> cu_seqlens_q = std::nullopt;
  // 8-bit k_pages and v_pages: their scale (and zero point) pools, as KVQuant says.
  std::optional<KVQuant> kv_quant = std::nullopt;
};
void attention_paged(const PagedInputs& inputs, const Outputs& outputs, const Options& options = {});

// Writes the dropout factors attention() with this dropout_p and seed applies: mask[b, h, i, j]
// = 1 where weight (b, h, i, j) is kept, 0 where dropped. mask is bool, shaped like the weights
// ((Nq, Nk), (Hq, Nq, Nk) or (B, Hq, Nq, Nk)), any strides.
void dropout_mask(double dropout_p, uint64_t seed, const TensorView& mask);

// Threads used by the kernels: n > 0 fixes the count, 0 restores OpenMP's default
// (OMP_NUM_THREADS, else the number of cores). Results do not depend on it, bit for bit.
void set_num_threads(int n);
int num_threads();

// Instruction paths beyond Highway's SIMD targets, in order. Where the CPU has AVX512_BF16 (or
// AMX), bfloat16 calls compute the forward's scores q·kᵀ (prefill tiles) and the backward's q·kᵀ
// and dout·vᵀ with its dot-product instruction (exact products, float32 sums: the error bound
// of the widening path, not its bits), and in Precision::kFast also the products of the rounded
// weights (p·V; the backward's dv and dk, and dq where the path is kAvx512Bf16: on AMX CPUs
// vdpbf16ps is slower than widening), for blocks and tiles whose nonzero values (and the scale)
// lie in [2^-40, 2^32), where its reading subnormals as 0 cannot matter; everything else runs on
// the SIMD target Highway dispatches (16-bit inputs widened to float32). A call uses one path
// throughout, so its results stay bitwise the same for any thread count.
enum class KernelPath : uint8_t {
  kSimd,        // Highway's SIMD on the dispatched target
  kAvx512Bf16,  // bfloat16 products with vdpbf16ps (bfloat16 q, k, v; AVX-512 dispatched)
  kAmxBf16,     // bfloat16 products in AMX tiles (TDPBF16PS; as kAvx512Bf16, where the OS grants AMX)
};
// The best path the kernels may use, process-wide (default kAmxBf16: the best the CPU has).
// For tests and benchmarks, as hwy::DisableTargets caps the SIMD target.
void set_max_kernel_path(KernelPath max);
KernelPath max_kernel_path();
// Whether this CPU (and the SIMD targets not disabled) can run the path.
bool kernel_path_available(KernelPath path);
// The best path the calling thread's last attention() or attention_backward() call used (kSimd
// when it used no other).
// On kAvx512Bf16 and kAmxBf16, blocks and tiles outside the instruction's range are still
// computed by widening.
KernelPath last_kernel_path();

}  // namespace sdpa
