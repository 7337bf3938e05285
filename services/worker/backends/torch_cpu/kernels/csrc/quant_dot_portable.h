/* quant_dot.c without x86's vectors: one column and row at a time, the same integer sums and the same
 * float steps (fmaf: the CPUs this form is for may lack an FMA instruction; libm's is exact). */

/* max|x| over a block of n inputs */
static inline float block_top(const float *in, int64_t n) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) top = fmaxf(top, fabsf(in[i]));
    return top;
}

/* 32 inputs to int8s (rint(x * inv), inv = 127 / the block's max|x|); the halves' sums in sums. */
static inline void quantize_32(const float *in, float inv, int8_t *q, int32_t sums[2]) {
    for (int half = 0; half < 2; half++) {
        sums[half] = 0;
        for (int i = half * 16; i < half * 16 + 16; i++) {
            q[i] = (int8_t)lrintf(in[i] * inv);
            sums[half] += q[i];
        }
    }
}

/* The stored unsigned value of a panel's column c at input i, in quant_dot.c's layout. */
static inline uint8_t value_at(const uint8_t *panel, int64_t k, int64_t i, int c, int bits) {
    const uint8_t byte = panel[(i / 8) * 4 * PANEL + 4 * c + i % 4];
    uint8_t u = i % 8 < 4 ? byte & 0x0F : byte >> 4;
    if (bits > 4) {
        const int width = bits - 4, per_high = 32 / width;
        const uint8_t top = panel[k * (PANEL / 2) + (i / per_high) * 4 * PANEL + 4 * c + i % 4];
        u |= ((top >> ((i % per_high) / 4 * width)) & ((1 << width) - 1)) << 4;
    }
    return u;
}

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  /* a subnormal: exact as a float32 product */
        const float v = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    float out;
    __builtin_memcpy(&out, &bits, sizeof out);
    return out;
}

/* A panel's column c: its group g's float scale and low (float16 or float32 formats). */
static inline __attribute__((always_inline)) void scale_low(const void *scales, const void *lows, int64_t g, int c,
                                                            const struct qformat f, float *scale, float *low) {
    const int64_t at = g * PANEL + c;
    if (f.scale_bits == 16) {
        *scale = half_to_float(((const uint16_t *)scales)[at]);
        *low = f.has_low ? half_to_float(((const uint16_t *)lows)[at]) : 0.0f;
    } else {
        *scale = ((const float *)scales)[at];
        *low = f.has_low ? ((const float *)lows)[at] : 0.0f;
    }
}

/* Row r's integer sum over inputs s0 .. s0 + sub - 1 against the panel's column c (6 bits: less 32
 * times the activations'). */
static inline int32_t group_sum(const uint8_t *panel, int64_t k, int64_t s0, int sub, const struct qrows *rows,
                                int64_t r, int c, const struct qformat f) {
    int32_t sum = 0;
    for (int64_t i = s0; i < s0 + sub; i++) sum += value_at(panel, k, i, c, f.bits) * rows->q[r * k + i];
    return f.bits == 6 ? sum - rows->offsets[r * (k / 16) + s0 / 16] : sum;
}

static inline __attribute__((always_inline)) void panel_rows(const uint8_t *panel, const void *scales,
                                                             const void *lows, const uint16_t *supers, int64_t k,
                                                             const struct qrows *rows, int64_t m, float *out,
                                                             int64_t n, const struct qformat f) {
    const int sub = f.group < XBLOCK ? f.group : XBLOCK;
    for (int64_t r = 0; r < m; r++)
        for (int c = 0; c < PANEL; c++) {
            float acc = 0.0f;
            if (SUPERS(f)) {  /* per super-block: the lows' float steps, then its integer total's */
                const int per_super = f.has_low ? 2 : 1;
                for (int64_t s0 = 0; s0 < k; s0 += SUPER) {
                    const uint16_t *super = supers + (s0 / SUPER) * per_super * PANEL + c;
                    int32_t total = 0;
                    for (int64_t s1 = s0; s1 < s0 + SUPER; s1 += f.group) {
                        const int64_t at = (s1 / f.group) * PANEL + c;
                        total += group_sum(panel, k, s1, f.group, rows, r, c, f) * ((const int8_t *)scales)[at];
                        if (f.has_low)
                            acc = fmaf((float)((const int8_t *)lows)[at] * half_to_float(super[PANEL]),
                                       f.group == 16 ? rows->low16[r * (k / 16) + s1 / 16]
                                                     : rows->low32[r * (k / XBLOCK) + s1 / XBLOCK], acc);
                    }
                    acc = fmaf((float)total, half_to_float(super[0]) * rows->d[r * (k / SUPER) + s0 / SUPER], acc);
                }
                out[r * n + c] = acc;
                continue;
            }
            for (int64_t s1 = 0; s1 < k; s1 += sub) {  /* a group at a time: its scale, its low */
                float scale, low;
                scale_low(scales, lows, s1 / f.group, c, f, &scale, &low);
                const float d = rows->d[r * (k / XBLOCK) + s1 / XBLOCK];
                acc = fmaf((float)group_sum(panel, k, s1, sub, rows, r, c, f), scale * d, acc);
                if (f.has_low)
                    acc = fmaf(low, sub == 16 ? rows->low16[r * (k / 16) + s1 / 16] : rows->low32[r * (k / XBLOCK) + s1 / XBLOCK],
                               acc);
            }
            out[r * n + c] = acc;
        }
}
