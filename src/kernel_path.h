// The instruction path a call used, recorded for last_kernel_path() (sdpa/attention.h).
#pragma once

#include "sdpa/attention.h"

namespace sdpa::internal {

// Records the path of the calling thread's current attention() call (called once per call,
// on the caller's thread, before any parallel region).
void note_kernel_path(KernelPath path);

}  // namespace sdpa::internal
