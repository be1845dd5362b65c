/* Internal interface of the attention kernels: the cache element types, the arguments of each
 * computation, and the entry points the bindings (module.c) call.
 *
 * A cache is [num_blocks, block_size, num_kv_heads, head_dim] of one element type (the
 * CacheDtype codes below); i8 and f8e4m3 caches store x / kv_scale and read back q * kv_scale.
 * Queries, outputs and all arithmetic are float32. The kernels run with the GIL released, with
 * OpenMP over (sequence, kv head, query tile) work items, on arguments module.c has checked.
 */
#ifndef KILN_ATTENTION_KERNELS_H
#define KILN_ATTENTION_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef enum {
    CACHE_F32 = 0,
    CACHE_BF16 = 1,
    CACHE_F16 = 2,
    CACHE_I8 = 3,
    CACHE_F8E4M3 = 4,
    CACHE_NUM_DTYPES = 5
} CacheDtype;

static const int cache_elem_size[CACHE_NUM_DTYPES] = {4, 2, 2, 1, 1};

typedef struct {
    const float *key;              /* [T, nkv, hd] */
    const float *value;            /* [T, nkv, hd] */
    uint8_t *k_cache;              /* [num_slots, nkv, hd] cache elements */
    uint8_t *v_cache;              /* [num_slots, nkv, hd] cache elements */
    const int64_t *slot_mapping;   /* [T], -1 = skip */
    Py_ssize_t num_tokens;         /* T */
    Py_ssize_t num_slots;          /* num_blocks * block_size */
    int row_size;                  /* nkv * hd */
    int cache_dtype;               /* CacheDtype */
    float kv_scale;                /* quantization scale of i8/f8 caches */
} KVWriteArgs;

#define ROWS_PER_TILE 32  /* target (query, head) rows per prefill work item */

typedef struct {
    const float *query;              /* [T, nh, hd] */
    float *out;                      /* [T, nh, hd] */
    const uint8_t *k_cache;          /* [num_blocks, block_size, nkv, hd] cache elements */
    const uint8_t *v_cache;          /* [num_blocks, block_size, nkv, hd] cache elements */
    const int32_t *block_tables;     /* [S, max_blocks] */
    const int32_t *context_lens;     /* [S] */
    const int32_t *query_start_loc;  /* [S + 1] */
    int num_seqs;                    /* S */
    int max_blocks;                  /* block table width */
    int num_heads;                   /* nh */
    int num_kv_heads;                /* nkv */
    int head_dim;                    /* hd */
    int block_size;                  /* slots per block */
    int queries_per_tile;            /* queries of one sequence per work item */
    int cache_dtype;                 /* CacheDtype */
    float kv_scale;                  /* dequantization scale of i8/f8 caches */
    float scale;                     /* softmax scale on q . k */
    int window;                      /* sliding window: a query at position p sees keys p - window + 1 .. p;
                                        0 = every earlier key */
} AttentionArgs;

/* The first key position a query at position pos attends to. */
static inline int first_visible_key(const AttentionArgs *a, int pos) {
    return a->window > 0 && pos >= a->window ? pos + 1 - a->window : 0;
}

typedef struct {
    /* q [T, nh * hd], k and v [T, nkv * hd], row t at q + t * q_stride (...): the parts of one fused
     * projection [T, (nh + 2 nkv) * hd] (stride its row), or three projections' own rows */
    const float *q, *k, *v;
    Py_ssize_t q_stride, k_stride, v_stride;  /* floats between consecutive rows */
    const int64_t *positions;  /* [T] */
    const float *rope;         /* [rope_rows, hd]: cos(pos * inv_freq) | sin(pos * inv_freq), hd/2 each */
    const int64_t *slot_mapping;  /* [T], -1 = skip the write */
    const float *q_norm;       /* [hd] RMSNorm weight of every q head, applied before the rotation; NULL: none */
    const float *k_norm;       /* [hd] the same for every k head (Gemma 3's q/k norms) */
    float norm_eps;            /* eps of both norms */
    Py_ssize_t num_tokens;
    Py_ssize_t rope_rows;
} RopeKVArgs;

/* cache.c */
extern float f8e4m3_table[256];  /* the float value of every e4m3fn byte */
void build_f8e4m3_table(void);
void detect_avx512(void);     /* paged.c: whether the single-query path adds values with AVX-512 (module init) */
int use_avx512(int on);       /* paged.c: the AVX-512 kernels where the CPU has them (on), else AVX2's; returns which */
void decode_rows(float *dst, const uint8_t *src, int rows, size_t src_stride, int n, int dtype, float kv_scale);
void encode_row(void *dst, const float *src, int n, int dtype, float kv_scale);
void kv_write_compute(const KVWriteArgs *a, int num_threads);

/* paged.c: 0, or -1 when scratch memory could not be allocated */
int paged_attention_compute(const AttentionArgs *a, int num_threads);
int qkv_attention_compute(const RopeKVArgs *r, AttentionArgs *a, int num_threads);

#endif
