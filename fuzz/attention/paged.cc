// attention_fuzz: attention_paged (ext 0x40).
#include "harness.h"

namespace sdpa_fuzz {

// ---- attention_paged (ext bit 6) and KVCache (ext bit 7) ----
//
// Both are judged against the same call made dense: a Case (rank 4) whose k and v hold each
// sequence's keys gathered in order into (B, Hkv, Nk, D), Nk = max_pages · page_size, keys past
// a sequence's length NaN, with Inputs::seqlens_k. So every oracle (classify.cc, tolerance.cc) applies to it as to a
// dense call with seqlens_k (edge semantics, the tolerance rule), and the header's promise is one
// comparison: the paged results are bit for bit the dense call's capped at KernelPath::kSimd.

// paged_dense: `full` (a paged or KVCache call's out, weights and lse) against attention() on c
// capped at kSimd, bit for bit; then (unless `oracle` is false: a KVCache step too large for it)
// the edge semantics, and on tame inputs the tolerance rule.
void check_paged_dense(const Case& c, const Outs& full, const char* call, bool oracle) {
  Outs dense = make_outs(c, true, true, false);
  sdpa::set_max_kernel_path(sdpa::KernelPath::kSimd);
  run_forward(c, c.inputs(), dense, c.opt);
  sdpa::set_max_kernel_path(c.path_cap);
  std::string why;
  check(full.bitwise_equal(dense, why), "paged_dense", [&] {
    return std::string(call) + " differs from attention() on the gathered keys with seqlens_k (capped at kSimd): " + why;
  });
  if (!oracle) return;
  check_edge_semantics(c, full);
  if (c.tame) check_tolerance(c, full);
}

// A sequence's length at a page's edges (0, 1, page_size ± 1, two pages ± 1), full, or random.
int64_t page_edge_length(std::mt19937_64& rng, int64_t ps, int64_t Nk) {
  int64_t x;
  switch (rng() % 11) {
    case 0: x = 0; break;
    case 1: x = 1; break;
    case 2: x = ps - 1; break;
    case 3: x = ps; break;
    case 4: x = ps + 1; break;
    case 5: x = 2 * ps - 1 + static_cast<int64_t>(rng() % 3); break;
    case 6: x = Nk; break;
    case 7: x = Nk - 1; break;
    case 8: x = Nk - ps + 1; break;
    default: x = static_cast<int64_t>(rng() % static_cast<uint64_t>(Nk + 1)); break;
  }
  return std::clamp<int64_t>(x, 0, Nk);
}

// A block table (B, cols), int32 or int64, unit last stride, row stride rs (cols plus a gap, its
// negative, or 0: one row for every sequence), at 0-3 bytes of misalignment, in IndexTensor's
// exactly-sized buffer (stride 1): entry (b, j) is element at(b, j) of it.
struct BlockTable {
  int64_t B = 0, cols = 0, rs = 0, base = 0;
  std::unique_ptr<IndexTensor> mem;
  BlockTable(DType dt, int64_t B_, int64_t cols_, int64_t rs_, int mis) : B(B_), cols(cols_), rs(rs_) {
    const int64_t n = B == 0 || cols == 0 ? 0 : (B - 1) * std::abs(rs) + cols;
    base = rs < 0 && B > 0 ? (B - 1) * -rs : 0;
    mem = std::make_unique<IndexTensor>(dt, std::vector<int64_t>(static_cast<size_t>(n), -1), 1, mis);
  }
  int64_t size() const { return static_cast<int64_t>(mem->vals.size()); }
  int64_t at(int64_t b, int64_t j) const { return base + b * rs + j; }
  int64_t get(int64_t b, int64_t j) const { return mem->vals[static_cast<size_t>(at(b, j))]; }
  void set_elem(int64_t i, int64_t x) { mem->set(i, mem->dtype == DType::kInt32 ? static_cast<int32_t>(x) : x); }
  sdpa::TensorView view() const {
    sdpa::TensorView t;
    t.dtype = mem->dtype;
    t.rank = 2;
    t.shape[0] = B;
    t.shape[1] = cols;
    t.strides[0] = rs;
    t.strides[1] = 1;
    t.data = size() == 0 ? nullptr : mem->data + base * (mem->dtype == DType::kInt32 ? 4 : 8);
    return t;
  }
  std::string describe() const {
    std::ostringstream s;
    s << "block_table: " << (mem->dtype == DType::kInt32 ? "int32" : "int64") << " (" << B << ", " << cols << ") strides (" << rs
      << ", 1) misalign " << mem->misalign << " rows [";
    for (int64_t b = 0; b < B && b < 8; ++b) {
      s << (b ? "; " : "");
      for (int64_t j = 0; j < cols && j < 40; ++j) s << (j ? " " : "") << get(b, j);
    }
    s << "]";
    return s.str();
  }
};

// The pool elements (sorted offsets) of the rows no sequence reads: rows past every reader's
// length, and pages no table row uses (read[p * page_size + r] says which rows are read).
std::vector<int64_t> unread_offsets(const Tensor& pool, const std::vector<uint8_t>& read) {
  std::vector<int64_t> offs;
  const int64_t rows = pool.numel() == 0 ? 0 : pool.shape()[0] * pool.shape()[1], per_row = pool.shape()[2] * pool.shape()[3];
  for (int64_t r = 0; r < rows; ++r)
    if (!read[static_cast<size_t>(r)])
      for (int64_t x = 0; x < per_row; ++x) offs.push_back(pool.offset_of_flat(r * per_row + x));
  std::sort(offs.begin(), offs.end());
  return offs;
}

enum class PagedBad : uint8_t {
  kNone, kEntryPastPool, kEntryNegative, kTooShort, kTableDtype, kTableBatch, kTableLastStride, kTableRank, kTableNull,
  kPoolsDiffer, kPageSizeZero, kPoolDk, kPoolHeads, kPoolDtype, kCount
};
const char* const kPagedBadNames[] = {"none", "block_table entry >= num_pages", "block_table entry negative",
                                      "table too short for seqlens_k", "block_table dtype", "block_table batch",
                                      "block_table last stride 2", "block_table rank 1", "block_table null",
                                      "v_pages num_pages differs", "page_size 0", "k_pages Dk", "v_pages heads",
                                      "v_pages dtype"};
static_assert(sizeof(kPagedBadNames) / sizeof(kPagedBadNames[0]) == static_cast<size_t>(PagedBad::kCount));

// Runs `fn` that must throw sdpa::Error (error_expected) naming `want` (error_names: every
// string in it is in the message), writing none of o's buffers (error_untouched).
void expect_error(const char* call, const std::function<void()>& fn, const Outs* o, const std::vector<std::string>& want,
                  const std::string& what_bad) {
  const auto s0 = o ? o->out.snapshot() : std::vector<std::byte>{};
  const auto s1 = o && o->weights ? o->weights->snapshot() : std::vector<std::byte>{};
  const auto s2 = o && o->lse ? o->lse->snapshot() : std::vector<std::byte>{};
  std::string what;
  const bool threw = throws_sdpa_error(call, fn, what);
  check(threw, "error_expected", [&] { return std::string(call) + ": no sdpa::Error for: " + what_bad; });
  for (const std::string& w : want)
    check(what.find(w) != std::string::npos, "error_names",
          [&] { return std::string(call) + ": the Error for " + what_bad + " does not name \"" + w + "\": " + what; });
  if (o)
    check(o->out.same_bytes(s0) && (!o->weights || o->weights->same_bytes(s1)) && (!o->lse || o->lse->same_bytes(s2)),
          "error_untouched", [&] { return std::string(call) + ": sdpa::Error(\"" + what + "\") but an output buffer changed"; });
}

void run_paged(FuzzedDataProvider& f) {
  Case c;  // the call made dense: k, v (B, Hkv, Nk, D) gathered from the pool, seqlens_k
  const bool fancy = decode_flags(f, c);
  c.backward = false;  // attention_paged is forward only
  c.rank = 4;
  const uint8_t inv = f.ConsumeIntegral<uint8_t>();
  PagedBad bad = inv < 200 ? PagedBad::kNone : static_cast<PagedBad>(1 + inv % (static_cast<int>(PagedBad::kCount) - 1));
  Dims& d = c.d;
  static const int64_t kB[] = {1, 1, 1, 2, 2, 3, 3, 4, 5, 0};
  static const int64_t kHkv[] = {1, 1, 2, 3};
  static const int64_t kGroup[] = {1, 1, 2, 4, 5, 8};
  static const int64_t kNq[] = {0, 1, 1, 1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 65};
  static const int64_t kPs[] = {1, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 32, 48, 64, 127, 128, 129, 256};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64, 65, 128};
  d.B = pick(f, kB);
  d.Hkv = pick(f, kHkv);
  d.Hq = d.Hkv * pick(f, kGroup);
  d.Nq = pick(f, kNq);
  int64_t ps = pick(f, kPs);
  const uint8_t sz = f.ConsumeIntegral<uint8_t>();
  // max_pages: a few pages, or (1 in 8) past 2048 keys, where the kernels split the keys.
  const bool long_keys = sz % 8 == 7;
  int64_t cols = long_keys ? (2048 + 64 * (sz >> 3 & 3)) / ps + 1 : (sz >> 3) % 7;
  d.Dk = pick(f, kD);
  d.Dv = pick(f, kD);
  const uint8_t pl = f.ConsumeIntegral<uint8_t>();  // bits 0-1, 2-3: the k, v pools' layouts; 4-5 spare pages; 6-7 sharing
  const uint8_t tb = f.ConsumeIntegral<uint8_t>();  // the table: int32 (bit 0), row stride (1-2), misalignment (3-4), extra columns (5-6)
  const uint8_t sb = f.ConsumeIntegral<uint8_t>();  // seqlens_k: int32 (bit 0), stride (1-2), misalignment (3-4)
  if (!long_keys && ((tb >> 5) & 3) > 1) cols += ((tb >> 5) & 3) - 1;  // columns past every sequence's pages
  if (long_keys) { d.B = std::min<int64_t>(d.B, 2); d.Hq = d.Hkv; d.Nq = std::min<int64_t>(d.Nq, 2); }
  // Bound the work (kPagedWorkBudget). Long keys stay long.
  for (;;) {
    d.Nk = cols * ps;
    if (work_of(d) <= kPagedWorkBudget) break;
    if (d.Hq > d.Hkv) { d.Hq = d.Hkv; continue; }
    int64_t* biggest = &d.Dk;
    for (int64_t* x : {&d.Dv, &d.Nq, long_keys ? &d.B : &cols, long_keys ? &d.B : &ps}) if (*x > *biggest) biggest = x;
    *biggest = std::max<int64_t>(1, *biggest / 2);
  }
  const uint8_t of = decode_short_options(f, c.opt);
  c.want_weights = of & 64;
  c.want_lse = of & 128;
  // Pools: token-major C order, head-major (KVCache's layout), or any layout with a unit last stride.
  const auto pool_layout = [&](int kind) {
    LayoutSpec ls;
    if (kind == 1) ls.perm = 1;  // memory (num_pages, Hkv, page_size, D)
    if (kind >= 2) ls = decode_layout(f, true);
    ls.zero = 0;  // every pool row its own memory
    if (skipping("paged_empty_pool_view")) {  // F15 (fixed; SDPA_FUZZ_SKIP only): no null data, no huge strides
      ls.null_empty = false;
      ls.empty_stride_seed = 0;
    }
    return ls;
  };
  const LayoutSpec lk = pool_layout(pl & 3), lv = pool_layout(pl >> 2 & 3), lq = decode_layout(f, fancy);
  c.out_ls = decode_layout(f, fancy);
  c.w_ls = decode_layout(f, fancy);
  c.l_ls = decode_layout(f, fancy);
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30, 300};
  const uint8_t vf = f.ConsumeIntegral<uint8_t>();

  // Lengths, then the pages: each sequence's in a shuffled order, some sharing a prefix of
  // another's (read-only), or (row stride 0) one table row for all.
  std::vector<int64_t> L(static_cast<size_t>(d.B));
  for (auto& x : L) x = page_edge_length(rng, ps, d.Nk);
  const int rs_kind = (tb >> 1) & 3;
  const int64_t rs = rs_kind == 0 ? cols : rs_kind == 1 ? cols + 1 + static_cast<int64_t>(rng() % 3)
                     : rs_kind == 2 ? -(cols + static_cast<int64_t>(rng() % 2)) : 0;
  std::vector<int64_t> used(static_cast<size_t>(d.B));
  int64_t max_used = 0;
  for (int64_t b = 0; b < d.B; ++b) max_used = std::max(max_used, used[b] = (L[b] + ps - 1) / ps);
  std::vector<std::vector<int32_t>> pages(static_cast<size_t>(d.B));
  std::vector<int64_t> share(static_cast<size_t>(d.B), 0), from(static_cast<size_t>(d.B), 0);  // a prefix of sequence from[b]'s
  int64_t own = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    if (rs == 0 && d.B > 1) { share[b] = b > 0 ? used[b] : 0; from[b] = 0; }
    else if (b > 0 && (pl >> 6) && rng() % 4 < (pl >> 6)) {
      from[b] = static_cast<int64_t>(rng() % static_cast<uint64_t>(b));
      share[b] = std::min(used[b], used[from[b]]) - static_cast<int64_t>(rng() % 2);
      share[b] = std::max<int64_t>(0, share[b]);
    }
    own += (rs == 0 && d.B > 1) ? (b == 0 ? max_used : 0) : used[b] - share[b];
  }
  int64_t num_pages = own + ((pl >> 4) & 3);
  if (num_pages == 0 && d.B > 0 && cols > 0 && skipping("paged_empty_pool")) num_pages = 1;  // F14 (fixed; SDPA_FUZZ_SKIP only)
  std::vector<int32_t> order(static_cast<size_t>(num_pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  size_t next = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t n = rs == 0 && d.B > 1 && b == 0 ? max_used : used[b];
    for (int64_t j = 0; j < n; ++j) pages[b].push_back(j < share[b] ? pages[from[b]][j] : order[next++]);
  }
  const DType tdt = tb & 1 ? DType::kInt32 : DType::kInt64;
  // F13 (fixed; SDPA_FUZZ_SKIP=paged_misaligned_table): aligned tables only when skipped.
  BlockTable table(tdt, d.B, cols, rs, skipping("paged_misaligned_table") ? 0 : (tb >> 3) & 3);
  std::vector<uint8_t> entry_read(static_cast<size_t>(table.size()), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t j = 0; j < static_cast<int64_t>(pages[b].size()); ++j) {
      table.set_elem(table.at(b, j), pages[b][j]);
      if (j < used[b]) entry_read[static_cast<size_t>(table.at(b, j))] = 1;
    }
  // Entries no sequence reads (past its pages, and the gaps between rows): out of range, -1.
  std::vector<int64_t> table_unread;
  for (int64_t i = 0; i < table.size(); ++i) {
    if (entry_read[static_cast<size_t>(i)]) continue;
    table_unread.push_back(i);
    const int64_t k = static_cast<int64_t>(rng() % 6);
    const int64_t huge = tdt == DType::kInt32 ? INT32_MAX : int64_t{1} << 40, low = tdt == DType::kInt32 ? INT32_MIN : INT64_MIN;
    table.set_elem(i, k == 0 ? -1 : k == 1 ? num_pages : k == 2 ? num_pages + 7 : k == 3 ? huge : k == 4 ? low : -2);
  }
  std::vector<uint8_t> row_read(static_cast<size_t>(num_pages * ps), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t j = 0; j < L[b]; ++j) row_read[static_cast<size_t>(pages[b][j / ps] * ps + j % ps)] = 1;

  // The pools: random values, specials (not tame), NaN in every row no sequence reads.
  Tensor kp(c.kv, {num_pages, ps, d.Hkv, d.Dk}, Role::kUnitLast, false, lk);
  Tensor vp(c.kv, {num_pages, ps, d.Hkv, d.Dv}, Role::kUnitLast, false, lv);
  c.q.init(c.dtype, {d.B, d.Hq, d.Nq, d.Dk}, Role::kUnitLast, true, lq);
  fill_values(c.q, rng, kSigma[vf % 6], (vf >> 3) % 3);
  fill_values(kp, rng, kSigma[vf % 6], (vf >> 3) % 3);
  fill_values(vp, rng, 1.0, 0);
  if (!c.tame) plant_specials(f, {&c.q, &kp, &vp});
  const std::vector<int64_t> k_unread = unread_offsets(kp, row_read), v_unread = unread_offsets(vp, row_read);
  for (int64_t o : k_unread) kp.set_off(o, kNaN);
  for (int64_t o : v_unread) vp.set_off(o, kNaN);
  // The dense call: each sequence's keys gathered in order; keys past its length NaN.
  c.k.init(c.kv, {d.B, d.Hkv, d.Nk, d.Dk}, Role::kUnitLast, true, LayoutSpec::plain());
  c.v.init(c.kv, {d.B, d.Hkv, d.Nk, d.Dv}, Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hkv; ++h)
      for (int64_t j = 0; j < d.Nk; ++j) {
        const int64_t row = j < L[b] ? pages[b][j / ps] * ps + j % ps : -1;
        for (int64_t e = 0; e < d.Dk; ++e)
          c.k.set_flat(((b * d.Hkv + h) * d.Nk + j) * d.Dk + e, row < 0 ? kNaN : kp.flat((row * d.Hkv + h) * d.Dk + e));
        for (int64_t e = 0; e < d.Dv; ++e)
          c.v.set_flat(((b * d.Hkv + h) * d.Nk + j) * d.Dv + e, row < 0 ? kNaN : vp.flat((row * d.Hkv + h) * d.Dv + e));
      }
  c.seqlens = L;
  const int sl_st = (sb >> 1) & 3;
  c.sl = std::make_shared<IndexTensor>(sb & 1 ? DType::kInt32 : DType::kInt64, L, sl_st == 1 ? 2 : sl_st == 2 ? -1 : 1, (sb >> 3) & 3);
  c.sl_view = c.sl->view();
  if (c.tame && c.opt.scale && !(std::fabs(*c.opt.scale) <= 1e3)) c.tame = false;

  sdpa::PagedInputs in;
  in.q = c.q.view();
  in.k_pages = kp.view();
  in.v_pages = vp.view();
  in.block_table = table.view();
  in.seqlens_k = *c.sl_view;
  std::ostringstream pd;
  pd << "attention_paged: page_size " << ps << ", num_pages " << num_pages << ", pages per sequence:";
  for (int64_t b = 0; b < d.B; ++b) {
    pd << " [";
    for (size_t j = 0; j < pages[b].size() && j < 40; ++j) pd << (j ? " " : "") << pages[b][j];
    if (pages[b].size() > 40) pd << " ... (" << pages[b].size() << ")";
    pd << "]" << (share[b] > 0 ? " (" + std::to_string(share[b]) + " shared with sequence " + std::to_string(from[b]) + ")" : "");
  }
  pd << "\n" << kp.describe("k_pages") << "\n" << vp.describe("v_pages") << "\n" << table.describe() << "\n";
  g_case = describe(c) + pd.str();
  if (g_print) std::fprintf(stderr, "attention_fuzz: paged case\n%s", g_case.c_str());
  sdpa::set_num_threads(c.threads);
  // While a paged call runs: garbage in the rows no sequence reads and, under ASan, those bytes and
  // the table entries no sequence reads unaddressable.
  const auto unread_fenced = [&](Garbage& g) {
    g.values(kp, k_unread);
    g.values(vp, v_unread);
    g.fence(table.mem->data, table_unread, tdt == DType::kInt32 ? 4 : 8);
  };
  const auto paged = [&](const Outs& o, uint64_t seed) {
    Garbage g(seed);
    unread_fenced(g);
    expect_no_throw("attention_paged", [&] { sdpa::attention_paged(in, o.outputs(), c.opt); });
  };

  if (bad != PagedBad::kNone) {
    Outs o = make_outs(c, c.want_weights, c.want_lse, true);
    sdpa::PagedInputs bin = in;
    std::vector<std::string> want;
    std::optional<IndexTensor> bad_sl;
    bool must_throw = true;
    // A table entry a sequence reads made invalid: the Error names the first such entry in the
    // order the table is read (sequence by sequence), and its sequence.
    const auto bad_entry = [&](int64_t x) {
      std::vector<std::pair<int64_t, int64_t>> cand;
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t j = 0; j < used[b]; ++j) cand.push_back({b, j});
      if (cand.empty()) return false;
      const auto [b0, j0] = cand[rng() % cand.size()];
      table.set_elem(table.at(b0, j0), x);
      for (const auto& [b, j] : cand) {
        const int64_t e = table.get(b, j);
        if (e < 0 || e >= num_pages) {
          want = {"block_table[" + std::to_string(b) + "][" + std::to_string(j) + "] = " + std::to_string(e), "sequence " + std::to_string(b)};
          break;
        }
      }
      return true;
    };
    switch (bad) {
      case PagedBad::kEntryPastPool: must_throw = bad_entry(rng() % 2 ? num_pages : tdt == DType::kInt32 ? INT32_MAX : int64_t{1} << 40); break;
      case PagedBad::kEntryNegative: must_throw = bad_entry(rng() % 2 ? -1 : tdt == DType::kInt32 ? INT32_MIN : INT64_MIN); break;
      case PagedBad::kTooShort: {
        if (d.B == 0) { must_throw = false; break; }
        std::vector<int64_t> L2 = L;
        const size_t b = static_cast<size_t>(rng() % static_cast<uint64_t>(d.B));
        L2[b] = d.Nk + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(ps));
        bad_sl.emplace(c.sl->dtype, L2, c.sl->stride, c.sl->misalign);
        bin.seqlens_k = bad_sl->view();
        want = {"seqlens_k[" + std::to_string(b) + "] = " + std::to_string(L2[b])};
        // A pool of no pages (every other length 0): the Error names the sequence that has keys
        // and its length ("block_table[b][0] ... is not a page of k_pages (num_pages = 0);
        // sequence b has L keys", F14's fix) before the length's range.
        if (num_pages == 0) {
          want = {"sequence " + std::to_string(b), std::to_string(L2[b]) + " keys"};
          // That Error quotes block_table[b][0], which the call reads for it: not fenced (a
          // fenced one was an ASan report in the harness's own making, 2026-11-28).
          if (cols > 0) table_unread.erase(std::remove(table_unread.begin(), table_unread.end(), table.at(static_cast<int64_t>(b), 0)), table_unread.end());
        }
        break;
      }
      case PagedBad::kTableDtype: bin.block_table.dtype = tb & 64 ? DType::kFloat32 : DType::kBool; break;
      case PagedBad::kTableBatch: bin.block_table.shape[0] = d.B + 1; break;
      case PagedBad::kTableLastStride: bin.block_table.strides[1] = 2; must_throw = cols > 1; break;
      case PagedBad::kTableRank: bin.block_table.rank = 1; break;
      case PagedBad::kTableNull: bin.block_table.data = nullptr; must_throw = d.B > 0 && cols > 0; break;
      case PagedBad::kPoolsDiffer: bin.v_pages.shape[tb & 128 ? 1 : 0] += 1; break;
      case PagedBad::kPageSizeZero: bin.k_pages.shape[1] = bin.v_pages.shape[1] = 0; break;
      case PagedBad::kPoolDk: bin.k_pages.shape[3] += 1; break;
      case PagedBad::kPoolHeads: bin.v_pages.shape[2] += 1; break;
      case PagedBad::kPoolDtype: bin.v_pages.dtype = c.kv == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32; break;
      default: must_throw = false; break;
    }
    if (!must_throw) return;  // nothing to break in this call (no page read, one column)
    g_case += std::string("invalid argument: ") + kPagedBadNames[static_cast<int>(bad)] + "\n" + table.describe() + "\n";
    if (g_print) std::fprintf(stderr, "attention_fuzz: paged invalid argument: %s\n", kPagedBadNames[static_cast<int>(bad)]);
    Garbage g(0x9a6edull + inv);
    unread_fenced(g);
    expect_error("attention_paged", [&] { sdpa::attention_paged(bin, o.outputs(), c.opt); }, &o, want, kPagedBadNames[static_cast<int>(bad)]);
    return;
  }

  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  paged(o, 0x9a6e0ull + vf);
  check_outs_written(o);
  {  // repeatable, across thread counts (and other garbage in the unread rows)
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_outs(c, c.want_weights, c.want_lse, false);
    paged(o2, 0x9a6e1ull + vf);
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(o.bitwise_equal(o2, why), "repeatable", [&] { return "two identical attention_paged calls (threads 1 and 2) differ: " + why; });
  }
  Outs full = make_outs(c, true, true, false);
  paged(full, 0x9a6e2ull + vf);
  std::string why;
  check(o.bitwise_equal(full, why), "weights_invariant", [&] { return "the same paged call with weights and lse requested differs: " + why; });
  check_paged_dense(c, full, "attention_paged");
}

}  // namespace sdpa_fuzz
