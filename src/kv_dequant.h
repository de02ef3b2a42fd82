// 8-bit K/V (KVQuant, include/sdpa/attention.h): the forward calls (attention, attention_varlen,
// attention_paged) validate kv_quant here, then run as the float32 call that stands in for the
// 8-bit one: k and v dequantised by KVQuant's rule, fl32(fl32(x - z) · s), into float32 scratch
// (only the rows the call reads: rows past seqlens_k and pages no block-table entry in use names
// stay 0 and their scales are never read), and, for bfloat16 or float16 q, q and a 16-bit float
// mask widened exactly to float32 and out computed in float32 and rounded once to out's dtype
// (what the kernels do for 16-bit q: they widen exactly and round once; Options::precision does
// not apply). Every path (kFlash, kReference, kNaive, weights, stats, scores, the decode kernel,
// pages, varlen) thus reads the same float32 values, bit for bit the call on float32 K/V holding
// them. Costs float32 copies of k and v (of the pools, for attention_paged) per call, except
// where the call is fused (prepare's fusable): then the SIMD kernels read the 8-bit values in
// place and dequantise them in registers by the same rule (the same bits); 16-bit q, a 16-bit
// mask and out still go through their float32 copies (a decode step's are small).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa::internal {

struct View4;
struct Problem;

// A scale group the fused kernels read in place holds whole vectors of float32 (16 lanes on
// AVX-512, 8 on AVX2, 4 on EMU128), or a vector holds whole groups: its width is a multiple of
// this or divides it (1, 2, 4, 8); else (e.g. 12) the call takes the scratch path.
inline constexpr int64_t kFusedWidth = 16;

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
  //
  // fusable (the caller's word that its problem's views can carry the quantisation: the
  // dense, varlen and paged calls; every kernel then reads 8-bit k and v in place, the fused ones
  // dequantising in registers, the slow paths through View4::load): with scale groups of
  // whole vectors (one group per row, or a width that kFusedWidth divides or is divided by), prepare
  // validates as above but does not copy k and v and returns true with fused() true: k, v and
  // kv_quant stay as given (q, mask and out are rewritten as above when q is 16-bit), and
  // attach() puts the quantisation into the problem's k and v views (problem.h's
  // View4::Quant), which the kernels dequantise in registers, the same values (rows-inl.h's
  // RowReader, ReadRows). Else the float32 stand-in call above.
  bool prepare(TensorView& q, TensorView& k, TensorView& v, std::optional<KVQuant>& kv_quant,
               std::optional<TensorView>* mask, TensorView& out, const char* k_name, const char* v_name,
               const RowsRead& reads, bool fusable = false);
  bool fused() const { return fused_; }
  // After a fused prepare: the quantisation of k (which = 0) or v (1) into its View4, scale and
  // zero laid out as k of rank `rank` (dense) or as a pool (paged).
  void attach(View4& view, int which, const TensorView& scale, const std::optional<TensorView>& zero, int rank,
              bool paged) const;
  // After the run: out's float32 results rounded once into the caller's 16-bit out.
  void finish() const;

 private:
  std::unique_ptr<float[]> k_, v_;  // not zeroed on allocation (dequantize writes every row)
  std::vector<float> q_, mask_, out_;
  TensorView user_out_{};
  bool round_out_ = false;
  bool fused_ = false;
  int64_t width_[2] = {0, 0};  // features per scale of k, v (fused)
};

// make_problem for a fused dense call (prepare returned true with fused()): in's q, k, v and
// kv_quant as given; k and v become 8-bit views carrying their quantisation.
Problem make_fused_problem(const Float32Call& f32, const Inputs& in, const Outputs& outputs, const Options& options);

// The rows read of a dense k (rank 2..4) under seqlens_k (any row when none is given; none when
// seqlens_k is not readable: make_problem then reports it).
RowsRead dense_rows_read(const TensorView& k, const std::optional<TensorView>& seqlens_k);

}  // namespace sdpa::internal
