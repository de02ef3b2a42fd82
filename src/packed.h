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
// Error unless t has rank 3 ("name has shape ... but must be <shape>").
void check_rank3(const char* name, const TensorView& t, const char* shape);
// Rows [r0, r1) of a packed (total, H, D) tensor as a (H, r1 - r0, D) view (no copy).
TensorView rows_of(const TensorView& t, int64_t r0, int64_t r1);
// Columns [r0, r1) of lse (H, total_q).
TensorView cols_of(const TensorView& t, int64_t r0, int64_t r1);

// The options of sequence b of `sequences` packed ones (each a problem with batch 1): per-batch
// ALiBi slopes (sequences, Hq) become row b as (1, Hq); Error naming alibi_slopes when their
// first dim is neither 1 nor `sequences`; a block_mask is an Error (its blocks would differ per
// sequence). Other options are shared.
Options sequence_options(const Options& options, int64_t b, int64_t sequences);

}  // namespace sdpa::internal
