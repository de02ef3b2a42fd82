// bfloat16 dot products with AVX512_BF16 (vdpbf16ps), for the forward's score tiles.
//
// Why a hand-written piece: Highway 1.0.3 (Debian's) has no target with AVX512_BF16, so its
// ReorderWidenMulAccumulate for bfloat16 widens and uses float32 FMAs. vdpbf16ps multiplies 32
// pairs of bfloat16 and adds them into 16 float32 lanes per instruction: twice the products of
// a float32 FMA, read straight from bfloat16 memory. This file is the only one that uses it;
// it is compiled with a target attribute and called only after the runtime check below.
//
// Numerics: the products of two bfloat16 are exact in float32 and the sums are rounded in
// float32, as the widening path's (the same error bound, not the same bits). The instruction
// treats subnormal inputs as zero and flushes subnormal results; the caller keeps that far
// below float32's rounding by sending only blocks whose queries hold no subnormal and are
// small enough (bf16_dot_block_ok).
#pragma once

#include <cstddef>
#include <cstdint>

namespace sdpa::internal {

// Whether this CPU and OS run AVX512_BF16 with 512-bit vectors (cpuid and xgetbv). Checked once.
bool cpu_has_avx512_bf16();

// Whether a block whose queries have largest magnitude max_abs_q (finite, none subnormal)
// may use Bf16DotScores: the instruction's flushing then moves each scaled score by at most
// |scale| · Dk · (max_abs_q + 2) · 2^-126 <= 2^-60.
bool bf16_dot_block_ok(double scale, int64_t dk, double max_abs_q);

// st[j·mq + lane] = scale · Σ_c k_j[c] · q_lane[c] for keys j < n and lanes < mq (16 or 32),
// with the block's queries packed in pairs of features: qp[c2·mq + lane] holds q_lane[2·c2] in
// its low half and q_lane[2·c2 + 1] (0 past dk) in its high half. k: bfloat16 bits, key j's
// row at k + j·k_stride (elements; the stride may be negative). qp and st 64-byte aligned.
// Only after cpu_has_avx512_bf16() returned true.
void Bf16DotScores(const uint32_t* qp, size_t mq, int64_t dk, const uint16_t* k, int64_t k_stride, int64_t n,
                   float scale, float* st);

}  // namespace sdpa::internal
