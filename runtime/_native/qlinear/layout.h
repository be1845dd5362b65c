/* The packed weight layout of the qlinear kernels: formats, panels, codes, scales and zeros.
 * This is the one description of the layout; runtime/weights/ packs weights into it and every
 * kernel path (portable.c, avx2.c, avx512.c) reads it.
 *
 * A linear computes y[T, N] = x[T, K] @ W[N, K]^T (+ bias[N]). W is stored in panels of
 * PANEL = 16 output rows, so that one k step of a panel is one 512-bit vector of f32 (or two
 * 256-bit ones); N is padded with zero rows to P * 16, P = ceil(N / 16). Panel p holds rows
 * 16p .. 16p+15 (r = n % 16 below), all K columns, and the panels follow each other.
 *
 * Codes of one panel, by format (K is a multiple of 8):
 *   q4  : uint8  [K/8][16][4]  byte (r, j) of k-block kb holds q[r][8kb+j] | q[r][8kb+4+j] << 4,
 *                              q in 0..15 (low nibbles: k steps 0..3, high nibbles: 4..7)
 *   q5  : uint8  [K/8][80]     per k-block kb: its 64 bytes of low nibbles laid out as q4's, then 16
 *                              bytes of bit 4: byte r holds bit 4 of q[r][8kb+j] at bit j; q in 0..31
 *   q6  : uint8  [K/8][96]     per k-block kb: its 64 bytes of low nibbles laid out as q4's, then 32
 *                              bytes of bits 4-5: row r's little-endian uint16 (bytes 2r, 2r+1) holds
 *                              them for q[r][8kb+j] at bits 2j, 2j+1; q in 0..63
 *   q8  : int8   [K/4][16][4]  q[r][4kb+j], -128..127 (the VNNI order: 4 k of one row per 32 bits)
 *   f8  : uint8  [K][16]       e4m3 code (finite codes only)
 *   bf16: uint16 [K][16]       bf16 bits
 * so a panel holds 16 * bits / 8 bytes per k step (panel_bytes_per_k).
 *
 * Scales: [P][K/G][16] f32 or f16 (scales_f16), one per row and group of G columns; per-channel
 * scales have G = K. bf16 weights have none. q4 also has zeros of the same shape: the zero
 * point z as f32, or, when stored as f16, the min m = z - 8 * s (the value of code 0). q5 has
 * mins m (the value of code 0) of the same shape and dtype as its scales.
 *
 * Dequantized weight of (n, k), g = k / G, each rounded once to f32:
 *   q4 (q - 8) * s + z,   q5 fma(q, s, m),   q6 (q - 32) * s,   q8 q * s,   f8 e4m3(q) * s,   bf16 as is.
 * The q5 and q6 codes hold GGUF's Q5_0, Q5_1, Q5_K and Q6_K blocks exactly (builder/sources/gguf_blocks.py).
 */
#ifndef KILN_QLINEAR_LAYOUT_H
#define KILN_QLINEAR_LAYOUT_H

#include <stdint.h>

enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_F8 = 2, FMT_BF16 = 3, FMT_Q5 = 4, FMT_Q6 = 5 };

#define PANEL 16  /* output rows per stored panel */

typedef struct {
    int fmt;
    const uint8_t *codes;   /* [P][panel codes], layouts above */
    const void *scales;     /* [P][K/G][16] f32 or f16; NULL for bf16 */
    const void *zeros;      /* q4: [P][K/G][16] zeros (f32) or mins (f16); q5: mins; else NULL */
    int scales_f16;
    int64_t n, k, group;    /* N, K, G (G = K for per-channel) */
    int64_t panels;         /* P = ceil(N / 16) */
} Weight;

static inline int bits_of(int fmt)
{
    switch (fmt) {
    case FMT_Q4: return 4;
    case FMT_Q5: return 5;
    case FMT_Q6: return 6;
    case FMT_BF16: return 16;
    default: return 8;
    }
}

/* Formats with a second per-group array (`zeros`): an offset term that the kernels add per group. */
static inline int has_zeros(int fmt) { return fmt == FMT_Q4 || fmt == FMT_Q5; }

/* Bytes of one panel's codes per k step: 16 rows * bits / 8. */
static inline int64_t panel_bytes_per_k(int fmt) { return 2 * bits_of(fmt); }

#endif
