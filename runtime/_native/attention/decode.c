/* Paged attention's path for items of one query (decode steps) and for all the query heads of a kv head at
 * once (prefill tiles whose head size is a multiple of 8), in AVX2 and AVX-512 forms. */
#include "paged.h"

/* ----------------------------------------------------------------------------------------
 * Paged attention: an item with one query (every item of a decode step), all the query heads
 * of its kv head at once, or of every kv head of the sequence
 *
 * With enough decoding sequences to share out (WHOLE_SEQ_ITEMS_PER_THREAD a thread), a sequence is
 * one item: its kv heads' rows lie side by side in each slot, so a chunk's keys are whole runs of
 * cache lines instead of a third of each slot (5-25% faster than an item a kv head on a Zen 5).
 * The rows of the chunk after the one being worked on (or of the thread's next item's first chunk)
 * are asked for a few at a time between the current chunk's keys and values (Ahead), one head at a
 * time; the slots' offsets are computed once a chunk, with no division a key. The same requests in
 * one burst a head ran 2x slower: most were lost. bench_attention on a Zen 5, f16, µs a layer, the
 * previous code against this, interleaved: 32 sequences x 192 / 512 tokens 211-216 / 506-508 ->
 * 154-156 / 382-385; 8 x 192 / 512 53-55 / 126-132 -> 41-43 / 94-95; one sequence at 512 26 -> 21.
 * The AVX2 kernels (the same machine, AVX-512 turned off): 32 x 192 / 512 220-239 / 556-567 ->
 * 169-176 / 418-455, 8 x 512 139-141 -> 109-112.
 *
 * Each key and value row is read once from the cache and converted in registers, where the
 * general path decodes a chunk into scratch and reads it back once per query head. Each head's
 * arithmetic is the general path's operation for operation (the same key chunks, dot-product and
 * reduction order, softmax updates and accumulation order), so a query's output is the same bit
 * for bit whichever path computes it: decoded alone, in a batch, or as the last query of a
 * prefill chunk.
 */

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROW_GROUP 3  /* query heads per pass over a chunk (their accumulators stay in registers) */
#define ROW_PAIR 6   /* with AVX-512, a prefill tile's two queries' heads (ratio <= 3) in one pass (ROW_GROUP x 2) */

/* 8 cache elements of type dtype at src as float32, the values decode_rows gives. */
ALWAYS_INLINE __m256 load8(const uint8_t *src, const int dtype, __m256 kv_scale) {
    switch (dtype) {
    case CACHE_F32:
        return _mm256_loadu_ps((const float *)src);
    case CACHE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
    case CACHE_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
    case CACHE_I8:
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src))),
                             kv_scale);
    default:
        return _mm256_mul_ps(_mm256_i32gather_ps(f8e4m3_table, _mm256_cvtepu8_epi32(
                                 _mm_loadl_epi64((const __m128i *)src)), 4), kv_scale);
    }
}

/* scores[r][i .. i+nk) = scale * q[r] . keys i .. i+nk-1 of the chunk (nk = 2 or 4), for the nr heads:
 * lane-wise FMAs over d, then per key the reduction order of hsum8 (score_eight_keys). nr x nk
 * accumulators: at most 8, so that none spills out of the 16 registers. */
ALWAYS_INLINE void score_keys_of_heads(const int nr, const int nk, const int dtype, const float *const *q,
                                       const uint8_t *const *k_src, int i, int hd, size_t elem, __m256 kv_scale,
                                       float scale, float *const *scores) {
    __m256 acc[ROW_PAIR][4];  /* nr <= ROW_GROUP here: sized for attend_row_pair's copies, which take the AVX-512 path */
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < nk; j++)
            acc[r][j] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        __m256 k[4];
        for (int j = 0; j < nk; j++)
            k[j] = load8(k_src[i + j] + (size_t)d * elem, dtype, kv_scale);
        for (int r = 0; r < nr; r++) {
            __m256 qv = _mm256_loadu_ps(q[r] + d);
            for (int j = 0; j < nk; j++)
                acc[r][j] = _mm256_fmadd_ps(qv, k[j], acc[r][j]);
        }
    }
    for (int r = 0; r < nr; r++) {
        /* lanes of key j: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), as hsum8 adds them */
        __m256 h = nk == 4 ? _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]))
                           : _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_setzero_ps());
        __m128 sum = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), _mm_set1_ps(scale));
        if (nk == 4) {
            _mm_storeu_ps(scores[r] + i, sum);
        } else {
            _mm_storel_pi((__m64 *)(scores[r] + i), sum);
        }
    }
}

/* acc[r][d0 .. d0 + 8 nv) += sum_i p[r][i] * value_i[d0 ...], in key order (as accumulate_values);
 * nv <= 2, so that the accumulators, values and weight fit the 16 registers. */
ALWAYS_INLINE void accumulate_slice(const int nr, const int nv, const int dtype, const uint8_t *const *v_src, int n,
                                    int d0, size_t elem, __m256 kv_scale, float *const *p, float *const *acc) {
    __m256 c[ROW_PAIR][2];  /* as score_keys_of_heads' */
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++)
            c[r][v] = _mm256_loadu_ps(acc[r] + d0 + 8 * v);
    for (int i = 0; i < n; i++) {
        __m256 val[2];
        for (int v = 0; v < nv; v++)
            val[v] = load8(v_src[i] + (size_t)(d0 + 8 * v) * elem, dtype, kv_scale);
        for (int r = 0; r < nr; r++) {
            __m256 w = _mm256_set1_ps(p[r][i]);
            for (int v = 0; v < nv; v++)
                c[r][v] = _mm256_fmadd_ps(w, val[v], c[r][v]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++)
            _mm256_storeu_ps(acc[r] + d0 + 8 * v, c[r][v]);
}

/* The AVX-512 form of accumulate_slice over whole heads, for CPUs that have it (have_avx512, set
 * at module init): 16 dimensions a register and up to 64 of them per pass, so each key's values feed 3 x 4
 * independent accumulators where the AVX2 form, in 16 registers, has 3 x 2 on 16 dimensions and
 * waits on FMA latency. Every lane still takes its dimension's products in key order, one FMA each:
 * the same numbers bit for bit. */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

static int have_avx512 = 0;

/* exp_shifted's values and sum, bit for bit: sixteen exponentials at a time, their sum still taken eight lanes
 * at a time in exp_shifted's order. */
AVX512_TARGET static float exp_shifted_512(float *p, int n, float max_score) {
    const __m512 shift = _mm512_set1_ps(max_score);
    __m256 total = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + i), shift));
        _mm512_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    if (i + 8 <= n) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm512_castps512_ps256(shift)));
        _mm256_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, e);
        i += 8;
    }
    float sum = hsum256(total);
    for (; i < n; i++) {
        p[i] = expf(p[i] - max_score);
        sum += p[i];
    }
    return sum;
}

void detect_avx512(void) {
    __builtin_cpu_init();
    have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl");
}

int use_avx512(int on) {
    detect_avx512();
    have_avx512 = have_avx512 && on;
    return have_avx512;
}

/* 16 cache elements of type dtype at src as float32: load8's values, twice as wide. */
AVX512_TARGET ALWAYS_INLINE __m512 load16(const uint8_t *src, const int dtype, __m512 kv_scale) {
    switch (dtype) {
    case CACHE_F32:
        return _mm512_loadu_ps((const float *)src);
    case CACHE_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
    case CACHE_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
    case CACHE_I8:
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src))), kv_scale);
    default:
        return _mm512_mul_ps(_mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src)),
                                                 f8e4m3_table, 4), kv_scale);
    }
}

/* acc[r][d0 .. d0 + 16 g) += sum_i p[r][i] * value_i[d0 ...], in key order. */
/* Rows to ask the memory for while a chunk is worked on (the next chunk's keys or values of the same head),
 * a few at a time between the chunk's own keys: asked for in one burst, most of them were lost (the core's
 * queue of misses fills, 1.7-2x slower steps on a Zen 5 than spread out). */
typedef struct {
    const uint8_t *rows[KEY_CHUNK];
    int n;      /* rows to ask for */
    int lines;  /* 64-byte lines a row */
} Ahead;

static inline void ask_rows(const Ahead *ahead, int from, int to) {
    if (!ahead)
        return;
    to = to < ahead->n ? to : ahead->n;
    for (int i = from; i < to; i++)
        for (int line = 0; line < ahead->lines; line++)
            _mm_prefetch((const char *)ahead->rows[i] + 64 * line, _MM_HINT_T0);
}

AVX512_TARGET ALWAYS_INLINE void accumulate_heads_512(const int nr, const int g, const int dtype,
                                                     const uint8_t *const *v_src, int n, int d0, size_t elem,
                                                     float kv_scale, float *const *p, float *const *acc,
                                                     const Ahead *ahead) {
    const __m512 scale = _mm512_set1_ps(kv_scale);
    __m512 c[ROW_PAIR][4];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < g; v++)
            c[r][v] = _mm512_loadu_ps(acc[r] + d0 + 16 * v);
    for (int i = 0; i < n; i++) {
        __m512 val[4];
        ask_rows(ahead, i, i + 1);
        for (int v = 0; v < g; v++)
            val[v] = load16(v_src[i] + (size_t)(d0 + 16 * v) * elem, dtype, scale);
        for (int r = 0; r < nr; r++) {
            const __m512 w = _mm512_set1_ps(p[r][i]);
            for (int v = 0; v < g; v++)
                c[r][v] = _mm512_fmadd_ps(w, val[v], c[r][v]);
        }
    }
    ask_rows(ahead, n, KEY_CHUNK);
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < g; v++)
            _mm512_storeu_ps(acc[r] + d0 + 16 * v, c[r][v]);
}

#define HEADS_512(nr, g)                                                                                   \
    case g: accumulate_heads_512(nr, g, dtype, v_src, n, d0, elem, kv_scale, p, acc, d0 ? NULL : ahead); break;

AVX512_TARGET static void accumulate_values_512_as(const int dtype, int nr, const uint8_t *const *v_src, int n,
                                                   int hd, size_t elem, float kv_scale, float *const *p,
                                                   float *const *acc, const Ahead *ahead) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        const int g = hd - d0 < 64 ? (hd - d0) / 16 : 4;
        if (nr == 6) {
            switch (g) { HEADS_512(6, 1) HEADS_512(6, 2) HEADS_512(6, 3) default: HEADS_512(6, 4) }
        } else if (nr == 4) {
            switch (g) { HEADS_512(4, 1) HEADS_512(4, 2) HEADS_512(4, 3) default: HEADS_512(4, 4) }
        } else if (nr == 3) {
            switch (g) { HEADS_512(3, 1) HEADS_512(3, 2) HEADS_512(3, 3) default: HEADS_512(3, 4) }
        } else if (nr == 2) {
            switch (g) { HEADS_512(2, 1) HEADS_512(2, 2) HEADS_512(2, 3) default: HEADS_512(2, 4) }
        } else {
            switch (g) { HEADS_512(1, 1) HEADS_512(1, 2) HEADS_512(1, 3) default: HEADS_512(1, 4) }
        }
    }
}

/* For head_dim a multiple of 16 (the caller checks). */
static void accumulate_values_512(const int dtype, int nr, const uint8_t *const *v_src, int n, int hd, size_t elem,
                                  float kv_scale, float *const *p, float *const *acc, const Ahead *ahead) {
    switch (dtype) {
    case CACHE_F32: accumulate_values_512_as(CACHE_F32, nr, v_src, n, hd, elem, kv_scale, p, acc, ahead); break;
    case CACHE_F16: accumulate_values_512_as(CACHE_F16, nr, v_src, n, hd, elem, kv_scale, p, acc, ahead); break;
    case CACHE_BF16: accumulate_values_512_as(CACHE_BF16, nr, v_src, n, hd, elem, kv_scale, p, acc, ahead); break;
    case CACHE_I8: accumulate_values_512_as(CACHE_I8, nr, v_src, n, hd, elem, kv_scale, p, acc, ahead); break;
    default: accumulate_values_512_as(CACHE_F8E4M3, nr, v_src, n, hd, elem, kv_scale, p, acc, ahead); break;
    }
}

/* 8 cache elements of each of two rows as float32 in one register, a's in lanes 0-7 and b's in 8-15:
 * load8's values. */
AVX512_TARGET ALWAYS_INLINE __m512 load8x2(const uint8_t *a, const uint8_t *b, const int dtype, __m256 kv_scale) {
    if (dtype == CACHE_F16)
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                       _mm_loadu_si128((const __m128i *)b), 1));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(load8(a, dtype, kv_scale))),
                                               _mm256_castps_pd(load8(b, dtype, kv_scale)), 1));
}

/* scores[r][i .. i+8) = scale * q[r] . keys i .. i+7 of the chunk, for nr heads: score_keys_of_heads'
 * numbers with half its instructions. Two keys share a register, each in its own 8 lanes, so every lane
 * takes the same products in the same order as there; then each key's lanes are added in hsum8's tree
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). q2[r]: head r's query with every 8 dimensions
 * written twice. */
AVX512_TARGET ALWAYS_INLINE void score_eight_keys_512(const int nr, const int dtype, const float *const *q2,
                                                     const uint8_t *const *k_src, int i, int hd, size_t elem,
                                                     __m256 kv_scale, float scale, float *const *scores) {
    __m512 acc[ROW_PAIR][4];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        __m512 k[4];
        for (int j = 0; j < 4; j++)
            k[j] = load8x2(k_src[i + 2 * j] + (size_t)d * elem, k_src[i + 2 * j + 1] + (size_t)d * elem, dtype, kv_scale);
        for (int r = 0; r < nr; r++) {
            const __m512 qv = _mm512_load_ps(q2[r] + 2 * d);
            for (int j = 0; j < 4; j++)
                acc[r][j] = _mm512_fmadd_ps(qv, k[j], acc[r][j]);
        }
    }
    const __m512i pick = _mm512_setr_epi32(0, 8, 16, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i join = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < nr; r++) {
        __m512 t[4];
        for (int j = 0; j < 4; j++) {
            __m512 a = acc[r][j];
            a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));         /* l0 + l1, l2 + l3, ... */
            a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4E));         /* (l0 + l1) + (l2 + l3), (l4 + l5) + (l6 + l7) */
            t[j] = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xB1)); /* their sum: lane 0 one key's, lane 8 the other's */
        }
        const __m512 all = _mm512_permutex2var_ps(_mm512_permutex2var_ps(t[0], pick, t[1]), join,
                                                  _mm512_permutex2var_ps(t[2], pick, t[3]));
        _mm256_storeu_ps(scores[r] + i, _mm256_mul_ps(_mm512_castps512_ps256(all), _mm256_set1_ps(scale)));
    }
}

#define SCORES_512(nr, hdc)                                                                      \
    for (int i = 0; i < n8; i += 8) {                                                            \
        score_eight_keys_512(nr, dtype, q2, k_src, i, hdc, elem, kv_scale, scale, scores);       \
        ask_rows(ahead, i, i + 8);                                                               \
    }

/* Head dim 64 (SmolLM2's, Llama 3.2 1B's) a compile-time constant: its 8 steps unrolled, each key row read at
 * fixed offsets from one pointer. */
AVX512_TARGET static void score_keys_512_as(const int dtype, int nr, const float *const *q2, const uint8_t *const *k_src,
                                            int n8, int hd, size_t elem, __m256 kv_scale, float scale,
                                            float *const *scores, const Ahead *ahead) {
#define SCORES_512_HEADS(hdc)  \
    if (nr == 6) {             \
        SCORES_512(6, hdc);    \
    } else if (nr == 4) {      \
        SCORES_512(4, hdc);    \
    } else if (nr == 3) {      \
        SCORES_512(3, hdc);    \
    } else if (nr == 2) {      \
        SCORES_512(2, hdc);    \
    } else {                   \
        SCORES_512(1, hdc);    \
    }
    elem = (size_t)cache_elem_size[dtype];  /* a constant: dtype is one in each copy */
    if (hd == 64) {
        SCORES_512_HEADS(64)
    } else {
        SCORES_512_HEADS(hd)
    }
#undef SCORES_512_HEADS
    ask_rows(ahead, n8, KEY_CHUNK);
}

/* The first n8 (a multiple of 8) keys' scores for nr heads, on CPUs with AVX-512. */
static void score_keys_512(const int dtype, int nr, const float *const *q2, const uint8_t *const *k_src, int n8,
                           int hd, size_t elem, __m256 kv_scale, float scale, float *const *scores,
                           const Ahead *ahead) {
    switch (dtype) {
    case CACHE_F32: score_keys_512_as(CACHE_F32, nr, q2, k_src, n8, hd, elem, kv_scale, scale, scores, ahead); break;
    case CACHE_F16: score_keys_512_as(CACHE_F16, nr, q2, k_src, n8, hd, elem, kv_scale, scale, scores, ahead); break;
    case CACHE_BF16: score_keys_512_as(CACHE_BF16, nr, q2, k_src, n8, hd, elem, kv_scale, scale, scores, ahead); break;
    case CACHE_I8: score_keys_512_as(CACHE_I8, nr, q2, k_src, n8, hd, elem, kv_scale, scale, scores, ahead); break;
    default: score_keys_512_as(CACHE_F8E4M3, nr, q2, k_src, n8, hd, elem, kv_scale, scale, scores, ahead); break;
    }
}

/* The largest of n scores (NaN ignored, -inf for none): a maximum is exact in any order. */
static inline float max_of(const float *p, int n) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        best = _mm256_max_ps(_mm256_loadu_ps(p + i), best);  /* the second operand where either is NaN */
    best = _mm256_max_ps(best, _mm256_permute2f128_ps(best, best, 1));
    best = _mm256_max_ps(best, _mm256_permute_ps(best, 0x4E));
    best = _mm256_max_ps(best, _mm256_permute_ps(best, 0xB1));
    float m = _mm256_cvtss_f32(best);
    for (; i < n; i++)
        m = p[i] > m ? p[i] : m;
    return m;
}

/* The streaming-softmax update of nr heads with the n keys and values at scratch->k_src / v_src. */
ALWAYS_INLINE void attend_chunk_heads(const int nr, const int dtype, const AttentionArgs *a, const float *const *q,
                                      const float *const *q2, int n, Scratch *scratch, float *const *scores,
                                      float *const *acc, float *row_max, float *row_sum, const Ahead *keys_ahead,
                                      const Ahead *values_ahead) {
    const int hd = a->head_dim, n8 = n / 8 * 8;
    const size_t elem = (size_t)cache_elem_size[dtype];
    const __m256 kv_scale = _mm256_set1_ps(a->kv_scale);
    const int nk = nr == 3 ? 2 : 4;
    const int values_with_keys = !(hd % 16 == 0 && have_avx512);  /* only accumulate_values_512 asks for values */
    if (have_avx512) {
        score_keys_512(dtype, nr, q2, scratch->k_src, n8, hd, elem, kv_scale, a->scale, scores, keys_ahead);
    } else {
        for (int i = 0; i < n8; i += nk) {
            score_keys_of_heads(nr, nk, dtype, q, scratch->k_src, i, hd, elem, kv_scale, a->scale, scores);
            ask_rows(keys_ahead, i, i + nk);
            ask_rows(values_ahead, i, i + nk);
        }
        ask_rows(keys_ahead, n8, KEY_CHUNK);
    }
    if (values_with_keys)
        ask_rows(values_ahead, have_avx512 ? 0 : n8, KEY_CHUNK);

    for (int i = n8; i < n; i++) {  /* the chunk's last n % 8 keys, as score_keys scores them */
        const float *k = (const float *)scratch->k_src[i];  /* f32 rows as they are (a multi-query item's decoded chunk) */
        if (dtype != CACHE_F32) {
            decode_rows(scratch->k_decoded, scratch->k_src[i], 1, 0, hd, dtype, a->kv_scale);
            k = scratch->k_decoded;
        }
        for (int r = 0; r < nr; r++)
            scores[r][i] = dot(q[r], k, hd) * a->scale;
    }
    for (int r = 0; r < nr; r++) {
        float chunk_max = max_of(scores[r], n);
        if (chunk_max > row_max[r]) {
            float correction = expf(row_max[r] - chunk_max);
            scale_row(acc[r], correction, hd);
            row_sum[r] *= correction;
            row_max[r] = chunk_max;
        }
        row_sum[r] += have_avx512 ? exp_shifted_512(scores[r], n, row_max[r]) : exp_shifted(scores[r], n, row_max[r]);
    }
    if (hd % 16 == 0 && have_avx512) {
        accumulate_values_512(dtype, nr, scratch->v_src, n, hd, elem, a->kv_scale, scores, acc, values_ahead);
        return;
    }
    int d0 = 0;
    for (; d0 + 16 <= hd; d0 += 16)
        accumulate_slice(nr, 2, dtype, scratch->v_src, n, d0, elem, kv_scale, scores, acc);
    for (; d0 < hd; d0 += 8)
        accumulate_slice(nr, 1, dtype, scratch->v_src, n, d0, elem, kv_scale, scores, acc);
}

/* Keys skip .. end of the chunk at key_begin (chunk keys) that the query at position pos sees: its causal limit and
 * its window's start. */
static inline void visible_keys(const AttentionArgs *a, int pos, int key_begin, int chunk, int *skip, int *end) {
    const int visible = pos + 1 - key_begin, first = first_visible_key(a, pos) - key_begin;
    *skip = first > 0 ? first : 0;
    *end = visible < chunk ? visible : chunk;
}

/* at[i]: the byte offset in the cache of key pos + i's slot (n keys), at kv head kv_head; SIZE_MAX for a slot
 * of a block given back behind a sliding window. One division for the chunk, not one a key. */
static void slot_offsets(const AttentionArgs *a, const int32_t *table, int kv_head, int pos, int n, size_t *at) {
    const size_t elem = (size_t)cache_elem_size[a->cache_dtype];
    const size_t slot_bytes = (size_t)a->num_kv_heads * a->head_dim * elem, head = (size_t)kv_head * a->head_dim * elem;
    int block = pos / a->block_size, offset = pos % a->block_size;
    for (int i = 0; i < n; i++) {
        at[i] = table[block] < 0 ? SIZE_MAX : ((size_t)table[block] * a->block_size + offset) * slot_bytes + head;
        if (++offset == a->block_size) {
            offset = 0;
            block++;
        }
    }
}

/* Asks for the rows of one head (head_bytes past at[i]) of n slots, keys or values */
static inline void prefetch_slots(const uint8_t *cache, const size_t *at, int n, size_t head_bytes, size_t row_bytes) {
    for (int i = 0; i < n; i++)
        if (at[i] != SIZE_MAX)
            for (size_t line = 0; line < row_bytes; line += 64)
                _mm_prefetch((const char *)cache + at[i] + head_bytes + line, _MM_HINT_T0);
}

/* Row r's query q as score_keys_512 reads it: every 8 dimensions written twice */
static void duplicate_query(Scratch *scratch, int r, const float *q, int hd) {
    for (int d = 0; d < hd; d += 8) {
        memcpy(scratch->q2 + (size_t)r * 2 * hd + 2 * d, q + d, 8 * sizeof(float));
        memcpy(scratch->q2 + (size_t)r * 2 * hd + 2 * d + 8, q + d, 8 * sizeof(float));
    }
}

/* Where rows r0 .. r0 + nr of the scratch read and write: their query heads at q0, hd apart (the first `per` of
 * them; the rest `next` floats further on, a second query's), and their duplicated queries, scores and sums. */
typedef struct {
    const float *q[ROW_PAIR], *q2[ROW_PAIR];
    float *scores[ROW_PAIR], *acc[ROW_PAIR];
} Rows;

ALWAYS_INLINE void point_rows(Rows *rows, Scratch *scratch, const float *q0, size_t next, int per, int r0, int nr,
                              int hd) {
    for (int r = 0; r < nr; r++) {
        rows->q[r] = q0 + (r < per ? 0 : next) + (size_t)(r % per) * hd;
        rows->q2[r] = scratch->q2 + (size_t)(r0 + r) * 2 * hd;
        rows->scores[r] = scratch->scores + (size_t)(r0 + r) * KEY_CHUNK;
        rows->acc[r] = scratch->acc + (size_t)(r0 + r) * hd;
    }
}

/* attend_chunk_heads for the item's rows r0 .. r0 + nr (nr <= ROW_GROUP): query heads at q0, hd apart, on the
 * n keys and values at scratch->k_src / v_src */
ALWAYS_INLINE void attend_row_group(const int dtype, const AttentionArgs *a, const float *q0, int r0, int nr, int n,
                                    Scratch *scratch, const Ahead *keys_ahead, const Ahead *values_ahead) {
    Rows w;
    point_rows(&w, scratch, q0, 0, nr, r0, nr, a->head_dim);
    float *row_max = scratch->row_max + r0, *row_sum = scratch->row_sum + r0;
    if (nr == 3)
        attend_chunk_heads(3, dtype, a, w.q, w.q2, n, scratch, w.scores, w.acc, row_max, row_sum, keys_ahead, values_ahead);
    else if (nr == 2)
        attend_chunk_heads(2, dtype, a, w.q, w.q2, n, scratch, w.scores, w.acc, row_max, row_sum, keys_ahead, values_ahead);
    else
        attend_chunk_heads(1, dtype, a, w.q, w.q2, n, scratch, w.scores, w.acc, row_max, row_sum, keys_ahead, values_ahead);
}

/* attend_chunk_heads for two queries of a prefill tile that see the same keys of the chunk, all the query heads
 * of their kv head (ratio <= ROW_GROUP), on CPUs with AVX-512: rows r0 .. r0 + 2 ratio (the first query's heads,
 * then the second's), the first query's heads at q0 and the second's `next` floats on. Each row's arithmetic is
 * attend_row_group's, operation for operation; the chunk's keys are read once for both queries. */
static void attend_row_pair(const AttentionArgs *a, const float *q0, size_t next, int r0, int ratio, int n,
                            Scratch *scratch) {
    Rows w;
    point_rows(&w, scratch, q0, next, ratio, r0, 2 * ratio, a->head_dim);
    float *row_max = scratch->row_max + r0, *row_sum = scratch->row_sum + r0;
    if (ratio == 3)
        attend_chunk_heads(6, CACHE_F32, a, w.q, w.q2, n, scratch, w.scores, w.acc, row_max, row_sum, NULL, NULL);
    else if (ratio == 2)
        attend_chunk_heads(4, CACHE_F32, a, w.q, w.q2, n, scratch, w.scores, w.acc, row_max, row_sum, NULL, NULL);
    else
        attend_chunk_heads(2, CACHE_F32, a, w.q, w.q2, n, scratch, w.scores, w.acc, row_max, row_sum, NULL, NULL);
}

/* out = row r's weighted sum of values over its sum of weights */
static void finish_row(float *out, const Scratch *scratch, int r, int hd) {
    const float inv_sum = 1.0f / scratch->row_sum[r];
    for (int d = 0; d < hd; d++)
        out[d] = scratch->acc[(size_t)r * hd + d] * inv_sum;
}

/* Whether a single-query item asks for the next item's first chunk spread over its own last chunk (Ahead):
 * when that item is read the same way */
int spreads_ahead(const WorkItem *w, const WorkItem *ahead) {
    return ahead && ahead->q_end - ahead->q_begin == 1 && ahead->kv_heads == w->kv_heads;
}

/* Where an item's first chunk starts (first_key: the first key its query sees) and how many keys it has */
static int first_chunk(const AttentionArgs *a, const WorkItem *w, int *first_key) {
    const int num_keys = a->context_lens[w->seq] - seq_query_len(a, w->seq) + w->q_end;
    *first_key = first_visible_key(a, num_keys - 1);
    const int keys_from = *first_key / KEY_CHUNK * KEY_CHUNK;
    return (num_keys - keys_from < KEY_CHUNK ? num_keys - keys_from : KEY_CHUNK) - (*first_key - keys_from);
}

ALWAYS_INLINE void attend_single_query_as(const int dtype, const AttentionArgs *a, const WorkItem *w,
                                          const WorkItem *ahead, int first_asked, Scratch *scratch) {
    const int hd = a->head_dim, ratio = a->num_heads / a->num_kv_heads;
    const int heads = w->kv_heads, rows = heads * ratio;  /* the item's query heads, its kv heads' in turn */
    const int token0 = a->query_start_loc[w->seq] + w->q_begin;
    const int num_keys = a->context_lens[w->seq] - seq_query_len(a, w->seq) + w->q_end;
    const int32_t *table = a->block_tables + (size_t)w->seq * a->max_blocks;
    const size_t row_bytes = (size_t)hd * cache_elem_size[dtype];
    const int lines = (int)((row_bytes + 63) / 64);
    const float *query = a->query + ((size_t)token0 * a->num_heads + (size_t)w->kv_head * ratio) * hd;
    const int spread_ahead = spreads_ahead(w, ahead);
    size_t at[KEY_CHUNK], next_at[KEY_CHUNK];  /* a chunk's slots in the cache, at the item's first head */
    int first_key, n = first_chunk(a, w, &first_key);
    start_rows(scratch, rows, hd);
    if (have_avx512)
        for (int r = 0; r < rows; r++)
            duplicate_query(scratch, r, query + (size_t)r * hd, hd);
    slot_offsets(a, table, w->kv_head, first_key, n, at);
    if (!first_asked)  /* else the item before asked for this chunk, spread over its last one */
        for (int h = 0; h < heads; h++) {
            prefetch_slots(a->k_cache, at, n, (size_t)h * row_bytes, row_bytes);
            prefetch_slots(a->v_cache, at, n, (size_t)h * row_bytes, row_bytes);
        }
    for (int key_begin = first_key / KEY_CHUNK * KEY_CHUNK; key_begin < num_keys; key_begin += KEY_CHUNK) {
        const int next = key_begin + KEY_CHUNK, last = next >= num_keys;
        int next_n = 0;  /* keys of the chunk after this one (this item's, or the next item's first) at next_at */
        if (!last) {
            next_n = num_keys - next < KEY_CHUNK ? num_keys - next : KEY_CHUNK;
            slot_offsets(a, table, w->kv_head, next, next_n, next_at);
        } else if (spread_ahead) {
            int ahead_first;
            next_n = first_chunk(a, ahead, &ahead_first);
            slot_offsets(a, a->block_tables + (size_t)ahead->seq * a->max_blocks, ahead->kv_head, ahead_first, next_n,
                         next_at);
        } else if (ahead) {
            prefetch_first_chunk(a, ahead, PREFETCH_KEYS);
        }
        for (int h = 0; h < heads; h++) {  /* each kv head's query heads, as an item of that head alone */
            const size_t head_bytes = (size_t)h * row_bytes;
            Ahead keys_ahead, values_ahead;  /* the next chunk's rows of this head */
            keys_ahead.n = values_ahead.n = next_n;
            keys_ahead.lines = values_ahead.lines = lines;
            for (int i = 0; i < next_n; i++) {
                keys_ahead.rows[i] = a->k_cache + next_at[i] + head_bytes;
                values_ahead.rows[i] = a->v_cache + next_at[i] + head_bytes;
            }
            for (int i = 0; i < n; i++) {
                scratch->k_src[i] = a->k_cache + at[i] + head_bytes;
                scratch->v_src[i] = a->v_cache + at[i] + head_bytes;
            }
            for (int r0 = h * ratio; r0 < (h + 1) * ratio; r0 += ROW_GROUP) {
                const int nr = (h + 1) * ratio - r0 < ROW_GROUP ? (h + 1) * ratio - r0 : ROW_GROUP;
                const int first = r0 == h * ratio;  /* the next chunk's rows are asked for once a head */
                attend_row_group(dtype, a, query + (size_t)r0 * hd, r0, nr, n, scratch, first ? &keys_ahead : NULL,
                                 first ? &values_ahead : NULL);
            }
        }
        if (last && ahead && !spread_ahead)
            prefetch_first_chunk(a, ahead, PREFETCH_VALUES);
        if (!last) {
            memcpy(at, next_at, sizeof(size_t) * (size_t)next_n);
            n = next_n;
        }
    }
    for (int r = 0; r < rows; r++)
        finish_row(a->out + ((size_t)token0 * a->num_heads + (size_t)w->kv_head * ratio + r) * hd, scratch, r, hd);
}

/* A multi-query item (a prefill tile) for head_dim a multiple of 8: each chunk decoded once into f32 rows
 * (load_key_chunk), then each query's heads at once through attend_chunk_heads on those rows, as a lone
 * query's are on the cache: the same scores, softmax and sums, so the same bits as attend_work_item (which
 * other head sizes take) and as the single-query path. Chunks of 64 queries (f16, Zen 5, µs a layer):
 * context 128 / 158 / 512 117-118 / 149-150 / 504-508 -> 96-97 / 118-120 / 380-381. With AVX-512 and at most
 * ROW_GROUP heads a kv head, two queries that see the same keys of a chunk (every chunk but their diagonal
 * one, without a window) go through it together (attend_row_pair), each key read once for both: a 2,041-token
 * prompt (SmolLM2's heads, f16, 2 threads, a 2-core Xeon) 36.5-38.0 -> 32.6-34.6 ms a layer, 16 of 128 tokens
 * 3.5-3.7 -> 3.2-3.5. */
void attend_work_item_heads(const AttentionArgs *a, const WorkItem *w, Scratch *scratch) {
    const int hd = a->head_dim, ratio = a->num_heads / a->num_kv_heads;
    const int rows = (w->q_end - w->q_begin) * ratio;
    const int token0 = a->query_start_loc[w->seq];
    const int first_pos = a->context_lens[w->seq] - seq_query_len(a, w->seq);  /* position of query 0 */
    const int num_keys = first_pos + w->q_end;  /* keys seen by the tile's last query */
    const int keys_from = first_visible_key(a, first_pos + w->q_begin) / KEY_CHUNK * KEY_CHUNK;
    const int32_t *table = a->block_tables + (size_t)w->seq * a->max_blocks;
    /* query j's heads of this kv head: rows (j - q_begin) * ratio .. + ratio, side by side in a->query */
    const float *query = a->query + ((size_t)(token0 + w->q_begin) * a->num_heads + (size_t)w->kv_head * ratio) * hd;
    const int pairs = have_avx512 && hd % 16 == 0 && ratio <= ROW_GROUP;  /* two queries a pass where they see the same keys */
    start_rows(scratch, rows, hd);
    if (have_avx512)
        for (int r = 0; r < rows; r++)
            duplicate_query(scratch, r, query + (size_t)(r / ratio) * a->num_heads * hd + (size_t)(r % ratio) * hd, hd);
    prefetch_key_chunk(a, table, w->kv_head, keys_from,
                       num_keys - keys_from < KEY_CHUNK ? num_keys - keys_from : KEY_CHUNK);
    for (int key_begin = keys_from; key_begin < num_keys; key_begin += KEY_CHUNK) {
        const int chunk = num_keys - key_begin < KEY_CHUNK ? num_keys - key_begin : KEY_CHUNK;
        const int next = key_begin + KEY_CHUNK;
        if (next < num_keys)
            prefetch_key_chunk(a, table, w->kv_head, next, num_keys - next < KEY_CHUNK ? num_keys - next : KEY_CHUNK);
        load_key_chunk(a, table, w->kv_head, key_begin, chunk, scratch);
        for (int jj = 0; jj < w->q_end - w->q_begin; jj++) {
            int skip, end, skip2, end2;
            visible_keys(a, first_pos + w->q_begin + jj, key_begin, chunk, &skip, &end);
            if (end <= skip)
                continue;
            for (int i = skip; i < end; i++) {
                scratch->k_src[i - skip] = (const uint8_t *)scratch->k_rows[i];
                scratch->v_src[i - skip] = (const uint8_t *)scratch->v_rows[i];
            }
            skip2 = 0, end2 = -1;
            if (pairs && jj + 1 < w->q_end - w->q_begin)
                visible_keys(a, first_pos + w->q_begin + jj + 1, key_begin, chunk, &skip2, &end2);
            if (skip2 == skip && end2 == end) {  /* the next query sees the same keys: both in one pass */
                attend_row_pair(a, query + (size_t)jj * a->num_heads * hd, (size_t)a->num_heads * hd, jj * ratio, ratio,
                                end - skip, scratch);
                jj++;
                continue;
            }
            for (int h0 = 0; h0 < ratio; h0 += ROW_GROUP)
                attend_row_group(CACHE_F32, a, query + (size_t)jj * a->num_heads * hd + (size_t)h0 * hd,
                                 jj * ratio + h0, ratio - h0 < ROW_GROUP ? ratio - h0 : ROW_GROUP, end - skip, scratch,
                                 NULL, NULL);
        }
    }
    for (int r = 0; r < rows; r++)
        finish_row(a->out + ((size_t)(token0 + w->q_begin + r / ratio) * a->num_heads + (size_t)w->kv_head * ratio
                             + r % ratio) * hd, scratch, r, hd);
}

void attend_single_query(const AttentionArgs *a, const WorkItem *w, const WorkItem *ahead, int first_asked,
                                Scratch *scratch) {
    switch (a->cache_dtype) {
    case CACHE_F32: attend_single_query_as(CACHE_F32, a, w, ahead, first_asked, scratch); break;
    case CACHE_BF16: attend_single_query_as(CACHE_BF16, a, w, ahead, first_asked, scratch); break;
    case CACHE_F16: attend_single_query_as(CACHE_F16, a, w, ahead, first_asked, scratch); break;
    case CACHE_I8: attend_single_query_as(CACHE_I8, a, w, ahead, first_asked, scratch); break;
    default: attend_single_query_as(CACHE_F8E4M3, a, w, ahead, first_asked, scratch); break;
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
