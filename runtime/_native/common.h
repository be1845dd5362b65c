/* Helpers shared by the runtime's C modules (static inline: each module gets its own copy):
 * AVX2 + FMA vector math, and the bits of the Python bindings every module needs. */
#ifndef KILN_COMMON_H
#define KILN_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
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

static inline float hsum256(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

/* exp(x) for x in [-87, 88]: Cody-Waite reduction by ln 2 and the Cephes degree-6 polynomial
 * (relative error ~1e-7, same as expf for softmax purposes). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
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

typedef struct {
    TapeCheck check;  /* may be NULL */
    TapeRun run;
    void *args;       /* malloc'd copy */
} TapeEntry;

typedef struct {
    TapeEntry *entries;
    Py_ssize_t count, capacity;
    int failed;       /* an entry could not be stored: the tape must not be replayed */
} Tape;

typedef struct {
    Tape *recording;       /* NULL when no tape records */
    unsigned long thread;  /* the thread whose calls it records (others' calls are not its steps) */
} TapeState;

#define TAPE_STATE_CAPSULE "runtime._native._ops._tape_state"

static TapeState *tape_state;  /* each module's pointer to _ops' state (set at module init) */

static inline int tape_import(void) {
    tape_state = PyCapsule_Import(TAPE_STATE_CAPSULE, 0);
    return tape_state ? 0 : -1;
}

static inline void tape_record(TapeCheck check, TapeRun run, const void *args, size_t size) {
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
    void *copy = malloc(size);
    if (!copy) {
        tape->failed = 1;
        return;
    }
    memcpy(copy, args, size);
    tape->entries[tape->count++] = (TapeEntry){check, run, copy};
}

#endif
