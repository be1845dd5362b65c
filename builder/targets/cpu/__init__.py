"""The cpu target: Kiln's C kernels on the build host's kind of CPU."""

from __future__ import annotations

from runtime.engine_format import KV_CACHE_DTYPES

DEVICE_KIND = "cpu"
RANKS_ALONE = True
# auto (the default): every path measured at build, the serving host runs the fastest of those the accuracy gate
# allows (builder/activation_choice.py, runtime/activations.py); f32, or int16 / int12 / int8 (integer activations
# per token and block in int4/int8 linears): that path alone
ACTIVATIONS = ("auto", "f32", "int16", "int12", "int8")
KV_DTYPES = tuple(KV_CACHE_DTYPES)
QUANT_METHODS = ("none", "source", "int8", "int4", "int4-awq", "fp8")


def check_plan(plan, device, fail) -> None:
    if plan.quant.activations in ("f16", "bf16"):
        fail("[quant] activations", f"{plan.quant.activations} is not a cpu kernel path; the cpu target takes "
                                    f"{' or '.join(ACTIVATIONS)}: use activations = \"auto\" (the default) or \"f32\" (exact)")


def layout_passes(plan) -> list:
    from builder.pipeline import Pass
    from passes.pack_weights import LAYOUTS, pack_weights

    # After sharding, which slices the logical [N, K] operands; before plan_memory, which counts packed bytes.
    return [Pass("pack_weights", pack_weights, {"layouts": dict(LAYOUTS)}, per_rank=True)]


def prepare(plan, onnx_only: bool) -> None:
    return None


def run(pipeline, graph, ctx, options, onnx_only: bool):
    from builder.pipeline import run_pipeline

    return run_pipeline(graph, ctx, pipeline, options), None


def requirements(plan) -> dict:
    from runtime._native import required_cpu_flags

    return {"name": "cpu", "requires": {"cpu_flags": required_cpu_flags()}}
