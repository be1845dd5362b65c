"""Executor: the protocol LLMEngine runs its steps through, whatever runs them (one rank, many ranks, a GPU)."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.kv_groups import KVGroups
from runtime.step import StepMetadata


class KVCache(Protocol):
    num_blocks: int    # blocks of the first KV group's pool (every layer's, with one group)
    groups: KVGroups   # each KV group's window and blocks (runtime/kv_groups.py); the scheduler hands out their ids


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


# The onnxruntime backend runs a GPU plan's engine on this machine's memory: without --kv-cache-gib
# its pools hold 1 GiB, not the GPU memory plan's blocks.
ONNXRUNTIME_KV_GIB = 1.0


def kv_budget(backend: str, kv_cache_gib: float | None) -> float | None:
    return ONNXRUNTIME_KV_GIB if backend == "onnxruntime" and kv_cache_gib is None else kv_cache_gib


# The backends that give sliding-window layers a KV pool of their own (runtime/kv_groups.py); the others
# read every layer through one block table.
WINDOWED_POOLS = ("cpu",)


def kv_groups(manifest, backend: str, kv_cache_gib: float | None) -> KVGroups:
    """The KV pools an engine runs with on this backend."""
    return manifest.kv_groups(kv_budget(backend, kv_cache_gib), windowed=backend in WINDOWED_POOLS)


def create_executor(engine, rank: int, pools: KVGroups, backend: str, num_threads: int | None = None,
                    collectives: dict | None = None) -> Executor:
    """The executor of one rank of `engine` (an EngineDir) for a backend check_target accepted."""
    manifest = engine.manifest
    num_blocks = pools.num_blocks[0]
    if backend == "onnxruntime":
        from runtime.onnx_executor import OnnxExecutor

        return OnnxExecutor(engine.path / manifest.ranks[rank].onnx_dir, num_blocks, num_threads, collectives)
    if backend == "tensorrt":  # check_target refused it already where no GPU is present
        from runtime.tensorrt_executor import TensorRTExecutor, rank_device

        return TensorRTExecutor(engine.path / manifest.ranks[rank].file, manifest.tensorrt["flavour"], num_blocks,
                                collectives, rank_device(rank))
    from runtime.executor import CpuExecutor

    return CpuExecutor(engine.load_rank(rank), pools, manifest.block_size, manifest.kv_dtype,
                       collectives=collectives)
