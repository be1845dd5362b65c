"""Kiln IR: a small SSA graph over named values, printable as text and serialisable as JSON."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import torch

from builder.graph.experts import expert_linears
from runtime.format.engine_format import DTYPE_NAMES, TORCH_DTYPES

DTYPES = tuple(TORCH_DTYPES)
SYMBOLS = ("T", "N")  # T: packed tokens of the step; N: tokens whose logits are wanted

# op -> (number of inputs (min, max), number of outputs)
OPS = {
    "embedding": ((2, 4), 1),
    "rms_norm": ((2, 2), 1),
    "head_rms_norm": ((2, 2), 1),
    "add_rms_norm": ((3, 3), 2),
    "linear": ((2, 5), 1),
    "split": ((1, 1), None),
    "rope": ((3, 3), 2),
    "attention": ((3, 3), 1),
    "silu_mul": ((1, 2), 1),
    "add": ((2, 2), 1),
    "gather_last": ((1, 1), 1),
    "logits": ((2, 5), 1),
    "all_reduce": ((1, 1), 1),
    "all_gather": ((1, 1), 1),
    "send": ((1, 1), 0),
    "recv": ((0, 0), 1),
    # x, then the weights of each linear inside (attrs["linears"]: the router, the experts', the shared expert's)
    "moe": ((2, 1 << 20), 1),
}


class IRError(ValueError):
    """An IR that breaks an invariant; the message names the value or node."""


@dataclass(frozen=True)
class Value:
    name: str
    dtype: str
    shape: tuple  # ints, the leading one may be a symbol from SYMBOLS

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    layer: int | None = None  # the transformer layer the node computes (set by the trace); None outside the layers


@dataclass
class Graph:
    """The program of one rank. Weight tensors live in `tensors`, never in the serialised IR."""

    inputs: list[Value]
    nodes: list[Node]
    outputs: list[str]
    weights: dict[str, Value]
    values: dict[str, Value]  # type of every graph input and node output
    meta: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def type_of(self, name: str) -> Value:
        if name in self.values:
            return self.values[name]
        if name in self.weights:
            return self.weights[name]
        raise IRError(f"value {name!r} is not defined")

    def replace(self, **changes) -> Graph:
        """A copy with some fields replaced; tensors are shared, structure is copied."""
        fields = dict(
            inputs=list(self.inputs), nodes=[copy.deepcopy(n) for n in self.nodes],
            outputs=list(self.outputs), weights=dict(self.weights), values=dict(self.values),
            meta=copy.deepcopy(self.meta), tensors=copy.copy(self.tensors),
        )
        fields.update(changes)
        return Graph(**fields)

    def add_weight(self, name: str, tensor: torch.Tensor) -> None:
        self.weights[name] = Value(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))
        self.tensors[name] = tensor

    def derive_weight(self, name: str, dtype: str, shape: tuple, sources: list[str], fn) -> None:
        """A weight computed as fn(*source tensors): when read, if tensors are lazy (a streaming
        build), else now."""
        self.weights[name] = Value(name, dtype, tuple(shape))
        if hasattr(self.tensors, "derive"):
            self.tensors.derive(name, sources, fn)
        else:
            self.tensors[name] = fn(*(self.tensors[s] for s in sources))

    def drop_unused_weights(self) -> None:
        used = {i for n in self.nodes for i in n.inputs}
        for name in [w for w in self.weights if w not in used]:
            del self.weights[name]
            self.tensors.pop(name, None)

    # ---------------------------------------------------------------- text and JSON

    def format(self) -> str:
        lines = ["graph(" + ", ".join(f"%{v.name}: {v}" for v in self.inputs) + ") {"]
        for w in sorted(self.weights.values(), key=lambda v: v.name):
            lines.append(f"  @{w.name}: {w}")
        for node in self.nodes:
            outs = ", ".join(f"%{o}: {self.values[o]}" for o in node.outputs if o in self.values)
            args = ", ".join(("@" if i in self.weights else "%") + i for i in node.inputs)
            attrs = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in sorted(node.attrs.items()))
            head = f"{outs} = " if outs else ""
            where = node.name if node.layer is None else f"{node.name}, layer {node.layer}"
            lines.append(f"  {head}{node.op}({args}){' {' + attrs + '}' if attrs else ''}  # {where}")
        lines.append("  return " + ", ".join("%" + o for o in self.outputs))
        lines.append("}")
        return "\n".join(lines)

    def to_json(self) -> str:
        doc = {
            "inputs": [_value_json(v) for v in self.inputs],
            "weights": [_value_json(self.weights[k]) for k in sorted(self.weights)],
            "nodes": [
                {"name": n.name, "op": n.op, "inputs": n.inputs, "outputs": n.outputs, "layer": n.layer,
                 "attrs": n.attrs, "types": [_value_json(self.values[o]) for o in n.outputs]}
                for n in self.nodes
            ],
            "outputs": self.outputs,
            "meta": self.meta,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Graph:
        doc = json.loads(text)
        inputs = [_value_from_json(v) for v in doc["inputs"]]
        weights = {w["name"]: _value_from_json(w) for w in doc["weights"]}
        values = {v.name: v for v in inputs}
        nodes = []
        for n in doc["nodes"]:
            # Programs written before nodes carried their layer have no "layer" key.
            nodes.append(Node(n["name"], n["op"], list(n["inputs"]), list(n["outputs"]), dict(n["attrs"]),
                              n.get("layer")))
            values.update((t["name"], _value_from_json(t)) for t in n["types"])
        return Graph(inputs, nodes, list(doc["outputs"]), weights, values, doc["meta"])


def _fmt_attr(v) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list, str)) or v is None else str(v)


def _value_json(v: Value) -> dict:
    return {"name": v.name, "dtype": v.dtype, "shape": list(v.shape)}


def _value_from_json(d: dict) -> Value:
    return Value(d["name"], d["dtype"], tuple(d["shape"]))


# -------------------------------------------------------------------- verification

def verify(graph: Graph) -> None:
    """Check dtypes, shapes and single definition before use; raise IRError naming the node."""
    defined: set[str] = set()
    for v in graph.inputs:
        _check_value(v)
        if v.name in defined:
            raise IRError(f"graph input %{v.name} is defined twice")
        defined.add(v.name)
    for w in graph.weights.values():
        _check_value(w)
        if any(isinstance(d, str) for d in w.shape):
            raise IRError(f"weight @{w.name} has a symbolic shape {w.shape}")
        if w.name in defined:
            raise IRError(f"weight @{w.name} has the name of a graph input")
    for node in graph.nodes:
        where = f"node {node.name!r} ({node.op})"
        if node.op not in OPS:
            raise IRError(f"{where}: unknown op")
        (lo, hi), n_out = OPS[node.op]
        if not lo <= len(node.inputs) <= hi:
            raise IRError(f"{where}: takes {lo}..{hi} inputs, got {len(node.inputs)}")
        if n_out is not None and len(node.outputs) != n_out:
            raise IRError(f"{where}: gives {n_out} outputs, got {len(node.outputs)}")
        for name in node.inputs:
            if name not in defined and name not in graph.weights:
                raise IRError(f"{where}: uses %{name} before it is defined")
        for name in node.outputs:
            if name in defined or name in graph.weights:
                raise IRError(f"{where}: %{name} is defined twice")
            if name not in graph.values:
                raise IRError(f"{where}: output %{name} has no type")
            _check_value(graph.values[name])
            defined.add(name)
        _check_shapes(graph, node, where)
    for name in graph.outputs:
        if name not in defined:
            raise IRError(f"graph output %{name} is never defined")


def _check_value(v: Value) -> None:
    if v.dtype not in DTYPES:
        raise IRError(f"%{v.name}: unknown dtype {v.dtype!r}")
    for i, d in enumerate(v.shape):
        if isinstance(d, str) and (i != 0 or d not in SYMBOLS):
            raise IRError(f"%{v.name}: dimension {i} is {d!r}; only the leading one may be symbolic {SYMBOLS}")
        if isinstance(d, int) and d < 0:
            raise IRError(f"%{v.name}: negative dimension {d}")


def _check_shapes(graph: Graph, node: Node, where: str) -> None:
    """Shape rules for the ops whose output shape follows from their inputs."""
    ins = [graph.type_of(i) for i in node.inputs]
    outs = [graph.values[o] for o in node.outputs]

    def expect(cond: bool, what: str) -> None:
        if not cond:
            got = ", ".join(f"%{v.name}: {v}" for v in ins + outs)
            raise IRError(f"{where}: shape mismatch: {what} (got {got})")

    op = node.op
    if op in ("rms_norm", "add_rms_norm"):
        x, w = ins[0], ins[-1]
        expect(w.shape == (x.shape[-1],), "norm weight must be [hidden]")
        expect(all(o.shape == x.shape for o in outs), "outputs must have the input's shape")
        if op == "add_rms_norm":
            expect(ins[1].shape == x.shape, "residual must have the input's shape")
    elif op in ("linear", "logits"):
        x, out = ins[0], outs[0]
        k, n = node.attrs.get("in_features"), node.attrs.get("out_features")
        expect(x.shape[-1] == k, f"input features must be in_features={k}")
        expect(out.shape == (*x.shape[:-1], n), f"output must be [{x.shape[0]}, out_features={n}]")
        if node.attrs.get("quant", "none") == "none":
            expect(ins[1].shape == (n, k), f"float weight must be [{n}, {k}]")
        else:
            _check_logical_operands(node, ins[1:], n, k, expect)
    elif op == "add":
        expect(ins[0].shape == ins[1].shape == outs[0].shape, "add needs equal shapes")
    elif op == "split":
        sizes = node.attrs.get("sizes", [])
        expect(len(sizes) == len(outs) and sum(sizes) == ins[0].shape[-1], "sizes must cover the last dim")
        expect(all(o.shape == (*ins[0].shape[:-1], s) for o, s in zip(outs, sizes)), "split outputs")
    elif op == "silu_mul":
        width = ins[0].shape[-1] // (2 if len(ins) == 1 else 1)
        expect(all(i.shape == ins[0].shape for i in ins), "gate and up must match")
        expect(outs[0].shape == (*ins[0].shape[:-1], width), "silu_mul output width")
    elif op == "head_rms_norm":
        hd = node.attrs["head_dim"]
        expect(ins[1].shape == (hd,) and ins[0].shape[-1] % hd == 0, f"head_rms_norm weight [{hd}] on whole heads")
        expect(outs[0].shape == ins[0].shape, "head_rms_norm keeps its input's shape")
    elif op == "rope":
        expect(outs[0].shape == ins[0].shape and outs[1].shape == ins[1].shape, "rope keeps q/k shapes")
        expect(ins[2].shape == (ins[0].shape[0],), "positions must be [T]")
    elif op == "attention":
        a = node.attrs
        expect(ins[0].shape[-1] == a["num_heads"] * a["head_dim"], "q width = num_heads * head_dim")
        expect(ins[1].shape[-1] == ins[2].shape[-1] == a["num_kv_heads"] * a["head_dim"],
               "k/v width = num_kv_heads * head_dim")
        expect(outs[0].shape == ins[0].shape, "attention output has q's shape")
    elif op == "embedding":
        expect(ins[0].dtype in ("i64", "i32") and len(ins[0].shape) == 1, "tokens must be integer [T]")
        if node.attrs.get("quant", "none") != "none":
            _check_logical_operands(node, ins[1:], node.attrs["vocab_size"], node.attrs["hidden_size"], expect)
        expect(outs[0].shape == (ins[0].shape[0], node.attrs["hidden_size"]), "embedding output [T, hidden]")
    elif op == "gather_last":
        expect(outs[0].shape[1:] == ins[0].shape[1:], "gather_last keeps the row width")
    elif op == "moe":
        expect(outs[0].shape == ins[0].shape, "moe output has its input's shape")
        views = expert_linears(node)
        expect(sum(len(v.attrs["operands"]) for v in views) == len(ins) - 1, "the linears' operands are its inputs")
        for view in views:
            n, k = view.attrs["out_features"], view.attrs["in_features"]
            operands = [graph.type_of(i) for i in view.inputs[1:]]
            if view.attrs.get("quant", "none") == "none":
                expect(operands[0].shape == (n, k), f"{view.name}: float weight must be [{n}, {k}]")
            else:
                _check_logical_operands(view, operands, n, k, expect)


# Logical quantized operands (before pack_weights gives them the kernels' layout): role -> dtypes
LOGICAL_DTYPES = {"int8": {"qweight": ("i8",)}, "int4": {"qweight": ("u8",)}, "int5": {"qweight": ("u8",)},
                  "int6": {"qweight": ("u8",)}, "fp8": {"qweight": ("f8e4m3",)}}


def _check_logical_operands(node: Node, operands: list[Value], n: int, k: int, expect) -> None:
    """qweight [N, K]; scales (and zeros or mins) f32 [N] per channel or [N, K/G] per group; bias f32 [N]."""
    a = node.attrs
    if a.get("layout") != "logical":
        return  # packed: runtime.ops.linear checks its own layouts when it binds the node
    expect(a.get("quant") in LOGICAL_DTYPES, f"quant must be one of {sorted(LOGICAL_DTYPES)}")
    group = a.get("group_size")
    expect(group is None or (group > 0 and k % group == 0), f"group_size {group} must divide in_features {k}")
    per_group = (n,) if group is None else (n, k // group)
    roles = a.get("operands", [])
    expect(len(roles) == len(operands), "operands must name every weight input")
    for role, value in zip(roles, operands):
        if role == "qweight":
            expect(value.shape == (n, k) and value.dtype in LOGICAL_DTYPES[a["quant"]]["qweight"],
                   f"qweight must be {LOGICAL_DTYPES[a['quant']]['qweight'][0]} [{n}, {k}]")
        elif role in ("scales", "zeros", "mins"):
            expect(value.dtype == "f32" and value.shape == per_group, f"{role} must be f32 {list(per_group)}")
        elif role == "bias":
            expect(value.shape == (n,), f"bias must be [{n}]")
