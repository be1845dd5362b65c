"""The tensorrt target: each rank's program as ONNX, verified under ONNX Runtime, compiled by TensorRT (or
TensorRT for RTX) into one engine file per rank for the plan's GPU (docs/tensorrt.md)."""

from __future__ import annotations

from builder.pipeline import Pass, run_pipeline
from builder.planning.plan import load_devices
from builder.quant import methods
from builder.targets.cuda.arches import ARCHES
from builder.targets.cuda.compile import kernel_fingerprint
from runtime.trt_plugin import source_digest

DEVICE_KIND = "gpu"
RANKS_ALONE = False  # its ranks' engines are checked against each other (the ONNX across ranks)
WRITES_ONNX = True         # each rank as ONNX, verified under ONNX Runtime at build (--onnx-only stops there)
WINDOWED_POOLS = False     # its executors read every layer through one block table
KERNELS_WIDEN = False
FP8_ACTIVATION_SCALES = True   # fp8 plans calibrate activation scales for TensorRT's fp8 matmuls
# A tensorrt engine's activations are TensorRT's to place. This is the planner's estimate; the build reads
# TensorRT's own figure for each engine and, where it is larger, prices the rank with it instead (fewer KV
# blocks, or the memory plan's refusal): builder/targets/tensorrt/build.py. TensorRT-RTX 1.7 reported, in
# [max_num_tokens, widest] f32 units: 2.8 and 3.1 for SmolLM2's two ranks at tp=2 (f16, 2048 tokens); 7 to 12
# for a 64-wide test model, whose fixed costs weigh more.
LIVE_ACTIVATIONS = 8
ACTIVATIONS = ("f16", "bf16", "f32")
# An fp8 cache is held as int8 pools of e4m3 bit patterns in the ONNX (float8 has no ScatterND or GatherND
# there), which the plugin's kernels read as e4m3. int8 caches are a cpu kernel path.
KV_DTYPES = ("f16", "bf16", "f32", "fp8")
QUANT_METHODS = methods.taking({"int8", "int4", "fp8"})
# fp8 plans quantize each fp8 linear's input too, with a calibrated static scale (passes/
# calibrate_fp8_activations.py), so TensorRT can choose FP8 tensor-core GEMMs.
FP8_ACTIVATIONS = True


def check_plan(plan, device, fail) -> None:
    if device.compute_capability not in ARCHES:
        fail("device", f"{plan.device} is compute capability {device.compute_capability}; the tensorrt target's "
                       f"PagedAttention plugin runs Kiln's kernels, which compile for {', '.join(ARCHES)}")


def layout_passes(plan) -> list:
    """None that changes the graph (the ONNX lowering reads the logical weights); one that records what decides
    the plugin's binary and kernels, so another plugin or kernel source means another build id."""
    return [Pass("tensorrt_plugin", _unchanged, {"plugin": source_digest(), "kernels": kernel_fingerprint()},
                 per_rank=True)]


def _unchanged(graph, ctx):
    return graph


def prepare(plan, onnx_only: bool) -> None:
    if not onnx_only:  # before any work: can it be compiled here?
        from builder.targets.tensorrt.compile import find_toolchain

        find_toolchain(load_devices()[plan.device].compute_capability)


def run(pipeline, graph, ctx, options, onnx_only: bool):
    from builder.targets.tensorrt.build import TensorRTBuild

    # The whole program before sharding is the reference each rank's ONNX is verified against.
    first = next(i for i, step in enumerate(pipeline) if step.per_rank)
    [whole] = run_pipeline(graph, ctx, pipeline[:first], options)
    graphs = run_pipeline(whole, ctx, pipeline[first:], options)
    return graphs, TensorRTBuild(ctx.plan, whole, onnx_only, ctx.model.config.vocab_size).write_ranks


def requirements(plan) -> dict:
    from builder.targets.tensorrt.build import manifest_target

    return manifest_target(plan)
