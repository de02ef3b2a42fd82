// KVCache: generation token by token for interleaved sequences against full recomputation
// (attention() on each sequence's keys and values so far), chunked prefill into the cache, pages
// taken and given back, and the errors (full pool, unknown sequence, mismatched shapes). The
// 8-bit cache (int8, uint8): pools holding what quantize_kv gives, its attention against
// attention_paged on the same pools and against the reference on the dequantised values, errors.
#include "sdpa/kv_cache.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
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

// The VmFlags of the mapping of /proc/self/smaps that holds address a ("" where none does, or
// smaps cannot be read).
std::string vm_flags_at(const void* a) {
  std::ifstream smaps("/proc/self/smaps");
  const auto x = reinterpret_cast<uintptr_t>(a);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = lo <= x && x < hi;  // a mapping's first line: "lo-hi perms offset dev inode path"
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8) + " ";
    }
  }
  return "";
}

// A pool of 4 MiB or more asks for transparent huge pages before it is first touched
// (src/huge_pages.h: decode reads every row, and 4 KiB pages cost it 15-25 %), so the mappings
// holding a pool's rows carry the "hg" flag (MADV_HUGEPAGE). Whether the OS then gives huge
// pages depends on its THP mode and free memory, so that is not asserted; the flag is. (That a
// small buffer is not advised is not asserted either: it may land in a heap range a freed
// large one left advised.)
TEST(KVCache, LargePoolsAskForHugePages) {
#if !defined(__linux__)
  GTEST_SKIP() << "huge pages are asked for on Linux only";
#endif
  const int on_the_stack = 0;
  if (vm_flags_at(&on_the_stack).empty()) GTEST_SKIP() << "/proc/self/smaps cannot be read here";
  for (const DType dtype : {kF32, DType::kInt8}) {
    // 512 pages of 16 tokens, 4 kv heads of 128: 16 MiB of float32 K, 4 MiB of int8 K.
    sdpa::KVCache cache(512, 16, 4, 128, 128, dtype);
    for (const sdpa::TensorView& pool : {cache.k_pages(), cache.v_pages()}) {
      const auto* mid = static_cast<const char*>(pool.data) + pool.numel() * dtype_size(dtype) / 2;
      EXPECT_NE(vm_flags_at(mid).find(" hg "), std::string::npos)
          << dtype_name(dtype) << " pool's VmFlags:" << vm_flags_at(mid);
    }
  }
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

// ---- The 8-bit cache ----

// Element (i0, i1, i2[, i3]) of a view (any strides): its byte, or its float32.
double element(const sdpa::TensorView& t, std::initializer_list<int64_t> index) {
  int64_t offset = 0, d = 0;
  for (int64_t i : index) offset += i * t.strides[d++];
  if (t.dtype == sdpa::DType::kInt8) return static_cast<const int8_t*>(t.data)[offset];
  if (t.dtype == sdpa::DType::kUInt8) return static_cast<const uint8_t*>(t.data)[offset];
  return static_cast<const float*>(t.data)[offset];
}

// Token j of sequence s in the cache: its pool values (Hkv, D) and scales, zero points (Hkv, G)
// of k (is_k) or v, in C order.
struct Slot {
  std::vector<double> values, scale, zero;
};
Slot slot(const sdpa::KVCache& cache, int64_t s, int64_t j, bool is_k) {
  const int64_t page = cache.pages(s)[static_cast<size_t>(j / cache.page_size())], r = j % cache.page_size();
  const sdpa::TensorView pool = is_k ? cache.k_pages() : cache.v_pages();
  const sdpa::KVQuant q = *cache.kv_quant();
  const sdpa::TensorView scale = is_k ? q.k_scale : q.v_scale;
  const std::optional<sdpa::TensorView> zero = is_k ? q.k_zero : q.v_zero;
  const int64_t G = cache.quant_groups();
  Slot out;
  for (int64_t h = 0; h < cache.num_kv_heads(); ++h) {
    for (int64_t e = 0; e < pool.shape[3]; ++e) out.values.push_back(element(pool, {page, r, h, e}));
    for (int64_t g = 0; g < G; ++g) {
      // (num_pages, page_size, Hkv) for one group, else (num_pages, page_size, Hkv, G).
      const auto at = [&](const sdpa::TensorView& t) {
        return G == 1 && t.rank == 3 ? element(t, {page, r, h}) : element(t, {page, r, h, g});
      };
      out.scale.push_back(at(scale));
      if (zero) out.zero.push_back(at(*zero));
    }
  }
  return out;
}

// quantize_kv of one token's rows (Hkv, D) as a Slot.
Slot quantized(const GuardedTensor& rows, DType dtype, int64_t G) {
  const int64_t H = rows.shape()[0];
  GuardedTensor values(dtype, rows.shape()), scale(kF32, {H, G});
  std::optional<GuardedTensor> zero;
  if (dtype == DType::kUInt8) zero.emplace(kF32, std::vector<int64_t>{H, G});
  sdpa::quantize_kv(rows.view(), values.view(), scale.view(),
                    zero ? std::optional<sdpa::TensorView>(zero->view()) : std::nullopt);
  return {values.values(), scale.values(), zero ? zero->values() : std::vector<double>{}};
}

// Row i of (n, Hkv, D) token rows as (Hkv, D).
GuardedTensor token(const GuardedTensor& t, int64_t i) {
  const int64_t H = t.shape()[1], D = t.shape()[2];
  GuardedTensor row(t.dtype(), {H, D});
  for (int64_t x = 0; x < H * D; ++x) row.set(x, t.get(i * H * D + x));
  return row;
}

TEST(KVCache8Bit, PoolsHoldWhatQuantizeKvGives) {
  for (DType dtype : {DType::kInt8, DType::kUInt8}) {
    for (DType in : {kF32, kBF16, kF16}) {
      for (int64_t G : {1, 2, 8}) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dtype)) + " from " + sdpa::dtype_name(in) + " G=" + std::to_string(G));
        std::mt19937 rng(5);
        sdpa::KVCache cache(12, 16, kHkv, kDk, kDv, dtype, G);
        ASSERT_TRUE(cache.kv_quant().has_value());
        EXPECT_EQ(cache.kv_quant()->k_zero.has_value(), dtype == DType::kUInt8);
        std::vector<std::vector<GuardedTensor>> ks(2), vs(2);  // each sequence's token rows
        const int64_t a = cache.new_sequence(), b = cache.new_sequence();
        for (auto [s, n] : std::vector<std::pair<int64_t, int64_t>>{{a, 17}, {b, 1}, {a, 1}, {b, 40}, {a, 15}}) {
          GuardedTensor k(in, {n, kHkv, kDk}, Layout::kPadded), v(in, {n, kHkv, kDv}, Layout::kPadded);
          fill_normal(k, rng, 2.0);
          fill_normal(v, rng, 2.0);
          cache.append(s, k.view(), v.view());
          for (int64_t i = 0; i < n; ++i) {
            ks[static_cast<size_t>(s)].push_back(token(k, i));
            vs[static_cast<size_t>(s)].push_back(token(v, i));
          }
        }
        for (int64_t s : {a, b}) {
          ASSERT_EQ(cache.length(s), static_cast<int64_t>(ks[static_cast<size_t>(s)].size()));
          for (int64_t j = 0; j < cache.length(s); ++j) {
            for (bool is_k : {true, false}) {
              const Slot got = slot(cache, s, j, is_k);
              const Slot want = quantized((is_k ? ks : vs)[static_cast<size_t>(s)][static_cast<size_t>(j)], dtype, G);
              ASSERT_EQ(got.values, want.values) << "seq " << s << " token " << j << (is_k ? " k" : " v");
              ASSERT_EQ(got.scale, want.scale) << "seq " << s << " token " << j << (is_k ? " k" : " v");
              ASSERT_EQ(got.zero, want.zero) << "seq " << s << " token " << j << (is_k ? " k" : " v");
            }
          }
        }
      }
    }
  }
}

// The dequantised K or V of sequence s as dense (1, Hkv, L, D) float32: fl32(fl32(x - z) · s).
GuardedTensor dequantised(const sdpa::KVCache& cache, int64_t s, bool is_k) {
  const int64_t L = cache.length(s), H = cache.num_kv_heads(), D = is_k ? cache.head_dim_k() : cache.head_dim_v();
  const int64_t G = cache.quant_groups();
  GuardedTensor t(kF32, {1, H, L, D});
  for (int64_t j = 0; j < L; ++j) {
    const Slot x = slot(cache, s, j, is_k);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) {
        const size_t g = static_cast<size_t>(h * G + e / (D / G));
        const float z = x.zero.empty() ? 0.0f : static_cast<float>(x.zero[g]);
        const float q = static_cast<float>(x.values[static_cast<size_t>(h * D + e)]);
        t.set((h * L + j) * D + e, static_cast<float>((q - z) * static_cast<float>(x.scale[g])));
      }
  }
  return t;
}

// KVCache::attention on an 8-bit cache equals attention_paged on its pools and kv_quant()
// (bitwise), and the reference on float32 K/V holding the dequantised values (tolerance rule).
TEST(KVCache8Bit, AttentionMatchesPagedAndDequantisedReference) {
  for (DType dtype : {DType::kInt8, DType::kUInt8}) {
    for (int64_t G : {1, 4}) {
      for (DType qd : {kF32, kBF16}) {
        SCOPED_TRACE(std::string(sdpa::dtype_name(dtype)) + " G=" + std::to_string(G) + " q " + sdpa::dtype_name(qd));
        std::mt19937 rng(11);
        sdpa::KVCache cache(40, 16, kHkv, kDk, kDv, dtype, G);
        const int64_t s = cache.new_sequence();
        for (int64_t n : {1, 40, 1, 1, 55}) {  // 98 keys over 7 pages
          GuardedTensor k(kF32, {n, kHkv, kDk}), v(kF32, {n, kHkv, kDv});
          fill_normal(k, rng);
          fill_normal(v, rng);
          cache.append(s, k.view(), v.view());
          for (int64_t nq : {int64_t{1}, std::min<int64_t>(n, 5)}) {
            Tensors t{GuardedTensor(qd, {1, kHq, nq, kDk}), dequantised(cache, s, true), dequantised(cache, s, false),
                      std::nullopt};
            fill_normal(t.q, rng);
            sdpa::Options o;
            o.causal = sdpa::Causal::kBottomRight;
            Outs got{GuardedTensor(qd, {1, kHq, nq, kDv}), std::nullopt, std::nullopt};
            cache.attention(t.q.view(), {s}, got.outputs(), o);
            EXPECT_TRUE(got.guards_intact());
            // attention_paged on the same pools: the same bits.
            std::vector<int32_t> table(cache.pages(s).begin(), cache.pages(s).end());
            std::vector<int64_t> lengths{cache.length(s)};
            sdpa::PagedInputs in;
            in.q = t.q.view();
            in.k_pages = cache.k_pages();
            in.v_pages = cache.v_pages();
            in.block_table = sdpa::TensorView::contiguous(table.data(), sdpa::DType::kInt32,
                                                          {1, static_cast<int64_t>(table.size())});
            in.seqlens_k = sdpa::TensorView::contiguous(lengths.data(), sdpa::DType::kInt64, {1});
            in.kv_quant = cache.kv_quant();
            Outs paged{GuardedTensor(qd, {1, kHq, nq, kDv}), std::nullopt, std::nullopt};
            sdpa::attention_paged(in, paged.outputs(), o);
            EXPECT_TRUE(bitwise_equal(got, paged));
            // The float64 reference on the dequantised float32 cache (q float32 over them: the
            // 8-bit kernels compute in float32 as a float32 cache's do).
            if (qd == kF32) {
              EXPECT_TRUE(matches_reference(t, o, got));
            }
          }
        }
      }
    }
  }
}

TEST(KVCache8Bit, ErrorsNameTheProblemAndWriteNothing) {
  expect_error([] { sdpa::KVCache(4, 16, 1, 8, 6, sdpa::DType::kInt8, 4); },
               "quant_groups=4 must be at least 1 and divide head_dim_k=8 and head_dim_v=6");
  expect_error([] { sdpa::KVCache(4, 16, 1, 8, 8, sdpa::DType::kUInt8, 0); }, "quant_groups=0 must be at least 1");
  expect_error([] { sdpa::KVCache(4, 16, 1, 8, 8, sdpa::DType::kFloat32, 2); },
               "quant_groups=2 is for an 8-bit cache (int8, uint8); a float32 cache takes 1");
  EXPECT_FALSE(sdpa::KVCache(4, 16, 1, 8, 8).kv_quant().has_value());

  sdpa::KVCache cache(2, 4, 2, 8, 4, sdpa::DType::kUInt8, 2);
  const int64_t s = cache.new_sequence();
  std::vector<float> k(3 * 2 * 8, 0.5f), v(3 * 2 * 4, -0.25f);
  const auto rows = [](std::vector<float>& b, int64_t n, int64_t D) {
    return sdpa::TensorView::contiguous(b.data(), sdpa::DType::kFloat32, {n, 2, D});
  };
  cache.append(s, rows(k, 3, 8), rows(v, 3, 4));
  const Slot before = slot(cache, s, 2, true);
  v[2 * 2 * 4 + 5] = std::numeric_limits<float>::infinity();  // the last token's v, head 1
  k[0] = 7.0f;                                                 // would change token 3's k row
  expect_error([&] { cache.append(s, rows(k, 3, 8), rows(v, 3, 4)); }, "v holds inf in row 5");
  EXPECT_EQ(cache.length(s), 3);
  EXPECT_EQ(cache.free_pages(), 1);
  const Slot after = slot(cache, s, 2, true);
  EXPECT_EQ(before.values, after.values);
  EXPECT_EQ(before.scale, after.scale);
  std::vector<double> d(2 * 8);
  expect_error([&] { cache.append(s, sdpa::TensorView::contiguous(d.data(), sdpa::DType::kFloat64, {1, 2, 8}), rows(v, 1, 4)); },
               "k has dtype float64 but the cache holds uint8, quantised from float32, bfloat16 or float16");
}

}  // namespace
