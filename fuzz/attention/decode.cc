// attention_fuzz: decoding the input into a case.
#include "harness.h"

namespace sdpa_fuzz {

LayoutSpec decode_layout(FuzzedDataProvider& f, bool fancy) {
  LayoutSpec ls;
  if (!fancy) return ls;
  const uint8_t kind = f.ConsumeIntegral<uint8_t>();
  ls.perm = f.ConsumeIntegral<uint8_t>();
  ls.pad = kind & 1 ? f.ConsumeIntegral<uint8_t>() : 0;
  ls.neg = kind & 2 ? f.ConsumeIntegral<uint8_t>() : 0;
  ls.zero = kind & 4 ? f.ConsumeIntegral<uint8_t>() : 0;
  ls.misalign = kind & 8 ? static_cast<uint8_t>(1 + f.ConsumeIntegralInRange<int>(0, 6)) : 0;
  ls.last = static_cast<uint8_t>(kind & 16 ? 2 + (kind >> 7) : 1);
  ls.odd_unit = kind & 32;
  ls.null_empty = !(kind & 64);
  ls.empty_stride_seed = f.ConsumeIntegral<uint8_t>();
  return ls;
}

// Special values planted into tensors.
double special(uint8_t i, DType dt) {
  static const double f32v[] = {0.0, -0.0, kInf, -kInf, kNaN, 1e20, -1e20, 1e30, -1e30, 3e38, -3e38,
                                FLT_MAX, 1e-30, -1e-38, 1e-45, 1e10, 1e15, -1e19, 65504, 1e-10};
  static const double f64v[] = {0.0, -0.0, kInf, -kInf, kNaN, 1e150, -1e150, 1e200, -1e300, 1e308, -1e308,
                                DBL_MAX, 1e-300, -1e-310, 5e-324, 1e30, 1e100, -1e160, 3e38, 1e-30};
  // bfloat16: its largest value, its smallest subnormal, and values just outside the range
  // [2^-40, 2^32) where the AVX512_BF16 / AMX path is used (a tile or block holding one widens).
  static const double bf16v[] = {0.0, -0.0, kInf, -kInf, kNaN, 1e20, -1e20, 1e30, -1e30, 3e38, -3e38,
                                 0x1.fep127, 0x1p32, -0x1p-41, 0x1p-133, 1e10, 0x1.fep31, 0x1p-40, -1e-38, 1e-10};
  // float16: its largest value (and values rounding to it or to inf), subnormals, the smallest
  // normal, and values beyond its range (stored as inf or 0).
  static const double f16v[] = {0.0, -0.0, kInf, -kInf, kNaN, 65504, -65504, 6e4, -3e4, 1e4, -1e4,
                                65519, 0x1p-24, -0x1p-20, 0x1p-14, 300, 1e3, 65520, 1e20, 1e-10};
  switch (dt) {
    case DType::kFloat64: return f64v[i % 20];
    case DType::kBFloat16: return bf16v[i % 20];
    case DType::kFloat16: return f16v[i % 20];
    default: return f32v[i % 20];
  }
}

void fill_values(Tensor& t, std::mt19937_64& rng, double sigma, int zeros_mode) {
  std::normal_distribution<double> nd(0.0, sigma);
  for (int64_t i = 0; i < t.numel(); ++i) {
    double x = nd(rng);
    if (zeros_mode == 1 && rng() % 4 == 0) x = 0;
    if (zeros_mode == 2) x = static_cast<double>(static_cast<int>(rng() % 5) - 2);  // ties
    t.set_flat(i, std::clamp(x, -1e3, 1e3));
  }
}

int64_t work_of(const Dims& d) {
  // Saturating B*Hq*Nq*Nk*(Dk+Dv+1).
  const long double w = static_cast<long double>(d.B) * d.Hq * d.Nq * d.Nk * (d.Dk + d.Dv + 1);
  return w > 1e15L ? int64_t{1} << 50 : static_cast<int64_t>(w);
}

// ---- Decoding the case ----

void fill_mask(Case& c, std::mt19937_64& rng, double density, double empty_rows, double sigma) {
  Tensor& m = *c.mask;
  const int64_t nk = m.shape().empty() ? 1 : m.shape().back();
  std::uniform_real_distribution<double> u(0, 1);
  std::normal_distribution<double> nd(0, sigma);
  bool row_empty = false;
  for (int64_t n = 0; n < m.numel(); ++n) {
    if (nk > 0 && n % nk == 0) row_empty = u(rng) < empty_rows;
    const bool attend = !row_empty && u(rng) < density;
    if (m.dtype() == DType::kBool) {
      m.set_flat(n, attend ? static_cast<double>(1 + rng() % 255) : 0.0);
    } else {
      m.set_flat(n, attend ? std::clamp(nd(rng), -1e3, 1e3) : -kInf);
    }
  }
}

// Inputs::seqlens_k from the prefix bytes sk and sk_seed (see kExtSeqlens): lengths in [0, Nk]
// drawn as sk bits 0-2 say, int32 (bit 3) or int64, stride 1 / 2 / -1 / 0 (bits 4-5; 0 sets
// every length to the first), 0-3 bytes of misalignment; sk bits 6-7 (with sk_seed's top bits)
// make it invalid.
void decode_seqlens(Case& c) {
  std::mt19937_64 rng(0x5e91e25ull * (g_sk_seed + 1u) + g_sk);
  const int64_t B = c.rank == 4 ? c.d.B : 1, Nk = c.d.Nk, Nq = c.d.Nq;
  auto draw = [&](int kind) -> int64_t {
    auto clampk = [&](int64_t x) { return std::clamp<int64_t>(x, 0, Nk); };
    switch (kind) {
      case 1: return Nk;
      case 2: return 0;
      case 3: return static_cast<int64_t>(rng() % static_cast<uint64_t>(Nk + 1));
      case 4: return clampk(static_cast<int64_t>(rng() % 4));
      case 5: return clampk(Nq - 1 + static_cast<int64_t>(rng() % 3));  // causal's edge: L - Nq near 0
      case 6: return clampk(Nk - 1 - static_cast<int64_t>(rng() % 2));
      default: {  // a tile or chunk edge
        static const int64_t kEdge[] = {7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024, 2047, 2048, 2049};
        return clampk(kEdge[rng() % 19]);
      }
    }
  };
  const int how = g_sk & 7;
  std::vector<int64_t> L(static_cast<size_t>(B));
  for (auto& x : L) x = draw(how == 0 ? 1 + static_cast<int>(rng() % 7) : how);
  const int st = (g_sk >> 4) & 3;
  const int64_t stride = st == 0 ? 1 : st == 1 ? 2 : st == 2 ? -1 : 0;
  if (stride == 0) for (auto& x : L) x = L.empty() ? 0 : L[0];
  const DType dt = g_sk & 8 ? DType::kInt32 : DType::kInt64;
  const int bad_hi = (g_sk >> 6) & 3;
  BadSeqlens bad = bad_hi == 0 ? BadSeqlens::kNone : static_cast<BadSeqlens>(1 + ((bad_hi - 1) * 8 + (g_sk_seed >> 5)) % 7);
  std::vector<int64_t> vals = L;
  const size_t at = B > 0 ? static_cast<size_t>(rng() % static_cast<uint64_t>(B)) : 0;
  switch (bad) {
    case BadSeqlens::kNegative:
    case BadSeqlens::kTooLong: {
      if (B == 0) { bad = BadSeqlens::kNone; break; }
      int64_t x;
      if (bad == BadSeqlens::kNegative) x = rng() % 2 ? -1 : dt == DType::kInt32 ? INT32_MIN : INT64_MIN;
      else x = rng() % 2 ? Nk + 1 : dt == DType::kInt32 ? INT32_MAX : int64_t{1} << 40;
      if (stride == 0) for (auto& v : vals) v = x; else vals[at] = x;
      break;
    }
    case BadSeqlens::kShapeB1: vals.push_back(B > 0 ? L[0] : 0); break;
    case BadSeqlens::kShapeSmall: if (B > 0) vals.pop_back(); else vals.push_back(0); break;
    case BadSeqlens::kNull: if (B == 0) bad = BadSeqlens::kNone; break;
    default: break;
  }
  c.bad_sl = bad;
  c.sl = std::make_shared<IndexTensor>(dt, vals, stride, (g_sk_seed >> 3) & 3);
  sdpa::TensorView v = c.sl->view();
  if (bad == BadSeqlens::kRank) {
    if (g_sk_seed & 1) { v.rank = 2; v.shape[1] = v.shape[0]; v.strides[1] = v.strides[0]; v.shape[0] = 1; v.strides[0] = 0; }
    else { v.rank = 0; if (!v.data) v.data = c.sl->buf.get(); }
  }
  if (bad == BadSeqlens::kDtype) v.dtype = g_sk_seed & 1 ? DType::kBool : dt == DType::kInt32 ? DType::kFloat32 : DType::kFloat64;
  if (bad == BadSeqlens::kNull) v.data = nullptr;
  c.sl_view = v;
  if (bad == BadSeqlens::kNone) c.seqlens = L;
}

// A small layout for a rank 1-2 modifier tensor (slopes, sinks, dsinks): unit stride, stride 2 or
// 3, negative strides, stride 0 (inputs only: every element the same), column-major, an offset.
LayoutSpec modifier_layout(std::mt19937_64& rng, bool input) {
  LayoutSpec ls;
  const int kind = static_cast<int>(rng() % 6);
  if (kind == 3) ls.last = 2;
  if (kind == 4) ls.neg = 3;
  if (kind == 5) { if (input) ls.zero = static_cast<uint8_t>(1 + rng() % 3); else ls.last = 3; }
  ls.perm = static_cast<uint8_t>(rng() % 2);
  ls.pad = static_cast<uint8_t>(rng() % 4 == 0 ? 1 : 0);
  ls.misalign = static_cast<uint8_t>(rng() % 3);
  ls.null_empty = rng() % 2;
  ls.empty_stride_seed = rng() % 4 == 0 ? 1 + rng() % 255 : 0;
  return ls;
}

// The score modifiers from the prefix bytes md and md_seed (kExtModifiers):
//   md bits 0-1  softcap: 0 none; 1 one of 0.5, 1, 2, 5, 10, 20, 30, 50, 60; 2 uniform in
//                [0.5, 60]; 3 an extreme one (1e-3, 0.01, 0.1, 1e3, 1e4, 1e30, 3e38, FLT_MIN)
//   md bit 2     SoftcapOrder::kAfterBias (else kBeforeBias; set without a softcap too)
//   md bits 3-4  alibi_slopes: 0 none, 1 (Hq,), 2 (B, Hq) ((1, Hq) below rank 4), 3 (1, Hq)
//   md bit 5     sinks (Hq,)
//   md bit 6     backward calls with sinks write Gradients::dsinks
//   md bit 7     an invalid modifier (BadMod, picked by md_seed)
// md_seed seeds the PRNG for the rest: float32 / float64 tensors, their layouts (modifier_layout),
// and the values (slopes: ALiBi's geometric 2^(-8(h+1)/Hq), normal 0.1, 1 or 30, or zeros with one
// of 0.5, -0.5, 1e-30, 10, 1e3; sinks: normal 1 or 10, zeros, or per head one of 0, ±1e30, ±88,
// ±1e3, ±700, 1e-30), all finite in float32.
void decode_modifiers(Case& c) {
  auto m = std::make_shared<Modifiers>();
  std::mt19937_64 rng(0x30d1f1e5ull * (g_md_seed + 1u) + g_md);
  sdpa::Options& o = c.opt;
  const int cap_kind = g_md & 3;
  if (cap_kind == 1) {
    static const double kCaps[] = {0.5, 1, 2, 5, 10, 20, 30, 50, 60};
    o.softcap = kCaps[rng() % 9];
  } else if (cap_kind == 2) {
    o.softcap = 0.5 + 59.5 * std::uniform_real_distribution<double>(0, 1)(rng);
  } else if (cap_kind == 3) {
    static const double kExtreme[] = {1e-3, 0.01, 0.1, 1e3, 1e4, 1e30, 3e38, FLT_MIN};
    o.softcap = kExtreme[rng() % 8];
  }
  o.softcap_order = g_md & 4 ? sdpa::Options::SoftcapOrder::kAfterBias : sdpa::Options::SoftcapOrder::kBeforeBias;
  const int64_t Hq = c.d.Hq, B = c.rank == 4 ? c.d.B : 1;
  const int alibi_kind = (g_md >> 3) & 3;
  if (alibi_kind != 0) {
    const std::vector<int64_t> shape = alibi_kind == 1 ? std::vector<int64_t>{Hq} : alibi_kind == 2 ? std::vector<int64_t>{B, Hq} : std::vector<int64_t>{1, Hq};
    const DType dt = rng() % 2 ? DType::kFloat64 : DType::kFloat32;
    m->slopes.emplace(dt, shape, Role::kAny, true, modifier_layout(rng, true));
    Tensor& t = *m->slopes;
    const int kind = static_cast<int>(rng() % 5);
    static const double kSigma[] = {0, 0.1, 1, 0, 30};
    std::normal_distribution<double> nd(0.0, 1.0);
    for (int64_t n = 0; n < t.numel(); ++n) {
      const int64_t h = Hq > 0 ? n % Hq : 0;
      double x = kind == 0 ? std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(std::max<int64_t>(1, Hq)))
                 : kind == 3 ? 0.0 : std::clamp(kSigma[kind] * nd(rng), -1e3, 1e3);
      t.set_flat(n, x);
    }
    if (kind == 3 && t.numel() > 0) {
      static const double kOne[] = {0.5, -0.5, 1e-30, 10, 1e3};
      t.set_flat(static_cast<int64_t>(rng() % static_cast<uint64_t>(t.numel())), kOne[rng() % 5]);
    }
    o.alibi_slopes = t.view();
  }
  if (g_md & 32) {
    const DType dt = rng() % 2 ? DType::kFloat64 : DType::kFloat32;
    m->sinks.emplace(dt, std::vector<int64_t>{Hq}, Role::kAny, true, modifier_layout(rng, true));
    Tensor& t = *m->sinks;
    const int kind = static_cast<int>(rng() % 4);
    std::normal_distribution<double> nd(0.0, kind == 1 ? 10.0 : 1.0);
    static const double kSpecial[] = {0, 1e30, -1e30, 88, -88, 1e3, -1e3, 700, -700, 1e-30};
    for (int64_t n = 0; n < t.numel(); ++n)
      t.set_flat(n, kind == 2 ? 0.0 : kind == 3 ? kSpecial[rng() % 10] : nd(rng));
    o.sinks = t.view();
  }
  m->dsinks = g_md & 64;
  m->dsinks_dtype = rng() % 2 ? DType::kFloat64 : DType::kFloat32;
  m->dsinks_ls = modifier_layout(rng, false);
  m->bad_seed = rng();
  if (g_md & 128) {
    m->bad = static_cast<BadMod>(1 + m->bad_seed % (static_cast<uint64_t>(BadMod::kCount) - 1));
    if (m->bad >= BadMod::kDsinksNoSinks && !c.backward) m->bad = BadMod::kNone;  // backward-only kinds
  }
  c.mods = m;
}

// A layout for the block mask (rank 2-4, bool, any strides: Role::kAny): C order, or permuted
// dims with gaps after some, negative strides, a last stride of 2 or 3, odd strides on dims of
// extent 1, a misaligned start, and sometimes a dim of stride 0 (every entry along it the same
// element: still a valid input view); an empty one with null data or any strides.
LayoutSpec block_layout(std::mt19937_64& rng) {
  LayoutSpec ls;
  const int kind = static_cast<int>(rng() % 4);  // 0 C order, 1 permuted / padded, 2 + negative, 3 + stride 0
  ls.misalign = static_cast<uint8_t>(rng() % 7);
  ls.null_empty = rng() % 2;
  ls.empty_stride_seed = rng() % 2 ? 0 : 1 + rng() % 255;
  if (kind == 0) return ls;
  ls.perm = static_cast<uint8_t>(rng() % 24);
  ls.pad = static_cast<uint8_t>(rng() % 16);
  ls.last = static_cast<uint8_t>(1 + rng() % 3);
  ls.odd_unit = rng() % 3 == 0;
  if (kind >= 2) ls.neg = static_cast<uint8_t>(rng() % 16);
  if (kind == 3) ls.zero = static_cast<uint8_t>(1u << (rng() % 4));
  return ls;
}

// ceil(n / block) for n >= 0, block >= 1 (no overflow for huge blocks).
int64_t ceil_div(int64_t n, int64_t block) { return n / block + (n % block != 0); }

// Options::block_mask from the prefix bytes bm and bm_seed (kExtBlocks):
//   bm bits 0-1  block_q, block_k: 0 small (1-5 each); 1 a menu of 1-129 and sizes relative to
//                Nq / Nk (N, N + 1, N - 1, N / 2, N / 3); 2 tile-sized: block_k 128, 256, 384, 512,
//                1024 or 2048 (whole tiles of 128 keys skipped), block_q 1-256; 3 anything from 1 to
//                INT64_MAX (huge ones: one block)
//   bm bits 2-3  density: 0 each block true with p 0.1-0.9; 1 sparse (p 0-0.2, 30% of block rows
//                all false, 10% all true); 2 all true (maybe one false block); 3 structured per (b, h):
//                block-causal, a band, global column + diagonal, all false, or a checkerboard
//   bm bits 4-5  leading dims: 0 none (QB, KB); 1 per head (Hq, QB, KB); 2 per batch (B, 1, QB, KB)
//                ((1, QB, KB) for rank 3); 3 (B | 1, Hq | 1, QB, KB), each leading dim 1 or full
//                (dims q's rank lacks are left out)
//   bm bit 6     seqlens_k too (prefix bytes sk, sk_seed after bm_seed); bm bit 7 score modifiers
//                too (md, md_seed after those)
// bm_seed seeds the PRNG for the rest: the sizes, the values (a true block is 1 or any of 1-255),
// the layout (block_layout); its top three bits 0b111 make the mask invalid (bad_blocks_of).
// The block mask's sizes, leading dims and values (decode_block_mask's, and run_varlen's for
// packed sequences): `rank` is q's (it bounds the leading dims), (B, Hq) what they broadcast to,
// Nq and Nk the rows and keys the blocks cover. `max_elems` bounds the mask's elements (B · Hq ·
// QB · KB): block_q or block_k (whichever gives more blocks) doubles until it fits.
std::shared_ptr<BlockMask> make_block_mask(std::mt19937_64& rng, int size_kind, int density_kind, int lead_kind, int rank, int64_t B,
                                           int64_t Hq, int64_t Nq, int64_t Nk, int64_t max_elems) {
  auto bl = std::make_shared<BlockMask>();
  const auto relative = [&](int64_t n) {
    const int64_t r[] = {n, n + 1, n - 1, n / 2, n / 3};
    return std::max<int64_t>(1, r[rng() % 5]);
  };
  const auto size_of = [&](int64_t n, bool keys) -> int64_t {
    switch (size_kind) {
      case 0: return 1 + static_cast<int64_t>(rng() % 5);
      case 1: {
        static const int64_t kMenu[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129};
        return rng() % 3 == 0 ? relative(n) : kMenu[rng() % 20];
      }
      case 2: {
        static const int64_t kKeys[] = {128, 128, 128, 256, 256, 384, 512, 1024, 2048};
        static const int64_t kRows[] = {1, 2, 3, 16, 64, 128, 128, 256};
        return keys ? kKeys[rng() % 9] : kRows[rng() % 8];
      }
      default: {
        static const int64_t kAny[] = {1, 2, 5, 7, 100, 128, 256, 4096, int64_t{1} << 20, int64_t{1} << 40, INT64_MAX - 1, INT64_MAX};
        return rng() % 4 == 0 ? relative(n) : kAny[rng() % 12];
      }
    }
  };
  bl->bq = size_of(Nq, false);
  bl->bk = size_of(Nk, true);
  if (max_elems != INT64_MAX) {
    const long double lead = static_cast<long double>(std::max<int64_t>(1, B)) * std::max<int64_t>(1, Hq);
    while (lead * ceil_div(Nq, bl->bq) * ceil_div(Nk, bl->bk) > max_elems) {
      int64_t& b = ceil_div(Nq, bl->bq) >= ceil_div(Nk, bl->bk) ? bl->bq : bl->bk;
      b = b > INT64_MAX / 2 ? INT64_MAX : 2 * b;
    }
  }
  const int64_t QB = ceil_div(Nq, bl->bq), KB = ceil_div(Nk, bl->bk);
  std::vector<int64_t> shape;
  switch (lead_kind) {
    case 1: if (rank >= 3) shape = {Hq}; break;
    case 2: if (rank == 4) shape = {B, 1}; else if (rank == 3) shape = {1}; break;
    case 3:
      if (rank == 4) shape.push_back(rng() % 2 ? B : 1);
      if (rank >= 3) shape.push_back(rng() % 2 ? Hq : 1);
      break;
    default: break;
  }
  shape.push_back(QB);
  shape.push_back(KB);
  bl->mask.init(DType::kBool, shape, Role::kAny, true, block_layout(rng));
  Tensor& m = bl->mask;
  const bool any_byte = rng() % 2;  // a true block holds any of 1-255, else 1
  const auto yes = [&] { return any_byte ? static_cast<double>(1 + rng() % 255) : 1.0; };
  static const double kP[] = {0.1, 0.25, 0.5, 0.75, 0.9};
  static const double kSparse[] = {0.0, 0.05, 0.2};
  const double p = density_kind == 0 ? kP[rng() % 5] : density_kind == 1 ? kSparse[rng() % 3] : 1.0;
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t slice = QB * KB;
  int pattern = 0, param = 0;
  int row_state = 0;  // sparse: 0 drawn, 1 all false, 2 all true
  for (int64_t n = 0; n < m.numel(); ++n) {
    const int64_t kb = n % KB, qb = (n / KB) % QB;
    if (n % slice == 0) {  // a new (b, h) slice: its structure
      pattern = static_cast<int>(rng() % 5);
      param = static_cast<int>(rng() % 3);
    }
    if (kb == 0 && density_kind == 1) {
      const double r = u(rng);
      row_state = r < 0.3 ? 1 : r < 0.4 ? 2 : 0;
    }
    bool on;
    switch (density_kind) {
      case 0: on = u(rng) < p; break;
      case 1: on = row_state == 2 || (row_state == 0 && u(rng) < p); break;
      case 2: on = true; break;
      default:
        switch (pattern) {
          case 0: on = kb <= qb + (param - 1); break;                    // block-causal, offset -1..1
          case 1: on = std::abs(qb - kb) <= param; break;                 // a band
          case 2: on = kb == 0 || kb == qb; break;                        // global column + diagonal
          case 3: on = false; break;                                      // all false
          default: on = (qb + kb + param) % 2 == 0; break;                // a checkerboard
        }
    }
    m.set_flat(n, on ? yes() : 0.0);
  }
  if (density_kind == 2 && m.numel() > 0 && rng() % 2) m.set_flat(static_cast<int64_t>(rng() % static_cast<uint64_t>(m.numel())), 0.0);
  static const char* const kSizeNames[] = {"small", "menu", "tiles", "any"};
  static const char* const kDensityNames[] = {"random", "sparse", "all true", "structured"};
  static const char* const kLeadNames[] = {"none", "per head", "per batch", "broadcast"};
  bl->how = std::string("sizes ") + kSizeNames[size_kind] + ", density " + kDensityNames[density_kind] + ", leading dims " + kLeadNames[lead_kind];
  return bl;
}

void decode_block_mask(Case& c) {
  std::mt19937_64 rng(0xb10c4a5cull * (g_bm_seed + 1u) + g_bm);
  const int64_t B = c.rank == 4 ? c.d.B : 1, Hq = c.rank >= 3 ? c.d.Hq : 1;
  std::shared_ptr<BlockMask> bl = make_block_mask(rng, g_bm & 3, (g_bm >> 2) & 3, (g_bm >> 4) & 3, c.rank, B, Hq, c.d.Nq, c.d.Nk);
  bl->bad = bad_blocks_of(g_bm_seed);
  bl->bad_seed = rng();
  c.opt.block_mask = bl->mask.view();
  c.opt.block_q = bl->bq;
  c.opt.block_k = bl->bk;
  c.blocks = bl;
}

// A call's first byte: dtypes, backward, threads, tame; the caps and the precision from the ext prefix. Returns
// the `fancy` bit (layouts and masks beyond the plain ones). Shared by decode and run_varlen.
bool decode_flags(FuzzedDataProvider& f, Case& c) {
  const uint8_t flags = f.ConsumeIntegral<uint8_t>();
  // The ext byte's storage: 16-bit k and v are float16 where the bit that picks float64 is set,
  // else bfloat16; q shares their dtype or (storage 2) is float32.
  if (g_storage != 0) {
    c.kv = flags & 1 ? DType::kFloat16 : DType::kBFloat16;
    c.dtype = g_storage == 2 ? DType::kFloat32 : c.kv;
  } else {
    c.dtype = c.kv = flags & 1 ? DType::kFloat64 : DType::kFloat32;
  }
  c.opt.precision = g_precision;
  c.backward = flags & 2;
  c.threads = flags & 4 ? 2 : 1;
  c.avx2 = g_avx2;
  c.path_cap = g_path_cap;
  c.tame = !(flags & 32);
  return flags & 16;
}

bool decode(FuzzedDataProvider& f, Case& c, Invalid& invalid) {
  const bool fancy = decode_flags(f, c);
  const uint8_t inv = f.ConsumeIntegral<uint8_t>();
  invalid = inv < 200 ? Invalid::kNone : static_cast<Invalid>(1 + inv % (static_cast<int>(Invalid::kCount) - 1));
  c.rank = f.ConsumeIntegralInRange<int>(2, 4);
  const uint8_t size_class = f.ConsumeIntegralInRange<uint8_t>(0, 9);
  static const int64_t kN[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257};
  static const int64_t kSmallN[] = {0, 1, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17};
  static const int64_t kLongN[] = {2047, 2048, 2049, 2100, 2176, 2304, 2500, 3000, 4100};
  static const int64_t kD[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 59, 63, 64, 65, 80, 111, 127, 128, 129, 256};
  static const int64_t kSmallD[] = {1, 1, 2, 3, 4, 5, 8, 9};
  static const int64_t kB[] = {1, 1, 1, 2, 3, 0};
  static const int64_t kHkv[] = {1, 1, 2, 3, 0};
  static const int64_t kGroup[] = {1, 1, 2, 3, 4, 5, 8};
  Dims& d = c.d;
  d.B = c.rank == 4 ? pick(f, kB) : 1;
  d.Hkv = c.rank >= 3 ? pick(f, kHkv) : 1;
  d.Hq = c.rank >= 3 ? d.Hkv * pick(f, kGroup) : 1;
  if (size_class <= 5) {  // general
    d.Nq = pick(f, kN); d.Nk = pick(f, kN); d.Dk = pick(f, kD); d.Dv = pick(f, kD);
  } else if (size_class <= 7) {  // small
    d.Nq = pick(f, kSmallN); d.Nk = pick(f, kSmallN); d.Dk = pick(f, kSmallD); d.Dv = pick(f, kSmallD);
  } else {  // long keys, few rows: key chunking (kMinChunkKeys)
    d.Nq = size_class == 8 ? pick(f, kSmallN) : f.ConsumeIntegralInRange<int64_t>(9, 40);
    d.Nk = pick(f, kLongN); d.Dk = pick(f, kSmallD); d.Dv = pick(f, kSmallD);
    if (c.rank >= 3) d.Hq = d.Hkv * 1;
    d.B = std::min<int64_t>(d.B, 1);
  }
  // Bound the work so that each execution is fast (the reference and naive run too).
  while (work_of(d) > kWorkBudget) {
    int64_t* biggest = &d.Dk;
    for (int64_t* x : {&d.Dv, &d.Nq, &d.Nk, &d.Hq}) if (*x > *biggest && !(x == &d.Nk && size_class >= 8)) biggest = x;
    if (biggest == &d.Hq) { d.Hq = d.Hkv; if (work_of(d) > kWorkBudget) { d.Nq = std::max<int64_t>(1, d.Nq / 2); } continue; }
    *biggest = std::max<int64_t>(1, *biggest / 2);
  }

  // F11 (fixed; see kSkipDefault): bfloat16 with Dk = 0 aborted on the dot-product path.
  if (c.all_bf16() && d.Dk == 0 && c.path_cap != sdpa::KernelPath::kSimd && skipping("bf16_dk0")) {
    c.path_cap = g_path_cap = sdpa::KernelPath::kSimd;
    sdpa::set_max_kernel_path(g_path_cap);
  }

  // Options.
  sdpa::Options& o = c.opt;
  static const int64_t kWin[] = {-1, -1, -1, -7, 0, 1, 2, 3, 16, 100, 1000, INT64_MAX, INT64_MAX - 1, int64_t{1} << 62};
  const uint8_t of = f.ConsumeIntegral<uint8_t>();
  o.causal = static_cast<Causal>(of % 3);
  if (of & 4) o.window = {pick(f, kWin), pick(f, kWin)};
  const uint8_t be = f.ConsumeIntegral<uint8_t>();
  o.backend = be < 140 ? Backend::kFlash : be < 180 ? Backend::kAuto : be < 220 ? Backend::kReference : Backend::kNaive;
  if (of & 8) {
    static const double kScales[] = {1, 0.5, 0.125, -1, 0, 1e-3, 2, 8, 1e3, -1e3, 30, -0.0, 1e10, 1e30, 3e38, FLT_MAX,
                                     1e-38, 1e-40, 1e-300, 5e-324, 1e300, -1e20, 0.1, 64};
    const uint8_t si = f.ConsumeIntegral<uint8_t>();
    o.scale = si < 240 ? kScales[si % 24] : f.ConsumeFloatingPointInRange<double>(-1e3, 1e3);
  }
  if (of & 16) {
    static const double kP[] = {0.1, 0.5, 0.9, 0.999, 0.25, 1e-9};
    o.dropout_p = kP[f.ConsumeIntegralInRange<int>(0, 5)];
    o.seed = f.ConsumeIntegral<uint64_t>();
  } else if (of & 32) {
    o.seed = f.ConsumeIntegral<uint64_t>();  // ignored without dropout
  }
  c.want_weights = of & 64;
  c.want_lse = (of & 128) || c.backward;

  // Layouts.
  const LayoutSpec lq = decode_layout(f, fancy), lk = decode_layout(f, fancy), lv = decode_layout(f, fancy);
  c.out_ls = decode_layout(f, fancy);
  c.w_ls = decode_layout(f, fancy);
  c.l_ls = decode_layout(f, fancy);
  c.q.init(c.dtype, last_dims(c.rank, {d.B, d.Hq, d.Nq, d.Dk}), Role::kUnitLast, true, lq);
  c.k.init(c.kv, last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dk}), Role::kUnitLast, true, lk);
  c.v.init(c.kv, last_dims(c.rank, {d.B, d.Hkv, d.Nk, d.Dv}), Role::kUnitLast, true, lv);

  // Values.
  std::mt19937_64 rng(f.ConsumeIntegral<uint64_t>());
  static const double kSigma[] = {1, 1, 0.1, 3, 30, 300};
  const uint8_t vf = f.ConsumeIntegral<uint8_t>();
  const double sigma = kSigma[vf % 6];
  fill_values(c.q, rng, sigma, (vf >> 3) % 3);
  fill_values(c.k, rng, sigma, (vf >> 3) % 3);
  fill_values(c.v, rng, 1.0, 0);

  // Mask: none, bool or float, broadcast shape.
  const uint8_t mf = f.ConsumeIntegral<uint8_t>();
  if (mf % 3 != 0) {
    // A float mask has q's dtype, or (storage 3) float32, which any q allows.
    const DType mdt = mf % 3 == 1 ? DType::kBool : g_storage == 3 ? DType::kFloat32 : c.dtype;
    const int mrank = f.ConsumeIntegralInRange<int>(0, c.rank);
    const std::vector<int64_t> full = c.w_shape();
    const uint8_t bmask = f.ConsumeIntegral<uint8_t>();
    std::vector<int64_t> ms;
    for (int x = 0; x < mrank; ++x) {
      const int64_t dim = full[static_cast<size_t>(c.rank - mrank + x)];
      ms.push_back((bmask >> x & 1) ? 1 : dim);
    }
    c.mask.emplace(mdt, ms, Role::kAny, true, decode_layout(f, fancy));
    static const double kDensity[] = {0.7, 0.9, 0.3, 0.0, 1.0, 0.5};
    static const double kEmpty[] = {0, 0, 0.1, 0.5};
    fill_mask(c, rng, kDensity[(mf >> 2) % 6], kEmpty[(mf >> 5) % 4], (mf & 128) ? 30.0 : 1.0);
  }

  // Special values planted where the input says (not tame).
  if (!c.tame) {
    const int n = f.ConsumeIntegralInRange<int>(1, 8);
    for (int s = 0; s < n; ++s) {
      const uint8_t which = f.ConsumeIntegral<uint8_t>();
      const uint32_t where = f.ConsumeIntegral<uint32_t>();
      const uint8_t val = f.ConsumeIntegral<uint8_t>();
      Tensor* t = which % 4 == 0 ? &c.q : which % 4 == 1 ? &c.k : which % 4 == 2 ? &c.v : (c.mask ? &*c.mask : &c.v);
      if (t->numel() == 0) continue;
      double x = special(val, t->dtype());
      if (t == &*c.mask && c.mask) {
        if (t->dtype() == DType::kBool) x = val % 2 ? 0.0 : static_cast<double>(val);
        // NaN / +inf in a float mask are Errors (tested separately); in a 16-bit mask a finite
        // value may round to +inf (float16: 1e20).
        else if (std::isnan(x) || x == kInf || (is16(t->dtype()) && sdpa_oracle::round_half(sdpa_oracle::half_format(t->dtype()), x) == kInf)) x = -kInf;
      }
      // A whole row (same value everywhere in the last dim) or one element.
      if (which & 0x80) {
        const int64_t last = t->shape().empty() ? 1 : t->shape().back();
        const int64_t row = where % std::max<int64_t>(1, t->numel() / std::max<int64_t>(1, last));
        for (int64_t e = 0; e < last; ++e) t->set_flat(row * last + e, x);
      } else {
        t->set_flat(where % t->numel(), x);
      }
    }
  }
  if (g_seqlens) decode_seqlens(c);
  if (g_mods) decode_modifiers(c);  // after Hq and B (and seqlens_k) are known
  if (g_blocks) decode_block_mask(c);  // after Nq and Nk are known
  // Tame: finite, |values| <= 1e3, |scale| <= 1e3: float32 scores and sums cannot overflow.
  if (c.tame && o.scale && !(std::fabs(*o.scale) <= 1e3)) c.tame = false;
  if (c.tame && o.scale && *o.scale != 0 && std::fabs(*o.scale) < 1e-30) c.tame = false;
  return true;
}

// The options of a varlen, paged or KVCache call, from a shorter menu than decode()'s (no mask):
// causal, window, backend, scale, dropout. Returns the options byte: its bits 5-7 are the caller's.
uint8_t decode_short_options(FuzzedDataProvider& f, sdpa::Options& o) {
  static const int64_t kWin[] = {-1, -1, 0, 1, 3, 16, 100, INT64_MAX, int64_t{1} << 62};
  const uint8_t of = f.ConsumeIntegral<uint8_t>();
  o.causal = static_cast<Causal>(of % 3);
  if (of & 4) o.window = {pick(f, kWin), pick(f, kWin)};
  const uint8_t be = f.ConsumeIntegral<uint8_t>();
  o.backend = be < 140 ? Backend::kFlash : be < 180 ? Backend::kAuto : be < 220 ? Backend::kReference : Backend::kNaive;
  if (of & 8) {
    static const double kScales[] = {1, 0.5, 0.125, -1, 0, 1e-3, 2, 8, 30, 1e30};
    o.scale = kScales[f.ConsumeIntegralInRange<int>(0, 9)];
  }
  if (of & 16) {
    static const double kP[] = {0.1, 0.5, 0.9, 0.25};
    o.dropout_p = kP[f.ConsumeIntegralInRange<int>(0, 3)];
    o.seed = f.ConsumeIntegral<uint64_t>();
  }
  return of;
}

// Not-tame inputs of run_varlen, run_paged and run_kvcache: 1 to 6 special values (special(), per
// dtype) planted at elements the input picks of three tensors (which % 3 picks the tensor).
void plant_specials(FuzzedDataProvider& f, const std::array<Tensor*, 3>& ts) {
  const int n = f.ConsumeIntegralInRange<int>(1, 6);
  for (int s = 0; s < n; ++s) {
    const uint8_t which = f.ConsumeIntegral<uint8_t>();
    const uint32_t where = f.ConsumeIntegral<uint32_t>();
    Tensor& t = *ts[which % 3];
    if (t.numel() > 0) t.set_flat(where % t.numel(), special(f.ConsumeIntegral<uint8_t>(), t.dtype()));
  }
}

}  // namespace sdpa_fuzz
