/* quant_linear.c's AVX2 form: a panel's 16 columns are two registers; a block is 1 panel by up to 6
 * rows (12 accumulators of the 16 registers), or 2 panels by up to 2 rows. */
#include <immintrin.h>

typedef struct { __m256 lo, hi; } cols;
#define PANELS 1
#define ROWS 6
#define FEW_PANELS 2
#define FEW_ROWS 2
#define FOR_EACH_ROW_COUNT(X, P, B) X(1, P, B) X(2, P, B) X(3, P, B) X(4, P, B) X(5, P, B) X(6, P, B)
#define FOR_EACH_FEW_ROW_COUNT(X, P, B) X(1, P, B) X(2, P, B)

static inline cols cols_zero(void) { return (cols){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline cols cols_load(const float *p) { return (cols){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void cols_store(float *p, cols v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }

static inline cols cols_fma(cols w, float x, cols acc) {
    const __m256 xv = _mm256_set1_ps(x);
    return (cols){_mm256_fmadd_ps(w.lo, xv, acc.lo), _mm256_fmadd_ps(w.hi, xv, acc.hi)};
}

static inline cols cols_half(const uint16_t *p) {
    return (cols){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}

static inline cols widen_int4(__m128i q, cols scale, cols low) {  /* 16 values 0..15 in bytes */
    return (cols){_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), scale.lo, low.lo),
                  _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), scale.hi, low.hi)};
}

/* 16 bytes: the 16 columns at an input in the low nibbles, at the next input in the high ones */
static inline void cols_int4(const uint8_t *p, cols scale, cols low, cols *at_i, cols *at_next) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    *at_i = widen_int4(_mm_and_si128(bytes, mask), scale, low);
    *at_next = widen_int4(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), scale, low);
}

static inline cols cols_int8(const int8_t *p, cols scale) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return (cols){_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale.lo),
                  _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), scale.hi)};
}

static inline cols cols_int8_low(const int8_t *p, cols scale, cols low) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return (cols){_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale.lo, low.lo),
                  _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), scale.hi, low.hi)};
}

/* 16 float8 e4m3 codes: as float16 bits ((code & 0x7F) << 7 | sign << 15) each is its value / 256,
 * subnormals included; the scale carries the 256 (quant_linear.c) */
static inline cols cols_e4m3(const uint8_t *p, cols scale) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return (cols){_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale.lo),
                  _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale.hi)};
}

/* 16 bytes (unsigned where `bias` is 0, signed where not) as floats, then fma(q, scale, low) or q * scale */
static inline cols widen_bytes(__m128i q, cols scale, cols low, int bias) {
    const __m128i upper = _mm_srli_si128(q, 8);
    const __m256 lo = _mm256_cvtepi32_ps(bias ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
    const __m256 hi = _mm256_cvtepi32_ps(bias ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper));
    return bias ? (cols){_mm256_mul_ps(lo, scale.lo), _mm256_mul_ps(hi, scale.hi)}
                : (cols){_mm256_fmadd_ps(lo, scale.lo, low.lo), _mm256_fmadd_ps(hi, scale.hi, low.hi)};
}

#include "quant_linear_high_x86.h"
