"""Decode steps as CUDA graphs: the counterpart of the cpu backend's step replay.

A decode step (every sequence one new token, each with a logits row) of S sequences runs padded to the smallest
captured batch size B >= S: the step is copied into that size's static device buffers, the padding rows write
no KV (slot -1) and attend over nothing (context 0), and the graph captured for B is replayed; the first S
logits rows are the step's. On a GPU each size is captured once, on first use; where there is no GPU (the
interpreter) the same buffers and padding run the program eagerly, so the bookkeeping is what CI tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from runtime.backends.cuda.step import DeviceStep
from runtime.backends.step import StepMetadata


def graph_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


# The DeviceStep buffers a decode step fills (query_start_loc and logits_indices stay 0..B)
STEP_BUFFERS = ("token_ids", "positions", "slot_mapping", "context_lens", "block_tables")


@dataclass
class Captured:
    step: object                   # DeviceStep: the static buffers the graph reads
    host: object                   # its host mirror (pinned), filled on the CPU and copied in one transfer a buffer;
                                   # the step itself where the device is the host
    output: torch.Tensor | None    # [B, V]: the graph's logits buffer
    graph: object | None           # torch.cuda.CUDAGraph, None where steps run eagerly
    replays: int = 0


class DecodeGraphs:
    def __init__(self, executor, max_batch: int, max_blocks: int):
        self.executor, self.max_blocks = executor, max_blocks
        self.sizes = graph_sizes(max_batch)
        self.captured: dict[int, Captured] = {}
        self.capture = executor.device.type == "cuda"
        # One memory pool for every size's graph: they replay one at a time and each step's logits are sampled
        # before the next, so their activations may share memory (a graph per size would otherwise keep its own).
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def takes(self, meta: StepMetadata) -> bool:
        """A decode step this runner covers: one token and one logits row per sequence, within the sizes."""
        s = meta.context_lens.numel()
        return (0 < s <= self.sizes[-1] and meta.token_ids.numel() == s and meta.logits_indices.numel() == s
                and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, meta: StepMetadata) -> torch.Tensor:
        s = meta.context_lens.numel()
        size = next(b for b in self.sizes if b >= s)
        entry = self.captured.get(size) or self._make(size)
        self._load(entry.host, meta)
        if entry.host is not entry.step:
            for name in STEP_BUFFERS:
                getattr(entry.step, name).copy_(getattr(entry.host, name), non_blocking=True)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.output = self.executor.run(entry.step)
        entry.replays += 1
        return entry.output[:s]

    def _make(self, size: int) -> Captured:

        device = self.executor.device
        ints = lambda n, dtype=torch.int32: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
        step = DeviceStep(ints(size, torch.int64), ints(size), ints(size) - 1,
                          torch.full((size, self.max_blocks), -1, dtype=torch.int32, device=device), ints(size),
                          torch.arange(size + 1, dtype=torch.int32, device=device),
                          torch.arange(size, dtype=torch.int64, device=device), 1)
        host = step
        if self.capture:
            host = dataclasses.replace(step, **{name: getattr(step, name).cpu().pin_memory() for name in STEP_BUFFERS})
        entry = Captured(step, host, None, None)
        if self.capture:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up outside capture: first launches load modules, allocate
                self.executor.run(step)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                entry.output = self.executor.run(step)
            entry.graph = graph
        self.captured[size] = entry
        return entry

    @staticmethod
    def _load(step, meta: StepMetadata) -> None:
        """Write a decode step into host-side buffers of the static shapes; rows past it become padding."""
        s, width = meta.context_lens.numel(), meta.block_tables.shape[1]
        step.token_ids[:s], step.token_ids[s:] = meta.token_ids, 0
        step.positions[:s], step.positions[s:] = meta.positions, 0
        step.slot_mapping[:s], step.slot_mapping[s:] = meta.slot_mapping, -1
        step.context_lens[:s], step.context_lens[s:] = meta.context_lens, 0
        step.block_tables.fill_(-1)
        step.block_tables[:s, :width] = meta.block_tables
