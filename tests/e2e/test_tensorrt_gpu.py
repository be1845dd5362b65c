"""The tensorrt backend on a GPU: TensorRT engines of a tiny Llama give the onnxruntime backend's greedy
text (f32 activations) in one process and across two rank processes, and the executor holds one context
whose KV pools are bound in place, every planned block of them.

Skipped, with the reason, on a host without a CUDA GPU, a CUDA build of torch, and a TensorRT that
builds for that GPU's compute capability. Kiln's development machines have none of these: this file
has not yet run (docs/validation.md).
"""

from __future__ import annotations

import pytest
import torch

from builder.build import build_engine
from builder.planning.plan import load_devices
from test_tensorrt import greedy, tensorrt_plan


def local_gpu_device() -> tuple[str | None, str]:
    """(the devices.toml entry of this host's GPU, or None; why not)."""
    if not torch.cuda.is_available():
        return None, "no CUDA GPU (or a CPU-only torch build)"
    major, minor = torch.cuda.get_device_capability()
    cc = f"{major}.{minor}"
    from builder.errors import KilnError
    from builder.targets.tensorrt.compile import find_toolchain

    try:
        find_toolchain(cc)
    except KilnError as exc:
        return None, str(exc)
    for name, device in load_devices().items():
        if device.compute_capability == cc:
            return name, ""
    return None, f"no device of compute capability {cc} in plans/devices.toml"


DEVICE, WHY_NOT = local_gpu_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=f"the tensorrt backend needs a GPU: {WHY_NOT}")


@pytest.mark.parametrize("tp", [1, 2])
def test_tensorrt_backend_gives_the_onnxruntime_backends_greedy_text(tiny_llama_dir, tmp_path, tp):
    if tp > torch.cuda.device_count():
        pytest.skip(f"tp={tp} needs {tp} GPUs; this host has {torch.cuda.device_count()}")
    plan = tensorrt_plan(tp=tp).with_overrides(device=DEVICE)
    engine = tmp_path / "engine"
    build_engine(str(tiny_llama_dir), plan, engine, show_progress=False)
    assert greedy(engine, "tensorrt") == greedy(engine, "onnxruntime")


def test_the_executor_binds_every_planned_block_in_place(tiny_llama_dir, tmp_path):
    from runtime.core.engine import EngineOptions
    from runtime.launcher import open_llm_engine

    plan = tensorrt_plan().with_overrides(device=DEVICE)
    engine = tmp_path / "engine"
    build_engine(str(tiny_llama_dir), plan, engine, show_progress=False)
    from runtime.backends.base import kv_groups
    from runtime.format.engine_format import Manifest

    planned = kv_groups(Manifest.read(engine), "tensorrt", 0.02).num_blocks[0]
    with open_llm_engine(engine, EngineOptions(backend="tensorrt", kv_cache_gib=0.02)) as llm:
        executor = llm.executor
        assert executor.cache.num_blocks == planned  # all of them: no second buffer per pool
        for name, pool in executor.pools.items():
            if name.endswith(".out"):
                assert pool.data_ptr() == executor.pools[name.removesuffix(".out")].data_ptr()
        assert executor.scratch.numel() >= executor.engine.device_memory_size_v2

