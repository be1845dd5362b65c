"""Prefill/decode disaggregation: one engine prefills a prompt, another decodes it from the K/V handed over.

A prefill engine runs a request marked `hand_off` to its first token. As the request finishes, and
before its blocks go back to the pool, the prompt's K and V are read out of its paged cache into a
KVHandoff: per attention layer, the raw bytes of [prompt tokens, KV heads, head dim] in the cache's
dtype, token-major whatever the block size, with the layout they were read with (layers, heads, head
dim, dtype, block size) and the prefill engine's block ids they came from. A decode engine with the
same layout takes the handoff (LLMEngine.add_prefilled): it allocates blocks for the prompt, reusing
its own cached prefix blocks, writes the rest of the prompt's K/V into them byte for byte, and the
request joins its running batch with the first token appended, to decode from the next step on.
Greedy output is then the colocated engine's, token for token, and a seeded sampled request keeps
its seed (each output position draws its own noise from the seed and the position).

A decode engine without the blocks free at that moment queues the request as it does a preempted
one: it recomputes prompt + first token when admitted, and the answer is the same.

The handoff is plain data (numpy byte arrays): Ray's object store moves it between processes
through shared memory on one host and over the network between hosts. It carries the wall-clock time
it was read out, so the decode engine can count each hand-over's bytes and time (EngineStats; across
hosts the time is only as good as the hosts' clock agreement). Engines with one rank and a CPU KV
cache (KVCacheStorage) only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.backends.cpu.executor import KVCacheStorage
from runtime.format.engine_format import KV_CACHE_DTYPES, EngineError

DTYPE_NAMES = {dtype: name for name, dtype in KV_CACHE_DTYPES.items()}


@dataclass(frozen=True)
class KVLayout:
    """How a cache holds K/V: per attention layer (in layer order) its KV heads and head dim, one dtype."""

    layers: tuple[int, ...]
    num_kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtype: str
    block_size: int


@dataclass
class KVHandoff:
    """A prefilled prompt's K/V and first token, from one engine to another."""

    prompt_token_ids: list[int]
    first_token: int
    first_logprob: float | None
    seed: int
    layout: KVLayout
    k: list[np.ndarray]         # per layer: uint8 bytes of [len(prompt), kv heads, head dim] in layout.dtype
    v: list[np.ndarray]
    source_blocks: tuple[int, ...]  # the prefill engine's block ids it was read from, in token order
    made_at: float = 0.0            # wall-clock time (time.time()) the prefill engine read it out

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


def cache_layout(cache, block_size: int) -> KVLayout:
    """The layout of an executor's KV cache; EngineError for a cache K/V cannot be handed over from."""
    if not isinstance(cache, KVCacheStorage):
        raise EngineError("prefill/decode disaggregation needs a one-rank engine with a CPU KV cache "
                          f"(this one keeps its cache in {type(cache).__name__})")
    layers = tuple(sorted(cache.k))
    shapes = [cache.k[layer].shape for layer in layers]
    return KVLayout(layers, tuple(s[2] for s in shapes), tuple(s[3] for s in shapes),
                    DTYPE_NAMES[cache.k[layers[0]].dtype], block_size)


def layer_tables(cache, layout: KVLayout, tables: list[list[int]]) -> list[list[int]]:
    """Each layout layer's block table: its KV group's (runtime/format/kv_groups.py) of a sequence's tables."""
    return [tables[cache.group[layer]] for layer in layout.layers]


def _slots(block_table: list[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """The cache slot of each position in [start, stop) that the table holds a block for (-1: given back)."""
    positions = torch.arange(start, stop)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return torch.where(blocks >= 0, blocks * block_size + positions % block_size, -1)


def read_kv(cache, layout: KVLayout, tables: list[list[int]], num_tokens: int) -> tuple[list, list]:
    """K and V of positions [0, num_tokens) of a sequence holding `tables` (per layout layer), as byte arrays."""
    def gather(tensor: torch.Tensor, slots: torch.Tensor) -> np.ndarray:
        rows = tensor.view(-1, *tensor.shape[2:])[slots.to(tensor.device)]  # a GPU backend's pools: copied out
        return rows.contiguous().view(torch.uint8).cpu().numpy()

    slots = [_slots(table, layout.block_size, 0, num_tokens) for table in tables]
    return ([gather(cache.k[layer], s) for layer, s in zip(layout.layers, slots)],
            [gather(cache.v[layer], s) for layer, s in zip(layout.layers, slots)])


def write_kv(cache, layout: KVLayout, tables: list[list[int]], start: int, handoff: KVHandoff) -> None:
    """Write the handoff's positions [start, prompt length) into a sequence's blocks (per layout layer's table),
    those of a sliding-window layer that its table has given back left out."""
    stop = len(handoff.prompt_token_ids)
    if start >= stop:
        return
    dtype = KV_CACHE_DTYPES[layout.dtype]
    for i, (layer, table) in enumerate(zip(layout.layers, tables)):
        slots = _slots(table, layout.block_size, start, stop)
        kept = slots >= 0
        for tensor, data in ((cache.k[layer], handoff.k[i]), (cache.v[layer], handoff.v[i])):
            rows = torch.from_numpy(data).view(dtype).view(stop, *tensor.shape[2:])
            tensor.view(-1, *tensor.shape[2:])[slots[kept].to(tensor.device)] = rows[start:stop][kept].to(tensor.device)


def check_handoff(handoff: KVHandoff, layout: KVLayout, vocab_size: int) -> None:
    """ValueError unless this engine can decode from the handoff."""
    if handoff.layout != layout:
        raise ValueError(f"the handed-over K/V does not fit this engine's cache: {handoff.layout} != {layout} "
                         "(prefill and decode workers must run the same engine)")
    n = len(handoff.prompt_token_ids)
    for i, (k, v) in enumerate(zip(handoff.k, handoff.v)):
        expected = n * layout.num_kv_heads[i] * layout.head_dims[i] * KV_CACHE_DTYPES[layout.dtype].itemsize
        if k.nbytes != expected or v.nbytes != expected:
            raise ValueError(f"the handed-over K/V of layer {layout.layers[i]} has {k.nbytes}/{v.nbytes} bytes, "
                             f"expected {expected} for {n} tokens")
    if not 0 <= handoff.first_token < vocab_size:
        raise ValueError(f"the handed-over first token {handoff.first_token} is not in [0, {vocab_size})")
