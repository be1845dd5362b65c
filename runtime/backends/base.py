"""Executor: the protocol LLMEngine runs its steps through, whatever runs them (one rank, many ranks, a GPU)."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.backends import activations
from runtime.backends import backend as backend_module
from runtime.backends.step import StepMetadata
from runtime.format.kv_groups import KVGroups


class KVCache(Protocol):
    num_blocks: int    # blocks of the first KV group's pool (every layer's, with one group)
    groups: KVGroups   # each KV group's window and blocks (runtime/format/kv_groups.py); the scheduler hands out their ids


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


def kv_groups(manifest, backend: str, kv_cache_gib: float | None) -> KVGroups:
    """The KV pools an engine runs with on this backend (runtime/backends: its default budget and whether it
    gives sliding-window layers a pool of their own)."""
    module = backend_module(backend)
    budget = module.DEFAULT_KV_GIB if kv_cache_gib is None else kv_cache_gib
    return manifest.kv_groups(budget, windowed=module.WINDOWED_POOLS)


def create_executor(engine, rank: int, pools: KVGroups, backend: str, num_threads: int | None = None,
                    collectives: dict | None = None) -> Executor:
    """The executor of one rank of `engine` (an EngineDir) for a backend check_target accepted."""
    return backend_module(backend).create_executor(engine, rank, pools, num_threads, collectives)


def for_host(engine, backend: str, requested: str | None = None):
    """`engine` (an EngineDir) with the activation path this host runs it with on `backend`
    (runtime/backends/activations.py: the fastest the build allowed, or `requested`)."""
    return activations.for_host(engine, backend_module(backend), requested)
