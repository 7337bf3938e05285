/* quant_linear.c's codebook indices on x86, shared by the AVX-512 and AVX2 forms: the bytes are
 * looked up in an SSE register, then widened by the including form's widen_bytes. */

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
