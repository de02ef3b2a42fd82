// Dropout's keep/drop decision: a pure function of (seed, b, h, i, j) through Philox4x32-10
// (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), a counter-based
// generator. No state, no sequence: any kernel, tile order or thread count, and the forward
// and backward passes, draw the same decision for the same element.
#pragma once

#include <cstdint>

namespace sdpa::internal {

struct Dropout {
  double p = 0.0;          // probability of dropping; 0 = off
  uint64_t seed = 0;
  uint32_t threshold = 0;  // drop when the 32-bit draw is below p · 2^32
  double keep_scale = 1.0; // 1 / (1 - p): kept weights are scaled so the expectation is unchanged
  int64_t batch_offset = 0;  // added to b: attention_varlen runs sequence b as a batch of one
  int64_t row_offset = 0, col_offset = 0;  // added to i and j: Options::q_start and k_start

  bool enabled() const { return p > 0; }

  static uint32_t draw(uint64_t seed, uint32_t b, uint32_t h, uint32_t i, uint32_t j) {
    uint32_t c0 = j, c1 = i, c2 = h, c3 = b;
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = uint64_t{0xD2511F53u} * c0, p1 = uint64_t{0xCD9E8D57u} * c2;
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = n0;
      c2 = n2;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    return c0;
  }

  // The factor that multiplies weight (b, h, i, j): 0 if dropped, 1 / (1 - p) if kept.
  template <typename T>
  T factor(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!enabled()) return T(1);
    const uint32_t u = draw(seed, static_cast<uint32_t>(b + batch_offset), static_cast<uint32_t>(h),
                            static_cast<uint32_t>(i + row_offset), static_cast<uint32_t>(j + col_offset));
    return u < threshold ? T(0) : static_cast<T>(keep_scale);
  }
};

}  // namespace sdpa::internal
