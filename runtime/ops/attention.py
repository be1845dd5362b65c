"""Paged attention and KV-cache writes: checks torch tensors, then calls the C kernels in _native._attention.

kv_write, paged_attention and the fused qkv_attention (q/k norms where the model has them, rope, KV
write and attention from the qkv projection; LayerAttention binds it to one layer for the executor). The wrappers check dtypes,
dimensions, matching sizes, devices and contiguity (skipped with check=False, for callers that
validated the step once). The C side always checks buffer lengths and the metadata values (slot
range, positions within the rope table, block ids of used blocks, query_start_loc monotonic and
ending at T, context_lens >= query length) before touching any data, so check=False stays
memory-safe; both raise ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime._native import _attention as _C
from runtime.ops.checks import buffer, expect_contiguous, threads
from runtime.ops.tape import Outputs

# torch dtype of a KV cache -> the C kernel's element code
CACHE_DTYPE_CODES = {
    torch.float32: _C.DTYPE_F32,
    torch.bfloat16: _C.DTYPE_BF16,
    torch.float16: _C.DTYPE_F16,
    torch.int8: _C.DTYPE_I8,
    torch.float8_e4m3fn: _C.DTYPE_F8E4M3,
}
QUANTIZED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn)  # store x / kv_scale


def kv_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_scale: float = 1.0, num_threads: int | None = None,
             check: bool = True) -> None:
    """Scatter key/value [T, nkv, hd] f32 into caches [num_blocks, block_size, nkv, hd] at slot_mapping [T].

    Slot s is block s // block_size, offset s % block_size; slot -1 skips the token. i8 and
    f8e4m3 caches store key / kv_scale (int8: rounded half to even, clamped to +-127; f8e4m3:
    saturating at 448).
    """
    if check:
        _check_kv_write(key, value, k_cache, v_cache, slot_mapping, kv_scale)
    _C.kv_write(key.numpy(), value.numpy(), buffer(k_cache), buffer(v_cache), slot_mapping.numpy(),
                k_cache.shape[2], k_cache.shape[3], CACHE_DTYPE_CODES[k_cache.dtype], float(kv_scale),
                threads(num_threads))


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, kv_scale: float = 1.0, window: int = 0, num_threads: int | None = None,
                    check: bool = True) -> torch.Tensor:
    """Causal attention of packed queries through the paged KV cache; writes and returns out [T, nh, hd] f32.

    Sequence s owns query tokens query_start_loc[s] .. query_start_loc[s+1]-1 ([S+1] i32), the
    last qlen positions of its context_lens[s] ([S] i32) cached tokens; query j attends to key
    positions 0 .. context_lens[s] - qlen + j, read through block_tables [S, max_blocks] i32.
    Query head h uses kv head h // (nh // nkv). kv_scale dequantizes i8/f8e4m3 caches. A sliding
    window > 0 limits a query at position p to keys p - window + 1 .. p.
    """
    if check:
        _check_paged_attention(out, query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                               kv_scale)
    _C.paged_attention(out.numpy(), query.numpy(), buffer(k_cache), buffer(v_cache), block_tables.numpy(),
                       context_lens.numpy(), query_start_loc.numpy(), query.shape[1], k_cache.shape[2],
                       query.shape[2], k_cache.shape[1], float(scale), CACHE_DTYPE_CODES[k_cache.dtype],
                       float(kv_scale), int(window), threads(num_threads))
    return out


def qkv_attention(out: torch.Tensor, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  positions: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  scale: float, *, kv_scale: float = 1.0, window: int = 0, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, norm_eps: float = 0.0, k: torch.Tensor | None = None,
                  v: torch.Tensor | None = None, num_threads: int | None = None, check: bool = True) -> torch.Tensor:
    """One attention layer's step from the fused projection qkv [T, (nh + 2 nkv) * hd] f32 = q | k | v, or,
    given k and v [T, nkv * hd] (three projections of their own), from q = qkv [T, nh * hd] and them.

    Normalizes each head of q by q_norm and each of k by k_norm (RMSNorm weights [hd] f32 with
    norm_eps, as reference.head_rms_norm; None: no norm), rotates q and k by position (rope [rows, hd]
    f32 = cos | sin of the first half of the frequencies, as reference.RopeTable.packed; positions
    [T] int64 index its rows), writes k and v to the caches at slot_mapping like kv_write, then runs
    paged_attention (with its window) into out [T, nh, hd].
    """
    if check:
        _check_qkv_attention(out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
                             rope, slot_mapping, num_heads, kv_scale, q_norm, k_norm, k, v)
    _C.qkv_attention(out.numpy(), qkv.numpy(), buffer(k_cache), buffer(v_cache), block_tables.numpy(),
                     context_lens.numpy(), query_start_loc.numpy(), positions.numpy(), rope.numpy(),
                     slot_mapping.numpy(), num_heads, k_cache.shape[2], k_cache.shape[3], k_cache.shape[1],
                     float(scale), CACHE_DTYPE_CODES[k_cache.dtype], float(kv_scale), int(window),
                     threads(num_threads), buffer(q_norm), buffer(k_norm), float(norm_eps), buffer(k), buffer(v))
    return out


@dataclass(frozen=True)
class StepArrays:
    """A step's metadata as arrays the C kernels read, made once per step for every layer."""

    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray

    @staticmethod
    def of(meta, group: int = 0) -> StepArrays:
        """The arrays of the layers of one KV group (runtime/format/kv_groups.py): its own slots and block tables."""
        slot_mapping, block_tables = meta.groups[group]
        return StepArrays(meta.positions.numpy(), slot_mapping.numpy(), block_tables.numpy(),
                          meta.context_lens.numpy(), meta.query_start_loc.numpy())


class LayerAttention:
    """qkv_attention of one layer bound to its caches and rope table: (StepArrays, qkv) -> [T, nh * hd], or
    (StepArrays, q, k, v) for a layer whose q, k and v come from projections of their own.

    The per-call cost is one C call: the caches' buffers are taken once, the step's arrays once per
    step, and the argument checks are the C side's (lengths and every index, before any data moves).
    qk_norm: None, or the q and k head norms (weight [hd] f32 each, eps) as qkv_attention takes them.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
                 kv_scale: float, rope_table, reuse_outputs: bool = False, window: int = 0,
                 qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
        _check_caches("qkv_attention", k_cache, v_cache, kv_scale)
        q_norm, k_norm, eps = qk_norm or (None, None, 0.0)
        _check_norms("qkv_attention", q_norm, k_norm, k_cache.shape[3])
        self.norms = (buffer(q_norm), buffer(k_norm), float(eps))  # held while the layer lives: a tape reads them
        self.k, self.v = buffer(k_cache), buffer(v_cache)
        _, self.block_size, self.num_kv_heads, self.head_dim = k_cache.shape
        self.num_heads, self.scale, self.kv_scale, self.window = num_heads, float(scale), float(kv_scale), int(window)
        self.dtype = CACHE_DTYPE_CODES[k_cache.dtype]
        self.rope_table = rope_table
        self._rope = (None, None)  # (rope_table.packed, its numpy view): taken again only when the table grows
        self.q_width, self.kv_width = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.outputs = Outputs((num_heads * self.head_dim,), reuse_outputs)

    def __call__(self, step: StepArrays, qkv: torch.Tensor, k: torch.Tensor | None = None,
                 v: torch.Tensor | None = None) -> torch.Tensor:
        parts = [("qkv", qkv, self.q_width + 2 * self.kv_width)] if k is None else \
            [("q", qkv, self.q_width), ("k", k, self.kv_width), ("v", v, self.kv_width)]
        for name, t, width in parts:  # the C side checks lengths; rows must also be this wide
            if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != width or t.shape[0] != qkv.shape[0]:
                raise ValueError(f"qkv_attention: {name} must be float32 [T, {width}], got {t.dtype} {tuple(t.shape)}")
        (out, out_np), = self.outputs.get(qkv)
        if self._rope[0] is not self.rope_table.packed:
            self._rope = (self.rope_table.packed, self.rope_table.packed.numpy())
        kv = () if k is None else (k.numpy(), v.numpy())
        _C.qkv_attention(out_np, qkv.numpy(), self.k, self.v, step.block_tables, step.context_lens,
                         step.query_start_loc, step.positions, self._rope[1], step.slot_mapping,
                         self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, self.scale, self.dtype,
                         self.kv_scale, self.window, threads(), *self.norms, *kv)
        return out


# ---------------------------------------------------------------------------------------- checks

def _check_kv_write(key, value, k_cache, v_cache, slot_mapping, kv_scale) -> None:
    fn = "kv_write"
    expect_contiguous(fn, "key", key, torch.float32, 3, "[T, num_kv_heads, head_dim]")
    expect_contiguous(fn, "value", value, torch.float32, 3, "[T, num_kv_heads, head_dim]", shape=key.shape)
    _check_caches(fn, k_cache, v_cache, kv_scale)
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"{fn}: key [T, num_kv_heads, head_dim] = {tuple(key.shape)} does not match "
                         f"cache [num_blocks, block_size, num_kv_heads, head_dim] = {tuple(k_cache.shape)}")
    expect_contiguous(fn, "slot_mapping", slot_mapping, torch.int64, 1, "[T]", shape=key.shape[:1])


def _check_paged_attention(out, query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           kv_scale) -> None:
    fn = "paged_attention"
    expect_contiguous(fn, "query", query, torch.float32, 3, "[T, num_heads, head_dim]")
    expect_contiguous(fn, "out", out, torch.float32, 3, "[T, num_heads, head_dim]", shape=query.shape)
    _check_caches(fn, k_cache, v_cache, kv_scale)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3] or num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{fn}: query [T, num_heads, head_dim] = {tuple(query.shape)} needs a cache with "
                         f"the same head_dim and num_kv_heads dividing num_heads, "
                         f"got cache {tuple(k_cache.shape)}")
    _check_sequences(fn, block_tables, context_lens, query_start_loc)


def _check_qkv_attention(out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions, rope,
                         slot_mapping, num_heads, kv_scale, q_norm, k_norm, k=None, v=None) -> None:
    fn = "qkv_attention"
    _check_caches(fn, k_cache, v_cache, kv_scale)
    nkv, hd = k_cache.shape[2:]
    if num_heads <= 0 or num_heads % nkv or hd % 2:
        raise ValueError(f"{fn}: num_heads ({num_heads}) must be a positive multiple of the cache's num_kv_heads "
                         f"({nkv}) and head_dim ({hd}) even")
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v come together (or both inside qkv)")
    heads = num_heads if k is not None else num_heads + 2 * nkv
    name = "q" if k is not None else "qkv"
    expect_contiguous(fn, name, qkv, torch.float32, 2, f"[T, {heads} heads x head_dim]")
    t = qkv.shape[0]
    if qkv.shape[1] != heads * hd:
        raise ValueError(f"{fn}: {name} must be [T, {heads * hd}] for {heads} heads of {hd}, got {tuple(qkv.shape)}")
    for part_name, part in (("k", k), ("v", v)):
        if part is not None:
            expect_contiguous(fn, part_name, part, torch.float32, 2, "[T, num_kv_heads head_dim]", shape=(t, nkv * hd))
    expect_contiguous(fn, "out", out, torch.float32, 3, "[T, num_heads, head_dim]", shape=(t, num_heads, hd))
    expect_contiguous(fn, "positions", positions, torch.int64, 1, "[T]", shape=(t,))
    expect_contiguous(fn, "slot_mapping", slot_mapping, torch.int64, 1, "[T]", shape=(t,))
    expect_contiguous(fn, "rope", rope, torch.float32, 2, "[rows, head_dim]")
    if rope.shape[1] != hd:
        raise ValueError(f"{fn}: rope must be [rows, {hd}], got {tuple(rope.shape)}")
    _check_norms(fn, q_norm, k_norm, hd)
    _check_sequences(fn, block_tables, context_lens, query_start_loc)


def _check_norms(fn: str, q_norm, k_norm, head_dim: int) -> None:
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None:
            expect_contiguous(fn, name, weight, torch.float32, 1, "[head_dim]", shape=(head_dim,))


def _check_sequences(fn: str, block_tables, context_lens, query_start_loc) -> None:
    expect_contiguous(fn, "context_lens", context_lens, torch.int32, 1, "[S]")
    num_seqs = context_lens.shape[0]
    expect_contiguous(fn, "query_start_loc", query_start_loc, torch.int32, 1, "[S + 1]", shape=(num_seqs + 1,))
    expect_contiguous(fn, "block_tables", block_tables, torch.int32, 2, "[S, max_blocks]")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"{fn}: block_tables must be [S, max_blocks] with S = {num_seqs}, "
                         f"got {tuple(block_tables.shape)}")


def _check_caches(fn: str, k_cache, v_cache, kv_scale) -> None:
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    if k_cache.dtype not in CACHE_DTYPE_CODES:
        raise ValueError(f"{fn}: k_cache dtype must be one of {sorted(map(str, CACHE_DTYPE_CODES))}, "
                         f"got {k_cache.dtype}")
    expect_contiguous(fn, "k_cache", k_cache, k_cache.dtype, 4, layout)
    expect_contiguous(fn, "v_cache", v_cache, k_cache.dtype, 4, layout + " like k_cache", shape=k_cache.shape)
    if k_cache.dtype not in QUANTIZED_CACHE_DTYPES and kv_scale != 1.0:
        raise ValueError(f"{fn}: kv_scale applies to int8/float8_e4m3fn caches only; got {kv_scale} "
                         f"with a {k_cache.dtype} cache (pass 1.0)")
    if not kv_scale > 0.0:
        raise ValueError(f"{fn}: kv_scale must be positive, got {kv_scale}")
