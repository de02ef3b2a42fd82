// Process-wide settings of the kernels: the thread count every kernel uses (OpenMP's,
// OMP_NUM_THREADS, unless set explicitly) and the cap on the instruction paths.
#include <atomic>

#include "kernel_path.h"

#include "sdpa/attention.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sdpa {
namespace {
std::atomic<int> g_threads{0};  // 0 = OpenMP's default
std::atomic<KernelPath> g_max_path{KernelPath::kAmxBf16};
thread_local KernelPath t_last_path = KernelPath::kSimd;
thread_local int t_threads = 0;  // > 0: this thread's calls use this many (ScopedThreadCount)
}  // namespace

void set_max_kernel_path(KernelPath max) {
  if (max != KernelPath::kSimd && max != KernelPath::kAvx512Bf16 && max != KernelPath::kAmxBf16) {
    throw Error("set_max_kernel_path: unknown path " + std::to_string(static_cast<int>(max)));
  }
  g_max_path.store(max);
}
KernelPath max_kernel_path() { return g_max_path.load(); }
KernelPath last_kernel_path() { return t_last_path; }

namespace internal {
void note_kernel_path(KernelPath path) { t_last_path = path; }
ScopedThreadCount::ScopedThreadCount(int n) : before_(t_threads) { t_threads = n; }
ScopedThreadCount::~ScopedThreadCount() { t_threads = before_; }
}  // namespace internal

void set_num_threads(int n) {
  if (n < 0) throw Error("set_num_threads: n must be >= 0 (0 = OpenMP's default), got " + std::to_string(n));
  g_threads.store(n);
}

int num_threads() {
  if (t_threads > 0) return t_threads;
  const int n = g_threads.load();
  if (n > 0) return n;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace sdpa
