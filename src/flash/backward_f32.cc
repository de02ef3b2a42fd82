// backward-inl.h's backward (FlashBackward) in float, compiled once per SIMD target. Each compute
// type and direction is a translation unit of its own, so that the four compile in parallel
// (flash.cc dispatches on the compute type).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "flash/backward_f32.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "flash/backward-inl.h"
#include "flash/flash.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
void FlashBackwardF32(const BackwardProblem& bp) { FlashBackward<float>(bp); }
}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sdpa::internal {
HWY_EXPORT(FlashBackwardF32);
void flash_backward_f32(const BackwardProblem& bp) { HWY_DYNAMIC_DISPATCH(FlashBackwardF32)(bp); }
}  // namespace sdpa::internal
#endif
