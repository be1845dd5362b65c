/* The AVX2 qlinear path (the module's baseline ISA): f32, int16 and int8 activations. A panel's 16
 * rows are two 8-lane vectors; codes decode to q (q4: 0..15, q5: 0..31) and w = q * s + m, or to
 * signed values (q6: q - 32, q8) and w = q * s. */
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"

#define MR2 6        /* tokens per AVX2 micro-kernel call: 12 of the 16 ymm registers accumulate */
#define DIRECT_T2 4  /* AVX2, f32 activations: T <= DIRECT_T2 decodes weights in registers */

typedef struct {
    __m256 lo, hi;  /* rows 0..7, 8..15 of a panel */
} Rows16;

typedef struct {
    __m256i first[2], last[2];  /* rows 0..7 [0] and 8..15 [1]: byte j of a row's lane is its code of k step j
                                   (first) or j + 4 (last) */
} CodeBytes;

INLINE Rows16 avx2_load16(const void *base, int64_t idx, int f16)
{
    if (f16) {
        const __m128i *h = (const __m128i *)((const uint16_t *)base + idx);
        return (Rows16){_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
    }
    const float *f = (const float *)base + idx;
    return (Rows16){_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}

/* Scale s and offset m (the value of code 0: q4 m = z - 8s, stored as is when f16; q5 the stored
 * min) of panel p, group g. */
INLINE void avx2_group_params(const int fmt, const Weight *w, int64_t p, int64_t g, Rows16 *s, Rows16 *m)
{
    const int64_t idx = (p * (w->k / w->group) + g) * PANEL;
    if (fmt == FMT_BF16) {
        s->lo = s->hi = _mm256_set1_ps(1.0f);
        return;
    }
    *s = avx2_load16(w->scales, idx, w->scales_f16);
    if (fmt == FMT_F8) {
        s->lo = _mm256_mul_ps(s->lo, _mm256_set1_ps(256.0f));
        s->hi = _mm256_mul_ps(s->hi, _mm256_set1_ps(256.0f));
    }
    if (has_zeros(fmt)) {
        *m = avx2_load16(w->zeros, idx, w->scales_f16);
        if (fmt == FMT_Q4 && !w->scales_f16) {
            m->lo = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s->lo, m->lo);
            m->hi = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s->hi, m->hi);
        }
    }
}

/* 8 rows' q4 codes of k step j from a 32-byte half of a chunk's 64 bytes (see decode_step). */
INLINE __m256 avx2_decode_q4(const uint8_t *half, const int j)
{
    const __m256i raw = _mm256_loadu_si256((const __m256i *)half);
    const int shift = (j & 3) * 8 + (j >> 2) * 4;
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, shift), _mm256_set1_epi32(15)));
}

/* 8 rows' q8 codes of k step j from a 32-byte half of a 64-byte word. */
INLINE __m256 avx2_decode_q8(const uint8_t *half, const int j)
{
    const __m256i raw = _mm256_loadu_si256((const __m256i *)half);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 24 - 8 * (j & 3)), 24));
}

/* 0xFF in each byte whose bit in `tests` (one a byte) `bits` has set, else 0. */
INLINE __m256i avx2_byte_flags(__m256i bits, int32_t tests)
{
    const __m256i t = _mm256_set1_epi32(tests);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bits, t), t);
}

/* q6 code bytes: `nibbles` with bits 4-5 from `pairs` (byte j of a lane: its pair at bits 2j, 2j+1), bit 5
 * flipped. */
INLINE __m256i avx2_q6_bytes(__m256i nibbles, __m256i pairs)
{
    const __m256i b4 = _mm256_and_si256(avx2_byte_flags(pairs, 0x40100401), _mm256_set1_epi8(0x10));
    const __m256i b5 = _mm256_andnot_si256(avx2_byte_flags(pairs, (int32_t)0x80200802), _mm256_set1_epi8(0x20));
    return _mm256_or_si256(nibbles, _mm256_or_si256(b4, b5));
}

/* The 8 rows 8h..8h+7 of a q5/q6 chunk (layout.h) as CodeBytes: the low nibbles, bits 4 (and 5) added from
 * each row's high-bit bytes, copied into every byte of its lane (tested per byte: bit j of byte j for q5,
 * bits 2j, 2j+1 for q6). q6 codes get bit 5 flipped: a byte's low 6 bits, read as signed, are q - 32. Once
 * a chunk, so that a k step decodes in three instructions. */
INLINE void avx2_split_codes(const int fmt, const uint8_t *chunk, int h, CodeBytes *c)
{
    const __m256i nibbles = _mm256_loadu_si256((const __m256i *)(chunk + 32 * h)), low4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(nibbles, low4), hi = _mm256_and_si256(_mm256_srli_epi32(nibbles, 4), low4);
    const __m256i byte0 = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                           0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    if (fmt == FMT_Q5) {
        const __m256i bit4 = _mm256_set1_epi8(0x10), bits = _mm256_shuffle_epi8(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(chunk + 64 + 8 * h))), byte0);
        c->first[h] = _mm256_or_si256(lo, _mm256_and_si256(avx2_byte_flags(bits, 0x08040201), bit4));
        c->last[h] = _mm256_or_si256(hi, _mm256_and_si256(avx2_byte_flags(bits, (int32_t)0x80402010), bit4));
        return;
    }
    const __m256i pairs = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(chunk + 64 + 16 * h)));
    c->first[h] = avx2_q6_bytes(lo, _mm256_shuffle_epi8(pairs, byte0));  /* steps 0..3: the pairs' low byte */
    c->last[h] = avx2_q6_bytes(hi, _mm256_shuffle_epi8(pairs, _mm256_add_epi8(byte0, _mm256_set1_epi8(1))));
}

/* A chunk's CodeBytes (q5, q6; other formats decode from the chunk itself). */
INLINE CodeBytes avx2_code_bytes(const int fmt, const uint8_t *chunk)
{
    CodeBytes c = {{_mm256_setzero_si256(), _mm256_setzero_si256()}, {_mm256_setzero_si256(), _mm256_setzero_si256()}};
    if (fmt == FMT_Q5 || fmt == FMT_Q6) {
        avx2_split_codes(fmt, chunk, 0, &c);
        avx2_split_codes(fmt, chunk, 1, &c);
    }
    return c;
}

/* 8 rows' values of k step j from CodeBytes: q5 q, q6 q - 32 (the flipped bit 5 makes it the sign). */
INLINE __m256 avx2_decode_bytes(const int fmt, const CodeBytes *c, int h, const int j)
{
    const __m256i v = j < 4 ? c->first[h] : c->last[h];
    const int byte = 8 * (j & 3);
    if (fmt == FMT_Q5) {  /* the top byte needs no mask */
        const __m256i shifted = _mm256_srli_epi32(v, byte);
        return _mm256_cvtepi32_ps(byte == 24 ? shifted : _mm256_and_si256(shifted, _mm256_set1_epi32(0x1F)));
    }
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 26 - byte), 26));
}

/* e4m3 codes -> f32 / 2^8 for 8 rows (the f16 route of decode_step). */
INLINE __m256 avx2_decode_f8(const uint8_t *codes)
{
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_add_epi16(b, _mm_and_si128(b, _mm_set1_epi16(0x80))), 7));
}

/* The 16 rows' values of k step j of an 8-k chunk; `bytes` is avx2_code_bytes' (q5, q6). */
INLINE Rows16 avx2_decode_step(const int fmt, const uint8_t *chunk, const CodeBytes *bytes, const int j)
{
    if (fmt == FMT_Q5 || fmt == FMT_Q6)
        return (Rows16){avx2_decode_bytes(fmt, bytes, 0, j), avx2_decode_bytes(fmt, bytes, 1, j)};
    if (fmt == FMT_Q4)
        return (Rows16){avx2_decode_q4(chunk, j), avx2_decode_q4(chunk + 32, j)};
    if (fmt == FMT_Q8) {
        const uint8_t *word = chunk + (j >> 2) * 64;
        return (Rows16){avx2_decode_q8(word, j), avx2_decode_q8(word + 32, j)};
    }
    if (fmt == FMT_F8)
        return (Rows16){avx2_decode_f8(chunk + 16 * j), avx2_decode_f8(chunk + 16 * j + 8)};
    const __m128i *h = (const __m128i *)(chunk + 32 * j);
    return (Rows16){_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16)),
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h + 1)), 16))};
}

INLINE Rows16 avx2_fmadd(Rows16 a, Rows16 b, Rows16 c)
{
    return (Rows16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

INLINE Rows16 avx2_splat(float v)
{
    return (Rows16){_mm256_set1_ps(v), _mm256_set1_ps(v)};
}

/* Lane masks of the rows of panel p below N. */
INLINE void avx2_row_masks(int64_t n, int64_t p, __m256i *lo, __m256i *hi)
{
    const __m256i left = _mm256_set1_epi32((int)(n - p * PANEL < PANEL ? n - p * PANEL : PANEL));
    *lo = _mm256_cmpgt_epi32(left, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    *hi = _mm256_cmpgt_epi32(left, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
}

INLINE Rows16 avx2_load_rows(const float *y, __m256i mlo, __m256i mhi)
{
    return (Rows16){_mm256_maskload_ps(y, mlo), _mm256_maskload_ps(y + 8, mhi)};
}

INLINE void avx2_store_rows(float *y, Rows16 v, const float *bias, __m256i mlo, __m256i mhi)
{
    if (bias) {
        v.lo = _mm256_add_ps(v.lo, _mm256_maskload_ps(bias, mlo));
        v.hi = _mm256_add_ps(v.hi, _mm256_maskload_ps(bias + 8, mhi));
    }
    _mm256_maskstore_ps(y, mlo, v.lo);
    _mm256_maskstore_ps(y + 8, mhi, v.hi);
}

/* y[0 .. mt, panel p] for mt <= DIRECT_T2, as direct_kernel: y += s * sum(q x) + m * sum(x). */
INLINE void avx2_direct_kernel(const int fmt, const int mt, const Job *job, int64_t p)
{
    /* Independent accumulators per token: one chain's FMAs wait on each other (4 cycles each), so
     * with fewer than 8 in flight the loop waits on latency, not on the decode. */
    const int chains = mt == 1 ? 4 : mt == 2 ? 2 : 1;
    const Weight *w = &job->w;
    const int64_t K = w->k, G = w->group, ng = K / G, bpk = panel_bytes_per_k(fmt);
    Rows16 yacc[DIRECT_T2];
    for (int t = 0; t < mt; t++)
        yacc[t] = avx2_splat(0.0f);
    for (int64_t g = 0; g < ng; g++) {
        Rows16 acc[DIRECT_T2][4];
        for (int t = 0; t < mt; t++)
            for (int c = 0; c < chains; c++)
                acc[t][c] = avx2_splat(0.0f);
        for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
            const uint8_t *chunk = w->codes + p * K * bpk + k * bpk;
            _mm_prefetch((const char *)chunk + 4096, _MM_HINT_T0);
            const CodeBytes bytes = avx2_code_bytes(fmt, chunk);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const Rows16 wv = avx2_decode_step(fmt, chunk, &bytes, j);
                for (int t = 0; t < mt; t++)
                    acc[t][j % chains] = avx2_fmadd(wv, avx2_splat(job->x[t * K + k + j]), acc[t][j % chains]);
            }
        }
        Rows16 s, m = avx2_splat(0.0f);
        avx2_group_params(fmt, w, p, g, &s, &m);
        for (int t = 0; t < mt; t++) {
            Rows16 sum = acc[t][0];
            for (int c = 1; c < chains; c++)
                sum = (Rows16){_mm256_add_ps(sum.lo, acc[t][c].lo), _mm256_add_ps(sum.hi, acc[t][c].hi)};
            yacc[t] = avx2_fmadd(sum, s, yacc[t]);
            if (has_zeros(fmt))
                yacc[t] = avx2_fmadd(m, avx2_splat(job->ws.xsum[t * ng + g]), yacc[t]);
        }
    }
    __m256i mlo, mhi;
    avx2_row_masks(w->n, p, &mlo, &mhi);
    for (int t = 0; t < mt; t++)
        avx2_store_rows(job->y + t * w->n + p * PANEL, yacc[t], job->bias ? job->bias + p * PANEL : NULL, mlo, mhi);
}

/* tile[kc][16] = dequantized W of panel p, k0 .. k0+kc. */
INLINE void avx2_dequant_tile(const int fmt, const Weight *w, int64_t p, int64_t k0, int64_t kc, float *tile)
{
    const int64_t bpk = panel_bytes_per_k(fmt);
    Rows16 s = avx2_splat(0.0f), m = avx2_splat(0.0f);
    int64_t g_loaded = -1;
    for (int64_t k = k0; k < k0 + kc; k += 8) {
        if (k / w->group != g_loaded) {
            g_loaded = k / w->group;
            avx2_group_params(fmt, w, p, g_loaded, &s, &m);
        }
        const uint8_t *chunk = w->codes + p * w->k * bpk + k * bpk;
        const CodeBytes bytes = avx2_code_bytes(fmt, chunk);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            Rows16 v = avx2_decode_step(fmt, chunk, &bytes, j);
            if (has_zeros(fmt))
                v = avx2_fmadd(v, s, m);  /* q5: fma(q, s, m), portable_weight's one rounding */
            else if (fmt != FMT_BF16)
                v = (Rows16){_mm256_mul_ps(v.lo, s.lo), _mm256_mul_ps(v.hi, s.hi)};
            _mm256_storeu_ps(tile + (k - k0 + j) * PANEL, v.lo);
            _mm256_storeu_ps(tile + (k - k0 + j) * PANEL + 8, v.hi);
        }
    }
}

/* y[mr tokens, 16 rows] (+)= xp[kc][MR] . tile[kc][16], as micro_f32. */
INLINE void avx2_micro(const int mr, const float *xp, const float *tile, int64_t kc, float *y, int64_t ldy,
                       const float *bias, __m256i mlo, __m256i mhi, int first, int last)
{
    Rows16 c[MR2];
    for (int t = 0; t < mr; t++)
        c[t] = first ? avx2_splat(0.0f) : avx2_load_rows(y + t * ldy, mlo, mhi);
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const Rows16 b = {_mm256_loadu_ps(tile + k * PANEL), _mm256_loadu_ps(tile + k * PANEL + 8)};
        for (int t = 0; t < mr; t++)
            c[t] = avx2_fmadd(avx2_splat(xp[k * MR + t]), b, c[t]);
    }
    for (int t = 0; t < mr; t++)
        avx2_store_rows(y + t * ldy, c[t], last ? bias : NULL, mlo, mhi);
}

static void avx2_micro_any(int mr, const float *xp, const float *tile, int64_t kc, float *y, int64_t ldy,
                           const float *bias, __m256i mlo, __m256i mhi, int first, int last)
{
    switch (mr) {
    case 1: avx2_micro(1, xp, tile, kc, y, ldy, bias, mlo, mhi, first, last); break;
    case 2: avx2_micro(2, xp, tile, kc, y, ldy, bias, mlo, mhi, first, last); break;
    case 3: avx2_micro(3, xp, tile, kc, y, ldy, bias, mlo, mhi, first, last); break;
    case 4: avx2_micro(4, xp, tile, kc, y, ldy, bias, mlo, mhi, first, last); break;
    case 5: avx2_micro(5, xp, tile, kc, y, ldy, bias, mlo, mhi, first, last); break;
    default: avx2_micro(6, xp, tile, kc, y, ldy, bias, mlo, mhi, first, last); break;
    }
}

#define AVX2_CASES(fmt)                                                                              \
    static void avx2_direct_##fmt(const Job *job, int64_t p)                                         \
    {                                                                                                \
        switch (job->t) {                                                                            \
        case 1: avx2_direct_kernel(fmt, 1, job, p); break;                                           \
        case 2: avx2_direct_kernel(fmt, 2, job, p); break;                                           \
        case 3: avx2_direct_kernel(fmt, 3, job, p); break;                                           \
        default: avx2_direct_kernel(fmt, 4, job, p); break;                                          \
        }                                                                                            \
    }                                                                                                \
    static void avx2_dequant_##fmt(const Weight *w, int64_t p, int64_t k0, int64_t kc, float *tile) \
    {                                                                                                \
        avx2_dequant_tile(fmt, w, p, k0, kc, tile);                                                  \
    }
AVX2_CASES(FMT_Q4)
AVX2_CASES(FMT_Q5)
AVX2_CASES(FMT_Q6)
AVX2_CASES(FMT_Q8)
AVX2_CASES(FMT_F8)
AVX2_CASES(FMT_BF16)

/* Panel p against tokens t1 .. t2 - 1 (t1 a multiple of MR). */
static void avx2_tile_panel(const Job *job, int64_t p, int64_t t1, int64_t t2, float *tile /* [KC][16] */)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, N = w->n;
    __m256i mlo, mhi;
    avx2_row_masks(N, p, &mlo, &mhi);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        switch (w->fmt) {
        case FMT_Q4: avx2_dequant_FMT_Q4(w, p, k0, kc, tile); break;
        case FMT_Q5: avx2_dequant_FMT_Q5(w, p, k0, kc, tile); break;
        case FMT_Q6: avx2_dequant_FMT_Q6(w, p, k0, kc, tile); break;
        case FMT_Q8: avx2_dequant_FMT_Q8(w, p, k0, kc, tile); break;
        case FMT_F8: avx2_dequant_FMT_F8(w, p, k0, kc, tile); break;
        default: avx2_dequant_FMT_BF16(w, p, k0, kc, tile); break;
        }
        /* Each packed tile of MR tokens goes in near-equal calls of at most MR2: 8 tokens as 4 + 4,
         * not 6 + 2, whose 4 accumulators would leave the loop waiting on FMA latency. */
        for (int64_t base = t1; base < t2; base += MR) {
            const int in_tile = (int)(t2 - base < MR ? t2 - base : MR);
            const int calls = (in_tile + MR2 - 1) / MR2;
            for (int c = 0, t = 0; c < calls; c++) {
                const int mr = (in_tile - t) / (calls - c);
                const int64_t t0 = base + t;
                const float *xp = job->ws.xpack + (base / MR) * K * MR + k0 * MR + t;
                avx2_micro_any(mr, xp, tile, kc, job->y + t0 * N + p * PANEL, N,
                               job->bias ? job->bias + p * PANEL : NULL, mlo, mhi, k0 == 0, k0 + kc == K);
                t += mr;
            }
        }
    }
}

// ----------------------------------------------------------------------------
// Int16 activations, q4 and q8

#define MRI 4  /* tokens per int16 micro-kernel call: 4 codes + 4 dots + 4 sums of 16 ymm registers */

/* Each 32-bit lane of `codes` holds one row's 4 u8 codes (k, k+1, k+2, k+3); PAIR_LO widens
 * codes k, k+1 to the lane's two int16 halves, PAIR_HI codes k+2, k+3 (0x80: a zero byte). */
#define PAIR_LO _mm256_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128, 12, -128, 13, -128, \
                                 0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128, 12, -128, 13, -128)
#define PAIR_HI _mm256_setr_epi8(2, -128, 3, -128, 6, -128, 7, -128, 10, -128, 11, -128, 14, -128, 15, -128, \
                                 2, -128, 3, -128, 6, -128, 7, -128, 10, -128, 11, -128, 14, -128, 15, -128)

/* The scale s and zero point z (as portable_zero computes it) of rows 8h..8h+7 of panel p, group g of the
 * panel's `groups`. */
INLINE void avx2_int_params(const int fmt, const Weight *w, int64_t p, int h, int64_t g, int64_t groups, __m256 *s,
                            __m256 *z)
{
    const int64_t idx = (p * groups + g) * PANEL + 8 * h;
    const Rows16 sv = avx2_load16(w->scales, idx - 8 * h, w->scales_f16);
    *s = h ? sv.hi : sv.lo;
    if (fmt != FMT_Q4)
        return;
    if (w->scales_f16)
        *z = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), *s, _mm256_cvtph_ps(_mm_loadu_si128(
            (const __m128i *)((const uint16_t *)w->zeros + idx))));
    else
        *z = _mm256_loadu_ps((const float *)w->zeros + idx);
}

/* The end of activation block b for tokens t0 .. t0+mr, rows 8h..8h+7 of panel p: acc +=
 * f32(dot) * (s * step) (+ z * xsum for q4), in the portable path's order. */
INLINE void avx2_int_block_end(const int fmt, const int mr, const int b32, const Job *job, int64_t p, int h,
                               int64_t t0, int64_t b, const __m256i *dot, __m256 *acc)
{
    const int64_t nb = job->w.k / (b32 ? 32 : job->blk);
    const float *step = job->ws.xscale + t0 * nb, *xsum = job->ws.xsum + t0 * nb;
    __m256 s, z = _mm256_setzero_ps();
    if (b32)
        avx2_int_params(fmt, &job->w, p, h, b, nb, &s, &z);
    else
        avx2_int_params(fmt, &job->w, p, h, b * job->blk / job->w.group, job->w.k / job->w.group, &s, &z);
    #pragma GCC unroll 4
    for (int t = 0; t < mr; t++) {
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(s, _mm256_set1_ps(step[t * nb + b])), acc[t]);
        if (fmt == FMT_Q4)
            acc[t] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[t * nb + b]), acc[t]);
    }
}

/* y[t0 + t, rows 8h..8h+7 of panel p] = acc[t] (+ bias), the rows below N only. */
INLINE void avx2_int_store(const int mr, const Job *job, int64_t p, int h, int64_t t0, const __m256 *acc)
{
    const int64_t N = job->w.n;
    __m256i mlo, mhi;
    avx2_row_masks(N, p, &mlo, &mhi);
    const __m256i mask = h ? mhi : mlo;
    const float *bias = job->bias ? job->bias + p * PANEL + 8 * h : NULL;
    #pragma GCC unroll 4
    for (int t = 0; t < mr; t++) {
        __m256 v = acc[t];
        if (bias)
            v = _mm256_add_ps(v, _mm256_maskload_ps(bias, mask));
        _mm256_maskstore_ps(job->y + (t0 + t) * N + p * PANEL + 8 * h, mask, v);
    }
}

/* y[t0 .. t0+mr, rows 8h..8h+7 of panel p]: per activation block b, dot = corr + sum(u8 code * s16
 * x) in int32 (pairs of k per vpmaddwd), then acc += f32(dot) * (s * step) (+ z * xsum for q4),
 * the portable path's numbers bit for bit. */
INLINE void avx2_micro_i16(const int fmt, const int mr, const int b32, const Job *job, int64_t p, int h, int64_t t0)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, B = b32 ? 32 : job->blk, nb = K / B, bpk = panel_bytes_per_k(fmt);
    const int32_t *xw = (const int32_t *)job->ws.xq16 + (t0 / MRQ) * (K / 2) * MRQ + t0 % MRQ;
    const int32_t *corr = job->ws.xcorr + t0 * nb;
    const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    const __m256i pair_lo = PAIR_LO, pair_hi = PAIR_HI;
    __m256 acc[MRI];
    #pragma GCC unroll 4
    for (int t = 0; t < mr; t++)
        acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[MRI];
        #pragma GCC unroll 4
        for (int t = 0; t < mr; t++)
            dot[t] = _mm256_set1_epi32(corr[t * nb + b]);
        for (int64_t k = b * B; k < (b + 1) * B; k += 8) {
            const uint8_t *chunk = w->codes + p * K * bpk + k * bpk + 32 * h;
            _mm_prefetch((const char *)chunk + 4096, _MM_HINT_T0);
            __m256i lo, hi;  /* codes k..k+3 and k+4..k+7 of 8 rows, as u8 */
            if (fmt == FMT_Q4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)chunk);
                lo = _mm256_and_si256(v, low4);
                hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            } else {
                lo = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)chunk), flip);
                hi = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(chunk + 64)), flip);
            }
            const __m256i c0 = _mm256_shuffle_epi8(lo, pair_lo), c1 = _mm256_shuffle_epi8(lo, pair_hi);
            const __m256i c2 = _mm256_shuffle_epi8(hi, pair_lo), c3 = _mm256_shuffle_epi8(hi, pair_hi);
            const int32_t *xk = xw + (k / 2) * MRQ;
            #pragma GCC unroll 4
            for (int t = 0; t < mr; t++) {
                const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(c0, _mm256_set1_epi32(xk[t])),
                                                     _mm256_madd_epi16(c1, _mm256_set1_epi32(xk[MRQ + t])));
                const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(c2, _mm256_set1_epi32(xk[2 * MRQ + t])),
                                                     _mm256_madd_epi16(c3, _mm256_set1_epi32(xk[3 * MRQ + t])));
                dot[t] = _mm256_add_epi32(dot[t], _mm256_add_epi32(s01, s23));
            }
        }
        avx2_int_block_end(fmt, mr, b32, job, p, h, t0, b, dot, acc);
    }
    avx2_int_store(mr, job, p, h, t0, acc);
}

// ----------------------------------------------------------------------------
// Int8 activations, q4 and q8: vpmaddubsw (u8 x s8, adjacent pairs summed to s16 with saturation)
// stays exact for both. q4 codes are 0..15, so a pair is at most 2 * 15 * 127 and 16 pairs fit
// an int16 lane: a 32-k sub-block sums in int16 before one vpmaddwd widens it. q8 codes are
// signed: |q| (0..128, unsigned) times x with q's sign moved onto it (vpsignb), 2 * 128 * 127 <
// 32767, widened after every product. Either way the integer dot is the portable path's (q8
// without its offset and correction, which cancel), so the numbers are the same bit for bit.

/* y[t0 .. t0+mr, rows 8h..8h+7 of panel p] with int8 activations (see above). */
INLINE void avx2_micro_i8(const int fmt, const int mr, const int b32, const Job *job, int64_t p, int h, int64_t t0)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, B = b32 ? 32 : job->blk, nb = K / B, bpk = panel_bytes_per_k(fmt);
    const int32_t *xw = (const int32_t *)job->ws.xq + (t0 / MRQ) * (K / 4) * MRQ + t0 % MRQ;
    const int32_t *corr = job->ws.xcorr + t0 * nb;
    const uint8_t *codes = w->codes + p * K * bpk + 32 * h;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MRI];
    #pragma GCC unroll 4
    for (int t = 0; t < mr; t++)
        acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[MRI];
        #pragma GCC unroll 4
        for (int t = 0; t < mr; t++)
            dot[t] = fmt == FMT_Q4 ? _mm256_set1_epi32(corr[t * nb + b]) : _mm256_setzero_si256();
        for (int64_t k0 = b * B; k0 < (b + 1) * B; k0 += 32) {
            if (fmt == FMT_Q4) {
                __m256i part[MRI];
                #pragma GCC unroll 4
                for (int t = 0; t < mr; t++)
                    part[t] = _mm256_setzero_si256();
                #pragma GCC unroll 4
                for (int64_t k = k0; k < k0 + 32; k += 8) {
                    _mm_prefetch((const char *)(codes + k * bpk) + 4096, _MM_HINT_T0);
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + k * bpk));
                    const __m256i lo = _mm256_and_si256(v, low4);  /* codes k..k+3 of 8 rows */
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  /* k+4..k+7 */
                    const int32_t *xk = xw + (k / 4) * MRQ;
                    #pragma GCC unroll 4
                    for (int t = 0; t < mr; t++)
                        part[t] = _mm256_add_epi16(part[t], _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xk[t])),
                            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xk[MRQ + t]))));
                }
                #pragma GCC unroll 4
                for (int t = 0; t < mr; t++)
                    dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(part[t], ones));
            } else {
                #pragma GCC unroll 8
                for (int64_t k = k0; k < k0 + 32; k += 4) {
                    _mm_prefetch((const char *)(codes + k * bpk) + 4096, _MM_HINT_T0);
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(codes + k * bpk));
                    const __m256i mag = _mm256_abs_epi8(q);
                    const int32_t *xk = xw + (k / 4) * MRQ;
                    #pragma GCC unroll 4
                    for (int t = 0; t < mr; t++)
                        dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(mag, _mm256_sign_epi8(_mm256_set1_epi32(xk[t]), q)), ones));
                }
            }
        }
        avx2_int_block_end(fmt, mr, b32, job, p, h, t0, b, dot, acc);
    }
    avx2_int_store(mr, job, p, h, t0, acc);
}

/* avx2_<kind>_<fmt>(job, p, h, t0, mr): the integer micro-kernel of one kind and format, its
 * token count a compile-time constant, and so is the block for blocks of 32 k over weight groups of 32
 * (GGUF's Q4_0, Q4_1 and Q8_0): no division a block for its group. */
#define INT_MR_CASES(kind, fmt, b32)                                                               \
    switch (mr) {                                                                                  \
    case 1: avx2_micro_##kind(fmt, 1, b32, job, p, h, t0); break;                                  \
    case 2: avx2_micro_##kind(fmt, 2, b32, job, p, h, t0); break;                                  \
    case 3: avx2_micro_##kind(fmt, 3, b32, job, p, h, t0); break;                                  \
    default: avx2_micro_##kind(fmt, 4, b32, job, p, h, t0); break;                                 \
    }
#define INT_CASES(kind, fmt)                                                                       \
    static void avx2_##kind##_##fmt(const Job *job, int64_t p, int h, int64_t t0, int mr)          \
    {                                                                                              \
        if (job->blk == 32 && job->w.group == 32)                                                  \
            INT_MR_CASES(kind, fmt, 1)                                                             \
        else                                                                                       \
            INT_MR_CASES(kind, fmt, 0)                                                             \
    }
INT_CASES(i16, FMT_Q4)
INT_CASES(i16, FMT_Q8)
INT_CASES(i8, FMT_Q4)
INT_CASES(i8, FMT_Q8)

/* Integer activations: threads own panels; each 8-row half of a panel runs MRI tokens at a time. */
static void avx2_compute_int(const Job *job, int tid, int nt)
{
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    const int q4 = job->w.fmt == FMT_Q4, i8 = job->act == ACT_INT8;
    const int64_t pass = pass_tokens(i8 ? job->w.k : 2 * job->w.k, MRQ);  /* whole tiles of the xq layouts */
    for (int64_t t1 = 0; t1 < job->t; t1 += pass) {
        const int64_t t2 = t1 + pass < job->t ? t1 + pass : job->t;
        for (int64_t p = lo; p < hi; p++)
            for (int h = 0; h < 2; h++) {
                if (8 * h >= job->w.n - p * PANEL)
                    break;  /* the panel's padding rows: nothing to store */
                for (int64_t t0 = t1; t0 < t2; t0 += MRI) {
                    const int mr = (int)(t2 - t0 < MRI ? t2 - t0 : MRI);
                    if (i8)
                        (q4 ? avx2_i8_FMT_Q4 : avx2_i8_FMT_Q8)(job, p, h, t0, mr);
                    else
                        (q4 ? avx2_i16_FMT_Q4 : avx2_i16_FMT_Q8)(job, p, h, t0, mr);
                }
            }
    }
}

static void avx2_prepare(Job *job, int tid, int nt)
{
    portable_prepare(job, tid, nt);
    if (job->act == ACT_F32 && !uses_direct(job)) {
        int64_t lo, hi;
        thread_range(ceil_div(job->t, MR), tid, nt, &lo, &hi);
        for (int64_t tile = lo; tile < hi; tile++)
            pack_tile(job, tile);
    }
}

static void avx2_compute(Job *job, int tid, int nt)
{
    if (job->act != ACT_F32) {
        avx2_compute_int(job, tid, nt);
        return;
    }
    float tile[KC * PANEL] __attribute__((aligned(32)));
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    if (!uses_direct(job)) {
        const int64_t pass = pass_tokens(4 * job->w.k, MR);
        for (int64_t t1 = 0; t1 < job->t; t1 += pass)
            for (int64_t p = lo; p < hi; p++)
                avx2_tile_panel(job, p, t1, t1 + pass < job->t ? t1 + pass : job->t, tile);
        return;
    }
    for (int64_t p = lo; p < hi; p++) {
        switch (job->w.fmt) {
        case FMT_Q4: avx2_direct_FMT_Q4(job, p); break;
        case FMT_Q5: avx2_direct_FMT_Q5(job, p); break;
        case FMT_Q6: avx2_direct_FMT_Q6(job, p); break;
        case FMT_Q8: avx2_direct_FMT_Q8(job, p); break;
        case FMT_F8: avx2_direct_FMT_F8(job, p); break;
        default: avx2_direct_FMT_BF16(job, p); break;
        }
    }
}

// ----------------------------------------------------------------------------
// Peak micro-benchmark

double avx2_peak(int kind, int64_t iters)
{
    float sink = 0.0f;
    if (kind == PEAK_F32) {  /* vfmadd: 8 lanes x 2 operations */
        __m256 acc[PEAK_CHAINS];
        const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
        for (int i = 0; i < PEAK_CHAINS; i++)
            acc[i] = _mm256_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++) {
            #pragma GCC unroll 12
            for (int i = 0; i < PEAK_CHAINS; i++)
                acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        }
        for (int i = 0; i < PEAK_CHAINS; i++)
            sink += _mm256_cvtss_f32(acc[i]);
        return sink == 12345.0f ? 0.0 : (double)iters * PEAK_CHAINS * 16;
    }
    /* int8: vpmaddubsw, 32 u8 x s8 products summed in pairs: 64 operations; int16: vpmaddwd, 16
     * s16 x s16 products, and the vpaddd that accumulates them (AVX2 has no multiply-add into 32
     * bits): 32. Each chain feeds its result back as the next operand (the values are meaningless;
     * the timing is not). */
    __m256i acc[PEAK_CHAINS];
    const __m256i s = _mm256_set1_epi8(-2);
    for (int i = 0; i < PEAK_CHAINS; i++)
        acc[i] = _mm256_set1_epi8((char)(i + 1));
    for (int64_t it = 0; it < iters; it++) {
        #pragma GCC unroll 12
        for (int i = 0; i < PEAK_CHAINS; i++)
            acc[i] = kind == PEAK_INT16 ? _mm256_add_epi32(acc[i], _mm256_madd_epi16(acc[i], s))
                                        : _mm256_maddubs_epi16(acc[i], s);
    }
    for (int i = 0; i < PEAK_CHAINS; i++)
        sink += (float)_mm256_extract_epi32(acc[i], 0);
    return sink == 12345.0f ? 0.0 : (double)iters * PEAK_CHAINS * (kind == PEAK_INT16 ? 32 : 64);
}

const Kernels KERNELS_AVX2 = {"avx2", avx2_prepare, avx2_compute, DIRECT_T2};
