/* quant_dot.c on x86 (the AVX-512 and AVX2 variants): a panel's 16 columns at 4 inputs are two
 * registers of 8 columns, each column's 4 unsigned values side by side in 32 bits, multiplied by the
 * row's 4 int8 activations with maddubs (pairs, exact: u <= 63) and madd (the pairs summed). */
#include <immintrin.h>

typedef struct { __m256 lo, hi; } fcols;

#define PREFETCH 4096 /* bytes ahead in a panel's stream that a step asks the cache for */

static inline fcols fcols_half(const uint16_t *p) {
    return (fcols){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}

static inline fcols fcols_int8_times(const int8_t *p, fcols by) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return (fcols){_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), by.lo),
                   _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), by.hi)};
}

/* The panel's 16 scales and lows of group g (scale_low in quant_dot.c, one column at a time). */
static inline __attribute__((always_inline)) void scale_low_cols(const void *scales, const void *lows,
                                                                 const uint16_t *supers, int64_t g,
                                                                 const struct qformat f, fcols *scale, fcols *low) {
    const int64_t at = g * PANEL;
    const fcols zero = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if (f.scale_bits == 8) {
        const uint16_t *super = supers + (g * f.group / SUPER) * (f.has_low ? 2 : 1) * PANEL;
        *scale = fcols_int8_times((const int8_t *)scales + at, fcols_half(super));
        *low = f.has_low ? fcols_int8_times((const int8_t *)lows + at, fcols_half(super + PANEL)) : zero;
    } else if (f.scale_bits == 16) {
        *scale = fcols_half((const uint16_t *)scales + at);
        *low = f.has_low ? fcols_half((const uint16_t *)lows + at) : zero;
    } else {
        *scale = (fcols){_mm256_loadu_ps((const float *)scales + at), _mm256_loadu_ps((const float *)scales + at + 8)};
        *low = f.has_low ? (fcols){_mm256_loadu_ps((const float *)lows + at), _mm256_loadu_ps((const float *)lows + at + 8)}
                         : zero;
    }
}

/* A panel's 16 columns at inputs i .. i + 3 (i a multiple of 4), each column's 4 unsigned values side
 * by side: w0 holds columns 0..3 and 8..11, w1 4..7 and 12..15 (in_order puts the sums back in column
 * order); i odd times 4 past a multiple of 8. The two rows of nibble pairs are one register (i, i + 1 | i + 2, i + 3); 5 and 6 bits: the
 * row of high bits in both halves, shifted per half so that input i's (i + 2's) are at bit 0. */
static inline __attribute__((always_inline)) void side_by_side(const uint8_t *panel, int64_t k, int64_t i,
                                                               const int odd, const struct qformat f, __m256i *w0,
                                                               __m256i *w1) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    _mm_prefetch((const char *)(panel + (i / 2) * PANEL + PREFETCH), _MM_HINT_T0);
    if (f.bits > 4 && i % 32 == 0)
        _mm_prefetch((const char *)(panel + k * (PANEL / 2) + (i / (8 / (f.bits - 4))) * PANEL + PREFETCH), _MM_HINT_T0);
    const __m256i pairs = _mm256_loadu_si256((const __m256i *)(panel + (i / 2) * PANEL));
    __m256i low = _mm256_and_si256(pairs, nibble), high = _mm256_and_si256(_mm256_srli_epi16(pairs, 4), nibble);
    if (f.bits > 4) {  /* the 32-bit shifts bring in a neighbour byte's bits only where the mask drops them */
        const int width = f.bits - 4, per_row = 8 / width;
        const __m256i top = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(panel + k * (PANEL / 2) + (i / per_row) * PANEL)));
        const __m256i keep = _mm256_set1_epi8(width == 1 ? 0x10 : 0x30);
        /* shift by i % per_row (0, or 4 where odd) in the first half, 2 * width more in the second:
         * constants either way, picked, not made, whether or not the compiler unrolls the caller's loop */
        const __m256i even_shifts = _mm256_setr_epi32(0, 0, 0, 0, 2 * width, 2 * width, 2 * width, 2 * width);
        const __m256i odd_shifts = _mm256_setr_epi32(4, 4, 4, 4, 4 + 2 * width, 4 + 2 * width, 4 + 2 * width, 4 + 2 * width);
        const __m256i at0 = _mm256_srlv_epi32(top, odd && width == 1 ? odd_shifts : even_shifts);
        low = _mm256_or_si256(low, _mm256_and_si256(_mm256_slli_epi32(at0, 4), keep));
        high = _mm256_or_si256(high, _mm256_and_si256(width == 1 ? _mm256_slli_epi32(at0, 3)
                                                                 : _mm256_slli_epi32(at0, 2), keep));
    }
    const __m256i a = _mm256_unpacklo_epi8(low, high), b = _mm256_unpackhi_epi8(low, high);  /* columns 0..7, 8..15 */
    const __m256i first = _mm256_permute2x128_si256(a, b, 0x20), second = _mm256_permute2x128_si256(a, b, 0x31);
    *w0 = _mm256_unpacklo_epi16(first, second);
    *w1 = _mm256_unpackhi_epi16(first, second);
}

static inline void in_order(__m256i *s0, __m256i *s1) {
    const __m256i a = *s0, b = *s1;
    *s0 = _mm256_permute2x128_si256(a, b, 0x20);
    *s1 = _mm256_permute2x128_si256(a, b, 0x31);
}

static inline __m256i dot4(__m256i w, __m256i x, __m256i acc) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

/* Rows r0 .. r0 + R - 1 against one panel. */
static inline __attribute__((always_inline)) void pass(const uint8_t *panel, const void *scales, const void *lows,
                                                       const uint16_t *supers, int64_t k, const struct qrows *rows,
                                                       int64_t r0, const int R, float *out, int64_t n,
                                                       const struct qformat f) {
    const int sub = f.group < XBLOCK ? f.group : XBLOCK;
    __m256 acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t s0 = 0; s0 < k; s0 += sub) {
        fcols scale, low;
        scale_low_cols(scales, lows, supers, s0 / f.group, f, &scale, &low);
        __m256i sums[ROWS][2];
        for (int r = 0; r < R; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
        for (int64_t i = s0; i < s0 + sub; i += 8)
#pragma GCC unroll 2
            for (int odd = 0; odd < 2; odd++) {
                __m256i w0, w1;
                side_by_side(panel, k, i + 4 * odd, odd, f, &w0, &w1);
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    __builtin_memcpy(&four, rows->q + (r0 + r) * k + i + 4 * odd, sizeof four);
                    const __m256i x = _mm256_set1_epi32(four);
                    sums[r][0] = dot4(w0, x, sums[r][0]);
                    sums[r][1] = dot4(w1, x, sums[r][1]);
                }
            }
        for (int r = 0; r < R; r++) {
            in_order(&sums[r][0], &sums[r][1]);
            const float d = rows->d[(r0 + r) * (k / XBLOCK) + s0 / XBLOCK];
            const __m256 dv = _mm256_set1_ps(d);
            if (f.bits == 6) {  /* values u - 32: the integer sums less 32 times the activations' (exact) */
                const __m256i off = _mm256_set1_epi32(rows->offsets[(r0 + r) * (k / 16) + s0 / 16]);
                sums[r][0] = _mm256_sub_epi32(sums[r][0], off);
                sums[r][1] = _mm256_sub_epi32(sums[r][1], off);
            }
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][0]), _mm256_mul_ps(scale.lo, dv), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][1]), _mm256_mul_ps(scale.hi, dv), acc[r][1]);
            if (f.has_low) {
                const __m256 xd = _mm256_set1_ps(sub == 16 ? rows->low16[(r0 + r) * (k / 16) + s0 / 16]
                                                           : rows->low32[(r0 + r) * (k / XBLOCK) + s0 / XBLOCK]);
                acc[r][0] = _mm256_fmadd_ps(low.lo, xd, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(low.hi, xd, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + (r0 + r) * n, acc[r][0]);
        _mm256_storeu_ps(out + (r0 + r) * n + 8, acc[r][1]);
    }
}

#if defined(__AVX512VNNI__)
/* AVX-512 VNNI: a panel's 16 columns at 4 inputs are one register, their 64 products summed by one
 * dpbusd; 8 rows a pass. The float steps are pass()'s, column by column, so the bits are its. */
#define WIDE_ROWS 8

static inline __m512 wide(fcols v) { return _mm512_insertf32x8(_mm512_castps256_ps512(v.lo), v.hi, 1); }

static inline __attribute__((always_inline)) void wide_pass(const uint8_t *panel, const void *scales,
                                                            const void *lows, const uint16_t *supers, int64_t k,
                                                            const struct qrows *rows, int64_t r0, const int R,
                                                            float *out, int64_t n, const struct qformat f) {
    const int sub = f.group < XBLOCK ? f.group : XBLOCK;
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < k; s0 += sub) {
        fcols scale, low;
        scale_low_cols(scales, lows, supers, s0 / f.group, f, &scale, &low);
        /* in the sums' column order (0-3, 8-11, 4-7, 12-15: a permutation its own inverse) */
        const __m512 scale16 = _mm512_shuffle_f32x4(wide(scale), wide(scale), _MM_SHUFFLE(3, 1, 2, 0));
        const __m512 low16 = _mm512_shuffle_f32x4(wide(low), wide(low), _MM_SHUFFLE(3, 1, 2, 0));
        __m512i sums[WIDE_ROWS];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
        for (int64_t i = s0; i < s0 + sub; i += 8)
#pragma GCC unroll 2
            for (int odd = 0; odd < 2; odd++) {
                __m256i w0, w1;
                side_by_side(panel, k, i + 4 * odd, odd, f, &w0, &w1);
                const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);  /* 0-3, 8-11, 4-7, 12-15 */
                const int32_t *fours = rows->fours + (i / 4 + odd) * rows->m + r0;
                for (int r = 0; r < R; r++) sums[r] = _mm512_dpbusd_epi32(sums[r], w, _mm512_set1_epi32(fours[r]));
            }
        for (int r = 0; r < R; r++) {
            __m512i sum = sums[r];
            const float d = rows->d[(r0 + r) * (k / XBLOCK) + s0 / XBLOCK];
            if (f.bits == 6)
                sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(rows->offsets[(r0 + r) * (k / 16) + s0 / 16]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale16, _mm512_set1_ps(d)), acc[r]);
            if (f.has_low)
                acc[r] = _mm512_fmadd_ps(low16, _mm512_set1_ps(sub == 16 ? rows->low16[(r0 + r) * (k / 16) + s0 / 16]
                                                                         : rows->low32[(r0 + r) * (k / XBLOCK) + s0 / XBLOCK]),
                                         acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out + (r0 + r) * n, _mm512_shuffle_f32x4(acc[r], acc[r], _MM_SHUFFLE(3, 1, 2, 0)));
}

#define PASS wide_pass
#define PASS_ROWS WIDE_ROWS
#define FOR_EACH_PASS_ROWS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#else
#define PASS pass
#define PASS_ROWS ROWS
#define FOR_EACH_PASS_ROWS(X) X(1) X(2) X(3) X(4)
#endif

/* Every row against one panel, PASS_ROWS at a time: each count of rows its own loop nest, so the
 * sums stay in registers. */
#define PASS_CASE(R) case R: PASS(panel, scales, lows, supers, k, rows, r0, R, out, n, f); break;

static inline __attribute__((always_inline)) void panel_rows(const uint8_t *panel, const void *scales,
                                                             const void *lows, const uint16_t *supers, int64_t k,
                                                             const struct qrows *rows, int64_t m, float *out,
                                                             int64_t n, const struct qformat f) {
    for (int64_t r0 = 0; r0 < m; r0 += PASS_ROWS)
        switch ((int)(m - r0 < PASS_ROWS ? m - r0 : PASS_ROWS)) { FOR_EACH_PASS_ROWS(PASS_CASE) }
}
