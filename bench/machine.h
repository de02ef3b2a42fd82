// What this machine can do, measured in the same process as the benchmarks it puts in
// context: the FMA peak (GFLOP/s) and the memory read bandwidth (GB/s).
#pragma once

#include <string>

namespace sdpa::bench {

// f32 FMA throughput of the best SIMD target on `threads` threads, in GFLOP/s (2 flops per
// FMA lane): independent accumulator chains, so only the FMA units limit it.
double measure_fma_peak_gflops(int threads);

// Read bandwidth streaming `bytes` (far larger than the caches) on `threads` threads, GB/s:
// the best of several runs, what the machine can reach (as the FMA peak is).
double measure_read_bandwidth_gbs(int threads, size_t bytes = size_t{1} << 30);

// The SIMD target the kernels dispatch to on this CPU, e.g. "AVX2" or "AVX3".
std::string simd_target();

// Stops dispatch to AVX-512 targets for the rest of the process (kernels and probes alike),
// to measure what a CPU without AVX-512 gets. Call before the first kernel runs.
void disable_avx512();

}  // namespace sdpa::bench
