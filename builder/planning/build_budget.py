"""What a build holds in memory at its peak and how long it takes, priced from the model's shape before a weight is
read, and the host's memory to hold it.

A build streams (builder/sources/lazy_tensors.py): quantizing, sharding and writing hold about one weight at a time, and
calibration a layer at a time (builder/measure/calibration.py's LayerSweep: a layer's float weights, and for int4-awq GPTQ's
codes so far and its widest Hessian). What it holds beyond that is its accuracy measure (builder/measure/accuracy.py), when
the plan loses anything: the quantized model packed for the cpu kernels (the engine's weights, for tp=1), the float
reference's largest layer (a reference over 1 GiB runs a layer at a time) or the whole reference (smaller ones), the
float tables it checks against the quantized runner's, and a window's logits. A quantized model over 1 GiB runs a
layer at a time too, its packed weights mapped from a scratch folder: it then holds a layer, the float table and the
logits. The figures are phases of a build; its peak is the largest, with a margin. Measured against the estimate
(peak RSS / estimate, this machine, benchmarks/bench_builds.py): SmolLM2 default 1.4 / 1.5 GiB, int8 1.8 / 2.1 GiB,
int4-awq 1.9 / 2.1 GiB, the a100-tp2-int4 tensorrt plan 2.7 / 2.7 GiB; a random Llama-3.2-1B-shaped int4 build
2.5 / 2.7 GiB, fp8 2.4 / 2.7 GiB, int4-awq 4.2 / 4.2 GiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from builder.errors import KilnError
from builder.quant import methods
from builder.targets import target
from builder.planning.planner import ModelShape, bytes_per_weight
from builder.planning.plan import Plan, load_devices
from runtime.format.engine_format import GIB

BASE_BYTES = GIB  # the interpreter, torch, Kiln's kernels, the traced graph and the tokenizer
MARGIN = 1.1
WINDOW_ROWS = 512  # the evaluation's windows (builder/measure/calibration.py's WINDOW): their logits rows at once
REQUANT = tuple(methods.REQUANTIZING)


# Seconds a parameter (of the whole model) costs each part of a build on the host Kiln is developed on (2 cores),
# fitted to benchmarks/bench_builds.py's builds there (docs/building.md, "Memory and time"); like the planner's
# efficiencies, a calibration of one machine: expect them within a factor of about 1.5 on another 2-core host, and
# fewer seconds with more cores.
START_SECONDS = 5.0   # the interpreter, torch, the trace and the tokenizer
STREAM_NS = 27.0      # read from the checkpoint, laid out and written (a float build: Llama-1B exact, tp=2)
ROUND_NS = 50.0       # rounded to nearest (int4/int8/fp8) and its error measured, then rounded again when written
ROUND_ALONE_NS = 18.0 # rounded only when written, no error measured: a rank built alone (8B, rank 3 of 8)
MEASURE_NS = 140.0    # the accuracy measure: reference and quantized model over the evaluation (Llama-1B int4)
AWQ_GPTQ_NS = 700.0   # AWQ's searches and GPTQ's grids and rounding, a linear weight (SmolLM2 and Llama-1B int4-awq)
HESSIAN_NS = 0.016    # GPTQ's Hessian of an input K wide (its product, Cholesky factors and inverse): times K^3
TENSORRT_NS = 200.0   # ONNX export, ONNX Runtime's verification and TensorRT's compile (SmolLM2 a100-tp2-int4)


@dataclass(frozen=True)
class BuildBudget:
    peak_bytes: int
    phase: str            # the phase that sets the peak
    measured: bool        # whether the build runs the accuracy measure
    seconds: float = 0.0  # wall time on a 2-core host like Kiln's

    def describe(self) -> str:
        return f"about {self.peak_bytes / GIB:.1f} GiB at its peak ({self.phase}), {duration(self.seconds)}"


def duration(seconds: float) -> str:
    """About how long, in the unit a person would say it (seconds under two minutes, minutes under an hour and a
    half, then hours)."""
    if seconds < 120:
        return f"about {max(5, round(seconds / 5) * 5):.0f} s"
    if seconds < 5400:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


def price_build(shape: ModelShape, plan: Plan, rank: int | None = None) -> BuildBudget:
    """The build's peak memory on the build host, for the whole engine or (rank) one rank built alone."""
    cpu = load_devices()["cpu"]
    q = plan.quant
    table = shape.vocab_size * shape.hidden_size * 4.0
    tables = table * (1 if shape.tie_word_embeddings else 2)
    norms = (shape.num_layers * shape.layer_norm_parameters + shape.hidden_size) * 4.0
    layer = (shape.mean_layer_parameters + shape.layer_norm_parameters) * 4.0
    float_model = 4.0 * _parameters(shape)
    src = shape.source_bytes if q.method == "source" else None
    linear = src["layers"] if src else \
        shape.num_layers * shape.mean_layer_parameters * bytes_per_weight(_weights(q.method), cpu, q.group_size)
    quantized = linear + tables + norms  # what the measure's quantized runner holds (tables kept float)
    phases = {"streaming the weights": table + layer}  # a float table read whole, then sliced and written
    awq = methods.method(q.method).calibrated
    # GPTQ's codes, held two a byte with their groups' scales and zero points until they are written
    codes = shape.num_layers * shape.mean_layer_parameters * (0.5 + 8.0 / q.group_size) if awq else 0.0
    # Calibration runs a layer at a time (builder/measure/calibration.py's LayerSweep): the first stage reads the float
    # table (and the last binds it for the head); later ones a layer's float weights, a few copies of it, and GPTQ's
    # Hessian of the widest input (K x K doubles, two at once)
    sweep = table + layer
    if awq:  # the table's stages beside GPTQ's codes measured at twice the table (Llama-1B: 4.2 GiB peak RSS)
        hessian = 2 * 8.0 * max(shape.hidden_size, shape.intermediate_size) ** 2
        phases["AWQ/GPTQ calibration, a layer at a time"] = codes + max(table + sweep, 3 * layer + hessian)
    elif plan.kv_cache.dtype in ("int8", "fp8") or (q.method == "fp8" and target(plan.target).FP8_ACTIVATION_SCALES):
        phases["calibrating scales, a layer at a time"] = sweep
    if target(plan.target).WRITES_ONNX:  # the ONNX export, ONNX Runtime's sessions and the cpu engine that verify it
        phases["verifying the ONNX (ONNX Runtime beside the cpu engine)"] = 2.5 * float_model + quantized
    # auto measures its paths where some linear has integer ones (int4/int8 weights: not none, not fp8)
    paths = q.activations in ("int8", "int16", "int12") or (q.activations == "auto" and q.method not in ("none", "fp8"))
    measured = (q.method in REQUANT or plan.kv_cache.dtype != "f32" or paths) and rank in (None, 0)
    if measured:
        logits = 2 * WINDOW_ROWS * shape.vocab_size * 4.0
        # builder/measure/accuracy.py's STREAM_BYTES: a larger quantized model runs a layer at a time too, mapped from a
        # scratch folder (its float table mapped while a stage reads it), and so does a larger float reference
        streamed = max(table, 2 * layer) + logits
        if quantized > GIB:
            phases["the accuracy measure, a layer at a time"] = codes + streamed
        elif q.method not in REQUANT:  # the reference is the same weights, run exactly
            phases["the accuracy measure"] = codes + quantized + logits
        elif float_model <= GIB:
            phases["the accuracy measure, beside the float reference"] = codes + quantized + float_model + logits
        else:
            phases["the accuracy measure, the float reference a layer at a time"] = codes + quantized + streamed
    phase = max(phases, key=phases.get)
    return BuildBudget(int(MARGIN * (BASE_BYTES + phases[phase])), phase, measured,
                       _seconds(shape, plan, rank, measured))


def _seconds(shape: ModelShape, plan: Plan, rank: int | None, measured: bool) -> float:
    """The build's wall time from the fitted costs a parameter (see STREAM_NS)."""
    q = plan.quant
    params = _parameters(shape)
    written = params / (plan.world_size if rank is not None else 1)
    ns = STREAM_NS * written
    if q.method in REQUANT and rank in (None, 0):
        ns += ROUND_NS * params
    elif q.method in REQUANT:  # a rank alone: its stage's weights, each rounded whole before it is sliced
        ns += ROUND_ALONE_NS * params / plan.pp
    if measured:  # activations = "auto" measures each path (f32, int16, int12, int8) and times it
        ns += MEASURE_NS * params * (4 if q.activations == "auto" and q.method not in ("none", "fp8") else 1)
    if methods.method(q.method).calibrated:  # every rank's job: a layer's codes depend on the layers rounded before it
        inputs = 3 * shape.hidden_size ** 3 + shape.intermediate_size ** 3  # q/k/v, o, gate/up, down (o: heads wide)
        ns += AWQ_GPTQ_NS * shape.num_layers * shape.mean_layer_parameters + HESSIAN_NS * shape.num_layers * inputs
    if target(plan.target).WRITES_ONNX:
        ns += TENSORRT_NS * params
    return START_SECONDS + ns / 1e9


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
GLIBC_MMAP_CEILING = 32 << 20  # where glibc's moving mmap threshold stops rising (64-bit); it keeps twice that free


@contextlib.contextmanager
def freed_memory_given_back(large: bool):
    """While the accuracy measure of a large model runs (one over 1 GiB, run a layer at a time): each tensor over
    128 KiB in its own mapping, returned to the system when freed. glibc raises that threshold (up to 32 MiB)
    whenever such a block is freed, after which tensors up to that size are carved from the heap, whose freed
    pieces stay in the process: a random Llama-3.2-1B-shaped int4 build peaked at 3.5 GiB with the moving
    threshold and 2.5 GiB with it fixed, for 20-30% more time (a float reference read a layer at a time
    gets fresh pages for every layer it converts). Elsewhere fresh pages cost more than they save (SmolLM2's GPTQ
    took 3 times as long), so afterwards both thresholds are where a build's moving ones end up anyway (setting
    one stops glibc moving either). A C library without mallopt is left as it is."""
    def thresholds(mmap: int, trim: int) -> None:
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt(M_MMAP_THRESHOLD, mmap)
            libc.mallopt(M_TRIM_THRESHOLD, trim)
        except (OSError, AttributeError):
            pass

    if large:
        thresholds(128 << 10, 128 << 10)
    try:
        yield
    finally:
        if large:
            thresholds(GLIBC_MMAP_CEILING, 2 * GLIBC_MMAP_CEILING)


def _parameters(shape: ModelShape) -> int:
    """The model's parameters: its layers (norms included), its tables and the final norm."""
    tables = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return shape.num_layers * (shape.mean_layer_parameters + shape.layer_norm_parameters) + tables + shape.hidden_size


def _weights(method: str) -> str:
    return methods.REQUANTIZING.get(method, method)


def available_memory() -> int | None:
    """Bytes this process may still use: the kernel's MemAvailable, or a cgroup's limit less its usage if smaller
    (None where neither can be read)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_host(shape: ModelShape, plan: Plan, rank: int | None) -> None:
    """A KilnError in one line, naming the ways out, when this host has less memory available than the build
    needs. KILN_BUILD_MEMORY_CHECK=0 skips the check."""
    budget = price_build(shape, plan, rank)
    if os.environ.get("KILN_BUILD_MEMORY_CHECK") == "0":
        return
    available = available_memory()
    if available is None or budget.peak_bytes <= available:
        return
    ways = []
    if budget.measured and plan.world_size > 1 and rank is None:
        alone = price_build(shape, plan, 1)
        ways.append(f"build the ranks one at a time with --rank: ranks 1 to {plan.world_size - 1} need "
                    f"{alone.describe()}, rank 0 measures accuracy and needs as much as this")
    if budget.measured:
        ways.append("--quant source or none with --kv-dtype f32 (nothing to measure)")
    ways.append("a build host with more memory (KILN_BUILD_MEMORY_CHECK=0 tries anyway)")
    raise KilnError(f"this build needs {budget.describe()} and this host has {available / GIB:.1f} GiB available: "
                    + "; or ".join(ways))
