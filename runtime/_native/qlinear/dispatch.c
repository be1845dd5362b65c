/* One qlinear call: its workspace, and the OpenMP region that runs a path's two phases. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static void *alloc_aligned(size_t bytes)
{
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static int build_workspace(const Kernels *kern, Job *job, int threads)
{
    const int64_t T = job->t, K = job->w.k, nb = K / job->blk;
    Workspace *ws = &job->ws;
    memset(ws, 0, sizeof *ws);
    if (job->act != ACT_F32)  /* every integer path's block parameters, the AVX-512 and AMX ones' per tile */
        ws->tparams = alloc_aligned((size_t)(ceil_div(T, MRQ) * nb * 3 * MRQ) * sizeof(float));
    if (kern == &KERNELS_AMX && amx_takes(job) && job->act == ACT_F32) {
        const int64_t rows = ceil_div(T, MT) * MT;
        ws->xbf = alloc_aligned((size_t)(3 * rows * K) * sizeof(uint16_t));
        ws->xsum32 = alloc_aligned((size_t)(T * (K / 32)) * sizeof(float));
        ws->wrows = alloc_aligned((size_t)threads * AMX_PANELS * (size_t)K * PANEL * sizeof(uint16_t));
        if (!ws->xbf || !ws->xsum32 || !ws->wrows)
            return 0;
        for (int i = 0; i < 3; i++)  /* the last tile's rows past T: zeros (see below) */
            memset(ws->xbf + (i * rows + T) * K, 0, (size_t)((rows - T) * K) * sizeof(uint16_t));
        return 1;
    }
    if (kern == &KERNELS_AMX && amx_takes(job)) {
        const int64_t rows = ceil_div(T, MT) * MT;
        const int joined = amx_joined(job), wide = act_wide(job->act) && !joined;
        const int64_t row = joined ? 2 * K : K;  /* bytes of a token's row of xhi */
        ws->xhi = alloc_aligned((size_t)(rows * row));
        ws->xlo = wide ? alloc_aligned((size_t)(rows * K)) : NULL;
        ws->wrows = job->w.fmt == FMT_Q4 ? alloc_aligned((size_t)threads * (size_t)row * PANEL) : NULL;
        if (!ws->xhi || (wide && !ws->xlo) || (job->w.fmt == FMT_Q4 && !ws->wrows) || !ws->tparams)
            return 0;
        /* the last tile's rows past T: zeros, so that every tile multiply reads defined bytes */
        memset(ws->xhi + T * row, 0, (size_t)((rows - T) * row));
        if (ws->xlo)
            memset(ws->xlo + T * K, 0, (size_t)((rows - T) * K));
        return 1;
    }
    if (job->act != ACT_F32) {
        if (act_wide(job->act))
            ws->xq16 = alloc_aligned((size_t)(ceil_div(T, MRQ) * MRQ * K) * sizeof(int16_t));
        else
            ws->xq = alloc_aligned((size_t)(ceil_div(T, MRQ) * MRQ * K));
        ws->xscale = malloc((size_t)(T * nb) * sizeof(float));
        ws->xcorr = malloc((size_t)(T * nb) * sizeof(int32_t));
        ws->xsum = malloc((size_t)(T * nb) * sizeof(float));
        return (ws->xq || ws->xq16) && ws->tparams && ws->xscale && ws->xcorr && ws->xsum;
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
    free(ws->xq16);
    free(ws->xscale);
    free(ws->xcorr);
    free(ws->tparams);
    free(ws->xhi);
    free(ws->xlo);
    free(ws->wrows);
    free(ws->xbf);
    free(ws->xsum32);
    memset(ws, 0, sizeof *ws);
}

int cpu_has_avx512(void)
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

/* Runs a job on `threads` threads (its workspace built and freed around it): 0, or -1 when
 * memory runs out. */
int run_kernels(const Kernels *kern, Job *job, int threads)
{
    const int ok = build_workspace(kern, job, threads > 0 ? threads : 1);
    if (ok)
        run_job(kern, job, threads);
    free_workspace(&job->ws);
    return ok ? 0 : -1;
}

double measure_peak(const Kernels *kern, int kind, int threads, int64_t iters)
{
    double ops = 0.0;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(+ : ops)
    ops += kern == &KERNELS_AVX2 || kern == &KERNELS_PORTABLE ? avx2_peak(kind, iters) : avx512_peak(kind, iters);
    return ops / (omp_get_wtime() - start);
}
