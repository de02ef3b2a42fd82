// The BLAS loader (blas.h says why it is loaded at run time).
#include "layer/blas.h"

#include <dlfcn.h>
#include <hwy/targets.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "sdpa/attention.h"

namespace sdpa::internal {
namespace {

// CBLAS's enum values (cblas.h): fixed by the CBLAS standard.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
using DgemmFn = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int, double,
                         double*, int);
using SetThreadsFn = void (*)(int);
using NameFn = char* (*)();

struct Blas {
  SgemmFn sgemm = nullptr;
  DgemmFn dgemm = nullptr;
  SetThreadsFn set_threads = nullptr;
  std::string description, error;
};

// OpenBLAS's name for the kernels of the best SIMD target Highway finds on this CPU.
const char* core_type() {
  const int64_t targets = hwy::SupportedTargets();
  if (targets & (HWY_AVX3 | HWY_AVX3_DL)) return "SkylakeX";
  if (targets & HWY_AVX2) return "Haswell";
  return nullptr;
}

void load(Blas& blas) {
  const char* chosen = std::getenv("SDPA_BLAS");
  const char* name = chosen && *chosen ? chosen : "libopenblas.so.0";
  const char* user_core = std::getenv("OPENBLAS_CORETYPE");
  const char* core = user_core ? nullptr : core_type();
#ifdef _OPENMP
  // OpenBLAS built for OpenMP sets the calling thread's OpenMP thread count in
  // openblas_set_num_threads; sdpa's kernels read that count (num_threads()), so it is put back.
  const int omp_threads = omp_get_max_threads();
#endif
  if (core) setenv("OPENBLAS_CORETYPE", core, 0);
  void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  const char* why = lib ? nullptr : dlerror();
  if (core) unsetenv("OPENBLAS_CORETYPE");
  if (!lib) {
    blas.error = std::string("the multi-head layer's matrix products need OpenBLAS (apt-get install "
                             "libopenblas0-openmp) or a CBLAS library named by SDPA_BLAS; loading ") +
                 name + " failed: " + (why ? why : "unknown error");
    return;
  }
  blas.sgemm = reinterpret_cast<SgemmFn>(dlsym(lib, "cblas_sgemm"));
  blas.dgemm = reinterpret_cast<DgemmFn>(dlsym(lib, "cblas_dgemm"));
  blas.set_threads = reinterpret_cast<SetThreadsFn>(dlsym(lib, "openblas_set_num_threads"));
  if (!blas.sgemm || !blas.dgemm) {
    blas.error = std::string(name) + " has no cblas_sgemm / cblas_dgemm";
    return;
  }
  // One thread inside the library: sdpa runs its tiles on its own threads (gemm below).
  if (blas.set_threads) blas.set_threads(1);
#ifdef _OPENMP
  omp_set_num_threads(omp_threads);
#endif
  blas.description = name;
  if (auto config = reinterpret_cast<NameFn>(dlsym(lib, "openblas_get_config"))) blas.description = config();
  if (auto corename = reinterpret_cast<NameFn>(dlsym(lib, "openblas_get_corename"))) {
    blas.description += std::string(" (core ") + corename() + (user_core ? ", from OPENBLAS_CORETYPE)" : ")");
  }
}

Blas& blas() {
  static Blas b;
  static std::once_flag once;
  std::call_once(once, [] { load(b); });
  if (!b.error.empty()) throw Error(b.error);
  return b;
}

int as_int(int64_t x) {
  if (x < 0 || x > INT_MAX) throw Error("gemm: dimension " + std::to_string(x) + " is outside BLAS's int range");
  return static_cast<int>(x);
}

// C in tiles of at most kTile × kTile, one single-threaded BLAS call each, on sdpa's threads.
// The tiles depend on the shape alone, so every element of C is summed the same way for any
// thread count (OpenBLAS's own threading is not: a 128 × 128 × 600 product gave other bits
// on 2 threads than on 1, as its single-threaded small-matrix kernels sum differently).
// 256: at 4096 × 512 × 512 the tiles run at the speed of OpenBLAS's own two threads
// (docs/PERFORMANCE.md).
constexpr int64_t kTile = 256;

// Runs fn(t) for t in [0, tiles) on up to sdpa::num_threads() threads.
template <typename Fn>
void for_tiles(int64_t tiles, Fn fn) {
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), tiles));
#pragma omp parallel for num_threads(threads) schedule(dynamic)
  for (int64_t t = 0; t < tiles; ++t) fn(t);
}

template <typename T, typename Fn>
void tiled(Fn fn, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
           T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const int at = ta ? kTrans : kNoTrans, bt = tb ? kTrans : kNoTrans;
  const int64_t tn = (N + kTile - 1) / kTile;
  const int ia = as_int(lda), ib = as_int(ldb), ic = as_int(ldc), ik = as_int(K);
  (void)as_int(M);
  (void)as_int(N);
  for_tiles((M + kTile - 1) / kTile * tn, [&](int64_t t) {
    const int64_t i0 = t / tn * kTile, j0 = t % tn * kTile;
    const int m = static_cast<int>(std::min(kTile, M - i0)), n = static_cast<int>(std::min(kTile, N - j0));
    const T* a = ta ? A + i0 : A + i0 * lda;  // A is K × M when transposed: the tile's columns
    const T* b = tb ? B + j0 * ldb : B + j0;
    fn(kRowMajor, at, bt, m, n, ik, T(1), a, ia, b, ib, beta, C + i0 * ldc + j0, ic);
  });
}

// The product in head-major tiles: rows of one batch entry (at most kTile) times one head's D
// columns, written to that head's contiguous (N, D) block.
template <typename T, typename Fn>
void tiled_heads(Fn fn, bool ta, bool tb, int64_t batches, int64_t N, int64_t H, int64_t D, int64_t K, const T* A,
                 int64_t lda, const T* B, int64_t ldb, T* C) {
  if (batches == 0 || N == 0 || H == 0 || D == 0) return;
  const int at = ta ? kTrans : kNoTrans, bt = tb ? kTrans : kNoTrans;
  const int64_t tm = (N + kTile - 1) / kTile;
  const int ia = as_int(lda), ib = as_int(ldb), ik = as_int(K), id = as_int(D);
  (void)as_int(batches * N);
  for_tiles(batches * tm * H, [&](int64_t t) {
    const int64_t h = t % H, i0 = t / H % tm * kTile, b = t / H / tm, r0 = b * N + i0;
    const int m = static_cast<int>(std::min(kTile, N - i0));
    const T* a = ta ? A + r0 : A + r0 * lda;
    const T* bp = tb ? B + h * D * ldb : B + h * D;
    fn(kRowMajor, at, bt, m, id, ik, T(1), a, ia, bp, ib, T(0), C + ((b * H + h) * N + i0) * D, id);
  });
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  tiled<float>(blas().sgemm, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
          int64_t ldb, double beta, double* C, int64_t ldc) {
  tiled<double>(blas().dgemm, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void gemm_heads(bool trans_a, bool trans_b, int64_t batches, int64_t N, int64_t H, int64_t D, int64_t K,
                const float* A, int64_t lda, const float* B, int64_t ldb, float* C) {
  tiled_heads<float>(blas().sgemm, trans_a, trans_b, batches, N, H, D, K, A, lda, B, ldb, C);
}

void gemm_heads(bool trans_a, bool trans_b, int64_t batches, int64_t N, int64_t H, int64_t D, int64_t K,
                const double* A, int64_t lda, const double* B, int64_t ldb, double* C) {
  tiled_heads<double>(blas().dgemm, trans_a, trans_b, batches, N, H, D, K, A, lda, B, ldb, C);
}

std::string blas_description() { return blas().description; }

}  // namespace sdpa::internal
