// The entry point: validate once, then hand the Problem to the chosen kernel.
#include "flash/flash.h"
#include "problem.h"
#include "reference.h"

namespace sdpa {

void attention(const Inputs& inputs, const Outputs& outputs, const Options& options) {
  const internal::Problem p = internal::make_problem(inputs, outputs, options);
  if (p.writes_nothing()) return;
  if (p.scores_are_biases_only()) return internal::lse_of_biases(p);
  const bool f64 = p.dtype == DType::kFloat64;
  switch (options.backend) {
    case Backend::kReference:
      internal::materialized_attention<double>(p);
      return;
    case Backend::kAuto:
    case Backend::kFlash:
      internal::flash_attention(p);
      return;
    case Backend::kNaive:
      f64 ? internal::materialized_attention<double>(p) : internal::materialized_attention<float>(p);
      return;
  }
  throw Error("backend has an unknown value " + std::to_string(static_cast<int>(options.backend)));
}

void attention_backward(const Inputs& inputs, const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const Gradients& grads, const Options& options) {
  const internal::BackwardProblem bp = internal::make_backward_problem(inputs, out, lse, dout, grads, options);
  if (bp.writes_nothing()) return;
  const bool f64 = bp.fwd.dtype == DType::kFloat64;
  switch (options.backend) {
    case Backend::kAuto:
    case Backend::kFlash:
      internal::flash_backward(bp);
      return;
    case Backend::kReference:
      internal::materialized_backward<double>(bp);
      return;
    case Backend::kNaive:
      f64 ? internal::materialized_backward<double>(bp) : internal::materialized_backward<float>(bp);
      return;
  }
  throw Error("backend has an unknown value " + std::to_string(static_cast<int>(options.backend)));
}

}  // namespace sdpa
