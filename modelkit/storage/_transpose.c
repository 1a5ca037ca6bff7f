/* Matrix transposes for the Keras layouts (a Dense kernel is (out, in) in torch, (in, out) in Keras):
 *
 *   transpose(src, dst)         dst[j, i] = src[i, j]
 *   transposed_equal(a, b)      True when a[i, j] == b[j, i] for every i, j, byte for byte
 *
 * Both take 2-D buffers (numpy arrays, memory maps) whose rows may lie anywhere (any row stride, so a
 * band of columns of a larger matrix is a valid argument) but whose items within a row are contiguous,
 * items of 1, 2, 4 or 8 bytes, moved and compared as raw bits (no float arithmetic: NaN payloads and
 * signed zeros pass unchanged, and a NaN equals its own bits). The GIL is released while they run, so
 * callers share a large matrix out between threads by rows.
 *
 * 4-byte items (float32, int32: every large Dense kernel) go tile by tile through registers on x86-64,
 * with the instruction set chosen when the module loads: 16 x 16 tiles in AVX-512 registers where the CPU
 * has AVX-512F, else 8 x 8 in AVX2, else 4 x 4 in SSE2 (part of the base instruction set). AVX-512 and AVX2
 * move each tile straight from a to b (`direct`), a strip of TILE rows of a at a time across STRIP columns,
 * so the STRIP rows of b being written stay in L1 until their lines are whole; the comparison transposes a
 * tile of a in registers and compares it with b's rows there (no store, no memcmp). On a 1 GiB float32 mlp
 * (4096-wide kernels, 4 MiB bands, 2026-11-28) that took 0.16 s of CPU per GiB to transpose and 0.14 s to
 * compare, against 0.21-0.25 s and 0.17-0.20 s for the AVX2 path through a buffer that came before.
 *
 * Other item sizes and SSE2: cache blocking, BLOCK x BLOCK items at a time transposed into a buffer in L1
 * whose rows are then copied to b (or compared with b's) whole (`run`); elsewhere portable C.
 * modelkit/storage/transpose.py is the Python side (and the numpy path where this is not built).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define BLOCK 64

typedef struct {
    const char *a;          /* (rows, cols) */
    Py_ssize_t a_stride;    /* bytes from one row of a to the next */
    char *b;                /* (cols, rows): written by transpose, read by transposed_equal */
    Py_ssize_t b_stride;
    Py_ssize_t rows, cols, item;
} plan_t;

#define MIN(x, y) ((x) < (y) ? (x) : (y))

/* Portable kernels, one per item size: the items of block [i0, i1) x [j0, j1). */
#define SCALAR(T)                                                                                         \
    static void copy_##T(const plan_t *p, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1) {   \
        for (Py_ssize_t i = i0; i < i1; i++) {                                                            \
            const T *row = (const T *)(p->a + i * p->a_stride);                                           \
            for (Py_ssize_t j = j0; j < j1; j++) ((T *)(p->b + j * p->b_stride))[i] = row[j];             \
        }                                                                                                 \
    }
SCALAR(uint8_t)
SCALAR(uint16_t)
SCALAR(uint32_t)
SCALAR(uint64_t)

#if defined(__SSE2__)
/* Four rows of four 32-bit items are transposed in registers (unpack 32-bit, then 64-bit halves). */
static inline const char *at(const plan_t *p, Py_ssize_t i, Py_ssize_t j) { return p->a + i * p->a_stride + j * 4; }
static inline char *bt(const plan_t *p, Py_ssize_t j, Py_ssize_t i) { return p->b + j * p->b_stride + i * 4; }

static void copy_sse(const plan_t *p, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1) {
    Py_ssize_t i = i0;
    for (; i + 4 <= i1; i += 4) {
        Py_ssize_t j = j0;
        for (; j + 4 <= j1; j += 4) {
            const char *s = at(p, i, j);
            __m128i r0 = _mm_loadu_si128((const __m128i *)s);
            __m128i r1 = _mm_loadu_si128((const __m128i *)(s + p->a_stride));
            __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * p->a_stride));
            __m128i r3 = _mm_loadu_si128((const __m128i *)(s + 3 * p->a_stride));
            __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3);
            __m128i t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);
            _mm_storeu_si128((__m128i *)bt(p, j, i), _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)bt(p, j + 1, i), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)bt(p, j + 2, i), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128((__m128i *)bt(p, j + 3, i), _mm_unpackhi_epi64(t2, t3));
        }
        if (j < j1) copy_uint32_t(p, i, i + 4, j, j1);
    }
    if (i < i1) copy_uint32_t(p, i, i1, j0, j1);
}

/* Eight rows of eight 32-bit items through AVX2 registers (unpack 32-bit, shuffle 64-bit pairs, swap 128-bit
 * halves), and sixteen of sixteen through AVX-512's (unpack 32-bit, then 64-bit, then two rounds of 128-bit
 * lane shuffles). Only data moves: the bits pass unchanged. Built with target attributes and chosen at run
 * time (`isa`), so the module still loads on any x86-64. */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define TARGET_AVX2 __attribute__((target("avx2")))
#define TARGET_AVX512 __attribute__((target("avx512f")))

/* Rows [i0, i1) x columns [j0, j1) of a compared with b's transpose item by item: 1 where any differs. */
static int differ_uint32(const plan_t *p, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1) {
    for (Py_ssize_t i = i0; i < i1; i++) {
        const uint32_t *row = (const uint32_t *)(p->a + i * p->a_stride);
        for (Py_ssize_t j = j0; j < j1; j++)
            if (((const uint32_t *)(p->b + j * p->b_stride))[i] != row[j]) return 1;
    }
    return 0;
}

/* r[k] = row k of an 8 x 8 tile in, column k out. */
TARGET_AVX2 static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
    }
}

TARGET_AVX2 static void copy_avx2(const plan_t *p, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1) {
    Py_ssize_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        Py_ssize_t j = j0;
        for (; j + 8 <= j1; j += 8) {
            __m256 r[8];
            for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps((const float *)at(p, i + k, j));
            transpose8(r);
            for (int k = 0; k < 8; k++) _mm256_storeu_ps((float *)bt(p, j + k, i), r[k]);
        }
        if (j < j1) copy_uint32_t(p, i, i + 8, j, j1);
    }
    if (i < i1) copy_sse(p, i, i1, j0, j1);
}

/* One 8 x 8 tile at (i, j): stored into b, or (`compare`) its differences with b's ORed into the result. */
TARGET_AVX2 static inline __m256i tile_avx2(const plan_t *p, Py_ssize_t i, Py_ssize_t j, int compare) {
    __m256 r[8];
    __m256i differ = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps((const float *)at(p, i + k, j));
    transpose8(r);
    for (int k = 0; k < 8; k++) {
        if (!compare)
            _mm256_storeu_ps((float *)bt(p, j + k, i), r[k]);
        else
            differ = _mm256_or_si256(differ, _mm256_xor_si256(_mm256_castps_si256(r[k]),
                                                              _mm256_loadu_si256((const __m256i *)bt(p, j + k, i))));
    }
    return differ;
}

/* r[k] = row k of a 16 x 16 tile in, column k out. After the 32- and 64-bit unpacks, r[4g + c] holds in its
 * 128-bit lane L column 4L + c of rows 4g..4g+3; the two rounds of lane shuffles gather each column's four
 * lanes in row order. */
TARGET_AVX512 static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int k = 0; k < 16; k += 2) {
        t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) {
        r[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
        r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
        r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
        r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    for (int k = 0; k < 4; k++) {              /* 0x88: lanes 0, 2 of each; 0xdd: lanes 1, 3 */
        t[k] = _mm512_shuffle_i32x4(r[k], r[k + 4], 0x88);
        t[k + 4] = _mm512_shuffle_i32x4(r[k], r[k + 4], 0xdd);
        t[k + 8] = _mm512_shuffle_i32x4(r[k + 8], r[k + 12], 0x88);
        t[k + 12] = _mm512_shuffle_i32x4(r[k + 8], r[k + 12], 0xdd);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
        r[k + 4] = _mm512_shuffle_i32x4(t[k + 4], t[k + 12], 0x88);
        r[k + 12] = _mm512_shuffle_i32x4(t[k + 4], t[k + 12], 0xdd);
    }
}

TARGET_AVX512 static inline __m512i tile_avx512(const plan_t *p, Py_ssize_t i, Py_ssize_t j, int compare) {
    __m512i r[16], differ = _mm512_setzero_si512();
    for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_si512((const void *)at(p, i + k, j));
    transpose16(r);
    for (int k = 0; k < 16; k++) {
        if (!compare)
            _mm512_storeu_si512((void *)bt(p, j + k, i), r[k]);
        else
            differ = _mm512_or_si512(differ, _mm512_xor_si512(r[k], _mm512_loadu_si512((const void *)bt(p, j + k, i))));
    }
    return differ;
}

/* Straight from a to b, tile by tile: STRIP columns of a at a time, down all its rows TILE at a time, so the
 * STRIP rows of b being written (STRIP x TILE items: 16 KiB for float32 and AVX-512) stay in L1 until their
 * lines are whole. The items outside whole tiles (the last rows and columns) item by item. `compare`:
 * stop at the first strip of tiles that differs, return 1. */
#define STRIP 256
#define DIRECT(NAME, TILE, TARGET, TILE_FN, DIFFER, ZERO, ANY)                                                   \
    TARGET static int NAME(const plan_t *p, int compare) {                                                     \
        Py_ssize_t rows = p->rows - p->rows % TILE, cols = p->cols - p->cols % TILE;                           \
        for (Py_ssize_t j0 = 0; j0 < cols; j0 += STRIP) {                                                      \
            Py_ssize_t j1 = MIN(j0 + STRIP, cols);                                                             \
            for (Py_ssize_t i = 0; i < rows; i += TILE) {                                                      \
                DIFFER differ = ZERO;                                                                          \
                for (Py_ssize_t j = j0; j < j1; j += TILE) differ = ANY(differ, TILE_FN(p, i, j, compare));   \
                if (compare && !IS_ZERO_##TILE(differ)) return 1;                                              \
            }                                                                                                  \
        }                                                                                                      \
        if (!compare) {                                                                                        \
            copy_uint32_t(p, 0, rows, cols, p->cols);                                                          \
            copy_uint32_t(p, rows, p->rows, 0, p->cols);                                                       \
            return 0;                                                                                          \
        }                                                                                                      \
        return differ_uint32(p, 0, rows, cols, p->cols) || differ_uint32(p, rows, p->rows, 0, p->cols);       \
    }
#define IS_ZERO_8(v) _mm256_testz_si256((v), (v))
#define IS_ZERO_16(v) (_mm512_test_epi64_mask((v), (v)) == 0)
DIRECT(direct_avx2, 8, TARGET_AVX2, tile_avx2, __m256i, _mm256_setzero_si256(), _mm256_or_si256)
DIRECT(direct_avx512, 16, TARGET_AVX512, tile_avx512, __m512i, _mm512_setzero_si512(), _mm512_or_si512)
#endif
#endif

enum { ISA_BASE, ISA_AVX2, ISA_AVX512 };
static int isa = ISA_BASE;        /* for 4-byte items: set when the module loads (`best_isa`), changed by use_isa */

/* One block of `p`: a's rows [i0, i1) x columns [j0, j1), transposed into `tmp` (j1 - j0 rows of
 * BLOCK items), contiguous and so free of cache-set conflicts, whatever a's stride. */
static void to_buffer(const plan_t *p, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1, char *tmp) {
    plan_t q = {p->a + i0 * p->a_stride + j0 * p->item, p->a_stride, tmp, BLOCK * p->item, i1 - i0, j1 - j0, p->item};
    switch (p->item) {
    case 1: copy_uint8_t(&q, 0, q.rows, 0, q.cols); break;
    case 2: copy_uint16_t(&q, 0, q.rows, 0, q.cols); break;
#if defined(__SSE2__)
    case 4:
#if defined(HAVE_AVX2_PATH)
        if (isa >= ISA_AVX2) {
            copy_avx2(&q, 0, q.rows, 0, q.cols);
            break;
        }
#endif
        copy_sse(&q, 0, q.rows, 0, q.cols);
        break;
#else
    case 4: copy_uint32_t(&q, 0, q.rows, 0, q.cols); break;
#endif
    default: copy_uint64_t(&q, 0, q.rows, 0, q.cols); break;
    }
}

/* 4-byte items with AVX2 or AVX-512: `direct`. Otherwise block by block: each block of a is transposed into
 * a buffer in L1, whose rows are then copied to b (or compared with b's) whole. Going straight from a to b
 * a block at a time cost 3-4x more where the row strides are powers of two (a 4096-wide float32 matrix): the
 * block's rows then share one cache set, and every partial write of a row of b evicts the others (`direct`
 * avoids that by keeping a whole strip of b's rows in L1). `compare`: stop at the first block that differs,
 * return 1. */
static int run(const plan_t *p, int compare) {
#if defined(HAVE_AVX2_PATH)
    if (p->item == 4 && isa == ISA_AVX512) return direct_avx512(p, compare);
    if (p->item == 4 && isa == ISA_AVX2) return direct_avx2(p, compare);
#endif
    uint64_t words[BLOCK * BLOCK];          /* BLOCK x BLOCK items of up to 8 bytes, aligned */
    char *tmp = (char *)words;
    Py_ssize_t row = BLOCK * p->item;
    for (Py_ssize_t j0 = 0; j0 < p->cols; j0 += BLOCK) {
        Py_ssize_t j1 = MIN(j0 + BLOCK, p->cols);
        for (Py_ssize_t i0 = 0; i0 < p->rows; i0 += BLOCK) {
            Py_ssize_t i1 = MIN(i0 + BLOCK, p->rows), n = (i1 - i0) * p->item;
            to_buffer(p, i0, i1, j0, j1, tmp);
            for (Py_ssize_t j = j0; j < j1; j++) {
                char *target = p->b + j * p->b_stride + i0 * p->item;
                if (!compare)
                    memcpy(target, tmp + (j - j0) * row, n);
                else if (memcmp(target, tmp + (j - j0) * row, n) != 0)
                    return 1;
            }
        }
    }
    return 0;
}

/* Fill `p` from two buffers, a (rows, cols) and b (cols, rows); 0 with an exception set on a bad argument. */
static int make_plan(plan_t *p, Py_buffer *a, Py_buffer *b) {
    if (a->ndim != 2 || b->ndim != 2) {
        PyErr_SetString(PyExc_ValueError, "both arguments must be 2-D");
        return 0;
    }
    if (a->itemsize != b->itemsize || (a->itemsize != 1 && a->itemsize != 2 && a->itemsize != 4 && a->itemsize != 8)) {
        PyErr_SetString(PyExc_ValueError, "items must be 1, 2, 4 or 8 bytes, the same in both");
        return 0;
    }
    if (a->shape[0] != b->shape[1] || a->shape[1] != b->shape[0]) {
        PyErr_Format(PyExc_ValueError, "shapes (%zd, %zd) and (%zd, %zd) are not each other's transpose",
                     a->shape[0], a->shape[1], b->shape[0], b->shape[1]);
        return 0;
    }
    if ((a->shape[1] > 1 && a->strides[1] != a->itemsize) || (b->shape[1] > 1 && b->strides[1] != b->itemsize)
        || a->strides[0] < 0 || b->strides[0] < 0) {
        PyErr_SetString(PyExc_ValueError, "each row's items must be contiguous and rows in increasing order");
        return 0;
    }
    p->a = (const char *)a->buf;
    p->a_stride = a->strides[0];
    p->b = (char *)b->buf;
    p->b_stride = b->strides[0];
    p->rows = a->shape[0];
    p->cols = a->shape[1];
    p->item = a->itemsize;
    return 1;
}

static PyObject *call(PyObject *args, int compare) {
    PyObject *first, *second;
    if (!PyArg_ParseTuple(args, "OO", &first, &second)) return NULL;
    Py_buffer a, b;
    if (PyObject_GetBuffer(first, &a, PyBUF_STRIDES) < 0) return NULL;
    if (PyObject_GetBuffer(second, &b, compare ? PyBUF_STRIDES : PyBUF_STRIDES | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    plan_t p;
    int differ = 0, ok = make_plan(&p, &a, &b);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        differ = run(&p, compare);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    if (!ok) return NULL;
    if (!compare) Py_RETURN_NONE;
    return PyBool_FromLong(!differ);
}

static PyObject *transpose(PyObject *self, PyObject *args) { (void)self; return call(args, 0); }
static PyObject *transposed_equal(PyObject *self, PyObject *args) { (void)self; return call(args, 1); }

static const char *ISA_NAMES[] = {"sse2", "avx2", "avx512"};

/* The best path for 4-byte items this CPU runs. */
static int best_isa(void) {
#if defined(HAVE_AVX2_PATH)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2")) return ISA_AVX2;
#endif
    return ISA_BASE;
}

/* use_isa(name) -> str: take the path of that name for 4-byte items ("avx512", "avx2", "sse2"; tests compare
 * them), or the best below it where the CPU lacks it; returns the name of the path taken. */
static PyObject *use_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    int want = -1;
    for (int k = 0; name != NULL && k < 3; k++)
        if (strcmp(name, ISA_NAMES[k]) == 0) want = k;
    if (want < 0) {
        PyErr_SetString(PyExc_ValueError, "use_isa takes 'avx512', 'avx2' or 'sse2'");
        return NULL;
    }
    int best = best_isa();
    isa = want < best ? want : best;
#if !defined(__SSE2__)
    return PyUnicode_FromString("generic");
#endif
    return PyUnicode_FromString(ISA_NAMES[isa]);
}

static PyMethodDef METHODS[] = {
    {"use_isa", use_isa, METH_O, "use_isa(name) -> str: the path for 4-byte items ('avx512', 'avx2', 'sse2', or the "
     "best below it the CPU has); the name of the path taken"},
    {"transpose", transpose, METH_VARARGS,
     "transpose(src, dst): dst[j, i] = src[i, j] for 2-D buffers whose rows are contiguous"},
    {"transposed_equal", transposed_equal, METH_VARARGS,
     "transposed_equal(a, b) -> bool: a[i, j] == b[j, i] bit for bit, for every i, j"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_transpose", "Cache-blocked transposes and transposed comparisons; see "
    "modelkit/storage/transpose.py.", -1, METHODS,
};

PyMODINIT_FUNC PyInit__transpose(void) {
    PyObject *module = PyModule_Create(&MODULE);
    isa = best_isa();
#if defined(__SSE2__)
    const char *name = ISA_NAMES[isa];
#else
    const char *name = "generic";
#endif
    if (module != NULL && PyModule_AddStringConstant(module, "ISA", name) < 0) Py_CLEAR(module);
    return module;
}
