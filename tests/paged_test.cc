// attention_paged: keys and values in a pool of pages through a block table. Each case builds a
// dense problem with Inputs::seqlens_k (Nk = max_pages · page_size, keys past each length
// poisoned with NaN), scatters the sequences' rows into shuffled pages of a pool whose other
// pages hold NaN, and checks the paged call against kReference on the dense problem by the
// tolerance rule, against the dense call bit for bit (the header's promise), and that no
// unused page or table entry is read.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;
using sdpa::Backend;
using sdpa::Causal;

struct PagedCase {
  DType dtype;     // q's
  DType kv_dtype;  // the pool's (q's, or 16-bit under float32 q)
  int64_t B, Hq, Hkv, Nq, max_pages, page_size, Dk, Dv;
  Causal causal;
  sdpa::Window window;
};

// A pool and block table holding the rows of t.k and t.v that each sequence uses.
struct Pool {
  GuardedTensor k, v;
  std::vector<int32_t> table;
  int64_t num_pages = 0;
};

Pool scatter(const Tensors& t, const PagedCase& c, std::mt19937& rng) {
  std::vector<int64_t> used(static_cast<size_t>(c.B));
  int64_t total = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    used[b] = (t.seqlens_k[b] + c.page_size - 1) / c.page_size;
    total += used[b];
  }
  const int64_t spare = 3;  // pages no sequence uses: NaN, never read
  Pool pool{GuardedTensor(t.k.dtype(), {total + spare, c.page_size, c.Hkv, c.Dk}),
            GuardedTensor(t.v.dtype(), {total + spare, c.page_size, c.Hkv, c.Dv}),
            std::vector<int32_t>(static_cast<size_t>(c.B * c.max_pages), -1), total + spare};
  for (int64_t x = 0; x < pool.k.numel(); ++x) pool.k.set(x, std::nan(""));
  for (int64_t x = 0; x < pool.v.numel(); ++x) pool.v.set(x, std::nan(""));
  std::vector<int32_t> order(static_cast<size_t>(total + spare));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  int64_t next = 0;
  const int64_t Nk = c.max_pages * c.page_size;
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t pg = 0; pg < used[b]; ++pg) {
      const int32_t page = order[next++];
      pool.table[b * c.max_pages + pg] = page;
      for (int64_t r = 0; r < c.page_size; ++r) {
        const int64_t j = pg * c.page_size + r;
        if (j >= t.seqlens_k[b]) break;  // the rest of the last page stays NaN
        for (int64_t h = 0; h < c.Hkv; ++h) {
          for (int64_t e = 0; e < c.Dk; ++e)
            pool.k.set(((page * c.page_size + r) * c.Hkv + h) * c.Dk + e, t.k.get(((b * c.Hkv + h) * Nk + j) * c.Dk + e));
          for (int64_t e = 0; e < c.Dv; ++e)
            pool.v.set(((page * c.page_size + r) * c.Hkv + h) * c.Dv + e, t.v.get(((b * c.Hkv + h) * Nk + j) * c.Dv + e));
        }
      }
    }
  }
  return pool;
}

std::vector<int64_t> lengths_for(const PagedCase& c, std::mt19937& rng) {
  // Every edge of a page: full, empty, one key, a page less one, a page plus one, and random.
  const int64_t Nk = c.max_pages * c.page_size;
  const int64_t edges[] = {Nk, 0, 1, c.page_size - 1, c.page_size + 1, Nk - 1};
  std::vector<int64_t> L;
  for (int64_t b = 0; b < c.B; ++b) {
    L.push_back(b < 6 ? std::clamp<int64_t>(edges[b], 0, Nk) : std::uniform_int_distribution<int64_t>(0, Nk)(rng));
  }
  return L;
}

Tensors dense_problem(const PagedCase& c, std::mt19937& rng) {
  const int64_t Nk = c.max_pages * c.page_size;
  Tensors t{GuardedTensor(kF64, {c.B, c.Hq, c.Nq, c.Dk}), GuardedTensor(kF64, {c.B, c.Hkv, Nk, c.Dk}),
            GuardedTensor(kF64, {c.B, c.Hkv, Nk, c.Dv}), std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  t.seqlens_k = lengths_for(c, rng);
  for (int64_t b = 0; b < c.B; ++b)  // keys past each length: NaN, never read
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t j = t.seqlens_k[b]; j < Nk; ++j) {
        for (int64_t e = 0; e < c.Dk; ++e) t.k.set(((b * c.Hkv + h) * Nk + j) * c.Dk + e, std::nan(""));
        for (int64_t e = 0; e < c.Dv; ++e) t.v.set(((b * c.Hkv + h) * Nk + j) * c.Dv + e, std::nan(""));
      }
  Tensors out{t.q.converted(c.dtype, Layout::kContiguous), t.k.converted(c.kv_dtype, Layout::kContiguous),
              t.v.converted(c.kv_dtype, Layout::kContiguous), std::nullopt, t.seqlens_k};
  return out;
}

// The call's inputs: t's queries and lengths, the pool and (a copy of) its table.
sdpa::PagedInputs paged_inputs(const Tensors& t, const Pool& pool, const PagedCase& c, std::vector<int32_t>& table,
                               std::vector<int64_t>& lengths) {
  table = pool.table;
  lengths = t.seqlens_k;
  sdpa::PagedInputs in;
  in.q = t.q.view();
  in.k_pages = pool.k.view();
  in.v_pages = pool.v.view();
  in.block_table = sdpa::TensorView::contiguous(table.data(), sdpa::DType::kInt32, {c.B, c.max_pages});
  in.seqlens_k = sdpa::TensorView::contiguous(lengths.data(), sdpa::DType::kInt64, {c.B});
  return in;
}

Outs run_paged(const Tensors& t, const Pool& pool, const PagedCase& c, const sdpa::Options& o) {
  const int64_t Nk = c.max_pages * c.page_size;
  Outs outs{GuardedTensor(c.dtype, {c.B, c.Hq, c.Nq, c.Dv}), std::nullopt, std::nullopt};
  outs.weights.emplace(compute_dtype(c.dtype), std::vector<int64_t>{c.B, c.Hq, c.Nq, Nk}, Layout::kContiguous, false);
  outs.lse.emplace(compute_dtype(c.dtype), std::vector<int64_t>{c.B, c.Hq, c.Nq}, Layout::kContiguous, false);
  std::vector<int32_t> table;
  std::vector<int64_t> lengths;
  sdpa::attention_paged(paged_inputs(t, pool, c, table, lengths), outs.outputs(), o);
  return outs;
}

void check_case(const PagedCase& c) {
  std::mt19937 rng(static_cast<uint32_t>(c.Nq * 7919 + c.page_size * 31 + c.B + c.Dk));
  const Tensors t = dense_problem(c, rng);
  const Pool pool = scatter(t, c, rng);
  sdpa::Options o;
  o.causal = c.causal;
  o.window = c.window;
  for (Backend backend : {Backend::kAuto, Backend::kReference}) {
    SCOPED_TRACE(backend_name(backend));
    o.backend = backend;
    const Outs got = run_paged(t, pool, c, o);
    EXPECT_TRUE(got.guards_intact());
    EXPECT_TRUE(matches_reference(t, o, got));
    EXPECT_TRUE(blocked_are_exact(t, o, got));
    // (The dense call without the AVX512_BF16 products, which a paged call does not use.)
    const KernelPathCap widening(sdpa::KernelPath::kSimd);
    const Outs dense = run(t, o);
    EXPECT_TRUE(bitwise_equal(got, dense));  // the same tiles, read through the pages
  }
}

std::vector<PagedCase> paged_cases() {
  std::vector<PagedCase> cases;
  const sdpa::Window none{}, win{40, 0};
  for (DType dt : {kF32, kF64, kBF16, kF16}) {
    cases.push_back({dt, dt, 7, 8, 2, 1, 40, 16, 64, 64, Causal::kBottomRight, none});     // decode, GQA 4:1
    cases.push_back({dt, dt, 6, 4, 4, 3, 9, 48, 32, 40, Causal::kBottomRight, none});      // few rows, page 48
    cases.push_back({dt, dt, 6, 2, 1, 16, 3, 128, 64, 64, Causal::kBottomRight, none});    // chunk prefill, page 128
    cases.push_back({dt, dt, 7, 2, 2, 40, 11, 32, 17, 24, Causal::kTopLeft, none});        // prefill: gathered tiles
    cases.push_back({dt, dt, 6, 4, 1, 2, 12, 16, 128, 128, Causal::kBottomRight, win});    // window
  }
  cases.push_back({kF32, kBF16, 7, 8, 2, 1, 20, 16, 64, 64, Causal::kBottomRight, none});  // float32 q, bf16 cache
  cases.push_back({kF32, kF16, 6, 4, 4, 4, 5, 256, 32, 32, Causal::kNone, none});
  cases.push_back({kF32, kF32, 6, 2, 2, 1, 140, 16, 64, 64, Causal::kNone, none});  // 2240 keys: the key split
  return cases;
}

class PagedSweep : public testing::TestWithParam<size_t> {};

TEST_P(PagedSweep, MatchesTheGatheredProblem) {
  const PagedCase c = paged_cases()[GetParam()];
  check_case(c);
  if (avx2_pass_skip_reason().empty()) {
    SCOPED_TRACE("AVX2");
    const Avx2Only avx2;
    check_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, PagedSweep, testing::Range<size_t>(0, paged_cases().size()),
                         [](const testing::TestParamInfo<size_t>& info) {
                           const PagedCase c = paged_cases()[info.param];
                           return std::string(sdpa::dtype_name(c.dtype)) + "_" + sdpa::dtype_name(c.kv_dtype) + "_b" +
                                  std::to_string(c.B) + "_h" + std::to_string(c.Hq) + "x" + std::to_string(c.Hkv) +
                                  "_q" + std::to_string(c.Nq) + "_pages" + std::to_string(c.max_pages) + "x" +
                                  std::to_string(c.page_size) + (c.window.left >= 0 ? "_win" : "") +
                                  (c.causal == Causal::kTopLeft ? "_causalTL" : "");
                         });

// Packed queries (cu_seqlens_q): sequence b's first n_b query rows (n_b cycling through Nq, 0,
// 1 and Nq - 1), packed (total_q, Hq, Dk), give bit for bit the call with q = those rows as
// (1, Hq, n_b, Dk) against table row b alone; lse (Hq, total_q) likewise.
TEST_P(PagedSweep, PackedQueriesAreEachSequenceAlone) {
  const PagedCase c = paged_cases()[GetParam()];
  std::mt19937 rng(static_cast<uint32_t>(GetParam() + 100));
  const Tensors t = dense_problem(c, rng);
  const Pool pool = scatter(t, c, rng);
  sdpa::Options o;
  o.causal = c.causal;
  o.window = c.window;
  std::vector<int64_t> cu = {0};
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t counts[] = {c.Nq, 0, 1, std::max<int64_t>(0, c.Nq - 1)};
    cu.push_back(cu.back() + counts[b % 4]);
  }
  const int64_t total = cu.back();
  GuardedTensor q(c.dtype, {total, c.Hq, c.Dk}), out(c.dtype, {total, c.Hq, c.Dv});
  GuardedTensor lse(compute_dtype(c.dtype), {c.Hq, total});
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t r = 0; r < cu[b + 1] - cu[b]; ++r)
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t e = 0; e < c.Dk; ++e)
          q.set(((cu[b] + r) * c.Hq + h) * c.Dk + e, t.q.get(((b * c.Hq + h) * c.Nq + r) * c.Dk + e));
  std::vector<int32_t> table;
  std::vector<int64_t> lengths;
  sdpa::PagedInputs in = paged_inputs(t, pool, c, table, lengths);
  in.q = q.view();
  in.cu_seqlens_q = sdpa::TensorView::contiguous(cu.data(), sdpa::DType::kInt64, {c.B + 1});
  sdpa::attention_paged(in, {out.view(), std::nullopt, lse.view()}, o);
  EXPECT_TRUE(out.guards_intact() && lse.guards_intact());
  for (int64_t b = 0; b < c.B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const int64_t n = cu[b + 1] - cu[b];
    GuardedTensor qb(c.dtype, {1, c.Hq, n, c.Dk}), ob(c.dtype, {1, c.Hq, n, c.Dv});
    GuardedTensor lb(compute_dtype(c.dtype), {1, c.Hq, n});
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t e = 0; e < c.Dk; ++e) qb.set((h * n + r) * c.Dk + e, q.get(((cu[b] + r) * c.Hq + h) * c.Dk + e));
    sdpa::PagedInputs alone = in;
    alone.cu_seqlens_q.reset();
    alone.q = qb.view();
    alone.block_table = sdpa::TensorView::contiguous(table.data() + b * c.max_pages, sdpa::DType::kInt32, {1, c.max_pages});
    alone.seqlens_k = sdpa::TensorView::contiguous(lengths.data() + b, sdpa::DType::kInt64, {1});
    sdpa::attention_paged(alone, {ob.view(), std::nullopt, lb.view()}, o);
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t e = 0; e < c.Dv; ++e) {
          const double got = out.get(((cu[b] + r) * c.Hq + h) * c.Dv + e), want = ob.get((h * n + r) * c.Dv + e);
          ASSERT_TRUE(got == want || (std::isnan(got) && std::isnan(want))) << "h " << h << " row " << r << " col " << e;
        }
        ASSERT_EQ(lse.get(h * total + cu[b] + r), lb.get(h * n + r)) << "lse h " << h << " row " << r;
      }
  }
}

TEST(Paged, PackedQueryErrorsNameTheSequence) {
  std::vector<float> pool(4 * 16 * 1 * 8, 0.5f), q(5 * 2 * 8, 0.25f), out(5 * 2 * 8, -7.0f);
  std::vector<int32_t> table = {0, 1, 2, 9};
  std::vector<int64_t> lengths = {20, 20}, cu = {0, 2, 5};
  sdpa::PagedInputs in;
  in.q = sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {5, 2, 8});
  in.k_pages = in.v_pages = sdpa::TensorView::contiguous(pool.data(), sdpa::DType::kFloat32, {4, 16, 1, 8});
  in.block_table = sdpa::TensorView::contiguous(table.data(), sdpa::DType::kInt32, {2, 2});
  in.seqlens_k = sdpa::TensorView::contiguous(lengths.data(), sdpa::DType::kInt64, {2});
  in.cu_seqlens_q = sdpa::TensorView::contiguous(cu.data(), sdpa::DType::kInt64, {3});
  const sdpa::Outputs outs{sdpa::TensorView::contiguous(out.data(), sdpa::DType::kFloat32, {5, 2, 8})};
  expect_sdpa_error([&] { sdpa::attention_paged(in, outs); },
                    {"block_table[1][1] = 9", "not a page of k_pages", "sequence 1 has 20 keys"});
  cu = {0, 2, 4};
  expect_sdpa_error([&] { sdpa::attention_paged(in, outs); }, {"cu_seqlens_q[2] = 4", "q has 5 rows"});
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }));  // nothing written
}

// Fuzz findings F13-F15: a table at an unaligned address is read as well as an aligned one; a
// pool of no pages is valid while no sequence has a key (out 0, lse -inf, weights 0) and an
// Error naming the table entry otherwise; a pool whose rows hold no element (Dk = 0, null data)
// is never offset into.
TEST(Paged, UnalignedTableEmptyPoolAndEmptyRows) {
  std::vector<float> pool(3 * 4 * 1 * 2), q = {0.5f, -1.0f};
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<float>(i % 7) - 3.0f;
  std::vector<int64_t> lengths = {10};
  const auto call = [&](const sdpa::TensorView& table, float* out, float* lse) {
    sdpa::PagedInputs in;
    in.q = sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {1, 1, 1, 2});
    in.k_pages = in.v_pages = sdpa::TensorView::contiguous(pool.data(), sdpa::DType::kFloat32, {3, 4, 1, 2});
    in.block_table = table;
    in.seqlens_k = sdpa::TensorView::contiguous(lengths.data(), sdpa::DType::kInt64, {1});
    sdpa::attention_paged(in, {sdpa::TensorView::contiguous(out, sdpa::DType::kFloat32, {1, 1, 1, 2}), std::nullopt,
                               sdpa::TensorView::contiguous(lse, sdpa::DType::kFloat32, {1, 1, 1})});
  };
  const int32_t pages[3] = {2, 0, 1};
  float out[2], lse[1], out_u[2], lse_u[1];
  call(sdpa::TensorView::contiguous(const_cast<int32_t*>(pages), sdpa::DType::kInt32, {1, 3}), out, lse);
  alignas(8) unsigned char bytes[2 + sizeof pages];  // the same entries 2 bytes past an int32 boundary
  std::memcpy(bytes + 2, pages, sizeof pages);
  call(sdpa::TensorView::contiguous(bytes + 2, sdpa::DType::kInt32, {1, 3}), out_u, lse_u);
  EXPECT_EQ(std::memcmp(out, out_u, sizeof out), 0);
  EXPECT_EQ(lse[0], lse_u[0]);

  // No pages, no keys: valid; with keys: an Error naming the entry its first key would use.
  sdpa::PagedInputs in;
  std::vector<float> q1(2, 1.0f), o(2, 9.0f), l(1, 9.0f), w(1 * 1 * 1 * 4, 9.0f);
  int32_t table[1] = {-1};
  std::vector<int64_t> none = {0};
  in.q = sdpa::TensorView::contiguous(q1.data(), sdpa::DType::kFloat32, {1, 1, 1, 2});
  in.k_pages = in.v_pages = sdpa::TensorView::contiguous(nullptr, sdpa::DType::kFloat32, {0, 4, 1, 2});
  in.block_table = sdpa::TensorView::contiguous(table, sdpa::DType::kInt32, {1, 1});
  in.seqlens_k = sdpa::TensorView::contiguous(none.data(), sdpa::DType::kInt64, {1});
  sdpa::attention_paged(in, {sdpa::TensorView::contiguous(o.data(), sdpa::DType::kFloat32, {1, 1, 1, 2}),
                             sdpa::TensorView::contiguous(w.data(), sdpa::DType::kFloat32, {1, 1, 1, 4}),
                             sdpa::TensorView::contiguous(l.data(), sdpa::DType::kFloat32, {1, 1, 1})});
  EXPECT_EQ(o, std::vector<float>(2, 0.0f));
  EXPECT_EQ(w, std::vector<float>(4, 0.0f));
  EXPECT_TRUE(std::isinf(l[0]) && l[0] < 0);
  none[0] = 3;
  expect_sdpa_error([&] { sdpa::attention_paged(in, {sdpa::TensorView::contiguous(o.data(), sdpa::DType::kFloat32, {1, 1, 1, 2})}); },
                    {"block_table[0][0] = -1", "num_pages = 0", "sequence 0 has 3 keys"});

  // Rows of no element (Dk = 0, null data): every score is 0, so out is the mean of the values.
  std::vector<float> v(2 * 4 * 1 * 1), o1(1, 9.0f);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  int32_t two[2] = {1, 0};
  std::vector<int64_t> six = {6};
  sdpa::PagedInputs e;
  e.q = sdpa::TensorView::contiguous(nullptr, sdpa::DType::kFloat32, {1, 1, 1, 0});
  e.k_pages = sdpa::TensorView::contiguous(nullptr, sdpa::DType::kFloat32, {2, 4, 1, 0});
  e.v_pages = sdpa::TensorView::contiguous(v.data(), sdpa::DType::kFloat32, {2, 4, 1, 1});
  e.block_table = sdpa::TensorView::contiguous(two, sdpa::DType::kInt32, {1, 2});
  e.seqlens_k = sdpa::TensorView::contiguous(six.data(), sdpa::DType::kInt64, {1});
  sdpa::attention_paged(e, {sdpa::TensorView::contiguous(o1.data(), sdpa::DType::kFloat32, {1, 1, 1, 1})});
  EXPECT_FLOAT_EQ(o1[0], (4 + 5 + 6 + 7 + 0 + 1) / 6.0f);  // page 1's rows 0-3, page 0's rows 0-1
}

// The header's picture: page_size 4, block_table[b] = {7, 2, 5}, 10 keys: keys 0-3 in page 7,
// 4-7 in page 2, 8-9 in rows 0-1 of page 5. One query with q = 0 weighs the 10 keys equally, so
// out is the mean of the value rows it reads: each row holds its (page, row) code.
TEST(Paged, HeaderPicture) {
  const int64_t pages = 8, ps = 4;
  std::vector<float> k(pages * ps * 1 * 2, 0.0f), v(pages * ps * 1 * 1, -1e6f), q(2, 0.0f), out(1, -1.0f);
  const int32_t table[3] = {7, 2, 5};
  std::vector<int64_t> where;
  for (int64_t j = 0; j < 10; ++j) where.push_back(table[j / ps] * ps + j % ps);
  for (int64_t j = 0; j < 10; ++j) v[where[j]] = static_cast<float>(j);  // value = the key's index
  const int64_t L = 10;
  sdpa::PagedInputs in;
  in.q = sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {1, 1, 1, 2});
  in.k_pages = sdpa::TensorView::contiguous(k.data(), sdpa::DType::kFloat32, {pages, ps, 1, 2});
  in.v_pages = sdpa::TensorView::contiguous(v.data(), sdpa::DType::kFloat32, {pages, ps, 1, 1});
  in.block_table = sdpa::TensorView::contiguous(const_cast<int32_t*>(table), sdpa::DType::kInt32, {1, 3});
  in.seqlens_k = sdpa::TensorView::contiguous(const_cast<int64_t*>(&L), sdpa::DType::kInt64, {1});
  sdpa::Outputs o;
  o.out = sdpa::TensorView::contiguous(out.data(), sdpa::DType::kFloat32, {1, 1, 1, 1});
  sdpa::attention_paged(in, o);
  EXPECT_FLOAT_EQ(out[0], 4.5f);  // the mean of 0 .. 9: no other row of the pool was read
}

// The same results for any thread count, bit for bit (decode with the key split).
TEST(Paged, ThreadCountDoesNotChangeResults) {
  const PagedCase c{kF32, kBF16, 3, 4, 1, 1, 150, 16, 64, 64, Causal::kBottomRight, {}};
  std::mt19937 rng(9);
  const Tensors t = dense_problem(c, rng);
  const Pool pool = scatter(t, c, rng);
  sdpa::set_num_threads(1);
  const Outs one = run_paged(t, pool, c, {});
  sdpa::set_num_threads(2);
  const Outs two = run_paged(t, pool, c, {});
  sdpa::set_num_threads(3);
  const Outs three = run_paged(t, pool, c, {});
  sdpa::set_num_threads(0);
  EXPECT_TRUE(bitwise_equal(one, two));
  EXPECT_TRUE(bitwise_equal(one, three));
}

// Errors name the argument, and nothing is written.
TEST(Paged, BadArgumentsAreErrorsThatWriteNothing) {
  const PagedCase c{kF32, kF32, 2, 2, 1, 1, 3, 16, 8, 8, Causal::kNone, {}};
  std::mt19937 rng(4);
  const Tensors t = dense_problem(c, rng);
  const Pool pool = scatter(t, c, rng);
  const auto call = [&](const std::function<void(sdpa::PagedInputs&, std::vector<int32_t>&, std::vector<int64_t>&)>& edit,
                        const char* message) {
    SCOPED_TRACE(message);
    GuardedTensor out(kF32, {c.B, c.Hq, c.Nq, c.Dv});
    std::vector<int32_t> table;
    std::vector<int64_t> lengths;
    sdpa::PagedInputs in = paged_inputs(t, pool, c, table, lengths);
    edit(in, table, lengths);
    sdpa::Outputs o;
    o.out = out.view();
    try {
      sdpa::attention_paged(in, o);
      ADD_FAILURE() << "no error";
    } catch (const sdpa::Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    EXPECT_TRUE(out.untouched());
  };
  // Sequence 0 has all 48 keys (3 pages), so its table row is read whole.
  call([](auto&, auto& table, auto&) { table[1] = -1; }, "block_table[0][1] = -1 is not a page of k_pages");
  call([&](auto&, auto& table, auto&) { table[2] = static_cast<int32_t>(pool.num_pages); }, "block_table[0][2]");
  call([](auto&, auto&, auto& lengths) { lengths[1] = 49; }, "seqlens_k");
  call([](auto& in, auto&, auto&) { in.v_pages.shape[1] = 8; }, "v_pages has shape");
  call([](auto& in, auto&, auto&) { in.k_pages.shape[3] = 4; }, "k_pages has Dk=4");
  call([](auto& in, auto&, auto&) { in.block_table.dtype = sdpa::DType::kFloat32; }, "block_table has dtype float32");
  call([](auto& in, auto&, auto&) { in.block_table.shape[0] = 1; }, "block_table has shape (1, 3) but q has batch 2");
  call([](auto& in, auto&, auto&) { in.q.rank = 3; }, "q has shape");
  call([](auto& in, auto&, auto&) { in.k_pages.shape[1] = 0; in.v_pages.shape[1] = 0; }, "page_size");
}

// Two sequences sharing a prefix read the same pages (read-only): the second sequence's table
// points at the first's two full pages, then a page of its own.
TEST(Paged, SequencesMaySharePages) {
  const PagedCase c{kF32, kF32, 2, 2, 1, 2, 4, 16, 16, 16, Causal::kBottomRight, {}};
  std::mt19937 rng(8);
  Tensors t = dense_problem(c, rng);
  t.seqlens_k = {40, 45};
  const int64_t Nk = c.max_pages * c.page_size;
  for (int64_t j = 0; j < Nk; ++j)  // sequence 1's first 32 keys are sequence 0's; the rest finite
    for (int64_t e = 0; e < c.Dk; ++e) {
      const double k0 = j < 32 ? t.k.get(j * c.Dk + e) : static_cast<double>(e % 5) - 2;
      const double v0 = j < 32 ? t.v.get(j * c.Dv + e) : static_cast<double>(e % 3) - 1;
      t.k.set((Nk + j) * c.Dk + e, k0);
      t.v.set((Nk + j) * c.Dv + e, v0);
      if (j >= 32) {
        t.k.set(j * c.Dk + e, k0);
        t.v.set(j * c.Dv + e, v0);
      }
    }
  Pool pool = scatter(t, c, rng);  // 3 + 3 pages: sequence 1's first two are copies
  for (int64_t pg = 0; pg < 2; ++pg) {  // its own copies become NaN: only the shared ones are read
    const int64_t own = pool.table[c.max_pages + pg];
    for (int64_t x = 0; x < c.page_size * c.Dk; ++x) pool.k.set(own * c.page_size * c.Dk + x, std::nan(""));
    for (int64_t x = 0; x < c.page_size * c.Dv; ++x) pool.v.set(own * c.page_size * c.Dv + x, std::nan(""));
    pool.table[c.max_pages + pg] = pool.table[pg];
  }
  sdpa::Options o;
  o.causal = c.causal;
  const Outs got = run_paged(t, pool, c, o);
  EXPECT_TRUE(matches_reference(t, o, got));
  EXPECT_TRUE(blocked_are_exact(t, o, got));
}

// A table entry past a sequence's pages is never read: -1 or garbage there changes nothing.
TEST(Paged, EntriesPastASequencesPagesAreNotRead) {
  const PagedCase c{kF32, kF32, 3, 2, 1, 1, 6, 16, 32, 32, Causal::kNone, {}};
  std::mt19937 rng(6);
  Tensors t = dense_problem(c, rng);
  t.seqlens_k = {17, 0, 33};  // 2, 0 and 3 pages of 6
  // (rows past the new lengths are finite now; they are not in the pool either way)
  Pool pool = scatter(t, c, rng);
  const Outs clean = run_paged(t, pool, c, {});
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t pg = (t.seqlens_k[b] + 15) / 16; pg < c.max_pages; ++pg) pool.table[b * c.max_pages + pg] = 1 << 30;
  const Outs garbage = run_paged(t, pool, c, {});
  EXPECT_TRUE(bitwise_equal(clean, garbage));
}

}  // namespace
