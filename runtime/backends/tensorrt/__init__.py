"""The tensorrt backend: per-rank TensorRT engines on NVIDIA GPUs of the compute capability they were built for."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.backends.cuda.kernel_index import files, load
from runtime.backends.gpus import rank_device
from runtime.format.engine_format import TENSORRT_RTX_TARGETS, EngineError

TARGETS = ("tensorrt",)
WINDOWED_POOLS = False
DEFAULT_KV_GIB = None
GPU = True
DRAFTS = False
ACTIVATION_PATHS = False  # computes as the engine was built (runtime/backends/activations.py: cpu paths)
GRAPH_BATCH = 64  # decode steps of up to this many sequences replay CUDA graphs (one-rank engines)


def rank_files(path: Path, manifest, entry) -> list[tuple[Path, str]]:
    """The rank's engine (none yet after --onnx-only), and on rank 0 the plugin library and its kernels, which
    the ranks share."""
    own = [] if entry.file is None else [(path / entry.file, entry.sha256)]
    if entry.rank != 0 or manifest.trt_plugin is None or "library" not in manifest.trt_plugin:
        return own
    return own + [(path / manifest.trt_plugin["library"], manifest.trt_plugin["sha256"])] + \
        files(path, manifest.trt_kernels)


def gpu_mismatch(compiled_for: str, flavour: str, gpu: str) -> str | None:
    """Why an engine compiled by `flavour` for compute capability `compiled_for` cannot run on a GPU of
    compute capability `gpu`, with what to do instead; None when it can."""
    if gpu == compiled_for:
        return None
    if flavour == "tensorrt-rtx" and gpu not in TENSORRT_RTX_TARGETS:
        return (f"compiled by TensorRT for RTX for compute capability {compiled_for}; this GPU is {gpu}, which "
                f"TensorRT for RTX does not run on (it runs on {', '.join(TENSORRT_RTX_TARGETS)}): build the "
                "plan with --onnx-only and run `engine-build compile DIR` on this host with datacenter TensorRT")
    return f"compiled for compute capability {compiled_for}, this GPU is {gpu}; rebuild the engine for it"


def check_host(path: Path, manifest) -> None:
    """Its compiled rank files, a CUDA GPU of its compute capability and the TensorRT that compiled it."""
    if manifest.tensorrt is None or any(r.file is None for r in manifest.ranks):
        raise EngineError(f"{path}: built with --onnx-only, no TensorRT engines yet; run `engine-build compile "
                          f"{path}` on a GPU host, or --backend onnxruntime to run its ONNX on the CPU")
    if manifest.trt_plugin is None or "library" not in manifest.trt_plugin:
        raise EngineError(f"{path}: built before tensorrt engines carried Kiln's PagedAttention plugin (its KV pools "
                          "would be copied every step); rebuild it with this Kiln")
    if not torch.cuda.is_available():
        raise EngineError(f"{path}: a tensorrt engine needs an NVIDIA GPU of compute capability "
                          f"{manifest.compute_capability} and this machine has none; run its ONNX on the CPU "
                          "with --backend onnxruntime")
    major, minor = torch.cuda.get_device_capability()
    flavour, version = manifest.tensorrt["flavour"], manifest.tensorrt["version"]
    mismatch = gpu_mismatch(manifest.compute_capability, flavour, f"{major}.{minor}")
    if mismatch:
        raise EngineError(f"{path}: {mismatch}")
    module = "tensorrt" if flavour == "tensorrt" else "tensorrt_rtx_bindings"
    try:
        installed = __import__(module).__version__
    except ImportError:
        raise EngineError(f"{path}: compiled by {flavour} {version}, which is not installed here") from None
    if installed != version:
        raise EngineError(f"{path}: compiled by {flavour} {version}, this host has {installed}; rebuild the engine "
                          "or install that version")


def create_executor(engine, rank: int, pools, num_threads: int | None = None, collectives: dict | None = None):
    from runtime.backends.tensorrt.executor import TensorRTExecutor

    manifest = engine.manifest
    hooks = collectives or {}
    tp_group = getattr(hooks.get("all_reduce"), "__self__", None)  # runtime.ranks.collectives.Collectives
    one_rank = manifest.world_size == 1
    return TensorRTExecutor(engine.path / manifest.ranks[rank].file, manifest.tensorrt["flavour"], pools,
                            manifest.block_size, manifest.kv_dtype, engine.path / manifest.trt_plugin["library"],
                            load(engine.path), hooks, tp_group.tp_group if manifest.group > 1 and tp_group else None,
                            rank_device(rank), max_graph_batch=min(GRAPH_BATCH, manifest.limits.max_batch_size)
                            if one_rank else 0, device_logits=one_rank)
