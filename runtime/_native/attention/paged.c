/* Paged attention over the KV cache (streaming softmax over chunks of keys): the work items, the general path
 * (any head size: a tile of queries, one query head at a time) and the entry point that shares the items out;
 * decode.c holds the path of one query at a time and of all a kv head's query heads at once. */
#include "paged.h"

static void free_scratch(Scratch *scratch, int num_threads) {
    for (int i = 0; i < num_threads; i++)
        free(scratch[i].acc);
    free(scratch);
}

/* n floats rounded up to whole 64-byte cache lines, so that every scratch array starts on one */
static size_t cache_lines(size_t n) {
    return (n + 15) & ~(size_t)15;
}

static Scratch *build_scratch(int num_threads, int max_rows, int hd) {
    Scratch *scratch = aligned_alloc(64, sizeof(Scratch) * (size_t)num_threads);
    if (!scratch)
        return NULL;
    size_t acc = cache_lines((size_t)max_rows * hd), rows = cache_lines(max_rows);
    size_t scores = cache_lines((size_t)max_rows * KEY_CHUNK), decoded = cache_lines((size_t)KEY_CHUNK * hd);
    for (int i = 0; i < num_threads; i++) {
        Scratch *s = &scratch[i];
        s->acc = aligned_alloc(64, sizeof(float) * (3 * acc + 2 * rows + scores + 2 * decoded));
        if (!s->acc) {
            free_scratch(scratch, i);
            return NULL;
        }
        s->row_max = s->acc + acc;
        s->row_sum = s->row_max + rows;
        s->scores = s->row_sum + rows;
        s->k_decoded = s->scores + scores;
        s->v_decoded = s->k_decoded + decoded;
        s->q2 = s->v_decoded + decoded;  /* 2 acc: max_rows x 2 hd floats */
    }
    return scratch;
}

/* Counts work items; with items != NULL also fills them, the costliest (last) tile of each
 * sequence first so that dynamic scheduling balances causal prefill. */
static Py_ssize_t build_work_items(const AttentionArgs *a, int whole_seqs, WorkItem *items) {
    Py_ssize_t count = 0;
    int tile = a->queries_per_tile;
    for (int s = 0; s < a->num_seqs; s++) {
        int qlen = seq_query_len(a, s);
        if (qlen == 1 && whole_seqs) {
            if (items)
                items[count] = (WorkItem){s, 0, a->num_kv_heads, 0, 1};
            count++;
            continue;
        }
        for (int q_begin = ((qlen - 1) / tile) * tile; qlen > 0 && q_begin >= 0; q_begin -= tile)
            for (int g = 0; g < a->num_kv_heads; g++, count++)
                if (items) {
                    int q_end = q_begin + tile < qlen ? q_begin + tile : qlen;
                    items[count] = (WorkItem){s, g, 1, q_begin, q_end};
                }
    }
    return count;
}

/* ----------------------------------------------------------------------------------------
 * Paged attention: one work item, the general path
 */

static void attend_work_item(const AttentionArgs *a, const WorkItem *w, Scratch *scratch) {
    int hd = a->head_dim, ratio = a->num_heads / a->num_kv_heads;
    int rows = (w->q_end - w->q_begin) * ratio;
    int token0 = a->query_start_loc[w->seq];
    int first_pos = a->context_lens[w->seq] - seq_query_len(a, w->seq);  /* position of query 0 */
    int num_keys = first_pos + w->q_end;  /* keys seen by the tile's last query */
    /* Chunks start at multiples of KEY_CHUNK whatever the window, as on the single-query path. */
    int keys_from = first_visible_key(a, first_pos + w->q_begin) / KEY_CHUNK * KEY_CHUNK;
    const int32_t *table = a->block_tables + (size_t)w->seq * a->max_blocks;

    start_rows(scratch, rows, hd);
    prefetch_key_chunk(a, table, w->kv_head, keys_from,
                       num_keys - keys_from < KEY_CHUNK ? num_keys - keys_from : KEY_CHUNK);
    for (int key_begin = keys_from; key_begin < num_keys; key_begin += KEY_CHUNK) {
        int chunk = num_keys - key_begin < KEY_CHUNK ? num_keys - key_begin : KEY_CHUNK;
        int next = key_begin + KEY_CHUNK;
        if (next < num_keys)
            prefetch_key_chunk(a, table, w->kv_head, next, num_keys - next < KEY_CHUNK ? num_keys - next : KEY_CHUNK);
        load_key_chunk(a, table, w->kv_head, key_begin, chunk, scratch);
        for (int r = 0; r < rows; r++) {
            int j = w->q_begin + r / ratio, head = w->kv_head * ratio + r % ratio;
            int visible = first_pos + j + 1 - key_begin;  /* causal limit within the chunk */
            int skip = first_visible_key(a, first_pos + j) - key_begin;  /* window start within it */
            skip = skip > 0 ? skip : 0;
            int end = visible < chunk ? visible : chunk;
            if (end <= skip)
                continue;
            const float *q = a->query + ((size_t)(token0 + j) * a->num_heads + head) * hd;
            attend_chunk_row(q, skip, end - skip, a->scale, hd, scratch,
                             scratch->acc + (size_t)r * hd, &scratch->row_max[r], &scratch->row_sum[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        int j = w->q_begin + r / ratio, head = w->kv_head * ratio + r % ratio;
        float *o = a->out + ((size_t)(token0 + j) * a->num_heads + head) * hd;
        float inv_sum = 1.0f / scratch->row_sum[r];
        for (int d = 0; d < hd; d++)
            o[d] = scratch->acc[(size_t)r * hd + d] * inv_sum;
    }
}


int paged_attention_compute(const AttentionArgs *a, int num_threads) {
    /* A decoding sequence is one item, all its kv heads, when there are enough sequences to keep every thread
     * busy: its heads' rows lie side by side in each slot, so the item reads whole runs of cache lines. */
    int single_query_path = a->head_dim % 8 == 0;
    int whole_seqs = single_query_path && a->num_seqs >= WHOLE_SEQ_ITEMS_PER_THREAD * num_threads;
    Py_ssize_t num_items = build_work_items(a, whole_seqs, NULL);
    if (num_items == 0)
        return 0;
    int ratio = a->num_heads / a->num_kv_heads, tile_rows = a->queries_per_tile * ratio;
    WorkItem *items = malloc(sizeof(WorkItem) * (size_t)num_items);
    Scratch *scratch = build_scratch(num_threads, tile_rows > a->num_heads ? tile_rows : a->num_heads, a->head_dim);
    if (!items || !scratch) {
        free(items);
        if (scratch) free_scratch(scratch, num_threads);
        return -1;
    }
    build_work_items(a, whole_seqs, items);
    /* Items are claimed one ahead of their turn (dynamic scheduling otherwise), so that each thread can ask
     * for its next item's first keys while it works on the last keys of the current one. */
    Py_ssize_t claimed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        Scratch *own = &scratch[omp_get_thread_num()];
        Py_ssize_t i = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        int first_asked = 0;  /* whether the item before asked for item i's first chunk spread over its own last */
        while (i < num_items) {
            Py_ssize_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const WorkItem *ahead = next < num_items ? &items[next] : NULL;
            if (items[i].q_end - items[i].q_begin == 1 && single_query_path) {
                attend_single_query(a, &items[i], ahead, first_asked, own);
                first_asked = spreads_ahead(&items[i], ahead);
            } else {
                if (single_query_path)
                    attend_work_item_heads(a, &items[i], own);
                else
                    attend_work_item(a, &items[i], own);
                first_asked = 0;
            }
            i = next;
        }
    }
    free_scratch(scratch, num_threads);
    free(items);
    return 0;
}

