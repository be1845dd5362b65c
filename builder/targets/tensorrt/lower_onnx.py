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
from builder.ir import Graph, Node
from builder.targets.tensorrt.onnx_attention import (
    DOMAIN,
    FP8_POOL,
    SCALED_CACHES,
    paged_attention_function,
    paged_attention_node,
)
from builder.targets.tensorrt.onnx_moe import moe_function, moe_node
from builder.targets.tensorrt.plugin_kernels import layer_kernels
from runtime.ops.reference import RopeTable
from runtime.weights import fp8, int4, int5, int6, int8

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


def kv_names(layer: int) -> tuple[str, str, str, str]:
    """(k pool, v pool, k pool after the step, v pool after the step) of an attention layer."""
    return f"kv.{layer}.k", f"kv.{layer}.v", f"kv.{layer}.k.out", f"kv.{layer}.v.out"


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


class _Lowerer:
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

    def _embedding(self, node: Node) -> None:
        a = node.attrs
        table = _dequantized(node, self.graph)  # [V, H] f32
        if a.get("scale", 1.0) != 1.0:  # Gemma: rows times sqrt(hidden) in f32, as the cpu target computes them
            table = table * a["scale"]
        weight = self._float(f"{node.name}.table", table, self.act)
        tokens = node.inputs[0]
        start, vocab = a.get("vocab_start", 0), a["vocab_size"]
        out = node.outputs[0]
        if start == 0 and vocab == a.get("full_vocab_size", vocab):
            self._emit("Gather", [weight, tokens], [out], hint=node.name, axis=0)
        else:  # this rank's rows of a vocabulary split over tensor-parallel ranks; the all_reduce sums
            local = self._emit("Sub", [tokens, self._const(start)], hint=node.name)
            inside = self._emit("And", [self._emit("GreaterOrEqual", [local, self._const(0)], hint=node.name),
                                        self._emit("Less", [local, self._const(vocab)], hint=node.name)],
                                hint=node.name)
            rows = self._emit("Gather", [weight, self._emit("Clip", [local, self._const(0), self._const(vocab - 1)],
                                                            hint=node.name)], hint=node.name, axis=0)
            mask = self._emit("Cast", [self._emit("Unsqueeze", [inside, self._const([1])], hint=node.name)],
                              hint=node.name, to=self.act)
            self._emit("Mul", [rows, mask], [out], hint=node.name)
        self._define(out, self.act)

    def _linear(self, node: Node, logits: bool = False) -> None:
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        roles = dict(zip(a.get("operands", ["weight"]), node.inputs[1:]))
        quant, group = a.get("quant", "none"), a.get("group_size")
        n, k = a["out_features"], a["in_features"]
        name = node.name
        act = self.act
        if quant == "int4":
            q = self._tensor(roles["qweight"])
            codes = (q.to(torch.int16) - 8).t().contiguous().numpy().astype(np.int8)   # [K, N] in -8..7
            packed = _pack_int4(codes)
            wq = self._init(f"{name}.qweight", TensorProto.INT4, packed, (k, n))
            scales = self._float(f"{name}.scales", self._tensor(roles["scales"]), act, transpose=True)  # [K/G, N]
            weight = self._emit("DequantizeLinear", [wq, scales], hint=name, axis=0, block_size=group)
            y = self._emit("MatMul", [x, weight], hint=name)
            # + sum over groups g of (sum of x over g) * z[n, g]: the zero points, exactly, in f32.
            zeros = self._float(f"{name}.zeros", self._tensor(roles["zeros"]), TensorProto.FLOAT, transpose=True)
            grouped = self._emit("Reshape", [self._to_f32(x), self._const([0, k // group, group])], hint=name)
            sums = self._emit("ReduceSum", [grouped, self._const([2])], hint=name, keepdims=0)
            correction = self._emit("MatMul", [sums, zeros], hint=name)
            y = self._emit("Add", [y, self._to_act(correction)], hint=name)
        elif quant in ("int8", "fp8") and not (quant == "int8" and group):
            q = self._tensor(roles["qweight"])
            data_type = TensorProto.INT8 if quant == "int8" else TensorProto.FLOAT8E4M3FN
            codes = q.t().contiguous().view(torch.uint8 if quant == "fp8" else torch.int8).numpy()
            wq = self._init(f"{name}.qweight", data_type, codes.tobytes(), (k, n))
            s = self._tensor(roles["scales"]).reshape(-1)
            scales = self._float(f"{name}.scales", s if s.numel() > 1 else s.reshape(()), act)
            weight = self._emit("DequantizeLinear", [wq, scales], hint=name, **({"axis": 1} if s.numel() > 1 else {}))
            if "act_scale" in a:  # FP8 activations (passes/calibrate_fp8_activations.py): Q/DQ for an FP8 GEMM
                x_scale = self._float(f"{name}.act_scale", torch.tensor(float(a["act_scale"])), act)
                zero = f"{name}.act_zero"  # a float8 zero point: the type QuantizeLinear produces
                self.segment.initializers[zero] = helper.make_tensor(zero, TensorProto.FLOAT8E4M3FN, [], [0])
                x = self._emit("DequantizeLinear", [self._emit("QuantizeLinear", [x, x_scale, zero], hint=name),
                                                     x_scale], hint=name)
            y = self._emit("MatMul", [x, weight], hint=name)
        else:  # float, or int8 per group, int5, int6 (no TensorRT form): the dequantized weight
            weight = self._float(f"{name}.weight", _dequantized(node, self.graph), act, transpose=True)
            y = self._emit("MatMul", [x, weight], hint=name)
        if "bias" in roles:
            y = self._emit("Add", [y, self._float(f"{name}.bias", self._tensor(roles["bias"]), act)], hint=name)
        if logits:
            self._emit("Cast", [y], [out], to=TensorProto.FLOAT) if act != TensorProto.FLOAT else \
                self._emit("Identity", [y], [out])
            self._define(out, TensorProto.FLOAT)
        else:
            self._emit("Identity", [y], [out])
            self._define(out, act)

    def _logits(self, node: Node) -> None:
        self._linear(node, logits=True)

    def _norm(self, x: str, weight_name: str, eps: float, out: str, hint: str) -> None:
        xf = self._to_f32(x)
        mean = self._emit("ReduceMean", [self._emit("Mul", [xf, xf], hint=hint), self._const([-1])], hint=hint,
                          keepdims=1)
        inv = self._emit("Reciprocal", [self._emit("Sqrt", [self._emit("Add", [mean, self._const(eps, np.float32)],
                                                                         hint=hint)], hint=hint)], hint=hint)
        weight = self._float(f"{hint}.weight", self._tensor(weight_name), TensorProto.FLOAT)
        normed = self._emit("Mul", [self._emit("Mul", [xf, inv], hint=hint), weight], hint=hint)
        self._to_act(normed, [out])
        self._define(out, self.act)

    def _rms_norm(self, node: Node) -> None:
        self._norm(node.inputs[0], node.inputs[1], node.attrs["eps"], node.outputs[0], node.name)

    def _head_rms_norm(self, node: Node) -> None:
        """The norm over each head: x [T, heads * hd] as [T * heads, hd], normed, and back."""
        hd, x = node.attrs["head_dim"], node.inputs[0]
        rows = self._emit("Reshape", [x, self._const([-1, hd])], hint=node.name)
        self._define(rows, self.types[x])
        normed = f"{node.name}.heads"
        self._norm(rows, node.inputs[1], node.attrs["eps"], normed, node.name)
        self._emit("Reshape", [normed, self._emit("Shape", [x], hint=node.name)], [node.outputs[0]], hint=node.name)
        self._define(node.outputs[0], self.act)

    def _add_rms_norm(self, node: Node) -> None:
        x, residual, weight = node.inputs
        normed, total = node.outputs
        self._emit("Add", [x, residual], [total], hint=node.name)
        self._define(total, self.act)
        self._norm(total, weight, node.attrs["eps"], normed, node.name)

    def _split(self, node: Node) -> None:
        self._emit("Split", [node.inputs[0], self._const(node.attrs["sizes"])], list(node.outputs), hint=node.name,
                   axis=-1)
        for out in node.outputs:
            self._define(out, self.types[node.inputs[0]])

    def _silu_mul(self, node: Node) -> None:
        if len(node.inputs) == 1:
            width = self.graph.values[node.outputs[0]].shape[-1]
            gate, up = f"{node.name}.gate", f"{node.name}.up"
            self._emit("Split", [node.inputs[0], self._const([width, width])], [gate, up], hint=node.name, axis=-1)
        else:
            gate, up = node.inputs
        if node.attrs.get("act", "silu") == "gelu_tanh":  # Gemma's GeGLU: tanh-approximated gelu of the gate
            act = self._emit("Gelu", [gate], hint=node.name, approximate="tanh")
        else:
            act = self._emit("Mul", [gate, self._emit("Sigmoid", [gate], hint=node.name)], hint=node.name)
        self._emit("Mul", [act, up], [node.outputs[0]], hint=node.name)
        self._define(node.outputs[0], self.act)

    def _add(self, node: Node) -> None:
        self._emit("Add", list(node.inputs), [node.outputs[0]], hint=node.name)
        self._define(node.outputs[0], self.types[node.inputs[0]])

    def _gather_last(self, node: Node) -> None:
        self._emit("Gather", [node.inputs[0], "logits_indices"], [node.outputs[0]], hint=node.name, axis=0)
        self._define(node.outputs[0], self.types[node.inputs[0]])

    def _moe(self, node: Node) -> None:
        """A kiln::MoE node (builder/targets/tensorrt/onnx_moe.py): the router in f32, the held experts' weights
        stacked [El, H, 2I] and [El, I, H] in the activations' dtype (quantized experts dequantized, as the formats
        without a TensorRT form are), the shared expert's beside them."""
        from builder.experts import expert_linears

        a = node.attrs
        if a.get("act", "silu") != "silu":
            raise KilnError(f"lower_onnx: {node.name}: a mixture with the {a['act']} activation has no ONNX lowering")
        views = {view.base: view for view in expert_linears(node)}
        weight = {base: _dequantized(view, self.graph) for base, view in views.items()}  # [N, K] f32 each

        def stack(name: str, parts: list[torch.Tensor]) -> str:
            return self._float(f"{node.name}.{name}", torch.stack(parts), self.act)

        def gate_up(prefix: str) -> torch.Tensor:  # [2I, H]: stacked by fuse_gate_up, or the two projections
            if f"{prefix}.gate_up_proj" in weight:
                return weight[f"{prefix}.gate_up_proj"]
            return torch.cat([weight[f"{prefix}.gate_proj"], weight[f"{prefix}.up_proj"]])

        held = a["experts"]
        inputs = [node.inputs[0], self._float(f"{node.name}.router", weight["router"], TensorProto.FLOAT,
                                             transpose=True),
                  self._init(f"{node.name}.held", TensorProto.INT64, np.array(held, np.int64), (len(held),)),
                  stack("gate_up", [gate_up(f"experts.{e}").t() for e in held]),
                  stack("down", [weight[f"experts.{e}.down_proj"].t() for e in held])]
        shared = bool(a.get("shared", False))
        if shared:
            inputs += [self._float(f"{node.name}.shared_gate_up", gate_up("shared_expert"), self.act, transpose=True),
                       self._float(f"{node.name}.shared_down", weight["shared_expert.down_proj"], self.act,
                                   transpose=True),
                       self._float(f"{node.name}.shared_gate", weight["shared_expert_gate"], self.act, transpose=True)]
        self.segment.nodes.append(moe_node(node.name, inputs, node.outputs[0], a["top_k"], a["norm_topk_prob"],
                                           shared))
        self.segment.moe.add(shared)
        self._define(node.outputs[0], self.act)

    def _rope(self, node: Node) -> None:
        for which, out in enumerate(node.outputs):
            self.pending_rope[out] = (node, which)

    def _attention(self, node: Node) -> None:
        a = node.attrs
        q, k, v = node.inputs
        ropes = [self.pending_rope.pop(x, None) for x in (q, k)]
        if any(r is None for r in ropes) or ropes[0][0] is not ropes[1][0] or [r[1] for r in ropes] != [0, 1]:
            raise KilnError(f"lower_onnx: attention {node.name!r} must read the two outputs of one rope node")
        rope = ropes[0][0]
        table = self._rope_table(rope.attrs)
        node_kernels, variants = layer_kernels(a, self.activations, self.kv_dtype, self.block_size)
        self.kernels.update(variants)
        layer = a["layer"]
        k_in, v_in, k_out, v_out = kv_names(layer)
        scale = self._const(a.get("kv_scale", 1.0) if self.cache in SCALED_CACHES else 1.0, np.float32)
        inputs = [rope.inputs[0], rope.inputs[1], v, rope.inputs[2], table, k_in, v_in, "slot_mapping",
                  "block_tables", "context_lens", "query_start_loc", scale]
        self.segment.nodes.append(paged_attention_node(node.name, inputs, [node.outputs[0], k_out, v_out], a["scale"],
                                                      a.get("window", 0), node_kernels))
        self.segment.kv_layers.append(layer)
        self.layers[layer] = {**a, "block_size": self.block_size}
        self._define(node.outputs[0], self.act)

    def _rope_table(self, attrs: dict) -> str:
        """[max_seq_len, head_dim] f32: cos | sin of the first half by position, runtime.ops.reference.RopeTable's
        packed rows (what Kiln's rope kernel reads)."""
        scaling = attrs.get("scaling")
        key = f"rope.{attrs['head_dim']}.{attrs['theta']:g}" + (".scaled" if scaling else "")
        table = RopeTable(attrs["head_dim"], attrs["theta"], scaling)
        table.ensure(self.max_seq_len)
        return self._init(f"{key}.table", TensorProto.FLOAT, table.packed[:self.max_seq_len].contiguous().numpy(),
                          (self.max_seq_len, attrs["head_dim"]))


def _pack_int4(codes: np.ndarray) -> bytes:
    """ONNX INT4 raw data: two values a byte, the first in the low nibble."""
    flat = codes.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def _dequantized(node: Node, graph: Graph) -> torch.Tensor:
    """The node's weight [N, K] (or table [V, H]) in f32, as the cpu target's kernels compute with it."""
    a = node.attrs
    roles = dict(zip(a.get("operands", ["weight"]), node.inputs[1:]))
    quant = a.get("quant", "none")
    tensors = graph.tensors
    if quant == "none":
        return tensors[roles["weight"]].float()
    if quant == "int4":
        return int4.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]], tensors[roles["zeros"]])
    if quant == "int5":
        return int5.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]], tensors[roles["mins"]])
    if quant == "int6":
        return int6.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]])
    if quant == "int8":
        return int8.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]])
    if quant == "fp8":
        return fp8.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]])
    raise KilnError(f"lower_onnx: node {node.name!r}: weight format {quant!r} has no ONNX lowering")
