"""Lower a rank's program (the IR after sharding, logical weight layouts) to ONNX for the tensorrt target.

A rank becomes a short list of steps (`program.json`: {"steps": [...], "outputs": [...]}), run in
order over named values:

    {"segment": "segment00.onnx", "inputs": [...], "outputs": [...], "kv_layers": [0, 1]}
    {"exchange": "all_reduce" | "all_gather" | "send" | "recv", "attrs": {...}, "input": x, "output": y}

A segment is an ONNX model of the ops between two exchanges; an exchange is a collective or a
pipeline transfer the runtime performs between segments (gloo on CPU, NCCL on a GPU). Every segment
runs unchanged under ONNX Runtime and compiles into its own TensorRT engine, so a rank's model
needs no communication plugin (docs/tensorrt.md says why, and what it costs). A rank of a tp=1, pp=1
engine is one segment.

Weights are ONNX external data in one file per rank (`weights.bin`, 64-byte aligned, in the order
the segments first use them), so segments share it and nothing is loaded twice.

Quantization is what TensorRT takes (symmetric Q/DQ, DequantizeLinear feeding MatMul):

- int4 (zero points: GGUF Q4_1, Kiln's grids) is converted exactly: w = (q - 8) * s + z becomes a
  symmetric block-INT4 DequantizeLinear of q - 8 with scale s, plus a correction term, the
  group sums of x times z (a [T, K/G] x [K/G, N] MatMul in f32: 1/G of the main product's work);
- int8 per channel and fp8 (e4m3, per channel or per tensor) are weight DequantizeLinear;
- int8 per group (GGUF Q8_0), int5 (GGUF Q5_0, Q5_1, Q5_K) and int6 (GGUF Q6_K) have no TensorRT
  form: their weights are dequantized into the activation dtype (exact for f32 activations; one
  f16/bf16 rounding otherwise). So are embedding tables, which are gathered rather than multiplied.

Activations are the plan's dtype (f32, f16 or bf16); norms, softmax and rotary embedding compute
in f32; logits are f32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from builder.errors import KilnError
from builder.graph.ir import Graph, Node
from builder.targets.tensorrt.onnx_attention import (
    DOMAIN,
    FP8_POOL,
    paged_attention_function,
)
from builder.targets.tensorrt.onnx_moe import moe_function
from builder.targets.tensorrt.onnx_ops import OpLowerings, kv_names

OPSET = 21
IR_VERSION = 10
ACT_TYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
CACHE_TYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
               "fp8": FP8_POOL}  # fp8: e4m3 bit patterns in int8 pools (onnx_attention.py)
TORCH_OF = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
            TensorProto.BFLOAT16: torch.bfloat16}
EXCHANGES = ("all_reduce", "all_gather", "send", "recv")

# The step inputs a runtime feeds (beyond the program's own `tokens` and `positions`): name -> (type, dims)
STEP_INPUTS = {
    "tokens": (TensorProto.INT64, ["T"]),
    "positions": (TensorProto.INT64, ["T"]),
    "slot_mapping": (TensorProto.INT64, ["T"]),
    "block_tables": (TensorProto.INT32, ["S", "B"]),
    "context_lens": (TensorProto.INT32, ["S"]),
    "query_start_loc": (TensorProto.INT32, ["S1"]),
    "logits_indices": (TensorProto.INT64, ["N"]),
}
WEIGHTS_FILE = "weights.bin"
PROGRAM_FILE = "program.json"


@dataclass
class LoweredRank:
    directory: Path
    program: list[dict]
    files: list[str]  # relative to directory, program.json included
    kernels: dict = field(default_factory=dict)  # the plugin's kernels: variant key -> (Kernel, Variant)


class _Weights:
    """Initializers as external data in one file, written as the segments first use them."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.location = path.name
        self.protos: dict[str, TensorProto] = {}

    def add(self, name: str, data_type: int, array: np.ndarray | bytes, dims: tuple) -> TensorProto:
        if name in self.protos:
            return self.protos[name]
        raw = array if isinstance(array, bytes) else np.ascontiguousarray(array).tobytes()
        pad = -self.file.tell() % 64
        self.file.write(b"\0" * pad)
        offset = self.file.tell()
        self.file.write(raw)
        proto = TensorProto(name=name, data_type=data_type, dims=list(dims))
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(len(raw)))):
            proto.external_data.add(key=key, value=value)
        self.protos[name] = proto
        return proto

    def close(self) -> None:
        self.file.close()


@dataclass
class _Segment:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: dict[str, TensorProto] = field(default_factory=dict)
    kv_layers: list[int] = field(default_factory=list)
    defines: set[str] = field(default_factory=set)  # IR values it computes
    moe: set[bool] = field(default_factory=set)      # the kiln::MoE variants it uses (with a shared expert or not)


def lower_rank(graph: Graph, out_dir: Path, *, activations: str, kv_dtype: str, block_size: int,
               max_seq_len: int) -> LoweredRank:
    """Write `graph`'s segments, weights and program.json into out_dir (created)."""
    if activations not in ACT_TYPES:
        raise KilnError(f"tensorrt target: activations {activations!r} cannot be lowered "
                        f"(use one of {', '.join(ACT_TYPES)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = _Weights(out_dir / WEIGHTS_FILE)
    try:
        lowerer = _Lowerer(graph, weights, activations, kv_dtype, block_size, max_seq_len)
        program = lowerer.run(out_dir)
    finally:
        weights.close()
    doc = {"outputs": list(graph.outputs), "steps": program}
    (out_dir / PROGRAM_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    files = [item["segment"] for item in program if "segment" in item] + [WEIGHTS_FILE, PROGRAM_FILE]
    return LoweredRank(out_dir, program, files, lowerer.kernels)


class _Lowerer(OpLowerings):
    def __init__(self, graph: Graph, weights: _Weights, activations: str, kv_dtype: str, block_size: int,
                 max_seq_len: int):
        self.graph, self.weights = graph, weights
        self.activations, self.kv_dtype = activations, kv_dtype
        self.act, self.cache = ACT_TYPES[activations], CACHE_TYPES[kv_dtype]
        self.kernels: dict = {}  # the plugin's kernels, over every attention layer
        self.block_size, self.max_seq_len = block_size, max_seq_len
        self.layers: dict[int, dict] = {}  # attention layer -> its attrs (the KV pools' shapes)
        self.types: dict[str, int] = {name: t for name, (t, _) in STEP_INPUTS.items()}
        self.dims: dict[str, list] = {name: d for name, (_, d) in STEP_INPUTS.items()}
        self.pending_rope: dict[str, tuple[Node, int]] = {}  # rope output -> (rope node, which output)
        self.segment = _Segment()
        self.count = 0

    # ------------------------------------------------------------------ the walk

    def run(self, out_dir: Path) -> list[dict]:
        items: list[dict | _Segment] = []
        for node in self.graph.nodes:
            if node.op in EXCHANGES:
                if self.segment.nodes:
                    items.append(self.segment)
                    self.segment = _Segment()
                items.append(self._exchange(node))
                continue
            getattr(self, f"_{node.op}")(node)
            self.segment.defines.update(node.outputs)
        if self.segment.nodes:
            items.append(self.segment)
        if self.pending_rope:
            raise KilnError(f"lower_onnx: rope outputs {sorted(self.pending_rope)} are read by something other "
                            "than attention; the tensorrt target lowers rope inside kiln::PagedAttention only")
        return self._write(items, out_dir)

    def _write(self, items: list, out_dir: Path) -> list[dict]:
        """Each segment's inputs and outputs from what the items read, then the models on disk."""
        reads: list[set[str]] = []
        for item in items:
            if isinstance(item, _Segment):
                produced = {o for n in item.nodes for o in n.output}
                reads.append({i for n in item.nodes for i in n.input
                              if i and i not in produced and i not in item.initializers})
            else:
                reads.append({item["input"]} if item.get("input") else set())
        program = []
        final = set(self.graph.outputs)
        index = 0
        for position, item in enumerate(items):
            if not isinstance(item, _Segment):
                program.append(item)
                continue
            later = set().union(*reads[position + 1:], final)
            inputs = sorted(reads[position] - {kv for layer in item.kv_layers for kv in kv_names(layer)[:2]})
            outputs = sorted(item.defines & later)
            name = f"segment{index:02d}.onnx"
            index += 1
            self._save(item, inputs, outputs, out_dir / name)
            program.append({"segment": name, "inputs": inputs, "outputs": outputs, "kv_layers": item.kv_layers})
        return program

    def _save(self, segment: _Segment, inputs: list[str], outputs: list[str], path: Path) -> None:
        infos_in = [self._info(name) for name in inputs]
        infos_out = [self._info(name) for name in outputs]
        for layer in segment.kv_layers:
            k, v, k_out, v_out = kv_names(layer)
            attrs = self.layers[layer]
            dims = ["blocks", attrs["block_size"], attrs["num_kv_heads"], attrs["head_dim"]]
            infos_in += [helper.make_tensor_value_info(n, self.cache, dims) for n in (k, v)]
            infos_out += [helper.make_tensor_value_info(n, self.cache, dims) for n in (k_out, v_out)]
        graph = helper.make_graph(segment.nodes, path.stem, infos_in, infos_out,
                                  initializer=list(segment.initializers.values()))
        opsets = [helper.make_opsetid("", OPSET)]
        functions = []
        if segment.kv_layers or segment.moe:
            opsets.append(helper.make_opsetid(DOMAIN, 1))
        if segment.kv_layers:
            functions.append(paged_attention_function(self.act, self.cache))
        functions += [moe_function(self.act, shared) for shared in sorted(segment.moe)]
        model = helper.make_model(graph, opset_imports=opsets, functions=functions, producer_name="kiln")
        model.ir_version = IR_VERSION
        onnx.save_model(model, str(path))

    def _info(self, name: str) -> onnx.ValueInfoProto:
        if name not in self.types:
            raise KilnError(f"lower_onnx: value %{name} is read across a segment boundary but has no type")
        return helper.make_tensor_value_info(name, self.types[name], self.dims[name])

    # ------------------------------------------------------------------ helpers

    def _emit(self, op: str, inputs: list[str], outputs: list[str] | None = None, *, hint: str = "", **attrs) -> str:
        if outputs is None:
            self.count += 1
            outputs = [f"{hint or op.lower()}.{self.count}"]
        self.segment.nodes.append(helper.make_node(op, inputs, outputs, name=f"{hint or op}.{len(self.segment.nodes)}",
                                                   **attrs))
        return outputs[0]

    def _define(self, name: str, data_type: int, ir_name: str | None = None) -> None:
        """Record an IR value's ONNX type and dims (from the IR's shape)."""
        self.types[name] = data_type
        value = self.graph.values.get(ir_name or name)
        self.dims[name] = list(value.shape) if value is not None else ["T"]

    def _init(self, name: str, data_type: int, array: np.ndarray | bytes, dims: tuple) -> str:
        self.segment.initializers[name] = self.weights.add(name, data_type, array, dims)
        return name

    def _const(self, values, dtype=np.int64) -> str:
        array = np.asarray(values, dtype=dtype)
        name = f"const.{dtype.__name__}.{'_'.join(str(v) for v in array.reshape(-1))}"
        if name not in self.segment.initializers:
            self.segment.initializers[name] = onnx.numpy_helper.from_array(array, name)
        return name

    def _float(self, name: str, tensor: torch.Tensor, data_type: int, transpose: bool = False) -> str:
        t = tensor.float()
        t = t.t() if transpose else t
        t = t.to(TORCH_OF[data_type]).contiguous()
        raw = t.view(torch.int16).numpy().tobytes() if data_type == TensorProto.BFLOAT16 else t.numpy().tobytes()
        return self._init(name, data_type, raw, tuple(t.shape))

    def _tensor(self, name: str) -> torch.Tensor:
        return self.graph.tensors[name]

    def _to_f32(self, x: str) -> str:
        return x if self.types.get(x) == TensorProto.FLOAT else self._emit("Cast", [x], hint="cast", to=TensorProto.FLOAT)

    def _to_act(self, x: str, outputs: list[str] | None = None) -> str:
        if self.act == TensorProto.FLOAT and outputs is None:
            return x
        if self.act == TensorProto.FLOAT:
            return self._emit("Identity", [x], outputs)
        return self._emit("Cast", [x], outputs, to=self.act)

    # ------------------------------------------------------------------ exchanges

    def _exchange(self, node: Node) -> dict:
        item = {"exchange": node.op, "attrs": dict(node.attrs), "name": node.name}
        if node.inputs:
            item["input"] = node.inputs[0]
        if node.outputs:
            out = node.outputs[0]
            item["output"] = out
            source = node.inputs[0] if node.inputs else None
            self._define(out, self.types[source] if source else self.act)
        return item

    # ------------------------------------------------------------------ ops
