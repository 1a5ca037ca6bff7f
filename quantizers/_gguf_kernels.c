/* GGUF block quantization (q8_0, q4_0, q4_1, q5_0, q5_1) in one pass per block.
 *
 * The accelerated path of quantizers/gguf_blocks.py, which also holds the reference in eager
 * torch (used wherever this extension was not built) and the byte layouts. Both reproduce
 * gguf-py's `gguf.quants.quantize` byte for byte: the same float32 operations in the same
 * order (a division stays a division; this file is built without -ffast-math and with
 * -ffp-contract=off, so nothing is fused or reassociated). tests/test_quant_gguf.py checks
 * this extension, the torch path and gguf-py against each other.
 *
 * Why C: eager torch runs each step (abs, max, scale, round, pack) as its own pass over the
 * data, 7 to 9 passes per block type; here a block of 32 floats is read once and its bytes
 * written once. Two implementations of each kernel, checked against each other and gguf-py:
 * _gguf_kernels_avx2.h (x86-64 CPUs with AVX2, picked at run time) and
 * _gguf_kernels_generic.h (GCC/clang vector extensions, no intrinsics: builds and runs
 * anywhere). The GIL is released while a call runs: gguf_blocks.py splits a tensor between
 * threads that call in here side by side.
 *
 * Blocks holding NaN or infinity are not quantized: the call returns the index of the first
 * such block (gguf-py's output for them depends on the CPU's conversion of NaN to integers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "little-endian CPUs only (the kernels store 32-bit lanes as GGUF's little-endian bytes); eager torch runs elsewhere"
#endif

#define BLOCK 32

/* float32(0.5 - 2**-25): trunc(|y| + ROUND) == gguf-py's np_roundf(|y|) (round half away from
 * zero) for |y| < 2**22; q8_0's |y| is at most 127. */
static const float ROUND = 0.49999997f;
static const int32_t EXPONENT = 0x7f800000;   /* bits of +inf: |x| bits >= this is inf or NaN */

/* id = where(d == 0, 0, 1 / d) */
static inline float inverse(float d) { return d == 0.0f ? 0.0f : 1.0f / d; }

/* float32 -> IEEE binary16 bits, round to nearest even (numpy's astype(float16)): overflow to
 * inf, subnormal halves rounded through a float addition that aligns the bits. */
static inline uint16_t half_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint16_t h;
    if (u >= 0x47800000u) {                     /* >= 65536, inf or NaN */
        h = u > 0x7f800000u ? 0x7e00 : 0x7c00;
    } else if (u < 0x38800000u) {               /* below 2**-14: a subnormal half or zero */
        float a, magic = 0.5f;                  /* 2**-1: its ulp is 2**-24, a half's subnormal step */
        memcpy(&a, &u, 4);
        a += magic;
        uint32_t r;
        memcpy(&r, &a, 4);
        h = (uint16_t)(r - 0x3f000000u);
    } else {                                    /* rebias 127 -> 15, round the 13 dropped bits */
        u += 0xc8000fffu + ((u >> 13) & 1u);
        h = (uint16_t)(u >> 13);
    }
    return (uint16_t)(h | sign);
}

static inline void put_half(uint8_t *dst, float f) {
    uint16_t h = half_bits(f);
    dst[0] = (uint8_t)h;                        /* little-endian, as GGUF stores it */
    dst[1] = (uint8_t)(h >> 8);
}

#include "_gguf_kernels_generic.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_KERNELS 1
#include "_gguf_kernels_avx2.h"
#endif
#include "_gguf_kernels_kquants.h"
#include "_gguf_kernels_imatrix.h"
#ifdef HAVE_AVX2_KERNELS
#include "_gguf_kernels_kquants_avx2.h"
#define KQ_AVX2(name) quantize_##name##_avx2, quantize_##name##_weighted_avx2
#else
#define KQ_AVX2(name) NULL, NULL
#endif

typedef void (*kquantize_t)(const float *, uint8_t *);
typedef void (*kweighted_t)(const float *, uint8_t *, const float *);
typedef void (*kdequantize_t)(const uint8_t *, float *);

/* The types quantized a block at a time (K-quant super-blocks of 256, IQ4 blocks): name, weights
 * per block, bytes per block, quantizer, quantizer under importance weights (one per value of the
 * block), dequantizer, and the AVX2 quantizers (the same bytes; NULL where there are none). */
static const struct {
    const char *name; int block, type_size; kquantize_t quantize; kweighted_t weighted; kdequantize_t dequantize;
    kquantize_t quantize_avx2; kweighted_t weighted_avx2;
} KTYPES[] = {
    {"q2_k", SUPER, 84, quantize_q2_k, quantize_q2_k_weighted, dequantize_q2_k, KQ_AVX2(q2_k)},
    {"q3_k", SUPER, 110, quantize_q3_k, quantize_q3_k_weighted, dequantize_q3_k, KQ_AVX2(q3_k)},
    {"q4_k", SUPER, 144, quantize_q4_k, quantize_q4_k_weighted, dequantize_q4_k, KQ_AVX2(q4_k)},
    {"q5_k", SUPER, 176, quantize_q5_k, quantize_q5_k_weighted, dequantize_q5_k, KQ_AVX2(q5_k)},
    {"q6_k", SUPER, 210, quantize_q6_k, quantize_q6_k_weighted, dequantize_q6_k, KQ_AVX2(q6_k)},
    {"iq4_nl", 32, 18, quantize_iq4_nl, quantize_iq4_nl_weighted, dequantize_iq4_nl, NULL, NULL},
    {"iq4_xs", SUPER, 136, quantize_iq4_xs, quantize_iq4_xs_weighted, dequantize_iq4_xs, NULL, NULL},
};

/* Whether any of the n values is NaN or infinite. */
static inline int non_finite(const float *x, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t bits;
        memcpy(&bits, x + i, 4);                /* no type punning through pointers */
        if ((bits & 0x7fffffff) >= EXPONENT) return 1;
    }
    return 0;
}

typedef Py_ssize_t (*kernel_t)(const float *, uint8_t *, Py_ssize_t);

/* Each kernel returns -1 when done, or the index of the first block with NaN or infinity. */
static const struct { const char *name; int type_size; kernel_t generic, avx2; } KERNELS[] = {
#ifdef HAVE_AVX2_KERNELS
    {"q8_0", 34, q8_0_generic, q8_0_avx2}, {"q4_0", 18, q4_0_generic, q4_0_avx2},
    {"q4_1", 20, q4_1_generic, q4_1_avx2}, {"q5_0", 22, q5_0_generic, q5_0_avx2},
    {"q5_1", 24, q5_1_generic, q5_1_avx2},
#else
    {"q8_0", 34, q8_0_generic, NULL}, {"q4_0", 18, q4_0_generic, NULL}, {"q4_1", 20, q4_1_generic, NULL},
    {"q5_0", 22, q5_0_generic, NULL}, {"q5_1", 24, q5_1_generic, NULL},
#endif
};

static int has_avx2;            /* this CPU runs the AVX2 kernels: set once, when the module loads */
static int has_f16c;            /* ... and converts float16 with F16C */

typedef void (*widen_t)(const uint8_t *, float *, int);

/* n float16 values (little-endian bits) to float32: exact. */
static void widen_generic(const uint8_t *h, float *f, int n) {
    for (int i = 0; i < n; i++) f[i] = half_value(h + 2 * i);
}

#ifdef HAVE_AVX2_KERNELS
__attribute__((target("avx,f16c"))) static void widen_f16c(const uint8_t *h, float *f, int n) {
    for (int i = 0; i < n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 2 * i))));
}
#define WIDEN_F16C widen_f16c
#else
#define WIDEN_F16C widen_generic
#endif

PyDoc_STRVAR(quantize_doc,
"quantize(type_name, src, dst, isa) -> int\n\n"
"Quantize the float32 blocks in the buffer `src` (a multiple of 32 values) into `dst` (exactly\n"
"the block bytes they need). Returns -1, or the index of the first block holding NaN or\n"
"infinity (dst is then incomplete). `isa`: one of ISAS, \"avx2\" or \"generic\".\n"
"Releases the GIL while it runs.");

static PyObject *quantize(PyObject *self, PyObject *args) {
    const char *name, *isa;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "sy*w*s", &name, &src, &dst, &isa)) return NULL;
    PyObject *result = NULL;
    kernel_t kernel = NULL;
    int type_size = 0, found = 0;
    for (size_t i = 0; i < sizeof KERNELS / sizeof KERNELS[0]; i++)
        if (strcmp(name, KERNELS[i].name) == 0) {
            found = 1;
            type_size = KERNELS[i].type_size;
            if (strcmp(isa, "generic") == 0) kernel = KERNELS[i].generic;
            else if (strcmp(isa, "avx2") == 0 && has_avx2) kernel = KERNELS[i].avx2;
        }
    Py_ssize_t n = src.len / (BLOCK * (Py_ssize_t)sizeof(float));
    if (!found) {
        PyErr_Format(PyExc_ValueError, "unknown block type %s", name);
    } else if (kernel == NULL) {
        PyErr_Format(PyExc_ValueError, "no %s kernels on this CPU", isa);
    } else if (src.len % (BLOCK * sizeof(float)) || dst.len != n * type_size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd source bytes are not whole blocks for %zd output bytes",
                     name, src.len, dst.len);
    } else {
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = kernel((const float *)src.buf, (uint8_t *)dst.buf, n);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}
PyDoc_STRVAR(half_doc,
"half_bits(src, dst)\n\n"
"float32 values in `src` to IEEE binary16 bits in `dst` (2 bytes each), as every block's\n"
"scale is stored; exposed so that tests can compare it with numpy's astype(float16).");

static PyObject *half(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    PyObject *result = NULL;
    if (src.len % 4 || dst.len != src.len / 2) {
        PyErr_SetString(PyExc_ValueError, "dst must hold 2 bytes per float32 of src");
    } else {
        const float *s = (const float *)src.buf;
        uint8_t *d = (uint8_t *)dst.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < src.len / 4; i++) put_half(d + 2 * i, s[i]);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static int find_ktype(const char *name) {
    for (int i = 0; i < (int)(sizeof KTYPES / sizeof KTYPES[0]); i++)
        if (strcmp(name, KTYPES[i].name) == 0) return i;
    PyErr_Format(PyExc_ValueError, "unknown K-quant or IQ4 type %s", name);
    return -1;
}

PyDoc_STRVAR(kquantize_doc,
"kquantize(type_name, src, dst, weights=None, isa=None, half=False) -> int\n\n"
"Quantize the float32 values in `src` (float16 with `half`, widened exactly a block at a time;\n"
"whole blocks: 256 values, 32 for iq4_nl) to blocks in `dst` (exactly the bytes they need): q2_k .. q6_k, iq4_nl, iq4_xs. `weights`: None, or a float32 buffer\n"
"of one importance per column of a row (its length is the row's); `src` then holds whole rows.\n"
"`isa`: None (the best of ISAS), \"avx2\" or \"generic\"; every one writes the same bytes (a type\n"
"without AVX2 kernels runs the generic ones). Returns -1, or the index of the first block holding\n"
"NaN or infinity (dst is then incomplete). Releases the GIL.");

static PyObject *kquantize(PyObject *self, PyObject *args) {
    const char *name, *isa = NULL;
    int half = 0;
    Py_buffer src, dst, weights = {0};
    PyObject *weights_obj = Py_None;
    if (!PyArg_ParseTuple(args, "sy*w*|Ozp", &name, &src, &dst, &weights_obj, &isa, &half)) return NULL;
    int avx2 = has_avx2;
    if (isa && strcmp(isa, "generic") == 0) {
        avx2 = 0;
    } else if (isa && !(strcmp(isa, "avx2") == 0 && has_avx2)) {
        PyErr_Format(PyExc_ValueError, "no %s kernels on this CPU", isa);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (weights_obj != Py_None && PyObject_GetBuffer(weights_obj, &weights, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    int t = find_ktype(name);
    const Py_ssize_t item = half ? 2 : (Py_ssize_t)sizeof(float);
    Py_ssize_t block = t < 0 ? 1 : KTYPES[t].block, n = src.len / (block * item);
    Py_ssize_t row = weights.buf ? weights.len / (Py_ssize_t)sizeof(float) : block;
    if (t < 0) {
    } else if (src.len % (block * item) || dst.len != n * KTYPES[t].type_size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd source bytes are not whole blocks for %zd output bytes",
                     name, src.len, dst.len);
    } else if (weights.buf && (weights.len % sizeof(float) || row == 0 || row % block
                               || (src.len / item) % row)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes of weights are not one float32 per column of whole rows",
                     name, weights.len);
    } else {
        Py_ssize_t bad = -1;
        const float *x = (const float *)src.buf, *qw = (const float *)weights.buf;
        uint8_t *y = (uint8_t *)dst.buf;
        kquantize_t plain = avx2 && KTYPES[t].quantize_avx2 ? KTYPES[t].quantize_avx2 : KTYPES[t].quantize;
        kweighted_t weighted = avx2 && KTYPES[t].weighted_avx2 ? KTYPES[t].weighted_avx2 : KTYPES[t].weighted;
        widen_t widen = has_f16c ? WIDEN_F16C : widen_generic;
        float wide[SUPER];
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t b = 0; b < n; b++) {
            const float *xb = x + b * block;
            if (half) {                         /* float16 source: this block widened (exactly) first */
                widen((const uint8_t *)src.buf + 2 * b * block, wide, (int)block);
                xb = wide;
            }
            if (non_finite(xb, block)) { bad = b; break; }
            if (qw) weighted(xb, y + b * KTYPES[t].type_size, qw + (b * block) % row);
            else plain(xb, y + b * KTYPES[t].type_size);
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(bad);
    }
    if (weights.buf) PyBuffer_Release(&weights);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(wquantize_doc,
"wquantize(type_name, src, dst, weights) -> int\n\n"
"Quantize whole rows of float32 `src` to q4_0, q4_1, q5_0 or q5_1 blocks in `dst` under importance\n"
"`weights` (float32, one per column; its length is the row's), as llama.cpp does with an importance\n"
"matrix. Returns -1, or the index of the first row holding NaN or infinity. Releases the GIL.");

static PyObject *wquantize(PyObject *self, PyObject *args) {
    const char *name;
    Py_buffer src, dst, weights;
    if (!PyArg_ParseTuple(args, "sy*w*y*", &name, &src, &dst, &weights)) return NULL;
    PyObject *result = NULL;
    int t = -1;
    for (int i = 0; i < (int)(sizeof WTYPES / sizeof WTYPES[0]); i++)
        if (strcmp(name, WTYPES[i].name) == 0) t = i;
    Py_ssize_t row = weights.len / (Py_ssize_t)sizeof(float);
    Py_ssize_t rows = row ? src.len / (Py_ssize_t)sizeof(float) / row : 0;
    if (t < 0) {
        PyErr_Format(PyExc_ValueError, "no weighted kernel for %s", name);
    } else if (row == 0 || row % BLOCK || weights.len % sizeof(float) || src.len != rows * row * (Py_ssize_t)sizeof(float)
               || dst.len != rows * (row / BLOCK) * WTYPES[t].type_size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd source bytes are not whole rows of %zd for %zd output bytes",
                     name, src.len, row, dst.len);
    } else {
        Py_ssize_t bad = -1, row_bytes = row / BLOCK * WTYPES[t].type_size;
        const float *x = (const float *)src.buf, *qw = (const float *)weights.buf;
        uint8_t *y = (uint8_t *)dst.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < rows; r++) {
            if (non_finite(x + r * row, row)) { bad = r; break; }
            WTYPES[t].quantize(x + r * row, y + r * row_bytes, row, qw);
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&weights);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(kdequantize_doc,
"kdequantize(type_name, src, dst)\n\n"
"Blocks in `src` (q2_k .. q6_k, iq4_nl, iq4_xs) to float32 values in `dst`, as\n"
"llama.cpp's to_float computes them. Releases the GIL.");

static PyObject *kdequantize(PyObject *self, PyObject *args) {
    const char *name;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "sy*w*", &name, &src, &dst)) return NULL;
    PyObject *result = NULL;
    int t = find_ktype(name);
    if (t < 0) {
    } else if (src.len % KTYPES[t].type_size || dst.len != src.len / KTYPES[t].type_size * KTYPES[t].block * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes are not whole blocks for %zd output bytes",
                     name, src.len, dst.len);
    } else {
        Py_ssize_t n = src.len / KTYPES[t].type_size;
        const uint8_t *b = (const uint8_t *)src.buf;
        float *y = (float *)dst.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) KTYPES[t].dequantize(b + i * KTYPES[t].type_size, y + i * KTYPES[t].block);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef METHODS[] = {
    {"quantize", quantize, METH_VARARGS, quantize_doc},
    {"half_bits", half, METH_VARARGS, half_doc},
    {"kquantize", kquantize, METH_VARARGS, kquantize_doc},
    {"wquantize", wquantize, METH_VARARGS, wquantize_doc},
    {"kdequantize", kdequantize, METH_VARARGS, kdequantize_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_gguf_kernels",
    "GGUF block quantization kernels; see quantizers/gguf_blocks.py.", -1, METHODS,
};

PyMODINIT_FUNC PyInit__gguf_kernels(void) {
    PyObject *module = PyModule_Create(&MODULE);
    if (module == NULL) return NULL;
#ifdef HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2");
    has_f16c = __builtin_cpu_supports("f16c");
#endif
    /* ISAS: the instruction sets this CPU runs kernels for, best first. */
    PyObject *isas = has_avx2 ? Py_BuildValue("(ss)", "avx2", "generic") : Py_BuildValue("(s)", "generic");
    if (isas == NULL || PyModule_AddObject(module, "ISAS", isas) < 0) {
        Py_XDECREF(isas);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
