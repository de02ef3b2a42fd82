// Packed (varlen) tensors: sequences stored end to end, token-major (FlashAttention's layout),
// cut into per-sequence views for attention_varlen and attention_paged's packed queries.
#pragma once

#include <cstdint>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa::internal {

// cu_seqlens: (B + 1,) int32 or int64, starting at 0, non-decreasing, ending at `total` (the
// packed rows of `of`). Read once, into int64; Error naming `name` and the entry otherwise.
std::vector<int64_t> read_offsets(const char* name, const TensorView& t, int64_t total, const char* of);
// The most rows any sequence of cu_seqlens `cu` (read_offsets') has: 0 for no sequence.
int64_t longest_sequence(const std::vector<int64_t>& cu);
// Rows [r0, r1) of a packed (total, H, D) tensor as a (H, r1 - r0, D) view (no copy).
TensorView rows_of(const TensorView& t, int64_t r0, int64_t r1);
// Columns [r0, r1) of lse (H, total_q).
TensorView cols_of(const TensorView& t, int64_t r0, int64_t r1);

// Packed sequences' options. packed_options checks them against all `sequences` (Hq query
// heads; the longest sequence has max_q queries and max_k keys): per-batch ALiBi slopes are
// (sequences or 1, Hq); a block_mask is (..., ceil(max_q / block_q), ceil(max_k / block_k)),
// its leading dims broadcasting to (sequences, Hq). Error naming the argument otherwise. It
// returns the options for the check of all rows as one sequence (no block_mask: its geometry
// is not that one's).
Options packed_options(const Options& options, int64_t sequences, int64_t Hq, int64_t max_q, int64_t max_k);
// Sequence b's own options, once packed_options has checked them: ALiBi slopes (sequences, Hq)
// become row b as (Hq,); the block_mask becomes its batch row b and, of that, the top-left
// (ceil(nq / block_q), ceil(nk / block_k)) blocks, with nq and nk sequence b's own lengths.
// Other options are shared.
Options sequence_options(const Options& options, int64_t b, int64_t nq, int64_t nk);

}  // namespace sdpa::internal
