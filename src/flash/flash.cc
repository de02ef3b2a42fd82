// Compiles flash-inl.h once per SIMD target and dispatches to the best one at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "flash/flash.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "flash/backward-inl.h"
#include "flash/bf16_dot.h"
#include "flash/flash-inl.h"
#include "flash/flash.h"
#include "hwy/highway.h"
#include "hwy/targets.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
void FlashF32(const Problem& p) { Flash<float>(p); }
void FlashF64(const Problem& p) { Flash<double>(p); }
void FlashManyF32(const std::vector<const Problem*>& ps) { FlashMany<float>(ps.data(), ps.size()); }
void FlashManyF64(const std::vector<const Problem*>& ps) { FlashMany<double>(ps.data(), ps.size()); }
void FlashBackwardF32(const BackwardProblem& bp) { FlashBackward<float>(bp); }
void FlashBackwardF64(const BackwardProblem& bp) { FlashBackward<double>(bp); }
}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sdpa::internal {
HWY_EXPORT(FlashF32);
HWY_EXPORT(FlashF64);
HWY_EXPORT(FlashManyF32);
HWY_EXPORT(FlashManyF64);
HWY_EXPORT(FlashBackwardF32);
HWY_EXPORT(FlashBackwardF64);

// Dispatches on the compute type (validation admits only these two).
void flash_attention(const Problem& p) {
  if (p.compute == DType::kFloat64) {
    HWY_DYNAMIC_DISPATCH(FlashF64)(p);
  } else {
    HWY_DYNAMIC_DISPATCH(FlashF32)(p);
  }
}
void flash_attention_many(const std::vector<const Problem*>& problems) {
  if (problems.front()->compute == DType::kFloat64) {
    HWY_DYNAMIC_DISPATCH(FlashManyF64)(problems);
  } else {
    HWY_DYNAMIC_DISPATCH(FlashManyF32)(problems);
  }
}
void flash_backward(const BackwardProblem& bp) {
  if (bp.fwd.compute == DType::kFloat64) {
    HWY_DYNAMIC_DISPATCH(FlashBackwardF64)(bp);
  } else {
    HWY_DYNAMIC_DISPATCH(FlashBackwardF32)(bp);
  }
}
}  // namespace sdpa::internal

bool sdpa::kernel_path_available(KernelPath path) {
  if (path == KernelPath::kSimd) return true;
  if (path != KernelPath::kAvx512Bf16 && path != KernelPath::kAmxBf16) return false;
#if HWY_ARCH_X86
  // Some AVX-512 target compiled in, supported and not disabled (Flash dispatches to one).
  const bool avx512 = (hwy::SupportedTargets() & HWY_TARGETS & (HWY_AVX2 - 1)) != 0;
  return avx512 && (path == KernelPath::kAmxBf16 ? internal::cpu_has_amx_bf16() : internal::cpu_has_avx512_bf16());
#else
  return false;
#endif
}
#endif
