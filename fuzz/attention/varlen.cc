// attention_fuzz: attention_varlen (ext bit 5).
#include "harness.h"

namespace sdpa_fuzz {

// ---- attention_varlen / attention_varlen_backward (ext bit 5) ----

// Rows [r0, r1) of a packed (total, H, D) tensor as a contiguous (H, n, D) copy, or, for `at` > 0,
// as batch entry `at` of a contiguous (at + 1, H, n, D) tensor whose earlier entries are 0 (a
// dense call in which the sequence draws dropout as batch entry `at`, as the header promises).
Tensor dense_rows(const Tensor& t, int64_t r0, int64_t r1, int64_t at) {
  const int64_t H = t.shape()[1], D = t.shape()[2], n = r1 - r0;
  const std::vector<int64_t> shape = at == 0 ? std::vector<int64_t>{H, n, D} : std::vector<int64_t>{at + 1, H, n, D};
  Tensor r(t.dtype(), shape, Role::kUnitLast, true, LayoutSpec::plain());
  const int64_t base = at * H * n * D;
  for (int64_t x = 0; x < base; ++x) r.set_flat(x, 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < D; ++e) r.set_flat(base + (h * n + i) * D + e, t.flat(((r0 + i) * H + h) * D + e));
  return r;
}

// Packed rows [r0, r1) of `packed` (total, H, D) against the dense (.., H, n, D) tensor (batch entry
// `at`): "" when bitwise equal (NaN matches NaN).
std::string rows_bitwise(const char* name, const Tensor& packed, int64_t r0, const Tensor& dense, int64_t at) {
  const int64_t H = packed.shape()[1], D = packed.shape()[2];
  const int64_t n = dense.shape()[dense.rank() - 2], base = at * H * n * D;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < D; ++e) {
        const double a = packed.flat(((r0 + i) * H + h) * D + e), b = dense.flat(base + (h * n + i) * D + e);
        if (!(same_bits(a, b) || (std::isnan(a) && std::isnan(b))))
          return std::string(name) + " packed row " + std::to_string(r0 + i) + " head " + std::to_string(h) + " col " + std::to_string(e) +
                 " = " + num(a) + " but the dense call on the sequence's rows gives " + num(b);
      }
  return "";
}

enum class VarBad : uint8_t {
  kNone, kFirstNonzero, kDecreasing, kLastShort, kLastLong, kCuDtype, kCuRank, kCountMismatch, kCuEmpty, kCuNull,
  kNegative, kOutShape, kLseShape, kKDtype, kQRank,
  // backward only
  kDqRows, kDoutShape, kDvDtype, kCount
};
const char* const kVarBadNames[] = {"none", "cu_seqlens_q[0] != 0", "cu_seqlens_k decreasing", "cu_seqlens_q last < total_q",
                                    "cu_seqlens_k last > total_k", "cu_seqlens dtype", "cu_seqlens rank 2", "B + 1 differs between q and k",
                                    "cu_seqlens_q shape (0,)", "cu_seqlens_k null", "cu_seqlens_q negative entry", "out shape", "lse shape",
                                    "k dtype", "q rank 2", "dq rows (backward)", "dout shape (backward)", "dv dtype (backward)"};
static_assert(sizeof(kVarBadNames) / sizeof(kVarBadNames[0]) == static_cast<size_t>(VarBad::kCount));

// ---- Block masks on packed sequences (kExtBlocks, BadBlocks::kVarlen) ----

// Rows [r0, r1) of a packed (total, H, D) tensor as a (H, n, D) view of its buffer (no copy; as
// the header cuts a sequence), or for `batch` > 0 a (batch, H, n, D) view of batch stride 0 (every
// entry those rows: a dense call in which the sequence can stand at batch entry batch - 1). A view
// without elements keeps the tensor's pointer (its data may be null).
sdpa::TensorView packed_rows_view(const Tensor& t, int64_t r0, int64_t r1, int64_t batch = 0) {
  const sdpa::TensorView p = t.view();
  sdpa::TensorView v = p;
  v.rank = 3;
  v.shape[0] = p.shape[1];
  v.shape[1] = r1 - r0;
  v.shape[2] = p.shape[2];
  v.strides[0] = p.strides[1];
  v.strides[1] = p.strides[0];
  v.strides[2] = p.strides[2];
  if (v.shape[0] > 0 && v.shape[1] > 0 && v.shape[2] > 0) v.data = static_cast<std::byte*>(p.data) + r0 * p.strides[0] * esize(t.dtype());
  if (batch > 0) {
    for (int d = 3; d > 0; --d) v.shape[d] = v.shape[d - 1], v.strides[d] = v.strides[d - 1];
    v.rank = 4;
    v.shape[0] = batch;
    v.strides[0] = 0;
  }
  return v;
}

int64_t view_numel(const sdpa::TensorView& t) {
  int64_t n = 1;
  for (int d = 0; d < t.rank; ++d) n *= t.shape[d];
  return n;
}

// Sequence b's block mask as the header reads it (Options::block_mask, packed sequences): of a
// rank-4 (S or 1, Hq or 1, QB, KB) mask its row b (its first dim dropped), of any mask the top-left
// (qb, kb) blocks, same strides: a view of the caller's mask.
sdpa::TensorView corner_view(const sdpa::TensorView& m, int64_t b, int64_t qb, int64_t kb) {
  sdpa::TensorView t = m;
  if (t.rank == 4) {
    if (t.shape[0] != 1 && t.data != nullptr && view_numel(t) > 0) t.data = static_cast<std::byte*>(t.data) + b * t.strides[0];
    for (int d = 1; d < 4; ++d) t.shape[d - 1] = t.shape[d], t.strides[d - 1] = t.strides[d];
    t.rank = 3;
  }
  t.shape[t.rank - 2] = qb;
  t.shape[t.rank - 1] = kb;
  return t;
}

// The same corner as a copy in its own layout (any but a stride-0 dim, which would alias its
// elements), read element by element (Tensor::at4: the mask's dims right-aligned to (b, h, qb, kb),
// extent-1 dims broadcast).
Tensor corner_copy(const Tensor& m, int64_t b, int64_t qb, int64_t kb, LayoutSpec ls) {
  ls.zero = 0;
  std::vector<int64_t> shape = m.shape();
  if (shape.size() == 4) shape.erase(shape.begin());
  shape[shape.size() - 2] = qb;
  shape[shape.size() - 1] = kb;
  Tensor t(DType::kBool, shape, Role::kAny, true, ls);
  for (int64_t n = 0; n < t.numel(); ++n) {
    const int64_t j = n % kb, i = (n / kb) % qb, h = n / (kb * qb);
    t.set_flat(n, m.at4(b, h, i, j) != 0 ? 1.0 : 0.0);
  }
  return t;
}

// `m` (.., QB, KB) widened to (.., QB, kb) columns (kb >= KB): the new columns random (a layout
// without stride-0 dims, so that the first KB columns are m's).
Tensor widened_mask(const Tensor& m, int64_t kb, std::mt19937_64& rng, LayoutSpec ls) {
  ls.zero = 0;
  std::vector<int64_t> shape = m.shape();
  const int64_t KB = shape.back();
  shape.back() = kb;
  Tensor t(DType::kBool, shape, Role::kAny, true, ls);
  for (int64_t n = 0; n < t.numel(); ++n) {
    const int64_t j = n % kb, row = n / kb;
    t.set_flat(n, j < KB ? (m.flat(row * KB + j) != 0 ? 1.0 : 0.0) : static_cast<double>(rng() % 2));
  }
  return t;
}

// What makes a packed call's block mask invalid (vb bits 2-4, BadBlocks::kVarlen inputs).
enum class PackedBad : uint8_t { kQB, kKB, kLead, kDtype, kRank, kTotals, kNull, kOther, kCount };
const char* const kPackedBadNames[] = {"QB ± 1", "KB ± 1", "a leading dim neither 1 nor S / Hq", "dtype not bool",
                                       "rank 0 or 1", "QB, KB of the packed totals (ceil(total / block))", "null data",
                                       "the other call's KB (varlen: max Nk_b; paged: max_pages · page_size)"};
static_assert(sizeof(kPackedBadNames) / sizeof(kPackedBadNames[0]) == static_cast<size_t>(PackedBad::kCount));

// An invalid block mask for a packed call whose valid mask is `good` ((.., QB, KB); S sequences,
// Hq heads); `tot` the (QB, KB) of the packed totals, `other` the other call's valid mask. A kind
// that would not break this call (the totals' or the other call's shape equal to this one's, an
// empty mask for null data) is QB ± 1 instead. `made` holds the tensor behind the view.
sdpa::TensorView broken_packed_mask(PackedBad kind, const Tensor& good, const Tensor& other, int64_t S, int64_t Hq,
                                    const std::array<int64_t, 2>& tot, std::mt19937_64& rng, std::optional<Tensor>& made,
                                    std::string& how) {
  std::vector<int64_t> shape = good.shape();
  const size_t r = shape.size();
  const auto bool_tensor = [&](std::vector<int64_t> sh) -> sdpa::TensorView {
    made.emplace(DType::kBool, std::move(sh), Role::kAny, true, block_layout(rng));
    for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, rng() % 2 ? 1.0 : 0.0);
    return made->view();
  };
  if (kind == PackedBad::kTotals && shape[r - 2] == tot[0] && shape[r - 1] == tot[1]) kind = PackedBad::kQB;
  if (kind == PackedBad::kOther && other.shape() == shape) kind = PackedBad::kQB;
  if (kind == PackedBad::kNull && good.numel() == 0) kind = PackedBad::kQB;
  how = kPackedBadNames[static_cast<int>(kind)];
  switch (kind) {
    case PackedBad::kQB:
    case PackedBad::kKB: {
      int64_t& n = shape[r - (kind == PackedBad::kQB ? 2 : 1)];
      n = n > 0 && rng() % 2 ? n - 1 : n + 1;
      return bool_tensor(shape);
    }
    case PackedBad::kLead: {
      // (S, Hq)'s dim + 1 (+ 2 where that is 1); a rank-2 mask gets a leading dim S (per
      // sequence, as rank 3: read as heads), or Hq + 1 where S is 1 or Hq.
      const auto wrong = [](int64_t full) { return full + 1 == 1 ? int64_t{2} : full + 1; };
      if (r == 4) {
        const size_t x = rng() % 2;
        shape[x] = wrong(x == 0 ? S : Hq);
      } else if (r == 3) {
        shape[0] = wrong(Hq);
      } else {
        shape.insert(shape.begin(), S != 1 && S != Hq ? S : wrong(Hq));
      }
      return bool_tensor(shape);
    }
    case PackedBad::kDtype: {
      made.emplace(DType::kFloat64, shape, Role::kAny, true, LayoutSpec::plain());  // room for any dtype's view
      for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, 1.0);
      sdpa::TensorView v = made->view();
      static const DType kBad[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64};
      v.dtype = kBad[rng() % 6];
      return v;
    }
    case PackedBad::kRank: {  // rank 0 or 1 (a TensorView holds at most rank 4, which is valid)
      if (rng() % 2) return bool_tensor({shape.back()});
      sdpa::TensorView v = bool_tensor({1});
      v.rank = 0;
      return v;
    }
    case PackedBad::kTotals:
      shape[r - 2] = tot[0];
      shape[r - 1] = tot[1];
      return bool_tensor(shape);
    case PackedBad::kNull: {
      sdpa::TensorView v = good.view();
      v.data = nullptr;
      return v;
    }
    default:
      return other.view();
  }
}

// BadBlocks::kVarlen (kExtBlocks, bm_seed 0xe7 / 0xef / 0xf7 / 0xff): the attention_varlen call
// run_varlen decoded (c, in: S = nq.size() sequences) with Options::block_mask, and the same
// sequences as a packed attention_paged call (cu_seqlens_q; a pool of one-row pages over the
// packed k, v, page r = packed key row r; an int32 table (S, max Nk_b + extra) whose row b lists
// sequence b's rows, -1 after them; seqlens_k = Nk_b). Two more bytes from the input: `vb` and a
// 32-bit seed (with bm, bm_seed: the mask's PRNG). bm bits 0-5 pick block_q / block_k, the density
// and the leading dims as for a dense call (make_block_mask, with Nq = max_b Nq_b, Nk = max_b Nk_b,
// (B, Hq) = (S, Hq)); vb bits 0-1 == 3: an invalid mask (bits 2-4: PackedBad), else a valid one;
// bit 5: rank 3 instead of 4 for the leading-dim kinds that have a batch dim ((1, QB, KB), (Hq | 1,
// QB, KB)); bit 6: the single-sequence calls get a copy of the corner instead of a view; bit 7: the
// block table has 1-130 more columns than the longest sequence needs (never read), so the paged
// call's KB = ceil(max_pages · page_size / block_k) exceeds varlen's.
//   valid:   attention_varlen (and attention_varlen_backward with c.backward) and the packed
//            attention_paged must not throw: unexpected_error, guards, unwritten, kernel_path,
//            repeatable (threads 1 and 2), lse_inf_backward; and
//            varlen_blocks_equiv  sequence b's out, lse (dq, dk, dv) bit for bit (NaN = NaN) those
//                                 of attention() (attention_backward()) on views of its rows of the
//                                 packed q, k, v (dout, and the single call's out and lse) with the
//                                 corner (ceil(Nq_b / block_q), ceil(Nk_b / block_k)) of its row of
//                                 the mask and the same options; with dropout the forward as batch
//                                 entry b of a (b + 1, ..) call whose batch has stride 0 (the draws
//                                 the header promises), the backward for b = 0 only (varlen_dense's
//                                 rule)
//            paged_blocks_equiv   sequence b's out, lse bit for bit those of an unpacked
//                                 attention_paged call with q = its rows as (1, Hq, Nq_b, Dk) (a view),
//                                 table row b, seqlens_k {Nk_b} and the corner (ceil(Nq_b / block_q),
//                                 ceil(max_pages · page_size / block_k)) (the header's "each
//                                 sequence is bit for bit the call with q = its rows"); with
//                                 dropout batch entry b of a (b + 1, ..) call over table rows 0..b
//                                 (q's batch stride 0)
//   invalid: (PackedBad: QB or KB ± 1, a leading dim neither 1 nor S / Hq, dtype, rank 0 or 1, the
//            totals' blocks, null data, the other call's KB) attention_varlen,
//            attention_varlen_backward (given a valid forward's out and lse) and the packed
//            attention_paged each throw an sdpa::Error that writes nothing (error_expected,
//            error_untouched) and names block_mask, and for a shape that does not broadcast "the
//            longest sequence's" lengths (error_names). With no sequence QB = KB = 0 for varlen,
//            KB = ceil(max_pages / block_k) for paged (F19: that call validates the mask too).
void run_varlen_blocks(FuzzedDataProvider& f, Case& c, const sdpa::VarlenInputs& in, const std::vector<int64_t>& nq,
                       const std::vector<int64_t>& nk, const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k,
                       const IndexTensor& cuq, const Tensor& dout, const std::string& described) {
  const Dims& d = c.d;
  const sdpa::Options& o = c.opt;
  const DType ct = c.compute();
  const int64_t S = static_cast<int64_t>(nq.size());
  const uint8_t vb = f.ConsumeIntegral<uint8_t>();
  const uint32_t vb_seed = f.ConsumeIntegral<uint32_t>();
  std::mt19937_64 br(0xb10c7a51ull * (g_bm_seed + 1u) + g_bm + (uint64_t{vb_seed} << 16));
  int64_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b < S; ++b) {
    max_q = std::max(max_q, nq[static_cast<size_t>(b)]);
    max_k = std::max(max_k, nk[static_cast<size_t>(b)]);
  }
  const int64_t extra = vb & 128 ? 1 + static_cast<int64_t>(br() % 130) : 0;
  const int64_t maxp = max_k + extra;  // the block table's columns (pages of one row)
  // The varlen mask (at most 2^20 elements: sizes double until it fits).
  const std::shared_ptr<BlockMask> bl =
      make_block_mask(br, g_bm & 3, (g_bm >> 2) & 3, (g_bm >> 4) & 3, vb & 32 ? 3 : 4, S, d.Hq, max_q, max_k, int64_t{1} << 20);
  const int64_t bq = bl->bq, bk = bl->bk;
  const int64_t QB = ceil_div(max_q, bq), KB = ceil_div(max_k, bk), KBp = ceil_div(maxp, bk);
  // The paged call's mask: the same blocks, widened to its KB (columns of keys no sequence has).
  std::optional<Tensor> pm_own;
  if (KBp != KB) pm_own.emplace(widened_mask(bl->mask, KBp, br, block_layout(br)));
  const Tensor& pm = pm_own ? *pm_own : bl->mask;
  const bool invalid = (vb & 3) == 3;
  const bool copy_corner = vb & 64;
  sdpa::Options bo = o, po = o;
  bo.block_mask = bl->mask.view();
  po.block_mask = pm.view();
  bo.block_q = po.block_q = bq;
  bo.block_k = po.block_k = bk;

  std::string desc = described + "with a block mask on the packed sequences (" + bl->how + "; " +
                     (invalid ? "invalid" : "valid") + (copy_corner ? ", corners copied" : ", corners as views") +
                     "): block_q=" + std::to_string(bq) + " block_k=" + std::to_string(bk) + ", QB = ceil(" + std::to_string(max_q) +
                     " / block_q) = " + std::to_string(QB) + ", KB = ceil(" + std::to_string(max_k) + " / block_k) = " +
                     std::to_string(KB) + "; " + bl->mask.describe("block_mask") + "\n";
  desc += "packed attention_paged: table (" + std::to_string(S) + ", " + std::to_string(maxp) + ") (" + std::to_string(extra) +
          " columns past the longest sequence), pages of 1 row, KB = " + std::to_string(KBp) +
          (pm_own ? "; " + pm_own->describe("its block_mask (widened)") : std::string("; the same block_mask")) + "\n";
  g_case = desc;
  if (g_print) std::fprintf(stderr, "attention_fuzz: varlen case with a block mask (vb 0x%02x, seed 0x%08x; %zu input bytes left after them)\n%s", vb, vb_seed, f.remaining_bytes(), g_case.c_str());

  sdpa::set_num_threads(c.threads);
  const auto make_vouts = [&](bool fancy) {
    Outs r;
    r.out.init(c.dtype, {d.Nq, d.Hq, d.Dv}, Role::kUnitLast, false, fancy ? c.out_ls : LayoutSpec::plain());
    if (c.want_lse) r.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, fancy ? c.l_ls : LayoutSpec::plain());
    return r;
  };
  const auto vouts = [](const Outs& r) {
    sdpa::VarlenOutputs v;
    v.out = r.out.view();
    if (r.lse) v.lse = r.lse->view();
    return v;
  };
  const auto pouts = [](const Outs& r) {
    sdpa::Outputs v;
    v.out = r.out.view();
    if (r.lse) v.lse = r.lse->view();
    return v;
  };
  const auto make_vgrads = [&](const LayoutSpec& ls) {
    return Grads{Tensor(c.dtype, {d.Nq, d.Hq, d.Dk}, Role::kUnitLast, false, ls), Tensor(c.kv, {d.Nk, d.Hkv, d.Dk}, Role::kUnitLast, false, ls),
                 Tensor(c.kv, {d.Nk, d.Hkv, d.Dv}, Role::kUnitLast, false, ls), std::nullopt};
  };
  // lse (Hq, total_q) columns [q0, q0 + n) against a dense (.., Hq, n) lse's batch entry `at`.
  const auto lse_bitwise = [&](const Tensor& packed, int64_t q0, const Tensor& dense, int64_t n, int64_t at) -> std::string {
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const double a = packed.flat(h * d.Nq + q0 + i), w = dense.flat((at * d.Hq + h) * n + i);
        if (!(same_bits(a, w) || (std::isnan(a) && std::isnan(w))))
          return "lse[" + std::to_string(h) + ", " + std::to_string(q0 + i) + "] = " + num(a) + " but the single call gives " + num(w);
      }
    return "";
  };

  // The packed attention_paged call's inputs.
  std::vector<int32_t> table(static_cast<size_t>(std::max<int64_t>(1, S * maxp)), -1);
  for (int64_t b = 0; b < S; ++b)
    for (int64_t j = 0; j < nk[static_cast<size_t>(b)]; ++j)
      table[static_cast<size_t>(b * maxp + j)] = static_cast<int32_t>(cu_k[static_cast<size_t>(b)] + j);
  const auto pool = [](const Tensor& t) {
    sdpa::TensorView v = t.view(), r = v;
    r.rank = 4;
    r.shape[0] = v.shape[0]; r.shape[1] = 1; r.shape[2] = v.shape[1]; r.shape[3] = v.shape[2];
    r.strides[0] = v.strides[0]; r.strides[1] = v.strides[0]; r.strides[2] = v.strides[1]; r.strides[3] = v.strides[2];
    return r;
  };
  // Table rows [r0, r0 + rows) as a (rows, maxp) view.
  const auto table_view = [&](int64_t r0, int64_t rows) {
    sdpa::TensorView t;
    t.data = table.data() + r0 * maxp;
    t.dtype = DType::kInt32;
    t.rank = 2;
    t.shape[0] = rows;
    t.shape[1] = maxp;
    t.strides[0] = maxp;
    t.strides[1] = 1;
    return t;
  };
  const IndexTensor sl(DType::kInt64, nk, 1, 0);
  sdpa::PagedInputs pin;
  pin.q = c.q.view();
  pin.k_pages = pool(c.k);
  pin.v_pages = pool(c.v);
  pin.block_table = table_view(0, S);
  pin.seqlens_k = sl.view();
  pin.cu_seqlens_q = cuq.view();
  // Without the block mask the packed paged call must run, else this construction is not a valid
  // call here (nothing to check of it).
  bool paged_runs = false;
  {
    Outs p0 = make_vouts(false);
    std::string why_not;
    sdpa::Options no_mask = o;
    paged_runs = !throws_sdpa_error("attention_paged", [&] { sdpa::attention_paged(pin, pouts(p0), no_mask); }, why_not);
    if (g_print) std::fprintf(stderr, "attention_fuzz: packed attention_paged without the block mask %s%s\n", paged_runs ? "runs" : "throws: ", why_not.c_str());
  }

  if (invalid) {
    const PackedBad kind = static_cast<PackedBad>((vb >> 2) & 7);
    const std::array<int64_t, 2> tot_v{ceil_div(d.Nq, bq), ceil_div(d.Nk, bk)}, tot_p{ceil_div(d.Nq, bq), ceil_div(S * maxp, bk)};
    std::optional<Tensor> made_v, made_p;
    std::string how_v, how_p;
    bo.block_mask = broken_packed_mask(kind, bl->mask, pm, S, d.Hq, tot_v, br, made_v, how_v);
    po.block_mask = broken_packed_mask(kind, pm, bl->mask, S, d.Hq, tot_p, br, made_p, how_p);
    const auto given = [](const sdpa::TensorView& v, const std::optional<Tensor>& made, const char* name) {
      std::string s = made ? made->describe(name) + "\n" : std::string();
      std::ostringstream sh;
      for (int a = 0; a < v.rank; ++a) sh << (a ? ", " : "") << v.shape[a];
      return s + name + " given: rank " + std::to_string(v.rank) + " shape (" + sh.str() + "), dtype " + dtype_long(v.dtype) +
             (v.data ? "" : ", null data") + "\n";
    };
    g_case = desc + "invalid for attention_varlen: " + how_v + "\n" + given(*bo.block_mask, made_v, "varlen block_mask") +
             "invalid for attention_paged: " + how_p + "\n" + given(*po.block_mask, made_p, "paged block_mask");
    if (g_print) std::fprintf(stderr, "%s", g_case.c_str() + desc.size());
    const std::string what_bad = std::string(kBadBlocksNames[static_cast<int>(BadBlocks::kVarlen)]) + ": ";
    // A shape that does not broadcast: the Error names the longest sequence's lengths too.
    const auto names = [&](const std::string& what, const char* call, const std::string& how, bool shape_kind) {
      check_error_names(what, "block_mask", call, (what_bad + how).c_str());
      if (shape_kind) check_error_names(what, "the longest sequence's", call, (what_bad + how).c_str());
    };
    const auto shape_kind = [](const std::string& how) {
      return how == kPackedBadNames[0] || how == kPackedBadNames[1] || how == kPackedBadNames[2] || how == kPackedBadNames[5] ||
             how == kPackedBadNames[7];
    };
    std::string what;
    {
      Outs vo = make_vouts(true);
      const auto s0 = vo.out.snapshot();
      const auto s1 = vo.lse ? vo.lse->snapshot() : std::vector<std::byte>{};
      check(throws_sdpa_error("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(vo), bo); }, what), "error_expected",
            [&] { return "attention_varlen: no sdpa::Error for an invalid block mask: " + how_v; });
      check(vo.out.same_bytes(s0) && (!vo.lse || vo.lse->same_bytes(s1)), "error_untouched",
            [&] { return "attention_varlen: sdpa::Error(\"" + what + "\") for a block mask but an output buffer changed"; });
      names(what, "attention_varlen", how_v, shape_kind(how_v));
    }
    if (c.backward) {
      Outs valid = make_vouts(false);
      if (!valid.lse) valid.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, LayoutSpec::plain());
      expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(valid), o); });
      Grads g = make_vgrads(c.out_ls);
      const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
      check(throws_sdpa_error("attention_varlen_backward",
                    [&] { sdpa::attention_varlen_backward(in, valid.out.view(), valid.lse->view(), dout.view(), g.gradients(), bo); }, what),
            "error_expected", [&] { return "attention_varlen_backward: no sdpa::Error for an invalid block mask: " + how_v; });
      check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
            [&] { return "attention_varlen_backward: sdpa::Error(\"" + what + "\") for a block mask but a gradient buffer changed"; });
      names(what, "attention_varlen_backward", how_v, shape_kind(how_v));
    }
    if (!paged_runs) return;
    Outs pb = make_vouts(true);
    const auto s0 = pb.out.snapshot();
    const auto s1 = pb.lse ? pb.lse->snapshot() : std::vector<std::byte>{};
    check(throws_sdpa_error("attention_paged", [&] { sdpa::attention_paged(pin, pouts(pb), po); }, what), "error_expected",
          [&] { return "attention_paged with cu_seqlens_q: no sdpa::Error for an invalid block mask: " + how_p; });
    check(pb.out.same_bytes(s0) && (!pb.lse || pb.lse->same_bytes(s1)), "error_untouched",
          [&] { return "attention_paged with cu_seqlens_q: sdpa::Error(\"" + what + "\") for a block mask but an output buffer changed"; });
    names(what, "attention_paged with cu_seqlens_q", how_p, shape_kind(how_p));
    return;
  }

  // ---- A valid block mask ----
  // F21 (fixed): a pool of no pages (every sequence has 0 keys) with a table of max_pages > 0
  // columns: the mask counts max_pages · page_size keys all the same; paged_blocks_no_pages names
  // a failure there.
  const bool no_pages = d.Nk == 0 && maxp > 0 && S > 0;
  const auto paged_no_throw = [&](const char* call, const std::function<void()>& fn) {
    std::string what;
    if (!throws_sdpa_error(call, fn, what)) return;
    check(false, no_pages ? "paged_blocks_no_pages" : "unexpected_error",
          [&] { return std::string(call) + " threw sdpa::Error on a valid call: " + what; });
  };
  // Sequence b's corner of mask `m` (qbn x kbn blocks): a view, or a copy kept in `keep`.
  std::vector<Tensor> keep;
  const auto corner = [&](const Tensor& m, int64_t b, int64_t qbn, int64_t kbn) {
    if (!copy_corner) return corner_view(m.view(), b, qbn, kbn);
    keep.push_back(corner_copy(m, b, qbn, kbn, block_layout(br)));
    return keep.back().view();
  };
  Outs vo = make_vouts(true);
  expect_no_throw("attention_varlen (block mask)", [&] { sdpa::attention_varlen(in, vouts(vo), bo); });
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen");
  check_outs_written(vo);
  {
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_vouts(false);
    expect_no_throw("attention_varlen (block mask)", [&] { sdpa::attention_varlen(in, vouts(o2), bo); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(vo.bitwise_equal(o2, why), "repeatable", [&] { return "two identical attention_varlen calls (threads 1 and 2) with a block mask differ: " + why; });
  }
  // Each sequence: attention() on views of its rows with its corner.
  struct Seq { Tensor out, lse; int64_t at = 0; bool ran = false; sdpa::Options opt; };
  std::vector<Seq> seqs(static_cast<size_t>(S));
  for (int64_t b = 0; b < S; ++b) {
    Seq& s = seqs[static_cast<size_t>(b)];
    s.at = o.dropout_p > 0 ? b : 0;
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], k1 = cu_k[static_cast<size_t>(b) + 1];
    const int64_t n = q1 - q0;
    if (static_cast<long double>(s.at + 1) * n * (k1 - k0) * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1) > 4.0L * kWorkBudget) continue;
    const int64_t batch = s.at > 0 ? s.at + 1 : 0;
    sdpa::Inputs di;
    di.q = packed_rows_view(c.q, q0, q1, batch);
    di.k = packed_rows_view(c.k, k0, k1, batch);
    di.v = packed_rows_view(c.v, k0, k1, batch);
    std::vector<int64_t> os{d.Hq, n, d.Dv}, ls{d.Hq, n};
    if (batch > 0) os.insert(os.begin(), batch), ls.insert(ls.begin(), batch);
    s.out.init(c.dtype, os, Role::kUnitLast, false, LayoutSpec::plain());
    s.lse.init(ct, ls, Role::kAny, false, LayoutSpec::plain());
    s.opt = o;
    s.opt.block_mask = corner(bl->mask, b, ceil_div(n, bq), ceil_div(k1 - k0, bk));
    s.opt.block_q = bq;
    s.opt.block_k = bk;
    sdpa::Outputs so;
    so.out = s.out.view();
    so.lse = s.lse.view();
    expect_no_throw("attention (one sequence, its corner of the block mask)", [&] { sdpa::attention(di, so, s.opt); });
    s.ran = true;
    std::string r = rows_bitwise("out", vo.out, q0, s.out, s.at);
    if (r.empty() && vo.lse) r = lse_bitwise(*vo.lse, q0, s.lse, n, s.at);
    check(r.empty(), "varlen_blocks_equiv", [&] {
      return "sequence " + std::to_string(b) + " (corner (" + std::to_string(ceil_div(n, bq)) + ", " + std::to_string(ceil_div(k1 - k0, bk)) +
             ")): " + r;
    });
  }

  if (paged_runs) {
    Outs pb = make_vouts(true);
    paged_no_throw("attention_paged with cu_seqlens_q (block mask)", [&] { sdpa::attention_paged(pin, pouts(pb), po); });
    check_outs_written(pb);
    {
      sdpa::set_num_threads(3 - c.threads);
      Outs p2 = make_vouts(false);
      paged_no_throw("attention_paged with cu_seqlens_q (block mask)", [&] { sdpa::attention_paged(pin, pouts(p2), po); });
      sdpa::set_num_threads(c.threads);
      std::string why;
      check(pb.bitwise_equal(p2, why), "repeatable", [&] { return "two identical packed attention_paged calls (threads 1 and 2) with a block mask differ: " + why; });
    }
    for (int64_t b = 0; b < S; ++b) {
      const int64_t at = o.dropout_p > 0 ? b : 0;
      const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1], n = q1 - q0;
      if (static_cast<long double>(at + 1) * n * maxp * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1) > 4.0L * kWorkBudget) continue;
      // Table rows b (or 0..b with dropout: the sequence as batch entry b), their lengths.
      const int64_t r0 = at > 0 ? 0 : b;
      const IndexTensor sb(DType::kInt64, std::vector<int64_t>(nk.begin() + r0, nk.begin() + b + 1), 1, 0);
      sdpa::PagedInputs one = pin;
      one.cu_seqlens_q.reset();
      one.q = packed_rows_view(c.q, q0, q1, at + 1);
      one.block_table = table_view(r0, at + 1);
      one.seqlens_k = sb.view();
      Outs u;
      u.out.init(c.dtype, {at + 1, d.Hq, n, d.Dv}, Role::kUnitLast, false, LayoutSpec::plain());
      if (pb.lse) u.lse.emplace(ct, std::vector<int64_t>{at + 1, d.Hq, n}, Role::kAny, false, LayoutSpec::plain());
      sdpa::Options uo = po;
      uo.block_mask = corner(pm, b, ceil_div(n, bq), KBp);
      paged_no_throw("attention_paged (one sequence, its corner of the block mask)", [&] { sdpa::attention_paged(one, pouts(u), uo); });
      std::string r = rows_bitwise("out", pb.out, q0, u.out, at);
      if (r.empty() && pb.lse) r = lse_bitwise(*pb.lse, q0, *u.lse, n, at);
      check(r.empty(), "paged_blocks_equiv", [&] {
        return "packed attention_paged, sequence " + std::to_string(b) + " (corner (" + std::to_string(ceil_div(n, bq)) + ", " +
               std::to_string(KBp) + ")): " + r;
      });
    }
  }

  if (!c.backward) return;
  const Tensor& lse = *vo.lse;
  bool lse_pinf = false;
  for (int64_t n = 0; n < lse.numel(); ++n) lse_pinf |= lse.flat(n) == kInf;
  Grads g = make_vgrads(c.out_ls);
  const auto call_bwd = [&](const Grads& gg) { sdpa::attention_varlen_backward(in, vo.out.view(), lse.view(), dout.view(), gg.gradients(), bo); };
  if (lse_pinf) {
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    std::string what;
    check(throws_sdpa_error("attention_varlen_backward", [&] { call_bwd(g); }, what), "lse_inf_backward",
          [&] { return std::string("attention_varlen_backward (block mask) with +inf in lse did not throw"); });
    check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
          [] { return std::string("varlen backward (block mask) Error but a gradient changed"); });
    return;
  }
  expect_no_throw("attention_varlen_backward (block mask)", [&] { call_bwd(g); });
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen_backward");
  for (const auto& tn : {std::pair<const Tensor*, const char*>{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"}}) {
    const std::string r = tn.first->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(tn.second) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(tn.second) + ": " + r; });
  }
  {
    sdpa::set_num_threads(3 - c.threads);
    Grads g2 = make_vgrads(LayoutSpec::plain());
    expect_no_throw("attention_varlen_backward (block mask)", [&] { call_bwd(g2); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(grads_bitwise(g, g2, why), "repeatable", [&] { return "two identical attention_varlen_backward calls (threads 1 and 2) with a block mask differ: " + why; });
  }
  for (int64_t b = 0; b < S; ++b) {
    const Seq& s = seqs[static_cast<size_t>(b)];
    if (!s.ran || s.at > 0) continue;  // with dropout b = 0 only (varlen_dense's rule)
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], k1 = cu_k[static_cast<size_t>(b) + 1];
    Tensor dq(c.dtype, {d.Hq, q1 - q0, d.Dk}, Role::kUnitLast, false, LayoutSpec::plain()),
        dk(c.kv, {d.Hkv, k1 - k0, d.Dk}, Role::kUnitLast, false, LayoutSpec::plain()),
        dv(c.kv, {d.Hkv, k1 - k0, d.Dv}, Role::kUnitLast, false, LayoutSpec::plain());
    sdpa::Inputs di;
    di.q = packed_rows_view(c.q, q0, q1);
    di.k = packed_rows_view(c.k, k0, k1);
    di.v = packed_rows_view(c.v, k0, k1);
    expect_no_throw("attention_backward (one sequence, its corner of the block mask)", [&] {
      sdpa::attention_backward(di, s.out.view(), s.lse.view(), packed_rows_view(dout, q0, q1), {dq.view(), dk.view(), dv.view()}, s.opt);
    });
    std::string r = rows_bitwise("dq", g.dq, q0, dq, 0);
    if (r.empty()) r = rows_bitwise("dk", g.dk, k0, dk, 0);
    if (r.empty()) r = rows_bitwise("dv", g.dv, k0, dv, 0);
    check(r.empty(), "varlen_blocks_equiv", [&] { return "backward, sequence " + std::to_string(b) + ": " + r; });
  }
}

void run_varlen(FuzzedDataProvider& f) {
  Case c;  // c.q, c.k, c.v: the packed (total, H, D) tensors; c.d: B sequences, Nq / Nk the totals
  const bool fancy = decode_flags(f, c);
  c.rank = 3;
  const uint8_t inv = f.ConsumeIntegral<uint8_t>();
  VarBad bad = inv < 190 ? VarBad::kNone : static_cast<VarBad>(1 + inv % (static_cast<int>(VarBad::kCount) - 1));
  Dims& d = c.d;
  static const int64_t kHkv[] = {1, 1, 2, 3, 0};
  static const int64_t kGroup[] = {1, 1, 2, 4, 5};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64, 65, 128};
  static const int64_t kNqV[] = {0, 1, 1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 64, 65, 130};
  static const int64_t kNkV[] = {0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 64, 65, 130, 300, 2100};
  d.Hkv = pick(f, kHkv);
  d.Hq = d.Hkv * pick(f, kGroup);
  d.Dk = pick(f, kD);
  d.Dv = pick(f, kD);
  const int nseq = f.ConsumeIntegralInRange<int>(0, 5);
  d.B = nseq;
  std::vector<int64_t> nq(static_cast<size_t>(nseq)), nk(static_cast<size_t>(nseq));
  for (int b = 0; b < nseq; ++b) {
    nq[static_cast<size_t>(b)] = pick(f, kNqV);
    nk[static_cast<size_t>(b)] = pick(f, kNkV);
  }
  auto work = [&] {
    long double w = 0;
    for (int b = 0; b < nseq; ++b) w += static_cast<long double>(nq[static_cast<size_t>(b)]) * nk[static_cast<size_t>(b)];
    return w * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1);
  };
  while (work() > kWorkBudget) {
    if (d.Hq > std::max<int64_t>(1, d.Hkv)) { d.Hq = d.Hkv; continue; }
    int64_t* biggest = &d.Dk;
    if (d.Dv > *biggest) biggest = &d.Dv;
    for (auto& x : nq) if (x > *biggest) biggest = &x;
    for (auto& x : nk) if (x > *biggest) biggest = &x;
    *biggest /= 2;
  }
  // The packed k, v (and dk, dv) elements too: with no query rows the work above is 0 whatever
  // the keys, and 6300 keys of Dk = Dv = 128 in 3 heads (4.8 M elements per tensor pair, walked by
  // every check and copy) took 30 s under ASan, past libFuzzer's -timeout=10 (a varlen kNaive
  // backward with cu_seqlens_q = {0, 0, 0, 0}). No committed seed or finding comes near the bound.
  auto kv_elems = [&] {
    long double n = 0;
    for (int64_t x : nk) n += x;
    return n * std::max<int64_t>(1, d.Hkv) * (d.Dk + d.Dv);
  };
  while (kv_elems() > 2 * kWorkBudget) {
    int64_t* biggest = &d.Dk;
    if (d.Dv > *biggest) biggest = &d.Dv;
    for (auto& x : nk) if (x > *biggest) biggest = &x;
    *biggest /= 2;
  }
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (int b = 0; b < nseq; ++b) {
    cu_q.push_back(cu_q.back() + nq[static_cast<size_t>(b)]);
    cu_k.push_back(cu_k.back() + nk[static_cast<size_t>(b)]);
  }
  d.Nq = cu_q.back();
  d.Nk = cu_k.back();

  // Options (no weights: varlen has none).
  sdpa::Options& o = c.opt;
  const uint8_t of = decode_short_options(f, o);
  c.want_lse = (of & 128) || c.backward;
  const uint8_t cf = f.ConsumeIntegral<uint8_t>();
  const DType cu_dt = cf & 1 ? DType::kInt32 : DType::kInt64;
  const int64_t cu_stride = ((cf >> 1) & 3) == 1 ? 2 : ((cf >> 1) & 3) == 2 ? -1 : 1;
  const int cu_mis = (cf >> 3) & 3;

  // F12 (kSkipDefault: varlen_empty_view): empty tensors get a buffer and stride 0 while open.
  const auto vl_layout = [&](bool fancy_layout) {
    LayoutSpec ls = decode_layout(f, fancy_layout);
    if (skipping("varlen_empty_view")) {
      ls.null_empty = false;
      ls.empty_stride_seed = 0;
    }
    return ls;
  };
  const LayoutSpec lq = vl_layout(fancy), lk = vl_layout(fancy), lv = vl_layout(fancy);
  c.out_ls = vl_layout(fancy);
  c.l_ls = vl_layout(fancy);
  c.q.init(c.dtype, {d.Nq, d.Hq, d.Dk}, Role::kUnitLast, true, lq);
  c.k.init(c.kv, {d.Nk, d.Hkv, d.Dk}, Role::kUnitLast, true, lk);
  c.v.init(c.kv, {d.Nk, d.Hkv, d.Dv}, Role::kUnitLast, true, lv);
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30};
  const double sigma = kSigma[f.ConsumeIntegralInRange<int>(0, 4)];
  fill_values(c.q, rng, sigma, 0);
  fill_values(c.k, rng, sigma, 0);
  fill_values(c.v, rng, 1.0, 0);
  if (!c.tame) plant_specials(f, {&c.q, &c.k, &c.v});

  const IndexTensor cuq(cu_dt, cu_q, cu_stride, cu_mis), cuk(cu_dt, cu_k, cu_stride, cu_mis);
  sdpa::VarlenInputs in{c.q.view(), c.k.view(), c.v.view(), cuq.view(), cuk.view()};
  auto describe_varlen = [&] {
    return describe(c) + "attention_varlen: " + cuq.describe("cu_seqlens_q") + "\n" + cuk.describe("cu_seqlens_k") + "\n";
  };
  g_case = describe_varlen();
  if (g_print) std::fprintf(stderr, "attention_fuzz: varlen case\n%s", g_case.c_str());
  sdpa::set_num_threads(c.threads);
  const DType ct = c.compute();
  auto make_vouts = [&](bool fancy_layout) {
    Outs r;
    r.out.init(c.dtype, {d.Nq, d.Hq, d.Dv}, Role::kUnitLast, false, fancy_layout ? c.out_ls : LayoutSpec::plain());
    if (c.want_lse) r.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, fancy_layout ? c.l_ls : LayoutSpec::plain());
    return r;
  };
  auto vouts = [](const Outs& r) {
    sdpa::VarlenOutputs vo;
    vo.out = r.out.view();
    if (r.lse) vo.lse = r.lse->view();
    return vo;
  };
  auto make_vgrads = [&](const LayoutSpec& ls) {
    return Grads{Tensor(c.dtype, {d.Nq, d.Hq, d.Dk}, Role::kUnitLast, false, ls), Tensor(c.kv, {d.Nk, d.Hkv, d.Dk}, Role::kUnitLast, false, ls),
                 Tensor(c.kv, {d.Nk, d.Hkv, d.Dv}, Role::kUnitLast, false, ls), std::nullopt};
  };
  bool bad_scale = false;
  if (o.scale) bad_scale = c.compute() == DType::kFloat32 && std::fabs(*o.scale) > FLT_MAX;  // not drawn today

  Outs vo = make_vouts(true);
  Tensor dout(c.dtype, {d.Nq, d.Hq, d.Dv}, Role::kUnitLast, true, vl_layout(true));
  {
    std::mt19937_64 r2(f.ConsumeIntegral<uint64_t>());
    fill_values(dout, r2, 1.0, 0);
  }

  if (g_varlen_blocks) {
    run_varlen_blocks(f, c, in, nq, nk, cu_q, cu_k, cuq, dout, describe_varlen());
    return;
  }

  if (bad != VarBad::kNone) {
    // Invalid: sdpa::Error, nothing written. The backward gets the out and lse of a valid forward.
    Outs valid = make_vouts(false);
    if (!valid.lse) valid.lse.emplace(ct, std::vector<int64_t>{d.Hq, d.Nq}, Role::kAny, false, LayoutSpec::plain());
    if (c.backward) expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(valid), o); });
    sdpa::VarlenInputs bin = in;
    sdpa::VarlenOutputs bo = vouts(vo);
    std::vector<int64_t> bq = cu_q, bk = cu_k;
    sdpa::TensorView bout = valid.out.view(), blse = valid.lse->view(), bdout = dout.view();
    Grads g = make_vgrads(c.out_ls);
    sdpa::Gradients gr = g.gradients();
    bool must_throw = true, fwd = true;
    std::optional<IndexTensor> tq, tk;
    switch (bad) {
      case VarBad::kFirstNonzero: bq[0] = 1; break;
      case VarBad::kDecreasing: if (nseq >= 2 && bk[1] > 0) bk[1] = bk[2] + 1; else bk.back() += 1; break;
      case VarBad::kLastShort: if (bq.back() > 0) bq.back() -= 1; else bq.back() = 1; break;
      case VarBad::kLastLong: bk.back() += 1; break;
      case VarBad::kNegative: if (nseq >= 1) bq[1] = -1; else bq[0] = -1; break;
      case VarBad::kCountMismatch: bk.push_back(bk.back()); break;
      default: break;
    }
    tq.emplace(cu_dt, bq, cu_stride, cu_mis);
    tk.emplace(cu_dt, bk, cu_stride, cu_mis);
    bin.cu_seqlens_q = tq->view();
    bin.cu_seqlens_k = tk->view();
    switch (bad) {
      case VarBad::kCuDtype: bin.cu_seqlens_q.dtype = cf & 32 ? DType::kBool : cu_dt == DType::kInt32 ? DType::kFloat32 : DType::kFloat64; break;
      case VarBad::kCuRank: {
        sdpa::TensorView& t = bin.cu_seqlens_k;
        t.rank = 2; t.shape[1] = t.shape[0]; t.strides[1] = t.strides[0]; t.shape[0] = 1; t.strides[0] = 0;
        break;
      }
      case VarBad::kCuEmpty: bin.cu_seqlens_q.shape[0] = 0; break;
      case VarBad::kCuNull: bin.cu_seqlens_k.data = nullptr; break;
      case VarBad::kOutShape: bo.out.shape[2] += 1; bout.shape[2] += 1; break;
      case VarBad::kLseShape: if (bo.lse) bo.lse->shape[1] += 1; else must_throw = c.backward; blse.shape[1] += 1; break;
      case VarBad::kKDtype: bin.k.dtype = c.kv == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32; break;
      case VarBad::kQRank: bin.q.rank = 2; break;
      case VarBad::kDqRows: fwd = false; gr.dq.shape[0] += 1; break;
      case VarBad::kDoutShape: fwd = false; bdout.shape[2] += 1; break;
      case VarBad::kDvDtype: fwd = false; gr.dv.dtype = c.bad_dv_dtype(); break;
      default: break;
    }
    g_case = describe_varlen() + "invalid argument: " + kVarBadNames[static_cast<int>(bad)] + "\n" + tq->describe("cu_seqlens_q (given)") + "\n" +
             tk->describe("cu_seqlens_k (given)") + "\n";
    if (!fwd && !c.backward) return;
    std::string what;
    if (fwd) {
      const auto s0 = vo.out.snapshot();
      const auto s1 = vo.lse ? vo.lse->snapshot() : std::vector<std::byte>{};
      const bool threw = throws_sdpa_error("attention_varlen", [&] { sdpa::attention_varlen(bin, bo, o); }, what);
      if (threw)
        check(vo.out.same_bytes(s0) && (!vo.lse || vo.lse->same_bytes(s1)), "error_untouched",
              [&] { return "attention_varlen: sdpa::Error(\"" + what + "\") but an output buffer changed"; });
      else
        check(!must_throw || (bad == VarBad::kLseShape && !vo.lse), "error_expected",
              [&] { return std::string("attention_varlen: no sdpa::Error for: ") + kVarBadNames[static_cast<int>(bad)]; });
    }
    if (!c.backward) return;
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    const bool threw = throws_sdpa_error("attention_varlen_backward", [&] { sdpa::attention_varlen_backward(bin, bout, blse, bdout, gr, o); }, what);
    if (threw)
      check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
            [&] { return "attention_varlen_backward: sdpa::Error(\"" + what + "\") but a gradient buffer changed"; });
    else
      check(false, "error_expected", [&] { return std::string("attention_varlen_backward: no sdpa::Error for: ") + kVarBadNames[static_cast<int>(bad)]; });
    return;
  }
  (void)bad_scale;

  // A valid call.
  expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(vo), o); });
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen");
  check_outs_written(vo);
  {
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_vouts(false);
    expect_no_throw("attention_varlen", [&] { sdpa::attention_varlen(in, vouts(o2), o); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(vo.bitwise_equal(o2, why), "repeatable", [&] { return "two identical attention_varlen calls (threads 1 and 2) differ: " + why; });
  }
  // Each sequence: bit for bit attention() on contiguous copies of its rows (with dropout, as
  // batch entry b of a dense call).
  struct Seq { Tensor q, k, v, out; std::optional<Tensor> lse; int64_t at = 0; bool ran = false; };
  std::vector<Seq> seqs(static_cast<size_t>(nseq));
  for (int b = 0; b < nseq; ++b) {
    Seq& s = seqs[static_cast<size_t>(b)];
    s.at = o.dropout_p > 0 ? b : 0;
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], k1 = cu_k[static_cast<size_t>(b) + 1];
    if (static_cast<long double>(s.at + 1) * (q1 - q0) * (k1 - k0) * std::max<int64_t>(1, d.Hq) * (d.Dk + d.Dv + 1) > 4.0L * kWorkBudget) continue;
    s.q = dense_rows(c.q, q0, q1, s.at);
    s.k = dense_rows(c.k, k0, k1, s.at);
    s.v = dense_rows(c.v, k0, k1, s.at);
    std::vector<int64_t> os = s.q.shape(), ls = os;
    os.back() = d.Dv;
    ls.pop_back();
    s.out.init(c.dtype, os, Role::kUnitLast, false, LayoutSpec::plain());
    s.lse.emplace(ct, ls, Role::kAny, false, LayoutSpec::plain());
    sdpa::Inputs di;
    di.q = s.q.view();
    di.k = s.k.view();
    di.v = s.v.view();
    sdpa::Outputs dout_s;
    dout_s.out = s.out.view();
    dout_s.lse = s.lse->view();
    expect_no_throw("attention (one sequence)", [&] { sdpa::attention(di, dout_s, o); });
    s.ran = true;
    std::string r = rows_bitwise("out", vo.out, q0, s.out, s.at);
    if (r.empty() && vo.lse) {
      const int64_t n = q1 - q0;
      for (int64_t h = 0; h < d.Hq && r.empty(); ++h)
        for (int64_t i = 0; i < n; ++i) {
          const double a = vo.lse->flat(h * d.Nq + q0 + i), w = s.lse->flat((s.at * d.Hq + h) * n + i);
          if (!(same_bits(a, w) || (std::isnan(a) && std::isnan(w)))) {
            r = "lse[" + std::to_string(h) + ", " + std::to_string(q0 + i) + "] = " + num(a) + " but the dense call gives " + num(w);
            break;
          }
        }
    }
    check(r.empty(), "varlen_dense", [&] { return "sequence " + std::to_string(b) + ": " + r; });
  }

  if (!c.backward) return;
  const Tensor& lse = *vo.lse;
  bool lse_pinf = false;
  for (int64_t n = 0; n < lse.numel(); ++n) lse_pinf |= lse.flat(n) == kInf;
  Grads g = make_vgrads(c.out_ls);
  auto call_bwd = [&](const Grads& gg) { sdpa::attention_varlen_backward(in, vo.out.view(), lse.view(), dout.view(), gg.gradients(), o); };
  if (lse_pinf) {
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    bool threw = false;
    try {
      call_bwd(g);
    } catch (const sdpa::Error&) {
      threw = true;
    }
    check(threw, "lse_inf_backward", [&] { return std::string("attention_varlen_backward with +inf in lse did not throw"); });
    check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched", [] { return std::string("varlen backward Error but a gradient changed"); });
    return;
  }
  expect_no_throw("attention_varlen_backward", [&] { call_bwd(g); });
  // F20 (fixed): with 2 threads a sequence whose backward notes no path (one that writes nothing,
  // or any under kReference / kNaive) used to report the path an earlier call left in an OpenMP
  // worker's thread_local record (findings/kernel_path_stale-prelude, then -naive).
  check_kernel_path(c, sdpa::last_kernel_path(), "attention_varlen_backward");
  for (const auto& tn : {std::pair<const Tensor*, const char*>{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"}}) {
    const char* name = tn.second;
    const std::string r = tn.first->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  }
  {
    sdpa::set_num_threads(3 - c.threads);
    Grads g2 = make_vgrads(LayoutSpec::plain());
    expect_no_throw("attention_varlen_backward", [&] { call_bwd(g2); });
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(grads_bitwise(g, g2, why), "repeatable", [&] { return "two identical attention_varlen_backward calls (threads 1 and 2) differ: " + why; });
  }
  for (int b = 0; b < nseq; ++b) {
    Seq& s = seqs[static_cast<size_t>(b)];
    // With dropout only the draws are promised for b > 0 (the forward above checked them): a dense
    // call with B = b + 1 may pick another backward plan (the plan follows the shape), so other bits.
    if (!s.ran || s.at > 0) continue;
    const int64_t q0 = cu_q[static_cast<size_t>(b)], q1 = cu_q[static_cast<size_t>(b) + 1], k0 = cu_k[static_cast<size_t>(b)];
    const Tensor dout_b = dense_rows(dout, q0, q1, s.at);
    Tensor dq(c.dtype, s.q.shape(), Role::kUnitLast, false, LayoutSpec::plain()), dk(c.kv, s.k.shape(), Role::kUnitLast, false, LayoutSpec::plain()),
        dv(c.kv, s.v.shape(), Role::kUnitLast, false, LayoutSpec::plain());
    sdpa::Inputs di;
    di.q = s.q.view();
    di.k = s.k.view();
    di.v = s.v.view();
    expect_no_throw("attention_backward (one sequence)", [&] {
      sdpa::attention_backward(di, s.out.view(), s.lse->view(), dout_b.view(), {dq.view(), dk.view(), dv.view()}, o);
    });
    std::string r = rows_bitwise("dq", g.dq, q0, dq, s.at);
    if (r.empty()) r = rows_bitwise("dk", g.dk, k0, dk, s.at);
    if (r.empty()) r = rows_bitwise("dv", g.dv, k0, dv, s.at);
    check(r.empty(), "varlen_dense", [&] { return "backward, sequence " + std::to_string(b) + ": " + r; });
  }
}

}  // namespace sdpa_fuzz
