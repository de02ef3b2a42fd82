#include "sdpa/attention.h"

#include <gtest/gtest.h>

#include <vector>

TEST(Attention, SeedExampleUniform) {
  std::vector<float> q = {0, 0, 0, 0}, k = {0, 0, 0, 0}, v = {1, 0, 0, 1}, out(4);
  sdpa::Inputs in{sdpa::TensorView::contiguous(q.data(), sdpa::DType::kFloat32, {2, 2}),
                  sdpa::TensorView::contiguous(k.data(), sdpa::DType::kFloat32, {2, 2}),
                  sdpa::TensorView::contiguous(v.data(), sdpa::DType::kFloat32, {2, 2}), std::nullopt};
  sdpa::attention(in, {sdpa::TensorView::contiguous(out.data(), sdpa::DType::kFloat32, {2, 2})});
  for (float x : out) EXPECT_FLOAT_EQ(x, 0.5f);
}
