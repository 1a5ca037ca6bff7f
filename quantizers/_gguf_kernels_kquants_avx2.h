/* AVX2 K-quant quantizers (Q2_K..Q6_K, with and without an importance matrix): eight sub-blocks side by side.
 *
 * Byte-identical to the portable kernels of _gguf_kernels_kquants.h / _gguf_kernels_imatrix.h (and so
 * to llama.cpp): each of the 8 lanes of a register is one sub-block, and every lane runs exactly the
 * scalar code's float32 operations on its own values in the scalar order (sums accumulate value 0,
 * 1, 2 ... of the lane's sub-block; no reduction is reordered; divisions stay divisions; no FMA: the
 * functions are compiled for "avx2" only and the file with -ffp-contract=off). Branches of the scalar
 * searches become per-lane masks; a lane whose scalar search would have stopped early runs on with an
 * unchanged state, which changes nothing. The super-block's scales (a few scalar steps) are the
 * portable code, shared; the requantization at the stored scales and the packing are element-wise (no
 * reductions), 8 values or 32 bytes at a time.
 * Included by _gguf_kernels.c after the portable headers and _gguf_kernels_avx2.h (AVX2, immintrin).
 * tests/test_kquants_isa.py checks both against each other and against llama.cpp's golden bytes.
 */

#define F8(v) _mm256_set1_ps(v)
#define I8(v) _mm256_set1_epi32(v)

/* Rows r[0..7] become columns: r[i] lane b = old r[b] lane i (32-bit elements). */
AVX2 static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* v[i] lane b = p[stride * b + i], i < n (a multiple of 8): value i of 8 sub-blocks `stride` apart. */
AVX2 static inline void load_lanes(const float *p, int stride, int n, __m256 *v) {
    for (int k = 0; k < n; k += 8) {
        __m256 r[8];
        for (int b = 0; b < 8; b++) r[b] = _mm256_loadu_ps(p + stride * b + k);
        transpose8(r);
        for (int i = 0; i < 8; i++) v[k + i] = r[i];
    }
}

/* The low bytes of the 8 lanes of v (levels -128..255) to dst[0..7]. */
AVX2 static inline void store_bytes8(__m256i v, uint8_t *dst) {
    __m256i q = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    uint32_t lo = (uint32_t)_mm256_extract_epi32(q, 0), hi = (uint32_t)_mm256_extract_epi32(q, 4);
    memcpy(dst, &lo, 4);
    memcpy(dst + 4, &hi, 4);
}

/* The inverse of load_lanes for levels: L[stride * b + i] = v[i] lane b (as a byte). */
AVX2 static inline void store_lanes(const __m256i *v, int stride, int n, uint8_t *L) {
    for (int k = 0; k < n; k += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_castsi256_ps(v[k + i]);
        transpose8(r);
        for (int b = 0; b < 8; b++) store_bytes8(_mm256_castps_si256(r[b]), L + stride * b + k);
    }
}

/* round_int in every lane: f + 1.5 * 2**23, the low mantissa bits. */
AVX2 static inline __m256i round_lanes(__m256 f) {
    __m256i bits = _mm256_castps_si256(_mm256_add_ps(f, F8(12582912.f)));
    return _mm256_sub_epi32(_mm256_and_si256(bits, I8(0x007fffff)), I8(0x00400000));
}

AVX2 static inline __m256i clamp_lanes(__m256i v, int lo, int hi) {
    return _mm256_min_epi32(_mm256_max_epi32(v, I8(lo)), I8(hi));
}

AVX2 static inline __m256 abs_lanes(__m256 v) { return _mm256_andnot_ps(F8(-0.0f), v); }

/* largest(): per lane, the value of largest magnitude (the first of ties), 0 if none is above 0. */
AVX2 static inline __m256 largest_lanes(int n, const __m256 *X) {
    __m256 amax = _mm256_setzero_ps(), max = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) {
        __m256 a = abs_lanes(X[i]), more = _mm256_cmp_ps(a, amax, _CMP_GT_OQ);
        amax = _mm256_blendv_ps(amax, a, more);
        max = _mm256_blendv_ps(max, X[i], more);
    }
    return max;
}

/* signed_levels() per lane: the levels T (-nmax..nmax-1, not offset) and the sums sum(w x l), sum(w l l). */
AVX2 static inline void signed_levels_lanes(int n, int nmax, const __m256 *X, const __m256 *W, const __m256 *WX,
                                            __m256 iscale, __m256i *T, __m256 *sumlx, __m256 *suml2) {
    __m256 slx = _mm256_setzero_ps(), sl2 = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) {
        __m256i l = clamp_lanes(round_lanes(_mm256_mul_ps(iscale, X[i])), -nmax, nmax - 1);
        T[i] = l;
        __m256 fl = _mm256_cvtepi32_ps(l);
        slx = _mm256_add_ps(slx, _mm256_mul_ps(WX[i], fl));
        sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(_mm256_mul_ps(W[i], fl), fl));
    }
    *sumlx = slx;
    *suml2 = sl2;
}

/* fit_signed() on 8 sub-blocks of n <= 32 values: X[i], W[i] lane b = value i of sub-block b and its
 * weight. L[i] gets the levels offset by nmax (0 in an all-zero sub-block); returns the scales. */
AVX2 static __m256 fit_signed_lanes(int n, int nmax, const __m256 *X, const __m256 *W, __m256i *L) {
    __m256 WX[32], sumlx, suml2;
    __m256i T[32];
    for (int i = 0; i < n; i++) WX[i] = _mm256_mul_ps(W[i], X[i]);
    const __m256 max = largest_lanes(n, X);
    signed_levels_lanes(n, nmax, X, W, WX, _mm256_div_ps(F8((float)-nmax), max), L, &sumlx, &suml2);
    __m256 scale = _mm256_and_ps(_mm256_div_ps(sumlx, suml2), _mm256_cmp_ps(suml2, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    __m256 best = _mm256_mul_ps(scale, sumlx);
    for (int step = -9; step <= 9; step++) {
        if (step == 0) continue;
        const float numerator = -(nmax + 0.1f * step);
        signed_levels_lanes(n, nmax, X, W, WX, _mm256_div_ps(F8(numerator), max), T, &sumlx, &suml2);
        __m256 better = _mm256_and_ps(_mm256_cmp_ps(suml2, _mm256_setzero_ps(), _CMP_GT_OQ),
                                      _mm256_cmp_ps(_mm256_mul_ps(sumlx, sumlx), _mm256_mul_ps(best, suml2), _CMP_GT_OQ));
        if (_mm256_movemask_ps(better)) {
            __m256i keep = _mm256_castps_si256(better);
            for (int i = 0; i < n; i++) L[i] = _mm256_blendv_epi8(L[i], T[i], keep);
            __m256 s = _mm256_div_ps(sumlx, suml2);
            scale = _mm256_blendv_ps(scale, s, better);
            best = _mm256_blendv_ps(best, _mm256_mul_ps(s, sumlx), better);
        }
    }
    __m256 tiny = _mm256_cmp_ps(abs_lanes(max), F8(TINY), _CMP_LT_OQ);
    __m256i zero = _mm256_castps_si256(tiny);
    for (int i = 0; i < n; i++) L[i] = _mm256_andnot_si256(zero, _mm256_add_epi32(L[i], I8(nmax)));
    return _mm256_andnot_ps(tiny, scale);
}

/* fit_signed_greedy() (weights x*x) on 8 sub-blocks of n <= 32 values, as fit_signed_lanes. */
AVX2 static __m256 fit_signed_greedy_lanes(int n, int nmax, const __m256 *X, __m256i *L) {
    __m256 W[32], WX[32], sumlx, suml2;
    for (int i = 0; i < n; i++) {
        W[i] = _mm256_mul_ps(X[i], X[i]);
        WX[i] = _mm256_mul_ps(W[i], X[i]);
    }
    const __m256 max = largest_lanes(n, X), zero = _mm256_setzero_ps();
    signed_levels_lanes(n, nmax, X, W, WX, _mm256_div_ps(F8((float)-nmax), max), L, &sumlx, &suml2);
    for (int pass = 0; pass < 5; pass++) {
        __m256 changed = zero;
        for (int i = 0; i < n; i++) {
            __m256 fL = _mm256_cvtepi32_ps(L[i]);
            __m256 slx = _mm256_sub_ps(sumlx, _mm256_mul_ps(WX[i], fL));
            __m256 sl2 = _mm256_sub_ps(suml2, _mm256_mul_ps(_mm256_mul_ps(W[i], fL), fL));
            __m256 active = _mm256_cmp_ps(slx, zero, _CMP_GT_OQ);
            __m256i l = clamp_lanes(round_lanes(_mm256_div_ps(_mm256_mul_ps(X[i], sl2), slx)), -nmax, nmax - 1);
            active = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(l, L[i])), active);
            __m256 fl = _mm256_cvtepi32_ps(l);
            slx = _mm256_add_ps(slx, _mm256_mul_ps(WX[i], fl));
            sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(_mm256_mul_ps(W[i], fl), fl));
            __m256 better = _mm256_cmp_ps(_mm256_mul_ps(_mm256_mul_ps(slx, slx), suml2),
                                          _mm256_mul_ps(_mm256_mul_ps(sumlx, sumlx), sl2), _CMP_GT_OQ);
            better = _mm256_and_ps(_mm256_and_ps(active, better), _mm256_cmp_ps(sl2, zero, _CMP_GT_OQ));
            L[i] = _mm256_blendv_epi8(L[i], l, _mm256_castps_si256(better));
            sumlx = _mm256_blendv_ps(sumlx, slx, better);
            suml2 = _mm256_blendv_ps(suml2, sl2, better);
            changed = _mm256_or_ps(changed, better);
        }
        if (!_mm256_movemask_ps(changed)) break;
    }
    __m256 tiny = _mm256_cmp_ps(abs_lanes(max), F8(TINY), _CMP_LT_OQ);
    __m256i none = _mm256_castps_si256(tiny);
    for (int i = 0; i < n; i++) L[i] = _mm256_andnot_si256(none, _mm256_add_epi32(L[i], I8(nmax)));
    __m256 scale = _mm256_and_ps(_mm256_div_ps(sumlx, suml2), _mm256_cmp_ps(suml2, zero, _CMP_GT_OQ));
    return _mm256_andnot_ps(tiny, scale);
}

/* error_of() per lane. */
AVX2 static inline __m256 error_lanes(__m256 diff, int mad) {
    return mad ? abs_lanes(diff) : _mm256_mul_ps(diff, diff);
}

/* fit_affine() on 8 sub-blocks of n <= 32 values (X, W as for fit_signed_lanes): L[i] gets the levels
 * 0..nmax, *neg_min the negated minimums; returns the scales. */
AVX2 static __m256 fit_affine_lanes(int n, int nmax, const __m256 *X, const __m256 *W, __m256i *L, __m256 *neg_min,
                                    float rmin, float rdelta, int nstep, int mad) {
    __m256i T[32];
    const __m256 zero = _mm256_setzero_ps();
    __m256 min = X[0], max = X[0], sum_w = W[0], sum_x = _mm256_mul_ps(sum_w, X[0]);
    for (int i = 1; i < n; i++) {
        min = _mm256_min_ps(X[i], min);         /* x < min ? x : min */
        max = _mm256_max_ps(X[i], max);         /* x > max ? x : max */
        sum_w = _mm256_add_ps(sum_w, W[i]);
        sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(W[i], X[i]));
    }
    min = _mm256_blendv_ps(min, zero, _mm256_cmp_ps(min, zero, _CMP_GT_OQ));
    const __m256 flat = _mm256_cmp_ps(max, min, _CMP_EQ_OQ);
    const __m256 first_min = min;
    __m256 iscale = _mm256_div_ps(F8((float)nmax), _mm256_sub_ps(max, min)), scale = _mm256_div_ps(F8(1.f), iscale);
    __m256 best_error = zero;
    for (int i = 0; i < n; i++) {
        L[i] = clamp_lanes(round_lanes(_mm256_mul_ps(iscale, _mm256_sub_ps(X[i], min))), 0, nmax);
        __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(L[i])), min), X[i]);
        best_error = _mm256_add_ps(best_error, _mm256_mul_ps(W[i], error_lanes(diff, mad)));
    }
    for (int step = 0; step <= nstep; step++) {
        const float numerator = rmin + rdelta * step + nmax;
        iscale = _mm256_div_ps(F8(numerator), _mm256_sub_ps(max, min));
        __m256 sum_l = zero, sum_l2 = zero, sum_xl = zero;
        for (int i = 0; i < n; i++) {
            __m256i l = clamp_lanes(round_lanes(_mm256_mul_ps(iscale, _mm256_sub_ps(X[i], min))), 0, nmax);
            T[i] = l;
            __m256 wl = _mm256_mul_ps(W[i], _mm256_cvtepi32_ps(l)), fl = _mm256_cvtepi32_ps(l);
            sum_l = _mm256_add_ps(sum_l, wl);
            sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wl, fl));
            sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wl, X[i]));
        }
        __m256 D = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
        __m256 positive = _mm256_cmp_ps(D, zero, _CMP_GT_OQ);
        if (!_mm256_movemask_ps(positive)) continue;
        __m256 this_scale = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l)), D);
        __m256 this_min = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl)), D);
        __m256 clip = _mm256_cmp_ps(this_min, zero, _CMP_GT_OQ);
        this_min = _mm256_blendv_ps(this_min, zero, clip);
        this_scale = _mm256_blendv_ps(this_scale, _mm256_div_ps(sum_xl, sum_l2), clip);
        __m256 error = zero;
        for (int i = 0; i < n; i++) {
            __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(this_scale, _mm256_cvtepi32_ps(T[i])), this_min), X[i]);
            error = _mm256_add_ps(error, _mm256_mul_ps(W[i], error_lanes(diff, mad)));
        }
        __m256 better = _mm256_and_ps(positive, _mm256_cmp_ps(error, best_error, _CMP_LT_OQ));
        if (_mm256_movemask_ps(better)) {
            __m256i keep = _mm256_castps_si256(better);
            for (int i = 0; i < n; i++) L[i] = _mm256_blendv_epi8(L[i], T[i], keep);
            best_error = _mm256_blendv_ps(best_error, error, better);
            scale = _mm256_blendv_ps(scale, this_scale, better);
            min = _mm256_blendv_ps(min, this_min, better);
        }
    }
    /* a flat sub-block: levels 0, scale 0, its own minimum */
    __m256i none = _mm256_castps_si256(flat);
    for (int i = 0; i < n; i++) L[i] = _mm256_andnot_si256(none, L[i]);
    *neg_min = _mm256_xor_ps(F8(-0.0f), _mm256_blendv_ps(min, first_min, flat));   /* -min, exactly */
    return _mm256_andnot_ps(flat, scale);
}

/* importance() per lane: W[i] = qw * sqrt(sigma2 + x * x), and their sums (value 0 first). */
AVX2 static inline __m256 importance_lanes(int n, const __m256 *X, const __m256 *QW, float sigma2, __m256 *W) {
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) W[i] = _mm256_mul_ps(QW[i], _mm256_sqrt_ps(_mm256_add_ps(F8(sigma2), _mm256_mul_ps(X[i], X[i]))));
    for (int i = 0; i < n; i++) sum = _mm256_add_ps(sum, W[i]);
    return sum;
}

/* ---- Q6_K: 16 sub-blocks of 16, two groups of 8 lanes. ---- */

/* q6_k_finish: the requantization at the stored scales 8 values at a time, the packing 32 bytes at a time. */
AVX2 static void q6_k_finish_avx2(const float *x, uint8_t *y, int8_t *L, const float *fits) {
    float d_all;
    if (!q6_k_scales(y, fits, &d_all)) return;
    const int8_t *scales = (const int8_t *)(y + 192);
    uint8_t *levels = (uint8_t *)L;
    for (int b = 0; b < 16; b++) {
        const float d = d_all * scales[b];
        if (!d) continue;
        for (int h = 0; h < 16; h += 8) {
            __m256i l = clamp_lanes(round_lanes(_mm256_div_ps(_mm256_loadu_ps(x + 16 * b + h), F8(d))), -32, 31);
            store_bytes8(_mm256_add_epi32(l, I8(32)), levels + 16 * b + h);
        }
    }
    const __m256i nibble = _mm256_set1_epi8(0xF), pair = _mm256_set1_epi8(3);
    for (int j = 0; j < 2; j++) {               /* levels 0..63: low nibbles in ql, the two high bits in qh */
        const uint8_t *q = levels + 128 * j;
        __m256i a = _mm256_loadu_si256((const __m256i *)q), b = _mm256_loadu_si256((const __m256i *)(q + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(q + 64)), e = _mm256_loadu_si256((const __m256i *)(q + 96));
        __m256i ql0 = _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_slli_epi16(_mm256_and_si256(c, nibble), 4));
        __m256i ql1 = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_slli_epi16(_mm256_and_si256(e, nibble), 4));
        __m256i qh = _mm256_or_si256(
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), pair),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), pair), 2)),
            _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), pair), 4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(e, 4), pair), 6)));
        _mm256_storeu_si256((__m256i *)(y + 64 * j), ql0);
        _mm256_storeu_si256((__m256i *)(y + 64 * j + 32), ql1);
        _mm256_storeu_si256((__m256i *)(y + 128 + 32 * j), qh);
    }
}

AVX2 static void quantize_q6_k_weighted_avx2(const float *x, uint8_t *y, const float *qw) {
    int8_t L[SUPER];
    float fits[16];
    for (int g = 0; g < 2; g++) {
        __m256 X[16], W[16];
        __m256i Lv[16];
        load_lanes(x + 128 * g, 16, 16, X);
        if (qw) load_lanes(qw + 128 * g, 16, 16, W);
        else for (int i = 0; i < 16; i++) W[i] = _mm256_mul_ps(X[i], X[i]);
        _mm256_storeu_ps(fits + 8 * g, fit_signed_lanes(16, 32, X, W, Lv));
        store_lanes(Lv, 16, 16, (uint8_t *)L + 128 * g);
    }
    q6_k_finish_avx2(x, y, L, fits);
}

AVX2 static void quantize_q6_k_avx2(const float *x, uint8_t *y) { quantize_q6_k_weighted_avx2(x, y, NULL); }

/* ---- Q4_K, Q5_K: 8 sub-blocks of 32, one group. ---- */

/* qk_affine_finish: the requantization at the stored scales 8 values at a time, the packing 32 bytes at a time. */
AVX2 static void qk_affine_finish_avx2(const float *x, uint8_t *y, uint8_t *L, int five) {
    const int nmax = five ? 31 : 15;
    for (int j = 0; j < 8; j++) {
        float dm;
        const float d = qk_affine_stored(y, j, &dm);
        if (!d) continue;
        for (int h = 0; h < 32; h += 8) {
            __m256 f = _mm256_div_ps(_mm256_add_ps(_mm256_loadu_ps(x + 32 * j + h), F8(dm)), F8(d));
            store_bytes8(clamp_lanes(round_lanes(f), 0, nmax), L + 32 * j + h);
        }
    }
    const __m256i nibble = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    uint8_t *ql = five ? y + 48 : y + 16;
    __m256i qh = _mm256_setzero_si256();        /* Q5_K: bit 2p of qh[j] the fifth bit of L[64p + j], 2p + 1 of L[64p + 32 + j] */
    for (int p = 0; p < 4; p++) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(L + 64 * p)), hi = _mm256_loadu_si256((const __m256i *)(L + 64 * p + 32));
        _mm256_storeu_si256((__m256i *)(ql + 32 * p),
                            _mm256_or_si256(_mm256_and_si256(lo, nibble), _mm256_slli_epi16(_mm256_and_si256(hi, nibble), 4)));
        __m256i bits = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), one),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4), one), 1));
        qh = _mm256_or_si256(qh, _mm256_sll_epi16(bits, _mm_cvtsi32_si128(2 * p)));
    }
    if (five) _mm256_storeu_si256((__m256i *)(y + 16), qh);
}
AVX2 static void quantize_qk_affine_avx2(const float *x, uint8_t *y, const float *qw, int five) {
    uint8_t L[SUPER];
    float fits[8], mins[8], sw[8];
    __m256 X[32], W[32], neg_min;
    __m256i Lv[32];
    load_lanes(x, 32, 32, X);
    __m256 scale;
    if (qw) {
        __m256 QW[32];
        load_lanes(qw, 32, 32, QW);
        const float sigma2 = 2 * sum_squares(SUPER, x) / SUPER;
        _mm256_storeu_ps(sw, importance_lanes(32, X, QW, sigma2, W));
        scale = fit_affine_lanes(32, five ? 31 : 15, X, W, Lv, &neg_min, -0.9f, 0.05f, 36, 0);
    } else {
        __m256 sum_x2 = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(X[i], X[i]));
        __m256 av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, F8(32.f)));
        for (int i = 0; i < 32; i++) W[i] = _mm256_add_ps(av_x, abs_lanes(X[i]));
        scale = five ? fit_affine_lanes(32, 31, X, W, Lv, &neg_min, -0.5f, 0.1f, 15, 0)
                     : fit_affine_lanes(32, 15, X, W, Lv, &neg_min, -1.f, 0.1f, 20, 0);
    }
    _mm256_storeu_ps(fits, scale);
    _mm256_storeu_ps(mins, neg_min);
    store_lanes(Lv, 32, 32, L);
    if (qw) qk_affine_weighted_scales(y, fits, mins, sw, five);
    else qk_affine_scales(y, fits, mins);
    qk_affine_finish_avx2(x, y, L, five);
}

AVX2 static void quantize_q4_k_avx2(const float *x, uint8_t *y) { quantize_qk_affine_avx2(x, y, NULL, 0); }
AVX2 static void quantize_q5_k_avx2(const float *x, uint8_t *y) { quantize_qk_affine_avx2(x, y, NULL, 1); }
AVX2 static void quantize_q4_k_weighted_avx2(const float *x, uint8_t *y, const float *qw) { quantize_qk_affine_avx2(x, y, qw, 0); }
AVX2 static void quantize_q5_k_weighted_avx2(const float *x, uint8_t *y, const float *qw) { quantize_qk_affine_avx2(x, y, qw, 1); }

/* put_crumbs for levels 0..3, 32 bytes at a time. */
AVX2 static inline void put_crumbs_avx2(uint8_t *qs, const uint8_t *L) {
    for (int j = 0; j < 2; j++, L += 128, qs += 32) {
        __m256i a = _mm256_loadu_si256((const __m256i *)L), b = _mm256_loadu_si256((const __m256i *)(L + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(L + 64)), e = _mm256_loadu_si256((const __m256i *)(L + 96));
        _mm256_storeu_si256((__m256i *)qs, _mm256_or_si256(_mm256_or_si256(a, _mm256_slli_epi16(b, 2)),
                                                           _mm256_or_si256(_mm256_slli_epi16(c, 4), _mm256_slli_epi16(e, 6))));
    }
}

/* ---- Q2_K: 16 sub-blocks of 16, two groups. ---- */

/* q2_k_finish: the requantization at the stored scales 8 values at a time, the packing 32 bytes at a time. */
AVX2 static void q2_k_finish_avx2(const float *x, uint8_t *y, uint8_t *L) {
    float d_all = half_value(y + 80), m_all = half_value(y + 82);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * (y[j] & 0xF), dm = m_all * (y[j] >> 4);
        if (!d) continue;
        for (int h = 0; h < 16; h += 8) {
            __m256 f = _mm256_div_ps(_mm256_add_ps(_mm256_loadu_ps(x + 16 * j + h), F8(dm)), F8(d));
            store_bytes8(clamp_lanes(round_lanes(f), 0, 3), L + 16 * j + h);
        }
    }
    put_crumbs_avx2(y + 16, L);
}
AVX2 static void quantize_q2_k_weighted_avx2(const float *x, uint8_t *y, const float *qw) {
    uint8_t L[SUPER];
    float fits[16], mins[16], sw[16];
    const float sigma2 = qw ? sum_squares(SUPER, x) / SUPER : 0.f;
    for (int g = 0; g < 2; g++) {
        __m256 X[16], W[16], neg_min, scale;
        __m256i Lv[16];
        load_lanes(x + 128 * g, 16, 16, X);
        if (qw) {
            __m256 QW[16];
            load_lanes(qw + 128 * g, 16, 16, QW);
            _mm256_storeu_ps(sw + 8 * g, importance_lanes(16, X, QW, sigma2, W));
            scale = fit_affine_lanes(16, 3, X, W, Lv, &neg_min, -0.9f, 0.05f, 36, 0);
        } else {
            for (int i = 0; i < 16; i++) W[i] = abs_lanes(X[i]);
            scale = fit_affine_lanes(16, 3, X, W, Lv, &neg_min, -0.5f, 0.1f, 15, 1);
        }
        _mm256_storeu_ps(fits + 8 * g, scale);
        _mm256_storeu_ps(mins + 8 * g, neg_min);
        store_lanes(Lv, 16, 16, L + 128 * g);
    }
    if (qw) q2_k_weighted_scales(y, fits, mins, sw);
    else q2_k_scales(y, fits, mins);
    q2_k_finish_avx2(x, y, L);
}

AVX2 static void quantize_q2_k_avx2(const float *x, uint8_t *y) { quantize_q2_k_weighted_avx2(x, y, NULL); }

/* ---- Q3_K: 16 sub-blocks of 16, two groups. ---- */

/* q3_k_finish: the requantization at the stored scales 8 values at a time; the third bits and the
 * packing 32 bytes at a time. */
AVX2 static void q3_k_finish_avx2(const float *x, uint8_t *y, int8_t *L) {
    uint8_t *levels = (uint8_t *)L;
    float d_all = half_value(y + 108);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * q3_k_code(y + 96, j);
        if (!d) continue;
        for (int h = 0; h < 16; h += 8) {
            __m256i l = clamp_lanes(round_lanes(_mm256_div_ps(_mm256_loadu_ps(x + 16 * j + h), F8(d))), -4, 3);
            store_bytes8(_mm256_add_epi32(l, I8(4)), levels + 16 * j + h);
        }
    }
    const __m256i one = _mm256_set1_epi8(1), two_bits = _mm256_set1_epi8(3);
    __m256i hmask = _mm256_setzero_si256();     /* bit k of hmask[m]: the third bit of level 32k + m (0..7) */
    for (int k = 0; k < 8; k++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(levels + 32 * k));
        hmask = _mm256_or_si256(hmask, _mm256_sll_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 2), one), _mm_cvtsi32_si128(k)));
        _mm256_storeu_si256((__m256i *)(levels + 32 * k), _mm256_and_si256(v, two_bits));
    }
    _mm256_storeu_si256((__m256i *)y, hmask);
    put_crumbs_avx2(y + 32, levels);
}
AVX2 static void quantize_q3_k_weighted_avx2(const float *x, uint8_t *y, const float *qw) {
    int8_t L[SUPER];
    float fits[16], sw[16];
    const float sigma2 = qw ? 2 * sum_squares(SUPER, x) / SUPER : 0.f;
    for (int g = 0; g < 2; g++) {
        __m256 X[16];
        __m256i Lv[16];
        load_lanes(x + 128 * g, 16, 16, X);
        if (qw) {
            __m256 QW[16], W[16];
            load_lanes(qw + 128 * g, 16, 16, QW);
            _mm256_storeu_ps(sw + 8 * g, importance_lanes(16, X, QW, sigma2, W));
            _mm256_storeu_ps(fits + 8 * g, fit_signed_lanes(16, 4, X, W, Lv));
        } else {
            _mm256_storeu_ps(fits + 8 * g, fit_signed_greedy_lanes(16, 4, X, Lv));
        }
        store_lanes(Lv, 16, 16, (uint8_t *)L + 128 * g);
    }
    if (qw) q3_k_weighted_scales(y, fits, sw);
    else q3_k_scales(y, fits);
    q3_k_finish_avx2(x, y, L);
}

AVX2 static void quantize_q3_k_avx2(const float *x, uint8_t *y) { quantize_q3_k_weighted_avx2(x, y, NULL); }
