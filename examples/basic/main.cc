// Causal self-attention over one head of 4 tokens, with the lse, through the C++ API.
#include <sdpa/attention.h>

#include <cstdio>
#include <vector>

int main() {
  const int64_t n = 4, d = 2;
  std::vector<float> q = {1, 0, 0, 1, 1, 1, 0, 0};  // (n, d), row-major
  std::vector<float> k = q, v = {1, 0, 0, 1, 2, 2, 3, 3};
  std::vector<float> out(n * d), lse(n);

  sdpa::Inputs in;
  in.q = sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {n, d});
  in.k = sdpa::TensorView::contiguous(k.data(), sdpa::DType::kFloat32, {n, d});
  in.v = sdpa::TensorView::contiguous(v.data(), sdpa::DType::kFloat32, {n, d});
  sdpa::Outputs outs;
  outs.out = sdpa::TensorView::contiguous(out.data(), sdpa::DType::kFloat32, {n, d});
  outs.lse = sdpa::TensorView::contiguous(lse.data(), sdpa::DType::kFloat32, {n});
  sdpa::Options opt;
  opt.causal = sdpa::Causal::kBottomRight;
  try {
    sdpa::attention(in, outs, opt);
  } catch (const sdpa::Error& e) {
    std::fprintf(stderr, "sdpa: %s\n", e.what());
    return 1;
  }
  for (int64_t i = 0; i < n; ++i) {
    std::printf("out[%lld] = (%.4f, %.4f)  lse = %.4f\n", static_cast<long long>(i), out[i * d], out[i * d + 1], lse[i]);
  }
  // Row 0 sees only key 0, so it must equal v[0] exactly.
  return out[0] == 1.0f && out[1] == 0.0f ? 0 : 1;
}
