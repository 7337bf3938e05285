// The argument checks the ops' bindings share (bindings.cpp, attention_ops.cpp, kv_write.cpp): each
// raises before a kernel could read or write out of bounds; and a tensor's data as a kernel takes it.
#pragma once

#include <ATen/ATen.h>

namespace sy {

inline void check_cpu(const at::Tensor &t, const char *what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU, got ", t.device());
}

inline void check_float(const at::Tensor &t, const char *what) {
  check_cpu(t, what);
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

inline void check_same_dtype(const at::Tensor &a, const at::Tensor &b, const char *what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, " must be ", a.scalar_type(), ", got ", b.scalar_type());
}

inline void check_shape(const at::Tensor &t, at::IntArrayRef shape, const char *what) {
  TORCH_CHECK(t.sizes() == shape, what, " must have shape ", shape, ", got ", t.sizes());
}

// a contiguous tensor's elements as the C kernels' type (bfloat16 as uint16_t)
template <typename T>
T *data(const at::Tensor &t) {
  return reinterpret_cast<T *>(t.data_ptr());
}

}  // namespace sy
