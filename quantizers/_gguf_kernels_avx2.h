/* AVX2 kernels (x86-64): a block is four 8-float registers, reductions are vector max/min plus
 * three shuffles, and the 32-bit levels become bytes with the pack instructions. Compiled for
 * AVX2 function by function (target attribute; no FMA: nothing may fuse), chosen at run time
 * when the CPU has it. Same arithmetic, in the same order, as the portable kernels.
 * Included by _gguf_kernels.c, after the shared scalar helpers. */

#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))

/* Every lane: the maximum over the lanes of m (signed 32-bit). */
AVX2 static inline __m256i all_max_epi32(__m256i m) {
    m = _mm256_max_epi32(m, _mm256_permute2x128_si256(m, m, 1));
    m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0x4e));
    return _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0xb1));
}

AVX2 static inline float all_max_ps(__m256 m) {
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
    return _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1))));
}

AVX2 static inline float all_min_ps(__m256 m) {
    m = _mm256_min_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
    return _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0xb1))));
}

typedef struct {
    __m256 x[4];            /* values 0-7, 8-15, 16-23, 24-31 */
    __m256i abs_bits[4];    /* their |x| as bits */
    __m256i abs_max;        /* bits of the largest |x| in every lane: >= EXPONENT means inf or NaN */
} avx2_block;

AVX2 static inline avx2_block avx2_load(const float *src) {
    avx2_block b;
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    for (int k = 0; k < 4; k++) {
        b.x[k] = _mm256_loadu_ps(src + 8 * k);
        b.abs_bits[k] = _mm256_and_si256(_mm256_castps_si256(b.x[k]), magnitude);
    }
    b.abs_max = all_max_epi32(_mm256_max_epi32(_mm256_max_epi32(b.abs_bits[0], b.abs_bits[1]),
                                               _mm256_max_epi32(b.abs_bits[2], b.abs_bits[3])));
    return b;
}

/* The first value whose magnitude is the block's largest (gguf-py's abs(blocks).argmax()). */
AVX2 static inline float avx2_signed_abs_max(const avx2_block *b, const float *src) {
    uint32_t hits = 0;
    for (int k = 0; k < 4; k++)
        hits |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b->abs_bits[k], b->abs_max))) << (8 * k);
    return src[__builtin_ctz(hits)];            /* hits != 0: the maximum is one of the values */
}

/* levels: trunc(f) clipped to 0..top (f >= -1, so truncation gives at least 0). */
AVX2 static inline __m256i avx2_levels(__m256 f, __m256i top) {
    return _mm256_min_epi32(_mm256_cvttps_epi32(f), top);
}

/* 32 int32 lanes holding int8/uint8 values, in order -> 32 bytes. The packs interleave the two
 * 128-bit halves; one permutation of 32-bit groups puts them back in order. */
AVX2 static inline void avx2_put_bytes(uint8_t *dst, const __m256i q[4]) {
    __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    words = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, words);
}

/* 32 levels -> 16 bytes: low nibble from value j, high nibble from value j + 16. */
AVX2 static inline void avx2_put_nibbles(uint8_t *dst, const __m256i q[4]) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    __m256i n0 = _mm256_or_si256(_mm256_and_si256(q[0], low), _mm256_slli_epi32(_mm256_and_si256(q[2], low), 4));
    __m256i n1 = _mm256_or_si256(_mm256_and_si256(q[1], low), _mm256_slli_epi32(_mm256_and_si256(q[3], low), 4));
    __m128i p0 = _mm_packs_epi32(_mm256_castsi256_si128(n0), _mm256_extracti128_si256(n0, 1));
    __m128i p1 = _mm_packs_epi32(_mm256_castsi256_si128(n1), _mm256_extracti128_si256(n1, 1));
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi16(p0, p1));
}

/* qh: bit j of a little-endian u32 is bit 4 of level j (moved to the sign bit, then movemask). */
AVX2 static inline void avx2_put_high_bits(uint8_t *dst, const __m256i q[4]) {
    uint32_t w = 0;
    for (int k = 0; k < 4; k++)
        w |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32(q[k], 27))) << (8 * k);
    memcpy(dst, &w, 4);                         /* x86 is little-endian */
}

AVX2 static Py_ssize_t q8_0_avx2(const float *src, uint8_t *dst, Py_ssize_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), round = _mm256_set1_ps(ROUND);
    for (Py_ssize_t blk = 0; blk < n; blk++, src += BLOCK, dst += 34) {
        avx2_block b = avx2_load(src);
        int32_t amax = _mm256_cvtsi256_si32(b.abs_max);
        if (amax >= EXPONENT) return blk;
        float m;
        memcpy(&m, &amax, 4);
        float d = m / 127.0f, id = inverse(d);
        put_half(dst, d);
        __m256 scale = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) {           /* trunc(y + copysign(ROUND, y)) = roundf(y), y = x * id */
            __m256 y = _mm256_mul_ps(b.x[k], scale);
            q[k] = _mm256_cvttps_epi32(_mm256_add_ps(y, _mm256_or_ps(_mm256_and_ps(y, sign), round)));
        }
        avx2_put_bytes(dst + 2, q);
    }
    return -1;
}

/* q4_0 and q5_0: d = (signed max) / -(2**(bits-1)), q = trunc(x * id + offset) clipped. */
AVX2 static inline Py_ssize_t symmetric_avx2(const float *src, uint8_t *dst, Py_ssize_t n, int five) {
    const float divisor = five ? -16.0f : -8.0f;
    const __m256 offset = _mm256_set1_ps(five ? 16.5f : 8.5f);
    const __m256i top = _mm256_set1_epi32(five ? 31 : 15);
    const int size = five ? 22 : 18;
    for (Py_ssize_t blk = 0; blk < n; blk++, src += BLOCK, dst += size) {
        avx2_block b = avx2_load(src);
        if (_mm256_cvtsi256_si32(b.abs_max) >= EXPONENT) return blk;
        float d = avx2_signed_abs_max(&b, src) / divisor, id = inverse(d);
        put_half(dst, d);
        __m256 scale = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = avx2_levels(_mm256_add_ps(_mm256_mul_ps(b.x[k], scale), offset), top);
        if (five) avx2_put_high_bits(dst + 2, q);
        avx2_put_nibbles(dst + (five ? 6 : 2), q);
    }
    return -1;
}

/* q4_1 and q5_1: d = (max - min) / (2**bits - 1), m = min, q = trunc((x - min) * id + 0.5). */
AVX2 static inline Py_ssize_t affine_avx2(const float *src, uint8_t *dst, Py_ssize_t n, int five) {
    const float divisor = five ? 31.0f : 15.0f;
    const __m256 half = _mm256_set1_ps(0.5f);
    const __m256i top = _mm256_set1_epi32(five ? 31 : 15);
    const int size = five ? 24 : 20;
    for (Py_ssize_t blk = 0; blk < n; blk++, src += BLOCK, dst += size) {
        avx2_block b = avx2_load(src);
        if (_mm256_cvtsi256_si32(b.abs_max) >= EXPONENT) return blk;
        float lo = all_min_ps(_mm256_min_ps(_mm256_min_ps(b.x[0], b.x[1]), _mm256_min_ps(b.x[2], b.x[3])));
        float hi = all_max_ps(_mm256_max_ps(_mm256_max_ps(b.x[0], b.x[1]), _mm256_max_ps(b.x[2], b.x[3])));
        float d = (hi - lo) / divisor, id = inverse(d);
        put_half(dst, d);
        put_half(dst + 2, lo);
        __m256 scale = _mm256_set1_ps(id), minimum = _mm256_set1_ps(lo);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = avx2_levels(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(b.x[k], minimum), scale), half), top);
        if (five) avx2_put_high_bits(dst + 4, q);
        avx2_put_nibbles(dst + (five ? 8 : 4), q);
    }
    return -1;
}

AVX2 static Py_ssize_t q4_0_avx2(const float *s, uint8_t *d, Py_ssize_t n) { return symmetric_avx2(s, d, n, 0); }
AVX2 static Py_ssize_t q5_0_avx2(const float *s, uint8_t *d, Py_ssize_t n) { return symmetric_avx2(s, d, n, 1); }
AVX2 static Py_ssize_t q4_1_avx2(const float *s, uint8_t *d, Py_ssize_t n) { return affine_avx2(s, d, n, 0); }
AVX2 static Py_ssize_t q5_1_avx2(const float *s, uint8_t *d, Py_ssize_t n) { return affine_avx2(s, d, n, 1); }
