/* x86-64 SIMD kernels of _matmul_kernels.c for int8 rows, int4 rows and the GGUF blocks of 32 (q8_0, q4_0,
 * q4_1, q5_0, q5_1, iq4_nl), included once per instruction set with
 *   KNAME(name)  the function names' suffix      KTARGET  the target attribute
 *   KVNNI        1: vpdpbusd (KDPBUSD) on 256-bit registers; 0: AVX2 vpmaddubsw + vpmaddwd
 *
 * Eight output rows at a time: each row's block of 32 levels is one register, its integer dot
 * product with the activation block another, and eight of those reduce to one register whose
 * lane i is row i's sum; that register is scaled in float (block scales of the eight rows times
 * the activation block's scale) into the row group's accumulator. One load of a weight block
 * serves TOKENS activation rows (batch > 1 is a tiled loop).
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes: int8 weight levels are read as unsigned by
 * flipping their top bit (q + 128) and 128 joins their zero. vpmaddubsw could overflow 16 bits on
 * such products, so the AVX2 kernel multiplies |q| by the activations carrying q's sign instead.
 */

#if !KVNNI
/* Activations -> int8 blocks, as quantize_activations (the same levels: cvtps2dq rounds half to even
 * like nearbyintf); whole blocks here, a row's partial last block through quantize_block. Compiled
 * once, with the AVX2 kernels; the VNNI kernels use it too. */
KTARGET static void quantize_activations_avx2(const float *x, Py_ssize_t M, Py_ssize_t K, Py_ssize_t nb, int pairs,
                                              int rowwise, int8_t *q, float *d, float *s) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (Py_ssize_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float fixed = rowwise ? row_max(row, K) : -1.0f;
        for (Py_ssize_t b = 0; b < nb; b++) {
            const float *src = row + b * QK;
            int8_t *dst = q + (m * nb + b) * QK;
            if (K - b * QK < QK) {
                quantize_block(src, K - b * QK, fixed, pairs, dst, d + m * nb + b, s + m * nb + b);
                continue;
            }
            __m256 v[4];
            for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(src + 8 * k);
            float amax = fixed;
            if (amax < 0.0f) {
                __m256 m4 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                          _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
                __m128 h = _mm_max_ps(_mm256_castps256_ps128(m4), _mm256_extractf128_ps(m4, 1));
                h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                h = _mm_max_ss(h, _mm_movehdup_ps(h));
                amax = _mm_cvtss_f32(h);
            }
            __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m256i i[4];
            for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
            __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
            packed = _mm256_permutevar8x32_epi32(packed, order);              /* back to x0 .. x31 */
            if (pairs)                                                        /* x0, x2, .., x30, x1, .., x31 */
                packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(packed, evens_odds), 0xd8);
            _mm256_storeu_si256((__m256i *)dst, packed);
            d[m * nb + b] = amax / 127.0f;
            s[m * nb + b] = (float)_mm_cvtsi128_si32(t);
        }
    }
}
#endif

KTARGET static inline __m256i KNAME(expand_nibbles)(const uint8_t *p) {
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);      /* low nibbles: lanes 0-15, high: 16-31 */
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* Lane i of the result: the sum of the eight 32-bit lanes of p[i]. */
KTARGET static inline __m256i KNAME(reduce8)(const __m256i *p) {
    __m256i s01 = _mm256_hadd_epi32(p[0], p[1]), s23 = _mm256_hadd_epi32(p[2], p[3]);
    __m256i s45 = _mm256_hadd_epi32(p[4], p[5]), s67 = _mm256_hadd_epi32(p[6], p[7]);
    __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                            _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

/* Eight rows' block b: levels in activation order (unsigned-ready for VNNI), block scales, zeros. */
typedef struct {
    __m256i v[ROWS];
#if !KVNNI
    __m256i abs[ROWS];
#endif
    __m256 scale, zero;
    __m256 offset;                 /* q4_1, q5_1: m of w = d u + m */
} KNAME(block_t);

/* The formats whose levels are signed (the others' are unsigned, with a zero). */
static inline int KNAME(signed_format)(int fmt) { return fmt == F_I8 || fmt == F_Q8_0 || fmt == F_IQ4_NL; }
static inline int KNAME(has_offset)(int fmt) { return fmt == F_Q4_1 || fmt == F_Q5_1; }

/* _matmul_kernels_kquants.h: the 32 levels of a q4_1, q5_0, q5_1 (unsigned) or iq4_nl (signed) block. */
KTARGET static inline __m256i KNAME(legacy_levels)(const int fmt, const uint8_t *b);

/* The eight rows of a tile (the last repeated where fewer are left). */
typedef struct {
    const uint8_t *row[ROWS];      /* each row's weights */
    const uint16_t *scale[ROWS];   /* F_I4: each row's f16 group scales */
    const uint8_t *zero[ROWS];     /* F_I4 asymmetric: each row's group zero points */
    __m256 fixed_zero;             /* the formats with one zero per row: F_I8's zero points, q8_0's 0, q4_0's 8 */
} KNAME(tile_rows_t);

/* Eight 16-bit values, p[i][at] (i = 0..7), built in registers: eight scalar stores read back as one vector
 * would stall store forwarding once per block. */
KTARGET static inline __m128i KNAME(halves8)(const uint16_t *const *p, Py_ssize_t at) {
    return _mm_setr_epi16((short)p[0][at], (short)p[1][at], (short)p[2][at], (short)p[3][at], (short)p[4][at],
                          (short)p[5][at], (short)p[6][at], (short)p[7][at]);
}

/* Block b of the eight rows; g: its scale group (F_I4). */
KTARGET static inline void KNAME(load_block)(const int fmt, const weight_t *w, const KNAME(tile_rows_t) *tr,
                                             Py_ssize_t b, Py_ssize_t g, KNAME(block_t) *blk) {
    const uint16_t *block_start[ROWS];
    int is_signed = KNAME(signed_format)(fmt);
    for (int i = 0; i < ROWS; i++) {
        const uint8_t *row = tr->row[i];
        if (fmt == F_I8) {
            Py_ssize_t n = w->K - b * QK;
            if (n >= QK) {
                blk->v[i] = _mm256_loadu_si256((const __m256i *)(row + b * QK));
            } else {                                     /* the row's last, partial block */
                uint8_t tail[QK] = {0};
                memcpy(tail, row + b * QK, (size_t)n);
                blk->v[i] = _mm256_loadu_si256((const __m256i *)tail);
            }
        } else if (fmt == F_Q8_0) {
            const uint8_t *block = row + b * 34;
            block_start[i] = (const uint16_t *)block;
            blk->v[i] = _mm256_loadu_si256((const __m256i *)(block + 2));
        } else if (fmt == F_Q4_0) {
            const uint8_t *block = row + b * 18;
            block_start[i] = (const uint16_t *)block;
            blk->v[i] = KNAME(expand_nibbles)(block + 2);
        } else if (fmt != F_I4) {                        /* q4_1, q5_0, q5_1, iq4_nl: f16 d first */
            const uint8_t *block = row + b * more_block_bytes(fmt);
            block_start[i] = (const uint16_t *)block;
            blk->v[i] = KNAME(legacy_levels)(fmt, block);
        } else {                                         /* F_I4 */
            blk->v[i] = KNAME(expand_nibbles)(row + b * (QK / 2));
            if (w->signed_nibbles) blk->v[i] = _mm256_xor_si256(blk->v[i], _mm256_set1_epi8(8));
        }
        if (is_signed) {
#if KVNNI
            blk->v[i] = _mm256_xor_si256(blk->v[i], _mm256_set1_epi8((char)0x80));
#else
            blk->abs[i] = _mm256_abs_epi8(blk->v[i]);
#endif
        }
    }
    if (fmt == F_I8) blk->scale = _mm256_set1_ps(1.0f);
    else if (fmt == F_I4) blk->scale = _mm256_cvtph_ps(KNAME(halves8)(tr->scale, g));
    else blk->scale = _mm256_cvtph_ps(KNAME(halves8)(block_start, 0));
    if (KNAME(has_offset)(fmt)) blk->offset = _mm256_cvtph_ps(KNAME(halves8)(block_start, 1));   /* f16 m after d */
    if (fmt == F_I4 && !w->signed_nibbles) {
        const uint8_t *const *z = tr->zero;
        blk->zero = _mm256_cvtepi32_ps(_mm256_setr_epi32(z[0][g], z[1][g], z[2][g], z[3][g], z[4][g], z[5][g], z[6][g],
                                                         z[7][g]));
    } else {
        blk->zero = tr->fixed_zero;
    }
}

/* Block b of the tile's rows into `blk`, bringing `chunk` bytes of `ahead` (a later tile's rows, or NULL)
 * into the cache meanwhile; advances the scale group (g, in_group) past it (F_I4). */
KTARGET static inline void KNAME(next_block)(const int fmt, const weight_t *w, const KNAME(tile_rows_t) *tr,
                                             Py_ssize_t b, Py_ssize_t *g, Py_ssize_t *in_group,
                                             const uint8_t *ahead, Py_ssize_t chunk, KNAME(block_t) *blk) {
    if (ahead)
        for (Py_ssize_t at = b * chunk; at < (b + 1) * chunk; at += 64)
            _mm_prefetch((const char *)(ahead + at), _MM_HINT_T0);
    KNAME(load_block)(fmt, w, tr, b, *g, blk);
    if (++*in_group == w->group_blocks) *in_group = 0, ++*g;
}

/* One activation block against the eight rows: their eight integer dot products, as lanes. */
KTARGET static inline __m256i KNAME(dots)(const int fmt, const KNAME(block_t) *blk, __m256i x) {
    __m256i p[ROWS];
#if KVNNI
    (void)fmt;
    for (int i = 0; i < ROWS; i++) p[i] = KDPBUSD(_mm256_setzero_si256(), blk->v[i], x);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < ROWS; i++) {
        __m256i pairs = KNAME(signed_format)(fmt)
            ? _mm256_maddubs_epi16(blk->abs[i], _mm256_sign_epi8(x, blk->v[i]))
            : _mm256_maddubs_epi16(blk->v[i], x);
        p[i] = _mm256_madd_epi16(pairs, ones);
    }
#endif
    return KNAME(reduce8)(p);
}

/* Rows [r, r + ROWS) (clamped copies past N) against activation rows [m0, m0 + T). `ahead` (or NULL):
 * bytes to bring into the cache meanwhile, `chunk` of them per block (a later tile's rows). */
KTARGET static inline void KNAME(tile)(const int fmt, const int T, const weight_t *w, const act_t *a,
                                       const KNAME(tile_rows_t) *tr, Py_ssize_t m0, __m256 *acc, const uint8_t *ahead,
                                       Py_ssize_t chunk) {
    const Py_ssize_t nb = w->nb;
    Py_ssize_t g = 0, in_group = 0;                     /* block b's scale group (F_I4) */
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < nb; b++) {
        KNAME(block_t) blk;
        KNAME(next_block)(fmt, w, tr, b, &g, &in_group, ahead, chunk, &blk);
        for (int t = 0; t < T; t++) {
            Py_ssize_t at = (m0 + t) * nb + b;
            __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + at * QK));
            __m256 f = _mm256_cvtepi32_ps(KNAME(dots)(fmt, &blk, x));
            f = _mm256_fnmadd_ps(blk.zero, _mm256_set1_ps(a->s[at]), f);
            acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(blk.scale, _mm256_set1_ps(a->d[at])), acc[t]);
            if (KNAME(has_offset)(fmt)) acc[t] = _mm256_fmadd_ps(blk.offset, _mm256_set1_ps(a->d[at] * a->s[at]), acc[t]);
        }
    }
}

#if KVNNI
/* v[i] (row i's block) -> u[j]: lane i holds row i's bytes 4j..4j+3 (an 8 x 8 transpose of 32-bit words). */
KTARGET static inline void KNAME(transpose8)(const __m256i *v, __m256i *u) {
    __m256i t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);          /* words 0,1 | 4,5 of rows i, i+1 */
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);      /* words 2,3 | 6,7 */
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);          /* word 0 | 4 of rows i..i+3 */
        s[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);      /* word 1 | 5 */
        s[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);  /* word 2 | 6 */
        s[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);  /* word 3 | 7 */
    }
    for (int j = 0; j < 4; j++) {
        u[j] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x20);
        u[j + 4] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x31);
    }
}

/* As tile, for TOKENS activation rows at once: the weight block is transposed once so that each
 * vpdpbusd takes four activations broadcast to all eight rows; no reduction per token. */
KTARGET static inline void KNAME(tile_wide)(const int fmt, const weight_t *w, const act_t *a,
                                            const KNAME(tile_rows_t) *tr, Py_ssize_t m0, __m256 *acc,
                                            const uint8_t *ahead, Py_ssize_t chunk) {
    const Py_ssize_t nb = w->nb;
    Py_ssize_t g = 0, in_group = 0;
    for (int t = 0; t < TOKENS; t++) acc[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < nb; b++) {
        KNAME(block_t) blk;
        __m256i u[8], sums[TOKENS];
        KNAME(next_block)(fmt, w, tr, b, &g, &in_group, ahead, chunk, &blk);
        KNAME(transpose8)(blk.v, u);
        const int32_t *x = (const int32_t *)(a->q + (m0 * nb + b) * QK);
        for (int t = 0; t < TOKENS; t++) sums[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
#pragma GCC unroll 8
            for (int t = 0; t < TOKENS; t++)
                sums[t] = KDPBUSD(sums[t], u[j], _mm256_set1_epi32(x[t * nb * (QK / 4) + j]));
        for (int t = 0; t < TOKENS; t++) {
            Py_ssize_t at = (m0 + t) * nb + b;
            __m256 f = _mm256_fnmadd_ps(blk.zero, _mm256_set1_ps(a->s[at]), _mm256_cvtepi32_ps(sums[t]));
            acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(blk.scale, _mm256_set1_ps(a->d[at])), acc[t]);
            if (KNAME(has_offset)(fmt)) acc[t] = _mm256_fmadd_ps(blk.offset, _mm256_set1_ps(a->d[at] * a->s[at]), acc[t]);
        }
    }
}

/* A tile's block b, transposed as tile_wide uses it, with its scales: kept for every block of the tile's
 * rows when many activation rows will read them (wide_rows), so the transposition is paid once per call. */
typedef struct {
    __m256i u[8];
    __m256 scale, zero, offset;
} KNAME(wide_block_t);

/* The tile's rows, every block loaded and transposed once into wb[0..nb). */
KTARGET static inline void KNAME(wide_blocks)(const int fmt, const weight_t *w, const KNAME(tile_rows_t) *tr,
                                              KNAME(wide_block_t) *wb, const uint8_t *ahead, Py_ssize_t chunk) {
    Py_ssize_t g = 0, in_group = 0;
    for (Py_ssize_t b = 0; b < w->nb; b++) {
        KNAME(block_t) blk;
        KNAME(next_block)(fmt, w, tr, b, &g, &in_group, ahead, chunk, &blk);
        KNAME(transpose8)(blk.v, wb[b].u);
        wb[b].scale = blk.scale;
        wb[b].zero = blk.zero;
        wb[b].offset = KNAME(has_offset)(fmt) ? blk.offset : _mm256_setzero_ps();
    }
}

/* tile_wide on blocks transposed beforehand (wide_blocks). */
KTARGET static inline void KNAME(tile_wide_kept)(const int fmt, const weight_t *w, const act_t *a,
                                                 const KNAME(wide_block_t) *wb, Py_ssize_t m0, __m256 *acc) {
    const Py_ssize_t nb = w->nb;
    for (int t = 0; t < TOKENS; t++) acc[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const KNAME(wide_block_t) *blk = wb + b;
        __m256i sums[TOKENS];
        const int32_t *x = (const int32_t *)(a->q + (m0 * nb + b) * QK);
        for (int t = 0; t < TOKENS; t++) sums[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i u = blk->u[j];
#pragma GCC unroll 8
            for (int t = 0; t < TOKENS; t++) sums[t] = KDPBUSD(sums[t], u, _mm256_set1_epi32(x[t * nb * (QK / 4) + j]));
        }
        for (int t = 0; t < TOKENS; t++) {
            Py_ssize_t at = (m0 + t) * nb + b;
            __m256 f = _mm256_fnmadd_ps(blk->zero, _mm256_set1_ps(a->s[at]), _mm256_cvtepi32_ps(sums[t]));
            acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(blk->scale, _mm256_set1_ps(a->d[at])), acc[t]);
            if (KNAME(has_offset)(fmt)) acc[t] = _mm256_fmadd_ps(blk->offset, _mm256_set1_ps(a->d[at] * a->s[at]), acc[t]);
        }
    }
}
#endif

KTARGET static inline void KNAME(rows_of)(const int fmt, const weight_t *w, const act_t *a, Py_ssize_t r0,
                                          Py_ssize_t r1) {
#if KVNNI
    /* Two or more tiles of activation rows: each row tile's blocks are transposed once, not once per tile. */
    KNAME(wide_block_t) *kept = a->M >= KEPT_TOKENS ? _mm_malloc(sizeof(KNAME(wide_block_t)) * (size_t)w->nb, 32) : NULL;
#endif
    for (Py_ssize_t r = r0; r < r1; r += ROWS) {
        int n = r1 - r < ROWS ? (int)(r1 - r) : ROWS;
        KNAME(tile_rows_t) tr;
        float scale[ROWS], bias[ROWS], row_zero[ROWS];
        for (int i = 0; i < ROWS; i++) {
            Py_ssize_t ri = r + (i < n ? i : n - 1);
            tr.row[i] = w->w + ri * w->w_stride;
            tr.scale[i] = fmt == F_I4 ? (const uint16_t *)w->scale + ri * w->scale_stride : NULL;
            tr.zero[i] = fmt == F_I4 && w->zero ? w->zero + ri * w->zero_stride : NULL;
            scale[i] = row_scale(w, ri);
            bias[i] = w->bias ? w->bias[ri] : 0.0f;
            row_zero[i] = fmt == F_I8 && w->zero ? (float)(int8_t)w->zero[ri * w->zero_stride]
                        : fmt == F_Q4_0 || fmt == F_I4 ? 8.0f : fmt == F_Q5_0 ? 16.0f : 0.0f;
#if KVNNI
            if (KNAME(signed_format)(fmt)) row_zero[i] += 128.0f;   /* the levels are read as unsigned */
#endif
        }
        __m256 vscale = _mm256_loadu_ps(scale), vbias = _mm256_loadu_ps(bias);
        tr.fixed_zero = _mm256_loadu_ps(row_zero);
        /* The first pass over a tile's rows reads them from memory: the rows PREFETCH_TILES tiles on are
         * requested meanwhile, so memory latency overlaps the arithmetic (later passes find them in cache). */
        Py_ssize_t next = r + PREFETCH_TILES * ROWS, rows_ahead = r1 - next < ROWS ? r1 - next : ROWS;
        const uint8_t *ahead = PREFETCH_TILES > 0 && rows_ahead > 0 ? w->w + next * w->w_stride : NULL;
        Py_ssize_t chunk = ahead ? ((rows_ahead * w->w_stride + w->nb - 1) / w->nb + 63) / 64 * 64 : 0;
#if KVNNI
        if (kept) KNAME(wide_blocks)(fmt, w, &tr, kept, ahead, chunk);
#endif
        for (Py_ssize_t m0 = 0; m0 < a->M;) {
            __m256 acc[TOKENS];
            int T = a->M - m0 >= TOKENS ? TOKENS : 1;
#if KVNNI
            if (T == TOKENS && kept) KNAME(tile_wide_kept)(fmt, w, a, kept, m0, acc);
            else if (T == TOKENS) KNAME(tile_wide)(fmt, w, a, &tr, m0, acc, m0 == 0 ? ahead : NULL, chunk);
#else
            if (T == TOKENS) KNAME(tile)(fmt, TOKENS, w, a, &tr, m0, acc, m0 == 0 ? ahead : NULL, chunk);
#endif
            else KNAME(tile)(fmt, 1, w, a, &tr, m0, acc, m0 == 0 ? ahead : NULL, chunk);
            for (int t = 0; t < T; t++) {
                float out[ROWS];
                _mm256_storeu_ps(out, _mm256_fmadd_ps(acc[t], vscale, vbias));
                memcpy(a->y + (m0 + t) * w->N + r, out, sizeof(float) * (size_t)n);
            }
            m0 += T;
        }
    }
#if KVNNI
    _mm_free(kept);
#endif
}

KTARGET static void KNAME(rows)(const weight_t *w, const act_t *a, Py_ssize_t r0, Py_ssize_t r1) {
    switch (w->fmt) {
    case F_I8: KNAME(rows_of)(F_I8, w, a, r0, r1); break;
    case F_Q8_0: KNAME(rows_of)(F_Q8_0, w, a, r0, r1); break;
    case F_Q4_0: KNAME(rows_of)(F_Q4_0, w, a, r0, r1); break;
    case F_I4: KNAME(rows_of)(F_I4, w, a, r0, r1); break;
    case F_Q4_1: KNAME(rows_of)(F_Q4_1, w, a, r0, r1); break;
    case F_Q5_0: KNAME(rows_of)(F_Q5_0, w, a, r0, r1); break;
    case F_Q5_1: KNAME(rows_of)(F_Q5_1, w, a, r0, r1); break;
    default: KNAME(rows_of)(F_IQ4_NL, w, a, r0, r1); break;
    }
}
