// The fused, tiled, multi-threaded SIMD kernel (FlashAttention-2 forward). Dispatches once
// to the best SIMD target of this CPU (Highway), then runs flash-inl.h's code for it.
#pragma once

#include <cstddef>
#include <vector>

#include "problem.h"

namespace sdpa::internal {

// Writes out (and lse, weights when requested) for a validated problem, in p.dtype.
void flash_attention(const Problem& p);
// flash_attention of each problem (all of one compute type), in one parallel region whose
// threads share the problems' work: bitwise what flash_attention of each gives.
void flash_attention_many(const std::vector<const Problem*>& problems);

// The FlashAttention-2 backward: dq, dk, dv from tiles recomputed with the saved lse.
void flash_backward(const BackwardProblem& bp);

// The same per compute type, one translation unit each (forward_f32.cc, ...): flash.cc calls
// them.
void flash_attention_many_f32(const Problem* const* problems, size_t n);
void flash_attention_many_f64(const Problem* const* problems, size_t n);
void flash_backward_f32(const BackwardProblem& bp);
void flash_backward_f64(const BackwardProblem& bp);

}  // namespace sdpa::internal
