// quantize_kv's two passes (kv_cache.h states the rule), shared by quantize_kv and KVCache's
// 8-bit append: quant_scales reads and checks every group of x and returns its scale (and zero
// point), writing nothing; write_quantized then writes the values and scales. A caller checks
// every group before it writes any (nothing is written on an error).
#pragma once

#include <cstdint>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa::internal {

// One group's scale s and zero point z (0 for int8): quantize_kv's rule.
struct QuantScale {
  float scale = 0.0f, zero = 0.0f;
};

// The scales of x's groups, in C order of (x's rows, groups): x (any rank >= 1, last dim D, a
// unit last stride when D > 1; float32, float64, bfloat16 or float16) cut into `groups` groups
// of D / groups features per row (groups divides D), for `values` int8 or uint8. Error naming
// `name` for a non-finite element or a scale that float32 cannot hold (float64 x only).
std::vector<QuantScale> quant_scales(const char* name, const TensorView& x, DType values, int64_t groups);

// Writes x's rows quantised by `scales` (quant_scales' for x, from `first` on) into `values`
// (x's shape, int8 or uint8, unit last stride), `scale` (x's shape without its last dim, or
// with a last dim G = the groups) and, when given, `zero` (scale's shape). No checks.
void write_quantized(const TensorView& x, const QuantScale* scales, const TensorView& values, const TensorView& scale,
                     const TensorView* zero);

}  // namespace sdpa::internal
