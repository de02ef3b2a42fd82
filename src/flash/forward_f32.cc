// flash-inl.h's forward (FlashMany) in float, compiled once per SIMD target. Each compute
// type and direction is a translation unit of its own, so that the four compile in parallel
// (flash.cc dispatches on the compute type).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "flash/forward_f32.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "flash/flash-inl.h"
#include "flash/flash.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
void FlashManyF32(const Problem* const* ps, size_t n) { FlashMany<float>(ps, n); }
}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sdpa::internal {
HWY_EXPORT(FlashManyF32);
void flash_attention_many_f32(const Problem* const* ps, size_t n) { HWY_DYNAMIC_DISPATCH(FlashManyF32)(ps, n); }
}  // namespace sdpa::internal
#endif
