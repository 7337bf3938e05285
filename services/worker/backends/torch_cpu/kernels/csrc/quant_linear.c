/* Linears over quantized weights on float32 rows: out[m, n] = x[m, k] W^T (+ bias). W is stored in
 * groups of G inputs (16, 32, 64 or 128) with a scale each, and a low for the formats that have one:
 * w = q * scale + low, q an unsigned 4- or 5-bit value, a 6-bit one (-32..31), an 8-bit one
 * (-128..127) or a codebook's int8 value at a 4-bit index. Scales and lows are float16 where the
 * file's are (a GGUF's Q4_0 / Q4_1 / Q8_0 / IQ4_NL blocks), float32 where a checkpoint's are (AWQ,
 * GPTQ, compressed-tensors), or in two levels as a k-quant's file has them: an int8 per group times
 * a float16 per super-block of 256 inputs (d and sc, dmin and m; the product, made as the group's
 * weights are decoded, is exact in float32).
 * The formats (struct format below):
 *   4 bits, G 32, float16, low   Q4_0, Q4_1 (low -8d), int4
 *   8 bits, G 32, float16        Q8_0
 *   4-bit codebook indices, G 32, float16   IQ4_NL (w = codebook[q] * scale)
 *   4 or 8 bits, G 16 or 32, float32 (4 bits with a low; 8 with or without): a k-quant's one-level
 *   form (QuantBlocks.flat(), the tests' reference for the two-level ones), checkpoints' groups of 32
 *   4 bits, G 64 or 128, float32, low     AWQ, GPTQ, compressed-tensors int4 (low -zero * scale)
 *   8 bits, G 128, float32 (with a low or without)   GPTQ and compressed-tensors int8
 *   8-bit float codes (e4m3), G 128 or 32, float32: compressed-tensors' FP8 (a channel's scale repeated)
 *   two levels: 4 bits G 32 low Q4_K, 5 bits G 32 low Q5_K, 6 bits G 16 Q6_K, 4 bits G 16 low Q2_K
 *   and Q3_K (q + 4, low -4 sc), 4-bit codebook indices G 32 IQ4_XS; 8 bits G 16 (Q3_K where -4d is
 *   past float16)
 *
 * The weights are laid out in panels of 16 output columns, the columns of a panel side by side for
 * each input: 4 bits: [n / 16, k / 2, 16] bytes, byte c of pair j holding column c at input 2j (low
 * nibble) and at 2j + 1 (high nibble); 5 bits: the 4-bit layout, then the fifth bits, [n / 16,
 * k / 8, 16] bytes, byte c of row r column c's at inputs 8r .. 8r + 7 (input 8r + t at bit t); 6
 * bits: value + 32 (the values are -32..31) likewise, its two high bits [n / 16, k / 4, 16], input
 * 4r + t at bits 2t, 2t + 1; 8 bits: [n / 16, k, 16] int8; scales and lows:
 * [n / 16, k / G, 16]; two levels: int8 scales and lows [n / 16, k / G, 16], and float16 supers
 * [n / 16, k / 256, S, 16], S 2 with lows (the super-scale, then the super-low), else 1.
 *
 * Every output is one sum over i in order, out = fma(w_i, x_i, out), with w_i = fma(q, scale, low)
 * (no low: q * scale): each row's arithmetic is the same whatever the number of rows, and the same
 * in every variant with an FMA (avx512, avx2; the portable form where the CPU has one, its header
 * says why not elsewhere). A few rows decode each weight in registers as they use it; more rows
 * decode a chunk of inputs into a buffer once and read it for every block of rows. Both give the
 * same numbers. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define PANEL 16  /* output columns per panel */
#define CHUNK 128 /* inputs a buffer holds (a multiple of every group) */
#define SUPER 256 /* inputs per super-block (two-level formats) */

#if defined(__AVX512F__)
#include "quant_linear_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_linear_avx2.h"
#else
#include "quant_linear_portable.h"
#endif

/* A weight format; each function below takes one as a constant, so its loops are compiled for it. */
struct format {
    int bits, group, half_scales, has_low, two_level, e4m3;  /* e4m3: 8-bit float codes, not integers */
    int codebook;  /* 4-bit indices into a table of 16 int8 values (IQ4's), not the values */
};
#define F_Q4_G32_F16 ((struct format){4, 32, 1, 1, 0, 0, 0})
#define F_Q8_G32_F16 ((struct format){8, 32, 1, 0, 0, 0, 0})
#define F_Q4_G32_F32 ((struct format){4, 32, 0, 1, 0, 0, 0})
#define F_Q8_G32_F32_LOW ((struct format){8, 32, 0, 1, 0, 0, 0})
#define F_Q8_G16_F32 ((struct format){8, 16, 0, 0, 0, 0, 0})
#define F_Q4_G16_F32 ((struct format){4, 16, 0, 1, 0, 0, 0})
#define F_Q8_G32_F32 ((struct format){8, 32, 0, 0, 0, 0, 0})
#define F_Q4_G64_F32 ((struct format){4, 64, 0, 1, 0, 0, 0})
#define F_Q4_G128_F32 ((struct format){4, 128, 0, 1, 0, 0, 0})
#define F_Q8_G128_F32 ((struct format){8, 128, 0, 0, 0, 0, 0})
#define F_Q8_G128_F32_LOW ((struct format){8, 128, 0, 1, 0, 0, 0})
#define F_Q4_G32_I8 ((struct format){4, 32, 0, 1, 1, 0, 0})
#define F_Q5_G32_I8 ((struct format){5, 32, 0, 1, 1, 0, 0})
#define F_Q8_G16_I8 ((struct format){8, 16, 0, 0, 1, 0, 0})
#define F_Q6_G16_I8 ((struct format){6, 16, 0, 0, 1, 0, 0})
#define F_Q4_G16_I8 ((struct format){4, 16, 0, 1, 1, 0, 0})
#define F_E4M3_G128_F32 ((struct format){8, 128, 0, 0, 0, 1, 0})
#define F_E4M3_G32_F32 ((struct format){8, 32, 0, 0, 0, 1, 0})
#define F_C4_G32_F16 ((struct format){4, 32, 1, 0, 0, 0, 1})
#define F_C4_G32_I8 ((struct format){4, 32, 0, 0, 1, 0, 1})

/* What a block of panels reads: its first panel's weights, scales and lows, k inputs each. */
struct panels {
    const uint8_t *q;
    const void *scales, *lows, *supers;
    int64_t k;
    const int8_t *codebook;  /* a codebook format's 16 values */
};

/* The inputs one step of the loops below covers, unrolled in pairs: a 5- or 6-bit format's row of
 * high bits (8 or 4 inputs), so that each pair's place in its row is a constant (its shifts take
 * immediates, not a count computed each pair); a pair for the others. A group is a whole number of
 * rows (5 bits: groups of 32, 6 bits: of 16; kernels_for builds no other) and so is a chunk. */
#define STEP(f) ((f).bits == 5 ? 8 : (f).bits == 6 ? 4 : 2)

/* Panel c's 16 weights at inputs i and i + 1 (i even, t = i % STEP), from their group's scale and low. */
static inline __attribute__((always_inline)) void weights_at(const struct panels *w, int c, int64_t i, int t,
                                                             cols scale, cols low, const struct format f,
                                                             cols *at_i, cols *at_next) {
    if (f.bits == 4 && f.codebook) {
        cols_codebook(w->q + (c * w->k + i) * (PANEL / 2), w->codebook, scale, at_i, at_next);
    } else if (f.bits == 4) {
        cols_int4(w->q + (c * w->k + i) * (PANEL / 2), scale, low, at_i, at_next);
    } else if (f.bits == 5 || f.bits == 6) {  /* a panel: k * 8 bytes of nibbles, then k * 2 (or 4) of high bits */
        const int width = f.bits - 4, per_row = 8 / width;  /* high bits a value; inputs a row of 16 bytes */
        const uint8_t *panel = w->q + c * w->k * (PANEL / 2 + 2 * width);
        const uint8_t *high = panel + w->k * (PANEL / 2) + (i / per_row) * PANEL;
        cols_high(panel + i * (PANEL / 2), high, t * width, width, f.has_low ? 0 : 32, scale, low, at_i, at_next);
    } else if (f.e4m3) {
        *at_i = cols_e4m3(w->q + (c * w->k + i) * PANEL, scale);
        *at_next = cols_e4m3(w->q + (c * w->k + i + 1) * PANEL, scale);
    } else if (f.has_low) {
        *at_i = cols_int8_low((const int8_t *)w->q + (c * w->k + i) * PANEL, scale, low);
        *at_next = cols_int8_low((const int8_t *)w->q + (c * w->k + i + 1) * PANEL, scale, low);
    } else {
        *at_i = cols_int8((const int8_t *)w->q + (c * w->k + i) * PANEL, scale);
        *at_next = cols_int8((const int8_t *)w->q + (c * w->k + i + 1) * PANEL, scale);
    }
}

static inline __attribute__((always_inline)) cols scales_at(const void *p, int64_t at, const struct format f) {
    return f.half_scales ? cols_half((const uint16_t *)p + at) : cols_load((const float *)p + at);
}

static inline __attribute__((always_inline)) void group_scales(const struct panels *w, int c, int64_t g,
                                                               cols *scale, cols *low, const struct format f) {
    const int64_t at = (c * (w->k / f.group) + g) * PANEL;
    if (f.two_level) {  /* sub * super: exact in float32 (an 8-bit integer times an 11-bit significand) */
        const int per_super = f.has_low ? 2 : 1;
        const uint16_t *super = (const uint16_t *)w->supers + (c * (w->k / SUPER) + g * f.group / SUPER) * per_super * PANEL;
        *scale = cols_int8((const int8_t *)w->scales + at, cols_half(super));
        *low = f.has_low ? cols_int8((const int8_t *)w->lows + at, cols_half(super + PANEL)) : cols_zero();
        return;
    }
    *scale = scales_at(w->scales, at, f);
    if (f.e4m3)  /* cols_e4m3 gives each value / 256: the scale times 256 (exact, a power of two) */
        *scale = cols_fma(*scale, 256.0f, cols_zero());
    *low = f.has_low ? scales_at(w->lows, at, f) : cols_zero();
}

/* `rows` rows of x (stride k) by `panels` panels, each weight decoded in registers as it is used. */
static inline __attribute__((always_inline)) void direct(const struct panels *w, const float *x, const int rows,
                                                         const int panels, const struct format f, float *out,
                                                         int64_t n) {
    cols acc[ROWS][FEW_PANELS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) acc[r][c] = cols_zero();
    for (int64_t g = 0; g < w->k / f.group; g++) {
        cols scale[FEW_PANELS], low[FEW_PANELS];
        for (int c = 0; c < panels; c++) group_scales(w, c, g, &scale[c], &low[c], f);
        for (int64_t i0 = g * f.group; i0 < (g + 1) * f.group; i0 += STEP(f))
#pragma GCC unroll 4
        for (int t = 0; t < STEP(f); t += 2) {
            const int64_t i = i0 + t;
            cols wi[FEW_PANELS], wj[FEW_PANELS];
            for (int c = 0; c < panels; c++) weights_at(w, c, i, t, scale[c], low[c], f, &wi[c], &wj[c]);
            for (int r = 0; r < rows; r++) {
                const float xi = x[r * w->k + i];
                for (int c = 0; c < panels; c++) acc[r][c] = cols_fma(wi[c], xi, acc[r][c]);
            }
            for (int r = 0; r < rows; r++) {
                const float xj = x[r * w->k + i + 1];
                for (int c = 0; c < panels; c++) acc[r][c] = cols_fma(wj[c], xj, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) cols_store(out + r * n + c * PANEL, acc[r][c]);
}

/* The weights of inputs [first, first + count) of `panels` panels, decoded into buffer[i][c]. */
static inline __attribute__((always_inline)) void decode_chunk(const struct panels *w, int64_t first, int64_t count,
                                                               const int panels, const struct format f,
                                                               cols *buffer) {
    for (int64_t g = first / f.group; g < (first + count) / f.group; g++)
        for (int c = 0; c < panels; c++) {
            cols scale, low;
            group_scales(w, c, g, &scale, &low, f);
            for (int64_t i0 = g * f.group; i0 < (g + 1) * f.group; i0 += STEP(f))
#pragma GCC unroll 4
                for (int t = 0; t < STEP(f); t += 2)
                    weights_at(w, c, i0 + t, t, scale, low, f, &buffer[(i0 + t - first) * PANELS + c],
                               &buffer[(i0 + t + 1 - first) * PANELS + c]);
        }
}

/* `rows` rows of x at inputs [first, first + count) against the decoded chunk, carrying on the
 * sums the previous chunk stored in out (none before the first). */
static inline __attribute__((always_inline)) void from_buffer(const cols *buffer, const float *x, int64_t k,
                                                              int64_t first, int64_t count, const int rows,
                                                              const int panels, float *out, int64_t n) {
    cols acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) acc[r][c] = first ? cols_load(out + r * n + c * PANEL) : cols_zero();
    for (int64_t i = 0; i < count; i++)
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * k + first + i];
            for (int c = 0; c < panels; c++) acc[r][c] = cols_fma(buffer[i * PANELS + c], xi, acc[r][c]);
        }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) cols_store(out + r * n + c * PANEL, acc[r][c]);
}

/* One block of `P` panels for all m rows (format F): its own loop nest for each count of rows, so
 * the accumulators stay in registers. */
#define DIRECT_CASE(R, P, F) case R: direct(w, x, R, P, F, out, n); break;
#define BUFFER_CASE(R, P, F) case R: from_buffer(buffer, x + r0 * k, k, first, count, R, P, out + r0 * n, n); break;

#define DEFINE_BLOCK(NAME, P, F)                                                                      \
static void NAME(const struct panels *w, const float *x, int64_t m, float *out, int64_t n) {          \
    const int64_t k = w->k;                                                                           \
    if (m <= ROWS) {                                                                                  \
        switch ((int)m) { FOR_EACH_ROW_COUNT(DIRECT_CASE, P, F) }                                     \
        return;                                                                                       \
    }                                                                                                 \
    cols buffer[CHUNK * PANELS];                                                                      \
    for (int64_t first = 0; first < k; first += CHUNK) {                                              \
        const int64_t count = k - first < CHUNK ? k - first : CHUNK;                                  \
        decode_chunk(w, first, count, P, F, buffer);                                                  \
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {                                                    \
            switch ((int)(m - r0 < ROWS ? m - r0 : ROWS)) { FOR_EACH_ROW_COUNT(BUFFER_CASE, P, F) }   \
        }                                                                                             \
    }                                                                                                 \
}

/* At most FEW_ROWS rows: FEW_PANELS panels a block, so each row has that many independent sums in
 * flight (one sum is a chain of FMAs, each waiting for the last). */
#define FEW_CASE(R, P, F) case R: direct(w, x, R, P, F, out, n); break;
#define DEFINE_FEW_ROWS(NAME, F)                                                                      \
static void NAME(const struct panels *w, const float *x, int64_t m, float *out, int64_t n) {          \
    switch ((int)m) { FOR_EACH_FEW_ROW_COUNT(FEW_CASE, FEW_PANELS, F) }                               \
}

typedef void (*block_fn)(const struct panels *, const float *, int64_t, float *, int64_t);

struct kernels {
    block_fn block, one_panel, few_rows; /* whole blocks of many rows, the panels past them, few rows */
};

/* The three functions of a format, named after it. */
#define DEFINE_FORMAT(NAME, F)                                                                        \
    DEFINE_BLOCK(block_##NAME, PANELS, F)                                                             \
    DEFINE_BLOCK(one_panel_##NAME, 1, F)                                                              \
    DEFINE_FEW_ROWS(few_rows_##NAME, F)                                                               \
    static const struct kernels kernels_##NAME = {block_##NAME, one_panel_##NAME, few_rows_##NAME};

DEFINE_FORMAT(q4_g32_f16, F_Q4_G32_F16)
DEFINE_FORMAT(q8_g32_f16, F_Q8_G32_F16)
DEFINE_FORMAT(q4_g32_f32, F_Q4_G32_F32)
DEFINE_FORMAT(q8_g32_f32_low, F_Q8_G32_F32_LOW)
DEFINE_FORMAT(q8_g16_f32, F_Q8_G16_F32)
DEFINE_FORMAT(q4_g16_f32, F_Q4_G16_F32)
DEFINE_FORMAT(q8_g32_f32, F_Q8_G32_F32)
DEFINE_FORMAT(q4_g64_f32, F_Q4_G64_F32)
DEFINE_FORMAT(q4_g128_f32, F_Q4_G128_F32)
DEFINE_FORMAT(q8_g128_f32, F_Q8_G128_F32)
DEFINE_FORMAT(q8_g128_f32_low, F_Q8_G128_F32_LOW)
DEFINE_FORMAT(q4_g32_i8, F_Q4_G32_I8)
DEFINE_FORMAT(q5_g32_i8, F_Q5_G32_I8)
DEFINE_FORMAT(q8_g16_i8, F_Q8_G16_I8)
DEFINE_FORMAT(q6_g16_i8, F_Q6_G16_I8)
DEFINE_FORMAT(q4_g16_i8, F_Q4_G16_I8)
DEFINE_FORMAT(e4m3_g128_f32, F_E4M3_G128_F32)
DEFINE_FORMAT(e4m3_g32_f32, F_E4M3_G32_F32)
DEFINE_FORMAT(c4_g32_f16, F_C4_G32_F16)
DEFINE_FORMAT(c4_g32_i8, F_C4_G32_I8)

/* The format's kernels, or none (bindings.cpp checks a format before it calls). */
static const struct kernels *kernels_for(int64_t bits, int64_t group, int64_t scale_bits, int has_low, int e4m3,
                                         int codebook) {
    if ((bits == 5 || bits == 6) && scale_bits != 8)  /* they come in two levels only (Q5_K, Q6_K) */
        return 0;
    if (codebook)  /* IQ4_NL (float16 scales), IQ4_XS (two levels) */
        return bits != 4 || group != 32 || has_low ? 0 : scale_bits == 16 ? &kernels_c4_g32_f16
                                                       : scale_bits == 8 ? &kernels_c4_g32_i8 : 0;
    if (e4m3)
        return bits != 8 || scale_bits != 32 || has_low ? 0 : group == 128 ? &kernels_e4m3_g128_f32
                                                         : group == 32 ? &kernels_e4m3_g32_f32 : 0;
    if (scale_bits == 8 && group == 32)
        return bits == 4 ? (has_low ? &kernels_q4_g32_i8 : 0)
             : bits == 5 ? (has_low ? &kernels_q5_g32_i8 : 0) : 0;
    if (scale_bits == 8 && group == 16)
        return bits == 4 ? (has_low ? &kernels_q4_g16_i8 : 0)
             : bits == 6 ? (has_low ? 0 : &kernels_q6_g16_i8) : (has_low ? 0 : &kernels_q8_g16_i8);
    if (scale_bits == 16 && group == 32)
        return bits == 4 ? (has_low ? &kernels_q4_g32_f16 : 0) : (has_low ? 0 : &kernels_q8_g32_f16);
    if (scale_bits != 32)
        return 0;
    if (group == 32)
        return bits == 4 ? (has_low ? &kernels_q4_g32_f32 : 0) : (has_low ? &kernels_q8_g32_f32_low : &kernels_q8_g32_f32);
    if (group == 16)
        return bits == 4 ? (has_low ? &kernels_q4_g16_f32 : 0) : (has_low ? 0 : &kernels_q8_g16_f32);
    if (group == 64)
        return bits == 4 && has_low ? &kernels_q4_g64_f32 : 0;
    if (group == 128)
        return bits == 4 ? (has_low ? &kernels_q4_g128_f32 : 0)
                         : (has_low ? &kernels_q8_g128_f32_low : &kernels_q8_g128_f32);
    return 0;
}

int SY_KERNEL(quant_linear_f32)(const float *x, int64_t m, int64_t k, const void *qweight, int64_t bits,
                                int64_t group, const void *scales, const void *lows, const void *supers,
                                int64_t scale_bits, int64_t e4m3, const int8_t *codebook, const float *bias, int64_t n,
                                float *out) {
    const struct kernels *fns = kernels_for(bits, group, scale_bits, lows != 0, e4m3 != 0, codebook != 0);
    if (!fns || k % group || k % 8 || (scale_bits == 8) != (supers != 0) || (supers && k % SUPER))
        return -1;
    const int64_t num_panels = n / PANEL, groups = k / group, panel_bytes = k * (bits == 4 ? PANEL / 2 : bits == 5 ? PANEL / 2 + 2 : bits == 6 ? PANEL / 2 + 4 : PANEL);
    const int64_t scale_bytes = scale_bits / 8;
    const int is_few = m <= FEW_ROWS, per_block = is_few ? FEW_PANELS : PANELS;
    const int64_t num_blocks = num_panels / per_block, num_tasks = num_blocks + num_panels % per_block;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t t = 0; t < num_tasks; t++) {
        const int is_whole = t < num_blocks, panels = is_whole ? per_block : 1;
        const int64_t p = is_whole ? t * per_block : num_blocks * per_block + (t - num_blocks);
        const int64_t scale_at = p * groups * PANEL * scale_bytes;
        const int64_t super_at = p * (k / SUPER) * (lows ? 2 : 1) * PANEL;
        const struct panels w = {(const uint8_t *)qweight + p * panel_bytes, (const uint8_t *)scales + scale_at,
                                 lows ? (const uint8_t *)lows + scale_at : 0,
                                 supers ? (const uint16_t *)supers + super_at : 0, k, codebook};
        float *block_out = out + p * PANEL;
        if (!is_whole)
            fns->one_panel(&w, x, m, block_out, n);
        else if (is_few)
            fns->few_rows(&w, x, m, block_out, n);
        else
            fns->block(&w, x, m, block_out, n);
        if (bias)
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = p * PANEL; j < (p + panels) * PANEL; j++) out[r * n + j] += bias[j];
    }
    return 0;
}
