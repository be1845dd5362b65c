"""The tensorrt target: each rank's program as ONNX, verified under ONNX Runtime, compiled by TensorRT (or
TensorRT for RTX) into one engine file per rank for the plan's GPU (docs/tensorrt.md)."""

from __future__ import annotations

DEVICE_KIND = "gpu"
ACTIVATIONS = ("f16", "bf16", "f32")
# An fp8 cache waits for the PagedAttention plugin: the node's reference body gathers keys with GatherND and
# ScatterND, which ONNX (opset 21) does not define for float8. int8 caches are a cpu kernel path.
KV_DTYPES = ("f16", "bf16", "f32")
QUANT_METHODS = ("none", "source", "int8", "int4", "int4-awq", "fp8")


def check_plan(plan, device, fail) -> None:
    if plan.kv_cache.dtype == "fp8":
        fail("[kv_cache] dtype", "fp8 cannot be built for the tensorrt target (its reference attention body has "
                                 "no float8 form in ONNX until the PagedAttention plugin lands); it takes "
                                 f"{', '.join(KV_DTYPES)}: use dtype = \"f16\"")


def layout_passes(plan) -> list:
    return []  # the ONNX lowering reads the logical weights


def prepare(plan, onnx_only: bool) -> None:
    if not onnx_only:  # before any work: can it be compiled here?
        from builder.plan import load_devices
        from builder.targets.tensorrt.compile import find_toolchain

        find_toolchain(load_devices()[plan.device].compute_capability)


def run(pipeline, graph, ctx, options, onnx_only: bool):
    from builder.pipeline import run_pipeline
    from builder.targets.tensorrt.build import TensorRTBuild

    # The whole program before sharding is the reference each rank's ONNX is verified against.
    first = next(i for i, step in enumerate(pipeline) if step.per_rank)
    [whole] = run_pipeline(graph, ctx, pipeline[:first], options)
    graphs = run_pipeline(whole, ctx, pipeline[first:], options)
    return graphs, TensorRTBuild(ctx.plan, whole, onnx_only, ctx.model.config.vocab_size).write_ranks


def requirements(plan) -> dict:
    from builder.targets.tensorrt.build import manifest_target

    return manifest_target(plan)
