"""One rank's memory plan: weights, activation workspace and the KV blocks the rest holds.

The one place these numbers are computed: the build's `plan_memory` pass prices a rank from its
final program, `engine-build plan` (builder/planner.py) prices candidates from a model's shape
before anything is built, and the runtime allocates the KV blocks the build recorded. So a plan
the planner calls too large is refused by the build with the same message, and the block count
the runtime allocates is the one both computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.engine_format import GIB, kv_blocks

LIVE_ACTIVATIONS = 6  # [max_num_tokens, widest] float32 activations alive at once in a step


def workspace_bytes(max_num_tokens: int, widest: int, max_batch_size: int, vocab: int) -> int:
    """A handful of [max_num_tokens, widest] float32 activations alive at once, plus the logits rows."""
    return 4 * (LIVE_ACTIVATIONS * max_num_tokens * widest + max_batch_size * vocab)


@dataclass(frozen=True)
class RankMemoryPlan:
    weight_bytes: int
    workspace_bytes: int
    kv_bytes_per_token: int   # 0 on a rank without attention layers
    memory_bytes: float       # the device memory Kiln may use
    memory_fraction: float    # share of what weights and workspace leave that goes to the KV cache
    block_size: int
    max_seq_len: int

    @property
    def free_bytes(self) -> float:
        return self.memory_bytes - self.weight_bytes - self.workspace_bytes

    @property
    def kv_blocks(self) -> int:
        if not self.kv_bytes_per_token:
            return 0
        return kv_blocks(self.free_bytes * self.memory_fraction, self.kv_bytes_per_token, self.block_size)

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_seq_len tokens the KV blocks hold at once."""
        return self.kv_blocks // self.blocks_per_sequence if self.kv_bytes_per_token else 0

    def problem(self, device: str, rank: int) -> str | None:
        """Why the plan does not fit this rank (one line naming what to change), or None when it fits."""
        gib = self.memory_bytes / GIB
        used = f"weights {self.weight_bytes / GIB:.2f} GiB + workspace {self.workspace_bytes / GIB:.2f} GiB"
        if self.free_bytes <= 0:
            return (f"plan does not fit {device} ({gib:g} GiB) on rank {rank}: {used} exceed it; quantize the "
                    f"weights, add ranks (tp or pp), or lower max_num_tokens")
        if self.kv_bytes_per_token and self.kv_blocks < self.blocks_per_sequence:
            return (f"plan does not fit {device} ({gib:g} GiB) on rank {rank}: {used} leave room for "
                    f"{self.kv_blocks} KV blocks, one sequence of max_seq_len={self.max_seq_len} needs "
                    f"{self.blocks_per_sequence}; lower max_seq_len or max_num_tokens, raise "
                    f"kv_cache.memory_fraction, quantize, or add ranks")
        return None
