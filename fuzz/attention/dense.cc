// attention_fuzz: one dense attention (+ backward) call: run_case.
#include "harness.h"

namespace sdpa_fuzz {

void poison_offsets(const Tensor& t, const Dims& d, int64_t off, int64_t heads, int64_t rows, int64_t cols,
                    std::vector<uint8_t>& hit /* heads*B x rows */) {
  // hit[(b * heads + h) * rows + n] = 1 when element (b, h, n, e) of t is at `off` for some e.
  hit.assign(static_cast<size_t>(d.B * heads * rows), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t e = 0; e < cols; ++e)
          if (t.offset4(b, h, n, e) == off) { hit[static_cast<size_t>((b * heads + h) * rows + n)] = 1; break; }
}

// ---- seqlens_k: keys past a sequence's length are never read ----

// The buffer elements of k (or v) that only keys past their sequence's length use (an element a
// key inside some length shares, through a zero or overlapping stride, is left alone).
std::vector<int64_t> past_offsets(const Case& c, const Tensor& t, int64_t cols) {
  const Dims& d = c.d;
  if (t.numel() == 0 || c.seqlens.empty()) return {};
  std::vector<int64_t> in, past;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hkv; ++h)
      for (int64_t j = 0; j < d.Nk; ++j)
        for (int64_t e = 0; e < cols; ++e) (j < c.keys_of(b) ? in : past).push_back(t.offset4(b, h, j, e));
  std::sort(in.begin(), in.end());
  std::sort(past.begin(), past.end());
  past.erase(std::unique(past.begin(), past.end()), past.end());
  std::vector<int64_t> r;
  for (int64_t o : past) if (!std::binary_search(in.begin(), in.end(), o)) r.push_back(o);
  return r;
}

// Garbage in the elements of k and v that only keys past their sequence's length use.
class PastKeysGarbage : public Garbage {
 public:
  PastKeysGarbage(Case& c, uint64_t seed) : Garbage(seed) {
    values(c.k, past_offsets(c, c.k, c.d.Dk));
    values(c.v, past_offsets(c, c.v, c.d.Dv));
  }
};

// The element mask the header calls equivalent to the case's block mask (on top of its own mask):
// (B, Hq, Nq, Nk) (q's rank's last dims), contiguous; bool (1 where the block and a bool mask allow
// the key), or, over a float mask, that mask's dtype with its bias where the block allows the key
// and -inf where it does not.
Tensor expanded_mask(const Case& c) {
  const bool float_mask = c.mask && c.mask->dtype() != DType::kBool;
  Tensor m(float_mask ? c.mask->dtype() : DType::kBool, c.w_shape(), Role::kAny, true, LayoutSpec::plain());
  const Dims& d = c.d;
  int64_t at = 0;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Nq; ++i)
        for (int64_t j = 0; j < d.Nk; ++j, ++at) {
          const bool block = c.block_allows(b, h, i, j);
          if (float_mask) m.set_flat(at, block ? c.mask->at4(b, h, i, j) : -kInf);
          else m.set_flat(at, block && (!c.mask || c.mask->at4(b, h, i, j) != 0) ? 1.0 : 0.0);
        }
  return m;
}

// Bitwise equal (any NaN equals any NaN): "" or the first difference.
std::string outs_equal(const Outs& a, const Outs& b) {
  auto cmp = [](const Tensor& x, const Tensor& y, const char* name) -> std::string {
    for (int64_t n = 0; n < x.numel(); ++n) {
      const double p = x.flat(n), q = y.flat(n);
      if (!(same_bits(p, q) || (std::isnan(p) && std::isnan(q))))
        return std::string(name) + "[" + std::to_string(n) + "]: " + num(p) + " vs " + num(q);
    }
    return "";
  };
  std::string r = cmp(a.out, b.out, "out");
  if (r.empty() && a.weights && b.weights) r = cmp(*a.weights, *b.weights, "weights");
  if (r.empty() && a.lse && b.lse) r = cmp(*a.lse, *b.lse, "lse");
  return r;
}

// Key tile t (keys [128 t, 128 t + 128)) of (b, kvh) is blocked by the block mask for every row
// of every query head of the group: the header's fused forward then neither scores nor reads it.
std::vector<uint8_t> unread_tiles(const Case& c) {
  const Dims& d = c.d;
  constexpr int64_t kTile = 128;
  const int64_t tiles = ceil_div(d.Nk, kTile), group = d.group();
  std::vector<uint8_t> r(static_cast<size_t>(d.B * d.Hkv * tiles), 0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t kvh = 0; kvh < d.Hkv; ++kvh)
      for (int64_t t = 0; t < tiles; ++t) {
        bool blocked = true;
        for (int64_t h = kvh * group; h < (kvh + 1) * group && blocked; ++h)
          for (int64_t i = 0; i < d.Nq && blocked; ++i)
            for (int64_t j = t * kTile; j < std::min(d.Nk, (t + 1) * kTile) && blocked; ++j) blocked = !c.block_allows(b, h, i, j);
        r[static_cast<size_t>((b * d.Hkv + kvh) * tiles + t)] = blocked;
      }
  return r;
}

// The buffer elements of k (or v) that only keys of unread tiles use (one shared, through a zero or
// overlapping stride, with a key of a tile that is read is left alone).
std::vector<int64_t> unread_offsets(const Case& c, const std::vector<uint8_t>& unread, const Tensor& t, int64_t cols) {
  const Dims& d = c.d;
  if (t.numel() == 0) return {};
  const int64_t tiles = ceil_div(d.Nk, 128);
  std::vector<int64_t> in, out;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hkv; ++h)
      for (int64_t j = 0; j < d.Nk; ++j) {
        const bool skip = unread[static_cast<size_t>((b * d.Hkv + h) * tiles + j / 128)] != 0;
        for (int64_t e = 0; e < cols; ++e) (skip ? out : in).push_back(t.offset4(b, h, j, e));
      }
  std::sort(in.begin(), in.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  std::vector<int64_t> r;
  for (int64_t o : out) if (!std::binary_search(in.begin(), in.end(), o)) r.push_back(o);
  return r;
}

// block_equiv and blocks_unread on a valid forward with a block mask (`full`: the call's out,
// weights and lse).
void check_blocks_forward(Case& c, const Outs& full) {
  {
    const Tensor em = expanded_mask(c);
    sdpa::Inputs in = c.inputs();
    in.mask = em.view();
    sdpa::Options o = c.opt;
    o.block_mask.reset();
    Outs e = make_outs(c, true, true, false);
    run_forward(c, in, e, o);
    const std::string why = outs_equal(full, e);
    check(why.empty(), "block_equiv", [&] {
      return "attention with the block mask differs from the same call with the equivalent element mask (" + em.describe("mask") + "): " + why;
    });
  }
  if (c.opt.backend != Backend::kFlash && c.opt.backend != Backend::kAuto) return;
  const std::vector<uint8_t> unread = unread_tiles(c);
  Outs g2 = make_outs(c, true, true, false);
  size_t n = 0;
  {
    Garbage garbage(0xb10c0ffeull + g_bm_seed);
    garbage.values(c.k, unread_offsets(c, unread, c.k, c.d.Dk));
    garbage.values(c.v, unread_offsets(c, unread, c.v, c.d.Dv));
    n = garbage.count();
    if (n > 0) run_forward(c, c.inputs(), g2, c.opt);
  }
  if (n == 0) return;
  const std::string why = outs_equal(full, g2);
  check(why.empty(), "blocks_unread", [&] {
    return "attention with garbage (NaN, inf, random bits) in the k, v rows of " + std::to_string(n) +
           " elements of key tiles the block mask blocks for every row differs: " + why;
  });
}

void run_case(FuzzedDataProvider& f) {
  Case c;
  Invalid invalid = Invalid::kNone;
  if (!decode(f, c, invalid)) return;
  const Dims& d = c.d;
  sdpa::set_num_threads(c.threads);
  g_case = describe(c);
  if (g_print) std::fprintf(stderr, "attention_fuzz: case\n%s", g_case.c_str());

  // (d): a scale the compute type cannot hold is an Error now (float32 for 16-bit q too).
  const bool f32 = c.compute() == DType::kFloat32;
  bool bad_scale = false;
  if (c.opt.scale) {
    const double s = *c.opt.scale;
    bad_scale = !std::isfinite(s) || (f32 && (std::fabs(s) > FLT_MAX || (s != 0 && static_cast<float>(s) == 0)));
  }

  // An invalid seqlens_k (it comes before the other invalid arguments, whose backward-only kinds
  // need a valid forward).
  if (c.bad_sl != BadSeqlens::kNone) {
    run_bad_seqlens(c, bad_scale);
    return;
  }
  // An invalid score modifier (kExtModifiers, md bit 7).
  if (c.mods && c.mods->bad != BadMod::kNone) {
    run_bad_modifiers(c, bad_scale);
    return;
  }
  // An invalid block mask (kExtBlocks, bm_seed's top bits).
  if (c.blocks && c.blocks->bad != BadBlocks::kNone) {
    run_bad_blocks(c, bad_scale);
    return;
  }

  // Invalid arguments: must throw sdpa::Error, and write nothing.
  if (invalid != Invalid::kNone) {
    Outs o = make_outs(c, c.want_weights, c.want_lse, true);
    sdpa::Inputs in = c.inputs();
    sdpa::Outputs outs = o.outputs();
    bool must_throw = true;
    const bool bwd_only = invalid >= Invalid::kLsePosInf;
    if (!bwd_only) apply_invalid(c, invalid, in, outs, must_throw);
    if (c.mask) in.mask->data = c.mask->view().data;  // (values may have changed in place; same buffer)
    g_case = describe(c) + "invalid argument: " + kInvalidNames[static_cast<int>(invalid)] + "\n";
    if (!bwd_only) {
      const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                        o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
      bool threw = false;
      std::string what;
      try {
        sdpa::attention(in, outs, c.opt);
      } catch (const sdpa::Error& e) {
        threw = true;
        what = e.what();
      } catch (const std::exception& e) {
        check(false, "other_exception", [&] { return std::string("attention threw a non-sdpa::Error exception: ") + e.what(); });
      }
      if (threw) {
        const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                               (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
        check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") but an output buffer changed"; });
      } else {
        const bool is_d = invalid == Invalid::kScaleHugeF32 || invalid == Invalid::kScaleTinyF32;
        check(!must_throw, is_d ? "scale_range" : "error_expected", [&] { return std::string("no sdpa::Error for: ") + kInvalidNames[static_cast<int>(invalid)]; });
      }
      return;
    }
    // Backward-only invalid arguments: build a valid forward first.
    c.opt.backend = Backend::kReference;
    if (bad_scale) c.opt.scale = 1.0;
    Outs fo = make_outs(c, false, true, false);
    run_forward(c, c.inputs(), fo, c.opt);
    Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
    for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
    Grads g = make_grads(c, c.out_ls);
    sdpa::Gradients gr = g.gradients();
    sdpa::TensorView lse = fo.lse->view(), doutv = dout.view();
    must_throw = true;
    switch (invalid) {
      case Invalid::kLsePosInf: if (fo.lse->numel() > 0) fo.lse->set_flat(fo.lse->numel() - 1, kInf); else must_throw = false; break;
      case Invalid::kDoutShape: doutv.shape[c.rank - 1] += 1; break;
      case Invalid::kDqShape: gr.dq.shape[c.rank - 2] += 1; break;
      case Invalid::kDkStride0: { must_throw = false; if (g.dk.numel() > 0) for (int x = 0; x < c.rank; ++x) if (gr.dk.shape[x] > 1) { gr.dk.strides[x] = 0; must_throw = true; break; } break; }
      case Invalid::kDvDtype: gr.dv.dtype = c.bad_dv_dtype(); break;  // dv must have v's dtype or the compute type
      case Invalid::kGradNull: if (g.dq.numel() > 0) gr.dq.data = nullptr; else must_throw = false; break;
      default: must_throw = false; break;
    }
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    bool threw = false;
    std::string what;
    try {
      sdpa::attention_backward(c.inputs(), fo.out.view(), lse, doutv, gr, c.opt);
    } catch (const sdpa::Error& e) {
      threw = true;
      what = e.what();
    } catch (const std::exception& e) {
      check(false, "other_exception", [&] { return std::string("attention_backward threw a non-sdpa::Error exception: ") + e.what(); });
    }
    if (threw) {
      check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
            [&] { return "attention_backward: sdpa::Error(\"" + what + "\") but a gradient buffer changed"; });
    } else {
      const bool empty_grads = g.dq.numel() == 0 && g.dk.numel() == 0 && g.dv.numel() == 0;
      check(!must_throw, invalid == Invalid::kLsePosInf ? (empty_grads ? "lse_inf_backward_empty" : "lse_inf_backward") : "error_expected",
            [&] { return std::string("attention_backward: no sdpa::Error for: ") + kInvalidNames[static_cast<int>(invalid)]; });
    }
    return;
  }

  // A valid call, except maybe for (d).
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  if (bad_scale) {
    const auto snap = o.out.snapshot();
    bool threw = false;
    try {
      sdpa::attention(c.inputs(), o.outputs(), c.opt);
    } catch (const sdpa::Error&) {
      threw = true;
    }
    check(threw, "scale_range", [&] { return "scale " + num(*c.opt.scale) + " is not representable in " + (f32 ? "float32" : "float64") + " (or not finite) but no sdpa::Error"; });
    check(o.out.same_bytes(snap), "error_untouched", [&] { return std::string("scale Error but out changed"); });
    return;
  }
  run_forward(c, c.inputs(), o, c.opt);
  check_kernel_path(c, sdpa::last_kernel_path(), "attention");
  check_outs_written(o);

  // Repeatable, across thread counts.
  {
    sdpa::set_num_threads(3 - c.threads);
    Outs o2 = make_outs(c, c.want_weights, c.want_lse, false);
    run_forward(c, c.inputs(), o2, c.opt);
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(o.bitwise_equal(o2, why), "repeatable", [&] { return "two identical calls (threads " + std::to_string(c.threads) + " and " + std::to_string(3 - c.threads) + ") differ: " + why; });
  }

  // Edge semantics, from the classified scores (tame or not).
  {
    Outs full = make_outs(c, true, true, false);
    run_forward(c, c.inputs(), full, c.opt);
    std::string why;
    check(o.bitwise_equal(full, why), "weights_invariant", [&] { return "the same call with weights and lse requested differs: " + why; });
    std::vector<uint8_t> finite_rows;
    check_edge_semantics(c, full, &finite_rows);
    check_fast_forward(c, full, finite_rows);  // kFast only
    // seqlens_k: the same call with garbage in the keys past each length (and, under ASan,
    // those bytes unaddressable) gives the same bits.
    if (!c.seqlens.empty()) {
      Outs g2 = make_outs(c, true, true, false);
      bool ran = false;
      {
        PastKeysGarbage garbage(c, 0x9a4ba9eull + g_sk_seed);
        if (garbage.count() > 0) {
          run_forward(c, c.inputs(), g2, c.opt);
          ran = true;
        }
      }
      if (ran)
        check(full.bitwise_equal(g2, why), "seqlens_unread",
              [&] { return "attention with garbage (NaN, inf, random bits) in k, v past seqlens_k differs: " + why; });
    }
    // Block mask: the same bits as the equivalent element mask; tiles it skips are never read.
    if (c.blocks) check_blocks_forward(c, full);
  }

  if (c.tame) check_tolerance(c, o);
  // Outputs::stats and Outputs::scores against kReference (mode bits kModeStats: a quarter of the dense calls).
  if ((g_mode & kModeStats) == kModeStats) check_stats(c, o);

  // Poison: plant NaN/inf/huge in k or v (or q) and compare the rows it must not reach.
  const uint8_t pf = f.ConsumeIntegral<uint8_t>();
  if (pf & 1) {
    const int which = (pf >> 1) % 3;  // 0 v, 1 k, 2 q
    Tensor& t = which == 0 ? c.v : which == 1 ? c.k : c.q;
    if (t.numel() > 0) {
      static const double kPoison[] = {kNaN, kInf, -kInf, 1e30, -1e30, 3e38, 1e300};
      double pv = kPoison[(pf >> 3) % 7];
      const int64_t flat = f.ConsumeIntegral<uint32_t>() % t.numel();
      const int64_t off = t.offset_of_flat(flat);
      const double old = t.get_off(off);
      if (std::getenv("SDPA_FUZZ_POISON_NOOP")) pv = old;  // triage: is a difference caused by the poison at all?
      Outs base = make_outs(c, true, true, false);
      run_forward(c, c.inputs(), base, c.opt);
      const sdpa::KernelPath base_path = sdpa::last_kernel_path();
      t.set_off(off, pv);
      g_case = describe(c) + "poisoned " + (which == 0 ? "v" : which == 1 ? "k" : "q") + " flat index " + std::to_string(flat) + " = " + num(pv) + "\n";
      Outs pois = make_outs(c, true, true, false);
      run_forward(c, c.inputs(), pois, c.opt);
      std::vector<uint8_t> hit;
      const int64_t heads = which == 2 ? d.Hq : d.Hkv, rows = which == 2 ? d.Nq : d.Nk, cols = which == 0 ? d.Dv : d.Dk;
      poison_offsets(t, d, off, heads, rows, cols, hit);
      const std::vector<uint8_t> keep = keep_mask(c);
      // The first difference in the results of the rows the poison must not reach ("" if none).
      const auto compare = [&](const Outs& base_o, const Outs& pois_o) -> std::string {
        for (int64_t b = 0; b < d.B; ++b)
          for (int64_t h = 0; h < d.Hq; ++h)
            for (int64_t i = 0; i < d.Nq; ++i) {
              const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
              bool safe = true;
              if (which == 2) {
                if (hit[static_cast<size_t>(row)]) for (int64_t j = 0; j < d.Nk && safe; ++j) safe = !allowed(c, b, h, i, j);
              } else {
                for (int64_t j = 0; j < d.Nk && safe; ++j) {
                  if (!hit[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)]) continue;
                  const bool dropped = which == 0 && !keep.empty() && !keep[static_cast<size_t>(row * d.Nk + j)];
                  safe = !allowed(c, b, h, i, j) || dropped;
                }
              }
              if (!safe) continue;
              const std::string at = "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i) + ", ";
              auto cmp = [&](const Tensor& x, const Tensor& y, const char* name, int64_t col) -> std::string {
                const double a = x.at4(b, h, i, col), bb = y.at4(b, h, i, col);
                if (same_value(a, bb)) return "";
                return std::string(name) + at + std::to_string(col) + "] changed from " + num(bb) + " to " + num(a) +
                       " when a value this row must not see (blocked" + (which == 0 ? " or dropped" : "") +
                       " key, or the q of a row with no allowed key) was poisoned";
              };
              // The column of a NaN/inf planted in v is recomputed by the reference's row code in
              // the same precision (finish_block): equal within the rounding of a sum of Nk terms
              // of |w·v| <= max|v|, not bit for bit. Every other column keeps its bits.
              const int64_t pcol = which == 0 && d.Dv > 0 ? flat % d.Dv : -1;
              for (int64_t e = 0; e < d.Dv; ++e) {
                if (e == pcol && !std::isfinite(c.v.flat(flat))) {  // as stored: 1e300 is inf in float32
                  const double a = pois_o.out.at4(b, h, i, e), bb = base_o.out.at4(b, h, i, e);
                  double vmax = 0;
                  for (int64_t n = 0; n < c.v.numel(); ++n) {
                    if (n != flat && std::isfinite(c.v.flat(n))) vmax = std::max(vmax, std::fabs(c.v.flat(n)));
                  }
                  const double eps = sdpa_oracle::eps(c.compute());
                  // A 16-bit out: the two float32 values, within that rounding, may round to
                  // neighbouring 16-bit values: one unit in out's last place (|out| <= max|v| / (1 - p)).
                  const double ulp = is16(c.dtype) ? sdpa_oracle::eps(c.dtype) * vmax / (1 - c.opt.dropout_p) : 0.0;
                  const double tol = 4 * static_cast<double>(d.Nk + 2) * eps * vmax + ulp;
                  if (!(same_value(a, bb) || std::fabs(a - bb) <= tol))
                    return "out" + at + std::to_string(e) + "] (the poisoned column) changed from " + num(bb) + " to " + num(a) +
                           ", more than tol " + num(tol);
                  continue;
                }
                if (std::string r = cmp(pois_o.out, base_o.out, "out", e); !r.empty()) return r;
              }
              for (int64_t j = 0; j < d.Nk; ++j)
                if (std::string r = cmp(*pois_o.weights, *base_o.weights, "weights", j); !r.empty()) return r;
              const double la = pois_o.lse->at4(0, b, h, i), lb = base_o.lse->at4(0, b, h, i);
              if (!same_value(la, lb)) return "lse[" + std::to_string(row) + "] changed from " + num(lb) + " to " + num(la) + " after poisoning";
            }
        return "";
      };
      const std::string why = compare(base, pois);
      const char* name = "poison_fwd";
      if (!why.empty() && c.all_bf16() && base_path != sdpa::KernelPath::kSimd) {
        // The bfloat16 dot-product path widens a whole tile of keys (block of queries) when one
        // value of it is outside [2^-40, 2^32): the poison may have switched the path of the
        // rows' other keys. The same pair of calls on kSimd tells that apart (FINDINGS.md F10).
        sdpa::set_max_kernel_path(sdpa::KernelPath::kSimd);
        t.set_off(off, old);
        Outs base2 = make_outs(c, true, true, false);
        run_forward(c, c.inputs(), base2, c.opt);
        t.set_off(off, pv);
        Outs pois2 = make_outs(c, true, true, false);
        run_forward(c, c.inputs(), pois2, c.opt);
        sdpa::set_max_kernel_path(c.path_cap);
        if (compare(base2, pois2).empty()) name = "poison_fwd_dot_path";
      }
      check(why.empty(), name, [&] {
        return why + (name != std::string("poison_fwd") ? " (on the bfloat16 dot-product path; the same calls capped at kSimd agree)" : "");
      });
      t.set_off(off, old);
      g_case = describe(c);
    }
  }

  if (!c.backward) return;

  // ---- Backward: from this forward's out and lse ----
  Tensor& lse = *o.lse;
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, decode_layout(f, true));
  {
    std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
    fill_values(dout, rng, 1.0, 0);
  }
  bool lse_pinf = false;
  for (int64_t n = 0; n < lse.numel(); ++n) lse_pinf |= lse.flat(n) == kInf;
  Grads g = make_grads(c, c.out_ls, true);
  if (lse_pinf) {  // (e)
    const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
    const auto s3 = g.dsinks ? g.dsinks->snapshot() : std::vector<std::byte>{};
    bool threw = false;
    try {
      sdpa::attention_backward(c.inputs(), o.out.view(), lse.view(), dout.view(), g.gradients(), c.opt);
    } catch (const sdpa::Error&) {
      threw = true;
    }
    check(threw, "lse_inf_backward", [&] { return std::string("attention_backward with +inf in lse (the forward overflowed) did not throw"); });
    check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2) && (!g.dsinks || g.dsinks->same_bytes(s3)), "error_untouched",
          [] { return std::string("backward Error but a gradient changed"); });
    return;
  }
  run_backward(c, c.inputs(), o.out, lse, dout, g, c.opt);
  const sdpa::KernelPath bwd_path = sdpa::last_kernel_path();
  check_kernel_path(c, bwd_path, "attention_backward");
  for (const auto& tn : {std::pair<const Tensor*, const char*>{&g.dq, "dq"}, {&g.dk, "dk"}, {&g.dv, "dv"},
                         {g.dsinks ? &*g.dsinks : nullptr, "dsinks"}}) {
    if (tn.first == nullptr) continue;
    const char* name = tn.second;
    const std::string r = tn.first->guards_and_written();
    check(r.empty() || r.rfind("guards", 0) != 0, "guards", [&] { return std::string(name) + ": " + r; });
    check(r.empty(), "unwritten", [&] { return std::string(name) + ": " + r; });
  }
  {
    sdpa::set_num_threads(3 - c.threads);
    Grads g2 = make_grads(c, LayoutSpec::plain());
    run_backward(c, c.inputs(), o.out, lse, dout, g2, c.opt);
    sdpa::set_num_threads(c.threads);
    std::string why;
    check(grads_bitwise(g, g2, why), "repeatable", [&] { return "two identical backward calls (threads 1 and 2) differ: " + why; });
  }
  check_fast_backward(c, o.out, lse, dout, g);  // kFast only
  if (c.blocks) {  // block_equiv: the gradients of the equivalent element mask, bit for bit (NaN = NaN)
    const Tensor em = expanded_mask(c);
    sdpa::Inputs in = c.inputs();
    in.mask = em.view();
    sdpa::Options eo = c.opt;
    eo.block_mask.reset();
    Grads ge = make_grads(c, LayoutSpec::plain());
    run_backward(c, in, o.out, lse, dout, ge, eo);
    const GradVals a = gvals(g), b = gvals(ge);
    std::string why;
    for (int n = 0; n < 4 && why.empty(); ++n)
      for (size_t x = 0; x < a.g[n].size(); ++x)
        if (!(same_bits(a.g[n][x], b.g[n][x]) || (std::isnan(a.g[n][x]) && std::isnan(b.g[n][x])))) {
          why = std::string(kGradNames[n]) + "[" + std::to_string(x) + "]: " + num(a.g[n][x]) + " vs " + num(b.g[n][x]);
          break;
        }
    check(why.empty(), "block_equiv", [&] {
      return "attention_backward with the block mask differs from the same call with the equivalent element mask: " + why;
    });
  }
  if (!c.seqlens.empty()) {  // as seqlens_unread in the forward
    Grads g3 = make_grads(c, LayoutSpec::plain());
    bool ran = false;
    {
      PastKeysGarbage garbage(c, 0xb4c4ba9eull + g_sk_seed);
      if (garbage.count() > 0) {
        run_backward(c, c.inputs(), o.out, lse, dout, g3, c.opt);
        ran = true;
      }
    }
    std::string why;
    if (ran) check(grads_bitwise(g, g3, why), "seqlens_unread", [&] { return "attention_backward with garbage in k, v past seqlens_k differs: " + why; });
  }
  // (e): rows with no allowed key: dq = 0; keys no row allows: dk = dv = 0.
  {
    std::vector<uint8_t> key_used(static_cast<size_t>(d.B * d.Hkv * d.Nk), 0);
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t i = 0; i < d.Nq; ++i) {
          bool any = false;
          for (int64_t j = 0; j < d.Nk; ++j)
            if (allowed(c, b, h, i, j)) { any = true; key_used[static_cast<size_t>((b * d.Hkv + h / d.group()) * d.Nk + j)] = 1; }
          if (any) continue;
          for (int64_t x = 0; x < d.Dk; ++x) {
            const double v = g.dq.at4(b, h, i, x);
            check(v == 0, "masked_grad", [&] { return "dq[b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", i=" + std::to_string(i) + ", " + std::to_string(x) + "] = " + num(v) + " but the row has no allowed key"; });
          }
        }
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t kvh = 0; kvh < d.Hkv; ++kvh)
        for (int64_t j = 0; j < d.Nk; ++j) {
          if (key_used[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)]) continue;
          for (int64_t x = 0; x < d.Dk; ++x) {
            const double v = g.dk.at4(b, kvh, j, x);
            check(v == 0, "masked_grad", [&] { return "dk[b=" + std::to_string(b) + ", kvh=" + std::to_string(kvh) + ", j=" + std::to_string(j) + ", " + std::to_string(x) + "] = " + num(v) + " but no row allows that key"; });
          }
          for (int64_t x = 0; x < d.Dv; ++x) {
            const double v = g.dv.at4(b, kvh, j, x);
            check(v == 0, "masked_grad", [&] { return "dv[b=" + std::to_string(b) + ", kvh=" + std::to_string(kvh) + ", j=" + std::to_string(j) + ", " + std::to_string(x) + "] = " + num(v) + " but no row allows that key"; });
          }
        }
  }
  bool finite_inputs = true;
  for (const Tensor* t : {&o.out, &lse}) for (int64_t n = 0; n < t->numel(); ++n) finite_inputs &= std::isfinite(t->flat(n)) || t->flat(n) == -kInf;
  if (c.tame && finite_inputs) check_bwd_tolerance(c, o.out, lse, dout, g);

  // Poison for the backward: v, k, q or dout; compare what it must not reach.
  const uint8_t bf = f.ConsumeIntegral<uint8_t>();
  if (bf & 1) {
    const int which = (bf >> 1) % 4;  // 0 v, 1 k, 2 q, 3 dout
    Tensor& t = which == 0 ? c.v : which == 1 ? c.k : which == 2 ? c.q : dout;
    if (t.numel() > 0) {
      static const double kPoison[] = {kNaN, kInf, -kInf, 1e30};
      const double pv = kPoison[(bf >> 3) % 4];
      const int64_t flat = f.ConsumeIntegral<uint32_t>() % t.numel();
      const int64_t off = t.offset_of_flat(flat);
      const double old = t.get_off(off);
      t.set_off(off, pv);
      g_case = describe(c) + "backward: poisoned " + (which == 0 ? "v" : which == 1 ? "k" : which == 2 ? "q" : "dout") + " flat index " + std::to_string(flat) + " = " + num(pv) + "\n";
      Grads gp = make_grads(c, LayoutSpec::plain());
      run_backward(c, c.inputs(), o.out, lse, dout, gp, c.opt);
      std::vector<uint8_t> hit;
      const bool by_row = which >= 2;
      const int64_t heads = by_row ? d.Hq : d.Hkv, rows = by_row ? d.Nq : d.Nk, cols = which == 0 || which == 3 ? d.Dv : d.Dk;
      poison_offsets(t, d, off, heads, rows, cols, hit);
      const std::vector<uint8_t> keep = keep_mask(c);
      std::vector<uint8_t> row_hit(static_cast<size_t>(d.B * d.Hq * d.Nq), 0), key_hit(static_cast<size_t>(d.B * d.Hkv * d.Nk), 0);
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.Hq; ++h)
          for (int64_t i = 0; i < d.Nq; ++i) {
            const int64_t row = (b * d.Hq + h) * d.Nq + i, kvh = h / d.group();
            for (int64_t j = 0; j < d.Nk; ++j) {
              const int64_t key = (b * d.Hkv + kvh) * d.Nk + j;
              if (!allowed(c, b, h, i, j)) continue;
              const bool kept = keep.empty() || keep[static_cast<size_t>(row * d.Nk + j)];
              const bool poisoned = by_row ? hit[static_cast<size_t>(row)] != 0 : hit[static_cast<size_t>(key)] != 0;
              if (!poisoned) continue;
              if (which == 0 && !kept) continue;  // a dropped key's v reaches nothing
              row_hit[static_cast<size_t>(row)] = 1;
              key_hit[static_cast<size_t>(key)] = 1;
            }
            // A poisoned k or q changes that row's softmax, as kReference and kNaive recompute it
            // (the fused kernel reads it from lse): every key the row allows may change.
            if (row_hit[static_cast<size_t>(row)] && (which == 1 || which == 2))
              for (int64_t j = 0; j < d.Nk; ++j)
                if (allowed(c, b, h, i, j)) key_hit[static_cast<size_t>((b * d.Hkv + kvh) * d.Nk + j)] = 1;
          }
      std::vector<uint8_t> dk_aff = key_hit, dv_aff = key_hit;
      if (which == 0) std::fill(dv_aff.begin(), dv_aff.end(), 0);  // dv_j does not read v
      // dsinks_h: the heads of rows whose dout was poisoned; with kReference and kNaive, which
      // recompute each row's lse from q and k (src/reference_backward.cc), also the heads of the
      // rows a poisoned q or k reaches (row_hit).
      std::vector<uint8_t> ds_aff(static_cast<size_t>(d.Hq), 0);
      const bool recomputes = c.opt.backend == Backend::kReference || c.opt.backend == Backend::kNaive;
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.Hq; ++h)
          for (int64_t i = 0; i < d.Nq; ++i) {
            const size_t row = static_cast<size_t>((b * d.Hq + h) * d.Nq + i);
            if ((which == 3 && hit[row]) || ((which == 1 || which == 2) && recomputes && row_hit[row])) ds_aff[static_cast<size_t>(h)] = 1;
          }
      // The first difference between the gradients the poison must not reach ("" if none).
      const auto compare = [&](const Grads& base_g, const Grads& pois_g) -> std::string {
        const GradVals a = gvals(pois_g), base = gvals(base_g);
        auto cmp_all = [&](int n, int64_t rowsn, int64_t colsn, const std::vector<uint8_t>& affected) -> std::string {
          for (int64_t r = 0; r < rowsn; ++r) {
            if (affected[static_cast<size_t>(r)]) continue;
            for (int64_t x = 0; x < colsn; ++x) {
              const size_t at = static_cast<size_t>(r * colsn + x);
              if (!same_value(a.g[n][at], base.g[n][at]))
                return std::string(kGradNames[n]) + " row " + std::to_string(r) + " col " + std::to_string(x) + " changed from " + num(base.g[n][at]) + " to " +
                       num(a.g[n][at]) + " after poisoning a value it must not see (a blocked/dropped key, or a row with no allowed key)";
            }
          }
          return "";
        };
        std::string r = cmp_all(0, d.B * d.Hq * d.Nq, d.Dk, row_hit);
        if (r.empty()) r = cmp_all(1, d.B * d.Hkv * d.Nk, d.Dk, dk_aff);
        if (r.empty()) r = cmp_all(2, d.B * d.Hkv * d.Nk, d.Dv, dv_aff);
        // dsinks_h reads only sink_h, lse, out and dout (the header's formula): a poisoned q, k or
        // v changes none of it (kFlash), a poisoned dout only the head of its rows.
        if (r.empty() && !a.g[3].empty()) r = cmp_all(3, d.Hq, 1, ds_aff);
        return r;
      };
      const std::string why = compare(g, gp);
      const char* name = "poison_bwd";
      if (!why.empty() && c.all_bf16() && bwd_path != sdpa::KernelPath::kSimd) {
        // As poison_fwd_dot_path: the same pair of backward calls (same out, lse) on kSimd.
        sdpa::set_max_kernel_path(sdpa::KernelPath::kSimd);
        t.set_off(off, old);
        Grads g2 = make_grads(c, LayoutSpec::plain());
        run_backward(c, c.inputs(), o.out, lse, dout, g2, c.opt);
        t.set_off(off, pv);
        Grads gp2 = make_grads(c, LayoutSpec::plain());
        run_backward(c, c.inputs(), o.out, lse, dout, gp2, c.opt);
        sdpa::set_max_kernel_path(c.path_cap);
        if (compare(g2, gp2).empty()) name = "poison_bwd_dot_path";
      }
      check(why.empty(), name, [&] {
        return why + (name != std::string("poison_bwd") ? " (on the bfloat16 dot-product path; the same calls capped at kSimd agree)" : "");
      });
      t.set_off(off, old);
      g_case = describe(c);
    }
  }
}

}  // namespace sdpa_fuzz
