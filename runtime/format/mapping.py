"""Mapping: which rank holds which layers, attention heads, MLP columns and vocabulary rows.

Ranks are numbered pipeline-stage-major: rank = pp_rank * tp + tp_rank, so the tp ranks of one stage
are neighbours (TensorRT-LLM's convention). Every answer is a pure function of (tp, pp, rank) and
the model's sizes, so each rank computes its own share and all ranks agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A contiguous share [start, start + count) of some dimension."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class HeadShare:
    """The query and KV heads one tensor-parallel rank computes (contiguous; KV heads may be replicated)."""

    q: Span
    kv: Span


def even_split(total: int, parts: int, index: int) -> Span:
    """Part `index` of `total` split into `parts` contiguous pieces, the first ones one larger."""
    base, extra = divmod(total, parts)
    return Span(index * base + min(index, extra), base + (index < extra))


@dataclass(frozen=True)
class Mapping:
    tp: int = 1
    pp: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for key in ("tp", "pp"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank}: must be in [0, {self.world_size}) for tp={self.tp} x pp={self.pp}")

    # ------------------------------------------------------------------ ranks

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    def tp_group(self) -> list[int]:
        """The ranks of this rank's pipeline stage, which split its layers' tensors between them."""
        return [self.pp_rank * self.tp + t for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        """Every pipeline stage's ranks, in stage order."""
        return [Mapping(self.tp, self.pp, p * self.tp).tp_group() for p in range(self.pp)]

    def pp_group(self) -> list[int]:
        """The ranks holding the same tensor share in every stage, in stage order."""
        return [p * self.tp + self.tp_rank for p in range(self.pp)]

    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp - 1

    def prev_pp_rank(self) -> int:
        """The rank this one receives hidden states from (same tp_rank, previous stage)."""
        return self.rank - self.tp

    def next_pp_rank(self) -> int:
        """The rank this one sends hidden states to (same tp_rank, next stage)."""
        return self.rank + self.tp

    # ------------------------------------------------------------------ layers

    def pp_layers(self, num_layers: int, layer_costs: Sequence[float] | None = None,
                  first_cost: float = 0.0, last_cost: float = 0.0) -> range:
        """The layers of this rank's stage: contiguous, at least one per stage, stage costs balanced.

        `layer_costs[i]` prices layer i; `first_cost` and `last_cost` price what the first and last
        stage hold besides layers (embedding; final norm and logits). Without costs layers count equally.
        """
        if self.pp > num_layers:
            raise ValueError(f"pp={self.pp}: more stages than the model's {num_layers} layers; "
                             f"use pp <= {num_layers}")
        costs = list(layer_costs) if layer_costs is not None else [1.0] * num_layers
        if len(costs) != num_layers:
            raise ValueError(f"pp_layers: {len(costs)} layer costs for {num_layers} layers")
        bounds = balanced_stages(costs, self.pp, first_cost, last_cost)
        return range(bounds[self.pp_rank], bounds[self.pp_rank + 1])

    # ------------------------------------------------------------------ tensor shares

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> HeadShare:
        """This rank's heads: whole KV groups split as evenly as possible, or, with more ranks than
        KV heads, one (replicated) KV head per rank and its group's query heads split among the
        ranks that share it. 9 query / 3 KV heads on 2 ranks: 6 + 3 query, 2 + 1 KV heads."""
        if self.tp > num_heads:
            raise ValueError(f"tp={self.tp}: more ranks than the model's {num_heads} attention heads; "
                             f"use tp <= {num_heads}")
        group = num_heads // num_kv_heads
        if self.tp <= num_kv_heads:
            kv = even_split(num_kv_heads, self.tp, self.tp_rank)
            return HeadShare(Span(kv.start * group, kv.count * group), kv)
        # Ranks per KV head: even_split of the ranks over the KV heads; find the head of this rank.
        for head in range(num_kv_heads):
            ranks = even_split(self.tp, num_kv_heads, head)
            if ranks.start <= self.tp_rank < ranks.stop:
                q = even_split(group, ranks.count, self.tp_rank - ranks.start)
                return HeadShare(Span(head * group + q.start, q.count), Span(head, 1))
        raise AssertionError("unreachable: every tp rank maps to a KV head")

    def columns(self, size: int, what: str) -> Span:
        """This rank's share of a dimension split by tensor parallelism (MLP columns, vocabulary rows)."""
        if self.tp > size:
            raise ValueError(f"tp={self.tp}: more ranks than the model's {what} ({size})")
        return even_split(size, self.tp, self.tp_rank)

    def column_sizes(self, size: int) -> list[int]:
        """Every tp rank's share of `size`, in tp-rank order (for all_gather of uneven pieces)."""
        return [even_split(size, self.tp, t).count for t in range(self.tp)]

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "rank": self.rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank}


def balanced_stages(costs: list[float], stages: int, first_cost: float = 0.0, last_cost: float = 0.0) -> list[int]:
    """Stage bounds [0, b1, ..., len(costs)] of a contiguous split minimising the costliest stage
    (ties: the smallest sum of squared stage costs, i.e. the most even), each stage non-empty."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(k: int, i: int, j: int) -> float:
        extra = (first_cost if k == 0 else 0.0) + (last_cost if k == stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = (float("inf"), float("inf"))
    # best[k][j]: (max, sum of squares) of splitting the first j layers into k + 1 stages; cut[k][j]: start of stage k
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        c = stage_cost(0, 0, j)
        best[0][j] = (c, c * c)
    for k in range(1, stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                prev = best[k - 1][i]
                c = stage_cost(k, i, j)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    bounds = [n]
    for k in range(stages - 1, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.append(0)
    return bounds[::-1]
