// attention_fuzz's shared state, case and declarations (see README.md here for the byte format,
// the checks and how to add a mode). Each .cc here holds one part of the harness; this header
// declares what more than one of them uses. The oracle's rules that the tests share (the
// causal / window rule, the 16-bit formats, eps, the guard patterns) are tests/oracle/oracle.h;
// the tolerance rule is tests/oracle/tolerance.h.
#pragma once

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
#include "oracle.h"
#include "sdpa/attention.h"
#include "sdpa/kv_cache.h"
#include "tensor.h"
#include "tolerance.h"

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

namespace sdpa_fuzz {

using sdpa::Backend;
using sdpa::Causal;

// ---- The input's global state (harness.cc defines it; main.cc sets it per input) ----

extern std::set<std::string> g_known, g_skip;
extern std::map<std::string, uint64_t> g_known_hits;
extern bool g_avx2;  // this input caps Highway's dispatch at AVX2
extern sdpa::KernelPath g_path_cap;  // this input's set_max_kernel_path (kAmxBf16: no cap)
extern int g_storage;  // ext bits 0-1: 0 float32 / float64, 1 all 16-bit, 2 float32 q over 16-bit k, v, 3 as 1, float32 mask
constexpr unsigned char kExtMagic[2] = {0xb6, 0x16};  // an input starting with these has an `ext` byte next
// The same prefix with the magic's second byte 0x17: every call of the input gets
// Options::precision = kFast (the rest decodes as after kExtMagic; fast.cc adds kFast's own
// checks). No committed seed or finding started with b6 17 before.
constexpr unsigned char kExtMagicFast[2] = {0xb6, 0x17};
extern sdpa::Precision g_precision;  // kFast after kExtMagicFast, else kExact
// ext bit 4 (kExtSeqlens): Inputs::seqlens_k; two more prefix bytes follow ext: `sk` (bits 0-2
// how lengths are drawn, bit 3 int32, bits 4-5 stride, bits 6-7 and sk_seed's top bits: an
// invalid seqlens_k) and `sk_seed` (the lengths' and the garbage's PRNG seed).
// ext bit 5 (kExtVarlen): the input is an attention_varlen (+ backward) call (run_varlen).
// ext & kExtModeBits == kExtPaged: an attention_paged call (run_paged); == kExtKVCache: a KVCache
// script (run_kvcache). Only with bits 4 and 5 clear: an earlier seed (seed53, ext 0x5f) set bit 6
// beside bit 4, and stays a dense call with seqlens_k.
constexpr uint8_t kExtSeqlens = 0x10, kExtVarlen = 0x20, kExtPaged = 0x40, kExtKVCache = 0x80, kExtModeBits = 0xf0;
extern bool g_seqlens;
extern uint8_t g_sk, g_sk_seed;
extern bool g_varlen;
// ext bits 5-7 equal to 0b110 ((ext & kExtModsMask) == kExtModifiers: 0xc0-0xdf, with bit 4 also
// seqlens_k): a dense call whose Options carry score modifiers (softcap and its order, ALiBi slopes,
// sinks; Gradients::dsinks on backward calls). Two more prefix bytes follow ext (after sk and
// sk_seed when bit 4 is set): `md` (what: see decode_modifiers) and `md_seed` (the values' PRNG
// seed, dtypes, layouts). No committed seed or finding had bits 6 and 7 set without bit 5.
constexpr uint8_t kExtModifiers = 0xc0, kExtModsMask = 0xe0;
extern bool g_mods;
extern uint8_t g_md, g_md_seed;
// ext bits 4-7 exactly 0x90 ((ext & kExtModeBits) == kExtBlocks; ext 0x90-0x9f, the storage and
// path-cap bits as always): a dense call with Options::block_mask. Two more prefix bytes follow
// ext: `bm` (what: see decode_block_mask; its bit 6 adds seqlens_k, whose sk and sk_seed follow
// bm_seed, and its bit 7 adds score modifiers, whose md and md_seed follow those) and `bm_seed`
// (the block mask's PRNG seed; top three bits 0b111: an invalid block mask, BadBlocks). No
// committed seed or finding had ext 0x90-0x9f (before, a dense call with seqlens_k, as 0x10-0x1f).
constexpr uint8_t kExtBlocks = 0x90;
constexpr uint8_t kBmSeqlens = 0x40, kBmMods = 0x80;
extern bool g_blocks;
extern uint8_t g_bm, g_bm_seed;
extern bool g_varlen_blocks;  // BadBlocks::kVarlen: the input is an attention_varlen call with a block mask

extern std::string g_case;  // the description of the current case, printed on failure

extern const uint8_t* g_data;  // the current input, saved for KNOWN failures (SDPA_FUZZ_KNOWN_DIR)
extern size_t g_size;
extern const char* g_known_dir;

extern std::map<std::string, uint64_t> g_evaluated;  // SDPA_FUZZ_STATS=1: how often each check ran
extern bool g_stats;
extern bool g_print;  // SDPA_FUZZ_PRINT=1: print every decoded case (to check what a seed decodes to)
extern uint8_t g_mode;  // the mode byte (the input's last)

struct CheckFailed {};  // thrown by a KNOWN check's failure: abandons the rest of this input

// ---- Checks (harness.cc) ----

// A failed check named `name` prints message() and the case, then aborts; a KNOWN one (main.cc)
// is counted and throws CheckFailed instead. Every check's name is listed in README.md here.
void check(bool ok, const char* name, const std::function<std::string()>& message);
// Runs fn (the call `call`): true, with its message in `what`, when it throws sdpa::Error; any
// other exception fails the check other_exception.
bool throws_sdpa_error(const char* call, const std::function<void()>& fn, std::string& what);
std::string num(double x);
bool same_bits(double a, double b);
bool same_value(double a, double b);
bool skipping(const char* what);  // whether SDPA_FUZZ_SKIP (main.cc) lists this input class

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

// What an invalid seqlens_k (sk bits 6-7 with sk_seed bits 5-7) breaks.
enum class BadSeqlens : uint8_t { kNone, kNegative, kTooLong, kShapeB1, kRank, kDtype, kNull, kShapeSmall };
const char* const kBadSeqlensNames[] = {"none", "negative length", "length > Nk", "shape (B + 1,)", "rank != 1",
                                        "dtype not int32/int64", "null data", "shape (B - 1,) or (0,)"};

// ---- The case ----

struct Dims {
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, Dk = 1, Dv = 1;
  int64_t group() const { return Hkv > 0 ? Hq / Hkv : 1; }
};

inline std::vector<int64_t> last_dims(int rank, std::vector<int64_t> full) { return {full.end() - rank, full.end()}; }

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
  DType compute() const { return sdpa_oracle::compute_dtype(dtype); }  // weights', lse's and the arithmetic's
  bool lowp() const { return is16(dtype) || is16(kv); }
  // A dtype dv may not have: neither v's (kv) nor the compute type (float32 <-> float64, or the
  // other 16-bit dtype).
  DType bad_dv_dtype() const {
    return kv == DType::kFloat32 ? DType::kFloat64 : kv == DType::kFloat64 ? DType::kFloat32
           : kv == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
  }
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
    return opt.alibi_slopes ? sdpa_oracle::alibi_bias(slope(b, h), d.Nq, keys_of(b), i, j) : 0.0;
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
  double scale() const { return sdpa_oracle::scale_of(opt, d.Dk); }
};

// ---- Decoding ----

template <size_t N>
int64_t pick(FuzzedDataProvider& f, const int64_t (&menu)[N]) {
  return menu[f.ConsumeIntegralInRange<size_t>(0, N - 1)];
}

constexpr int64_t kWorkBudget = 1 << 18;
// The work of a paged or KVCache input: each valid call runs 3 paged calls, the dense one,
// kReference and kNaive, and the oracle over B · Hq · Nq · max_pages · page_size scores; a quarter
// of a dense call's budget keeps these inputs no slower than the others.
constexpr int64_t kPagedWorkBudget = kWorkBudget / 4;

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

enum class Cls : uint8_t { kBlocked, kNaN, kPosInf, kNegInf, kFinite, kAmbig };

struct Score {
  Cls cls = Cls::kBlocked;
  long double s = 0;    // for kFinite
  long double err = 0;  // bound on |computed - s|
};

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

struct Vals { std::vector<double> out, weights, lse; };

// Failures within kNearFactor times the tolerance are reported as "tolerance_near" (the rule's
// maximum error is a noisy statistic on the fuzzer's tiny cases: see FINDINGS.md), beyond it as
// "tolerance".
constexpr double kNearFactor = 4;

// The mode byte's bits that run check_stats (dense calls), both set: a quarter of the inputs (it
// about doubles an input's time; CI's 2,500 inputs must fit their 135 s).
constexpr uint8_t kModeStats = 0xa0;

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

// g[3]: dsinks (empty without).
struct GradVals { std::vector<double> g[4]; };

const char* const kGradNames[4] = {"dq", "dk", "dv", "dsinks"};

// ---- Functions more than one file uses, by the file that defines them ----

// harness.cc: the case's description
BadBlocks bad_blocks_of(uint8_t bm_seed);
const char* backend_name(Backend b);
const char* path_name(sdpa::KernelPath p);
std::string dtype_long(DType t);
std::string describe(const Case& c);
uint64_t input_seed();  // an FNV-1a hash of the whole input: draws that read no input byte

// decode.cc: decoding the input into a case
LayoutSpec decode_layout(FuzzedDataProvider& f, bool fancy);
double special(uint8_t i, DType dt);
void fill_values(Tensor& t, std::mt19937_64& rng, double sigma, int zeros_mode);
int64_t work_of(const Dims& d);
LayoutSpec block_layout(std::mt19937_64& rng);
int64_t ceil_div(int64_t n, int64_t block);
std::shared_ptr<BlockMask> make_block_mask(std::mt19937_64& rng, int size_kind, int density_kind, int lead_kind, int rank, int64_t B,
                                           int64_t Hq, int64_t Nq, int64_t Nk, int64_t max_elems = INT64_MAX);
bool decode_flags(FuzzedDataProvider& f, Case& c);
bool decode(FuzzedDataProvider& f, Case& c, Invalid& invalid);
uint8_t decode_short_options(FuzzedDataProvider& f, sdpa::Options& o);
void plant_specials(FuzzedDataProvider& f, const std::array<Tensor*, 3>& ts);

// classify.cc: the edge-semantics oracle: each score's IEEE class and rounding bound
double mask_bias(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j);
bool allowed(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j);
double score_magnitude(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j);
double max_score_magnitude(const Case& c);
Score raw_score(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j);
Score classify(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j, bool capped = true);
std::vector<uint8_t> keep_mask(const Case& c);

// checks.cc: forward calls and the edge-semantics checks
Outs make_outs(const Case& c, bool weights, bool lse, bool fancy_layout);
void run_forward(const Case&, const sdpa::Inputs& in, const Outs& o, const sdpa::Options& opt);
void check_outs_written(const Outs& o);
// `finite_rows` (if given): per row (b, h, i), 1 where every allowed score is finite or -inf, one
// at least finite, none ambiguous (the rows fast_stochastic judges).
void check_edge_semantics(const Case& c, const Outs& o, std::vector<uint8_t>* finite_rows = nullptr);
void check_kernel_path(const Case& c, sdpa::KernelPath p, const char* call);

// tolerance.cc: the tolerance rules (forward and backward) and the gradients' buffers
Vals vals(const Outs& o);
Case converted(const Case& c, DType dt);
void check_tolerance(const Case& c, const Outs& got);
Grads make_grads(const Case& c, const LayoutSpec& ls, bool ds_fancy = false);
GradVals gvals(const Grads& g);
void run_backward(const Case&, const sdpa::Inputs& in, const Tensor& out, const Tensor& lse, const Tensor& dout,
                  const Grads& g, const sdpa::Options& opt);
bool grads_bitwise(const Grads& a, const Grads& b, std::string& why);
void check_bwd_tolerance(const Case& c, const Tensor& out, const Tensor& lse, const Tensor& dout, const Grads& got);

// fast.cc: Options::precision kFast's own checks (kExtMagicFast)
bool rounds_weights(const Case& c);
bool precision_ignored(const Case& c);
void check_fast_forward(const Case& c, const Outs& full, const std::vector<uint8_t>& finite_rows);
void check_fast_backward(const Case& c, const Tensor& out, const Tensor& lse, const Tensor& dout, const Grads& got);

// stats.cc: stats mode (Outputs::stats and Outputs::scores)
void check_stats(Case& c, const Outs& own);

// huge.cc: mode < 12: empty views with huge dims
void run_huge(FuzzedDataProvider& f);

// invalid.cc: invalid arguments: error_expected, error_untouched, error_names
void apply_invalid(Case& c, Invalid inv, sdpa::Inputs& in, sdpa::Outputs& outs, bool& must_throw);
void run_bad_seqlens(Case& c, bool bad_scale);
void run_bad_modifiers(Case& c, bool bad_scale);
void check_error_names(const std::string& what, const char* name, const char* call, const char* what_bad);
void run_bad_blocks(Case& c, bool bad_scale);

// dense.cc: one dense attention (+ backward) call: run_case
std::vector<int64_t> unread_offsets(const Case& c, const std::vector<uint8_t>& unread, const Tensor& t, int64_t cols);
void run_case(FuzzedDataProvider& f);

// varlen.cc: attention_varlen (ext bit 5)
void run_varlen(FuzzedDataProvider& f);

// paged.cc: attention_paged (ext 0x40)
void check_paged_dense(const Case& c, const Outs& full, const char* call, bool oracle = true);
std::vector<int64_t> unread_offsets(const Tensor& pool, const std::vector<uint8_t>& read);
void expect_error(const char* call, const std::function<void()>& fn, const Outs* o, const std::vector<std::string>& want,
                  const std::string& what_bad);
void run_paged(FuzzedDataProvider& f);

// kvcache.cc: KVCache scripts (ext 0x80)
void run_kvcache(FuzzedDataProvider& f);

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
        else x = sdpa_oracle::half_value(sdpa_oracle::half_format(t.dtype()), static_cast<uint16_t>(rng_()));
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

}  // namespace sdpa_fuzz
