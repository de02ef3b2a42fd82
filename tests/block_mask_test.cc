// Block-sparse attention (Options::block_mask, block_q, block_k): the header's picture; every
// backend, dtype and SIMD path against the same call with the equivalent element mask (written
// out here from the header's rule, independently of src/), bitwise (a zero's sign included),
// forward and backward, and within the tolerance rule of kReference; the tiles it skips provably
// unread (their K/V rows on pages that cannot be read); and errors that name the argument.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

constexpr Backend kBackends[] = {Backend::kAuto, Backend::kFlash, Backend::kNaive, Backend::kReference};

int64_t blocks(int64_t n, int64_t size) { return (n + size - 1) / size; }

enum class MaskKind { kNone, kBool, kFloat };

struct Case {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv, bq, bk;
  std::vector<int64_t> lead;  // the block mask's leading dims: {}, {Hq} or {B, 1}
  double density;             // of allowed blocks
  Causal causal = Causal::kNone;
  MaskKind mask = MaskKind::kNone;
  std::vector<int64_t> mask_shape = {};
  sdpa::Window window = {};
  double dropout = 0;
  bool mods = false;  // softcap, ALiBi and sinks too
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

const Case kCases[] = {
    {"tiles_128", 1, 2, 2, 150, 517, 32, 32, 128, 128, {}, 0.5},
    {"small_blocks_gqa_causal_bool", 2, 4, 2, 97, 600, 16, 24, 16, 40, {4}, 0.4, Causal::kBottomRight,
     MaskKind::kBool, {2, 1, 97, 600}},
    {"decode_float_mask", 2, 8, 2, 1, 1025, 64, 64, 1, 64, {2, 1}, 0.3, Causal::kNone, MaskKind::kFloat, {1025}},
    {"top_left_window_dropout", 1, 2, 1, 200, 160, 16, 16, 32, 128, {}, 0.6, Causal::kTopLeft, MaskKind::kNone,
     {}, {50, 10}, 0.2},
    {"element_blocks_modifiers", 2, 2, 1, 33, 17, 8, 5, 1, 1, {2, 1}, 0.5, Causal::kNone, MaskKind::kFloat,
     {33, 17}, {}, 0, true},
    {"empty_rows", 1, 3, 3, 64, 300, 32, 32, 16, 256, {3}, 0.15, Causal::kBottomRight},
};

struct Built {
  Tensors t, expanded;  // expanded: the same call with the block mask written into an element mask
  GuardedTensor bm;
  std::optional<GuardedTensor> slopes, sinks;
  sdpa::Options o;      // with the block mask
  sdpa::Options plain;  // without it (for `expanded`)
};

// The case's float64 tensors, a random block mask of the given density (in a padded, misaligned
// layout), and the element mask that says the same: the header's rule, block (i / bq, j / bk)
// of the (b, h) the mask's leading dims broadcast to, on top of the case's own mask.
Built build(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> bm_shape = c.lead;
  bm_shape.push_back(blocks(c.Nq, c.bq));
  bm_shape.push_back(blocks(c.Nk, c.bk));
  Built b{{GuardedTensor(kF64, {c.B, c.Hq, c.Nq, c.Dk}), GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.Dk}),
           GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.Dv}), std::nullopt},
          {GuardedTensor(kF64, {1}), GuardedTensor(kF64, {1}), GuardedTensor(kF64, {1}), std::nullopt},
          GuardedTensor(DType::kBool, bm_shape, Layout::kPadded, /*unit_last_stride=*/false),
          std::nullopt,
          std::nullopt,
          {},
          {}};
  fill_normal(b.t.q, rng, 1.5);
  fill_normal(b.t.k, rng, 1.5);
  fill_normal(b.t.v, rng);
  std::bernoulli_distribution keep(c.density);
  for (int64_t e = 0; e < b.bm.numel(); ++e) b.bm.set(e, keep(rng) ? 1 : 0);
  if (c.mask != MaskKind::kNone) {
    b.t.mask = GuardedTensor(c.mask == MaskKind::kBool ? DType::kBool : kF64, c.mask_shape);
    fill_mask(*b.t.mask, rng, 0.8, 0.05);
  }
  b.plain.causal = c.causal;
  b.plain.window = c.window;
  if (c.dropout > 0) {
    b.plain.dropout_p = c.dropout;
    b.plain.seed = 99;
  }
  if (c.mods) {
    std::vector<double> slopes, sinks;
    for (int64_t h = 0; h < c.Hq; ++h) {
      slopes.push_back(std::exp2(-1.0 - static_cast<double>(h)));
      sinks.push_back(0.25 * static_cast<double>(h));
    }
    b.slopes = tensor(kF32, {c.Hq}, slopes);
    b.sinks = tensor(kF64, {c.Hq}, sinks);
    b.plain.softcap = 2.0;
    b.plain.alibi_slopes = b.slopes->view();
    b.plain.sinks = b.sinks->view();
  }
  b.o = b.plain;
  b.o.block_mask = b.bm.view();
  b.o.block_q = c.bq;
  b.o.block_k = c.bk;

  // The equivalent element mask, (B, Hq, Nq, Nk): bool, or float keeping the case's biases.
  const bool float_mask = c.mask == MaskKind::kFloat;
  GuardedTensor full(float_mask ? kF64 : DType::kBool, {c.B, c.Hq, c.Nq, c.Nk});
  int64_t at = 0;
  for (int64_t bb = 0; bb < c.B; ++bb)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Nq; ++i)
        for (int64_t j = 0; j < c.Nk; ++j, ++at) {
          const bool block = b.bm.at(bb, h, i / c.bq, j / c.bk) != 0;
          const double bias = b.t.mask ? mask_bias(b.t, bb, h, i, j) : 0.0;
          if (float_mask) {
            full.set(at, block ? bias : -kInf);
          } else {
            full.set(at, block && bias == 0.0 ? 1 : 0);
          }
        }
  b.expanded = Tensors{b.t.q.converted(kF64, Layout::kContiguous), b.t.k.converted(kF64, Layout::kContiguous),
                       b.t.v.converted(kF64, Layout::kContiguous), std::move(full)};
  return b;
}

TEST(BlockMask, ThePictureInTheHeader) {
  // Nq = 4, Nk = 6, block_q = 2, block_k = 3, block_mask = {{1, 0}, {1, 1}}.
  const char* picture[] = {"xxx...", "xxx...", "xxxxxx", "xxxxxx"};
  std::mt19937 rng(1);
  Tensors t{GuardedTensor(kF64, {4, 3}), GuardedTensor(kF64, {6, 3}), GuardedTensor(kF64, {6, 2}), std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  const GuardedTensor bm = tensor(DType::kBool, {2, 2}, {1, 0, 1, 1});
  for (Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    sdpa::Options o;
    o.backend = backend;
    o.block_mask = bm.view();
    o.block_q = 2;
    o.block_k = 3;
    const Values v = values(run(t, o));
    for (int64_t i = 0; i < 4; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < 6; ++j) {
        const double w = v.weights[static_cast<size_t>(i * 6 + j)];
        EXPECT_EQ(w > 0, picture[i][j] == 'x') << "weight (" << i << ", " << j << ") = " << w;
        sum += w;
      }
      EXPECT_NEAR(sum, 1.0, 1e-12);
    }
  }
}

class BlockSweep : public testing::TestWithParam<Case> {};

// Each backend gives bit for bit what it gives for the equivalent element mask (the fused
// kernels skip whole tiles, which changes no sum), in every dtype, with q, k, v permuted and
// outputs padded, on the best SIMD target and capped at AVX2; and that is kReference's answer
// within the tolerance rule, with blocked weights exactly 0.
TEST_P(BlockSweep, ForwardEqualsTheEquivalentElementMask) {
  const Case& c = GetParam();
  const Built b = build(c, 7);
  for (bool avx2 : {false, true}) {
    if (avx2 && !avx2_pass_skip_reason().empty()) continue;
    std::optional<Avx2Only> cap;
    if (avx2) cap.emplace();
    for (DType dtype : {kF32, kF64, kBF16, kF16}) {
      // float32: q, k and v permuted (negative strides); the others C order.
      const Layout in_layout = dtype == kF32 ? Layout::kPermuted : Layout::kContiguous;
      const auto laid = [&](const Tensors& x) {
        Tensors y = x.converted(dtype);
        for (GuardedTensor* g : {&y.q, &y.k, &y.v}) *g = g->converted(dtype, in_layout);
        return y;
      };
      const Tensors t = laid(b.t), e = laid(b.expanded);
      for (Backend backend : kBackends) {
        // kNaive and kReference do not dispatch on the SIMD target, nor widen 16-bit inputs
        // differently: once, in float32 and float64.
        const bool simple = backend == Backend::kNaive || backend == Backend::kReference;
        if (simple && (avx2 || dtype == kBF16 || dtype == kF16)) continue;
        SCOPED_TRACE(std::string(avx2 ? "AVX2 " : "") + backend_name(backend) + " dtype " +
                     std::to_string(static_cast<int>(dtype)));
        sdpa::Options o = b.o, plain = b.plain;
        o.backend = plain.backend = backend;
        const Layout layout = dtype == kF32 ? Layout::kContiguous : Layout::kPadded;
        const Outs got = run(t, o, layout), want = run(e, plain, layout);
        EXPECT_TRUE(got.guards_intact());
        EXPECT_TRUE(bitwise_equal(got, want));
        if (backend == Backend::kAuto) {
          EXPECT_TRUE(matches_reference(e, plain, got));
          EXPECT_TRUE(blocked_are_exact(e, plain, got));
        }
      }
    }
  }
  EXPECT_TRUE(b.bm.guards_intact());
}

// The backward too: dq, dk and dv bit for bit those of the element mask, for the fused
// backward (which skips tiles and rows the block mask blocks) and kReference.
TEST_P(BlockSweep, BackwardEqualsTheEquivalentElementMask) {
  const Case& c = GetParam();
  const Built b = build(c, 11);
  for (bool avx2 : {false, true}) {
    if (avx2 && !avx2_pass_skip_reason().empty()) continue;
    std::optional<Avx2Only> cap;
    if (avx2) cap.emplace();
    for (DType dtype : {kF32, kF64, kBF16}) {
      const Problem pb = make_problem(b.t.converted(dtype), b.o, Layout::kContiguous, 13);
      const Problem pe = make_problem(b.expanded.converted(dtype), b.plain, Layout::kContiguous, 13);
      for (Backend backend : {Backend::kAuto, Backend::kReference}) {
        if (backend == Backend::kReference && (avx2 || dtype == kBF16)) continue;  // as above
        SCOPED_TRACE(std::string(avx2 ? "AVX2 " : "") + backend_name(backend) + " dtype " +
                     std::to_string(static_cast<int>(dtype)));
        sdpa::Options o = b.o, plain = b.plain;
        o.backend = plain.backend = backend;
        const Grads got = backward(pb, o, Layout::kPadded), want = backward(pe, plain, Layout::kPadded);
        EXPECT_TRUE(got.guards_intact());
        EXPECT_TRUE(bitwise_equal(got, want));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, BlockSweep, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A zero's sign (issue 26 item 11, fuzz finding F22: fuzz/findings/block_equiv_zero_sign-1). The
// fused kernels skip what the block mask blocks for a whole block of keys (the backward: a row
// of the dk / dv pass, a tile of the dq pass; the forward: a tile of 128 keys), where the
// equivalent element mask's call adds its p = 0 and ds = 0 terms: +0 · x. A sum that underflowed
// to -0 (a tiny p or ds times a tiny negative value) stays -0 without them and becomes +0 with
// them (-0 + +0 = +0), so the kernels write a zero as +0 (the one place each output is written):
// then the two calls agree bit for bit, as the header promises. Rows 0 .. bq - 1 (block row 0)
// see every key; key 1 scores `lo` below the others, so its p (about e^-50) times the rows' tiny
// second columns of q and dout underflows: dk[1][1] and dv[1][1] are -0 before any other term.
// The rows of block rows 1 and 2 come later and see only keys from 35 on (their block mask row
// blocks every block that starts below 35), so the dk / dv pass skips them for key 1's block of
// keys (at most 32 keys), and with the element mask adds their +0 · (1, 1). float32 and float64,
// with and without a sink, no softcap and one before / after the bias, block sizes that do not
// divide Nq or Nk, every SIMD target and AVX2, kAuto and kReference.
TEST(BlockMask, ZerosHaveTheElementMasksSign) {
  constexpr int64_t Nk = 43, D = 2;
  for (const DType dtype : {kF32, kF64}) {
    // Normal in both dtypes, and e^-50 times it underflows to a signed zero.
    const double tiny = dtype == kF32 ? 1e-30 : 1e-305;
    for (bool sinks : {false, true}) {
      for (int cap : {0, 1, 2}) {  // none, kBeforeBias, kAfterBias (60 · tanh(-72 / 60) = -50)
        for (const auto& [bq, bk] : {std::pair<int64_t, int64_t>{1, 5}, {2, 7}, {3, 4}}) {
          for (bool avx2 : {false, true}) {
            if (avx2 && !avx2_pass_skip_reason().empty()) continue;
            SCOPED_TRACE(std::string(dtype == kF32 ? "float32" : "float64") + (sinks ? ", sink" : "") + ", softcap " +
                         std::to_string(cap) + ", block_q " + std::to_string(bq) + ", block_k " + std::to_string(bk) +
                         (avx2 ? ", AVX2" : ""));
            std::optional<Avx2Only> only;
            if (avx2) only.emplace();
            const int64_t Nq = 2 * bq + 1, KB = blocks(Nk, bk);
            const double lo = cap == 0 ? -50.0 : -72.0;
            std::vector<double> q, k, v, dout, bm, full;
            for (int64_t i = 0; i < Nq; ++i) {
              q.insert(q.end(), {1.0, i < bq ? tiny : 1.0});
              dout.insert(dout.end(), {i < bq ? -1.0 : 1.0, i < bq ? -tiny : 1.0});
            }
            for (int64_t j = 0; j < Nk; ++j) {
              k.insert(k.end(), {j == 1 ? lo : 0.0, 0.0});
              v.insert(v.end(), {j == 1 ? 1.0 : 0.0, j == 1 ? 1.0 : 0.0});
            }
            for (int64_t qb = 0; qb < 3; ++qb)
              for (int64_t kb = 0; kb < KB; ++kb) bm.push_back(qb == 0 || kb * bk >= 35 ? 1 : 0);
            for (int64_t i = 0; i < Nq; ++i)
              for (int64_t j = 0; j < Nk; ++j) full.push_back(bm[static_cast<size_t>(i / bq * KB + j / bk)]);
            const GuardedTensor block_mask = tensor(DType::kBool, {3, KB}, bm);
            const GuardedTensor sink = tensor(kF64, {1}, {0.0});
            sdpa::Options plain;
            plain.scale = 1.0;
            if (sinks) plain.sinks = sink.view();
            if (cap > 0) {
              plain.softcap = 60.0;
              plain.softcap_order = cap == 1 ? sdpa::Options::SoftcapOrder::kBeforeBias : sdpa::Options::SoftcapOrder::kAfterBias;
            }
            sdpa::Options o = plain;
            o.block_mask = block_mask.view();
            o.block_q = bq;
            o.block_k = bk;
            const Tensors t{tensor(dtype, {Nq, D}, q), tensor(dtype, {Nk, D}, k), tensor(dtype, {Nk, D}, v), std::nullopt};
            Problem pb = make_problem(t.converted(dtype), o, Layout::kContiguous, 1);
            pb.dout.set_values(dout);
            // The element mask's call on the same out, lse and dout.
            Problem pe{t.converted(dtype), pb.out.converted(dtype, Layout::kContiguous),
                       pb.lse.converted(compute_dtype(dtype), Layout::kContiguous), pb.dout.converted(dtype, Layout::kContiguous)};
            pe.t.mask = tensor(DType::kBool, {Nq, Nk}, full);
            for (Backend backend : {Backend::kAuto, Backend::kReference}) {
              SCOPED_TRACE(backend_name(backend));
              o.backend = plain.backend = backend;
              const Grads got = backward(pb, o), want = backward(pe, plain);
              EXPECT_TRUE(bitwise_equal(got, want));
              // The premise: the sums that underflow are zeros (dk[1][1], dv[1][1]).
              const GradValues g = values(got);
              EXPECT_EQ(g.g[1][3], 0.0);
              EXPECT_EQ(g.g[2][3], 0.0);
            }
          }
        }
      }
    }
  }
}

// The forward's skipped tiles: rows see keys 0 .. 127 only (block (0, 1) of 128 keys is false),
// key 1 scores -50 below the others and its value row is tiny and negative, the others' -0, so
// out underflows to -0; the element mask's call processes tile 1 (keys 128 .. 199, values 1)
// with weight 0 and adds +0 · 1. Decode (1 row), a few rows and a block of tiles' rows.
TEST(BlockMask, ForwardZerosHaveTheElementMasksSign) {
  constexpr int64_t Nk = 200, D = 2;
  for (const DType dtype : {kF32, kF64}) {
    const double tiny = dtype == kF32 ? 1e-30 : 1e-305;
    for (int64_t Nq : {1, 3, 40}) {
      for (bool avx2 : {false, true}) {
        if (avx2 && !avx2_pass_skip_reason().empty()) continue;
        SCOPED_TRACE(std::string(dtype == kF32 ? "float32" : "float64") + ", Nq " + std::to_string(Nq) + (avx2 ? ", AVX2" : ""));
        std::optional<Avx2Only> only;
        if (avx2) only.emplace();
        std::vector<double> q, k, v, full;
        for (int64_t i = 0; i < Nq; ++i) q.insert(q.end(), {1.0, 0.0});
        for (int64_t j = 0; j < Nk; ++j) {
          k.insert(k.end(), {j == 1 ? -50.0 : 0.0, 0.0});
          const double x = j == 1 ? -tiny : j < 128 ? -0.0 : 1.0;
          v.insert(v.end(), {x, x});
        }
        for (int64_t i = 0; i < Nq; ++i)
          for (int64_t j = 0; j < Nk; ++j) full.push_back(j < 128 ? 1 : 0);
        const GuardedTensor block_mask = tensor(DType::kBool, {1, 2}, {1, 0});
        sdpa::Options plain;
        plain.scale = 1.0;
        sdpa::Options o = plain;
        o.block_mask = block_mask.view();
        o.block_q = Nq;
        o.block_k = 128;
        const Tensors t{tensor(dtype, {Nq, D}, q), tensor(dtype, {Nk, D}, k), tensor(dtype, {Nk, D}, v), std::nullopt};
        Tensors e{tensor(dtype, {Nq, D}, q), tensor(dtype, {Nk, D}, k), tensor(dtype, {Nk, D}, v),
                  tensor(DType::kBool, {Nq, Nk}, full)};
        for (Backend backend : {Backend::kAuto, Backend::kReference}) {
          SCOPED_TRACE(backend_name(backend));
          o.backend = plain.backend = backend;
          const Outs got = run(t, o), want = run(e, plain);
          EXPECT_TRUE(bitwise_equal(got, want));
          EXPECT_EQ(values(got).out[0], 0.0);  // the premise: out underflows to a zero
        }
      }
    }
  }
}

// A (1, 1, N, D) tensor on pages of its own whose rows [r0, r1) cannot be read: reading them
// kills the test with SIGSEGV. Rows are filled with normal values first.
class UnreadableRows {
 public:
  UnreadableRows(DType dtype, int64_t N, int64_t D, int64_t r0, int64_t r1, std::mt19937& rng) {
    const size_t row_bytes = static_cast<size_t>(D) * (dtype == kF32 ? 4 : 2);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    bytes_ = (static_cast<size_t>(N) * row_bytes + page - 1) / page * page;
    base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) throw std::runtime_error("mmap failed");
    view_ = sdpa::TensorView::contiguous(base_, dtype, {1, 1, N, D});
    GuardedTensor values(kF64, {1, 1, N, D});
    fill_normal(values, rng);
    for (int64_t e = 0; e < values.numel(); ++e) {
      const double x = values.get(e);
      if (dtype == kF32) {
        static_cast<float*>(base_)[e] = static_cast<float>(x);
      } else {  // bfloat16: float32's top half (x is a float32 value truncated; any value will do)
        const float f = static_cast<float>(x);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        static_cast<uint16_t*>(base_)[e] = static_cast<uint16_t>(bits >> 16);
      }
    }
    locked_ = static_cast<char*>(base_) + static_cast<size_t>(r0) * row_bytes;
    locked_bytes_ = static_cast<size_t>(r1 - r0) * row_bytes;
    if (reinterpret_cast<uintptr_t>(locked_) % page != 0 || locked_bytes_ % page != 0) {
      throw std::runtime_error("the unreadable rows must fill whole pages");
    }
    if (mprotect(locked_, locked_bytes_, PROT_NONE) != 0) throw std::runtime_error("mprotect failed");
  }
  ~UnreadableRows() { munmap(base_, bytes_); }
  UnreadableRows(const UnreadableRows&) = delete;
  UnreadableRows& operator=(const UnreadableRows&) = delete;
  const sdpa::TensorView& view() const { return view_; }
  // A readable copy of the tensor with the locked rows NaN: what an element mask would read.
  GuardedTensor readable_copy(int64_t r0, int64_t r1) const {
    mprotect(locked_, locked_bytes_, PROT_READ);
    GuardedTensor t(view_.dtype, {1, 1, view_.shape[2], view_.shape[3]});
    const int64_t D = view_.shape[3];
    for (int64_t e = 0; e < t.numel(); ++e) {
      const int64_t row = e / D;
      double x;
      if (view_.dtype == kF32) {
        x = static_cast<const float*>(base_)[e];
      } else {
        const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(base_)[e]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        x = f;
      }
      t.set(e, row >= r0 && row < r1 ? std::nan("") : x);
    }
    mprotect(locked_, locked_bytes_, PROT_NONE);
    return t;
  }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  char* locked_ = nullptr;
  size_t locked_bytes_ = 0;
  sdpa::TensorView view_;
};

// The forward (prefill, decode, with weights too) never reads the keys and values of a tile
// of 128 keys that the block mask blocks for every row: K and V rows 256 .. 383 lie on pages
// that cannot be read. The results equal the element mask's over K and V with NaN there.
TEST(BlockMask, SkippedTilesAreNeverRead) {
  constexpr int64_t Nk = 640, D = 64, r0 = 256, r1 = 384;
  for (bool avx2 : {false, true}) {
    if (avx2 && !avx2_pass_skip_reason().empty()) continue;
    std::optional<Avx2Only> cap;
    if (avx2) cap.emplace();
    for (DType dtype : {kF32, kBF16}) {
      for (int64_t Nq : {1, 3, 300}) {
        SCOPED_TRACE(std::string(avx2 ? "AVX2 " : "") + "dtype " + std::to_string(static_cast<int>(dtype)) +
                     " Nq " + std::to_string(Nq));
        std::mt19937 rng(static_cast<uint32_t>(Nq));
        const UnreadableRows k(dtype, Nk, D, r0, r1, rng), v(dtype, Nk, D, r0, r1, rng);
        GuardedTensor q(kF64, {1, 2, Nq, D});
        fill_normal(q, rng);
        q = q.converted(dtype, Layout::kContiguous);
        // Key block 2 (keys 256 .. 383) blocked for every query block; the others random.
        const int64_t QB = blocks(Nq, 64), KB = blocks(Nk, 128);
        std::vector<double> bits;
        for (int64_t qb = 0; qb < QB; ++qb)
          for (int64_t kb = 0; kb < KB; ++kb) bits.push_back(kb == 2 ? 0 : (qb + kb) % 3 != 0 || kb == 0);
        const GuardedTensor bm = tensor(DType::kBool, {QB, KB}, bits);
        sdpa::Options o;
        o.block_mask = bm.view();
        o.block_q = 64;
        o.block_k = 128;
        o.causal = Causal::kBottomRight;
        Tensors e{q.converted(dtype, Layout::kContiguous), k.readable_copy(r0, r1), v.readable_copy(r0, r1),
                  GuardedTensor(DType::kBool, {1, 2, Nq, Nk})};
        for (int64_t h = 0, at = 0; h < 2; ++h)
          for (int64_t i = 0; i < Nq; ++i)
            for (int64_t j = 0; j < Nk; ++j, ++at) e.mask->set(at, bm.at(0, 0, i / 64, j / 128));
        sdpa::Options plain;
        plain.causal = Causal::kBottomRight;
        const Outs want = run(e, plain);
        for (bool weights : {false, true}) {
          GuardedTensor out(dtype, {1, 2, Nq, D}), lse(kF32, {1, 2, Nq});
          std::optional<GuardedTensor> w;
          if (weights) w.emplace(kF32, std::vector<int64_t>{1, 2, Nq, Nk});
          sdpa::Outputs outs{out.view(), w ? std::optional(w->view()) : std::nullopt, lse.view()};
          sdpa::Inputs in{q.view(), k.view(), v.view(), std::nullopt};
          sdpa::attention(in, outs, o);  // SIGSEGV here if a skipped tile is read
          EXPECT_TRUE(all_close("out", out.values(), want.out.values(), 0));
          EXPECT_TRUE(all_close("lse", lse.values(), want.lse->values(), 0));
          if (w) {
            EXPECT_TRUE(all_close("weights", w->values(), want.weights->values(), 0));
          }
        }
      }
    }
  }
}

// A paged call (attention_paged, queries not packed) takes the block mask as the dense call on
// the gathered keys does: its blocks count the table's max_pages · page_size keys.
TEST(BlockMask, PagedEqualsTheDenseCall) {
  constexpr int64_t D = 16, page = 64, pages = 5, Nk = page * pages;
  std::mt19937 rng(5);
  GuardedTensor kp(kF32, {pages, page, 1, D}), vp(kF32, {pages, page, 1, D});
  fill_normal(kp, rng);
  fill_normal(vp, rng);
  const GuardedTensor k = tensor(kF32, {1, 1, Nk, D}, kp.values()), v = tensor(kF32, {1, 1, Nk, D}, vp.values());
  std::vector<int32_t> table = {0, 1, 2, 3, 4};
  std::vector<int64_t> lengths = {300};
  for (int64_t Nq : {1, 150}) {
    SCOPED_TRACE("Nq " + std::to_string(Nq));
    GuardedTensor q(kF32, {1, 2, Nq, D});
    fill_normal(q, rng);
    GuardedTensor mask(DType::kBool, {2, blocks(Nq, 32), 3});  // per head; a quarter of the blocks false
    for (int64_t e = 0; e < mask.numel(); ++e) mask.set(e, (e * 7 + 3) % 4 != 0);
    sdpa::Options o;
    o.block_mask = mask.view();
    o.block_q = 32;
    o.block_k = 128;
    o.causal = Causal::kBottomRight;
    GuardedTensor out(kF32, {1, 2, Nq, D}), lse(kF32, {1, 2, Nq}), want(kF32, {1, 2, Nq, D}), want_lse(kF32, {1, 2, Nq});
    sdpa::PagedInputs in{q.view(), kp.view(), vp.view(), sdpa::TensorView::contiguous(table.data(), DType::kInt32, {1, pages}),
                         sdpa::TensorView::contiguous(lengths.data(), DType::kInt64, {1})};
    sdpa::attention_paged(in, {out.view(), std::nullopt, lse.view()}, o);
    sdpa::Inputs dense{q.view(), k.view(), v.view(), std::nullopt, sdpa::TensorView::contiguous(lengths.data(), DType::kInt64, {1})};
    sdpa::attention(dense, {want.view(), std::nullopt, want_lse.view()}, o);
    EXPECT_TRUE(all_close("out", out.values(), want.values(), 0));
    EXPECT_TRUE(all_close("lse", lse.values(), want_lse.values(), 0));
  }
}

// Packed sequences: sequence b reads the top-left (ceil(Nq_b / bq), ceil(Nk_b / bk)) blocks of
// its row of a (..., ceil(max Nq_b / bq), ceil(max Nk_b / bk)) block mask, so each sequence of
// attention_varlen (forward and backward) is bit for bit attention() on its own rows with that
// corner, copied out here into a block mask of its own.
namespace packed {

// Rows [r0, r1) of a packed (total, H, D) float32 tensor, copied as (H, r1 - r0, D).
GuardedTensor rows(const GuardedTensor& t, int64_t r0, int64_t r1) {
  const int64_t H = t.shape()[1], D = t.shape()[2];
  GuardedTensor s(t.dtype(), {H, r1 - r0, D});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t d = 0; d < D; ++d) s.set((h * (r1 - r0) + i - r0) * D + d, t.get((i * H + h) * D + d));
  return s;
}

// The (H, n, D) values of a sequence's rows of a packed tensor, in C order.
std::vector<double> packed_rows(const GuardedTensor& t, int64_t r0, int64_t r1) { return rows(t, r0, r1).values(); }

// Sequence b's corner of a (S or 1, Hm, QB, KB) block mask, as (Hm, qb, kb).
GuardedTensor corner(const GuardedTensor& bm, int64_t b, int64_t qb, int64_t kb) {
  const auto& sh = bm.shape();
  const int64_t Hm = sh[1], QB = sh[2], KB = sh[3], row = sh[0] == 1 ? 0 : b;
  GuardedTensor c(DType::kBool, {Hm, qb, kb});
  for (int64_t h = 0; h < Hm; ++h)
    for (int64_t i = 0; i < qb; ++i)
      for (int64_t j = 0; j < kb; ++j) c.set((h * qb + i) * kb + j, bm.get(((row * Hm + h) * QB + i) * KB + j));
  return c;
}

}  // namespace packed

TEST(BlockMask, VarlenSequencesReadTheirCorner) {
  constexpr int64_t Hq = 4, Hkv = 2, D = 16, bq = 32, bk = 64;
  const std::vector<int64_t> nq = {37, 130, 0, 5, 64}, nk = {200, 129, 7, 0, 64};
  const int64_t S = static_cast<int64_t>(nq.size());
  std::vector<int64_t> cu_q = {0}, cu_k = {0};
  int64_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b < S; ++b) {
    cu_q.push_back(cu_q.back() + nq[b]);
    cu_k.push_back(cu_k.back() + nk[b]);
    max_q = std::max(max_q, nq[b]);
    max_k = std::max(max_k, nk[b]);
  }
  std::mt19937 rng(17);
  GuardedTensor q(kF32, {cu_q.back(), Hq, D}), k(kF32, {cu_k.back(), Hkv, D}), v(kF32, {cu_k.back(), Hkv, D}),
      dout(kF32, {cu_q.back(), Hq, D});
  for (GuardedTensor* t : {&q, &k, &v, &dout}) fill_normal(*t, rng);
  for (const int64_t heads : {int64_t{1}, Hq}) {  // (S, 1, QB, KB) and (1, Hq, QB, KB)
    SCOPED_TRACE("block mask heads " + std::to_string(heads));
    GuardedTensor bm(DType::kBool, {heads == 1 ? S : 1, heads, blocks(max_q, bq), blocks(max_k, bk)});
    std::bernoulli_distribution keep(0.6);
    for (int64_t e = 0; e < bm.numel(); ++e) bm.set(e, keep(rng) ? 1 : 0);
    sdpa::Options o;
    o.causal = Causal::kBottomRight;
    o.block_mask = bm.view();
    o.block_q = bq;
    o.block_k = bk;
    GuardedTensor out(kF32, {cu_q.back(), Hq, D}), lse(kF32, {Hq, cu_q.back()});
    GuardedTensor dq(kF32, q.shape()), dk(kF32, k.shape()), dv(kF32, v.shape());
    const sdpa::VarlenInputs in{q.view(), k.view(), v.view(),
                                sdpa::TensorView::contiguous(cu_q.data(), DType::kInt64, {S + 1}),
                                sdpa::TensorView::contiguous(cu_k.data(), DType::kInt64, {S + 1})};
    sdpa::attention_varlen(in, {out.view(), lse.view()}, o);
    sdpa::attention_varlen_backward(in, out.view(), lse.view(), dout.view(), {dq.view(), dk.view(), dv.view()}, o);
    for (int64_t b = 0; b < S; ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const GuardedTensor mb = packed::corner(bm, b, blocks(nq[b], bq), blocks(nk[b], bk));
      sdpa::Options ob = o;
      ob.block_mask = mb.view();
      const GuardedTensor qb = packed::rows(q, cu_q[b], cu_q[b + 1]), kb = packed::rows(k, cu_k[b], cu_k[b + 1]),
                          vb = packed::rows(v, cu_k[b], cu_k[b + 1]), gb = packed::rows(dout, cu_q[b], cu_q[b + 1]);
      GuardedTensor ob_out(kF32, {Hq, nq[b], D}), ob_lse(kF32, {Hq, nq[b]});
      GuardedTensor dqb(kF32, qb.shape()), dkb(kF32, kb.shape()), dvb(kF32, vb.shape());
      const sdpa::Inputs ib{qb.view(), kb.view(), vb.view(), std::nullopt, std::nullopt};
      sdpa::attention(ib, {ob_out.view(), std::nullopt, ob_lse.view()}, ob);
      sdpa::attention_backward(ib, ob_out.view(), ob_lse.view(), gb.view(), {dqb.view(), dkb.view(), dvb.view()}, ob);
      EXPECT_TRUE(all_close("out", packed::packed_rows(out, cu_q[b], cu_q[b + 1]), ob_out.values(), 0));
      std::vector<double> lse_b;
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = cu_q[b]; i < cu_q[b + 1]; ++i) lse_b.push_back(lse.get(h * cu_q.back() + i));
      EXPECT_TRUE(all_close("lse", lse_b, ob_lse.values(), 0));
      EXPECT_TRUE(all_close("dq", packed::packed_rows(dq, cu_q[b], cu_q[b + 1]), dqb.values(), 0));
      EXPECT_TRUE(all_close("dk", packed::packed_rows(dk, cu_k[b], cu_k[b + 1]), dkb.values(), 0));
      EXPECT_TRUE(all_close("dv", packed::packed_rows(dv, cu_k[b], cu_k[b + 1]), dvb.values(), 0));
    }
  }
}

// Packed paged queries: sequence b is the unpacked paged call on its rows with its corner (its
// keys are the table's max_pages · page_size).
TEST(BlockMask, PackedPagedSequencesReadTheirCorner) {
  constexpr int64_t Hq = 2, D = 16, page = 32, pages = 6, max_pages = 3, bq = 16, bk = 32;
  std::mt19937 rng(23);
  GuardedTensor kp(kF32, {pages, page, 1, D}), vp(kF32, {pages, page, 1, D});
  fill_normal(kp, rng);
  fill_normal(vp, rng);
  const std::vector<int64_t> nq = {20, 1, 40};
  const int64_t S = 3;
  std::vector<int64_t> cu = {0, 20, 21, 61}, lengths = {70, 96, 33};
  std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 5, 0, 1};
  GuardedTensor q(kF32, {cu.back(), Hq, D});
  fill_normal(q, rng);
  GuardedTensor bm(DType::kBool, {S, 1, blocks(40, bq), blocks(max_pages * page, bk)});
  for (int64_t e = 0; e < bm.numel(); ++e) bm.set(e, (e * 5 + 1) % 3 != 0);
  sdpa::Options o;
  o.causal = Causal::kBottomRight;
  o.block_mask = bm.view();
  o.block_q = bq;
  o.block_k = bk;
  GuardedTensor out(kF32, {cu.back(), Hq, D});
  sdpa::PagedInputs in{q.view(), kp.view(), vp.view(),
                       sdpa::TensorView::contiguous(table.data(), DType::kInt32, {S, max_pages}),
                       sdpa::TensorView::contiguous(lengths.data(), DType::kInt64, {S}),
                       sdpa::TensorView::contiguous(cu.data(), DType::kInt64, {S + 1})};
  sdpa::attention_paged(in, {out.view()}, o);
  for (int64_t b = 0; b < S; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const GuardedTensor mb = packed::corner(bm, b, blocks(nq[b], bq), blocks(max_pages * page, bk));
    sdpa::Options ob = o;
    ob.block_mask = mb.view();
    GuardedTensor qb = packed::rows(q, cu[b], cu[b + 1]), ob_out(kF32, {1, Hq, nq[b], D});
    sdpa::TensorView q4 = qb.view();  // (Hq, n, D) as (1, Hq, n, D)
    q4 = sdpa::TensorView::contiguous(q4.data, kF32, {1, Hq, nq[b], D});
    sdpa::PagedInputs one{q4, kp.view(), vp.view(),
                          sdpa::TensorView::contiguous(table.data() + b * max_pages, DType::kInt32, {1, max_pages}),
                          sdpa::TensorView::contiguous(lengths.data() + b, DType::kInt64, {1})};
    sdpa::attention_paged(one, {ob_out.view()}, ob);
    EXPECT_TRUE(all_close("out", packed::packed_rows(out, cu[b], cu[b + 1]), ob_out.values(), 0));
  }
}

TEST(BlockMask, BadArgumentsAreErrorsNamingThem) {
  std::mt19937 rng(3);
  Tensors t{GuardedTensor(kF32, {2, 4, 100, 8}), GuardedTensor(kF32, {2, 2, 300, 8}),
            GuardedTensor(kF32, {2, 2, 300, 8}), std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  const auto expect_error = [&](const GuardedTensor& bm, int64_t bq, int64_t bk, std::vector<std::string> words) {
    sdpa::Options o;
    o.block_mask = bm.view();
    o.block_q = bq;
    o.block_k = bk;
    GuardedTensor out(kF32, {2, 4, 100, 8});
    expect_sdpa_error([&] { sdpa::attention(t.inputs(), {out.view()}, o); }, words);
    EXPECT_TRUE(out.untouched());
  };
  const GuardedTensor good(DType::kBool, {1, 3});  // ceil(100 / 128), ceil(300 / 128)
  expect_error(GuardedTensor(kF32, {1, 3}), 128, 128, {"block_mask", "dtype float32", "bool"});
  expect_error(GuardedTensor(DType::kBool, {1, 2}), 128, 128,
               {"block_mask", "(1, 2)", "(2, 4, 1, 3) = (B, Hq, QB, KB)", "ceil(300 / 128)"});
  expect_error(GuardedTensor(DType::kBool, {3, 1, 3}), 128, 128, {"block_mask", "(3, 1, 3)", "(2, 4, 1, 3)"});
  expect_error(GuardedTensor(DType::kBool, {3}), 128, 128, {"block_mask", "rank 1"});
  expect_error(good, 0, 128, {"block_q=0", "at least 1"});
  expect_error(good, 128, -1, {"block_k=-1", "at least 1"});
  // Packed sequences: the longest one's blocks; with no sequence, (..., 0, 0) (fuzz finding F19).
  GuardedTensor q(kF32, {10, 2, 8}), k(kF32, {12, 2, 8}), v(kF32, {12, 2, 8}), out(kF32, {10, 2, 8});
  std::vector<int32_t> cu_q = {0, 4, 10}, cu_k = {0, 5, 12};
  const sdpa::VarlenInputs in{q.view(), k.view(), v.view(), sdpa::TensorView::contiguous(cu_q.data(), DType::kInt32, {3}),
                              sdpa::TensorView::contiguous(cu_k.data(), DType::kInt32, {3})};
  const auto varlen_error = [&](const GuardedTensor& bm, std::vector<std::string> words) {
    sdpa::Options o;
    o.block_mask = bm.view();
    o.block_q = 4;
    o.block_k = 4;
    expect_sdpa_error([&] { sdpa::attention_varlen(in, {out.view()}, o); }, words);
    EXPECT_TRUE(out.untouched());
  };
  varlen_error(GuardedTensor(DType::kBool, {3, 2}),  // ceil(6 / 4), ceil(7 / 4)
               {"block_mask", "(3, 2)", "(2, 2, 2, 2) = (B, Hq, QB, KB)", "ceil(the longest sequence's Nq / block_q) = ceil(6 / 4)"});
  varlen_error(GuardedTensor(DType::kBool, {3, 1, 2, 2}), {"block_mask", "(3, 1, 2, 2)", "(2, 2, 2, 2)"});
  varlen_error(GuardedTensor(kF32, {2, 2}), {"block_mask", "bool"});
  GuardedTensor pages(kF32, {1, 4, 2, 8}), q0(kF32, {0, 2, 8}), out0(kF32, {0, 2, 8});
  std::vector<int32_t> table = {0}, none = {0};
  std::vector<int64_t> lengths;
  sdpa::PagedInputs paged{q0.view(), pages.view(), pages.view(), sdpa::TensorView::contiguous(table.data(), DType::kInt32, {0, 1}),
                          sdpa::TensorView::contiguous(lengths.data(), DType::kInt64, {0}),
                          sdpa::TensorView::contiguous(none.data(), DType::kInt32, {1})};
  sdpa::Options o;
  o.block_mask = good.view();  // (1, 3): QB must be ceil(0 / 128) = 0
  expect_sdpa_error([&] { sdpa::attention_paged(paged, {out0.view()}, o); },
                    {"block_mask", "(1, 3)", "ceil(the longest sequence's Nq / block_q) = ceil(0 / 128)"});
  const GuardedTensor empty(DType::kBool, {0, 1});  // QB = 0, KB = ceil(1 · 4 / 128)
  o.block_mask = empty.view();
  EXPECT_NO_THROW(sdpa::attention_paged(paged, {out0.view()}, o));
  // No pages at all (a pool not allocated yet, every sequence empty): the mask still counts the
  // table's keys, max_pages · page_size (fuzz: paged_blocks_no_pages).
  GuardedTensor no_pages(kF32, {0, 4, 2, 8}), q1(kF32, {3, 2, 8}), out1(kF32, {3, 2, 8});
  std::vector<int32_t> table1 = {-1, -1, -1, -1, -1};
  std::vector<int64_t> lengths1 = {0};
  std::vector<int32_t> cu1 = {0, 3};
  sdpa::PagedInputs unallocated{q1.view(), no_pages.view(), no_pages.view(),
                                sdpa::TensorView::contiguous(table1.data(), DType::kInt32, {1, 5}),
                                sdpa::TensorView::contiguous(lengths1.data(), DType::kInt64, {1}),
                                sdpa::TensorView::contiguous(cu1.data(), DType::kInt32, {2})};
  GuardedTensor keys20(DType::kBool, {2, 3});  // ceil(3 / 2), ceil(5 · 4 / 8)
  for (int64_t e = 0; e < keys20.numel(); ++e) keys20.set(e, e % 2);
  o.block_mask = keys20.view();
  o.block_q = 2;
  o.block_k = 8;
  EXPECT_NO_THROW(sdpa::attention_paged(unallocated, {out1.view()}, o));
  for (double x : out1.values()) EXPECT_EQ(x, 0.0);
  const GuardedTensor keys0(DType::kBool, {2, 0});
  o.block_mask = keys0.view();
  expect_sdpa_error([&] { sdpa::attention_paged(unallocated, {out1.view()}, o); }, {"block_mask", "(2, 0)", "ceil(20 / 8)"});
}

}  // namespace
