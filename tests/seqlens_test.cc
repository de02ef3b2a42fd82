// Inputs::seqlens_k: per-sequence key lengths (ONNX Attention's nonpad_kv_seqlen). The header's
// picture, hand-made cases written from the ONNX reference's definition, keys past a length that
// are never read (they sit on a page the process may not touch), validation, and a sweep of
// forward and backward against kReference and the independent oracle on every SIMD path.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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

// ---- The header's picture ----

// Nq = 2, Nk = 6, seqlens_k = {5, 2}, causal bottom-right:
//     b = 0:  x x x x . -      b = 1:  x . - - - -
//             x x x x x -              x x - - - -
TEST(SeqlensK, HeaderPicture) {
  const char* picture[2][2] = {{"xxxx.-", "xxxxx-"}, {"x.----", "xx----"}};
  for (Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    std::mt19937 rng(5);
    Tensors t{GuardedTensor(kF32, {2, 1, 2, 4}), GuardedTensor(kF32, {2, 1, 6, 4}), GuardedTensor(kF32, {2, 1, 6, 3}),
              std::nullopt, {5, 2}};
    fill_normal(t.q, rng);
    fill_normal(t.k, rng);
    fill_normal(t.v, rng);
    sdpa::Options o;
    o.causal = Causal::kBottomRight;
    o.backend = backend;
    const Outs got = run(t, o);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t i = 0; i < 2; ++i)
        for (int64_t j = 0; j < 6; ++j) {
          const double w = got.weights->at(b, 0, i, j);
          EXPECT_EQ(picture[b][i][j] == 'x', w > 0) << "b " << b << " i " << i << " j " << j << " weight " << w;
        }
  }
}

// ---- ONNX Attention-24's nonpad_kv_seqlen, by hand ----
//
// The ONNX reference (onnx/reference/ops/op_attention.py) adds a padding bias of -inf at keys
// j >= nonpad_kv_seqlen[b] and, with is_causal, lets query i see keys j <= i + (nonpad_kv_seqlen[b]
// - q_len) ("external/static cache": bottom-right per batch). Expected values below are worked
// out by hand from that definition, not taken from sdpa.
//   One head, D = 1, scale 1, q = 1 everywhere, k = (0, ln 3, 0, 0), v = (1, 2, 4, 8): the weights
//   of the allowed keys are proportional to (1, 3, 1, 1).
Tensors onnx_case(int64_t nq, std::vector<int64_t> seqlens) {
  const int64_t B = static_cast<int64_t>(seqlens.size());
  std::vector<double> q(static_cast<size_t>(B * nq), 1.0), k, v;
  for (int64_t b = 0; b < B; ++b) {
    for (double x : {0.0, std::log(3.0), 0.0, 0.0}) k.push_back(x);
    for (double x : {1.0, 2.0, 4.0, 8.0}) v.push_back(x);
  }
  return {tensor(kF64, {B, 1, nq, 1}, q), tensor(kF64, {B, 1, 4, 1}, k), tensor(kF64, {B, 1, 4, 1}, v), std::nullopt,
          std::move(seqlens)};
}

TEST(SeqlensK, OnnxNonpadKvSeqlenByHand) {
  struct Expect {
    bool causal;
    int64_t nq;
    std::vector<int64_t> seqlens;
    std::vector<double> out;  // (B, 1, nq, 1) in C order
  };
  const Expect cases[] = {
      // No causal: sequence 0 has keys {0, 1}: (1·1 + 3·2) / 4; sequence 1 all four: (1 + 6 + 4 + 8) / 6.
      {false, 1, {2, 4}, {7.0 / 4, 19.0 / 6}},
      // One key: its value; three keys: (1 + 6 + 4) / 5.
      {false, 1, {1, 3}, {1.0, 11.0 / 5}},
      // Causal, 2 queries. Sequence 0 (L = 3): row 0 sees j <= 0 + 3 - 2 = 1 -> 7/4; row 1 j <= 2
      // -> 11/5. Sequence 1 (L = 4): row 0 j <= 2 -> 11/5; row 1 j <= 3 -> 19/6.
      {true, 2, {3, 4}, {7.0 / 4, 11.0 / 5, 11.0 / 5, 19.0 / 6}},
      // Causal, L = 2 = q_len: row 0 sees key 0 only -> 1; row 1 keys {0, 1} -> 7/4.
      {true, 2, {2, 4}, {1.0, 7.0 / 4, 11.0 / 5, 19.0 / 6}},
  };
  for (const Expect& e : cases) {
    for (Backend backend : kBackends) {
      SCOPED_TRACE(std::string(backend_name(backend)) + (e.causal ? " causal" : "") + " L0=" +
                   std::to_string(e.seqlens[0]));
      const Tensors t = onnx_case(e.nq, e.seqlens);
      sdpa::Options o;
      o.scale = 1.0;
      o.causal = e.causal ? Causal::kBottomRight : Causal::kNone;
      o.backend = backend;
      const Outs got = run(t, o);
      EXPECT_TRUE(all_close("out", values(got).out, e.out, 1e-14));
    }
  }
}

// A row that sees no key (length 0, or causal with L < Nq) is fully masked: zeros and lse -inf
// (the ONNX reference would give NaN there: softmax of a row of -inf).
TEST(SeqlensK, RowsWithoutKeysAreZero) {
  for (Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    const Tensors t = onnx_case(3, {0, 1});
    sdpa::Options o;
    o.causal = Causal::kBottomRight;
    o.backend = backend;
    const Values got = values(run(t, o));
    // Sequence 0: no keys. Sequence 1 (L = 1): rows 0, 1 see j <= i - 2: nothing; row 2 key 0.
    EXPECT_TRUE(all_close("out", got.out, {0, 0, 0, 0, 0, 1}, 0));
    EXPECT_TRUE(all_close("lse", got.lse, {-kInf, -kInf, -kInf, -kInf, -kInf, 0}, 0));
  }
}

// ---- Keys past the length are never read ----

// A buffer of `before` bytes that ends where a page the process may not touch begins: reading
// one byte past it is a segmentation fault (prefetches are not reads and do not fault).
class FencedBuffer {
 public:
  explicit FencedBuffer(size_t before) {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    pages_ = (before + page_ - 1) / page_ + 2;
    base_ = static_cast<char*>(mmap(nullptr, pages_ * page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    EXPECT_NE(base_, MAP_FAILED);
    fence_ = base_ + (pages_ - 1) * page_;
    EXPECT_EQ(mprotect(fence_, page_, PROT_NONE), 0);
  }
  ~FencedBuffer() { munmap(base_, pages_ * page_); }
  FencedBuffer(const FencedBuffer&) = delete;
  FencedBuffer& operator=(const FencedBuffer&) = delete;
  char* fence() const { return fence_; }

 private:
  size_t page_ = 0, pages_ = 0;
  char* base_ = nullptr;
  char* fence_ = nullptr;
};

// One sequence, rank 2: q (Nq, D), k and v (Nk, D) contiguous with rows 0 .. L - 1 right before
// a fence, so that rows L .. Nk - 1 lie on it. Forward (every backend, lse and weights asked
// for) and backward run without touching them, and give the bits of the same call on guarded
// copies whose rows past L hold NaN.
void check_fenced(DType dtype, int64_t nq, int64_t nk, int64_t L, int64_t D, Causal causal) {
  SCOPED_TRACE(std::string(sdpa::dtype_name(dtype)) + " Nq=" + std::to_string(nq) + " Nk=" + std::to_string(nk) +
               " L=" + std::to_string(L));
  const int64_t es = sdpa::dtype_size(dtype);
  std::mt19937 rng(static_cast<uint32_t>(nq * 131 + nk * 7 + L));
  Tensors full{GuardedTensor(dtype, {nq, D}), GuardedTensor(dtype, {nk, D}), GuardedTensor(dtype, {nk, D}),
               std::nullopt, {L}};
  fill_normal(full.q, rng);
  fill_normal(full.k, rng);
  fill_normal(full.v, rng);
  for (int64_t x = L * D; x < nk * D; ++x) {
    full.k.set(x, std::nan(""));
    full.v.set(x, std::nan(""));
  }
  FencedBuffer kb(static_cast<size_t>(L * D * es)), vb(static_cast<size_t>(L * D * es));
  char* k0 = kb.fence() - L * D * es;
  char* v0 = vb.fence() - L * D * es;
  const sdpa::TensorView ks = full.k.view(), vs = full.v.view();  // contiguous
  if (L > 0) {
    std::memcpy(k0, ks.data, static_cast<size_t>(L * D * es));
    std::memcpy(v0, vs.data, static_cast<size_t>(L * D * es));
  }
  sdpa::Inputs in = full.inputs();
  in.k = sdpa::TensorView::contiguous(k0, dtype, {nk, D});
  in.v = sdpa::TensorView::contiguous(v0, dtype, {nk, D});
  sdpa::Options o;
  o.causal = causal;
  for (Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    o.backend = backend;
    const DType c = compute_dtype(dtype);
    GuardedTensor out(dtype, {nq, D}), lse(c, {nq}), weights(c, {nq, nk});
    sdpa::Outputs outs;
    outs.out = out.view();
    outs.lse = lse.view();
    outs.weights = weights.view();
    sdpa::attention(in, outs, o);
    const Outs want = run(full, o);
    EXPECT_TRUE(bitwise_equal(Outs{std::move(out), std::move(weights), std::move(lse)}, want));
    EXPECT_TRUE(blocked_are_exact(full, o, want));
    if (backend != Backend::kAuto && backend != Backend::kReference) continue;
    // Backward: rows of dk, dv past L get 0 (written, not read).
    GuardedTensor dout(dtype, {nq, D});
    fill_normal(dout, rng);
    Grads fenced = empty_grads(full, Layout::kContiguous), guarded = empty_grads(full, Layout::kContiguous);
    sdpa::attention_backward(in, want.out.view(), want.lse->view(), dout.view(), fenced.gradients(), o);
    sdpa::attention_backward(full.inputs(), want.out.view(), want.lse->view(), dout.view(), guarded.gradients(), o);
    EXPECT_TRUE(bitwise_equal(fenced, guarded));
    for (int64_t x = L * D; x < nk * D; ++x) {
      ASSERT_EQ(fenced.dk.get(x), 0.0);
      ASSERT_EQ(fenced.dv.get(x), 0.0);
    }
  }
}

TEST(SeqlensK, KeysPastTheLengthAreNeverRead) {
  for (DType dtype : {kF32, kBF16, kF16, kF64}) {
    check_fenced(dtype, 1, 3000, 1500, 64, Causal::kNone);      // decode, keys split into chunks
    check_fenced(dtype, 3, 300, 131, 32, Causal::kBottomRight);  // few rows
    check_fenced(dtype, 70, 400, 257, 64, Causal::kNone);        // prefill tiles, a partial last tile
    check_fenced(dtype, 40, 200, 0, 16, Causal::kTopLeft);       // no keys at all
  }
}

// ---- Validation ----

TEST(SeqlensK, BadLengthsAreErrorsNamingThem) {
  Tensors t{GuardedTensor(kF32, {2, 1, 3, 4}), GuardedTensor(kF32, {2, 1, 5, 4}), GuardedTensor(kF32, {2, 1, 5, 4}), std::nullopt};
  std::mt19937 rng(1);
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  GuardedTensor out(kF32, {2, 1, 3, 4});
  sdpa::Outputs outs;
  outs.out = out.view();
  const auto call = [&](sdpa::TensorView s) {
    sdpa::Inputs in = t.inputs();
    in.seqlens_k = s;
    return [in, outs] { sdpa::attention(in, outs); };
  };
  int64_t good[2] = {5, 0}, neg[2] = {5, -1}, big[2] = {6, 1};
  int32_t i32[2] = {5, 7};
  float f[2] = {1, 1};
  using sdpa::TensorView;
  expect_sdpa_error(call(TensorView::contiguous(neg, DType::kInt64, {2})), {"seqlens_k[1] = -1", "[0, 5]"});
  expect_sdpa_error(call(TensorView::contiguous(big, DType::kInt64, {2})), {"seqlens_k[0] = 6", "[0, 5]"});
  expect_sdpa_error(call(TensorView::contiguous(i32, DType::kInt32, {2})), {"seqlens_k[1] = 7"});
  expect_sdpa_error(call(TensorView::contiguous(f, DType::kFloat32, {2})), {"seqlens_k", "float32", "int32 or int64"});
  expect_sdpa_error(call(TensorView::contiguous(good, DType::kInt64, {1})), {"seqlens_k", "(1,)", "(2,)"});
  expect_sdpa_error(call(TensorView::contiguous(good, DType::kInt64, {1, 2})), {"seqlens_k", "rank 2"});
  EXPECT_TRUE(out.untouched());
  // A strided, int32 view is fine; validate() checks it without outputs.
  int32_t strided[4] = {5, -99, 0, -99};
  sdpa::Inputs in = t.inputs();
  TensorView s = TensorView::contiguous(strided, DType::kInt32, {2});
  s.strides[0] = 2;
  in.seqlens_k = s;
  EXPECT_NO_THROW(sdpa::validate(in));
  EXPECT_NO_THROW(sdpa::attention(in, outs));
}

// ---- The sweep: forward and backward against kReference and the oracle ----

struct SeqCase {
  DType dtype;
  int64_t B, Hq, Hkv, Nq, Nk, D;
  Causal causal;
  sdpa::Window window;
  bool mask;  // a bool (B, 1, 1, Nk) key-padding mask on top
  Layout layout;
};

std::vector<int64_t> lengths_for(const SeqCase& c, std::mt19937& rng) {
  // The first sequences take the ends (all keys, none), the rest lie in between.
  std::vector<int64_t> L;
  for (int64_t b = 0; b < c.B; ++b) {
    if (b == 0) L.push_back(c.Nk);
    else if (b == 1) L.push_back(0);
    else L.push_back(std::uniform_int_distribution<int64_t>(1, c.Nk)(rng));
  }
  return L;
}

void check_case(const SeqCase& c) {
  std::mt19937 rng(static_cast<uint32_t>(c.Nq * 1000003 + c.Nk * 101 + c.B * 7 + c.D));
  Tensors t{GuardedTensor(kF64, {c.B, c.Hq, c.Nq, c.D}, c.layout), GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.D}, c.layout),
            GuardedTensor(kF64, {c.B, c.Hkv, c.Nk, c.D}, c.layout), std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  if (c.mask) {
    t.mask = GuardedTensor(DType::kBool, {c.B, 1, 1, c.Nk});
    fill_mask(*t.mask, rng, 0.8, 0.0);
  }
  t.seqlens_k = lengths_for(c, rng);
  // Keys past each length hold NaN: they must not reach anything.
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t j = t.seqlens_k[static_cast<size_t>(b)]; j < c.Nk; ++j)
        for (int64_t e = 0; e < c.D; ++e) {
          const int64_t flat = ((b * c.Hkv + h) * c.Nk + j) * c.D + e;
          t.k.set(flat, std::nan(""));
          t.v.set(flat, std::nan(""));
        }
  if (c.dtype != kF64) t = t.converted(c.dtype);
  sdpa::Options o;
  o.causal = c.causal;
  o.window = c.window;
  // kReference against the independent oracle (which knows seqlens_k from the header's words).
  o.backend = Backend::kReference;
  if (c.dtype == kF64) {
    const Values ref = values(run(t, o));
    const Values want = oracle(t, o);
    EXPECT_TRUE(all_close("out", ref.out, want.out, 1e-12 * (1 + max_abs_finite(want.out))));
    EXPECT_TRUE(all_close("lse", ref.lse, want.lse, 1e-12 * (1 + max_abs_finite(want.lse))));
  }
  for (Backend backend : {Backend::kAuto, Backend::kFlash}) {
    SCOPED_TRACE(backend_name(backend));
    o.backend = backend;
    const Outs got = run(t, o, c.layout);
    EXPECT_TRUE(got.guards_intact());
    EXPECT_TRUE(matches_reference(t, o, got));
    EXPECT_TRUE(blocked_are_exact(t, o, got));
  }
  // Backward: kAuto against kReference by the backward's tolerance rule; keys past a length get
  // exactly 0 (no NaN from their poisoned rows).
  o.backend = Backend::kAuto;
  const std::vector<int64_t> L = t.seqlens_k;
  const Problem p = make_problem(std::move(t), o, c.layout, 77);
  Expected e;
  ASSERT_TRUE(expected(p, o, e));
  const Grads g = backward(p, o, c.layout);
  EXPECT_TRUE(g.guards_intact());
  EXPECT_TRUE(matches(e, g));
  EXPECT_TRUE(no_nan(values(g)));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t j = L[static_cast<size_t>(b)]; j < c.Nk; ++j)
        for (int64_t x = 0; x < c.D; ++x) {
          ASSERT_EQ(g.dk.at(b, h, j, x), 0.0);
          ASSERT_EQ(g.dv.at(b, h, j, x), 0.0);
        }
}

std::vector<SeqCase> seq_cases() {
  std::vector<SeqCase> cases;
  const sdpa::Window none{}, win{16, 4};
  for (DType dt : {kF32, kF64, kBF16, kF16}) {
    cases.push_back({dt, 3, 2, 1, 1, 2100, 64, Causal::kNone, none, false, Layout::kContiguous});      // decode, split keys
    cases.push_back({dt, 3, 4, 2, 4, 97, 32, Causal::kBottomRight, none, false, Layout::kPadded});    // few rows, GQA
    cases.push_back({dt, 4, 2, 2, 40, 130, 24, Causal::kBottomRight, none, true, Layout::kPermuted});  // prefill, mask
    cases.push_back({dt, 3, 2, 2, 33, 65, 17, Causal::kTopLeft, none, false, Layout::kContiguous});
    cases.push_back({dt, 3, 1, 1, 20, 300, 8, Causal::kBottomRight, win, false, Layout::kContiguous});  // window
    cases.push_back({dt, 2, 1, 1, 140, 260, 64, Causal::kNone, none, false, Layout::kPadded});
  }
  return cases;
}

class SeqlensSweep : public testing::TestWithParam<size_t> {};

TEST_P(SeqlensSweep, MatchesReferenceOnEveryPath) {
  const SeqCase c = seq_cases()[GetParam()];
  {
    SCOPED_TRACE("best path");
    check_case(c);
  }
  if (c.dtype == kBF16) {
    SCOPED_TRACE("capped at AVX512_BF16");
    const KernelPathCap cap(sdpa::KernelPath::kAvx512Bf16);
    check_case(c);
  }
  if (c.dtype == kBF16) {
    SCOPED_TRACE("capped at SIMD (widening)");
    const KernelPathCap cap(sdpa::KernelPath::kSimd);
    check_case(c);
  }
  if (avx2_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX2");
    const Avx2Only avx2;
    check_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, SeqlensSweep, testing::Range<size_t>(0, seq_cases().size()),
                         [](const testing::TestParamInfo<size_t>& info) {
                           const SeqCase c = seq_cases()[info.param];
                           std::string causal = c.causal == Causal::kNone ? "" : c.causal == Causal::kTopLeft ? "_causalTL" : "_causalBR";
                           return std::string(sdpa::dtype_name(c.dtype)) + "_b" + std::to_string(c.B) + "_q" +
                                  std::to_string(c.Nq) + "_k" + std::to_string(c.Nk) + causal +
                                  (c.window.left >= 0 ? "_win" : "") + (c.mask ? "_mask" : "");
                         });

// The same results for any thread count, bit for bit.
TEST(SeqlensK, ThreadCountDoesNotChangeResults) {
  const SeqCase c{kF32, 3, 2, 1, 1, 2100, 64, Causal::kNone, {}, false, Layout::kContiguous};
  std::mt19937 rng(3);
  Tensors t{GuardedTensor(kF32, {c.B, c.Hq, c.Nq, c.D}), GuardedTensor(kF32, {c.B, c.Hkv, c.Nk, c.D}),
            GuardedTensor(kF32, {c.B, c.Hkv, c.Nk, c.D}), std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  t.seqlens_k = {2100, 5, 1300};
  sdpa::Options o;
  sdpa::set_num_threads(1);
  const Outs one = run(t, o);
  sdpa::set_num_threads(2);
  const Outs two = run(t, o);
  sdpa::set_num_threads(0);
  EXPECT_TRUE(bitwise_equal(one, two));
}

}  // namespace
