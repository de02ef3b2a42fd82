// The thread count every kernel uses: OpenMP's (OMP_NUM_THREADS) unless set explicitly.
#include <atomic>

#include "sdpa/attention.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sdpa {
namespace {
std::atomic<int> g_threads{0};  // 0 = OpenMP's default
}

void set_num_threads(int n) {
  if (n < 0) throw Error("set_num_threads: n must be >= 0 (0 = OpenMP's default), got " + std::to_string(n));
  g_threads.store(n);
}

int num_threads() {
  const int n = g_threads.load();
  if (n > 0) return n;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace sdpa
