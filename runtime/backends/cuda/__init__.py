"""The cuda backend: a cuda engine's ranks on NVIDIA GPUs, with Kiln's Triton kernels compiled into the engine.

The serving host needs no compiler: cubins are loaded and launched through the CUDA driver (cuda-python). A
host without a GPU can still run an engine here for tests with KILN_CUDA_INTERPRET=1: the same kernels then
run in Triton's interpreter on CPU tensors (slowly), which is how CI runs this backend end to end.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.backends.gpus import rank_device
from runtime.format.engine_format import EngineError

TARGETS = ("cuda",)
WINDOWED_POOLS = False   # one pool: windowed layers read the full block table and mask by position
GRAPH_BATCH = int(os.environ.get("KILN_CUDA_GRAPH_BATCH", "256"))  # decode steps up to this size replay graphs
DRAFTS = False
ACTIVATION_PATHS = False  # computes as the engine was built (runtime/backends/activations.py: cpu paths)


def __getattr__(name: str):
    """INTERPRET, GPU and DEFAULT_KV_GIB follow KILN_CUDA_INTERPRET when read, not when this module loaded."""
    interpret = os.environ.get("KILN_CUDA_INTERPRET") == "1"
    if name == "INTERPRET":
        return interpret
    if name == "GPU":
        return torch.cuda.is_available() and not interpret
    if name == "DEFAULT_KV_GIB":  # a GPU's pools: the build's memory plan; the interpreter's are host memory
        return None if torch.cuda.is_available() and not interpret else 0.25
    raise AttributeError(name)


def rank_files(path: Path, manifest, entry) -> list[tuple[Path, str]]:
    from runtime.backends.cuda.kernel_index import files

    kernels = files(path, manifest.cuda) if manifest.cuda and entry.rank == 0 else []  # the ranks share them
    return [(path / entry.file, entry.sha256)] + kernels


def check_host(path: Path, manifest) -> None:
    """A GPU of the compute capability the kernels were compiled for, or the interpreter when asked for."""
    if manifest.cuda is None:
        raise EngineError(f"{path}: the manifest has no cuda section (compiled kernels); rebuild the engine")
    compiled = manifest.cuda["compute_capability"]
    if os.environ.get("KILN_CUDA_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise EngineError("KILN_CUDA_INTERPRET=1 runs the kernels in Triton's interpreter, and triton is not "
                              "installed: pip install 'kiln[gpu]'") from None
        return
    if not torch.cuda.is_available():
        raise EngineError(f"{path}: a cuda engine needs an NVIDIA GPU of compute capability {compiled} and this "
                          "machine has none (KILN_CUDA_INTERPRET=1 runs its kernels in Triton's interpreter on the "
                          "CPU, for tests: very slow)")
    major, minor = torch.cuda.get_device_capability()
    if f"{major}.{minor}" != compiled:
        raise EngineError(f"{path}: its kernels are compiled for compute capability {compiled} "
                          f"({manifest.cuda['arch']}) and this GPU is {major}.{minor}; rebuild it for this GPU with "
                          f"a plan whose device is {major}.{minor} (`engine-build build --plan ... --force`)")
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        raise EngineError("the cuda backend launches its kernels with cuda-python, which is not installed: "
                          "pip install 'kiln[gpu]'") from None


def create_executor(engine, rank: int, pools, num_threads: int | None = None, collectives: dict | None = None):
    from runtime.backends.cuda.executor import CudaExecutor
    from runtime.backends.cuda.kernel_index import load
    from runtime.backends.cuda.launch import CubinLauncher, InterpreterLauncher

    manifest = engine.manifest
    compiled = load(engine.path)
    if torch.cuda.is_available() and os.environ.get("KILN_CUDA_INTERPRET") != "1":
        launcher = CubinLauncher(compiled, rank_device(rank))
    else:
        launcher = InterpreterLauncher(allowed=set(compiled))  # the engine's variants only, as on a GPU
    max_batch = min(GRAPH_BATCH, manifest.limits.max_batch_size) if manifest.world_size == 1 else 0
    return CudaExecutor(engine.load_rank(rank), pools, manifest.block_size, manifest.kv_dtype, manifest.activations,
                        manifest.limits.max_seq_len, launcher, collectives, max_graph_batch=max_batch,
                        device_logits=manifest.world_size == 1)
