"""Paged attention and KV-cache writes as Triton kernels, with the host functions that launch them.

The semantics are those of the C kernels in runtime/ops/attention.py: slot -1 skips a token, a block id -1
marks a block given back behind a sliding window (never read), float8_e4m3fn caches store x / kv_scale.

- `kv_write`: one program per (token, kv head) scatters a head's key and value rows into their cache slot.
- `rope_kv_write`: rows.rope and kv_write in one launch: query heads rotated in place, keys rotated on their
  way into the cache (one launch a layer fewer).
- `paged_attention`: one program per (sequence, kv head, tile of queries) runs an online softmax over the
  sequence's keys, read through its block table. The rows of a query tile are (query, head) pairs of the
  kv head's GQA group, so each K/V tile is loaded once per group and both products are tl.dot on at least
  16 rows. Prefill chunks and decodes share one launch and one compiled variant: the grid's last axis is
  the number of query tiles of the longest query (1 on a decode step, so a captured graph stays valid).

- `decode_attention`: a decode step (one query a sequence) split over the context, so that a few sequences still
  fill the GPU: `paged_attention_split_kernel` has one program per (sequence, kv head, split) and writes each
  split's running max, sum and unnormalised output; `attention_merge_kernel` combines a head's splits. The grid's
  split axis is fixed for a batch size (so a captured graph stays valid); how many of those splits a sequence
  uses is computed on the device from its context length (at least SPLIT_MIN_KEYS keys a split).

Constexprs hold model constants and tile sizes only (never a token count or batch size), so the build can
compile every variant ahead of time from one recording.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.cuda.launch import Launcher, cdiv, kernel, next_power_of_2

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------- KV write

@kernel(num_warps=1, num_stages=1)
def kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_row_stride, v_row_stride,
                    num_kv_heads, kv_scale,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, QUANTIZED: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a token whose KV is not kept (padding, or already cached)
        return
    d = tl.arange(0, HEAD_DIM_PADDED)
    in_head = d < HEAD_DIM
    k = tl.load(k_ptr + token.to(tl.int64) * k_row_stride + head * HEAD_DIM + d, mask=in_head).to(tl.float32)
    v = tl.load(v_ptr + token.to(tl.int64) * v_row_stride + head * HEAD_DIM + d, mask=in_head).to(tl.float32)
    if QUANTIZED:  # saturate at float8_e4m3fn's largest finite value rather than overflow to NaN
        k = tl.clamp(k / kv_scale, -448.0, 448.0)
        v = tl.clamp(v / kv_scale, -448.0, 448.0)
    dst = (slot * num_kv_heads + head) * HEAD_DIM + d  # caches [num_blocks * block_size, num_kv_heads, head_dim]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=in_head)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=in_head)


def kv_write(launcher: Launcher, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Scatter k, v [T, num_kv_heads * head_dim] (rows may be strided, e.g. slices of a fused qkv) into caches
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [T] int32 or int64 (-1: skip the token)."""
    _, _, num_kv_heads, head_dim = _check_caches("kv_write", k_cache, v_cache, kv_scale)
    for name, t in (("k", k), ("v", v)):
        _check_rows("kv_write", name, t, num_kv_heads * head_dim)
    if v.shape[0] != k.shape[0] or slot_mapping.shape != (k.shape[0],) or \
            slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_write: slot_mapping must be int32 or int64 [T] with T = {k.shape[0]} rows of k and v, "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)} and v {tuple(v.shape)}")
    launcher.launch(kv_write_kernel, (k.shape[0], num_kv_heads),
                    (k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), num_kv_heads, float(kv_scale)),
                    HEAD_DIM=head_dim, HEAD_DIM_PADDED=_padded(head_dim),
                    QUANTIZED=k_cache.dtype == torch.float8_e4m3fn)


@kernel(num_warps=1, num_stages=1)
def rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, table_ptr, slot_mapping_ptr,
                         q_row_stride, k_row_stride, v_row_stride, num_kv_heads, kv_scale,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr,
                         QUANTIZED: tl.constexpr):
    """rows.rope and kv_write in one launch. Program (token, head): a query head is rotated in place; a kv head's
    key is rotated, rounded to the activations' dtype (as rope would have stored it) and written to its cache
    slot with its value (slot -1: nothing written)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(table_ptr + pos * HEAD_DIM + offs, mask=mask, other=0.0)
    sin = tl.load(table_ptr + pos * HEAD_DIM + half + offs, mask=mask, other=0.0)
    if head < NUM_HEADS:
        src = q_ptr + token * q_row_stride + head * HEAD_DIM
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(src + offs, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(src + half + offs, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            src = k_ptr + token * k_row_stride + kv_head * HEAD_DIM
            x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
            k1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty).to(tl.float32)
            k2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty).to(tl.float32)
            vsrc = v_ptr + token * v_row_stride + kv_head * HEAD_DIM
            v1 = tl.load(vsrc + offs, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(vsrc + half + offs, mask=mask, other=0.0).to(tl.float32)
            if QUANTIZED:
                k1 = tl.clamp(k1 / kv_scale, -448.0, 448.0)
                k2 = tl.clamp(k2 / kv_scale, -448.0, 448.0)
                v1 = tl.clamp(v1 / kv_scale, -448.0, 448.0)
                v2 = tl.clamp(v2 / kv_scale, -448.0, 448.0)
            dst = (slot * num_kv_heads + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + dst + offs, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + dst + half + offs, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst + half + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rope_kv_write(launcher: Launcher, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, kv_scale: float = 1.0) -> None:
    """q [T, nh*hd] rotated in place, k [T, nkv*hd] rotated and written with v into the caches at slot_mapping
    (k itself is left as it was): what rows.rope(q, k, out=(q, k)) then kv_write do, in one launch."""
    fn = "rope_kv_write"
    _, _, num_kv_heads, head_dim = _check_caches(fn, k_cache, v_cache, kv_scale)
    if head_dim % 2:
        raise ValueError(f"{fn}: head_dim must be even, got {head_dim}")
    _check_rows(fn, "q", q, num_heads * head_dim)
    for name, t in (("k", k), ("v", v)):
        _check_rows(fn, name, t, num_kv_heads * head_dim)
    tokens = q.shape[0]
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (tokens,) or t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous int32 or int64 [{tokens}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if k.shape[0] != tokens or v.shape[0] != tokens or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{fn}: q, k and v must have {tokens} rows of one dtype")
    if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(f"{fn}: table must be a contiguous float32 [P, {head_dim}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    launcher.launch(rope_kv_write_kernel, (tokens, num_heads + num_kv_heads),
                    (q, k, v, k_cache, v_cache, positions, table, slot_mapping, q.stride(0), k.stride(0), v.stride(0),
                     num_kv_heads, float(kv_scale)),
                    NUM_HEADS=num_heads, HEAD_DIM=head_dim, HALF_BLOCK=next_power_of_2(head_dim // 2),
                    QUANTIZED=k_cache.dtype == torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------- paged attention

@triton.jit
def _kv_tile(q, k_cache_ptr, v_cache_ptr, table, key, key_end, kv_head, num_kv_heads, d, in_head, kv_scale,
             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr):
    """The keys `key` (< key_end) of a sequence's block table, K and V [BLOCK_N, HEAD_DIM_PADDED] in q's dtype, and
    which of them exist (a block given back, -1, is never read)."""
    block = tl.load(table + key // BLOCK_SIZE, mask=key < key_end, other=-1)
    key_ok = (key < key_end) & (block >= 0)
    slot = block.to(tl.int64) * BLOCK_SIZE + key % BLOCK_SIZE
    at = (slot * num_kv_heads + kv_head)[:, None] * HEAD_DIM + d[None, :]  # int64: pools exceed 2^31
    kv_mask = key_ok[:, None] & in_head[None, :]
    k = tl.load(k_cache_ptr + at, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + at, mask=kv_mask, other=0.0)
    if QUANTIZED:
        k = k.to(tl.float32) * kv_scale
        v = v.to(tl.float32) * kv_scale
    return k.to(q.dtype), v.to(q.dtype), key_ok


@triton.jit
def _softmax_step(s, v, m, row_sum, acc):
    """One tile of an online softmax in base 2: scores s [BLOCK_M, BLOCK_N] (-inf where hidden) and values v into
    the running max m, sum and unnormalised output acc."""
    m_new = tl.maximum(m, tl.reduce(s, 1, tl.standard._elementwise_max))
    p = tl.exp2(s - m_new[:, None])
    correction = tl.exp2(m - m_new)
    row_sum = row_sum * correction + tl.reduce(p, 1, tl.standard._sum_combine)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, row_sum, acc


@kernel(num_warps=4, num_stages=2)
def paged_attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                           query_start_loc_ptr, out_row_stride, q_row_stride, block_table_stride, num_kv_heads,
                           scale, kv_scale, window,
                           HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           WINDOWED: tl.constexpr, QUANTIZED: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    queries_per_tile: tl.constexpr = BLOCK_M // GROUP
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    tile_first = tl.program_id(2) * queries_per_tile  # first query of this tile, within the sequence
    if tile_first >= q_len:  # the grid is sized for the longest query of the step
        return
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = context_len - q_len  # position of the sequence's query 0

    # Rows are (query, head of the group) pairs: row r is query tile_first + r // GROUP, head r % GROUP.
    r = tl.arange(0, BLOCK_M)
    query = tile_first + r // GROUP
    row_ok = (r < queries_per_tile * GROUP) & (query < q_len)
    pos = first_pos + query  # [BLOCK_M]
    head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM_PADDED)
    in_head = d < HEAD_DIM
    token = (q_begin + query).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * q_row_stride + (head * HEAD_DIM)[:, None] + d[None, :],
                mask=row_ok[:, None] & in_head[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PADDED]

    # Keys this tile can see: up to its last query's position, from its first query's window start.
    key_end = first_pos + tl.minimum(tile_first + queries_per_tile, q_len)
    key_start = 0
    if WINDOWED:  # whole tiles before the window are skipped; their blocks may have been given back
        key_start = tl.maximum(first_pos + tile_first - window + 1, 0) // BLOCK_N * BLOCK_N
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    # tl.full, and tl.reduce with the standard combine functions: what tl.zeros, tl.max and tl.sum compile to.
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite, so a row with no key yet gives exp2(-inf - m) = 0
    row_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PADDED], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for key0 in range(key_start, key_end, BLOCK_N):
        key = key0 + tl.arange(0, BLOCK_N)
        k, v, key_ok = _kv_tile(q, k_cache_ptr, v_cache_ptr, table, key, key_end, kv_head, num_kv_heads, d, in_head,
                                kv_scale, HEAD_DIM, BLOCK_SIZE, QUANTIZED)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N] f32
        visible = key_ok[None, :] & (key[None, :] <= pos[:, None])
        if WINDOWED:
            visible = visible & (key[None, :] > pos[:, None] - window)
        m, row_sum, acc = _softmax_step(tl.where(visible, s, float("-inf")), v, m, row_sum, acc)
    row_sum = tl.where(row_ok, row_sum, 1.0)  # rows past the tile's queries saw no key; they are not stored
    o = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # rows that see no key (graph padding: context 0) stay 0
    tl.store(out_ptr + token[:, None] * out_row_stride + (head * HEAD_DIM)[:, None] + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & in_head[None, :])


def paged_attention(launcher: Launcher, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *, num_heads: int, kv_scale: float = 1.0,
                    window: int = 0, max_query_len: int) -> torch.Tensor:
    """Causal attention of packed queries q [T, num_heads * head_dim] through the paged caches into out (same
    shape and dtype; rows of both may be strided), as runtime.ops.attention.paged_attention computes it.

    block_tables [S, W], context_lens [S] and query_start_loc [S + 1] are int32; max_query_len is the longest
    query_start_loc[s + 1] - query_start_loc[s] (1 on a decode step) and sizes the grid. window > 0: a query at
    position p sees keys p - window + 1 .. p. Returns out.
    """
    fn = "paged_attention"
    _, block_size, num_kv_heads, head_dim = _check_caches(fn, k_cache, v_cache, kv_scale)
    if num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{fn}: num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    _check_rows(fn, "q", q, num_heads * head_dim)
    _check_rows(fn, "out", out, num_heads * head_dim)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"{fn}: out must match q, got {out.dtype} {tuple(out.shape)} for {q.dtype} {tuple(q.shape)}")
    num_seqs = context_lens.shape[0]
    for name, t, shape in (("block_tables", block_tables, (num_seqs, block_tables.shape[-1])),
                           ("context_lens", context_lens, (num_seqs,)),
                           ("query_start_loc", query_start_loc, (num_seqs + 1,))):
        if t.dtype != torch.int32 or t.shape != shape or not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous int32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if window < 0 or max_query_len < 0:
        raise ValueError(f"{fn}: window ({window}) and max_query_len ({max_query_len}) must be >= 0")
    group = num_heads // num_kv_heads
    block_m = _block_m(group)
    head_dim_padded = _padded(head_dim)
    block_n = 32 if head_dim_padded <= 128 else 16  # keeps a K/V tile of f32 within the register file
    grid = (num_seqs, num_kv_heads, cdiv(max_query_len, queries_per_tile(group)))
    launcher.launch(paged_attention_kernel, grid,
                    (out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out.stride(0), q.stride(0),
                     block_tables.stride(0), num_kv_heads, float(scale), float(kv_scale), int(window)),
                    HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, BLOCK_SIZE=block_size, GROUP=group,
                    BLOCK_M=block_m, BLOCK_N=block_n, WINDOWED=window > 0,
                    QUANTIZED=k_cache.dtype == torch.float8_e4m3fn)
    return out


# ---------------------------------------------------------------------------------------- split decode attention

SPLIT_MIN_KEYS = 256   # keys a split covers at the least: shorter contexts use fewer splits
MAX_SPLITS = 32


@kernel(num_warps=4, num_stages=2)
def paged_attention_split_kernel(part_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                                 query_start_loc_ptr, q_row_stride, block_table_stride, num_kv_heads, scale,
                                 kv_scale, window, min_keys,
                                 HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 WINDOWED: tl.constexpr, QUANTIZED: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_begin < 1:  # no query (an empty slot of the batch)
        return
    context_len = tl.load(context_lens_ptr + seq)
    pos = context_len - 1  # the sequence's one query
    lo = 0
    if WINDOWED:  # whole tiles before the window are skipped; their blocks may have been given back
        lo = tl.maximum(pos - window + 1, 0) // BLOCK_N * BLOCK_N
    splits = tl.minimum(tl.maximum(tl.cdiv(context_len - lo, min_keys), 1), tl.num_programs(2))
    if split >= splits:
        return
    chunk = tl.cdiv(tl.cdiv(context_len - lo, splits), BLOCK_N) * BLOCK_N
    key_start = lo + split * chunk
    key_end = tl.minimum(key_start + chunk, context_len)

    r = tl.arange(0, BLOCK_M)  # row r: query head kv_head * GROUP + r
    row_ok = r < GROUP
    head = kv_head * GROUP + r
    d = tl.arange(0, HEAD_DIM_PADDED)
    in_head = d < HEAD_DIM
    q = tl.load(q_ptr + q_begin.to(tl.int64) * q_row_stride + (head * HEAD_DIM)[:, None] + d[None, :],
                mask=row_ok[:, None] & in_head[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    row_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PADDED], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for key0 in range(key_start, key_end, BLOCK_N):
        key = key0 + tl.arange(0, BLOCK_N)
        k, v, key_ok = _kv_tile(q, k_cache_ptr, v_cache_ptr, table, key, key_end, kv_head, num_kv_heads, d, in_head,
                                kv_scale, HEAD_DIM, BLOCK_SIZE, QUANTIZED)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = key_ok[None, :] & (r[:, None] >= 0)
        if WINDOWED:
            visible = visible & (key[None, :] > pos - window)
        m, row_sum, acc = _softmax_step(tl.where(visible, s, float("-inf")), v, m, row_sum, acc)
    # part [seqs, heads, splits, HEAD_DIM_PADDED + 2]: the unnormalised output, then max (base 2) and sum
    width = HEAD_DIM_PADDED + 2
    row = part_ptr + ((seq.to(tl.int64) * num_kv_heads * GROUP + head) * tl.num_programs(2) + split) * width
    tl.store(row[:, None] + d[None, :], acc, mask=row_ok[:, None])
    tl.store(row + HEAD_DIM_PADDED, tl.where(row_sum > 0, m, float("-inf")), mask=row_ok)  # -inf: saw no key
    tl.store(row + HEAD_DIM_PADDED + 1, row_sum, mask=row_ok)


@kernel(num_warps=4, num_stages=1)
def attention_merge_kernel(out_ptr, part_ptr, context_lens_ptr, query_start_loc_ptr, out_row_stride, num_splits,
                           window, min_keys,
                           HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_N: tl.constexpr,
                           SPLITS_PADDED: tl.constexpr, WINDOWED: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_begin = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_begin < 1:
        return
    context_len = tl.load(context_lens_ptr + seq)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(context_len - window, 0) // BLOCK_N * BLOCK_N
    splits = tl.minimum(tl.maximum(tl.cdiv(context_len - lo, min_keys), 1), num_splits)
    i = tl.arange(0, SPLITS_PADDED)
    d = tl.arange(0, HEAD_DIM_PADDED)
    width = HEAD_DIM_PADDED + 2
    rows = part_ptr + ((seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + i) * width
    used = i < splits
    m = tl.load(rows + HEAD_DIM_PADDED, mask=used, other=float("-inf"))
    total = tl.load(rows + HEAD_DIM_PADDED + 1, mask=used, other=0.0)
    acc = tl.load(rows[:, None] + d[None, :], mask=used[:, None], other=0.0)
    top = tl.maximum(tl.reduce(m, 0, tl.standard._elementwise_max), -1.0e30)  # finite: no split may have a key
    weight = tl.exp2(m - top)  # each split's share, in the scale of the largest max
    row_sum = tl.reduce(total * weight, 0, tl.standard._sum_combine)
    o = tl.reduce(acc * weight[:, None], 0, tl.standard._sum_combine)
    o = o / tl.where(row_sum > 0, row_sum, 1.0)  # a sequence that sees no key (graph padding) stays 0
    tl.store(out_ptr + q_begin.to(tl.int64) * out_row_stride + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_splits(num_seqs: int, num_kv_heads: int, multiprocessors: int) -> int:
    """The split axis of a decode step's grid: enough programs for two per multiprocessor, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, cdiv(2 * multiprocessors, max(1, num_seqs * num_kv_heads))))


def decode_attention(launcher: Launcher, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, *, num_heads: int, splits: int,
                     kv_scale: float = 1.0, window: int = 0, min_keys: int = SPLIT_MIN_KEYS) -> torch.Tensor:
    """paged_attention for a step whose sequences have one query each (or none), each sequence's keys split in
    up to `splits` parts (decode_splits) that run side by side and are merged. Same arguments and result."""
    fn = "decode_attention"
    _, block_size, num_kv_heads, head_dim = _check_caches(fn, k_cache, v_cache, kv_scale)
    if num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{fn}: num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    _check_rows(fn, "q", q, num_heads * head_dim)
    _check_rows(fn, "out", out, num_heads * head_dim)
    if not 1 <= splits <= MAX_SPLITS or min_keys < 1 or window < 0:
        raise ValueError(f"{fn}: splits must be in 1..{MAX_SPLITS} (got {splits}), min_keys >= 1 (got {min_keys}), "
                         f"window >= 0 (got {window})")
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    head_dim_padded = _padded(head_dim)
    block_n = 32 if head_dim_padded <= 128 else 16
    part = torch.empty(num_seqs, num_heads, splits, head_dim_padded + 2, dtype=torch.float32, device=q.device)
    launcher.launch(paged_attention_split_kernel, (num_seqs, num_kv_heads, splits),
                    (part, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, q.stride(0),
                     block_tables.stride(0), num_kv_heads, float(scale), float(kv_scale), int(window), int(min_keys)),
                    HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, BLOCK_SIZE=block_size, GROUP=group,
                    BLOCK_M=_block_m(group), BLOCK_N=block_n, WINDOWED=window > 0,
                    QUANTIZED=k_cache.dtype == torch.float8_e4m3fn)
    launcher.launch(attention_merge_kernel, (num_seqs, num_heads),
                    (out, part, context_lens, query_start_loc, out.stride(0), splits, int(window), int(min_keys)),
                    HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, BLOCK_N=block_n,
                    SPLITS_PADDED=next_power_of_2(MAX_SPLITS), WINDOWED=window > 0)
    return out


def queries_per_tile(group: int) -> int:
    """Queries one paged_attention program covers for a GQA group of `group` query heads per kv head (the grid's
    last axis is the longest query over this)."""
    return _block_m(group) // group


def _block_m(group: int) -> int:
    return max(16, next_power_of_2(group))  # rows of (query, head) pairs: tl.dot wants at least 16


# ---------------------------------------------------------------------------------------- checks

def _padded(head_dim: int) -> int:
    """head_dim rounded up to a power of two (tl.arange needs one) and to 16 (tl.dot's smallest K)."""
    return max(16, next_power_of_2(head_dim))


def _check_caches(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scale: float) -> torch.Size:
    if k_cache.dtype not in CACHE_DTYPES or k_cache.dim() != 4 or not k_cache.is_contiguous():
        raise ValueError(f"{fn}: k_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] of "
                         f"{', '.join(map(str, CACHE_DTYPES))}, got {k_cache.dtype} {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape or not v_cache.is_contiguous():
        raise ValueError(f"{fn}: v_cache must be contiguous like k_cache {k_cache.dtype} {tuple(k_cache.shape)}, "
                         f"got {v_cache.dtype} {tuple(v_cache.shape)}")
    if not kv_scale > 0.0 or (k_cache.dtype != torch.float8_e4m3fn and kv_scale != 1.0):
        raise ValueError(f"{fn}: kv_scale must be positive, and 1.0 unless the cache is float8_e4m3fn; "
                         f"got {kv_scale} with a {k_cache.dtype} cache")
    return k_cache.shape


def _check_rows(fn: str, name: str, t: torch.Tensor, width: int) -> None:
    """t: [T, width] of an activation dtype with unit column stride (its rows may be further apart)."""
    if t.dtype not in ACTIVATION_DTYPES or t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(f"{fn}: {name} must be [T, {width}] of float32/float16/bfloat16 with unit column stride, "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
