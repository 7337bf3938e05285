/* The row-wise ops: the residual add with RMSNorm, rotary embedding and SwiGLU's silu(gate) * up,
 * each one pass over a row instead of torch's several. Arithmetic is float32, rounded to the
 * tensors' type where torch's ops round, so results match the reference ops to that type's
 * precision; every row is computed on its own. */
#include <stdint.h>

#include "cpu_math.h"
#include "kernels.h"

/* a loop over `rows` on torch's OpenMP threads, when there are enough rows to share */
#define PARALLEL_ROWS _Pragma("omp parallel for schedule(static) if(rows >= 8)")

#define DEFINE_OPS(SUFFIX, T, LOAD, STORE)                                                             \
/* summed = x + residual; out = weight * (summed / rms(summed)), rows of `dim` */                      \
void SY_KERNEL(add_rms_norm_##SUFFIX)(const T *x, const T *residual, const T *weight, T *out, T *summed,          \
                          int64_t rows, int64_t dim, float eps) {                                      \
    PARALLEL_ROWS                                                                                      \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const T *xr = x + r * dim, *rr = residual + r * dim;                                           \
        T *sr = summed + r * dim, *orow = out + r * dim;                                               \
        float squares = 0.f;                                                                           \
        for (int64_t i = 0; i < dim; i++) {                                                            \
            sr[i] = STORE(LOAD(xr + i) + LOAD(rr + i));                                                \
            const float s = LOAD(sr + i);                                                              \
            squares += s * s;                                                                          \
        }                                                                                              \
        const float inv = 1.f / sqrtf(squares / (float)dim + eps);                                     \
        for (int64_t i = 0; i < dim; i++) {                                                            \
            const T normed = STORE(LOAD(sr + i) * inv);                                                \
            orow[i] = STORE(LOAD(weight + i) * LOAD(&normed));                                         \
        }                                                                                              \
    }                                                                                                  \
}                                                                                                      \
                                                                                                       \
/* x: [rows, heads, head_dim] with row stride x_stride -> out, contiguous; cos, sin: [rows, head_dim] \
 * float32, the half-split layout (Hugging Face's) */                                                  \
void SY_KERNEL(rotary_##SUFFIX)(const T *x, int64_t x_stride, const float *cos, const float *sin, T *out,         \
                     int64_t rows, int64_t heads, int64_t head_dim) {                                  \
    const int64_t half = head_dim / 2;                                                                 \
    PARALLEL_ROWS                                                                                      \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;                                  \
        for (int64_t h = 0; h < heads; h++) {                                                          \
            const T *xh = x + r * x_stride + h * head_dim;                                             \
            T *oh = out + (r * heads + h) * head_dim;                                                  \
            for (int64_t i = 0; i < half; i++) {                                                       \
                const float a = LOAD(xh + i), b = LOAD(xh + half + i);                                 \
                oh[i] = STORE(a * c[i] - b * s[i]);                                                    \
                oh[half + i] = STORE(b * c[half + i] + a * s[half + i]);                               \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
}                                                                                                      \
                                                                                                       \
/* gate_up: [rows, 2 * width] (gate, then up) -> out: [rows, width] = silu(gate) * up */               \
void SY_KERNEL(silu_and_mul_##SUFFIX)(const T *gate_up, T *out, int64_t rows, int64_t width) {                   \
    PARALLEL_ROWS                                                                                      \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const T *g = gate_up + r * 2 * width, *u = g + width;                                          \
        T *o = out + r * width;                                                                        \
        for (int64_t i = 0; i < width; i++) {                                                          \
            const float gate = LOAD(g + i);                                                            \
            const T silu = STORE(gate / (1.f + exp_clamped(-gate)));                                   \
            o[i] = STORE(LOAD(&silu) * LOAD(u + i));                                                   \
        }                                                                                              \
    }                                                                                                  \
}

DEFINE_OPS(f32, float, F32_LOAD, F32_STORE)
DEFINE_OPS(bf16, uint16_t, bf16_load, bf16_store)
