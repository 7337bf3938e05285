/* quant_linear.c's portable form: plain loops over a panel's 16 columns. Where the CPU has an FMA
 * (aarch64, say), its sums are the vector forms' to the bit; where it has none (x86-64 before AVX2),
 * each product is rounded before its sum: fmaf would be a call to libm there, 30x slower. */
#include <math.h>
#include <string.h>

#ifdef FP_FAST_FMAF
#define MADD(a, b, c) fmaf(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

typedef struct { float v[16]; } cols;
#define PANELS 1
#define ROWS 4
#define FEW_PANELS 1
#define FEW_ROWS 1
#define FOR_EACH_ROW_COUNT(X, P, B) X(1, P, B) X(2, P, B) X(3, P, B) X(4, P, B)
#define FOR_EACH_FEW_ROW_COUNT(X, P, B) X(1, P, B)

static inline cols cols_zero(void) { return (cols){{0}}; }
static inline cols cols_load(const float *p) { cols c; memcpy(c.v, p, sizeof c.v); return c; }
static inline void cols_store(float *p, cols c) { memcpy(p, c.v, sizeof c.v); }

static inline cols cols_fma(cols w, float x, cols acc) {
    for (int j = 0; j < 16; j++) acc.v[j] = MADD(w.v[j], x, acc.v[j]);
    return acc;
}

static inline float half_to_float(uint16_t h) {  /* IEEE binary16, subnormals and infinities included */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    float f;
    if (exponent == 0) {
        f = ldexpf((float)mantissa, -24);
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7F800000u | (mantissa << 13)
                                                 : ((exponent + 112) << 23) | (mantissa << 13));
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline cols cols_half(const uint16_t *p) {
    cols c;
    for (int j = 0; j < 16; j++) c.v[j] = half_to_float(p[j]);
    return c;
}

/* 16 bytes: the 16 columns at an input in the low nibbles, at the next input in the high ones */
static inline void cols_int4(const uint8_t *p, cols scale, cols low, cols *at_i, cols *at_next) {
    for (int j = 0; j < 16; j++) {
        at_i->v[j] = MADD((float)(p[j] & 0x0F), scale.v[j], low.v[j]);
        at_next->v[j] = MADD((float)(p[j] >> 4), scale.v[j], low.v[j]);
    }
}

static inline cols cols_int8(const int8_t *p, cols scale) {
    cols c;
    for (int j = 0; j < 16; j++) c.v[j] = (float)p[j] * scale.v[j];
    return c;
}

static inline cols cols_int8_low(const int8_t *p, cols scale, cols low) {
    cols c;
    for (int j = 0; j < 16; j++) c.v[j] = MADD((float)p[j], scale.v[j], low.v[j]);
    return c;
}

/* 16 float8 e4m3 codes: as float16 bits ((code & 0x7F) << 7 | sign << 15) each is its value / 256,
 * subnormals included; the scale carries the 256 (quant_linear.c) */
static inline cols cols_e4m3(const uint8_t *p, cols scale) {
    cols c;
    for (int j = 0; j < 16; j++)
        c.v[j] = half_to_float((uint16_t)(((p[j] & 0x7F) << 7) | ((p[j] & 0x80) << 8))) * scale.v[j];
    return c;
}

/* 16 values of 5 or 6 bits from their nibbles and their high bits: `width` bits at bit `shift` of each
 * byte of `high` (column c's in byte c), the next input's at shift + width; minus `bias` (32: Q6_K's
 * signed values), then q * scale + low (no low: q * scale, as the 8-bit form) */
static inline void cols_high(const uint8_t *p, const uint8_t *high, int shift, int width, int bias, cols scale,
                             cols low, cols *at_i, cols *at_next) {
    const int mask = (1 << width) - 1;
    for (int j = 0; j < 16; j++) {
        const float qi = (float)(((p[j] & 0x0F) | ((high[j] >> shift) & mask) << 4) - bias);
        const float qj = (float)(((p[j] >> 4) | ((high[j] >> (shift + width)) & mask) << 4) - bias);
        at_i->v[j] = bias ? qi * scale.v[j] : MADD(qi, scale.v[j], low.v[j]);
        at_next->v[j] = bias ? qj * scale.v[j] : MADD(qj, scale.v[j], low.v[j]);
    }
}

/* 16 bytes of codebook indices (an input in the low nibbles, the next in the high ones): codebook[q] * scale */
static inline void cols_codebook(const uint8_t *p, const int8_t *codebook, cols scale, cols *at_i, cols *at_next) {
    for (int j = 0; j < 16; j++) {
        at_i->v[j] = (float)codebook[p[j] & 0x0F] * scale.v[j];
        at_next->v[j] = (float)codebook[p[j] >> 4] * scale.v[j];
    }
}
