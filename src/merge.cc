// merge_attention (include/sdpa/merge.h): a k-way merge of partial attention results by their
// log-sum-exp. A plain loop per row (the work is a few reads per element: memory bound), rows
// split among the kernels' threads; each row's arithmetic is fixed, so any thread count gives
// the same bits.
#include "sdpa/merge.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "checks.h"
#include "storage.h"

namespace sdpa {
namespace {

using internal::fail;

// A tensor's rows: (lead dims, padded on the left to 3) x last dim (out's Dv; 1 for lse).
struct RowView {
  const char* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t bytes = 0;
  int64_t shape[3] = {1, 1, 1};
  int64_t strides[3] = {0, 0, 0};
  int64_t last_stride = 0;

  RowView(const TensorView& t, int lead) : data(static_cast<const char*>(t.data)), dtype(t.dtype) {
    bytes = internal::storage_bytes(t.dtype);
    for (int d = 0; d < lead; ++d) {
      shape[3 - lead + d] = t.shape[d];
      strides[3 - lead + d] = t.strides[d];
    }
    last_stride = lead < t.rank ? t.strides[lead] : 0;
  }
  // Row r in C order over the lead dims (null for a view without data, e.g. out with Dv = 0,
  // whose rows are never read: no offset is applied to a null pointer).
  const char* row(int64_t r) const {
    if (data == nullptr) return nullptr;
    const int64_t c = r % shape[2], b = r / shape[2] % shape[1], a = r / shape[2] / shape[1];
    return data + (a * strides[0] + b * strides[1] + c * strides[2]) * bytes;
  }
  template <typename T>
  T load(const char* row, int64_t e) const {
    return internal::load_as<T>(dtype, row + e * last_stride * bytes);
  }
  template <typename T>
  void store(const char* row, int64_t e, T x) const {
    internal::store_as(dtype, const_cast<char*>(row + e * last_stride * bytes), x);
  }
};

bool is_lse_dtype(DType t) { return t == DType::kFloat32 || t == DType::kFloat64; }

// The index of row r of lse (shape `lead`, rank `rank`), as the errors print it.
std::string row_index(int64_t r, const TensorView& lse) {
  TensorView at;
  at.rank = lse.rank;
  for (int d = lse.rank - 1; d >= 0; --d) {
    at.shape[d] = r % lse.shape[d];
    r /= lse.shape[d];
  }
  return at.shape_string();
}

void check_tensor(const std::string& name, const TensorView& t, const TensorView& like, const char* like_name,
                  bool is_lse) {
  if (t.rank != like.rank) {  // before check_basic, whose rank message would not show like's shape
    fail(name + " has shape " + t.shape_string() + " (rank " + std::to_string(t.rank) + ") but " + like_name +
         " has shape " + like.shape_string() + " (rank " + std::to_string(like.rank) + ")");
  }
  internal::check_basic(name.c_str(), t, like.rank, like.rank);
  bool same = true;
  for (int d = 0; d < t.rank; ++d) same = same && t.shape[d] == like.shape[d];
  if (!same) fail(name + " has shape " + t.shape_string() + " but " + like_name + " has shape " + like.shape_string());
  if (is_lse ? !is_lse_dtype(t.dtype) : !internal::is_float_dtype(t.dtype)) {
    fail(name + " has dtype " + dtype_name(t.dtype) + " but must be " +
         (is_lse ? std::string("float32 or float64") : internal::storage_dtype_list()));
  }
}

template <typename T>
void merge_rows(std::span<const Partial> parts, const TensorView& out, const TensorView& lse) {
  const int lead = lse.rank;
  const int64_t rows = lse.numel(), Dv = out.shape[out.rank - 1];
  const RowView o(out, lead), l(lse, lead);
  std::vector<RowView> po, pl;
  for (const Partial& part : parts) {
    po.emplace_back(part.out, lead);
    pl.emplace_back(part.lse, lead);
  }
  const int64_t k = static_cast<int64_t>(parts.size());
  // Threads only where each gets a few thousand elements to read (OpenMP's start costs ~µs).
  const int64_t work = rows * (k + 1) * std::max<int64_t>(Dv, 1);
  const int threads = static_cast<int>(std::clamp<int64_t>(work / 32768, 1, num_threads()));
  const T neg_inf = -std::numeric_limits<T>::infinity();
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> w(static_cast<size_t>(k));
    std::vector<const char*> rows_s(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T m = neg_inf;
      for (int64_t s = 0; s < k; ++s) {
        w[s] = pl[s].load<T>(pl[s].row(r), 0);  // lse_s for now; finite or -inf (checked)
        m = std::max(m, w[s]);
      }
      const char* out_row = o.row(r);
      if (m == neg_inf) {  // no part has a key: the empty row
        for (int64_t e = 0; e < Dv; ++e) o.store(out_row, e, T(0));
        l.store(l.row(r), 0, neg_inf);
        continue;
      }
      T sum = 0;
      for (int64_t s = 0; s < k; ++s) {
        w[s] = w[s] == neg_inf ? T(0) : std::exp(w[s] - m);
        sum += w[s];
        rows_s[s] = po[s].row(r);
      }
      for (int64_t e = 0; e < Dv; ++e) {
        T acc = 0;
        for (int64_t s = 0; s < k; ++s)
          if (w[s] != T(0)) acc += w[s] * po[s].load<T>(rows_s[s], e);  // weight 0: not read
        o.store(out_row, e, acc / sum);
      }
      l.store(l.row(r), 0, m + std::log(sum));
    }
  }
}

}  // namespace

void merge_attention(std::span<const Partial> parts, const TensorView& out, const TensorView& lse) {
  if (parts.empty()) fail("merge_attention: parts is empty; there is nothing to merge");
  internal::check_basic("out", out, 2, 4);
  TensorView lead = out;  // out's shape without its last dim: what every lse must be
  lead.rank = out.rank - 1;
  check_tensor("out", out, out, "out", false);
  check_tensor("lse", lse, lead, "out without its last dim", true);
  internal::check_no_zero_stride("out", out);
  internal::check_no_zero_stride("lse", lse);
  bool f64 = out.dtype == DType::kFloat64 || lse.dtype == DType::kFloat64;
  for (size_t s = 0; s < parts.size(); ++s) {
    const std::string name = "parts[" + std::to_string(s) + "]";
    check_tensor(name + ".out", parts[s].out, out, "out", false);
    check_tensor(name + ".lse", parts[s].lse, lead, "out without its last dim", true);
    f64 = f64 || parts[s].out.dtype == DType::kFloat64 || parts[s].lse.dtype == DType::kFloat64;
  }
  // +inf or NaN lse: refused before anything is written (each stored element read once here).
  const int64_t rows = lse.numel();
  for (size_t s = 0; s < parts.size(); ++s) {
    const RowView l(parts[s].lse, lse.rank);
    for (int64_t r = 0; r < rows; ++r) {
      const double x = l.load<double>(l.row(r), 0);
      if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) {
        fail("parts[" + std::to_string(s) + "].lse has " + (std::isnan(x) ? "NaN" : "+inf") + " at index " +
             row_index(r, lse) + ": a part whose scores " + (std::isnan(x) ? "held NaN" : "overflowed") +
             " has no weight to merge by");
      }
    }
  }
  if (f64) {
    merge_rows<double>(parts, out, lse);
  } else {
    merge_rows<float>(parts, out, lse);
  }
}

}  // namespace sdpa
