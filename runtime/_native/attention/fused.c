/* The fused step of one attention layer (rotary embedding, KV write, paged attention) from its projections. */
#include "kernels.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include "../numeric.h"

/* ----------------------------------------------------------------------------------------
 * Fused step of one attention layer: per-head q/k norms when the model has them, rotary
 * embedding, KV write and paged attention, reading q, k and v straight from the fused qkv
 * projection [T, (nh + 2 nkv) * hd], or from the q, k and v projections' own rows.
 */

/* out[d] = x[d] cos[d] - x[d + h] sin[d], out[d + h] = x[d + h] cos[d] + x[d] sin[d]: the
 * rotate-half form of Hugging Face Llama, evaluated in the same order (no contraction in c11). */
static void rotate_head(float *out, const float *x, const float *cs, int hd) {
    int half = hd / 2;
    const float *c = cs, *sn = cs + half;
    for (int d = 0; d < half; d++) {
        float x0 = x[d], x1 = x[d + half];
        out[d] = x0 * c[d] + (-x1) * sn[d];
        out[d + half] = x1 * c[d] + x0 * sn[d];
    }
}

/* rotate_head of x, or with a norm weight [hd] of rms_norm_row(x) (the rms_norm op's row kernel, so that
 * the fused call rounds as head_rms_norm then rope do), normalized into normed [hd]. */
static void norm_rotate_head(float *out, const float *x, const float *norm, float eps, const float *cs, int hd,
                             float *normed) {
    if (norm) {
        rms_norm_row(normed, x, norm, hd, eps);
        x = normed;
    }
    rotate_head(out, x, cs, hd);
}

/* Rotates q into query [T, nh, hd], rotates k and writes it and v into their cache slots. */
static int rope_kv_write_compute(const RopeKVArgs *r, const AttentionArgs *a, float *query, int num_threads) {
    int nh = a->num_heads, nkv = a->num_kv_heads, hd = a->head_dim, dtype = a->cache_dtype;
    size_t row = (size_t)(nh + 2 * nkv) * hd, kv_row = (size_t)nkv * hd;
    size_t row_bytes = kv_row * cache_elem_size[dtype];
    float *k_rot = malloc(sizeof(float) * (kv_row + hd) * (size_t)num_threads);  /* per thread: k | normed head */
    if (!k_rot)
        return -1;
    int parallel = r->num_tokens * (Py_ssize_t)row >= (1 << 15);
    uint8_t *k_cache = (uint8_t *)a->k_cache, *v_cache = (uint8_t *)a->v_cache;
    #pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (Py_ssize_t t = 0; t < r->num_tokens; t++) {
        const float *q_in = r->q + (size_t)t * r->q_stride, *k_in = r->k + (size_t)t * r->k_stride;
        const float *cs = r->rope + (size_t)r->positions[t] * hd;
        float *k = k_rot + (kv_row + hd) * (size_t)omp_get_thread_num(), *normed = k + kv_row;
        for (int h = 0; h < nh; h++)
            norm_rotate_head(query + ((size_t)t * nh + h) * hd, q_in + (size_t)h * hd, r->q_norm, r->norm_eps, cs,
                             hd, normed);
        int64_t slot = r->slot_mapping[t];
        if (slot < 0)
            continue;
        for (int h = 0; h < nkv; h++)
            norm_rotate_head(k + (size_t)h * hd, k_in + (size_t)h * hd, r->k_norm, r->norm_eps, cs, hd, normed);
        encode_row(k_cache + slot * row_bytes, k, (int)kv_row, dtype, a->kv_scale);
        encode_row(v_cache + slot * row_bytes, r->v + (size_t)t * r->v_stride, (int)kv_row, dtype, a->kv_scale);
    }
    free(k_rot);
    return 0;
}

int qkv_attention_compute(const RopeKVArgs *r, AttentionArgs *a, int num_threads) {
    float *query = malloc(sizeof(float) * (size_t)r->num_tokens * a->num_heads * a->head_dim + 1);
    if (!query)
        return -1;
    a->query = query;
    int status = rope_kv_write_compute(r, a, query, num_threads);
    if (status == 0)
        status = paged_attention_compute(a, num_threads);
    free(query);
    return status;
}
