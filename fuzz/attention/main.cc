// libFuzzer target for sdpa::attention, attention_backward, attention_varlen, attention_paged and
// KVCache (see README.md here: the byte format, the checks, how to add a mode). This file holds
// the entry points: the environment (KNOWN checks, skipped classes), the input's prefix bytes and
// the dispatch to a mode's runner (run_case, run_huge, run_varlen, run_paged, run_kvcache).
#include "harness.h"

namespace sdpa_fuzz {
namespace {

// ---------------------------------------------------------------------------------------------
// KNOWN: checks that fail today because of findings recorded in fuzz/FINDINGS.md, to be fixed
// in src/. A failing KNOWN check is counted (printed at exit) instead of aborting, so the
// fuzzer explores past it. SDPA_FUZZ_STRICT=1 in the environment makes every check fatal;
// SDPA_FUZZ_KNOWN="a,b" replaces the list. Empty the list once src/ is fixed.
// See FINDINGS.md (F1-F7) for each; fuzz/findings/ holds an input that reproduces it.
// F3 fixed; F6's near misses were the rules', which now carry the scores' rounding.
// KNOWN: F10 (open): on the bfloat16 dot-product path a NaN/inf/out-of-range value in a blocked
// key's k (or in q or dout of a row that attends nothing) moves its whole tile of keys or block
// of queries to the widening path, which changes other rows' bits (findings/poison_*_dot_path-1).
// F17 (resolved in 8fe379e: the header blocks a key whose kAfterBias argument is -inf in the
// compute type, and kReference rounds that argument to it) is checked by the edge-semantics
// checks as any -inf score (modified_score); its former KNOWN name cap_overflow is gone.
// kernel_path_stale (F20, fixed: src/varlen.cc's run_backward_sequences resets the thread's
// kernel path before each sequence's run_backward) was KNOWN while open: attention_varlen_backward
// with 2 threads and a sequence whose backward notes no path reported the path an earlier call left
// in an OpenMP worker's thread_local record. Its failures are plain `kernel_path` failures now
// (findings/kernel_path_stale-prelude, then findings/kernel_path_stale-naive, replay strict).
// F21 (fixed in 5522985: paged_problem checks the block mask against max_pages · page_size
// before it empties the rows view of a pool of no pages) was KNOWN as paged_blocks_no_pages while
// open: attention_paged with a pool of no pages and a table of max_pages > 0 columns checked
// Options::block_mask against Nk = 0 (findings/paged_blocks_no_pages-1 replays strict).
const char* const kKnownDefault = "poison_fwd_dot_path,poison_bwd_dot_path";
// KNOWN: input classes that would crash or hang (so a check cannot even report): generation
// of the classes listed is off (or, for bf16_dk0, changed). The names understood are
//   huge_mask       (f) an empty mask with a huge dim (validation must not walk it)
//   huge_reference  (f) kReference / kNaive with a huge empty Nk and lse requested
//   bf16_dk0        F11 (fixed): all-bfloat16 calls with Dk = 0 run capped at kSimd (on the
//                   dot-product path the forward's Scratch asked Highway for 0 bfloat16 pairs and
//                   hwy::AllocateAligned aborted the process: findings/bf16_dk0_scratch_abort-1);
//                   off by default since the fix (test KernelPaths.Bfloat16WithNoFeaturesRuns)
//   varlen_empty_view  F12 (fixed; off by default): attention_varlen(_backward) with an empty packed tensor (a
//                   head count or D of 0) whose view has null data or huge strides: varlen.cc's
//                   rows_of / cols_of compute data + r0 · stride on it, which UBSan reports
//                   (offset applied to a null pointer; the product may overflow int64).
//                   While listed, run_varlen gives empty tensors a 1-element buffer and stride 0
//                   (findings/varlen_empty_null_offset-1)
//   paged_misaligned_table  F13 (fixed; off by default): attention_paged with a block table
//                   whose data is not aligned to its dtype: the kernels read it as int32_t /
//                   int64_t (View4::page_of in src/problem.h), which UBSan reported (load of
//                   misaligned address). While listed, run_paged's tables are aligned
//                   (findings/paged_misaligned_table-1)
//   paged_empty_pool  F14 (fixed; off by default): attention_paged with a pool of no pages
//                   (num_pages = 0, an empty view: null data or any strides) and a table with
//                   columns that no sequence reads (every length 0): a valid call by the header,
//                   which threw "k has no data" or "k must have stride 1 in its last dim". While
//                   listed, run_paged's pools have at least one page when the table has columns
//                   (findings/paged_empty_pool-1)
//   paged_empty_pool_view  F15 (fixed; off by default): attention_paged with a pool that holds
//                   no element because its D is 0 (k_pages (num_pages, page_size, Hkv, 0): an
//                   empty view, null data, any strides) while sequences have keys: the kernels
//                   formed row addresses in it (View4::ptr, from ReadRows), an offset applied to a
//                   null pointer (UBSan), as F12 in varlen. While listed, run_paged gives empty
//                   pools a 1-element buffer and stride 0 (findings/paged_empty_pool_view-1)
// (F16, all-bfloat16 calls with Dk = 0 or Dv = 0 on the AMX path, had the class amx_d0 until
// its fix in 87159b8: such calls now run uncapped; findings/amx_d0_empty_rows-1 is its
// regression input. F18's blocks_unread_fallback (blocks_unread fenced the skipped tiles of tame
// inputs only, while the forward's overflow fallback read them) and F19's paged_blocks_empty (the
// packed paged call of 0 sequences was not checked for the block mask's Error) are gone with their
// fixes, as amx_d0: findings/blocks_unread_finish_block-1 and
// findings/paged_block_mask_no_sequences-1 are their regression inputs.)
// SDPA_FUZZ_SKIP="a,b" sets the list; SDPA_FUZZ_STRICT=1 empties it.
const char* const kSkipDefault = "";  // F11-F16, F18, F19 fixed
// ---------------------------------------------------------------------------------------------

std::set<std::string> split(const char* s) {
  std::set<std::string> r;
  std::string cur;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == '\0') {
      if (!cur.empty()) r.insert(cur);
      cur.clear();
      if (*p == '\0') break;
    } else if (*p != ' ') {
      cur += *p;
    }
  }
  return r;
}

void print_known_hits() {
  if (g_stats) {
    std::fprintf(stderr, "attention_fuzz: checks evaluated:");
    for (const auto& [k, n] : g_evaluated) std::fprintf(stderr, " %s=%llu", k.c_str(), static_cast<unsigned long long>(n));
    std::fprintf(stderr, "\n");
  }
  if (g_known_hits.empty()) return;
  std::fprintf(stderr, "attention_fuzz: KNOWN check failures seen (skipped):");
  for (const auto& [k, n] : g_known_hits) std::fprintf(stderr, " %s=%llu", k.c_str(), static_cast<unsigned long long>(n));
  std::fprintf(stderr, "\n");
}

}  // namespace
}  // namespace sdpa_fuzz

using namespace sdpa_fuzz;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const bool strict = std::getenv("SDPA_FUZZ_STRICT") && std::string(std::getenv("SDPA_FUZZ_STRICT")) == "1";
  const char* known = std::getenv("SDPA_FUZZ_KNOWN");
  const char* skip = std::getenv("SDPA_FUZZ_SKIP");
  g_known = strict ? std::set<std::string>{} : split(known ? known : kKnownDefault);
  g_skip = strict ? std::set<std::string>{} : split(skip ? skip : kSkipDefault);
  g_verbose = std::getenv("SDPA_FUZZ_VERBOSE") != nullptr;
  g_stats = std::getenv("SDPA_FUZZ_STATS") != nullptr;
  g_print = std::getenv("SDPA_FUZZ_PRINT") != nullptr;
  g_known_dir = std::getenv("SDPA_FUZZ_KNOWN_DIR");
  std::atexit(print_known_hits);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  g_data = data;
  g_size = size;
  // The ext prefix (README.md here): 16-bit storage, the kernel-path cap and the mode; after
  // kExtMagicFast every call in kFast.
  uint8_t ext = 0;
  g_precision = sdpa::Precision::kExact;
  const bool fast = size >= 3 && std::memcmp(data, kExtMagicFast, 2) == 0;
  if (size >= 3 && (fast || std::memcmp(data, kExtMagic, 2) == 0)) {
    if (fast) g_precision = sdpa::Precision::kFast;
    ext = data[2];
    data += 3;
    size -= 3;
  }
  // kExtBlocks: bm and bm_seed come first; bm says whether seqlens_k's and the modifiers' bytes follow.
  g_blocks = (ext & kExtModeBits) == kExtBlocks;
  g_bm = g_bm_seed = 0;
  if (g_blocks) {
    if (size >= 1) g_bm = data[0];
    if (size >= 2) g_bm_seed = data[1];
    const size_t n = std::min<size_t>(size, 2);
    data += n;
    size -= n;
  }
  g_varlen_blocks = g_blocks && bad_blocks_of(g_bm_seed) == BadBlocks::kVarlen;
  g_seqlens = g_blocks ? (g_bm & kBmSeqlens) != 0 : (ext & kExtSeqlens) != 0;
  g_varlen = ext & kExtVarlen;
  g_sk = g_sk_seed = 0;
  if (g_seqlens) {  // two more prefix bytes
    if (size >= 1) g_sk = data[0];
    if (size >= 2) g_sk_seed = data[1];
    const size_t n = std::min<size_t>(size, 2);
    data += n;
    size -= n;
  }
  g_mods = g_blocks ? (g_bm & kBmMods) != 0 : (ext & kExtModsMask) == kExtModifiers;
  g_md = g_md_seed = 0;
  if (g_mods) {  // two more prefix bytes (after sk, sk_seed)
    if (size >= 1) g_md = data[0];
    if (size >= 2) g_md_seed = data[1];
    const size_t n = std::min<size_t>(size, 2);
    data += n;
    size -= n;
  }
  g_storage = ext & 3;
  const int cap = (ext >> 2) & 3;
  g_path_cap = cap == 1 ? sdpa::KernelPath::kAvx512Bf16 : cap == 2 ? sdpa::KernelPath::kSimd : sdpa::KernelPath::kAmxBf16;
  sdpa::set_max_kernel_path(g_path_cap);
  FuzzedDataProvider f(data, size);
  const uint8_t mode = f.ConsumeIntegral<uint8_t>();
  g_mode = mode;
  const bool avx2 = mode & 0x40;
  g_avx2 = avx2;
#if HWY_ARCH_X86
  if (avx2) hwy::DisableTargets(HWY_AVX2 - 1);  // as tests/test_util.cc's Avx2Only
#endif
  try {
    if (g_varlen || g_varlen_blocks) {
      run_varlen(f);
    } else if ((ext & kExtModeBits) == kExtPaged) {
      run_paged(f);
    } else if ((ext & kExtModeBits) == kExtKVCache) {
      run_kvcache(f);
    } else if (mode < 12) {
      run_huge(f);
    } else {
      run_case(f);
    }
  } catch (const CheckFailed&) {
  }
#if HWY_ARCH_X86
  if (avx2) hwy::DisableTargets(0);
#endif
  sdpa::set_max_kernel_path(sdpa::KernelPath::kAmxBf16);  // the default: no cap
  sdpa::set_num_threads(0);
  return 0;
}
