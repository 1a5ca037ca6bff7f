/* The forward pass of a stack of Llama blocks over many tokens in one call: _matmul_kernels.c's `forward`
 * (quantizers/fast_decode.py's DecodePlan.forward; tinylm's forward, the decoders' prefill).
 *
 * The many-row counterpart of the decode step (_matmul_kernels_decode.h), on the same plan: M = B sequences
 * x T tokens of residual stream, row m = b T + t at position start + t. Per block:
 *   h = rmsnorm(x) * w_attn_norm, rounded to int8 once per kind the q/k/v weights read   one row job
 *   q, k, v = h @ W.T                   one pool job over the 8-row tiles of all three (the multi-row tiles of
 *                                       `linear`: 8 activation rows per weight load, VNNI / AVX2 / portable)
 *   per-head norms (Qwen3), rotary at each row's position, k and v stored at their positions    one row job
*   y = causal softmax(q K.T / sqrt(hd)) V   one task per (sequence, query head) over its T queries; keys and
 *                                       values from a cache (prefill: positions 0..start+t; a forward pass that
 *                                       returns its keys and values: a cache of T positions a sequence) or,
 *                                       without one, a scratch of this call's own T positions
 *   x += round(y) @ Wo.T; h = rmsnorm(x) * w_mlp_norm, rounded              one row job after the product
 *   a = silu(h @ Wgate.T) * (h @ Wup.T)   one pool job (each task: the same rows of gate and up, their SwiGLU)
 *   x += round(a) @ Wdown.T             the add goes into the next block's norm job
 * then the final norm of every row (or of each sequence's last row) and the head. Row jobs split their rows
 * between the threads from ROW_SPLIT values; every job is a barrier the pool's polling threads pass in ~1 us.
 */

#define ROW_SPLIT 8192             /* a row job shares its rows between threads from this many values */

/* The activation buffers are the decode step's act_bufs_t, for M rows: one input rounded once per activation kind
 * the weights reading it need. */

static unsigned kinds_of(const weight_t *const *w, int n) {
    unsigned kinds = 0;
    for (int i = 0; i < n; i++) kinds |= 1u << act_kind(w[i]);
    return kinds;
}

static act_t rows_act(const act_bufs_t *b, const weight_t *w, Py_ssize_t M, float *y) {
    int kind = act_kind(w);
    return (act_t){b->q[kind], b->d[kind], b->s[kind], M, y, b->bsums};
}

/* A row job: rows m0..m1 of  x += add (if add);  h = rmsnorm(x) * norm (if norm; else h = x);  h rounded for
 * each kind in `kinds` (K values a row). */
typedef struct {
    int isa;
    float *x;
    const float *add, *norm;
    float *h;
    Py_ssize_t K, rows_per_task, M;
    float eps;
    unsigned kinds;
    const act_bufs_t *b;
} prepare_t;

static void round_rows(int isa, const act_bufs_t *b, unsigned kinds, const float *src, Py_ssize_t K, Py_ssize_t m0,
                       Py_ssize_t n) {
    Py_ssize_t nb = (K + QK - 1) / QK;
    for (int kind = 0; kind < ACT_KINDS; kind++) {
        if (!(kinds & (1u << kind))) continue;
        if (kind == ACT_Q8_K)
            ALL_ISAS[isa].quantize_k(src, n, K, b->q[kind] + m0 * K, b->d[kind] + m0 * (K / QKK), b->bsums + m0 * (K / 16));
        else
            ALL_ISAS[isa].quantize(src, n, K, nb, kind == ACT_PAIRS, kind == ACT_ROWWISE, b->q[kind] + m0 * nb * QK,
                                   b->d[kind] + m0 * nb, b->s[kind] + m0 * nb);
    }
}

static void prepare_task(const void *ctx, Py_ssize_t task) {
    const prepare_t *p = ctx;
    Py_ssize_t m0 = task * p->rows_per_task, m1 = m0 + p->rows_per_task < p->M ? m0 + p->rows_per_task : p->M;
    for (Py_ssize_t m = m0; m < m1; m++) {
        float *x = p->x + m * p->K;
        if (p->add)
            for (Py_ssize_t i = 0; i < p->K; i++) x[i] += p->add[m * p->K + i];
        if (p->norm) rmsnorm(x, p->norm, p->K, p->eps, p->h + m * p->K);
    }
    const float *src = p->norm ? p->h : p->x;
    round_rows(p->isa, p->b, p->kinds, src + m0 * p->K, p->K, m0, m1 - m0);
}

/* Tasks of at least ROW_SPLIT values, two per thread at most. */
static void run_rows(job_t *job, Py_ssize_t *rows_per_task, Py_ssize_t M, Py_ssize_t width, int threads) {
    Py_ssize_t tasks = threads > 1 && M > 1 && M * width >= ROW_SPLIT ? 2 * (Py_ssize_t)threads : 1;
    if (tasks > M) tasks = M;
    *rows_per_task = (M + tasks - 1) / tasks;
    run_job(job, (M + *rows_per_task - 1) / *rows_per_task, threads);
}

static void prepare(int isa, int threads, const act_bufs_t *b, float *x, const float *add, const float *norm, float *h,
                    Py_ssize_t M, Py_ssize_t K, float eps, unsigned kinds) {
    prepare_t p = {isa, x, add, norm, h, K, 0, M, eps, kinds, b};
    job_t job = {0};
    job.run = prepare_task;
    job.ctx = &p;
    run_rows(&job, &p.rows_per_task, M, K, threads);
}

/* ---- per-row attention inputs and the attention ----------------------------------------------------- */

typedef struct {
    Py_ssize_t B, T, start, heads, kv_heads, hd, window, rows_per_task, seq_stride, M;
    float scale;
    head_norms_t norms;
    const float *cos, *sin;        /* rows at `start` */
    float *q, *k, *v, *y, *scores;
    float *keys, *values;          /* this layer's, sequence 0: (kv_heads, window, hd), sequences seq_stride apart */
    attend_fn attend;
} attend_rows_t;

static void positions_task(const void *ctx, Py_ssize_t task) {
    const attend_rows_t *a = ctx;
    Py_ssize_t nq = a->heads * a->hd, nkv = a->kv_heads * a->hd;
    Py_ssize_t m0 = task * a->rows_per_task, m1 = m0 + a->rows_per_task < a->M ? m0 + a->rows_per_task : a->M;
    for (Py_ssize_t m = m0; m < m1; m++) {
        Py_ssize_t b = m / a->T, t = m % a->T;
        place_row(&a->norms, a->q + m * nq, a->k + m * nkv, a->v + m * nkv, a->cos + t * a->hd, a->sin + t * a->hd,
                  a->keys + b * a->seq_stride, a->values + b * a->seq_stride, a->window, a->start + t);
    }
}

/* Task (b, h): the T queries of head h of sequence b, each over positions 0..start+t of its key/value head. */
static void causal_task(const void *ctx, Py_ssize_t task) {
    const attend_rows_t *a = ctx;
    Py_ssize_t b = task / a->heads, h = task % a->heads, nq = a->heads * a->hd;
    Py_ssize_t kv = b * a->seq_stride + (h / (a->heads / a->kv_heads)) * a->window * a->hd;
    float *scores = a->scores + task * (a->window + 8);
    for (Py_ssize_t t = 0; t < a->T; t++) {
        Py_ssize_t m = b * a->T + t;
        attention_t at = {NULL, NULL, NULL, NULL, NULL, 1, a->hd, a->window, a->start + t + 1, a->scale};
        a->attend(&at, a->q + m * nq + h * a->hd, a->keys + kv, a->values + kv, scores, a->y + m * nq + h * a->hd);
    }
}

/* ---- the forward ---------------------------------------------------------------------------------------- */

typedef struct {
    int isa, threads;
    Py_ssize_t B, T, start, hidden, heads, kv_heads, hd, inter, window, layer_stride, seq_stride;
    float eps;
    const float *cos, *sin;
    float *keys, *values;
} forward_t;

typedef struct {
    float *h, *q, *k, *v, *y, *o, *gate, *up, *act, *scores;
} forward_work_t;

/* The blocks over x; returns the last block's output, still to add to x (NULL without blocks). */
static const float *forward_layers(const forward_t *s, const int64_t *plan, Py_ssize_t layers, float *x,
                                   const act_bufs_t *b, const forward_work_t *wk) {
    Py_ssize_t C = s->hidden, M = s->B * s->T, nq = s->heads * s->hd;
    attend_fn attend;
    swiglu_fn swiglu;
    block_kernels(s->isa, &attend, &swiglu);
    const float *pending = NULL;       /* the last product of the previous block, still to add to x */
    for (Py_ssize_t l = 0; l < layers; l++) {
        const int64_t *f = plan + l * LAYER_FIELDS;
        weight_t w[DECODE_WEIGHTS];
        plan_layer_weights(f, w);
        const weight_t *qkv_w[3] = {&w[0], &w[1], &w[2]}, *mlp_w[2] = {&w[4], &w[5]};

        prepare(s->isa, s->threads, b, x, pending, plan_norm(f, 0), wk->h, M, C, s->eps, kinds_of(qkv_w, 3));
        products_t qkv = {{&w[0], &w[1], &w[2]}, {rows_act(b, &w[0], M, wk->q), rows_act(b, &w[1], M, wk->k),
                          rows_act(b, &w[2], M, wk->v)}, {0}, 3};
        for (int i = 0; i < 3; i++) qkv.rows[i] = rows_for(s->isa, w[i].fmt);
        run_products(&qkv, s->threads);

        attend_rows_t at = {s->B, s->T, s->start, s->heads, s->kv_heads, s->hd, s->window, 0, s->seq_stride, M,
                            1.0f / sqrtf((float)s->hd), {plan_norm(f, 2), plan_norm(f, 3), s->eps, s->heads, s->kv_heads, s->hd},
                            s->cos, s->sin, wk->q, wk->k, wk->v, wk->y, wk->scores, s->keys + l * s->layer_stride,
                            s->values + l * s->layer_stride, attend};
        job_t job = {0};
        job.run = positions_task;
        job.ctx = &at;
        run_rows(&job, &at.rows_per_task, M, (s->heads + 2 * s->kv_heads) * s->hd, s->threads);
        job.run = causal_task;
        /* (sequence, head) pairs share threads once they hold a few thousand multiply-adds in all */
        Py_ssize_t pairs = s->B * s->heads, work = pairs * s->T * (s->start + s->T) * s->hd;
        run_job(&job, pairs, work >= 16384 ? s->threads : 1);

        prepare(s->isa, s->threads, b, wk->y, NULL, NULL, NULL, M, nq, s->eps, 1u << act_kind(&w[3]));
        products_t o = {{&w[3]}, {rows_act(b, &w[3], M, wk->o)}, {rows_for(s->isa, w[3].fmt)}, 1};
        run_products(&o, s->threads);

        prepare(s->isa, s->threads, b, x, wk->o, plan_norm(f, 1), wk->h, M, C, s->eps, kinds_of(mlp_w, 2));
        products_t mlp = {{&w[4], &w[5]}, {rows_act(b, &w[4], M, wk->gate), rows_act(b, &w[5], M, wk->up)}, {0}, 2,
                          swiglu, wk->act};
        for (int i = 0; i < 2; i++) mlp.rows[i] = rows_for(s->isa, w[4 + i].fmt);
        run_products(&mlp, s->threads);

        prepare(s->isa, s->threads, b, wk->act, NULL, NULL, NULL, M, s->inter, s->eps, 1u << act_kind(&w[6]));
        products_t down = {{&w[6]}, {rows_act(b, &w[6], M, wk->o)}, {rows_for(s->isa, w[6].fmt)}, 1};
        run_products(&down, s->threads);
        pending = wk->o;
    }
    return pending;
}

#ifndef GROUP_ROWS
#define GROUP_ROWS 64              /* rows of a group of whole sequences (forward) */
#endif
#define MAX_GROUPS 64
#ifndef GROUP_WEIGHT_BYTES
#define GROUP_WEIGHT_BYTES (8 << 20)   /* groups only where the blocks' weights stay in the caches (see below) */
#endif

/* Bytes of the blocks' packed weights (their rows; scales aside). */
static size_t plan_weight_bytes(const int64_t *plan, Py_ssize_t layers) {
    size_t bytes = 0;
    for (Py_ssize_t l = 0; l < layers; l++) {
        weight_t w[DECODE_WEIGHTS];
        plan_layer_weights(plan + l * LAYER_FIELDS, w);
        for (int i = 0; i < DECODE_WEIGHTS; i++) bytes += (size_t)(w[i].w_stride * w[i].N);
    }
    return bytes;
}

/* One group's sequences b0..b1 and its buffers (forward_alloc). */
typedef struct {
    Py_ssize_t b0, b1;
    uint8_t *memory;
    float *x, *last, *keys, *values;
    forward_work_t wk;
    act_bufs_t b;
} forward_group_t;

typedef struct {
    const forward_t *s;            /* the whole call's (B: every sequence) */
    const int64_t *plan;
    Py_ssize_t layers;
    const float *x;                /* (B T, hidden) embeddings */
    float *out;                    /* (rows, vocab or hidden) */
    const weight_t *head;          /* or NULL */
    const float *norm;
    int last_only;
    Py_ssize_t kmax;
    forward_group_t *groups;
} forward_groups_t;

/* The buffers of `sequences` sequences of s->T tokens (NULL: out of memory), carved into g's pointers. */
static uint8_t *forward_alloc(const forward_t *s, Py_ssize_t kmax, Py_ssize_t sequences, int last_only, int cached,
                              forward_group_t *g) {
    Py_ssize_t M = sequences * s->T, nq = s->heads * s->hd, nkv = s->kv_heads * s->hd, C = s->hidden, I = s->inter;
    Py_ssize_t window = cached ? s->window : s->T, nb = (kmax + QK - 1) / QK;
    /* floats: x, h, q, k, v, y, o, gate, up, act, scores; the scratch keys and values; the last rows */
    size_t parts[] = {(size_t)(M * C), (size_t)(M * kmax), (size_t)(M * nq), (size_t)(M * nkv), (size_t)(M * nkv),
                      (size_t)(M * nq), (size_t)(M * C), (size_t)(M * I), (size_t)(M * I), (size_t)(M * I),
                      (size_t)(sequences * s->heads * (window + 8)), cached ? 0 : (size_t)(M * nkv),
                      cached ? 0 : (size_t)(M * nkv), (size_t)((last_only ? sequences : 0) * C)};
    enum { N_PARTS = sizeof parts / sizeof parts[0] };
    size_t floats = 0;
    for (int i = 0; i < N_PARTS; i++) floats += (parts[i] + 15) / 16 * 16;      /* each part 64-byte aligned */
    size_t act_bytes = ((size_t)(M * nb * QK) + 64) * ACT_KINDS + sizeof(float) * (size_t)(2 * M * nb * ACT_KINDS) +
                       sizeof(int16_t) * (size_t)(M * (kmax / 16) + 16);
    uint8_t *memory = malloc(sizeof(float) * floats + act_bytes + 64);
    if (!memory) return NULL;
    float *base[N_PARTS], *at = (float *)(((uintptr_t)memory + 63) & ~(uintptr_t)63);
    for (int i = 0; i < N_PARTS; i++, at += (parts[i - 1] + 15) / 16 * 16) base[i] = at;
    uint8_t *bytes = (uint8_t *)at;
    for (int i = 0; i < ACT_KINDS; i++, bytes += M * nb * QK + 64) g->b.q[i] = (int8_t *)bytes;
    float *scales = (float *)(((uintptr_t)bytes + 3) & ~(uintptr_t)3);
    for (int i = 0; i < ACT_KINDS; i++, scales += 2 * M * nb) {
        g->b.d[i] = scales;
        g->b.s[i] = scales + M * nb;
    }
    g->b.bsums = (int16_t *)scales;
    g->x = base[0];
    g->wk = (forward_work_t){base[1], base[2], base[3], base[4], base[5], base[6], base[7], base[8], base[9], base[10]};
    g->keys = cached ? NULL : base[11];
    g->values = cached ? NULL : base[12];
    g->last = base[13];
    return memory;
}

/* Task g: group g's sequences through every block, the final norm and the head, into their rows of `out`. */
static void forward_group(const void *ctx, Py_ssize_t task) {
    const forward_groups_t *all = ctx;
    forward_group_t *g = &all->groups[task];
    forward_t s = *all->s;
    Py_ssize_t C = s.hidden, T = s.T, B = g->b1 - g->b0, M = B * T, out_rows = all->last_only ? B : M;
    s.B = B;
    if (g->keys) {                 /* a forward pass: its own scratch of keys and values; else the cache's */
        s.keys = g->keys;
        s.values = g->values;
    } else {                       /* this group's sequences in the cache */
        s.keys += g->b0 * s.seq_stride;
        s.values += g->b0 * s.seq_stride;
    }
    memcpy(g->x, all->x + g->b0 * T * C, sizeof(float) * (size_t)(M * C));
    const float *pending = forward_layers(&s, all->plan, all->layers, g->x, &g->b, &g->wk);
    float *rows = g->x;
    if (all->last_only) {          /* each sequence's last row, its last product added */
        for (Py_ssize_t i = 0; i < B; i++) {
            Py_ssize_t r = ((i + 1) * T - 1) * C;
            for (Py_ssize_t j = 0; j < C; j++) g->last[i * C + j] = g->x[r + j] + (pending ? pending[r + j] : 0.0f);
        }
        rows = g->last;
        pending = NULL;
    }
    const weight_t *head = all->head;
    float *out = all->out + (all->last_only ? g->b0 : g->b0 * T) * (head ? head->N : C);
    /* the final norm (into `out` without a head), rounded for the head */
    prepare(s.isa, s.threads, &g->b, rows, pending, all->norm, head ? g->wk.h : out, out_rows, C, s.eps,
            head ? kinds_of(&head, 1) : 0);
    if (head) {
        products_t p = {{head}, {rows_act(&g->b, head, out_rows, out)}, {rows_for(s.isa, head->fmt)}, 1};
        run_products(&p, s.threads);
    }
}

PyDoc_STRVAR(forward_doc,
"forward(isa, threads, plan, layers, x, B, T, start, hidden, heads, kv_heads, head_dim, intermediate, eps,\n"
"        cos, sin, keys, values, layer_stride, window, final_norm, head, out, last_only)\n\n"
"The Llama blocks of `plan` (as `decode` reads it) over B sequences of T tokens: `x` (B T, hidden) float32\n"
"embeddings, row b T + t at position start + t (see _matmul_kernels_forward.h). `cos`, `sin`: the rotary rows\n"
"from `start` (T rows of head_dim). `keys`, `values`: 0 (attention over this call's tokens alone; start 0),\n"
"or layer 0 of the first sequence's cache (kv_heads, window, head_dim) float32, sequence b's kv_heads window\n"
"head_dim floats after sequence b-1's, layer l's `layer_stride` floats after layer l-1's: positions\n"
"start..start+T-1 are written, and each token attends to the cache from position 0. `out`: the head's logits of every row, or of each sequence's last row with `last_only`\n"
"(rows x vocab); without a head (0), those rows after the final norm (rows x hidden). Every address is of\n"
"contiguous memory the caller keeps alive. Releases the GIL while it runs.");

static PyObject *forward(PyObject *self, PyObject *args) {
    (void)self;
    const char *isa_name;
    int threads, last_only;
    unsigned long long plan_ptr, x_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, norm_ptr, head_ptr, out_ptr;
    Py_ssize_t layers, B, T, start, hidden, heads, kv_heads, hd, inter, layer_stride, window;
    double eps;
    if (!PyArg_ParseTuple(args, "siKnKnnnnnnnndKKKKnnKKKp", &isa_name, &threads, &plan_ptr, &layers, &x_ptr, &B, &T,
                          &start, &hidden, &heads, &kv_heads, &hd, &inter, &eps, &cos_ptr, &sin_ptr, &keys_ptr,
                          &values_ptr, &layer_stride, &window, &norm_ptr, &head_ptr, &out_ptr, &last_only))
        return NULL;
    int isa = isa_index(isa_name);
    if (isa < 0) return NULL;
    int cached = keys_ptr != 0;
    if (layers < 0 || B < 1 || T < 1 || hidden < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || hd < 2 || hd % 2 ||
        inter < 1 || start < 0 || (cached ? !values_ptr || start + T > window : start != 0) || !plan_ptr ||
        !x_ptr || !cos_ptr || !sin_ptr || !norm_ptr || !out_ptr)
        return PyErr_Format(PyExc_ValueError, "bad forward arguments: %zd x %zd tokens from %zd, hidden %zd, heads %zd/%zd, "
                            "head_dim %zd, window %zd", B, T, start, hidden, heads, kv_heads, hd, window);
    const int64_t *plan = (const int64_t *)(uintptr_t)plan_ptr;
    Py_ssize_t nq = heads * hd, nkv = kv_heads * hd, kmax = hidden, M = B * T;
    if (nq > kmax) kmax = nq;
    if (inter > kmax) kmax = inter;
    weight_t head;
    if (!check_plan("forward", plan, layers, hidden, nq, nkv, inter, head_ptr, &head)) return NULL;
    if (!cached) {
        window = T;                                /* a scratch cache of this call's positions, reused by every layer */
        layer_stride = 0;
    }
    /* A batch of sequences runs as groups of whole sequences of ~GROUP_ROWS rows, each through the whole stack on
     * one thread (the threads claim groups): a group's activations stay in its core's cache, and no barrier
     * separates the ~10 jobs of a block (on a shared machine every barrier waits for the slowest thread). Each
     * group reads every weight again, so only blocks of up to GROUP_WEIGHT_BYTES run so (tinylm's ~1-3 MB);
     * larger ones (llama-100m's 40-80 MB, which stream from memory) run all rows in each job. */
    int th = threads < 1 ? 1 : threads;
    Py_ssize_t per = (GROUP_ROWS + T - 1) / T, groups = 1;
    if (per < (B + MAX_GROUPS - 1) / MAX_GROUPS) per = (B + MAX_GROUPS - 1) / MAX_GROUPS;
    if (B > per && M >= 2 * GROUP_ROWS && plan_weight_bytes(plan, layers) <= GROUP_WEIGHT_BYTES)
        groups = (B + per - 1) / per;
    forward_t s = {isa, groups > 1 ? 1 : th, B, T, start, hidden, heads, kv_heads, hd, inter, window, layer_stride,
                   nkv * window, (float)eps, (const float *)(uintptr_t)cos_ptr, (const float *)(uintptr_t)sin_ptr,
                   (float *)(uintptr_t)keys_ptr, (float *)(uintptr_t)values_ptr};
    forward_group_t group[MAX_GROUPS];
    forward_groups_t all = {&s, plan, layers, (const float *)(uintptr_t)x_ptr, (float *)(uintptr_t)out_ptr,
                            head_ptr ? &head : NULL, (const float *)(uintptr_t)norm_ptr, last_only, kmax, group};
    for (Py_ssize_t g = 0; g < groups; g++) {
        group[g].b0 = g * per;
        group[g].b1 = g + 1 < groups ? (g + 1) * per : B;      /* (one group: every sequence, however many) */
        group[g].memory = forward_alloc(&s, kmax, group[g].b1 - group[g].b0, last_only, cached, &group[g]);
        if (!group[g].memory) {
            for (Py_ssize_t i = 0; i < g; i++) free(group[i].memory);
            return PyErr_NoMemory();
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (th > 1) POLLING(1);
    if (groups == 1) {
        forward_group(&all, 0);
    } else {
        job_t job = {0};
        job.run = forward_group;
        job.ctx = &all;
        run_job(&job, groups, th);        /* (one thread: the groups in turn) */
    }
    POLLING(0);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < groups; g++) free(group[g].memory);
    Py_RETURN_NONE;
}
