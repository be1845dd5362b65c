/* The portable qlinear path: plain C, correctness first. It runs int8 activations on CPUs
 * without AVX-512, serves as the tests' reference, and dequantizes the rows of embedding lookups;
 * the SIMD paths compute the same numbers (activation quantization bit for bit). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../numeric.h"
#include "kernels.h"

static float portable_scale(const Weight *w, int64_t n, int64_t g)
{
    const int64_t ng = w->k / w->group, idx = ((n / PANEL) * ng + g) * PANEL + n % PANEL;
    if (!w->scales)
        return 1.0f;
    return w->scales_f16 ? f16_to_f32(((const uint16_t *)w->scales)[idx]) : ((const float *)w->scales)[idx];
}

/* The stored zeros entry of (n, g): q4's zero point or f16 min, q5's min. */
static float portable_stored_zero(const Weight *w, int64_t n, int64_t g)
{
    const int64_t ng = w->k / w->group, idx = ((n / PANEL) * ng + g) * PANEL + n % PANEL;
    return w->scales_f16 ? f16_to_f32(((const uint16_t *)w->zeros)[idx]) : ((const float *)w->zeros)[idx];
}

/* q4 zero point z (from f32 zeros, or z = fma(8, d, m) from f16 mins). */
static float portable_zero(const Weight *w, int64_t n, int64_t g)
{
    const float stored = portable_stored_zero(w, n, g);
    return w->scales_f16 ? fmaf(8.0f, portable_scale(w, n, g), stored) : stored;
}

/* Bits 4 and up of q5/q6 code (r, k) from its k-block's high-bit bytes (layout.h), at bit 4. */
static int32_t portable_high_bits(int fmt, const uint8_t *high, int64_t r, int64_t k)
{
    const int j = (int)(k % 8);
    if (fmt == FMT_Q5)
        return ((high[r] >> j) & 1) << 4;
    const int32_t pair = high[2 * r] | high[2 * r + 1] << 8;
    return ((pair >> (2 * j)) & 3) << 4;
}

/* Raw code of (n, k): q4 0..15, q5 0..31, q6 0..63, q8 -128..127, f8/bf16 the bit pattern. */
static int32_t portable_code(const Weight *w, int64_t n, int64_t k)
{
    const int64_t p = n / PANEL, r = n % PANEL, K = w->k, bpk = panel_bytes_per_k(w->fmt);
    const uint8_t *panel = w->codes + p * K * bpk;
    switch (w->fmt) {
    case FMT_Q4:
    case FMT_Q5:
    case FMT_Q6: {
        const uint8_t *chunk = panel + (k / 8) * 8 * bpk;  /* the k-block: low nibbles, then high bits */
        const uint8_t byte = chunk[r * 4 + (k % 4)];
        const int32_t low = (k % 8) < 4 ? byte & 15 : byte >> 4;
        return w->fmt == FMT_Q4 ? low : low | portable_high_bits(w->fmt, chunk + 64, r, k);
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
    case FMT_Q5: return fmaf((float)code, portable_scale(w, n, g), portable_stored_zero(w, n, g));
    case FMT_Q6: return (float)(code - 32) * portable_scale(w, n, g);
    case FMT_Q8: return (float)code * portable_scale(w, n, g);
    case FMT_F8: return e4m3_to_f32((uint8_t)code) * portable_scale(w, n, g);
    default: return bf16_to_f32((uint16_t)code);
    }
}

float lane_sum(const float *x, int64_t len)
{
    float part[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= len; k += 16)  /* lanes apart: the compiler may vectorize it, the order stays */
        for (int i = 0; i < 16; i++)
            part[i] += x[k + i];
    for (; k < len; k++)
        part[k % 16] += x[k];
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++)
            part[i] += part[i + width];
    return part[0];
}

static void portable_block_sums(const Job *job, int64_t t)
{
    const int64_t K = job->w.k, nb = K / job->blk;
    for (int64_t b = 0; b < nb; b++)
        job->ws.xsum[t * nb + b] = lane_sum(job->x + t * K + b * job->blk, job->blk);
}

/* int8 / int16 activations of token t: per block, step = amax / L, q = rint(x * (L / amax)), L the
 * mode's act_levels. */
static void portable_quantize_token(const Job *job, int64_t t)
{
    const int64_t K = job->w.k, B = job->blk, nb = K / B;
    const float *x = job->x + t * K, levels = act_levels(job->act);
    for (int64_t b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (int64_t k = b * B; k < (b + 1) * B; k++)
            amax = fmaxf(amax, fabsf(x[k]));
        const float inv = amax > 0.0f ? levels / amax : 0.0f;
        int32_t qsum = 0;
        for (int64_t k = b * B; k < (b + 1) * B; k++) {
            const int32_t q = (int32_t)lrintf(x[k] * inv);
            if (act_wide(job->act))
                job->ws.xq16[xq16_index(t, k, K)] = (int16_t)q;
            else
                job->ws.xq[xq_index(t, k, K)] = (int8_t)q;
            qsum += q;
        }
        job->ws.xscale[t * nb + b] = amax / levels;
        job->ws.xcorr[t * nb + b] = -vnni_offset(job->w.fmt) * qsum;
    }
}

void portable_prepare(Job *job, int tid, int nt)
{
    int64_t lo, hi;
    thread_range(job->t, tid, nt, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        if (has_zeros(job->w.fmt) || job->act != ACT_F32)
            portable_block_sums(job, t);
        if (job->act != ACT_F32)
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

/* Same arithmetic as the VNNI kernels: integer block dot of the offset (u8) codes with the int8 or
 * int16 activations, then acc += f32(dot) * (s * step) (+ z * xsum). */
static void portable_row_int(const Job *job, int64_t n)
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
                dot += u * (act_wide(job->act) ? job->ws.xq16[xq16_index(t, k, K)] : job->ws.xq[xq_index(t, k, K)]);
            }
            const int64_t g = b * B / w->group;
            acc = fmaf((float)dot, portable_scale(w, n, g) * job->ws.xscale[t * nb + b], acc);
            if (w->fmt == FMT_Q4)
                acc = fmaf(portable_zero(w, n, g), job->ws.xsum[t * nb + b], acc);
        }
        job->y[t * N + n] = acc + (job->bias ? job->bias[n] : 0.0f);
    }
}

void portable_compute(Job *job, int tid, int nt)
{
    int64_t lo, hi;
    thread_range(job->w.n, tid, nt, &lo, &hi);
    float row[job->w.k];  /* one dequantized weight row; K is a layer width, a few KiB to tens of KiB */
    for (int64_t n = lo; n < hi; n++) {
        if (job->act == ACT_F32)
            portable_row_f32(job, n, row);
        else
            portable_row_int(job, n);
    }
}

/* x rows of one MR-token tile, interleaved [K][MR] (missing tokens zero). */
void pack_tile(const Job *job, int64_t tile)
{
    const int64_t K = job->w.k, t0 = tile * MR, mr = job->t - t0 < MR ? job->t - t0 : MR;
    float *dst = job->ws.xpack + tile * K * MR;
    for (int64_t k = 0; k < K; k++)
        for (int64_t i = 0; i < MR; i++)
            dst[k * MR + i] = i < mr ? job->x[(t0 + i) * K + k] : 0.0f;
}

/* out[count, K] f32 = dequantized weight rows ids[count] (each within 0..N-1), one rounding
 * per element. */
void dequantize_rows(const Weight *w, const int64_t *ids, int64_t count, float *out, int threads)
{
    const int64_t K = w->k;
    #pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (count * K >= (1 << 16)) schedule(static)
    for (int64_t r = 0; r < count; r++)
        for (int64_t k = 0; k < K; k++)
            out[r * K + k] = portable_weight(w, ids[r], k);
}

const Kernels KERNELS_PORTABLE = {"portable", portable_prepare, portable_compute, INT64_MAX};
