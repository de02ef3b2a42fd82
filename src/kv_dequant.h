// 8-bit K/V (KVQuant, include/sdpa/attention.h): the forward calls (attention, attention_varlen,
// attention_paged) validate kv_quant here, then run as the float32 call that stands in for the
// 8-bit one: k and v dequantised by KVQuant's rule, fl32(fl32(x - z) · s), into float32 scratch
// (only the rows the call reads: rows past seqlens_k and pages no block-table entry in use names
// stay 0 and their scales are never read), and, for bfloat16 or float16 q, q and a 16-bit float
// mask widened exactly to float32 and out computed in float32 and rounded once to out's dtype
// (what the kernels do for 16-bit q: they widen exactly and round once; Options::precision does
// not apply). Every path (kFlash, kReference, kNaive, weights, stats, scores, the decode kernel,
// pages, varlen) thus reads the same float32 values, bit for bit the call on float32 K/V holding
// them. Costs float32 copies of k and v (of the pools, for attention_paged) per call: the
// kernels do not dequantise in registers (yet).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa::internal {

inline bool is_8bit_dtype(DType t) { return t == DType::kInt8 || t == DType::kUInt8; }

// Whether row `lead` (the indices of every dim but the last) of k (or v) is read by the call.
using RowsRead = std::function<bool(const int64_t* lead)>;

// The float32 call standing in for an 8-bit one; owns the scratch its views point into.
class Float32Call {
 public:
  // Returns false, having checked that kv_quant is not given, unless k or v is 8-bit. Else
  // validates (q's dtype, k's and v's, kv_quant's views against k and v as named, the scales and
  // zero points of the rows read finite; Error naming the argument and the shapes) and rewrites
  // q, k, v, mask and out as float32 views over its scratch, and kv_quant as none.
  bool prepare(TensorView& q, TensorView& k, TensorView& v, std::optional<KVQuant>& kv_quant,
               std::optional<TensorView>* mask, TensorView& out, const char* k_name, const char* v_name,
               const RowsRead& reads);
  // After the run: out's float32 results rounded once into the caller's 16-bit out.
  void finish() const;

 private:
  std::unique_ptr<float[]> k_, v_;  // not zeroed on allocation (dequantize writes every row)
  std::vector<float> q_, mask_, out_;
  TensorView user_out_{};
  bool round_out_ = false;
};

// The rows read of a dense k (rank 2..4) under seqlens_k (any row when none is given; none when
// seqlens_k is not readable: make_problem then reports it).
RowsRead dense_rows_read(const TensorView& k, const std::optional<TensorView>& seqlens_k);

}  // namespace sdpa::internal
