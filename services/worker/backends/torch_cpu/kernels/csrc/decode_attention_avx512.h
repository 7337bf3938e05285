/* decode_attention.c's AVX-512 form: the query heads of a KV head share each 16-key tile, whose 16
 * dot products are summed across lanes together; the next block is prefetched while one is read. */
#include <immintrin.h>

#define AHEAD 1                         /* blocks prefetched ahead of the one being read */
#define MAX_HEADS 4                     /* query heads per pass over the blocks, at most */
#define HEADS_PER_PASS(HD) (256 / (HD)) /* so that their accumulators fill 16 registers */

/* A tile's 16 rows of head_dim floats: float32 rows as they are, bfloat16 rows widened into buf. */
static inline const float *f32_tile(const float *rows, float *buf, int64_t count) {
    (void)buf, (void)count;
    return rows;
}

static inline const float *bf16_tile(const uint16_t *rows, float *buf, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(rows + i)));
        _mm512_store_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
    return buf;
}

/* Lane i of the result: the sum of v[i]'s 16 lanes (halving 16 vectors into one, then reordering). */
static inline __m512 lane_sums(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* 128-bit quarters: [v0 (q0+q2), v0 (q1+q3), v1 (...), v1 (...)] */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarter j: v[4i + j]'s four partial sums */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    /* lane 4j + m holds v[4m + j] */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

static inline void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch((const char *)block + offset);
}

/* NAME##_pass: `heads` (a constant once inlined) query heads over one KV head's blocks; q, out: those
 * heads' rows; scores: heads x len. NAME##_tiles: the group in passes of HEADS_PER_PASS heads. */
#define DEFINE_TILES(NAME, T, LOAD, TILE, STORE, HD)                                                   \
static inline __attribute__((always_inline)) void NAME##_pass(                                         \
        const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len,             \
        int64_t kv_head, int64_t num_kv_heads, int64_t block_size, const int heads, float scale,       \
        float *scores, T *out) {                                                                       \
    enum { C = HD / 16 };                                                                              \
    const int64_t row_stride = block_size * HD, block_bytes = row_stride * (int64_t)sizeof(T);         \
    float tile[16 * HD] __attribute__((aligned(64))), qf[MAX_HEADS][HD] __attribute__((aligned(64)));  \
    __m512 max[MAX_HEADS], acc[MAX_HEADS][C];                                                          \
    for (int g = 0; g < heads; g++) {                                                                  \
        for (int d = 0; d < HD; d++) qf[g][d] = LOAD(q + g * HD + d) * scale;                          \
        max[g] = _mm512_set1_ps(-INFINITY);                                                            \
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();                                   \
    }                                                                                                  \
    for (int64_t first = 0; first < len; first += block_size) {                                        \
        const int64_t j = first / block_size, n = len - first < block_size ? len - first : block_size;  \
        const T *block = k_cache + block_start(table, j, num_kv_heads, kv_head, row_stride);               \
        if (first + AHEAD * block_size < len)                                                          \
            prefetch_block(k_cache + block_start(table, j + AHEAD, num_kv_heads, kv_head, row_stride), block_bytes); \
        for (int64_t i0 = 0; i0 < n; i0 += 16) {  /* rows past n are in the block, unused */           \
            const float *k = TILE(block + i0 * HD, tile, 16 * HD);                                     \
            const __mmask16 valid = n - i0 >= 16 ? 0xffff : (__mmask16)((1u << (n - i0)) - 1);          \
            for (int g = 0; g < heads; g++) {                                                          \
                __m512 part[16];                                                                       \
                for (int i = 0; i < 16; i++) {                                                         \
                    part[i] = _mm512_mul_ps(_mm512_loadu_ps(k + i * HD), _mm512_load_ps(qf[g]));       \
                    for (int c = 1; c < C; c++)                                                        \
                        part[i] = _mm512_fmadd_ps(_mm512_loadu_ps(k + i * HD + 16 * c),                \
                                                  _mm512_load_ps(qf[g] + 16 * c), part[i]);            \
                }                                                                                      \
                const __m512 s = lane_sums(part);                                                      \
                _mm512_mask_storeu_ps(scores + g * len + first + i0, valid, s);                        \
                max[g] = _mm512_mask_max_ps(max[g], valid, max[g], s);                                 \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    float total[MAX_HEADS];                                                                            \
    for (int g = 0; g < heads; g++) {                                                                  \
        float *row = scores + g * len, sum = 0.f;                                                      \
        const float top = _mm512_reduce_max_ps(max[g]);                                               \
        for (int64_t t = 0; t < len; t++) { row[t] = exp_clamped(row[t] - top); sum += row[t]; }   \
        total[g] = sum;                                                                                \
    }                                                                                                  \
    for (int64_t first = 0; first < len; first += block_size) {                                        \
        const int64_t j = first / block_size, n = len - first < block_size ? len - first : block_size;  \
        const T *block = v_cache + block_start(table, j, num_kv_heads, kv_head, row_stride);               \
        if (first + AHEAD * block_size < len)                                                          \
            prefetch_block(v_cache + block_start(table, j + AHEAD, num_kv_heads, kv_head, row_stride), block_bytes); \
        for (int64_t i0 = 0; i0 < n; i0 += 16) {                                                       \
            const float *v = TILE(block + i0 * HD, tile, 16 * HD);                                     \
            const int64_t rows = n - i0 < 16 ? n - i0 : 16;                                            \
            for (int64_t i = 0; i < rows; i++)                                                         \
                for (int g = 0; g < heads; g++) {                                                      \
                    const __m512 p = _mm512_set1_ps(scores[g * len + first + i0 + i]);                 \
                    for (int c = 0; c < C; c++)                                                        \
                        acc[g][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + i * HD + 16 * c), acc[g][c]); \
                }                                                                                      \
        }                                                                                              \
    }                                                                                                  \
    for (int g = 0; g < heads; g++) {                                                                  \
        float row[HD] __attribute__((aligned(64)));                                                    \
        for (int c = 0; c < C; c++)                                                                    \
            _mm512_store_ps(row + 16 * c, _mm512_div_ps(acc[g][c], _mm512_set1_ps(total[g])));          \
        for (int d = 0; d < HD; d++) out[g * HD + d] = STORE(row[d]);                                  \
    }                                                                                                  \
}                                                                                                      \
static void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len,   \
                 int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t group, float scale, \
                 float *scores, T *out) {                                                              \
    for (int64_t g0 = 0; g0 < group; g0 += HEADS_PER_PASS(HD)) {                                       \
        const int64_t left = group - g0, heads = left < HEADS_PER_PASS(HD) ? left : HEADS_PER_PASS(HD); \
        const T *qh = q + g0 * HD;                                                                     \
        float *sh = scores + g0 * len;                                                                 \
        T *oh = out + g0 * HD;                                                                         \
        switch (heads) {  /* each count its own loop nest, unrolled, accumulators in registers */      \
        case 1: NAME##_pass(qh, k_cache, v_cache, table, len, kv_head, num_kv_heads, block_size, 1, scale, sh, oh); break; \
        case 2: NAME##_pass(qh, k_cache, v_cache, table, len, kv_head, num_kv_heads, block_size, 2, scale, sh, oh); break; \
        case 3: NAME##_pass(qh, k_cache, v_cache, table, len, kv_head, num_kv_heads, block_size, 3, scale, sh, oh); break; \
        default: NAME##_pass(qh, k_cache, v_cache, table, len, kv_head, num_kv_heads, block_size, 4, scale, sh, oh); \
        }                                                                                              \
    }                                                                                                  \
}
