// The entry point: validate once, then hand the Problem to the chosen kernel.
#include <string>
#include <vector>

#include "flash/flash.h"
#include "kernel_path.h"
#include "kv_dequant.h"
#include "problem.h"
#include "reference.h"

namespace sdpa {
namespace {

// The kernels exist for two compute types; validation admits no other.
bool computes_in_f64(DType compute) {
  if (compute != DType::kFloat64 && compute != DType::kFloat32) {
    throw Error(std::string("internal: no kernel computes in ") + dtype_name(compute));
  }
  return compute == DType::kFloat64;
}

// Whether the fused kernel runs p as two passes: Options::precision kFast (round_p) with the
// weights or statistics asked for, which describe the exact softmax.
bool splits_exact_pass(const internal::Problem& p) { return p.round_p && (p.weights || p.stats.any()); }

void run_backend(const internal::Problem& p, Backend backend) {
  const bool f64 = computes_in_f64(p.compute);
  switch (backend) {
    case Backend::kReference:
      internal::materialized_attention<double>(p);
      return;
    case Backend::kAuto:
    case Backend::kFlash:
      if (splits_exact_pass(p)) {
        // kFast's weights and statistics are exact mode's: an exact pass writes them (and out,
        // which the kFast pass then writes again; outputs overlap no input), the kFast pass out
        // and lse.
        internal::Problem exact = p;
        exact.round_p = false;
        exact.lse.reset();
        internal::flash_attention(exact);
        internal::Problem fast = p;
        fast.weights.reset();
        fast.stats = {};
        internal::flash_attention(fast);
        return;
      }
      internal::flash_attention(p);
      return;
    case Backend::kNaive:  // kFast's naive row keeps the exact weights beside its rounded sums
      f64 ? internal::materialized_attention<double>(p) : internal::materialized_attention<float>(p);
      return;
  }
  throw Error("backend has an unknown value " + std::to_string(static_cast<int>(backend)));
}

}  // namespace

namespace internal {

void run_forward(const Problem& p, Backend backend) {
  if (p.writes_nothing()) return;
  if (p.scores) {  // a plain loop of its own, for inspection
    computes_in_f64(p.compute) || backend == Backend::kReference ? internal::write_scores<double>(p)
                                                                  : internal::write_scores<float>(p);
  }
  // Scores that are the biases alone: lse from them directly, so that it does not depend on
  // asking for anything else. The statistics too, in closed form, when the biases are constant
  // along the keys and no weights are asked for (k of shape (2^40, 0) holds no element: work
  // must not follow Nk). The kernels otherwise, for the weights (whose Nq × Nk elements exist)
  // and the statistics of rows whose biases vary (the mask row exists; ALiBi; block mask).
  if (p.scores_are_biases_only()) {
    internal::Problem weights_only = p;
    weights_only.lse.reset();
    if (p.stats.any() && !p.weights && p.biases_constant_along_keys()) {
      computes_in_f64(p.compute) || backend == Backend::kReference ? internal::stats_of_constant_rows<double>(p)
                                                                    : internal::stats_of_constant_rows<float>(p);
    } else if (weights_only.weights || weights_only.stats.any()) {
      run_backend(weights_only, backend);
    }
    if (p.lse) internal::lse_of_biases(p);
    return;
  }
  run_backend(p, backend);
}

void run_forward_many(const std::vector<Problem>& problems, Backend backend) {
  std::vector<const Problem*> fused[2];  // by compute type: float32, float64
  for (const Problem& p : problems) {
    const bool fuse = (backend == Backend::kAuto || backend == Backend::kFlash) && !p.writes_nothing() &&
                      !p.scores_are_biases_only() && !splits_exact_pass(p);
    if (fuse) {
      fused[computes_in_f64(p.compute)].push_back(&p);
    } else {
      run_forward(p, backend);
    }
  }
  for (const std::vector<const Problem*>& batch : fused)
    if (!batch.empty()) internal::flash_attention_many(batch);
}

void run_backward(const BackwardProblem& bp, Backend backend) {
  const bool f64 = computes_in_f64(bp.fwd.compute);
  if (bp.writes_nothing()) {
    if (bp.dsinks) internal::sink_gradients(bp);
  } else {
    switch (backend) {
      case Backend::kAuto:
      case Backend::kFlash:
        internal::flash_backward(bp);
        break;
      case Backend::kReference:
        internal::materialized_backward<double>(bp);
        break;
      case Backend::kNaive:
        f64 ? internal::materialized_backward<double>(bp) : internal::materialized_backward<float>(bp);
        break;
      default:
        throw Error("backend has an unknown value " + std::to_string(static_cast<int>(backend)));
    }
  }
  // The mask's and the ALiBi slopes' gradients have a pass of their own (bias_grad.cc), in the
  // compute type (float64 for kReference), after the kernels; written even where dq, dk and dv
  // are empty (Dk = 0: the scores are the biases alone).
  if (bp.dbias || bp.dalibi) {
    if (backend == Backend::kAuto || backend == Backend::kFlash) {
      f64 ? internal::fast_bias_gradients<double>(bp) : internal::fast_bias_gradients<float>(bp);
    } else {
      f64 || backend == Backend::kReference ? internal::bias_gradients<double>(bp) : internal::bias_gradients<float>(bp);
    }
  }
}

}  // namespace internal

void attention(const Inputs& inputs, const Outputs& outputs, const Options& options) {
  internal::note_kernel_path(KernelPath::kSimd);  // until a kernel says otherwise
  Inputs in = inputs;
  Outputs outs = outputs;
  internal::Float32Call f32;  // 8-bit K/V: the float32 call standing in for this one, or fused
  if (f32.prepare(in.q, in.k, in.v, in.kv_quant, &in.mask, outs.out, "k", "v",
                  internal::dense_rows_read(in.k, in.seqlens_k), /*fusable=*/true)) {
    if (f32.fused()) {
      internal::run_forward(internal::make_fused_problem(f32, in, outs, options), options.backend);
      f32.finish();
      return;
    }
    internal::run_forward(internal::make_problem(in, outs, options), options.backend);
    f32.finish();
    return;
  }
  internal::run_forward(internal::make_problem(inputs, outputs, options), options.backend);
}

void attention_backward(const Inputs& inputs, const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const Gradients& grads, const Options& options) {
  internal::note_kernel_path(KernelPath::kSimd);  // until a kernel says otherwise
  internal::run_backward(internal::make_backward_problem(inputs, out, lse, dout, grads, options), options.backend);
}

}  // namespace sdpa
