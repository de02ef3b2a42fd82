// Row-major matrix products through a real BLAS (OpenBLAS), loaded at first use.
//
// Why loaded, not linked: OpenBLAS picks its kernels by the CPU's model number when it loads,
// and Debian 12's 0.3.21 does not know the CPUs this project runs on (an Emerald Rapids Xeon,
// model 0xCF, gets the generic "Prescott" kernels: 26 GFLOP/s for a 4096×512×512 sgemm on 2
// threads, against 235-260 with its SkylakeX or Cooperlake kernels; docs/PERFORMANCE.md). Its
// only way to choose is the OPENBLAS_CORETYPE environment variable, read while it loads, so
// sdpa sets it from the SIMD target Highway finds (AVX-512: SkylakeX, AVX2: Haswell) unless
// the user set it, loads the library, and restores the environment.
//   SDPA_BLAS   path or name of the library to load instead of libopenblas.so.0 (any CBLAS
//               with OpenBLAS's openblas_set_num_threads, or without it: one thread count)
//
// Only float32 and float64 products: a bfloat16 or float16 layer widens its operands to float32
// (exactly) and calls sgemm. OpenBLAS has a bfloat16 GEMM (cblas_sbgemm, from 0.3.10 on builds
// made with BUILD_BFLOAT16=1), but Debian 12's libopenblas.so.0 (0.3.21) exports no sbgemm
// symbol (nm -D), so a path through it could not be built or tested against the library this
// project loads; the layer does not look for one.
#pragma once

#include <cstdint>
#include <string>

namespace sdpa::internal {

// C = op(A) · op(B) + beta · C, row-major, op(X) = Xᵀ when the flag is set: A is M × K (K × M
// transposed) with row stride lda, B is K × N (N × K) with ldb, C is M × N with ldc. Runs on
// sdpa::num_threads() threads. Throws Error when no BLAS can be loaded.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
          int64_t ldb, double beta, double* C, int64_t ldc);

// The same product with C's columns split into H heads of D, stored head-major: C's row
// b·N + i, column h·D + d at C[((b·H + h)·N + i)·D + d] (the (B, H, N, D) layout the kernel
// reads fastest: docs/PERFORMANCE.md). beta = 0.
void gemm_heads(bool trans_a, bool trans_b, int64_t batches, int64_t N, int64_t H, int64_t D, int64_t K,
                const float* A, int64_t lda, const float* B, int64_t ldb, float* C);
void gemm_heads(bool trans_a, bool trans_b, int64_t batches, int64_t N, int64_t H, int64_t D, int64_t K,
                const double* A, int64_t lda, const double* B, int64_t ldb, double* C);

// "OpenBLAS 0.3.21 ... (core SkylakeX)", for benchmarks and error messages; loads the library.
std::string blas_description();

}  // namespace sdpa::internal
