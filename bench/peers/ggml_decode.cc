// Times ggml's CPU flash attention (ggml_flash_attn_ext) for one decode step, the llama.cpp peer
// of issue 30 §2. Built against a ggml source tree outside this repository by build_ggml.sh.
//
//   ggml_decode --type q8_0|f16|f32 --case one|batch [--threads 2] [--reps 20] [--hq 32 --hkv 8 --d 128]
//
// Layouts (ggml's, innermost first): q [D, tokens, Hq, 1] f32, K and V [D, n_kv, Hkv, 1] in --type,
// mask [n_kv, tokens] f16, out [D, Hq, tokens, 1].
//  one:   one sequence of 32768 keys, one query token, no mask.
//  batch: 32 sequences of 512 ... 32768 keys (sdpa bench's spread: round(512 * 64^(b/31)),
//         257k keys in all), one query token each, in ONE call the way llama.cpp's unified KV
//         cache runs a decode batch: the sequences' cells lie one after another in one cache of
//         n_kv = the sum of lengths, and the mask (0 for a token's own cells, -inf elsewhere)
//         keeps each token to its sequence. ggml skips a masked key's row (its -inf test comes
//         before the row is read), so each key row is read for its own token only.
// Bytes read (the GB/s): the K and V rows of keys that exist, as stored: q8_0 is 34 bytes per
// 32 values (an f16 scale + 32 int8), f16 2 bytes, f32 4; the mask (n_kv * tokens * 2 bytes,
// batch only) is printed separately and not counted.
// Prints one line: type case threads ms_median ms_min kv_bytes GB/s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml.h"
#include "ggml-cpu.h"

int main(int argc, char** argv) {
  std::string type_name = "q8_0", which = "one";
  int threads = 2, reps = 20, hq = 32, hkv = 8, d = 128;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--type") type_name = argv[i + 1];
    else if (a == "--case") which = argv[i + 1];
    else if (a == "--threads") threads = std::atoi(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--hq") hq = std::atoi(argv[i + 1]);
    else if (a == "--hkv") hkv = std::atoi(argv[i + 1]);
    else if (a == "--d") d = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "ggml_decode: unknown argument %s\n", argv[i]); return 2; }
  }
  ggml_type type;
  if (type_name == "q8_0") type = GGML_TYPE_Q8_0;
  else if (type_name == "f16") type = GGML_TYPE_F16;
  else if (type_name == "f32") type = GGML_TYPE_F32;
  else { std::fprintf(stderr, "ggml_decode: --type must be q8_0, f16 or f32, not %s\n", type_name.c_str()); return 2; }
  if (which != "one" && which != "batch") { std::fprintf(stderr, "ggml_decode: --case must be one or batch\n"); return 2; }

  std::vector<int64_t> lengths;
  if (which == "one") lengths = {32768};
  else for (int b = 0; b < 32; ++b) lengths.push_back(std::llround(512.0 * std::pow(64.0, b / 31.0)));
  int64_t n_kv = 0;
  for (int64_t n : lengths) n_kv += n;
  const int64_t tokens = static_cast<int64_t>(lengths.size());

  const size_t row = ggml_row_size(type, d);
  const size_t kv_bytes = 2 * row * static_cast<size_t>(n_kv) * hkv;
  const size_t mask_bytes = which == "batch" ? static_cast<size_t>(n_kv) * tokens * 2 : 0;
  ggml_init_params ip{kv_bytes + mask_bytes + static_cast<size_t>(d) * tokens * hq * 8 + (64u << 20), nullptr, false};
  ggml_context* ctx = ggml_init(ip);
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d, tokens, hq, 1);
  ggml_tensor* k = ggml_new_tensor_4d(ctx, type, d, n_kv, hkv, 1);
  ggml_tensor* v = ggml_new_tensor_4d(ctx, type, d, n_kv, hkv, 1);
  ggml_tensor* mask = nullptr;

  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t i = 0; i < ggml_nelements(q); ++i) static_cast<float*>(q->data)[i] = nd(gen);
  std::vector<float> src(static_cast<size_t>(n_kv) * d);  // one head's rows at a time
  for (ggml_tensor* t : {k, v}) {
    for (int h = 0; h < hkv; ++h) {
      for (float& x : src) x = nd(gen);
      char* dst = static_cast<char*>(t->data) + static_cast<size_t>(h) * t->nb[2];
      if (type == GGML_TYPE_F32) std::memcpy(dst, src.data(), src.size() * 4);
      else if (type == GGML_TYPE_F16) ggml_fp32_to_fp16_row(src.data(), reinterpret_cast<ggml_fp16_t*>(dst), src.size());
      else ggml_quantize_chunk(type, src.data(), dst, 0, n_kv, d, nullptr);
    }
  }
  if (which == "batch") {
    mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, tokens);
    auto* m = static_cast<ggml_fp16_t*>(mask->data);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.f), ninf = ggml_fp32_to_fp16(-INFINITY);
    int64_t start = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < n_kv; ++j) m[t * n_kv + j] = (j >= start && j < start + lengths[t]) ? zero : ninf;
      start += lengths[t];
    }
  }
  ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / std::sqrt(static_cast<float>(d)), 0.f, 0.f);
  ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
  ggml_cgraph* gf = ggml_new_graph(ctx);
  ggml_build_forward_expand(gf, out);

  std::vector<double> ms;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (ggml_graph_compute_with_ctx(ctx, gf, threads) != GGML_STATUS_SUCCESS) { std::fprintf(stderr, "ggml_decode: compute failed\n"); return 1; }
    const auto t1 = std::chrono::steady_clock::now();
    if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());  // the first is a warm-up
  }
  for (int64_t i = 0; i < ggml_nelements(out); ++i) {
    if (!std::isfinite(static_cast<float*>(out->data)[i])) { std::fprintf(stderr, "ggml_decode: non-finite output\n"); return 1; }
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  std::printf("ggml %s %s threads=%d ms_median=%.3f ms_min=%.3f kv_bytes=%zu mask_bytes=%zu GB/s=%.2f\n", type_name.c_str(),
              which.c_str(), threads, med, ms.front(), kv_bytes, mask_bytes, kv_bytes / med / 1e6);
  ggml_free(ctx);
  return 0;
}
