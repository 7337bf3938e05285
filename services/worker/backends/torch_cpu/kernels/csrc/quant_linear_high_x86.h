/* quant_linear.c's 5- and 6-bit values and its codebook indices on x86, shared by the AVX-512 and
 * AVX2 forms: the bytes are put together in SSE registers, then widened by the including form's
 * widen_bytes. */

/* 16 values of 5 or 6 bits from their nibbles and their high bits: `width` bits at bit `shift` of each
 * byte of `high` (column c's in byte c), the next input's at shift + width; minus `bias` (32: Q6_K's
 * signed values), then fma(q, scale, low) (no low: q * scale, as the 8-bit form) */
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

/* 16 bytes of codebook indices (the columns at an input in the low nibbles, at the next in the high
 * ones): each the codebook's int8 value by a byte shuffle, then q * scale (as the 8-bit form) */
static inline void cols_codebook(const uint8_t *p, const int8_t *codebook, cols scale, cols *at_i, cols *at_next) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), nibble = _mm_set1_epi8(0x0F);
    const __m128i table = _mm_loadu_si128((const __m128i *)codebook);
    const __m128i qi = _mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble));
    const __m128i qj = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    *at_i = widen_bytes(qi, scale, cols_zero(), 1);  /* signed values, no low */
    *at_next = widen_bytes(qj, scale, cols_zero(), 1);
}
