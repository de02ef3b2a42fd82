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

// Tiles of the scores: 0, 1 C (lanes 0-15, 16-31); 2 A; 3, 4 B (lanes 0-15, 16-31); 5 A of the
// last features (tail_pairs pairs); 6, 7 its B (without a tail, BlockPair's second block: 5 A,
// 6, 7 C). Of p·V: 0-3 C, 4-5 A, 6-7 B. Without a tail every
// tile is 16 rows of 64 bytes, one configuration for both products.
TileConfig make_config(int64_t tail_pairs) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  if (tail_pairs > 0) {
    c.colsb[5] = static_cast<uint16_t>(4 * tail_pairs);
    for (int t = 6; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(tail_pairs);
  }
  return c;
}

// The configuration this thread has loaded (its tail_pairs; -1: none) and whether an AmxScope
// is open on it (then the products leave the tiles configured for the next one).
thread_local int64_t g_loaded = -1;
thread_local int g_scopes = 0;

__attribute__((target("amx-tile"))) void configure(int64_t tail_pairs) {
  if (g_loaded == tail_pairs) return;
  const TileConfig config = make_config(tail_pairs);
  _tile_loadconfig(&config);
  g_loaded = tail_pairs;
}

__attribute__((target("amx-tile"))) void release() {
  if (g_loaded >= 0) _tile_release();
  g_loaded = -1;
}

// After a product: the tiles are released unless a scope keeps them.
void done() {
  if (g_scopes == 0) release();
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

// Two blocks of 16 keys at once, the second at k + 16·ks (both whole, no tail features), 32
// lanes: C tiles 0, 1 (the first block's lanes 0-15, 16-31) and 6, 7 (the second's), A tiles 2
// and 5, B tiles 3 and 4 loaded once per chunk for both. Four independent sums in flight where
// Block<true> has two, each tile load serving two products; every C element sums its chunks in
// the same order as Block's, so the scores' bits are Block's.
__attribute__((target("amx-tile,amx-bf16"))) inline void BlockPair(const uint32_t* qp, size_t mq, int64_t chunks,
                                                                  const uint16_t* k, int64_t ks) {
  const int64_t qstride = static_cast<int64_t>(mq) * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* b = qp + c * (kDepth / 2) * static_cast<int64_t>(mq);
    _tile_loadd(2, k + c * kDepth, ks * 2);
    _tile_loadd(3, b, qstride);
    _tile_loadd(4, b + 16, qstride);
    _tile_loadd(5, k + kKeys * ks + c * kDepth, ks * 2);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
    _tile_dpbf16ps(6, 5, 3);
    _tile_dpbf16ps(7, 5, 4);
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
  // Zero-padded copies: the last features of a block's rows, and whole rows of a last partial
  // block (then read with the padded row length).
  const int64_t padded = (chunks + (tail_pairs > 0)) * kDepth;
  thread_local std::vector<uint16_t> tail, rows;
  thread_local std::vector<float> c_rows;
  tail.assign(kKeys * kDepth, 0);
  c_rows.resize(kKeys * mq);
  configure(tail_pairs);
  int64_t j = 0;
  if constexpr (kTwo) {
    for (; tail_pairs == 0 && j + 2 * kKeys <= n; j += 2 * kKeys) {
      BlockPair(qp, mq, chunks, k + j * ks, ks);
      float* out = st + j * static_cast<int64_t>(mq);
      const int64_t ld = static_cast<int64_t>(mq) * 4;
      _tile_stored(0, out, ld);
      _tile_stored(1, out + 16, ld);
      _tile_stored(6, out + kKeys * static_cast<int64_t>(mq), ld);
      _tile_stored(7, out + kKeys * static_cast<int64_t>(mq) + 16, ld);
      Scale(out, 2 * kKeys * static_cast<int64_t>(mq), scale);
    }
  }
  for (; j < n; j += kKeys) {
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
  done();
}

// Every lane: the masked forms, whose unmasked ones g++ 12 warns about (as bf16_dot.cc).
constexpr __mmask16 kAll = 0xffff;
constexpr __mmask8 kAll8 = 0xff;

// 16 rows of 16 words (row r at in[r], zero where null; words past `valid` zero) transposed
// into out[c·out_stride + r]: the unpack / shuffle network, 64 permutes.
__attribute__((target("avx512f"))) inline void Transpose16(const uint32_t* const* in, __mmask16 valid, uint32_t* out,
                                                           int64_t out_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = in[i] ? _mm512_maskz_loadu_epi32(valid, in[i]) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {  // lane L of t[i]: (r_i, r_i+1) of columns 4L, 4L+1; t[i+1]: 4L+2, 4L+3
    t[i] = _mm512_maskz_unpacklo_epi32(kAll, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_epi32(kAll, r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane L of r[i + k]: rows i .. i+3 of column 4L + k
    r[i] = _mm512_maskz_unpacklo_epi64(kAll8, t[i], t[i + 2]);
    r[i + 1] = _mm512_maskz_unpackhi_epi64(kAll8, t[i], t[i + 2]);
    r[i + 2] = _mm512_maskz_unpacklo_epi64(kAll8, t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_maskz_unpackhi_epi64(kAll8, t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {  // t[h + k]: columns k, k + 8; t[h + 4 + k]: 4 + k, 12 + k (rows h .. h+7)
    for (int k = 0; k < 4; ++k) {
      t[h + k] = _mm512_maskz_shuffle_i32x4(kAll, r[h + k], r[h + 4 + k], 0x88);
      t[h + 4 + k] = _mm512_maskz_shuffle_i32x4(kAll, r[h + k], r[h + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {  // columns k and k + 8 from rows 0-7 (t[k]) and 8-15 (t[8 + k])
    _mm512_storeu_si512(out + k * out_stride, _mm512_maskz_shuffle_i32x4(kAll, t[k], t[8 + k], 0x88));
    _mm512_storeu_si512(out + (k + 8) * out_stride, _mm512_maskz_shuffle_i32x4(kAll, t[k], t[8 + k], 0xdd));
  }
}

// Rows in groups of 128 (vp holds one group's pairs), each group's pairs from column word r0 / 2.
__attribute__((target("avx512f"))) void PackTransposed(const uint16_t* v, int64_t vs, int64_t n, int64_t dv,
                                                        int64_t pitch, uint32_t* vp, uint32_t* vt) {
  const int64_t rows = (dv + 15) / 16 * 16;
  int64_t written = 0;  // words of every column written so far
  for (int64_t r0 = 0; r0 < n; r0 += 128) {
    const int64_t m = std::min<int64_t>(128, n - r0), at = r0 / 2;
    PackBf16ValuePairs(v + r0 * vs, vs, m, dv, vp);  // vp[j2·dv + e]
    const int64_t pairs = (m + 1) / 2, filled = (pairs + 15) / 16 * 16;
    for (int64_t e = 0; e < rows; e += 16) {
      const __mmask16 valid = static_cast<__mmask16>(dv - e >= 16 ? 0xffff : (1u << (dv - e)) - 1);
      for (int64_t j2 = 0; j2 < filled; j2 += 16) {
        const uint32_t* in[16];
        for (int r = 0; r < 16; ++r) in[r] = j2 + r < pairs ? vp + (j2 + r) * dv + e : nullptr;
        Transpose16(in, valid, vt + e * pitch + at + j2, pitch);
      }
    }
    written = at + filled;
  }
  for (int64_t e = 0; e < rows; ++e) std::fill(vt + e * pitch + written, vt + (e + 1) * pitch, 0u);
}

// C tiles 0..3 = value columns e0 .. e0+15 and (two) e0+16 .. e0+31, lanes 0-15 and (QV 2) 16-31,
// summed over `chunks` of 16 key pairs and over the `parts` weight pairs (part k at pp + k ·
// part_words); then ot rows e = alpha · ot + C for e < dv.
template <int QV, bool kTwo>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) inline void AccumulateColumns(const uint32_t* pp, int parts,
                                                                                int64_t part_words, size_t mq,
                                                                                int64_t chunks, const uint32_t* vt,
                                                                                int64_t pitch, int64_t e0, int64_t dv,
                                                                                const __m512* alpha, float* ot) {
  const int64_t bstride = static_cast<int64_t>(mq) * 4, astride = pitch * 4;
  _tile_zero(0);
  if constexpr (QV == 2) _tile_zero(1);
  if constexpr (kTwo) _tile_zero(2);
  if constexpr (kTwo && QV == 2) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, vt + e0 * pitch + c * 16, astride);
    if constexpr (kTwo) _tile_loadd(5, vt + (e0 + 16) * pitch + c * 16, astride);
    for (int part = 0; part < parts; ++part) {
      const uint32_t* b = pp + part * part_words + c * 16 * static_cast<int64_t>(mq);
      _tile_loadd(6, b, bstride);
      if constexpr (QV == 2) _tile_loadd(7, b + 16, bstride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (QV == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (kTwo) {
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (QV == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  alignas(64) float buf[2][16 * 32];
  const int64_t ld = static_cast<int64_t>(mq) * 4;
  _tile_stored(0, buf[0], ld);
  if constexpr (QV == 2) _tile_stored(1, buf[0] + 16, ld);
  if constexpr (kTwo) _tile_stored(2, buf[1], ld);
  if constexpr (kTwo && QV == 2) _tile_stored(3, buf[1] + 16, ld);
  const int64_t end = std::min(dv, e0 + (kTwo ? 32 : 16));
  for (int64_t e = e0; e < end; ++e) {
    const float* sum = buf[(e - e0) / 16] + (e - e0) % 16 * static_cast<int64_t>(mq);
    for (int v = 0; v < QV; ++v) {
      float* o = ot + e * static_cast<int64_t>(mq) + v * 16;
      _mm512_store_ps(o, _mm512_fmadd_ps(alpha[v], _mm512_load_ps(o), _mm512_load_ps(sum + v * 16)));
    }
  }
}

// AccumulateColumns over every column of the tile, from weight pairs already packed (parts of
// them, part_words apart); zeros written past each part's pairs up to whole chunks.
template <int QV>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void AccumulatePacked(uint32_t* pp, int parts, int64_t part_words,
                                                                    size_t mq, int64_t first, int64_t n,
                                                                    const uint32_t* vt, int64_t pitch, int64_t dv,
                                                                    const float* alpha, float* ot) {
  const int64_t j2_0 = first / 2, pairs = (first + n + 1) / 2 - j2_0, chunks = (pairs + 15) / 16;
  for (int part = 0; part < parts; ++part) {
    uint32_t* at = pp + part * part_words;
    std::fill(at + pairs * static_cast<int64_t>(mq), at + chunks * 16 * static_cast<int64_t>(mq), 0u);
  }
  __m512 al[QV];
  for (int v = 0; v < QV; ++v) al[v] = _mm512_load_ps(alpha + v * 16);
  configure(0);
  const uint32_t* from = vt + j2_0;  // the A tiles start at the block's first pair
  int64_t e = 0;
  for (; e + 16 < dv; e += 32) AccumulateColumns<QV, true>(pp, parts, part_words, mq, chunks, from, pitch, e, dv, al, ot);
  if (e < dv) AccumulateColumns<QV, false>(pp, parts, part_words, mq, chunks, from, pitch, e, dv, al, ot);
  done();
}

// One 16-column tile of DsKeysTiles: C (tile kC, 0 to 2) = acc's 16 rows × columns c0 .. c0 + 15 (through
// pad when the block has fewer rows), += A (tile 4: the rows' weight pairs) · B (tile kB: the
// 16 key pairs of those columns: tile kC + 5).
template <int kC>
__attribute__((target("amx-tile,amx-bf16"))) inline void DsKeysColumns(const uint32_t* kp, int64_t width, int64_t c0,
                                                                      float* acc, int64_t rows, float* pad) {
  float* c = acc + c0;
  int64_t ld = width * 4;
  if (rows < 16) {
    for (int64_t r = 0; r < 16; ++r) {
      for (int64_t x = 0; x < 16; ++x) pad[r * 16 + x] = r < rows ? acc[r * width + c0 + x] : 0.0f;
    }
    c = pad;
    ld = 64;
  }
  // (The tile intrinsics take register numbers as literals.)
#define SDPA_DS_KEYS_PRODUCT(C, B)          \
  _tile_loadd(C, c, ld);                    \
  _tile_loadd(B, kp + c0, width * 4);       \
  _tile_dpbf16ps(C, 4, B);                  \
  _tile_stored(C, c, ld)
  if constexpr (kC == 0) {
    SDPA_DS_KEYS_PRODUCT(0, 5);
  } else if constexpr (kC == 1) {
    SDPA_DS_KEYS_PRODUCT(1, 6);
  } else {
    SDPA_DS_KEYS_PRODUCT(2, 7);
  }
#undef SDPA_DS_KEYS_PRODUCT
  if (rows < 16) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(acc + r * width + c0, pad + r * 16, 16 * sizeof(float));
  }
}

// Bf16DsKeys on tiles, for mq = 32 (all 32 key lanes one A tile of 16 pairs): kp as the caller
// packed it (its 16 pairs, zero past nk), wp as Bf16DsKeys packs it (PackBf16DsWeightPairs) with
// its rows past n, up to a multiple of 16, zero; then per block of 16 rows the A tile loaded once
// and the columns taken 16 at a time in three C/B tile slots, so that three products are in flight.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void DsKeysTiles(const float* w, int64_t n, const uint32_t* kp,
                                                                      int64_t width, uint32_t* wp, float* acc) {
  constexpr int64_t kHalf = 16;
  PackBf16DsWeightPairs(w, 2 * kHalf, n, wp);
  const int64_t blocks = (n + 15) / 16;
  std::fill(wp + n * kHalf, wp + blocks * 16 * kHalf, 0u);
  alignas(64) float pad[3][16 * 16];
  configure(0);
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n - r0);
    float* a = acc + r0 * width;
    _tile_loadd(4, wp + r0 * kHalf, kHalf * 4);
    int64_t c0 = 0;
    for (; c0 + 48 <= width; c0 += 48) {
      DsKeysColumns<0>(kp, width, c0, a, rows, pad[0]);
      DsKeysColumns<1>(kp, width, c0 + 16, a, rows, pad[1]);
      DsKeysColumns<2>(kp, width, c0 + 32, a, rows, pad[2]);
    }
    if (c0 < width) DsKeysColumns<0>(kp, width, c0, a, rows, pad[0]);
    if (c0 + 16 < width) DsKeysColumns<1>(kp, width, c0 + 16, a, rows, pad[1]);
  }
  done();
}

}  // namespace

bool cpu_has_amx_bf16() {
  static const bool has = detect();
  return has;
}

AmxScope::AmxScope(bool on) : on_(on && cpu_has_amx_bf16()) {
  if (on_) ++g_scopes;
}

AmxScope::~AmxScope() {
  if (on_ && --g_scopes == 0) release();
}

void PackAmxValuePairs(const uint16_t* v, int64_t v_stride, int64_t n, int64_t dv, uint32_t* vp, uint32_t* vt,
                       int64_t pitch) {
  PackTransposed(v, v_stride, n, dv, pitch, vp, vt);
}

void AmxDotAccumulate(const float* p, size_t mq, int64_t first, int64_t n, const uint32_t* vt, int64_t dv,
                      const float* alpha, uint32_t* pp, float* ot, int64_t pitch) {
  PackBf16WeightPairs(p, mq, first, n, pp);
  AmxDotAccumulatePacked(pp, 1, 0, mq, first, n, vt, dv, alpha, ot, pitch);
}

void AmxDotAccumulatePacked(uint32_t* pp, int parts, int64_t part_words, size_t mq, int64_t first, int64_t n,
                            const uint32_t* vt, int64_t dv, const float* alpha, float* ot, int64_t pitch) {
  if (mq == 16) {
    AccumulatePacked<1>(pp, parts, part_words, mq, first, n, vt, pitch, dv, alpha, ot);
  } else {
    AccumulatePacked<2>(pp, parts, part_words, mq, first, n, vt, pitch, dv, alpha, ot);
  }
}

void AmxDsKeys(const float* w, size_t mq, int64_t n, int64_t nk, const uint32_t* kp, int64_t width, uint32_t* wp,
               float* acc) {
  if (mq == 32) {
    DsKeysTiles(w, n, kp, width, wp, acc);
  } else {
    Bf16DsKeys(w, mq, n, nk, kp, width, wp, acc);
  }
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
void AmxDsKeys(const float*, size_t, int64_t, int64_t, const uint32_t*, int64_t, uint32_t*, float*) {}
AmxScope::AmxScope(bool) : on_(false) {}
AmxScope::~AmxScope() = default;
void PackAmxValuePairs(const uint16_t*, int64_t, int64_t, int64_t, uint32_t*, uint32_t*, int64_t) {}
void AmxDotAccumulate(const float*, size_t, int64_t, int64_t, const uint32_t*, int64_t, const float*, uint32_t*,
                      float*, int64_t) {}
void AmxDotAccumulatePacked(uint32_t*, int, int64_t, size_t, int64_t, int64_t, const uint32_t*, int64_t, const float*,
                            float*, int64_t) {}

#endif

}  // namespace sdpa::internal
