/* The _qlinear module: Python bindings of the quantized linear kernels (layout.h describes the
 * packed weights, kernels.h the paths). */
#include "../common.h"
#include "kernels.h"

static const Kernels *active_kernels = NULL;

// ----------------------------------------------------------------------------
// Python bindings: bind() checks the weight buffers against the shapes once and keeps them;
// run() takes x and y as addresses the Python wrapper has checked (f32, contiguous, [T, K] / [T, N])

typedef struct {
    Weight w;
    int act;
    int64_t blk;
    const float *bias;   /* [N] or NULL */
    Py_buffer views[4];  /* codes, scales, zeros, bias */
    int num_views;
} Bound;

static void free_bound(Bound *b)
{
    for (int i = 0; i < b->num_views; i++)
        PyBuffer_Release(&b->views[i]);
    PyMem_Free(b);
}

static void capsule_free_bound(PyObject *capsule)
{
    free_bound(PyCapsule_GetPointer(capsule, "qlinear.Bound"));
}

/* Borrow obj's bytes (None -> NULL when optional) and check it holds exactly `bytes`. */
static int take_buffer(Bound *b, PyObject *obj, const char *name, int64_t bytes, int optional, const void **ptr)
{
    *ptr = NULL;
    if (obj == Py_None) {
        if (optional)
            return 0;
        PyErr_Format(PyExc_ValueError, "qlinear: %s is required", name);
        return -1;
    }
    Py_buffer *view = &b->views[b->num_views];
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    b->num_views++;
    if ((int64_t)view->len != bytes) {
        PyErr_Format(PyExc_ValueError, "qlinear: %s holds %zd bytes, the shapes need %lld", name, view->len,
                     (long long)bytes);
        return -1;
    }
    *ptr = view->buf;
    return 0;
}

static int check_dims(int fmt, int act, int64_t N, int64_t K, int64_t G, int64_t blk)
{
    if (fmt < FMT_Q4 || fmt > FMT_Q6 || act < ACT_F32 || act > ACT_INT12)
        return PyErr_Format(PyExc_ValueError, "qlinear: unknown format %d or activation mode %d", fmt, act), -1;
    if (N <= 0 || K <= 0 || K % 8)
        return PyErr_Format(PyExc_ValueError, "qlinear: bad shape N=%lld K=%lld (K must be a positive multiple "
                            "of 8)", (long long)N, (long long)K), -1;
    if (G <= 0 || G % 8 || K % G)
        return PyErr_Format(PyExc_ValueError, "qlinear: group %lld must be a multiple of 8 dividing K=%lld",
                            (long long)G, (long long)K), -1;
    if (act != ACT_F32 && ((fmt != FMT_Q4 && fmt != FMT_Q8) || blk % 32 || K % blk))
        return PyErr_Format(PyExc_ValueError, "qlinear: int8/int16 activations need q4/q8 weights and K, group "
                            "multiples of 32"), -1;
    return 0;
}

/* Activation block of the int8 and int16 modes (and of the q4/q5 per-group sums of x). */
static int64_t activation_block(int fmt, int64_t K, int64_t G)
{
    if (has_zeros(fmt) || G < K)
        return G;
    return K % 128 == 0 ? 128 : K % 64 == 0 ? 64 : 32;
}

/* bind(fmt, act, codes, scales, zeros, bias, N, K, group, scales_f16) -> handle */
static PyObject *py_bind(PyObject *self, PyObject *args)
{
    int fmt, act, scales_f16;
    PyObject *codes, *scales, *zeros, *bias;
    long long N, K, G;
    if (!PyArg_ParseTuple(args, "iiOOOOLLLp", &fmt, &act, &codes, &scales, &zeros, &bias, &N, &K, &G, &scales_f16))
        return NULL;
    const int64_t blk = activation_block(fmt, K, G);
    if (check_dims(fmt, act, N, K, G, blk) < 0)
        return NULL;
    Bound *b = PyMem_Calloc(1, sizeof(Bound));
    if (!b)
        return PyErr_NoMemory();
    b->w = (Weight){.fmt = fmt, .scales_f16 = scales_f16, .n = N, .k = K, .group = G, .panels = ceil_div(N, PANEL)};
    b->act = act;
    b->blk = blk;
    const int64_t P = b->w.panels, scale_bytes = P * (K / G) * PANEL * (scales_f16 ? 2 : 4);
    const void *code_ptr, *scale_ptr, *zero_ptr, *bias_ptr;
    if (take_buffer(b, codes, "codes", P * K * panel_bytes_per_k(fmt), 0, &code_ptr) < 0 ||
        take_buffer(b, scales, "scales", scale_bytes, fmt == FMT_BF16, &scale_ptr) < 0 ||
        take_buffer(b, zeros, "zeros", scale_bytes, !has_zeros(fmt), &zero_ptr) < 0 ||
        take_buffer(b, bias, "bias", N * 4, 1, &bias_ptr) < 0) {
        free_bound(b);
        return NULL;
    }
    if ((fmt == FMT_BF16) != (scale_ptr == NULL) || has_zeros(fmt) != (zero_ptr != NULL)) {
        free_bound(b);
        return PyErr_Format(PyExc_ValueError, "qlinear: scales are needed by every format but bf16, zeros by q4 "
                            "and q5 only");
    }
    b->w.codes = code_ptr;
    b->w.scales = scale_ptr;
    b->w.zeros = zero_ptr;
    b->bias = bias_ptr;
    PyObject *capsule = PyCapsule_New(b, "qlinear.Bound", capsule_free_bound);
    if (!capsule)
        free_bound(b);
    return capsule;
}

/* The arguments of run() and rows(): (handle, out_address, in_address, count, threads). Returns 1
 * with them set, 0 when count is 0 (nothing to do), -1 with an exception set. */
static int parse_call(const char *fn, PyObject *const *args, Py_ssize_t nargs, const Bound **b, void **out,
                      const void **in, long long *count, long *threads)
{
    if (nargs != 5)
        return PyErr_Format(PyExc_TypeError, "%s() takes 5 arguments (%zd given)", fn, nargs), -1;
    *b = PyCapsule_GetPointer(args[0], "qlinear.Bound");
    if (!*b)
        return -1;
    *out = PyLong_AsVoidPtr(args[1]);
    *in = PyLong_AsVoidPtr(args[2]);
    *count = PyLong_AsLongLong(args[3]);
    *threads = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return -1;
    if (*count == 0)
        return 0;
    if (!*out || !*in || *count < 0)
        return PyErr_Format(PyExc_ValueError, "qlinear.%s: null address or negative count", fn), -1;
    return 1;
}

typedef struct {
    const Bound *b;
    float *out;
    const void *in;   /* x [T, K] f32 (run) or ids [R] int64 (rows) */
    long long count;  /* T or R */
    int threads;
} CallArgs;

static int run_linear(const void *p)
{
    const CallArgs *a = p;
    const Kernels *kern = active_kernels;
    Job job = {.w = a->b->w, .act = a->b->act, .t = a->count, .blk = a->b->blk, .direct_t = kern->direct_t,
               .x = a->in, .bias = a->b->bias, .y = a->out};
    return run_kernels(kern, &job, live_threads(a->threads));
}

static void resize_call(void *p, const TapeShape *from, const TapeShape *to, int logits_rows)
{
    CallArgs *a = p;
    a->count = tape_step_rows((Py_ssize_t)a->count, from, to, logits_rows);
}

/* run(handle, y_address, x_address, T, threads): y[T, N] = x[T, K] @ W^T (+ bias) */
static PyObject *py_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CallArgs a;
    long threads;
    const int status = parse_call("run", args, nargs, &a.b, (void **)&a.out, &a.in, &a.count, &threads);
    if (status <= 0)
        return status < 0 ? NULL : Py_NewRef(Py_None);
    a.threads = (int)threads;
    tape_record_resizable(NULL, run_linear, resize_call, &a, sizeof a);
    int result;
    Py_BEGIN_ALLOW_THREADS
    result = run_linear(&a);
    Py_END_ALLOW_THREADS
    return result < 0 ? PyErr_NoMemory() : Py_NewRef(Py_None);
}

static PyObject *py_isa(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(active_kernels->name);
}

/* The fastest kernels this CPU runs: AMX, else AVX-512, else AVX2 (each gives the same numbers). */
static const Kernels *best_kernels(void)
{
    return cpu_has_amx() ? &KERNELS_AMX : cpu_has_avx512() ? &KERNELS_AVX512 : &KERNELS_AVX2;
}

/* set_isa("auto" | "amx" | "avx512" | "avx2" | "portable"): pick the kernels (tests use it to cover every path). */
static PyObject *py_set_isa(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    if (!strcmp(name, "auto"))
        active_kernels = best_kernels();
    else if (!strcmp(name, "amx")) {
        if (!cpu_has_amx())
            return PyErr_Format(PyExc_ValueError, "qlinear: this CPU (or OS) offers no AMX-INT8 tiles");
        active_kernels = &KERNELS_AMX;
    } else if (!strcmp(name, "avx512")) {
        if (!cpu_has_avx512())
            return PyErr_Format(PyExc_ValueError, "qlinear: this CPU lacks AVX-512 F/BW/DQ/VL/VNNI");
        active_kernels = &KERNELS_AVX512;
    } else if (!strcmp(name, "avx2"))
        active_kernels = &KERNELS_AVX2;
    else if (!strcmp(name, "portable"))
        active_kernels = &KERNELS_PORTABLE;
    else
        return PyErr_Format(PyExc_ValueError, "qlinear: unknown isa %R (auto, amx, avx512, avx2, portable)", arg);
    return PyUnicode_FromString(active_kernels->name);
}

/* rows(handle, out_address, ids_address, R, threads): out[R, K] f32 = dequantized weight rows ids[R]
 * (int64, each checked against N): embedding lookups of a packed table, through the exact
 * portable dequantization (one rounding per element). */
static int check_rows(const void *p)
{
    const CallArgs *a = p;
    const int64_t *ids = a->in;
    for (long long r = 0; r < a->count; r++)
        if (ids[r] < 0 || ids[r] >= a->b->w.n) {
            PyErr_Format(PyExc_ValueError, "qlinear.rows: id %lld at %lld is outside 0..%lld", (long long)ids[r], r,
                         (long long)a->b->w.n - 1);
            return -1;
        }
    return 0;
}

static int run_rows(const void *p)
{
    const CallArgs *a = p;
    dequantize_rows(&a->b->w, a->in, a->count, a->out, live_threads(a->threads));
    return 0;
}

static PyObject *py_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CallArgs a;
    long threads;
    const int status = parse_call("rows", args, nargs, &a.b, (void **)&a.out, &a.in, &a.count, &threads);
    if (status <= 0)
        return status < 0 ? NULL : Py_NewRef(Py_None);
    a.threads = (int)threads;
    if (check_rows(&a) < 0)
        return NULL;
    tape_record_resizable(check_rows, run_rows, resize_call, &a, sizeof a);
    Py_BEGIN_ALLOW_THREADS
    run_rows(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* peak(kind, threads, iters) -> operations/s of the active kernels' multiply-add instruction
 * (kind 0: f32 FMA, 1: int8 dot product, 2: int16 pair product) on `threads` threads, registers only. */
static PyObject *py_peak(PyObject *self, PyObject *args)
{
    int kind, threads;
    long long iters;
    if (!PyArg_ParseTuple(args, "iiL", &kind, &threads, &iters))
        return NULL;
    if ((kind != PEAK_F32 && kind != PEAK_INT8 && kind != PEAK_INT16) || threads < 1 || iters < 1)
        return PyErr_Format(PyExc_ValueError, "peak: kind 0, 1 or 2, threads and iters >= 1"), NULL;
    double ops;
    Py_BEGIN_ALLOW_THREADS
    ops = measure_peak(active_kernels, kind, threads, (int64_t)iters);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(ops);
}

static PyMethodDef methods[] = {
    {"bind", py_bind, METH_VARARGS, "bind(fmt, act, codes, scales, zeros, bias, N, K, group, scales_f16) -> handle"},
    {"run", (PyCFunction)(void (*)(void))py_run, METH_FASTCALL, "run(handle, y_address, x_address, T, threads)"},
    {"rows", (PyCFunction)(void (*)(void))py_rows, METH_FASTCALL,
     "rows(handle, out_address, ids_address, R, threads): dequantized weight rows"},
    {"peak", py_peak, METH_VARARGS,
     "peak(kind, threads, iters) -> operations/s (kind 0: f32 FMA, 1: int8 dot, 2: int16 pairs)."},
    {"isa", py_isa, METH_NOARGS, "Name of the kernels in use: 'amx', 'avx512', 'avx2' or 'portable'."},
    {"set_isa", py_set_isa, METH_O, "set_isa('auto' | 'amx' | 'avx512' | 'avx2' | 'portable') -> name in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qlinear", "Quantized linear kernels.", -1, methods};

PyMODINIT_FUNC PyInit__qlinear(void)
{
    active_kernels = best_kernels();
    if (tape_import() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (add_required_cpu_flags(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    const struct { const char *name; int value; } consts[] = {
        {"FMT_Q4", FMT_Q4}, {"FMT_Q5", FMT_Q5}, {"FMT_Q6", FMT_Q6}, {"FMT_Q8", FMT_Q8}, {"FMT_F8", FMT_F8},
        {"FMT_BF16", FMT_BF16},
        {"ACT_F32", ACT_F32}, {"ACT_INT8", ACT_INT8}, {"ACT_INT16", ACT_INT16}, {"ACT_INT12", ACT_INT12}, {"PANEL", PANEL},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
