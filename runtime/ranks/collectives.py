"""Collectives between ranks: the program hooks (all_reduce, all_gather, send, recv) and the step broadcast.

The hooks run the IR's collective ops over torch.distributed: all_reduce and all_gather within the
rank's pipeline stage (its tp group), send and recv between stages by global rank. Rank 0 broadcasts
each step's metadata as two int64 tensors: a header [command, T, S, max_blocks, N, window max_blocks]
and every field packed in one tensor, so a step costs two small broadcasts whatever the batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.backends.step import StepMetadata

STOP, STEP = 0, 1
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i64": torch.int64}


class Collectives:
    """The program hooks for all_reduce / all_gather (this stage's tp ranks) and send / recv (stages).

    On CPU tensors (gloo) the tp collectives are one exchange: each rank sends its piece to every
    other tp rank and receives theirs (isend/irecv), then reduces or concatenates them in tp-rank
    order, so every rank computes the same sum. For decode-sized tensors gloo's own all_reduce costs
    several round trips (about 1.5 ms between two local processes against 0.2 ms for the exchange).
    CUDA tensors take the group's collectives (NCCL).
    """

    def __init__(self, rank: int, tp_ranks: list[int], tp_group, device: torch.device | None = None):
        self.rank, self.tp_ranks, self.tp_group = rank, tp_ranks, tp_group
        self.device = device  # where recv puts what it receives: a GPU executor's sends are CUDA tensors (NCCL)
        self.num_tokens = 0   # T and N of the running step, for the shapes of received values
        self.num_logits = 0

    def hooks(self) -> dict:
        return {"all_reduce": self.all_reduce, "all_gather": self.all_gather, "send": self.send, "recv": self.recv}

    def all_reduce(self, x: torch.Tensor, attrs: dict) -> torch.Tensor:
        x = x.contiguous()
        if x.is_cuda:
            dist.all_reduce(x, group=self.tp_group)
            return x
        pieces = self._exchange(x, [x.shape] * len(self.tp_ranks))
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total += piece
        return total

    def all_gather(self, x: torch.Tensor, attrs: dict) -> torch.Tensor:
        sizes = attrs["sizes"]  # every tp rank's width of the last dimension
        x = x.contiguous()
        if x.is_cuda:  # the collective needs equal pieces: pad to the widest, trim after
            padded = F.pad(x, (0, max(sizes) - x.shape[-1]))
            pieces = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(pieces, padded, group=self.tp_group)
            return torch.cat([p[..., :s] for p, s in zip(pieces, sizes)], dim=-1)
        return torch.cat(self._exchange(x, [(*x.shape[:-1], s) for s in sizes]), dim=-1)

    def _exchange(self, x: torch.Tensor, shapes: list[tuple]) -> list[torch.Tensor]:
        """Every tp rank's piece (this rank's is x), in tp-rank order."""
        pieces, works = [], []
        for peer, shape in zip(self.tp_ranks, shapes):
            if peer == self.rank:
                pieces.append(x)
                continue
            pieces.append(torch.empty(shape, dtype=x.dtype))
            works += [dist.isend(x, peer), dist.irecv(pieces[-1], peer)]
        for work in works:
            work.wait()
        return pieces

    def send(self, x: torch.Tensor, attrs: dict) -> None:
        dist.send(x.contiguous(), attrs["dst"])

    def recv(self, attrs: dict) -> torch.Tensor:
        sizes = {"T": self.num_tokens, "N": self.num_logits}
        out = torch.empty([sizes.get(d, d) for d in attrs["shape"]], dtype=DTYPES[attrs["dtype"]], device=self.device)
        dist.recv(out, attrs["src"])
        return out


# ---------------------------------------------------------------------- the step broadcast

_FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
           "logits_indices")


def broadcast_step(meta: StepMetadata | None, group, async_op: bool = False) -> list:
    """Rank 0: one int64 header [command, T, S, max_blocks, N, window max_blocks (-1: one KV group)], then every
    field packed in one int64 tensor (the windowed layers' slots and tables last, when the step has them).

    With async_op it returns the broadcasts' works without waiting on them: rank 0 with steps in
    flight goes on while a rank still busy with an earlier step has yet to take this one.
    """
    if meta is None:
        tensors = [torch.tensor([STOP, 0, 0, 0, 0, -1])]
    else:
        s, b = meta.block_tables.shape
        window = meta.window_block_tables
        fields = [getattr(meta, f) for f in _FIELDS]
        if window is not None:
            fields += [meta.window_slot_mapping, window]
        tensors = [torch.tensor([STEP, meta.token_ids.numel(), s, b, meta.logits_indices.numel(),
                                 -1 if window is None else window.shape[1]]),
                   torch.cat([f.reshape(-1).to(torch.int64) for f in fields])]
    works = [dist.broadcast(t, 0, group=group, async_op=async_op) for t in tensors]
    return works if async_op else []


def receive_step(group) -> StepMetadata | None:
    header = torch.empty(6, dtype=torch.int64)
    dist.broadcast(header, 0, group=group)
    command, t, s, b, n, wb = header.tolist()
    if command == STOP:
        return None
    sizes = [t, t, t, s * b, s, s + 1, n] + ([t, s * wb] if wb >= 0 else [])
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(payload, 0, group=group)
    parts = dict(zip(_FIELDS + ("window_slot_mapping", "window_block_tables"), torch.split(payload, sizes)))
    window = {} if wb < 0 else dict(window_slot_mapping=parts["window_slot_mapping"],
                                    window_block_tables=parts["window_block_tables"].view(s, wb).to(torch.int32))
    return StepMetadata(
        token_ids=parts["token_ids"], positions=parts["positions"], slot_mapping=parts["slot_mapping"],
        block_tables=parts["block_tables"].view(s, b).to(torch.int32),
        context_lens=parts["context_lens"].to(torch.int32),
        query_start_loc=parts["query_start_loc"].to(torch.int32), logits_indices=parts["logits_indices"], **window)
