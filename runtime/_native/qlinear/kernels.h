/* Internal interface of the qlinear kernels: one call's job and workspace, the per-ISA entry
 * points (a prepare and a compute phase per instruction set) and the helpers they share.
 *
 * Activation modes: f32 (codes decoded to f32, fp32 FMA accumulation), int8 (q4/q8 only:
 * activations quantized per token and block of `blk` k to int8, u8 x s8 VNNI dot products, one
 * fp32 rescale per block, as llama.cpp does), int16 (the same with 16-bit activations, step
 * amax / 32767: u8-widened codes x s16 pair products, vpdpwssd on AVX-512 VNNI, vpmaddwd on AVX2) and
 * int12 (int16's kernels on codes of step amax / 2047; on AMX, q4 blocks join, see amx_joined).
 *
 * Kernels: AMX (AVX-512's, with tile multiplies for integer activations' larger steps, and for f32
 * ones' with AMX-BF16: x split exactly into three bf16 parts) when the CPU and OS offer AMX-INT8, else
 * AVX-512 (F, BW, DQ, VL, VNNI) when the CPU has it, else AVX2
 * (vpmaddubsw for int8, vpmaddwd for int16); the portable C path is the tests' reference.
 * Each call runs one OpenMP region in which threads own contiguous ranges of panels; activations
 * are first prepared (packed or quantized), by the calling thread when T is small, else in the
 * region before a barrier.
 */
#ifndef KILN_QLINEAR_KERNELS_H
#define KILN_QLINEAR_KERNELS_H

#include <stdint.h>

#include "layout.h"

enum { ACT_F32 = 0, ACT_INT8 = 1, ACT_INT16 = 2, ACT_INT12 = 3 };

/* int12 activations are int16 codes of a smaller range (step amax / 2047): every path runs them as int16,
 * but on AMX a q4 block's 32 codes fit one 64-byte tile row (see amx.c). */
static inline int act_wide(int act) { return act == ACT_INT16 || act == ACT_INT12; }

#define MR 12        /* tokens per f32 micro-kernel tile */
#define MRQ 8        /* tokens per integer micro-kernel tile, and per tile of the xq / xq16 layouts */
#define KC 256       /* k per dequantized f32 tile: [KC][32] f32 = 32 KiB, L1/L2 resident */
#define MT 16          /* tokens per AMX tile (amx.c) */
#define AMX_PANELS 8   /* panels an AMX pass of f32 activations takes at a time: their sums stay in L1 */
#define DIRECT_T 12  /* AVX-512, f32 activations: T <= DIRECT_T decodes weights in registers, no tile (12
                        tokens: 24 accumulators, the most the 32 registers hold beside a chunk's codes) */

#define INLINE static inline __attribute__((always_inline))

/* Tokens of a step that one pass runs against every panel of a thread, before the next pass: as many as
 * keep their prepared activations within PASS_BYTES, so that they stay in L2 from one panel to the next.
 * A step of 2,048 or 4,096 tokens otherwise reads all of them from L3 or memory again for every panel: a
 * SmolLM2 layer at 4,096 tokens on a 2-core Xeon went x1.3 faster in passes with AMX int12, x1.1-1.2 AMX
 * f32, x1.3-1.4 AVX-512 f32, x1.4 AVX2 f32 (steps of 512 tokens unchanged). Each pass is a multiple of `unit`
 * (the kernel's tile of tokens), at least one; every output's arithmetic is the same in any pass. */
#define PASS_BYTES (1 << 20)
static inline int64_t pass_tokens(int64_t bytes_per_token, int64_t unit)
{
    const int64_t t = PASS_BYTES / bytes_per_token / unit * unit;
    return t > unit ? t : unit;
}

typedef struct {
    float *xpack;    /* [ceil(T/MR)][K][MR] f32 tokens interleaved (f32 tile path) */
    float *xsum;     /* [T][K/blk] sum of x over each block (the q4/q5 offset term) */
    int8_t *xq;      /* [ceil(T/MRQ)][K/4][MRQ][4] int8 activations */
    int16_t *xq16;   /* [ceil(T/MRQ)][K/2][MRQ][2] int16 activations */
    float *xscale;   /* [T][K/blk] int8 / int16 step of each block (portable, AVX2) */
    int32_t *xcorr;  /* [T][K/blk] -offset * sum(q) over each block (portable, AVX2) */
    float *tparams;  /* AVX-512 integer modes: [ceil(T/MRQ)][K/blk][3][MRQ] a tile's xscale, xsum
                        and xcorr (its int32 bits) per block, its tokens side by side */
    int8_t *xhi;     /* AMX: [ceil(T/MT)*MT][K] int8 activations, or int16 ones' high bytes (signed); joined
                        int12 ones (amx_joined): [ceil(T/MT)*MT][K/32][2][32] each block's x >> 4 (signed),
                        then its x & 15 */
    uint8_t *xlo;    /* AMX, int16: [ceil(T/MT)*MT][K] their low bytes (unsigned); x = 256 xhi + xlo */
    uint8_t *wrows;  /* AMX, q4: [threads][K/4][16][4] a panel's codes as tile rows;
                        f32 activations: [threads][AMX_PANELS][K/2][16][2] their values as bf16 */
    uint16_t *xbf;   /* AMX, f32 activations: [3][ceil(T/MT)*MT][K] bf16 parts of x (hi, mid, lo: their sum
                        is x exactly) */
    float *xsum32;   /* AMX, f32 activations: [T][K/32] sum of x over each 32 k */
} Workspace;

typedef struct {
    Weight w;
    int act;
    int64_t t;          /* tokens */
    int64_t blk;        /* activation block: q4/q5 G; int8 mode q8 G or 128/64/32 per-channel */
    int64_t direct_t;   /* f32 activations: T <= direct_t decodes in registers, else packs x for tiles */
    const float *x;     /* [T, K] */
    const float *bias;  /* [N] or NULL */
    float *y;           /* [T, N] */
    Workspace ws;
} Job;

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* An AMX job (amx_takes) whose blocks go as one tile row each: int12 activations against q4 codes in blocks
 * of 32 k, from 32 tokens (at 16, its twice larger split of the codes costs more than it saves: 0.8-0.9x
 * the int16 tiles, which take int12 codes too). */
static inline int amx_joined(const Job *job)
{
    return job->act == ACT_INT12 && job->w.fmt == FMT_Q4 && job->blk == 32 && job->t >= 32;
}

static inline int uses_direct(const Job *job) { return job->act == ACT_F32 && job->t <= job->direct_t; }

/* Contiguous share [*lo, *hi) of `units` work units for thread `tid` of `nt`. */
static inline void thread_range(int64_t units, int tid, int nt, int64_t *lo, int64_t *hi)
{
    *lo = units * tid / nt;
    *hi = units * (tid + 1) / nt;
}

/* Offset added to weight codes to make them u8 for VNNI: q4 codes are 0..15 already but
 * centred on 8; q8 codes are flipped to q + 128. */
static inline int32_t vnni_offset(int fmt) { return fmt == FMT_Q4 ? 8 : 128; }

/* Byte index of activation (t, k) in the interleaved int8 layout [T/MRQ][K/4][MRQ][4]. */
static inline int64_t xq_index(int64_t t, int64_t k, int64_t K)
{
    return ((t / MRQ) * (K / 4) + k / 4) * MRQ * 4 + (t % MRQ) * 4 + (k % 4);
}

/* Element index of activation (t, k) in the interleaved int16 layout [T/MRQ][K/2][MRQ][2]: the
 * pair (k, k+1) of a token is one 32-bit word, broadcast against a vector of row pairs. */
static inline int64_t xq16_index(int64_t t, int64_t k, int64_t K)
{
    return ((t / MRQ) * (K / 2) + k / 2) * MRQ * 2 + (t % MRQ) * 2 + (k % 2);
}

/* Largest activation code of an integer mode: q = rint(x * levels / amax) over a block. */
static inline float act_levels(int act) { return act == ACT_INT16 ? 32767.0f : act == ACT_INT12 ? 2047.0f : 127.0f; }

// ----------------------------------------------------------------------------
// Per-ISA entry points

/* One phase of a call, run by thread `tid` of `nt` on its share of the work. */
typedef void (*PhaseFn)(Job *job, int tid, int nt);

typedef struct {
    const char *name;
    PhaseFn prepare, compute;
    int64_t direct_t;  /* see Job.direct_t */
} Kernels;

extern const Kernels KERNELS_AMX;       /* amx.c */
extern const Kernels KERNELS_AVX512;    /* avx512.c */
extern const Kernels KERNELS_AVX2;      /* avx2.c */
extern const Kernels KERNELS_PORTABLE;  /* portable.c */

/* portable.c: the reference phases (AVX2 reuses them), the f32 tile packing every SIMD path
 * shares, and the exact dequantization of whole rows. */
void portable_prepare(Job *job, int tid, int nt);
void portable_compute(Job *job, int tid, int nt);
void pack_tile(const Job *job, int64_t tile);
void dequantize_rows(const Weight *w, const int64_t *ids, int64_t count, float *out, int threads);
/* The sum of x[0 .. len) in the order of a 16-lane vector sum, which every path computes alike: lane
 * i adds x[i], x[i + 16], ... in turn, then lanes i and i + w are added for w = 8, 4, 2, 1. */
float lane_sum(const float *x, int64_t len);

/* Peak micro-benchmarks (runtime/measure/roofline.py): one thread's `iters` rounds of PEAK_CHAINS independent
 * chains of the path's multiply-add instruction on registers alone; each returns the operations
 * done (a multiply-add counts two). */
enum { PEAK_F32 = 0, PEAK_INT8 = 1, PEAK_INT16 = 2 };
#define PEAK_CHAINS 12
double avx2_peak(int kind, int64_t iters);
double avx512_peak(int kind, int64_t iters);  /* also the AMX kernels': their steps of few tokens run on it */

/* avx512.c: its phases, which the AMX kernels reuse beside their own. With ws.xhi set, the
 * prepare phase quantizes integer activations into AMX's token rows. */
void avx512_prepare(Job *job, int tid, int nt);
void avx512_compute(Job *job, int tid, int nt);

/* amx.c: whether this CPU and OS let the process use AMX-INT8 tiles (asked once), and whether a
 * job runs on them (integer activations, q4 or q8, blocks of 32 or 64). */
int cpu_has_amx(void);
int amx_takes(const Job *job);
void amx_prepare(Job *job, int tid, int nt);

/* dispatch.c */
int cpu_has_avx512(void);
int run_kernels(const Kernels *kern, Job *job, int threads);
/* Operations per second of `kind` on `threads` threads with the kernels' instruction set. */
double measure_peak(const Kernels *kern, int kind, int threads, int64_t iters);

#endif
