#include "test_util.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "hwy/base.h"
#include "hwy/targets.h"

namespace sdpa {
void PrintTo(Backend b, std::ostream* os) { *os << sdpa_test::backend_name(b); }
}  // namespace sdpa

namespace sdpa_test {
namespace {

// Guard patterns: the oracle's (tests/oracle/oracle.h), shared with the fuzzers.
using sdpa_oracle::kSentinel32;
using sdpa_oracle::kSentinel64;
using sdpa_oracle::kSentinel8;
using sdpa_oracle::kSentinelBF16;
using sdpa_oracle::kSentinelF16;

const void* sentinel(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32: return &kSentinel32;
    case DType::kFloat64:
    case DType::kInt64: return &kSentinel64;
    case DType::kBFloat16: return &kSentinelBF16;
    case DType::kFloat16: return &kSentinelF16;
    case DType::kBool:
    case DType::kInt8:
    case DType::kUInt8: break;
  }
  return &kSentinel8;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

const char* backend_name(sdpa::Backend b) {
  return b == sdpa::Backend::kAuto    ? "Auto"
         : b == sdpa::Backend::kFlash ? "Flash"
         : b == sdpa::Backend::kNaive ? "Naive"
                                      : "Reference";
}

Dims dims_of(const Tensors& t) {
  const auto &q = t.q.shape(), &k = t.k.shape(), &v = t.v.shape();
  const int r = t.q.rank();
  Dims d{};
  d.B = r == 4 ? q[0] : 1;
  d.Hq = r >= 3 ? q[r - 3] : 1;
  d.Hkv = r >= 3 ? k[r - 3] : 1;
  d.Nq = q[r - 2];
  d.Dk = q[r - 1];
  d.Nk = k[r - 2];
  d.Dv = v[r - 1];
  d.group = d.Hkv > 0 ? d.Hq / d.Hkv : 1;
  return d;
}

double mask_bias(const Tensors& t, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!t.mask) return 0.0;
  const double m = t.mask->at(b, h, i, j);
  return sdpa_oracle::mask_bias(t.mask->dtype(), m);
}

// ---- GuardedTensor ----

GuardedTensor::GuardedTensor(DType dtype, std::vector<int64_t> shape, Layout layout, bool unit_last_stride)
    : dtype_(dtype),
      shape_(std::move(shape)),
      strides_(shape_.size()),
      layout_(layout),
      unit_last_stride_(unit_last_stride),
      buffer_(nullptr, std::free) {
  const int r = rank();
  const int64_t elem = sdpa::dtype_size(dtype);
  const bool plain = layout == Layout::kContiguous;
  // Memory order, innermost dim first; kPermuted swaps N (r-2) and H (r-3).
  std::vector<int> order;
  for (int d = r - 1; d >= 0; --d) order.push_back(d);
  if (layout == Layout::kPermuted && r >= 3) std::swap(order[1], order[2]);
  int64_t stride = plain || unit_last_stride ? 1 : 2;
  for (int d : order) {
    strides_[d] = stride;
    stride = stride * shape_[d] + (plain ? 0 : 3);
  }
  if (layout == Layout::kPermuted) {
    if (r >= 2) strides_[r - 2] = -strides_[r - 2];
    if (!unit_last_stride) strides_[r - 1] = -strides_[r - 1];
  }
  // Buffer: front guard (64 bytes, +1 element when misaligned), the elements' span, back guard.
  const int64_t front = 64 / elem + (plain ? 0 : 1);
  int64_t span = 0, below = 0;  // below: how far negative strides reach under element 0
  if (numel() > 0) {
    span = 1;
    for (int d = 0; d < r; ++d) {
      span += (shape_[d] - 1) * std::abs(strides_[d]);
      if (strides_[d] < 0) below += (shape_[d] - 1) * -strides_[d];
    }
  }
  start_ = front + below;
  size_ = front + span + 64 / elem + 3;
  const size_t bytes = static_cast<size_t>((size_ * elem + 63) / 64 * 64);
  buffer_.reset(static_cast<std::byte*>(std::aligned_alloc(64, bytes)));
  if (!buffer_) throw std::bad_alloc();
  for (int64_t o = 0; o < size_; ++o) std::memcpy(buffer_.get() + o * elem, sentinel(dtype), elem);
  is_element_.assign(static_cast<size_t>(size_), false);
  for (int64_t n = 0; n < numel(); ++n) is_element_[element_offset(n)] = true;
}

sdpa::TensorView GuardedTensor::view() const {
  sdpa::TensorView t;
  t.data = buffer_.get() + start_ * sdpa::dtype_size(dtype_);
  t.dtype = dtype_;
  t.rank = rank();
  for (int d = 0; d < rank(); ++d) {
    t.shape[d] = shape_[d];
    t.strides[d] = strides_[d];
  }
  return t;
}

int64_t GuardedTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

int64_t GuardedTensor::element_offset(int64_t flat) const {
  int64_t offset = start_;
  for (int d = rank() - 1; d >= 0; --d) {
    offset += flat % shape_[d] * strides_[d];
    flat /= shape_[d];
  }
  return offset;
}

double GuardedTensor::get(int64_t flat) const {
  const std::byte* p = buffer_.get() + element_offset(flat) * sdpa::dtype_size(dtype_);
  switch (dtype_) {
    case DType::kFloat32: {
      float x;
      std::memcpy(&x, p, sizeof x);
      return x;
    }
    case DType::kFloat64: {
      double x;
      std::memcpy(&x, p, sizeof x);
      return x;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      uint16_t bits;
      std::memcpy(&bits, p, sizeof bits);
      return sdpa_oracle::half_value(sdpa_oracle::half_format(dtype_), bits);
    }
    case DType::kInt8: return static_cast<int8_t>(*p);  // 8-bit K/V values as they are stored
    case DType::kUInt8: return static_cast<uint8_t>(*p);
    case DType::kBool:
    case DType::kInt32:
    case DType::kInt64: break;
  }
  return static_cast<uint8_t>(*p) != 0 ? 1.0 : 0.0;
}

void GuardedTensor::set(int64_t flat, double value) {
  std::byte* p = buffer_.get() + element_offset(flat) * sdpa::dtype_size(dtype_);
  switch (dtype_) {
    case DType::kFloat32: {
      const float x = static_cast<float>(value);
      std::memcpy(p, &x, sizeof x);
      return;
    }
    case DType::kFloat64: std::memcpy(p, &value, sizeof value); return;
    case DType::kBFloat16:
    case DType::kFloat16: {
      const sdpa_oracle::HalfFormat& f = sdpa_oracle::half_format(dtype_);
      const uint16_t bits = sdpa_oracle::half_bits(f, sdpa_oracle::round_half(f, value));
      std::memcpy(p, &bits, sizeof bits);
      return;
    }
    case DType::kInt8: *p = static_cast<std::byte>(static_cast<int8_t>(value)); return;  // an integer in range
    case DType::kUInt8: *p = static_cast<std::byte>(static_cast<uint8_t>(value)); return;
    case DType::kBool:
    case DType::kInt32:
    case DType::kInt64: break;
  }
  *p = static_cast<std::byte>(static_cast<uint8_t>(value));  // any byte: 0 blocks, others attend
}

std::vector<double> GuardedTensor::values() const {
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t n = 0; n < numel(); ++n) out[n] = get(n);
  return out;
}

void GuardedTensor::set_values(const std::vector<double>& values) {
  if (static_cast<int64_t>(values.size()) != numel()) throw std::invalid_argument("set_values: wrong count");
  for (int64_t n = 0; n < numel(); ++n) set(n, values[n]);
}

double GuardedTensor::at(int64_t b, int64_t h, int64_t i, int64_t j) const {
  const int64_t index[4] = {b, h, i, j};
  int64_t flat = 0;
  for (int d = 0; d < rank(); ++d) flat = flat * shape_[d] + (shape_[d] == 1 ? 0 : index[4 - rank() + d]);
  return get(flat);
}

GuardedTensor GuardedTensor::converted(DType dtype, Layout layout) const {
  GuardedTensor t(dtype, shape_, layout, unit_last_stride_);
  t.set_values(values());
  return t;
}

bool GuardedTensor::holds_sentinel(int64_t offset) const {
  const int64_t elem = sdpa::dtype_size(dtype_);
  return std::memcmp(buffer_.get() + offset * elem, sentinel(dtype_), elem) == 0;
}

testing::AssertionResult GuardedTensor::guards_intact() const {
  for (int64_t o = 0; o < size_; ++o) {
    if (!is_element_[o] && !holds_sentinel(o)) {
      return testing::AssertionFailure() << "guard at buffer offset " << o - start_
                                         << " (relative to element 0) was overwritten; tensor shape "
                                         << view().shape_string();
    }
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult GuardedTensor::untouched() const {
  for (int64_t o = 0; o < size_; ++o) {
    if (!holds_sentinel(o)) {
      return testing::AssertionFailure() << "buffer offset " << o - start_ << " was written; tensor shape "
                                         << view().shape_string();
    }
  }
  return testing::AssertionSuccess();
}

GuardedTensor tensor(DType dtype, std::vector<int64_t> shape, const std::vector<double>& values, Layout layout) {
  GuardedTensor t(dtype, std::move(shape), layout);
  t.set_values(values);
  return t;
}

// ---- Random fills ----

void fill_normal(GuardedTensor& t, std::mt19937& rng, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  for (int64_t n = 0; n < t.numel(); ++n) t.set(n, dist(rng));
}

void fill_uniform(GuardedTensor& t, std::mt19937& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t n = 0; n < t.numel(); ++n) t.set(n, dist(rng));
}

void fill_mask(GuardedTensor& t, std::mt19937& rng, double density, double empty_row_probability) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  const bool is_bool = t.dtype() == DType::kBool;
  const int64_t row = t.rank() > 0 ? t.shape().back() : 1;
  for (int64_t start = 0; start < t.numel(); start += row) {
    const bool empty = unit(rng) < empty_row_probability;
    for (int64_t n = start; n < start + row; ++n) {
      const bool attend = !empty && unit(rng) < density;
      t.set(n, is_bool ? (attend ? 1.0 : 0.0) : (attend ? normal(rng) : -kInf));
    }
  }
}

// ---- Tensors, Outs, run ----

sdpa::Inputs Tensors::inputs() const {
  sdpa::Inputs in;
  in.q = q.view();
  in.k = k.view();
  in.v = v.view();
  if (mask) in.mask = mask->view();
  if (!seqlens_k.empty()) {
    sdpa::TensorView s;
    s.data = const_cast<int64_t*>(seqlens_k.data());  // read only
    s.dtype = DType::kInt64;
    s.rank = 1;
    s.shape[0] = static_cast<int64_t>(seqlens_k.size());
    s.strides[0] = 1;
    in.seqlens_k = s;
  }
  return in;
}

Tensors Tensors::converted(DType dtype) const {
  std::optional<GuardedTensor> m;
  if (mask) m = mask->converted(mask->dtype() == DType::kBool ? DType::kBool : dtype, mask->layout());
  return {q.converted(dtype, q.layout()), k.converted(dtype, k.layout()), v.converted(dtype, v.layout()),
          std::move(m), seqlens_k};
}

sdpa::Outputs Outs::outputs() const {
  sdpa::Outputs o;
  o.out = out.view();
  if (weights) o.weights = weights->view();
  if (lse) o.lse = lse->view();
  return o;
}

testing::AssertionResult Outs::guards_intact() const {
  if (auto r = out.guards_intact(); !r) return r << " (out)";
  if (weights) {
    if (auto r = weights->guards_intact(); !r) return r << " (weights)";
  }
  if (lse) {
    if (auto r = lse->guards_intact(); !r) return r << " (lse)";
  }
  return testing::AssertionSuccess();
}

Outs run(const Tensors& t, const sdpa::Options& options, Layout layout, bool with_extras) {
  std::vector<int64_t> shape = t.q.shape();
  const DType dtype = t.q.dtype();
  shape.back() = t.v.shape().back();
  Outs outs{GuardedTensor(dtype, shape, layout), std::nullopt, std::nullopt};
  if (with_extras) {
    shape.back() = t.k.shape()[t.k.rank() - 2];
    outs.weights.emplace(compute_dtype(dtype), shape, layout, false);
    shape.pop_back();
    outs.lse.emplace(compute_dtype(dtype), shape, layout, false);
  }
  sdpa::attention(t.inputs(), outs.outputs(), options);
  return outs;
}

Values values(const Outs& outs) {
  Values v;
  v.out = outs.out.values();
  if (outs.weights) v.weights = outs.weights->values();
  if (outs.lse) v.lse = outs.lse->values();
  return v;
}

testing::AssertionResult no_nan(const Values& v) {
  for (const auto* xs : {&v.out, &v.weights, &v.lse}) {
    for (double x : *xs) {
      if (std::isnan(x)) return testing::AssertionFailure() << "NaN in the outputs";
    }
  }
  return testing::AssertionSuccess();
}

Tensors random_qkv(DType dtype, std::vector<int64_t> q, std::vector<int64_t> k, std::vector<int64_t> v,
                   uint32_t seed) {
  std::mt19937 rng(seed);
  Tensors t{GuardedTensor(dtype, std::move(q)), GuardedTensor(dtype, std::move(k)), GuardedTensor(dtype, std::move(v)),
            std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  return t;
}

// ---- The oracle ----

bool key_allowed(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t i, int64_t j) {
  const Dims d = dims_of(t);
  const int64_t keys = t.seqlens_k.empty() ? d.Nk : t.seqlens_k[static_cast<size_t>(b)];
  return j < keys && sdpa_oracle::key_allowed(options, d.Nq, keys, i, j);
}

double view_value(const sdpa::TensorView& v, int64_t row, int64_t col) {
  const int64_t offset = (v.rank == 2 ? (v.shape[0] == 1 ? 0 : row) * v.strides[0] : 0) + col * v.strides[v.rank - 1];
  if (v.dtype == DType::kFloat64) return static_cast<const double*>(v.data)[offset];
  return static_cast<const float*>(v.data)[offset];
}

double alibi_bias(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!options.alibi_slopes) return 0.0;
  const Dims d = dims_of(t);
  const int64_t keys = t.seqlens_k.empty() ? d.Nk : t.seqlens_k[static_cast<size_t>(b)];
  return sdpa_oracle::alibi_bias(view_value(*options.alibi_slopes, b, h), options, d.Nq, keys, i, j);
}

double modified_score(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t h, int64_t i, int64_t j,
                      double x) {
  const double cap = options.softcap;
  const bool after = options.softcap_order == sdpa::Options::SoftcapOrder::kAfterBias;
  if (cap > 0 && !after) x = cap * std::tanh(x / cap);
  x += alibi_bias(t, options, b, h, i, j);
  const double bias = mask_bias(t, b, h, i, j);
  if (bias == -kInf) return -kInf;
  x += bias;
  if (cap > 0 && after) x = cap * std::tanh(x / cap);
  return x;
}

namespace {

// score_magnitude of (b, h, i, j) given q's row i and k's row j as doubles (Dk each).
double score_magnitude_of_rows(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t h, int64_t i,
                               int64_t j, const double* q_row, const double* k_row, int64_t Dk) {
  const double bias = mask_bias(t, b, h, i, j);
  if (!key_allowed(t, options, b, i, j) || !std::isfinite(bias)) return 0.0;
  const double scale = sdpa_oracle::scale_of(options, Dk);
  double sum = 0;
  for (int64_t x = 0; x < Dk; ++x) sum += std::abs(q_row[x] * k_row[x]);
  // ALiBi's bias is a term of the score too (its distance exact, its product rounded once).
  return sdpa_oracle::score_magnitude(scale, sum, bias, alibi_bias(t, options, b, h, i, j));
}

}  // namespace

std::vector<double> widened(const GuardedTensor& x, int64_t B, int64_t H, int64_t N, int64_t D) {
  std::vector<double> out;
  out.reserve(static_cast<size_t>(B * H * N * D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < D; ++c) out.push_back(x.at(b, h, n, c));
  return out;
}

ScoreMagnitudes::ScoreMagnitudes(const Tensors& t, const sdpa::Options& options) : t_(t), options_(options) {
  const Dims d = dims_of(t);
  Hq_ = d.Hq, Hkv_ = d.Hkv, Nq_ = d.Nq, Nk_ = d.Nk, Dk_ = d.Dk, group_ = d.group;
  q_ = widened(t.q, d.B, d.Hq, d.Nq, d.Dk);
  k_ = widened(t.k, d.B, d.Hkv, d.Nk, d.Dk);
}

double ScoreMagnitudes::operator()(int64_t b, int64_t h, int64_t i, int64_t j) const {
  const size_t q_row = static_cast<size_t>(((b * Hq_ + h) * Nq_ + i) * Dk_);
  const size_t k_row = static_cast<size_t>(((b * Hkv_ + h / group_) * Nk_ + j) * Dk_);
  return score_magnitude_of_rows(t_, options_, b, h, i, j, q_.data() + q_row, k_.data() + k_row, Dk_);
}

double score_magnitude(const Tensors& t, const sdpa::Options& options, int64_t b, int64_t h, int64_t i, int64_t j) {
  const Dims d = dims_of(t);
  std::vector<double> qr(static_cast<size_t>(d.Dk)), kr(static_cast<size_t>(d.Dk));
  for (int64_t x = 0; x < d.Dk; ++x) qr[x] = t.q.at(b, h, i, x), kr[x] = t.k.at(b, h / d.group, j, x);
  return score_magnitude_of_rows(t, options, b, h, i, j, qr.data(), kr.data(), d.Dk);
}

double max_score_magnitude(const Tensors& t, const sdpa::Options& options) {
  const Dims d = dims_of(t);
  const ScoreMagnitudes magnitude(t, options);
  double m = 0;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i)
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double s = magnitude(b, h, i, j);
          if (std::isfinite(s)) m = std::max(m, s);
        }
  return m;
}

Values oracle(const Tensors& t, const sdpa::Options& options) {
  const Dims d = dims_of(t);
  const double scale = sdpa_oracle::scale_of(options, d.Dk);
  Values r;
  r.out.reserve(static_cast<size_t>(d.B * d.Hq * d.Nq * d.Dv));
  r.weights.reserve(static_cast<size_t>(d.B * d.Hq * d.Nq * d.Nk));
  std::vector<double> s(static_cast<size_t>(d.Nk));
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t kvh = h / d.group;
      for (int64_t i = 0; i < d.Nq; ++i) {
        double m = -kInf;
        for (int64_t j = 0; j < d.Nk; ++j) {
          s[j] = -kInf;
          if (key_allowed(t, options, b, i, j)) {
            double dot = 0;
            for (int64_t x = 0; x < d.Dk; ++x) dot += t.q.at(b, h, i, x) * t.k.at(b, kvh, j, x);
            s[j] = modified_score(t, options, b, h, i, j, dot * scale);
          }
          m = std::max(m, s[j]);
        }
        // A sink: one more term of the softmax's sum, with no value row.
        const double sink = options.sinks ? view_value(*options.sinks, 0, h) : -kInf;
        const bool any = m != -kInf;
        m = std::max(m, sink);
        double sum = options.sinks && m != -kInf ? std::exp(sink - m) : 0.0;
        for (int64_t j = 0; j < d.Nk; ++j) sum += !any ? 0.0 : std::exp(s[j] - m);
        for (int64_t j = 0; j < d.Nk; ++j) r.weights.push_back(!any ? 0.0 : std::exp(s[j] - m) / sum);
        const double* w = r.weights.data() + r.weights.size() - d.Nk;
        for (int64_t x = 0; x < d.Dv; ++x) {
          double o = 0;
          for (int64_t j = 0; j < d.Nk; ++j) o += w[j] == 0 ? 0.0 : w[j] * t.v.at(b, kvh, j, x);
          r.out.push_back(o);
        }
        r.lse.push_back(m == -kInf ? -kInf : m + std::log(sum));
      }
    }
  }
  return r;
}

// ---- Comparisons and the tolerance rule ----

testing::AssertionResult all_close(const char* what, const std::vector<double>& got, const std::vector<double>& want,
                                   double tol) {
  const sdpa_oracle::Mismatch m = sdpa_oracle::compare(what, got, want, tol);
  if (m.count == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << m.message;
}

void expect_sdpa_error(const std::function<void()>& call, const std::vector<std::string>& substrings) {
  try {
    call();
    ADD_FAILURE() << "no sdpa::Error thrown";
  } catch (const sdpa::Error& e) {
    for (const std::string& s : substrings) {
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "message: " << e.what() << "\nmissing: " << s;
    }
  }
}

testing::AssertionResult bitwise_equal(const Outs& a, const Outs& b) {
  const Values va = values(a), vb = values(b);
  const std::pair<const char*, const std::vector<double>*> pairs[][2] = {
      {{"out", &va.out}, {"out", &vb.out}},
      {{"weights", &va.weights}, {"weights", &vb.weights}},
      {{"lse", &va.lse}, {"lse", &vb.lse}}};
  for (const auto& [x, y] : pairs) {
    if (x.second->empty() || y.second->empty()) continue;
    if (x.second->size() != y.second->size()) return testing::AssertionFailure() << x.first << ": sizes differ";
    for (size_t n = 0; n < x.second->size(); ++n) {
      if (std::bit_cast<uint64_t>((*x.second)[n]) != std::bit_cast<uint64_t>((*y.second)[n])) {
        return testing::AssertionFailure() << x.first << "[" << n << "]: " << (*x.second)[n] << " vs "
                                           << (*y.second)[n] << " (not bitwise equal)";
      }
    }
  }
  return testing::AssertionSuccess();
}

// The rule is sdpa_oracle's (oracle/tolerance.h), which states it; here the backends run on t.
testing::AssertionResult expected_forward(const Tensors& t, const sdpa::Options& options, ForwardExpected& e) {
  // Runs kReference and kNaive on `in`; sets `ref` and raises `err` to kNaive's error * scale.
  auto measure = [&](const Tensors& in, double scale, Values& ref, double (&err)[3]) {
    sdpa::Options o = options;
    o.backend = sdpa::Backend::kReference;
    ref = values(run(in, o));
    o.backend = sdpa::Backend::kNaive;
    const Values naive = values(run(in, o));
    std::string why = sdpa_oracle::naive_error("out", naive.out, ref.out, scale, err[0]);
    if (why.empty()) why = sdpa_oracle::naive_error("weights", naive.weights, ref.weights, scale, err[1]);
    if (why.empty()) why = sdpa_oracle::naive_error("lse", naive.lse, ref.lse, scale, err[2]);
    return why.empty() ? testing::AssertionSuccess() : testing::AssertionFailure() << why;
  };
  const DType dtype = t.q.dtype();
  Values& ref = e.ref;
  Values ref32;
  double err[3] = {0, 0, 0};
  if (auto r = measure(t, 1.0, ref, err); !r) return r;
  if (dtype == DType::kFloat64) {
    if (auto r = measure(t.converted(DType::kFloat32), sdpa_oracle::kFloat64ErrorScale, ref32, err); !r) return r;
  }
  e.tol = sdpa_oracle::forward_tolerance(
      err, sdpa_oracle::naive_factor(dtype),
      {.dtype = dtype,
       .out_max = max_abs_finite(t.v.values()) / (1 - options.dropout_p),  // / 1 exactly without dropout
       .max_score = max_score_magnitude(t, options),
       .lse_max = max_abs_finite(ref.lse),
       .rounds_weights = options.precision == sdpa::Precision::kFast && (dtype == DType::kBFloat16 ||
                                                                         dtype == DType::kFloat16)});
  return testing::AssertionSuccess();
}

testing::AssertionResult matches(const ForwardExpected& e, const Outs& got) {
  const Values g = values(got);
  if (auto r = all_close("out", g.out, e.ref.out, e.tol.out); !r) return r;
  if (got.weights) {
    if (auto r = all_close("weights", g.weights, e.ref.weights, e.tol.weights); !r) return r;
  }
  if (got.lse) return all_close("lse", g.lse, e.ref.lse, e.tol.lse);
  return testing::AssertionSuccess();
}

testing::AssertionResult matches_reference(const Tensors& t, const sdpa::Options& options, const Outs& got) {
  ForwardExpected e;
  if (auto r = expected_forward(t, options, e); !r) return r;
  return matches(e, got);
}

testing::AssertionResult blocked_are_exact(const Tensors& t, const sdpa::Options& options, const Outs& got) {
  const Dims d = dims_of(t);
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.Hq; ++h) {
      for (int64_t i = 0; i < d.Nq; ++i) {
        bool any = false;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const bool allowed = key_allowed(t, options, b, i, j) && mask_bias(t, b, h, i, j) != -kInf;
          any = any || allowed;
          if (!allowed && got.weights && got.weights->at(b, h, i, j) != 0) {
            return testing::AssertionFailure() << "weights[" << b << "," << h << "," << i << "," << j
                                               << "] = " << got.weights->at(b, h, i, j) << " but that key is blocked";
          }
        }
        if (any) continue;
        for (int64_t x = 0; x < d.Dv; ++x) {
          if (got.out.at(b, h, i, x) != 0) {
            return testing::AssertionFailure() << "out[" << b << "," << h << "," << i << "," << x
                                               << "] = " << got.out.at(b, h, i, x) << " but the row has no allowed key";
          }
        }
        // lse = -inf, or the sink (stored in the compute type) where the row has one.
        const double no_key_lse = options.sinks ? round_to(got.lse ? got.lse->dtype() : kF64,
                                                           view_value(*options.sinks, 0, h)) : -kInf;
        if (got.lse && got.lse->at(0, b, h, i) != no_key_lse) {
          return testing::AssertionFailure() << "lse[" << b << "," << h << "," << i << "] = " << got.lse->at(0, b, h, i)
                                             << " but the row has no allowed key (want " << no_key_lse << ")";
        }
      }
    }
  }
  return testing::AssertionSuccess();
}

// ---- The sweep ----

namespace {

std::string number(double x) {
  std::ostringstream s;
  s << x;
  std::string out;
  for (char c : s.str()) out += c == '.' ? 'p' : c == '-' ? 'm' : c;
  return out;
}

std::string case_name(const Case& c) {
  std::ostringstream s;
  s << (c.dtype == DType::kFloat32 ? "f32" : c.dtype == DType::kFloat64 ? "f64" : c.dtype == DType::kBFloat16 ? "bf16" : "f16")
    << "_r" << c.rank;
  if (c.rank == 4) s << "_b" << c.B;
  if (c.rank >= 3) s << "_h" << c.Hq << "x" << c.Hkv;
  s << "_q" << c.Nq << "_k" << c.Nk << "_d" << c.Dk << "_v" << c.Dv;
  if (c.mask != MaskKind::kNone) {
    static const char* const shapes[] = {"Full", "QK", "HK", "K"};
    s << (c.mask == MaskKind::kBool ? "_bool" : "_add") << shapes[static_cast<int>(c.mask_shape)];
  }
  if (c.causal == sdpa::Causal::kBottomRight) s << "_causalBR";
  if (c.causal == sdpa::Causal::kTopLeft) s << "_causalTL";
  if (c.window.left >= 0 || c.window.right >= 0) {
    s << "_win" << (c.window.left >= 0 ? std::to_string(c.window.left) : "n") << "_"
      << (c.window.right >= 0 ? std::to_string(c.window.right) : "n");
  }
  if (c.scale) s << "_scale" << number(*c.scale);
  if (c.layout == Layout::kPadded) s << "_padded";
  if (c.layout == Layout::kPermuted) s << "_permuted";
  if (c.blocked.end > c.blocked.begin) {
    s << "_blocked" << c.blocked.begin << "_" << c.blocked.end;
    if (c.blocked.rows >= 0) s << "_rows" << c.blocked.rows;
  }
  return s.str();
}

std::vector<int64_t> last(int rank, std::vector<int64_t> full) { return {full.end() - rank, full.end()}; }

}  // namespace

std::vector<Case> sweep_cases() {
  using sdpa::Causal;
  using Pairs = std::initializer_list<std::pair<int64_t, int64_t>>;
  // Lengths at and around the AVX2 lane counts (8 f32, 4 f64) and their multiples.
  const int64_t lengths[] = {1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 97, 257};
  const int64_t dims[] = {1, 3, 8, 59, 64, 80, 128};
  const MaskShape shapes[] = {MaskShape::kFull, MaskShape::kQueryKey, MaskShape::kHeadKey, MaskShape::kKey};
  const sdpa::Window windows[] = {{3, -1}, {-1, 2}, {4, 4}, {0, 0}, {16, 0}};
  std::vector<Case> cases;
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16}) {
    auto add = [&](Case c) {
      c.dtype = dtype;
      c.name = case_name(c);
      for (const Case& other : cases) {
        if (other.name == c.name) throw std::logic_error("duplicate sweep case " + c.name);
      }
      cases.push_back(std::move(c));
    };
    for (int i = 0; i < 12; ++i) {
      // Self-attention over every length; cross-attention with Nq < Nk and Nq > Nk.
      add({.rank = 3, .Hq = 2, .Hkv = 2, .Nq = lengths[i], .Nk = lengths[i], .Dk = dims[i % 7], .Dv = dims[i % 7],
           .layout = i % 3 == 1 ? Layout::kPadded : Layout::kContiguous});
      add({.rank = 3, .Nq = lengths[i], .Nk = lengths[(i + 5) % 12], .Dk = dims[(i + 2) % 7], .Dv = dims[(i + 2) % 7],
           .causal = i % 2 ? Causal::kBottomRight : Causal::kNone});
    }
    for (int i = 0; i < 7; ++i) {
      // Head dims, Dv == Dk and Dv != Dk, in rank 2 and rank 4.
      add({.rank = 2, .Nq = 17, .Nk = 33, .Dk = dims[i], .Dv = dims[i]});
      add({.rank = 4, .B = 2, .Hq = 2, .Hkv = 2, .Nq = 9, .Nk = 65, .Dk = dims[i], .Dv = dims[(i + 3) % 7],
           .layout = i % 2 ? Layout::kPermuted : Layout::kContiguous});
    }
    for (auto [hq, hkv] : Pairs{{4, 4}, {4, 2}, {8, 2}, {6, 1}}) {
      // GQA ratios 1, 2, 4 and MQA.
      add({.rank = 4, .B = 2, .Hq = hq, .Hkv = hkv, .Nq = 16, .Nk = 65, .Dk = 64, .Dv = 64, .causal = Causal::kBottomRight});
      add({.rank = 3, .Hq = hq, .Hkv = hkv, .Nq = 9, .Nk = 9, .Dk = 8, .Dv = 8, .mask = MaskKind::kBool,
           .mask_shape = MaskShape::kHeadKey});
    }
    for (MaskKind kind : {MaskKind::kBool, MaskKind::kAdditive}) {
      // Every mask kind and broadcast shape, alone and with causal; rank 2 and 3 too.
      for (int s = 0; s < 4; ++s) {
        add({.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = 17, .Nk = 63, .Dk = 64, .Dv = 64, .mask = kind,
             .mask_shape = shapes[s], .causal = s % 2 ? Causal::kTopLeft : Causal::kNone,
             .layout = s == 2 ? Layout::kPadded : Layout::kContiguous});
      }
      add({.rank = 2, .Nq = 9, .Nk = 16, .Dk = 3, .Dv = 3, .mask = kind, .mask_shape = MaskShape::kKey});
      add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 15, .Nk = 8, .Dk = 8, .Dv = 16, .mask = kind,
           .mask_shape = MaskShape::kHeadKey, .causal = Causal::kBottomRight});
    }
    for (Causal causal : {Causal::kBottomRight, Causal::kTopLeft}) {
      for (auto [nq, nk] : Pairs{{15, 64}, {64, 15}, {33, 33}}) {
        add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = nq, .Nk = nk, .Dk = 59, .Dv = 16, .causal = causal});
      }
    }
    for (const sdpa::Window& w : windows) {
      // Windows alone and with causal; the last, Nq > Nk, leaves the first rows without keys.
      add({.rank = 3, .Hq = 2, .Hkv = 2, .Nq = 65, .Nk = 65, .Dk = 64, .Dv = 64, .window = w});
      add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 16, .Nk = 97, .Dk = 80, .Dv = 80, .causal = Causal::kBottomRight,
           .window = w});
    }
    add({.rank = 2, .Nq = 97, .Nk = 16, .Dk = 8, .Dv = 8, .window = {2, 2}});
    for (double scale : {0.0, 0.05, -1.5, 8.0}) {
      // Uniform, flat, negative and sharp (saturating) softmax; 512 rows for a stable max error.
      add({.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = 64, .Nk = 64, .Dk = 64, .Dv = 64, .scale = scale});
    }
    // Everything at once on strided, misaligned, permuted views.
    add({.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = 17, .Nk = 65, .Dk = 59, .Dv = 80, .mask = MaskKind::kAdditive,
         .causal = Causal::kBottomRight, .window = {32, -1}, .layout = Layout::kPermuted});
    add({.rank = 4, .B = 2, .Hq = 4, .Hkv = 1, .Nq = 65, .Nk = 17, .Dk = 64, .Dv = 8, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kQueryKey, .causal = Causal::kTopLeft, .layout = Layout::kPadded});
    // Large: a long causal prefill, a decode step against a long KV cache, a mid-size head.
    add({.rank = 2, .Nq = 1025, .Nk = 1025, .Dk = 64, .Dv = 64, .causal = Causal::kBottomRight});
    add({.rank = 4, .Hq = 8, .Hkv = 2, .Nq = 1, .Nk = 1025, .Dk = 128, .Dv = 128, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kKey});
    add({.rank = 3, .Hq = 2, .Hkv = 2, .Nq = 257, .Nk = 257, .Dk = 128, .Dv = 128});
    // Few rows against more than 2048 keys: long enough for a kernel to split the keys into
    // chunks and merge them; with a window most chunks see no key at all.
    add({.rank = 4, .Hq = 4, .Hkv = 1, .Nq = 1, .Nk = 4100, .Dk = 64, .Dv = 64, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kKey});
    add({.rank = 3, .Hq = 2, .Hkv = 2, .Nq = 3, .Nk = 4100, .Dk = 16, .Dv = 16, .causal = Causal::kBottomRight,
         .window = {100, -1}});
    // The few-rows kernel takes all rows of a block (up to kDecodeMaxRows = 8) in one pass over
    // K/V: 5, 6 and 8 rows per kv head (GQA groups of 5 and 8, 2 tokens × group 3), so each
    // row count has a case (1-4, 7 and 8 come from the cases above).
    add({.rank = 4, .Hq = 5, .Hkv = 1, .Nq = 1, .Nk = 300, .Dk = 64, .Dv = 32, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kHeadKey});
    add({.rank = 4, .B = 2, .Hq = 6, .Hkv = 2, .Nq = 2, .Nk = 4100, .Dk = 128, .Dv = 128,
         .causal = Causal::kBottomRight, .window = {1000, -1}});
    add({.rank = 4, .Hq = 16, .Hkv = 2, .Nq = 1, .Nk = 1025, .Dk = 128, .Dv = 128, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kKey});

    // Chunked prefill: many rows (> kDecodeMaxRows per kv head, so the many-rows kernel) but
    // fewer than 16 blocks, against more than 2048 keys: the keys are split into chunks merged
    // by lse. Top-left causal leaves every chunk but the first empty; with the window {600, 0}
    // (keys [i + 3400, i + 4000]) and 1152-key chunks, rows 0-55 see a few keys of the chunk
    // that ends at 3456 and rows 56-99 none, so lanes of one block differ in which chunks they
    // see; masks block a whole chunk for every row, or all but the first chunk for rows 0-49.
    for (Causal causal : {Causal::kBottomRight, Causal::kTopLeft}) {
      add({.rank = 3, .Nq = 100, .Nk = 4100, .Dk = 32, .Dv = 32, .causal = causal});
    }
    add({.rank = 3, .Nq = 100, .Nk = 4100, .Dk = 32, .Dv = 32, .window = {600, 0}});
    add({.rank = 3, .Nq = 100, .Nk = 4100, .Dk = 32, .Dv = 32, .mask = MaskKind::kBool, .mask_shape = MaskShape::kKey,
         .blocked = {1152, 2304}});
    add({.rank = 3, .Nq = 100, .Nk = 4100, .Dk = 32, .Dv = 16, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kQueryKey, .causal = Causal::kBottomRight, .blocked = {1000, 4100, 50}});
    add({.rank = 4, .Hq = 4, .Hkv = 1, .Nq = 25, .Nk = 4100, .Dk = 32, .Dv = 32, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kHeadKey, .window = {2000, 300}});

    // Masks across several key tiles (kTileKeys = 128): every shape and kind at Nk = 300 and
    // 1025, with causal (top-left: tiles past the first never visited), a window, and masks
    // that block a whole tile ([128, 256)) for every row.
    for (MaskKind kind : {MaskKind::kBool, MaskKind::kAdditive}) {
      for (int s = 0; s < 4; ++s) {
        const Causal causal = s == 1 ? Causal::kBottomRight : s == 3 ? Causal::kTopLeft : Causal::kNone;
        add({.rank = 4, .B = 2, .Hq = 4, .Hkv = 2, .Nq = 33, .Nk = 300, .Dk = 32, .Dv = 32, .mask = kind,
             .mask_shape = shapes[s], .causal = causal, .blocked = s == 0 ? KeyBlock{128, 256} : KeyBlock{}});
        add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 40, .Nk = 1025, .Dk = 64, .Dv = 32, .mask = kind,
             .mask_shape = shapes[s], .causal = s == 2 ? Causal::kBottomRight : Causal::kNone,
             .window = s == 0 ? sdpa::Window{200, -1} : sdpa::Window{},
             .blocked = s == 0 ? KeyBlock{} : KeyBlock{128, 256}});
      }
    }
    // Windows and causal across tiles.
    for (const sdpa::Window& w : {sdpa::Window{64, 0}, sdpa::Window{0, 64}, sdpa::Window{130, 130}}) {
      add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 300, .Nk = 300, .Dk = 32, .Dv = 32, .window = w});
    }
    add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 150, .Nk = 1025, .Dk = 32, .Dv = 32, .window = {64, 0}});
    for (Causal causal : {Causal::kBottomRight, Causal::kTopLeft}) {
      add({.rank = 3, .Nq = 260, .Nk = 1025, .Dk = 32, .Dv = 64, .causal = causal});
    }
    add({.rank = 3, .Nq = 260, .Nk = 1025, .Dk = 32, .Dv = 32, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kQueryKey, .causal = Causal::kTopLeft, .blocked = {128, 256}});

    // Head dims 111 and 256 (Dv == Dk and Dv != Dk), across tiles, in decode and chunked decode.
    for (int64_t d : {111, 256}) {
      add({.rank = 2, .Nq = 17, .Nk = 33, .Dk = d, .Dv = d});
      add({.rank = 4, .B = 2, .Hq = 2, .Hkv = 2, .Nq = 9, .Nk = 65, .Dk = d, .Dv = d == 111 ? 64 : 111,
           .layout = Layout::kPermuted});
      add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 65, .Nk = 300, .Dk = d, .Dv = d == 111 ? 256 : 8,
           .mask = MaskKind::kBool, .mask_shape = MaskShape::kKey, .causal = Causal::kBottomRight});
    }
    add({.rank = 3, .Hq = 4, .Hkv = 1, .Nq = 1, .Nk = 257, .Dk = 256, .Dv = 256});
    add({.rank = 3, .Hq = 2, .Hkv = 2, .Nq = 2, .Nk = 2500, .Dk = 111, .Dv = 111, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kQueryKey});
    // Long cross-attention with masks: Nq > Nk (bottom-right causal: the first 825 rows see
    // nothing) and Nq < Nk.
    add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 1025, .Nk = 200, .Dk = 32, .Dv = 32, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kQueryKey, .causal = Causal::kBottomRight});
    add({.rank = 4, .Hq = 2, .Hkv = 2, .Nq = 200, .Nk = 1025, .Dk = 32, .Dv = 32, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kFull});

    // Shapes of the backward kernel's blocks (key blocks of 16 / 32 rows, 128-row query tiles,
    // 128-key tiles), which the backward sweep runs on this same table.
    for (const sdpa::Window& w : windows) {
      add({.rank = 2, .Nq = 97, .Nk = 17, .Dk = 3, .Dv = 8, .causal = Causal::kTopLeft, .window = w});
    }
    add({.rank = 3, .Hq = 2, .Hkv = 1, .Nq = 1, .Nk = 97, .Dk = 80, .Dv = 8, .causal = Causal::kBottomRight});
    add({.rank = 2, .Nq = 257, .Nk = 300, .Dk = 64, .Dv = 32, .causal = Causal::kBottomRight});
    add({.rank = 3, .Hq = 4, .Hkv = 1, .Nq = 140, .Nk = 33, .Dk = 8, .Dv = 8, .mask = MaskKind::kAdditive,
         .mask_shape = MaskShape::kQueryKey, .layout = Layout::kPadded});
    add({.rank = 4, .Hq = 2, .Hkv = 1, .Nq = 1, .Nk = 700, .Dk = 128, .Dv = 128, .mask = MaskKind::kBool,
         .mask_shape = MaskShape::kKey});
  }
  return cases;
}

Tensors make_inputs(const Case& c) {
  std::mt19937 rng(static_cast<uint32_t>(fnv1a(c.name)));
  Tensors t{GuardedTensor(c.dtype, last(c.rank, {c.B, c.Hq, c.Nq, c.Dk}), c.layout),
            GuardedTensor(c.dtype, last(c.rank, {c.B, c.Hkv, c.Nk, c.Dk}), c.layout),
            GuardedTensor(c.dtype, last(c.rank, {c.B, c.Hkv, c.Nk, c.Dv}), c.layout), std::nullopt};
  fill_normal(t.q, rng);
  fill_normal(t.k, rng);
  fill_normal(t.v, rng);
  if (c.mask != MaskKind::kNone) {
    std::vector<int64_t> shape;
    switch (c.mask_shape) {
      case MaskShape::kFull: shape = last(c.rank, {c.B, c.Hq, c.Nq, c.Nk}); break;
      case MaskShape::kQueryKey: shape = {c.Nq, c.Nk}; break;
      case MaskShape::kHeadKey: shape = last(c.rank, {1, c.Hq, 1, c.Nk}); break;
      case MaskShape::kKey: shape = {c.Nk}; break;
    }
    t.mask.emplace(c.mask == MaskKind::kBool ? DType::kBool : c.dtype, shape, c.layout, false);
    // Fully blocked rows only where the mask has many rows: a blocked key-padding row would
    // empty the whole output and leave nothing to compare.
    const int64_t rows = t.mask->numel() / std::max<int64_t>(1, shape.back());
    fill_mask(*t.mask, rng, 0.7, rows >= 8 ? 0.1 : 0.0);
    if (c.blocked.end > c.blocked.begin) {
      const bool has_rows = c.mask_shape == MaskShape::kFull || c.mask_shape == MaskShape::kQueryKey;
      const double blocked = c.mask == MaskKind::kBool ? 0.0 : -std::numeric_limits<double>::infinity();
      for (int64_t n = 0; n < t.mask->numel(); ++n) {
        const int64_t j = n % c.Nk, i = has_rows ? n / c.Nk % c.Nq : 0;
        if (j >= c.blocked.begin && j < c.blocked.end && (!has_rows || c.blocked.rows < 0 || i < c.blocked.rows)) {
          t.mask->set(n, blocked);
        }
      }
    }
  } else if (c.blocked.end > c.blocked.begin) {
    throw std::logic_error("case " + c.name + " blocks keys but has no mask");
  }
  return t;
}

sdpa::Options options(const Case& c, sdpa::Backend backend) {
  sdpa::Options o;
  o.scale = c.scale;
  o.causal = c.causal;
  o.window = c.window;
  o.backend = backend;
  return o;
}

int64_t work(const Case& c) { return c.B * c.Hq * c.Nq * c.Nk * (c.Dk + c.Dv); }

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// ---- SIMD targets ----

#if HWY_ARCH_X86
// Every x86 target better than AVX2 (AVX3, AVX3_DL and any later one): the lower bits.
constexpr int64_t kAboveAvx2 = HWY_AVX2 - 1;
#endif

Avx2Only::Avx2Only() {
#if HWY_ARCH_X86
  hwy::DisableTargets(kAboveAvx2);
#endif
}

Avx2Only::~Avx2Only() { hwy::DisableTargets(0); }

KernelPathCap::KernelPathCap(sdpa::KernelPath max) { sdpa::set_max_kernel_path(max); }
KernelPathCap::~KernelPathCap() { sdpa::set_max_kernel_path(sdpa::KernelPath::kAmxBf16); }

std::string bf16_dot_pass_skip_reason() {
  if (!sdpa::kernel_path_available(sdpa::KernelPath::kAvx512Bf16)) return "no AVX512_BF16 path on this CPU";
  if (!sdpa::kernel_path_available(sdpa::KernelPath::kAmxBf16)) {
    return "no AMX on this CPU: the normal pass already runs on AVX512_BF16";
  }
  return "";
}

std::vector<Case> bf16_sweep_cases() {
  std::vector<Case> cases;
  for (const Case& c : sweep_cases()) {
    if (c.dtype == kBF16) cases.push_back(c);
  }
  return cases;
}

std::string avx2_pass_skip_reason() {
#if HWY_ARCH_X86
  const int64_t supported = hwy::SupportedTargets();
  if (!(supported & HWY_AVX2)) return "this CPU has no AVX2";
  if (!(supported & HWY_TARGETS & kAboveAvx2)) {
    return "nothing better than AVX2 here (CPU or build): the normal pass already runs on AVX2";
  }
  return "";
#else
  return "not an x86 CPU";
#endif
}

std::string dispatched_target() {
  const hwy::ChosenTarget& chosen = hwy::GetChosenTarget();
  if (!chosen.IsInitialized()) return "none";
  const size_t index = chosen.GetIndex();  // into a HWY_EXPORT table; the same in every TU
  for (int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    const int64_t target = targets & -targets;
    const int64_t bit = HWY_CHOSEN_TARGET_SHIFT(target);
    const int64_t want = bit != 0 ? bit : HWY_CHOSEN_TARGET_MASK_SCALAR;  // EMU128 / SCALAR: the last entry
    if (hwy::Num0BitsBelowLS1Bit_Nonzero64(static_cast<uint64_t>(want)) == index) return hwy::TargetName(target);
  }
  return "index " + std::to_string(index);
}

}  // namespace sdpa_test
