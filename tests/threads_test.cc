// Bitwise equality of every output across thread counts (1, 2, 3) and across calls, for each
// way the fused kernel cuts work: many-row blocks, few-row (decode) blocks, key chunks merged
// by lse (decode and prefill), blocks grouped over long K/V, GQA, causal, windows, bool,
// additive and key-padding masks, weights and Outputs::stats, dropout; and of the backward's gradients (its
// key-block and query-block passes), with and without dropout; and of attention_varlen, whose
// sequences share one parallel region; and of dbias (a float mask's gradient). Also the program
// the ThreadSanitizer build runs.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "sdpa/attention.h"

namespace {

constexpr uint64_t kSeed = 0x0123456789abcdefull;  // dropout's seed, both halves non-zero

template <typename T>
constexpr sdpa::DType dtype_of() {
  return sizeof(T) == 4 ? sdpa::DType::kFloat32 : sdpa::DType::kFloat64;
}

// The upper halves of float32 values: bfloat16 (truncated; any bits do for these tests).
std::vector<uint16_t> upper_halves(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t n = 0; n < x.size(); ++n) {
    uint32_t u;
    std::memcpy(&u, &x[n], sizeof u);
    h[n] = static_cast<uint16_t>(u >> 16);
  }
  return h;
}

template <typename T>
std::vector<uint8_t> bytes(const std::vector<T>& x) {
  std::vector<uint8_t> b(x.size() * sizeof(T));
  if (!x.empty()) std::memcpy(b.data(), x.data(), b.size());
  return b;
}

// ---- Forward ----

// What `mask` means: a (Nq, Nk) bool mask, a (Nq, Nk) additive one (normal values, a quarter
// -inf), or a key-padding bool mask of shape (Nk,) or (B, 1, 1, Nk).
enum class MaskForm { kBoolQueryKey, kAdditiveQueryKey, kBoolKey, kBoolBatchKey };

struct Shape {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, D;
  sdpa::Causal causal;
  bool mask, weights;
  double dropout_p = 0;
  bool f64 = false;
  sdpa::Window window = {};
  MaskForm mask_form = MaskForm::kBoolQueryKey;
  bool bf16 = false;  // q, k, v and out stored as bfloat16 (the float32 values' upper halves)
};

struct Result {
  std::vector<uint8_t> out, lse, weights, stats;  // the outputs' bytes
};

template <typename T>
Result run_as(const Shape& s, int threads) {
  constexpr sdpa::DType dt = dtype_of<T>();
  std::mt19937 rng(7);
  std::normal_distribution<T> normal;
  std::vector<T> q(s.B * s.Hq * s.Nq * s.D), k(s.B * s.Hkv * s.Nk * s.D), v(k.size());
  for (auto* t : {&q, &k, &v})
    for (T& x : *t) x = normal(rng);
  std::vector<uint8_t> mask(s.Nq * s.Nk);
  for (auto& m : mask) m = rng() % 4 != 0;
  std::vector<T> bias(s.Nq * s.Nk);  // the additive mask
  for (T& b : bias) b = rng() % 4 != 0 ? normal(rng) : -std::numeric_limits<T>::infinity();
  std::vector<uint8_t> keys(s.B * s.Nk);  // the key-padding masks: the last keys of each batch entry
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t j = 0; j < s.Nk; ++j) keys[b * s.Nk + j] = j < s.Nk - 37 * (b + 1) && rng() % 8 != 0;
  std::vector<T> out(s.B * s.Hq * s.Nq * s.D), lse(s.B * s.Hq * s.Nq), weights;
  if (s.weights) weights.resize(s.B * s.Hq * s.Nq * s.Nk);

  sdpa::Inputs in;
  in.q = sdpa::TensorView::contiguous(q.data(), dt, {s.B, s.Hq, s.Nq, s.D});
  in.k = sdpa::TensorView::contiguous(k.data(), dt, {s.B, s.Hkv, s.Nk, s.D});
  in.v = sdpa::TensorView::contiguous(v.data(), dt, {s.B, s.Hkv, s.Nk, s.D});
  std::vector<uint16_t> q16, k16, v16, out16(s.bf16 ? out.size() : 0);
  if constexpr (sizeof(T) == 4) {
    if (s.bf16) {
      q16 = upper_halves(q), k16 = upper_halves(k), v16 = upper_halves(v);
      in.q = sdpa::TensorView::contiguous(q16.data(), sdpa::DType::kBFloat16, {s.B, s.Hq, s.Nq, s.D});
      in.k = sdpa::TensorView::contiguous(k16.data(), sdpa::DType::kBFloat16, {s.B, s.Hkv, s.Nk, s.D});
      in.v = sdpa::TensorView::contiguous(v16.data(), sdpa::DType::kBFloat16, {s.B, s.Hkv, s.Nk, s.D});
    }
  }
  if (s.mask) {
    switch (s.mask_form) {
      case MaskForm::kBoolQueryKey:
        in.mask = sdpa::TensorView::contiguous(mask.data(), sdpa::DType::kBool, {s.Nq, s.Nk});
        break;
      case MaskForm::kAdditiveQueryKey: in.mask = sdpa::TensorView::contiguous(bias.data(), dt, {s.Nq, s.Nk}); break;
      case MaskForm::kBoolKey: in.mask = sdpa::TensorView::contiguous(keys.data(), sdpa::DType::kBool, {s.Nk}); break;
      case MaskForm::kBoolBatchKey:
        in.mask = sdpa::TensorView::contiguous(keys.data(), sdpa::DType::kBool, {s.B, 1, 1, s.Nk});
        break;
    }
  }
  sdpa::Outputs outs;
  outs.out = s.bf16 ? sdpa::TensorView::contiguous(out16.data(), sdpa::DType::kBFloat16, {s.B, s.Hq, s.Nq, s.D})
                    : sdpa::TensorView::contiguous(out.data(), dt, {s.B, s.Hq, s.Nq, s.D});
  outs.lse = sdpa::TensorView::contiguous(lse.data(), dt, {s.B, s.Hq, s.Nq});
  if (s.weights) outs.weights = sdpa::TensorView::contiguous(weights.data(), dt, {s.B, s.Hq, s.Nq, s.Nk});
  // With weights, every statistic too (Outputs::stats: the first pass's and the weights pass's).
  constexpr int64_t kTopK = 4, kRuns = 5;
  const int64_t rows = s.B * s.Hq * s.Nq;
  std::vector<T> reals(s.weights ? rows * (3 + kTopK + kRuns) : 0);
  std::vector<int64_t> ints(s.weights ? rows * (2 + kTopK) : 0);
  if (s.weights) {
    sdpa::Stats& st = outs.stats;
    st.entropy = sdpa::TensorView::contiguous(reals.data(), dt, {s.B, s.Hq, s.Nq});
    st.entropy_normalized = sdpa::TensorView::contiguous(reals.data() + rows, dt, {s.B, s.Hq, s.Nq});
    st.max_weight = sdpa::TensorView::contiguous(reals.data() + 2 * rows, dt, {s.B, s.Hq, s.Nq});
    st.topk_weights = sdpa::TensorView::contiguous(reals.data() + 3 * rows, dt, {s.B, s.Hq, s.Nq, kTopK});
    st.pooled_weights = sdpa::TensorView::contiguous(reals.data() + (3 + kTopK) * rows, dt, {s.B, s.Hq, s.Nq, kRuns});
    st.allowed = sdpa::TensorView::contiguous(ints.data(), sdpa::DType::kInt64, {s.B, s.Hq, s.Nq});
    st.argmax = sdpa::TensorView::contiguous(ints.data() + rows, sdpa::DType::kInt64, {s.B, s.Hq, s.Nq});
    st.topk_indices = sdpa::TensorView::contiguous(ints.data() + 2 * rows, sdpa::DType::kInt64, {s.B, s.Hq, s.Nq, kTopK});
  }
  sdpa::Options opt;
  opt.causal = s.causal;
  opt.window = s.window;
  opt.dropout_p = s.dropout_p;
  opt.seed = kSeed;
  sdpa::set_num_threads(threads);
  sdpa::attention(in, outs, opt);
  sdpa::set_num_threads(0);
  std::vector<uint8_t> stats = bytes(reals), int_bytes = bytes(ints);
  stats.insert(stats.end(), int_bytes.begin(), int_bytes.end());
  return {s.bf16 ? bytes(out16) : bytes(out), bytes(lse), bytes(weights), stats};
}

Result run(const Shape& s, int threads) { return s.f64 ? run_as<double>(s, threads) : run_as<float>(s, threads); }

void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }  // names, not bytes, in test logs

class Threads : public testing::TestWithParam<Shape> {};

TEST_P(Threads, OutputsAreBitwiseIdenticalForAnyThreadCount) {
  const Shape& s = GetParam();
  const Result one = run(s, 1);
  for (int threads : {1, 2, 3}) {
    const Result other = run(s, threads);
    EXPECT_TRUE(one.out == other.out) << "out differs with " << threads << " threads";
    EXPECT_TRUE(one.lse == other.lse) << "lse differs with " << threads << " threads";
    EXPECT_TRUE(one.weights == other.weights) << "weights differ with " << threads << " threads";
    EXPECT_TRUE(one.stats == other.stats) << "stats differ with " << threads << " threads";
  }
}

// Sizes are kept small enough for the ThreadSanitizer build, while still crossing tiles
// (128 keys), blocks (16-32 rows) and key chunks (decode with few blocks and Nk >= 2048).
// The dropout cases repeat the cuts with dropout on (its decisions are drawn inside each
// tile, block and chunk), in float32 and float64.
INSTANTIATE_TEST_SUITE_P(
    Cuts, Threads,
    testing::Values(Shape{"prefill", 2, 4, 2, 97, 300, 32, sdpa::Causal::kNone, false, false},
                    Shape{"prefill_causal_mask_weights", 1, 2, 1, 70, 260, 16, sdpa::Causal::kBottomRight, true, true},
                    Shape{"decode_split_keys", 1, 2, 1, 1, 5000, 64, sdpa::Causal::kNone, false, false},
                    Shape{"decode_split_keys_mask_weights", 1, 4, 2, 2, 4500, 24, sdpa::Causal::kTopLeft, true, true},
                    Shape{"many_heads", 3, 6, 3, 9, 120, 8, sdpa::Causal::kNone, true, false},
                    Shape{"prefill_dropout", 2, 4, 2, 97, 300, 32, sdpa::Causal::kNone, false, false, 0.3},
                    Shape{"prefill_causal_mask_weights_dropout_f64", 1, 2, 1, 70, 260, 16, sdpa::Causal::kBottomRight,
                          true, true, 0.5, true},
                    Shape{"decode_split_keys_dropout", 1, 2, 1, 1, 5000, 64, sdpa::Causal::kNone, false, false, 0.2},
                    Shape{"decode_split_keys_mask_weights_dropout_f64", 1, 4, 2, 2, 4500, 24, sdpa::Causal::kTopLeft,
                          true, true, 0.4, true},
                    Shape{"many_heads_dropout", 3, 6, 3, 9, 120, 8, sdpa::Causal::kNone, true, false, 0.7},
                    // K and V of a head over 512 KiB (1100 keys · (64 + 64) · 4 bytes): blocks are
                    // swept in groups of up to 4, fewer when there are few blocks per thread (with
                    // 32-row blocks, the 12 blocks of the second are grouped by 4 for one thread and
                    // by 2 for two or three).
                    Shape{"grouped_blocks", 1, 2, 1, 400, 1100, 64, sdpa::Causal::kNone, false, false},
                    Shape{"grouped_blocks_causal_mask", 1, 1, 1, 384, 1100, 64, sdpa::Causal::kBottomRight, true,
                          false},
                    Shape{"prefill_window", 2, 4, 2, 97, 300, 32, sdpa::Causal::kNone, false, false, 0, false,
                          {64, 16}},
                    Shape{"prefill_window_causal_weights_f64", 1, 2, 1, 70, 260, 16, sdpa::Causal::kBottomRight, false,
                          true, 0, true, {100, -1}},
                    Shape{"prefill_additive_mask_weights", 1, 2, 1, 70, 260, 16, sdpa::Causal::kNone, true, true, 0,
                          false, {}, MaskForm::kAdditiveQueryKey},
                    Shape{"prefill_key_padding", 2, 4, 2, 97, 300, 32, sdpa::Causal::kNone, true, false, 0, false, {},
                          MaskForm::kBoolKey},
                    Shape{"prefill_batch_key_padding_f64", 3, 2, 1, 40, 200, 16, sdpa::Causal::kTopLeft, true, false,
                          0, true, {}, MaskForm::kBoolBatchKey},
                    // Many rows against > 2048 keys in few blocks: keys split into chunks (prefill).
                    Shape{"chunked_prefill", 1, 1, 1, 100, 4100, 32, sdpa::Causal::kBottomRight, false, false},
                    Shape{"chunked_prefill_window_key_padding_weights", 1, 2, 1, 60, 4100, 16, sdpa::Causal::kNone,
                          true, true, 0, false, {600, 0}, MaskForm::kBoolBatchKey},
                    Shape{"chunked_prefill_additive_mask_f64", 1, 1, 1, 100, 3000, 16, sdpa::Causal::kTopLeft, true,
                          false, 0, true, {}, MaskForm::kAdditiveQueryKey},
                    // bfloat16 storage (tiles widened per thread; float32 additive mask beside it).
                    Shape{"prefill_additive_mask_weights_bf16", 1, 2, 1, 70, 260, 16, sdpa::Causal::kNone, true, true,
                          0.3, false, {}, MaskForm::kAdditiveQueryKey, true},
                    Shape{"decode_split_keys_bf16", 1, 4, 2, 2, 4500, 24, sdpa::Causal::kTopLeft, true, true, 0,
                          false, {}, MaskForm::kBoolQueryKey, true},
                    Shape{"grouped_blocks_bf16", 1, 2, 1, 400, 1100, 64, sdpa::Causal::kNone, false, false, 0, false,
                          {}, MaskForm::kBoolQueryKey, true}),
    [](const testing::TestParamInfo<Shape>& info) { return std::string(info.param.name); });

// ---- Backward ----

struct BackwardShape {
  const char* name;
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  sdpa::Causal causal;
  bool mask;
};

void PrintTo(const BackwardShape& s, std::ostream* os) { *os << s.name; }

struct Gradients {
  std::vector<uint8_t> out, lse, dq, dk, dv;  // bytes: the forward's out and lse, then the gradients
};

// The forward (for out and lse, as a caller chains the calls) and the backward, both with
// `threads` threads.
template <typename T>
Gradients run_backward_as(const BackwardShape& s, double dropout_p, int threads) {
  constexpr sdpa::DType dt = dtype_of<T>();
  std::mt19937 rng(11);
  std::normal_distribution<T> normal;
  std::vector<T> q(s.B * s.Hq * s.Nq * s.Dk), k(s.B * s.Hkv * s.Nk * s.Dk), v(s.B * s.Hkv * s.Nk * s.Dv);
  std::vector<T> dout(s.B * s.Hq * s.Nq * s.Dv);
  for (auto* t : {&q, &k, &v, &dout})
    for (T& x : *t) x = normal(rng);
  std::vector<uint8_t> mask(s.Nq * s.Nk);
  for (auto& m : mask) m = rng() % 4 != 0;
  std::vector<T> out(dout.size()), lse(s.B * s.Hq * s.Nq), dq(q.size()), dk(k.size()), dv(v.size());

  sdpa::Inputs in;
  in.q = sdpa::TensorView::contiguous(q.data(), dt, {s.B, s.Hq, s.Nq, s.Dk});
  in.k = sdpa::TensorView::contiguous(k.data(), dt, {s.B, s.Hkv, s.Nk, s.Dk});
  in.v = sdpa::TensorView::contiguous(v.data(), dt, {s.B, s.Hkv, s.Nk, s.Dv});
  if (s.mask) in.mask = sdpa::TensorView::contiguous(mask.data(), sdpa::DType::kBool, {s.Nq, s.Nk});
  sdpa::Outputs outs;
  outs.out = sdpa::TensorView::contiguous(out.data(), dt, {s.B, s.Hq, s.Nq, s.Dv});
  outs.lse = sdpa::TensorView::contiguous(lse.data(), dt, {s.B, s.Hq, s.Nq});
  sdpa::Gradients grads;
  grads.dq = sdpa::TensorView::contiguous(dq.data(), dt, {s.B, s.Hq, s.Nq, s.Dk});
  grads.dk = sdpa::TensorView::contiguous(dk.data(), dt, {s.B, s.Hkv, s.Nk, s.Dk});
  grads.dv = sdpa::TensorView::contiguous(dv.data(), dt, {s.B, s.Hkv, s.Nk, s.Dv});
  sdpa::Options opt;
  opt.causal = s.causal;
  opt.dropout_p = dropout_p;
  opt.seed = kSeed;
  sdpa::set_num_threads(threads);
  sdpa::attention(in, outs, opt);
  sdpa::attention_backward(in, outs.out, *outs.lse,
                           sdpa::TensorView::contiguous(dout.data(), dt, {s.B, s.Hq, s.Nq, s.Dv}), grads, opt);
  sdpa::set_num_threads(0);
  return {bytes(out), bytes(lse), bytes(dq), bytes(dk), bytes(dv)};
}

// (shape, float64, dropout_p)
using BackwardParam = std::tuple<BackwardShape, bool, double>;

class BackwardThreads : public testing::TestWithParam<BackwardParam> {};

TEST_P(BackwardThreads, GradientsAreBitwiseIdenticalForAnyThreadCount) {
  const BackwardShape& s = std::get<0>(GetParam());
  const bool f64 = std::get<1>(GetParam());
  const double p = std::get<2>(GetParam());
  auto run = [&](int threads) {
    return f64 ? run_backward_as<double>(s, p, threads) : run_backward_as<float>(s, p, threads);
  };
  const Gradients one = run(1);
  for (int threads : {1, 2, 3}) {
    const Gradients other = run(threads);
    EXPECT_TRUE(one.out == other.out) << "out differs with " << threads << " threads";
    EXPECT_TRUE(one.lse == other.lse) << "lse differs with " << threads << " threads";
    EXPECT_TRUE(one.dq == other.dq) << "dq differs with " << threads << " threads";
    EXPECT_TRUE(one.dk == other.dk) << "dk differs with " << threads << " threads";
    EXPECT_TRUE(one.dv == other.dv) << "dv differs with " << threads << " threads";
  }
}

// The backward splits its work into key blocks of 2 SIMD vectors of lanes: 16 or 32
// (float32), 8 or 16 (float64). The first three shapes run the one-pass plan (dq summed over
// chunks of key blocks; backward-inl.h's OnePassChunks), the first crossing a 128-row query
// tile in the key-block pass; the last has too few key blocks for it on every target and
// runs the two-pass plan (query blocks for dq).
INSTANTIATE_TEST_SUITE_P(
    Cuts, BackwardThreads,
    testing::Combine(
        testing::Values(BackwardShape{"gqa_causal_top_left_mask", 2, 4, 2, 150, 170, 24, 16, sdpa::Causal::kTopLeft, true},
                        BackwardShape{"mqa_causal_bottom_right", 1, 3, 1, 70, 300, 32, 40, sdpa::Causal::kBottomRight,
                                      false},
                        BackwardShape{"one_row_many_keys_mask", 1, 4, 2, 1, 700, 16, 8, sdpa::Causal::kNone, true},
                        BackwardShape{"two_pass_few_keys_mask", 1, 2, 1, 300, 24, 16, 12, sdpa::Causal::kNone, true}),
        testing::Bool(), testing::Values(0.0, 0.3)),
    [](const testing::TestParamInfo<BackwardParam>& info) {
      return std::string(std::get<0>(info.param).name) + (std::get<1>(info.param) ? "_f64" : "_f32") +
             (std::get<2>(info.param) > 0 ? "_dropout" : "");
    });

// ---- dbias: the float mask's gradient, a pass of its own (units of mask rows) ----

// A (Nq, Nk) additive mask broadcast over batch and heads (each element sums B · Hq rows) and a
// full (B, Hq, Nq, Nk) one, with GQA and dropout: dbias's bytes for 1, 2 and 3 threads.
TEST(BiasGradThreads, DbiasIsBitwiseIdenticalForAnyThreadCount) {
  const int64_t B = 2, Hq = 4, Hkv = 2, Nq = 150, Nk = 90, D = 16;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> q(B * Hq * Nq * D), k(B * Hkv * Nk * D), v(k.size()), dout(q.size()), out(q.size());
  for (auto* t : {&q, &k, &v, &dout})
    for (float& x : *t) x = normal(rng);
  for (bool full : {false, true}) {
    const auto shaped = [&](void* data) {
      return full ? sdpa::TensorView::contiguous(data, sdpa::DType::kFloat32, {B, Hq, Nq, Nk})
                  : sdpa::TensorView::contiguous(data, sdpa::DType::kFloat32, {Nq, Nk});
    };
    std::vector<float> bias(full ? B * Hq * Nq * Nk : Nq * Nk), lse(B * Hq * Nq);
    for (float& b : bias) b = rng() % 5 != 0 ? normal(rng) : -std::numeric_limits<float>::infinity();
    sdpa::Inputs in;
    in.q = sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {B, Hq, Nq, D});
    in.k = sdpa::TensorView::contiguous(k.data(), sdpa::DType::kFloat32, {B, Hkv, Nk, D});
    in.v = sdpa::TensorView::contiguous(v.data(), sdpa::DType::kFloat32, {B, Hkv, Nk, D});
    in.mask = shaped(bias.data());
    sdpa::Options opt;
    opt.dropout_p = 0.2;
    opt.seed = kSeed;
    sdpa::Outputs outs;
    outs.out = sdpa::TensorView::contiguous(out.data(), sdpa::DType::kFloat32, {B, Hq, Nq, D});
    outs.lse = sdpa::TensorView::contiguous(lse.data(), sdpa::DType::kFloat32, {B, Hq, Nq});
    sdpa::attention(in, outs, opt);
    std::vector<uint8_t> first;
    for (int threads : {1, 2, 3}) {
      std::vector<float> dq(q.size()), dk(k.size()), dv(v.size()), dbias(bias.size());
      sdpa::Gradients grads;
      grads.dq = sdpa::TensorView::contiguous(dq.data(), sdpa::DType::kFloat32, {B, Hq, Nq, D});
      grads.dk = sdpa::TensorView::contiguous(dk.data(), sdpa::DType::kFloat32, {B, Hkv, Nk, D});
      grads.dv = sdpa::TensorView::contiguous(dv.data(), sdpa::DType::kFloat32, {B, Hkv, Nk, D});
      grads.dbias = shaped(dbias.data());
      sdpa::set_num_threads(threads);
      sdpa::attention_backward(in, outs.out, *outs.lse,
                               sdpa::TensorView::contiguous(dout.data(), sdpa::DType::kFloat32, {B, Hq, Nq, D}), grads,
                               opt);
      sdpa::set_num_threads(0);
      if (first.empty()) first = bytes(dbias);
      EXPECT_TRUE(first == bytes(dbias)) << (full ? "full" : "(Nq, Nk)") << " dbias differs with " << threads
                                         << " threads";
    }
  }
}

// ---- Varlen: the sequences' units in one parallel region ----

// A packed batch of sequences of very different lengths: decode rows against long keys (split
// into chunks, merged), prefill blocks, an empty sequence; dropout on or off; forward and
// backward (whose short sequences run side by side, a thread each).
TEST(VarlenThreads, OutputsAreBitwiseIdenticalForAnyThreadCount) {
  const std::vector<int64_t> cu_q = {0, 1, 98, 98, 100, 160}, cu_k = {0, 4500, 4800, 4810, 9000, 9060};
  const int64_t Hq = 4, Hkv = 2, D = 16, tq = cu_q.back(), tk = cu_k.back();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> q(tq * Hq * D), k(tk * Hkv * D), v(tk * Hkv * D);
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) e = normal(rng);
  for (double dropout : {0.0, 0.25}) {
    const auto run = [&](int threads) {
      sdpa::set_num_threads(threads);
      std::vector<float> out(tq * Hq * D), lse(Hq * tq);
      sdpa::VarlenInputs in{sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {tq, Hq, D}),
                            sdpa::TensorView::contiguous(k.data(), sdpa::DType::kFloat32, {tk, Hkv, D}),
                            sdpa::TensorView::contiguous(v.data(), sdpa::DType::kFloat32, {tk, Hkv, D}),
                            sdpa::TensorView::contiguous(const_cast<int64_t*>(cu_q.data()), sdpa::DType::kInt64,
                                                         {static_cast<int64_t>(cu_q.size())}),
                            sdpa::TensorView::contiguous(const_cast<int64_t*>(cu_k.data()), sdpa::DType::kInt64,
                                                         {static_cast<int64_t>(cu_k.size())})};
      sdpa::Options o;
      o.causal = sdpa::Causal::kBottomRight;
      o.dropout_p = dropout;
      o.seed = kSeed;
      const sdpa::TensorView out_v = sdpa::TensorView::contiguous(out.data(), sdpa::DType::kFloat32, {tq, Hq, D});
      const sdpa::TensorView lse_v = sdpa::TensorView::contiguous(lse.data(), sdpa::DType::kFloat32, {Hq, tq});
      sdpa::attention_varlen(in, {out_v, lse_v}, o);
      // The backward: the short sequences side by side, the long one on all threads.
      std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
      sdpa::attention_varlen_backward(in, out_v, lse_v, out_v,
                                      {sdpa::TensorView::contiguous(dq.data(), sdpa::DType::kFloat32, {tq, Hq, D}),
                                       sdpa::TensorView::contiguous(dk.data(), sdpa::DType::kFloat32, {tk, Hkv, D}),
                                       sdpa::TensorView::contiguous(dv.data(), sdpa::DType::kFloat32, {tk, Hkv, D})},
                                      o);
      sdpa::set_num_threads(0);
      return std::vector<std::vector<uint8_t>>{bytes(out), bytes(lse), bytes(dq), bytes(dk), bytes(dv)};
    };
    const auto one = run(1);
    for (int threads : {2, 3}) {
      const auto other = run(threads);
      const char* names[] = {"out", "lse", "dq", "dk", "dv"};
      for (size_t x = 0; x < one.size(); ++x)
        EXPECT_TRUE(one[x] == other[x]) << names[x] << " differs with " << threads << " threads, dropout " << dropout;
    }
  }
}

}  // namespace
