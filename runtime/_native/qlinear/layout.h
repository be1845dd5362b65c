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
 *   q8  : int8   [K/4][16][4]  q[r][4kb+j], -128..127 (the VNNI order: 4 k of one row per 32 bits)
 *   f8  : uint8  [K][16]       e4m3 code (finite codes only)
 *   bf16: uint16 [K][16]       bf16 bits
 * so a panel holds 16 * bits / 8 bytes per k step (panel_bytes_per_k).
 *
 * Scales: [P][K/G][16] f32 or f16 (scales_f16), one per row and group of G columns; per-channel
 * scales have G = K. bf16 weights have none. q4 also has zeros of the same shape: the zero
 * point z as f32, or, when stored as f16, the min m = z - 8 * s (the value of code 0).
 *
 * Dequantized weight of (n, k), g = k / G:
 *   q4 (q - 8) * s + z,   q8 q * s,   f8 e4m3(q) * s,   bf16 as is.
 */
#ifndef KILN_QLINEAR_LAYOUT_H
#define KILN_QLINEAR_LAYOUT_H

#include <stdint.h>

enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_F8 = 2, FMT_BF16 = 3 };

#define PANEL 16  /* output rows per stored panel */

typedef struct {
    int fmt;
    const uint8_t *codes;   /* [P][panel codes], layouts above */
    const void *scales;     /* [P][K/G][16] f32 or f16; NULL for bf16 */
    const void *zeros;      /* q4: [P][K/G][16] zeros (f32) or mins (f16); else NULL */
    int scales_f16;
    int64_t n, k, group;    /* N, K, G (G = K for per-channel) */
    int64_t panels;         /* P = ceil(N / 16) */
} Weight;

static inline int bits_of(int fmt) { return fmt == FMT_Q4 ? 4 : fmt == FMT_BF16 ? 16 : 8; }

/* Bytes of one panel's codes per k step: 16 rows * bits / 8. */
static inline int64_t panel_bytes_per_k(int fmt) { return 2 * bits_of(fmt); }

#endif
