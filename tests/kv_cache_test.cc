// KVCache: generation token by token for interleaved sequences against full recomputation
// (attention() on each sequence's keys and values so far), chunked prefill into the cache, pages
// taken and given back, and the errors (full pool, unknown sequence, mismatched shapes).
#include "sdpa/kv_cache.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sdpa/attention.h"
#include "test_util.h"

namespace {

using namespace sdpa_test;

constexpr int64_t kHq = 4, kHkv = 2, kDk = 24, kDv = 16;

// One sequence's tokens so far, as the dense (1, Hkv, L, D) tensors attention() takes.
struct History {
  std::vector<double> k, v;  // token-major: (L, Hkv, D)
  int64_t length = 0;
};

GuardedTensor head_major(const std::vector<double>& rows, int64_t L, int64_t D, DType dtype) {
  GuardedTensor t(dtype, {1, kHkv, L, D});
  for (int64_t j = 0; j < L; ++j)
    for (int64_t h = 0; h < kHkv; ++h)
      for (int64_t e = 0; e < D; ++e) t.set((h * L + j) * D + e, rows[(j * kHkv + h) * D + e]);
  return t;
}

// Appends n random tokens to sequence s of the cache and to its history; then attends n new
// queries against the cache (causal bottom-right: each sees the cache up to itself) and checks
// the result against attention() on the whole history.
void step(sdpa::KVCache& cache, int64_t s, History& hist, int64_t n, DType dtype, std::mt19937& rng) {
  GuardedTensor k(dtype, {n, kHkv, kDk}), v(dtype, {n, kHkv, kDv});
  fill_normal(k, rng);
  fill_normal(v, rng);
  cache.append(s, k.view(), v.view());
  for (double x : k.values()) hist.k.push_back(x);
  for (double x : v.values()) hist.v.push_back(x);
  hist.length += n;
  ASSERT_EQ(cache.length(s), hist.length);

  Tensors t{GuardedTensor(dtype, {1, kHq, n, kDk}), head_major(hist.k, hist.length, kDk, dtype),
            head_major(hist.v, hist.length, kDv, dtype), std::nullopt};
  fill_normal(t.q, rng);
  sdpa::Options o;
  o.causal = sdpa::Causal::kBottomRight;
  Outs got{GuardedTensor(dtype, {1, kHq, n, kDv}), std::nullopt, std::nullopt};
  got.lse.emplace(compute_dtype(dtype), std::vector<int64_t>{1, kHq, n}, Layout::kContiguous, false);
  cache.attention(t.q.view(), {s}, got.outputs(), o);
  EXPECT_TRUE(got.guards_intact());
  EXPECT_TRUE(matches_reference(t, o, got));
  o.backend = sdpa::Backend::kReference;  // the reference reads through the pages: the same bits
  Outs ref{GuardedTensor(dtype, {1, kHq, n, kDv}), std::nullopt, std::nullopt};
  cache.attention(t.q.view(), {s}, ref.outputs(), o);
  EXPECT_TRUE(bitwise_equal(ref, run(t, o, Layout::kContiguous, /*with_extras=*/false)));
}

TEST(KVCache, TokenByTokenMatchesFullRecomputation) {
  for (DType dtype : {kF32, kBF16, kF16, kF64}) {
    SCOPED_TRACE(sdpa::dtype_name(dtype));
    std::mt19937 rng(17);
    sdpa::KVCache cache(/*num_pages=*/40, /*page_size=*/16, kHkv, kDk, kDv, dtype);
    std::vector<int64_t> ids{cache.new_sequence(), cache.new_sequence(), cache.new_sequence()};
    EXPECT_EQ(ids, (std::vector<int64_t>{0, 1, 2}));
    std::vector<History> hist(3);
    // A prompt each (chunked prefill into the cache: 1, 17 and 40 tokens), then tokens one at a
    // time, the three interleaved, crossing page boundaries at different steps.
    const int64_t prompt[3] = {1, 17, 40};
    for (int s = 0; s < 3; ++s) step(cache, ids[s], hist[s], prompt[s], dtype, rng);
    for (int t = 0; t < 20; ++t)
      for (int s = 0; s < 3; ++s) step(cache, ids[s], hist[s], 1, dtype, rng);
    EXPECT_EQ(cache.free_pages(), 40 - (2 + 3 + 4));  // 21, 37 and 60 tokens in pages of 16
  }
}

TEST(KVCache, BatchOfSequencesMatchesEachAlone) {
  std::mt19937 rng(3);
  sdpa::KVCache cache(64, 32, kHkv, kDk, kDv, kF32);
  std::vector<int64_t> ids;
  for (int64_t n : {5, 300, 64, 1}) {
    ids.push_back(cache.new_sequence());
    GuardedTensor k(kF32, {n, kHkv, kDk}), v(kF32, {n, kHkv, kDv});
    fill_normal(k, rng);
    fill_normal(v, rng);
    cache.append(ids.back(), k.view(), v.view());
  }
  const std::vector<int64_t> batch{ids[1], ids[3], ids[0], ids[1]};  // one twice
  GuardedTensor q(kF32, {4, kHq, 1, kDk}), out(kF32, {4, kHq, 1, kDv});
  fill_normal(q, rng);
  sdpa::Outputs o;
  o.out = out.view();
  cache.attention(q.view(), batch, o);
  for (size_t b = 0; b < batch.size(); ++b) {
    sdpa::TensorView qb = q.view();
    qb.shape[0] = 1;
    qb.data = static_cast<char*>(qb.data) + static_cast<int64_t>(b) * qb.strides[0] * 4;
    std::vector<float> alone(kHq * kDv);
    sdpa::Outputs ob;
    ob.out = sdpa::TensorView::contiguous(alone.data(), sdpa::DType::kFloat32, {1, kHq, 1, kDv});
    cache.attention(qb, {batch[b]}, ob);
    for (int64_t x = 0; x < kHq * kDv; ++x) ASSERT_EQ(out.get(static_cast<int64_t>(b) * kHq * kDv + x), alone[x]) << b;
  }
}

TEST(KVCache, FreedPagesAreReused) {
  sdpa::KVCache cache(4, 16, 1, 8, 8, kF32);
  std::vector<float> rows(40 * 8, 1.0f);
  const sdpa::TensorView k = sdpa::TensorView::contiguous(rows.data(), sdpa::DType::kFloat32, {40, 1, 8});
  const int64_t a = cache.new_sequence();
  cache.append(a, k, k);  // 3 pages
  EXPECT_EQ(cache.free_pages(), 1);
  EXPECT_EQ(cache.pages(a), (std::vector<int32_t>{0, 1, 2}));
  cache.free(a);
  EXPECT_EQ(cache.free_pages(), 4);
  EXPECT_TRUE(cache.sequences().empty());
  const int64_t b = cache.new_sequence();
  EXPECT_EQ(b, a);  // the id comes back too
  cache.append(b, k, k);
  EXPECT_EQ(cache.pages(b), (std::vector<int32_t>{0, 1, 2}));
}

void expect_error(const std::function<void()>& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const sdpa::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

TEST(KVCache, ErrorsNameTheProblemAndChangeNothing) {
  sdpa::KVCache cache(2, 16, 2, 8, 4, kF32);
  const int64_t s = cache.new_sequence();
  std::vector<float> buf(64 * 2 * 8, 0.5f);
  const auto rows = [&](int64_t n, int64_t h, int64_t d) {
    return sdpa::TensorView::contiguous(buf.data(), sdpa::DType::kFloat32, {n, h, d});
  };
  expect_error([&] { cache.append(s, rows(33, 2, 8), rows(33, 2, 4)); }, "KVCache is full: sequence 0 needs 3 more pages");
  EXPECT_EQ(cache.length(s), 0);
  EXPECT_EQ(cache.free_pages(), 2);
  expect_error([&] { cache.append(7, rows(1, 2, 8), rows(1, 2, 4)); }, "sequence 7 is not in this KVCache");
  expect_error([&] { cache.append(s, rows(1, 3, 8), rows(1, 2, 4)); }, "k has shape (1, 3, 8) but the cache takes (n, 2, 8)");
  expect_error([&] { cache.append(s, rows(1, 2, 8), rows(1, 2, 5)); }, "v has shape (1, 2, 5) but the cache takes (n, 2, 4)");
  expect_error([&] { cache.append(s, rows(2, 2, 8), rows(1, 2, 4)); }, "v has 1 tokens but k has 2");
  std::vector<double> d(16);
  expect_error([&] { cache.append(s, sdpa::TensorView::contiguous(d.data(), sdpa::DType::kFloat64, {1, 2, 8}), rows(1, 2, 4)); },
               "k has dtype float64 but the cache holds float32");
  expect_error([&] { cache.free(3); }, "sequence 3 is not in this KVCache");
  EXPECT_EQ(cache.length(s), 0);
  expect_error([] { sdpa::KVCache(4, 0, 1, 8, 8); }, "page_size=0");
  expect_error([] { sdpa::KVCache(4, 16, 1, 8, 8, sdpa::DType::kBool); }, "dtype bool");
  std::vector<float> q(2 * 1 * 8), out(2 * 1 * 4);
  sdpa::Outputs o;
  o.out = sdpa::TensorView::contiguous(out.data(), sdpa::DType::kFloat32, {2, 1, 1, 4});
  expect_error([&] { cache.attention(sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {2, 2, 1, 8}), {s}, o); },
               "q has shape (2, 2, 1, 8) but must be (len(seqs), Hq, Nq, Dk) = (1, Hq, Nq, 8)");
}

}  // namespace
