"""One rank's memory plan: weights, activation workspace and the KV blocks the rest holds.

The one place these numbers are computed: the build's `plan_memory` pass prices a rank from its
final program, `engine-build plan` (builder/planning/planner.py) prices candidates from a model's shape
before anything is built, and the runtime allocates the KV blocks the build recorded. So a plan
the planner calls too large is refused by the build with the same message, and the block count
the runtime allocates is the one both computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.format.engine_format import GIB
from runtime.format.kv_groups import PoolSizing, blocks_for, pool_blocks, window_blocks_per_sequence

LIVE_ACTIVATIONS = 6  # [max_num_tokens, widest] float32 activations alive at once in a step


def workspace_bytes(max_num_tokens: int, widest: int, max_batch_size: int, vocab: int,
                    live: int = LIVE_ACTIVATIONS) -> int:
    """`live` [max_num_tokens, widest] float32 activations alive at once (a target's LIVE_ACTIVATIONS), plus the
    logits rows."""
    return 4 * (live * max_num_tokens * widest + max_batch_size * vocab)


@dataclass(frozen=True)
class RankMemoryPlan:
    weight_bytes: int
    workspace_bytes: int
    kv_bytes_per_token: int   # 0 on a rank without attention layers
    memory_bytes: float       # the device memory Kiln may use
    memory_fraction: float    # share of what weights and workspace leave that goes to the KV cache
    block_size: int
    max_seq_len: int
    # Sliding-window layers priced by their window (runtime/format/kv_groups.py): the engine's groups, this rank's
    # windowed layers' share of kv_bytes_per_token, and the limits a windowed sequence's blocks depend on.
    windows: tuple[int, ...] = (0,)
    window_bytes_per_token: int = 0
    max_batch_size: int = 1
    max_num_tokens: int = 1

    @property
    def free_bytes(self) -> float:
        return self.memory_bytes - self.weight_bytes - self.workspace_bytes

    @property
    def pools(self) -> tuple[int, ...]:
        """Blocks of each KV group's pool (0 for a group without layers on this rank)."""
        if not self.kv_bytes_per_token:
            return (0,) * len(self.windows)
        sizing = PoolSizing(self.block_size, self.max_batch_size, self.max_num_tokens, self.max_seq_len)
        return pool_blocks(self.free_bytes * self.memory_fraction, self.kv_bytes_per_token - self.window_bytes_per_token,
                           self.window_bytes_per_token, self.windows, sizing)

    @property
    def kv_blocks(self) -> int:
        """The first pool's blocks: every layer's, the windowed layers' when all are, else the full layers'."""
        return self.pools[0]

    @property
    def kv_window_blocks(self) -> int:
        """The windowed layers' own pool beside the full layers' (0 with one pool)."""
        return self.pools[1] if len(self.windows) == 2 else 0

    @property
    def blocks_per_sequence(self) -> tuple[int, ...]:
        """Blocks one sequence of max_seq_len holds at most in each pool."""
        whole = blocks_for(self.max_seq_len, self.block_size)
        return tuple(window_blocks_per_sequence(w, self.block_size, self.max_num_tokens, self.max_seq_len) if w
                     else whole for w in self.windows)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_seq_len tokens the KV blocks hold at once."""
        if not self.kv_bytes_per_token:
            return 0
        return min(blocks // need for blocks, need, used in zip(self.pools, self.blocks_per_sequence, self.uses_pools)
                   if used)

    @property
    def uses_pools(self) -> tuple[bool, ...]:
        """Which pools this rank holds layers of."""
        if len(self.windows) == 1:
            return (self.kv_bytes_per_token > 0,)
        return self.kv_bytes_per_token > self.window_bytes_per_token, self.window_bytes_per_token > 0

    def problem(self, device: str, rank: int) -> str | None:
        """Why the plan does not fit this rank (one line naming what to change), or None when it fits."""
        gib = self.memory_bytes / GIB
        used = f"weights {self.weight_bytes / GIB:.2f} GiB + workspace {self.workspace_bytes / GIB:.2f} GiB"
        if self.free_bytes <= 0:
            return (f"plan does not fit {device} ({gib:g} GiB) on rank {rank}: {used} exceed it; quantize the "
                    f"weights, add ranks (tp or pp), or lower max_num_tokens")
        if not self.kv_bytes_per_token:
            return None
        for blocks, need, used_pool, window in zip(self.pools, self.blocks_per_sequence, self.uses_pools, self.windows):
            if used_pool and blocks < need:
                pool = f" for the {window}-token window layers" if window else ""
                return (f"plan does not fit {device} ({gib:g} GiB) on rank {rank}: {used} leave room for "
                        f"{blocks} KV blocks{pool}, one sequence of max_seq_len={self.max_seq_len} needs "
                        f"{need}; lower max_seq_len or max_num_tokens, raise kv_cache.memory_fraction, quantize, "
                        f"or add ranks")
        return None
