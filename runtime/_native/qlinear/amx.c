/* The AMX qlinear path (AMX-TILE and AMX-INT8, and AMX-BF16 for f32 activations, beside the AVX-512
 * path's instructions; chosen at run time when the CPU has them and Linux grants the process the tile
 * state): integer activations against q4 and q8 codes, and f32 ones in steps of 13 tokens and more
 * against any format but fp8 whose groups are multiples of 32; every other job on the AVX-512 path.
 *
 * F32 activations: see "F32 activations on AMX-BF16 tiles" below (three bf16 tile multiplies a 32-k
 * chunk, f32 sums; not bit for bit the other paths', within the same f32 bounds).
 *
 * A block's integer dot products come from tile multiplies: a tile of MT tokens' activation bytes
 * [MT][B] times a panel's codes [B/4][16 rows][4] gives [MT][16] int32 sums. Int8 activations take
 * one multiply a block; int16 ones, split into a signed high byte and an unsigned low byte
 * (x = 256 hi + lo), take two, combined as 256 * sum(hi) + sum(lo). Int12 ones (|x| <= 2047) against q4
 * codes in blocks of 32 take one, from 32 tokens: x = 16 hi + lo with lo in 0..15, and a block's tile row
 * is [32 hi | 32 lo] against codes [16 (q - 8) | q - 8] (16 (q - 8) still fits a signed byte), so the
 * tile's sum is the block's whole dot; at a layer's 64 and 128 tokens x1.2-1.35 int16's tiles on a
 * 2-core Xeon, as each block's finish needs no combining and half the stored sums (the products take
 * the same time: one multiply of 64-byte rows costs about what two of 32-byte rows do). Integer sums are
 * exact, so each block's dot is micro_int's (q8 codes multiply as signed bytes, which needs no
 * correction; q4 codes multiply as q - 8, which is the dot plus micro_int's correction), and the f32
 * steps after it are the same: the numbers are the portable path's, bit for bit. */
#define _GNU_SOURCE  /* syscall() */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1;  /* -1: not asked yet; 0: no AMX; 1: granted */
static int amx_bf16 = 0;    /* the CPU has AMX-BF16 too (f32 activations' tiles) */

int cpu_has_amx(void)
{
    if (amx_state < 0) {
        unsigned int eax, ebx, ecx, edx;
        __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
        const int tile_int8 = (edx >> 24 & 1) && (edx >> 25 & 1);  /* AMX-TILE, AMX-INT8 */
        unsigned int eax1, ebx1, ecx1, edx1;  /* leaf 7, subleaf 1: EAX bit 5, AVX512_BF16 */
        __asm__("cpuid" : "=a"(eax1), "=b"(ebx1), "=c"(ecx1), "=d"(edx1) : "a"(7), "c"(1));
        amx_bf16 = (edx >> 22 & 1) && (eax1 >> 5 & 1);  /* AMX-BF16, and AVX512_BF16 for the q8 codes */
        amx_state = tile_int8 && cpu_has_avx512() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
}

/* Tokens from which the tiles beat the AVX-512 kernels (a SmolLM2 layer, 1 and 2 threads, measured on
 * a Xeon with AMX): int16 activations (and int12 ones, as int16 below amx_joined's 32) from 16 (on 2
 * threads x1.0-1.1 there, x1.1-1.25 at 32, with each panel's sums in registers), int8 ones from 32 (even there for q4 codes, x1.05-1.2 for q8; 0.8-0.9x
 * at 16), f32 ones from 13, where the AVX-512 tiles begin (x1.4 there on 2 threads, x1.6-1.7 at 16,
 * 1.9-2.0 at 64; at 8 tokens, converting the codes for the tiles costs more than it saves: 0.75x). */
#define AMX_MIN_T_INT16 16
#define AMX_MIN_T_INT8 32
#define AMX_MIN_T_F32 13

int amx_takes(const Job *job)
{
    /* f32: every format but fp8. Its values are exact in bf16 too, but a tensorrt plan's cpu engine rounds
     * an fp8 layer's input to fp8, as its ONNX does, so an f32 rounding difference can move an fp8 rounding
     * of the next layer: with the AVX-512 kernels (each weight dequantized, then the dot) the build's
     * verification against ONNX Runtime stays within its 1e-4, with the tiles' order (the dot of the
     * codes, then the scale) a tiny model's logits moved by 0.038. */
    if (job->act == ACT_F32)
        return amx_bf16 && job->t >= AMX_MIN_T_F32 && job->w.group % 32 == 0 && job->w.fmt != FMT_F8;
    return (act_wide(job->act) ? job->t >= AMX_MIN_T_INT16 : job->act == ACT_INT8 && job->t >= AMX_MIN_T_INT8) &&
           (job->w.fmt == FMT_Q4 || job->w.fmt == FMT_Q8) && (job->blk == 32 || job->blk == 64);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c,amx-tile,amx-int8,amx-bf16")

#include "avx512_shared.h"

/* Palette 1's configuration: 64 bytes, then each tile's bytes per row and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* ldtilecfg with the whole configuration as its operand (the intrinsic names only its first 8 bytes,
 * so the compiler may drop or delay the stores to the rest). */
INLINE void load_config(const TileConfig *cfg)
{
    __asm__ volatile("ldtilecfg %0" ::"m"(*cfg));
}

/* The tiles (the intrinsics take their numbers as literals); activation and code tiles alternate between
 * even and odd blocks, so that loading a block's need not wait for the multiplies of the block before.
 * One multiply a block (int8 activations, and joined int12 ones): sums [MT][16] int32 0 (joined: odd
 * blocks' in 3, see panel_int), activation bytes [MT][B] 2 and 4 (joined: [MT][64]). Int16 ones: sums 0
 * (high bytes' products) and 1 (low bytes'), activation bytes 4 and 5, then 2 and 3. Codes [B/4][64]
 * (joined: [16][64]) 6 and 7. */
static void configure(int64_t B, int wide)
{
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    if (wide == 2)  /* a block's row is 64 bytes, x >> 4 then x & 15, against 16 rows of codes */
        B = 64;
    for (int i = 0; i < 6; i++) {
        const int sums = i == 0 || (wide == 1 ? i == 1 : i == 3);
        cfg.rows[i] = wide == 1 || sums || i == 2 || i == 4 ? MT : 0;
        cfg.colsb[i] = sums ? PANEL * 4 : cfg.rows[i] ? (uint16_t)B : 0;
    }
    cfg.rows[6] = cfg.rows[7] = (uint8_t)(B / 4);
    cfg.colsb[6] = cfg.colsb[7] = PANEL * 4;
    load_config(&cfg);
}

/* A q4 panel's codes as tile rows: [K/4][16 rows][4 codes], each code a signed byte q - 8 (a chunk of 8
 * k holds k 0-3 in the low nibbles, 4-7 in the high ones). Q8 panels are in this layout already, as
 * signed bytes too. With q - 8 in the products, a q4 block's integer dot is micro_int's dot plus its
 * correction (-8 * the sum of the block's activation codes) already. */
static void split_q4(const Job *job, int64_t p, uint8_t *rows)
{
    const int64_t K = job->w.k;
    const uint8_t *src = job->w.codes + p * K * panel_bytes_per_k(FMT_Q4);
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t c = 0; c < K / 8; c++) {
        const __m512i v = _mm512_loadu_si512(src + c * 64);
        prefetch_ahead(src + c * 64, 64);
        _mm512_store_si512(rows + c * 128, _mm512_sub_epi8(_mm512_and_si512(v, low4), eight));
        _mm512_store_si512(rows + c * 128 + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight));
    }
}

/* A q4 panel's codes for joined int12 activations (amx_joined): per block of 32 k, 8 tile rows of 16 * (q - 8)
 * (against x >> 4), then 8 of q - 8 (against x & 15), each 8 rows in split_q4's order. 16 * (q - 8) is
 * the nibble moved to the byte's top, minus 128 (an exclusive or of the top bit). */
static void split_q4_joined(const Job *job, int64_t p, uint8_t *rows)
{
    const int64_t K = job->w.k;
    const uint8_t *src = job->w.codes + p * K * panel_bytes_per_k(FMT_Q4);
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    const __m512i eight = _mm512_set1_epi8(8), top = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; c < K / 8; c++) {
        const __m512i v = _mm512_loadu_si512(src + c * 64);
        prefetch_ahead(src + c * 64, 64);
        uint8_t *dst = rows + (c / 4) * 1024 + (c % 4) * 128;
        _mm512_store_si512(dst, _mm512_xor_si512(_mm512_and_si512(_mm512_slli_epi16(v, 4), high4), top));
        _mm512_store_si512(dst + 64, _mm512_xor_si512(_mm512_and_si512(v, high4), top));
        _mm512_store_si512(dst + 512, _mm512_sub_epi8(_mm512_and_si512(v, low4), eight));
        _mm512_store_si512(dst + 576, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight));
    }
}

/* Block b's products, tokens t0 .. t0+MT against one panel's codes for the block (at `codes`), in the tiles
 * `configure` gives them. wide: 0 int8 activations, 1 int16 ones as high and low bytes, 2 joined int12
 * ones (one tile row a block, against amx_joined's codes). */
INLINE void block_products(const int wide, const int odd, const Job *job, int64_t t0, int64_t b, const uint8_t *codes)
{
    const int64_t K = job->w.k, off = t0 * K + b * job->blk;
    const int8_t *x = job->ws.xhi + (wide == 2 ? 2 * off : off);
    const int64_t row = wide == 2 ? 2 * K : K;
    if (wide == 1) {
        _tile_zero(0);
        _tile_zero(1);
        if (!odd) {
            _tile_loadd(4, x, row);
            _tile_loadd(5, job->ws.xlo + off, K);
            _tile_loadd(6, codes, PANEL * 4);
            _tile_dpbssd(0, 4, 6);  /* high bytes, signed, x signed codes */
            _tile_dpbusd(1, 5, 6);  /* low bytes, unsigned, x signed codes */
        } else {
            _tile_loadd(2, x, row);
            _tile_loadd(3, job->ws.xlo + off, K);
            _tile_loadd(7, codes, PANEL * 4);
            _tile_dpbssd(0, 2, 7);
            _tile_dpbusd(1, 3, 7);
        }
    } else if (!odd) {
        _tile_zero(0);
        _tile_loadd(2, x, row);
        _tile_loadd(6, codes, PANEL * 4);
        _tile_dpbssd(0, 2, 6);  /* int8 or joined bytes, signed, x signed codes */
    } else if (wide == 2) {  /* its own sums tile: stored while the next block multiplies */
        _tile_zero(3);
        _tile_loadd(4, x, row);
        _tile_loadd(7, codes, PANEL * 4);
        _tile_dpbssd(3, 4, 7);
    } else {
        _tile_zero(0);
        _tile_loadd(4, x, row);
        _tile_loadd(7, codes, PANEL * 4);
        _tile_dpbssd(0, 4, 7);
    }
}

/* A block's sums into sums[0] (and, int16, its low bytes' into sums[1]); odd: an odd joined block's tile. */
INLINE void store_block(const int wide, const int odd, int32_t (*sums)[MT][PANEL])
{
    if (odd && wide == 2) {
        _tile_stored(3, sums[0], PANEL * 4);
        return;
    }
    _tile_stored(0, sums[0], PANEL * 4);
    if (wide == 1)
        _tile_stored(1, sums[1], PANEL * 4);
}

/* y[t0 .. t0+mt, panel p] (+ bias) for integer activations, the panel's codes as tile rows at `codes`:
 * per block, the products stored to sums while a block before is finished from its stored sums
 * (acc[t] += its dot, the correction included, * (s * step) (+ z * xsum for q4), in micro_int's
 * order of operations); the panel's f32 sums stay in registers from block to block (x1.4 at 16
 * tokens, x1.24 at 32 on a 2-core Xeon against keeping eight panels' sums in memory, each block's
 * activation tiles loaded once for the eight). Joined int12 blocks (wide 2) alternate two sums tiles
 * and are finished two blocks after their products, not one (x1.1-1.2 at 32-64 tokens there: the
 * finish's loads wait less on the tile's stores; the other modes have no tile to spare). */
INLINE void panel_int(const int fmt, const int wide, const int mt, const Job *job, int64_t p, int64_t t0,
                      const uint8_t *codes)
{
    const int64_t K = job->w.k, B = job->blk, nb = K / B, N = job->w.n;
    const int64_t groups = K / job->w.group, stride = nb * 3 * MRQ;  /* per-channel scales: one group */
    const float *tparams = job->ws.tparams + (t0 / MRQ) * stride;    /* tokens t0 .. t0+7; +stride: the next 8 */
    int32_t sums[3][2][MT][PANEL] __attribute__((aligned(64)));  /* [block % (lag + 1)][high, low][token] */
    __m512 acc[MT];
    #pragma GCC unroll 16
    for (int t = 0; t < mt; t++)
        acc[t] = _mm512_setzero_ps();
    const int lag = wide == 2 ? 2 : 1;  /* blocks from a block's multiplies to its finish */
    for (int64_t b = 0; b < nb + lag; b++) {
        if (b < nb) {
            const uint8_t *at = codes + b * B * PANEL * (wide == 2 ? 2 : 1);
            if (fmt == FMT_Q8 && t0 == 0)  /* q8 codes: read from the weights by the first tile of tokens (of the
                                              * first pass: a later pass reads them without asking ahead) */
                prefetch_ahead(at, B * PANEL);
            (b & 1) ? block_products(wide, 1, job, t0, b, at) : block_products(wide, 0, job, t0, b, at);
            if (wide != 2)  /* one sums tile (pair): stored before the next block's multiplies */
                store_block(wide, 0, sums[b & 1]);
        }
        if (wide == 2 && b >= 1 && b <= nb)  /* the block before's sums, its multiply done by now */
            ((b - 1) & 1) ? store_block(2, 1, sums[(b - 1) % 3]) : store_block(2, 0, sums[(b - 1) % 3]);
        if (b < lag)
            continue;
        const int64_t f = b - lag;  /* the block to finish */
        __m512 s, z = _mm512_setzero_ps();
        group_params_at(fmt, &job->w, (p * groups + (groups == 1 ? 0 : f)) * PANEL, &s, &z);  /* q4/q8 groups are blocks */
        const float *tp0 = tparams + f * 3 * MRQ, *tp1 = tp0 + stride;
        int32_t (*d32)[MT][PANEL] = sums[wide == 2 ? f % 3 : f & 1];
        #pragma GCC unroll 16
        for (int t = 0; t < mt; t++) {
            const float *tp = (t < MRQ ? tp0 : tp1) + t % MRQ;
            __m512i d = _mm512_load_si512(d32[0][t]);
            if (wide == 1)
                d = _mm512_add_epi32(_mm512_slli_epi32(d, 8), _mm512_load_si512(d32[1][t]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_set1_ps(tp[0])), acc[t]);
            if (fmt == FMT_Q4)
                acc[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(tp[MRQ]), acc[t]);
        }
    }
    const __mmask16 m = rows_mask(N, p);
    const __m512 bias = job->bias ? _mm512_maskz_loadu_ps(m, job->bias + p * PANEL) : _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int t = 0; t < mt; t++)
        _mm512_mask_storeu_ps(job->y + (t0 + t) * N + p * PANEL, m, job->bias ? _mm512_add_ps(acc[t], bias) : acc[t]);
}

#define PANEL_INT(name, fmt, wide)                                                             \
    static void name(const Job *job, int64_t p, int64_t t0, int mt, const uint8_t *codes)      \
    {                                                                                          \
        if (mt == MT)                                                                          \
            panel_int(fmt, wide, MT, job, p, t0, codes);                                       \
        else                                                                                   \
            panel_int(fmt, wide, mt, job, p, t0, codes);                                       \
    }
PANEL_INT(amx_i8_q4, FMT_Q4, 0)
PANEL_INT(amx_i8_q8, FMT_Q8, 0)
PANEL_INT(amx_i16_q4, FMT_Q4, 1)
PANEL_INT(amx_i16_q8, FMT_Q8, 1)
PANEL_INT(amx_i12_q4, FMT_Q4, 2)

/* y[t0 .. t0+mt, panels p0 .. p0+np) = the sums a tile pass kept in acc (+ bias). */
INLINE void store_sums(const Job *job, int64_t p0, int np, int64_t t0, int mt, float (*acc)[MT][PANEL])
{
    const int64_t N = job->w.n;
    for (int i = 0; i < np; i++) {
        const __mmask16 m = rows_mask(N, p0 + i);
        const __m512 bias = job->bias ? _mm512_maskz_loadu_ps(m, job->bias + (p0 + i) * PANEL) : _mm512_setzero_ps();
        for (int t = 0; t < mt; t++)
            _mm512_mask_storeu_ps(job->y + (t0 + t) * N + (p0 + i) * PANEL, m,
                                  job->bias ? _mm512_add_ps(_mm512_load_ps(acc[i][t]), bias) : _mm512_load_ps(acc[i][t]));
    }
}

// ----------------------------------------------------------------------------
// F32 activations on AMX-BF16 tiles
//
// x = hi + mid + lo exactly, each part a bf16 (hi: x's first 8 significant bits, mid the next 8 of what
// is left, lo the rest, which fits in 8 bits), and the formats' values are exact in bf16 (q4's q - 8,
// q5's q, q6's q - 32, q8's q, bf16 itself); a tile multiply
// takes each product exactly and adds it to its f32 sum in turn, one rounding an addition, as an FMA
// does. So a 32-k chunk's sum(x q) is the f32 path's dot product, in another order of addition,
// and each chunk is finished as the f32 path finishes a group: acc += s * sum + z * sum(x). (The tiles
// read bf16 subnormals as zero: an x under about 2^-110 in magnitude loses its lo part, 2^-16 of it.)

/* Tiles: sums [MT][16] f32, 0 (even panels) and 2 (odd); x's parts [MT][32] bf16, 4 (hi), 5 (mid),
 * 1 (lo); codes [16 k-pairs][16 rows][2] bf16, 6 (even panels) and 7. */
static void configure_bf16(void)
{
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = i == 6 || i == 7 ? 16 : MT;
        cfg.colsb[i] = 64;
    }
    cfg.rows[3] = 0;
    cfg.colsb[3] = 0;
    load_config(&cfg);
}

/* A q4 panel's codes as bf16 tile rows: row i of a chunk of 8 k holds, for each of the 16 rows, (q - 8)
 * of two k, in the pairs (0, 2), (1, 3), (4, 6), (5, 7): a 16-bit permute looks each code up from its
 * nibble where the layout has it (byte j of a row's 4: k j in the low nibble, j + 4 in the high one),
 * and split_token_bf16 orders x's k alike (Q4_ORDER). */
static void split_q4_bf16(const Job *job, int64_t p, uint16_t *rows)
{
    const int64_t K = job->w.k;
    const uint8_t *src = job->w.codes + p * K * panel_bytes_per_k(FMT_Q4);
    /* bf16 of i - 8 at indices i and i + 16 (the permute reads 5 bits; the 5th is the next nibble's) */
    const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(8)))), 16));
    const __m512i table = _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
    for (int64_t c = 0; c < K / 8; c++) {
        const __m512i v = _mm512_loadu_si512(src + c * 64);  /* 16-bit word 2r: row r's bytes 0, 1; 2r + 1: 2, 3 */
        prefetch_ahead(src + c * 64, 64);
        uint16_t *dst = rows + c * 4 * 32;                    /* 4 rows of 16 x 2 bf16 per chunk of 8 k */
        _mm512_store_si512(dst, _mm512_permutexvar_epi16(v, table));                           /* k 0, 2 */
        _mm512_store_si512(dst + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table));  /* 1, 3 */
        _mm512_store_si512(dst + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));  /* 4, 6 */
        _mm512_store_si512(dst + 96, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table)); /* 5, 7 */
    }
}

/* A q8 panel's codes ([K/4][16 rows][4], each exact in bf16) as bf16 tile rows: row 2c holds each row's
 * k 4c, 4c + 1, row 2c + 1 its k 4c + 2, 4c + 3. */
static void split_q8_bf16(const Job *job, int64_t p, uint16_t *rows)
{
    const int64_t K = job->w.k;
    const uint8_t *src = job->w.codes + p * K * panel_bytes_per_k(FMT_Q8);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t c = 0; c < K / 4; c++) {
        __m512 f[4];
        prefetch_ahead(src + c * 64, 64);
        for (int i = 0; i < 4; i++)
            f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + c * 64 + 16 * i))));
        /* bf16 pairs, rows 0-7 (a) and 8-15 (b), two a row: its k 0, 1 then its k 2, 3 */
        const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), b = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
        _mm512_store_si512(rows + 2 * c * 32, _mm512_permutex2var_epi32(a, even, b));
        _mm512_store_si512(rows + (2 * c + 1) * 32, _mm512_permutex2var_epi32(a, odd, b));
    }
}

/* Any other format's codes as bf16 tile rows, from the f32 values the AVX-512 kernels decode (exact in
 * bf16, so their top 16 bits): row k/2 holds each row's k and k + 1. */
INLINE void split_decoded_bf16(const int fmt, const Job *job, int64_t p, uint16_t *rows)
{
    const int64_t K = job->w.k, bpk = panel_bytes_per_k(fmt);
    const __m512i top = _mm512_set1_epi32((int32_t)0xFFFF0000);
    for (int64_t c = 0; c < K / 8; c++) {
        const uint8_t *chunk = job->w.codes + p * K * bpk + c * 8 * bpk;
        __m512i raw0 = _mm512_setzero_si512(), raw1 = _mm512_setzero_si512();
        load_chunk(fmt, chunk, &raw0, &raw1);
        #pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
            const __m512i a = _mm512_castps_si512(decode_step(fmt, chunk, raw0, raw1, j));
            const __m512i b = _mm512_castps_si512(decode_step(fmt, chunk, raw0, raw1, j + 1));
            _mm512_store_si512(rows + (c * 4 + j / 2) * 32, _mm512_or_si512(_mm512_and_si512(b, top), _mm512_srli_epi32(a, 16)));
        }
    }
}

#define SPLIT_DECODED(fmt)                                                          \
    static void split_decoded_##fmt(const Job *job, int64_t p, uint16_t *rows)      \
    {                                                                               \
        split_decoded_bf16(fmt, job, p, rows);                                      \
    }
SPLIT_DECODED(FMT_Q5)
SPLIT_DECODED(FMT_Q6)
SPLIT_DECODED(FMT_BF16)

/* Token t's parts of x into the three planes of xbf (for q4 codes each 8 k in split_q4_bf16's order),
 * and its sums over each 32 k. */
static void split_token_bf16(const Job *job, int64_t t, int64_t rows)
{
    const int64_t K = job->w.k;
    const float *x = job->x + t * K;
    uint16_t *hi = job->ws.xbf + t * K, *mid = hi + rows * K, *lo = mid + rows * K;
    const __m512i top = _mm512_set1_epi32((int32_t)0xFFFF0000);
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);  /* Q4_ORDER */
    const int q4 = job->w.fmt == FMT_Q4;
    for (int64_t k = 0; k < K; k += 32) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t h = k; h < k + 32; h += 16) {
            const __m512 x16 = _mm512_loadu_ps(x + h), v = q4 ? _mm512_permutexvar_ps(order, x16) : x16;
            sum = _mm512_add_ps(sum, x16);
            const __m512i vh = _mm512_and_si512(_mm512_castps_si512(v), top);
            const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(vh));
            const __m512i rm = _mm512_and_si512(_mm512_castps_si512(r), top);
            const __m512i rl = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(rm)));
            _mm256_storeu_si256((__m256i *)(hi + h), _mm512_cvtepi32_epi16(_mm512_srli_epi32(vh, 16)));
            _mm256_storeu_si256((__m256i *)(mid + h), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rm, 16)));
            _mm256_storeu_si256((__m256i *)(lo + h), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rl, 16)));
        }
        job->ws.xsum32[t * (K / 32) + k / 32] = _mm512_reduce_add_ps(sum);
    }
}

INLINE void panel_products_bf16(const int odd, const uint16_t *codes)
{
    if (!odd) {
        _tile_zero(0);
        _tile_loadd(6, codes, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 6);
        _tile_dpbf16ps(0, 1, 6);
    } else {
        _tile_zero(2);
        _tile_loadd(7, codes, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(2, 5, 7);
        _tile_dpbf16ps(2, 1, 7);
    }
}

/* acc[t] (+)= chunk c's sums * s + z * sum(x over the chunk), tokens t0 .. t0+mt, panel p; `at`: the
 * index of the panel's scales for the chunk's group (group_params_at). */
INLINE void chunk_finish_f32(const int fmt, const int mt, const Job *job, int64_t at, int64_t t0, int64_t c,
                             float (*sums)[PANEL], float (*acc)[PANEL])
{
    const int64_t nc = job->w.k / 32;
    __m512 s, z = _mm512_setzero_ps();
    group_params_at(fmt, &job->w, at, &s, &z);
    const float *xs = job->ws.xsum32 + t0 * nc + c;
    #pragma GCC unroll 16
    for (int t = 0; t < mt; t++) {
        __m512 a = c ? _mm512_load_ps(acc[t]) : _mm512_setzero_ps();
        a = _mm512_fmadd_ps(_mm512_load_ps(sums[t]), s, a);
        if (has_zeros(fmt))
            a = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[t * nc]), a);
        _mm512_store_ps(acc[t], a);
    }
}

/* y[t0 .. t0+mt, panels p0 .. p0+np) for f32 activations, as tiles_int: per 32 k, x's three tiles
 * once, then each panel's products, stored a panel later and finished two panels later. */
INLINE void tiles_f32(const int fmt, const Job *job, int64_t p0, int np, int64_t t0, int mt,
                      const uint16_t *const *codes)
{
    const int64_t K = job->w.k, nc = K / 32, rows = ceil_div(job->t, MT) * MT;
    const int64_t groups = K / job->w.group, chunks = job->w.group / 32;  /* 32-k chunks a group */
    float sums[2][MT][PANEL] __attribute__((aligned(64)));
    float acc[AMX_PANELS][MT][PANEL] __attribute__((aligned(64)));
    const uint16_t *xh = job->ws.xbf + t0 * K, *xm = xh + rows * K, *xl = xm + rows * K;
    for (int64_t c = 0; c < nc; c++) {
        const int64_t g = c / chunks;  /* one division a chunk, not one a panel */
        _tile_loadd(4, xh + c * 32, K * 2);
        _tile_loadd(5, xm + c * 32, K * 2);
        _tile_loadd(1, xl + c * 32, K * 2);
        for (int i = 0; i < np + 2; i++) {
            if (i < np)
                (i & 1) ? panel_products_bf16(1, codes[i] + c * 16 * 32) : panel_products_bf16(0, codes[i] + c * 16 * 32);
            if (i >= 1 && i <= np) {
                if ((i - 1) & 1)
                    _tile_stored(2, sums[1], 64);
                else
                    _tile_stored(0, sums[0], 64);
            }
            if (i >= 2) {
                const int64_t at = ((p0 + i - 2) * groups + g) * PANEL;
                if (mt == MT)
                    chunk_finish_f32(fmt, MT, job, at, t0, c, sums[i & 1], acc[i - 2]);
                else
                    chunk_finish_f32(fmt, mt, job, at, t0, c, sums[i & 1], acc[i - 2]);
            }
        }
    }
    store_sums(job, p0, np, t0, mt, acc);
}

#define TILES_F32(fmt)                                                                                      \
    static void tiles_f32_##fmt(const Job *job, int64_t p0, int np, int64_t t0, int mt, const uint16_t *const *codes) \
    {                                                                                                       \
        tiles_f32(fmt, job, p0, np, t0, mt, codes);                                                         \
    }
TILES_F32(FMT_Q4)
TILES_F32(FMT_Q8)
TILES_F32(FMT_Q5)
TILES_F32(FMT_Q6)
TILES_F32(FMT_BF16)

static void amx_compute_f32(Job *job, int tid, int nt)
{
    const int64_t K = job->w.k;
    void (*split)(const Job *, int64_t, uint16_t *);
    void (*tiles)(const Job *, int64_t, int, int64_t, int, const uint16_t *const *);
    switch (job->w.fmt) {
    case FMT_Q4: split = split_q4_bf16, tiles = tiles_f32_FMT_Q4; break;
    case FMT_Q8: split = split_q8_bf16, tiles = tiles_f32_FMT_Q8; break;
    case FMT_Q5: split = split_decoded_FMT_Q5, tiles = tiles_f32_FMT_Q5; break;
    case FMT_Q6: split = split_decoded_FMT_Q6, tiles = tiles_f32_FMT_Q6; break;
    default: split = split_decoded_FMT_BF16, tiles = tiles_f32_FMT_BF16; break;
    }
    uint16_t *rows = (uint16_t *)job->ws.wrows + (size_t)tid * AMX_PANELS * K * PANEL;
    configure_bf16();
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    const int64_t pass = pass_tokens(3 * 2 * K, MT);  /* x's three bf16 parts */
    for (int64_t t1 = 0; t1 < job->t; t1 += pass) {
        const int64_t t2 = t1 + pass < job->t ? t1 + pass : job->t;
        for (int64_t p0 = lo; p0 < hi; p0 += AMX_PANELS) {
            const int np = (int)(hi - p0 < AMX_PANELS ? hi - p0 : AMX_PANELS);
            const uint16_t *codes[AMX_PANELS];
            for (int i = 0; i < np; i++) {
                split(job, p0 + i, rows + i * K * PANEL);
                codes[i] = rows + i * K * PANEL;
            }
            for (int64_t t0 = t1; t0 < t2; t0 += MT)
                tiles(job, p0, np, t0, (int)(t2 - t0 < MT ? t2 - t0 : MT), codes);
        }
    }
    _tile_release();
}

/* f32 activations bound for the tiles: x's bf16 parts and chunk sums; every other job: avx512's. */
void amx_prepare(Job *job, int tid, int nt)
{
    if (!job->ws.xbf) {
        avx512_prepare(job, tid, nt);
        return;
    }
    int64_t lo, hi;
    thread_range(job->t, tid, nt, &lo, &hi);
    for (int64_t t = lo; t < hi; t++)
        split_token_bf16(job, t, ceil_div(job->t, MT) * MT);
}

/* Each thread a contiguous range of panels, each (q4: its codes split into tile rows first) against every
 * tile of MT tokens of a pass (pass_tokens). */
static void amx_compute(Job *job, int tid, int nt)
{
    if (job->ws.xbf) {
        amx_compute_f32(job, tid, nt);
        return;
    }
    if (!job->ws.xhi) {
        avx512_compute(job, tid, nt);
        return;
    }
    const int64_t K = job->w.k, bpk = panel_bytes_per_k(job->w.fmt);
    const int q4 = job->w.fmt == FMT_Q4, wide = act_wide(job->act), joined = amx_joined(job);
    void (*fn)(const Job *, int64_t, int64_t, int, const uint8_t *) =
        joined ? amx_i12_q4 : wide ? (q4 ? amx_i16_q4 : amx_i16_q8) : (q4 ? amx_i8_q4 : amx_i8_q8);
    uint8_t *rows = q4 ? job->ws.wrows + (size_t)tid * K * PANEL * (joined ? 2 : 1) : NULL;
    configure(job->blk, joined ? 2 : wide);
    int64_t lo, hi;
    thread_range(job->w.panels, tid, nt, &lo, &hi);
    const int64_t pass = pass_tokens(wide ? 2 * K : K, MT);  /* int16 and int12: two bytes a k */
    for (int64_t t1 = 0; t1 < job->t; t1 += pass) {
        const int64_t t2 = t1 + pass < job->t ? t1 + pass : job->t;
        for (int64_t p = lo; p < hi; p++) {
            if (joined)
                split_q4_joined(job, p, rows);
            else if (q4)
                split_q4(job, p, rows);  /* 16 K bytes: in L1 for every tile of tokens */
            const uint8_t *codes = q4 ? rows : job->w.codes + p * K * bpk;
            for (int64_t t0 = t1; t0 < t2; t0 += MT)
                fn(job, p, t0, (int)(t2 - t0 < MT ? t2 - t0 : MT), codes);
        }
    }
    _tile_release();
}

#pragma GCC pop_options

const Kernels KERNELS_AMX = {"amx", amx_prepare, amx_compute, DIRECT_T};
