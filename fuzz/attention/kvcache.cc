// attention_fuzz: KVCache scripts (ext 0x80).
#include "harness.h"

namespace sdpa_fuzz {

// A KVCache driven by a short script on 2-3 interleaved sequences (new_sequence, append of 0-4
// tokens or a prompt across pages, attention, free; appends to a full pool and calls with an
// unknown sequence that must be Errors changing nothing), against a model of its pages and
// lengths (kvcache_model) and, at every attention, the same call made dense on the tokens the
// script appended (paged_dense).
void run_kvcache(FuzzedDataProvider& f) {
  Case base;  // dtypes, threads, tame, caps
  const bool fancy = decode_flags(f, base);
  base.backward = false;
  static const int64_t kHkv[] = {1, 1, 2, 3};
  static const int64_t kGroup[] = {1, 1, 2, 4};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32};
  static const int64_t kPs[] = {1, 1, 2, 3, 4, 5, 7, 8, 16, 17, 32};
  const int64_t Hkv = pick(f, kHkv), Hq = Hkv * pick(f, kGroup), Dk = pick(f, kD), Dv = pick(f, kD), ps = pick(f, kPs);
  const int64_t num_pages = f.ConsumeIntegralInRange<int64_t>(0, 12);
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30, 300};
  const double sigma = kSigma[f.ConsumeIntegral<uint8_t>() % 6];
  sdpa::set_num_threads(base.threads);
  std::ostringstream log;
  log << "KVCache(num_pages " << num_pages << ", page_size " << ps << ", Hkv " << Hkv << ", Dk " << Dk << ", Dv " << Dv << ", "
      << dtype_long(base.kv) << "), q " << dtype_long(base.dtype) << " Hq " << Hq << ", threads " << base.threads << ", "
      << (base.tame ? "tame" : "not tame") << ", kernel path cap " << path_name(base.path_cap) << (base.avx2 ? ", SIMD capped at AVX2" : "")
      << (base.opt.precision == sdpa::Precision::kFast ? ", precision kFast" : "") << "\nscript:";
  g_case = log.str();
  // Constructor arguments the header forbids.
  const uint8_t kf = f.ConsumeIntegral<uint8_t>();
  if (kf % 4 != 0) {
    const int64_t a = kf % 4 == 1 ? 0 : ps, h = kf % 4 == 2 ? 0 : Hkv;
    const DType dt = kf % 4 == 3 ? (kf & 4 ? DType::kBool : DType::kInt32) : base.kv;
    expect_error("KVCache()", [&] { sdpa::KVCache bad(num_pages, a, h, Dk, Dv, dt); }, nullptr, {}, "page_size 0, num_kv_heads 0 or dtype");
  }
  sdpa::KVCache cache(num_pages, ps, Hkv, Dk, Dv, base.kv);

  struct Seq {
    bool live = false;
    int64_t L = 0;
    std::vector<int32_t> pages;
    std::vector<double> k, v;  // the tokens appended, (L, Hkv, D) token-major
  };
  std::vector<Seq> model;
  std::set<int32_t> free_pages;
  for (int32_t p = 0; p < num_pages; ++p) free_pages.insert(p);
  const auto live = [&] {
    std::vector<int64_t> r;
    for (size_t s = 0; s < model.size(); ++s) if (model[s].live) r.push_back(static_cast<int64_t>(s));
    return r;
  };
  // kvcache_model: the cache's ids, lengths, pages and free count are the model's.
  const auto state_matches = [&](const std::string& after) {
    const std::vector<int64_t> ids = live();
    check(cache.sequences() == ids && cache.free_pages() == static_cast<int64_t>(free_pages.size()), "kvcache_model", [&] {
      return "after " + after + ": " + std::to_string(cache.sequences().size()) + " sequences and " + std::to_string(cache.free_pages()) +
             " free pages, the model " + std::to_string(ids.size()) + " and " + std::to_string(free_pages.size());
    });
    const auto list = [](const std::vector<int32_t>& v) {
      std::string r;
      for (int32_t x : v) r += (r.empty() ? "" : " ") + std::to_string(x);
      return "[" + r + "]";
    };
    for (int64_t s : ids)
      check(cache.length(s) == model[s].L && cache.pages(s) == model[s].pages, "kvcache_model", [&] {
        return "after " + after + ": sequence " + std::to_string(s) + " has length " + std::to_string(cache.length(s)) + " and pages " +
               list(cache.pages(s)) + ", the model " + std::to_string(model[s].L) + " and " + list(model[s].pages);
      });
  };
  // An id no live sequence has: never issued, freed, negative.
  const auto unknown_id = [&](uint8_t x) -> int64_t {
    for (size_t s = 0; s < model.size() && x % 4 == 0; ++s) if (!model[s].live) return static_cast<int64_t>(s);
    return x % 4 == 1 ? -1 : x % 4 == 2 ? INT64_MAX : static_cast<int64_t>(model.size()) + x % 7;
  };
  int64_t last_n = 1;
  const int nops = f.ConsumeIntegralInRange<int>(1, 10);
  for (int step = 0; step < nops && f.remaining_bytes() > 0; ++step) {
    const uint8_t op = f.ConsumeIntegral<uint8_t>();
    std::vector<int64_t> ids = live();
    const int64_t pick_live = ids.empty() ? -1 : ids[(op >> 3) % ids.size()];
    // op bits 5-7 all set: the call names an unknown sequence (append, attention, free).
    const bool unknown = (op >> 5) == 7;
    int kind = op % 8;
    if (kind <= 1 && ids.size() >= 3) kind = 2;  // at most 3 live sequences: an append instead
    if (ids.empty() && !unknown && kind >= 2) kind = 0;  // nothing to append to or attend yet
    switch (kind) {
      case 0:
      case 1: {  // new_sequence
        {
          size_t want = 0;
          while (want < model.size() && model[want].live) ++want;
          if (want == model.size()) model.emplace_back();
          model[want] = Seq{true, 0, {}, {}, {}};
          const int64_t id = cache.new_sequence();
          log << " new_sequence() = " << id << ";";
          g_case = log.str();
          check(id == static_cast<int64_t>(want), "kvcache_model", [&] { return "new_sequence() = " + std::to_string(id) + ", the lowest free id is " + std::to_string(want); });
          state_matches("new_sequence");
        }
        break;
      }
      case 2:
      case 3:
      case 4: {  // append n tokens; to an unknown sequence, mismatched, or past a full pool: an Error
        static const int64_t kN[] = {1, 1, 1, 2, 3, 4, 0};
        const uint8_t nb = f.ConsumeIntegral<uint8_t>();
        const int64_t n = nb % 8 == 7 ? std::max<int64_t>(0, 2 * ps + 1 - static_cast<int64_t>(nb >> 6)) : kN[(nb >> 3) % 7];
        const int mis = nb % 8 == 6 ? 1 + (nb >> 6) % 3 : 0;  // 1 k's dtype, 2 v's Dv, 3 v's token count
        const int64_t s = unknown ? unknown_id(nb) : pick_live;
        Tensor kt(base.kv, {n, Hkv, Dk}, Role::kUnitLast, true, decode_layout(f, fancy));
        Tensor vt(base.kv, {n + (mis == 3), Hkv, Dv + (mis == 2)}, Role::kUnitLast, true, decode_layout(f, fancy));
        fill_values(kt, rng, sigma, 0);
        fill_values(vt, rng, 1.0, 0);
        if (!base.tame) plant_specials(f, {&kt, &vt, &kt});
        sdpa::TensorView kv = kt.view();
        if (mis == 1) kv.dtype = base.kv == DType::kFloat64 ? DType::kFloat32 : DType::kFloat64;
        const bool known = s >= 0 && s < static_cast<int64_t>(model.size()) && model[static_cast<size_t>(s)].live;
        const int64_t need = known ? (model[s].L + n + ps - 1) / ps - static_cast<int64_t>(model[s].pages.size()) : 0;
        log << " append(" << s << ", " << n << " tokens" << (mis ? std::string(", mismatched ") + (mis == 1 ? "k dtype" : mis == 2 ? "v Dv" : "v tokens") : "") << ");";
        g_case = log.str() + "\n" + kt.describe("k tokens") + "\n" + vt.describe("v tokens") + "\n";
        if (!known || mis || need > static_cast<int64_t>(free_pages.size())) {
          std::vector<std::string> want;
          if (!known) want = {std::to_string(s)};
          else if (!mis) want = {"full"};
          expect_error("KVCache::append", [&] { cache.append(s, kv, vt.view()); }, nullptr, want,
                       !known ? "an unknown sequence" : mis ? "mismatched tokens" : "a full pool");
          state_matches("a failed append");
          break;
        }
        expect_no_throw("KVCache::append", [&] { cache.append(s, kv, vt.view()); });
        Seq& q = model[s];
        for (int64_t p = 0; p < need; ++p) {
          q.pages.push_back(*free_pages.begin());  // the lowest free page first (the header)
          free_pages.erase(free_pages.begin());
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < Hkv; ++h) {
            for (int64_t e = 0; e < Dk; ++e) q.k.push_back(kt.at4(0, i, h, e));
            for (int64_t e = 0; e < Dv; ++e) q.v.push_back(vt.at4(0, i, h, e));
          }
        q.L += n;
        last_n = std::max<int64_t>(1, n);
        state_matches("append");
        break;
      }
      case 5:
      case 6: {  // attention of 0-3 sequences (one may repeat, or be unknown: an Error)
        const uint8_t ab = f.ConsumeIntegral<uint8_t>();
        std::vector<int64_t> seqs;
        const int nb = ids.empty() ? 0 : 1 + ab % 3;
        for (int b = 0; b < nb; ++b) seqs.push_back(ids[static_cast<size_t>(rng() % ids.size())]);
        const int64_t unk = unknown_id(ab >> 2);
        if (unknown) seqs.insert(seqs.begin() + static_cast<std::ptrdiff_t>(rng() % (seqs.size() + 1)), unk);
        static const int64_t kNq[] = {1, 1, 1, 2, 3, 0};
        Case dc;
        dc.dtype = base.dtype;
        dc.kv = base.kv;
        dc.rank = 4;
        dc.tame = base.tame;
        dc.threads = base.threads;
        dc.avx2 = base.avx2;
        dc.path_cap = base.path_cap;
        dc.opt.precision = base.opt.precision;
        Dims& d = dc.d;
        d.Hq = Hq;
        d.Hkv = Hkv;
        d.Nq = (ab >> 2) % 7 == 6 ? last_n : kNq[(ab >> 2) % 7 % 6];
        d.Dk = Dk;
        d.Dv = Dv;
        const auto set_nk = [&] {
          size_t max_pages = 0;
          for (int64_t s : seqs) if (s != unk || !unknown) max_pages = std::max(max_pages, model[static_cast<size_t>(s)].pages.size());
          d.Nk = static_cast<int64_t>(max_pages) * ps;
          d.B = static_cast<int64_t>(seqs.size());
        };
        set_nk();
        // Bound the work as run_paged does: fewer queries, then fewer entries (a script may hold
        // 3 prompts of 65 tokens with 12 query heads); past a dense call's budget the oracle is
        // left out (the dense comparison stays).
        while (work_of(d) > kPagedWorkBudget && d.Nq > 1) d.Nq /= 2;
        while (work_of(d) > kPagedWorkBudget && seqs.size() > 1 && !unknown) {
          seqs.pop_back();
          set_nk();
        }
        const bool oracle = work_of(d) <= kWorkBudget;
        const uint8_t of = decode_short_options(f, dc.opt);
        if ((of & 32) == 0) dc.opt.causal = Causal::kBottomRight;  // mostly a decode / prefill step
        dc.want_weights = of & 64;
        dc.want_lse = of & 128;
        if (dc.tame && dc.opt.scale && !(std::fabs(*dc.opt.scale) <= 1e3)) dc.tame = false;
        dc.q.init(dc.dtype, {d.B, d.Hq, d.Nq, d.Dk}, Role::kUnitLast, true, decode_layout(f, fancy));
        fill_values(dc.q, rng, sigma, 0);
        if (!base.tame) plant_specials(f, {&dc.q, &dc.q, &dc.q});
        dc.out_ls = decode_layout(f, fancy);
        dc.w_ls = decode_layout(f, fancy);
        dc.l_ls = decode_layout(f, fancy);
        log << " attention({";
        for (size_t b = 0; b < seqs.size(); ++b) log << (b ? ", " : "") << seqs[b];
        log << "}, Nq " << d.Nq << ");";
        if (unknown) {
          g_case = log.str() + "\n";
          Outs o = make_outs(dc, dc.want_weights, dc.want_lse, true);
          expect_error("KVCache::attention", [&] { cache.attention(dc.q.view(), seqs, o.outputs(), dc.opt); }, &o,
                       {std::to_string(unk)}, "an unknown sequence");
          break;
        }
        // The dense call: the tokens appended so far, gathered; keys past each length NaN.
        dc.k.init(dc.kv, {d.B, Hkv, d.Nk, Dk}, Role::kUnitLast, true, LayoutSpec::plain());
        dc.v.init(dc.kv, {d.B, Hkv, d.Nk, Dv}, Role::kUnitLast, true, LayoutSpec::plain());
        for (int64_t b = 0; b < d.B; ++b) {
          const Seq& q = model[seqs[b]];
          dc.seqlens.push_back(q.L);
          for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t j = 0; j < d.Nk; ++j) {
              for (int64_t e = 0; e < Dk; ++e) dc.k.set_flat(((b * Hkv + h) * d.Nk + j) * Dk + e, j < q.L ? q.k[(j * Hkv + h) * Dk + e] : kNaN);
              for (int64_t e = 0; e < Dv; ++e) dc.v.set_flat(((b * Hkv + h) * d.Nk + j) * Dv + e, j < q.L ? q.v[(j * Hkv + h) * Dv + e] : kNaN);
            }
        }
        dc.sl = std::make_shared<IndexTensor>(DType::kInt64, dc.seqlens, 1, 0);
        dc.sl_view = dc.sl->view();
        g_case = log.str() + "\n" + describe(dc);
        if (g_print) std::fprintf(stderr, "attention_fuzz: KVCache case\n%s", g_case.c_str());
        // Under ASan the cache's rows these sequences do not read are unaddressable during the call.
        std::vector<uint8_t> row_read(static_cast<size_t>(num_pages * ps), 0);
        for (int64_t s : seqs)
          for (int64_t j = 0; j < model[s].L; ++j) row_read[static_cast<size_t>(model[s].pages[j / ps] * ps + j % ps)] = 1;
        const auto attend = [&](const Outs& o) {
          Garbage g(0);
          for (const sdpa::TensorView& t : {cache.k_pages(), cache.v_pages()}) {
            std::vector<int64_t> offs;
            for (int64_t p = 0; p < num_pages; ++p)
              for (int64_t r = 0; r < ps; ++r)
                if (!row_read[static_cast<size_t>(p * ps + r)])
                  for (int64_t h = 0; h < Hkv; ++h)
                    for (int64_t e = 0; e < t.shape[3]; ++e) offs.push_back(p * t.strides[0] + r * t.strides[1] + h * t.strides[2] + e);
            std::sort(offs.begin(), offs.end());
            g.fence(static_cast<std::byte*>(t.data), offs, esize(t.dtype));
          }
          expect_no_throw("KVCache::attention", [&] { cache.attention(dc.q.view(), seqs, o.outputs(), dc.opt); });
        };
        Outs o = make_outs(dc, dc.want_weights, dc.want_lse, true);
        attend(o);
        check_outs_written(o);
        {
          sdpa::set_num_threads(3 - base.threads);
          Outs o2 = make_outs(dc, dc.want_weights, dc.want_lse, false);
          attend(o2);
          sdpa::set_num_threads(base.threads);
          std::string why;
          check(o.bitwise_equal(o2, why), "repeatable", [&] { return "two identical KVCache::attention calls (threads 1 and 2) differ: " + why; });
        }
        Outs full = make_outs(dc, true, true, false);
        attend(full);
        std::string why;
        check(o.bitwise_equal(full, why), "weights_invariant", [&] { return "the same KVCache::attention call with weights and lse requested differs: " + why; });
        check_paged_dense(dc, full, "KVCache::attention", oracle);
        break;
      }
      case 7: {  // free, or a call with an unknown sequence (free, length, pages): an Error
        const uint8_t fb = f.ConsumeIntegral<uint8_t>();
        if (!unknown) {
          log << " free(" << pick_live << ");";
          g_case = log.str();
          expect_no_throw("KVCache::free", [&] { cache.free(pick_live); });
          for (int32_t p : model[pick_live].pages) free_pages.insert(p);
          model[pick_live] = Seq{};
          state_matches("free");
          break;
        }
        const int64_t s = unknown_id(fb);
        log << " " << (fb & 0x30 ? "length(" : "free(") << s << ") (unknown);";
        g_case = log.str();
        if (fb & 0x30) expect_error("KVCache::length", [&] { (void)cache.length(s); }, nullptr, {std::to_string(s)}, "an unknown sequence");
        else expect_error("KVCache::free", [&] { cache.free(s); }, nullptr, {std::to_string(s)}, "an unknown sequence");
        state_matches("a failed call");
        break;
      }
    }
  }
}

}  // namespace sdpa_fuzz
