// AVX512_BF16 score tiles (see bf16_dot.h). Register blocking as products-inl.h's ScoreKeys:
// KB keys × QV vectors of lanes in accumulators, one broadcast pair of a key's features and QV
// loads of query pairs per step.
#include "flash/bf16_dot.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define SDPA_HAVE_BF16_DOT 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define SDPA_HAVE_BF16_DOT 0
#endif

namespace sdpa::internal {

bool bf16_dot_scale_ok(double scale) {
  return scale == 0 || (std::fabs(scale) >= 0x1p-40 && std::fabs(scale) < 0x1p32);
}

#if SDPA_HAVE_BF16_DOT
namespace {

bool detect() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 16))) return false;  // AVX512F
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;   // AVX512_BF16
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xe6u) == 0xe6u;  // the OS saves SSE, AVX, opmask and both halves of ZMM state
}

// A pair of key features as one 32-bit word (the second half 0 when only one is left).
inline uint32_t pair_at(const uint16_t* row, int64_t c2, int64_t dk) {
  if (2 * c2 + 1 < dk) {
    uint32_t w;
    std::memcpy(&w, row + 2 * c2, sizeof w);
    return w;
  }
  return row[2 * c2];
}

template <int KB, int QV>
__attribute__((target("avx512f,avx512bf16"))) inline void Block(const uint32_t* qp, size_t mq, int64_t dk,
                                                                const uint16_t* k, int64_t ks, float scale,
                                                                float* st) {
  __m512 acc[KB][QV];
  for (int kb = 0; kb < KB; ++kb)
    for (int v = 0; v < QV; ++v) acc[kb][v] = _mm512_setzero_ps();
  const int64_t pairs = (dk + 1) / 2;
  for (int64_t c2 = 0; c2 < pairs; ++c2) {
    __m512bh q[QV];
    for (int v = 0; v < QV; ++v) q[v] = (__m512bh)_mm512_load_si512(qp + c2 * mq + v * 16);
    for (int kb = 0; kb < KB; ++kb) {
      const __m512bh kk = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(k + kb * ks, c2, dk)));
      for (int v = 0; v < QV; ++v) acc[kb][v] = _mm512_dpbf16_ps(acc[kb][v], kk, q[v]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int kb = 0; kb < KB; ++kb)
    for (int v = 0; v < QV; ++v) _mm512_store_ps(st + kb * mq + v * 16, _mm512_mul_ps(acc[kb][v], s));
}

template <int QV>
__attribute__((target("avx512f,avx512bf16"))) void Tile(const uint32_t* qp, size_t mq, int64_t dk, const uint16_t* k, int64_t ks, int64_t n, float scale,
          float* st) {
  constexpr int KB = QV == 1 ? 16 : 12;  // KB·QV accumulators + QV + 1 of the 32 registers
  int64_t j = 0;
  for (; j + KB <= n; j += KB) Block<KB, QV>(qp, mq, dk, k + j * ks, ks, scale, st + j * mq);
  for (; j + 4 <= n; j += 4) Block<4, QV>(qp, mq, dk, k + j * ks, ks, scale, st + j * mq);
  for (; j + 2 <= n; j += 2) Block<2, QV>(qp, mq, dk, k + j * ks, ks, scale, st + j * mq);
  for (; j < n; ++j) Block<1, QV>(qp, mq, dk, k + j * ks, ks, scale, st + j * mq);
}

}  // namespace

bool cpu_has_avx512_bf16() {
  static const bool has = detect();
  return has;
}

void Bf16DotScores(const uint32_t* qp, size_t mq, int64_t dk, const uint16_t* k, int64_t k_stride, int64_t n,
                   float scale, float* st) {
  if (mq == 16) {
    Tile<1>(qp, mq, dk, k, k_stride, n, scale, st);
  } else {
    Tile<2>(qp, mq, dk, k, k_stride, n, scale, st);
  }
}

#else  // not x86-64, or a compiler without the intrinsics: never available

bool cpu_has_avx512_bf16() { return false; }
void Bf16DotScores(const uint32_t*, size_t, int64_t, const uint16_t*, int64_t, int64_t, float, float*) {}

#endif

}  // namespace sdpa::internal
