"""The cuda target: the IR as each rank's program, weights laid out for Kiln's Triton kernels, and those kernels
compiled ahead of time into cubins for the plan's GPU (runtime/backends/cuda serves it on any NVIDIA GPU of that
compute capability, Hopper included)."""

from __future__ import annotations

DEVICE_KIND = "gpu"
RANKS_ALONE = True  # the kernels are compiled when the ranks are assembled
ACTIVATIONS = ("bf16", "f16", "f32")
KV_DTYPES = ("bf16", "f16", "f32", "fp8")
# int5/int6/int8 blocks (a GGUF's, under "source") have no GPU kernel: the layout pass widens them to the
# activation dtype and the report says so.
QUANT_METHODS = ("none", "source", "int4", "int4-awq", "fp8")
# What Triton compiles for: compute capability -> the architecture its cubins name
ARCHES = {"8.0": "sm_80", "8.6": "sm_86", "8.9": "sm_89", "9.0": "sm_90a", "10.0": "sm_100a", "12.0": "sm_120"}


def check_plan(plan, device, fail) -> None:
    if device.compute_capability not in ARCHES:
        fail("device", f"{plan.device} is compute capability {device.compute_capability}; the cuda target compiles "
                       f"for {', '.join(ARCHES)}")


def layout_passes(plan) -> list:
    from builder.pipeline import Pass
    from builder.targets.cuda.compile import kernel_fingerprint
    from builder.targets.cuda.pack_weights import LAYOUTS, pack_cuda_weights

    # The kernels' fingerprint rides on the layout pass: other kernels (or another Triton) mean another build id,
    # so an engine whose cubins this Kiln would not compile the same is rebuilt, not reported up to date.
    return [Pass("pack_cuda_weights", pack_cuda_weights,
                 {"activations": plan.quant.activations, "layouts": dict(LAYOUTS), "kernels": kernel_fingerprint()},
                 per_rank=True)]


def prepare(plan, onnx_only: bool) -> None:
    if onnx_only:
        from builder.errors import KilnError

        raise KilnError("--onnx-only: the cuda target writes no ONNX; it applies to tensorrt plans")
    from builder.targets.cuda.compile import find_triton

    find_triton()


def run(pipeline, graph, ctx, options, onnx_only: bool):
    from builder.pipeline import run_pipeline
    from builder.targets.cuda.compile import kernel_writer

    graphs = run_pipeline(graph, ctx, pipeline, options)
    return graphs, kernel_writer(ctx.plan, ctx.show_progress)


def assemble(plan, show_progress: bool):
    """emit.assemble's write_shared: the kernels, compiled once the ranks built alone are all there."""
    from builder.targets.cuda.compile import shared_writer

    return shared_writer(plan, show_progress)


def requirements(plan) -> dict:
    from builder.plan import load_devices

    cc = load_devices()[plan.device].compute_capability
    return {"name": "cuda", "requires": {"gpu_arch": ARCHES[cc], "compute_capability": cc}}
