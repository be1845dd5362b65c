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

#include "ops.h"

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

PyObject *py_rms_norm(PyObject *Py_UNUSED(self), PyObject *args) {
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

PyObject *py_add_rms_norm(PyObject *Py_UNUSED(self), PyObject *args) {
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

PyObject *py_silu_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    return gated_act(args, "w*y*ni:silu_mul", "silu_mul", run_silu_mul);
}

PyObject *py_gelu_tanh_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    return gated_act(args, "w*y*ni:gelu_tanh_mul", "gelu_tanh_mul", run_gelu_tanh_mul);
}

PyObject *py_scale(PyObject *Py_UNUSED(self), PyObject *args) {
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

PyObject *py_add(PyObject *Py_UNUSED(self), PyObject *args) {
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

PyObject *py_gather_rows(PyObject *Py_UNUSED(self), PyObject *args) {
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

