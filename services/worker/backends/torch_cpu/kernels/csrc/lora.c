/* The grouped LoRA GEMM of a mixed batch (a CPU SGMV): each token's row through its own adapter
 * slot's A, then B, added into the base Linear's output row; tokens on the base model (slot -1)
 * are skipped. One pass per token reads its slot's A and B once; the arithmetic is float32. */
#include <stdint.h>

#include "cpu_math.h"
#include "kernels.h"

/* x: [tokens, in]; y: [tokens, out], added into; a: [slots, width, in]; b: [slots, out, width]
 * (width: the slot's ranks side by side); slots: [tokens], each -1 or a slot */
#define DEFINE_LORA(SUFFIX, T, LOAD, STORE)                                                            \
void SY_KERNEL(lora_add_##SUFFIX)(const T *x, T *y, const T *a, const T *b, const int64_t *slots,       \
                                  int64_t tokens, int64_t in, int64_t out, int64_t width) {            \
    _Pragma("omp parallel for schedule(static) if(tokens >= 2)")                                       \
    for (int64_t t = 0; t < tokens; t++) {                                                             \
        const int64_t s = slots[t];                                                                    \
        if (s < 0)                                                                                     \
            continue;                                                                                  \
        float shrunk[width];                                                                           \
        const T *xt = x + t * in, *as = a + s * width * in, *bs = b + s * out * width;                 \
        for (int64_t j = 0; j < width; j++) {                                                          \
            const T *aj = as + j * in;                                                                 \
            float acc = 0.f;                                                                           \
            for (int64_t k = 0; k < in; k++)                                                           \
                acc += LOAD(aj + k) * LOAD(xt + k);                                                    \
            shrunk[j] = acc;                                                                           \
        }                                                                                              \
        T *yt = y + t * out;                                                                           \
        for (int64_t n = 0; n < out; n++) {                                                            \
            const T *bn = bs + n * width;                                                              \
            float acc = 0.f;                                                                           \
            for (int64_t j = 0; j < width; j++)                                                        \
                acc += LOAD(bn + j) * shrunk[j];                                                       \
            yt[n] = STORE(LOAD(yt + n) + acc);                                                         \
        }                                                                                              \
    }                                                                                                  \
}

DEFINE_LORA(f32, float, F32_LOAD, F32_STORE)
DEFINE_LORA(bf16, uint16_t, bf16_load, bf16_store)
