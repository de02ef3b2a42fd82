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

// Every lane: the masked forms, whose unmasked ones g++ 12 warns about (_mm512_undefined_epi32
// read as "maybe uninitialized").
constexpr __mmask16 kAll = 0xffff;

// EB value columns × QV vectors of lanes of ot: alpha·ot + Σ over key pairs [j2_0, j2_1) of
// the weight pairs (pp, relative to j2_0) times a broadcast pair of values.
template <int EB, int QV>
__attribute__((target("avx512f,avx512bf16"))) inline void AccumulateBlock(const uint32_t* pp, size_t mq, int64_t pairs,
                                                                          const uint32_t* vp, int64_t dv,
                                                                          const __m512* alpha, float* ot) {
  __m512 acc[EB][QV];
  for (int e = 0; e < EB; ++e)
    for (int v = 0; v < QV; ++v) acc[e][v] = _mm512_mul_ps(alpha[v], _mm512_load_ps(ot + e * mq + v * 16));
  for (int64_t j2 = 0; j2 < pairs; ++j2) {
    __m512bh pv[QV];
    for (int v = 0; v < QV; ++v) pv[v] = (__m512bh)_mm512_load_si512(pp + j2 * mq + v * 16);
    for (int e = 0; e < EB; ++e) {
      const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[j2 * dv + e]));
      for (int v = 0; v < QV; ++v) acc[e][v] = _mm512_dpbf16_ps(acc[e][v], vv, pv[v]);
    }
  }
  for (int e = 0; e < EB; ++e)
    for (int v = 0; v < QV; ++v) _mm512_store_ps(ot + e * mq + v * 16, acc[e][v]);
}

__attribute__((target("avx512f"))) void PackWeightPairs(const float* p, size_t mq, int64_t first, int64_t n, uint32_t* pp) {
  // The weight pairs of keys (2·j2, 2·j2 + 1) from the pair holding `first`: a key outside
  // [first, first + n) weighs 0. Each float32 p is a bfloat16 value: its top half.
  const int64_t j2_0 = first / 2, j2_1 = (first + n + 1) / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t j2 = j2_0; j2 < j2_1; ++j2) {
    const int64_t a = 2 * j2 - first, b = a + 1;  // rows of p
    for (size_t v = 0; v < mq; v += 16) {
      const __m512i pa = a >= 0 ? _mm512_load_si512(p + a * mq + v) : _mm512_setzero_si512();
      const __m512i pb = b < n ? _mm512_load_si512(p + b * mq + v) : _mm512_setzero_si512();
      _mm512_store_si512(pp + (j2 - j2_0) * mq + v, _mm512_or_si512(_mm512_maskz_srli_epi32(kAll, pa, 16), _mm512_and_si512(pb, high)));
    }
  }
}

template <int QV>
__attribute__((target("avx512f,avx512bf16"))) void AccumulatePacked(const uint32_t* pp, size_t mq, int64_t first,
                                                                     int64_t n, const uint32_t* vp, int64_t dv,
                                                                     const float* alpha, float* ot) {
  const int64_t j2_0 = first / 2, j2_1 = (first + n + 1) / 2;
  __m512 al[QV];
  for (int v = 0; v < QV; ++v) al[v] = _mm512_load_ps(alpha + v * 16);
  constexpr int EB = QV == 1 ? 16 : 12;  // EB·QV accumulators + QV + 1 of the 32 registers
  const uint32_t* vps = vp + j2_0 * dv;
  const int64_t pairs = j2_1 - j2_0;
  int64_t e = 0;
  for (; e + EB <= dv; e += EB) AccumulateBlock<EB, QV>(pp, mq, pairs, vps + e, dv, al, ot + e * mq);
  for (; e + 4 <= dv; e += 4) AccumulateBlock<4, QV>(pp, mq, pairs, vps + e, dv, al, ot + e * mq);
  for (; e + 2 <= dv; e += 2) AccumulateBlock<2, QV>(pp, mq, pairs, vps + e, dv, al, ot + e * mq);
  for (; e < dv; ++e) AccumulateBlock<1, QV>(pp, mq, pairs, vps + e, dv, al, ot + e * mq);
}

// vp[j2·out_stride + e] for e < dv: the pairs of rows (2·j2, 2·j2 + 1) of v (the high half 0 past
// an odd n).
__attribute__((target("avx512f,avx512bf16"))) void PackPairs(const uint16_t* v, int64_t vs, int64_t n, int64_t dv,
                                                              int64_t out_stride, uint32_t* vp) {
  for (int64_t j2 = 0; 2 * j2 < n; ++j2) {
    const uint16_t* ra = v + 2 * j2 * vs;
    const uint16_t* rb = 2 * j2 + 1 < n ? ra + vs : nullptr;
    uint32_t* out = vp + j2 * out_stride;
    int64_t e = 0;
    for (; e + 16 <= dv; e += 16) {
      const __m512i a = _mm512_maskz_cvtepu16_epi32(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + e)));
      const __m512i b = rb ? _mm512_maskz_cvtepu16_epi32(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + e)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(out + e, _mm512_or_si512(a, _mm512_maskz_slli_epi32(kAll, b, 16)));
    }
    for (; e < dv; ++e) out[e] = ra[e] | (rb ? static_cast<uint32_t>(rb[e]) << 16 : 0u);
  }
}

// NR rows × NV vectors of 16 columns of acc += Σ_{l2 < pairs} wp[r·half + l2] (a pair of
// weights, broadcast) times kp[l2·width + c] (a pair of key values per column).
template <int NR, int NV>
__attribute__((target("avx512f,avx512bf16"))) inline void DsKeysPairsBlock(const uint32_t* wp, int64_t half,
                                                                           int64_t pairs, const uint32_t* kp,
                                                                           int64_t width, float* acc) {
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_load_ps(acc + r * width + v * 16);
  for (int64_t l2 = 0; l2 < pairs; ++l2) {
    __m512bh k[NV];
    for (int v = 0; v < NV; ++v) k[v] = (__m512bh)_mm512_load_si512(kp + l2 * width + v * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[r * half + l2]));
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], x, k[v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(acc + r * width + v * 16, a[r][v]);
}

__attribute__((target("avx512f"))) void PackDsWeightPairs(const float* w, size_t mq, int64_t n, uint32_t* wp) {
  const int64_t half = static_cast<int64_t>(mq) / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t r = 0; r < n; ++r) {  // weight pairs per row: lanes 2·l2 (low half) and 2·l2 + 1
    for (int64_t l = 0; l < static_cast<int64_t>(mq); l += 32) {
      const __m512i a = _mm512_loadu_si512(w + r * static_cast<int64_t>(mq) + l);
      const __m512i b = _mm512_loadu_si512(w + r * static_cast<int64_t>(mq) + l + 16);
      // Lanes (2i, 2i + 1) of a then b: the even lanes' top halves low, the odd lanes' high.
      const __m512i idx_even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      const __m512i idx_odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
      const __m512i even = _mm512_permutex2var_epi32(a, idx_even, b), odd = _mm512_permutex2var_epi32(a, idx_odd, b);
      _mm512_storeu_si512(wp + r * half + l / 2,
                          _mm512_or_si512(_mm512_maskz_srli_epi32(kAll, even, 16), _mm512_and_si512(odd, high)));
    }
  }
}

__attribute__((target("avx512f,avx512bf16"))) void DsKeys(const float* w, size_t mq, int64_t n, int64_t nk,
                                                           const uint32_t* kp, int64_t width, uint32_t* wp, float* acc) {
  const int64_t pairs = (nk + 1) / 2, half = static_cast<int64_t>(mq) / 2;
  PackDsWeightPairs(w, mq, n, wp);
  constexpr int NR = 6, NV = 4;
  for (int64_t c = 0; c < width;) {
    const bool whole = c + NV * 16 <= width;
    int64_t r = 0;
    for (; r + NR <= n; r += NR) {
      whole ? DsKeysPairsBlock<NR, NV>(wp + r * half, half, pairs, kp + c, width, acc + r * width + c)
            : DsKeysPairsBlock<NR, 1>(wp + r * half, half, pairs, kp + c, width, acc + r * width + c);
    }
    for (; r < n; ++r) {
      whole ? DsKeysPairsBlock<1, NV>(wp + r * half, half, pairs, kp + c, width, acc + r * width + c)
            : DsKeysPairsBlock<1, 1>(wp + r * half, half, pairs, kp + c, width, acc + r * width + c);
    }
    c += whole ? NV * 16 : 16;
  }
}

}  // namespace

void Bf16DsKeys(const float* w, size_t mq, int64_t n, int64_t nk, const uint32_t* kp, int64_t width, uint32_t* wp,
                float* acc) {
  DsKeys(w, mq, n, nk, kp, width, wp, acc);
}

void PackBf16ValuePairs(const uint16_t* v, int64_t v_stride, int64_t n, int64_t dv, uint32_t* vp) {
  PackPairs(v, v_stride, n, dv, dv, vp);
}

void PackBf16KeyPairs(const uint16_t* k, int64_t k_stride, int64_t nk, int64_t dk, int64_t width, int64_t kp_pairs,
                      uint32_t* kp) {
  PackPairs(k, k_stride, nk, dk, width, kp);
  const int64_t pairs = (nk + 1) / 2;
  for (int64_t l2 = 0; l2 < pairs; ++l2) std::fill(kp + l2 * width + dk, kp + (l2 + 1) * width, 0u);
  std::fill(kp + pairs * width, kp + kp_pairs * width, 0u);
}

void PackBf16DsWeightPairs(const float* w, size_t mq, int64_t n, uint32_t* wp) { PackDsWeightPairs(w, mq, n, wp); }

void PackBf16WeightPairs(const float* p, size_t mq, int64_t first, int64_t n, uint32_t* pp) {
  PackWeightPairs(p, mq, first, n, pp);
}

void Bf16DotAccumulate(const float* p, size_t mq, int64_t first, int64_t n, const uint32_t* vp, int64_t dv,
                       const float* alpha, uint32_t* pp, float* ot) {
  PackWeightPairs(p, mq, first, n, pp);
  Bf16DotAccumulatePacked(pp, mq, first, n, vp, dv, alpha, ot);
}

void Bf16DotAccumulatePacked(const uint32_t* pp, size_t mq, int64_t first, int64_t n, const uint32_t* vp, int64_t dv,
                             const float* alpha, float* ot) {
  if (mq == 16) {
    AccumulatePacked<1>(pp, mq, first, n, vp, dv, alpha, ot);
  } else {
    AccumulatePacked<2>(pp, mq, first, n, vp, dv, alpha, ot);
  }
}

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
void PackBf16ValuePairs(const uint16_t*, int64_t, int64_t, int64_t, uint32_t*) {}
void PackBf16KeyPairs(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t*) {}
void PackBf16DsWeightPairs(const float*, size_t, int64_t, uint32_t*) {}
void PackBf16WeightPairs(const float*, size_t, int64_t, int64_t, uint32_t*) {}
void Bf16DsKeys(const float*, size_t, int64_t, int64_t, const uint32_t*, int64_t, uint32_t*, float*) {}
void Bf16DotAccumulate(const float*, size_t, int64_t, int64_t, const uint32_t*, int64_t, const float*, uint32_t*,
                       float*) {}
void Bf16DotAccumulatePacked(const uint32_t*, size_t, int64_t, int64_t, const uint32_t*, int64_t, const float*,
                             float*) {}

#endif

}  // namespace sdpa::internal
