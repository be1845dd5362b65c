/*
 * qlinear.c - linear layers over quantized and float weights for the Kiln CPU runtime.
 *
 *   y[T, N] = x[T, K] @ W[N, K]^T (+ bias[N]),  x and y float32 row-major.
 *
 * Weights are stored in panels of 16 output rows (one 512-bit vector of f32 per k step); rows are
 * padded with zeros to P * 16. Codes of panel p (runtime/qlinear.py builds them):
 *   q4  : uint8 [K/8][16][4]  byte (r, j) of k-block kb holds q[r][8kb+j] | q[r][8kb+4+j] << 4
 *   q8  : int8  [K/4][16][4]  q[r][4kb+j]          (the VNNI order: 4 k of one row per 32 bits)
 *   f8  : uint8 [K][16]       e4m3 code
 *   bf16: uint16 [K][16]
 * Scales [P][K/G][16] f32 or f16 (per-channel: G = K); q4 zero points alike, or its mins
 * m = zero - 8 * scale when stored as f16. Dequantized weight:
 *   q4 (q - 8) * s + z,   q8 q * s,   f8 e4m3(q) * s,   bf16 as is.
 *
 * Activation modes: f32 (codes decoded to f32, fp32 FMA accumulation) and int8 (q4/q8 only:
 * activations quantized per token and block of GA k to int8, u8 x s8 VNNI dot products, one
 * fp32 rescale per block, as llama.cpp does).
 *
 * Kernels: AVX-512 (F, BW, DQ, VL, VNNI) when the CPU has it, else AVX2 (f32 activations; int8
 * activations then run the portable C path, which also serves as the tests' reference).
 * Each call runs one OpenMP region in which threads own contiguous ranges of panels; activations
 * are first prepared (packed or quantized), by the calling thread when T is small, else in the
 * region before a barrier.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"

// ----------------------------------------------------------------------------
// Formats, jobs, workspace

enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_F8 = 2, FMT_BF16 = 3 };
enum { ACT_F32 = 0, ACT_INT8 = 1 };

#define PANEL 16     /* output rows per stored panel */
#define MR 12        /* tokens per f32 micro-kernel tile */
#define MRQ 8        /* tokens per int8 micro-kernel tile */
#define KC 256       /* k per dequantized f32 tile: [KC][32] f32 = 32 KiB, L1/L2 resident */
#define DIRECT_T 8   /* AVX-512, f32 activations: T <= DIRECT_T decodes weights in registers, no tile */

typedef struct {
    int fmt;
    const uint8_t *codes;   /* panel-major codes, layouts above */
    const void *scales;     /* [P][K/G][16] f32 or f16; NULL for bf16 */
    const void *zeros;      /* q4: [P][K/G][16] zeros (f32) or mins (f16); else NULL */
    int scales_f16;
    int64_t n, k, group;    /* group = k for per-channel */
    int64_t panels;         /* P = ceil(n / 16) */
} Weight;

typedef struct {
    float *xpack;    /* [ceil(T/MR)][K][MR] f32 tokens interleaved (f32 tile path) */
    float *xsum;     /* [T][K/blk] sum of x over each block (q4 zero-point term) */
    int8_t *xq;      /* [ceil(T/MRQ)][K/4][MRQ][4] int8 activations */
    float *xscale;   /* [T][K/blk] int8 step of each block */
    int32_t *xcorr;  /* [T][K/blk] -offset * sum(q) over each block */
} Workspace;

typedef struct {
    Weight w;
    int act;
    int64_t t;          /* tokens */
    int64_t blk;        /* activation block: q4 G; int8 mode q8 G or 128/64/32 per-channel */
    int64_t direct_t;   /* f32 activations: T <= direct_t decodes in registers, else packs x for tiles */
    const float *x;     /* [T, K] */
    const float *bias;  /* [N] or NULL */
    float *y;           /* [T, N] */
    Workspace ws;
} Job;

static int bits_of(int fmt) { return fmt == FMT_Q4 ? 4 : fmt == FMT_BF16 ? 16 : 8; }

/* Bytes of one panel's codes per k step: 16 rows * bits / 8. */
static int64_t panel_bytes_per_k(int fmt) { return 2 * bits_of(fmt); }

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int uses_direct(const Job *job) { return job->act == ACT_F32 && job->t <= job->direct_t; }

static void *alloc_aligned(size_t bytes)
{
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static int build_workspace(Job *job)
{
    const int64_t T = job->t, K = job->w.k, nb = K / job->blk;
    Workspace *ws = &job->ws;
    memset(ws, 0, sizeof *ws);
    if (job->act == ACT_INT8) {
        ws->xq = alloc_aligned((size_t)(ceil_div(T, MRQ) * MRQ * K));
        ws->xscale = malloc((size_t)(T * nb) * sizeof(float));
        ws->xcorr = malloc((size_t)(T * nb) * sizeof(int32_t));
        ws->xsum = malloc((size_t)(T * nb) * sizeof(float));
        return ws->xq && ws->xscale && ws->xcorr && ws->xsum;
    }
    ws->xsum = malloc((size_t)(T * nb) * sizeof(float));
    if (!uses_direct(job))
        ws->xpack = alloc_aligned((size_t)(ceil_div(T, MR) * MR * K) * sizeof(float));
    return ws->xsum && (uses_direct(job) || ws->xpack);
}

static void free_workspace(Workspace *ws)
{
    free(ws->xpack);
    free(ws->xsum);
    free(ws->xq);
    free(ws->xscale);
    free(ws->xcorr);
    memset(ws, 0, sizeof *ws);
}

/* Contiguous share [*lo, *hi) of `units` work units for thread `tid` of `nt`. */
static void thread_range(int64_t units, int tid, int nt, int64_t *lo, int64_t *hi)
{
    *lo = units * tid / nt;
    *hi = units * (tid + 1) / nt;
}

// ----------------------------------------------------------------------------
// Scalar helpers shared by both paths (activation quantization must match bit for bit)

static float f16_to_f32(uint16_t h)
{
    return _cvtsh_ss(h);
}

/* e4m3 (finite codes) -> f32, exactly. */
static float e4m3_to_f32(uint8_t code)
{
    const int e = (code >> 3) & 15, m = code & 7;
    const float mag = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
    return (code & 0x80) ? -mag : mag;
}

/* Offset added to weight codes to make them u8 for VNNI: q4 codes are 0..15 already but
 * centred on 8; q8 codes are flipped to q + 128. */
static int32_t vnni_offset(int fmt) { return fmt == FMT_Q4 ? 8 : 128; }

/* Byte index of activation (t, k) in the interleaved int8 layout [T/MRQ][K/4][MRQ][4]. */
static int64_t xq_index(int64_t t, int64_t k, int64_t K)
{
    return ((t / MRQ) * (K / 4) + k / 4) * MRQ * 4 + (t % MRQ) * 4 + (k % 4);
}

/* x rows of one MR-token tile, interleaved [K][MR] (missing tokens zero). */
static void pack_tile(const Job *job, int64_t tile)
{
    const int64_t K = job->w.k, t0 = tile * MR, mr = job->t - t0 < MR ? job->t - t0 : MR;
    float *dst = job->ws.xpack + tile * K * MR;
    for (int64_t k = 0; k < K; k++)
        for (int64_t i = 0; i < MR; i++)
            dst[k * MR + i] = i < mr ? job->x[(t0 + i) * K + k] : 0.0f;
}

// ----------------------------------------------------------------------------
// Portable path: plain C, correctness first (int8 activations on AVX2-only CPUs, and tests)

static float portable_scale(const Weight *w, int64_t n, int64_t g)
{
    const int64_t ng = w->k / w->group, idx = ((n / PANEL) * ng + g) * PANEL + n % PANEL;
    if (!w->scales)
        return 1.0f;
    return w->scales_f16 ? f16_to_f32(((const uint16_t *)w->scales)[idx]) : ((const float *)w->scales)[idx];
}

/* q4 zero point z (from f32 zeros, or z = fma(8, d, m) from f16 mins). */
static float portable_zero(const Weight *w, int64_t n, int64_t g)
{
    const int64_t ng = w->k / w->group, idx = ((n / PANEL) * ng + g) * PANEL + n % PANEL;
    if (!w->scales_f16)
        return ((const float *)w->zeros)[idx];
    return fmaf(8.0f, portable_scale(w, n, g), f16_to_f32(((const uint16_t *)w->zeros)[idx]));
}

/* Raw code of (n, k): q4 0..15, q8 -128..127, f8/bf16 the bit pattern. */
static int32_t portable_code(const Weight *w, int64_t n, int64_t k)
{
    const int64_t p = n / PANEL, r = n % PANEL, K = w->k;
    const uint8_t *panel = w->codes + p * K * panel_bytes_per_k(w->fmt);
    switch (w->fmt) {
    case FMT_Q4: {
        const uint8_t byte = panel[(k / 8) * 64 + r * 4 + (k % 4)];
        return (k % 8) < 4 ? byte & 15 : byte >> 4;
    }
    case FMT_Q8: return ((const int8_t *)panel)[(k / 4) * 64 + r * 4 + (k % 4)];
    case FMT_F8: return panel[k * PANEL + r];
    default: return ((const uint16_t *)panel)[k * PANEL + r];
    }
}

static float portable_weight(const Weight *w, int64_t n, int64_t k)
{
    const int32_t code = portable_code(w, n, k);
    const int64_t g = k / w->group;
    switch (w->fmt) {
    case FMT_Q4: return fmaf((float)(code - 8), portable_scale(w, n, g), portable_zero(w, n, g));
    case FMT_Q8: return (float)code * portable_scale(w, n, g);
    case FMT_F8: return e4m3_to_f32((uint8_t)code) * portable_scale(w, n, g);
    default: {
        const uint32_t bits = (uint32_t)code << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    }
}

static void portable_block_sums(const Job *job, int64_t t)
{
    const int64_t K = job->w.k, nb = K / job->blk;
    for (int64_t b = 0; b < nb; b++) {
        float sum = 0.0f;
        for (int64_t k = b * job->blk; k < (b + 1) * job->blk; k++)
            sum += job->x[t * K + k];
        job->ws.xsum[t * nb + b] = sum;
    }
}

/* int8 activations of token t: per block, step = amax / 127, q = rint(x * (127 / amax)). */
static void portable_quantize_token(const Job *job, int64_t t)
{
    const int64_t K = job->w.k, B = job->blk, nb = K / B;
    const float *x = job->x + t * K;
    for (int64_t b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (int64_t k = b * B; k < (b + 1) * B; k++)
            amax = fmaxf(amax, fabsf(x[k]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t qsum = 0;
        for (int64_t k = b * B; k < (b + 1) * B; k++) {
            const int32_t q = (int32_t)lrintf(x[k] * inv);
            job->ws.xq[xq_index(t, k, K)] = (int8_t)q;
            qsum += q;
        }
        job->ws.xscale[t * nb + b] = amax / 127.0f;
        job->ws.xcorr[t * nb + b] = -vnni_offset(job->w.fmt) * qsum;
    }
}

static void portable_prepare(Job *job, int tid, int nt)
{
    int64_t lo, hi;
    thread_range(job->t, tid, nt, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        if (job->w.fmt == FMT_Q4 || job->act == ACT_INT8)
            portable_block_sums(job, t);
        if (job->act == ACT_INT8)
            portable_quantize_token(job, t);
    }
}

static void portable_row_f32(const Job *job, int64_t n, float *row /* [K] */)
{
    const int64_t K = job->w.k, N = job->w.n;
    for (int64_t k = 0; k < K; k++)
        row[k] = portable_weight(&job->w, n, k);
    for (int64_t t = 0; t < job->t; t++) {
        const float *x = job->x + t * K;
        float part[8] = {0};
        for (int64_t k = 0; k < K; k += 8)
            for (int i = 0; i < 8 && k + i < K; i++)
                part[i] = fmaf(row[k + i], x[k + i], part[i]);
        const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        job->y[t * N + n] = sum + (job->bias ? job->bias[n] : 0.0f);
    }
}

/* Same arithmetic as the VNNI kernel: integer block dot, then acc += f32(dot) * (s * step) (+ z * xsum). */
static void portable_row_int8(const Job *job, int64_t n)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, B = job->blk, nb = K / B, N = w->n;
    const int32_t off = vnni_offset(w->fmt);
    for (int64_t t = 0; t < job->t; t++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot = job->ws.xcorr[t * nb + b];
            for (int64_t k = b * B; k < (b + 1) * B; k++) {
                const int32_t code = portable_code(w, n, k);
                const int32_t u = w->fmt == FMT_Q4 ? code : code + off;
                dot += u * job->ws.xq[xq_index(t, k, K)];
            }
            const int64_t g = b * B / w->group;
            acc = fmaf((float)dot, portable_scale(w, n, g) * job->ws.xscale[t * nb + b], acc);
            if (w->fmt == FMT_Q4)
                acc = fmaf(portable_zero(w, n, g), job->ws.xsum[t * nb + b], acc);
        }
        job->y[t * N + n] = acc + (job->bias ? job->bias[n] : 0.0f);
    }
}

static void portable_compute(Job *job, int tid, int nt)
{
    int64_t lo, hi;
    thread_range(job->w.n, tid, nt, &lo, &hi);
    float row[job->w.k];  /* one dequantized weight row; K is a layer width, a few KiB to tens of KiB */
    for (int64_t n = lo; n < hi; n++) {
        if (job->act == ACT_F32)
            portable_row_f32(job, n, row);
        else
            portable_row_int8(job, n);
    }
}

// ----------------------------------------------------------------------------
// AVX2 path (the module's baseline ISA): f32 activations; int8 activations use the portable path.
// A panel's 16 rows are two 8-lane vectors; codes decode to q (q4: 0..15) and w = q * s + m.

#define MR2 6        /* tokens per AVX2 micro-kernel call: 12 of the 16 ymm registers accumulate */
#define DIRECT_T2 2  /* AVX2, f32 activations: T <= DIRECT_T2 decodes weights in registers */

#define INLINE static inline __attribute__((always_inline))

typedef struct {
    __m256 lo, hi;  /* rows 0..7, 8..15 of a panel */
} Rows16;

INLINE Rows16 avx2_load16(const void *base, int64_t idx, int f16)
{
    if (f16) {
        const __m128i *h = (const __m128i *)((const uint16_t *)base + idx);
        return (Rows16){_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
    }
    const float *f = (const float *)base + idx;
    return (Rows16){_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}

/* Scale s and offset m (q4: m = z - 8s, the value of code 0; stored as is when f16) of panel p, group g. */
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
    if (fmt == FMT_Q4) {
        *m = avx2_load16(w->zeros, idx, w->scales_f16);
        if (!w->scales_f16) {
            m->lo = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s->lo, m->lo);
            m->hi = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s->hi, m->hi);
        }
    }
}

/* 8 rows' codes of k step j from a 32-byte half of a q4/q8 chunk's 64-byte word (see decode_step). */
INLINE __m256 avx2_decode_half(const int fmt, const uint8_t *half, const int j)
{
    const __m256i raw = _mm256_loadu_si256((const __m256i *)half);
    if (fmt == FMT_Q4) {
        const int shift = (j & 3) * 8 + (j >> 2) * 4;
        return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, shift), _mm256_set1_epi32(15)));
    }
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 24 - 8 * (j & 3)), 24));
}

/* e4m3 codes -> f32 / 2^8 for 8 rows (the f16 route of decode_step). */
INLINE __m256 avx2_decode_f8(const uint8_t *codes)
{
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_add_epi16(b, _mm_and_si128(b, _mm_set1_epi16(0x80))), 7));
}

INLINE Rows16 avx2_decode_step(const int fmt, const uint8_t *chunk, const int j)
{
    if (fmt == FMT_Q4)
        return (Rows16){avx2_decode_half(fmt, chunk, j), avx2_decode_half(fmt, chunk + 32, j)};
    if (fmt == FMT_Q8) {
        const uint8_t *word = chunk + (j >> 2) * 64;
        return (Rows16){avx2_decode_half(fmt, word, j), avx2_decode_half(fmt, word + 32, j)};
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
    const int chains = mt == 1 ? 2 : 1;
    const Weight *w = &job->w;
    const int64_t K = w->k, G = w->group, ng = K / G, bpk = panel_bytes_per_k(fmt);
    Rows16 yacc[DIRECT_T2];
    for (int t = 0; t < mt; t++)
        yacc[t] = avx2_splat(0.0f);
    for (int64_t g = 0; g < ng; g++) {
        Rows16 acc[DIRECT_T2][2];
        for (int t = 0; t < mt; t++)
            acc[t][0] = acc[t][1] = avx2_splat(0.0f);
        for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
            const uint8_t *chunk = w->codes + p * K * bpk + k * bpk;
            _mm_prefetch((const char *)chunk + 4096, _MM_HINT_T0);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const Rows16 wv = avx2_decode_step(fmt, chunk, j);
                for (int t = 0; t < mt; t++)
                    acc[t][j % chains] = avx2_fmadd(wv, avx2_splat(job->x[t * K + k + j]), acc[t][j % chains]);
            }
        }
        Rows16 s, m = avx2_splat(0.0f);
        avx2_group_params(fmt, w, p, g, &s, &m);
        for (int t = 0; t < mt; t++) {
            Rows16 sum = acc[t][0];
            if (chains == 2)
                sum = (Rows16){_mm256_add_ps(sum.lo, acc[t][1].lo), _mm256_add_ps(sum.hi, acc[t][1].hi)};
            yacc[t] = avx2_fmadd(sum, s, yacc[t]);
            if (fmt == FMT_Q4)
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
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            Rows16 v = avx2_decode_step(fmt, chunk, j);
            if (fmt == FMT_Q4)
                v = avx2_fmadd(v, s, m);
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
        if (job->t == 1)                                                                             \
            avx2_direct_kernel(fmt, 1, job, p);                                                      \
        else                                                                                         \
            avx2_direct_kernel(fmt, 2, job, p);                                                      \
    }                                                                                                \
    static void avx2_dequant_##fmt(const Weight *w, int64_t p, int64_t k0, int64_t kc, float *tile) \
    {                                                                                                \
        avx2_dequant_tile(fmt, w, p, k0, kc, tile);                                                  \
    }
AVX2_CASES(FMT_Q4)
AVX2_CASES(FMT_Q8)
AVX2_CASES(FMT_F8)
AVX2_CASES(FMT_BF16)

static void avx2_tile_panel(const Job *job, int64_t p, float *tile /* [KC][16] */)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, N = w->n;
    __m256i mlo, mhi;
    avx2_row_masks(N, p, &mlo, &mhi);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        switch (w->fmt) {
        case FMT_Q4: avx2_dequant_FMT_Q4(w, p, k0, kc, tile); break;
        case FMT_Q8: avx2_dequant_FMT_Q8(w, p, k0, kc, tile); break;
        case FMT_F8: avx2_dequant_FMT_F8(w, p, k0, kc, tile); break;
        default: avx2_dequant_FMT_BF16(w, p, k0, kc, tile); break;
        }
        for (int64_t t0 = 0; t0 < job->t; t0 += MR2) {
            const int mr = (int)(job->t - t0 < MR2 ? job->t - t0 : MR2);
            const float *xp = job->ws.xpack + (t0 / MR) * K * MR + k0 * MR + t0 % MR;
            avx2_micro_any(mr, xp, tile, kc, job->y + t0 * N + p * PANEL, N, job->bias ? job->bias + p * PANEL : NULL,
                           mlo, mhi, k0 == 0, k0 + kc == K);
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
    if (job->act == ACT_INT8) {
        portable_compute(job, tid, nt);
        return;
    }
    float tile[KC * PANEL] __attribute__((aligned(32)));
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    for (int64_t p = lo; p < hi; p++) {
        if (!uses_direct(job)) {
            avx2_tile_panel(job, p, tile);
            continue;
        }
        switch (job->w.fmt) {
        case FMT_Q4: avx2_direct_FMT_Q4(job, p); break;
        case FMT_Q8: avx2_direct_FMT_Q8(job, p); break;
        case FMT_F8: avx2_direct_FMT_F8(job, p); break;
        default: avx2_direct_FMT_BF16(job, p); break;
        }
    }
}

// ----------------------------------------------------------------------------
// AVX-512 path: helpers

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")

INLINE __mmask16 rows_mask(int64_t n, int64_t p)
{
    const int64_t left = n - p * PANEL;
    return left >= PANEL ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

INLINE __m512 load16(const void *base, int64_t idx, int f16)
{
    if (f16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx)));
    return _mm512_loadu_ps((const float *)base + idx);
}

/* Scale s and (q4) zero point z of panel p, weight group g, for 16 rows. f8 scales carry the
 * 2^8 that decode_step leaves out. */
INLINE void group_params(const int fmt, const Weight *w, int64_t p, int64_t g, __m512 *s, __m512 *z)
{
    const int64_t idx = (p * (w->k / w->group) + g) * PANEL;
    if (fmt == FMT_BF16) {
        *s = _mm512_set1_ps(1.0f);
        return;
    }
    *s = load16(w->scales, idx, w->scales_f16);
    if (fmt == FMT_F8)
        *s = _mm512_mul_ps(*s, _mm512_set1_ps(256.0f));
    if (fmt == FMT_Q4)
        *z = w->scales_f16 ? _mm512_fmadd_ps(_mm512_set1_ps(8.0f), *s, load16(w->zeros, idx, 1))
                           : _mm512_loadu_ps((const float *)w->zeros + idx);
}

/* The 512-bit words of an 8-k chunk that decode_step shifts from (q4: one, q8: two). */
INLINE void load_chunk(const int fmt, const uint8_t *chunk, __m512i *raw0, __m512i *raw1)
{
    if (fmt == FMT_Q4 || fmt == FMT_Q8)
        *raw0 = _mm512_loadu_si512(chunk);
    if (fmt == FMT_Q8)
        *raw1 = _mm512_loadu_si512(chunk + 64);
}

/* Codes of k step j (0..7) of a chunk as f32 for 16 rows: q4 q - 8, q8 q, f8 value / 2^8, bf16 value. */
INLINE __m512 decode_step(const int fmt, const uint8_t *chunk, __m512i raw0, __m512i raw1, const int j)
{
    if (fmt == FMT_Q4) {
        const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        const int shift = (j & 3) * 8 + (j >> 2) * 4;  /* low nibbles: steps 0..3, high: 4..7 */
        return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(raw0, shift) : raw0, table);
    }
    if (fmt == FMT_Q8) {
        const __m512i raw = j < 4 ? raw0 : raw1;
        const int up = 24 - 8 * (j & 3);
        const __m512i v = up ? _mm512_slli_epi32(raw, up) : raw;
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
    }
    if (fmt == FMT_F8) {
        /* e4m3 -> f16 bits: sign << 15 | (exponent, mantissa) << 7; f16 = value / 2^8, subnormals exact */
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(chunk + 16 * j)));
        const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(b, _mm256_and_si256(b, _mm256_set1_epi16(0x80))), 7);
        return _mm512_cvtph_ps(h);
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)(chunk + 32 * j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Software prefetch PREFETCH_BYTES ahead of a streamed chunk of `bytes` (one line per 64 bytes):
 * the decode loops read weights once, from DRAM, and the hardware prefetcher alone leaves a
 * single core well short of the memory bandwidth. */
#define PREFETCH_BYTES 4096
INLINE void prefetch_ahead(const uint8_t *chunk, int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch((const char *)chunk + PREFETCH_BYTES + off, _MM_HINT_T0);
}

INLINE void store_rows(float *y, __m512 v, const float *bias, __mmask16 m)
{
    if (bias)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias));
    _mm512_mask_storeu_ps(y, m, v);
}

// ----------------------------------------------------------------------------
// AVX-512 path: activation preparation

static float avx512_block_sum(const float *x, int64_t len)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < len; k += 16)
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + k));
    return _mm512_reduce_add_ps(acc);
}

/* Same numbers as portable_quantize_token (the block sums aside). Blocks are multiples of 16. */
static void avx512_quantize_token(const Job *job, int64_t t)
{
    const int64_t K = job->w.k, B = job->blk, nb = K / B;
    const float *x = job->x + t * K;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++) {
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t k = b * B; k < (b + 1) * B; k += 16)
            vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + k)));
        const float amax = _mm512_reduce_max_ps(vmax);
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i qsum = _mm512_setzero_si512();
        for (int64_t k = b * B; k < (b + 1) * B; k += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
            qsum = _mm512_add_epi32(qsum, q);
            int32_t words[4];
            _mm_storeu_si128((__m128i *)words, _mm512_cvtepi32_epi8(q));
            for (int i = 0; i < 4; i++)
                memcpy(job->ws.xq + xq_index(t, k + 4 * i, K), &words[i], 4);
        }
        job->ws.xscale[t * nb + b] = amax / 127.0f;
        job->ws.xcorr[t * nb + b] = -vnni_offset(job->w.fmt) * _mm512_reduce_add_epi32(qsum);
        job->ws.xsum[t * nb + b] = avx512_block_sum(x + b * B, B);
    }
}

static void avx512_prepare(Job *job, int tid, int nt)
{
    const int64_t K = job->w.k, nb = K / job->blk;
    int64_t lo, hi;
    if (job->act == ACT_INT8) {
        thread_range(job->t, tid, nt, &lo, &hi);
        for (int64_t t = lo; t < hi; t++)
            avx512_quantize_token(job, t);
        return;  /* a last tile of mr < MRQ tokens reads only its mr tokens: padding needs no zeros */
    }
    if (job->w.fmt == FMT_Q4) {
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
// AVX-512 path: f32 activations, small T (weights decoded in registers)

/* y[0 .. mt, panel p] for mt <= DIRECT_T tokens; per group the codes' dot with x is scaled once:
 * y += s * sum((q-8) x) + z * sum(x). One panel at a time keeps one stream of codes (two
 * interleaved panels read slower from DRAM); a lone token splits its sum over two chains (even
 * and odd k) so the FMA latency hides behind the other chain. */
INLINE void direct_kernel(const int fmt, const int mt, const Job *job, int64_t p)
{
    const int chains = mt == 1 ? 2 : 1;
    const Weight *w = &job->w;
    const int64_t K = w->k, G = w->group, ng = K / G, N = w->n, bpk = panel_bytes_per_k(fmt);
    const float *x = job->x;
    __m512 yacc[DIRECT_T];
#pragma GCC unroll 16
    for (int t = 0; t < mt; t++)
        yacc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 acc[DIRECT_T][2];
#pragma GCC unroll 16
        for (int t = 0; t < mt; t++)
            acc[t][0] = acc[t][1] = _mm512_setzero_ps();
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
            const __m512 sum = chains == 2 ? _mm512_add_ps(acc[t][0], acc[t][1]) : acc[t][0];
            yacc[t] = _mm512_fmadd_ps(sum, s, yacc[t]);
            if (fmt == FMT_Q4)
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
        default: direct_kernel(fmt, 8, job, p); break;                                     \
        }                                                                                  \
    }
DIRECT_CASES(FMT_Q4)
DIRECT_CASES(FMT_Q8)
DIRECT_CASES(FMT_F8)
DIRECT_CASES(FMT_BF16)

// ----------------------------------------------------------------------------
// AVX-512 path: f32 activations, larger T (dequantized tile + 12x32 FMA micro-kernel)

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
                const __m512 v = fmt == FMT_Q4 ? _mm512_fmadd_ps(q, s, z) : fmt == FMT_BF16 ? q : _mm512_mul_ps(q, s);
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
DEQUANT_CASES(FMT_Q8)
DEQUANT_CASES(FMT_F8)
DEQUANT_CASES(FMT_BF16)

static void tile_panels(const Job *job, int64_t p, int np, float *tile /* [KC][32] */)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, N = w->n;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        switch (w->fmt) {
        case FMT_Q4: dequant_FMT_Q4(w, p, np, k0, kc, tile); break;
        case FMT_Q8: dequant_FMT_Q8(w, p, np, k0, kc, tile); break;
        case FMT_F8: dequant_FMT_F8(w, p, np, k0, kc, tile); break;
        default: dequant_FMT_BF16(w, p, np, k0, kc, tile); break;
        }
        for (int64_t t0 = 0; t0 < job->t; t0 += MR) {
            const int mr = (int)(job->t - t0 < MR ? job->t - t0 : MR);
            micro_f32_any(mr, np, job->ws.xpack + (t0 / MR) * K * MR + k0 * MR, tile, kc, job->y + t0 * N + p * PANEL,
                          N, job->bias ? job->bias + p * PANEL : NULL, rows_mask(N, p), rows_mask(N, p + 1),
                          k0 == 0, k0 + kc == K);
        }
    }
}

// ----------------------------------------------------------------------------
// AVX-512 path: int8 activations (VNNI), q4 and q8

/* y[t0 .. t0+mr, panel p]: per activation block b, dot = corr + sum(u8 code * s8 x) in int32,
 * then acc += f32(dot) * (s * step) (+ z * xsum for q4). */
INLINE void micro_vnni(const int fmt, const int mr, const Job *job, int64_t p, int64_t t0)
{
    const Weight *w = &job->w;
    const int64_t K = w->k, B = job->blk, nb = K / B, N = w->n, bpk = panel_bytes_per_k(fmt);
    const int32_t *xq = (const int32_t *)(job->ws.xq + (t0 / MRQ) * K * MRQ);  /* [K/4][MRQ] words */
    const float *step = job->ws.xscale + t0 * nb, *xsum = job->ws.xsum + t0 * nb;
    const int32_t *corr = job->ws.xcorr + t0 * nb;
    const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MRQ];
    #pragma GCC unroll 16
    for (int t = 0; t < mr; t++)
        acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[MRQ];
        #pragma GCC unroll 16
        for (int t = 0; t < mr; t++)
            dot[t] = _mm512_set1_epi32(corr[t * nb + b]);
        for (int64_t k = b * B; k < (b + 1) * B; k += 8) {
            const uint8_t *chunk = w->codes + p * K * bpk + k * bpk;
            prefetch_ahead(chunk, 8 * bpk);
            __m512i lo, hi;
            if (fmt == FMT_Q4) {
                const __m512i v = _mm512_loadu_si512(chunk);
                lo = _mm512_and_si512(v, low4);
                hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            } else {
                lo = _mm512_xor_si512(_mm512_loadu_si512(chunk), flip);
                hi = _mm512_xor_si512(_mm512_loadu_si512(chunk + 64), flip);
            }
            const int32_t *xk = xq + (k / 4) * MRQ;
            #pragma GCC unroll 16
            for (int t = 0; t < mr; t++)
                dot[t] = _mm512_dpbusd_epi32(dot[t], lo, _mm512_set1_epi32(xk[t]));
            #pragma GCC unroll 16
            for (int t = 0; t < mr; t++)
                dot[t] = _mm512_dpbusd_epi32(dot[t], hi, _mm512_set1_epi32(xk[MRQ + t]));
        }
        __m512 s, z = _mm512_setzero_ps();
        group_params(fmt, w, p, b * B / w->group, &s, &z);
        #pragma GCC unroll 16
        for (int t = 0; t < mr; t++) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(s, _mm512_set1_ps(step[t * nb + b])), acc[t]);
            if (fmt == FMT_Q4)
                acc[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum[t * nb + b]), acc[t]);
        }
    }
    #pragma GCC unroll 16
    for (int t = 0; t < mr; t++)
        store_rows(job->y + (t0 + t) * N + p * PANEL, acc[t], job->bias ? job->bias + p * PANEL : NULL,
                   rows_mask(N, p));
}

#define VNNI_CASES(fmt)                                                                            \
    static void vnni_##fmt(const Job *job, int64_t p, int64_t t0, int mr)                          \
    {                                                                                              \
        switch (mr) {                                                                              \
        case 1: micro_vnni(fmt, 1, job, p, t0); break;                                             \
        case 2: micro_vnni(fmt, 2, job, p, t0); break;                                             \
        case 3: micro_vnni(fmt, 3, job, p, t0); break;                                             \
        case 4: micro_vnni(fmt, 4, job, p, t0); break;                                             \
        case 5: micro_vnni(fmt, 5, job, p, t0); break;                                             \
        case 6: micro_vnni(fmt, 6, job, p, t0); break;                                             \
        case 7: micro_vnni(fmt, 7, job, p, t0); break;                                             \
        default: micro_vnni(fmt, 8, job, p, t0); break;                                            \
        }                                                                                          \
    }
VNNI_CASES(FMT_Q4)
VNNI_CASES(FMT_Q8)

// ----------------------------------------------------------------------------
// AVX-512 path: per-thread compute

static void avx512_compute_direct(const Job *job, int tid, int nt)
{
    const int mt = (int)job->t;
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    for (int64_t p = lo; p < hi; p++) {
        switch (job->w.fmt) {
        case FMT_Q4: direct_FMT_Q4(job, p, mt); break;
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
    for (int64_t u = lo; u < hi; u++)
        tile_panels(job, 2 * u, 2 * u + 1 < job->w.panels ? 2 : 1, tile);
}

static void avx512_compute_vnni(const Job *job, int tid, int nt)
{
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    for (int64_t p = lo; p < hi; p++)
        for (int64_t t0 = 0; t0 < job->t; t0 += MRQ) {
            const int mr = (int)(job->t - t0 < MRQ ? job->t - t0 : MRQ);
            if (job->w.fmt == FMT_Q4)
                vnni_FMT_Q4(job, p, t0, mr);
            else
                vnni_FMT_Q8(job, p, t0, mr);
        }
}

static void avx512_compute(Job *job, int tid, int nt)
{
    if (job->act == ACT_INT8)
        avx512_compute_vnni(job, tid, nt);
    else if (uses_direct(job))
        avx512_compute_direct(job, tid, nt);
    else
        avx512_compute_tiled(job, tid, nt);
}

#pragma GCC pop_options

// ----------------------------------------------------------------------------
// Dispatch

typedef void (*PhaseFn)(Job *job, int tid, int nt);

typedef struct {
    const char *name;
    PhaseFn prepare, compute;
    int64_t direct_t;  /* see Job.direct_t */
} Kernels;

static const Kernels KERNELS_AVX512 = {"avx512", avx512_prepare, avx512_compute, DIRECT_T};
static const Kernels KERNELS_AVX2 = {"avx2", avx2_prepare, avx2_compute, DIRECT_T2};
static const Kernels KERNELS_PORTABLE = {"portable", portable_prepare, portable_compute, INT64_MAX};
static const Kernels *active_kernels = NULL;

static int cpu_has_avx512(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

/* Small batches prepare their activations on the calling thread (a few microseconds at most), so
 * the parallel region needs no barrier: one fewer place for a descheduled thread to stall it. */
static void run_job(const Kernels *kern, Job *job, int threads)
{
    const int prepare_first = threads <= 1 || job->t <= DIRECT_T;
    if (prepare_first)
        kern->prepare(job, 0, 1);
    if (threads <= 1) {
        kern->compute(job, 0, 1);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        if (!prepare_first) {
            kern->prepare(job, tid, nt);
#pragma omp barrier
        }
        kern->compute(job, tid, nt);
    }
}

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
    if (fmt < FMT_Q4 || fmt > FMT_BF16 || act < ACT_F32 || act > ACT_INT8)
        return PyErr_Format(PyExc_ValueError, "qlinear: unknown format %d or activation mode %d", fmt, act), -1;
    if (N <= 0 || K <= 0 || K % 8)
        return PyErr_Format(PyExc_ValueError, "qlinear: bad shape N=%lld K=%lld (K must be a positive multiple "
                            "of 8)", (long long)N, (long long)K), -1;
    if (G <= 0 || G % 8 || K % G)
        return PyErr_Format(PyExc_ValueError, "qlinear: group %lld must be a multiple of 8 dividing K=%lld",
                            (long long)G, (long long)K), -1;
    if (act == ACT_INT8 && (fmt > FMT_Q8 || blk % 32 || K % blk))
        return PyErr_Format(PyExc_ValueError, "qlinear: int8 activations need q4/q8 weights and K, group "
                            "multiples of 32"), -1;
    return 0;
}

/* Activation block of the int8 mode (and of the q4 zero-point sums). */
static int64_t activation_block(int fmt, int64_t K, int64_t G)
{
    if (fmt == FMT_Q4 || G < K)
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
        take_buffer(b, zeros, "zeros", scale_bytes, fmt != FMT_Q4, &zero_ptr) < 0 ||
        take_buffer(b, bias, "bias", N * 4, 1, &bias_ptr) < 0) {
        free_bound(b);
        return NULL;
    }
    if ((fmt == FMT_BF16) != (scale_ptr == NULL) || (fmt == FMT_Q4) != (zero_ptr != NULL)) {
        free_bound(b);
        return PyErr_Format(PyExc_ValueError, "qlinear: scales are needed by every format but bf16, zeros by q4 only");
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
    int ok = build_workspace(&job);
    if (ok)
        run_job(kern, &job, a->threads);
    free_workspace(&job.ws);
    return ok ? 0 : -1;
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
    tape_record(NULL, run_linear, &a, sizeof a);
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

/* set_isa("auto" | "avx512" | "avx2" | "portable"): pick the kernels (tests use it to cover every path). */
static PyObject *py_set_isa(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    if (!strcmp(name, "auto"))
        active_kernels = cpu_has_avx512() ? &KERNELS_AVX512 : &KERNELS_AVX2;
    else if (!strcmp(name, "avx512")) {
        if (!cpu_has_avx512())
            return PyErr_Format(PyExc_ValueError, "qlinear: this CPU lacks AVX-512 F/BW/DQ/VL/VNNI");
        active_kernels = &KERNELS_AVX512;
    } else if (!strcmp(name, "avx2"))
        active_kernels = &KERNELS_AVX2;
    else if (!strcmp(name, "portable"))
        active_kernels = &KERNELS_PORTABLE;
    else
        return PyErr_Format(PyExc_ValueError, "qlinear: unknown isa %R (auto, avx512, avx2, portable)", arg);
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
    const Weight *w = &a->b->w;
    const int64_t *ids = a->in, K = w->k;
    float *out = a->out;
    #pragma omp parallel for num_threads(a->threads > 0 ? a->threads : 1) if (a->count * K >= (1 << 16)) \
        schedule(static)
    for (long long r = 0; r < a->count; r++)
        for (int64_t k = 0; k < K; k++)
            out[r * K + k] = portable_weight(w, ids[r], k);
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
    tape_record(check_rows, run_rows, &a, sizeof a);
    Py_BEGIN_ALLOW_THREADS
    run_rows(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", py_bind, METH_VARARGS, "bind(fmt, act, codes, scales, zeros, bias, N, K, group, scales_f16) -> handle"},
    {"run", (PyCFunction)(void (*)(void))py_run, METH_FASTCALL, "run(handle, y_address, x_address, T, threads)"},
    {"rows", (PyCFunction)(void (*)(void))py_rows, METH_FASTCALL,
     "rows(handle, out_address, ids_address, R, threads): dequantized weight rows"},
    {"isa", py_isa, METH_NOARGS, "Name of the kernels in use: 'avx512', 'avx2' or 'portable'."},
    {"set_isa", py_set_isa, METH_O, "set_isa('auto' | 'avx512' | 'avx2' | 'portable') -> name in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qlinear", "Quantized linear kernels.", -1, methods};

PyMODINIT_FUNC PyInit__qlinear(void)
{
    active_kernels = cpu_has_avx512() ? &KERNELS_AVX512 : &KERNELS_AVX2;
    if (tape_import() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    const struct { const char *name; int value; } consts[] = {
        {"FMT_Q4", FMT_Q4}, {"FMT_Q8", FMT_Q8}, {"FMT_F8", FMT_F8}, {"FMT_BF16", FMT_BF16},
        {"ACT_F32", ACT_F32}, {"ACT_INT8", ACT_INT8}, {"PANEL", PANEL},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
