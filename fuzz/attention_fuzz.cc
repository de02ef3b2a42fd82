// libFuzzer target for sdpa::attention and sdpa::attention_backward (see README.md here).
//
// The input bytes are decoded (FuzzedDataProvider) into one call the public API allows: rank
// 2..4, shapes with 0 and 1 and lane-relative sizes, Nq != Nk, Dv != Dk, GQA, long key runs
// (key chunking), strided / padded / permuted / negative-stride / zero-stride (broadcast)
// views at misaligned addresses, float32 / float64 / bfloat16 / float16 (q, k, v of one dtype,
// or float32 q over a bfloat16 or float16 k, v), bool or float masks (float32 or q's dtype) with
// NumPy broadcasting, causal, windows, scale, dropout, weights and lse, the backend, the SIMD
// targets (all, or capped at AVX2), the instruction path (sdpa::set_max_kernel_path: kSimd,
// kAvx512Bf16 or no cap), 1 or 2 threads, forward and backward; sometimes an
// invalid argument; sometimes empty views with huge other dims. Values come from a PRNG seeded
// by the input, plus special values (0, ±inf, NaN, huge, tiny; per storage dtype: float16's
// 65504 and subnormals, bfloat16's values just outside the dot-product path's range) planted
// where the input says.
//
// Where the input's bytes go: FuzzedDataProvider reads integers from the END of the input, so
// the last byte is `mode` (below 12: the huge-empty class; bit 0x40: SIMD capped at AVX2) and
// the byte before it `flags` (bit 1 float64, 2 backward, 4 two threads, 16 fancy layouts, 32 not
// tame). An input that STARTS with the two bytes kExtMagic (b6 16) has a third byte `ext` (the
// decoder reads the rest as before): bits 0-1 the storage (0: float32 / float64 as before; 1: q,
// k, v all bfloat16, or float16 where flags picks float64; 2: float32 q over bfloat16 / float16
// k, v; 3: as 1 with a float32 mask instead of q's dtype), bits 2-3 the kernel-path cap (1:
// kAvx512Bf16, 2: kSimd, 0 and 3: none). Inputs without the prefix (every corpus file and
// finding written before 16-bit dtypes were fuzzed) decode exactly as they did.
// ext bit 4 (0x10): the call gets Inputs::seqlens_k; the two bytes after ext, `sk` and `sk_seed`,
// say how (decode_seqlens: how lengths in [0, Nk] are drawn, int32 or int64, stride 1 / 2 / -1 / 0,
// misalignment, and sometimes an invalid one). ext bit 5 (0x20): the input is an
// attention_varlen call (+ attention_varlen_backward) instead, decoded by run_varlen. ext bits
// 4-7 exactly 0x40 (ext & 0xf0 == 0x40): an attention_paged call (run_paged: B sequences of
// lengths at page edges, page_size 1 to 256, shuffled and shared pages, int32 / int64 block tables
// with any row stride and entries past a sequence's pages out of range, pools token-major,
// head-major or any layout, unread rows NaN, and sometimes an invalid table or pool); exactly 0x80:
// a KVCache script (run_kvcache: new_sequence / append / attention / free on up to 3 sequences, a
// full pool, unknown ids). Bits 6-7 of every ext byte written before were 0 or came with bit 4 or
// 5 (seed53: 0x5f, a dense call with seqlens_k), so those inputs decode as they did.
// ext bits 5-7 exactly 0b110 (ext 0xc0-0xdf: kExtModifiers): a dense call (with seqlens_k where
// bit 4 is set too) whose Options carry score modifiers: two more prefix bytes `md`, `md_seed`
// (after sk, sk_seed) pick a softcap (0.5-60, or an extreme one) in either SoftcapOrder, ALiBi slopes
// (Hq,), (B, Hq) or (1, Hq), sinks (Hq,) (float32 / float64, any strides), Gradients::dsinks on
// backward calls, or an invalid modifier (decode_modifiers). Every check above then follows the
// header's modified scores: classify applies the cap (±inf -> ±cap before the bias; after it +inf
// -> cap, and an argument that is -inf in the compute type, x + alibi + bias past float32's range
// included, blocks the key: F17, resolved by the header), ALiBi (aligned bottom-right to L) and
// the bias; masked_row wants lse = the head's sink where there are sinks, and finite_row's lse
// includes the sink; score_magnitude adds |alibi| (as tests/test_util.cc); and dsinks is checked for guards,
// unwritten, repeatable, seqlens_unread, the tolerance rule (its terms summed over B·Nq rows) and
// poison_bwd (a poisoned q, k or v never changes it; a poisoned dout only its head's). An invalid
// modifier (softcap < 0 / NaN / inf / not held by the compute type, an unknown order, slopes or
// sinks of the wrong shape, rank, dtype, a non-finite value or null data, dsinks without sinks or
// of the wrong dtype, shape or stride 0) goes through error_expected and error_untouched for
// attention, validate and attention_backward. (run_huge, mode < 12, ignores the modifiers.)
// ext bits 4-7 exactly 0x90 (ext 0x90-0x9f: kExtBlocks): a dense call with Options::block_mask.
// Two more prefix bytes `bm`, `bm_seed` follow ext (then sk, sk_seed where bm bit 6 asks for
// seqlens_k, then md, md_seed where bm bit 7 asks for score modifiers): block_q, block_k (1-5, a
// menu up to 129 and sizes relative to Nq / Nk, multiples of 128 that skip whole key tiles, or
// anything up to INT64_MAX), the mask's leading dims (none, (Hq, ..), (B, 1, ..), any mix of B / Hq
// and 1), its density (random, sparse with all-false block rows, all true, or per (b, h) a
// block-causal, band, global, all-false or checkerboard pattern), any nonzero byte as true, any
// layout (block_layout: permuted, padded, negative, last stride 2-3, a stride-0 dim, misaligned),
// or an invalid one (decode_block_mask; BadBlocks). Every check above then follows the header's
// rule: row i and key j lie in block (i / block_q, j / block_k) of the (b, h) the leading dims
// broadcast to, and a false block blocks the key on top of every other mask, exactly as a bool
// mask's 0 (mask_bias: -inf there), so blocked_weight, masked_row (lse -inf, or the sink, for a
// row the block mask empties), poison_*, masked_grad, the tolerance rules and the rest see it; and
//   block_equiv       out, weights, lse (forward) and dq, dk, dv, dsinks (backward) equal bit for
//                     bit (NaN = NaN) those of the same call with the equivalent element mask
//                     (expanded_mask: (B, Hq, Nq, Nk), bool, or the float mask's dtype with its
//                     biases and -inf where a block is false) and no block mask (the header)
//   blocks_unread     kFlash / kAuto forward: garbage (NaN, ±inf, random bits) in every k, v
//                     element only key tiles [128 t, 128 t + 128) use that the block mask blocks
//                     for every row of every query head of the kv head (unread_tiles) changes no
//                     bit; in ASan builds those bytes are poisoned during the call, so a read of a
//                     tile the header says is skipped unread is an ASan report (tame or not: F18,
//                     the overflow fallback's read of such tiles, is fixed)
// An invalid block mask (dtype not bool, a last dim ± 1, a leading dim neither 1 nor B / Hq, rank
// 0, 1 or above q's, block_q or block_k < 1, null data) goes through error_expected and
// error_untouched for attention, validate and attention_backward, and error_names: the Error names
// block_mask (block_q, block_k). BadBlocks::kVarlen makes the input an attention_varlen call
// (run_varlen) with a block mask for packed sequences (run_varlen_blocks): bool, (..,
// ceil(max_b Nq_b / block_q), ceil(max_b Nk_b / block_k)), leading dims broadcasting to
// (sequences, Hq); sequence b reads the top-left (ceil(Nq_b / block_q), ceil(Nk_b / block_k))
// blocks of its row. Two more input bytes pick a valid mask (make_block_mask's sizes, densities,
// leading dims (QB, KB), (Hq | 1, ..), (S | 1, Hq | 1, ..), any layout) or an invalid one (QB or
// KB ± 1, a leading dim neither 1 nor S / Hq, dtype, rank 0 or 1, the packed totals' blocks, null
// data, the other call's KB); the same sequences also run as a packed attention_paged call (cu_seqlens_q;
// pools of one-row pages over the packed k, v; a table with 0 or 1-130 unread columns past the
// longest sequence, so that its Nk_b = max_pages · page_size gives another KB). Valid:
//   varlen_blocks_equiv  attention_varlen's out, lse (attention_varlen_backward's dq, dk, dv) of
//                     sequence b equal bit for bit (NaN = NaN) those of attention()
//                     (attention_backward()) on views of the sequence's rows of the packed tensors
//                     with its corner of the mask (a view of it or a copy) and the same options
//                     (with dropout: as batch entry b, forward; b = 0 only, backward)
//   paged_blocks_equiv  the packed attention_paged call's out, lse of sequence b equal bit for bit
//                     those of the unpacked attention_paged call with q = its rows (1, Hq, Nq_b, Dk),
//                     table row b, seqlens_k {Nk_b} and its corner (ceil(Nq_b / block_q),
//                     ceil(max_pages / block_k)) (with dropout: batch entry b of rows 0..b)
// besides unexpected_error (named paged_blocks_no_pages for the paged calls over a pool of no
// pages: F21, fixed), guards, unwritten, repeatable, kernel_path and lse_inf_backward on the
// packed calls. Invalid: attention_varlen, attention_varlen_backward and the packed
// attention_paged throw an Error that writes nothing (error_expected, error_untouched) and names
// block_mask, and for a shape that does not broadcast "the longest sequence's" lengths
// (error_names); with no sequence too (F19). (run_huge, mode < 12, ignores the block mask.)
//
// Checks (each has a name; a failure prints the case and aborts, unless the check is listed
// as KNOWN below, which records it and goes on):
//   error_untouched   an sdpa::Error leaves every byte of every output buffer unchanged
//   error_expected    an argument the API forbids throws sdpa::Error
//   unexpected_error  a valid call does not throw
//   other_exception   only sdpa::Error is thrown
//   guards            nothing is written outside the outputs' elements (padding, gaps)
//   unwritten         every output element is written (no sentinel left)
//   repeatable        two identical calls, with 1 and with 2 threads, are bitwise equal
//   tolerance         tame inputs: kFlash/kAuto match kReference by the project's rule
//   bwd_tolerance     the same for the gradients (tests/backward_util.cc's rule); a non-finite
//                     gradient there is "bwd_nonfinite", a miss within 4x "..._near"
//   blocked_weight    (a) a key causal, window or the mask blocks has weight 0
//   masked_row        (b) a row with no allowed key, or only -inf scores: out 0, weights 0, lse -inf
//   nan_row           (b) a NaN score on an allowed key: out, weights, lse of the row NaN
//   inf_row           (b) +inf scores: weight 1/count on each, 0 elsewhere, lse +inf
//   finite_row        (b, c) finite scores: -inf keys weight 0, finite lse, out finite unless a
//                     key of nonzero weight (and kept by dropout) has a non-finite v
//   poison_fwd        (a, c) NaN/inf/huge planted in k or v of a blocked (for v: or dropped)
//                     key, or in q of a row with no allowed key: the row's results unchanged
//   poison_bwd        (e) the same for the gradients (and dout of a row with no allowed key)
//   poison_fwd_dot_path, poison_bwd_dot_path
//                     a poison_fwd / poison_bwd failure of an all-bfloat16 call on the AVX512_BF16
//                     (or AMX) path that goes away when the same two calls are capped at kSimd:
//                     the poison only moved a tile of keys (or a block of queries) off the
//                     dot-product path, whose range check reads every value of the tile
//   masked_grad       (e) rows with no allowed key have dq = 0, keys no row allows dk = dv = 0
//   scale_range       (d) scale not finite or not representable in the compute type: Error
//   lse_inf_backward  (e) attention_backward with +inf in lse: Error
//   empty_fast        (f) calls on empty views with huge other dims return quickly
//   empty_lse         (f) ... and lse = log(number of allowed keys) + bias when Dk = 0
//   kernel_path       sdpa::last_kernel_path() after a call: no better than the cap, available
//                     on this CPU (with the SIMD targets not disabled), kSimd unless q, k and v
//                     are all bfloat16 (a varlen backward with 2 threads and a sequence that notes
//                     no path too: F20, fixed; its KNOWN name kernel_path_stale is gone)
// Stats mode (the mode byte's bits 0xa0 both set, kModeStats; valid dense calls, every ext mode that makes
// one: seqlens_k, modifiers, block masks; no input byte is read for it): one more call with every
// Outputs::stats field (top k of 0-32, pooled_weights of G 0 to 2 Nk + 3) and Outputs::scores at
// one ScoresStage, and the same call on kReference (check_stats, which says more):
//   stats_invariant   out, weights, lse unchanged by asking for statistics and scores
//   stats_self        max_weight, top-k weights bit for bit the weights at argmax / the top-k
//                     keys; pooled_weights the weights summed in key order (kFlash: bit for bit)
//   stats_rows        allowed exactly; NaN rows, rows with no key above -inf and +inf rows as the
//                     header says (from classify's classes, for each backend's arithmetic)
//   stats_rank        argmax, top-k indices: ranked by score, never a key above another by more
//                     than their scores' rounding bounds, equal scores to the lower key, -1 past
//                     the allowed keys
//   stats_tolerance   (tame) the real-valued statistics against kReference by the tolerance rule
//   scores            every score at its stage in the oracle's class and within its bound
// With seqlens_k (ext bit 4) every check above uses the header's rule: batch entry b has keys
// 0 .. L - 1 (L = seqlens_k[b]) and causal / window align to L, so keys past L count as blocked
// (blocked_weight, masked_row, poison_*, masked_grad: dk = dv = 0 there); invalid values
// (negative, > Nk, shape (B + 1,) or (B - 1,), rank, dtype, null) go through error_expected and
// error_untouched for attention, validate and attention_backward; and
//   seqlens_unread    the same forward (and backward) with garbage (NaN, ±inf, huge, random
//                     bits) in every k, v element only keys past their length use gives the same
//                     bits; in ASan builds those bytes are also poisoned (ASAN_POISON_MEMORY_REGION)
//                     during the call, so a read of one is a use-after-poison report
// attention_varlen (ext bit 5): repeatable, guards, unwritten, kernel_path, lse_inf_backward,
// error_expected / error_untouched (cu_seqlens not starting at 0, decreasing, negative, last
// != total, wrong dtype / rank / count / null; out, lse, k, q, dq, dout, dv wrong), and
//   varlen_dense      each sequence's out and lse (and dq, dk, dv) equal bit for bit attention()
//                     (attention_backward) on contiguous copies of its rows with the same options;
//                     with dropout, sequence b against batch entry b of a dense (b + 1, ...) call
//                     (the draws the header promises); the backward with dropout only for b = 0
//                     (a dense call with another B may take another backward plan: other bits)
// attention_paged (ext bit 6) and KVCache (ext bit 7): error_expected, error_untouched, guards,
// unwritten, repeatable (threads 1 and 2, and other garbage in what is not read),
// weights_invariant, and the edge semantics and (tame) tolerance checks above on the call made
// dense (the sequences' keys gathered into (B, Hkv, Nk, D), Nk = max_pages · page_size, with
// seqlens_k); and
//   paged_dense       out, weights and lse equal bit for bit attention() on those gathered keys
//                     with seqlens_k, capped at KernelPath::kSimd (the header's promise); during
//                     the paged calls the pool rows no sequence reads hold garbage and the table
//                     entries past each sequence's pages out-of-range values, and in ASan builds
//                     both are poisoned (a read is an ASan report), the KVCache's unread rows too
//   error_names       the Error for an invalid block mask names block_mask (block_q, block_k; on
//                     packed sequences also "the longest sequence's": see above); for a bad block-table entry it names the entry and its sequence
//                     ("block_table[b][j] = x", "sequence b"), for a table too short for a length
//                     "seqlens_k[b] = L", for an unknown KVCache sequence its id
//   kvcache_model     after each step the cache's ids (new_sequence: the lowest free), lengths,
//                     pages (taken lowest first, given back by free) and free count are a model's;
//                     a failed append (unknown sequence, mismatched tokens, full pool) changes none
//
// The tolerance rule is reimplemented here from tests/test_util.cc (matches_reference) and
// tests/backward_util.cc (expected / matches): those files need GoogleTest, which a fuzz build
// does not assume. Keep them in step. 16-bit storage follows them too: the compute type is
// float32, so the measured error is kNaive's (float32 arithmetic on the same 16-bit inputs, its
// results rounded to the same 16-bit outputs) with factor 2, the floors use float32's epsilon
// (weights and lse are float32), and a 16-bit out or gradient gets one more unit in its last
// place (eps of its dtype times its magnitude bound).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "sdpa/attention.h"
#include "sdpa/kv_cache.h"

// ASan's manual poisoning (no-ops without ASan): keys past seqlens_k are made unaddressable while
// the library runs, so that reading one is an ASan report, not only a changed bit.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SDPA_FUZZ_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(SDPA_FUZZ_ASAN)
#define SDPA_FUZZ_ASAN 1
#endif
#ifdef SDPA_FUZZ_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace {

using sdpa::Backend;
using sdpa::Causal;
using sdpa::DType;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

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

std::set<std::string> g_known, g_skip;
std::map<std::string, uint64_t> g_known_hits;
bool g_verbose = false;
bool g_avx2 = false;  // this input caps Highway's dispatch at AVX2
sdpa::KernelPath g_path_cap = sdpa::KernelPath::kAmxBf16;  // this input's set_max_kernel_path (kAmxBf16: no cap)
int g_storage = 0;  // ext bits 0-1: 0 float32 / float64, 1 all 16-bit, 2 float32 q over 16-bit k, v, 3 as 1, float32 mask
constexpr unsigned char kExtMagic[2] = {0xb6, 0x16};  // an input starting with these has an `ext` byte next
// ext bit 4 (kExtSeqlens): Inputs::seqlens_k; two more prefix bytes follow ext: `sk` (bits 0-2
// how lengths are drawn, bit 3 int32, bits 4-5 stride, bits 6-7 and sk_seed's top bits: an
// invalid seqlens_k) and `sk_seed` (the lengths' and the garbage's PRNG seed).
// ext bit 5 (kExtVarlen): the input is an attention_varlen (+ backward) call (run_varlen).
// ext & kExtModeBits == kExtPaged: an attention_paged call (run_paged); == kExtKVCache: a KVCache
// script (run_kvcache). Only with bits 4 and 5 clear: an earlier seed (seed53, ext 0x5f) set bit 6
// beside bit 4, and stays a dense call with seqlens_k.
constexpr uint8_t kExtSeqlens = 0x10, kExtVarlen = 0x20, kExtPaged = 0x40, kExtKVCache = 0x80, kExtModeBits = 0xf0;
bool g_seqlens = false;
uint8_t g_sk = 0, g_sk_seed = 0;
bool g_varlen = false;
// ext bits 5-7 equal to 0b110 ((ext & kExtModsMask) == kExtModifiers: 0xc0-0xdf, with bit 4 also
// seqlens_k): a dense call whose Options carry score modifiers (softcap and its order, ALiBi slopes,
// sinks; Gradients::dsinks on backward calls). Two more prefix bytes follow ext (after sk and
// sk_seed when bit 4 is set): `md` (what: see decode_modifiers) and `md_seed` (the values' PRNG
// seed, dtypes, layouts). No committed seed or finding had bits 6 and 7 set without bit 5.
constexpr uint8_t kExtModifiers = 0xc0, kExtModsMask = 0xe0;
bool g_mods = false;
uint8_t g_md = 0, g_md_seed = 0;
// ext bits 4-7 exactly 0x90 ((ext & kExtModeBits) == kExtBlocks; ext 0x90-0x9f, the storage and
// path-cap bits as always): a dense call with Options::block_mask. Two more prefix bytes follow
// ext: `bm` (what: see decode_block_mask; its bit 6 adds seqlens_k, whose sk and sk_seed follow
// bm_seed, and its bit 7 adds score modifiers, whose md and md_seed follow those) and `bm_seed`
// (the block mask's PRNG seed; top three bits 0b111: an invalid block mask, BadBlocks). No
// committed seed or finding had ext 0x90-0x9f (before, a dense call with seqlens_k, as 0x10-0x1f).
constexpr uint8_t kExtBlocks = 0x90;
constexpr uint8_t kBmSeqlens = 0x40, kBmMods = 0x80;
bool g_blocks = false;
uint8_t g_bm = 0, g_bm_seed = 0;
bool g_varlen_blocks = false;  // BadBlocks::kVarlen: the input is an attention_varlen call with a block mask

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

bool skipping(const char* what) { return g_skip.count(what) != 0; }

std::string g_case;  // the description of the current case, printed on failure

const uint8_t* g_data = nullptr;  // the current input, saved for KNOWN failures (SDPA_FUZZ_KNOWN_DIR)
size_t g_size = 0;
const char* g_known_dir = nullptr;

struct CheckFailed {};  // thrown by a KNOWN check's failure: abandons the rest of this input

std::map<std::string, uint64_t> g_evaluated;  // SDPA_FUZZ_STATS=1: how often each check ran
bool g_stats = false;
bool g_print = false;  // SDPA_FUZZ_PRINT=1: print every decoded case (to check what a seed decodes to)

void check(bool ok, const char* name, const std::function<std::string()>& message) {
  if (g_stats) ++g_evaluated[name];
  if (ok) return;
  if (g_known.count(name)) {
    ++g_known_hits[name];
    if (g_verbose || g_known_hits[name] == 1) std::fprintf(stderr, "KNOWN %s: %s\n%s\n", name, message().c_str(), g_case.c_str());
    if (g_known_dir && g_known_hits[name] <= 5) {
      const std::string path = std::string(g_known_dir) + "/known-" + name + "-" + std::to_string(g_known_hits[name]);
      if (FILE* fp = std::fopen(path.c_str(), "wb")) {
        std::fwrite(g_data, 1, g_size, fp);
        std::fclose(fp);
      }
    }
    throw CheckFailed{};
  }
  std::fprintf(stderr, "\n==== attention_fuzz: CHECK FAILED: %s\n%s\n---- case:\n%s\n", name, message().c_str(),
               g_case.c_str());
  std::fflush(stderr);
  std::abort();
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

std::string num(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

bool same_bits(double a, double b) { return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b); }
// Equal for the poison checks: same bits, or both zero (+0 / -0), or both NaN.
bool same_value(double a, double b) {
  return same_bits(a, b) || (a == 0 && b == 0) || (std::isnan(a) && std::isnan(b));
}

// ---- Tensors: strided views into exactly-sized heap buffers (ASan sees any overrun) ----

constexpr uint32_t kSentinel32 = 0x7fc5a5a5u;
constexpr uint64_t kSentinel64 = 0x7ff8a5a5a5a5a5a5ull;
constexpr uint8_t kSentinel8 = 0xa5;
constexpr uint16_t kSentinelBF16 = 0x7fa5;  // exponent all ones, mantissa non-zero: NaN
constexpr uint16_t kSentinelF16 = 0x7ea5;

bool is16(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }
int64_t esize(DType t) { return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : is16(t) ? 2 : 1; }
const char* dtype_str(DType t) {
  return t == DType::kFloat32 ? "f32" : t == DType::kFloat64 ? "f64" : t == DType::kBFloat16 ? "bf16" : t == DType::kFloat16 ? "f16" : "bool";
}
// The compute type of q's dtype (the header): float64 for float64, float32 otherwise.
DType compute_of(DType q) { return q == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }
// The spacing above 1 (as tests/test_util.cc's eps): FLT_EPSILON, DBL_EPSILON, 2^-7, 2^-10.
double eps_of(DType t) {
  return t == DType::kFloat64 ? DBL_EPSILON : t == DType::kBFloat16 ? 0x1p-7 : t == DType::kFloat16 ? 0x1p-10 : FLT_EPSILON;
}
// The largest finite value and the smallest normal one of a float dtype.
double max_of(DType t) {
  return t == DType::kFloat64 ? DBL_MAX : t == DType::kBFloat16 ? 0x1.fep127 : t == DType::kFloat16 ? 65504.0 : FLT_MAX;
}
double min_normal_of(DType t) {
  return t == DType::kFloat64 ? DBL_MIN : t == DType::kBFloat16 ? 0x1p-126 : t == DType::kFloat16 ? 0x1p-14 : FLT_MIN;
}
// Where rounding to the dtype gives ±inf: halfway between its largest finite value and the next
// power of two (float16: 65520). A correct kernel and kReference may land on either side of it.
double overflow_at(DType t) {
  return t == DType::kBFloat16 ? 0x1.ffp127 : t == DType::kFloat16 ? 65520.0 : kInf;
}

// The 16-bit formats, written from their definitions as tests/test_util.cc does (not from src/):
// `digits` significant bits, smallest normal exponent `emin`, largest finite value `max`.
struct HalfFormat {
  int digits, emin;
  double max;
};
constexpr HalfFormat kBF16Format{8, -126, 0x1.fep127};
constexpr HalfFormat kF16Format{11, -14, 65504.0};
const HalfFormat& half_format(DType t) { return t == DType::kBFloat16 ? kBF16Format : kF16Format; }

// x rounded to the format, to nearest with ties to even.
double round_half(const HalfFormat& f, double x) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);  // |x| = m · 2^e, 0.5 <= m < 1: the leading bit is worth 2^(e - 1)
  const int spacing = std::max(e - f.digits, f.emin - f.digits + 1);
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -spacing)), spacing);
  return std::abs(r) > f.max ? std::copysign(kInf, x) : r;
}
// The bits of a value the format holds exactly (NaN: a quiet NaN).
uint16_t half_bits(const HalfFormat& f, double x) {
  const int exp_bits = f.digits == 8 ? 8 : 5, mant_bits = f.digits - 1, bias = (1 << (exp_bits - 1)) - 1;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0, all_ones = static_cast<uint16_t>(((1 << exp_bits) - 1) << mant_bits);
  if (std::isnan(x)) return static_cast<uint16_t>(all_ones | (1 << (mant_bits - 1)));
  if (std::isinf(x)) return sign | all_ones;
  const double a = std::abs(x);
  if (a < std::ldexp(1.0, f.emin)) return sign | static_cast<uint16_t>(std::ldexp(a, -(f.emin - mant_bits)));  // subnormal
  int e;
  const double m = std::frexp(a, &e);  // a = (2m) · 2^(e - 1)
  const uint16_t mant = static_cast<uint16_t>(std::ldexp(2 * m - 1, mant_bits));
  return sign | static_cast<uint16_t>((e - 1 + bias) << mant_bits) | mant;
}
double half_value(const HalfFormat& f, uint16_t bits) {
  const int exp_bits = f.digits == 8 ? 8 : 5, mant_bits = f.digits - 1, bias = (1 << (exp_bits - 1)) - 1;
  const double sign = bits & 0x8000 ? -1.0 : 1.0;
  const int exp = (bits >> mant_bits) & ((1 << exp_bits) - 1);
  const int mant = bits & ((1 << mant_bits) - 1);
  if (exp == (1 << exp_bits) - 1) return mant ? kNaN : sign * kInf;
  if (exp == 0) return sign * std::ldexp(mant, f.emin - mant_bits);
  return sign * std::ldexp(1.0 + std::ldexp(mant, -mant_bits), exp - bias);
}

// How a tensor lays out its elements; decoded from the input.
struct LayoutSpec {
  uint8_t perm = 0;      // memory order of the dims (a permutation index)
  uint8_t pad = 0;       // bit d: gap after dim d's block (1-3 elements)
  uint8_t neg = 0;       // bit d: negative stride on dim d
  uint8_t zero = 0;      // bit d: stride 0 on dim d (inputs only: broadcast)
  uint8_t misalign = 0;  // elements before the lowest element in the buffer
  uint8_t last = 1;      // last-dim stride for mask / weights / lse (1..3)
  bool odd_unit = false; // dims of extent 1 get odd strides (never stepped)
  bool null_empty = true;  // an empty tensor has data == nullptr
  uint64_t empty_stride_seed = 0;

  static LayoutSpec plain() { return LayoutSpec{}; }
};

enum class Role { kUnitLast, kAny };  // q/k/v/out/gradients need stride 1 in the last dim

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape, Role role, bool input, const LayoutSpec& ls) { init(dtype, std::move(shape), role, input, ls); }
  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;

  void init(DType dtype, std::vector<int64_t> shape, Role role, bool input, const LayoutSpec& ls) {
    dtype_ = dtype;
    shape_ = std::move(shape);
    rank_ = static_cast<int>(shape_.size());
    strides_.assign(shape_.size(), 0);
    const int r = rank_;
    int64_t n = 1;
    for (int64_t s : shape_) if (s == 0) n = 0;
    for (int64_t s : shape_) if (n != 0 && __builtin_mul_overflow(n, s, &n)) n = INT64_MAX;  // never allocated
    numel_ = n;
    if (numel_ == 0) {
      // Never read or written: any strides; data null or a tiny buffer.
      std::mt19937_64 g(ls.empty_stride_seed);
      const int64_t choices[] = {0, 1, -1, 7, -1000, int64_t{1} << 40, -(int64_t{1} << 50)};
      for (int d = 0; d < r; ++d) strides_[d] = ls.empty_stride_seed == 0 ? 0 : choices[g() % 7];
      if (!ls.null_empty) alloc(1);
      data_off_ = 0;
      return;
    }
    std::vector<int> order;  // innermost first
    for (int d = r - 1; d >= 0; --d) order.push_back(d);
    {
      // Permute: unit-last roles keep the last dim innermost.
      const int fixed = role == Role::kUnitLast && r > 0 ? 1 : 0;
      std::vector<int> rest(order.begin() + fixed, order.end());
      int p = ls.perm;
      for (size_t i = 0; i < rest.size(); ++i) {
        const size_t j = i + static_cast<size_t>(p % static_cast<int>(rest.size() - i));
        p /= static_cast<int>(rest.size() - i);
        std::swap(rest[i], rest[j]);
      }
      std::copy(rest.begin(), rest.end(), order.begin() + fixed);
    }
    int64_t cur = role == Role::kUnitLast ? 1 : std::max<int>(1, ls.last);
    for (size_t o = 0; o < order.size(); ++o) {
      const int d = order[o];
      if (shape_[d] == 1 && ls.odd_unit) {
        strides_[d] = (o % 2 ? -12345 : 99991) + d;
        continue;
      }
      strides_[d] = cur;
      cur = cur * shape_[d] + ((ls.pad >> d & 1) ? 1 + d % 3 : 0);
    }
    for (int d = 0; d < r; ++d) {
      const bool is_last = d == r - 1;
      if (input && (ls.zero >> d & 1) && !(role == Role::kUnitLast && is_last && shape_[d] > 1)) strides_[d] = 0;
      if ((ls.neg >> d & 1) && !(role == Role::kUnitLast && is_last && shape_[d] > 1)) strides_[d] = -strides_[d];
    }
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < r; ++d) {
      const int64_t ext = (shape_[d] - 1) * strides_[d];
      if (ext < 0) lo += ext; else hi += ext;
    }
    alloc(static_cast<size_t>(hi - lo + 1 + ls.misalign));
    data_off_ = ls.misalign - lo;
  }

  sdpa::TensorView view() const {
    sdpa::TensorView t;
    t.dtype = dtype_;
    t.rank = rank_;
    for (int d = 0; d < rank_; ++d) {
      t.shape[d] = shape_[d];
      t.strides[d] = strides_[d];
    }
    t.data = buf_ ? buf_.get() + data_off_ * esize(dtype_) : nullptr;
    return t;
  }

  DType dtype() const { return dtype_; }
  int rank() const { return rank_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const { return numel_; }
  size_t buffer_elems() const { return elems_; }

  // Offset (in elements, relative to element 0) of the element at C-order flat index.
  int64_t offset_of_flat(int64_t flat) const {
    int64_t off = 0;
    for (int d = rank_ - 1; d >= 0; --d) {
      off += (flat % shape_[d]) * strides_[d];
      flat /= shape_[d];
    }
    return off;
  }
  // Element (b, h, n, e): dims right-aligned to these four; extent-1 dims broadcast.
  int64_t offset4(int64_t b, int64_t h, int64_t n, int64_t e) const {
    const int64_t idx[4] = {b, h, n, e};
    int64_t off = 0;
    for (int d = 0; d < rank_; ++d) {
      const int64_t i = idx[4 - rank_ + d];
      if (shape_[d] != 1) off += i * strides_[d];
    }
    return off;
  }
  double get_off(int64_t off) const {
    const std::byte* p = buf_.get() + (data_off_ + off) * esize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: { float f; std::memcpy(&f, p, 4); return f; }
      case DType::kFloat64: { double f; std::memcpy(&f, p, 8); return f; }
      case DType::kBool: return static_cast<double>(static_cast<uint8_t>(*p));
      case DType::kBFloat16:
      case DType::kFloat16: { uint16_t h; std::memcpy(&h, p, 2); return half_value(half_format(dtype_), h); }
      default: break;
    }
    return 0;
  }
  void set_off(int64_t off, double v) {
    std::byte* p = buf_.get() + (data_off_ + off) * esize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: { const float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
      case DType::kFloat64: std::memcpy(p, &v, 8); break;
      case DType::kBool: *p = static_cast<std::byte>(static_cast<uint8_t>(v)); break;
      case DType::kBFloat16:
      case DType::kFloat16: {  // rounded once to nearest even, as a caller's conversion would
        const HalfFormat& hf = half_format(dtype_);
        const uint16_t h = half_bits(hf, round_half(hf, v));
        std::memcpy(p, &h, 2);
        break;
      }
      default: break;
    }
  }
  double at4(int64_t b, int64_t h, int64_t n, int64_t e) const { return get_off(offset4(b, h, n, e)); }
  double flat(int64_t i) const { return get_off(offset_of_flat(i)); }
  void set_flat(int64_t i, double v) { set_off(offset_of_flat(i), v); }
  std::vector<double> values() const {
    std::vector<double> r(static_cast<size_t>(numel_));
    for (int64_t i = 0; i < numel_; ++i) r[static_cast<size_t>(i)] = flat(i);
    return r;
  }
  // Raw bits of element (flat) for bitwise comparisons (as uint64).
  bool is_sentinel_off(int64_t off) const {
    const std::byte* p = buf_.get() + (data_off_ + off) * esize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: return std::memcmp(p, &kSentinel32, 4) == 0;
      case DType::kFloat64: return std::memcmp(p, &kSentinel64, 8) == 0;
      case DType::kBool: return static_cast<uint8_t>(*p) == kSentinel8;
      case DType::kBFloat16: return std::memcmp(p, &kSentinelBF16, 2) == 0;
      case DType::kFloat16: return std::memcmp(p, &kSentinelF16, 2) == 0;
      default: break;
    }
    return false;
  }
  std::vector<std::byte> snapshot() const { return buf_ ? std::vector<std::byte>(buf_.get(), buf_.get() + bytes()) : std::vector<std::byte>{}; }
  bool same_bytes(const std::vector<std::byte>& s) const { return s.size() == bytes() && (bytes() == 0 || std::memcmp(s.data(), buf_.get(), bytes()) == 0); }
  size_t bytes() const { return elems_ * static_cast<size_t>(esize(dtype_)); }

  // Every buffer slot that is no element still holds the sentinel; every element is written.
  std::string guards_and_written() const {
    if (!buf_) return "";
    std::vector<uint8_t> is_elem(elems_, 0);
    for (int64_t i = 0; i < numel_; ++i) is_elem[static_cast<size_t>(data_off_ + offset_of_flat(i))] = 1;
    for (size_t o = 0; o < elems_; ++o) {
      const bool sent = is_sentinel_off(static_cast<int64_t>(o) - data_off_);
      if (!is_elem[o] && !sent) return "guards: slot " + std::to_string(o) + " of the buffer (not an element) was written";
      if (is_elem[o] && sent) return "unwritten: an element (buffer slot " + std::to_string(o) + ") still holds the sentinel";
    }
    return "";
  }

  std::string describe(const char* name) const {
    std::ostringstream s;
    s << name << ": " << dtype_str(dtype_) << " shape (";
    for (int d = 0; d < rank_; ++d) s << (d ? ", " : "") << shape_[d];
    s << ") strides (";
    for (int d = 0; d < rank_; ++d) s << (d ? ", " : "") << strides_[d];
    s << ") data " << (buf_ ? "buffer" : "nullptr") << " +" << data_off_ << " elems";
    const int64_t lim = g_verbose ? 4096 : 64;
    if (numel_ > 0 && numel_ <= lim && dtype_ != DType::kBool) {
      s << " values [";
      for (int64_t i = 0; i < numel_; ++i) s << (i ? ", " : "") << flat(i);
      s << "]";
    } else if (numel_ > 0 && numel_ <= lim) {
      s << " values [";
      for (int64_t i = 0; i < numel_; ++i) s << (i ? "," : "") << flat(i);
      s << "]";
    }
    return s.str();
  }

  // A contiguous copy in another dtype (same values, C order).
  Tensor converted(DType dt) const {
    Tensor t(dt, shape_, Role::kUnitLast, true, LayoutSpec::plain());
    for (int64_t i = 0; i < numel_; ++i) t.set_flat(i, flat(i));
    return t;
  }
  Tensor clone() const {
    Tensor t;
    t.dtype_ = dtype_; t.rank_ = rank_; t.shape_ = shape_; t.strides_ = strides_; t.numel_ = numel_;
    t.data_off_ = data_off_;
    if (buf_) {
      t.alloc(elems_);
      std::memcpy(t.buf_.get(), buf_.get(), bytes());
    }
    return t;
  }

 private:
  void alloc(size_t elems) {
    elems_ = elems;
    const size_t b = std::max<size_t>(1, elems * static_cast<size_t>(esize(dtype_)));
    buf_.reset(static_cast<std::byte*>(std::malloc(b)));
    for (size_t o = 0; o < elems; ++o) {
      std::byte* p = buf_.get() + o * static_cast<size_t>(esize(dtype_));
      if (dtype_ == DType::kFloat32) std::memcpy(p, &kSentinel32, 4);
      else if (dtype_ == DType::kFloat64) std::memcpy(p, &kSentinel64, 8);
      else if (dtype_ == DType::kBFloat16) std::memcpy(p, &kSentinelBF16, 2);
      else if (dtype_ == DType::kFloat16) std::memcpy(p, &kSentinelF16, 2);
      else *p = static_cast<std::byte>(kSentinel8);
    }
  }
  struct Free { void operator()(std::byte* p) const { std::free(p); } };
  DType dtype_ = DType::kFloat32;
  int rank_ = 0;
  std::vector<int64_t> shape_, strides_;
  int64_t numel_ = 0;
  int64_t data_off_ = 0;
  size_t elems_ = 0;
  std::unique_ptr<std::byte[], Free> buf_;
};

// An int32 / int64 rank-1 tensor (seqlens_k, cu_seqlens) in an exactly-sized heap buffer, any
// stride (0 only when every value is the same) and a byte offset (index_at reads any alignment).
struct IndexTensor {
  DType dtype = DType::kInt64;
  std::vector<int64_t> vals;
  int64_t stride = 1;
  int misalign = 0;  // bytes before the lowest element
  struct Free { void operator()(std::byte* p) const { std::free(p); } };
  std::unique_ptr<std::byte[], Free> buf;
  size_t bytes = 0;
  std::byte* data = nullptr;  // element 0

  IndexTensor(DType dt, std::vector<int64_t> v, int64_t st, int mis) : dtype(dt), vals(std::move(v)), stride(st), misalign(mis) {
    const int64_t n = static_cast<int64_t>(vals.size()), es = dt == DType::kInt32 ? 4 : 8;
    const int64_t span = n == 0 ? 0 : (n - 1) * std::abs(stride) + 1;
    bytes = static_cast<size_t>(span * es + misalign);
    buf.reset(static_cast<std::byte*>(std::malloc(std::max<size_t>(1, bytes))));
    std::memset(buf.get(), 0xa5, std::max<size_t>(1, bytes));
    data = buf.get() + misalign + (stride < 0 && n > 0 ? (n - 1) * -stride * es : 0);
    for (int64_t i = 0; i < n; ++i) {
      std::byte* at = data + i * stride * es;
      if (dt == DType::kInt32) { const int32_t x = static_cast<int32_t>(vals[static_cast<size_t>(i)]); std::memcpy(at, &x, 4); }
      else std::memcpy(at, &vals[static_cast<size_t>(i)], 8);
    }
  }
  // Entry i's value, in memory too (as the dtype holds it).
  void set(int64_t i, int64_t x) {
    vals[static_cast<size_t>(i)] = x;
    std::byte* at = data + i * stride * (dtype == DType::kInt32 ? 4 : 8);
    if (dtype == DType::kInt32) { const int32_t y = static_cast<int32_t>(x); std::memcpy(at, &y, 4); }
    else std::memcpy(at, &x, 8);
  }
  sdpa::TensorView view() const {
    sdpa::TensorView t;
    t.data = vals.empty() ? nullptr : data;
    t.dtype = dtype;
    t.rank = 1;
    t.shape[0] = static_cast<int64_t>(vals.size());
    t.strides[0] = stride;
    return t;
  }
  std::string describe(const char* name) const {
    std::ostringstream s;
    s << name << ": " << (dtype == DType::kInt32 ? "int32" : "int64") << " (" << vals.size() << ",) stride " << stride
      << " misalign " << misalign << " values [";
    for (size_t i = 0; i < vals.size(); ++i) s << (i ? ", " : "") << vals[i];
    s << "]";
    return s.str();
  }
};

// What an invalid score modifier (md bit 7, with md_seed) breaks. The kDsinks* kinds need a backward
// call (else the call runs as a valid one).
enum class BadMod : uint8_t {
  kNone, kCapNegative, kCapNaN, kCapInf, kCapRange, kOrderEnum, kSlopesShape, kSlopesBatch, kSlopesRank, kSlopesDtype,
  kSlopesValue, kSlopesNull, kSinksShape, kSinksRank, kSinksDtype, kSinksValue, kSinksNull,
  // backward only
  kDsinksNoSinks, kDsinksDtype, kDsinksShape, kDsinksStride0,
  kCount
};
const char* const kBadModNames[] = {"none", "softcap < 0", "softcap NaN", "softcap inf", "softcap not held by the compute type",
                                    "softcap_order enum", "alibi_slopes (Hq + 1,)", "alibi_slopes (B + 2, Hq)", "alibi_slopes rank 3",
                                    "alibi_slopes dtype", "alibi_slopes non-finite", "alibi_slopes null data", "sinks (Hq + 1,)",
                                    "sinks rank 2", "sinks dtype", "sinks non-finite", "sinks null data", "dsinks without sinks",
                                    "dsinks dtype", "dsinks (Hq + 1,)", "dsinks stride 0"};
static_assert(sizeof(kBadModNames) / sizeof(kBadModNames[0]) == static_cast<size_t>(BadMod::kCount));

// What an invalid block mask (bm_seed's top three bits 0b111; bm_seed's low five bits pick the
// kind) breaks. kVarlen (bm_seed 0xe7, 0xef, 0xf7, 0xff) is no invalid kind of a dense call: it
// makes the input an attention_varlen call (run_varlen) with a block mask for its packed sequences,
// valid or invalid (run_varlen_blocks, PackedBad), and the same sequences as a packed
// attention_paged call.
enum class BadBlocks : uint8_t { kNone, kDtype, kShape, kLeadShape, kRank, kBlockQ, kBlockK, kNull, kVarlen, kCount };
const char* const kBadBlocksNames[] = {"none", "block_mask dtype not bool", "block_mask (.., QB ± 1, KB) or (.., QB, KB ± 1)",
                                       "block_mask leading dim neither 1 nor B / Hq", "block_mask rank (0, 1 or > q's)",
                                       "block_q < 1", "block_k < 1", "block_mask null data",
                                       "block_mask on packed sequences (attention_varlen / packed attention_paged)"};
static_assert(sizeof(kBadBlocksNames) / sizeof(kBadBlocksNames[0]) == static_cast<size_t>(BadBlocks::kCount));
BadBlocks bad_blocks_of(uint8_t bm_seed) {
  return (bm_seed >> 5) == 7 ? static_cast<BadBlocks>(1 + (bm_seed & 31) % (static_cast<int>(BadBlocks::kCount) - 1)) : BadBlocks::kNone;
}

// What an invalid seqlens_k (sk bits 6-7 with sk_seed bits 5-7) breaks.
enum class BadSeqlens : uint8_t { kNone, kNegative, kTooLong, kShapeB1, kRank, kDtype, kNull, kShapeSmall };
const char* const kBadSeqlensNames[] = {"none", "negative length", "length > Nk", "shape (B + 1,)", "rank != 1",
                                        "dtype not int32/int64", "null data", "shape (B - 1,) or (0,)"};

// ---- The case ----

struct Dims {
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, Dk = 1, Dv = 1;
  int64_t group() const { return Hkv > 0 ? Hq / Hkv : 1; }
};

std::vector<int64_t> last_dims(int rank, std::vector<int64_t> full) { return {full.end() - rank, full.end()}; }

// The score modifiers' tensors (kExtModifiers): Options::alibi_slopes ((Hq,), (B, Hq) or (1, Hq))
// and Options::sinks ((Hq,)), float32 or float64, any strides (0 too); and how a backward call
// gets Gradients::dsinks.
struct Modifiers {
  std::optional<Tensor> slopes, sinks;
  bool dsinks = false;  // backward calls with sinks also write dsinks
  DType dsinks_dtype = DType::kFloat32;
  LayoutSpec dsinks_ls;
  BadMod bad = BadMod::kNone;
  uint64_t bad_seed = 0;  // picks the details of `bad`
};

// Options::block_mask (kExtBlocks): the bool tensor (any layout; c.opt.block_mask views it) and
// block_q, block_k (also in c.opt); what an invalid one breaks.
struct BlockMask {
  Tensor mask;
  int64_t bq = 128, bk = 128;
  std::string how;  // the size, density and leading-dims classes drawn (for the case's description)
  BadBlocks bad = BadBlocks::kNone;
  uint64_t bad_seed = 0;
};

struct Case {
  DType dtype = DType::kFloat32;  // q's (and out's, dout's, dq's)
  DType kv = DType::kFloat32;     // k's and v's (and dk's, dv's): dtype, or bfloat16 / float16 under float32 q
  int rank = 2;
  Dims d;
  Tensor q, k, v;
  std::optional<Tensor> mask;
  sdpa::Options opt;
  bool want_weights = false, want_lse = false;
  LayoutSpec out_ls, w_ls, l_ls;
  bool tame = true;
  bool huge = false;  // empty views with huge dims (checks (f))
  int threads = 1;
  bool avx2 = false;
  sdpa::KernelPath path_cap = sdpa::KernelPath::kAmxBf16;
  bool backward = false;
  // Inputs::seqlens_k (ext bit 4): lengths per batch entry (one entry for rank 2 / 3), the view
  // the call gets, and what an invalid one breaks (the view then differs from `seqlens`).
  std::vector<int64_t> seqlens;
  std::shared_ptr<IndexTensor> sl;
  std::optional<sdpa::TensorView> sl_view;
  BadSeqlens bad_sl = BadSeqlens::kNone;
  // Score modifiers (kExtModifiers): their tensors; opt holds the softcap and the views.
  std::shared_ptr<Modifiers> mods;
  // Options::block_mask (kExtBlocks): its tensor; opt holds the view, block_q and block_k.
  std::shared_ptr<BlockMask> blocks;

  // The keys batch entry b has (Nk without seqlens_k): causal and window align to it.
  int64_t keys_of(int64_t b) const { return seqlens.empty() ? d.Nk : seqlens[static_cast<size_t>(b)]; }
  DType compute() const { return compute_of(dtype); }  // weights', lse's and the arithmetic's
  bool lowp() const { return is16(dtype) || is16(kv); }
  bool all_bf16() const { return dtype == DType::kBFloat16 && kv == DType::kBFloat16; }
  // Whether the scores are more than q·k·scale + bias, or the softmax has a sink (the header's
  // Options::softcap, alibi_slopes, sinks).
  bool modified() const { return opt.softcap != 0 || opt.alibi_slopes.has_value() || opt.sinks.has_value(); }
  bool want_dsinks() const { return backward && mods && mods->dsinks && opt.sinks.has_value(); }
  // ALiBi's slope for (b, h) as stored ((1, Hq) and (Hq,) broadcast over the batch), 0 without.
  double slope(int64_t b, int64_t h) const {
    if (!opt.alibi_slopes || !mods || !mods->slopes) return 0.0;
    const Tensor& t = *mods->slopes;
    return t.rank() == 1 ? t.flat(h) : t.flat((t.shape()[0] == 1 ? 0 : b) * d.Hq + h);
  }
  // -slope · |i + (L - Nq) - j| (the header: i aligned bottom-right to the sequence's L keys).
  double alibi(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!opt.alibi_slopes) return 0.0;
    const int64_t dist = i + (keys_of(b) - d.Nq) - j;
    return -slope(b, h) * static_cast<double>(dist < 0 ? -dist : dist);
  }
  bool has_sinks() const { return opt.sinks.has_value() && mods && mods->sinks; }
  // The header's Options::block_mask rule: row i and key j lie in block (i / block_q, j / block_k)
  // of the (b, h) the mask's leading dims broadcast to; 0 there blocks the key (true without one).
  bool block_allows(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!blocks || !opt.block_mask) return true;
    return blocks->mask.at4(b, h, i / blocks->bq, j / blocks->bk) != 0;
  }
  double sink(int64_t h) const { return has_sinks() ? mods->sinks->flat(h) : -std::numeric_limits<double>::infinity(); }

  sdpa::Inputs inputs() const {
    sdpa::Inputs in;
    in.q = q.view();
    in.k = k.view();
    in.v = v.view();
    if (mask) in.mask = mask->view();
    if (sl_view) in.seqlens_k = *sl_view;
    return in;
  }
  std::vector<int64_t> out_shape() const { return last_dims(rank, {d.B, d.Hq, d.Nq, d.Dv}); }
  std::vector<int64_t> w_shape() const { return last_dims(rank, {d.B, d.Hq, d.Nq, d.Nk}); }
  std::vector<int64_t> lse_shape() const { return last_dims(rank - 1, {d.B, d.Hq, d.Nq}); }
  double scale() const { return opt.scale.value_or(d.Dk > 0 ? 1.0 / std::sqrt(static_cast<double>(d.Dk)) : 1.0); }
};

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kAuto: return "kAuto";
    case Backend::kFlash: return "kFlash";
    case Backend::kReference: return "kReference";
    case Backend::kNaive: return "kNaive";
  }
  return "invalid";
}

const char* path_name(sdpa::KernelPath p) {
  return p == sdpa::KernelPath::kSimd ? "kSimd" : p == sdpa::KernelPath::kAvx512Bf16 ? "kAvx512Bf16" : p == sdpa::KernelPath::kAmxBf16 ? "kAmxBf16" : "invalid";
}

std::string dtype_long(DType t) {
  return t == DType::kFloat32 ? "float32" : t == DType::kFloat64 ? "float64" : t == DType::kBFloat16 ? "bfloat16" : t == DType::kFloat16 ? "float16" : "bool";
}

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "dtype " << (c.kv == c.dtype ? dtype_long(c.dtype) : dtype_long(c.dtype) + " q over " + dtype_long(c.kv) + " k, v") << ", rank " << c.rank << ", B=" << c.d.B
    << " Hq=" << c.d.Hq << " Hkv=" << c.d.Hkv << " Nq=" << c.d.Nq << " Nk=" << c.d.Nk << " Dk=" << c.d.Dk
    << " Dv=" << c.d.Dv << "\n";
  s << "options: scale=" << (c.opt.scale ? num(*c.opt.scale) : std::string("default")) << " causal="
    << (c.opt.causal == Causal::kNone ? "kNone" : c.opt.causal == Causal::kBottomRight ? "kBottomRight" : c.opt.causal == Causal::kTopLeft ? "kTopLeft" : "invalid")
    << " window={" << c.opt.window.left << ", " << c.opt.window.right << "} backend=" << backend_name(c.opt.backend)
    << " dropout_p=" << num(c.opt.dropout_p) << " seed=" << (c.opt.seed ? std::to_string(*c.opt.seed) : "none") << "\n";
  s << "weights " << (c.want_weights ? "yes" : "no") << ", lse " << (c.want_lse ? "yes" : "no") << ", threads "
    << c.threads << ", SIMD " << (c.avx2 ? "capped at AVX2" : "all targets") << ", kernel path cap " << path_name(c.path_cap) << ", " << (c.backward ? "forward+backward" : "forward")
    << ", " << (c.tame ? "tame" : "not tame") << (c.huge ? ", huge-empty" : "") << "\n";
  s << c.q.describe("q") << "\n" << c.k.describe("k") << "\n" << c.v.describe("v") << "\n";
  if (c.mask) s << c.mask->describe("mask") << "\n";
  if (c.sl) {
    s << c.sl->describe("seqlens_k");
    if (c.bad_sl != BadSeqlens::kNone) s << " (invalid: " << kBadSeqlensNames[static_cast<int>(c.bad_sl)] << ")";
    s << "\n";
  }
  if (c.mods) {
    s << "modifiers: softcap=" << num(c.opt.softcap) << " order="
      << (c.opt.softcap_order == sdpa::Options::SoftcapOrder::kBeforeBias ? "kBeforeBias" : c.opt.softcap_order == sdpa::Options::SoftcapOrder::kAfterBias ? "kAfterBias" : "invalid")
      << (c.want_dsinks() ? ", dsinks " + dtype_long(c.mods->dsinks_dtype) : std::string()) << "\n";
    if (c.opt.alibi_slopes && c.mods->slopes) s << c.mods->slopes->describe("alibi_slopes") << "\n";
    if (c.opt.sinks && c.mods->sinks) s << c.mods->sinks->describe("sinks") << "\n";
    if (c.mods->bad != BadMod::kNone) s << "invalid modifier: " << kBadModNames[static_cast<int>(c.mods->bad)] << "\n";
  }
  if (c.blocks) {
    s << "block mask (" << c.blocks->how << "): block_q=" << c.opt.block_q << " block_k=" << c.opt.block_k << "; "
      << c.blocks->mask.describe("block_mask") << "\n";
    if (c.blocks->bad != BadBlocks::kNone) s << "invalid block mask: " << kBadBlocksNames[static_cast<int>(c.blocks->bad)] << "\n";
  }
  return s.str();
}

// ---- Decoding ----

template <size_t N>
int64_t pick(FuzzedDataProvider& f, const int64_t (&menu)[N]) {
  return menu[f.ConsumeIntegralInRange<size_t>(0, N - 1)];
}

LayoutSpec decode_layout(FuzzedDataProvider& f, bool fancy) {
  LayoutSpec ls;
  if (!fancy) return ls;
  const uint8_t kind = f.ConsumeIntegral<uint8_t>();
  ls.perm = f.ConsumeIntegral<uint8_t>();
  ls.pad = kind & 1 ? f.ConsumeIntegral<uint8_t>() : 0;
  ls.neg = kind & 2 ? f.ConsumeIntegral<uint8_t>() : 0;
  ls.zero = kind & 4 ? f.ConsumeIntegral<uint8_t>() : 0;
  ls.misalign = kind & 8 ? static_cast<uint8_t>(1 + f.ConsumeIntegralInRange<int>(0, 6)) : 0;
  ls.last = static_cast<uint8_t>(kind & 16 ? 2 + (kind >> 7) : 1);
  ls.odd_unit = kind & 32;
  ls.null_empty = !(kind & 64);
  ls.empty_stride_seed = f.ConsumeIntegral<uint8_t>();
  return ls;
}

// Special values planted into tensors.
double special(uint8_t i, DType dt) {
  static const double f32v[] = {0.0, -0.0, kInf, -kInf, kNaN, 1e20, -1e20, 1e30, -1e30, 3e38, -3e38,
                                FLT_MAX, 1e-30, -1e-38, 1e-45, 1e10, 1e15, -1e19, 65504, 1e-10};
  static const double f64v[] = {0.0, -0.0, kInf, -kInf, kNaN, 1e150, -1e150, 1e200, -1e300, 1e308, -1e308,
                                DBL_MAX, 1e-300, -1e-310, 5e-324, 1e30, 1e100, -1e160, 3e38, 1e-30};
  // bfloat16: its largest value, its smallest subnormal, and values just outside the range
  // [2^-40, 2^32) where the AVX512_BF16 / AMX path is used (a tile or block holding one widens).
  static const double bf16v[] = {0.0, -0.0, kInf, -kInf, kNaN, 1e20, -1e20, 1e30, -1e30, 3e38, -3e38,
                                 0x1.fep127, 0x1p32, -0x1p-41, 0x1p-133, 1e10, 0x1.fep31, 0x1p-40, -1e-38, 1e-10};
  // float16: its largest value (and values rounding to it or to inf), subnormals, the smallest
  // normal, and values beyond its range (stored as inf or 0).
  static const double f16v[] = {0.0, -0.0, kInf, -kInf, kNaN, 65504, -65504, 6e4, -3e4, 1e4, -1e4,
                                65519, 0x1p-24, -0x1p-20, 0x1p-14, 300, 1e3, 65520, 1e20, 1e-10};
  switch (dt) {
    case DType::kFloat64: return f64v[i % 20];
    case DType::kBFloat16: return bf16v[i % 20];
    case DType::kFloat16: return f16v[i % 20];
    default: return f32v[i % 20];
  }
}

void fill_values(Tensor& t, std::mt19937_64& rng, double sigma, int zeros_mode) {
  std::normal_distribution<double> nd(0.0, sigma);
  for (int64_t i = 0; i < t.numel(); ++i) {
    double x = nd(rng);
    if (zeros_mode == 1 && rng() % 4 == 0) x = 0;
    if (zeros_mode == 2) x = static_cast<double>(static_cast<int>(rng() % 5) - 2);  // ties
    t.set_flat(i, std::clamp(x, -1e3, 1e3));
  }
}

int64_t work_of(const Dims& d) {
  // Saturating B*Hq*Nq*Nk*(Dk+Dv+1).
  const long double w = static_cast<long double>(d.B) * d.Hq * d.Nq * d.Nk * (d.Dk + d.Dv + 1);
  return w > 1e15L ? int64_t{1} << 50 : static_cast<int64_t>(w);
}

constexpr int64_t kWorkBudget = 1 << 18;

// What the input asks for beyond a valid call.
enum class Invalid : uint8_t {
  kNone, kQBool, kKDtype, kOutDtype, kWeightsDtype, kLseDtype, kMaskDtype, kDk, kNkV, kHeads, kBatch, kOutShape,
  kWeightsShape, kLseShape, kMaskShape, kMaskRank, kRank, kRankMismatch, kNullData, kOutStride0, kWeightsStride0,
  kLseStride0, kLastStride, kNegDim, kScaleNaN, kScaleInf, kScaleHugeF32, kScaleTinyF32, kDropoutRange,
  kDropoutNoSeed, kMaskNaN, kMaskPosInf, kBackendEnum, kCausalEnum, kNumelOverflow,
  // backward only
  kLsePosInf, kDoutShape, kDqShape, kDkStride0, kDvDtype, kGradNull,
  kCount
};
const char* const kInvalidNames[] = {
    "none", "q bool", "k dtype", "out dtype", "weights dtype", "lse dtype", "mask dtype", "k Dk", "v Nk", "Hq % Hkv",
    "k batch", "out shape", "weights shape", "lse shape", "mask shape", "mask rank > q rank", "rank 5", "k rank != q rank",
    "null data", "out stride 0", "weights stride 0", "lse stride 0", "q last stride 2", "negative dim",
    "scale NaN", "scale inf", "scale > FLT_MAX (f32)", "scale rounds to 0 (f32)", "dropout_p out of range",
    "dropout without seed", "mask NaN", "mask +inf", "backend enum", "causal enum", "numel overflow",
    "lse +inf (backward)", "dout shape", "dq shape", "dk stride 0", "dv dtype", "dq null"};
static_assert(sizeof(kInvalidNames) / sizeof(kInvalidNames[0]) == static_cast<size_t>(Invalid::kCount));

// ---- The oracle of the edge semantics (a)-(c): exact structure and IEEE classes per row ----

// The header's rules written out again (independently of src/): keys query i may see.
bool key_allowed_cw(const sdpa::Options& o, int64_t Nq, int64_t Nk, int64_t i, int64_t j) {
  const __int128 al = static_cast<__int128>(i) + Nk - Nq;
  if (o.causal == Causal::kBottomRight && j > al) return false;
  if (o.causal == Causal::kTopLeft && j > i) return false;
  if (o.window.left >= 0 && static_cast<__int128>(j) < al - o.window.left) return false;
  if (o.window.right >= 0 && static_cast<__int128>(j) > al + o.window.right) return false;
  return true;
}
// How many keys causal and window allow for row i (for huge Nk).
int64_t allowed_count(const sdpa::Options& o, int64_t Nq, int64_t Nk, int64_t i) {
  const __int128 al = static_cast<__int128>(i) + Nk - Nq;
  __int128 lo = 0, hi = Nk;  // [lo, hi)
  if (o.causal == Causal::kBottomRight) hi = std::min<__int128>(hi, al + 1);
  if (o.causal == Causal::kTopLeft) hi = std::min<__int128>(hi, static_cast<__int128>(i) + 1);
  if (o.window.left >= 0) lo = std::max<__int128>(lo, al - o.window.left);
  if (o.window.right >= 0) hi = std::min<__int128>(hi, al + o.window.right + 1);
  return hi > lo ? static_cast<int64_t>(hi - lo) : 0;
}

// The bias of score (b, h, i, j): a float mask's value, 0 / -inf for a bool mask's nonzero / 0,
// and -inf where the block mask blocks the key (the header: on top of every other mask, exactly
// as a bool mask's 0), so every check that asks whether a key is blocked sees the block mask.
double mask_bias(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!c.block_allows(b, h, i, j)) return -kInf;
  if (!c.mask) return 0.0;
  const double m = c.mask->at4(b, h, i, j);
  return c.mask->dtype() == DType::kBool ? (m != 0 ? 0.0 : -kInf) : m;
}
// Causal, window and seqlens_k: batch entry b has keys 0 .. L - 1, L = seqlens_k[b], and causal
// and window align to L (the header's Inputs::seqlens_k), not to Nk.
bool key_allowed(const Case& c, int64_t b, int64_t i, int64_t j) {
  const int64_t L = c.keys_of(b);
  return j < L && key_allowed_cw(c.opt, c.d.Nq, L, i, j);
}
bool allowed(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  return key_allowed(c, b, i, j) && mask_bias(c, b, h, i, j) != -kInf;
}

// tests/test_util.cc: score_magnitude: |scale| Σ_d |q_d k_d| + |bias|, 0 for a blocked key.
double score_magnitude(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  const double bias = mask_bias(c, b, h, i, j);
  if (!key_allowed(c, b, i, j) || !std::isfinite(bias)) return 0.0;
  double t = 0;
  for (int64_t x = 0; x < c.d.Dk; ++x) t += std::abs(c.q.at4(b, h, i, x) * c.k.at4(b, h / c.d.group(), j, x));
  // ALiBi's bias is a term of the score too (test_util.cc; 0 without slopes).
  return std::abs(c.scale()) * t + std::abs(bias) + std::abs(c.alibi(b, h, i, j));
}
double max_score_magnitude(const Case& c) {
  double m = 0;
  for (int64_t b = 0; b < c.d.B; ++b)
    for (int64_t h = 0; h < c.d.Hq; ++h)
      for (int64_t i = 0; i < c.d.Nq; ++i)
        for (int64_t j = 0; j < c.d.Nk; ++j) {
          const double x = score_magnitude(c, b, h, i, j);
          if (std::isfinite(x)) m = std::max(m, x);
        }
  return m;
}

enum class Cls : uint8_t { kBlocked, kNaN, kPosInf, kNegInf, kFinite, kAmbig };

struct Score {
  Cls cls = Cls::kBlocked;
  long double s = 0;    // for kFinite
  long double err = 0;  // bound on |computed - s|
};

// The score modifiers (the header's Options::softcap, softcap_order, alibi_slopes) applied to the
// class of x = Σ_d (q_d·scale)·k_d (`raw`; x and xerr for kFinite) of an allowed key with a finite
// bias:
//   kBeforeBias  s = cap·tanh(x / cap) + alibi + bias: x = ±inf gives ±cap, NaN stays NaN
//   kAfterBias   s = cap·tanh((x + alibi + bias) / cap): +inf gives cap, NaN stays NaN, and an
//                argument that is -inf in the compute type (x = -inf, or a sum past its range:
//                ±inf from |x + alibi + bias| >= 0x1.ffffffp127 for float32 compute) blocks the
//                key like a -inf bias: score -inf, weight 0 (the header's Options::softcap;
//                kReference rounds the argument to the compute type's range, Problem::
//                in_compute_range, as the float32 kernels' sum does: F17, resolved so)
// The errors: tanh is 1-Lipschitz, so an argument's error passes through; the division by cap
// (its reciprocal may be subnormal for caps near FLT_MAX: a few ulps), Highway's Tanh (a few ulps
// of a value <= 1) and the multiplication by cap add eps·(8|x| + 16·cap); ALiBi's slope (rounded
// to the compute type) times an exact distance, 2·eps·|alibi|; each addition eps·(|a| + |b|).
// An argument of the cap after the bias near the overflow threshold: kAmbig.
// `with_cap` false leaves the cap out (cap = 0): Outputs::scores' kBiased stage.
Score modified_score(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j, Cls raw, long double x, long double xerr,
                     double bias, long double TMAX, long double eps, bool with_cap = true) {
  Score r;
  r.cls = Cls::kAmbig;
  if (raw == Cls::kAmbig) return r;
  if (raw == Cls::kNaN) { r.cls = Cls::kNaN; return r; }
  // The kernels hold cap in the compute type; kReference computes in float64.
  const bool f32_arith = c.compute() == DType::kFloat32 && c.opt.backend != Backend::kReference;
  const long double cap = !with_cap ? 0 : f32_arith ? static_cast<long double>(static_cast<float>(c.opt.softcap)) : c.opt.softcap;
  const bool after = c.opt.softcap_order == sdpa::Options::SoftcapOrder::kAfterBias;
  const long double a = c.alibi(b, h, i, j), aerr = 2 * eps * std::fabs(a);
  const auto capped = [&](long double v, long double verr, long double& out_err) {
    out_err = verr + eps * (8 * std::fabs(v) + 16 * cap);
    return cap * std::tanh(v / cap);
  };
  long double v = x, verr = xerr;
  int inf = raw == Cls::kPosInf ? 1 : raw == Cls::kNegInf ? -1 : 0;  // the class of v while infinite
  if (cap > 0 && !after) {
    if (inf != 0) { v = inf * cap; verr = 16 * eps * cap; inf = 0; }
    else v = capped(v, verr, verr);
  }
  // + alibi + bias (finite): an infinite v stays so.
  if (inf == 0) {
    const long double va = v + a, t = va + bias;
    const long double terr = verr + aerr + eps * (std::fabs(v) + std::fabs(a)) + eps * (std::fabs(va) + std::fabs(bias));
    const long double big = std::max(std::fabs(va), std::fabs(t));
    if (std::fabs(t) - terr > 1.001L * TMAX) {
      inf = t > 0 ? 1 : -1;
    } else if (big + terr >= 0.999L * TMAX) {
      return r;  // which side of the threshold is rounding
    } else {
      v = t;
      verr = terr;
    }
  }
  if (cap > 0 && after) {
    // -inf stays -inf (blocked: weight 0); +inf becomes cap.
    if (inf > 0) { v = cap; verr = 16 * eps * cap; inf = 0; }
    else if (inf == 0) v = capped(v, verr, verr);
  }
  if (inf != 0) { r.cls = inf > 0 ? Cls::kPosInf : Cls::kNegInf; return r; }
  if (std::fabs(v) + verr >= 0.999L * TMAX) return r;
  r.cls = Cls::kFinite;
  r.s = v;
  r.err = verr;
  return r;
}

// The range and the arithmetic of c's scores: the range is the inputs' dtype's for every backend
// (kReference rounds q·scale, each product and the score to it); the arithmetic is float64 in
// kReference (the header's rule). 16-bit inputs compute in float32: the range and the arithmetic
// are float32's (kReference rounds to float32's range, src/reference.cc).
struct ScoreArith {
  bool f32, f32_arith;
  long double TMAX, eps, scale;
};
ScoreArith score_arith(const Case& c) {
  const bool f32 = c.compute() == DType::kFloat32, f32_arith = f32 && c.opt.backend != Backend::kReference;
  return {f32, f32_arith, f32 ? FLT_MAX : DBL_MAX, f32_arith ? FLT_EPSILON : DBL_EPSILON,
          f32_arith ? static_cast<long double>(static_cast<float>(c.scale())) : c.scale()};
}

// The class of x = Σ_d (q_d·scale)·k_d alone (no mask, bias or modifier; Outputs::scores' kScaled
// stage) in the compute type, robust to the order of the sum and to FMA: kAmbig when rounding
// could decide it; kFinite with s = x and err its bound.
Score raw_score(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  Score r;
  const ScoreArith a = score_arith(c);
  const bool f32 = a.f32;
  const long double TMAX = a.TMAX, eps = a.eps, scale = a.scale;
  const int64_t kvh = h / c.d.group();
  bool pinf = false, ninf = false, nan = false, ambig = false, ambig_pos = false, ambig_neg = false;
  long double sum = 0, sabs = 0;
  // The score is Σ_d (q_d · scale) · k_d + bias: the scale multiplies q first (the header).
  for (int64_t e = 0; e < c.d.Dk; ++e) {
    const long double x = c.q.at4(b, h, i, e), y = c.k.at4(b, kvh, j, e);
    if (std::isnan(x) || std::isnan(y)) { nan = true; continue; }
    if (std::isinf(x) && scale == 0) { nan = true; continue; }
    // q · scale is one rounded multiply in every backend: it overflows to ±inf and underflows
    // to ±0 at the ends of the inputs' range (kReference rounds to them too; 0 · inf = NaN).
    long double xs = x * scale;
    const long double xr = f32 ? static_cast<long double>(static_cast<float>(xs)) : static_cast<long double>(static_cast<double>(xs));
    if (std::isinf(xr) || xr == 0) xs = xr;
    if ((std::isinf(xs) && y == 0) || (std::isinf(y) && xs == 0)) { nan = true; continue; }
    const long double p = xs * y;
    if (std::isinf(p) || std::fabs(p) > 3 * TMAX) { (p > 0 ? pinf : ninf) = true; continue; }
    if (std::fabs(p) > 0.999L * TMAX) { ambig = true; (p > 0 ? ambig_pos : ambig_neg) = true; continue; }
    sum += p;
    sabs += std::fabs(p);
  }
  r.cls = Cls::kAmbig;
  if (nan) { r.cls = Cls::kNaN; return r; }
  // Overflowing products of both signs: inf - inf = NaN when each product is rounded, but a
  // fused multiply-add adds the next exact product to the inf so far and keeps its sign.
  if (pinf && ninf) return r;
  const long double derr = (c.d.Dk + 2) * eps * sabs;
  if (pinf || ninf) {
    // The finite products' partial sums may themselves overflow, to the other infinity.
    if (sabs + derr >= 0.999L * TMAX) return r;
    // A product near the overflow threshold of the other sign may or may not become inf - inf.
    if ((pinf && ambig_neg) || (ninf && ambig_pos)) return r;
    r.cls = pinf ? Cls::kPosInf : Cls::kNegInf;
    return r;
  }
  if (ambig) return r;
  if (sabs + derr >= 0.999L * TMAX) return r;
  r.cls = Cls::kFinite;
  r.s = sum;
  r.err = derr;
  return r;
}

// The class of score s = Σ_d (q_d·scale)·k_d + bias in the compute type (max = FLT_MAX or DBL_MAX),
// robust to the order of the sum and to FMA: kAmbig when rounding could decide it. With
// `capped` false, the modifiers without the softcap (Outputs::scores' kBiased stage).
Score classify(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j, bool capped = true) {
  Score r;
  const double bias = mask_bias(c, b, h, i, j);
  if (!key_allowed(c, b, i, j) || bias == -kInf) return r;
  const Score raw = raw_score(c, b, h, i, j);
  if (raw.cls == Cls::kNaN || raw.cls == Cls::kAmbig) return raw;
  const ScoreArith a = score_arith(c);
  const long double TMAX = a.TMAX, eps = a.eps;
  if (c.modified()) return modified_score(c, b, h, i, j, raw.cls, raw.s, raw.err, bias, TMAX, eps, capped);
  if (raw.cls != Cls::kFinite) return raw;
  const long double x = raw.s, xerr = raw.err;
  const long double s = x + bias, serr = xerr + eps * (std::fabs(x) + std::fabs(bias));
  if (std::fabs(s) - serr > 1.001L * TMAX) { r.cls = s > 0 ? Cls::kPosInf : Cls::kNegInf; return r; }
  if (std::fabs(s) + serr >= 0.999L * TMAX) { r.cls = Cls::kAmbig; return r; }
  r.cls = Cls::kFinite;
  r.s = s;
  r.err = serr;
  return r;
}

// Dropout keep decisions (1 kept, 0 dropped) for every (b, h, i, j), C order; empty without dropout.
std::vector<uint8_t> keep_mask(const Case& c) {
  if (c.opt.dropout_p <= 0) return {};
  Tensor m(DType::kBool, c.w_shape(), Role::kAny, false, LayoutSpec::plain());
  if (m.numel() == 0) return {};
  sdpa::dropout_mask(c.opt.dropout_p, c.opt.seed.value_or(0), m.view());
  std::vector<uint8_t> r(static_cast<size_t>(m.numel()));
  for (int64_t n = 0; n < m.numel(); ++n) r[static_cast<size_t>(n)] = m.flat(n) != 0;
  return r;
}

struct Outs {
  Tensor out;
  std::optional<Tensor> weights, lse;
  sdpa::Outputs outputs() const {
    sdpa::Outputs o;
    o.out = out.view();
    if (weights) o.weights = weights->view();
    if (lse) o.lse = lse->view();
    return o;
  }
  bool bitwise_equal(const Outs& o, std::string& why) const {
    auto cmp = [&](const Tensor& a, const Tensor& b, const char* name) {
      for (int64_t n = 0; n < a.numel(); ++n) {
        if (!same_bits(a.flat(n), b.flat(n))) {
          why = std::string(name) + "[" + std::to_string(n) + "]: " + num(a.flat(n)) + " vs " + num(b.flat(n));
          return false;
        }
      }
      return true;
    };
    return cmp(out, o.out, "out") && (!weights || !o.weights || cmp(*weights, *o.weights, "weights")) &&
           (!lse || !o.lse || cmp(*lse, *o.lse, "lse"));
  }
};

Outs make_outs(const Case& c, bool weights, bool lse, bool fancy_layout) {
  Outs o;
  o.out.init(c.dtype, c.out_shape(), Role::kUnitLast, false, fancy_layout ? c.out_ls : LayoutSpec::plain());
  if (weights) o.weights.emplace(c.compute(), c.w_shape(), Role::kAny, false, fancy_layout ? c.w_ls : LayoutSpec::plain());
  if (lse) o.lse.emplace(c.compute(), c.lse_shape(), Role::kAny, false, fancy_layout ? c.l_ls : LayoutSpec::plain());
  return o;
}

// Runs `call` (named `name`); turns exceptions into check failures (a valid call must not throw).
template <class F>
void expect_no_throw(const char* name, F call) {
  std::string what;
  bool other = false;
  try {
    call();
    return;
  } catch (const sdpa::Error& e) {
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
    other = true;
  }
  check(!other, "other_exception", [&] { return std::string(name) + " threw a non-sdpa::Error exception: " + what; });
  // (d): a valid call throws only for a scale the compute type cannot hold.
  check(false, "unexpected_error", [&] { return std::string(name) + " threw sdpa::Error on a valid call: " + what; });
}

void run_forward(const Case&, const sdpa::Inputs& in, const Outs& o, const sdpa::Options& opt) {
  expect_no_throw("attention", [&] { sdpa::attention(in, o.outputs(), opt); });
}

void check_outs_written(const Outs& o) {
  auto one = [](const Tensor& t, const char* name) {
    const std::string r = t.guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  };
  one(o.out, "out");
  if (o.weights) one(*o.weights, "weights");
  if (o.lse) one(*o.lse, "lse");
}

// (a)-(c): per row, from the classified scores.
void check_edge_semantics(const Case& c, const Outs& o) {
  const Dims& d = c.d;
  const bool f32 = c.compute() == DType::kFloat32 && c.opt.backend != Backend::kReference;
  // Results are stored in the inputs' dtype: kReference's float64 values are rounded to it.
  // out has q's dtype (16-bit: its own eps, range and smallest normal); weights and lse the
  // compute type's (float32 for 16-bit q).
  const long double out_eps = eps_of(c.dtype), w_eps = eps_of(c.compute());
  const long double out_store_max = max_of(c.dtype), out_min_normal = min_normal_of(c.dtype);
  const long double TMAX = f32 ? FLT_MAX : DBL_MAX;
  const long double zero_below = f32 ? -110 : -760, nonzero_above = f32 ? -80 : -700;
  const std::vector<uint8_t> keep = keep_mask(c);
  const double keep_scale = c.opt.dropout_p > 0 ? 1.0 / (1.0 - c.opt.dropout_p) : 1.0;
  std::vector<Score> sc(static_cast<size_t>(d.Nk));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i;
        const int64_t kvh = h / d.group();
        int n_nan = 0, n_pinf = 0, n_fin = 0, n_ambig = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          sc[j] = classify(c, b, h, i, j);
          n_nan += sc[j].cls == Cls::kNaN;
          n_pinf += sc[j].cls == Cls::kPosInf;
          n_fin += sc[j].cls == Cls::kFinite;
          n_ambig += sc[j].cls == Cls::kAmbig;
        }
        auto W = [&](int64_t j) { return o.weights->at4(b, h, i, j); };
        auto where = [&](const char* what, int64_t x) {
          return std::string(what) + "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i) +
                 (x >= 0 ? ", " + std::to_string(x) : std::string()) + "]";
        };
        // Blocked keys: weight 0 (NaN accepted in a NaN row, where the header's NaN rule may reach it).
        if (o.weights) {
          for (int64_t j = 0; j < d.Nk; ++j) {
            if (sc[j].cls != Cls::kBlocked) continue;
            const double w = W(j);
            check(w == 0 || (std::isnan(w) && (n_nan > 0 || n_ambig > 0)), "blocked_weight",
                  [&] { return where("weights", j) + " = " + num(w) + " but causal/window/mask block that key"; });
          }
        }
        if (n_ambig > 0) continue;
        const double lse = o.lse ? o.lse->at4(0, b, h, i) : 0.0;
        if (n_nan > 0) {
          if (o.lse) check(std::isnan(lse), "nan_row", [&] { return where("lse", -1) + " = " + num(lse) + " but an allowed key's score is NaN"; });
          if (o.weights)
            for (int64_t j = 0; j < d.Nk; ++j)
              if (sc[j].cls != Cls::kBlocked && sc[j].cls != Cls::kNegInf)  // a -inf key: 0 or NaN
                check(std::isnan(W(j)), "nan_row", [&] { return where("weights", j) + " = " + num(W(j)) + " but an allowed key's score is NaN"; });
          if (c.opt.dropout_p == 0)
            for (int64_t e = 0; e < d.Dv; ++e) {
              const double x = o.out.at4(b, h, i, e);
              check(std::isnan(x), "nan_row", [&] { return where("out", e) + " = " + num(x) + " but an allowed key's score is NaN"; });
            }
          continue;
        }
        if (n_pinf > 0) {
          if (o.lse) check(lse == kInf, "inf_row", [&] { return where("lse", -1) + " = " + num(lse) + " but " + std::to_string(n_pinf) + " allowed keys score +inf"; });
          if (o.weights)
            for (int64_t j = 0; j < d.Nk; ++j) {
              const double want = sc[j].cls == Cls::kPosInf ? 1.0 / n_pinf : 0.0;
              const double w = W(j);
              check(std::fabs(w - want) <= 4 * w_eps, "inf_row",
                    [&] { return where("weights", j) + " = " + num(w) + ", want " + num(want) + " (" + std::to_string(n_pinf) + " keys score +inf)"; });
            }
          for (int64_t e = 0; e < d.Dv; ++e) {
            long double want = 0, mag = 0;
            bool any_nan = false, pos = false, neg = false;
            for (int64_t j = 0; j < d.Nk; ++j) {
              if (sc[j].cls != Cls::kPosInf) continue;
              const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * keep_scale;
              if (z == 0) continue;
              const long double vv = c.v.at4(b, kvh, j, e);
              if (std::isnan(vv)) any_nan = true;
              else if (std::isinf(vv)) (vv > 0 ? pos : neg) = true;
              else { want += vv * z / n_pinf; mag += std::fabs(vv * z); }
            }
            const double x = o.out.at4(b, h, i, e);
            if (any_nan || (pos && neg)) {
              check(std::isnan(x), "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want NaN (NaN/inf in v of a +inf key)"; });
            } else if (pos || neg) {
              check(x == (pos ? kInf : -kInf), "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want " + (pos ? "+inf" : "-inf"); });
            } else if (mag < 0.25L * TMAX) {
              // kReference computes in float64: a mean past float32's range overflows when stored
              // (and a float32 mean past a 16-bit out's range).
              const long double stored_max = out_store_max;
              const long double tol = 8 * out_eps * mag + out_min_normal;
              if (std::fabs(want) - tol > stored_max) {
                check(x == (want > 0 ? kInf : -kInf), "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want " + (want > 0 ? "+inf" : "-inf") + " (the mean of the +inf keys' v rows overflows the output dtype)"; });
              } else if (std::fabs(want) + tol <= stored_max) {
                check(std::fabs(x - want) <= tol, "inf_row", [&] { return where("out", e) + " = " + num(x) + ", want " + num(static_cast<double>(want)) + " (mean of the v rows of the +inf keys)"; });
              }
            }
          }
          continue;
        }
        if (n_fin == 0) {  // nothing allowed, or every allowed score -inf
          // With sinks: lse = the head's sink (the header), stored in the compute type.
          const double no_key_lse = !c.has_sinks() ? -kInf : c.compute() == DType::kFloat32 ? static_cast<double>(static_cast<float>(c.sink(h))) : c.sink(h);
          if (o.lse) check(same_bits(lse, no_key_lse), "masked_row", [&] { return where("lse", -1) + " = " + num(lse) + " but the row has no allowed key with a score above -inf" + (c.has_sinks() ? " (want the sink " + num(no_key_lse) + ")" : std::string()); });
          if (o.weights)
            for (int64_t j = 0; j < d.Nk; ++j)
              check(W(j) == 0, "masked_row", [&] { return where("weights", j) + " = " + num(W(j)) + " but the row is fully masked"; });
          for (int64_t e = 0; e < d.Dv; ++e) {
            const double x = o.out.at4(b, h, i, e);
            check(x == 0, "masked_row", [&] { return where("out", e) + " = " + num(x) + " but the row is fully masked"; });
          }
          continue;
        }
        // Finite scores (some maybe -inf): -inf keys weight 0; lse finite; out per (c).
        // lse is a smooth max: off by at most the largest error of any score (not only the top
        // one's: a key whose score cancels from huge products may be the max in the kernels).
        long double m = -INFINITY, merr = 0;
        for (int64_t j = 0; j < d.Nk; ++j)
          if (sc[j].cls == Cls::kFinite) {
            m = std::max(m, sc[j].s);
            merr = std::max(merr, sc[j].err);
          }
        // A sink is one more term of the softmax's sum (exact: the sink is finite, as stored).
        if (c.has_sinks()) m = std::max<long double>(m, c.sink(h));
        long double l = c.has_sinks() ? std::exp(static_cast<long double>(c.sink(h)) - m) : 0;
        for (int64_t j = 0; j < d.Nk; ++j)
          if (sc[j].cls == Cls::kFinite) l += std::exp(sc[j].s - m);
        const long double lse_exact = m + std::log(l);
        // kReference computes in float64 and may legitimately round a huge lse to inf in float32.
        const long double out_max = max_of(c.compute());  // lse's storage
        if (o.lse && std::fabs(lse_exact) + merr < 0.999L * out_max) check(std::isfinite(lse), "finite_row", [&] { return where("lse", -1) + " = " + num(lse) + " but every allowed score is finite or -inf (lse ~ " + num(static_cast<double>(lse_exact)) + ")"; });
        if (o.weights)
          for (int64_t j = 0; j < d.Nk; ++j) {
            const double w = W(j);
            if (sc[j].cls == Cls::kNegInf) check(w == 0, "finite_row", [&] { return where("weights", j) + " = " + num(w) + " but that key's score is -inf"; });
            else check(w >= 0 && w <= 1, "finite_row", [&] { return where("weights", j) + " = " + num(w) + ", not in [0, 1] (finite scores)"; });
          }
        // (c): classify each key's weight as robustly zero / nonzero / unsure.
        for (int64_t e = 0; e < d.Dv; ++e) {
          bool unsure = false, any_nan = false, pos = false, neg = false;
          long double mag = 0;
          for (int64_t j = 0; j < d.Nk; ++j) {
            const long double vv = c.v.at4(b, kvh, j, e);
            const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * keep_scale;
            if (sc[j].cls != Cls::kFinite || z == 0) continue;  // weight 0 or dropped: contributes nothing
            const long double t = sc[j].s - lse_exact;
            if (t + sc[j].err + merr < zero_below) continue;  // underflows to weight 0
            const bool nonzero = t - sc[j].err - merr > nonzero_above;
            if (!std::isfinite(vv)) {
              if (!nonzero) { unsure = true; break; }
              if (std::isnan(vv)) any_nan = true; else (vv > 0 ? pos : neg) = true;
            } else {
              mag += std::fabs(vv) * z;
            }
          }
          if (unsure) continue;
          const double x = o.out.at4(b, h, i, e);
          if (any_nan || (pos && neg)) {
            check(std::isnan(x), "finite_row", [&] { return where("out", e) + " = " + num(x) + ", want NaN (NaN, or +inf and -inf, in v rows of keys with nonzero weight)"; });
          } else if (pos || neg) {
            if (mag < 0.25L * std::min(TMAX, out_store_max)) check(x == (pos ? kInf : -kInf), "finite_row", [&] { return where("out", e) + " = " + num(x) + ", want " + (pos ? "+inf" : "-inf") + " (inf in the v row of a key with nonzero weight)"; });
          } else if (mag < 0.25L * std::min(TMAX, out_store_max)) {
            check(std::isfinite(x), "finite_row", [&] { return where("out", e) + " = " + num(x) + " but every key with nonzero weight has a finite v row (keys of weight 0 must contribute nothing)"; });
          }
        }
      }
}

// ---- The tolerance rule (tests/test_util.cc: matches_reference) ----

double max_abs_finite(const std::vector<double>& xs) {
  double m = 0;
  for (double x : xs) if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

struct Vals { std::vector<double> out, weights, lse; };
Vals vals(const Outs& o) { return {o.out.values(), o.weights ? o.weights->values() : std::vector<double>{}, o.lse ? o.lse->values() : std::vector<double>{}}; }

// Case with q, k, v, mask converted to dt (contiguous).
Case converted(const Case& c, DType dt) {
  Case r;
  r.dtype = dt; r.kv = dt; r.rank = c.rank; r.d = c.d; r.opt = c.opt;
  r.q = c.q.converted(dt); r.k = c.k.converted(dt); r.v = c.v.converted(dt);
  if (c.mask) r.mask.emplace(c.mask->converted(c.mask->dtype() == DType::kBool ? DType::kBool : dt));
  r.seqlens = c.seqlens; r.sl = c.sl; r.sl_view = c.sl_view; r.bad_sl = c.bad_sl;
  r.mods = c.mods; r.backward = c.backward;  // the modifiers' tensors are shared (opt holds their views)
  r.blocks = c.blocks;  // the block mask too (bool: the same in every dtype)
  return r;
}

Vals run_plain(const Case& c, Backend be) {
  sdpa::Options o = c.opt;
  o.backend = be;
  Outs out = make_outs(c, true, true, false);
  run_forward(c, c.inputs(), out, o);
  return vals(out);
}

// false when no tolerance can be derived (kNaive and kReference disagree on non-finite values).
bool max_error(const std::vector<double>& a, const std::vector<double>& b, double& err) {
  for (size_t n = 0; n < a.size(); ++n) {
    if (std::isfinite(a[n]) && std::isfinite(b[n])) err = std::max(err, std::abs(a[n] - b[n]));
    else if (!(a[n] == b[n])) return false;
  }
  return true;
}

// Failures within kNearFactor times the tolerance are reported as "tolerance_near" (the rule's
// maximum error is a noisy statistic on the fuzzer's tiny cases: see FINDINGS.md), beyond it as
// "tolerance".
constexpr double kNearFactor = 4;

// `overflow`: where rounding to the stored dtype gives inf (overflow_at; inf for float32 and
// float64, whose tame results never get near it). A 16-bit out can: tame values reach 1e3, and
// dropout's 1 / (1 - p) = 1000 takes a float16 out past 65504. Which side of the threshold a
// result lands on is rounding, so an inf against a finite value of the same sign within tol of
// the threshold passes (the finite one is then within tol of a value that rounds to inf).
std::string all_close(const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol,
                      double& worst_ratio, double overflow = kInf) {
  std::string first;
  for (size_t n = 0; n < got.size(); ++n) {
    const bool inf = std::isinf(got[n]) || std::isinf(want[n]);
    bool ok = inf ? got[n] == want[n] : std::abs(got[n] - want[n]) <= tol;
    if (!ok && inf && overflow < kInf) {
      const double fin = std::isinf(got[n]) ? want[n] : got[n], infv = std::isinf(got[n]) ? got[n] : want[n];
      ok = std::isfinite(fin) && std::signbit(fin) == std::signbit(infv) && std::abs(fin) + tol >= overflow;
    }
    if (ok) continue;
    const double ratio = inf || std::isnan(got[n]) ? kInf : std::abs(got[n] - want[n]) / tol;
    if (ratio > worst_ratio || first.empty()) {
      worst_ratio = std::max(worst_ratio, ratio);
      first = std::string(what) + "[" + std::to_string(n) + "] = " + num(got[n]) + ", kReference " + num(want[n]) + ", tol " + num(tol) +
              " (" + num(ratio) + " x tol)";
    }
  }
  return first;
}

void check_tolerance(const Case& c, const Outs& got) {
  double err[3] = {0, 0, 0};
  Vals ref;
  auto measure = [&](const Case& in, double scale, Vals& r) {
    r = run_plain(in, Backend::kReference);
    const Vals naive = run_plain(in, Backend::kNaive);
    double e[3] = {0, 0, 0};
    if (!max_error(naive.out, r.out, e[0]) || !max_error(naive.weights, r.weights, e[1]) || !max_error(naive.lse, r.lse, e[2])) return false;
    for (int n = 0; n < 3; ++n) err[n] = std::max(err[n], e[n] * scale);
    return true;
  };
  if (!measure(c, 1.0, ref)) return;
  double factor = 2;
  if (c.dtype == DType::kFloat64) {
    Vals ref32;
    if (!measure(converted(c, DType::kFloat32), DBL_EPSILON / FLT_EPSILON, ref32)) return;
    factor = 3;
  }
  const Vals g = vals(got);
  const double e = eps_of(c.compute());  // weights and lse are stored in the compute type (test_util.cc)
  const double out_max = max_abs_finite(c.v.values()) / (1 - c.opt.dropout_p);
  const double S2 = 2 * max_score_magnitude(c);  // the scores' own rounding (test_util.cc)
  // 16-bit out: one more unit in its last place (test_util.cc: a float32 result near a tie may
  // round the other way than kReference's float64 one).
  const double out_ulp = is16(c.dtype) ? eps_of(c.dtype) * out_max : 0.0;
  // Summation, fuzz-only (as in the backward rule below): out and l are sums over up to Nk keys,
  // whose roundings grow like sqrt(Nk)·eps relative to Σ p|v| and l (F6 fourth: float64, Nk 2047,
  // out off by 1.09x a floor without it).
  const double sum_n = std::sqrt(static_cast<double>(std::max<int64_t>(1, c.d.Nk)));
  double ratio = 0;
  std::string r = all_close("out", g.out, ref.out, factor * err[0] + e * out_max * (std::max(4.0, S2) + sum_n) + out_ulp, ratio,
                            overflow_at(c.dtype));
  if (got.weights) { const std::string x = all_close("weights", g.weights, ref.weights, factor * err[1] + e * (std::max(4.0, S2) + sum_n), ratio); if (r.empty()) r = x; }
  if (got.lse) { const std::string x = all_close("lse", g.lse, ref.lse, factor * err[2] + e * (std::max(4 * (1 + max_abs_finite(ref.lse)), S2) + sum_n), ratio); if (r.empty()) r = x; }
  check(r.empty(), ratio <= kNearFactor ? "tolerance_near" : "tolerance",
        [&] { return std::string(backend_name(c.opt.backend)) + " vs kReference: " + r + "; worst " + num(ratio) + " x tol"; });
}

// ---- Outputs::stats and Outputs::scores against kReference (stats mode: mode bits 0xa0) ----
//
// One more call of the case's backend with every statistic (allowed, entropy, entropy_normalized,
// max_weight, argmax, top k for k in [0, 32], pooled_weights for G in [0, 2 Nk + 3]) and the raw
// scores at one ScoresStage, in padded / permuted / negative-stride layouts; the same with
// kReference. Checked (names as in the header comment):
//   stats_invariant  out, weights, lse of that call bit for bit the case's own (stats change none)
//   stats_self       max_weight and the top-k weights bit for bit the call's weights at argmax and
//                    at the top-k keys; pooled_weights the weights summed in key order in the
//                    compute type (bit for bit for kFlash / kAuto, within a run's roundings else)
//   stats_rows       per row, from the oracle's score classes (classify, for each backend's
//                    arithmetic): allowed = the keys scoring above -inf, exactly; a row with a NaN
//                    score: entropy, normalized, max_weight, top-k weights NaN, argmax and indices
//                    -1; a row with no key above -inf: 0, 0, 0, -1, -1 / 0; +inf keys share the
//                    weight (max_weight 1 / count, entropy log count); normalized 0 where allowed <= 1
//   stats_rank       argmax and the top-k indices: allowed keys, distinct, the first
//                    min(k, allowed), then -1; never a key below another by more than the two scores'
//                    rounding bounds (the oracle's), among keys left out too; equal scores (+inf, or
//                    the same key row, bias and ALiBi term) in increasing key order; argmax = the
//                    first index. For kReference and the case's backend alike
//   stats_tolerance  (tame) entropy, entropy_normalized, max_weight, top-k weights and
//                    pooled_weights against kReference's by the tolerance rule (kNaive's measured
//                    error times 2, or 3 for float64 with float32's scaled; floors as check_tolerance,
//                    and for the entropy tests/stats_test.cc's e·max(4(1 + H), S2·spread));
//                    "stats_tolerance_near" within kNearFactor
//   scores           every element of Outputs::scores of both calls in the oracle's class at that
//                    stage (kScaled: x for every key below the sequence's length; kBiased / kFinal:
//                    -inf where causal, the window, a mask or the block mask blocks the key), exactly,
//                    and a finite one within the oracle's bound of its value (plus the rounding to
//                    the compute type, and underflow's absolute error); not judged where kAmbig
//   guards, unwritten for every view.

// The mode byte's bits that run check_stats (dense calls), both set: a quarter of the inputs (it
// about doubles an input's time; CI's 2,500 inputs must fit their 135 s).
constexpr uint8_t kModeStats = 0xa0;
uint8_t g_mode = 0;

// An int64 output of the statistics (allowed, argmax, topk_indices), C order, exactly sized,
// every element first kSentinelIndex (unwritten if it stays).
constexpr int64_t kSentinelIndex = INT64_MIN + 0x5a5a;
struct IndexOut {
  std::vector<int64_t> shape, vals;
  explicit IndexOut(std::vector<int64_t> s) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    vals.assign(static_cast<size_t>(n), kSentinelIndex);
  }
  sdpa::TensorView view() {
    sdpa::TensorView t;
    t.data = vals.empty() ? nullptr : vals.data();
    t.dtype = DType::kInt64;
    t.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.shape[d] = shape[static_cast<size_t>(d)];
      t.strides[d] = stride;
      stride *= std::max<int64_t>(1, shape[static_cast<size_t>(d)]);
    }
    return t;
  }
  int64_t at(int64_t row, int64_t k, int64_t x) const { return vals[static_cast<size_t>(row * k + x)]; }
};

// A layout for a statistics output (no zero strides: outputs), from the mode's PRNG.
LayoutSpec stats_layout(std::mt19937_64& rng) {
  LayoutSpec ls;
  ls.perm = static_cast<uint8_t>(rng() % 24);
  ls.pad = static_cast<uint8_t>(rng() % 16);
  ls.neg = static_cast<uint8_t>(rng() % 16);
  ls.misalign = static_cast<uint8_t>(rng() % 3);
  ls.last = static_cast<uint8_t>(1 + rng() % 3);
  ls.odd_unit = rng() % 2;
  return ls;
}

struct StatsRun {
  Outs base;  // out, weights, lse
  Tensor entropy, normalized, max_weight, topk_w, pooled, scores;  // the compute type
  IndexOut allowed, argmax, topk_i;
  int64_t k = 0, G = 0;
  sdpa::ScoresStage stage = sdpa::ScoresStage::kFinal;
  sdpa::KernelPath path = sdpa::KernelPath::kSimd;
};

const char* stage_name(sdpa::ScoresStage s) {
  return s == sdpa::ScoresStage::kScaled ? "kScaled" : s == sdpa::ScoresStage::kBiased ? "kBiased" : "kFinal";
}

// The case's call on backend `be` with every statistic (top k if k > 0) and the scores at `stage`;
// layouts from rng where `fancy`, else plain.
StatsRun run_stats(const Case& c, Backend be, int64_t k, int64_t G, sdpa::ScoresStage stage, std::mt19937_64* rng) {
  const std::vector<int64_t> rows = c.lse_shape();
  std::vector<int64_t> top = rows, pool = rows;
  top.push_back(k);
  pool.push_back(G);
  const auto ls = [&] { return rng ? stats_layout(*rng) : LayoutSpec::plain(); };
  const DType ct = c.compute();
  StatsRun r{make_outs(c, true, true, false),
             Tensor(ct, rows, Role::kAny, false, ls()), Tensor(ct, rows, Role::kAny, false, ls()),
             Tensor(ct, rows, Role::kAny, false, ls()), Tensor(ct, top, Role::kAny, false, ls()),
             Tensor(ct, pool, Role::kAny, false, ls()), Tensor(ct, c.w_shape(), Role::kAny, false, ls()),
             IndexOut(rows), IndexOut(rows), IndexOut(top), k, G, stage};
  sdpa::Outputs o = r.base.outputs();
  o.stats.allowed = r.allowed.view();
  o.stats.entropy = r.entropy.view();
  o.stats.entropy_normalized = r.normalized.view();
  o.stats.max_weight = r.max_weight.view();
  o.stats.argmax = r.argmax.view();
  if (k > 0) {
    o.stats.topk_weights = r.topk_w.view();
    o.stats.topk_indices = r.topk_i.view();
  }
  o.stats.pooled_weights = r.pooled.view();
  o.scores = r.scores.view();
  o.scores_stage = stage;
  sdpa::Options opt = c.opt;
  opt.backend = be;
  expect_no_throw(be == Backend::kReference ? "attention (stats, kReference)" : "attention (stats)",
                  [&] { sdpa::attention(c.inputs(), o, opt); });
  r.path = sdpa::last_kernel_path();
  return r;
}

// Sets c.opt.backend for the oracle (classify reads the backend's arithmetic), restored on exit.
struct BackendAs {
  Case& c;
  Backend old;
  BackendAs(Case& cc, Backend be) : c(cc), old(cc.opt.backend) { c.opt.backend = be; }
  ~BackendAs() { c.opt.backend = old; }
};

// The per-row quantities the tolerance rule reads: measured kNaive errors of the weights and the
// entropy, and kReference's largest entropy and spread (stats_test.cc's entropy_of).
struct StatsTol {
  bool ok = false;
  double w = 0, h = 0;
};

// Per row: the largest entropy and Σ w |log w - mean| of the weights (how far a score error moves
// the entropy: at most max|δs| times this; tests/stats_test.cc).
void entropy_spread(const Case& c, const Tensor& weights, double& H_max, double& spread_max) {
  H_max = spread_max = 0;
  const Dims& d = c.d;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        double H = 0, mass = 0, mean = 0, spread = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double w = weights.at4(b, h, i, j);
          if (w > 0) H -= w * std::log(w), mass += w, mean += w * std::log(w);
        }
        if (mass > 0) mean /= mass;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double w = weights.at4(b, h, i, j);
          if (w > 0) spread += w * std::abs(std::log(w) - mean);
        }
        if (std::isfinite(H)) H_max = std::max(H_max, H);
        if (std::isfinite(spread)) spread_max = std::max(spread_max, spread);
      }
}

// kNaive's error against kReference on the weights and the entropy (plain layouts), scaled;
// false where their non-finite values differ (no tolerance can be derived, as max_error).
bool measure_stats(const Case& c, int64_t k, int64_t G, double scale, StatsTol& t) {
  const StatsRun r = run_stats(c, Backend::kReference, k, G, sdpa::ScoresStage::kFinal, nullptr);
  const StatsRun n = run_stats(c, Backend::kNaive, k, G, sdpa::ScoresStage::kFinal, nullptr);
  double ew = 0, eh = 0;
  if (!max_error(n.base.weights->values(), r.base.weights->values(), ew) || !max_error(n.entropy.values(), r.entropy.values(), eh))
    return false;
  t.w = std::max(t.w, ew * scale);
  t.h = std::max(t.h, eh * scale);
  return true;
}

void check_stats(Case& c, const Outs& own) {
  const Dims& d = c.d;
  // The mode's draws: a PRNG seeded by the input's bytes (no byte of the input is consumed, so
  // every other check decodes and runs as it did).
  uint64_t seed = 1469598103934665603ull;
  for (size_t n = 0; n < g_size; ++n) seed = (seed ^ g_data[n]) * 1099511628211ull;
  std::mt19937_64 rng(seed);
  static const int64_t kTopK[] = {0, 1, 2, 3, 5, 8, 31, 32};
  const int64_t k = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 33) : kTopK[rng() % 8];
  const int64_t Gs[] = {0, 1, 2, 7, d.Nk, d.Nk + 3, static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * d.Nk + 4))};
  const int64_t G = Gs[rng() % 7];
  const auto stage = static_cast<sdpa::ScoresStage>(rng() % 3);
  const Backend be = c.opt.backend;
  const std::string saved_case = g_case;
  g_case = saved_case + "stats mode: top k " + std::to_string(k) + ", pooled G " + std::to_string(G) + ", scores " +
           stage_name(stage) + "\n";
  const StatsRun A = run_stats(c, be, k, G, stage, &rng);
  const StatsRun R = run_stats(c, Backend::kReference, k, G, stage, nullptr);

  // Guards and unwritten elements.
  for (const auto& [t_, name_] : {std::pair<const Tensor*, const char*>{&A.entropy, "entropy"}, {&A.normalized, "entropy_normalized"},
                                {&A.max_weight, "max_weight"}, {&A.topk_w, "topk_weights"}, {&A.pooled, "pooled_weights"},
                                {&A.scores, "scores"}}) {
    const Tensor* t = t_;
    const char* name = name_;
    if (t == &A.topk_w && k == 0) {
      check(t->guards_and_written().rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + " (not requested) was written"; });
      continue;
    }
    const std::string r = t->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  }
  for (const auto& [t_, name_] : {std::pair<const IndexOut*, const char*>{&A.allowed, "allowed"}, {&A.argmax, "argmax"}, {&A.topk_i, "topk_indices"}}) {
    const IndexOut* t = t_;
    const char* name = name_;
    if (t == &A.topk_i && k == 0) continue;
    const auto it = std::find(t->vals.begin(), t->vals.end(), kSentinelIndex);
    check(it == t->vals.end(), "unwritten", [&] { return std::string(name) + "[" + std::to_string(it - t->vals.begin()) + "] was not written"; });
  }
  {
    std::string why;
    check(own.bitwise_equal(A.base, why), "stats_invariant", [&] { return "the same call with every statistic and the scores requested differs: " + why; });
  }

  // stats_self: the statistics' weights are the call's own weights, bit for bit.
  const auto self = [&](const StatsRun& X) {
    const bool fused = &X == &A && (be == Backend::kFlash || be == Backend::kAuto);
    const Tensor& W = *X.base.weights;
    const double e = eps_of(c.compute());
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t i = 0; i < d.Nq; ++i) {
          const int64_t row = (b * d.Hq + h) * d.Nq + i;
          const std::string at = "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i);
          const int64_t am = X.argmax.at(row, 1, 0);
          if (am >= 0 && am < d.Nk) {
            const double mw = X.max_weight.at4(0, b, h, i), w = W.at4(b, h, i, am);
            check(same_bits(mw, w) || (std::isnan(mw) && std::isnan(w)), "stats_self",
                  [&] { return "max_weight" + at + "] = " + num(mw) + " but weights at argmax " + std::to_string(am) + " = " + num(w); });
          }
          for (int64_t x = 0; x < X.k; ++x) {
            const int64_t j = X.topk_i.at(row, X.k, x);
            if (j < 0 || j >= d.Nk) continue;  // stats_rank judges the indices
            const double tw = X.topk_w.at4(b, h, i, x), w = W.at4(b, h, i, j);
            check(same_bits(tw, w) || (std::isnan(tw) && std::isnan(w)), "stats_self",
                  [&] { return "topk_weights" + at + ", " + std::to_string(x) + "] = " + num(tw) + " but weights at key " + std::to_string(j) + " = " + num(w); });
          }
          // pooled_weights: key j in run floor(j · G / Nk), summed in key order in the compute type.
          std::vector<double> sums(static_cast<size_t>(X.G), 0.0), mass(static_cast<size_t>(X.G), 0.0);
          std::vector<int64_t> len(static_cast<size_t>(X.G), 0);
          for (int64_t j = 0; j < d.Nk && X.G > 0; ++j) {
            const size_t g = static_cast<size_t>(static_cast<__int128>(j) * X.G / d.Nk);
            const double w = W.at4(b, h, i, j);
            sums[g] = c.compute() == DType::kFloat32 ? static_cast<double>(static_cast<float>(sums[g]) + static_cast<float>(w)) : sums[g] + w;
            mass[g] += std::fabs(w);
            ++len[g];
          }
          for (int64_t g = 0; g < X.G; ++g) {
            const double got = X.pooled.at4(b, h, i, g), want = sums[static_cast<size_t>(g)];
            // Other backends sum in their own precision, rounded once: a run's worth of roundings.
            const double tol = fused ? 0.0 : e * static_cast<double>(len[static_cast<size_t>(g)] + 2) * mass[static_cast<size_t>(g)];
            check(same_bits(got, want) || (std::isnan(got) && std::isnan(want)) || std::fabs(got - want) <= tol, "stats_self",
                  [&] { return "pooled_weights" + at + ", " + std::to_string(g) + "] = " + num(got) + " but the weights of its run of keys sum to " + num(want) + " (tol " + num(tol) + ")"; });
          }
        }
  };
  self(A);
  self(R);

  // Equal scores by construction: the same key row (as values), mask bias and ALiBi term, or both
  // +inf. (Not on the bfloat16 dot-product path, where two tiles of keys may take different
  // arithmetic: F10.)
  std::vector<int64_t> krep(static_cast<size_t>(d.B * d.Hkv * d.Nk), -1);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t kvh = 0; kvh < d.Hkv; ++kvh) {
      std::map<std::vector<double>, int64_t> first;
      for (int64_t j = 0; j < d.Nk; ++j) {
        std::vector<double> row(static_cast<size_t>(d.Dk));
        for (int64_t e = 0; e < d.Dk; ++e) row[static_cast<size_t>(e)] = c.k.at4(b, kvh, j, e);
        krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)] = first.emplace(std::move(row), j).first->second;
      }
    }

  // stats_rows, stats_rank and scores for one call X of backend xb, from the oracle's classes.
  const auto judge = [&](const StatsRun& X, Backend xb) {
    BackendAs as(c, xb);
    const char* who = xb == Backend::kReference ? "kReference" : backend_name(be);
    const bool ties = !(c.all_bf16() && X.path != sdpa::KernelPath::kSimd);
    const double w_eps = eps_of(c.compute());
    // Underflow's absolute error, beside the oracle's relative bound: q·scale and each product may
    // lose up to the smallest normal number each (the bfloat16 dot-product instructions flush
    // subnormals), so key j's scores carry (Dk + 2 + Σ_d |k_d|) · min_normal more.
    const double tiny = min_normal_of(c.compute());
    std::vector<double> floor_of(static_cast<size_t>(d.Nk));
    std::vector<Score> sc(static_cast<size_t>(d.Nk));
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t i = 0; i < d.Nq; ++i) {
          const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
          const std::string at = std::string(who) + " [b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i);
          int64_t n_nan = 0, n_pinf = 0, n_fin = 0, n_ambig = 0;
          for (int64_t j = 0; j < d.Nk; ++j) {
            double ksum = 0;
            for (int64_t e = 0; e < d.Dk; ++e) ksum += std::fabs(c.k.at4(b, kvh, j, e));
            floor_of[static_cast<size_t>(j)] = tiny * (ksum + static_cast<double>(d.Dk + 2));
            sc[static_cast<size_t>(j)] = classify(c, b, h, i, j);
            const Cls cl = sc[static_cast<size_t>(j)].cls;
            n_nan += cl == Cls::kNaN;
            n_pinf += cl == Cls::kPosInf;
            n_fin += cl == Cls::kFinite;
            n_ambig += cl == Cls::kAmbig;
          }
          // The scores output at X's stage: the oracle's class, exactly, and a finite one within its
          // bound (plus its rounding to the compute type, and underflow: q·scale and each product
          // may lose up to the smallest subnormal each).
          std::string bad_score;
          for (int64_t j = 0; j < d.Nk && bad_score.empty(); ++j) {
            Score s;
            if (j >= c.keys_of(b)) s.cls = Cls::kNegInf;  // never read: -inf at every stage
            else if (X.stage == sdpa::ScoresStage::kScaled) s = raw_score(c, b, h, i, j);
            else if (X.stage == sdpa::ScoresStage::kBiased) s = classify(c, b, h, i, j, /*capped=*/false);
            else s = sc[static_cast<size_t>(j)];
            if (s.cls == Cls::kBlocked) s.cls = Cls::kNegInf;
            if (s.cls == Cls::kAmbig) continue;
            const double got = X.scores.at4(b, h, i, j);
            const auto where = [&] { return "scores" + at + ", " + std::to_string(j) + "] = " + num(got) + " at " + stage_name(X.stage) + ", want "; };
            if (s.cls != Cls::kFinite) {
              const bool ok = s.cls == Cls::kNaN ? std::isnan(got) : got == (s.cls == Cls::kPosInf ? kInf : -kInf);
              if (!ok) bad_score = where() + (s.cls == Cls::kNaN ? "NaN" : s.cls == Cls::kPosInf ? "+inf" : "-inf");
              continue;
            }
            const long double tol = s.err + w_eps * std::fabs(s.s) + floor_of[static_cast<size_t>(j)];
            if (!(std::isfinite(got) && std::fabs(got - s.s) <= tol)) bad_score = where() + num(static_cast<double>(s.s)) + " within " + num(static_cast<double>(tol));
          }
          check(bad_score.empty(), "scores", [&] { return bad_score; });
          const int64_t allowed = X.allowed.at(row, 1, 0);
          const int64_t sure = n_pinf + n_fin;
          check(allowed >= sure && allowed <= sure + n_ambig, "stats_rows", [&] {
            return "allowed" + at + "] = " + std::to_string(allowed) + ", want " + std::to_string(sure) +
                   (n_ambig ? " to " + std::to_string(sure + n_ambig) : std::string()) + " (the keys scoring above -inf)";
          });
          if (n_ambig > 0) continue;
          const double H = X.entropy.at4(0, b, h, i), Hn = X.normalized.at4(0, b, h, i), mw = X.max_weight.at4(0, b, h, i);
          const int64_t am = X.argmax.at(row, 1, 0);
          const auto cls_msg = [&](const char* what) { return std::string("row") + at + "] " + what + ": entropy " + num(H) + ", normalized " + num(Hn) + ", max_weight " + num(mw) + ", argmax " + std::to_string(am); };
          if (n_nan > 0) {
            check(std::isnan(H) && std::isnan(Hn) && std::isnan(mw) && am == -1, "stats_rows", [&] { return cls_msg("has a NaN score (want NaN, NaN, NaN, -1)"); });
            for (int64_t x = 0; x < X.k; ++x) {
              const int64_t j = X.topk_i.at(row, X.k, x);
              const double tw = X.topk_w.at4(b, h, i, x);
              check(j == -1 && std::isnan(tw), "stats_rows", [&] { return "top " + std::to_string(x) + " of row" + at + "] with a NaN score: key " + std::to_string(j) + ", weight " + num(tw) + " (want -1, NaN)"; });
            }
            continue;
          }
          if (sure == 0) {
            check(H == 0 && Hn == 0 && mw == 0 && am == -1, "stats_rows", [&] { return cls_msg("has no key above -inf (want 0, 0, 0, -1)"); });
            for (int64_t x = 0; x < X.k; ++x) {
              const int64_t j = X.topk_i.at(row, X.k, x);
              const double tw = X.topk_w.at4(b, h, i, x);
              check(j == -1 && tw == 0, "stats_rows", [&] { return "top " + std::to_string(x) + " of row" + at + "] with no key: key " + std::to_string(j) + ", weight " + num(tw) + " (want -1, 0)"; });
            }
            continue;
          }
          if (allowed <= 1) check(Hn == 0, "stats_rows", [&] { return cls_msg("allows one key (want normalized 0)"); });
          if (n_pinf > 0) {
            const double want = 1.0 / static_cast<double>(n_pinf), Hw = std::log(static_cast<double>(n_pinf));
            check(std::fabs(mw - want) <= 4 * w_eps && std::fabs(H - Hw) <= static_cast<double>(d.Nk + 4) * w_eps * (1 + Hw), "stats_rows",
                  [&] { return cls_msg(("has " + std::to_string(n_pinf) + " keys at +inf (want max_weight " + num(want) + ", entropy " + num(Hw) + ")").c_str()); });
          }
          // stats_rank: argmax as a list of one, and the top k.
          const auto lo = [&](int64_t j) { const Score& s = sc[static_cast<size_t>(j)]; return s.cls == Cls::kPosInf ? static_cast<long double>(INFINITY) : s.s - s.err - floor_of[static_cast<size_t>(j)]; };
          const auto hi = [&](int64_t j) { const Score& s = sc[static_cast<size_t>(j)]; return s.cls == Cls::kPosInf ? static_cast<long double>(INFINITY) : s.s + s.err + floor_of[static_cast<size_t>(j)]; };
          const auto ranked = [&](int64_t j) { const Cls cl = sc[static_cast<size_t>(j)].cls; return cl == Cls::kFinite || cl == Cls::kPosInf; };
          const auto equal = [&](int64_t j1, int64_t j2) {
            const Cls c1 = sc[static_cast<size_t>(j1)].cls, c2 = sc[static_cast<size_t>(j2)].cls;
            if (c1 == Cls::kPosInf || c2 == Cls::kPosInf) return c1 == c2;
            return ties && krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j1)] == krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j2)] &&
                   same_bits(mask_bias(c, b, h, i, j1), mask_bias(c, b, h, i, j2)) && c.alibi(b, h, i, j1) == c.alibi(b, h, i, j2);
          };
          std::vector<int64_t> pos(static_cast<size_t>(d.Nk));
          const auto rank = [&](const std::vector<int64_t>& L, const char* name) {
            const int64_t n = std::min<int64_t>(static_cast<int64_t>(L.size()), sure);
            std::string why;  // the first violation
            std::fill(pos.begin(), pos.end(), INT64_MAX);  // each key's rank in L (INT64_MAX: left out)
            for (int64_t x = 0; x < static_cast<int64_t>(L.size()) && why.empty(); ++x) {
              const int64_t j = L[static_cast<size_t>(x)];
              if (x >= n) {
                if (j != -1) why = "rank " + std::to_string(x) + " past the " + std::to_string(sure) + " keys above -inf is not -1";
              } else if (!(j >= 0 && j < d.Nk && ranked(j) && pos[static_cast<size_t>(j)] == INT64_MAX)) {
                why = "rank " + std::to_string(x) + " is not a new key scoring above -inf";
              } else {
                pos[static_cast<size_t>(j)] = x;
              }
            }
            // A key ranked after jx (later in L, or left out) must not score surely above it: the
            // largest lower bound of the keys after each rank (a suffix maximum, from the keys left out).
            if (why.empty() && n > 0) {
              long double after = -INFINITY;
              int64_t after_j = -1;
              for (int64_t j = 0; j < d.Nk; ++j)
                if (ranked(j) && pos[static_cast<size_t>(j)] == INT64_MAX && lo(j) > after) after = lo(j), after_j = j;
              for (int64_t x = n - 1; x >= 0 && why.empty(); --x) {
                const int64_t jx = L[static_cast<size_t>(x)];
                if (after > hi(jx))
                  why = "key " + std::to_string(after_j) + " (score ~ " + num(static_cast<double>(sc[static_cast<size_t>(after_j)].s)) + ") is ranked after key " +
                        std::to_string(jx) + " (score ~ " + num(static_cast<double>(sc[static_cast<size_t>(jx)].s)) + ") but scores above it by more than rounding";
                if (lo(jx) > after) after = lo(jx), after_j = jx;
              }
            }
            // Nor a lower key with the same score (the key row compared first: cheap).
            for (int64_t x = 0; x < n && why.empty(); ++x) {
              const int64_t jx = L[static_cast<size_t>(x)];
              const int64_t rx = krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + jx)];
              for (int64_t j = 0; j < jx && why.empty(); ++j) {
                if (pos[static_cast<size_t>(j)] < x || !ranked(j)) continue;
                if (sc[static_cast<size_t>(j)].cls != Cls::kPosInf && krep[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)] != rx) continue;
                if (equal(j, jx))
                  why = "key " + std::to_string(j) + " has the score of key " + std::to_string(jx) +
                        " (the same key row, bias and ALiBi term, or +inf) but is ranked after it (equal scores go to the lower key)";
              }
            }
            check(why.empty(), "stats_rank", [&] {
              std::string s = std::string(name) + " of row" + at + "] = [";
              for (size_t x = 0; x < L.size(); ++x) s += (x ? ", " : "") + std::to_string(L[x]);
              return s + "]: " + why;
            });
          };
          rank({am}, "argmax");
          if (X.k > 0) {
            std::vector<int64_t> L(static_cast<size_t>(X.k));
            for (int64_t x = 0; x < X.k; ++x) L[static_cast<size_t>(x)] = X.topk_i.at(row, X.k, x);
            rank(L, "topk_indices");
            check(L[0] == am, "stats_rank", [&] { return "topk_indices" + at + ", 0] = " + std::to_string(L[0]) + " but argmax = " + std::to_string(am); });
            for (int64_t x = sure; x < X.k; ++x)
              check(X.topk_w.at4(b, h, i, x) == 0, "stats_rows", [&] { return "topk_weights" + at + ", " + std::to_string(x) + "] past the allowed keys is not 0"; });
          }
        }
  };
  judge(A, be);
  judge(R, Backend::kReference);

  // stats_tolerance (tame): against kReference by the tolerance rule.
  if (c.tame) {
    StatsTol t;
    bool ok = measure_stats(c, k, G, 1.0, t);
    double factor = 2;
    if (ok && c.dtype == DType::kFloat64) {
      ok = measure_stats(converted(c, DType::kFloat32), k, G, DBL_EPSILON / FLT_EPSILON, t);
      factor = 3;
    }
    if (ok) {
      const double e = eps_of(c.compute());
      const double S2 = 2 * max_score_magnitude(c);
      const double sum_n = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.Nk)));
      double H_max = 0, spread = 0;
      entropy_spread(c, *R.base.weights, H_max, spread);
      const double tol_w = factor * t.w + e * (std::max(4.0, S2) + sum_n);
      const double tol_h = factor * t.h + e * (std::max(4 * (1 + H_max), S2 * spread) + sum_n * (1 + H_max));
      double ratio = 0;
      std::string first;
      const auto close = [&](const std::string& what, double got, double want, double tol) {
        if (std::isnan(got) && std::isnan(want)) return;
        const bool inf = std::isinf(got) || std::isinf(want);
        if (inf ? got == want : std::fabs(got - want) <= tol) return;
        const double r = inf || std::isnan(got) || std::isnan(want) ? kInf : std::fabs(got - want) / tol;
        if (r > ratio || first.empty()) {
          ratio = std::max(ratio, r);
          first = what + " = " + num(got) + ", kReference " + num(want) + ", tol " + num(tol) + " (" + num(r) + " x tol)";
        }
      };
      const Tensor& WR = *R.base.weights;
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.Hq; ++h)
          for (int64_t i = 0; i < d.Nq; ++i) {
            const int64_t row = (b * d.Hq + h) * d.Nq + i;
            const std::string at = "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i);
            if (std::isnan(R.entropy.at4(0, b, h, i)) || std::isnan(A.entropy.at4(0, b, h, i))) continue;  // stats_rows judges NaN rows
            check(A.allowed.at(row, 1, 0) == R.allowed.at(row, 1, 0), "stats_rows",
                  [&] { return "allowed" + at + "] = " + std::to_string(A.allowed.at(row, 1, 0)) + " but kReference's is " + std::to_string(R.allowed.at(row, 1, 0)); });
            close("entropy" + at + "]", A.entropy.at4(0, b, h, i), R.entropy.at4(0, b, h, i), tol_h);
            close("entropy_normalized" + at + "]", A.normalized.at4(0, b, h, i), R.normalized.at4(0, b, h, i), tol_h / std::log(2.0));
            // Where the two rank another key first (scores within rounding), the weight kReference
            // gives the key this call names.
            const int64_t am = A.argmax.at(row, 1, 0), amr = R.argmax.at(row, 1, 0);
            const double mw_ref = am == amr ? R.max_weight.at4(0, b, h, i) : am >= 0 ? WR.at4(b, h, i, am) : 0.0;
            close("max_weight" + at + "]", A.max_weight.at4(0, b, h, i), mw_ref, tol_w);
            for (int64_t x = 0; x < k; ++x) {
              const int64_t j = A.topk_i.at(row, k, x), jr = R.topk_i.at(row, k, x);
              const double want = j == jr ? R.topk_w.at4(b, h, i, x) : j >= 0 ? WR.at4(b, h, i, j) : 0.0;
              close("topk_weights" + at + ", " + std::to_string(x) + "]", A.topk_w.at4(b, h, i, x), want, tol_w);
            }
            for (int64_t g = 0; g < G; ++g) {
              // A run of n keys: n weights within tol_w each, and the sums' roundings.
              const int64_t first_key = static_cast<int64_t>((static_cast<__int128>(g) * d.Nk + G - 1) / G);
              const int64_t end_key = std::min<int64_t>(d.Nk, static_cast<int64_t>((static_cast<__int128>(g + 1) * d.Nk + G - 1) / G));
              const double n = static_cast<double>(std::max<int64_t>(0, end_key - first_key));
              close("pooled_weights" + at + ", " + std::to_string(g) + "]", A.pooled.at4(b, h, i, g), R.pooled.at4(b, h, i, g), n * tol_w + e * (n + 2));
            }
          }
      check(first.empty(), ratio <= kNearFactor ? "stats_tolerance_near" : "stats_tolerance",
            [&] { return std::string(backend_name(be)) + " vs kReference: " + first + "; worst " + num(ratio) + " x tol"; });
    }
  }
  g_case = saved_case;
}

// ---- Backward ----

struct Grads {
  Tensor dq, dk, dv;
  std::optional<Tensor> dsinks;  // Gradients::dsinks (Case::want_dsinks)
  sdpa::Gradients gradients() const {
    sdpa::Gradients g{dq.view(), dk.view(), dv.view()};
    if (dsinks) g.dsinks = dsinks->view();
    return g;
  }
};
// `ds_ls`: dsinks' layout (the case's own for the call under test, plain for the others).
Grads make_grads(const Case& c, const LayoutSpec& ls, bool ds_fancy = false) {
  // dq has q's dtype, dk and dv k's and v's (the header's Gradients).
  Grads g{Tensor(c.dtype, c.q.shape(), Role::kUnitLast, false, ls), Tensor(c.kv, c.k.shape(), Role::kUnitLast, false, ls),
          Tensor(c.kv, c.v.shape(), Role::kUnitLast, false, ls), std::nullopt};
  if (c.want_dsinks())
    g.dsinks.emplace(c.mods->dsinks_dtype, std::vector<int64_t>{c.d.Hq}, Role::kAny, false, ds_fancy ? c.mods->dsinks_ls : LayoutSpec::plain());
  return g;
}
// g[3]: dsinks (empty without).
struct GradVals { std::vector<double> g[4]; };
GradVals gvals(const Grads& g) { return {{g.dq.values(), g.dk.values(), g.dv.values(), g.dsinks ? g.dsinks->values() : std::vector<double>{}}}; }
const char* const kGradNames[4] = {"dq", "dk", "dv", "dsinks"};

void run_backward(const Case&, const sdpa::Inputs& in, const Tensor& out, const Tensor& lse, const Tensor& dout,
                  const Grads& g, const sdpa::Options& opt) {
  expect_no_throw("attention_backward",
                  [&] { sdpa::attention_backward(in, out.view(), lse.view(), dout.view(), g.gradients(), opt); });
}

bool grads_bitwise(const Grads& a, const Grads& b, std::string& why) {
  const GradVals va = gvals(a), vb = gvals(b);
  for (int n = 0; n < 4; ++n)
    for (size_t x = 0; x < va.g[n].size(); ++x)
      if (!same_bits(va.g[n][x], vb.g[n][x])) {
        why = std::string(kGradNames[n]) + "[" + std::to_string(x) + "]: " + num(va.g[n][x]) + " vs " + num(vb.g[n][x]);
        return false;
      }
  return true;
}

// tests/backward_util.cc: expected() and matches(), reimplemented.
void check_bwd_tolerance(const Case& c, const Tensor& out, const Tensor& lse, const Tensor& dout, const Grads& got) {
  const Dims& d = c.d;
  auto measure = [&](const Case& cc, const Tensor& o, const Tensor& l, const Tensor& dO, double scale, GradVals& ref, double (&err)[4]) {
    sdpa::Options opt = cc.opt;
    opt.backend = Backend::kReference;
    Grads gr = make_grads(cc, LayoutSpec::plain());
    run_backward(cc, cc.inputs(), o, l, dO, gr, opt);
    opt.backend = Backend::kNaive;
    Grads gn = make_grads(cc, LayoutSpec::plain());
    run_backward(cc, cc.inputs(), o, l, dO, gn, opt);
    ref = gvals(gr);
    const GradVals naive = gvals(gn);
    for (int n = 0; n < 4; ++n) {  // n = 3: dsinks (none without)
      double e = 0;
      for (size_t x = 0; x < ref.g[n].size(); ++x) {
        if (!std::isfinite(ref.g[n][x]) || !std::isfinite(naive.g[n][x])) return false;  // no_nan fails: no tolerance
        e = std::max(e, std::abs(naive.g[n][x] - ref.g[n][x]));
      }
      err[n] = std::max(err[n], e * scale);
    }
    return true;
  };
  double err[4] = {0, 0, 0, 0};
  GradVals ref;
  if (!measure(c, out, lse, dout, 1.0, ref, err)) return;
  double factor = 2;
  if (c.dtype == DType::kFloat64) {
    const Case c32 = converted(c, DType::kFloat32);
    GradVals ref32;
    if (!measure(c32, out.converted(DType::kFloat32), lse.converted(DType::kFloat32), dout.converted(DType::kFloat32),
                 DBL_EPSILON / FLT_EPSILON, ref32, err)) return;
    factor = 3;
  }
  // Cancellation magnitudes M (backward_util.cc: cancellation_magnitudes, the same terms).
  const Vals rf = run_plain(c, Backend::kReference);
  const std::vector<uint8_t> keep = keep_mask(c);
  const std::vector<double> lsev = lse.values();
  const double zk = c.opt.dropout_p > 0 ? 1.0 / (1.0 - c.opt.dropout_p) : 1.0;
  const double scale = std::abs(c.scale());
  double row_max = 0;
  std::vector<double> col(static_cast<size_t>(d.B * d.Hkv * d.Nk), 0.0), col_v(col.size(), 0.0);
  // dsinks_h = -Σ_b Σ_i exp(sink_h - lse_bhi) · (dout_bhi · out_bhi): the sizes of its terms.
  std::vector<double> ds_terms(static_cast<size_t>(d.Hq), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
        const double lse_i = std::isfinite(lsev[static_cast<size_t>(row)]) ? std::abs(lsev[static_cast<size_t>(row)]) : 0.0;
        double D = 0, D_size = 0, qmax = 0, dout_max = 0;
        for (int64_t e = 0; e < d.Dv; ++e) {
          D += dout.at4(b, h, i, e) * out.at4(b, h, i, e);
          D_size += std::abs(dout.at4(b, h, i, e) * out.at4(b, h, i, e));
          dout_max = std::max(dout_max, std::abs(dout.at4(b, h, i, e)));
        }
        for (int64_t x = 0; x < d.Dk; ++x) qmax = std::max(qmax, std::abs(c.q.at4(b, h, i, x)));
        if (c.has_sinks() && std::isfinite(lsev[static_cast<size_t>(row)]))
          ds_terms[static_cast<size_t>(h)] += std::exp(c.sink(h) - lsev[static_cast<size_t>(row)]) * D_size;
        double sum = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double pij = rf.weights[static_cast<size_t>(row * d.Nk + j)];
          if (pij == 0) continue;
          double dp = 0, dp_size = 0, kmax = 0;
          for (int64_t e = 0; e < d.Dv; ++e) {
            dp += dout.at4(b, h, i, e) * c.v.at4(b, kvh, j, e);
            dp_size += std::abs(dout.at4(b, h, i, e) * c.v.at4(b, kvh, j, e));
          }
          for (int64_t x = 0; x < d.Dk; ++x) kmax = std::max(kmax, std::abs(c.k.at4(b, kvh, j, x)));
          const double z = keep.empty() ? 1.0 : keep[static_cast<size_t>(row * d.Nk + j)] * zk;
          const double s_err = 2 * (score_magnitude(c, b, h, i, j) + lse_i);
          const double mag = pij * (z * dp_size + D_size + std::abs(z * dp - D) * s_err);
          const size_t key = static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j);
          sum += mag * kmax;
          col[key] += mag * qmax;
          col_v[key] += pij * z * s_err * dout_max;
        }
        row_max = std::max(row_max, sum);
      }
  // Summation, a fuzz-only term (like the score rounding in s_err): each gradient element sums n
  // terms (dq: a row's keys, n <= Nk; dk, dv: the rows of a key's group, n <= group·Nq) in order,
  // and their roundings add up like a random walk, ~sqrt(n)·eps·Σ|terms| (the usual estimate for
  // recursive summation; the worst case is (n-1)·eps·Σ|terms|), where the tests' rule counts each
  // term's size once (eps · M). It shows where a gradient cancels to zero: F6 third, a dq that
  // is zero up to rounding over 2048 keys, off by 11·eps·M in both backends.
  const double n_dq = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.Nk)));
  const double n_dkv = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.group() * d.Nq)));
  // dsinks: a sum over the B·Nq rows of its head, in a fixed order.
  const double n_ds = std::sqrt(static_cast<double>(std::max<int64_t>(1, d.B * d.Nq)));
  const double M[4] = {n_dq * scale * row_max, n_dkv * scale * max_abs_finite(col), n_dkv * max_abs_finite(col_v),
                       n_ds * max_abs_finite(ds_terms)};
  const GradVals g = gvals(got);
  const DType grad_dtype[4] = {c.dtype, c.kv, c.kv, got.dsinks ? got.dsinks->dtype() : c.compute()};
  for (int n = 0; n < 4; ++n) {
    if (n == 3 && !got.dsinks) break;
    // dsinks is stored in its own dtype (float32 under float64 q too): its epsilon where larger.
    const double e = n == 3 ? std::max(eps_of(c.compute()), eps_of(grad_dtype[3])) : eps_of(c.compute());
    const double ref_max = max_abs_finite(ref.g[n]);
    // 16-bit gradients: one more unit in their last place, as for out (backward_util.cc).
    const double ulp = is16(grad_dtype[n]) ? eps_of(grad_dtype[n]) * ref_max : 0.0;
    const double tol = factor * err[n] + e * (4 * std::max(1.0, ref_max) + M[n]) + ulp;
    // A 16-bit gradient may round to inf where kReference's stays finite near the threshold (as
    // out in all_close): tame inputs and dropout's z = 1000 reach past float16's 65504.
    const double overflow = overflow_at(grad_dtype[n]);
    double worst = 0;
    size_t at = 0;
    for (size_t x = 0; x < g.g[n].size(); ++x) {
      const double a = g.g[n][x], w = ref.g[n][x];
      const bool rounds_over = std::isinf(a) && std::signbit(a) == std::signbit(w) && std::abs(w) + tol >= overflow;
      const double ratio = std::isfinite(a) ? std::abs(a - w) / tol : rounds_over ? 0.0 : kInf;
      if (!(ratio <= worst)) { worst = std::isnan(ratio) ? kInf : ratio; at = x; }
    }
    const char* name = worst <= kNearFactor ? "bwd_tolerance_near" : std::isinf(worst) ? "bwd_nonfinite" : "bwd_tolerance";
    check(worst <= 1, name, [&] {
      return std::string(backend_name(c.opt.backend)) + " vs kReference: " + kGradNames[n] + "[" + std::to_string(at) + "] = " + num(g.g[n][at]) +
             ", kReference " + num(ref.g[n][at]) + ", tol " + num(tol) + " (" + num(worst) + " x tol; measured error " +
             num(err[n]) + " x " + num(factor) + ", eps " + num(e) + " x (4 max(1, " + num(ref_max) + ") + M " + num(M[n]) + "))";
    });
  }
}

// ---- Decoding the case ----

void fill_mask(Case& c, std::mt19937_64& rng, double density, double empty_rows, double sigma) {
  Tensor& m = *c.mask;
  const int64_t nk = m.shape().empty() ? 1 : m.shape().back();
  std::uniform_real_distribution<double> u(0, 1);
  std::normal_distribution<double> nd(0, sigma);
  bool row_empty = false;
  for (int64_t n = 0; n < m.numel(); ++n) {
    if (nk > 0 && n % nk == 0) row_empty = u(rng) < empty_rows;
    const bool attend = !row_empty && u(rng) < density;
    if (m.dtype() == DType::kBool) {
      m.set_flat(n, attend ? static_cast<double>(1 + rng() % 255) : 0.0);
    } else {
      m.set_flat(n, attend ? std::clamp(nd(rng), -1e3, 1e3) : -kInf);
    }
  }
}

// Inputs::seqlens_k from the prefix bytes sk and sk_seed (see kExtSeqlens): lengths in [0, Nk]
// drawn as sk bits 0-2 say, int32 (bit 3) or int64, stride 1 / 2 / -1 / 0 (bits 4-5; 0 sets
// every length to the first), 0-3 bytes of misalignment; sk bits 6-7 (with sk_seed's top bits)
// make it invalid.
void decode_seqlens(Case& c) {
  std::mt19937_64 rng(0x5e91e25ull * (g_sk_seed + 1u) + g_sk);
  const int64_t B = c.rank == 4 ? c.d.B : 1, Nk = c.d.Nk, Nq = c.d.Nq;
  auto draw = [&](int kind) -> int64_t {
    auto clampk = [&](int64_t x) { return std::clamp<int64_t>(x, 0, Nk); };
    switch (kind) {
      case 1: return Nk;
      case 2: return 0;
      case 3: return static_cast<int64_t>(rng() % static_cast<uint64_t>(Nk + 1));
      case 4: return clampk(static_cast<int64_t>(rng() % 4));
      case 5: return clampk(Nq - 1 + static_cast<int64_t>(rng() % 3));  // causal's edge: L - Nq near 0
      case 6: return clampk(Nk - 1 - static_cast<int64_t>(rng() % 2));
      default: {  // a tile or chunk edge
        static const int64_t kEdge[] = {7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024, 2047, 2048, 2049};
        return clampk(kEdge[rng() % 19]);
      }
    }
  };
  const int how = g_sk & 7;
  std::vector<int64_t> L(static_cast<size_t>(B));
  for (auto& x : L) x = draw(how == 0 ? 1 + static_cast<int>(rng() % 7) : how);
  const int st = (g_sk >> 4) & 3;
  const int64_t stride = st == 0 ? 1 : st == 1 ? 2 : st == 2 ? -1 : 0;
  if (stride == 0) for (auto& x : L) x = L.empty() ? 0 : L[0];
  const DType dt = g_sk & 8 ? DType::kInt32 : DType::kInt64;
  const int bad_hi = (g_sk >> 6) & 3;
  BadSeqlens bad = bad_hi == 0 ? BadSeqlens::kNone : static_cast<BadSeqlens>(1 + ((bad_hi - 1) * 8 + (g_sk_seed >> 5)) % 7);
  std::vector<int64_t> vals = L;
  const size_t at = B > 0 ? static_cast<size_t>(rng() % static_cast<uint64_t>(B)) : 0;
  switch (bad) {
    case BadSeqlens::kNegative:
    case BadSeqlens::kTooLong: {
      if (B == 0) { bad = BadSeqlens::kNone; break; }
      int64_t x;
      if (bad == BadSeqlens::kNegative) x = rng() % 2 ? -1 : dt == DType::kInt32 ? INT32_MIN : INT64_MIN;
      else x = rng() % 2 ? Nk + 1 : dt == DType::kInt32 ? INT32_MAX : int64_t{1} << 40;
      if (stride == 0) for (auto& v : vals) v = x; else vals[at] = x;
      break;
    }
    case BadSeqlens::kShapeB1: vals.push_back(B > 0 ? L[0] : 0); break;
    case BadSeqlens::kShapeSmall: if (B > 0) vals.pop_back(); else vals.push_back(0); break;
    case BadSeqlens::kNull: if (B == 0) bad = BadSeqlens::kNone; break;
    default: break;
  }
  c.bad_sl = bad;
  c.sl = std::make_shared<IndexTensor>(dt, vals, stride, (g_sk_seed >> 3) & 3);
  sdpa::TensorView v = c.sl->view();
  if (bad == BadSeqlens::kRank) {
    if (g_sk_seed & 1) { v.rank = 2; v.shape[1] = v.shape[0]; v.strides[1] = v.strides[0]; v.shape[0] = 1; v.strides[0] = 0; }
    else { v.rank = 0; if (!v.data) v.data = c.sl->buf.get(); }
  }
  if (bad == BadSeqlens::kDtype) v.dtype = g_sk_seed & 1 ? DType::kBool : dt == DType::kInt32 ? DType::kFloat32 : DType::kFloat64;
  if (bad == BadSeqlens::kNull) v.data = nullptr;
  c.sl_view = v;
  if (bad == BadSeqlens::kNone) c.seqlens = L;
}

// A small layout for a rank 1-2 modifier tensor (slopes, sinks, dsinks): unit stride, stride 2 or
// 3, negative strides, stride 0 (inputs only: every element the same), column-major, an offset.
LayoutSpec modifier_layout(std::mt19937_64& rng, bool input) {
  LayoutSpec ls;
  const int kind = static_cast<int>(rng() % 6);
  if (kind == 3) ls.last = 2;
  if (kind == 4) ls.neg = 3;
  if (kind == 5) { if (input) ls.zero = static_cast<uint8_t>(1 + rng() % 3); else ls.last = 3; }
  ls.perm = static_cast<uint8_t>(rng() % 2);
  ls.pad = static_cast<uint8_t>(rng() % 4 == 0 ? 1 : 0);
  ls.misalign = static_cast<uint8_t>(rng() % 3);
  ls.null_empty = rng() % 2;
  ls.empty_stride_seed = rng() % 4 == 0 ? 1 + rng() % 255 : 0;
  return ls;
}

// The score modifiers from the prefix bytes md and md_seed (kExtModifiers):
//   md bits 0-1  softcap: 0 none; 1 one of 0.5, 1, 2, 5, 10, 20, 30, 50, 60; 2 uniform in
//                [0.5, 60]; 3 an extreme one (1e-3, 0.01, 0.1, 1e3, 1e4, 1e30, 3e38, FLT_MIN)
//   md bit 2     SoftcapOrder::kAfterBias (else kBeforeBias; set without a softcap too)
//   md bits 3-4  alibi_slopes: 0 none, 1 (Hq,), 2 (B, Hq) ((1, Hq) below rank 4), 3 (1, Hq)
//   md bit 5     sinks (Hq,)
//   md bit 6     backward calls with sinks write Gradients::dsinks
//   md bit 7     an invalid modifier (BadMod, picked by md_seed)
// md_seed seeds the PRNG for the rest: float32 / float64 tensors, their layouts (modifier_layout),
// and the values (slopes: ALiBi's geometric 2^(-8(h+1)/Hq), normal 0.1, 1 or 30, or zeros with one
// of 0.5, -0.5, 1e-30, 10, 1e3; sinks: normal 1 or 10, zeros, or per head one of 0, ±1e30, ±88,
// ±1e3, ±700, 1e-30), all finite in float32.
void decode_modifiers(Case& c) {
  auto m = std::make_shared<Modifiers>();
  std::mt19937_64 rng(0x30d1f1e5ull * (g_md_seed + 1u) + g_md);
  sdpa::Options& o = c.opt;
  const int cap_kind = g_md & 3;
  if (cap_kind == 1) {
    static const double kCaps[] = {0.5, 1, 2, 5, 10, 20, 30, 50, 60};
    o.softcap = kCaps[rng() % 9];
  } else if (cap_kind == 2) {
    o.softcap = 0.5 + 59.5 * std::uniform_real_distribution<double>(0, 1)(rng);
  } else if (cap_kind == 3) {
    static const double kExtreme[] = {1e-3, 0.01, 0.1, 1e3, 1e4, 1e30, 3e38, FLT_MIN};
    o.softcap = kExtreme[rng() % 8];
  }
  o.softcap_order = g_md & 4 ? sdpa::Options::SoftcapOrder::kAfterBias : sdpa::Options::SoftcapOrder::kBeforeBias;
  const int64_t Hq = c.d.Hq, B = c.rank == 4 ? c.d.B : 1;
  const int alibi_kind = (g_md >> 3) & 3;
  if (alibi_kind != 0) {
    const std::vector<int64_t> shape = alibi_kind == 1 ? std::vector<int64_t>{Hq} : alibi_kind == 2 ? std::vector<int64_t>{B, Hq} : std::vector<int64_t>{1, Hq};
    const DType dt = rng() % 2 ? DType::kFloat64 : DType::kFloat32;
    m->slopes.emplace(dt, shape, Role::kAny, true, modifier_layout(rng, true));
    Tensor& t = *m->slopes;
    const int kind = static_cast<int>(rng() % 5);
    static const double kSigma[] = {0, 0.1, 1, 0, 30};
    std::normal_distribution<double> nd(0.0, 1.0);
    for (int64_t n = 0; n < t.numel(); ++n) {
      const int64_t h = Hq > 0 ? n % Hq : 0;
      double x = kind == 0 ? std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(std::max<int64_t>(1, Hq)))
                 : kind == 3 ? 0.0 : std::clamp(kSigma[kind] * nd(rng), -1e3, 1e3);
      t.set_flat(n, x);
    }
    if (kind == 3 && t.numel() > 0) {
      static const double kOne[] = {0.5, -0.5, 1e-30, 10, 1e3};
      t.set_flat(static_cast<int64_t>(rng() % static_cast<uint64_t>(t.numel())), kOne[rng() % 5]);
    }
    o.alibi_slopes = t.view();
  }
  if (g_md & 32) {
    const DType dt = rng() % 2 ? DType::kFloat64 : DType::kFloat32;
    m->sinks.emplace(dt, std::vector<int64_t>{Hq}, Role::kAny, true, modifier_layout(rng, true));
    Tensor& t = *m->sinks;
    const int kind = static_cast<int>(rng() % 4);
    std::normal_distribution<double> nd(0.0, kind == 1 ? 10.0 : 1.0);
    static const double kSpecial[] = {0, 1e30, -1e30, 88, -88, 1e3, -1e3, 700, -700, 1e-30};
    for (int64_t n = 0; n < t.numel(); ++n)
      t.set_flat(n, kind == 2 ? 0.0 : kind == 3 ? kSpecial[rng() % 10] : nd(rng));
    o.sinks = t.view();
  }
  m->dsinks = g_md & 64;
  m->dsinks_dtype = rng() % 2 ? DType::kFloat64 : DType::kFloat32;
  m->dsinks_ls = modifier_layout(rng, false);
  m->bad_seed = rng();
  if (g_md & 128) {
    m->bad = static_cast<BadMod>(1 + m->bad_seed % (static_cast<uint64_t>(BadMod::kCount) - 1));
    if (m->bad >= BadMod::kDsinksNoSinks && !c.backward) m->bad = BadMod::kNone;  // backward-only kinds
  }
  c.mods = m;
}

// A layout for the block mask (rank 2-4, bool, any strides: Role::kAny): C order, or permuted
// dims with gaps after some, negative strides, a last stride of 2 or 3, odd strides on dims of
// extent 1, a misaligned start, and sometimes a dim of stride 0 (every entry along it the same
// element: still a valid input view); an empty one with null data or any strides.
LayoutSpec block_layout(std::mt19937_64& rng) {
  LayoutSpec ls;
  const int kind = static_cast<int>(rng() % 4);  // 0 C order, 1 permuted / padded, 2 + negative, 3 + stride 0
  ls.misalign = static_cast<uint8_t>(rng() % 7);
  ls.null_empty = rng() % 2;
  ls.empty_stride_seed = rng() % 2 ? 0 : 1 + rng() % 255;
  if (kind == 0) return ls;
  ls.perm = static_cast<uint8_t>(rng() % 24);
  ls.pad = static_cast<uint8_t>(rng() % 16);
  ls.last = static_cast<uint8_t>(1 + rng() % 3);
  ls.odd_unit = rng() % 3 == 0;
  if (kind >= 2) ls.neg = static_cast<uint8_t>(rng() % 16);
  if (kind == 3) ls.zero = static_cast<uint8_t>(1u << (rng() % 4));
  return ls;
}

// ceil(n / block) for n >= 0, block >= 1 (no overflow for huge blocks).
int64_t ceil_div(int64_t n, int64_t block) { return n / block + (n % block != 0); }

// Options::block_mask from the prefix bytes bm and bm_seed (kExtBlocks):
//   bm bits 0-1  block_q, block_k: 0 small (1-5 each); 1 a menu of 1-129 and sizes relative to
//                Nq / Nk (N, N + 1, N - 1, N / 2, N / 3); 2 tile-sized: block_k 128, 256, 384, 512,
//                1024 or 2048 (whole tiles of 128 keys skipped), block_q 1-256; 3 anything from 1 to
//                INT64_MAX (huge ones: one block)
//   bm bits 2-3  density: 0 each block true with p 0.1-0.9; 1 sparse (p 0-0.2, 30% of block rows
//                all false, 10% all true); 2 all true (maybe one false block); 3 structured per (b, h):
//                block-causal, a band, global column + diagonal, all false, or a checkerboard
//   bm bits 4-5  leading dims: 0 none (QB, KB); 1 per head (Hq, QB, KB); 2 per batch (B, 1, QB, KB)
//                ((1, QB, KB) for rank 3); 3 (B | 1, Hq | 1, QB, KB), each leading dim 1 or full
//                (dims q's rank lacks are left out)
//   bm bit 6     seqlens_k too (prefix bytes sk, sk_seed after bm_seed); bm bit 7 score modifiers
//                too (md, md_seed after those)
// bm_seed seeds the PRNG for the rest: the sizes, the values (a true block is 1 or any of 1-255),
// the layout (block_layout); its top three bits 0b111 make the mask invalid (bad_blocks_of).
// The block mask's sizes, leading dims and values (decode_block_mask's, and run_varlen's for
// packed sequences): `rank` is q's (it bounds the leading dims), (B, Hq) what they broadcast to,
// Nq and Nk the rows and keys the blocks cover. `max_elems` bounds the mask's elements (B · Hq ·
// QB · KB): block_q or block_k (whichever gives more blocks) doubles until it fits.
std::shared_ptr<BlockMask> make_block_mask(std::mt19937_64& rng, int size_kind, int density_kind, int lead_kind, int rank, int64_t B,
                                           int64_t Hq, int64_t Nq, int64_t Nk, int64_t max_elems = INT64_MAX) {
  auto bl = std::make_shared<BlockMask>();
  const auto relative = [&](int64_t n) {
    const int64_t r[] = {n, n + 1, n - 1, n / 2, n / 3};
    return std::max<int64_t>(1, r[rng() % 5]);
  };
  const auto size_of = [&](int64_t n, bool keys) -> int64_t {
    switch (size_kind) {
      case 0: return 1 + static_cast<int64_t>(rng() % 5);
      case 1: {
        static const int64_t kMenu[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129};
        return rng() % 3 == 0 ? relative(n) : kMenu[rng() % 20];
      }
      case 2: {
        static const int64_t kKeys[] = {128, 128, 128, 256, 256, 384, 512, 1024, 2048};
        static const int64_t kRows[] = {1, 2, 3, 16, 64, 128, 128, 256};
        return keys ? kKeys[rng() % 9] : kRows[rng() % 8];
      }
      default: {
        static const int64_t kAny[] = {1, 2, 5, 7, 100, 128, 256, 4096, int64_t{1} << 20, int64_t{1} << 40, INT64_MAX - 1, INT64_MAX};
        return rng() % 4 == 0 ? relative(n) : kAny[rng() % 12];
      }
    }
  };
  bl->bq = size_of(Nq, false);
  bl->bk = size_of(Nk, true);
  if (max_elems != INT64_MAX) {
    const long double lead = static_cast<long double>(std::max<int64_t>(1, B)) * std::max<int64_t>(1, Hq);
    while (lead * ceil_div(Nq, bl->bq) * ceil_div(Nk, bl->bk) > max_elems) {
      int64_t& b = ceil_div(Nq, bl->bq) >= ceil_div(Nk, bl->bk) ? bl->bq : bl->bk;
      b = b > INT64_MAX / 2 ? INT64_MAX : 2 * b;
    }
  }
  const int64_t QB = ceil_div(Nq, bl->bq), KB = ceil_div(Nk, bl->bk);
  std::vector<int64_t> shape;
  switch (lead_kind) {
    case 1: if (rank >= 3) shape = {Hq}; break;
    case 2: if (rank == 4) shape = {B, 1}; else if (rank == 3) shape = {1}; break;
    case 3:
      if (rank == 4) shape.push_back(rng() % 2 ? B : 1);
      if (rank >= 3) shape.push_back(rng() % 2 ? Hq : 1);
      break;
    default: break;
  }
  shape.push_back(QB);
  shape.push_back(KB);
  bl->mask.init(DType::kBool, shape, Role::kAny, true, block_layout(rng));
  Tensor& m = bl->mask;
  const bool any_byte = rng() % 2;  // a true block holds any of 1-255, else 1
  const auto yes = [&] { return any_byte ? static_cast<double>(1 + rng() % 255) : 1.0; };
  static const double kP[] = {0.1, 0.25, 0.5, 0.75, 0.9};
  static const double kSparse[] = {0.0, 0.05, 0.2};
  const double p = density_kind == 0 ? kP[rng() % 5] : density_kind == 1 ? kSparse[rng() % 3] : 1.0;
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t slice = QB * KB;
  int pattern = 0, param = 0;
  int row_state = 0;  // sparse: 0 drawn, 1 all false, 2 all true
  for (int64_t n = 0; n < m.numel(); ++n) {
    const int64_t kb = n % KB, qb = (n / KB) % QB;
    if (n % slice == 0) {  // a new (b, h) slice: its structure
      pattern = static_cast<int>(rng() % 5);
      param = static_cast<int>(rng() % 3);
    }
    if (kb == 0 && density_kind == 1) {
      const double r = u(rng);
      row_state = r < 0.3 ? 1 : r < 0.4 ? 2 : 0;
    }
    bool on;
    switch (density_kind) {
      case 0: on = u(rng) < p; break;
      case 1: on = row_state == 2 || (row_state == 0 && u(rng) < p); break;
      case 2: on = true; break;
      default:
        switch (pattern) {
          case 0: on = kb <= qb + (param - 1); break;                    // block-causal, offset -1..1
          case 1: on = std::abs(qb - kb) <= param; break;                 // a band
          case 2: on = kb == 0 || kb == qb; break;                        // global column + diagonal
          case 3: on = false; break;                                      // all false
          default: on = (qb + kb + param) % 2 == 0; break;                // a checkerboard
        }
    }
    m.set_flat(n, on ? yes() : 0.0);
  }
  if (density_kind == 2 && m.numel() > 0 && rng() % 2) m.set_flat(static_cast<int64_t>(rng() % static_cast<uint64_t>(m.numel())), 0.0);
  static const char* const kSizeNames[] = {"small", "menu", "tiles", "any"};
  static const char* const kDensityNames[] = {"random", "sparse", "all true", "structured"};
  static const char* const kLeadNames[] = {"none", "per head", "per batch", "broadcast"};
  bl->how = std::string("sizes ") + kSizeNames[size_kind] + ", density " + kDensityNames[density_kind] + ", leading dims " + kLeadNames[lead_kind];
  return bl;
}

void decode_block_mask(Case& c) {
  std::mt19937_64 rng(0xb10c4a5cull * (g_bm_seed + 1u) + g_bm);
  const int64_t B = c.rank == 4 ? c.d.B : 1, Hq = c.rank >= 3 ? c.d.Hq : 1;
  std::shared_ptr<BlockMask> bl = make_block_mask(rng, g_bm & 3, (g_bm >> 2) & 3, (g_bm >> 4) & 3, c.rank, B, Hq, c.d.Nq, c.d.Nk);
  bl->bad = bad_blocks_of(g_bm_seed);
  bl->bad_seed = rng();
  c.opt.block_mask = bl->mask.view();
  c.opt.block_q = bl->bq;
  c.opt.block_k = bl->bk;
  c.blocks = bl;
}

// A call's first byte: dtypes, backward, threads, tame; the caps from the ext prefix. Returns
// the `fancy` bit (layouts and masks beyond the plain ones). Shared by decode and run_varlen.
bool decode_flags(FuzzedDataProvider& f, Case& c) {
  const uint8_t flags = f.ConsumeIntegral<uint8_t>();
  // The ext byte's storage: 16-bit k and v are float16 where the bit that picks float64 is set,
  // else bfloat16; q shares their dtype or (storage 2) is float32.
  if (g_storage != 0) {
    c.kv = flags & 1 ? DType::kFloat16 : DType::kBFloat16;
    c.dtype = g_storage == 2 ? DType::kFloat32 : c.kv;
  } else {
    c.dtype = c.kv = flags & 1 ? DType::kFloat64 : DType::kFloat32;
  }
  c.backward = flags & 2;
  c.threads = flags & 4 ? 2 : 1;
  c.avx2 = g_avx2;
  c.path_cap = g_path_cap;
  c.tame = !(flags & 32);
  return flags & 16;
}

bool decode(FuzzedDataProvider& f, Case& c, Invalid& invalid) {
  const bool fancy = decode_flags(f, c);
  const uint8_t inv = f.ConsumeIntegral<uint8_t>();
  invalid = inv < 200 ? Invalid::kNone : static_cast<Invalid>(1 + inv % (static_cast<int>(Invalid::kCount) - 1));
  c.rank = f.ConsumeIntegralInRange<int>(2, 4);
  const uint8_t size_class = f.ConsumeIntegralInRange<uint8_t>(0, 9);
  static const int64_t kN[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257};
  static const int64_t kSmallN[] = {0, 1, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17};
  static const int64_t kLongN[] = {2047, 2048, 2049, 2100, 2176, 2304, 2500, 3000, 4100};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 59, 63, 64, 65, 80, 111, 127, 128, 129, 256};
  static const int64_t kSmallD[] = {1, 1, 2, 3, 4, 5, 8, 9};
  static const int64_t kB[] = {1, 1, 1, 2, 3, 0};
  static const int64_t kHkv[] = {1, 1, 2, 3, 0};
  static const int64_t kGroup[] = {1, 1, 2, 3, 4, 5, 8};
  Dims& d = c.d;
  d.B = c.rank == 4 ? pick(f, kB) : 1;
  d.Hkv = c.rank >= 3 ? pick(f, kHkv) : 1;
  d.Hq = c.rank >= 3 ? d.Hkv * pick(f, kGroup) : 1;
  if (size_class <= 5) {  // general
    d.Nq = pick(f, kN); d.Nk = pick(f, kN); d.Dk = pick(f, kD); d.Dv = pick(f, kD);
  } else if (size_class <= 7) {  // small
    d.Nq = pick(f, kSmallN); d.Nk = pick(f, kSmallN); d.Dk = pick(f, kSmallD); d.Dv = pick(f, kSmallD);
  } else {  // long keys, few rows: key chunking (kMinChunkKeys)
    d.Nq = size_class == 8 ? pick(f, kSmallN) : f.ConsumeIntegralInRange<int64_t>(9, 40);
    d.Nk = pick(f, kLongN); d.Dk = pick(f, kSmallD); d.Dv = pick(f, kSmallD);
    if (c.rank >= 3) d.Hq = d.Hkv * 1;
    d.B = std::min<int64_t>(d.B, 1);
  }
  // Bound the work so that each execution is fast (the reference and naive run too).
  while (work_of(d) > kWorkBudget) {
    int64_t* biggest = &d.Dk;
    for (int64_t* x : {&d.Dv, &d.Nq, &d.Nk, &d.Hq}) if (*x > *biggest && !(x == &d.Nk && size_class >= 8)) biggest = x;
    if (biggest == &d.Hq) { d.Hq = d.Hkv; if (work_of(d) > kWorkBudget) { d.Nq = std::max<int64_t>(1, d.Nq / 2); } continue; }
    *biggest = std::max<int64_t>(1, *biggest / 2);
  }

  // F11 (fixed; see kSkipDefault): bfloat16 with Dk = 0 aborted on the dot-product path.
  if (c.all_bf16() && d.Dk == 0 && c.path_cap != sdpa::KernelPath::kSimd && skipping("bf16_dk0")) {
    c.path_cap = g_path_cap = sdpa::KernelPath::kSimd;
    sdpa::set_max_kernel_path(g_path_cap);
  }

  // Options.
  sdpa::Options& o = c.opt;
  static const int64_t kWin[] = {-1, -1, -1, -7, 0, 1, 2, 3, 16, 100, 1000, INT64_MAX, INT64_MAX - 1, int64_t{1} << 62};
  const uint8_t of = f.ConsumeIntegral<uint8_t>();
  o.causal = static_cast<Causal>(of % 3);
  if (of & 4) o.window = {pick(f, kWin), pick(f, kWin)};
  const uint8_t be = f.ConsumeIntegral<uint8_t>();
  o.backend = be < 140 ? Backend::kFlash : be < 180 ? Backend::kAuto : be < 220 ? Backend::kReference : Backend::kNaive;
  if (of & 8) {
    static const double kScales[] = {1, 0.5, 0.125, -1, 0, 1e-3, 2, 8, 1e3, -1e3, 30, -0.0, 1e10, 1e30, 3e38, FLT_MAX,
                                     1e-38, 1e-40, 1e-300, 5e-324, 1e300, -1e20, 0.1, 64};
    const uint8_t si = f.ConsumeIntegral<uint8_t>();
    o.scale = si < 240 ? kScales[si % 24] : f.ConsumeFloatingPointInRange<double>(-1e3, 1e3);
  }
  if (of & 16) {
    static const double kP[] = {0.1, 0.5, 0.9, 0.999, 0.25, 1e-9};
    o.dropout_p = kP[f.ConsumeIntegralInRange<int>(0, 5)];
    o.seed = f.ConsumeIntegral<uint64_t>();
  } else if (of & 32) {
    o.seed = f.ConsumeIntegral<uint64_t>();  // ignored without dropout
  }
  c.want_weights = of & 64;
  c.want_lse = (of & 128) || c.backward;

  // Layouts.
  const LayoutSpec lq = decode_layout(f, fancy), lk = decode_layout(f, fancy), lv = decode_layout(f, fancy);
  c.out_ls = decode_layout(f, fancy);
  c.w_ls = decode_layout(f, fancy);
  c.l_ls = decode_layout(f, fancy);
  c.q.init(c.dtype, last_dims(c.rank, {d.B, d.Hq, d.Nq, d.Dk}), Role::kUnitLast, true, lq);
  c.k.init(c.kv, last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dk}), Role::kUnitLast, true, lk);
  c.v.init(c.kv, last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dv}), Role::kUnitLast, true, lv);

  // Values.
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30, 300};
  const uint8_t vf = f.ConsumeIntegral<uint8_t>();
  const double sigma = kSigma[vf % 6];
  fill_values(c.q, rng, sigma, (vf >> 3) % 3);
  fill_values(c.k, rng, sigma, (vf >> 3) % 3);
  fill_values(c.v, rng, 1.0, 0);

  // Mask: none, bool or float, broadcast shape.
  const uint8_t mf = f.ConsumeIntegral<uint8_t>();
  if (mf % 3 != 0) {
    // A float mask has q's dtype, or (storage 3) float32, which any q allows.
    const DType mdt = mf % 3 == 1 ? DType::kBool : g_storage == 3 ? DType::kFloat32 : c.dtype;
    const int mrank = f.ConsumeIntegralInRange<int>(0, c.rank);
    const std::vector<int64_t> full = c.w_shape();
    const uint8_t bmask = f.ConsumeIntegral<uint8_t>();
    std::vector<int64_t> ms;
    for (int x = 0; x < mrank; ++x) {
      const int64_t dim = full[static_cast<size_t>(c.rank - mrank + x)];
      ms.push_back((bmask >> x & 1) ? 1 : dim);
    }
    c.mask.emplace(mdt, ms, Role::kAny, true, decode_layout(f, fancy));
    static const double kDensity[] = {0.7, 0.9, 0.3, 0.0, 1.0, 0.5};
    static const double kEmpty[] = {0, 0, 0.1, 0.5};
    fill_mask(c, rng, kDensity[(mf >> 2) % 6], kEmpty[(mf >> 5) % 4], (mf & 128) ? 30.0 : 1.0);
  }

  // Special values planted where the input says (not tame).
  if (!c.tame) {
    const int n = f.ConsumeIntegralInRange<int>(1, 8);
    for (int s = 0; s < n; ++s) {
      const uint8_t which = f.ConsumeIntegral<uint8_t>();
      const uint32_t where = f.ConsumeIntegral<uint32_t>();
      const uint8_t val = f.ConsumeIntegral<uint8_t>();
      Tensor* t = which % 4 == 0 ? &c.q : which % 4 == 1 ? &c.k : which % 4 == 2 ? &c.v : (c.mask ? &*c.mask : &c.v);
      if (t->numel() == 0) continue;
      double x = special(val, t->dtype());
      if (t == &*c.mask && c.mask) {
        if (t->dtype() == DType::kBool) x = val % 2 ? 0.0 : static_cast<double>(val);
        // NaN / +inf in a float mask are Errors (tested separately); in a 16-bit mask a finite
        // value may round to +inf (float16: 1e20).
        else if (std::isnan(x) || x == kInf || (is16(t->dtype()) && round_half(half_format(t->dtype()), x) == kInf)) x = -kInf;
      }
      // A whole row (same value everywhere in the last dim) or one element.
      if (which & 0x80) {
        const int64_t last = t->shape().empty() ? 1 : t->shape().back();
        const int64_t row = where % std::max<int64_t>(1, t->numel() / std::max<int64_t>(1, last));
        for (int64_t e = 0; e < last; ++e) t->set_flat(row * last + e, x);
      } else {
        t->set_flat(where % t->numel(), x);
      }
    }
  }
  if (g_seqlens) decode_seqlens(c);
  if (g_mods) decode_modifiers(c);  // after Hq and B (and seqlens_k) are known
  if (g_blocks) decode_block_mask(c);  // after Nq and Nk are known
  // Tame: finite, |values| <= 1e3, |scale| <= 1e3: float32 scores and sums cannot overflow.
  if (c.tame && o.scale && !(std::fabs(*o.scale) <= 1e3)) c.tame = false;
  if (c.tame && o.scale && *o.scale != 0 && std::fabs(*o.scale) < 1e-30) c.tame = false;
  return true;
}

// ---- (f): empty views with huge dims ----

void run_huge(FuzzedDataProvider& f) {
  Case c;
  c.huge = true;
  c.path_cap = g_path_cap;
  c.dtype = f.ConsumeBool() ? DType::kFloat64 : DType::kFloat32;
  c.rank = f.ConsumeIntegralInRange<int>(2, 4);
  static const int64_t kHuge[] = {0, 0, 1, 2, 3, int64_t{1} << 20, (int64_t{1} << 31) + 1, int64_t{1} << 40, int64_t{1} << 62};
  Dims& d = c.d;
  d.B = c.rank == 4 ? pick(f, kHuge) : 1;
  d.Hkv = c.rank >= 3 ? pick(f, kHuge) : 1;
  d.Hq = c.rank >= 3 ? (f.ConsumeBool() ? d.Hkv : 0) : 1;
  d.Nq = pick(f, kHuge); d.Nk = pick(f, kHuge); d.Dk = pick(f, kHuge); d.Dv = pick(f, kHuge);
  const uint8_t of = f.ConsumeIntegral<uint8_t>();
  // The ext byte's storage: 16-bit (float16 where the bool above picked float64); a float32 q
  // over a 16-bit k, v for storage 2.
  if (g_storage != 0) {
    c.kv = c.dtype == DType::kFloat64 ? DType::kFloat16 : DType::kBFloat16;
    c.dtype = g_storage == 2 ? DType::kFloat32 : c.kv;
  } else {
    c.kv = c.dtype;
  }
  if (c.all_bf16() && d.Dk == 0 && c.path_cap != sdpa::KernelPath::kSimd && skipping("bf16_dk0")) {  // F11
    c.path_cap = g_path_cap = sdpa::KernelPath::kSimd;
    sdpa::set_max_kernel_path(g_path_cap);
  }
  c.opt.causal = static_cast<Causal>(of % 3);
  static const int64_t kWin[] = {-1, 0, 3, 100, int64_t{1} << 41, INT64_MAX};
  if (of & 4) c.opt.window = {pick(f, kWin), pick(f, kWin)};
  c.opt.backend = static_cast<Backend>(f.ConsumeIntegralInRange<int>(0, 3));
  if (of & 8) { c.opt.dropout_p = 0.5; c.opt.seed = 1; }
  if (of & 16) c.opt.scale = 0.5;
  auto numel = [](std::vector<int64_t> s) {
    __int128 n = 1;
    for (int64_t x : s) n = (x == 0 || n == 0) ? 0 : std::min<__int128>(n * x, __int128{1} << 64);
    return n;
  };
  constexpr __int128 kMax = 4096;
  const auto qs = last_dims(c.rank, {d.B, d.Hq, d.Nq, d.Dk}), ks = last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dk}),
             vs = last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dv}), os = c.out_shape(), ws = c.w_shape(), ls = c.lse_shape();
  // Every tensor we must allocate is small; at least one dim is huge.
  if (numel(qs) > kMax || numel(ks) > kMax || numel(vs) > kMax || numel(os) > kMax) return;
  if (std::max({d.B, d.Hq, d.Nq, d.Nk, d.Dk, d.Dv}) < (int64_t{1} << 20)) return;
  // The products of the dims must fit int64_t for a valid call (validation may refuse otherwise).
  c.want_lse = numel(ls) <= kMax && (of & 32);
  c.want_weights = numel(ws) <= kMax && (of & 64);
  const bool huge_ref = c.want_lse && d.Nk > (1 << 20) && (c.opt.backend == Backend::kReference || c.opt.backend == Backend::kNaive);
  if (huge_ref && skipping("huge_reference")) return;
  const LayoutSpec ls0 = decode_layout(f, true);
  c.q.init(c.dtype, qs, Role::kUnitLast, true, ls0);
  c.k.init(c.kv, ks, Role::kUnitLast, true, ls0);
  c.v.init(c.kv, vs, Role::kUnitLast, true, ls0);
  std::mt19937_64 rng(7);
  fill_values(c.q, rng, 1, 0);
  fill_values(c.k, rng, 1, 0);
  fill_values(c.v, rng, 1, 0);
  const uint8_t mf = f.ConsumeIntegral<uint8_t>();
  double bias = 0;
  bool full_mask = false;
  if (mf % 4 == 1) {  // a scalar (rank 0) or all-ones-shape mask: one bias for every score
    const bool b = mf & 4;
    c.mask.emplace(b ? DType::kBool : c.dtype, std::vector<int64_t>(static_cast<size_t>(f.ConsumeIntegralInRange<int>(0, c.rank)), 1), Role::kAny, true, LayoutSpec::plain());
    const double x = b ? ((mf & 8) ? 1.0 : 0.0) : ((mf & 8) ? -kInf : 1.5);
    c.mask->set_flat(0, x);
    bias = b ? (x != 0 ? 0.0 : -kInf) : x;
  } else if (mf % 4 == 2) {  // a full-shaped float mask: empty when the scores are
    if (numel(ws) > kMax && numel(ws) != 0) return;
    if (numel(ws) == 0 && std::max({d.B, d.Hq, d.Nq, d.Nk}) >= (int64_t{1} << 20) && skipping("huge_mask")) return;
    c.mask.emplace(f.ConsumeBool() ? DType::kBool : c.dtype, ws, Role::kAny, true, decode_layout(f, true));
    full_mask = true;
  }
  g_case = describe(c);
  if (g_print) std::fprintf(stderr, "attention_fuzz: case\n%s", g_case.c_str());
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  const auto t0 = std::chrono::steady_clock::now();
  bool threw = false;
  std::string what;
  try {
    sdpa::attention(c.inputs(), o.outputs(), c.opt);
  } catch (const sdpa::Error& e) {
    threw = true;
    what = e.what();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(secs < 2.0, "empty_fast", [&] { return "attention on empty views took " + num(secs) + " s"; });
  // An Error is acceptable only when an element count overflows int64_t.
  if (threw) {
    bool overflow = false;
    for (const auto& s : {qs, ks, vs, os}) {
      int64_t m = 1;
      for (int64_t x : s) if (__builtin_mul_overflow(m, x, &m)) overflow = true;
    }
    for (const auto& s : {ws, ls}) {
      int64_t m = 1;
      for (int64_t x : s) if (__builtin_mul_overflow(m, x, &m)) overflow = true;
    }
    check(overflow, "unexpected_error", [&] { return "attention threw on empty views with huge dims: " + what; });
    return;
  }
  check_outs_written(o);
  if (o.lse && d.Dk == 0 && !full_mask) {
    for (int64_t n = 0; n < o.lse->numel(); ++n) {
      const int64_t i = d.Nq > 0 ? n % d.Nq : 0;
      const int64_t cnt = allowed_count(c.opt, d.Nq, d.Nk, i);
      const double want = (cnt == 0 || bias == -kInf) ? -kInf : bias + std::log(static_cast<double>(cnt));
      const double got = o.lse->flat(n);
      const double tol = 8 * eps_of(c.compute()) * (1 + std::fabs(want));  // lse has the compute type
      check(got == want || std::fabs(got - want) <= tol, "empty_lse", [&] {
        return "lse[" + std::to_string(n) + "] = " + num(got) + ", want " + num(want) + " = bias + log(" + std::to_string(cnt) + " allowed keys) (Dk = 0: every score is the bias)";
      });
    }
  }
  if (d.Dk == 0 && !c.want_weights && c.opt.dropout_p == 0) {
    // Backward with the forward's out and lse: gradients are empty; must return quickly too.
    if (!o.lse || o.lse->numel() == 0) return;
    Tensor dout(c.dtype, os, Role::kUnitLast, true, LayoutSpec::plain());
    for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
    Grads g = make_grads(c, LayoutSpec::plain());
    const auto t1 = std::chrono::steady_clock::now();
    try {
      sdpa::attention_backward(c.inputs(), o.out.view(), o.lse->view(), dout.view(), g.gradients(), c.opt);
    } catch (const sdpa::Error&) {
    }
    const double s2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    check(s2 < 2.0, "empty_fast", [&] { return "attention_backward on empty views took " + num(s2) + " s"; });
  }
}

// ---- Invalid arguments ----

void apply_invalid(Case& c, Invalid inv, sdpa::Inputs& in, sdpa::Outputs& outs, bool& must_throw) {
  must_throw = true;
  const int r = c.rank;
  switch (inv) {
    case Invalid::kQBool: in.q.dtype = DType::kBool; break;
    // 16-bit cases break the dtype policy in their own ways: k and v of different 16-bit dtypes,
    // an out, weights or lse of the wrong one of q's dtype and the compute type.
    case Invalid::kKDtype:
      if (c.lowp() && c.d.Nq % 2) in.v.dtype = c.kv == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
      else in.k.dtype = c.dtype == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32;
      break;
    case Invalid::kOutDtype: outs.out.dtype = !c.lowp() ? DType::kBool : is16(c.dtype) ? DType::kFloat32 : c.kv; break;
    case Invalid::kWeightsDtype:
      if (outs.weights) outs.weights->dtype = is16(c.dtype) ? c.dtype : c.compute() == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32;
      else must_throw = false;
      break;
    case Invalid::kLseDtype:
      if (outs.lse) outs.lse->dtype = !c.lowp() ? DType::kBool : is16(c.dtype) ? c.dtype : c.kv;
      else must_throw = false;
      break;
    case Invalid::kMaskDtype:  // a float mask of a dtype neither float32 nor q's (float32 is allowed under any q)
      if (in.mask && c.mask->dtype() != DType::kBool)
        in.mask->dtype = c.dtype == DType::kFloat32 ? (c.lowp() ? c.kv : DType::kFloat64) : c.dtype == DType::kFloat16 ? DType::kBFloat16 : DType::kFloat16;
      else must_throw = false;
      break;
    case Invalid::kDk: in.k.shape[r - 1] += 1; break;
    case Invalid::kNkV: in.v.shape[r - 2] += 1; break;
    case Invalid::kHeads: if (r >= 3 && c.d.Hkv > 0 && c.d.Hq > 0) { in.q.shape[r - 3] = c.d.Hq + 1; if ((c.d.Hq + 1) % c.d.Hkv == 0) in.q.shape[r - 3] = c.d.Hq + 1 + (c.d.Hkv > 1 ? 1 : 0); if (in.q.shape[r - 3] % c.d.Hkv == 0) must_throw = false; } else must_throw = false; break;
    case Invalid::kBatch: if (r == 4) in.k.shape[0] += 1; else must_throw = false; break;
    case Invalid::kOutShape: outs.out.shape[r - 1] += 1; break;
    case Invalid::kWeightsShape: if (outs.weights) outs.weights->shape[r - 1] += 1; else must_throw = false; break;
    case Invalid::kLseShape: if (outs.lse) outs.lse->shape[outs.lse->rank - 1] += 1; else must_throw = false; break;
    case Invalid::kMaskShape: if (in.mask && in.mask->rank > 0) { in.mask->shape[in.mask->rank - 1] = c.d.Nk + 2; } else must_throw = false; break;
    case Invalid::kMaskRank: if (in.mask && r < 4) { sdpa::TensorView& m = *in.mask; for (int x = m.rank; x > 0; --x) { m.shape[x] = m.shape[x - 1]; m.strides[x] = m.strides[x - 1]; } m.shape[0] = 1; m.strides[0] = 0; m.rank += 1; if (m.rank <= r) must_throw = false; } else must_throw = false; break;
    case Invalid::kRank: in.q.rank = 1; break;
    case Invalid::kRankMismatch: if (r > 2) { in.k.rank = r - 1; for (int x = 0; x < r - 1; ++x) { in.k.shape[x] = in.k.shape[x + 1]; in.k.strides[x] = in.k.strides[x + 1]; } } else must_throw = false; break;
    case Invalid::kNullData: if (c.q.numel() > 0) in.q.data = nullptr; else if (c.d.B * c.d.Hq * c.d.Nq * c.d.Dv > 0) outs.out.data = nullptr; else must_throw = false; break;
    case Invalid::kOutStride0: { bool any = false; for (int x = 0; x < r; ++x) if (outs.out.shape[x] > 1 && c.q.numel() >= 0) { outs.out.strides[x] = 0; any = true; break; } must_throw = any && c.out_shape().size() && [&] { int64_t n = 1; for (int64_t s : c.out_shape()) n *= s; return n > 0; }(); break; }
    case Invalid::kWeightsStride0: { must_throw = false; if (outs.weights) { int64_t n = 1; for (int64_t s : c.w_shape()) n *= s; for (int x = 0; x < r; ++x) if (outs.weights->shape[x] > 1) { outs.weights->strides[x] = 0; must_throw = n > 0; break; } } break; }
    case Invalid::kLseStride0: { must_throw = false; if (outs.lse) { int64_t n = 1; for (int64_t s : c.lse_shape()) n *= s; for (int x = 0; x < outs.lse->rank; ++x) if (outs.lse->shape[x] > 1) { outs.lse->strides[x] = 0; must_throw = n > 0; break; } } break; }
    case Invalid::kLastStride: if (c.q.numel() > 0 && c.d.Dk > 1) in.q.strides[r - 1] = in.q.strides[r - 1] == 1 ? 2 : 1; else must_throw = false;
      if (must_throw && in.q.strides[r - 1] == 1) must_throw = false;
      break;
    case Invalid::kNegDim: in.v.shape[r - 1] = -1; break;
    case Invalid::kScaleNaN: c.opt.scale = kNaN; break;
    case Invalid::kScaleInf: c.opt.scale = -kInf; break;
    case Invalid::kScaleHugeF32: c.opt.scale = c.compute() == DType::kFloat32 ? 1e39 : kInf; break;               // (d)
    case Invalid::kScaleTinyF32: c.opt.scale = c.compute() == DType::kFloat32 ? 1e-46 : std::nan(""); break;       // (d)
    case Invalid::kDropoutRange: { static const double bad[] = {-0.1, 1.0, 1.5, kNaN, kInf}; c.opt.dropout_p = bad[c.d.Nq % 5]; c.opt.seed = 1; break; }
    case Invalid::kDropoutNoSeed: c.opt.dropout_p = 0.5; c.opt.seed.reset(); break;
    case Invalid::kMaskNaN:
    case Invalid::kMaskPosInf:
      if (c.mask && c.mask->dtype() != DType::kBool && c.mask->numel() > 0) c.mask->set_flat(c.mask->numel() / 2, inv == Invalid::kMaskNaN ? kNaN : kInf);
      else must_throw = false;
      break;
    case Invalid::kBackendEnum: c.opt.backend = static_cast<Backend>(7); break;
    case Invalid::kCausalEnum: c.opt.causal = static_cast<Causal>(9); break;
    case Invalid::kNumelOverflow: in.q.shape[0] = int64_t{1} << 40; in.q.shape[r - 1] = int64_t{1} << 40; in.q.rank = r;
      if (r == 2) { in.q.shape[0] = int64_t{1} << 40; in.q.shape[1] = int64_t{1} << 40; }
      break;
    default: must_throw = false; break;
  }
}

// ---- One forward (+ backward) case ----

// kernel_path: the path a call reports (sdpa::last_kernel_path) is no better than the cap,
// available here (kernel_path_available: this CPU, the SIMD targets not disabled: so kSimd under
// the AVX2 cap), and kSimd unless q, k and v are all bfloat16 (the header's KernelPath).
void check_kernel_path(const Case& c, sdpa::KernelPath p, const char* call) {
  if (g_print) std::fprintf(stderr, "attention_fuzz: %s ran on kernel path %s\n", call, path_name(p));
  const bool ok = static_cast<int>(p) <= static_cast<int>(c.path_cap) && sdpa::kernel_path_available(p) &&
                  (p == sdpa::KernelPath::kSimd || c.all_bf16());
  check(ok, "kernel_path", [&] {
    return std::string(call) + " reports kernel path " + path_name(p) + " (cap " + path_name(c.path_cap) + ", available: " +
           (sdpa::kernel_path_available(p) ? "yes" : "no") + ", dtype " + dtype_str(c.dtype) + "/" + dtype_str(c.kv) + ")";
  });
}

void poison_offsets(const Tensor& t, const Dims& d, int64_t off, int64_t heads, int64_t rows, int64_t cols,
                    std::vector<uint8_t>& hit /* heads*B x rows */) {
  // hit[(b * heads + h) * rows + n] = 1 when element (b, h, n, e) of t is at `off` for some e.
  hit.assign(static_cast<size_t>(d.B * heads * rows), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t e = 0; e < cols; ++e)
          if (t.offset4(b, h, n, e) == off) { hit[static_cast<size_t>((b * heads + h) * rows + n)] = 1; break; }
}

// ---- seqlens_k: keys past a sequence's length are never read ----

// The buffer elements of k (or v) that only keys past their sequence's length use (an element a
// key inside some length shares, through a zero or overlapping stride, is left alone).
std::vector<int64_t> past_offsets(const Case& c, const Tensor& t, int64_t cols) {
  const Dims& d = c.d;
  if (t.numel() == 0 || c.seqlens.empty()) return {};
  std::vector<int64_t> in, past;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hkv; ++h)
      for (int64_t j = 0; j < d.Nk; ++j)
        for (int64_t e = 0; e < cols; ++e) (j < c.keys_of(b) ? in : past).push_back(t.offset4(b, h, j, e));
  std::sort(in.begin(), in.end());
  std::sort(past.begin(), past.end());
  past.erase(std::unique(past.begin(), past.end()), past.end());
  std::vector<int64_t> r;
  for (int64_t o : past) if (!std::binary_search(in.begin(), in.end(), o)) r.push_back(o);
  return r;
}

// Garbage (NaN, ±inf, huge, random bits) in elements a call must not read, for as long as the
// object lives, and (ASan builds) their bytes made unaddressable: a read is an ASan report. The
// destructor puts the values back and the bytes into use again. One piece for every "never read"
// promise: keys past seqlens_k (PastKeysGarbage), a paged pool's unused pages and rows and a block
// table's entries past a sequence's pages (run_paged), a KVCache's unused rows (run_kvcache).
class Garbage {
 public:
  explicit Garbage(uint64_t seed) : rng_(seed) {}
  ~Garbage() {
#ifdef SDPA_FUZZ_ASAN
    for (const auto& [p, n] : regions_) ASAN_UNPOISON_MEMORY_REGION(p, n);
#endif
    for (const Saved& s : saved_) s.t->set_off(s.off, s.old);
  }
  Garbage(const Garbage&) = delete;
  Garbage& operator=(const Garbage&) = delete;

  // Elements of t at these offsets (sorted, distinct): garbage, then fenced.
  void values(Tensor& t, const std::vector<int64_t>& offs) {
    for (int64_t o : offs) {
      saved_.push_back({&t, o, t.get_off(o)});
      double x;
      const uint64_t r = rng_();
      if (r % 3 == 0) {  // random bits of the dtype
        if (t.dtype() == DType::kFloat64) x = std::bit_cast<double>(rng_());
        else if (t.dtype() == DType::kFloat32) x = std::bit_cast<float>(static_cast<uint32_t>(rng_()));
        else x = half_value(half_format(t.dtype()), static_cast<uint16_t>(rng_()));
      } else {
        x = special(static_cast<uint8_t>(r >> 8), t.dtype());
      }
      t.set_off(o, x);
    }
    fence(static_cast<std::byte*>(t.view().data), offs, esize(t.dtype()));
  }
  // Elements of `es` bytes at these offsets (sorted, distinct) from base: fenced only (their
  // values stay as they are).
  void fence(std::byte* base, const std::vector<int64_t>& offs, int64_t es) {
#ifdef SDPA_FUZZ_ASAN
    for (size_t a = 0; a < offs.size();) {  // runs of consecutive elements, one region each
      size_t z = a + 1;
      while (z < offs.size() && offs[z] == offs[z - 1] + 1) ++z;
      std::byte* p = base + offs[a] * es;
      const size_t n = static_cast<size_t>((offs[z - 1] - offs[a] + 1) * es);
      ASAN_POISON_MEMORY_REGION(p, n);
      regions_.push_back({p, n});
      a = z;
    }
#else
    (void)base;
    (void)offs;
    (void)es;
#endif
  }
  size_t count() const { return saved_.size(); }

 private:
  struct Saved { Tensor* t; int64_t off; double old; };
  std::mt19937_64 rng_;
  std::vector<Saved> saved_;
  std::vector<std::pair<std::byte*, size_t>> regions_;
};

// Garbage in the elements of k and v that only keys past their sequence's length use.
class PastKeysGarbage : public Garbage {
 public:
  PastKeysGarbage(Case& c, uint64_t seed) : Garbage(seed) {
    values(c.k, past_offsets(c, c.k, c.d.Dk));
    values(c.v, past_offsets(c, c.v, c.d.Dv));
  }
};

// An invalid seqlens_k (negative, past Nk, wrong shape, rank or dtype, null): attention,
// validate and attention_backward throw sdpa::Error and write nothing.
void run_bad_seqlens(Case& c, bool bad_scale) {
  const char* what_bad = kBadSeqlensNames[static_cast<int>(c.bad_sl)];
  g_case = describe(c) + "invalid seqlens_k: " + what_bad + "\n";
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                    o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
  auto throws = [&](const char* call, const std::function<void()>& fn, std::string& what) {
    try {
      fn();
    } catch (const sdpa::Error& e) {
      what = e.what();
      return true;
    } catch (const std::exception& e) {
      check(false, "other_exception", [&] { return std::string(call) + " threw a non-sdpa::Error exception: " + e.what(); });
    }
    return false;
  };
  std::string what;
  const bool threw = throws("attention", [&] { sdpa::attention(c.inputs(), o.outputs(), c.opt); }, what);
  check(threw, "error_expected", [&] { return std::string("attention: no sdpa::Error for an invalid seqlens_k: ") + what_bad; });
  const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                         (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
  check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") for seqlens_k but an output buffer changed"; });
  check(throws("validate", [&] { sdpa::validate(c.inputs(), c.opt); }, what), "error_expected",
        [&] { return std::string("validate: no sdpa::Error for an invalid seqlens_k: ") + what_bad; });
  if (!c.backward) return;
  // attention_backward with out and lse of a valid forward (the same call without seqlens_k).
  sdpa::Options opt = c.opt;
  opt.backend = Backend::kReference;
  if (bad_scale) opt.scale = 1.0;
  sdpa::Inputs in = c.inputs();
  in.seqlens_k.reset();
  Outs fo = make_outs(c, false, true, false);
  expect_no_throw("attention (without seqlens_k)", [&] { sdpa::attention(in, fo.outputs(), opt); });
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
  Grads g = make_grads(c, c.out_ls);
  const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
  const bool bthrew = throws("attention_backward", [&] {
    sdpa::attention_backward(c.inputs(), fo.out.view(), fo.lse->view(), dout.view(), g.gradients(), opt);
  }, what);
  check(bthrew, "error_expected", [&] { return std::string("attention_backward: no sdpa::Error for an invalid seqlens_k: ") + what_bad; });
  check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
        [&] { return "attention_backward: sdpa::Error(\"" + what + "\") for seqlens_k but a gradient buffer changed"; });
}

// An invalid score modifier (md bit 7, BadMod): attention and validate throw sdpa::Error and write
// nothing, and so does attention_backward (given the out and lse of a valid forward) on backward
// calls; the kDsinks* kinds break only the backward's Gradients::dsinks (dsinks untouched too).
void run_bad_modifiers(Case& c, bool bad_scale) {
  const Modifiers& m = *c.mods;
  const char* what_bad = kBadModNames[static_cast<int>(m.bad)];
  g_case = describe(c);
  std::mt19937_64 rng(m.bad_seed);
  const int64_t Hq = c.d.Hq, B = c.rank == 4 ? c.d.B : 1;
  const bool f32 = c.compute() == DType::kFloat32;
  sdpa::Options bad = c.opt;
  std::optional<Tensor> made;  // the tensor behind a broken view
  bool must_throw = true;
  const auto small = [&](DType dt, std::vector<int64_t> shape, bool input = true) -> Tensor& {
    made.emplace(dt, std::move(shape), Role::kAny, input, LayoutSpec::plain());
    for (int64_t n = 0; input && n < made->numel(); ++n) made->set_flat(n, 0.25);
    return *made;
  };
  static const DType kBadDtype[] = {DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kBool};
  const double kNonFinite[] = {kNaN, kInf, -kInf, f32 ? 1e39 : kNaN};  // 1e39: finite, but not in float32
  const auto with_value = [&](std::optional<sdpa::TensorView>& slot) {
    if (Hq == 0) { must_throw = false; return; }
    Tensor& t = small(rng() % 2 ? DType::kFloat64 : DType::kFloat32, {Hq});
    t.set_flat(static_cast<int64_t>(rng() % static_cast<uint64_t>(Hq)), kNonFinite[rng() % 4]);
    slot = t.view();
  };
  const auto with_dtype = [&](std::optional<sdpa::TensorView>& slot) {
    sdpa::TensorView v = small(DType::kFloat32, {Hq}).view();
    v.dtype = kBadDtype[rng() % 4];
    slot = v;
  };
  const auto with_null = [&](std::optional<sdpa::TensorView>& slot) {
    if (Hq == 0) { must_throw = false; return; }
    sdpa::TensorView v = small(DType::kFloat32, {Hq}).view();
    v.data = nullptr;
    slot = v;
  };
  switch (m.bad) {
    case BadMod::kCapNegative: bad.softcap = rng() % 2 ? -1.0 : -1e-30; break;
    case BadMod::kCapNaN: bad.softcap = kNaN; break;
    case BadMod::kCapInf: bad.softcap = rng() % 2 ? kInf : -kInf; break;
    case BadMod::kCapRange: bad.softcap = f32 ? (rng() % 2 ? 1e39 : 1e-40) : -DBL_MIN; break;  // float32: not a normal float32
    case BadMod::kOrderEnum: bad.softcap_order = static_cast<sdpa::Options::SoftcapOrder>(2 + rng() % 200); break;
    case BadMod::kSlopesShape: bad.alibi_slopes = small(DType::kFloat32, {Hq + 1}).view(); break;
    case BadMod::kSlopesBatch: bad.alibi_slopes = small(DType::kFloat64, {B + 2, Hq}).view(); break;
    case BadMod::kSlopesRank: bad.alibi_slopes = small(DType::kFloat32, {1, 1, Hq}).view(); break;
    case BadMod::kSlopesDtype: with_dtype(bad.alibi_slopes); break;
    case BadMod::kSlopesValue: with_value(bad.alibi_slopes); break;
    case BadMod::kSlopesNull: with_null(bad.alibi_slopes); break;
    case BadMod::kSinksShape: bad.sinks = small(DType::kFloat64, {Hq + 1}).view(); break;
    case BadMod::kSinksRank: bad.sinks = small(DType::kFloat32, {1, Hq}).view(); break;
    case BadMod::kSinksDtype: with_dtype(bad.sinks); break;
    case BadMod::kSinksValue: with_value(bad.sinks); break;
    case BadMod::kSinksNull: with_null(bad.sinks); break;
    default: break;
  }
  auto throws = [&](const char* call, const std::function<void()>& fn, std::string& what) {
    try {
      fn();
    } catch (const sdpa::Error& e) {
      what = e.what();
      return true;
    } catch (const std::exception& e) {
      check(false, "other_exception", [&] { return std::string(call) + " threw a non-sdpa::Error exception: " + e.what(); });
    }
    return false;
  };
  std::string what;
  // The out and lse of a valid forward (the case's own modifiers; scale 1 where the case's is
  // out of range), for attention_backward.
  sdpa::Options ok = c.opt;
  ok.backend = Backend::kReference;
  if (bad_scale) ok.scale = 1.0;
  if (m.bad == BadMod::kDsinksNoSinks) ok.sinks.reset();
  if (m.bad < BadMod::kDsinksNoSinks) {
    if (!must_throw) return;  // nothing to break (Hq = 0)
    Outs o = make_outs(c, c.want_weights, c.want_lse, true);
    const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                      o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
    const bool threw = throws("attention", [&] { sdpa::attention(c.inputs(), o.outputs(), bad); }, what);
    check(threw, "error_expected", [&] { return std::string("attention: no sdpa::Error for an invalid modifier: ") + what_bad; });
    const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                           (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
    check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") for a modifier but an output buffer changed"; });
    check(throws("validate", [&] { sdpa::validate(c.inputs(), bad); }, what), "error_expected",
          [&] { return std::string("validate: no sdpa::Error for an invalid modifier: ") + what_bad; });
    if (!c.backward) return;
  }
  Outs fo = make_outs(c, false, true, false);
  expect_no_throw("attention (valid modifiers)", [&] { sdpa::attention(c.inputs(), fo.outputs(), ok); });
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
  Grads g = make_grads(c, c.out_ls, true);
  sdpa::Gradients gr = g.gradients();
  sdpa::Options bo = bad;
  bo.backend = Backend::kReference;
  if (bad_scale) bo.scale = 1.0;
  if (m.bad >= BadMod::kDsinksNoSinks) {
    bo = ok;
    Tensor& ds = small(DType::kFloat32, {m.bad == BadMod::kDsinksShape ? Hq + 1 : Hq}, false);
    gr.dsinks = ds.view();
    if (m.bad == BadMod::kDsinksDtype) gr.dsinks->dtype = kBadDtype[rng() % 4];
    if (m.bad == BadMod::kDsinksStride0) {
      gr.dsinks->strides[0] = 0;
      must_throw = Hq > 1 || !ok.sinks;  // one element may have any stride; without sinks dsinks is an Error
    }
    if (!must_throw) return;
  }
  const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
  const auto s3 = g.dsinks ? g.dsinks->snapshot() : std::vector<std::byte>{};
  const auto s4 = made && !(m.bad < BadMod::kDsinksNoSinks) ? made->snapshot() : std::vector<std::byte>{};
  const bool bthrew = throws("attention_backward", [&] {
    sdpa::attention_backward(c.inputs(), fo.out.view(), fo.lse->view(), dout.view(), gr, bo);
  }, what);
  check(bthrew, "error_expected", [&] { return std::string("attention_backward: no sdpa::Error for an invalid modifier: ") + what_bad; });
  check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2) && (!g.dsinks || g.dsinks->same_bytes(s3)) &&
            (s4.empty() || made->same_bytes(s4)),
        "error_untouched", [&] { return "attention_backward: sdpa::Error(\"" + what + "\") for a modifier but a gradient buffer changed"; });
}

// The header's Error for a block mask names it: "block_mask", or "block_q" / "block_k" for a
// size below 1.
void check_error_names(const std::string& what, const char* name, const char* call, const char* what_bad) {
  check(what.find(name) != std::string::npos, "error_names", [&] {
    return std::string(call) + ": the sdpa::Error for an invalid block mask (" + what_bad + ") does not name " + name + ": \"" + what + "\"";
  });
}

// An invalid block mask (BadBlocks): attention, validate and (backward calls, given the out and lse
// of a valid forward) attention_backward throw an sdpa::Error that names block_mask (block_q,
// block_k) and write nothing. The rest of the call is valid (a scale the compute type cannot hold
// is replaced by 1, so that the block mask is the only fault).
void run_bad_blocks(Case& c, bool bad_scale) {
  const BlockMask& bl = *c.blocks;
  const char* what_bad = kBadBlocksNames[static_cast<int>(bl.bad)];
  g_case = describe(c);
  std::mt19937_64 rng(bl.bad_seed);
  sdpa::Options bad = c.opt;
  if (bad_scale) bad.scale = 1.0;
  const char* name = "block_mask";
  std::optional<Tensor> made;  // the tensor behind a broken view
  sdpa::TensorView v = bl.mask.view();
  std::vector<int64_t> shape = bl.mask.shape();
  const int r = c.rank, mr = bl.mask.rank();
  const auto bool_tensor = [&](std::vector<int64_t> sh) -> sdpa::TensorView {
    made.emplace(DType::kBool, std::move(sh), Role::kAny, true, block_layout(rng));
    for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, rng() % 2 ? 1.0 : 0.0);
    return made->view();
  };
  switch (bl.bad) {
    case BadBlocks::kDtype: {
      // A float64 buffer of the mask's shape (8 bytes an element: room for any dtype's view).
      made.emplace(DType::kFloat64, shape, Role::kAny, true, LayoutSpec::plain());
      for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, 1.0);
      v = made->view();
      static const DType kBad[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64};
      v.dtype = kBad[rng() % 6];
      break;
    }
    case BadBlocks::kShape: {
      const size_t d = static_cast<size_t>(mr - 1 - static_cast<int>(rng() % 2));
      if (shape[d] > 0 && rng() % 2) shape[d] -= 1; else shape[d] += 1;
      v = bool_tensor(shape);
      break;
    }
    case BadBlocks::kLeadShape: {
      // A leading dim that is neither 1 nor its B / Hq (that + 2); a mask without one gets (Hq + 2, ..)
      // (for rank-2 q a rank error: the Error names block_mask all the same).
      const int64_t full[4] = {c.d.B, c.d.Hq, 0, 0};
      if (mr > 2) {
        const int x = static_cast<int>(rng() % static_cast<uint64_t>(mr - 2));
        shape[static_cast<size_t>(x)] = full[4 - mr + x] + 2;
      } else {
        shape.insert(shape.begin(), c.d.Hq + 2);
      }
      v = bool_tensor(shape);
      break;
    }
    case BadBlocks::kRank: {
      const int pick_rank = static_cast<int>(rng() % 3);  // 0: rank 0, 1: rank 1, 2: q's rank + 1 (rank 1 for rank-4 q)
      if (pick_rank == 2 && r < 4) {
        shape.insert(shape.begin(), 1);
        while (static_cast<int>(shape.size()) < r + 1) shape.insert(shape.begin(), 1);
        v = bool_tensor(shape);
      } else if (pick_rank == 0) {
        v = bool_tensor({1});
        v.rank = 0;
      } else {
        v = bool_tensor({shape.back()});
      }
      break;
    }
    case BadBlocks::kBlockQ:
    case BadBlocks::kBlockK: {
      static const int64_t kBadSize[] = {0, -1, -128, INT64_MIN};
      (bl.bad == BadBlocks::kBlockQ ? bad.block_q : bad.block_k) = kBadSize[rng() % 4];
      name = bl.bad == BadBlocks::kBlockQ ? "block_q" : "block_k";
      break;
    }
    case BadBlocks::kNull:
      if (bl.mask.numel() == 0) return;  // an empty view may have null data: nothing to break
      v.data = nullptr;
      break;
    default: return;
  }
  bad.block_mask = v;
  if (made) g_case += made->describe("block_mask (given)") + "\n";
  g_case += std::string("given: rank ") + std::to_string(v.rank) + ", dtype " + dtype_long(v.dtype) + ", block_q=" +
            std::to_string(bad.block_q) + " block_k=" + std::to_string(bad.block_k) + (v.data ? "" : ", null data") + "\n";
  auto throws = [&](const char* call, const std::function<void()>& fn, std::string& what) {
    try {
      fn();
    } catch (const sdpa::Error& e) {
      what = e.what();
      return true;
    } catch (const std::exception& e) {
      check(false, "other_exception", [&] { return std::string(call) + " threw a non-sdpa::Error exception: " + e.what(); });
    }
    return false;
  };
  std::string what;
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                    o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
  const bool threw = throws("attention", [&] { sdpa::attention(c.inputs(), o.outputs(), bad); }, what);
  check(threw, "error_expected", [&] { return std::string("attention: no sdpa::Error for an invalid block mask: ") + what_bad; });
  const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                         (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
  check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") for a block mask but an output buffer changed"; });
  check_error_names(what, name, "attention", what_bad);
  check(throws("validate", [&] { sdpa::validate(c.inputs(), bad); }, what), "error_expected",
        [&] { return std::string("validate: no sdpa::Error for an invalid block mask: ") + what_bad; });
  check_error_names(what, name, "validate", what_bad);
  if (!c.backward) return;
  sdpa::Options ok = c.opt;
  ok.backend = Backend::kReference;
  if (bad_scale) ok.scale = 1.0;
  Outs fo = make_outs(c, false, true, false);
  expect_no_throw("attention (valid block mask)", [&] { sdpa::attention(c.inputs(), fo.outputs(), ok); });
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
  Grads g = make_grads(c, c.out_ls, true);
  sdpa::Options bo = bad;
  bo.backend = Backend::kReference;
  const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
  const auto s3 = g.dsinks ? g.dsinks->snapshot() : std::vector<std::byte>{};
  const bool bthrew = throws("attention_backward", [&] {
    sdpa::attention_backward(c.inputs(), fo.out.view(), fo.lse->view(), dout.view(), g.gradients(), bo);
  }, what);
  check(bthrew, "error_expected", [&] { return std::string("attention_backward: no sdpa::Error for an invalid block mask: ") + what_bad; });
  check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2) && (!g.dsinks || g.dsinks->same_bytes(s3)),
        "error_untouched", [&] { return "attention_backward: sdpa::Error(\"" + what + "\") for a block mask but a gradient buffer changed"; });
  check_error_names(what, name, "attention_backward", what_bad);
}

// The element mask the header calls equivalent to the case's block mask (on top of its own mask):
// (B, Hq, Nq, Nk) (q's rank's last dims), contiguous; bool (1 where the block and a bool mask allow
// the key), or, over a float mask, that mask's dtype with its bias where the block allows the key
// and -inf where it does not.
Tensor expanded_mask(const Case& c) {
  const bool float_mask = c.mask && c.mask->dtype() != DType::kBool;
  Tensor m(float_mask ? c.mask->dtype() : DType::kBool, c.w_shape(), Role::kAny, true, LayoutSpec::plain());
  const Dims& d = c.d;
  int64_t at = 0;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i)
        for (int64_t j = 0; j < d.Nk; ++j, ++at) {
          const bool block = c.block_allows(b, h, i, j);
          if (float_mask) m.set_flat(at, block ? c.mask->at4(b, h, i, j) : -kInf);
          else m.set_flat(at, block && (!c.mask || c.mask->at4(b, h, i, j) != 0) ? 1.0 : 0.0);
        }
  return m;
}

// Bitwise equal (any NaN equals any NaN): "" or the first difference.
std::string outs_equal(const Outs& a, const Outs& b) {
  auto cmp = [](const Tensor& x, const Tensor& y, const char* name) -> std::string {
    for (int64_t n = 0; n < x.numel(); ++n) {
      const double p = x.flat(n), q = y.flat(n);
      if (!(same_bits(p, q) || (std::isnan(p) && std::isnan(q))))
        return std::string(name) + "[" + std::to_string(n) + "]: " + num(p) + " vs " + num(q);
    }
    return "";
  };
  std::string r = cmp(a.out, b.out, "out");
  if (r.empty() && a.weights && b.weights) r = cmp(*a.weights, *b.weights, "weights");
  if (r.empty() && a.lse && b.lse) r = cmp(*a.lse, *b.lse, "lse");
  return r;
}

// Key tile t (keys [128 t, 128 t + 128)) of (b, kvh) is blocked by the block mask for every row
// of every query head of the group: the header's fused forward then neither scores nor reads it.
std::vector<uint8_t> unread_tiles(const Case& c) {
  const Dims& d = c.d;
  constexpr int64_t kTile = 128;
  const int64_t tiles = ceil_div(d.Nk, kTile), group = d.group();
  std::vector<uint8_t> r(static_cast<size_t>(d.B * d.Hkv * tiles), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t kvh = 0; kvh < d.Hkv; ++kvh)
      for (int64_t t = 0; t < tiles; ++t) {
        bool blocked = true;
        for (int64_t h = kvh * group; h < (kvh + 1) * group && blocked; ++h)
          for (int64_t i = 0; i < d.Nq && blocked; ++i)
            for (int64_t j = t * kTile; j < std::min(d.Nk, (t + 1) * kTile) && blocked; ++j) blocked = !c.block_allows(b, h, i, j);
        r[static_cast<size_t>((b * d.Hkv + kvh) * tiles + t)] = blocked;
      }
  return r;
}

// The buffer elements of k (or v) that only keys of unread tiles use (one shared, through a zero or
// overlapping stride, with a key of a tile that is read is left alone).
std::vector<int64_t> unread_offsets(const Case& c, const std::vector<uint8_t>& unread, const Tensor& t, int64_t cols) {
  const Dims& d = c.d;
  if (t.numel() == 0) return {};
  const int64_t tiles = ceil_div(d.Nk, 128);
  std::vector<int64_t> in, out;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hkv; ++h)
      for (int64_t j = 0; j < d.Nk; ++j) {
        const bool skip = unread[static_cast<size_t>((b * d.Hkv + h) * tiles + j / 128)] != 0;
        for (int64_t e = 0; e < cols; ++e) (skip ? out : in).push_back(t.offset4(b, h, j, e));
      }
  std::sort(in.begin(), in.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  std::vector<int64_t> r;
  for (int64_t o : out) if (!std::binary_search(in.begin(), in.end(), o)) r.push_back(o);
  return r;
}

// block_equiv and blocks_unread on a valid forward with a block mask (`full`: the call's out,
// weights and lse).
void check_blocks_forward(Case& c, const Outs& full) {
  {
    const Tensor em = expanded_mask(c);
    sdpa::Inputs in = c.inputs();
    in.mask = em.view();
    sdpa::Options o = c.opt;
    o.block_mask.reset();
    Outs e = make_outs(c, true, true, false);
    run_forward(c, in, e, o);
    const std::string why = outs_equal(full, e);
    check(why.empty(), "block_equiv", [&] {
      return "attention with the block mask differs from the same call with the equivalent element mask (" + em.describe("mask") + "): " + why;
    });
  }
  if (c.opt.backend != Backend::kFlash && c.opt.backend != Backend::kAuto) return;
  const std::vector<uint8_t> unread = unread_tiles(c);
  Outs g2 = make_outs(c, true, true, false);
  size_t n = 0;
  {
    Garbage garbage(0xb10c0ffeull + g_bm_seed);
    garbage.values(c.k, unread_offsets(c, unread, c.k, c.d.Dk));
    garbage.values(c.v, unread_offsets(c, unread, c.v, c.d.Dv));
    n = garbage.count();
    if (n > 0) run_forward(c, c.inputs(), g2, c.opt);
  }
  if (n == 0) return;
  const std::string why = outs_equal(full, g2);
  check(why.empty(), "blocks_unread", [&] {
    return "attention with garbage (NaN, inf, random bits) in the k, v rows of " + std::to_string(n) +
           " elements of key tiles the block mask blocks for every row differs: " + why;
  });
}

void run_case(FuzzedDataProvider& f) {
  Case c;
  Invalid invalid = Invalid::kNone;
  if (!decode(f, c, invalid)) return;
  const Dims& d = c.d;
  sdpa::set_num_threads(c.threads);
  g_case = describe(c);
  if (g_print) std::fprintf(stderr, "attention_fuzz: case\n%s", g_case.c_str());

  // (d): a scale the compute type cannot hold is an Error now (float32 for 16-bit q too).
  const bool f32 = c.compute() == DType::kFloat32;
  bool bad_scale = false;
  if (c.opt.scale) {
    const double s = *c.opt.scale;
    bad_scale = !std::isfinite(s) || (f32 && (std::fabs(s) > FLT_MAX || (s != 0 && static_cast<float>(s) == 0)));
  }

  // An invalid seqlens_k (it comes before the other invalid arguments, whose backward-only kinds
  // need a valid forward).
  if (c.bad_sl != BadSeqlens::kNone) {
    run_bad_seqlens(c, bad_scale);
    return;
  }
  // An invalid score modifier (kExtModifiers, md bit 7).
  if (c.mods && c.mods->bad != BadMod::kNone) {
    run_bad_modifiers(c, bad_scale);
    return;
  }
  // An invalid block mask (kExtBlocks, bm_seed's top bits).
  if (c.blocks && c.blocks->bad != BadBlocks::kNone) {
    run_bad_blocks(c, bad_scale);
    return;
  }

  // Invalid arguments: must throw sdpa::Error, and write nothing.
  if (invalid != Invalid::kNone) {
    Outs o = make_outs(c, c.want_weights, c.want_lse, true);
    sdpa::Inputs in = c.inputs();
    sdpa::Outputs outs = o.outputs();
    bool must_throw = true;
    const bool bwd_only = invalid >= Invalid::kLsePosInf;
    if (!bwd_only) apply_invalid(c, invalid, in, outs, must_throw);
    if (c.mask) in.mask->data = c.mask->view().data;  // (values may have changed in place; same buffer)
    g_case = describe(c) + "invalid argument: " + kInvalidNames[static_cast<int>(invalid)] + "\n";
    if (!bwd_only) {
      const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                        o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
      bool threw = false;
      std::string what;
      try {
        sdpa::attention(in, outs, c.opt);
      } catch (const sdpa::Error& e) {
        threw = true;
        what = e.what();
      } catch (const std::exception& e) {
        check(false, "other_exception", [&] { return std::string("attention threw a non-sdpa::Error exception: ") + e.what(); });
      }
      if (threw) {
        const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                               (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
        check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") but an output buffer changed"; });
      } else {
        const bool is_d = invalid == Invalid::kScaleHugeF32 || invalid == Invalid::kScaleTinyF32;
        check(!must_throw, is_d ? "scale_range" : "error_expected", [&] { return std::string("no sdpa::Error for: ") + kInvalidNames[static_cast<int>(invalid)]; });
      }
      return;
    }
    // Backward-only invalid arguments: build a valid forward first.
    c.opt.backend = Backend::kReference;
    if (bad_scale) c.opt.scale = 1.0;
    Outs fo = make_outs(c, false, true, false);
    run_forward(c, c.inputs(), fo, c.opt);
    Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
    for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
    Grads g = make_grads(c, c.out_ls);
    sdpa::Gradients gr = g.gradients();
    sdpa::TensorView lse = fo.lse->view(), doutv = dout.view();
    must_throw = true;
    switch (invalid) {
      case Invalid::kLsePosInf: if (fo.lse->numel() > 0) fo.lse->set_flat(fo.lse->numel() - 1, kInf); else must_throw = false; break;
      case Invalid::kDoutShape: doutv.shape[c.rank - 1] += 1; break;
      case Invalid::kDqShape: gr.dq.shape[c.rank - 2] += 1; break;
      case Invalid::kDkStride0: { must_throw = false; if (g.dk.numel() > 0) for (int x = 0; x < c.rank; ++x) if (gr.dk.shape[x] > 1) { gr.dk.strides[x] = 0; must_throw = true; break; } break; }
      case Invalid::kDvDtype: gr.dv.dtype = c.kv == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32; break;  // dv must have v's dtype
      case Invalid::kGradNull: if (g.dq.numel() > 0) gr.dq.data = nullptr; else must_throw = false; break;
      default: must_throw = false; break;
    }
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    bool threw = false;
    std::string what;
    try {
      sdpa::attention_backward(c.inputs(), fo.out.view(), lse, doutv, gr, c.opt);
    } catch (const sdpa::Error& e) {
      threw = true;
      what = e.what();
    } catch (const std::exception& e) {
      check(false, "other_exception", [&] { return std::string("attention_backward threw a non-sdpa::Error exception: ") + e.what(); });
    }
    if (threw) {
      check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
            [&] { return "attention_backward: sdpa::Error(\"" + what + "\") but a gradient buffer changed"; });
    } else {
      const bool empty_grads = g.dq.numel() == 0 && g.dk.numel() == 0 && g.dv.numel() == 0;
      check(!must_throw, invalid == Invalid::kLsePosInf ? (empty_grads ? "lse_inf_backward_empty" : "lse_inf_backward") : "error_expected",
            [&] { return std::string("attention_backward: no sdpa::Error for: ") + kInvalidNames[static_cast<int>(invalid)]; });
    }
    return;
  }

  // A valid call, except maybe for (d).
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  if (bad_scale) {
    const auto snap = o.out.snapshot();
    bool threw = false;
    try {
      sdpa::attention(c.inputs(), o.outputs(), c.opt);
    } catch (const sdpa::Error&) {
      threw = true;
    }
    check(threw, "scale_range", [&] { return "scale " + num(*c.opt.scale) + " is not representable in " + (f32 ? "float32" : "float64") + " (or not finite) but no sdpa::Error"; });
    check(o.out.same_bytes(snap), "error_untouched", [&] { return std::string("scale Error but out changed"); });
    return;
  }
  run_forward(c, c.inputs(), o, c.opt);
  check_kernel_path(c, sdpa::last_kernel_path(), "attention");
  check_outs_written(o);

  // Repeatable, across thread counts.
  {
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_outs(c, c.want_weights, c.want_lse, false);
    run_forward(c, c.inputs(), o2, c.opt);
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(o.bitwise_equal(o2, why), "repeatable", [&] { return "two identical calls (threads " + std::to_string(c.threads) + " and " + std::to_string(3 - c.threads) + ") differ: " + why; });
  }

  // Edge semantics, from the classified scores (tame or not).
  {
    Outs full = make_outs(c, true, true, false);
    run_forward(c, c.inputs(), full, c.opt);
    std::string why;
    check(o.bitwise_equal(full, why), "weights_invariant", [&] { return "the same call with weights and lse requested differs: " + why; });
    check_edge_semantics(c, full);
    // seqlens_k: the same call with garbage in the keys past each length (and, under ASan,
    // those bytes unaddressable) gives the same bits.
    if (!c.seqlens.empty()) {
      Outs g2 = make_outs(c, true, true, false);
      bool ran = false;
      {
        PastKeysGarbage garbage(c, 0x9a4ba9eull + g_sk_seed);
        if (garbage.count() > 0) {
          run_forward(c, c.inputs(), g2, c.opt);
          ran = true;
        }
      }
      if (ran)
        check(full.bitwise_equal(g2, why), "seqlens_unread",
              [&] { return "attention with garbage (NaN, inf, random bits) in k, v past seqlens_k differs: " + why; });
    }
    // Block mask: the same bits as the equivalent element mask; tiles it skips are never read.
    if (c.blocks) check_blocks_forward(c, full);
  }

  if (c.tame) check_tolerance(c, o);
  // Outputs::stats and Outputs::scores against kReference (mode bits kModeStats: a quarter of the dense calls).
  if ((g_mode & kModeStats) == kModeStats) check_stats(c, o);

  // Poison: plant NaN/inf/huge in k or v (or q) and compare the rows it must not reach.
  const uint8_t pf = f.ConsumeIntegral<uint8_t>();
  if (pf & 1) {
    const int which = (pf >> 1) % 3;  // 0 v, 1 k, 2 q
    Tensor& t = which == 0 ? c.v : which == 1 ? c.k : c.q;
    if (t.numel() > 0) {
      static const double kPoison[] = {kNaN, kInf, -kInf, 1e30, -1e30, 3e38, 1e300};
      double pv = kPoison[(pf >> 3) % 7];
      const int64_t flat = f.ConsumeIntegral<uint32_t>() % t.numel();
      const int64_t off = t.offset_of_flat(flat);
      const double old = t.get_off(off);
      if (std::getenv("SDPA_FUZZ_POISON_NOOP")) pv = old;  // triage: is a difference caused by the poison at all?
      Outs base = make_outs(c, true, true, false);
      run_forward(c, c.inputs(), base, c.opt);
      const sdpa::KernelPath base_path = sdpa::last_kernel_path();
      t.set_off(off, pv);
      g_case = describe(c) + "poisoned " + (which == 0 ? "v" : which == 1 ? "k" : "q") + " flat index " + std::to_string(flat) + " = " + num(pv) + "\n";
      Outs pois = make_outs(c, true, true, false);
      run_forward(c, c.inputs(), pois, c.opt);
      std::vector<uint8_t> hit;
      const int64_t heads = which == 2 ? d.Hq : d.Hkv, rows = which == 2 ? d.Nq : d.Nk, cols = which == 0 ? d.Dv : d.Dk;
      poison_offsets(t, d, off, heads, rows, cols, hit);
      const std::vector<uint8_t> keep = keep_mask(c);
      // The first difference in the results of the rows the poison must not reach ("" if none).
      const auto compare = [&](const Outs& base_o, const Outs& pois_o) -> std::string {
        for (int64_t b = 0; b < d.B; ++b)
          for (int64_t h = 0; h < d.Hq; ++h)
            for (int64_t i = 0; i < d.Nq; ++i) {
              const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
              bool safe = true;
              if (which == 2) {
                if (hit[static_cast<size_t>(row)]) for (int64_t j = 0; j < d.Nk && safe; ++j) safe = !allowed(c, b, h, i, j);
              } else {
                for (int64_t j = 0; j < d.Nk && safe; ++j) {
                  if (!hit[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)]) continue;
                  const bool dropped = which == 0 && !keep.empty() && !keep[static_cast<size_t>(row * d.Nk + j)];
                  safe = !allowed(c, b, h, i, j) || dropped;
                }
              }
              if (!safe) continue;
              const std::string at = "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i) + ", ";
              auto cmp = [&](const Tensor& x, const Tensor& y, const char* name, int64_t col) -> std::string {
                const double a = x.at4(b, h, i, col), bb = y.at4(b, h, i, col);
                if (same_value(a, bb)) return "";
                return std::string(name) + at + std::to_string(col) + "] changed from " + num(bb) + " to " + num(a) +
                       " when a value this row must not see (blocked" + (which == 0 ? " or dropped" : "") +
                       " key, or the q of a row with no allowed key) was poisoned";
              };
              // The column of a NaN/inf planted in v is recomputed by the reference's row code in
              // the same precision (finish_block): equal within the rounding of a sum of Nk terms
              // of |w·v| <= max|v|, not bit for bit. Every other column keeps its bits.
              const int64_t pcol = which == 0 && d.Dv > 0 ? flat % d.Dv : -1;
              for (int64_t e = 0; e < d.Dv; ++e) {
                if (e == pcol && !std::isfinite(c.v.flat(flat))) {  // as stored: 1e300 is inf in float32
                  const double a = pois_o.out.at4(b, h, i, e), bb = base_o.out.at4(b, h, i, e);
                  double vmax = 0;
                  for (int64_t n = 0; n < c.v.numel(); ++n) {
                    if (n != flat && std::isfinite(c.v.flat(n))) vmax = std::max(vmax, std::fabs(c.v.flat(n)));
                  }
                  const double eps = eps_of(c.compute());
                  // A 16-bit out: the two float32 values, within that rounding, may round to
                  // neighbouring 16-bit values: one unit in out's last place (|out| <= max|v| / (1 - p)).
                  const double ulp = is16(c.dtype) ? eps_of(c.dtype) * vmax / (1 - c.opt.dropout_p) : 0.0;
                  const double tol = 4 * static_cast<double>(d.Nk + 2) * eps * vmax + ulp;
                  if (!(same_value(a, bb) || std::fabs(a - bb) <= tol))
                    return "out" + at + std::to_string(e) + "] (the poisoned column) changed from " + num(bb) + " to " + num(a) +
                           ", more than tol " + num(tol);
                  continue;
                }
                if (std::string r = cmp(pois_o.out, base_o.out, "out", e); !r.empty()) return r;
              }
              for (int64_t j = 0; j < d.Nk; ++j)
                if (std::string r = cmp(*pois_o.weights, *base_o.weights, "weights", j); !r.empty()) return r;
              const double la = pois_o.lse->at4(0, b, h, i), lb = base_o.lse->at4(0, b, h, i);
              if (!same_value(la, lb)) return "lse[" + std::to_string(row) + "] changed from " + num(lb) + " to " + num(la) + " after poisoning";
            }
        return "";
      };
      const std::string why = compare(base, pois);
      const char* name = "poison_fwd";
      if (!why.empty() && c.all_bf16() && base_path != sdpa::KernelPath::kSimd) {
        // The bfloat16 dot-product path widens a whole tile of keys (block of queries) when one
        // value of it is outside [2^-40, 2^32): the poison may have switched the path of the
        // rows' other keys. The same pair of calls on kSimd tells that apart (FINDINGS.md F10).
        sdpa::set_max_kernel_path(sdpa::KernelPath::kSimd);
        t.set_off(off, old);
        Outs base2 = make_outs(c, true, true, false);
        run_forward(c, c.inputs(), base2, c.opt);
        t.set_off(off, pv);
        Outs pois2 = make_outs(c, true, true, false);
        run_forward(c, c.inputs(), pois2, c.opt);
        sdpa::set_max_kernel_path(c.path_cap);
        if (compare(base2, pois2).empty()) name = "poison_fwd_dot_path";
      }
      check(why.empty(), name, [&] {
        return why + (name != std::string("poison_fwd") ? " (on the bfloat16 dot-product path; the same calls capped at kSimd agree)" : "");
      });
      t.set_off(off, old);
      g_case = describe(c);
    }
  }

  if (!c.backward) return;

  // ---- Backward: from this forward's out and lse ----
  Tensor& lse = *o.lse;
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, decode_layout(f, true));
  {
    std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
    fill_values(dout, rng, 1.0, 0);
  }
  bool lse_pinf = false;
  for (int64_t n = 0; n < lse.numel(); ++n) lse_pinf |= lse.flat(n) == kInf;
  Grads g = make_grads(c, c.out_ls, true);
  if (lse_pinf) {  // (e)
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    const auto s3 = g.dsinks ? g.dsinks->snapshot() : std::vector<std::byte>{};
    bool threw = false;
    try {
      sdpa::attention_backward(c.inputs(), o.out.view(), lse.view(), dout.view(), g.gradients(), c.opt);
    } catch (const sdpa::Error&) {
      threw = true;
    }
    check(threw, "lse_inf_backward", [&] { return std::string("attention_backward with +inf in lse (the forward overflowed) did not throw"); });
    check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2) && (!g.dsinks || g.dsinks->same_bytes(s3)), "error_untouched",
          [] { return std::string("backward Error but a gradient changed"); });
    return;
  }
  run_backward(c, c.inputs(), o.out, lse, dout, g, c.opt);
  const sdpa::KernelPath bwd_path = sdpa::last_kernel_path();
  check_kernel_path(c, bwd_path, "attention_backward");
  for (const auto& tn : {std::pair<const Tensor*, const char*>{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"},
                         {g.dsinks ? &*g.dsinks : nullptr, "dsinks"}}) {
    if (tn.first == nullptr) continue;
    const char* name = tn.second;
    const std::string r = tn.first->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  }
  {
    sdpa::set_num_threads(3 - c.threads);
    Grads g2 = make_grads(c, LayoutSpec::plain());
    run_backward(c, c.inputs(), o.out, lse, dout, g2, c.opt);
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(grads_bitwise(g, g2, why), "repeatable", [&] { return "two identical backward calls (threads 1 and 2) differ: " + why; });
  }
  if (c.blocks) {  // block_equiv: the gradients of the equivalent element mask, bit for bit (NaN = NaN)
    const Tensor em = expanded_mask(c);
    sdpa::Inputs in = c.inputs();
    in.mask = em.view();
    sdpa::Options eo = c.opt;
    eo.block_mask.reset();
    Grads ge = make_grads(c, LayoutSpec::plain());
    run_backward(c, in, o.out, lse, dout, ge, eo);
    const GradVals a = gvals(g), b = gvals(ge);
    std::string why;
    for (int n = 0; n < 4 && why.empty(); ++n)
      for (size_t x = 0; x < a.g[n].size(); ++x)
        if (!(same_bits(a.g[n][x], b.g[n][x]) || (std::isnan(a.g[n][x]) && std::isnan(b.g[n][x])))) {
          why = std::string(kGradNames[n]) + "[" + std::to_string(x) + "]: " + num(a.g[n][x]) + " vs " + num(b.g[n][x]);
          break;
        }
    check(why.empty(), "block_equiv", [&] {
      return "attention_backward with the block mask differs from the same call with the equivalent element mask: " + why;
    });
  }
  if (!c.seqlens.empty()) {  // as seqlens_unread in the forward
    Grads g3 = make_grads(c, LayoutSpec::plain());
    bool ran = false;
    {
      PastKeysGarbage garbage(c, 0xb4c4ba9eull + g_sk_seed);
      if (garbage.count() > 0) {
        run_backward(c, c.inputs(), o.out, lse, dout, g3, c.opt);
        ran = true;
      }
    }
    std::string why;
    if (ran) check(grads_bitwise(g, g3, why), "seqlens_unread", [&] { return "attention_backward with garbage in k, v past seqlens_k differs: " + why; });
  }
  // (e): rows with no allowed key: dq = 0; keys no row allows: dk = dv = 0.
  {
    std::vector<uint8_t> key_used(static_cast<size_t>(d.B * d.Hkv * d.Nk), 0);
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t i = 0; i < d.Nq; ++i) {
          bool any = false;
          for (int64_t j = 0; j < d.Nk; ++j)
            if (allowed(c, b, h, i, j)) { any = true; key_used[static_cast<size_t>((b * d.Hkv + h / d.group()) * d.Nk + j)] = 1; }
          if (any) continue;
          for (int64_t x = 0; x < d.Dk; ++x) {
            const double v = g.dq.at4(b, h, i, x);
            check(v == 0, "masked_grad", [&] { return "dq[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i) + ", " + std::to_string(x) + "] = " + num(v) + " but the row has no allowed key"; });
          }
        }
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t kvh = 0; kvh < d.Hkv; ++kvh)
        for (int64_t j = 0; j < d.Nk; ++j) {
          if (key_used[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)]) continue;
          for (int64_t x = 0; x < d.Dk; ++x) {
            const double v = g.dk.at4(b, kvh, j, x);
            check(v == 0, "masked_grad", [&] { return "dk[b=" + std::to_string(b) + ", kvh=" + std::to_string(kvh) + ", j=" + std::to_string(j) + ", " + std::to_string(x) + "] = " + num(v) + " but no row allows that key"; });
          }
          for (int64_t x = 0; x < d.Dv; ++x) {
            const double v = g.dv.at4(b, kvh, j, x);
            check(v == 0, "masked_grad", [&] { return "dv[b=" + std::to_string(b) + ", kvh=" + std::to_string(kvh) + ", j=" + std::to_string(j) + ", " + std::to_string(x) + "] = " + num(v) + " but no row allows that key"; });
          }
        }
  }
  bool finite_inputs = true;
  for (const Tensor* t : {&o.out, &lse}) for (int64_t n = 0; n < t->numel(); ++n) finite_inputs &= std::isfinite(t->flat(n)) || t->flat(n) == -kInf;
  if (c.tame && finite_inputs) check_bwd_tolerance(c, o.out, lse, dout, g);

  // Poison for the backward: v, k, q or dout; compare what it must not reach.
  const uint8_t bf = f.ConsumeIntegral<uint8_t>();
  if (bf & 1) {
    const int which = (bf >> 1) % 4;  // 0 v, 1 k, 2 q, 3 dout
    Tensor& t = which == 0 ? c.v : which == 1 ? c.k : which == 2 ? c.q : dout;
    if (t.numel() > 0) {
      static const double kPoison[] = {kNaN, kInf, -kInf, 1e30};
      const double pv = kPoison[(bf >> 3) % 4];
      const int64_t flat = f.ConsumeIntegral<uint32_t>() % t.numel();
      const int64_t off = t.offset_of_flat(flat);
      const double old = t.get_off(off);
      t.set_off(off, pv);
      g_case = describe(c) + "backward: poisoned " + (which == 0 ? "v" : which == 1 ? "k" : which == 2 ? "q" : "dout") + " flat index " + std::to_string(flat) + " = " + num(pv) + "\n";
      Grads gp = make_grads(c, LayoutSpec::plain());
      run_backward(c, c.inputs(), o.out, lse, dout, gp, c.opt);
      std::vector<uint8_t> hit;
      const bool by_row = which >= 2;
      const int64_t heads = by_row ? d.Hq : d.Hkv, rows = by_row ? d.Nq : d.Nk, cols = which == 0 || which == 3 ? d.Dv : d.Dk;
      poison_offsets(t, d, off, heads, rows, cols, hit);
      const std::vector<uint8_t> keep = keep_mask(c);
      std::vector<uint8_t> row_hit(static_cast<size_t>(d.B * d.Hq * d.Nq), 0), key_hit(static_cast<size_t>(d.B * d.Hkv * d.Nk), 0);
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.Hq; ++h)
          for (int64_t i = 0; i < d.Nq; ++i) {
            const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
            for (int64_t j = 0; j < d.Nk; ++j) {
              const int64_t key = (b * d.Hkv + kvh) * d.Nk + j;
              if (!allowed(c, b, h, i, j)) continue;
              const bool kept = keep.empty() || keep[static_cast<size_t>(row * d.Nk + j)];
              const bool poisoned = by_row ? hit[static_cast<size_t>(row)] != 0 : hit[static_cast<size_t>(key)] != 0;
              if (!poisoned) continue;
              if (which == 0 && !kept) continue;  // a dropped key's v reaches nothing
              row_hit[static_cast<size_t>(row)] = 1;
              key_hit[static_cast<size_t>(key)] = 1;
            }
            // A poisoned k or q changes that row's softmax, as kReference and kNaive recompute it
            // (the fused kernel reads it from lse): every key the row allows may change.
            if (row_hit[static_cast<size_t>(row)] && (which == 1 || which == 2))
              for (int64_t j = 0; j < d.Nk; ++j)
                if (allowed(c, b, h, i, j)) key_hit[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)] = 1;
          }
      std::vector<uint8_t> dk_aff = key_hit, dv_aff = key_hit;
      if (which == 0) std::fill(dv_aff.begin(), dv_aff.end(), 0);  // dv_j does not read v
      // dsinks_h: the heads of rows whose dout was poisoned; with kReference and kNaive, which
      // recompute each row's lse from q and k (src/reference_backward.cc), also the heads of the
      // rows a poisoned q or k reaches (row_hit).
      std::vector<uint8_t> ds_aff(static_cast<size_t>(d.Hq), 0);
      const bool recomputes = c.opt.backend == Backend::kReference || c.opt.backend == Backend::kNaive;
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.Hq; ++h)
          for (int64_t i = 0; i < d.Nq; ++i) {
            const size_t row = static_cast<size_t>((b * d.Hq + h) * d.Nq + i);
            if ((which == 3 && hit[row]) || ((which == 1 || which == 2) && recomputes && row_hit[row])) ds_aff[static_cast<size_t>(h)] = 1;
          }
      // The first difference between the gradients the poison must not reach ("" if none).
      const auto compare = [&](const Grads& base_g, const Grads& pois_g) -> std::string {
        const GradVals a = gvals(pois_g), base = gvals(base_g);
        auto cmp_all = [&](int n, int64_t rowsn, int64_t colsn, const std::vector<uint8_t>& affected) -> std::string {
          for (int64_t r = 0; r < rowsn; ++r) {
            if (affected[static_cast<size_t>(r)]) continue;
            for (int64_t x = 0; x < colsn; ++x) {
              const size_t at = static_cast<size_t>(r * colsn + x);
              if (!same_value(a.g[n][at], base.g[n][at]))
                return std::string(kGradNames[n]) + " row " + std::to_string(r) + " col " + std::to_string(x) + " changed from " + num(base.g[n][at]) + " to " +
                       num(a.g[n][at]) + " after poisoning a value it must not see (a blocked/dropped key, or a row with no allowed key)";
            }
          }
          return "";
        };
        std::string r = cmp_all(0, d.B * d.Hq * d.Nq, d.Dk, row_hit);
        if (r.empty()) r = cmp_all(1, d.B * d.Hkv * d.Nk, d.Dk, dk_aff);
        if (r.empty()) r = cmp_all(2, d.B * d.Hkv * d.Nk, d.Dv, dv_aff);
        // dsinks_h reads only sink_h, lse, out and dout (the header's formula): a poisoned q, k or
        // v changes none of it (kFlash), a poisoned dout only the head of its rows.
        if (r.empty() && !a.g[3].empty()) r = cmp_all(3, d.Hq, 1, ds_aff);
        return r;
      };
      const std::string why = compare(g, gp);
      const char* name = "poison_bwd";
      if (!why.empty() && c.all_bf16() && bwd_path != sdpa::KernelPath::kSimd) {
        // As poison_fwd_dot_path: the same pair of backward calls (same out, lse) on kSimd.
        sdpa::set_max_kernel_path(sdpa::KernelPath::kSimd);
        t.set_off(off, old);
        Grads g2 = make_grads(c, LayoutSpec::plain());
        run_backward(c, c.inputs(), o.out, lse, dout, g2, c.opt);
        t.set_off(off, pv);
        Grads gp2 = make_grads(c, LayoutSpec::plain());
        run_backward(c, c.inputs(), o.out, lse, dout, gp2, c.opt);
        sdpa::set_max_kernel_path(c.path_cap);
        if (compare(g2, gp2).empty()) name = "poison_bwd_dot_path";
      }
      check(why.empty(), name, [&] {
        return why + (name != std::string("poison_bwd") ? " (on the bfloat16 dot-product path; the same calls capped at kSimd agree)" : "");
      });
      t.set_off(off, old);
      g_case = describe(c);
    }
  }
}

// ---- attention_varlen / attention_varlen_backward (ext bit 5) ----

// Rows [r0, r1) of a packed (total, H, D) tensor as a contiguous (H, n, D) copy, or, for `at` > 0,
// as batch entry `at` of a contiguous (at + 1, H, n, D) tensor whose earlier entries are 0 (a
// dense call in which the sequence draws dropout as batch entry `at`, as the header promises).
Tensor dense_rows(const Tensor& t, int64_t r0, int64_t r1, int64_t at) {
  const int64_t H = t.shape()[1], D = t.shape()[2], n = r1 - r0;
  const std::vector<int64_t> shape = at == 0 ? std::vector<int64_t>{H, n, D} : std::vector<int64_t>{at + 1, H, n, D};
  Tensor r(t.dtype(), shape, Role::kUnitLast, true, LayoutSpec::plain());
  const int64_t base = at * H * n * D;
  for (int64_t x = 0; x < base; ++x) r.set_flat(x, 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < D; ++e) r.set_flat(base + (h * n + i) * D + e, t.flat(((r0 + i) * H + h) * D + e));
  return r;
}

// Packed rows [r0, r1) of `packed` (total, H, D) against the dense (.., H, n, D) tensor (batch entry
// `at`): "" when bitwise equal (NaN matches NaN).
std::string rows_bitwise(const char* name, const Tensor& packed, int64_t r0, const Tensor& dense, int64_t at) {
  const int64_t H = packed.shape()[1], D = packed.shape()[2];
  const int64_t n = dense.shape()[dense.rank() - 2], base = at * H * n * D;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < D; ++e) {
        const double a = packed.flat(((r0 + i) * H + h) * D + e), b = dense.flat(base + (h * n + i) * D + e);
        if (!(same_bits(a, b) || (std::isnan(a) && std::isnan(b))))
          return std::string(name) + " packed row " + std::to_string(r0 + i) + " head " + std::to_string(h) + " col " + std::to_string(e) +
                 " = " + num(a) + " but the dense call on the sequence's rows gives " + num(b);
      }
  return "";
}

// The options of a varlen, paged or KVCache call, from a shorter menu than decode()'s (no mask):
// causal, window, backend, scale, dropout. Returns the options byte: its bits 5-7 are the caller's.
uint8_t decode_short_options(FuzzedDataProvider& f, sdpa::Options& o) {
  static const int64_t kWin[] = {-1, -1, 0, 1, 3, 16, 100, INT64_MAX, int64_t{1} << 62};
  const uint8_t of = f.ConsumeIntegral<uint8_t>();
  o.causal = static_cast<Causal>(of % 3);
  if (of & 4) o.window = {pick(f, kWin), pick(f, kWin)};
  const uint8_t be = f.ConsumeIntegral<uint8_t>();
  o.backend = be < 140 ? Backend::kFlash : be < 180 ? Backend::kAuto : be < 220 ? Backend::kReference : Backend::kNaive;
  if (of & 8) {
    static const double kScales[] = {1, 0.5, 0.125, -1, 0, 1e-3, 2, 8, 30, 1e30};
    o.scale = kScales[f.ConsumeIntegralInRange<int>(0, 9)];
  }
  if (of & 16) {
    static const double kP[] = {0.1, 0.5, 0.9, 0.25};
    o.dropout_p = kP[f.ConsumeIntegralInRange<int>(0, 3)];
    o.seed = f.ConsumeIntegral<uint64_t>();
  }
  return of;
}

// Not-tame inputs of run_varlen, run_paged and run_kvcache: 1 to 6 special values (special(), per
// dtype) planted at elements the input picks of three tensors (which % 3 picks the tensor).
void plant_specials(FuzzedDataProvider& f, const std::array<Tensor*, 3>& ts) {
  const int n = f.ConsumeIntegralInRange<int>(1, 6);
  for (int s = 0; s < n; ++s) {
    const uint8_t which = f.ConsumeIntegral<uint8_t>();
    const uint32_t where = f.ConsumeIntegral<uint32_t>();
    Tensor& t = *ts[which % 3];
    if (t.numel() > 0) t.set_flat(where % t.numel(), special(f.ConsumeIntegral<uint8_t>(), t.dtype()));
  }
}

enum class VarBad : uint8_t {
  kNone, kFirstNonzero, kDecreasing, kLastShort, kLastLong, kCuDtype, kCuRank, kCountMismatch, kCuEmpty, kCuNull,
  kNegative, kOutShape, kLseShape, kKDtype, kQRank,
  // backward only
  kDqRows, kDoutShape, kDvDtype, kCount
};
const char* const kVarBadNames[] = {"none", "cu_seqlens_q[0] != 0", "cu_seqlens_k decreasing", "cu_seqlens_q last < total_q",
                                    "cu_seqlens_k last > total_k", "cu_seqlens dtype", "cu_seqlens rank 2", "B + 1 differs between q and k",
                                    "cu_seqlens_q shape (0,)", "cu_seqlens_k null", "cu_seqlens_q negative entry", "out shape", "lse shape",
                                    "k dtype", "q rank 2", "dq rows (backward)", "dout shape (backward)", "dv dtype (backward)"};
static_assert(sizeof(kVarBadNames) / sizeof(kVarBadNames[0]) == static_cast<size_t>(VarBad::kCount));

// ---- Block masks on packed sequences (kExtBlocks, BadBlocks::kVarlen) ----

// Rows [r0, r1) of a packed (total, H, D) tensor as a (H, n, D) view of its buffer (no copy; as
// the header cuts a sequence), or for `batch` > 0 a (batch, H, n, D) view of batch stride 0 (every
// entry those rows: a dense call in which the sequence can stand at batch entry batch - 1). A view
// without elements keeps the tensor's pointer (its data may be null).
sdpa::TensorView packed_rows_view(const Tensor& t, int64_t r0, int64_t r1, int64_t batch = 0) {
  const sdpa::TensorView p = t.view();
  sdpa::TensorView v = p;
  v.rank = 3;
  v.shape[0] = p.shape[1];
  v.shape[1] = r1 - r0;
  v.shape[2] = p.shape[2];
  v.strides[0] = p.strides[1];
  v.strides[1] = p.strides[0];
  v.strides[2] = p.strides[2];
  if (v.shape[0] > 0 && v.shape[1] > 0 && v.shape[2] > 0) v.data = static_cast<std::byte*>(p.data) + r0 * p.strides[0] * esize(t.dtype());
  if (batch > 0) {
    for (int d = 3; d > 0; --d) v.shape[d] = v.shape[d - 1], v.strides[d] = v.strides[d - 1];
    v.rank = 4;
    v.shape[0] = batch;
    v.strides[0] = 0;
  }
  return v;
}

int64_t view_numel(const sdpa::TensorView& t) {
  int64_t n = 1;
  for (int d = 0; d < t.rank; ++d) n *= t.shape[d];
  return n;
}

// Sequence b's block mask as the header reads it (Options::block_mask, packed sequences): of a
// rank-4 (S or 1, Hq or 1, QB, KB) mask its row b (its first dim dropped), of any mask the top-left
// (qb, kb) blocks, same strides: a view of the caller's mask.
sdpa::TensorView corner_view(const sdpa::TensorView& m, int64_t b, int64_t qb, int64_t kb) {
  sdpa::TensorView t = m;
  if (t.rank == 4) {
    if (t.shape[0] != 1 && t.data != nullptr && view_numel(t) > 0) t.data = static_cast<std::byte*>(t.data) + b * t.strides[0];
    for (int d = 1; d < 4; ++d) t.shape[d - 1] = t.shape[d], t.strides[d - 1] = t.strides[d];
    t.rank = 3;
  }
  t.shape[t.rank - 2] = qb;
  t.shape[t.rank - 1] = kb;
  return t;
}

// The same corner as a copy in its own layout (any but a stride-0 dim, which would alias its
// elements), read element by element (Tensor::at4: the mask's dims right-aligned to (b, h, qb, kb),
// extent-1 dims broadcast).
Tensor corner_copy(const Tensor& m, int64_t b, int64_t qb, int64_t kb, LayoutSpec ls) {
  ls.zero = 0;
  std::vector<int64_t> shape = m.shape();
  if (shape.size() == 4) shape.erase(shape.begin());
  shape[shape.size() - 2] = qb;
  shape[shape.size() - 1] = kb;
  Tensor t(DType::kBool, shape, Role::kAny, true, ls);
  for (int64_t n = 0; n < t.numel(); ++n) {
    const int64_t j = n % kb, i = (n / kb) % qb, h = n / (kb * qb);
    t.set_flat(n, m.at4(b, h, i, j) != 0 ? 1.0 : 0.0);
  }
  return t;
}

// `m` (.., QB, KB) widened to (.., QB, kb) columns (kb >= KB): the new columns random (a layout
// without stride-0 dims, so that the first KB columns are m's).
Tensor widened_mask(const Tensor& m, int64_t kb, std::mt19937_64& rng, LayoutSpec ls) {
  ls.zero = 0;
  std::vector<int64_t> shape = m.shape();
  const int64_t KB = shape.back();
  shape.back() = kb;
  Tensor t(DType::kBool, shape, Role::kAny, true, ls);
  for (int64_t n = 0; n < t.numel(); ++n) {
    const int64_t j = n % kb, row = n / kb;
    t.set_flat(n, j < KB ? (m.flat(row * KB + j) != 0 ? 1.0 : 0.0) : static_cast<double>(rng() % 2));
  }
  return t;
}

// What makes a packed call's block mask invalid (vb bits 2-4, BadBlocks::kVarlen inputs).
enum class PackedBad : uint8_t { kQB, kKB, kLead, kDtype, kRank, kTotals, kNull, kOther, kCount };
const char* const kPackedBadNames[] = {"QB ± 1", "KB ± 1", "a leading dim neither 1 nor S / Hq", "dtype not bool",
                                       "rank 0 or 1", "QB, KB of the packed totals (ceil(total / block))", "null data",
                                       "the other call's KB (varlen: max Nk_b; paged: max_pages · page_size)"};
static_assert(sizeof(kPackedBadNames) / sizeof(kPackedBadNames[0]) == static_cast<size_t>(PackedBad::kCount));

// An invalid block mask for a packed call whose valid mask is `good` ((.., QB, KB); S sequences,
// Hq heads); `tot` the (QB, KB) of the packed totals, `other` the other call's valid mask. A kind
// that would not break this call (the totals' or the other call's shape equal to this one's, an
// empty mask for null data) is QB ± 1 instead. `made` holds the tensor behind the view.
sdpa::TensorView broken_packed_mask(PackedBad kind, const Tensor& good, const Tensor& other, int64_t S, int64_t Hq,
                                    const std::array<int64_t, 2>& tot, std::mt19937_64& rng, std::optional<Tensor>& made,
                                    std::string& how) {
  std::vector<int64_t> shape = good.shape();
  const size_t r = shape.size();
  const auto bool_tensor = [&](std::vector<int64_t> sh) -> sdpa::TensorView {
    made.emplace(DType::kBool, std::move(sh), Role::kAny, true, block_layout(rng));
    for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, rng() % 2 ? 1.0 : 0.0);
    return made->view();
  };
  if (kind == PackedBad::kTotals && shape[r - 2] == tot[0] && shape[r - 1] == tot[1]) kind = PackedBad::kQB;
  if (kind == PackedBad::kOther && other.shape() == shape) kind = PackedBad::kQB;
  if (kind == PackedBad::kNull && good.numel() == 0) kind = PackedBad::kQB;
  how = kPackedBadNames[static_cast<int>(kind)];
  switch (kind) {
    case PackedBad::kQB:
    case PackedBad::kKB: {
      int64_t& n = shape[r - (kind == PackedBad::kQB ? 2 : 1)];
      n = n > 0 && rng() % 2 ? n - 1 : n + 1;
      return bool_tensor(shape);
    }
    case PackedBad::kLead: {
      // (S, Hq)'s dim + 1 (+ 2 where that is 1); a rank-2 mask gets a leading dim S (per
      // sequence, as rank 3: read as heads), or Hq + 1 where S is 1 or Hq.
      const auto wrong = [](int64_t full) { return full + 1 == 1 ? int64_t{2} : full + 1; };
      if (r == 4) {
        const size_t x = rng() % 2;
        shape[x] = wrong(x == 0 ? S : Hq);
      } else if (r == 3) {
        shape[0] = wrong(Hq);
      } else {
        shape.insert(shape.begin(), S != 1 && S != Hq ? S : wrong(Hq));
      }
      return bool_tensor(shape);
    }
    case PackedBad::kDtype: {
      made.emplace(DType::kFloat64, shape, Role::kAny, true, LayoutSpec::plain());  // room for any dtype's view
      for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, 1.0);
      sdpa::TensorView v = made->view();
      static const DType kBad[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64};
      v.dtype = kBad[rng() % 6];
      return v;
    }
    case PackedBad::kRank: {  // rank 0 or 1 (a TensorView holds at most rank 4, which is valid)
      if (rng() % 2) return bool_tensor({shape.back()});
      sdpa::TensorView v = bool_tensor({1});
      v.rank = 0;
      return v;
    }
    case PackedBad::kTotals:
      shape[r - 2] = tot[0];
      shape[r - 1] = tot[1];
      return bool_tensor(shape);
    case PackedBad::kNull: {
      sdpa::TensorView v = good.view();
      v.data = nullptr;
      return v;
    }
    default:
      return other.view();
  }
}

// BadBlocks::kVarlen (kExtBlocks, bm_seed 0xe7 / 0xef / 0xf7 / 0xff): the attention_varlen call
// run_varlen decoded (c, in: S = nq.size() sequences) with Options::block_mask, and the same
// sequences as a packed attention_paged call (cu_seqlens_q; a pool of one-row pages over the
// packed k, v, page r = packed key row r; an int32 table (S, max Nk_b + extra) whose row b lists
// sequence b's rows, -1 after them; seqlens_k = Nk_b). Two more bytes from the input: `vb` and a
// 32-bit seed (with bm, bm_seed: the mask's PRNG). bm bits 0-5 pick block_q / block_k, the density
// and the leading dims as for a dense call (make_block_mask, with Nq = max_b Nq_b, Nk = max_b Nk_b,
// (B, Hq) = (S, Hq)); vb bits 0-1 == 3: an invalid mask (bits 2-4: PackedBad), else a valid one;
// bit 5: rank 3 instead of 4 for the leading-dim kinds that have a batch dim ((1, QB, KB), (Hq | 1,
// QB, KB)); bit 6: the single-sequence calls get a copy of the corner instead of a view; bit 7: the
// block table has 1-130 more columns than the longest sequence needs (never read), so the paged
// call's KB = ceil(max_pages · page_size / block_k) exceeds varlen's.
//   valid:   attention_varlen (and attention_varlen_backward with c.backward) and the packed
//            attention_paged must not throw: unexpected_error, guards, unwritten, kernel_path,
//            repeatable (threads 1 and 2), lse_inf_backward; and
//            varlen_blocks_equiv  sequence b's out, lse (dq, dk, dv) bit for bit (NaN = NaN) those
//                                 of attention() (attention_backward()) on views of its rows of the
//                                 packed q, k, v (dout, and the single call's out and lse) with the
//                                 corner (ceil(Nq_b / block_q), ceil(Nk_b / block_k)) of its row of
//                                 the mask and the same options; with dropout the forward as batch
//                                 entry b of a (b + 1, ..) call whose batch has stride 0 (the draws
//                                 the header promises), the backward for b = 0 only (varlen_dense's
//                                 rule)
//            paged_blocks_equiv   sequence b's out, lse bit for bit those of an unpacked
//                                 attention_paged call with q = its rows as (1, Hq, Nq_b, Dk) (a view),
//                                 table row b, seqlens_k {Nk_b} and the corner (ceil(Nq_b / block_q),
//                                 ceil(max_pages · page_size / block_k)) (the header's "each
//                                 sequence is bit for bit the call with q = its rows"); with
//                                 dropout batch entry b of a (b + 1, ..) call over table rows 0..b
//                                 (q's batch stride 0)
//   invalid: (PackedBad: QB or KB ± 1, a leading dim neither 1 nor S / Hq, dtype, rank 0 or 1, the
//            totals' blocks, null data, the other call's KB) attention_varlen,
//            attention_varlen_backward (given a valid forward's out and lse) and the packed
//            attention_paged each throw an sdpa::Error that writes nothing (error_expected,
//            error_untouched) and names block_mask, and for a shape that does not broadcast "the
//            longest sequence's" lengths (error_names). With no sequence QB = KB = 0 for varlen,
//            KB = ceil(max_pages / block_k) for paged (F19: that call validates the mask too).
void run_varlen_blocks(FuzzedDataProvider& f, Case& c, const sdpa::VarlenInputs& in, const std::vector<int64_t>& nq,
                       const std::vector<int64_t>& nk, const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k,
                       const IndexTensor& cuq, const Tensor& dout, const std::string& described) {
  const Dims& d = c.d;
  const sdpa::Options& o = c.opt;
  const DType ct = c.compute();
  const int64_t S = static_cast<int64_t>(nq.size());
  const uint8_t vb = f.ConsumeIntegral<uint8_t>();
  const uint32_t vb_seed = f.ConsumeIntegral<uint32_t>();
  std::mt19937_64 br(0xb10c7a51ull * (g_bm_seed + 1u) + g_bm + (uint64_t{vb_seed} << 16));
  int64_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b < S; ++b) {
    max_q = std::max(max_q, nq[static_cast<size_t>(b)]);
    max_k = std::max(max_k, nk[static_cast<size_t>(b)]);
  }
  const int64_t extra = vb & 128 ? 1 + static_cast<int64_t>(br() % 130) : 0;
  const int64_t maxp = max_k + extra;  // the block table's columns (pages of one row)
  // The varlen mask (at most 2^20 elements: sizes double until it fits).
  const std::shared_ptr<BlockMask> bl =
      make_block_mask(br, g_bm & 3, (g_bm >> 2) & 3, (g_bm >> 4) & 3, vb & 32 ? 3 : 4, S, d.Hq, max_q, max_k, int64_t{1} << 20);
  const int64_t bq = bl->bq, bk = bl->bk;
  const int64_t QB = ceil_div(max_q, bq), KB = ceil_div(max_k, bk), KBp = ceil_div(maxp, bk);
  // The paged call's mask: the same blocks, widened to its KB (columns of keys no sequence has).
  std::optional<Tensor> pm_own;
  if (KBp != KB) pm_own.emplace(widened_mask(bl->mask, KBp, br, block_layout(br)));
  const Tensor& pm = pm_own ? *pm_own : bl->mask;
  const bool invalid = (vb & 3) == 3;
  const bool copy_corner = vb & 64;
  sdpa::Options bo = o, po = o;
  bo.block_mask = bl->mask.view();
  po.block_mask = pm.view();
  bo.block_q = po.block_q = bq;
  bo.block_k = po.block_k = bk;

  std::string desc = described + "with a block mask on the packed sequences (" + bl->how + "; " +
                     (invalid ? "invalid" : "valid") + (copy_corner ? ", corners copied" : ", corners as views") +
                     "): block_q=" + std::to_string(bq) + " block_k=" + std::to_string(bk) + ", QB = ceil(" + std::to_string(max_q) +
                     " / block_q) = " + std::to_string(QB) + ", KB = ceil(" + std::to_string(max_k) + " / block_k) = " +
                     std::to_string(KB) + "; " + bl->mask.describe("block_mask") + "\n";
  desc += "packed attention_paged: table (" + std::to_string(S) + ", " + std::to_string(maxp) + ") (" + std::to_string(extra) +
          " columns past the longest sequence), pages of 1 row, KB = " + std::to_string(KBp) +
          (pm_own ? "; " + pm_own->describe("its block_mask (widened)") : std::string("; the same block_mask")) + "\n";
  g_case = desc;
  if (g_print) std::fprintf(stderr, "attention_fuzz: varlen case with a block mask (vb 0x%02x, seed 0x%08x; %zu input bytes left after them)\n%s", vb, vb_seed, f.remaining_bytes(), g_case.c_str());

  sdpa::set_num_threads(c.threads);
  const auto make_vouts = [&](bool fancy) {
    Outs r;
    r.out.init(c.dtype, {d.Nq, d.Hq, d.Dv}, Role::kUnitLast, false, fancy ? c.out_ls : LayoutSpec::plain());
    if (c.want_lse) r.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, fancy ? c.l_ls : LayoutSpec::plain());
    return r;
  };
  const auto vouts = [](const Outs& r) {
    sdpa::VarlenOutputs v;
    v.out = r.out.view();
    if (r.lse) v.lse = r.lse->view();
    return v;
  };
  const auto pouts = [](const Outs& r) {
    sdpa::Outputs v;
    v.out = r.out.view();
    if (r.lse) v.lse = r.lse->view();
    return v;
  };
  const auto make_vgrads = [&](const LayoutSpec& ls) {
    return Grads{Tensor(c.dtype, {d.Nq, d.Hq, d.Dk}, Role::kUnitLast, false, ls), Tensor(c.kv, {d.Nk, d.Hkv, d.Dk}, Role::kUnitLast, false, ls),
                 Tensor(c.kv, {d.Nk, d.Hkv, d.Dv}, Role::kUnitLast, false, ls), std::nullopt};
  };
  const auto attempt = [&](const char* call, const std::function<void()>& fn, std::string& what) {
    try {
      fn();
    } catch (const sdpa::Error& e) {
      what = e.what();
      return true;
    } catch (const std::exception& e) {
      check(false, "other_exception", [&] { return std::string(call) + " threw a non-sdpa::Error exception: " + e.what(); });
    }
    return false;
  };
  // lse (Hq, total_q) columns [q0, q0 + n) against a dense (.., Hq, n) lse's batch entry `at`.
  const auto lse_bitwise = [&](const Tensor& packed, int64_t q0, const Tensor& dense, int64_t n, int64_t at) -> std::string {
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const double a = packed.flat(h * d.Nq + q0 + i), w = dense.flat((at * d.Hq + h) * n + i);
        if (!(same_bits(a, w) || (std::isnan(a) && std::isnan(w))))
          return "lse[" + std::to_string(h) + ", " + std::to_string(q0 + i) + "] = " + num(a) + " but the single call gives " + num(w);
      }
    return "";
  };

  // The packed attention_paged call's inputs.
  std::vector<int32_t> table(static_cast<size_t>(std::max<int64_t>(1, S * maxp)), -1);
  for (int64_t b = 0; b < S; ++b)
    for (int64_t j = 0; j < nk[static_cast<size_t>(b)]; ++j)
      table[static_cast<size_t>(b * maxp + j)] = static_cast<int32_t>(cu_k[static_cast<size_t>(b)] + j);
  const auto pool = [](const Tensor& t) {
    sdpa::TensorView v = t.view(), r = v;
    r.rank = 4;
    r.shape[0] = v.shape[0]; r.shape[1] = 1; r.shape[2] = v.shape[1]; r.shape[3] = v.shape[2];
    r.strides[0] = v.strides[0]; r.strides[1] = v.strides[0]; r.strides[2] = v.strides[1]; r.strides[3] = v.strides[2];
    return r;
  };
  // Table rows [r0, r0 + rows) as a (rows, maxp) view.
  const auto table_view = [&](int64_t r0, int64_t rows) {
    sdpa::TensorView t;
    t.data = table.data() + r0 * maxp;
    t.dtype = DType::kInt32;
    t.rank = 2;
    t.shape[0] = rows;
    t.shape[1] = maxp;
    t.strides[0] = maxp;
    t.strides[1] = 1;
    return t;
  };
  const IndexTensor sl(DType::kInt64, nk, 1, 0);
  sdpa::PagedInputs pin;
  pin.q = c.q.view();
  pin.k_pages = pool(c.k);
  pin.v_pages = pool(c.v);
  pin.block_table = table_view(0, S);
  pin.seqlens_k = sl.view();
  pin.cu_seqlens_q = cuq.view();
  // Without the block mask the packed paged call must run, else this construction is not a valid
  // call here (nothing to check of it).
  bool paged_runs = false;
  {
    Outs p0 = make_vouts(false);
    std::string why_not;
    sdpa::Options no_mask = o;
    paged_runs = !attempt("attention_paged", [&] { sdpa::attention_paged(pin, pouts(p0), no_mask); }, why_not);
    if (g_print) std::fprintf(stderr, "attention_fuzz: packed attention_paged without the block mask %s%s\n", paged_runs ? "runs" : "throws: ", why_not.c_str());
  }

  if (invalid) {
    const PackedBad kind = static_cast<PackedBad>((vb >> 2) & 7);
    const std::array<int64_t, 2> tot_v{ceil_div(d.Nq, bq), ceil_div(d.Nk, bk)}, tot_p{ceil_div(d.Nq, bq), ceil_div(S * maxp, bk)};
    std::optional<Tensor> made_v, made_p;
    std::string how_v, how_p;
    bo.block_mask = broken_packed_mask(kind, bl->mask, pm, S, d.Hq, tot_v, br, made_v, how_v);
    po.block_mask = broken_packed_mask(kind, pm, bl->mask, S, d.Hq, tot_p, br, made_p, how_p);
    const auto given = [](const sdpa::TensorView& v, const std::optional<Tensor>& made, const char* name) {
      std::string s = made ? made->describe(name) + "\n" : std::string();
      std::ostringstream sh;
      for (int a = 0; a < v.rank; ++a) sh << (a ? ", " : "") << v.shape[a];
      return s + name + " given: rank " + std::to_string(v.rank) + " shape (" + sh.str() + "), dtype " + dtype_long(v.dtype) +
             (v.data ? "" : ", null data") + "\n";
    };
    g_case = desc + "invalid for attention_varlen: " + how_v + "\n" + given(*bo.block_mask, made_v, "varlen block_mask") +
             "invalid for attention_paged: " + how_p + "\n" + given(*po.block_mask, made_p, "paged block_mask");
    if (g_print) std::fprintf(stderr, "%s", g_case.c_str() + desc.size());
    const std::string what_bad = std::string(kBadBlocksNames[static_cast<int>(BadBlocks::kVarlen)]) + ": ";
    // A shape that does not broadcast: the Error names the longest sequence's lengths too.
    const auto names = [&](const std::string& what, const char* call, const std::string& how, bool shape_kind) {
      check_error_names(what, "block_mask", call, (what_bad + how).c_str());
      if (shape_kind) check_error_names(what, "the longest sequence's", call, (what_bad + how).c_str());
    };
    const auto shape_kind = [](const std::string& how) {
      return how == kPackedBadNames[0] || how == kPackedBadNames[1] || how == kPackedBadNames[2] || how == kPackedBadNames[5] ||
             how == kPackedBadNames[7];
    };
    std::string what;
    {
      Outs vo = make_vouts(true);
      const auto s0 = vo.out.snapshot();
      const auto s1 = vo.lse ? vo.lse->snapshot() : std::vector<std::byte>{};
      check(attempt("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(vo), bo); }, what), "error_expected",
            [&] { return "attention_varlen: no sdpa::Error for an invalid block mask: " + how_v; });
      check(vo.out.same_bytes(s0) && (!vo.lse || vo.lse->same_bytes(s1)), "error_untouched",
            [&] { return "attention_varlen: sdpa::Error(\"" + what + "\") for a block mask but an output buffer changed"; });
      names(what, "attention_varlen", how_v, shape_kind(how_v));
    }
    if (c.backward) {
      Outs valid = make_vouts(false);
      if (!valid.lse) valid.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, LayoutSpec::plain());
      expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(valid), o); });
      Grads g = make_vgrads(c.out_ls);
      const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
      check(attempt("attention_varlen_backward",
                    [&] { sdpa::attention_varlen_backward(in, valid.out.view(), valid.lse->view(), dout.view(), g.gradients(), bo); }, what),
            "error_expected", [&] { return "attention_varlen_backward: no sdpa::Error for an invalid block mask: " + how_v; });
      check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
            [&] { return "attention_varlen_backward: sdpa::Error(\"" + what + "\") for a block mask but a gradient buffer changed"; });
      names(what, "attention_varlen_backward", how_v, shape_kind(how_v));
    }
    if (!paged_runs) return;
    Outs pb = make_vouts(true);
    const auto s0 = pb.out.snapshot();
    const auto s1 = pb.lse ? pb.lse->snapshot() : std::vector<std::byte>{};
    check(attempt("attention_paged", [&] { sdpa::attention_paged(pin, pouts(pb), po); }, what), "error_expected",
          [&] { return "attention_paged with cu_seqlens_q: no sdpa::Error for an invalid block mask: " + how_p; });
    check(pb.out.same_bytes(s0) && (!pb.lse || pb.lse->same_bytes(s1)), "error_untouched",
          [&] { return "attention_paged with cu_seqlens_q: sdpa::Error(\"" + what + "\") for a block mask but an output buffer changed"; });
    names(what, "attention_paged with cu_seqlens_q", how_p, shape_kind(how_p));
    return;
  }

  // ---- A valid block mask ----
  // F21 (fixed): a pool of no pages (every sequence has 0 keys) with a table of max_pages > 0
  // columns: the mask counts max_pages · page_size keys all the same; paged_blocks_no_pages names
  // a failure there.
  const bool no_pages = d.Nk == 0 && maxp > 0 && S > 0;
  const auto paged_no_throw = [&](const char* call, const std::function<void()>& fn) {
    std::string what;
    if (!attempt(call, fn, what)) return;
    check(false, no_pages ? "paged_blocks_no_pages" : "unexpected_error",
          [&] { return std::string(call) + " threw sdpa::Error on a valid call: " + what; });
  };
  // Sequence b's corner of mask `m` (qbn x kbn blocks): a view, or a copy kept in `keep`.
  std::vector<Tensor> keep;
  const auto corner = [&](const Tensor& m, int64_t b, int64_t qbn, int64_t kbn) {
    if (!copy_corner) return corner_view(m.view(), b, qbn, kbn);
    keep.push_back(corner_copy(m, b, qbn, kbn, block_layout(br)));
    return keep.back().view();
  };
  Outs vo = make_vouts(true);
  expect_no_throw("attention_varlen (block mask)", [&] { sdpa::attention_varlen(in, vouts(vo), bo); });
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen");
  check_outs_written(vo);
  {
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_vouts(false);
    expect_no_throw("attention_varlen (block mask)", [&] { sdpa::attention_varlen(in, vouts(o2), bo); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(vo.bitwise_equal(o2, why), "repeatable", [&] { return "two identical attention_varlen calls (threads 1 and 2) with a block mask differ: " + why; });
  }
  // Each sequence: attention() on views of its rows with its corner.
  struct Seq { Tensor out, lse; int64_t at = 0; bool ran = false; sdpa::Options opt; };
  std::vector<Seq> seqs(static_cast<size_t>(S));
  for (int64_t b = 0; b < S; ++b) {
    Seq& s = seqs[static_cast<size_t>(b)];
    s.at = o.dropout_p > 0 ? b : 0;
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], k1 = cu_k[static_cast<size_t>(b) + 1];
    const int64_t n = q1 - q0;
    if (static_cast<long double>(s.at + 1) * n * (k1 - k0) * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1) > 4.0L * kWorkBudget) continue;
    const int64_t batch = s.at > 0 ? s.at + 1 : 0;
    sdpa::Inputs di;
    di.q = packed_rows_view(c.q, q0, q1, batch);
    di.k = packed_rows_view(c.k, k0, k1, batch);
    di.v = packed_rows_view(c.v, k0, k1, batch);
    std::vector<int64_t> os{d.Hq, n, d.Dv}, ls{d.Hq, n};
    if (batch > 0) os.insert(os.begin(), batch), ls.insert(ls.begin(), batch);
    s.out.init(c.dtype, os, Role::kUnitLast, false, LayoutSpec::plain());
    s.lse.init(ct, ls, Role::kAny, false, LayoutSpec::plain());
    s.opt = o;
    s.opt.block_mask = corner(bl->mask, b, ceil_div(n, bq), ceil_div(k1 - k0, bk));
    s.opt.block_q = bq;
    s.opt.block_k = bk;
    sdpa::Outputs so;
    so.out = s.out.view();
    so.lse = s.lse.view();
    expect_no_throw("attention (one sequence, its corner of the block mask)", [&] { sdpa::attention(di, so, s.opt); });
    s.ran = true;
    std::string r = rows_bitwise("out", vo.out, q0, s.out, s.at);
    if (r.empty() && vo.lse) r = lse_bitwise(*vo.lse, q0, s.lse, n, s.at);
    check(r.empty(), "varlen_blocks_equiv", [&] {
      return "sequence " + std::to_string(b) + " (corner (" + std::to_string(ceil_div(n, bq)) + ", " + std::to_string(ceil_div(k1 - k0, bk)) +
             ")): " + r;
    });
  }

  if (paged_runs) {
    Outs pb = make_vouts(true);
    paged_no_throw("attention_paged with cu_seqlens_q (block mask)", [&] { sdpa::attention_paged(pin, pouts(pb), po); });
    check_outs_written(pb);
    {
      sdpa::set_num_threads(3 - c.threads);
      Outs p2 = make_vouts(false);
      paged_no_throw("attention_paged with cu_seqlens_q (block mask)", [&] { sdpa::attention_paged(pin, pouts(p2), po); });
      sdpa::set_num_threads(c.threads);
      std::string why;
      check(pb.bitwise_equal(p2, why), "repeatable", [&] { return "two identical packed attention_paged calls (threads 1 and 2) with a block mask differ: " + why; });
    }
    for (int64_t b = 0; b < S; ++b) {
      const int64_t at = o.dropout_p > 0 ? b : 0;
      const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1], n = q1 - q0;
      if (static_cast<long double>(at + 1) * n * maxp * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1) > 4.0L * kWorkBudget) continue;
      // Table rows b (or 0..b with dropout: the sequence as batch entry b), their lengths.
      const int64_t r0 = at > 0 ? 0 : b;
      const IndexTensor sb(DType::kInt64, std::vector<int64_t>(nk.begin() + r0, nk.begin() + b + 1), 1, 0);
      sdpa::PagedInputs one = pin;
      one.cu_seqlens_q.reset();
      one.q = packed_rows_view(c.q, q0, q1, at + 1);
      one.block_table = table_view(r0, at + 1);
      one.seqlens_k = sb.view();
      Outs u;
      u.out.init(c.dtype, {at + 1, d.Hq, n, d.Dv}, Role::kUnitLast, false, LayoutSpec::plain());
      if (pb.lse) u.lse.emplace(ct, std::vector<int64_t>{at + 1, d.Hq, n}, Role::kAny, false, LayoutSpec::plain());
      sdpa::Options uo = po;
      uo.block_mask = corner(pm, b, ceil_div(n, bq), KBp);
      paged_no_throw("attention_paged (one sequence, its corner of the block mask)", [&] { sdpa::attention_paged(one, pouts(u), uo); });
      std::string r = rows_bitwise("out", pb.out, q0, u.out, at);
      if (r.empty() && pb.lse) r = lse_bitwise(*pb.lse, q0, *u.lse, n, at);
      check(r.empty(), "paged_blocks_equiv", [&] {
        return "packed attention_paged, sequence " + std::to_string(b) + " (corner (" + std::to_string(ceil_div(n, bq)) + ", " +
               std::to_string(KBp) + ")): " + r;
      });
    }
  }

  if (!c.backward) return;
  const Tensor& lse = *vo.lse;
  bool lse_pinf = false;
  for (int64_t n = 0; n < lse.numel(); ++n) lse_pinf |= lse.flat(n) == kInf;
  Grads g = make_vgrads(c.out_ls);
  const auto call_bwd = [&](const Grads& gg) { sdpa::attention_varlen_backward(in, vo.out.view(), lse.view(), dout.view(), gg.gradients(), bo); };
  if (lse_pinf) {
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    std::string what;
    check(attempt("attention_varlen_backward", [&] { call_bwd(g); }, what), "lse_inf_backward",
          [&] { return std::string("attention_varlen_backward (block mask) with +inf in lse did not throw"); });
    check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
          [] { return std::string("varlen backward (block mask) Error but a gradient changed"); });
    return;
  }
  expect_no_throw("attention_varlen_backward (block mask)", [&] { call_bwd(g); });
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen_backward");
  for (const auto& tn : {std::pair<const Tensor*, const char*>{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"}}) {
    const std::string r = tn.first->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(tn.second) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(tn.second) + ": " + r; });
  }
  {
    sdpa::set_num_threads(3 - c.threads);
    Grads g2 = make_vgrads(LayoutSpec::plain());
    expect_no_throw("attention_varlen_backward (block mask)", [&] { call_bwd(g2); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(grads_bitwise(g, g2, why), "repeatable", [&] { return "two identical attention_varlen_backward calls (threads 1 and 2) with a block mask differ: " + why; });
  }
  for (int64_t b = 0; b < S; ++b) {
    const Seq& s = seqs[static_cast<size_t>(b)];
    if (!s.ran || s.at > 0) continue;  // with dropout b = 0 only (varlen_dense's rule)
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], k1 = cu_k[static_cast<size_t>(b) + 1];
    Tensor dq(c.dtype, {d.Hq, q1 - q0, d.Dk}, Role::kUnitLast, false, LayoutSpec::plain()),
        dk(c.kv, {d.Hkv, k1 - k0, d.Dk}, Role::kUnitLast, false, LayoutSpec::plain()),
        dv(c.kv, {d.Hkv, k1 - k0, d.Dv}, Role::kUnitLast, false, LayoutSpec::plain());
    sdpa::Inputs di;
    di.q = packed_rows_view(c.q, q0, q1);
    di.k = packed_rows_view(c.k, k0, k1);
    di.v = packed_rows_view(c.v, k0, k1);
    expect_no_throw("attention_backward (one sequence, its corner of the block mask)", [&] {
      sdpa::attention_backward(di, s.out.view(), s.lse.view(), packed_rows_view(dout, q0, q1), {dq.view(), dk.view(), dv.view()}, s.opt);
    });
    std::string r = rows_bitwise("dq", g.dq, q0, dq, 0);
    if (r.empty()) r = rows_bitwise("dk", g.dk, k0, dk, 0);
    if (r.empty()) r = rows_bitwise("dv", g.dv, k0, dv, 0);
    check(r.empty(), "varlen_blocks_equiv", [&] { return "backward, sequence " + std::to_string(b) + ": " + r; });
  }
}

void run_varlen(FuzzedDataProvider& f) {
  Case c;  // c.q, c.k, c.v: the packed (total, H, D) tensors; c.d: B sequences, Nq / Nk the totals
  const bool fancy = decode_flags(f, c);
  c.rank = 3;
  const uint8_t inv = f.ConsumeIntegral<uint8_t>();
  VarBad bad = inv < 190 ? VarBad::kNone : static_cast<VarBad>(1 + inv % (static_cast<int>(VarBad::kCount) - 1));
  Dims& d = c.d;
  static const int64_t kHkv[] = {1, 1, 2, 3, 0};
  static const int64_t kGroup[] = {1, 1, 2, 4, 5};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64, 65, 128};
  static const int64_t kNqV[] = {0, 1, 1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 64, 65, 130};
  static const int64_t kNkV[] = {0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 64, 65, 130, 300, 2100};
  d.Hkv = pick(f, kHkv);
  d.Hq = d.Hkv * pick(f, kGroup);
  d.Dk = pick(f, kD);
  d.Dv = pick(f, kD);
  const int nseq = f.ConsumeIntegralInRange<int>(0, 5);
  d.B = nseq;
  std::vector<int64_t> nq(static_cast<size_t>(nseq)), nk(static_cast<size_t>(nseq));
  for (int b = 0; b < nseq; ++b) {
    nq[static_cast<size_t>(b)] = pick(f, kNqV);
    nk[static_cast<size_t>(b)] = pick(f, kNkV);
  }
  auto work = [&] {
    long double w = 0;
    for (int b = 0; b < nseq; ++b) w += static_cast<long double>(nq[static_cast<size_t>(b)]) * nk[static_cast<size_t>(b)];
    return w * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1);
  };
  while (work() > kWorkBudget) {
    if (d.Hq > std::max<int64_t>(1, d.Hkv)) { d.Hq = d.Hkv; continue; }
    int64_t* biggest = &d.Dk;
    if (d.Dv > *biggest) biggest = &d.Dv;
    for (auto& x : nq) if (x > *biggest) biggest = &x;
    for (auto& x : nk) if (x > *biggest) biggest = &x;
    *biggest /= 2;
  }
  // The packed k, v (and dk, dv) elements too: with no query rows the work above is 0 whatever
  // the keys, and 6300 keys of Dk = Dv = 128 in 3 heads (4.8 M elements per tensor pair, walked by
  // every check and copy) took 30 s under ASan, past libFuzzer's -timeout=10 (a varlen kNaive
  // backward with cu_seqlens_q = {0, 0, 0, 0}). No committed seed or finding comes near the bound.
  auto kv_elems = [&] {
    long double n = 0;
    for (int64_t x : nk) n += x;
    return n * std::max<int64_t>(1, d.Hkv) * (d.Dk + d.Dv);
  };
  while (kv_elems() > 2 * kWorkBudget) {
    int64_t* biggest = &d.Dk;
    if (d.Dv > *biggest) biggest = &d.Dv;
    for (auto& x : nk) if (x > *biggest) biggest = &x;
    *biggest /= 2;
  }
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (int b = 0; b < nseq; ++b) {
    cu_q.push_back(cu_q.back() + nq[static_cast<size_t>(b)]);
    cu_k.push_back(cu_k.back() + nk[static_cast<size_t>(b)]);
  }
  d.Nq = cu_q.back();
  d.Nk = cu_k.back();

  // Options (no weights: varlen has none).
  sdpa::Options& o = c.opt;
  const uint8_t of = decode_short_options(f, o);
  c.want_lse = (of & 128) || c.backward;
  const uint8_t cf = f.ConsumeIntegral<uint8_t>();
  const DType cu_dt = cf & 1 ? DType::kInt32 : DType::kInt64;
  const int64_t cu_stride = ((cf >> 1) & 3) == 1 ? 2 : ((cf >> 1) & 3) == 2 ? -1 : 1;
  const int cu_mis = (cf >> 3) & 3;

  // F12 (kSkipDefault: varlen_empty_view): empty tensors get a buffer and stride 0 while open.
  const auto vl_layout = [&](bool fancy_layout) {
    LayoutSpec ls = decode_layout(f, fancy_layout);
    if (skipping("varlen_empty_view")) {
      ls.null_empty = false;
      ls.empty_stride_seed = 0;
    }
    return ls;
  };
  const LayoutSpec lq = vl_layout(fancy), lk = vl_layout(fancy), lv = vl_layout(fancy);
  c.out_ls = vl_layout(fancy);
  c.l_ls = vl_layout(fancy);
  c.q.init(c.dtype, {d.Nq, d.Hq, d.Dk}, Role::kUnitLast, true, lq);
  c.k.init(c.kv, {d.Nk, d.Hkv, d.Dk}, Role::kUnitLast, true, lk);
  c.v.init(c.kv, {d.Nk, d.Hkv, d.Dv}, Role::kUnitLast, true, lv);
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30};
  const double sigma = kSigma[f.ConsumeIntegralInRange<int>(0, 4)];
  fill_values(c.q, rng, sigma, 0);
  fill_values(c.k, rng, sigma, 0);
  fill_values(c.v, rng, 1.0, 0);
  if (!c.tame) plant_specials(f, {&c.q, &c.k, &c.v});

  const IndexTensor cuq(cu_dt, cu_q, cu_stride, cu_mis), cuk(cu_dt, cu_k, cu_stride, cu_mis);
  sdpa::VarlenInputs in{c.q.view(), c.k.view(), c.v.view(), cuq.view(), cuk.view()};
  auto describe_varlen = [&] {
    return describe(c) + "attention_varlen: " + cuq.describe("cu_seqlens_q") + "\n" + cuk.describe("cu_seqlens_k") + "\n";
  };
  g_case = describe_varlen();
  if (g_print) std::fprintf(stderr, "attention_fuzz: varlen case\n%s", g_case.c_str());
  sdpa::set_num_threads(c.threads);
  const DType ct = c.compute();
  auto make_vouts = [&](bool fancy_layout) {
    Outs r;
    r.out.init(c.dtype, {d.Nq, d.Hq, d.Dv}, Role::kUnitLast, false, fancy_layout ? c.out_ls : LayoutSpec::plain());
    if (c.want_lse) r.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, fancy_layout ? c.l_ls : LayoutSpec::plain());
    return r;
  };
  auto vouts = [](const Outs& r) {
    sdpa::VarlenOutputs vo;
    vo.out = r.out.view();
    if (r.lse) vo.lse = r.lse->view();
    return vo;
  };
  auto make_vgrads = [&](const LayoutSpec& ls) {
    return Grads{Tensor(c.dtype, {d.Nq, d.Hq, d.Dk}, Role::kUnitLast, false, ls), Tensor(c.kv, {d.Nk, d.Hkv, d.Dk}, Role::kUnitLast, false, ls),
                 Tensor(c.kv, {d.Nk, d.Hkv, d.Dv}, Role::kUnitLast, false, ls), std::nullopt};
  };
  bool bad_scale = false;
  if (o.scale) bad_scale = c.compute() == DType::kFloat32 && std::fabs(*o.scale) > FLT_MAX;  // not drawn today

  Outs vo = make_vouts(true);
  Tensor dout(c.dtype, {d.Nq, d.Hq, d.Dv}, Role::kUnitLast, true, vl_layout(true));
  {
    std::mt19937_64 r2(f.ConsumeIntegral<uint64_t>());
    fill_values(dout, r2, 1.0, 0);
  }

  if (g_varlen_blocks) {
    run_varlen_blocks(f, c, in, nq, nk, cu_q, cu_k, cuq, dout, describe_varlen());
    return;
  }

  if (bad != VarBad::kNone) {
    // Invalid: sdpa::Error, nothing written. The backward gets the out and lse of a valid forward.
    Outs valid = make_vouts(false);
    if (!valid.lse) valid.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, LayoutSpec::plain());
    if (c.backward) expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(valid), o); });
    sdpa::VarlenInputs bin = in;
    sdpa::VarlenOutputs bo = vouts(vo);
    std::vector<int64_t> bq = cu_q, bk = cu_k;
    sdpa::TensorView bout = valid.out.view(), blse = valid.lse->view(), bdout = dout.view();
    Grads g = make_vgrads(c.out_ls);
    sdpa::Gradients gr = g.gradients();
    bool must_throw = true, fwd = true;
    std::optional<IndexTensor> tq, tk;
    switch (bad) {
      case VarBad::kFirstNonzero: bq[0] = 1; break;
      case VarBad::kDecreasing: if (nseq >= 2 && bk[1] > 0) bk[1] = bk[2] + 1; else bk.back() += 1; break;
      case VarBad::kLastShort: if (bq.back() > 0) bq.back() -= 1; else bq.back() = 1; break;
      case VarBad::kLastLong: bk.back() += 1; break;
      case VarBad::kNegative: if (nseq >= 1) bq[1] = -1; else bq[0] = -1; break;
      case VarBad::kCountMismatch: bk.push_back(bk.back()); break;
      default: break;
    }
    tq.emplace(cu_dt, bq, cu_stride, cu_mis);
    tk.emplace(cu_dt, bk, cu_stride, cu_mis);
    bin.cu_seqlens_q = tq->view();
    bin.cu_seqlens_k = tk->view();
    switch (bad) {
      case VarBad::kCuDtype: bin.cu_seqlens_q.dtype = cf & 32 ? DType::kBool : cu_dt == DType::kInt32 ? DType::kFloat32 : DType::kFloat64; break;
      case VarBad::kCuRank: {
        sdpa::TensorView& t = bin.cu_seqlens_k;
        t.rank = 2; t.shape[1] = t.shape[0]; t.strides[1] = t.strides[0]; t.shape[0] = 1; t.strides[0] = 0;
        break;
      }
      case VarBad::kCuEmpty: bin.cu_seqlens_q.shape[0] = 0; break;
      case VarBad::kCuNull: bin.cu_seqlens_k.data = nullptr; break;
      case VarBad::kOutShape: bo.out.shape[2] += 1; bout.shape[2] += 1; break;
      case VarBad::kLseShape: if (bo.lse) bo.lse->shape[1] += 1; else must_throw = c.backward; blse.shape[1] += 1; break;
      case VarBad::kKDtype: bin.k.dtype = c.kv == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32; break;
      case VarBad::kQRank: bin.q.rank = 2; break;
      case VarBad::kDqRows: fwd = false; gr.dq.shape[0] += 1; break;
      case VarBad::kDoutShape: fwd = false; bdout.shape[2] += 1; break;
      case VarBad::kDvDtype: fwd = false; gr.dv.dtype = c.kv == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32; break;
      default: break;
    }
    g_case = describe_varlen() + "invalid argument: " + kVarBadNames[static_cast<int>(bad)] + "\n" + tq->describe("cu_seqlens_q (given)") + "\n" +
             tk->describe("cu_seqlens_k (given)") + "\n";
    if (!fwd && !c.backward) return;
    auto attempt = [&](const char* call, const std::function<void()>& fn, std::string& what) {
      try {
        fn();
      } catch (const sdpa::Error& e) {
        what = e.what();
        return true;
      } catch (const std::exception& e) {
        check(false, "other_exception", [&] { return std::string(call) + " threw a non-sdpa::Error exception: " + e.what(); });
      }
      return false;
    };
    std::string what;
    if (fwd) {
      const auto s0 = vo.out.snapshot();
      const auto s1 = vo.lse ? vo.lse->snapshot() : std::vector<std::byte>{};
      const bool threw = attempt("attention_varlen", [&] { sdpa::attention_varlen(bin, bo, o); }, what);
      if (threw)
        check(vo.out.same_bytes(s0) && (!vo.lse || vo.lse->same_bytes(s1)), "error_untouched",
              [&] { return "attention_varlen: sdpa::Error(\"" + what + "\") but an output buffer changed"; });
      else
        check(!must_throw || (bad == VarBad::kLseShape && !vo.lse), "error_expected",
              [&] { return std::string("attention_varlen: no sdpa::Error for: ") + kVarBadNames[static_cast<int>(bad)]; });
    }
    if (!c.backward) return;
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    const bool threw = attempt("attention_varlen_backward", [&] { sdpa::attention_varlen_backward(bin, bout, blse, bdout, gr, o); }, what);
    if (threw)
      check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
            [&] { return "attention_varlen_backward: sdpa::Error(\"" + what + "\") but a gradient buffer changed"; });
    else
      check(false, "error_expected", [&] { return std::string("attention_varlen_backward: no sdpa::Error for: ") + kVarBadNames[static_cast<int>(bad)]; });
    return;
  }
  (void)bad_scale;

  // A valid call.
  expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(vo), o); });
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen");
  check_outs_written(vo);
  {
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_vouts(false);
    expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(o2), o); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(vo.bitwise_equal(o2, why), "repeatable", [&] { return "two identical attention_varlen calls (threads 1 and 2) differ: " + why; });
  }
  // Each sequence: bit for bit attention() on contiguous copies of its rows (with dropout, as
  // batch entry b of a dense call).
  struct Seq { Tensor q, k, v, out; std::optional<Tensor> lse; int64_t at = 0; bool ran = false; };
  std::vector<Seq> seqs(static_cast<size_t>(nseq));
  for (int b = 0; b < nseq; ++b) {
    Seq& s = seqs[static_cast<size_t>(b)];
    s.at = o.dropout_p > 0 ? b : 0;
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], k1 = cu_k[static_cast<size_t>(b) + 1];
    if (static_cast<long double>(s.at + 1) * (q1 - q0) * (k1 - k0) * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1) > 4.0L * kWorkBudget) continue;
    s.q = dense_rows(c.q, q0, q1, s.at);
    s.k = dense_rows(c.k, k0, k1, s.at);
    s.v = dense_rows(c.v, k0, k1, s.at);
    std::vector<int64_t> os = s.q.shape(), ls = os;
    os.back() = d.Dv;
    ls.pop_back();
    s.out.init(c.dtype, os, Role::kUnitLast, false, LayoutSpec::plain());
    s.lse.emplace(ct, ls, Role::kAny, false, LayoutSpec::plain());
    sdpa::Inputs di;
    di.q = s.q.view();
    di.k = s.k.view();
    di.v = s.v.view();
    sdpa::Outputs dout_s;
    dout_s.out = s.out.view();
    dout_s.lse = s.lse->view();
    expect_no_throw("attention (one sequence)", [&] { sdpa::attention(di, dout_s, o); });
    s.ran = true;
    std::string r = rows_bitwise("out", vo.out, q0, s.out, s.at);
    if (r.empty() && vo.lse) {
      const int64_t n = q1 - q0;
      for (int64_t h = 0; h < d.Hq && r.empty(); ++h)
        for (int64_t i = 0; i < n; ++i) {
          const double a = vo.lse->flat(h * d.Nq + q0 + i), w = s.lse->flat((s.at * d.Hq + h) * n + i);
          if (!(same_bits(a, w) || (std::isnan(a) && std::isnan(w)))) {
            r = "lse[" + std::to_string(h) + ", " + std::to_string(q0 + i) + "] = " + num(a) + " but the dense call gives " + num(w);
            break;
          }
        }
    }
    check(r.empty(), "varlen_dense", [&] { return "sequence " + std::to_string(b) + ": " + r; });
  }

  if (!c.backward) return;
  const Tensor& lse = *vo.lse;
  bool lse_pinf = false;
  for (int64_t n = 0; n < lse.numel(); ++n) lse_pinf |= lse.flat(n) == kInf;
  Grads g = make_vgrads(c.out_ls);
  auto call_bwd = [&](const Grads& gg) { sdpa::attention_varlen_backward(in, vo.out.view(), lse.view(), dout.view(), gg.gradients(), o); };
  if (lse_pinf) {
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    bool threw = false;
    try {
      call_bwd(g);
    } catch (const sdpa::Error&) {
      threw = true;
    }
    check(threw, "lse_inf_backward", [&] { return std::string("attention_varlen_backward with +inf in lse did not throw"); });
    check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched", [] { return std::string("varlen backward Error but a gradient changed"); });
    return;
  }
  expect_no_throw("attention_varlen_backward", [&] { call_bwd(g); });
  // F20 (fixed): with 2 threads a sequence whose backward notes no path (one that writes nothing,
  // or any under kReference / kNaive) used to report the path an earlier call left in an OpenMP
  // worker's thread_local record (findings/kernel_path_stale-prelude, then -naive).
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen_backward");
  for (const auto& tn : {std::pair<const Tensor*, const char*>{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"}}) {
    const char* name = tn.second;
    const std::string r = tn.first->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  }
  {
    sdpa::set_num_threads(3 - c.threads);
    Grads g2 = make_vgrads(LayoutSpec::plain());
    expect_no_throw("attention_varlen_backward", [&] { call_bwd(g2); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(grads_bitwise(g, g2, why), "repeatable", [&] { return "two identical attention_varlen_backward calls (threads 1 and 2) differ: " + why; });
  }
  for (int b = 0; b < nseq; ++b) {
    Seq& s = seqs[static_cast<size_t>(b)];
    // With dropout only the draws are promised for b > 0 (the forward above checked them): a dense
    // call with B = b + 1 may pick another backward plan (the plan follows the shape), so other bits.
    if (!s.ran || s.at > 0) continue;
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1], k0 = cu_k[static_cast<size_t>(b)];
    const Tensor dout_b = dense_rows(dout, q0, q1, s.at);
    Tensor dq(c.dtype, s.q.shape(), Role::kUnitLast, false, LayoutSpec::plain()), dk(c.kv, s.k.shape(), Role::kUnitLast, false, LayoutSpec::plain()),
        dv(c.kv, s.v.shape(), Role::kUnitLast, false, LayoutSpec::plain());
    sdpa::Inputs di;
    di.q = s.q.view();
    di.k = s.k.view();
    di.v = s.v.view();
    expect_no_throw("attention_backward (one sequence)", [&] {
      sdpa::attention_backward(di, s.out.view(), s.lse->view(), dout_b.view(), {dq.view(), dk.view(), dv.view()}, o);
    });
    std::string r = rows_bitwise("dq", g.dq, q0, dq, s.at);
    if (r.empty()) r = rows_bitwise("dk", g.dk, k0, dk, s.at);
    if (r.empty()) r = rows_bitwise("dv", g.dv, k0, dv, s.at);
    check(r.empty(), "varlen_dense", [&] { return "backward, sequence " + std::to_string(b) + ": " + r; });
  }
}

// ---- attention_paged (ext bit 6) and KVCache (ext bit 7) ----
//
// Both are judged against the same call made dense: a Case (rank 4) whose k and v hold each
// sequence's keys gathered in order into (B, Hkv, Nk, D), Nk = max_pages · page_size, keys past
// a sequence's length NaN, with Inputs::seqlens_k. So every oracle above applies to it as to a
// dense call with seqlens_k (edge semantics, the tolerance rule), and the header's promise is one
// comparison: the paged results are bit for bit the dense call's capped at KernelPath::kSimd.

// The work of a paged or KVCache input: each valid call runs 3 paged calls, the dense one,
// kReference and kNaive, and the oracle over B · Hq · Nq · max_pages · page_size scores; a quarter
// of a dense call's budget keeps these inputs no slower than the others.
constexpr int64_t kPagedWorkBudget = kWorkBudget / 4;

// paged_dense: `full` (a paged or KVCache call's out, weights and lse) against attention() on c
// capped at kSimd, bit for bit; then (unless `oracle` is false: a KVCache step too large for it)
// the edge semantics, and on tame inputs the tolerance rule.
void check_paged_dense(const Case& c, const Outs& full, const char* call, bool oracle = true) {
  Outs dense = make_outs(c, true, true, false);
  sdpa::set_max_kernel_path(sdpa::KernelPath::kSimd);
  run_forward(c, c.inputs(), dense, c.opt);
  sdpa::set_max_kernel_path(c.path_cap);
  std::string why;
  check(full.bitwise_equal(dense, why), "paged_dense", [&] {
    return std::string(call) + " differs from attention() on the gathered keys with seqlens_k (capped at kSimd): " + why;
  });
  if (!oracle) return;
  check_edge_semantics(c, full);
  if (c.tame) check_tolerance(c, full);
}

// A sequence's length at a page's edges (0, 1, page_size ± 1, two pages ± 1), full, or random.
int64_t page_edge_length(std::mt19937_64& rng, int64_t ps, int64_t Nk) {
  int64_t x;
  switch (rng() % 11) {
    case 0: x = 0; break;
    case 1: x = 1; break;
    case 2: x = ps - 1; break;
    case 3: x = ps; break;
    case 4: x = ps + 1; break;
    case 5: x = 2 * ps - 1 + static_cast<int64_t>(rng() % 3); break;
    case 6: x = Nk; break;
    case 7: x = Nk - 1; break;
    case 8: x = Nk - ps + 1; break;
    default: x = static_cast<int64_t>(rng() % static_cast<uint64_t>(Nk + 1)); break;
  }
  return std::clamp<int64_t>(x, 0, Nk);
}

// A block table (B, cols), int32 or int64, unit last stride, row stride rs (cols plus a gap, its
// negative, or 0: one row for every sequence), at 0-3 bytes of misalignment, in IndexTensor's
// exactly-sized buffer (stride 1): entry (b, j) is element at(b, j) of it.
struct BlockTable {
  int64_t B = 0, cols = 0, rs = 0, base = 0;
  std::unique_ptr<IndexTensor> mem;
  BlockTable(DType dt, int64_t B_, int64_t cols_, int64_t rs_, int mis) : B(B_), cols(cols_), rs(rs_) {
    const int64_t n = B == 0 || cols == 0 ? 0 : (B - 1) * std::abs(rs) + cols;
    base = rs < 0 && B > 0 ? (B - 1) * -rs : 0;
    mem = std::make_unique<IndexTensor>(dt, std::vector<int64_t>(static_cast<size_t>(n), -1), 1, mis);
  }
  int64_t size() const { return static_cast<int64_t>(mem->vals.size()); }
  int64_t at(int64_t b, int64_t j) const { return base + b * rs + j; }
  int64_t get(int64_t b, int64_t j) const { return mem->vals[static_cast<size_t>(at(b, j))]; }
  void set_elem(int64_t i, int64_t x) { mem->set(i, mem->dtype == DType::kInt32 ? static_cast<int32_t>(x) : x); }
  sdpa::TensorView view() const {
    sdpa::TensorView t;
    t.dtype = mem->dtype;
    t.rank = 2;
    t.shape[0] = B;
    t.shape[1] = cols;
    t.strides[0] = rs;
    t.strides[1] = 1;
    t.data = size() == 0 ? nullptr : mem->data + base * (mem->dtype == DType::kInt32 ? 4 : 8);
    return t;
  }
  std::string describe() const {
    std::ostringstream s;
    s << "block_table: " << (mem->dtype == DType::kInt32 ? "int32" : "int64") << " (" << B << ", " << cols << ") strides (" << rs
      << ", 1) misalign " << mem->misalign << " rows [";
    for (int64_t b = 0; b < B && b < 8; ++b) {
      s << (b ? "; " : "");
      for (int64_t j = 0; j < cols && j < 40; ++j) s << (j ? " " : "") << get(b, j);
    }
    s << "]";
    return s.str();
  }
};

// The pool elements (sorted offsets) of the rows no sequence reads: rows past every reader's
// length, and pages no table row uses (read[p * page_size + r] says which rows are read).
std::vector<int64_t> unread_offsets(const Tensor& pool, const std::vector<uint8_t>& read) {
  std::vector<int64_t> offs;
  const int64_t rows = pool.numel() == 0 ? 0 : pool.shape()[0] * pool.shape()[1], per_row = pool.shape()[2] * pool.shape()[3];
  for (int64_t r = 0; r < rows; ++r)
    if (!read[static_cast<size_t>(r)])
      for (int64_t x = 0; x < per_row; ++x) offs.push_back(pool.offset_of_flat(r * per_row + x));
  std::sort(offs.begin(), offs.end());
  return offs;
}

enum class PagedBad : uint8_t {
  kNone, kEntryPastPool, kEntryNegative, kTooShort, kTableDtype, kTableBatch, kTableLastStride, kTableRank, kTableNull,
  kPoolsDiffer, kPageSizeZero, kPoolDk, kPoolHeads, kPoolDtype, kCount
};
const char* const kPagedBadNames[] = {"none", "block_table entry >= num_pages", "block_table entry negative",
                                      "table too short for seqlens_k", "block_table dtype", "block_table batch",
                                      "block_table last stride 2", "block_table rank 1", "block_table null",
                                      "v_pages num_pages differs", "page_size 0", "k_pages Dk", "v_pages heads",
                                      "v_pages dtype"};
static_assert(sizeof(kPagedBadNames) / sizeof(kPagedBadNames[0]) == static_cast<size_t>(PagedBad::kCount));

// Runs `fn` that must throw sdpa::Error (error_expected) naming `want` (error_names: every
// string in it is in the message), writing none of o's buffers (error_untouched).
void expect_error(const char* call, const std::function<void()>& fn, const Outs* o, const std::vector<std::string>& want,
                  const std::string& what_bad) {
  const auto s0 = o ? o->out.snapshot() : std::vector<std::byte>{};
  const auto s1 = o && o->weights ? o->weights->snapshot() : std::vector<std::byte>{};
  const auto s2 = o && o->lse ? o->lse->snapshot() : std::vector<std::byte>{};
  std::string what;
  bool threw = false;
  try {
    fn();
  } catch (const sdpa::Error& e) {
    threw = true;
    what = e.what();
  } catch (const std::exception& e) {
    check(false, "other_exception", [&] { return std::string(call) + " threw a non-sdpa::Error exception: " + e.what(); });
  }
  check(threw, "error_expected", [&] { return std::string(call) + ": no sdpa::Error for: " + what_bad; });
  for (const std::string& w : want)
    check(what.find(w) != std::string::npos, "error_names",
          [&] { return std::string(call) + ": the Error for " + what_bad + " does not name \"" + w + "\": " + what; });
  if (o)
    check(o->out.same_bytes(s0) && (!o->weights || o->weights->same_bytes(s1)) && (!o->lse || o->lse->same_bytes(s2)),
          "error_untouched", [&] { return std::string(call) + ": sdpa::Error(\"" + what + "\") but an output buffer changed"; });
}

void run_paged(FuzzedDataProvider& f) {
  Case c;  // the call made dense: k, v (B, Hkv, Nk, D) gathered from the pool, seqlens_k
  const bool fancy = decode_flags(f, c);
  c.backward = false;  // attention_paged is forward only
  c.rank = 4;
  const uint8_t inv = f.ConsumeIntegral<uint8_t>();
  PagedBad bad = inv < 200 ? PagedBad::kNone : static_cast<PagedBad>(1 + inv % (static_cast<int>(PagedBad::kCount) - 1));
  Dims& d = c.d;
  static const int64_t kB[] = {1, 1, 1, 2, 2, 3, 3, 4, 5, 0};
  static const int64_t kHkv[] = {1, 1, 2, 3};
  static const int64_t kGroup[] = {1, 1, 2, 4, 5, 8};
  static const int64_t kNq[] = {0, 1, 1, 1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 65};
  static const int64_t kPs[] = {1, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 32, 48, 64, 127, 128, 129, 256};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64, 65, 128};
  d.B = pick(f, kB);
  d.Hkv = pick(f, kHkv);
  d.Hq = d.Hkv * pick(f, kGroup);
  d.Nq = pick(f, kNq);
  int64_t ps = pick(f, kPs);
  const uint8_t sz = f.ConsumeIntegral<uint8_t>();
  // max_pages: a few pages, or (1 in 8) past 2048 keys, where the kernels split the keys.
  const bool long_keys = sz % 8 == 7;
  int64_t cols = long_keys ? (2048 + 64 * (sz >> 3 & 3)) / ps + 1 : (sz >> 3) % 7;
  d.Dk = pick(f, kD);
  d.Dv = pick(f, kD);
  const uint8_t pl = f.ConsumeIntegral<uint8_t>();  // bits 0-1, 2-3: the k, v pools' layouts; 4-5 spare pages; 6-7 sharing
  const uint8_t tb = f.ConsumeIntegral<uint8_t>();  // the table: int32 (bit 0), row stride (1-2), misalignment (3-4), extra columns (5-6)
  const uint8_t sb = f.ConsumeIntegral<uint8_t>();  // seqlens_k: int32 (bit 0), stride (1-2), misalignment (3-4)
  if (!long_keys && ((tb >> 5) & 3) > 1) cols += ((tb >> 5) & 3) - 1;  // columns past every sequence's pages
  if (long_keys) { d.B = std::min<int64_t>(d.B, 2); d.Hq = d.Hkv; d.Nq = std::min<int64_t>(d.Nq, 2); }
  // Bound the work (kPagedWorkBudget). Long keys stay long.
  for (;;) {
    d.Nk = cols * ps;
    if (work_of(d) <= kPagedWorkBudget) break;
    if (d.Hq > d.Hkv) { d.Hq = d.Hkv; continue; }
    int64_t* biggest = &d.Dk;
    for (int64_t* x : {&d.Dv, &d.Nq, long_keys ? &d.B : &cols, long_keys ? &d.B : &ps}) if (*x > *biggest) biggest = x;
    *biggest = std::max<int64_t>(1, *biggest / 2);
  }
  const uint8_t of = decode_short_options(f, c.opt);
  c.want_weights = of & 64;
  c.want_lse = of & 128;
  // Pools: token-major C order, head-major (KVCache's layout), or any layout with a unit last stride.
  const auto pool_layout = [&](int kind) {
    LayoutSpec ls;
    if (kind == 1) ls.perm = 1;  // memory (num_pages, Hkv, page_size, D)
    if (kind >= 2) ls = decode_layout(f, true);
    ls.zero = 0;  // every pool row its own memory
    if (skipping("paged_empty_pool_view")) {  // F15 (fixed; SDPA_FUZZ_SKIP only): no null data, no huge strides
      ls.null_empty = false;
      ls.empty_stride_seed = 0;
    }
    return ls;
  };
  const LayoutSpec lk = pool_layout(pl & 3), lv = pool_layout(pl >> 2 & 3), lq = decode_layout(f, fancy);
  c.out_ls = decode_layout(f, fancy);
  c.w_ls = decode_layout(f, fancy);
  c.l_ls = decode_layout(f, fancy);
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30, 300};
  const uint8_t vf = f.ConsumeIntegral<uint8_t>();

  // Lengths, then the pages: each sequence's in a shuffled order, some sharing a prefix of
  // another's (read-only), or (row stride 0) one table row for all.
  std::vector<int64_t> L(static_cast<size_t>(d.B));
  for (auto& x : L) x = page_edge_length(rng, ps, d.Nk);
  const int rs_kind = (tb >> 1) & 3;
  const int64_t rs = rs_kind == 0 ? cols : rs_kind == 1 ? cols + 1 + static_cast<int64_t>(rng() % 3)
                     : rs_kind == 2 ? -(cols + static_cast<int64_t>(rng() % 2)) : 0;
  std::vector<int64_t> used(static_cast<size_t>(d.B));
  int64_t max_used = 0;
  for (int64_t b = 0; b < d.B; ++b) max_used = std::max(max_used, used[b] = (L[b] + ps - 1) / ps);
  std::vector<std::vector<int32_t>> pages(static_cast<size_t>(d.B));
  std::vector<int64_t> share(static_cast<size_t>(d.B), 0), from(static_cast<size_t>(d.B), 0);  // a prefix of sequence from[b]'s
  int64_t own = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    if (rs == 0 && d.B > 1) { share[b] = b > 0 ? used[b] : 0; from[b] = 0; }
    else if (b > 0 && (pl >> 6) && rng() % 4 < (pl >> 6)) {
      from[b] = static_cast<int64_t>(rng() % static_cast<uint64_t>(b));
      share[b] = std::min(used[b], used[from[b]]) - static_cast<int64_t>(rng() % 2);
      share[b] = std::max<int64_t>(0, share[b]);
    }
    own += (rs == 0 && d.B > 1) ? (b == 0 ? max_used : 0) : used[b] - share[b];
  }
  int64_t num_pages = own + ((pl >> 4) & 3);
  if (num_pages == 0 && d.B > 0 && cols > 0 && skipping("paged_empty_pool")) num_pages = 1;  // F14 (fixed; SDPA_FUZZ_SKIP only)
  std::vector<int32_t> order(static_cast<size_t>(num_pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  size_t next = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t n = rs == 0 && d.B > 1 && b == 0 ? max_used : used[b];
    for (int64_t j = 0; j < n; ++j) pages[b].push_back(j < share[b] ? pages[from[b]][j] : order[next++]);
  }
  const DType tdt = tb & 1 ? DType::kInt32 : DType::kInt64;
  // F13 (fixed; SDPA_FUZZ_SKIP=paged_misaligned_table): aligned tables only when skipped.
  BlockTable table(tdt, d.B, cols, rs, skipping("paged_misaligned_table") ? 0 : (tb >> 3) & 3);
  std::vector<uint8_t> entry_read(static_cast<size_t>(table.size()), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t j = 0; j < static_cast<int64_t>(pages[b].size()); ++j) {
      table.set_elem(table.at(b, j), pages[b][j]);
      if (j < used[b]) entry_read[static_cast<size_t>(table.at(b, j))] = 1;
    }
  // Entries no sequence reads (past its pages, and the gaps between rows): out of range, -1.
  std::vector<int64_t> table_unread;
  for (int64_t i = 0; i < table.size(); ++i) {
    if (entry_read[static_cast<size_t>(i)]) continue;
    table_unread.push_back(i);
    const int64_t k = static_cast<int64_t>(rng() % 6);
    const int64_t huge = tdt == DType::kInt32 ? INT32_MAX : int64_t{1} << 40, low = tdt == DType::kInt32 ? INT32_MIN : INT64_MIN;
    table.set_elem(i, k == 0 ? -1 : k == 1 ? num_pages : k == 2 ? num_pages + 7 : k == 3 ? huge : k == 4 ? low : -2);
  }
  std::vector<uint8_t> row_read(static_cast<size_t>(num_pages * ps), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t j = 0; j < L[b]; ++j) row_read[static_cast<size_t>(pages[b][j / ps] * ps + j % ps)] = 1;

  // The pools: random values, specials (not tame), NaN in every row no sequence reads.
  Tensor kp(c.kv, {num_pages, ps, d.Hkv, d.Dk}, Role::kUnitLast, false, lk);
  Tensor vp(c.kv, {num_pages, ps, d.Hkv, d.Dv}, Role::kUnitLast, false, lv);
  c.q.init(c.dtype, {d.B, d.Hq, d.Nq, d.Dk}, Role::kUnitLast, true, lq);
  fill_values(c.q, rng, kSigma[vf % 6], (vf >> 3) % 3);
  fill_values(kp, rng, kSigma[vf % 6], (vf >> 3) % 3);
  fill_values(vp, rng, 1.0, 0);
  if (!c.tame) plant_specials(f, {&c.q, &kp, &vp});
  const std::vector<int64_t> k_unread = unread_offsets(kp, row_read), v_unread = unread_offsets(vp, row_read);
  for (int64_t o : k_unread) kp.set_off(o, kNaN);
  for (int64_t o : v_unread) vp.set_off(o, kNaN);
  // The dense call: each sequence's keys gathered in order; keys past its length NaN.
  c.k.init(c.kv, {d.B, d.Hkv, d.Nk, d.Dk}, Role::kUnitLast, true, LayoutSpec::plain());
  c.v.init(c.kv, {d.B, d.Hkv, d.Nk, d.Dv}, Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hkv; ++h)
      for (int64_t j = 0; j < d.Nk; ++j) {
        const int64_t row = j < L[b] ? pages[b][j / ps] * ps + j % ps : -1;
        for (int64_t e = 0; e < d.Dk; ++e)
          c.k.set_flat(((b * d.Hkv + h) * d.Nk + j) * d.Dk + e, row < 0 ? kNaN : kp.flat((row * d.Hkv + h) * d.Dk + e));
        for (int64_t e = 0; e < d.Dv; ++e)
          c.v.set_flat(((b * d.Hkv + h) * d.Nk + j) * d.Dv + e, row < 0 ? kNaN : vp.flat((row * d.Hkv + h) * d.Dv + e));
      }
  c.seqlens = L;
  const int sl_st = (sb >> 1) & 3;
  c.sl = std::make_shared<IndexTensor>(sb & 1 ? DType::kInt32 : DType::kInt64, L, sl_st == 1 ? 2 : sl_st == 2 ? -1 : 1, (sb >> 3) & 3);
  c.sl_view = c.sl->view();
  if (c.tame && c.opt.scale && !(std::fabs(*c.opt.scale) <= 1e3)) c.tame = false;

  sdpa::PagedInputs in;
  in.q = c.q.view();
  in.k_pages = kp.view();
  in.v_pages = vp.view();
  in.block_table = table.view();
  in.seqlens_k = *c.sl_view;
  std::ostringstream pd;
  pd << "attention_paged: page_size " << ps << ", num_pages " << num_pages << ", pages per sequence:";
  for (int64_t b = 0; b < d.B; ++b) {
    pd << " [";
    for (size_t j = 0; j < pages[b].size() && j < 40; ++j) pd << (j ? " " : "") << pages[b][j];
    if (pages[b].size() > 40) pd << " ... (" << pages[b].size() << ")";
    pd << "]" << (share[b] > 0 ? " (" + std::to_string(share[b]) + " shared with sequence " + std::to_string(from[b]) + ")" : "");
  }
  pd << "\n" << kp.describe("k_pages") << "\n" << vp.describe("v_pages") << "\n" << table.describe() << "\n";
  g_case = describe(c) + pd.str();
  if (g_print) std::fprintf(stderr, "attention_fuzz: paged case\n%s", g_case.c_str());
  sdpa::set_num_threads(c.threads);
  // While a paged call runs: garbage in the rows no sequence reads and, under ASan, those bytes and
  // the table entries no sequence reads unaddressable.
  const auto unread_fenced = [&](Garbage& g) {
    g.values(kp, k_unread);
    g.values(vp, v_unread);
    g.fence(table.mem->data, table_unread, tdt == DType::kInt32 ? 4 : 8);
  };
  const auto paged = [&](const Outs& o, uint64_t seed) {
    Garbage g(seed);
    unread_fenced(g);
    expect_no_throw("attention_paged", [&] { sdpa::attention_paged(in, o.outputs(), c.opt); });
  };

  if (bad != PagedBad::kNone) {
    Outs o = make_outs(c, c.want_weights, c.want_lse, true);
    sdpa::PagedInputs bin = in;
    std::vector<std::string> want;
    std::optional<IndexTensor> bad_sl;
    bool must_throw = true;
    // A table entry a sequence reads made invalid: the Error names the first such entry in the
    // order the table is read (sequence by sequence), and its sequence.
    const auto bad_entry = [&](int64_t x) {
      std::vector<std::pair<int64_t, int64_t>> cand;
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t j = 0; j < used[b]; ++j) cand.push_back({b, j});
      if (cand.empty()) return false;
      const auto [b0, j0] = cand[rng() % cand.size()];
      table.set_elem(table.at(b0, j0), x);
      for (const auto& [b, j] : cand) {
        const int64_t e = table.get(b, j);
        if (e < 0 || e >= num_pages) {
          want = {"block_table[" + std::to_string(b) + "][" + std::to_string(j) + "] = " + std::to_string(e), "sequence " + std::to_string(b)};
          break;
        }
      }
      return true;
    };
    switch (bad) {
      case PagedBad::kEntryPastPool: must_throw = bad_entry(rng() % 2 ? num_pages : tdt == DType::kInt32 ? INT32_MAX : int64_t{1} << 40); break;
      case PagedBad::kEntryNegative: must_throw = bad_entry(rng() % 2 ? -1 : tdt == DType::kInt32 ? INT32_MIN : INT64_MIN); break;
      case PagedBad::kTooShort: {
        if (d.B == 0) { must_throw = false; break; }
        std::vector<int64_t> L2 = L;
        const size_t b = static_cast<size_t>(rng() % static_cast<uint64_t>(d.B));
        L2[b] = d.Nk + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(ps));
        bad_sl.emplace(c.sl->dtype, L2, c.sl->stride, c.sl->misalign);
        bin.seqlens_k = bad_sl->view();
        want = {"seqlens_k[" + std::to_string(b) + "] = " + std::to_string(L2[b])};
        // A pool of no pages (every other length 0): the Error names the sequence that has keys
        // and its length ("block_table[b][0] ... is not a page of k_pages (num_pages = 0);
        // sequence b has L keys", F14's fix) before the length's range.
        if (num_pages == 0) want = {"sequence " + std::to_string(b), std::to_string(L2[b]) + " keys"};
        break;
      }
      case PagedBad::kTableDtype: bin.block_table.dtype = tb & 64 ? DType::kFloat32 : DType::kBool; break;
      case PagedBad::kTableBatch: bin.block_table.shape[0] = d.B + 1; break;
      case PagedBad::kTableLastStride: bin.block_table.strides[1] = 2; must_throw = cols > 1; break;
      case PagedBad::kTableRank: bin.block_table.rank = 1; break;
      case PagedBad::kTableNull: bin.block_table.data = nullptr; must_throw = d.B > 0 && cols > 0; break;
      case PagedBad::kPoolsDiffer: bin.v_pages.shape[tb & 128 ? 1 : 0] += 1; break;
      case PagedBad::kPageSizeZero: bin.k_pages.shape[1] = bin.v_pages.shape[1] = 0; break;
      case PagedBad::kPoolDk: bin.k_pages.shape[3] += 1; break;
      case PagedBad::kPoolHeads: bin.v_pages.shape[2] += 1; break;
      case PagedBad::kPoolDtype: bin.v_pages.dtype = c.kv == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32; break;
      default: must_throw = false; break;
    }
    if (!must_throw) return;  // nothing to break in this call (no page read, one column)
    g_case += std::string("invalid argument: ") + kPagedBadNames[static_cast<int>(bad)] + "\n" + table.describe() + "\n";
    if (g_print) std::fprintf(stderr, "attention_fuzz: paged invalid argument: %s\n", kPagedBadNames[static_cast<int>(bad)]);
    Garbage g(0x9a6edull + inv);
    unread_fenced(g);
    expect_error("attention_paged", [&] { sdpa::attention_paged(bin, o.outputs(), c.opt); }, &o, want, kPagedBadNames[static_cast<int>(bad)]);
    return;
  }

  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  paged(o, 0x9a6e0ull + vf);
  check_outs_written(o);
  {  // repeatable, across thread counts (and other garbage in the unread rows)
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_outs(c, c.want_weights, c.want_lse, false);
    paged(o2, 0x9a6e1ull + vf);
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(o.bitwise_equal(o2, why), "repeatable", [&] { return "two identical attention_paged calls (threads 1 and 2) differ: " + why; });
  }
  Outs full = make_outs(c, true, true, false);
  paged(full, 0x9a6e2ull + vf);
  std::string why;
  check(o.bitwise_equal(full, why), "weights_invariant", [&] { return "the same paged call with weights and lse requested differs: " + why; });
  check_paged_dense(c, full, "attention_paged");
}

// A KVCache driven by a short script on 2-3 interleaved sequences (new_sequence, append of 0-4
// tokens or a prompt across pages, attention, free; appends to a full pool and calls with an
// unknown sequence that must be Errors changing nothing), against a model of its pages and
// lengths (kvcache_model) and, at every attention, the same call made dense on the tokens the
// script appended (paged_dense).
void run_kvcache(FuzzedDataProvider& f) {
  Case base;  // dtypes, threads, tame, caps
  const bool fancy = decode_flags(f, base);
  base.backward = false;
  static const int64_t kHkv[] = {1, 1, 2, 3};
  static const int64_t kGroup[] = {1, 1, 2, 4};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32};
  static const int64_t kPs[] = {1, 1, 2, 3, 4, 5, 7, 8, 16, 17, 32};
  const int64_t Hkv = pick(f, kHkv), Hq = Hkv * pick(f, kGroup), Dk = pick(f, kD), Dv = pick(f, kD), ps = pick(f, kPs);
  const int64_t num_pages = f.ConsumeIntegralInRange<int64_t>(0, 12);
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30, 300};
  const double sigma = kSigma[f.ConsumeIntegral<uint8_t>() % 6];
  sdpa::set_num_threads(base.threads);
  std::ostringstream log;
  log << "KVCache(num_pages " << num_pages << ", page_size " << ps << ", Hkv " << Hkv << ", Dk " << Dk << ", Dv " << Dv << ", "
      << dtype_long(base.kv) << "), q " << dtype_long(base.dtype) << " Hq " << Hq << ", threads " << base.threads << ", "
      << (base.tame ? "tame" : "not tame") << ", kernel path cap " << path_name(base.path_cap) << (base.avx2 ? ", SIMD capped at AVX2" : "") << "\nscript:";
  g_case = log.str();
  // Constructor arguments the header forbids.
  const uint8_t kf = f.ConsumeIntegral<uint8_t>();
  if (kf % 4 != 0) {
    const int64_t a = kf % 4 == 1 ? 0 : ps, h = kf % 4 == 2 ? 0 : Hkv;
    const DType dt = kf % 4 == 3 ? (kf & 4 ? DType::kBool : DType::kInt32) : base.kv;
    expect_error("KVCache()", [&] { sdpa::KVCache bad(num_pages, a, h, Dk, Dv, dt); }, nullptr, {}, "page_size 0, num_kv_heads 0 or dtype");
  }
  sdpa::KVCache cache(num_pages, ps, Hkv, Dk, Dv, base.kv);

  struct Seq {
    bool live = false;
    int64_t L = 0;
    std::vector<int32_t> pages;
    std::vector<double> k, v;  // the tokens appended, (L, Hkv, D) token-major
  };
  std::vector<Seq> model;
  std::set<int32_t> free_pages;
  for (int32_t p = 0; p < num_pages; ++p) free_pages.insert(p);
  const auto live = [&] {
    std::vector<int64_t> r;
    for (size_t s = 0; s < model.size(); ++s) if (model[s].live) r.push_back(static_cast<int64_t>(s));
    return r;
  };
  // kvcache_model: the cache's ids, lengths, pages and free count are the model's.
  const auto state_matches = [&](const std::string& after) {
    const std::vector<int64_t> ids = live();
    check(cache.sequences() == ids && cache.free_pages() == static_cast<int64_t>(free_pages.size()), "kvcache_model", [&] {
      return "after " + after + ": " + std::to_string(cache.sequences().size()) + " sequences and " + std::to_string(cache.free_pages()) +
             " free pages, the model " + std::to_string(ids.size()) + " and " + std::to_string(free_pages.size());
    });
    const auto list = [](const std::vector<int32_t>& v) {
      std::string r;
      for (int32_t x : v) r += (r.empty() ? "" : " ") + std::to_string(x);
      return "[" + r + "]";
    };
    for (int64_t s : ids)
      check(cache.length(s) == model[s].L && cache.pages(s) == model[s].pages, "kvcache_model", [&] {
        return "after " + after + ": sequence " + std::to_string(s) + " has length " + std::to_string(cache.length(s)) + " and pages " +
               list(cache.pages(s)) + ", the model " + std::to_string(model[s].L) + " and " + list(model[s].pages);
      });
  };
  // An id no live sequence has: never issued, freed, negative.
  const auto unknown_id = [&](uint8_t x) -> int64_t {
    for (size_t s = 0; s < model.size() && x % 4 == 0; ++s) if (!model[s].live) return static_cast<int64_t>(s);
    return x % 4 == 1 ? -1 : x % 4 == 2 ? INT64_MAX : static_cast<int64_t>(model.size()) + x % 7;
  };
  int64_t last_n = 1;
  const int nops = f.ConsumeIntegralInRange<int>(1, 10);
  for (int step = 0; step < nops && f.remaining_bytes() > 0; ++step) {
    const uint8_t op = f.ConsumeIntegral<uint8_t>();
    std::vector<int64_t> ids = live();
    const int64_t pick_live = ids.empty() ? -1 : ids[(op >> 3) % ids.size()];
    // op bits 5-7 all set: the call names an unknown sequence (append, attention, free).
    const bool unknown = (op >> 5) == 7;
    int kind = op % 8;
    if (kind <= 1 && ids.size() >= 3) kind = 2;  // at most 3 live sequences: an append instead
    if (ids.empty() && !unknown && kind >= 2) kind = 0;  // nothing to append to or attend yet
    switch (kind) {
      case 0:
      case 1: {  // new_sequence
        {
          size_t want = 0;
          while (want < model.size() && model[want].live) ++want;
          if (want == model.size()) model.emplace_back();
          model[want] = Seq{true, 0, {}, {}, {}};
          const int64_t id = cache.new_sequence();
          log << " new_sequence() = " << id << ";";
          g_case = log.str();
          check(id == static_cast<int64_t>(want), "kvcache_model", [&] { return "new_sequence() = " + std::to_string(id) + ", the lowest free id is " + std::to_string(want); });
          state_matches("new_sequence");
        }
        break;
      }
      case 2:
      case 3:
      case 4: {  // append n tokens; to an unknown sequence, mismatched, or past a full pool: an Error
        static const int64_t kN[] = {1, 1, 1, 2, 3, 4, 0};
        const uint8_t nb = f.ConsumeIntegral<uint8_t>();
        const int64_t n = nb % 8 == 7 ? std::max<int64_t>(0, 2 * ps + 1 - static_cast<int64_t>(nb >> 6)) : kN[(nb >> 3) % 7];
        const int mis = nb % 8 == 6 ? 1 + (nb >> 6) % 3 : 0;  // 1 k's dtype, 2 v's Dv, 3 v's token count
        const int64_t s = unknown ? unknown_id(nb) : pick_live;
        Tensor kt(base.kv, {n, Hkv, Dk}, Role::kUnitLast, true, decode_layout(f, fancy));
        Tensor vt(base.kv, {n + (mis == 3), Hkv, Dv + (mis == 2)}, Role::kUnitLast, true, decode_layout(f, fancy));
        fill_values(kt, rng, sigma, 0);
        fill_values(vt, rng, 1.0, 0);
        if (!base.tame) plant_specials(f, {&kt, &vt, &kt});
        sdpa::TensorView kv = kt.view();
        if (mis == 1) kv.dtype = base.kv == DType::kFloat64 ? DType::kFloat32 : DType::kFloat64;
        const bool known = s >= 0 && s < static_cast<int64_t>(model.size()) && model[static_cast<size_t>(s)].live;
        const int64_t need = known ? (model[s].L + n + ps - 1) / ps - static_cast<int64_t>(model[s].pages.size()) : 0;
        log << " append(" << s << ", " << n << " tokens" << (mis ? std::string(", mismatched ") + (mis == 1 ? "k dtype" : mis == 2 ? "v Dv" : "v tokens") : "") << ");";
        g_case = log.str() + "\n" + kt.describe("k tokens") + "\n" + vt.describe("v tokens") + "\n";
        if (!known || mis || need > static_cast<int64_t>(free_pages.size())) {
          std::vector<std::string> want;
          if (!known) want = {std::to_string(s)};
          else if (!mis) want = {"full"};
          expect_error("KVCache::append", [&] { cache.append(s, kv, vt.view()); }, nullptr, want,
                       !known ? "an unknown sequence" : mis ? "mismatched tokens" : "a full pool");
          state_matches("a failed append");
          break;
        }
        expect_no_throw("KVCache::append", [&] { cache.append(s, kv, vt.view()); });
        Seq& q = model[s];
        for (int64_t p = 0; p < need; ++p) {
          q.pages.push_back(*free_pages.begin());  // the lowest free page first (the header)
          free_pages.erase(free_pages.begin());
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < Hkv; ++h) {
            for (int64_t e = 0; e < Dk; ++e) q.k.push_back(kt.at4(0, i, h, e));
            for (int64_t e = 0; e < Dv; ++e) q.v.push_back(vt.at4(0, i, h, e));
          }
        q.L += n;
        last_n = std::max<int64_t>(1, n);
        state_matches("append");
        break;
      }
      case 5:
      case 6: {  // attention of 0-3 sequences (one may repeat, or be unknown: an Error)
        const uint8_t ab = f.ConsumeIntegral<uint8_t>();
        std::vector<int64_t> seqs;
        const int nb = ids.empty() ? 0 : 1 + ab % 3;
        for (int b = 0; b < nb; ++b) seqs.push_back(ids[static_cast<size_t>(rng() % ids.size())]);
        const int64_t unk = unknown_id(ab >> 2);
        if (unknown) seqs.insert(seqs.begin() + static_cast<std::ptrdiff_t>(rng() % (seqs.size() + 1)), unk);
        static const int64_t kNq[] = {1, 1, 1, 2, 3, 0};
        Case dc;
        dc.dtype = base.dtype;
        dc.kv = base.kv;
        dc.rank = 4;
        dc.tame = base.tame;
        dc.threads = base.threads;
        dc.avx2 = base.avx2;
        dc.path_cap = base.path_cap;
        Dims& d = dc.d;
        d.Hq = Hq;
        d.Hkv = Hkv;
        d.Nq = (ab >> 2) % 7 == 6 ? last_n : kNq[(ab >> 2) % 7 % 6];
        d.Dk = Dk;
        d.Dv = Dv;
        const auto set_nk = [&] {
          size_t max_pages = 0;
          for (int64_t s : seqs) if (s != unk || !unknown) max_pages = std::max(max_pages, model[static_cast<size_t>(s)].pages.size());
          d.Nk = static_cast<int64_t>(max_pages) * ps;
          d.B = static_cast<int64_t>(seqs.size());
        };
        set_nk();
        // Bound the work as run_paged does: fewer queries, then fewer entries (a script may hold
        // 3 prompts of 65 tokens with 12 query heads); past a dense call's budget the oracle is
        // left out (the dense comparison stays).
        while (work_of(d) > kPagedWorkBudget && d.Nq > 1) d.Nq /= 2;
        while (work_of(d) > kPagedWorkBudget && seqs.size() > 1 && !unknown) {
          seqs.pop_back();
          set_nk();
        }
        const bool oracle = work_of(d) <= kWorkBudget;
        const uint8_t of = decode_short_options(f, dc.opt);
        if ((of & 32) == 0) dc.opt.causal = Causal::kBottomRight;  // mostly a decode / prefill step
        dc.want_weights = of & 64;
        dc.want_lse = of & 128;
        if (dc.tame && dc.opt.scale && !(std::fabs(*dc.opt.scale) <= 1e3)) dc.tame = false;
        dc.q.init(dc.dtype, {d.B, d.Hq, d.Nq, d.Dk}, Role::kUnitLast, true, decode_layout(f, fancy));
        fill_values(dc.q, rng, sigma, 0);
        if (!base.tame) plant_specials(f, {&dc.q, &dc.q, &dc.q});
        dc.out_ls = decode_layout(f, fancy);
        dc.w_ls = decode_layout(f, fancy);
        dc.l_ls = decode_layout(f, fancy);
        log << " attention({";
        for (size_t b = 0; b < seqs.size(); ++b) log << (b ? ", " : "") << seqs[b];
        log << "}, Nq " << d.Nq << ");";
        if (unknown) {
          g_case = log.str() + "\n";
          Outs o = make_outs(dc, dc.want_weights, dc.want_lse, true);
          expect_error("KVCache::attention", [&] { cache.attention(dc.q.view(), seqs, o.outputs(), dc.opt); }, &o,
                       {std::to_string(unk)}, "an unknown sequence");
          break;
        }
        // The dense call: the tokens appended so far, gathered; keys past each length NaN.
        dc.k.init(dc.kv, {d.B, Hkv, d.Nk, Dk}, Role::kUnitLast, true, LayoutSpec::plain());
        dc.v.init(dc.kv, {d.B, Hkv, d.Nk, Dv}, Role::kUnitLast, true, LayoutSpec::plain());
        for (int64_t b = 0; b < d.B; ++b) {
          const Seq& q = model[seqs[b]];
          dc.seqlens.push_back(q.L);
          for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t j = 0; j < d.Nk; ++j) {
              for (int64_t e = 0; e < Dk; ++e) dc.k.set_flat(((b * Hkv + h) * d.Nk + j) * Dk + e, j < q.L ? q.k[(j * Hkv + h) * Dk + e] : kNaN);
              for (int64_t e = 0; e < Dv; ++e) dc.v.set_flat(((b * Hkv + h) * d.Nk + j) * Dv + e, j < q.L ? q.v[(j * Hkv + h) * Dv + e] : kNaN);
            }
        }
        dc.sl = std::make_shared<IndexTensor>(DType::kInt64, dc.seqlens, 1, 0);
        dc.sl_view = dc.sl->view();
        g_case = log.str() + "\n" + describe(dc);
        if (g_print) std::fprintf(stderr, "attention_fuzz: KVCache case\n%s", g_case.c_str());
        // Under ASan the cache's rows these sequences do not read are unaddressable during the call.
        std::vector<uint8_t> row_read(static_cast<size_t>(num_pages * ps), 0);
        for (int64_t s : seqs)
          for (int64_t j = 0; j < model[s].L; ++j) row_read[static_cast<size_t>(model[s].pages[j / ps] * ps + j % ps)] = 1;
        const auto attend = [&](const Outs& o) {
          Garbage g(0);
          for (const sdpa::TensorView& t : {cache.k_pages(), cache.v_pages()}) {
            std::vector<int64_t> offs;
            for (int64_t p = 0; p < num_pages; ++p)
              for (int64_t r = 0; r < ps; ++r)
                if (!row_read[static_cast<size_t>(p * ps + r)])
                  for (int64_t h = 0; h < Hkv; ++h)
                    for (int64_t e = 0; e < t.shape[3]; ++e) offs.push_back(p * t.strides[0] + r * t.strides[1] + h * t.strides[2] + e);
            std::sort(offs.begin(), offs.end());
            g.fence(static_cast<std::byte*>(t.data), offs, esize(t.dtype));
          }
          expect_no_throw("KVCache::attention", [&] { cache.attention(dc.q.view(), seqs, o.outputs(), dc.opt); });
        };
        Outs o = make_outs(dc, dc.want_weights, dc.want_lse, true);
        attend(o);
        check_outs_written(o);
        {
          sdpa::set_num_threads(3 - base.threads);
          Outs o2 = make_outs(dc, dc.want_weights, dc.want_lse, false);
          attend(o2);
          sdpa::set_num_threads(base.threads);
          std::string why;
          check(o.bitwise_equal(o2, why), "repeatable", [&] { return "two identical KVCache::attention calls (threads 1 and 2) differ: " + why; });
        }
        Outs full = make_outs(dc, true, true, false);
        attend(full);
        std::string why;
        check(o.bitwise_equal(full, why), "weights_invariant", [&] { return "the same KVCache::attention call with weights and lse requested differs: " + why; });
        check_paged_dense(dc, full, "KVCache::attention", oracle);
        break;
      }
      case 7: {  // free, or a call with an unknown sequence (free, length, pages): an Error
        const uint8_t fb = f.ConsumeIntegral<uint8_t>();
        if (!unknown) {
          log << " free(" << pick_live << ");";
          g_case = log.str();
          expect_no_throw("KVCache::free", [&] { cache.free(pick_live); });
          for (int32_t p : model[pick_live].pages) free_pages.insert(p);
          model[pick_live] = Seq{};
          state_matches("free");
          break;
        }
        const int64_t s = unknown_id(fb);
        log << " " << (fb & 0x30 ? "length(" : "free(") << s << ") (unknown);";
        g_case = log.str();
        if (fb & 0x30) expect_error("KVCache::length", [&] { (void)cache.length(s); }, nullptr, {std::to_string(s)}, "an unknown sequence");
        else expect_error("KVCache::free", [&] { cache.free(s); }, nullptr, {std::to_string(s)}, "an unknown sequence");
        state_matches("a failed call");
        break;
      }
    }
  }
}

}  // namespace

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
  // The ext prefix (see the top of this file): 16-bit storage and the kernel-path cap.
  uint8_t ext = 0;
  if (size >= 3 && std::memcmp(data, kExtMagic, 2) == 0) {
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
