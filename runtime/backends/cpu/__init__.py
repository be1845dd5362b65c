"""The cpu backend: Kiln's C kernels run a cpu engine's ranks on this host's cores."""

from __future__ import annotations

from pathlib import Path

from runtime.backends import activations
from runtime.format.engine_format import EngineError, cpu_flags

TARGETS = ("cpu",)
WINDOWED_POOLS = True
DEFAULT_KV_GIB = None
GPU = False
DRAFTS = True  # its one-rank engines run in another engine's process as a speculative draft
ACTIVATION_PATHS = True  # runs a packed program's int4/int8 linears on any activation path (runtime/backends/activations.py)


def rank_files(path: Path, manifest, entry) -> list[tuple[Path, str]]:
    return [(path / entry.file, entry.sha256)]


def check_host(path: Path, manifest) -> None:
    missing = sorted(set(manifest.cpu_flags) - cpu_flags())
    if missing:
        raise EngineError(f"{path}: this CPU lacks {', '.join(missing)}, which the engine's kernels need; "
                          "run it on a CPU that has them")


def create_executor(engine, rank: int, pools, num_threads: int | None = None, collectives: dict | None = None):
    from runtime.backends.cpu.executor import CpuExecutor

    manifest = engine.manifest
    rank_file = engine.load_rank(rank)
    if engine.activation_choice is not None:
        rank_file = activations.rebind(rank_file, engine.activation_choice.activations)
    return CpuExecutor(rank_file, pools, manifest.block_size, manifest.kv_dtype, collectives=collectives,
                       max_seq_len=manifest.limits.max_seq_len)
