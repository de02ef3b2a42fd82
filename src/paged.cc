// attention_paged: keys and values in a pool of pages (block_table). The call is validated as
// attention() on a (B, Hkv, max_pages · page_size, D) view of the pool with stride 0 over the
// batch, then the view is made paged (problem.h's View4::page_table): every row read goes
// through the table, and the kernels keep their evenly spaced runs inside a page. Packed
// queries (cu_seqlens_q) make one such problem per sequence, all run in one parallel region.
#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "kv_dequant.h"
#include "packed.h"
#include "problem.h"
#include "storage.h"

namespace sdpa {
namespace internal {
namespace {

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
  // A pool without elements (D = 0) may have null data: no offsets into it (F15), as
  // to_view4 gives any empty view stride 0.
  v.page_stride = pool.numel() == 0 ? 0 : pool.strides[0];
}

// With a pool of no pages, every sequence must have no key: else an Error naming the table
// entry its first key would be read through. (Only what can be read is read here; make_problem
// checks seqlens_k's shape and dtype afterwards.)
void check_no_keys(const PagedInputs& in, int64_t B, int64_t page_size, int64_t first_sequence) {
  const TensorView &lengths = in.seqlens_k, &table = in.block_table;
  const bool readable = lengths.rank == 1 && lengths.shape[0] == B && lengths.data != nullptr &&
                        (lengths.dtype == DType::kInt32 || lengths.dtype == DType::kInt64);
  for (int64_t b = 0; readable && b < B; ++b) {
    const int64_t L = index_at(lengths, b);
    if (L <= 0) continue;
    const std::string seq = std::to_string(first_sequence + b);
    std::string entry = "block_table[" + seq + "][0]";
    if (table.shape[1] > 0 && table.data != nullptr) {
      TensorView row = table;
      row.strides[0] = 1;
      entry += " = " + std::to_string(index_at(row, b * table.strides[0]));
    }
    fail(entry + " is not a page of k_pages (num_pages = 0); sequence " + seq + " has " + std::to_string(L) +
         " keys in pages of " + std::to_string(page_size));
  }
}

// The validated, paged problem of q (B, Hq, Nq, Dk). Messages name sequence b as
// first_sequence + b (a packed call passes one sequence at a time).
// `fused`: 8-bit pools read in place (kv_dequant.h), in's kv_quant attached to the views.
Problem paged_problem(const PagedInputs& in, const Outputs& outs, const Options& options, int64_t first_sequence,
                      const Float32Call* fused) {
  const TensorView &kp = in.k_pages, &vp = in.v_pages, &table = in.block_table;
  check_rank("q", in.q, 4, "(B, Hq, Nq, Dk)");
  check_rank("k_pages", kp, 4, "(num_pages, page_size, Hkv, Dk)");
  check_rank("v_pages", vp, 4, "(num_pages, page_size, Hkv, Dv)");
  check_rank("block_table", table, 2, "(B, max_pages)");
  const int64_t B = in.q.shape[0], num_pages = kp.shape[0], page_size = kp.shape[1];
  if (page_size < 1) fail("k_pages has shape " + kp.shape_string() + ": page_size (dim 1) must be at least 1");
  if (vp.shape[0] != num_pages || vp.shape[1] != page_size) {
    fail("v_pages has shape " + vp.shape_string() + " but k_pages has " + kp.shape_string() +
         ": they share num_pages and page_size (dims 0 and 1)");
  }
  check_index_dtype("block_table", table);
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
  dense.k = as_rows(kp, B, max_pages);
  dense.v = as_rows(vp, B, max_pages);
  if (fused) dense.k.dtype = dense.v.dtype = DType::kFloat32;  // checked as float32 views (make_fused_problem)
  dense.seqlens_k = in.seqlens_k;
  Outputs checked = outs;
  if (num_pages == 0) {
    // No pages (a pool not allocated yet, F14): valid while no sequence has a key, and then no
    // row is read; the rows views hold none either, so that their data may be null. The
    // weights, all 0, are validated as (B, Hq, Nq, 0) here and written by attention_paged.
    check_no_keys(in, B, page_size, first_sequence);
    dense.k.shape[2] = dense.v.shape[2] = 0;
    if (outs.weights) {
      const int64_t want[4] = {B, in.q.shape[1], in.q.shape[2], max_pages * page_size};
      for (int d = 0; d < 4; ++d)
        if (outs.weights->rank != 4 || outs.weights->shape[d] != want[d]) {
          fail("weights has shape " + outs.weights->shape_string() +
               " but must be (B, Hq, Nq, max_pages · page_size) = (" + std::to_string(want[0]) + ", " +
               std::to_string(want[1]) + ", " + std::to_string(want[2]) + ", " + std::to_string(want[3]) + ")");
        }
      checked.weights->shape[3] = 0;
    }
  }
  Options opts = options;
  if (num_pages == 0 && options.block_mask) {
    // The block mask counts the table's max_pages · page_size keys, as with pages; none of them
    // is read here, so the problem of no keys gets its key blocks cut to none.
    checked_block_mask(*options.block_mask, options, in.q.rank, B, in.q.shape[1], in.q.shape[2], max_pages * page_size,
                       "");
    opts.block_mask->shape[opts.block_mask->rank - 1] = 0;
  }
  Problem p = make_problem(dense, checked, opts);
  // The pages each sequence reads exist.
  check_has_data("block_table", table);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (p.keys_of(b) + page_size - 1) / page_size;
    for (int64_t j = 0; j < used; ++j) {
      TensorView entry = table;
      entry.strides[0] = 1;
      const int64_t page = index_at(entry, b * table.strides[0] + j);
      if (page < 0 || page >= num_pages) {
        const std::string seq = std::to_string(first_sequence + b);
        fail("block_table[" + seq + "][" + std::to_string(j) + "] = " + std::to_string(page) +
             " is not a page of k_pages (num_pages = " + std::to_string(num_pages) + "); sequence " + seq + " has " +
             std::to_string(p.keys_of(b)) + " keys in pages of " + std::to_string(page_size));
      }
    }
  }
  make_paged(p.k, kp, table);
  make_paged(p.v, vp, table);
  if (fused) {
    p.k.dtype = kp.dtype;
    p.v.dtype = vp.dtype;
    fused->attach(p.k, 0, in.kv_quant->k_scale, in.kv_quant->k_zero, 4, /*paged=*/true);
    fused->attach(p.v, 1, in.kv_quant->v_scale, in.kv_quant->v_zero, 4, /*paged=*/true);
  }
  return p;
}

// A (H, n, D) view as (1, H, n, D); a (H, n) one as (1, H, n).
TensorView with_batch_of_one(TensorView t) {
  for (int d = t.rank; d > 0; --d) {
    t.shape[d] = t.shape[d - 1];
    t.strides[d] = t.strides[d - 1];
  }
  t.shape[0] = 1;
  t.strides[0] = 0;
  ++t.rank;
  return t;
}

// Entry b of a (B, ...) tensor as a (1, ...) view.
TensorView entry_of(TensorView t, int64_t b) {
  if (t.shape[0] > 0 && t.data != nullptr) {
    t.data = static_cast<char*>(t.data) + b * t.strides[0] * storage_bytes(t.dtype);
  }
  t.shape[0] = 1;
  return t;
}

// Packed queries: q (total_q, Hq, Dk) cut by cu_seqlens_q, sequence b against table row b.
std::vector<Problem> packed_problems(const PagedInputs& in, const Outputs& outs, const Options& options,
                                     const Float32Call* fused) {
  check_rank("q", in.q, 3, "(total_q, Hq, Dk) with cu_seqlens_q");
  check_rank("out", outs.out, 3, "(total_q, Hq, Dv) with cu_seqlens_q");
  if (outs.weights) fail("weights are not available with cu_seqlens_q (packed queries)");
  if (any_stats(outs.stats)) fail("stats are not available with cu_seqlens_q (packed queries)");
  if (outs.lse) check_rank("lse", *outs.lse, 2, "(Hq, total_q)");
  const std::vector<int64_t> cu = read_offsets("cu_seqlens_q", *in.cu_seqlens_q, in.q.shape[0], "q");
  const int64_t B = static_cast<int64_t>(cu.size()) - 1;
  check_rank("block_table", in.block_table, 2, "(B, max_pages)");
  if (in.block_table.shape[0] != B) {
    fail("block_table has shape " + in.block_table.shape_string() + " but cu_seqlens_q holds " + std::to_string(B) +
         " sequences");
  }
  if (in.seqlens_k.rank != 1 || in.seqlens_k.shape[0] != B) {
    fail("seqlens_k has shape " + in.seqlens_k.shape_string() + " but must be (B,) = (" + std::to_string(B) +
         ",): cu_seqlens_q holds " + std::to_string(B) + " sequences");
  }
  if (outs.out.shape[0] != in.q.shape[0] || outs.out.shape[1] != in.q.shape[1]) {
    fail("out has shape " + outs.out.shape_string() + " but q has " + in.q.shape_string() +
         ": out is (total_q, Hq, Dv)");
  }
  if (outs.lse) check_packed_lse(*outs.lse, in.q);
  // The options checked against all sequences, with no sequence too (fuzz finding F19). Each
  // sequence's keys are the max_pages · page_size rows of its block-table row.
  check_rank("k_pages", in.k_pages, 4, "(num_pages, page_size, Hkv, Dk)");
  const int64_t max_pages = in.block_table.shape[1], page_size = std::max<int64_t>(in.k_pages.shape[1], 1);
  const int64_t nk = max_pages > std::numeric_limits<int64_t>::max() / page_size ? std::numeric_limits<int64_t>::max()
                                                                                 : max_pages * page_size;
  packed_options(options, B, in.q.shape[1], longest_sequence(cu), nk);
  std::vector<Problem> problems;
  problems.reserve(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {  // every sequence valid before any is computed
    PagedInputs s = in;
    s.cu_seqlens_q.reset();
    s.q = with_batch_of_one(rows_of(in.q, cu[b], cu[b + 1]));
    s.block_table = entry_of(in.block_table, b);
    s.seqlens_k = entry_of(in.seqlens_k, b);
    Outputs o;
    o.out = with_batch_of_one(rows_of(outs.out, cu[b], cu[b + 1]));
    if (outs.lse) o.lse = with_batch_of_one(cols_of(*outs.lse, cu[b], cu[b + 1]));
    problems.push_back(paged_problem(s, o, sequence_options(options, b, cu[b + 1] - cu[b], nk), b, fused));
    problems.back().dropout.batch_offset = b;
  }
  return problems;
}

// The pages of k_pages a call reads: those its block-table rows name for each sequence's keys
// (none when the table or seqlens_k is not readable, or an entry is not a page: paged_problem
// then reports it).
std::vector<bool> pages_read(const PagedInputs& in) {
  const TensorView &table = in.block_table, &lengths = in.seqlens_k;
  std::vector<bool> read(static_cast<size_t>(std::max<int64_t>(in.k_pages.shape[0], 0)), false);
  const int64_t page_size = in.k_pages.rank == 4 ? in.k_pages.shape[1] : 0;
  const bool readable = table.rank == 2 && table.data != nullptr && lengths.rank == 1 && lengths.data != nullptr &&
                        lengths.shape[0] == table.shape[0] && page_size > 0 &&
                        (table.dtype == DType::kInt32 || table.dtype == DType::kInt64) &&
                        (lengths.dtype == DType::kInt32 || lengths.dtype == DType::kInt64);
  for (int64_t b = 0; readable && b < table.shape[0]; ++b) {
    const int64_t used = std::min((std::max<int64_t>(index_at(lengths, b), 0) + page_size - 1) / page_size, table.shape[1]);
    for (int64_t j = 0; j < used; ++j) {
      TensorView entry = table;
      entry.strides[0] = 1;
      const int64_t page = index_at(entry, b * table.strides[0] + j * table.strides[1]);
      if (page >= 0 && page < static_cast<int64_t>(read.size())) read[static_cast<size_t>(page)] = true;
    }
  }
  return read;
}

void run_paged(const PagedInputs& in, const Outputs& outs, const Options& options, const Float32Call* fused) {
  if (in.cu_seqlens_q) {
    run_forward_many(packed_problems(in, outs, options, fused), options.backend);
    return;
  }
  run_forward(paged_problem(in, outs, options, 0, fused), options.backend);
  if (in.k_pages.shape[0] == 0 && outs.weights) {  // no pages: every weight is 0 (see paged_problem)
    const TensorView& w = *outs.weights;
    for (int64_t i = 0; i < w.numel(); ++i) {
      int64_t at = 0, rest = i;
      for (int d = w.rank - 1; d >= 0; --d) {
        at += rest % w.shape[d] * w.strides[d];
        rest /= w.shape[d];
      }
      store_as(w.dtype, static_cast<char*>(w.data) + at * storage_bytes(w.dtype), 0.0);
    }
  }
}

}  // namespace
}  // namespace internal

void attention_paged(const PagedInputs& given, const Outputs& outs_given, const Options& options) {
  internal::check_no_positions(options, "attention_paged");
  if (outs_given.scores) internal::fail("scores are not available with attention_paged (attention() on the gathered keys has them)");
  // 8-bit pools: the float32 call standing in for this one (kv_dequant.h), the pages read
  // dequantised.
  PagedInputs in = given;
  Outputs outs = outs_given;
  internal::Float32Call f32;
  bool dequantised = false;
  if (in.k_pages.rank == 4) {
    const std::vector<bool> read = internal::is_8bit_dtype(in.k_pages.dtype) ? internal::pages_read(in) : std::vector<bool>{};
    dequantised = f32.prepare(in.q, in.k_pages, in.v_pages, in.kv_quant, nullptr, outs.out, "k_pages", "v_pages",
                              [&read](const int64_t* lead) { return read[static_cast<size_t>(lead[0])]; },
                              /*fusable=*/true);
  } else if (in.kv_quant || internal::is_8bit_dtype(in.k_pages.dtype)) {
    internal::check_rank("k_pages", in.k_pages, 4, "(num_pages, page_size, Hkv, Dk)");
  }
  internal::run_paged(in, outs, options, dequantised && f32.fused() ? &f32 : nullptr);
  if (dequantised) f32.finish();
}

}  // namespace sdpa
