// The instruction path a call used, recorded for last_kernel_path() (sdpa/attention.h), and a
// thread's own override of the thread count.
#pragma once

#include "sdpa/attention.h"

namespace sdpa::internal {

// Records the path of the calling thread's current attention() call (called once per call,
// on the caller's thread, before any parallel region).
void note_kernel_path(KernelPath path);

// While alive, num_threads() on the constructing thread returns n (> 0): for a kernel call
// made from inside a parallel region, one problem per thread (attention_varlen_backward).
class ScopedThreadCount {
 public:
  explicit ScopedThreadCount(int n);
  ~ScopedThreadCount();
  ScopedThreadCount(const ScopedThreadCount&) = delete;
  ScopedThreadCount& operator=(const ScopedThreadCount&) = delete;

 private:
  int before_;
};

}  // namespace sdpa::internal
