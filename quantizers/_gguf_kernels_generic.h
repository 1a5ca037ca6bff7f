/* Portable kernels: GCC/clang vector extensions of 4 x 32-bit lanes (SSE2 on x86-64, NEON on
 * arm64), no intrinsics. Used where the CPU has no AVX2 (see _gguf_kernels_avx2.h).
 * Included by _gguf_kernels.c, after the shared scalar helpers. */

#define LANES 4                 /* 16-byte vectors are native everywhere; wider ones are split lane by lane */
#define NV (BLOCK / LANES)

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* One block of 32 floats as eight vectors, each half (16 values) transposed: in v[k] (and
 * v[4 + k]) lane i holds value 4i + k (16 + 4i + k). Order does not matter to the per-value
 * arithmetic or the reductions, and this one makes packing cheap: lane i of four vectors holds
 * four consecutive values, so shifts and ors build their bytes in one 32-bit lane (see
 * put_bytes) without per-lane code. */
typedef struct { vf v[NV]; } block_t;

#define TRANSPOSE4(T, a, b, c, d) do {                                                        \
        T lo_ab = __builtin_shufflevector(a, b, 0, 4, 1, 5), hi_ab = __builtin_shufflevector(a, b, 2, 6, 3, 7); \
        T lo_cd = __builtin_shufflevector(c, d, 0, 4, 1, 5), hi_cd = __builtin_shufflevector(c, d, 2, 6, 3, 7); \
        a = __builtin_shufflevector(lo_ab, lo_cd, 0, 1, 4, 5);                                 \
        b = __builtin_shufflevector(lo_ab, lo_cd, 2, 3, 6, 7);                                 \
        c = __builtin_shufflevector(hi_ab, hi_cd, 0, 1, 4, 5);                                 \
        d = __builtin_shufflevector(hi_ab, hi_cd, 2, 3, 6, 7);                                 \
    } while (0)

static inline block_t load_block(const float *src) {
    block_t b;
    memcpy(b.v, src, sizeof b.v);          /* unaligned-safe load; compiles to vector loads */
    TRANSPOSE4(vf, b.v[0], b.v[1], b.v[2], b.v[3]);
    TRANSPOSE4(vf, b.v[4], b.v[5], b.v[6], b.v[7]);
    return b;
}

static inline vi bits_of(vf x) { return (vi)x; }
static inline vf select_f(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vi select_i(vi mask, vi a, vi b) { return (mask & a) | (~mask & b); }
static inline vf vmax(vf a, vf b) { return select_f(a > b, a, b); }
static inline vf vmin(vf a, vf b) { return select_f(a < b, a, b); }
static inline vi vmax_i(vi a, vi b) { return select_i(a > b, a, b); }

/* Horizontal reductions by halving: lanes i and i + w combined, w = 2, 1; every lane ends
 * with the result (shuffles and vector max/min, no per-lane scalar code). */
#define SWAP2(v) __builtin_shufflevector(v, v, 2, 3, 0, 1)
#define SWAP1(v) __builtin_shufflevector(v, v, 1, 0, 3, 2)

static inline float hmax(vf v) {
    v = vmax(v, SWAP2(v));
    return vmax(v, SWAP1(v))[0];
}

static inline float hmin(vf v) {
    v = vmin(v, SWAP2(v));
    return vmin(v, SWAP1(v))[0];
}

static inline int32_t hmax_i(vi v) {
    v = vmax_i(v, SWAP2(v));
    return vmax_i(v, SWAP1(v))[0];
}

/* Bits of the largest |x| in the block (as an integer: for non-negative floats the order of
 * their bits is the order of their values, and inf/NaN bits are above every finite one). */
static inline int32_t abs_max_bits(const block_t *b) {
    vi m = bits_of(b->v[0]) & 0x7fffffff;
    for (int k = 1; k < NV; k++) m = vmax_i(m, bits_of(b->v[k]) & 0x7fffffff);
    return hmax_i(m);
}

static inline void min_max(const block_t *b, float *lo, float *hi) {
    vf mn = b->v[0], mx = b->v[0];
    for (int k = 1; k < NV; k++) {
        mn = vmin(mn, b->v[k]);
        mx = vmax(mx, b->v[k]);
    }
    *lo = hmin(mn);
    *hi = hmax(mx);
}

/* The block's value of largest magnitude, the first one where several tie, as gguf-py's
 * abs(blocks).argmax() picks it (q4_0, q5_0: the sign of d follows this value). */
static inline float signed_abs_max(const block_t *b, const float *x) {
    float lo, hi;
    min_max(b, &lo, &hi);
    if (-lo > hi) return lo;
    if (hi > -lo) return hi;
    float m = hi;                              /* +m and -m both present, or all zeros */
    for (int i = 0; i < BLOCK; i++)
        if (x[i] == m || x[i] == -m) return x[i];
    return m;
}

/* trunc(f) clipped to 0..top, for f >= 0 (gguf-py: np.trunc(f).astype(uint8).clip(0, top)). */
static inline vi levels(vf f, int32_t top) {
    vi t = __builtin_convertvector(f, vi);      /* float -> int truncates */
    vi limit = {top, top, top, top};
    return select_i(t > limit, limit, t);
}

/* Four transposed vectors (lane i of q[k]: value 4i + k) -> 16 bytes, each value's low byte. */
static inline void put_bytes(uint8_t *dst, const vi q[4]) {
    vu words = ((vu)q[0] & 0xff) | ((vu)q[1] & 0xff) << 8 | ((vu)q[2] & 0xff) << 16 | (vu)q[3] << 24;   /* unsigned: no overflow */
    memcpy(dst, &words, sizeof words);          /* little-endian: lane i's bytes are dst[4i..4i+3] */
}

/* 32 levels of 0..31 -> 16 bytes: low nibble from value j, high nibble from value j + 16. */
static inline void put_nibbles(uint8_t *dst, const vi q[NV]) {
    vi bytes[4];
    for (int k = 0; k < 4; k++) bytes[k] = (q[k] & 0x0f) | (q[4 + k] & 0x0f) << 4;
    put_bytes(dst, bytes);
}

/* qh: bit j of a little-endian u32 is bit 4 of level j. Lane i gathers the bits of values
 * 4i..4i+3 (and 16 + those) with uniform shifts; four scalar shifts place the lanes. */
static inline void put_high_bits(uint8_t *dst, const vi q[NV]) {
    vi bits = {0};
    for (int k = 0; k < 4; k++) bits |= ((q[k] >> 4) & 1) << k | ((q[4 + k] >> 4) & 1) << (16 + k);
    uint32_t w = (uint32_t)bits[0] | (uint32_t)bits[1] << 4 | (uint32_t)bits[2] << 8 | (uint32_t)bits[3] << 12;
    dst[0] = (uint8_t)w;
    dst[1] = (uint8_t)(w >> 8);
    dst[2] = (uint8_t)(w >> 16);
    dst[3] = (uint8_t)(w >> 24);
}

static Py_ssize_t q8_0_generic(const float *src, uint8_t *dst, Py_ssize_t n) {
    const vf round = {ROUND, ROUND, ROUND, ROUND};
    for (Py_ssize_t blk = 0; blk < n; blk++, src += BLOCK, dst += 34) {
        block_t b = load_block(src);
        int32_t amax = abs_max_bits(&b);
        if (amax >= EXPONENT) return blk;
        float m;
        memcpy(&m, &amax, 4);
        float d = m / 127.0f, id = inverse(d);
        put_half(dst, d);
        vi q[NV];
        for (int k = 0; k < NV; k++) {          /* trunc(y + copysign(ROUND, y)) = roundf(y), y = x * id */
            vf y = b.v[k] * id;
            q[k] = __builtin_convertvector(y + (vf)((bits_of(y) & (int32_t)0x80000000) | bits_of(round)), vi);
        }
        put_bytes(dst + 2, q);                  /* int8 two's complement: the low bytes */
        put_bytes(dst + 18, q + 4);
    }
    return -1;
}

/* q4_0 and q5_0: d = (signed max) / -(2**(bits-1)), q = trunc(x * id + offset) clipped. */
static inline Py_ssize_t symmetric_generic(const float *src, uint8_t *dst, Py_ssize_t n, int five) {
    const float divisor = five ? -16.0f : -8.0f, offset = five ? 16.5f : 8.5f;
    const int32_t top = five ? 31 : 15;
    const int size = five ? 22 : 18;
    for (Py_ssize_t blk = 0; blk < n; blk++, src += BLOCK, dst += size) {
        block_t b = load_block(src);
        if (abs_max_bits(&b) >= EXPONENT) return blk;
        float d = signed_abs_max(&b, src) / divisor, id = inverse(d);
        put_half(dst, d);
        vi q[NV];
        for (int k = 0; k < NV; k++) q[k] = levels(b.v[k] * id + offset, top);
        if (five) put_high_bits(dst + 2, q);
        put_nibbles(dst + (five ? 6 : 2), q);
    }
    return -1;
}

/* q4_1 and q5_1: d = (max - min) / (2**bits - 1), m = min, q = trunc((x - min) * id + 0.5). */
static inline Py_ssize_t affine_generic(const float *src, uint8_t *dst, Py_ssize_t n, int five) {
    const float divisor = five ? 31.0f : 15.0f;
    const int32_t top = five ? 31 : 15;
    const int size = five ? 24 : 20;
    for (Py_ssize_t blk = 0; blk < n; blk++, src += BLOCK, dst += size) {
        block_t b = load_block(src);
        if (abs_max_bits(&b) >= EXPONENT) return blk;
        float lo, hi;
        min_max(&b, &lo, &hi);
        float d = (hi - lo) / divisor, id = inverse(d);
        put_half(dst, d);
        put_half(dst + 2, lo);
        vi q[NV];
        for (int k = 0; k < NV; k++) q[k] = levels((b.v[k] - lo) * id + 0.5f, top);
        if (five) put_high_bits(dst + 4, q);
        put_nibbles(dst + (five ? 8 : 4), q);
    }
    return -1;
}

static Py_ssize_t q4_0_generic(const float *s, uint8_t *d, Py_ssize_t n) { return symmetric_generic(s, d, n, 0); }
static Py_ssize_t q5_0_generic(const float *s, uint8_t *d, Py_ssize_t n) { return symmetric_generic(s, d, n, 1); }
static Py_ssize_t q4_1_generic(const float *s, uint8_t *d, Py_ssize_t n) { return affine_generic(s, d, n, 0); }
static Py_ssize_t q5_1_generic(const float *s, uint8_t *d, Py_ssize_t n) { return affine_generic(s, d, n, 1); }
