// write_kv_: a step's K and V rows copied into the paged caches through the slot mapping, in one op
// (torch's index_put_ takes one for K and one for V, each with its index arithmetic).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "checks.h"

namespace {

using namespace sy;

// each row's heads side by side (a view of the fused projection keeps a row stride of its own)
at::Tensor rows_of(const at::Tensor &x) {
  return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
}

// caches: [blocks, kv heads, block size, head_dim], contiguous, one dtype; k, v: [T, kv heads,
// head_dim] of that dtype; slot_mapping: [T] int64, token t's slot (block * block size + offset),
// every one inside the caches. Copies, so any dtype the caches hold.
void write_kv_(at::Tensor &k_cache, at::Tensor &v_cache, const at::Tensor &k, const at::Tensor &v,
               const at::Tensor &slot_mapping) {
  const std::initializer_list<const at::Tensor *> all{&k_cache, &v_cache, &k, &v, &slot_mapping};
  for (const at::Tensor *t : all) check_cpu(*t, "write_kv's tensors");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches must be contiguous [blocks, kv heads, block size, head_dim], got ", k_cache.sizes());
  check_shape(v_cache, k_cache.sizes(), "v_cache");
  check_same_dtype(k_cache, v_cache, "v_cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping must be [tokens] int64, got ", slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  const int64_t tokens = slot_mapping.size(0), heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t dim = k_cache.size(3), capacity = k_cache.size(0) * block_size;
  for (const auto *t : {&k, &v}) {
    check_same_dtype(k_cache, *t, "k and v");
    check_shape(*t, {tokens, heads, dim}, "k and v");
  }
  const at::Tensor kr = rows_of(k), vr = rows_of(v), slots = slot_mapping.contiguous();
  const int64_t *slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; t++)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot_mapping[", t, "] = ", slot[t], " is not one of the ",
                capacity, " slots");
  const int64_t row_bytes = dim * k_cache.element_size();
  const int64_t k_stride = kr.stride(0) * kr.element_size(), v_stride = vr.stride(0) * vr.element_size();
  char *kc = static_cast<char *>(k_cache.data_ptr()), *vc = static_cast<char *>(v_cache.data_ptr());
  const char *kp = static_cast<const char *>(kr.data_ptr()), *vp = static_cast<const char *>(vr.data_ptr());
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < heads; h++) {
        const int64_t row = (block * heads + h) * block_size + offset;
        std::memcpy(kc + row * row_bytes, kp + t * k_stride + h * row_bytes, row_bytes);
        std::memcpy(vc + row * row_bytes, vp + t * v_stride + h * row_bytes, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("write_kv_", &write_kv_); }
