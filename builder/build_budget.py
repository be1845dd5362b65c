"""What a build holds in memory at its peak, priced from the model's shape before a weight is read, and the host's
memory to hold it.

A build streams (builder/lazy_tensors.py): quantizing, sharding and writing hold about one weight at a time. What
it holds beyond that is its accuracy measure (builder/accuracy.py), when the plan loses anything: the quantized
model packed for the cpu kernels (the engine's weights, for tp=1), the float reference's largest layer (a
reference over 1 GiB runs a layer at a time) or the whole reference (smaller ones), the float tables it checks
against the quantized runner's, and a window's logits. The figures are phases of a build; its peak is the
largest, with a margin. Measured against the estimate (peak RSS / estimate, this machine): SmolLM2 default 1.4 /
1.5 GiB, int8 1.9 / 2.1 GiB, int4-awq 3.0 / 3.0 GiB, the a100-tp2-int4 tensorrt plan 2.5 / 2.8 GiB; a random
Llama-3.2-1B-shaped int4 build 3.5 / 4.0 GiB, exact at tp=2 1.8 / 2.5 GiB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from builder.errors import KilnError
from builder.planner import ModelShape, bytes_per_weight
from builder.plan import Plan, load_devices
from runtime.engine_format import GIB

BASE_BYTES = GIB  # the interpreter, torch, Kiln's kernels, the traced graph and the tokenizer
MARGIN = 1.1
WINDOW_ROWS = 512  # the evaluation's windows (builder/calibration.py's WINDOW): their logits rows at once
REQUANT = ("int8", "int4", "int4-awq", "fp8")


@dataclass(frozen=True)
class BuildBudget:
    peak_bytes: int
    phase: str            # the phase that sets the peak
    measured: bool        # whether the build runs the accuracy measure

    def describe(self) -> str:
        return f"about {self.peak_bytes / GIB:.1f} GiB at its peak ({self.phase})"


def price_build(shape: ModelShape, plan: Plan, rank: int | None = None) -> BuildBudget:
    """The build's peak memory on the build host, for the whole engine or (rank) one rank built alone."""
    cpu = load_devices()["cpu"]
    q = plan.quant
    table = shape.vocab_size * shape.hidden_size * 4.0
    tables = table * (1 if shape.tie_word_embeddings else 2)
    norms = (shape.num_layers * shape.layer_norm_parameters + shape.hidden_size) * 4.0
    layer = (shape.layer_parameters() + shape.layer_norm_parameters) * 4.0
    float_model = shape.num_layers * layer + tables + shape.hidden_size * 4.0
    src = shape.source_bytes if q.method == "source" else None
    linear = src["layers"] if src else \
        shape.num_layers * shape.layer_parameters() * bytes_per_weight(_weights(q.method), cpu, q.group_size)
    quantized = linear + tables + norms  # what the measure's quantized runner holds (tables kept float)
    phases = {"streaming the weights": table + layer}  # a float table read whole, then sliced and written
    awq = q.method == "int4-awq"
    if awq:  # AWQ's and GPTQ's calibration run the float model whole, with its activations and GPTQ's Hessians
        phases["AWQ/GPTQ calibration on the float model"] = 3.5 * float_model
    elif plan.kv_cache.dtype in ("int8", "fp8") or (q.method == "fp8" and plan.target == "tensorrt"):
        phases["calibrating scales on the float model"] = 1.5 * float_model
    if plan.target == "tensorrt":  # the ONNX export, ONNX Runtime's sessions and the cpu engine that verify it
        phases["verifying the ONNX (ONNX Runtime beside the cpu engine)"] = 2.5 * float_model + quantized
    measured = (q.method in REQUANT or plan.kv_cache.dtype != "f32" or q.activations in ("int8", "int16")) \
        and rank in (None, 0)
    if measured:
        logits = 2 * WINDOW_ROWS * shape.vocab_size * 4.0
        held = quantized * (2 if awq else 1)  # GPTQ's output is kept beside the runner's packed copy
        if q.method not in REQUANT:  # the reference is the same weights, run exactly
            phases["the accuracy measure"] = held + logits
        elif float_model <= GIB:  # builder/accuracy.py's STREAM_REFERENCE_BYTES
            phases["the accuracy measure, beside the float reference"] = held + float_model + logits
        else:
            phases["the accuracy measure, the float reference a layer at a time"] = held + max(table, 2 * layer
                                                                                             + logits)
    phase = max(phases, key=phases.get)
    return BuildBudget(int(MARGIN * (BASE_BYTES + phases[phase])), phase, measured)


def _weights(method: str) -> str:
    return "int4" if method == "int4-awq" else method


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
