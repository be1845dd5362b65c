/* Cache rows: conversion between a cache row of any element type and float32, and the KV write
 * that scatters key/value rows into their slots. */
#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "../numeric.h"

float f8e4m3_table[256];  /* [256] float value of every e4m3fn byte, built at import */

/* e4m3fn spends S.1111.111 on NaN. */
void build_f8e4m3_table(void) {
    for (int i = 0; i < 256; i++)
        f8e4m3_table[i] = (i & 0x7F) == 0x7F ? ((i & 0x80) ? -NAN : NAN) : e4m3_to_f32((uint8_t)i);
}

static int8_t i8_encode(float x, float kv_scale) {
    float q = nearbyintf(x / kv_scale);
    q = fminf(fmaxf(q, -127.0f), 127.0f);
    return (int8_t)q;
}

/* ----------------------------------------------------------------------------------------
 * Row conversion between a cache row and float32
 */

static void decode_bf16(float *dst, const uint16_t *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; i < n; i++) {
        dst[i] = bf16_to_f32(src[i]);
    }
}

static void decode_f16(float *dst, const uint16_t *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = f16_to_f32(src[i]);
}

static void decode_i8(float *dst, const int8_t *src, int n, float kv_scale) {
    __m256 scale = _mm256_set1_ps(kv_scale);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), scale));
    }
    for (; i < n; i++)
        dst[i] = (float)src[i] * kv_scale;
}

static void decode_f8e4m3(float *dst, const uint8_t *src, int n, float kv_scale) {
    __m256 scale = _mm256_set1_ps(kv_scale);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        __m256 value = _mm256_i32gather_ps(f8e4m3_table, index, 4);
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(value, scale));
    }
    for (; i < n; i++)
        dst[i] = f8e4m3_table[src[i]] * kv_scale;
}

/* dst: [rows, n] float32; src: rows of n cache elements, src_stride elements apart */
void decode_rows(float *dst, const uint8_t *src, int rows, size_t src_stride, int n, int dtype,
                        float kv_scale) {
    size_t step = src_stride * cache_elem_size[dtype];
    for (int r = 0; r < rows; r++, dst += n, src += step)
        switch (dtype) {
        case CACHE_F32: memcpy(dst, src, (size_t)n * 4); break;
        case CACHE_BF16: decode_bf16(dst, (const uint16_t *)src, n); break;
        case CACHE_F16: decode_f16(dst, (const uint16_t *)src, n); break;
        case CACHE_I8: decode_i8(dst, (const int8_t *)src, n, kv_scale); break;
        case CACHE_F8E4M3: decode_f8e4m3(dst, src, n, kv_scale); break;
        }
}

/* dst: [n] cache elements; src: [n] float32 */
void encode_row(void *dst, const float *src, int n, int dtype, float kv_scale) {
    switch (dtype) {
    case CACHE_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case CACHE_BF16:
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
        break;
    case CACHE_F16:
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_f16(src[i]);
        break;
    case CACHE_I8:
        for (int i = 0; i < n; i++) ((int8_t *)dst)[i] = i8_encode(src[i], kv_scale);
        break;
    case CACHE_F8E4M3:
        for (int i = 0; i < n; i++) ((uint8_t *)dst)[i] = f32_to_e4m3(src[i] / kv_scale);
        break;
    }
}

void kv_write_compute(const KVWriteArgs *a, int num_threads) {
    size_t row_bytes = (size_t)a->row_size * cache_elem_size[a->cache_dtype];
    int parallel = a->num_tokens * a->row_size >= (1 << 16);
    #pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (Py_ssize_t t = 0; t < a->num_tokens; t++) {
        int64_t slot = a->slot_mapping[t];
        if (slot < 0)
            continue;
        size_t src = (size_t)t * a->row_size;
        encode_row(a->k_cache + slot * row_bytes, a->key + src, a->row_size, a->cache_dtype, a->kv_scale);
        encode_row(a->v_cache + slot * row_bytes, a->value + src, a->row_size, a->cache_dtype, a->kv_scale);
    }
}
