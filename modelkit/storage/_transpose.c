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
 * Cache blocking: BLOCK x BLOCK items at a time, so the rows read and written stay in L1 while the
 * block is done. On x86-64 4-byte items go eight rows at a time through an 8 x 8 register transpose where
 * the CPU has AVX2 (chosen when the module loads: about 12% less CPU than SSE2 on a 4096-wide float32
 * matrix, 2026-11-28), else four rows at a time through SSE2's 4 x 4 (part of the base instruction set);
 * elsewhere, and for the other item sizes, portable C.
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
 * halves): half the instructions of the SSE2 path per item. Only data moves: the bits pass unchanged. Built
 * with a target attribute and chosen at run time (`use_avx2`), so the module still loads on any x86-64. */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

__attribute__((target("avx2"))) static void copy_avx2(const plan_t *p, Py_ssize_t i0, Py_ssize_t i1,
                                                      Py_ssize_t j0, Py_ssize_t j1) {
    Py_ssize_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        Py_ssize_t j = j0;
        for (; j + 8 <= j1; j += 8) {
            __m256 r[8], t[8], u[8];
            for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps((const float *)at(p, i + k, j));
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
                _mm256_storeu_ps((float *)bt(p, j + k, i), _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
                _mm256_storeu_ps((float *)bt(p, j + k + 4, i), _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
            }
        }
        if (j < j1) copy_uint32_t(p, i, i + 8, j, j1);
    }
    if (i < i1) copy_sse(p, i, i1, j0, j1);
}
#endif
#endif

static int use_avx2 = 0;        /* set when the module loads, where the CPU has AVX2 */

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
        if (use_avx2) {
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

/* Block by block: each block of a is transposed into a buffer in L1, whose rows are then copied to b
 * (or compared with b's) whole. Going straight from a to b costs 3-4x more where the row strides are
 * powers of two (a 4096-wide float32 matrix): the block's rows then share one cache set, and every
 * partial write of a row of b evicts the others. `compare`: stop at the first block that differs, return 1. */
static int run(const plan_t *p, int compare) {
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

/* use_avx2(on) -> bool: take the AVX2 path for 4-byte items or not (tests compare both); it is taken only
 * where the CPU has AVX2. Returns whether it is taken now. */
static PyObject *set_avx2(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
#if defined(HAVE_AVX2_PATH)
    use_avx2 = on && __builtin_cpu_supports("avx2");
#endif
    return PyBool_FromLong(use_avx2);
}

static PyMethodDef METHODS[] = {
    {"use_avx2", set_avx2, METH_O, "use_avx2(on) -> bool: take the AVX2 path where the CPU has it; whether it is taken"},
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
#if defined(HAVE_AVX2_PATH)
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
    const char *isa = use_avx2 ? "avx2" : "sse2";
#elif defined(__SSE2__)
    const char *isa = "sse2";
#else
    const char *isa = "generic";
#endif
    if (module != NULL && PyModule_AddStringConstant(module, "ISA", isa) < 0) Py_CLEAR(module);
    return module;
}
