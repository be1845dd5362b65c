/* AVX-512 helpers that avx512.c and amx.c share. Included after each file's `#pragma GCC target`,
 * which enables the instructions they use. */
#ifndef KILN_QLINEAR_AVX512_SHARED_H
#define KILN_QLINEAR_AVX512_SHARED_H

#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"

INLINE __mmask16 rows_mask(int64_t n, int64_t p)
{
    const int64_t left = n - p * PANEL;
    return left >= PANEL ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* Software prefetch PREFETCH_BYTES ahead of a streamed chunk of `bytes` (one line per 64 bytes): the
 * decode loops (and the AMX kernels' passes over each panel's codes) read weights once, from DRAM, and
 * the hardware prefetcher alone leaves a single core well short of the memory bandwidth. (Past the end of
 * the weights it asks for lines nothing reads: a prefetch never faults.) */
#define PREFETCH_BYTES 4096
INLINE void prefetch_ahead(const uint8_t *chunk, int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch((const char *)chunk + PREFETCH_BYTES + off, _MM_HINT_T0);
}

INLINE __m512 load16(const void *base, int64_t idx, int f16)
{
    if (f16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx)));
    return _mm512_loadu_ps((const float *)base + idx);
}

/* Scale s and offset z of panel p, weight group g, for 16 rows (group_params_at: at index
 * (p * groups + g) * PANEL): q4 the zero point, q5 the min (the value of code 0). f8 scales carry the
 * 2^8 that decode_step leaves out. */
INLINE void group_params_at(const int fmt, const Weight *w, int64_t idx, __m512 *s, __m512 *z)
{
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
    if (fmt == FMT_Q5)
        *z = load16(w->zeros, idx, w->scales_f16);
}

INLINE void group_params(const int fmt, const Weight *w, int64_t p, int64_t g, __m512 *s, __m512 *z)
{
    group_params_at(fmt, w, (p * (w->k / w->group) + g) * PANEL, s, z);
}

/* q6 code bytes: `nibbles` with bits 4-5 from `pairs` (byte j of a lane: its pair at bits 2j, 2j+1), bit 5
 * flipped, so that a byte's low 6 bits read as signed are q - 32. */
INLINE __m512i q6_bytes(__m512i nibbles, __m512i pairs)
{
    const __m512i v = _mm512_mask_add_epi8(nibbles, _mm512_test_epi8_mask(pairs, _mm512_set1_epi32(0x40100401)),
                                           nibbles, _mm512_set1_epi8(0x10));
    return _mm512_mask_add_epi8(v, _mm512_testn_epi8_mask(pairs, _mm512_set1_epi32((int32_t)0x80200802)), v,
                                _mm512_set1_epi8(0x20));
}

/* A q5/q6 chunk (layout.h) as bytes: byte j of a row's lane is its code of k step j (raw0) or j + 4 (raw1),
 * the low nibble with bits 4 (and 5) added from the row's high-bit bytes, copied into every byte of its
 * lane and tested per byte (bit j of byte j for q5, bits 2j, 2j+1 for q6). Once a chunk, so that a k step
 * decodes in two (q5) or three (q6) instructions. */
INLINE void split_codes(const int fmt, const uint8_t *chunk, __m512i *raw0, __m512i *raw1)
{
    const __m512i nibbles = _mm512_loadu_si512(chunk), low4 = _mm512_set1_epi8(0x0F);
    const __m512i lo = _mm512_and_si512(nibbles, low4), hi = _mm512_and_si512(_mm512_srli_epi32(nibbles, 4), low4);
    const __m512i byte0 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    if (fmt == FMT_Q5) {
        const __m512i bit4 = _mm512_set1_epi8(0x10), bits = _mm512_shuffle_epi8(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(chunk + 64))), byte0);
        *raw0 = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bits, _mm512_set1_epi32(0x08040201)), lo, bit4);
        *raw1 = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bits, _mm512_set1_epi32((int32_t)0x80402010)), hi,
                                     bit4);
        return;
    }
    const __m512i pairs = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(chunk + 64)));
    *raw0 = q6_bytes(lo, _mm512_shuffle_epi8(pairs, byte0));  /* steps 0..3: the pairs' low byte */
    *raw1 = q6_bytes(hi, _mm512_shuffle_epi8(pairs, _mm512_add_epi8(byte0, _mm512_set1_epi8(1))));
}

/* The 512-bit words of an 8-k chunk that decode_step shifts from: q4 one; q8 two; q5 and q6 split_codes'. */
INLINE void load_chunk(const int fmt, const uint8_t *chunk, __m512i *raw0, __m512i *raw1)
{
    if (fmt == FMT_Q4 || fmt == FMT_Q8)
        *raw0 = _mm512_loadu_si512(chunk);
    if (fmt == FMT_Q8)
        *raw1 = _mm512_loadu_si512(chunk + 64);
    if (fmt == FMT_Q5 || fmt == FMT_Q6)
        split_codes(fmt, chunk, raw0, raw1);
}

/* Codes of k step j (0..7) of a chunk as f32 for 16 rows: q4 q - 8, q5 q, q6 q - 32, q8 q, f8
 * value / 2^8, bf16 value. */
INLINE __m512 decode_step(const int fmt, const uint8_t *chunk, __m512i raw0, __m512i raw1, const int j)
{
    if (fmt == FMT_Q4) {
        const int shift = (j & 3) * 8 + (j >> 2) * 4;  /* low nibbles: steps 0..3, high: 4..7 */
        const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(raw0, shift) : raw0, table);
    }
    if (fmt == FMT_Q5 || fmt == FMT_Q6) {
        const __m512i bytes = j < 4 ? raw0 : raw1;
        const int byte = 8 * (j & 3);
        if (fmt == FMT_Q6)
            return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(bytes, 26 - byte), 26));
        /* q5: 32-entry table, indexed by a lane's low 5 bits */
        const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 high = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
        return _mm512_permutex2var_ps(low, byte ? _mm512_srli_epi32(bytes, byte) : bytes, high);
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

#endif
