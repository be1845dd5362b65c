/* The AVX-512 qlinear path (F, BW, DQ, VL, VNNI; chosen at run time when the CPU has them):
 * f32 activations decode weights in registers for small T, else into a dequantized tile for an
 * FMA micro-kernel; int8 activations take u8 x s8 VNNI dot products (q4 and q8), int16 ones the
 * codes widened to int16 x s16 (vpdpwssd). The module is compiled for AVX2, so this file enables
 * AVX-512 for its own functions only. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

// ----------------------------------------------------------------------------
// Helpers

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")

#include "avx512_shared.h"

INLINE void store_rows(float *y, __m512 v, const float *bias, __mmask16 m)
{
    if (bias)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias));
    _mm512_mask_storeu_ps(y, m, v);
}

// ----------------------------------------------------------------------------
// Activation preparation

/* lane_sum's order (kernels.h): the 16 lanes, then halves added pairwise. */
INLINE float lane_sum16(__m512 acc)
{
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

static float avx512_block_sum(const float *x, int64_t len)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < len; k += 16)
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + k));
    return lane_sum16(acc);
}

/* The largest |x| of a block of len floats (a multiple of 16), and (*sum) their sum in avx512_block_sum's order */
INLINE float block_amax(const float *x, int64_t len, float *sum)
{
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
    for (int64_t k = 0; k < len; k += 16) {
        const __m512 v = _mm512_loadu_ps(x + k);
        vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign, v));
        vsum = _mm512_add_ps(vsum, v);
    }
    *sum = lane_sum16(vsum);
    return _mm512_reduce_max_ps(vmax);
}

/* portable_quantize_token's numbers, the block sums included: int8 codes 4 k to a word of xq,
 * int16 ones 2 k to a word of xq16 (or, for the AMX kernels, token rows of xhi / xlo: int8 codes,
 * or each int16 code's high byte, signed, and low byte, unsigned), and each block's step, sum and
 * correction into the tile parameters (the only ones micro_int and amx.c read). Blocks are
 * multiples of 16. */
static void avx512_quantize_token(const Job *job, int64_t t)
{
    const int64_t K = job->w.k, B = job->blk, nb = K / B;
    const float *x = job->x + t * K, levels = act_levels(job->act);
    const int wide = act_wide(job->act);
    /* xq / xq16 words of this token: one every MRQ words along k (4 k a word for int8, 2 for int16) */
    int32_t *words = job->ws.xhi ? NULL
                     : wide ? (int32_t *)job->ws.xq16 + xq16_index(t, 0, K) / 2
                            : (int32_t *)job->ws.xq + xq_index(t, 0, K) / 4;
    const __m256i every8 = _mm256_setr_epi32(0, MRQ, 2 * MRQ, 3 * MRQ, 4 * MRQ, 5 * MRQ, 6 * MRQ, 7 * MRQ);
    const __m128i every4 = _mm_setr_epi32(0, MRQ, 2 * MRQ, 3 * MRQ);
    for (int64_t b = 0; b < nb; b++) {
        float sum;
        const float amax = block_amax(x + b * B, B, &sum);
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
        __m512i qsum = _mm512_setzero_si512();
        for (int64_t k = b * B; k < (b + 1) * B; k += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
            qsum = _mm512_add_epi32(qsum, q);
            if (job->ws.xhi) {
                if (amx_joined(job)) {  /* block b's 64 bytes: x >> 4, then x & 15 */
                    int8_t *row = job->ws.xhi + t * 2 * K + b * 64 + (k - b * B);
                    _mm_storeu_si128((__m128i *)row, _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 4)));
                    _mm_storeu_si128((__m128i *)(row + 32), _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(15))));
                } else if (wide) {
                    _mm_storeu_si128((__m128i *)(job->ws.xhi + t * K + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8)));
                    _mm_storeu_si128((__m128i *)(job->ws.xlo + t * K + k),
                                     _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(0xFF))));
                } else {
                    _mm_storeu_si128((__m128i *)(job->ws.xhi + t * K + k), _mm512_cvtepi32_epi8(q));
                }
            } else if (wide) {  /* 8 words of k pairs, MRQ words apart */
                _mm256_i32scatter_epi32(words + (k / 2) * MRQ, every8, _mm512_cvtepi32_epi16(q), 4);
            } else {            /* 4 words of k quads */
                _mm_i32scatter_epi32(words + (k / 4) * MRQ, every4, _mm512_cvtepi32_epi8(q), 4);
            }
        }
        const int32_t corr = -vnni_offset(job->w.fmt) * _mm512_reduce_add_epi32(qsum);
        float *tp = job->ws.tparams + ((t / MRQ) * nb + b) * 3 * MRQ + t % MRQ;
        tp[0] = amax / levels;
        tp[MRQ] = sum;
        memcpy(tp + 2 * MRQ, &corr, 4);
    }
}

#define TILE_QUANTIZE_T 8  /* steps of at least this many tokens quantize int16 activations a tile at a time */

/* The 8 x 8 transpose of 32-bit words: out[p] = word p of r[0], ..., word p of r[7] */
INLINE void transpose8x8_epi32(const __m256i r[8], __m256i out[8])
{
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {  /* tokens 0-3, then 4-7 */
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int p = 0; p < 4; p++) {
        out[p] = _mm256_permute2x128_si256(u[p], u[4 + p], 0x20);
        out[p + 4] = _mm256_permute2x128_si256(u[p], u[4 + p], 0x31);
    }
}

/* avx512_quantize_token for the mr tokens of the tile at t0 (a multiple of MRQ), int16 codes for micro_int
 * (xq16): the tile's 8 words of each k pair are adjacent, so each 16 k of the 8 tokens are transposed in
 * registers and stored as one run, where a token alone scatters its words MRQ apart (the scatter was 60%
 * of the preparation's time on a Zen 5). Rows past mr are zeros, never read. Same numbers. */
static void avx512_quantize_tile16(const Job *job, int64_t t0, int mr)
{
    const int64_t K = job->w.k, B = job->blk, nb = K / B;
    const float levels = act_levels(job->act);
    int32_t *words = (int32_t *)job->ws.xq16 + xq16_index(t0, 0, K) / 2;
    for (int64_t b = 0; b < nb; b++) {
        __m512 inv[MRQ];
        __m512i qsum[MRQ];
        for (int t = 0; t < mr; t++) {
            float sum;
            const float amax = block_amax(job->x + (t0 + t) * K + b * B, B, &sum);
            inv[t] = _mm512_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
            qsum[t] = _mm512_setzero_si512();
            float *tp = job->ws.tparams + ((t0 / MRQ) * nb + b) * 3 * MRQ + t;
            tp[0] = amax / levels;
            tp[MRQ] = sum;
        }
        for (int64_t k = b * B; k < (b + 1) * B; k += 16) {
            __m256i rows[MRQ], pairs[MRQ];
            for (int t = 0; t < MRQ; t++) {
                if (t < mr) {
                    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(job->x + (t0 + t) * K + k), inv[t]));
                    qsum[t] = _mm512_add_epi32(qsum[t], q);
                    rows[t] = _mm512_cvtepi32_epi16(q);  /* 8 words: k pairs */
                } else {
                    rows[t] = _mm256_setzero_si256();
                }
            }
            transpose8x8_epi32(rows, pairs);
            for (int p = 0; p < 8; p++)
                _mm256_storeu_si256((__m256i *)(words + (k / 2 + p) * MRQ), pairs[p]);
        }
        for (int t = 0; t < mr; t++) {
            const int32_t corr = -vnni_offset(job->w.fmt) * _mm512_reduce_add_epi32(qsum[t]);
            memcpy(job->ws.tparams + ((t0 / MRQ) * nb + b) * 3 * MRQ + 2 * MRQ + t, &corr, 4);
        }
    }
}

void avx512_prepare(Job *job, int tid, int nt)
{
    const int64_t K = job->w.k, nb = K / job->blk;
    int64_t lo, hi;
    if (act_wide(job->act) && !job->ws.xhi && job->t >= TILE_QUANTIZE_T) {  /* whole tiles a thread */
        thread_range((job->t + MRQ - 1) / MRQ, tid, nt, &lo, &hi);
        for (int64_t tile = lo; tile < hi; tile++)
            avx512_quantize_tile16(job, tile * MRQ, (int)(job->t - tile * MRQ < MRQ ? job->t - tile * MRQ : MRQ));
        return;
    }
    if (job->act != ACT_F32) {
        thread_range(job->t, tid, nt, &lo, &hi);
        for (int64_t t = lo; t < hi; t++)
            avx512_quantize_token(job, t);
        return;  /* a last tile of mr < MRQ tokens reads only its mr tokens: padding needs no zeros */
    }
    if (has_zeros(job->w.fmt)) {
        thread_range(job->t, tid, nt, &lo, &hi);
        for (int64_t t = lo; t < hi; t++)
            for (int64_t b = 0; b < nb; b++)
                job->ws.xsum[t * nb + b] = avx512_block_sum(job->x + t * K + b * job->blk, job->blk);
    }
    if (!uses_direct(job)) {
        thread_range(ceil_div(job->t, MR), tid, nt, &lo, &hi);
        for (int64_t tile = lo; tile < hi; tile++)
            pack_tile(job, tile);
    }
}

// ----------------------------------------------------------------------------
// F32 activations, small T (weights decoded in registers)

/* y[0 .. mt, panel p] for mt <= DIRECT_T tokens; per group the codes' dot with x is scaled once:
 * y += s * sum((q-8) x) + z * sum(x) (q5: s * sum(q x) + m * sum(x)). One panel at a time keeps one stream of codes (two
 * interleaved panels read slower from DRAM); one or two tokens split each sum over four chains (k
 * mod 4), three or four over two, so that 8 or more FMAs are in flight (per layer from DRAM on a
 * Zen 5, 2-4 tokens x1.1-1.2). */
INLINE void direct_kernel(const int fmt, const int mt, const Job *job, int64_t p)
{
    const int chains = mt <= 2 ? 4 : mt <= 4 ? 2 : 1;
    const Weight *w = &job->w;
    const int64_t K = w->k, G = w->group, ng = K / G, N = w->n, bpk = panel_bytes_per_k(fmt);
    const float *x = job->x;
    __m512 yacc[DIRECT_T];
#pragma GCC unroll 16
    for (int t = 0; t < mt; t++)
        yacc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 acc[DIRECT_T][4];
#pragma GCC unroll 16
        for (int t = 0; t < mt; t++)
            acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
            const uint8_t *chunk = w->codes + p * K * bpk + k * bpk;
            prefetch_ahead(chunk, 8 * bpk);
            __m512i raw0 = _mm512_setzero_si512(), raw1 = _mm512_setzero_si512();
            load_chunk(fmt, chunk, &raw0, &raw1);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512 wv = decode_step(fmt, chunk, raw0, raw1, j);
#pragma GCC unroll 16
                for (int t = 0; t < mt; t++)
                    acc[t][j % chains] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[t * K + k + j]), acc[t][j % chains]);
            }
        }
        __m512 s, z = _mm512_setzero_ps();
        group_params(fmt, w, p, g, &s, &z);
#pragma GCC unroll 16
        for (int t = 0; t < mt; t++) {
            const __m512 sum = chains == 4 ? _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3]))
                             : chains == 2 ? _mm512_add_ps(acc[t][0], acc[t][1]) : acc[t][0];
            yacc[t] = _mm512_fmadd_ps(sum, s, yacc[t]);
            if (has_zeros(fmt))
                yacc[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(job->ws.xsum[t * ng + g]), yacc[t]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < mt; t++)
        store_rows(job->y + t * N + p * PANEL, yacc[t], job->bias ? job->bias + p * PANEL : NULL, rows_mask(N, p));
}

#define DIRECT_CASES(fmt)                                                                  \
    static void direct_##fmt(const Job *job, int64_t p, int mt)                            \
    {                                                                                      \
        switch (mt) {                                                                      \
        case 1: direct_kernel(fmt, 1, job, p); break;                                      \
        case 2: direct_kernel(fmt, 2, job, p); break;                                      \
        case 3: direct_kernel(fmt, 3, job, p); break;                                      \
        case 4: direct_kernel(fmt, 4, job, p); break;                                      \
        case 5: direct_kernel(fmt, 5, job, p); break;                                      \
        case 6: direct_kernel(fmt, 6, job, p); break;                                      \
        case 7: direct_kernel(fmt, 7, job, p); break;                                      \
        case 8: direct_kernel(fmt, 8, job, p); break;                                      \
        case 9: direct_kernel(fmt, 9, job, p); break;                                      \
        case 10: direct_kernel(fmt, 10, job, p); break;                                    \
        case 11: direct_kernel(fmt, 11, job, p); break;                                    \
        default: direct_kernel(fmt, 12, job, p); break;                                    \
        }                                                                                  \
    }
DIRECT_CASES(FMT_Q4)
DIRECT_CASES(FMT_Q5)
DIRECT_CASES(FMT_Q6)
DIRECT_CASES(FMT_Q8)
DIRECT_CASES(FMT_F8)
DIRECT_CASES(FMT_BF16)

// ----------------------------------------------------------------------------
// F32 activations, larger T (dequantized tile + 12x32 FMA micro-kernel)

/* tile[kc][np*16] = dequantized W of panels p .. p+np, k0 .. k0+kc. */
INLINE void dequant_tile(const int fmt, const Weight *w, int64_t p, int np, int64_t k0, int64_t kc, float *tile)
{
    const int64_t K = w->k, bpk = panel_bytes_per_k(fmt), ld = np * PANEL;
    #pragma GCC unroll 16
    for (int i = 0; i < np; i++) {
        __m512 s = _mm512_setzero_ps(), z = _mm512_setzero_ps();
        int64_t g_loaded = -1;
        for (int64_t k = k0; k < k0 + kc; k += 8) {
            if (k / w->group != g_loaded) {
                g_loaded = k / w->group;
                group_params(fmt, w, p + i, g_loaded, &s, &z);
            }
            const uint8_t *chunk = w->codes + (p + i) * K * bpk + k * bpk;
            prefetch_ahead(chunk, 8 * bpk);
            __m512i raw0 = _mm512_setzero_si512(), raw1 = _mm512_setzero_si512();
            load_chunk(fmt, chunk, &raw0, &raw1);
            float *dst = tile + (k - k0) * ld + i * PANEL;
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512 q = decode_step(fmt, chunk, raw0, raw1, j);
                const __m512 v = has_zeros(fmt) ? _mm512_fmadd_ps(q, s, z) : fmt == FMT_BF16 ? q : _mm512_mul_ps(q, s);
                _mm512_storeu_ps(dst + j * ld, v);
            }
        }
    }
}

/* y[mr tokens, np*16 rows] (+)= xp[kc][MR] . tile[kc][np*16]; `first` starts from zero,
 * `last` adds the bias. */
INLINE void micro_f32(const int mr, const int np, const float *xp, const float *tile, int64_t kc, float *y,
                      int64_t ldy, const float *bias, __mmask16 m0, __mmask16 m1, int first, int last)
{
    __m512 c[MR][2];
    #pragma GCC unroll 16
    for (int t = 0; t < mr; t++) {
        c[t][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + t * ldy);
        if (np == 2)
            c[t][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + t * ldy + PANEL);
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(tile + k * np * PANEL);
        const __m512 b1 = np == 2 ? _mm512_loadu_ps(tile + k * np * PANEL + PANEL) : b0;
        #pragma GCC unroll 16
        for (int t = 0; t < mr; t++) {
            const __m512 a = _mm512_set1_ps(xp[k * MR + t]);
            c[t][0] = _mm512_fmadd_ps(a, b0, c[t][0]);
            if (np == 2)
                c[t][1] = _mm512_fmadd_ps(a, b1, c[t][1]);
        }
    }
    #pragma GCC unroll 16
    for (int t = 0; t < mr; t++) {
        store_rows(y + t * ldy, c[t][0], last ? bias : NULL, m0);
        if (np == 2)
            store_rows(y + t * ldy + PANEL, c[t][1], last && bias ? bias + PANEL : NULL, m1);
    }
}

#define MICRO_CASE(mr)                                                                          \
    case mr:                                                                                    \
        if (np == 2)                                                                            \
            micro_f32(mr, 2, xp, tile, kc, y, ldy, bias, m0, m1, first, last);                  \
        else                                                                                    \
            micro_f32(mr, 1, xp, tile, kc, y, ldy, bias, m0, m1, first, last);                  \
        break;

static void micro_f32_any(int mr, int np, const float *xp, const float *tile, int64_t kc, float *y, int64_t ldy,
                          const float *bias, __mmask16 m0, __mmask16 m1, int first, int last)
{
    switch (mr) {
        MICRO_CASE(1) MICRO_CASE(2) MICRO_CASE(3) MICRO_CASE(4) MICRO_CASE(5) MICRO_CASE(6)
        MICRO_CASE(7) MICRO_CASE(8) MICRO_CASE(9) MICRO_CASE(10) MICRO_CASE(11) default: MICRO_CASE(12)
    }
}

#define DEQUANT_CASES(fmt)                                                                              \
    static void dequant_##fmt(const Weight *w, int64_t p, int np, int64_t k0, int64_t kc, float *tile) \
    {                                                                                                   \
        dequant_tile(fmt, w, p, np, k0, kc, tile);                                                      \
    }
DEQUANT_CASES(FMT_Q4)
DEQUANT_CASES(FMT_Q5)
DEQUANT_CASES(FMT_Q6)
DEQUANT_CASES(FMT_Q8)
DEQUANT_CASES(FMT_F8)
DEQUANT_CASES(FMT_BF16)

/* Panels p .. p + np - 1 against tokens t1 .. t2 - 1 (t1 a multiple of MR). */
static void tile_panels(const Job *job, int64_t p, int np, int64_t t1, int64_t t2, float *tile /* [KC][32] */)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, N = w->n;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        switch (w->fmt) {
        case FMT_Q4: dequant_FMT_Q4(w, p, np, k0, kc, tile); break;
        case FMT_Q5: dequant_FMT_Q5(w, p, np, k0, kc, tile); break;
        case FMT_Q6: dequant_FMT_Q6(w, p, np, k0, kc, tile); break;
        case FMT_Q8: dequant_FMT_Q8(w, p, np, k0, kc, tile); break;
        case FMT_F8: dequant_FMT_F8(w, p, np, k0, kc, tile); break;
        default: dequant_FMT_BF16(w, p, np, k0, kc, tile); break;
        }
        for (int64_t t0 = t1; t0 < t2; t0 += MR) {
            const int mr = (int)(t2 - t0 < MR ? t2 - t0 : MR);
            micro_f32_any(mr, np, job->ws.xpack + (t0 / MR) * K * MR + k0 * MR, tile, kc, job->y + t0 * N + p * PANEL,
                          N, job->bias ? job->bias + p * PANEL : NULL, rows_mask(N, p), rows_mask(N, p + 1),
                          k0 == 0, k0 + kc == K);
        }
    }
}

// ----------------------------------------------------------------------------
// Int8 and int16 activations (VNNI), q4 and q8

/* acc += the products of code's lanes with the activation word at x, broadcast (a {1to16} memory
 * operand): int16 pairs (vpdpwssd) or u8 codes x s8 quads (vpdpbusd). Written in asm because GCC's
 * register allocation of these intrinsics copies the accumulators around every step: twice the
 * instructions. */
INLINE __m512i dot_bcast(const int wide, __m512i acc, __m512i code, const int32_t *x)
{
    if (wide)
        __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(code), "m"(*x));
    else
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(code), "m"(*x));
    return acc;
}

/* y[t0 .. t0+mr, panel p], integer activations: per activation block b, dot = corr + sum(u8 code
 * * x) in int32, then acc += f32(dot) * (s * step) (+ z * xsum for q4). Int8 x (wide = 0): vpdpbusd
 * on the 4 codes of a row per 32-bit lane. Int16 x (wide = 1): each lane's codes widened to int16
 * pairs (k, k+1 and k+2, k+3; 0x80 is a zero byte) for vpdpwssd. Tiles of 4 tokens or more keep
 * one chain of sums a token, enough independent ones to hide the instructions' latency; smaller
 * tiles alternate each token's words between two. One panel at a time keeps one stream of codes
 * from DRAM (two panels side by side, each broadcast word feeding both, ran 1.1-2x slower on a Zen 5
 * at every token count, in cache too), and the f32 sums stay in registers from block to block (2-5%
 * faster on a Zen 5 than keeping them in memory). Integer sums are exact in any order and each f32
 * step is the portable path's, so the numbers are too. */
INLINE void micro_int(const int fmt, const int wide, const int mr, const int b32, const Job *job, int64_t p, int64_t t0)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, B = b32 ? 32 : job->blk, nb = K / B, N = w->n, bpk = panel_bytes_per_k(fmt);
    const int per_channel = !b32 && w->group == K;
    const int words = wide ? 4 : 2;  /* activation words of a token per 8 k */
    const int32_t *xq = wide ? (const int32_t *)job->ws.xq16 + (t0 / MRQ) * (K / 2) * MRQ
                             : (const int32_t *)job->ws.xq + (t0 / MRQ) * (K / 4) * MRQ;
    const float *params = job->ws.tparams + (t0 / MRQ) * nb * 3 * MRQ;
    const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    const __m512i pair_lo = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128,
                                                                 8, -128, 9, -128, 12, -128, 13, -128));
    const __m512i pair_hi = _mm512_broadcast_i32x4(_mm_setr_epi8(2, -128, 3, -128, 6, -128, 7, -128,
                                                                 10, -128, 11, -128, 14, -128, 15, -128));
    const int chains = mr >= 4 ? 1 : 2;
    __m512 acc[MRQ];
    #pragma GCC unroll 16
    for (int t = 0; t < mr; t++)
        acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const float *step = params + b * 3 * MRQ, *xsum = step + MRQ, *corr = step + 2 * MRQ;
        __m512i d[2][MRQ];  /* [chain][token] */
        #pragma GCC unroll 16
        for (int t = 0; t < mr; t++) {
            int32_t c;
            memcpy(&c, corr + t, 4);  /* xcorr's int32 bits */
            d[0][t] = _mm512_set1_epi32(c);
            if (chains == 2)
                d[1][t] = _mm512_setzero_si512();
        }
        const uint8_t *chunk = w->codes + p * K * bpk + b * B * bpk;
        const int32_t *xk = xq + b * (B / 8) * words * MRQ;
        for (int64_t c = 0; c < B / 8; c++, chunk += 8 * bpk, xk += words * MRQ) {
            prefetch_ahead(chunk, 8 * bpk);
            __m512i code[4], lo, hi;
            if (fmt == FMT_Q4) {
                const __m512i v = _mm512_loadu_si512(chunk);
                lo = _mm512_and_si512(v, low4);
                hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            } else {
                lo = _mm512_xor_si512(_mm512_loadu_si512(chunk), flip);
                hi = _mm512_xor_si512(_mm512_loadu_si512(chunk + 64), flip);
            }
            if (wide) {
                code[0] = _mm512_shuffle_epi8(lo, pair_lo);
                code[1] = _mm512_shuffle_epi8(lo, pair_hi);
                code[2] = _mm512_shuffle_epi8(hi, pair_lo);
                code[3] = _mm512_shuffle_epi8(hi, pair_hi);
            } else {
                code[0] = lo;
                code[1] = hi;
            }
            #pragma GCC unroll 4
            for (int j = 0; j < words; j++)
                #pragma GCC unroll 16
                for (int t = 0; t < mr; t++)
                    d[j % chains][t] = dot_bcast(wide, d[j % chains][t], code[j], xk + j * MRQ + t);
        }
        __m512 s, z = _mm512_setzero_ps();
        if (b32)
            group_params_at(fmt, w, (p * nb + b) * PANEL, &s, &z);
        else
            group_params(fmt, w, p, per_channel ? 0 : b, &s, &z);
        #pragma GCC unroll 16
        for (int t = 0; t < mr; t++) {
            const __m512i dot = chains == 2 ? _mm512_add_epi32(d[0][t], d[1][t]) : d[0][t];
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(step[t])), acc[t]);
            if (fmt == FMT_Q4)
                acc[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum[t]), acc[t]);
        }
    }
    #pragma GCC unroll 16
    for (int t = 0; t < mr; t++)
        store_rows(job->y + (t0 + t) * N + p * PANEL, acc[t], job->bias ? job->bias + p * PANEL : NULL,
                   rows_mask(N, p));
}

#define INT_MR_CASES(fmt, wide, b32)                                                                 \
    switch (mr) {                                                                                    \
    case 1: micro_int(fmt, wide, 1, b32, job, p, t0); break;                                         \
    case 2: micro_int(fmt, wide, 2, b32, job, p, t0); break;                                         \
    case 3: micro_int(fmt, wide, 3, b32, job, p, t0); break;                                         \
    case 4: micro_int(fmt, wide, 4, b32, job, p, t0); break;                                         \
    case 5: micro_int(fmt, wide, 5, b32, job, p, t0); break;                                         \
    case 6: micro_int(fmt, wide, 6, b32, job, p, t0); break;                                         \
    case 7: micro_int(fmt, wide, 7, b32, job, p, t0); break;                                         \
    default: micro_int(fmt, wide, 8, b32, job, p, t0); break;                                        \
    }
/* Blocks of 32 k over weight groups of 32 (GGUF's Q4_0, Q4_1 and Q8_0: the models' usual case) take
 * a copy with both known at compile time: its 4 chunks a block unrolled, its group the block. */
#define INT_CASES(name, fmt, wide)                                                                 \
    static void name(const Job *job, int64_t p, int64_t t0, int mr)                                \
    {                                                                                              \
        if (job->blk == 32 && job->w.group == 32)                                                  \
            INT_MR_CASES(fmt, wide, 1)                                                             \
        else                                                                                       \
            INT_MR_CASES(fmt, wide, 0)                                                             \
    }
INT_CASES(i8_FMT_Q4, FMT_Q4, 0)
INT_CASES(i8_FMT_Q8, FMT_Q8, 0)
INT_CASES(i16_FMT_Q4, FMT_Q4, 1)
INT_CASES(i16_FMT_Q8, FMT_Q8, 1)

// ----------------------------------------------------------------------------
// Per-thread compute

static void avx512_compute_direct(const Job *job, int tid, int nt)
{
    const int mt = (int)job->t;
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    for (int64_t p = lo; p < hi; p++) {
        switch (job->w.fmt) {
        case FMT_Q4: direct_FMT_Q4(job, p, mt); break;
        case FMT_Q5: direct_FMT_Q5(job, p, mt); break;
        case FMT_Q6: direct_FMT_Q6(job, p, mt); break;
        case FMT_Q8: direct_FMT_Q8(job, p, mt); break;
        case FMT_F8: direct_FMT_F8(job, p, mt); break;
        default: direct_FMT_BF16(job, p, mt); break;
        }
    }
}

static void avx512_compute_tiled(const Job *job, int tid, int nt)
{
    float tile[KC * 2 * PANEL] __attribute__((aligned(64)));
    int64_t lo, hi;
    thread_range(ceil_div(job->w.panels, 2), tid, nt, &lo, &hi);
    const int64_t pass = pass_tokens(4 * job->w.k, MR);
    for (int64_t t1 = 0; t1 < job->t; t1 += pass)
        for (int64_t u = lo; u < hi; u++)
            tile_panels(job, 2 * u, 2 * u + 1 < job->w.panels ? 2 : 1, t1, t1 + pass < job->t ? t1 + pass : job->t, tile);
}

/* Integer activations: each thread a contiguous range of panels, each panel's tokens of a pass in tiles of
 * MRQ. */
static void avx512_compute_int(const Job *job, int tid, int nt)
{
    const int q4 = job->w.fmt == FMT_Q4;
    void (*fn)(const Job *, int64_t, int64_t, int) =
        act_wide(job->act) ? (q4 ? i16_FMT_Q4 : i16_FMT_Q8) : (q4 ? i8_FMT_Q4 : i8_FMT_Q8);
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    const int64_t pass = pass_tokens(act_wide(job->act) ? 2 * job->w.k : job->w.k, MRQ);
    for (int64_t t1 = 0; t1 < job->t; t1 += pass) {
        const int64_t t2 = t1 + pass < job->t ? t1 + pass : job->t;
        for (int64_t p = lo; p < hi; p++)
            for (int64_t t0 = t1; t0 < t2; t0 += MRQ)
                fn(job, p, t0, (int)(t2 - t0 < MRQ ? t2 - t0 : MRQ));
    }
}

void avx512_compute(Job *job, int tid, int nt)
{
    if (job->act != ACT_F32)
        avx512_compute_int(job, tid, nt);
    else if (uses_direct(job))
        avx512_compute_direct(job, tid, nt);
    else
        avx512_compute_tiled(job, tid, nt);
}

// ----------------------------------------------------------------------------
// Peak micro-benchmark

double avx512_peak(int kind, int64_t iters)
{
    float sink = 0.0f;
    if (kind == PEAK_F32) {  /* vfmadd: 16 lanes x 2 operations */
        __m512 acc[PEAK_CHAINS];
        const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
        for (int i = 0; i < PEAK_CHAINS; i++)
            acc[i] = _mm512_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++) {
            #pragma GCC unroll 12
            for (int i = 0; i < PEAK_CHAINS; i++)
                acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        }
        for (int i = 0; i < PEAK_CHAINS; i++)
            sink += _mm512_reduce_add_ps(acc[i]);
        return sink == 12345.0f ? 0.0 : (double)iters * PEAK_CHAINS * 32;
    }
    /* int8: vpdpbusd, 64 u8 x s8 products into 16 int32 lanes: 128 operations; int16: vpdpwssd,
     * 32 s16 x s16 products: 64 */
    __m512i acc[PEAK_CHAINS];
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
    for (int i = 0; i < PEAK_CHAINS; i++)
        acc[i] = _mm512_set1_epi32(i);
    for (int64_t it = 0; it < iters; it++) {
        #pragma GCC unroll 12
        for (int i = 0; i < PEAK_CHAINS; i++)
            acc[i] = kind == PEAK_INT16 ? _mm512_dpwssd_epi32(acc[i], u, s) : _mm512_dpbusd_epi32(acc[i], u, s);
    }
    for (int i = 0; i < PEAK_CHAINS; i++)
        sink += (float)_mm512_reduce_add_epi32(acc[i]);
    return sink == 12345.0f ? 0.0 : (double)iters * PEAK_CHAINS * (kind == PEAK_INT16 ? 64 : 128);
}

#pragma GCC pop_options

const Kernels KERNELS_AVX512 = {"avx512", avx512_prepare, avx512_compute, DIRECT_T};
