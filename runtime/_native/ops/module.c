/* The _ops module: step tapes (the recording state every Kiln C module records into), the thread cap, thread
 * placement, and the method table of every _ops binding. */
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

TapeState *tape_state;  /* the module's one pointer to its own state (KILN_TAPE_STATE_EXTERN) */

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
    {"mask_rows_bits", py_mask_rows_bits, METH_VARARGS,
     "mask_rows_bits(x, rows, bits, n, words, num_threads): x[rows[i], v] = -inf wherever bit v % 32 of "
     "bits[i, v / 32] is clear (v past words * 32 too); x float32 [R, n], rows int64, bits int32 [M, words]."},
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
