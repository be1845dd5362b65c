/* Greedy picks, the exponential race and grammar masks of the sampler (runtime/core/sampler.py), over float32
 * logits rows. */
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

PyObject *py_argmax_rows(PyObject *Py_UNUSED(self), PyObject *args) {
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

PyObject *py_race_rows(PyObject *Py_UNUSED(self), PyObject *args) {
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

PyObject *py_race_noise(PyObject *Py_UNUSED(self), PyObject *args) {
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
 * A grammar's mask (runtime/core/constraints.py): -inf for every token a row's bitmask refuses
 */

/* Row `row` of n float32: token v keeps its logit when bit v % 32 of bits[v / 32] is set, else -inf; tokens
 * past the mask's `words` * 32 are refused. Most words of a grammar's mask are all refused or all allowed. */
static void mask_row_bits(float *row, Py_ssize_t n, const uint32_t *bits, Py_ssize_t words) {
    const __m256 refused = _mm256_set1_ps(-INFINITY);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const Py_ssize_t covered = words * 32 < n ? words * 32 : n;
    Py_ssize_t v = 0;
    for (; v + 32 <= covered; v += 32) {
        const uint32_t word = bits[v / 32];
        if (word == UINT32_MAX)
            continue;
        for (int part = 0; part < 4; part++) {
            float *at = row + v + 8 * part;
            const __m256i kept = _mm256_and_si256(_mm256_set1_epi32((int)((word >> (8 * part)) & 0xFF)), lane_bit);
            const __m256 drop = _mm256_castsi256_ps(_mm256_cmpeq_epi32(kept, _mm256_setzero_si256()));
            _mm256_storeu_ps(at, _mm256_blendv_ps(_mm256_loadu_ps(at), refused, drop));
        }
    }
    for (; v < n; v++)
        if (v >= covered || !(bits[v / 32] >> (v % 32) & 1))
            row[v] = -INFINITY;
}

PyObject *py_mask_rows_bits(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[3];  /* x [R, n] float32 (written), rows [M] int64, bits [M, words] int32 */
    Py_ssize_t n, words;
    int threads;
    if (!PyArg_ParseTuple(args, "w*y*y*nni:mask_rows_bits", &b[0], &b[1], &b[2], &n, &words, &threads))
        return NULL;
    const Py_ssize_t m = b[1].len / 8, rows = n > 0 ? b[0].len / 4 / n : 0;
    int ok = n > 0 && words > 0 && b[0].len % (4 * n) == 0 && b[1].len % 8 == 0 && b[2].len == m * words * 4;
    const int64_t *index = b[1].buf;
    for (Py_ssize_t i = 0; ok && i < m; i++)
        ok = index[i] >= 0 && index[i] < rows;
    if (!ok) {
        release_buffers(b, 3);
        return PyErr_Format(PyExc_ValueError, "mask_rows_bits: x must be float32 [R, %zd], rows int64 [M] within R "
                            "and bits int32 [M, %zd]", n, words);
    }
    float *x = b[0].buf;
    const uint32_t *bits = b[2].buf;
    const int live = live_threads(resolve_threads(threads));
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel for num_threads(live) if (m > 1 && live > 1) schedule(static)
    for (Py_ssize_t i = 0; i < m; i++)
        mask_row_bits(x + index[i] * n, n, bits + i * words, words);
    Py_END_ALLOW_THREADS
    release_buffers(b, 3);
    Py_RETURN_NONE;
}
