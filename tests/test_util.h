// Helpers shared by the attention tests (and by the fast-kernel tests to come): guarded strided
// tensors, seeded random fills, an independent float64 oracle, the tolerance rule and the case
// table of the sweep.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "oracle.h"
#include "sdpa/attention.h"
#include "tolerance.h"

namespace sdpa {
// GoogleTest prints parameters in test names: a backend by its name, not its byte.
void PrintTo(Backend b, std::ostream* os);
}  // namespace sdpa

namespace sdpa_test {

using sdpa::DType;

inline constexpr DType kF32 = DType::kFloat32;
inline constexpr DType kF64 = DType::kFloat64;
inline constexpr DType kBF16 = DType::kBFloat16;
inline constexpr DType kF16 = DType::kFloat16;
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// How a GuardedTensor lays out its elements. Every layout surrounds them with guard values.
enum class Layout {
  kContiguous,  // C order, data 64-byte aligned
  kPadded,      // C order, 3 guard elements after every row and every outer slice; the data
                // starts one element past a 64-byte boundary (misaligned for SIMD)
  kPermuted,    // as kPadded, but H and N are swapped in memory (a (B, N, H, D) buffer, like a
                // transposed PyTorch tensor) and N runs backwards (negative stride)
};

// An owning tensor whose elements live inside a larger buffer filled with a sentinel (a NaN with
// a payload; 0xA5 for bool). Outputs start as sentinels too, so unwritten elements show, and
// guards_intact() catches any write outside the elements. Inputs' guards being NaN also makes
// a kernel that reads past a row produce NaN.
class GuardedTensor {
 public:
  // unit_last_stride = false gives non-contiguous layouts a last-dim stride of 2 (allowed for
  // mask, weights and lse, which may have any strides).
  GuardedTensor(DType dtype, std::vector<int64_t> shape, Layout layout = Layout::kContiguous,
                bool unit_last_stride = true);

  sdpa::TensorView view() const;
  DType dtype() const { return dtype_; }
  Layout layout() const { return layout_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const;

  // Element `flat` in C order, read or written as double (bool: 0 / 1, any non-zero reads 1).
  double get(int64_t flat) const;
  void set(int64_t flat, double value);
  std::vector<double> values() const;  // all elements in C order
  void set_values(const std::vector<double>& values);
  // Element (b, h, i, j): the tensor's dims right-aligned to these four; a dim of extent 1
  // broadcasts (index 0), as NumPy does. Indices of dims the tensor lacks are ignored.
  double at(int64_t b, int64_t h, int64_t i, int64_t j) const;

  // The same values in another dtype and/or layout.
  GuardedTensor converted(DType dtype, Layout layout) const;

  testing::AssertionResult guards_intact() const;  // everything outside the elements unchanged
  testing::AssertionResult untouched() const;      // the whole buffer unchanged, elements too

 private:
  int64_t element_offset(int64_t flat) const;  // into the buffer, in elements
  bool holds_sentinel(int64_t offset) const;

  DType dtype_;
  std::vector<int64_t> shape_, strides_;
  Layout layout_;
  bool unit_last_stride_;
  int64_t size_ = 0;   // buffer size in elements
  int64_t start_ = 0;  // offset of the element at index (0, ..., 0)
  std::unique_ptr<std::byte[], void (*)(void*)> buffer_;
  std::vector<bool> is_element_;
};

// A tensor with the given values in C order.
GuardedTensor tensor(DType dtype, std::vector<int64_t> shape, const std::vector<double>& values,
                     Layout layout = Layout::kContiguous);

// Seeded random fills (std::mt19937, so a failing case reproduces).
void fill_normal(GuardedTensor& t, std::mt19937& rng, double stddev = 1.0);
void fill_uniform(GuardedTensor& t, std::mt19937& rng, double lo, double hi);
// Each entry attends with probability `density`; each row (last dim) is then blocked entirely
// with probability `empty_row_probability`. Bool masks get 1 / 0; float masks get a normal
// value / -inf (an additive bias).
void fill_mask(GuardedTensor& t, std::mt19937& rng, double density, double empty_row_probability);

// The inputs of one call, and its outputs.
struct Tensors {
  GuardedTensor q, k, v;
  std::optional<GuardedTensor> mask;
  // Inputs::seqlens_k (empty: not given), passed as an int64 view of this vector.
  std::vector<int64_t> seqlens_k = {};
  sdpa::Inputs inputs() const;
  Tensors converted(DType dtype) const;  // q, k, v and a float mask in another dtype
};

// q, k, v of the given shapes with normal values (fill_normal, seeded).
Tensors random_qkv(DType dtype, std::vector<int64_t> q, std::vector<int64_t> k, std::vector<int64_t> v,
                   uint32_t seed);

struct Outs {
  GuardedTensor out;
  std::optional<GuardedTensor> weights, lse;
  sdpa::Outputs outputs() const;
  testing::AssertionResult guards_intact() const;
};

// Allocates out (and, when with_extras, weights and lse) for t's shapes in `layout`, calls
// sdpa::attention and returns them.
Outs run(const Tensors& t, const sdpa::Options& options, Layout layout = Layout::kContiguous,
         bool with_extras = true);

// Results as doubles in C order; weights / lse empty when absent.
struct Values {
  std::vector<double> out, weights, lse;
};
Values values(const Outs& outs);
// Failure at the first NaN in any output present.
testing::AssertionResult no_nan(const Values& v);

// The oracle's rules (tests/oracle/oracle.h, shared with the fuzzers): whether causal and window
// let query i see key j, the dtypes' eps and rounding, the compute type.
using sdpa_oracle::compute_dtype;
using sdpa_oracle::eps;
using sdpa_oracle::key_allowed;
using sdpa_oracle::round_to;
// The same for batch b of t: Nk is that sequence's own length when t has seqlens_k (the header:
// keys past it do not exist, and causal and window align to it).
bool key_allowed(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t i, int64_t j);


const char* backend_name(sdpa::Backend b);  // "Auto", "Flash", "Naive", "Reference"

// The problem's dims, read from the shapes the way the header defines them.
struct Dims {
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv, group;
};
Dims dims_of(const Tensors& t);

// The additive bias the mask puts on score (b, h, i, j): 0 / -inf for bool, the value for float.
double mask_bias(const Tensors& t, int64_t b, int64_t h, int64_t i, int64_t j);

using sdpa_oracle::max_abs_finite;  // over the finite entries

// The size of the terms that make up score (b, h, i, j): |scale| · Σ_d |q_d k_d| + |bias| (0 for
// a blocked key). A score is only accurate to about eps times this, however it is summed, and
// so are the weights and lse computed from it: the tolerance rules' score-rounding term.
// x's elements (b, h, n, 0 .. D - 1) for b < B, h < H, n < N (at()'s broadcasting), as doubles in
// that C order: for loops that would otherwise read an element through at() many times.
std::vector<double> widened(const GuardedTensor& x, int64_t B, int64_t H, int64_t N, int64_t D);

// ScoreMagnitudes reads q and k once (as doubles, broadcast to (B, Hq, Nq, Dk) and (B, Hkv, Nk,
// Dk)) for callers that visit every (i, j): reading the elements per pair was most of a 16-bit
// sweep case's time.
class ScoreMagnitudes {
 public:
  ScoreMagnitudes(const Tensors& t, const sdpa::Options& options);
  double operator()(int64_t b, int64_t h, int64_t i, int64_t j) const;

 private:
  const Tensors& t_;
  sdpa::Options options_;
  int64_t Hq_, Hkv_, Nq_, Nk_, Dk_, group_;
  std::vector<double> q_, k_;
};
double score_magnitude(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t h, int64_t i, int64_t j);
double max_score_magnitude(const Tensors& t, const sdpa::Options& options);  // over every (b, h, i, j)

// Element (row, col) of a float32/float64 view of rank 1 (row ignored) or 2 (a first dim of 1
// broadcasts): Options::alibi_slopes and sinks.
double view_value(const sdpa::TensorView& v, int64_t row, int64_t col);
// ALiBi's bias -slope(b, h) · |i + (L - Nq) - j| (0 without Options::alibi_slopes).
double alibi_bias(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t h, int64_t i, int64_t j);
// The score of (b, h, i, j) from its scaled dot product x under Options' softcap, ALiBi slopes
// and the mask, in the header's order (an allowed key; -inf where the mask blocks it).
double modified_score(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t h, int64_t i, int64_t j,
                      double x);

// Attention computed the obvious way in float64 straight from the header's contract,
// independently of src/ (its own indexing, broadcasting, causal and window rules).
Values oracle(const Tensors& t, const sdpa::Options& options);

// Element-wise |got - want| <= tol; infinities must match exactly; NaN always fails
// (sdpa_oracle::compare, whose message a failure carries).
testing::AssertionResult all_close(const char* what, const std::vector<double>& got,
                                   const std::vector<double>& want, double tol);
// Runs `call` and expects it to throw sdpa::Error with every one of `substrings` in its message
// (non-fatal failures: one if nothing is thrown, one per missing substring).
void expect_sdpa_error(const std::function<void()>& call, const std::vector<std::string>& substrings);
// Bit-for-bit equality of every output present in both.
testing::AssertionResult bitwise_equal(const Outs& a, const Outs& b);

// The tolerance rule: `got` (computed from t with `options`, any backend) against kReference on
// the same inputs (and the same dropout_p and seed), per output, with tol = 2 * (max error of
// kNaive) + floor: oracle/tolerance.h states it.
testing::AssertionResult matches_reference(const Tensors& t, const sdpa::Options& options,
                                           const Outs& got);
// The same in two steps, for a case checked on several paths: kReference's values and each
// output's tolerance, computed once; then any number of results against them.
struct ForwardExpected {
  Values ref;
  sdpa_oracle::ForwardTolerance tol;
};
testing::AssertionResult expected_forward(const Tensors& t, const sdpa::Options& options, ForwardExpected& e);
testing::AssertionResult matches(const ForwardExpected& e, const Outs& got);

// Exact structure, independent of the kernel's arithmetic: every weight that causal, window or
// mask blocks is exactly 0; a row with nothing allowed has out exactly 0 and lse -inf.
testing::AssertionResult blocked_are_exact(const Tensors& t, const sdpa::Options& options,
                                           const Outs& got);

// ---- The case table of the sweep (ggml test-backend-ops style) ----

enum class MaskKind { kNone, kBool, kAdditive };
enum class MaskShape {
  kFull,      // the scores' shape, e.g. (B, Hq, Nq, Nk)
  kQueryKey,  // (Nq, Nk), shared by batch and heads
  kHeadKey,   // (1, Hq, 1, Nk) in rank 4, (Hq, 1, Nk) in rank 3, (1, Nk) in rank 2
  kKey,       // (Nk,): a key-padding mask
};

// Keys [begin, end) blocked by the mask (bool false, additive -inf) on top of its random fill:
// in every row of a mask without a query dim (kHeadKey, kKey), in query rows i < rows (every
// row when rows < 0) of one with (kFull, kQueryKey). E.g. {128, 256} blocks a whole key tile.
struct KeyBlock {
  int64_t begin = 0, end = 0, rows = -1;
};

struct Case {
  std::string name = "";  // a valid GoogleTest name, set by sweep_cases()
  int rank = 4;      // 2 drops B and H, 3 drops B
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, Dk = 1, Dv = 1;
  DType dtype = DType::kFloat32;
  MaskKind mask = MaskKind::kNone;
  MaskShape mask_shape = MaskShape::kFull;
  sdpa::Causal causal = sdpa::Causal::kNone;
  sdpa::Window window = {};
  std::optional<double> scale = std::nullopt;
  Layout layout = Layout::kContiguous;  // of every input and output
  KeyBlock blocked = {};                // needs a mask
};

std::vector<Case> sweep_cases();
// Random inputs for the case: q, k, v normal; masks with density 0.7 and, when they have 8
// rows or more, 10% of rows fully blocked; then c.blocked.
// Seeded from the case name, so each case always sees the same data.
Tensors make_inputs(const Case& c);
sdpa::Options options(const Case& c, sdpa::Backend backend);
// B * Hq * Nq * Nk * (Dk + Dv): the multiply-adds of one materialising call.
int64_t work(const Case& c);
void PrintTo(const Case& c, std::ostream* os);  // GoogleTest prints the name, not the bytes

// ---- SIMD targets ----
//
// The fused kernel is compiled for every Highway target and dispatched to the best one the CPU
// has. The product's target machine has AVX2 but no AVX-512, so on a machine with AVX-512 the
// sweeps run a second time with AVX-512 disabled.

// While alive, Highway's dispatch may pick nothing better than AVX2 (hwy::DisableTargets of the
// AVX-512 targets, as `sdpa bench --no-avx512` does); the destructor enables every target again.
class Avx2Only {
 public:
  Avx2Only();
  ~Avx2Only();
  Avx2Only(const Avx2Only&) = delete;
  Avx2Only& operator=(const Avx2Only&) = delete;
};
// Why an AVX2-only pass would add nothing here ("" when it is worth running): the CPU lacks
// AVX2, or lacks AVX-512 (then the normal pass already runs on AVX2 or less).
std::string avx2_pass_skip_reason();
// While alive, the kernels may use no instruction path better than `max`
// (sdpa::set_max_kernel_path); the destructor lifts the cap (kAmxBf16, the default).
class KernelPathCap {
 public:
  explicit KernelPathCap(sdpa::KernelPath max);
  ~KernelPathCap();
  KernelPathCap(const KernelPathCap&) = delete;
  KernelPathCap& operator=(const KernelPathCap&) = delete;
};
// Why a pass capped at kAvx512Bf16 would add nothing here ("" when it is worth running): the
// CPU lacks AVX512_BF16 (then nothing uses it), or lacks AMX (then the normal pass uses it).
std::string bf16_dot_pass_skip_reason();
// The bfloat16 cases of the sweep.
std::vector<Case> bf16_sweep_cases();

// The target the last HWY_DYNAMIC_DISPATCH chose (Highway's name for it, e.g. "AVX2"; "none"
// when nothing has been dispatched since the targets last changed).
std::string dispatched_target();

}  // namespace sdpa_test
