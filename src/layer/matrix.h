// The multi-head layer's building blocks: strided views as row-major matrices, the two ways of
// multiplying them (BLAS, or the reference's plain loops), column sums and RoPE.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "layer/blas.h"
#include "sdpa/attention.h"
#include "storage.h"

namespace sdpa::internal {

// A view of rank 2 (R, W) or 3 (B, N, W) read as a row-major matrix of B·N rows in T: in place
// when it holds T and its rows are evenly spaced (unit last stride, row stride >= W, and the
// batches one after another), else a contiguous copy.
template <typename T>
struct InRows {
  const T* data = nullptr;
  int64_t ld = 0;
  std::vector<T> copy;
};

inline int64_t width(const TensorView& t) { return t.shape[t.rank - 1]; }

// Whether t's rows are evenly spaced with unit last stride: then row r is at data + r · ld.
inline bool evenly_spaced(const TensorView& t, int64_t* ld) {
  const int64_t W = width(t), rs = t.rank >= 2 ? t.strides[t.rank - 2] : W;
  if (t.strides[t.rank - 1] != 1 && W > 1) return false;
  if (rs < W || rs < 1) return false;
  if (t.rank == 3 && t.shape[0] > 1 && t.strides[0] != t.shape[1] * rs) return false;
  *ld = rs;
  return true;
}

// Visits every element of a rank 1-4 view in C order: f(flat index, element pointer).
template <typename F>
void for_each_element(const TensorView& t, F f) {
  const int64_t sz = dtype_size(t.dtype);
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  for (int d = 0; d < t.rank; ++d) shape[4 - t.rank + d] = t.shape[d], strides[4 - t.rank + d] = t.strides[d];
  int64_t flat = 0;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t e = 0; e < shape[3]; ++e, ++flat)
          f(flat, static_cast<char*>(t.data) +
                      (a * strides[0] + b * strides[1] + c * strides[2] + e * strides[3]) * sz);
}

// n elements of the floating-point dtype s at src, widened to T (exact), one dtype test per
// call: the loops of the 16-bit layer's conversions.
template <typename T>
void widen(DType s, const void* src, int64_t n, T* dst) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  switch (s) {
    case DType::kBFloat16: for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(bf16_to_f32(h[i])); return;
    case DType::kFloat16: for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(f16_to_f32(h[i])); return;
    default: for (int64_t i = 0; i < n; ++i) dst[i] = load_as<T>(s, static_cast<const char*>(src) + i * storage_bytes(s));
  }
}

// n values of T rounded once (to nearest even) to the floating-point dtype s at dst.
template <typename T>
void round_to(DType s, const T* src, int64_t n, void* dst) {
  uint16_t* h = static_cast<uint16_t*>(dst);
  switch (s) {
    case DType::kBFloat16: for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(static_cast<float>(src[i])); return;
    case DType::kFloat16: for (int64_t i = 0; i < n; ++i) h[i] = f32_to_f16(static_cast<float>(src[i])); return;
    default: for (int64_t i = 0; i < n; ++i) store_as<T>(s, static_cast<char*>(dst) + i * storage_bytes(s), src[i]);
  }
}

template <typename T>
InRows<T> in_rows(const TensorView& t) {
  InRows<T> m;
  int64_t ld;
  const bool even = evenly_spaced(t, &ld);
  if (t.dtype == dtype_of<T>() && even) {
    m.data = static_cast<const T*>(t.data);
    m.ld = ld;
    return m;
  }
  const int64_t W = width(t), R = W ? t.numel() / W : 0;
  m.copy.resize(static_cast<size_t>(t.numel()));
  if (even) {  // another dtype (a 16-bit layer's): widened row by row
    for (int64_t r = 0; r < R; ++r)
      widen<T>(t.dtype, static_cast<const char*>(t.data) + r * ld * storage_bytes(t.dtype), W, m.copy.data() + r * W);
  } else {
    for_each_element(t, [&](int64_t i, const void* p) { m.copy[i] = load_as<T>(t.dtype, p); });
  }
  m.data = m.copy.data();
  m.ld = W;
  return m;
}

// R rows of W elements of dtype s at data (row r at data + r · ld elements) as T: in place when
// s is T's dtype, else widened into a contiguous copy (ld W). The layer's intermediates, which
// a 16-bit layer stores in its dtype.
template <typename T>
InRows<T> rows_as(const void* data, DType s, int64_t R, int64_t W, int64_t ld) {
  TensorView t = TensorView::contiguous(const_cast<void*>(data), s, {R, W});
  t.strides[0] = ld;
  return in_rows<T>(t);
}

// An output view written as a row-major matrix: in place when possible, else into a
// contiguous buffer that finish() copies out (converting to the view's dtype).
template <typename T>
struct OutRows {
  T* data = nullptr;
  int64_t ld = 0;
  std::vector<T> buffer;
  TensorView view;

  explicit OutRows(const TensorView& t) : view(t) {
    int64_t s;
    if (t.dtype == dtype_of<T>() && evenly_spaced(t, &s)) {
      data = static_cast<T*>(t.data);
      ld = s;
    } else {
      buffer.assign(static_cast<size_t>(t.numel()), T(0));
      data = buffer.data();
      ld = width(t);
    }
  }
  // Rounds the buffer once to the view's dtype (a 16-bit layer's results), row by row where the
  // view's rows are evenly spaced.
  void finish() {
    if (buffer.empty()) return;
    int64_t s;
    const int64_t W = width(view), R = W ? view.numel() / W : 0;
    if (evenly_spaced(view, &s)) {
      for (int64_t r = 0; r < R; ++r)
        round_to<T>(view.dtype, buffer.data() + r * W, W, static_cast<char*>(view.data) + r * s * storage_bytes(view.dtype));
      return;
    }
    for_each_element(view, [&](int64_t i, void* p) { store_as<T>(view.dtype, p, buffer[i]); });
  }
};

// C = op(A) op(B) + beta C (row-major; see gemm). `blas` picks OpenBLAS; otherwise the
// reference's loop: each element the plain sum over k in order, in T.
template <typename T>
void matmul(bool blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
            int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (blas && K > 0) {
    gemm(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      T s = 0;
      for (int64_t k = 0; k < K; ++k) s += (ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
      C[i * ldc + j] = beta == T(0) ? s : s + beta * C[i * ldc + j];
    }
}

// The same as matmul with C (batches·N rows, H·D columns) stored head-major (gemm_heads).
template <typename T>
void matmul_heads(bool blas, bool ta, bool tb, int64_t batches, int64_t N, int64_t H, int64_t D, int64_t K, const T* A,
                  int64_t lda, const T* B, int64_t ldb, T* C) {
  if (blas && K > 0) {
    gemm_heads(ta, tb, batches, N, H, D, K, A, lda, B, ldb, C);
    return;
  }
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t r = b * N + i, c = h * D + d;
          T s = 0;
          for (int64_t k = 0; k < K; ++k) s += (ta ? A[k * lda + r] : A[r * lda + k]) * (tb ? B[c * ldb + k] : B[k * ldb + c]);
          C[((b * H + h) * N + i) * D + d] = s;
        }
}

// Adds bias (a view of W elements) to every row of the R × W matrix C.
template <typename T>
void add_bias(const TensorView& bias, int64_t R, int64_t W, T* C, int64_t ldc) {
  const InRows<T> b = in_rows<T>(bias);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < W; ++c) C[r * ldc + c] += b.data[c];
}

// out[c] = Σ_r A[r][c] in row order (a bias's gradient): the same sums for any thread count.
template <typename T>
void column_sums(const T* A, int64_t lda, int64_t R, int64_t W, const TensorView& out) {
  OutRows<T> o(out);
  std::vector<T> s(static_cast<size_t>(W), T(0));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < W; ++c) s[c] += A[r * lda + c];
  for (int64_t c = 0; c < W; ++c) o.data[c] = s[c];
  o.finish();
}

// RoPE (sdpa/mha.h) on H heads of D elements in each of N rows of x (row r at x + r · ld),
// row i at position pos0 + i; sign -1 applies the inverse rotation (the backward).
template <typename T>
void rope(T* x, int64_t ld, int64_t N, int64_t H, int64_t D, int64_t pos0, double base, int sign) {
  const int64_t half = D / 2;
  std::vector<T> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t i = 0; i < N; ++i) {
    const double p = static_cast<double>(pos0 + i);
    for (int64_t d = 0; d < half; ++d) {
      const double theta = p * std::pow(base, -2.0 * static_cast<double>(d) / static_cast<double>(D));
      c[d] = static_cast<T>(std::cos(theta));
      s[d] = static_cast<T>(sign * std::sin(theta));
    }
    for (int64_t h = 0; h < H; ++h) {
      T* e = x + i * ld + h * D;
      for (int64_t d = 0; d < half; ++d) {
        const T a = e[d], b = e[d + half];
        e[d] = a * c[d] - b * s[d];
        e[d + half] = b * c[d] + a * s[d];
      }
    }
  }
}

}  // namespace sdpa::internal
