/* One decode step of a stack of Llama blocks at batch 1, in one call: _matmul_kernels.c's `decode`
 * (quantizers/fast_decode.py builds its plan; pipeline/tinylm_decoder.py calls it).
 *
 * Per block, on a float32 residual stream x of `hidden` values, with a static key/value cache:
 *   h = rmsnorm(x) * w_attn_norm
 *   q, k, v = h @ Wq.T, h @ Wk.T, h @ Wv.T     one pool job over the rows of all three; h rounded to
 *                                               int8 once per activation kind the three weights read
 *   q, k = rmsnorm(each head) * w_q_norm, ...   where the plan has per-head query/key norms (Qwen3)
 *   rotate q and k by the position (the "rotate half" layout of cos/sin rows), store k, v in the cache
 *   y = softmax(q K.T / sqrt(head_dim)) V        per query head over positions 0..pos of its key/value
 *                                                head (grouped-query), one pool task per head
 *   x += y @ Wo.T
 *   h = rmsnorm(x) * w_mlp_norm
 *   a = silu(h @ Wgate.T) * (h @ Wup.T)          one pool job: each task takes the same rows of gate
 *                                                and up, then their SwiGLU
 *   x += a @ Wdown.T
 * then the final rmsnorm, and the output head when the plan has one. The weight products are the
 * kernels of `linear` (ALL_ISAS' rows / more_rows on quantize / quantize_k activations), unchanged.
 *
 * The pool's workers poll for the next job while a step runs (pool_polling) instead of sleeping
 * between its ~50 jobs; they go back to sleep when it returns.
 */

#define DECODE_WEIGHTS 7           /* q, k, v, o, gate, up, down */
#define WEIGHT_FIELDS 13           /* fmt, w, w_stride, scale, scale_stride, zero, zero_stride, group_blocks,
                                      signed_nibbles, bias, N, K (addresses as integers; 0 for none), rowwise
                                      (1: one activation scale per row, int8-dynamic's, as `linear`'s rowwise) */
#define LAYER_FIELDS (DECODE_WEIGHTS * WEIGHT_FIELDS + 4)   /* then the attention and MLP norm weights' addresses,
                                                               the per-head query and key norms' (0: none) */
#define DECODE_SPLIT_BYTES 32768   /* a product shares its rows between threads from this many weight bytes */
#ifndef FORWARD_SPLIT_WORK
#define FORWARD_SPLIT_WORK (1 << 18) /* ... or, over several activation rows, this many multiply-adds */
#endif

enum { ACT_Q8_0, ACT_PAIRS, ACT_Q8_K, ACT_ROWWISE, ACT_KINDS };

static inline int act_kind(const weight_t *w) {
    int fmt = w->fmt;
    return w->rowwise ? ACT_ROWWISE : fmt == F_I4 ? ACT_PAIRS : fmt > F_I4 && is_k_format(fmt) ? ACT_Q8_K : ACT_Q8_0;
}

/* One weight of the plan -> weight_t, checked as `linear` checks its arguments. */
static int plan_weight(const int64_t *f, weight_t *w) {
    int fmt = (int)f[0];
    Py_ssize_t K = (Py_ssize_t)f[11];
    *w = (weight_t){fmt, (const uint8_t *)(uintptr_t)f[1], (Py_ssize_t)f[2], (const void *)(uintptr_t)f[3],
                    (Py_ssize_t)f[4], (const uint8_t *)(uintptr_t)f[5], (Py_ssize_t)f[6], (Py_ssize_t)f[7],
                    (int)f[8], (const float *)(uintptr_t)f[9], (Py_ssize_t)f[10], K, (K + QK - 1) / QK, (int)f[12]};
    if ((w->rowwise && fmt != F_I8) || fmt < F_I8 || fmt > F_LAST || w->N < 1 || K < 1 || !w->w) return 0;
    if ((fmt != F_I8 && K % QK) || (fmt > F_I4 && is_k_format(fmt) && K % QKK) ||
        ((fmt == F_I8 || fmt == F_I4) && !w->scale) || (fmt == F_I4 && (w->group_blocks < 1 || (!w->signed_nibbles && !w->zero))))
        return 0;
    return 1;
}

/* Every weight of one layer of the plan (checked once per call by check_plan). */
static void plan_layer_weights(const int64_t *f, weight_t w[DECODE_WEIGHTS]) {
    for (int i = 0; i < DECODE_WEIGHTS; i++) plan_weight(f + i * WEIGHT_FIELDS, &w[i]);
}

/* The index of `name` in ALL_ISAS where this CPU runs it; else -1 with ValueError set. */
static int isa_index(const char *name) {
    for (int i = 0; i < N_ISAS; i++)
        if (strcmp(name, ALL_ISAS[i].name) == 0 && isa_ok[i]) return i;
    PyErr_Format(PyExc_ValueError, "no %s kernels on this CPU", name);
    return -1;
}

/* The plan's products chain (q, k, v: (nq | nkv, hidden), o: (hidden, nq), gate, up: (inter, hidden), down:
 * (hidden, inter)), every layer has its norms, the head (if any; read into `head`) reads `hidden` columns:
 * checked once per call, so the layers read them unchecked. 0 with ValueError set (naming `what`) when not. */
static int check_plan(const char *what, const int64_t *plan, Py_ssize_t layers, Py_ssize_t hidden, Py_ssize_t nq,
                      Py_ssize_t nkv, Py_ssize_t inter, unsigned long long head_ptr, weight_t *head) {
    const Py_ssize_t shapes[DECODE_WEIGHTS][2] = {{nq, hidden}, {nkv, hidden}, {nkv, hidden}, {hidden, nq},
                                                   {inter, hidden}, {inter, hidden}, {hidden, inter}};
    for (Py_ssize_t l = 0; l < layers; l++) {
        const int64_t *f = plan + l * LAYER_FIELDS;
        for (int i = 0; i < DECODE_WEIGHTS; i++) {
            weight_t w;
            if (!plan_weight(f + i * WEIGHT_FIELDS, &w) || w.N != shapes[i][0] || w.K != shapes[i][1]) {
                PyErr_Format(PyExc_ValueError, "%s: layer %zd weight %d is not a (%zd, %zd) packed weight", what, l, i,
                             shapes[i][0], shapes[i][1]);
                return 0;
            }
        }
        if (!f[DECODE_WEIGHTS * WEIGHT_FIELDS] || !f[DECODE_WEIGHTS * WEIGHT_FIELDS + 1]) {
            PyErr_Format(PyExc_ValueError, "%s: layer %zd has no norm weights", what, l);
            return 0;
        }
    }
    if (head_ptr && (!plan_weight((const int64_t *)(uintptr_t)head_ptr, head) || head->K != hidden)) {
        PyErr_Format(PyExc_ValueError, "%s: the head is not a packed weight of %zd columns", what, hidden);
        return 0;
    }
    return 1;
}

/* A layer's norm weight i of the plan: 0 attention, 1 MLP, 2 and 3 the per-head query and key norms (NULL: none). */
static inline const float *plan_norm(const int64_t *f, int i) {
    return (const float *)(uintptr_t)f[DECODE_WEIGHTS * WEIGHT_FIELDS + i];
}

/* ---- attention of one query head and SwiGLU: portable, and AVX2 where the kernels are ------------- */

typedef struct {
    const float *q;                /* (heads, hd), rotated */
    const float *keys, *values;    /* this layer's (kv_heads, window, hd) */
    float *y, *scores;             /* (heads, hd); (heads, window) scratch */
    Py_ssize_t groups, hd, window, positions;
    float scale;
} attention_t;

typedef void (*attend_fn)(const attention_t *, const float *q, const float *keys, const float *values, float *scores,
                          float *y);
typedef void (*swiglu_fn)(const float *gate, const float *up, float *act, Py_ssize_t n);

/* y = softmax(q . keys[t] * scale over t < positions) . values */
static void attend_generic(const attention_t *at, const float *q, const float *keys, const float *values, float *scores,
                           float *y) {
    const Py_ssize_t hd = at->hd;
    float top = -INFINITY, total = 0.0f;
    for (Py_ssize_t t = 0; t < at->positions; t++) {
        const float *k = keys + t * hd;
        float s[8] = {0}, tail = 0.0f;
        Py_ssize_t i = 0;
        for (; i + 8 <= hd; i += 8)
            for (int j = 0; j < 8; j++) s[j] += q[i + j] * k[i + j];
        for (; i < hd; i++) tail += q[i] * k[i];
        scores[t] = (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail) * at->scale;
        top = scores[t] > top ? scores[t] : top;
    }
    for (Py_ssize_t t = 0; t < at->positions; t++) total += scores[t] = expf(scores[t] - top);
    memset(y, 0, sizeof(float) * (size_t)hd);
    for (Py_ssize_t t = 0; t < at->positions; t++)
        for (Py_ssize_t i = 0; i < hd; i++) y[i] += scores[t] * values[t * hd + i];
    float inverse = 1.0f / total;
    for (Py_ssize_t i = 0; i < hd; i++) y[i] *= inverse;
}

static void swiglu_generic(const float *gate, const float *up, float *act, Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < n; r++) act[r] = gate[r] / (1.0f + expf(-gate[r])) * up[r];
}

#ifdef HAVE_X86_KERNELS
#define AVX2_FMA __attribute__((target("avx2,fma")))

/* e**x in each lane (Cody-Waite reduction to [-ln2/2, ln2/2], degree-6 polynomial: Cephes' expf
 * coefficients; within 2 ulp of expf). Lanes below -87.3 give 0, above 88.37 e**88.37. */
AVX2_FMA static inline __m256 exp_avx2(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.33654f);
    __m256 tiny = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Lane j: the sum of v[j]'s lanes. */
AVX2_FMA static inline __m256 sum8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* As attend_generic: scores of eight positions at a time (one register of sums), softmax in registers of
 * eight, and the weighted values summed in four registers of the output at a time. */
AVX2_FMA static void attend_avx2(const attention_t *at, const float *q, const float *keys, const float *values,
                                 float *scores, float *y) {
    const Py_ssize_t hd = at->hd, whole = hd / 8 * 8, P = at->positions;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (Py_ssize_t t0 = 0; t0 < P; t0 += 8) {
        int n = P - t0 < 8 ? (int)(P - t0) : 8;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (Py_ssize_t i = 0; i < whole; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            for (int j = 0; j < n; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(keys + (t0 + j) * hd + i), qv, acc[j]);
        }
        float s[8];
        _mm256_storeu_ps(s, sum8(acc));
        for (int j = 0; j < n; j++) {
            for (Py_ssize_t i = whole; i < hd; i++) s[j] += q[i] * keys[(t0 + j) * hd + i];
            s[j] *= at->scale;
        }
        for (int j = n; j < 8; j++) s[j] = -INFINITY;
        _mm256_storeu_ps(scores + t0, _mm256_loadu_ps(s));      /* the window's scratch row has room for 8 past P */
        top = _mm256_max_ps(top, _mm256_loadu_ps(s));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    __m256 vtop = _mm256_set1_ps(_mm_cvtss_f32(m)), vtotal = _mm256_setzero_ps();
    for (Py_ssize_t t0 = 0; t0 < P; t0 += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + t0), vtop));      /* -inf past P: 0 */
        _mm256_storeu_ps(scores + t0, e);
        vtotal = _mm256_add_ps(vtotal, e);
    }
    __m256 totals[8] = {vtotal, vtotal, vtotal, vtotal, vtotal, vtotal, vtotal, vtotal};
    __m256 inverse = _mm256_div_ps(_mm256_set1_ps(1.0f), sum8(totals));
    Py_ssize_t i = 0;
    for (; i + 32 <= whole; i += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (Py_ssize_t t = 0; t < P; t++) {
            const float *v = values + t * hd + i;
            __m256 p = _mm256_set1_ps(scores[t]);
            a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(y + i, _mm256_mul_ps(a0, inverse));
        _mm256_storeu_ps(y + i + 8, _mm256_mul_ps(a1, inverse));
        _mm256_storeu_ps(y + i + 16, _mm256_mul_ps(a2, inverse));
        _mm256_storeu_ps(y + i + 24, _mm256_mul_ps(a3, inverse));
    }
    for (; i < whole; i += 8) {
        __m256 a = _mm256_setzero_ps();
        for (Py_ssize_t t = 0; t < P; t++) a = _mm256_fmadd_ps(_mm256_set1_ps(scores[t]), _mm256_loadu_ps(values + t * hd + i), a);
        _mm256_storeu_ps(y + i, _mm256_mul_ps(a, inverse));
    }
    for (; i < hd; i++) {
        float a = 0.0f;
        for (Py_ssize_t t = 0; t < P; t++) a += scores[t] * values[t * hd + i];
        y[i] = a * _mm256_cvtss_f32(inverse);
    }
}

AVX2_FMA static void swiglu_avx2(const float *gate, const float *up, float *act, Py_ssize_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    Py_ssize_t r = 0;
    for (; r + 8 <= n; r += 8) {
        __m256 g = _mm256_loadu_ps(gate + r);
        __m256 sigmoid = _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_xor_ps(g, sign))));
        _mm256_storeu_ps(act + r, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + r)));
    }
    swiglu_generic(gate + r, up + r, act + r, n - r);
}
#endif

/* ---- norms and rotary ------------------------------------------------------------------------- */

/* out = x / sqrt(mean(x^2) + eps) * weight, as tinylm's and Llama's RMSNorm (float32); out may be x. */
static void rmsnorm(const float *x, const float *weight, Py_ssize_t n, float eps, float *out) {
    float s[8] = {0};
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += x[i + j] * x[i + j];
    float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) total += x[i] * x[i];
    float inverse = 1.0f / sqrtf(total / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inverse);
}

/* Rotate each of `heads` vectors of head_dim values by one position: x * cos + rotate_half(x) * sin. */
static void rotate(float *x, Py_ssize_t heads, Py_ssize_t hd, const float *cos, const float *sin) {
    Py_ssize_t half = hd / 2;
    for (Py_ssize_t h = 0; h < heads; h++, x += hd)
        for (Py_ssize_t i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

/* One token's q, k (heads x hd, kv_heads x hd) made ready: per-head norms (Qwen3; NULL: none), the rotary at its
 * position (cos, sin: that position's rows); then its k and v stored at `pos` of the (kv_heads, window, hd) cache. */
typedef struct {
    const float *q_norm, *k_norm;
    float eps;
    Py_ssize_t heads, kv_heads, hd;
} head_norms_t;

static void place_row(const head_norms_t *n, float *q, float *k, const float *v, const float *cos, const float *sin,
                      float *keys, float *values, Py_ssize_t window, Py_ssize_t pos) {
    const Py_ssize_t hd = n->hd;
    if (n->q_norm)
        for (Py_ssize_t i = 0; i < n->heads; i++) rmsnorm(q + i * hd, n->q_norm, hd, n->eps, q + i * hd);
    if (n->k_norm)
        for (Py_ssize_t i = 0; i < n->kv_heads; i++) rmsnorm(k + i * hd, n->k_norm, hd, n->eps, k + i * hd);
    rotate(q, n->heads, hd, cos, sin);
    rotate(k, n->kv_heads, hd, cos, sin);
    for (Py_ssize_t g = 0; g < n->kv_heads; g++) {
        memcpy(keys + (g * window + pos) * hd, k + g * hd, sizeof(float) * (size_t)hd);
        memcpy(values + (g * window + pos) * hd, v + g * hd, sizeof(float) * (size_t)hd);
    }
}

/* ---- activations: one input, rounded once per kind the weights reading it need ------------------ */

typedef struct {
    int8_t *q[ACT_KINDS];
    float *d[ACT_KINDS], *s[ACT_KINDS];
    int16_t *bsums;
} act_bufs_t;

typedef struct {
    const float *x;
    Py_ssize_t K;
    int done[ACT_KINDS];
} input_t;

/* The activations of `in` as weight `w` reads them (rounded on first use), writing to y. */
static act_t input_act(int isa, const act_bufs_t *b, input_t *in, const weight_t *w, float *y) {
    int kind = act_kind(w);
    if (!in->done[kind]) {
        if (kind == ACT_Q8_K)
            ALL_ISAS[isa].quantize_k(in->x, 1, in->K, b->q[kind], b->d[kind], b->bsums);
        else
            ALL_ISAS[isa].quantize(in->x, 1, in->K, w->nb, kind == ACT_PAIRS, kind == ACT_ROWWISE, b->q[kind], b->d[kind],
                                   b->s[kind]);
        in->done[kind] = 1;
    }
    return (act_t){b->q[kind], b->d[kind], b->s[kind], 1, y, b->bsums};
}

/* ---- jobs: several products in one pool job, attention heads ------------------------------------- */

#define MAX_PARTS 3

typedef struct {
    const weight_t *w[MAX_PARTS];
    act_t a[MAX_PARTS];
    rows_fn rows[MAX_PARTS];
    int n;
    swiglu_fn swiglu;              /* or NULL: parts 0 and 1 (gate, up; same N) in step, act = silu(gate) * up */
    float *act;
    Py_ssize_t per_task[MAX_PARTS], first[MAX_PARTS + 1];   /* tiles per task; each part's first task */
} products_t;

static void products_task(const void *ctx, Py_ssize_t task) {
    const products_t *p = ctx;
    int i = 0;
    while (i + 1 < p->n && task >= p->first[i + 1]) i++;
    Py_ssize_t tiles = (p->w[i]->N + ROWS - 1) / ROWS, t0 = (task - p->first[i]) * p->per_task[i];
    Py_ssize_t t1 = t0 + p->per_task[i] < tiles ? t0 + p->per_task[i] : tiles;
    Py_ssize_t r0 = t0 * ROWS, r1 = t1 * ROWS < p->w[i]->N ? t1 * ROWS : p->w[i]->N;
    if (!p->swiglu) {
        p->rows[i](p->w[i], &p->a[i], r0, r1);
        return;
    }
    p->rows[0](p->w[0], &p->a[0], r0, r1);
    p->rows[1](p->w[1], &p->a[1], r0, r1);
    Py_ssize_t N = p->w[0]->N;
    for (Py_ssize_t m = 0; m < p->a[0].M; m++)          /* outputs are (M, N): these rows of each activation row */
        p->swiglu(p->a[0].y + m * N + r0, p->a[1].y + m * N + r0, p->act + m * N + r0, r1 - r0);
}

static Py_ssize_t weight_bytes(const weight_t *w) { return w->N * w->w_stride; }

/* Run the products (their acts set up), split between `threads` where they are large enough: one activation
 * row from DECODE_SPLIT_BYTES of weights, several (the forward of _matmul_kernels_forward.h) from
 * FORWARD_SPLIT_WORK multiply-adds. */
static void run_products(products_t *p, int threads) {
    Py_ssize_t bytes = 0, work = 0, tasks = 0;
    for (int i = 0; i < p->n; i++) {
        bytes += weight_bytes(p->w[i]);
        work += p->w[i]->N * p->w[i]->K * p->a[i].M;
    }
    if (p->a[0].M == 1 ? bytes < DECODE_SPLIT_BYTES : work < FORWARD_SPLIT_WORK) threads = 1;
    int counted = p->swiglu ? 1 : p->n;      /* SwiGLU: the tasks walk gate's rows (up's are the same) */
    for (int i = 0; i < counted; i++) {
        Py_ssize_t tiles = (p->w[i]->N + ROWS - 1) / ROWS;
        Py_ssize_t per = threads > 1 ? (tiles + 4 * threads - 1) / (4 * threads) : tiles;
        p->per_task[i] = per < 1 ? 1 : per;
        p->first[i] = tasks;
        tasks += (tiles + p->per_task[i] - 1) / p->per_task[i];
    }
    p->n = counted;
    p->first[counted] = tasks;
    job_t job = {0};
    job.run = products_task;
    job.ctx = p;
    run_job(&job, tasks, threads);
}

typedef struct {
    const attention_t *at;
    attend_fn attend;
} attention_job_t;

static void attention_task(const void *ctx, Py_ssize_t h) {
    const attention_job_t *job = ctx;
    const attention_t *at = job->at;
    Py_ssize_t kv = (h / at->groups) * at->window * at->hd;
    job->attend(at, at->q + h * at->hd, at->keys + kv, at->values + kv, at->scores + h * (at->window + 8),
                at->y + h * at->hd);
}

/* ---- the step ---------------------------------------------------------------------------------- */

typedef struct {
    int isa, threads;
    Py_ssize_t hidden, heads, kv_heads, hd, inter, window, pos, layer_stride;
    float eps;
    const float *cos, *sin;        /* rows at pos */
    float *keys, *values;          /* layer 0 of this sequence's slot: (kv_heads, window, hd) */
} step_t;

static void one_product(const step_t *s, const act_bufs_t *b, input_t *in, const weight_t *w, float *y) {
    products_t p = {{w}, {input_act(s->isa, b, in, w, y)}, {rows_for(s->isa, w->fmt)}, 1};
    run_products(&p, s->threads);
}

/* The attention and SwiGLU kernels of an ISA: AVX2 ones for every x86 ISA (they all run AVX2 and FMA). */
static void block_kernels(int isa, attend_fn *attend, swiglu_fn *swiglu) {
    *attend = attend_generic;
    *swiglu = swiglu_generic;
#ifdef HAVE_X86_KERNELS
    if (strcmp(ALL_ISAS[isa].name, "generic") != 0) {
        *attend = attend_avx2;
        *swiglu = swiglu_avx2;
    }
#endif
}

static void decode_layers(const step_t *s, const int64_t *plan, Py_ssize_t layers, float *x, const act_bufs_t *b,
                          float *work) {
    Py_ssize_t C = s->hidden, nq = s->heads * s->hd, nkv = s->kv_heads * s->hd;
    float *h = work, *q = h + (C > s->inter ? C : s->inter), *k = q + nq, *v = k + nkv, *y = v + nkv, *o = y + nq;
    float *gate = o + C, *up = gate + s->inter, *act = up + s->inter, *scores = act + s->inter;
    attend_fn attend;
    swiglu_fn swiglu;
    block_kernels(s->isa, &attend, &swiglu);
    for (Py_ssize_t l = 0; l < layers; l++) {
        const int64_t *f = plan + l * LAYER_FIELDS;
        weight_t w[DECODE_WEIGHTS];
        plan_layer_weights(f, w);
        const float *attn_norm = plan_norm(f, 0), *mlp_norm = plan_norm(f, 1);
        float *keys = s->keys + l * s->layer_stride, *values = s->values + l * s->layer_stride;

        rmsnorm(x, attn_norm, C, s->eps, h);
        input_t in = {h, C, {0}};
        products_t qkv = {{&w[0], &w[1], &w[2]}, {input_act(s->isa, b, &in, &w[0], q), input_act(s->isa, b, &in, &w[1], k),
                          input_act(s->isa, b, &in, &w[2], v)}, {0}, 3};
        for (int i = 0; i < 3; i++) qkv.rows[i] = rows_for(s->isa, w[i].fmt);
        run_products(&qkv, s->threads);
        const head_norms_t norms = {plan_norm(f, 2), plan_norm(f, 3), s->eps, s->heads, s->kv_heads, s->hd};
        place_row(&norms, q, k, v, s->cos, s->sin, keys, values, s->window, s->pos);
        attention_t at = {q, keys, values, y, scores, s->heads / s->kv_heads, s->hd, s->window, s->pos + 1,
                          1.0f / sqrtf((float)s->hd)};
        attention_job_t heads_job = {&at, attend};
        job_t job = {0};
        job.run = attention_task;
        job.ctx = &heads_job;
        /* Heads share threads once each has a few thousand multiply-adds. */
        run_job(&job, s->heads, s->heads * (s->pos + 1) * s->hd >= 8192 ? s->threads : 1);

        input_t attended = {y, nq, {0}};
        one_product(s, b, &attended, &w[3], o);
        for (Py_ssize_t i = 0; i < C; i++) x[i] += o[i];

        rmsnorm(x, mlp_norm, C, s->eps, h);
        input_t normed = {h, C, {0}};
        products_t mlp = {{&w[4], &w[5]}, {input_act(s->isa, b, &normed, &w[4], gate), input_act(s->isa, b, &normed, &w[5], up)},
                          {0}, 2, swiglu, act};
        for (int i = 0; i < 2; i++) mlp.rows[i] = rows_for(s->isa, w[4 + i].fmt);
        run_products(&mlp, s->threads);

        input_t activated = {act, s->inter, {0}};
        one_product(s, b, &activated, &w[6], o);
        for (Py_ssize_t i = 0; i < C; i++) x[i] += o[i];
    }
}

#ifdef HAVE_POOL
#define POLLING(on) __atomic_store_n(&pool_polling, (on), __ATOMIC_RELEASE)
#else
#define POLLING(on) ((void)0)
#endif

PyDoc_STRVAR(decode_doc,
"decode(isa, threads, plan, layers, x, pos, hidden, heads, kv_heads, head_dim, intermediate, eps, cos, sin,\n"
"       keys, values, layer_stride, window, final_norm, head, out)\n\n"
"One batch-1 decode step of `layers` Llama blocks (see _matmul_kernels_decode.h). `plan`: the address of\n"
"(layers, DECODE_LAYER_FIELDS) int64 (each of q, k, v, o, gate, up, down as `linear`'s weight arguments\n"
"fmt, w, w_stride, scale, scale_stride, zero, zero_stride, group_blocks, signed_nibbles, bias, N, K; then\n"
"the attention and MLP norm weights, and the per-head query and key norms' (head_dim floats) or 0). `x`: the token's embedding (hidden float32). `cos`, `sin`: the\n"
"rotary rows at `pos`; `keys`, `values`: layer 0 of the sequence's cache slot, (kv_heads, window,\n"
"head_dim) float32 per layer, `layer_stride` floats apart. `final_norm`: its weight; `head`: 0, or the address of the output head's DECODE_WEIGHT_FIELDS\n"
"int64. `out`: the head's logits, or without a head the final-normed state (hidden floats). Every\n"
"address is of contiguous memory the caller keeps alive. Releases the GIL while it runs.");

static PyObject *decode(PyObject *self, PyObject *args) {
    (void)self;
    const char *isa_name;
    int threads;
    unsigned long long plan_ptr, x_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, norm_ptr, head_ptr, out_ptr;
    Py_ssize_t layers, pos, hidden, heads, kv_heads, hd, inter, layer_stride, window;
    double eps;
    if (!PyArg_ParseTuple(args, "siKnKnnnnnndKKKKnnKKK", &isa_name, &threads, &plan_ptr, &layers, &x_ptr, &pos, &hidden,
                          &heads, &kv_heads, &hd, &inter, &eps, &cos_ptr, &sin_ptr, &keys_ptr, &values_ptr,
                          &layer_stride, &window, &norm_ptr, &head_ptr, &out_ptr))
        return NULL;
    int isa = isa_index(isa_name);
    if (isa < 0) return NULL;
    if (layers < 0 || hidden < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || hd < 2 || hd % 2 || inter < 1 ||
        window < 1 || pos < 0 || pos >= window || !plan_ptr || !x_ptr || !cos_ptr || !sin_ptr || !keys_ptr ||
        !values_ptr || !norm_ptr || !out_ptr)
        return PyErr_Format(PyExc_ValueError, "bad decode arguments: hidden %zd, heads %zd/%zd, head_dim %zd, pos %zd of %zd",
                            hidden, heads, kv_heads, hd, pos, window);
    const int64_t *plan = (const int64_t *)(uintptr_t)plan_ptr;
    Py_ssize_t nq = heads * hd, nkv = kv_heads * hd, kmax = hidden;
    if (nq > kmax) kmax = nq;
    if (inter > kmax) kmax = inter;
    weight_t head;
    if (!check_plan("decode", plan, layers, hidden, nq, nkv, inter, head_ptr, &head)) return NULL;
    Py_ssize_t nb = (kmax + QK - 1) / QK;
    size_t act_bytes = (size_t)(nb * QK + 64) * ACT_KINDS + sizeof(float) * (size_t)(2 * nb * ACT_KINDS) +
                       sizeof(int16_t) * (size_t)(kmax / 16 + 16);
    size_t work_floats = (size_t)(kmax + 2 * nq + 2 * nkv + 2 * hidden + 3 * inter + heads * (window + 8));
    uint8_t *memory = malloc(act_bytes + sizeof(float) * work_floats + 128);   /* + two alignments to 64 */
    if (!memory) return PyErr_NoMemory();
    act_bufs_t b;
    uint8_t *at = memory;
    for (int i = 0; i < ACT_KINDS; i++, at += nb * QK + 64) b.q[i] = (int8_t *)at;
    float *floats = (float *)(((uintptr_t)at + 63) & ~(uintptr_t)63);
    for (int i = 0; i < ACT_KINDS; i++, floats += 2 * nb) {
        b.d[i] = floats;
        b.s[i] = floats + nb;
    }
    b.bsums = (int16_t *)floats;
    float *work = (float *)(((uintptr_t)(b.bsums + kmax / 16 + 16) + 63) & ~(uintptr_t)63);
    step_t s = {isa, threads < 1 ? 1 : threads, hidden, heads, kv_heads, hd, inter, window, pos, layer_stride, (float)eps,
                (const float *)(uintptr_t)cos_ptr, (const float *)(uintptr_t)sin_ptr, (float *)(uintptr_t)keys_ptr,
                (float *)(uintptr_t)values_ptr};
    float *x = work + work_floats - hidden, *out = (float *)(uintptr_t)out_ptr;     /* the residual stream */
    Py_BEGIN_ALLOW_THREADS
    memcpy(x, (const float *)(uintptr_t)x_ptr, sizeof(float) * (size_t)hidden);
    if (s.threads > 1) POLLING(1);
    decode_layers(&s, plan, layers, x, &b, work);
    float *normed = head_ptr ? work : out;
    rmsnorm(x, (const float *)(uintptr_t)norm_ptr, hidden, s.eps, normed);
    if (head_ptr) {
        input_t in = {normed, hidden, {0}};
        one_product(&s, &b, &in, &head, out);
    }
    POLLING(0);
    Py_END_ALLOW_THREADS
    free(memory);
    Py_RETURN_NONE;
}
