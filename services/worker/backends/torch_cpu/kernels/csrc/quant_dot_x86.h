/* quant_dot.c on x86 (the AVX-512 and AVX2 variants): a panel's 16 columns at 4 inputs are two
 * registers of 8 columns, each column's 4 unsigned values side by side in 32 bits, multiplied by the
 * row's 4 int8 activations with maddubs (pairs, exact: u <= 63) and madd (the pairs summed). */
#include <immintrin.h>

typedef struct { __m256 lo, hi; } fcols;

#define PREFETCH 4096 /* bytes ahead in a panel's stream that a step asks the cache for */

static inline int32_t sum_lanes(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* quant_dot_portable.h's block_top in vectors: max|x| (a NaN passed over, as fmaxf does; a maximum
 * is exact in any order). */
static inline float block_top(const float *in, int64_t n) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) top8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(in + i), magnitude), top8);
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

/* quant_dot_portable.h's quantize_32 in vectors: cvtps's rounding to nearest even (lrintf's), the
 * packs in order. */
static inline void quantize_32(const float *in, float inv, int8_t *q, int32_t sums[2]) {
    __m256i v[4];
    for (int j = 0; j < 4; j++) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(in + 8 * j), _mm256_set1_ps(inv)));
    sums[0] = sum_lanes(_mm256_add_epi32(v[0], v[1]));
    sums[1] = sum_lanes(_mm256_add_epi32(v[2], v[3]));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline fcols fcols_half(const uint16_t *p) {
    return (fcols){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}

static inline fcols fcols_int8_times(const int8_t *p, fcols by) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return (fcols){_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), by.lo),
                   _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), by.hi)};
}

/* The panel's 16 scales and lows of group g, float16 or float32 formats (scale_low in
 * quant_dot_portable.h). */
static inline __attribute__((always_inline)) void scale_low_cols(const void *scales, const void *lows, int64_t g,
                                                                 const struct qformat f, fcols *scale, fcols *low) {
    const int64_t at = g * PANEL;
    const fcols zero = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if (f.scale_bits == 16) {
        *scale = fcols_half((const uint16_t *)scales + at);
        *low = f.has_low ? fcols_half((const uint16_t *)lows + at) : zero;
    } else {
        *scale = (fcols){_mm256_loadu_ps((const float *)scales + at), _mm256_loadu_ps((const float *)scales + at + 8)};
        *low = f.has_low ? (fcols){_mm256_loadu_ps((const float *)lows + at), _mm256_loadu_ps((const float *)lows + at + 8)}
                         : zero;
    }
}

/* The high bits' field t of each byte (`width` bits at bit width * t) moved to bit 4, the rest
 * dropped: the 16-bit lanes' shifts (at most 4 left, 3 right) leave the kept bits each byte's own. */
#define HIGH_FIELD(T, SLL, SRL, AND, H, t, width)                                                    \
    AND((width) * (t) < 4 ? SLL(H, _mm_cvtsi32_si128(4 - (width) * (t))) : SRL(H, _mm_cvtsi32_si128((width) * (t) - 4)), \
        T((char)((((1 << (width)) - 1) << 4))))

/* One step of 8 inputs (i a multiple of 8) over a panel's 16 columns in quant_dot.c's layout, as
 * 32 bytes at `at` (8 columns): `lo` each column's values at i .. i + 3 side by side in 32 bits,
 * `hi` at i + 4 .. i + 7, the bits past the fourth put back in. */
static inline __attribute__((always_inline)) void step_bytes(const uint8_t *panel, int64_t k, int64_t i, int at,
                                                             const struct qformat f, __m256i *lo, __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(panel + i * (PANEL / 2) + at));
    *lo = _mm256_and_si256(bytes, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    if (f.bits > 4) {
        const int width = f.bits - 4, per_high = 32 / width, t = (int)(i % per_high) / 4;
        const __m256i top = _mm256_loadu_si256(
            (const __m256i *)(panel + k * (PANEL / 2) + (i / per_high) * 4 * PANEL + at));
        *lo = _mm256_or_si256(*lo, HIGH_FIELD(_mm256_set1_epi8, _mm256_sll_epi16, _mm256_srl_epi16, _mm256_and_si256, top, t, width));
        *hi = _mm256_or_si256(*hi, HIGH_FIELD(_mm256_set1_epi8, _mm256_sll_epi16, _mm256_srl_epi16, _mm256_and_si256, top, t + 1, width));
    }
}

static inline __attribute__((always_inline)) void prefetch_step(const uint8_t *panel, int64_t k, int64_t i,
                                                                const struct qformat f) {
    _mm_prefetch((const char *)(panel + i * (PANEL / 2) + PREFETCH), _MM_HINT_T0);
    if (f.bits > 4 && i % (32 / (f.bits - 4)) == 0)
        _mm_prefetch((const char *)(panel + k * (PANEL / 2) + (i / (32 / (f.bits - 4))) * 4 * PANEL + PREFETCH), _MM_HINT_T0);
}

/* u8 x s8 products of 8 inputs: maddubs's pairs of the two halves added in int16 (each column's
 * 4 sums at most 2 * 2 * 127 * (2^bits - 1): 32004 for 6 bits) */
static inline __m256i dot8(__m256i lo, __m256i hi, __m256i xa, __m256i xb) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
}

/* the steps whose int16 sums stay exact added up before they are widened (4 bits: 4 x 7620; 5: 2 x
 * 15748; 6: 1 x 32004), at most the group's steps */
static inline int steps_held(const struct qformat f, int sub) {
    const int hold = f.bits == 4 ? 4 : f.bits == 5 ? 2 : 1;
    return hold < sub / 8 ? hold : sub / 8;
}

/* The R rows' integer sums over inputs s0 .. s0 + sub - 1 against the panel's two halves of 8 columns,
 * the int16 pairs' madd by `by` (ones, or a column's scale in both halves: the sums times it), of the
 * stored unsigned values (6 bits: the caller takes off 32 times the activations'). */
static inline __attribute__((always_inline)) void group_sums(const uint8_t *panel, int64_t k, int64_t s0, int sub,
                                                             const struct qrows *rows, int64_t r0, const int R,
                                                             const struct qformat f, const __m256i by[2],
                                                             __m256i sums[][2]) {
    const int hold = steps_held(f, sub);
    for (int r = 0; r < R; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    for (int64_t i0 = s0; i0 < s0 + sub; i0 += 8 * hold) {
        __m256i held[ROWS][2];
        for (int h = 0; h < hold; h++) {
            const int64_t i = i0 + 8 * h;
            __m256i lo0, hi0, lo1, hi1;
            prefetch_step(panel, k, i, f);
            step_bytes(panel, k, i, 0, f, &lo0, &hi0);
            step_bytes(panel, k, i, 32, f, &lo1, &hi1);
            for (int r = 0; r < R; r++) {
                int32_t a, b;
                __builtin_memcpy(&a, rows->q + (r0 + r) * k + i, sizeof a);
                __builtin_memcpy(&b, rows->q + (r0 + r) * k + i + 4, sizeof b);
                const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
                const __m256i p0 = dot8(lo0, hi0, xa, xb), p1 = dot8(lo1, hi1, xa, xb);
                held[r][0] = h ? _mm256_add_epi16(held[r][0], p0) : p0;
                held[r][1] = h ? _mm256_add_epi16(held[r][1], p1) : p1;
            }
        }
        for (int r = 0; r < R; r++) {
            sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(held[r][0], by[0]));
            sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(held[r][1], by[1]));
        }
    }
}

/* Each 32-bit lane's int8-valued int32 in both its int16 halves: a column's scale for madd. */
static inline __m256i both_halves(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

/* A k-quant's rows r0 .. r0 + R - 1 against one panel, a super-block at a time: each group's integer
 * sums times its int8 scales (in madd) into the block's total, each group's low a float step, then
 * the total's. 6 bits: the total less 32 sum_g(scale_g sum(xq) over g), a madd of two groups' scales
 * (int16 pairs) by their activations' sums (rows->pairs) a block of 32. */
static inline __attribute__((always_inline)) void pass_supers(const uint8_t *panel, const void *scales,
                                                              const void *lows, const uint16_t *supers, int64_t k,
                                                              const struct qrows *rows, int64_t r0, const int R,
                                                              float *out, int64_t n, const struct qformat f) {
    __m256 acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t s0 = 0; s0 < k; s0 += SUPER) {
        const uint16_t *at = supers + (s0 / SUPER) * (f.has_low ? 2 : 1) * PANEL;
        const fcols super = fcols_half(at), super_low = f.has_low ? fcols_half(at + PANEL) : super;
        __m256i total[ROWS][2], offset[ROWS][2], sums[ROWS][2];
        for (int r = 0; r < R; r++) total[r][0] = total[r][1] = offset[r][0] = offset[r][1] = _mm256_setzero_si256();
        for (int64_t s1 = s0; s1 < s0 + SUPER; s1 += f.group) {
            const int64_t g = s1 / f.group;
            const int8_t *scale8 = (const int8_t *)scales + g * PANEL;
            const __m128i s = _mm_loadu_si128((const __m128i *)scale8);
            const __m256i by[2] = {both_halves(_mm256_cvtepi8_epi32(s)), both_halves(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8)))};
            group_sums(panel, k, s1, f.group, rows, r0, R, f, by, sums);
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 2; c++) total[r][c] = _mm256_add_epi32(total[r][c], sums[r][c]);
            if (f.bits == 6 && s1 % XBLOCK == 0) {  /* groups g and g + 1's scales, column by column in int16 pairs */
                const __m256i a = _mm256_cvtepi8_epi16(s), b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scale8 + PANEL)));
                const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
                const __m256i pair[2] = {_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31)};
                for (int r = 0; r < R; r++) {
                    const __m256i q = _mm256_set1_epi32(rows->pairs[(r0 + r) * (k / XBLOCK) + s1 / XBLOCK]);
                    for (int c = 0; c < 2; c++) offset[r][c] = _mm256_add_epi32(offset[r][c], _mm256_madd_epi16(pair[c], q));
                }
            }
            if (f.has_low) {
                const fcols low = fcols_int8_times((const int8_t *)lows + g * PANEL, super_low);
                for (int r = 0; r < R; r++) {
                    const __m256 xd = _mm256_set1_ps(f.group == 16 ? rows->low16[(r0 + r) * (k / 16) + s1 / 16]
                                                                   : rows->low32[(r0 + r) * (k / XBLOCK) + s1 / XBLOCK]);
                    acc[r][0] = _mm256_fmadd_ps(low.lo, xd, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(low.hi, xd, acc[r][1]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 dv = _mm256_set1_ps(rows->d[(r0 + r) * (k / SUPER) + s0 / SUPER]);
            for (int c = 0; c < 2; c++)
                if (f.bits == 6) total[r][c] = _mm256_sub_epi32(total[r][c], _mm256_slli_epi32(offset[r][c], 5));
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][0]), _mm256_mul_ps(super.lo, dv), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][1]), _mm256_mul_ps(super.hi, dv), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + (r0 + r) * n, acc[r][0]);
        _mm256_storeu_ps(out + (r0 + r) * n + 8, acc[r][1]);
    }
}

/* Rows r0 .. r0 + R - 1 against one panel. */
static inline __attribute__((always_inline)) void pass(const uint8_t *panel, const void *scales, const void *lows,
                                                       const uint16_t *supers, int64_t k, const struct qrows *rows,
                                                       int64_t r0, const int R, float *out, int64_t n,
                                                       const struct qformat f) {
    if (SUPERS(f)) {
        pass_supers(panel, scales, lows, supers, k, rows, r0, R, out, n, f);
        return;
    }
    const int sub = f.group < XBLOCK ? f.group : XBLOCK;
    const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
    __m256 acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t s1 = 0; s1 < k; s1 += sub) {  /* a group at a time: its scale, its low */
        fcols scale, low;
        __m256i sums[ROWS][2];
        scale_low_cols(scales, lows, s1 / f.group, f, &scale, &low);
        group_sums(panel, k, s1, sub, rows, r0, R, f, ones, sums);
        for (int r = 0; r < R; r++) {
            const __m256 dv = _mm256_set1_ps(rows->d[(r0 + r) * (k / XBLOCK) + s1 / XBLOCK]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][0]), _mm256_mul_ps(scale.lo, dv), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][1]), _mm256_mul_ps(scale.hi, dv), acc[r][1]);
            if (f.has_low) {
                const __m256 xd = _mm256_set1_ps(sub == 16 ? rows->low16[(r0 + r) * (k / 16) + s1 / 16]
                                                           : rows->low32[(r0 + r) * (k / XBLOCK) + s1 / XBLOCK]);
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

/* scale_low_cols in one register */
static inline __attribute__((always_inline)) void wide_scale_low(const void *scales, const void *lows, int64_t g,
                                                                 const struct qformat f, __m512 *scale, __m512 *low) {
    const int64_t at = g * PANEL;
    *low = _mm512_setzero_ps();
    if (f.scale_bits == 16) {
        *scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)scales + at)));
        if (f.has_low) *low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)lows + at)));
    } else {
        *scale = _mm512_loadu_ps((const float *)scales + at);
        if (f.has_low) *low = _mm512_loadu_ps((const float *)lows + at);
    }
}

/* step_bytes' step as one register: each of the 16 columns' 4 values in 32 bits, in column order */
static inline __attribute__((always_inline)) void wide_step_bytes(const uint8_t *panel, int64_t k, int64_t i,
                                                                  const struct qformat f, __m512i *lo, __m512i *hi) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i bytes = _mm512_loadu_si512((const void *)(panel + i * (PANEL / 2)));
    *lo = _mm512_and_si512(bytes, nibble);
    *hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    if (f.bits > 4) {
        const int width = f.bits - 4, per_high = 32 / width, t = (int)(i % per_high) / 4;
        const __m512i top = _mm512_loadu_si512((const void *)(panel + k * (PANEL / 2) + (i / per_high) * 4 * PANEL));
        *lo = _mm512_or_si512(*lo, HIGH_FIELD(_mm512_set1_epi8, _mm512_sll_epi16, _mm512_srl_epi16, _mm512_and_si512, top, t, width));
        *hi = _mm512_or_si512(*hi, HIGH_FIELD(_mm512_set1_epi8, _mm512_sll_epi16, _mm512_srl_epi16, _mm512_and_si512, top, t + 1, width));
    }
}

/* The R rows' integer sums over inputs s0 .. s0 + sub - 1 against the panel (6 bits: less 32 times
 * the activations'), two chains of dpbusd a row (its latency, at few rows). */
static inline __attribute__((always_inline)) void wide_group_sums(const uint8_t *panel, int64_t k, int64_t s0,
                                                                  int sub, const struct qrows *rows, int64_t r0,
                                                                  const int R, const struct qformat f, __m512i *sums) {
    __m512i his[WIDE_ROWS];
    for (int r = 0; r < R; r++) sums[r] = his[r] = _mm512_setzero_si512();
    for (int64_t i = s0; i < s0 + sub; i += 8) {
        __m512i lo, hi;
        prefetch_step(panel, k, i, f);
        wide_step_bytes(panel, k, i, f, &lo, &hi);
        const int32_t *fours = rows->fours + (i / 4) * rows->m + r0;
        for (int r = 0; r < R; r++) {
            sums[r] = _mm512_dpbusd_epi32(sums[r], lo, _mm512_set1_epi32(fours[r]));
            his[r] = _mm512_dpbusd_epi32(his[r], hi, _mm512_set1_epi32(fours[rows->m + r]));
        }
    }
    for (int r = 0; r < R; r++) {
        sums[r] = _mm512_add_epi32(sums[r], his[r]);
        if (f.bits == 6)
            sums[r] = _mm512_sub_epi32(sums[r], _mm512_set1_epi32(rows->offsets[(r0 + r) * (k / 16) + s0 / 16]));
    }
}

/* pass_supers in one register: each group's dpbusd sums times its int8 scales into the total */
static inline __attribute__((always_inline)) void wide_pass_supers(const uint8_t *panel, const void *scales,
                                                                   const void *lows, const uint16_t *supers, int64_t k,
                                                                   const struct qrows *rows, int64_t r0, const int R,
                                                                   float *out, int64_t n, const struct qformat f) {
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < k; s0 += SUPER) {
        const uint16_t *at = supers + (s0 / SUPER) * (f.has_low ? 2 : 1) * PANEL;
        const __m512 super16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
        const __m512 super_low16 = f.has_low ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + PANEL))) : super16;
        __m512i total[WIDE_ROWS], sums[WIDE_ROWS];
        for (int r = 0; r < R; r++) total[r] = _mm512_setzero_si512();
        for (int64_t s1 = s0; s1 < s0 + SUPER; s1 += f.group) {
            const int64_t g = s1 / f.group;
            const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)scales + g * PANEL)));
            wide_group_sums(panel, k, s1, f.group, rows, r0, R, f, sums);
            for (int r = 0; r < R; r++) total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(sums[r], scale));
            if (f.has_low) {
                const __m128i l = _mm_loadu_si128((const __m128i *)((const int8_t *)lows + g * PANEL));
                const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l)), super_low16);
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(f.group == 16 ? rows->low16[(r0 + r) * (k / 16) + s1 / 16]
                                                                               : rows->low32[(r0 + r) * (k / XBLOCK) + s1 / XBLOCK]),
                                             acc[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const float d = rows->d[(r0 + r) * (k / SUPER) + s0 / SUPER];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(super16, _mm512_set1_ps(d)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out + (r0 + r) * n, acc[r]);
}

static inline __attribute__((always_inline)) void wide_pass(const uint8_t *panel, const void *scales,
                                                            const void *lows, const uint16_t *supers, int64_t k,
                                                            const struct qrows *rows, int64_t r0, const int R,
                                                            float *out, int64_t n, const struct qformat f) {
    if (SUPERS(f)) {
        wide_pass_supers(panel, scales, lows, supers, k, rows, r0, R, out, n, f);
        return;
    }
    const int sub = f.group < XBLOCK ? f.group : XBLOCK;
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s1 = 0; s1 < k; s1 += sub) {  /* a group at a time: its scale, its low */
        __m512 scale16, low16;
        __m512i sums[WIDE_ROWS];
        wide_scale_low(scales, lows, s1 / f.group, f, &scale16, &low16);
        wide_group_sums(panel, k, s1, sub, rows, r0, R, f, sums);
        for (int r = 0; r < R; r++) {
            const float d = rows->d[(r0 + r) * (k / XBLOCK) + s1 / XBLOCK];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(scale16, _mm512_set1_ps(d)), acc[r]);
            if (f.has_low)
                acc[r] = _mm512_fmadd_ps(low16, _mm512_set1_ps(sub == 16 ? rows->low16[(r0 + r) * (k / 16) + s1 / 16]
                                                                         : rows->low32[(r0 + r) * (k / XBLOCK) + s1 / XBLOCK]),
                                         acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out + (r0 + r) * n, acc[r]);
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
