/* Row-wise float32 kernels of the Kiln CPU runtime: rms_norm, add + rms_norm, silu(gate) * up.
 *
 * They replace chains of 3-6 torch ops whose dispatch costs more than their arithmetic for the
 * few rows of a decode step. Plain C over the buffer protocol: runtime/native_ops.py checks
 * dtypes and shapes; this file checks buffer lengths under the GIL, then computes without it,
 * with OpenMP over rows only when there is enough work to pay for waking the threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "common.h"

#define PARALLEL_ELEMENTS (1 << 15)  /* fewer elements than this run on the calling thread */

/* out[:n] = weight * x * 1 / sqrt(mean(x^2) + eps) */
static void rms_norm_row(float *out, const float *x, const float *weight, int n, float eps) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    float sum = hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++)
        sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv)));
    for (; i < n; i++)
        out[i] = weight[i] * (x[i] * inv);
}

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

static PyObject *py_rms_norm(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[3];  /* out, x, weight */
    float eps;
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*y*y*fi:rms_norm", &b[0], &b[1], &b[2], &eps, &num_threads))
        return NULL;
    Py_ssize_t n = b[2].len / 4, rows = n > 0 ? b[1].len / 4 / n : 0;
    static const char *const names[] = {"out", "x"};
    int status = check_width("rms_norm", n) < 0 ? -1 : check_rows("rms_norm", names, b, (Py_ssize_t[]){n, n}, 2, rows);
    if (status == 0) {
        float *out = b[0].buf;
        const float *x = b[1].buf, *weight = b[2].buf;
        int threads = resolve_threads(num_threads);
        Py_BEGIN_ALLOW_THREADS
        #pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS) schedule(static)
        for (Py_ssize_t r = 0; r < rows; r++)
            rms_norm_row(out + r * n, x + r * n, weight, (int)n, eps);
        Py_END_ALLOW_THREADS
    }
    release_buffers(b, 3);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_add_rms_norm(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[5];  /* out, total, x, residual, weight */
    float eps;
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*w*y*y*y*fi:add_rms_norm", &b[0], &b[1], &b[2], &b[3], &b[4], &eps,
                          &num_threads))
        return NULL;
    Py_ssize_t n = b[4].len / 4, rows = n > 0 ? b[2].len / 4 / n : 0;
    static const char *const names[] = {"out", "total", "x", "residual"};
    int status = check_width("add_rms_norm", n) < 0
                 ? -1 : check_rows("add_rms_norm", names, b, (Py_ssize_t[]){n, n, n, n}, 4, rows);
    if (status == 0) {
        float *out = b[0].buf, *total = b[1].buf;
        const float *x = b[2].buf, *residual = b[3].buf, *weight = b[4].buf;
        int threads = resolve_threads(num_threads);
        Py_BEGIN_ALLOW_THREADS
        #pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS) schedule(static)
        for (Py_ssize_t r = 0; r < rows; r++)
            add_rms_norm_row(out + r * n, total + r * n, x + r * n, residual + r * n, weight, (int)n, eps);
        Py_END_ALLOW_THREADS
    }
    release_buffers(b, 5);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[2];  /* out [rows, n], gate_up [rows, 2n] */
    Py_ssize_t n;
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*y*ni:silu_mul", &b[0], &b[1], &n, &num_threads))
        return NULL;
    int status = check_width("silu_mul", n);
    if (status == 0) {
        Py_ssize_t rows = b[0].len / 4 / n;
        static const char *const names[] = {"out", "gate_up"};
        status = check_rows("silu_mul", names, b, (Py_ssize_t[]){n, 2 * n}, 2, rows);
        if (status == 0) {
            float *out = b[0].buf;
            const float *gate_up = b[1].buf;
            int threads = resolve_threads(num_threads);
            Py_BEGIN_ALLOW_THREADS
            #pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS) schedule(static)
            for (Py_ssize_t r = 0; r < rows; r++)
                silu_mul_row(out + r * n, gate_up + 2 * r * n, gate_up + 2 * r * n + n, (int)n);
            Py_END_ALLOW_THREADS
        }
    }
    release_buffers(b, 2);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ops", "Row-wise float32 kernels: rms_norm, add_rms_norm, silu_mul (AVX2, OpenMP).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ops(void) {
    return PyModule_Create(&module);
}
