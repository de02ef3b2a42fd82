// attention_fuzz: invalid arguments: error_expected, error_untouched, error_names.
#include "harness.h"

namespace sdpa_fuzz {

// ---- Invalid arguments ----

void apply_invalid(Case& c, Invalid inv, sdpa::Inputs& in, sdpa::Outputs& outs, bool& must_throw) {
  must_throw = true;
  const int r = c.rank;
  switch (inv) {
    case Invalid::kQBool: in.q.dtype = DType::kBool; break;
    // 16-bit cases break the dtype policy in their own ways: k and v of different 16-bit dtypes,
    // an out of the other 16-bit dtype (q's and the compute type are both out's), weights or lse
    // of the wrong one of q's dtype and the compute type.
    case Invalid::kKDtype:
      if (c.lowp() && c.d.Nq % 2) in.v.dtype = c.kv == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
      else in.k.dtype = c.dtype == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32;
      break;
    case Invalid::kOutDtype:
      outs.out.dtype = !c.lowp()                       ? DType::kBool
                       : c.dtype == DType::kBFloat16 ? DType::kFloat16
                       : c.dtype == DType::kFloat16  ? DType::kBFloat16
                                                     : c.kv;
      break;
    case Invalid::kWeightsDtype:
      if (outs.weights) outs.weights->dtype = is16(c.dtype) ? c.dtype : c.compute() == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32;
      else must_throw = false;
      break;
    case Invalid::kLseDtype:
      if (outs.lse) outs.lse->dtype = !c.lowp() ? DType::kBool : is16(c.dtype) ? c.dtype : c.kv;
      else must_throw = false;
      break;
    case Invalid::kMaskDtype:  // a float mask of a dtype neither float32 nor q's (float32 is allowed under any q)
      if (in.mask && c.mask->dtype() != DType::kBool)
        in.mask->dtype = c.dtype == DType::kFloat32 ? (c.lowp() ? c.kv : DType::kFloat64) : c.dtype == DType::kFloat16 ? DType::kBFloat16 : DType::kFloat16;
      else must_throw = false;
      break;
    case Invalid::kDk: in.k.shape[r - 1] += 1; break;
    case Invalid::kNkV: in.v.shape[r - 2] += 1; break;
    case Invalid::kHeads: if (r >= 3 && c.d.Hkv > 0 && c.d.Hq > 0) { in.q.shape[r - 3] = c.d.Hq + 1; if ((c.d.Hq + 1) % c.d.Hkv == 0) in.q.shape[r - 3] = c.d.Hq + 1 + (c.d.Hkv > 1 ? 1 : 0); if (in.q.shape[r - 3] % c.d.Hkv == 0) must_throw = false; } else must_throw = false; break;
    case Invalid::kBatch: if (r == 4) in.k.shape[0] += 1; else must_throw = false; break;
    case Invalid::kOutShape: outs.out.shape[r - 1] += 1; break;
    case Invalid::kWeightsShape: if (outs.weights) outs.weights->shape[r - 1] += 1; else must_throw = false; break;
    case Invalid::kLseShape: if (outs.lse) outs.lse->shape[outs.lse->rank - 1] += 1; else must_throw = false; break;
    case Invalid::kMaskShape: if (in.mask && in.mask->rank > 0) { in.mask->shape[in.mask->rank - 1] = c.d.Nk + 2; } else must_throw = false; break;
    case Invalid::kMaskRank: if (in.mask && r < 4) { sdpa::TensorView& m = *in.mask; for (int x = m.rank; x > 0; --x) { m.shape[x] = m.shape[x - 1]; m.strides[x] = m.strides[x - 1]; } m.shape[0] = 1; m.strides[0] = 0; m.rank += 1; if (m.rank <= r) must_throw = false; } else must_throw = false; break;
    case Invalid::kRank: in.q.rank = 1; break;
    case Invalid::kRankMismatch: if (r > 2) { in.k.rank = r - 1; for (int x = 0; x < r - 1; ++x) { in.k.shape[x] = in.k.shape[x + 1]; in.k.strides[x] = in.k.strides[x + 1]; } } else must_throw = false; break;
    case Invalid::kNullData: if (c.q.numel() > 0) in.q.data = nullptr; else if (c.d.B * c.d.Hq * c.d.Nq * c.d.Dv > 0) outs.out.data = nullptr; else must_throw = false; break;
    case Invalid::kOutStride0: { bool any = false; for (int x = 0; x < r; ++x) if (outs.out.shape[x] > 1 && c.q.numel() >= 0) { outs.out.strides[x] = 0; any = true; break; } must_throw = any && c.out_shape().size() && [&] { int64_t n = 1; for (int64_t s : c.out_shape()) n *= s; return n > 0; }(); break; }
    case Invalid::kWeightsStride0: { must_throw = false; if (outs.weights) { int64_t n = 1; for (int64_t s : c.w_shape()) n *= s; for (int x = 0; x < r; ++x) if (outs.weights->shape[x] > 1) { outs.weights->strides[x] = 0; must_throw = n > 0; break; } } break; }
    case Invalid::kLseStride0: { must_throw = false; if (outs.lse) { int64_t n = 1; for (int64_t s : c.lse_shape()) n *= s; for (int x = 0; x < outs.lse->rank; ++x) if (outs.lse->shape[x] > 1) { outs.lse->strides[x] = 0; must_throw = n > 0; break; } } break; }
    case Invalid::kLastStride: if (c.q.numel() > 0 && c.d.Dk > 1) in.q.strides[r - 1] = in.q.strides[r - 1] == 1 ? 2 : 1; else must_throw = false;
      if (must_throw && in.q.strides[r - 1] == 1) must_throw = false;
      break;
    case Invalid::kNegDim: in.v.shape[r - 1] = -1; break;
    case Invalid::kScaleNaN: c.opt.scale = kNaN; break;
    case Invalid::kScaleInf: c.opt.scale = -kInf; break;
    case Invalid::kScaleHugeF32: c.opt.scale = c.compute() == DType::kFloat32 ? 1e39 : kInf; break;               // (d)
    case Invalid::kScaleTinyF32: c.opt.scale = c.compute() == DType::kFloat32 ? 1e-46 : std::nan(""); break;       // (d)
    case Invalid::kDropoutRange: { static const double bad[] = {-0.1, 1.0, 1.5, kNaN, kInf}; c.opt.dropout_p = bad[c.d.Nq % 5]; c.opt.seed = 1; break; }
    case Invalid::kDropoutNoSeed: c.opt.dropout_p = 0.5; c.opt.seed.reset(); break;
    case Invalid::kMaskNaN:
    case Invalid::kMaskPosInf:
      if (c.mask && c.mask->dtype() != DType::kBool && c.mask->numel() > 0) c.mask->set_flat(c.mask->numel() / 2, inv == Invalid::kMaskNaN ? kNaN : kInf);
      else must_throw = false;
      break;
    case Invalid::kBackendEnum: c.opt.backend = static_cast<Backend>(7); break;
    case Invalid::kCausalEnum: c.opt.causal = static_cast<Causal>(9); break;
    case Invalid::kNumelOverflow: in.q.shape[0] = int64_t{1} << 40; in.q.shape[r - 1] = int64_t{1} << 40; in.q.rank = r;
      if (r == 2) { in.q.shape[0] = int64_t{1} << 40; in.q.shape[1] = int64_t{1} << 40; }
      break;
    default: must_throw = false; break;
  }
}

// An invalid seqlens_k (negative, past Nk, wrong shape, rank or dtype, null): attention,
// validate and attention_backward throw sdpa::Error and write nothing.
void run_bad_seqlens(Case& c, bool bad_scale) {
  const char* what_bad = kBadSeqlensNames[static_cast<int>(c.bad_sl)];
  g_case = describe(c) + "invalid seqlens_k: " + what_bad + "\n";
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                    o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
  std::string what;
  const bool threw = throws_sdpa_error("attention", [&] { sdpa::attention(c.inputs(), o.outputs(), c.opt); }, what);
  check(threw, "error_expected", [&] { return std::string("attention: no sdpa::Error for an invalid seqlens_k: ") + what_bad; });
  const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                         (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
  check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") for seqlens_k but an output buffer changed"; });
  check(throws_sdpa_error("validate", [&] { sdpa::validate(c.inputs(), c.opt); }, what), "error_expected",
        [&] { return std::string("validate: no sdpa::Error for an invalid seqlens_k: ") + what_bad; });
  if (!c.backward) return;
  // attention_backward with out and lse of a valid forward (the same call without seqlens_k).
  sdpa::Options opt = c.opt;
  opt.backend = Backend::kReference;
  if (bad_scale) opt.scale = 1.0;
  sdpa::Inputs in = c.inputs();
  in.seqlens_k.reset();
  Outs fo = make_outs(c, false, true, false);
  expect_no_throw("attention (without seqlens_k)", [&] { sdpa::attention(in, fo.outputs(), opt); });
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
  Grads g = make_grads(c, c.out_ls);
  const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
  const bool bthrew = throws_sdpa_error("attention_backward", [&] {
    sdpa::attention_backward(c.inputs(), fo.out.view(), fo.lse->view(), dout.view(), g.gradients(), opt);
  }, what);
  check(bthrew, "error_expected", [&] { return std::string("attention_backward: no sdpa::Error for an invalid seqlens_k: ") + what_bad; });
  check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2), "error_untouched",
        [&] { return "attention_backward: sdpa::Error(\"" + what + "\") for seqlens_k but a gradient buffer changed"; });
}

// An invalid score modifier (md bit 7, BadMod): attention and validate throw sdpa::Error and write
// nothing, and so does attention_backward (given the out and lse of a valid forward) on backward
// calls; the kDsinks* kinds break only the backward's Gradients::dsinks (dsinks untouched too).
void run_bad_modifiers(Case& c, bool bad_scale) {
  const Modifiers& m = *c.mods;
  const char* what_bad = kBadModNames[static_cast<int>(m.bad)];
  g_case = describe(c);
  std::mt19937_64 rng(m.bad_seed);
  const int64_t Hq = c.d.Hq, B = c.rank == 4 ? c.d.B : 1;
  const bool f32 = c.compute() == DType::kFloat32;
  sdpa::Options bad = c.opt;
  std::optional<Tensor> made;  // the tensor behind a broken view
  bool must_throw = true;
  const auto small = [&](DType dt, std::vector<int64_t> shape, bool input = true) -> Tensor& {
    made.emplace(dt, std::move(shape), Role::kAny, input, LayoutSpec::plain());
    for (int64_t n = 0; input && n < made->numel(); ++n) made->set_flat(n, 0.25);
    return *made;
  };
  static const DType kBadDtype[] = {DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kBool};
  const double kNonFinite[] = {kNaN, kInf, -kInf, f32 ? 1e39 : kNaN};  // 1e39: finite, but not in float32
  const auto with_value = [&](std::optional<sdpa::TensorView>& slot) {
    if (Hq == 0) { must_throw = false; return; }
    Tensor& t = small(rng() % 2 ? DType::kFloat64 : DType::kFloat32, {Hq});
    t.set_flat(static_cast<int64_t>(rng() % static_cast<uint64_t>(Hq)), kNonFinite[rng() % 4]);
    slot = t.view();
  };
  const auto with_dtype = [&](std::optional<sdpa::TensorView>& slot) {
    sdpa::TensorView v = small(DType::kFloat32, {Hq}).view();
    v.dtype = kBadDtype[rng() % 4];
    slot = v;
  };
  const auto with_null = [&](std::optional<sdpa::TensorView>& slot) {
    if (Hq == 0) { must_throw = false; return; }
    sdpa::TensorView v = small(DType::kFloat32, {Hq}).view();
    v.data = nullptr;
    slot = v;
  };
  switch (m.bad) {
    case BadMod::kCapNegative: bad.softcap = rng() % 2 ? -1.0 : -1e-30; break;
    case BadMod::kCapNaN: bad.softcap = kNaN; break;
    case BadMod::kCapInf: bad.softcap = rng() % 2 ? kInf : -kInf; break;
    case BadMod::kCapRange: bad.softcap = f32 ? (rng() % 2 ? 1e39 : 1e-40) : -DBL_MIN; break;  // float32: not a normal float32
    case BadMod::kOrderEnum: bad.softcap_order = static_cast<sdpa::Options::SoftcapOrder>(2 + rng() % 200); break;
    case BadMod::kSlopesShape: bad.alibi_slopes = small(DType::kFloat32, {Hq + 1}).view(); break;
    case BadMod::kSlopesBatch: bad.alibi_slopes = small(DType::kFloat64, {B + 2, Hq}).view(); break;
    case BadMod::kSlopesRank: bad.alibi_slopes = small(DType::kFloat32, {1, 1, Hq}).view(); break;
    case BadMod::kSlopesDtype: with_dtype(bad.alibi_slopes); break;
    case BadMod::kSlopesValue: with_value(bad.alibi_slopes); break;
    case BadMod::kSlopesNull: with_null(bad.alibi_slopes); break;
    case BadMod::kSinksShape: bad.sinks = small(DType::kFloat64, {Hq + 1}).view(); break;
    case BadMod::kSinksRank: bad.sinks = small(DType::kFloat32, {1, Hq}).view(); break;
    case BadMod::kSinksDtype: with_dtype(bad.sinks); break;
    case BadMod::kSinksValue: with_value(bad.sinks); break;
    case BadMod::kSinksNull: with_null(bad.sinks); break;
    default: break;
  }
  std::string what;
  // The out and lse of a valid forward (the case's own modifiers; scale 1 where the case's is
  // out of range), for attention_backward.
  sdpa::Options ok = c.opt;
  ok.backend = Backend::kReference;
  if (bad_scale) ok.scale = 1.0;
  if (m.bad == BadMod::kDsinksNoSinks) ok.sinks.reset();
  if (m.bad < BadMod::kDsinksNoSinks) {
    if (!must_throw) return;  // nothing to break (Hq = 0)
    Outs o = make_outs(c, c.want_weights, c.want_lse, true);
    const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                      o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
    const bool threw = throws_sdpa_error("attention", [&] { sdpa::attention(c.inputs(), o.outputs(), bad); }, what);
    check(threw, "error_expected", [&] { return std::string("attention: no sdpa::Error for an invalid modifier: ") + what_bad; });
    const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                           (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
    check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") for a modifier but an output buffer changed"; });
    check(throws_sdpa_error("validate", [&] { sdpa::validate(c.inputs(), bad); }, what), "error_expected",
          [&] { return std::string("validate: no sdpa::Error for an invalid modifier: ") + what_bad; });
    if (!c.backward) return;
  }
  Outs fo = make_outs(c, false, true, false);
  expect_no_throw("attention (valid modifiers)", [&] { sdpa::attention(c.inputs(), fo.outputs(), ok); });
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
  Grads g = make_grads(c, c.out_ls, true);
  sdpa::Gradients gr = g.gradients();
  sdpa::Options bo = bad;
  bo.backend = Backend::kReference;
  if (bad_scale) bo.scale = 1.0;
  if (m.bad >= BadMod::kDsinksNoSinks) {
    bo = ok;
    Tensor& ds = small(DType::kFloat32, {m.bad == BadMod::kDsinksShape ? Hq + 1 : Hq}, false);
    gr.dsinks = ds.view();
    if (m.bad == BadMod::kDsinksDtype) gr.dsinks->dtype = kBadDtype[rng() % 4];
    if (m.bad == BadMod::kDsinksStride0) {
      gr.dsinks->strides[0] = 0;
      must_throw = Hq > 1 || !ok.sinks;  // one element may have any stride; without sinks dsinks is an Error
    }
    if (!must_throw) return;
  }
  const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
  const auto s3 = g.dsinks ? g.dsinks->snapshot() : std::vector<std::byte>{};
  const auto s4 = made && !(m.bad < BadMod::kDsinksNoSinks) ? made->snapshot() : std::vector<std::byte>{};
  const bool bthrew = throws_sdpa_error("attention_backward", [&] {
    sdpa::attention_backward(c.inputs(), fo.out.view(), fo.lse->view(), dout.view(), gr, bo);
  }, what);
  check(bthrew, "error_expected", [&] { return std::string("attention_backward: no sdpa::Error for an invalid modifier: ") + what_bad; });
  check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2) && (!g.dsinks || g.dsinks->same_bytes(s3)) &&
            (s4.empty() || made->same_bytes(s4)),
        "error_untouched", [&] { return "attention_backward: sdpa::Error(\"" + what + "\") for a modifier but a gradient buffer changed"; });
}

// The header's Error for a block mask names it: "block_mask", or "block_q" / "block_k" for a
// size below 1.
void check_error_names(const std::string& what, const char* name, const char* call, const char* what_bad) {
  check(what.find(name) != std::string::npos, "error_names", [&] {
    return std::string(call) + ": the sdpa::Error for an invalid block mask (" + what_bad + ") does not name " + name + ": \"" + what + "\"";
  });
}

// An invalid block mask (BadBlocks): attention, validate and (backward calls, given the out and lse
// of a valid forward) attention_backward throw an sdpa::Error that names block_mask (block_q,
// block_k) and write nothing. The rest of the call is valid (a scale the compute type cannot hold
// is replaced by 1, so that the block mask is the only fault).
void run_bad_blocks(Case& c, bool bad_scale) {
  const BlockMask& bl = *c.blocks;
  const char* what_bad = kBadBlocksNames[static_cast<int>(bl.bad)];
  g_case = describe(c);
  std::mt19937_64 rng(bl.bad_seed);
  sdpa::Options bad = c.opt;
  if (bad_scale) bad.scale = 1.0;
  const char* name = "block_mask";
  std::optional<Tensor> made;  // the tensor behind a broken view
  sdpa::TensorView v = bl.mask.view();
  std::vector<int64_t> shape = bl.mask.shape();
  const int r = c.rank, mr = bl.mask.rank();
  const auto bool_tensor = [&](std::vector<int64_t> sh) -> sdpa::TensorView {
    made.emplace(DType::kBool, std::move(sh), Role::kAny, true, block_layout(rng));
    for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, rng() % 2 ? 1.0 : 0.0);
    return made->view();
  };
  switch (bl.bad) {
    case BadBlocks::kDtype: {
      // A float64 buffer of the mask's shape (8 bytes an element: room for any dtype's view).
      made.emplace(DType::kFloat64, shape, Role::kAny, true, LayoutSpec::plain());
      for (int64_t n = 0; n < made->numel(); ++n) made->set_flat(n, 1.0);
      v = made->view();
      static const DType kBad[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64};
      v.dtype = kBad[rng() % 6];
      break;
    }
    case BadBlocks::kShape: {
      const size_t d = static_cast<size_t>(mr - 1 - static_cast<int>(rng() % 2));
      if (shape[d] > 0 && rng() % 2) shape[d] -= 1; else shape[d] += 1;
      v = bool_tensor(shape);
      break;
    }
    case BadBlocks::kLeadShape: {
      // A leading dim that is neither 1 nor its B / Hq (that + 2); a mask without one gets (Hq + 2, ..)
      // (for rank-2 q a rank error: the Error names block_mask all the same).
      const int64_t full[4] = {c.d.B, c.d.Hq, 0, 0};
      if (mr > 2) {
        const int x = static_cast<int>(rng() % static_cast<uint64_t>(mr - 2));
        shape[static_cast<size_t>(x)] = full[4 - mr + x] + 2;
      } else {
        shape.insert(shape.begin(), c.d.Hq + 2);
      }
      v = bool_tensor(shape);
      break;
    }
    case BadBlocks::kRank: {
      const int pick_rank = static_cast<int>(rng() % 3);  // 0: rank 0, 1: rank 1, 2: q's rank + 1 (rank 1 for rank-4 q)
      if (pick_rank == 2 && r < 4) {
        shape.insert(shape.begin(), 1);
        while (static_cast<int>(shape.size()) < r + 1) shape.insert(shape.begin(), 1);
        v = bool_tensor(shape);
      } else if (pick_rank == 0) {
        v = bool_tensor({1});
        v.rank = 0;
      } else {
        v = bool_tensor({shape.back()});
      }
      break;
    }
    case BadBlocks::kBlockQ:
    case BadBlocks::kBlockK: {
      static const int64_t kBadSize[] = {0, -1, -128, INT64_MIN};
      (bl.bad == BadBlocks::kBlockQ ? bad.block_q : bad.block_k) = kBadSize[rng() % 4];
      name = bl.bad == BadBlocks::kBlockQ ? "block_q" : "block_k";
      break;
    }
    case BadBlocks::kNull:
      if (bl.mask.numel() == 0) return;  // an empty view may have null data: nothing to break
      v.data = nullptr;
      break;
    default: return;
  }
  bad.block_mask = v;
  if (made) g_case += made->describe("block_mask (given)") + "\n";
  g_case += std::string("given: rank ") + std::to_string(v.rank) + ", dtype " + dtype_long(v.dtype) + ", block_q=" +
            std::to_string(bad.block_q) + " block_k=" + std::to_string(bad.block_k) + (v.data ? "" : ", null data") + "\n";
  std::string what;
  Outs o = make_outs(c, c.want_weights, c.want_lse, true);
  const auto snap = std::make_tuple(o.out.snapshot(), o.weights ? o.weights->snapshot() : std::vector<std::byte>{},
                                    o.lse ? o.lse->snapshot() : std::vector<std::byte>{});
  const bool threw = throws_sdpa_error("attention", [&] { sdpa::attention(c.inputs(), o.outputs(), bad); }, what);
  check(threw, "error_expected", [&] { return std::string("attention: no sdpa::Error for an invalid block mask: ") + what_bad; });
  const bool untouched = o.out.same_bytes(std::get<0>(snap)) && (!o.weights || o.weights->same_bytes(std::get<1>(snap))) &&
                         (!o.lse || o.lse->same_bytes(std::get<2>(snap)));
  check(untouched, "error_untouched", [&] { return "sdpa::Error(\"" + what + "\") for a block mask but an output buffer changed"; });
  check_error_names(what, name, "attention", what_bad);
  check(throws_sdpa_error("validate", [&] { sdpa::validate(c.inputs(), bad); }, what), "error_expected",
        [&] { return std::string("validate: no sdpa::Error for an invalid block mask: ") + what_bad; });
  check_error_names(what, name, "validate", what_bad);
  if (!c.backward) return;
  sdpa::Options ok = c.opt;
  ok.backend = Backend::kReference;
  if (bad_scale) ok.scale = 1.0;
  Outs fo = make_outs(c, false, true, false);
  expect_no_throw("attention (valid block mask)", [&] { sdpa::attention(c.inputs(), fo.outputs(), ok); });
  Tensor dout(c.dtype, c.out_shape(), Role::kUnitLast, true, LayoutSpec::plain());
  for (int64_t n = 0; n < dout.numel(); ++n) dout.set_flat(n, 1.0);
  Grads g = make_grads(c, c.out_ls, true);
  sdpa::Options bo = bad;
  bo.backend = Backend::kReference;
  const auto s0 = g.dq.snapshot(), s1 = g.dk.snapshot(), s2 = g.dv.snapshot();
  const auto s3 = g.dsinks ? g.dsinks->snapshot() : std::vector<std::byte>{};
  const bool bthrew = throws_sdpa_error("attention_backward", [&] {
    sdpa::attention_backward(c.inputs(), fo.out.view(), fo.lse->view(), dout.view(), g.gradients(), bo);
  }, what);
  check(bthrew, "error_expected", [&] { return std::string("attention_backward: no sdpa::Error for an invalid block mask: ") + what_bad; });
  check(g.dq.same_bytes(s0) && g.dk.same_bytes(s1) && g.dv.same_bytes(s2) && (!g.dsinks || g.dsinks->same_bytes(s3)),
        "error_untouched", [&] { return "attention_backward: sdpa::Error(\"" + what + "\") for a block mask but a gradient buffer changed"; });
  check_error_names(what, name, "attention_backward", what_bad);
}

}  // namespace sdpa_fuzz
