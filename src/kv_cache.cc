// KVCache: the pool, its free list and the sequences' pages; attention goes to attention_paged.
#include "sdpa/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "checks.h"
#include "huge_pages.h"
#include "problem.h"
#include "quantize.h"
#include "storage.h"

namespace sdpa {
namespace {

using internal::fail;

int64_t checked_product(std::initializer_list<int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) {
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) fail("KVCache: the pool's size overflows");
    n *= d;
  }
  return n;
}

bool is_8bit(DType t) { return t == DType::kInt8 || t == DType::kUInt8; }

// Token rows (n, H, D) of a new k or v: shape, dtype (the cache's; float32, bfloat16 or float16
// for an 8-bit cache, which quantises them), unit last stride.
void check_tokens(const char* name, const TensorView& t, int64_t H, int64_t D, DType dtype, int64_t n) {
  const std::string want = "(n, " + std::to_string(H) + ", " + std::to_string(D) + ")";
  if (t.rank != 3 || t.shape[1] != H || t.shape[2] != D) {
    fail(std::string(name) + " has shape " + t.shape_string() + " but the cache takes " + want);
  }
  if (t.shape[0] != n) {
    fail(std::string(name) + " has " + std::to_string(t.shape[0]) + " tokens but k has " + std::to_string(n));
  }
  if (is_8bit(dtype)) {
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16 && t.dtype != DType::kFloat16) {
      fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but the cache holds " + dtype_name(dtype) +
           ", quantised from float32, bfloat16 or float16");
    }
  } else if (t.dtype != dtype) {
    fail(std::string(name) + " has dtype " + dtype_name(t.dtype) + " but the cache holds " + dtype_name(dtype));
  }
  if (n > 0 && D > 1 && t.strides[2] != 1) fail(std::string(name) + " must have a unit last stride");
  internal::check_has_data(name, t);
}

}  // namespace

KVCache::KVCache(int64_t num_pages, int64_t page_size, int64_t num_kv_heads, int64_t head_dim_k, int64_t head_dim_v,
                 DType dtype, int64_t quant_groups)
    : num_pages_(num_pages),
      page_size_(page_size),
      heads_(num_kv_heads),
      dk_(head_dim_k),
      dv_(head_dim_v),
      dtype_(dtype),
      groups_(quant_groups) {
  if (page_size < 1) fail("KVCache: page_size=" + std::to_string(page_size) + " must be at least 1");
  if (num_kv_heads < 1) fail("KVCache: num_kv_heads=" + std::to_string(num_kv_heads) + " must be at least 1");
  if (num_pages < 0 || num_pages > std::numeric_limits<int32_t>::max()) {
    fail("KVCache: num_pages=" + std::to_string(num_pages) + " must be in [0, 2^31)");
  }
  if (head_dim_k < 0 || head_dim_v < 0) {
    fail("KVCache: head dims " + std::to_string(head_dim_k) + ", " + std::to_string(head_dim_v) + " must be >= 0");
  }
  if (!internal::is_float_dtype(dtype) && !is_8bit(dtype)) {
    fail(std::string("KVCache: dtype ") + dtype_name(dtype) + " must be " + internal::storage_dtype_list() +
         ", or int8 or uint8 (8-bit)");
  }
  if (!is_8bit(dtype) && quant_groups != 1) {
    fail("KVCache: quant_groups=" + std::to_string(quant_groups) + " is for an 8-bit cache (int8, uint8); a " +
         dtype_name(dtype) + " cache takes 1");
  }
  if (quant_groups < 1 || head_dim_k % quant_groups != 0 || head_dim_v % quant_groups != 0) {
    fail("KVCache: quant_groups=" + std::to_string(quant_groups) + " must be at least 1 and divide head_dim_k=" +
         std::to_string(head_dim_k) + " and head_dim_v=" + std::to_string(head_dim_v));
  }
  const int64_t bytes = internal::storage_bytes(dtype);
  // The pools on huge pages where the OS gives them (huge_pages.h: decode reads every row).
  internal::resize_with_huge_pages(k_, static_cast<size_t>(checked_product({num_pages, page_size, num_kv_heads, head_dim_k, bytes})));
  internal::resize_with_huge_pages(v_, static_cast<size_t>(checked_product({num_pages, page_size, num_kv_heads, head_dim_v, bytes})));
  if (is_8bit(dtype)) {
    const auto n = static_cast<size_t>(checked_product({num_pages, page_size, num_kv_heads, quant_groups, 4}) / 4);
    internal::resize_with_huge_pages(k_scale_, n);
    internal::resize_with_huge_pages(v_scale_, n);
    if (dtype == DType::kUInt8) {
      internal::resize_with_huge_pages(k_zero_, n);
      internal::resize_with_huge_pages(v_zero_, n);
    }
  }
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

int64_t KVCache::new_sequence() {
  for (size_t s = 0; s < seqs_.size(); ++s) {
    if (!seqs_[s].live) {
      seqs_[s] = {true, 0, {}};
      return static_cast<int64_t>(s);
    }
  }
  seqs_.push_back({true, 0, {}});
  return static_cast<int64_t>(seqs_.size()) - 1;
}

const KVCache::Sequence& KVCache::sequence(int64_t seq) const {
  if (seq < 0 || seq >= static_cast<int64_t>(seqs_.size()) || !seqs_[static_cast<size_t>(seq)].live) {
    fail("sequence " + std::to_string(seq) + " is not in this KVCache (ids in use: " +
         std::to_string(sequences().size()) + ", from new_sequence())");
  }
  return seqs_[static_cast<size_t>(seq)];
}

void KVCache::append(int64_t seq, const TensorView& k, const TensorView& v) {
  const Sequence& s = sequence(seq);
  const int64_t n = k.rank == 3 ? k.shape[0] : 0;
  check_tokens("k", k, heads_, dk_, dtype_, n);
  check_tokens("v", v, heads_, dv_, dtype_, n);
  const int64_t need = (s.length + n + page_size_ - 1) / page_size_ - static_cast<int64_t>(s.pages.size());
  if (need > free_pages()) {
    fail("KVCache is full: sequence " + std::to_string(seq) + " needs " + std::to_string(need) +
         " more pages for " + std::to_string(n) + " tokens, " + std::to_string(free_pages()) + " of " +
         std::to_string(num_pages_) + " are free");
  }
  // An 8-bit cache's scales of every (token, head, group), checked before anything is written.
  std::vector<internal::QuantScale> k_scales, v_scales;
  if (is_8bit(dtype_)) {
    k_scales = internal::quant_scales("k", k, dtype_, groups_);
    v_scales = internal::quant_scales("v", v, dtype_, groups_);
  }
  Sequence& w = seqs_[static_cast<size_t>(seq)];
  for (int64_t p = 0; p < need; ++p) {
    w.pages.push_back(free_.back());
    free_.pop_back();
  }
  const int64_t bytes = internal::storage_bytes(dtype_);
  const auto copy = [&](const TensorView& t, std::vector<std::byte>& pool, int64_t D,
                        const std::vector<internal::QuantScale>& scales, std::vector<float>& scale_pool,
                        std::vector<float>& zero_pool) {
    const int64_t in_bytes = internal::storage_bytes(t.dtype);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = w.length + i;
      const int64_t page = w.pages[static_cast<size_t>(j / page_size_)], r = j % page_size_;
      if (is_8bit(dtype_)) {  // token i's (Hkv, D) rows into their slots: head h at (page, h, r)
        TensorView x = t;
        x.data = static_cast<std::byte*>(t.data) + i * t.strides[0] * in_bytes;
        x.rank = 2;
        x.shape[0] = heads_;
        x.shape[1] = D;
        x.strides[0] = t.strides[1];
        x.strides[1] = t.strides[2];
        TensorView values = TensorView::contiguous(pool.data() + ((page * heads_) * page_size_ + r) * D, dtype_,
                                                   {heads_, D});
        values.strides[0] = page_size_ * D;
        const int64_t at = ((page * heads_) * page_size_ + r) * groups_;
        TensorView scale = TensorView::contiguous(scale_pool.data() + at, DType::kFloat32, {heads_, groups_});
        scale.strides[0] = page_size_ * groups_;
        TensorView zero = scale;
        if (!zero_pool.empty()) zero.data = zero_pool.data() + at;
        internal::write_quantized(x, scales.data() + i * heads_ * groups_, values, scale,
                                  zero_pool.empty() ? nullptr : &zero);
        continue;
      }
      for (int64_t h = 0; h < heads_; ++h) {  // the pool is head-major within a page (see the header)
        const auto* src = static_cast<const std::byte*>(t.data) + (i * t.strides[0] + h * t.strides[1]) * bytes;
        std::memcpy(pool.data() + (((page * heads_ + h) * page_size_ + r) * D) * bytes, src,
                    static_cast<size_t>(D * bytes));
      }
    }
  };
  if (dk_ > 0) copy(k, k_, dk_, k_scales, k_scale_, k_zero_);
  if (dv_ > 0) copy(v, v_, dv_, v_scales, v_scale_, v_zero_);
  w.length += n;
}

void KVCache::free(int64_t seq) {
  sequence(seq);
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) free_.push_back(*it);
  std::sort(free_.begin(), free_.end(), std::greater<>());  // lowest index taken first
  s = {};
}

void KVCache::attention(const TensorView& q, const std::vector<int64_t>& seqs, const Outputs& outputs,
                        const Options& options) const {
  internal::check_no_positions(options, "KVCache::attention");
  if (q.rank != 4 || q.shape[0] != static_cast<int64_t>(seqs.size())) {
    fail("q has shape " + q.shape_string() + " but must be (len(seqs), Hq, Nq, Dk) = (" + std::to_string(seqs.size()) +
         ", Hq, Nq, " + std::to_string(dk_) + ")");
  }
  size_t max_pages = 0;
  for (int64_t s : seqs) max_pages = std::max(max_pages, sequence(s).pages.size());
  std::vector<int32_t> table(seqs.size() * std::max<size_t>(1, max_pages), -1);
  std::vector<int64_t> lengths(seqs.size());
  for (size_t b = 0; b < seqs.size(); ++b) {
    const Sequence& s = sequence(seqs[b]);
    std::copy(s.pages.begin(), s.pages.end(), table.begin() + static_cast<std::ptrdiff_t>(b * max_pages));
    lengths[b] = s.length;
  }
  PagedInputs in;
  in.q = q;
  in.k_pages = k_pages();
  in.v_pages = v_pages();
  in.block_table = TensorView::contiguous(table.data(), DType::kInt32,
                                          {static_cast<int64_t>(seqs.size()), static_cast<int64_t>(max_pages)});
  in.seqlens_k = TensorView::contiguous(lengths.data(), DType::kInt64, {static_cast<int64_t>(seqs.size())});
  in.kv_quant = kv_quant();
  attention_paged(in, outputs, options);
}

int64_t KVCache::length(int64_t seq) const { return sequence(seq).length; }
const std::vector<int32_t>& KVCache::pages(int64_t seq) const { return sequence(seq).pages; }

std::vector<int64_t> KVCache::sequences() const {
  std::vector<int64_t> ids;
  for (size_t s = 0; s < seqs_.size(); ++s)
    if (seqs_[s].live) ids.push_back(static_cast<int64_t>(s));
  return ids;
}

namespace {
// A pool stored (num_pages, H, page_size, D) as the (num_pages, page_size, H, D) view
// attention_paged takes.
TensorView head_major_pages(const std::vector<std::byte>& pool, DType dtype, int64_t pages, int64_t size, int64_t H,
                            int64_t D) {
  TensorView t = TensorView::contiguous(const_cast<std::byte*>(pool.data()), dtype, {pages, size, H, D});
  t.strides[1] = D;
  t.strides[2] = size * D;
  return t;
}
}  // namespace

TensorView KVCache::k_pages() const { return head_major_pages(k_, dtype_, num_pages_, page_size_, heads_, dk_); }
TensorView KVCache::v_pages() const { return head_major_pages(v_, dtype_, num_pages_, page_size_, heads_, dv_); }

namespace {
// A scale (or zero-point) pool stored (num_pages, H, page_size, G) as the view attention_paged
// takes: (num_pages, page_size, H) for G == 1, else (num_pages, page_size, H, G).
TensorView head_major_scales(const std::vector<float>& pool, int64_t pages, int64_t size, int64_t H, int64_t G) {
  TensorView t = TensorView::contiguous(const_cast<float*>(pool.data()), DType::kFloat32, {pages, size, H, G});
  t.strides[1] = G;
  t.strides[2] = size * G;
  if (G == 1) t.rank = 3;
  return t;
}
}  // namespace

std::optional<KVQuant> KVCache::kv_quant() const {
  if (!is_8bit(dtype_)) return std::nullopt;
  KVQuant q;
  q.k_scale = head_major_scales(k_scale_, num_pages_, page_size_, heads_, groups_);
  q.v_scale = head_major_scales(v_scale_, num_pages_, page_size_, heads_, groups_);
  if (dtype_ == DType::kUInt8) {
    q.k_zero = head_major_scales(k_zero_, num_pages_, page_size_, heads_, groups_);
    q.v_zero = head_major_scales(v_zero_, num_pages_, page_size_, heads_, groups_);
  }
  return q;
}

}  // namespace sdpa
