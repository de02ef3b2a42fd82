// sdpa_digest: one hash per case of every output bit (forward out, lse, weights; backward dq,
// dk, dv) over a fixed table of random problems covering every kernel path (prefill tiles,
// decode, key split, masks of each kind, both causal alignments, windows, GQA, dropout, f32, f64,
// bf16, f16). Not a test: a refactor that promises unchanged arithmetic is checked by building this at
// the old and the new commit and diffing the two outputs:
//   build/tests/sdpa_digest > new.txt;  (old build)/sdpa_digest > old.txt;  diff old.txt new.txt
// (and the same with the argument avx2).
// Public API only, so the same file builds against any commit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "sdpa/attention.h"

namespace {

// Finite values and -inf only (what fill() makes), rounded to nearest even.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
uint16_t to_f16(float f) {
#if defined(__clang__) && __clang_major__ < 15  // clang 14 has no _Float16 on x86
  // |f| rounded to float16's spacing at its exponent (nearbyint: ties to even), then packed.
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) return sign | 0x7c00;
  int e = 0;
  std::frexp(a, &e);                     // a = m · 2^e, m in [0.5, 1)
  int exp = std::max(e - 1, -14);        // float16's exponent of a (-14 for subnormals)
  double q = std::nearbyint(std::ldexp(a, 10 - exp));  // a in units of 2^(exp - 10)
  if (q == 2048) q = 1024, ++exp;        // rounded up to the next power of two
  if (exp > 15) return sign | 0x7c00;    // overflow
  if (q < 1024) return sign | static_cast<uint16_t>(q);  // subnormal (or 0)
  return sign | static_cast<uint16_t>((exp + 15) << 10 | (static_cast<int>(q) - 1024));
#else
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
#endif
}

struct Buffer {
  sdpa::DType dtype;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
  Buffer(sdpa::DType dt, std::vector<int64_t> s) : dtype(dt), shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    bytes.assign(static_cast<size_t>(n * sdpa::dtype_size(dt)), 0);
  }
  int64_t numel() const { return static_cast<int64_t>(bytes.size()) / sdpa::dtype_size(dtype); }
  sdpa::TensorView view() {
    sdpa::TensorView t;
    t.data = bytes.data();
    t.dtype = dtype;
    t.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.shape[d] = shape[d];
      t.strides[d] = stride;
      stride *= shape[d];
    }
    return t;
  }
  void fill(std::mt19937& rng, double sd, double density = -1) {
    std::normal_distribution<double> nd(0, sd);
    std::uniform_real_distribution<double> u(0, 1);
    for (int64_t n = 0; n < numel(); ++n) {
      const double x = nd(rng);
      if (dtype == sdpa::DType::kBool) {
        bytes[n] = u(rng) < density;
      } else if (dtype == sdpa::DType::kFloat32) {
        const float f = density >= 0 && u(rng) >= density ? -INFINITY : static_cast<float>(x);
        std::memcpy(&bytes[n * 4], &f, 4);
      } else if (dtype == sdpa::DType::kBFloat16 || dtype == sdpa::DType::kFloat16) {
        const float f = density >= 0 && u(rng) >= density ? -INFINITY : static_cast<float>(x);
        const uint16_t h = dtype == sdpa::DType::kFloat16 ? to_f16(f) : to_bf16(f);
        std::memcpy(&bytes[n * 2], &h, 2);
      } else {
        const double f = density >= 0 && u(rng) >= density ? -INFINITY : x;
        std::memcpy(&bytes[n * 8], &f, 8);
      }
    }
  }
};

uint64_t fnv(uint64_t h, const std::vector<unsigned char>& b) {
  for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  // "avx2": every x86 target better than AVX2 disabled, so the capped paths are digested too.
  if (argc > 1 && std::string(argv[1]) == "avx2") hwy::DisableTargets(HWY_AVX2 - 1);
  struct Shape {
    int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  };
  const Shape shapes[] = {{1, 2, 2, 97, 130, 64, 64}, {2, 4, 2, 33, 33, 17, 9},  {1, 8, 2, 1, 3000, 64, 64},
                          {1, 4, 1, 3, 257, 32, 40},  {1, 2, 1, 200, 200, 128, 128}, {1, 1, 1, 1, 1, 1, 1}};
  int id = 0;
  // 16-bit storage last, so that the float32 and float64 cases keep their numbers.
  for (sdpa::DType dt : {sdpa::DType::kFloat32, sdpa::DType::kFloat64, sdpa::DType::kBFloat16, sdpa::DType::kFloat16}) {
    const sdpa::DType ct = dt == sdpa::DType::kFloat64 ? dt : sdpa::DType::kFloat32;  // compute type
    for (const Shape& s : shapes) {
      for (int mask = 0; mask < 4; ++mask) {        // none, bool key padding, bool full, float full
        for (int variant = 0; variant < 4; ++variant) {  // none, causal BR, causal TL + window, dropout
          std::mt19937 rng(static_cast<uint32_t>(1000 + id));
          Buffer q(dt, {s.B, s.Hq, s.Nq, s.Dk}), k(dt, {s.B, s.Hkv, s.Nk, s.Dk}), v(dt, {s.B, s.Hkv, s.Nk, s.Dv});
          q.fill(rng, 1.5);
          k.fill(rng, 1.0);
          v.fill(rng, 1.0);
          std::vector<Buffer> m;
          if (mask == 1) m.emplace_back(sdpa::DType::kBool, std::vector<int64_t>{s.Nk});
          if (mask == 2) m.emplace_back(sdpa::DType::kBool, std::vector<int64_t>{s.B, s.Hq, s.Nq, s.Nk});
          if (mask == 3) m.emplace_back(dt, std::vector<int64_t>{s.B, 1, s.Nq, s.Nk});
          if (!m.empty()) m[0].fill(rng, 1.0, 0.8);
          sdpa::Options o;
          if (variant == 1) o.causal = sdpa::Causal::kBottomRight;
          if (variant == 2) {
            o.causal = sdpa::Causal::kTopLeft;
            o.window = {20, 5};
          }
          if (variant == 3) {
            o.dropout_p = 0.3;
            o.seed = 7;
          }
          Buffer out(dt, {s.B, s.Hq, s.Nq, s.Dv}), lse(ct, {s.B, s.Hq, s.Nq}), w(ct, {s.B, s.Hq, s.Nq, s.Nk});
          sdpa::Inputs in{q.view(), k.view(), v.view(), std::nullopt};
          if (!m.empty()) in.mask = m[0].view();
          sdpa::Outputs outs{out.view(), std::nullopt, lse.view()};
          const bool weights = s.Nq * s.Nk <= 40000;
          if (weights) outs.weights = w.view();
          sdpa::attention(in, outs, o);
          Buffer dout(dt, out.shape), dq(dt, q.shape), dk(dt, k.shape), dv(dt, v.shape);
          dout.fill(rng, 1.0);
          sdpa::attention_backward(in, out.view(), lse.view(), dout.view(), {dq.view(), dk.view(), dv.view()}, o);
          std::printf("%3d %s B%lld Hq%lld Hkv%lld Nq%lld Nk%lld Dk%lld Dv%lld mask%d variant%d", id,
                      sdpa::dtype_name(dt), (long long)s.B, (long long)s.Hq, (long long)s.Hkv, (long long)s.Nq,
                      (long long)s.Nk, (long long)s.Dk, (long long)s.Dv, mask, variant);
          // One short hash per output: out, lse, weights (0 when not asked), dq, dk, dv.
          for (const Buffer* b : {&out, &lse, &w, &dq, &dk, &dv}) {
            const uint64_t h = b == &w && !weights ? 0 : fnv(1469598103934665603ull, b->bytes);
            std::printf(" %06llx", static_cast<unsigned long long>(h & 0xffffff));
          }
          std::printf("\n");
          ++id;
        }
      }
    }
  }
  // Outputs::stats (entropy's t, max, top-k, allowed), appended so that the cases above keep
  // their numbers: the prefill and decode shapes, float32 and float64, with and without a key
  // mask, plain, causal, and keys that overflow the scores to +inf (the rule exp(s - m) = 1 at
  // a +inf max).
  for (sdpa::DType dt : {sdpa::DType::kFloat32, sdpa::DType::kFloat64}) {
    for (const Shape& s : shapes) {
      for (int mask = 0; mask < 2; ++mask) {
        for (int variant = 0; variant < 3; ++variant) {  // none, causal BR, +inf scores
          std::mt19937 rng(static_cast<uint32_t>(1000 + id));
          Buffer q(dt, {s.B, s.Hq, s.Nq, s.Dk}), k(dt, {s.B, s.Hkv, s.Nk, s.Dk}), v(dt, {s.B, s.Hkv, s.Nk, s.Dv});
          q.fill(rng, 1.5);
          k.fill(rng, 1.0);
          v.fill(rng, 1.0);
          if (variant == 2) {  // every 7th key's first feature near the largest value: q0 · k0 overflows
            for (int64_t r = 0; r < s.B * s.Hkv * s.Nk; r += 7) {
              unsigned char* at = k.bytes.data() + r * s.Dk * (dt == sdpa::DType::kFloat64 ? 8 : 4);
              if (dt == sdpa::DType::kFloat64) {
                const double x = 1.7e308;
                std::memcpy(at, &x, 8);
              } else {
                const float x = 3e38f;
                std::memcpy(at, &x, 4);
              }
            }
          }
          std::vector<Buffer> m;
          if (mask == 1) {
            m.emplace_back(sdpa::DType::kBool, std::vector<int64_t>{s.Nk});
            m[0].fill(rng, 1.0, 0.8);
          }
          sdpa::Options o;
          if (variant == 1) o.causal = sdpa::Causal::kBottomRight;
          constexpr int64_t kTop = 4;
          Buffer out(dt, {s.B, s.Hq, s.Nq, s.Dv}), lse(dt, {s.B, s.Hq, s.Nq}), ent(dt, lse.shape), mx(dt, lse.shape),
              allowed(sdpa::DType::kInt64, lse.shape), arg(sdpa::DType::kInt64, lse.shape),
              tw(dt, {s.B, s.Hq, s.Nq, kTop}), ti(sdpa::DType::kInt64, tw.shape);
          sdpa::Inputs in{q.view(), k.view(), v.view(), std::nullopt};
          if (!m.empty()) in.mask = m[0].view();
          sdpa::Outputs outs{out.view(), std::nullopt, lse.view()};
          outs.stats.entropy = ent.view();
          outs.stats.max_weight = mx.view();
          outs.stats.allowed = allowed.view();
          outs.stats.argmax = arg.view();
          outs.stats.topk_weights = tw.view();
          outs.stats.topk_indices = ti.view();
          sdpa::attention(in, outs, o);
          std::printf("%3d stats %s B%lld Hq%lld Hkv%lld Nq%lld Nk%lld Dk%lld Dv%lld mask%d variant%d", id,
                      sdpa::dtype_name(dt), (long long)s.B, (long long)s.Hq, (long long)s.Hkv, (long long)s.Nq,
                      (long long)s.Nk, (long long)s.Dk, (long long)s.Dv, mask, variant);
          for (const Buffer* b : {&out, &lse, &ent, &mx, &allowed, &arg, &tw, &ti}) {
            std::printf(" %06llx", static_cast<unsigned long long>(fnv(1469598103934665603ull, b->bytes) & 0xffffff));
          }
          std::printf("\n");
          ++id;
        }
      }
    }
  }
  return 0;
}
