// Peak and bandwidth probes, compiled per SIMD target like the kernels (Highway dispatch).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "machine.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <chrono>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "machine.h"
#include "huge_pages.h"  // src/

HWY_BEFORE_NAMESPACE();
namespace sdpa::bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Runs `iters` rounds of kChains independent FMAs per thread; returns flops done.
double FmaFlops(int threads, int64_t iters) {
  constexpr int kChains = 12;  // > FMA latency × units, so the chains never wait
  const hn::ScalableTag<float> d;
  double sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    hn::Vec<decltype(d)> acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(d, 1.0f + c * 1e-3f);
    const auto a = hn::Set(d, 0.999999f), b = hn::Set(d, 1e-7f);
    for (int64_t i = 0; i < iters; ++i) {
      for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], a, b);
    }
    for (int c = 1; c < kChains; ++c) acc[0] = hn::Add(acc[0], acc[c]);
    sink += hn::GetLane(acc[0]);
  }
  volatile double keep = sink;
  (void)keep;
  return 2.0 * kChains * hn::Lanes(d) * static_cast<double>(iters) * threads;
}

// Sums `n` floats split across threads; returns the sum so nothing is optimised away.
double ReadAll(const float* data, size_t n, int threads) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  double total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
  for (int64_t t = 0; t < threads; ++t) {
    const size_t begin = n / threads * t / N * N, end = t + 1 == threads ? n / N * N : n / threads * (t + 1) / N * N;
    auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
    size_t i = begin;
    for (; i + 4 * N <= end; i += 4 * N) {
      s0 = hn::Add(s0, hn::LoadU(d, data + i));
      s1 = hn::Add(s1, hn::LoadU(d, data + i + N));
      s2 = hn::Add(s2, hn::LoadU(d, data + i + 2 * N));
      s3 = hn::Add(s3, hn::LoadU(d, data + i + 3 * N));
    }
    for (; i + N <= end; i += N) s0 = hn::Add(s0, hn::LoadU(d, data + i));
    total += hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  }
  return total;
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace sdpa::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sdpa::bench {
HWY_EXPORT(FmaFlops);
HWY_EXPORT(ReadAll);
HWY_EXPORT(TargetName);

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

double measure_fma_peak_gflops(int threads) {
  // Rounds per run: doubled from 2^16 until a run takes 0.1 s (2^24 rounds, as the fixed
  // 2·10^7 before, on a 2-thread AVX-512 VM, where 20 ms runs read ~10 % lower). In a sanitizer
  // build each round's accumulators go through checked stack slots, 140x slower (0.8 GFLOP/s):
  // the fixed rounds made this probe most of a `sdpa bench` test's 52 s (CI's ASan stage).
  int64_t iters = int64_t{1} << 16;
  double flops = 0, seconds = 0;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    flops = HWY_DYNAMIC_DISPATCH(FmaFlops)(threads, iters);
    seconds = seconds_since(t0);
    if (seconds >= 0.1 || iters >= (int64_t{1} << 30)) break;
    iters *= 2;
  }
  double best = flops / seconds / 1e9;
  for (int rep = 1; rep < 5; ++rep) {  // best of 5: the peak is what the machine can reach
    const auto t0 = std::chrono::steady_clock::now();
    const double f = HWY_DYNAMIC_DISPATCH(FmaFlops)(threads, iters);
    best = std::max(best, f / seconds_since(t0) / 1e9);
  }
  return best;
}

double measure_read_bandwidth_gbs(int threads, size_t bytes) {
  const size_t n = bytes / sizeof(float);
  auto data = hwy::AllocateAligned<float>(n);
  sdpa::internal::advise_huge_pages(data.get(), n * sizeof(float));  // as the cases' K and V (cases.cc)
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) data[i] = 1.0f;  // first touch by the readers
  double best = 0;
  for (int rep = 0; rep < 7; ++rep) {  // best of 7, like STREAM: on a shared VM runs vary ×2
    const auto t0 = std::chrono::steady_clock::now();
    volatile double sum = HWY_DYNAMIC_DISPATCH(ReadAll)(data.get(), n, threads);
    (void)sum;
    best = std::max(best, static_cast<double>(bytes) / seconds_since(t0) / 1e9);
  }
  return best;
}

std::string simd_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

// HWY_AVX2 - 1: every target bit above AVX2 (AVX3, AVX3_DL and any later AVX-512 flavour), as
// the tests' Avx2Only and sdpa._core._limit_simd_to_avx2 do.
void disable_avx512() { hwy::DisableTargets(HWY_AVX2 - 1); }

}  // namespace sdpa::bench
#endif
