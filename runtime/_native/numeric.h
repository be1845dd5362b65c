/* Numeric helpers shared by the runtime's C modules (static inline: each file gets its own copy):
 * scalar conversions between float32 and the f16, bf16 and e4m3 element types, and AVX2 + FMA
 * vector math. */
#ifndef KILN_NUMERIC_H
#define KILN_NUMERIC_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------
 * Scalar conversions
 */

static inline float f16_to_f32(uint16_t h) {
    return _cvtsh_ss(h);
}

static inline uint16_t f32_to_f16(float x) {
    return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Round to nearest even; a NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (isnan(x))
        return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* e4m3 code -> f32, exactly, reading every code as finite (S.1111.111 gives +-480; e4m3fn
 * spends it on NaN, which a caller that stores such codes maps itself). */
static inline float e4m3_to_f32(uint8_t code) {
    const int e = (code >> 3) & 15, m = code & 7;
    const float mag = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
    return (code & 0x80) ? -mag : mag;
}

/* Saturating round-to-nearest-even float -> e4m3fn (max 448, no infinities). */
static inline uint8_t f32_to_e4m3(float x) {
    if (isnan(x))
        return 0x7F;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float magnitude = fabsf(x);
    if (magnitude >= 448.0f)
        return sign | 0x7E;
    if (magnitude < 0.015625f)  /* below 2^-6: subnormals, steps of 2^-9 */
        return sign | (uint8_t)nearbyintf(magnitude * 512.0f);
    uint32_t bits;
    memcpy(&bits, &magnitude, 4);
    bits += 0x7FFFF + ((bits >> 20) & 1);  /* round 23 mantissa bits to 3, ties to even */
    uint32_t exponent = (bits >> 23) - 127 + 7;
    return sign | (uint8_t)((exponent << 3) | ((bits >> 20) & 0x7));
}

/* ------------------------------------------------------------------------------------------
 * AVX2 + FMA vector math
 */

static inline float hsum256(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

/* exp256's and exp512's constants, named once so that the two stay in step: the argument's clamp, log2(e),
 * ln 2 in two parts (Cody-Waite), and the polynomial's coefficients. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* exp(x) for x in [-87, 88]: Cody-Waite reduction by ln 2 and the Cephes degree-6 polynomial
 * (relative error ~1e-7, same as expf for softmax purposes). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* exp256 sixteen lanes at a time, for CPUs with AVX-512: each lane takes exp256's operations, so it gives exp256's
 * values bit for bit (keep the two in step). */
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* out[:n] = weight * x * 1 / sqrt(mean(x^2) + eps): the rms_norm row kernel, shared by the row ops and the
 * fused attention's q/k norms so that both round alike. */
static inline void rms_norm_row(float *out, const float *x, const float *weight, int n, float eps) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    float sum = hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++)
        sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv)));
    for (; i < n; i++)
        out[i] = weight[i] * (x[i] * inv);
}

#endif
