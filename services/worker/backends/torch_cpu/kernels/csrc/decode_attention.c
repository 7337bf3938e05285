/* Decode attention over the paged KV cache, one query token per sequence. Each (sequence, KV head)
 * reads its blocks in place: no gathered copy. Scores, softmax and the weighted sum of values are
 * float32; a sequence's result depends on its own rows only, so it is the same whatever else is in
 * the batch. Two forms of the same sums: the portable loops below, and where the variant targets
 * AVX-512, decode_attention_avx512.h.
 *
 * q, out: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, num_kv_heads, block_size,
 * head_dim]; block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs]. All contiguous.
 */
#include <stdlib.h>

#include "cpu_math.h"
#include "kernels.h"

/* where a sequence's block j holds a KV head's rows in a cache, in elements from its start */
static inline int64_t block_start(const int64_t *table, int64_t j, int64_t num_kv_heads, int64_t kv_head,
                                  int64_t row_stride) {
    return (table[j] * num_kv_heads + kv_head) * row_stride;
}

/* The portable form, one (sequence, KV head) at a time. T: the element type; LOAD(p): a float from
 * *p; STORE(x): T from a float; HD: the head size, a constant so that a query row and an
 * accumulator stay in registers. Each query head of the group takes its own pass over the keys and
 * the values, which the first pass leaves in L1/L2. `scores`: room for `len` floats. */
#define DEFINE_PORTABLE(NAME, T, LOAD, STORE, HD)                                                      \
static void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len,   \
                 int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t group, float scale, \
                 float *scores, T *out) {                                                              \
    const int64_t row_stride = block_size * HD;                                                        \
    for (int64_t g = 0; g < group; g++) {                                                              \
        float qf[HD], acc[HD], max = -INFINITY, total = 0.f;                                           \
        for (int d = 0; d < HD; d++) { qf[d] = LOAD(q + g * HD + d); acc[d] = 0.f; }                   \
        for (int64_t first = 0; first < len; first += block_size) {  /* block by block */              \
            const T *k = k_cache + block_start(table, first / block_size, num_kv_heads, kv_head, row_stride); \
            const int64_t n = len - first < block_size ? len - first : block_size;                     \
            for (int64_t i = 0; i < n; i++, k += HD) {                                                 \
                float sum = 0.f;                                                                       \
                for (int d = 0; d < HD; d++) sum += qf[d] * LOAD(k + d);                               \
                scores[first + i] = sum * scale;                                                       \
                max = scores[first + i] > max ? scores[first + i] : max;                               \
            }                                                                                          \
        }                                                                                              \
        for (int64_t t = 0; t < len; t++) { scores[t] = exp_clamped(scores[t] - max); total += scores[t]; } \
        for (int64_t first = 0; first < len; first += block_size) {                                    \
            const T *v = v_cache + block_start(table, first / block_size, num_kv_heads, kv_head, row_stride); \
            const int64_t n = len - first < block_size ? len - first : block_size;                     \
            for (int64_t i = 0; i < n; i++, v += HD) {                                                 \
                const float p = scores[first + i];                                                     \
                for (int d = 0; d < HD; d++) acc[d] += p * LOAD(v + d);                                \
            }                                                                                          \
        }                                                                                              \
        for (int d = 0; d < HD; d++) out[g * HD + d] = STORE(acc[d] / total);                          \
    }                                                                                                  \
}

DEFINE_PORTABLE(decode_attention_f32_64_loops, float, F32_LOAD, F32_STORE, 64)
DEFINE_PORTABLE(decode_attention_bf16_64_loops, uint16_t, bf16_load, bf16_store, 64)
DEFINE_PORTABLE(decode_attention_f32_128_loops, float, F32_LOAD, F32_STORE, 128)
DEFINE_PORTABLE(decode_attention_bf16_128_loops, uint16_t, bf16_load, bf16_store, 128)

#if defined(__AVX512F__)
#include "decode_attention_avx512.h"
DEFINE_TILES(decode_attention_f32_64_tiles, float, F32_LOAD, f32_tile, F32_STORE, 64)
DEFINE_TILES(decode_attention_bf16_64_tiles, uint16_t, bf16_load, bf16_tile, bf16_store, 64)
DEFINE_TILES(decode_attention_f32_128_tiles, float, F32_LOAD, f32_tile, F32_STORE, 128)
DEFINE_TILES(decode_attention_bf16_128_tiles, uint16_t, bf16_load, bf16_tile, bf16_store, 128)
#define FAST_PATH(block_size) ((block_size) % 16 == 0)
#else  /* the tiles' names, never called, stand for the portable form */
#define decode_attention_f32_64_tiles decode_attention_f32_64_loops
#define decode_attention_bf16_64_tiles decode_attention_bf16_64_loops
#define decode_attention_f32_128_tiles decode_attention_f32_128_loops
#define decode_attention_bf16_128_tiles decode_attention_bf16_128_loops
#define FAST_PATH(block_size) 0
#endif

/* The entry point: every (sequence, KV head) on torch's OpenMP threads, the AVX-512 form where it
 * was built and the blocks hold whole 16-key tiles, else the portable one. */
#define DEFINE_DECODE(NAME, T, HD)                                                                     \
int SY_KERNEL(NAME)(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,                  \
         const int64_t *context_lens, T *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, \
         int64_t block_size, int64_t max_blocks, float scale) {                                        \
    const int64_t group = num_heads / num_kv_heads;                                                    \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                          \
    for (int64_t s = 0; s < num_seqs; s++) {                                                           \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                   \
            const int64_t len = context_lens[s], first_head = (s * num_heads + h * group) * HD;        \
            float *scores = malloc(sizeof(float) * (size_t)(len > 0 ? len : 1) * (size_t)group);       \
            if (!scores) { failed = 1; continue; }                                                     \
            if (FAST_PATH(block_size))                                                                 \
                NAME##_tiles(q + first_head, k_cache, v_cache, block_tables + s * max_blocks, len, h,   \
                             num_kv_heads, block_size, group, scale, scores, out + first_head);        \
            else                                                                                       \
                NAME##_loops(q + first_head, k_cache, v_cache, block_tables + s * max_blocks, len,  \
                                h, num_kv_heads, block_size, group, scale, scores, out + first_head);  \
            free(scores);                                                                              \
        }                                                                                              \
    }                                                                                                  \
    return failed ? -2 : 0;                                                                            \
}

DEFINE_DECODE(decode_attention_f32_64, float, 64)
DEFINE_DECODE(decode_attention_bf16_64, uint16_t, 64)
DEFINE_DECODE(decode_attention_f32_128, float, 128)
DEFINE_DECODE(decode_attention_bf16_128, uint16_t, 128)
