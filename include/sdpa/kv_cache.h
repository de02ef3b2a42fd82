// A paged KV cache that owns its pool and block tables: the layout attention_paged reads.
//
//   pool    k_pages (num_pages, page_size, Hkv, Dk), v_pages (num_pages, page_size, Hkv, Dv)
//           as attention_paged takes them, in the cache's dtype (float32, float64, bfloat16,
//           float16, or the 8-bit int8 or uint8), stored head-major within a page: memory
//           (num_pages, Hkv, page_size, D), so that one head's rows of a page are contiguous
//           (decode streams them; the token-major layout strides Hkv·D between them, which
//           measured ~2x slower: PERFORMANCE.md). k_pages() and v_pages() are views with those
//           strides.
//   8-bit   beside the int8 or uint8 pool, float32 scale pools (and zero-point pools for uint8)
//           for k and v: (num_pages, page_size, Hkv) with one scale per (token, kv head), or
//           (num_pages, page_size, Hkv, G) with G = quant_groups groups of D / G features;
//           stored head-major too, memory (num_pages, Hkv, page_size[, G]); kv_quant() returns
//           views of them as attention_paged's PagedInputs::kv_quant takes them (KVQuant).
//           append() quantises each (token, head[, group]) by quantize_kv's rule (below).
//   seq s   a list of pages (its block-table row) and a length L: key j of s is row
//           j % page_size of page pages[j / page_size], for j < L
//
//   page_size 4; sequence 0 holds 6 tokens in pages {3, 0}, sequence 1 holds 3 in page {1}:
//     page 0: s0 keys 4 5 . .    page 1: s1 keys 0 1 2 .    page 2: free    page 3: s0 keys 0 1 2 3
//
// append() writes new tokens in place, taking free pages as a sequence grows (lowest index
// first); free() gives a sequence's pages back. An engine that fills the pool itself can call
// attention_paged on k_pages(), v_pages() and block tables of its own instead.
// Not thread-safe: one thread changes a cache at a time (attention() only reads it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa {

// Quantises x (any rank <= 4, last dim D, unit last stride; float32, float64, bfloat16 or
// float16, finite) into an 8-bit K/V cache's values and scales (KVQuant): values shaped like x,
// int8 or uint8; scale (float32) x's shape without its last dim, or with a last dim G dividing
// D (groups of D / G features); zero (float32) given exactly when values are uint8. Per group
// of features u (its elements widened to float64):
//   int8:  s = fl32(max|u| / 127), x_q = clamp(rne(u / s), -127, 127)      (s = 0: x_q = 0)
//   uint8: lo = min(min u, 0), hi = max(max u, 0), s = fl32((hi - lo) / 255),
//          z = clamp(rne(-lo / s), 0, 255), x_q = clamp(rne(u / s) + z, 0, 255)   (s = 0: z = 0, x_q = 0)
// (rne: round to nearest even; the range includes 0 so that a zero is stored exactly). The
// quotients are float64's, the scale that quotient rounded once to float32 (for float32,
// bfloat16 and float16 x the rounding of the exact quotient). z is an integer, so the
// dequantised fl32(fl32(x_q - z) · s) is one float32 rounding of (x_q - z) · s; it is within
// s · (1/2 + 2^-15) of u for a normal s (tests/quantize_test.cc derives the bound).
// Any strides but unit last ones (values, x); scale and zero any strides. Throws Error (writing
// nothing) for shapes or dtypes that do not fit, a non-finite x, or a scale beyond float32's
// largest value (float64 x only).
void quantize_kv(const TensorView& x, const TensorView& values, const TensorView& scale,
                 const std::optional<TensorView>& zero = std::nullopt);

class KVCache {
 public:
  // Throws Error for a size < 1 (page_size, Hkv), < 0 (num_pages, Dk, Dv) or a dtype that is
  // not float32, float64, bfloat16, float16, int8 or uint8, or a quant_groups < 1, not dividing
  // Dk and Dv, or other than 1 for a float cache. An 8-bit cache (int8, uint8) keeps
  // beside its pool float32 scale pools (and zero points for uint8), (num_pages, page_size, Hkv)
  // with quant_groups == 1 (one scale per token and kv head), else (..., quant_groups), which
  // must divide Dk and Dv; append() quantises what it is given with quantize_kv's rule.
  KVCache(int64_t num_pages, int64_t page_size, int64_t num_kv_heads, int64_t head_dim_k, int64_t head_dim_v,
          DType dtype = DType::kFloat32, int64_t quant_groups = 1);

  // A new, empty sequence: its id (the lowest id not in use).
  int64_t new_sequence();
  // Appends n tokens to sequence `seq`: k (n, Hkv, Dk) and v (n, Hkv, Dv) in the cache's dtype,
  // any strides with a unit last one (an 8-bit cache takes float32, bfloat16 or float16 and
  // quantises them, writing each token's values, scales and zero points in its page slots).
  // Throws Error (writing nothing) for an unknown sequence, mismatched shapes or dtype, a
  // non-finite value given to an 8-bit cache, or when the pool has too few free pages.
  void append(int64_t seq, const TensorView& k, const TensorView& v);
  // Gives the sequence's pages back; its id may be reused. Throws Error for an unknown sequence.
  void free(int64_t seq);

  // Attention of q (len(seqs), Hq, Nq, Dk), row b against sequence seqs[b] (a sequence may
  // appear more than once): attention_paged on the pool with these sequences' block tables
  // and lengths (and, for an 8-bit cache, kv_quant()). Causal bottom-right lets query i see keys j <= i + L - Nq: a step that
  // appended Nq tokens and attends with their queries sees the cache up to itself.
  void attention(const TensorView& q, const std::vector<int64_t>& seqs, const Outputs& outputs,
                 const Options& options = {}) const;

  int64_t length(int64_t seq) const;
  const std::vector<int32_t>& pages(int64_t seq) const;  // its block-table row
  std::vector<int64_t> sequences() const;                // the ids in use, ascending
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_pages() const { return num_pages_; }
  int64_t page_size() const { return page_size_; }
  int64_t num_kv_heads() const { return heads_; }
  int64_t head_dim_k() const { return dk_; }
  int64_t head_dim_v() const { return dv_; }
  DType dtype() const { return dtype_; }
  TensorView k_pages() const;  // the pool, (num_pages, page_size, Hkv, Dk), head-major strides
  TensorView v_pages() const;
  // An 8-bit cache's scale (and zero-point) pools, as attention_paged's PagedInputs::kv_quant
  // takes them; std::nullopt for a float cache.
  std::optional<KVQuant> kv_quant() const;
  int64_t quant_groups() const { return groups_; }

 private:
  struct Sequence {
    bool live = false;
    int64_t length = 0;
    std::vector<int32_t> pages;
  };
  const Sequence& sequence(int64_t seq) const;  // throws for an unknown id

  int64_t num_pages_, page_size_, heads_, dk_, dv_;
  DType dtype_;
  int64_t groups_ = 1;
  std::vector<std::byte> k_, v_;
  std::vector<float> k_scale_, v_scale_, k_zero_, v_zero_;  // an 8-bit cache's (zero points: uint8)
  std::vector<int32_t> free_;  // free pages, highest first (taken from the back)
  std::vector<Sequence> seqs_;
};

}  // namespace sdpa
