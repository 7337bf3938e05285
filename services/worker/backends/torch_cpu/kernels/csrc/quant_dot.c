/* quant_linear over int8 activations (--quant-activations int8): each row quantized to int8 with a
 * float32 scale per block of inputs, as llama.cpp does, each group's dot an exact integer sum of
 * unsigned weights times signed activations, for quant_linear.c's 4-, 5- and 6-bit formats.
 *
 * Row r's block b (256 inputs, Q8_K's, for the k-quants' two-level scales; else 32, Q8_0's):
 * d = max|x| / 127, xq = rint(x * (127 / max|x|)) (in -127..127). u is a weight's stored unsigned
 * value (a 6-bit one is value + 32: its sum less 32 sum_i(xq_i)). A column then adds, in order:
 *   k-quants (int8 scales s_g and lows l_g times the super-block's float16 S and L), per super-block:
 *     acc = fma(l_g * L, (float)sum_i(xq_i) * d, acc)             (each group g, formats with a low)
 *     acc = fma((float)sum_g(s_g * sum_i(u_i * xq_i)), S * d, acc)  (the block's one integer total)
 *   the others (float scales), per group g of G inputs (a sub-block: G if G <= 32, else 32):
 *     acc = fma((float)sum_i(u_i * xq_i), scale_g * d, acc)
 *     acc = fma(low_g, (float)sum_i(xq_i) * d, acc)                (formats with a low)
 * The integer sums are exact (a super-block's total below 2^27) and the float steps the same in
 * every variant, so every variant gives the same bits, at every batch size.
 *
 * The weights are in panels of 16 columns as quant_linear.c's, their bytes in another order
 * (QuantLinear.use_int8_rows() puts them so), four inputs of a column side by side, as the u8 x s8
 * dot products take them: the nibbles [k / 8, 64] bytes, byte 4c + j of step s holding column c at
 * input 8s + j (low nibble) and 8s + 4 + j (high nibble); 5 and 6 bits then the bits past the fourth
 * (width w), [k / (32 / w), 64] bytes, byte 4c + j of row R holding column c's at inputs
 * (32 / w) R + 4t + j in bits w t .. w t + w - 1. On x86 a step's bytes are then two registers
 * (a nibble mask, a shift, the high bits or-ed in), summed by maddubs and madd (VNNI: dpbusd) with
 * no shuffles. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define PANEL 16
#define SUPER 256
#define XBLOCK 32 /* inputs an activation scale covers (float scales; SUPER for the k-quants) */
#define ROWS 4    /* rows a pass over the weights serves */

/* A weight format (quant_linear.c's, integer values only). */
struct qformat {
    int bits, group, scale_bits, has_low;  /* scale_bits 8: int8 times a float16 super per 256 */
};

/* The rows quantized: q [m, k] (as fours: [k / 4, m] groups of 4 inputs, every row's side by side),
 * d [m, k / block] (block: XBLOCK or SUPER); what a 6-bit group's sum less (32 sum(q) per 16 inputs,
 * [m, k / 16]) and what a group's low multiplies ((float)sum(q) * d per 16 inputs [m, k / 16] and
 * per 32 [m, k / 32]); pairs [m, k / 32], a block of 32's two sums of 16 as int16s (low, high). */
struct qrows {
    int8_t *q;
    int32_t *fours;
    float *d;
    int32_t *offsets;
    float *low16, *low32;
    int32_t *pairs;
    int64_t m, block;
};

/* The k-quants' formats: int8 scales (and lows) times a float16 per super-block, their rows' scale
 * one per super-block, each super-block's integer total one float step. */
#define SUPERS(f) ((f).scale_bits == 8)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_dot_x86.h"
#else
#include "quant_dot_portable.h"
#endif

static void quantize_rows(const float *x, int64_t m, int64_t k, struct qrows *rows) {
    const int64_t block = rows->block, blocks = k / block;
    /* a few rows on this thread: the threads' start would cost more than the work */
    _Pragma("omp parallel for schedule(static) if(m * k >= 16384)")
    for (int64_t t = 0; t < m * blocks; t++) {
        const int64_t r = t / blocks, b = t % blocks;
        const float top = block_top(x + r * k + b * block, block), d = top / 127.0f;
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        rows->d[r * blocks + b] = d;
        for (int64_t i0 = b * block; i0 < (b + 1) * block; i0 += XBLOCK) {
            int8_t *q = rows->q + r * k + i0;
            int32_t sums[2];
            quantize_32(x + r * k + i0, inv, q, sums);
            for (int half = 0; half < 2; half++) {
                rows->offsets[r * (k / 16) + i0 / 16 + half] = 32 * sums[half];
                rows->low16[r * (k / 16) + i0 / 16 + half] = (float)sums[half] * d;
            }
            rows->low32[r * (k / XBLOCK) + i0 / XBLOCK] = (float)(sums[0] + sums[1]) * d;
            rows->pairs[r * (k / XBLOCK) + i0 / XBLOCK] = (int32_t)((uint32_t)(uint16_t)sums[0] | (uint32_t)sums[1] << 16);
            for (int i = 0; i < XBLOCK; i += 4) __builtin_memcpy(rows->fours + (i0 + i) / 4 * m + r, q + i, 4);
        }
    }
}

static void free_rows(struct qrows *rows) {
    free(rows->q), free(rows->fours), free(rows->d), free(rows->offsets), free(rows->low16), free(rows->low32);
    free(rows->pairs);
}

#define Q_FORMATS(X)                                        \
    X(q4_g32_f16, ((struct qformat){4, 32, 16, 1}))         \
    X(q4_g16_f32, ((struct qformat){4, 16, 32, 1}))         \
    X(q4_g32_f32, ((struct qformat){4, 32, 32, 1}))         \
    X(q4_g64_f32, ((struct qformat){4, 64, 32, 1}))         \
    X(q4_g128_f32, ((struct qformat){4, 128, 32, 1}))       \
    X(q4_g32_i8, ((struct qformat){4, 32, 8, 1}))           \
    X(q4_g16_i8, ((struct qformat){4, 16, 8, 1}))           \
    X(q5_g32_i8, ((struct qformat){5, 32, 8, 1}))           \
    X(q6_g16_i8, ((struct qformat){6, 16, 8, 0}))

typedef void (*panel_fn)(const uint8_t *, const void *, const void *, const uint16_t *, int64_t,
                         const struct qrows *, int64_t, float *, int64_t);

#define DEFINE_Q_FORMAT(NAME, F)                                                                             \
    static void dot_##NAME(const uint8_t *panel, const void *scales, const void *lows, const uint16_t *supers, \
                           int64_t k, const struct qrows *rows, int64_t m, float *out, int64_t n) {            \
        panel_rows(panel, scales, lows, supers, k, rows, m, out, n, F);                                       \
    }
Q_FORMATS(DEFINE_Q_FORMAT)

static panel_fn panel_fn_for(int64_t bits, int64_t group, int64_t scale_bits, int has_low) {
#define PICK(NAME, F)                                                                                    \
    if ((F).bits == bits && (F).group == group && (F).scale_bits == scale_bits && (F).has_low == has_low) \
        return dot_##NAME;
    Q_FORMATS(PICK)
#undef PICK
    return 0;
}

int SY_KERNEL(quant_linear_q8)(const float *x, int64_t m, int64_t k, const void *qweight, int64_t bits,
                               int64_t group, const void *scales, const void *lows, const void *supers,
                               int64_t scale_bits, const float *bias, int64_t n, float *out) {
    const panel_fn fn = panel_fn_for(bits, group, scale_bits, lows != 0);
    if (!fn || k % XBLOCK || k % group || (scale_bits == 8) != (supers != 0) || (supers && k % SUPER))
        return -1;
    const int64_t block = scale_bits == 8 ? SUPER : XBLOCK;
    struct qrows rows = {malloc(m * k), malloc(m * k), malloc(m * (k / block) * sizeof(float)),
                         malloc(m * (k / 16) * sizeof(int32_t)), malloc(m * (k / 16) * sizeof(float)),
                         malloc(m * (k / XBLOCK) * sizeof(float)), malloc(m * (k / XBLOCK) * sizeof(int32_t)),
                         m, block};
    if (!rows.q || !rows.fours || !rows.d || !rows.offsets || !rows.low16 || !rows.low32 || !rows.pairs) {
        free_rows(&rows);
        return -2;
    }
    quantize_rows(x, m, k, &rows);
    const int64_t num_panels = n / PANEL, groups = k / group;
    const int64_t panel_bytes = k * (PANEL / 2) + (bits - 4) * (k / 8) * PANEL;
    const int64_t scale_bytes = scale_bits / 8, per_super = lows ? 2 : 1;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t scale_at = p * groups * PANEL * scale_bytes;
        fn((const uint8_t *)qweight + p * panel_bytes, (const uint8_t *)scales + scale_at,
           lows ? (const uint8_t *)lows + scale_at : 0,
           supers ? (const uint16_t *)supers + p * (k / SUPER) * per_super * PANEL : 0, k, &rows, m, out + p * PANEL, n);
        if (bias)
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = p * PANEL; j < (p + 1) * PANEL; j++) out[r * n + j] += bias[j];
    }
    free_rows(&rows);
    return 0;
}
