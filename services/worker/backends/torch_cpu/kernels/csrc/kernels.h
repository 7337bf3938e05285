/* The C kernels' entry points. Every source is compiled once per instruction-set variant (build.py),
 * with SY_VARIANT naming it, so that each entry point exists once per variant in the one library:
 * quant_linear_f32_avx512, quant_linear_f32_avx2, ... bindings.cpp includes this file once per
 * variant and picks one at run time. No include guard: that is what makes the repeated includes work.
 *
 * Every tensor is contiguous; the shapes are in each kernel's source. */
#include <stdint.h>

#define SY_CAT_(a, b) a##_##b
#define SY_CAT(a, b) SY_CAT_(a, b)
#define SY_KERNEL(name) SY_CAT(name, SY_VARIANT)

/* quant_linear.c: out[m, n] = x[m, k] W^T (+ bias), W in 4- or 8-bit groups of `group` inputs with
 * float16 (scale_bits 16) or float32 scales (and lows), or int8 ones (8) times float16 supers; e4m3:
 * the 8 bits are float8 e4m3 codes, not integers; codebook: 4-bit indices into its 16 int8 values
 * (IQ4's), or null; 0, or -1 for a format it has no kernel for */
int SY_KERNEL(quant_linear_f32)(const float *x, int64_t m, int64_t k, const void *qweight, int64_t bits,
                                int64_t group, const void *scales, const void *lows, const void *supers,
                                int64_t scale_bits, int64_t e4m3, const int8_t *codebook, const float *bias, int64_t n,
                                float *out);

/* quant_dot.c: quant_linear_f32's 4-, 5- and 6-bit integer formats over int8 activations (each row
 * quantized per 32 inputs); 0, -1 for a format it has no kernel for, or -2 out of memory */
int SY_KERNEL(quant_linear_q8)(const float *x, int64_t m, int64_t k, const void *qweight, int64_t bits,
                               int64_t group, const void *scales, const void *lows, const void *supers,
                               int64_t scale_bits, const float *bias, int64_t n, float *out);

/* fused_ops.c: the row-wise ops, float32 (f32) and bfloat16 (bf16, as uint16_t) */
void SY_KERNEL(add_rms_norm_f32)(const float *x, const float *residual, const float *weight, float *out,
                                 float *summed, int64_t rows, int64_t dim, float eps);
void SY_KERNEL(add_rms_norm_bf16)(const uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                                  uint16_t *out, uint16_t *summed, int64_t rows, int64_t dim, float eps);
void SY_KERNEL(rotary_f32)(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out,
                           int64_t rows, int64_t heads, int64_t head_dim);
void SY_KERNEL(rotary_bf16)(const uint16_t *x, int64_t x_stride, const float *cos, const float *sin,
                            uint16_t *out, int64_t rows, int64_t heads, int64_t head_dim);
void SY_KERNEL(silu_and_mul_f32)(const float *gate_up, float *out, int64_t rows, int64_t width);
void SY_KERNEL(silu_and_mul_bf16)(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width);

/* lora.c: y[t] += B[s] A[s] x[t] for each token t of slot s = slots[t] >= 0 (the grouped LoRA GEMM),
 * B block-diagonal over num_slices output slices; 0, or -2 out of memory */
int SY_KERNEL(lora_add_f32)(const float *x, float *y, const float *a, const float *b, const int64_t *slots,
                            int64_t tokens, int64_t in, int64_t out, int64_t width, int64_t num_slots,
                            const int64_t *offsets, int64_t num_slices);
int SY_KERNEL(lora_add_bf16)(const uint16_t *x, uint16_t *y, const uint16_t *a, const uint16_t *b,
                             const int64_t *slots, int64_t tokens, int64_t in, int64_t out, int64_t width,
                             int64_t num_slots, const int64_t *offsets, int64_t num_slices);

/* decode_attention.c: one query token per sequence over the paged KV cache; window: a query sees its last
 * `window` keys (0: all); softcap: scores -> softcap * tanh(scores / softcap) (0: none); 0, or -2 out of memory */
#define SY_DECODE_ATTENTION(T, NAME)                                                                 \
    int SY_KERNEL(NAME)(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables, \
                        const int64_t *context_lens, T *out, int64_t num_seqs, int64_t num_heads,     \
                        int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale,    \
                        int64_t window, float softcap);
SY_DECODE_ATTENTION(float, decode_attention_f32_64)
SY_DECODE_ATTENTION(float, decode_attention_f32_128)
SY_DECODE_ATTENTION(uint16_t, decode_attention_bf16_64)
SY_DECODE_ATTENTION(uint16_t, decode_attention_bf16_128)
SY_DECODE_ATTENTION(float, decode_attention_f32_256)
SY_DECODE_ATTENTION(float, decode_attention_f32_96)
SY_DECODE_ATTENTION(uint16_t, decode_attention_bf16_96)
SY_DECODE_ATTENTION(uint16_t, decode_attention_bf16_256)
#undef SY_DECODE_ATTENTION
/* decode_attention.c: a prefill chunk's rows after num_cached keys, each as its decode would be */
#define SY_PREFILL_ATTENTION(T, NAME)                                                                \
    int SY_KERNEL(NAME)(const T *q, const T *k_cache, const T *v_cache, const int64_t *table,       \
                        int64_t num_cached, T *out, int64_t num_query, int64_t num_heads,            \
                        int64_t num_kv_heads, int64_t block_size, float scale, int64_t window,      \
                        float softcap);
SY_PREFILL_ATTENTION(float, prefill_attention_f32_64)
SY_PREFILL_ATTENTION(float, prefill_attention_f32_128)
SY_PREFILL_ATTENTION(uint16_t, prefill_attention_bf16_64)
SY_PREFILL_ATTENTION(uint16_t, prefill_attention_bf16_128)
SY_PREFILL_ATTENTION(float, prefill_attention_f32_256)
SY_PREFILL_ATTENTION(float, prefill_attention_f32_96)
SY_PREFILL_ATTENTION(uint16_t, prefill_attention_bf16_96)
SY_PREFILL_ATTENTION(uint16_t, prefill_attention_bf16_256)
#undef SY_PREFILL_ATTENTION
