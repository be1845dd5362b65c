/* Row-wise float32 kernels of the Kiln CPU runtime: rms_norm, add + rms_norm, silu(gate) * up,
 * gelu_tanh(gate) * up, x * factor.
 *
 * They replace chains of 3-6 torch ops whose dispatch costs more than their arithmetic for the
 * few rows of a decode step. Plain C over the buffer protocol: runtime/ops/rowops.py checks
 * dtypes and shapes; this file checks buffer lengths under the GIL, then computes without it,
 * with OpenMP over rows only when there is enough work to pay for waking the threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"
#include "numeric.h"

/* Row ops of one row, or of fewer elements than this, run on the calling thread. A 32-row step's norms of
 * SmolLM2 (18,432 elements) split across two threads take 0.20-0.21 ms a decode step instead of 0.29-0.31 on
 * one (a Zen 5, per-call times in the replay loop): their rows were written by both threads' share of the
 * linear before, so the thread that runs them alone fetches half its input from the other core. */
#define PARALLEL_ELEMENTS (1 << 13)
#define PARALLEL_ROWS(rows, n) ((rows) > 1 && (rows) * (n) >= PARALLEL_ELEMENTS)

/* total[:n] = x + residual; out = rms_norm(total) */
static void add_rms_norm_row(float *out, float *total, const float *x, const float *residual,
                             const float *weight, int n, float eps) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(total + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(residual + i)));
    for (; i < n; i++)
        total[i] = x[i] + residual[i];
    rms_norm_row(out, total, weight, n, eps);
}

/* out[:n] = silu(gate) * up = gate / (1 + exp(-gate)) * up */
static void silu_mul_row(float *out, const float *gate, const float *up, int n) {
    __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp256(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++)
        out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

#define GELU_BETA 0.7978845608028654f  /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

/* out[:n] = gelu_tanh(gate) * up, where gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3)
 * (torch's F.gelu(approximate="tanh")). Computed as g / (1 + exp(-2u)), the same function (0.5 (1 + tanh u)
 * is the logistic of 2u) without the cancellation of 1 + tanh(u) for negative g. Large |g|: g^3 may
 * overflow to inf, which exp takes to 0 (out = g) or to inf (out = -0, as torch gives); exp256 clamps its
 * argument at 88, so above that the vector path uses inf itself, as expf overflows in the scalar tail. */
static void gelu_tanh_mul_row(float *out, const float *gate, const float *up, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), kappa = _mm256_set1_ps(GELU_KAPPA);
    const __m256 minus_two_beta = _mm256_set1_ps(-2.0f * GELU_BETA), overflow = _mm256_set1_ps(88.0f);
    const __m256 inf = _mm256_set1_ps(INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(kappa, g), _mm256_mul_ps(g, g), g);  /* g + kappa g^3 */
        __m256 arg = _mm256_mul_ps(minus_two_beta, inner);
        __m256 e = _mm256_blendv_ps(exp256(arg), inf, _mm256_cmp_ps(arg, overflow, _CMP_GT_OQ));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-2.0f * GELU_BETA * (g + GELU_KAPPA * g * g * g))) * up[i];
    }
}

/* ----------------------------------------------------------------------------------------
 * Python bindings
 */

static int check_width(const char *fn, Py_ssize_t n) {
    if (n > 0 && n <= INT32_MAX)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: rows must hold 1 .. 2^31-1 float32, got %zd", fn, n);
    return -1;
}

/* Every buffer of b[0:count] must hold rows * widths[i] floats. */
static int check_rows(const char *fn, const char *const *names, Py_buffer *b, const Py_ssize_t *widths,
                      int count, Py_ssize_t rows) {
    for (int i = 0; i < count; i++)
        if (b[i].len != rows * widths[i] * 4) {
            PyErr_Format(PyExc_ValueError, "%s: %s holds %zd bytes, expected %zd (%zd rows of %zd float32)",
                         fn, names[i], b[i].len, rows * widths[i] * 4, rows, widths[i]);
            return -1;
        }
    return 0;
}

/* One row-wise call: what a tape stores to run it again. */
typedef struct {
    float *out, *total;                      /* total: add_rms_norm's sum */
    const float *x, *residual, *weight;      /* residual: add_rms_norm's and add's second input */
    const int64_t *indices;                  /* gather_rows: source row of each out row */
    Py_ssize_t rows, n, source_rows;         /* source_rows: rows of x (gather_rows) */
    int gathers_logits;                      /* gather_rows of the logits rows: rows follow those, x the tokens */
    float eps;
    float factor;                            /* scale: the multiplier */
    int threads;
} RowArgs;

static int run_rms_norm(const void *p) {
    const RowArgs *a = p;
    #pragma omp parallel for num_threads(live_threads(a->threads)) if (PARALLEL_ROWS(a->rows, a->n)) schedule(static)
    for (Py_ssize_t r = 0; r < a->rows; r++)
        rms_norm_row(a->out + r * a->n, a->x + r * a->n, a->weight, (int)a->n, a->eps);
    return 0;
}

static int run_add_rms_norm(const void *p) {
    const RowArgs *a = p;
    Py_ssize_t n = a->n;
    #pragma omp parallel for num_threads(live_threads(a->threads)) if (PARALLEL_ROWS(a->rows, n)) schedule(static)
    for (Py_ssize_t r = 0; r < a->rows; r++)
        add_rms_norm_row(a->out + r * n, a->total + r * n, a->x + r * n, a->residual + r * n, a->weight, (int)n,
                         a->eps);
    return 0;
}

/* act(gate) * up over rows of gate_up [rows, 2n] = gate | up, act one row at a time. */
static int run_gated(const RowArgs *a, void (*act_mul_row)(float *, const float *, const float *, int)) {
    Py_ssize_t n = a->n;
    #pragma omp parallel for num_threads(live_threads(a->threads)) if (PARALLEL_ROWS(a->rows, n)) schedule(static)
    for (Py_ssize_t r = 0; r < a->rows; r++)
        act_mul_row(a->out + r * n, a->x + 2 * r * n, a->x + 2 * r * n + n, (int)n);
    return 0;
}

static int run_silu_mul(const void *p) { return run_gated(p, silu_mul_row); }

static int run_gelu_tanh_mul(const void *p) { return run_gated(p, gelu_tanh_mul_row); }

static int run_scale(const void *p) {
    const RowArgs *a = p;
    Py_ssize_t total = a->rows * a->n;
    for (Py_ssize_t i = 0; i < total; i++)
        a->out[i] = a->x[i] * a->factor;
    return 0;
}

static int run_add(const void *p) {
    const RowArgs *a = p;
    Py_ssize_t total = a->rows * a->n;
    for (Py_ssize_t i = 0; i < total; i++)
        a->out[i] = a->x[i] + a->residual[i];
    return 0;
}

static int check_gather_rows(const void *p) {
    const RowArgs *a = p;
    for (Py_ssize_t r = 0; r < a->rows; r++)
        if (a->indices[r] < 0 || a->indices[r] >= a->source_rows) {
            PyErr_Format(PyExc_ValueError, "gather_rows: indices[%zd] = %lld is outside x's %zd rows", r,
                         (long long)a->indices[r], a->source_rows);
            return -1;
        }
    return 0;
}

static int run_gather_rows(const void *p) {
    const RowArgs *a = p;
    for (Py_ssize_t r = 0; r < a->rows; r++)
        memcpy(a->out + r * a->n, a->x + a->indices[r] * a->n, sizeof(float) * (size_t)a->n);
    return 0;
}

static void resize_rows(void *p, const TapeShape *from, const TapeShape *to, int logits_rows) {
    RowArgs *a = p;
    a->rows = tape_step_rows(a->rows, from, to, logits_rows || a->gathers_logits);
    a->source_rows = tape_step_rows(a->source_rows, from, to, logits_rows);
}

/* Checks (run again at every replay), records when a tape records, and runs the call. */
static PyObject *record_and_run(TapeCheck check, TapeRun run, RowArgs *a, Py_buffer *b, int count, int status) {
    if (status == 0 && check)
        status = check(a);
    if (status == 0) {
        tape_record_resizable(check, run, resize_rows, a, sizeof *a);
        Py_BEGIN_ALLOW_THREADS
        run(a);
        Py_END_ALLOW_THREADS
    }
    release_buffers(b, count);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[3];  /* out, x, weight */
    RowArgs a = {0};
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*y*y*fi:rms_norm", &b[0], &b[1], &b[2], &a.eps, &num_threads))
        return NULL;
    Py_ssize_t n = b[2].len / 4, rows = n > 0 ? b[1].len / 4 / n : 0;
    static const char *const names[] = {"out", "x"};
    int status = check_width("rms_norm", n) < 0 ? -1 : check_rows("rms_norm", names, b, (Py_ssize_t[]){n, n}, 2, rows);
    a.out = b[0].buf, a.x = b[1].buf, a.weight = b[2].buf;
    a.rows = rows, a.n = n, a.threads = resolve_threads(num_threads);
    return record_and_run(NULL, run_rms_norm, &a, b, 3, status);
}

static PyObject *py_add_rms_norm(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[5];  /* out, total, x, residual, weight */
    RowArgs a = {0};
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*w*y*y*y*fi:add_rms_norm", &b[0], &b[1], &b[2], &b[3], &b[4], &a.eps,
                          &num_threads))
        return NULL;
    Py_ssize_t n = b[4].len / 4, rows = n > 0 ? b[2].len / 4 / n : 0;
    static const char *const names[] = {"out", "total", "x", "residual"};
    int status = check_width("add_rms_norm", n) < 0
                 ? -1 : check_rows("add_rms_norm", names, b, (Py_ssize_t[]){n, n, n, n}, 4, rows);
    a.out = b[0].buf, a.total = b[1].buf, a.x = b[2].buf, a.residual = b[3].buf, a.weight = b[4].buf;
    a.rows = rows, a.n = n, a.threads = resolve_threads(num_threads);
    return record_and_run(NULL, run_add_rms_norm, &a, b, 5, status);
}

/* A gated activation fn(out [rows, n], gate_up [rows, 2n], n, num_threads), run by run; format names fn. */
static PyObject *gated_act(PyObject *args, const char *format, const char *fn, TapeRun run) {
    Py_buffer b[2];  /* out [rows, n], gate_up [rows, 2n] */
    RowArgs a = {0};
    int num_threads;
    if (!PyArg_ParseTuple(args, format, &b[0], &b[1], &a.n, &num_threads))
        return NULL;
    int status = check_width(fn, a.n);
    if (status == 0) {
        a.rows = b[0].len / 4 / a.n;
        static const char *const names[] = {"out", "gate_up"};
        status = check_rows(fn, names, b, (Py_ssize_t[]){a.n, 2 * a.n}, 2, a.rows);
    }
    a.out = b[0].buf, a.x = b[1].buf, a.threads = resolve_threads(num_threads);
    return record_and_run(NULL, run, &a, b, 2, status);
}

static PyObject *py_silu_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    return gated_act(args, "w*y*ni:silu_mul", "silu_mul", run_silu_mul);
}

static PyObject *py_gelu_tanh_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    return gated_act(args, "w*y*ni:gelu_tanh_mul", "gelu_tanh_mul", run_gelu_tanh_mul);
}

static PyObject *py_scale(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[2];  /* out, x: n float32 each (out may be x) */
    RowArgs a = {0};
    Py_ssize_t width = 0;
    if (!PyArg_ParseTuple(args, "w*y*f|n:scale", &b[0], &b[1], &a.factor, &width))
        return NULL;
    int status = 0;
    if (b[1].len != b[0].len || b[0].len % 4 || width < 0 || (width && b[0].len / 4 % width)) {
        PyErr_Format(PyExc_ValueError, "scale: out and x must hold the same float32 count, in rows of %zd if given, "
                     "got %zd and %zd bytes", width, b[0].len, b[1].len);
        status = -1;
    }
    a.out = b[0].buf, a.x = b[1].buf, a.n = width ? width : b[0].len / 4, a.rows = a.n ? b[0].len / 4 / a.n : 0;
    return record_and_run(NULL, run_scale, &a, b, 2, status);
}

static PyObject *py_add(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[3];  /* out, x, y: n float32 each */
    RowArgs a = {0};
    Py_ssize_t width = 0;
    if (!PyArg_ParseTuple(args, "w*y*y*|n:add", &b[0], &b[1], &b[2], &width))
        return NULL;
    int status = 0;
    if (b[1].len != b[0].len || b[2].len != b[0].len || b[0].len % 4 || width < 0
        || (width && b[0].len / 4 % width)) {
        PyErr_Format(PyExc_ValueError, "add: out, x and y must hold the same float32 count, in rows of %zd if given, "
                     "got %zd, %zd, %zd bytes", width, b[0].len, b[1].len, b[2].len);
        status = -1;
    }
    a.out = b[0].buf, a.x = b[1].buf, a.residual = b[2].buf, a.n = width ? width : b[0].len / 4;
    a.rows = a.n ? b[0].len / 4 / a.n : 0;
    return record_and_run(NULL, run_add, &a, b, 3, status);
}

static PyObject *py_gather_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[3];  /* out [R, n], x [rows, n], indices [R] int64 */
    RowArgs a = {0};
    if (!PyArg_ParseTuple(args, "w*y*y*n|p:gather_rows", &b[0], &b[1], &b[2], &a.n, &a.gathers_logits))
        return NULL;
    int status = check_width("gather_rows", a.n);
    if (status == 0) {
        a.rows = b[2].len / 8, a.source_rows = b[1].len / 4 / a.n;
        static const char *const names[] = {"out", "x"};
        status = check_rows("gather_rows", names, b, (Py_ssize_t[]){a.n, a.n}, 1, a.rows);
        if (status == 0 && (b[2].len % 8 || b[1].len != a.source_rows * a.n * 4)) {
            PyErr_Format(PyExc_ValueError, "gather_rows: x must be whole rows of %zd float32 and indices int64",
                         a.n);
            status = -1;
        }
    }
    a.out = b[0].buf, a.x = b[1].buf, a.indices = b[2].buf;
    PyObject *result = record_and_run(check_gather_rows, run_gather_rows, &a, b, 3, status);
    if (result && a.gathers_logits)
        tape_logits_gathered();
    return result;
}

/* ----------------------------------------------------------------------------------------
 * Greedy picks: the index of each logits row's largest value
 */

/* The first index of the largest of x[0..n) (a NaN counts as largest: the first NaN), as torch's argmax. */
static Py_ssize_t argmax_span(const float *x, Py_ssize_t n, float *best_value) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; j++)
        best = lanes[j] > best ? lanes[j] : best;
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (Py_ssize_t j = i; j < n; j++) {
        nan |= isnan(x[j]);
        best = x[j] > best ? x[j] : best;
    }
    Py_ssize_t j = 0;
    if (!nan) {  /* the first equal, eight at a time */
        const __m256 b = _mm256_set1_ps(best);
        for (; j + 8 <= n; j += 8) {
            const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
            if (hits) {
                *best_value = best;
                return j + __builtin_ctz((unsigned)hits);
            }
        }
    }
    for (; j < n; j++)  /* the rest, or the first NaN */
        if (nan ? isnan(x[j]) : x[j] == best) {
            *best_value = x[j];
            return j;
        }
    *best_value = -INFINITY;  /* n == 0, or every value -inf: the first */
    return 0;
}

/* Each thread's first largest over its own contiguous part of a row: the part a linear's threads wrote
 * (qlinear splits its output columns the same way), so that it is read from that core's cache. */
#define ARGMAX_MAX_THREADS 64

static void argmax_rows_compute(int64_t *out, const float *x, Py_ssize_t rows, Py_ssize_t n, int threads) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float values[ARGMAX_MAX_THREADS];
        Py_ssize_t at[ARGMAX_MAX_THREADS];
        int parts = threads < ARGMAX_MAX_THREADS ? threads : ARGMAX_MAX_THREADS;
        if (n < 4096)
            parts = 1;
        #pragma omp parallel num_threads(parts) if (parts > 1)
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            const Py_ssize_t lo = n * tid / nt, hi = n * (tid + 1) / nt;
            at[tid] = lo + argmax_span(row + lo, hi - lo, &values[tid]);
            if (tid == 0)
                parts = nt;
        }
        Py_ssize_t best = at[0];
        float value = values[0];
        for (int t = 1; t < parts; t++)  /* later parts win only when strictly larger (or the first NaN) */
            if (!isnan(value) && (isnan(values[t]) || values[t] > value))
                best = at[t], value = values[t];
        out[r] = best;
    }
}

static PyObject *py_argmax_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[2];  /* out [R] int64, x [R, n] float32 */
    Py_ssize_t n;
    int threads;
    if (!PyArg_ParseTuple(args, "w*y*ni:argmax_rows", &b[0], &b[1], &n, &threads))
        return NULL;
    const Py_ssize_t rows = b[0].len / 8;
    if (n <= 0 || b[0].len % 8 || b[1].len != rows * n * 4) {
        release_buffers(b, 2);
        return PyErr_Format(PyExc_ValueError, "argmax_rows: out must be int64 [R] and x float32 [R, %zd], got %zd "
                            "and %zd bytes", n, b[0].len, b[1].len);
    }
    Py_BEGIN_ALLOW_THREADS
    argmax_rows_compute(b[0].buf, b[1].buf, rows, n, live_threads(resolve_threads(threads)));
    Py_END_ALLOW_THREADS
    release_buffers(b, 2);
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------------------------------
 * The exponential race (runtime/core/sampler.py): token = argmax(p / e), e ~ Exp(1) per token
 *
 * A row's noise is a function of its stream key (the sequence's seed and output position, mixed in
 * Python) and the token id only: two rounds of a 32-bit integer hash (lowbias32's constants) over
 * the id, keyed by the key's halves, give 24 bits; u = (bits + 1/2) / 2^24 lies in (0, 1), and
 * e = -log(u), between 3e-8 and 17.3. Everything runs 8 tokens at a time with AVX2, the same
 * instructions on every CPU, so a seed draws the same tokens on any x86-64 machine Kiln runs on.
 */

static inline __m256i race_hash(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7feb352d));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

/* log(x) for x in (0, 1]: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then log(m) by Cephes' logf
 * polynomial in m - 1 (relative error about 1e-7). */
static inline __m256 race_log(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                                   _mm256_set1_epi32(0x3F000000)));  /* [1/2, 1) */
    const __m256 low = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm256_sub_ps(e, _mm256_and_ps(low, _mm256_set1_ps(1.0f)));
    m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(low, m)), _mm256_set1_ps(1.0f));
    const __m256 z = _mm256_mul_ps(m, m);
    __m256 y = _mm256_set1_ps(7.0376836292e-2f);
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.1514610310e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.1676998740e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.2420140846e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.4249322787e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.6668057665e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(2.0000714765e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-2.4999993993e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(3.3333331174e-1f));
    y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

/* u for tokens v .. v + 7 of the stream `key`. */
static inline __m256 race_uniform8(Py_ssize_t v, uint64_t key) {
    const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32((int)v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i h = race_hash(_mm256_xor_si256(ids, _mm256_set1_epi32((int)(uint32_t)key)));
    h = race_hash(_mm256_add_epi32(h, _mm256_set1_epi32((int)(uint32_t)(key >> 32))));
    return _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0.5f)),
                         _mm256_set1_ps(1.0f / 16777216.0f));
}

/* e for tokens v .. v + 7 of the stream `key`. */
static inline __m256 race_noise8(Py_ssize_t v, uint64_t key) {
    return _mm256_sub_ps(_mm256_setzero_ps(), race_log(race_uniform8(v, key)));
}

static inline __m256i race_tail_mask(Py_ssize_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* One row: p = exp(x / temperature - max) (0 where x is -inf), or p = x when the row holds probabilities
 * already (given_probs); the first token of the largest p / e. */
static int64_t race_row(const float *x, Py_ssize_t n, float temperature, uint64_t key, int given_probs) {
    const __m256 t = _mm256_set1_ps(temperature), minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 top = _mm256_setzero_ps();
    if (!given_probs) {
        top = minus_inf;
        for (Py_ssize_t v = 0; v < n; v += 8) {
            const __m256 xs = _mm256_maskload_ps(x + v, race_tail_mask(n - v));
            top = _mm256_max_ps(top, _mm256_blendv_ps(minus_inf, _mm256_div_ps(xs, t),
                                                      _mm256_castsi256_ps(race_tail_mask(n - v))));
        }
        float lanes[8], m = -INFINITY;
        _mm256_storeu_ps(lanes, top);
        for (int j = 0; j < 8; j++)
            m = lanes[j] > m ? lanes[j] : m;
        top = _mm256_set1_ps(isfinite(m) ? m : 0.0f);
    }
    /* A token can win only if its p / e beats every ratio already seen. Since e = -log u >= 1 - u (the
     * computed e too, to well within the factor of 2 kept in hand), a lane with p < bound (1 - u) / 2,
     * bound a ratio some token reaches, cannot: a vector of such lanes skips the log and the division,
     * and the winner is the same bit for bit. With logits the top token's p is 1 and its e at most 17.4,
     * so 0.05 is such a bound from the start; the largest ratio computed so far raises it. Most of a
     * vocabulary is far below the top token, so most vectors stop at u. */
    __m256 best = _mm256_set1_ps(-1.0f), cut = _mm256_set1_ps(given_probs ? 0.0f : 0.025f);  /* bound / 2 */
    __m256i best_id = _mm256_setzero_si256(), ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (Py_ssize_t v = 0; v < n; v += 8, ids = _mm256_add_epi32(ids, _mm256_set1_epi32(8))) {
        const __m256i valid = race_tail_mask(n - v);
        const __m256 xs = _mm256_maskload_ps(x + v, valid);
        __m256 p = xs;
        if (!given_probs)
            p = _mm256_andnot_ps(_mm256_cmp_ps(xs, minus_inf, _CMP_EQ_OQ),
                                 exp256(_mm256_sub_ps(_mm256_div_ps(xs, t), top)));
        const __m256 u = race_uniform8(v, key);
        const __m256 may_win = _mm256_and_ps(_mm256_cmp_ps(p, _mm256_mul_ps(cut, _mm256_sub_ps(one, u)), _CMP_GE_OQ),
                                             _mm256_castsi256_ps(valid));
        if (!_mm256_movemask_ps(may_win))
            continue;
        __m256 ratio = _mm256_div_ps(p, _mm256_sub_ps(_mm256_setzero_ps(), race_log(u)));
        ratio = _mm256_blendv_ps(_mm256_set1_ps(-1.0f), ratio, _mm256_castsi256_ps(valid));  /* past n: never */
        const __m256 better = _mm256_cmp_ps(ratio, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, ratio, better);
        best_id = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_id), _mm256_castsi256_ps(ids), better));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        cut = _mm256_max_ps(cut, _mm256_set1_ps(0.5f * _mm_cvtss_f32(m)));
    }
    float values[8];
    int32_t at[8];
    _mm256_storeu_ps(values, best);
    _mm256_storeu_si256((__m256i *)at, best_id);
    int64_t winner = 0;
    float value = -INFINITY;
    for (int j = 0; j < 8; j++)  /* the largest ratio; among equal ones the lowest token id */
        if (values[j] > value || (values[j] == value && at[j] < winner))
            value = values[j], winner = at[j];
    return winner;
}

static PyObject *py_race_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[4];  /* out [R] int64, x [R, n] float32, temperatures [R] float32, keys [R] uint64 */
    Py_ssize_t n;
    int given_probs, threads;
    if (!PyArg_ParseTuple(args, "w*y*y*y*npi:race_rows", &b[0], &b[1], &b[2], &b[3], &n, &given_probs, &threads))
        return NULL;
    const Py_ssize_t rows = b[0].len / 8;
    if (n <= 0 || n > INT32_MAX - 8 || b[0].len % 8 || b[1].len != rows * n * 4 || b[2].len != rows * 4 ||
        b[3].len != rows * 8) {
        release_buffers(b, 4);
        return PyErr_Format(PyExc_ValueError, "race_rows: out int64 [R], x float32 [R, %zd], temperatures float32 "
                            "[R] and keys uint64 [R] expected, got %zd, %zd, %zd and %zd bytes",
                            n, b[0].len, b[1].len, b[2].len, b[3].len);
    }
    int64_t *out = b[0].buf;
    const float *x = b[1].buf, *temperatures = b[2].buf;
    const uint64_t *keys = b[3].buf;
    const int live = live_threads(resolve_threads(threads));
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel for num_threads(live) if (rows > 1 && live > 1) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++)
        out[r] = race_row(x + r * n, n, temperatures[r], keys[r], given_probs);
    Py_END_ALLOW_THREADS
    release_buffers(b, 4);
    Py_RETURN_NONE;
}

static PyObject *py_race_noise(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer out;  /* [n] float32 */
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "w*K:race_noise", &out, &key))
        return NULL;
    const Py_ssize_t n = out.len / 4;
    if (out.len % 4 || n > INT32_MAX - 8) {
        PyBuffer_Release(&out);
        return PyErr_Format(PyExc_ValueError, "race_noise: out must be float32 [n], got %zd bytes", out.len);
    }
    float *e = out.buf;
    for (Py_ssize_t v = 0; v < n; v += 8)
        _mm256_maskstore_ps(e + v, race_tail_mask(n - v), race_noise8(v, (uint64_t)key));
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------------------------------
 * Tapes
 */

static TapeState state = {NULL, 0, 0};

static void tape_free(Tape *tape) {
    for (Py_ssize_t i = 0; i < tape->count; i++)
        free(tape->entries[i].args);
    free(tape->entries);
    free(tape);
}

static void tape_capsule_free(PyObject *capsule) {
    Tape *tape = PyCapsule_GetPointer(capsule, "kiln.Tape");
    if (tape)
        tape_free(tape);
}

static PyObject *py_tape_begin(PyObject *Py_UNUSED(self), PyObject *args) {
    TapeShape shape = {0, 0, 0};
    if (!PyArg_ParseTuple(args, "|nnn:tape_begin", &shape.tokens, &shape.seqs, &shape.logits))
        return NULL;
    if (shape.tokens < 0 || shape.seqs < 0 || shape.logits < 0)
        return PyErr_Format(PyExc_ValueError, "tape_begin: tokens, seqs and logits must be 0 (not given) or more, "
                            "got %zd, %zd, %zd", shape.tokens, shape.seqs, shape.logits);
    if (state.recording)  /* another thread records (one tape at a time per process) */
        Py_RETURN_FALSE;
    state.recording = calloc(1, sizeof(Tape));
    if (!state.recording)
        return PyErr_NoMemory();
    state.recording->recorded = state.recording->shape = shape;
    state.thread = PyThread_get_thread_ident();
    Py_RETURN_TRUE;
}

static PyObject *py_tape_end(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused)) {
    Tape *tape = state.recording;
    if (!tape || state.thread != PyThread_get_thread_ident())
        return PyErr_Format(PyExc_RuntimeError, "tape_end: this thread is not recording");
    state.recording = NULL;
    if (tape->failed) {
        tape_free(tape);
        Py_RETURN_NONE;
    }
    PyObject *capsule = PyCapsule_New(tape, "kiln.Tape", tape_capsule_free);
    if (!capsule)
        tape_free(tape);
    return capsule;
}

static PyObject *py_tape_size(PyObject *Py_UNUSED(self), PyObject *capsule) {
    Tape *tape = PyCapsule_GetPointer(capsule, "kiln.Tape");
    return tape ? PyLong_FromSsize_t(tape->count) : NULL;
}

static PyObject *py_tape_tokens(PyObject *Py_UNUSED(self), PyObject *capsule) {
    Tape *tape = PyCapsule_GetPointer(capsule, "kiln.Tape");
    if (!tape)
        return NULL;
    return PyLong_FromSsize_t(tape->fixed ? -tape->shape.tokens : tape->shape.tokens);
}

static PyObject *py_replay(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *capsule;
    Py_ssize_t tokens = -1, seqs = -1, logits = -1;
    if (!PyArg_ParseTuple(args, "O|nnn:replay", &capsule, &tokens, &seqs, &logits))
        return NULL;
    Tape *tape = PyCapsule_GetPointer(capsule, "kiln.Tape");
    if (!tape)
        return NULL;
    const TapeShape *from = &tape->recorded;
    const TapeShape to = {tokens >= 0 ? tokens : tape->shape.tokens, seqs >= 0 ? seqs : tape->shape.seqs,
                          logits >= 0 ? logits : tape->shape.logits};
    if (to.tokens != tape->shape.tokens || to.seqs != tape->shape.seqs || to.logits != tape->shape.logits) {
        if (tape->fixed || from->tokens <= 0 || to.tokens == 0)
            return PyErr_Format(PyExc_ValueError, "replay: this tape runs %zd tokens, %zd sequences and %zd logits "
                                "rows only, not %zd, %zd and %zd", tape->shape.tokens, tape->shape.seqs,
                                tape->shape.logits, to.tokens, to.seqs, to.logits);
        const int seqs_untold = to.seqs != from->seqs && from->seqs <= 0;
        if (seqs_untold || (to.logits != from->logits && from->logits <= 0))
            return PyErr_Format(PyExc_ValueError, "replay: this tape was recorded without its %s count: it runs "
                                "the recorded one only", seqs_untold ? "sequences" : "logits rows");
        for (Py_ssize_t i = 0; i < tape->count; i++) {  /* from the recorded arguments: no rounding builds up */
            TapeEntry *e = &tape->entries[i];
            memcpy(e->args, e->recorded, e->size);
            e->resize(e->args, from, &to, e->logits_rows);
        }
        tape->shape = to;
    }
    for (Py_ssize_t i = 0; i < tape->count; i++)
        if (tape->entries[i].check && tape->entries[i].check(tape->entries[i].args) < 0)
            return NULL;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < tape->count && status == 0; i++)
        status = tape->entries[i].run(tape->entries[i].args);
    Py_END_ALLOW_THREADS
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_set_thread_cap(PyObject *Py_UNUSED(self), PyObject *arg) {
    const long cap = PyLong_AsLong(arg);
    if (cap == -1 && PyErr_Occurred())
        return NULL;
    if (cap < 0)
        return PyErr_Format(PyExc_ValueError, "set_thread_cap: cap must be 0 (none) or more, got %ld", cap);
    __atomic_store_n(&state.thread_cap, (int)(cap > 1 << 20 ? 1 << 20 : cap), __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *py_thread_cap(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused)) {
    return PyLong_FromLong(__atomic_load_n(&state.thread_cap, __ATOMIC_RELAXED));
}

static PyObject *py_live_threads(PyObject *Py_UNUSED(self), PyObject *arg) {
    const long requested = PyLong_AsLong(arg);
    if (requested == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(live_threads((int)requested));
}

/* ----------------------------------------------------------------------------------------
 * Thread placement
 */

#define PIN_MAX_THREADS 1024

/* Pins the OpenMP workers that this thread's parallel regions of `count` threads use (libgomp keeps one
 * pool of them per calling thread) to one CPU each: worker i to cpus[i]. The calling thread itself is
 * left as it is (runtime.backends.cpu.cpus pins it around each step). Returns the native thread ids of the team,
 * the caller's first. */
static PyObject *py_pin_team(PyObject *Py_UNUSED(self), PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "pin_team: cpus must be a sequence of CPU numbers");
    if (!seq)
        return NULL;
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1 || count > PIN_MAX_THREADS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "pin_team: 1 to %d CPUs, got %zd", PIN_MAX_THREADS, count);
    }
    int cpus[PIN_MAX_THREADS];
    for (Py_ssize_t i = 0; i < count; i++) {
        const long cpu = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (cpu == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        if (cpu < 0 || cpu >= CPU_SETSIZE) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_ValueError, "pin_team: CPU %ld is not between 0 and %d", cpu, CPU_SETSIZE - 1);
        }
        cpus[i] = (int)cpu;
    }
    Py_DECREF(seq);
    long tids[PIN_MAX_THREADS];
    int ran = 1, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel num_threads((int)count)
    {
        const int tid = omp_get_thread_num();
        tids[tid] = (long)syscall(SYS_gettid);
        if (tid > 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[tid], &set);
            if (sched_setaffinity(0, sizeof set, &set) != 0)
                __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        } else {
            ran = omp_get_num_threads();
        }
    }
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *out = PyList_New(ran);
    for (int i = 0; out && i < ran; i++)
        PyList_SET_ITEM(out, i, PyLong_FromLong(tids[i]));
    return out;
}

static PyMethodDef methods[] = {
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(out, x, weight, eps, num_threads): out = weight * x / sqrt(mean(x^2) + eps) per row; "
     "x, out [rows, n] f32, weight [n] f32."},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS,
     "add_rms_norm(out, total, x, residual, weight, eps, num_threads): total = x + residual, "
     "out = rms_norm(total) per row."},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(out, gate_up, n, num_threads): out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:]."},
    {"gelu_tanh_mul", py_gelu_tanh_mul, METH_VARARGS,
     "gelu_tanh_mul(out, gate_up, n, num_threads): out [rows, n] = gelu_tanh(gate_up[:, :n]) * gate_up[:, n:] "
     "(torch's F.gelu(approximate=\"tanh\"))."},
    {"scale", py_scale, METH_VARARGS,
     "scale(out, x, factor, width=0): out = x * factor, float32 of one size (out may be x), rows of `width` if given "
     "(a tape then follows the rows' count)."},
    {"add", py_add, METH_VARARGS,
     "add(out, x, y, width=0): out = x + y, float32 of one size, rows of `width` if given (a tape then follows the "
     "rows' count)."},
    {"gather_rows", py_gather_rows, METH_VARARGS,
     "gather_rows(out, x, indices, n, logits=False): out[r] = x[indices[r]], rows of n float32; indices int64 "
     "checked. logits: the gather of a step's logits rows (a tape records the calls after it as following those)."},
    {"argmax_rows", py_argmax_rows, METH_VARARGS,
     "argmax_rows(out, x, n, num_threads): out[r] = the first index of row r's largest value (a NaN counts as "
     "largest), rows of n float32, each row split among the threads."},
    {"race_rows", py_race_rows, METH_VARARGS,
     "race_rows(out, x, temperatures, keys, n, given_probs, num_threads): out[r] = the exponential race's winner "
     "of row r (argmax of p / e): p = exp(x / temperature - max), or x itself when given_probs; e = race_noise "
     "of keys[r]. Rows of n float32, one thread per row."},
    {"race_noise", py_race_noise, METH_VARARGS,
     "race_noise(out, key): out[v] = the Exp(1) noise of token v in the stream `key` (what race_rows divides by)."},
    {"tape_begin", py_tape_begin, METH_VARARGS,
     "tape_begin(tokens=0, seqs=0, logits=0) -> bool: this thread's kernel calls (of every Kiln C module) are "
     "recorded from now on, for a step of that many tokens, sequences and logits rows (0: not given; without "
     "tokens the tape replays as recorded); False if another thread is recording."},
    {"tape_end", py_tape_end, METH_NOARGS,
     "tape_end() -> tape, or None if a call could not be recorded: stops recording."},
    {"tape_size", py_tape_size, METH_O, "tape_size(tape) -> the number of recorded calls."},
    {"tape_tokens", py_tape_tokens, METH_O,
     "tape_tokens(tape) -> the token count its calls run now; minus it (or 0) if a call cannot run another."},
    {"replay", py_replay, METH_VARARGS,
     "replay(tape, tokens=-1, seqs=-1, logits=-1): runs the recorded calls again on the same buffers (their index "
     "checks first); a count >= 0: for a step of that many tokens, sequences or logits rows, every call's counts "
     "rewritten first from the recorded ones (the buffers must hold the rows; a tape recorded with its counts)."},
    {"set_thread_cap", py_set_thread_cap, METH_O,
     "set_thread_cap(n): every Kiln kernel (of every Kiln C module, replayed tapes too) runs on at most n "
     "threads from now on; 0 lifts the cap."},
    {"thread_cap", py_thread_cap, METH_NOARGS, "thread_cap() -> the cap set_thread_cap set (0: none)."},
    {"pin_team", py_pin_team, METH_O,
     "pin_team(cpus) -> thread ids: pins the OpenMP workers of this thread's parallel regions of len(cpus) "
     "threads to one CPU each (worker i to cpus[i]; the calling thread is not moved); returns the native ids "
     "of the team's threads, the caller's first."},
    {"live_threads", py_live_threads, METH_O,
     "live_threads(n) -> the threads a kernel call that asks for n runs on now (n, at most the cap)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ops",
    "Row-wise float32 kernels (rms_norm, add_rms_norm, silu_mul, gelu_tanh_mul, scale, add, gather_rows; AVX2, "
    "OpenMP) and the step tapes that record and replay the calls of every Kiln C module.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ops(void) {
    tape_state = &state;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    PyObject *capsule = PyCapsule_New(&state, TAPE_STATE_CAPSULE, NULL);
    if (!capsule || PyModule_AddObjectRef(m, "_tape_state", capsule) < 0 || add_required_cpu_flags(m) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(capsule);
    return m;
}
