"""Packing a graph's logical quantized operands into the kernels' panel layout (each format's pack, by registry)."""

from __future__ import annotations

from builder.graph.experts import graph_expert_linears
from builder.graph.ir import DTYPE_NAMES, Graph, Value
from builder.sources.lazy_tensors import PartsMemo
from runtime.backends.activations import integer_activations
from runtime.weights import FORMATS


def pack_graph(graph: Graph, activations: str = "f32") -> Graph:
    """A copy of `graph` whose logical quantized nodes read packed operands (layout = the kernel's id). With lazy
    tensors (a streaming build), the packed operands are packed again from the logical ones when read, not kept."""
    out = graph.replace()
    packed: dict[tuple, tuple[list[str], list[str]]] = {}  # logical operand names -> (packed names, roles)
    memo = PartsMemo(4)
    for node in out.nodes + graph_expert_linears(out):
        attrs = node.attrs
        if attrs.get("quant", "none") == "none" or attrs.get("layout") != "logical":
            continue
        fmt = FORMATS[attrs["quant"]]
        count = len(fmt.roles)
        logical = tuple(node.inputs[1:1 + count])
        if logical not in packed:
            packed[logical] = _pack(out, attrs["quant"], attrs["group_size"], logical, memo)
        names, roles = packed[logical]
        node.inputs = [node.inputs[0], *names, *node.inputs[1 + count:]]
        node.attrs = dict(attrs, layout=fmt.layout, operands=[*roles, *attrs["operands"][count:]])
        if integer_activations(node.op, node.attrs, activations):
            node.attrs["act"] = activations
    out.drop_unused_weights()
    return out


def _pack(graph: Graph, quant: str, group_size: int | None, logical: tuple[str, ...], memo: PartsMemo):
    fmt = FORMATS[quant]
    parts = fmt.pack([graph.tensors[name] for name in logical], group_size)
    base = logical[0].removesuffix(".qweight")
    names = {role: f"{base}.{role}" for role in parts}  # the packed qweight takes the logical one's name
    if hasattr(graph.tensors, "derive_parts"):  # before the names are rebound: it reads the logical operands
        graph.tensors.derive_parts(names, list(logical), lambda *tensors: fmt.pack(list(tensors), group_size), memo)
        for role, tensor in parts.items():
            graph.weights[names[role]] = Value(names[role], DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))
    else:
        for role, tensor in parts.items():
            graph.add_weight(names[role], tensor)
    return list(names.values()), list(parts)


def plan_activations(graph: Graph, plan) -> str:
    """The activation path the program computes with: the plan's, or the one `activations = "auto"` chose
    (passes/choose_activations.py records it in the graph's meta)."""
    return graph.meta.get("activations", plan.quant.activations)
