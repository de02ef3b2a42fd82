// The validated, normalised description of one attention call, shared by every kernel.
// make_problem() (problem.cc) checks every argument of an attention() call; the calls that cut
// their tensors into such problems (varlen.cc, paged.cc, kv_cache.cc) check only their own
// layouts, with the shared checks of checks.h, and hand each problem to make_problem; the layer
// (layer/mha.cc) checks its weights and inputs (reporting through checks.h too) and calls
// attention(). Kernels trust a Problem.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "checks.h"
#include "dropout.h"
#include "storage.h"
#include "sdpa/attention.h"

namespace sdpa::internal {

// A tensor view normalised to 4 dims (B, H, N, D). Dims that broadcast have stride 0.
struct View4 {
  char* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t shape[4] = {1, 1, 1, 1};
  int64_t strides[4] = {0, 0, 0, 0};  // in elements

  // A paged K/V pool (attention_paged): row n of batch b lies in page table(b, n / page_rows)
  // of the pool, at row n % page_rows; strides[0] is unused (0) and page_stride steps pages.
  // Rows are evenly spaced only within a page: kernels that stride across rows keep their
  // runs inside one (run_end).
  const void* page_table = nullptr;  // (B, max_pages) int32 or int64, validated for the rows read
  bool page_table_64 = false;
  int64_t page_table_stride = 0;  // elements between the table's batch rows
  int64_t page_rows = 0, page_stride = 0;

  // 8-bit K/V read in place (int8 or uint8 dtype; kv_dequant.h's fused calls): element
  // (b, h, n, d) is fl32(fl32(x - z) · s) (KVQuant's rule), s and z the float32 scale and zero
  // point (z = 0 without zero points) of group d / width of row (b, h, n). scale and zero are
  // laid out as the rows are (same page as the row, in a paged pool) with their own strides
  // (in floats; [3] steps groups) and page_stride.
  struct Quant {
    const float* scale = nullptr;
    const float* zero = nullptr;
    int64_t strides[4] = {0, 0, 0, 0}, zero_strides[4] = {0, 0, 0, 0};
    int64_t page_stride = 0, zero_page_stride = 0;
    int64_t width = 0;  // features per scale
  } quant;

  bool paged() const { return page_table != nullptr; }
  bool quantized() const { return quant.scale != nullptr; }
  int64_t page_of(int64_t b, int64_t n) const {
    const int64_t at = b * page_table_stride + n / page_rows;
    // memcpy: the table may lie at any address, as seqlens_k and cu_seqlens may (F13).
    const char* entry = static_cast<const char*>(page_table) + at * (page_table_64 ? 8 : 4);
    if (page_table_64) {
      int64_t page;
      std::memcpy(&page, entry, sizeof page);
      return page;
    }
    int32_t page;
    std::memcpy(&page, entry, sizeof page);
    return page;
  }
  // One past the last row of the evenly spaced run that holds row n.
  int64_t run_end(int64_t n) const {
    return paged() ? (n / page_rows + 1) * page_rows : std::numeric_limits<int64_t>::max();
  }
  int64_t offset(int64_t b, int64_t h, int64_t n, int64_t d) const {
    if (paged()) return page_of(b, n) * page_stride + n % page_rows * strides[2] + h * strides[1] + d * strides[3];
    return b * strides[0] + h * strides[1] + n * strides[2] + d * strides[3];
  }
  template <typename T>
  T* at(int64_t b, int64_t h, int64_t n, int64_t d = 0) const {
    return reinterpret_cast<T*>(data) + offset(b, h, n, d);
  }
  const void* ptr(int64_t b, int64_t h, int64_t n, int64_t d) const {
    return data + offset(b, h, n, d) * storage_bytes(dtype);
  }
  // The scale (zero point: `zero`) of group g of row (b, h, n) of an 8-bit view; 0 for a zero
  // point not given.
  float quant_at(bool zero, int64_t b, int64_t h, int64_t n, int64_t g) const {
    const float* row = quant_row(zero, b, h, n);
    return row == nullptr ? 0.0f : row[g * (zero ? quant.zero_strides : quant.strides)[3]];
  }
  // Group 0's scale (zero point) of row (b, h, n): null for zero points not given.
  const float* quant_row(bool zero, int64_t b, int64_t h, int64_t n) const {
    const float* base = zero ? quant.zero : quant.scale;
    if (base == nullptr) return nullptr;
    const int64_t* st = zero ? quant.zero_strides : quant.strides;
    const int64_t ps = zero ? quant.zero_page_stride : quant.page_stride;
    if (paged()) return base + page_of(b, n) * ps + n % page_rows * st[2] + h * st[1];
    return base + b * st[0] + h * st[1] + n * st[2];
  }
  // Reads one element of a floating-point view as T (slow path: branches on the storage dtype).
  template <typename T>
  T load(int64_t b, int64_t h, int64_t n, int64_t d) const {
    if (quantized()) {  // an 8-bit view: dequantised by KVQuant's rule
      const void* at = ptr(b, h, n, d);
      const float x = dtype == DType::kInt8 ? static_cast<float>(*static_cast<const int8_t*>(at))
                                            : static_cast<float>(*static_cast<const uint8_t*>(at));
      const int64_t g = d / quant.width;
      return static_cast<T>(dequantised(x, quant_at(true, b, h, n, g), quant_at(false, b, h, n, g)));
    }
    return load_as<T>(dtype, ptr(b, h, n, d));
  }
  // Writes one element, rounded once to the view's storage dtype.
  template <typename T>
  void store(int64_t b, int64_t h, int64_t n, int64_t d, T value) const {
    store_as(dtype, const_cast<void*>(ptr(b, h, n, d)), value);
  }
};

// Row (b, h, n) of v = x[0, width), rounded once to v's dtype (a plain copy when v holds T).
template <typename T>
void write_row(const View4& v, int64_t b, int64_t h, int64_t n, const T* x, int64_t width) {
  if (v.dtype == dtype_of<T>()) {
    T* dst = v.at<T>(b, h, n);
    for (int64_t c = 0; c < width; ++c) dst[c] = x[c];
    return;
  }
  if (width == 0) return;
  // 16-bit storage (the last dim has stride 1, as for every tensor): one dtype test per row.
  char* dst = static_cast<char*>(const_cast<void*>(v.ptr(b, h, n, 0)));
  if (v.dtype == DType::kBFloat16 || v.dtype == DType::kFloat16) {
    uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
    if (v.dtype == DType::kBFloat16) {
      for (int64_t c = 0; c < width; ++c) d16[c] = f32_to_bf16(static_cast<float>(x[c]));
    } else {
      for (int64_t c = 0; c < width; ++c) d16[c] = f32_to_f16(static_cast<float>(x[c]));
    }
    return;
  }
  for (int64_t c = 0; c < width; ++c) v.store(b, h, n, c, x[c]);
}

// x rounded to float32 (to nearest even), ±inf past its range as IEEE arithmetic gives, without
// the undefined behaviour of converting a double float cannot hold.
inline float round_to_float(double x) {
  constexpr double kOverflow = 0x1.ffffffp127;  // the midpoint past FLT_MAX: rounds to inf
  const float big = std::abs(x) >= kOverflow ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::max();
  if (std::abs(x) > std::numeric_limits<float>::max()) return x > 0 ? big : -big;
  return static_cast<float>(x);  // NaN stays NaN
}

// The score rules every kernel shares (scalar; the SIMD kernels follow the same two rules):
//   with_bias: a bias of -inf blocks the key, whatever its dot product (+inf, NaN) was, so a
//              blocked key never reaches the row; any other bias is added.
//   shifted_exp: the softmax numerator exp(s - m) against the row's max m, where s == m gives 1.
//              For finite scores that is exp(0); for a max of +inf (a score overflowed) it
//              splits the row's weight equally among its +inf keys (the limit of softmax as
//              those scores grow together) instead of exp(inf - inf) = NaN.
template <typename T>
T with_bias(T score, T bias) {
  return bias == -std::numeric_limits<T>::infinity() ? bias : score + bias;
}
template <typename T>
T shifted_exp(T s, T m) {
  return s == m ? T(1) : std::exp(s - m);
}
// The backward's rule for ds (flash/grad_rules-inl.h's DroppedDp and Ds are its SIMD form):
// ds = p · (z·dp - D) with z the dropout factor (1 without dropout), exactly 0 where p is, and
// a dropped key's dp (z · NaN) counting as 0: a key of weight 0 passes no NaN from its v row.
template <typename T>
T grad_ds(T p, T z, T dp, T D_row) {
  return p == 0 ? T(0) : p * ((z == 0 ? T(0) : z * dp) - D_row);
}

// Half-open range of key indices [begin, end) a query row may see.
struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool empty() const { return end <= begin; }
};

struct Problem {
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 0, Nk = 0, Dk = 0, Dv = 0;
  int64_t group = 1;  // Hq / Hkv: query heads per kv head
  DType dtype = DType::kFloat32;    // q's storage dtype (out's, dq's)
  DType compute = DType::kFloat32;  // what every kernel accumulates in: compute_dtype(dtype)
  double scale = 1.0;
  Causal causal = Causal::kNone;
  Window window;
  Dropout dropout;
  // Options::q_start / k_start (positioned: both were given): query row i lies at position
  // q_start + i, key j at k_start + j; 0 and 0 otherwise (then they change nothing).
  bool positioned = false;
  int64_t q_start = 0, k_start = 0;
  // Options::precision kFast with 16-bit q (k, v: the same type): the weights p are rounded to
  // `dtype` before the products that use them (the header's rule). False: exact.
  bool round_p = false;
  // Options::batch_invariant: the fused forward plans each row's arithmetic from the row alone
  // (flash_plan.h's make_plan: fixed key chunks, the block kernel, kSimd products).
  bool batch_invariant = false;

  // Score modifiers (Options::softcap, alibi_slopes, sinks), validated: the tanh cap (0: none)
  // and where it goes, and the slopes ((1 or B) × Hq, row-major; empty: none) and sinks (Hq;
  // empty: none) as doubles, read once.
  double softcap = 0.0;
  bool cap_after_bias = false;  // SoftcapOrder::kAfterBias
  std::vector<double> alibi_slopes;
  std::vector<double> sinks;

  View4 q, k, v, out;
  std::optional<View4> mask;     // broadcast to (B, Hq, Nq, Nk)
  // Options::block_mask (bool), broadcast to (B, Hq, ceil(Nq / block_q), ceil(Nk / block_k)).
  std::optional<View4> block_mask;
  int64_t block_q = 1, block_k = 1;
  std::optional<View4> weights;  // (B, Hq, Nq, Nk)
  std::optional<View4> lse;      // (B, Hq, Nq, 1)
  std::optional<View4> scores;   // (B, Hq, Nq, Nk): Outputs::scores at scores_stage
  ScoresStage scores_stage = ScoresStage::kFinal;
  // Outputs::stats: (B, Hq, Nq, 1) each, the top-k ones (B, Hq, Nq, topk); topk = 0 without them.
  // pooled_weights (B, Hq, Nq, G) is written by the weights pass, the others by the first.
  struct StatViews {
    std::optional<View4> allowed, entropy, entropy_normalized, max_weight, argmax, topk_weights, topk_indices;
    std::optional<View4> pooled_weights;
    int64_t topk = 0;
    bool in_pass() const {
      return allowed || entropy || entropy_normalized || max_weight || argmax || topk_weights || topk_indices;
    }
    bool any() const { return in_pass() || pooled_weights; }
    // Writes row (b, h, i)'s first-pass statistics to the views asked for; top(r) gives the
    // r-th top entry as {key, weight}.
    template <typename T, typename TopK>
    void store_row(int64_t b, int64_t h, int64_t i, int64_t n_allowed, T H, T H_normalized, T w_max, int64_t key_max,
                   const TopK& top) const {
      if (allowed) *allowed->at<int64_t>(b, h, i) = n_allowed;
      if (entropy) entropy->store(b, h, i, 0, H);
      if (entropy_normalized) entropy_normalized->store(b, h, i, 0, H_normalized);
      if (max_weight) max_weight->store(b, h, i, 0, w_max);
      if (argmax) *argmax->at<int64_t>(b, h, i) = key_max;
      for (int64_t r = 0; r < topk; ++r) {
        const auto [j, w] = top(r);
        if (topk_weights) topk_weights->store(b, h, i, r, w);
        if (topk_indices) *topk_indices->at<int64_t>(b, h, i, r) = j;
      }
    }
  } stats;

  // Per batch b, the keys that exist: 0 .. seqlens_k[b] - 1 (Inputs::seqlens_k, validated to lie
  // in [0, Nk]); empty when not given, and then every batch has Nk keys.
  std::vector<int64_t> seqlens_k;
  int64_t keys_of(int64_t b) const { return seqlens_k.empty() ? Nk : seqlens_k[static_cast<size_t>(b)]; }

  // The keys that causal, window and the sequence's length allow for query row i of batch b
  // (the mask may block more): the one place every kernel and reference takes them from.
  // With positions, both causal kinds and the window compare positions: key j is at or before
  // row i when k_start + j <= q_start + i, i.e. j <= aligned_row(b, i).
  KeyRange key_range(int64_t b, int64_t i) const {
    const int64_t L = keys_of(b);
    const int64_t aligned = aligned_row(b, i);
    int64_t begin = 0;
    int64_t end = L;
    if (causal == Causal::kBottomRight || (causal == Causal::kTopLeft && positioned)) end = std::min(end, aligned + 1);
    if (causal == Causal::kTopLeft && !positioned) end = std::min(end, i + 1);
    // The window's sums in 128 bits: aligned lies anywhere in int64_t with positions, and the
    // bounds may be anything >= 0. begin stays in [0, L].
    __extension__ using Wide = __int128;
    if (window.right >= 0) end = static_cast<int64_t>(std::min<Wide>(end, Wide{aligned} + window.right + 1));
    if (window.left >= 0) begin = static_cast<int64_t>(std::clamp<Wide>(Wide{aligned} - window.left, begin, L));
    return {begin, std::max(begin, end)};
  }

  // True when every output has a zero extent, so there is nothing to compute. Checked by dims,
  // not products: an empty view's other dims may be huge (e.g. q of shape (2^62, 0)), and the
  // kernels would otherwise loop over all of its rows.
  bool writes_nothing() const {
    const bool no_rows = B == 0 || Hq == 0 || Nq == 0;
    return (no_rows || Dv == 0) && ((!weights && !scores) || no_rows || Nk == 0) && ((!lse && !stats.any()) || no_rows);
  }

  // Dk == 0: every score is its bias alone; with Dv == 0 too out is empty, so lse needs no pass
  // over the keys (see attention.cc): Nk may be huge (k and v of shape (2^40, 0) hold no
  // element) and work must follow the elements.
  bool scores_are_biases_only() const { return Dk == 0 && Dv == 0; }
  // Whether the biases of a row are one value for all of its keys: no mask row in memory (a mask
  // broadcast along the keys), no ALiBi distances, no block mask. With scores_are_biases_only,
  // a row's lse and statistics then follow from its key range alone, in closed form.
  bool biases_constant_along_keys() const { return !(mask && mask->strides[3] != 0) && !has_alibi() && !block_mask; }

  // The block mask's block row of query row i and block column of key j, by position
  // (q_start + i, k_start + j; i and j themselves without positions).
  int64_t block_row(int64_t i) const { return (q_start + i) / block_q; }
  int64_t block_col(int64_t j) const { return (k_start + j) / block_k; }
  // One past the last key of key j's block column, at most limit (> j), without overflow.
  int64_t block_col_end(int64_t j, int64_t limit) const {
    const int64_t first = block_col(j) * block_k - k_start;  // the column's first key (may be < 0)
    return first + std::min(block_k, limit - first);
  }
  // Whether the block mask lets row i of (b, h) see key j (true without one).
  bool block_allows(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return !block_mask || *block_mask->at<uint8_t>(b, h, block_row(i), block_col(j)) != 0;
  }
  // Whether block row qb (block_row of its rows) of (b, h)'s block mask allows some key of [j0, j1)
  // (j0 < j1; a block mask is given): one of its blocks that overlap them is set. The one rule
  // for "does this block of rows see any key of this tile" (flash_plan.h's BlockRowsSeeKeys asks
  // it for the kernels' lanes and rows).
  bool block_allows_any(int64_t b, int64_t h, int64_t qb, int64_t j0, int64_t j1) const {
    const uint8_t* row = block_mask->at<uint8_t>(b, h, qb, 0);
    for (int64_t kb = block_col(j0); kb <= block_col(j1 - 1); ++kb) {
      if (row[kb * block_mask->strides[3]] != 0) return true;
    }
    return false;
  }

  // The mask's additive bias at (b, h, i, j): a float mask's value, or 0 / -inf for bool; -inf
  // where the block mask blocks (a blocked block is a bool mask's 0 over the block).
  template <typename T>
  T mask_bias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!block_allows(b, h, i, j)) return -std::numeric_limits<T>::infinity();
    if (!mask) return T(0);
    if (mask->dtype == DType::kBool) {
      return *mask->at<uint8_t>(b, h, i, j) ? T(0) : -std::numeric_limits<T>::infinity();
    }
    return mask->load<T>(b, h, i, j);
  }

  bool has_alibi() const { return !alibi_slopes.empty(); }
  bool has_sinks() const { return !sinks.empty(); }
  // ALiBi's slope for (b, h) as T (the slopes broadcast over the batch when given per head).
  template <typename T>
  T alibi_slope(int64_t b, int64_t h) const {
    const size_t row = alibi_slopes.size() == static_cast<size_t>(Hq) ? 0 : static_cast<size_t>(b);
    return static_cast<T>(alibi_slopes[row * static_cast<size_t>(Hq) + static_cast<size_t>(h)]);
  }
  // Query row i aligned bottom-right to batch b's keys: i' = i + (L - Nq), ALiBi's (and causal's) i'.
  // With positions, row i's position in key indices: i' = i + (q_start - k_start) (key j is at
  // row i's position when j == i'; no overflow: both starts lie in [0, 2^63)).
  int64_t aligned_row(int64_t b, int64_t i) const {
    return positioned ? i + (q_start - k_start) : i + (keys_of(b) - Nq);
  }
  // ALiBi's distance |i' - j| of query i of batch b and key j.
  int64_t alibi_distance(int64_t b, int64_t i, int64_t j) const {
    const int64_t distance = aligned_row(b, i) - j;
    return distance < 0 ? -distance : distance;
  }
  // -slope · |i' - j|: the distance is an integer, exact in T (below 2^24 for float32).
  template <typename T>
  T alibi_bias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return -alibi_slope<T>(b, h) * static_cast<T>(alibi_distance(b, i, j));
  }
  template <typename T>
  T sink(int64_t h) const {
    return static_cast<T>(sinks[static_cast<size_t>(h)]);
  }

  // x at the ends of the compute type's range, for a T wider than it (the float64 reference
  // of a float32 problem): ±inf past float32's largest value and ±0 below its smallest, as in
  // the kernels that compute in float32; the precision stays T's. Identity otherwise.
  template <typename T>
  T in_compute_range(T x) const {
    if (compute != DType::kFloat32 || sizeof(T) <= sizeof(float) || std::isnan(x)) return x;
    const float r = round_to_float(static_cast<double>(x));
    return std::isinf(r) || r == 0 ? static_cast<T>(r) : x;
  }

  // The score of (b, h, i, j) from its scaled dot product x, in T: the header's formula, the
  // softcap, ALiBi and the mask in their order (Options::softcap_order). A blocked key (bias
  // -inf) is -inf in either order; so is, under kAfterBias, an argument x + alibi + bias that
  // is -inf in the compute type (a sum past its range: the kernels cannot tell it from a
  // blocked key). The scalar statement of what MaskScores (score_tile-inl.h) does to a tile;
  // the references use it. (Causal, window and length are the caller's.)
  template <typename T>
  T score(T x, int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!cap_after_bias) x = capped(x);
    if (has_alibi()) x += alibi_bias<T>(b, h, i, j);
    x = with_bias(x, mask_bias<T>(b, h, i, j));
    if (softcap != 0 && cap_after_bias) {
      x = in_compute_range(x);
      if (x != -std::numeric_limits<T>::infinity()) x = capped(x);
    }
    return x;
  }
  // cap · tanh(x / cap) with cap = softcap; x itself without a softcap.
  template <typename T>
  T capped(T x) const {
    const T cap = static_cast<T>(softcap);
    return softcap == 0 ? x : cap * std::tanh(x / cap);
  }
  // ∂score/∂x for softcap: 1 - tanh² of the capped argument (1 without a cap), from the same x.
  template <typename T>
  T score_slope(T x, int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (softcap == 0) return T(1);
    const T cap = static_cast<T>(softcap);
    if (cap_after_bias) {
      if (has_alibi()) x += alibi_bias<T>(b, h, i, j);
      x = in_compute_range(with_bias(x, mask_bias<T>(b, h, i, j)));
    }
    const T t = std::tanh(x / cap);
    return T(1) - t * t;
  }
};

// Stats::topk_weights' largest k (make_problem refuses more).
inline constexpr int64_t kMaxTopK = 32;

// Stats::pooled_weights' run of key j of Nk among G: floor(j · G / Nk) (j < Nk).
inline int64_t pooled_run(int64_t j, int64_t G, int64_t Nk) {
  __extension__ using Wide = __int128;  // j · G may pass int64_t (GCC and Clang have it)
  return static_cast<int64_t>(static_cast<Wide>(j) * G / Nk);
}
// The first key of run g by the same rule: ceil(g · Nk / G) (g <= G; run g is keys
// pooled_run_first(g) .. pooled_run_first(g + 1) - 1).
inline int64_t pooled_run_first(int64_t g, int64_t G, int64_t Nk) {
  __extension__ using Wide = __int128;  // g · Nk may pass int64_t
  return static_cast<int64_t>((static_cast<Wide>(g) * Nk + G - 1) / G);
}

// Checks dropout_p (in [0, 1)) and builds the keep/drop rule.
Dropout make_dropout(double p, uint64_t seed);

// ceil(n / block) for n >= 0, block >= 1, without the overflow of n + block - 1: every count of
// blocks, tiles and chunks (the kernels' plans too).
inline int64_t ceil_blocks(int64_t n, int64_t block) { return n / block + (n % block != 0); }
// Options::block_mask checked (bool, rank 2 .. max_rank, block_q and block_k >= 1) against
// (B, Hq, ceil(Nq / block_q), ceil(Nk / block_k)) and broadcast to it; Error naming block_mask
// otherwise (showing the target at max_rank dims), with `lengths` before Nq and Nk in its
// arithmetic ("" or "the longest sequence's ").
View4 checked_block_mask(const TensorView& m, const Options& opt, int max_rank, int64_t B, int64_t Hq, int64_t Nq,
                         int64_t Nk, const char* lengths);

// Validates every argument and builds the Problem. Throws sdpa::Error naming the argument.
Problem make_problem(const Inputs& inputs, const Outputs& outputs, const Options& options);

// The backward pass: the forward Problem (with out and lse, both required) plus the
// incoming gradient and the three gradient outputs, all in q's dtype.
struct BackwardProblem {
  Problem fwd;
  View4 dout;        // (B, Hq, Nq, Dv)
  View4 dq, dk, dv;  // shaped like q, k, v
  std::optional<View4> dsinks;  // (Hq,) in the last slot: (1, 1, 1, Hq)
  // The float mask's gradient, the mask's own shape padded to rank 4 (a size 1 where the mask
  // broadcasts), unlike fwd.mask, which is broadcast to (B, Hq, Nq, Nk).
  std::optional<View4> dbias;
  // Gradients::dalibi_slopes, the slopes' shape in the last two slots: (1, 1, 1, Hq) for (Hq,)
  // (summed over the batch), (1, 1, S, Hq) for (S, Hq) with S = 1 (summed too) or B.
  std::optional<View4> dalibi;
  // True when dq, dk and dv all have a zero extent (see Problem::writes_nothing).
  bool writes_nothing() const {
    const Problem& p = fwd;
    const bool no_q = p.B == 0 || p.Hq == 0 || p.Nq == 0, no_kv = p.B == 0 || p.Hkv == 0 || p.Nk == 0;
    return (no_q || p.Dk == 0) && (no_kv || p.Dk == 0) && (no_kv || p.Dv == 0);
  }
};

// Gradients::dalibi_slopes checked against Options::alibi_slopes (given, its shape, float32 or
// float64, no zero stride); Error naming dalibi_slopes otherwise. attention_varlen_backward
// checks the packed call's with it.
void check_alibi_gradient(const TensorView& dalibi_slopes, const Options& options);

BackwardProblem make_backward_problem(const Inputs& inputs, const TensorView& out, const TensorView& lse,
                                      const TensorView& dout, const Gradients& grads, const Options& options);

// Hand a validated problem to the backend (attention.cc): what attention() and
// attention_backward() do after make_problem, and what attention_varlen does per sequence.
void run_forward(const Problem& p, Backend backend);
void run_backward(const BackwardProblem& bp, Backend backend);
// run_forward of each problem, the fused kernel's ones in one parallel region
// (flash_attention_many): attention_varlen's sequences.
void run_forward_many(const std::vector<Problem>& problems, Backend backend);

}  // namespace sdpa::internal
