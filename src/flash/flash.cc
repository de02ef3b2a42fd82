// The kernels' entry points: dispatch on the compute type to the translation unit compiled for
// it (forward_f32.cc, forward_f64.cc, backward_f32.cc, backward_f64.cc), each of which
// dispatches once to the best SIMD target of this CPU (Highway).
#include "flash/flash.h"

#include "flash/bf16_dot.h"
#include "hwy/highway.h"
#include "hwy/targets.h"
#include "sdpa/attention.h"

namespace sdpa::internal {

// Validation admits only these two compute types.
void flash_attention(const Problem& p) { flash_attention_many({&p}); }
void flash_attention_many(const std::vector<const Problem*>& problems) {
  if (problems.front()->compute == DType::kFloat64) {
    flash_attention_many_f64(problems.data(), problems.size());
  } else {
    flash_attention_many_f32(problems.data(), problems.size());
  }
}
void flash_backward(const BackwardProblem& bp) {
  if (bp.fwd.compute == DType::kFloat64) {
    flash_backward_f64(bp);
  } else {
    flash_backward_f32(bp);
  }
}

}  // namespace sdpa::internal

bool sdpa::kernel_path_available(KernelPath path) {
  if (path == KernelPath::kSimd) return true;
  if (path != KernelPath::kAvx512Bf16 && path != KernelPath::kAmxBf16) return false;
#if HWY_ARCH_X86
  // Some AVX-512 target compiled in, supported and not disabled (the kernels dispatch to one).
  const bool avx512 = (hwy::SupportedTargets() & HWY_TARGETS & (HWY_AVX2 - 1)) != 0;
  return avx512 && (path == KernelPath::kAmxBf16 ? internal::cpu_has_amx_bf16() : internal::cpu_has_avx512_bf16());
#else
  return false;
#endif
}
