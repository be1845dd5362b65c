"""Executor: the protocol LLMEngine runs its steps through, whatever runs them (one rank, many ranks, a GPU)."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.step import StepMetadata


class KVCache(Protocol):
    num_blocks: int  # blocks of every attention layer's K and V; the scheduler hands out their ids


class Executor(Protocol):
    """Runs steps: `execute(meta)` returns the logits rows named by meta.logits_indices.

    One that can hold several steps at once (a multi-rank engine with pp > 1 stages) has
    max_in_flight > 1, and LLMEngine then starts steps with `submit(meta) -> handle` and takes their
    logits, in submission order, with `collect(handle)`. The logits returned stay valid until the
    executor's next step: callers sample before they step again.
    """

    max_in_flight: int = 1
    cache: KVCache

    def execute(self, meta: StepMetadata) -> torch.Tensor:
        ...

    def submit(self, meta: StepMetadata) -> object:
        """Start a step; an executor of one step at a time runs it to the end here."""
        return self.execute(meta)

    def collect(self, handle: object) -> torch.Tensor:
        """The logits of a submitted step."""
        return handle
