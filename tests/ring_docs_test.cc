// Ring attention with packed documents (RingOptions::cu_seqlens) in both strategies: the ranks'
// results against attention_varlen on the whole packed sequence, which is attention() of each
// document on its own rows (include/sdpa/attention.h), so each document is held to the tolerance
// rule of its own call (expected_forward / expected of the document's tensors) plus the merges'
// and sums' bounds ring_test derives; repeatable bit for bit; the refusals and the collective
// check of the offsets.
#include <gtest/gtest.h>

#include <algorithm>
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
    {"w4_contiguous_not_causal_one_doc", 4, kCont, 2, 1, 5, 8, 8, {0, 20}},
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

// attention_varlen of the whole packed sequence (the backend given) as (1, Hq, N, Dv) out and
// (1, Hq, N) lse values.
std::pair<std::vector<double>, std::vector<double>> varlen(const Tensors& t, const std::vector<int64_t>& cu,
                                                           const Options& o) {
  const auto packed = [](const GuardedTensor& x) {  // (1, H, N, D) -> (N, H, D)
    const std::vector<int64_t> s = x.shape();
    const std::vector<double> v = x.values();
    std::vector<double> p(v.size());
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t n = 0; n < s[2]; ++n)
        for (int64_t e = 0; e < s[3]; ++e) p[static_cast<size_t>((n * s[1] + h) * s[3] + e)] = v[static_cast<size_t>((h * s[2] + n) * s[3] + e)];
    return tensor(x.dtype(), {s[2], s[1], s[3]}, p);
  };
  const GuardedTensor q = packed(t.q), k = packed(t.k), v = packed(t.v);
  const int64_t N = t.q.shape()[2], Hq = t.q.shape()[1], Dv = t.v.shape()[3];
  GuardedTensor out(compute_dtype(t.q.dtype()), {N, Hq, Dv}), lse(compute_dtype(t.q.dtype()), {Hq, N});
  std::vector<int64_t> offsets = cu;
  const sdpa::TensorView cu_v = sdpa::TensorView::contiguous(offsets.data(), DType::kInt64, {static_cast<int64_t>(cu.size())});
  sdpa::attention_varlen({q.view(), k.view(), v.view(), cu_v, cu_v}, {out.view(), lse.view()}, o);
  const std::vector<double> ov = out.values();
  std::vector<double> o4(ov.size());
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < Dv; ++e) o4[static_cast<size_t>((h * N + n) * Dv + e)] = ov[static_cast<size_t>((n * Hq + h) * Dv + e)];
  return {o4, lse.values()};
}

sdpa::RingOptions ring_options(const DocCase& c, RingStrategy strategy, std::vector<int64_t>& cu) {
  sdpa::RingOptions ring{c.layout, 30.0};
  ring.cu_seqlens = sdpa::TensorView::contiguous(cu.data(), DType::kInt64, {static_cast<int64_t>(cu.size())});
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
  const auto [ref_out, ref_lse] = varlen(t, cu, ro);
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

TEST_F(Ring, DocumentsForwardMatchVarlen) {
  for (RingStrategy strategy : {RingStrategy::kRing, RingStrategy::kAllGather}) {
    for (const DocCase& c : kDocCases) {
      if (!supported(c, strategy)) continue;
      for (DType dt : {kF32, kF64, kBF16}) {
        SCOPED_TRACE(std::string(c.name) + " " + sdpa::dtype_name(dt) +
                     (strategy == RingStrategy::kRing ? " kRing" : " kAllGather"));
        check_docs_forward(c, dt, strategy);
      }
    }
  }
}

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
  // The backward with documents is not supported yet: refused on every rank, nothing written.
  {
    const Tensors t = random_qkv(kF32, {1, 2, N, 4}, {1, 2, N, 4}, {1, 2, N, 4}, 3);
    std::vector<RankData> ranks = shards(t, W, kCont, kF32);
    std::vector<int64_t> cu = {0, 3, 8};
    LocalWorld world(W);
    std::vector<GuardedTensor> dq, dk, dv;
    for (int r = 0; r < W; ++r) {
      for (auto* g : {&dq, &dk, &dv}) g->emplace_back(kF32, std::vector<int64_t>{1, 2, n_local, 4});
    }
    const auto errors = messages(world.run([&](int r, sdpa::Communicator& comm) {
      RankData& d = ranks[static_cast<size_t>(r)];
      sdpa::RingOptions ring{kCont, 5.0};
      ring.cu_seqlens = sdpa::TensorView::contiguous(cu.data(), DType::kInt64, {3});
      sdpa::ring_attention_backward(comm, {d.q.view(), d.k.view(), d.v.view()}, d.out.view(), d.lse.view(), d.out.view(),
                                    {dq[r].view(), dk[r].view(), dv[r].view()}, {}, ring);
    }));
    for (int r = 0; r < W; ++r) {
      EXPECT_NE(errors[static_cast<size_t>(r)].find("cu_seqlens (packed documents) is not supported yet"), std::string::npos)
          << "rank " << r << ": " << errors[static_cast<size_t>(r)];
      EXPECT_TRUE(dq[r].untouched() && dk[r].untouched() && dv[r].untouched());
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
