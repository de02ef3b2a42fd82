// Options::batch_invariant: a query row's out, bit for bit, depends only on the row, its own keys
// and the options. One "target" sequence's last rows are computed
//   (a) alone: B 1, Nq 1 each, and token by token from a growing KVCache (causal),
//   (b) in a dense batch of B 5 with other random sequences (seqlens_k),
//   (c) as chunked prefill, chunks of 7, 64 and 300 rows,
//   (d) through attention_varlen beside other sequences,
//   (e) through attention_paged with pages of 1, 16 and 128 beside other sequences,
//   (f) with 1 and 2 threads,
// for key counts 1, 127, 4097 and 9000 (one to three of the 4096-key chunks), every float dtype,
// causal or not, GQA, Dv != Dk, softcap and sinks; all must give the alone call's bits. And
// without the option at least one of them differs today (the option is not vacuous).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "oracle.h"
#include "sdpa/attention.h"
#include "sdpa/kv_cache.h"
#include "test_util.h"

namespace {

using sdpa::DType;
using sdpa::TensorView;

constexpr int64_t kHq = 4, kHkv = 2;
// Head dims of the sequences built next: 64 and 32, or odd ones (OddHeadDims below: the
// kernels' tails of a vector of features).
int64_t g_dk = 64, g_dv = 32;
// K and V in an 8-bit cache (BatchInvarianceKv8 below): int8 with one scale per (token, kv
// head), the Seq's values multiples of a power-of-two scale with one element at ±127, so that
// every layout stores the same int8 values and scales (a KVCache's own quantiser included).
bool g_kv8 = false;

void put(uint8_t* p, DType t, double x) {
  if (t == DType::kFloat32) {
    const float f = static_cast<float>(x);
    std::memcpy(p, &f, sizeof f);
  } else if (t == DType::kFloat64) {
    std::memcpy(p, &x, sizeof x);
  } else {
    const auto& f = sdpa_oracle::half_format(t);
    const uint16_t bits = sdpa_oracle::half_bits(f, sdpa_oracle::round_half(f, x));
    std::memcpy(p, &bits, sizeof bits);
  }
}

// A sequence, token-major: q (L, Hq, Dk), k (L, Hkv, Dk), v (L, Hkv, Dv) as values; with
// g_kv8, ks and vs the scales of k's and v's rows (L, Hkv).
struct Seq {
  int64_t L = 0;
  std::vector<double> q, k, v, ks, vs;
};

Seq random_seq(int64_t L, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  Seq s{L, std::vector<double>(L * kHq * g_dk), std::vector<double>(L * kHkv * g_dk), std::vector<double>(L * kHkv * g_dv),
        std::vector<double>(L * kHkv, 1.0), std::vector<double>(L * kHkv, 1.0)};
  for (auto* x : {&s.q, &s.k, &s.v})
    for (double& e : *x) e = normal(rng);
  if (g_kv8) {
    std::uniform_int_distribution<int> value(-127, 127), exponent(4, 7);
    for (auto [x, scales, D] : {std::tuple{&s.k, &s.ks, g_dk}, std::tuple{&s.v, &s.vs, g_dv}})
      for (int64_t r = 0; r < L * kHkv; ++r) {
        (*scales)[r] = std::ldexp(1.0, -exponent(rng));
        for (int64_t d = 0; d < D; ++d) (*x)[r * D + d] = (d == 0 ? 127 : value(rng)) * (*scales)[r];
      }
  }
  return s;
}

// Bytes in dtype t, shape (lead..., D) C-order.
struct Buf {
  DType t;
  std::vector<uint8_t> bytes;
  Buf(DType t, int64_t n) : t(t), bytes(static_cast<size_t>(n * sdpa::dtype_size(t))) {}
  uint8_t* at(int64_t x) { return bytes.data() + x * sdpa::dtype_size(t); }
  TensorView view(std::initializer_list<int64_t> shape) { return TensorView::contiguous(bytes.data(), t, shape); }
};

struct Config {
  DType dtype;
  bool causal;
  bool modifiers;  // softcap and sinks
};

// Element d of row `row` (D wide) of k or v: in the call's dtype, or (g_kv8) as int8 x / scale
// with the row's scale in s.
void put_kv(Buf& x, Buf& s, int64_t row, int64_t D, int64_t d, double value, double scale) {
  if (!g_kv8) return put(x.at(row * D + d), x.t, value);
  const auto q = static_cast<int8_t>(std::lrint(value / scale));
  std::memcpy(x.at(row * D + d), &q, 1);
  put(s.at(row), DType::kFloat32, scale);
}
DType kv_dtype(DType t) { return g_kv8 ? DType::kInt8 : t; }

// One query row's output (Hq × Dv elements of out), as bytes.
using Row = std::vector<uint8_t>;

class Runner {
 public:
  Runner(const Config& c, bool invariant) : c_(c), sz_(sdpa::dtype_size(c.dtype)) {
    opt_.causal = c.causal ? sdpa::Causal::kBottomRight : sdpa::Causal::kNone;
    opt_.batch_invariant = invariant;
    if (c.modifiers) {
      opt_.softcap = 20.0;
      for (int64_t h = 0; h < kHq; ++h) sinks_[h] = 0.5f * static_cast<float>(h) - 0.7f;
      opt_.sinks = TensorView::contiguous(sinks_, DType::kFloat32, {kHq});
    }
  }
  // The keys row `pos` of s sees: [0, pos] under causal, all of them otherwise.
  int64_t keys_of(const Seq& s, int64_t pos) const { return c_.causal ? pos + 1 : s.L; }

  // Dense attention of items (sequence, first query position, keys) with n rows each: B =
  // items, seqlens_k when asked (else every item has Nk keys). Returns row (b, i).
  struct Item {
    const Seq* s;
    int64_t q0, keys;
  };
  std::vector<Row> dense(const std::vector<Item>& items, int64_t n, bool seqlens) {
    const int64_t B = static_cast<int64_t>(items.size());
    int64_t Nk = 0;
    for (const Item& it : items) Nk = std::max(Nk, it.keys);
    Buf q(c_.dtype, B * kHq * n * g_dk), k(kv_dtype(c_.dtype), B * kHkv * Nk * g_dk),
        v(kv_dtype(c_.dtype), B * kHkv * Nk * g_dv), out(c_.dtype, B * kHq * n * g_dv), ks(DType::kFloat32, B * kHkv * Nk),
        vs(DType::kFloat32, B * kHkv * Nk);
    std::vector<int64_t> lens(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      const Item& it = items[b];
      lens[b] = it.keys;
      for (int64_t h = 0; h < kHq; ++h)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t d = 0; d < g_dk; ++d) put(q.at(((b * kHq + h) * n + i) * g_dk + d), c_.dtype, it.s->q[((it.q0 + i) * kHq + h) * g_dk + d]);
      for (int64_t h = 0; h < kHkv; ++h)
        for (int64_t j = 0; j < Nk; ++j) {
          const int64_t row = (b * kHkv + h) * Nk + j, at = j * kHkv + h;  // (rows past keys: 0, scale 1)
          for (int64_t d = 0; d < g_dk; ++d)
            put_kv(k, ks, row, g_dk, d, j < it.keys ? it.s->k[at * g_dk + d] : 0.0, j < it.keys ? it.s->ks[at] : 1.0);
          for (int64_t d = 0; d < g_dv; ++d)
            put_kv(v, vs, row, g_dv, d, j < it.keys ? it.s->v[at * g_dv + d] : 0.0, j < it.keys ? it.s->vs[at] : 1.0);
        }
    }
    sdpa::Inputs in{q.view({B, kHq, n, g_dk}), k.view({B, kHkv, Nk, g_dk}), v.view({B, kHkv, Nk, g_dv})};
    if (seqlens) in.seqlens_k = TensorView::contiguous(lens.data(), DType::kInt64, {B});
    if (g_kv8) in.kv_quant = sdpa::KVQuant{ks.view({B, kHkv, Nk}), vs.view({B, kHkv, Nk})};
    sdpa::attention(in, {out.view({B, kHq, n, g_dv})}, opt_);
    std::vector<Row> rows;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) rows.push_back(gather(out, [&](int64_t h, int64_t e) { return ((b * kHq + h) * n + i) * g_dv + e; }));
    return rows;
  }

  // attention_varlen of sequences (each: its last nq rows against all its keys).
  std::vector<Row> varlen(const std::vector<const Seq*>& seqs, const std::vector<int64_t>& nq) {
    std::vector<int64_t> cq{0}, ck{0};
    for (size_t b = 0; b < seqs.size(); ++b) cq.push_back(cq.back() + nq[b]), ck.push_back(ck.back() + seqs[b]->L);
    Buf q(c_.dtype, cq.back() * kHq * g_dk), k(kv_dtype(c_.dtype), ck.back() * kHkv * g_dk),
        v(kv_dtype(c_.dtype), ck.back() * kHkv * g_dv), out(c_.dtype, cq.back() * kHq * g_dv),
        ks(DType::kFloat32, ck.back() * kHkv), vs(DType::kFloat32, ck.back() * kHkv);
    for (size_t b = 0; b < seqs.size(); ++b) {
      const Seq& s = *seqs[b];
      for (int64_t i = 0; i < nq[b] * kHq * g_dk; ++i) put(q.at(cq[b] * kHq * g_dk + i), c_.dtype, s.q[(s.L - nq[b]) * kHq * g_dk + i]);
      for (int64_t i = 0; i < s.L * kHkv * g_dk; ++i) put_kv(k, ks, ck[b] * kHkv + i / g_dk, g_dk, i % g_dk, s.k[i], s.ks[i / g_dk]);
      for (int64_t i = 0; i < s.L * kHkv * g_dv; ++i) put_kv(v, vs, ck[b] * kHkv + i / g_dv, g_dv, i % g_dv, s.v[i], s.vs[i / g_dv]);
    }
    const int64_t B1 = static_cast<int64_t>(cq.size());
    sdpa::VarlenInputs in{q.view({cq.back(), kHq, g_dk}), k.view({ck.back(), kHkv, g_dk}), v.view({ck.back(), kHkv, g_dv}),
                          TensorView::contiguous(cq.data(), DType::kInt64, {B1}),
                          TensorView::contiguous(ck.data(), DType::kInt64, {B1})};
    if (g_kv8) in.kv_quant = sdpa::KVQuant{ks.view({ck.back(), kHkv}), vs.view({ck.back(), kHkv})};
    sdpa::attention_varlen(in, {out.view({cq.back(), kHq, g_dv})}, opt_);
    std::vector<Row> rows;
    for (int64_t r = 0; r < cq.back(); ++r) rows.push_back(gather(out, [&](int64_t h, int64_t e) { return (r * kHq + h) * g_dv + e; }));
    return rows;
  }

  // attention_paged of sequences (each: its last nq rows against all its keys) from a pool of
  // pages of page_size, shuffled. Returns row (b, i).
  std::vector<Row> paged(const std::vector<const Seq*>& seqs, int64_t nq, int64_t page_size, std::mt19937& rng) {
    const int64_t B = static_cast<int64_t>(seqs.size());
    int64_t max_pages = 0, pages = 0;
    for (const Seq* s : seqs) {
      const int64_t n = (s->L + page_size - 1) / page_size;
      max_pages = std::max(max_pages, n);
      pages += n;
    }
    std::vector<int32_t> order(static_cast<size_t>(pages)), table(static_cast<size_t>(B * max_pages), -1);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    Buf k(kv_dtype(c_.dtype), pages * page_size * kHkv * g_dk), v(kv_dtype(c_.dtype), pages * page_size * kHkv * g_dv),
        q(c_.dtype, B * kHq * nq * g_dk), out(c_.dtype, B * kHq * nq * g_dv), ks(DType::kFloat32, pages * page_size * kHkv),
        vs(DType::kFloat32, pages * page_size * kHkv);
    for (int64_t r = 0; r < pages * page_size * kHkv; ++r) put(ks.at(r), DType::kFloat32, 1.0), put(vs.at(r), DType::kFloat32, 1.0);
    std::vector<int64_t> lens;
    size_t next = 0;
    for (int64_t b = 0; b < B; ++b) {
      const Seq& s = *seqs[b];
      lens.push_back(s.L);
      for (int64_t pg = 0; pg * page_size < s.L; ++pg) table[b * max_pages + pg] = order[next++];
      for (int64_t j = 0; j < s.L; ++j) {
        const int64_t row = table[b * max_pages + j / page_size] * page_size + j % page_size;
        for (int64_t x = 0; x < kHkv * g_dk; ++x)
          put_kv(k, ks, row * kHkv + x / g_dk, g_dk, x % g_dk, s.k[j * kHkv * g_dk + x], s.ks[j * kHkv + x / g_dk]);
        for (int64_t x = 0; x < kHkv * g_dv; ++x)
          put_kv(v, vs, row * kHkv + x / g_dv, g_dv, x % g_dv, s.v[j * kHkv * g_dv + x], s.vs[j * kHkv + x / g_dv]);
      }
      for (int64_t h = 0; h < kHq; ++h)
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t d = 0; d < g_dk; ++d) put(q.at(((b * kHq + h) * nq + i) * g_dk + d), c_.dtype, s.q[((s.L - nq + i) * kHq + h) * g_dk + d]);
    }
    sdpa::PagedInputs in{q.view({B, kHq, nq, g_dk}), k.view({pages, page_size, kHkv, g_dk}), v.view({pages, page_size, kHkv, g_dv}),
                         TensorView::contiguous(table.data(), DType::kInt32, {B, max_pages}),
                         TensorView::contiguous(lens.data(), DType::kInt64, {B})};
    if (g_kv8) in.kv_quant = sdpa::KVQuant{ks.view({pages, page_size, kHkv}), vs.view({pages, page_size, kHkv})};
    sdpa::attention_paged(in, {out.view({B, kHq, nq, g_dv})}, opt_);
    std::vector<Row> rows;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < nq; ++i) rows.push_back(gather(out, [&](int64_t h, int64_t e) { return ((b * kHq + h) * nq + i) * g_dv + e; }));
    return rows;
  }

  // A KVCache (pages of 16) decoding the target token by token beside another sequence: the
  // target's rows at positions [first, L) (causal).
  std::vector<Row> kv_cache_decode(const Seq& target, const Seq& other, int64_t first) {
    sdpa::KVCache cache(2 * ((target.L + other.L) / 16 + 2), 16, kHkv, g_dk, g_dv, kv_dtype(c_.dtype));  // (8-bit: its own quantiser)
    const int64_t a = cache.new_sequence(), t = cache.new_sequence();
    const auto append = [&](int64_t seq, const Seq& s, int64_t j0, int64_t j1) {
      if (j1 <= j0) return;
      Buf k(c_.dtype, (j1 - j0) * kHkv * g_dk), v(c_.dtype, (j1 - j0) * kHkv * g_dv);
      for (int64_t x = 0; x < (j1 - j0) * kHkv * g_dk; ++x) put(k.at(x), c_.dtype, s.k[j0 * kHkv * g_dk + x]);
      for (int64_t x = 0; x < (j1 - j0) * kHkv * g_dv; ++x) put(v.at(x), c_.dtype, s.v[j0 * kHkv * g_dv + x]);
      cache.append(seq, k.view({j1 - j0, kHkv, g_dk}), v.view({j1 - j0, kHkv, g_dv}));
    };
    append(a, other, 0, other.L - 1);
    append(t, target, 0, first);
    std::vector<Row> rows;
    for (int64_t pos = first; pos < target.L; ++pos) {
      append(t, target, pos, pos + 1);
      Buf q(c_.dtype, 2 * kHq * g_dk), out(c_.dtype, 2 * kHq * g_dv);
      const Seq* s[2] = {&other, &target};
      const int64_t at[2] = {other.L - 1, pos};
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t x = 0; x < kHq * g_dk; ++x) put(q.at(b * kHq * g_dk + x), c_.dtype, s[b]->q[at[b] * kHq * g_dk + x]);
      cache.attention(q.view({2, kHq, 1, g_dk}), {a, t}, {out.view({2, kHq, 1, g_dv})}, opt_);
      rows.push_back(gather(out, [&](int64_t h, int64_t e) { return (kHq + h) * g_dv + e; }));
    }
    return rows;
  }

 private:
  template <class Index>
  Row gather(Buf& out, Index index) const {
    Row r;
    for (int64_t h = 0; h < kHq; ++h)
      for (int64_t e = 0; e < g_dv; ++e) {
        const uint8_t* p = out.at(index(h, e));
        r.insert(r.end(), p, p + sz_);
      }
    return r;
  }
  Config c_;
  int64_t sz_;
  sdpa::Options opt_;
  float sinks_[kHq] = {};
};

// Runs every way of computing the target's last rows; returns how many rows differ from the
// alone call's, and describes the first in *first.
int64_t differing_rows(const Config& c, int64_t L, bool invariant, std::string* first) {
  std::mt19937 rng(static_cast<uint32_t>(L * 7 + static_cast<int>(c.dtype) * 3 + c.causal));
  const Seq target = random_seq(L, rng);
  std::vector<Seq> others;
  for (int x = 0; x < 4; ++x) others.push_back(random_seq(std::uniform_int_distribution<int64_t>(9, 1500)(rng), rng));
  const int64_t P = std::min<int64_t>(L, 9), first_pos = L - P;  // the rows compared
  int64_t differ = 0;
  const auto compare = [&](const std::string& how, int64_t pos, const Row& got, const Row& want) {
    if (got == want) return;
    if (differ++ == 0) *first = how + ", row at position " + std::to_string(pos);
  };
  for (int threads : {1, 2}) {
    sdpa::set_num_threads(threads);
    const std::string th = " (" + std::to_string(threads) + " threads)";
    Runner run(c, invariant);
    std::vector<Row> alone;
    for (int64_t pos = first_pos; pos < L; ++pos) alone.push_back(run.dense({{&target, pos, run.keys_of(target, pos)}}, 1, false)[0]);
    // (b) a dense batch of 5, the target third, all rows of the target's last P.
    // (Every other sequence has at least 9 >= P keys: each gives its last P rows.)
    std::vector<Runner::Item> items;
    for (const Seq& o : others) items.push_back({&o, o.L - P, o.L});
    items.insert(items.begin() + 2, {&target, first_pos, L});
    const auto batch = run.dense(items, P, true);
    for (int64_t i = 0; i < P; ++i) compare("dense batch of 5" + th, first_pos + i, batch[2 * P + i], alone[i]);
    // (c) chunked prefill: chunks of n from position 0; those holding the compared rows.
    for (int64_t n : {7, 64, 300}) {
      for (int64_t a = first_pos / n * n; a < L; a += n) {
        const int64_t m = std::min(n, L - a);
        const auto rows = run.dense({{&target, a, c.causal ? a + m : L}}, m, false);
        for (int64_t i = std::max(a, first_pos); i < a + m; ++i)
          compare("chunked prefill by " + std::to_string(n) + th, i, rows[i - a], alone[i - first_pos]);
      }
    }
    // (d) varlen beside other sequences.
    {
      const auto rows = run.varlen({&others[0], &target, &others[1]}, {std::min<int64_t>(5, others[0].L), P, 1});
      const int64_t off = std::min<int64_t>(5, others[0].L);
      for (int64_t i = 0; i < P; ++i) compare("attention_varlen" + th, first_pos + i, rows[off + i], alone[i]);
    }
    // (e) paged, pages of 1, 16, 128, beside other sequences (the same Nq: P rows of each).
    for (int64_t ps : {1, 16, 128}) {
      const auto rows = run.paged({&others[2], &target, &others[3]}, P, ps, rng);
      for (int64_t i = 0; i < P; ++i) compare("attention_paged, pages of " + std::to_string(ps) + th, first_pos + i, rows[P + i], alone[i]);
    }
    // (a) token by token from a growing KVCache (a decode step sees the keys up to itself).
    if (c.causal) {
      const auto rows = run.kv_cache_decode(target, others[0], first_pos);
      for (int64_t i = 0; i < P; ++i) compare("KVCache decode" + th, first_pos + i, rows[i], alone[i]);
    }
  }
  sdpa::set_num_threads(0);
  return differ;
}

std::string name_of(DType t) { return sdpa::dtype_name(t); }

class BatchInvariance : public testing::TestWithParam<std::tuple<DType, bool, bool>> {};

TEST_P(BatchInvariance, RowsAreBitwiseEqualHoweverBatched) {
  const auto [dtype, causal, modifiers] = GetParam();
  for (int64_t L : {1, 127, 4097, 9000}) {
    std::string first;
    EXPECT_EQ(differing_rows({dtype, causal, modifiers}, L, /*invariant=*/true, &first), 0)
        << name_of(dtype) << " L=" << L << " causal=" << causal << ": first differing: " << first;
  }
}

INSTANTIATE_TEST_SUITE_P(All, BatchInvariance,
                         testing::Combine(testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64),
                                          testing::Bool(), testing::Bool()),
                         [](const testing::TestParamInfo<std::tuple<DType, bool, bool>>& info) {
                           return name_of(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_causal" : "") +
                                  (std::get<2>(info.param) ? "_softcap_sinks" : "");
                         });

// Head dims that are not a multiple of the vector (Dk 67, Dv 33: every kernel's feature tails),
// float32 and bfloat16, causal, on this CPU's best path and capped at AVX2.
TEST(BatchInvarianceOddHeadDims, RowsAreBitwiseEqualHoweverBatched) {
  g_dk = 67, g_dv = 33;
  for (bool avx2 : {false, true}) {
    if (avx2 && !sdpa_test::avx2_pass_skip_reason().empty()) continue;
    std::optional<sdpa_test::Avx2Only> cap;
    if (avx2) cap.emplace();
    for (DType dtype : {DType::kFloat32, DType::kBFloat16})
      for (int64_t L : {127, 4097}) {
        std::string first;
        EXPECT_EQ(differing_rows({dtype, true, false}, L, /*invariant=*/true, &first), 0)
            << name_of(dtype) << (avx2 ? " (AVX2)" : "") << " L=" << L << ": first differing: " << first;
      }
  }
  g_dk = 64, g_dv = 32;
}

// 8-bit caches (int8, one scale per token and kv head; g_kv8): every way of batching reads the
// 8-bit rows in place (dense with seqlens_k, chunked prefill, varlen, paged, a KVCache that
// quantises them itself), with float32 and bfloat16 q, causal, with and without softcap and
// sinks. (KVQuant.EqualsFloat32CallBatchInvariant shows the same bits as the float32 call.)
TEST(BatchInvarianceKv8, RowsAreBitwiseEqualHoweverBatched) {
  g_kv8 = true;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16})
    for (bool modifiers : {false, true})
      for (int64_t L : {127, 4097}) {
        std::string first;
        EXPECT_EQ(differing_rows({dtype, true, modifiers}, L, /*invariant=*/true, &first), 0)
            << "int8 cache, q " << name_of(dtype) << (modifiers ? " softcap, sinks" : "") << " L=" << L
            << ": first differing: " << first;
      }
  g_kv8 = false;
}

// The option is not vacuous: without it, some way of batching changes a row's bits today (the
// decode kernel's dot products, and key chunks chosen from the number of blocks).
TEST(BatchInvarianceOff, SomeBatchingDiffersWithoutTheOption) {
  std::string first;
  const int64_t differ = differing_rows({DType::kFloat32, true, false}, 9000, /*invariant=*/false, &first);
  EXPECT_GT(differ, 0);
  std::printf("without batch_invariant: %lld rows differ, first: %s\n", static_cast<long long>(differ), first.c_str());
}

// The statistics (Outputs::stats) and lse merge with the chunks too, bit for bit: rows of a call
// with many blocks (its units merge a block's chunks themselves: Plan::local_chunks) equal the
// same rows computed in a call of one block (its chunks are units, merged after them).
// 0: every row sees all keys. Else the rows lie at positions q_start + i with a window of the
// 100 keys before them: at 4090 the compared rows see chunk 0 or chunks 0 and 1, at 5000 chunk
// 1 alone; the many-block call runs and merges only those chunks (one alone is not merged), the
// one-block call merges all three.
class BatchInvarianceStats : public testing::TestWithParam<int64_t> {};

TEST_P(BatchInvarianceStats, StatisticsAndLseAreBitwiseEqualToo) {
  const int64_t q_start = GetParam();
  constexpr int64_t D = 32, Nk = 9000, big_H = 8, big_Nq = 256, small_Nq = 16;  // 128 blocks vs 1; 3 chunks
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> q(big_H * big_Nq * D), k(big_H * Nk * D), v(big_H * Nk * D);
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) e = normal(rng);
  struct Result {
    std::vector<float> out, lse, max_weight, entropy;
    std::vector<int64_t> allowed, argmax;
  };
  // Head 0's first small_Nq rows of the call on heads [0, H) and rows [0, Nq).
  const auto run = [&](int64_t H, int64_t Nq) {
    Result r{std::vector<float>(H * Nq * D), std::vector<float>(H * Nq), std::vector<float>(H * Nq),
             std::vector<float>(H * Nq), std::vector<int64_t>(H * Nq), std::vector<int64_t>(H * Nq)};
    sdpa::Outputs outs{TensorView::contiguous(r.out.data(), DType::kFloat32, {1, H, Nq, D})};
    outs.lse = TensorView::contiguous(r.lse.data(), DType::kFloat32, {1, H, Nq});
    outs.stats.max_weight = TensorView::contiguous(r.max_weight.data(), DType::kFloat32, {1, H, Nq});
    outs.stats.entropy = TensorView::contiguous(r.entropy.data(), DType::kFloat32, {1, H, Nq});
    outs.stats.allowed = TensorView::contiguous(r.allowed.data(), DType::kInt64, {1, H, Nq});
    outs.stats.argmax = TensorView::contiguous(r.argmax.data(), DType::kInt64, {1, H, Nq});
    TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {1, H, Nq, D});
    qv.strides[1] = big_Nq * D;  // q's first Nq rows of each head
    sdpa::Options opt;
    opt.batch_invariant = true;
    if (q_start > 0) {
      opt.window = {100, 0};
      opt.q_start = q_start;
      opt.k_start = 0;
    }
    sdpa::attention({qv, TensorView::contiguous(k.data(), DType::kFloat32, {1, H, Nk, D}),
                     TensorView::contiguous(v.data(), DType::kFloat32, {1, H, Nk, D})},
                    outs, opt);
    r.out.resize(small_Nq * D);
    for (auto* x : {&r.lse, &r.max_weight, &r.entropy}) x->resize(small_Nq);
    for (auto* x : {&r.allowed, &r.argmax}) x->resize(small_Nq);
    return r;
  };
  const Result big = run(big_H, big_Nq), small = run(1, small_Nq);
  const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(big.out, small.out));
  EXPECT_TRUE(same_bits(big.lse, small.lse));
  EXPECT_TRUE(same_bits(big.max_weight, small.max_weight));
  EXPECT_TRUE(same_bits(big.entropy, small.entropy));
  EXPECT_EQ(big.allowed, small.allowed);
  EXPECT_EQ(big.argmax, small.argmax);
}

INSTANTIATE_TEST_SUITE_P(All, BatchInvarianceStats, testing::Values(int64_t{0}, int64_t{4090}, int64_t{5000}),
                         [](const testing::TestParamInfo<int64_t>& info) {
                           return info.param == 0 ? std::string("AllKeys") : "WindowAt" + std::to_string(info.param);
                         });

}  // namespace
