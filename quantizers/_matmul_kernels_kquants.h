/* Kernels of _matmul_kernels.c for the GGUF types beyond q8_0/q4_0, included once per instruction set with
 *   KNAME(name)  the function names' suffix      KTARGET  the target attribute (empty for the portable build)
 *   KSIMD        1: AVX2 intrinsics (vpmaddubsw + vpmaddwd); 0: portable C
 *   KVNNI        with KSIMD: 1 where the target has VNNI (KDPBUSD, KDPWSSD: vpdpbusd, vpdpwssd on 256-bit
 *                registers), which fuse the multiply-adds and the sum that follows them; 0 (or undefined) else
 *
 * At up to FUSED_TOKENS activation rows the SIMD kernels take dot products on the stored K blocks (no
 * unpacking). Above, each weight row is first unpacked, once per call, into a small buffer of integer
 * levels and integer scales (the block layouts on disk: quantizers/_gguf_kernels_kquants.h and
 * _gguf_kernels_generic.h); that row then takes an integer dot product with every activation row, so the
 * unpacking is paid once per weight and the row never leaves L1.
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
 * Only the portable build unpacks them; the SIMD ones decode them (legacy_levels) in the 8-row tiles of
 * _matmul_kernels_x86.h, as q4_0 (zero 8; Q5_0's is 16, Q4_1/Q5_1 add m * dx * xsum, IQ4_NL is signed).
 */

#ifndef MODELKIT_KQUANTS_COMMON
#define MODELKIT_KQUANTS_COMMON

#define QKK 256                     /* weights per K super-block, activations per q8_K scale */
#define FUSED_TOKENS 3              /* up to this many activation rows, the AVX2 kernels skip the unpacked row */
#define WIDE_TOKENS 8               /* from this many activation rows, the VNNI kernels interleave eight rows (kwide) */

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

/* One legacy block unpacked: w = d q + m, q unsigned (0..31) except IQ4_NL's signed table values. */
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

/* The same 12 bytes at once, as four words of four bytes: sm[0..1] the eight scales, sm[2..3] the eight
 * minimums (kq_byte reads one). Kept in words: bytes stored one way and read back another would stall the
 * store forwarding of the dot products that use them. */
static inline void kq_scales_mins(const uint8_t *q, uint32_t *sm) {
    uint32_t word[3];
    memcpy(word, q, 12);
    sm[0] = word[0] & 0x3f3f3f3fu;                                          /* scales 0-3: low 6 bits of 0-3 */
    sm[1] = (word[2] & 0x0f0f0f0fu) | ((word[0] >> 6) & 0x03030303u) << 4;  /* scales 4-7 */
    sm[2] = word[1] & 0x3f3f3f3fu;                                          /* minimums 0-3 */
    sm[3] = ((word[2] >> 4) & 0x0f0f0f0fu) | ((word[1] >> 6) & 0x03030303u) << 4;
}

static inline int kq_byte(const uint32_t *sm, int i) { return (int)((sm[i >> 2] >> (8 * (i & 3))) & 0xff); }

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
/* Their d, dmin, minimums (o) and the 16 scales (scale). */
static inline void q2_q3_scales(const uint8_t *b, ksuper_t *o, int three, int *scale) {
    if (three) {
        const uint8_t *s = b + 96;
        o->d = o->dmin = half_to_float(read_u16(b + 108));
        for (int j = 0; j < 16; j++) {
            int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            scale[j] = (low | high << 4) - 32;
            o->mn[j] = (int16_t)(4 * scale[j]);
        }
    } else {
        o->d = half_to_float(read_u16(b + 80));
        o->dmin = half_to_float(read_u16(b + 82));
        for (int j = 0; j < 16; j++) {
            scale[j] = b[j] & 0xF;
            o->mn[j] = (int16_t)(b[j] >> 4);
        }
    }
}

static inline void unpack_q2_q3_k(const uint8_t *b, ksuper_t *o, int three) {
    const uint8_t *qs = three ? b + 32 : b + 16;
    int scale[16];
    q2_q3_scales(b, o, three, scale);
    for (int j = 0; j < 16; j++) put_scales(o, j, scale[j], o->mn[j]);
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
static inline int iq4_xs_scale(const uint8_t *b, int ib) {
    return (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((read_u16(b + 2) >> (2 * ib)) & 3) << 4)) - 32;
}

static inline void unpack_iq4_xs(const uint8_t *b, ksuper_t *o) {
    o->d = half_to_float(read_u16(b));
    o->dmin = 0.0f;
    for (int ib = 0; ib < 8; ib++) {
        put_scales(o, 2 * ib, iq4_xs_scale(b, ib), 0);
        put_scales(o, 2 * ib + 1, iq4_xs_scale(b, ib), 0);
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
    o->m = fmt == F_Q4_1 || fmt == F_Q5_1 ? half_to_float(read_u16(b + 2)) : fmt == F_Q5_0 ? -16.0f * o->d : 0.0f;
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
    for (int l = 0; l < 16; l++) {                 /* Q5_0's - 16 is in m */
        o->q[l] = (int8_t)((qs[l] & 0xF) | ((bits >> l) & 1) << 4);
        o->q[l + 16] = (int8_t)((qs[l] >> 4) | ((bits >> (l + 16)) & 1) << 4);
    }
}

/* Activations as q8_K: (M, K) int8 levels, a float scale per 256, the sum of each 16 levels (int16). */
static void quantize_q8_k_generic(const float *x, Py_ssize_t M, Py_ssize_t K, int8_t *q, float *d, int16_t *bsums) {
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

/* One unpacked row of nb legacy blocks against activation row (xq, xd, xs). Portable only: the SIMD kernels
 * read the legacy blocks in the 8-row tiles of _matmul_kernels_x86.h. */
static inline float ldot(const lblock_t *w, Py_ssize_t nb, const int8_t *xq, const float *xd, const float *xs) {
    float acc = 0.0f;
    for (Py_ssize_t b = 0; b < nb; b++, w++, xq += QK) {
        int32_t dot = 0;
        for (int k = 0; k < QK; k++) dot += w->q[k] * xq[k];
        acc += xd[b] * (w->d * (float)dot + w->m * xs[b]);
    }
    return acc;
}

#endif /* MODELKIT_KQUANTS_COMMON */

/* ---- per instruction set: the dot products and the row loop ---------------------------------- */

#if KSIMD
/* acc + the int32 pair sums of p * s (int16 lanes): vpdpwssd with VNNI, vpmaddwd + vpaddd else. */
KTARGET static inline __m256i KNAME(add_madd)(__m256i acc, __m256i p, __m256i s) {
#if KVNNI
    return KDPWSSD(acc, p, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

/* vpmaddubsw of levels u (signed_levels: int8, by |u| and x carrying u's sign; else unsigned) and x. */
KTARGET static inline __m256i KNAME(levels_times)(const int signed_levels, __m256i u, __m256i abs_u, __m256i x) {
    return signed_levels ? _mm256_maddubs_epi16(abs_u, _mm256_sign_epi8(x, u)) : _mm256_maddubs_epi16(u, x);
}
#endif

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
            __m256i p = KNAME(levels_times)(signed_levels, u, _mm256_abs_epi8(u), x);
            isum = KNAME(add_madd)(isum, p, _mm256_loadu_si256((const __m256i *)(w->scx + 16 * c)));
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


#if KSIMD
/* ---- AVX2 decoding of the stored blocks, shared by the fused dot products and the unpacking ------ */

KTARGET static inline float KNAME(hsum)(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* Q4_K/Q5_K: levels of values 64 c .. 64 c + 31 (lo) and 64 c + 32 .. 64 c + 63 (hi). */
KTARGET static inline void KNAME(qk_levels)(const uint8_t *b, int c, int five, __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    __m256i bits = _mm256_loadu_si256((const __m256i *)((five ? b + 48 : b + 16) + 32 * c));
    *lo = _mm256_and_si256(bits, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
    if (five) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        __m256i m_lo = _mm256_set1_epi8((char)(1 << (2 * c))), m_hi = _mm256_set1_epi8((char)(2 << (2 * c)));
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, m_lo), m_lo), fifth));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, m_hi), m_hi), fifth));
    }
}

/* Q6_K: levels 0..63 of values 128 n + 32 g .. + 31, g = 0..3. */
KTARGET static inline void KNAME(q6_levels)(const uint8_t *b, int n, __m256i *q) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t *ql = b + 64 * n;
    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(qh, _mm256_set1_epi8(48)));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), _mm256_set1_epi8(48)));
}

/* Q6_K: the int16 scales of values 128 n + 32 g .. + 31 (16 lanes: the first 16 values' scale, then the next's). */
KTARGET static inline __m256i KNAME(q6_scales)(const int8_t *sc, int n, int g) {
    int j = 8 * n + 2 * g;
    return _mm256_set_m128i(_mm_set1_epi16(sc[j + 1]), _mm_set1_epi16(sc[j]));
}

/* Q4_1/Q5_0/Q5_1: the 32 unsigned levels of a block; IQ4_NL: its 32 signed table values. */
KTARGET static inline __m256i KNAME(legacy_levels)(const int fmt, const uint8_t *b) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t *qs = fmt == F_IQ4_NL ? b + 2 : fmt == F_Q4_1 ? b + 4 : fmt == F_Q5_0 ? b + 6 : b + 8;
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
    if (fmt == F_IQ4_NL) {
        __m128i table = _mm_loadu_si128((const __m128i *)IQ4_TABLE);
        return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), u);
    }
    if (fmt == F_Q5_0 || fmt == F_Q5_1) {             /* byte l takes bit l of the 32 fifth bits */
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        uint32_t bits;
        memcpy(&bits, b + (fmt == F_Q5_0 ? 2 : 4), 4);
        __m256i spread_bits = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread_bits, bit), bit);
        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return u;
}

/* The unpacked form of unpack_super, from the decoders above. */
KTARGET static inline void KNAME(unpack_super)(const int fmt, const uint8_t *b, ksuper_t *o) {
    if (fmt == F_Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        o->d = o->dmin = _cvtsh_ss(read_u16(b + 208));
        _mm256_storeu_si256((__m256i *)o->mn, _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)), 5));
        for (int n = 0; n < 2; n++) {
            __m256i q[4];
            KNAME(q6_levels)(b, n, q);
            for (int g = 0; g < 4; g++) {
                _mm256_storeu_si256((__m256i *)(o->q + 128 * n + 32 * g), q[g]);
                _mm256_storeu_si256((__m256i *)(o->scx + 16 * (4 * n + g)), KNAME(q6_scales)(sc, n, g));
            }
        }
        return;
    }
    if (fmt == F_Q2_K || fmt == F_Q3_K) {
        const int three = fmt == F_Q3_K;
        const uint8_t *qs = three ? b + 32 : b + 16;
        int scale[16];
        q2_q3_scales(b, o, three, scale);
        __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        for (int n = 0; n < 2; n++) {
            __m256i src = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
            for (int c = 0; c < 4; c++) {               /* values 128 n + 32 c: bits 2c; groups 8 n + 2 c, + 1 */
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(src, 2 * c), _mm256_set1_epi8(3));
                if (three) {
                    __m256i bit = _mm256_set1_epi8((char)(1 << (4 * n + c)));
                    q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit),
                                                            _mm256_set1_epi8(4)));
                }
                int j = 8 * n + 2 * c;
                _mm256_storeu_si256((__m256i *)(o->q + 128 * n + 32 * c), q);
                _mm256_storeu_si256((__m256i *)(o->scx + 16 * (4 * n + c)),
                                    _mm256_set_m128i(_mm_set1_epi16((short)scale[j + 1]), _mm_set1_epi16((short)scale[j])));
            }
        }
        return;
    }
    if (fmt == F_IQ4_XS) {
        const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_TABLE);
        o->d = _cvtsh_ss(read_u16(b));
        o->dmin = 0.0f;
        _mm256_storeu_si256((__m256i *)o->mn, _mm256_setzero_si256());
        for (int ib = 0; ib < 8; ib++) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * ib));
            __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
            _mm256_storeu_si256((__m256i *)(o->q + 32 * ib), _mm256_shuffle_epi8(_mm256_set_m128i(table, table), idx));
            _mm256_storeu_si256((__m256i *)(o->scx + 16 * ib), _mm256_set1_epi16((short)iq4_xs_scale(b, ib)));
        }
        return;
    }
    uint32_t sm[4];
    kq_scales_mins(b + 4, sm);
    o->d = _cvtsh_ss(read_u16(b));
    o->dmin = _cvtsh_ss(read_u16(b + 2));
    __m128i mins = _mm_cvtsi64_si128((long long)((uint64_t)sm[3] << 32 | sm[2]));
    _mm256_storeu_si256((__m256i *)o->mn, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)));
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        KNAME(qk_levels)(b, c, fmt == F_Q5_K, &lo, &hi);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * c), lo);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * c + 32), hi);
        _mm256_storeu_si256((__m256i *)(o->scx + 32 * c), _mm256_set1_epi16((short)kq_byte(sm, 2 * c)));
        _mm256_storeu_si256((__m256i *)(o->scx + 32 * c + 16), _mm256_set1_epi16((short)kq_byte(sm, 2 * c + 1)));
    }
}

/* q8_K activations, as quantize_q8_k (cvtps2dq rounds half to even like its 2**23 trick). */
#if !KVNNI
KTARGET static void KNAME(quantize_q8_k)(const float *x, Py_ssize_t M, Py_ssize_t K, int8_t *q, float *d, int16_t *bsums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (Py_ssize_t m = 0; m < M; m++)
        for (Py_ssize_t b = 0; b < K / QKK; b++) {
            const float *src = x + m * K + b * QKK;
            int8_t *dst = q + m * K + b * QKK;
            __m256 big = _mm256_setzero_ps();
            for (int k = 0; k < QKK; k += 8) big = _mm256_max_ps(big, _mm256_and_ps(_mm256_loadu_ps(src + k), magnitude));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float amax = _mm_cvtss_f32(h);
            __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            for (int k = 0; k < QKK; k += 32) {
                __m256i i[4];
                for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + k + 8 * j), inverse));
                __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
                _mm256_storeu_si256((__m256i *)(dst + k), _mm256_permutevar8x32_epi32(packed, order));
            }
            d[m * (K / QKK) + b] = amax / 127.0f;
            for (int j = 0; j < QKK / 16; j++) {
                __m128i v = _mm_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(dst + 16 * j)));
                __m128i w = _mm_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(dst + 16 * j + 8)));
                __m128i s = _mm_madd_epi16(_mm_add_epi16(v, w), _mm_set1_epi16(1));
                s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
                s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
                bsums[(m * K + b * QKK) / 16 + j] = (int16_t)_mm_cvtsi128_si32(s);
            }
        }
}
#endif

/* ---- AVX2, few activation rows: dot products straight on the stored blocks (no unpacked row) ---- */

/* Q4_K / Q5_K row (nsb super-blocks) . q8_K row. */
KTARGET static float KNAME(fused_qk_affine)(const uint8_t *b, Py_ssize_t nsb, const int8_t *xq, const float *xd,
                                            const int16_t *xb, const int five) {
    __m256 acc = _mm256_setzero_ps();
    __m128 acc_min = _mm_setzero_ps();
    const Py_ssize_t block_bytes = five ? 176 : 144;
    for (Py_ssize_t sb = 0; sb < nsb; sb++, b += block_bytes, xq += QKK, xb += 16) {
        uint32_t sm[4];
        kq_scales_mins(b + 4, sm);
        float dx = xd[sb];
        __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)((uint64_t)sm[3] << 32 | sm[2])));
        __m128i pair_sums = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)xb), _mm_loadu_si128((const __m128i *)(xb + 8)));
        acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, pair_sums)), _mm_set1_ps(_cvtsh_ss(read_u16(b + 2)) * dx),
                               acc_min);
        __m256i isum = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            KNAME(qk_levels)(b, c, five, &lo, &hi);
            __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xq + 64 * c)));
            __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32)));
            isum = KNAME(add_madd)(isum, p_lo, _mm256_set1_epi16((short)kq_byte(sm, 2 * c)));
            isum = KNAME(add_madd)(isum, p_hi, _mm256_set1_epi16((short)kq_byte(sm, 2 * c + 1)));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(_cvtsh_ss(read_u16(b)) * dx), acc);
    }
    __m128 m = _mm_add_ps(acc_min, _mm_movehl_ps(acc_min, acc_min));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return KNAME(hsum)(acc) - _mm_cvtss_f32(m);
}

/* Q6_K row . q8_K row: levels 0..63 (the -32 comes off with 32 * the scaled 16-level sums). */
KTARGET static float KNAME(fused_q6_k)(const uint8_t *b, Py_ssize_t nsb, const int8_t *xq, const float *xd,
                                       const int16_t *xb) {
    __m256 acc = _mm256_setzero_ps();
    for (Py_ssize_t sb = 0; sb < nsb; sb++, b += 210, xq += QKK, xb += 16) {
        const int8_t *sc = (const int8_t *)(b + 192);
        __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i isum = _mm256_mullo_epi32(_mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i *)xb)),
                                          _mm256_set1_epi32(-32));
        for (int n = 0; n < 2; n++) {
            __m256i q[4];
            KNAME(q6_levels)(b, n, q);
            for (int g = 0; g < 4; g++) {
                __m256i p = _mm256_maddubs_epi16(q[g], _mm256_loadu_si256((const __m256i *)(xq + 128 * n + 32 * g)));
                isum = KNAME(add_madd)(isum, p, KNAME(q6_scales)(sc, n, g));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(_cvtsh_ss(read_u16(b + 208)) * xd[sb]), acc);
    }
    return KNAME(hsum)(acc);
}

/* Q3_K's sixteen 6-bit scales (12 bytes: words a0, a1, a2), each less 32, as q2_q3_scales: scales 4 i .. 4 i + 3
 * are the low nibbles of a0, a1 (i = 0, 1), then their high nibbles (i = 2, 3), with bits 2 i, 2 i + 1 of a2's
 * bytes on top. In registers: scalar stores read back as one vector would stall store forwarding. */
KTARGET static inline __m128i KNAME(q3_scales)(const uint8_t *s) {
    uint32_t a2;
    memcpy(&a2, s + 8, 4);
    __m128i a01 = _mm_loadl_epi64((const __m128i *)s);
    __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_unpacklo_epi64(a01, a01), _mm_setr_epi32(0, 0, 4, 4)),
                                _mm_set1_epi8(0x0f));
    __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)a2), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(high, 4)), _mm_set1_epi8(32));
}

/* Q2_K / Q3_K row . q8_K row. Levels u (Q2_K 0..3; Q3_K 0..7, the stored level + 4) with scale s_j per 16:
 * Q2_K: d sum_j s_j (u . x)_j - dmin sum_j m_j bsum_j; Q3_K: d (sum_j s_j (u . x)_j - 4 sum_j s_j bsum_j). */
KTARGET static inline float KNAME(fused_q2_q3_k)(const uint8_t *b, Py_ssize_t nsb, const int8_t *xq, const float *xd,
                                          const int16_t *xb, const int three) {
    const __m256i two_bits = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const Py_ssize_t block_bytes = three ? 110 : 84;
    __m256 acc = _mm256_setzero_ps();
    for (Py_ssize_t sb = 0; sb < nsb; sb++, b += block_bytes, xq += QKK, xb += 16) {
        const uint8_t *qs = three ? b + 32 : b + 16;
        __m128i scales;                                           /* s_j as 16 int8 */
        __m256i bsums = _mm256_loadu_si256((const __m256i *)xb), msum;
        float d = _cvtsh_ss(read_u16(three ? b + 108 : b + 80)), dx = xd[sb];
        if (three) {
            scales = KNAME(q3_scales)(b + 96);
            msum = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), bsums), 2);
        } else {
            __m128i packed = _mm_loadu_si128((const __m128i *)b);
            scales = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
            msum = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F))),
                                     bsums);
        }
        __m256i hm = three ? _mm256_loadu_si256((const __m256i *)b) : _mm256_setzero_si256();
        __m256i isum = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            __m256i src = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
            for (int s = 0; s < 4; s++) {                        /* values 128 n + 32 s: groups j, j + 1 */
                const int j = 8 * n + 2 * s;
                __m256i u = _mm256_and_si256(_mm256_srli_epi16(src, 2 * s), two_bits);
                if (three) {                                      /* bit 4 n + s of hm[l] -> 4 */
                    const int at = 4 * n + s;
                    __m256i moved = at >= 2 ? _mm256_srli_epi16(hm, at - 2) : _mm256_slli_epi16(hm, 2 - at);
                    u = _mm256_or_si256(u, _mm256_and_si256(moved, four));
                }
                __m128i pick = _mm_set_epi64x((long long)(0x0101010101010101ull * (uint64_t)(j + 1)),
                                              (long long)(0x0101010101010101ull * (uint64_t)j));
                __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)(xq + 128 * n + 32 * s)));
                isum = KNAME(add_madd)(isum, p, _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick)));
            }
        }
        if (three) {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, msum)), _mm256_set1_ps(d * dx), acc);
        } else {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * dx), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(_cvtsh_ss(read_u16(b + 82)) * dx), acc);
        }
    }
    return KNAME(hsum)(acc);
}

/* IQ4_XS row . q8_K row: signed table values (sign trick), one scale per 32. */
KTARGET static float KNAME(fused_iq4_xs)(const uint8_t *b, Py_ssize_t nsb, const int8_t *xq, const float *xd) {
    const __m128i table128 = _mm_loadu_si128((const __m128i *)IQ4_TABLE);
    const __m256i table = _mm256_set_m128i(table128, table128), low4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    for (Py_ssize_t sb = 0; sb < nsb; sb++, b += 136, xq += QKK) {
        __m256i isum = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * ib));
            __m256i u = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4));
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * ib));
            isum = KNAME(add_madd)(isum, KNAME(levels_times)(1, u, _mm256_abs_epi8(u), x),
                                   _mm256_set1_epi16((short)iq4_xs_scale(b, ib)));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(_cvtsh_ss(read_u16(b)) * xd[sb]), acc);
    }
    return KNAME(hsum)(acc);
}

/* ---- AVX2, more activation rows: two unpacked rows against four activation rows at once ---------- */

/* K rows w[0], w[1] . q8_K rows t = 0..3 (levels xq + t K, scales xd + t nsb, sums xb + t K / 16): out[4 i + t]. */
KTARGET __attribute__((always_inline)) static inline void KNAME(ktile)(const int signed_levels, const ksuper_t *const *w, Py_ssize_t nsb, Py_ssize_t K,
                                 const int8_t *xq, const float *xd, const int16_t *xb, float *out) {
    __m256 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    for (Py_ssize_t sb = 0; sb < nsb; sb++) {
        const ksuper_t *w0 = w[0] + sb, *w1 = w[1] + sb;
        const int8_t *x0 = xq + sb * QKK;
        __m256i isum[8];
        for (int k = 0; k < 8; k++) isum[k] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            __m256i u0 = _mm256_loadu_si256((const __m256i *)(w0->q + 32 * c));
            __m256i u1 = _mm256_loadu_si256((const __m256i *)(w1->q + 32 * c));
            __m256i s0 = _mm256_loadu_si256((const __m256i *)(w0->scx + 16 * c));
            __m256i s1 = _mm256_loadu_si256((const __m256i *)(w1->scx + 16 * c));
            __m256i a0 = signed_levels ? _mm256_abs_epi8(u0) : u0, a1 = signed_levels ? _mm256_abs_epi8(u1) : u1;
            for (int t = 0; t < 4; t++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(x0 + t * K + 32 * c));
                isum[t] = KNAME(add_madd)(isum[t], KNAME(levels_times)(signed_levels, u0, a0, x), s0);
                isum[4 + t] = KNAME(add_madd)(isum[4 + t], KNAME(levels_times)(signed_levels, u1, a1, x), s1);
            }
        }
        for (int i = 0; i < 2; i++) {
            const ksuper_t *ws = i ? w1 : w0;
            __m256i mn = _mm256_loadu_si256((const __m256i *)ws->mn);
            for (int t = 0; t < 4; t++) {
                float dx = xd[t * nsb + sb];
                __m256i msum = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)(xb + t * (K / 16) + 16 * sb)));
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[4 * i + t]), _mm256_set1_ps(ws->d * dx), acc[4 * i + t]);
                acc[4 * i + t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(ws->dmin * dx), a);
            }
        }
    }
    for (int k = 0; k < 8; k++) out[k] = KNAME(hsum)(acc[k]);
}

#if KVNNI
/* ---- VNNI, more activation rows: eight rows interleaved once, then vpdpbusd on broadcast activations -----
 * A tile of eight weight rows is unpacked once per call into kwide_t super-blocks whose level vectors hold,
 * in lane i, four consecutive levels of row i (transpose8 of _matmul_kernels_x86.h): one vpdpbusd then takes
 * four activations of one token, broadcast, against all eight rows, and sums them into the rows' lanes with
 * no reduction afterwards (as tile_wide does for the blocks of 32, but transposed once per call, not once per
 * eight tokens). The levels are unsigned (IQ4_XS's signed table values + 128, the 128 joining the minimums as
 * Q6_K's 32 does), the scales per 16 or 32 levels multiply the groups' int32 sums (vpmulld), and the
 * minimums take the activations' 16-level sums in pairs (vpdpwssd). Every sum is exact, as in ktile. */
typedef struct {
    __m256i u[QKK / 4];             /* u[j]: lane i = row i's levels 4 j .. 4 j + 3 */
    __m256i s[QKK / 16];            /* s[g]: lane i = row i's scale of group g (16 or 32 levels: kwide_group) */
    __m256i mn[QKK / 32];           /* mn[p]: lane i = row i's minimums of 16-level groups 2 p, 2 p + 1 (int16) */
    __m256 d, dmin;
} KNAME(kwide_t);

/* Levels per scale group in kwide_t: Q4_K, Q5_K and IQ4_XS keep one scale per 32. */
static inline int KNAME(kwide_group)(int fmt) { return fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_IQ4_XS ? 32 : 16; }

/* Rows row[0..7] (nsb super-blocks each, `scratch`: eight ksuper_t) -> tile[0..nsb). */
KTARGET static void KNAME(kwide_unpack)(const int fmt, const uint8_t *const *row, Py_ssize_t nsb, ksuper_t *scratch,
                                        KNAME(kwide_t) *tile) {
    const int group = KNAME(kwide_group)(fmt), signed_levels = fmt == F_IQ4_XS;
    const Py_ssize_t block_bytes = more_block_bytes(fmt);
    for (Py_ssize_t sb = 0; sb < nsb; sb++) {
        KNAME(kwide_t) *t = tile + sb;
        for (int i = 0; i < ROWS; i++) KNAME(unpack_super)(fmt, row[i] + sb * block_bytes, scratch + i);
        for (int c = 0; c < QKK / 32; c++) {
            __m256i v[ROWS];
            for (int i = 0; i < ROWS; i++) {
                v[i] = _mm256_loadu_si256((const __m256i *)(scratch[i].q + 32 * c));
                if (signed_levels) v[i] = _mm256_xor_si256(v[i], _mm256_set1_epi8((char)0x80));
            }
            KNAME(transpose8)(v, t->u + 8 * c);
        }
        /* In registers: eight scalar stores read back as one vector would stall store forwarding. */
        for (int g = 0; g < QKK / group; g++) {
            const int at = 8 * (g * group / 16);
            t->s[g] = _mm256_setr_epi32(scratch[0].scx[at], scratch[1].scx[at], scratch[2].scx[at], scratch[3].scx[at],
                                        scratch[4].scx[at], scratch[5].scx[at], scratch[6].scx[at], scratch[7].scx[at]);
        }
        for (int p = 0; p < QKK / 32; p++) {
            int32_t pair[ROWS];
            for (int i = 0; i < ROWS; i++) {
                int m0 = scratch[i].mn[2 * p], m1 = scratch[i].mn[2 * p + 1];
                if (signed_levels) m0 = 128 * scratch[i].scx[16 * p], m1 = 128 * scratch[i].scx[16 * p + 8];
                pair[i] = (int32_t)((uint32_t)(uint16_t)m0 | (uint32_t)(uint16_t)m1 << 16);
            }
            t->mn[p] = _mm256_setr_epi32(pair[0], pair[1], pair[2], pair[3], pair[4], pair[5], pair[6], pair[7]);
        }
        const __m256 d = _mm256_setr_ps(scratch[0].d, scratch[1].d, scratch[2].d, scratch[3].d, scratch[4].d, scratch[5].d,
                                        scratch[6].d, scratch[7].d);
        t->d = d;
        t->dmin = signed_levels ? d : _mm256_setr_ps(scratch[0].dmin, scratch[1].dmin, scratch[2].dmin, scratch[3].dmin,
                                                     scratch[4].dmin, scratch[5].dmin, scratch[6].dmin, scratch[7].dmin);
    }
}

/* The tile's eight rows against T q8_K activation rows (levels xq + t K, scales xd + t nsb, sums xb + t K / 16):
 * out[t] lane i = row i . activation row t. */
KTARGET __attribute__((always_inline)) static inline void KNAME(kwide_tokens)(const int T, const int group,
        const KNAME(kwide_t) *tile, Py_ssize_t nsb, Py_ssize_t K, const int8_t *xq, const float *xd,
        const int16_t *xb, __m256 *out) {
    const int per_group = group / 4;
    for (int t = 0; t < T; t++) out[t] = _mm256_setzero_ps();
    for (Py_ssize_t sb = 0; sb < nsb; sb++) {
        const KNAME(kwide_t) *w = tile + sb;
        const int32_t *x = (const int32_t *)(xq + sb * QKK);
        __m256i isum[8];
        for (int t = 0; t < T; t++) isum[t] = _mm256_setzero_si256();
        for (int g = 0; g < QKK / group; g++) {
            const __m256i s = w->s[g];
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                __m256i p = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int j = 0; j < per_group; j++)
                    p = KDPBUSD(p, w->u[g * per_group + j], _mm256_set1_epi32(x[t * (K / 4) + g * per_group + j]));
                isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(p, s));
            }
        }
        for (int t = 0; t < T; t++) {
            const int32_t *bs = (const int32_t *)(xb + t * (K / 16) + 16 * sb);
            __m256i msum = _mm256_setzero_si256();
            for (int p = 0; p < QKK / 32; p++) msum = KDPWSSD(msum, w->mn[p], _mm256_set1_epi32(bs[p]));
            __m256 dx = _mm256_set1_ps(xd[t * nsb + sb]);
            out[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(w->d, dx), out[t]);
            out[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(w->dmin, dx), out[t]);
        }
    }
}

/* Rows [r0, r1) of a K-type weight against every activation row, eight rows at a time (the last tile's
 * missing rows repeat its last row and are not written). Returns 0 where it had no memory for a tile. */
KTARGET static int KNAME(kwide_rows)(const weight_t *w, const act_t *a, Py_ssize_t r0, Py_ssize_t r1) {
    const int fmt = w->fmt, group = KNAME(kwide_group)(fmt);
    const Py_ssize_t nsb = w->K / QKK, K = w->K;
    KNAME(kwide_t) *tile = _mm_malloc(sizeof(KNAME(kwide_t)) * (size_t)nsb, 32);
    ksuper_t *scratch = malloc(sizeof(ksuper_t) * ROWS);
    if (tile == NULL || scratch == NULL) {
        _mm_free(tile);
        free(scratch);
        return 0;
    }
    for (Py_ssize_t r = r0; r < r1; r += ROWS) {
        const int n = r1 - r < ROWS ? (int)(r1 - r) : ROWS;
        const uint8_t *row[ROWS];
        float bias[ROWS];
        for (int i = 0; i < ROWS; i++) {
            Py_ssize_t ri = r + (i < n ? i : n - 1);
            row[i] = w->w + ri * w->w_stride;
            bias[i] = w->bias ? w->bias[ri] : 0.0f;
        }
        const __m256 vbias = _mm256_loadu_ps(bias);
        KNAME(kwide_unpack)(fmt, row, nsb, scratch, tile);
        for (Py_ssize_t m = 0; m < a->M;) {
            __m256 out[8];
            const int T = a->M - m >= 8 ? 8 : a->M - m >= 4 ? 4 : 1;
            const int8_t *xq = a->q + m * K;
            const float *xd = a->d + m * nsb;
            const int16_t *xb = a->bsums + m * (K / 16);
            if (T == 8) {
                if (group == 32) KNAME(kwide_tokens)(8, 32, tile, nsb, K, xq, xd, xb, out);
                else KNAME(kwide_tokens)(8, 16, tile, nsb, K, xq, xd, xb, out);
            } else if (T == 4) {
                if (group == 32) KNAME(kwide_tokens)(4, 32, tile, nsb, K, xq, xd, xb, out);
                else KNAME(kwide_tokens)(4, 16, tile, nsb, K, xq, xd, xb, out);
            } else {
                if (group == 32) KNAME(kwide_tokens)(1, 32, tile, nsb, K, xq, xd, xb, out);
                else KNAME(kwide_tokens)(1, 16, tile, nsb, K, xq, xd, xb, out);
            }
            for (int t = 0; t < T; t++) {
                float y[ROWS];
                _mm256_storeu_ps(y, _mm256_add_ps(out[t], vbias));
                memcpy(a->y + (m + t) * w->N + r, y, sizeof(float) * (size_t)n);
            }
            m += T;
        }
    }
    _mm_free(tile);
    free(scratch);
    return 1;
}
#endif

#endif

/* Rows [r0, r1) of a weight in one of the formats above F_I4: each row unpacked once, then dotted with
 * every activation row. `a`: q8_K activations (q, d, bsums) for the K types, q8_0 ones (q, d, s) else.
 * The SIMD builds see the K types only (the legacy blocks go to _matmul_kernels_x86.h's tiles). */
#if KSIMD
#define KUNPACK_SUPER KNAME(unpack_super)
#else
#define KUNPACK_SUPER unpack_super
#endif
#if KSIMD
#define KPREFETCH_ROWS 8            /* the row this many rows on is requested from memory while one computes */
/* Bring row r (if below r1) into the cache. */
KTARGET static inline void KNAME(prefetch_row)(const weight_t *w, Py_ssize_t r, Py_ssize_t r1) {
    if (r >= r1) return;
    const uint8_t *row = w->w + r * w->w_stride;
    for (Py_ssize_t at = 0; at < w->w_stride; at += 64) _mm_prefetch((const char *)(row + at), _MM_HINT_T0);
}
#endif

KTARGET static void KNAME(more_rows)(const weight_t *w, const act_t *a, Py_ssize_t r0, Py_ssize_t r1) {
    const int fmt = w->fmt, k_type = is_k_format(fmt), signed_levels = fmt == F_IQ4_XS || fmt == F_IQ4_NL;
    const Py_ssize_t nblocks = k_type ? w->K / QKK : w->nb, block_bytes = more_block_bytes(fmt);
    const size_t unpacked_bytes = (size_t)nblocks * (k_type ? sizeof(ksuper_t) : sizeof(lblock_t));
#if KSIMD
#if KVNNI
    if (a->M >= WIDE_TOKENS && k_type && KNAME(kwide_rows)(w, a, r0, r1)) return;
#endif
    if (a->M <= FUSED_TOKENS && k_type) {
        for (Py_ssize_t r = r0; r < r1; r++) {
            const uint8_t *row = w->w + r * w->w_stride;
            float bias = w->bias ? w->bias[r] : 0.0f;
            KNAME(prefetch_row)(w, r + KPREFETCH_ROWS, r1);
            for (Py_ssize_t m = 0; m < a->M; m++) {
                float dot;
                if (fmt == F_Q4_K || fmt == F_Q5_K)
                    dot = KNAME(fused_qk_affine)(row, nblocks, a->q + m * w->K, a->d + m * nblocks,
                                                 a->bsums + m * (w->K / 16), fmt == F_Q5_K);
                else if (fmt == F_Q6_K)
                    dot = KNAME(fused_q6_k)(row, nblocks, a->q + m * w->K, a->d + m * nblocks, a->bsums + m * (w->K / 16));
                else if (fmt == F_Q2_K)
                    dot = KNAME(fused_q2_q3_k)(row, nblocks, a->q + m * w->K, a->d + m * nblocks, a->bsums + m * (w->K / 16), 0);
                else if (fmt == F_Q3_K)
                    dot = KNAME(fused_q2_q3_k)(row, nblocks, a->q + m * w->K, a->d + m * nblocks, a->bsums + m * (w->K / 16), 1);
                else
                    dot = KNAME(fused_iq4_xs)(row, nblocks, a->q + m * w->K, a->d + m * nblocks);
                a->y[m * w->N + r] = bias + dot;
            }
        }
        return;
    }
    const int pairs = 1;                          /* two rows at a time for the 2 x 4 tiles */
#else
    const int pairs = 0;
#endif
    uint8_t *buffer = malloc(2 * unpacked_bytes);
    if (buffer == NULL) {                 /* no memory for two rows: NaN outputs rather than a crash */
        for (Py_ssize_t r = r0; r < r1; r++)
            for (Py_ssize_t m = 0; m < a->M; m++) a->y[m * w->N + r] = NAN;
        return;
    }
    for (Py_ssize_t r = r0; r < r1; r += 1 + pairs) {
        int n = pairs && r + 1 < r1 ? 2 : 1;             /* rows unpacked together */
        for (int i = 0; i < n; i++) {
            const uint8_t *row = w->w + (r + i) * w->w_stride;
            for (Py_ssize_t b = 0; b < nblocks; b++) {
                if (k_type) KUNPACK_SUPER(fmt, row + b * block_bytes, (ksuper_t *)(buffer + i * unpacked_bytes) + b);
                else unpack_legacy(fmt, row + b * block_bytes, (lblock_t *)(buffer + i * unpacked_bytes) + b);
            }
        }
        Py_ssize_t m = 0;
#if KSIMD
        if (n == 2 && k_type) {
            for (; m + 4 <= a->M; m += 4) {
                float out[8];
                const ksuper_t *rows[2] = {(const ksuper_t *)buffer, (const ksuper_t *)(buffer + unpacked_bytes)};
                KNAME(ktile)(signed_levels, rows, nblocks, w->K, a->q + m * w->K, a->d + m * nblocks, a->bsums + m * (w->K / 16), out);
                for (int i = 0; i < 2; i++)
                    for (int t = 0; t < 4; t++)
                        a->y[(m + t) * w->N + r + i] = out[4 * i + t] + (w->bias ? w->bias[r + i] : 0.0f);
            }
        }
#endif
        for (int i = 0; i < n; i++) {
            float bias = w->bias ? w->bias[r + i] : 0.0f;
            for (Py_ssize_t t = m; t < a->M; t++) {
                float dot = k_type
                    ? KNAME(kdot)(signed_levels, (const ksuper_t *)(buffer + i * unpacked_bytes), nblocks, a->q + t * w->K,
                                  a->d + t * nblocks, a->bsums + t * (w->K / 16))
                    : ldot((const lblock_t *)(buffer + i * unpacked_bytes), nblocks, a->q + t * nblocks * QK,
                           a->d + t * nblocks, a->s + t * nblocks);
                a->y[t * w->N + r + i] = bias + dot;
            }
        }
    }
    free(buffer);
}
#undef KUNPACK_SUPER
