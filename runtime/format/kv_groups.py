"""KV groups: the attention layers that keep the same KV blocks, each group with a block pool of its own.

Full-attention layers keep every position of a sequence. A sliding-window layer's query sees only
its last `window` positions, so a block that falls wholly before the window of every windowed layer
can go back to the pool while the full layers keep theirs. Layers are grouped so:

    all full                (0,)      one pool, as without windows
    all windowed            (W,)      one pool, whose blocks behind the window are released
    full and windowed       (0, W)    two pools: the full layers', and the windowed layers'

W is the largest window of the windowed layers (a block is released once none of them sees it). Each
pool has block ids of its own; a sequence holds a block table per group (runtime/core/kv_cache.py), and a
step carries both groups' tables (runtime/backends/step.py).

A windowed sequence holds at most the blocks under its window plus one step's tokens:
ceil((W - 1 + step tokens) / block_size) + 1, never more than its whole length needs. The memory
plan prices the windowed layers by that, and the block manager reserves it when it admits a sequence,
so a windowed block is always there when a step needs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    """An engine's KV pools: each group's window (0 = full attention) and its blocks."""

    windows: tuple[int, ...] = (0,)
    num_blocks: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if len(self.windows) != len(self.num_blocks) or self.windows not in _shapes(self.windows):
            raise ValueError(f"KV groups must be (full), (windowed) or (full, windowed) with a block count each, "
                             f"got windows {self.windows} and blocks {self.num_blocks}")

    def group_of(self, window: int) -> int:
        """The group of a layer with this sliding window (0 = full attention)."""
        return 1 if len(self.windows) == 2 and window else 0


def _shapes(windows: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    widest = max(windows, default=0)
    return ((0,), (widest,), (0, widest)) if widest > 0 else ((0,),)


def group_windows(layer_windows: Iterable[int]) -> tuple[int, ...]:
    """The groups' windows for layers with these windows (0 = full attention)."""
    windows = list(layer_windows)
    widest = max(windows, default=0)
    if not widest:
        return (0,)
    return (widest,) if all(windows) else (0, widest)


def kv_blocks(budget_bytes: float, bytes_per_token: int, block_size: int) -> int:
    """KV blocks of block_size tokens that fit in budget_bytes; 0 when nothing is cached or nothing fits."""
    block_bytes = bytes_per_token * block_size
    return int(budget_bytes // block_bytes) if block_bytes and budget_bytes > 0 else 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def window_blocks_per_sequence(window: int, block_size: int, step_tokens: int, num_tokens: int) -> int:
    """The most blocks a sequence of num_tokens tokens holds at once in a group of this window, with at most
    step_tokens tokens computed in one step: the window before a step's first token, and the step's tokens."""
    return min(blocks_for(num_tokens, block_size), blocks_for(window - 1 + step_tokens, block_size) + 1)


@dataclass(frozen=True)
class PoolSizing:
    """What sizes the pools: the plan's block size and limits."""

    block_size: int
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int


def pool_blocks(budget_bytes: float, full_bytes_per_token: int, window_bytes_per_token: int,
                windows: tuple[int, ...], sizing: PoolSizing) -> tuple[int, ...]:
    """Each group's blocks that budget_bytes hold on a rank whose full and windowed layers take these bytes a
    token (0 for a group the rank has no layers of: it does not bound that pool).

    With both kinds of layers the pools hold the same number of sequences of max_seq_len at their worst, the
    windowed pool no more than max_batch_size of them (no more is ever used); the full pool has the rest."""
    bs = sizing.block_size
    if len(windows) == 1:
        return (kv_blocks(budget_bytes, full_bytes_per_token + window_bytes_per_token, bs),)
    per_sequence = window_blocks_per_sequence(windows[1], bs, sizing.max_num_tokens, sizing.max_seq_len)
    if not full_bytes_per_token:
        return 0, min(sizing.max_batch_size * per_sequence, kv_blocks(budget_bytes, window_bytes_per_token, bs))
    if not window_bytes_per_token:
        return kv_blocks(budget_bytes, full_bytes_per_token, bs), 0
    sequence_bytes = bs * (blocks_for(sizing.max_seq_len, bs) * full_bytes_per_token + per_sequence * window_bytes_per_token)
    sequences = min(sizing.max_batch_size, max(1, int(max(budget_bytes, 0) // sequence_bytes)))
    window_pool = sequences * per_sequence
    return kv_blocks(budget_bytes - window_pool * window_bytes_per_token * bs, full_bytes_per_token, bs), window_pool


def shared_pools(windows: tuple[int, ...], ranks: list[tuple[int, ...]], has_layers: list[tuple[bool, ...]]) -> KVGroups:
    """The pools every rank allocates: per group, the fewest blocks of the ranks that hold layers of it."""
    blocks = tuple(min((r[g] for r, has in zip(ranks, has_layers) if has[g]), default=0) for g in range(len(windows)))
    return KVGroups(windows, blocks)
