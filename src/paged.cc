// attention_paged: keys and values in a pool of pages (block_table). The call is validated as
// attention() on a (B, Hkv, max_pages · page_size, D) view of the pool with stride 0 over the
// batch, then the view is made paged (problem.h's View4::page_table): every row read goes
// through the table, and the kernels keep their evenly spaced runs inside a page.
#include <limits>
#include <string>

#include "problem.h"
#include "storage.h"

namespace sdpa {
namespace internal {
namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

void check_rank(const char* name, const TensorView& t, int rank, const char* shape) {
  if (t.rank != rank) fail(std::string(name) + " has shape " + t.shape_string() + " but must be " + shape);
}

// The pool (num_pages, page_size, H, D) as the (B, H, max_pages · page_size, D) view that
// make_problem validates: batch stride 0, rows page_size apart within a page.
TensorView as_rows(const TensorView& pool, int64_t B, int64_t max_pages) {
  TensorView v = pool;
  v.shape[0] = B;
  v.shape[1] = pool.shape[2];
  v.shape[2] = max_pages * pool.shape[1];
  v.shape[3] = pool.shape[3];
  v.strides[0] = 0;
  v.strides[1] = pool.strides[2];
  v.strides[2] = pool.strides[1];
  v.strides[3] = pool.strides[3];
  return v;
}

void make_paged(View4& v, const TensorView& pool, const TensorView& table) {
  v.page_table = table.data;
  v.page_table_64 = table.dtype == DType::kInt64;
  v.page_table_stride = table.strides[0];
  v.page_rows = pool.shape[1];
  v.page_stride = pool.strides[0];
}

}  // namespace
}  // namespace internal

void attention_paged(const PagedInputs& in, const Outputs& outs, const Options& options) {
  using internal::fail;
  const TensorView &kp = in.k_pages, &vp = in.v_pages, &table = in.block_table;
  internal::check_rank("q", in.q, 4, "(B, Hq, Nq, Dk)");
  internal::check_rank("k_pages", kp, 4, "(num_pages, page_size, Hkv, Dk)");
  internal::check_rank("v_pages", vp, 4, "(num_pages, page_size, Hkv, Dv)");
  internal::check_rank("block_table", table, 2, "(B, max_pages)");
  const int64_t B = in.q.shape[0], num_pages = kp.shape[0], page_size = kp.shape[1];
  if (page_size < 1) fail("k_pages has shape " + kp.shape_string() + ": page_size (dim 1) must be at least 1");
  if (vp.shape[0] != num_pages || vp.shape[1] != page_size) {
    fail("v_pages has shape " + vp.shape_string() + " but k_pages has " + kp.shape_string() +
         ": they share num_pages and page_size (dims 0 and 1)");
  }
  if (table.dtype != DType::kInt32 && table.dtype != DType::kInt64) {
    fail(std::string("block_table has dtype ") + dtype_name(table.dtype) + " but must be int32 or int64");
  }
  if (table.shape[0] != B) {
    fail("block_table has shape " + table.shape_string() + " but q has batch " + std::to_string(B) + " (q " +
         in.q.shape_string() + ")");
  }
  const int64_t max_pages = table.shape[1];
  if (max_pages > 1 && table.strides[1] != 1) {
    fail("block_table has strides (" + std::to_string(table.strides[0]) + ", " + std::to_string(table.strides[1]) +
         ") but its last stride must be 1");
  }
  if (max_pages > std::numeric_limits<int64_t>::max() / page_size) {
    fail("block_table has shape " + table.shape_string() + ": max_pages · page_size overflows");
  }
  // The pools' own shapes, named as the caller knows them (make_problem below would name the
  // row views k and v).
  if (kp.shape[3] != in.q.shape[3]) {
    fail("k_pages has Dk=" + std::to_string(kp.shape[3]) + " but q has Dk=" + std::to_string(in.q.shape[3]) + " (q " +
         in.q.shape_string() + ", k_pages " + kp.shape_string() + ")");
  }
  if (vp.shape[2] != kp.shape[2]) {
    fail("v_pages has " + std::to_string(vp.shape[2]) + " heads but k_pages has " + std::to_string(kp.shape[2]) +
         " (k_pages " + kp.shape_string() + ", v_pages " + vp.shape_string() + ")");
  }
  if (vp.dtype != kp.dtype) {
    fail(std::string("v_pages has dtype ") + dtype_name(vp.dtype) + " but k_pages has dtype " + dtype_name(kp.dtype));
  }
  Inputs dense;
  dense.q = in.q;
  dense.k = internal::as_rows(kp, B, max_pages);
  dense.v = internal::as_rows(vp, B, max_pages);
  dense.seqlens_k = in.seqlens_k;
  internal::Problem p = internal::make_problem(dense, outs, options);
  // The pages each sequence reads exist.
  if (B > 0 && max_pages > 0 && table.data == nullptr) fail("block_table has no data but shape " + table.shape_string());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (p.keys_of(b) + page_size - 1) / page_size;
    for (int64_t j = 0; j < used; ++j) {
      TensorView entry = table;
      entry.strides[0] = 1;
      const int64_t page = internal::index_at(entry, b * table.strides[0] + j);
      if (page < 0 || page >= num_pages) {
        fail("block_table[" + std::to_string(b) + "][" + std::to_string(j) + "] = " + std::to_string(page) +
             " is not a page of k_pages (num_pages = " + std::to_string(num_pages) + "); sequence " +
             std::to_string(b) + " has " + std::to_string(p.keys_of(b)) + " keys in pages of " +
             std::to_string(page_size));
      }
    }
  }
  internal::make_paged(p.k, kp, table);
  internal::make_paged(p.v, vp, table);
  internal::run_forward(p, options.backend);
}

}  // namespace sdpa
