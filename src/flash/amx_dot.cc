// AMX score tiles (bf16_dot.h's Bf16DotScores with amx = true): the same layout and the same
// range rules as the vdpbf16ps path, with the products in tile registers.
//
// One 16-key block at a time: C (16 keys × 16 lanes of float32, one tile per 16 lanes of the
// block's queries) += A (16 keys × 32 features of k, read in place) · B (16 pairs of features ×
// 16 lanes: qp's rows), 32 features per TDPBF16PS. The last features of a row (dk mod 32, odd dk
// included) and the last keys of a tile (n mod 16) are copied into zero-padded rows first, so
// every key goes through the same instructions in the same order: a score's bits depend on its
// q and k rows only, never on the blocking, the tile or the thread.
//
// Numerics: TDPBF16PS rounds like vdpbf16ps (exact products, float32 sums, subnormal inputs read
// as 0, subnormal results flushed) but adds each pair of products before the float32 sum, so its
// bits are not vdpbf16ps's; the error bound is the same (bf16_dot.h's range rules make flushing
// impossible).
#include <algorithm>
#include <cstring>
#include <vector>

#include "flash/bf16_dot.h"

#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define SDPA_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SDPA_HAVE_AMX 0
#endif

namespace sdpa::internal {

#if SDPA_HAVE_AMX
namespace {

bool detect() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0x60000u) != 0x60000u) return false;  // XTILECFG and XTILEDATA enabled by the OS
  // Linux hands out the tile data state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA),
  // once per process; without it the first tile instruction faults.
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

// LDTILECFG's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kKeys = 16, kDepth = 32;  // keys per C tile; features per A tile

// Tiles: 0, 1 C (lanes 0-15, 16-31); 2 A; 3, 4 B (lanes 0-15, 16-31); 5 A of the last features
// (tail_pairs pairs); 6, 7 its B.
TileConfig make_config(int64_t tail_pairs) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  if (tail_pairs > 0) {
    c.rows[5] = 16;
    c.colsb[5] = static_cast<uint16_t>(4 * tail_pairs);
    for (int t = 6; t < 8; ++t) {
      c.rows[t] = static_cast<uint8_t>(tail_pairs);
      c.colsb[t] = 64;
    }
  }
  return c;
}

// One block of 16 keys: rows at k (row r at k + r·ks elements, the full chunks read in place),
// their last features in tail (16 rows of kDepth, zero past dk). C left in tiles 0 (and 1).
template <bool kTwo>
__attribute__((target("amx-tile,amx-bf16"))) inline void Block(const uint32_t* qp, size_t mq, int64_t chunks,
                                                              bool has_tail, const uint16_t* k, int64_t ks,
                                                              const uint16_t* tail) {
  const int64_t qstride = static_cast<int64_t>(mq) * 4;
  _tile_zero(0);
  if constexpr (kTwo) _tile_zero(1);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* b = qp + c * (kDepth / 2) * static_cast<int64_t>(mq);
    _tile_loadd(2, k + c * kDepth, ks * 2);
    _tile_loadd(3, b, qstride);
    _tile_dpbf16ps(0, 2, 3);
    if constexpr (kTwo) {
      _tile_loadd(4, b + 16, qstride);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  if (has_tail) {
    const uint32_t* b = qp + chunks * (kDepth / 2) * static_cast<int64_t>(mq);
    _tile_loadd(5, tail, kDepth * 2);
    _tile_loadd(6, b, qstride);
    _tile_dpbf16ps(0, 5, 6);
    if constexpr (kTwo) {
      _tile_loadd(7, b + 16, qstride);
      _tile_dpbf16ps(1, 5, 7);
    }
  }
}

// rows[0 .. n·mq) *= scale, 16 floats at a time (mq is a multiple of 16), while they are in L1.
__attribute__((target("avx512f"))) inline void Scale(float* rows, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t x = 0; x < n; x += 16) _mm512_storeu_ps(rows + x, _mm512_mul_ps(_mm512_loadu_ps(rows + x), s));
}

template <bool kTwo>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void Tile(const uint32_t* qp, size_t mq, int64_t dk, const uint16_t* k,
                                                      int64_t ks, int64_t n, float scale, float* st) {
  const int64_t chunks = dk / kDepth, tail_features = dk % kDepth, tail_pairs = (tail_features + 1) / 2;
  const TileConfig config = make_config(tail_pairs);
  // Zero-padded copies: the last features of a block's rows, and whole rows of a last partial
  // block (then read with the padded row length).
  const int64_t padded = (chunks + (tail_pairs > 0)) * kDepth;
  thread_local std::vector<uint16_t> tail, rows;
  thread_local std::vector<float> c_rows;
  tail.assign(kKeys * kDepth, 0);
  c_rows.resize(kKeys * mq);
  _tile_loadconfig(&config);
  for (int64_t j = 0; j < n; j += kKeys) {
    const int64_t count = std::min(kKeys, n - j);
    const uint16_t* block = k + j * ks;
    int64_t stride = ks;
    if (count < kKeys) {
      rows.assign(kKeys * padded, 0);
      // (dk = 0: nothing to copy, and rows and block may hold no element: fuzz finding F16.)
      for (int64_t r = 0; r < count && dk > 0; ++r) std::memcpy(rows.data() + r * padded, block + r * ks, dk * sizeof(uint16_t));
      block = rows.data();
      stride = padded;
    }
    if (tail_pairs > 0) {
      for (int64_t r = 0; r < count; ++r) {
        std::memcpy(&tail[r * kDepth], block + r * stride + chunks * kDepth, tail_features * sizeof(uint16_t));
      }
    }
    Block<kTwo>(qp, mq, chunks, tail_pairs > 0, block, stride, tail.data());
    float* out = count == kKeys ? st + j * static_cast<int64_t>(mq) : c_rows.data();
    _tile_stored(0, out, static_cast<int64_t>(mq) * 4);
    if constexpr (kTwo) _tile_stored(1, out + 16, static_cast<int64_t>(mq) * 4);
    Scale(out, count * static_cast<int64_t>(mq), scale);
    if (count < kKeys) std::memcpy(st + j * static_cast<int64_t>(mq), out, count * mq * sizeof(float));
  }
  _tile_release();
}

}  // namespace

bool cpu_has_amx_bf16() {
  static const bool has = detect();
  return has;
}

void AmxDotScores(const uint32_t* qp, size_t mq, int64_t dk, const uint16_t* k, int64_t k_stride, int64_t n,
                  float scale, float* st) {
  if (mq == 16) {
    Tile<false>(qp, mq, dk, k, k_stride, n, scale, st);
  } else {
    Tile<true>(qp, mq, dk, k, k_stride, n, scale, st);
  }
}

#else  // not x86-64 Linux, or a compiler without the intrinsics: never available

bool cpu_has_amx_bf16() { return false; }
void AmxDotScores(const uint32_t*, size_t, int64_t, const uint16_t*, int64_t, int64_t, float, float*) {}

#endif

}  // namespace sdpa::internal
