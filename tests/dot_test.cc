// The bfloat16 dot-product kernels (src/flash/bf16_dot.h): Bf16DotScores (vdpbf16ps) and
// AmxDotScores (AMX tiles) against float64 sums of the same bfloat16 values, on every size
// class of the tiles (keys 1, 15, 16, 17, 97; depths 1, 2, 31, 32, 33, 64, 127; 16 and 32
// lanes), key rows with padded, negative and odd strides; and the bits of a key's score
// independent of the keys around it (the blocking), which the kernels' thread-count
// determinism rests on. Skipped where the CPU lacks the instructions (the sweeps check the
// kernels that use them, through the public API, on every path the machine has).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "flash/bf16_dot.h"
#include "storage.h"

namespace {

using sdpa::internal::AmxDotScores;
using sdpa::internal::Bf16DotScores;

using DotFn = void (*)(const uint32_t*, size_t, int64_t, const uint16_t*, int64_t, int64_t, float, float*);

uint16_t to_bf16(float x) { return sdpa::internal::f32_to_bf16(x); }
double from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Kernel {
  const char* name;
  DotFn fn;
  bool available;
  friend void PrintTo(const Kernel& k, std::ostream* os) { *os << k.name; }
};

std::vector<Kernel> kernels() {
  return {{"vdpbf16ps", Bf16DotScores, sdpa::internal::cpu_has_avx512_bf16()},
          {"amx", AmxDotScores, sdpa::internal::cpu_has_amx_bf16()}};
}

// 64-byte aligned float32 / uint32 buffers, as the kernels require for qp and st.
template <typename T>
struct Aligned {
  explicit Aligned(size_t n) : data(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    std::memset(data, 0, (n * sizeof(T) + 63) / 64 * 64);
  }
  ~Aligned() { std::free(data); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  T* data;
};

// One problem: n keys of depth dk (row j at keys + base + j·stride), mq lanes of queries.
struct DotCase {
  int64_t n, dk;
  size_t mq;
  int64_t stride;  // elements between key rows; negative walks backwards
  std::vector<uint16_t> keys;
  int64_t base;                   // element of key 0
  std::vector<uint16_t> queries;  // mq × dk
  Aligned<uint32_t> pairs;

  DotCase(int64_t n_, int64_t dk_, size_t mq_, int64_t stride_, std::mt19937& rng)
      : n(n_), dk(dk_), mq(mq_), stride(stride_), pairs(std::max<int64_t>(1, (dk_ + 1) / 2) * mq_) {
    std::normal_distribution<float> normal;
    const int64_t span = (n - 1) * std::abs(stride) + dk;
    keys.resize(static_cast<size_t>(std::max<int64_t>(span, 1)));
    for (auto& x : keys) x = to_bf16(normal(rng));
    base = stride < 0 ? (n - 1) * -stride : 0;
    queries.resize(mq * dk);
    for (auto& x : queries) x = to_bf16(normal(rng));
    for (int64_t c = 0; c < dk; ++c) {
      for (size_t l = 0; l < mq; ++l) pairs.data[c / 2 * mq + l] |= uint32_t{queries[l * dk + c]} << (16 * (c % 2));
    }
  }
  const uint16_t* key(int64_t j) const { return keys.data() + base + j * stride; }
};

class DotKernels : public testing::TestWithParam<Kernel> {};

TEST_P(DotKernels, MatchFloat64WithinTheSummationBound) {
  const Kernel k = GetParam();
  if (!k.available) GTEST_SKIP() << k.name << " is not available on this CPU";
  std::mt19937 rng(7);
  const float scale = 0.125f;
  for (int64_t n : {1, 15, 16, 17, 97}) {
    for (int64_t dk : {1, 2, 31, 32, 33, 64, 127}) {
      for (size_t mq : {16, 32}) {
        for (int64_t extra : {0, 3}) {
          for (int sign : {1, -1}) {
            const int64_t stride = sign * (dk + extra);
            SCOPED_TRACE(testing::Message() << k.name << " n " << n << " dk " << dk << " mq " << mq << " stride " << stride);
            const DotCase c(n, dk, mq, stride, rng);
            Aligned<float> st(n * mq);
            k.fn(c.pairs.data, mq, dk, c.key(0), stride, n, scale, st.data);
            // A float32 sum of dk exact products is within dk·u·Σ|a·b| of the exact sum (u =
            // 2^-24), and the scale adds one rounding of the result.
            int64_t bad = 0;
            for (int64_t j = 0; j < n; ++j) {
              for (size_t l = 0; l < mq; ++l) {
                double exact = 0, magnitude = 0;
                for (int64_t e = 0; e < dk; ++e) {
                  const double p = from_bf16(c.key(j)[e]) * from_bf16(c.queries[l * dk + e]);
                  exact += p;
                  magnitude += std::fabs(p);
                }
                const double bound = (dk * magnitude + std::fabs(exact)) * 0x1p-24 * scale;
                bad += std::fabs(st.data[j * mq + l] - exact * scale) > bound;
              }
            }
            EXPECT_EQ(bad, 0);
          }
        }
      }
    }
  }
}

// A key's scores have the same bits whether it is computed alone or among 97 keys, and with
// 16 or 32 lanes: what the tiles around it are never changes it.
TEST_P(DotKernels, AKeysScoreDoesNotDependOnTheBlocking) {
  const Kernel k = GetParam();
  if (!k.available) GTEST_SKIP() << k.name << " is not available on this CPU";
  std::mt19937 rng(11);
  for (int64_t dk : {1, 33, 64, 127}) {
    SCOPED_TRACE(testing::Message() << k.name << " dk " << dk);
    const int64_t n = 97;
    const DotCase c(n, dk, 32, -dk, rng);
    Aligned<float> all(n * 32), one(32), narrow(16);
    k.fn(c.pairs.data, 32, dk, c.key(0), c.stride, n, 1.0f, all.data);
    // The first 16 lanes as their own block of queries (qp rows of 16).
    Aligned<uint32_t> pairs16((dk + 1) / 2 * 16);
    for (int64_t p = 0; p < (dk + 1) / 2; ++p) std::memcpy(pairs16.data + p * 16, c.pairs.data + p * 32, 64);
    for (int64_t j = 0; j < n; ++j) {
      k.fn(c.pairs.data, 32, dk, c.key(j), c.stride, 1, 1.0f, one.data);
      EXPECT_EQ(std::memcmp(one.data, all.data + j * 32, 32 * sizeof(float)), 0) << "key " << j;
      k.fn(pairs16.data, 16, dk, c.key(j), c.stride, 1, 1.0f, narrow.data);
      EXPECT_EQ(std::memcmp(narrow.data, all.data + j * 32, 16 * sizeof(float)), 0) << "key " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, DotKernels, testing::ValuesIn(kernels()),
                         [](const testing::TestParamInfo<Kernel>& info) { return std::string(info.param.name); });

// kFast's p·V products, Bf16DotAccumulate (vdpbf16ps, values packed by PackBf16ValuePairs) and
// AmxDotAccumulate (AMX tiles, values packed by PackAmxValuePairs), against float64: ot = alpha
// · ot + Σ_j p_j · v_j over keys [first, first + n) of a tile, p bfloat16 weights in [0, 1]
// held in float32. Every size class: first 0, 1 and 5 (an odd first splits a key pair), n up
// to the tile's 128 keys, dv 1 … 127 (tiles of 16 columns and their tails), 16 and 32 lanes,
// value rows padded or negative-strided; and rows from 131 and 200 of a longer run packed whole
// (the backward's HeadPairs: AMX columns `pitch` words apart). Bound: a float32 sum of n + 1 terms (the rescaled
// accumulator and n exact products), (n + 2)·u·Σ|term|, u = 2^-24.
TEST(DotAccumulate, MatchFloat64WithinTheSummationBound) {
  struct Path {
    const char* name;
    bool amx;
    bool available;
  };
  const Path paths[] = {{"vdpbf16ps", false, sdpa::internal::cpu_has_avx512_bf16()},
                        {"amx", true, sdpa::internal::cpu_has_amx_bf16()}};
  std::mt19937 rng(13);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  int ran = 0;
  for (const Path& path : paths) {
    if (!path.available) continue;
    for (int64_t first : {0, 1, 5, 131, 200}) {
      for (int64_t n : {1, 2, 15, 16, 17, 33, 97, 123}) {
        if (first < 128 && first + n > 128) continue;
        for (int64_t dv : {1, 15, 16, 17, 33, 64, 127}) {
          for (size_t mq : {16, 32}) {
            for (int64_t stride : {dv, -(dv + 3)}) {
              SCOPED_TRACE(testing::Message() << path.name << " first " << first << " n " << n << " dv " << dv
                                              << " mq " << mq << " stride " << stride);
              const int64_t rows = first + n, span = (rows - 1) * std::abs(stride) + dv;
              std::vector<uint16_t> values(static_cast<size_t>(span));
              for (auto& x : values) x = to_bf16(normal(rng));
              const uint16_t* v0 = values.data() + (stride < 0 ? (rows - 1) * -stride : 0);
              Aligned<float> p(n * mq), alpha(mq), ot(dv * mq), before(dv * mq);
              for (int64_t i = 0; i < n * static_cast<int64_t>(mq); ++i) p.data[i] = static_cast<float>(from_bf16(to_bf16(unit(rng))));
              for (size_t l = 0; l < mq; ++l) alpha.data[l] = unit(rng);
              for (int64_t i = 0; i < dv * static_cast<int64_t>(mq); ++i) before.data[i] = ot.data[i] = normal(rng);
              const int64_t pitch = rows > 128 ? ((rows + 1) / 2 + 15) / 16 * 16 + 16 : sdpa::internal::kAmxPairsRow;
              Aligned<uint32_t> vp(((std::max<int64_t>(rows, 128)) + 1) / 2 * dv), vt((dv + 15) / 16 * 16 * pitch),
                  pp(sdpa::internal::kAmxPairsRow * mq);
              if (path.amx) {
                sdpa::internal::PackAmxValuePairs(v0, stride, rows, dv, vp.data, vt.data, pitch);
                sdpa::internal::AmxDotAccumulate(p.data, mq, first, n, vt.data, dv, alpha.data, pp.data, ot.data, pitch);
              } else {
                sdpa::internal::PackBf16ValuePairs(v0, stride, rows, dv, vp.data);
                sdpa::internal::Bf16DotAccumulate(p.data, mq, first, n, vp.data, dv, alpha.data, pp.data, ot.data);
              }
              int64_t bad = 0;
              for (int64_t e = 0; e < dv; ++e) {
                for (size_t l = 0; l < mq; ++l) {
                  const double scaled = static_cast<double>(alpha.data[l]) * before.data[e * mq + l];
                  double exact = scaled, magnitude = std::fabs(scaled);
                  for (int64_t j = 0; j < n; ++j) {
                    const double term = static_cast<double>(p.data[j * mq + l]) * from_bf16(v0[(first + j) * stride + e]);
                    exact += term;
                    magnitude += std::fabs(term);
                  }
                  bad += std::fabs(ot.data[e * mq + l] - exact) > (n + 2) * magnitude * 0x1p-24;
                }
              }
              EXPECT_EQ(bad, 0);
              ++ran;
            }
          }
        }
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no bfloat16 dot-product instruction on this CPU";
}

}  // namespace
