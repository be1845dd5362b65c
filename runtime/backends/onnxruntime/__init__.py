"""The onnxruntime backend: a tensorrt engine's ONNX run by ONNX Runtime on this host's CPU (its check and
the way to run a GPU plan's program where no GPU is)."""

from __future__ import annotations

from pathlib import Path

from runtime.format.engine_format import EngineError

TARGETS = ("tensorrt",)
WINDOWED_POOLS = False
# A GPU plan's memory plan prices the GPU's memory: on this host the pools hold 1 GiB unless told otherwise.
DEFAULT_KV_GIB = 1.0
GPU = False
DRAFTS = False
ACTIVATION_PATHS = False  # computes as the engine was built (runtime/backends/activations.py: cpu paths)


def rank_files(path: Path, manifest, entry) -> list[tuple[Path, str]]:
    return [(path / entry.onnx_dir / name, digest) for name, digest in entry.onnx_files]


def check_host(path: Path, manifest) -> None:
    if not all(r.onnx_dir for r in manifest.ranks):
        raise EngineError(f"{path}: the manifest lists no ONNX for some rank; rebuild the engine")


def create_executor(engine, rank: int, pools, num_threads: int | None = None, collectives: dict | None = None):
    from runtime.backends.onnxruntime.executor import OnnxExecutor

    return OnnxExecutor(engine.path / engine.manifest.ranks[rank].onnx_dir, pools.num_blocks[0], num_threads,
                        collectives)
