// sdpa::dropout_mask: the keep/drop decisions of Dropout, written out for tests and debugging.
#include "dropout.h"

#include "problem.h"

namespace sdpa {

void dropout_mask(double dropout_p, uint64_t seed, const TensorView& mask) {
  const internal::Dropout dropout = internal::make_dropout(dropout_p, seed);
  if (mask.dtype != DType::kBool) throw Error(std::string("mask has dtype ") + dtype_name(mask.dtype) + " but must be bool");
  if (mask.rank < 2 || mask.rank > 4) {
    throw Error("mask has rank " + std::to_string(mask.rank) + " but must have rank 2..4 (like the weights)");
  }
  if (mask.data == nullptr && mask.numel() > 0) throw Error("mask has no data but shape " + mask.shape_string());
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  for (int d = 0; d < mask.rank; ++d) {
    if (mask.shape[d] < 0) throw Error("mask has a negative dim: " + mask.shape_string());
    shape[4 - mask.rank + d] = mask.shape[d];
    strides[4 - mask.rank + d] = mask.strides[d];
  }
  auto* data = static_cast<uint8_t*>(mask.data);
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t h = 0; h < shape[1]; ++h)
      for (int64_t i = 0; i < shape[2]; ++i)
        for (int64_t j = 0; j < shape[3]; ++j) {
          data[b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]] =
              dropout.factor<double>(b, h, i, j) != 0.0;
        }
}

}  // namespace sdpa
