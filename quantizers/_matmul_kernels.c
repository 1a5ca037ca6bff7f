/* Matrix products on packed quantized weights: y = x @ W.T (+ b) without a float copy of W.
 *
 * The fast path of the quantized layers in quantizers/_modules.py (see quantizers/fast_linear.py,
 * which picks the layouts and calls in here). As llama.cpp does, each call first rounds the
 * activations to int8 in blocks of 32 (one float scale per block, q8_0-like; or one scale per row
 * for int8-dynamic), then takes integer dot products of those blocks with the stored weight blocks
 * and scales the int32 sums back to float. The weights are read in the layout the file stores them:
 *
 *   F_I8    modelkit "affine" int8: rows of int8, one float32 scale per row (or per tensor),
 *           an optional int8 zero point per row                     w = (q - z) * s
 *   F_Q8_0  GGUF q8_0: 34-byte blocks, f16 d | 32 x int8            w = d * q
 *   F_Q4_0  GGUF q4_0: 18-byte blocks, f16 d | 16 B nibbles (low: weights 0-15, high: 16-31)
 *                                                                    w = d * (q - 8)
 *   F_I4    modelkit "affine" int4: rows of nibble pairs (low nibble first), one f16 scale per group
 *           of 32/64/128 columns; two's complement nibbles, or 0..15 with a uint8 zero point per group
 *           The activations of an F_I4 product are stored in pair order within each block
 *           (weights 0,2,..,30 then 1,3,..,31), so the nibble expansion of F_Q4_0 serves both.
 *   F_Q4_1 .. F_IQ4_XS  the other GGUF block types (q4_1, q5_0, q5_1, iq4_nl; the K-quants q2_k .. q6_k
 *           and iq4_xs, whose activations are llama.cpp's q8_K: blocks of 256): _matmul_kernels_kquants.h
 *
 * For each block, sum_k (q_k - z) x_k = sum_k q_k x_k - z sum_k x_k: the integer dot product runs
 * on the raw levels and the zero (8 for q4_0 and symmetric int4; 128 where the VNNI kernels read
 * int8 levels as unsigned bytes) comes off with the block's activation sum.
 *
 * Kernels, chosen once at import by fast_linear.py (or forced with MODELKIT_MATMUL_ISA):
 * "avx512vnni" and "avxvnni" (vpdpbusd on 256-bit registers), "avx2" (vpmaddubsw), and "generic"
 * (portable C, also the reference the tests check the others against). The SIMD ones are in
 * _matmul_kernels_x86.h, compiled per instruction set with target attributes, so the build needs
 * no -march flag and runs on any x86-64 or other CPU (-DMODELKIT_GENERIC_ONLY builds the portable
 * kernel alone, as a CPU other than x86-64 gets it: `gcc -Wall -DMODELKIT_GENERIC_ONLY` checks it). Work is split over output rows between a
 * small pool of POSIX threads (the calling thread takes part); the GIL is released meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "little-endian CPUs only (GGUF blocks store little-endian f16 scales)"
#endif

#define QK 32           /* weights per block, activations per block scale */
#define ROWS 8          /* output rows computed together (one 8-lane register of results) */
#define TOKENS 8        /* activation rows sharing one load of a weight block */
#define KEPT_TOKENS 32  /* from this many activation rows, the VNNI tiles transpose their blocks once per call */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 2 /* decode: prefetch the weight rows this many tiles ahead */
#endif

enum { F_I8 = 0, F_Q8_0 = 1, F_Q4_0 = 2, F_I4 = 3,
       /* _matmul_kernels_kquants.h: legacy blocks of 32, then the K super-blocks of 256 */
       F_Q4_1 = 4, F_Q5_0 = 5, F_Q5_1 = 6, F_IQ4_NL = 7, F_Q2_K = 8, F_Q3_K = 9, F_Q4_K = 10, F_Q5_K = 11,
       F_Q6_K = 12, F_IQ4_XS = 13, F_LAST = F_IQ4_XS };

typedef struct {
    int fmt;
    const uint8_t *w;              /* row 0 */
    Py_ssize_t w_stride;           /* bytes from one row to the next */
    const void *scale;             /* F_I8: float32 per row; F_I4: f16 per row and group; else NULL */
    Py_ssize_t scale_stride;       /* elements from one row to the next (0: one scale for the tensor) */
    const uint8_t *zero;           /* F_I8: int8 per row; F_I4 asymmetric: uint8 per row and group; or NULL */
    Py_ssize_t zero_stride;
    Py_ssize_t group_blocks;       /* F_I4: blocks of 32 per scale group */
    int signed_nibbles;            /* F_I4 symmetric: two's complement nibbles */
    const float *bias;             /* N floats or NULL */
    Py_ssize_t N, K, nb;           /* rows, columns, blocks per row (ceil(K / 32)) */
    int rowwise;                   /* the decode and forward plans: its activations rounded per row (int8-dynamic) */
} weight_t;

typedef struct {
    const int8_t *q;               /* (M, nb * 32) levels, zero past K */
    const float *d;                /* (M, nb) block scales */
    const float *s;                /* (M, nb) sum of each block's levels */
    Py_ssize_t M;
    float *y;                      /* (M, N) output */
    const int16_t *bsums;          /* K types: (M, K / 16) sums of 16 levels (q, d: q8_K, one scale per 256) */
} act_t;

/* IEEE binary16 bits -> float (exact; subnormals included). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, u;
    if (exponent == 0) {
        float f = (float)mantissa * (1.0f / 16777216.0f);          /* mantissa * 2**-24 */
        return sign ? -f : f;
    }
    u = exponent == 31 ? sign | 0x7f800000u | (mantissa << 13) : sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* The row scale (F_I8) and bias that finish every output. */
static inline float row_scale(const weight_t *w, Py_ssize_t r) {
    return w->fmt == F_I8 ? ((const float *)w->scale)[r * w->scale_stride] : 1.0f;
}

/* ---- activations: float32 rows -> int8 blocks ------------------------------------------------ */

/* One block of n <= 32 activations -> 32 levels (zero past n; in pair order for F_I4), scale, level sum.
 * `amax` < 0: the block's own max |x|; else the row's (int8-dynamic's one scale per row). */
static inline void quantize_block(const float *src, Py_ssize_t n, float amax, int pairs, int8_t *dst, float *d,
                                  float *s) {
    if (amax < 0.0f) {
        amax = 0.0f;
        for (Py_ssize_t k = 0; k < n; k++) amax = fmaxf(amax, fabsf(src[k]));
    }
    float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t levels[QK] = {0};
    int sum = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        float v = nearbyintf(src[k] * inverse);            /* round half to even, as cvtps2dq */
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        levels[k] = (int8_t)v;
        sum += levels[k];
    }
    if (pairs) {
        for (int j = 0; j < QK / 2; j++) {
            dst[j] = levels[2 * j];
            dst[QK / 2 + j] = levels[2 * j + 1];
        }
    } else {
        memcpy(dst, levels, QK);
    }
    *d = amax / 127.0f;
    *s = (float)sum;
}

typedef void (*quantize_fn)(const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, int, int, int8_t *, float *, float *);

static float row_max(const float *row, Py_ssize_t K) {
    float m = 0.0f;
    for (Py_ssize_t k = 0; k < K; k++) m = fmaxf(m, fabsf(row[k]));
    return m;
}

static void quantize_activations(const float *x, Py_ssize_t M, Py_ssize_t K, Py_ssize_t nb, int pairs, int rowwise,
                                 int8_t *q, float *d, float *s) {
    for (Py_ssize_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float amax = rowwise ? row_max(row, K) : -1.0f;
        for (Py_ssize_t b = 0; b < nb; b++) {
            Py_ssize_t n = K - b * QK < QK ? K - b * QK : QK;
            quantize_block(row + b * QK, n, amax, pairs, q + (m * nb + b) * QK, d + m * nb + b, s + m * nb + b);
        }
    }
}

/* ---- portable kernel ------------------------------------------------------------------------- */

/* Row r's block b as 32 integer levels in activation order, with its scale and zero. */
static void generic_block(const weight_t *w, Py_ssize_t r, Py_ssize_t b, int *v, float *scale, float *zero) {
    const uint8_t *row = w->w + r * w->w_stride;
    switch (w->fmt) {
    case F_I8: {
        Py_ssize_t n = w->K - b * QK < QK ? w->K - b * QK : QK;
        for (int k = 0; k < QK; k++) v[k] = k < n ? (int8_t)row[b * QK + k] : 0;
        *scale = 1.0f;
        *zero = w->zero ? (float)(int8_t)w->zero[r * w->zero_stride] : 0.0f;
        return;
    }
    case F_Q8_0: {
        const uint8_t *block = row + b * 34;
        for (int k = 0; k < QK; k++) v[k] = (int8_t)block[2 + k];
        *scale = half_to_float(read_u16(block));
        *zero = 0.0f;
        return;
    }
    case F_Q4_0: {
        const uint8_t *block = row + b * 18;
        for (int k = 0; k < QK / 2; k++) {
            v[k] = block[2 + k] & 0x0f;
            v[QK / 2 + k] = block[2 + k] >> 4;
        }
        *scale = half_to_float(read_u16(block));
        *zero = 8.0f;
        return;
    }
    default: {                                            /* F_I4 */
        const uint8_t *nibbles = row + b * (QK / 2);
        int flip = w->signed_nibbles ? 8 : 0;
        for (int k = 0; k < QK / 2; k++) {
            v[k] = (nibbles[k] & 0x0f) ^ flip;
            v[QK / 2 + k] = (nibbles[k] >> 4) ^ flip;
        }
        Py_ssize_t g = r * w->scale_stride + b / w->group_blocks;
        *scale = half_to_float(((const uint16_t *)w->scale)[g]);
        *zero = w->signed_nibbles ? 8.0f : (float)w->zero[r * w->zero_stride + b / w->group_blocks];
        return;
    }
    }
}

static void generic_rows(const weight_t *w, const act_t *a, Py_ssize_t r0, Py_ssize_t r1) {
    int v[QK];
    for (Py_ssize_t r = r0; r < r1; r++) {
        for (Py_ssize_t m = 0; m < a->M; m++) {
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < w->nb; b++) {
                float scale, zero;
                generic_block(w, r, b, v, &scale, &zero);
                const int8_t *x = a->q + (m * w->nb + b) * QK;
                int32_t dot = 0;
                for (int k = 0; k < QK; k++) dot += v[k] * x[k];
                acc += ((float)dot - zero * a->s[m * w->nb + b]) * (scale * a->d[m * w->nb + b]);
            }
            float out = acc * row_scale(w, r);
            a->y[m * w->N + r] = w->bias ? out + w->bias[r] : out;
        }
    }
}

/* ---- SIMD kernels ---------------------------------------------------------------------------- */

typedef void (*rows_fn)(const weight_t *, const act_t *, Py_ssize_t, Py_ssize_t);

/* The other GGUF types (K-quants, q4_1, q5_0, q5_1, IQ4): portable here, AVX2 below. */
#define KNAME(name) name##_generic
#define KTARGET
#define KSIMD 0
#include "_matmul_kernels_kquants.h"
#undef KNAME
#undef KTARGET
#undef KSIMD

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MODELKIT_GENERIC_ONLY)
#include <immintrin.h>
#define HAVE_X86_KERNELS 1

#define KNAME(name) name##_avx2
#define KTARGET __attribute__((target("avx2,fma,f16c")))
#define KVNNI 0
#include "_matmul_kernels_x86.h"
#define KSIMD 1
#include "_matmul_kernels_kquants.h"        /* quantize_q8_k_avx2 serves the VNNI entries too */
#undef KSIMD
#undef KNAME
#undef KTARGET
#undef KVNNI

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define HAVE_VNNI_KERNELS 1
#define KNAME(name) name##_avxvnni
#define KTARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define KVNNI 1
#define KSIMD 1
#define KDPBUSD _mm256_dpbusd_avx_epi32
#define KDPWSSD _mm256_dpwssd_avx_epi32
#include "_matmul_kernels_x86.h"
#include "_matmul_kernels_kquants.h"
#undef KNAME
#undef KTARGET
#undef KDPBUSD
#undef KDPWSSD

#define KNAME(name) name##_avx512vnni
#define KTARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define KDPBUSD _mm256_dpbusd_epi32
#define KDPWSSD _mm256_dpwssd_epi32
#include "_matmul_kernels_x86.h"
#include "_matmul_kernels_kquants.h"
#undef KNAME
#undef KTARGET
#undef KDPBUSD
#undef KDPWSSD
#undef KVNNI
#undef KSIMD
#endif
#endif

typedef void (*quantize_k_fn)(const float *, Py_ssize_t, Py_ssize_t, int8_t *, float *, int16_t *);

/* rows: F_I8..F_I4; legacy_rows: q4_1, q5_0, q5_1, iq4_nl (the SIMD kernels read them as they read q4_0);
 * more_rows: the K types of _matmul_kernels_kquants.h, quantize_k: their q8_K activations. */
static const struct {
    const char *name;
    rows_fn rows;
    quantize_fn quantize;
    rows_fn legacy_rows;
    rows_fn more_rows;
    quantize_k_fn quantize_k;
} ALL_ISAS[] = {
#ifdef HAVE_VNNI_KERNELS
    {"avx512vnni", rows_avx512vnni, quantize_activations_avx2, rows_avx512vnni, more_rows_avx512vnni, quantize_q8_k_avx2},
    {"avxvnni", rows_avxvnni, quantize_activations_avx2, rows_avxvnni, more_rows_avxvnni, quantize_q8_k_avx2},
#endif
#ifdef HAVE_X86_KERNELS
    {"avx2", rows_avx2, quantize_activations_avx2, rows_avx2, more_rows_avx2, quantize_q8_k_avx2},
#endif
    {"generic", generic_rows, quantize_activations, more_rows_generic, more_rows_generic, quantize_q8_k_generic},
};
#define N_ISAS ((int)(sizeof ALL_ISAS / sizeof ALL_ISAS[0]))
static int isa_ok[N_ISAS];      /* this CPU runs ALL_ISAS[i]: set once, when the module loads */

/* The kernel that reads weights of format `fmt` with ALL_ISAS[isa]: `linear` and the decode step choose here. */
static rows_fn rows_for(int isa, int fmt) {
    return fmt <= F_I4 ? ALL_ISAS[isa].rows : is_k_format(fmt) ? ALL_ISAS[isa].more_rows : ALL_ISAS[isa].legacy_rows;
}

/* ---- thread pool ------------------------------------------------------------------------------ */
/* The caller and up to MAX_WORKERS pool threads claim tasks (ranges of row tiles) from one counter
 * that also carries the job's number, so a thread that wakes late cannot take a task of a later
 * job. The caller returns once every task of its job is done. */

typedef struct {
    const weight_t *w; const act_t *a; rows_fn rows; Py_ssize_t tiles, per_task;
    void (*run)(const void *ctx, Py_ssize_t task);     /* or NULL: a task is `run(ctx, task)` (_matmul_kernels_decode.h) */
    const void *ctx;
} job_t;

static void run_task(const job_t *job, Py_ssize_t task) {
    if (job->run) {
        job->run(job->ctx, task);
        return;
    }
    Py_ssize_t t0 = task * job->per_task, t1 = t0 + job->per_task < job->tiles ? t0 + job->per_task : job->tiles;
    Py_ssize_t r1 = t1 * ROWS < job->w->N ? t1 * ROWS : job->w->N;
    job->rows(job->w, job->a, t0 * ROWS, r1);
}

#ifndef _WIN32
#include <pthread.h>
#include <sched.h>
#define HAVE_POOL 1
#define MAX_WORKERS 63

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time; a second caller runs alone */
static int pool_workers;
static int pool_wanted;           /* workers asked to join the current job */
static uint32_t pool_generation;
static const job_t *pool_job;
static Py_ssize_t pool_tasks;
static int64_t pool_claim;        /* generation << 32 | next task */
static int64_t pool_finished;     /* tasks of the current job done */
static int pool_polling;          /* set during a decode step: idle workers poll for its next job, not sleep */

/* Take and run tasks of job `generation` until none is left; returns how many this thread ran. */
static void claim_tasks(uint32_t generation, const job_t *job, Py_ssize_t tasks) {
    for (;;) {
        int64_t seen = __atomic_load_n(&pool_claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)(seen >> 32) != generation || (seen & 0xffffffff) >= tasks) return;
        if (!__atomic_compare_exchange_n(&pool_claim, &seen, seen + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        run_task(job, (Py_ssize_t)(seen & 0xffffffff));
        __atomic_add_fetch(&pool_finished, 1, __ATOMIC_RELEASE);
    }
}

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *pool_worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = 0;
    pthread_mutex_lock(&pool_mu);
    seen = pool_generation;
    for (;;) {
        while (pool_generation == seen) pthread_cond_wait(&pool_wake, &pool_mu);
        seen = pool_generation;
        if (id >= pool_wanted) continue;
        const job_t *job = pool_job;
        Py_ssize_t tasks = pool_tasks;
        pthread_mutex_unlock(&pool_mu);
        claim_tasks(seen, job, tasks);
        while (__atomic_load_n(&pool_polling, __ATOMIC_ACQUIRE) && __atomic_load_n(&pool_generation, __ATOMIC_ACQUIRE) == seen)
            spin_pause();
        pthread_mutex_lock(&pool_mu);
    }
    return NULL;
}

static void pool_after_fork(void) {   /* the child has no pool threads: start afresh */
    pthread_mutex_init(&pool_mu, NULL);
    pthread_mutex_init(&call_mu, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pool_workers = 0;
    pool_polling = 0;
}

static void run_job(const job_t *job, Py_ssize_t tasks, int threads) {
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1 || tasks <= 1 || pthread_mutex_trylock(&call_mu) != 0) {
        for (Py_ssize_t t = 0; t < tasks; t++) run_task(job, t);
        return;
    }
    pthread_mutex_lock(&pool_mu);
    while (pool_workers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)pool_workers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool_workers++;
    }
    uint32_t generation = pool_generation + 1;
    __atomic_store_n(&pool_generation, generation, __ATOMIC_RELEASE);   /* read unlocked by polling workers */
    pool_wanted = threads - 1;
    pool_job = job;
    pool_tasks = tasks;
    __atomic_store_n(&pool_finished, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&pool_claim, (int64_t)generation << 32, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mu);
    claim_tasks(generation, job, tasks);
    while (__atomic_load_n(&pool_finished, __ATOMIC_ACQUIRE) < tasks) sched_yield();
    pthread_mutex_unlock(&call_mu);
}
#else
static void run_job(const job_t *job, Py_ssize_t tasks, int threads) {
    (void)threads;
    for (Py_ssize_t t = 0; t < tasks; t++) run_task(job, t);
}
#endif

/* ---- activations, shared between the threads ------------------------------------------------------ */

/* Rounding a large batch of activations is a few per cent of its product's time: with two threads or more
 * it runs as a job of its own (ranges of activation rows), so it does not stay serial. */
typedef struct {
    const float *x;
    Py_ssize_t K, nb, M, rows_per_task;
    int k_type, pairs, rowwise;
    quantize_fn quantize;
    quantize_k_fn quantize_k;
    int8_t *q;
    float *d, *s;                  /* q8_0: scales, sums per block; K types: d (M, K / 256) then bsums */
    int16_t *bsums;
} quantize_job_t;

static void quantize_rows(const void *ctx, Py_ssize_t task) {
    const quantize_job_t *c = ctx;
    Py_ssize_t m0 = task * c->rows_per_task, m1 = m0 + c->rows_per_task < c->M ? m0 + c->rows_per_task : c->M;
    if (c->k_type)
        c->quantize_k(c->x + m0 * c->K, m1 - m0, c->K, c->q + m0 * c->K, c->d + m0 * (c->K / QKK),
                      c->bsums + m0 * (c->K / 16));
    else
        c->quantize(c->x + m0 * c->K, m1 - m0, c->K, c->nb, c->pairs, c->rowwise, c->q + m0 * c->nb * QK,
                    c->d + m0 * c->nb, c->s + m0 * c->nb);
}

#define SHARED_QUANTIZE (1 << 16)   /* activations (M K) from which the threads share their rounding */

/* ---- Python entry points ---------------------------------------------------------------------- */

PyDoc_STRVAR(linear_doc,
"linear(isa, threads, fmt, w, w_stride, scale, scale_stride, zero, zero_stride, group_blocks,\n"
"       signed_nibbles, bias, N, K, x, M, y, rowwise)\n\n"
"y (M, N float32) = x (M, K float32) @ W.T + bias, W packed as `fmt` (0 int8 rows, 1 q8_0, 2 q4_0,\n"
"3 int4 rows, 4 q4_1, 5 q5_0, 6 q5_1, 7 iq4_nl, 8 q2_k, 9 q3_k, 10 q4_k, 11 q5_k, 12 q6_k, 13 iq4_xs). Every array argument is an address (int; 0 for none) of contiguous memory the caller\n"
"keeps alive for the call. `rowwise`: one activation scale per row instead of per block of 32.\n"
"`isa`: a name of ISAS. Releases the GIL while it runs.");

static PyObject *linear(PyObject *self, PyObject *args) {
    const char *isa;
    int threads, fmt, signed_nibbles, rowwise;
    unsigned long long w_ptr, scale_ptr, zero_ptr, bias_ptr, x_ptr, y_ptr;
    Py_ssize_t w_stride, scale_stride, zero_stride, group_blocks, N, K, M;
    if (!PyArg_ParseTuple(args, "siiKnKnKnniKnnKnKi", &isa, &threads, &fmt, &w_ptr, &w_stride, &scale_ptr,
                          &scale_stride, &zero_ptr, &zero_stride, &group_blocks, &signed_nibbles, &bias_ptr, &N, &K,
                          &x_ptr, &M, &y_ptr, &rowwise))
        return NULL;
    rows_fn rows = NULL;
    quantize_fn quantize = NULL;
    quantize_k_fn quantize_k = NULL;
    for (int i = 0; i < N_ISAS; i++)
        if (strcmp(isa, ALL_ISAS[i].name) == 0 && isa_ok[i]) {
            rows = rows_for(i, fmt);
            quantize = ALL_ISAS[i].quantize;
            quantize_k = ALL_ISAS[i].quantize_k;
        }
    if (rows == NULL) return PyErr_Format(PyExc_ValueError, "no %s kernels on this CPU", isa);
    if (fmt < F_I8 || fmt > F_LAST || N < 1 || K < 1 || M < 0 || !w_ptr || !x_ptr || !y_ptr)
        return PyErr_Format(PyExc_ValueError, "bad arguments: fmt %d, N %zd, K %zd, M %zd", fmt, N, K, M);
    if ((fmt != F_I8 && K % QK) || (fmt > F_I4 && is_k_format(fmt) && K % QKK) || ((fmt == F_I8 || fmt == F_I4) && !scale_ptr) ||
        (fmt == F_I4 && (group_blocks < 1 || (!signed_nibbles && !zero_ptr))))
        return PyErr_Format(PyExc_ValueError, "format %d does not fit K %zd with these parts", fmt, K);
    if (M == 0) Py_RETURN_NONE;
    weight_t w = {fmt, (const uint8_t *)(uintptr_t)w_ptr, w_stride, (const void *)(uintptr_t)scale_ptr, scale_stride,
                  (const uint8_t *)(uintptr_t)zero_ptr, zero_stride, group_blocks, signed_nibbles,
                  (const float *)(uintptr_t)bias_ptr, N, K, (K + QK - 1) / QK, 0};
    Py_ssize_t nb = w.nb;
    int k_type = fmt > F_I4 && is_k_format(fmt);
    int8_t *q = malloc((size_t)(M * nb * QK) + 64);
    float *d = malloc(sizeof(float) * (size_t)(M * nb) * 2);     /* q8_K's scales and sums fit in there too */
    if (!q || !d) {
        free(q);
        free(d);
        return PyErr_NoMemory();
    }
    act_t a = {q, d, d + M * nb, M, (float *)(uintptr_t)y_ptr, (const int16_t *)(d + M * nb)};
    Py_BEGIN_ALLOW_THREADS
    quantize_job_t rounding = {(const float *)(uintptr_t)x_ptr, K, nb, M, M, k_type, fmt == F_I4, rowwise, quantize,
                               quantize_k, q, d, d + M * nb, (int16_t *)(d + M * nb)};
    Py_ssize_t rounding_tasks = 1;
    if (threads > 1 && M > 1 && M * K >= SHARED_QUANTIZE) {
        rounding.rows_per_task = (M + 2 * (Py_ssize_t)threads - 1) / (2 * (Py_ssize_t)threads);
        rounding_tasks = (M + rounding.rows_per_task - 1) / rounding.rows_per_task;
    }
    job_t rounding_job = {NULL, NULL, NULL, 0, 0, quantize_rows, &rounding};
    run_job(&rounding_job, rounding_tasks, threads);
    Py_ssize_t tiles = (N + ROWS - 1) / ROWS;
    /* Tasks of at least ~64 Ki multiply-adds, at most 4 per thread. */
    Py_ssize_t work_per_tile = ROWS * K * M, per_task = (65536 + work_per_tile - 1) / work_per_tile;
    Py_ssize_t even = (tiles + 4 * (Py_ssize_t)threads - 1) / (4 * (Py_ssize_t)threads);
    if (per_task < even) per_task = even;
    if (per_task < 1) per_task = 1;
    job_t job = {&w, &a, rows, tiles, per_task, NULL, NULL};
    run_job(&job, (tiles + per_task - 1) / per_task, threads);
    Py_END_ALLOW_THREADS
    free(q);
    free(d);
    Py_RETURN_NONE;
}

/* ---- batch-1 decode steps ------------------------------------------------------------------------ */
#include "_matmul_kernels_decode.h"

/* ---- the forward pass over many tokens ------------------------------------------------------------ */
#include "_matmul_kernels_forward.h"

static PyMethodDef METHODS[] = {
    {"linear", linear, METH_VARARGS, linear_doc},
    {"decode", decode, METH_VARARGS, decode_doc},
    {"forward", forward, METH_VARARGS, forward_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_matmul_kernels",
    "Matrix products on packed quantized weights; see quantizers/fast_linear.py.", -1, METHODS,
};

PyMODINIT_FUNC PyInit__matmul_kernels(void) {
    PyObject *module = PyModule_Create(&MODULE);
    if (module == NULL) return NULL;
#ifdef HAVE_X86_KERNELS
    __builtin_cpu_init();
#endif
    for (int i = 0; i < N_ISAS; i++) {
        const char *name = ALL_ISAS[i].name;
        isa_ok[i] = strcmp(name, "generic") == 0;
#ifdef HAVE_X86_KERNELS
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        if (strcmp(name, "avx2") == 0) isa_ok[i] = avx2;
#ifdef HAVE_VNNI_KERNELS
        if (strcmp(name, "avxvnni") == 0) isa_ok[i] = avx2 && __builtin_cpu_supports("avxvnni");
        if (strcmp(name, "avx512vnni") == 0)
            isa_ok[i] = avx2 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
#endif
    }
    /* ISAS: the kernels this CPU runs, best first. */
    PyObject *isas = PyTuple_New(0);
    for (int i = 0; isas && i < N_ISAS; i++) {
        if (!isa_ok[i]) continue;
        PyObject *name = PyUnicode_FromString(ALL_ISAS[i].name);
        if (name == NULL || _PyTuple_Resize(&isas, PyTuple_GET_SIZE(isas) + 1) < 0) {
            Py_XDECREF(name);
            Py_CLEAR(isas);
            break;
        }
        PyTuple_SET_ITEM(isas, PyTuple_GET_SIZE(isas) - 1, name);
    }
    if (isas == NULL || PyModule_AddObject(module, "ISAS", isas) < 0) {
        Py_XDECREF(isas);
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "DECODE_LAYER_FIELDS", LAYER_FIELDS) < 0 ||
        PyModule_AddIntConstant(module, "DECODE_WEIGHT_FIELDS", WEIGHT_FIELDS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#ifdef HAVE_POOL
    pthread_atfork(NULL, NULL, pool_after_fork);
#endif
    return module;
}
