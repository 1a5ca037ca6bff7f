/* Quantization under an importance matrix, and the IQ4 non-linear types (IQ4_NL, IQ4_XS).
 *
 * Byte-identical to llama.cpp's ggml_quantize_chunk when it is given `imatrix` (one weight per
 * column of the rows, the mean squared activation feeding that column): its quantize_row_*_impl
 * functions for Q4_0, Q4_1, Q5_0, Q5_1 and Q2_K..Q6_K, and its quantize_iq4_nl / quantize_iq4_xs
 * (which take the weights when given and x*x otherwise). Each value's weight is its column's
 * importance times sqrt(sigma2 + x*x) (sigma2: the mean square of the row for the 32-weight
 * types, of the super-block for the K types, twice that for Q3_K..Q5_K and the IQ4 types; Q6_K
 * takes the importance alone). The scale searches are those of the reference code with these
 * weights; the float32 operations keep its order (built with -ffp-contract=off). Q8_0 has no
 * weighted path in llama.cpp. Included by _gguf_kernels.c after _gguf_kernels_kquants.h, whose
 * searches (fit_signed, fit_affine) and packers this reuses; checked against llama.cpp's own
 * library by tests/test_imatrix_quants.py (golden bytes in fixtures/llama_cpp/imatrix.npz).
 */

/* Levels 0..nmax for non-negative x (the sub-block scales or minimums of a super-block) under
 * weights qw: the largest value's level nmax first, 8 nearby scales by weighted squared error,
 * then up to 5 passes moving single levels where that improves the least-squares fit.
 * Returns the scale. (make_qp_quants.) */
static float fit_positive(int n, int nmax, const float *x, uint8_t *L, const float *qw) {
    float max = 0;
    for (int i = 0; i < n; i++) max = max > x[i] ? max : x[i];
    if (max < TINY) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = nmax / max;
    for (int i = 0; i < n; i++) L[i] = (uint8_t)round_int(iscale * x[i]);
    float scale = 1 / iscale, best_mse = 0;
    for (int i = 0; i < n; i++) {
        float diff = x[i] - scale * L[i];
        best_mse += qw[i] * diff * diff;
    }
    for (int step = -4; step <= 4; step++) {
        if (step == 0) continue;
        float iscale_step = (0.1f * step + nmax) / max, scale_step = 1 / iscale_step, mse = 0;
        for (int i = 0; i < n; i++) {
            int l = round_int(iscale_step * x[i]);
            l = l < nmax ? l : nmax;
            float diff = x[i] - scale_step * l;
            mse += qw[i] * diff * diff;
        }
        if (mse < best_mse) {
            best_mse = mse;
            iscale = iscale_step;
        }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = round_int(iscale * x[i]);
        l = l < nmax ? l : nmax;
        L[i] = (uint8_t)l;
        sumlx += qw[i] * x[i] * l;
        suml2 += qw[i] * l * l;
    }
    for (int pass = 0; pass < 5; pass++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float w = qw[i], slx = sumlx - w * x[i] * L[i], sl2 = suml2 - w * L[i] * L[i];
            if (!(slx > 0 && sl2 > 0)) continue;
            int l = round_int(x[i] * sl2 / slx);
            l = l < nmax ? l : nmax;
            if (l == L[i]) continue;
            slx += w * x[i] * l;
            sl2 += w * l * l;
            if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (uint8_t)l;
                sumlx = slx;
                suml2 = sl2;
                changed++;
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

static inline float sum_squares(int64_t n, const float *x) {
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

/* weight[i] = qw[i] * sqrt(sigma2 + x[i]^2), and their sum. */
static inline float importance(int n, const float *x, const float *qw, float sigma2, float *weight) {
    float sum = 0;
    for (int i = 0; i < n; i++) weight[i] = qw[i] * sqrtf(sigma2 + x[i] * x[i]);
    for (int i = 0; i < n; i++) sum += weight[i];
    return sum;
}

static void q2_k_weighted_scales(uint8_t *y, const float *fits, const float *mins, const float *sw);

/* Q2_K: sub-block scales and minimums by fit_affine under the weights (squared error), their 4-bit
 * codes by fit_positive. */
static void quantize_q2_k_weighted(const float *x, uint8_t *y, const float *qw) {
    uint8_t L[SUPER];
    float mins[16], fits[16], sw[16], weight[16];
    const float sigma2 = sum_squares(SUPER, x) / SUPER;
    for (int j = 0; j < 16; j++) {
        sw[j] = importance(16, x + 16 * j, qw + 16 * j, sigma2, weight);
        fits[j] = fit_affine(16, 3, x + 16 * j, weight, L + 16 * j, &mins[j], -0.9f, 0.05f, 36, 0);
    }
    q2_k_weighted_scales(y, fits, mins, sw);
    q2_k_finish(x, y, L);
}

/* Q2_K's d, dmin and 4-bit codes under an importance matrix (sw: each sub-block's summed weights). */
static void q2_k_weighted_scales(uint8_t *y, const float *fits, const float *mins, const float *sw) {
    uint8_t Ls[16], Lm[16];
    put_half(y + 80, fit_positive(16, 15, fits, Ls, sw));
    put_half(y + 82, fit_positive(16, 15, mins, Lm, sw));
    for (int j = 0; j < 16; j++) y[j] = (uint8_t)(Ls[j] | Lm[j] << 4);
}

static void q3_k_weighted_scales(uint8_t *y, const float *fits, const float *sw);

/* Q3_K: sub-block scales by fit_signed under the weights, their 6-bit codes by fit_signed under
 * the sub-blocks' summed weights. */
static void quantize_q3_k_weighted(const float *x, uint8_t *y, const float *qw) {
    int8_t L[SUPER];
    float fits[16], sw[16], weight[16];
    const float sigma2 = 2 * sum_squares(SUPER, x) / SUPER;
    for (int j = 0; j < 16; j++) {
        sw[j] = importance(16, x + 16 * j, qw + 16 * j, sigma2, weight);
        fits[j] = fit_signed(16, 4, x + 16 * j, weight, L + 16 * j);
    }
    q3_k_weighted_scales(y, fits, sw);
    q3_k_finish(x, y, L);
}

static void q3_k_weighted_scales(uint8_t *y, const float *fits, const float *sw) {
    int8_t Ls[16];
    uint8_t *scales = y + 96;
    memset(scales, 0, 12);
    float d_block = fit_signed(16, 32, fits, sw, Ls);
    for (int j = 0; j < 16; j++) {
        int l = Ls[j];
        if (j < 8) scales[j] = (uint8_t)(l & 0xF);
        else scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
        scales[j % 4 + 8] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
    }
    put_half(y + 108, d_block);
}

static void qk_affine_weighted_scales(uint8_t *y, const float *fits, const float *mins, const float *sw, int five);

/* Q4_K, Q5_K: sub-block scales and minimums by fit_affine under the weights (squared error),
 * their 6-bit codes by fit_positive. */
static void quantize_qk_affine_weighted(const float *x, uint8_t *y, const float *qw, int five) {
    uint8_t L[SUPER];
    float mins[8], fits[8], sw[8], weight[32];
    const float sigma2 = 2 * sum_squares(SUPER, x) / SUPER;
    for (int j = 0; j < 8; j++) {
        sw[j] = importance(32, x + 32 * j, qw + 32 * j, sigma2, weight);
        fits[j] = fit_affine(32, five ? 31 : 15, x + 32 * j, weight, L + 32 * j, &mins[j], -0.9f, 0.05f, 36, 0);
    }
    qk_affine_weighted_scales(y, fits, mins, sw, five);
    qk_affine_finish(x, y, L, five);
}

/* Q4_K/Q5_K's d, dmin and scale codes under an importance matrix (sw: each sub-block's summed weights). */
static void qk_affine_weighted_scales(uint8_t *y, const float *fits, const float *mins, const float *sw, int five) {
    uint8_t Ls[8], Lm[8];
    float d_block = fit_positive(8, 63, fits, Ls, sw), m_block = fit_positive(8, 63, mins, Lm, sw);
    for (int j = 0; j < 8; j++) {
        uint8_t ls = Ls[j], lm = Lm[j];
        if (five) {                             /* Q5_K clips the codes, Q4_K stores them as they are */
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
        }
        if (j < 4) {
            y[4 + j] = ls;
            y[4 + j + 4] = lm;
        } else {
            y[4 + j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            y[4 + j - 4] |= (uint8_t)((ls >> 4) << 6);
            y[4 + j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    put_half(y, d_block);
    put_half(y + 2, m_block);
}

static void quantize_q4_k_weighted(const float *x, uint8_t *y, const float *qw) { quantize_qk_affine_weighted(x, y, qw, 0); }
static void quantize_q5_k_weighted(const float *x, uint8_t *y, const float *qw) { quantize_qk_affine_weighted(x, y, qw, 1); }

/* ---- IQ4_NL (18 bytes: d, 16 nibble bytes) and IQ4_XS (136 bytes: d, scales_h u16, scales_l[4],
 * qs[128]): 4-bit indices into a fixed table of 16 levels (kvalues_iq4nl), blocks of 32; IQ4_XS
 * gives each of its 8 blocks a 6-bit scale under one fp16 d. ---- */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Index of the level nearest x: a binary search on the midpoints, compared doubled to stay exact
 * (the first of two equally near). (best_index_int8.) */
static inline int nearest_level(float x) {
    const float x2 = x + x;
    int idx = 0;
    for (int step = 8; step > 0; step >>= 1) {
        const int j = idx + step;
        idx = x2 >= (float)(IQ4_LEVELS[j - 1] + IQ4_LEVELS[j]) ? j : idx;
    }
    return idx;
}

/* One IQ4 super-block of `n` values (32 for IQ4_NL, 256 for IQ4_XS): per block of 32, the scale of
 * best weighted fit among the largest value's level and 15 nearby ones (ntry 7, as ggml_quantize_chunk
 * runs it); weights from qw as above, or x*x. (quantize_row_iq4_nl_impl.) */
static void iq4_super_block(int n, const float *x, const float *qw, uint8_t *dh, uint8_t *q4,
                            uint8_t *scales_h, uint8_t *scales_l) {
    uint8_t L[SUPER];
    float scales[SUPER / 32], weight[32];
    float sigma2 = sum_squares(n, x);
    sigma2 *= 2.f / n;
    memset(q4, 0, (size_t)n / 2);
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < n / 32; ib++) {
        const float *xb = x + 32 * ib;
        uint8_t *Lb = L + 32 * ib;
        if (qw) {
            for (int j = 0; j < 32; j++) weight[j] = qw[32 * ib + j] * sqrtf(sigma2 + xb[j] * xb[j]);
        } else {
            for (int j = 0; j < 32; j++) weight[j] = xb[j] * xb[j];
        }
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++) {
            float ax = fabsf(xb[j]);
            if (ax > amax) { amax = ax; max = xb[j]; }
        }
        if (amax < TINY) {
            scales[ib] = 0;
            continue;
        }
        float d = -max / IQ4_LEVELS[0], id = 1 / d, sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; j++) {
            int l = nearest_level(id * xb[j]);
            Lb[j] = (uint8_t)l;
            float q = IQ4_LEVELS[l], w = weight[j];
            sumqx += w * q * xb[j];
            sumq2 += w * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        float best = d * sumqx;
        for (int step = -7; step <= 7; step++) {
            id = (step + IQ4_LEVELS[0]) / max;
            sumqx = sumq2 = 0;
            for (int j = 0; j < 32; j++) {
                float q = IQ4_LEVELS[nearest_level(id * xb[j])], w = weight[j];
                sumqx += w * q * xb[j];
                sumq2 += w * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        if (fabsf(d) > amax_scale) { amax_scale = fabsf(d); max_scale = d; }
    }
    if (n > 32) {                               /* IQ4_XS: 6-bit scales under d = -max_scale / 32 */
        uint16_t high = 0;
        float d = -max_scale / 32, id = d ? 1 / d : 0.f;
        put_half(dh, d);
        for (int ib = 0; ib < n / 32; ib++) {
            int l = clamp_int(round_int(id * scales[ib]), -32, 31);
            float dl = d * l, idl = dl ? 1 / dl : 0.f;
            for (int j = 0; j < 32; j++) L[32 * ib + j] = (uint8_t)nearest_level(idl * x[32 * ib + j]);
            l += 32;
            if (ib % 2 == 0) scales_l[ib / 2] = (uint8_t)(l & 0xF);
            else scales_l[ib / 2] |= (uint8_t)((l & 0xF) << 4);
            high |= (uint16_t)((l >> 4) << (2 * (ib % 8)));
        }
        scales_h[0] = (uint8_t)high;
        scales_h[1] = (uint8_t)(high >> 8);
    } else {                                    /* IQ4_NL: the block's own scale in fp16 */
        put_half(dh, scales[0]);
        float id = scales[0] ? 1 / scales[0] : 0;
        for (int j = 0; j < 32; j++) L[j] = (uint8_t)nearest_level(id * x[j]);
    }
    for (int i = 0; i < n / 32; i++)
        for (int j = 0; j < 16; j++) q4[16 * i + j] = (uint8_t)(L[32 * i + j] | L[32 * i + 16 + j] << 4);
}

static void quantize_iq4_nl_weighted(const float *x, uint8_t *y, const float *qw) {
    iq4_super_block(32, x, qw, y, y + 2, NULL, NULL);
}
static void quantize_iq4_xs_weighted(const float *x, uint8_t *y, const float *qw) {
    iq4_super_block(SUPER, x, qw, y, y + 8, y + 2, y + 4);
}
static void quantize_iq4_nl(const float *x, uint8_t *y) { quantize_iq4_nl_weighted(x, y, NULL); }
static void quantize_iq4_xs(const float *x, uint8_t *y) { quantize_iq4_xs_weighted(x, y, NULL); }

static void dequantize_iq4_nl(const uint8_t *b, float *y) {
    const float d = half_value(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * IQ4_LEVELS[b[2 + j] & 0xF];
        y[j + 16] = d * IQ4_LEVELS[b[2 + j] >> 4];
    }
}

static void dequantize_iq4_xs(const uint8_t *b, float *y) {
    const float d = half_value(b);
    const unsigned scales_h = (unsigned)(b[2] | b[3] << 8);
    const uint8_t *qs = b + 8;
    for (int ib = 0; ib < 8; ib++, y += 32, qs += 16) {
        const int ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4);
        const float dl = d * (ls - 32);
        for (int j = 0; j < 16; j++) {
            y[j] = dl * IQ4_LEVELS[qs[j] & 0xF];
            y[j + 16] = dl * IQ4_LEVELS[qs[j] >> 4];
        }
    }
}

/* ---- The 32-weight types under an importance matrix: sigma2 is the mean square of the whole row,
 * so these take a row at a time. ---- */

/* Q4_0 (d, 16 nibble bytes) and Q5_0 (d, qh u32, 16 nibble bytes): symmetric, fit_signed. */
static void quantize_row_symmetric_weighted(const float *x, uint8_t *y, int64_t n, const float *qw, int five) {
    const int size = five ? 22 : 18, nmax = five ? 16 : 8;
    const float sigma2 = sum_squares(n, x) / n;
    float weight[32];
    int8_t L[32];
    for (int64_t ib = 0; ib < n / 32; ib++, y += size) {
        const float *xb = x + 32 * ib;
        for (int j = 0; j < 32; j++) weight[j] = qw[32 * ib + j] * sqrtf(sigma2 + xb[j] * xb[j]);
        put_half(y, fit_signed(32, nmax, xb, weight, L));
        uint8_t *qs = y + (five ? 6 : 2);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            const uint8_t lo = (uint8_t)L[j], hi = (uint8_t)L[j + 16];
            qs[j] = (uint8_t)((lo & 0xF) | (hi & 0xF) << 4);
            qh |= (uint32_t)((lo & 0x10u) >> 4) << j;
            qh |= (uint32_t)((hi & 0x10u) >> 4) << (j + 16);
        }
        if (five) for (int k = 0; k < 4; k++) y[2 + k] = (uint8_t)(qh >> (8 * k));
    }
}

/* Q4_1 (d, m, 16 nibble bytes) and Q5_1 (d, m, qh u32, 16 nibble bytes): fit_affine. */
static void quantize_row_affine_weighted(const float *x, uint8_t *y, int64_t n, const float *qw, int five) {
    const int size = five ? 24 : 20;
    const float sigma2 = sum_squares(n, x) / n;
    float weight[32], neg_min;
    uint8_t L[32];
    for (int64_t ib = 0; ib < n / 32; ib++, y += size) {
        const float *xb = x + 32 * ib;
        for (int j = 0; j < 32; j++) weight[j] = qw[32 * ib + j] * sqrtf(sigma2 + xb[j] * xb[j]);
        float d = fit_affine(32, five ? 31 : 15, xb, weight, L, &neg_min, -0.9f, 0.05f, 36, 0);
        put_half(y, d);
        put_half(y + 2, -neg_min);
        uint8_t *qs = y + (five ? 8 : 4);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            qs[j] = (uint8_t)((L[j] & 0xF) | (L[j + 16] & 0xF) << 4);
            qh |= (uint32_t)((L[j] & 0x10u) >> 4) << j;
            qh |= (uint32_t)((L[j + 16] & 0x10u) >> 4) << (j + 16);
        }
        if (five) for (int k = 0; k < 4; k++) y[4 + k] = (uint8_t)(qh >> (8 * k));
    }
}

static void row_q4_0(const float *x, uint8_t *y, int64_t n, const float *qw) { quantize_row_symmetric_weighted(x, y, n, qw, 0); }
static void row_q5_0(const float *x, uint8_t *y, int64_t n, const float *qw) { quantize_row_symmetric_weighted(x, y, n, qw, 1); }
static void row_q4_1(const float *x, uint8_t *y, int64_t n, const float *qw) { quantize_row_affine_weighted(x, y, n, qw, 0); }
static void row_q5_1(const float *x, uint8_t *y, int64_t n, const float *qw) { quantize_row_affine_weighted(x, y, n, qw, 1); }

typedef void (*row_quantize_t)(const float *, uint8_t *, int64_t, const float *);

/* Name, bytes per block of 32, quantizer of whole rows under weights. */
static const struct { const char *name; int type_size; row_quantize_t quantize; } WTYPES[] = {
    {"q4_0", 18, row_q4_0}, {"q4_1", 20, row_q4_1}, {"q5_0", 22, row_q5_0}, {"q5_1", 24, row_q5_1},
};
