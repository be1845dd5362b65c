/* Paged attention and KV-cache writes for the Kiln CPU runtime.
 *
 * Plain C over the Python buffer protocol; runtime/attention.py checks dtypes and shapes and
 * passes flat buffers plus sizes. This file checks buffer lengths and the metadata values
 * (slots, block ids, query offsets) while it holds the GIL, before touching any data, then
 * releases the GIL and computes with OpenMP over (sequence, kv head, query tile) work items.
 *
 * A cache is [num_blocks, block_size, num_kv_heads, head_dim] of one element type (the
 * CacheDtype codes below); i8 and f8e4m3 caches store x / kv_scale and read back q * kv_scale.
 * Queries, outputs and all arithmetic are float32.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdarg.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "numeric.h"

/* ----------------------------------------------------------------------------------------
 * Cache element types
 */

typedef enum {
    CACHE_F32 = 0,
    CACHE_BF16 = 1,
    CACHE_F16 = 2,
    CACHE_I8 = 3,
    CACHE_F8E4M3 = 4,
    CACHE_NUM_DTYPES = 5
} CacheDtype;

static const int cache_elem_size[CACHE_NUM_DTYPES] = {4, 2, 2, 1, 1};

static float f8e4m3_table[256];  /* [256] float value of every e4m3fn byte, built at import */

static float f8e4m3_decode_scalar(uint8_t byte) {
    int sign = byte >> 7, exponent = (byte >> 3) & 0xF, mantissa = byte & 0x7;
    float magnitude;
    if (exponent == 0xF && mantissa == 0x7)
        magnitude = NAN;
    else if (exponent == 0)
        magnitude = ldexpf((float)mantissa, -9);
    else
        magnitude = ldexpf((float)(8 + mantissa), exponent - 10);
    return sign ? -magnitude : magnitude;
}

static void build_f8e4m3_table(void) {
    for (int i = 0; i < 256; i++)
        f8e4m3_table[i] = f8e4m3_decode_scalar((uint8_t)i);
}

/* Saturating round-to-nearest-even float -> e4m3fn (max 448, no infinities). */
static uint8_t f8e4m3_encode(float x) {
    if (isnan(x))
        return 0x7F;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float magnitude = fabsf(x);
    if (magnitude >= 448.0f)
        return sign | 0x7E;
    if (magnitude < 0.015625f)  /* below 2^-6: subnormals, steps of 2^-9 */
        return sign | (uint8_t)nearbyintf(magnitude * 512.0f);
    uint32_t bits;
    memcpy(&bits, &magnitude, 4);
    bits += 0x7FFFF + ((bits >> 20) & 1);  /* round 23 mantissa bits to 3, ties to even */
    uint32_t exponent = (bits >> 23) - 127 + 7;
    return sign | (uint8_t)((exponent << 3) | ((bits >> 20) & 0x7));
}

static uint16_t bf16_encode(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (isnan(x))
        return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static int8_t i8_encode(float x, float kv_scale) {
    float q = nearbyintf(x / kv_scale);
    q = fminf(fmaxf(q, -127.0f), 127.0f);
    return (int8_t)q;
}

/* ----------------------------------------------------------------------------------------
 * Row conversion between a cache row and float32
 */

static void decode_bf16(float *dst, const uint16_t *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, 4);
    }
}

static void decode_f16(float *dst, const uint16_t *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = _cvtsh_ss(src[i]);
}

static void decode_i8(float *dst, const int8_t *src, int n, float kv_scale) {
    __m256 scale = _mm256_set1_ps(kv_scale);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), scale));
    }
    for (; i < n; i++)
        dst[i] = (float)src[i] * kv_scale;
}

static void decode_f8e4m3(float *dst, const uint8_t *src, int n, float kv_scale) {
    __m256 scale = _mm256_set1_ps(kv_scale);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        __m256 value = _mm256_i32gather_ps(f8e4m3_table, index, 4);
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(value, scale));
    }
    for (; i < n; i++)
        dst[i] = f8e4m3_table[src[i]] * kv_scale;
}

/* dst: [rows, n] float32; src: rows of n cache elements, src_stride elements apart */
static void decode_rows(float *dst, const uint8_t *src, int rows, size_t src_stride, int n, int dtype,
                        float kv_scale) {
    size_t step = src_stride * cache_elem_size[dtype];
    for (int r = 0; r < rows; r++, dst += n, src += step)
        switch (dtype) {
        case CACHE_F32: memcpy(dst, src, (size_t)n * 4); break;
        case CACHE_BF16: decode_bf16(dst, (const uint16_t *)src, n); break;
        case CACHE_F16: decode_f16(dst, (const uint16_t *)src, n); break;
        case CACHE_I8: decode_i8(dst, (const int8_t *)src, n, kv_scale); break;
        case CACHE_F8E4M3: decode_f8e4m3(dst, src, n, kv_scale); break;
        }
}

/* dst: [n] cache elements; src: [n] float32 */
static void encode_row(void *dst, const float *src, int n, int dtype, float kv_scale) {
    switch (dtype) {
    case CACHE_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case CACHE_BF16:
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[i] = bf16_encode(src[i]);
        break;
    case CACHE_F16:
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        break;
    case CACHE_I8:
        for (int i = 0; i < n; i++) ((int8_t *)dst)[i] = i8_encode(src[i], kv_scale);
        break;
    case CACHE_F8E4M3:
        for (int i = 0; i < n; i++) ((uint8_t *)dst)[i] = f8e4m3_encode(src[i] / kv_scale);
        break;
    }
}

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
static float score_keys(const float *q, const float *const *k_rows, int n, int hd, float scale,
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
static float exp_shifted(float *p, int n, float max_score) {
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
static void scale_row(float *acc, float factor, int hd) {
    for (int d = 0; d < hd; d++)
        acc[d] *= factor;
}

/* acc: [64] += sum_i p[i] * v_rows[i][:64]: eight independent accumulators, so the FMAs of one
 * value row do not wait on each other (head_dim 64 is the common case). */
static void accumulate_values_64(float *acc, const float *p, const float *const *v_rows, int n) {
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
static void accumulate_values(float *acc, const float *p, const float *const *v_rows, int n, int hd) {
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
 * KV write
 */

typedef struct {
    const float *key;              /* [T, nkv, hd] */
    const float *value;            /* [T, nkv, hd] */
    uint8_t *k_cache;              /* [num_slots, nkv, hd] cache elements */
    uint8_t *v_cache;              /* [num_slots, nkv, hd] cache elements */
    const int64_t *slot_mapping;   /* [T], -1 = skip */
    Py_ssize_t num_tokens;         /* T */
    Py_ssize_t num_slots;          /* num_blocks * block_size */
    int row_size;                  /* nkv * hd */
    int cache_dtype;               /* CacheDtype */
    float kv_scale;                /* quantization scale of i8/f8 caches */
} KVWriteArgs;

static void kv_write_compute(const KVWriteArgs *a, int num_threads) {
    size_t row_bytes = (size_t)a->row_size * cache_elem_size[a->cache_dtype];
    int parallel = a->num_tokens * a->row_size >= (1 << 16);
    #pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (Py_ssize_t t = 0; t < a->num_tokens; t++) {
        int64_t slot = a->slot_mapping[t];
        if (slot < 0)
            continue;
        size_t src = (size_t)t * a->row_size;
        encode_row(a->k_cache + slot * row_bytes, a->key + src, a->row_size, a->cache_dtype, a->kv_scale);
        encode_row(a->v_cache + slot * row_bytes, a->value + src, a->row_size, a->cache_dtype, a->kv_scale);
    }
}

/* ----------------------------------------------------------------------------------------
 * Paged attention: work items and per-thread scratch
 */

#define KEY_CHUNK 32      /* keys scored together before one softmax rescale */
#define ROWS_PER_TILE 32  /* target (query, head) rows per prefill work item */

typedef struct {
    const float *query;              /* [T, nh, hd] */
    float *out;                      /* [T, nh, hd] */
    const uint8_t *k_cache;          /* [num_blocks, block_size, nkv, hd] cache elements */
    const uint8_t *v_cache;          /* [num_blocks, block_size, nkv, hd] cache elements */
    const int32_t *block_tables;     /* [S, max_blocks] */
    const int32_t *context_lens;     /* [S] */
    const int32_t *query_start_loc;  /* [S + 1] */
    int num_seqs;                    /* S */
    int max_blocks;                  /* block table width */
    int num_heads;                   /* nh */
    int num_kv_heads;                /* nkv */
    int head_dim;                    /* hd */
    int block_size;                  /* slots per block */
    int queries_per_tile;            /* queries of one sequence per work item */
    int cache_dtype;                 /* CacheDtype */
    float kv_scale;                  /* dequantization scale of i8/f8 caches */
    float scale;                     /* softmax scale on q . k */
} AttentionArgs;

typedef struct {
    int seq;      /* sequence index s */
    int kv_head;  /* kv head; its nh / nkv query heads are processed together */
    int q_begin;  /* first query of the tile, 0-based within the sequence */
    int q_end;    /* one past the last query of the tile */
} WorkItem;

/* One per thread; cache-line aligned so that no two threads write to the same line. */
typedef struct {
    _Alignas(64) float *acc;  /* [max_rows, hd] running sum of p * v per (query, head) row */
    float *row_max;        /* [max_rows] running max score */
    float *row_sum;        /* [max_rows] running sum of exp(score - row_max) */
    float *scores;         /* [KEY_CHUNK] scores, then probabilities */
    float *k_decoded;      /* [KEY_CHUNK, hd] float32 keys of a non-f32 cache */
    float *v_decoded;      /* [KEY_CHUNK, hd] float32 values of a non-f32 cache */
    const float *k_rows[KEY_CHUNK];  /* row pointers of the current key chunk */
    const float *v_rows[KEY_CHUNK];  /* row pointers of the current value chunk */
} Scratch;

static void free_scratch(Scratch *scratch, int num_threads) {
    for (int i = 0; i < num_threads; i++)
        free(scratch[i].acc);
    free(scratch);
}

/* n floats rounded up to whole 64-byte cache lines, so that every scratch array starts on one */
static size_t cache_lines(size_t n) {
    return (n + 15) & ~(size_t)15;
}

static Scratch *build_scratch(int num_threads, int max_rows, int hd) {
    Scratch *scratch = aligned_alloc(64, sizeof(Scratch) * (size_t)num_threads);
    if (!scratch)
        return NULL;
    size_t acc = cache_lines((size_t)max_rows * hd), rows = cache_lines(max_rows);
    size_t scores = cache_lines(KEY_CHUNK), decoded = cache_lines((size_t)KEY_CHUNK * hd);
    for (int i = 0; i < num_threads; i++) {
        Scratch *s = &scratch[i];
        s->acc = aligned_alloc(64, sizeof(float) * (acc + 2 * rows + scores + 2 * decoded));
        if (!s->acc) {
            free_scratch(scratch, i);
            return NULL;
        }
        s->row_max = s->acc + acc;
        s->row_sum = s->row_max + rows;
        s->scores = s->row_sum + rows;
        s->k_decoded = s->scores + scores;
        s->v_decoded = s->k_decoded + decoded;
    }
    return scratch;
}

static int seq_query_len(const AttentionArgs *a, int s) {
    return a->query_start_loc[s + 1] - a->query_start_loc[s];
}

/* Counts work items; with items != NULL also fills them, the costliest (last) tile of each
 * sequence first so that dynamic scheduling balances causal prefill. */
static Py_ssize_t build_work_items(const AttentionArgs *a, WorkItem *items) {
    Py_ssize_t count = 0;
    int tile = a->queries_per_tile;
    for (int s = 0; s < a->num_seqs; s++) {
        int qlen = seq_query_len(a, s);
        for (int q_begin = ((qlen - 1) / tile) * tile; qlen > 0 && q_begin >= 0; q_begin -= tile)
            for (int g = 0; g < a->num_kv_heads; g++, count++)
                if (items) {
                    int q_end = q_begin + tile < qlen ? q_begin + tile : qlen;
                    items[count] = (WorkItem){s, g, q_begin, q_end};
                }
    }
    return count;
}

/* ----------------------------------------------------------------------------------------
 * Paged attention: one work item
 */

/* Points scratch->k_rows / v_rows at keys key_begin .. key_begin + n - 1 of one kv head,
 * decoding them into float32 scratch (one run per cache block) unless the cache is float32. */
static void load_key_chunk(const AttentionArgs *a, const int32_t *table, int kv_head,
                           int key_begin, int n, Scratch *scratch) {
    int hd = a->head_dim, dtype = a->cache_dtype, block_size = a->block_size;
    size_t slot_stride = (size_t)a->num_kv_heads * hd;  /* elements between consecutive slots */
    size_t elem = (size_t)cache_elem_size[dtype];
    for (int i = 0; i < n;) {
        int pos = key_begin + i, offset = pos % block_size;
        int run = block_size - offset < n - i ? block_size - offset : n - i;
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

/* Streaming-softmax update of one (query, head) row with the first n keys of the chunk. */
static void attend_chunk_row(const float *q, int n, float scale, int hd, Scratch *scratch,
                             float *acc, float *row_max, float *row_sum) {
    float *scores = scratch->scores;
    float chunk_max = score_keys(q, scratch->k_rows, n, hd, scale, scores);
    if (chunk_max > *row_max) {
        float correction = expf(*row_max - chunk_max);
        scale_row(acc, correction, hd);
        *row_sum *= correction;
        *row_max = chunk_max;
    }
    *row_sum += exp_shifted(scores, n, *row_max);
    accumulate_values(acc, scores, scratch->v_rows, n, hd);
}

static void attend_work_item(const AttentionArgs *a, const WorkItem *w, Scratch *scratch) {
    int hd = a->head_dim, ratio = a->num_heads / a->num_kv_heads;
    int rows = (w->q_end - w->q_begin) * ratio;
    int token0 = a->query_start_loc[w->seq];
    int first_pos = a->context_lens[w->seq] - seq_query_len(a, w->seq);  /* position of query 0 */
    int num_keys = first_pos + w->q_end;  /* keys seen by the tile's last query */
    const int32_t *table = a->block_tables + (size_t)w->seq * a->max_blocks;

    memset(scratch->acc, 0, sizeof(float) * (size_t)rows * hd);
    for (int r = 0; r < rows; r++) {
        scratch->row_max[r] = -INFINITY;
        scratch->row_sum[r] = 0.0f;
    }
    for (int key_begin = 0; key_begin < num_keys; key_begin += KEY_CHUNK) {
        int chunk = num_keys - key_begin < KEY_CHUNK ? num_keys - key_begin : KEY_CHUNK;
        load_key_chunk(a, table, w->kv_head, key_begin, chunk, scratch);
        for (int r = 0; r < rows; r++) {
            int j = w->q_begin + r / ratio, head = w->kv_head * ratio + r % ratio;
            int visible = first_pos + j + 1 - key_begin;  /* causal limit within the chunk */
            if (visible <= 0)
                continue;
            const float *q = a->query + ((size_t)(token0 + j) * a->num_heads + head) * hd;
            attend_chunk_row(q, visible < chunk ? visible : chunk, a->scale, hd, scratch,
                             scratch->acc + (size_t)r * hd, &scratch->row_max[r], &scratch->row_sum[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        int j = w->q_begin + r / ratio, head = w->kv_head * ratio + r % ratio;
        float *o = a->out + ((size_t)(token0 + j) * a->num_heads + head) * hd;
        float inv_sum = 1.0f / scratch->row_sum[r];
        for (int d = 0; d < hd; d++)
            o[d] = scratch->acc[(size_t)r * hd + d] * inv_sum;
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
static int paged_attention_compute(const AttentionArgs *a, int num_threads) {
    Py_ssize_t num_items = build_work_items(a, NULL);
    if (num_items == 0)
        return 0;
    int ratio = a->num_heads / a->num_kv_heads;
    WorkItem *items = malloc(sizeof(WorkItem) * (size_t)num_items);
    Scratch *scratch = build_scratch(num_threads, a->queries_per_tile * ratio, a->head_dim);
    if (!items || !scratch) {
        free(items);
        if (scratch) free_scratch(scratch, num_threads);
        return -1;
    }
    build_work_items(a, items);
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic)
    for (Py_ssize_t i = 0; i < num_items; i++)
        attend_work_item(a, &items[i], &scratch[omp_get_thread_num()]);
    free_scratch(scratch, num_threads);
    free(items);
    return 0;
}

/* ----------------------------------------------------------------------------------------
 * Fused step of one attention layer: rotary embedding, KV write and paged attention, reading
 * q, k and v straight from the fused qkv projection [T, (nh + 2 nkv) * hd].
 */

typedef struct {
    const float *qkv;          /* [T, (nh + 2 nkv) * hd] */
    const int64_t *positions;  /* [T] */
    const float *rope;         /* [rope_rows, hd]: cos(pos * inv_freq) | sin(pos * inv_freq), hd/2 each */
    const int64_t *slot_mapping;  /* [T], -1 = skip the write */
    Py_ssize_t num_tokens;
    Py_ssize_t rope_rows;
} RopeKVArgs;

/* out[d] = x[d] cos[d] - x[d + h] sin[d], out[d + h] = x[d + h] cos[d] + x[d] sin[d]: the
 * rotate-half form of Hugging Face Llama, evaluated in the same order (no contraction in c11). */
static void rotate_head(float *out, const float *x, const float *cs, int hd) {
    int half = hd / 2;
    const float *c = cs, *sn = cs + half;
    for (int d = 0; d < half; d++) {
        float x0 = x[d], x1 = x[d + half];
        out[d] = x0 * c[d] + (-x1) * sn[d];
        out[d + half] = x1 * c[d] + x0 * sn[d];
    }
}

/* Rotates q into query [T, nh, hd], rotates k and writes it and v into their cache slots. */
static int rope_kv_write_compute(const RopeKVArgs *r, const AttentionArgs *a, float *query, int num_threads) {
    int nh = a->num_heads, nkv = a->num_kv_heads, hd = a->head_dim, dtype = a->cache_dtype;
    size_t row = (size_t)(nh + 2 * nkv) * hd, kv_row = (size_t)nkv * hd;
    size_t row_bytes = kv_row * cache_elem_size[dtype];
    float *k_rot = malloc(sizeof(float) * kv_row * (size_t)num_threads);
    if (!k_rot)
        return -1;
    int parallel = r->num_tokens * (Py_ssize_t)row >= (1 << 15);
    uint8_t *k_cache = (uint8_t *)a->k_cache, *v_cache = (uint8_t *)a->v_cache;
    #pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (Py_ssize_t t = 0; t < r->num_tokens; t++) {
        const float *x = r->qkv + (size_t)t * row;
        const float *cs = r->rope + (size_t)r->positions[t] * hd;
        float *k = k_rot + kv_row * (size_t)omp_get_thread_num();
        for (int h = 0; h < nh; h++)
            rotate_head(query + ((size_t)t * nh + h) * hd, x + (size_t)h * hd, cs, hd);
        int64_t slot = r->slot_mapping[t];
        if (slot < 0)
            continue;
        for (int h = 0; h < nkv; h++)
            rotate_head(k + (size_t)h * hd, x + (size_t)(nh + h) * hd, cs, hd);
        encode_row(k_cache + slot * row_bytes, k, (int)kv_row, dtype, a->kv_scale);
        encode_row(v_cache + slot * row_bytes, x + (size_t)(nh + nkv) * hd, (int)kv_row, dtype, a->kv_scale);
    }
    free(k_rot);
    return 0;
}

static int qkv_attention_compute(const RopeKVArgs *r, AttentionArgs *a, int num_threads) {
    float *query = malloc(sizeof(float) * (size_t)r->num_tokens * a->num_heads * a->head_dim + 1);
    if (!query)
        return -1;
    a->query = query;
    int status = rope_kv_write_compute(r, a, query, num_threads);
    if (status == 0)
        status = paged_attention_compute(a, num_threads);
    free(query);
    return status;
}

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
        for (int b = 0; b < used_blocks; b++)
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
        kv_write_compute(&a, resolve_threads(num_threads));
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
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*y*y*iiiififi:paged_attention", &b[0], &b[1], &b[2], &b[3],
                          &b[4], &b[5], &b[6], &a.num_heads, &a.num_kv_heads, &a.head_dim, &a.block_size,
                          &a.scale, &a.cache_dtype, &a.kv_scale, &num_threads))
        return NULL;
    int status = setup_paged_attention(&a, b);
    if (status == 0) {
        Py_BEGIN_ALLOW_THREADS
        status = paged_attention_compute(&a, resolve_threads(num_threads));
        Py_END_ALLOW_THREADS
        if (status < 0)
            PyErr_NoMemory();
    }
    release_buffers(b, 7);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* b = {out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions, rope,
 * slot_mapping}; fills r and a (whose sizes are set) and checks every index before any data moves. */
static int setup_qkv_attention(RopeKVArgs *r, AttentionArgs *a, Py_buffer *b) {
    const char *fn = "qkv_attention";
    if (a->num_heads <= 0 || a->num_kv_heads <= 0 || a->head_dim <= 0 || a->head_dim % 2)
        return fail("%s: num_heads, num_kv_heads and an even head_dim must be positive, got %d, %d, %d",
                    fn, a->num_heads, a->num_kv_heads, a->head_dim);
    Py_ssize_t row_bytes = (Py_ssize_t)(a->num_heads + 2 * a->num_kv_heads) * a->head_dim * 4;
    Py_ssize_t num_tokens = b[1].len / row_bytes, rope_row = (Py_ssize_t)a->head_dim * 4;
    Py_ssize_t rope_rows = b[8].len / rope_row;
    if (check_buffer_len(fn, "qkv", &b[1], num_tokens * row_bytes) < 0
        || check_buffer_len(fn, "positions", &b[7], num_tokens * 8) < 0
        || check_buffer_len(fn, "slot_mapping", &b[9], num_tokens * 8) < 0
        || check_buffer_len(fn, "rope", &b[8], rope_rows * rope_row) < 0
        || setup_attention(fn, a, b, num_tokens) < 0)
        return -1;
    *r = (RopeKVArgs){b[1].buf, b[7].buf, b[8].buf, b[9].buf, num_tokens, rope_rows};
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
    return qkv_attention_compute(&c->r, &a, c->threads);
}

static PyObject *py_qkv_attention(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b[10];
    QKVCall c = {0};
    AttentionArgs *a = &c.a;
    int num_threads;
    if (!PyArg_ParseTuple(args, "w*y*w*w*y*y*y*y*y*y*iiiififi:qkv_attention", &b[0], &b[1], &b[2], &b[3],
                          &b[4], &b[5], &b[6], &b[7], &b[8], &b[9], &a->num_heads, &a->num_kv_heads,
                          &a->head_dim, &a->block_size, &a->scale, &a->cache_dtype, &a->kv_scale, &num_threads))
        return NULL;
    int status = setup_qkv_attention(&c.r, a, b);
    if (status == 0) {
        c.num_blocks = b[2].len / ((Py_ssize_t)a->block_size * a->num_kv_heads * a->head_dim
                                   * cache_elem_size[a->cache_dtype]);
        c.threads = resolve_threads(num_threads);
        tape_record(check_qkv_call, run_qkv_call, &c, sizeof c);
        Py_BEGIN_ALLOW_THREADS
        status = run_qkv_call(&c);
        Py_END_ALLOW_THREADS
        if (status < 0)
            PyErr_NoMemory();
    }
    release_buffers(b, 10);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------------------------------
 * Module
 */

static PyMethodDef methods[] = {
    {"kv_write", py_kv_write, METH_VARARGS,
     "kv_write(key, value, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim, cache_dtype, "
     "kv_scale, num_threads): scatter key/value rows [T, nkv, hd] f32 into cache slots; slot -1 skips."},
    {"paged_attention", py_paged_attention, METH_VARARGS,
     "paged_attention(out, query, k_cache, v_cache, block_tables, context_lens, query_start_loc, "
     "num_heads, num_kv_heads, head_dim, block_size, scale, cache_dtype, kv_scale, num_threads): "
     "causal attention of packed queries [T, nh, hd] f32 over the paged KV cache."},
    {"qkv_attention", py_qkv_attention, METH_VARARGS,
     "qkv_attention(out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions, "
     "rope, slot_mapping, num_heads, num_kv_heads, head_dim, block_size, scale, cache_dtype, kv_scale, "
     "num_threads): one attention layer's step from the fused projection qkv [T, (nh + 2 nkv) * hd] f32: "
     "rotary embedding (rope [rows, hd] = cos | sin by position), KV write, paged attention into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_attention", "Paged attention and KV-cache write kernels (AVX2, OpenMP).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__attention(void) {
    build_f8e4m3_table();
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
