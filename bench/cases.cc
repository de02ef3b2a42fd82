#include "cases.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include "huge_pages.h"  // src/
#include "storage.h"  // src/: the dtype table, and rounding as the library rounds its outputs

namespace sdpa::bench {

bool has_window(const BenchCase& c) { return c.window.left >= 0 || c.window.right >= 0; }

const char* dtype_tag(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "f16";
    case DType::kFloat32: return "f32";
    case DType::kFloat64: return "f64";
    case DType::kInt8: return "i8";
    case DType::kUInt8: return "u8";
    case DType::kBool:
    case DType::kInt32:
    case DType::kInt64: break;
  }
  return "?";
}

std::optional<DType> dtype_of_tag(const std::string& tag) {
  for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
    if (tag == dtype_tag(d)) return d;
  }
  return std::nullopt;
}

namespace {

using internal::compute_dtype;

// Stores `value` as element i of a buffer of `dtype`, rounded to nearest even.
void store(DType dtype, std::vector<char>& buf, size_t i, double value) {
  internal::store_as(dtype, buf.data() + i * static_cast<size_t>(internal::storage_bytes(dtype)), value);
}

// The (i, j) pairs that causal and the window allow: the header's rules, summed row by row.
double allowed_pairs(const BenchCase& c) {
  double pairs = 0;
  for (int64_t i = 0; i < c.Nq; ++i) {
    const int64_t aligned = i + c.Nk - c.Nq;  // i aligned bottom-right
    int64_t begin = 0, end = c.Nk;
    if (c.causal == Causal::kBottomRight) end = std::min(end, aligned + 1);
    if (c.causal == Causal::kTopLeft) end = std::min(end, i + 1);
    if (c.window.right >= 0) end = std::min(end, aligned + c.window.right + 1);
    if (c.window.left >= 0) begin = std::max(begin, aligned - c.window.left);
    pairs += static_cast<double>(std::max<int64_t>(0, end - begin));
  }
  return pairs;
}

}  // namespace

int64_t keys_of(const BenchCase& c, int64_t b) {
  if (c.page_size == 0 || c.B < 2) return c.Nk;
  return std::llround(static_cast<double>(c.Nk) / 64 * std::pow(64.0, static_cast<double>(b) / (c.B - 1)));
}

namespace {
double total_keys(const BenchCase& c) {
  double n = 0;
  for (int64_t b = 0; b < c.B; ++b) n += static_cast<double>(keys_of(c, b));
  return n;
}
}  // namespace

double flop_count(const BenchCase& c) {
  if (c.page_size > 0) return 4.0 * c.Hq * c.Nq * c.D * total_keys(c);  // decode rows see every key
  const double per_pair = (c.backward ? 10.0 : 4.0) * c.B * c.Hq * c.D;
  if (has_window(c)) return per_pair * allowed_pairs(c);
  const double f = per_pair * c.Nq * c.Nk;
  return c.causal == Causal::kNone ? f : f / 2;
}

bool is_8bit(DType t) { return t == DType::kInt8 || t == DType::kUInt8; }

double kv_bytes(const BenchCase& c) {
  const double keys = c.page_size > 0 ? total_keys(c) : static_cast<double>(c.B) * c.Nk;
  if (is_8bit(c.kv)) return 2.0 * c.Hkv * keys * (c.D + (c.kv == DType::kUInt8 ? 8 : 4));
  return 2.0 * c.Hkv * keys * c.D * dtype_size(c.dtype);
}

bool is_decode(const BenchCase& c) { return c.Nq * (c.Hq / std::max<int64_t>(c.Hkv, 1)) <= 16; }

namespace {

std::vector<BenchCase> float32_cases() {
  const auto backward = [](BenchCase c) {
    c.backward = true;
    return c;
  };
  const auto paged = [](BenchCase c, int64_t page_size, bool token_major = false) {
    c.page_size = page_size;
    c.token_major_pages = token_major;
    return c;
  };
  const auto windowed = [](BenchCase c) {
    c.window = {255, 0};  // with causal: the row's own key and the 255 before it
    return c;
  };
  const auto prefill = [](std::string name, int64_t N, int64_t D, Causal causal = Causal::kNone,
                          MaskKind mask = MaskKind::kNone, int64_t Hkv = 8) {
    return BenchCase{std::move(name), 1, 8, Hkv, N, N, D, mask, causal, DType::kFloat32};
  };
  return {
      prefill("prefill d64", 2048, 64),
      prefill("prefill d128", 2048, 128),
      prefill("prefill d64 causal", 2048, 64, Causal::kBottomRight),
      prefill("prefill d128 causal", 2048, 128, Causal::kBottomRight),
      prefill("prefill d64 bool mask", 2048, 64, Causal::kNone, MaskKind::kBool),
      prefill("prefill d64 additive mask", 2048, 64, Causal::kNone, MaskKind::kAdditive),
      prefill("prefill d64 key padding", 2048, 64, Causal::kNone, MaskKind::kKeyPadding),
      prefill("prefill d64 gqa 8:2", 2048, 64, Causal::kNone, MaskKind::kNone, 2),
      BenchCase{"decode gqa 32:8 d128", 1, 32, 8, 1, 32768, 128},
      BenchCase{"decode gqa 64:8 d128", 1, 64, 8, 1, 32768, 128},
      // 2 GiB of K/V: more than any L3, so K and V really come from memory.
      BenchCase{"decode gqa 32:8 d128 256k", 1, 32, 8, 1, 262144, 128},
      BenchCase{"decode mha 8 d64 (4 tokens)", 1, 8, 8, 4, 16384, 64},
      // A decode step of a very small model: the time is the call's overhead, not arithmetic
      // (8192 flops); the yardstick for the entry's per-call cost.
      BenchCase{"tiny call (1,4,1,32) x 16 keys", 1, 4, 4, 1, 16, 32},
      backward(prefill("backward d64", 2048, 64)),
      backward(prefill("backward d64 causal", 2048, 64, Causal::kBottomRight)),
      backward(prefill("backward d128", 2048, 128)),
      // A sliding window over a long sequence: time follows the 256 keys a row sees, not N.
      windowed(prefill("prefill d64 window 256", 8192, 64, Causal::kBottomRight)),
      backward(windowed(prefill("backward d64 window 256", 8192, 64, Causal::kBottomRight))),
      // Continuous batching against a paged cache: 32 sequences of 512 ... 32768 keys.
      paged(BenchCase{"paged decode 32 seqs page 16", 32, 32, 8, 1, 32768, 128}, 16),
      paged(BenchCase{"paged decode 32 seqs page 128", 32, 32, 8, 1, 32768, 128}, 128),
      paged(BenchCase{"paged decode 32 seqs page 16 token-major", 32, 32, 8, 1, 32768, 128}, 16, true),
  };
}

// The 8-bit KV cache's decode cases (issue 30): float32 q (or 16-bit: cases_in) against int8 / uint8 K/V.
std::vector<BenchCase> kv8_cases() {
  std::vector<BenchCase> cases;
  for (DType kv : {DType::kInt8, DType::kUInt8}) {
    const std::string tag = std::string(" ") + dtype_tag(kv);
    BenchCase dense{"decode gqa 32:8 d128" + tag, 1, 32, 8, 1, 32768, 128};
    BenchCase page16{"paged decode 32 seqs page 16" + tag, 32, 32, 8, 1, 32768, 128};
    BenchCase page128{"paged decode 32 seqs page 128" + tag, 32, 32, 8, 1, 32768, 128};
    page16.page_size = 16;
    page128.page_size = 128;
    for (BenchCase* c : {&dense, &page16, &page128}) {
      c->kv = kv;
      cases.push_back(*c);
    }
  }
  return cases;
}

BenchCase in_dtype(BenchCase c, DType dtype) {
  c.dtype = dtype;
  if (dtype != DType::kFloat32) c.name += std::string(" ") + dtype_tag(dtype);
  return c;
}

}  // namespace

std::vector<BenchCase> cases_in(DType dtype) {
  std::vector<BenchCase> cases;
  for (const BenchCase& c : float32_cases()) cases.push_back(in_dtype(c, dtype));
  if (dtype == DType::kBFloat16 || dtype == DType::kFloat16) {  // 16-bit q against an 8-bit cache
    for (const BenchCase& c : kv8_cases()) cases.push_back(in_dtype(c, dtype));
  }
  return cases;
}

std::vector<BenchCase> default_cases() {
  std::vector<BenchCase> cases = float32_cases();
  const std::vector<BenchCase> all = cases;
  for (const char* name : {"prefill d64", "prefill d128", "prefill d64 causal", "prefill d128 causal",
                           "decode gqa 32:8 d128", "backward d64", "paged decode 32 seqs page 16"}) {
    const auto c = std::find_if(all.begin(), all.end(), [&](const BenchCase& x) { return x.name == name; });
    if (c != all.end()) cases.push_back(in_dtype(*c, DType::kBFloat16));
  }
  for (const BenchCase& c : kv8_cases()) cases.push_back(c);
  return cases;
}

CaseData::CaseData(const BenchCase& c) : c_(c) {
  const int64_t es = dtype_size(c.dtype);
  const DType compute = compute_dtype(c.dtype);
  q_.resize(c.B * c.Hq * c.Nq * c.D * es);
  int64_t k_bytes = c.B * c.Hkv * c.Nk * c.D * es;
  if (c.page_size > 0) {  // a pool of just the pages the sequences use, handed out shuffled
    const int64_t max_pages = (c.Nk + c.page_size - 1) / c.page_size;
    int64_t pages = 0;
    for (int64_t b = 0; b < c.B; ++b) {
      lengths_.push_back(keys_of(c, b));
      pages += (lengths_.back() + c.page_size - 1) / c.page_size;
    }
    std::vector<int32_t> order(static_cast<size_t>(pages));
    for (int64_t p = 0; p < pages; ++p) order[p] = static_cast<int32_t>(p);
    std::shuffle(order.begin(), order.end(), std::minstd_rand(7));
    table_.assign(static_cast<size_t>(c.B * max_pages), -1);
    for (int64_t b = 0, next = 0; b < c.B; ++b)
      for (int64_t p = 0; p * c.page_size < lengths_[b]; ++p) table_[b * max_pages + p] = order[next++];
    k_bytes = pages * c.page_size * c.Hkv * c.D * es;
  }
  // K and V on huge pages where the OS gives them, as a KVCache's pools and NumPy's arrays are
  // (src/huge_pages.h): with 4 KiB pages decode pays a page walk per page of rows.
  internal::resize_with_huge_pages(k_, static_cast<size_t>(k_bytes));
  internal::resize_with_huge_pages(v_, k_.size());
  out_.resize(q_.size());
  std::minstd_rand rng(42);  // fast: gigabytes of inputs for the decode cases
  std::uniform_real_distribution<double> normal(-1.7, 1.7);  // unit variance, like randn
  for (auto* buf : {&q_, &k_, &v_}) {
    const size_t n = buf->size() / es;
    for (size_t i = 0; i < n; ++i) store(c.dtype, *buf, i, normal(rng));
  }
  if (is_8bit(c.kv)) {  // random 8-bit values (any byte is one), a scale (and zero point) per row
    const size_t rows = k_.size() / es / c.D;
    k_.resize(rows * c.D);
    v_.resize(rows * c.D);
    for (auto* buf : {&k_, &v_})
      for (char& x : *buf) x = static_cast<char>(rng());
    for (int s = 0; s < (c.kv == DType::kUInt8 ? 4 : 2); ++s) {
      internal::resize_with_huge_pages(scales_[s], rows);
      for (float& x : scales_[s]) x = s < 2 ? 0.01f : static_cast<float>(rng() % 256);
    }
  }
  if (c.backward) {  // the forward's out and lse, and a random incoming gradient
    lse_.resize(c.B * c.Hq * c.Nq * dtype_size(compute));
    dout_.resize(out_.size());
    dq_.resize(q_.size());
    dk_.resize(k_.size());
    dv_.resize(v_.size());
    for (size_t i = 0; i < dout_.size() / es; ++i) store(c.dtype, dout_, i, normal(rng));
  }
  if (c.mask == MaskKind::kBool) {
    mask_.resize(c.Nq * c.Nk);
    for (auto& m : mask_) m = (rng() % 8) != 0;  // 1 in 8 keys blocked
  } else if (c.mask == MaskKind::kKeyPadding) {
    mask_.resize(c.B * c.Nk);
    for (int64_t i = 0; i < c.B * c.Nk; ++i) mask_[i] = i % c.Nk < c.Nk - c.Nk / 8;
  } else if (c.mask == MaskKind::kAdditive) {
    mask_.resize(c.Nq * c.Nk * es);
    const size_t n = c.Nq * c.Nk;
    for (size_t i = 0; i < n; ++i) {
      const double bias = rng() % 8 ? 0.1 * normal(rng) : -std::numeric_limits<double>::infinity();
      store(c.dtype, mask_, i, bias);
    }
  }
  if (c.backward) {  // out and lse of these inputs, which the backward pass takes as given
    Options opt;
    opt.causal = c.causal;
    opt.window = c.window;
    Outputs outs;
    outs.out = TensorView::contiguous(out_.data(), c.dtype, {c.B, c.Hq, c.Nq, c.D});
    outs.lse = TensorView::contiguous(lse_.data(), compute, {c.B, c.Hq, c.Nq});
    attention(inputs(), outs, opt);
  }
}

Inputs CaseData::inputs() const {
  auto* self = const_cast<CaseData*>(this);  // views are non-const; the inputs are only read
  Inputs in;
  in.q = TensorView::contiguous(self->q_.data(), c_.dtype, {c_.B, c_.Hq, c_.Nq, c_.D});
  in.k = TensorView::contiguous(self->k_.data(), c_.dtype, {c_.B, c_.Hkv, c_.Nk, c_.D});
  in.v = TensorView::contiguous(self->v_.data(), c_.dtype, {c_.B, c_.Hkv, c_.Nk, c_.D});
  if (c_.mask == MaskKind::kKeyPadding) {
    in.mask = TensorView::contiguous(self->mask_.data(), DType::kBool, {c_.B, 1, 1, c_.Nk});
  } else if (c_.mask != MaskKind::kNone) {
    in.mask = TensorView::contiguous(self->mask_.data(), c_.mask == MaskKind::kBool ? DType::kBool : c_.dtype,
                                     {c_.Nq, c_.Nk});
  }
  return in;
}

void CaseData::run(Backend backend) {
  Options opt;
  opt.causal = c_.causal;
  opt.window = c_.window;
  opt.backend = backend;
  opt.precision = c_.precision;
  opt.batch_invariant = c_.batch_invariant;
  Outputs outs;
  outs.out = TensorView::contiguous(out_.data(), c_.dtype, {c_.B, c_.Hq, c_.Nq, c_.D});
  const bool kv8 = is_8bit(c_.kv);
  const DType kv = kv8 ? c_.kv : c_.dtype;
  // An 8-bit cache's scale views, shaped like k (or the pool) without its last dim, with the
  // same strides divided by D (one float per row where k has D values).
  const auto quant = [&](const TensorView& k) {
    KVQuant q;
    TensorView* views[4] = {&q.k_scale, &q.v_scale, nullptr, nullptr};
    if (c_.kv == DType::kUInt8) {
      q.k_zero = TensorView{};
      q.v_zero = TensorView{};
      views[2] = &*q.k_zero;
      views[3] = &*q.v_zero;
    }
    for (int s = 0; s < 4 && views[s] != nullptr; ++s) {
      TensorView& t = *views[s];
      t = k;
      t.rank = 3;
      t.dtype = DType::kFloat32;
      t.data = scales_[s].data();
      for (int d = 0; d < 3; ++d) t.strides[d] = k.strides[d] / c_.D;
    }
    return q;
  };
  if (c_.page_size > 0) {
    const int64_t pages = static_cast<int64_t>(k_.size()) / (c_.page_size * c_.Hkv * c_.D * dtype_size(kv));
    PagedInputs in;
    in.q = TensorView::contiguous(q_.data(), c_.dtype, {c_.B, c_.Hq, c_.Nq, c_.D});
    in.k_pages = TensorView::contiguous(k_.data(), kv, {pages, c_.page_size, c_.Hkv, c_.D});
    in.v_pages = TensorView::contiguous(v_.data(), kv, {pages, c_.page_size, c_.Hkv, c_.D});
    if (!c_.token_major_pages) {  // memory (pages, Hkv, page_size, D): a head's rows of a page contiguous
      for (TensorView* t : {&in.k_pages, &in.v_pages}) {
        t->strides[1] = c_.D;
        t->strides[2] = c_.page_size * c_.D;
      }
    }
    if (kv8) in.kv_quant = quant(in.k_pages);
    in.block_table = TensorView::contiguous(table_.data(), DType::kInt32,
                                            {c_.B, static_cast<int64_t>(table_.size()) / c_.B});
    in.seqlens_k = TensorView::contiguous(lengths_.data(), DType::kInt64, {c_.B});
    attention_paged(in, outs, opt);
    return;
  }
  if (!c_.backward) {
    Inputs in = inputs();
    if (kv8) {
      in.k.dtype = in.v.dtype = kv;
      in.kv_quant = quant(in.k);
    }
    attention(in, outs, opt);
    return;
  }
  const TensorView lse = TensorView::contiguous(lse_.data(), compute_dtype(c_.dtype), {c_.B, c_.Hq, c_.Nq});
  Gradients g;
  g.dq = TensorView::contiguous(dq_.data(), c_.dtype, {c_.B, c_.Hq, c_.Nq, c_.D});
  g.dk = TensorView::contiguous(dk_.data(), c_.dtype, {c_.B, c_.Hkv, c_.Nk, c_.D});
  g.dv = TensorView::contiguous(dv_.data(), c_.dtype, {c_.B, c_.Hkv, c_.Nk, c_.D});
  attention_backward(inputs(), outs.out, lse, TensorView::contiguous(dout_.data(), c_.dtype, {c_.B, c_.Hq, c_.Nq, c_.D}),
                     g, opt);
}

double median_seconds(CaseData& data, int reps, Backend backend) {
  const auto seconds = [&](int calls) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) data.run(backend);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
  };
  // The warm-up (page faults, caches, thread pool) also sizes a run: calls shorter than 1 ms
  // are timed in batches of about 1 ms, so that the clock's resolution does not matter.
  const double once = seconds(1);
  const int calls = once >= 1e-3 ? 1 : static_cast<int>(std::min(1e5, 1e-3 / std::max(once, 1e-8)));
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) times.push_back(seconds(calls));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace sdpa::bench
