"""The cpu target: Kiln's C kernels on the build host's kind of CPU."""

from __future__ import annotations

from builder.pipeline import Pass, run_pipeline
from builder.quant import methods
from passes.pack_weights import LAYOUTS, pack_weights
from runtime._native import required_cpu_flags
from runtime.format import memory_plan
from runtime.format.engine_format import KV_CACHE_DTYPES

DEVICE_KIND = "cpu"
RANKS_ALONE = True
WRITES_ONNX = False        # its ranks hold Kiln programs (the IR), not ONNX
WINDOWED_POOLS = True      # the cpu backend gives sliding-window layers a KV pool of their own
KERNELS_WIDEN = True       # quantized weights stay quantized in memory and are widened inside the C kernels
FP8_ACTIVATION_SCALES = False  # fp8 weights take no calibrated activation scales
LIVE_ACTIVATIONS = memory_plan.LIVE_ACTIVATIONS
# auto (the default): every path measured at build, the serving host runs the fastest of those the accuracy gate
# allows (builder/measure/activation_choice.py, runtime/backends/activations.py); f32, or int16 / int12 / int8 (integer activations
# per token and block in int4/int8 linears): that path alone
ACTIVATIONS = ("auto", "f32", "int16", "int12", "int8")
KV_DTYPES = tuple(KV_CACHE_DTYPES)
QUANT_METHODS = methods.taking({"int8", "int4", "fp8"})


def check_plan(plan, device, fail) -> None:
    if plan.quant.activations in ("f16", "bf16"):
        fail("[quant] activations", f"{plan.quant.activations} is not a cpu kernel path; the cpu target takes "
                                    f"{' or '.join(ACTIVATIONS)}: use activations = \"auto\" (the default) or \"f32\" (exact)")


def layout_passes(plan) -> list:
    # After sharding, which slices the logical [N, K] operands; before plan_memory, which counts packed bytes.
    return [Pass("pack_weights", pack_weights, {"layouts": dict(LAYOUTS)}, per_rank=True)]


def prepare(plan, onnx_only: bool) -> None:
    return None


def run(pipeline, graph, ctx, options, onnx_only: bool):
    return run_pipeline(graph, ctx, pipeline, options), None


def requirements(plan) -> dict:
    return {"name": "cpu", "requires": {"cpu_flags": required_cpu_flags()}}
