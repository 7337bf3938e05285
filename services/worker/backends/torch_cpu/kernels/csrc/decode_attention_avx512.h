/* decode_attention.c's AVX-512 form: the queries of a KV head (slots: the heads of a row, or of several
 * rows) share each 16-key tile, whose 16 dot products are summed across lanes together; the next block
 * is prefetched while one is read. */
#include <immintrin.h>

#define AHEAD 1      /* blocks prefetched ahead of the one being read */
#define MAX_SLOTS 64 /* queries per pass over the blocks, at most */

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

/* Each lane's score soft-capped (soft_capped, lane by lane: the same bits as the portable loops'). */
static inline __m512 soft_capped_lanes(__m512 sums, float cap) {
    float lanes[16] __attribute__((aligned(64)));
    _mm512_store_ps(lanes, sums);
    for (int i = 0; i < 16; i++) lanes[i] = soft_capped(lanes[i], cap);
    return _mm512_load_ps(lanes);
}

static inline void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch((const char *)block + offset);
}

/* NAME##_slots: `count` (<= MAX_SLOTS) queries over one KV head's blocks, query s seeing keys
 * first_key(lens[s], window) .. lens[s] - 1, its scores soft-capped where softcap > 0; q[s], out[s]:
 * its head_dim values. Each query's sums are in one order whatever the other slots are: its scores
 * tile by tile, its softmax over its own row of `scores` (count rows of `stride` floats, 64-byte
 * aligned), its values key by key. The accumulators live in L1 between tiles, so that any number of
 * queries share a tile's loads. */
#define DEFINE_SLOTS(NAME, T, LOAD, TILE, STORE, HD)                                                   \
static __attribute__((noinline)) void NAME##_slots(                                                    \
        const T *const *q, T *const *out, const int64_t *lens, int count, const T *k_cache,             \
        const T *v_cache, const int64_t *table, int64_t kv_head, int64_t num_kv_heads,                 \
        int64_t block_size, float scale, int64_t window, float softcap, float *scores, int64_t stride) { \
    enum { C = HD / 16 };                                                                              \
    const int64_t row_stride = block_size * HD, block_bytes = row_stride * (int64_t)sizeof(T);         \
    float tile[16 * HD] __attribute__((aligned(64))), qf[MAX_SLOTS][HD] __attribute__((aligned(64)));  \
    float acc[MAX_SLOTS][HD] __attribute__((aligned(64))), total[MAX_SLOTS];                           \
    __m512 max[MAX_SLOTS];                                                                             \
    int64_t longest = 0, lo[MAX_SLOTS], earliest = INT64_MAX;                                          \
    for (int s = 0; s < count; s++) {                                                                  \
        lo[s] = first_key(lens[s], window);                                                            \
        earliest = lo[s] < earliest ? lo[s] : earliest;                                                \
        for (int d = 0; d < HD; d++) qf[s][d] = LOAD(q[s] + d) * scale;                                \
        for (int d = 0; d < HD; d++) acc[s][d] = 0.f;                                                  \
        max[s] = _mm512_set1_ps(-INFINITY);                                                            \
        longest = lens[s] > longest ? lens[s] : longest;                                               \
    }                                                                                                  \
    const int64_t start = earliest / block_size * block_size;                                          \
    for (int64_t first = start; first < longest; first += block_size) {                                \
        const int64_t j = first / block_size, n = longest - first < block_size ? longest - first : block_size; \
        const T *block = k_cache + block_start(table, j, num_kv_heads, kv_head, row_stride);           \
        if (first + AHEAD * block_size < longest)                                                      \
            prefetch_block(k_cache + block_start(table, j + AHEAD, num_kv_heads, kv_head, row_stride), block_bytes); \
        for (int64_t i0 = 0; i0 < n; i0 += 16) {  /* rows past a query's keys are in the block, unused */ \
            if (first + i0 + 16 <= earliest) continue;  /* before every query's window */              \
            const float *k = TILE(block + i0 * HD, tile, 16 * HD);                                     \
            for (int s = 0; s < count; s++) {                                                          \
                const int64_t seen = lens[s] - first - i0, before = lo[s] - first - i0;  /* of the tile's keys */ \
                if (seen <= 0 || before >= 16) continue;                                               \
                __mmask16 valid = seen >= 16 ? 0xffff : (__mmask16)((1u << seen) - 1);                 \
                if (before > 0) valid &= (__mmask16)(0xffffu << before);                               \
                __m512 part[16];                                                                       \
                for (int i = 0; i < 16; i++) {                                                         \
                    part[i] = _mm512_mul_ps(_mm512_loadu_ps(k + i * HD), _mm512_load_ps(qf[s]));       \
                    for (int c = 1; c < C; c++)                                                        \
                        part[i] = _mm512_fmadd_ps(_mm512_loadu_ps(k + i * HD + 16 * c),                \
                                                  _mm512_load_ps(qf[s] + 16 * c), part[i]);            \
                }                                                                                      \
                const __m512 sums = softcap > 0.f ? soft_capped_lanes(lane_sums(part), softcap) : lane_sums(part); \
                _mm512_mask_storeu_ps(scores + s * stride + first + i0, valid, sums);                  \
                max[s] = _mm512_mask_max_ps(max[s], valid, max[s], sums);                              \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int s = 0; s < count; s++) {                                                                  \
        float *row = scores + s * stride, sum = 0.f;                                                   \
        const float top = _mm512_reduce_max_ps(max[s]);                                                \
        for (int64_t t = lo[s]; t < lens[s]; t++) { row[t] = exp_clamped(row[t] - top); sum += row[t]; } \
        total[s] = sum;                                                                                \
    }                                                                                                  \
    for (int64_t first = start; first < longest; first += block_size) {                                \
        const int64_t j = first / block_size, n = longest - first < block_size ? longest - first : block_size; \
        const T *block = v_cache + block_start(table, j, num_kv_heads, kv_head, row_stride);           \
        if (first + AHEAD * block_size < longest)                                                      \
            prefetch_block(v_cache + block_start(table, j + AHEAD, num_kv_heads, kv_head, row_stride), block_bytes); \
        for (int64_t i0 = 0; i0 < n; i0 += 16) {                                                       \
            if (first + i0 + 16 <= earliest) continue;                                                 \
            const float *v = TILE(block + i0 * HD, tile, 16 * HD);                                     \
            for (int s = 0; s < count; s++) {                                                          \
                const int64_t seen = lens[s] - first - i0, rows = seen < 16 ? seen : 16;               \
                const int64_t before = lo[s] - first - i0;                                             \
                if (seen <= 0 || before >= 16) continue;                                               \
                const float *p = scores + s * stride + first + i0;                                     \
                __m512 a[C];                                                                           \
                for (int c = 0; c < C; c++) a[c] = _mm512_load_ps(acc[s] + 16 * c);                    \
                for (int64_t i = before > 0 ? before : 0; i < rows; i++)                               \
                    for (int c = 0; c < C; c++)                                                        \
                        a[c] = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), _mm512_loadu_ps(v + i * HD + 16 * c), a[c]); \
                for (int c = 0; c < C; c++) _mm512_store_ps(acc[s] + 16 * c, a[c]);                    \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int s = 0; s < count; s++) {                                                                  \
        float row[HD] __attribute__((aligned(64)));                                                    \
        for (int c = 0; c < C; c++)                                                                    \
            _mm512_store_ps(row + 16 * c, _mm512_div_ps(_mm512_load_ps(acc[s] + 16 * c), _mm512_set1_ps(total[s]))); \
        for (int d = 0; d < HD; d++) out[s][d] = STORE(row[d]);                                        \
    }                                                                                                  \
}
