"""Pack cuda weights: lay each linear's weights out for the cuda backend's kernels (int4 nibbles, fp8 as is,
floats in the activation dtype); formats without a GPU kernel are widened to the activation dtype."""

from __future__ import annotations

import torch

from builder.errors import KilnError
from builder.graph.experts import graph_expert_linears
from builder.graph.ir import DTYPE_NAMES, Graph
from passes.context import PassContext
from runtime.backends.cuda.kernels.gemm import GROUP_SIZES, INT4_LAYOUT, pack_int4
from runtime.weights import fp8, int4, int5, int6, int8

FP8_LAYOUT = "f8e4m3.nk"
LAYOUTS = {"int4": INT4_LAYOUT, "fp8": FP8_LAYOUT}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
WIDENED = {  # format -> (roles, f32 dequantization of the logical operands)
    "int4": (("qweight", "scales", "zeros"), int4.dequantize),
    "int5": (("qweight", "scales", "mins"), int5.dequantize),
    "int6": (("qweight", "scales"), int6.dequantize),
    "int8": (("qweight", "scales"), int8.dequantize),
    "fp8": (("qweight", "scales"), fp8.dequantize),
}


def pack_cuda_weights(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    act = ctx.plan.quant.activations
    dtype = DTYPES[act]
    made: dict[tuple, tuple[list[str], dict]] = {}   # the operands a node read -> what it reads now, shared
    widened = []
    for node in out.nodes + graph_expert_linears(out):
        if node.op not in ("linear", "logits", "embedding", "moe_linear"):
            continue
        a = node.attrs
        quant = a.get("quant", "none")
        roles = a.get("operands", ["weight"])
        count = len(roles) - ("bias" in roles)
        sources = tuple(node.inputs[1:1 + count])
        if quant == "none":
            kind = ("float",)
        elif a.get("layout") != "logical":
            raise KilnError(f"pack_cuda_weights: node {node.name!r} has {quant} weights already packed "
                            f"({a.get('layout')}); the cuda target reads logical operands")
        elif node.op == "moe_linear" and quant == "int4" and a.get("group_size") not in GROUP_SIZES:
            kind = ("widen", quant)  # the experts' kernel reads int4 in gemm's group sizes
            widened.append(node.name)
        elif node.op != "embedding" and quant == "int4" and a["in_features"] % 2 == 0:
            kind = ("int4",)
        elif node.op != "embedding" and quant == "fp8":
            kind = ("fp8",)
        else:
            kind = ("widen", quant)
            widened.append(node.name)
        key = (*kind, sources)
        if key not in made:
            made[key] = _rewrite(out, kind, sources, dtype, act)
        names, attrs = made[key]
        node.inputs = [node.inputs[0], *names, *node.inputs[1 + count:]]
        bias = ["bias"] if "bias" in roles else []
        node.attrs = {k: v for k, v in a.items() if k not in ("layout", "operands", "quant", "group_size")}
        node.attrs.update(attrs)
        node.attrs["operands"] = [*node.attrs["operands"], *bias]
    out.drop_unused_weights()
    out.meta["cuda_weights"] = {"activations": act, "widened": widened}
    return out


def _rewrite(graph: Graph, kind: tuple, sources: tuple, dtype: torch.dtype, act: str) -> tuple[list[str], dict]:
    """New weights for one set of operands: (their names, the node attrs that describe them)."""
    if kind[0] == "float":
        [name] = sources
        if graph.weights[name].dtype == act:
            return [name], {"quant": "none", "operands": ["weight"]}
        new = f"{name}.{act}"
        graph.derive_weight(new, act, graph.weights[name].shape, [name], lambda w: w.to(dtype))
        return [new], {"quant": "none", "operands": ["weight"]}
    if kind[0] == "int4":
        q, scales, zeros = sources
        n, k = graph.weights[q].shape
        packed = q.removesuffix(".qweight") + ".q4nk2"
        graph.derive_weight(packed, "u8", (n, k // 2), [q], pack_int4)
        group = k // graph.weights[scales].shape[1]
        return [packed, scales, zeros], {"quant": "int4", "layout": INT4_LAYOUT, "group_size": group,
                                         "operands": ["qweight", "scales", "zeros"]}
    if kind[0] == "fp8":
        return list(sources), {"quant": "fp8", "layout": FP8_LAYOUT, "operands": ["qweight", "scales"]}
    roles, dequantize = WIDENED[kind[1]]
    if len(sources) != len(roles):
        raise KilnError(f"pack_cuda_weights: {kind[1]} operands {list(sources)} are not {list(roles)}")
    base = sources[0].removesuffix(".qweight")
    new = f"{base}.{act}"
    shape = graph.weights[sources[0]].shape
    graph.derive_weight(new, DTYPE_NAMES[dtype], shape, list(sources), lambda *t: dequantize(*t).to(dtype))
    return [new], {"quant": "none", "operands": ["weight"]}
