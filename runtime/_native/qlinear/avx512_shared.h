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

INLINE __m512 load16(const void *base, int64_t idx, int f16)
{
    if (f16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx)));
    return _mm512_loadu_ps((const float *)base + idx);
}

/* Scale s and offset z of panel p, weight group g, for 16 rows: q4 the zero point, q5 the min (the
 * value of code 0). f8 scales carry the 2^8 that decode_step leaves out. */
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
    if (fmt == FMT_Q5)
        *z = load16(w->zeros, idx, w->scales_f16);
}

#endif
