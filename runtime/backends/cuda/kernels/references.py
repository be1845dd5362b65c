"""Each cuda kernel's meaning in torch: a function of the launch's grid and the kernel's own arguments.

A reference reads and writes the same tensors as its kernel, through the same row strides, and computes what the
kernel computes (f32 inside, stored in the output's dtype), without the kernel's tiling. `engine-build verify` on a
host without the engine's GPU runs a whole model through the executor with these (fast), and runs the first launch
of every compiled variant in Triton's interpreter as well, on copies of the same arguments, comparing the two
(runtime/backends/cuda/checking.py). The sampling kernels (penalties, hold-back, sample) have none: they run in the
interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.weights import int4

Reference = Callable[..., None]
REFERENCES: dict[tuple[str, str], Reference] = {}   # (kernel module, kernel name) -> reference

_KERNELS = "runtime.backends.cuda.kernels."


def references(module: str, name: str) -> Callable[[Reference], Reference]:
    def register(fn: Reference) -> Reference:
        REFERENCES[(_KERNELS + module, name)] = fn
        return fn
    return register


def reference_of(kernel) -> Reference | None:
    return REFERENCES.get((kernel.module, kernel.name))


def _rows(t: torch.Tensor, rows: int, width: int, stride: int, offset: int = 0) -> torch.Tensor:
    """rows x width elements of t from its first element (+ offset), rows `stride` apart."""
    return t.as_strided((rows, width), (stride, 1), t.storage_offset() + offset)


def _fp8(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8 or float8_e4m3fn) -> their values in f32."""
    return (codes if codes.dtype == torch.float8_e4m3fn else codes.view(torch.float8_e4m3fn)).float()


def _int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K/2] packed codes with f32 [N, K/G] scales and zeros -> w [N, K] f32: (q - 8) * scale + zero."""
    q = int4.unpack_nibbles(qweight).float()
    return (q - 8.0) * scales.repeat_interleave(group, 1) + zeros.repeat_interleave(group, 1)


# ------------------------------------------------------------------------------------------------- rows

@references("rows", "_rms_norm_kernel")
def rms_norm(grid, x, weight, out, x_stride, out_stride, width, eps, BLOCK):
    rows, groups = grid
    v = x.as_strided((rows, groups, width), (x_stride, width, 1)).float()
    normed = weight * (v * torch.rsqrt(v.square().sum(-1, keepdim=True) / width + eps))
    out.as_strided((rows, groups, width), (out_stride, width, 1)).copy_(normed)


@references("rows", "_add_rms_norm_kernel")
def add_rms_norm(grid, x, residual, weight, out, total, x_stride, residual_stride, out_stride, total_stride,
                 width, eps, BLOCK):
    rows = grid[0]
    t = (_rows(x, rows, width, x_stride).float() + _rows(residual, rows, width, residual_stride).float())
    t = t.to(total.dtype)
    _rows(total, rows, width, total_stride).copy_(t)
    t = t.float()
    _rows(out, rows, width, out_stride).copy_(weight * (t * torch.rsqrt(t.square().sum(-1, keepdim=True) / width + eps)))


@references("rows", "_rope_kernel")
def rope(grid, q, k, q_out, k_out, positions, table, q_stride, k_stride, q_out_stride, k_out_stride,
         NUM_HEADS, HEAD_DIM, HALF_BLOCK):
    rows, heads = grid
    half = HEAD_DIM // 2
    at = table[positions[:rows].long()]
    cos, sin = at[:, None, :half], at[:, None, half:2 * half]
    for src, dst, n, s_in, s_out in ((q, q_out, NUM_HEADS, q_stride, q_out_stride),
                                     (k, k_out, heads - NUM_HEADS, k_stride, k_out_stride)):
        v = src.as_strided((rows, n, HEAD_DIM), (s_in, HEAD_DIM, 1)).float()
        x1, x2 = v[..., :half], v[..., half:]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        dst.as_strided((rows, n, HEAD_DIM), (s_out, HEAD_DIM, 1)).copy_(rotated)


@references("rows", "_gated_act_kernel")
def gated_act(grid, gate, up, out, gate_stride, up_stride, out_stride, up_offset, width, ACT, BLOCK):
    rows = grid[0]
    g = _rows(gate, rows, width, gate_stride).float()
    u = _rows(up, rows, width, up_stride, up_offset).float()
    z = -g if ACT == "silu" else -1.5957691216057308 * (g + 0.044715 * g * g * g)
    _rows(out, rows, width, out_stride).copy_(g / (1.0 + torch.exp(z)) * u)


# -------------------------------------------------------------------------------------------- attention

@references("attention", "kv_write_kernel")
def kv_write(grid, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_row_stride, v_row_stride,
             num_kv_heads, kv_scale, HEAD_DIM, HEAD_DIM_PADDED, QUANTIZED):
    tokens, width = grid[0], num_kv_heads * HEAD_DIM
    slots = slot_mapping_ptr[:tokens].long()
    kept = slots >= 0
    for src, stride, cache in ((k_ptr, k_row_stride, k_cache_ptr), (v_ptr, v_row_stride, v_cache_ptr)):
        v = _rows(src, tokens, width, stride).float()[kept]
        if QUANTIZED:
            v = (v / kv_scale).clamp(-448.0, 448.0)
        cache.view(-1, width)[slots[kept]] = v.to(cache.dtype)


@references("attention", "rope_kv_write_kernel")
def rope_kv_write(grid, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, table_ptr, slot_mapping_ptr,
                  q_row_stride, k_row_stride, v_row_stride, num_kv_heads, kv_scale, NUM_HEADS, HEAD_DIM, HALF_BLOCK,
                  QUANTIZED):
    tokens, width, half = grid[0], num_kv_heads * HEAD_DIM, HEAD_DIM // 2
    at = table_ptr[positions_ptr[:tokens].long()]
    cos, sin = at[:, None, :half], at[:, None, half:2 * half]

    def rotated(src, heads, stride):
        x = src.as_strided((tokens, heads, HEAD_DIM), (stride, HEAD_DIM, 1)).float()
        return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)

    q_new = rotated(q_ptr, NUM_HEADS, q_row_stride)
    k_new = rotated(k_ptr, num_kv_heads, k_row_stride).to(k_ptr.dtype).float().reshape(tokens, width)
    q_ptr.as_strided((tokens, NUM_HEADS, HEAD_DIM), (q_row_stride, HEAD_DIM, 1)).copy_(q_new)
    slots = slot_mapping_ptr[:tokens].long()
    kept = slots >= 0
    for value, cache in ((k_new, k_cache_ptr), (_rows(v_ptr, tokens, width, v_row_stride).float(), v_cache_ptr)):
        value = value[kept]
        if QUANTIZED:
            value = (value / kv_scale).clamp(-448.0, 448.0)
        cache.view(-1, width)[slots[kept]] = value.to(cache.dtype)


@references("attention", "paged_attention_kernel")
def paged_attention(grid, out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                    query_start_loc_ptr, out_row_stride, q_row_stride, block_table_stride, num_kv_heads, scale,
                    kv_scale, window, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, GROUP, BLOCK_M, BLOCK_N, WINDOWED,
                    QUANTIZED):
    seqs, num_heads = grid[0], num_kv_heads * GROUP
    starts = query_start_loc_ptr[:seqs + 1].tolist()
    width = num_heads * HEAD_DIM
    q_all = _rows(q_ptr, starts[-1], width, q_row_stride)
    out_all = _rows(out_ptr, starts[-1], width, out_row_stride)
    k_flat = k_cache_ptr.view(-1, num_kv_heads, HEAD_DIM)
    v_flat = v_cache_ptr.view(-1, num_kv_heads, HEAD_DIM)
    for s in range(seqs):
        begin, end = starts[s], starts[s + 1]
        context = int(context_lens_ptr[s])
        if end <= begin:
            continue
        key = torch.arange(context)
        block = block_tables_ptr.view(-1)[s * block_table_stride + key // BLOCK_SIZE].long()
        slot = block.clamp(min=0) * BLOCK_SIZE + key % BLOCK_SIZE
        k, v = k_flat[slot].float(), v_flat[slot].float()     # [keys, kv heads, head_dim]
        if QUANTIZED:
            k, v = k * kv_scale, v * kv_scale
        k, v = k.to(q_ptr.dtype).float(), v.to(q_ptr.dtype)   # the kernel's dots run in q's dtype
        pos = torch.arange(context - (end - begin), context)
        visible = (block >= 0)[None, :] & (key[None, :] <= pos[:, None])
        if WINDOWED:
            visible &= key[None, :] > pos[:, None] - window
        q = q_all[begin:end].float().view(end - begin, num_kv_heads, GROUP, HEAD_DIM)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.amax(-1, keepdim=True).clamp(min=-1.0e30)
        p = torch.exp(scores - top)
        total = p.sum(-1, keepdim=True)
        o = torch.einsum("hgqk,khd->qhgd", p.to(v.dtype).float(), v.float())
        o = o / torch.where(total > 0, total, 1.0).permute(2, 0, 1, 3)
        out_all[begin:end] = o.reshape(end - begin, width).to(out_ptr.dtype)


def _decode_splits(context: int, window: int, block_n: int, min_keys: int, most: int) -> tuple[int, int, int]:
    """A decode query's split of its keys, as the split kernels compute it: (first key, splits, keys a split)."""
    lo = max(context - window, 0) // block_n * block_n if window > 0 else 0
    splits = min(max(-(-(context - lo) // min_keys), 1), most)
    chunk = -(-(-(-(context - lo) // splits)) // block_n) * block_n
    return lo, splits, chunk


@references("attention", "paged_attention_split_kernel")
def paged_attention_split(grid, part_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                          query_start_loc_ptr, q_row_stride, block_table_stride, num_kv_heads, scale, kv_scale,
                          window, min_keys, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, GROUP, BLOCK_M, BLOCK_N,
                          WINDOWED, QUANTIZED):
    seqs, _, most = grid
    num_heads = num_kv_heads * GROUP
    starts = query_start_loc_ptr[:seqs + 1].tolist()
    q_all = _rows(q_ptr, max(starts[-1], 1), num_heads * HEAD_DIM, q_row_stride)
    k_flat = k_cache_ptr.view(-1, num_kv_heads, HEAD_DIM)
    v_flat = v_cache_ptr.view(-1, num_kv_heads, HEAD_DIM)
    part = part_ptr.view(seqs, num_heads, most, HEAD_DIM_PADDED + 2)
    for s in range(seqs):
        if starts[s + 1] - starts[s] < 1:
            continue
        context = int(context_lens_ptr[s])
        lo, splits, chunk = _decode_splits(context, window if WINDOWED else 0, BLOCK_N, min_keys, most)
        q = q_all[starts[s]].float().view(num_kv_heads, GROUP, HEAD_DIM)
        for i in range(splits):
            first = lo + i * chunk
            key = torch.arange(first, max(first, min(first + chunk, context)))
            block = block_tables_ptr.view(-1)[s * block_table_stride + key // BLOCK_SIZE].long()
            slot = block.clamp(min=0) * BLOCK_SIZE + key % BLOCK_SIZE
            k, v = k_flat[slot].float(), v_flat[slot].float()
            if QUANTIZED:
                k, v = k * kv_scale, v * kv_scale
            k, v = k.to(q_ptr.dtype).float(), v.to(q_ptr.dtype)
            visible = block >= 0
            if WINDOWED:
                visible &= key > context - 1 - window
            scores = torch.einsum("hgd,khd->hgk", q, k) * (scale * 1.4426950408889634)  # base 2, as the kernel
            scores = scores.masked_fill(~visible, float("-inf"))
            top = scores.amax(-1).clamp(min=-1.0e30) if len(key) else torch.full((num_kv_heads, GROUP), -1.0e30)
            p = torch.exp2(scores - top[..., None])
            acc = torch.einsum("hgk,khd->hgd", p.to(v.dtype).float(), v.float())
            row = part[s, :, i]
            row[:, :HEAD_DIM_PADDED] = 0.0
            row[:, :HEAD_DIM] = acc.reshape(num_heads, HEAD_DIM)
            total = p.sum(-1)
            row[:, HEAD_DIM_PADDED] = torch.where(total > 0, top, float("-inf")).reshape(num_heads)
            row[:, HEAD_DIM_PADDED + 1] = total.reshape(num_heads)


@references("attention", "attention_merge_kernel")
def attention_merge(grid, out_ptr, part_ptr, context_lens_ptr, query_start_loc_ptr, out_row_stride, num_splits,
                    window, min_keys, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_N, SPLITS_PADDED, WINDOWED):
    seqs, num_heads = grid
    starts = query_start_loc_ptr[:seqs + 1].tolist()
    out_all = _rows(out_ptr, max(starts[-1], 1), num_heads * HEAD_DIM, out_row_stride)
    part = part_ptr.view(seqs, num_heads, num_splits, HEAD_DIM_PADDED + 2)
    for s in range(seqs):
        if starts[s + 1] - starts[s] < 1:
            continue
        _, splits, _ = _decode_splits(int(context_lens_ptr[s]), window if WINDOWED else 0, BLOCK_N, min_keys,
                                      num_splits)
        used = part[s, :, :splits]
        m, total = used[..., HEAD_DIM_PADDED], used[..., HEAD_DIM_PADDED + 1]
        weight = torch.exp2(m - m.amax(-1, keepdim=True).clamp(min=-1.0e30))
        row_sum = (total * weight).sum(-1)
        o = (used[..., :HEAD_DIM] * weight[..., None]).sum(1) / torch.where(row_sum > 0, row_sum, 1.0)[:, None]
        out_all[starts[s]] = o.reshape(-1).to(out_ptr.dtype)


# ------------------------------------------------------------------------------------------------- gemm

def _linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, T: int, bias, HAS_BIAS: bool,
            col_scale=None) -> None:
    """y[:T] = (x[:T] @ w.T) * col_scale + bias, in f32, stored in y's dtype."""
    acc = x[:T].float() @ w.T
    if col_scale is not None:
        acc = acc * col_scale
    if HAS_BIAS:
        acc = acc + bias
    y[:T] = acc.to(y.dtype)


@references("gemm", "int4_gemv")
def int4_gemv(grid, x, qweight, scales, zeros, bias, y, T, N, K, GROUP, HAS_BIAS, MAX_T, BLOCK_N):
    _linear(x, _int4(qweight, scales, zeros, GROUP), y, T, bias, HAS_BIAS)


@references("gemm", "int4_gemm")
def int4_gemm(grid, x, qweight, scales, zeros, bias, y, T, N, K, GROUP, HAS_BIAS, BLOCK_M, BLOCK_N):
    _linear(x, _int4(qweight, scales, zeros, GROUP).to(x.dtype).float(), y, T, bias, HAS_BIAS)


def _fp8_scale(scales, N, PER_CHANNEL):
    return scales[:N] if PER_CHANNEL else scales[0]


@references("gemm", "fp8_gemv")
def fp8_gemv(grid, x, qweight, scales, bias, y, T, N, K, PER_CHANNEL, HAS_BIAS, MAX_T, BLOCK_N, BLOCK_K):
    _linear(x, _fp8(qweight), y, T, bias, HAS_BIAS, _fp8_scale(scales, N, PER_CHANNEL))


@references("gemm", "fp8_gemv1")
def fp8_gemv1(grid, x, qweight, scales, bias, y, N, K, PER_CHANNEL, HAS_BIAS, BLOCK_N, BLOCK_K):
    _linear(x, _fp8(qweight), y, 1, bias, HAS_BIAS, _fp8_scale(scales, N, PER_CHANNEL))


@references("gemm", "fp8_gemm")
def fp8_gemm(grid, x, x_scales, qweight, scales, bias, y, T, N, K, PER_CHANNEL, FP8_ACT, HAS_BIAS, BLOCK_M, BLOCK_N,
             BLOCK_K):
    w = _fp8(qweight)
    if FP8_ACT:  # x holds e4m3 codes, a scale per row
        acc = (_fp8(x[:T]) @ w.T) * x_scales[:T, None]
        _linear(acc, torch.eye(N), y, T, bias, HAS_BIAS, _fp8_scale(scales, N, PER_CHANNEL))
    else:
        _linear(x, w.to(x.dtype).float(), y, T, bias, HAS_BIAS, _fp8_scale(scales, N, PER_CHANNEL))


@references("gemm", "fp8_quantize_rows")
def fp8_quantize_rows(grid, x, x_q, x_scales, K, BLOCK_K):
    rows = grid[0]
    v = x[:rows].float()
    scale = v.abs().amax(-1) / 448.0
    x_scales[:rows] = scale
    x_q[:rows] = (v / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-448.0, 448.0).to(x_q.dtype)


@references("experts", "_expert_gemv")
def expert_gemv(grid, x, experts, w, scales, zeros, y, N, K, ROWS_PER_X, FORMAT, GROUP, BLOCK_N, BLOCK_K):
    slots = grid[1]
    chosen = experts[:slots].long()
    y[:slots] = 0
    for e in chosen.unique().tolist():
        if e < 0:
            continue
        if FORMAT == 1:
            weight = _int4(w[e], scales[e], zeros[e], GROUP)
        elif FORMAT == 2:
            weight = _fp8(w[e]) * scales[e][:, None]
        else:
            weight = w[e].float()
        mine = (chosen == e).nonzero().flatten()
        y[mine] = (x[mine // ROWS_PER_X].float() @ weight.T).to(y.dtype)


# --------------------------------------------------------------------------------------------- sampling

@references("sampling", "_greedy_kernel")
def greedy(grid, logits_ptr, out_ptr, V, stride, TILE):
    rows = grid[0]
    out_ptr[:rows] = _rows(logits_ptr, rows, V, stride).float().argmax(-1).to(out_ptr.dtype)


@references("sampling", "_mask_bits_kernel")
def mask_bits(grid, logits_ptr, rows_ptr, bits_ptr, V, words, stride, TILE):
    chosen = rows_ptr[:grid[0]].tolist()
    bits = bits_ptr.reshape(-1)[:grid[0] * words].view(grid[0], words)
    v = torch.arange(V)
    inside = v < 32 * words
    allowed = torch.zeros(grid[0], V, dtype=torch.bool)
    allowed[:, inside] = ((bits[:, v[inside] // 32] >> (v[inside] % 32)) & 1) != 0
    logits = _rows(logits_ptr, max(chosen) + 1, V, stride)
    for m, row in enumerate(chosen):
        logits[row].masked_fill_(~allowed[m], float("-inf"))


@references("sampling", "_top_logprobs_kernel")
def top_logprobs(grid, logits_ptr, tokens_ptr, chosen_ptr, values_ptr, ids_ptr, V, K, stride, TILE):
    rows = grid[0]
    logp = torch.log_softmax(_rows(logits_ptr, rows, V, stride).float(), dim=-1)
    chosen_ptr[:rows] = logp.gather(1, tokens_ptr[:rows].long().unsqueeze(1)).squeeze(1)
    if K:
        values, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
        values_ptr.reshape(-1)[:rows * K] = values[:, :K].reshape(-1)
        ids_ptr.reshape(-1)[:rows * K] = ids[:, :K].reshape(-1).to(ids_ptr.dtype)
