// The materialising kernels: a float64 oracle and its same-precision twin.
#pragma once

#include "problem.h"

namespace sdpa::internal {

// Computes every row's scores, a stable softmax and the weighted sum of values, accumulating in
// Acc. Acc = double is the reference every fast kernel is tested against; Acc = the inputs'
// dtype is the "naive implementation" whose error sets test tolerances. Deliberately simple.
template <typename Acc>
void materialized_attention(const Problem& p);

// The backward pass the same way (reference_backward.cc): recomputes each row's softmax,
// accumulates dq, dk, dv in Acc.
template <typename Acc>
void materialized_backward(const BackwardProblem& bp);

}  // namespace sdpa::internal
