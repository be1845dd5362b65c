"""Compile a rank's ONNX into one TensorRT engine, ahead of time, with no GPU needed.

Datacenter TensorRT (`import tensorrt`) is used where it is importable; otherwise TensorRT for RTX
(`import tensorrt_rtx_bindings`, PyPI tensorrt-rtx-cu13-*), which compiles for the compute
capabilities it lists (7.5, 8.0, 8.6, 8.9, 12.0, 12.1) on a machine without a CUDA device. A plan
whose GPU no installed TensorRT can target stops with one line naming what to install; `--onnx-only`
then writes the verified ONNX, and `engine-build compile DIR` finishes the build on a GPU host.

A rank's segments are joined into one ONNX model (`rank_model`): values cross segments by name, and each
collective between them becomes a graph output (its input) and a graph input (its result). TensorRT's ONNX
parser turns that model into one strongly typed network (the ONNX types are the engine's types), with every
`kiln::PagedAttention` node bound to Kiln's plugin (runtime/trt_plugin/); then each collective is put back
inside the network as TensorRT's distributed collective layer (NCCL at run time, in the activations' dtype),
and the network is built with one optimization profile from the plan's limits. A pipeline stage's recv and
send stay outside, as the engine's first input and last output.

The compile runs in a child process (compile_worker.py): TensorRT for RTX's parser needs a library path set
before the process starts (runtime/trt_plugin/__init__.py says why), and an abort inside TensorRT then costs
the build one line rather than the process.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import onnx

from builder.errors import KilnError
from runtime.format.engine_format import TENSORRT_RTX_TARGETS as RTX_TARGETS
from runtime.trt_plugin import shim_env


@dataclass(frozen=True)
class Toolchain:
    flavour: str       # "tensorrt" or "tensorrt-rtx"
    version: str
    module: object
    targets: tuple[str, ...] | None  # compute capabilities it compiles for without a GPU (None: the local GPU's)

    def record(self) -> dict:
        return {"flavour": self.flavour, "version": self.version}


def find_toolchain(compute_capability: str) -> Toolchain:
    """The installed TensorRT that can build for `compute_capability`, or a KilnError naming what to install."""
    found = []
    try:
        import tensorrt
        found.append(Toolchain("tensorrt", tensorrt.__version__, tensorrt, None))
    except ImportError:
        pass
    try:
        import tensorrt_rtx_bindings
        found.append(Toolchain("tensorrt-rtx", tensorrt_rtx_bindings.__version__, tensorrt_rtx_bindings,
                               tuple(RTX_TARGETS)))
    except ImportError:
        pass
    for chain in found:
        if chain.targets is None or compute_capability in chain.targets:
            return chain
    have = ", ".join(f"{c.flavour} {c.version}" for c in found) or "no TensorRT"
    wanted = ("TensorRT-RTX: pip install -e \".[tensorrt]\"" if compute_capability in RTX_TARGETS
              else "datacenter TensorRT (pip install tensorrt-cu13 on a host with NVIDIA's index and a GPU)")
    raise KilnError(f"tensorrt: compute capability {compute_capability} cannot be compiled here ({have} installed); "
                    f"install {wanted}, or pass --onnx-only and run `engine-build compile DIR` on a GPU host")


@dataclass(frozen=True)
class Profile:
    """The dimensions a step may have (min, opt, max), from the plan's limits."""

    max_num_tokens: int
    max_batch_size: int
    max_seq_len: int
    block_size: int
    max_blocks: int   # KV blocks a pool may hold

    def shape(self, dims: list) -> tuple[tuple, tuple, tuple]:
        bounds = {"T": (1, min(64, self.max_num_tokens), self.max_num_tokens),
                  "N": (1, min(8, self.max_batch_size), self.max_batch_size),
                  "S": (1, min(8, self.max_batch_size), self.max_batch_size),
                  "S1": (2, min(9, self.max_batch_size + 1), self.max_batch_size + 1),
                  "B": (1, 8, math.ceil(self.max_seq_len / self.block_size)),
                  "blocks": (1, self.max_blocks, self.max_blocks)}
        picks = [bounds[d] if isinstance(d, str) else (d, d, d) for d in dims]
        return tuple(tuple(p[i] for p in picks) for i in range(3))


COLLECTIVES = ("all_reduce", "all_gather")
ACTIVATION_MEMORY = re.compile(r"Total Activation Memory: (\d+) bytes")


@dataclass
class CompiledRank:
    """A rank's engine and what the build records about it."""

    engine: bytes
    seconds: float
    activation_bytes: int          # TensorRT's own figure for the engine's activation memory (its build log)
    plugin_layers: int             # kiln::PagedAttention nodes bound to the plugin
    collectives: int               # collectives inside the engine
    inputs: list[str]              # the engine's input tensors, in order
    outputs: list[str]
    aliases: dict[str, str]        # output -> the input whose buffer it is (the KV pools)

    def record(self) -> dict:
        return {"seconds": round(self.seconds, 2), "activation_bytes": self.activation_bytes,
                "plugin_layers": self.plugin_layers, "collectives": self.collectives,
                "io": {"inputs": self.inputs, "outputs": self.outputs, "aliases": self.aliases}}


def rank_model(directory: Path, doc: dict) -> tuple[onnx.ModelProto, list[dict], list[dict]]:
    """A rank's segments (program.json's doc) as one ONNX model for TensorRT; its collectives (exchange items,
    each an Identity node in the model, from its input to its output, that the compile replaces by TensorRT's
    collective); the steps the runtime runs around the engine (a pipeline stage's recv before, send after)."""
    steps = doc["steps"]
    kinds = [("segment" if "segment" in s else s["exchange"]) for s in steps]
    for position, kind in enumerate(kinds):
        if (kind == "recv" and position != 0) or (kind == "send" and position != len(kinds) - 1):
            raise KilnError(f"tensorrt: {directory}: a {kind} inside the rank's program (only a pipeline stage's "
                            "first and last step can be one); the engine cannot be one network")
    nodes, initializers, functions, opsets = [], {}, {}, {}
    inputs, outputs, infos, produced = {}, {}, {}, set()
    for step in steps:
        if step.get("exchange") in COLLECTIVES:  # a stand-in the compile replaces (compile_worker.py)
            nodes.append(onnx.helper.make_node("Identity", [step["input"]], [step["output"]],
                                               name=f"kiln.{step['exchange']}.{step['output']}"))
            produced.add(step["output"])
            continue
        if "segment" not in step:
            continue
        model = onnx.load(str(directory / step["segment"]), load_external_data=False)
        g = model.graph
        for vi in list(g.input) + list(g.output):
            infos.setdefault(vi.name, vi)
        for vi in g.input:
            if vi.name not in produced and vi.name not in inputs:
                inputs[vi.name] = vi
        nodes += list(g.node)
        produced.update(o for n in g.node for o in n.output)
        for init in g.initializer:
            initializers.setdefault(init.name, init)
        for f in model.functions:
            functions.setdefault((f.domain, f.name), f)
        for o in model.opset_import:
            opsets[o.domain] = o
        for vi in g.output:  # the KV pools after the step
            if vi.name.startswith("kv.") and vi.name.endswith(".out"):
                outputs[vi.name] = vi
    collectives = [dict(s, input_dims=_dims(infos[s["input"]])) for s in steps if s.get("exchange") in COLLECTIVES]
    around = [s for s in steps if s.get("exchange") in ("send", "recv")]
    wanted = list(doc["outputs"]) + [s["input"] for s in around if s["exchange"] == "send"]
    for item in collectives:  # the result is typed as the input, all_gather's as wide as every rank's piece
        info = onnx.ValueInfoProto()
        info.CopyFrom(infos[item["input"]])
        info.name = item["output"]
        if item["exchange"] == "all_gather":
            last = info.type.tensor_type.shape.dim[-1]
            last.Clear()
            last.dim_value = sum(item["attrs"]["sizes"])
        infos.setdefault(item["output"], info)
    for name in wanted:
        if name in produced and name not in outputs:
            outputs[name] = infos[name]
    graph = onnx.helper.make_graph(nodes, f"{directory.name}", list(inputs.values()), list(outputs.values()),
                                   initializer=list(initializers.values()))
    model = onnx.helper.make_model(graph, opset_imports=list(opsets.values()), functions=list(functions.values()),
                                   producer_name="kiln")
    model.ir_version = onnx.load(str(directory / next(s["segment"] for s in steps if "segment" in s)),
                                 load_external_data=False).ir_version
    return model, collectives, around


def compile_rank(directory: Path, chain: Toolchain, compute_capability: str, profile: Profile, tp: int,
                 plugin: Path, timing_cache: Path | None = None) -> CompiledRank:
    """One engine for the rank whose ONNX is in `directory`, compiled in a child process (compile_worker);
    timing_cache: kept between builds by datacenter TensorRT (TensorRT-RTX has none)."""
    request = {"directory": str(directory), "flavour": chain.flavour, "compute_capability": compute_capability,
               "profile": profile.__dict__, "tp": tp, "plugin": str(plugin),
               "timing_cache": str(timing_cache) if timing_cache else None}
    out = directory.parent / f".{directory.name}.engine"
    request["out"] = str(out)
    done = subprocess.run([sys.executable, "-m", "builder.targets.tensorrt.compile_worker"],
                          input=json.dumps(request), capture_output=True, text=True, env=shim_env())
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        said = json.loads(lines[-1]).get("error") if lines else None
        if not said:
            tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or [f"exit {done.returncode}"]
            said = f"TensorRT stopped ({tail[0][:300]})"
        raise KilnError(f"tensorrt: {chain.flavour} {chain.version} could not build {directory.name} for "
                        f"compute capability {compute_capability}: {said}")
    result = json.loads(lines[-1])
    engine = out.read_bytes()
    out.unlink()
    return CompiledRank(engine, result["seconds"], result["activation_bytes"], result["plugin_layers"],
                        result["collectives"], result["inputs"], result["outputs"], result["aliases"])


def logger(trt):
    """TensorRT's messages: errors kept for the one-line error (its complaint that no CUDA driver is present
    is expected when compiling ahead of time and dropped), and its activation-memory figure."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.activation_bytes: int | None = None

        def log(self, severity, message):
            found = ACTIVATION_MEMORY.search(message)
            if found:
                self.activation_bytes = int(found.group(1))
            if severity <= trt.ILogger.Severity.ERROR and "CUDA driver version is insufficient" not in message:
                self.errors.append(" ".join(message.split())[:300])

    return Logger()


def model_dims(model: onnx.ModelProto) -> dict[str, list]:
    """Each graph input's ONNX dims: ints, or the symbols the lowering uses (T, N, S, S1, B, blocks)."""
    return {vi.name: _dims(vi) for vi in model.graph.input}


def _dims(info: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in info.type.tensor_type.shape.dim]
