/* Attention over the paged KV cache, one query row at a time: decode rows (one token per sequence)
 * and a prefill chunk's rows, each computed as its token's decode would be. Each (rows, KV head)
 * reads its blocks in place: no gathered copy. Scores, softmax and the weighted sum of values are
 * float32 and a row's sums run in one order fixed by its own keys, so its result is the same bits
 * whatever else is in the batch, whatever was cached before it and however its prompt was chunked.
 * Two forms of the same sums: the portable loops below, and where the variant targets AVX-512,
 * decode_attention_avx512.h. Both are noinline: one compiled copy serves decode and prefill alike.
 *
 * Decode: q, out: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, num_kv_heads,
 * block_size, head_dim]; block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs]. Prefill: q,
 * out: [num_query, num_heads, head_dim]; table: the sequence's blocks. All contiguous. head_dim 64,
 * 96, 128 or 256. window > 0: a row sees its last `window` keys (Mistral's, Gemma's sliding layers);
 * softcap > 0: its scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2).
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_math.h"
#include "kernels.h"

/* where a sequence's block j holds a KV head's rows in a cache, in elements from its start */
static inline int64_t block_start(const int64_t *table, int64_t j, int64_t num_kv_heads, int64_t kv_head,
                                  int64_t row_stride) {
    return (table[j] * num_kv_heads + kv_head) * row_stride;
}

/* The first key a query of `len` keys sees: its last `window` (0: all of them). */
static inline int64_t first_key(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The portable form, one row and KV head at a time. T: the element type; LOAD(p): a float from
 * *p; STORE(x): T from a float; HD: the head size, a constant so that a query row and an
 * accumulator stay in registers. Each query head of the group takes its own pass over the keys and
 * the values, which the first pass leaves in L1/L2. The row sees keys first_key(len, window) ..
 * len - 1. `scores`: room for `len` floats, 64-byte aligned (so that a vectorized sum's split does
 * not depend on where the buffer fell). */
#define DEFINE_PORTABLE(NAME, T, LOAD, STORE, HD)                                                      \
static __attribute__((noinline)) void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len,   \
                 int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t group, float scale, \
                 int64_t window, float softcap, float *scores, T *out) {                               \
    const int64_t row_stride = block_size * HD, lo = first_key(len, window);                           \
    for (int64_t g = 0; g < group; g++) {                                                              \
        float qf[HD], acc[HD], max = -INFINITY, total = 0.f;                                           \
        for (int d = 0; d < HD; d++) { qf[d] = LOAD(q + g * HD + d); acc[d] = 0.f; }                   \
        for (int64_t first = lo / block_size * block_size; first < len; first += block_size) {         \
            const T *k = k_cache + block_start(table, first / block_size, num_kv_heads, kv_head, row_stride); \
            const int64_t n = len - first < block_size ? len - first : block_size;                     \
            for (int64_t i = first < lo ? lo - first : 0; i < n; i++) {                                \
                float sum = 0.f;                                                                       \
                for (int d = 0; d < HD; d++) sum += qf[d] * LOAD(k + i * HD + d);                      \
                const float x = sum * scale, capped = softcap > 0.f ? soft_capped(x, softcap) : x;     \
                scores[first + i] = capped;                                                            \
                max = capped > max ? capped : max;                                                     \
            }                                                                                          \
        }                                                                                              \
        for (int64_t t = lo; t < len; t++) { scores[t] = exp_clamped(scores[t] - max); total += scores[t]; } \
        for (int64_t first = lo / block_size * block_size; first < len; first += block_size) {         \
            const T *v = v_cache + block_start(table, first / block_size, num_kv_heads, kv_head, row_stride); \
            const int64_t n = len - first < block_size ? len - first : block_size;                     \
            for (int64_t i = first < lo ? lo - first : 0; i < n; i++) {                                \
                const float p = scores[first + i];                                                     \
                for (int d = 0; d < HD; d++) acc[d] += p * LOAD(v + i * HD + d);                       \
            }                                                                                          \
        }                                                                                              \
        for (int d = 0; d < HD; d++) out[g * HD + d] = STORE(acc[d] / total);                          \
    }                                                                                                  \
}

DEFINE_PORTABLE(decode_attention_f32_64_loops, float, F32_LOAD, F32_STORE, 64)
DEFINE_PORTABLE(decode_attention_bf16_64_loops, uint16_t, bf16_load, bf16_store, 64)
DEFINE_PORTABLE(decode_attention_f32_128_loops, float, F32_LOAD, F32_STORE, 128)
DEFINE_PORTABLE(decode_attention_bf16_128_loops, uint16_t, bf16_load, bf16_store, 128)
DEFINE_PORTABLE(decode_attention_f32_256_loops, float, F32_LOAD, F32_STORE, 256)
DEFINE_PORTABLE(decode_attention_f32_96_loops, float, F32_LOAD, F32_STORE, 96)
DEFINE_PORTABLE(decode_attention_bf16_96_loops, uint16_t, bf16_load, bf16_store, 96)
DEFINE_PORTABLE(decode_attention_bf16_256_loops, uint16_t, bf16_load, bf16_store, 256)

#if defined(__AVX512F__)
#include "decode_attention_avx512.h"
DEFINE_SLOTS(decode_attention_f32_64, float, F32_LOAD, f32_tile, F32_STORE, 64)
DEFINE_SLOTS(decode_attention_bf16_64, uint16_t, bf16_load, bf16_tile, bf16_store, 64)
DEFINE_SLOTS(decode_attention_f32_128, float, F32_LOAD, f32_tile, F32_STORE, 128)
DEFINE_SLOTS(decode_attention_bf16_128, uint16_t, bf16_load, bf16_tile, bf16_store, 128)
DEFINE_SLOTS(decode_attention_f32_256, float, F32_LOAD, f32_tile, F32_STORE, 256)
DEFINE_SLOTS(decode_attention_f32_96, float, F32_LOAD, f32_tile, F32_STORE, 96)
DEFINE_SLOTS(decode_attention_bf16_96, uint16_t, bf16_load, bf16_tile, bf16_store, 96)
DEFINE_SLOTS(decode_attention_bf16_256, uint16_t, bf16_load, bf16_tile, bf16_store, 256)
#define FAST_PATH(block_size) ((block_size) % 16 == 0)
#define ROWS_PER_ITEM(group) ((group) < MAX_SLOTS ? MAX_SLOTS / (group) : 1)
#else  /* never called: FAST_PATH is 0 */
#define MAX_SLOTS 1
#define DEFINE_NO_SLOTS(NAME, T)                                                                      \
static void NAME##_slots(const T *const *q, T *const *out, const int64_t *lens, int count,            \
                         const T *k_cache, const T *v_cache, const int64_t *table, int64_t kv_head,   \
                         int64_t num_kv_heads, int64_t block_size, float scale, int64_t window,       \
                         float softcap, float *scores, int64_t stride) {                              \
    (void)q, (void)out, (void)lens, (void)count, (void)k_cache, (void)v_cache, (void)table;           \
    (void)kv_head, (void)num_kv_heads, (void)block_size, (void)scale, (void)window, (void)softcap;    \
    (void)scores, (void)stride;                                                                       \
}
DEFINE_NO_SLOTS(decode_attention_f32_64, float)
DEFINE_NO_SLOTS(decode_attention_bf16_64, uint16_t)
DEFINE_NO_SLOTS(decode_attention_f32_128, float)
DEFINE_NO_SLOTS(decode_attention_bf16_128, uint16_t)
DEFINE_NO_SLOTS(decode_attention_f32_256, float)
DEFINE_NO_SLOTS(decode_attention_f32_96, float)
DEFINE_NO_SLOTS(decode_attention_bf16_96, uint16_t)
DEFINE_NO_SLOTS(decode_attention_bf16_256, uint16_t)
#define FAST_PATH(block_size) 0
#define ROWS_PER_ITEM(group) 1
#endif

/* One KV head for `rows` query rows of one sequence, row r seeing its first lens[r] keys: their
 * query heads of the KV head as the AVX-512 form's slots where it was built and the blocks hold
 * whole 16-key tiles, else the portable loops row by row. Either way a row's result is the one its
 * own keys give, whatever rows it is computed with. q, out: row 0's first head of the KV head;
 * row_stride: elements from one row to the next. 0, or -2 out of memory. */
#define DEFINE_ROWS(NAME, T, HD)                                                                       \
static int NAME##_rows(const T *q, T *out, int64_t row_stride, const int64_t *lens, int64_t rows,      \
                       int64_t group, const T *k_cache, const T *v_cache, const int64_t *table,        \
                       int64_t kv_head, int64_t num_kv_heads, int64_t block_size, float scale,        \
                       int64_t window, float softcap) {                                               \
    int64_t longest = 1;                                                                               \
    for (int64_t r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;                \
    const int64_t stride = (longest + 15) / 16 * 16;  /* each row of scores 64-byte aligned */          \
    const int64_t count = FAST_PATH(block_size) ? (rows * group < MAX_SLOTS ? rows * group : MAX_SLOTS) : 1; \
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(stride * count));                       \
    if (!scores) return -2;                                                                            \
    if (FAST_PATH(block_size)) {                                                                       \
        const T *qs[MAX_SLOTS];                                                                        \
        T *outs[MAX_SLOTS];                                                                            \
        int64_t seen[MAX_SLOTS];                                                                       \
        int filled = 0;                                                                                \
        for (int64_t r = 0; r < rows; r++)                                                             \
            for (int64_t g = 0; g < group; g++) {                                                      \
                qs[filled] = q + r * row_stride + g * HD, outs[filled] = out + r * row_stride + g * HD; \
                seen[filled] = lens[r];                                                                \
                if (++filled == MAX_SLOTS || (r == rows - 1 && g == group - 1)) {                      \
                    NAME##_slots(qs, outs, seen, filled, k_cache, v_cache, table, kv_head, num_kv_heads, \
                                 block_size, scale, window, softcap, scores, stride);                  \
                    filled = 0;                                                                        \
                }                                                                                      \
            }                                                                                          \
    } else {                                                                                           \
        for (int64_t r = 0; r < rows; r++)                                                             \
            NAME##_loops(q + r * row_stride, k_cache, v_cache, table, lens[r], kv_head, num_kv_heads,  \
                         block_size, group, scale, window, softcap, scores, out + r * row_stride);     \
    }                                                                                                  \
    free(scores);                                                                                      \
    return 0;                                                                                          \
}

/* Decode: every (sequence, KV head) on torch's OpenMP threads. */
#define DEFINE_DECODE(NAME, T, HD)                                                                     \
DEFINE_ROWS(NAME, T, HD)                                                                               \
int SY_KERNEL(NAME)(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,       \
         const int64_t *context_lens, T *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, \
         int64_t block_size, int64_t max_blocks, float scale, int64_t window, float softcap) {        \
    const int64_t group = num_heads / num_kv_heads;                                                    \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                          \
    for (int64_t s = 0; s < num_seqs; s++) {                                                           \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                   \
            const int64_t first_head = (s * num_heads + h * group) * HD;                               \
            if (NAME##_rows(q + first_head, out + first_head, 0, context_lens + s, 1, group, k_cache,  \
                            v_cache, block_tables + s * max_blocks, h, num_kv_heads, block_size, scale, \
                            window, softcap))                                                          \
                failed = 1;                                                                            \
        }                                                                                              \
    }                                                                                                  \
    return failed ? -2 : 0;                                                                            \
}

/* A prefill chunk of one sequence after num_cached keys, its row i seeing num_cached + i + 1 keys, as
 * that token's decode would: every (tile of rows, KV head) on torch's OpenMP threads, a tile's rows
 * sharing each key tile's loads. table: the sequence's blocks. */
#define DEFINE_PREFILL(NAME, DECODE, T, HD)                                                            \
int SY_KERNEL(NAME)(const T *q, const T *k_cache, const T *v_cache, const int64_t *table,              \
         int64_t num_cached, T *out, int64_t num_query, int64_t num_heads, int64_t num_kv_heads,       \
         int64_t block_size, float scale, int64_t window, float softcap) {                            \
    const int64_t group = num_heads / num_kv_heads;                                                    \
    /* as many rows a tile as make four items a thread (how rows are grouped changes no row's sums) */ \
    const int64_t spread = num_query * num_kv_heads / (4 * omp_get_max_threads());                     \
    const int64_t per_item = !FAST_PATH(block_size) || spread < 1 ? 1                                  \
        : (spread < ROWS_PER_ITEM(group) ? spread : ROWS_PER_ITEM(group));                             \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                          \
    for (int64_t first_row = 0; first_row < num_query; first_row += per_item) {                        \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                   \
            int64_t lens[MAX_SLOTS];                                                                   \
            const int64_t rows = num_query - first_row < per_item ? num_query - first_row : per_item;  \
            for (int64_t r = 0; r < rows; r++) lens[r] = num_cached + first_row + r + 1;               \
            const int64_t first_head = (first_row * num_heads + h * group) * HD;                       \
            if (DECODE##_rows(q + first_head, out + first_head, num_heads * HD, lens, rows, group,     \
                              k_cache, v_cache, table, h, num_kv_heads, block_size, scale, window,     \
                              softcap))                                                                \
                failed = 1;                                                                            \
        }                                                                                              \
    }                                                                                                  \
    return failed ? -2 : 0;                                                                            \
}

DEFINE_DECODE(decode_attention_f32_64, float, 64)
DEFINE_DECODE(decode_attention_bf16_64, uint16_t, 64)
DEFINE_DECODE(decode_attention_f32_128, float, 128)
DEFINE_DECODE(decode_attention_bf16_128, uint16_t, 128)
DEFINE_DECODE(decode_attention_f32_256, float, 256)
DEFINE_DECODE(decode_attention_f32_96, float, 96)
DEFINE_DECODE(decode_attention_bf16_96, uint16_t, 96)
DEFINE_DECODE(decode_attention_bf16_256, uint16_t, 256)
DEFINE_PREFILL(prefill_attention_f32_64, decode_attention_f32_64, float, 64)
DEFINE_PREFILL(prefill_attention_bf16_64, decode_attention_bf16_64, uint16_t, 64)
DEFINE_PREFILL(prefill_attention_f32_128, decode_attention_f32_128, float, 128)
DEFINE_PREFILL(prefill_attention_bf16_128, decode_attention_bf16_128, uint16_t, 128)
DEFINE_PREFILL(prefill_attention_f32_256, decode_attention_f32_256, float, 256)
DEFINE_PREFILL(prefill_attention_f32_96, decode_attention_f32_96, float, 96)
DEFINE_PREFILL(prefill_attention_bf16_96, decode_attention_bf16_96, uint16_t, 96)
DEFINE_PREFILL(prefill_attention_bf16_256, decode_attention_bf16_256, uint16_t, 256)
