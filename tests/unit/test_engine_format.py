"""What the runtime says when a tensorrt engine meets a GPU it was not compiled for."""

from __future__ import annotations

from runtime.backends.tensorrt import gpu_mismatch
from runtime.format.engine_format import TENSORRT_RTX_TARGETS


def test_an_engine_runs_on_the_compute_capability_it_was_compiled_for():
    assert gpu_mismatch("8.9", "tensorrt-rtx", "8.9") is None
    assert gpu_mismatch("9.0", "tensorrt", "9.0") is None


def test_another_supported_gpu_is_told_to_rebuild():
    said = gpu_mismatch("8.0", "tensorrt-rtx", "8.9")
    assert "compiled for compute capability 8.0, this GPU is 8.9; rebuild" in said


def test_a_gpu_tensorrt_for_rtx_refuses_is_pointed_at_datacenter_tensorrt():
    # an H100: TensorRT-RTX 1.7 would not deserialize engines built for 8.0, 8.9 or 12.0 there
    assert "9.0" not in TENSORRT_RTX_TARGETS
    said = gpu_mismatch("8.0", "tensorrt-rtx", "9.0")
    assert "does not run on" in said and "--onnx-only" in said and "engine-build compile" in said
    # datacenter TensorRT's engines are tied to their GPU, but it builds for any: rebuilding is the answer
    assert "rebuild the engine" in gpu_mismatch("8.0", "tensorrt", "9.0")
