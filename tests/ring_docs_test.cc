// Ring attention with packed documents (RingOptions::cu_seqlens): the ranks' forward results
// against attention_varlen and their gradients against attention_varlen_backward on the whole
// packed sequence, which are attention() / attention_backward() of each document on its own rows
// (include/sdpa/attention.h), so each document is held to the tolerance rule of its own call
// (expected_forward / expected of the document's tensors) plus the merges' and sums' bounds
// ring_util.h derives; repeatable bit for bit; the refusals and the collective check of the offsets.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"
#include "ring_local.h"
#include "ring_util.h"
#include "sdpa/ring.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Causal;
using sdpa::RingStrategy;

constexpr RingLayout kZig = RingLayout::kZigzag, kCont = RingLayout::kContiguous;

struct DocCase {
  const char* name;
  int W;
  RingLayout layout;
  int64_t Hq, Hkv, n_local, Dk, Dv;
  std::vector<int64_t> cu;  // over the whole sequence, N = W · n_local
  Causal causal = Causal::kNone;
  sdpa::Window window = {};
  bool alibi = false, doc_slopes = false, sinks = false;  // doc_slopes: (D, Hq), row d document d's
  double dropout = 0;
  int64_t bq = 0, bk = 0;  // a block mask (D, Hq, ...) when > 0
  bool softcap = false;
};

// Documents of 1 token, empty ones, ones that span ranks and start mid-chunk.
const DocCase kDocCases[] = {
    {"w1_contiguous_causal", 1, kCont, 2, 2, 10, 8, 8, {0, 3, 4, 10}, Causal::kTopLeft},
    {"w2_zigzag_causal_gqa_one_token", 2, kZig, 4, 2, 8, 16, 8, {0, 1, 7, 16}, Causal::kBottomRight},
    {"w3_contiguous_window_alibi_sinks_empty", 3, kCont, 2, 1, 7, 8, 6, {0, 5, 5, 13, 21}, Causal::kNone, {2, 3}, true,
     false, true},
    {"w4_zigzag_causal_doc_slopes_sinks", 4, kZig, 2, 2, 6, 8, 8, {0, 11, 12, 23, 24}, Causal::kTopLeft, {}, true, true,
     true},
    {"w2_contiguous_causal_dropout", 2, kCont, 2, 2, 9, 8, 8, {0, 4, 18}, Causal::kTopLeft, {}, false, false, false,
     0.2},
    {"w3_zigzag_block_mask_window", 3, kZig, 2, 2, 6, 8, 8, {0, 2, 9, 18}, Causal::kNone, {4, -1}, false, false, false,
     0, 3, 2},
    {"w4_contiguous_not_causal_one_doc_slopes_1xHq", 4, kCont, 2, 1, 5, 8, 8, {0, 20}, Causal::kNone, {}, true, true},
    {"w2_contiguous_97_causal_window_alibi_sinks", 2, kCont, 2, 2, 97, 16, 16, {0, 1, 60, 60, 150, 194},
     Causal::kTopLeft, {40, -1}, true, false, true},
    {"w3_contiguous_softcap_gqa_doc_slopes_sinks_dropout", 3, kCont, 4, 2, 5, 8, 8, {0, 7, 7, 15},
     Causal::kBottomRight, {}, true, true, true, 0.1, 0, 0, true},
};

int64_t docs_of(const DocCase& c) { return static_cast<int64_t>(c.cu.size()) - 1; }
int64_t longest(const DocCase& c) {
  int64_t n = 0;
  for (size_t d = 1; d < c.cu.size(); ++d) n = std::max(n, c.cu[d] - c.cu[d - 1]);
  return n;
}

struct DocOptions {
  GuardedTensor slopes, sinks, bm;
  Options o;
  DocOptions(const DocCase& c, uint32_t seed)
      : slopes(kF64, c.doc_slopes ? std::vector<int64_t>{docs_of(c), c.Hq} : std::vector<int64_t>{c.Hq}),
        sinks(kF32, {c.Hq}),
        bm(DType::kBool, {docs_of(c), c.Hq, c.bq ? (longest(c) + c.bq - 1) / c.bq : 1,
                          c.bk ? (longest(c) + c.bk - 1) / c.bk : 1}) {
    std::mt19937 rng(seed);
    fill_uniform(slopes, rng, 0.01, 0.3);
    fill_normal(sinks, rng);
    fill_mask(bm, rng, 0.6, 0.0);
    o.causal = c.causal;
    o.window = c.window;
    if (c.alibi) o.alibi_slopes = slopes.view();
    if (c.sinks) o.sinks = sinks.view();
    if (c.dropout > 0) o.dropout_p = c.dropout, o.seed = 99;
    if (c.bq > 0) o.block_mask = bm.view(), o.block_q = c.bq, o.block_k = c.bk;
    if (c.softcap) o.softcap = 3;
  }
};

// Document d's tensors of the whole problem (rows cu[d] .. cu[d + 1] of dim from_end), repeated
// over a batch of `copies` (dropout draws document d as batch entry d: the dense call of d + 1
// copies draws its last entry as attention_varlen draws the document).
GuardedTensor doc_rows(const GuardedTensor& t, int from_end, const std::vector<int64_t>& cu, int64_t d, int64_t copies = 1) {
  const GuardedTensor one = cut(t, from_end, {RingChunk{0, cu[d], cu[d + 1] - cu[d]}});
  std::vector<int64_t> shape = one.shape();
  shape[0] *= copies;
  std::vector<double> v;
  for (int64_t b = 0; b < copies; ++b) {
    const std::vector<double> x = one.values();
    v.insert(v.end(), x.begin(), x.end());
  }
  return tensor(one.dtype(), shape, v);
}

// Document d's options as its own dense call: positions 0 (the block mask read as a corner),
// its slopes' row, its block mask's row (all the batch's rows: `copies` of the document).
struct DocCall {
  GuardedTensor slopes, bm;
  Options o;
  DocCall(const DocCase& c, const DocOptions& co, int64_t d, int64_t copies)
      : slopes(kF64, {c.Hq}), bm(DType::kBool, {1, 1}) {
    o = co.o;
    o.q_start = o.k_start = 0;
    if (c.doc_slopes) {
      const std::vector<double> all = co.slopes.values();
      slopes.set_values(std::vector<double>(all.begin() + d * c.Hq, all.begin() + (d + 1) * c.Hq));
      o.alibi_slopes = slopes.view();
    }
    if (c.bq > 0) {
      bm = doc_rows(co.bm, 4, std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}, d, copies);  // row d of dim 0
      o.block_mask = bm.view();
    }
  }
};

// A (1, H, N, D) tensor as attention_varlen's packed (N, H, D), and back (`dense_values`: the
// packed tensor's values in the (1, H, N, D) order).
GuardedTensor packed(const GuardedTensor& x) {
  const std::vector<int64_t> s = x.shape();
  const std::vector<double> v = x.values();
  std::vector<double> p(v.size());
  for (int64_t h = 0; h < s[1]; ++h)
    for (int64_t n = 0; n < s[2]; ++n)
      for (int64_t e = 0; e < s[3]; ++e) p[static_cast<size_t>((n * s[1] + h) * s[3] + e)] = v[static_cast<size_t>((h * s[2] + n) * s[3] + e)];
  return tensor(x.dtype(), {s[2], s[1], s[3]}, p);
}
std::vector<double> dense_values(const GuardedTensor& x) {
  const std::vector<int64_t> s = x.shape();  // (N, H, D)
  const std::vector<double> v = x.values();
  std::vector<double> d(v.size());
  for (int64_t h = 0; h < s[1]; ++h)
    for (int64_t n = 0; n < s[0]; ++n)
      for (int64_t e = 0; e < s[2]; ++e) d[static_cast<size_t>((h * s[0] + n) * s[2] + e)] = v[static_cast<size_t>((n * s[1] + h) * s[2] + e)];
  return d;
}
sdpa::TensorView offsets_view(std::vector<int64_t>& cu) {
  return sdpa::TensorView::contiguous(cu.data(), DType::kInt64, {static_cast<int64_t>(cu.size())});
}

// attention_varlen of the whole packed sequence (the backend given) as (1, Hq, N, Dv) out (of
// dtype out_dtype) and (1, Hq, N) lse.
std::pair<GuardedTensor, GuardedTensor> varlen(const Tensors& t, std::vector<int64_t>& cu, const Options& o,
                                               DType out_dtype) {
  const int64_t N = t.q.shape()[2], Hq = t.q.shape()[1], Dv = t.v.shape()[3];
  GuardedTensor out(out_dtype, {N, Hq, Dv}), lse(compute_dtype(t.q.dtype()), {Hq, N});
  const GuardedTensor q = packed(t.q), k = packed(t.k), v = packed(t.v);
  sdpa::attention_varlen({q.view(), k.view(), v.view(), offsets_view(cu), offsets_view(cu)}, {out.view(), lse.view()}, o);
  return {tensor(out_dtype, {1, Hq, N, Dv}, dense_values(out)), tensor(lse.dtype(), {1, Hq, N}, lse.values())};
}

// attention_varlen_backward of the whole packed sequence (out, lse, dout as varlen() gives them)
// as (1, H, N, D) dq, dk, dv values; dalibi_slopes (the slopes' shape) and dsinks in float64
// when the options have slopes and sinks.
struct VarlenGrads {
  GradValues g;
  std::vector<double> dalibi, dsinks;
};
VarlenGrads varlen_backward(const Tensors& t, const GuardedTensor& out, const GuardedTensor& lse,
                            const GuardedTensor& dout, std::vector<int64_t>& cu, const Options& o) {
  const int64_t N = t.q.shape()[2], Hq = t.q.shape()[1];
  const GuardedTensor q = packed(t.q), k = packed(t.k), v = packed(t.v), po = packed(out), pd = packed(dout);
  const GuardedTensor pl = tensor(lse.dtype(), {Hq, N}, lse.values());
  GuardedTensor dq(q.dtype(), q.shape()), dk(k.dtype(), k.shape()), dv(v.dtype(), v.shape());
  GuardedTensor dalibi(kF64, o.alibi_slopes ? std::vector<int64_t>(o.alibi_slopes->shape, o.alibi_slopes->shape + o.alibi_slopes->rank)
                                            : std::vector<int64_t>{1});
  GuardedTensor dsinks(kF64, {Hq});
  sdpa::Gradients g{dq.view(), dk.view(), dv.view()};
  if (o.alibi_slopes) g.dalibi_slopes = dalibi.view();
  if (o.sinks) g.dsinks = dsinks.view();
  sdpa::attention_varlen_backward({q.view(), k.view(), v.view(), offsets_view(cu), offsets_view(cu)}, po.view(), pl.view(),
                                  pd.view(), g, o);
  VarlenGrads r{{{dense_values(dq), dense_values(dk), dense_values(dv)}}, {}, {}};
  if (o.alibi_slopes) r.dalibi = dalibi.values();
  if (o.sinks) r.dsinks = dsinks.values();
  return r;
}

sdpa::RingOptions ring_options(const DocCase& c, RingStrategy strategy, std::vector<int64_t>& cu) {
  sdpa::RingOptions ring{c.layout, 30.0};
  ring.cu_seqlens = offsets_view(cu);
  ring.strategy = strategy;
  return ring;
}

void check_docs_forward(const DocCase& c, DType dt, RingStrategy strategy) {
  const int64_t N = c.W * c.n_local, D = docs_of(c);
  const Tensors t = random_qkv(dt, {1, c.Hq, N, c.Dk}, {1, c.Hkv, N, c.Dk}, {1, c.Hkv, N, c.Dv}, 31);
  const DocOptions co(c, 8);
  const Options& o = co.o;
  std::vector<int64_t> cu = c.cu;
  std::vector<RankData> ranks = shards(t, c.W, c.layout, dt);
  run_forward(ranks, o, ring_options(c, strategy, cu));
  std::vector<double> out(static_cast<size_t>(c.Hq * N * c.Dv)), lse(static_cast<size_t>(c.Hq * N));
  for (const RankData& d : ranks) {
    EXPECT_TRUE(d.out.guards_intact());
    place(out, N, d.out.values(), c.n_local, c.Dv, d.chunks);
    place(lse, N, d.lse.values(), c.n_local, 1, d.chunks);
  }
  // The reference: attention_varlen (kReference) of the packed sequence; each document's
  // tolerance: the rule of its own dense call (its rows, options and dropout draws).
  Options ro = o;
  ro.backend = sdpa::Backend::kReference;
  const auto [ref_o, ref_l] = varlen(t, cu, ro, compute_dtype(dt));
  const std::vector<double> ref_out = ref_o.values(), ref_lse = ref_l.values();
  std::vector<double> tol_out(out.size(), 0.0), tol_lse(lse.size(), 0.0);
  for (int64_t d = 0; d < D; ++d) {
    if (c.cu[d + 1] == c.cu[d]) continue;
    const int64_t copies = c.dropout > 0 ? d + 1 : 1;
    const Tensors td{doc_rows(t.q, 2, cu, d, copies), doc_rows(t.k, 2, cu, d, copies), doc_rows(t.v, 2, cu, d, copies), std::nullopt, {}};
    const DocCall call(c, co, d, copies);
    ForwardExpected e;
    ASSERT_TRUE(expected_forward(td, call.o, e));
    const int64_t P = c.layout == kZig ? 2 * c.W : c.W;
    const MergeBound mb = merge_bound(dt, P, max_abs_finite(td.v.values()) / (1 - o.dropout_p), max_abs_finite(e.ref.lse));
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
        tol_lse[static_cast<size_t>(h * N + i)] = e.tol.lse + mb.lse;
        for (int64_t x = 0; x < c.Dv; ++x) tol_out[static_cast<size_t>((h * N + i) * c.Dv + x)] = e.tol.out + mb.out;
      }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::abs(out[i] - ref_out[i]) > tol_out[i] || std::isnan(out[i])) {
      ADD_FAILURE() << "out[" << i << "] = " << out[i] << ", attention_varlen's " << ref_out[i] << ", tol " << tol_out[i];
      break;
    }
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (!(std::abs(lse[i] - ref_lse[i]) <= tol_lse[i]) && lse[i] != ref_lse[i]) {
      ADD_FAILURE() << "lse[" << i << "] = " << lse[i] << ", attention_varlen's " << ref_lse[i] << ", tol " << tol_lse[i];
      break;
    }
  }
  // Repeatable bit for bit.
  std::vector<RankData> again = shards(t, c.W, c.layout, dt);
  run_forward(again, o, ring_options(c, strategy, cu));
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_TRUE(all_close("out (second run)", again[r].out.values(), ranks[r].out.values(), 0));
    EXPECT_TRUE(all_close("lse (second run)", again[r].lse.values(), ranks[r].lse.values(), 0));
  }
}

bool supported(const DocCase& c, RingStrategy strategy) {
  return strategy == RingStrategy::kRing || (c.dropout == 0 && c.bq == 0);  // kAllGather refuses those
}

// Every case the strategy takes, in each dtype, for both strategies.
void for_each_case(void (*check)(const DocCase&, DType, RingStrategy)) {
  for (RingStrategy strategy : {RingStrategy::kRing, RingStrategy::kAllGather}) {
    for (const DocCase& c : kDocCases) {
      if (!supported(c, strategy)) continue;
      for (DType dt : {kF32, kF64, kBF16}) {
        SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt) +
                     (strategy == RingStrategy::kRing ? " kRing" : " kAllGather"));
        check(c, dt, strategy);
      }
    }
  }
}

TEST_F(Ring, DocumentsForwardMatchVarlen) { for_each_case(check_docs_forward); }

// ---- Backward ----

// The ranks' dq, dk, dv against attention_varlen_backward (kReference) of the whole packed
// sequence, given the out and lse of attention_varlen (kAuto) and a normal dout. Each document's
// rows are held to the backward's rule of the document's own dense call (backward_util's
// expected: its rows, options and dropout draws, as in the forward above) plus the ring's sums
// as ring_util.h's sums_bound derives them: a row's dq sums at most P pair terms (P key chunks: a row's
// document meets a pair in one part), a key's dk and dv at most P (one per query chunk), P - 1
// additions in the compute type, each within u times the terms' sizes, bounded with the
// document's own maxima and its own rows (group · length rows read a key of the document).
// dalibi_slopes (each rank's part, summed here over the ranks; (D, Hq): a row per document) for
// float32 as ring_test checks it: 2 |kNaive - kReference| of attention_varlen_backward + 4 eps
// max(1, max|ref|) (float32's kNaive error stands for the kernels' own; in float64 kNaive and
// kReference agree to the last bits and bound nothing, in bfloat16 the pairs' kernels err as
// kNaive does not); dsinks so in float32 and float64 plus its sums' order bound (below).
// Repeatable bit for bit. Both strategies (kAllGather's dk, dv sum in another order: the bound
// above holds for any order of the P terms).
void check_docs_backward(const DocCase& c, DType dt, RingStrategy strategy) {
  const int64_t N = c.W * c.n_local, D = docs_of(c);
  const Tensors t = random_qkv(dt, {1, c.Hq, N, c.Dk}, {1, c.Hkv, N, c.Dk}, {1, c.Hkv, N, c.Dv}, 37);
  const DocOptions co(c, 9);
  const Options& o = co.o;
  std::vector<int64_t> cu = c.cu;
  // (named references, not a structured binding: clang 14's lambdas cannot capture those)
  const std::pair<GuardedTensor, GuardedTensor> whole = varlen(t, cu, o, dt);
  const GuardedTensor &out = whole.first, &lse = whole.second;
  GuardedTensor dout(dt, out.shape());
  std::mt19937 rng(41);
  fill_normal(dout, rng);
  const std::vector<RankData> ranks = shards(t, c.W, c.layout, dt);
  const auto run = [&] {  // dsinks in float64
    return run_backward(ranks, out, lse, dout, o, ring_options(c, strategy, cu), co.slopes.shape(), kF64);
  };
  const std::vector<RankGrads> rg = run();
  // The whole gradients from the ranks' shards; dalibi_slopes and dsinks summed over the ranks.
  const int64_t width[3] = {c.Dk, c.Dk, c.Dv}, heads[3] = {c.Hq, c.Hkv, c.Hkv};
  GradValues got;
  for (int x = 0; x < 3; ++x) got.g[x].resize(static_cast<size_t>(heads[x] * N * width[x]));
  std::vector<double> dalibi(static_cast<size_t>(co.slopes.numel()), 0.0), dsinks(static_cast<size_t>(c.Hq), 0.0);
  for (size_t r = 0; r < rg.size(); ++r) {
    EXPECT_TRUE(rg[r].g.guards_intact()) << "rank " << r;
    const GradValues v = values(rg[r].g);
    for (int x = 0; x < 3; ++x) place(got.g[x], N, v.g[x], c.n_local, width[x], ranks[r].chunks);
    const std::vector<double> a = rg[r].dalibi.values(), b = rg[r].dsinks.values();
    if (o.alibi_slopes) for (size_t i = 0; i < a.size(); ++i) dalibi[i] += a[i];
    if (o.sinks) for (size_t i = 0; i < b.size(); ++i) dsinks[i] += b[i];
  }
  Options ro = o;
  ro.backend = sdpa::Backend::kReference;
  const VarlenGrads ref = varlen_backward(t, out, lse, dout, cu, ro);
  // Each document's tolerance.
  const int64_t P = c.layout == kZig ? 2 * c.W : c.W;
  const double u = eps(compute_dtype(dt)) / 2;  // (dsinks' order bound, below)
  std::vector<double> tol[3];
  for (int x = 0; x < 3; ++x) tol[x].assign(got.g[x].size(), 0.0);
  for (int64_t d = 0; d < D; ++d) {
    const int64_t length = cu[d + 1] - cu[d];
    if (length == 0) continue;
    const int64_t copies = c.dropout > 0 ? d + 1 : 1;
    const DocCall call(c, co, d, copies);
    Problem pd = make_problem({doc_rows(t.q, 2, cu, d, copies), doc_rows(t.k, 2, cu, d, copies),
                               doc_rows(t.v, 2, cu, d, copies), std::nullopt, {}},
                              call.o, Layout::kContiguous, 1);
    pd.dout.set_values(doc_rows(dout, 2, cu, d, copies).values());
    Expected e;
    ASSERT_TRUE(expected(pd, call.o, e)) << "document " << d;
    const auto doc_max = [&](const GuardedTensor& x) { return max_abs_finite(doc_rows(x, 2, cu, d).values()); };
    const std::array<double, 3> sums =
        sums_bound(dt, P, c.Dk, c.Dv, static_cast<double>(c.Hq / c.Hkv * length), o.dropout_p,
                   {doc_max(dout), doc_max(t.v), doc_max(out), doc_max(t.k), doc_max(t.q)});
    for (int x = 0; x < 3; ++x)
      for (int64_t h = 0; h < heads[x]; ++h)
        for (int64_t i = cu[d]; i < cu[d + 1]; ++i)
          for (int64_t w = 0; w < width[x]; ++w) tol[x][static_cast<size_t>((h * N + i) * width[x] + w)] = e.tol[x] + sums[x];
  }
  for (int x = 0; x < 3; ++x) {
    for (size_t i = 0; i < got.g[x].size(); ++i) {
      if (!(std::abs(got.g[x][i] - ref.g.g[x][i]) <= tol[x][i])) {  // NaN fails
        ADD_FAILURE() << kGradNames[x] << "[" << i << "] = " << got.g[x][i] << ", attention_varlen_backward's "
                      << ref.g.g[x][i] << ", tol " << tol[x][i];
        break;
      }
    }
  }
  // dsinks of head h sums N row terms t_i = -exp(sink_h - lse_i) D_i (D_i = dout_i · out_i) in
  // another order than the one call (per part, then over the pairs and the ranks): any two
  // orders differ by at most (N - 1) u Σ_i |t_i|, added to the rule below (it matters in float64,
  // where kNaive and kReference sum alike).
  double sink_sum = 0;
  if (o.sinks) {
    const std::vector<double> ov = out.values(), dv = dout.values(), lv = lse.values(), sv = co.sinks.values();
    for (int64_t h = 0; h < c.Hq; ++h) {
      double S = 0;
      for (int64_t i = 0; i < N; ++i) {
        double Di = 0;
        for (int64_t e = 0; e < c.Dv; ++e) Di += dv[static_cast<size_t>((h * N + i) * c.Dv + e)] * ov[static_cast<size_t>((h * N + i) * c.Dv + e)];
        S += std::exp(sv[static_cast<size_t>(h)] - lv[static_cast<size_t>(h * N + i)]) * std::abs(Di);
      }
      sink_sum = std::max(sink_sum, static_cast<double>(N - 1) * u * S);
    }
  }
  const auto modifier_check = [&](const char* what, const std::vector<double>& g, const std::vector<double>& want,
                                  const std::vector<double>& yardstick, double order) {
    double err = 0;
    for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::abs(yardstick[i] - want[i]));
    EXPECT_TRUE(all_near(what, g, want, 2 * err + 4 * eps(dt) * std::max(1.0, max_abs_finite(want)) + order));
  };
  if ((dt == kF32 && o.alibi_slopes) || ((dt == kF32 || dt == kF64) && o.sinks)) {
    Options no = o;
    no.backend = sdpa::Backend::kNaive;
    const VarlenGrads naive = varlen_backward(t, out, lse, dout, cu, no);
    if (dt == kF32 && o.alibi_slopes) modifier_check("dalibi_slopes", dalibi, ref.dalibi, naive.dalibi, 0);
    if (o.sinks) modifier_check("dsinks", dsinks, ref.dsinks, naive.dsinks, sink_sum);
  }
  // Repeatable bit for bit.
  const std::vector<RankGrads> again = run();
  for (size_t r = 0; r < rg.size(); ++r) {
    EXPECT_TRUE(bitwise_equal(again[r].g, rg[r].g)) << "rank " << r;
    if (o.alibi_slopes) {
      EXPECT_TRUE(all_close("dalibi (second run)", again[r].dalibi.values(), rg[r].dalibi.values(), 0)) << "rank " << r;
    }
    if (o.sinks) {
      EXPECT_TRUE(all_close("dsinks (second run)", again[r].dsinks.values(), rg[r].dsinks.values(), 0)) << "rank " << r;
    }
  }
}

TEST_F(Ring, DocumentsBackwardMatchVarlen) { for_each_case(check_docs_backward); }

// A different cu_seqlens on one rank is the same Error on every rank (the values are compared,
// as a hash, before any block moves); offsets that do not cover the sequence, and documents with
// a batch of 2, are refused on every rank; nothing is written.
TEST_F(Ring, DocumentsRefusals) {
  const int W = 2;
  const int64_t n_local = 4, N = W * n_local;
  const auto run = [&](const std::function<void(int, std::vector<int64_t>&, sdpa::RingOptions&)>& edit, int64_t B,
                       const std::string& why) {
    const Tensors t = random_qkv(kF32, {B, 2, N, 4}, {B, 2, N, 4}, {B, 2, N, 4}, 3);
    std::vector<RankData> ranks = shards(t, W, kCont, kF32);
    std::vector<std::vector<int64_t>> cus(W, std::vector<int64_t>{0, 3, 8});
    LocalWorld world(W);
    const auto errors = messages(world.run([&](int r, sdpa::Communicator& comm) {
      RankData& d = ranks[static_cast<size_t>(r)];
      sdpa::RingOptions ring{kCont, 5.0};
      edit(r, cus[static_cast<size_t>(r)], ring);
      ring.cu_seqlens = sdpa::TensorView::contiguous(cus[static_cast<size_t>(r)].data(), DType::kInt64,
                                                     {static_cast<int64_t>(cus[static_cast<size_t>(r)].size())});
      sdpa::ring_attention(comm, {d.q.view(), d.k.view(), d.v.view()}, {d.out.view(), std::nullopt, d.lse.view()}, {},
                           ring);
    }));
    for (int r = 0; r < W; ++r) {
      EXPECT_NE(errors[static_cast<size_t>(r)].find(why), std::string::npos) << "rank " << r << ": " << errors[static_cast<size_t>(r)];
      EXPECT_TRUE(ranks[static_cast<size_t>(r)].out.untouched());
      EXPECT_TRUE(ranks[static_cast<size_t>(r)].lse.untouched());
    }
  };
  // The backward with documents: dalibi_slopes has the slopes' shape, (D, Hq) for per-document
  // slopes (a row per document, as attention_varlen_backward's); an (Hq,) one is refused on
  // every rank, nothing written.
  {
    const Tensors t = random_qkv(kF32, {1, 2, N, 4}, {1, 2, N, 4}, {1, 2, N, 4}, 3);
    std::vector<RankData> ranks = shards(t, W, kCont, kF32);
    std::vector<int64_t> cu = {0, 3, 8};
    std::vector<double> slopes = {0.1, 0.2, 0.3, 0.4};  // (D, Hq) = (2, 2)
    Options o;
    o.alibi_slopes = sdpa::TensorView::contiguous(slopes.data(), kF64, {2, 2});
    LocalWorld world(W);
    std::vector<GuardedTensor> dq, dk, dv, dalibi;
    for (int r = 0; r < W; ++r) {
      for (auto* g : {&dq, &dk, &dv}) g->emplace_back(kF32, std::vector<int64_t>{1, 2, n_local, 4});
      dalibi.emplace_back(kF64, std::vector<int64_t>{2});
    }
    const auto errors = messages(world.run([&](int r, sdpa::Communicator& comm) {
      RankData& d = ranks[static_cast<size_t>(r)];
      sdpa::RingOptions ring{kCont, 5.0};
      ring.cu_seqlens = offsets_view(cu);
      sdpa::Gradients g{dq[r].view(), dk[r].view(), dv[r].view()};
      g.dalibi_slopes = dalibi[r].view();
      sdpa::ring_attention_backward(comm, {d.q.view(), d.k.view(), d.v.view()}, d.out.view(), d.lse.view(), d.out.view(),
                                    g, o, ring);
    }));
    for (int r = 0; r < W; ++r) {
      EXPECT_NE(errors[static_cast<size_t>(r)].find("rank 0 refused its arguments: dalibi_slopes has shape (2,) but must be (2, 2) = the shape of alibi_slopes"),
                std::string::npos)
          << "rank " << r << ": " << errors[static_cast<size_t>(r)];
      EXPECT_TRUE(dq[r].untouched() && dk[r].untouched() && dv[r].untouched() && dalibi[r].untouched());
    }
  }
  for (RingStrategy strategy : {RingStrategy::kRing, RingStrategy::kAllGather}) {
    SCOPED_TRACE(strategy == RingStrategy::kRing ? "kRing" : "kAllGather");
    const auto with = [strategy](const std::function<void(int, std::vector<int64_t>&, sdpa::RingOptions&)>& f) {
      return [strategy, f](int r, std::vector<int64_t>& cu, sdpa::RingOptions& ring) {
        ring.strategy = strategy;
        f(r, cu, ring);
      };
    };
    run(with([](int r, std::vector<int64_t>& cu, sdpa::RingOptions&) { if (r == 1) cu = {0, 4, 8}; }), 1,
        "rank 1's arguments differ from rank 0's (every rank must pass the same shapes, dtypes and options): "
        "RingOptions::cu_seqlens: one set of values on rank 0, other values on rank 1");
    run(with([](int r, std::vector<int64_t>& cu, sdpa::RingOptions&) { if (r == 0) cu = {0, 3, 5, 8}; }), 1,
        "RingOptions::cu_seqlens: 4 offsets on rank 0, 3 offsets on rank 1");
    run(with([](int, std::vector<int64_t>& cu, sdpa::RingOptions&) { cu = {0, 3, 7}; }), 1,
        "refused its arguments: RingOptions::cu_seqlens[2] = 7 but the whole sequence (W · N_local = 2 · 4) has 8 rows");
    run(with([](int, std::vector<int64_t>& cu, sdpa::RingOptions&) { cu = {0, 5, 3, 8}; }), 1,
        "RingOptions::cu_seqlens[2] = 3 is less than RingOptions::cu_seqlens[1] = 5");
    run(with([](int, std::vector<int64_t>&, sdpa::RingOptions&) {}), 2,
        "RingOptions::cu_seqlens needs q's batch B = 1 (packed documents are one row of tokens), but q has shape (2, 2, 4, 4)");
  }
}

}  // namespace
