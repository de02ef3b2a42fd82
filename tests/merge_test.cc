// The pieces of context parallelism (issue 29 §1): float32 partials of 16-bit calls (Outputs::out
// and the gradients in the compute type, "rounded once"), merge_attention (sdpa/merge.h) against
// a float64 twin and its derived error bound, key shards merged against the one call within the
// tolerance rule, and the backward of a key shard given the whole rows' out and lse.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "sdpa/attention.h"
#include "sdpa/merge.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::TensorView;

constexpr DType kAll[] = {kF32, kF64, kBF16, kF16};
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The float32 partial's dtype for q's dtype: the compute type (float32 for 16-bit q).
DType partial_dtype(DType q) { return compute_dtype(q); }

// Elements [k0, k1) of dim `dim` of t (a view into the same memory).
TensorView slice(TensorView t, int dim, int64_t k0, int64_t k1) {
  if (t.shape[dim] == 1) return t;  // a broadcast dim (a mask without keys) is every shard's
  t.data = static_cast<char*>(t.data) + k0 * t.strides[dim] * sdpa::dtype_size(t.dtype);
  t.shape[dim] = k1 - k0;
  return t;
}

// Shard [k0, k1) of t's keys: k, v and the mask's key columns sliced alike.
sdpa::Inputs shard_inputs(const Tensors& t, int64_t k0, int64_t k1) {
  sdpa::Inputs in = t.inputs();
  in.k = slice(in.k, in.k.rank - 2, k0, k1);
  in.v = slice(in.v, in.v.rank - 2, k0, k1);
  if (in.mask) in.mask = slice(*in.mask, in.mask->rank - 1, k0, k1);
  return in;
}

// The partials of the shards [bounds[s], bounds[s+1]) (float32 for 16-bit q), each from its own
// attention() call with `o` (sinks, if any, only in shard `sinks_shard`), then merged into an out
// of q's dtype and an lse of the compute type.
Outs merged_shards(const Tensors& t, const sdpa::Options& o, const std::vector<int64_t>& bounds, size_t sinks_shard = 0) {
  const DType dt = t.q.dtype();
  std::vector<int64_t> out_shape = t.q.shape(), lse_shape = t.q.shape();
  out_shape.back() = t.v.shape().back();
  lse_shape.pop_back();
  std::vector<GuardedTensor> outs, lses;
  std::vector<sdpa::Partial> parts;
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    outs.emplace_back(partial_dtype(dt), out_shape);
    lses.emplace_back(compute_dtype(dt), lse_shape);
  }
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    sdpa::Options shard = o;
    if (s != sinks_shard) shard.sinks = std::nullopt;
    sdpa::Outputs so;
    so.out = outs[s].view();
    so.lse = lses[s].view();
    sdpa::attention(shard_inputs(t, bounds[s], bounds[s + 1]), so, shard);
    parts.push_back({outs[s].view(), lses[s].view()});
  }
  Outs merged{GuardedTensor(dt, out_shape), std::nullopt, GuardedTensor(compute_dtype(dt), lse_shape)};
  sdpa::merge_attention(parts, merged.out.view(), merged.lse->view());
  EXPECT_TRUE(merged.guards_intact());
  return merged;
}

// ---- Float32 partials: out (and gradients) in the compute type for 16-bit inputs ----

// A 16-bit call with a float32 out writes the unrounded float32 results: rounded to q's dtype
// they are, bit for bit, the call's with an out of q's dtype (the "rounded once" promise), in
// either precision, on every backend and kernel shape (prefill, decode, causal, masked, GQA).
TEST(Float32Partials, RoundedOnceEqualsTheSixteenBitCall) {
  struct Shape {
    std::vector<int64_t> q, k, v;
    sdpa::Causal causal;
    bool mask;
  };
  const Shape shapes[] = {
      {{2, 4, 97, 64}, {2, 2, 300, 64}, {2, 2, 300, 40}, sdpa::Causal::kNone, true},   // prefill, GQA
      {{1, 8, 1, 64}, {1, 2, 1025, 64}, {1, 2, 1025, 64}, sdpa::Causal::kNone, false},  // decode
      {{3, 33, 16}, {3, 129, 16}, {3, 129, 8}, sdpa::Causal::kBottomRight, false},
  };
  for (DType dt : {kBF16, kF16}) {
    for (const sdpa::Precision precision : {sdpa::Precision::kExact, sdpa::Precision::kFast}) {
      for (const sdpa::Backend backend : {sdpa::Backend::kFlash, sdpa::Backend::kNaive, sdpa::Backend::kReference}) {
        for (const Shape& sh : shapes) {
          SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " fast=" << (precision == sdpa::Precision::kFast)
                                          << " " << backend_name(backend) << " Nq=" << sh.q[sh.q.size() - 2]);
          Tensors t = random_qkv(dt, sh.q, sh.k, sh.v, 11);
          if (sh.mask) {
            std::vector<int64_t> m = sh.q;
            m.back() = sh.k[sh.k.size() - 2];
            t.mask.emplace(DType::kBool, m);
            std::mt19937 rng(5);
            fill_mask(*t.mask, rng, 0.7, 0.1);
          }
          sdpa::Options o;
          o.backend = backend;
          o.precision = precision;
          o.causal = sh.causal;
          const Outs low = run(t, o, Layout::kContiguous, false);
          std::vector<int64_t> shape = low.out.shape(), lse_shape = sh.q;
          lse_shape.pop_back();
          Outs wide{GuardedTensor(kF32, shape, Layout::kPadded), std::nullopt, GuardedTensor(kF32, lse_shape)};
          Outs narrow{GuardedTensor(dt, shape), std::nullopt, GuardedTensor(kF32, lse_shape)};
          sdpa::attention(t.inputs(), wide.outputs(), o);
          sdpa::attention(t.inputs(), narrow.outputs(), o);
          ASSERT_TRUE(wide.guards_intact());
          const std::vector<double> w = wide.out.values(), n = narrow.out.values();
          bool some_unrounded = false;
          for (size_t x = 0; x < w.size(); ++x) {
            ASSERT_EQ(round_to(dt, w[x]), n[x]) << "element " << x << ": float32 " << w[x];
            some_unrounded = some_unrounded || round_to(dt, w[x]) != w[x];
          }
          EXPECT_TRUE(some_unrounded) << "the float32 out holds only 16-bit values: it was rounded";
          EXPECT_EQ(wide.lse->values(), narrow.lse->values());
          EXPECT_EQ(low.out.values(), n);
        }
      }
    }
  }
}

// attention_varlen takes the float32 out too (make_problem's rule), with the same bits.
TEST(Float32Partials, Varlen) {
  for (DType dt : {kBF16, kF16}) {
    const Tensors t = random_qkv(dt, {9, 4, 32}, {12, 2, 32}, {12, 2, 16}, 3);
    std::vector<int64_t> cu_q = {0, 4, 9}, cu_k = {0, 5, 12};
    sdpa::VarlenInputs in{t.q.view(), t.k.view(), t.v.view(), TensorView::contiguous(cu_q.data(), DType::kInt64, {3}),
                          TensorView::contiguous(cu_k.data(), DType::kInt64, {3})};
    GuardedTensor wide(kF32, {9, 4, 16}), narrow(dt, {9, 4, 16});
    sdpa::attention_varlen(in, {wide.view(), std::nullopt});
    sdpa::attention_varlen(in, {narrow.view(), std::nullopt});
    const std::vector<double> w = wide.values(), n = narrow.values();
    for (size_t x = 0; x < w.size(); ++x) ASSERT_EQ(round_to(dt, w[x]), n[x]) << sdpa::dtype_name(dt) << " " << x;
  }
}

// dq, dk and dv in float32 for 16-bit inputs: rounded, the 16-bit gradients bit for bit; dout
// in float32 beside a 16-bit out is accepted (each of q's dtype or the compute type).
TEST(Float32Partials, GradientsRoundedOnce) {
  for (DType dt : {kBF16, kF16}) {
    for (const sdpa::Precision precision : {sdpa::Precision::kExact, sdpa::Precision::kFast}) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " fast=" << (precision == sdpa::Precision::kFast));
      sdpa::Options o;
      o.precision = precision;
      const Problem p = make_problem(random_qkv(dt, {2, 4, 70, 32}, {2, 2, 150, 32}, {2, 2, 150, 24}, 9), o,
                                     Layout::kContiguous, 4);
      const Grads narrow = backward(p, o);
      Grads wide{GuardedTensor(kF32, p.t.q.shape()), GuardedTensor(kF32, p.t.k.shape()), GuardedTensor(kF32, p.t.v.shape())};
      sdpa::attention_backward(p.t.inputs(), p.out.view(), p.lse.view(), p.dout.view(), wide.gradients(), o);
      const GradValues w = values(wide), n = values(narrow);
      for (int g = 0; g < 3; ++g) {
        for (size_t x = 0; x < w.g[g].size(); ++x) ASSERT_EQ(round_to(dt, w.g[g][x]), n.g[g][x]) << kGradNames[g] << " " << x;
      }
      // A float32 dout and out holding the 16-bit ones' values: the same gradients (on the SIMD
      // path: a bfloat16 dout would otherwise take AVX512_BF16's products, which a float32 one
      // cannot, and those keep the error bound, not the bits).
      const KernelPathCap simd(sdpa::KernelPath::kSimd);
      const GuardedTensor dout32 = p.dout.converted(kF32, Layout::kContiguous);
      const GuardedTensor out32 = p.out.converted(kF32, Layout::kContiguous);
      Grads again = empty_grads(p.t, Layout::kContiguous);
      sdpa::attention_backward(p.t.inputs(), out32.view(), p.lse.view(), dout32.view(), again.gradients(), o);
      EXPECT_TRUE(bitwise_equal(values(again), values(backward(p, o))));
    }
  }
}

TEST(Float32Partials, OtherDtypesAreErrors) {
  const Tensors t = random_qkv(kBF16, {2, 3, 4}, {2, 5, 4}, {2, 5, 6}, 1);
  GuardedTensor out16(kF16, {2, 3, 6}), out64(kF64, {2, 3, 6});
  expect_sdpa_error([&] { sdpa::attention(t.inputs(), {out16.view()}); },
                    {"out has dtype float16 but must be q's dtype bfloat16 or the compute type float32"});
  expect_sdpa_error([&] { sdpa::attention(t.inputs(), {out64.view()}); }, {"out has dtype float64"});
  EXPECT_TRUE(out16.untouched());
  const Tensors t32 = random_qkv(kF32, {2, 3, 4}, {2, 5, 4}, {2, 5, 6}, 1);
  expect_sdpa_error([&] { sdpa::attention(t32.inputs(), {out64.view()}); }, {"out has dtype float64 but q has dtype float32"});
  EXPECT_TRUE(out64.untouched());
}

// ---- merge_attention against its float64 twin ----

// The merge the header writes, in float64, a deliberately simple loop: parts' out (rows x Dv)
// and lse (rows) in C order.
struct Merged {
  std::vector<double> out, lse;
};
Merged merge_twin(const std::vector<std::vector<double>>& outs, const std::vector<std::vector<double>>& lses,
                  int64_t rows, int64_t Dv) {
  Merged m{std::vector<double>(static_cast<size_t>(rows * Dv)), std::vector<double>(static_cast<size_t>(rows))};
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -kInf;
    for (const auto& l : lses) mx = std::max(mx, l[r]);
    if (mx == -kInf) {
      m.lse[r] = -kInf;
      continue;  // out stays 0
    }
    double sum = 0;
    for (const auto& l : lses) sum += std::exp(l[r] - mx);
    for (int64_t e = 0; e < Dv; ++e) {
      double acc = 0;
      for (size_t s = 0; s < outs.size(); ++s)
        if (lses[s][r] != -kInf) acc += std::exp(lses[s][r] - mx) * outs[s][r * Dv + e];
      m.out[r * Dv + e] = acc / sum;
    }
    m.lse[r] = mx + std::log(sum);
  }
  return m;
}

// The bound of the header (sdpa/merge.h), per row, first order, u the compute type's unit
// roundoff, k the parts of finite lse, M their largest |out| in the row:
//   w_s = exp(lse_s - m): the difference rounds by u·|lse_s - m| = u·|d| (a relative change of
//     exp(-d) of u·|d|, so an absolute change of at most u·|d|·e^-d <= u/e, as Σ_s w_s >= 1),
//     exp by 2u (1 ulp) relative: |ŵ_s - w_s| <= 2u·w_s + u/e.
//   out = Σ ŵ_s out_s / Σ ŵ_s moves by Σ_s |ŵ_s - w_s|·|out_s - out| / Σ w_s <= 2M·(2u + k·u/e);
//     the numerator's k products and sums by k·u·M, the denominator's k - 1 sums by (k - 1)·u·M,
//     the division by u·M:  |Δout| <= u·M·((2 + 2/e)·k + 4).
//   Σ ŵ_s moves by (2u + k·u/e + (k - 1)·u) relative, so its log by that; log's own 2u·log(k),
//     m + log(..) by u·|lse|:  |Δlse| <= u·((1 + 1/e)·k + 1 + 2·log(k) + |lse|).
// Storing adds the output dtype's eps·|x| (half an ulp, and another for a float64 result bound
// for 16 bits through float32).
struct Bound {
  double out, lse;
};
Bound merge_bound(const std::vector<std::vector<double>>& outs, const std::vector<std::vector<double>>& lses,
                  int64_t r, int64_t Dv, double lse, DType compute, DType out_dtype, DType lse_dtype) {
  double k = 0, M = 0;
  for (size_t s = 0; s < outs.size(); ++s) {
    if (lses[s][r] == -kInf) continue;
    k += 1;
    for (int64_t e = 0; e < Dv; ++e) M = std::max(M, std::abs(outs[s][r * Dv + e]));
  }
  const double u = eps(compute) / 2, e = std::exp(1.0), L = std::isfinite(lse) ? std::abs(lse) : 0;
  const double store_out = out_dtype == compute ? 0 : eps(out_dtype), store_lse = lse_dtype == compute ? 0 : eps(lse_dtype);
  return {u * M * ((2 + 2 / e) * k + 4) + store_out * M,
          u * ((1 + 1 / e) * k + 1 + 2 * std::log(std::max(k, 1.0)) + L) + store_lse * L};
}

struct MergeCase {
  std::vector<DType> out_dtypes, lse_dtypes;  // per part
  DType out, lse;                             // the outputs'
};

// Random partials (lse spread over [-40, 40], some -inf, some rows -inf in every part; out
// normal), merged, against the twin within the bound; bitwise the same for 1, 3 and the default
// thread count; in place (out and lse being part 0's) bitwise the out-of-place result.
TEST(MergeAttention, MatchesTheFloat64TwinWithinTheDerivedBound) {
  const std::vector<MergeCase> cases = {
      {{kF32}, {kF32}, kF32, kF32},
      {{kF32, kF32}, {kF32, kF32}, kF32, kF32},
      {{kF32, kF32, kF32, kF32, kF32, kF32, kF32}, {kF32, kF32, kF32, kF32, kF32, kF32, kF32}, kF32, kF32},
      {{kF32, kF32, kF32}, {kF32, kF32, kF32}, kBF16, kF32},
      {{kF32, kF32, kF32}, {kF32, kF32, kF32}, kF16, kF32},
      {{kBF16, kF16, kF32}, {kF32, kF32, kF32}, kF32, kF32},
      {{kF64, kF64, kF64}, {kF64, kF64, kF64}, kF64, kF64},
      {{kF32, kF64, kF32}, {kF32, kF32, kF64}, kF32, kF32},  // float64 somewhere: merged in float64
      {{kF64, kF64}, {kF64, kF64}, kBF16, kF32},
  };
  const std::vector<int64_t> lead = {2, 3, 17};
  const int64_t rows = 2 * 3 * 17, Dv = 33;
  std::mt19937 rng(7);
  for (size_t c = 0; c < cases.size(); ++c) {
    const MergeCase& mc = cases[c];
    SCOPED_TRACE(testing::Message() << "case " << c << ": " << mc.out_dtypes.size() << " parts");
    bool f64 = mc.out == kF64 || mc.lse == kF64;
    std::vector<GuardedTensor> outs, lses;
    std::vector<std::vector<double>> out_values, lse_values;
    std::uniform_real_distribution<double> spread(-40, 40);
    for (size_t s = 0; s < mc.out_dtypes.size(); ++s) {
      f64 = f64 || mc.out_dtypes[s] == kF64 || mc.lse_dtypes[s] == kF64;
      outs.emplace_back(mc.out_dtypes[s], std::vector<int64_t>{2, 3, 17, Dv}, s % 2 ? Layout::kPermuted : Layout::kPadded);
      lses.emplace_back(mc.lse_dtypes[s], lead, s % 2 ? Layout::kPadded : Layout::kContiguous, false);
      fill_normal(outs[s], rng, 3.0);
      std::vector<double> l(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const bool empty_row = r % 11 == 0;  // -inf in every part
        l[r] = empty_row || (r + static_cast<int64_t>(s)) % 5 == 0 ? -kInf : spread(rng);
      }
      if (s == 0) l[1] = 200;  // the others underflow next to it
      lses[s].set_values(l);
      out_values.push_back(outs[s].values());
      lse_values.push_back(lses[s].values());
    }
    std::vector<sdpa::Partial> parts;
    for (size_t s = 0; s < outs.size(); ++s) parts.push_back({outs[s].view(), lses[s].view()});
    const DType compute = f64 ? kF64 : kF32;
    const Merged twin = merge_twin(out_values, lse_values, rows, Dv);

    GuardedTensor out(mc.out, {2, 3, 17, Dv}, Layout::kPermuted), lse(mc.lse, lead, Layout::kPadded, false);
    sdpa::merge_attention(parts, out.view(), lse.view());
    ASSERT_TRUE(out.guards_intact());
    ASSERT_TRUE(lse.guards_intact());
    const std::vector<double> got = out.values(), got_lse = lse.values();
    for (int64_t r = 0; r < rows; ++r) {
      const Bound b = merge_bound(out_values, lse_values, r, Dv, twin.lse[r], compute, mc.out, mc.lse);
      if (twin.lse[r] == -kInf) {
        ASSERT_EQ(got_lse[r], -kInf) << "row " << r;
      } else {
        ASSERT_LE(std::abs(got_lse[r] - twin.lse[r]), b.lse) << "lse, row " << r;
      }
      for (int64_t e = 0; e < Dv; ++e) {
        const double g = got[r * Dv + e], want = twin.out[r * Dv + e];
        if (twin.lse[r] == -kInf) {
          ASSERT_TRUE(g == 0 && !std::signbit(g)) << "row " << r << ": an empty row's out is +0, got " << g;
        } else {
          ASSERT_LE(std::abs(g - want), b.out) << "out[" << r << ", " << e << "] = " << g << ", twin " << want;
        }
      }
    }
    // Any thread count: the same bits.
    for (int threads : {1, 3}) {
      sdpa::set_num_threads(threads);
      GuardedTensor again(mc.out, {2, 3, 17, Dv}), again_lse(mc.lse, lead);
      sdpa::merge_attention(parts, again.view(), again_lse.view());
      sdpa::set_num_threads(0);
      EXPECT_EQ(again.values(), got) << threads << " threads";
      EXPECT_EQ(again_lse.values(), got_lse) << threads << " threads";
    }
    // In place into the last part (each row reads all its parts before writing), then part 0.
    const size_t last = outs.size() - 1;
    if (last > 0 && mc.out_dtypes[last] == mc.out && mc.lse_dtypes[last] == mc.lse) {
      sdpa::merge_attention(parts, outs[last].view(), lses[last].view());
      EXPECT_EQ(outs[last].values(), got) << "in place, last part";
      EXPECT_EQ(lses[last].values(), got_lse) << "in place, last part";
      outs[last].set_values(out_values[last]);
      lses[last].set_values(lse_values[last]);
    }
    // In place: out is part 0's out, lse part 0's lse (same dtype as the outputs' here).
    if (mc.out_dtypes[0] == mc.out && mc.lse_dtypes[0] == mc.lse) {
      sdpa::merge_attention(parts, outs[0].view(), lses[0].view());
      EXPECT_EQ(outs[0].values(), got) << "in place";
      EXPECT_EQ(lses[0].values(), got_lse) << "in place";
    }
  }
}

// A part of weight 0 is not read: lse -inf beside NaN out, or an lse so far below the row's
// largest that exp underflows; a single part merges to itself exactly (w = 1, out / 1).
TEST(MergeAttention, WeightZeroPartsAreNotRead) {
  const GuardedTensor a = tensor(kF32, {2, 2}, {1.5, -2.0, 3.0, 4.0}), la = tensor(kF32, {2}, {0.25, 1000.0});
  const GuardedTensor b = tensor(kF32, {2, 2}, {kNaN, kInf, kNaN, -kInf}), lb = tensor(kF32, {2}, {-kInf, 0.0});
  GuardedTensor out(kF32, {2, 2}), lse(kF32, {2});
  const sdpa::Partial parts[] = {{a.view(), la.view()}, {b.view(), lb.view()}};
  sdpa::merge_attention(parts, out.view(), lse.view());
  EXPECT_EQ(out.values(), a.values());
  EXPECT_EQ(lse.values(), la.values());
}

// No rows: nothing to read or write. Dv = 0: no out to merge, but the lse still merge.
TEST(MergeAttention, ZeroSizes) {
  const GuardedTensor a(kF32, {2, 0, 4}), la(kF32, {2, 0});
  GuardedTensor out(kF32, {2, 0, 4}), lse(kF32, {2, 0});
  const sdpa::Partial none[] = {{a.view(), la.view()}, {a.view(), la.view()}};
  sdpa::merge_attention(none, out.view(), lse.view());
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(lse.guards_intact());

  const GuardedTensor b(kF32, {3, 0}), lb = tensor(kF32, {3}, {0.0, -kInf, 1.0});
  const GuardedTensor lc = tensor(kF32, {3}, {0.0, -kInf, -kInf});
  GuardedTensor o2(kF32, {3, 0}), l2(kF32, {3});
  const sdpa::Partial parts[] = {{b.view(), lb.view()}, {b.view(), lc.view()}};
  sdpa::merge_attention(parts, o2.view(), l2.view());
  const std::vector<double> got = l2.values();
  EXPECT_EQ(got[0], static_cast<double>(std::log(2.0f)));  // m + log(1 + 1), in float32
  EXPECT_EQ(got[1], -kInf);
  EXPECT_EQ(got[2], 1.0);
}

TEST(MergeAttention, Errors) {
  const GuardedTensor a(kF32, {2, 3, 4}), la(kF32, {2, 3});
  GuardedTensor b = tensor(kF32, {2, 3, 4}, std::vector<double>(24, 1.0)), lb = tensor(kF32, {2, 3}, std::vector<double>(6, 0.0));
  const GuardedTensor wrong(kF32, {2, 5, 4}), lse_bf16(kBF16, {2, 3}), lse_wrong(kF32, {2, 4});
  GuardedTensor out(kBF16, {2, 3, 4}), lse(kF32, {2, 3});
  auto call = [&](std::vector<sdpa::Partial> parts, TensorView o, TensorView l) {
    return [=] { sdpa::merge_attention(parts, o, l); };
  };
  expect_sdpa_error(call({}, out.view(), lse.view()), {"parts is empty"});
  expect_sdpa_error(call({{b.view(), lb.view()}, {wrong.view(), la.view()}}, out.view(), lse.view()),
                    {"parts[1].out has shape (2, 5, 4) but out has shape (2, 3, 4)"});
  const GuardedTensor flat(kF32, {6, 4});
  expect_sdpa_error(call({{b.view(), lb.view()}, {flat.view(), la.view()}}, out.view(), lse.view()),
                    {"parts[1].out has shape (6, 4) (rank 2) but out has shape (2, 3, 4) (rank 3)"});
  expect_sdpa_error(call({{b.view(), lse_wrong.view()}}, out.view(), lse.view()),
                    {"parts[0].lse has shape (2, 4) but out without its last dim has shape (2, 3)"});
  expect_sdpa_error(call({{b.view(), lb.view()}, {b.view(), lse_bf16.view()}}, out.view(), lse.view()),
                    {"parts[1].lse has dtype bfloat16 but must be float32 or float64"});
  expect_sdpa_error(call({{b.view(), lb.view()}}, out.view(), lse_wrong.view()), {"lse has shape (2, 4)"});
  TensorView broadcast = out.view();
  broadcast.strides[1] = 0;
  expect_sdpa_error(call({{b.view(), lb.view()}}, broadcast, lse.view()), {"out has stride 0 in dim 1"});
  lb.set(4, kInf);
  expect_sdpa_error(call({{b.view(), lb.view()}, {b.view(), lb.view()}}, out.view(), lse.view()),
                    {"parts[0].lse has +inf at index (1, 1)"});
  lb.set(4, 0.0);
  GuardedTensor lnan = tensor(kF32, {2, 3}, {0, 0, kNaN, 0, 0, 0});
  expect_sdpa_error(call({{b.view(), lb.view()}, {b.view(), lnan.view()}}, out.view(), lse.view()),
                    {"parts[1].lse has NaN at index (0, 2)"});
  EXPECT_TRUE(out.untouched());
  EXPECT_TRUE(lse.untouched());
}

// ---- Key shards: the merged partials against the one call ----

struct ShardCase {
  std::vector<int64_t> q, k, v;
  std::vector<int64_t> bounds;  // shard s is keys [bounds[s], bounds[s + 1])
  MaskKind mask;
  std::vector<int64_t> mask_shape;
};

// For every dtype: key shards (one key, none, a whole tile, odd sizes) merged from float32
// partials equal the one call within the tolerance rule; bool and additive masks with fully
// masked rows, and a shard whose keys the mask blocks for every row; sinks given to exactly one
// shard; GQA, Nq != Nk, Dk != Dv. Structure exact: an empty row is out 0, lse -inf (or the sink).
TEST(KeyShards, MergedPartialsMatchTheOneCall) {
  const std::vector<ShardCase> cases = {
      {{2, 4, 97, 24}, {2, 2, 1025, 24}, {2, 2, 1025, 40}, {0, 1, 128, 600, 600, 1025}, MaskKind::kBool, {2, 4, 97, 1025}},
      {{3, 1, 40}, {3, 300, 40}, {3, 300, 17}, {0, 97, 256, 300}, MaskKind::kAdditive, {300}},
      {{1, 8}, {130, 8}, {130, 8}, {0, 64, 130}, MaskKind::kNone, {}},
  };
  for (const ShardCase& sc : cases) {
    for (DType dt : kAll) {
      for (bool sinks : {false, true}) {
        SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << sc.q[sc.q.size() - 2]
                                        << " shards=" << sc.bounds.size() - 1 << " sinks=" << sinks);
        Tensors t = random_qkv(dt, sc.q, sc.k, sc.v, 21);
        if (sc.mask != MaskKind::kNone) {
          t.mask.emplace(sc.mask == MaskKind::kBool ? DType::kBool : dt, sc.mask_shape);
          std::mt19937 rng(8);
          fill_mask(*t.mask, rng, 0.7, 0.1);
          // Shard [128, 600) blocked for every row of the first head: a fully masked partial.
          if (sc.mask_shape.size() == 4) {
            for (int64_t i = 0; i < sc.q[2]; ++i)
              for (int64_t j = 128; j < 600; ++j) t.mask->set(i * sc.mask_shape[3] + j, 0.0);
          }
        }
        const int64_t Hq = sc.q.size() >= 3 ? sc.q[sc.q.size() - 3] : 1;
        std::vector<double> sink_values(static_cast<size_t>(Hq));
        for (int64_t h = 0; h < Hq; ++h) sink_values[h] = 0.5 * static_cast<double>(h) - 1.0;
        sdpa::Options o;
        if (sinks) o.sinks = TensorView::contiguous(sink_values.data(), kF64, {Hq});
        const Outs merged = merged_shards(t, o, sc.bounds, /*sinks_shard=*/1);
        EXPECT_TRUE(matches_reference(t, o, merged));
        EXPECT_TRUE(blocked_are_exact(t, o, merged));
      }
    }
  }
}

// The same partials in the same order merge to the same bits, run after run; and each partial
// call's float32 out is the unrounded one (a 16-bit out of the shard rounds it).
TEST(KeyShards, FixedOrderIsBitwiseReproducible) {
  for (DType dt : kAll) {
    const Tensors t = random_qkv(dt, {2, 4, 50, 16}, {2, 4, 333, 16}, {2, 4, 333, 16}, 5);
    const std::vector<int64_t> bounds = {0, 100, 128, 256, 333};
    const Outs a = merged_shards(t, {}, bounds);
    sdpa::set_num_threads(1);
    const Outs b = merged_shards(t, {}, bounds);
    sdpa::set_num_threads(0);
    EXPECT_TRUE(bitwise_equal(a, b)) << sdpa::dtype_name(dt);
  }
}

// ---- The backward of a key shard ----

// Given the whole rows' out and lse, attention_backward on one shard's keys gives that shard's
// rows of dk and dv and its term of dq: the float32 (compute type) dq terms summed over the shards
// in order, rounded once to q's dtype, and the shards' dk, dv written into their slices of one
// tensor, against kReference's gradients of the one call within the backward's tolerance rule.
TEST(KeyShards, BackwardOfAShardIsItsPartOfTheOneCall) {
  const std::vector<ShardCase> cases = {
      {{2, 4, 61, 24}, {2, 2, 257, 24}, {2, 2, 257, 40}, {0, 1, 128, 128, 200, 257}, MaskKind::kBool, {2, 4, 61, 257}},
      {{3, 45, 16}, {3, 97, 16}, {3, 97, 8}, {0, 50, 97}, MaskKind::kAdditive, {45, 97}},
      {{2, 4, 33, 16}, {2, 1, 150, 16}, {2, 1, 150, 16}, {0, 75, 150}, MaskKind::kNone, {}},
  };
  for (const ShardCase& sc : cases) {
    for (DType dt : kAll) {
      SCOPED_TRACE(testing::Message() << sdpa::dtype_name(dt) << " Nq=" << sc.q[sc.q.size() - 2]
                                      << " shards=" << sc.bounds.size() - 1);
      Tensors t = random_qkv(dt, sc.q, sc.k, sc.v, 31);
      if (sc.mask != MaskKind::kNone) {
        t.mask.emplace(sc.mask == MaskKind::kBool ? DType::kBool : dt, sc.mask_shape);
        std::mt19937 rng(9);
        fill_mask(*t.mask, rng, 0.7, 0.1);
      }
      const sdpa::Options o;
      const Problem p = make_problem(std::move(t), o, Layout::kContiguous, 6);
      Expected e;
      ASSERT_TRUE(expected(p, o, e));
      Grads got = empty_grads(p.t, Layout::kContiguous);
      const int q_rank = p.t.q.rank();
      std::vector<double> dq(static_cast<size_t>(p.t.q.numel()), 0.0);
      for (size_t s = 0; s + 1 < sc.bounds.size(); ++s) {
        const int64_t k0 = sc.bounds[s], k1 = sc.bounds[s + 1];
        GuardedTensor dq_s(compute_dtype(dt), p.t.q.shape());
        const sdpa::Gradients g{dq_s.view(), slice(got.dk.view(), q_rank - 2, k0, k1),
                                slice(got.dv.view(), q_rank - 2, k0, k1)};
        sdpa::attention_backward(shard_inputs(p.t, k0, k1), p.out.view(), p.lse.view(), p.dout.view(), g, o);
        const std::vector<double> part = dq_s.values();
        for (size_t x = 0; x < dq.size(); ++x) dq[x] = round_to(compute_dtype(dt), dq[x] + part[x]);  // in the compute type
      }
      for (double& x : dq) x = round_to(dt, x);
      got.dq.set_values(dq);
      ASSERT_TRUE(got.guards_intact());
      EXPECT_TRUE(matches(e, got));
    }
  }
}

}  // namespace
