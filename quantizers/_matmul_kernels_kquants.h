/* Kernels of _matmul_kernels.c for the GGUF types beyond q8_0/q4_0, included once per instruction set with
 *   KNAME(name)  the function names' suffix      KTARGET  the target attribute (empty for the portable build)
 *   KSIMD        1: AVX2 intrinsics (vpmaddubsw + vpmaddwd); 0: portable C
 *
 * Each weight row is first unpacked, once per call, into a small buffer of integer levels and integer
 * scales (the block layouts on disk: quantizers/_gguf_kernels_kquants.h and _gguf_kernels_generic.h);
 * that row then takes an integer dot product with every activation row, so at batch > 1 the unpacking
 * is paid once per weight, and at batch 1 the row never leaves L1.
 *
 * K types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: super-blocks of 256): activations as llama.cpp's q8_K,
 * int8 levels in blocks of 256 with one float scale and the sum of each 16 levels. A super-block
 * unpacks to levels u (0..63; IQ4_XS: signed table values), a scale s_j and a minimum m_j per 16
 * levels, and two floats d, dmin, with w = d * s_j * u - dmin * m_j: an offset level (Q6_K's u - 32,
 * Q3_K's u - 4) joins the minimum (m_j = 32 s_j, dmin = d). Then
 *     sum_k w_k x_k = dx * (d * sum_j s_j (u . xq)_j - dmin * sum_j m_j bsum_j)
 * with every inner sum an exact integer.
 *
 * Legacy types (Q4_1, Q5_0, Q5_1, IQ4_NL: blocks of 32): the q8_0 activations of _matmul_kernels.c
 * (scale and level sum per 32). A block unpacks to signed levels q and floats d, m with w = d q + m:
 *     sum_k w_k x_k = dx * (d * (q . xq) + m * xsum).
 */

#ifndef MODELKIT_KQUANTS_COMMON
#define MODELKIT_KQUANTS_COMMON

#define QKK 256                     /* weights per K super-block, activations per q8_K scale */

static const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int is_k_format(int fmt) { return fmt >= F_Q2_K; }

/* Bytes per block and weights per block of each format above F_I4. */
static inline Py_ssize_t more_block_bytes(int fmt) {
    switch (fmt) {
    case F_Q4_1: return 20;
    case F_Q5_0: return 22;
    case F_Q5_1: return 24;
    case F_IQ4_NL: return 18;
    case F_Q2_K: return 84;
    case F_Q3_K: return 110;
    case F_Q4_K: return 144;
    case F_Q5_K: return 176;
    case F_Q6_K: return 210;
    default: return 136;            /* F_IQ4_XS */
    }
}

/* One K super-block unpacked. scx holds each 16-level scale eight times (the int16 lanes of vpmaddwd). */
typedef struct {
    uint8_t q[QKK];                 /* levels (IQ4_XS: int8 table values) */
    int16_t scx[QKK / 2];           /* scx[8 j + i] = s_j */
    int16_t mn[QKK / 16];
    float d, dmin;
} ksuper_t;

/* One legacy block unpacked. */
typedef struct {
    int8_t q[QK];
    float d, m;
} lblock_t;

static inline void put_scales(ksuper_t *o, int j, int scale, int minimum) {
    for (int i = 0; i < 8; i++) o->scx[8 * j + i] = (int16_t)scale;
    o->mn[j] = (int16_t)minimum;
}

/* Q4_K/Q5_K's 12 scale bytes: the 6-bit scale and minimum of 32-level group j. */
static inline void kq_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K (144 B: d, dmin, 12 scale bytes, 128 nibble bytes), Q5_K (176 B: the same with 32 fifth-bit
 * bytes before the nibbles): 64 weights per 32 nibble bytes, low nibbles first. */
static inline void unpack_qk_affine(const uint8_t *b, ksuper_t *o, int five) {
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = five ? b + 48 : b + 16;
    o->d = half_to_float(read_u16(b));
    o->dmin = half_to_float(read_u16(b + 2));
    for (int c = 0; c < 4; c++, ql += 32) {
        int sc, m;
        uint8_t *q = o->q + 64 * c;
        kq_scale_min(2 * c, scales, &sc, &m);
        put_scales(o, 4 * c, sc, m);
        put_scales(o, 4 * c + 1, sc, m);
        kq_scale_min(2 * c + 1, scales, &sc, &m);
        put_scales(o, 4 * c + 2, sc, m);
        put_scales(o, 4 * c + 3, sc, m);
        if (five) {
            for (int l = 0; l < 32; l++) {
                q[l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] >> (2 * c)) & 1) << 4);
                q[l + 32] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> (2 * c + 1)) & 1) << 4);
            }
        } else {
            for (int l = 0; l < 32; l++) {
                q[l] = ql[l] & 0xF;
                q[l + 32] = ql[l] >> 4;
            }
        }
    }
}

/* Q6_K (210 B: 128 low-nibble bytes, 64 bytes of 2-bit highs, 16 int8 scales, d). Value 128 n + 32 g + l:
 * nibble of ql[64 n + l + 32 (g & 1)] (high nibble for g >= 2), bits 2g of qh[32 n + l]; scale 8 n + 2 g + l / 16. */
static inline void unpack_q6_k(const uint8_t *b, ksuper_t *o) {
    const int8_t *sc = (const int8_t *)(b + 192);
    o->d = o->dmin = half_to_float(read_u16(b + 208));
    for (int j = 0; j < 16; j++) put_scales(o, j, sc[j], 32 * sc[j]);
    for (int n = 0; n < 2; n++) {
        const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        uint8_t *q = o->q + 128 * n;
        for (int l = 0; l < 32; l++) {
            q[l] = (uint8_t)((ql[l] & 0xF) | (qh[l] & 3) << 4);
            q[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
    }
}

/* Q2_K (84 B: 16 scale bytes (low nibble scale, high nibble minimum), 64 bytes of 2-bit levels, d, dmin)
 * and Q3_K (110 B: 32 bytes of third bits, 64 bytes of 2-bit levels, 12 bytes of sixteen 6-bit scales, d).
 * Value 128 n + 32 s + 16 h + l: bits 2s of byte 32 n + 16 h + l; 16-level group 8 n + 2 s + h. */
static inline void unpack_q2_q3_k(const uint8_t *b, ksuper_t *o, int three) {
    const uint8_t *qs = three ? b + 32 : b + 16;
    if (three) {
        const uint8_t *s = b + 96;
        o->d = o->dmin = half_to_float(read_u16(b + 108));
        for (int j = 0; j < 16; j++) {
            int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            int scale = (low | high << 4) - 32;
            put_scales(o, j, scale, 4 * scale);
        }
    } else {
        o->d = half_to_float(read_u16(b + 80));
        o->dmin = half_to_float(read_u16(b + 82));
        for (int j = 0; j < 16; j++) put_scales(o, j, b[j] & 0xF, b[j] >> 4);
    }
    for (int n = 0; n < 2; n++)
        for (int s = 0; s < 4; s++) {
            uint8_t *q = o->q + 128 * n + 32 * s;
            const uint8_t *src = qs + 32 * n;
            for (int l = 0; l < 32; l++) q[l] = (src[l] >> (2 * s)) & 3;
            if (three) {                   /* third bit set: level + 4 (stored level - 4 + 4 offset) */
                const uint8_t *hm = b, bit = (uint8_t)(1u << (4 * n + s));
                for (int l = 0; l < 32; l++) q[l] = (uint8_t)(q[l] + ((hm[l] & bit) ? 4 : 0));
            }
        }
}

/* IQ4_XS (136 B: d, 16 bits of high scale bits, 4 bytes of low scale nibbles, 128 index bytes):
 * block of 32 ib: scale ((low nibble ib) | (2 high bits ib) << 4) - 32, indices low nibbles then high. */
static inline void unpack_iq4_xs(const uint8_t *b, ksuper_t *o) {
    uint16_t high = read_u16(b + 2);
    o->d = half_to_float(read_u16(b));
    o->dmin = 0.0f;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4);
        put_scales(o, 2 * ib, ls - 32, 0);
        put_scales(o, 2 * ib + 1, ls - 32, 0);
        const uint8_t *qs = b + 8 + 16 * ib;
        int8_t *q = (int8_t *)o->q + 32 * ib;
        for (int l = 0; l < 16; l++) {
            q[l] = IQ4_TABLE[qs[l] & 0xF];
            q[l + 16] = IQ4_TABLE[qs[l] >> 4];
        }
    }
}

static inline void unpack_super(int fmt, const uint8_t *b, ksuper_t *o) {
    switch (fmt) {
    case F_Q2_K: unpack_q2_q3_k(b, o, 0); break;
    case F_Q3_K: unpack_q2_q3_k(b, o, 1); break;
    case F_Q4_K: unpack_qk_affine(b, o, 0); break;
    case F_Q5_K: unpack_qk_affine(b, o, 1); break;
    case F_Q6_K: unpack_q6_k(b, o); break;
    default: unpack_iq4_xs(b, o); break;
    }
}

/* Q4_1 (20 B: d, m, 16 nibble bytes), Q5_0 (22 B: d, 32 fifth bits, nibbles; w = d (q - 16)),
 * Q5_1 (24 B: d, m, fifth bits, nibbles), IQ4_NL (18 B: d, nibble indices into IQ4_TABLE):
 * weight l from the low nibble of byte l, weight l + 16 from its high nibble. */
static inline void unpack_legacy(int fmt, const uint8_t *b, lblock_t *o) {
    o->d = half_to_float(read_u16(b));
    o->m = fmt == F_Q4_1 || fmt == F_Q5_1 ? half_to_float(read_u16(b + 2)) : 0.0f;
    if (fmt == F_IQ4_NL) {
        for (int l = 0; l < 16; l++) {
            o->q[l] = IQ4_TABLE[b[2 + l] & 0xF];
            o->q[l + 16] = IQ4_TABLE[b[2 + l] >> 4];
        }
        return;
    }
    if (fmt == F_Q4_1) {
        for (int l = 0; l < 16; l++) {
            o->q[l] = (int8_t)(b[4 + l] & 0xF);
            o->q[l + 16] = (int8_t)(b[4 + l] >> 4);
        }
        return;
    }
    const uint8_t *qh = fmt == F_Q5_0 ? b + 2 : b + 4, *qs = qh + 4;
    uint32_t bits = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
    int offset = fmt == F_Q5_0 ? 16 : 0;
    for (int l = 0; l < 16; l++) {
        o->q[l] = (int8_t)(((qs[l] & 0xF) | ((bits >> l) & 1) << 4) - offset);
        o->q[l + 16] = (int8_t)(((qs[l] >> 4) | ((bits >> (l + 16)) & 1) << 4) - offset);
    }
}

/* Activations as q8_K: (M, K) int8 levels, a float scale per 256, the sum of each 16 levels (int16). */
static void quantize_q8_k(const float *x, Py_ssize_t M, Py_ssize_t K, int8_t *q, float *d, int16_t *bsums) {
    for (Py_ssize_t m = 0; m < M; m++)
        for (Py_ssize_t b = 0; b < K / QKK; b++) {
            const float *src = x + m * K + b * QKK;
            int8_t *dst = q + m * K + b * QKK;
            float amax = 0.0f;
            for (int k = 0; k < QKK; k++) amax = fmaxf(amax, fabsf(src[k]));
            float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int k = 0; k < QKK; k++) {      /* |x| * inverse <= 127: round half to even by the 2**23 trick */
                float v = (src[k] * inverse + 12582912.0f) - 12582912.0f;
                dst[k] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
            for (int j = 0; j < QKK / 16; j++) {
                int sum = 0;
                for (int k = 0; k < 16; k++) sum += dst[16 * j + k];
                bsums[(m * K + b * QKK) / 16 + j] = (int16_t)sum;
            }
            d[m * (K / QKK) + b] = amax / 127.0f;
        }
}

#endif /* MODELKIT_KQUANTS_COMMON */

/* ---- per instruction set: the dot products and the row loop ---------------------------------- */

/* One unpacked row of nsb K super-blocks against activation row (xq, xd, xb). */
KTARGET static inline float KNAME(kdot)(const int signed_levels, const ksuper_t *w, Py_ssize_t nsb, const int8_t *xq,
                                        const float *xd, const int16_t *xb) {
#if KSIMD
    __m256 acc = _mm256_setzero_ps();
    for (Py_ssize_t sb = 0; sb < nsb; sb++, w++, xq += QKK, xb += 16) {
        __m256i isum = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            __m256i u = _mm256_loadu_si256((const __m256i *)(w->q + 32 * c));
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * c));
            __m256i p = signed_levels ? _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(x, u))
                                      : _mm256_maddubs_epi16(u, x);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_loadu_si256((const __m256i *)(w->scx + 16 * c))));
        }
        float dx = xd[sb];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w->d * dx), acc);
        if (!signed_levels) {
            __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)w->mn),
                                             _mm256_loadu_si256((const __m256i *)xb));
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(w->dmin * dx), acc);
        }
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
#else
    float acc = 0.0f;
    for (Py_ssize_t sb = 0; sb < nsb; sb++, w++, xq += QKK, xb += 16) {
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 16; j++) {
            int32_t dot = 0;
            for (int k = 16 * j; k < 16 * j + 16; k++)
                dot += (signed_levels ? (int)(int8_t)w->q[k] : (int)w->q[k]) * xq[k];
            isum += w->scx[8 * j] * dot;
            msum += w->mn[j] * xb[j];
        }
        acc += xd[sb] * (w->d * (float)isum - w->dmin * (float)msum);
    }
    return acc;
#endif
}

/* One unpacked row of nb legacy blocks against activation row (xq, xd, xs). */
KTARGET static inline float KNAME(ldot)(const lblock_t *w, Py_ssize_t nb, const int8_t *xq, const float *xd,
                                        const float *xs) {
#if KSIMD
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    float offsets = 0.0f;
    for (Py_ssize_t b = 0; b < nb; b++, w++, xq += QK) {
        __m256i u = _mm256_loadu_si256((const __m256i *)w->q), x = _mm256_loadu_si256((const __m256i *)xq);
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(x, u)), ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(w->d * xd[b]), acc);
        offsets += w->m * xd[b] * xs[b];
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h) + offsets;
#else
    float acc = 0.0f;
    for (Py_ssize_t b = 0; b < nb; b++, w++, xq += QK) {
        int32_t dot = 0;
        for (int k = 0; k < QK; k++) dot += w->q[k] * xq[k];
        acc += xd[b] * (w->d * (float)dot + w->m * xs[b]);
    }
    return acc;
#endif
}

/* Rows [r0, r1) of a weight in one of the formats above F_I4: each row unpacked once, then dotted with
 * every activation row. `a`: q8_K activations (q, d, bsums) for the K types, q8_0 ones (q, d, s) else. */
KTARGET static void KNAME(more_rows)(const weight_t *w, const act_t *a, Py_ssize_t r0, Py_ssize_t r1) {
    const int fmt = w->fmt, k_type = is_k_format(fmt), signed_levels = fmt == F_IQ4_XS;
    const Py_ssize_t nblocks = k_type ? w->K / QKK : w->nb, block_bytes = more_block_bytes(fmt);
    void *buffer = malloc((size_t)nblocks * (k_type ? sizeof(ksuper_t) : sizeof(lblock_t)));
    if (buffer == NULL) {                 /* no memory for one row: NaN outputs rather than a crash */
        for (Py_ssize_t r = r0; r < r1; r++)
            for (Py_ssize_t m = 0; m < a->M; m++) a->y[m * w->N + r] = NAN;
        return;
    }
    for (Py_ssize_t r = r0; r < r1; r++) {
        const uint8_t *row = w->w + r * w->w_stride;
        float bias = w->bias ? w->bias[r] : 0.0f;
        if (k_type) {
            ksuper_t *unpacked = buffer;
            for (Py_ssize_t b = 0; b < nblocks; b++) unpack_super(fmt, row + b * block_bytes, unpacked + b);
            for (Py_ssize_t m = 0; m < a->M; m++)
                a->y[m * w->N + r] = bias + KNAME(kdot)(signed_levels, unpacked, nblocks, a->q + m * w->K,
                                                        a->d + m * nblocks, a->bsums + m * (w->K / 16));
        } else {
            lblock_t *unpacked = buffer;
            for (Py_ssize_t b = 0; b < nblocks; b++) unpack_legacy(fmt, row + b * block_bytes, unpacked + b);
            for (Py_ssize_t m = 0; m < a->M; m++)
                a->y[m * w->N + r] = bias + KNAME(ldot)(unpacked, nblocks, a->q + m * nblocks * QK, a->d + m * nblocks,
                                                        a->s + m * nblocks);
        }
    }
    free(buffer);
}
