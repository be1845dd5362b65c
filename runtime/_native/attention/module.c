/* The _attention module: argument checks and Python bindings of the paged-attention and KV-write
 * kernels. runtime/ops/attention.py checks dtypes and shapes and passes flat buffers plus sizes; this
 * file checks buffer lengths and the metadata values (slots, block ids, query offsets) while it
 * holds the GIL, before touching any data, then releases the GIL for the kernels. */
#include "kernels.h"

#include <math.h>
#include <stdarg.h>

#include "../common.h"

/* ----------------------------------------------------------------------------------------
 * Argument checks (GIL held, before any data is read beyond the metadata)
 */

static int fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    PyErr_FormatV(PyExc_ValueError, format, args);
    va_end(args);
    return -1;
}

static int check_buffer_len(const char *fn, const char *name, const Py_buffer *b, Py_ssize_t expected) {
    if (b->len != expected)
        return fail("%s: %s has %zd bytes, expected %zd", fn, name, b->len, expected);
    return 0;
}

static int check_common(const char *fn, int num_kv_heads, int head_dim, int cache_dtype, float kv_scale) {
    if (num_kv_heads <= 0 || head_dim <= 0)
        return fail("%s: num_kv_heads and head_dim must be positive, got %d and %d",
                    fn, num_kv_heads, head_dim);
    if (cache_dtype < 0 || cache_dtype >= CACHE_NUM_DTYPES)
        return fail("%s: unknown cache dtype code %d", fn, cache_dtype);
    if (!(kv_scale > 0.0f) || isinf(kv_scale))
        return fail("%s: kv_scale must be a positive finite number, got %g", fn, (double)kv_scale);
    return 0;
}

static int check_slots(const char *fn, const int64_t *slots, Py_ssize_t n, Py_ssize_t num_slots) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (slots[t] < -1 || slots[t] >= num_slots)
            return fail("%s: slot_mapping[%zd] = %lld is out of range [-1, %zd)",
                        fn, t, (long long)slots[t], num_slots);
    return 0;
}

static int check_sequences(const AttentionArgs *a, Py_ssize_t num_tokens, Py_ssize_t num_blocks) {
    const int32_t *qsl = a->query_start_loc;
    if (qsl[0] != 0 || qsl[a->num_seqs] != num_tokens)
        return fail("paged_attention: query_start_loc must start at 0 and end at T = %zd, got %d .. %d",
                    num_tokens, qsl[0], qsl[a->num_seqs]);
    for (int s = 0; s < a->num_seqs; s++) {
        int qlen = qsl[s + 1] - qsl[s], ctx = a->context_lens[s];
        if (qlen < 0)
            return fail("paged_attention: query_start_loc is not monotonic at sequence %d (%d > %d)",
                        s, qsl[s], qsl[s + 1]);
        if (ctx < qlen)
            return fail("paged_attention: context_lens[%d] = %d is less than its %d query tokens",
                        s, ctx, qlen);
        int used_blocks = (int)(((int64_t)ctx + a->block_size - 1) / a->block_size);
        if (used_blocks > a->max_blocks)
            return fail("paged_attention: sequence %d needs %d blocks for %d tokens, "
                        "block_tables has %d columns",
                        s, used_blocks, ctx, a->max_blocks);
        const int32_t *table = a->block_tables + (size_t)s * a->max_blocks;
        /* Blocks wholly before the window of the sequence's first query are never read: a sliding-window
         * KV group gives them back (-1). */
        for (int b = first_visible_key(a, ctx - qlen) / a->block_size; b < used_blocks; b++)
            if (table[b] < 0 || table[b] >= num_blocks)
                return fail("paged_attention: block_tables[%d][%d] = %d is out of range [0, %zd)",
                            s, b, table[b], num_blocks);
    }
    return 0;
}

/* ----------------------------------------------------------------------------------------
 * Python bindings
 */

/* Fills a from the buffers b = {key, value, k_cache, v_cache, slot_mapping} and checks them. */
static int setup_kv_write(KVWriteArgs *a, Py_buffer *b, int nkv, int hd, int dtype, float kv_scale) {
    if (check_common("kv_write", nkv, hd, dtype, kv_scale) < 0)
        return -1;
    Py_ssize_t row_bytes = (Py_ssize_t)nkv * hd * cache_elem_size[dtype];
    Py_ssize_t num_tokens = b[4].len / 8;
    Py_ssize_t num_slots = b[2].len / row_bytes;
    if (check_buffer_len("kv_write", "slot_mapping", &b[4], num_tokens * 8) < 0
        || check_buffer_len("kv_write", "key", &b[0], num_tokens * nkv * hd * 4) < 0
        || check_buffer_len("kv_write", "value", &b[1], num_tokens * nkv * hd * 4) < 0
        || check_buffer_len("kv_write", "k_cache", &b[2], num_slots * row_bytes) < 0
        || check_buffer_len("kv_write", "v_cache", &b[3], num_slots * row_bytes) < 0)
        return -1;
    *a = (KVWriteArgs){b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf,
                       num_tokens, num_slots, nkv * hd, dtype, kv_scale};
    return check_slots("kv_write", a->slot_mapping, num_tokens, num_slots);
}

static PyObject *py_kv_write(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[5];  /* key, value, k_cache, v_cache, slot_mapping */
    int nkv, hd, dtype, num_threads;
    float kv_scale;
    if (!PyArg_ParseTuple(args, "y*y*w*w*y*iiifi:kv_write", &b[0], &b[1], &b[2], &b[3], &b[4],
                          &nkv, &hd, &dtype, &kv_scale, &num_threads))
        return NULL;
    KVWriteArgs a;
    int status = setup_kv_write(&a, b, nkv, hd, dtype, kv_scale);
    if (status == 0) {
        Py_BEGIN_ALLOW_THREADS
        kv_write_compute(&a, live_threads(resolve_threads(num_threads)));
        Py_END_ALLOW_THREADS
    }
    release_buffers(b, 5);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Fills a from the buffers {out, k_cache, v_cache, block_tables, context_lens, query_start_loc}
 * (b[0], b[2..6]) and the sizes in a (num_heads, num_kv_heads, head_dim, block_size, cache_dtype,
 * kv_scale), for num_tokens queries; a->query is left to the caller. */
static int setup_attention(const char *fn, AttentionArgs *a, Py_buffer *b, Py_ssize_t num_tokens) {
    if (check_common(fn, a->num_kv_heads, a->head_dim, a->cache_dtype, a->kv_scale) < 0)
        return -1;
    if (a->num_heads <= 0 || a->num_heads % a->num_kv_heads != 0 || a->block_size <= 0)
        return fail("%s: num_heads (%d) must be a positive multiple of num_kv_heads (%d), "
                    "block_size (%d) positive",
                    fn, a->num_heads, a->num_kv_heads, a->block_size);
    Py_ssize_t token_bytes = (Py_ssize_t)a->num_heads * a->head_dim * 4;
    Py_ssize_t block_bytes = (Py_ssize_t)a->block_size * a->num_kv_heads * a->head_dim
                             * cache_elem_size[a->cache_dtype];
    Py_ssize_t num_blocks = b[2].len / block_bytes;
    int num_seqs = (int)(b[5].len / 4);
    int max_blocks = num_seqs > 0 ? (int)(b[4].len / 4 / num_seqs) : 0;
    if (check_buffer_len(fn, "out", &b[0], num_tokens * token_bytes) < 0
        || check_buffer_len(fn, "k_cache", &b[2], num_blocks * block_bytes) < 0
        || check_buffer_len(fn, "v_cache", &b[3], num_blocks * block_bytes) < 0
        || check_buffer_len(fn, "context_lens", &b[5], (Py_ssize_t)num_seqs * 4) < 0
        || check_buffer_len(fn, "block_tables", &b[4], (Py_ssize_t)num_seqs * max_blocks * 4) < 0
        || check_buffer_len(fn, "query_start_loc", &b[6], ((Py_ssize_t)num_seqs + 1) * 4) < 0)
        return -1;
    a->out = b[0].buf;
    a->k_cache = b[2].buf;
    a->v_cache = b[3].buf;
    a->block_tables = b[4].buf;
    a->context_lens = b[5].buf;
    a->query_start_loc = b[6].buf;
    a->num_seqs = num_seqs;
    a->max_blocks = max_blocks;
    if (a->window < 0)
        return fail("%s: window must be 0 (full attention) or positive, got %d", fn, a->window);
    int ratio = a->num_heads / a->num_kv_heads;
    a->queries_per_tile = ratio >= ROWS_PER_TILE ? 1 : ROWS_PER_TILE / ratio;
    return check_sequences(a, num_tokens, num_blocks);
}

/* Fills a from b = {out, query, k_cache, v_cache, block_tables, context_lens, query_start_loc}. */
static int setup_paged_attention(AttentionArgs *a, Py_buffer *b) {
    if (a->num_heads <= 0 || a->head_dim <= 0)
        return fail("paged_attention: num_heads and head_dim must be positive, got %d and %d",
                    a->num_heads, a->head_dim);
    Py_ssize_t token_bytes = (Py_ssize_t)a->num_heads * a->head_dim * 4;
    Py_ssize_t num_tokens = b[1].len / token_bytes;
    if (check_buffer_len("paged_attention", "query", &b[1], num_tokens * token_bytes) < 0)
        return -1;
    a->query = b[1].buf;
    return setup_attention("paged_attention", a, b, num_tokens);
}

static PyObject *py_paged_attention(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[7];  /* out, query, k_cache, v_cache, block_tables, context_lens, query_start_loc */
    AttentionArgs a = {0};
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*y*y*iiiififii:paged_attention", &b[0], &b[1], &b[2], &b[3],
                          &b[4], &b[5], &b[6], &a.num_heads, &a.num_kv_heads, &a.head_dim, &a.block_size,
                          &a.scale, &a.cache_dtype, &a.kv_scale, &a.window, &num_threads))
        return NULL;
    int status = setup_paged_attention(&a, b);
    if (status == 0) {
        Py_BEGIN_ALLOW_THREADS
        status = paged_attention_compute(&a, live_threads(resolve_threads(num_threads)));
        Py_END_ALLOW_THREADS
        if (status < 0)
            PyErr_NoMemory();
    }
    release_buffers(b, 7);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* b = {out, qkv (or q), k_cache, v_cache, block_tables, context_lens, query_start_loc, positions, rope,
 * slot_mapping, q_norm, k_norm, k, v} (the last four optional: buf NULL); fills r and a (whose sizes are set)
 * and checks every index before any data moves. With k and v, b[1] is q alone. */
static int setup_qkv_attention(RopeKVArgs *r, AttentionArgs *a, Py_buffer *b) {
    const char *fn = "qkv_attention";
    if (a->num_heads <= 0 || a->num_kv_heads <= 0 || a->head_dim <= 0 || a->head_dim % 2)
        return fail("%s: num_heads, num_kv_heads and an even head_dim must be positive, got %d, %d, %d",
                    fn, a->num_heads, a->num_kv_heads, a->head_dim);
    if (!b[12].buf != !b[13].buf)
        return fail("%s: k and v come together (or both in qkv)", fn);
    const int parts = b[12].buf != NULL;
    const Py_ssize_t q_row = (Py_ssize_t)a->num_heads * a->head_dim, kv_row = (Py_ssize_t)a->num_kv_heads * a->head_dim;
    const Py_ssize_t row = parts ? q_row : q_row + 2 * kv_row;  /* floats of a row of b[1] */
    Py_ssize_t num_tokens = b[1].len / (row * 4), rope_row = (Py_ssize_t)a->head_dim * 4;
    Py_ssize_t rope_rows = b[8].len / rope_row;
    if (check_buffer_len(fn, parts ? "q" : "qkv", &b[1], num_tokens * row * 4) < 0
        || (parts && check_buffer_len(fn, "k", &b[12], num_tokens * kv_row * 4) < 0)
        || (parts && check_buffer_len(fn, "v", &b[13], num_tokens * kv_row * 4) < 0)
        || check_buffer_len(fn, "positions", &b[7], num_tokens * 8) < 0
        || check_buffer_len(fn, "slot_mapping", &b[9], num_tokens * 8) < 0
        || check_buffer_len(fn, "rope", &b[8], rope_rows * rope_row) < 0
        || (b[10].buf && check_buffer_len(fn, "q_norm", &b[10], rope_row) < 0)
        || (b[11].buf && check_buffer_len(fn, "k_norm", &b[11], rope_row) < 0)
        || setup_attention(fn, a, b, num_tokens) < 0)
        return -1;
    const float *qkv = b[1].buf;
    r->q = qkv, r->k = parts ? b[12].buf : qkv + q_row, r->v = parts ? b[13].buf : qkv + q_row + kv_row;
    r->q_stride = row, r->k_stride = r->v_stride = parts ? kv_row : row;
    r->positions = b[7].buf, r->rope = b[8].buf, r->slot_mapping = b[9].buf;
    r->q_norm = b[10].buf, r->k_norm = b[11].buf, r->num_tokens = num_tokens, r->rope_rows = rope_rows;
    for (Py_ssize_t t = 0; t < num_tokens; t++)
        if (r->positions[t] < 0 || r->positions[t] >= rope_rows)
            return fail("%s: positions[%zd] = %lld is outside the rope table's %zd rows",
                        fn, t, (long long)r->positions[t], rope_rows);
    Py_ssize_t block_bytes = (Py_ssize_t)a->block_size * a->num_kv_heads * a->head_dim
                             * cache_elem_size[a->cache_dtype];
    return check_slots(fn, r->slot_mapping, num_tokens, b[2].len / block_bytes * a->block_size);
}

/* One qkv_attention call as a tape stores it; the index checks run again at every replay. */
typedef struct {
    RopeKVArgs r;
    AttentionArgs a;
    Py_ssize_t num_blocks;
    int threads;
} QKVCall;

static int check_qkv_call(const void *p) {
    const QKVCall *c = p;
    const char *fn = "qkv_attention";
    if (check_sequences(&c->a, c->r.num_tokens, c->num_blocks) < 0)
        return -1;
    for (Py_ssize_t t = 0; t < c->r.num_tokens; t++)
        if (c->r.positions[t] < 0 || c->r.positions[t] >= c->r.rope_rows)
            return fail("%s: positions[%zd] = %lld is outside the rope table's %zd rows",
                        fn, t, (long long)c->r.positions[t], c->r.rope_rows);
    return check_slots(fn, c->r.slot_mapping, c->r.num_tokens, c->num_blocks * c->a.block_size);
}

static int run_qkv_call(const void *p) {
    const QKVCall *c = p;
    AttentionArgs a = c->a;  /* qkv_attention_compute points a.query at its own buffer */
    return qkv_attention_compute(&c->r, &a, live_threads(c->threads));
}

static void resize_qkv_call(void *p, const TapeShape *from, const TapeShape *to, int logits_rows) {
    QKVCall *c = p;
    c->r.num_tokens = tape_step_rows(c->r.num_tokens, from, to, logits_rows);
    if (from->seqs > 0 && c->a.num_seqs == from->seqs)  /* the step's sequences (their arrays hold room for more) */
        c->a.num_seqs = (int)to->seqs;
}

static PyObject *py_qkv_attention(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[14] = {{0}};  /* the optional q_norm, k_norm, k, v stay empty (buf NULL) when not passed */
    QKVCall c = {0};
    AttentionArgs *a = &c.a;
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*y*w*w*y*y*y*y*y*y*iiiififii|z*z*fz*z*:qkv_attention", &b[0], &b[1], &b[2],
                          &b[3], &b[4], &b[5], &b[6], &b[7], &b[8], &b[9], &a->num_heads, &a->num_kv_heads,
                          &a->head_dim, &a->block_size, &a->scale, &a->cache_dtype, &a->kv_scale, &a->window,
                          &num_threads, &b[10], &b[11], &c.r.norm_eps, &b[12], &b[13]))
        return NULL;
    int status = setup_qkv_attention(&c.r, a, b);
    if (status == 0) {
        c.num_blocks = b[2].len / ((Py_ssize_t)a->block_size * a->num_kv_heads * a->head_dim
                                   * cache_elem_size[a->cache_dtype]);
        c.threads = resolve_threads(num_threads);
        tape_record_resizable(check_qkv_call, run_qkv_call, resize_qkv_call, &c, sizeof c);
        Py_BEGIN_ALLOW_THREADS
        status = run_qkv_call(&c);
        Py_END_ALLOW_THREADS
        if (status < 0)
            PyErr_NoMemory();
    }
    release_buffers(b, 14);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------------------------------
 * Module
 */

static PyObject *py_use_avx512(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
    return PyBool_FromLong(use_avx512(on));
}

static PyMethodDef methods[] = {
    {"kv_write", py_kv_write, METH_VARARGS,
     "kv_write(key, value, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim, cache_dtype, "
     "kv_scale, num_threads): scatter key/value rows [T, nkv, hd] f32 into cache slots; slot -1 skips."},
    {"paged_attention", py_paged_attention, METH_VARARGS,
     "paged_attention(out, query, k_cache, v_cache, block_tables, context_lens, query_start_loc, "
     "num_heads, num_kv_heads, head_dim, block_size, scale, cache_dtype, kv_scale, window, num_threads): "
     "causal attention of packed queries [T, nh, hd] f32 over the paged KV cache (window > 0: the last "
     "window keys only)."},
    {"qkv_attention", py_qkv_attention, METH_VARARGS,
     "qkv_attention(out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions, "
     "rope, slot_mapping, num_heads, num_kv_heads, head_dim, block_size, scale, cache_dtype, kv_scale, "
     "window, num_threads[, q_norm, k_norm, norm_eps, k, v]): one attention layer's step from the fused projection "
     "qkv [T, (nh + 2 nkv) * hd] f32 (or, given k and v [T, nkv * hd], from q [T, nh * hd] and them): per-head "
     "RMSNorm of q and of k by weights [hd] f32 when given (None: none), rotary embedding (rope [rows, hd] = "
     "cos | sin by position), KV write, paged attention into out."},
    {"use_avx512", py_use_avx512, METH_VARARGS,
     "use_avx512(on): the AVX-512 kernels where this CPU has them (True), or the AVX2 ones (False), for every "
     "later call in this process; returns whether AVX-512 is in use (their numbers are the same, bit for bit)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_attention", "Paged attention and KV-cache write kernels (AVX2, OpenMP).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__attention(void) {
    build_f8e4m3_table();
    detect_avx512();
    if (tape_import() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "DTYPE_F32", CACHE_F32) < 0
        || PyModule_AddIntConstant(m, "DTYPE_BF16", CACHE_BF16) < 0
        || PyModule_AddIntConstant(m, "DTYPE_F16", CACHE_F16) < 0
        || PyModule_AddIntConstant(m, "DTYPE_I8", CACHE_I8) < 0
        || PyModule_AddIntConstant(m, "DTYPE_F8E4M3", CACHE_F8E4M3) < 0
        || add_required_cpu_flags(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
