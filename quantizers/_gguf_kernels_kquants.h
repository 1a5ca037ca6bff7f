/* K-quant super-blocks (256 weights): Q2_K..Q6_K quantization and dequantization.
 *
 * Byte-identical to llama.cpp's ggml_quantize_chunk without an importance matrix (its
 * quantize_row_qN_K_ref) and bit-identical to its to_float: the same search for scales and
 * minimums, the same float32 operations in the same order (this file is built with
 * -ffp-contract=off, as ggml's reference code runs without fused multiply-add), rounding by
 * adding 1.5 * 2**23 and reading the low mantissa bits, scales stored as fp16 by half_bits.
 * Plain scalar C, portable: the searches branch per sub-block and are not vectorised.
 * Included by _gguf_kernels.c after the shared helpers; checked against llama.cpp's own
 * library by tests/test_kquants.py (golden bytes in fixtures/llama_cpp/).
 */
#define SUPER 256
#define TINY 1e-15f                 /* a sub-block whose largest |x| is below this is all zeros */

/* Round to nearest, ties to even, for |f| < 2**22: in f + 1.5 * 2**23 the float's ulp is 1. */
static inline int round_int(float f) {
    float biased = f + 12582912.f;
    int32_t bits;
    memcpy(&bits, &biased, 4);
    return (bits & 0x007fffff) - 0x00400000;
}

static inline int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static inline float half_value(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | man << 13;
    } else if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f);    /* exact: man * 2**-24 */
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The value of largest magnitude (the first of ties), 0 for an empty or all-zero x. */
static inline float largest(int n, const float *x) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax) { amax = a; max = x[i]; }
    }
    return max;
}

/* Levels of x at `iscale` clipped to -nmax..nmax-1, stored plus `offset` in L unless L is NULL, and
 * the weighted sums sum(w x l) and sum(w l l) for weights w = qw, or x * x where qw is NULL. */
static inline void signed_levels(int n, int nmax, const float *x, const float *qw, float iscale, int8_t *L,
                                 int offset, float *sumlx, float *suml2) {
    float slx = 0, sl2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clamp_int(round_int(iscale * x[i]), -nmax, nmax - 1);
        if (L) L[i] = (int8_t)(l + offset);
        float w = qw ? qw[i] : x[i] * x[i];
        slx += w * x[i] * l;
        sl2 += w * l * l;
    }
    *sumlx = slx;
    *suml2 = sl2;
}

/* The scale that fits x (n values) to signed levels -nmax..nmax-1 under weights qw (x*x where qw is
 * NULL): the largest-magnitude value's level -nmax first, then 18 nearby scales, keeping the best
 * weighted least-squares fit. L gets the levels offset by nmax. (make_qx_quants, rmse 1.) */
static float fit_signed(int n, int nmax, const float *x, const float *qw, int8_t *L) {
    float max = largest(n, x), sumlx, suml2, unused;
    if (fabsf(max) < TINY) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    signed_levels(n, nmax, x, qw, -nmax / max, L, nmax, &sumlx, &suml2);
    float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int step = -9; step <= 9; step++) {
        if (step == 0) continue;
        float iscale = -(nmax + 0.1f * step) / max;
        signed_levels(n, nmax, x, qw, iscale, NULL, 0, &sumlx, &suml2);
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            signed_levels(n, nmax, x, qw, iscale, L, nmax, &unused, &unused);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Scale and minimum fitting x (n <= 32 values) to levels 0..nmax as scale * L + min (min <= 0):
 * the min/max fit first, then nstep + 1 scales around it, each refit by weighted least squares,
 * keeping the one of least weighted error (squared, or absolute with `mad`). Returns the scale,
 * *neg_min = -min. (make_qkx2_quants.) */
static inline float error_of(float diff, int mad) { return mad ? fabsf(diff) : diff * diff; }

static float fit_affine(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min,
                        float rmin, float rdelta, int nstep, int mad) {
    uint8_t trial[32];
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *neg_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best_error = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)clamp_int(round_int(iscale * (x[i] - min)), 0, nmax);
        best_error += w[i] * error_of(scale * L[i] + min - x[i], mad);
    }
    for (int step = 0; step <= nstep; step++) {
        iscale = (rmin + rdelta * step + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = clamp_int(round_int(iscale * (x[i] - min)), 0, nmax);
            trial[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float error = 0;
            for (int i = 0; i < n; i++) {
                error += w[i] * error_of(this_scale * trial[i] + this_min - x[i], mad);
            }
            if (error < best_error) {
                memcpy(L, trial, (size_t)n);
                best_error = error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *neg_min = -min;
    return scale;
}

/* The 12 bytes of Q4_K/Q5_K: eight 6-bit scales and eight 6-bit minimums. */
static inline void scale_min_get(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static inline void scale_min_put(int j, uint8_t *q, uint8_t ls, uint8_t lm) {
    if (j < 4) {
        q[j] = ls;
        q[j + 4] = lm;
    } else {
        q[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
        q[j - 4] |= (uint8_t)((ls >> 4) << 6);
        q[j] |= (uint8_t)((lm >> 4) << 6);
    }
}

static void qk_affine_scales(uint8_t *y, const float *fits, const float *mins);
static void qk_affine_finish(const float *x, uint8_t *y, uint8_t *L, int five);

/* Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 nibble bytes) and Q5_K (176 bytes: the same
 * plus 32 bytes of fifth bits before the nibbles): eight sub-blocks of 32, each scale * L - min. */
static void quantize_qk_affine(const float *x, uint8_t *y, int five) {
    uint8_t L[SUPER];
    float mins[8], fits[8], w[32];
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        fits[j] = five ? fit_affine(32, 31, xs, w, L + 32 * j, &mins[j], -0.5f, 0.1f, 15, 0)
                       : fit_affine(32, 15, xs, w, L + 32 * j, &mins[j], -1.f, 0.1f, 20, 0);
    }
    qk_affine_scales(y, fits, mins);
    qk_affine_finish(x, y, L, five);
}

/* Q4_K/Q5_K's d, dmin and 6-bit scale and minimum codes from the sub-blocks' fitted scales and
 * minimums (negated). */
static void qk_affine_scales(uint8_t *y, const float *fits, const float *mins) {
    uint8_t *scales = y + 4;
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        if (fits[j] > max_scale) max_scale = fits[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    memset(scales, 0, 12);
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)round_int(inv_scale * fits[j]), lm = (uint8_t)round_int(inv_min * mins[j]);
        scale_min_put(j, scales, ls < 63 ? ls : 63, lm < 63 ? lm : 63);
    }
    put_half(y, max_scale / 63.f);
    put_half(y + 2, max_min / 63.f);
}

/* Sub-block j's stored scale d * code (returned) and minimum dmin * code (*dm) in a Q4_K/Q5_K block y. */
static inline float qk_affine_stored(const uint8_t *y, int j, float *dm) {
    uint8_t sc, m;
    scale_min_get(j, y + 4, &sc, &m);
    *dm = half_value(y + 2) * m;
    return half_value(y) * sc;
}

/* Q4_K/Q5_K with d, dmin and the scale bytes written: levels requantized at the stored scales, packed. */
static void qk_affine_finish(const float *x, uint8_t *y, uint8_t *L, int five) {
    const int nmax = five ? 31 : 15;
    for (int j = 0; j < 8; j++) {
        float dm;
        const float d = qk_affine_stored(y, j, &dm);
        if (!d) continue;
        for (int i = 0; i < 32; i++) L[32 * j + i] = (uint8_t)clamp_int(round_int((x[32 * j + i] + dm) / d), 0, nmax);
    }
    uint8_t *qh = y + 16, *ql = five ? y + 48 : y + 16;
    if (five) memset(qh, 0, 32);
    for (int n = 0, pair = 0; n < SUPER; n += 64, pair++, ql += 32) {
        for (int j = 0; j < 32; j++) {
            int lo = L[n + j], hi = L[n + j + 32];
            if (lo > 15) { lo -= 16; qh[j] |= (uint8_t)(1 << (2 * pair)); }
            if (hi > 15) { hi -= 16; qh[j] |= (uint8_t)(2 << (2 * pair)); }
            ql[j] = (uint8_t)(lo | hi << 4);
        }
    }
}

/* Q6_K (210 bytes: 128 low-nibble bytes, 64 high-bit-pair bytes, 16 int8 scales, d): sixteen
 * sub-blocks of 16, symmetric, levels -32..31. */
static void q6_k_finish(const float *x, uint8_t *y, int8_t *L, const float *fits);

static void quantize_q6_k_weighted(const float *x, uint8_t *y, const float *qw) {
    int8_t L[SUPER];
    float fits[16];
    for (int b = 0; b < 16; b++) fits[b] = fit_signed(16, 32, x + 16 * b, qw ? qw + 16 * b : NULL, L + 16 * b);
    q6_k_finish(x, y, L, fits);
}

/* Q6_K's int8 sub-block scales and d (y + 192, y + 208) from the fitted scales, the rest of y zeroed.
 * Returns 0 for an all-zero super-block (y is then complete: all zeros), else 1 with *d_all = d as stored. */
static int q6_k_scales(uint8_t *y, const float *fits, float *d_all) {
    const float max_scale = largest(16, fits);
    memset(y, 0, 210);
    if (fabsf(max_scale) < TINY) return 0;      /* all zeros, d = +0 */
    int8_t *scales = (int8_t *)(y + 192);
    float iscale = -128.f / max_scale;
    put_half(y + 208, 1 / iscale);
    for (int b = 0; b < 16; b++) {
        int s = round_int(iscale * fits[b]);
        scales[b] = (int8_t)(s < 127 ? s : 127);
    }
    *d_all = half_value(y + 208);
    return 1;
}

/* Q6_K from the sub-blocks' fitted scales and levels: the int8 scales under d, the levels
 * requantized at the stored scales (a sub-block whose scale is 0 keeps its fitted levels), packed. */
static void q6_k_finish(const float *x, uint8_t *y, int8_t *L, const float *fits) {
    float d_all;
    if (!q6_k_scales(y, fits, &d_all)) return;
    const int8_t *scales = (const int8_t *)(y + 192);
    for (int b = 0; b < 16; b++) {
        float d = d_all * scales[b];
        if (!d) continue;
        for (int i = 0; i < 16; i++) L[16 * b + i] = (int8_t)(clamp_int(round_int(x[16 * b + i] / d), -32, 31) + 32);
    }
    uint8_t *ql = y, *qh = y + 128;
    for (int j = 0; j < SUPER; j += 128, ql += 64, qh += 32) {
        for (int l = 0; l < 32; l++) {
            const uint8_t *q = (const uint8_t *)L + j + l;
            ql[l] = (uint8_t)((q[0] & 0xF) | (q[64] & 0xF) << 4);
            ql[l + 32] = (uint8_t)((q[32] & 0xF) | (q[96] & 0xF) << 4);
            qh[l] = (uint8_t)((q[0] >> 4) | (q[32] >> 4) << 2 | (q[64] >> 4) << 4 | (q[96] >> 4) << 6);
        }
    }
}

/* Signed levels -nmax..nmax-1 for x (n values) under weights x*x: start from the largest-magnitude
 * value's level -nmax, then up to 5 passes moving single levels where that improves the weighted
 * least-squares fit. L gets the levels offset by nmax; returns the scale. (make_q3_quants, rmse.) */
static float fit_signed_greedy(int n, int nmax, const float *x, int8_t *L) {
    float max = largest(n, x), sumlx, suml2;
    if (fabsf(max) < TINY) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    signed_levels(n, nmax, x, NULL, -nmax / max, L, 0, &sumlx, &suml2);
    for (int pass = 0; pass < 5; pass++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i], slx = sumlx - w * x[i] * L[i];
            if (!(slx > 0)) continue;
            float sl2 = suml2 - w * L[i] * L[i];
            int l = clamp_int(round_int(x[i] * sl2 / slx), -nmax, nmax - 1);
            if (l == L[i]) continue;
            slx += w * x[i] * l;
            sl2 += w * l * l;
            if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (int8_t)l;
                sumlx = slx;
                suml2 = sl2;
                changed++;
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Four 2-bit levels per byte: byte 32h + l holds values 128h + l, +32, +64, +96 (Q2_K, Q3_K). */
static void put_crumbs(uint8_t *qs, const uint8_t *L) {
    for (int j = 0; j < SUPER; j += 128, qs += 32)
        for (int l = 0; l < 32; l++)
            qs[l] = (uint8_t)(L[j + l] | L[j + l + 32] << 2 | L[j + l + 64] << 4 | L[j + l + 96] << 6);
}

static void q2_k_scales(uint8_t *y, const float *fits, const float *mins);
static void q2_k_finish(const float *x, uint8_t *y, uint8_t *L);

/* Q2_K (84 bytes: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit levels,
 * d, dmin): sixteen sub-blocks of 16, each scale * L - min with L in 0..3, fit by absolute error. */
static void quantize_q2_k(const float *x, uint8_t *y) {
    uint8_t L[SUPER];
    float mins[16], fits[16], w[16];
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 16; l++) w[l] = fabsf(x[16 * j + l]);
        fits[j] = fit_affine(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, 1);
    }
    q2_k_scales(y, fits, mins);
    q2_k_finish(x, y, L);
}

/* Q2_K's d, dmin and 4-bit scale and minimum codes from the sub-blocks' fitted scales and minimums (negated). */
static void q2_k_scales(uint8_t *y, const float *fits, const float *mins) {
    uint8_t *scales = y;
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; j++) {
        if (fits[j] > max_scale) max_scale = fits[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    memset(scales, 0, 16);
    if (max_scale > 0) {
        float iscale = 15.f / max_scale;
        for (int j = 0; j < 16; j++) scales[j] = (uint8_t)round_int(iscale * fits[j]);
    }
    put_half(y + 80, max_scale > 0 ? max_scale / 15.f : 0.f);
    if (max_min > 0) {
        float iscale = 15.f / max_min;
        for (int j = 0; j < 16; j++) scales[j] |= (uint8_t)(round_int(iscale * mins[j]) << 4);
    }
    put_half(y + 82, max_min > 0 ? max_min / 15.f : 0.f);
}

/* Q2_K with d, dmin and the scale bytes written: levels requantized at the stored scales, packed. */
static void q2_k_finish(const float *x, uint8_t *y, uint8_t *L) {
    float d_all = half_value(y + 80), m_all = half_value(y + 82);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * (y[j] & 0xF);
        if (!d) continue;
        const float dm = m_all * (y[j] >> 4);
        for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)clamp_int(round_int((x[16 * j + i] + dm) / d), 0, 3);
    }
    put_crumbs(y + 16, L);
}

static void q3_k_finish(const float *x, uint8_t *y, int8_t *L);

static void q3_k_scales(uint8_t *y, const float *fits);

/* Q3_K (110 bytes: 32 bytes of third bits, 64 bytes of 2-bit levels, 12 bytes of sixteen 6-bit
 * scales, d): sixteen sub-blocks of 16, symmetric, levels -4..3. */
static void quantize_q3_k(const float *x, uint8_t *y) {
    int8_t L[SUPER];
    float fits[16];
    for (int j = 0; j < 16; j++) fits[j] = fit_signed_greedy(16, 4, x + 16 * j, L + 16 * j);
    q3_k_scales(y, fits);
    q3_k_finish(x, y, L);
}

/* Q3_K's d and 6-bit scale codes from the sub-blocks' fitted scales. */
static void q3_k_scales(uint8_t *y, const float *fits) {
    uint8_t *scales = y + 96;
    const float max_scale = largest(16, fits);
    memset(scales, 0, 12);
    if (max_scale) {
        float iscale = -32.f / max_scale;
        for (int j = 0; j < 16; j++) {
            int l = clamp_int((int8_t)round_int(iscale * fits[j]), -32, 31) + 32;
            if (j < 8) scales[j] = (uint8_t)(l & 0xF);
            else scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
            scales[j % 4 + 8] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
        }
        put_half(y + 108, 1 / iscale);
    } else {
        put_half(y + 108, 0.f);
    }
}

/* Q3_K with d and the scale bytes written: levels requantized at the stored scales, packed. */
/* Sub-block j's signed 6-bit scale code (-32..31) from Q3_K's 12 scale bytes. */
static inline int q3_k_code(const uint8_t *scales, int j) {
    int low = j < 8 ? scales[j] & 0xF : scales[j - 8] >> 4, high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (low | high << 4) - 32;
}

static void q3_k_finish(const float *x, uint8_t *y, int8_t *L) {
    uint8_t *hmask = y;
    float d_all = half_value(y + 108);
    for (int j = 0; j < 16; j++) {
        float d = d_all * q3_k_code(y + 96, j);
        if (!d) continue;
        for (int i = 0; i < 16; i++) L[16 * j + i] = (int8_t)(clamp_int(round_int(x[16 * j + i] / d), -4, 3) + 4);
    }
    memset(hmask, 0, 32);                       /* bit k of hmask[m]: the third bit of value 32k + m */
    for (int j = 0; j < SUPER; j++)
        if (L[j] > 3) {
            hmask[j % 32] |= (uint8_t)(1 << (j / 32));
            L[j] -= 4;
        }
    put_crumbs(y + 32, (const uint8_t *)L);
}

static void dequantize_q2_k(const uint8_t *b, float *y) {   /* 84 bytes: scales[16], qs[64], d, dmin */
    const uint8_t *sc = b, *q = b + 16;
    float d = half_value(b + 80), min = half_value(b + 82);
    for (int n = 0, is = 0; n < SUPER; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2)
            for (int half = 0; half < 2; half++, is++) {
                float dl = d * (sc[is] & 0xF), ml = min * (sc[is] >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * ((q[16 * half + l] >> shift) & 3) - ml;
            }
}

static void dequantize_q3_k(const uint8_t *b, float *y) {   /* 110 bytes: hmask[32], qs[64], scales[12], d */
    const uint8_t *hm = b, *q = b + 32, *s = b + 96;
    float d_all = half_value(b + 108);
    int8_t scales[16];
    for (int j = 0; j < 16; j++) scales[j] = (int8_t)q3_k_code(s, j);
    uint8_t m = 1;
    for (int n = 0, is = 0; n < SUPER; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2, m <<= 1)
            for (int half = 0; half < 2; half++, is++) {
                float dl = d_all * scales[is];
                for (int l = 0; l < 16; l++) {
                    int k = 16 * half + l;
                    *y++ = dl * (((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4));
                }
            }
}

static void dequantize_qk_affine(const uint8_t *b, float *y, int five) {    /* Q4_K, Q5_K */
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = five ? b + 48 : b + 16;
    const int high = five ? 1 : 0;              /* Q4_K has no fifth bits: the mask drops them */
    float d = half_value(b), min = half_value(b + 2);
    for (int j = 0, is = 0; j < SUPER; j += 64, is += 2, ql += 32) {
        uint8_t sc, m;
        scale_min_get(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        scale_min_get(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
        for (int l = 0; l < 32; l++) y[l] = d1 * ((ql[l] & 0xF) | (qh[l] >> is & high) << 4) - m1;
        for (int l = 0; l < 32; l++) y[l + 32] = d2 * ((ql[l] >> 4) | (qh[l] >> (is + 1) & high) << 4) - m2;
        y += 64;
    }
}

static void dequantize_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_value(b + 208);
    /* value 32g + l of each 128: low nibble of ql[l + 32 (g & 1)] (high nibble when g >= 2), bits 2g of qh[l] */
    for (int n = 0; n < SUPER; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
        for (int g = 0; g < 4; g++)
            for (int half = 0; half < 2; half++) {
                const float dl = d * sc[2 * g + half];
                const uint8_t *low = ql + 32 * (g & 1) + 16 * half, *hb = qh + 16 * half;
                const int shift = g >= 2 ? 4 : 0;
                float *out = y + 32 * g + 16 * half;
                for (int l = 0; l < 16; l++) out[l] = dl * (((low[l] >> shift & 0xF) | (hb[l] >> (2 * g) & 3) << 4) - 32);
            }
}

static void quantize_q6_k(const float *x, uint8_t *y) { quantize_q6_k_weighted(x, y, NULL); }
static void quantize_q4_k(const float *x, uint8_t *y) { quantize_qk_affine(x, y, 0); }
static void quantize_q5_k(const float *x, uint8_t *y) { quantize_qk_affine(x, y, 1); }
static void dequantize_q4_k(const uint8_t *b, float *y) { dequantize_qk_affine(b, y, 0); }
static void dequantize_q5_k(const uint8_t *b, float *y) { dequantize_qk_affine(b, y, 1); }
