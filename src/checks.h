// Argument checks that more than one front door makes, in one place (defined in problem.cc,
// beside make_problem's own). attention() and attention_backward() check every argument in
// make_problem / make_backward_problem; the calls that cut their tensors into attention()
// problems (attention_varlen, attention_paged, KVCache) check only their own layout (packing,
// pages, the cache's shape) with these, then make_problem checks each problem. The layer
// (layer/mha.cc) checks its weights and inputs against its config itself, reporting with fail
// and checking for data with check_has_data. Each fails (fail below: sdpa::Error naming the
// argument and its shape) before anything is written.
#pragma once

#include <string>

#include "sdpa/attention.h"

namespace sdpa::internal {

// Reports an invalid argument: throws Error(message), before anything is written. The one way
// every check reports.
[[noreturn]] inline void fail(const std::string& message) { throw Error(message); }

// Error unless t has `rank` dims: "<name> has shape <t's> but must be <meaning>".
void check_rank(const char* name, const TensorView& t, int rank, const char* meaning);
// Error unless t holds indices, int32 or int64 (seqlens_k, cu_seqlens_q/k, block_table).
void check_index_dtype(const char* name, const TensorView& t);
// Error when t has elements but no data.
void check_has_data(const char* name, const TensorView& t);
// What every tensor needs: rank in [min_rank, max_rank], non-negative dims whose element count
// fits int64_t, data when non-empty.
void check_basic(const char* name, const TensorView& t, int min_rank, int max_rank);
// An output (written) must not map two indices to one element: Error on stride 0 in a dim of
// extent > 1 (other self-overlapping strides are the caller's promise).
void check_no_zero_stride(const char* name, const TensorView& t);
// A packed call's lse (rank 2, as check_rank found it) against q (total_q, Hq, Dk): Error
// unless it is (Hq, total_q).
void check_packed_lse(const TensorView& lse, const TensorView& q);
// The storage dtypes as the errors list them, "float32, float64, bfloat16 or float16": the
// storage rows of storage.h's kDTypeTable, in its order.
std::string storage_dtype_list();
// Error naming q_start when Options::q_start or k_start is set, for the calls that take no
// positions (`call`: "attention_varlen", ...): only attention() and attention_backward() do.
void check_no_positions(const Options& options, const char* call);
// Whether any of Outputs::stats is given (the fields make_problem's check_stats reads).
bool any_stats(const Stats& stats);

}  // namespace sdpa::internal
