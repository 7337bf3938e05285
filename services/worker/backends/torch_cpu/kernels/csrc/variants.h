// The C kernels' instruction-set variants: each variant's entry points (kernels.h, once per variant)
// and the one this CPU runs, which bindings.cpp picks when the library loads.
#pragma once

#include <cstdint>

extern "C" {
#if defined(__x86_64__)
#define SY_VARIANT avx512_vnni
#include "kernels.h"
#undef SY_VARIANT
#define SY_VARIANT avx512
#include "kernels.h"
#undef SY_VARIANT
#define SY_VARIANT avx2
#include "kernels.h"
#undef SY_VARIANT
#endif
#define SY_VARIANT portable
#include "kernels.h"
#undef SY_VARIANT
}

namespace sy {

using DecodeF32 = decltype(&decode_attention_f32_64_portable);
using DecodeBF16 = decltype(&decode_attention_bf16_64_portable);
using PrefillF32 = decltype(&prefill_attention_f32_64_portable);
using PrefillBF16 = decltype(&prefill_attention_bf16_64_portable);

constexpr int64_t HEAD_DIMS[4] = {64, 96, 128, 256};  // the head sizes the attention kernels are built for

struct Variant {
  const char *name;
  bool (*runs_here)();
  decltype(&quant_linear_f32_portable) quant_linear_f32;
  decltype(&quant_linear_q8_portable) quant_linear_q8;
  decltype(&add_rms_norm_f32_portable) add_rms_norm_f32;
  decltype(&add_rms_norm_bf16_portable) add_rms_norm_bf16;
  decltype(&rotary_f32_portable) rotary_f32;
  decltype(&rotary_bf16_portable) rotary_bf16;
  decltype(&silu_and_mul_f32_portable) silu_and_mul_f32;
  decltype(&silu_and_mul_bf16_portable) silu_and_mul_bf16;
  decltype(&lora_add_f32_portable) lora_add_f32;
  decltype(&lora_add_bf16_portable) lora_add_bf16;
  // the attention kernels, one per head size of HEAD_DIMS
  DecodeF32 decode_f32[4];
  DecodeBF16 decode_bf16[4];
  PrefillF32 prefill_f32[4];
  PrefillBF16 prefill_bf16[4];
};

extern const Variant *current;  // the variant the ops call (bindings.cpp; use_variant switches it)

}  // namespace sy
