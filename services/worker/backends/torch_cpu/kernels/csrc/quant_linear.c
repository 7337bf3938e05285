/* Linears over quantized weights on float32 rows: out[m, n] = x[m, k] W^T (+ bias). W is stored in
 * groups of 32 inputs with a float16 scale each (and a float16 minimum for 4 bits), as a GGUF's
 * Q4_0 / Q4_1 / Q8_0 blocks are: w = q * scale + low (4 bits, q in 0..15) or w = q * scale (8 bits,
 * q in -128..127).
 *
 * The weights are laid out in panels of 16 output columns, the columns of a panel side by side for
 * each input: 4 bits: [n / 16, k / 2, 16] bytes, byte c of pair j holding column c at input 2j (low
 * nibble) and at 2j + 1 (high nibble); 8 bits: [n / 16, k, 16] int8; scales and lows:
 * [n / 16, k / 32, 16] float16.
 *
 * Every output is one sum over i in order, out = fma(w_i, x_i, out), with w_i = fma(q, scale, low)
 * (8 bits: q * scale): each row's arithmetic is the same whatever the number of rows, and the same
 * in every variant with an FMA (avx512, avx2; the portable form where the CPU has one, its header
 * says why not elsewhere). A few rows decode each weight in registers as they use it; more rows
 * decode a chunk of inputs into a buffer once and read it for every block of rows. Both give the
 * same numbers. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define GROUP 32  /* inputs per scale */
#define PANEL 16  /* output columns per panel */
#define CHUNK 128 /* inputs a buffer holds */

#if defined(__AVX512F__)
#include "quant_linear_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_linear_avx2.h"
#else
#include "quant_linear_portable.h"
#endif

/* What a block of panels reads: its first panel's weights, scales and lows, k inputs each. */
struct panels {
    const uint8_t *q;
    const uint16_t *scales, *lows;
    int64_t k;
};

/* Panel c's 16 weights at inputs i and i + 1 (i even), from their group's scale and low (bits: a
 * constant once inlined). */
static inline __attribute__((always_inline)) void weights_at(const struct panels *w, int c, int64_t i, cols scale,
                                                             cols low, const int bits, cols *at_i, cols *at_next) {
    if (bits == 4) {
        cols_int4(w->q + (c * w->k + i) * (PANEL / 2), scale, low, at_i, at_next);
    } else {
        *at_i = cols_int8((const int8_t *)w->q + (c * w->k + i) * PANEL, scale);
        *at_next = cols_int8((const int8_t *)w->q + (c * w->k + i + 1) * PANEL, scale);
    }
}

static inline __attribute__((always_inline)) void group_scales(const struct panels *w, int c, int64_t g,
                                                               cols *scale, cols *low, const int bits) {
    const int64_t at = (c * (w->k / GROUP) + g) * PANEL;
    *scale = cols_half(w->scales + at);
    *low = bits == 4 ? cols_half(w->lows + at) : cols_zero();
}

/* `rows` rows of x (stride k) by `panels` panels, each weight decoded in registers as it is used. */
static inline __attribute__((always_inline)) void direct(const struct panels *w, const float *x, const int rows,
                                                         const int panels, const int bits, float *out, int64_t n) {
    cols acc[ROWS][FEW_PANELS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) acc[r][c] = cols_zero();
    for (int64_t g = 0; g < w->k / GROUP; g++) {
        cols scale[FEW_PANELS], low[FEW_PANELS];
        for (int c = 0; c < panels; c++) group_scales(w, c, g, &scale[c], &low[c], bits);
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i += 2) {
            cols wi[FEW_PANELS], wj[FEW_PANELS];
            for (int c = 0; c < panels; c++) weights_at(w, c, i, scale[c], low[c], bits, &wi[c], &wj[c]);
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
                                                               const int panels, const int bits, cols *buffer) {
    for (int64_t g = first / GROUP; g < (first + count) / GROUP; g++)
        for (int c = 0; c < panels; c++) {
            cols scale, low;
            group_scales(w, c, g, &scale, &low, bits);
            for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i += 2)
                weights_at(w, c, i, scale, low, bits, &buffer[(i - first) * PANELS + c],
                           &buffer[(i + 1 - first) * PANELS + c]);
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

/* One block of `P` panels for all m rows (B bits): its own loop nest for each count of rows, so the
 * accumulators stay in registers. */
#define DIRECT_CASE(R, P, B) case R: direct(w, x, R, P, B, out, n); break;
#define BUFFER_CASE(R, P, B) case R: from_buffer(buffer, x + r0 * k, k, first, count, R, P, out + r0 * n, n); break;

#define DEFINE_BLOCK(NAME, P, B)                                                                      \
static void NAME(const struct panels *w, const float *x, int64_t m, float *out, int64_t n) {          \
    const int64_t k = w->k;                                                                           \
    if (m <= ROWS) {                                                                                  \
        switch ((int)m) { FOR_EACH_ROW_COUNT(DIRECT_CASE, P, B) }                                     \
        return;                                                                                       \
    }                                                                                                 \
    cols buffer[CHUNK * PANELS];                                                                      \
    for (int64_t first = 0; first < k; first += CHUNK) {                                              \
        const int64_t count = k - first < CHUNK ? k - first : CHUNK;                                  \
        decode_chunk(w, first, count, P, B, buffer);                                                  \
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {                                                    \
            switch ((int)(m - r0 < ROWS ? m - r0 : ROWS)) { FOR_EACH_ROW_COUNT(BUFFER_CASE, P, B) }   \
        }                                                                                             \
    }                                                                                                 \
}

/* At most FEW_ROWS rows: FEW_PANELS panels a block, so each row has that many independent sums in
 * flight (one sum is a chain of FMAs, each waiting for the last). */
#define FEW_CASE(R, P, B) case R: direct(w, x, R, P, B, out, n); break;
#define DEFINE_FEW_ROWS(NAME, B)                                                                      \
static void NAME(const struct panels *w, const float *x, int64_t m, float *out, int64_t n) {          \
    switch ((int)m) { FOR_EACH_FEW_ROW_COUNT(FEW_CASE, FEW_PANELS, B) }                               \
}

DEFINE_BLOCK(block_int4, PANELS, 4)
DEFINE_BLOCK(block_int8, PANELS, 8)
DEFINE_BLOCK(one_panel_int4, 1, 4) /* the panels past the last whole block */
DEFINE_BLOCK(one_panel_int8, 1, 8)
DEFINE_FEW_ROWS(few_rows_int4, 4)
DEFINE_FEW_ROWS(few_rows_int8, 8)

void SY_KERNEL(quant_linear_f32)(const float *x, int64_t m, int64_t k, const void *qweight, int64_t bits,
                                 const uint16_t *scales, const uint16_t *lows, const float *bias, int64_t n,
                                 float *out) {
    const int64_t num_panels = n / PANEL, groups = k / GROUP, panel_bytes = k * (bits == 4 ? PANEL / 2 : PANEL);
    const int is_few = m <= FEW_ROWS, per_block = is_few ? FEW_PANELS : PANELS;
    const int64_t num_blocks = num_panels / per_block, num_tasks = num_blocks + num_panels % per_block;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t t = 0; t < num_tasks; t++) {
        const int is_whole = t < num_blocks, panels = is_whole ? per_block : 1;
        const int64_t p = is_whole ? t * per_block : num_blocks * per_block + (t - num_blocks);
        const struct panels w = {(const uint8_t *)qweight + p * panel_bytes, scales + p * groups * PANEL,
                                 lows ? lows + p * groups * PANEL : 0, k};
        float *block_out = out + p * PANEL;
        if (!is_whole)
            (bits == 4 ? one_panel_int4 : one_panel_int8)(&w, x, m, block_out, n);
        else if (is_few)
            (bits == 4 ? few_rows_int4 : few_rows_int8)(&w, x, m, block_out, n);
        else
            (bits == 4 ? block_int4 : block_int8)(&w, x, m, block_out, n);
        if (bias)
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = p * PANEL; j < (p + panels) * PANEL; j++) out[r * n + j] += bias[j];
    }
}
