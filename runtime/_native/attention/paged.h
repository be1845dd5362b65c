/* Internal to the paged-attention kernels (paged.c, decode.c): the vector helpers, work items, per-thread
 * scratch and the one-item helpers both paths share, as static inline functions, and the entry points each
 * file gives the other. */
#ifndef KILN_ATTENTION_PAGED_H
#define KILN_ATTENTION_PAGED_H

#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../numeric.h"

/* ----------------------------------------------------------------------------------------
 * Vector helpers (AVX2 + FMA)
 */

/* a, b: [n] */
static inline float dot(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float sum = hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* The eight sums of a0..a7, one per lane: [sum(a0), ..., sum(a7)] */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                           __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* scores[0:8] = scale * q . k_rows[0:8]; q: [hd], k_rows: 8 rows of [hd], hd % 8 == 0.
 * Eight independent FMA chains share each load of q and need one reduction per 8 keys. */
static inline void score_eight_keys(const float *q, const float *const *k_rows, int hd, float scale,
                                    float *scores) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int d = 0; d < hd; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[0] + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[3] + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[4] + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[5] + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[6] + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[7] + d), a7);
    }
    _mm256_storeu_ps(scores, _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
}

/* scores: [n] = scale * q . k_rows[i]; returns their max */
static inline float score_keys(const float *q, const float *const *k_rows, int n, int hd, float scale,
                        float *scores) {
    int i = 0;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    if (hd % 8 == 0)
        for (; i + 8 <= n; i += 8) {
            score_eight_keys(q, k_rows + i, hd, scale, scores + i);
            vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + i));
        }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float max_score = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    for (; i < n; i++) {
        scores[i] = dot(q, k_rows[i], hd) * scale;
        max_score = scores[i] > max_score ? scores[i] : max_score;
    }
    return max_score;
}

/* p: [n] scores, replaced by exp(p - max_score); returns their sum */
static inline float exp_shifted(float *p, int n, float max_score) {
    __m256 shift = _mm256_set1_ps(max_score), total = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), shift));
        _mm256_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum256(total);
    for (; i < n; i++) {
        p[i] = expf(p[i] - max_score);
        sum += p[i];
    }
    return sum;
}

/* acc: [hd] *= factor */
static inline void scale_row(float *acc, float factor, int hd) {
    for (int d = 0; d < hd; d++)
        acc[d] *= factor;
}

/* acc: [64] += sum_i p[i] * v_rows[i][:64]: eight independent accumulators, so the FMAs of one
 * value row do not wait on each other (head_dim 64 is the common case). */
static inline void accumulate_values_64(float *acc, const float *p, const float *const *v_rows, int n) {
    __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8), a2 = _mm256_loadu_ps(acc + 16);
    __m256 a3 = _mm256_loadu_ps(acc + 24), a4 = _mm256_loadu_ps(acc + 32), a5 = _mm256_loadu_ps(acc + 40);
    __m256 a6 = _mm256_loadu_ps(acc + 48), a7 = _mm256_loadu_ps(acc + 56);
    for (int i = 0; i < n; i++) {
        __m256 w = _mm256_set1_ps(p[i]);
        const float *v = v_rows[i];
        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
        a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
        a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
        a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4);
        a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
        a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6);
        a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
    }
    _mm256_storeu_ps(acc, a0), _mm256_storeu_ps(acc + 8, a1), _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3), _mm256_storeu_ps(acc + 32, a4), _mm256_storeu_ps(acc + 40, a5);
    _mm256_storeu_ps(acc + 48, a6), _mm256_storeu_ps(acc + 56, a7);
}

/* acc: [hd] += sum_i p[i] * v_rows[i][:hd]; four accumulators in registers per pass. */
static inline void accumulate_values(float *acc, const float *p, const float *const *v_rows, int n, int hd) {
    if (hd == 64) {
        accumulate_values_64(acc, p, v_rows, n);
        return;
    }
    int d = 0;
    for (; d + 32 <= hd; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int i = 0; i < n; i++) {
            __m256 w = _mm256_set1_ps(p[i]);
            const float *v = v_rows[i] + d;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d + 8 <= hd; d += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + d);
        for (int i = 0; i < n; i++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(v_rows[i] + d), a0);
        _mm256_storeu_ps(acc + d, a0);
    }
    for (; d < hd; d++)
        for (int i = 0; i < n; i++)
            acc[d] += p[i] * v_rows[i][d];
}

/* ----------------------------------------------------------------------------------------
 * Paged attention: work items and per-thread scratch
 */

#define KEY_CHUNK 32      /* keys scored together before one softmax rescale */
#define WHOLE_SEQ_ITEMS_PER_THREAD 4  /* decoding sequences a thread that make a sequence one work item */

typedef struct {
    int seq;      /* sequence index s */
    int kv_head;  /* first kv head; the nh / nkv query heads of each are processed together */
    int kv_heads; /* kv heads of the item: 1, or every one of a decoding sequence (attend_single_query) */
    int q_begin;  /* first query of the tile, 0-based within the sequence */
    int q_end;    /* one past the last query of the tile */
} WorkItem;

/* One per thread; cache-line aligned so that no two threads write to the same line. */
typedef struct {
    _Alignas(64) float *acc;  /* [max_rows, hd] running sum of p * v per (query, head) row */
    float *row_max;        /* [max_rows] running max score */
    float *row_sum;        /* [max_rows] running sum of exp(score - row_max) */
    float *scores;         /* [max_rows, KEY_CHUNK] scores, then probabilities (one row at a time
                              on the general path, every row of the item on the single-query one) */
    float *k_decoded;      /* [KEY_CHUNK, hd] float32 keys of a non-f32 cache */
    float *v_decoded;      /* [KEY_CHUNK, hd] float32 values of a non-f32 cache */
    const float *k_rows[KEY_CHUNK];  /* row pointers of the current key chunk */
    const float *v_rows[KEY_CHUNK];  /* row pointers of the current value chunk */
    const uint8_t *k_src[KEY_CHUNK]; /* single-query path: the chunk's key rows in the cache */
    const uint8_t *v_src[KEY_CHUNK]; /* ... and its value rows */
    float *q2;             /* single-query path with AVX-512: [max_rows, 2 hd] each query head with every 8
                              dimensions written twice (score_keys_512) */
} Scratch;


static inline int seq_query_len(const AttentionArgs *a, int s) {
    return a->query_start_loc[s + 1] - a->query_start_loc[s];
}

/* ----------------------------------------------------------------------------------------
 * Paged attention: one work item
 */

/* Points scratch->k_rows / v_rows at keys key_begin .. key_begin + n - 1 of one kv head,
 * decoding them into float32 scratch (one run per cache block) unless the cache is float32. */
static inline void load_key_chunk(const AttentionArgs *a, const int32_t *table, int kv_head,
                           int key_begin, int n, Scratch *scratch) {
    int hd = a->head_dim, dtype = a->cache_dtype, block_size = a->block_size;
    size_t slot_stride = (size_t)a->num_kv_heads * hd;  /* elements between consecutive slots */
    size_t elem = (size_t)cache_elem_size[dtype];
    for (int i = 0; i < n;) {
        int pos = key_begin + i, offset = pos % block_size;
        int run = block_size - offset < n - i ? block_size - offset : n - i;
        if (table[pos / block_size] < 0) {  /* a block given back behind a sliding window: no query sees it */
            i += run;
            continue;
        }
        size_t slot = (size_t)table[pos / block_size] * block_size + offset;
        size_t at = (slot * slot_stride + (size_t)kv_head * hd) * elem;
        const uint8_t *k_src = a->k_cache + at, *v_src = a->v_cache + at;
        if (dtype == CACHE_F32) {
            for (int r = 0; r < run; r++) {
                scratch->k_rows[i + r] = (const float *)k_src + r * slot_stride;
                scratch->v_rows[i + r] = (const float *)v_src + r * slot_stride;
            }
        } else {
            float *k = scratch->k_decoded + (size_t)i * hd, *v = scratch->v_decoded + (size_t)i * hd;
            decode_rows(k, k_src, run, slot_stride, hd, dtype, a->kv_scale);
            decode_rows(v, v_src, run, slot_stride, hd, dtype, a->kv_scale);
            for (int r = 0; r < run; r++) {
                scratch->k_rows[i + r] = k + (size_t)r * hd;
                scratch->v_rows[i + r] = v + (size_t)r * hd;
            }
        }
        i += run;
    }
}

/* Asks for the cache lines of keys (PREFETCH_KEYS), values (PREFETCH_VALUES) or both, key_begin .. key_begin +
 * n - 1 of one kv head, ahead of their use. A head's rows are strided between the other heads' rows and its blocks lie anywhere
 * in the pool, so the hardware prefetchers do not see the stream: without this, batched decode
 * waits on memory for each row in turn. */
#define PREFETCH_KEYS 1
#define PREFETCH_VALUES 2

static inline void prefetch_rows(const AttentionArgs *a, const int32_t *table, int kv_head, int kv_heads, int key_begin, int n,
                          int which) {
    size_t elem = (size_t)cache_elem_size[a->cache_dtype];
    size_t slot_bytes = (size_t)a->num_kv_heads * a->head_dim * elem, row_bytes = (size_t)a->head_dim * elem;
    size_t bytes = row_bytes * (size_t)kv_heads;  /* the item's heads are adjacent in a slot */
    for (int pos = key_begin; pos < key_begin + n; pos++) {
        if (table[pos / a->block_size] < 0)  /* given back behind a sliding window */
            continue;
        size_t slot = (size_t)table[pos / a->block_size] * a->block_size + pos % a->block_size;
        size_t at = slot * slot_bytes + (size_t)kv_head * row_bytes;
        for (size_t line = 0; line < bytes; line += 64) {
            if (which & PREFETCH_KEYS)
                _mm_prefetch((const char *)a->k_cache + at + line, _MM_HINT_T0);
            if (which & PREFETCH_VALUES)
                _mm_prefetch((const char *)a->v_cache + at + line, _MM_HINT_T0);
        }
    }
}

static inline void prefetch_key_chunk(const AttentionArgs *a, const int32_t *table, int kv_head, int key_begin, int n) {
    prefetch_rows(a, table, kv_head, 1, key_begin, n, PREFETCH_KEYS | PREFETCH_VALUES);
}

/* prefetch_rows for the first chunk an item reads. */
static inline void prefetch_first_chunk(const AttentionArgs *a, const WorkItem *w, int which) {
    int num_keys = a->context_lens[w->seq] - seq_query_len(a, w->seq) + w->q_end;
    int keys_from = first_visible_key(a, a->context_lens[w->seq] - seq_query_len(a, w->seq) + w->q_begin)
                    / KEY_CHUNK * KEY_CHUNK;
    prefetch_rows(a, a->block_tables + (size_t)w->seq * a->max_blocks, w->kv_head, w->kv_heads, keys_from,
                  num_keys - keys_from < KEY_CHUNK ? num_keys - keys_from : KEY_CHUNK, which);
}

/* Streaming-softmax update of one (query, head) row with keys skip .. skip + n - 1 of the chunk. */
static inline void attend_chunk_row(const float *q, int skip, int n, float scale, int hd, Scratch *scratch,
                             float *acc, float *row_max, float *row_sum) {
    float *scores = scratch->scores;
    float chunk_max = score_keys(q, scratch->k_rows + skip, n, hd, scale, scores);
    if (chunk_max > *row_max) {
        float correction = expf(*row_max - chunk_max);
        scale_row(acc, correction, hd);
        *row_sum *= correction;
        *row_max = chunk_max;
    }
    *row_sum += exp_shifted(scores, n, *row_max);
    accumulate_values(acc, scores, scratch->v_rows + skip, n, hd);
}

/* The streaming softmax of `rows` rows before their first key: no sum, no weight, max -inf. */
static inline void start_rows(Scratch *scratch, int rows, int hd) {
    memset(scratch->acc, 0, sizeof(float) * (size_t)rows * hd);
    for (int r = 0; r < rows; r++) {
        scratch->row_max[r] = -INFINITY;
        scratch->row_sum[r] = 0.0f;
    }
}

/* decode.c: items with one query (every item of a decode step), and all the query heads of a kv head at once */
void attend_single_query(const AttentionArgs *a, const WorkItem *w, const WorkItem *ahead, int first_asked,
                         Scratch *scratch);
void attend_work_item_heads(const AttentionArgs *a, const WorkItem *w, Scratch *scratch);
int spreads_ahead(const WorkItem *w, const WorkItem *ahead);

#endif
