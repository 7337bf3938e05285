/* Scalar helpers the C kernels share, written so that loops over them vectorize: bfloat16 to and
 * from float32 (round to nearest even, as torch), and an exponential (Cephes' expf, ~1 ulp) and a soft cap from it. */
#ifndef SWITCHYARD_CPU_MATH_H
#define SWITCHYARD_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return 0x7fc0;
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

#define F32_LOAD(p) (*(p))
#define F32_STORE(x) (x)

/* exp(x), x clamped to [-87, 88]: below -87 it returns ~1e-38, not 0 (libm's expf does not
 * vectorize here). */
static inline float exp_clamped(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = rintf(x * 1.44269504f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* x - n ln2, ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* cap * tanh(x / cap) (Gemma 2's soft cap on attention scores), tanh from exp_clamped:
 * (1 - e) / (1 + e) with e = exp(-2|x|), its sign restored. */
static inline float soft_capped(float x, float cap) {
    const float a = fabsf(x / cap), e = exp_clamped(-2.f * a), t = (1.f - e) / (1.f + e);
    return cap * (x < 0.f ? -t : t);
}

#endif
