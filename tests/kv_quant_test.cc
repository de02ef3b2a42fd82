// 8-bit K/V (KVQuant): the call on int8 / uint8 k and v with their scales (and zero points)
// equals, bit for bit, the same call on float32 k and v holding the dequantised values
// fl32(fl32(x - z) · s) (computed here by the test's own quantiser), on dense, seqlens_k, varlen
// and paged calls, every backend, with and without AVX-512; matches kReference by the tolerance
// rule; and every malformed argument is an Error naming it, with nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <random>
#include <string>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace sdpa_test {
namespace {

using sdpa::Causal;
using sdpa::DType;
using sdpa::TensorView;

TensorView view_of(const float* data, const std::vector<int64_t>& shape) {
  TensorView t;
  t.data = const_cast<float*>(data);
  t.dtype = DType::kFloat32;
  t.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) t.shape[d] = shape[d], t.strides[d] = stride, stride *= shape[d];
  return t;
}

// Random 8-bit values of `shape` (rank 2..4, last dim D), random positive float32 scales (and
// integral zero points for uint8), one per row (G = 0: the scale view has no group dim) or G
// per row; deq holds KVQuant's rule's values, computed here.
struct Quantized {
  GuardedTensor x, deq;
  std::vector<float> scale, zero;
  std::vector<int64_t> scale_shape;
  Quantized(DType dtype, const std::vector<int64_t>& shape, int64_t G, std::mt19937& rng)
      : x(dtype, shape), deq(DType::kFloat32, shape) {
    const int64_t D = shape.back(), groups = G == 0 ? 1 : G, rows = x.numel() / std::max<int64_t>(D, 1);
    scale_shape.assign(shape.begin(), shape.end() - 1);
    if (G != 0) scale_shape.push_back(G);
    std::uniform_real_distribution<float> s(0.002f, 0.05f);
    std::uniform_int_distribution<int> value(dtype == DType::kInt8 ? -127 : 0, dtype == DType::kInt8 ? 127 : 255);
    std::uniform_int_distribution<int> z(100, 150);
    for (int64_t i = 0; i < rows * groups; ++i) {
      scale.push_back(s(rng));
      zero.push_back(dtype == DType::kUInt8 ? static_cast<float>(z(rng)) : 0.0f);
    }
    for (int64_t i = 0; i < x.numel(); ++i) {
      const int64_t row = i / D, g = (i % D) / (D / groups);
      const int v = value(rng);
      x.set(i, v);
      const float centred = static_cast<float>(v) - zero[static_cast<size_t>(row * groups + g)];
      deq.set(i, centred * scale[static_cast<size_t>(row * groups + g)]);
    }
  }
  TensorView scale_view() const { return view_of(scale.data(), scale_shape); }
  TensorView zero_view() const { return view_of(zero.data(), scale_shape); }
};

sdpa::KVQuant kv_quant_of(const Quantized& k, const Quantized& v) {
  sdpa::KVQuant q;
  q.k_scale = k.scale_view();
  q.v_scale = v.scale_view();
  if (k.x.dtype() == DType::kUInt8) q.k_zero = k.zero_view(), q.v_zero = v.zero_view();
  return q;
}

struct QCase {
  std::string name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  DType q_dtype, kv_dtype;
  int64_t Gk = 0, Gv = 0;  // 0: a scale per (token, head)
  MaskKind mask = MaskKind::kNone;
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  double softcap = 0;
  bool alibi = false, sinks = false, seqlens = false, block_mask = false;
  bool batch_invariant = false;
};

std::vector<QCase> cases() {
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16, i8 = DType::kInt8,
              u8 = DType::kUInt8;
  std::vector<QCase> c;
  c.push_back({"decode_gqa_i8", 2, 8, 2, 1, 97, 64, 64, f32, i8});
  c.push_back({"decode_gqa_u8_groups", 2, 8, 2, 1, 1025, 64, 32, f32, u8, 4, 2});
  c.push_back({"decode_bf16_u8", 1, 4, 1, 1, 300, 128, 128, bf16, u8, 0, 8});
  c.push_back({"decode_f16_i8_seqlens", 2, 4, 2, 1, 97, 32, 32, f16, i8, 2, 0, MaskKind::kNone, Causal::kNone, {}, 0,
               false, false, true});
  c.push_back({"tiny", 1, 1, 1, 1, 1, 1, 1, f32, i8});
  // float32 q reads 8-bit K/V in place (kv_dequant.h's fused calls): a scale per token with D
  // not a multiple of the lanes (the decode kernel's feature tails); groups of 16 features
  // (whole vectors) beside a scale per token; groups of 8, 4 and 1 (several per vector:
  // RowReader's Spread; 8 is a whole AVX2 vector); groups of 12 (neither: the float32 stand-in
  // call); a prefill on the block kernel with groups of 16.
  c.push_back({"decode_f32_i8_odd_d", 1, 8, 2, 1, 300, 97, 33, f32, i8});
  c.push_back({"decode_f32_u8_groups16_v_per_token", 1, 4, 4, 2, 513, 48, 32, f32, u8, 3, 0});
  c.push_back({"decode_f32_u8_groups8", 2, 4, 1, 1, 200, 64, 64, f32, u8, 8, 8});
  c.push_back({"decode_f32_i8_groups4_and_1", 1, 8, 2, 1, 130, 64, 40, f32, i8, 16, 40});
  c.push_back({"decode_f32_u8_groups4_odd_d", 1, 4, 2, 2, 97, 36, 20, f32, u8, 9, 5});
  c.push_back({"decode_f32_i8_groups12", 1, 4, 1, 1, 150, 48, 48, f32, i8, 4, 4});
  c.push_back({"prefill_f32_i8_groups16", 1, 4, 2, 65, 130, 32, 48, f32, i8, 2, 3, MaskKind::kNone,
               Causal::kBottomRight});
  c.push_back({"prefill_causal_u8", 1, 4, 4, 97, 97, 32, 16, f32, u8, 0, 0, MaskKind::kNone, Causal::kBottomRight});
  c.push_back({"prefill_bf16_mask", 2, 4, 2, 33, 200, 48, 24, bf16, i8, 3, 4, MaskKind::kAdditive});
  c.push_back({"prefill_f16_boolmask", 1, 2, 1, 40, 130, 16, 16, f16, u8, 0, 0, MaskKind::kBool, Causal::kTopLeft});
  c.push_back({"window_softcap", 1, 2, 2, 64, 257, 32, 32, f32, i8, 0, 0, MaskKind::kNone, Causal::kBottomRight,
               {16, 0}, 30.0});
  c.push_back({"alibi_sinks_seqlens", 2, 4, 2, 17, 150, 32, 32, f32, u8, 2, 2, MaskKind::kNone, Causal::kNone, {}, 0,
               true, true, true});
  c.push_back({"block_mask", 1, 2, 1, 130, 600, 32, 32, f32, i8, 0, 0, MaskKind::kNone, Causal::kNone, {}, 0, false,
               false, false, true});
  c.push_back({"bf16_block_mask_causal", 1, 2, 2, 129, 300, 64, 64, bf16, u8, 4, 4, MaskKind::kNone,
               Causal::kBottomRight, {}, 0, false, false, false, true});
  return c;
}

struct Built {
  Tensors t32;  // the float32 call: q (widened for 16-bit q), k and v the dequantised values
  GuardedTensor q;
  std::optional<GuardedTensor> mask;
  Quantized k, v;
  std::vector<float> alibi, sinks;
  std::vector<uint8_t> blocks;
  std::vector<int64_t> block_shape;
  sdpa::Options options;
};

Built build(const QCase& c) {
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(c.name)));
  Quantized k(c.kv_dtype, {c.B, c.Hkv, c.Nk, c.Dk}, c.Gk, rng);
  Quantized v(c.kv_dtype, {c.B, c.Hkv, c.Nk, c.Dv}, c.Gv, rng);
  GuardedTensor q(c.q_dtype, {c.B, c.Hq, c.Nq, c.Dk});
  fill_normal(q, rng);
  std::optional<GuardedTensor> mask;
  if (c.mask != MaskKind::kNone) {
    mask.emplace(c.mask == MaskKind::kBool ? DType::kBool : c.q_dtype, std::vector<int64_t>{c.B, c.Hq, c.Nq, c.Nk});
    fill_mask(*mask, rng, 0.7, 0.1);
    for (int64_t j = 0; j < c.Nk; ++j) mask->set(j, c.mask == MaskKind::kBool ? 0.0 : -kInf);  // row 0 fully masked
  }
  Tensors t32{q.converted(DType::kFloat32, Layout::kContiguous), k.deq.converted(DType::kFloat32, Layout::kContiguous),
              v.deq.converted(DType::kFloat32, Layout::kContiguous),
              mask ? std::optional<GuardedTensor>(mask->dtype() == DType::kBool
                                                      ? mask->converted(DType::kBool, Layout::kContiguous)
                                                      : mask->converted(DType::kFloat32, Layout::kContiguous))
                   : std::nullopt};
  Built b{std::move(t32), std::move(q), std::move(mask), std::move(k), std::move(v), {}, {}, {}, {}, {}};
  if (c.seqlens) {
    for (int64_t i = 0; i < c.B; ++i) b.t32.seqlens_k.push_back(i == 0 ? c.Nk / 2 : c.Nk - 3);
  }
  sdpa::Options& o = b.options;
  o.batch_invariant = c.batch_invariant;
  o.causal = c.causal;
  o.window = c.window;
  o.softcap = c.softcap;
  if (c.alibi) {
    for (int64_t h = 0; h < c.Hq; ++h) b.alibi.push_back(0.5f / static_cast<float>(h + 1));
    o.alibi_slopes = view_of(b.alibi.data(), {c.Hq});
  }
  if (c.sinks) {
    for (int64_t h = 0; h < c.Hq; ++h) b.sinks.push_back(0.25f * static_cast<float>(h));
    o.sinks = view_of(b.sinks.data(), {c.Hq});
  }
  if (c.block_mask) {
    o.block_q = 64;
    o.block_k = 128;
    b.block_shape = {(c.Nq + 63) / 64, (c.Nk + 127) / 128};
    for (int64_t i = 0; i < b.block_shape[0] * b.block_shape[1]; ++i) b.blocks.push_back(static_cast<uint8_t>(i % 3 != 1));
    TensorView m;
    m.data = b.blocks.data();
    m.dtype = DType::kBool;
    m.rank = 2;
    m.shape[0] = b.block_shape[0], m.shape[1] = b.block_shape[1];
    m.strides[0] = b.block_shape[1], m.strides[1] = 1;
    o.block_mask = m;
  }
  return b;
}

// The 8-bit call: out in `out_dtype`, weights and lse (float32) when with_extras.
Outs run_8bit(const Built& b, const QCase& c, const sdpa::Options& options, DType out_dtype, bool with_extras) {
  Outs outs{GuardedTensor(out_dtype, {c.B, c.Hq, c.Nq, c.Dv}), std::nullopt, std::nullopt};
  if (with_extras) {
    outs.weights.emplace(DType::kFloat32, std::vector<int64_t>{c.B, c.Hq, c.Nq, c.Nk});
    outs.lse.emplace(DType::kFloat32, std::vector<int64_t>{c.B, c.Hq, c.Nq});
  }
  sdpa::Inputs in = b.t32.inputs();
  in.q = b.q.view();
  in.k = b.k.x.view();
  in.v = b.v.x.view();
  if (b.mask) in.mask = b.mask->view();
  in.kv_quant = kv_quant_of(b.k, b.v);
  sdpa::attention(in, outs.outputs(), options);
  return outs;
}

testing::AssertionResult same_bits(const char* what, const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    if (!both_nan && (got[i] != want[i] || std::signbit(got[i]) != std::signbit(want[i]))) {
      return testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << " but the float32 call's is "
                                         << want[i];
    }
  }
  return testing::AssertionSuccess();
}

// The 8-bit call against the float32 call on the dequantised values, bit for bit.
void check_case(const QCase& c, sdpa::Backend backend) {
  SCOPED_TRACE(c.name + " backend " + backend_name(backend));
  const Built b = build(c);
  sdpa::Options o = b.options;
  o.backend = backend;
  const bool extras = c.Nq * c.Nk <= 200000;
  const Outs want = run(b.t32, o, Layout::kContiguous, extras);
  // out in q's dtype: the float32 call's out rounded once.
  const Outs got = run_8bit(b, c, o, c.q_dtype, extras);
  EXPECT_TRUE(same_bits("out", got.out.values(), want.out.converted(c.q_dtype, Layout::kContiguous).values()));
  if (extras) {
    EXPECT_TRUE(same_bits("weights", got.weights->values(), want.weights->values()));
    EXPECT_TRUE(same_bits("lse", got.lse->values(), want.lse->values()));
  }
  EXPECT_TRUE(got.guards_intact());
  if (c.q_dtype != DType::kFloat32) {  // float32 partials of 16-bit q: the float32 call's out itself
    const Outs partial = run_8bit(b, c, o, DType::kFloat32, false);
    EXPECT_TRUE(same_bits("float32 out", partial.out.values(), want.out.values()));
  }
}

TEST(KVQuant, EqualsFloat32CallOnDequantisedValues) {
  for (const QCase& c : cases())
    for (sdpa::Backend backend : {sdpa::Backend::kAuto, sdpa::Backend::kNaive, sdpa::Backend::kReference})
      check_case(c, backend);
}

// Options::batch_invariant too: the 8-bit call is the float32 call on the same values, so the
// float32 call's invariance (batch_invariance_test) carries over to 8-bit caches.
TEST(KVQuant, EqualsFloat32CallBatchInvariant) {
  for (QCase c : cases()) {
    if (c.block_mask) continue;  // (block masks and the option are separate concerns)
    c.name += " batch invariant";
    c.batch_invariant = true;
    check_case(c, sdpa::Backend::kAuto);
  }
}

TEST(KVQuant, EqualsFloat32CallAvx2Only) {
  const std::string skip = avx2_pass_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const Avx2Only avx2;
  for (const QCase& c : cases()) check_case(c, sdpa::Backend::kAuto);
}

TEST(KVQuant, MatchesReferenceByTheToleranceRule) {
  for (const QCase& c : cases()) {
    if (c.q_dtype != DType::kFloat32 || c.block_mask) continue;
    SCOPED_TRACE(c.name);
    const Built b = build(c);
    const Outs got = run_8bit(b, c, b.options, DType::kFloat32, c.Nq * c.Nk <= 200000);
    EXPECT_TRUE(matches_reference(b.t32, b.options, got));
  }
}

// Outputs::scores and the statistics read the same dequantised values: bit for bit the float32
// call's (the kernels' statistics pass and the scores' own loop), decode and prefill, 16-bit q.
TEST(KVQuant, ScoresAndStatsEqualFloat32Call) {
  for (const QCase& c : cases()) {
    if (c.Nq * c.Nk > 40000) continue;
    SCOPED_TRACE(c.name);
    const Built b = build(c);
    const std::vector<int64_t> rows = {c.B, c.Hq, c.Nq}, scores = {c.B, c.Hq, c.Nq, c.Nk};
    const auto call = [&](bool eight_bit, GuardedTensor& sc, GuardedTensor& entropy, GuardedTensor& max_weight,
                          std::vector<int64_t>& argmax) {
      const GuardedTensor out(eight_bit ? c.q_dtype : DType::kFloat32, {c.B, c.Hq, c.Nq, c.Dv});
      sdpa::Inputs in = b.t32.inputs();
      if (eight_bit) {
        in.q = b.q.view(), in.k = b.k.x.view(), in.v = b.v.x.view();
        if (b.mask) in.mask = b.mask->view();
        in.kv_quant = kv_quant_of(b.k, b.v);
      }
      sdpa::Outputs o;
      o.out = out.view();
      o.scores = sc.view();
      o.stats.entropy = entropy.view();
      o.stats.max_weight = max_weight.view();
      argmax.assign(static_cast<size_t>(c.B * c.Hq * c.Nq), -2);
      o.stats.argmax = TensorView::contiguous(argmax.data(), DType::kInt64, {c.B, c.Hq, c.Nq});
      sdpa::attention(in, o, b.options);
    };
    GuardedTensor sc(DType::kFloat32, scores), e(DType::kFloat32, rows), m(DType::kFloat32, rows);
    GuardedTensor sc32(DType::kFloat32, scores), e32(DType::kFloat32, rows), m32(DType::kFloat32, rows);
    std::vector<int64_t> a, a32;
    call(true, sc, e, m, a);
    call(false, sc32, e32, m32, a32);
    EXPECT_TRUE(same_bits("scores", sc.values(), sc32.values()));
    EXPECT_TRUE(same_bits("entropy", e.values(), e32.values()));
    EXPECT_TRUE(same_bits("max_weight", m.values(), m32.values()));
    EXPECT_EQ(a, a32);
  }
}

// Varlen: packed (total, H, D) rows, per-token and per-group scales (read in place, groups
// of 16 features, of 8 (two per AVX-512 vector) and per token; and through the float32 copy,
// groups of 12).
TEST(KVQuant, VarlenEqualsFloat32Call) {
  for (DType kv : {DType::kInt8, DType::kUInt8})
    for (DType qd : {DType::kFloat32, DType::kBFloat16})
      for (int64_t k_groups : {4, 6, 3, 0}) {  // k's groups of 12 features: the float32 copy; 8, 16, per token: in place
        SCOPED_TRACE(std::string(sdpa::dtype_name(kv)) + " q " + sdpa::dtype_name(qd) + " k groups " +
                     std::to_string(k_groups));
        std::mt19937 rng(7);
        const std::vector<int64_t> cu_q = {0, 1, 98, 100}, cu_k = {0, 97, 200, 1225};
        const int64_t Hq = 4, Hkv = 2, Dk = 48, Dv = 16;
        Quantized k(kv, {cu_k.back(), Hkv, Dk}, k_groups, rng), v(kv, {cu_k.back(), Hkv, Dv}, 0, rng);
        GuardedTensor q(qd, {cu_q.back(), Hq, Dk});
        fill_normal(q, rng);
        const GuardedTensor q32 = q.converted(DType::kFloat32, Layout::kContiguous);
        GuardedTensor out(qd, {cu_q.back(), Hq, Dv}), out32(DType::kFloat32, {cu_q.back(), Hq, Dv});
        GuardedTensor lse(DType::kFloat32, {Hq, cu_q.back()}), lse32(DType::kFloat32, {Hq, cu_q.back()});
        sdpa::VarlenInputs in;
        in.q = q.view();
        in.k = k.x.view();
        in.v = v.x.view();
        in.cu_seqlens_q = TensorView::contiguous(const_cast<int64_t*>(cu_q.data()), DType::kInt64, {4});
        in.cu_seqlens_k = TensorView::contiguous(const_cast<int64_t*>(cu_k.data()), DType::kInt64, {4});
        in.kv_quant = kv_quant_of(k, v);
        sdpa::Options o;
        o.causal = Causal::kBottomRight;
        sdpa::attention_varlen(in, {out.view(), lse.view()}, o);
        sdpa::VarlenInputs in32 = in;
        in32.q = q32.view();
        in32.k = k.deq.view();
        in32.v = v.deq.view();
        in32.kv_quant.reset();
        sdpa::attention_varlen(in32, {out32.view(), lse32.view()}, o);
        EXPECT_TRUE(same_bits("out", out.values(), out32.converted(qd, Layout::kContiguous).values()));
        EXPECT_TRUE(same_bits("lse", lse.values(), lse32.values()));
      }
}

// A (num_pages, page_size, Hkv, D)-shaped view of a head-major buffer (num_pages, Hkv, page_size, D).
TensorView head_major(TensorView t) {
  std::swap(t.shape[1], t.shape[2]);
  std::swap(t.strides[1], t.strides[2]);
  return t;
}

// Paged: pages of 1, 16 and 128 keys, token-major and head-major pools (scales alike), decode
// and packed prefill, pages shuffled; pages no sequence uses hold NaN scales (never read).
TEST(KVQuant, PagedEqualsFloat32Call) {
  for (int64_t page_size : {1, 16, 128})
    for (bool hm : {false, true})
      for (DType kv : {DType::kInt8, DType::kUInt8}) {
        SCOPED_TRACE("page_size " + std::to_string(page_size) + (hm ? " head-major " : " ") + sdpa::dtype_name(kv));
        std::mt19937 rng(static_cast<uint32_t>(page_size * 4 + hm * 2 + (kv == DType::kUInt8)));
        const int64_t B = 2, Hq = 4, Hkv = 2, Dk = 64, Dv = 32, Nq = 1;
        const std::vector<int64_t> lengths = {97, 300};
        const int64_t max_pages = (300 + page_size - 1) / page_size, P = 2 * max_pages + 1;
        // Built in the memory order (head-major: (P, Hkv, page_size, D)), viewed as the pool.
        const std::vector<int64_t> k_shape = hm ? std::vector<int64_t>{P, Hkv, page_size, Dk}
                                                : std::vector<int64_t>{P, page_size, Hkv, Dk};
        const std::vector<int64_t> v_shape = hm ? std::vector<int64_t>{P, Hkv, page_size, Dv}
                                                : std::vector<int64_t>{P, page_size, Hkv, Dv};
        Quantized k(kv, k_shape, 2, rng), v(kv, v_shape, 0, rng);
        std::vector<int64_t> table(static_cast<size_t>(B * max_pages));
        for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int64_t>((i * 7 + 3) % static_cast<size_t>(P));
        std::vector<bool> used(static_cast<size_t>(P), false);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t j = 0; j < (lengths[b] + page_size - 1) / page_size; ++j)
            used[static_cast<size_t>(table[static_cast<size_t>(b * max_pages + j)])] = true;
        for (int64_t p = 0; p < P; ++p) {  // unused pages: NaN scales, never read
          if (used[static_cast<size_t>(p)]) continue;
          const size_t per_page = k.scale.size() / static_cast<size_t>(P);
          for (size_t i = 0; i < per_page; ++i) k.scale[static_cast<size_t>(p) * per_page + i] = NAN;
        }
        GuardedTensor q(DType::kFloat32, {B, Hq, Nq, Dk});
        fill_normal(q, rng);
        sdpa::PagedInputs in;
        in.q = q.view();
        in.k_pages = hm ? head_major(k.x.view()) : k.x.view();
        in.v_pages = hm ? head_major(v.x.view()) : v.x.view();
        in.block_table = TensorView::contiguous(table.data(), DType::kInt64, {B, max_pages});
        in.seqlens_k = TensorView::contiguous(const_cast<int64_t*>(lengths.data()), DType::kInt64, {B});
        sdpa::KVQuant quant = kv_quant_of(k, v);
        if (hm) {
          quant.k_scale = head_major(quant.k_scale), quant.v_scale = head_major(quant.v_scale);
          if (quant.k_zero) quant.k_zero = head_major(*quant.k_zero), quant.v_zero = head_major(*quant.v_zero);
        }
        in.kv_quant = quant;
        GuardedTensor out(DType::kFloat32, {B, Hq, Nq, Dv}), out32(DType::kFloat32, {B, Hq, Nq, Dv});
        GuardedTensor lse(DType::kFloat32, {B, Hq, Nq}), lse32(DType::kFloat32, {B, Hq, Nq});
        sdpa::attention_paged(in, {out.view(), std::nullopt, lse.view()});
        sdpa::PagedInputs in32 = in;
        in32.k_pages = hm ? head_major(k.deq.view()) : k.deq.view();
        in32.v_pages = hm ? head_major(v.deq.view()) : v.deq.view();
        in32.kv_quant.reset();
        sdpa::attention_paged(in32, {out32.view(), std::nullopt, lse32.view()});
        EXPECT_TRUE(same_bits("out", out.values(), out32.values()));
        EXPECT_TRUE(same_bits("lse", lse.values(), lse32.values()));
        {  // bfloat16 q (widened exactly) and out (the float32 call's, rounded once): also in place
          const GuardedTensor q16 = q.converted(DType::kBFloat16, Layout::kContiguous);
          const GuardedTensor q16f = q16.converted(DType::kFloat32, Layout::kContiguous);
          GuardedTensor out16(DType::kBFloat16, {B, Hq, Nq, Dv});
          sdpa::PagedInputs in16 = in, in16f = in32;
          in16.q = q16.view();
          in16f.q = q16f.view();
          sdpa::attention_paged(in16, {out16.view()});
          sdpa::attention_paged(in16f, {out32.view()});
          EXPECT_TRUE(same_bits("bfloat16 out", out16.values(),
                                out32.converted(DType::kBFloat16, Layout::kContiguous).values()));
        }
        // A read row's non-finite scale is an Error in either layout of the scales (v's are all
        // finite: one pass over them, kv_dequant.cc's all_finite_dense, head-major too).
        const size_t per_page = k.scale.size() / static_cast<size_t>(P);
        k.scale[static_cast<size_t>(table[0]) * per_page] = INFINITY;  // row 0 of sequence 0, head 0
        v.scale[static_cast<size_t>(table[0]) * (v.scale.size() / static_cast<size_t>(P))] = NAN;
        expect_sdpa_error([&] { sdpa::attention_paged(in, {out.view()}); }, {"kv_quant.k_scale has a non-finite value inf"});
        k.scale[static_cast<size_t>(table[0]) * per_page] = 1.0f;
        expect_sdpa_error([&] { sdpa::attention_paged(in, {out.view()}); }, {"kv_quant.v_scale has a non-finite value nan"});
      }
}

// Each malformed argument: an Error naming it, and out untouched.
TEST(KVQuant, Errors) {
  std::mt19937 rng(3);
  const int64_t B = 1, H = 2, N = 5, D = 8;
  Quantized k8(DType::kInt8, {B, H, N, D}, 0, rng), v8(DType::kInt8, {B, H, N, D}, 0, rng);
  Quantized ku(DType::kUInt8, {B, H, N, D}, 2, rng), vu(DType::kUInt8, {B, H, N, D}, 2, rng);
  GuardedTensor q(DType::kFloat32, {B, H, 1, D});
  fill_normal(q, rng);
  const GuardedTensor q64 = q.converted(DType::kFloat64, Layout::kContiguous);
  const GuardedTensor out(DType::kFloat32, {B, H, 1, D});
  const GuardedTensor kf = k8.deq.converted(DType::kFloat32, Layout::kContiguous);
  const auto inputs = [&](const Quantized& k, const Quantized& v) {
    sdpa::Inputs in;
    in.q = q.view();
    in.k = k.x.view();
    in.v = v.x.view();
    in.kv_quant = kv_quant_of(k, v);
    return in;
  };
  const auto expect = [&](const sdpa::Inputs& in, const std::vector<std::string>& words) {
    expect_sdpa_error([&] { sdpa::attention(in, {out.view()}); }, words);
    EXPECT_TRUE(out.untouched());
  };
  {  // missing kv_quant
    sdpa::Inputs in = inputs(k8, v8);
    in.kv_quant.reset();
    expect(in, {"k has dtype int8", "kv_quant is not given"});
  }
  {  // kv_quant with float k
    sdpa::Inputs in = inputs(k8, v8);
    in.k = kf.view(), in.v = kf.view();
    expect(in, {"kv_quant is given", "k has dtype float32"});
  }
  {  // k int8, v uint8
    sdpa::Inputs in = inputs(k8, v8);
    in.v = vu.x.view();
    expect(in, {"v has dtype uint8", "k has dtype int8"});
  }
  {  // float64 q
    sdpa::Inputs in = inputs(k8, v8);
    in.q = q64.view();
    expect(in, {"q has dtype float64", "float32, bfloat16 or float16"});
  }
  {  // zero point for int8
    sdpa::Inputs in = inputs(k8, v8);
    in.kv_quant->k_zero = ku.zero_view();
    expect(in, {"kv_quant.k_zero is given", "int8"});
  }
  {  // no zero point for uint8
    sdpa::Inputs in = inputs(ku, vu);
    in.kv_quant->v_zero.reset();
    expect(in, {"kv_quant.v_zero is not given", "uint8"});
  }
  {  // scale of the wrong shape
    sdpa::Inputs in = inputs(k8, v8);
    in.kv_quant->v_scale.shape[2] = N - 1;
    expect(in, {"kv_quant.v_scale has shape (1, 2, 4)", "v has shape (1, 2, 5, 8)"});
  }
  {  // G not dividing D
    Quantized kg(DType::kInt8, {B, H, N, D}, 2, rng);
    sdpa::Inputs in = inputs(kg, v8);
    std::vector<float> s3(static_cast<size_t>(B * H * N * 3), 0.01f);
    in.kv_quant->k_scale = view_of(s3.data(), {B, H, N, 3});
    expect(in, {"kv_quant.k_scale has shape (1, 2, 5, 3)", "k has shape (1, 2, 5, 8)", "divides 8"});
  }
  {  // float64 scale
    sdpa::Inputs in = inputs(k8, v8);
    in.kv_quant->k_scale.dtype = DType::kFloat64;
    expect(in, {"kv_quant.k_scale has dtype float64", "float32"});
  }
  {  // zero point shape unlike its scale's
    sdpa::Inputs in = inputs(ku, vu);
    in.kv_quant->k_zero->shape[3] = 1;
    expect(in, {"kv_quant.k_zero has shape (1, 2, 5, 1)", "kv_quant.k_scale has shape (1, 2, 5, 2)"});
  }
  {  // non-finite scale, and zero point, of a row read
    Quantized k(DType::kUInt8, {B, H, N, D}, 0, rng), v(DType::kUInt8, {B, H, N, D}, 0, rng);
    k.scale[3] = INFINITY;
    expect(inputs(k, v), {"kv_quant.k_scale has a non-finite value inf at (0, 0, 3)"});
    k.scale[3] = 0.01f;
    v.zero[7] = NAN;
    expect(inputs(k, v), {"kv_quant.v_zero has a non-finite value", "(0, 1, 2)"});
    // ... but a row past seqlens_k is not read: its scale is not checked.
    std::vector<int64_t> lengths = {2};
    sdpa::Inputs in = inputs(k, v);
    in.seqlens_k = TensorView::contiguous(lengths.data(), DType::kInt64, {1});
    const GuardedTensor o(DType::kFloat32, {B, H, 1, D});
    EXPECT_NO_THROW(sdpa::attention(in, {o.view()}));
  }
  {  // out of another 16-bit dtype than q's
    const GuardedTensor qb = q.converted(DType::kBFloat16, Layout::kContiguous);
    const GuardedTensor oh(DType::kFloat16, {B, H, 1, D});
    sdpa::Inputs in = inputs(k8, v8);
    in.q = qb.view();
    expect_sdpa_error([&] { sdpa::attention(in, {oh.view()}); }, {"out has dtype float16", "bfloat16"});
    EXPECT_TRUE(oh.untouched());
  }
  {  // the backward refuses 8-bit k
    sdpa::Inputs in = inputs(k8, v8);
    const GuardedTensor lse(DType::kFloat32, {B, H, 1}), dq(DType::kFloat32, {B, H, 1, D}),
        dk(DType::kFloat32, {B, H, N, D}), dv(DType::kFloat32, {B, H, N, D});
    expect_sdpa_error([&] { sdpa::attention_backward(in, out.view(), lse.view(), out.view(), {dq.view(), dk.view(), dv.view()}); },
                      {"k has dtype int8", "backward"});
    EXPECT_TRUE(dq.untouched());
  }
}

}  // namespace
}  // namespace sdpa_test
