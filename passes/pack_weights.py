"""Pack weights: rewrite logical quantized operands into the CPU kernels' panel layout (runtime.qlinear.pack_*)."""

from __future__ import annotations

from builder.ir import Graph
from passes.context import PassContext
from passes.quant_rewrite import QUANT_ROLES
from runtime import qlinear

LAYOUTS = {"int4": qlinear.LAYOUT_INT4, "int8": qlinear.LAYOUT_INT8, "fp8": qlinear.LAYOUT_FP8}


def pack_weights(graph: Graph, ctx: PassContext) -> Graph:
    # The panel layout is the cpu target's; the tensorrt target exports the logical operands (ONNX Q/DQ).
    if ctx.plan.target != "cpu":
        return graph
    return pack_graph(graph, ctx.plan.quant.activations)


def pack_graph(graph: Graph, activations: str = "f32") -> Graph:
    """A copy of `graph` whose logical quantized nodes read packed operands (layout = the kernel's id)."""
    out = graph.replace()
    packed: dict[tuple, tuple[list[str], list[str]]] = {}  # logical operand names -> (packed names, roles)
    for node in out.nodes:
        attrs = node.attrs
        if attrs.get("quant", "none") == "none" or attrs.get("layout") != "logical":
            continue
        count = len(QUANT_ROLES[attrs["quant"]])
        logical = tuple(node.inputs[1:1 + count])
        if logical not in packed:
            packed[logical] = _pack(out, attrs["quant"], attrs["group_size"], logical)
        names, roles = packed[logical]
        node.inputs = [node.inputs[0], *names, *node.inputs[1 + count:]]
        node.attrs = dict(attrs, layout=LAYOUTS[attrs["quant"]], operands=[*roles, *attrs["operands"][count:]])
        if runs_int8_activations(node.op, node.attrs, activations):
            node.attrs["act"] = "int8"
    out.drop_unused_weights()
    return out


def _pack(graph: Graph, quant: str, group_size: int | None, logical: tuple[str, ...]):
    tensors = [graph.tensors[name] for name in logical]
    if quant == "int4":
        parts = qlinear.pack_int4(*tensors, group_size)
    elif quant == "int8":
        parts = qlinear.pack_int8(*tensors, group_size)
    else:
        parts = qlinear.pack_fp8(*tensors)
    base = logical[0].removesuffix(".qweight")
    for role, tensor in parts.items():
        graph.add_weight(f"{base}.{role}", tensor)
    return [f"{base}.{role}" for role in parts], list(parts)


def runs_int8_activations(op: str, attrs: dict, activations: str) -> bool:
    """The VNNI path takes int4/int8 linears (and logits) whose input width is a multiple of 32."""
    return (activations == "int8" and op in ("linear", "logits") and attrs.get("quant") in ("int4", "int8")
            and attrs["in_features"] % 32 == 0)
