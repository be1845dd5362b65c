/* The bits of the Python bindings every runtime C module needs (static inline: each module gets
 * its own copy): thread counts, buffer release, the CPU flags the module requires, step tapes. */
#ifndef KILN_COMMON_H
#define KILN_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static inline int resolve_threads(int num_threads) {
    return num_threads > 0 ? num_threads : omp_get_max_threads();
}

static inline void release_buffers(Py_buffer *buffers, int n) {
    for (int i = 0; i < n; i++)
        PyBuffer_Release(&buffers[i]);
}

/* The /proc/cpuinfo names of the instruction sets this module's compiled code requires, from the
 * compiler's predefined macros of the -m options in pyproject.toml (in the order those options
 * are given there; a new -m option needs its line here). A flag implied by a listed one (avx by
 * avx2) is not listed, and code that checks the CPU before it runs (qlinear's AVX-512 path)
 * requires nothing. The builder records the list in an engine's manifest. */
static inline int add_required_cpu_flags(PyObject *module) {
    static const char *const flags[] = {
#ifdef __AVX2__
        "avx2",
#endif
#ifdef __FMA__
        "fma",
#endif
#ifdef __F16C__
        "f16c",
#endif
        NULL,
    };
    Py_ssize_t count = 0;
    while (flags[count])
        count++;
    PyObject *names = PyTuple_New(count);
    if (!names)
        return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyUnicode_FromString(flags[i]);
        if (!name) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, i, name);
    }
    if (PyModule_AddObject(module, "REQUIRED_CPU_FLAGS", names) < 0) {
        Py_DECREF(names);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * Step tapes: while a tape records, every kernel call appends what it computes (a run function and
 * a copy of its arguments: raw pointers and sizes) after its checks pass; replaying the tape runs
 * the same calls again, on whatever the same buffers hold then, with no Python in between. Index
 * checks that depend on the step's metadata (block tables, slots, positions, ids) are recorded
 * too and run again, with the GIL held, before anything is computed. _ops owns the recording
 * state; the other modules find it through a capsule at import.
 */

typedef int (*TapeCheck)(const void *args);  /* GIL held: 0, or -1 with a Python exception set */
typedef int (*TapeRun)(const void *args);    /* GIL released: 0, or -1 when memory runs out */

/* The sizes of a step that a tape's calls follow: packed tokens, sequences, logits rows (0: not given). */
typedef struct {
    Py_ssize_t tokens, seqs, logits;
} TapeShape;

/* Rewrites a call's counts, as recorded in args, for a step of shape `to` instead of `from`: its token rows by
 * the tokens, or, on a call after the logits rows' gather (logits_rows), by the logits rows (tape_rows below);
 * a sequence count by the sequences. */
typedef void (*TapeResize)(void *args, const TapeShape *from, const TapeShape *to, int logits_rows);

typedef struct {
    TapeCheck check;    /* may be NULL */
    TapeRun run;
    TapeResize resize;  /* NULL: the call cannot follow another shape */
    void *args;         /* malloc'd copy, as the calls run now */
    void *recorded;     /* the arguments as recorded (args is rewritten from them for another shape); size bytes */
    size_t size;
    int logits_rows;    /* recorded after the gather of the logits rows: its rows follow those */
} TapeEntry;

typedef struct {
    TapeEntry *entries;
    Py_ssize_t count, capacity;
    int failed;         /* an entry could not be stored: the tape must not be replayed */
    int fixed;          /* an entry has no resize: the tape replays its recorded shape only */
    int logits_phase;   /* while recording: the logits rows have been gathered (tape_logits_gathered) */
    TapeShape recorded; /* the shape its calls were recorded with (tokens 0: not given) */
    TapeShape shape;    /* the shape its entries hold now */
} Tape;

/* A row count of a recorded call that follows a step's size (tokens, or logits rows after their gather; tokens x
 * rows per token, as rms_norm over heads has), rewritten for a size of `to` instead of the recorded `from`.
 * A tape that follows the tokens is recorded on a step with more tokens than sequences and logits rows
 * (runtime/backends/cpu/executor.py), so a count at or above `from` that it divides is size-proportional; smaller counts stay. */
static inline Py_ssize_t tape_rows(Py_ssize_t count, Py_ssize_t from, Py_ssize_t to) {
    return count >= from && from > 0 && count % from == 0 ? count / from * to : count;
}

/* tape_rows for a call's row count: by the tokens, or by the logits rows on a call after their gather. */
static inline Py_ssize_t tape_step_rows(Py_ssize_t count, const TapeShape *from, const TapeShape *to,
                                        int logits_rows) {
    return logits_rows ? tape_rows(count, from->logits, to->logits) : tape_rows(count, from->tokens, to->tokens);
}

typedef struct {
    Tape *recording;       /* NULL when no tape records */
    unsigned long thread;  /* the thread whose calls it records (others' calls are not its steps) */
    int thread_cap;        /* most threads any kernel runs on now, 0: no cap (set_thread_cap) */
} TapeState;

#define TAPE_STATE_CAPSULE "runtime._native._ops._tape_state"

#ifdef KILN_TAPE_STATE_EXTERN
extern TapeState *tape_state;  /* a module of several files: one pointer, defined in one of them */
#else
static TapeState *tape_state;  /* each module's pointer to _ops' state (set at module init) */
#endif

static inline int tape_import(void) {
    tape_state = PyCapsule_Import(TAPE_STATE_CAPSULE, 0);
    return tape_state ? 0 : -1;
}

/* The threads a kernel runs on now: the count its call asked for (recorded with it on a tape), at
 * most the process-wide cap that runtime.backends.cpu.cpus.ThreadGovernor lowers while other processes hold
 * cores. Read when the kernel runs, so a replayed tape follows the cap too. */
static inline int live_threads(int requested) {
    const int cap = tape_state ? __atomic_load_n(&tape_state->thread_cap, __ATOMIC_RELAXED) : 0;
    return cap > 0 && cap < requested ? cap : requested;
}

/* Appends a call to the tape this thread records, if any; resize NULL: it holds its recorded shape. */
static inline void tape_record_resizable(TapeCheck check, TapeRun run, TapeResize resize, const void *args,
                                         size_t size) {
    Tape *tape = tape_state ? tape_state->recording : NULL;
    if (!tape || tape->failed || tape_state->thread != PyThread_get_thread_ident())
        return;
    if (tape->count == tape->capacity) {
        Py_ssize_t capacity = tape->capacity ? 2 * tape->capacity : 64;
        TapeEntry *grown = realloc(tape->entries, sizeof(TapeEntry) * (size_t)capacity);
        if (!grown) {
            tape->failed = 1;
            return;
        }
        tape->entries = grown;
        tape->capacity = capacity;
    }
    void *copy = malloc(2 * size);  /* args, then the recorded arguments */
    if (!copy) {
        tape->failed = 1;
        return;
    }
    memcpy(copy, args, size);
    memcpy((char *)copy + size, args, size);
    tape->entries[tape->count++] = (TapeEntry){check, run, resize, copy, (char *)copy + size, size,
                                               tape->logits_phase};
    if (!resize)
        tape->fixed = 1;
}

static inline void tape_record(TapeCheck check, TapeRun run, const void *args, size_t size) {
    tape_record_resizable(check, run, NULL, args, size);
}

/* Called by the gather of the logits rows after it records: the calls recorded from now on run on those rows. */
static inline void tape_logits_gathered(void) {
    Tape *tape = tape_state ? tape_state->recording : NULL;
    if (tape && tape_state->thread == PyThread_get_thread_ident())
        tape->logits_phase = 1;
}

#endif
