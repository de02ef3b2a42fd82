// Transparent huge pages for the large buffers the kernels stream (a KVCache's pools).
//
// Why: a decode step reads every row of a long cache once, and with 4 KiB pages each page of
// rows costs a TLB miss and a page walk. On the AMX Xeon (2 threads, `sdpa bench --filter
// "paged decode 32 seqs page 16"`, 2026-11-29) the same binary decoded 15-25 % faster with the
// system's THP mode set to "always" than with Debian's default, "madvise", under which a
// buffer gets huge pages only if asked (PERFORMANCE.md, "Huge pages"). NumPy asks for its
// arrays of 4 MiB and more; std::vector and PyTorch's allocator (without THP_MEM_ALLOC_ENABLE)
// do not, so sdpa asks for the buffers it allocates itself.
#pragma once

#include <cstddef>
#include <vector>

namespace sdpa::internal {

// Below this a buffer holds at most one whole 2 MiB huge page: not worth asking (NumPy's
// threshold too).
inline constexpr size_t kHugePagesFrom = size_t{4} << 20;

// Asks the OS to back [p, p + bytes) with transparent huge pages when it is first touched
// (Linux madvise(MADV_HUGEPAGE) over the whole 4 KiB pages inside it). A hint: a no-op on
// other systems, for buffers under kHugePagesFrom, and where the OS refuses.
void advise_huge_pages(void* p, size_t bytes);

// v.resize(n) (new elements value-initialised, i.e. zeroed for arithmetic types), advising
// huge pages for the storage before the zeroing first touches it. For an empty v.
template <typename T>
void resize_with_huge_pages(std::vector<T>& v, size_t n) {
  v.reserve(n);
  advise_huge_pages(v.data(), n * sizeof(T));
  v.resize(n);
}

}  // namespace sdpa::internal
