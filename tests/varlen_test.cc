// attention_varlen and attention_varlen_backward: sequences packed token-major. Each sequence
// must be exactly attention() on its own rows (bit for bit: the same kernel on views of the
// same values), nothing may cross a boundary, dropout draws per sequence, and bad offsets are
// Errors that write nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;
using sdpa::TensorView;

// A packed batch: q (total_q, Hq, D), k, v (total_k, Hkv, D), out (total_q, Hq, D), lse
// (Hq, total_q), the offsets, and each sequence's rows copied into dense (H, n, D) tensors.
struct Packed {
  int64_t Hq, Hkv, D;
  std::vector<int64_t> cu_q, cu_k;
  GuardedTensor q, k, v;
  Packed(DType dt, int64_t hq, int64_t hkv, int64_t d, const std::vector<int64_t>& nq, const std::vector<int64_t>& nk,
         uint32_t seed)
      : Hq(hq), Hkv(hkv), D(d), cu_q(offsets(nq)), cu_k(offsets(nk)), q(dt, {cu_q.back(), hq, d}),
        k(dt, {cu_k.back(), hkv, d}), v(dt, {cu_k.back(), hkv, d}) {
    std::mt19937 rng(seed);
    fill_normal(q, rng);
    fill_normal(k, rng);
    fill_normal(v, rng);
  }
  static std::vector<int64_t> offsets(const std::vector<int64_t>& n) {
    std::vector<int64_t> cu = {0};
    for (int64_t x : n) cu.push_back(cu.back() + x);
    return cu;
  }
  int64_t B() const { return static_cast<int64_t>(cu_q.size()) - 1; }
  sdpa::VarlenInputs inputs() const {
    return {q.view(), k.view(), v.view(), TensorView::contiguous(const_cast<int64_t*>(cu_q.data()), DType::kInt64,
                                                                 {static_cast<int64_t>(cu_q.size())}),
            TensorView::contiguous(const_cast<int64_t*>(cu_k.data()), DType::kInt64, {static_cast<int64_t>(cu_k.size())})};
  }
  // Rows [r0, r1) of a packed (total, H, D) tensor as a dense (H, r1 - r0, D) tensor.
  static GuardedTensor rows(const GuardedTensor& t, int64_t r0, int64_t r1) {
    const int64_t H = t.shape()[1], d = t.shape()[2];
    GuardedTensor s(t.dtype(), {H, r1 - r0, d});
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t x = 0; x < d; ++x) s.set((h * (r1 - r0) + r - r0) * d + x, t.get((r * H + h) * d + x));
    return s;
  }
  Tensors sequence(int64_t b) const {
    return {rows(q, cu_q[b], cu_q[b + 1]), rows(k, cu_k[b], cu_k[b + 1]), rows(v, cu_k[b], cu_k[b + 1]), std::nullopt};
  }
};

// Sequence b's rows of a packed output equal a dense (H, n, D) output bit for bit.
testing::AssertionResult rows_equal(const GuardedTensor& packed, int64_t r0, const GuardedTensor& dense) {
  const int64_t H = dense.shape()[0], n = dense.shape()[1], d = dense.shape()[2];
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t x = 0; x < d; ++x) {
        const double got = packed.get(((r0 + r) * H + h) * d + x), want = dense.get((h * n + r) * d + x);
        if (!(got == want || (std::isnan(got) && std::isnan(want)))) {
          return testing::AssertionFailure() << "row " << r0 + r << " head " << h << " col " << x << ": " << got
                                             << " vs dense " << want;
        }
      }
  return testing::AssertionSuccess();
}

struct VarCase {
  DType dtype;
  std::vector<int64_t> nq, nk;
  Causal causal;
  sdpa::Window window;
};

class VarlenSweep : public testing::TestWithParam<size_t> {};

std::vector<VarCase> var_cases() {
  std::vector<VarCase> cases;
  for (DType dt : {kF32, kF64, kBF16, kF16}) {
    // Lengths 0, 1, around a tile, and 100x apart; decode-sized and prefill-sized sequences.
    cases.push_back({dt, {3, 0, 130, 1, 17}, {5, 7, 200, 2100, 0}, Causal::kBottomRight, {}});
    cases.push_back({dt, {40, 1, 9}, {40, 300, 9}, Causal::kTopLeft, {}});
    cases.push_back({dt, {20, 64}, {128, 64}, Causal::kNone, {8, 2}});
  }
  return cases;
}

TEST_P(VarlenSweep, EachSequenceIsAttentionOnItsOwnRows) {
  const VarCase c = var_cases()[GetParam()];
  const Packed pk(c.dtype, 4, 2, 24, c.nq, c.nk, static_cast<uint32_t>(GetParam() + 1));
  sdpa::Options o;
  o.causal = c.causal;
  o.window = c.window;
  const DType ct = compute_dtype(c.dtype);
  GuardedTensor out(c.dtype, {pk.cu_q.back(), pk.Hq, pk.D}), lse(ct, {pk.Hq, pk.cu_q.back()});
  sdpa::attention_varlen(pk.inputs(), {out.view(), lse.view()}, o);
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(lse.guards_intact());
  // Backward on the same packing.
  GuardedTensor dout(c.dtype, {pk.cu_q.back(), pk.Hq, pk.D});
  std::mt19937 rng(7);
  fill_normal(dout, rng);
  GuardedTensor dq(c.dtype, pk.q.shape()), dk(c.dtype, pk.k.shape()), dv(c.dtype, pk.v.shape());
  sdpa::attention_varlen_backward(pk.inputs(), out.view(), lse.view(), dout.view(), {dq.view(), dk.view(), dv.view()}, o);
  for (int64_t b = 0; b < pk.B(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const Tensors t = pk.sequence(b);
    const Outs dense = run(t, o, Layout::kContiguous, /*with_extras=*/true);
    EXPECT_TRUE(matches_reference(t, o, dense));  // the dense call itself is right
    EXPECT_TRUE(rows_equal(out, pk.cu_q[b], dense.out));
    const int64_t q0 = pk.cu_q[b], nq = pk.cu_q[b + 1] - q0;
    for (int64_t h = 0; h < pk.Hq; ++h)
      for (int64_t i = 0; i < nq; ++i) ASSERT_EQ(lse.get(h * pk.cu_q.back() + q0 + i), dense.lse->get(h * nq + i));
    // Gradients: the dense backward on the sequence's rows, with the same out and lse.
    const GuardedTensor dout_b = Packed::rows(dout, pk.cu_q[b], pk.cu_q[b + 1]);
    GuardedTensor dq_b(c.dtype, t.q.shape()), dk_b(c.dtype, t.k.shape()), dv_b(c.dtype, t.v.shape());
    sdpa::attention_backward(t.inputs(), dense.out.view(), dense.lse->view(), dout_b.view(),
                             {dq_b.view(), dk_b.view(), dv_b.view()}, o);
    EXPECT_TRUE(rows_equal(dq, pk.cu_q[b], dq_b));
    EXPECT_TRUE(rows_equal(dk, pk.cu_k[b], dk_b));
    EXPECT_TRUE(rows_equal(dv, pk.cu_k[b], dv_b));
  }
  EXPECT_TRUE(dq.guards_intact() && dk.guards_intact() && dv.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cases, VarlenSweep, testing::Range<size_t>(0, var_cases().size()),
                         [](const testing::TestParamInfo<size_t>& info) {
                           const VarCase c = var_cases()[info.param];
                           return std::string(sdpa::dtype_name(c.dtype)) + "_" + std::to_string(info.param % 3);
                         });

// Dropout draws for (seed, b, h, i, j) with b the sequence: two identical sequences get
// different drops, and sequence 0 gets those of attention() on its rows.
TEST(Varlen, DropoutDrawsPerSequence) {
  Packed pk(kF32, 2, 2, 8, {6, 6}, {30, 30}, 3);
  for (int64_t r = 0; r < 6 * 2 * 8; ++r) pk.q.set(6 * 2 * 8 + r, pk.q.get(r));  // sequence 1 = sequence 0
  for (int64_t r = 0; r < 30 * 2 * 8; ++r) {
    pk.k.set(30 * 2 * 8 + r, pk.k.get(r));
    pk.v.set(30 * 2 * 8 + r, pk.v.get(r));
  }
  GuardedTensor out(kF32, {12, 2, 8});
  sdpa::Options o;
  sdpa::attention_varlen(pk.inputs(), {out.view(), std::nullopt}, o);
  EXPECT_TRUE(rows_equal(out, 6, Packed::rows(out, 0, 6)));  // no dropout: equal sequences, equal rows
  o.dropout_p = 0.3;
  o.seed = 11;
  sdpa::attention_varlen(pk.inputs(), {out.view(), std::nullopt}, o);
  EXPECT_FALSE(rows_equal(out, 6, Packed::rows(out, 0, 6)));
  const Outs dense = run(pk.sequence(0), o, Layout::kContiguous, /*with_extras=*/false);
  EXPECT_TRUE(rows_equal(out, 0, dense.out));
}

// Packed tensors without elements (no heads) may have null data and any strides: nothing is
// computed from their pointers (F12: UBSan reported null + offset in the per-sequence views).
TEST(Varlen, EmptyPackedTensorsWithNullData) {
  int64_t cu[3] = {0, 2, 5};
  const auto empty = [](std::initializer_list<int64_t> shape) {
    sdpa::TensorView t = sdpa::TensorView::contiguous(nullptr, sdpa::DType::kFloat32, shape);
    t.strides[0] = int64_t{1} << 40;  // huge strides: allowed on an empty view
    return t;
  };
  sdpa::VarlenInputs in{empty({5, 0, 8}), empty({5, 0, 8}), empty({5, 0, 4}),
                        sdpa::TensorView::contiguous(cu, sdpa::DType::kInt64, {3}),
                        sdpa::TensorView::contiguous(cu, sdpa::DType::kInt64, {3})};
  sdpa::VarlenOutputs outs{empty({5, 0, 4}), std::nullopt};
  EXPECT_NO_THROW(sdpa::attention_varlen(in, outs));
  const sdpa::Gradients g{empty({5, 0, 8}), empty({5, 0, 8}), empty({5, 0, 4})};
  sdpa::TensorView lse = sdpa::TensorView::contiguous(nullptr, sdpa::DType::kFloat32, {0, 5});
  EXPECT_NO_THROW(sdpa::attention_varlen_backward(in, outs.out, lse, empty({5, 0, 4}), g));
}

TEST(Varlen, BadOffsetsAreErrorsThatWriteNothing) {
  const Packed pk(kF32, 2, 1, 4, {3, 2}, {4, 4}, 1);
  GuardedTensor out(kF32, {5, 2, 4}), lse(kF32, {2, 5});
  const auto call = [&](std::vector<int64_t> cu_q, std::vector<int64_t> cu_k, DType dt = DType::kInt64) {
    return [&pk, &out, &lse, cu_q, cu_k, dt] {
      sdpa::VarlenInputs in = pk.inputs();
      std::vector<int32_t> q32(cu_q.begin(), cu_q.end());
      in.cu_seqlens_q = dt == DType::kInt32
                            ? TensorView::contiguous(q32.data(), dt, {static_cast<int64_t>(cu_q.size())})
                            : TensorView::contiguous(const_cast<int64_t*>(cu_q.data()), dt, {static_cast<int64_t>(cu_q.size())});
      in.cu_seqlens_k = TensorView::contiguous(const_cast<int64_t*>(cu_k.data()), DType::kInt64,
                                               {static_cast<int64_t>(cu_k.size())});
      sdpa::attention_varlen(in, {out.view(), lse.view()});
    };
  };
  expect_sdpa_error(call({1, 3, 5}, {0, 4, 8}), {"cu_seqlens_q[0] = 1 but must be 0"});
  expect_sdpa_error(call({0, 3, 2, 5}, {0, 4, 4, 8}), {"cu_seqlens_q[2] = 2 is less than cu_seqlens_q[1] = 3"});
  expect_sdpa_error(call({0, 3, 4}, {0, 4, 8}), {"cu_seqlens_q[2] = 4", "q has 5 rows"});
  expect_sdpa_error(call({0, 3, 5}, {0, 8}), {"cu_seqlens_q has shape (3,)", "cu_seqlens_k has shape (2,)"});
  expect_sdpa_error(call({0, 3, 5}, {0, 4, 9}), {"cu_seqlens_k[2] = 9", "k has 8 rows"});
  expect_sdpa_error(call({0, 3, 6}, {0, 4, 8}, DType::kInt32), {"cu_seqlens_q[2] = 6"});
  EXPECT_TRUE(out.untouched());
  EXPECT_TRUE(lse.untouched());
  // The whole tensors' checks, also with no sequence at all.
  GuardedTensor bad_out(kF32, {5, 2, 3});
  sdpa::VarlenInputs in = pk.inputs();
  expect_sdpa_error([&] { sdpa::attention_varlen(in, {bad_out.view(), std::nullopt}); }, {"out has shape (5, 2, 3)"});
  GuardedTensor k16(kBF16, {8, 1, 4});
  in.k = k16.view();
  expect_sdpa_error([&] { sdpa::attention_varlen(in, {out.view(), std::nullopt}); }, {"k has dtype bfloat16"});
  EXPECT_TRUE(out.untouched());
}

// Bitwise the same for any thread count (forward and backward).
TEST(Varlen, ThreadCountDoesNotChangeResults) {
  const Packed pk(kF32, 4, 1, 16, {1, 200, 3}, {3000, 200, 50}, 5);
  const int64_t tq = pk.cu_q.back(), tk = pk.cu_k.back();
  std::vector<double> got[2];
  for (int threads : {1, 2}) {
    sdpa::set_num_threads(threads);
    GuardedTensor out(kF32, {tq, 4, 16}), lse(kF32, {4, tq}), dq(kF32, {tq, 4, 16}), dk(kF32, {tk, 1, 16}),
        dv(kF32, {tk, 1, 16});
    sdpa::attention_varlen(pk.inputs(), {out.view(), lse.view()}, {});
    sdpa::attention_varlen_backward(pk.inputs(), out.view(), lse.view(), out.view(), {dq.view(), dk.view(), dv.view()});
    for (const GuardedTensor* t : {&out, &lse, &dq, &dk, &dv})
      for (double x : t->values()) got[threads - 1].push_back(x);
  }
  sdpa::set_num_threads(0);
  ASSERT_EQ(got[0].size(), got[1].size());
  for (size_t i = 0; i < got[0].size(); ++i) ASSERT_EQ(got[0][i], got[1][i]) << i;
}

}  // namespace
