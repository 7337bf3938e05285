/* quant_linear.c's AVX-512 form: a panel's 16 columns are one register; a block is 2 panels by up
 * to 12 rows (24 accumulators of the 32 registers), or 4 panels by up to 4 rows. */
#include <immintrin.h>

typedef __m512 cols;
#define PANELS 2
#define ROWS 12
#define FEW_PANELS 4
#define FEW_ROWS 4
#define FOR_EACH_ROW_COUNT(X, P, B) X(1, P, B) X(2, P, B) X(3, P, B) X(4, P, B) X(5, P, B) X(6, P, B) \
    X(7, P, B) X(8, P, B) X(9, P, B) X(10, P, B) X(11, P, B) X(12, P, B)
#define FOR_EACH_FEW_ROW_COUNT(X, P, B) X(1, P, B) X(2, P, B) X(3, P, B) X(4, P, B)

static inline cols cols_zero(void) { return _mm512_setzero_ps(); }
static inline cols cols_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void cols_store(float *p, cols v) { _mm512_storeu_ps(p, v); }
static inline cols cols_fma(cols w, float x, cols acc) { return _mm512_fmadd_ps(w, _mm512_set1_ps(x), acc); }
static inline cols cols_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* 16 bytes: the 16 columns at an input in the low nibbles, at the next input in the high ones
 * (widened once). A nibble's float is looked up in the 16 values 0..15 by the lane's low 4 bits
 * (vpermps reads only those): the byte's low nibble as it is, its high one after a shift; the
 * values cvtdq2ps gives, one instruction fewer than masking then converting. */
static inline void cols_int4(const uint8_t *p, cols scale, cols low, cols *at_i, cols *at_next) {
    const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *at_i = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes, values), scale, low);
    *at_next = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), values), scale, low);
}

static inline cols cols_int8(const int8_t *p, cols scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), scale);
}

static inline cols cols_int8_low(const int8_t *p, cols scale, cols low) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), scale, low);
}

/* 16 float8 e4m3 codes: as float16 bits ((code & 0x7F) << 7 | sign << 15) each is its value / 256,
 * subnormals included; the scale carries the 256 (quant_linear.c) */
static inline cols cols_e4m3(const uint8_t *p, cols scale) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), scale);
}

/* 16 bytes (unsigned where `bias` is 0, signed where not) as floats, then fma(q, scale, low) or q * scale */
static inline cols widen_bytes(__m128i q, cols scale, cols low, int bias) {
    const __m512 f = _mm512_cvtepi32_ps(bias ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q));
    return bias ? _mm512_mul_ps(f, scale) : _mm512_fmadd_ps(f, scale, low);
}

/* 16 values of 5 or 6 bits from their nibbles and their high bits: `width` bits at bit `shift` of each
 * byte of `high` (column c's in byte c), the next input's at shift + width; minus `bias` (32: Q6_K's
 * signed values, as fma(q, scale, -32 scale): the same real number rounded once, as (q - 32) * scale
 * is), then fma(q, scale, low). Each byte is widened to its lane once; a field is shifted to the
 * lane's top, then down to bits 4.., the bits below it dropped with the nibble's mask. */
static inline void cols_high(const uint8_t *p, const uint8_t *high, int shift, int width, int bias, cols scale,
                             cols low, cols *at_i, cols *at_next) {
    const __m512i nibbles = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), mask = _mm512_set1_epi32(0x0F);
    const __m512i top = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)high));
    const __m128i down = _mm_cvtsi32_si128(28 - width);
    const __m512i field_i = _mm512_srl_epi32(_mm512_sll_epi32(top, _mm_cvtsi32_si128(32 - shift - width)), down);
    const __m512i field_j = _mm512_srl_epi32(_mm512_sll_epi32(top, _mm_cvtsi32_si128(32 - shift - 2 * width)), down);
    /* 0xE4: (nibble & mask) | (field & ~mask) */
    const __m512i qi = _mm512_ternarylogic_epi32(nibbles, field_i, mask, 0xE4);
    const __m512i qj = _mm512_ternarylogic_epi32(_mm512_srli_epi32(nibbles, 4), field_j, mask, 0xE4);
    const cols offset = bias ? _mm512_mul_ps(scale, _mm512_set1_ps((float)-bias)) : low;
    *at_i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), scale, offset);
    *at_next = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qj), scale, offset);
}

#include "quant_linear_codebook_x86.h"
