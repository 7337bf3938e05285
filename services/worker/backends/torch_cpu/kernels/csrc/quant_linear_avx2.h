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

/* 16 bytes: the 16 columns at an input in the low nibbles, at the next input in the high ones
 * (widened once, 8 bytes a register: a byte's low nibble is its lane & 15, its high one the lane >> 4) */
static inline void cols_int4(const uint8_t *p, cols scale, cols low, cols *at_i, cols *at_next) {
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))), mask = _mm256_set1_epi32(0x0F);
    *at_i = (cols){_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(first, mask)), scale.lo, low.lo),
                   _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(second, mask)), scale.hi, low.hi)};
    *at_next = (cols){_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), scale.lo, low.lo),
                      _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), scale.hi, low.hi)};
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

/* 16 values of 5 or 6 bits from their nibbles and their high bits, put together in an SSE register
 * (a lane's 16 columns are two registers here: widening first would double the work): `width` bits
 * at bit `shift` of each byte of `high` (column c's in byte c), the next input's at shift + width;
 * minus `bias` (32: Q6_K's signed values), then fma(q, scale, low) (no low: q * scale) */
static inline void cols_high(const uint8_t *p, const uint8_t *high, int shift, int width, int bias, cols scale,
                             cols low, cols *at_i, cols *at_next) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), nibble = _mm_set1_epi8(0x0F);
    const __m128i top = _mm_loadu_si128((const __m128i *)high), keep = _mm_set1_epi8(width == 1 ? 0x10 : 0x30);
    /* bits shift.. of each byte to bits 4..: the 16-bit lanes' shifts leave those bits of each byte its own */
    const __m128i hi_i = _mm_and_si128(_mm_sll_epi16(_mm_srl_epi16(top, _mm_cvtsi32_si128(shift)), _mm_cvtsi32_si128(4)),
                                       keep);
    const __m128i hi_j = _mm_and_si128(_mm_sll_epi16(_mm_srl_epi16(top, _mm_cvtsi32_si128(shift + width)),
                                                     _mm_cvtsi32_si128(4)), keep);
    const __m128i qi = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(bytes, nibble), hi_i), _mm_set1_epi8((char)bias));
    const __m128i qj = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), hi_j),
                                    _mm_set1_epi8((char)bias));
    *at_i = widen_bytes(qi, scale, low, bias);
    *at_next = widen_bytes(qj, scale, low, bias);
}

#include "quant_linear_codebook_x86.h"
