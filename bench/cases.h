// One table of benchmark cases drives `sdpa bench` and the Google Benchmark program
// (bench_attention), so both measure the same shapes with the same flop formula.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa::bench {

enum class MaskKind {
  kNone,
  kBool,        // (Nq, Nk), 1 in 8 entries blocked at random, broadcast over batch and heads
  kAdditive,    // (Nq, Nk) biases, 1 in 8 -inf at random
  kKeyPadding,  // (B, 1, 1, Nk) bool: the last Nk / 8 keys blocked (padded), the common case
};

struct BenchCase {
  std::string name;  // ends in the dtype's tag (" bf16") unless the dtype is float32
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, D = 64;
  MaskKind mask = MaskKind::kNone;
  Causal causal = Causal::kNone;
  DType dtype = DType::kFloat32;  // of q, k, v, out (and dout, the gradients, an additive mask);
                                 // lse has the compute type: float64 for float64, else float32
  bool backward = false;  // time attention_backward (given out and lse) instead of attention
  Window window = {};     // sliding window (left, right); -1 = unbounded
  // > 0: attention_paged on a pool of pages of this many rows, the B sequences' lengths
  // spread geometrically from Nk / 64 to Nk (continuous batching), pages shuffled.
  int64_t page_size = 0;
  // The pool's memory: head-major within a page, (pages, Hkv, page_size, D) (KVCache's), or
  // token-major, C order (pages, page_size, Hkv, D).
  bool token_major_pages = false;
  // kInt8 / kUInt8: an 8-bit K/V cache (KVQuant) read by float32 q: k and v hold random 8-bit
  // values with a float32 scale (and, for uint8, zero point) per (token, kv head); the type
  // column prints its tag. Anything else: k and v are `dtype` as q is.
  DType kv = DType::kFloat32;
  Precision precision = Precision::kExact;  // Options::precision (sdpa bench --precision)
  bool batch_invariant = false;              // Options::batch_invariant (sdpa bench --batch-invariant)
};

// Keys of sequence b: Nk, or with page_size the geometric spread above.
int64_t keys_of(const BenchCase& c, int64_t b);

// Forward: 4·B·Hq·Nq·Nk·D (two products of 2·Nq·Nk·D flops per head). Backward:
// 10·B·Hq·Nq·Nk·D (five products: q·kᵀ recomputed, dout·vᵀ, dv, dq, dk). Halved for causal.
// With a window, Nq·Nk becomes the number of (i, j) pairs that causal and the window allow.
double flop_count(const BenchCase& c);
bool has_window(const BenchCase& c);
// Bytes of K and V (of the sequences' keys), which a decode step (small Nq) must stream from
// memory; for an 8-bit cache the 1-byte values and the float32 scales (and zero points).
double kv_bytes(const BenchCase& c);
bool is_decode(const BenchCase& c);  // Nq·(Hq/Hkv) small: bandwidth, not flops, is the measure

// "bf16", "f16", "f32", "f64": what `sdpa bench --dtype` takes and case names end in.
const char* dtype_tag(DType dtype);
// The dtype of a tag, or nullopt for anything else.
std::optional<DType> dtype_of_tag(const std::string& tag);

// The default table: prefill (D 64/128, causal, masks, GQA), decode, backward and window cases
// in float32, then a few of them in bfloat16 (prefill D 64/128 with and without causal, GQA
// decode, backward D 64).
std::vector<BenchCase> default_cases();
// Every case of the float32 table in `dtype` instead, named with its tag.
std::vector<BenchCase> cases_in(DType dtype);

// Random inputs for a case, owned; `run` calls sdpa::attention once with the given backend.
class CaseData {
 public:
  explicit CaseData(const BenchCase& c);
  void run(Backend backend = Backend::kAuto);

 private:
  Inputs inputs() const;
  BenchCase c_;
  std::vector<char> q_, k_, v_, out_, mask_, lse_, dout_, dq_, dk_, dv_;
  std::vector<float> scales_[4];  // an 8-bit cache's k_scale, v_scale, k_zero, v_zero (one per row of k_)
  std::vector<int32_t> table_;    // paged: (B, max_pages)
  std::vector<int64_t> lengths_;  // paged: (B,)
};

// Median wall time (seconds) of `reps` runs after one warm-up.
double median_seconds(CaseData& data, int reps, Backend backend = Backend::kAuto);

}  // namespace sdpa::bench
