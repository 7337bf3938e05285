/* The grouped LoRA GEMM of a mixed batch (a CPU SGMV): each token's row through its own adapter
 * slot's A, then B, added into the base Linear's output row; tokens on the base model (slot -1)
 * are skipped. The tokens are grouped by slot in chunks of CHUNK, so a slot's A and B are read once
 * per chunk (once a step, for decode rows), and the chunks share the threads. B is read only where
 * it is not zero: slice i's outputs take slice i's rank columns. The arithmetic is float32. */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_math.h"
#include "kernels.h"

#define CHUNK 16

/* x: [tokens, in]; y: [tokens, out], added into; a: [slots, width, in]; b: [slots, out, width],
 * width = num_slices * rank, slice i's outputs offsets[i]..offsets[i + 1] - 1 reading columns
 * i * rank..; slots: [tokens], each -1 or a slot below num_slots. 0, or -2 out of memory */
#define DEFINE_LORA(SUFFIX, T, LOAD, STORE)                                                            \
int SY_KERNEL(lora_add_##SUFFIX)(const T *x, T *y, const T *a, const T *b, const int64_t *slots,        \
                                 int64_t tokens, int64_t in, int64_t out, int64_t width, int64_t num_slots, \
                                 const int64_t *offsets, int64_t num_slices) {                         \
    int64_t *order = malloc(sizeof(int64_t) * (tokens + 2 * (num_slots + 1) + tokens / CHUNK + num_slots)); \
    if (order == NULL)                                                                                 \
        return -2;                                                                                     \
    int64_t *starts = order + tokens, *fill = starts + num_slots + 1, *items = fill + num_slots + 1;   \
    for (int64_t s = 0; s <= num_slots; s++)                                                           \
        starts[s] = 0;                                                                                 \
    for (int64_t t = 0; t < tokens; t++)                                                               \
        if (slots[t] >= 0)                                                                             \
            starts[slots[t] + 1]++;                                                                    \
    for (int64_t s = 0; s < num_slots; s++)                                                            \
        starts[s + 1] += starts[s];                                                                    \
    for (int64_t s = 0; s <= num_slots; s++)                                                           \
        fill[s] = starts[s];                                                                           \
    for (int64_t t = 0; t < tokens; t++)                                                               \
        if (slots[t] >= 0)                                                                             \
            order[fill[slots[t]]++] = t;                                                               \
    int64_t num_items = 0; /* each a chunk's first index into order */                                 \
    for (int64_t s = 0; s < num_slots; s++)                                                            \
        for (int64_t i = starts[s]; i < starts[s + 1]; i += CHUNK)                                     \
            items[num_items++] = i;                                                                    \
    const int64_t rank = width / num_slices;                                                           \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel for schedule(dynamic) if(num_items >= 2)")                                   \
    for (int64_t item = 0; item < num_items; item++) {                                                 \
        const int64_t first = items[item], s = slots[order[first]];                                    \
        const int64_t count = (starts[s + 1] - first) < CHUNK ? starts[s + 1] - first : CHUNK;         \
        float *shrunk = malloc(sizeof(float) * CHUNK * width);                                         \
        if (shrunk == NULL) {                                                                          \
            failed = 1;                                                                                \
            continue;                                                                                  \
        }                                                                                              \
        const T *as = a + s * width * in, *bs = b + s * out * width;                                   \
        for (int64_t j = 0; j < width; j++) {                                                          \
            const T *aj = as + j * in;                                                                 \
            for (int64_t c = 0; c < count; c++) {                                                      \
                const T *xt = x + order[first + c] * in;                                               \
                float acc = 0.f;                                                                       \
                for (int64_t k = 0; k < in; k++)                                                       \
                    acc += LOAD(aj + k) * LOAD(xt + k);                                                \
                shrunk[c * width + j] = acc;                                                           \
            }                                                                                          \
        }                                                                                              \
        for (int64_t i = 0; i < num_slices; i++) {                                                     \
            for (int64_t n = offsets[i]; n < offsets[i + 1]; n++) {                                    \
                const T *bn = bs + n * width + i * rank;                                               \
                for (int64_t c = 0; c < count; c++) {                                                  \
                    const float *h = shrunk + c * width + i * rank;                                    \
                    float acc = 0.f;                                                                   \
                    for (int64_t j = 0; j < rank; j++)                                                 \
                        acc += LOAD(bn + j) * h[j];                                                    \
                    T *yt = y + order[first + c] * out + n;                                            \
                    *yt = STORE(LOAD(yt) + acc);                                                       \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        free(shrunk);                                                                                  \
    }                                                                                                  \
    free(order);                                                                                       \
    return failed ? -2 : 0;                                                                            \
}

DEFINE_LORA(f32, float, F32_LOAD, F32_STORE)
DEFINE_LORA(bf16, uint16_t, bf16_load, bf16_store)
