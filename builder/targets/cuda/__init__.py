"""The cuda target: the IR as each rank's program, weights laid out for Kiln's Triton kernels, and those kernels
compiled ahead of time into cubins for the plan's GPU (runtime/backends/cuda serves it on any NVIDIA GPU of that
compute capability, Hopper included)."""

from __future__ import annotations

from builder.errors import KilnError
from builder.pipeline import Pass, run_pipeline
from builder.planning.plan import load_devices
from builder.quant import methods
from builder.targets.cuda.arches import ARCHES
from runtime.format import memory_plan

DEVICE_KIND = "gpu"
RANKS_ALONE = True  # the kernels are compiled when the ranks are assembled
WRITES_ONNX = False
WINDOWED_POOLS = False     # one pool: windowed layers read the full block table and mask by position
KERNELS_WIDEN = False
FP8_ACTIVATION_SCALES = False
LIVE_ACTIVATIONS = memory_plan.LIVE_ACTIVATIONS
ACTIVATIONS = ("bf16", "f16", "f32")
KV_DTYPES = ("bf16", "f16", "f32", "fp8")
# int5/int6/int8 blocks (a GGUF's, under "source") have no GPU kernel: the layout pass widens them to the
# activation dtype and the report says so.
QUANT_METHODS = methods.taking({"int4", "fp8"})  # no int8 GPU kernel


def check_plan(plan, device, fail) -> None:
    if device.compute_capability not in ARCHES:
        fail("device", f"{plan.device} is compute capability {device.compute_capability}; the cuda target compiles "
                       f"for {', '.join(ARCHES)}")


def layout_passes(plan) -> list:
    from builder.targets.cuda.compile import kernel_fingerprint
    from builder.targets.cuda.pack_weights import LAYOUTS, pack_cuda_weights

    # The kernels' fingerprint rides on the layout pass: other kernels (or another Triton) mean another build id,
    # so an engine whose cubins this Kiln would not compile the same is rebuilt, not reported up to date.
    return [Pass("pack_cuda_weights", pack_cuda_weights,
                 {"activations": plan.quant.activations, "layouts": dict(LAYOUTS), "kernels": kernel_fingerprint()},
                 per_rank=True)]


def prepare(plan, onnx_only: bool) -> None:
    if onnx_only:
        raise KilnError("--onnx-only: the cuda target writes no ONNX; it applies to tensorrt plans")
    from builder.targets.cuda.compile import find_triton

    find_triton()


def run(pipeline, graph, ctx, options, onnx_only: bool):
    from builder.targets.cuda.compile import kernel_writer

    graphs = run_pipeline(graph, ctx, pipeline, options)
    return graphs, kernel_writer(ctx.plan, ctx.show_progress)


def assemble(plan, show_progress: bool):
    """emit.assemble's write_shared: the kernels, compiled once the ranks built alone are all there."""
    from builder.targets.cuda.compile import shared_writer

    return shared_writer(plan, show_progress)


def requirements(plan) -> dict:
    cc = load_devices()[plan.device].compute_capability
    return {"name": "cuda", "requires": {"gpu_arch": ARCHES[cc], "compute_capability": cc}}


def verify_logits(engine, manifest):
    """`engine-build verify`'s logits through the cuda backend (its cubins on this host's GPU; elsewhere each kernel's
    torch reference, every variant first checked against it in Triton's interpreter), after checking the cubins
    cover every variant the program launches: (report lines, logits)."""
    from builder.targets.cuda.verify import cuda_logits, kernel_coverage

    coverage = kernel_coverage(engine, manifest)
    logits, lines = cuda_logits(engine, manifest)
    return [coverage, *lines], logits
